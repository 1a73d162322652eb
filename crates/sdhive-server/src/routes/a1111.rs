//! The AUTOMATIC1111 web UI API (`/sdapi/v1/*`) for the clients written against it: `txt2img` and `img2img`
//! (synchronous; a client that disconnects cancels its job), `progress`, `interrupt`, `skip`, `sd-models`,
//! `samplers`, `schedulers` and `options`. Request fields, defaults and the `info` JSON string follow A1111;
//! where we differ (errors are 400 `{"error", "detail", "field"}` rather than 422, `inpainting_fill` is always
//! "original") `docs/api-a1111.md` says so; an interrupted request answers with the images finished before it, as
//! A1111's does. The few settings A1111 keeps server-side (`CLIP_stop_at_last_layers`, and the image format its
//! API encodes responses in: `samples_format`, `jpeg_quality`, `webp_lossless`) live in this router's own state.

use crate::error::ApiError;
use crate::extract::parse_json;
use crate::jobs::{FinishedImage, JobView};
use crate::models::{ModelError, VaeChoice};
use crate::routes::openai::{decode_capped, job_outcome, JobFailure};
use crate::validation::{decode_base64, decode_base64_image, parse_sampler};
use crate::AppState;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use sdhive_engine::{
    GenerateRequest, GrayImage, ImageFormat, ModelSpec, OutputFormat, Sampler, Schedule, ValidationError,
};
use sdhive_protocol::{HiresRequest, JobId, LoraRequest, Seed, SkipLayerGuidanceRequest};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/sdapi/v1/txt2img", post(txt2img))
        .route("/sdapi/v1/img2img", post(img2img))
        .route("/sdapi/v1/progress", get(progress))
        .route("/sdapi/v1/interrupt", post(interrupt))
        .route("/sdapi/v1/skip", post(skip))
        .route("/sdapi/v1/sd-models", get(sd_models))
        .route("/sdapi/v1/sd-vae", get(sd_vae))
        .route("/sdapi/v1/refresh-checkpoints", post(refresh))
        .route("/sdapi/v1/refresh-vae", post(refresh))
        .route("/sdapi/v1/loras", get(loras))
        .route("/sdapi/v1/refresh-loras", post(refresh_networks))
        .route("/sdapi/v1/embeddings", get(embeddings))
        .route("/sdapi/v1/refresh-embeddings", post(refresh_networks))
        .route("/sdapi/v1/unload-checkpoint", post(unload_checkpoint))
        .route("/sdapi/v1/reload-checkpoint", post(reload_checkpoint))
        .route("/sdapi/v1/samplers", get(samplers))
        .route("/sdapi/v1/schedulers", get(schedulers))
        .route("/sdapi/v1/options", get(get_options).post(set_options))
        // The extras encode their images as `samples_format` says, so they share these options.
        .merge(crate::routes::a1111_upscale::router())
        // One per router (so per server): tests run several servers in one process.
        .layer(Extension(Local::default()))
}

/// A1111's API defaults where they differ from the engine's.
const DEFAULT_STEPS: u32 = 50;
const DEFAULT_SAMPLER: &str = "Euler";
const DEFAULT_DENOISING: f32 = 0.75;
const DEFAULT_MASK_BLUR: u32 = 4;
/// A1111's mask-blur slider stops here; larger radii only burn CPU.
const MAX_MASK_BLUR: u32 = 64;

// ---------------------------------------------------------------------------------------------------------
// Router state and errors
// ---------------------------------------------------------------------------------------------------------

/// What A1111 keeps server-side between requests.
#[derive(Debug, Default)]
struct Settings {
    /// `CLIP_stop_at_last_layers` from `POST /options`: the clip skip of requests that do not override it.
    clip_skip: Option<u32>,
    /// The format responses' images are encoded in.
    samples: SampleOptions,
    /// Options we do not act on, echoed back by `GET /options` so clients see what they set.
    other: Map<String, Value>,
    /// The job `/interrupt` last cancelled, so `/progress` can say `interrupted`.
    interrupted: Option<JobId>,
}

/// A1111's image-saving options, which its API also encodes response images with (`encode_pil_to_base64`).
#[derive(Debug, Clone, PartialEq)]
struct SampleOptions {
    /// `samples_format` as set: A1111 keeps the name it is given (`jpg` stays `jpg`).
    format: String,
    jpeg_quality: u8,
    /// Accepted and shown; WebP is always written lossless (no pure-Rust encoder writes lossy WebP).
    webp_lossless: bool,
}

impl Default for SampleOptions {
    fn default() -> Self {
        SampleOptions { format: "png".into(), jpeg_quality: 80, webp_lossless: false }
    }
}

/// A1111's names for `samples_format` (its `jpg` included).
const SAMPLES_FORMATS: &str = "`png`, `jpg`, `jpeg` or `webp`";

