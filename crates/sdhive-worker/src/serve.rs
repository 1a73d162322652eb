//! The `serve` subcommand: its flags (each also an environment variable, for containers), turning them into the
//! server's configuration, opening the device up front (a wrong `--device` fails before anything listens),
//! scanning the model library, and handing the first model's load to the server, which runs it while `/health`
//! already answers; later switches go through the same engine factory.

use crate::cli::{DTypeArg, PreviewArg};
use crate::engine::EngineOptions;
use anyhow::Context;
use clap::Args;
use sdhive_engine::{Limits, Placement};
use sdhive_modelsource::ResolveOptions;
use sdhive_protocol::DeviceDescription;
use sdhive_server::{LibraryStartup, MemoryProbe, ModelLibrary, RegistrationConfig, ServerConfig};
use shared_worker::Backend;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// The model to load first: a diffusers folder, a .safetensors checkpoint, a Hugging Face repo id
    /// `org/name[@revision]`, or a name from the models dirs; default: the models dirs' first checkpoint.
    #[arg(long, short = 'm', env = "MODEL_PATH", value_name = "MODEL")]
    pub model: Option<String>,

    /// A folder of checkpoints (diffusers folders, .safetensors), scanned recursively; requests pick among
    /// them by name. Also a model root. Repeatable; the variable takes a comma-separated list.
    #[arg(long = "models-dir", env = "MODELS_DIRS", value_name = "DIR", value_delimiter = ',')]
    pub models_dirs: Vec<PathBuf>,

    /// A folder of standalone VAE files (A1111's `sd_vae`); a `VAE` folder inside a models dir counts too.
    #[arg(long = "vae-dir", env = "VAE_DIRS", value_name = "DIR", value_delimiter = ',')]
    pub vae_dirs: Vec<PathBuf>,

    /// A folder of LoRA / LyCORIS .safetensors files (`<lora:name:weight>` in prompts); a `Lora` or `LyCORIS`
    /// folder inside a models dir counts too. Repeatable; the variable takes a comma-separated list.
    #[arg(long = "lora-dir", env = "LORA_DIRS", value_name = "DIR", value_delimiter = ',')]
    pub lora_dirs: Vec<PathBuf>,

    /// A folder of textual-inversion embeddings (.safetensors), used by name in prompts; an `embeddings` folder
    /// inside a models dir counts too. Repeatable; the variable takes a comma-separated list.
    #[arg(long = "embeddings-dir", env = "EMBEDDINGS_DIRS", value_name = "DIR", value_delimiter = ',')]
    pub embeddings_dirs: Vec<PathBuf>,

    /// A folder of upscaler models (ESRGAN / Real-ESRGAN / SRVGG .safetensors) for hires fix and the extras; an
    /// `ESRGAN`, `RealESRGAN` or `upscale_models` folder inside a models dir counts too. Repeatable; the variable
    /// takes a comma-separated list.
    #[arg(long = "upscaler-dir", env = "UPSCALER_DIRS", value_name = "DIR", value_delimiter = ',')]
    pub upscaler_dirs: Vec<PathBuf>,

    /// Recently used checkpoints kept in host memory, so switching back only uploads (0: none). Entries are
    /// dropped early while the machine is short of memory.
    #[arg(long, env = "CHECKPOINT_CACHE", default_value_t = 2)]
    pub checkpoint_cache: usize,

    /// Where checkpoint hashes are cached (by path, size and mtime); default ~/.cache/sdhive/hashes.json.
    #[arg(long, env = "HASH_CACHE", value_name = "FILE")]
    pub hash_cache: Option<PathBuf>,

    /// Address to listen on; loopback unless you mean to expose the worker.
    #[arg(long, env = "HOST", default_value = "127.0.0.1")]
    pub host: String,

    /// Port to listen on; 0 picks a free one (printed, and sent to the hive).
    #[arg(long, env = "PORT", default_value_t = 7860)]
    pub port: u16,

    /// URL the hive uses to reach this worker; default http://HOST:PORT as bound.
    #[arg(long, env = "PUBLIC_URL", value_name = "URL")]
    pub public_url: Option<String>,

    /// This worker's name towards the hive; default HOSTNAME-BACKEND-DEVICE-PID.
    #[arg(long, env = "WORKER_ID")]
    pub worker_id: Option<String>,

    /// The hive's registration endpoint; without it the worker runs standalone.
    #[arg(long, env = "CALLBACK_URL", value_name = "URL")]
    pub callback_url: Option<String>,

    /// Bearer token sent to the hive.
    #[arg(long, env = "WORKER_TOKEN", hide_env_values = true)]
    pub token: Option<String>,

    /// Require `Authorization: Bearer KEY` on every route but /health.
    #[arg(long, env = "API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,

    /// A1111's HTTP Basic credentials, `user:password[,user2:password2]`, required on every route but /health
    /// (with --api-key too, either credential is accepted).
    #[arg(long, env = "API_AUTH", hide_env_values = true, value_name = "USER:PASSWORD[,…]")]
    pub api_auth: Option<String>,

    /// A1111's prompt styles: a styles.csv (`name,prompt,negative_prompt`) or a folder of .csv files, read on each
    /// use; requests name styles in `styles`.
    #[arg(long, env = "STYLES_FILE", value_name = "PATH")]
    pub styles_file: Option<PathBuf>,

    /// Device index on this binary's backend.
    #[arg(long, env = "DEVICE", default_value_t = 0)]
    pub device: usize,

    /// Weight and activation precision; default: f32 on CPU, f16 on GPUs.
    #[arg(long, env = "DTYPE", value_enum)]
    pub dtype: Option<DTypeArg>,

    /// SD3/SD3.5: leave the T5 text encoder out (its context is zeros, as diffusers' `text_encoder_3=None`;
    /// saves about 9 GB in f16 for T5-XXL at some cost in prompt following).
    #[arg(long, env = "NO_T5")]
    pub no_t5: bool,

    /// Per-module devices, e.g. `te=cpu,unet=cuda0,vae=cuda0` (modules: unet, te, vae; devices: cpu or this
    /// binary's backend with an index).
    #[arg(long, env = "PLACEMENT", default_value = "")]
    pub placement: String,

    /// Modules whose weights stay in host memory until used, e.g. `te,vae`.
    #[arg(long, env = "OFFLOAD", default_value = "")]
    pub offload: String,

    /// The most device memory jobs may be planned for, weights included (e.g. 8G, 512M); bigger jobs use VAE
    /// tiling and attention slicing, or are refused. Default: whatever the device has free.
    #[arg(long, env = "MEMORY_BUDGET", value_parser = crate::cli::parse_bytes)]
    pub memory_budget: Option<u64>,

    /// Jobs that may wait behind the running one; more are refused with 429.
    #[arg(long, env = "MAX_QUEUE", default_value_t = 64)]
    pub max_queue: usize,

    /// The most images of compatible queued generations (same model, LoRAs, size, steps, sampler) denoised
    /// together; 1 runs one job at a time (stable-diffusion.cpp always does). Above 1 a GPU worker runs a short
    /// batch of every size before it is ready (seconds), so no request meets a size's first, tuning step. Off by
    /// default: on an H200 a batch of 8 SD1.5 images takes 6.4× one image's time, and SDXL gains little
    /// (docs/benchmarks.md).
    #[arg(long, env = "MAX_BATCH", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub max_batch: u32,

    /// Live previews of jobs with `preview_every`: `taesd` decodes them with TAESD at the output size (its
    /// weights must be found: `VAE-taesd/` or `vae_approx/` `taesd_decoder.safetensors` and
    /// `taesdxl_decoder.safetensors`, or a `taesd`/`taesdxl` diffusers folder, in a models dir; else
    /// madebyollin/taesd and madebyollin/taesdxl in the Hugging Face cache), `latent` maps latents to RGB at 1/8
    /// of the size, `off` sends none; `auto`: TAESD on GPUs where found, else latent.
    #[arg(long, env = "PREVIEW", value_enum, default_value_t = PreviewArg::Auto)]
    pub preview: PreviewArg,

    /// How long finished results stay retrievable (e.g. 600s, 10m, 1h).
    #[arg(long, env = "JOB_TTL", default_value = "600s", value_parser = parse_duration)]
    pub job_ttl: Duration,

    /// On SIGTERM/SIGINT, how long the running job may finish before it is cancelled.
    #[arg(long, env = "SHUTDOWN_GRACE", default_value = "10s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,

    /// Only load local models inside this folder (repeatable; the variable takes a comma-separated list).
    #[arg(long = "model-root", env = "MODEL_ROOTS", value_name = "DIR", value_delimiter = ',')]
    pub model_roots: Vec<PathBuf>,

    /// Never download from the Hugging Face hub (also: HF_HUB_OFFLINE=1).
    #[arg(long, env = "OFFLINE")]
    pub offline: bool,

    #[arg(long, env = "MAX_WIDTH", default_value_t = 2048)]
    pub max_width: u32,

    #[arg(long, env = "MAX_HEIGHT", default_value_t = 2048)]
    pub max_height: u32,

    #[arg(long, env = "MAX_STEPS", default_value_t = 150)]
    pub max_steps: u32,

    /// Most images per request.
    #[arg(long, env = "MAX_N", default_value_t = 8)]
    pub max_n: u32,

    /// Longest prompt (and negative prompt), in characters.
    #[arg(long, env = "MAX_PROMPT_CHARS", default_value_t = 20_000)]
    pub max_prompt_chars: usize,

    /// Largest request body; base64 images count towards it.
    #[arg(long, env = "MAX_BODY_BYTES", default_value_t = 32 * 1024 * 1024)]
    pub max_body_bytes: usize,

    /// Largest uploaded image, in pixels, checked before decoding.
    #[arg(long, env = "MAX_IMAGE_PIXELS", default_value_t = 8192 * 8192)]
    pub max_image_pixels: u64,
}

