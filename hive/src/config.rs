//! The hive's effective configuration and how it is assembled: built-in defaults, then `hive.toml`, then
//! `SDHIVE_*` environment variables, then command-line flags — each layer overriding only what it sets.
//! `docs/operations.md` lists every key.

use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("environment variable {var}: {message}")]
    Env { var: String, message: String },
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// When the CPU gets a worker of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CpuPolicy {
    /// Only when no GPU worker is planned: a CPU worker beside GPU workers would mostly steal the cores that
    /// feed them.
    Auto,
    Always,
    Never,
}

impl std::str::FromStr for CpuPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(CpuPolicy::Auto),
            "always" => Ok(CpuPolicy::Always),
            "never" => Ok(CpuPolicy::Never),
            other => Err(format!("`{other}` is not one of auto, always, never")),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HiveConfig {
    /// Where the hive's HTTP API listens.
    pub bind: SocketAddr,
    /// Models to preload: worker *i* starts with `models[i % len]`; the others of the models dirs load on
    /// demand.
    pub models: Vec<String>,
    /// Passed to every worker as `--model-root`: local model paths must lie inside one of these.
    pub model_roots: Vec<PathBuf>,
    /// The model library: scanned by the hive (for listing and for resolving requests' model names) and passed
    /// to every worker as `--models-dir` (and `--model-root`), so any worker can load any of its checkpoints.
    pub models_dirs: Vec<PathBuf>,
    /// Standalone VAE folders, passed to every worker as `--vae-dir`.
    pub vae_dirs: Vec<PathBuf>,
    /// LoRA folders, passed to every worker as `--lora-dir`.
    pub lora_dirs: Vec<PathBuf>,
    /// Textual-inversion folders, passed to every worker as `--embeddings-dir`.
    pub embeddings_dirs: Vec<PathBuf>,
    /// Upscaler model folders (ESRGAN family), passed to every worker as `--upscaler-dir`.
    pub upscaler_dirs: Vec<PathBuf>,
    /// Where `sd-worker-<backend>` binaries live; default: beside the hive executable.
    pub workers_dir: Option<PathBuf>,
    /// Registration/heartbeat bearer token; a random one is generated when unset.
    pub token: Option<String>,
    /// Bearer key for the hive's API (admin routes always, job routes when set).
    pub api_key: Option<String>,
    /// A1111's `--api-auth`: `user:password[,user2:password2]` HTTP Basic credentials for the hive's API, accepted
    /// besides `api_key` (workers are never given them: the hive reaches its workers with `worker_api_key`).
    pub api_auth: Option<String>,
    /// A1111's prompt styles (a `styles.csv` or a folder of them): listed by the hive, passed to every worker as
    /// `--styles-file`.
    pub styles_file: Option<PathBuf>,
    /// Live previews, passed to every worker as `--preview`: `auto` (TAESD on GPUs where its weights are found,
    /// else latent), `taesd`, `latent` or `off`.
    pub preview: sdhive_engine::PreviewMode,
    /// SD3/SD3.5 without T5 (its part of the context zeros; about 9.5 GB less in bf16): passed to every worker as
    /// `--no-t5`.
    pub no_t5: bool,
    /// Key the workers require (`--api-key` of spawned workers, and what the hive sends to any worker that
    /// registers with `api_key_required`).
    pub worker_api_key: Option<String>,
    /// Use only this backend (`cuda`, `rocm`, `vulkan`, `metal`, `cpu`).
    pub backend: Option<String>,
    /// `backend:index` entries: serve that physical device with that backend.
    pub pin: Vec<String>,
    /// `backend:index` (that physical device) or `backend` (never use that backend).
    pub exclude: Vec<String>,
    /// AMD gfx targets ROCm must not serve (they get the Vulkan worker); default: the APUs known to crash under
    /// ROCm (`crate::amd::DEFAULT_DENY`).
    pub rocm_deny: Vec<String>,
    /// AMD gfx targets ROCm serves even when denied or missing from the ROCm worker's build (e.g. with
    /// `HSA_OVERRIDE_GFX_VERSION` set for it).
    pub rocm_allow: Vec<String>,
    pub cpu: CpuPolicy,
    /// How many workers the CPU gets when it serves (each uses every core; more than one helps only to keep
    /// several models loaded at once, and tests).
    pub cpu_workers: usize,
    /// The most workers one GPU runs: its planned worker plus those started on demand, when a request needs a
    /// model no worker has and none can switch to it, and the device's free memory fits that model. 1: none on
    /// demand.
    pub max_workers_per_device: usize,
    /// The most workers the CPU runs, `cpu_workers` included (unset: `cpu_workers`, so none on demand).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_cpu_workers: Option<usize>,
    /// A worker started on demand that had nothing to do for this long is stopped, so its memory returns.
    pub idle_worker_secs: f64,
    /// `backend:index=SIZE` (`cuda:0=40G`, `cpu:0=16G`): the memory the hive may fill on that device with its
    /// workers' models. On-demand workers start only while the estimates of the models its workers hold, plus
    /// the new one, fit; the device's measured free memory still applies. A device whose free memory is not
    /// detected (Vulkan, Metal) gets on-demand workers only with this.
    pub device_memory: Vec<String>,
    /// A worker whose loaded model still has requests waiting is not switched to another model, unless a
    /// request for that other model has waited this long (no thrashing, no starvation).
    pub model_switch_wait_secs: f64,
    /// Sent to workers in the registration answer; a worker silent for 2.5 intervals is unhealthy.
    pub heartbeat_interval_secs: u64,
    /// Jobs the hive holds while every worker is full; beyond it submissions get 429.
    pub queue_size: usize,
    /// Jobs in flight per worker (running + queued on the worker); more wait in the hive's queue, where they
    /// can still go to whichever worker frees up first.
    pub worker_slots: usize,
    /// First port for spawned workers (`base + n`); 0 lets each worker pick a free port.
    pub worker_port_base: u16,
    /// Restart delay after the n-th consecutive failure: `min(initial · 2^(n−1), max)`.
    pub restart_initial_secs: f64,
    pub restart_max_secs: f64,
    /// A child that stayed up this long counts as healthy again: the next failure starts the backoff over.
    pub restart_reset_secs: f64,
    /// This many failures within `crash_loop_window_secs` mark the worker `failed` (no more restarts).
    pub crash_loop_failures: u32,
    pub crash_loop_window_secs: f64,
    /// On SIGTERM: how long running jobs may finish before the workers are stopped.
    pub drain_grace_secs: f64,
    /// After SIGTERM to a worker: how long before SIGKILL.
    pub stop_grace_secs: f64,
    /// How long finished job results stay readable through the hive.
    pub job_ttl_secs: u64,
    /// Several hives as one (`[cluster]` in hive.toml): this hive as a gateway, or as a node under a parent.
    pub cluster: ClusterConfig,
}

