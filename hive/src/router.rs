//! Choosing a worker and keeping track of what was sent where: the hive's bounded queue of waiting
//! requests, the routing policy (a worker that has the request's model loaded, else an idle one to switch,
//! without switching a worker away from a model that still has requests waiting, nor while a worker started
//! on demand for the model comes up; what can be placed nowhere may get such a worker: `capacity`), hive job ids mapped to
//! worker job ids, dispatch of native jobs, the monitor that follows each dispatched job's event stream
//! (re-publishing it under the hive id), and what happens to jobs whose worker dies — queued ones go back to
//! the hive queue, and so do running ones, once: a generation is reproducible from its seed, so it is run
//! again elsewhere before it fails with `worker_lost`.

use crate::registry::{WorkerEntry, WorkerStatus};
use crate::{models, random_hex, unix_now, Hive, State};
use futures::StreamExt;
use sdhive_protocol::{JobAccepted, JobErrorKind, JobLinks};
use serde_json::{json, Value};
use std::collections::HashMap;
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
    /// What every attempt submits: the client's request with the model made explicit and the seed pinned.
    pub body: Value,
    /// The resolved model (`None`: whatever the worker has).
    pub model: Option<String>,
    pub phase: Phase,
    /// Dispatch attempts so far; a monitor of an older attempt stands down.
    pub attempt: u32,
    /// Times it was run again after its worker was lost mid-run.
    pub reruns: u32,
    /// When it first waited for a worker: its age decides when it may switch a busy model's worker.
    pub queued_since: Instant,
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

/// How often a request whose worker was lost while running it is run again before it fails `worker_lost`.
pub const MAX_RERUNS: u32 = 1;

/// What waits in the hive queue.
pub enum Waiting {
    /// A native job, by hive id.
    Job(String),
    /// A synchronous (OpenAI/A1111) request; its handler waits on the receiver.
    Sync(oneshot::Sender<Slot>),
}

/// A request waiting for a worker slot.
pub struct Ticket {
    pub waiting: Waiting,
    /// The resolved model (`None`: any worker, as it is).
    pub model: Option<String>,
    pub since: Instant,
    /// A worker life this request must not go to again (it was lost running it).
    pub avoid: Option<Avoid>,
}

/// Keeps a re-run off the worker life that lost it, for a while: long enough for the hive to see a death (its
/// supervisor, or missed heartbeats), short enough that a worker that only dropped a connection is not
/// shunned for good (it may be the only one).
#[derive(Debug, Clone, PartialEq)]
pub struct Avoid {
    pub worker: String,
    pub epoch: u64,
    pub until: Instant,
}

impl Avoid {
    pub fn new(hive: &Hive, worker: &str, epoch: u64) -> Avoid {
        Avoid { worker: worker.into(), epoch, until: Instant::now() + hive.config.heartbeat_interval() * 3 }
    }
}

impl Ticket {
    pub fn job(id: &str, model: Option<String>, since: Instant) -> Ticket {
        Ticket { waiting: Waiting::Job(id.to_string()), model, since, avoid: None }
    }
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
            w.last_active = Some(Instant::now());
            if w.inflight == 0
                && w.status == WorkerStatus::Busy
                && w.heartbeat.as_ref().is_none_or(|h| h.queue_depth == 0 && h.running_job.is_none())
            {
                w.status = WorkerStatus::Ready;
            }
        }
    }
}

/// Whether worker `w` is the life `avoid` excludes, now.
fn avoided(w: &WorkerEntry, avoid: Option<&Avoid>, now: Instant) -> bool {
    avoid.is_some_and(|a| w.id == a.worker && w.epoch == a.epoch && now < a.until)
}

/// What a pass of [`pump`] knows about the whole queue.
struct Pass {
    /// Waiting requests per model: a worker whose model still has some is not switched away from it.
    demand: HashMap<String, usize>,
    /// Worker → the model a request that waited too long needs it for: it gets no more requests of its own
    /// model, so that it drains and switches (without this, a steady stream for one model would starve the
    /// others on a single-device node).
    reserved: HashMap<String, String>,
}

impl Pass {
    fn new(hive: &Hive, state: &State, now: Instant) -> Pass {
        let mut demand: HashMap<String, usize> = HashMap::new();
        for m in state.queue.iter().filter_map(|t| t.model.clone()) {
            *demand.entry(m).or_default() += 1;
        }
        let wait = hive.config.model_switch_wait();
        let mut reserved: HashMap<String, String> = HashMap::new();
        for t in state.queue.iter().filter(|t| now.saturating_duration_since(t.since) >= wait) {
            let Some(m) = &t.model else { continue };
            let held = state.workers.values().any(|w| w.routable(now) && w.holds(m));
            if held || reserved.values().any(|r| r == m) {
                continue;
            }
            let in_catalog = models::in_catalog(&state.catalog, m);
            let candidate = state
                .workers
                .values()
                // A node hive needs no draining to take another model: it switches its own workers.
                .filter(|w| {
                    w.routable(now)
                        && !w.is_hive()
                        && !reserved.contains_key(&w.id)
                        && !avoided(w, t.avoid.as_ref(), now)
                })
                .filter(|w| w.can_load(m, in_catalog))
                .min_by_key(|w| (w.inflight, w.last_used, w.id.clone()));
            if let Some(w) = candidate {
                reserved.insert(w.id.clone(), m.clone());
            }
        }
        Pass { demand, reserved }
    }
}

