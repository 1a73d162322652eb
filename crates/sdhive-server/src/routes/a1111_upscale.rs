//! A1111's upscaler routes: the listings (`upscalers`, `latent-upscale-modes`, `realesrgan-models`) and the
//! extras (`extra-single-image`, `extra-batch-images`: images through one or two upscalers, by a factor or to a
//! size), which run as jobs on the engine thread so upscaler models use the worker's device.

use crate::error::ApiError;
use crate::extract::parse_json;
use crate::routes::a1111::{failure, invalid, read_body, A1111Error, Local, Spelling};
use crate::routes::a1111_info::{realesrgan_models, RealesrganModel};
use crate::routes::openai::job_outcome;
use crate::validation::decode_base64_image;
use crate::AppState;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::routing::{get, post};
use axum::Extension;
use axum::{Json, Router};
use base64::Engine as _;
use sdhive_engine::hires::{BUILTIN_IMAGE_UPSCALERS, LATENT_UPSCALERS};
use sdhive_engine::{HiresUpscaler, RgbImage, UpscaleRequest, UpscaleSize};
use serde::Deserialize;
use serde_json::{json, Value};

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/sdapi/v1/upscalers", get(upscalers))
        .route("/sdapi/v1/latent-upscale-modes", get(latent_upscale_modes))
        .route("/sdapi/v1/realesrgan-models", get(realesrgan))
        .route("/sdapi/v1/extra-single-image", post(extra_single_image))
        .route("/sdapi/v1/extra-batch-images", post(extra_batch_images))
}

/// The node's upscaler models with what their headers say (architecture, scale); unreadable files are logged
/// and left out, so a listed name always loads.
fn models(state: &AppState) -> Vec<(sdhive_catalog::UpscalerFile, sdhive_upscale::ModelInfo)> {
    state
        .upscaler_models()
        .into_iter()
        .filter_map(|f| match sdhive_upscale::UpscaleModel::inspect(&f.path) {
            Ok(info) => Some((f, info)),
            Err(e) => {
                tracing::warn!("not listing upscaler {}: {e}", f.path.display());
                None
            }
        })
        .collect()
}

/// `GET /sdapi/v1/upscalers`: A1111's built-in ones, then the models (`name`, `model_name`, `model_path`,
/// `model_url`, `scale`).
async fn upscalers(State(state): State<AppState>) -> Json<Value> {
    let models = tokio::task::spawn_blocking(move || models(&state)).await.unwrap_or_default();
    let mut list: Vec<Value> = BUILTIN_IMAGE_UPSCALERS
        .iter()
        .map(|n| json!({"name": n, "model_name": null, "model_path": null, "model_url": null, "scale": 4}))
        .collect();
    list.extend(models.iter().map(|(f, info)| {
        json!({
            "name": f.name,
            "model_name": info.arch.name(),
            "model_path": f.path.display().to_string(),
            "model_url": null,
            "scale": info.scale,
        })
    }));
    Json(Value::Array(list))
}

async fn latent_upscale_modes() -> Json<Value> {
    Json(Value::Array(LATENT_UPSCALERS.iter().map(|(n, _)| json!({"name": n})).collect()))
}

/// `GET /sdapi/v1/realesrgan-models`: every upscaler model (A1111 lists its Real-ESRGAN family here).
async fn realesrgan(State(state): State<AppState>) -> Json<Value> {
    let models = tokio::task::spawn_blocking(move || models(&state)).await.unwrap_or_default();
    let listed: Vec<RealesrganModel> = models
        .iter()
        .map(|(f, info)| RealesrganModel {
            name: f.name.clone(),
            path: Some(f.path.display().to_string()),
            scale: Some(f64::from(info.scale)),
        })
        .collect();
    Json(realesrgan_models(&listed))
}