impl SampleOptions {
    const KEYS: [&'static str; 3] = ["samples_format", "jpeg_quality", "webp_lossless"];

    fn output(&self) -> OutputFormat {
        OutputFormat::new(ImageFormat::parse(&self.format).unwrap_or_default(), self.jpeg_quality)
    }

    /// These options with the ones `map` sets (absent or null keys keep theirs). Errors name the key after
    /// `prefix` (`override_settings.` for a request's overrides).
    fn updated(&self, map: Option<&Map<String, Value>>, prefix: &str) -> Result<SampleOptions, A1111Error> {
        let get = |key: &str| map.and_then(|m| m.get(key)).filter(|v| !v.is_null());
        let field = |key: &str| format!("{prefix}{key}");
        let mut out = self.clone();
        if let Some(value) = get("samples_format") {
            let name = string_option(&field("samples_format"), value)?;
            if ImageFormat::parse(name).is_none() {
                return Err(invalid(
                    &field("samples_format"),
                    format!("must be {SAMPLES_FORMATS}, got `{name}`"),
                ));
            }
            out.format = name.trim().to_string();
        }
        if let Some(value) = get("jpeg_quality") {
            // A slider value: an integer, which some clients send as 80.0.
            let quality = value
                .as_u64()
                .or_else(|| value.as_f64().filter(|v| v.fract() == 0.0 && *v >= 0.0).map(|v| v as u64))
                .filter(|q| *q <= 100);
            out.jpeg_quality = match quality {
                Some(q) => q as u8,
                None => {
                    return Err(invalid(
                        &field("jpeg_quality"),
                        format!("must be an integer between 0 and 100, got {value}"),
                    ))
                }
            };
        }
        if let Some(value) = get("webp_lossless") {
            out.webp_lossless = flag(&field("webp_lossless"), Some(value))?;
        }
        Ok(out)
    }
}

#[derive(Debug, Clone, Default)]
pub(crate) struct Local(Arc<Mutex<Settings>>);

impl Local {
    fn lock(&self) -> MutexGuard<'_, Settings> {
        // Every update is a plain field write, so a poisoned lock still holds consistent data.
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The format the options say response images are encoded in.
    pub(crate) fn samples_output(&self) -> OutputFormat {
        self.lock().samples.output()
    }
}

/// An [`ApiError`] in A1111's shape: `{"error": <kind>, "detail": <message>, "field": <request field or null>,
/// "code": <stable code>}`, with the same status and `Retry-After`.
#[derive(Debug)]
pub struct A1111Error(pub ApiError);

impl From<ApiError> for A1111Error {
    fn from(e: ApiError) -> Self {
        A1111Error(e)
    }
}

impl IntoResponse for A1111Error {
    fn into_response(self) -> Response {
        let e = self.0;
        let body = json!({
            "error": e.body.error.kind,
            "detail": e.body.error.message,
            "field": e.body.error.param,
            "code": e.body.error.code,
        });
        let mut response = (e.status, Json(body)).into_response();
        if let Some(secs) = e.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

/// 400 about `field`, with the message saying which field as the engine's validation messages do.
pub(crate) fn invalid(field: &str, message: impl std::fmt::Display) -> A1111Error {
    A1111Error(ApiError::invalid(field, format!("invalid `{field}`: {message}")))
}

/// How this request spelled the fields our validation names differently.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Spelling {
    /// `sampler_name`, or `sampler_index` when only that was sent.
    pub(crate) sampler: &'static str,
}

impl Spelling {
    fn field(self, ours: &str) -> String {
        match ours {
            "n" => "batch_size",
            "strength" => "denoising_strength",
            "init_image" => "init_images",
            "clip_skip" => "override_settings.CLIP_stop_at_last_layers",
            "output_format" => "samples_format",
            "model" => "override_settings.sd_model_checkpoint",
            "vae" => "override_settings.sd_vae",
            "sampler" => self.sampler,
            other => other,
        }
        .to_string()
    }

    fn invalid(self, e: ValidationError) -> A1111Error {
        let field = self.field(e.field);
        invalid(&field, e.message)
    }
}

pub(crate) fn failure(f: JobFailure, spelling: Spelling) -> A1111Error {
    A1111Error(match f {
        JobFailure::Invalid { param, message } => ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("invalid_value"),
            param.as_deref().map(|p| spelling.field(p)),
            message,
        ),
        JobFailure::Cancelled => ApiError::new(
            StatusCode::CONFLICT,
            "interrupted",
            Some("job_cancelled"),
            None,
            "the job was interrupted before it finished".into(),
        ),
        JobFailure::ShuttingDown(message) => {
            let mut e = ApiError::unavailable("shutting_down", message);
            e.retry_after = Some(10);
            e
        }
        JobFailure::Engine { code, message } => {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", Some(code), None, message)
        }
    })
}

// ---------------------------------------------------------------------------------------------------------
// txt2img / img2img
// ---------------------------------------------------------------------------------------------------------

/// The fields of A1111's `txt2img` and `img2img` bodies that we act on. Everything else A1111 accepts
/// (`restore_faces`, `save_images`, `subseed`, `alwayson_scripts`, …) is accepted and ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct SdapiRequest {
    prompt: Option<String>,
    negative_prompt: Option<String>,
    steps: Option<u32>,
    cfg_scale: Option<f32>,
    width: Option<u32>,
    height: Option<u32>,
    seed: Option<Seed>,
    batch_size: Option<u32>,
    n_iter: Option<u32>,
    sampler_name: Option<String>,
    sampler_index: Option<String>,
    scheduler: Option<String>,
    override_settings: Option<Map<String, Value>>,
    override_settings_restore_afterwards: Option<bool>,
    denoising_strength: Option<f32>,
    send_images: Option<bool>,
    enable_hr: Option<bool>,
    hr_scale: Option<f32>,
    hr_upscaler: Option<String>,
    hr_second_pass_steps: Option<u32>,
    hr_resize_x: Option<u32>,
    hr_resize_y: Option<u32>,
    hr_sampler_name: Option<String>,
    hr_scheduler: Option<String>,
    hr_prompt: Option<String>,
    hr_negative_prompt: Option<String>,
    hr_cfg: Option<f32>,
    hr_checkpoint_name: Option<String>,
    tiling: Option<bool>,
    script_name: Option<String>,
    init_images: Option<Vec<String>>,
    mask: Option<String>,
    mask_blur: Option<u32>,
    inpainting_fill: Option<u32>,
    inpainting_mask_invert: Option<Value>,
    resize_mode: Option<u32>,
    include_init_images: Option<bool>,
    /// Our extension: LoRAs besides the prompt's `<lora:…>` tags.
    loras: Option<Vec<LoraRequest>>,
    /// Prompt styles from `--styles-file`, applied in order (A1111's `styles`).
    styles: Option<Vec<String>>,
    /// Our extension: skip-layer guidance (SD3-family models), the native API's object.
    skip_layer_guidance: Option<SkipLayerGuidanceRequest>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Txt2Img,
    Img2Img,
}

/// A parsed request, with what the response needs besides the job's own record.
struct Prepared {
    req: GenerateRequest,
    model: ModelSpec,
    /// `override_settings_restore_afterwards: false`: the overriding model and VAE stay selected afterwards.
    keep_override: Option<(ModelSpec, Option<VaeChoice>)>,
    /// The same for overridden image options.
    keep_samples: Option<SampleOptions>,
    spelling: Spelling,
    batch_size: u32,
    n_iter: u32,
    send_images: bool,
    mask_blur: Option<u32>,
    echo: Value,
    styles: Vec<String>,
}

pub(crate) fn read_body(body: Result<Bytes, BytesRejection>) -> Result<Bytes, A1111Error> {
    crate::extract::read_body(body).map_err(A1111Error)
}

/// A1111 flags are ints (0/1) that some clients send as booleans.
fn flag(field: &str, value: Option<&Value>) -> Result<bool, A1111Error> {
    match value {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => match v.as_u64() {
            Some(0) => Ok(false),
            Some(1) => Ok(true),
            _ => Err(invalid(field, format!("must be 0 or 1, got {v}"))),
        },
    }
}

