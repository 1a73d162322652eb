//! `hive serve | devices | config`: parses flags, layers the configuration, and runs the hive.

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use sdhive_hive::config::{CliOverrides, CpuPolicy, HiveConfig};
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "hive",
    version,
    about = "Runs one sdhive worker per device and serves them behind one endpoint"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Detect devices, spawn workers, serve the API.
    Serve(Flags),
    /// Print the detected devices and what the hive would run on each.
    Devices {
        #[command(flatten)]
        flags: Flags,
        /// JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Print the effective configuration (secrets redacted).
    Config(Flags),
}

#[derive(Debug, Args)]
struct Flags {
    /// TOML configuration file.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    #[arg(long, value_name = "ADDR")]
    bind: Option<SocketAddr>,
    /// Model to preload (repeatable): worker i starts with the i-th (round robin); the rest of the models dirs
    /// load on demand.
    #[arg(long = "model", value_name = "MODEL")]
    models: Vec<String>,
    /// Confine local model paths to this folder (repeatable; passed to every worker).
    #[arg(long = "model-root", value_name = "DIR")]
    model_roots: Vec<PathBuf>,
    /// A folder of checkpoints every worker can load on demand (repeatable; also a model root).
    #[arg(long = "models-dir", value_name = "DIR")]
    models_dirs: Vec<PathBuf>,
    /// A folder of standalone VAEs (repeatable).
    #[arg(long = "vae-dir", value_name = "DIR")]
    vae_dirs: Vec<PathBuf>,
    /// A folder of LoRA / LyCORIS files every worker serves (repeatable).
    #[arg(long = "lora-dir", value_name = "DIR")]
    lora_dirs: Vec<PathBuf>,
    /// A folder of textual-inversion embeddings every worker serves (repeatable).
    #[arg(long = "embeddings-dir", value_name = "DIR")]
    embeddings_dirs: Vec<PathBuf>,
    /// A folder of upscaler models (ESRGAN / Real-ESRGAN .safetensors) every worker serves (repeatable).
    #[arg(long = "upscaler-dir", value_name = "DIR")]
    upscaler_dirs: Vec<PathBuf>,
    /// Where the sd-worker-<backend> binaries are (default: beside this executable).
    #[arg(long, value_name = "DIR")]
    workers_dir: Option<PathBuf>,
    /// Token workers must present to register and heartbeat.
    #[arg(long)]
    token: Option<String>,
    /// Bearer key for the hive's API.
    #[arg(long)]
    api_key: Option<String>,
    /// A1111's HTTP Basic credentials for the hive's API, `user:password[,user2:password2]` (accepted besides
    /// --api-key).
    #[arg(long, value_name = "USER:PASSWORD[,…]")]
    api_auth: Option<String>,
    /// A1111's prompt styles: a styles.csv or a folder of .csv files (passed to every worker).
    #[arg(long, value_name = "PATH")]
    styles_file: Option<PathBuf>,
    /// Live previews in the workers: auto (TAESD on GPUs where its weights are found, else latent), taesd,
    /// latent, off (passed to every worker as --preview).
    #[arg(long, value_name = "MODE")]
    preview: Option<sdhive_engine::PreviewMode>,
    /// SD3/SD3.5 models without T5 (its part of the context zeros; about 9.5 GB less): passed to every worker.
    #[arg(long)]
    no_t5: bool,
    /// Use only this backend.
    #[arg(long)]
    backend: Option<String>,
    /// Serve the physical device known as BACKEND:INDEX with that backend (repeatable).
    #[arg(long, value_name = "BACKEND:INDEX")]
    pin: Vec<String>,
    /// Leave out a device (BACKEND:INDEX) or a whole backend (repeatable).
    #[arg(long, value_name = "BACKEND[:INDEX]")]
    exclude: Vec<String>,
    /// AMD gfx targets ROCm must not serve; they get the Vulkan worker (repeatable; replaces the default list of
    /// APUs known to crash under ROCm, shown by `hive config`).
    #[arg(long, value_name = "GFX")]
    rocm_deny: Vec<String>,
    /// AMD gfx targets ROCm serves even when denied or not in the ROCm worker's build (repeatable).
    #[arg(long, value_name = "GFX")]
    rocm_allow: Vec<String>,
    /// Whether the CPU gets a worker: auto (only without GPU workers), always, never.
    #[arg(long)]
    cpu: Option<CpuPolicy>,
    /// How many workers the CPU gets when it serves.
    #[arg(long, value_name = "N")]
    cpu_workers: Option<usize>,
    /// The most workers one GPU runs, those started on demand included (1: none on demand).
    #[arg(long, value_name = "N")]
    max_workers_per_device: Option<usize>,
    /// The most workers the CPU runs, --cpu-workers included (default: --cpu-workers, none on demand).
    #[arg(long, value_name = "N")]
    max_cpu_workers: Option<usize>,
    /// Memory the hive may fill with its workers' models on a device, e.g. cuda:0=40G (repeatable).
    #[arg(long = "device-memory", value_name = "BACKEND:INDEX=SIZE")]
    device_memory: Vec<String>,
    /// Heartbeat interval asked of workers, in seconds.
    #[arg(long, value_name = "SECS")]
    heartbeat_interval: Option<u64>,
    /// Jobs held by the hive while every worker is full.
    #[arg(long)]
    queue_size: Option<usize>,
    /// Jobs in flight per worker.
    #[arg(long)]
    worker_slots: Option<usize>,
    /// Run no workers here: route only to node hives (and workers) that register with this one.
    #[arg(long)]
    gateway: bool,
    /// Register this hive with a parent hive (a gateway) at this URL, as a node of its cluster.
    #[arg(long, value_name = "URL")]
    parent: Option<String>,
    /// The parent's registration token (its --token).
    #[arg(long, value_name = "TOKEN")]
    parent_token: Option<String>,
    /// The id this hive registers under with its parent (default: the host name).
    #[arg(long, value_name = "ID")]
    node_id: Option<String>,
    /// How the parent reaches this hive (default http://<bind>).
    #[arg(long, value_name = "URL")]
    advertise_url: Option<String>,
}

