//! The worker's side of the hive protocol (`docs/protocol.md`): register once the model is loaded (retrying
//! with capped exponential backoff until the hive answers 2xx), heartbeat at the interval the hive asked for,
//! register again when a heartbeat is answered 404/410, and deregister on shutdown. The registration carries the
//! model library (every checkpoint the worker can load); when it changes (a refresh found other files, a
//! checkpoint was hashed) a heartbeat carries it again at once, so the hive routes requests for it here.

use crate::locks::lock;
use crate::{unix_secs, AppState};
use reqwest::{StatusCode, Url};
use sdhive_protocol::{
    Deregister, Heartbeat, LibraryModel, RegisterRequest, RegisterResponse, WorkerState,
    DEFAULT_HEARTBEAT_INTERVAL_SECS, PROTOCOL_VERSION,
};
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio::sync::watch;

#[derive(Debug, Clone)]
pub struct RegistrationConfig {
    /// The hive's registration endpoint (`--callback-url`).
    pub callback_url: String,
    /// Sent as `Authorization: Bearer <token>` on every hive request.
    pub token: Option<String>,
    /// How the hive reaches this worker; default `http://<bound address>`.
    pub base_url: Option<String>,
    pub backoff_initial: Duration,
    pub backoff_cap: Duration,
    pub request_timeout: Duration,
}

impl RegistrationConfig {
    pub fn new(callback_url: impl Into<String>, token: Option<String>) -> Self {
        RegistrationConfig {
            callback_url: callback_url.into(),
            token,
            base_url: None,
            backoff_initial: Duration::from_millis(250),
            backoff_cap: Duration::from_secs(10),
            request_timeout: Duration::from_secs(10),
        }
    }
}

#[derive(Debug, Error)]
pub enum RegistrationError {
    #[error("--callback-url `{url}` is not a valid URL: {message}")]
    BadUrl { url: String, message: String },
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
}

#[derive(Debug, Clone)]
struct Registered {
    heartbeat_url: Url,
    interval: Duration,
    deregister_url: Option<Url>,
}

/// How often the library is looked at between heartbeats: a change reaches the hive within this.
const LIBRARY_POLL: Duration = Duration::from_secs(1);

/// This worker's connection to its hive.
pub struct HiveLink {
    client: reqwest::Client,
    callback_url: Url,
    config: RegistrationConfig,
    base_url: String,
    state: AppState,
    registered: Mutex<Option<Registered>>,
    /// Digest of the library the hive last accepted (in a registration or a heartbeat).
    library_sent: Mutex<Option<u64>>,
}

enum Beat {
    Ok,
    /// The hive forgot us.
    Unknown,
    Failed,
}

impl HiveLink {
    pub fn new(
        config: RegistrationConfig,
        base_url: String,
        state: AppState,
    ) -> Result<Self, RegistrationError> {
        let callback_url = Url::parse(&config.callback_url).map_err(|e| RegistrationError::BadUrl {
            url: config.callback_url.clone(),
            message: e.to_string(),
        })?;
        let client = reqwest::Client::builder()
            .timeout(config.request_timeout)
            .build()
            .map_err(|e| RegistrationError::Client(e.to_string()))?;
        Ok(HiveLink {
            client,
            callback_url,
            config,
            base_url,
            state,
            registered: Mutex::new(None),
            library_sent: Mutex::new(None),
        })
    }

    /// Every checkpoint this worker can load, and a digest of the list to tell whether the hive has it.
    fn library(&self) -> (Vec<LibraryModel>, u64) {
        let listed = self.state.library.list(&self.state.config.worker_id);
        let library: Vec<LibraryModel> = listed.iter().map(LibraryModel::from).collect();
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        library.hash(&mut hasher);
        (library, hasher.finish())
    }

