//! `SdCppEngine`: a stable-diffusion.cpp context behind the [`Engine`] trait. Loading builds the context on the
//! named ggml device (never ggml's "best available", which may quietly be the CPU); each request is validated,
//! mapped onto `sd_img_gen_params_t` and run one image at a time (seed, seed+1, …), each stoppable after any
//! denoising step (`callbacks::generate`), and seeds use sd.cpp's torch-compatible CPU generator so they match
//! diffusers'. A request's LoRAs are checked (`networks`) and handed to sd.cpp with the image's parameters. A GGUF
//! checkpoint loads in its own (quantised) types; a standalone VAE file is checked before sd.cpp reads it. An SD3
//! model is handed over part by part (`sd3`) and sampled on diffusers' flow-matching sigmas, which this engine
//! computes and passes as sd.cpp's schedule, so its images follow diffusers' `StableDiffusion3Pipeline`.

use crate::callbacks::{self, Generated};
use crate::device;
use crate::model_info::ModelInfo;
use crate::networks::{self, LoraChecks};
use crate::params::{self, SAMPLERS};
use crate::sd3;
use diffusion_rs_sys as sys;
use sdhive_engine::extra_networks::strip_networks;
use sdhive_engine::{
    budgeted_free, infotext, random_seed, Control, Engine, EngineError, EngineInfo, GenerateOutput,
    GenerateRequest, GeneratedImage, GrayImage, HiresFix, HiresUpscaler, InfotextContext, LatentMode, Limits,
    MemoryReport, ModelShape, Placement, PlacementError, Progress, RgbImage, Sampler, Schedule,
    SkipLayerGuidance, UpscaleRequest, ValidationError,
};
use sdhive_modelsource::{ModelLocation, ResolvedModel};
use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::ptr::NonNull;
use thiserror::Error;

/// Where and how to load the model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// ggml's name of the worker's device (`Vulkan0`, `ROCm1`), as `device::open` returned it.
    pub ggml_device: String,
    /// Shown in `info()`: the backend compiled into the binary and the device's own name.
    pub backend_name: String,
    pub device_name: String,
    /// Weight precision: `f16` (default, what GPUs run fastest) or `f32`; `None` keeps the file's. A GGUF
    /// checkpoint always keeps its own types: converting quantised weights to f16 would undo what the file is for.
    pub weight_type: Option<WeightType>,
    pub placement: Placement,
    /// CPU threads for the parts ggml runs on the CPU.
    pub threads: Option<usize>,
    /// The most device memory jobs may be planned for, weights included.
    pub memory_budget: Option<u64>,
    /// SD3/SD3.5: leave T5 out (its part of the context is zeros).
    pub no_t5: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightType {
    F32,
    F16,
}

#[derive(Debug, Error)]
pub enum LoadError {
    #[error("{path}: {message}")]
    Model { path: PathBuf, message: String },
    #[error(transparent)]
    Placement(#[from] PlacementError),
    #[error("{0} contains a NUL byte")]
    Nul(&'static str),
    #[error("VAE {path}: {message}")]
    Vae { path: PathBuf, message: String },
    #[error(
        "stable-diffusion.cpp could not load {path}{} on {device} (its log, at RUST_LOG=sdcpp=info, says why: \
         unsupported architecture, missing tensors, or not enough device memory)",
        vae.as_ref().map(|v| format!(" with the VAE {}", v.display())).unwrap_or_default()
    )]
    Context { path: PathBuf, vae: Option<PathBuf>, device: String },
}

/// Owns an `sd_ctx_t`.
struct Context(NonNull<sys::sd_ctx_t>);

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the pointer came from new_sd_ctx and is freed once, here.
        unsafe { sys::free_sd_ctx(self.0.as_ptr()) }
    }
}

pub struct SdCppEngine {
    ctx: Context,
    info: EngineInfo,
    model: ModelInfo,
    shape: ModelShape,
    /// ggml's name of the device the denoiser runs on, whose free memory plans each job.
    plan_device: String,
    memory_budget: Option<u64>,
    limits: Limits,
    loras: LoraChecks,
    upscalers: crate::upscale::SdCppUpscalers,
    /// An SD3-family model's flow-matching schedule config (`None` for SD1/SD2/SDXL).
    flow: Option<sdhive_schedulers::FlowMatchConfig>,
    /// An SD3-family model's MMDiT (what skip-layer guidance may name, what its LoRAs must fit).
    mmdit: Option<networks::Mmdit>,
}

/// sd.cpp runs the conditional and unconditional passes as separate batch-1 calls.
const IMAGES_PER_UNET_CALL: u64 = 1;

// SAFETY: an sd.cpp context has no thread affinity; it is only ever used through `&mut self` (one call at a
// time), and the process-wide callback state is serialised by `callbacks::with_progress`.
unsafe impl Send for SdCppEngine {}

