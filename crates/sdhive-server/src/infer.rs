//! The engine thread: the only owner of the loaded model. It takes one job at a time from the queue, switches to
//! the job's model first when another is loaded (a switch that fails fails the job and leaves the previous model
//! serving), runs it with a progress callback that records steps and answers cancellation, encodes the images,
//! and turns every failure — engine errors and engine panics alike — into a failed job, so the worker keeps
//! serving.

use crate::jobs::{FinishedImage, JobManager, Next, Outcome, Shared, StartedJob, Work};
use bytes::Bytes;
use sdhive_engine::{
    encode_png, Control, Engine, EngineError, GenerateOutput, GenerateRequest, GeneratedImage, HiresUpscaler,
    ModelHost, ModelSpec, Progress, RgbImage, UpscaleRequest,
};
use sdhive_protocol::JobId;
use sdhive_protocol::{JobError, JobErrorKind};
use sdhive_upscale::a1111;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Weak;
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

/// Serves jobs until told to stop or until nothing can submit any more (every manager handle dropped); the
/// engine, and with it the model's memory, is freed when this returns.
fn run(weak: Weak<Shared>, mut host: ModelHost) {
    let _alive = AliveGuard(weak.clone());
    while let Some(jobs) = JobManager::upgrade(&weak) {
        match jobs.next_job() {
            Next::Job(job) => {
                let StartedJob { id, work, cancel } = *job;
                let outcome = match work {
                    Work::Generate { request, model } => match switch(&jobs, &mut host, &id, &model) {
                        Err(failure) => failure,
                        Ok(()) => match host.engine() {
                            Some(engine) => {
                                let native = engine.info();
                                jobs.set_size(
                                    &id,
                                    request.output_size((native.native_width, native.native_height)),
                                );
                                run_one(&jobs, engine, &id, &request, &cancel)
                            }
                            None => model_failure("no model is loaded".into()),
                        },
                    },
                    Work::Load(model) => switch(&jobs, &mut host, &id, &model)
                        .map_or_else(|f| f, |()| Outcome::Succeeded(vec![])),
                    Work::Upscale(request) => match host.engine() {
                        Some(engine) => upscale(engine, &request),
                        // Resampling needs no model; upscaler models run on the loaded engine's device.
                        None => upscale_without_engine(&request),
                    },
                    Work::Unload => {
                        host.unload_model();
                        jobs.library().record_unloaded();
                        tracing::info!("model unloaded");
                        Outcome::Succeeded(vec![])
                    }
                };
                jobs.finish(&id, outcome);
            }
            Next::Idle => {}
            Next::Stop => break,
        }
    }
}

/// A job that could not run because its model could not be loaded: the model is what the client asked for, so
/// the failure is reported against the request's `model` field.
fn model_failure(message: String) -> Outcome {
    Outcome::Failed(JobError { kind: JobErrorKind::InvalidRequest, message, param: Some("model".into()) })
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
        Ok(Err(e)) => Err(model_failure(e.to_string())),
        Err(payload) => {
            let message = panic_message(payload.as_ref());
            tracing::error!(model = %title, "loading panicked: {message}");
            Err(model_failure(format!("cannot load model `{title}`: the loader panicked: {message}")))
        }
    }
}