/// A hive's place in a cluster (`docs/cluster.md`): a node hive registers with its parent as a
/// worker registers with a hive; a gateway runs no workers of its own and routes to the node hives that register.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// No local workers, whatever the node's devices: only registered node hives (and workers) serve.
    pub gateway: bool,
    /// The parent hive's URL (`http://gateway:7833`; `/v1/workers/register` is added when it names no path).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// The parent's registration token (its `token`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent_token: Option<String>,
    /// The id this hive registers under (default: the host name).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    /// How the parent reaches this hive (default `http://<bind>`; needed when binding all addresses).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advertise_url: Option<String>,
}

impl ClusterConfig {
    /// The parent's registration endpoint.
    pub fn parent_register_url(&self) -> Option<Result<reqwest::Url, String>> {
        let parent = self.parent.as_deref()?;
        let parsed = reqwest::Url::parse(parent.trim())
            .map_err(|e| format!("cluster.parent `{parent}` is not a URL: {e}"))
            .and_then(|mut url| {
                if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
                    return Err(format!("cluster.parent `{parent}` must be an http(s) URL with a host"));
                }
                if matches!(url.path(), "" | "/") {
                    url.set_path("/v1/workers/register");
                }
                Ok(url)
            });
        Some(parsed)
    }
}

impl Default for HiveConfig {
    fn default() -> Self {
        HiveConfig {
            bind: SocketAddr::from(([127, 0, 0, 1], 7833)),
            models: Vec::new(),
            model_roots: Vec::new(),
            models_dirs: Vec::new(),
            vae_dirs: Vec::new(),
            lora_dirs: Vec::new(),
            embeddings_dirs: Vec::new(),
            upscaler_dirs: Vec::new(),
            workers_dir: None,
            token: None,
            api_key: None,
            api_auth: None,
            styles_file: None,
            preview: sdhive_engine::PreviewMode::Auto,
            no_t5: false,
            worker_api_key: None,
            backend: None,
            pin: Vec::new(),
            exclude: Vec::new(),
            rocm_deny: crate::amd::DEFAULT_DENY.iter().map(|(gfx, _)| gfx.to_string()).collect(),
            rocm_allow: Vec::new(),
            cpu: CpuPolicy::Auto,
            cpu_workers: 1,
            max_workers_per_device: 2,
            max_cpu_workers: None,
            idle_worker_secs: 600.0,
            device_memory: Vec::new(),
            model_switch_wait_secs: 30.0,
            heartbeat_interval_secs: 5,
            queue_size: 64,
            worker_slots: 2,
            worker_port_base: 0,
            restart_initial_secs: 1.0,
            restart_max_secs: 60.0,
            restart_reset_secs: 60.0,
            crash_loop_failures: 5,
            crash_loop_window_secs: 300.0,
            drain_grace_secs: 30.0,
            stop_grace_secs: 15.0,
            job_ttl_secs: 600,
            cluster: ClusterConfig::default(),
        }
    }
}

