//! The hive's HTTP surface: the workers' public API (native jobs + SSE + cancel, OpenAI images, A1111 sdapi)
//! forwarded to a chosen worker; the registration endpoints workers call (token); the admin API (workers,
//! devices); and health, readiness and Prometheus metrics. Error bodies have the workers' shapes
//! (`docs/api.md`, "Errors").

use crate::plan::{binary_path, valid_worker_id, workers_dir, PlannedWorker};
use crate::registry::{RegisterError, WorkerStatus};
use crate::router::{self, SlotGuard, SseEvent, SubmitError, Ticket};
use crate::supervisor::{self, Spec};
use crate::Hive;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Json, Router};
use futures::StreamExt;
use sdhive_protocol::{Deregister, ErrorBody, ErrorDetail, Heartbeat, RegisterRequest, RegisterResponse};
use serde::Deserialize;
use serde_json::{json, Value};
use shared_worker::Backend;
use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};
use subtle::ConstantTimeEq;
use tokio::sync::{broadcast, oneshot};

type H = State<Arc<Hive>>;

/// OpenAI-shaped error (`{"error": {"message", "type", "param", "code"}}`).
pub fn error(status: StatusCode, kind: &str, code: &str, message: impl Into<String>) -> Response {
    let body = ErrorBody {
        error: ErrorDetail {
            message: message.into(),
            kind: kind.into(),
            param: None,
            code: Some(code.into()),
        },
    };
    let mut r = (status, Json(body)).into_response();
    if status == StatusCode::UNAUTHORIZED {
        r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    if matches!(status, StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE) {
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
    }
    r
}

/// A1111-shaped error (`{"error", "detail", "code"}`), for `/sdapi` routes.
fn a1111_error(status: StatusCode, kind: &str, code: &str, message: impl Into<String>) -> Response {
    let mut r =
        (status, Json(json!({"error": kind, "detail": message.into(), "code": code}))).into_response();
    if matches!(status, StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE) {
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
    }
    r
}

fn bearer_matches(headers: &HeaderMap, secret: &str) -> bool {
    let Some(given) = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) else { return false };
    let Some(given) = given.strip_prefix("Bearer ") else { return false };
    given.as_bytes().ct_eq(secret.as_bytes()).into()
}

async fn public_auth(State(hive): H, req: Request, next: Next) -> Response {
    if let Some(key) = &hive.config.api_key {
        if req.uri().path() != "/health" && !bearer_matches(req.headers(), key) {
            return error(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "invalid_api_key",
                "missing or wrong API key",
            );
        }
    }
    next.run(req).await
}

async fn admin_auth(State(hive): H, req: Request, next: Next) -> Response {
    match &hive.config.api_key {
        Some(key) if !bearer_matches(req.headers(), key) => error(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid_api_key",
            "missing or wrong API key",
        ),
        None if !hive.config.is_loopback() => error(
            StatusCode::FORBIDDEN,
            "permission_error",
            "admin_disabled",
            "the hive listens beyond loopback without an api_key: admin routes are disabled",
        ),
        _ => next.run(req).await,
    }
}

async fn token_auth(State(hive): H, req: Request, next: Next) -> Response {
    if !bearer_matches(req.headers(), &hive.token) {
        return error(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid_token",
            "missing or wrong worker token",
        );
    }
    next.run(req).await
}

