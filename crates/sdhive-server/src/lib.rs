//! The worker's HTTP serving layer, split as a request flows through it: `extract` and `validation` turn a body
//! into a checked [`GenerateRequest`](sdhive_engine::GenerateRequest), `jobs` queues it and keeps its state,
//! `infer` runs it on the one engine thread, and `routes` exposes it (native jobs, ops, OpenAI, A1111). `serve`
//! ties these to a listener, the model load, hive `registration` and graceful shutdown.

pub mod auth;
mod encoder;
pub mod error;
pub mod extract;
pub mod hires;
mod infer;
pub mod jobs;
mod locks;
pub mod metrics;
pub mod models;
pub mod networks;
pub mod png_info;
pub mod registration;
pub mod routes;
pub mod serve;
pub mod styles;
pub mod validation;

pub use error::ApiError;
pub use extract::ApiJson;
pub use jobs::{
    CancelOnDrop, FinishedImage, JobErrorView, JobManager, JobView, LookupError, RunError, SubmitError,
};
pub use metrics::Metrics;
pub use models::{ModelError, ModelLibrary, VaeChoice};
pub use networks::Networks;
pub use registration::RegistrationConfig;
pub use serve::{run, serve, shutdown_signal, EngineLoader, LibraryStartup, ServeError, Startup};

use axum::extract::DefaultBodyLimit;
use sdhive_engine::{Engine, EngineFactory, EngineInfo, Limits, ModelHost, ModelSpec};
use sdhive_protocol::{Capabilities, DeviceDescription};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// Reads a device's current memory as (total, free) bytes; called for `/v1/info` and every heartbeat.
#[derive(Clone)]
pub struct MemoryProbe(pub Arc<dyn Fn() -> (Option<u64>, Option<u64>) + Send + Sync>);

impl fmt::Debug for MemoryProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("MemoryProbe")
    }
}

/// Everything an operator configures about serving (the `serve` flags), minus where to listen.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub limits: Limits,
    /// Jobs waiting behind the running one; one more is refused with 429.
    pub max_queue: usize,
    /// The most images of compatible queued generations denoised together (`--max-batch`); 1 runs one job at a
    /// time.
    pub max_batch: u32,
    /// The AMD gfx targets a ROCm worker was built for (`capabilities.gfx_targets`); empty elsewhere.
    pub gfx_targets: Vec<String>,
    /// `--preview`: with `off` no engine makes previews and `capabilities.preview` is false.
    pub preview: sdhive_engine::PreviewMode,
    /// How long a finished job's result stays retrievable; afterwards its id answers 410.
    pub job_ttl: Duration,
    /// When set, every route but `/health` needs `Authorization: Bearer <key>` (or one of `api_auth`).
    pub api_key: Option<String>,
    pub max_body_bytes: usize,
    /// The model as the operator named it (`--model`); the engine's own name is in [`EngineInfo::model`].
    pub model_name: String,
    /// Cap on uploaded images (init images, masks), in pixels, checked before their pixels are allocated.
    pub max_decode_pixels: u64,
    /// On shutdown, how long the running job may go on before it is cancelled.
    pub shutdown_grace: Duration,
    pub worker_id: String,
    pub device: DeviceDescription,
    pub memory_probe: Option<MemoryProbe>,
    /// Expired job ids remembered (to answer 410 rather than 404); the oldest are forgotten first.
    pub max_tombstones: usize,
    pub version: String,
    /// LoRA and embeddings folders (`--lora-dir`, `--embeddings-dir`).
    pub networks: sdhive_catalog::NetworksConfig,
    /// Upscaler model folders (`--upscaler-dir`, and the models dirs' `ESRGAN`/`RealESRGAN` subfolders).
    pub upscalers: sdhive_catalog::UpscalersConfig,
    /// A1111's `--api-auth` users: HTTP Basic credentials accepted besides the bearer `api_key`.
    pub api_auth: sdhive_protocol::BasicUsers,
    /// A1111's `--styles-file`: a `styles.csv` or a folder of them (read on each use).
    pub styles_file: Option<std::path::PathBuf>,
    /// The worker's other effective flags (A1111's names where it has them, secrets left out), for
    /// `GET /sdapi/v1/cmd-flags`; what this config holds is added there.
    pub cmd_flags: serde_json::Map<String, serde_json::Value>,
    /// Where the server listens, once bound (`serve` fills it in).
    pub listen: Option<std::net::SocketAddr>,
}