fn clip_skip_override(settings: Option<&Map<String, Value>>) -> Result<Option<u32>, A1111Error> {
    let Some(value) = settings.and_then(|s| s.get("CLIP_stop_at_last_layers")) else {
        return Ok(None);
    };
    parse_clip_skip(value)
        .map(Some)
        .map_err(|message| invalid("override_settings.CLIP_stop_at_last_layers", message))
}

fn parse_clip_skip(value: &Value) -> Result<u32, String> {
    match value.as_u64() {
        Some(v @ 1..=12) => Ok(v as u32),
        _ => Err(format!("must be an integer between 1 and 12, got {value}")),
    }
}

/// A model-library refusal as A1111's 400 about `field`.
fn model_error(field: &str, e: ModelError) -> A1111Error {
    let code = match &e {
        ModelError::UnknownCheckpoint { .. } => "model_not_found",
        ModelError::UnknownVae { .. } => "vae_not_found",
        ModelError::NothingSelected => "no_model",
        ModelError::Catalog(_) => "model_library_unreadable",
    };
    A1111Error(ApiError::new(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        Some(code),
        Some(field.into()),
        format!("invalid `{field}`: {e}"),
    ))
}

fn string_option<'a>(field: &str, value: &'a Value) -> Result<&'a str, A1111Error> {
    value.as_str().ok_or_else(|| invalid(field, format!("must be a string, got {value}")))
}

/// A checkpoint and a VAE choice as A1111's options name them (`sd_model_checkpoint`, `sd_vae`), read from
/// `options` or `override_settings`, whose field names start with `prefix`. The VAE is checked against the
/// library.
struct ModelOptions<'a> {
    checkpoint: Option<&'a str>,
    vae: Option<VaeChoice>,
    prefix: &'static str,
}

impl<'a> ModelOptions<'a> {
    fn read(
        state: &AppState,
        map: Option<&'a Map<String, Value>>,
        prefix: &'static str,
    ) -> Result<Self, A1111Error> {
        let get = |key: &str| map.and_then(|m| m.get(key)).filter(|v| !v.is_null());
        let field = |key: &str| format!("{prefix}{key}");
        let checkpoint = get("sd_model_checkpoint")
            .map(|v| string_option(&field("sd_model_checkpoint"), v))
            .transpose()?;
        let vae =
            get("sd_vae").map(|v| string_option(&field("sd_vae"), v).map(VaeChoice::parse)).transpose()?;
        if let Some(choice) = &vae {
            state.library.check_vae(choice).map_err(|e| model_error(&field("sd_vae"), e))?;
        }
        Ok(ModelOptions { checkpoint, vae, prefix })
    }

    /// The spec they stand for, the selected checkpoint and VAE filling in what they leave out.
    fn resolve(&self, state: &AppState) -> Result<ModelSpec, A1111Error> {
        state
            .library
            .resolve(self.checkpoint, self.vae.as_ref())
            .map_err(|e| model_error(&format!("{}sd_model_checkpoint", self.prefix), e))
    }

    fn any(&self) -> bool {
        self.checkpoint.is_some() || self.vae.is_some()
    }
}

