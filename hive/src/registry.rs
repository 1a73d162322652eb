//! The worker table: one entry per worker id, spawned here ("managed", planned or started on demand) or
//! registered from elsewhere ("external"); registration validation, heartbeats (with the models each worker
//! can load), and the health sweep that turns silent workers unhealthy (and forgets silent external ones).
//! Which jobs a lost worker held is the router's business.

use crate::plan::valid_worker_id;
use crate::State;
use sdhive_protocol::{Heartbeat, LibraryModel, NodeSummary, RegisterRequest, WorkerState, PROTOCOL_VERSION};
use serde::Serialize;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// `starting → ready → busy ↔ ready → draining → stopped`, plus `unhealthy` (silent: not routed) and
/// `failed` (crash loop: no more restarts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerStatus {
    Starting,
    Ready,
    Busy,
    Draining,
    Unhealthy,
    Stopped,
    Failed,
}

/// Lines of a managed worker's stderr kept for `GET /v1/workers`.
pub const STDERR_TAIL: usize = 50;

#[derive(Debug, Clone)]
pub struct WorkerEntry {
    pub id: String,
    /// Spawned and restarted by this hive (else: registered by itself; tracked by heartbeat only).
    pub managed: bool,
    pub status: WorkerStatus,
    pub backend: String,
    pub device_index: Option<usize>,
    /// The model argument a managed worker was started with (`None`: it loads its library's first checkpoint).
    pub planned_model: Option<String>,
    /// `planned_model` as the worker will report it once loaded (`model_source`): a library checkpoint's
    /// canonical path, or the argument itself.
    pub planned_source: Option<String>,
    /// The model this worker has loaded once everything the hive sent it has run (the source of the last
    /// request dispatched to it; between requests, what its heartbeats report). `None`: nothing loaded.
    pub loaded: Option<String>,
    /// When a request for `loaded` was last dispatched here: the least recently used model is switched first.
    pub last_used: Option<Instant>,
    pub registration: Option<RegisterRequest>,
    /// Bumped whenever the worker's previous life ends (death, restart, re-registration by a new process):
    /// jobs and slots remember the epoch they were given in, so stale ones are recognised.
    pub epoch: u64,
    pub last_seen: Option<Instant>,
    pub heartbeat: Option<Heartbeat>,
    /// Jobs and synchronous requests the hive has in flight on this worker.
    pub inflight: usize,
    /// Not routed until then (it just refused a job as full or unreachable).
    pub cooldown_until: Option<Instant>,
    pub restarts: u32,
    pub pid: Option<u32>,
    pub last_exit: Option<String>,
    pub stderr_tail: VecDeque<String>,
    /// `DELETE /v1/workers/{id}` or hive shutdown: finish what it has, take nothing new.
    pub stop_requested: bool,
    /// The checkpoints the worker says it can load (its registration, then heartbeats when it changes).
    pub library: Vec<LibraryModel>,
    /// Set for a worker the hive started on demand: for which model, and why.
    pub on_demand: Option<OnDemand>,
    /// When the hive last gave it a request or got one back: how long an on-demand worker has been idle.
    pub last_active: Option<Instant>,
    /// A hive registered as this entry (a node under this gateway): its slots, devices and loaded models, as its
    /// registration and latest heartbeat say.
    pub node: Option<NodeSummary>,
}

/// Why a worker was started on demand, and what became of it.
#[derive(Debug, Clone, PartialEq)]
pub struct OnDemand {
    /// The model it was started for (a catalogue checkpoint's path).
    pub model: String,
    pub reason: String,
    pub started_at: Instant,
    /// Why it stopped, and whether that was a failure (it exited by itself) rather than idleness.
    pub ended: Option<(Instant, String, bool)>,
}

impl WorkerEntry {
    /// Requests the hive keeps in flight here: `worker_slots`, or enough for the worker to fill a batch
    /// (`--max-batch`) while it runs one.
    pub fn slots(&self, worker_slots: usize) -> usize {
        if let Some(node) = &self.node {
            return node.slots as usize;
        }
        match self.registration.as_ref().map_or(1, |r| r.capabilities.max_batch as usize) {
            batch if batch > 1 => worker_slots.max(batch + 1),
            _ => worker_slots,
        }
    }