impl ServerConfig {
    /// The credentials every route but `/health` needs: the bearer key and/or the Basic users.
    pub fn credentials(&self) -> sdhive_protocol::Credentials {
        sdhive_protocol::Credentials::new(self.api_key.clone(), self.api_auth.clone())
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            limits: Limits::default(),
            max_queue: 64,
            max_batch: 1,
            gfx_targets: Vec::new(),
            preview: sdhive_engine::PreviewMode::Auto,
            job_ttl: Duration::from_secs(600),
            api_key: None,
            max_body_bytes: 32 * 1024 * 1024,
            model_name: String::new(),
            max_decode_pixels: sdhive_engine::image_io::DEFAULT_MAX_DECODE_PIXELS,
            shutdown_grace: Duration::from_secs(10),
            worker_id: "worker".into(),
            device: DeviceDescription {
                backend: "cpu".into(),
                index: 0,
                name: "cpu".into(),
                memory_total_bytes: None,
                memory_free_bytes: None,
                driver: None,
            },
            memory_probe: None,
            max_tombstones: 10_000,
            version: env!("CARGO_PKG_VERSION").into(),
            networks: sdhive_catalog::NetworksConfig::default(),
            upscalers: sdhive_catalog::UpscalersConfig::default(),
            api_auth: sdhive_protocol::BasicUsers::default(),
            styles_file: None,
            cmd_flags: serde_json::Map::new(),
            listen: None,
        }
    }
}

/// What every handler gets. Cheap to clone: the job manager and config are shared.
#[derive(Clone)]
pub struct AppState {
    pub jobs: JobManager,
    pub config: Arc<ServerConfig>,
    pub library: Arc<ModelLibrary>,
    pub networks: Arc<Networks>,
    pub metrics: Arc<Metrics>,
    pub started_at: SystemTime,
}

/// The factory of a worker that serves one engine for life: it loads nothing else.
struct NoSwitching;

impl EngineFactory for NoSwitching {
    fn load(&mut self, spec: &ModelSpec) -> Result<Box<dyn Engine>, sdhive_engine::BoxError> {
        Err(format!("this worker serves one model and cannot load `{}`", spec.name).into())
    }
}

impl AppState {
    /// Starts the engine thread around an already loaded engine, which it serves for life, and returns the
    /// state the routes share.
    pub fn new(config: ServerConfig, engine: Box<dyn Engine>) -> AppState {
        let info = engine.info();
        let library = Arc::new(ModelLibrary::fixed(&config.model_name, &info));
        let spec = library.selected_checkpoint().unwrap_or_else(|| ModelSpec::new(info.model.clone(), ""));
        let host = ModelHost::with_engine(Box::new(NoSwitching), spec, engine);
        AppState::with_library(config, library, host)
    }

    /// Starts the engine thread around `host` (with or without a model loaded) over `library`.
    pub fn with_library(config: ServerConfig, library: Arc<ModelLibrary>, host: ModelHost) -> AppState {
        if let (Some(spec), Some(info)) = (host.current_model().cloned(), host.info()) {
            library.record_loaded(&spec, &info);
        }
        let networks = Arc::new(Networks::scan_or_empty(config.networks.clone()));
        let config = Arc::new(config);
        let metrics = Arc::new(Metrics::new());
        let jobs = JobManager::start(Arc::clone(&config), Arc::clone(&metrics), Arc::clone(&library), host);
        AppState { jobs, config, library, networks, metrics, started_at: SystemTime::now() }
    }

    /// The node's upscaler models, scanned now (a folder walk: files added since start are seen).
    pub fn upscaler_models(&self) -> Vec<sdhive_catalog::UpscalerFile> {
        match sdhive_catalog::UpscalerCatalog::scan(&self.config.upscalers) {
            Ok(c) => c.models,
            Err(e) => {
                tracing::warn!("cannot scan the upscaler folders: {e}");
                Vec::new()
            }
        }
    }

    /// An upscaler model by name, as a hires upscaler.
    pub fn upscaler_model(&self, name: &str) -> Option<sdhive_engine::HiresUpscaler> {
        let catalog = sdhive_catalog::UpscalerCatalog { models: self.upscaler_models(), refused: Vec::new() };
        catalog
            .find(name)
            .map(|f| sdhive_engine::HiresUpscaler::Model { name: f.name.clone(), path: f.path.clone() })
    }

