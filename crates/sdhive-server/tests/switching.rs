//! Model switches as queued work, with an engine factory whose loads take a known time: jobs for another model
//! wait their turn (FIFO) while the switch runs, `/sdapi/v1/progress` shows the worker busy during it (what
//! SillyTavern polls after choosing a model), an options change waits for the jobs queued before it, and a job
//! reports its model.

mod common;

use common::{fake_library, SlowEngine};
use sdhive_engine::{
    BoxError, Control, Engine, EngineError, EngineInfo, GenerateOutput, GenerateRequest, ModelSpec, Progress,
};
use sdhive_server::{serve, LibraryStartup};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;

const LOAD_TIME: Duration = Duration::from_millis(600);

/// A slow engine that reports the model it was loaded as.
struct Named(String, SlowEngine);

impl Engine for Named {
    fn info(&self) -> EngineInfo {
        EngineInfo { model: self.0.clone(), ..self.1.info() }
    }

    fn generate(
        &mut self,
        req: &GenerateRequest,
        progress: &mut dyn FnMut(&Progress) -> Control,
    ) -> Result<GenerateOutput, EngineError> {
        self.1.generate(req, progress)
    }
}

struct Setup {
    base: String,
    client: reqwest::Client,
    loads: Arc<Mutex<Vec<String>>>,
    _dir: tempfile::TempDir,
}

async fn start() -> Setup {
    let (dir, library) = fake_library(&["a.safetensors", "b.safetensors"]);
    let loads = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&loads);
    let factory = move |spec: &ModelSpec| -> Result<Box<dyn Engine>, BoxError> {
        std::thread::sleep(LOAD_TIME);
        log.lock().unwrap().push(spec.name.clone());
        Ok(Box::new(Named(spec.name.clone(), SlowEngine { per_step: Duration::from_millis(30) })))
    };
    let initial = library.find("a").ok();
    let startup = LibraryStartup { library, factory: Box::new(factory), initial, initial_required: true };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(serve(listener, common::config(), startup, None, std::future::pending::<()>()));
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while client.get(format!("{base}/ready")).send().await.map(|r| r.status() != 200).unwrap_or(true) {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Setup { base, client, loads, _dir: dir }
}