    pub fn managed(id: &str, backend: &str, device_index: usize, model: Option<&str>) -> WorkerEntry {
        WorkerEntry {
            id: id.into(),
            managed: true,
            status: WorkerStatus::Starting,
            backend: backend.into(),
            device_index: Some(device_index),
            planned_model: model.map(String::from),
            planned_source: None,
            loaded: None,
            last_used: None,
            registration: None,
            epoch: 0,
            last_seen: None,
            heartbeat: None,
            inflight: 0,
            cooldown_until: None,
            restarts: 0,
            pid: None,
            last_exit: None,
            stderr_tail: VecDeque::new(),
            stop_requested: false,
            library: Vec::new(),
            on_demand: None,
            last_active: None,
            node: None,
        }
    }

    /// A hive under this one: it switches models and spreads requests over its own workers.
    pub fn is_hive(&self) -> bool {
        self.node.is_some()
    }

    /// Whether it has `model` loaded (a worker: once what the hive sent it has run; a hive: on some worker).
    pub fn holds(&self, model: &str) -> bool {
        self.loaded.as_deref() == Some(model)
            || self.node.as_ref().is_some_and(|n| n.loaded.iter().any(|m| m == model))
    }

    fn external(req: &RegisterRequest) -> WorkerEntry {
        WorkerEntry {
            managed: false,
            status: WorkerStatus::Starting,
            backend: req.backend.clone(),
            device_index: Some(req.device.index),
            planned_model: None,
            pid: Some(req.pid),
            ..WorkerEntry::managed(&req.worker_id, &req.backend, req.device.index, None)
        }
    }

    pub fn base_url(&self) -> Option<&str> {
        self.registration.as_ref().map(|r| r.base_url.as_str())
    }

    /// Registered and heard from recently: a second registration of this id from elsewhere is a conflict.
    pub fn is_live(&self) -> bool {
        self.registration.is_some()
            && matches!(self.status, WorkerStatus::Ready | WorkerStatus::Busy | WorkerStatus::Draining)
    }

    pub fn routable(&self, now: Instant) -> bool {
        self.registration.is_some()
            && !self.stop_requested
            && matches!(self.status, WorkerStatus::Ready | WorkerStatus::Busy)
            && self.cooldown_until.is_none_or(|t| now >= t)
    }

    /// The model this worker can load without a library: the one it registered with (or, before registering,
    /// the one it was started with).
    pub fn own_source(&self) -> Option<&str> {
        self.registration.as_ref().and_then(|r| r.model_source.as_deref()).or(self.planned_source.as_deref())
    }

    /// Whether it can run requests for `source`: its own model, any model of the library it reported, or — for
    /// a worker this hive started, which got the hive's models dirs — any checkpoint of the hive's catalogue.
    pub fn can_load(&self, source: &str, in_catalog: bool) -> bool {
        self.loaded.as_deref() == Some(source)
            || self.own_source() == Some(source)
            || (self.managed && in_catalog && crate::models::backend_loads(&self.backend, source))
            || self.library.iter().any(|m| m.filename == source)
    }

    /// Counts toward a device's workers: up, on its way up, or stopping — not stopped or failed.
    pub fn occupies_device(&self) -> bool {
        !matches!(self.status, WorkerStatus::Stopped | WorkerStatus::Failed)
    }

    /// The engine's name for what it registered with, or the argument it was started with.
    pub fn model_name(&self) -> Option<&str> {
        self.registration
            .as_ref()
            .map(|r| r.model.as_str())
            .filter(|m| !m.is_empty())
            .or(self.planned_model.as_deref())
    }

    /// Load for "least queued first": what the hive sent plus what the worker says it is doing for others.
    pub fn load(&self) -> usize {
        let reported = self.heartbeat.as_ref().map(|h| h.queue_depth + usize::from(h.running_job.is_some()));
        self.inflight.max(reported.unwrap_or(0))
    }

