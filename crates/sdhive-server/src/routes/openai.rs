//! The OpenAI Images API: `POST /v1/images/generations` (JSON), `POST /v1/images/edits` (multipart: img2img,
//! or inpainting with an OpenAI-style mask), `GET /v1/models[/{id}]`, and `GET /v1/files/{job}/{index}.{ext}`,
//! which serves finished images for `response_format: "url"` while the job is retained. Requests are
//! synchronous: each becomes a queued job that the handler awaits, and a client that disconnects cancels it.
//! `output_format` and `output_compression` (gpt-image-1's) travel with the job, so its images are encoded once,
//! off the request's path, in the format asked for. Errors are OpenAI's `{"error": {...}}` body ([`ApiError`]).
//! Also home of the job-outcome mapping that the A1111 routes share.

use crate::error::ApiError;
use crate::extract::{parse_json, ApiJson};
use crate::jobs::{FinishedImage, JobView};
use crate::validation::parse_sampler;
use crate::{unix_secs, AppState};
use axum::extract::multipart::{Multipart, MultipartError, MultipartRejection};
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use image::ImageReader;
use sdhive_engine::{
    decode_image, GenerateRequest, GrayImage, ImageFormat, ModelSpec, OutputFormat, RgbImage, ValidationError,
};
use sdhive_protocol::{JobErrorKind, JobId, JobState, LoraRequest, Seed};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::io::Cursor;
use std::time::SystemTime;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/images/generations", post(generations))
        .route("/v1/images/edits", post(edits))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route("/v1/files/{job}/{file}", get(get_file))
}

/// JPEG quality when `output_compression` is not given (OpenAI's default is 100 too).
const DEFAULT_COMPRESSION: u8 = 100;

// ---------------------------------------------------------------------------------------------------------
// Request parameters
// ---------------------------------------------------------------------------------------------------------

/// The parameters both image routes take (JSON for generations, multipart text fields for edits). OpenAI-only
/// knobs we cannot honour (`quality`, `style`, `user`, `background`, `moderation`, …) are accepted and ignored,
/// so OpenAI clients work unchanged; the Stable Diffusion extras are our own additions.
#[derive(Debug, Clone, Deserialize)]
struct ImageParams {
    prompt: String,
    n: Option<u32>,
    size: Option<String>,
    response_format: Option<String>,
    output_format: Option<String>,
    output_compression: Option<u32>,
    stream: Option<bool>,
    negative_prompt: Option<String>,
    steps: Option<u32>,
    cfg_scale: Option<f32>,
    seed: Option<Seed>,
    sampler: Option<String>,
    scheduler: Option<String>,
    clip_skip: Option<u32>,
    strength: Option<f32>,
    /// A checkpoint of the library by any A1111 name; OpenAI's own names (`dall-e-3`, …) mean the selected one.
    model: Option<String>,
    /// LoRAs besides the prompt's `<lora:…>` tags.
    loras: Option<Vec<LoraRequest>>,
    /// Hires fix (generations only), as the native API's `hires` object.
    hires: Option<sdhive_protocol::HiresRequest>,
    /// Skip-layer guidance (SD3-family models), as the native API's object.
    skip_layer_guidance: Option<sdhive_protocol::SkipLayerGuidanceRequest>,
}

/// The checkpoint a request names, with the selected VAE choice.
fn model_of(p: &ImageParams, state: &AppState) -> Result<ModelSpec, ApiError> {
    Ok(state.library.resolve(p.model.as_deref(), None)?)
}

