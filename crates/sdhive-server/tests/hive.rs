//! Registration and heartbeats against a mock hive (a small axum server in the test): the bearer token, retry
//! after a refused registration, heartbeats with the worker's state, re-registration after a 404 heartbeat,
//! deregistration on shutdown, and the model library in the registration and again in a heartbeat once a
//! refresh changed it.

mod common;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use common::{config, fake_checkpoint, fake_library, slow_loader, start_with, SlowEngine};
use sdhive_engine::{BoxError, Engine, ModelSpec};
use sdhive_server::{serve, LibraryStartup, RegistrationConfig};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Default)]
struct Hive {
    register_attempts: usize,
    /// (Authorization header, body) per accepted call.
    registrations: Vec<(Option<String>, Value)>,
    heartbeats: Vec<(Option<String>, String, Value)>,
    deregistrations: Vec<(Option<String>, Value)>,
}

type Shared = Arc<Mutex<Hive>>;

fn auth(headers: &HeaderMap) -> Option<String> {
    headers.get("authorization").and_then(|v| v.to_str().ok()).map(str::to_string)
}

async fn register(
    State(hive): State<Shared>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let mut hive = hive.lock().unwrap();
    hive.register_attempts += 1;
    // The first attempt is refused, to exercise the retry.
    if hive.register_attempts == 1 {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"error": "starting"})));
    }
    hive.registrations.push((auth(&headers), body));
    let n = hive.registrations.len();
    (
        StatusCode::CREATED,
        Json(json!({
            // Relative: resolved against the callback URL.
            "heartbeat_url": format!("heartbeat/{n}"),
            "heartbeat_interval_secs": 1,
            "deregister_url": "/hive/deregister",
        })),
    )
}

