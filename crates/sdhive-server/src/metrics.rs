//! Prometheus metrics, written out by hand in the text exposition format (a handful of series does not need a
//! registry crate): jobs entering each state, queue depth, step latency, generation time and model load time.

use sdhive_protocol::JobState;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

const STEP_BUCKETS: [f64; 12] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];
const BATCH_BUCKETS: [f64; 7] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0];
const GENERATION_BUCKETS: [f64; 12] = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0];

struct Histogram {
    bounds: &'static [f64],
    /// Per-bucket (non-cumulative) counts; the last slot is +Inf.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, counts: vec![0; bounds.len() + 1], sum: 0.0, count: 0 }
    }

    fn observe(&mut self, v: f64) {
        let slot = self.bounds.iter().position(|b| v <= *b).unwrap_or(self.bounds.len());
        self.counts[slot] += 1;
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, count) in self.bounds.iter().zip(&self.counts) {
            cumulative += count;
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

pub struct Metrics {
    jobs_by_state: [AtomicU64; 5],
    step_seconds: Mutex<Histogram>,
    generation_seconds: Mutex<Histogram>,
    batch_images: Mutex<Histogram>,
    previews: AtomicU64,
    /// f64 bits; written once after the load.
    model_load_seconds: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn state_slot(state: JobState) -> usize {
    JobState::ALL.iter().position(|s| *s == state).unwrap_or(0)
}

fn lock(h: &Mutex<Histogram>) -> std::sync::MutexGuard<'_, Histogram> {
    h.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Metrics {
    pub fn new() -> Self {
        Metrics {
            jobs_by_state: Default::default(),
            step_seconds: Mutex::new(Histogram::new(&STEP_BUCKETS)),
            generation_seconds: Mutex::new(Histogram::new(&GENERATION_BUCKETS)),
            batch_images: Mutex::new(Histogram::new(&BATCH_BUCKETS)),
            previews: AtomicU64::new(0),
            model_load_seconds: AtomicU64::new(0f64.to_bits()),
        }
    }

    pub fn job_entered(&self, state: JobState) {
        self.jobs_by_state[state_slot(state)].fetch_add(1, Ordering::Relaxed);
    }

    /// Jobs that have entered `state` since start.
    pub fn jobs_entered(&self, state: JobState) -> u64 {
        self.jobs_by_state[state_slot(state)].load(Ordering::Relaxed)
    }

    pub fn observe_step(&self, d: Duration) {
        lock(&self.step_seconds).observe(d.as_secs_f64());
    }

    /// One denoising step's images: a batch's, or 1 for a job run alone.
    pub fn observe_batch(&self, images: u32) {
        lock(&self.batch_images).observe(f64::from(images));
    }

    /// A live preview went out with a step's report.
    pub fn preview_sent(&self) {
        self.previews.fetch_add(1, Ordering::Relaxed);
    }

    pub fn observe_generation(&self, d: Duration) {
        lock(&self.generation_seconds).observe(d.as_secs_f64());
    }

    pub fn set_model_load_time(&self, d: Duration) {
        self.model_load_seconds.store(d.as_secs_f64().to_bits(), Ordering::Relaxed);
    }

    pub fn model_load_seconds(&self) -> f64 {
        f64::from_bits(self.model_load_seconds.load(Ordering::Relaxed))
    }

    /// The text exposition format (version 0.0.4).
    pub fn render(&self, queue_depth: usize, running: usize, ready: bool) -> String {
        let mut out = String::new();
        out.push_str(
            "# HELP sdhive_jobs_total Jobs that entered each state.\n# TYPE sdhive_jobs_total counter\n",
        );
        for state in JobState::ALL {
            let _ = writeln!(out, "sdhive_jobs_total{{state=\"{state}\"}} {}", self.jobs_entered(state));
        }
        let _ = writeln!(
            out,
            "# HELP sdhive_queue_depth Jobs waiting to run.\n# TYPE sdhive_queue_depth gauge\nsdhive_queue_depth {queue_depth}"
        );
        let _ = writeln!(
            out,
            "# HELP sdhive_jobs_running Jobs running now (a batch's, and those being encoded).\n# TYPE sdhive_jobs_running gauge\nsdhive_jobs_running {running}"
        );
        let _ = writeln!(
            out,
            "# HELP sdhive_ready Whether the worker accepts jobs.\n# TYPE sdhive_ready gauge\nsdhive_ready {}",
            u8::from(ready)
        );
        let _ = writeln!(
            out,
            "# HELP sdhive_model_load_seconds Time the model took to load.\n# TYPE sdhive_model_load_seconds gauge\nsdhive_model_load_seconds {}",
            self.model_load_seconds()
        );
        let _ = writeln!(
            out,
            "# HELP sdhive_previews_total Live previews sent with step reports.\n# TYPE sdhive_previews_total counter\nsdhive_previews_total {}",
            self.previews.load(Ordering::Relaxed)
        );
        lock(&self.step_seconds).render(&mut out, "sdhive_step_seconds", "Time per denoising step.");
        lock(&self.generation_seconds).render(
            &mut out,
            "sdhive_generation_seconds",
            "Run time of successful jobs (all images).",
        );
        lock(&self.batch_images).render(
            &mut out,
            "sdhive_batch_images",
            "Images denoised together per denoising step (--max-batch).",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::new();
        m.observe_step(Duration::from_millis(3));
        m.observe_step(Duration::from_millis(70));
        m.observe_step(Duration::from_secs(100));
        m.job_entered(JobState::Queued);
        let text = m.render(2, 1, true);
        assert!(text.contains("sdhive_step_seconds_bucket{le=\"0.005\"} 1\n"), "{text}");
        assert!(text.contains("sdhive_step_seconds_bucket{le=\"0.1\"} 2\n"), "{text}");
        assert!(text.contains("sdhive_step_seconds_bucket{le=\"+Inf\"} 3\n"), "{text}");
        assert!(text.contains("sdhive_step_seconds_count 3\n"));
        assert!(text.contains("sdhive_jobs_total{state=\"queued\"} 1\n"));
        assert!(text.contains("sdhive_queue_depth 2\n"));
    }
}
