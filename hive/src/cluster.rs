//! This hive as a node of a cluster: what it tells its parent hive (a gateway) when it registers and in every
//! heartbeat — through the same `sdhive-uplink` code a worker uses, since to its parent a hive is a worker with
//! several slots, several devices and several models loaded at once — and the tree of workers a gateway shows.
//!
//! Models travel between hives by their library name (A1111's `name`, relative to the models dir): node hives
//! that mount the same models volume at any path then offer the same model under the same name, and a node
//! resolves the name it is sent exactly as a client's.

use crate::registry::WorkerEntry;
use crate::{models, Hive, State};
use sdhive_protocol::{
    DeviceDescription, Heartbeat, LibraryModel, NodeSummary, RegisterRequest, WorkerState, PROTOCOL_VERSION,
};
use sdhive_uplink::{Registrant, Uplink, UplinkConfig};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// The name under which a model of this hive is known to its parent: a catalogue checkpoint by its library
/// name, anything else (a worker's `--model` outside the library, a model of a node below) as it is.
pub fn name_for_parent(state: &State, source: &str) -> String {
    match state.catalog.checkpoints.iter().find(|c| c.path.as_os_str() == source) {
        Some(c) => c.name.clone(),
        None => source.to_string(),
    }
}

/// Every model this hive can run, as its parent should route them.
pub fn library(state: &State) -> Vec<LibraryModel> {
    models::list(state)
        .into_iter()
        .map(|l| {
            let mut m = LibraryModel::from(&l.model);
            m.filename = name_for_parent(state, &l.model.filename);
            m
        })
        .collect()
}

/// Slots, loaded models and devices now.
pub fn summary(hive: &Hive, state: &State, now: Instant) -> NodeSummary {
    let ready: Vec<&WorkerEntry> = state.workers.values().filter(|w| w.routable(now)).collect();
    let mut loaded: Vec<String> = Vec::new();
    for w in &ready {
        let held = w.loaded.iter().chain(w.node.iter().flat_map(|n| &n.loaded));
        for m in held.map(|m| name_for_parent(state, m)) {
            if !loaded.contains(&m) {
                loaded.push(m);
            }
        }
    }
    let mut devices: Vec<DeviceDescription> = Vec::new();
    for w in &ready {
        let own = w.registration.iter().filter(|_| !w.is_hive()).map(|r| &r.device);
        for d in own.chain(w.node.iter().flat_map(|n| &n.devices)) {
            if !devices.iter().any(|x| x.backend == d.backend && x.index == d.index && x.name == d.name) {
                devices.push(d.clone());
            }
        }
    }
    let slots: usize = ready.iter().map(|w| w.slots(hive.config.worker_slots)).sum();
    NodeSummary {
        slots: u32::try_from(slots).unwrap_or(u32::MAX),
        loaded,
        devices,
        workers: state.workers.values().filter(|w| crate::router::may_serve(w)).count() as u32,
        workers_ready: ready.len() as u32,
    }
}

/// The node hive as its parent sees it.
pub struct NodeRegistrant {
    pub hive: Arc<Hive>,
    pub id: String,
    pub base_url: String,
    pub started_at: f64,
}

impl NodeRegistrant {
    fn device(&self, node: &NodeSummary) -> DeviceDescription {
        let sum = |f: fn(&DeviceDescription) -> Option<u64>| node.devices.iter().map(f).sum::<Option<u64>>();
        DeviceDescription {
            backend: "hive".into(),
            index: 0,
            name: self.id.clone(),
            memory_total_bytes: sum(|d| d.memory_total_bytes),
            memory_free_bytes: sum(|d| d.memory_free_bytes),
            driver: None,
        }
    }
}

impl Registrant for NodeRegistrant {
    fn id(&self) -> String {
        self.id.clone()
    }

    fn library(&self) -> Vec<LibraryModel> {
        library(&self.hive.lock())
    }

