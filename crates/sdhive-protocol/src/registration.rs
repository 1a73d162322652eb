//! Worker ⇄ hive messages: the registration a worker posts once its model is loaded, the hive's answer (where
//! to send heartbeats and how often), the periodic heartbeat, and the deregistration on shutdown. The flow is
//! specified in `docs/protocol.md`. Both messages carry the worker's model library (the checkpoints it can load),
//! so a hive routes requests for any of them to it.

use crate::job::JobId;
use crate::models::ListedModel;
use serde::{Deserialize, Serialize};

/// Bumped on incompatible changes; a hive refuses registrations it cannot speak (4xx), the worker keeps retrying.
pub const PROTOCOL_VERSION: u32 = 1;

/// Used when the hive's registration answer does not say.
pub const DEFAULT_HEARTBEAT_INTERVAL_SECS: u64 = 5;

/// `POST <callback-url>` with `Authorization: Bearer <token>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegisterRequest {
    pub protocol_version: u32,
    pub worker_id: String,
    /// Where the hive reaches this worker's HTTP API (`http://host:port`, no trailing slash).
    pub base_url: String,
    /// Whether the worker's routes need `Authorization: Bearer <api key>`; the hive must hold that key.
    pub api_key_required: bool,
    pub backend: String,
    pub device: DeviceDescription,
    /// The loaded model's name (empty when the worker started without one).
    pub model: String,
    /// The loaded checkpoint as the worker's model library knows it: its canonical path (or the `--model`
    /// argument for a model outside the library). A hive scanning the same folders maps it to its catalogue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_source: Option<String>,
    /// Whether the worker switches models per request (it has a model library).
    #[serde(default)]
    pub switchable: bool,
    /// Every checkpoint the worker can load, as its `/sdapi/v1/sd-models` lists them. Absent from older
    /// workers: a hive then routes only the loaded model there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub library: Option<Vec<LibraryModel>>,
    /// `sd1`, `sd2`, `sdxl`, … as the engine detected it.
    pub model_family: String,
    pub capabilities: Capabilities,
    /// Worker version, e.g. `0.1.0`.
    pub version: String,
    pub pid: u32,
    /// Unix seconds at which the worker process started serving.
    pub started_at: f64,
    /// Present when the registrant is a hive joining a parent (a gateway): what it runs and holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<NodeSummary>,
}

/// What a hive registering with a parent says beyond what a worker says: to its parent it is a worker with
/// several slots, several devices and several models loaded at once. It comes with the registration and with
/// every heartbeat (a hive's workers come and go, and switch models).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSummary {
    /// Requests it runs at once: the slots of its routable workers together (0: none routable now).
    pub slots: u32,
    /// The models its workers hold loaded, as its library names them (`LibraryModel::filename`).
    pub loaded: Vec<String>,
    /// The devices its workers serve.
    pub devices: Vec<DeviceDescription>,
    /// Its workers, and how many of them are routable now.
    pub workers: u32,
    pub workers_ready: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceDescription {
    pub backend: String,
    pub index: usize,
    pub name: String,
    pub memory_total_bytes: Option<u64>,
    pub memory_free_bytes: Option<u64>,
    pub driver: Option<String>,
}

/// What requests this worker can run; a hive routes on these.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    pub engine: String,
    pub dtype: String,
    pub samplers: Vec<String>,
    pub schedulers: Vec<String>,
    pub native_width: u32,
    pub native_height: u32,
    pub max_width: u32,
    pub max_height: u32,
    pub max_steps: u32,
    pub max_n: u32,
    pub max_prompt_chars: usize,
    pub max_queue: usize,
    pub max_body_bytes: usize,
    pub img2img: bool,
    pub inpaint: bool,
    /// Previews during denoising (`preview_every`); false with `--preview off` and on engines that make none.
    pub preview: bool,
    /// The most images of queued jobs the worker denoises together (`--max-batch`); a hive keeps that many jobs
    /// queued on it so batches can form. Older workers: 1.
    #[serde(default = "one")]
    pub max_batch: u32,
    /// The AMD gfx targets a ROCm worker was built for (`gfx1030`, `gfx1100`); empty for other backends, or
    /// when the build did not record them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gfx_targets: Vec<String>,
}

fn one() -> u32 {
    1
}

