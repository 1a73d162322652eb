//! The rest of A1111's `/sdapi/v1` that clients call besides generating: `png-info` (the parameters an image
//! carries, parsed as A1111 parses them), `memory` (RAM and device memory in A1111's shape, from real readings
//! only), `cmd-flags` (our effective flags under A1111's names), `prompt-styles` (`--styles-file`), and the
//! listings of what we do not have (`face-restorers`, `realesrgan-models`, `scripts`, `script-info`,
//! `extensions`, `hypernetworks`), which answer empty in A1111's shapes so clients that list them work.

use crate::error::ApiError;
use crate::routes::a1111::A1111Error;
use crate::validation::decode_base64;
use crate::AppState;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::path::PathBuf;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/sdapi/v1/png-info", post(png_info))
        .route("/sdapi/v1/memory", get(memory))
        .route("/sdapi/v1/cmd-flags", get(cmd_flags))
        .route("/sdapi/v1/prompt-styles", get(prompt_styles))
        .route("/sdapi/v1/face-restorers", get(|| async { Json(json!([])) }))
        .route("/sdapi/v1/scripts", get(|| async { Json(json!({"txt2img": [], "img2img": []})) }))
        .route("/sdapi/v1/script-info", get(|| async { Json(json!([])) }))
        .route("/sdapi/v1/extensions", get(|| async { Json(json!([])) }))
        .route("/sdapi/v1/hypernetworks", get(|| async { Json(json!([])) }))
}

// ---------------------------------------------------------------------------------------------------------
// PNG Info
// ---------------------------------------------------------------------------------------------------------

/// A1111's `PNGInfoRequest`; other fields are ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PngInfoRequest {
    image: Option<String>,
}

/// `{"info": <the parameters text, "" without one>, "items": {<other text chunks>}, "parameters": {<A1111's
/// parse of info>}}`. An upload that is not a readable PNG, JPEG or WebP is a 400 about `image`.
async fn png_info(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, A1111Error> {
    let bytes = crate::routes::a1111::read_body(body)?;

    let request: PngInfoRequest = crate::extract::parse_json(&bytes)?;
    let image = request.image.filter(|i| !i.trim().is_empty()).ok_or_else(|| {
        A1111Error(ApiError::invalid("image", "invalid `image`: a base64 image (or data: URL) is required"))
    })?;
    let data = decode_base64("image", &image).map_err(|e| A1111Error(ApiError::from(e)))?;
    let max_pixels = state.config.max_decode_pixels;
    let config = state.config.clone();
    let answer = tokio::task::spawn_blocking(move || {
        let info = crate::png_info::read_image_info(&data, max_pixels)
            .map_err(|e| ApiError::invalid("image", format!("invalid `image`: {e}")))?;
        let text = info.parameters.unwrap_or_default();
        // The styles only help recognise styled prompts; a broken styles file must not break PNG Info.
        let styles = crate::styles::load(&config).unwrap_or_else(|e| {
            tracing::warn!("png-info without styles: {}", e.body.error.message);
            Vec::new()
        });
        let parameters = crate::png_info::parse_generation_parameters(&text, &styles);
        Ok::<_, ApiError>(json!({"info": text, "items": info.items, "parameters": parameters}))
    })
    .await
    .map_err(|e| A1111Error(ApiError::internal(format!("reading the image failed: {e}"))))??;
    Ok(Json(answer))
}

// ---------------------------------------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------------------------------------

/// A `kB` line of a `/proc` file (`MemTotal:  16384 kB`), in bytes.
fn proc_kib(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(key)?.strip_prefix(':')?;
        rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok().map(|kib| kib * 1024)
    })
}

/// A1111's `ram`: `used` is this process's resident memory, `total` the machine's, `free` the difference (as
/// A1111 computes them from psutil). Linux only (`/proc`); elsewhere A1111's error form.
pub fn ram() -> Value {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| proc_kib(&t, "MemTotal"));
    let used = std::fs::read_to_string("/proc/self/status").ok().and_then(|t| proc_kib(&t, "VmRSS"));
    match (total, used) {
        (Some(total), Some(used)) => {
            json!({"free": total.saturating_sub(used), "used": used, "total": total})
        }
        _ => json!({"error": "unavailable: this platform has no /proc/meminfo and /proc/self/status"}),
    }
}

/// A1111's `cuda`: the device's memory as the driver reports it now (`system`). The PyTorch allocator's
/// statistics (`active`, `allocated`, `reserved`, `inactive`, `events`) have no counterpart here and are given
/// in A1111's error form rather than made up; `device` is ours (which device, the weights resident on it).
fn device_memory(state: &AppState) -> Value {
    let device = state.device();
    if device.backend == "cpu" {
        return json!({"error": "unavailable: this worker runs on the CPU (its memory is under `ram`)"});
    }
    let (Some(total), Some(free)) = (device.memory_total_bytes, device.memory_free_bytes) else {
        return json!({"error": format!("unavailable: the {} backend does not report device memory", device.backend)});
    };
    let untracked = json!({"error": "not tracked: sdhive's engines keep no allocator statistics"});
    json!({
        "system": {"free": free, "used": total.saturating_sub(free), "total": total},
        "active": untracked,
        "allocated": untracked,
        "reserved": untracked,
        "inactive": untracked,
        "events": untracked,
        "device": {
            "backend": device.backend,
            "index": device.index,
            "name": device.name,
            "weights_bytes": state.info().memory.map(|m| m.weights_bytes),
        },
    })
}