impl SdCppEngine {
    pub fn load(model: &ResolvedModel, opts: LoadOptions) -> Result<Self, LoadError> {
        callbacks::install();
        let path = model.location.path().to_path_buf();
        let info =
            ModelInfo::read(model).map_err(|message| LoadError::Model { path: path.clone(), message })?;
        let model_error = |message: String| LoadError::Model { path: path.clone(), message };
        let sd3 = match (&model.location, info.family.as_str()) {
            (ModelLocation::DiffusersDir(dir), "sd3") => Some(sd3::folder_files(dir, !opts.no_t5)),
            (ModelLocation::SingleFile(file), "sd3") => Some(sd3::single_file_files(file, !opts.no_t5)),
            _ => None,
        }
        .transpose()
        .map_err(model_error)?;
        if let Some(vae) = &model.vae {
            check_vae(vae, sd3.is_some())?;
        }
        let flow = match (&sd3, &model.location) {
            (None, _) => None,
            (Some(_), ModelLocation::DiffusersDir(dir)) => {
                let file = dir.join("scheduler").join("scheduler_config.json");
                Some(
                    sdhive_schedulers::FlowMatchConfig::from_file(&file)
                        .map_err(|e| model_error(format!("{}: {e}", file.display())))?,
                )
            }
            // SAI's files carry no scheduler config; every SD3/SD3.5 ships shift 3.
            (Some(_), ModelLocation::SingleFile(_)) => {
                Some(sdhive_schedulers::FlowMatchConfig { shift: 3.0, ..Default::default() })
            }
        };
        // A GGUF's quantised weights stay as they are stored.
        let weight_type = if info.gguf.is_some() { None } else { opts.weight_type };
        let (runtime, params_backend) = params::backend_specs(&opts.ggml_device, &opts.placement)?;
        let c_path =
            CString::new(path.to_string_lossy().into_owned()).map_err(|_| LoadError::Nul("model path"))?;
        let c_file = |p: &Option<PathBuf>, what: &'static str| {
            p.as_ref()
                .map(|p| CString::new(p.to_string_lossy().into_owned()).map_err(|_| LoadError::Nul(what)))
                .transpose()
        };
        // A folder's MMDiT goes to sd.cpp as its SAI-layout copy, in place of a checkpoint file.
        let sai = match sd3.as_ref().and_then(|f| f.diffusion_model.as_ref()) {
            Some(src) => Some(sd3::sai_transformer(src).map_err(model_error)?),
            None => None,
        };
        let sd3_paths = match &sd3 {
            Some(f) => [
                c_file(&f.checkpoint.clone().or(sai), "model path")?,
                c_file(&f.vae, "VAE path")?,
                c_file(&f.clip_l, "CLIP-L path")?,
                c_file(&f.clip_g, "CLIP-G path")?,
                c_file(&f.t5xxl, "T5 path")?,
            ],
            None => Default::default(),
        };
        let c_runtime = CString::new(runtime).map_err(|_| LoadError::Nul("placement"))?;
        let c_params = CString::new(params_backend).map_err(|_| LoadError::Nul("offload"))?;
        // A1111's `sd_vae`: stable-diffusion.cpp loads a standalone VAE file in place of the model's own.
        let c_vae = model
            .vae
            .as_ref()
            .map(|v| CString::new(v.to_string_lossy().into_owned()).map_err(|_| LoadError::Nul("VAE path")))
            .transpose()?;