pub fn router(hive: Arc<Hive>) -> Router {
    let registration = Router::new()
        .route("/v1/workers/register", post(register))
        .route("/v1/workers/{id}/heartbeat", post(heartbeat))
        .route("/v1/workers/{id}/deregister", post(deregister))
        .route_layer(middleware::from_fn_with_state(hive.clone(), token_auth));
    let admin = Router::new()
        .route("/v1/workers", get(list_workers).post(spawn_worker))
        .route("/v1/workers/{id}", get(get_worker).delete(stop_worker))
        .route("/v1/devices", get(devices))
        .route_layer(middleware::from_fn_with_state(hive.clone(), admin_auth));
    let public = Router::new()
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/v1/info", get(info))
        .route("/v1/jobs", post(submit_job))
        .route("/v1/jobs/{id}", get(get_job))
        .route("/v1/jobs/{id}/events", get(job_events))
        .route("/v1/jobs/{id}/cancel", post(cancel_job))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/images/generations", post(forward_openai))
        .route("/v1/images/edits", post(forward_openai))
        .route("/v1/files/{job}/{file}", get(forward_file))
        .route("/sdapi/v1/txt2img", post(forward_a1111))
        .route("/sdapi/v1/img2img", post(forward_a1111))
        .route("/sdapi/v1/interrupt", post(forward_all))
        .route("/sdapi/v1/options", get(forward_any).post(forward_all))
        .route("/sdapi/v1/{*rest}", any(forward_any))
        .route_layer(middleware::from_fn_with_state(hive.clone(), public_auth));
    Router::new()
        .merge(registration)
        .merge(admin)
        .merge(public)
        .fallback(|| async { error(StatusCode::NOT_FOUND, "not_found_error", "not_found", "no such route") })
        // Forwarded img2img bodies carry base64 images; the workers enforce their own (smaller) limit.
        .layer(DefaultBodyLimit::max(64 * 1024 * 1024))
        .with_state(hive)
}

// ---- registration ----

async fn register(State(hive): H, body: Bytes) -> Response {
    let req: RegisterRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return error(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_body", e.to_string())
        }
    };
    let id = req.worker_id.clone();
    let result = {
        let mut state = hive.lock();
        match state.register(req, Instant::now()) {
            Ok(r) => {
                let starts = match r.lost_epoch {
                    Some(epoch) => {
                        router::worker_lost(&hive, &mut state, &id, epoch, "re-registered by a new process")
                    }
                    None => router::pump(&hive, &mut state),
                };
                Ok(starts)
            }
            Err(e) => Err(e),
        }
    };
    match result {
        Ok(starts) => {
            router::start_dispatches(&hive, starts);
            tracing::info!(worker = %id, "worker registered");
            let answer = RegisterResponse {
                heartbeat_url: format!("/v1/workers/{id}/heartbeat"),
                heartbeat_interval_secs: Some(hive.config.heartbeat_interval_secs),
                deregister_url: Some(format!("/v1/workers/{id}/deregister")),
            };
            (StatusCode::CREATED, Json(answer)).into_response()
        }
        Err(RegisterError::Invalid(m)) => {
            tracing::warn!(worker = %id, "registration refused: {m}");
            error(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_registration", m)
        }
        Err(RegisterError::Conflict(m)) => {
            tracing::warn!(worker = %id, "registration refused: {m}");
            error(StatusCode::CONFLICT, "conflict_error", "worker_id_in_use", m)
        }
    }
}

async fn heartbeat(State(hive): H, Path(id): Path<String>, body: Bytes) -> Response {
    let hb: Heartbeat = match serde_json::from_slice(&body) {
        Ok(h) => h,
        Err(e) => {
            return error(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_body", e.to_string())
        }
    };
    if hb.worker_id != id {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_body",
            "worker_id does not match the URL",
        );
    }
    let known = {
        let mut state = hive.lock();
        let known = state.heartbeat(&id, hb, Instant::now());
        let starts = router::pump(&hive, &mut state);
        drop(state);
        router::start_dispatches(&hive, starts);
        known
    };
    if known {
        Json(json!({})).into_response()
    } else {
        // Tells the worker to register again (docs/protocol.md §2).
        error(
            StatusCode::NOT_FOUND,
            "not_found_error",
            "unknown_worker",
            "this hive does not know the worker",
        )
    }
}

