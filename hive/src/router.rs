//! Choosing a worker and keeping track of what was sent where: the hive's bounded queue of waiting
//! requests, hive job ids mapped to worker job ids, dispatch of native jobs, the monitor that follows each
//! dispatched job's event stream (re-publishing it under the hive id), and what happens to jobs whose worker
//! dies — queued ones go back to the hive queue, running ones fail with `worker_lost`.

use crate::registry::WorkerStatus;
use crate::{random_hex, unix_now, Hive, State};
use futures::StreamExt;
use sdhive_protocol::{JobAccepted, JobErrorKind, JobLinks};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{broadcast, oneshot};

/// A server-sent event as forwarded: the worker's event name and its JSON data with the id rewritten.
#[derive(Debug, Clone, PartialEq)]
pub struct SseEvent {
    pub name: String,
    pub data: String,
}

impl SseEvent {
    pub fn is_terminal(&self) -> bool {
        matches!(self.name.as_str(), "completed" | "failed" | "cancelled")
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Phase {
    /// In the hive's queue.
    Queued,
    /// Handed to a worker; the submission is under way.
    Dispatching {
        worker: String,
        epoch: u64,
    },
    /// The worker accepted it as `worker_job`.
    OnWorker {
        worker: String,
        epoch: u64,
        worker_job: String,
        started: bool,
    },
    Done,
}

pub struct HiveJob {
    pub id: String,
    pub body: Value,
    pub model: Option<String>,
    pub phase: Phase,
    /// Dispatch attempts so far; a monitor of an older attempt stands down.
    pub attempt: u32,
    pub created_at: f64,
    pub finished: Option<Instant>,
    /// The latest full snapshot from the worker (id rewritten), and the final one once done.
    pub snapshot: Option<Value>,
    pub events: broadcast::Sender<SseEvent>,
    /// Latest event of each kind for late subscribers, in stream order.
    pub replay: Vec<SseEvent>,
    pub cancel_requested: bool,
    /// Told the outcome of the first submission to a worker: the worker's refusal (status and body) when it
    /// refused the request itself, so the client gets the worker's 400 instead of a job that fails later.
    pub first_dispatch: Option<oneshot::Sender<Option<(u16, Value)>>>,
}

impl HiveJob {
    fn publish(&mut self, event: SseEvent) {
        match self.replay.iter_mut().find(|e| e.name == event.name) {
            Some(slot) => *slot = event.clone(),
            None => self.replay.push(event.clone()),
        }
        // No subscribers is fine: the replay keeps the state.
        let _ = self.events.send(event);
    }

    /// What `GET /v1/jobs/{id}` shows without asking a worker.
    pub fn local_view(&self, queue_position: Option<usize>) -> Value {
        if let Some(snapshot) = &self.snapshot {
            if self.phase == Phase::Done {
                return snapshot.clone();
            }
        }
        let state = match &self.phase {
            Phase::Queued | Phase::Dispatching { .. } => "queued",
            Phase::OnWorker { started: false, .. } => "queued",
            Phase::OnWorker { started: true, .. } => "running",
            Phase::Done => "failed",
        };
        json!({
            "id": self.id,
            "state": state,
            "queue_position": queue_position,
            "created_at": self.created_at,
            "error": null,
            "images": [],
            "links": links(&self.id),
        })
    }
}

fn links(id: &str) -> Value {
    serde_json::to_value(JobLinks::for_job(&id.into())).unwrap_or(Value::Null)
}

/// A request waiting for a worker slot.
pub enum Ticket {
    Job(String),
    /// A synchronous (OpenAI/A1111) request; the handler waits on the receiver.
    Sync {
        model: Option<String>,
        reply: oneshot::Sender<Slot>,
    },
}

/// One unit of a worker's capacity, held while a job or request is on it.
#[derive(Debug, Clone)]
pub struct Slot {
    pub worker: String,
    pub epoch: u64,
    pub base_url: String,
    pub bearer: Option<String>,
}

/// Releases its slot when dropped (a synchronous request finished, failed, or its client went away).
pub struct SlotGuard {
    pub hive: Arc<Hive>,
    pub slot: Slot,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let starts = {
            let mut state = self.hive.lock();
            release(&mut state, &self.slot.worker, self.slot.epoch);
            pump(&self.hive, &mut state)
        };
        start_dispatches(&self.hive, starts);
    }
}

pub fn release(state: &mut State, worker: &str, epoch: u64) {
    if let Some(w) = state.workers.get_mut(worker) {
        if w.epoch == epoch {
            w.inflight = w.inflight.saturating_sub(1);
            if w.inflight == 0
                && w.status == WorkerStatus::Busy
                && w.heartbeat.as_ref().is_none_or(|h| h.queue_depth == 0 && h.running_job.is_none())
            {
                w.status = WorkerStatus::Ready;
            }
        }
    }
}

/// The least loaded routable worker with a free slot that serves `model` (any model when `None`).
fn choose(hive: &Hive, state: &State, model: Option<&str>, now: Instant) -> Option<String> {
    state
        .workers
        .values()
        .filter(|w| w.routable(now) && w.inflight < hive.config.worker_slots)
        .filter(|w| model.is_none_or(|m| w.serves(m)))
        .min_by_key(|w| (w.load(), w.inflight, w.id.clone()))
        .map(|w| w.id.clone())
}

fn take_slot(hive: &Hive, state: &mut State, worker: &str) -> Option<Slot> {
    let w = state.workers.get_mut(worker)?;
    let base_url = w.base_url()?.to_string();
    w.inflight += 1;
    if w.status == WorkerStatus::Ready {
        w.status = WorkerStatus::Busy;
    }
    let api_key_required = w.registration.as_ref().is_some_and(|r| r.api_key_required);
    Some(Slot {
        worker: worker.to_string(),
        epoch: w.epoch,
        base_url,
        bearer: if api_key_required { hive.config.worker_api_key.clone() } else { None },
    })
}

/// Whether anything could ever serve `model`: a worker that is up or coming up.
pub fn model_known(state: &State, model: &str) -> bool {
    state.workers.values().any(|w| w.serves(model) && may_serve(w))
}

/// Up, or on its way up (starting, restarting, silent for now): worth waiting for.
fn may_serve(w: &crate::registry::WorkerEntry) -> bool {
    !matches!(w.status, WorkerStatus::Failed | WorkerStatus::Stopped) && !w.stop_requested
}

/// Whether any worker could take work; without one, waiting in the queue would be waiting forever.
pub fn any_worker(state: &State) -> bool {
    state.workers.values().any(may_serve)
}

/// Hands free slots to waiting tickets, oldest first (a ticket for a model whose workers are all busy does
/// not hold back the others). Returns the native jobs to dispatch, to be started outside the lock.
pub fn pump(hive: &Hive, state: &mut State) -> Vec<(String, Slot, u32)> {
    let now = Instant::now();
    let mut starts = Vec::new();
    let mut i = 0;
    while i < state.queue.len() {
        let model = match &state.queue[i] {
            Ticket::Job(id) => match state.jobs.get(id) {
                Some(job) if job.phase == Phase::Queued => job.model.clone(),
                // Cancelled or gone while waiting.
                _ => {
                    state.queue.remove(i);
                    continue;
                }
            },
            Ticket::Sync { reply, .. } if reply.is_closed() => {
                state.queue.remove(i);
                continue;
            }
            Ticket::Sync { model, .. } => model.clone(),
        };
        let Some(worker) = choose(hive, state, model.as_deref(), now) else {
            i += 1;
            continue;
        };
        let Some(slot) = take_slot(hive, state, &worker) else {
            i += 1;
            continue;
        };
        match state.queue.remove(i) {
            Some(Ticket::Job(id)) => {
                if let Some(job) = state.jobs.get_mut(&id) {
                    job.phase = Phase::Dispatching { worker: slot.worker.clone(), epoch: slot.epoch };
                    job.attempt += 1;
                    starts.push((id, slot, job.attempt));
                }
            }
            Some(Ticket::Sync { reply, .. }) => {
                if let Err(slot) = reply.send(slot) {
                    release(state, &slot.worker, slot.epoch);
                }
            }
            None => {}
        }
    }
    publish_queue_positions(state);
    starts
}

/// Tells subscribers of hive-queued jobs where they stand.
fn publish_queue_positions(state: &mut State) {
    let ids: Vec<String> = state
        .queue
        .iter()
        .filter_map(|t| match t {
            Ticket::Job(id) => Some(id.clone()),
            Ticket::Sync { .. } => None,
        })
        .collect();
    for (position, id) in ids.iter().enumerate() {
        if let Some(job) = state.jobs.get_mut(id) {
            let data = json!({"event": "queued", "id": id, "position": position}).to_string();
            let changed = job.replay.iter().find(|e| e.name == "queued").is_none_or(|e| e.data != data);
            if changed {
                job.publish(SseEvent { name: "queued".into(), data });
            }
        }
    }
}

pub fn queue_position(state: &State, job_id: &str) -> Option<usize> {
    state
        .queue
        .iter()
        .filter(|t| matches!(t, Ticket::Job(_)))
        .position(|t| matches!(t, Ticket::Job(id) if id == job_id))
}

pub fn start_dispatches(hive: &Arc<Hive>, starts: Vec<(String, Slot, u32)>) {
    for (job, slot, attempt) in starts {
        tokio::spawn(dispatch(hive.clone(), job, slot, attempt));
    }
}

#[derive(Debug)]
pub enum SubmitError {
    QueueFull,
    Draining,
    UnknownModel(String),
    NoWorkers,
}

/// What a worker's refusal of a submission looks like: its status and error body.
pub type Refusal = Option<(u16, Value)>;

/// Creates a hive job and queues it; dispatch happens when a slot frees (possibly at once). When it was
/// dispatched at once, the receiver tells whether the worker refused the request itself.
pub fn submit(
    hive: &Arc<Hive>,
    body: Value,
    model: Option<String>,
) -> Result<(JobAccepted, Option<oneshot::Receiver<Refusal>>), SubmitError> {
    let id = format!("job_{}", random_hex(12));
    let starts;
    let position;
    let (first_tx, first_rx) = oneshot::channel();
    let dispatched_now;
    {
        let mut state = hive.lock();
        if state.draining {
            return Err(SubmitError::Draining);
        }
        if let Some(m) = &model {
            if !model_known(&state, m) {
                return Err(SubmitError::UnknownModel(m.clone()));
            }
        }
        if !any_worker(&state) {
            return Err(SubmitError::NoWorkers);
        }
        if state.queue.len() >= hive.config.queue_size {
            state.metrics.rejected_queue_full += 1;
            return Err(SubmitError::QueueFull);
        }
        state.metrics.jobs_submitted += 1;
        state.jobs.insert(
            id.clone(),
            HiveJob {
                id: id.clone(),
                body,
                model,
                phase: Phase::Queued,
                attempt: 0,
                created_at: unix_now(),
                finished: None,
                snapshot: None,
                events: broadcast::channel(64).0,
                replay: Vec::new(),
                cancel_requested: false,
                first_dispatch: Some(first_tx),
            },
        );
        state.queue.push_back(Ticket::Job(id.clone()));
        starts = pump(hive, &mut state);
        position = queue_position(&state, &id).unwrap_or(0);
        dispatched_now = state.jobs.get(&id).is_some_and(|j| matches!(j.phase, Phase::Dispatching { .. }));
    }
    start_dispatches(hive, starts);
    let accepted = JobAccepted {
        id: id.as_str().into(),
        state: sdhive_protocol::JobState::Queued,
        queue_position: Some(position),
        links: JobLinks::for_job(&id.as_str().into()),
    };
    Ok((accepted, dispatched_now.then_some(first_rx)))
}

/// Puts a job back at the front of the hive queue (its worker refused it or died before running it).
fn requeue(state: &mut State, id: &str) {
    if let Some(job) = state.jobs.get_mut(id) {
        if job.cancel_requested {
            finish_cancelled(job);
            state.metrics.jobs_cancelled += 1;
            return;
        }
        job.phase = Phase::Queued;
        state.metrics.jobs_redispatched += 1;
        state.queue.push_front(Ticket::Job(id.to_string()));
    }
}

fn finish_cancelled(job: &mut HiveJob) {
    job.phase = Phase::Done;
    job.finished = Some(Instant::now());
    let mut view = job.local_view(None);
    view["state"] = json!("cancelled");
    job.snapshot = Some(view);
    job.publish(SseEvent {
        name: "cancelled".into(),
        data: json!({"event": "cancelled", "id": job.id, "step": 0}).to_string(),
    });
}

fn fail(job: &mut HiveJob, kind: JobErrorKind, message: String, param: Option<String>) {
    job.phase = Phase::Done;
    job.finished = Some(Instant::now());
    let mut error = json!({"kind": kind.as_str(), "message": message});
    if let Some(p) = param {
        error["param"] = json!(p);
    }
    let mut view = job.snapshot.clone().unwrap_or_else(|| job.local_view(None));
    view["state"] = json!("failed");
    view["error"] = error.clone();
    view["queue_position"] = Value::Null;
    view["finished_at"] = json!(unix_now());
    job.snapshot = Some(view);
    job.publish(SseEvent {
        name: "failed".into(),
        data: json!({"event": "failed", "id": job.id, "error": error}).to_string(),
    });
}

/// Cancels a job the hive still holds; `None` when it is on a worker (the caller forwards the cancel).
pub fn cancel_local(state: &mut State, id: &str) -> Option<Value> {
    let job = state.jobs.get_mut(id)?;
    match &job.phase {
        Phase::Queued => {
            finish_cancelled(job);
            let view = job.local_view(None);
            state.metrics.jobs_cancelled += 1;
            state.queue.retain(|t| !matches!(t, Ticket::Job(j) if j == id));
            publish_queue_positions(state);
            Some(view)
        }
        Phase::Dispatching { .. } => {
            // The submission is in flight; `dispatch` forwards the cancel once it has the worker's id.
            job.cancel_requested = true;
            Some(job.local_view(None))
        }
        Phase::Done => Some(job.local_view(None)),
        Phase::OnWorker { .. } => None,
    }
}

/// The worker's `id`/`links` replaced by the hive's.
pub fn rewrite_snapshot(mut v: Value, hive_id: &str) -> Value {
    if let Some(obj) = v.as_object_mut() {
        obj.insert("id".into(), json!(hive_id));
        if obj.contains_key("links") {
            obj.insert("links".into(), links(hive_id));
        }
    }
    v
}

fn bearer(req: reqwest::RequestBuilder, slot: &Slot) -> reqwest::RequestBuilder {
    match &slot.bearer {
        Some(k) => req.bearer_auth(k),
        None => req,
    }
}

/// Submits a native job to its worker and starts following it.
async fn dispatch(hive: Arc<Hive>, job_id: String, slot: Slot, attempt: u32) {
    let body = {
        let state = hive.lock();
        match state.jobs.get(&job_id) {
            Some(job) => job.body.clone(),
            None => return,
        }
    };
    let url = format!("{}/v1/jobs", slot.base_url);
    let result =
        bearer(hive.client.post(&url), &slot).timeout(Duration::from_secs(30)).json(&body).send().await;
    enum Next {
        Accepted(String),
        Retry(Option<Duration>),
        Refused(u16, Value),
    }
    let next = match result {
        Ok(r) if r.status().is_success() => match r.json::<JobAccepted>().await {
            Ok(a) => Next::Accepted(a.id.0),
            Err(e) => {
                tracing::warn!(worker = %slot.worker, "the worker's job answer is not understood: {e}");
                Next::Retry(Some(Duration::from_secs(1)))
            }
        },
        Ok(r) if r.status().as_u16() == 429 || r.status().is_server_error() => {
            tracing::info!(worker = %slot.worker, status = %r.status(), "worker refused a job; requeued");
            Next::Retry(Some(Duration::from_secs(1)))
        }
        Ok(r) => {
            let status = r.status();
            let err: Value = r.json().await.unwrap_or(Value::Null);
            Next::Refused(status.as_u16(), err)
        }
        Err(e) => {
            tracing::warn!(worker = %slot.worker, "cannot submit to the worker: {e}");
            Next::Retry(Some(Duration::from_secs(2)))
        }
    };
    let mut forward_cancel = None;
    let starts = {
        let mut state = hive.lock();
        let refusal = match &next {
            Next::Refused(status, body) => Some((*status, body.clone())),
            _ => None,
        };
        let told_client = state
            .jobs
            .get_mut(&job_id)
            .and_then(|j| j.first_dispatch.take())
            .is_some_and(|tx| tx.send(refusal).is_ok());
        let current = state.jobs.get(&job_id).is_some_and(|j| {
            j.attempt == attempt
                && matches!(&j.phase, Phase::Dispatching { worker, .. } if *worker == slot.worker)
        });
        match next {
            Next::Accepted(worker_job) if current => {
                if let Some(job) = state.jobs.get_mut(&job_id) {
                    job.phase = Phase::OnWorker {
                        worker: slot.worker.clone(),
                        epoch: slot.epoch,
                        worker_job: worker_job.clone(),
                        started: false,
                    };
                    if job.cancel_requested {
                        forward_cancel = Some(worker_job.clone());
                    }
                }
                tokio::spawn(monitor(hive.clone(), job_id.clone(), slot.clone(), attempt, worker_job));
            }
            // The worker died meanwhile and the job moved on; the slot was reset with the epoch.
            Next::Accepted(_) => {}
            Next::Retry(cooldown) => {
                release(&mut state, &slot.worker, slot.epoch);
                if let (Some(d), Some(w)) = (cooldown, state.workers.get_mut(&slot.worker)) {
                    w.cooldown_until = Some(Instant::now() + d);
                }
                if current {
                    requeue(&mut state, &job_id);
                }
            }
            Next::Refused(status, err) => {
                release(&mut state, &slot.worker, slot.epoch);
                if current && told_client {
                    // The client got the worker's answer instead of a job id: there is no job.
                    state.jobs.remove(&job_id);
                    state.metrics.jobs_submitted = state.metrics.jobs_submitted.saturating_sub(1);
                } else if current {
                    let message = err["error"]["message"]
                        .as_str()
                        .map(String::from)
                        .unwrap_or_else(|| format!("the worker answered {status}"));
                    let param = err["error"]["param"].as_str().map(String::from);
                    if let Some(job) = state.jobs.get_mut(&job_id) {
                        fail(job, JobErrorKind::InvalidRequest, message, param);
                    }
                    state.metrics.jobs_failed += 1;
                }
            }
        }
        pump(&hive, &mut state)
    };
    start_dispatches(&hive, starts);
    if let Some(worker_job) = forward_cancel {
        let url = format!("{}/v1/jobs/{worker_job}/cancel", slot.base_url);
        if let Err(e) = bearer(hive.client.post(url), &slot).send().await {
            tracing::warn!("cannot forward a cancel: {e}");
        }
    }
    // A retried job waits for the cooldown to pass; nudge the queue then.
    let hive2 = hive.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let starts = {
            let mut state = hive2.lock();
            pump(&hive2, &mut state)
        };
        start_dispatches(&hive2, starts);
    });
}