impl Flags {
    fn load(&self) -> anyhow::Result<HiveConfig> {
        let cli = CliOverrides {
            bind: self.bind,
            models: self.models.clone(),
            model_roots: self.model_roots.clone(),
            models_dirs: self.models_dirs.clone(),
            vae_dirs: self.vae_dirs.clone(),
            lora_dirs: self.lora_dirs.clone(),
            embeddings_dirs: self.embeddings_dirs.clone(),
            upscaler_dirs: self.upscaler_dirs.clone(),
            workers_dir: self.workers_dir.clone(),
            token: self.token.clone(),
            api_key: self.api_key.clone(),
            api_auth: self.api_auth.clone(),
            styles_file: self.styles_file.clone(),
            preview: self.preview,
            no_t5: self.no_t5,
            backend: self.backend.clone(),
            pin: self.pin.clone(),
            exclude: self.exclude.clone(),
            rocm_deny: self.rocm_deny.clone(),
            rocm_allow: self.rocm_allow.clone(),
            cpu: self.cpu,
            cpu_workers: self.cpu_workers,
            max_workers_per_device: self.max_workers_per_device,
            max_cpu_workers: self.max_cpu_workers,
            device_memory: self.device_memory.clone(),
            heartbeat_interval_secs: self.heartbeat_interval,
            queue_size: self.queue_size,
            worker_slots: self.worker_slots,
            gateway: self.gateway,
            parent: self.parent.clone(),
            parent_token: self.parent_token.clone(),
            node_id: self.node_id.clone(),
            advertise_url: self.advertise_url.clone(),
        };
        Ok(HiveConfig::load(self.config.as_deref(), std::env::vars(), &cli)?)
    }
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = term => tracing::info!("SIGTERM"),
        r = tokio::signal::ctrl_c() => {
            if let Err(e) = r {
                tracing::warn!("cannot listen for Ctrl-C: {e}");
                std::future::pending::<()>().await;
            }
            tracing::info!("interrupted");
        }
    }
}

fn main() -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_writer(std::io::stderr).with_env_filter(filter).init();
    let cli = Cli::parse();
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    match cli.command {
        Command::Config(flags) => {
            print!("{}", flags.load()?.redacted_toml());
            Ok(())
        }
        Command::Devices { flags, json } => {
            let config = flags.load()?;
            let devices = runtime.block_on(sdhive_hive::detect::detect());
            let installed = runtime.block_on(sdhive_hive::plan::Probe::read(&config));
            let plan = sdhive_hive::plan::plan(&devices, &config, installed);
            if json {
                println!("{}", serde_json::to_string_pretty(&plan.rows)?);
                return Ok(());
            }
            print!("{}", sdhive_hive::plan::render_table(&plan));
            // Which worker preloads which model, and what becomes of the others: no model goes unmentioned.
            match sdhive_hive::models::scan(&config) {
                Ok(catalog) => {
                    for note in sdhive_hive::models::preload_notes(&plan, &catalog) {
                        println!("{}{}", if note.warn { "WARNING: " } else { "" }, note.text);
                    }
                }
                Err(e) => println!("WARNING: cannot read the model library: {e}"),
            }
            Ok(())
        }
        Command::Serve(flags) => {
            let config = flags.load()?;
            runtime.block_on(sdhive_hive::serve(config, shutdown_signal(), |addr| {
                // Scripts and tests wait for this line to learn the port.
                eprintln!("hive listening on http://{addr}");
            }))?;
            Ok(())
        }
    }
}
