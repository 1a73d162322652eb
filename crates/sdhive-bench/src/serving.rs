//! `sdhive-bench --serve-bench WORKER`: the serving benchmark. Starts a worker binary (`sd-worker-cpu`,
//! `sd-worker-cuda`) with `serve` on one model and the arguments given after `--` (e.g. `--max-batch 8`), waits
//! until it is ready, and then measures the path users hit, `POST /sdapi/v1/txt2img`, each request with its own
//! seed and prompt: single-client latency, then images per second and latency percentiles with each number of
//! concurrent clients in a closed loop (every client sends its next request when its last one has answered; each
//! number of clients runs twice, and the second pass, with every batch size it forms already planned, is the
//! steady state reported; the first pass's figures come beside it), and
//! with `--rates` the same at fixed arrival rates in an open loop (requests sent on a clock, whatever the answers:
//! the latency a service shows many users at a load below or near its capacity). The
//! worker's peak device memory (nvidia-smi, per process) and resident memory are sampled beside every part. A last
//! part prices live previews: native jobs (`POST /v1/jobs`) with and without `preview_every`, their engine run
//! times against the step time. One JSON report on stdout; `xtask/bench/serve_table.py` runs it next to diffusers.

use anyhow::{bail, ensure, Context, Result};
use base64::Engine as _;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct ServeBenchArgs {
    /// Time the HTTP serving path instead: start this worker binary with `serve --model <--serve-model>` and the
    /// arguments after `--`, and load it through `POST /sdapi/v1/txt2img` (`--size`², `--steps` steps, Euler a,
    /// CFG 7, `--dtype`; `--warmup` requests first).
    #[arg(long, value_name = "WORKER")]
    pub serve_bench: Option<PathBuf>,
    /// With --serve-bench: the model the worker serves (a diffusers folder or a single-file checkpoint).
    #[arg(long, value_name = "MODEL")]
    pub serve_model: Option<String>,
    /// With --serve-bench: timed requests of the single-client latency part.
    #[arg(long, default_value_t = 20)]
    pub latency_requests: usize,
    /// With --serve-bench: the numbers of concurrent clients measured, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,16")]
    pub clients: Vec<usize>,
    /// With --serve-bench: timed requests per number of clients (each client sends at least two) and per rate.
    #[arg(long, default_value_t = 48)]
    pub requests_per_level: usize,
    /// With --serve-bench: arrival rates (requests per second, comma-separated) measured in an open loop after the
    /// closed-loop levels: request i is sent i / rate seconds after the first, whatever has answered.
    #[arg(long, value_delimiter = ',')]
    pub rates: Vec<f64>,
    /// With --serve-bench: native jobs per preview setting (the settings take turns); 0 skips the preview part.
    #[arg(long, default_value_t = 5)]
    pub preview_images: usize,
    /// With --serve-bench: the `preview_every` values priced against jobs without previews, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,10")]
    pub preview_every: Vec<u32>,
    /// With --serve-bench: how long the worker may take to load its model and answer `/ready`.
    #[arg(long, default_value_t = 900)]
    pub ready_timeout_s: u64,
    /// With --serve-bench: extra arguments for the worker's `serve` (after `--`).
    #[arg(last = true, value_name = "WORKER_ARGS")]
    pub worker_args: Vec<String>,
}

/// What one run measures; the image settings come from the shared flags.
pub struct Settings<'a> {
    pub args: &'a ServeBenchArgs,
    pub worker: PathBuf,
    pub size: u32,
    pub steps: u32,
    pub dtype: &'a str,
    pub warmup: usize,
}

const CFG_SCALE: f64 = 7.0;
const SAMPLER: &str = "Euler a";
/// How often a native job's state is read while it runs.
const POLL: Duration = Duration::from_millis(10);
/// How often the memory sampler looks at the worker.
const SAMPLE_EVERY: Duration = Duration::from_millis(50);

pub fn run(s: &Settings) -> Result<Value> {
    let model = s.args.serve_model.as_deref().context("--serve-bench needs --serve-model MODEL")?;
    ensure!(s.args.latency_requests > 0, "--latency-requests must be at least 1");
    ensure!(
        !s.args.clients.is_empty() && s.args.clients.iter().all(|&c| c > 0),
        "--clients needs one or more numbers, each at least 1"
    );
    ensure!(s.args.requests_per_level > 0, "--requests-per-level must be at least 1");
    ensure!(
        s.args.rates.iter().all(|r| r.is_finite() && *r > 0.0),
        "--rates values must be positive numbers of requests per second"
    );
    ensure!(s.args.preview_every.iter().all(|&k| k > 0), "--preview-every values must be at least 1");
    ensure!(s.size > 0 && s.size.is_multiple_of(8), "--size must be a positive multiple of 8");
    ensure!(s.steps > 0, "--steps must be at least 1");

    let started = Instant::now();
    let mut worker = Worker::start(&s.worker, model, s.dtype, &s.args.worker_args)?;
    let memory = MemorySampler::start(worker.pid);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let outcome = runtime.block_on(async {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(3600))
            .build()
            .context("building the HTTP client")?;
        let load =
            Load { client, url: worker.url.clone(), size: s.size, steps: s.steps, next: Default::default() };
        worker.wait_ready(&load.client, Duration::from_secs(s.args.ready_timeout_s)).await?;
        let ready_s = started.elapsed().as_secs_f64();
        let loading = memory.take();
        eprintln!("worker ready after {ready_s:.1} s; while loading: {loading}");
        let mut report = measure(s, &load, &memory, ready_s, loading).await?;
        // Read at the end: the log line comes before `/ready` answers, but its reader thread may lag behind.
        let warm_s = *worker.warm_s.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(w) = warm_s {
            eprintln!("worker warm-up: {w:.1} s of the {ready_s:.1} s before it was ready");
        }
        report["warm_up_s"] = json!(warm_s);
        Ok::<_, anyhow::Error>(report)
    });
    let exit = worker.stop();
    let mut report = outcome?;
    let exit = exit?;
    if let Some(code) = exit {
        bail!("the worker exited on its own during the benchmark ({code})");
    }
    report["worker"] = json!(s.worker.display().to_string());
    report["worker_args"] = json!(s.args.worker_args);
    report["model"] = json!(model);
    Ok(report)
}