async fn deregister(State(hive): H, Path(id): Path<String>, body: Bytes) -> Response {
    if let Ok(d) = serde_json::from_slice::<Deregister>(&body) {
        tracing::info!(worker = %id, reason = %d.reason, "worker deregistered");
    }
    let starts = {
        let mut state = hive.lock();
        match state.deregister(&id) {
            Some(epoch) => router::worker_lost(&hive, &mut state, &id, epoch, "deregistered"),
            None => Vec::new(),
        }
    };
    router::start_dispatches(&hive, starts);
    Json(json!({})).into_response()
}

// ---- admin ----

async fn list_workers(State(hive): H) -> Response {
    let now = Instant::now();
    let state = hive.lock();
    let workers: Vec<Value> = state.workers.values().map(|w| w.view(now)).collect();
    Json(json!({"workers": workers})).into_response()
}

async fn get_worker(State(hive): H, Path(id): Path<String>) -> Response {
    let state = hive.lock();
    match state.workers.get(&id) {
        Some(w) => Json(w.view(Instant::now())).into_response(),
        None => {
            error(StatusCode::NOT_FOUND, "not_found_error", "worker_not_found", format!("no worker `{id}`"))
        }
    }
}

async fn devices(State(hive): H) -> Response {
    let rows = hive.devices.lock().unwrap_or_else(|p| p.into_inner()).clone();
    Json(json!({"devices": rows})).into_response()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SpawnRequest {
    backend: String,
    #[serde(default)]
    device: usize,
    model: Option<String>,
    worker_id: Option<String>,
}

async fn spawn_worker(State(hive): H, body: Bytes) -> Response {
    let bad = |m: String| error(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_value", m);
    let req: SpawnRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad(e.to_string()),
    };
    let backend: Backend = match req.backend.parse() {
        Ok(b) => b,
        Err(e) => return bad(format!("{e}")),
    };
    let Some(model) = req.model.or_else(|| hive.config.models.first().cloned()) else {
        return bad("`model` is required (no default model is configured)".into());
    };
    // Without model roots the workers could be pointed anywhere on disk; only configured models then.
    if hive.config.model_roots.is_empty() && !hive.config.models.contains(&model) {
        return bad(format!("model `{model}` is not configured and no model_roots confine model paths"));
    }
    let worker_id = req.worker_id.unwrap_or_else(|| {
        format!("{}-{backend}{}-{}", crate::plan::host_prefix(), req.device, crate::random_hex(3))
    });
    if !valid_worker_id(&worker_id) {
        return bad("worker_id must match [A-Za-z0-9._-]{1,64}".into());
    }
    let binary = binary_path(&workers_dir(&hive.config), backend);
    if !binary.is_file() {
        return bad(format!("the {backend} worker binary is not installed: {} is missing", binary.display()));
    }
    {
        let state = hive.lock();
        if state.draining {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "shutting_down",
                "the hive is shutting down",
            );
        }
        if state
            .workers
            .get(&worker_id)
            .is_some_and(|w| !matches!(w.status, WorkerStatus::Stopped | WorkerStatus::Failed))
        {
            return error(
                StatusCode::CONFLICT,
                "conflict_error",
                "worker_id_in_use",
                format!("worker `{worker_id}` exists"),
            );
        }
    }
    let mut supervisors = hive.supervisors.lock().unwrap_or_else(|p| p.into_inner());
    let port = match hive.config.worker_port_base {
        0 => 0,
        base => base.saturating_add(u16::try_from(supervisors.len()).unwrap_or(u16::MAX)),
    };
    let spec = Spec {
        worker: PlannedWorker {
            worker_id: worker_id.clone(),
            backend,
            device_index: req.device,
            model,
            binary,
        },
        port,
    };
    tracing::info!(worker = %worker_id, "spawning a worker on request");
    if let Some(old) = supervisors.insert(worker_id.clone(), supervisor::start(&hive, spec)) {
        old.task.abort();
    }
    drop(supervisors);
    let view = hive.lock().workers.get(&worker_id).map(|w| w.view(Instant::now()));
    (StatusCode::CREATED, Json(view)).into_response()
}