        // SAFETY: sd_ctx_params_init fills every field; the strings outlive new_sd_ctx, which copies what it
        // keeps.
        let ctx = unsafe {
            let mut p: sys::sd_ctx_params_t = std::mem::zeroed();
            sys::sd_ctx_params_init(&mut p);
            let ptr = |s: &Option<CString>| s.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
            if sd3.is_some() {
                let [checkpoint, vae, clip_l, clip_g, t5xxl] = &sd3_paths;
                p.model_path = ptr(checkpoint);
                p.vae_path = ptr(vae);
                p.clip_l_path = ptr(clip_l);
                p.clip_g_path = ptr(clip_g);
                p.t5xxl_path = ptr(t5xxl);
            } else {
                // A diffusers folder and an original single file both go in `model_path`: sd.cpp tells them
                // apart itself (folder → unet/, vae/, text_encoder/ in diffusers naming).
                p.model_path = c_path.as_ptr();
            }
            if let Some(vae) = &c_vae {
                p.vae_path = vae.as_ptr();
            }
            if let Some(threads) = opts.threads {
                p.n_threads = threads.min(i32::MAX as usize) as i32;
            }
            p.wtype = match weight_type {
                Some(WeightType::F32) => sys::sd_type_t::SD_TYPE_F32,
                Some(WeightType::F16) => sys::sd_type_t::SD_TYPE_F16,
                None => sys::sd_type_t::SD_TYPE_COUNT,
            };
            // torch.Generator("cpu")-compatible noise, for the initial latents and the ancestral samplers.
            p.rng_type = sys::rng_type_t::CPU_RNG;
            p.sampler_rng_type = sys::rng_type_t::CPU_RNG;
            // A job's LoRAs are added in each patched layer's forward (rank-r products, only on the layers a LoRA
            // names) and the adapters are replaced by the next call's set, empty included, so the weights are never
            // changed and a job without LoRAs computes on the file's own. sd.cpp's other mode merges into the
            // weights and on a changed set drops them all to re-read them from the file: on this sd.cpp the job
            // after a LoRA job then crashed in the VAE decode (SIGSEGV, CPU backend; tests/lora_switch.rs).
            p.lora_apply_mode = sys::lora_apply_mode_t::LORA_APPLY_AT_RUNTIME;
            p.backend = c_runtime.as_ptr();
            p.params_backend =
                if c_params.as_bytes().is_empty() { std::ptr::null() } else { c_params.as_ptr() };
            sys::new_sd_ctx(&p)
        };
        let ctx = NonNull::new(ctx).map(Context).ok_or_else(|| LoadError::Context {
            path: path.clone(),
            vae: model.vae.clone(),
            device: opts.ggml_device.clone(),
        })?;
        // sd.cpp reads each module's weights from disk on first use. One small generation now makes them
        // resident, so the memory plan below sees the device as jobs will, and no job waits on a load.
        if let Err(message) = warm_up(ctx.0.as_ptr()) {
            tracing::warn!(
                "{}: a 64×64 warm-up generation failed ({message}); weights load with the first job",
                path.display()
            );
        }
        let (dtype, bytes_per_weight) = match (&info.gguf, weight_type) {
            (Some(gguf), _) => (gguf.types.clone(), 2),
            (None, Some(WeightType::F32)) => ("f32".into(), 4),
            (None, Some(WeightType::F16)) => ("f16".into(), 2),
            (None, None) => ("file".into(), 2),
        };
        let shape = match &sd3 {
            Some(files) => files.shape(bytes_per_weight),
            None => info.shape(bytes_per_weight),
        };
        let plan_device = match opts.placement.device_of(sdhive_engine::Module::Diffusion) {
            Some(d) => params::ggml_device_name(d).unwrap_or_else(|| opts.ggml_device.clone()),
            None => opts.ggml_device.clone(),
        };
        let device_now = device::find(&plan_device);
        let free = budgeted_free(
            device_now.as_ref().map(|d| d.memory_free_bytes),
            opts.memory_budget,
            shape.weights_bytes,
        );
        let memory = MemoryReport {
            weights_bytes: shape.weights_bytes,
            device_total_bytes: device_now.as_ref().map(|d| d.memory_total_bytes),
            device_free_bytes: free,
            native_job: shape
                .plan(info.native_width, info.native_height, IMAGES_PER_UNET_CALL, free, false, true)
                .ok(),
            vae_tiling_available: true,
            attention_slicing_available: false,
        };
        let engine_info = EngineInfo {
            engine: "stable-diffusion.cpp".into(),
            backend: opts.backend_name,
            device: opts.device_name,
            dtype,
            model: model.name.clone(),
            family: info.family.clone(),
            native_width: info.native_width,
            native_height: info.native_height,
            samplers: if sd3.is_some() {
                vec![Sampler::Euler.name().to_string()]
            } else {
                SAMPLERS.iter().map(|s| s.name().to_string()).collect()
            },
            supports_img2img: true,
            supports_inpaint: true,
            memory: Some(memory),
            // sd.cpp takes no textual-inversion embeddings per request.
            text_widths: Vec::new(),
            // The shim's step callback gets no latents, so this engine sends no preview events.
            preview: sdhive_engine::PreviewDecoder::Off,
        };
        Ok(SdCppEngine {
            ctx,
            info: engine_info,
            model: info,
            shape,
            plan_device,
            memory_budget: opts.memory_budget,
            limits: Limits::default(),
            loras: LoraChecks::default(),
            upscalers: Default::default(),
            flow,
            mmdit: sd3.as_ref().map(|f| networks::Mmdit { hidden: f.hidden, blocks: f.blocks }),
        })
    }

    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Model-specific checks; returns sd.cpp's sample method for the request and, for SD3, the schedule.
    fn check(
        &self,
        req: &GenerateRequest,
        width: u32,
        height: u32,
    ) -> Result<(sys::sample_method_t, Vec<f32>), ValidationError> {
        if let Some(config) = &self.flow {
            let sigmas = self.check_sd3(req, width, height, config)?;
            return Ok((sys::sample_method_t::EULER_SAMPLE_METHOD, sigmas));
        }
        let Some(method) = params::sample_method(req.sampler) else {
            let offered: Vec<&str> = SAMPLERS.iter().map(|s| s.name()).collect();
            return Err(ValidationError {
                field: "sampler",
                message: format!(
                    "{} is not available on the stable-diffusion.cpp engine; use one of: {}",
                    req.sampler.name(),
                    offered.join(", ")
                ),
            });
        };
        for (field, v) in [("width", width), ("height", height)] {
            if v % 8 != 0 {
                return Err(ValidationError { field, message: format!("must be a multiple of 8, got {v}") });
            }
        }
        if self.model.inpainting && req.mask.is_none() {
            return Err(ValidationError {
                field: "mask",
                message: "this is an inpainting model: send an init image and a mask".into(),
            });
        }
        if req.skip_layer_guidance.is_some() {
            let message =
                "skip-layer guidance is for SD3-family (MMDiT) models; this engine serves SD1, SD2 and SDXL";
            return Err(ValidationError { field: "skip_layer_guidance", message: message.into() });
        }
        Ok((method, Vec::new()))
    }

    /// What this engine runs of an SD3 request: flow-matching Euler on diffusers' schedule (sd.cpp's other
    /// samplers are k-diffusion's, which diffusers' SD3 pipelines do not run); skip-layer guidance as the candle
    /// engine takes it. Hires fix and LoRAs are checked where they are prepared (`sd3_hires`, `networks`).
    /// Returns the schedule handed to sd.cpp.
    fn check_sd3(
        &self,
        req: &GenerateRequest,
        width: u32,
        height: u32,
        config: &sdhive_schedulers::FlowMatchConfig,
    ) -> Result<Vec<f32>, ValidationError> {
        let refuse = |field: &'static str, message: String| Err(ValidationError { field, message });
        if !matches!(req.sampler, Sampler::Euler | Sampler::EulerA) {
            return refuse(
                "sampler",
                format!(
                    "SD3 models run flow-matching `Euler` on the stable-diffusion.cpp engine, not `{}`",
                    req.sampler.name()
                ),
            );
        }
        if req.schedule != Schedule::Automatic {
            return refuse(
                "scheduler",
                format!(
                    "SD3 models take the schedule of their scheduler config (`Automatic`), not `{}`",
                    req.schedule
                ),
            );
        }
        for (field, v) in [("width", width), ("height", height)] {
            if v % 16 != 0 {
                return refuse(field, format!("must be a multiple of 16 for SD3 models, got {v}"));
            }
        }
        if let Some(g) = &req.skip_layer_guidance {
            g.validate()?;
            if req.init_image.is_some() {
                let message = "applies to text-to-image only, as in diffusers (its SD3 img2img and inpaint \
                               pipelines have none)";
                return refuse("skip_layer_guidance", message.into());
            }
            if req.cfg_scale <= 1.0 {
                return refuse(
                    "skip_layer_guidance",
                    format!(
                        "runs beside classifier-free guidance, which cfg_scale {} turns off (it must be above 1)",
                        req.cfg_scale
                    ),
                );
            }
            let blocks = self.mmdit.map_or(0, |m| m.blocks);
            if let Some(l) = g.layers.iter().find(|&&l| l >= blocks) {
                return refuse(
                    "skip_layer_guidance.layers",
                    format!(
                        "block {l} does not exist: this model's transformer has {blocks} (0 to {})",
                        blocks - 1
                    ),
                );
            }
        }
        if !req.embeddings.is_empty() {
            return refuse("prompt", "textual-inversion embeddings do not apply to SD3 models".into());
        }
        let strength = req.init_image.is_some().then_some(req.strength);
        flow_sigmas(config, req.steps, strength, "steps")?.ok_or_else(|| ValidationError {
            field: "denoising_strength",
            message: format!("{} leaves no step of {} to run", req.strength, req.steps),
        })
    }
}