async fn measure(
    s: &Settings<'_>,
    load: &Load,
    memory: &MemorySampler,
    ready_s: f64,
    loading: Peak,
) -> Result<Value> {
    for i in 0..s.warmup {
        let ms = load.txt2img().await?;
        eprintln!("warm-up {i}: {ms:.1} ms");
    }
    memory.take();
    let mut latency = Vec::with_capacity(s.args.latency_requests);
    let mut parts = Parts::default();
    for i in 0..s.args.latency_requests {
        let (ms, timing, check) = load.txt2img_unchecked().await?;
        check.await.context("checking an answer")??;
        eprintln!("one client, request {i}: {ms:.1} ms (server: {timing:?})");
        latency.push(ms);
        parts.add(ms, &timing);
    }
    let latency_peak = memory.take();

    let mut levels = Vec::new();
    for &clients in &s.args.clients {
        let rounds = s.args.requests_per_level.div_ceil(clients).max(2);
        let (first, level) = load.closed_loop(clients, rounds).await?;
        let peak = memory.take();
        eprintln!(
            "{clients} clients × {rounds}: {:.2} images/s, p50 {:.1} ms, p90 {:.1} ms, {:.2} images per denoising step \
             (first pass {:.2} images/s, p90 {:.1} ms); {peak}",
            level.images_per_s,
            percentile(&level.latencies_ms, 50.0),
            percentile(&level.latencies_ms, 90.0),
            level.mean_batch.unwrap_or(f64::NAN),
            first.images_per_s,
            percentile(&first.latencies_ms, 90.0),
        );
        let mut report = level.report(clients, rounds, peak);
        report["first_pass"] = json!({
            "images_per_s": first.images_per_s,
            "mean_batch": first.mean_batch,
            "latency": summary(&first.latencies_ms),
        });
        levels.push(report);
    }

    let mut open = Vec::new();
    for &rate in &s.args.rates {
        let level = load.open_loop(rate, s.args.requests_per_level).await?;
        let peak = memory.take();
        eprintln!(
            "{rate} requests/s, open loop: {:.2} images/s, p50 {:.1} ms, p90 {:.1} ms, {:.2} images per denoising step; \
             {peak}",
            level.images_per_s,
            percentile(&level.latencies_ms, 50.0),
            percentile(&level.latencies_ms, 90.0),
            level.mean_batch.unwrap_or(f64::NAN),
        );
        open.push(level.report_open(rate, peak));
    }

    let previews = if s.args.preview_images > 0 { Some(previews(s, load).await?) } else { None };
    Ok(json!({
        "mode": "serve",
        "size": s.size,
        "steps": s.steps,
        "cfg_scale": CFG_SCALE,
        "sampler": SAMPLER,
        "dtype": s.dtype,
        "ready_s": ready_s,
        "loading_peak": loading.json(),
        "latency": summary(&latency),
        "latency_parts": parts.json(),
        "latency_peak": latency_peak.json(),
        "levels": levels,
        "open_levels": open,
        "previews": previews,
        "peak": memory.overall().json(),
    }))
}

/// The client side: one HTTP client, the worker's address, and the request counter that gives every request its
/// own seed and prompt.
struct Load {
    client: reqwest::Client,
    url: String,
    size: u32,
    steps: u32,
    next: Arc<AtomicU64>,
}

/// The timed requests of one number of clients.
struct Level {
    latencies_ms: Vec<f64>,
    wall_s: f64,
    images_per_s: f64,
    /// Images per denoising step over the timed part, from the worker's `sdhive_batch_images` histogram (absent in
    /// workers that do not batch).
    mean_batch: Option<f64>,
}

impl Level {
    fn report(&self, clients: usize, rounds: usize, peak: Peak) -> Value {
        json!({
            "clients": clients,
            "requests": self.latencies_ms.len(),
            "rounds": rounds,
            "wall_s": self.wall_s,
            "images_per_s": self.images_per_s,
            "mean_batch": self.mean_batch,
            "latency": summary(&self.latencies_ms),
            "peak": peak.json(),
        })
    }

