//! The job store and bounded queue: submission (with back-pressure), the state of every job from `queued` to
//! its terminal state, per-job event broadcast, cancellation, result retention for the TTL and the tombstones
//! that let expired ids answer 410. The engine thread (`infer`) is the only consumer of the queue; handlers
//! only ever talk to this module.

use crate::infer;
use crate::metrics::Metrics;
use crate::models::{ModelError, ModelLibrary};
use crate::{unix_secs, ServerConfig};
use base64::Engine as _;
use bytes::Bytes;
use sdhive_engine::{GenerateRequest, ImageFormat, ModelHost, ModelSpec, OutputFormat, Progress};
use sdhive_protocol::{
    JobError, JobErrorKind, JobEvent, JobId, JobImage, JobLinks, JobSnapshot, JobState, RequestSummary,
    RunningJob,
};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};
use thiserror::Error;
use tokio::sync::{broadcast, watch};

/// A job's error as the API shows it.
pub type JobErrorView = JobError;

/// Events buffered per job before a slow subscriber lags (it then resynchronises from the job's state).
const EVENT_CAPACITY: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SubmitError {
    #[error("the job queue is full; retry in about {retry_after_secs} s")]
    QueueFull { retry_after_secs: u64 },
    #[error("the worker is shutting down")]
    ShuttingDown,
    /// The model the request names (or the selection) cannot be served.
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// What a queued job asks of the engine thread. Model switches are jobs too, so they wait their turn behind the
/// jobs submitted before them and `/progress` shows the worker busy while one runs.
#[derive(Debug)]
pub(crate) enum Work {
    // Boxed: a request (prompts, LoRAs, images) is several times the size of the other variants.
    Generate {
        request: Box<GenerateRequest>,
        model: ModelSpec,
    },
    Load(ModelSpec),
    Unload,
    /// A1111's extras: images through an upscaler, on the engine's device.
    Upscale(Box<sdhive_engine::UpscaleRequest>),
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LookupError {
    #[error("no job {0}")]
    NotFound(JobId),
    #[error("job {0} has expired")]
    Gone(JobId),
}

/// Why [`JobManager::run_to_completion`] gave no finished job.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RunError {
    #[error(transparent)]
    Submit(#[from] SubmitError),
    #[error(transparent)]
    Lookup(#[from] LookupError),
}

/// One generated image, encoded once when the job finishes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinishedImage {
    /// The encoded image, with the A1111 infotext in it (a PNG's `parameters` chunk, a JPEG's or WebP's EXIF).
    pub bytes: Bytes,
    /// Its format (and JPEG quality): the request's `output`.
    pub output: OutputFormat,
    pub seed: u64,
    pub infotext: String,
    pub width: u32,
    pub height: u32,
}

impl FinishedImage {
    pub fn to_wire(&self, index: u32) -> JobImage {
        let image_base64 = base64::engine::general_purpose::STANDARD.encode(&self.bytes);
        JobImage {
            index,
            seed: self.seed,
            width: self.width,
            height: self.height,
            infotext: self.infotext.clone(),
            format: self.output.format.name().into(),
            png_base64: if self.output.format == ImageFormat::Png {
                image_base64.clone()
            } else {
                String::new()
            },
            image_base64,
        }
    }
}

/// A consistent copy of one job's state.
#[derive(Debug, Clone, PartialEq)]
pub struct JobView {
    pub id: JobId,
    pub state: JobState,
    /// Jobs ahead of this one (0 = next); `None` unless queued.
    pub queue_position: Option<usize>,
    pub step: u32,
    pub total_steps: u32,
    pub image_index: u32,
    pub images_total: u32,
    pub eta_seconds: Option<f64>,
    pub created_at: SystemTime,
    pub started_at: Option<SystemTime>,
    pub finished_at: Option<SystemTime>,
    /// Time queued (so far, while still queued).
    pub queue_duration: Option<Duration>,
    /// Time running (so far, while still running), the encoding of the images included.
    pub run_duration: Option<Duration>,
    /// Of the finished run, the time from the engine's hand-over to the job's end: waiting for an encoding
    /// thread and encoding the images.
    pub encode_duration: Option<Duration>,
    pub error: Option<JobErrorView>,
    pub images: Vec<FinishedImage>,
    pub request: RequestSummary,
    /// The latest preview PNG (TAESD's or the latent one) of a running job that asked for previews.
    pub preview: Option<Bytes>,
    /// What the job is doing besides denoising (`loading model X`), while it does it.
    pub activity: Option<String>,
    /// A model load or unload rather than a generation.
    pub control: bool,
}

impl JobView {
    /// The JSON shape of `GET /v1/jobs/{id}` (images as base64).
    pub fn to_snapshot(&self) -> JobSnapshot {
        JobSnapshot {
            id: self.id.clone(),
            state: self.state,
            queue_position: self.queue_position,
            step: self.step,
            total_steps: self.total_steps,
            image_index: self.image_index,
            images_total: self.images_total,
            eta_seconds: self.eta_seconds,
            created_at: unix_secs(self.created_at),
            started_at: self.started_at.map(unix_secs),
            finished_at: self.finished_at.map(unix_secs),
            queue_seconds: self.queue_duration.map(|d| d.as_secs_f64()),
            run_seconds: self.run_duration.map(|d| d.as_secs_f64()),
            error: self.error.clone(),
            images: self.images.iter().zip(0..).map(|(img, i)| img.to_wire(i)).collect(),
            request: self.request.clone(),
            links: JobLinks::for_job(&self.id),
        }
    }

    /// The events a subscriber joining now is owed, so every stream has the same grammar: `queued`, then
    /// `started` and the latest `progress` if the job ran, then its terminal event if it has one.
    pub fn replay_events(&self) -> Vec<JobEvent> {
        let id = &self.id;
        let mut events =
            vec![JobEvent::Queued { id: id.clone(), position: self.queue_position.unwrap_or(0) }];
        if let Some(started) = self.started_at {
            events.push(JobEvent::Started { id: id.clone(), started_at: unix_secs(started) });
            if self.step > 0 {
                events.push(self.progress_event());
            }
        }
        match self.state {
            JobState::Queued | JobState::Running => {}
            JobState::Succeeded => events.push(JobEvent::Completed {
                id: id.clone(),
                images: self.images.iter().zip(0..).map(|(img, i)| img.to_wire(i)).collect(),
                run_seconds: self.run_duration.map(|d| d.as_secs_f64()).unwrap_or(0.0),
            }),
            JobState::Failed => events.push(JobEvent::Failed {
                id: id.clone(),
                error: self.error.clone().unwrap_or(JobError {
                    kind: JobErrorKind::EngineError,
                    message: "failed".into(),
                    param: None,
                }),
            }),
            JobState::Cancelled => events.push(JobEvent::Cancelled { id: id.clone(), step: self.step }),
        }
        events
    }

    fn progress_event(&self) -> JobEvent {
        JobEvent::Progress {
            id: self.id.clone(),
            step: self.step,
            total_steps: self.total_steps,
            image: self.image_index,
            images: self.images_total,
            eta_seconds: self.eta_seconds,
        }
    }
}

struct Job {
    id: JobId,
    state: JobState,
    /// Taken by the engine thread when the job starts.
    work: Option<Work>,
    control: bool,
    activity: Option<String>,
    summary: RequestSummary,
    step: u32,
    total_steps: u32,
    image_index: u32,
    images_total: u32,
    created_at: SystemTime,
    created: Instant,
    started: Option<(SystemTime, Instant)>,
    finished: Option<(SystemTime, Instant)>,
    /// When the engine handed the finished job to the encoding stage.
    handed_over: Option<Instant>,
    /// When the last progress report (or the start) arrived: the step-latency clock.
    last_step: Option<Instant>,
    /// The latest preview PNG, when the request asked for previews.
    preview: Option<Bytes>,
    error: Option<JobError>,
    images: Vec<FinishedImage>,
    cancel: Arc<AtomicBool>,
    /// Cancelled because the worker is shutting down: ends `failed` (`shutting_down`), which tells clients to
    /// resubmit elsewhere, rather than `cancelled`, which says someone chose to stop it.
    stopped_by_shutdown: bool,
    events: broadcast::Sender<JobEvent>,
    /// Set once the job is in a terminal state: what [`JobManager::wait`] waits on, so that waiting costs no copy
    /// of the events (a completed event carries the images in base64).
    ended: watch::Sender<bool>,
}

impl Job {
    fn eta_seconds(&self) -> Option<f64> {
        let (_, started) = self.started?;
        if self.state != JobState::Running || self.total_steps == 0 {
            return None;
        }
        let total = u64::from(self.total_steps) * u64::from(self.images_total.max(1));
        let done = u64::from(self.image_index) * u64::from(self.total_steps) + u64::from(self.step);
        if done == 0 {
            return None;
        }
        let per_step = started.elapsed().as_secs_f64() / done as f64;
        Some(per_step * total.saturating_sub(done) as f64)
    }

    fn view(&self, queue_position: Option<usize>) -> JobView {
        let now = Instant::now();
        let queue_duration = Some(match self.started {
            Some((_, started)) => started.duration_since(self.created),
            None => self.finished.map(|(_, f)| f).unwrap_or(now).duration_since(self.created),
        });
        let run_duration = self
            .started
            .map(|(_, started)| self.finished.map(|(_, f)| f).unwrap_or(now).duration_since(started));
        JobView {
            id: self.id.clone(),
            state: self.state,
            queue_position,
            step: self.step,
            total_steps: self.total_steps,
            image_index: self.image_index,
            images_total: self.images_total,
            eta_seconds: self.eta_seconds(),
            created_at: self.created_at,
            started_at: self.started.map(|(t, _)| t),
            finished_at: self.finished.map(|(t, _)| t),
            queue_duration,
            run_duration,
            encode_duration: self
                .handed_over
                .zip(self.finished)
                .map(|(handed, (_, finished))| finished.duration_since(handed)),
            error: self.error.clone(),
            images: self.images.clone(),
            request: self.summary.clone(),
            preview: self.preview.clone(),
            activity: self.activity.clone(),
            control: self.control,
        }
    }

    /// Sends to whoever listens (nobody listening is normal); a terminal event also wakes the job's waiters.
    fn emit(&self, event: JobEvent) {
        self.emit_with(event.is_terminal(), || event);
    }

    /// [`Job::emit`] of an event built only when an event stream listens.
    fn emit_with(&self, terminal: bool, event: impl FnOnce() -> JobEvent) {
        if terminal {
            self.ended.send_replace(true);
        }
        if self.events.receiver_count() > 0 {
            let _ = self.events.send(event());
        }
    }
}

struct Inner {
    jobs: HashMap<JobId, Job>,
    queue: VecDeque<JobId>,
    /// Jobs taken by the engine thread and not finished yet, oldest first: the batch it denoises, and jobs whose
    /// images are still being encoded.
    running: Vec<JobId>,
    tombstones: VecDeque<JobId>,
    tombstone_set: HashSet<JobId>,
    accepting: bool,
    /// Set to make the engine thread exit once idle.
    stop: bool,
    engine_alive: bool,
    /// The engine thread has warmed its batch sizes up (or had nothing to warm) and takes jobs.
    warm: bool,
    /// Smoothed seconds per finished job, for `Retry-After`.
    avg_job_secs: f64,
}

impl Inner {
    fn position(&self, id: &JobId) -> Option<usize> {
        self.queue.iter().position(|q| q == id)
    }

    fn view_of(&self, job: &Job) -> JobView {
        job.view(if job.state == JobState::Queued { self.position(&job.id) } else { None })
    }

    fn lookup(&self, id: &JobId) -> Result<&Job, LookupError> {
        match self.jobs.get(id) {
            Some(job) => Ok(job),
            None if self.tombstone_set.contains(id) => Err(LookupError::Gone(id.clone())),
            None => Err(LookupError::NotFound(id.clone())),
        }
    }

    /// Drops finished jobs older than `ttl`, remembering their ids (bounded) so lookups answer "gone".
    fn expire(&mut self, ttl: Duration, max_tombstones: usize) {
        let now = Instant::now();
        let expired: Vec<JobId> = self
            .jobs
            .values()
            .filter(|j| j.finished.is_some_and(|(_, f)| now.duration_since(f) >= ttl))
            .map(|j| j.id.clone())
            .collect();
        for id in expired {
            self.jobs.remove(&id);
            if max_tombstones == 0 {
                continue;
            }
            while self.tombstones.len() >= max_tombstones {
                if let Some(old) = self.tombstones.pop_front() {
                    self.tombstone_set.remove(&old);
                }
            }
            self.tombstone_set.insert(id.clone());
            self.tombstones.push_back(id);
        }
    }

    /// Tells every queued job its new place after the queue moved.
    fn announce_positions(&self) {
        for (position, id) in self.queue.iter().enumerate() {
            if let Some(job) = self.jobs.get(id) {
                job.emit(JobEvent::Queued { id: id.clone(), position });
            }
        }
    }
}

/// The state behind every `JobManager` clone; the engine thread holds it weakly.
pub(crate) struct Shared {
    inner: Mutex<Inner>,
    /// Wakes the engine thread: work queued, or stop requested.
    work: Condvar,
    /// Wakes shutdown waiting for the engine thread to go idle.
    idle: Condvar,
    pub(crate) config: Arc<ServerConfig>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) library: Arc<ModelLibrary>,
    engine_thread: Mutex<Option<JoinHandle<()>>>,
}

/// The queue and job store; clones share them.
#[derive(Clone)]
pub struct JobManager {
    shared: Arc<Shared>,
}

/// What the engine thread gets for one job.
pub(crate) struct StartedJob {
    pub id: JobId,
    pub work: Work,
    pub cancel: Arc<AtomicBool>,
}

/// A generation's batch key, model and image count, if it can join a batch.
fn batch_of(work: &Work) -> Option<(sdhive_engine::BatchKey, ModelSpec, u32)> {
    match work {
        Work::Generate { request, model } => request.batch_key().map(|key| (key, model.clone(), request.n)),
        _ => None,
    }
}

/// The images of `work` if it may join a batch of `key` and `model` with `room` images left.
fn joining_images(work: &Work, key: &sdhive_engine::BatchKey, model: &ModelSpec, room: u32) -> Option<u32> {
    batch_of(work).filter(|(k, m, n)| k == key && m == model && *n <= room).map(|(_, _, n)| n)
}

/// What the engine thread should do next.
pub(crate) enum Next {
    /// One job, or several generations to run as one batch (oldest first).
    Jobs(Vec<StartedJob>),
    /// Nothing queued yet; ask again.
    Idle,
    Stop,
}

/// How a run ended, as the engine thread reports it.
#[derive(Clone)]
pub(crate) enum Outcome {
    Succeeded(Vec<FinishedImage>),
    Failed(JobError),
    /// Stopped by a cancel; the images finished before it (a batch's first ones).
    Cancelled(Vec<FinishedImage>),
}

fn new_job_id() -> JobId {
    let mut bytes = [0u8; 12];
    if getrandom::fill(&mut bytes).is_err() {
        // Ids need uniqueness, not secrecy: without OS entropy, time plus a counter still gives that.
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let t = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        bytes[..4].copy_from_slice(&(n as u32).to_le_bytes());
        bytes[4..].copy_from_slice(&(t as u64).to_le_bytes());
    }
    JobId(format!("job_{}", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()))
}

/// A seed below 2^32 (usable unchanged in A1111 and ComfyUI), drawn at submission so the job can report it.
fn random_seed() -> u64 {
    getrandom::u32().map(u64::from).unwrap_or_else(|_| {
        let t =
            SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
        u64::from(t)
    })
}

/// What a model load or unload job shows as its request.
fn control_summary(what: String) -> RequestSummary {
    RequestSummary {
        prompt: what,
        negative_prompt: String::new(),
        steps: 0,
        cfg_scale: 0.0,
        width: 0,
        height: 0,
        seed: 0,
        n: 0,
        sampler: String::new(),
        scheduler: String::new(),
        clip_skip: 0,
        strength: None,
        img2img: false,
        inpaint: false,
        model: None,
    }
}

fn summarize(req: &GenerateRequest, native: (u32, u32)) -> RequestSummary {
    let (width, height) = req.output_size(native);
    RequestSummary {
        prompt: req.prompt.clone(),
        negative_prompt: req.negative_prompt.clone(),
        steps: req.steps,
        cfg_scale: req.cfg_scale,
        width,
        height,
        seed: req.seed.unwrap_or(0),
        n: req.n,
        sampler: req.sampler.name().to_string(),
        scheduler: req.schedule.name().to_string(),
        clip_skip: req.clip_skip,
        strength: req.effective_strength(),
        img2img: req.init_image.is_some(),
        inpaint: req.mask.is_some(),
        model: None,
    }
}

impl JobManager {
    /// Starts the engine thread that owns `host` (and its loaded model) and serves this manager's queue.
    pub fn start(
        config: Arc<ServerConfig>,
        metrics: Arc<Metrics>,
        library: Arc<ModelLibrary>,
        host: ModelHost,
    ) -> JobManager {
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner {
                jobs: HashMap::new(),
                queue: VecDeque::new(),
                running: Vec::new(),
                tombstones: VecDeque::new(),
                tombstone_set: HashSet::new(),
                accepting: true,
                stop: false,
                engine_alive: true,
                warm: false,
                avg_job_secs: 5.0,
            }),
            work: Condvar::new(),
            idle: Condvar::new(),
            config,
            metrics,
            library,
            engine_thread: Mutex::new(None),
        });
        let manager = JobManager { shared };
        let handle = infer::spawn(manager.downgrade(), host);
        *lock_handle(&manager.shared.engine_thread) = Some(handle);
        manager
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves consistent-enough data (every update is a few field writes);
        // refusing all further requests would be worse.
        self.shared.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn lock_fresh(&self) -> MutexGuard<'_, Inner> {
        let mut inner = self.lock();
        inner.expire(self.shared.config.job_ttl, self.shared.config.max_tombstones);
        inner
    }

    /// Queues a validated request for the selected model.
    pub fn submit(&self, req: GenerateRequest) -> Result<JobId, SubmitError> {
        let model = self.shared.library.resolve(None, None)?;
        self.submit_for(req, model)
    }

    pub fn config(&self) -> &ServerConfig {
        &self.shared.config
    }

    pub(crate) fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    pub fn library(&self) -> &Arc<ModelLibrary> {
        &self.shared.library
    }

    /// Queues a validated request for `model` (switched to when the job starts). A request without a seed gets
    /// one drawn here, so the job reports it.
    pub fn submit_for(&self, mut req: GenerateRequest, model: ModelSpec) -> Result<JobId, SubmitError> {
        if req.seed.is_none() {
            req.seed = Some(random_seed());
        }
        let native = match self.shared.library.current() {
            Some((spec, info)) if spec == model => (info.native_width, info.native_height),
            // Not known before the model loads; the job's summary is corrected when it starts.
            _ => self.shared.library.info().map(|i| (i.native_width, i.native_height)).unwrap_or((512, 512)),
        };
        let mut summary = summarize(&req, native);
        summary.model = Some(self.shared.library.title_of(&model));
        self.enqueue(Work::Generate { request: Box::new(req), model }, summary, false)
    }

    /// Queues a switch to `model`; it runs after the jobs queued before it.
    pub fn submit_load(&self, model: ModelSpec) -> Result<JobId, SubmitError> {
        let what = format!("load model {}", self.shared.library.title_of(&model));
        self.enqueue(Work::Load(model), control_summary(what), true)
    }

    /// Queues freeing the loaded model.
    pub fn submit_unload(&self) -> Result<JobId, SubmitError> {
        self.enqueue(Work::Unload, control_summary("unload model".into()), true)
    }

    /// Queues an extras upscale; it runs on the engine thread like a generation, after the jobs before it.
    pub fn submit_upscale(&self, req: sdhive_engine::UpscaleRequest) -> Result<JobId, SubmitError> {
        let what = format!("upscale {} image(s) with {}", req.images.len(), req.upscaler.name());
        self.enqueue(Work::Upscale(Box::new(req)), control_summary(what), false)
    }

    /// [`JobManager::submit_upscale`], waiting for the result.
    pub async fn upscale(&self, req: sdhive_engine::UpscaleRequest) -> Result<JobView, RunError> {
        let id = self.submit_upscale(req)?;
        self.await_job(id).await
    }

    fn enqueue(&self, work: Work, summary: RequestSummary, control: bool) -> Result<JobId, SubmitError> {
        let mut inner = self.lock_fresh();
        if !inner.accepting {
            return Err(SubmitError::ShuttingDown);
        }
        if inner.queue.len() >= self.shared.config.max_queue {
            // One slot frees when the running job ends; the average job time is the best guess for that.
            let retry_after_secs = inner.avg_job_secs.ceil().clamp(1.0, 60.0) as u64;
            return Err(SubmitError::QueueFull { retry_after_secs });
        }
        let id = new_job_id();
        let (events, _) = broadcast::channel(EVENT_CAPACITY);
        let (total_steps, images_total) = match &work {
            Work::Generate { request, .. } => (request.steps, request.n),
            // A switch counts as one job for A1111's `job_count`, so pollers see the worker busy.
            Work::Load(_) | Work::Unload => (0, 1),
            Work::Upscale(req) => (0, req.images.len() as u32),
        };
        let job = Job {
            id: id.clone(),
            state: JobState::Queued,
            summary,
            total_steps,
            images_total,
            work: Some(work),
            control,
            activity: None,
            step: 0,
            image_index: 0,
            created_at: SystemTime::now(),
            created: Instant::now(),
            started: None,
            finished: None,
            handed_over: None,
            last_step: None,
            preview: None,
            error: None,
            images: Vec::new(),
            cancel: Arc::new(AtomicBool::new(false)),
            stopped_by_shutdown: false,
            events,
            ended: watch::channel(false).0,
        };
        let position = inner.queue.len();
        job.emit(JobEvent::Queued { id: id.clone(), position });
        inner.jobs.insert(id.clone(), job);
        inner.queue.push_back(id.clone());
        self.shared.metrics.job_entered(JobState::Queued);
        drop(inner);
        self.shared.work.notify_all();
        Ok(id)
    }

    pub fn view(&self, id: &JobId) -> Result<JobView, LookupError> {
        let inner = self.lock_fresh();
        let job = inner.lookup(id)?;
        Ok(inner.view_of(job))
    }

    /// The job's state and a receiver for every event after it: taken under one lock, so nothing is missed or
    /// seen twice.
    pub fn subscribe(&self, id: &JobId) -> Result<(JobView, broadcast::Receiver<JobEvent>), LookupError> {
        let inner = self.lock_fresh();
        let job = inner.lookup(id)?;
        Ok((inner.view_of(job), job.events.subscribe()))
    }

    /// Resolves once the job is in a terminal state.
    pub async fn wait(&self, id: &JobId) -> Result<JobView, LookupError> {
        let mut ended = self.lock_fresh().lookup(id)?.ended.subscribe();
        // An error means the job was dropped (expired): the lookup says so.
        let _ = ended.wait_for(|&done| done).await;
        self.view(id)
    }

    /// A queued job is taken off the queue and ends `cancelled` at once; a running one is flagged and stops
    /// after its current denoising step (its state says `running` until then); a finished one is unchanged.
    pub fn cancel(&self, id: &JobId) -> Result<JobView, LookupError> {
        let mut inner = self.lock_fresh();
        let state = inner.lookup(id)?.state;
        match state {
            JobState::Queued => {
                inner.queue.retain(|q| q != id);
                if let Some(job) = inner.jobs.get_mut(id) {
                    finish_cancelled(job, &self.shared.metrics);
                }
                inner.announce_positions();
            }
            JobState::Running => {
                if let Some(job) = inner.jobs.get(id) {
                    job.cancel.store(true, Ordering::SeqCst);
                }
            }
            JobState::Succeeded | JobState::Failed | JobState::Cancelled => {}
        }
        let job = inner.lookup(id)?;
        Ok(inner.view_of(job))
    }

    /// The running job (the oldest, when a batch runs), if any.
    pub fn current(&self) -> Option<JobView> {
        let inner = self.lock();
        let job = inner.jobs.get(inner.running.first()?)?;
        Some(inner.view_of(job))
    }

    /// Flags the running jobs (the whole batch: A1111's interrupt stops what is generating) for cancellation and
    /// returns the oldest one's id.
    pub fn cancel_current(&self) -> Option<JobId> {
        let inner = self.lock();
        for id in &inner.running {
            if let Some(job) = inner.jobs.get(id) {
                job.cancel.store(true, Ordering::SeqCst);
            }
        }
        inner.running.first().cloned()
    }

    /// Jobs taken by the engine and not finished (a batch's, and those whose images are being encoded).
    pub fn running_count(&self) -> usize {
        self.lock().running.len()
    }

    /// Jobs waiting (not counting the running one).
    pub fn queue_depth(&self) -> usize {
        self.lock().queue.len()
    }

    /// Whether submissions are accepted (false once shutdown began).
    pub fn is_accepting(&self) -> bool {
        self.lock().accepting
    }

    /// Whether the engine thread is alive to run jobs.
    pub fn engine_alive(&self) -> bool {
        self.lock().engine_alive
    }

    /// The running job's progress, for heartbeats.
    pub fn running_job(&self) -> Option<RunningJob> {
        let inner = self.lock();
        let job = inner.jobs.get(inner.running.first()?)?;
        Some(RunningJob {
            id: job.id.clone(),
            step: job.step,
            total_steps: job.total_steps,
            image: job.image_index,
            images: job.images_total,
        })
    }

    /// Submits and waits for the result. If the returned future is dropped first (an HTTP client went away and
    /// its handler was dropped), the job is cancelled.
    pub async fn run_to_completion(&self, req: GenerateRequest) -> Result<JobView, RunError> {
        let model = self.shared.library.resolve(None, None).map_err(SubmitError::from)?;
        self.run_for(req, model).await
    }

    /// [`JobManager::run_to_completion`] for `model`.
    pub async fn run_for(&self, req: GenerateRequest, model: ModelSpec) -> Result<JobView, RunError> {
        let id = self.submit_for(req, model)?;
        self.await_job(id).await
    }

    /// Switches to `model` after the jobs queued before, and waits for the switch.
    pub async fn load_model(&self, model: ModelSpec) -> Result<JobView, RunError> {
        let id = self.submit_load(model)?;
        self.await_job(id).await
    }

    /// Frees the loaded model after the jobs queued before, and waits for it.
    pub async fn unload_model(&self) -> Result<JobView, RunError> {
        let id = self.submit_unload()?;
        self.await_job(id).await
    }

    async fn await_job(&self, id: JobId) -> Result<JobView, RunError> {
        let guard = CancelOnDrop::new(self.clone(), id.clone());
        let view = self.wait(&id).await?;
        guard.disarm();
        Ok(view)
    }

    /// Stops accepting jobs and fails everything still queued (`shutting_down`); the running job goes on.
    pub fn begin_shutdown(&self) {
        let mut inner = self.lock();
        inner.accepting = false;
        let queued: Vec<JobId> = inner.queue.drain(..).collect();
        for id in queued {
            if let Some(job) = inner.jobs.get_mut(&id) {
                let error = JobError {
                    kind: JobErrorKind::ShuttingDown,
                    message: "the worker shut down before the job could run; submit it again elsewhere"
                        .into(),
                    param: None,
                };
                job.state = JobState::Failed;
                job.work = None;
                job.finished = Some((SystemTime::now(), Instant::now()));
                job.error = Some(error.clone());
                job.emit(JobEvent::Failed { id: id.clone(), error });
                self.shared.metrics.job_entered(JobState::Failed);
            }
        }
    }

    /// Flags the running jobs to stop because the worker is shutting down; they then end `failed` with kind
    /// `shutting_down`. Returns the oldest one's id.
    pub fn cancel_current_for_shutdown(&self) -> Option<JobId> {
        let mut inner = self.lock();
        let running = inner.running.clone();
        for id in &running {
            if let Some(job) = inner.jobs.get_mut(id) {
                job.stopped_by_shutdown = true;
                job.cancel.store(true, Ordering::SeqCst);
            }
        }
        running.first().cloned()
    }

    /// Waits (blocking) up to `timeout` for the running job to end; true if nothing runs any more.
    pub fn wait_idle_blocking(&self, timeout: Duration) -> bool {
        let inner = self.lock();
        let (inner, _) = self
            .shared
            .idle
            .wait_timeout_while(inner, timeout, |i| !i.running.is_empty() || !i.queue.is_empty())
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        inner.running.is_empty() && inner.queue.is_empty()
    }

    /// Tells the engine thread to exit once idle and waits for it.
    pub fn stop_engine_blocking(&self) {
        let still_running = {
            let mut inner = self.lock();
            inner.stop = true;
            !inner.running.is_empty()
        };
        self.shared.work.notify_all();
        if still_running {
            // A job that ignored its cancellation would block the join forever; leave the thread to the exit.
            return;
        }
        let handle = lock_handle(&self.shared.engine_thread).take();
        if let Some(handle) = handle {
            // The thread catches engine panics itself; a join error would be our own bug, already logged.
            let _ = handle.join();
        }
    }

    // ---- engine-thread side ----

    /// Waits up to a second for work (→ `Next::Jobs`, now running). The oldest queued job comes first; a
    /// generation that can join a batch takes along the queued generations of the same model and
    /// [`sdhive_engine::BatchKey`], oldest first, while their images fit `max_images`. Sweeps expired jobs while
    /// idle, so memory is returned without any request arriving; the short wait lets the engine thread notice when
    /// every handle to this manager is gone.
    pub(crate) fn next_jobs(&self, max_images: u32) -> Next {
        let mut inner = self.lock();
        let mut waited = false;
        loop {
            inner.expire(self.shared.config.job_ttl, self.shared.config.max_tombstones);
            if inner.stop {
                return Next::Stop;
            }
            if let Some(id) = inner.queue.pop_front() {
                let Some(first) = self.start_job(&mut inner, &id) else { continue };
                let mut started = vec![first];
                if let Some((key, model, mut images)) = batch_of(&started[0].work).filter(|_| max_images > 1)
                {
                    let mut at = 0;
                    while at < inner.queue.len() && images < max_images {
                        let candidate = inner.queue[at].clone();
                        let joins =
                            inner.jobs.get(&candidate).and_then(|j| j.work.as_ref()).and_then(|w| {
                                joining_images(w, &key, &model, max_images.saturating_sub(images))
                            });
                        match joins {
                            Some(n) => {
                                inner.queue.remove(at);
                                if let Some(job) = self.start_job(&mut inner, &candidate) {
                                    images += n;
                                    started.push(job);
                                }
                            }
                            None => at += 1,
                        }
                    }
                }
                inner.announce_positions();
                return Next::Jobs(started);
            }
            if waited {
                return Next::Idle;
            }
            waited = true;
            inner = self
                .shared
                .work
                .wait_timeout(inner, Duration::from_secs(1))
                .map(|(guard, _)| guard)
                .unwrap_or_else(|poisoned| poisoned.into_inner().0);
        }
    }

    /// Queued generations of `model` and `key` that join a running batch now, together at most `max_images`
    /// images: taken from the front of the queue up to the first job that cannot join, so a job of another model,
    /// size or kind waits at most for the running batch to drain, never behind newcomers overtaking it.
    pub(crate) fn join_jobs(
        &self,
        key: &sdhive_engine::BatchKey,
        model: &ModelSpec,
        max_images: u32,
    ) -> Vec<StartedJob> {
        let mut inner = self.lock();
        let mut joined = Vec::new();
        let mut images = 0;
        while !inner.stop {
            let Some(id) = inner.queue.front().cloned() else { break };
            let Some(work) = inner.jobs.get(&id).and_then(|j| j.work.as_ref()) else {
                // Nothing left to run (as `next_jobs` skips it).
                inner.queue.pop_front();
                continue;
            };
            let Some(n) = joining_images(work, key, model, max_images.saturating_sub(images)) else { break };
            inner.queue.pop_front();
            if let Some(job) = self.start_job(&mut inner, &id) {
                images += n;
                joined.push(job);
            }
        }
        if !joined.is_empty() {
            inner.announce_positions();
        }
        joined
    }

    /// Marks queued job `id` (already out of the queue) running; `None` if it has no work left to run.
    fn start_job(&self, inner: &mut Inner, id: &JobId) -> Option<StartedJob> {
        let job = inner.jobs.get_mut(id)?;
        let work = job.work.take()?;
        let now = (SystemTime::now(), Instant::now());
        job.state = JobState::Running;
        job.started = Some(now);
        job.last_step = Some(now.1);
        job.emit(JobEvent::Started { id: id.clone(), started_at: unix_secs(now.0) });
        let started = StartedJob { id: id.clone(), work, cancel: Arc::clone(&job.cancel) };
        inner.running.push(id.clone());
        self.shared.metrics.job_entered(JobState::Running);
        Some(started)
    }

    pub(crate) fn downgrade(&self) -> Weak<Shared> {
        Arc::downgrade(&self.shared)
    }

    pub(crate) fn upgrade(weak: &Weak<Shared>) -> Option<JobManager> {
        weak.upgrade().map(|shared| JobManager { shared })
    }

    pub(crate) fn on_progress(&self, id: &JobId, p: &Progress) {
        let mut inner = self.lock();
        let Some(job) = inner.jobs.get_mut(id) else { return };
        let now = Instant::now();
        // An image's first report also covers prompt encoding (and, for img2img, the VAE encode): not a step.
        if let Some(last) = job.last_step.filter(|_| p.step > 1) {
            self.shared.metrics.observe_step(now.duration_since(last));
        }
        job.last_step = Some(now);
        job.step = p.step;
        job.total_steps = p.steps;
        job.image_index = p.image;
        job.images_total = p.images;
        let event = JobEvent::Progress {
            id: id.clone(),
            step: p.step,
            total_steps: p.steps,
            image: p.image,
            images: p.images,
            eta_seconds: job.eta_seconds(),
        };
        job.emit(event);
    }

    /// A running job's latest preview, encoded off the engine thread (see `encoder`); one that arrives after the
    /// job ended is dropped.
    pub(crate) fn publish_preview(&self, id: &JobId, step: u32, image: u32, png: Bytes) {
        use base64::Engine as _;
        let mut inner = self.lock();
        let Some(job) = inner.jobs.get_mut(id).filter(|j| j.state == JobState::Running) else { return };
        job.emit(JobEvent::Preview {
            id: id.clone(),
            step,
            image,
            png_base64: base64::engine::general_purpose::STANDARD.encode(&png),
        });
        job.preview = Some(png);
    }

    /// Says what a running job does besides denoising (`None` once it denoises).
    pub(crate) fn set_activity(&self, id: &JobId, activity: Option<String>) {
        if let Some(job) = self.lock().jobs.get_mut(id) {
            job.activity = activity;
        }
    }

    /// The job's output size once its model is loaded (a request without a size gets the model's).
    pub(crate) fn set_size(&self, id: &JobId, (width, height): (u32, u32)) {
        if let Some(job) = self.lock().jobs.get_mut(id) {
            job.summary.width = width;
            job.summary.height = height;
        }
    }

    /// Ends a job the engine handed to the encoding stage at `handed_over`.
    pub(crate) fn finish(&self, id: &JobId, outcome: Outcome, handed_over: Instant) {
        let mut inner = self.lock();
        inner.running.retain(|r| r != id);
        if let Some(job) = inner.jobs.get_mut(id) {
            let now = (SystemTime::now(), Instant::now());
            job.finished = Some(now);
            job.handed_over = Some(handed_over);
            job.activity = None;
            let run_secs = job.started.map(|(_, s)| now.1.duration_since(s).as_secs_f64()).unwrap_or(0.0);
            let state = match outcome {
                Outcome::Succeeded(images) => {
                    job.images = images;
                    // Only event streams read the images in base64: with none listening they are not encoded.
                    job.emit_with(true, || JobEvent::Completed {
                        id: id.clone(),
                        images: job.images.iter().zip(0..).map(|(img, i)| img.to_wire(i)).collect(),
                        run_seconds: run_secs,
                    });
                    self.shared.metrics.observe_generation(Duration::from_secs_f64(run_secs));
                    JobState::Succeeded
                }
                Outcome::Failed(error) => {
                    job.error = Some(error.clone());
                    job.emit(JobEvent::Failed { id: id.clone(), error });
                    JobState::Failed
                }
                Outcome::Cancelled(_) if job.stopped_by_shutdown => {
                    let error = JobError {
                        kind: JobErrorKind::ShuttingDown,
                        message: format!(
                            "the worker shut down and stopped the job at step {} of {}",
                            job.step, job.total_steps
                        ),
                        param: None,
                    };
                    job.error = Some(error.clone());
                    job.emit(JobEvent::Failed { id: id.clone(), error });
                    JobState::Failed
                }
                Outcome::Cancelled(done) => {
                    job.images = done;
                    job.emit(JobEvent::Cancelled { id: id.clone(), step: job.step });
                    JobState::Cancelled
                }
            };
            job.state = state;
            self.shared.metrics.job_entered(state);
            if state == JobState::Succeeded {
                inner.avg_job_secs = 0.7 * inner.avg_job_secs + 0.3 * run_secs;
            }
        }
        drop(inner);
        self.shared.idle.notify_all();
    }

    /// Called by the engine thread once it has warmed up, before it takes its first job.
    pub(crate) fn mark_warm(&self) {
        self.lock().warm = true;
        self.shared.idle.notify_all();
    }

    /// Blocks until the engine thread has warmed up or is gone.
    pub fn wait_warm(&self) {
        let mut inner = self.lock();
        while !inner.warm && inner.engine_alive {
            inner = self.shared.idle.wait(inner).unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }

    pub(crate) fn mark_engine_dead(&self) {
        let mut inner = self.lock();
        inner.engine_alive = false;
        inner.running.clear();
        drop(inner);
        self.shared.idle.notify_all();
    }
}

fn lock_handle(m: &Mutex<Option<JoinHandle<()>>>) -> MutexGuard<'_, Option<JoinHandle<()>>> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn finish_cancelled(job: &mut Job, metrics: &Metrics) {
    job.state = JobState::Cancelled;
    job.work = None;
    job.finished = Some((SystemTime::now(), Instant::now()));
    job.emit(JobEvent::Cancelled { id: job.id.clone(), step: job.step });
    metrics.job_entered(JobState::Cancelled);
}

/// Cancels its job when dropped, unless disarmed: ties a job's life to a synchronous request handler.
pub struct CancelOnDrop {
    jobs: JobManager,
    id: JobId,
    armed: bool,
}

impl CancelOnDrop {
    pub fn new(jobs: JobManager, id: JobId) -> Self {
        CancelOnDrop { jobs, id, armed: true }
    }

    pub fn id(&self) -> &JobId {
        &self.id
    }

    /// The job's outcome is wanted after all (it finished, or its ownership moved elsewhere).
    pub fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            tracing::info!(job = %self.id, "client went away; cancelling its job");
            // Already gone or finished: nothing to cancel, which is fine.
            let _ = self.jobs.cancel(&self.id);
        }
    }
}
