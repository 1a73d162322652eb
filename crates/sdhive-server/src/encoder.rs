//! The encoding stage between the engine thread and a job's end: finished images are encoded (the format the
//! request asked for, with A1111's infotext) on threads of their own, so the engine starts the next job while the
//! last one's images are written. A job ends — `finish`ed, its waiters woken — once its images are encoded. Live
//! previews are encoded here too, so asking for them costs the denoising loop only the preview's small read-back.

use crate::jobs::{FinishedImage, JobManager, Outcome, Shared};
use bytes::Bytes;
use sdhive_engine::{encode_image, GeneratedImage, ImageError, OutputFormat, RgbImage};
use sdhive_protocol::{JobError, JobErrorKind, JobId};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Instant;

/// How a job ended on the engine, before its images are encoded.
pub(crate) enum Ended {
    /// The images, and how the request wants them encoded.
    Succeeded(Vec<GeneratedImage>, OutputFormat),
    /// Stopped by a cancel, with the images finished before it (A1111's interrupted requests answer with them).
    Cancelled(Vec<GeneratedImage>, OutputFormat),
    /// Ended without images to encode: a failure, or a model load.
    Final(Outcome),
}

enum Work {
    /// A job's end, handed over by the engine thread at that instant.
    End(JobId, Ended, Instant),
    Preview {
        id: JobId,
        step: u32,
        image: u32,
        preview: RgbImage,
    },
}

/// The encoding threads and the channel that feeds them. Dropping it waits for every job handed over to end.
pub(crate) struct Encoder {
    jobs: Weak<Shared>,
    tx: Option<Sender<Work>>,
    threads: Vec<JoinHandle<()>>,
}

impl Encoder {
    /// Starts up to `threads` encoding threads; with none (the OS refused them all) jobs are encoded on the caller.
    pub(crate) fn start(jobs: Weak<Shared>, threads: usize) -> Encoder {
        let (tx, rx) = channel::<Work>();
        let rx = Arc::new(Mutex::new(rx));
        let handles: Vec<JoinHandle<()>> = (0..threads.max(1))
            .filter_map(|i| {
                let (jobs, rx) = (jobs.clone(), Arc::clone(&rx));
                std::thread::Builder::new()
                    .name(format!("sdhive-encode-{i}"))
                    .spawn(move || serve(&jobs, &rx))
                    .map_err(|e| tracing::warn!("cannot start an encoding thread: {e}"))
                    .ok()
            })
            .collect();
        let tx = (!handles.is_empty()).then_some(tx);
        Encoder { jobs, tx, threads: handles }
    }

    /// Ends job `id` once its images are encoded.
    pub(crate) fn finish(&self, id: JobId, ended: Ended) {
        self.send(Work::End(id, ended, Instant::now()));
    }

    /// Publishes a running job's preview once encoded.
    pub(crate) fn preview(&self, id: JobId, step: u32, image: u32, preview: RgbImage) {
        self.send(Work::Preview { id, step, image, preview });
    }

    fn send(&self, work: Work) {
        let unsent = match &self.tx {
            Some(tx) => tx.send(work).err().map(|e| e.0),
            None => Some(work),
        };
        if let (Some(work), Some(jobs)) = (unsent, JobManager::upgrade(&self.jobs)) {
            run(&jobs, work);
        }
    }
}

impl Drop for Encoder {
    fn drop(&mut self) {
        self.tx = None;
        for handle in self.threads.drain(..) {
            let _ = handle.join();
        }
    }
}

fn serve(jobs: &Weak<Shared>, rx: &Mutex<Receiver<Work>>) {
    loop {
        // The lock is held only while waiting for the next job, so the threads take turns receiving.
        let next = match rx.lock() {
            Ok(rx) => rx.recv(),
            Err(poisoned) => poisoned.into_inner().recv(),
        };
        let Ok(work) = next else { return };
        match JobManager::upgrade(jobs) {
            Some(jobs) => run(&jobs, work),
            None => return,
        }
    }
}

fn run(jobs: &JobManager, work: Work) {
    match work {
        Work::End(id, ended, handed) => jobs.finish(&id, encode(&id, ended), handed),
        Work::Preview { id, step, image, preview } => match sdhive_engine::encode_png(&preview, None) {
            Ok(png) => jobs.publish_preview(&id, step, image, Bytes::from(png)),
            Err(e) => tracing::debug!(job = %id, "cannot encode a preview: {e}"),
        },
    }
}

fn encode(id: &JobId, ended: Ended) -> Outcome {
    match ended {
        Ended::Succeeded(images, output) => match encode_images(images, output) {
            Ok(images) => Outcome::Succeeded(images),
            Err(e) => Outcome::Failed(e),
        },
        Ended::Cancelled(images, output) => match encode_images(images, output) {
            Ok(images) => Outcome::Cancelled(images),
            Err(e) => {
                tracing::warn!(job = %id, "the images finished before the cancel are lost: {}", e.message);
                Outcome::Cancelled(Vec::new())
            }
        },
        Ended::Final(outcome) => outcome,
    }
}

/// Extras results, in the format asked (A1111's `samples_format`), without infotext (A1111's extras write
/// none of their own).
pub(crate) fn upscaled(images: Vec<RgbImage>, output: OutputFormat) -> Ended {
    Ended::Succeeded(
        images.into_iter().map(|image| GeneratedImage { image, seed: 0, infotext: String::new() }).collect(),
        output,
    )
}

/// Encodes the images as `output` says. An infotext too long for the format fails the job as the client's error:
/// the same request asking for PNG or WebP succeeds.
fn encode_images(
    generated: Vec<GeneratedImage>,
    output: OutputFormat,
) -> Result<Vec<FinishedImage>, JobError> {
    let mut images = Vec::with_capacity(generated.len());
    for generated in generated {
        let infotext = Some(generated.infotext.as_str()).filter(|t| !t.is_empty());
        let bytes = encode_image(&generated.image, infotext, output).map_err(|e| match e {
            ImageError::InfotextTooLong { .. } => JobError {
                kind: JobErrorKind::InvalidRequest,
                message: e.to_string(),
                param: Some("output_format".into()),
            },
            e => JobError {
                kind: JobErrorKind::EngineError,
                message: format!("cannot encode the image: {e}"),
                param: None,
            },
        })?;
        images.push(FinishedImage {
            bytes: Bytes::from(bytes),
            output,
            seed: generated.seed,
            infotext: generated.infotext,
            width: generated.image.width,
            height: generated.image.height,
        });
    }
    Ok(images)
}