/// Whether the job is still on this attempt (a newer attempt or the end of the job retires the monitor).
fn still_current(hive: &Hive, job_id: &str, attempt: u32) -> bool {
    hive.lock()
        .jobs
        .get(job_id)
        .is_some_and(|j| j.attempt == attempt && matches!(j.phase, Phase::OnWorker { .. }))
}

/// Follows the worker's event stream for one job, re-publishing events under the hive id, until the job
/// ends there or the job is taken away from this worker (its death is handled by [`worker_lost`]).
async fn monitor(hive: Arc<Hive>, job_id: String, slot: Slot, attempt: u32, worker_job: String) {
    let events_url = format!("{}/v1/jobs/{worker_job}/events", slot.base_url);
    let mut reconnects = 0u32;
    loop {
        if !still_current(&hive, &job_id, attempt) {
            return;
        }
        match bearer(hive.client.get(&events_url), &slot).send().await {
            Ok(r) if r.status().is_success() => {
                let mut stream = r.bytes_stream();
                let mut buf = String::new();
                while let Some(chunk) = stream.next().await {
                    let Ok(chunk) = chunk else { break };
                    buf.push_str(&String::from_utf8_lossy(&chunk));
                    while let Some(end) = buf.find("\n\n") {
                        let block: String = buf.drain(..end + 2).collect();
                        if let Some(event) = parse_sse_block(&block, &job_id) {
                            if on_event(&hive, &job_id, &slot, attempt, &worker_job, event).await {
                                return;
                            }
                        }
                    }
                }
            }
            Ok(r) if matches!(r.status().as_u16(), 404 | 410) => {
                // The worker no longer has the job (it restarted, or the result expired): treat as lost.
                let starts = {
                    let mut state = hive.lock();
                    lose_job(&mut state, &job_id, attempt, "the worker no longer knows this job");
                    release(&mut state, &slot.worker, slot.epoch);
                    pump(&hive, &mut state)
                };
                start_dispatches(&hive, starts);
                return;
            }
            Ok(r) => tracing::debug!(status = %r.status(), "event stream refused"),
            Err(e) => tracing::debug!("event stream failed: {e}"),
        }
        reconnects += 1;
        // The worker is probably gone; its supervisor or the health sweep will say so. Poll gently meanwhile.
        tokio::time::sleep(Duration::from_millis(200 * u64::from(reconnects.min(10)))).await;
    }
}