/// The worker for a request for `model`, by the routing policy (`docs/operations.md`, "Routing"):
/// 1. the least loaded worker with a free slot whose model (after what it already has) is `model` — any worker
///    with a free slot when `model` is `None`;
/// 2. else an idle worker (nothing of the hive's on it) that can load `model`: one with nothing loaded, then the
///    one whose model was used least recently; a worker whose model still has requests waiting is left to
///    them, unless this request has waited `model_switch_wait_secs` (`urgent`). A node hive (a child of this
///    gateway) whose library has `model` counts as idle while it has a free slot: it places the request on its
///    own workers, by this same policy;
/// 3. else none: the request waits.
///
/// A worker reserved for an urgent request of another model takes nothing else.
fn choose(
    hive: &Hive,
    state: &State,
    model: Option<&str>,
    avoid: Option<&Avoid>,
    urgent: bool,
    pass: &Pass,
    now: Instant,
) -> Option<String> {
    let usable = |w: &&WorkerEntry| {
        w.routable(now)
            && !avoided(w, avoid, now)
            && pass.reserved.get(&w.id).is_none_or(|r| Some(r.as_str()) == model)
    };
    let hot = state
        .workers
        .values()
        .filter(usable)
        .filter(|w| w.inflight < w.slots(hive.config.worker_slots))
        .filter(|w| model.is_none_or(|m| w.holds(m)))
        .min_by_key(|w| (w.load(), w.inflight, w.id.clone()));
    if let Some(w) = hot {
        return Some(w.id.clone());
    }
    let m = model?;
    // A worker being started for this model will have it: switching another one to it meanwhile would only
    // evict that one's model.
    if awaited(state, m) {
        return None;
    }
    let in_catalog = models::in_catalog(&state.catalog, m);
    let wanted = |w: &WorkerEntry| {
        !w.is_hive() && w.loaded.as_ref().is_some_and(|l| pass.demand.get(l).is_some_and(|&n| n > 0))
    };
    let free = |w: &WorkerEntry| match w.is_hive() {
        true => w.inflight < w.slots(hive.config.worker_slots),
        false => w.inflight == 0,
    };
    state
        .workers
        .values()
        .filter(usable)
        .filter(|w| free(w) && w.can_load(m, in_catalog))
        .filter(|w| urgent || !wanted(w))
        .min_by_key(|w| (wanted(w), w.loaded.is_some(), w.load(), w.last_used, w.id.clone()))
        .map(|w| w.id.clone())
}

/// Whether a request for `model` that has waited since `since` could be handed to a worker now, by
/// [`choose`]'s policy.
pub fn placeable(hive: &Hive, state: &State, model: &str, since: Instant, now: Instant) -> bool {
    let pass = Pass::new(hive, state, now);
    let urgent = now.saturating_duration_since(since) >= hive.config.model_switch_wait();
    choose(hive, state, Some(model), None, urgent, &pass, now).is_some()
}

/// Whether a worker started on demand for `model` is still coming up.
pub fn awaited(state: &State, model: &str) -> bool {
    state.workers.values().any(|w| {
        w.on_demand.is_some()
            && w.status == WorkerStatus::Starting
            && !w.stop_requested
            && w.planned_source.as_deref() == Some(model)
    })
}

/// Takes a slot on `worker` for a request for `model`; the worker will have `model` loaded once it gets there.
fn take_slot(
    hive: &Hive,
    state: &mut State,
    worker: &str,
    model: Option<&str>,
    now: Instant,
) -> Option<Slot> {
    let w = state.workers.get_mut(worker)?;
    let base_url = w.base_url()?.to_string();
    w.inflight += 1;
    w.last_active = Some(now);
    if w.status == WorkerStatus::Ready {
        w.status = WorkerStatus::Busy;
    }
    let mut switched = false;
    if let (Some(m), Some(node)) = (model, w.node.as_mut()) {
        // Until its next heartbeat says otherwise, the node will have it loaded on some worker.
        if !node.loaded.iter().any(|l| l == m) {
            node.loaded.push(m.to_string());
        }
        w.last_used = Some(now);
    } else if let Some(m) = model {
        if w.loaded.as_deref() != Some(m) {
            tracing::info!(worker, from = ?w.loaded, to = m, "switching the worker's model");
            switched = w.loaded.is_some();
            w.loaded = Some(m.to_string());
        }
        w.last_used = Some(now);
    }
    let api_key_required = w.registration.as_ref().is_some_and(|r| r.api_key_required);
    let slot = Slot {
        worker: worker.to_string(),
        epoch: w.epoch,
        base_url,
        bearer: if api_key_required { hive.config.worker_api_key.clone() } else { None },
    };
    if switched {
        state.metrics.model_switches += 1;
    }
    Some(slot)
}

/// Up, or on its way up (starting, restarting, silent for now): worth waiting for.
pub fn may_serve(w: &WorkerEntry) -> bool {
    !matches!(w.status, WorkerStatus::Failed | WorkerStatus::Stopped) && !w.stop_requested
}

/// Whether any worker could take work; without one, waiting in the queue would be waiting forever.
pub fn any_worker(state: &State) -> bool {
    state.workers.values().any(may_serve)
}

/// Whether the ticket still waits for someone (not cancelled, not abandoned by its client).
fn still_wanted(state: &State, t: &Ticket) -> bool {
    match &t.waiting {
        Waiting::Job(id) => state.jobs.get(id).is_some_and(|j| j.phase == Phase::Queued),
        Waiting::Sync(reply) => !reply.is_closed(),
    }
}