async fn stop_worker(State(hive): H, Path(id): Path<String>) -> Response {
    {
        let mut state = hive.lock();
        let Some(w) = state.workers.get_mut(&id) else {
            return error(
                StatusCode::NOT_FOUND,
                "not_found_error",
                "worker_not_found",
                format!("no worker `{id}`"),
            );
        };
        w.stop_requested = true;
        if matches!(
            w.status,
            WorkerStatus::Ready | WorkerStatus::Busy | WorkerStatus::Starting | WorkerStatus::Unhealthy
        ) {
            w.status = WorkerStatus::Draining;
        }
    }
    tokio::spawn(drain_and_stop(hive.clone(), id.clone()));
    let view = hive.lock().workers.get(&id).map(|w| w.view(Instant::now()));
    (StatusCode::ACCEPTED, Json(view)).into_response()
}

/// Waits (up to the drain grace) for the worker's hive jobs to end, then stops it.
pub async fn drain_and_stop(hive: Arc<Hive>, id: String) {
    let deadline = Instant::now() + Duration::from_secs_f64(hive.config.drain_grace_secs);
    while Instant::now() < deadline && hive.lock().workers.get(&id).is_some_and(|w| w.inflight > 0) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let handle = hive.supervisors.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
    match handle {
        Some(h) => {
            let _ = h.stop.send(true);
            let _ = h.task.await;
        }
        None => {
            // An external worker: the hive cannot stop it, only stop routing to it.
            if let Some(w) = hive.lock().workers.get_mut(&id) {
                w.status = WorkerStatus::Stopped;
            }
        }
    }
}

// ---- operational ----

async fn ready(State(hive): H) -> Response {
    let state = hive.lock();
    let now = Instant::now();
    let routable = state.workers.values().filter(|w| w.routable(now)).count();
    if state.draining {
        (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "shutting_down"}))).into_response()
    } else if routable == 0 {
        (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "no_workers"}))).into_response()
    } else {
        Json(json!({"status": "ready", "workers": routable})).into_response()
    }
}

async fn info(State(hive): H) -> Response {
    let state = hive.lock();
    Json(json!({
        "role": "hive",
        "version": env!("CARGO_PKG_VERSION"),
        "workers": state.workers.len(),
        "queue": {"depth": state.queue.len(), "max": hive.config.queue_size},
        "models": model_names(&state),
        "auth_required": hive.config.api_key.is_some(),
    }))
    .into_response()
}