/// A1111's `ExtrasBaseRequest`; its other fields are ignored.
#[derive(Debug, Deserialize)]
#[serde(default)]
struct ExtrasRequest {
    resize_mode: u32,
    gfpgan_visibility: f32,
    codeformer_visibility: f32,
    upscaling_resize: f64,
    upscaling_resize_w: u32,
    upscaling_resize_h: u32,
    upscaling_crop: bool,
    upscaler_1: Option<String>,
    upscaler_2: Option<String>,
    extras_upscaler_2_visibility: f32,
    image: Option<String>,
    #[serde(rename = "imageList")]
    image_list: Option<Vec<ImageData>>,
}

impl Default for ExtrasRequest {
    fn default() -> Self {
        ExtrasRequest {
            resize_mode: 0,
            gfpgan_visibility: 0.0,
            codeformer_visibility: 0.0,
            upscaling_resize: 2.0,
            upscaling_resize_w: 512,
            upscaling_resize_h: 512,
            upscaling_crop: true,
            upscaler_1: None,
            upscaler_2: None,
            extras_upscaler_2_visibility: 0.0,
            image: None,
            image_list: None,
        }
    }
}

#[derive(Debug, Deserialize)]
struct ImageData {
    data: String,
}

/// The upscaler a field names: `None` or empty is A1111's "None"; latent upscalers have no image to work on.
fn image_upscaler(state: &AppState, field: &str, name: Option<&str>) -> Result<HiresUpscaler, A1111Error> {
    let name = name.map(str::trim).filter(|n| !n.is_empty()).unwrap_or("None");
    match crate::hires::find_upscaler(state, name) {
        Some(HiresUpscaler::Latent(_)) => {
            Err(invalid(field, format!("`{name}` works on latents; the extras take an image upscaler")))
        }
        Some(u) => Ok(u),
        None => {
            let names: Vec<String> = crate::hires::upscaler_names(state)
                .into_iter()
                .filter(|n| !LATENT_UPSCALERS.iter().any(|(l, _)| l == n))
                .collect();
            Err(invalid(field, format!("unknown upscaler `{name}`; available: {}", names.join(", "))))
        }
    }
}

/// The extras may make no image larger than an upload may be (`--max-image-pixels`).
fn check_output(state: &AppState, images: &[RgbImage], size: UpscaleSize) -> Result<(), A1111Error> {
    let max = state.config.max_decode_pixels;
    for img in images {
        let (w, h, field) = match size {
            UpscaleSize::By(s) => (f64::from(img.width) * s, f64::from(img.height) * s, "upscaling_resize"),
            UpscaleSize::To { width, height, .. } => {
                let s =
                    (f64::from(width) / f64::from(img.width)).max(f64::from(height) / f64::from(img.height));
                (f64::from(img.width) * s, f64::from(img.height) * s, "upscaling_resize_w")
            }
        };
        if w * h > max as f64 {
            return Err(invalid(
                field,
                format!(
                    "the result ({w:.0}x{h:.0}) would be larger than this server's limit of {max} pixels"
                ),
            ));
        }
    }
    Ok(())
}

