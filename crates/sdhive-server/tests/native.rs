//! The native job API, ops routes, limits and auth over real loopback HTTP against the tiny fixture model:
//! results identical to the engine's own, SSE event order, cancellation (running and queued), back-pressure,
//! expiry, auth, bad input, engine panics, and the drain-on-shutdown path.

mod common;

use common::{config, decode_png_b64, fixture_engine, slow_loader, start, start_with, SlowEngine, SseReader};
use sdhive_engine::{
    Control, Engine, EngineError, EngineInfo, GenerateOutput, GenerateRequest, GeneratedImage, Progress,
    RgbImage, Sampler,
};
use sdhive_protocol::{JobErrorKind, JobState};
use sdhive_server::{AppState, EngineLoader, ServerConfig};
use serde_json::{json, Value};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submitted_job_matches_the_engine_output() {
    let server = start(config()).await;
    let body = json!({"prompt": "a red cube", "negative_prompt": "blurry", "steps": 4, "seed": 42,
                      "sampler": "Euler a", "cfg_scale": 5.0, "n": 2});
    let r = server.post_json("/v1/jobs", &body).await;
    assert_eq!(r.status(), 202);
    let location = r.headers()["location"].to_str().unwrap().to_string();
    let accepted: Value = r.json().await.unwrap();
    let id = accepted["id"].as_str().unwrap().to_string();
    assert_eq!(location, format!("/v1/jobs/{id}"));
    assert!(matches!(accepted["state"].as_str(), Some("queued" | "running")), "{accepted}");
    assert_eq!(accepted["links"]["events"], format!("/v1/jobs/{id}/events"));

    let job = server.wait_done(&id).await;
    assert_eq!(job.state, JobState::Succeeded, "{:?}", job.error);
    assert_eq!(job.images.len(), 2);
    assert_eq!((job.step, job.total_steps, job.images_total), (4, 4, 2));
    assert!(job.started_at.is_some() && job.finished_at.is_some() && job.run_seconds.is_some());
    assert_eq!(job.request.seed, 42);

    let mut engine = fixture_engine();
    let req = GenerateRequest {
        prompt: "a red cube".into(),
        negative_prompt: "blurry".into(),
        steps: 4,
        cfg_scale: 5.0,
        seed: Some(42),
        n: 2,
        sampler: Sampler::EulerA,
        ..Default::default()
    };
    let reference = engine.generate(&req, &mut |_| Control::Continue).unwrap();
    for (got, want) in job.images.iter().zip(&reference.images) {
        assert_eq!((got.format.as_str(), &got.image_base64), ("png", &got.png_base64));
        let img = decode_png_b64(&got.png_base64);
        assert_eq!((img.width, img.height), (got.width, got.height));
        assert_eq!(img, want.image, "pixels differ from the engine's own output");
        assert_eq!((got.seed, &got.infotext), (want.seed, &want.infotext));
    }
    server.shutdown().await.unwrap();
}

