//! The serving-overhead benchmark that `cargo xtask bench serve` runs (ignored in normal test runs): the same
//! request through `Engine::generate` directly and through synchronous `POST /v1/images/generations` on
//! loopback, and the delay from the engine's progress callback to the client reading the matching SSE
//! `progress` event. Server and client share this process, so both ends read one monotonic clock.

mod common;

use common::{config, fixture_engine, start_with, SseReader};
use sdhive_engine::{
    Control, Engine, EngineError, EngineInfo, GenerateOutput, GenerateRequest, Progress, Sampler,
};
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// (step, when the engine reported it) for the job currently running.
type StepLog = Arc<Mutex<Vec<(u32, Instant)>>>;

/// Wraps the fixture engine to note when each progress callback fires, before the server sees it.
struct TimedEngine {
    inner: Box<dyn Engine>,
    log: StepLog,
}

impl Engine for TimedEngine {
    fn info(&self) -> EngineInfo {
        self.inner.info()
    }

    fn generate(
        &mut self,
        req: &GenerateRequest,
        progress: &mut dyn FnMut(&Progress) -> Control,
    ) -> Result<GenerateOutput, EngineError> {
        let log = self.log.clone();
        self.inner.generate(req, &mut |p| {
            if let Ok(mut log) = log.lock() {
                log.push((p.step, Instant::now()));
            }
            progress(p)
        })
    }
}

fn iters() -> usize {
    std::env::var("SDHIVE_BENCH_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(20).max(1)
}

/// (mean, p50) in milliseconds.
fn stats(samples: &mut [f64]) -> (f64, f64) {
    samples.sort_by(f64::total_cmp);
    let mean = samples.iter().sum::<f64>() / samples.len() as f64;
    (mean, samples[samples.len() / 2])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run with `cargo xtask bench serve`"]
async fn serving_overhead() {
    let n = iters();
    let steps = 4u32;
    let log: StepLog = Arc::default();
    let loader_log = log.clone();
    let loader: sdhive_server::EngineLoader = Box::new(move || {
        Ok(Box::new(TimedEngine { inner: Box::new(fixture_engine()), log: loader_log }) as _)
    });
    let server = start_with(config(), loader, None).await;

    // Direct and HTTP runs alternate, so load from anything else on the machine hits both alike. Direct: the
    // engine alone on a blocking thread, like the server's engine thread. HTTP: the same request through the
    // synchronous OpenAI route, PNG encoding and base64 in the response included. Run 0 of each is warm-up.
    let req = GenerateRequest {
        prompt: "a red cube".into(),
        steps,
        cfg_scale: 7.0,
        seed: Some(7),
        width: Some(64),
        height: Some(64),
        sampler: Sampler::EulerA,
        ..Default::default()
    };
    let body = json!({"prompt": "a red cube", "size": "64x64", "n": 1, "steps": steps, "seed": 7,
                      "sampler": "Euler a", "cfg_scale": 7.0, "response_format": "b64_json"});
    let mut engine = fixture_engine();
    let (mut direct, mut http) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..=n {
        let req = req.clone();
        let (back, ms) = tokio::task::spawn_blocking(move || {
            let t = Instant::now();
            engine.generate(&req, &mut |_| Control::Continue).expect("generate");
            (engine, t.elapsed().as_secs_f64() * 1e3)
        })
        .await
        .expect("direct run");
        engine = back;

        let t = Instant::now();
        let r = server.post_json("/v1/images/generations", &body).await;
        assert_eq!(r.status(), 200);
        let v: serde_json::Value = r.json().await.expect("json");
        assert!(v["data"][0]["b64_json"].is_string());
        if i > 0 {
            direct.push(ms);
            http.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }

    // SSE: engine callback → client has parsed the `progress` event for that step.
    let mut sse_lat = Vec::new();
    for i in 0..n {
        log.lock().expect("log").clear();
        let id = server
            .submit(&json!({"prompt": "a red cube", "steps": steps, "seed": i, "width": 64,
                                       "height": 64}))
            .await;
        let r = server.get(&format!("/v1/jobs/{id}/events")).await;
        let mut sse = SseReader::new(r);
        while let Some(e) = tokio::time::timeout(Duration::from_secs(60), sse.next()).await.expect("event") {
            let received = Instant::now();
            if e.event == "progress" {
                let step = e.data["step"].as_u64().expect("step") as u32;
                let sent = log.lock().expect("log").iter().find(|(s, _)| *s == step).map(|(_, t)| *t);
                // Steps that ran before the subscription are replayed, not live: leave them out.
                if let Some(sent) = sent.filter(|_| step > 1) {
                    sse_lat.push(received.duration_since(sent).as_secs_f64() * 1e3);
                }
            }
        }
    }

    let (d_mean, d_p50) = stats(&mut direct);
    let (h_mean, h_p50) = stats(&mut http);
    let (s_mean, s_p50) = stats(&mut sse_lat);
    let s_max = sse_lat.iter().copied().fold(0.0, f64::max);
    println!("\nserving overhead, fixture model, 64x64, {steps} steps, {n} runs each");
    println!("| measure                               | mean ms | p50 ms |");
    println!("|---------------------------------------|---------|--------|");
    println!("| Engine::generate direct               | {d_mean:7.2} | {d_p50:6.2} |");
    println!("| POST /v1/images/generations (b64)     | {h_mean:7.2} | {h_p50:6.2} |");
    println!("| HTTP overhead (difference)            | {:7.2} | {:6.2} |", h_mean - d_mean, h_p50 - d_p50);
    println!("| SSE progress latency (callback→client)| {s_mean:7.2} | {s_p50:6.2} |");
    println!("SSE samples {}, max {s_max:.2} ms; HTTP overhead target < 5 ms", sse_lat.len());
    server.shutdown().await.expect("shutdown");
}