    pub fn push_stderr(&mut self, line: String) {
        if self.stderr_tail.len() == STDERR_TAIL {
            self.stderr_tail.pop_front();
        }
        self.stderr_tail.push_back(line);
    }

    /// `GET /v1/workers` entry.
    pub fn view(&self, now: Instant) -> serde_json::Value {
        let reg = self.registration.as_ref();
        let on_demand = self.on_demand.as_ref().map(|o| {
            serde_json::json!({
                "model": o.model,
                "reason": o.reason,
                "started_secs_ago": now.saturating_duration_since(o.started_at).as_secs_f64(),
                "stopped": o.ended.as_ref().map(|(_, why, _)| why),
            })
        });
        serde_json::json!({
            "id": self.id,
            "managed": self.managed,
            "state": self.status,
            "backend": self.backend,
            "device_index": self.device_index,
            "model": self.model_name(),
            "preloads": self.planned_model,
            "loaded_source": self.loaded,
            "switchable": reg.map(|r| r.switchable),
            "base_url": reg.map(|r| &r.base_url),
            "device": reg.map(|r| &r.device),
            "capabilities": reg.map(|r| &r.capabilities),
            "version": reg.map(|r| &r.version),
            "pid": self.pid.or(reg.map(|r| r.pid)),
            "inflight": self.inflight,
            "queue_depth": self.heartbeat.as_ref().map(|h| h.queue_depth),
            "running_job": self.heartbeat.as_ref().and_then(|h| h.running_job.as_ref()),
            "last_heartbeat_secs_ago": self.last_seen.map(|t| now.duration_since(t).as_secs_f64()),
            "restarts": self.restarts,
            "last_exit": self.last_exit,
            "stderr_tail": self.stderr_tail,
            "library_models": self.library.len(),
            "kind": if self.is_hive() { "hive" } else { "worker" },
            "node": self.node,
            "on_demand": on_demand,
            "idle_secs": self.last_active.filter(|_| self.inflight == 0)
                .map(|t| now.saturating_duration_since(t).as_secs_f64()),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Conflict(String),
}

/// What a successful registration changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    /// The previous life of this id ended (a new process took its place): its jobs are lost.
    pub lost_epoch: Option<u64>,
}

/// Checks everything about a registration that does not depend on the table.
pub fn validate(req: &RegisterRequest) -> Result<(), RegisterError> {
    if req.protocol_version != PROTOCOL_VERSION {
        return Err(RegisterError::Invalid(format!(
            "protocol_version {} is not supported; this hive speaks {PROTOCOL_VERSION}",
            req.protocol_version
        )));
    }
    if !valid_worker_id(&req.worker_id) {
        return Err(RegisterError::Invalid("worker_id must match [A-Za-z0-9._-]{1,64}".into()));
    }
    let url = reqwest::Url::parse(&req.base_url)
        .map_err(|e| RegisterError::Invalid(format!("base_url `{}` is not a URL: {e}", req.base_url)))?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
        return Err(RegisterError::Invalid("base_url must be an http(s) URL with a host".into()));
    }
    if !url.username().is_empty() || url.password().is_some() || url.query().is_some() {
        return Err(RegisterError::Invalid("base_url must not carry credentials or a query".into()));
    }
    Ok(())
}

impl State {
    /// Records a registration (the token was checked by the caller).
    pub fn register(&mut self, req: RegisterRequest, now: Instant) -> Result<Registered, RegisterError> {
        validate(&req)?;
        let base_url = req.base_url.trim_end_matches('/').to_string();
        let req = RegisterRequest { base_url, ..req };
        let entry = self.workers.entry(req.worker_id.clone()).or_insert_with(|| WorkerEntry::external(&req));
        if entry.managed && entry.pid.is_some_and(|pid| pid != req.pid) {
            return Err(RegisterError::Conflict(format!(
                "worker id `{}` belongs to a worker this hive spawned (pid {:?})",
                req.worker_id, entry.pid
            )));
        }
        if entry.is_live() && entry.base_url() != Some(req.base_url.as_str()) {
            return Err(RegisterError::Conflict(format!(
                "worker id `{}` is already registered by a live worker at {}",
                req.worker_id,
                entry.base_url().unwrap_or("?")
            )));
        }
        let same_process =
            entry.registration.as_ref().is_some_and(|r| r.pid == req.pid && r.base_url == req.base_url);
        let mut lost_epoch = None;
        if entry.registration.is_some() && !same_process {
            lost_epoch = Some(entry.epoch);
            entry.epoch += 1;
            entry.inflight = 0;
        }
        if !entry.managed {
            entry.pid = Some(req.pid);
            entry.backend = req.backend.clone();
            entry.device_index = Some(req.device.index);
        }
        entry.loaded = match &req.model_source {
            Some(source) => Some(source.clone()),
            // A library worker that has nothing loaded yet.
            None if req.switchable => None,
            // A worker that predates model switching: its one model, by its start argument or its name.
            None => {
                entry.planned_source.clone().or_else(|| (!req.model.is_empty()).then(|| req.model.clone()))
            }
        };
        entry.library = req.library.clone().unwrap_or_default();
        entry.node = req.node.clone();
        entry.registration = Some(req);
        entry.status = if entry.stop_requested { WorkerStatus::Draining } else { WorkerStatus::Ready };
        entry.last_seen = Some(now);
        entry.heartbeat = None;
        entry.cooldown_until = None;
        Ok(Registered { lost_epoch })
    }