    fn report_open(&self, rate: f64, peak: Peak) -> Value {
        json!({
            "rate": rate,
            "requests": self.latencies_ms.len(),
            "wall_s": self.wall_s,
            "images_per_s": self.images_per_s,
            "mean_batch": self.mean_batch,
            "latency": summary(&self.latencies_ms),
            "peak": peak.json(),
        })
    }
}

impl Load {
    fn body(&self, i: u64) -> Value {
        json!({
            "prompt": prompt(i),
            "negative_prompt": NEGATIVE[(i % NEGATIVE.len() as u64) as usize],
            "seed": SEED_BASE + i,
            "steps": self.steps,
            "cfg_scale": CFG_SCALE,
            "width": self.size,
            "height": self.size,
            "sampler_name": SAMPLER,
            "batch_size": 1,
            "n_iter": 1,
        })
    }

    /// One `POST /sdapi/v1/txt2img`, timed from sending to the last byte of the answer, with the worker's
    /// `Server-Timing` metrics (name, ms; empty where it sends none); the answer is then checked (one PNG of the
    /// asked size) off the timed path.
    async fn txt2img_unchecked(
        &self,
    ) -> Result<(f64, Vec<(String, f64)>, tokio::task::JoinHandle<Result<()>>)> {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        let body = self.body(i);
        let t = Instant::now();
        let response = self
            .client
            .post(format!("{}/sdapi/v1/txt2img", self.url))
            .json(&body)
            .send()
            .await
            .context("POST /sdapi/v1/txt2img")?;
        let status = response.status();
        let timing = response.headers().get("server-timing").and_then(|v| v.to_str().ok()).map(server_timing);
        let bytes = response.bytes().await.context("reading the txt2img answer")?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        if !status.is_success() {
            bail!("POST /sdapi/v1/txt2img answered {status}: {}", excerpt(&bytes));
        }
        let size = self.size;
        let check = tokio::task::spawn_blocking(move || check_a1111_answer(&bytes, size));
        Ok((ms, timing.unwrap_or_default(), check))
    }

    async fn txt2img(&self) -> Result<f64> {
        let (ms, _, check) = self.txt2img_unchecked().await?;
        check.await.context("checking an answer")??;
        Ok(ms)
    }

    /// `clients` clients, each sending one untimed request and then `rounds` timed ones, the next as soon as the
    /// last has answered, twice: the first pass on a worker that may not have seen every batch size this load forms
    /// (the first step at a batch size plans and tunes its products: most of a second), the second in the steady
    /// state it reaches. Each pass starts when every client has its warm-up answer and ends with the last answer.
    async fn closed_loop(&self, clients: usize, rounds: usize) -> Result<(Level, Level)> {
        let first = self.closed_pass(clients, rounds).await?;
        Ok((first, self.closed_pass(clients, rounds).await?))
    }

    async fn closed_pass(&self, clients: usize, rounds: usize) -> Result<Level> {
        let mut warm = tokio::task::JoinSet::new();
        for _ in 0..clients {
            let me = self.clone_handle();
            warm.spawn(async move { me.txt2img().await });
        }
        while let Some(done) = warm.join_next().await {
            done.context("a warm-up client panicked")??;
        }
        let batches_before = self.batch_histogram().await;
        let start = Instant::now();
        let mut timed = tokio::task::JoinSet::new();
        for _ in 0..clients {
            let me = self.clone_handle();
            timed.spawn(async move {
                let mut out = Vec::with_capacity(rounds);
                let mut checks = Vec::with_capacity(rounds);
                for _ in 0..rounds {
                    let (ms, _, check) = me.txt2img_unchecked().await?;
                    out.push(ms);
                    checks.push(check);
                }
                Ok::<_, anyhow::Error>((out, checks))
            });
        }
        let mut latencies_ms = Vec::with_capacity(clients * rounds);
        let mut checks = Vec::new();
        while let Some(done) = timed.join_next().await {
            let (ms, c) = done.context("a client panicked")??;
            latencies_ms.extend(ms);
            checks.extend(c);
        }
        self.end_level(latencies_ms, checks, start, batches_before).await
    }

