//! stable-diffusion.cpp reports through process-wide C callbacks: its log lines go to `tracing` (target
//! `sdcpp`), and its progress reaches the closure of the one generation running — or nowhere, so that nothing
//! is ever printed on stdout, which carries the CLI's output. A generation runs through the C++ shim
//! (shim/generate.cpp), which stops sd.cpp's sampling loop at the next step once the closure says so and keeps
//! C++ exceptions from unwinding into Rust. One generation at a time per process is enforced here, since the
//! callback slot is global.

use diffusion_rs_sys as sys;
use std::ffi::{c_void, CStr};
use std::os::raw::{c_char, c_int};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, MutexGuard, Once};

static INSTALL: Once = Once::new();
static GENERATION: Mutex<()> = Mutex::new(());

/// The shim's outcomes (shim/generate.cpp).
const GENERATED: c_int = 0;
const STOPPED: c_int = 1;

type ReportFn = unsafe extern "C" fn(step: c_int, steps: c_int, data: *mut c_void) -> c_int;

extern "C" {
    fn sdhive_quiet_progress();
    fn sdhive_generate_image(
        ctx: *mut sys::sd_ctx_t,
        params: *const sys::sd_img_gen_params_t,
        report: ReportFn,
        data: *mut c_void,
        images: *mut *mut sys::sd_image_t,
        message: *mut c_char,
        message_capacity: usize,
    ) -> c_int;
}

/// Routes logs to tracing and silences progress; idempotent.
pub fn install() {
    INSTALL.call_once(|| {
        // SAFETY: the log callback is an `extern "C"` function valid for the whole process and ignores its null
        // data; the shim's quiet progress callback takes no data.
        unsafe {
            sys::sd_set_log_callback(Some(on_log), std::ptr::null_mut());
            sdhive_quiet_progress();
        }
    });
}

unsafe extern "C" fn on_log(level: sys::sd_log_level_t, text: *const c_char, _data: *mut c_void) {
    if text.is_null() {
        return;
    }
    // SAFETY: sd.cpp passes a NUL-terminated message valid for the duration of the call.
    let message = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    let message = message.trim_end();
    match level {
        sys::sd_log_level_t::SD_LOG_ERROR => tracing::error!(target: "sdcpp", "{message}"),
        sys::sd_log_level_t::SD_LOG_WARN => tracing::warn!(target: "sdcpp", "{message}"),
        sys::sd_log_level_t::SD_LOG_INFO => tracing::info!(target: "sdcpp", "{message}"),
        _ => tracing::debug!(target: "sdcpp", "{message}"),
    }
}

/// How one `generate_image` call ended.
#[derive(Debug)]
pub enum Generated {
    /// What generate_image returned: null when it failed on its own (its log says why).
    Images(*mut sys::sd_image_t),
    /// The progress closure asked to stop; sd.cpp was left between two steps.
    Stopped,
    /// sd.cpp threw; the message is the exception's.
    Threw(String),
}

/// Called with (step, steps) at each denoising step; returns whether to go on.
type Report<'a> = &'a mut dyn FnMut(u32, u32) -> bool;

/// Which of sd.cpp's progress reports are denoising steps. The same callback carries weight loads (tensors read /
/// tensors to read: sd.cpp loads weights lazily on first use, and a load runs worker threads that an unwind must
/// not cross) and the VAE's tiles. Each sequence announces itself with (0, total); sampling then reports (1, total),
/// (2, total), … one by one, from its own thread between two model calls, while a load polls its counter every
/// 200 ms and skips numbers. A report is taken as a step when it is the next number of an announced sequence; the
/// first sequence to reach its total ends the image's steps (the VAE's tiles come after). A hires fix samples twice:
/// then a second sequence counts too, one whose total is within one of the second pass's expected steps (sd.cpp
/// derives it from the strength with float rounding), so the VAE's or the upscaler's tiles between the passes do not.
#[derive(Debug, Default)]
struct Steps {
    /// (total, reached so far) per announced total.
    announced: Vec<(c_int, c_int)>,
    finished: bool,
    /// The hires second pass's expected steps, until the first pass ends.
    second: Option<c_int>,
    /// While the second pass runs: its expected steps.
    in_second: Option<c_int>,
}

impl Steps {
    fn new(second: Option<u32>) -> Steps {
        Steps { second: second.map(|s| s as c_int), ..Steps::default() }
    }

    fn is_step(&mut self, step: c_int, total: c_int) -> bool {
        if self.finished || total <= 0 {
            return false;
        }
        if self.in_second.is_some_and(|expected| (total - expected).abs() > 1) {
            return false;
        }
        let entry = self.announced.iter_mut().find(|(t, _)| *t == total);
        match (step, entry) {
            (0, None) => {
                self.announced.push((total, 0));
                false
            }
            (0, Some(_)) | (_, None) => false,
            (_, Some((_, reached))) => {
                if step != *reached + 1 {
                    return false;
                }
                *reached = step;
                if step == total {
                    match self.second.take() {
                        Some(expected) => {
                            self.announced.clear();
                            self.in_second = Some(expected);
                        }
                        None => self.finished = true,
                    }
                }
                true
            }
        }
    }
}