    /// `false`: unknown id (the worker must register again).
    pub fn heartbeat(&mut self, id: &str, mut hb: Heartbeat, now: Instant) -> bool {
        let Some(entry) = self.workers.get_mut(id) else { return false };
        if entry.registration.is_none() {
            return false;
        }
        if let Some(library) = hb.library.take() {
            tracing::info!(worker = %entry.id, models = library.len(), "worker reports a changed model library");
            entry.library = library;
        }
        entry.last_seen = Some(now);
        if let Some(node) = hb.node.take() {
            entry.node = Some(node);
        }
        if matches!(
            entry.status,
            WorkerStatus::Ready | WorkerStatus::Busy | WorkerStatus::Unhealthy | WorkerStatus::Draining
        ) {
            entry.status = match hb.state {
                _ if entry.stop_requested => WorkerStatus::Draining,
                WorkerState::Draining => WorkerStatus::Draining,
                WorkerState::Busy => WorkerStatus::Busy,
                WorkerState::Idle if entry.inflight > 0 => WorkerStatus::Busy,
                WorkerState::Idle => WorkerStatus::Ready,
            };
        }
        // What the worker has loaded counts only while the hive has nothing on it: with requests in flight, the
        // last one dispatched decides what it will have loaded, and a heartbeat may predate it.
        let reports_models =
            hb.model_source.is_some() || entry.registration.as_ref().is_some_and(|r| r.switchable);
        if reports_models
            && entry.inflight == 0
            && hb.state == WorkerState::Idle
            && entry.loaded != hb.model_source
        {
            tracing::info!(worker = %entry.id, model = ?hb.model_source, "worker reports another loaded model");
            entry.loaded = hb.model_source.clone();
        }
        entry.heartbeat = Some(hb);
        true
    }

    /// Marks workers unhealthy once they missed two heartbeats and half the time of a third (so a loss is seen
    /// within three intervals of the last heartbeat, sweeps included), and forgets external ones silent for 6
    /// intervals (their next heartbeat gets 404 and they register again). An external worker or node hive turning unhealthy ends its
    /// life there and then: nothing tells this hive about it but its heartbeats (a cut link sends no reset), so
    /// what it held runs again elsewhere rather than waiting on it. Returns `(id, epoch)` of each life ended.
    pub fn sweep(&mut self, now: Instant, interval: Duration) -> Vec<(String, u64)> {
        let mut ended = Vec::new();
        let mut forgotten = Vec::new();
        for entry in self.workers.values_mut() {
            let Some(seen) = entry.last_seen else { continue };
            if entry.registration.is_none() {
                continue;
            }
            let silent = now.saturating_duration_since(seen);
            if silent > interval * 5 / 2
                && matches!(entry.status, WorkerStatus::Ready | WorkerStatus::Busy | WorkerStatus::Draining)
            {
                tracing::warn!(worker = %entry.id, silent_secs = silent.as_secs_f64(), "missed heartbeats: unhealthy");
                entry.status = WorkerStatus::Unhealthy;
                if !entry.managed {
                    ended.push((entry.id.clone(), entry.epoch));
                    entry.epoch += 1;
                    entry.inflight = 0;
                }
            }
            if !entry.managed && silent > interval * 6 {
                forgotten.push(entry.id.clone());
            }
        }
        for id in &forgotten {
            tracing::warn!(worker = %id, "external worker silent too long: forgotten");
            self.workers.remove(id);
        }
        ended
    }