fn prepare(state: &AppState, local: &Local, bytes: &[u8], mode: Mode) -> Result<Prepared, A1111Error> {
    let body: SdapiRequest = parse_json(bytes)?;
    let raw: Value = serde_json::from_slice(bytes).unwrap_or(Value::Null);

    if body.tiling == Some(true) {
        return Err(invalid("tiling", "tiling is not supported"));
    }
    if let Some(script) = body.script_name.as_deref().filter(|s| !s.trim().is_empty()) {
        return Err(invalid("script_name", format!("scripts are not supported, got `{script}`")));
    }
    let overrides = ModelOptions::read(state, body.override_settings.as_ref(), "override_settings.")?;
    let model = overrides.resolve(state)?;
    let keep_override = (overrides.any() && body.override_settings_restore_afterwards == Some(false))
        .then(|| (model.clone(), overrides.vae.clone()));

    let sampler_name = body.sampler_name.as_deref().filter(|s| !s.trim().is_empty());
    let spelling = Spelling {
        sampler: if sampler_name.is_none() && body.sampler_index.is_some() {
            "sampler_index"
        } else {
            "sampler_name"
        },
    };
    let sampler = sampler_name.or(body.sampler_index.as_deref()).unwrap_or(DEFAULT_SAMPLER);
    let (sampler, schedule) =
        parse_sampler(Some(sampler), body.scheduler.as_deref(), spelling.sampler, "scheduler")
            .map_err(|e| spelling.invalid(e))?;

    let batch_size = body.batch_size.unwrap_or(1);
    let n_iter = body.n_iter.unwrap_or(1);
    for (field, v) in [("batch_size", batch_size), ("n_iter", n_iter)] {
        if v == 0 {
            return Err(invalid(field, "must be at least 1"));
        }
    }
    let n = batch_size
        .checked_mul(n_iter)
        .ok_or_else(|| invalid("n_iter", "batch_size × n_iter is too large"))?;
    let max_n = state.config.limits.max_n;
    if n > max_n {
        return Err(invalid(
            "batch_size",
            format!("batch_size × n_iter = {n} images, more than the limit of {max_n}"),
        ));
    }
    let clip_skip = match clip_skip_override(body.override_settings.as_ref())? {
        Some(c) => c,
        None => local.lock().clip_skip.unwrap_or(1),
    };
    // A1111 itself restores overrides before its API encodes the response, so there they only change the
    // response's format when kept (`override_settings_restore_afterwards: false`); here they apply to their
    // request too, which is what a client sending them means.
    let samples = local.lock().samples.clone();
    let overrides_samples = body
        .override_settings
        .as_ref()
        .is_some_and(|m| SampleOptions::KEYS.iter().any(|k| m.get(*k).is_some_and(|v| !v.is_null())));
    let samples = samples.updated(body.override_settings.as_ref(), "override_settings.")?;
    let keep_samples = (overrides_samples && body.override_settings_restore_afterwards == Some(false))
        .then(|| samples.clone());

    let mut req = GenerateRequest {
        prompt: body.prompt.clone().unwrap_or_default(),
        negative_prompt: body.negative_prompt.clone().unwrap_or_default(),
        steps: body.steps.unwrap_or(DEFAULT_STEPS),
        cfg_scale: body.cfg_scale.unwrap_or(GenerateRequest::default().cfg_scale),
        width: body.width,
        height: body.height,
        seed: body.seed.and_then(Seed::fixed),
        n,
        sampler,
        schedule,
        clip_skip,
        init_image: None,
        strength: body.denoising_strength.unwrap_or(DEFAULT_DENOISING),
        mask: None,
        // A1111's default "show_progress_every_n_steps" is 10: its clients poll /progress for current_image,
        // by default its cheap approximation ("Approx NN"); TAESD (or "Full") only when its options say so.
        preview_every: 10,
        preview_approx: !matches!(
            local.lock().other.get("show_progress_type").and_then(|v| v.as_str()),
            Some("TAESD" | "Full")
        ),

        loras: Vec::new(),
        embeddings: Vec::new(),
        hires: None,
        output: samples.output(),
        skip_layer_guidance: crate::validation::skip_layer_guidance(body.skip_layer_guidance.as_ref()),
    };
    // A1111's img2img has no hires fix; its clients may still send the txt2img switches.
    if mode == Mode::Txt2Img && body.enable_hr == Some(true) {
        let other_checkpoint = body
            .hr_checkpoint_name
            .as_deref()
            .map(str::trim)
            .filter(|n| !n.is_empty() && !n.eq_ignore_ascii_case("Use same checkpoint"));
        if let Some(name) = other_checkpoint {
            return Err(invalid(
                "hr_checkpoint_name",
                format!(
                    "the second pass runs on the first pass's checkpoint; `{name}` cannot be used for it"
                ),
            ));
        }
        let hr = HiresRequest {
            upscaler: body.hr_upscaler.clone(),
            scale: body.hr_scale,
            resize_x: body.hr_resize_x,
            resize_y: body.hr_resize_y,
            steps: body.hr_second_pass_steps,
            denoising_strength: body.denoising_strength,
            sampler: body.hr_sampler_name.clone(),
            scheduler: body.hr_scheduler.clone(),
            prompt: body.hr_prompt.clone(),
            negative_prompt: body.hr_negative_prompt.clone(),
            cfg_scale: body.hr_cfg,
        };
        crate::hires::attach(state, &mut req, &hr, &crate::hires::A1111_FIELDS, DEFAULT_DENOISING)
            .map_err(|e| spelling.invalid(e))?;
    }
    let styles = body.styles.clone().unwrap_or_default();
    crate::styles::apply(&state.config, &styles, &mut req)?;
    // Cheap checks before any image is decoded.
    req.validate(&state.config.limits).map_err(|e| spelling.invalid(e))?;
    state
        .resolve_networks(&mut req, body.loras.as_deref().unwrap_or_default(), &model)
        .map_err(|e| spelling.invalid(e))?;

    let mut mask_blur = None;
    if mode == Mode::Img2Img {
        if let Some(mode) = body.resize_mode.filter(|&m| m != 0) {
            return Err(invalid(
                "resize_mode",
                format!("only resize_mode 0 (just resize) is supported, got {mode}"),
            ));
        }
        if let Some(fill) = body.inpainting_fill.filter(|&f| f > 3) {
            return Err(invalid("inpainting_fill", format!("must be 0, 1, 2 or 3, got {fill}")));
        }
        let blur = body.mask_blur.unwrap_or(DEFAULT_MASK_BLUR);
        if blur > MAX_MASK_BLUR {
            return Err(invalid("mask_blur", format!("must be between 0 and {MAX_MASK_BLUR}, got {blur}")));
        }
        let invert = flag("inpainting_mask_invert", body.inpainting_mask_invert.as_ref())?;
        let first = body
            .init_images
            .as_ref()
            .and_then(|images| images.first())
            .ok_or_else(|| invalid("init_images", "img2img needs at least one image in `init_images`"))?;
        let max_pixels = state.config.max_decode_pixels;
        req.init_image =
            Some(decode_base64_image("init_images", first, max_pixels).map_err(|e| spelling.invalid(e))?);
        if let Some(data) = body.mask.as_deref() {
            let bytes = decode_base64("mask", data).map_err(|e| spelling.invalid(e))?;
            let mut mask = decode_a1111_mask(&bytes, max_pixels).map_err(|e| invalid("mask", e))?;
            if invert {
                mask.data.iter_mut().for_each(|v| *v = 255 - *v);
            }
            mask_blur = Some(blur);
            req.mask = Some(gaussian_blur(&mask, blur as f32));
        }
        req.validate(&state.config.limits).map_err(|e| spelling.invalid(e))?;
    }

    let echo = echo_parameters(&raw, &req, state, mode, body.include_init_images == Some(true));
    Ok(Prepared {
        req,
        model,
        keep_override,
        keep_samples,
        spelling,
        batch_size,
        n_iter,
        send_images: body.send_images.unwrap_or(true),
        mask_blur,
        echo,
        styles,
    })
}

/// A1111 echoes the request with every default filled in; we fill ours (the effective size, steps, …) and, as
/// A1111 does unless `include_init_images`, leave the uploaded images out.
fn echo_parameters(
    raw: &Value,
    req: &GenerateRequest,
    state: &AppState,
    mode: Mode,
    include_images: bool,
) -> Value {
    let (width, height) = req.output_size((state.info().native_width, state.info().native_height));
    let mut echo = json!({
        "prompt": "",
        "negative_prompt": "",
        "styles": null,
        "seed": -1,
        "subseed": -1,
        "subseed_strength": 0,
        "seed_resize_from_h": -1,
        "seed_resize_from_w": -1,
        "sampler_name": null,
        "scheduler": null,
        "batch_size": 1,
        "n_iter": 1,
        "steps": DEFAULT_STEPS,
        "cfg_scale": decimal(GenerateRequest::default().cfg_scale),
        "width": width,
        "height": height,
        "restore_faces": null,
        "tiling": null,
        "denoising_strength": null,
        "override_settings": null,
        "override_settings_restore_afterwards": true,
        "sampler_index": DEFAULT_SAMPLER,
        "script_name": null,
        "send_images": true,
        "save_images": false,
        "alwayson_scripts": {},
    });
    if let (Value::Object(out), Mode::Img2Img) = (&mut echo, mode) {
        for (key, value) in [
            ("init_images", Value::Null),
            ("mask", Value::Null),
            ("denoising_strength", json!(decimal(DEFAULT_DENOISING))),
            ("resize_mode", json!(0)),
            ("mask_blur", json!(DEFAULT_MASK_BLUR)),
            ("inpainting_fill", json!(0)),
            ("inpaint_full_res", json!(true)),
            ("inpaint_full_res_padding", json!(0)),
            ("inpainting_mask_invert", json!(0)),
            ("include_init_images", json!(false)),
        ] {
            out.insert(key.into(), value);
        }
    }
    if let (Value::Object(out), Value::Object(given)) = (&mut echo, raw) {
        for (key, value) in given {
            out.insert(key.clone(), value.clone());
        }
        if !include_images && mode == Mode::Img2Img {
            out.insert("init_images".into(), Value::Null);
            out.insert("mask".into(), Value::Null);
        }
    }
    echo
}

