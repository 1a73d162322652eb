//! Operational routes: liveness (`/health`), readiness (`/ready`), Prometheus metrics (`/metrics`) and the
//! worker's self-description (`/v1/info`).

use crate::AppState;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/v1/info", get(info))
}

pub async fn health() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

/// 200 while jobs can be accepted and run; 503 while loading (served by the loading router), after the engine
/// thread died, or once shutdown began.
async fn ready(State(state): State<AppState>) -> Response {
    let (status, reason) = if !state.jobs.engine_alive() {
        (StatusCode::SERVICE_UNAVAILABLE, "engine_unavailable")
    } else if !state.jobs.is_accepting() {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting_down")
    } else {
        (StatusCode::OK, "ready")
    };
    (status, Json(json!({"status": reason, "model": state.info().model}))).into_response()
}

async fn metrics(State(state): State<AppState>) -> Response {
    let ready = state.jobs.engine_alive() && state.jobs.is_accepting();
    let text = state.metrics.render(state.jobs.queue_depth(), state.jobs.running_count(), ready);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

async fn info(State(state): State<AppState>) -> Json<serde_json::Value> {
    let device = state.device();
    let info = state.info();
    let loaded = state.library.current();
    let listed = |files: Vec<(String, String)>| -> Vec<serde_json::Value> {
        files.into_iter().map(|(file, reason)| json!({"file": file, "reason": reason})).collect()
    };
    let refused = listed(state.library.refused());
    Json(json!({
        "worker_id": state.config.worker_id,
        "version": state.config.version,
        "engine": info.engine,
        "backend": info.backend,
        "device": device,
        "dtype": info.dtype,
        "model": {
            "name": loaded.as_ref().map(|(_, i)| i.model.clone()),
            "title": loaded.as_ref().map(|(spec, _)| state.library.title_of(spec)),
            "source": loaded.as_ref().map(|(spec, _)| spec.source.clone()),
            "vae": loaded.as_ref().and_then(|(spec, _)| state.library.vae_name_of(spec)),
            "requested": state.config.model_name,
            "family": info.family,
            "native_width": info.native_width,
            "native_height": info.native_height,
        },
        "models": {
            "available": state.library.list(&state.config.worker_id).len(),
            "vaes": state.library.list_vaes().len(),
            "refused": refused,
            "loras": state.networks.list_loras().len(),
            "embeddings": state.networks.list_embeddings(None).loaded.len(),
            "networks_refused": listed(state.networks.refused()),
        },
        "capabilities": state.capabilities(),
        "preview": state.preview_decoder(),
        "queue": {"depth": state.jobs.queue_depth(), "max": state.config.max_queue},
        "job_ttl_secs": state.config.job_ttl.as_secs_f64(),
        "auth_required": state.config.credentials().required(),
        "memory": info.memory,
    }))
}