/// Multipart fields that stay strings even when they look like numbers (a prompt of "42" is still a prompt).
const STRING_FIELDS: &[&str] = &[
    "prompt",
    "negative_prompt",
    "size",
    "response_format",
    "output_format",
    "model",
    "user",
    "quality",
    "style",
    "background",
    "moderation",
    "sampler",
    "scheduler",
    "input_fidelity",
    "safety_identifier",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ResponseFormat {
    B64Json,
    Url,
}

/// How the finished images go back to the client.
#[derive(Debug, Clone, Copy)]
struct Delivery {
    response: ResponseFormat,
    format: ImageFormat,
    /// JPEG quality, 0–100 (WebP is always lossless: no pure-Rust encoder writes lossy WebP).
    compression: u8,
}

impl Delivery {
    fn output(&self) -> OutputFormat {
        OutputFormat::new(self.format, self.compression)
    }
}

fn delivery(p: &ImageParams) -> Result<Delivery, ApiError> {
    let response = match p.response_format.as_deref().map(str::trim) {
        None | Some("b64_json") => ResponseFormat::B64Json,
        Some("url") => ResponseFormat::Url,
        Some(other) => {
            return Err(ApiError::invalid(
                "response_format",
                format!("must be `b64_json` or `url`, got `{other}`"),
            ))
        }
    };
    let format = match p.output_format.as_deref() {
        None => ImageFormat::Png,
        Some(name) => ImageFormat::parse(name).ok_or_else(|| {
            ApiError::invalid("output_format", format!("must be `png`, `jpeg` or `webp`, got `{name}`"))
        })?,
    };
    let compression = match p.output_compression {
        None => DEFAULT_COMPRESSION,
        Some(c) if c <= 100 => c as u8,
        Some(c) => return Err(ApiError::invalid("output_compression", format!("must be 0–100, got {c}"))),
    };
    Ok(Delivery { response, format, compression })
}

/// `"WxH"` → explicit size; absent or `"auto"` → the default (model resolution, or the input image's size).
fn parse_size(size: Option<&str>) -> Result<(Option<u32>, Option<u32>), ApiError> {
    let Some(size) = size.map(str::trim).filter(|s| !s.eq_ignore_ascii_case("auto")) else {
        return Ok((None, None));
    };
    let bad = || {
        ApiError::invalid("size", format!("must be `WIDTHxHEIGHT` (e.g. `512x512`) or `auto`, got `{size}`"))
    };
    let (w, h) = size.split_once(['x', 'X']).ok_or_else(bad)?;
    let w: u32 = w.trim().parse().map_err(|_| bad())?;
    let h: u32 = h.trim().parse().map_err(|_| bad())?;
    Ok((Some(w), Some(h)))
}

/// Our request field names → the OpenAI parameter the client sent.
fn openai_param(field: &str) -> &str {
    match field {
        "width" | "height" => "size",
        "init_image" => "image",
        other => other,
    }
}

fn openai_invalid(e: ValidationError) -> ApiError {
    let param = openai_param(e.field);
    if param == e.field {
        ApiError::invalid(param, e.to_string())
    } else {
        ApiError::invalid(param, format!("invalid `{param}` ({}): {}", e.field, e.message))
    }
}

/// The engine request for `p`, validated against the operator's limits. `init` and `mask` come from an edit.
fn build_request(
    p: &ImageParams,
    state: &AppState,
    output: OutputFormat,
    init: Option<RgbImage>,
    mask: Option<GrayImage>,
) -> Result<GenerateRequest, ApiError> {
    if p.prompt.trim().is_empty() {
        return Err(ApiError::invalid("prompt", "must not be empty"));
    }
    if p.stream == Some(true) {
        return Err(ApiError::invalid("stream", "streaming is not supported; use the native /v1/jobs API"));
    }
    if p.strength.is_some() && init.is_none() {
        return Err(ApiError::invalid("strength", "only applies to /v1/images/edits"));
    }
    let (width, height) = parse_size(p.size.as_deref())?;
    let (sampler, schedule) =
        parse_sampler(p.sampler.as_deref(), p.scheduler.as_deref(), "sampler", "scheduler")
            .map_err(openai_invalid)?;
    let defaults = GenerateRequest::default();
    // An edit with a mask means "redraw this region": start it from pure noise unless told otherwise.
    let default_strength = if mask.is_some() { 1.0 } else { defaults.strength };
    let mut req = GenerateRequest {
        prompt: p.prompt.clone(),
        negative_prompt: p.negative_prompt.clone().unwrap_or_default(),
        steps: p.steps.unwrap_or(defaults.steps),
        cfg_scale: p.cfg_scale.unwrap_or(defaults.cfg_scale),
        width,
        height,
        seed: p.seed.and_then(Seed::fixed),
        n: p.n.unwrap_or(1),
        sampler,
        schedule,
        clip_skip: p.clip_skip.unwrap_or(defaults.clip_skip),
        init_image: init,
        strength: p.strength.unwrap_or(default_strength),
        mask,
        // Synchronous calls return only the final images: nobody would see a preview.
        preview_every: 0,
        preview_approx: false,

        loras: Vec::new(),
        embeddings: Vec::new(),
        hires: None,
        output,
        skip_layer_guidance: crate::validation::skip_layer_guidance(p.skip_layer_guidance.as_ref()),
    };
    req.validate(&state.config.limits).map_err(openai_invalid)?;
    if let Some(hr) = &p.hires {
        if req.init_image.is_some() {
            return Err(ApiError::invalid("hires", "hires fix is for generations, not edits"));
        }
        let strength = sdhive_engine::HiresFix::default().denoising_strength;
        crate::hires::attach(state, &mut req, hr, &crate::hires::NATIVE_FIELDS, strength)
            .map_err(openai_invalid)?;
    }
    Ok(req)
}

// ---------------------------------------------------------------------------------------------------------
// Job outcome (shared with the A1111 routes)
// ---------------------------------------------------------------------------------------------------------

/// Why a finished job has no images, independent of any route family's error shape.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum JobFailure {
    /// The engine refused the request for this model; `param` is our request field name.
    Invalid {
        param: Option<String>,
        message: String,
    },
    /// Cancelled by someone else (native cancel, A1111 interrupt, shutdown).
    Cancelled,
    ShuttingDown(String),
    /// Engine error, out of memory or panic: retrying the same request will not help.
    Engine {
        code: &'static str,
        message: String,
    },
}