/// A standalone VAE must be one stable-diffusion.cpp can put in place of the model's own: read as the candle
/// engine reads VAE files (so both accept the same ones), with the latent channels and widths of the model's
/// family, which sd.cpp's autoencoder has built in (4 channels for SD 1.x, 2.x and XL, 16 for SD3). sd.cpp itself
/// would take a file of other tensors for a VAE that changes nothing, and a misshapen one only fails at the first
/// decode.
fn check_vae(path: &std::path::Path, sd3: bool) -> Result<(), LoadError> {
    let fail = |message: String| LoadError::Vae { path: path.to_path_buf(), message };
    let vae = sdhive_checkpoint::inspect_vae_file(path).map_err(|e| fail(e.to_string()))?;
    let (channels, family) =
        if sd3 { (16, "SD3 and SD3.5") } else { (4, "Stable Diffusion 1.x, 2.x and XL") };
    if vae.latent_channels != channels || vae.block_out_channels != [128, 256, 512, 512] {
        return Err(fail(format!(
            "an autoencoder with {} latent channels and widths {:?}; {family} models take {channels} and \
             [128, 256, 512, 512]",
            vae.latent_channels, vae.block_out_channels
        )));
    }
    Ok(())
}

fn c_text(field: &'static str, s: &str) -> Result<CString, EngineError> {
    CString::new(s).map_err(|_| {
        EngineError::Invalid(ValidationError { field, message: "must not contain NUL characters".into() })
    })
}

/// An image as sd.cpp reads it; borrows `data`, which must outlive the call.
fn sd_image(width: u32, height: u32, channels: u32, data: &[u8]) -> sys::sd_image_t {
    sys::sd_image_t { width, height, channel: channels, data: data.as_ptr().cast_mut() }
}

const EMPTY_IMAGE: sys::sd_image_t =
    sys::sd_image_t { width: 0, height: 0, channel: 0, data: std::ptr::null_mut() };

impl Engine for SdCppEngine {
    fn info(&self) -> EngineInfo {
        self.info.clone()
    }