/// An A1111 mask: white = repaint. Like A1111, a mask with real transparency is read from its alpha channel
/// instead (opaque = repaint), rounded to black and white.
fn decode_a1111_mask(bytes: &[u8], max_pixels: u64) -> Result<GrayImage, String> {
    let img = decode_capped(bytes, max_pixels)?;
    let (width, height) = (img.width(), img.height());
    let rgba = img.color().has_alpha().then(|| img.to_rgba8());
    let data = match rgba {
        Some(rgba) if rgba.pixels().any(|p| p[3] != 255) => {
            rgba.pixels().map(|p| if p[3] > 128 { 255 } else { 0 }).collect()
        }
        _ => img.to_luma8().into_raw(),
    };
    Ok(GrayImage { width, height, data })
}

/// A1111's mask blur: a Gaussian of standard deviation `sigma` over a kernel of 2·round(2.5·sigma)+1 taps,
/// applied along x then y, mirroring at the edges (OpenCV's default border).
fn gaussian_blur(mask: &GrayImage, sigma: f32) -> GrayImage {
    if sigma <= 0.0 || mask.width == 0 || mask.height == 0 {
        return mask.clone();
    }
    let radius = (2.5 * sigma + 0.5) as isize;
    let mut kernel: Vec<f32> =
        (-radius..=radius).map(|i| (-((i * i) as f32) / (2.0 * sigma * sigma)).exp()).collect();
    let sum: f32 = kernel.iter().sum();
    kernel.iter_mut().for_each(|k| *k /= sum);
    let (w, h) = (mask.width as usize, mask.height as usize);
    let pass = |src: &[f32], along_x: bool| -> Vec<f32> {
        let mut out = vec![0.0f32; w * h];
        for y in 0..h {
            for x in 0..w {
                let mut acc = 0.0;
                for (tap, k) in (-radius..=radius).zip(&kernel) {
                    let (sx, sy) = if along_x {
                        (mirror(x as isize + tap, w), y)
                    } else {
                        (x, mirror(y as isize + tap, h))
                    };
                    acc += k * src[sy * w + sx];
                }
                out[y * w + x] = acc;
            }
        }
        out
    };
    let src: Vec<f32> = mask.data.iter().map(|&v| f32::from(v)).collect();
    let blurred = pass(&pass(&src, true), false);
    GrayImage {
        width: mask.width,
        height: mask.height,
        data: blurred.iter().map(|v| v.round().clamp(0.0, 255.0) as u8).collect(),
    }
}

/// Reflects an out-of-range index back inside `0..n` without repeating the edge pixel (`dcb|abcd|cba`).
fn mirror(i: isize, n: usize) -> usize {
    if n == 1 {
        return 0;
    }
    let period = 2 * (n as isize - 1);
    let i = i.rem_euclid(period);
    (if i >= n as isize { period - i } else { i }) as usize
}

/// A1111's `job_timestamp` format (`%Y%m%d%H%M%S`), in UTC.
fn job_timestamp(t: SystemTime) -> String {
    let secs = t.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (year, month, day) = civil_date(secs / 86_400);
    let rem = secs % 86_400;
    format!("{year:04}{month:02}{day:02}{:02}{:02}{:02}", rem / 3600, rem / 60 % 60, rem % 60)
}

/// The proleptic Gregorian date `days` after 1970-01-01, counting in 400-year eras of 146 097 days that start
/// on 1 March (so the leap day falls at the end of each counted year).
fn civil_date(days: u64) -> (u64, u64, u64) {
    let shifted = days + 719_468; // days from 0000-03-01 to 1970-01-01
    let era = shifted / 146_097;
    let day_of_era = shifted % 146_097;
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 { month_from_march + 3 } else { month_from_march - 9 };
    let year = era * 400 + year_of_era + u64::from(month <= 2);
    (year, month, day)
}

/// An `f32` as the decimal the client wrote (0.6, not 0.6000000238418579): A1111 clients compare these.
fn decimal(v: f32) -> f64 {
    v.to_string().parse().unwrap_or(f64::from(v))
}

fn scheduler_name(s: Schedule) -> &'static str {
    match s {
        Schedule::Automatic => "automatic",
        Schedule::Karras => "karras",
    }
}

/// The JSON string A1111 clients `json.loads` from the `info` field.
fn info_json(state: &AppState, p: &Prepared, view: &JobView, images: &[FinishedImage]) -> String {
    let summary = &view.request;
    let req = &p.req;
    let n = req.n as usize;
    let all_seeds: Vec<u64> = if images.len() == n {
        images.iter().map(|i| i.seed).collect()
    } else {
        (0..req.n).map(|i| summary.seed.wrapping_add(u64::from(i))).collect()
    };
    let (width, height) =
        images.first().map(|i| (i.width, i.height)).unwrap_or((summary.width, summary.height));
    let mut extra = Map::new();
    if req.schedule != Schedule::Automatic {
        extra.insert("Schedule type".into(), json!(req.schedule.name()));
    }
    if let Some(blur) = p.mask_blur {
        extra.insert("Mask blur".into(), json!(blur));
        extra.insert("Masked content".into(), json!("original"));
    }
    let inpainting_model = state.info().family.to_ascii_lowercase().contains("inpaint");
    json!({
        "prompt": req.prompt,
        "all_prompts": vec![&req.prompt; n],
        "negative_prompt": req.negative_prompt,
        "all_negative_prompts": vec![&req.negative_prompt; n],
        "seed": all_seeds.first().copied().unwrap_or(summary.seed),
        "all_seeds": all_seeds,
        "subseed": -1,
        "all_subseeds": vec![-1; n],
        "subseed_strength": 0,
        "width": width,
        "height": height,
        "sampler_name": req.sampler.name(),
        "scheduler": scheduler_name(req.schedule),
        "cfg_scale": decimal(req.cfg_scale),
        "steps": req.steps,
        "batch_size": p.batch_size,
        "n_iter": p.n_iter,
        "restore_faces": false,
        "face_restoration_model": null,
        "sd_model_name": state.info().model,
        "sd_model_hash": null,
        "sd_vae_name": null,
        "sd_vae_hash": null,
        "seed_resize_from_w": -1,
        "seed_resize_from_h": -1,
        "denoising_strength": decimal(req.effective_strength().unwrap_or(0.0)),
        "extra_generation_params": extra,
        "index_of_first_image": 0,
        "infotexts": images.iter().map(|i| i.infotext.as_str()).collect::<Vec<_>>(),
        "styles": p.styles,
        "job_timestamp": job_timestamp(view.started_at.unwrap_or(view.created_at)),
        "clip_skip": req.clip_skip,
        "is_using_inpainting_conditioning": inpainting_model && req.mask.is_some(),
        "version": format!("sdhive {}", state.config.version),
    })
    .to_string()
}

