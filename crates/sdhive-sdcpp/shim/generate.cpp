// Runs stable-diffusion.cpp's generate_image so that it can be stopped between two denoising steps, and so that
// no C++ exception ever unwinds into Rust.
//
// sd.cpp has no cancellation entry point in the version diffusion-rs-sys vendors, but it reports every step
// through the process-wide progress callback, from its own C++ sampling loop, whose state lives in RAII objects
// (tensors, graph and buffer guards). The trampoline below asks Rust whether to go on and, when told to stop,
// throws; the exception unwinds sd.cpp's frames, which release what they hold, and is caught here. The runner's
// compute buffer may stay reserved until the next generation, which reuses or grows it.
//
// Only the two C functions used are declared, with opaque argument types, so that no header (and no struct layout)
// of sd.cpp is compiled in here.

#include <cstddef>
#include <cstring>
#include <exception>
#include <new>

extern "C" {
struct sd_ctx_t;
struct sd_img_gen_params_t;
struct sd_image_t;
typedef void (*sd_progress_cb_t)(int step, int steps, float time, void* data);
sd_image_t* generate_image(sd_ctx_t* sd_ctx, const sd_img_gen_params_t* params);
void sd_set_progress_callback(sd_progress_cb_t cb, void* data);

// Called at each step; returns 0 to stop the generation, anything else to go on. Must not unwind.
typedef int (*sdhive_progress_fn)(int step, int steps, void* data);
}

namespace {

// Thrown to leave sd.cpp's sampling loop; never escapes this file.
struct StopRequested {};

struct Progress {
    sdhive_progress_fn report;
    void* data;
};

void on_progress(int step, int steps, float /*time*/, void* data) {
    const Progress* progress = static_cast<const Progress*>(data);
    if (progress != nullptr && progress->report != nullptr && progress->report(step, steps, progress->data) == 0) {
        throw StopRequested{};
    }
}

// Registered outside generations: swallows load-time progress, which sd.cpp would otherwise print on stdout.
void quiet(int, int, float, void*) {}

void copy_message(char* out, std::size_t capacity, const char* message) {
    if (out == nullptr || capacity == 0) {
        return;
    }
    std::strncpy(out, message, capacity - 1);
    out[capacity - 1] = '\0';
}

}  // namespace

extern "C" {

enum {
    SDHIVE_GENERATED = 0,
    SDHIVE_STOPPED = 1,
    SDHIVE_EXCEPTION = 2,
};

// Installs the quiet progress callback; called before sd.cpp loads anything.
void sdhive_quiet_progress(void) { sd_set_progress_callback(quiet, nullptr); }

// generate_image with `report` consulted at every step. On SDHIVE_GENERATED `*images` is what generate_image
// returned (null when it failed on its own); otherwise `*images` is null and `message` names the exception.
// The process-wide progress callback is the quiet one again when this returns.
int sdhive_generate_image(sd_ctx_t* ctx,
                          const sd_img_gen_params_t* params,
                          sdhive_progress_fn report,
                          void* data,
                          sd_image_t** images,
                          char* message,
                          std::size_t message_capacity) {
    Progress progress{report, data};
    *images = nullptr;
    copy_message(message, message_capacity, "");
    int outcome = SDHIVE_GENERATED;
    sd_set_progress_callback(on_progress, &progress);
    try {
        *images = generate_image(ctx, params);
    } catch (const StopRequested&) {
        outcome = SDHIVE_STOPPED;
    } catch (const std::bad_alloc&) {
        copy_message(message, message_capacity, "out of host memory (std::bad_alloc)");
        outcome = SDHIVE_EXCEPTION;
    } catch (const std::exception& e) {
        copy_message(message, message_capacity, e.what());
        outcome = SDHIVE_EXCEPTION;
    } catch (...) {
        copy_message(message, message_capacity, "an exception that is not a std::exception");
        outcome = SDHIVE_EXCEPTION;
    }
    sd_set_progress_callback(quiet, nullptr);
    return outcome;
}

}  // extern "C"