fn request(
    state: &AppState,
    body: &ExtrasRequest,
    images: Vec<RgbImage>,
) -> Result<UpscaleRequest, A1111Error> {
    if body.gfpgan_visibility > 0.0 || body.codeformer_visibility > 0.0 {
        let field = if body.gfpgan_visibility > 0.0 { "gfpgan_visibility" } else { "codeformer_visibility" };
        return Err(invalid(
            field,
            "this server has no face restorers (GET /sdapi/v1/face-restorers); send 0",
        ));
    }
    let size = match body.resize_mode {
        0 => {
            let s = body.upscaling_resize;
            if !(s.is_finite() && s > 0.0 && s <= 8.0) {
                return Err(invalid("upscaling_resize", format!("must be a number in (0, 8], got {s}")));
            }
            UpscaleSize::By(s)
        }
        1 => {
            for (field, v) in [
                ("upscaling_resize_w", body.upscaling_resize_w),
                ("upscaling_resize_h", body.upscaling_resize_h),
            ] {
                if v == 0 {
                    return Err(invalid(field, "must be at least 1"));
                }
            }
            UpscaleSize::To {
                width: body.upscaling_resize_w,
                height: body.upscaling_resize_h,
                crop: body.upscaling_crop,
            }
        }
        m => return Err(invalid("resize_mode", format!("must be 0 (scale by) or 1 (scale to), got {m}"))),
    };
    check_output(state, &images, size)?;
    let upscaler = image_upscaler(state, "upscaler_1", body.upscaler_1.as_deref())?;
    let visibility = body.extras_upscaler_2_visibility;
    if !(0.0..=1.0).contains(&visibility) {
        return Err(invalid(
            "extras_upscaler_2_visibility",
            format!("must be between 0 and 1, got {visibility}"),
        ));
    }
    let second = match body.upscaler_2.as_deref().map(str::trim).filter(|n| !n.is_empty() && *n != "None") {
        Some(name) if visibility > 0.0 => {
            Some((image_upscaler(state, "upscaler_2", Some(name))?, visibility))
        }
        _ => None,
    };
    Ok(UpscaleRequest { images, upscaler, size, second, output: sdhive_engine::OutputFormat::PNG })
}

/// Runs the extras job and returns its images as base64, encoded as the options' `samples_format` says (A1111's
/// API encodes every image it returns so).
async fn run(state: &AppState, local: &Local, mut req: UpscaleRequest) -> Result<Vec<String>, A1111Error> {
    req.output = local.samples_output();
    let view = state.jobs.upscale(req).await.map_err(ApiError::from)?;
    let (_, images) = job_outcome(view).map_err(|f| {
        let renamed = match f {
            crate::routes::openai::JobFailure::Invalid { param, message } => {
                crate::routes::openai::JobFailure::Invalid {
                    param: param.map(|p| if p == "hr_upscaler" { "upscaler_1".into() } else { p }),
                    message,
                }
            }
            other => other,
        };
        failure(renamed, Spelling { sampler: "sampler_name" })
    })?;
    Ok(images.iter().map(|i| base64::engine::general_purpose::STANDARD.encode(&i.bytes)).collect())
}

async fn decode(state: &AppState, images: Vec<(&'static str, String)>) -> Result<Vec<RgbImage>, A1111Error> {
    let max = state.config.max_decode_pixels;
    tokio::task::spawn_blocking(move || {
        images
            .iter()
            .map(|(field, data)| {
                decode_base64_image(field, data, max).map_err(|e| invalid(e.field, e.message))
            })
            .collect::<Result<Vec<_>, _>>()
    })
    .await
    .map_err(|e| A1111Error(ApiError::internal(format!("decoding the images failed: {e}"))))?
}

async fn extra_single_image(
    State(state): State<AppState>,
    Extension(local): Extension<Local>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, A1111Error> {
    let bytes = read_body(body)?;
    let body: ExtrasRequest = parse_json(&bytes)?;
    let data = body
        .image
        .clone()
        .filter(|d| !d.is_empty())
        .ok_or_else(|| invalid("image", "an image is required"))?;
    let images = decode(&state, vec![("image", data)]).await?;
    let req = request(&state, &body, images)?;
    let mut out = run(&state, &local, req).await?;
    Ok(Json(json!({"html_info": "", "image": out.pop().unwrap_or_default()})))
}

async fn extra_batch_images(
    State(state): State<AppState>,
    Extension(local): Extension<Local>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, A1111Error> {
    let bytes = read_body(body)?;
    let body: ExtrasRequest = parse_json(&bytes)?;
    let list = body.image_list.as_deref().unwrap_or_default();
    if list.is_empty() {
        return Err(invalid("imageList", "at least one image is required"));
    }
    let images = decode(&state, list.iter().map(|i| ("imageList", i.data.clone())).collect()).await?;
    let req = request(&state, &body, images)?;
    let out = run(&state, &local, req).await?;
    Ok(Json(json!({"html_info": "", "images": out})))
}