async fn generate(
    state: AppState,
    local: Local,
    body: Result<Bytes, BytesRejection>,
    mode: Mode,
) -> Result<Response, A1111Error> {
    let mut clock = super::RouteClock::start();
    let bytes = read_body(body)?;
    // Decoding uploads and blurring a large mask take real CPU time: keep them off the async workers.
    let prepared = tokio::task::spawn_blocking({
        let (state, local) = (state.clone(), local.clone());
        move || prepare(&state, &local, &bytes, mode)
    })
    .await
    .map_err(|e| A1111Error(ApiError::internal(format!("request preparation failed: {e}"))))??;
    clock.submitted();
    let view =
        state.jobs.run_for(prepared.req.clone(), prepared.model.clone()).await.map_err(ApiError::from)?;
    clock.ended();
    // An interrupted job answers with the images it finished (possibly none), as A1111 does.
    let (view, images) = match view.state {
        sdhive_protocol::JobState::Cancelled => {
            let images = view.images.clone();
            (view, images)
        }
        _ => job_outcome(view).map_err(|f| failure(f, prepared.spelling))?,
    };
    if let Some((spec, vae)) = &prepared.keep_override {
        state.library.select_checkpoint(spec);
        if let Some(vae) = vae {
            state.library.select_vae(vae.clone());
        }
    }
    if let Some(samples) = &prepared.keep_samples {
        local.lock().samples = samples.clone();
    }
    let info = info_json(&state, &prepared, &view, &images);
    // The job encoded its images in the request's format.
    let sent: &[FinishedImage] = if prepared.send_images { &images } else { &[] };
    let body = answer_body(sent, &prepared.echo, &info).map_err(|e| A1111Error(ApiError::internal(e)))?;
    let response = ([(header::CONTENT_TYPE, "application/json")], body).into_response();
    Ok(clock.answer(response, &view))
}

/// The txt2img/img2img answer, `{"images": [base64, ...], "parameters": ..., "info": "..."}`, written straight
/// into its body ([`super::push_base64_string`]).
fn answer_body(images: &[FinishedImage], parameters: &Value, info: &str) -> Result<Vec<u8>, String> {
    let sizes: usize = images.iter().map(|i| i.bytes.len().div_ceil(3) * 4 + 3).sum();
    let mut body = Vec::with_capacity(sizes + 2 * info.len() + 4096);
    body.extend_from_slice(b"{\"images\":[");
    for (i, image) in images.iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        super::push_base64_string(&mut body, &image.bytes);
    }
    body.extend_from_slice(b"],\"parameters\":");
    serde_json::to_writer(&mut body, parameters).map_err(|e| format!("the answer's parameters: {e}"))?;
    body.extend_from_slice(b",\"info\":");
    serde_json::to_writer(&mut body, info).map_err(|e| format!("the answer's info: {e}"))?;
    body.push(b'}');
    Ok(body)
}