async fn heartbeat(
    State(hive): State<Shared>,
    Path(n): Path<String>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> StatusCode {
    let mut hive = hive.lock().unwrap();
    hive.heartbeats.push((auth(&headers), n.clone(), body));
    // The hive "restarts" after the first registration's second heartbeat and forgets the worker.
    let for_first = hive.heartbeats.iter().filter(|(_, k, _)| k == "1").count();
    if n == "1" && for_first >= 2 {
        StatusCode::NOT_FOUND
    } else {
        StatusCode::OK
    }
}

async fn deregister(State(hive): State<Shared>, headers: HeaderMap, Json(body): Json<Value>) -> StatusCode {
    hive.lock().unwrap().deregistrations.push((auth(&headers), body));
    StatusCode::NO_CONTENT
}

async fn wait_for(hive: &Shared, what: &str, check: impl Fn(&Hive) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !check(&hive.lock().unwrap()) {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_heartbeats_reregisters_and_deregisters() {
    let hive: Shared = Arc::default();
    let app = Router::new()
        .route("/hive/register", post(register))
        .route("/hive/heartbeat/{n}", post(heartbeat))
        .route("/hive/deregister", post(deregister))
        .with_state(Arc::clone(&hive));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hive_url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });

    let mut reg = RegistrationConfig::new(format!("{hive_url}/hive/register"), Some("hive-token".into()));
    reg.backoff_initial = Duration::from_millis(50);
    // Slow steps keep the job below running across a heartbeat whatever the machine's speed.
    let server = start_with(config(), slow_loader(Duration::from_millis(20)), Some(reg)).await;

    wait_for(&hive, "the first registration", |h| !h.registrations.is_empty()).await;
    {
        let h = hive.lock().unwrap();
        assert!(h.register_attempts >= 2, "the refused attempt was retried");
        let (token, body) = &h.registrations[0];
        assert_eq!(token.as_deref(), Some("Bearer hive-token"));
        assert_eq!(body["protocol_version"], 1);
        assert_eq!(body["worker_id"], "test-worker");
        assert_eq!(body["base_url"], server.base.as_str());
        assert_eq!(body["backend"], "cpu");
        assert_eq!(body["pid"], std::process::id());
        assert_eq!(body["api_key_required"], false);
        assert!(body["model"].is_string() && body["model_family"].is_string());
        assert!(body["device"]["name"].is_string());
        assert!(body["capabilities"]["samplers"].as_array().is_some_and(|s| !s.is_empty()));
        assert_eq!(body["capabilities"]["preview"], true);
        assert!(body["version"].is_string() && body["started_at"].is_number());
        // A worker with one fixed model lists just that one as its library.
        let library = body["library"].as_array().expect("a library");
        assert_eq!(library.len(), 1, "{body}");
        assert!(library[0]["filename"].is_string() && library[0]["title"].is_string(), "{body}");
    }

    // Second heartbeat to registration 1 is answered 404 → the worker registers again.
    wait_for(&hive, "re-registration", |h| h.registrations.len() >= 2).await;
    wait_for(&hive, "a heartbeat to the new registration", |h| h.heartbeats.iter().any(|(_, n, _)| n == "2"))
        .await;
    {
        let h = hive.lock().unwrap();
        assert!(h.heartbeats.iter().all(|(t, _, _)| t.as_deref() == Some("Bearer hive-token")));
        let (_, _, beat) = &h.heartbeats[0];
        assert_eq!(beat["worker_id"], "test-worker");
        assert_eq!(beat["state"], "idle");
        assert_eq!(beat["queue_depth"], 0);
        assert!(beat["running_job"].is_null());
        assert!(beat["uptime_secs"].is_number());
    }

    // A running job shows up in heartbeats.
    let id = server.submit(&json!({"prompt": "busy", "steps": 150})).await;
    wait_for(&hive, "a busy heartbeat", |h| {
        h.heartbeats.iter().any(|(_, _, b)| b["state"] == "busy" && b["running_job"]["id"] == id.as_str())
    })
    .await;
    server.client.post(server.url(&format!("/v1/jobs/{id}/cancel"))).send().await.unwrap();
    server.wait_done(&id).await;

    assert!(hive.lock().unwrap().deregistrations.is_empty());
    server.shutdown().await.unwrap();
    let h = hive.lock().unwrap();
    assert_eq!(h.deregistrations.len(), 1);
    let (token, body) = &h.deregistrations[0];
    assert_eq!(token.as_deref(), Some("Bearer hive-token"));
    assert_eq!(body["worker_id"], "test-worker");
    assert_eq!(body["reason"], "shutdown");
}

async fn accept_registration(
    State(hive): State<Shared>,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    hive.lock().unwrap().registrations.push((None, body));
    (StatusCode::CREATED, Json(json!({"heartbeat_url": "heartbeat/1", "heartbeat_interval_secs": 30})))
}

async fn accept_heartbeat(
    State(hive): State<Shared>,
    Path(n): Path<String>,
    Json(body): Json<Value>,
) -> StatusCode {
    hive.lock().unwrap().heartbeats.push((None, n, body));
    StatusCode::OK
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_library_is_registered_and_sent_again_when_it_changes() {
    let hive: Shared = Arc::default();
    let app = Router::new()
        .route("/hive/register", post(accept_registration))
        .route("/hive/heartbeat/{n}", post(accept_heartbeat))
        .with_state(Arc::clone(&hive));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hive_url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });

    let (dir, library) = fake_library(&["a.safetensors", "b.safetensors"]);
    let factory = |_: &ModelSpec| -> Result<Box<dyn Engine>, BoxError> {
        Ok(Box::new(SlowEngine { per_step: Duration::from_millis(1) }))
    };
    let initial = library.find("a").ok();
    let startup = LibraryStartup { library, factory: Box::new(factory), initial, initial_required: true };
    let worker = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", worker.local_addr().unwrap());
    let reg = RegistrationConfig::new(format!("{hive_url}/hive/register"), None);
    tokio::spawn(serve(worker, config(), startup, Some(reg), std::future::pending::<()>()));

    wait_for(&hive, "the registration", |h| !h.registrations.is_empty()).await;
    let filenames = |library: &Value| -> Vec<String> {
        let mut names: Vec<String> = library
            .as_array()
            .map(|l| l.iter().filter_map(|m| m["filename"].as_str().map(String::from)).collect())
            .unwrap_or_default();
        names.sort();
        names
    };
    let canonical = std::fs::canonicalize(dir.path()).unwrap();
    let path = |name: &str| canonical.join(name).display().to_string();
    {
        let h = hive.lock().unwrap();
        let body = &h.registrations[0].1;
        assert_eq!(filenames(&body["library"]), [path("a.safetensors"), path("b.safetensors")], "{body}");
        assert_eq!(body["library"][0]["name"], "a.safetensors");
    }

    // A new file, a refresh: a heartbeat carries the new library at once (the interval asked is 30 s).
    fake_checkpoint(&dir.path().join("c.safetensors"));
    let refreshed =
        reqwest::Client::new().post(format!("{base}/sdapi/v1/refresh-checkpoints")).send().await.unwrap();
    assert!(refreshed.status().is_success());
    // (An earlier one may carry the loaded checkpoint's hash, computed after loading: its title changed.)
    let has_c =
        |b: &Value| b["library"].as_array().is_some_and(|l| l.iter().any(|m| m["name"] == "c.safetensors"));
    wait_for(&hive, "a heartbeat with the new library", |h| h.heartbeats.iter().any(|(_, _, b)| has_c(b)))
        .await;
    let sent = |h: &Hive| h.heartbeats.iter().filter(|(_, _, b)| b["library"].is_array()).count();
    let before = {
        let h = hive.lock().unwrap();
        let (_, n, beat) = h.heartbeats.iter().find(|(_, _, b)| has_c(b)).unwrap();
        assert_eq!(n, "1");
        assert_eq!(
            filenames(&beat["library"]),
            [path("a.safetensors"), path("b.safetensors"), path("c.safetensors")],
            "{beat}"
        );
        sent(&h)
    };
    // An unchanged library is not sent again (it is looked at every second).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(sent(&hive.lock().unwrap()), before);
}
