//! How often TAESD previews run. A TAESD preview decodes the step's estimate at the output size, about a fifth of
//! an SD1.5 step's device time at 512², so previews asked for at every step would slow the job by that much. A
//! preview is made only while the previews' device time stays within [`SHARE`] of the denoising's: the device
//! time of the steps and of each decode is measured with marks the device passes (read once passed, never waited
//! for), every step adds `SHARE` of its time to a credit, and every decode spends its own time. A step whose
//! preview the credit cannot pay reports none, and the last preview stays the current one.

use sdhive_cuda_kernels::{mark, Mark};
use std::collections::VecDeque;
use std::sync::Mutex;

/// The previews' most share of the denoising's device time (the "≤ 2 % of step time").
pub(crate) const SHARE: f64 = 0.02;

/// How much an estimate may grow per measurement. An estimate takes the smallest measurement at once and rises
/// slowly: the first decodes of a size run kernel by kernel and then record a CUDA graph (several times a replay's
/// time), and an interval of steps may hold other work (a batch's decodes of finished images), so the smallest
/// recent measurement is the cost itself.
const GROWTH: f64 = 1.05;

/// A loaded model's TAESD pacing, shared by the engine's clones of its previews.
#[derive(Default)]
pub(crate) struct Pace {
    state: Mutex<State>,
}

impl std::fmt::Debug for Pace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pace")
    }
}

/// What an interval between two marks measures.
enum Span {
    /// One decode.
    Decode,
    /// This many steps (and whatever else ran between them).
    Steps(u64),
}

#[derive(Default)]
struct State {
    /// The latents' size the estimates are for.
    size: Option<(usize, usize)>,
    /// Device time of one decode and of one step (ms), once measured.
    decode_ms: Option<f64>,
    step_ms: Option<f64>,
    /// Device time the previews may still take (ms), at most one decode's.
    credit_ms: f64,
    /// Steps counted so far.
    steps: u64,
    /// The last decode's end mark and the step count then: where the next steps' interval starts.
    after_last: Option<(Mark, u64)>,
    /// Intervals whose marks the device may not have passed yet, oldest first.
    pending: VecDeque<(Mark, Mark, Span)>,
}

/// A decode the pace let through; [`Pace::decoded`] closes its interval.
pub(crate) struct Allowed {
    before: Mark,
}

impl Pace {
    /// One denoising step (one network call, whatever the batch) has been queued.
    pub(crate) fn step(&self) {
        let mut s = self.lock();
        s.steps += 1;
        if let (Some(step_ms), Some(decode_ms)) = (s.step_ms, s.decode_ms) {
            // A balance above one decode would let previews bunch up after a stretch without them.
            s.credit_ms = (s.credit_ms + SHARE * step_ms).min(decode_ms);
        }
    }

    /// A job (or a batch) of latents of `size` starts: the time since the last decode (other jobs, idle time) is
    /// not its steps', it starts with no credit, so each keeps within its own share, and another size is measured
    /// anew.
    pub(crate) fn new_job(&self, size: (usize, usize)) {
        let mut s = self.lock();
        if s.size != Some(size) {
            *s = State { size: Some(size), ..State::default() };
        }
        s.after_last = None;
        s.credit_ms = 0.0;
    }

    /// Whether a decode may run now on `device`; its start is marked when it may. Until both costs are measured,
    /// every decode may.
    pub(crate) fn allow(&self, device: &candle_core::Device) -> Option<Allowed> {
        let mut s = self.lock();
        s.read_passed();
        if let (Some(decode_ms), Some(_)) = (s.decode_ms, s.step_ms) {
            // (A tolerance for the sum's rounding: ten steps' shares pay a decode of a fifth of a step.)
            if s.credit_ms < decode_ms * (1.0 - 1e-9) {
                return None;
            }
            s.credit_ms = (s.credit_ms - decode_ms).max(0.0);
        }
        let before = mark(device).ok()?;
        if let Some((after_last, at)) = s.after_last.take() {
            let steps = s.steps - at;
            if steps > 0 {
                let start = mark(device).ok()?;
                // The steps ran between the last decode's end and this one's start.
                s.pending.push_back((after_last, start, Span::Steps(steps)));
            }
        }
        Some(Allowed { before })
    }