fn run_one(
    jobs: &JobManager,
    engine: &mut dyn Engine,
    id: &JobId,
    request: &GenerateRequest,
    cancel: &std::sync::atomic::AtomicBool,
) -> Outcome {
    tracing::info!(job = %id, steps = request.steps, n = request.n, "job started");
    let mut on_progress = |p: &Progress| {
        jobs.on_progress(id, p);
        if cancel.load(Ordering::SeqCst) {
            Control::Cancel
        } else {
            Control::Continue
        }
    };
    let result = catch_unwind(AssertUnwindSafe(|| engine.generate(request, &mut on_progress)));
    let outcome = match result {
        Ok(Ok(output)) => encode_all(output),
        // The images finished before the stop are kept: A1111's interrupted requests answer with them.
        Ok(Err(EngineError::Cancelled { done })) => match encode_images(done) {
            Ok(images) => Outcome::Cancelled(images),
            Err(e) => {
                tracing::warn!(job = %id, "the images finished before the cancel are lost: {}", e.message);
                Outcome::Cancelled(Vec::new())
            }
        },
        Ok(Err(EngineError::Invalid(v))) => Outcome::Failed(JobError {
            kind: JobErrorKind::InvalidRequest,
            message: v.to_string(),
            param: Some(v.field.to_string()),
        }),
        // The plan refused the job: the request (its size) is what does not fit, so it is the client's to change.
        Ok(Err(EngineError::InsufficientMemory(m))) => Outcome::Failed(JobError {
            kind: JobErrorKind::InvalidRequest,
            message: m.to_string(),
            param: Some("width".into()),
        }),
        Ok(Err(EngineError::OutOfMemory(m))) => {
            Outcome::Failed(JobError { kind: JobErrorKind::OutOfMemory, message: m, param: None })
        }
        Ok(Err(e)) => {
            Outcome::Failed(JobError { kind: JobErrorKind::EngineError, message: e.to_string(), param: None })
        }
        Err(payload) => {
            let message = panic_message(payload.as_ref());
            tracing::error!(job = %id, "engine panicked: {message}");
            Outcome::Failed(JobError {
                kind: JobErrorKind::EnginePanic,
                message: format!("the engine panicked: {message}"),
                param: None,
            })
        }
    };
    match &outcome {
        Outcome::Succeeded(_) => tracing::info!(job = %id, "job succeeded"),
        Outcome::Failed(e) => {
            tracing::warn!(job = %id, kind = e.kind.as_str(), "job failed: {}", e.message)
        }
        Outcome::Cancelled(done) => tracing::info!(job = %id, finished = done.len(), "job cancelled"),
    }
    outcome
}

/// An extras job on the engine: its images as PNGs (no parameters chunk: A1111's extras write none of their own).
fn upscale(engine: &mut dyn Engine, request: &UpscaleRequest) -> Outcome {
    let result = catch_unwind(AssertUnwindSafe(|| engine.upscale(request)));
    match result {
        Ok(Ok(images)) => encode_upscaled(images),
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
        Err(payload) => Outcome::Failed(JobError {
            kind: JobErrorKind::EnginePanic,
            message: format!("the engine panicked: {}", panic_message(payload.as_ref())),
            param: None,
        }),
    }
}

/// Extras with no model loaded: the resampling upscalers, computed here; upscaler models need an engine.
fn upscale_without_engine(request: &UpscaleRequest) -> Outcome {
    let model = |u: &HiresUpscaler| matches!(u, HiresUpscaler::Model { .. } | HiresUpscaler::Latent(_));
    if model(&request.upscaler) || request.second.as_ref().is_some_and(|(u, _)| model(u)) {
        return Outcome::Failed(JobError {
            kind: JobErrorKind::InvalidRequest,
            message: "upscaler models run on the loaded checkpoint's device, and no checkpoint is loaded"
                .into(),
            param: Some("upscaler_1".into()),
        });
    }
    let passes = a1111::extras(request, |upscaler, scale, img| match a1111::builtin_for(upscaler, scale) {
        Some(mut builtin) => builtin(img).map_err(|e| e.to_string()),
        None => Err(format!("`{}` needs an engine", upscaler.name())),
    });
    let out = match passes {
        Ok(images) => images,
        Err(message) => {
            return Outcome::Failed(JobError {
                kind: JobErrorKind::InvalidRequest,
                message,
                param: Some("upscaling_resize".into()),
            })
        }
    };
    encode_upscaled(out)
}

fn encode_upscaled(images: Vec<RgbImage>) -> Outcome {
    let generated =
        images.into_iter().map(|image| GeneratedImage { image, seed: 0, infotext: String::new() }).collect();
    match encode_images(generated) {
        Ok(images) => Outcome::Succeeded(images),
        Err(e) => Outcome::Failed(e),
    }
}

fn encode_all(output: GenerateOutput) -> Outcome {
    match encode_images(output.images) {
        Ok(images) => Outcome::Succeeded(images),
        Err(e) => Outcome::Failed(e),
    }
}

fn encode_images(generated: Vec<GeneratedImage>) -> Result<Vec<FinishedImage>, JobError> {
    let mut images = Vec::with_capacity(generated.len());
    for generated in generated {
        let png = encode_png(&generated.image, Some(generated.infotext.as_str()).filter(|t| !t.is_empty()))
            .map_err(|e| JobError {
            kind: JobErrorKind::EngineError,
            message: format!("cannot encode the image: {e}"),
            param: None,
        })?;
        images.push(FinishedImage {
            png: Bytes::from(png),
            seed: generated.seed,
            infotext: generated.infotext,
            width: generated.image.width,
            height: generated.image.height,
        });
    }
    Ok(images)
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