/// Hands free slots to waiting tickets, oldest first, by [`choose`]'s policy (a ticket no worker can take now
/// does not hold back the others). After each hand-out the queue is looked at again from its oldest ticket,
/// since what waits (and so which workers may switch) has changed. Returns the native jobs to dispatch, to be
/// started outside the lock.
pub fn pump(hive: &Hive, state: &mut State) -> Vec<(String, Slot, u32)> {
    let now = Instant::now();
    let queue = std::mem::take(&mut state.queue);
    state.queue = queue.into_iter().filter(|t| still_wanted(state, t)).collect();
    let wait = hive.config.model_switch_wait();
    let mut starts = Vec::new();
    'pass: loop {
        let pass = Pass::new(hive, state, now);
        for i in 0..state.queue.len() {
            let t = &state.queue[i];
            let (model, avoid) = (t.model.clone(), t.avoid.clone());
            let urgent = now.saturating_duration_since(t.since) >= wait;
            let chosen = choose(hive, state, model.as_deref(), avoid.as_ref(), urgent, &pass, now);
            let Some(slot) = chosen.and_then(|w| take_slot(hive, state, &w, model.as_deref(), now)) else {
                continue;
            };
            let Some(ticket) = state.queue.remove(i) else { break 'pass };
            match ticket.waiting {
                Waiting::Job(id) => {
                    if let Some(job) = state.jobs.get_mut(&id) {
                        job.phase = Phase::Dispatching { worker: slot.worker.clone(), epoch: slot.epoch };
                        job.attempt += 1;
                        starts.push((id, slot, job.attempt));
                    }
                }
                Waiting::Sync(reply) => {
                    if let Err(slot) = reply.send(slot) {
                        release(state, &slot.worker, slot.epoch);
                    }
                }
            }
            continue 'pass;
        }
        break;
    }
    publish_queue_positions(state);
    // What still waits may need a worker started for it (`capacity`).
    if !state.queue.is_empty() {
        hive.capacity_wake.notify_one();
    }
    starts
}

