//! Shared test plumbing: the tiny fixture engine, a server on a free loopback port with a shutdown trigger,
//! polling and SSE helpers.

#![allow(dead_code)]

use base64::Engine as _;
use candle_core::{DType, Device};
use sdhive_candle::{CandleEngine, LoadOptions};
use sdhive_engine::{
    Control, Engine, EngineError, EngineInfo, GenerateOutput, GenerateRequest, GeneratedImage, Progress,
    RgbImage,
};
use sdhive_modelsource::ResolveOptions;
use sdhive_protocol::JobSnapshot;
use sdhive_server::{serve, EngineLoader, RegistrationConfig, ServeError, ServerConfig};
use serde_json::Value;
use std::path::Path;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub fn fixture_engine() -> CandleEngine {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/sd1");
    let opts = ResolveOptions { offline: true, ..ResolveOptions::from_env() };
    let model =
        sdhive_modelsource::resolve(path.to_str().expect("utf-8 path"), &opts).expect("fixture model");
    let load = LoadOptions::single_device(&Device::Cpu, DType::F32, "cpu", "test cpu");
    CandleEngine::load(&model, load).expect("loading the fixture model")
}

pub fn fixture_loader() -> EngineLoader {
    Box::new(|| Ok(Box::new(fixture_engine()) as Box<dyn Engine>))
}

/// A stand-in engine whose steps take a fixed time, for tests that need a job to be running for a while
/// whatever the machine's speed. Makes grey 8×8 images.
pub struct SlowEngine {
    pub per_step: Duration,
}

impl Engine for SlowEngine {
    fn info(&self) -> EngineInfo {
        EngineInfo {
            engine: "slow".into(),
            backend: "cpu".into(),
            device: "none".into(),
            dtype: "f32".into(),
            model: "slow".into(),
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
        let mut images = Vec::new();
        for image in 0..req.n {
            for step in 1..=req.steps {
                std::thread::sleep(self.per_step);
                let p = Progress { image, images: req.n, step, steps: req.steps, preview: None };
                if progress(&p) == Control::Cancel {
                    return Err(EngineError::Cancelled { done: Vec::new() });
                }
            }
            let seed = req.seed.unwrap_or(0).wrapping_add(u64::from(image));
            let image = RgbImage { width: 8, height: 8, data: vec![128; 8 * 8 * 3] };
            images.push(GeneratedImage { image, seed, infotext: "slow".into() });
        }
        Ok(GenerateOutput { images })
    }
}

pub fn slow_loader(per_step: Duration) -> EngineLoader {
    Box::new(move || Ok(Box::new(SlowEngine { per_step }) as Box<dyn Engine>))
}

pub fn config() -> ServerConfig {
    ServerConfig {
        model_name: "sd1-fixture".into(),
        worker_id: "test-worker".into(),
        ..ServerConfig::default()
    }
}

pub struct TestServer {
    pub base: String,
    pub client: reqwest::Client,
    shutdown: Option<oneshot::Sender<()>>,
    pub handle: Option<JoinHandle<Result<(), ServeError>>>,
}

impl TestServer {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.client.get(self.url(path)).send().await.expect("GET")
    }

    pub async fn post_json(&self, path: &str, body: &Value) -> reqwest::Response {
        self.client.post(self.url(path)).json(body).send().await.expect("POST")
    }

    /// Submits and returns the job id, asserting 202.
    pub async fn submit(&self, body: &Value) -> String {
        let r = self.post_json("/v1/jobs", body).await;
        assert_eq!(r.status(), 202, "submit: {}", r.text().await.unwrap_or_default());
        let v: Value = r.json().await.expect("json");
        v["id"].as_str().expect("id").to_string()
    }

    pub async fn job(&self, id: &str) -> JobSnapshot {
        let r = self.get(&format!("/v1/jobs/{id}")).await;
        assert_eq!(r.status(), 200);
        r.json().await.expect("job snapshot")
    }