/// The images of a terminal job, or why there are none.
pub(crate) fn job_outcome(view: JobView) -> Result<(JobView, Vec<FinishedImage>), JobFailure> {
    match view.state {
        JobState::Succeeded => {
            let images = view.images.clone();
            Ok((view, images))
        }
        JobState::Cancelled => Err(JobFailure::Cancelled),
        JobState::Failed => {
            let Some(error) = view.error else {
                return Err(JobFailure::Engine { code: "engine_error", message: "the job failed".into() });
            };
            Err(match error.kind {
                JobErrorKind::InvalidRequest => {
                    JobFailure::Invalid { param: error.param, message: error.message }
                }
                JobErrorKind::ShuttingDown => JobFailure::ShuttingDown(error.message),
                kind => JobFailure::Engine { code: kind.as_str(), message: error.message },
            })
        }
        // `wait` only returns terminal jobs; this would be our own bug.
        JobState::Queued | JobState::Running => {
            Err(JobFailure::Engine { code: "internal_error", message: "the job had not finished".into() })
        }
    }
}

/// A response the OpenAI SDK should not retry: the same request would fail the same way, and retrying a
/// cancelled job would undo the cancellation.
fn no_retry(error: ApiError) -> Response {
    let mut response = error.into_response();
    response.headers_mut().insert("x-should-retry", HeaderValue::from_static("false"));
    response
}

fn failure_response(f: JobFailure) -> Response {
    match f {
        JobFailure::Invalid { param, message } => ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("invalid_value"),
            param.as_deref().map(|p| openai_param(p).to_string()),
            message,
        )
        .into_response(),
        JobFailure::Cancelled => no_retry(ApiError::new(
            StatusCode::CONFLICT,
            "server_error",
            Some("job_cancelled"),
            None,
            "the job was cancelled before it finished (native cancel, /sdapi/v1/interrupt or shutdown)"
                .into(),
        )),
        JobFailure::ShuttingDown(message) => {
            let mut e = ApiError::unavailable("shutting_down", message);
            e.retry_after = Some(10);
            e.into_response()
        }
        JobFailure::Engine { code, message } => no_retry(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            Some(code),
            None,
            message,
        )),
    }
}

