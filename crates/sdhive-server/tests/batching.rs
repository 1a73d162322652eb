//! Batching of queued jobs (`max_batch`) on the tiny fixture model: compatible jobs queued behind a running one
//! are denoised together, each with its own prompt, negative prompt, seed and CFG scale, and every image equals
//! the image of a worker that runs one job at a time; a job of another size or step count waits for its own
//! batch; cancelling one job of a running batch ends only that job; A1111's `batch_size` takes the same path.

mod common;

use common::{config, decode_png_b64, start, TestServer};
use sdhive_engine::RgbImage;
use sdhive_protocol::JobState;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

async fn server(max_batch: u32) -> TestServer {
    start(sdhive_server::ServerConfig { max_batch, ..config() }).await
}

fn job(prompt: &str, seed: u64, cfg_scale: f32, steps: u32) -> Value {
    json!({"prompt": prompt, "seed": seed, "cfg_scale": cfg_scale, "steps": steps, "width": 64, "height": 64,
           "sampler": "Euler a"})
}

/// The jobs of one comparison: a blocker that runs alone and keeps the engine busy while the rest queue, then
/// compatible jobs with mixed prompts, seeds, scales and image counts, and one of another step count.
fn mix() -> Vec<Value> {
    let mut negative = job("a blue ball", 5, 3.5, 6);
    negative["negative_prompt"] = json!("blurry");
    let mut two = job("two of a kind", 7, 7.0, 6);
    two["n"] = json!(2);
    vec![
        job("the blocker", 1, 7.0, 120),
        job("a red cube", 2, 7.0, 6),
        negative,
        two,
        job("a green cone", 9, 9.0, 6),
        job("other steps", 3, 7.0, 7),
    ]
}

async fn images(server: &TestServer, ids: &[String]) -> Vec<Vec<RgbImage>> {
    let mut out = Vec::new();
    for id in ids {
        let done = server.wait_done(id).await;
        assert_eq!(done.state, JobState::Succeeded, "{id}: {:?}", done.error);
        out.push(done.images.iter().map(|i| decode_png_b64(&i.png_base64)).collect());
    }
    out
}

/// `(count of engine calls, count with more than one image)` from the batch-size histogram.
async fn batches(server: &TestServer) -> (u64, u64) {
    let text = server.get("/metrics").await.text().await.expect("metrics");
    let value = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
            .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{text}"))
    };
    let all = value("sdhive_batch_images_count ");
    (all, all - value("sdhive_batch_images_bucket{le=\"1\"} "))
}

/// Within the CPU parity tests' tolerance: no channel value more than one level off.
fn assert_close(what: &str, got: &[RgbImage], want: &[RgbImage]) {
    assert_eq!(got.len(), want.len(), "{what}: image count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let max = g.data.iter().zip(&w.data).map(|(a, b)| a.abs_diff(*b)).max().unwrap_or(0);
        assert!(max <= 1, "{what} image {i}: batched differs from one-at-a-time by {max} levels");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queued_compatible_jobs_run_as_one_batch_with_their_own_images() {
    let batched = server(8).await;
    let single = server(1).await;
    let mut got_ids = Vec::new();
    for body in mix() {
        got_ids.push(batched.submit(&body).await);
    }
    let mut want_ids = Vec::new();
    for body in mix() {
        want_ids.push(single.submit(&body).await);
    }
    let got = images(&batched, &got_ids).await;
    let want = images(&single, &want_ids).await;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_close(&format!("job {i}"), g, w);
    }
    assert_ne!(got[1][0].data, got[2][0].data, "different prompts and seeds gave one image");
    // The blocker alone, the four compatible jobs (five images) together, the other step count alone.
    let (calls, multi) = batches(&batched).await;
    assert_eq!((calls, multi), (3, 1), "engine calls / calls with several images");
    let (calls, multi) = batches(&single).await;
    assert_eq!((calls, multi), (6, 0), "one at a time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancelling_one_job_of_a_batch_ends_only_it() {
    let batched = server(8).await;
    let single = server(1).await;
    let slow = |prompt: &str, seed: u64, cfg_scale: f32| job(prompt, seed, cfg_scale, 60);
    let bodies = [
        job("the blocker", 1, 7.0, 30),
        slow("kept", 2, 7.0),
        slow("cancelled", 3, 7.0),
        slow("kept too", 4, 5.0),
    ];
    let mut ids = Vec::new();
    for body in &bodies {
        ids.push(batched.submit(body).await);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let states: Vec<JobState> = {
            let mut s = Vec::new();
            for id in &ids[1..] {
                s.push(batched.job(id).await.state);
            }
            s
        };
        if states.iter().all(|s| *s == JobState::Running) {
            break;
        }
        assert!(states.iter().all(|s| !s.is_terminal()), "a batched job ended before the cancel: {states:?}");
        assert!(Instant::now() < deadline, "the batch never started: {states:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let r = batched
        .client
        .post(batched.url(&format!("/v1/jobs/{}/cancel", ids[2])))
        .send()
        .await
        .expect("cancel");
    assert!(r.status().is_success(), "cancel: {}", r.status());
    let cancelled = batched.wait_done(&ids[2]).await;
    assert_eq!(cancelled.state, JobState::Cancelled);
    assert!(cancelled.step < 60, "cancelled after its last step");
    let kept = images(&batched, &[ids[1].clone(), ids[3].clone()]).await;
    let mut want_ids = Vec::new();
    for body in [&bodies[1], &bodies[3]] {
        want_ids.push(single.submit(body).await);
    }
    let want = images(&single, &want_ids).await;
    assert_close("kept", &kept[0], &want[0]);
    assert_close("kept too", &kept[1], &want[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a1111_batch_size_denoises_together_and_equals_one_at_a_time() {
    let body = json!({"prompt": "a red cube", "seed": 11, "steps": 5, "width": 64, "height": 64,
                      "sampler_name": "Euler a", "cfg_scale": 6, "batch_size": 3});
    let mut results = Vec::new();
    for max_batch in [8, 1] {
        let s = server(max_batch).await;
        let r = s.post_json("/sdapi/v1/txt2img", &body).await;
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.expect("json");
        let imgs: Vec<RgbImage> = v["images"]
            .as_array()
            .expect("images")
            .iter()
            .map(|b| decode_png_b64(b.as_str().expect("b64")))
            .collect();
        results.push((imgs, batches(&s).await));
    }
    assert_eq!(results[0].1, (1, 1), "batch_size 3 as one engine call of three images");
    assert_eq!(results[1].1, (1, 0));
    assert_close("batch_size", &results[0].0, &results[1].0);
    assert_ne!(results[0].0[0].data, results[0].0[1].data, "seed and seed+1 gave one image");
}