    /// The worker said goodbye; returns the epoch whose jobs are lost.
    pub fn deregister(&mut self, id: &str) -> Option<u64> {
        let entry = self.workers.get_mut(id)?;
        entry.status = WorkerStatus::Stopped;
        entry.registration.as_ref()?;
        let epoch = entry.epoch;
        entry.epoch += 1;
        entry.inflight = 0;
        entry.registration = None;
        Some(epoch)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use sdhive_protocol::{Capabilities, DeviceDescription};

    pub(crate) fn request(id: &str, url: &str, pid: u32) -> RegisterRequest {
        RegisterRequest {
            protocol_version: PROTOCOL_VERSION,
            worker_id: id.into(),
            base_url: url.into(),
            api_key_required: false,
            backend: "cpu".into(),
            device: DeviceDescription {
                backend: "cpu".into(),
                index: 0,
                name: "cpu".into(),
                memory_total_bytes: None,
                memory_free_bytes: None,
                driver: None,
            },
            model: "sd1".into(),
            model_source: None,
            switchable: false,
            library: None,
            model_family: "sd1".into(),
            capabilities: Capabilities {
                engine: "candle".into(),
                dtype: "f32".into(),
                samplers: vec![],
                schedulers: vec![],
                native_width: 64,
                native_height: 64,
                max_width: 64,
                max_height: 64,
                max_steps: 10,
                max_n: 1,
                max_prompt_chars: 10,
                max_queue: 4,
                max_body_bytes: 1000,
                img2img: false,
                inpaint: false,
                preview: false,
                max_batch: 1,
                gfx_targets: Vec::new(),
            },
            version: "0".into(),
            pid,
            started_at: 0.0,
            node: None,
        }
    }

    #[test]
    fn a_batching_worker_gets_slots_to_fill_its_batch() {
        let mut w = WorkerEntry::managed("w", "cuda", 0, None);
        assert_eq!(w.slots(2), 2, "before registering");
        w.registration = Some(request("w", "http://127.0.0.1:1", 1));
        assert_eq!(w.slots(1), 1, "a worker that does not batch keeps the setting");
        let mut reg = request("w", "http://127.0.0.1:1", 1);
        reg.capabilities.max_batch = 8;
        w.registration = Some(reg);
        assert_eq!(w.slots(2), 9);
        assert_eq!(w.slots(12), 12, "a larger setting stays");
        let old: RegisterRequest = serde_json::from_value({
            let mut v = serde_json::to_value(request("w", "http://127.0.0.1:1", 1)).unwrap();
            v["capabilities"].as_object_mut().unwrap().remove("max_batch");
            v
        })
        .unwrap();
        assert_eq!(old.capabilities.max_batch, 1, "older workers do not batch");
    }

    #[test]
    fn registration_validation() {
        assert!(validate(&request("w1", "http://127.0.0.1:1", 1)).is_ok());
        for bad_url in ["file:///etc/passwd", "127.0.0.1:80", "http://u:p@h:1", "javascript:alert(1)"] {
            assert!(validate(&request("w1", bad_url, 1)).is_err(), "{bad_url}");
        }
        for bad_id in ["", "a b", "../x", "x;y", "é"] {
            assert!(validate(&request(bad_id, "http://h:1", 1)).is_err(), "{bad_id:?}");
        }
        let mut old = request("w1", "http://h:1", 1);
        old.protocol_version = 99;
        assert!(matches!(validate(&old), Err(RegisterError::Invalid(m)) if m.contains("99")));
    }

    #[test]
    fn duplicate_live_id_with_another_url_conflicts_but_same_url_reregisters() {
        let mut s = State::default();
        let now = Instant::now();
        assert_eq!(s.register(request("w1", "http://h:1", 10), now), Ok(Registered { lost_epoch: None }));
        assert!(matches!(s.register(request("w1", "http://h:2", 11), now), Err(RegisterError::Conflict(_))));
        // Same URL, same process (e.g. after a heartbeat 404): nothing lost.
        assert_eq!(s.register(request("w1", "http://h:1/", 10), now), Ok(Registered { lost_epoch: None }));
        // Same URL, new process (restarted): the previous life's jobs are lost.
        assert_eq!(s.register(request("w1", "http://h:1", 12), now), Ok(Registered { lost_epoch: Some(0) }));
        // Once the old one is silent (unhealthy), another URL may take the id.
        let later = now + Duration::from_secs(16);
        s.sweep(later, Duration::from_secs(5));
        assert_eq!(s.workers["w1"].status, WorkerStatus::Unhealthy);
        assert!(s.register(request("w1", "http://h:2", 13), later).is_ok());
    }

    #[test]
    fn managed_ids_cannot_be_claimed_by_other_processes() {
        let mut s = State::default();
        let mut e = WorkerEntry::managed("m1", "cpu", 0, Some("sd1"));
        e.pid = Some(100);
        s.workers.insert("m1".into(), e);
        assert!(matches!(
            s.register(request("m1", "http://h:1", 999), Instant::now()),
            Err(RegisterError::Conflict(_))
        ));
        assert!(s.register(request("m1", "http://h:1", 100), Instant::now()).is_ok());
        assert!(s.workers["m1"].routable(Instant::now()));
    }

    #[test]
    fn heartbeats_and_sweep() {
        let mut s = State::default();
        let t0 = Instant::now();
        s.register(request("w1", "http://h:1", 1), t0).unwrap();
        let hb = Heartbeat {
            worker_id: "w1".into(),
            state: WorkerState::Busy,
            queue_depth: 1,
            running_job: None,
            memory_total_bytes: None,
            memory_free_bytes: None,
            jobs_succeeded: 0,
            jobs_failed: 0,
            jobs_cancelled: 0,
            uptime_secs: 1.0,
            model: None,
            model_source: None,
            library: None,
            node: None,
        };
        assert!(!s.heartbeat("nobody", hb.clone(), t0), "unknown ids are told to register");
        assert!(s.heartbeat("w1", hb.clone(), t0));
        assert_eq!(s.workers["w1"].status, WorkerStatus::Busy);
        let i = Duration::from_secs(1);
        assert!(s.sweep(t0 + i * 2, i).is_empty());
        assert!(s.workers["w1"].routable(t0 + i * 2));
        s.workers.get_mut("w1").unwrap().inflight = 2;
        assert!(s.sweep(t0 + i * 5 / 2, i).is_empty(), "two heartbeats missed: not yet");
        assert_eq!(
            s.sweep(t0 + i * 3, i),
            vec![("w1".to_string(), 0)],
            "half a third one too: its life ends"
        );
        assert!(!s.workers["w1"].routable(t0 + i * 3), "and it is not routed");
        assert_eq!((s.workers["w1"].epoch, s.workers["w1"].inflight), (1, 0));
        assert!(s.sweep(t0 + i * 4, i).is_empty(), "once");
        assert!(s.heartbeat("w1", hb.clone(), t0 + i * 5), "a late heartbeat revives it");
        assert_eq!(s.workers["w1"].status, WorkerStatus::Busy);
        assert!(s.workers["w1"].routable(t0 + i * 5));
        assert_eq!(s.sweep(t0 + i * 9, i), vec![("w1".to_string(), 1)]);
        assert!(s.sweep(t0 + i * 12, i).is_empty());
        assert!(!s.workers.contains_key("w1"), "silent for 6 intervals: forgotten");
        assert!(!s.heartbeat("w1", hb, t0 + i * 12), "forgotten external workers get 404");
    }
}