/// A finished image as `output` asks: its own bytes when they already are (JPEG at the same quality), else
/// decoded and encoded again, infotext included.
pub(crate) fn encode_as(img: &FinishedImage, output: OutputFormat) -> Result<Bytes, String> {
    let same = img.output.format == output.format
        && (output.format != ImageFormat::Jpeg || img.output.quality == output.quality);
    if same {
        return Ok(img.bytes.clone());
    }
    let pixels = decode_image(&img.bytes, u64::from(img.width) * u64::from(img.height))
        .map_err(|e| format!("cannot read the finished image: {e}"))?;
    let infotext = Some(img.infotext.as_str()).filter(|t| !t.is_empty());
    sdhive_engine::encode_image(&pixels, infotext, output).map(Bytes::from).map_err(|e| e.to_string())
}

// ---------------------------------------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------------------------------------

/// One image of an answer's `data`: its bytes, sent as `b64_json`, or where to fetch it.
enum Delivered {
    B64(Bytes),
    Url(String),
}

/// OpenAI's images answer, `{"created", "data": [{"b64_json"} | {"url"}], "output_format", "size"}`, written
/// straight into its body ([`super::push_base64_string`]).
fn images_body(created: u64, data: &[Delivered], output_format: &str, size: &str) -> Result<Vec<u8>, String> {
    let json =
        |body: &mut Vec<u8>, text: &str| serde_json::to_writer(body, text).map_err(|e| format!("JSON: {e}"));
    let sizes: usize = data
        .iter()
        .map(|d| match d {
            Delivered::B64(bytes) => bytes.len().div_ceil(3) * 4 + 16,
            Delivered::Url(url) => 2 * url.len() + 16,
        })
        .sum();
    let mut body = Vec::with_capacity(sizes + 256);
    body.extend_from_slice(format!("{{\"created\":{created},\"data\":[").as_bytes());
    for (i, d) in data.iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        match d {
            Delivered::B64(bytes) => {
                body.extend_from_slice(b"{\"b64_json\":");
                super::push_base64_string(&mut body, bytes);
            }
            Delivered::Url(url) => {
                body.extend_from_slice(b"{\"url\":");
                json(&mut body, url)?;
            }
        }
        body.push(b'}');
    }
    body.extend_from_slice(b"],\"output_format\":");
    json(&mut body, output_format)?;
    body.extend_from_slice(b",\"size\":");
    json(&mut body, size)?;
    body.push(b'}');
    Ok(body)
}

/// `scheme://host` as the client reached us (honouring a proxy's `X-Forwarded-*`), for absolute file URLs.
fn base_url(headers: &HeaderMap, uri: &Uri) -> String {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(',').next())
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    };
    let host = header("x-forwarded-host")
        .or_else(|| header(header::HOST.as_str()))
        .or_else(|| uri.authority().map(|a| a.to_string()));
    let scheme = header("x-forwarded-proto").unwrap_or_else(|| "http".into());
    match host {
        Some(host) => format!("{scheme}://{host}"),
        // Without any host we can only give a path; clients resolve it against the URL they called.
        None => String::new(),
    }
}

fn file_url(base: &str, job: &JobId, index: usize, d: &Delivery) -> String {
    let mut url = format!("{base}/v1/files/{job}/{index}.{}", d.format.name());
    if d.format == ImageFormat::Jpeg && d.compression != DEFAULT_COMPRESSION {
        url.push_str(&format!("?compression={}", d.compression));
    }
    url
}

/// Runs `req` to completion and answers in OpenAI's shape.
async fn run_and_respond(
    state: &AppState,
    req: GenerateRequest,
    model: ModelSpec,
    d: Delivery,
    base: String,
    mut clock: super::RouteClock,
) -> Response {
    clock.submitted();
    let view = match state.jobs.run_for(req, model).await {
        Ok(view) => view,
        Err(e) => return ApiError::from(e).into_response(),
    };
    clock.ended();
    let (view, images) = match job_outcome(view) {
        Ok(done) => done,
        Err(f) => return failure_response(f),
    };
    let created = unix_secs(view.finished_at.unwrap_or_else(SystemTime::now)) as u64;
    let size = images.first().map(|i| format!("{}x{}", i.width, i.height)).unwrap_or_default();
    let job = view.id.clone();
    // The job encoded its images as asked; base64 of large images is still CPU work to keep off the async workers.
    let body = tokio::task::spawn_blocking(move || -> Result<Vec<u8>, String> {
        let data = images
            .iter()
            .enumerate()
            .map(|(index, img)| match d.response {
                ResponseFormat::Url => Ok(Delivered::Url(file_url(&base, &job, index, &d))),
                ResponseFormat::B64Json => encode_as(img, d.output()).map(Delivered::B64),
            })
            .collect::<Result<Vec<_>, String>>()?;
        images_body(created, &data, d.format.name(), &size)
    })
    .await;
    match body {
        Ok(Ok(body)) => {
            clock.answer(([(header::CONTENT_TYPE, "application/json")], body).into_response(), &view)
        }
        Ok(Err(message)) => no_retry(ApiError::internal(message)),
        Err(e) => no_retry(ApiError::internal(format!("image encoding failed: {e}"))),
    }
}