    fn registration(&self, library: Vec<LibraryModel>) -> RegisterRequest {
        let state = self.hive.lock();
        let node = summary(&self.hive, &state, Instant::now());
        // What its workers can do (the first registration waits for one to be ready).
        let now = Instant::now();
        let first = state.workers.values().filter(|w| w.routable(now)).find_map(|w| w.registration.as_ref());
        let capabilities = first.map(|r| r.capabilities.clone());
        let family = first.map(|r| r.model_family.clone()).unwrap_or_default();
        RegisterRequest {
            protocol_version: PROTOCOL_VERSION,
            worker_id: self.id.clone(),
            base_url: self.base_url.clone(),
            api_key_required: self.hive.config.api_key.is_some(),
            backend: "hive".into(),
            device: self.device(&node),
            model: String::new(),
            model_source: None,
            switchable: true,
            library: Some(library),
            model_family: family,
            capabilities: capabilities.unwrap_or_else(no_capabilities),
            version: env!("CARGO_PKG_VERSION").into(),
            pid: std::process::id(),
            started_at: self.started_at,
            node: Some(node),
        }
    }

    fn heartbeat(&self) -> Heartbeat {
        let state = self.hive.lock();
        let now = Instant::now();
        let node = summary(&self.hive, &state, now);
        let outstanding = state.queue.len() + state.workers.values().map(|w| w.inflight).sum::<usize>();
        let m = &state.metrics;
        let device = self.device(&node);
        Heartbeat {
            worker_id: self.id.clone(),
            state: if state.draining {
                WorkerState::Draining
            } else if outstanding > 0 {
                WorkerState::Busy
            } else {
                WorkerState::Idle
            },
            queue_depth: outstanding,
            running_job: None,
            memory_total_bytes: device.memory_total_bytes,
            memory_free_bytes: device.memory_free_bytes,
            jobs_succeeded: m.jobs_succeeded,
            jobs_failed: m.jobs_failed,
            jobs_cancelled: m.jobs_cancelled,
            uptime_secs: (crate::unix_now() - self.started_at).max(0.0),
            model: None,
            model_source: None,
            library: None,
            node: Some(node),
        }
    }
}

/// Only when no worker of the node is ready at a registration (a re-registration while its workers restart):
/// its `slots` of 0 keep the parent from routing here meanwhile.
fn no_capabilities() -> sdhive_protocol::Capabilities {
    sdhive_protocol::Capabilities {
        engine: "hive".into(),
        dtype: String::new(),
        samplers: Vec::new(),
        schedulers: Vec::new(),
        native_width: 512,
        native_height: 512,
        max_width: 0,
        max_height: 0,
        max_steps: 0,
        max_n: 0,
        max_prompt_chars: 0,
        max_queue: 0,
        max_body_bytes: 0,
        img2img: false,
        inpaint: false,
        preview: false,
        max_batch: 1,
        gfx_targets: Vec::new(),
    }
}

/// The link to the parent while it runs.
pub struct ParentLink {
    pub uplink: Arc<Uplink<NodeRegistrant>>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl ParentLink {
    /// Tells the parent this node leaves (after the drain) and stops heartbeating.
    pub async fn leave(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
        self.uplink.deregister("shutdown").await;
    }
}

/// Starts registering with the parent (`cluster.parent`), once a worker of this hive is ready — as a worker
/// registers once its model is loaded — so the parent never routes to a node that cannot run anything yet.
pub fn join_parent(hive: &Arc<Hive>, bound: std::net::SocketAddr) -> Result<Option<ParentLink>, String> {
    let cluster = &hive.config.cluster;
    let Some(url) = cluster.parent_register_url() else { return Ok(None) };
    let url = url?;
    let id = cluster.node_id.clone().unwrap_or_else(crate::plan::host_prefix);
    let base_url = match &cluster.advertise_url {
        Some(_) => hive.config.advertise_url(),
        None => format!("http://{bound}"),
    };
    let registrant = NodeRegistrant {
        hive: hive.clone(),
        id: id.clone(),
        base_url: base_url.clone(),
        started_at: crate::unix_now(),
    };
    let config = UplinkConfig::new(url.to_string(), cluster.parent_token.clone());
    let uplink = Arc::new(Uplink::new(config, registrant).map_err(|e| e.to_string())?);
    let (stop, mut stop_rx) = watch::channel(false);
    let task = tokio::spawn({
        let uplink = uplink.clone();
        let hive = hive.clone();
        async move {
            loop {
                let ready = {
                    let state = hive.lock();
                    let now = Instant::now();
                    state.workers.values().any(|w| w.routable(now))
                };
                if ready {
                    break;
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                    _ = stop_rx.wait_for(|s| *s) => return,
                }
            }
            tracing::info!(parent = %url, node = %id, base_url, "joining the parent hive");
            uplink.run(stop_rx).await;
        }
    });
    Ok(Some(ParentLink { uplink, stop, task }))
}