    fn generate(
        &mut self,
        req: &GenerateRequest,
        progress: &mut dyn FnMut(&Progress) -> Control,
    ) -> Result<GenerateOutput, EngineError> {
        req.validate(&self.limits)?;
        let (width, height) = req.output_size((self.model.native_width, self.model.native_height));
        // SD3: the schedule handed to sd.cpp (read through `custom_sigmas`; alive until the end of this call).
        let (method, sd3_sigmas) = self.check(req, width, height)?;
        networks::check_embeddings(&req.embeddings)?;
        let loras = self.loras.check(&req.loras, &self.model.family, self.mmdit)?;
        let base_seed = req.seed.unwrap_or_else(random_seed);
        let last_seed = base_seed.checked_add(u64::from(req.n.saturating_sub(1)));
        // sd.cpp takes a signed seed and treats negative values as "pick one at random".
        if last_seed.is_none_or(|s| s > i64::MAX as u64) {
            return Err(EngineError::Invalid(ValidationError {
                field: "seed",
                message: format!("must be below 2^63 on the stable-diffusion.cpp engine, got {base_seed}"),
            }));
        }
        // Hires fix runs inside sd.cpp's generate_image; its second pass is the largest UNet call.
        let mut hires =
            req.hires.as_ref().map(|h| check_hires(h, req, width, height, &self.limits)).transpose()?;
        if let (Some(h), Some(config)) = (hires.as_mut(), &self.flow) {
            sd3_hires(h, req, config)?;
        }
        let (plan_w, plan_h) = hires.as_ref().map_or((width, height), |h| h.output);
        let plan = self.shape.plan(
            plan_w,
            plan_h,
            IMAGES_PER_UNET_CALL,
            budgeted_free(
                device::find(&self.plan_device).map(|d| d.memory_free_bytes),
                self.memory_budget,
                self.shape.weights_bytes,
            ),
            false,
            true,
        )?;
        // The `<lora:…>` tags are the job's LoRAs (in `req.loras` now), not words of the prompt; the infotext keeps
        // them, as A1111's does.
        let prompt = c_text("prompt", &strip_networks(&req.prompt))?;
        let negative = c_text("negative_prompt", &req.negative_prompt)?;
        // sd.cpp reads init image and mask at the output size; A1111's "just resize" makes them fit.
        let init: Option<RgbImage> = req.init_image.as_ref().map(|i| fit_rgb(i, width, height));
        let mask: Option<GrayImage> = req.mask.as_ref().map(|m| fit_gray(m, width, height));
        // Borrows `loras`' paths, alive until the end of this call.
        let sd_loras = networks::sd_loras(&loras);
        // Read by sd.cpp through the SLG parameters; alive until the end of this call.
        let slg = req.skip_layer_guidance.as_ref().and_then(|g| sd3_slg(g, req.steps));

        let mut images = Vec::with_capacity(req.n as usize);
        for index in 0..req.n {
            let seed = base_seed + u64::from(index);
            // sd.cpp counts each hires pass from 1; reported as one run of steps over both.
            let second = hires.as_ref().map_or(0, |h| h.second_pass_steps(req.steps));
            let (mut offset, mut last) = (0, 0);
            let mut report = |step: u32, steps: u32| {
                if second > 0 && step <= last {
                    offset += last;
                }
                last = step;
                let total = if second > 0 && offset > 0 { offset + steps } else { steps + second };
                let p = Progress {
                    image: index,
                    images: req.n,
                    step: offset + step,
                    steps: total,
                    preview: None,
                };
                progress(&p) == Control::Continue
            };
            let ctx = self.ctx.0.as_ptr();
            // SAFETY: `ctx` is ours and live.
            let automatic = unsafe { sys::sd_get_default_scheduler(ctx, method) };
            let scheduler = params::scheduler(req.schedule, automatic);
            let mut p = image_params(&prompt, &negative, (width, height), seed, method, scheduler, req.steps);
            p.clip_skip = req.clip_skip as i32;
            p.strength = req.strength;
            // SD3: diffusers' sigmas from the job's first step on. Handed over whole, with strength 1: sd.cpp
            // would otherwise cut an img2img schedule A1111's way (one step more than diffusers runs). CLIP's
            // penultimate layer is A1111's clip skip 1 (diffusers' `clip_skip=None`); CFG at or below 1 is none.
            if self.flow.is_some() {
                p.sample_params.custom_sigmas = sd3_sigmas.as_ptr().cast_mut();
                p.sample_params.custom_sigmas_count = sd3_sigmas.len() as i32;
                p.sample_params.sample_steps = sd3_sigmas.len() as i32 - 1;
                p.strength = 1.0;
                p.clip_skip = req.clip_skip as i32 + 1;
                if let Some((layers, start, stop, scale)) = &slg {
                    p.sample_params.guidance.slg = sys::sd_slg_params_t {
                        layers: layers.as_ptr().cast_mut(),
                        layer_count: layers.len(),
                        layer_start: *start,
                        layer_end: *stop,
                        scale: *scale,
                    };
                }
            }
            p.init_image = init.as_ref().map_or(EMPTY_IMAGE, |i| sd_image(i.width, i.height, 3, &i.data));
            p.mask_image = mask.as_ref().map_or(EMPTY_IMAGE, |m| sd_image(m.width, m.height, 1, &m.data));
            p.sample_params.guidance.txt_cfg =
                if self.flow.is_some() && req.cfg_scale <= 1.0 { 1.0 } else { req.cfg_scale };
            p.vae_tiling_params.enabled = plan.vae_tiling;
            // Every image passes the set, empty included: sd.cpp applies what each call names and nothing else.
            if let Some(h) = &hires {
                p.hires = h.params();
            }
            p.loras = if sd_loras.is_empty() { std::ptr::null() } else { sd_loras.as_ptr() };
            p.lora_count = sd_loras.len() as u32;
            // SAFETY: every pointer in `p` (prompts, images, LoRA paths) borrows data alive for this whole call;
            // `ctx` is ours, used through `&mut self`.
            let image = match unsafe { generate_one(ctx, &p, (second > 0).then_some(second), &mut report) } {
                Err(EngineError::Cancelled { .. }) => return Err(EngineError::Cancelled { done: images }),
                other => other?,
            };
            let image = image.ok_or_else(|| {
                EngineError::Failed(
                    "stable-diffusion.cpp returned no image (its log at RUST_LOG=sdcpp=info says why)".into(),
                )
            })?;
            // A1111's `Size` is the first pass's; the hires size follows from the `Hires` fields.
            let ctx = InfotextContext {
                seed,
                width,
                height,
                model: &self.info.model,
                version: concat!("sdhive ", env!("CARGO_PKG_VERSION"), " (stable-diffusion.cpp)"),
            };
            images.push(GeneratedImage { image, seed, infotext: infotext(req, &ctx) });
        }
        Ok(GenerateOutput { images })
    }

