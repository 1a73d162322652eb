//! The hive's HTTP surface: the workers' public API (native jobs + SSE + cancel, OpenAI images, A1111 sdapi)
//! forwarded to a chosen worker — with the model resolved here and written into the request, and synchronous
//! requests run again elsewhere when their worker is lost; the model routes answered from the hive's own
//! catalogue (`/v1/models`, `sd-models`, `sd-vae`, refreshes, the selected model in `options`, `progress`
//! across the node); the registration endpoints workers call (token); the admin API (workers, devices); and
//! health, readiness and Prometheus metrics. Error bodies have the workers' shapes (`docs/api.md`, "Errors").

use crate::plan::{binary_path, valid_worker_id, workers_dir, PlannedWorker};
use crate::registry::{RegisterError, WorkerStatus};
use crate::router::{self, SlotGuard, SseEvent, SubmitError};
use crate::supervisor::{self, Spec};
use crate::Hive;
use crate::{models, rewrite};
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
use tokio::sync::broadcast;

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

/// [`error`] about one request field (`param`).
fn error_about(
    status: StatusCode,
    kind: &str,
    code: &str,
    param: &str,
    message: impl Into<String>,
) -> Response {
    let body = ErrorBody {
        error: ErrorDetail {
            message: message.into(),
            kind: kind.into(),
            param: Some(param.into()),
            code: Some(code.into()),
        },
    };
    let mut r = (status, Json(body)).into_response();
    if status == StatusCode::SERVICE_UNAVAILABLE {
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
    }
    r
}

/// A1111-shaped error (`{"error", "detail", "field", "code"}`), for `/sdapi` routes.
fn a1111_error(status: StatusCode, kind: &str, code: &str, message: impl Into<String>) -> Response {
    a1111_error_about(status, kind, code, None, message)
}

fn a1111_error_about(
    status: StatusCode,
    kind: &str,
    code: &str,
    field: Option<&str>,
    message: impl Into<String>,
) -> Response {
    let body = json!({"error": kind, "detail": message.into(), "field": field, "code": code});
    let mut r = (status, Json(body)).into_response();
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

/// 401 for the public and admin routes: one `WWW-Authenticate` challenge per configured credential.
fn unauthorized(credentials: &sdhive_protocol::Credentials) -> Response {
    let mut r = error(
        StatusCode::UNAUTHORIZED,
        "authentication_error",
        "invalid_api_key",
        "missing or wrong credentials (the API key as a bearer token, or the --api-auth user and password)",
    );
    r.headers_mut().remove(header::WWW_AUTHENTICATE);
    for challenge in credentials.challenges() {
        r.headers_mut().append(header::WWW_AUTHENTICATE, HeaderValue::from_static(challenge));
    }
    r
}

fn authorization(req: &Request) -> Option<&str> {
    req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok())
}

/// The API key (bearer) or the `--api-auth` users (Basic), whichever are configured. `/health` and `/ready` stay
/// open: probes (Kubernetes', a load balancer's) carry no credentials, and they say no more than up or not.
async fn public_auth(State(hive): H, req: Request, next: Next) -> Response {
    let credentials = hive.config.credentials();
    let probe = matches!(req.uri().path(), "/health" | "/ready");
    if !probe && !credentials.accepts(authorization(&req)) {
        return unauthorized(&credentials);
    }
    next.run(req).await
}