async fn metrics(State(hive): H) -> Response {
    let state = hive.lock();
    let m = &state.metrics;
    let mut out = String::new();
    let mut counter = |name: &str, help: &str, v: u64| {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}\n"));
    };
    counter("sdhive_hive_jobs_submitted_total", "Native jobs accepted by the hive.", m.jobs_submitted);
    counter("sdhive_hive_jobs_succeeded_total", "Native jobs that succeeded.", m.jobs_succeeded);
    counter(
        "sdhive_hive_jobs_failed_total",
        "Native jobs that failed (worker_lost included).",
        m.jobs_failed,
    );
    counter("sdhive_hive_jobs_cancelled_total", "Native jobs cancelled.", m.jobs_cancelled);
    counter("sdhive_hive_jobs_worker_lost_total", "Running jobs lost with their worker.", m.jobs_worker_lost);
    counter("sdhive_hive_jobs_redispatched_total", "Jobs sent back to the hive queue.", m.jobs_redispatched);
    counter(
        "sdhive_hive_sync_requests_total",
        "OpenAI/A1111 generation requests forwarded.",
        m.sync_requests,
    );
    counter("sdhive_hive_rejected_queue_full_total", "Requests refused with 429.", m.rejected_queue_full);
    counter("sdhive_hive_worker_restarts_total", "Managed worker restarts.", m.worker_restarts);
    out.push_str("# HELP sdhive_hive_queue_depth Requests waiting in the hive queue.\n# TYPE sdhive_hive_queue_depth gauge\n");
    out.push_str(&format!("sdhive_hive_queue_depth {}\n", state.queue.len()));
    out.push_str("# HELP sdhive_hive_workers Workers by state.\n# TYPE sdhive_hive_workers gauge\n");
    let mut by_state: HashMap<&str, usize> = HashMap::new();
    for w in state.workers.values() {
        let s = serde_json::to_value(w.status).ok().and_then(|v| v.as_str().map(String::from));
        let key = match s.as_deref() {
            Some("starting") => "starting",
            Some("ready") => "ready",
            Some("busy") => "busy",
            Some("draining") => "draining",
            Some("unhealthy") => "unhealthy",
            Some("stopped") => "stopped",
            _ => "failed",
        };
        *by_state.entry(key).or_default() += 1;
    }
    for s in ["starting", "ready", "busy", "draining", "unhealthy", "stopped", "failed"] {
        out.push_str(&format!("sdhive_hive_workers{{state=\"{s}\"}} {}\n", by_state.get(s).unwrap_or(&0)));
    }
    out.push_str("# HELP sdhive_hive_worker_inflight Requests the hive has on each worker.\n# TYPE sdhive_hive_worker_inflight gauge\n");
    for w in state.workers.values() {
        out.push_str(&format!("sdhive_hive_worker_inflight{{worker=\"{}\"}} {}\n", w.id, w.inflight));
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

fn model_names(state: &crate::State) -> Vec<String> {
    let mut names: Vec<String> = state
        .workers
        .values()
        .filter(|w| !matches!(w.status, WorkerStatus::Failed | WorkerStatus::Stopped))
        .filter_map(|w| w.registration.as_ref().map(|r| r.model.clone()))
        .collect();
    names.sort();
    names.dedup();
    names
}

fn model_object(name: &str) -> Value {
    json!({"id": name, "object": "model", "created": 0, "owned_by": "sdhive"})
}

async fn models(State(hive): H) -> Response {
    let names = model_names(&hive.lock());
    Json(json!({"object": "list", "data": names.iter().map(|n| model_object(n)).collect::<Vec<_>>()}))
        .into_response()
}

async fn model(State(hive): H, Path(id): Path<String>) -> Response {
    if model_names(&hive.lock()).contains(&id) {
        Json(model_object(&id)).into_response()
    } else {
        error(StatusCode::NOT_FOUND, "not_found_error", "model_not_found", format!("no worker serves `{id}`"))
    }
}

// ---- native jobs ----

#[derive(Debug, Deserialize)]
struct ModelQuery {
    model: Option<String>,
}

async fn submit_job(State(hive): H, Query(q): Query<ModelQuery>, body: Bytes) -> Response {
    // The shape is checked here so that a job waiting in the hive queue is not refused minutes later for a
    // typo; value ranges are the worker's to check (a refusal fails the job with `invalid_request`).
    if let Err(e) = serde_json::from_slice::<sdhive_protocol::JobRequest>(&body) {
        let code = if e.is_data() { "invalid_value" } else { "invalid_json" };
        return error(StatusCode::BAD_REQUEST, "invalid_request_error", code, e.to_string());
    }
    let value: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return error(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_json", e.to_string())
        }
    };
    match router::submit(&hive, value, q.model) {
        Ok((accepted, first)) => {
            // Dispatched at once: a worker's own validation error reaches the client as it would directly.
            if let Some(first) = first {
                if let Ok(Ok(Some((status, body)))) =
                    tokio::time::timeout(Duration::from_secs(30), first).await
                {
                    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
                    return (status, Json(body)).into_response();
                }
            }
            let location = accepted.links.self_.clone();
            let mut r = (StatusCode::ACCEPTED, Json(accepted)).into_response();
            if let Ok(v) = HeaderValue::from_str(&location) {
                r.headers_mut().insert(header::LOCATION, v);
            }
            r
        }
        Err(SubmitError::QueueFull) => error(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "queue_full",
            format!("every worker is busy and the hive queue holds {} jobs", hive.config.queue_size),
        ),
        Err(SubmitError::Draining) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "shutting_down",
            "the hive is shutting down",
        ),
        Err(SubmitError::NoWorkers) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "no_workers",
            "no worker is running or starting (see GET /v1/workers)",
        ),
        Err(SubmitError::UnknownModel(m)) => error(
            StatusCode::NOT_FOUND,
            "not_found_error",
            "model_not_found",
            format!("no worker serves `{m}`"),
        ),
    }
}

