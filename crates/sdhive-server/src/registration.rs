//! What this worker tells its hive (`docs/protocol.md`): the registration once the model is loaded (with the
//! model library: every checkpoint the worker can load) and the heartbeats (state, queue, running job, memory,
//! loaded model). Registering, heartbeating and re-registering are `sdhive-uplink`'s; this is the worker's
//! [`Registrant`].

use crate::{unix_secs, AppState};
use sdhive_protocol::{Heartbeat, LibraryModel, RegisterRequest, WorkerState, PROTOCOL_VERSION};
use sdhive_uplink::Registrant;
pub use sdhive_uplink::{Uplink, UplinkConfig as RegistrationConfig, UplinkError as RegistrationError};

/// The worker as its hive sees it.
pub struct WorkerRegistrant {
    pub state: AppState,
    /// How the hive reaches this worker.
    pub base_url: String,
}

impl Registrant for WorkerRegistrant {
    fn id(&self) -> String {
        self.state.config.worker_id.clone()
    }

    fn library(&self) -> Vec<LibraryModel> {
        let listed = self.state.library.list(&self.state.config.worker_id);
        listed.iter().map(LibraryModel::from).collect()
    }

    fn registration(&self, library: Vec<LibraryModel>) -> RegisterRequest {
        let state = &self.state;
        let loaded = state.library.current();
        RegisterRequest {
            protocol_version: PROTOCOL_VERSION,
            worker_id: state.config.worker_id.clone(),
            base_url: self.base_url.clone(),
            api_key_required: state.config.api_key.is_some(),
            backend: state.info().backend.clone(),
            device: state.device(),
            model: loaded.as_ref().map(|(_, info)| info.model.clone()).unwrap_or_default(),
            model_source: loaded.as_ref().map(|(spec, _)| spec.source.clone()),
            switchable: state.library.switchable(),
            library: Some(library),
            model_family: state.info().family.clone(),
            capabilities: state.capabilities(),
            version: state.config.version.clone(),
            pid: std::process::id(),
            started_at: unix_secs(state.started_at),
            node: None,
        }
    }

    fn heartbeat(&self) -> Heartbeat {
        let state = &self.state;
        let jobs = &state.jobs;
        let running_job = jobs.running_job();
        let queue_depth = jobs.queue_depth();
        let worker_state = if !jobs.is_accepting() {
            WorkerState::Draining
        } else if running_job.is_some() || queue_depth > 0 {
            WorkerState::Busy
        } else {
            WorkerState::Idle
        };
        let device = state.device();
        let m = &state.metrics;
        let loaded = state.library.current();
        Heartbeat {
            model: loaded.as_ref().map(|(_, info)| info.model.clone()),
            model_source: loaded.map(|(spec, _)| spec.source),
            worker_id: state.config.worker_id.clone(),
            state: worker_state,
            queue_depth,
            running_job,
            memory_total_bytes: device.memory_total_bytes,
            memory_free_bytes: device.memory_free_bytes,
            jobs_succeeded: m.jobs_entered(sdhive_protocol::JobState::Succeeded),
            jobs_failed: m.jobs_entered(sdhive_protocol::JobState::Failed),
            jobs_cancelled: m.jobs_entered(sdhive_protocol::JobState::Cancelled),
            uptime_secs: state.started_at.elapsed().map(|d| d.as_secs_f64()).unwrap_or(0.0),
            library: None,
            node: None,
        }
    }
}