async fn memory(State(state): State<AppState>) -> Json<Value> {
    let (ram, cuda) = tokio::task::spawn_blocking(move || (ram(), device_memory(&state)))
        .await
        .unwrap_or_else(|e| (json!({"error": e.to_string()}), json!({"error": e.to_string()})));
    Json(json!({"ram": ram, "cuda": cuda}))
}

// ---------------------------------------------------------------------------------------------------------
// Command-line flags
// ---------------------------------------------------------------------------------------------------------

fn paths(list: &[PathBuf]) -> Vec<String> {
    list.iter().map(|p| p.display().to_string()).collect()
}

/// A1111 answers its argparse namespace; we answer our effective flags, under A1111's names where it has the
/// flag (`ckpt_dir`, `lora_dir`, `embeddings_dir`, `styles_file`, `api_auth`, `listen`, `port`, `device_id`)
/// and ours otherwise. Secrets are never shown: `api_auth` and `api_key` are `"<redacted>"` when set.
async fn cmd_flags(State(state): State<AppState>) -> Json<Value> {
    let c = &state.config;
    let networks = &c.networks;
    let first = |list: &[PathBuf]| list.first().map(|p| p.display().to_string());
    let redacted = |set: bool| set.then_some("<redacted>");
    let mut flags: Map<String, Value> = c.cmd_flags.clone();
    let ours = json!({
        "api": true,
        "nowebui": true,
        "api_auth": redacted(!c.api_auth.is_empty()),
        "api_key": redacted(c.api_key.is_some()),
        "listen": c.listen.map(|a| !a.ip().is_loopback()),
        "server_name": c.listen.map(|a| a.ip().to_string()),
        "port": c.listen.map(|a| a.port()),
        "ckpt": (!c.model_name.is_empty()).then_some(c.model_name.as_str()),
        "ckpt_dir": first(&networks.models_dirs),
        "models_dirs": paths(&networks.models_dirs),
        "lora_dir": first(&networks.lora_dirs),
        "lora_dirs": paths(&networks.lora_dirs),
        "embeddings_dir": first(&networks.embeddings_dirs),
        "embeddings_dirs": paths(&networks.embeddings_dirs),
        "styles_file": c.styles_file.as_ref().map(|p| p.display().to_string()),
        "hash_cache": networks.hash_cache.as_ref().map(|p| p.display().to_string()),
        "device_id": c.device.index.to_string(),
        "backend": c.device.backend,
        "worker_id": c.worker_id,
        "max_width": c.limits.max_width,
        "max_height": c.limits.max_height,
        "max_steps": c.limits.max_steps,
        "max_n": c.limits.max_n,
        "max_prompt_chars": c.limits.max_prompt_chars,
        "max_queue": c.max_queue,
        "max_body_bytes": c.max_body_bytes,
        "max_image_pixels": c.max_decode_pixels,
        "job_ttl": c.job_ttl.as_secs_f64(),
        "shutdown_grace": c.shutdown_grace.as_secs_f64(),
        "version": c.version,
    });
    if let Value::Object(ours) = ours {
        flags.extend(ours);
    }
    Json(Value::Object(flags))
}

// ---------------------------------------------------------------------------------------------------------
// Listings
// ---------------------------------------------------------------------------------------------------------

/// `[{"name", "prompt", "negative_prompt"}]` from `--styles-file` (none configured: `[]`, as A1111 without the
/// file).
async fn prompt_styles(State(state): State<AppState>) -> Result<Json<Value>, A1111Error> {
    let config = state.config.clone();
    let styles = tokio::task::spawn_blocking(move || crate::styles::load(&config))
        .await
        .map_err(|e| A1111Error(ApiError::internal(format!("reading the styles failed: {e}"))))??;
    Ok(Json(json!(styles)))
}

/// One entry of `GET /sdapi/v1/realesrgan-models`.
#[derive(Debug, Clone, PartialEq)]
pub struct RealesrganModel {
    pub name: String,
    /// The model file (A1111's `data_path`).
    pub path: Option<String>,
    pub scale: Option<f64>,
}

/// A1111's `realesrgan-models` answer for `models`: `[{"name", "path", "scale"}]`.
pub fn realesrgan_models(models: &[RealesrganModel]) -> Value {
    Value::Array(models.iter().map(|m| json!({"name": m.name, "path": m.path, "scale": m.scale})).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_lines_are_read_in_bytes() {
        let meminfo = "MemTotal:       16316412 kB\nMemFree:         1000 kB\n";
        assert_eq!(proc_kib(meminfo, "MemTotal"), Some(16_316_412 * 1024));
        assert_eq!(proc_kib("VmRSS:\t  2048 kB\n", "VmRSS"), Some(2048 * 1024));
        assert_eq!(proc_kib(meminfo, "MemAvailable"), None);
        if cfg!(target_os = "linux") {
            let ram = ram();
            let (used, total) = (ram["used"].as_u64().unwrap(), ram["total"].as_u64().unwrap());
            assert!(used > 0 && used < total && ram["free"].as_u64() == Some(total - used), "{ram}");
        }
    }

    #[test]
    fn realesrgan_listing_has_a1111_fields() {
        let m =
            RealesrganModel { name: "R-ESRGAN 4x+".into(), path: Some("/m/x.pth".into()), scale: Some(4.0) };
        assert_eq!(
            realesrgan_models(&[m]),
            json!([{"name": "R-ESRGAN 4x+", "path": "/m/x.pth", "scale": 4.0}])
        );
        assert_eq!(realesrgan_models(&[]), json!([]));
    }
}
