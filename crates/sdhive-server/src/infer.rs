//! The engine thread: the only owner of the loaded model. It takes the next job — or a batch of compatible queued
//! generations, up to `--max-batch` images, which later compatible jobs join between steps — from the queue,
//! switches to the job's model first when another is loaded (a switch that fails fails the job and leaves the
//! previous model serving), runs it with a progress callback that records steps and answers cancellation per job,
//! hands each job's images to the encoding stage as soon as they are done and moves on; every failure — engine
//! errors and engine panics alike — becomes a failed job, so the worker keeps serving.

use crate::encoder::{self, Encoder, Ended};
use crate::jobs::{JobManager, Next, Outcome, Shared, StartedJob, Work};
use sdhive_engine::{
    BatchFeed, Control, Engine, EngineError, GenerateOutput, GenerateRequest, HiresUpscaler, ModelHost,
    ModelSpec, OutputFormat, Progress, UpscaleRequest,
};
use sdhive_protocol::JobId;
use sdhive_protocol::{JobError, JobErrorKind};
use sdhive_upscale::a1111;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;

pub(crate) fn spawn(jobs: Weak<Shared>, host: ModelHost) -> JoinHandle<()> {
    let spawned = std::thread::Builder::new().name("sdhive-engine".into()).spawn({
        let jobs = jobs.clone();
        move || run(jobs, host)
    });
    match spawned {
        Ok(handle) => handle,
        Err(e) => {
            // Without a thread there is no engine: report not-ready instead of failing every request later.
            tracing::error!("cannot start the engine thread: {e}");
            if let Some(jobs) = JobManager::upgrade(&jobs) {
                jobs.mark_engine_dead();
            }
            std::thread::spawn(|| {})
        }
    }
}

/// Marks the engine dead if the thread unwinds through our own code (engine panics are caught earlier).
struct AliveGuard(Weak<Shared>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        if let Some(jobs) = JobManager::upgrade(&self.0) {
            jobs.mark_engine_dead();
        }
    }
}

/// Threads encoding finished images: enough to keep up with a GPU making several images a second, while leaving
/// cores to the HTTP side.
fn encoder_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 4).clamp(1, 4))
}

/// Serves jobs until told to stop or until nothing can submit any more (every manager handle dropped); the
/// engine, and with it the model's memory, is freed when this returns, after the last images are encoded.
fn run(weak: Weak<Shared>, mut host: ModelHost) {
    let _alive = AliveGuard(weak.clone());
    if let Some(jobs) = JobManager::upgrade(&weak) {
        warm_up(&jobs, &mut host);
        jobs.mark_warm();
    }
    let encoder = Encoder::start(weak.clone(), encoder_threads());
    while let Some(jobs) = JobManager::upgrade(&weak) {
        let max_images = batch_images(&jobs, &mut host);
        match jobs.next_jobs(max_images) {
            Next::Jobs(started) => run_jobs(&jobs, &mut host, &encoder, started, max_images),
            Next::Idle => {}
            Next::Stop => break,
        }
    }
}

/// Where batching is on, runs a batch of every size up to `--max-batch` on the loaded model before the first job
/// ([`Engine::warm_up`]), on this thread: the kernel plans and product tuning it pays for are kept per thread, and
/// so are the CUDA graphs it records. A model switched to later is not warmed.
fn warm_up(jobs: &JobManager, host: &mut ModelHost) {
    let max_batch = jobs.config().max_batch;
    if max_batch > 1 {
        if let Some(engine) = host.engine() {
            let warm = catch_unwind(AssertUnwindSafe(|| engine.warm_up(max_batch)));
            if let Err(payload) = warm {
                tracing::error!("warming the batch sizes up panicked: {}", panic_message(payload.as_ref()));
            }
        }
    }
}

/// The most images one denoising step may take together: the operator's `--max-batch`, within what the loaded
/// engine batches (an engine that has not loaded yet is asked when it runs).
fn batch_images(jobs: &JobManager, host: &mut ModelHost) -> u32 {
    let configured = jobs.config().max_batch.max(1);
    match host.engine() {
        Some(engine) => configured.min(engine.max_batch().max(1)),
        None => configured,
    }
}