    /// `requests` requests arriving at `rate` per second from an idle worker, request i sent i / rate seconds after
    /// the first whatever has answered; the level ends with the last answer.
    async fn open_loop(&self, rate: f64, requests: usize) -> Result<Level> {
        let batches_before = self.batch_histogram().await;
        let start = tokio::time::Instant::now();
        let mut sent = tokio::task::JoinSet::new();
        for i in 0..requests {
            tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / rate)).await;
            let me = self.clone_handle();
            sent.spawn(async move { me.txt2img_unchecked().await });
        }
        let mut latencies_ms = Vec::with_capacity(requests);
        let mut checks = Vec::with_capacity(requests);
        while let Some(done) = sent.join_next().await {
            let (ms, _, check) = done.context("a request task panicked")??;
            latencies_ms.push(ms);
            checks.push(check);
        }
        self.end_level(latencies_ms, checks, start.into_std(), batches_before).await
    }

    /// A level's end once every answer is in: its wall time from `start`, the images per denoising step since the
    /// histogram read `before`, and every answer checked.
    async fn end_level(
        &self,
        latencies_ms: Vec<f64>,
        checks: Vec<tokio::task::JoinHandle<Result<()>>>,
        start: Instant,
        before: Option<(f64, f64)>,
    ) -> Result<Level> {
        let wall_s = start.elapsed().as_secs_f64();
        let mean_batch = self.mean_batch_since(before).await;
        for c in checks {
            c.await.context("checking an answer")??;
        }
        let images_per_s = latencies_ms.len() as f64 / wall_s;
        Ok(Level { latencies_ms, wall_s, images_per_s, mean_batch })
    }

    /// Images per denoising step since the histogram read `before` ([`Self::batch_histogram`]).
    async fn mean_batch_since(&self, before: Option<(f64, f64)>) -> Option<f64> {
        match (before, self.batch_histogram().await) {
            (Some((sum0, n0)), Some((sum1, n1))) if n1 > n0 => Some((sum1 - sum0) / (n1 - n0)),
            _ => None,
        }
    }

    /// `(sum, count)` of the worker's `sdhive_batch_images` histogram; `None` where `/metrics` has none.
    async fn batch_histogram(&self) -> Option<(f64, f64)> {
        let response = self.client.get(format!("{}/metrics", self.url)).send().await.ok()?;
        let text = response.error_for_status().ok()?.text().await.ok()?;
        histogram_totals(&text, "sdhive_batch_images")
    }

    /// The worker's count of previews sent (`sdhive_previews_total`), where it has one.
    async fn previews_sent(&self) -> Option<f64> {
        let response = self.client.get(format!("{}/metrics", self.url)).send().await.ok()?;
        let text = response.error_for_status().ok()?.text().await.ok()?;
        text.lines().find_map(|l| l.strip_prefix("sdhive_previews_total ")?.trim().parse().ok())
    }

    fn clone_handle(&self) -> Load {
        Load {
            client: self.client.clone(),
            url: self.url.clone(),
            size: self.size,
            steps: self.steps,
            next: self.next.clone(),
        }
    }

    /// One native job run to its end (polled); returns the worker's own `run_seconds` for it.
    async fn native_job(&self, steps: u32, preview_every: Option<u32>) -> Result<f64> {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        let mut body = self.body(i);
        let fields = body.as_object_mut().context("request body")?;
        for a1111_only in ["sampler_name", "batch_size", "n_iter"] {
            fields.remove(a1111_only);
        }
        fields.insert("sampler".into(), json!(SAMPLER));
        fields.insert("steps".into(), json!(steps));
        if let Some(k) = preview_every {
            fields.insert("preview_every".into(), json!(k));
        }
        let response = self
            .client
            .post(format!("{}/v1/jobs", self.url))
            .json(&body)
            .send()
            .await
            .context("POST /v1/jobs")?;
        let status = response.status();
        let bytes = response.bytes().await.context("reading the /v1/jobs answer")?;
        ensure!(status.as_u16() == 202, "POST /v1/jobs answered {status}: {}", excerpt(&bytes));
        let submitted: Value = serde_json::from_slice(&bytes).context("the /v1/jobs answer is not JSON")?;
        let id = submitted["id"].as_str().context("the /v1/jobs answer has no `id`")?.to_string();
        loop {
            tokio::time::sleep(POLL).await;
            let response = self
                .client
                .get(format!("{}/v1/jobs/{id}", self.url))
                .send()
                .await
                .context("GET /v1/jobs/{id}")?;
            let status = response.status();
            let bytes = response.bytes().await.context("reading a job")?;
            ensure!(status.is_success(), "GET /v1/jobs/{id} answered {status}: {}", excerpt(&bytes));
            let job: Value = serde_json::from_slice(&bytes).context("a job is not JSON")?;
            match job["state"].as_str() {
                Some("succeeded") => {
                    return job["run_seconds"].as_f64().context("a finished job without `run_seconds`");
                }
                Some("queued" | "running") => {}
                other => bail!("job {id} ended {other:?}: {}", job["error"]),
            }
        }
    }
}