/// `90`, `90s`, `500ms`, `10m`, `1h`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let value: f64 = number.parse().map_err(|_| format!("`{s}` is not a duration (e.g. 600s, 10m, 1h)"))?;
    let secs = match unit.trim() {
        "" | "s" => value,
        "ms" => value / 1000.0,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        other => return Err(format!("unknown unit `{other}` in `{s}` (use ms, s, m or h)")),
    };
    Duration::try_from_secs_f64(secs).map_err(|e| format!("`{s}`: {e}"))
}

/// The flags `GET /sdapi/v1/cmd-flags` shows besides what the server's config holds (A1111's names where it
/// has the flag); secrets are left out.
fn cmd_flags(args: &ServeArgs) -> serde_json::Map<String, serde_json::Value> {
    use serde_json::json;
    let paths = |list: &[PathBuf]| list.iter().map(|p| p.display().to_string()).collect::<Vec<_>>();
    let flags = json!({
        "vae_dir": args.vae_dirs.first().map(|p| p.display().to_string()),
        "vae_dirs": paths(&args.vae_dirs),
        "model_roots": paths(&args.model_roots),
        "esrgan_models_path": args.upscaler_dirs.first().map(|p| p.display().to_string()),
        "realesrgan_models_path": args.upscaler_dirs.first().map(|p| p.display().to_string()),
        "upscaler_dirs": paths(&args.upscaler_dirs),
        "checkpoint_cache": args.checkpoint_cache,
        "dtype": args.dtype.map(|d| format!("{d:?}").to_lowercase()),
        "no_half": args.dtype.is_some_and(|d| matches!(d, DTypeArg::F32)),
        "placement": args.placement,
        "offload": args.offload,
        "memory_budget": args.memory_budget,
        "preview": sdhive_engine::PreviewMode::from(args.preview).name(),
        "offline": args.offline,
        "callback_url": args.callback_url,
        "public_url": args.public_url,
    });
    match flags {
        serde_json::Value::Object(map) => map,
        _ => serde_json::Map::new(),
    }
}

