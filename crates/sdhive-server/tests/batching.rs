//! Batching of queued jobs (`max_batch`) on the tiny fixture model: compatible jobs queued behind a running one
//! are denoised together, each with its own prompt, negative prompt, seed and CFG scale, and every image equals
//! the image of a worker that runs one job at a time; a compatible job submitted while a batch runs joins it at
//! the next step and leaves when done; a job of another size or step count waits for its own batch, and a
//! compatible job queued behind it does not overtake it; cancelling one job of a running batch ends only that job;
//! A1111's `batch_size` takes the same path.

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

/// `(count of denoising steps, count with more than one image)` from the batch-size histogram.
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
    // The blocker's 120 steps alone, the four compatible jobs (five images) together for their 6 steps, the
    // other step count's 7 alone.
    let (steps, multi) = batches(&batched).await;
    assert_eq!((steps, multi), (133, 6), "denoising steps / steps with several images");
    // One at a time: every image's steps (the job of two images twice).
    let (steps, multi) = batches(&single).await;
    assert_eq!((steps, multi), (120 + 6 + 6 + 2 * 6 + 6 + 7, 0), "one at a time");
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
    assert_eq!(results[0].1, (5, 5), "batch_size 3: its 5 steps, each on its three images");
    assert_eq!(results[1].1, (15, 0));
    assert_close("batch_size", &results[0].0, &results[1].0);
    assert_ne!(results[0].0[0].data, results[0].0[1].data, "seed and seed+1 gave one image");
}

/// Waits until job `id` has reported `step` steps.
async fn until_step(server: &TestServer, id: &str, step: u32) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let job = server.job(id).await;
        assert!(!job.state.is_terminal(), "{id} ended before step {step}: {:?}", job.error);
        if job.step >= step {
            return;
        }
        assert!(Instant::now() < deadline, "{id} never reached step {step}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_submitted_while_a_batch_runs_joins_it_and_leaves_when_done() {
    let batched = server(8).await;
    let single = server(1).await;
    let running = job("running", 1, 7.0, 60);
    let mut joiner = job("joins mid-run", 2, 5.0, 60);
    joiner["negative_prompt"] = json!("blurry");
    let first = batched.submit(&running).await;
    until_step(&batched, &first, 5).await;
    let second = batched.submit(&joiner).await;
    let got = images(&batched, &[first.clone(), second.clone()]).await;
    let (a, b) = (batched.job(&first).await, batched.job(&second).await);
    // It joined at once (no wait for the running job's end) and the running job left before it, when done.
    let queued = b.queue_seconds.expect("queue time");
    assert!(queued < 0.5 * a.run_seconds.expect("run time"), "the newcomer waited {queued} s in the queue");
    assert!(a.finished_at < b.finished_at, "the first job left when it was done");
    let (_, multi) = batches(&batched).await;
    assert!(multi >= 30, "only {multi} steps ran both images");
    let want = images(&single, &[single.submit(&running).await, single.submit(&joiner).await]).await;
    assert_close("running", &got[0], &want[0]);
    assert_close("joined", &got[1], &want[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_compatible_job_does_not_overtake_an_incompatible_one_queued_before_it() {
    let batched = server(8).await;
    let first = batched.submit(&job("running", 1, 7.0, 40)).await;
    until_step(&batched, &first, 3).await;
    let other = batched.submit(&job("other steps", 2, 7.0, 8)).await;
    let behind = batched.submit(&job("compatible, queued behind", 3, 7.0, 40)).await;
    for id in [&first, &other, &behind] {
        let done = batched.wait_done(id).await;
        assert_eq!(done.state, JobState::Succeeded, "{id}: {:?}", done.error);
    }
    let (o, b) = (batched.job(&other).await, batched.job(&behind).await);
    assert!(
        o.started_at <= b.started_at,
        "the compatible job started at {:?}, before the job queued ahead of it ({:?})",
        b.started_at,
        o.started_at
    );
}