fn job_not_found(id: &str) -> Response {
    error(StatusCode::NOT_FOUND, "not_found_error", "job_not_found", format!("no job `{id}`"))
}

/// Where a job currently lives on a worker: (base URL, bearer, worker job id).
fn on_worker(hive: &Hive, state: &crate::State, id: &str) -> Option<(String, Option<String>, String)> {
    let job = state.jobs.get(id)?;
    let router::Phase::OnWorker { worker, worker_job, .. } = &job.phase else { return None };
    let w = state.workers.get(worker)?;
    let bearer =
        if w.registration.as_ref()?.api_key_required { hive.config.worker_api_key.clone() } else { None };
    Some((w.base_url()?.to_string(), bearer, worker_job.clone()))
}

async fn get_job(State(hive): H, Path(id): Path<String>) -> Response {
    let (target, local) = {
        let state = hive.lock();
        let Some(job) = state.jobs.get(&id) else { return job_not_found(&id) };
        let local = job.local_view(router::queue_position(&state, &id));
        (on_worker(&hive, &state, &id), local)
    };
    if let Some((base, bearer, worker_job)) = target {
        let mut req =
            hive.client.get(format!("{base}/v1/jobs/{worker_job}")).timeout(Duration::from_secs(30));
        if let Some(k) = bearer {
            req = req.bearer_auth(k);
        }
        if let Ok(r) = req.send().await {
            if r.status().is_success() {
                if let Ok(v) = r.json::<Value>().await {
                    return Json(router::rewrite_snapshot(v, &id)).into_response();
                }
            }
        }
    }
    let snapshot =
        hive.lock().jobs.get(&id).and_then(|j| j.snapshot.clone().filter(|_| j.phase == router::Phase::Done));
    Json(snapshot.unwrap_or(local)).into_response()
}

async fn cancel_job(State(hive): H, Path(id): Path<String>) -> Response {
    let target = {
        let mut state = hive.lock();
        if !state.jobs.contains_key(&id) {
            return job_not_found(&id);
        }
        if let Some(view) = router::cancel_local(&mut state, &id) {
            return Json(view).into_response();
        }
        on_worker(&hive, &state, &id)
    };
    let Some((base, bearer, worker_job)) = target else { return job_not_found(&id) };
    let mut req =
        hive.client.post(format!("{base}/v1/jobs/{worker_job}/cancel")).timeout(Duration::from_secs(30));
    if let Some(k) = bearer {
        req = req.bearer_auth(k);
    }
    match req.send().await {
        Ok(r) if r.status().is_success() => match r.json::<Value>().await {
            Ok(v) => Json(router::rewrite_snapshot(v, &id)).into_response(),
            Err(e) => error(StatusCode::BAD_GATEWAY, "server_error", "worker_error", e.to_string()),
        },
        Ok(r) => error(
            StatusCode::BAD_GATEWAY,
            "server_error",
            "worker_error",
            format!("the worker answered {}", r.status()),
        ),
        Err(e) => error(
            StatusCode::BAD_GATEWAY,
            "server_error",
            "worker_lost",
            format!("cannot reach the worker: {e}"),
        ),
    }
}