struct Reporting<'a> {
    report: Report<'a>,
    steps: Steps,
}

unsafe extern "C" fn on_progress(step: c_int, steps: c_int, data: *mut c_void) -> c_int {
    if data.is_null() {
        return 1;
    }
    // SAFETY: `data` is the `Reporting` that `generate` passed and keeps alive (and exclusively borrowed) for the
    // call; sd.cpp calls back on the thread that called generate_image.
    let reporting = unsafe { &mut *(data as *mut Reporting<'_>) };
    if !reporting.steps.is_step(step, steps) {
        return 1;
    }
    // A panic must not unwind into C++; treat it as a request to stop.
    let go_on =
        catch_unwind(AssertUnwindSafe(|| (reporting.report)(step as u32, steps as u32))).unwrap_or(false);
    c_int::from(go_on)
}

/// Runs sd.cpp's generate_image with `report` consulted at each step (of both passes when `second_pass`, a hires
/// fix's expected second-pass steps, is given), holding the process-wide generation lock.
///
/// # Safety
/// `ctx` is a live sd.cpp context used by no other thread, and every pointer in `params` is valid for the call.
pub unsafe fn generate(
    ctx: *mut sys::sd_ctx_t,
    params: &sys::sd_img_gen_params_t,
    second_pass: Option<u32>,
    report: Report<'_>,
) -> Generated {
    install();
    let _guard: MutexGuard<'_, ()> = GENERATION.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let mut images = std::ptr::null_mut();
    let mut message = [0 as c_char; 512];
    let mut reporting = Reporting { report, steps: Steps::new(second_pass) };
    // SAFETY: the caller vouches for `ctx` and `params`; `reporting` outlives the call and is only used on this
    // thread during it; `images` and `message` are writable for the sizes given.
    let outcome = unsafe {
        sdhive_generate_image(
            ctx,
            params,
            on_progress,
            (&mut reporting as *mut Reporting<'_>).cast(),
            &mut images,
            message.as_mut_ptr(),
            message.len(),
        )
    };
    match outcome {
        GENERATED => Generated::Images(images),
        STOPPED => Generated::Stopped,
        // SAFETY: the shim always leaves a NUL-terminated string in `message`.
        _ => Generated::Threw(unsafe { CStr::from_ptr(message.as_ptr()) }.to_string_lossy().into_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::Steps;

    /// The reports taken as denoising steps.
    fn steps_of(reports: &[(i32, i32)]) -> Vec<(i32, i32)> {
        steps_with(reports, None)
    }

    fn steps_with(reports: &[(i32, i32)], second: Option<u32>) -> Vec<(i32, i32)> {
        let mut steps = Steps::new(second);
        reports.iter().copied().filter(|&(step, total)| steps.is_step(step, total)).collect()
    }

    #[test]
    fn only_the_sampling_sequence_counts_as_steps() {
        // What the first generation of a freshly loaded SD1.5 reports on ggml's CPU backend: the text encoder's
        // load, sampling's announcement, the UNet's load (inside step 1), 3 steps, the VAE's load, then tiles.
        let reports = [
            (0, 196),
            (196, 196),
            (0, 3),
            (0, 686),
            (244, 686),
            (686, 686),
            (1, 3),
            (2, 3),
            (3, 3),
            (0, 140),
            (140, 140),
            (0, 4),
            (1, 4),
            (2, 4),
        ];
        assert_eq!(steps_of(&reports), [(1, 3), (2, 3), (3, 3)]);
    }

    #[test]
    fn nothing_counts_before_an_announcement_or_out_of_order() {
        assert!(steps_of(&[(1, 4), (2, 4)]).is_empty());
        assert_eq!(
            steps_of(&[(0, 4), (1, 4), (1, 4), (3, 4), (2, 4), (0, 4), (3, 4)]),
            [(1, 4), (2, 4), (3, 4)]
        );
    }

    #[test]
    fn a_hires_fix_counts_its_second_sampling_sequence() {
        // 3 steps, the VAE's 4 decode tiles and the encoder's 4 (an image upscaler between the passes), then a
        // second pass whose schedule sd.cpp rounded to 9 steps where 10 were asked, then the final decode's tiles.
        let mut reports = vec![(0, 3), (1, 3), (2, 3), (3, 3), (0, 4), (1, 4), (2, 4), (3, 4), (4, 4)];
        reports.extend([(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]);
        reports.push((0, 9));
        reports.extend((1..=9).map(|s| (s, 9)));
        reports.extend([(0, 4), (1, 4), (2, 4)]);
        let mut want = vec![(1, 3), (2, 3), (3, 3)];
        want.extend((1..=9).map(|s| (s, 9)));
        assert_eq!(steps_with(&reports, Some(10)), want);
        assert_eq!(steps_with(&reports, None), [(1, 3), (2, 3), (3, 3)]);
    }
}
