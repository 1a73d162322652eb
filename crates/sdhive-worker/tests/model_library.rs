//! The model library through a CPU worker built from its command line (`serve --models-dir …`), on the tiny
//! fixture models: switching through every API gives each model's own image (what a fresh worker loaded with
//! that model makes), the Open WebUI and SillyTavern flows, a standalone VAE, failed switches that leave the
//! previous model serving, unknown names, lazy hashes, refresh, unload/reload, and memory that does not grow
//! as models come and go; an SD3 model with a standalone SD3 VAE.

mod common;

use base64::Engine as _;
use common::{copy_dir, Worker};
use sdhive_candle::{CandleEngine, LoadOptions, ModuleTarget, Sd3Engine, Sd3Model};
use sdhive_engine::{Control, Engine, GenerateRequest, RgbImage, Sampler, Schedule};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn fixtures() -> PathBuf {
    common::fixtures().join("models")
}

/// A safetensors file that the catalogue takes for a checkpoint (a UNet tensor name) but no engine can load.
fn write_broken_checkpoint(path: &Path) {
    let header = br#"{"model.diffusion_model.input_blocks.0.0.weight":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0u8; 8]);
    std::fs::write(path, bytes).unwrap();
}

/// sd1 (diffusers), sub/sdxl (diffusers), sd1.safetensors (single file, its config folder `sd1/` beside it),
/// VAE/sd1-alt.safetensors, a broken checkpoint and a pickle.
fn models_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    copy_dir(&fixtures().join("sd1"), &root.join("sd1"));
    copy_dir(&fixtures().join("sdxl"), &root.join("sub/sdxl"));
    std::fs::copy(fixtures().join("sd1.safetensors"), root.join("sd1.safetensors")).unwrap();
    copy_dir(&fixtures().join("VAE"), &root.join("VAE"));
    write_broken_checkpoint(&root.join("zz-broken.safetensors"));
    std::fs::write(root.join("old.ckpt"), b"not unpickled").unwrap();
    // A GGUF SD1.5 checkpoint (header only): the stable-diffusion.cpp workers' format, not this CPU worker's.
    sdhive_catalog::gguf::write_sd_for_tests(&root.join("q8.gguf"), "sd1", 4).unwrap();
    dir
}

impl Worker {
    async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self.client.post(self.url(path)).json(body).send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    async fn loaded_source(&self) -> Option<String> {
        self.get("/v1/info").await["model"]["source"].as_str().map(str::to_string)
    }
}

fn decode(b64: &str) -> RgbImage {
    let bytes = base64::engine::general_purpose::STANDARD.decode(b64).unwrap();
    sdhive_engine::decode_image(&bytes, 1 << 24).unwrap()
}

/// The request every API below sends, in engine terms.
fn request(seed: u64) -> GenerateRequest {
    GenerateRequest {
        prompt: "a photo of a cat".into(),
        negative_prompt: String::new(),
        steps: 3,
        cfg_scale: 7.0,
        width: Some(64),
        height: Some(64),
        seed: Some(seed),
        n: 1,
        sampler: Sampler::Euler,
        schedule: Schedule::Automatic,
        clip_skip: 1,
        init_image: None,
        strength: 0.75,
        mask: None,
        preview_every: 0,
        preview_approx: false,
        loras: Vec::new(),
        embeddings: Vec::new(),
        hires: None,
        output: Default::default(),
        skip_layer_guidance: None,
    }
}

/// What a fresh worker loaded with `model` (and `vae`) makes of [`request`].
fn fresh_image(model: &Path, vae: Option<&Path>, seed: u64) -> RgbImage {
    let mut resolved = sdhive_modelsource::resolve(&model.to_string_lossy(), &Default::default()).unwrap();
    resolved.vae = vae.map(Path::to_path_buf);
    let opts = LoadOptions::single_device(&candle_core::Device::Cpu, candle_core::DType::F32, "cpu", "cpu");
    let mut engine = CandleEngine::load(&resolved, opts).unwrap();
    let out = engine.generate(&request(seed), &mut |_| Control::Continue).unwrap();
    out.images.into_iter().next().unwrap().image
}