async fn job_events(State(hive): H, Path(id): Path<String>) -> Response {
    let (replay, rx) = {
        let state = hive.lock();
        let Some(job) = state.jobs.get(&id) else { return job_not_found(&id) };
        let mut replay = job.replay.clone();
        if replay.is_empty() {
            let position = router::queue_position(&state, &id).unwrap_or(0);
            replay.push(SseEvent {
                name: "queued".into(),
                data: json!({"event": "queued", "id": id, "position": position}).to_string(),
            });
        }
        (replay, job.events.subscribe())
    };
    let done = replay.iter().any(SseEvent::is_terminal);
    let live = futures::stream::unfold((rx, done), |(mut rx, done)| async move {
        if done {
            return None;
        }
        loop {
            match rx.recv().await {
                Ok(ev) => {
                    let terminal = ev.is_terminal();
                    return Some((ev, (rx, terminal)));
                }
                // A slow subscriber skips ahead, as on the worker.
                Err(broadcast::error::RecvError::Lagged(_)) => continue,
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    });
    let stream = futures::stream::iter(replay)
        .chain(live)
        .map(|ev| Ok::<_, Infallible>(Event::default().event(ev.name).data(ev.data)));
    Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))).into_response()
}

// ---- forwarding ----

/// Headers a worker's answer keeps on the way back.
const PASS_BACK: [header::HeaderName; 4] =
    [header::CONTENT_TYPE, header::RETRY_AFTER, header::WWW_AUTHENTICATE, header::LOCATION];

async fn send_to(
    hive: &Hive,
    base: &str,
    bearer: Option<&str>,
    method: Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Response, reqwest::Error> {
    let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let mut req = hive.client.request(method, format!("{base}{path}")).body(body);
    for h in [header::CONTENT_TYPE, header::ACCEPT] {
        if let Some(v) = headers.get(&h) {
            req = req.header(h, v.clone());
        }
    }
    // So `response_format: "url"` links point at the hive, not at the worker's loopback address.
    if let Some(host) = headers.get("x-forwarded-host").or_else(|| headers.get(header::HOST)) {
        req = req.header("x-forwarded-host", host.clone());
        let proto = headers.get("x-forwarded-proto").cloned().unwrap_or(HeaderValue::from_static("http"));
        req = req.header("x-forwarded-proto", proto);
    }
    if let Some(k) = bearer {
        req = req.bearer_auth(k);
    }
    let r = req.send().await?;
    let status = r.status();
    let mut out_headers = HeaderMap::new();
    for h in PASS_BACK.iter().chain(std::iter::once(&header::HeaderName::from_static("x-should-retry"))) {
        if let Some(v) = r.headers().get(h) {
            out_headers.insert(h.clone(), v.clone());
        }
    }
    let bytes = r.bytes().await?;
    let mut response = Response::new(Body::from(bytes));
    *response.status_mut() = status;
    *response.headers_mut() = out_headers;
    Ok(response)
}

/// Waits for a slot on a worker serving `model`, then forwards the request and holds the slot until the
/// worker answers (these routes block until the image is made).
async fn forward_sync(
    hive: Arc<Hive>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
    model: Option<String>,
    a1111: bool,
) -> Response {
    let err = |status: StatusCode, kind: &str, code: &str, message: String| {
        if a1111 {
            a1111_error(status, kind, code, message)
        } else {
            error(status, kind, code, message)
        }
    };
    let (rx, starts) = {
        let mut state = hive.lock();
        if state.draining {
            return err(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "shutting_down",
                "the hive is shutting down".into(),
            );
        }
        // Clients send model names the hive has never heard of (OpenAI SDKs default to `dall-e-2`): only a
        // name some worker serves narrows the choice.
        let model = model.filter(|m| router::model_known(&state, m));
        if !router::any_worker(&state) {
            return err(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "no_workers",
                "no worker is running or starting".into(),
            );
        }
        if state.queue.len() >= hive.config.queue_size {
            state.metrics.rejected_queue_full += 1;
            return err(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "queue_full",
                "every worker is busy and the hive queue is full".into(),
            );
        }
        state.metrics.sync_requests += 1;
        let (reply, rx) = oneshot::channel();
        state.queue.push_back(Ticket::Sync { model, reply });
        let starts = router::pump(&hive, &mut state);
        (rx, starts)
    };
    router::start_dispatches(&hive, starts);
    let Ok(slot) = rx.await else {
        return err(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "shutting_down",
            "the hive is shutting down".into(),
        );
    };
    let guard = SlotGuard { hive: hive.clone(), slot };
    let slot = &guard.slot;
    match send_to(&hive, &slot.base_url, slot.bearer.as_deref(), method, &uri, &headers, body).await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(worker = %slot.worker, "forwarded request failed: {e}");
            err(
                StatusCode::BAD_GATEWAY,
                "server_error",
                "worker_lost",
                format!("worker {} was lost while serving this request: {e}", slot.worker),
            )
        }
    }
}

