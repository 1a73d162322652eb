//! Bounded loopback load test against the tiny fixture model: 200 mixed jobs over the native, OpenAI and
//! A1111 routes from 16 concurrent clients, about a tenth of them deliberately invalid, a few cancelled on
//! purpose, with a small queue so back-pressure (429 + `Retry-After`) is exercised. Checks that every bad
//! request gets its 4xx JSON error, every accepted job ends terminal, and resident memory stays flat.

mod common;

use common::{config, start, TestServer};
use sdhive_protocol::JobState;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const JOBS: usize = 200;
const CLIENTS: usize = 16;
const WARMUP: usize = 20;
/// Allowed RSS growth between the post-warm-up sample and the end: allocator slack, not a leak budget.
const RSS_SLACK_KIB: u64 = 64 * 1024;

#[derive(Default)]
struct Counters {
    succeeded: AtomicUsize,
    cancelled: AtomicUsize,
    rejected: AtomicUsize,
    retried_429: AtomicUsize,
}

/// What one job of the mix is.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Native,
    NativeCancel,
    OpenAi,
    A1111,
    Invalid(usize),
}

fn kind_of(i: usize) -> Kind {
    if i % 10 == 9 {
        Kind::Invalid(i / 10)
    } else if i % 25 == 3 {
        Kind::NativeCancel
    } else {
        match i % 3 {
            0 => Kind::Native,
            1 => Kind::OpenAi,
            _ => Kind::A1111,
        }
    }
}

fn vm_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS line")
}

/// Sends a request, sleeping out `Retry-After` on 429 (capped, so the test stays bounded) and retrying.
async fn send(server: &TestServer, path: &str, body: String, counters: &Counters) -> (u16, Value) {
    for _ in 0..200 {
        let r = server
            .client
            .post(server.url(path))
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .expect("POST");
        let status = r.status().as_u16();
        if status == 429 {
            let secs: u64 = r
                .headers()
                .get("retry-after")
                .expect("429 carries Retry-After")
                .to_str()
                .expect("ascii")
                .parse()
                .expect("seconds");
            assert!(secs >= 1);
            counters.retried_429.fetch_add(1, Ordering::Relaxed);
            // Honour the hint, but cap it: the queue drains in well under a second with 1-step jobs.
            tokio::time::sleep(Duration::from_millis((secs * 1000).min(1000))).await;
            continue;
        }
        let text = r.text().await.expect("body");
        let value =
            serde_json::from_str(&text).unwrap_or_else(|_| panic!("{path} {status}: not JSON: {text}"));
        return (status, value);
    }
    panic!("{path}: still 429 after 200 tries");
}