// ---------------------------------------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------------------------------------

async fn generations(
    State(state): State<AppState>,
    headers: HeaderMap,
    uri: Uri,
    ApiJson(params): ApiJson<ImageParams>,
) -> Response {
    let clock = super::RouteClock::start();
    let prepared = delivery(&params).and_then(|d| {
        Ok((d, model_of(&params, &state)?, build_request(&params, &state, d.output(), None, None)?))
    });
    let prepared = match prepared {
        Ok((d, model, req)) => {
            let loras = params.loras.clone().unwrap_or_default();
            state.resolve_networks_async(req, loras, model.clone()).await.map(|req| (d, model, req))
        }
        Err(e) => Err(e),
    };
    match prepared {
        Ok((d, model, req)) => run_and_respond(&state, req, model, d, base_url(&headers, &uri), clock).await,
        Err(e) => e.into_response(),
    }
}

/// An edit's uploads and text fields, as read from the multipart body.
struct EditForm {
    image: Option<Vec<u8>>,
    mask: Option<Vec<u8>>,
    fields: Map<String, Value>,
}

fn multipart_error(e: MultipartError) -> ApiError {
    crate::extract::body_error(
        e.status(),
        "invalid_multipart",
        format!("cannot read the multipart body: {}", e.body_text()),
    )
}

async fn read_form(mut multipart: Multipart) -> Result<EditForm, ApiError> {
    let mut form = EditForm { image: None, mask: None, fields: Map::new() };
    while let Some(field) = multipart.next_field().await.map_err(multipart_error)? {
        let name = field.name().unwrap_or_default().to_string();
        match name.as_str() {
            // The SDK sends one image as `image` and a list as `image[]`; only the first is used.
            "image" | "image[]" => {
                let bytes = field.bytes().await.map_err(multipart_error)?;
                form.image.get_or_insert_with(|| bytes.to_vec());
            }
            "mask" => {
                let bytes = field.bytes().await.map_err(multipart_error)?;
                form.mask = Some(bytes.to_vec());
            }
            // Other uploads (`markup`, extra images) have no meaning here; they are read past, not parsed as text.
            _ if field.file_name().is_some() => {
                field.bytes().await.map_err(multipart_error)?;
            }
            _ => {
                let text = field.text().await.map_err(multipart_error)?;
                let value = if STRING_FIELDS.contains(&name.as_str()) {
                    Value::String(text)
                } else if name == "loras" {
                    // A form carries the structured list as JSON text; left a string when it is none, so the
                    // typed parse names the field.
                    serde_json::from_str::<Value>(text.trim())
                        .ok()
                        .filter(Value::is_array)
                        .unwrap_or(Value::String(text))
                } else {
                    // Form values are text; numbers and booleans are recovered so the typed parse can check them.
                    serde_json::from_str::<Value>(text.trim())
                        .ok()
                        .filter(|v| v.is_number() || v.is_boolean() || v.is_null())
                        .unwrap_or(Value::String(text))
                };
                form.fields.insert(name, value);
            }
        }
    }
    Ok(form)
}

/// Decodes an upload, refusing anything over `max_pixels` before its pixels are allocated.
pub(crate) fn decode_capped(bytes: &[u8], max_pixels: u64) -> Result<image::DynamicImage, String> {
    let reader = || ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|e| e.to_string());
    let (width, height) = reader()?.into_dimensions().map_err(|e| format!("cannot decode image: {e}"))?;
    if u64::from(width) * u64::from(height) > max_pixels {
        return Err(format!("image is {width}x{height}, larger than the {max_pixels}-pixel limit"));
    }
    reader()?.decode().map_err(|e| format!("cannot decode image: {e}"))
}