/// One `event: …\ndata: …` block; comments (keep-alives) give `None`.
pub fn parse_sse_block(block: &str, hive_id: &str) -> Option<SseEvent> {
    let mut name = None;
    let mut data = String::new();
    for line in block.lines() {
        if let Some(v) = line.strip_prefix("event:") {
            name = Some(v.trim().to_string());
        } else if let Some(v) = line.strip_prefix("data:") {
            if !data.is_empty() {
                data.push('\n');
            }
            data.push_str(v.strip_prefix(' ').unwrap_or(v));
        }
    }
    let name = name?;
    let data = match serde_json::from_str::<Value>(&data) {
        Ok(v) => rewrite_snapshot(v, hive_id).to_string(),
        Err(_) => data,
    };
    Some(SseEvent { name, data })
}

/// Applies one worker event; `true` when the job is over (or no longer ours to follow).
async fn on_event(
    hive: &Arc<Hive>,
    job_id: &str,
    slot: &Slot,
    attempt: u32,
    worker_job: &str,
    event: SseEvent,
) -> bool {
    let terminal = event.is_terminal();
    let started = event.name == "started";
    if !terminal {
        {
            let mut state = hive.lock();
            let Some(job) = state.jobs.get_mut(job_id) else { return true };
            if job.attempt != attempt {
                return true;
            }
            let Phase::OnWorker { started: s, .. } = &mut job.phase else { return true };
            // Marked before anything else so a death right after `started` counts as a running job lost.
            *s |= started;
            job.publish(event);
        }
        if started {
            // A full snapshot to patch into a `worker_lost` failure, should it come to that.
            if let Some(snapshot) = fetch_snapshot(hive, slot, worker_job, job_id).await {
                if let Some(job) = hive.lock().jobs.get_mut(job_id) {
                    if job.attempt == attempt && matches!(job.phase, Phase::OnWorker { .. }) {
                        job.snapshot = Some(snapshot);
                    }
                }
            }
        }
        return false;
    }
    let snapshot = fetch_snapshot(hive, slot, worker_job, job_id).await;
    let starts = {
        let mut state = hive.lock();
        let Some(job) = state.jobs.get_mut(job_id) else { return true };
        if job.attempt != attempt || !matches!(job.phase, Phase::OnWorker { .. }) {
            return true;
        }
        let name = event.name.clone();
        let never_started = matches!(job.phase, Phase::OnWorker { started: false, .. });
        let shutting_down = name == "failed"
            && serde_json::from_str::<Value>(&event.data)
                .is_ok_and(|v| v["error"]["kind"] == JobErrorKind::ShuttingDown.as_str());
        if shutting_down && never_started {
            // The worker is stopping and dropped its queue; the job never ran, so it can run elsewhere.
            release(&mut state, &slot.worker, slot.epoch);
            requeue(&mut state, job_id);
            let starts = pump(hive, &mut state);
            drop(state);
            start_dispatches(hive, starts);
            return true;
        }
        job.publish(event);
        job.phase = Phase::Done;
        job.finished = Some(Instant::now());
        job.snapshot = snapshot.or_else(|| {
            let mut view = job.local_view(None);
            view["state"] = json!(match name.as_str() {
                "completed" => "succeeded",
                "cancelled" => "cancelled",
                _ => "failed",
            });
            Some(view)
        });
        match name.as_str() {
            "completed" => state.metrics.jobs_succeeded += 1,
            "cancelled" => state.metrics.jobs_cancelled += 1,
            _ => state.metrics.jobs_failed += 1,
        }
        release(&mut state, &slot.worker, slot.epoch);
        pump(hive, &mut state)
    };
    start_dispatches(hive, starts);
    true
}