/// The hive's 2xx answer to a registration. Relative URLs are resolved against the callback URL.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterResponse {
    /// `POST` heartbeats here.
    pub heartbeat_url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_interval_secs: Option<u64>,
    /// `POST` a [`Deregister`] here on shutdown; absent: the worker does not deregister (the hive times it out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deregister_url: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerState {
    /// Nothing running or queued.
    Idle,
    Busy,
    /// Shutting down: finishing its last job, accepting none.
    Draining,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunningJob {
    pub id: JobId,
    pub step: u32,
    pub total_steps: u32,
    pub image: u32,
    pub images: u32,
}

/// `POST <heartbeat_url>` every `heartbeat_interval_secs`. A 404 or 410 answer means "I do not know you":
/// the worker registers again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub worker_id: String,
    pub state: WorkerState,
    pub queue_depth: usize,
    pub running_job: Option<RunningJob>,
    pub memory_total_bytes: Option<u64>,
    pub memory_free_bytes: Option<u64>,
    pub jobs_succeeded: u64,
    pub jobs_failed: u64,
    pub jobs_cancelled: u64,
    pub uptime_secs: f64,
    /// The loaded model's name now (`None`: nothing loaded); models change at run time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// As [`RegisterRequest::model_source`], now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_source: Option<String>,
    /// The whole library again, only when it changed since the worker last sent it (a rescan found other
    /// files, a checkpoint was hashed); absent: unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub library: Option<Vec<LibraryModel>>,
    /// A hive's summary now (absent from workers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<NodeSummary>,
}

/// One checkpoint of a worker's library: what a hive needs to route requests for it there and to list it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LibraryModel {
    /// The checkpoint as the worker knows it (its canonical path, or the `--model` argument of a model outside
    /// its library): what a request routed there names.
    pub filename: String,
    /// A1111's `name`, `title` (`name [short hash]` once hashed) and `model_name`.
    pub name: String,
    pub title: String,
    pub model_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// `diffusers`, `safetensors`, or `path` (outside the library).
    pub format: String,
}

impl From<&ListedModel> for LibraryModel {
    fn from(m: &ListedModel) -> LibraryModel {
        LibraryModel {
            filename: m.filename.clone(),
            name: m.name.clone(),
            title: m.title.clone(),
            model_name: m.model_name.clone(),
            hash: m.hash.clone(),
            sha256: m.sha256.clone(),
            format: m.format.clone(),
        }
    }
}

/// `POST <deregister_url>` once, on shutdown, after the last job ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deregister {
    pub worker_id: String,
    pub reason: String,
}

/// Kept for symmetry with the request types: a hive may answer a heartbeat with an empty body or this object.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatResponse {}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn register_response_defaults() {
        let r: RegisterResponse = serde_json::from_value(json!({"heartbeat_url": "/hb/w1"})).unwrap();
        assert_eq!(r.heartbeat_interval_secs, None);
        assert_eq!(r.deregister_url, None);
        assert_eq!(serde_json::to_value(WorkerState::Draining).unwrap(), json!("draining"));
    }

    #[test]
    fn the_library_is_optional_both_ways() {
        let hb = json!({"worker_id": "w", "state": "idle", "queue_depth": 0, "running_job": null,
            "memory_total_bytes": null, "memory_free_bytes": null, "jobs_succeeded": 0, "jobs_failed": 0,
            "jobs_cancelled": 0, "uptime_secs": 1.0});
        let mut parsed: Heartbeat = serde_json::from_value(hb.clone()).unwrap();
        assert_eq!(parsed.library, None, "an older worker's heartbeat");
        assert_eq!(serde_json::to_value(&parsed).unwrap(), hb, "nothing added when unchanged");
        let listed = ListedModel {
            name: "sub/a.safetensors".into(),
            title: "sub/a.safetensors [0123456789]".into(),
            model_name: "sub_a".into(),
            hash: Some("0123456789".into()),
            sha256: None,
            filename: "/m/sub/a.safetensors".into(),
            format: "safetensors".into(),
            loaded_on: vec!["w".into()],
        };
        parsed.library = Some(vec![LibraryModel::from(&listed)]);
        let v = serde_json::to_value(&parsed).unwrap();
        assert_eq!(v["library"][0]["filename"], "/m/sub/a.safetensors");
        assert!(v["library"][0].get("sha256").is_none() && v["library"][0].get("loaded_on").is_none());
        assert_eq!(serde_json::from_value::<Heartbeat>(v).unwrap(), parsed);
    }
}
