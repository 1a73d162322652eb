//! Which requests can be denoised together: the [`BatchKey`] of a request names everything that shapes the UNet's
//! calls (size, steps, sampler, schedule, whether CFG runs, the LoRA weights merged into the network), so requests
//! with equal keys differ only in what each batch row carries on its own (prompt, negative prompt, seed, CFG scale,
//! clip skip, embeddings). An engine that batches runs such requests as one batch and each image equals the image
//! its request gets alone. A [`BatchFeed`] is how a running batch meets the queue: newcomers join it between
//! steps and each request's result leaves as soon as it is done ([`crate::Engine::generate_joined`]). A GPU
//! engine runs a batch of every size once before serving ([`warm_batches`]).

use crate::engine::{Control, Engine, EngineError, GenerateOutput, Progress};
use crate::request::{GenerateRequest, LoraUse};
use crate::sampler::{Sampler, Schedule};

/// Requests with equal keys may share a batch. Requests that start from an image, inpaint, run a hires pass or
/// skip-layer guidance have no key: they run alone.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchKey {
    width: Option<u32>,
    height: Option<u32>,
    steps: u32,
    sampler: Sampler,
    schedule: Schedule,
    guided: bool,
    /// Compared by value, multipliers included: the UNet's weights are the merged sum.
    loras: Vec<LoraUse>,
}

impl GenerateRequest {
    /// This request's batch key, if it can join a batch (see [`BatchKey`]).
    pub fn batch_key(&self) -> Option<BatchKey> {
        if self.init_image.is_some()
            || self.mask.is_some()
            || self.hires.is_some()
            || self.skip_layer_guidance.is_some()
        {
            return None;
        }
        Some(BatchKey {
            width: self.width,
            height: self.height,
            steps: self.steps,
            sampler: self.sampler,
            schedule: self.schedule,
            // diffusers (and the engines) run the negative prompt only when guiding.
            guided: self.cfg_scale > 1.0,
            loras: self.loras.clone(),
        })
    }
}

/// A running batch's link to whoever queued its requests, each known by the caller's token.
pub trait BatchFeed {
    /// Requests that join the batch now, together at most `images` images: queued requests of the batch's model
    /// and [`BatchKey`], taken in queue order up to the first that is not (so nothing queued is overtaken for
    /// long). Empty when none may join.
    fn join(&mut self, images: u32) -> Vec<(usize, GenerateRequest)>;

    /// Request `token`'s step report; `Control::Cancel` ends only that request.
    fn progress(&mut self, token: usize, progress: &Progress) -> Control;

    /// Request `token` is done: its images, or why it ended (a cancel carries the images it finished).
    fn finished(&mut self, token: usize, result: Result<GenerateOutput, EngineError>);

    /// One denoising step ran on `images` images together.
    fn denoised(&mut self, images: u32) {
        let _ = images;
    }
}

/// Steps each warm-up generation runs: the second call of a shape is where a GPU engine records its CUDA graph.
pub const WARM_STEPS: u32 = 2;

/// [`Engine::warm_up`] for batching engines: a guided generation of [`WARM_STEPS`] steps at the native size as
/// one batch of 1, 2, … up to `max_images` requests (within [`Engine::max_batch`]), so that every batch size a
/// worker's load can form has run once. Returns the batch sizes that ran, and logs them with the time taken; a
/// failure ends the warm-up there (it is logged, and serving goes on: the first real batch of that size pays
/// instead).
pub fn warm_batches(engine: &mut (impl Engine + ?Sized), max_images: u32) -> u32 {
    let started = std::time::Instant::now();
    let most = max_images.min(engine.max_batch()).max(1);
    let req = GenerateRequest { steps: WARM_STEPS, seed: Some(0), ..GenerateRequest::default() };
    let mut sizes = 0;
    for k in 1..=most {
        let reqs = vec![&req; k as usize];
        let failed =
            run_batch(engine, &reqs, k, &mut |_, _| Control::Continue).into_iter().find_map(Result::err);
        if let Some(e) = failed {
            tracing::warn!("warm-up at {k} images failed, the first such batch pays instead: {e}");
            break;
        }
        sizes = k;
    }
    tracing::info!(sizes, seconds = started.elapsed().as_secs_f64(), "warmed the batch sizes up");
    sizes
}

/// Runs `reqs` as one batch on `engine` through [`Engine::generate_joined`] with nobody joining, and returns one
/// result per request, in order (what [`Engine::generate_batch`] returns).
pub fn run_batch(
    engine: &mut (impl Engine + ?Sized),
    reqs: &[&GenerateRequest],
    max_images: u32,
    progress: &mut dyn FnMut(usize, &Progress) -> Control,
) -> Vec<Result<GenerateOutput, EngineError>> {
    struct Collect<'a> {
        progress: &'a mut dyn FnMut(usize, &Progress) -> Control,
        results: Vec<Option<Result<GenerateOutput, EngineError>>>,
    }
    impl BatchFeed for Collect<'_> {
        fn join(&mut self, _: u32) -> Vec<(usize, GenerateRequest)> {
            Vec::new()
        }
        fn progress(&mut self, token: usize, p: &Progress) -> Control {
            (self.progress)(token, p)
        }
        fn finished(&mut self, token: usize, result: Result<GenerateOutput, EngineError>) {
            if let Some(slot) = self.results.get_mut(token) {
                *slot = Some(result);
            }
        }
    }
    let mut feed = Collect { progress, results: reqs.iter().map(|_| None).collect() };
    let first = reqs.iter().enumerate().map(|(i, r)| (i, (*r).clone())).collect();
    engine.generate_joined(first, max_images, &mut feed);
    feed.results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(EngineError::Failed("the engine returned no result".into()))))
        .collect()
}

