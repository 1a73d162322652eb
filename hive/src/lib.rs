//! The hive: one process per node that detects the node's devices, runs one `sd-worker-<backend>` per device
//! (restarting them when they die; more on a device with room when a model is wanted that no worker has),
//! accepts registrations from workers started elsewhere, and serves the workers' public API behind one
//! endpoint. See `docs/operations.md` and the hive section of
//! `docs/architecture.md`.
//!
//! All mutable state (worker table, job table, hive queue) sits behind one mutex in [`State`], so a worker's
//! death and the jobs it held are handled in one step; nothing awaits while holding it.

pub mod amd;
pub mod api;
pub mod capacity;
pub mod cluster;
pub mod config;
pub mod detect;
pub mod models;
pub mod plan;
pub mod registry;
pub mod rewrite;
pub mod router;
pub mod supervisor;

use crate::config::HiveConfig;
use crate::plan::Row;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};
use tokio::sync::watch;

/// Everything that changes while the hive runs.
#[derive(Default)]
pub struct State {
    pub workers: BTreeMap<String, registry::WorkerEntry>,
    pub jobs: HashMap<String, router::HiveJob>,
    pub queue: VecDeque<router::Ticket>,
    /// Set on SIGTERM: no new jobs are accepted.
    pub draining: bool,
    pub metrics: Metrics,
    /// The hive's scan of the models dirs (what every worker it starts can load).
    pub catalog: sdhive_catalog::Catalog,
    /// The model requests that name none run with (A1111's `sd_model_checkpoint`), as a source string.
    pub selected: Option<String>,
    /// The latest decision about starting a worker on demand (why one was started, or why none could be).
    pub on_demand_note: Option<String>,
}

#[derive(Default, Debug, Clone)]
pub struct Metrics {
    pub jobs_submitted: u64,
    pub jobs_succeeded: u64,
    pub jobs_failed: u64,
    pub jobs_cancelled: u64,
    pub jobs_redispatched: u64,
    pub jobs_rerun: u64,
    pub jobs_worker_lost: u64,
    pub sync_requests: u64,
    pub sync_rerun: u64,
    pub sync_worker_lost: u64,
    pub model_switches: u64,
    pub on_demand_started: u64,
    pub on_demand_stopped: u64,
    pub rejected_queue_full: u64,
    pub worker_restarts: u64,
}

pub struct Hive {
    pub config: HiveConfig,
    /// The registration token actually in force (configured, or generated at start).
    pub token: String,
    /// `http://<hive>/v1/workers/register` as spawned workers must call it.
    pub callback_url: String,
    pub devices: Mutex<Vec<Row>>,
    pub client: reqwest::Client,
    state: Mutex<State>,
    pub supervisors: Mutex<HashMap<String, supervisor::Handle>>,
    pub spawner: supervisor::Spawner,
    /// Flips to true when the hive shuts down; background tasks watch it.
    pub shutdown: watch::Sender<bool>,
    /// Woken when requests remain waiting: `capacity` looks whether to start a worker for them.
    pub capacity_wake: tokio::sync::Notify,
}

impl Hive {
    pub fn new(config: HiveConfig, token: String, callback_url: String) -> Result<Arc<Hive>, HiveError> {
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| HiveError::Client(e.to_string()))?;
        Ok(Arc::new(Hive {
            config,
            token,
            callback_url,
            devices: Mutex::new(Vec::new()),
            client,
            state: Mutex::new(State::default()),
            supervisors: Mutex::new(HashMap::new()),
            spawner: supervisor::Spawner::start(),
            shutdown: watch::channel(false).0,
            capacity_wake: tokio::sync::Notify::new(),
        }))
    }

    /// The state lock. A panic while holding it leaves data that is still consistent enough to serve (each
    /// mutation is a few field writes), so poisoning is not fatal.
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HiveError {
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
    #[error("cannot bind {addr}: {source}")]
    Bind { addr: std::net::SocketAddr, source: std::io::Error },
    #[error("server error: {0}")]
    Serve(std::io::Error),
    #[error("cannot read the model library: {0}")]
    Catalog(String),
    #[error("cannot join the parent hive: {0}")]
    Parent(String),
}