/// What previews cost. Jobs without previews at `steps` and at `2 × steps` give the step time (the difference,
/// per step: text encoding, decode and encoding cancel out); jobs at `steps` with `preview_every: k` give the
/// added time per image. The settings take turns job by job (`preview_images` rounds), so drift hits all alike.
async fn previews(s: &Settings<'_>, load: &Load) -> Result<Value> {
    #[derive(Clone, Copy, PartialEq)]
    enum Phase {
        Plain,
        Double,
        Every(u32),
    }
    let mut phases = vec![Phase::Plain, Phase::Double];
    phases.extend(s.args.preview_every.iter().map(|&k| Phase::Every(k)));
    let run = |phase: Phase| {
        let (steps, every) = match phase {
            Phase::Plain => (s.steps, None),
            Phase::Double => (2 * s.steps, None),
            Phase::Every(k) => (s.steps, Some(k)),
        };
        load.native_job(steps, every)
    };
    for &p in &phases {
        run(p).await?;
    }
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); phases.len()];
    // Previews each setting got (TAESD's are paced: fewer than asked for where they cost more than their share).
    let mut sent = vec![0.0; phases.len()];
    for _ in 0..s.args.preview_images {
        for (i, &p) in phases.iter().enumerate() {
            let before = load.previews_sent().await;
            times[i].push(run(p).await? * 1e3);
            if let (Some(b), Some(a)) = (before, load.previews_sent().await) {
                sent[i] += a - b;
            }
        }
    }
    let plain = median(&times[0]);
    let double = median(&times[1]);
    let step_ms = (double - plain) / f64::from(s.steps);
    eprintln!(
        "previews: {plain:.1} ms per image without, {double:.1} ms at twice the steps: {step_ms:.2} ms/step"
    );
    let with: Vec<Value> = phases
        .iter()
        .zip(&times)
        .zip(&sent)
        .filter_map(|((p, t), sent)| match p {
            Phase::Every(k) => Some((*k, t, *sent)),
            _ => None,
        })
        .map(|(k, t, sent)| {
            let per_image = median(t);
            let extra_ms = per_image - plain;
            let per_step_ms = extra_ms / f64::from(s.steps);
            let previews = s.steps / k;
            eprintln!(
                "previews every {k}: {per_image:.1} ms per image, +{extra_ms:.2} ms ({:.2} % of the step time)",
                100.0 * per_step_ms / step_ms
            );
            json!({
                "preview_every": k,
                "previews_per_image": previews,
                "previews_sent_per_image": sent / s.args.preview_images.max(1) as f64,
                "run_ms": summary(t),
                "extra_ms_per_image": extra_ms,
                "extra_ms_per_preview": (previews > 0).then(|| extra_ms / f64::from(previews)),
                "step_cost_pct": 100.0 * per_step_ms / step_ms,
            })
        })
        .collect();
    Ok(json!({
        "images_per_setting": s.args.preview_images,
        "run_ms_without": summary(&times[0]),
        "run_ms_double_steps": summary(&times[1]),
        "step_ms": step_ms,
        "with": with,
    }))
}

/// A worker process serving on a free loopback port; killed when dropped.
struct Worker {
    child: Option<Child>,
    pid: u32,
    url: String,
    /// The seconds its warm-up took, once its log has said (a batching worker on a GPU).
    warm_s: Arc<std::sync::Mutex<Option<f64>>>,
}