/// Command-line values; `None`/empty leaves the lower layers alone.
#[derive(Debug, Clone, Default)]
pub struct CliOverrides {
    pub bind: Option<SocketAddr>,
    pub models: Vec<String>,
    pub model_roots: Vec<PathBuf>,
    pub models_dirs: Vec<PathBuf>,
    pub vae_dirs: Vec<PathBuf>,
    pub lora_dirs: Vec<PathBuf>,
    pub embeddings_dirs: Vec<PathBuf>,
    pub upscaler_dirs: Vec<PathBuf>,
    pub workers_dir: Option<PathBuf>,
    pub token: Option<String>,
    pub api_key: Option<String>,
    pub api_auth: Option<String>,
    pub styles_file: Option<PathBuf>,
    pub preview: Option<sdhive_engine::PreviewMode>,
    pub no_t5: bool,
    pub backend: Option<String>,
    pub pin: Vec<String>,
    pub exclude: Vec<String>,
    pub rocm_deny: Vec<String>,
    pub rocm_allow: Vec<String>,
    pub cpu: Option<CpuPolicy>,
    pub cpu_workers: Option<usize>,
    pub max_workers_per_device: Option<usize>,
    pub max_cpu_workers: Option<usize>,
    pub device_memory: Vec<String>,
    pub heartbeat_interval_secs: Option<u64>,
    pub queue_size: Option<usize>,
    pub worker_slots: Option<usize>,
    pub gateway: bool,
    pub parent: Option<String>,
    pub parent_token: Option<String>,
    pub node_id: Option<String>,
    pub advertise_url: Option<String>,
}

/// One `device_memory` entry: `backend:index=SIZE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    pub backend: shared_worker::Backend,
    pub index: usize,
    pub bytes: u64,
}

impl DeviceMemory {
    pub fn parse(s: &str) -> Result<DeviceMemory, String> {
        let (device, size) =
            s.split_once('=').ok_or_else(|| format!("`{s}` is not BACKEND:INDEX=SIZE (e.g. cuda:0=40G)"))?;
        let spec = crate::plan::DeviceSpec::parse(device.trim())?;
        let index =
            spec.index.ok_or_else(|| format!("`{s}`: name the device with its index (e.g. cuda:0)"))?;
        let bytes = parse_bytes(size).map_err(|e| format!("`{s}`: {e}"))?;
        Ok(DeviceMemory { backend: spec.backend, index, bytes })
    }
}

/// `16G`, `512M`, `1.5GiB`, `1000000` (bytes); binary units.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let n: f64 = number.parse().map_err(|_| format!("`{t}` is not a size such as 16G or 512M"))?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("`{other}` is not a size unit (K, M, G, T)")),
    };
    let bytes = n * scale as f64;
    if !(1.0..1.8e19).contains(&bytes) {
        return Err(format!("`{t}` is not a positive size"));
    }
    Ok(bytes as u64)
}

fn list(value: &str) -> Vec<String> {
    value.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect()
}

fn parse_bool(var: &str, value: &str) -> Result<bool, ConfigError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" | "" => Ok(false),
        other => {
            Err(ConfigError::Env { var: var.into(), message: format!("`{other}` is not true or false") })
        }
    }
}

fn parse<T: std::str::FromStr>(var: &str, value: &str) -> Result<T, ConfigError>
where
    T::Err: std::fmt::Display,
{
    value.trim().parse().map_err(|e: T::Err| ConfigError::Env { var: var.into(), message: e.to_string() })
}

