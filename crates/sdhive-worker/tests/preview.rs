//! `serve --preview` through a CPU worker built from its command line, on the tiny fixture models and the tiny
//! TAESD decoders of `tests/fixtures/taesd/`: TAESD previews at the output size for SD1 and, after a switch, for
//! SDXL with its own decoder (latent previews where that one is missing), `/v1/info`'s `preview`, `off` sending
//! none, and `--preview taesd` without weights refused before the worker listens, naming where it looked.
//!
//! The Hugging Face cache is pointed at a missing folder (`HF_HUB_CACHE`, set once before any test reads the
//! environment) so that a cache on the machine running the tests cannot change what is found.

mod common;

use common::{copy_dir, fixtures, Worker};
use serde_json::{json, Value};
use shared_worker::Backend;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

/// The (absent, so empty) hub cache every test sees; every test calls this before anything reads the
/// environment.
fn empty_hub_cache() -> &'static Path {
    static HUB: OnceLock<PathBuf> = OnceLock::new();
    HUB.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("sdhive-preview-test-no-hub-{}", std::process::id()));
        // SAFETY (edition 2021: a safe call): no other thread of this test binary reads the environment before
        // this once-initialiser has run, since each test starts here.
        std::env::set_var("HF_HUB_CACHE", &dir);
        std::env::remove_var("HF_HOME");
        dir
    })
}

/// sd1 and sdxl (diffusers folders) and, in A1111's `VAE-taesd/`, the TAESD decoders named.
fn models_dir(decoders: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixtures().join("models/sd1"), &dir.path().join("sd1"));
    copy_dir(&fixtures().join("models/sdxl"), &dir.path().join("sdxl"));
    std::fs::create_dir_all(dir.path().join("VAE-taesd")).unwrap();
    for name in decoders {
        let file = format!("VAE-taesd/{name}_decoder.safetensors");
        std::fs::copy(fixtures().join("taesd").join(&file), dir.path().join(&file)).unwrap();
    }
    dir
}

fn args(models: &Path, preview: &str) -> sdhive_worker::serve::ServeArgs {
    common::serve_args(models, &models.join("hashes.json"), &["--model", "sd1", "--preview", preview])
}

async fn start(models: &Path, preview: &str) -> Worker {
    empty_hub_cache();
    Worker::start(models, &["--model", "sd1", "--preview", preview]).await
}

impl Worker {
    async fn submit(&self, body: Value) -> String {
        let r = self.client.post(self.url("/v1/jobs")).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 202);
        let v: Value = r.json().await.unwrap();
        v["id"].as_str().unwrap().to_string()
    }

    /// Runs a job of `model` with `preview_every: 2` (4 steps) and returns its previews' (step, width, height).
    /// A longer job runs first, so the event stream is open before the job starts.
    async fn previews(&self, model: &str) -> Vec<(u64, u32, u32)> {
        self.submit(json!({"prompt": "wait", "model": model, "steps": 30, "seed": 1})).await;
        let job =
            json!({"prompt": "a photo of a cat", "model": model, "steps": 4, "seed": 5, "preview_every": 2});
        let id = self.submit(job).await;
        let r = self.client.get(self.url(&format!("/v1/jobs/{id}/events"))).send().await.unwrap();
        // The stream ends after the job's terminal event.
        let text =
            tokio::time::timeout(Duration::from_secs(120), r.text()).await.expect("job ended").unwrap();
        let mut out = Vec::new();
        let mut event = "";
        for line in text.lines() {
            if let Some(name) = line.strip_prefix("event: ") {
                event = name;
            } else if let (Some(data), "preview") = (line.strip_prefix("data: "), event) {
                let v: Value = serde_json::from_str(data).unwrap();
                let png = base64::Engine::decode(
                    &base64::engine::general_purpose::STANDARD,
                    v["png_base64"].as_str().unwrap(),
                )
                .unwrap();
                let image = sdhive_engine::decode_image(&png, 1 << 24).unwrap();
                out.push((v["step"].as_u64().unwrap(), image.width, image.height));
            }
        }
        assert!(text.contains("event: completed"), "{text}");
        out
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn taesd_previews_follow_the_model_family() {
    let dir = models_dir(&["taesd", "taesdxl"]);
    let w = start(dir.path(), "taesd").await;
    let info = w.get("/v1/info").await;
    assert_eq!(
        (info["preview"].clone(), info["capabilities"]["preview"].clone()),
        (json!("taesd"), json!(true))
    );
    assert_eq!(w.get("/sdapi/v1/cmd-flags").await["preview"], "taesd");
    assert_eq!(w.previews("sd1").await, [(2, 64, 64), (4, 64, 64)], "SD1: TAESD at the output size");
    assert_eq!(w.previews("sdxl").await, [(2, 64, 64), (4, 64, 64)], "SDXL: taesdxl at the output size");
    let info = w.get("/v1/info").await;
    assert_eq!((info["model"]["family"].clone(), info["preview"].clone()), (json!("sdxl"), json!("taesd")));
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_family_without_its_decoder_previews_its_latents() {
    let dir = models_dir(&["taesd"]);
    let w = start(dir.path(), "taesd").await;
    assert_eq!(w.previews("sdxl").await, [(2, 8, 8), (4, 8, 8)], "no taesdxl: latent previews at 1/8");
    assert_eq!(w.get("/v1/info").await["preview"], "latent");
    assert_eq!(w.previews("sd1").await, [(2, 64, 64), (4, 64, 64)]);
    assert_eq!(w.get("/v1/info").await["preview"], "taesd");
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn off_sends_no_previews_and_auto_on_the_cpu_is_latent() {
    let dir = models_dir(&["taesd", "taesdxl"]);
    let w = start(dir.path(), "off").await;
    let info = w.get("/v1/info").await;
    assert_eq!(
        (info["preview"].clone(), info["capabilities"]["preview"].clone()),
        (json!("off"), json!(false))
    );
    assert_eq!(w.previews("sd1").await, [], "preview_every is accepted and ignored");
    w.stop().await;

    let w = start(dir.path(), "auto").await;
    assert_eq!(w.get("/v1/info").await["preview"], "latent");
    assert_eq!(w.previews("sd1").await, [(2, 8, 8), (4, 8, 8)]);
    w.stop().await;
}

#[test]
fn taesd_without_weights_stops_the_worker_before_it_listens_naming_where_it_looked() {
    let hub = empty_hub_cache();
    let dir = models_dir(&[]);
    let err = match sdhive_worker::serve::prepare(Backend::Cpu, &args(dir.path(), "taesd")) {
        Ok(_) => panic!("--preview taesd without weights must not start"),
        Err(e) => format!("{e:#}"),
    };
    for place in [
        dir.path().join("VAE-taesd/taesd_decoder.safetensors"),
        dir.path().join("taesd"),
        dir.path().join("VAE-taesd/taesdxl_decoder.safetensors"),
        dir.path().join("taesdxl"),
        hub.join("models--madebyollin--taesd"),
        hub.join("models--madebyollin--taesdxl"),
    ] {
        assert!(err.contains(&place.display().to_string()), "{} missing from: {err}", place.display());
    }
    assert!(err.contains("--preview"), "{err}");
}