/// An OpenAI mask: transparent pixels are the ones to edit. A mask without transparency (no alpha channel, or
/// one that is opaque everywhere) is read as a plain grey mask instead: white = edit.
fn decode_openai_mask(bytes: &[u8], max_pixels: u64) -> Result<GrayImage, String> {
    let img = decode_capped(bytes, max_pixels)?;
    let (width, height) = (img.width(), img.height());
    let data = if img.color().has_alpha() {
        let rgba = img.to_rgba8();
        if rgba.pixels().any(|p| p[3] != 255) {
            rgba.pixels().map(|p| 255 - p[3]).collect()
        } else {
            img.to_luma8().into_raw()
        }
    } else {
        img.to_luma8().into_raw()
    };
    Ok(GrayImage { width, height, data })
}

async fn edits(
    State(state): State<AppState>,
    headers: HeaderMap,
    uri: Uri,
    multipart: Result<Multipart, MultipartRejection>,
) -> Response {
    let clock = super::RouteClock::start();
    match prepare_edit(&state, multipart).await {
        Ok((d, model, req)) => run_and_respond(&state, req, model, d, base_url(&headers, &uri), clock).await,
        Err(e) => e.into_response(),
    }
}

async fn prepare_edit(
    state: &AppState,
    multipart: Result<Multipart, MultipartRejection>,
) -> Result<(Delivery, ModelSpec, GenerateRequest), ApiError> {
    let multipart = multipart.map_err(|e| {
        ApiError::bad_body(
            "invalid_multipart",
            format!("expected a multipart/form-data body: {}", e.body_text()),
        )
    })?;
    let form = read_form(multipart).await?;
    let body = serde_json::to_vec(&Value::Object(form.fields))
        .map_err(|e| ApiError::internal(format!("cannot re-encode the form fields: {e}")))?;
    let params: ImageParams = parse_json(&body)?;
    let d = delivery(&params)?;
    let model = model_of(&params, state)?;
    let image_bytes = form.image.ok_or_else(|| ApiError::invalid("image", "an `image` file is required"))?;
    let mask_bytes = form.mask;
    // Decoding uploads takes real CPU time: keep it off the async workers.
    let state = state.clone();
    let job_model = model.clone();
    let req = tokio::task::spawn_blocking(move || {
        let mut req = decode_edit(&params, &state, d.output(), &image_bytes, mask_bytes.as_deref())?;
        let loras = params.loras.clone().unwrap_or_default();
        state.resolve_networks(&mut req, &loras, &job_model).map_err(openai_invalid)?;
        Ok::<_, ApiError>(req)
    })
    .await
    .map_err(|e| ApiError::internal(format!("request preparation failed: {e}")))??;
    Ok((d, model, req))
}

/// The edit's engine request from its uploads: the image, and the mask checked against it.
fn decode_edit(
    params: &ImageParams,
    state: &AppState,
    output: OutputFormat,
    image_bytes: &[u8],
    mask_bytes: Option<&[u8]>,
) -> Result<GenerateRequest, ApiError> {
    let max_pixels = state.config.max_decode_pixels;
    let init =
        decode_image(image_bytes, max_pixels).map_err(|e| ApiError::invalid("image", e.to_string()))?;
    let mask = match mask_bytes {
        Some(bytes) => {
            let mask = decode_openai_mask(bytes, max_pixels).map_err(|e| ApiError::invalid("mask", e))?;
            if (mask.width, mask.height) != (init.width, init.height) {
                return Err(ApiError::invalid(
                    "mask",
                    format!(
                        "must have the same dimensions as `image` ({}x{}), got {}x{}",
                        init.width, init.height, mask.width, mask.height
                    ),
                ));
            }
            Some(mask)
        }
        None => None,
    };
    build_request(params, state, output, Some(init), mask)
}