fn run_jobs(
    jobs: &JobManager,
    host: &mut ModelHost,
    encoder: &Encoder,
    started: Vec<StartedJob>,
    max_images: u32,
) {
    // A generation that can share a batch starts one that later jobs may join.
    let batches =
        |j: &StartedJob| matches!(&j.work, Work::Generate { request, .. } if request.batch_key().is_some());
    if max_images > 1 && started.iter().all(batches) {
        return run_batch(jobs, host, encoder, started, max_images);
    }
    for job in started {
        let StartedJob { id, work, cancel } = job;
        let ended = match work {
            Work::Generate { request, model } => match switch(jobs, host, &id, &model) {
                Err(failure) => Ended::Final(failure),
                Ok(()) => match host.engine() {
                    Some(engine) => {
                        let native = engine.info();
                        jobs.set_size(&id, request.output_size((native.native_width, native.native_height)));
                        run_one(jobs, encoder, engine, &id, &request, &cancel)
                    }
                    None => Ended::Final(model_failure("no model is loaded".into())),
                },
            },
            Work::Load(model) => Ended::Final(
                switch(jobs, host, &id, &model).map_or_else(|f| f, |()| Outcome::Succeeded(vec![])),
            ),
            Work::Upscale(request) => match host.engine() {
                Some(engine) => upscale(engine, &request),
                // Resampling needs no model; upscaler models run on the loaded engine's device.
                None => upscale_without_engine(&request),
            },
            Work::Unload => {
                host.unload_model();
                jobs.library().record_unloaded();
                tracing::info!("model unloaded");
                Ended::Final(Outcome::Succeeded(vec![]))
            }
        };
        encoder.finish(id, ended);
    }
}

/// Generations of one model and batch key, denoised as one batch that queued jobs of the same model and key join
/// between steps; each job keeps its own progress, cancellation and outcome, and leaves for encoding as soon as its
/// images are done.
fn run_batch(
    jobs: &JobManager,
    host: &mut ModelHost,
    encoder: &Encoder,
    started: Vec<StartedJob>,
    max_images: u32,
) {
    let Some((key, model)) = started.iter().find_map(|j| match &j.work {
        Work::Generate { request, model } => request.batch_key().map(|k| (k, model.clone())),
        _ => None,
    }) else {
        return;
    };
    let fail_all = |outcome: Outcome| {
        for job in &started {
            encoder.finish(job.id.clone(), Ended::Final(outcome.clone()));
        }
    };
    if let Err(failure) = switch(jobs, host, &started[0].id, &model) {
        return fail_all(failure);
    }
    let Some(engine) = host.engine() else { return fail_all(model_failure("no model is loaded".into())) };
    let info = engine.info();
    let native = (info.native_width, info.native_height);
    let max_images = max_images.min(engine.max_batch().max(1));
    let mut feed = QueueFeed { jobs, encoder, key, model, native, running: Vec::new(), next_token: 0 };
    let first = feed.take(started);
    tracing::info!(jobs = first.len(), steps = first.first().map_or(0, |(_, r)| r.steps), "batch started");
    let result = catch_unwind(AssertUnwindSafe(|| engine.generate_joined(first, max_images, &mut feed)));
    let outcome = match result {
        Ok(()) => no_result("the engine returned no result for the job"),
        Err(payload) => {
            let message = panic_message(payload.as_ref());
            tracing::error!(jobs = feed.running.len(), "engine panicked in a batch: {message}");
            engine_panic(&message)
        }
    };
    for (_, id, _, _) in std::mem::take(&mut feed.running) {
        encoder.finish(id, Ended::Final(outcome.clone()));
    }
}

/// The queue as a running batch sees it: jobs join from the front of the queue, and each job's reports and end
/// go where a job run alone sends them.
struct QueueFeed<'a> {
    jobs: &'a JobManager,
    encoder: &'a Encoder,
    key: sdhive_engine::BatchKey,
    model: ModelSpec,
    /// The loaded model's native size (a request without a size gets it).
    native: (u32, u32),
    /// Jobs in the batch: token, id, cancel flag, output format.
    running: Vec<(usize, JobId, Arc<AtomicBool>, OutputFormat)>,
    next_token: usize,
}

impl QueueFeed<'_> {
    /// Registers started generations with tokens of their own.
    fn take(&mut self, started: Vec<StartedJob>) -> Vec<(usize, GenerateRequest)> {
        let mut out = Vec::with_capacity(started.len());
        for StartedJob { id, work, cancel } in started {
            let Work::Generate { request, .. } = work else { continue };
            self.jobs.set_size(&id, request.output_size(self.native));
            let token = self.next_token;
            self.next_token += 1;
            self.running.push((token, id, cancel, request.output));
            out.push((token, *request));
        }
        out
    }

    fn job(&self, token: usize) -> Option<&(usize, JobId, Arc<AtomicBool>, OutputFormat)> {
        self.running.iter().find(|(t, ..)| *t == token)
    }
}