impl HiveConfig {
    /// Defaults → `file` (if any) → `env` → `cli`.
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
        cli: &CliOverrides,
    ) -> Result<HiveConfig, ConfigError> {
        let mut config = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|source| ConfigError::Read { path: path.into(), source })?;
                Self::from_toml(&text).map_err(|message| ConfigError::Parse { path: path.into(), message })?
            }
            None => HiveConfig::default(),
        };
        config.apply_env(env)?;
        config.apply_cli(cli);
        config.validate()?;
        Ok(config)
    }

    pub fn from_toml(text: &str) -> Result<HiveConfig, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }

    /// Applies the `SDHIVE_*` variables; others are ignored (the environment is shared with everything else).
    pub fn apply_env(&mut self, env: impl IntoIterator<Item = (String, String)>) -> Result<(), ConfigError> {
        for (var, value) in env {
            let Some(key) = var.strip_prefix("SDHIVE_") else { continue };
            match key {
                "BIND" => self.bind = parse(&var, &value)?,
                "MODELS" => self.models = list(&value),
                "MODEL_ROOTS" => self.model_roots = list(&value).into_iter().map(PathBuf::from).collect(),
                "MODELS_DIRS" => self.models_dirs = list(&value).into_iter().map(PathBuf::from).collect(),
                "VAE_DIRS" => self.vae_dirs = list(&value).into_iter().map(PathBuf::from).collect(),
                "LORA_DIRS" => self.lora_dirs = list(&value).into_iter().map(PathBuf::from).collect(),
                "EMBEDDINGS_DIRS" => {
                    self.embeddings_dirs = list(&value).into_iter().map(PathBuf::from).collect()
                }
                "UPSCALER_DIRS" => self.upscaler_dirs = list(&value).into_iter().map(PathBuf::from).collect(),
                "WORKERS_DIR" => self.workers_dir = Some(PathBuf::from(value)),
                "TOKEN" => self.token = Some(value),
                "API_KEY" => self.api_key = Some(value),
                "API_AUTH" => self.api_auth = Some(value),
                "STYLES_FILE" => self.styles_file = Some(PathBuf::from(value)),
                "PREVIEW" => self.preview = parse(&var, &value)?,
                "NO_T5" => self.no_t5 = parse_bool(&var, &value)?,
                "WORKER_API_KEY" => self.worker_api_key = Some(value),
                "BACKEND" => self.backend = Some(value),
                "PIN" => self.pin = list(&value),
                "EXCLUDE" => self.exclude = list(&value),
                "ROCM_DENY" => self.rocm_deny = list(&value),
                "ROCM_ALLOW" => self.rocm_allow = list(&value),
                "CPU" => self.cpu = parse(&var, &value)?,
                "CPU_WORKERS" => self.cpu_workers = parse(&var, &value)?,
                "MAX_WORKERS_PER_DEVICE" => self.max_workers_per_device = parse(&var, &value)?,
                "MAX_CPU_WORKERS" => self.max_cpu_workers = Some(parse(&var, &value)?),
                "IDLE_WORKER_SECS" => self.idle_worker_secs = parse(&var, &value)?,
                "DEVICE_MEMORY" => self.device_memory = list(&value),
                "MODEL_SWITCH_WAIT_SECS" => self.model_switch_wait_secs = parse(&var, &value)?,
                "HEARTBEAT_INTERVAL_SECS" => self.heartbeat_interval_secs = parse(&var, &value)?,
                "QUEUE_SIZE" => self.queue_size = parse(&var, &value)?,
                "WORKER_SLOTS" => self.worker_slots = parse(&var, &value)?,
                "WORKER_PORT_BASE" => self.worker_port_base = parse(&var, &value)?,
                "RESTART_INITIAL_SECS" => self.restart_initial_secs = parse(&var, &value)?,
                "RESTART_MAX_SECS" => self.restart_max_secs = parse(&var, &value)?,
                "RESTART_RESET_SECS" => self.restart_reset_secs = parse(&var, &value)?,
                "CRASH_LOOP_FAILURES" => self.crash_loop_failures = parse(&var, &value)?,
                "CRASH_LOOP_WINDOW_SECS" => self.crash_loop_window_secs = parse(&var, &value)?,
                "DRAIN_GRACE_SECS" => self.drain_grace_secs = parse(&var, &value)?,
                "STOP_GRACE_SECS" => self.stop_grace_secs = parse(&var, &value)?,
                "JOB_TTL_SECS" => self.job_ttl_secs = parse(&var, &value)?,
                "CLUSTER_GATEWAY" => self.cluster.gateway = parse_bool(&var, &value)?,
                "CLUSTER_PARENT" => self.cluster.parent = Some(value),
                "CLUSTER_PARENT_TOKEN" => self.cluster.parent_token = Some(value),
                "CLUSTER_NODE_ID" => self.cluster.node_id = Some(value),
                "CLUSTER_ADVERTISE_URL" => self.cluster.advertise_url = Some(value),
                // Test harness knobs and future keys share the prefix; they are not ours to refuse.
                _ => {}
            }
        }
        Ok(())
    }

    pub fn apply_cli(&mut self, cli: &CliOverrides) {
        fn set<T: Clone>(slot: &mut T, v: &Option<T>) {
            if let Some(v) = v {
                *slot = v.clone();
            }
        }
        fn set_list<T: Clone>(slot: &mut Vec<T>, v: &[T]) {
            if !v.is_empty() {
                *slot = v.to_vec();
            }
        }
        set(&mut self.bind, &cli.bind);
        set_list(&mut self.models, &cli.models);
        set_list(&mut self.model_roots, &cli.model_roots);
        set_list(&mut self.models_dirs, &cli.models_dirs);
        set_list(&mut self.vae_dirs, &cli.vae_dirs);
        set_list(&mut self.lora_dirs, &cli.lora_dirs);
        set_list(&mut self.embeddings_dirs, &cli.embeddings_dirs);
        set_list(&mut self.upscaler_dirs, &cli.upscaler_dirs);
        if cli.workers_dir.is_some() {
            self.workers_dir = cli.workers_dir.clone();
        }
        if cli.token.is_some() {
            self.token = cli.token.clone();
        }
        if cli.api_key.is_some() {
            self.api_key = cli.api_key.clone();
        }
        if cli.api_auth.is_some() {
            self.api_auth = cli.api_auth.clone();
        }
        if cli.styles_file.is_some() {
            self.styles_file = cli.styles_file.clone();
        }
        set(&mut self.preview, &cli.preview);
        self.no_t5 |= cli.no_t5;
        if cli.backend.is_some() {
            self.backend = cli.backend.clone();
        }
        set_list(&mut self.pin, &cli.pin);
        set_list(&mut self.exclude, &cli.exclude);
        set_list(&mut self.rocm_deny, &cli.rocm_deny);
        set_list(&mut self.rocm_allow, &cli.rocm_allow);
        set(&mut self.cpu, &cli.cpu);
        set(&mut self.cpu_workers, &cli.cpu_workers);
        set(&mut self.max_workers_per_device, &cli.max_workers_per_device);
        if cli.max_cpu_workers.is_some() {
            self.max_cpu_workers = cli.max_cpu_workers;
        }
        set_list(&mut self.device_memory, &cli.device_memory);
        set(&mut self.heartbeat_interval_secs, &cli.heartbeat_interval_secs);
        set(&mut self.queue_size, &cli.queue_size);
        set(&mut self.worker_slots, &cli.worker_slots);
        self.cluster.gateway |= cli.gateway;
        for (slot, v) in [
            (&mut self.cluster.parent, &cli.parent),
            (&mut self.cluster.parent_token, &cli.parent_token),
            (&mut self.cluster.node_id, &cli.node_id),
            (&mut self.cluster.advertise_url, &cli.advertise_url),
        ] {
            if v.is_some() {
                *slot = v.clone();
            }
        }
    }

    pub fn validate(&mut self) -> Result<(), ConfigError> {
        // Empty strings from an env file mean "unset", not "the empty token".
        let c = &mut self.cluster;
        for secret in [
            &mut self.token,
            &mut self.api_key,
            &mut self.api_auth,
            &mut self.worker_api_key,
            &mut c.parent,
            &mut c.parent_token,
            &mut c.node_id,
            &mut c.advertise_url,
        ] {
            if secret.as_deref().is_some_and(|s| s.trim().is_empty()) {
                *secret = None;
            }
        }
        self.validate_cluster()?;
        if let Some(auth) = &self.api_auth {
            sdhive_protocol::parse_api_auth(auth)
                .map_err(|e| ConfigError::Invalid(format!("api_auth: {e}")))?;
        }
        if self.heartbeat_interval_secs == 0 {
            return Err(ConfigError::Invalid("heartbeat_interval_secs must be at least 1".into()));
        }
        if self.worker_slots == 0 {
            return Err(ConfigError::Invalid("worker_slots must be at least 1".into()));
        }
        if self.cpu_workers == 0 {
            return Err(ConfigError::Invalid(
                "cpu_workers must be at least 1 (use cpu = \"never\" for none)".into(),
            ));
        }
        if self.max_workers_per_device == 0 {
            return Err(ConfigError::Invalid(
                "max_workers_per_device must be at least 1 (1: no workers started on demand)".into(),
            ));
        }
        if let Some(max) = self.max_cpu_workers {
            if max < self.cpu_workers {
                return Err(ConfigError::Invalid(format!(
                    "max_cpu_workers ({max}) must be at least cpu_workers ({})",
                    self.cpu_workers
                )));
            }
        }
        for entry in &self.device_memory {
            DeviceMemory::parse(entry).map_err(|e| ConfigError::Invalid(format!("device_memory: {e}")))?;
        }
        let secs = [
            ("idle_worker_secs", self.idle_worker_secs),
            ("restart_initial_secs", self.restart_initial_secs),
            ("restart_max_secs", self.restart_max_secs),
            ("restart_reset_secs", self.restart_reset_secs),
            ("crash_loop_window_secs", self.crash_loop_window_secs),
            ("drain_grace_secs", self.drain_grace_secs),
            ("stop_grace_secs", self.stop_grace_secs),
            ("model_switch_wait_secs", self.model_switch_wait_secs),
        ];
        for (name, v) in secs {
            if !(0.0..1e9).contains(&v) {
                return Err(ConfigError::Invalid(format!("{name} must be a non-negative number of seconds")));
            }
        }
        if let Some(b) = &self.backend {
            b.parse::<shared_worker::Backend>().map_err(|e| ConfigError::Invalid(e.to_string()))?;
        }
        for spec in self.pin.iter().chain(&self.exclude) {
            crate::plan::DeviceSpec::parse(spec).map_err(ConfigError::Invalid)?;
        }
        for gfx in self.rocm_deny.iter().chain(&self.rocm_allow) {
            let name = crate::amd::normalize(gfx);
            if name.len() < 6 || !name[3..].bytes().all(|b| b.is_ascii_alphanumeric()) {
                return Err(ConfigError::Invalid(format!(
                    "rocm_deny/rocm_allow: `{gfx}` is not a gfx target such as gfx1100 or gfx90c"
                )));
            }
        }
        Ok(())
    }

    fn validate_cluster(&self) -> Result<(), ConfigError> {
        let c = &self.cluster;
        let Some(url) = c.parent_register_url() else {
            if c.parent_token.is_some() || c.node_id.is_some() || c.advertise_url.is_some() {
                return Err(ConfigError::Invalid(
                    "cluster.parent_token, node_id and advertise_url need cluster.parent (--parent)".into(),
                ));
            }
            return Ok(());
        };
        url.map_err(ConfigError::Invalid)?;
        if c.parent_token.is_none() {
            return Err(ConfigError::Invalid(
                "cluster.parent needs cluster.parent_token (--parent-token): the parent's registration token"
                    .into(),
            ));
        }
        if let Some(id) = &c.node_id {
            if !crate::plan::valid_worker_id(id) {
                return Err(ConfigError::Invalid(format!(
                    "cluster.node_id `{id}` must match [A-Za-z0-9._-]{{1,64}}"
                )));
            }
        }
        match &c.advertise_url {
            Some(u) => {
                let url = reqwest::Url::parse(u)
                    .map_err(|e| ConfigError::Invalid(format!("cluster.advertise_url `{u}` is not a URL: {e}")))?;
                if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
                    return Err(ConfigError::Invalid(format!(
                        "cluster.advertise_url `{u}` must be an http(s) URL with a host"
                    )));
                }
            }
            None if self.bind.ip().is_unspecified() => {
                return Err(ConfigError::Invalid(format!(
                    "bind {} is every address: set cluster.advertise_url (--advertise-url) to the one the parent \
                     reaches this hive at",
                    self.bind
                )))
            }
            None => {}
        }
        Ok(())
    }

    /// The URL the parent reaches this hive at.
    pub fn advertise_url(&self) -> String {
        match &self.cluster.advertise_url {
            Some(u) => u.trim().trim_end_matches('/').to_string(),
            None => format!("http://{}", self.bind),
        }
    }

    pub fn model_switch_wait(&self) -> Duration {
        Duration::from_secs_f64(self.model_switch_wait_secs)
    }

    pub fn idle_worker(&self) -> Duration {
        Duration::from_secs_f64(self.idle_worker_secs)
    }

    /// The most workers the hive runs on one device of `backend` (planned and on demand together).
    pub fn max_workers(&self, backend: shared_worker::Backend) -> usize {
        match backend {
            shared_worker::Backend::Cpu => {
                self.max_cpu_workers.unwrap_or(self.cpu_workers).max(self.cpu_workers)
            }
            _ => self.max_workers_per_device.max(1),
        }
    }

    /// The memory stated for `backend:index` (`device_memory`), in bytes.
    pub fn stated_memory(&self, backend: shared_worker::Backend, index: usize) -> Option<u64> {
        self.device_memory
            .iter()
            .filter_map(|e| DeviceMemory::parse(e).ok())
            .find(|d| d.backend == backend && d.index == index)
            .map(|d| d.bytes)
    }

    /// What every spawned worker may load without being told a path: its `--model-root`s (the configured
    /// roots plus the models and VAE dirs, which confine like roots).
    pub fn worker_roots(&self) -> Vec<PathBuf> {
        let mut roots = self.model_roots.clone();
        for dir in self.models_dirs.iter().chain(&self.vae_dirs) {
            if !roots.contains(dir) {
                roots.push(dir.clone());
            }
        }
        roots
    }

    pub fn heartbeat_interval(&self) -> Duration {
        Duration::from_secs(self.heartbeat_interval_secs)
    }

    /// What the hive's public and admin routes accept: `api_key` as a bearer token, `api_auth` as HTTP Basic.
    pub fn credentials(&self) -> sdhive_protocol::Credentials {
        let basic = self
            .api_auth
            .as_deref()
            .and_then(|a| sdhive_protocol::parse_api_auth(a).ok())
            .unwrap_or_default();
        sdhive_protocol::Credentials::new(self.api_key.clone(), basic)
    }

    /// Whether the hive listens only on loopback (admin routes may then go without an API key).
    pub fn is_loopback(&self) -> bool {
        self.bind.ip().is_loopback()
    }

    /// The configuration with every secret that is set replaced by `<redacted>`.
    pub fn redacted(&self) -> HiveConfig {
        let mut shown = self.clone();
        for secret in [
            &mut shown.token,
            &mut shown.api_key,
            &mut shown.api_auth,
            &mut shown.worker_api_key,
            &mut shown.cluster.parent_token,
        ] {
            if secret.is_some() {
                *secret = Some("<redacted>".into());
            }
        }
        shown
    }

    /// The effective configuration as TOML with secrets replaced, for `hive config`.
    pub fn redacted_toml(&self) -> String {
        toml::to_string(&self.redacted())
            .unwrap_or_else(|e| format!("# cannot render the configuration: {e}\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn layers_apply_in_order_defaults_file_env_cli() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("hive.toml");
        std::fs::write(
            &file,
            "bind = \"0.0.0.0:9000\"\nmodels = [\"from-file\"]\nqueue_size = 7\nworker_slots = 3\n\
             heartbeat_interval_secs = 2\n",
        )
        .unwrap();
        let cli =
            CliOverrides { models: vec!["from-cli".into()], worker_slots: Some(4), ..Default::default() };
        let c = HiveConfig::load(
            Some(&file),
            env(&[("SDHIVE_QUEUE_SIZE", "11"), ("SDHIVE_MODELS", "a,b"), ("PATH", "/bin")]),
            &cli,
        )
        .unwrap();
        assert_eq!(c.bind, "0.0.0.0:9000".parse().unwrap(), "file beats default");
        assert_eq!(c.queue_size, 11, "env beats file");
        assert_eq!(c.models, vec!["from-cli"], "cli beats env");
        assert_eq!(c.worker_slots, 4, "cli beats file");
        assert_eq!(c.heartbeat_interval_secs, 2, "file value survives when nothing overrides it");
        assert_eq!(c.stop_grace_secs, HiveConfig::default().stop_grace_secs);
    }

    #[test]
    fn library_keys_layer_like_the_others() {
        let file = "models_dirs = [\"/file\"]\ncpu_workers = 3\n";
        let mut c = HiveConfig::from_toml(file).unwrap();
        c.apply_env(env(&[
            ("SDHIVE_MODELS_DIRS", "/a, /b"),
            ("SDHIVE_VAE_DIRS", "/v"),
            ("SDHIVE_MODEL_SWITCH_WAIT_SECS", "2.5"),
        ]))
        .unwrap();
        assert_eq!(c.models_dirs, [PathBuf::from("/a"), PathBuf::from("/b")]);
        assert_eq!((c.cpu_workers, c.model_switch_wait()), (3, Duration::from_millis(2500)));
        c.apply_cli(&CliOverrides {
            models_dirs: vec!["/cli".into()],
            cpu_workers: Some(2),
            model_roots: vec!["/r".into()],
            ..Default::default()
        });
        assert_eq!((c.models_dirs.clone(), c.cpu_workers), (vec![PathBuf::from("/cli")], 2));
        // Models and VAE dirs confine the workers like roots.
        let roots: Vec<PathBuf> = ["/r", "/cli", "/v"].iter().map(PathBuf::from).collect();
        assert_eq!(c.worker_roots(), roots);
        let cli = CliOverrides { cpu_workers: Some(0), ..Default::default() };
        assert!(HiveConfig::load(None, Vec::new(), &cli).is_err(), "no CPU workers is cpu = \"never\"");
    }

    #[test]
    fn on_demand_worker_keys() {
        let c = HiveConfig::default();
        use shared_worker::Backend;
        assert_eq!((c.max_workers(Backend::Cuda), c.max_workers(Backend::Cpu)), (2, 1));
        let mut c = HiveConfig::from_toml("cpu_workers = 2\ndevice_memory = [\"cuda:1=40G\"]\n").unwrap();
        c.apply_env(env(&[("SDHIVE_MAX_CPU_WORKERS", "3"), ("SDHIVE_IDLE_WORKER_SECS", "5")])).unwrap();
        assert_eq!((c.max_workers(Backend::Cpu), c.idle_worker()), (3, Duration::from_secs(5)));
        assert_eq!(c.stated_memory(Backend::Cuda, 1), Some(40 << 30));
        assert_eq!(c.stated_memory(Backend::Cuda, 0), None);
        c.apply_cli(&CliOverrides { device_memory: vec!["cpu:0=1.5G".into()], ..Default::default() });
        assert_eq!(c.stated_memory(Backend::Cpu, 0), Some(3 << 29));
        assert!(c.validate().is_ok());
        assert_eq!(parse_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_bytes("1000"), Ok(1000));
        for bad in ["cuda=4G", "cuda:0", "cuda:0=lots", "cuda:0=4Q", "gpu:0=4G", "cuda:0=0"] {
            let cli = CliOverrides { device_memory: vec![bad.into()], ..Default::default() };
            let err = HiveConfig::load(None, Vec::new(), &cli).unwrap_err().to_string();
            assert!(err.contains("device_memory") && err.contains(bad.split('=').next().unwrap()), "{err}");
        }
        let cli = CliOverrides { cpu_workers: Some(2), max_cpu_workers: Some(1), ..Default::default() };
        let err = HiveConfig::load(None, Vec::new(), &cli).unwrap_err().to_string();
        assert!(err.contains("max_cpu_workers"), "{err}");
        let cli = CliOverrides { max_workers_per_device: Some(0), ..Default::default() };
        assert!(HiveConfig::load(None, Vec::new(), &cli).is_err());
    }

    #[test]
    fn no_t5_comes_from_the_file_the_environment_or_the_flag() {
        assert!(!HiveConfig::default().no_t5);
        assert!(HiveConfig::from_toml("no_t5 = true\n").unwrap().no_t5);
        let c = HiveConfig::load(None, env(&[("SDHIVE_NO_T5", "1")]), &CliOverrides::default()).unwrap();
        assert!(c.no_t5);
        let c =
            HiveConfig::load(None, Vec::new(), &CliOverrides { no_t5: true, ..Default::default() }).unwrap();
        assert!(c.no_t5 && c.redacted_toml().contains("no_t5 = true"), "{}", c.redacted_toml());
        assert!(HiveConfig::load(None, env(&[("SDHIVE_NO_T5", "maybe")]), &CliOverrides::default()).is_err());
    }

    #[test]
    fn the_preview_mode_layers_like_the_others() {
        use sdhive_engine::PreviewMode;
        assert_eq!(HiveConfig::default().preview, PreviewMode::Auto);
        let mut c = HiveConfig::from_toml("preview = \"taesd\"\n").unwrap();
        assert_eq!(c.preview, PreviewMode::Taesd);
        c.apply_env(env(&[("SDHIVE_PREVIEW", "latent")])).unwrap();
        assert_eq!(c.preview, PreviewMode::Latent);
        c.apply_cli(&CliOverrides { preview: Some(PreviewMode::Off), ..Default::default() });
        assert_eq!(c.preview, PreviewMode::Off);
        assert!(c.redacted_toml().contains("preview = \"off\""), "{}", c.redacted_toml());
        let err =
            HiveConfig::load(None, env(&[("SDHIVE_PREVIEW", "vae")]), &CliOverrides::default()).unwrap_err();
        assert!(err.to_string().contains("SDHIVE_PREVIEW"), "{err}");
        assert!(HiveConfig::from_toml("preview = \"sharp\"").is_err());
    }

    #[test]
    fn bad_values_are_named() {
        let err = HiveConfig::load(None, env(&[("SDHIVE_QUEUE_SIZE", "lots")]), &CliOverrides::default())
            .unwrap_err();
        assert!(err.to_string().contains("SDHIVE_QUEUE_SIZE"), "{err}");
        let err = HiveConfig::from_toml("queue_sise = 3").unwrap_err();
        assert!(err.contains("queue_sise"), "{err}");
        let cli = CliOverrides { backend: Some("opengl".into()), ..Default::default() };
        assert!(HiveConfig::load(None, Vec::new(), &cli).is_err());
        let cli = CliOverrides { exclude: vec!["cuda:x".into()], ..Default::default() };
        assert!(HiveConfig::load(None, Vec::new(), &cli).is_err());
    }

    #[test]
    fn secrets_are_redacted_and_empty_ones_unset() {
        let cli = CliOverrides {
            token: Some("s3cret-token".into()),
            api_key: Some(String::new()),
            api_auth: Some("alice:s3cret-pw".into()),
            ..Default::default()
        };
        let c = HiveConfig::load(None, env(&[("SDHIVE_STYLES_FILE", "/s/styles.csv")]), &cli).unwrap();
        assert_eq!(c.api_key, None);
        assert_eq!(c.styles_file, Some(PathBuf::from("/s/styles.csv")));
        let credentials = c.credentials();
        assert!(credentials.required() && credentials.api_key.is_none());
        let shown = c.redacted_toml();
        assert!(!shown.contains("s3cret-token") && shown.contains("<redacted>"), "{shown}");
        assert!(!shown.contains("s3cret-pw") && !shown.contains("alice"), "{shown}");
        let bad = CliOverrides { api_auth: Some("no-colon".into()), ..Default::default() };
        let err = HiveConfig::load(None, Vec::new(), &bad).unwrap_err();
        assert!(err.to_string().contains("api_auth") && !err.to_string().contains("no-colon"), "{err}");
        // What `hive config` prints must load back as a config file.
        assert!(HiveConfig::from_toml(&shown).is_ok(), "{shown}");
    }

    #[test]
    fn cluster_settings_from_file_env_and_flags_with_their_errors() {
        let file = HiveConfig::from_toml(
            "bind = \"0.0.0.0:7833\"\n[cluster]\nparent = \"http://gw:7833\"\nparent_token = \"pt-s3cret\"\n\
             advertise_url = \"http://10.0.0.2:7833/\"\n",
        )
        .unwrap();
        assert_eq!(file.cluster.parent.as_deref(), Some("http://gw:7833"));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hive.toml");
        std::fs::write(&path, toml::to_string(&file).unwrap()).unwrap();
        let cli = CliOverrides { node_id: Some("gpu-1".into()), ..Default::default() };
        let c = HiveConfig::load(Some(&path), env(&[("SDHIVE_CLUSTER_GATEWAY", "true")]), &cli).unwrap();
        assert!(c.cluster.gateway);
        assert_eq!(c.cluster.node_id.as_deref(), Some("gpu-1"));
        assert_eq!(c.advertise_url(), "http://10.0.0.2:7833");
        assert_eq!(
            c.cluster.parent_register_url().unwrap().unwrap().as_str(),
            "http://gw:7833/v1/workers/register"
        );
        let shown = c.redacted_toml();
        assert!(!shown.contains("pt-s3cret") && shown.contains("[cluster]"), "{shown}");
        assert!(HiveConfig::from_toml(&shown).is_ok(), "{shown}");
        let other = CliOverrides { parent: Some("http://gw:9/hive/register".into()), ..Default::default() };
        let c = HiveConfig::load(Some(&path), Vec::new(), &other).unwrap();
        assert_eq!(c.cluster.parent_register_url().unwrap().unwrap().as_str(), "http://gw:9/hive/register");

        let refused = |env_pairs: &[(&str, &str)], cli: CliOverrides, needle: &str| {
            let err = HiveConfig::load(None, env(env_pairs), &cli).unwrap_err().to_string();
            assert!(err.contains(needle), "{needle}: {err}");
        };
        let parent = |p: &str| CliOverrides { parent: Some(p.into()), ..Default::default() };
        refused(&[("SDHIVE_CLUSTER_PARENT_TOKEN", "t")], parent("gw:7833"), "cluster.parent");
        refused(&[("SDHIVE_CLUSTER_PARENT_TOKEN", "t")], parent("ftp://gw"), "http(s)");
        refused(&[], parent("http://gw:7833"), "parent_token");
        refused(&[("SDHIVE_CLUSTER_NODE_ID", "n")], CliOverrides::default(), "need cluster.parent");
        refused(
            &[("SDHIVE_CLUSTER_PARENT_TOKEN", "t"), ("SDHIVE_CLUSTER_NODE_ID", "a b")],
            parent("http://gw:7833"),
            "node_id",
        );
        refused(
            &[("SDHIVE_CLUSTER_PARENT_TOKEN", "t"), ("SDHIVE_BIND", "0.0.0.0:7833")],
            parent("http://gw:7833"),
            "advertise_url",
        );
        refused(&[("SDHIVE_CLUSTER_GATEWAY", "maybe")], CliOverrides::default(), "SDHIVE_CLUSTER_GATEWAY");
    }
}