    /// The decode `allowed` let through has been queued on `device`.
    pub(crate) fn decoded(&self, allowed: Allowed, device: &candle_core::Device) {
        let mut s = self.lock();
        let (Ok(after), Ok(next)) = (mark(device), mark(device)) else { return };
        s.pending.push_back((allowed.before, after, Span::Decode));
        s.after_last = Some((next, s.steps));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl State {
    /// Takes in the intervals the device has passed, oldest first.
    fn read_passed(&mut self) {
        while let Some((from, to, _)) = self.pending.front() {
            let Some(ms) = to.ms_since(from) else { break };
            if let Some((_, _, span)) = self.pending.pop_front() {
                self.measured(&span, ms);
            }
        }
    }

    fn measured(&mut self, span: &Span, ms: f64) {
        let blend = |old: Option<f64>, new: f64| Some(old.map_or(new, |o| (o * GROWTH).min(new)));
        match span {
            Span::Decode => self.decode_ms = blend(self.decode_ms, ms),
            Span::Steps(n) => self.step_ms = blend(self.step_ms, ms / *n as f64),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measured(decode_ms: f64, step_ms: f64) -> Pace {
        let pace = Pace::default();
        pace.new_job((0, 0));
        {
            let mut s = pace.lock();
            s.measured(&Span::Decode, decode_ms);
            s.measured(&Span::Steps(4), 4.0 * step_ms);
        }
        pace
    }

    #[test]
    fn previews_run_while_they_stay_within_their_share_of_the_steps() {
        let cpu = candle_core::Device::Cpu;
        // A decode of a fifth of a step: one preview per ten steps at most.
        let pace = measured(1.0, 5.0);
        let mut made = Vec::new();
        for step in 1..=40 {
            pace.step();
            if pace.allow(&cpu).is_some() {
                made.push(step);
            }
        }
        assert_eq!(made, [10, 20, 30, 40], "previews asked at every step");
        // A new job starts with no credit, whatever the last one left.
        for _ in 0..9 {
            pace.step();
        }
        pace.new_job((0, 0));
        let made: Vec<u32> = (1..=12)
            .filter(|_| {
                pace.step();
                pace.allow(&cpu).is_some()
            })
            .collect();
        assert_eq!(made, [10], "the new job's first preview");
        // Asked every 4 steps: the credit of 8 steps does not pay, of 12 does.
        let pace = measured(1.0, 5.0);
        let mut made = Vec::new();
        for step in 1..=48 {
            pace.step();
            if step % 4 == 0 && pace.allow(&cpu).is_some() {
                made.push(step);
            }
        }
        assert_eq!(made, [12, 24, 36, 48]);
    }

    #[test]
    fn cheap_decodes_run_at_every_step_and_unmeasured_ones_run() {
        let cpu = candle_core::Device::Cpu;
        let pace = measured(0.01, 5.0);
        pace.step();
        assert!(pace.allow(&cpu).is_some(), "no credit yet, the first step's pays");
        assert!((1..20).all(|_| {
            pace.step();
            pace.allow(&cpu).is_some()
        }));
        let unmeasured = Pace::default();
        assert!((0..5).all(|_| unmeasured.allow(&cpu).is_some()));
    }

    #[test]
    fn the_device_time_of_decodes_and_steps_is_measured_between_marks() {
        let cpu = candle_core::Device::Cpu;
        let pace = Pace::default();
        let busy = |ms: u64| std::thread::sleep(std::time::Duration::from_millis(ms));
        // A decode of 20 ms, two steps of 10 ms, another decode of 20 ms, one more step.
        let allowed = pace.allow(&cpu).expect("unmeasured");
        busy(20);
        pace.decoded(allowed, &cpu);
        for _ in 0..2 {
            busy(10);
            pace.step();
        }
        let allowed = pace.allow(&cpu).expect("the steps are not measured yet");
        busy(20);
        pace.decoded(allowed, &cpu);
        busy(10);
        pace.step();
        let _ = pace.allow(&cpu);
        let s = pace.lock();
        let (decode, step) = (s.decode_ms.expect("decodes measured"), s.step_ms.expect("steps measured"));
        assert!((20.0..60.0).contains(&decode), "decode {decode} ms");
        assert!((10.0..30.0).contains(&step), "step {step} ms");
    }

    #[test]
    fn estimates_take_the_smallest_measurement_and_rise_slowly() {
        let pace = Pace::default();
        let mut s = pace.lock();
        // A recording decode, then replays.
        for ms in [9.0, 1.0, 1.2] {
            s.measured(&Span::Decode, ms);
        }
        assert!((s.decode_ms.expect("measured") - 1.05).abs() < 1e-9);
        s.measured(&Span::Steps(3), 30.0);
        s.measured(&Span::Steps(1), 5.0);
        assert_eq!(s.step_ms, Some(5.0));
        drop(s);
        // Another size starts over; the same size keeps what it measured.
        pace.new_job((64, 64));
        assert!(pace.lock().decode_ms.is_none());
        pace.lock().measured(&Span::Decode, 2.0);
        pace.new_job((64, 64));
        assert_eq!(pace.lock().decode_ms, Some(2.0));
    }
}