    fn upscale(&mut self, req: &UpscaleRequest) -> Result<Vec<RgbImage>, EngineError> {
        // SAFETY: a plain query of the machine.
        let threads = unsafe { sys::sd_get_num_physical_cores() };
        self.upscalers.extras(req, &self.plan_device, threads)
    }
}

/// Skip-layer guidance in sd.cpp's terms: the blocks, and a window that runs the extra pass at exactly diffusers'
/// steps (`n·start < i < n·stop`, `i` from 0). sd.cpp runs it at its 1-based step `s` when
/// `int(start'·S) < s < int(stop'·S)` with `S` its sigma count (n + 1), so the window is given as the midpoints
/// `start' = (first + 0.5)/S` and `stop' = (last + 2.5)/S`. `None` when no step is in diffusers' window.
fn sd3_slg(g: &SkipLayerGuidance, steps: u32) -> Option<(Vec<i32>, f32, f32, f32)> {
    let n = steps as usize;
    let first = (0..n).find(|&i| g.active_at(i, n))?;
    let last = (0..n).rev().find(|&i| g.active_at(i, n))?;
    let s = (n + 1) as f32;
    let layers = g.layers.iter().map(|&l| l as i32).collect();
    Some((layers, (first as f32 + 0.5) / s, (last as f32 + 2.5) / s, g.scale as f32))
}

/// A hires fix as sd.cpp runs it: its upscaler, the model file, the output size and the second pass's steps.
struct SdHires {
    upscaler: sys::sd_hires_upscaler_t,
    model_path: Option<CString>,
    output: (u32, u32),
    steps: u32,
    denoising_strength: f32,
    /// SD3: the second pass's sigmas, diffusers' img2img schedule from its first step on (empty otherwise).
    sigmas: Vec<f32>,
}

impl SdHires {
    /// The steps sd.cpp's second pass runs (`make_hires_sigma_schedule`): the schedule stretched to
    /// `steps / strength` steps, of which it keeps the last `int(stretched × strength) + 1`, in C's float arithmetic.
    fn second_pass_steps(&self, first_pass_steps: u32) -> u32 {
        if !self.sigmas.is_empty() {
            return self.sigmas.len() as u32 - 1;
        }
        let steps = if self.steps == 0 { first_pass_steps } else { self.steps }.max(1) as f32;
        let strength = self.denoising_strength.clamp(0.0001, 1.0);
        let stretched = ((steps / strength) as i32).max(1);
        let kept = ((stretched as f32 * strength) as i32).min(stretched - 1);
        (kept + 1) as u32
    }

    /// Borrows `model_path`: `self` must outlive the generate call.
    fn params(&self) -> sys::sd_hires_params_t {
        let mut h: sys::sd_hires_params_t = unsafe {
            let mut h = std::mem::MaybeUninit::<sys::sd_hires_params_t>::uninit();
            // SAFETY: sd_hires_params_init writes every field.
            sys::sd_hires_params_init(h.as_mut_ptr());
            h.assume_init()
        };
        h.enabled = true;
        h.upscaler = self.upscaler;
        h.model_path = self.model_path.as_ref().map_or(std::ptr::null(), |p| p.as_ptr());
        h.target_width = self.output.0 as i32;
        h.target_height = self.output.1 as i32;
        h.steps = self.steps as i32;
        h.denoising_strength = self.denoising_strength;
        if !self.sigmas.is_empty() {
            h.custom_sigmas = self.sigmas.as_ptr().cast_mut();
            h.custom_sigmas_count = self.sigmas.len() as i32;
        }
        h
    }
}

/// An SD3 hires fix as the candle engine composes it from diffusers: the first pass's latents upscaled (a Latent
/// mode), or decoded, enlarged by an image upscaler (Lanczos, Nearest, an ESRGAN model) and encoded again, then
/// `StableDiffusion3Img2ImgPipeline` at the hires size (its sigmas from `int(n − n·strength)` on, handed to sd.cpp's
/// second pass; `n` the hires steps or the first pass's). Skip-layer guidance (which would guide both passes here;
/// the candle engine guides the first only) is refused.
fn sd3_hires(
    h: &mut SdHires,
    req: &GenerateRequest,
    config: &sdhive_schedulers::FlowMatchConfig,
) -> Result<(), ValidationError> {
    let refuse = |field: &'static str, message: String| Err(ValidationError { field, message });
    let (w, hh) = h.output;
    if w % 16 != 0 || hh % 16 != 0 {
        return refuse(
            "hr_scale",
            format!("the hires size {w}x{hh} must be a multiple of 16 on each side for SD3"),
        );
    }
    if req.skip_layer_guidance.is_some() {
        return refuse(
            "skip_layer_guidance",
            "with hires fix on SD3 it is not available on the stable-diffusion.cpp engine (it would guide the \
             second pass too; the candle engine guides the first only)"
                .into(),
        );
    }
    let steps = if h.steps == 0 { req.steps } else { h.steps };
    h.sigmas =
        flow_sigmas(config, steps, Some(h.denoising_strength), "hr_second_pass_steps")?.ok_or_else(|| {
            ValidationError {
                field: "denoising_strength",
                message: format!("{} leaves no hires step of {steps} to run", h.denoising_strength),
            }
        })?;
    Ok(())
}

