//! Hires-fix requests of every route family turned into the engine's [`HiresFix`]: defaults, the upscaler looked
//! up by name (built-in or the node's upscaler models), the second pass's sampler, and errors naming the field as
//! the client spelled it (`hr_upscaler` for A1111, `hires.upscaler` for native jobs and OpenAI).

use crate::validation::parse_sampler;
use crate::AppState;
use sdhive_engine::{HiresFix, HiresUpscaler, ValidationError};
use sdhive_protocol::HiresRequest;

/// How a route family names the hires fields.
pub struct FieldNames {
    pub upscaler: &'static str,
    pub scale: &'static str,
    pub resize_x: &'static str,
    pub resize_y: &'static str,
    pub steps: &'static str,
    pub denoising_strength: &'static str,
    pub sampler: &'static str,
    pub scheduler: &'static str,
    pub prompt: &'static str,
    pub negative_prompt: &'static str,
    pub cfg_scale: &'static str,
    pub enable: &'static str,
}

pub const A1111_FIELDS: FieldNames = FieldNames {
    upscaler: "hr_upscaler",
    scale: "hr_scale",
    resize_x: "hr_resize_x",
    resize_y: "hr_resize_y",
    steps: "hr_second_pass_steps",
    denoising_strength: "denoising_strength",
    sampler: "hr_sampler_name",
    scheduler: "hr_scheduler",
    prompt: "hr_prompt",
    negative_prompt: "hr_negative_prompt",
    cfg_scale: "hr_cfg",
    enable: "enable_hr",
};

pub const NATIVE_FIELDS: FieldNames = FieldNames {
    upscaler: "hires.upscaler",
    scale: "hires.scale",
    resize_x: "hires.resize_x",
    resize_y: "hires.resize_y",
    steps: "hires.steps",
    denoising_strength: "hires.denoising_strength",
    sampler: "hires.sampler",
    scheduler: "hires.scheduler",
    prompt: "hires.prompt",
    negative_prompt: "hires.negative_prompt",
    cfg_scale: "hires.cfg_scale",
    enable: "hires",
};

impl FieldNames {
    /// The engine validates with A1111's names; this family's name for the same field.
    pub fn rename(&self, field: &'static str) -> &'static str {
        let pairs = [
            (A1111_FIELDS.upscaler, self.upscaler),
            (A1111_FIELDS.scale, self.scale),
            (A1111_FIELDS.resize_x, self.resize_x),
            (A1111_FIELDS.resize_y, self.resize_y),
            (A1111_FIELDS.steps, self.steps),
            (A1111_FIELDS.sampler, self.sampler),
            (A1111_FIELDS.scheduler, self.scheduler),
            (A1111_FIELDS.prompt, self.prompt),
            (A1111_FIELDS.negative_prompt, self.negative_prompt),
            (A1111_FIELDS.cfg_scale, self.cfg_scale),
            (A1111_FIELDS.enable, self.enable),
        ];
        pairs.iter().find(|(a, _)| *a == field).map_or(field, |(_, ours)| ours)
    }
}

fn invalid(field: &'static str, message: impl Into<String>) -> ValidationError {
    ValidationError { field, message: message.into() }
}

/// A1111's "same as the first pass" spellings of the second pass's sampler and scheduler.
fn same_as_first(name: Option<&str>) -> Option<&str> {
    name.map(str::trim).filter(|n| !n.is_empty() && !n.to_ascii_lowercase().starts_with("use same"))
}

/// The engine's hires settings for `req`; `default_strength` is the family's default denoising strength.
pub fn resolve(
    state: &AppState,
    req: &HiresRequest,
    names: &FieldNames,
    default_strength: f32,
) -> Result<HiresFix, ValidationError> {
    let defaults = HiresFix::default();
    let upscaler = match req.upscaler.as_deref().map(str::trim).filter(|n| !n.is_empty()) {
        None => defaults.upscaler.clone(),
        Some(name) => find_upscaler(state, name).ok_or_else(|| {
            let known = upscaler_names(state);
            invalid(names.upscaler, format!("unknown upscaler `{name}`; available: {}", known.join(", ")))
        })?,
    };
    let sampler_name = same_as_first(req.sampler.as_deref());
    let scheduler_name = same_as_first(req.scheduler.as_deref());
    let (sampler, schedule) = match (sampler_name, scheduler_name) {
        (None, None) => (None, None),
        (s, sch) => {
            let (sampler, schedule) = parse_sampler(s, sch, names.sampler, names.scheduler)?;
            // A scheduler alone keeps the first pass's sampler.
            (s.map(|_| sampler), Some(schedule).filter(|_| sch.is_some() || s.is_some()))
        }
    };
    Ok(HiresFix {
        upscaler,
        scale: req.scale.unwrap_or(defaults.scale),
        resize_x: req.resize_x.unwrap_or(0),
        resize_y: req.resize_y.unwrap_or(0),
        steps: req.steps.unwrap_or(0),
        denoising_strength: req.denoising_strength.unwrap_or(default_strength),
        sampler,
        schedule,
        prompt: req.prompt.clone().filter(|p| !p.is_empty()),
        negative_prompt: req.negative_prompt.clone().filter(|p| !p.is_empty()),
        cfg_scale: req.cfg_scale,
    })
}

/// A built-in upscaler, else one of the node's upscaler models, by name.
pub fn find_upscaler(state: &AppState, name: &str) -> Option<HiresUpscaler> {
    HiresUpscaler::builtin(name).or_else(|| state.upscaler_model(name))
}

/// Every upscaler name a request may use: the latent modes, the resampling ones, then the models.
pub fn upscaler_names(state: &AppState) -> Vec<String> {
    let mut names: Vec<String> =
        sdhive_engine::hires::LATENT_UPSCALERS.iter().map(|(n, _)| n.to_string()).collect();
    names.extend(sdhive_engine::hires::BUILTIN_IMAGE_UPSCALERS.iter().map(|n| n.to_string()));
    names.extend(state.upscaler_models().into_iter().map(|m| m.name));
    names
}

/// Sets `req.hires` from `hr` and checks the whole request again with the hires size known: a first pass left
/// at the model's native size is made explicit, so the hires size is checked against the limits before the job
/// is queued. Errors name the field as `names` spells it.
pub fn attach(
    state: &AppState,
    req: &mut sdhive_engine::GenerateRequest,
    hr: &HiresRequest,
    names: &FieldNames,
    default_strength: f32,
) -> Result<(), ValidationError> {
    let rename = |e: ValidationError| ValidationError { field: names.rename(e.field), ..e };
    req.hires = Some(resolve(state, hr, names, default_strength)?);
    if req.init_image.is_none() {
        let info = state.info();
        req.width = req.width.or(Some(info.native_width).filter(|w| *w > 0));
        req.height = req.height.or(Some(info.native_height).filter(|h| *h > 0));
    }
    req.validate(&state.config.limits).map_err(rename)
}