/// What an SD3 engine loaded from `model` (a diffusers folder) with `vae` in place of its own makes of the
/// request every API below sends.
fn fresh_sd3_image(model: &Path, vae: Option<&Path>, seed: u64) -> RgbImage {
    let (device, dtype) = (candle_core::Device::Cpu, candle_core::DType::F32);
    let mut sd3 = Sd3Model::from_dir(model, dtype, &device, true).unwrap();
    if let Some(vae) = vae {
        sd3.replace_vae(
            vae,
            &ModuleTarget { device: device.clone(), dtype, offload: false, host_copy: false },
        )
        .unwrap();
    }
    let mut engine = Sd3Engine::from_model(sd3, "sd3", dtype, ("cpu", "cpu"));
    let out = engine.generate(&request(seed), &mut |_| Control::Continue).unwrap();
    out.images.into_iter().next().unwrap().image
}

fn a1111_body(seed: u64) -> Value {
    json!({"prompt": "a photo of a cat", "steps": 3, "cfg_scale": 7, "width": 64, "height": 64, "seed": seed,
           "sampler_name": "Euler"})
}

async fn a1111_image(w: &Worker, body: &Value) -> RgbImage {
    let (status, v) = w.post("/sdapi/v1/txt2img", body).await;
    assert_eq!(status, 200, "{v}");
    decode(v["images"][0].as_str().unwrap())
}

async fn openai_image(w: &Worker, model: &str, seed: u64) -> RgbImage {
    let body = json!({"prompt": "a photo of a cat", "model": model, "size": "64x64", "steps": 3, "cfg_scale": 7,
                      "seed": seed, "sampler": "Euler"});
    let (status, v) = w.post("/v1/images/generations", &body).await;
    assert_eq!(status, 200, "{v}");
    decode(v["data"][0]["b64_json"].as_str().unwrap())
}