/// diffusers' flow-matching sigmas for `steps` steps (with the final 0), from the step an img2img of `strength`
/// starts at as diffusers' img2img pipeline starts it (`int(n − n·strength)`; `None`: text to image, all of
/// them): the schedule handed to sd.cpp. `None` when the strength leaves no step to run; a schedule the config
/// cannot make is refused naming `field`.
fn flow_sigmas(
    config: &sdhive_schedulers::FlowMatchConfig,
    steps: u32,
    strength: Option<f32>,
    field: &'static str,
) -> Result<Option<Vec<f32>>, ValidationError> {
    use sdhive_schedulers::FlowMatchEulerDiscrete;
    let steps = steps as usize;
    let schedule = FlowMatchEulerDiscrete::new(config, steps)
        .map_err(|e| ValidationError { field, message: e.to_string() })?;
    let start =
        strength.map_or(0, |s| FlowMatchEulerDiscrete::img2img_start(steps, sdhive_engine::decimal_f64(s)));
    Ok((start < steps).then(|| schedule.sigmas()[start..].to_vec()))
}

/// What of A1111's hires fix sd.cpp can run: one sampler, prompt and CFG for both passes, and no crop.
fn check_hires(
    h: &HiresFix,
    req: &GenerateRequest,
    width: u32,
    height: u32,
    limits: &Limits,
) -> Result<SdHires, EngineError> {
    let target = h.validate(width, height, limits)?;
    let refuse = |field: &'static str, what: &str| {
        EngineError::Invalid(ValidationError {
            field,
            message: format!(
                "stable-diffusion.cpp runs the second pass with the first pass's {what}; leave it unset or equal"
            ),
        })
    };
    if h.sampler.is_some_and(|s| s != req.sampler) {
        return Err(refuse("hr_sampler_name", "sampler"));
    }
    if h.schedule.is_some_and(|s| s != req.schedule) {
        return Err(refuse("hr_scheduler", "scheduler"));
    }
    if h.cfg_scale.is_some_and(|c| c != req.cfg_scale) {
        return Err(refuse("hr_cfg", "CFG scale"));
    }
    if h.prompt.as_ref().is_some_and(|p| *p != req.prompt) {
        return Err(refuse("hr_prompt", "prompt"));
    }
    if h.negative_prompt.as_ref().is_some_and(|p| *p != req.negative_prompt) {
        return Err(refuse("hr_negative_prompt", "negative prompt"));
    }
    if target.output != target.upscaled {
        return Err(EngineError::Invalid(ValidationError {
            field: "hr_resize_x",
            message:
                "stable-diffusion.cpp resizes to the given box without cropping; give one side, or a box \
                      of the first pass's aspect"
                    .into(),
        }));
    }
    use sys::sd_hires_upscaler_t as U;
    let (upscaler, model_path) = match &h.upscaler {
        HiresUpscaler::Latent(mode) => (
            match mode {
                LatentMode::Bilinear => U::SD_HIRES_UPSCALER_LATENT,
                LatentMode::BilinearAntialiased => U::SD_HIRES_UPSCALER_LATENT_ANTIALIASED,
                LatentMode::Bicubic => U::SD_HIRES_UPSCALER_LATENT_BICUBIC,
                LatentMode::BicubicAntialiased => U::SD_HIRES_UPSCALER_LATENT_BICUBIC_ANTIALIASED,
                LatentMode::Nearest => U::SD_HIRES_UPSCALER_LATENT_NEAREST,
                LatentMode::NearestExact => U::SD_HIRES_UPSCALER_LATENT_NEAREST_EXACT,
            },
            None,
        ),
        // sd.cpp's "none" turns hires off; A1111's None is a Lanczos resize.
        HiresUpscaler::None | HiresUpscaler::Lanczos => (U::SD_HIRES_UPSCALER_LANCZOS, None),
        HiresUpscaler::Nearest => (U::SD_HIRES_UPSCALER_NEAREST, None),
        HiresUpscaler::Model { path, .. } => {
            let text = path.to_str().ok_or_else(|| {
                EngineError::Invalid(ValidationError {
                    field: "hr_upscaler",
                    message: format!("the upscaler's path is not UTF-8: {}", path.display()),
                })
            })?;
            (U::SD_HIRES_UPSCALER_MODEL, Some(c_text("hr_upscaler", text)?))
        }
    };
    Ok(SdHires {
        upscaler,
        model_path,
        output: target.output,
        steps: h.steps,
        denoising_strength: h.denoising_strength,
        sigmas: Vec::new(),
    })
}