    /// Polls until the job is terminal.
    pub async fn wait_done(&self, id: &str) -> JobSnapshot {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let job = self.job(id).await;
            if job.state.is_terminal() {
                return job;
            }
            assert!(Instant::now() < deadline, "job {id} did not finish: {job:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Triggers the shutdown path (what SIGTERM does) and waits for `serve` to return.
    pub async fn shutdown(mut self) -> Result<(), ServeError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let handle = self.handle.take().expect("not yet shut down");
        tokio::time::timeout(Duration::from_secs(90), handle)
            .await
            .expect("serve returned")
            .expect("no panic")
    }

    pub fn trigger_shutdown(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

pub async fn start(config: ServerConfig) -> TestServer {
    start_with(config, fixture_loader(), None).await
}

pub async fn start_with(
    config: ServerConfig,
    loader: EngineLoader,
    registration: Option<RegistrationConfig>,
) -> TestServer {
    let key = config.api_key.clone();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = oneshot::channel::<()>();
    let handle = tokio::spawn(serve(listener, config, loader, registration, async {
        let _ = rx.await;
    }));
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(key) = key {
        headers.insert(reqwest::header::AUTHORIZATION, format!("Bearer {key}").parse().expect("header"));
    }
    let client = reqwest::Client::builder().default_headers(headers).build().expect("client");
    let server =
        TestServer { base: format!("http://{addr}"), client, shutdown: Some(tx), handle: Some(handle) };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(r) = server.client.get(server.url("/ready")).send().await {
            if r.status() == 200 {
                break;
            }
        }
        assert!(Instant::now() < deadline, "server never became ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server
}

pub fn decode_png_b64(b64: &str) -> sdhive_engine::RgbImage {
    let bytes = base64::engine::general_purpose::STANDARD.decode(b64).expect("base64");
    sdhive_engine::decode_image(&bytes, 1 << 24).expect("a PNG")
}

/// One parsed server-sent event.
#[derive(Debug, Clone)]
pub struct Sse {
    pub event: String,
    pub data: Value,
}

/// Reads SSE events from a streaming response; `next` yields them one at a time.
pub struct SseReader {
    response: reqwest::Response,
    buffer: String,
}

impl SseReader {
    pub fn new(response: reqwest::Response) -> Self {
        SseReader { response, buffer: String::new() }
    }

    pub async fn next(&mut self) -> Option<Sse> {
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let block: String = self.buffer.drain(..end + 2).collect();
                let mut event = String::from("message");
                let mut data = String::new();
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("event:") {
                        event = v.trim().to_string();
                    } else if let Some(v) = line.strip_prefix("data:") {
                        data.push_str(v.trim_start());
                    }
                }
                if data.is_empty() {
                    continue; // keep-alive comment
                }
                return Some(Sse { event, data: serde_json::from_str(&data).expect("event data is JSON") });
            }
            let chunk = tokio::time::timeout(Duration::from_secs(60), self.response.chunk())
                .await
                .expect("an event within 60 s")
                .expect("stream chunk")?;
            self.buffer.push_str(std::str::from_utf8(&chunk).expect("utf-8"));
        }
    }
}

/// A header-only safetensors file the catalogue lists as a checkpoint.
pub fn fake_checkpoint(path: &Path) {
    let header =
        br#"{"model.diffusion_model.out.2.weight":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0u8; 4]);
    std::fs::write(path, bytes).expect("writing a fake checkpoint");
}

/// A model library over a temporary folder of fake checkpoints named `names` (the folder lives as long as the
/// returned guard).
pub fn fake_library(names: &[&str]) -> (tempfile::TempDir, std::sync::Arc<sdhive_server::ModelLibrary>) {
    let dir = tempfile::tempdir().expect("temp dir");
    for name in names {
        fake_checkpoint(&dir.path().join(name));
    }
    let library = sdhive_server::ModelLibrary::scan(sdhive_catalog::CatalogConfig {
        models_dirs: vec![dir.path().to_path_buf()],
        vae_dirs: vec![],
        hash_cache: None,
    })
    .expect("scanning the fake library");
    (dir, std::sync::Arc::new(library))
}