async fn native_image(w: &Worker, model: &str, seed: u64) -> RgbImage {
    let body = json!({"prompt": "a photo of a cat", "model": model, "width": 64, "height": 64, "steps": 3,
                      "cfg_scale": 7, "seed": seed, "sampler": "Euler"});
    let (status, v) = w.post("/v1/jobs", &body).await;
    assert_eq!(status, 202, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let job = w.get(&format!("/v1/jobs/{id}")).await;
        match job["state"].as_str().unwrap() {
            "succeeded" => return decode(job["images"][0]["png_base64"].as_str().unwrap()),
            "failed" | "cancelled" => panic!("job failed: {job}"),
            _ => {}
        }
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_through_every_api_gives_each_models_own_image() {
    let dir = models_dir();
    let root = std::fs::canonicalize(dir.path()).unwrap();
    let w = Worker::start(&root, &["--model", "sd1"]).await;
    let (sd1, sdxl, single) = (root.join("sd1"), root.join("sub/sdxl"), root.join("sd1.safetensors"));
    let want = |m: &Path, seed| fresh_image(m, None, seed);

    // sd1 → sdxl → sd1.safetensors → sd1, each switch through another API.
    assert_eq!(native_image(&w, "sd1", 11).await, want(&sd1, 11), "native, sd1");
    let mut body = a1111_body(12);
    body["override_settings"] = json!({"sd_model_checkpoint": "sub/sdxl"});
    assert_eq!(a1111_image(&w, &body).await, want(&sdxl, 12), "A1111 override, sdxl");
    assert_eq!(w.loaded_source().await.as_deref(), Some(sdxl.to_str().unwrap()));
    // The override is restored afterwards (A1111's default): the selection is still sd1.
    assert_eq!(w.get("/sdapi/v1/options").await["sd_model_checkpoint"], "sd1");
    assert_eq!(openai_image(&w, "sd1.safetensors", 13).await, want(&single, 13), "OpenAI, single file");
    let (status, v) = w.post("/sdapi/v1/options", &json!({"sd_model_checkpoint": "sd1"})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(w.loaded_source().await.as_deref(), Some(sd1.to_str().unwrap()));
    assert_eq!(a1111_image(&w, &a1111_body(14)).await, want(&sd1, 14), "A1111 after options, sd1");
    // OpenAI's own model names mean the selected checkpoint.
    assert_eq!(openai_image(&w, "dall-e-3", 15).await, want(&sd1, 15), "OpenAI dall-e-3 → selection");

    // Memory: rounds of switches through all three models (RAM cache of 2) leave the process where the first
    // round left it; a model kept per switch would add megabytes per round.
    let round = || async {
        for (i, m) in ["sub/sdxl", "sd1.safetensors", "sd1"].iter().enumerate() {
            openai_image(&w, m, 20 + i as u64).await;
        }
    };
    round().await;
    let after_first = rss_bytes();
    for _ in 0..4 {
        round().await;
    }
    let after_five = rss_bytes();
    let growth = after_five.saturating_sub(after_first);
    eprintln!("RSS after 1 round {} MiB, after 5 rounds {} MiB", after_first >> 20, after_five >> 20);
    assert!(growth < 24 << 20, "memory grew by {} MiB over 4 rounds of 3 switches", growth >> 20);
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_webui_and_sillytavern_model_flows() {
    let dir = models_dir();
    let root = std::fs::canonicalize(dir.path()).unwrap();
    let w = Worker::start(&root, &["--model", "sd1"]).await;

    // Open WebUI: GET options, POST the whole object back with another checkpoint title from sd-models, txt2img.
    let models = w.get("/sdapi/v1/sd-models").await;
    let titles: Vec<&str> = models.as_array().unwrap().iter().map(|m| m["title"].as_str().unwrap()).collect();
    let sdxl_title = titles.iter().find(|t| t.contains("sdxl")).expect("sdxl listed").to_string();
    let mut options = w.get("/sdapi/v1/options").await;
    options["sd_model_checkpoint"] = json!(sdxl_title);
    let (status, v) = w.post("/sdapi/v1/options", &options).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(w.get("/sdapi/v1/options").await["sd_model_checkpoint"], json!(sdxl_title));
    let body = json!({"prompt": "a photo of a cat", "batch_size": 1, "width": 64, "height": 64, "steps": 3,
                      "seed": 5, "cfg_scale": 7, "sampler_name": "Euler"});
    assert_eq!(a1111_image(&w, &body).await, fresh_image(&root.join("sub/sdxl"), None, 5));

    // SillyTavern: POST options, poll progress until idle, txt2img with its own keys and override_settings.
    let (status, _) = w.post("/sdapi/v1/options", &json!({"sd_model_checkpoint": "sd1.safetensors"})).await;
    assert_eq!(status, 200);
    for _ in 0..10 {
        let p = w.get("/sdapi/v1/progress").await;
        if p["progress"] == json!(0.0) && p["state"]["job_count"] == json!(0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let body = json!({"url": "http://127.0.0.1:7860", "auth": "", "prompt": "a photo of a cat",
        "negative_prompt": "", "sampler_name": "Euler", "scheduler": "Automatic", "steps": 3, "cfg_scale": 7,
        "width": 64, "height": 64, "restore_faces": false, "seed": 6, "clip_skip": 1,
        "override_settings": {"CLIP_stop_at_last_layers": 1, "sd_vae": "Automatic"},
        "override_settings_restore_afterwards": true, "save_images": false, "send_images": true,
        "do_not_save_grid": false, "do_not_save_samples": false});
    assert_eq!(a1111_image(&w, &body).await, fresh_image(&root.join("sd1.safetensors"), None, 6));
    w.stop().await;
}

/// An SD3 model takes a standalone SD3 VAE (16 latent channels) per request: the image of an engine loaded with
/// that VAE (`sdhive-candle`'s SD3 tests hold that one against diffusers). An SD1 VAE for it fails the request
/// naming the file, and the model serves on with its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sd3_model_takes_a_standalone_sd3_vae() {
    let dir = models_dir();
    let root = std::fs::canonicalize(dir.path()).unwrap();
    copy_dir(&fixtures().join("sd3"), &root.join("sd3"));
    let w = Worker::start(&root, &["--model", "sd3"]).await;
    let with_vae = fresh_sd3_image(&root.join("sd3"), Some(&root.join("VAE/sd3-alt.safetensors")), 8);
    let without = fresh_sd3_image(&root.join("sd3"), None, 8);
    assert_ne!(with_vae, without, "the other VAE must change the image");

    let mut body = a1111_body(8);
    body["override_settings"] = json!({"sd_vae": "sd3-alt.safetensors"});
    assert_eq!(a1111_image(&w, &body).await, with_vae);
    assert_eq!(a1111_image(&w, &a1111_body(8)).await, without);

    body["override_settings"] = json!({"sd_vae": "sd1-alt.safetensors"});
    let (status, v) = w.post("/sdapi/v1/txt2img", &body).await;
    assert_eq!((status, v["field"].as_str()), (400, Some("override_settings.sd_vae")), "{v}");
    let said = v.to_string();
    assert!(said.contains("sd1-alt.safetensors") && said.contains("4 latent channels"), "{said}");
    assert_eq!(a1111_image(&w, &a1111_body(8)).await, without);
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standalone_vae_replaces_the_models_own() {
    let dir = models_dir();
    let root = std::fs::canonicalize(dir.path()).unwrap();
    let w = Worker::start(&root, &["--model", "sd1"]).await;
    let vaes = w.get("/sdapi/v1/sd-vae").await;
    assert_eq!(vaes[0]["model_name"], "sd1-alt.safetensors", "{vaes}");
    let vae = root.join("VAE/sd1-alt.safetensors");
    let with_vae = fresh_image(&root.join("sd1"), Some(&vae), 7);
    let without = fresh_image(&root.join("sd1"), None, 7);
    assert_ne!(with_vae, without, "the other VAE must change the image");

    // Per request, then restored: the next plain request uses the model's own VAE again.
    let mut body = a1111_body(7);
    body["override_settings"] = json!({"sd_vae": "sd1-alt.safetensors"});
    assert_eq!(a1111_image(&w, &body).await, with_vae);
    assert_eq!(a1111_image(&w, &a1111_body(7)).await, without);
    // As an option, until set back to Automatic.
    let (status, v) = w.post("/sdapi/v1/options", &json!({"sd_vae": "sd1-alt.safetensors"})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(w.get("/sdapi/v1/options").await["sd_vae"], "sd1-alt.safetensors");
    assert_eq!(w.get("/v1/info").await["model"]["vae"], "sd1-alt.safetensors");
    assert_eq!(native_image(&w, "sd1", 7).await, with_vae);
    let (status, _) = w.post("/sdapi/v1/options", &json!({"sd_vae": "Automatic"})).await;
    assert_eq!(status, 200);
    assert_eq!(native_image(&w, "sd1", 7).await, without);

    let (status, v) = w.post("/sdapi/v1/options", &json!({"sd_vae": "nope.safetensors"})).await;
    assert_eq!((status, v["field"].as_str()), (400, Some("sd_vae")), "{v}");
    assert!(v["detail"].as_str().unwrap().contains("sd1-alt.safetensors"), "{v}");
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_switches_and_unknown_names_leave_the_previous_model_serving() {
    let dir = models_dir();
    let root = std::fs::canonicalize(dir.path()).unwrap();
    let w = Worker::start(&root, &["--model", "sd1"]).await;
    let sd1 = root.join("sd1");

    // A checkpoint that fails to load: 400 naming the option and the reason; sd1 still loaded and selected.
    let (status, v) = w.post("/sdapi/v1/options", &json!({"sd_model_checkpoint": "zz-broken"})).await;
    assert_eq!((status, v["field"].as_str()), (400, Some("sd_model_checkpoint")), "{v}");
    let detail = v["detail"].as_str().unwrap();
    assert!(detail.contains("zz-broken") && detail.contains("cannot load"), "{detail}");
    assert_eq!(w.loaded_source().await.as_deref(), Some(sd1.to_str().unwrap()));
    assert_eq!(w.get("/sdapi/v1/options").await["sd_model_checkpoint"], "sd1");
    // The same through a native job: it fails against `model`, and the next job runs on sd1.
    let (status, v) = w
        .post(
            "/v1/jobs",
            &json!({"prompt": "x", "model": "zz-broken.safetensors", "steps": 1, "width": 64,
                                   "height": 64}),
        )
        .await;
    assert_eq!(status, 202, "{v}");
    let id = v["id"].as_str().unwrap();
    let job = loop {
        let job = w.get(&format!("/v1/jobs/{id}")).await;
        if job["state"] == "failed" {
            break job;
        }
        assert_ne!(job["state"], "succeeded");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(job["error"]["param"], "model", "{job}");
    assert_eq!(a1111_image(&w, &a1111_body(3)).await, fresh_image(&sd1, None, 3));

    // Unknown names: refused before queueing, naming the closest titles.
    let body = json!({"prompt": "x", "model": "sd-1", "size": "64x64"});
    let (status, v) = w.post("/v1/images/generations", &body).await;
    assert_eq!((status, v["error"]["code"].as_str()), (404, Some("model_not_found")), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("closest: sd1"), "{v}");
    let (status, v) = w.post("/v1/jobs", &json!({"prompt": "x", "model": "nothing-like-it"})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (404, Some("model")), "{v}");
    let mut body = a1111_body(1);
    body["override_settings"] = json!({"sd_model_checkpoint": "missing"});
    let (status, v) = w.post("/sdapi/v1/txt2img", &body).await;
    assert_eq!((status, v["field"].as_str()), (400, Some("override_settings.sd_model_checkpoint")), "{v}");

    // Pickles are listed as refused, never loaded.
    let info = w.get("/v1/info").await;
    let refused = info["models"]["refused"].as_array().unwrap();
    assert!(
        refused.iter().any(|r| r["file"].as_str().unwrap().ends_with("old.ckpt")
            && r["reason"].as_str().unwrap().contains("safetensors")),
        "{info}"
    );
    // A GGUF checkpoint is refused by this candle worker, saying which workers load it.
    assert!(
        refused.iter().any(|r| r["file"].as_str().unwrap().ends_with("q8.gguf")
            && r["reason"].as_str().unwrap().contains("sd-worker-vulkan")),
        "{info}"
    );
    let titles = w.get("/sdapi/v1/sd-models").await;
    assert!(!titles.to_string().contains("old.ckpt") && !titles.to_string().contains("q8.gguf"));
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hashes_refresh_unload_and_reload() {
    let dir = models_dir();
    let root = std::fs::canonicalize(dir.path()).unwrap();
    // Without --model the worker loads the library's first checkpoint, as A1111 does: here `sd1`.
    std::fs::remove_file(root.join("zz-broken.safetensors")).unwrap();
    let w = Worker::start(&root, &[]).await;
    assert_eq!(w.loaded_source().await.as_deref(), Some(root.join("sd1").to_str().unwrap()));

    // A single file is hashed when first loaded (A1111's short hash = the sha256's first 10 digits).
    let listed = |v: &Value, name: &str| {
        v.as_array()
            .unwrap()
            .iter()
            .find(|m| m["filename"].as_str().unwrap().ends_with(name))
            .unwrap()
            .clone()
    };
    let before = listed(&w.get("/sdapi/v1/sd-models").await, "sd1.safetensors");
    assert_eq!((before["hash"].clone(), before["title"].as_str()), (Value::Null, Some("sd1.safetensors")));
    openai_image(&w, "sd1.safetensors", 1).await;
    // Hashed in the background after the load.
    let deadline = Instant::now() + Duration::from_secs(20);
    let after = loop {
        let after = listed(&w.get("/sdapi/v1/sd-models").await, "sd1.safetensors");
        if !after["hash"].is_null() || Instant::now() > deadline {
            break after;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let out = std::process::Command::new("sha256sum").arg(root.join("sd1.safetensors")).output().unwrap();
    let sha = String::from_utf8(out.stdout).unwrap().split_whitespace().next().unwrap().to_string();
    assert_eq!(after["sha256"], json!(sha));
    assert_eq!(after["hash"], json!(&sha[..10]));
    assert_eq!(after["title"], json!(format!("sd1.safetensors [{}]", &sha[..10])));
    // The hash names the model too.
    assert_eq!(openai_image(&w, &sha[..10], 2).await, fresh_image(&root.join("sd1.safetensors"), None, 2));

    // A new file appears after refresh-checkpoints, without a restart.
    std::fs::copy(root.join("sd1.safetensors"), root.join("sub/copy.safetensors")).unwrap();
    copy_dir(&root.join("sd1"), &root.join("sub/copy"));
    assert!(!w.get("/sdapi/v1/sd-models").await.to_string().contains("sub/copy.safetensors"));
    let (status, _) = w.post("/sdapi/v1/refresh-checkpoints", &json!({})).await;
    assert_eq!(status, 200);
    assert!(w.get("/sdapi/v1/sd-models").await.to_string().contains("sub/copy.safetensors"));

    // Unload frees the model; reload brings back the selected one; a job after unload loads its model again.
    let (status, _) = w.post("/sdapi/v1/unload-checkpoint", &json!({})).await;
    assert_eq!(status, 200);
    assert_eq!(w.loaded_source().await, None);
    let (status, _) = w.post("/sdapi/v1/reload-checkpoint", &json!({})).await;
    assert_eq!(status, 200);
    assert_eq!(w.loaded_source().await.as_deref(), Some(root.join("sd1").to_str().unwrap()));
    let (status, _) = w.post("/sdapi/v1/unload-checkpoint", &json!({})).await;
    assert_eq!(status, 200);
    assert_eq!(a1111_image(&w, &a1111_body(4)).await, fresh_image(&root.join("sd1"), None, 4));
    w.stop().await;
}