pub fn unix_now() -> f64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// 96 random bits as hex, for job ids and generated tokens.
pub fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    if getrandom::fill(&mut buf).is_err() {
        // Uniqueness, not secrecy, is what ids need; tokens come from here too, so mix in what varies.
        let seed = unix_now().to_bits() ^ u64::from(std::process::id());
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (seed.rotate_left(i as u32 * 7) & 0xff) as u8;
        }
    }
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

/// Binds, detects, spawns the planned workers, and serves until `shutdown` resolves; then drains (no new
/// jobs; running ones get `drain_grace_secs`), stops the workers (SIGTERM, SIGKILL after `stop_grace_secs`)
/// and returns. `on_bound` gets the bound address (the port when `bind` asked for port 0).
pub async fn serve(
    config: HiveConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    on_bound: impl FnOnce(std::net::SocketAddr),
) -> Result<(), HiveError> {
    let listener = tokio::net::TcpListener::bind(config.bind)
        .await
        .map_err(|source| HiveError::Bind { addr: config.bind, source })?;
    let addr = listener.local_addr().map_err(HiveError::Serve)?;
    // Children reach a hive bound to a wildcard address through loopback.
    let reach = if addr.ip().is_unspecified() {
        let loopback: std::net::IpAddr = if addr.is_ipv6() {
            std::net::Ipv6Addr::LOCALHOST.into()
        } else {
            std::net::Ipv4Addr::LOCALHOST.into()
        };
        std::net::SocketAddr::new(loopback, addr.port())
    } else {
        addr
    };
    let callback_url = format!("http://{reach}/v1/workers/register");
    let token = match &config.token {
        Some(t) => t.clone(),
        None => {
            tracing::info!(
                "no token configured: generated one for this run (external workers need SDHIVE_TOKEN set)"
            );
            random_hex(24)
        }
    };
    if !config.credentials().required() && !config.is_loopback() {
        tracing::warn!(bind = %addr, "listening beyond loopback without api_key or api_auth: admin routes are disabled");
    }
    let hive = Hive::new(config, token, callback_url)?;

    let scan_config = hive.config.clone();
    let catalog = tokio::task::spawn_blocking(move || models::scan(&scan_config))
        .await
        .map_err(|e| HiveError::Catalog(e.to_string()))?
        .map_err(|e| HiveError::Catalog(e.to_string()))?;
    {
        let mut state = hive.lock();
        state.selected = models::initial_selection(&hive.config, &catalog);
        state.catalog = catalog;
    }

    let planned = if hive.config.cluster.gateway {
        tracing::info!("gateway: no workers of its own; node hives and workers register with it");
        plan::Plan::default()
    } else {
        let devices = detect::detect().await;
        plan::plan(&devices, &hive.config, plan::Probe::read(&hive.config).await)
    };
    for row in &planned.rows {
        if let plan::Status::MissingBinary { binary } = &row.status {
            tracing::warn!(
                backend = %row.device.backend, index = row.device.index, device = %row.device.name,
                "worker binary missing: {} (this backend cannot serve the device)", binary.display()
            );
        }
    }
    if hive.config.models.is_empty() && hive.config.models_dirs.is_empty() && !hive.config.cluster.gateway {
        tracing::warn!("no model or models dir configured: only externally started workers will serve");
    }
    for note in models::preload_notes(&planned, &hive.lock().catalog) {
        if note.warn {
            tracing::warn!("{}", note.text);
        } else {
            tracing::info!("{}", note.text);
        }
    }
    *hive.devices.lock().unwrap_or_else(|p| p.into_inner()) = planned.rows.clone();
    {
        let mut supervisors = hive.supervisors.lock().unwrap_or_else(|p| p.into_inner());
        for (n, worker) in planned.workers.into_iter().enumerate() {
            let port = match hive.config.worker_port_base {
                0 => 0,
                base => base.saturating_add(u16::try_from(n).unwrap_or(u16::MAX)),
            };
            let id = worker.worker_id.clone();
            supervisors.insert(id, supervisor::start(&hive, supervisor::Spec::planned(worker, port)));
        }
    }
    tokio::spawn(housekeeping(hive.clone()));
    tokio::spawn(capacity::run(hive.clone()));

    let app = api::router(hive.clone());
    let mut stopped = hive.shutdown.subscribe();
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        let _ = stopped.wait_for(|s| *s).await;
    });
    on_bound(addr);
    tracing::info!(%addr, "hive listening");
    let server = tokio::spawn(async move { server.await });
    let parent = match cluster::join_parent(&hive, addr) {
        Ok(link) => link,
        Err(e) => {
            let _ = hive.shutdown.send(true);
            return Err(HiveError::Parent(e));
        }
    };
    shutdown.await;
    drain(&hive).await;
    if let Some(link) = parent {
        link.leave().await;
    }
    let _ = hive.shutdown.send(true);
    // Event streams of jobs that outlived the drain may hold connections open; do not wait on them forever.
    match tokio::time::timeout(Duration::from_secs(2), server).await {
        Ok(Ok(Err(e))) => Err(HiveError::Serve(e)),
        _ => Ok(()),
    }
}