fn default_worker_id(backend: Backend, device: usize) -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "worker".into());
    format!("{host}-{backend}{device}-{}", std::process::id())
}

/// What `serve` runs with, built from its flags: the server's configuration, the model library with its engine
/// factory and first model, and the hive link.
pub struct Prepared {
    pub config: ServerConfig,
    pub startup: LibraryStartup,
    pub registration: Option<RegistrationConfig>,
}

pub fn run(backend: Backend, args: &ServeArgs) -> anyhow::Result<()> {
    let Prepared { config, startup, registration } = prepare(backend, args)?;
    sdhive_server::run(&args.host, args.port, config, startup, registration, |addr| {
        // Scripts and the hive's supervisor wait for this exact line to learn the port.
        eprintln!("listening on http://{addr}");
    })
    .map_err(|e| {
        let hint = match &e {
            sdhive_server::ServeError::Bind { addr, .. } => {
                Some(format!("is another process using {addr}? pick another --port"))
            }
            _ => None,
        };
        let e = anyhow::Error::new(e);
        match hint {
            Some(hint) => e.context(hint),
            None => e,
        }
    })
}

/// Opens the device and scans the model library: everything `serve` does before it listens.
pub fn prepare(backend: Backend, args: &ServeArgs) -> anyhow::Result<Prepared> {
    if args.model.is_none() && args.models_dirs.is_empty() {
        anyhow::bail!("nothing to serve: pass --model MODEL or --models-dir DIR (or both)");
    }
    let placement = Placement::parse(&args.placement, &args.offload)?;
    let (device, info) = shared_worker::init(backend, args.device)
        .with_context(|| format!("cannot open --device {} on backend {backend}", args.device))?;
    let dtype = args.dtype.map(Into::into);
    let memory_budget = args.memory_budget;
    let limits = Limits {
        max_width: args.max_width,
        max_height: args.max_height,
        max_steps: args.max_steps,
        max_n: args.max_n,
        max_prompt_chars: args.max_prompt_chars,
    };
    let api_auth = sdhive_protocol::parse_api_auth(args.api_auth.as_deref().unwrap_or_default())
        .map_err(|e| anyhow::anyhow!("invalid --api-auth: {e}"))?;
    if let Some(path) = &args.styles_file {
        // Read once now so that a wrong path stops the worker before it listens; requests read it again.
        sdhive_catalog::styles::read_styles(path).context("cannot read --styles-file")?;
    }
    if args.callback_url.is_some()
        && !api_auth.is_empty()
        && args.api_key.as_deref().unwrap_or_default().is_empty()
    {
        tracing::warn!("--api-auth without --api-key: the hive authenticates with a bearer key and cannot reach this worker");
    }
    let probe_device = device.clone();
    let memory_probe = Some(MemoryProbe(Arc::new(move || shared_worker::memory(&probe_device))));
    let config = ServerConfig {
        limits: limits.clone(),
        max_queue: args.max_queue,
        max_batch: args.max_batch,
        gfx_targets: backend.gfx_targets(),
        preview: args.preview.into(),
        job_ttl: args.job_ttl,
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        max_body_bytes: args.max_body_bytes,
        model_name: args.model.clone().unwrap_or_default(),
        max_decode_pixels: args.max_image_pixels,
        shutdown_grace: args.shutdown_grace,
        worker_id: args.worker_id.clone().unwrap_or_else(|| default_worker_id(backend, args.device)),
        device: DeviceDescription {
            backend: backend.name().into(),
            index: info.index,
            name: info.name.clone(),
            memory_total_bytes: info.memory_total_bytes,
            memory_free_bytes: info.memory_free_bytes,
            driver: info.driver.clone(),
        },
        memory_probe,
        api_auth,
        styles_file: args.styles_file.clone(),
        cmd_flags: cmd_flags(args),
        ..ServerConfig::default()
    };
    let hash_cache = args.hash_cache.clone().or_else(sdhive_catalog::default_hash_cache);
    let networks = sdhive_catalog::NetworksConfig {
        lora_dirs: args.lora_dirs.clone(),
        embeddings_dirs: args.embeddings_dirs.clone(),
        models_dirs: args.models_dirs.clone(),
        hash_cache: hash_cache.clone(),
    };
    // Scanned here too so that a wrong folder stops the worker before it listens; the server scans again.
    sdhive_catalog::NetworkCatalog::scan(&networks).context("cannot read the LoRA / embeddings folders")?;
    let upscalers = sdhive_catalog::UpscalersConfig {
        upscaler_dirs: args.upscaler_dirs.clone(),
        models_dirs: args.models_dirs.clone(),
    };
    sdhive_catalog::UpscalerCatalog::scan(&upscalers).context("cannot read the upscaler folders")?;
    let config = ServerConfig { networks, upscalers, ..config };
    let registration = args.callback_url.as_ref().map(|url| {
        let mut reg = RegistrationConfig::new(url.clone(), args.token.clone());
        reg.base_url = args.public_url.as_ref().map(|u| u.trim_end_matches('/').to_string());
        reg
    });

    let env = ResolveOptions::from_env();
    let mut model_roots = args.model_roots.clone();
    if !model_roots.is_empty() || !args.models_dirs.is_empty() || !args.vae_dirs.is_empty() {
        // Models and VAE dirs confine like roots: with any of them given, nothing outside them all loads.
        model_roots.extend(args.models_dirs.iter().chain(&args.vae_dirs).cloned());
    }
    let resolve_opts = ResolveOptions { model_roots, offline: args.offline || env.offline, ..env };
    let catalog = sdhive_catalog::CatalogConfig {
        models_dirs: args.models_dirs.clone(),
        vae_dirs: args.vae_dirs.clone(),
        hash_cache,
    };
    let formats = crate::engine::checkpoint_formats(backend);
    let library = Arc::new(
        ModelLibrary::scan_loading(catalog, &formats, backend.engine().name())
            .context("cannot read the model library")?,
    );
    // A name from the library (`--model v1-5`) is as good as its path.
    let first = match &args.model {
        Some(arg) => Some(library.add_model_arg(arg)),
        None => library.first_checkpoint(),
    };
    if first.is_none() {
        tracing::warn!("no --model and no checkpoint in the models dirs: starting without a model");
    }
    let initial = first.map(|spec| library.with_selected_vae(spec));
    tracing::info!(device = %info.name, %placement, first = ?initial.as_ref().map(|s| &s.source), "serving");
    let previews = crate::preview::setup(
        backend,
        args.preview.into(),
        &args.models_dirs,
        &resolve_opts.hub_cache,
        &device,
        dtype,
    )?;
    let opts = EngineOptions { dtype, placement, limits, memory_budget, previews, no_t5: args.no_t5 };
    let factory =
        crate::engine::Factory::new(backend, device, info, opts, resolve_opts, args.checkpoint_cache);
    let initial_required = args.model.is_some();
    let startup = LibraryStartup { library, factory: Box::new(factory), initial, initial_required };
    Ok(Prepared { config, startup, registration })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("600s"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn serve_flags_parse_with_defaults() {
        let cli =
            Cli::try_parse_from(["sd-worker", "serve", "--model", "m", "--port", "0", "--model-root", "/a"])
                .unwrap();
        let Command::Serve(args) = cli.command else { panic!("expected serve") };
        assert_eq!((args.port, args.max_queue), (0, 64));
        if std::env::var_os("HOST").is_none() {
            assert_eq!(args.host, "127.0.0.1");
        }
        assert_eq!(args.job_ttl, Duration::from_secs(600));
        assert_eq!(args.model_roots, vec![PathBuf::from("/a")]);
        assert_eq!((args.max_width, args.max_steps, args.max_n), (2048, 150, 8));
        assert!(args.callback_url.is_none() && args.api_key.is_none());
        if std::env::var_os("API_AUTH").is_none() && std::env::var_os("STYLES_FILE").is_none() {
            assert!(args.api_auth.is_none() && args.styles_file.is_none());
        }
        let cli = Cli::try_parse_from([
            "sd-worker",
            "serve",
            "--model",
            "m",
            "--api-auth",
            "alice:pw,bob:pw2",
            "--styles-file",
            "/srv/styles.csv",
        ])
        .unwrap();
        let Command::Serve(args) = cli.command else { panic!("expected serve") };
        assert_eq!(args.api_auth.as_deref(), Some("alice:pw,bob:pw2"));
        assert_eq!(args.styles_file, Some(PathBuf::from("/srv/styles.csv")));
        assert_eq!(cmd_flags(&args)["vae_dirs"], serde_json::json!([]));
    }
}