/// `output_format` / `output_quality`: the job's images come in that format (`format`, `image_base64`; the
/// old `png_base64` only for PNG), with the infotext inside, in the poll and in the `completed` event alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_deliver_the_output_format_asked_for() {
    let server = start(config()).await;
    let request = json!({"prompt": "a red cube", "steps": 2, "seed": 7});
    let want = {
        let req =
            GenerateRequest { prompt: "a red cube".into(), steps: 2, seed: Some(7), ..Default::default() };
        fixture_engine().generate(&req, &mut |_| Control::Continue).unwrap().images.remove(0)
    };
    let bytes_of = |image: &Value| {
        base64::Engine::decode(
            &base64::engine::general_purpose::STANDARD,
            image["image_base64"].as_str().expect("image_base64"),
        )
        .expect("base64")
    };
    for (format, quality, kind) in
        [("webp", None, image::ImageFormat::WebP), ("JPG", Some(40), image::ImageFormat::Jpeg)]
    {
        let mut body = request.clone();
        body["output_format"] = json!(format);
        if let Some(q) = quality {
            body["output_quality"] = json!(q);
        }
        let id = server.submit(&body).await;
        server.wait_done(&id).await;
        let job: Value = server.get(&format!("/v1/jobs/{id}")).await.json().await.unwrap();
        let image = &job["images"][0];
        let name = if format == "webp" { "webp" } else { "jpeg" };
        assert_eq!(image["format"], name, "{job}");
        assert!(image.get("png_base64").is_none(), "no PNG field for {format}: {image}");
        let bytes = bytes_of(image);
        assert_eq!(image::guess_format(&bytes).unwrap(), kind);
        let got = sdhive_engine::decode_image(&bytes, 1 << 24).unwrap();
        if kind == image::ImageFormat::WebP {
            assert_eq!(got, want.image, "WebP is lossless");
        } else {
            assert_eq!((got.width, got.height), (want.image.width, want.image.height));
        }
        let info = server.post_json("/sdapi/v1/png-info", &json!({"image": image["image_base64"]})).await;
        let info: Value = info.json().await.unwrap();
        assert_eq!(info["info"], want.infotext, "{format}");

        // The completed event of a late subscriber carries the same image.
        let mut sse = SseReader::new(server.get(&format!("/v1/jobs/{id}/events")).await);
        let mut completed = None;
        while let Some(e) = sse.next().await {
            if e.event == "completed" {
                completed = Some(e.data["images"][0].clone());
            }
        }
        let completed = completed.expect("a completed event");
        assert_eq!((&completed["format"], bytes_of(&completed)), (&image["format"], bytes));
    }
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_arrive_in_order() {
    let server = start(config()).await;
    let id = server.submit(&json!({"prompt": "x", "steps": 4, "seed": 1})).await;
    let r = server.get(&format!("/v1/jobs/{id}/events")).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let mut sse = SseReader::new(r);
    let mut names = Vec::new();
    let mut last_step = 0;
    while let Some(e) = sse.next().await {
        assert_eq!(e.data["event"], e.event.as_str());
        assert_eq!(e.data["id"], id.as_str());
        if e.event == "progress" {
            let step = e.data["step"].as_u64().unwrap();
            assert!(step > last_step, "steps go up: {step} after {last_step}");
            assert_eq!(e.data["total_steps"], 4);
            assert!(e.data["eta_seconds"].is_number());
            last_step = step;
        }
        if e.event == "completed" {
            let images = e.data["images"].as_array().unwrap();
            assert_eq!(images.len(), 1);
            decode_png_b64(images[0]["png_base64"].as_str().unwrap());
        }
        names.push(e.event);
    }
    assert_eq!(names.first().map(String::as_str), Some("queued"), "{names:?}");
    assert_eq!(names.get(1).map(String::as_str), Some("started"), "{names:?}");
    assert_eq!(names.last().map(String::as_str), Some("completed"), "{names:?}");
    assert!(names[2..names.len() - 1].iter().all(|n| n == "progress"), "{names:?}");
    assert_eq!(last_step, 4);

    // A late subscriber gets a condensed replay ending with the terminal event, then the stream ends.
    let mut sse = SseReader::new(server.get(&format!("/v1/jobs/{id}/events")).await);
    let mut late = Vec::new();
    while let Some(e) = sse.next().await {
        late.push(e.event);
    }
    assert_eq!(late, ["queued", "started", "progress", "completed"]);
    server.shutdown().await.unwrap();
}