async fn fetch_snapshot(hive: &Hive, slot: &Slot, worker_job: &str, hive_id: &str) -> Option<Value> {
    let url = format!("{}/v1/jobs/{worker_job}", slot.base_url);
    let r = bearer(hive.client.get(url), slot).timeout(Duration::from_secs(30)).send().await.ok()?;
    if !r.status().is_success() {
        return None;
    }
    r.json::<Value>().await.ok().map(|v| rewrite_snapshot(v, hive_id))
}

/// A job's worker is gone: queued there → back to the hive queue; running → `worker_lost`.
fn lose_job(state: &mut State, job_id: &str, attempt: u32, why: &str) {
    let Some(job) = state.jobs.get_mut(job_id) else { return };
    if job.attempt != attempt {
        return;
    }
    match job.phase.clone() {
        Phase::OnWorker { started: true, worker, .. } => {
            fail(
                job,
                JobErrorKind::WorkerLost,
                format!("worker {worker} was lost while running this job: {why}"),
                None,
            );
            state.metrics.jobs_failed += 1;
            state.metrics.jobs_worker_lost += 1;
        }
        Phase::OnWorker { started: false, .. } | Phase::Dispatching { .. } => requeue(state, job_id),
        Phase::Queued | Phase::Done => {}
    }
}