/// [`Engine::generate_joined`] for engines without a batch that takes newcomers: batches of the requests there
/// are, one after another, each through [`Engine::generate_batch`], a batch's results handed on when it ends.
pub fn joined_one_batch_at_a_time(
    engine: &mut (impl Engine + ?Sized),
    first: Vec<(usize, GenerateRequest)>,
    max_images: u32,
    feed: &mut dyn BatchFeed,
) {
    let mut batch = first;
    while !batch.is_empty() {
        let refs: Vec<&GenerateRequest> = batch.iter().map(|(_, r)| r).collect();
        let images = refs.iter().map(|r| r.n).sum::<u32>().min(max_images.max(1));
        // A step of the batch is counted once, on the reports of its first request still listening.
        let mut listening = vec![true; batch.len()];
        let results = engine.generate_batch(&refs, max_images, &mut |i, p| {
            if listening[..i].iter().all(|l| !l) {
                feed.denoised(images);
            }
            let answer = feed.progress(batch[i].0, p);
            if answer == Control::Cancel {
                listening[i] = false;
            }
            answer
        });
        for ((token, _), result) in batch.iter().zip(results) {
            feed.finished(*token, result);
        }
        batch = feed.join(max_images);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image_io::RgbImage;

    fn req() -> GenerateRequest {
        GenerateRequest { prompt: "a".into(), seed: Some(1), ..GenerateRequest::default() }
    }

    #[test]
    fn rows_may_differ_in_what_each_row_carries() {
        let other = GenerateRequest {
            prompt: "b".into(),
            negative_prompt: "c".into(),
            seed: Some(9),
            cfg_scale: 3.0,
            clip_skip: 2,
            n: 3,
            ..req()
        };
        assert_eq!(req().batch_key(), other.batch_key());
    }

    #[test]
    fn what_shapes_the_unet_calls_splits_batches() {
        let base = req().batch_key();
        let changed = [
            GenerateRequest { width: Some(640), ..req() },
            GenerateRequest { steps: 21, ..req() },
            GenerateRequest { sampler: Sampler::Ddim, ..req() },
            GenerateRequest { schedule: Schedule::Karras, ..req() },
            GenerateRequest { cfg_scale: 1.0, ..req() },
            GenerateRequest {
                loras: vec![LoraUse {
                    name: "l".into(),
                    path: "l.safetensors".into(),
                    te: 1.0,
                    unet: 0.5,
                    hash: None,
                }],
                ..req()
            },
        ];
        for r in changed {
            assert_ne!(r.batch_key(), base, "{r:?}");
        }
    }

    /// Records each batch it is given (sizes, steps, guidance, native size) and fails at `fail_at` images.
    struct Batches {
        seen: Vec<(usize, u32, bool, Option<u32>)>,
        most: u32,
        fail_at: usize,
    }

    impl Engine for Batches {
        fn info(&self) -> crate::EngineInfo {
            crate::EngineInfo::default()
        }
        fn generate(
            &mut self,
            _: &GenerateRequest,
            _: &mut dyn FnMut(&Progress) -> Control,
        ) -> Result<GenerateOutput, EngineError> {
            Ok(GenerateOutput { images: vec![] })
        }
        fn max_batch(&self) -> u32 {
            self.most
        }
        fn generate_joined(
            &mut self,
            first: Vec<(usize, GenerateRequest)>,
            max: u32,
            feed: &mut dyn BatchFeed,
        ) {
            let r = &first[0].1;
            self.seen.push((first.len(), r.steps, r.batch_key().is_some_and(|k| k.guided), r.width));
            assert_eq!(max as usize, first.len(), "one batch of every request");
            for (token, _) in first {
                let out = if self.seen.len() == self.fail_at {
                    Err(EngineError::Failed("oom".into()))
                } else {
                    Ok(GenerateOutput { images: vec![] })
                };
                feed.finished(token, out);
            }
        }
    }

    /// The warm-up runs one guided batch of every size up to the operator's limit, within the engine's, at the
    /// native size with two steps, and stops at the first size that fails.
    #[test]
    fn warm_up_runs_every_batch_size_once() {
        let mut e = Batches { seen: vec![], most: 16, fail_at: 0 };
        assert_eq!(warm_batches(&mut e, 4), 4);
        let want: Vec<_> = (1..=4).map(|k| (k, WARM_STEPS, true, None)).collect();
        assert_eq!(e.seen, want);
        let mut e = Batches { seen: vec![], most: 3, fail_at: 0 };
        assert_eq!(warm_batches(&mut e, 8), 3, "the engine's own limit");
        let mut e = Batches { seen: vec![], most: 8, fail_at: 3 };
        assert_eq!(warm_batches(&mut e, 8), 2, "stops where a size fails");
        assert_eq!(e.seen.len(), 3);
    }

    #[test]
    fn image_jobs_run_alone() {
        let img = RgbImage { width: 8, height: 8, data: vec![0; 192] };
        assert!(GenerateRequest { init_image: Some(img), ..req() }.batch_key().is_none());
        let slg = Some(crate::request::SkipLayerGuidance::with_layers(vec![7]));
        assert!(GenerateRequest { skip_layer_guidance: slg, ..req() }.batch_key().is_none());
    }
}