/// `preview_every: 2` adds a `preview` event after steps 2 and 4: a PNG at latent resolution (64 px / 8),
/// `/v1/info` says previews are supported, and `/metrics` counts them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn previews_arrive_every_k_steps_at_latent_resolution() {
    let server = start(config()).await;
    let info: Value = server.get("/v1/info").await.json().await.unwrap();
    assert_eq!(info["capabilities"]["preview"], true, "{info}");
    let id = server.submit(&json!({"prompt": "x", "steps": 4, "seed": 1, "preview_every": 2})).await;
    let mut sse = SseReader::new(server.get(&format!("/v1/jobs/{id}/events")).await);
    let mut preview_steps = Vec::new();
    let mut last_progress = 0;
    while let Some(e) = sse.next().await {
        if e.event == "progress" {
            last_progress = e.data["step"].as_u64().unwrap();
        }
        if e.event == "preview" {
            assert_eq!(
                e.data["step"].as_u64().unwrap(),
                last_progress,
                "a preview follows its step's progress"
            );
            let img = decode_png_b64(e.data["png_base64"].as_str().unwrap());
            assert_eq!((img.width, img.height), (8, 8));
            assert!(img.data.iter().any(|&v| v != img.data[0]), "a preview with structure, not a flat fill");
            preview_steps.push(last_progress);
        }
    }
    assert_eq!(preview_steps, [2, 4]);
    let metrics = server.get("/metrics").await.text().await.unwrap();
    assert!(metrics.lines().any(|l| l == "sdhive_previews_total 2"), "previews counted:\n{metrics}");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_running_job_stops_within_one_step() {
    let server = start(config()).await;
    let id = server.submit(&json!({"prompt": "long", "steps": 150, "seed": 3})).await;
    let mut sse = SseReader::new(server.get(&format!("/v1/jobs/{id}/events")).await);
    loop {
        let e = sse.next().await.expect("events until progress");
        if e.event == "progress" {
            break;
        }
    }
    let r = server.client.post(server.url(&format!("/v1/jobs/{id}/cancel"))).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let at_cancel: Value = r.json().await.unwrap();
    let step_at_cancel = at_cancel["step"].as_u64().unwrap() as u32;
    let mut last = None;
    while let Some(e) = sse.next().await {
        last = Some(e);
    }
    let last = last.unwrap();
    assert_eq!(last.event, "cancelled", "{last:?}");
    let job = server.wait_done(&id).await;
    assert_eq!(job.state, JobState::Cancelled);
    assert!(job.step <= step_at_cancel + 1, "ran on to step {} after a cancel at {step_at_cancel}", job.step);
    assert!(job.step < 150);
    assert!(job.images.is_empty());
    // The worker goes on serving.
    let next = server.submit(&json!({"prompt": "after", "steps": 2, "seed": 4})).await;
    assert_eq!(server.wait_done(&next).await.state, JobState::Succeeded);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_cancel_and_queue_full() {
    // A slow stand-in engine keeps the blocker running for the whole test (150 × 20 ms).
    let loader = slow_loader(Duration::from_millis(20));
    let server = start_with(ServerConfig { max_queue: 1, ..config() }, loader, None).await;
    let blocker = server.submit(&json!({"prompt": "block", "steps": 150})).await;
    // Wait until it runs, so the queue slot is free.
    for _ in 0..500 {
        if server.job(&blocker).await.state == JobState::Running {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let queued = server.submit(&json!({"prompt": "wait", "steps": 2})).await;
    let snapshot = server.job(&queued).await;
    assert_eq!((snapshot.state, snapshot.queue_position), (JobState::Queued, Some(0)));

    let mut refused = 0;
    for _ in 0..3 {
        let r = server.post_json("/v1/jobs", &json!({"prompt": "more", "steps": 2})).await;
        assert_eq!(r.status(), 429);
        let retry: u64 = r.headers()["retry-after"].to_str().unwrap().parse().unwrap();
        assert!(retry >= 1);
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["code"], "queue_full");
        refused += 1;
    }
    assert_eq!(refused, 3);

    let r = server.client.post(server.url(&format!("/v1/jobs/{queued}/cancel"))).send().await.unwrap();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["state"], "cancelled");
    assert_eq!(server.job(&queued).await.state, JobState::Cancelled);
    assert_eq!(server.job(&queued).await.started_at, None);
    // The slot is free again.
    let again = server.submit(&json!({"prompt": "again", "steps": 2})).await;
    server.client.post(server.url(&format!("/v1/jobs/{blocker}/cancel"))).send().await.unwrap();
    assert_eq!(server.wait_done(&blocker).await.state, JobState::Cancelled);
    assert_eq!(server.wait_done(&again).await.state, JobState::Succeeded);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_jobs_expire_to_410_and_unknown_ids_are_404() {
    let server = start(ServerConfig { job_ttl: Duration::from_secs(1), ..config() }).await;
    let id = server.submit(&json!({"prompt": "x", "steps": 1})).await;
    assert_eq!(server.wait_done(&id).await.state, JobState::Succeeded);
    tokio::time::sleep(Duration::from_millis(1300)).await;
    for path in [format!("/v1/jobs/{id}"), format!("/v1/jobs/{id}/events")] {
        let r = server.get(&path).await;
        assert_eq!(r.status(), 410, "{path}");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["code"], "job_expired");
    }
    let r = server.get("/v1/jobs/job_nonexistent").await;
    assert_eq!(r.status(), 404);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["type"], "not_found_error");
    let r = server.client.post(server.url("/v1/jobs/nope/cancel")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_guards_everything_but_health() {
    let server = start(ServerConfig { api_key: Some("s3cret".into()), ..config() }).await;
    let anon = reqwest::Client::new();
    assert_eq!(anon.get(server.url("/health")).send().await.unwrap().status(), 200);
    for path in ["/ready", "/metrics", "/v1/info", "/v1/jobs/x"] {
        let r = anon.get(server.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 401, "{path}");
        let r = anon.get(server.url(path)).bearer_auth("wrong").send().await.unwrap();
        assert_eq!(r.status(), 401, "{path}");
    }
    let r = anon.post(server.url("/v1/jobs")).json(&json!({"prompt": "x"})).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["type"], "authentication_error");
    // The web page loads without the key (it asks for it); its API calls need it.
    for path in ["/", "/index.html", "/assets/app.js", "/assets/app.css"] {
        let r = anon.get(server.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
        if path == "/" {
            assert!(r.headers().contains_key("content-security-policy"), "the page has no CSP");
        }
    }
    let page = anon.get(server.url("/")).send().await.unwrap().text().await.unwrap();
    assert!(page.contains("/assets/app.js"), "{page}");
    assert_eq!(anon.get(server.url("/assets/nope.js")).send().await.unwrap().status(), 401);
    // `server.client` sends the right key.
    assert_eq!(server.get("/ready").await.status(), 200);
    assert_eq!(server.get("/v1/info").await.status(), 200);
    let id = server.submit(&json!({"prompt": "x", "steps": 1})).await;
    assert_eq!(server.wait_done(&id).await.state, JobState::Succeeded);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ops_routes_have_their_shapes() {
    let server = start(config()).await;
    let health: Value = server.get("/health").await.json().await.unwrap();
    assert_eq!(health["status"], "ok");
    let ready = server.get("/ready").await;
    assert_eq!(ready.status(), 200);

    let info: Value = server.get("/v1/info").await.json().await.unwrap();
    assert_eq!(info["backend"], "cpu");
    assert_eq!(info["engine"], "candle");
    assert_eq!(info["worker_id"], "test-worker");
    assert_eq!(info["dtype"], "f32");
    assert_eq!(info["device"]["name"], "cpu");
    assert!(info["model"]["name"].is_string());
    assert_eq!(info["model"]["requested"], "sd1-fixture");
    let caps = &info["capabilities"];
    assert!(caps["samplers"].as_array().unwrap().iter().any(|s| s == "Euler a"));
    assert_eq!(caps["schedulers"], json!(["Automatic", "Karras"]));
    assert_eq!((caps["max_width"].as_u64(), caps["max_steps"].as_u64()), (Some(2048), Some(150)));
    assert_eq!(caps["preview"], true);
    assert_eq!(caps["img2img"], true);
    assert_eq!(info["queue"]["max"], 64);

    let id = server.submit(&json!({"prompt": "x", "steps": 2})).await;
    server.wait_done(&id).await;
    let r = server.get("/metrics").await;
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/plain"));
    let text = r.text().await.unwrap();
    for needle in [
        "sdhive_jobs_total{state=\"queued\"} 1",
        "sdhive_jobs_total{state=\"succeeded\"} 1",
        "sdhive_queue_depth 0",
        "# TYPE sdhive_step_seconds histogram",
        "sdhive_step_seconds_count 1",
        "sdhive_generation_seconds_count 1",
        "sdhive_model_load_seconds ",
    ] {
        assert!(text.contains(needle), "missing `{needle}` in\n{text}");
    }
    let r = server.get("/no/such/route").await;
    assert_eq!(r.status(), 404);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_400_naming_the_field_and_huge_bodies_413() {
    let server = start(ServerConfig { max_body_bytes: 64 * 1024, ..config() }).await;
    let raw = server.client.post(server.url("/v1/jobs")).body("{nope").send().await.unwrap();
    assert_eq!(raw.status(), 400);
    let body: Value = raw.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_json");
    assert_eq!(body["error"]["type"], "invalid_request_error");

    for (request, param) in [
        (json!({"steps": 3}), "prompt"),
        (json!({"prompt": "a", "steps": 0}), "steps"),
        (json!({"prompt": "a", "steps": 151}), "steps"),
        (json!({"prompt": "a", "steps": "ten"}), "steps"),
        (json!({"prompt": "a", "width": 100}), "width"),
        (json!({"prompt": "a", "height": 4096}), "height"),
        (json!({"prompt": "a", "n": 9}), "n"),
        (json!({"prompt": "a", "cfg_scale": 1000}), "cfg_scale"),
        (json!({"prompt": "a", "seed": -7}), "seed"),
        (json!({"prompt": "a", "sampler": "Heun"}), "sampler"),
        (json!({"prompt": "a", "scheduler": "cosine"}), "scheduler"),
        (json!({"prompt": "a", "sampler": "DDIM", "scheduler": "Karras"}), "scheduler"),
        (json!({"prompt": "a", "init_image": "not base64!"}), "init_image"),
        (json!({"prompt": "a", "init_image": "aGVsbG8="}), "init_image"),
        (json!({"prompt": "a", "mask": "aGVsbG8="}), "mask"),
        (json!({"prompt": "a", "clip_skip": 0}), "clip_skip"),
        (json!({"prompt": "a", "output_format": "gif"}), "output_format"),
        (json!({"prompt": "a", "output_format": 1}), "output_format"),
        (json!({"prompt": "a", "output_quality": 101}), "output_quality"),
        (json!({"prompt": "a", "output_quality": "high"}), "output_quality"),
        (json!({"prompt": "a", "stepz": 3}), "stepz"),
    ] {
        let r = server.post_json("/v1/jobs", &request).await;
        assert_eq!(r.status(), 400, "{request}");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["param"], param, "{request}: {body}");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert!(body["error"]["message"].as_str().unwrap().contains(param), "{body}");
    }
    let r = server.post_json("/v1/jobs", &json!(["not", "an", "object"])).await;
    assert_eq!(r.status(), 400);

    let huge = json!({"prompt": "x".repeat(200 * 1024)});
    let r = server.post_json("/v1/jobs", &huge).await;
    assert_eq!(r.status(), 413);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "body_too_large");
    // Nothing above was queued.
    let metrics = server.get("/metrics").await.text().await.unwrap();
    assert!(metrics.contains("sdhive_jobs_total{state=\"queued\"} 0"), "{metrics}");
    server.shutdown().await.unwrap();
}

/// Panics on the prompt "panic", makes a grey 8×8 image otherwise.
struct FlakyEngine;

impl Engine for FlakyEngine {
    fn info(&self) -> EngineInfo {
        EngineInfo {
            engine: "fake".into(),
            backend: "cpu".into(),
            device: "none".into(),
            dtype: "f32".into(),
            model: "flaky".into(),
            family: "sd1".into(),
            native_width: 8,
            native_height: 8,
            samplers: vec!["Euler a".into()],
            supports_img2img: false,
            supports_inpaint: false,
            memory: None,
            text_widths: Vec::new(),
            preview: Default::default(),
        }
    }

    fn generate(
        &mut self,
        req: &GenerateRequest,
        progress: &mut dyn FnMut(&Progress) -> Control,
    ) -> Result<GenerateOutput, EngineError> {
        if req.prompt == "panic" {
            panic!("boom inside the engine");
        }
        if req.prompt == "oom" {
            return Err(EngineError::OutOfMemory("8 GiB needed".into()));
        }
        for step in 1..=req.steps {
            if progress(&Progress { image: 0, images: 1, step, steps: req.steps, preview: None })
                == Control::Cancel
            {
                return Err(EngineError::Cancelled { done: Vec::new() });
            }
        }
        let image = RgbImage { width: 8, height: 8, data: vec![128; 8 * 8 * 3] };
        Ok(GenerateOutput {
            images: vec![GeneratedImage { image, seed: req.seed.unwrap_or(0), infotext: "fake".into() }],
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_panics_and_errors_fail_only_their_job() {
    let loader: EngineLoader = Box::new(|| Ok(Box::new(FlakyEngine) as Box<dyn Engine>));
    let server = start_with(config(), loader, None).await;
    let id = server.submit(&json!({"prompt": "panic", "steps": 2})).await;
    let job = server.wait_done(&id).await;
    assert_eq!(job.state, JobState::Failed);
    let error = job.error.unwrap();
    assert_eq!(error.kind, JobErrorKind::EnginePanic);
    assert!(error.message.contains("boom inside the engine"), "{}", error.message);

    let id = server.submit(&json!({"prompt": "oom", "steps": 2})).await;
    let job = server.wait_done(&id).await;
    assert_eq!(job.error.map(|e| e.kind), Some(JobErrorKind::OutOfMemory));

    // Events for a failed job end with `failed`.
    let mut sse = SseReader::new(server.get(&format!("/v1/jobs/{id}/events")).await);
    let mut last = None;
    while let Some(e) = sse.next().await {
        last = Some(e);
    }
    let last = last.unwrap();
    assert_eq!((last.event.as_str(), &last.data["error"]["kind"]), ("failed", &json!("out_of_memory")));

    assert_eq!(server.get("/ready").await.status(), 200);
    let id = server.submit(&json!({"prompt": "fine", "steps": 2})).await;
    assert_eq!(server.wait_done(&id).await.state, JobState::Succeeded);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_is_503_while_loading_and_load_failure_ends_serve() {
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let loader: EngineLoader = Box::new(move || {
        let _ = release_rx.recv();
        Err("no such model".into())
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let serving =
        tokio::spawn(sdhive_server::serve(listener, config(), loader, None, std::future::pending::<()>()));
    let client = reqwest::Client::new();
    assert_eq!(client.get(format!("{base}/health")).send().await.unwrap().status(), 200);
    assert_eq!(client.get(format!("{base}/ready")).send().await.unwrap().status(), 503);
    let r = client.post(format!("{base}/v1/jobs")).json(&json!({"prompt": "x"})).send().await.unwrap();
    assert_eq!(r.status(), 503);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "model_loading");
    release_tx.send(()).unwrap();
    let result = tokio::time::timeout(Duration::from_secs(30), serving).await.unwrap().unwrap();
    let err = result.unwrap_err();
    assert!(matches!(err, sdhive_server::ServeError::Load(_)), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_refuses_new_jobs_and_stops_the_running_one_after_the_grace_period() {
    // 150 steps of 50 ms: far longer than the grace period on any machine.
    let config = ServerConfig { shutdown_grace: Duration::from_millis(1000), ..config() };
    let mut server = start_with(config, slow_loader(Duration::from_millis(50)), None).await;
    let id = server.submit(&json!({"prompt": "long", "steps": 150})).await;
    let queued = server.submit(&json!({"prompt": "never runs", "steps": 2})).await;
    let mut sse = SseReader::new(server.get(&format!("/v1/jobs/{id}/events")).await);
    while sse.next().await.expect("progress").event != "progress" {}
    server.trigger_shutdown();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = server.post_json("/v1/jobs", &json!({"prompt": "late"})).await;
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "10");
    assert_eq!(server.get("/ready").await.status(), 503);
    // Still readable while draining: the queued job failed (resubmit elsewhere), the running one still runs.
    let never = server.job(&queued).await;
    assert_eq!(never.state, JobState::Failed);
    assert_eq!(never.error.map(|e| e.kind), Some(JobErrorKind::ShuttingDown));
    assert_eq!(server.job(&id).await.state, JobState::Running);
    let mut last = None;
    while let Some(e) = sse.next().await {
        last = Some(e);
    }
    let last = last.expect("a terminal event");
    assert_eq!(last.event, "failed", "{last:?}");
    assert_eq!(last.data["error"]["kind"], "shutting_down");
    let handle = server.handle.take().unwrap();
    tokio::time::timeout(Duration::from_secs(30), handle).await.unwrap().unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_to_completion_cancels_when_its_caller_goes_away() {
    let state = AppState::new(config(), Box::new(SlowEngine { per_step: Duration::from_millis(20) }));
    let req = GenerateRequest { prompt: "x".into(), steps: 150, seed: Some(5), ..Default::default() };
    let jobs = state.jobs.clone();
    let task = tokio::spawn(async move { jobs.run_to_completion(req).await });
    let running = loop {
        if let Some(view) = state.jobs.current() {
            if view.step > 0 {
                break view;
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    task.abort();
    let _ = task.await;
    let done = state.jobs.wait(&running.id).await.unwrap();
    assert_eq!(done.state, JobState::Cancelled);

    // And it returns the finished job when allowed to run.
    let req = GenerateRequest { prompt: "y".into(), steps: 2, seed: Some(6), ..Default::default() };
    let view = state.jobs.run_to_completion(req).await.unwrap();
    assert_eq!(view.state, JobState::Succeeded);
    assert_eq!(view.images.len(), 1);
    assert_eq!(view.images[0].seed, 6);
}
