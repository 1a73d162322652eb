//! The real candle engine on the tiny SD1 fixture, served over loopback HTTP, for the end-to-end tests that need
//! real images (LoRAs, hires fix): starting workers with a test's config, the one worker a test binary's tests
//! share (the model loads once), and a small JSON client.

#![allow(dead_code)]

use candle_core::{DType, Device};
use sdhive_candle::{CandleEngine, LoadOptions};
use sdhive_server::{AppState, ServerConfig};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn load_engine() -> CandleEngine {
    let offline = sdhive_modelsource::ResolveOptions { offline: true, ..Default::default() };
    let model = sdhive_modelsource::resolve(&fixtures().join("models/sd1").to_string_lossy(), &offline)
        .expect("the sd1 fixture model resolves");
    let opts = LoadOptions::single_device(&Device::Cpu, DType::F32, "cpu", "cpu");
    CandleEngine::load(&model, opts).expect("the sd1 fixture model loads")
}

/// A worker on a loopback port with a freshly loaded engine and `config` (its model named by the fixture's path, as
/// `serve --model tests/fixtures/models/sd1` names it); returns its base URL. Runs on the caller's runtime.
pub async fn start_worker(config: ServerConfig) -> String {
    let engine = tokio::task::spawn_blocking(load_engine).await.expect("engine loader thread");
    let model_name = fixtures().join("models/sd1").to_string_lossy().into_owned();
    let app = sdhive_server::router(AppState::new(ServerConfig { model_name, ..config }, Box::new(engine)));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind a loopback port");
    let addr = listener.local_addr().expect("local address");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("test server stopped: {e}");
        }
    });
    format!("http://{addr}")
}

/// The worker every test of a binary shares, started with `config` on first use. It runs on a runtime of its own
/// thread, since each `#[tokio::test]` has a runtime that ends with the test.
pub fn shared(config: fn() -> ServerConfig) -> &'static str {
    static BASE: OnceLock<String> = OnceLock::new();
    BASE.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("the shared worker's runtime");
            rt.block_on(async move {
                let _ = tx.send(start_worker(config()).await);
                std::future::pending::<()>().await;
            });
        });
        rx.recv().expect("the shared worker started")
    })
}

/// A client for one test (reqwest's pool belongs to the runtime that made its connections).
pub struct Client {
    pub base: String,
    pub http: reqwest::Client,
}

impl Client {
    pub fn new(base: &str) -> Client {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(300)).build().expect("http client");
        Client { base: base.to_string(), http }
    }

    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let response = self.http.post(format!("{}{path}", self.base)).json(body).send().await.expect("POST");
        let status = response.status().as_u16();
        (status, response.json().await.expect("a JSON body"))
    }

    pub async fn get(&self, path: &str) -> Value {
        let response = self.http.get(format!("{}{path}", self.base)).send().await.expect("GET");
        assert_eq!(response.status().as_u16(), 200, "GET {path}");
        response.json().await.expect("a JSON body")
    }

    /// A native job, polled to its end.
    pub async fn job(&self, body: &Value) -> Value {
        let (status, got) = self.post("/v1/jobs", body).await;
        assert_eq!(status, 202, "{body}: {got}");
        let id = got["id"].as_str().expect("a job id");
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let job = self.get(&format!("/v1/jobs/{id}")).await;
            if !["queued", "running"].contains(&job["state"].as_str().unwrap_or_default()) {
                return job;
            }
            assert!(Instant::now() < deadline, "job {id} did not finish: {job}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
