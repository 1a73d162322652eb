//! The registrant's side of the hive protocol (`docs/protocol.md`): register (retrying with capped exponential
//! backoff until the hive answers 2xx), heartbeat at the interval the hive asked for, register again when a
//! heartbeat is answered 404/410, and deregister on shutdown. A worker registers with its hive through this, and
//! a node hive with its parent (a gateway) through the same code: to its parent a hive is a worker with several
//! slots. What is sent comes from the [`Registrant`]; the model library goes along with the registration and
//! again in a heartbeat whenever it changes, so the hive routes requests for any of its models here.

use reqwest::{StatusCode, Url};
use sdhive_protocol::{
    Deregister, Heartbeat, LibraryModel, RegisterRequest, RegisterResponse, DEFAULT_HEARTBEAT_INTERVAL_SECS,
};
use std::hash::{Hash, Hasher};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio::sync::watch;

/// What a registrant tells its hive, read afresh for every message.
pub trait Registrant: Send + Sync + 'static {
    /// The registration, carrying `library`.
    fn registration(&self, library: Vec<LibraryModel>) -> RegisterRequest;
    /// The current heartbeat, without the library.
    fn heartbeat(&self) -> Heartbeat;
    /// Every checkpoint it can load now.
    fn library(&self) -> Vec<LibraryModel>;
    /// The id it registers under (for the deregistration).
    fn id(&self) -> String;
}

#[derive(Debug, Clone)]
pub struct UplinkConfig {
    /// The hive's registration endpoint.
    pub callback_url: String,
    /// Sent as `Authorization: Bearer <token>` on every hive request.
    pub token: Option<String>,
    /// How the hive reaches the registrant; default `http://<bound address>`.
    pub base_url: Option<String>,
    pub backoff_initial: Duration,
    pub backoff_cap: Duration,
    pub request_timeout: Duration,
}

impl UplinkConfig {
    pub fn new(callback_url: impl Into<String>, token: Option<String>) -> Self {
        UplinkConfig {
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
pub enum UplinkError {
    #[error("the hive's URL `{url}` is not a valid URL: {message}")]
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

/// One registrant's connection to its hive.
pub struct Uplink<R: Registrant> {
    client: reqwest::Client,
    callback_url: Url,
    token: Option<String>,
    backoff_initial: Duration,
    backoff_cap: Duration,
    registrant: R,
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<R: Registrant> Uplink<R> {
    pub fn new(config: UplinkConfig, registrant: R) -> Result<Self, UplinkError> {
        let callback_url = Url::parse(&config.callback_url)
            .map_err(|e| UplinkError::BadUrl { url: config.callback_url.clone(), message: e.to_string() })?;
        let client = reqwest::Client::builder()
            .timeout(config.request_timeout)
            .build()
            .map_err(|e| UplinkError::Client(e.to_string()))?;
        Ok(Uplink {
            client,
            callback_url,
            token: config.token,
            backoff_initial: config.backoff_initial,
            backoff_cap: config.backoff_cap,
            registrant,
            registered: Mutex::new(None),
            library_sent: Mutex::new(None),
        })
    }

    /// Whether the hive has accepted a registration that it has not forgotten since.
    pub fn is_registered(&self) -> bool {
        lock(&self.registered).is_some()
    }

    /// The library and a digest of it, to tell whether the hive has it.
    fn library(&self) -> (Vec<LibraryModel>, u64) {
        let library = self.registrant.library();
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        library.hash(&mut hasher);
        (library, hasher.finish())
    }

    fn library_changed(&self) -> bool {
        let sent = *lock(&self.library_sent);
        sent != Some(self.library().1)
    }

    fn post(&self, url: Url) -> reqwest::RequestBuilder {
        let req = self.client.post(url);
        match &self.token {
            Some(token) => req.bearer_auth(token),
            None => req,
        }
    }

    async fn try_register(&self) -> Result<Registered, String> {
        let (library, digest) = self.library();
        let response = self
            .post(self.callback_url.clone())
            .json(&self.registrant.registration(library))
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
        let mut delay = self.backoff_initial;
        let mut attempt = 1u32;
        loop {
            match self.try_register().await {
                Ok(registered) => {
                    tracing::info!(hive = %self.callback_url, "registered with the hive");
                    *lock(&self.registered) = Some(registered.clone());
                    return Some(registered);
                }
                Err(message) => {
                    tracing::warn!(attempt, retry_in = ?delay, "registration failed: {message}");
                }
            }
            if sleep_or_stop(delay, stop).await {
                return None;
            }
            delay = (delay * 2).min(self.backoff_cap);
            attempt = attempt.saturating_add(1);
        }
    }

    async fn beat(&self, registered: &Registered) -> Beat {
        let mut heartbeat = self.registrant.heartbeat();
        let (library, digest) = self.library();
        let changed = *lock(&self.library_sent) != Some(digest);
        if changed {
            tracing::info!(models = library.len(), "the model library changed; telling the hive");
            heartbeat.library = Some(library);
        }
        // No longer than an interval: a heartbeat lost on a cut link must not delay the next one.
        let sent =
            self.post(registered.heartbeat_url.clone()).timeout(registered.interval).json(&heartbeat).send();
        match sent.await {
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
                match self.beat(&registered).await {
                    Beat::Ok | Beat::Failed => {}
                    Beat::Unknown => {
                        tracing::warn!("the hive does not know us any more; registering again");
                        *lock(&self.registered) = None;
                        continue 'register;
                    }
                }
            }
        }
    }

    /// Tells the hive we are leaving; best effort (a hive that misses it times us out).
    pub async fn deregister(&self, reason: &str) {
        let Some(url) = lock(&self.registered).as_ref().and_then(|r| r.deregister_url.clone()) else {
            return;
        };
        let body = Deregister { worker_id: self.registrant.id(), reason: reason.into() };
        match self.post(url).json(&body).send().await {
            Ok(r) if r.status().is_success() => tracing::info!("deregistered from the hive"),
            Ok(r) => tracing::warn!(status = %r.status(), "the hive refused the deregistration"),
            Err(e) => tracing::warn!("cannot deregister: {e}"),
        }
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