impl Setup {
    async fn submit(&self, model: &str, steps: u32) -> String {
        let body = json!({"prompt": "x", "model": model, "steps": steps});
        let r = self.client.post(format!("{}/v1/jobs", self.base)).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 202);
        r.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string()
    }

    async fn get(&self, path: &str) -> Value {
        self.client.get(format!("{}{path}", self.base)).send().await.unwrap().json().await.unwrap()
    }

    async fn wait(&self, id: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let job = self.get(&format!("/v1/jobs/{id}")).await;
            if ["succeeded", "failed", "cancelled"].contains(&job["state"].as_str().unwrap()) {
                return job;
            }
            assert!(Instant::now() < deadline, "{job}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_for_another_model_wait_in_order_while_the_switch_shows_as_busy() {
    let s = start().await;
    let first = s.submit("a", 5).await;
    let second = s.submit("b.safetensors", 2).await;
    let third = s.submit("a.safetensors", 2).await;

    // While the second job's switch runs, the worker is busy loading b: A1111 pollers see a job.
    let deadline = Instant::now() + Duration::from_secs(20);
    let seen = loop {
        let p = s.get("/sdapi/v1/progress").await;
        if p["textinfo"].as_str().is_some_and(|t| t.contains("loading model b.safetensors")) {
            break p;
        }
        assert!(Instant::now() < deadline, "never saw the switch: {p}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(seen["state"]["job_count"], 1, "{seen}");
    assert_eq!(s.get(&format!("/v1/jobs/{third}")).await["state"], "queued");

    let (a, b, c) = (s.wait(&first).await, s.wait(&second).await, s.wait(&third).await);
    for job in [&a, &b, &c] {
        assert_eq!(job["state"], "succeeded", "{job}");
    }
    // In submission order (a job's images are encoded while the next one starts, so only starts are ordered).
    assert!(
        a["started_at"].as_f64() < b["started_at"].as_f64()
            && b["started_at"].as_f64() < c["started_at"].as_f64()
    );
    assert!(a["request"]["model"].as_str().unwrap().starts_with("a.safetensors"), "{a}");
    assert!(b["request"]["model"].as_str().unwrap().starts_with("b.safetensors"), "{b}");
    // The second job's run includes the switch.
    assert!(b["run_seconds"].as_f64().unwrap() >= LOAD_TIME.as_secs_f64() * 0.9, "{b}");
    assert_eq!(*s.loads.lock().unwrap(), ["a", "b", "a"]);
    assert_eq!(s.get("/sdapi/v1/progress").await["state"]["job_count"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_options_switch_waits_for_the_jobs_queued_before_it() {
    let s = start().await;
    let running = s.submit("a", 10).await;
    let started = Instant::now();
    let r = s
        .client
        .post(format!("{}/sdapi/v1/options", s.base))
        .json(&json!({"sd_model_checkpoint": "b"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // Answered only once the earlier job ran (10 steps of 30 ms) and b loaded.
    assert!(started.elapsed() >= LOAD_TIME + Duration::from_millis(250), "{:?}", started.elapsed());
    assert_eq!(s.get(&format!("/v1/jobs/{running}")).await["state"], "succeeded");
    // Titled with its short hash once loaded (hashed in the background), as A1111 does.
    let deadline = Instant::now() + Duration::from_secs(20);
    let options = loop {
        let options = s.get("/sdapi/v1/options").await;
        if options["sd_model_checkpoint"].as_str().unwrap().starts_with("b.safetensors [") {
            break options;
        }
        assert!(Instant::now() < deadline, "{options}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(s.get("/v1/info").await["model"]["name"], "b");
    // Posting the same choice back (Open WebUI sends the whole object) loads nothing.
    let r = s.client.post(format!("{}/sdapi/v1/options", s.base)).json(&options).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(*s.loads.lock().unwrap(), ["a", "b"]);
}

/// Each warm-up: the batch limit it got and the name of the thread it ran on.
type WarmLog = Arc<Mutex<Vec<(u32, Option<String>)>>>;

/// A slow engine whose warm-up takes a while and is logged.
struct Warming {
    inner: SlowEngine,
    log: WarmLog,
}

impl Engine for Warming {
    fn info(&self) -> EngineInfo {
        self.inner.info()
    }

    fn generate(
        &mut self,
        req: &GenerateRequest,
        progress: &mut dyn FnMut(&Progress) -> Control,
    ) -> Result<GenerateOutput, EngineError> {
        self.inner.generate(req, progress)
    }

    fn warm_up(&mut self, max_images: u32) {
        std::thread::sleep(LOAD_TIME);
        let thread = std::thread::current().name().map(str::to_string);
        self.log.lock().unwrap().push((max_images, thread));
    }
}

/// With batching on, the worker warms its engine's batch sizes up on the engine thread (where the GPU engines
/// keep their plans and recordings) and says it is ready only after; with `--max-batch 1` it does not warm up.
#[tokio::test]
async fn a_batching_worker_warms_up_on_the_engine_thread_before_it_is_ready() {
    for max_batch in [4, 1] {
        let log: WarmLog = Arc::default();
        let engine_log = Arc::clone(&log);
        let loader: sdhive_server::EngineLoader = Box::new(move || {
            let inner = SlowEngine { per_step: Duration::from_millis(5) };
            Ok(Box::new(Warming { inner, log: engine_log }) as Box<dyn Engine>)
        });
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let config = sdhive_server::ServerConfig { max_batch, ..common::config() };
        tokio::spawn(serve(listener, config, loader, None, std::future::pending::<()>()));
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while client.get(format!("{base}/ready")).send().await.map(|r| r.status() != 200).unwrap_or(true) {
            assert!(Instant::now() < deadline);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let warmed = log.lock().unwrap().clone();
        if max_batch > 1 {
            assert_eq!(warmed, vec![(max_batch, Some("sdhive-engine".to_string()))], "warmed before ready");
        } else {
            assert!(warmed.is_empty(), "{warmed:?}");
        }
        let r = client.post(format!("{base}/v1/jobs")).json(&json!({"prompt": "x", "steps": 2})).send().await;
        assert_eq!(r.unwrap().status(), 202, "jobs are taken once warm");
    }
}
