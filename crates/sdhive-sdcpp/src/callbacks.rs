//! stable-diffusion.cpp reports through process-wide C callbacks: its log lines go to `tracing` (target
//! `sdcpp`), and its progress reaches the closure of the one generation running — or nowhere, so that nothing
//! is ever printed on stdout, which carries the CLI's output. One generation at a time per process is enforced
//! here, since the callback slot is global.

use diffusion_rs_sys as sys;
use std::ffi::{c_void, CStr};
use std::os::raw::{c_char, c_int};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, MutexGuard, Once};

static INSTALL: Once = Once::new();
static GENERATION: Mutex<()> = Mutex::new(());

/// Routes logs to tracing and silences progress; idempotent.
pub fn install() {
    INSTALL.call_once(|| {
        // SAFETY: both callbacks are `extern "C"` functions valid for the whole process; null data is handled.
        unsafe {
            sys::sd_set_log_callback(Some(on_log), std::ptr::null_mut());
            sys::sd_set_progress_callback(Some(on_progress), std::ptr::null_mut());
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

/// What the progress callback feeds while one generation runs.
pub struct ProgressSink<'a> {
    /// Called with (step, steps); returns whether to go on.
    pub report: &'a mut dyn FnMut(u32, u32) -> bool,
    /// Set once `report` asked to stop; sd.cpp cannot be interrupted mid-image, so the caller acts on it when
    /// the image is done.
    pub cancelled: bool,
}

unsafe extern "C" fn on_progress(step: c_int, steps: c_int, _time: f32, data: *mut c_void) {
    if data.is_null() || step <= 0 || steps <= 0 {
        return;
    }
    // SAFETY: `data` is the `ProgressSink` that `with_progress` registered and keeps alive (and exclusively
    // borrowed) until it unregisters it; sd.cpp calls back on the thread that called generate_image.
    let sink = unsafe { &mut *(data as *mut ProgressSink<'_>) };
    // A panic must not unwind into C++; treat it as a request to stop.
    let go_on = catch_unwind(AssertUnwindSafe(|| (sink.report)(step as u32, steps as u32))).unwrap_or(false);
    if !go_on {
        sink.cancelled = true;
    }
}

/// Runs `body` with `sink` receiving sd.cpp's progress, holding the process-wide generation lock.
pub fn with_progress<T>(sink: &mut ProgressSink<'_>, body: impl FnOnce() -> T) -> T {
    install();
    let _guard: MutexGuard<'_, ()> = GENERATION.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    /// Unregisters the sink however `body` ends, before `sink`'s borrow does.
    struct Unregister;
    impl Drop for Unregister {
        fn drop(&mut self) {
            // SAFETY: as in `install`.
            unsafe { sys::sd_set_progress_callback(Some(on_progress), std::ptr::null_mut()) };
        }
    }
    // SAFETY: the pointer stays valid until `Unregister` runs, which is before `sink`'s borrow ends.
    unsafe { sys::sd_set_progress_callback(Some(on_progress), (sink as *mut ProgressSink<'_>).cast()) };
    let _unregister = Unregister;
    body()
}