    /// The text-encoder widths of the model a job will run on, for choosing the embeddings that fit it.
    pub fn text_widths(&self, model: &ModelSpec) -> Option<Vec<u64>> {
        let current = self.library.current();
        let loaded = current.as_ref().filter(|(spec, _)| spec.source == model.source).map(|(_, i)| i);
        // The loaded engine knows its encoders; a model not loaded yet is read from its files.
        if let Some(info) = loaded.filter(|i| !i.text_widths.is_empty()) {
            return Some(info.text_widths.iter().map(|&w| u64::from(w)).collect());
        }
        self.networks.text_widths(model, loaded.map(|i| i.family.as_str()))
    }

    /// Fills the request's LoRAs and embeddings (`Networks::resolve`) for a job on `model`. Blocks while a
    /// file is hashed for the first time.
    pub fn resolve_networks(
        &self,
        req: &mut sdhive_engine::GenerateRequest,
        loras: &[sdhive_protocol::LoraRequest],
        model: &ModelSpec,
    ) -> Result<(), sdhive_engine::ValidationError> {
        let widths = self.text_widths(model);
        self.networks.resolve(req, loras, widths.as_deref())
    }

    /// `resolve_networks` on a blocking thread, for async handlers.
    pub async fn resolve_networks_async(
        &self,
        mut req: sdhive_engine::GenerateRequest,
        loras: Vec<sdhive_protocol::LoraRequest>,
        model: ModelSpec,
    ) -> Result<sdhive_engine::GenerateRequest, ApiError> {
        let state = self.clone();
        tokio::task::spawn_blocking(move || state.resolve_networks(&mut req, &loras, &model).map(|()| req))
            .await
            .map_err(|e| ApiError::internal(format!("resolving the LoRAs failed: {e}")))?
            .map_err(ApiError::from)
    }

    /// The loaded engine's description (the last one's while none is loaded).
    pub fn info(&self) -> EngineInfo {
        self.library.info().unwrap_or_else(|| EngineInfo {
            backend: self.config.device.backend.clone(),
            device: self.config.device.name.clone(),
            ..EngineInfo::default()
        })
    }

    /// The device's memory now (falls back to what was known at start).
    pub fn device(&self) -> DeviceDescription {
        let mut device = self.config.device.clone();
        if let Some(probe) = &self.config.memory_probe {
            let (total, free) = (probe.0)();
            device.memory_total_bytes = total.or(device.memory_total_bytes);
            device.memory_free_bytes = free.or(device.memory_free_bytes);
        }
        device
    }

    /// How previews are made now: the loaded engine's decoder (`off` throughout with `--preview off`).
    pub fn preview_decoder(&self) -> sdhive_engine::PreviewDecoder {
        match self.config.preview {
            sdhive_engine::PreviewMode::Off => sdhive_engine::PreviewDecoder::Off,
            _ => self.info().preview,
        }
    }

    /// What this worker can run, for `/v1/info` and the hive registration.
    pub fn capabilities(&self) -> Capabilities {
        let limits = &self.config.limits;
        let info = self.info();
        Capabilities {
            engine: info.engine.clone(),
            dtype: info.dtype.clone(),
            samplers: info.samplers.clone(),
            schedulers: [sdhive_engine::Schedule::Automatic, sdhive_engine::Schedule::Karras]
                .iter()
                .map(|s| s.name().to_string())
                .collect(),
            native_width: info.native_width,
            native_height: info.native_height,
            max_width: limits.max_width,
            max_height: limits.max_height,
            max_steps: limits.max_steps,
            max_n: limits.max_n,
            max_prompt_chars: limits.max_prompt_chars,
            max_queue: self.config.max_queue,
            max_body_bytes: self.config.max_body_bytes,
            img2img: info.supports_img2img,
            inpaint: info.supports_inpaint,
            preview: self.preview_decoder() != sdhive_engine::PreviewDecoder::Off,
            max_batch: self.config.max_batch,
            gfx_targets: self.config.gfx_targets.clone(),
        }
    }
}

/// All route families over `state`, behind the credentials check and the body-size limit.
pub fn router(state: AppState) -> axum::Router {
    let body_limit = state.config.max_body_bytes;
    axum::Router::new()
        .merge(routes::native::router())
        .merge(routes::ops::router())
        .merge(routes::openai::router())
        .merge(routes::a1111::router())
        .merge(routes::a1111_info::router())
        .fallback(routes::not_found)
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth::require_credentials))
        // After the credentials layer: the page loads without a key and asks for it.
        .merge(sdhive_webui::router())
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

/// Unix seconds (fractional) of `t`; 0 for times before the epoch, which a sane clock never gives.
pub fn unix_secs(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}