async fn admin_auth(State(hive): H, req: Request, next: Next) -> Response {
    let credentials = hive.config.credentials();
    match credentials.required() {
        true if !credentials.accepts(authorization(&req)) => unauthorized(&credentials),
        false if !hive.config.is_loopback() => error(
            StatusCode::FORBIDDEN,
            "permission_error",
            "admin_disabled",
            "the hive listens beyond loopback without an api_key or api_auth: admin routes are disabled",
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
        .route("/sdapi/v1/options", get(get_options).post(set_options))
        .route("/sdapi/v1/progress", get(progress))
        .route("/sdapi/v1/sd-models", get(sd_models))
        .route("/sdapi/v1/sd-vae", get(sd_vae))
        .route("/sdapi/v1/refresh-checkpoints", post(refresh))
        .route("/sdapi/v1/refresh-vae", post(refresh))
        .route("/sdapi/v1/loras", get(loras))
        .route("/sdapi/v1/embeddings", get(embeddings))
        .route("/sdapi/v1/refresh-loras", post(refresh_networks))
        .route("/sdapi/v1/refresh-embeddings", post(refresh_networks))
        .route("/sdapi/v1/unload-checkpoint", post(unload_checkpoint))
        .route("/sdapi/v1/reload-checkpoint", post(reload_checkpoint))
        .route("/sdapi/v1/memory", get(memory))
        .route("/sdapi/v1/cmd-flags", get(cmd_flags))
        .route("/sdapi/v1/prompt-styles", get(prompt_styles))
        .route("/sdapi/v1/{*rest}", any(forward_any))
        .route_layer(middleware::from_fn_with_state(hive.clone(), public_auth));
    Router::new()
        .merge(registration)
        .merge(admin)
        .merge(public)
        // No credentials for the page itself: it asks for the key and sends it with its API calls.
        .merge(sdhive_webui::router())
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

/// A worker's admin view with its loaded model's title.
fn worker_view(state: &crate::State, w: &crate::registry::WorkerEntry, now: Instant) -> Value {
    let mut v = w.view(now);
    v["loaded_model"] = json!(w.loaded.as_deref().map(|m| models::title_of(state, m)));
    v
}

async fn list_workers(State(hive): H) -> Response {
    let now = Instant::now();
    let (mut body, below) = {
        let state = hive.lock();
        let workers: Vec<Value> = state.workers.values().map(|w| worker_view(&state, w, now)).collect();
        // Node hives answer for their own workers: asked below, outside the lock.
        let below: Vec<(usize, String, Option<String>)> = state
            .workers
            .values()
            .enumerate()
            .filter(|(_, w)| w.is_hive())
            .filter_map(|(i, w)| {
                let reg = w.registration.as_ref()?;
                let bearer = if reg.api_key_required { hive.config.worker_api_key.clone() } else { None };
                Some((i, reg.base_url.clone(), bearer))
            })
            .collect();
        // Configured models no worker preloads: said here so that none is silently dropped.
        let preloaded: Vec<&str> =
            state.workers.values().filter_map(|w| w.planned_model.as_deref()).collect();
        let on_demand: Vec<&String> =
            hive.config.models.iter().filter(|m| !preloaded.contains(&m.as_str())).collect();
        let body = json!({
            "workers": workers,
            "selected_model": state.selected.as_deref().map(|m| models::title_of(&state, m)),
            "on_demand_models": on_demand,
            "on_demand": "a request for a model no worker has loaded goes to an idle worker, which switches to it; \
                          when none can switch without thrashing, another worker is started for it on a device with \
                          room (max_workers_per_device, max_cpu_workers, its free memory), and stopped again after \
                          idle_worker_secs without work",
            "on_demand_last_decision": state.on_demand_note,
        });
        (body, below)
    };
    let asked = below.into_iter().map(|(i, base, bearer)| {
        let hive = hive.clone();
        async move {
            let mut req = hive.client.get(format!("{base}/v1/workers")).timeout(Duration::from_secs(3));
            if let Some(k) = bearer {
                req = req.bearer_auth(k);
            }
            let answer = match req.send().await {
                Ok(r) if r.status().is_success() => r.json::<Value>().await.map_err(|e| e.to_string()),
                Ok(r) => Err(format!("the node answered {}", r.status())),
                Err(e) => Err(e.to_string()),
            };
            (i, answer)
        }
    });
    for (i, answer) in futures::future::join_all(asked).await {
        let entry = &mut body["workers"][i];
        match answer {
            Ok(v) => entry["workers"] = v["workers"].clone(),
            Err(e) => entry["workers_error"] = json!(e),
        }
    }
    Json(body).into_response()
}

async fn get_worker(State(hive): H, Path(id): Path<String>) -> Response {
    let state = hive.lock();
    match state.workers.get(&id) {
        Some(w) => Json(worker_view(&state, w, Instant::now())).into_response(),
        None => {
            error(StatusCode::NOT_FOUND, "not_found_error", "worker_not_found", format!("no worker `{id}`"))
        }
    }
}

/// The device table, with the workers on each device now (planned and on demand) and what they hold. Free
/// memory is what the device's workers reported in their last heartbeats; a device without a reporting worker is
/// asked of its tool (`nvidia-smi`, `rocm-smi`, `/proc/meminfo`) per call, else detection's figure stands.
async fn devices(State(hive): H) -> Response {
    let rows = hive.devices.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let on_device = |w: &crate::registry::WorkerEntry, r: &crate::plan::Row| {
        w.backend == r.device.backend.name() && w.device_index == Some(r.device.index)
    };
    let reported: Vec<Option<u64>> = {
        let state = hive.lock();
        rows.iter()
            .map(|r| {
                let free = state.workers.values().filter(|w| on_device(w, r));
                free.filter_map(|w| w.heartbeat.as_ref()?.memory_free_bytes).min()
            })
            .collect()
    };
    let mut free = Vec::with_capacity(rows.len());
    for (r, reported) in rows.iter().zip(reported) {
        free.push(match reported {
            Some(bytes) => Some(bytes),
            None => crate::detect::free_memory(r.device.backend, r.device.index).await,
        });
    }
    let state = hive.lock();
    let rows: Vec<Value> = rows
        .iter()
        .zip(free)
        .map(|(r, free)| {
            let mut v = serde_json::to_value(r).unwrap_or(Value::Null);
            v["memory_free_bytes"] = json!(free.or(r.device.memory_free_bytes));
            let here: Vec<Value> = state
                .workers
                .values()
                .filter(|w| w.managed && on_device(w, r))
                .map(|w| {
                    json!({
                        "id": w.id,
                        "state": w.status,
                        "loaded_model": w.loaded.as_deref().map(|m| models::title_of(&state, m)),
                        "on_demand": w.on_demand.is_some(),
                    })
                })
                .collect();
            v["workers"] = json!(here);
            v
        })
        .collect();
    // A gateway's devices are its node hives': each node's as its last heartbeat gave them.
    let nodes: Vec<Value> = state
        .workers
        .values()
        .filter_map(|w| Some(json!({"id": w.id, "state": w.status, "devices": w.node.as_ref()?.devices})))
        .collect();
    Json(json!({"devices": rows, "nodes": nodes, "on_demand_last_decision": state.on_demand_note}))
        .into_response()
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
    let has_library = !hive.config.models_dirs.is_empty();
    let model = req.model.or_else(|| hive.config.models.first().cloned());
    if model.is_none() && !has_library {
        return bad("`model` is required (no default model and no models dir is configured)".into());
    }
    // Without model roots the workers could be pointed anywhere on disk; only configured models then (the
    // models dirs confine like roots).
    if let Some(m) = &model {
        if hive.config.worker_roots().is_empty() && !hive.config.models.contains(m) {
            return bad(format!("model `{m}` is not configured and no model_roots confine model paths"));
        }
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
    let worker =
        PlannedWorker { worker_id: worker_id.clone(), backend, device_index: req.device, model, binary };
    let spec = Spec::planned(worker, port);
    tracing::info!(worker = %worker_id, "spawning a worker on request");
    if let Some(old) = supervisors.insert(worker_id.clone(), supervisor::start(&hive, spec)) {
        old.task.abort();
    }
    drop(supervisors);
    let view = {
        let state = hive.lock();
        state.workers.get(&worker_id).map(|w| worker_view(&state, w, Instant::now()))
    };
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
    // The native size of the selected model, as a worker holding it reported it (the web page's default size).
    let holding = |w: &&crate::registry::WorkerEntry| {
        w.registration.is_some() && state.selected.is_some() && w.loaded == state.selected
    };
    let native = state
        .workers
        .values()
        .find(holding)
        .or_else(|| state.workers.values().find(|w| w.registration.is_some()))
        .and_then(|w| w.registration.as_ref())
        .map(|r| (r.capabilities.native_width, r.capabilities.native_height));
    Json(json!({
        "native_width": native.map(|n| n.0),
        "native_height": native.map(|n| n.1),
        "role": "hive",
        "version": env!("CARGO_PKG_VERSION"),
        "workers": state.workers.len(),
        "queue": {"depth": state.queue.len(), "max": hive.config.queue_size},
        // Counters since start: the node view turns them into jobs per second.
        "jobs": {
            "submitted": state.metrics.jobs_submitted,
            "succeeded": state.metrics.jobs_succeeded,
            "failed": state.metrics.jobs_failed,
            "cancelled": state.metrics.jobs_cancelled,
        },
        "models": models::list(&state).into_iter().map(|m| m.model.name).collect::<Vec<_>>(),
        "selected_model": state.selected.as_deref().map(|m| models::title_of(&state, m)),
        "auth_required": hive.config.credentials().required(),
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
        "sdhive_hive_jobs_rerun_total",
        "Native jobs run again because their worker was lost while running them.",
        m.jobs_rerun,
    );
    counter(
        "sdhive_hive_sync_rerun_total",
        "OpenAI/A1111 requests run again because their worker was lost.",
        m.sync_rerun,
    );
    counter(
        "sdhive_hive_sync_worker_lost_total",
        "OpenAI/A1111 requests answered worker_lost (lost twice).",
        m.sync_worker_lost,
    );
    counter(
        "sdhive_hive_model_switches_total",
        "Requests dispatched to a worker that had another model loaded.",
        m.model_switches,
    );
    counter(
        "sdhive_hive_sync_requests_total",
        "OpenAI/A1111 generation requests forwarded.",
        m.sync_requests,
    );
    counter(
        "sdhive_hive_on_demand_workers_started_total",
        "Workers started for a model no worker had and none could switch to.",
        m.on_demand_started,
    );
    counter(
        "sdhive_hive_on_demand_workers_stopped_total",
        "Workers started on demand and stopped again after idle_worker_secs.",
        m.on_demand_stopped,
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

async fn models(State(hive): H) -> Response {
    let listed = models::list(&hive.lock());
    Json(json!({"object": "list", "data": listed.iter().map(models::Listed::openai).collect::<Vec<_>>()}))
        .into_response()
}

async fn model(State(hive): H, Path(id): Path<String>) -> Response {
    let found = {
        let state = hive.lock();
        match models::resolve(&state, Some(&id)) {
            Ok(Some(source)) => Ok(models::list(&state).into_iter().find(|m| m.model.filename == source)),
            Ok(None) => Ok(None),
            Err(e) => Err(e),
        }
    };
    match found {
        Ok(Some(m)) => Json(m.openai()).into_response(),
        Ok(None) => error_about(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            "model",
            format!("no model `{id}`"),
        ),
        Err(e) => error_about(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            "model",
            models::not_found_message(&e),
        ),
    }
}

async fn sd_models(State(hive): H) -> Response {
    let listed = models::list(&hive.lock());
    Json(listed.iter().map(models::Listed::a1111).collect::<Vec<_>>()).into_response()
}

async fn sd_vae(State(hive): H) -> Response {
    let state = hive.lock();
    let vaes: Vec<Value> = state
        .catalog
        .vaes
        .iter()
        .map(|v| json!({"model_name": v.name, "filename": v.path.display().to_string()}))
        .collect();
    Json(vaes).into_response()
}

/// `refresh-checkpoints` and `refresh-vae`: the hive scans again (one scan covers both), then every worker.
async fn refresh(State(hive): H, method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let config = hive.config.clone();
    let scanned = tokio::task::spawn_blocking(move || models::scan(&config)).await;
    match scanned {
        Ok(Ok(catalog)) => hive.lock().catalog = catalog,
        Ok(Err(e)) => {
            return a1111_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "model_library_unreadable",
                e.to_string(),
            )
        }
        Err(e) => {
            return a1111_error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal", e.to_string())
        }
    }
    let answer = forward_all(State(hive), method, uri, headers, body).await;
    // No worker to tell is fine: the hive's own list is fresh.
    if answer.status() == StatusCode::SERVICE_UNAVAILABLE {
        return Json(Value::Null).into_response();
    }
    answer
}

/// `GET /sdapi/v1/loras`: every worker's LoRAs as one list, one entry per name. Workers resolve the names, so
/// the hive keeps no LoRA catalogue of its own.
async fn loras(State(hive): H, method: Method, uri: Uri, headers: HeaderMap) -> Response {
    let lists: Vec<Vec<sdhive_protocol::ListedLora>> = collect_json(&hive, method, &uri, &headers).await;
    Json(sdhive_protocol::union_loras(lists)).into_response()
}

/// `GET /sdapi/v1/embeddings`: the workers' lists merged; an embedding loaded on any worker counts as loaded
/// (workers may hold models of different families).
async fn embeddings(State(hive): H, method: Method, uri: Uri, headers: HeaderMap) -> Response {
    let lists: Vec<sdhive_protocol::EmbeddingList> = collect_json(&hive, method, &uri, &headers).await;
    let mut merged = sdhive_protocol::EmbeddingList::default();
    for list in lists {
        merged.merge(list);
    }
    Json(merged).into_response()
}

/// `refresh-loras` and `refresh-embeddings`: every worker rescans.
async fn refresh_networks(
    State(hive): H,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let answer = forward_all(State(hive), method, uri, headers, body).await;
    if answer.status() == StatusCode::SERVICE_UNAVAILABLE {
        return Json(Value::Null).into_response();
    }
    answer
}

/// Every ready worker's answer to the same request, parsed as `T`; workers that fail or answer otherwise are
/// left out (logged), so one sick worker does not empty a listing.
async fn collect_json<T: serde::de::DeserializeOwned>(
    hive: &Hive,
    method: Method,
    uri: &Uri,
    headers: &HeaderMap,
) -> Vec<T> {
    let mut out = Vec::new();
    for (id, base, bearer) in targets(hive) {
        let answer =
            send_to(hive, &base, bearer.as_deref(), method.clone(), uri, headers, Bytes::new()).await;
        let parsed = match answer {
            Ok(r) if r.status().is_success() => axum::body::to_bytes(r.into_body(), 64 * 1024 * 1024)
                .await
                .map_err(|e| e.to_string())
                .and_then(|bytes| serde_json::from_slice::<T>(&bytes).map_err(|e| e.to_string())),
            Ok(r) => Err(format!("answered {}", r.status())),
            Err(e) => Err(e.to_string()),
        };
        match parsed {
            Ok(v) => out.push(v),
            Err(e) => tracing::warn!(worker = %id, "left out of the listing {}: {e}", uri.path()),
        }
    }
    out
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
    let mut value: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return error(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_json", e.to_string())
        }
    };
    // Pinned before the first dispatch, so that a re-run after a lost worker makes the same image.
    rewrite::json_request(&mut value, None);
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
        Err(e) => submit_error(&hive, e, None),
    }
}

/// A refused submission in the route's shape; `a1111_field`: the A1111 field that named the model (A1111
/// answers an unknown model with 400 about it, OpenAI and the native API with 404).
fn submit_error(hive: &Hive, e: SubmitError, a1111_field: Option<&str>) -> Response {
    let plain = |status: StatusCode, kind: &str, code: &str, message: String| match a1111_field {
        Some(_) => a1111_error(status, kind, code, message),
        None => error(status, kind, code, message),
    };
    match e {
        SubmitError::QueueFull => plain(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "queue_full",
            format!("every worker is busy and the hive queue holds {} requests", hive.config.queue_size),
        ),
        SubmitError::Draining => plain(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "shutting_down",
            "the hive is shutting down".into(),
        ),
        SubmitError::NoWorkers => plain(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "no_workers",
            "no worker is running or starting (see GET /v1/workers)".into(),
        ),
        SubmitError::Unservable(why) => {
            plain(StatusCode::SERVICE_UNAVAILABLE, "server_error", "model_unavailable", why)
        }
        SubmitError::UnknownModel(nf) => match a1111_field {
            Some(field) => a1111_error_about(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "model_not_found",
                Some(field),
                format!("invalid `{field}`: {}", models::not_found_message(&nf)),
            ),
            None => error_about(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "model_not_found",
                "model",
                models::not_found_message(&nf),
            ),
        },
    }
}

fn job_not_found(id: &str) -> Response {
    error(StatusCode::NOT_FOUND, "not_found_error", "job_not_found", format!("no job `{id}`"))
}

/// Where a job currently lives on a worker: (base URL, bearer, worker job id).
/// Where a job runs now: the worker's URL, the key it wants, the worker's job id, and the worker's life.
struct OnWorker {
    base: String,
    bearer: Option<String>,
    worker_job: String,
    worker: String,
    epoch: u64,
}

fn on_worker(hive: &Hive, state: &crate::State, id: &str) -> Option<OnWorker> {
    let job = state.jobs.get(id)?;
    let router::Phase::OnWorker { worker, worker_job, epoch, .. } = &job.phase else { return None };
    let w = state.workers.get(worker)?;
    let bearer =
        if w.registration.as_ref()?.api_key_required { hive.config.worker_api_key.clone() } else { None };
    Some(OnWorker {
        base: w.base_url()?.to_string(),
        bearer,
        worker_job: worker_job.clone(),
        worker: worker.clone(),
        epoch: *epoch,
    })
}

/// Sends a request about a job to its worker; `None` when the worker's life ends first (the job then moved on:
/// back to the hive queue, or to another worker).
async fn ask_worker(
    hive: &Hive,
    at: &OnWorker,
    req: reqwest::RequestBuilder,
) -> Option<reqwest::Result<reqwest::Response>> {
    let req = match &at.bearer {
        Some(k) => req.bearer_auth(k),
        None => req,
    };
    tokio::select! {
        r = req.send() => Some(r),
        () = router::life_ended(hive, &at.worker, at.epoch) => None,
    }
}

async fn get_job(State(hive): H, Path(id): Path<String>) -> Response {
    let target = {
        let state = hive.lock();
        if !state.jobs.contains_key(&id) {
            return job_not_found(&id);
        }
        on_worker(&hive, &state, &id)
    };
    if let Some(at) = target {
        let url = format!("{}/v1/jobs/{}", at.base, at.worker_job);
        let asked = ask_worker(&hive, &at, hive.client.get(url).timeout(Duration::from_secs(30))).await;
        if let Some(Ok(r)) = asked {
            if r.status().is_success() {
                if let Ok(v) = r.json::<Value>().await {
                    return Json(router::rewrite_snapshot(v, &id)).into_response();
                }
            }
        }
    }
    let state = hive.lock();
    let Some(job) = state.jobs.get(&id) else { return job_not_found(&id) };
    let done = job.snapshot.clone().filter(|_| job.phase == router::Phase::Done);
    Json(done.unwrap_or_else(|| job.local_view(router::queue_position(&state, &id)))).into_response()
}

async fn cancel_job(State(hive): H, Path(id): Path<String>) -> Response {
    // Twice at most: a worker lost while the cancel is on its way leaves the job in the hive (or on another
    // worker), where the second attempt finds it.
    for _ in 0..2 {
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
        let Some(at) = target else { return job_not_found(&id) };
        let url = format!("{}/v1/jobs/{}/cancel", at.base, at.worker_job);
        let answer =
            match ask_worker(&hive, &at, hive.client.post(url).timeout(Duration::from_secs(30))).await {
                Some(answer) => answer,
                None => continue,
            };
        return match answer {
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
        };
    }
    error(
        StatusCode::BAD_GATEWAY,
        "server_error",
        "worker_lost",
        "the job's workers were lost while the cancel was on its way; try again",
    )
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

/// Headers a worker's answer keeps on the way back (`Server-Timing`: where a generation's time went).
const PASS_BACK: [header::HeaderName; 6] = [
    header::CONTENT_TYPE,
    header::RETRY_AFTER,
    header::WWW_AUTHENTICATE,
    header::LOCATION,
    header::HeaderName::from_static("server-timing"),
    header::HeaderName::from_static("x-should-retry"),
];

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
    for h in &PASS_BACK {
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

/// Where an A1111 request names its model, for the error that names it.
const A1111_MODEL_FIELD: &str = "override_settings.sd_model_checkpoint";

/// Waits for a slot on a worker chosen for `model`, forwards the request and holds the slot until the worker
/// answers (these routes block until the image is made). A worker lost meanwhile (the connection fails) gets
/// the request run again once elsewhere — the body carries its model and seed, so the image is the same —
/// before the client is told `worker_lost`.
async fn run_sync(
    hive: Arc<Hive>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
    model: Option<String>,
    a1111: bool,
) -> Response {
    let field = if a1111 { Some(A1111_MODEL_FIELD) } else { None };
    let since = Instant::now();
    let mut avoid: Option<router::Avoid> = None;
    loop {
        let rx = match router::enqueue_sync(&hive, model.clone(), since, avoid.clone()) {
            Ok(rx) => rx,
            Err(e) => return submit_error(&hive, e, field),
        };
        let Ok(slot) = rx.await else {
            return submit_error(&hive, SubmitError::Draining, field);
        };
        let guard = SlotGuard { hive: hive.clone(), slot };
        let slot = &guard.slot;
        let send = send_to(
            &hive,
            &slot.base_url,
            slot.bearer.as_deref(),
            method.clone(),
            &uri,
            &headers,
            body.clone(),
        );
        // A cut link sends nothing back: the request is given up once the health sweep ends that worker's life.
        let sent = tokio::select! {
            sent = send => sent.map_err(|e| (e.is_connect(), e.to_string())),
            () = router::slot_lost(&hive, slot) => Err((false, "it stopped heartbeating".to_string())),
        };
        let e = match sent {
            Ok(r) => return r,
            Err((refused, e)) => {
                if refused {
                    let starts =
                        router::connection_refused(&hive, &mut hive.lock(), &slot.worker, slot.epoch);
                    router::start_dispatches(&hive, starts);
                }
                e
            }
        };
        let rerun = avoid.is_none();
        {
            let mut state = hive.lock();
            // Most likely dead; its supervisor (or the health sweep) will say. Meanwhile nothing new goes there.
            if let Some(w) = state.workers.get_mut(&slot.worker) {
                if w.epoch == slot.epoch {
                    w.cooldown_until = Some(Instant::now() + Duration::from_secs(2));
                }
            }
            if rerun {
                state.metrics.sync_rerun += 1;
            } else {
                state.metrics.sync_worker_lost += 1;
            }
        }
        if !rerun {
            tracing::warn!(worker = %slot.worker, "forwarded request failed again: {e}");
            let message = format!(
                "worker {} was lost while serving this request, which had been run again: {e}",
                slot.worker
            );
            return if a1111 {
                a1111_error(StatusCode::BAD_GATEWAY, "server_error", "worker_lost", message)
            } else {
                error(StatusCode::BAD_GATEWAY, "server_error", "worker_lost", message)
            };
        }
        tracing::warn!(worker = %slot.worker, "forwarded request failed: {e}; running it again on another worker");
        avoid = Some(router::Avoid::new(&hive, &slot.worker, slot.epoch));
        drop(guard);
    }
}

/// An OpenAI or A1111 generation: resolves the model it names (refusing unknown ones before they queue),
/// writes it and a pinned seed into the body, and runs it.
async fn forward_generation(
    hive: Arc<Hive>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
    a1111: bool,
) -> Response {
    let boundary =
        headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).and_then(rewrite::multipart_boundary);
    let mut json: Option<Value> = match boundary {
        Some(_) => None,
        None => serde_json::from_slice(&body).ok(),
    };
    let named: Option<String> = match (&boundary, &json) {
        (Some(b), _) => rewrite::multipart_text_fields(&body, b)
            .into_iter()
            .rev()
            .find(|(k, _)| k == "model")
            .map(|(_, v)| v),
        (None, Some(v)) if a1111 => v["override_settings"]["sd_model_checkpoint"].as_str().map(String::from),
        (None, Some(v)) => v["model"].as_str().map(String::from),
        (None, None) => None,
    };
    let resolved = router::resolve_model(&hive, &hive.lock(), named.as_deref());
    let model = match resolved {
        Ok(m) => m,
        Err(e) => return submit_error(&hive, e, a1111.then_some(A1111_MODEL_FIELD)),
    };
    let body = match (&boundary, json.as_mut()) {
        (Some(b), _) => {
            rewrite::multipart_request(&body, b, model.as_deref()).map(Bytes::from).unwrap_or(body)
        }
        (None, Some(v)) => {
            if a1111 {
                rewrite::a1111_request(v, model.as_deref());
            } else {
                rewrite::json_request(v, model.as_deref());
            }
            serde_json::to_vec(v).map(Bytes::from).unwrap_or(body)
        }
        // Not JSON: forwarded as it is, for the worker to explain.
        (None, None) => body,
    };
    run_sync(hive, method, uri, headers, body, model, a1111).await
}

async fn forward_openai(
    State(hive): H,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    forward_generation(hive, method, uri, headers, body, false).await
}

async fn forward_a1111(
    State(hive): H,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    forward_generation(hive, method, uri, headers, body, true).await
}

/// Makes sure some worker has `model` loaded, as A1111 does before answering an options change: when none
/// has, the options POST (with `extra` options) goes to the worker the routing policy picks — the least
/// recently used idle one, or the first to become idle — and its answer is returned.
async fn ensure_loaded(
    hive: &Arc<Hive>,
    model: &str,
    extra: &serde_json::Map<String, Value>,
    headers: &HeaderMap,
) -> Option<Response> {
    let held = {
        let now = Instant::now();
        let state = hive.lock();
        state.workers.values().any(|w| w.routable(now) && w.holds(model))
    };
    if held {
        return None;
    }
    let mut body = extra.clone();
    body.insert("sd_model_checkpoint".into(), json!(model));
    let body = serde_json::to_vec(&body).map(Bytes::from).unwrap_or_default();
    let uri = Uri::from_static("/sdapi/v1/options");
    let mut headers = headers.clone();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Some(run_sync(hive.clone(), Method::POST, uri, headers, body, Some(model.to_string()), true).await)
}

/// `sd_model_checkpoint` (resolved here; 400 naming it and the closest titles when unknown) becomes the hive's
/// selected model, loaded on a worker before the answer; other options go to every worker.
async fn set_options(State(hive): H, method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let Ok(Value::Object(mut given)) = serde_json::from_slice::<Value>(&body) else {
        // Not an object: the workers explain.
        return forward_all(State(hive), method, uri, headers, body).await;
    };
    let mut answer = None;
    if let Some(v) = given.remove("sd_model_checkpoint").filter(|v| !v.is_null()) {
        let Some(q) = v.as_str() else {
            return a1111_error_about(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "invalid_value",
                Some("sd_model_checkpoint"),
                format!("invalid `sd_model_checkpoint`: must be a string, got {v}"),
            );
        };
        let resolved = router::resolve_model(&hive, &hive.lock(), Some(q));
        match resolved {
            Ok(Some(model)) => {
                tracing::info!(model, "selected model");
                hive.lock().selected = Some(model.clone());
                if let Some(r) = ensure_loaded(&hive, &model, &given, &headers).await {
                    if !r.status().is_success() {
                        return r;
                    }
                    answer = Some(r);
                }
            }
            // OpenAI's names mean "the selected model": nothing changes.
            Ok(None) => {}
            Err(e) => return submit_error(&hive, e, Some("sd_model_checkpoint")),
        }
    }
    if !given.is_empty() {
        let rest = serde_json::to_vec(&Value::Object(given)).map(Bytes::from).unwrap_or_default();
        let r = forward_all(State(hive), method, uri, headers, rest).await;
        if answer.is_none() || !r.status().is_success() {
            return r;
        }
    }
    answer.unwrap_or_else(|| Json(Value::Null).into_response())
}

/// A worker's options, with the hive's selected model.
async fn get_options(State(hive): H, method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let r = forward_any(State(hive.clone()), method, uri, headers, body).await;
    if !r.status().is_success() {
        return r;
    }
    let Ok(bytes) = axum::body::to_bytes(r.into_body(), 16 * 1024 * 1024).await else {
        return a1111_error(
            StatusCode::BAD_GATEWAY,
            "server_error",
            "worker_error",
            "cannot read the worker's options",
        );
    };
    let Ok(mut options) = serde_json::from_slice::<Value>(&bytes) else {
        return (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], bytes).into_response();
    };
    let state = hive.lock();
    if let (Some(m), Some(obj)) = (state.selected.as_deref(), options.as_object_mut()) {
        obj.insert("sd_model_checkpoint".into(), json!(models::title_of(&state, m)));
        let sha =
            state.catalog.checkpoints.iter().find(|c| c.path.as_os_str() == m).and_then(|c| c.sha256.clone());
        obj.insert("sd_checkpoint_hash".into(), json!(sha));
    }
    Json(options).into_response()
}

/// What the node is doing, for clients that poll until idle (SillyTavern after a model switch): `job_count` is
/// at least the number of requests waiting in the hive or in flight on workers (a model switch included); the
/// other fields come from a worker that is busy.
async fn progress(State(hive): H, method: Method, uri: Uri, headers: HeaderMap) -> Response {
    let (busy, target) = {
        let now = Instant::now();
        let state = hive.lock();
        let busy = state.queue.len() + state.workers.values().map(|w| w.inflight).sum::<usize>();
        let target = state
            .workers
            .values()
            .filter(|w| w.routable(now) && w.inflight > 0)
            .max_by_key(|w| w.heartbeat.as_ref().is_some_and(|h| h.running_job.is_some()))
            .and_then(|w| {
                let reg = w.registration.as_ref()?;
                let bearer = if reg.api_key_required { hive.config.worker_api_key.clone() } else { None };
                Some((reg.base_url.clone(), bearer))
            });
        (busy, target)
    };
    let mut view = json!({
        "progress": 0.0,
        "eta_relative": 0.0,
        "state": {
            "skipped": false, "interrupted": false, "job": "", "job_count": 0, "job_timestamp": "0",
            "job_no": 0, "sampling_step": 0, "sampling_steps": 0,
        },
        "current_image": null,
        "textinfo": null,
    });
    if busy == 0 {
        return Json(view).into_response();
    }
    if let Some((base, bearer)) = target {
        if let Ok(r) = send_to(&hive, &base, bearer.as_deref(), method, &uri, &headers, Bytes::new()).await {
            if r.status().is_success() {
                if let Ok(bytes) = axum::body::to_bytes(r.into_body(), 16 * 1024 * 1024).await {
                    if let Ok(v) = serde_json::from_slice::<Value>(&bytes) {
                        if v["state"].is_object() {
                            view = v;
                        }
                    }
                }
            }
        }
    }
    let reported = view["state"]["job_count"].as_u64().unwrap_or(0);
    view["state"]["job_count"] = json!(reported.max(busy as u64));
    Json(view).into_response()
}

/// Every worker unloads its model; the hive then knows none is loaded.
async fn unload_checkpoint(
    State(hive): H,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let r = forward_all(State(hive.clone()), method, uri, headers, body).await;
    if r.status().is_success() {
        let now = Instant::now();
        for w in hive.lock().workers.values_mut().filter(|w| w.routable(now)) {
            w.loaded = None;
        }
    }
    r
}

/// Loads the selected model again (after `unload-checkpoint`), on one worker.
async fn reload_checkpoint(State(hive): H, headers: HeaderMap) -> Response {
    let selected = {
        let state = hive.lock();
        models::default_model(&state)
    };
    let Some(model) = selected else {
        return a1111_error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "no_model",
            "no model is selected",
        );
    };
    match ensure_loaded(&hive, &model, &serde_json::Map::new(), &headers).await {
        Some(r) if !r.status().is_success() => r,
        _ => Json(Value::Null).into_response(),
    }
}

// ---- memory, flags, styles: answered by the hive itself ----

/// A `kB` line of a `/proc` file (`VmRSS:  2048 kB`), in bytes.
fn proc_kib(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(key)?.strip_prefix(':')?;
        rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok().map(|kib| kib * 1024)
    })
}

fn resident_bytes(pid: &str) -> Option<u64> {
    proc_kib(&std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?, "VmRSS")
}

/// A1111's `ram` (its process's resident memory as `used`, the machine's as `total`, `free` the difference) for
/// the hive and the workers it runs on this machine, together.
fn node_ram(hive: &Hive) -> Value {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| proc_kib(&t, "MemTotal"));
    let (Some(total), Some(own)) = (total, resident_bytes("self")) else {
        return json!({"error": "unavailable: this platform has no /proc/meminfo and /proc/<pid>/status"});
    };
    let children: Vec<u32> =
        hive.lock().workers.values().filter(|w| w.managed).filter_map(|w| w.pid).collect();
    let used = own + children.iter().filter_map(|pid| resident_bytes(&pid.to_string())).sum::<u64>();
    json!({"free": total.saturating_sub(used), "used": used, "total": total})
}

/// `GET /sdapi/v1/memory` for the node: `ram` counts the hive and its workers on this machine; `cuda` is the
/// workers' device memory — one device's reading as its worker gives it, several devices' `system` summed with
/// each listed under `devices` (workers sharing a device counted once); A1111's error form when no worker
/// reports device memory (CPU workers).
async fn memory(State(hive): H, method: Method, uri: Uri, headers: HeaderMap) -> Response {
    let mut devices: Vec<Value> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (id, base, bearer) in targets(&hive) {
        let answer =
            send_to(&hive, &base, bearer.as_deref(), method.clone(), &uri, &headers, Bytes::new()).await;
        let Ok(r) = answer.map_err(|e| tracing::debug!(worker = %id, "memory: {e}")) else { continue };
        if !r.status().is_success() {
            continue;
        }
        let Ok(bytes) = axum::body::to_bytes(r.into_body(), 1024 * 1024).await else { continue };
        let Ok(v) = serde_json::from_slice::<Value>(&bytes) else { continue };
        let mut cuda = v["cuda"].clone();
        if !cuda["system"].is_object() {
            continue;
        }
        let host =
            base.split("://").nth(1).and_then(|rest| rest.rsplit_once(':')).map(|(h, _)| h.to_string());
        let device = &cuda["device"];
        if !seen.insert((host, device["backend"].to_string(), device["index"].to_string())) {
            continue;
        }
        cuda["worker"] = json!(id);
        devices.push(cuda);
    }
    let cuda = match devices.len() {
        0 => json!({"error": "unavailable: no worker reports device memory (CPU workers, or none ready)"}),
        1 => devices.remove(0),
        _ => {
            let sum = |key: &str| devices.iter().filter_map(|d| d["system"][key].as_u64()).sum::<u64>();
            let untracked = json!({"error": "not tracked: sdhive's engines keep no allocator statistics"});
            json!({
                "system": {"free": sum("free"), "used": sum("used"), "total": sum("total")},
                "active": untracked,
                "allocated": untracked,
                "reserved": untracked,
                "inactive": untracked,
                "events": untracked,
                "devices": devices,
            })
        }
    };
    let ram = {
        let hive = hive.clone();
        tokio::task::spawn_blocking(move || node_ram(&hive))
            .await
            .unwrap_or_else(|e| json!({"error": e.to_string()}))
    };
    Json(json!({"ram": ram, "cuda": cuda})).into_response()
}

/// `GET /sdapi/v1/cmd-flags`: the hive's effective configuration (every key of `hive config`, secrets
/// `<redacted>`), plus A1111's names for what it has (`api`, `api_auth`, `listen`, `port`, `ckpt`, `ckpt_dir`,
/// `vae_dir`, `lora_dir`, `embeddings_dir`, `styles_file`).
async fn cmd_flags(State(hive): H) -> Response {
    let c = &hive.config;
    let mut flags = match serde_json::to_value(c.redacted()) {
        Ok(Value::Object(map)) => map,
        _ => serde_json::Map::new(),
    };
    let first = |list: &[std::path::PathBuf]| list.first().map(|p| p.display().to_string());
    // The port actually bound (the configured one may be 0), as the workers are told to call back.
    let port = hive
        .callback_url
        .split("://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .and_then(|authority| authority.rsplit_once(':'))
        .and_then(|(_, port)| port.parse::<u16>().ok());
    let a1111 = json!({
        "api": true,
        "nowebui": true,
        "role": "hive",
        "version": env!("CARGO_PKG_VERSION"),
        "listen": !c.is_loopback(),
        "server_name": c.bind.ip().to_string(),
        "port": port.unwrap_or(c.bind.port()),
        "ckpt": c.models.first(),
        "ckpt_dir": first(&c.models_dirs),
        "vae_dir": first(&c.vae_dirs),
        "lora_dir": first(&c.lora_dirs),
        "embeddings_dir": first(&c.embeddings_dirs),
        "esrgan_models_path": first(&c.upscaler_dirs),
    });
    if let Value::Object(a1111) = a1111 {
        flags.extend(a1111);
    }
    Json(Value::Object(flags)).into_response()
}

/// `GET /sdapi/v1/prompt-styles` from the hive's `styles_file` (the one its workers are given): `[]` without one.
async fn prompt_styles(State(hive): H) -> Response {
    let Some(path) = hive.config.styles_file.clone() else { return Json(json!([])).into_response() };
    match tokio::task::spawn_blocking(move || sdhive_catalog::styles::read_styles(&path)).await {
        Ok(Ok(styles)) => Json(json!(styles)).into_response(),
        Ok(Err(e)) => {
            a1111_error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "styles_unreadable", e.to_string())
        }
        Err(e) => a1111_error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal", e.to_string()),
    }
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