impl BatchFeed for QueueFeed<'_> {
    fn join(&mut self, images: u32) -> Vec<(usize, GenerateRequest)> {
        let joined = self.jobs.join_jobs(&self.key, &self.model, images);
        if !joined.is_empty() {
            tracing::info!(jobs = joined.len(), "joined a running batch");
        }
        self.take(joined)
    }

    fn progress(&mut self, token: usize, p: &Progress) -> Control {
        match self.job(token) {
            Some((_, id, cancel, _)) => report(self.jobs, self.encoder, id, cancel, p),
            None => Control::Cancel,
        }
    }

    fn finished(&mut self, token: usize, result: Result<GenerateOutput, EngineError>) {
        let Some(at) = self.running.iter().position(|(t, ..)| *t == token) else { return };
        let (_, id, _, output) = self.running.remove(at);
        let ended = ended(&id, result, output);
        self.encoder.finish(id, ended);
    }

    fn denoised(&mut self, images: u32) {
        self.jobs.metrics().observe_batch(images);
    }
}

/// A job the engine never reported back.
fn no_result(message: &str) -> Outcome {
    Outcome::Failed(JobError { kind: JobErrorKind::EngineError, message: message.into(), param: None })
}

/// A job that could not run because its model could not be loaded: the model is what the client asked for, so
/// the failure is reported against the request's `model` field.
fn model_failure(message: String) -> Outcome {
    failure_of("model", message)
}

/// A failed switch to `model`, reported against the request's `vae` field when the message names the standalone
/// VAE chosen with it (the engines name the file that failed: a VAE of another family), else against `model`.
fn switch_failure(model: &ModelSpec, message: String) -> Outcome {
    let vae_failed = model.vae.as_ref().is_some_and(|vae| message.contains(&*vae.to_string_lossy()));
    failure_of(if vae_failed { "vae" } else { "model" }, message)
}

fn failure_of(param: &str, message: String) -> Outcome {
    Outcome::Failed(JobError { kind: JobErrorKind::InvalidRequest, message, param: Some(param.into()) })
}

/// Makes `model` the loaded one, recording the outcome in the library. Engine panics during a load are caught
/// like generation panics.
fn switch(jobs: &JobManager, host: &mut ModelHost, id: &JobId, model: &ModelSpec) -> Result<(), Outcome> {
    if host.current_model() == Some(model) {
        return Ok(());
    }
    let library = jobs.library();
    let title = library.title_of(model);
    jobs.set_activity(id, Some(format!("loading model {title}")));
    tracing::info!(job = %id, model = %title, vae = ?model.vae, "switching model");
    let started = std::time::Instant::now();
    let result = catch_unwind(AssertUnwindSafe(|| host.load_model(model)));
    jobs.set_activity(id, None);
    match (host.current_model().cloned(), host.info()) {
        (Some(spec), Some(info)) => library.record_loaded(&spec, &info),
        _ => library.record_unloaded(),
    }
    match result {
        Ok(Ok(())) => {
            tracing::info!(model = %title, seconds = started.elapsed().as_secs_f64(), "model loaded");
            library.hash_in_background(model);
            Ok(())
        }
        Ok(Err(e)) => Err(switch_failure(model, e.to_string())),
        Err(payload) => {
            let message = panic_message(payload.as_ref());
            tracing::error!(model = %title, "loading panicked: {message}");
            Err(model_failure(format!("cannot load model `{title}`: the loader panicked: {message}")))
        }
    }
}

/// A step's report: progress now, the preview (if any) to the encoding threads; the answer is the job's cancel
/// flag.
fn report(jobs: &JobManager, encoder: &Encoder, id: &JobId, cancel: &AtomicBool, p: &Progress) -> Control {
    jobs.on_progress(id, p);
    if let Some(preview) = &p.preview {
        jobs.metrics().preview_sent();
        encoder.preview(id.clone(), p.step, p.image, preview.clone());
    }
    if cancel.load(Ordering::SeqCst) {
        Control::Cancel
    } else {
        Control::Continue
    }
}

fn engine_panic(message: &str) -> Outcome {
    Outcome::Failed(JobError {
        kind: JobErrorKind::EnginePanic,
        message: format!("the engine panicked: {message}"),
        param: None,
    })
}