/// Health sweep, job expiry, and re-pumping the queue once cooldowns pass.
async fn housekeeping(hive: Arc<Hive>) {
    let interval = hive.config.heartbeat_interval();
    // Fine enough that a silent worker is seen within a quarter interval of its deadline.
    let tick = (interval / 4).clamp(Duration::from_millis(100), Duration::from_secs(1));
    let ttl = Duration::from_secs(hive.config.job_ttl_secs);
    let mut stop = hive.shutdown.subscribe();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let (starts, hung) = {
            let mut state = hive.lock();
            let now = std::time::Instant::now();
            let mut starts = Vec::new();
            for (id, epoch) in state.sweep(now, interval) {
                starts.extend(router::worker_lost(&hive, &mut state, &id, epoch, "stopped heartbeating"));
            }
            // A managed worker silent this long is hung (or stopped): restarting it is the only cure.
            let hung: Vec<String> = state
                .workers
                .values()
                .filter(|w| w.managed && w.status == registry::WorkerStatus::Unhealthy && w.pid.is_some())
                .filter(|w| w.last_seen.is_some_and(|t| now.saturating_duration_since(t) > interval * 6))
                .map(|w| w.id.clone())
                .collect();
            router::expire_jobs(&mut state, ttl, now);
            starts.extend(router::pump(&hive, &mut state));
            (starts, hung)
        };
        router::start_dispatches(&hive, starts);
        if !hung.is_empty() {
            let supervisors = hive.supervisors.lock().unwrap_or_else(|p| p.into_inner());
            for id in hung {
                if let Some(h) = supervisors.get(&id) {
                    h.kill.notify_waiters();
                }
            }
        }
    }
}

/// SIGTERM: stop taking jobs, let the running ones finish (up to the drain grace), then stop every worker.
async fn drain(hive: &Arc<Hive>) {
    tracing::info!("draining: no new jobs; waiting for running ones");
    hive.lock().draining = true;
    let deadline = std::time::Instant::now() + Duration::from_secs_f64(hive.config.drain_grace_secs);
    loop {
        let busy = {
            let state = hive.lock();
            router::active_jobs(&state) + state.workers.values().map(|w| w.inflight).sum::<usize>()
        };
        if busy == 0 || std::time::Instant::now() >= deadline {
            if busy > 0 {
                tracing::warn!(busy, "drain grace over; stopping workers with jobs still running");
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Waiting synchronous requests see their reply sender dropped and answer 503.
    router::fail_waiting(&mut hive.lock());
    let handles: Vec<supervisor::Handle> =
        hive.supervisors.lock().unwrap_or_else(|p| p.into_inner()).drain().map(|(_, h)| h).collect();
    for h in &handles {
        let _ = h.stop.send(true);
    }
    for h in handles {
        let _ = h.task.await;
    }
    tracing::info!("all workers stopped");
}