    fn library_changed(&self) -> bool {
        let sent = *lock(&self.library_sent);
        sent != Some(self.library().1)
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
        }
    }

    fn post(&self, url: Url) -> reqwest::RequestBuilder {
        let req = self.client.post(url);
        match &self.config.token {
            Some(token) => req.bearer_auth(token),
            None => req,
        }
    }

    async fn try_register(&self) -> Result<Registered, String> {
        let (library, digest) = self.library();
        let response = self
            .post(self.callback_url.clone())
            .json(&self.registration(library))
            .send()
            .await
            .map_err(|e| format!("cannot reach {}: {e}", self.callback_url))?;
        let status = response.status();
        if !status.is_success() {
            let body = response.text().await.unwrap_or_default();
            return Err(format!(
                "the hive answered {status}: {}",
                body.chars().take(200).collect::<String>()
            ));
        }
        let answer: RegisterResponse = response
            .json()
            .await
            .map_err(|e| format!("the hive's registration answer is not understood: {e}"))?;
        let join =
            |u: &str| self.callback_url.join(u).map_err(|e| format!("the hive gave a bad URL `{u}`: {e}"));
        *lock(&self.library_sent) = Some(digest);
        Ok(Registered {
            heartbeat_url: join(&answer.heartbeat_url)?,
            interval: Duration::from_secs(
                answer.heartbeat_interval_secs.unwrap_or(DEFAULT_HEARTBEAT_INTERVAL_SECS).max(1),
            ),
            deregister_url: answer.deregister_url.as_deref().map(join).transpose()?,
        })
    }

    /// Registers, retrying with capped exponential backoff; `None` if stopped first.
    async fn register(&self, stop: &mut watch::Receiver<bool>) -> Option<Registered> {
        let mut delay = self.config.backoff_initial;
        let mut attempt = 1u32;
        loop {
            match self.try_register().await {
                Ok(registered) => {
                    tracing::info!(hive = %self.callback_url, "registered with the hive");
                    *self.lock() = Some(registered.clone());
                    return Some(registered);
                }
                Err(message) => {
                    tracing::warn!(attempt, retry_in = ?delay, "registration failed: {message}");
                }
            }
            if sleep_or_stop(delay, stop).await {
                return None;
            }
            delay = (delay * 2).min(self.config.backoff_cap);
            attempt = attempt.saturating_add(1);
        }
    }

    async fn beat(&self, url: &Url) -> Beat {
        let mut heartbeat = self.heartbeat();
        let (library, digest) = self.library();
        let changed = *lock(&self.library_sent) != Some(digest);
        if changed {
            tracing::info!(models = library.len(), "the model library changed; telling the hive");
            heartbeat.library = Some(library);
        }
        match self.post(url.clone()).json(&heartbeat).send().await {
            Ok(r) if r.status().is_success() => {
                if changed {
                    *lock(&self.library_sent) = Some(digest);
                }
                Beat::Ok
            }
            Ok(r) if matches!(r.status(), StatusCode::NOT_FOUND | StatusCode::GONE) => Beat::Unknown,
            Ok(r) => {
                tracing::warn!(status = %r.status(), "heartbeat refused");
                Beat::Failed
            }
            Err(e) => {
                tracing::warn!("heartbeat failed: {e}");
                Beat::Failed
            }
        }
    }

    /// Registers, then heartbeats until `stop` turns true; re-registers whenever the hive forgot us.
    pub async fn run(&self, mut stop: watch::Receiver<bool>) {
        'register: loop {
            let Some(registered) = self.register(&mut stop).await else { return };
            loop {
                // The next heartbeat goes out after the interval, or at once when the library changed.
                let due = Instant::now() + registered.interval;
                loop {
                    let left = due.saturating_duration_since(Instant::now());
                    if sleep_or_stop(left.min(LIBRARY_POLL), &mut stop).await {
                        return;
                    }
                    if Instant::now() >= due || self.library_changed() {
                        break;
                    }
                }
                match self.beat(&registered.heartbeat_url).await {
                    Beat::Ok | Beat::Failed => {}
                    Beat::Unknown => {
                        tracing::warn!("the hive does not know this worker any more; registering again");
                        *self.lock() = None;
                        continue 'register;
                    }
                }
            }
        }
    }

    /// Tells the hive this worker is leaving; best effort (a hive that misses it times the worker out).
    pub async fn deregister(&self, reason: &str) {
        let Some(url) = self.lock().as_ref().and_then(|r| r.deregister_url.clone()) else { return };
        let body = Deregister { worker_id: self.state.config.worker_id.clone(), reason: reason.into() };
        match self.post(url).json(&body).send().await {
            Ok(r) if r.status().is_success() => tracing::info!("deregistered from the hive"),
            Ok(r) => tracing::warn!(status = %r.status(), "the hive refused the deregistration"),
            Err(e) => tracing::warn!("cannot deregister: {e}"),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Registered>> {
        lock(&self.registered)
    }
}

/// Sleeps `d`, returning early with `true` if `stop` becomes (or is) true.
async fn sleep_or_stop(d: Duration, stop: &mut watch::Receiver<bool>) -> bool {
    if *stop.borrow() {
        return true;
    }
    tokio::select! {
        _ = tokio::time::sleep(d) => false,
        changed = stop.wait_for(|s| *s) => {
            // A dropped sender also means nobody wants us running.
            let _ = changed;
            true
        }
    }
}