/// Everything the hive had on `worker` during `epoch` (or earlier) is lost. Call with the state lock held;
/// returns dispatches to start.
pub fn worker_lost(
    hive: &Hive,
    state: &mut State,
    worker: &str,
    epoch: u64,
    why: &str,
) -> Vec<(String, Slot, u32)> {
    let affected: Vec<(String, u32)> = state
        .jobs
        .values()
        .filter(|j| match &j.phase {
            Phase::Dispatching { worker: w, epoch: e } | Phase::OnWorker { worker: w, epoch: e, .. } => {
                w == worker && *e <= epoch
            }
            _ => false,
        })
        .map(|j| (j.id.clone(), j.attempt))
        .collect();
    if !affected.is_empty() {
        tracing::warn!(worker, jobs = affected.len(), "worker lost: {why}");
    }
    // Running jobs fail before queued ones go back, so the re-queued keep their order at the front.
    let mut ordered = affected;
    ordered.sort_by_key(|(id, _)| {
        state.jobs.get(id).map(|j| {
            (
                !matches!(j.phase, Phase::OnWorker { started: true, .. }),
                std::cmp::Reverse(j.created_at.to_bits()),
            )
        })
    });
    for (id, attempt) in ordered {
        lose_job(state, &id, attempt, why);
    }
    if let Some(w) = state.workers.get_mut(worker) {
        if w.epoch <= epoch {
            w.epoch = epoch + 1;
            w.inflight = 0;
        }
    }
    pump(hive, state)
}