async fn forward_openai(
    State(hive): H,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let model =
        serde_json::from_slice::<Value>(&body).ok().and_then(|v| v["model"].as_str().map(String::from));
    forward_sync(hive, method, uri, headers, body, model, false).await
}

async fn forward_a1111(
    State(hive): H,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let model = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v["override_settings"]["sd_model_checkpoint"].as_str().map(String::from));
    forward_sync(hive, method, uri, headers, body, model, true).await
}

/// Routable workers as (id, base URL, bearer).
fn targets(hive: &Hive) -> Vec<(String, String, Option<String>)> {
    let now = Instant::now();
    let state = hive.lock();
    state
        .workers
        .values()
        .filter(|w| w.routable(now) || (w.registration.is_some() && w.status == WorkerStatus::Draining))
        .filter_map(|w| {
            let reg = w.registration.as_ref()?;
            let bearer = if reg.api_key_required { hive.config.worker_api_key.clone() } else { None };
            Some((w.id.clone(), reg.base_url.clone(), bearer))
        })
        .collect()
}

/// Read-only A1111 routes: any worker can answer.
async fn forward_any(State(hive): H, method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    for (id, base, bearer) in targets(&hive) {
        match send_to(&hive, &base, bearer.as_deref(), method.clone(), &uri, &headers, body.clone()).await {
            Ok(r) => return r,
            Err(e) => tracing::debug!(worker = %id, "forward failed: {e}"),
        }
    }
    a1111_error(StatusCode::SERVICE_UNAVAILABLE, "server_error", "no_workers", "no worker is ready")
}

/// Settings and interrupts apply to every worker; the first answer is returned.
async fn forward_all(State(hive): H, method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let mut first = None;
    for (id, base, bearer) in targets(&hive) {
        match send_to(&hive, &base, bearer.as_deref(), method.clone(), &uri, &headers, body.clone()).await {
            Ok(r) => {
                first.get_or_insert(r);
            }
            Err(e) => tracing::debug!(worker = %id, "forward failed: {e}"),
        }
    }
    first.unwrap_or_else(|| {
        a1111_error(StatusCode::SERVICE_UNAVAILABLE, "server_error", "no_workers", "no worker is ready")
    })
}

/// `response_format: "url"` images live on the worker that made them; job ids are unique, so ask each.
async fn forward_file(State(hive): H, method: Method, uri: Uri, headers: HeaderMap) -> Response {
    for (id, base, bearer) in targets(&hive) {
        match send_to(&hive, &base, bearer.as_deref(), method.clone(), &uri, &headers, Bytes::new()).await {
            Ok(r) if r.status() != StatusCode::NOT_FOUND => return r,
            Ok(_) => {}
            Err(e) => tracing::debug!(worker = %id, "forward failed: {e}"),
        }
    }
    error(StatusCode::NOT_FOUND, "not_found_error", "job_not_found", "no worker has this file")
}
