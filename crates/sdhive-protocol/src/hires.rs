//! Hires fix on the wire: the `hires` object of native jobs and OpenAI generations (A1111's flat `enable_hr` /
//! `hr_*` fields mean the same). Unset fields take A1111's defaults; see `docs/api-a1111.md` ("Hires fix").

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HiresRequest {
    /// `Latent` (default), `Latent (antialiased)`, …, `None`, `Lanczos`, `Nearest`, or an upscaler model's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upscaler: Option<String>,
    /// Enlargement factor (default 2), unless `resize_x` / `resize_y` give the size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resize_x: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resize_y: Option<u32>,
    /// Steps of the second pass's schedule (default: the first pass's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub denoising_strength: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampler: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub negative_prompt: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cfg_scale: Option<f32>,
}