impl Worker {
    fn start(bin: &std::path::Path, model: &str, dtype: &str, extra: &[String]) -> Result<Self> {
        let mut cmd = Command::new(bin);
        cmd.arg("serve")
            .args(["--model", model, "--host", "127.0.0.1", "--port", "0", "--offline", "--dtype", dtype])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // The warm-up's info line says how long it took; the worker's default is warnings only.
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "warn,sdhive_engine::batch=info");
        }
        eprintln!("starting {} serve --model {model} --dtype {dtype} {}", bin.display(), extra.join(" "));
        let mut child = cmd.spawn().with_context(|| format!("starting {}", bin.display()))?;
        let pid = child.id();
        let (tx, rx) = mpsc::channel();
        // The worker's output goes to our stderr (stdout carries the report); its bound address is read on the way.
        let warm_s = Arc::new(std::sync::Mutex::new(None));
        if let Some(out) = child.stdout.take() {
            std::thread::spawn(move || forward(out, None, None));
        }
        if let Some(err) = child.stderr.take() {
            let warm_s = Arc::clone(&warm_s);
            std::thread::spawn(move || forward(err, Some(tx), Some(warm_s)));
        }
        let mut worker = Worker { child: Some(child), pid, url: String::new(), warm_s };
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(url) => {
                    worker.url = url;
                    return Ok(worker);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {}
            }
            if let Some(code) = worker.exited()? {
                bail!("{} exited before listening ({code}); its output is above", bin.display());
            }
            if Instant::now() > deadline {
                bail!("{} did not print `listening on` within 120 s", bin.display());
            }
        }
    }

    fn exited(&mut self) -> Result<Option<std::process::ExitStatus>> {
        match self.child.as_mut() {
            Some(c) => c.try_wait().context("waiting for the worker"),
            None => Ok(None),
        }
    }

    async fn wait_ready(&mut self, client: &reqwest::Client, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(r) = client.get(format!("{}/ready", self.url)).send().await {
                if r.status().is_success() {
                    return Ok(());
                }
            }
            if let Some(code) = self.exited()? {
                bail!("the worker exited while loading ({code}); its output is above");
            }
            if Instant::now() > deadline {
                bail!("the worker was not ready within {} s", timeout.as_secs());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Ends the worker; `Some(status)` when it had already exited by itself.
    fn stop(&mut self) -> Result<Option<std::process::ExitStatus>> {
        let Some(mut child) = self.child.take() else { return Ok(None) };
        if let Some(status) = child.try_wait().context("waiting for the worker")? {
            return Ok(Some(status));
        }
        child.kill().context("stopping the worker")?;
        child.wait().context("waiting for the worker to stop")?;
        Ok(None)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// Copies a worker stream to our stderr line by line; on stderr, sends the address of `listening on http://…`.
fn forward(
    stream: impl std::io::Read,
    url: Option<mpsc::Sender<String>>,
    warm_s: Option<Arc<std::sync::Mutex<Option<f64>>>>,
) {
    for line in BufReader::new(stream).lines() {
        let Ok(line) = line else { break };
        if let (Some(tx), Some(addr)) = (&url, line.strip_prefix("listening on ")) {
            let _ = tx.send(addr.trim().to_string());
        }
        if let (Some(slot), Some(secs)) = (&warm_s, warm_up_seconds(&line)) {
            *slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(secs);
        }
        eprintln!("worker: {line}");
    }
}

/// The seconds of the engine's "warmed the batch sizes up" log line (tracing's `seconds=…` field), if `line` is it.
fn warm_up_seconds(line: &str) -> Option<f64> {
    if !line.contains("warmed the batch sizes up") {
        return None;
    }
    let (_, rest) = line.split_once("seconds=")?;
    rest.split(|c: char| c.is_whitespace() || c == ',').next()?.parse().ok()
}

/// The most memory the worker used over a span: device memory as nvidia-smi reports it for the worker's process
/// (CUDA context included, as the CUDA table samples every process), and resident host memory.
#[derive(Clone, Copy, Default)]
struct Peak {
    device_mib: Option<u64>,
    rss_mib: Option<u64>,
}

impl Peak {
    fn json(self) -> Value {
        json!({ "device_mib": self.device_mib, "rss_mib": self.rss_mib })
    }
}

impl std::fmt::Display for Peak {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |v: Option<u64>| v.map_or_else(|| "—".to_string(), |v| format!("{v} MiB"));
        write!(f, "peak device {}, RSS {}", mib(self.device_mib), mib(self.rss_mib))
    }
}

/// Samples the worker's memory every [`SAMPLE_EVERY`] on a thread of its own; `take` reads the peak since the last
/// `take`, `overall` the peak since the start. Without nvidia-smi (a CPU worker) the device figures stay empty.
struct MemorySampler {
    stop: Arc<AtomicBool>,
    /// Since the last `take`, then over the whole run; `UNSEEN` until a sample was seen.
    device_mib: [Arc<AtomicU64>; 2],
    rss_kib: [Arc<AtomicU64>; 2],
    thread: Option<std::thread::JoinHandle<()>>,
}

const UNSEEN: u64 = u64::MAX;

impl MemorySampler {
    fn start(pid: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let peaks = || [Arc::new(AtomicU64::new(UNSEEN)), Arc::new(AtomicU64::new(UNSEEN))];
        let (device_mib, rss_kib) = (peaks(), peaks());
        let thread = {
            let (stop, device_mib, rss_kib) = (stop.clone(), device_mib.clone(), rss_kib.clone());
            std::thread::spawn(move || {
                let mut smi = true;
                while !stop.load(Ordering::Relaxed) {
                    if let Some(kib) = rss_kib_of(pid) {
                        rss_kib.iter().for_each(|p| raise(p, kib));
                    }
                    if smi {
                        match device_mib_of(pid) {
                            Ok(Some(mib)) => device_mib.iter().for_each(|p| raise(p, mib)),
                            Ok(None) => {}
                            Err(_) => smi = false,
                        }
                    }
                    std::thread::sleep(SAMPLE_EVERY);
                }
            })
        };
        MemorySampler { stop, device_mib, rss_kib, thread: Some(thread) }
    }

    fn take(&self) -> Peak {
        let seen = |v: u64| (v != UNSEEN).then_some(v);
        Peak {
            device_mib: seen(self.device_mib[0].swap(UNSEEN, Ordering::Relaxed)),
            rss_mib: seen(self.rss_kib[0].swap(UNSEEN, Ordering::Relaxed)).map(|k| k / 1024),
        }
    }

    /// The peak over the whole run so far.
    fn overall(&self) -> Peak {
        let seen = |v: u64| (v != UNSEEN).then_some(v);
        Peak {
            device_mib: seen(self.device_mib[1].load(Ordering::Relaxed)),
            rss_mib: seen(self.rss_kib[1].load(Ordering::Relaxed)).map(|k| k / 1024),
        }
    }
}

impl Drop for MemorySampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Raises a peak (`UNSEEN` counts as nothing yet).
fn raise(peak: &AtomicU64, v: u64) {
    let _ = peak.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |p| (p == UNSEEN || v > p).then_some(v));
}

fn rss_kib_of(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The worker's device memory per nvidia-smi, in MiB (`Ok(None)`: it has no CUDA context yet); `Err` when
/// nvidia-smi cannot run here.
fn device_mib_of(pid: u32) -> Result<Option<u64>> {
    let out = Command::new("nvidia-smi")
        .args(["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"])
        .stderr(Stdio::null())
        .output()
        .context("running nvidia-smi")?;
    ensure!(out.status.success(), "nvidia-smi failed");
    Ok(parse_compute_apps(&String::from_utf8_lossy(&out.stdout), pid))
}

/// `pid, MiB` lines (nvidia-smi's `--query-compute-apps=pid,used_memory` CSV): the sum of `pid`'s lines.
fn parse_compute_apps(csv: &str, pid: u32) -> Option<u64> {
    let mut total = None;
    for line in csv.lines() {
        let mut fields = line.split(',').map(str::trim);
        let (Some(p), Some(mib)) = (fields.next(), fields.next()) else { continue };
        if p.parse::<u32>().ok() == Some(pid) {
            if let Ok(mib) = mib.parse::<u64>() {
                total = Some(total.unwrap_or(0) + mib);
            }
        }
    }
    total
}

/// `(sum, count)` of a histogram in the Prometheus text format.
fn histogram_totals(text: &str, name: &str) -> Option<(f64, f64)> {
    let value = |suffix: &str| -> Option<f64> {
        let key = format!("{name}_{suffix} ");
        text.lines().find_map(|l| l.strip_prefix(&key)).and_then(|v| v.trim().parse().ok())
    };
    Some((value("sum")?, value("count")?))
}

/// An A1111 txt2img answer holds one base64 PNG of `size`².
fn check_a1111_answer(body: &[u8], size: u32) -> Result<()> {
    let answer: Value = serde_json::from_slice(body).context("the txt2img answer is not JSON")?;
    let images = answer["images"].as_array().context("the txt2img answer has no `images` list")?;
    ensure!(images.len() == 1, "the txt2img answer has {} images, expected 1", images.len());
    let b64 = images[0].as_str().context("`images[0]` is not a string")?;
    let png = base64::engine::general_purpose::STANDARD.decode(b64).context("`images[0]` is not base64")?;
    let (w, h) = png_size(&png).context("`images[0]` is not a PNG")?;
    ensure!((w, h) == (size, size), "the answer's image is {w}×{h}, expected {size}×{size}");
    Ok(())
}

/// Width and height from a PNG's header chunk.
fn png_size(png: &[u8]) -> Option<(u32, u32)> {
    const SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";
    if png.len() < 24 || !png.starts_with(SIGNATURE) || &png[12..16] != b"IHDR" {
        return None;
    }
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    Some((be(&png[16..20]), be(&png[20..24])))
}

fn excerpt(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    text.chars().take(400).collect()
}

const SEED_BASE: u64 = 1000;

const SUBJECTS: [&str; 12] = [
    "a red fox",
    "an old lighthouse",
    "a bowl of ramen",
    "a vintage motorcycle",
    "a snowy mountain cabin",
    "a portrait of an astronaut",
    "a field of sunflowers",
    "a steampunk airship",
    "a cat sleeping on a windowsill",
    "a medieval castle",
    "a neon-lit street market",
    "a koi pond",
];
const PLACES: [&str; 6] =
    ["at dawn", "in the rain", "under a starry sky", "in autumn", "at golden hour", "in thick fog"];
const STYLES: [&str; 5] = [
    "highly detailed photograph",
    "oil painting",
    "watercolor illustration",
    "cinematic lighting, 35mm",
    "digital art, trending on artstation",
];
const NEGATIVE: [&str; 4] =
    ["blurry", "lowres, watermark", "deformed, bad anatomy", "oversaturated, jpeg artifacts"];

/// The `i`-th request's prompt: subjects, places and styles combined, so consecutive requests differ.
fn prompt(i: u64) -> String {
    let (s, p, t) = (SUBJECTS.len() as u64, PLACES.len() as u64, STYLES.len() as u64);
    format!(
        "{} {}, {}",
        SUBJECTS[(i % s) as usize],
        PLACES[((i / s) % p) as usize],
        STYLES[((i / (s * p)) % t) as usize]
    )
}

fn median(v: &[f64]) -> f64 {
    percentile(v, 50.0)
}

/// Linear interpolation between closest ranks (numpy's default).
fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut sorted = v.to_vec();
    sorted.sort_by(f64::total_cmp);
    let pos = q / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

/// A `Server-Timing` header's metrics with a duration (`name;dur=ms`), in order.
fn server_timing(header: &str) -> Vec<(String, f64)> {
    header
        .split(',')
        .filter_map(|metric| {
            let mut fields = metric.split(';').map(str::trim);
            let name = fields.next()?.to_string();
            let dur = fields.find_map(|f| f.strip_prefix("dur="))?.parse().ok()?;
            Some((name, dur))
        })
        .collect()
}

/// Where the single-client requests' time went: the worker's `Server-Timing` metrics per request, and the
/// client's wait beyond the engine's part (the HTTP path's cost: routing, encoding, the answer's JSON, the
/// transfer and the client's read).
#[derive(Default)]
struct Parts {
    by_name: Vec<(String, Vec<f64>)>,
    over_engine: Vec<f64>,
}

impl Parts {
    fn add(&mut self, client_ms: f64, timing: &[(String, f64)]) {
        for (name, ms) in timing {
            match self.by_name.iter_mut().find(|(n, _)| n == name) {
                Some((_, all)) => all.push(*ms),
                None => self.by_name.push((name.clone(), vec![*ms])),
            }
            if name == "engine" {
                self.over_engine.push(client_ms - ms);
            }
        }
    }

    /// `null` where the worker sent no timing.
    fn json(&self) -> Value {
        if self.by_name.is_empty() {
            return Value::Null;
        }
        let mut out: serde_json::Map<String, Value> =
            self.by_name.iter().map(|(name, ms)| (name.clone(), summary(ms))).collect();
        out.insert("over_engine".into(), summary(&self.over_engine));
        Value::Object(out)
    }
}

fn summary(ms: &[f64]) -> Value {
    let mean = ms.iter().sum::<f64>() / ms.len().max(1) as f64;
    json!({
        "n": ms.len(),
        "median_ms": median(ms),
        "p90_ms": percentile(ms, 90.0),
        "mean_ms": mean,
        "min_ms": ms.iter().copied().fold(f64::INFINITY, f64::min),
        "max_ms": ms.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        "ms": ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_warm_up_seconds_come_from_the_engine_log_line() {
        let line = "2026-11-30T00:01:02.345Z  INFO sdhive_engine::batch: warmed the batch sizes up sizes=8 seconds=6.25";
        assert_eq!(warm_up_seconds(line), Some(6.25));
        assert_eq!(warm_up_seconds("INFO x: warmed the batch sizes up sizes=8"), None);
        assert_eq!(warm_up_seconds("INFO x: model loaded; ready seconds=3.0"), None);
    }

    #[test]
    fn server_timing_metrics_and_the_time_over_the_engine() {
        let timing = server_timing(
            "queue;dur=0.05, engine;dur=120.5, encode;dur=2.25, cache, total;desc=\"x\";dur=123",
        );
        let names: Vec<&str> = timing.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["queue", "engine", "encode", "total"]);
        assert_eq!(timing[3].1, 123.0);
        let mut parts = Parts::default();
        parts.add(126.5, &timing);
        parts.add(130.0, &server_timing("engine;dur=125"));
        let json = parts.json();
        assert_eq!(json["over_engine"]["ms"], json!([6.0, 5.0]));
        assert_eq!(json["engine"]["n"], 2);
        assert_eq!(json["total"]["n"], 1);
        assert_eq!(Parts::default().json(), Value::Null);
    }

    /// A PNG's signature and header chunk (what `png_size` reads), CRC left zero.
    fn png_header(w: u32, h: u32) -> Vec<u8> {
        let mut png = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
        png.extend(w.to_be_bytes());
        png.extend(h.to_be_bytes());
        png.extend([8, 2, 0, 0, 0, 0, 0, 0, 0]);
        png
    }

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let v = [4.0, 1.0, 3.0, 2.0];
        assert_eq!(percentile(&v, 50.0), 2.5);
        assert!((percentile(&v, 90.0) - 3.7).abs() < 1e-12);
        assert_eq!(percentile(&[7.0], 90.0), 7.0);
        assert!(percentile(&[], 50.0).is_nan());
    }

    #[test]
    fn compute_apps_are_summed_for_the_pid_only() {
        let csv = "4242, 3540\n17, 900\n4242, 12\nnot a line\n";
        assert_eq!(parse_compute_apps(csv, 4242), Some(3552));
        assert_eq!(parse_compute_apps(csv, 17), Some(900));
        assert_eq!(parse_compute_apps(csv, 5), None);
        assert_eq!(parse_compute_apps("", 5), None);
    }

    #[test]
    fn png_size_reads_the_header_and_refuses_other_bytes() {
        let png = png_header(24, 16);
        assert_eq!(png_size(&png), Some((24, 16)));
        assert_eq!(png_size(b"GIF89a"), None);
        assert_eq!(png_size(&png[..20]), None);
    }

    #[test]
    fn answers_are_checked_for_one_png_of_the_size() {
        let png = png_header(8, 8);
        let b64 = base64::engine::general_purpose::STANDARD.encode(&png);
        let one = json!({"images": [b64]}).to_string();
        assert!(check_a1111_answer(one.as_bytes(), 8).is_ok());
        let err = check_a1111_answer(one.as_bytes(), 16).unwrap_err().to_string();
        assert!(err.contains("8×8"), "{err}");
        let two = json!({"images": [b64, b64]}).to_string();
        assert!(check_a1111_answer(two.as_bytes(), 8).is_err());
        assert!(check_a1111_answer(b"{\"images\": [\"not base64!\"]}", 8).is_err());
        assert!(check_a1111_answer(b"<html>", 8).is_err());
    }

    #[test]
    fn histogram_totals_are_read_from_the_exposition_format() {
        let text = "# HELP sdhive_batch_images x\nsdhive_batch_images_bucket{le=\"1\"} 3\n\
                    sdhive_batch_images_sum 28\nsdhive_batch_images_count 5\nsdhive_step_seconds_sum 1.5\n";
        assert_eq!(histogram_totals(text, "sdhive_batch_images"), Some((28.0, 5.0)));
        assert_eq!(histogram_totals(text, "sdhive_step_seconds"), None);
        assert_eq!(histogram_totals("", "sdhive_batch_images"), None);
    }

    #[test]
    fn consecutive_prompts_differ() {
        let prompts: std::collections::HashSet<String> = (0..200).map(prompt).collect();
        assert_eq!(prompts.len(), 200);
    }
}