async fn run_one(server: &TestServer, i: usize, counters: &Counters) {
    let steps = 1 + (i % 2) as u64;
    let prompt = format!("load test job {i}");
    match kind_of(i) {
        Kind::Native | Kind::NativeCancel => {
            let body = json!({"prompt": prompt, "steps": steps, "seed": i, "width": 64, "height": 64});
            let (status, v) = send(server, "/v1/jobs", body.to_string(), counters).await;
            assert_eq!(status, 202, "{v}");
            let id = v["id"].as_str().expect("id").to_string();
            let cancel = matches!(kind_of(i), Kind::NativeCancel);
            if cancel {
                let r = server
                    .client
                    .post(server.url(&format!("/v1/jobs/{id}/cancel")))
                    .send()
                    .await
                    .expect("cancel");
                // Too late (already finished) is a 409, not a failure of the server.
                assert!(r.status().is_success() || r.status() == 409, "cancel: {}", r.status());
            }
            let job = server.wait_done(&id).await;
            match job.state {
                JobState::Succeeded => {
                    assert_eq!(job.images.len(), 1);
                    counters.succeeded.fetch_add(1, Ordering::Relaxed);
                }
                JobState::Cancelled if cancel => {
                    counters.cancelled.fetch_add(1, Ordering::Relaxed);
                }
                other => panic!("job {i} ended {other:?}: {:?}", job.error),
            }
        }
        Kind::OpenAi => {
            let body = json!({"prompt": prompt, "size": "64x64", "n": 1, "steps": steps, "seed": i,
                              "response_format": "b64_json"});
            let (status, v) = send(server, "/v1/images/generations", body.to_string(), counters).await;
            assert_eq!(status, 200, "{v}");
            assert!(v["data"][0]["b64_json"].as_str().is_some_and(|s| !s.is_empty()), "{v}");
            counters.succeeded.fetch_add(1, Ordering::Relaxed);
        }
        Kind::A1111 => {
            let body = json!({"prompt": prompt, "width": 64, "height": 64, "steps": steps, "seed": i});
            let (status, v) = send(server, "/sdapi/v1/txt2img", body.to_string(), counters).await;
            assert_eq!(status, 200, "{v}");
            assert_eq!(v["images"].as_array().map(Vec::len), Some(1), "{v}");
            counters.succeeded.fetch_add(1, Ordering::Relaxed);
        }
        Kind::Invalid(n) => {
            let (path, body) = match n % 6 {
                0 => ("/v1/jobs", json!({"prompt": prompt, "width": 65, "height": 64}).to_string()),
                1 => ("/v1/jobs", json!({"prompt": prompt, "steps": 0}).to_string()),
                2 => (
                    "/v1/jobs",
                    json!({"prompt": prompt, "steps": 1, "sampler": "no such sampler"}).to_string(),
                ),
                3 => ("/v1/jobs", "{\"prompt\": \"unterminated".to_string()),
                4 => ("/v1/images/generations", "{\"prompt\": [".to_string()),
                _ => ("/sdapi/v1/txt2img", "not json at all".to_string()),
            };
            let (status, v) = send(server, path, body, counters).await;
            assert!((400..500).contains(&status), "invalid job {i} on {path} got {status}: {v}");
            assert!(v.get("error").is_some(), "error body: {v}");
            counters.rejected.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mixed_load_stays_correct_and_flat() {
    let started = Instant::now();
    let mut cfg = config();
    // Small enough that 16 clients overflow it and see 429s.
    cfg.max_queue = 6;
    // Batching on, as GPU workers run: compatible queued jobs share engine calls.
    cfg.max_batch = 4;
    let server = Arc::new(start(cfg).await);
    let counters = Arc::new(Counters::default());

    let outcome = tokio::time::timeout(Duration::from_secs(240), async {
        // Warm-up: allocator arenas, tokenizer and weight caches, connection pools reach steady state.
        for i in 0..WARMUP {
            let body = json!({"prompt": "warm-up", "steps": 1, "seed": i, "width": 64, "height": 64});
            let id = server.submit(&body).await;
            assert_eq!(server.wait_done(&id).await.state, JobState::Succeeded);
        }
        let rss_before = vm_rss_kib();

        let next = Arc::new(AtomicUsize::new(0));
        let mut clients = Vec::new();
        for _ in 0..CLIENTS {
            let (server, counters, next) = (server.clone(), counters.clone(), next.clone());
            clients.push(tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= JOBS {
                        break;
                    }
                    run_one(&server, i, &counters).await;
                }
            }));
        }
        for c in clients {
            c.await.expect("client task panicked");
        }
        (rss_before, vm_rss_kib())
    })
    .await;
    let (rss_before, rss_after) = outcome.expect("load test finished within its time bound");

    let succeeded = counters.succeeded.load(Ordering::Relaxed);
    let cancelled = counters.cancelled.load(Ordering::Relaxed);
    let rejected = counters.rejected.load(Ordering::Relaxed);
    let retried = counters.retried_429.load(Ordering::Relaxed);
    println!(
        "load: {JOBS} jobs in {:.1} s: {succeeded} succeeded, {cancelled} cancelled, {rejected} rejected, \
         {retried} 429 retries; VmRSS after warm-up {} KiB, at end {} KiB",
        started.elapsed().as_secs_f64(),
        rss_before,
        rss_after
    );
    let invalid = (0..JOBS).filter(|&i| matches!(kind_of(i), Kind::Invalid(_))).count();
    assert_eq!(rejected, invalid);
    assert_eq!(succeeded + cancelled + rejected, JOBS);
    assert!(
        rss_after <= rss_before + RSS_SLACK_KIB,
        "RSS grew from {rss_before} KiB to {rss_after} KiB under load"
    );

    let server = Arc::try_unwrap(server).unwrap_or_else(|_| panic!("clients still hold the server"));
    server.shutdown().await.expect("clean shutdown");
}