async fn txt2img(
    State(state): State<AppState>,
    Extension(local): Extension<Local>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, A1111Error> {
    generate(state, local, body, Mode::Txt2Img).await
}

async fn img2img(
    State(state): State<AppState>,
    Extension(local): Extension<Local>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, A1111Error> {
    generate(state, local, body, Mode::Img2Img).await
}

// ---------------------------------------------------------------------------------------------------------
// Progress and control
// ---------------------------------------------------------------------------------------------------------

async fn progress(State(state): State<AppState>, Extension(local): Extension<Local>) -> Json<Value> {
    let Some(view) = state.jobs.current() else {
        return Json(json!({
            "progress": 0.0,
            "eta_relative": 0.0,
            "state": {
                "skipped": false,
                "interrupted": false,
                "job": "",
                "job_count": 0,
                "job_timestamp": "0",
                "job_no": 0,
                "sampling_step": 0,
                "sampling_steps": 0,
            },
            "current_image": null,
            "textinfo": null,
        }));
    };
    let steps = u64::from(view.total_steps.max(1));
    let images = u64::from(view.images_total.max(1));
    let done = u64::from(view.image_index) * steps + u64::from(view.step);
    let fraction = (done as f64 / (images * steps) as f64).clamp(0.0, 1.0);
    let interrupted = local.lock().interrupted.as_ref() == Some(&view.id);
    Json(json!({
        "progress": fraction,
        "eta_relative": view.eta_seconds.unwrap_or(0.0),
        "state": {
            "skipped": false,
            "interrupted": interrupted,
            // The native job id: `GET /v1/jobs/{id}` has the rest.
            "job": view.id.as_str(),
            "job_count": view.images_total,
            "job_timestamp": job_timestamp(view.started_at.unwrap_or(view.created_at)),
            "job_no": view.image_index,
            "sampling_step": view.step,
            "sampling_steps": view.total_steps,
        },
        "current_image": view.preview.as_ref().map(|png| {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD.encode(png)
        }),
        "textinfo": view.activity.clone().unwrap_or_else(|| format!(
            "image {}/{}, step {}/{}",
            view.image_index + 1,
            view.images_total,
            view.step,
            view.total_steps
        )),
    }))
}

/// Cancels the running job (queued ones stay queued, as in A1111). Its synchronous caller gets a 409.
async fn interrupt(State(state): State<AppState>, Extension(local): Extension<Local>) -> Json<Value> {
    if let Some(id) = state.jobs.cancel_current() {
        local.lock().interrupted = Some(id);
    }
    Json(json!({}))
}

/// Skipping to the next image of a batch needs engine support we do not have; saying so beats a silent no-op.
async fn skip() -> A1111Error {
    A1111Error(ApiError::new(
        StatusCode::NOT_IMPLEMENTED,
        "not_implemented",
        Some("skip_unsupported"),
        None,
        "skip is not supported; use /sdapi/v1/interrupt to stop the running job".into(),
    ))
}

// ---------------------------------------------------------------------------------------------------------
// Models, samplers, schedulers, options
// ---------------------------------------------------------------------------------------------------------

/// The title of the checkpoint requests without a model run with.
fn checkpoint_title(state: &AppState) -> String {
    match state.library.resolve(None, None) {
        Ok(spec) => state.library.title_of(&spec),
        Err(_) => state.library.current().map(|(spec, _)| state.library.title_of(&spec)).unwrap_or_default(),
    }
}

async fn sd_models(State(state): State<AppState>) -> Json<Value> {
    Json(Value::Array(state.library.list(&state.config.worker_id).iter().map(|m| m.a1111()).collect()))
}

async fn sd_vae(State(state): State<AppState>) -> Json<Value> {
    Json(Value::Array(
        state
            .library
            .list_vaes()
            .into_iter()
            .map(|v| json!({"model_name": v.model_name, "filename": v.filename}))
            .collect(),
    ))
}

/// `refresh-checkpoints` and `refresh-vae`: one scan covers both.
async fn refresh(State(state): State<AppState>) -> Result<Json<Value>, A1111Error> {
    let library = state.library.clone();
    tokio::task::spawn_blocking(move || library.refresh())
        .await
        .map_err(|e| A1111Error(ApiError::internal(format!("the rescan failed: {e}"))))?
        .map_err(|e| A1111Error(ApiError::internal(e.to_string())))?;
    Ok(Json(Value::Null))
}

/// A1111's `create_lora_json` list.
async fn loras(State(state): State<AppState>) -> Json<Value> {
    Json(json!(state.networks.list_loras()))
}

/// `loaded`: the embeddings whose width fits the model requests without a model run on; the rest `skipped`.
async fn embeddings(State(state): State<AppState>) -> Json<Value> {
    let widths = state.library.resolve(None, None).ok().and_then(|spec| state.text_widths(&spec));
    Json(json!(state.networks.list_embeddings(widths.as_deref())))
}

/// `refresh-loras` and `refresh-embeddings`: one scan covers both.
async fn refresh_networks(State(state): State<AppState>) -> Result<Json<Value>, A1111Error> {
    let networks = state.networks.clone();
    tokio::task::spawn_blocking(move || networks.refresh())
        .await
        .map_err(|e| A1111Error(ApiError::internal(format!("the rescan failed: {e}"))))?
        .map_err(|e| A1111Error(ApiError::internal(e.to_string())))?;
    Ok(Json(Value::Null))
}

/// A model job (load or unload) that failed, as A1111's error about `field`.
fn switch_failed(view: JobView, field: &str) -> A1111Error {
    match job_outcome(view) {
        Ok(_) => A1111Error(ApiError::internal("the switch succeeded".to_string())),
        Err(f) => failure(f, Spelling { sampler: "sampler_name" }).relabel(field),
    }
}

impl A1111Error {
    /// The same error about `field` (a model switch reports failures against our `model`).
    fn relabel(mut self, field: &str) -> Self {
        if self.0.body.error.param.is_some() {
            self.0.body.error.param = Some(field.to_string());
        }
        self
    }
}

async fn unload_checkpoint(State(state): State<AppState>) -> Result<Json<Value>, A1111Error> {
    let view = state.jobs.unload_model().await.map_err(ApiError::from)?;
    if view.state != sdhive_protocol::JobState::Succeeded {
        return Err(switch_failed(view, "sd_model_checkpoint"));
    }
    Ok(Json(Value::Null))
}

/// Loads the selected checkpoint again (after `unload-checkpoint`).
async fn reload_checkpoint(State(state): State<AppState>) -> Result<Json<Value>, A1111Error> {
    let spec = state.library.resolve(None, None).map_err(|e| model_error("sd_model_checkpoint", e))?;
    let view = state.jobs.load_model(spec).await.map_err(ApiError::from)?;
    if view.state != sdhive_protocol::JobState::Succeeded {
        return Err(switch_failed(view, "sd_model_checkpoint"));
    }
    Ok(Json(Value::Null))
}

/// The samplers the loaded engine runs (the stable-diffusion.cpp engine lacks PNDM).
async fn samplers(State(state): State<AppState>) -> Json<Value> {
    Json(Value::Array(
        Sampler::ALL
            .iter()
            .filter(|s| state.info().samplers.iter().any(|name| name == s.name()))
            .map(|s| json!({"name": s.name(), "aliases": s.aliases(), "options": {}}))
            .collect(),
    ))
}

async fn schedulers() -> Json<Value> {
    Json(json!([
        {"name": "automatic", "label": "Automatic", "aliases": null, "default_rho": -1, "need_inner_model": false},
        {"name": "karras", "label": "Karras", "aliases": null, "default_rho": 7.0, "need_inner_model": false},
    ]))
}

/// Options we answer for ourselves; a POST sets the model, VAE, clip skip and image options, not the others.
const OWN_OPTIONS: &[&str] = &[
    "sd_model_checkpoint",
    "sd_checkpoint_hash",
    "sd_vae",
    "CLIP_stop_at_last_layers",
    "samples_format",
    "jpeg_quality",
    "webp_lossless",
    "eta_noise_seed_delta",
];

async fn get_options(State(state): State<AppState>, Extension(local): Extension<Local>) -> Json<Value> {
    let settings = local.lock();
    let mut out = settings.other.clone();
    out.insert("sd_model_checkpoint".into(), json!(checkpoint_title(&state)));
    let hash = state.library.resolve(None, None).ok().and_then(|spec| state.library.sha256_of(&spec));
    out.insert("sd_checkpoint_hash".into(), json!(hash));
    out.insert("sd_vae".into(), json!(state.library.selected_vae().as_option()));
    out.insert("CLIP_stop_at_last_layers".into(), json!(settings.clip_skip.unwrap_or(1)));
    out.insert("samples_format".into(), json!(settings.samples.format));
    out.insert("jpeg_quality".into(), json!(settings.samples.jpeg_quality));
    out.insert("webp_lossless".into(), json!(settings.samples.webp_lossless));
    out.insert("eta_noise_seed_delta".into(), json!(0));
    Json(Value::Object(out))
}

/// Stores `CLIP_stop_at_last_layers` and the image options (`samples_format`, `jpeg_quality`, `webp_lossless`),
/// switches to `sd_model_checkpoint` and `sd_vae` (answering once the model is loaded, after the jobs queued
/// before), and keeps any other key to echo back. Like A1111, answers `null`. A name that matches no model, or a
/// model that fails to load, is a 400 naming the option; the previous model then stays selected and loaded. A bad
/// value of any option changes nothing.
async fn set_options(
    State(state): State<AppState>,
    Extension(local): Extension<Local>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, A1111Error> {
    let bytes = read_body(body)?;
    let Value::Object(given) = parse_json::<Value>(&bytes)? else {
        return Err(A1111Error(ApiError::bad_body(
            "invalid_body",
            "the body must be a JSON object of options",
        )));
    };
    // Check everything before storing anything, so a bad request changes nothing.
    let clip_skip = given
        .get("CLIP_stop_at_last_layers")
        .map(|v| parse_clip_skip(v).map_err(|m| invalid("CLIP_stop_at_last_layers", m)))
        .transpose()?;
    // Checked against the options as they are now; stored (over what they are then) with the rest below.
    local.lock().samples.updated(Some(&given), "")?;
    let options = ModelOptions::read(&state, Some(&given), "")?;
    let (checkpoint, vae) = (options.checkpoint, options.vae.clone());
    let switch = if checkpoint.is_some() || vae.as_ref().is_some_and(|v| *v != state.library.selected_vae()) {
        Some(options.resolve(&state)?)
    } else {
        None
    };
    if let Some(spec) = switch {
        let loaded = state.library.current().map(|(current, _)| current);
        if state.library.switchable() && loaded.as_ref() != Some(&spec) {
            let view = state.jobs.load_model(spec.clone()).await.map_err(ApiError::from)?;
            if view.state != sdhive_protocol::JobState::Succeeded {
                let field = if checkpoint.is_some() { "sd_model_checkpoint" } else { "sd_vae" };
                return Err(switch_failed(view, field));
            }
        }
        state.library.select_checkpoint(&spec);
        if let Some(vae) = vae {
            state.library.select_vae(vae);
        }
    }
    let mut settings = local.lock();
    if let Some(c) = clip_skip {
        settings.clip_skip = Some(c);
    }
    settings.samples = settings.samples.updated(Some(&given), "")?;
    for (key, value) in given {
        if !OWN_OPTIONS.contains(&key.as_str()) {
            settings.other.insert(key, value);
        }
    }
    Ok(Json(Value::Null))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_written_answer_is_the_json_a_value_would_give() {
        use base64::Engine as _;
        let image = |bytes: &[u8]| FinishedImage {
            bytes: Bytes::copy_from_slice(bytes),
            output: sdhive_engine::OutputFormat::PNG,
            seed: 1,
            infotext: String::new(),
            width: 1,
            height: 1,
        };
        let images: Vec<FinishedImage> =
            [&b""[..], b"a", b"ab", b"abc", b"\x00\xff\x10\x80"].iter().map(|b| image(b)).collect();
        let parameters = json!({"prompt": "a \"quoted\" cat\non two lines", "seed": -1, "styles": []});
        let info = json!({"infotexts": ["é \\ \u{1}"]}).to_string();
        for sent in [&images[..], &[]] {
            let body = answer_body(sent, &parameters, &info).expect("an answer");
            let got: Value = serde_json::from_slice(&body).expect("valid JSON");
            let b64 = &base64::engine::general_purpose::STANDARD;
            let want = json!({
                "images": sent.iter().map(|i| b64.encode(&i.bytes)).collect::<Vec<_>>(),
                "parameters": parameters,
                "info": info,
            });
            assert_eq!(got, want);
        }
    }

    #[test]
    fn timestamps_are_utc_calendar_dates() {
        let at = |secs: u64| job_timestamp(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(secs));
        assert_eq!(at(0), "19700101000000");
        assert_eq!(at(1_700_000_000), "20231114221320");
        assert_eq!(at(951_782_400), "20000229000000");
        assert_eq!(at(4_107_542_399), "21000228235959"); // 2100 is not a leap year
    }

    #[test]
    fn mirror_reflects_without_repeating_the_edge() {
        let got: Vec<usize> = (-3..7).map(|i| mirror(i, 4)).collect();
        assert_eq!(got, vec![3, 2, 1, 0, 1, 2, 3, 2, 1, 0]);
        assert_eq!(mirror(-5, 1), 0);
    }

    #[test]
    fn blur_softens_edges_and_keeps_flat_areas() {
        let mut data = vec![0u8; 32 * 8];
        for row in data.chunks_mut(32) {
            row[16..].fill(255);
        }
        let mask = GrayImage { width: 32, height: 8, data };
        let blurred = gaussian_blur(&mask, 4.0);
        let row = &blurred.data[..32];
        assert_eq!((row[0], row[31]), (0, 255));
        assert!(row[15] > 0 && row[15] < 128 && row[16] > 128 && row[16] < 255, "{row:?}");
        assert!(row.windows(2).all(|w| w[0] <= w[1]), "{row:?}");
        assert_eq!(gaussian_blur(&mask, 0.0), mask);
        // A flat mask stays flat: the kernel sums to one.
        let flat = GrayImage { width: 5, height: 3, data: vec![200; 15] };
        assert_eq!(gaussian_blur(&flat, 2.0), flat);
    }

    #[test]
    fn alpha_masks_use_opacity_like_a1111() {
        let img = image::RgbaImage::from_raw(3, 1, vec![0, 0, 0, 255, 0, 0, 0, 0, 9, 9, 9, 129]).unwrap();
        let mut png = Vec::new();
        img.write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png).unwrap();
        assert_eq!(decode_a1111_mask(&png, 100).unwrap().data, vec![255, 0, 255]);
    }

    #[test]
    fn flags_accept_ints_and_bools() {
        assert!(!flag("f", None).unwrap());
        assert!(flag("f", Some(&json!(1))).unwrap());
        assert!(flag("f", Some(&json!(true))).unwrap());
        assert!(flag("f", Some(&json!(2))).is_err());
    }

    #[test]
    fn checkpoint_names_reduce_to_a_stem() {
        use sdhive_protocol::file_stem as stem;
        assert_eq!(stem("models/v1-5-pruned.safetensors"), "v1-5-pruned");
        assert_eq!(stem("stabilityai/sd-turbo"), "sd-turbo");
        assert_eq!(stem("C:\\m\\x.ckpt"), "x");
    }
}