fn run_one(
    jobs: &JobManager,
    encoder: &Encoder,
    engine: &mut dyn Engine,
    id: &JobId,
    request: &GenerateRequest,
    cancel: &AtomicBool,
) -> Ended {
    tracing::info!(job = %id, steps = request.steps, n = request.n, "job started");
    let mut on_progress = |p: &Progress| {
        jobs.metrics().observe_batch(1);
        report(jobs, encoder, id, cancel, p)
    };
    let result = catch_unwind(AssertUnwindSafe(|| engine.generate(request, &mut on_progress)));
    match result {
        Ok(result) => ended(id, result, request.output),
        Err(payload) => {
            let message = panic_message(payload.as_ref());
            tracing::error!(job = %id, "engine panicked: {message}");
            Ended::Final(engine_panic(&message))
        }
    }
}

/// A generation's engine result as the job's end: images to encode, or the failure as the API reports it.
fn ended(id: &JobId, result: Result<GenerateOutput, EngineError>, output: OutputFormat) -> Ended {
    let ended = match result {
        Ok(done) => Ended::Succeeded(done.images, output),
        // The images finished before the stop are kept: A1111's interrupted requests answer with them.
        Err(EngineError::Cancelled { done }) => Ended::Cancelled(done, output),
        Err(EngineError::Invalid(v)) => Ended::Final(Outcome::Failed(JobError {
            kind: JobErrorKind::InvalidRequest,
            message: v.to_string(),
            param: Some(v.field.to_string()),
        })),
        // The plan refused the job: the request (its size) is what does not fit, so it is the client's to change.
        Err(EngineError::InsufficientMemory(m)) => Ended::Final(Outcome::Failed(JobError {
            kind: JobErrorKind::InvalidRequest,
            message: m.to_string(),
            param: Some("width".into()),
        })),
        Err(EngineError::OutOfMemory(m)) => Ended::Final(Outcome::Failed(JobError {
            kind: JobErrorKind::OutOfMemory,
            message: m,
            param: None,
        })),
        Err(e) => Ended::Final(Outcome::Failed(JobError {
            kind: JobErrorKind::EngineError,
            message: e.to_string(),
            param: None,
        })),
    };
    match &ended {
        Ended::Succeeded(images, _) => tracing::info!(job = %id, images = images.len(), "job succeeded"),
        Ended::Final(Outcome::Failed(e)) => {
            tracing::warn!(job = %id, kind = e.kind.as_str(), "job failed: {}", e.message)
        }
        Ended::Cancelled(done, _) => tracing::info!(job = %id, finished = done.len(), "job cancelled"),
        Ended::Final(_) => {}
    }
    ended
}

/// An extras job on the engine: its images in the request's format (no infotext: A1111's extras write none).
fn upscale(engine: &mut dyn Engine, request: &UpscaleRequest) -> Ended {
    let result = catch_unwind(AssertUnwindSafe(|| engine.upscale(request)));
    let failure = match result {
        Ok(Ok(images)) => return encoder::upscaled(images, request.output),
        Ok(Err(EngineError::Invalid(v))) => Outcome::Failed(JobError {
            kind: JobErrorKind::InvalidRequest,
            message: v.to_string(),
            param: Some(v.field.to_string()),
        }),
        Ok(Err(EngineError::OutOfMemory(m))) => {
            Outcome::Failed(JobError { kind: JobErrorKind::OutOfMemory, message: m, param: None })
        }
        Ok(Err(e)) => {
            Outcome::Failed(JobError { kind: JobErrorKind::EngineError, message: e.to_string(), param: None })
        }
        Err(payload) => engine_panic(&panic_message(payload.as_ref())),
    };
    Ended::Final(failure)
}

/// Extras with no model loaded: the resampling upscalers, computed here; upscaler models need an engine.
fn upscale_without_engine(request: &UpscaleRequest) -> Ended {
    let model = |u: &HiresUpscaler| matches!(u, HiresUpscaler::Model { .. } | HiresUpscaler::Latent(_));
    if model(&request.upscaler) || request.second.as_ref().is_some_and(|(u, _)| model(u)) {
        return Ended::Final(Outcome::Failed(JobError {
            kind: JobErrorKind::InvalidRequest,
            message: "upscaler models run on the loaded checkpoint's device, and no checkpoint is loaded"
                .into(),
            param: Some("upscaler_1".into()),
        }));
    }
    let passes = a1111::extras(request, |upscaler, scale, img| match a1111::builtin_for(upscaler, scale) {
        Some(mut builtin) => builtin(img).map_err(|e| e.to_string()),
        None => Err(format!("`{}` needs an engine", upscaler.name())),
    });
    let out = match passes {
        Ok(images) => images,
        Err(message) => {
            return Ended::Final(Outcome::Failed(JobError {
                kind: JobErrorKind::InvalidRequest,
                message,
                param: Some("upscaling_resize".into()),
            }))
        }
    };
    encoder::upscaled(out, request.output)
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".into()
    }
}