/// sd.cpp's parameters for one text-to-image image, guidance off; the caller sets the rest. The prompts are
/// borrowed: they must outlive every use of the result.
fn image_params(
    prompt: &CStr,
    negative: &CStr,
    (width, height): (u32, u32),
    seed: u64,
    method: sys::sample_method_t,
    scheduler: sys::scheduler_t,
    steps: u32,
) -> sys::sd_img_gen_params_t {
    // SAFETY: sd_img_gen_params_init fills every field of the zeroed struct.
    let mut p = unsafe {
        let mut p: sys::sd_img_gen_params_t = std::mem::zeroed();
        sys::sd_img_gen_params_init(&mut p);
        p
    };
    p.prompt = prompt.as_ptr();
    p.negative_prompt = negative.as_ptr();
    p.width = width as i32;
    p.height = height as i32;
    p.seed = seed as i64;
    p.batch_count = 1;
    p.sample_params.sample_method = method;
    p.sample_params.scheduler = scheduler;
    p.sample_params.sample_steps = steps as i32;
    p.sample_params.guidance.txt_cfg = 1.0;
    p
}

/// One image of batch 1 through the shim: the image (`None` when sd.cpp made none; its log says why), or how the
/// job ended instead.
///
/// # Safety
/// As for [`callbacks::generate`].
unsafe fn generate_one(
    ctx: *mut sys::sd_ctx_t,
    p: &sys::sd_img_gen_params_t,
    second_pass: Option<u32>,
    report: &mut dyn FnMut(u32, u32) -> bool,
) -> Result<Option<RgbImage>, EngineError> {
    // SAFETY: the caller's contract; the shim passes on what generate_image returned for batch_count 1.
    match unsafe { callbacks::generate(ctx, p, second_pass, report) } {
        Generated::Images(out) => Ok(unsafe { take_image(out) }),
        Generated::Stopped => Err(EngineError::Cancelled { done: Vec::new() }),
        Generated::Threw(message) => {
            Err(EngineError::Failed(format!("stable-diffusion.cpp threw: {message}")))
        }
    }
}

/// One 64×64 image in one Euler step without guidance: every module computes once.
fn warm_up(ctx: *mut sys::sd_ctx_t) -> Result<(), EngineError> {
    let euler = sys::sample_method_t::EULER_SAMPLE_METHOD;
    // SAFETY: `ctx` is live and ours.
    let scheduler = unsafe { sys::sd_get_default_scheduler(ctx, euler) };
    let p = image_params(c"", c"", (64, 64), 0, euler, scheduler, 1);
    // SAFETY: `p` borrows static prompts; `ctx` is live and used by no one else during load.
    let image = unsafe { generate_one(ctx, &p, None, &mut |_, _| true) }?;
    image.map(|_| ()).ok_or_else(|| EngineError::Failed("no image".into()))
}

fn fit_rgb(img: &RgbImage, width: u32, height: u32) -> RgbImage {
    if (img.width, img.height) == (width, height) {
        img.clone()
    } else {
        img.resized(width, height)
    }
}

fn fit_gray(img: &GrayImage, width: u32, height: u32) -> GrayImage {
    if (img.width, img.height) == (width, height) {
        img.clone()
    } else {
        img.resized(width, height)
    }
}

/// Copies the one RGB image of a batch of 1 and frees the array.
///
/// # Safety
/// `out` is null or what generate_image returned for batch_count 1.
unsafe fn take_image(out: *mut sys::sd_image_t) -> Option<RgbImage> {
    if out.is_null() {
        return None;
    }
    // SAFETY: per the contract, `out` points at one sd_image_t whose data holds width·height·channel bytes.
    let image = unsafe {
        let img = &*out;
        let n = img.width as usize * img.height as usize * img.channel as usize;
        let result = if img.data.is_null() || img.channel != 3 || n == 0 {
            None
        } else {
            let data = std::slice::from_raw_parts(img.data, n).to_vec();
            Some(RgbImage { width: img.width, height: img.height, data })
        };
        sys::free_sd_images(out, 1);
        result
    };
    image
}

#[cfg(test)]
mod tests {
    use super::*;

    /// sd.cpp's test (guidance.cpp, `SkipLayerGuidance::is_enabled_for_step`) at its 1-based step of an Euler run.
    fn sdcpp_runs(window: &(Vec<i32>, f32, f32, f32), steps: usize) -> Vec<usize> {
        let s = (steps + 1) as f32;
        let (lo, hi) = ((window.1 * s) as i32, (window.2 * s) as i32);
        (0..steps).filter(|&i| lo < i as i32 + 1 && (i as i32 + 1) < hi).collect()
    }

    #[test]
    fn skip_layer_guidance_runs_at_diffusers_steps_in_sdcpp() {
        for steps in 1..=60 {
            for (start, stop) in [(0.01, 0.2), (0.0, 1.0), (0.01, 0.7), (0.25, 0.5), (0.3, 0.31), (0.5, 0.5)]
            {
                let g = SkipLayerGuidance { start, stop, ..SkipLayerGuidance::with_layers(vec![7, 8, 9]) };
                let want: Vec<usize> = (0..steps).filter(|&i| g.active_at(i, steps)).collect();
                match sd3_slg(&g, steps as u32) {
                    Some(window) => {
                        assert_eq!(sdcpp_runs(&window, steps), want, "{steps} steps, {start}..{stop}");
                        assert_eq!((window.0.as_slice(), window.3), (&[7, 8, 9][..], 2.8));
                    }
                    None => assert!(want.is_empty(), "{steps} steps, {start}..{stop}: {want:?}"),
                }
            }
        }
    }
}