/// Tells subscribers of hive-queued jobs where they stand.
fn publish_queue_positions(state: &mut State) {
    let ids: Vec<String> = state
        .queue
        .iter()
        .filter_map(|t| match &t.waiting {
            Waiting::Job(id) => Some(id.clone()),
            Waiting::Sync(_) => None,
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
        .filter(|t| matches!(t.waiting, Waiting::Job(_)))
        .position(|t| matches!(&t.waiting, Waiting::Job(id) if id == job_id))
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
    /// The name matches no model; with the closest titles.
    UnknownModel(sdhive_catalog::NotFound),
    /// A known model that no worker can load (its only worker failed, or only external workers run and
    /// none has it loaded), with why.
    Unservable(String),
    NoWorkers,
}

/// What a worker's refusal of a submission looks like: its status and error body.
pub type Refusal = Option<(u16, Value)>;

/// Resolves a request's model (`query`: what it names, if anything) to the model to route by, refusing names
/// no worker could run. A configured model that no worker preloads and the library lacks is named as such,
/// rather than as unknown.
pub fn resolve_model(
    hive: &Hive,
    state: &State,
    query: Option<&str>,
) -> Result<models::Resolved, SubmitError> {
    let resolved = match models::resolve(state, query) {
        Ok(r) => r,
        Err(nf) => {
            let configured = hive.config.models.iter().find(|m| models::same_model_name(m, &nf.query));
            return Err(match configured {
                Some(m) => SubmitError::Unservable(format!(
                    "`{m}` is configured, but no worker preloads it and it lies outside every models dir \
                     (add its folder with --models-dir)"
                )),
                None => SubmitError::UnknownModel(nf),
            });
        }
    };
    if let Some(m) = &resolved {
        if !models::servable(state, m) {
            let title = models::title_of(state, m);
            return Err(SubmitError::Unservable(format!(
                "no running or starting worker can load `{title}` (see GET /v1/workers)"
            )));
        }
    }
    Ok(resolved)
}

/// Whether a new request may queue at all.
fn admit(hive: &Hive, state: &mut State) -> Result<(), SubmitError> {
    if state.draining {
        return Err(SubmitError::Draining);
    }
    if !any_worker(state) {
        return Err(SubmitError::NoWorkers);
    }
    if state.queue.len() >= hive.config.queue_size {
        state.metrics.rejected_queue_full += 1;
        return Err(SubmitError::QueueFull);
    }
    Ok(())
}

/// Creates a hive job for `body` (its seed already pinned) and queues it; dispatch happens when a slot frees
/// (possibly at once). The model is `body.model`, else `query` (`?model=`), else the selected one; it is
/// written into the body so every worker runs the same model. When the job was dispatched at once, the
/// receiver tells whether the worker refused the request itself.
pub fn submit(
    hive: &Arc<Hive>,
    mut body: Value,
    query: Option<String>,
) -> Result<(JobAccepted, Option<oneshot::Receiver<Refusal>>), SubmitError> {
    let id = format!("job_{}", random_hex(12));
    let starts;
    let position;
    let (first_tx, first_rx) = oneshot::channel();
    let dispatched_now;
    {
        let mut state = hive.lock();
        let named = body["model"].as_str().map(String::from).or(query);
        let model = resolve_model(hive, &state, named.as_deref())?;
        admit(hive, &mut state)?;
        if let (Some(m), Some(obj)) = (&model, body.as_object_mut()) {
            obj.insert("model".into(), json!(m));
        }
        state.metrics.jobs_submitted += 1;
        let now = Instant::now();
        state.jobs.insert(
            id.clone(),
            HiveJob {
                id: id.clone(),
                body,
                model: model.clone(),
                phase: Phase::Queued,
                attempt: 0,
                reruns: 0,
                queued_since: now,
                created_at: unix_now(),
                finished: None,
                snapshot: None,
                events: broadcast::channel(64).0,
                replay: Vec::new(),
                cancel_requested: false,
                first_dispatch: Some(first_tx),
            },
        );
        state.queue.push_back(Ticket::job(&id, model, now));
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

/// Queues a synchronous request for `model` and returns where its slot will arrive. A first try is refused
/// when the hive is full; a re-run (`avoid`: the worker life that was lost running it) goes to the front,
/// since it was accepted long ago.
pub fn enqueue_sync(
    hive: &Arc<Hive>,
    model: Option<String>,
    since: Instant,
    avoid: Option<Avoid>,
) -> Result<oneshot::Receiver<Slot>, SubmitError> {
    let (reply, rx) = oneshot::channel();
    let starts = {
        let mut state = hive.lock();
        let ticket = Ticket { waiting: Waiting::Sync(reply), model, since, avoid };
        if ticket.avoid.is_some() {
            if state.draining {
                return Err(SubmitError::Draining);
            }
            state.queue.push_front(ticket);
        } else {
            admit(hive, &mut state)?;
            state.metrics.sync_requests += 1;
            state.queue.push_back(ticket);
        }
        pump(hive, &mut state)
    };
    start_dispatches(hive, starts);
    Ok(rx)
}

/// Puts a job back at the front of the hive queue (its worker refused it, died before running it, or died
/// running it and it runs again); `avoid` keeps it off the worker life that lost it.
fn requeue(state: &mut State, id: &str, avoid: Option<Avoid>) {
    if let Some(job) = state.jobs.get_mut(id) {
        if job.cancel_requested {
            finish_cancelled(job);
            state.metrics.jobs_cancelled += 1;
            return;
        }
        job.phase = Phase::Queued;
        state.metrics.jobs_redispatched += 1;
        let ticket = Ticket { avoid, ..Ticket::job(id, job.model.clone(), job.queued_since) };
        state.queue.push_front(ticket);
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
            state.queue.retain(|t| !matches!(&t.waiting, Waiting::Job(j) if j == id));
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
            if e.is_connect() {
                let starts = connection_refused(&hive, &mut hive.lock(), &slot.worker, slot.epoch);
                start_dispatches(&hive, starts);
            }
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
                    requeue(&mut state, &job_id, None);
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

/// Resolves once `slot`'s worker life has ended (death, re-registration, or silence seen by the health sweep).
pub async fn slot_lost(hive: &Hive, slot: &Slot) {
    life_ended(hive, &slot.worker, slot.epoch).await
}

/// Resolves once life `epoch` of `worker` has ended: what waits on an answer from it stops waiting, since its
/// requests are being run elsewhere (a cut link answers nothing, not even an error).
pub async fn life_ended(hive: &Hive, worker: &str, epoch: u64) {
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let state = hive.lock();
        if state.workers.get(worker).is_none_or(|w| w.epoch != epoch) {
            return;
        }
    }
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
                loop {
                    // A stream from a worker cut off mid-job stays silent: the job moving on (its worker's life
                    // ended) retires this monitor instead.
                    let next = tokio::select! {
                        next = stream.next() => next,
                        () = slot_lost(&hive, &slot) => return,
                    };
                    let Some(Ok(chunk)) = next else { break };
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
                    lose_job(&hive, &mut state, &job_id, attempt, "the worker no longer knows this job");
                    release(&mut state, &slot.worker, slot.epoch);
                    pump(&hive, &mut state)
                };
                start_dispatches(&hive, starts);
                return;
            }
            Ok(r) => tracing::debug!(status = %r.status(), "event stream refused"),
            Err(e) => {
                tracing::debug!("event stream failed: {e}");
                if e.is_connect() {
                    let starts = connection_refused(&hive, &mut hive.lock(), &slot.worker, slot.epoch);
                    start_dispatches(&hive, starts);
                }
            }
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
            requeue(&mut state, job_id, None);
            let starts = pump(hive, &mut state);
            drop(state);
            start_dispatches(hive, starts);
            return true;
        }
        if name == "completed" && snapshot.is_none() {
            // The images live in the worker's snapshot: a worker gone before it could be read took them along,
            // so the job counts as lost while running (run again once), not as succeeded without images.
            release(&mut state, &slot.worker, slot.epoch);
            lose_job(hive, &mut state, job_id, attempt, "its images could not be read after it completed");
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

/// A job's worker is gone: queued there → back to the hive queue; running → back to the hive queue too, to
/// run again from the start with the same seed (the same image), once; lost again → `worker_lost`.
fn lose_job(hive: &Hive, state: &mut State, job_id: &str, attempt: u32, why: &str) {
    let Some(job) = state.jobs.get_mut(job_id) else { return };
    if job.attempt != attempt {
        return;
    }
    match job.phase.clone() {
        Phase::OnWorker { started: true, worker, epoch, .. } if job.reruns < MAX_RERUNS => {
            job.reruns += 1;
            tracing::warn!(job = %job_id, worker, "worker lost while running the job ({why}); running it again");
            // The first run's progress and snapshot would read as this run's; the re-run reports afresh.
            job.replay.clear();
            job.snapshot = None;
            state.metrics.jobs_rerun += 1;
            requeue(state, job_id, Some(Avoid::new(hive, &worker, epoch)));
        }
        Phase::OnWorker { started: true, worker, .. } => {
            fail(
                job,
                JobErrorKind::WorkerLost,
                format!(
                    "worker {worker} was lost while running this job, after it had been run again: {why}"
                ),
                None,
            );
            state.metrics.jobs_failed += 1;
            state.metrics.jobs_worker_lost += 1;
        }
        Phase::OnWorker { started: false, .. } | Phase::Dispatching { .. } => requeue(state, job_id, None),
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
    let mut affected: Vec<(String, u32, f64)> = state
        .jobs
        .values()
        .filter(|j| match &j.phase {
            Phase::Dispatching { worker: w, epoch: e } | Phase::OnWorker { worker: w, epoch: e, .. } => {
                w == worker && *e <= epoch
            }
            _ => false,
        })
        .map(|j| (j.id.clone(), j.attempt, j.created_at))
        .collect();
    if !affected.is_empty() {
        tracing::warn!(worker, jobs = affected.len(), "worker lost: {why}");
    }
    // Each goes to the front of the queue: newest first, so that the oldest ends up first.
    affected.sort_by(|a, b| b.2.total_cmp(&a.2));
    for (id, attempt, _) in affected {
        lose_job(hive, state, &id, attempt, why);
    }
    if let Some(w) = state.workers.get_mut(worker) {
        if w.epoch <= epoch {
            w.epoch = epoch + 1;
            w.inflight = 0;
        }
    }
    pump(hive, state)
}

/// An external worker or node hive whose address refuses connections is gone (its process was killed, or it is
/// restarting): its life ends at once, rather than after its missed heartbeats, and what it held runs again
/// elsewhere. A heartbeat from the same process revives it; a new process registers anew. Managed workers are
/// their supervisor's to judge.
pub fn connection_refused(
    hive: &Hive,
    state: &mut State,
    worker: &str,
    epoch: u64,
) -> Vec<(String, Slot, u32)> {
    let Some(w) = state.workers.get_mut(worker) else { return Vec::new() };
    if w.managed || w.epoch != epoch || w.registration.is_none() {
        return Vec::new();
    }
    tracing::warn!(worker, "its address refuses connections: lost");
    w.status = WorkerStatus::Unhealthy;
    worker_lost(hive, state, worker, epoch, "its address refuses connections")
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
            reruns: 0,
            queued_since: Instant::now(),
            created_at,
            finished: None,
            snapshot: None,
            events: broadcast::channel(4).0,
            replay: Vec::new(),
            cancel_requested: false,
            first_dispatch: None,
        }
    }

    fn queued_ids(state: &State) -> Vec<String> {
        state
            .queue
            .iter()
            .filter_map(|t| match &t.waiting {
                Waiting::Job(id) => Some(id.clone()),
                Waiting::Sync(_) => None,
            })
            .collect()
    }

    #[test]
    fn a_lost_worker_reruns_its_running_job_once_and_redispatches_the_queued_ones() {
        let hive = Hive::new(HiveConfig::default(), "t".into(), "http://hive".into()).unwrap();
        let mut state = hive.lock();
        let now = Instant::now();
        state.register(request("w1", "http://h:1", 1), now).unwrap();
        state.register(request("w2", "http://h:2", 2), now).unwrap();
        let on_w1 =
            |started| Phase::OnWorker { worker: "w1".into(), epoch: 0, worker_job: "j".into(), started };
        let mut running = job("running", on_w1(true), 1.0);
        running.replay.push(SseEvent { name: "progress".into(), data: "{\"step\":3}".into() });
        running.snapshot = Some(json!({"state": "running", "step": 3}));
        state.jobs.insert("running".into(), running);
        state.jobs.insert("waiting".into(), job("waiting", on_w1(false), 2.0));
        state.jobs.insert("in_hive".into(), job("in_hive", Phase::Queued, 3.0));
        let mut twice = job("twice", on_w1(true), 0.5);
        twice.reruns = MAX_RERUNS;
        state.jobs.insert("twice".into(), twice);
        state.queue.push_back(Ticket::job("in_hive", None, now));
        state.workers.get_mut("w1").unwrap().inflight = 2;
        // w2 is full: the jobs w1 leaves behind must wait.
        state.workers.get_mut("w2").unwrap().inflight = 2;

        // As the supervisor does when the process exits: unroutable first, then the jobs are settled.
        state.workers.get_mut("w1").unwrap().registration = None;
        let starts = worker_lost(&hive, &mut state, "w1", 0, "killed");
        assert!(starts.is_empty(), "no free slot anywhere yet");
        let rerun = &state.jobs["running"];
        assert_eq!((&rerun.phase, rerun.reruns), (&Phase::Queued, 1), "the running job runs again");
        assert!(
            rerun.replay.is_empty() || rerun.replay.iter().all(|e| e.name == "queued"),
            "{:?}",
            rerun.replay
        );
        assert!(rerun.snapshot.is_none(), "the first run's snapshot is not the re-run's");
        let lost = &state.jobs["twice"];
        assert_eq!(lost.phase, Phase::Done, "a job already run again fails");
        assert_eq!(lost.snapshot.as_ref().unwrap()["error"]["kind"], "worker_lost");
        assert!(lost.replay.iter().any(|e| e.name == "failed"));
        assert_eq!(state.jobs["waiting"].phase, Phase::Queued);
        assert_eq!(
            queued_ids(&state),
            ["running", "waiting", "in_hive"],
            "the re-queued jobs go first, oldest first"
        );
        assert_eq!((state.metrics.jobs_rerun, state.metrics.jobs_worker_lost), (1, 1));
        let w1 = &state.workers["w1"];
        assert_eq!((w1.epoch, w1.inflight), (1, 0));

        // A late answer for the old epoch does not touch the new life's count.
        release(&mut state, "w1", 0);
        assert_eq!(state.workers["w1"].inflight, 0);

        // When w2 frees a slot, the oldest waiting job takes it.
        release(&mut state, "w2", 0);
        let starts = pump(&hive, &mut state);
        assert_eq!(starts.len(), 1);
        assert_eq!((starts[0].0.as_str(), starts[0].1.worker.as_str()), ("running", "w2"));
        assert_eq!(state.queue.len(), 2, "the others still wait");
        // The restarted w1 registers again (a new life: the re-run may go there too) and takes them.
        state.register(request("w1", "http://h:1", 3), now).unwrap();
        let starts = pump(&hive, &mut state);
        let taken: Vec<(&str, &str, u64)> =
            starts.iter().map(|(id, slot, _)| (id.as_str(), slot.worker.as_str(), slot.epoch)).collect();
        assert_eq!(taken, [("waiting", "w1", 1), ("in_hive", "w1", 1)]);
    }

    /// A hive over a library of three fixture checkpoints, with two managed workers registered: `w1` holding
    /// the first model, `w2` the second. Returns the hive, the models' sources, and the temp dir.
    fn two_workers(slots: usize) -> (Arc<Hive>, Vec<String>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models");
        for (i, f) in ["sd1.safetensors", "sdxl.safetensors", "sd2v.safetensors"].iter().enumerate() {
            std::fs::copy(fixtures.join(f), dir.path().join(format!("m{i}.safetensors"))).unwrap();
        }
        let config =
            HiveConfig { worker_slots: slots, models_dirs: vec![dir.path().into()], ..Default::default() };
        let (catalog, sources) = models::scan_for_tests(&config);
        let hive = Hive::new(config, "t".into(), "http://hive".into()).unwrap();
        {
            let mut state = hive.lock();
            state.catalog = catalog;
            for (i, id) in ["w1", "w2"].into_iter().enumerate() {
                state.workers.insert(id.into(), WorkerEntry::managed(id, "cpu", 0, None));
                let mut req = request(id, &format!("http://h:{i}"), i as u32 + 1);
                req.model_source = Some(sources[i].clone());
                req.switchable = true;
                state.register(req, Instant::now()).unwrap();
            }
        }
        (hive, sources, dir)
    }

    fn queue_job(state: &mut State, id: &str, model: &str, since: Instant) {
        let mut j = job(id, Phase::Queued, unix_now());
        j.model = Some(model.into());
        j.attempt = 0;
        state.jobs.insert(id.into(), j);
        state.queue.push_back(Ticket::job(id, Some(model.into()), since));
    }

    fn dispatched(starts: &[(String, Slot, u32)]) -> Vec<(String, String)> {
        starts.iter().map(|(id, slot, _)| (id.clone(), slot.worker.clone())).collect()
    }

    fn pair(id: &str, worker: &str) -> (String, String) {
        (id.into(), worker.into())
    }

    #[test]
    fn requests_go_where_their_model_is_loaded_then_to_idle_workers() {
        let (hive, m, _dir) = two_workers(2);
        let mut state = hive.lock();
        let now = Instant::now();
        queue_job(&mut state, "b1", &m[1], now);
        queue_job(&mut state, "a1", &m[0], now);
        queue_job(&mut state, "a2", &m[0], now);
        let starts = pump(&hive, &mut state);
        assert_eq!(dispatched(&starts), [pair("b1", "w2"), pair("a1", "w1"), pair("a2", "w1")]);
        assert_eq!(state.metrics.model_switches, 0);
        // w1 is full with m0, w2 has m1 in flight: a third m0 request waits rather than switch a busy worker.
        queue_job(&mut state, "a3", &m[0], now);
        assert!(pump(&hive, &mut state).is_empty());
        // Once w2 is idle and its model has no more demand, it switches to m0.
        release(&mut state, "w2", 0);
        let starts = pump(&hive, &mut state);
        assert_eq!(dispatched(&starts), [pair("a3", "w2")]);
        assert_eq!(state.workers["w2"].loaded.as_deref(), Some(m[0].as_str()));
        assert_eq!(state.metrics.model_switches, 1);
        // A model nobody has goes to the idle worker whose model was used least recently.
        release(&mut state, "w1", 0);
        release(&mut state, "w1", 0);
        release(&mut state, "w2", 0);
        state.workers.get_mut("w1").unwrap().last_used = Some(now + Duration::from_secs(5));
        queue_job(&mut state, "c1", &m[2], now);
        let starts = pump(&hive, &mut state);
        assert_eq!(dispatched(&starts), [pair("c1", "w2")]);
    }

    #[test]
    fn a_worker_is_not_switched_away_from_a_model_with_requests_waiting_until_one_waited_too_long() {
        let (hive, m, _dir) = two_workers(1);
        let mut state = hive.lock();
        let now = Instant::now();
        // w2 is busy; w1 is idle with m0 loaded. An older m1 request must not take w1 while m0 requests wait.
        state.workers.get_mut("w2").unwrap().inflight = 1;
        queue_job(&mut state, "b1", &m[1], now);
        queue_job(&mut state, "a1", &m[0], now);
        queue_job(&mut state, "a2", &m[0], now);
        assert_eq!(dispatched(&pump(&hive, &mut state)), [pair("a1", "w1")]);
        release(&mut state, "w1", 0);
        assert_eq!(dispatched(&pump(&hive, &mut state)), [pair("a2", "w1")], "m0 first: no thrashing");
        release(&mut state, "w1", 0);
        assert_eq!(dispatched(&pump(&hive, &mut state)), [pair("b1", "w1")], "then the switch");
        assert_eq!(state.metrics.model_switches, 1);

        // A request that waited `model_switch_wait_secs` may switch a worker whose model still has demand.
        release(&mut state, "w1", 0);
        let old = now.checked_sub(hive.config.model_switch_wait() + Duration::from_secs(1)).unwrap_or(now);
        queue_job(&mut state, "a3", &m[0], old);
        queue_job(&mut state, "b2", &m[1], now);
        // w1 has m1 now: b2 is its model's demand, yet a3 has waited too long.
        assert_eq!(dispatched(&pump(&hive, &mut state)), [pair("a3", "w1")]);
    }

    #[test]
    fn a_steady_stream_for_one_model_does_not_starve_another() {
        let (hive, m, _dir) = two_workers(2);
        let mut state = hive.lock();
        let now = Instant::now();
        // One worker only (w2 is gone), busy with m0 and more m0 requests arriving all the time.
        state.workers.get_mut("w2").unwrap().stop_requested = true;
        state.workers.get_mut("w1").unwrap().inflight = 2;
        let old = now.checked_sub(hive.config.model_switch_wait() + Duration::from_secs(1)).unwrap_or(now);
        queue_job(&mut state, "b1", &m[1], old);
        queue_job(&mut state, "a1", &m[0], now);
        release(&mut state, "w1", 0);
        assert!(pump(&hive, &mut state).is_empty(), "w1 drains for the m1 request that waited too long");
        release(&mut state, "w1", 0);
        assert_eq!(dispatched(&pump(&hive, &mut state)), [pair("b1", "w1")]);
        // Then the m0 request, which now waits for w1 to have a free slot (it switches back once idle).
        release(&mut state, "w1", 0);
        assert_eq!(dispatched(&pump(&hive, &mut state)), [pair("a1", "w1")]);
    }

    #[test]
    fn external_workers_only_get_their_own_model_and_reruns_avoid_the_lost_worker() {
        let (hive, m, _dir) = two_workers(1);
        let mut state = hive.lock();
        let now = Instant::now();
        let mut req = request("ext", "http://h:9", 9);
        req.model_source = Some("/elsewhere/x.safetensors".into());
        req.switchable = true;
        state.register(req, now).unwrap();
        state.workers.get_mut("w1").unwrap().inflight = 1;
        state.workers.get_mut("w2").unwrap().inflight = 1;
        queue_job(&mut state, "c1", &m[2], now);
        assert!(pump(&hive, &mut state).is_empty(), "the idle external worker cannot load a library model");
        queue_job(&mut state, "x1", "/elsewhere/x.safetensors", now);
        assert_eq!(dispatched(&pump(&hive, &mut state)), [pair("x1", "ext")]);
        release(&mut state, "ext", 0);
        // A re-run stays off the life that lost it, for a while.
        let mut t = Ticket::job("x1", Some("/elsewhere/x.safetensors".into()), now);
        t.avoid = Some(Avoid::new(&hive, "ext", 0));
        if let Some(j) = state.jobs.get_mut("x1") {
            j.phase = Phase::Queued;
        }
        state.queue.push_front(t);
        assert!(pump(&hive, &mut state).is_empty());
        state.queue[0].avoid.as_mut().unwrap().until = now;
        assert_eq!(dispatched(&pump(&hive, &mut state)), [pair("x1", "ext")]);
    }

    #[test]
    fn an_external_worker_is_switched_to_any_model_of_its_library() {
        let (hive, m, _dir) = two_workers(1);
        let mut state = hive.lock();
        let now = Instant::now();
        let entry = |path: &str| sdhive_protocol::LibraryModel {
            filename: path.into(),
            name: path.trim_start_matches("/remote/").into(),
            title: path.trim_start_matches("/remote/").into(),
            model_name: sdhive_protocol::file_stem(path).into(),
            hash: None,
            sha256: None,
            format: "safetensors".into(),
        };
        let (x, y) = ("/remote/x.safetensors", "/remote/y.safetensors");
        let mut req = request("ext", "http://h:9", 9);
        req.model_source = Some(x.into());
        req.switchable = true;
        req.library = Some(vec![entry(x), entry(y), entry(&m[2])]);
        state.register(req, now).unwrap();
        state.workers.get_mut("w1").unwrap().inflight = 1;
        state.workers.get_mut("w2").unwrap().inflight = 1;
        // Not loaded there, but in its library: it switches, as a spawned worker would.
        queue_job(&mut state, "y1", y, now);
        assert_eq!(dispatched(&pump(&hive, &mut state)), [pair("y1", "ext")]);
        assert_eq!(state.workers["ext"].loaded.as_deref(), Some(y));
        assert_eq!(state.metrics.model_switches, 1);
        release(&mut state, "ext", 0);
        // A catalogue model it lists too (it shares the hive's models dir).
        queue_job(&mut state, "c1", &m[2], now);
        assert_eq!(dispatched(&pump(&hive, &mut state)), [pair("c1", "ext")]);
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

    fn node(
        id: &str,
        port: u16,
        slots: u32,
        library: &[&str],
        loaded: &[&str],
    ) -> sdhive_protocol::RegisterRequest {
        let mut req = request(id, &format!("http://n:{port}"), u32::from(port));
        req.backend = "hive".into();
        req.switchable = true;
        req.model = String::new();
        req.library = Some(
            library
                .iter()
                .map(|m| sdhive_protocol::LibraryModel {
                    filename: m.to_string(),
                    name: m.to_string(),
                    title: m.to_string(),
                    model_name: m.to_string(),
                    hash: None,
                    sha256: None,
                    format: "diffusers".into(),
                })
                .collect(),
        );
        req.node = Some(sdhive_protocol::NodeSummary {
            slots,
            loaded: loaded.iter().map(|m| m.to_string()).collect(),
            devices: Vec::new(),
            workers: 1,
            workers_ready: 1,
        });
        req
    }

    #[test]
    fn node_hives_take_requests_up_to_their_slots_and_models_only_where_their_library_has_them() {
        let hive = Hive::new(HiveConfig::default(), "t".into(), "http://gw".into()).unwrap();
        let mut state = hive.lock();
        let now = Instant::now();
        state.register(node("n1", 1, 3, &["sd1", "sdxl"], &["sd1"]), now).unwrap();
        state.register(node("n2", 2, 2, &["sd1"], &["sd1"]), now).unwrap();
        assert!(state.workers["n1"].is_hive() && state.workers["n1"].loaded.is_none());
        let pass = Pass::new(&hive, &state, now);
        // sdxl: only n1 has it, and n1 takes it although its workers hold sd1 (it switches its own workers).
        assert_eq!(choose(&hive, &state, Some("sdxl"), None, false, &pass, now).as_deref(), Some("n1"));
        let sdxl = take_slot(&hive, &mut state, "n1", Some("sdxl"), now).unwrap();
        assert!(state.workers["n1"].holds("sdxl"), "until its heartbeat says otherwise");
        assert_eq!(state.metrics.model_switches, 0, "a node's switches are its own business");
        // sd1 goes to the least loaded node holding it; each node up to its slots, then the request waits.
        let mut on = Vec::new();
        for _ in 0..4 {
            let pass = Pass::new(&hive, &state, now);
            let w = choose(&hive, &state, Some("sd1"), None, false, &pass, now).unwrap();
            take_slot(&hive, &mut state, &w, Some("sd1"), now).unwrap();
            on.push(w);
        }
        on.sort();
        assert_eq!(on, ["n1", "n1", "n2", "n2"]);
        let pass = Pass::new(&hive, &state, now);
        assert_eq!(choose(&hive, &state, Some("sd1"), None, false, &pass, now), None, "every slot taken");
        // A model no node has is placed nowhere; a node whose heartbeat reports no ready worker gets nothing.
        release(&mut state, "n1", sdxl.epoch);
        let pass = Pass::new(&hive, &state, now);
        assert_eq!(choose(&hive, &state, Some("sd2"), None, false, &pass, now), None);
        assert_eq!(choose(&hive, &state, Some("sdxl"), None, false, &pass, now).as_deref(), Some("n1"));
        state.workers.get_mut("n1").unwrap().node.as_mut().unwrap().slots = 0;
        assert_eq!(choose(&hive, &state, Some("sdxl"), None, false, &pass, now), None);
    }

    #[test]
    fn a_silent_node_hive_loses_its_jobs_to_the_other_node_within_three_intervals() {
        let hive = Hive::new(HiveConfig::default(), "t".into(), "http://gw".into()).unwrap();
        let mut state = hive.lock();
        let t0 = Instant::now();
        state.register(node("n1", 1, 2, &["sd1"], &["sd1"]), t0).unwrap();
        state.register(node("n2", 2, 2, &["sd1"], &["sd1"]), t0).unwrap();
        let on_n1 = Phase::OnWorker { worker: "n1".into(), epoch: 0, worker_job: "j".into(), started: true };
        state.jobs.insert("a".into(), job("a", on_n1, 1.0));
        state.workers.get_mut("n1").unwrap().inflight = 1;
        let i = hive.config.heartbeat_interval();
        // n2 keeps heartbeating (a registration counts as seen); n1 falls silent.
        state.workers.get_mut("n2").unwrap().last_seen = Some(t0 + i * 5 / 2);
        assert!(state.sweep(t0 + i * 5 / 2, i).is_empty(), "two missed heartbeats are not yet silence");
        let ended = state.sweep(t0 + i * 5 / 2 + Duration::from_millis(10), i);
        assert_eq!(ended, vec![("n1".to_string(), 0)]);
        let starts = worker_lost(&hive, &mut state, "n1", 0, "stopped heartbeating");
        assert_eq!(starts.len(), 1);
        assert_eq!((starts[0].0.as_str(), starts[0].1.worker.as_str()), ("a", "n2"));
        assert_eq!(state.jobs["a"].reruns, 1);
    }
}