/// Shutdown: jobs still waiting in the hive will not run here; they fail `shutting_down` (resubmit elsewhere).
pub fn fail_waiting(state: &mut State) {
    state.queue.clear();
    let mut failed = 0;
    for job in state.jobs.values_mut().filter(|j| j.phase == Phase::Queued) {
        fail(job, JobErrorKind::ShuttingDown, "the hive shut down before a worker was free".into(), None);
        failed += 1;
    }
    state.metrics.jobs_failed += failed;
}

/// Drops finished jobs older than the TTL.
pub fn expire_jobs(state: &mut State, ttl: Duration, now: Instant) {
    state.jobs.retain(|_, j| j.finished.is_none_or(|t| now.saturating_duration_since(t) < ttl));
}

/// Jobs not finished yet (queued in the hive or on a worker).
pub fn active_jobs(state: &State) -> usize {
    state.jobs.values().filter(|j| j.phase != Phase::Done).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::HiveConfig;
    use crate::registry::tests::request;

    fn job(id: &str, phase: Phase, created_at: f64) -> HiveJob {
        HiveJob {
            id: id.into(),
            body: json!({"prompt": "x"}),
            model: None,
            phase,
            attempt: 1,
            created_at,
            finished: None,
            snapshot: None,
            events: broadcast::channel(4).0,
            replay: Vec::new(),
            cancel_requested: false,
            first_dispatch: None,
        }
    }

    #[test]
    fn a_lost_worker_fails_its_running_job_and_redispatches_the_queued_ones() {
        let hive = Hive::new(HiveConfig::default(), "t".into(), "http://hive".into()).unwrap();
        let mut state = hive.lock();
        let now = Instant::now();
        state.register(request("w1", "http://h:1", 1), now).unwrap();
        state.register(request("w2", "http://h:2", 2), now).unwrap();
        let on_w1 =
            |started| Phase::OnWorker { worker: "w1".into(), epoch: 0, worker_job: "j".into(), started };
        state.jobs.insert("running".into(), job("running", on_w1(true), 1.0));
        state.jobs.insert("waiting".into(), job("waiting", on_w1(false), 2.0));
        state.jobs.insert("in_hive".into(), job("in_hive", Phase::Queued, 3.0));
        state.queue.push_back(Ticket::Job("in_hive".into()));
        state.workers.get_mut("w1").unwrap().inflight = 2;
        // w2 is full: the jobs w1 leaves behind must wait.
        state.workers.get_mut("w2").unwrap().inflight = 2;

        // As the supervisor does when the process exits: unroutable first, then the jobs are settled.
        state.workers.get_mut("w1").unwrap().registration = None;
        let starts = worker_lost(&hive, &mut state, "w1", 0, "killed");
        assert!(starts.is_empty(), "no free slot anywhere yet");
        let running = &state.jobs["running"];
        assert_eq!(running.phase, Phase::Done);
        assert_eq!(running.snapshot.as_ref().unwrap()["error"]["kind"], "worker_lost");
        assert!(running.replay.iter().any(|e| e.name == "failed"));
        assert_eq!(state.jobs["waiting"].phase, Phase::Queued);
        let order: Vec<String> = state
            .queue
            .iter()
            .filter_map(|t| match t {
                Ticket::Job(id) => Some(id.clone()),
                Ticket::Sync { .. } => None,
            })
            .collect();
        assert_eq!(order, ["waiting", "in_hive"], "the re-queued job goes first");
        let w1 = &state.workers["w1"];
        assert_eq!((w1.epoch, w1.inflight), (1, 0));

        // A late answer for the old epoch does not touch the new life's count.
        release(&mut state, "w1", 0);
        assert_eq!(state.workers["w1"].inflight, 0);

        // When w2 frees a slot, the oldest waiting job takes it.
        release(&mut state, "w2", 0);
        let starts = pump(&hive, &mut state);
        assert_eq!(starts.len(), 1);
        assert_eq!((starts[0].0.as_str(), starts[0].1.worker.as_str()), ("waiting", "w2"));
        assert_eq!(state.queue.len(), 1, "in_hive still waits");
        // The restarted w1 registers again and takes it.
        state.register(request("w1", "http://h:1", 3), now).unwrap();
        let starts = pump(&hive, &mut state);
        assert_eq!(
            (starts[0].0.as_str(), starts[0].1.worker.as_str(), starts[0].1.epoch),
            ("in_hive", "w1", 1)
        );
    }

    #[test]
    fn sse_blocks_are_rewritten_to_the_hive_id() {
        let e = parse_sse_block(
            "event: progress\ndata: {\"event\":\"progress\",\"id\":\"job_w\",\"step\":3}\n\n",
            "job_h",
        )
        .unwrap();
        assert_eq!(e.name, "progress");
        let v: Value = serde_json::from_str(&e.data).unwrap();
        assert_eq!(v["id"], "job_h");
        assert_eq!(v["step"], 3);
        assert!(parse_sse_block(": keep-alive\n\n", "job_h").is_none());
        let snap = rewrite_snapshot(json!({"id": "job_w", "links": {"self": "/v1/jobs/job_w"}}), "job_h");
        assert_eq!(snap["links"]["events"], "/v1/jobs/job_h/events");
    }
}