async fn list_models(State(state): State<AppState>) -> Json<Value> {
    let created = unix_secs(state.started_at) as u64;
    let data: Vec<Value> =
        state.library.list(&state.config.worker_id).iter().map(|m| m.openai(created)).collect();
    Json(json!({"object": "list", "data": data}))
}

async fn get_model(State(state): State<AppState>, Path(id): Path<String>) -> Response {
    let found = state.library.find(&id).map(|spec| {
        state.library.list(&state.config.worker_id).into_iter().find(|m| m.filename == spec.source)
    });
    match found {
        Ok(Some(model)) => Json(model.openai(unix_secs(state.started_at) as u64)).into_response(),
        Ok(None) => ApiError::not_found(format!("the model `{id}` is not listed")).into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}

#[derive(Debug, Deserialize)]
struct FileQuery {
    compression: Option<u8>,
}

/// A finished image of a retained job, re-encoded to the extension asked for.
async fn get_file(
    State(state): State<AppState>,
    Path((job, file)): Path<(String, String)>,
    query: Result<Query<FileQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let compression = match query {
        Ok(Query(q)) => q.compression.unwrap_or(DEFAULT_COMPRESSION).min(100),
        Err(e) => return ApiError::invalid("compression", e.body_text()).into_response(),
    };
    let parsed = file
        .split_once('.')
        .and_then(|(index, ext)| Some((index.parse::<usize>().ok()?, ImageFormat::parse(ext)?)));
    let Some((index, format)) = parsed else {
        return ApiError::not_found(format!("no file `{file}`: expected `<index>.png`, `.jpeg` or `.webp`"))
            .into_response();
    };
    let view = match state.jobs.view(&JobId(job)) {
        Ok(view) => view,
        Err(e) => return ApiError::from(e).into_response(),
    };
    let Some(img) = view.images.get(index).cloned() else {
        return ApiError::not_found(format!("job {} has no image {index} (state: {})", view.id, view.state))
            .into_response();
    };
    let encoded =
        tokio::task::spawn_blocking(move || encode_as(&img, OutputFormat::new(format, compression))).await;
    match encoded {
        Ok(Ok(bytes)) => ([(header::CONTENT_TYPE, format.mime())], bytes).into_response(),
        Ok(Err(message)) => ApiError::internal(message).into_response(),
        Err(e) => ApiError::internal(format!("image encoding failed: {e}")).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_written_images_answer_is_the_json_a_value_would_give() {
        use base64::Engine as _;
        let b64 = &base64::engine::general_purpose::STANDARD;
        let png = Bytes::from_static(b"\x89PNG\r\n\x1a\n");
        let url = "http://h\"ost/v1/files/job_1/0.png".to_string();
        for data in [
            vec![Delivered::B64(png.clone()), Delivered::B64(Bytes::new())],
            vec![Delivered::Url(url.clone())],
            vec![],
        ] {
            let body = images_body(1_718_000_004, &data, "png", "512x512").expect("an answer");
            let got: Value = serde_json::from_slice(&body).expect("valid JSON");
            let entries: Vec<Value> = data
                .iter()
                .map(|d| match d {
                    Delivered::B64(bytes) => json!({"b64_json": b64.encode(bytes)}),
                    Delivered::Url(url) => json!({"url": url}),
                })
                .collect();
            let want = json!({"created": 1_718_000_004u64, "data": entries, "output_format": "png", "size": "512x512"});
            assert_eq!(got, want);
        }
    }
    use sdhive_engine::encode_png;

    #[test]
    fn sizes_parse_or_name_the_param() {
        assert_eq!(parse_size(None).unwrap(), (None, None));
        assert_eq!(parse_size(Some("auto")).unwrap(), (None, None));
        assert_eq!(parse_size(Some("64x128")).unwrap(), (Some(64), Some(128)));
        for bad in ["100", "ax3", "64x", "-8x8", "64x64x64"] {
            assert_eq!(parse_size(Some(bad)).unwrap_err().param(), Some("size"), "{bad}");
        }
    }

    #[test]
    fn engine_fields_map_to_openai_params() {
        let e =
            openai_invalid(ValidationError { field: "height", message: "must be a multiple of 8".into() });
        assert_eq!(e.param(), Some("size"));
        assert!(e.message().contains("height"), "{}", e.message());
        assert_eq!(openai_invalid(ValidationError { field: "n", message: "x".into() }).param(), Some("n"));
    }

    fn png_rgba(pixels: &[[u8; 4]], width: u32) -> Vec<u8> {
        let height = pixels.len() as u32 / width;
        let img = image::RgbaImage::from_raw(width, height, pixels.concat()).unwrap();
        let mut out = Vec::new();
        img.write_to(&mut Cursor::new(&mut out), image::ImageFormat::Png).unwrap();
        out
    }

    #[test]
    fn transparent_mask_pixels_are_edited() {
        let bytes = png_rgba(&[[0, 0, 0, 0], [0, 0, 0, 255], [255, 255, 255, 128]], 3);
        assert_eq!(decode_openai_mask(&bytes, 100).unwrap().data, vec![255, 0, 127]);
    }

    #[test]
    fn masks_without_transparency_use_white_as_edit() {
        let opaque = png_rgba(&[[255, 255, 255, 255], [0, 0, 0, 255]], 2);
        assert_eq!(decode_openai_mask(&opaque, 100).unwrap().data, vec![255, 0]);
        let rgb =
            encode_png(&RgbImage { width: 2, height: 1, data: vec![255, 255, 255, 0, 0, 0] }, None).unwrap();
        assert_eq!(decode_openai_mask(&rgb, 100).unwrap().data, vec![255, 0]);
        assert!(decode_openai_mask(&rgb, 1).is_err());
    }

    #[test]
    fn reencoding_passes_matching_bytes_through_and_keeps_the_infotext() {
        let img = RgbImage { width: 16, height: 8, data: (0..16 * 8 * 3).map(|v| (v % 251) as u8).collect() };
        let finished = |output: OutputFormat| FinishedImage {
            bytes: Bytes::from(sdhive_engine::encode_image(&img, Some("p"), output).unwrap()),
            output,
            seed: 1,
            infotext: "p".into(),
            width: 16,
            height: 8,
        };
        let jpeg = OutputFormat::new(ImageFormat::Jpeg, 80);
        for stored in [OutputFormat::PNG, jpeg, OutputFormat::new(ImageFormat::Webp, 80)] {
            let stored = finished(stored);
            // Same format (and JPEG quality): the very bytes.
            assert_eq!(encode_as(&stored, stored.output).unwrap(), stored.bytes);
            for (format, expected) in [
                (ImageFormat::Png, image::ImageFormat::Png),
                (ImageFormat::Jpeg, image::ImageFormat::Jpeg),
                (ImageFormat::Webp, image::ImageFormat::WebP),
            ] {
                let bytes = encode_as(&stored, OutputFormat::new(format, 50)).unwrap();
                assert_eq!(image::guess_format(&bytes).unwrap(), expected);
                let info = crate::png_info::read_image_info(&bytes, 1 << 20).unwrap();
                assert_eq!(info.parameters.as_deref(), Some("p"), "{format} from {}", stored.output.format);
                let back = decode_image(&bytes, 1 << 20).unwrap();
                assert_eq!((back.width, back.height), (16, 8));
                if stored.output.format != ImageFormat::Jpeg && format != ImageFormat::Jpeg {
                    assert_eq!(back, img, "lossless to lossless keeps the pixels");
                }
            }
        }
        let other_quality = encode_as(&finished(jpeg), OutputFormat::new(ImageFormat::Jpeg, 20)).unwrap();
        assert!(other_quality.len() < finished(jpeg).bytes.len());
    }

    #[test]
    fn base_url_prefers_forwarded_headers() {
        let uri: Uri = "/v1/images/generations".parse().unwrap();
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, HeaderValue::from_static("127.0.0.1:7860"));
        assert_eq!(base_url(&headers, &uri), "http://127.0.0.1:7860");
        headers.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        headers.insert("x-forwarded-host", HeaderValue::from_static("sd.example.com, proxy"));
        assert_eq!(base_url(&headers, &uri), "https://sd.example.com");
        assert_eq!(base_url(&HeaderMap::new(), &uri), "");
    }
}
