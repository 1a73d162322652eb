//! SD1/SDXL batches that queued requests join between steps. Each image is a [`Lane`] with its own scheduler,
//! noise stream, latents and place in its schedule, so lanes at different steps share one UNet call, each sample
//! with its own time rows. A lane's image is decoded and its request handed back as soon as its schedule ends, and
//! newcomers from the [`BatchFeed`] start at the next step, so under load the UNet runs as many images as are
//! waiting without anyone waiting for a whole batch to end. What a step reads back (previews, finished images) is
//! taken once the next step is queued, so the device never waits on the host's reads. Requests of one batch share
//! the batch's size, steps, sampler, schedule, guidance and LoRAs (one [`sdhive_engine::BatchKey`]); prompts,
//! seeds and CFG scales are each request's own.

use super::batch::copy_error;
use super::ledger::{Ledger, Site};
use super::{encode, failed, lora_error, pipeline_error, CandleEngine};
use crate::pipeline::{schedule_timesteps, start_decode, step_lanes, ImageJob, Lane, UnetConditioning};
use crate::preview::PendingPreview;
use crate::tensor_image::PendingImage;
use candle_core::Tensor;
use sdhive_engine::extra_networks::strip_networks;
use sdhive_engine::{
    random_seed, BatchFeed, Control, Engine, EngineError, GenerateOutput, GenerateRequest, GeneratedImage,
    JobPlan, Progress, ValidationError,
};

/// A request in the batch.
struct Member {
    token: usize,
    req: GenerateRequest,
    seed: u64,
    cond: UnetConditioning,
    /// The time rows of its schedule, `(steps, 2 when guided else 1, ΣC)`.
    times: Tensor,
    /// Images whose lanes have started.
    started: u32,
    images: Vec<GeneratedImage>,
    /// A report whose preview is on its way, sent once the next step is queued.
    held: Option<(Progress, PendingPreview)>,
}

/// An image in flight: its request (by token), its index within the request, and its lane.
struct Running {
    token: usize,
    index: u32,
    lane: Lane,
}

/// What every request of the batch shares, fixed by the first one admitted.
struct Settings {
    size: (u32, u32),
    guided: bool,
    /// The most images in flight at once (the memory plan's batch).
    lanes: u32,
    plan: JobPlan,
    /// Steps, sampler, schedule and LoRAs (what every request's key must equal; size and guidance above).
    key: sdhive_engine::BatchKey,
}

/// A finished image whose bytes are on their way to the host.
struct Decoded {
    token: usize,
    index: u32,
    image: PendingImage,
}

struct Run {
    settings: Option<Settings>,
    members: Vec<Member>,
    running: Vec<Running>,
    /// Images decoded behind the last step, handed on once the next step is queued.
    decoded: Vec<Decoded>,
    /// SD1.x/2.x time rows depend on the timestep alone: made once, shared by every member.
    shared_times: Option<Tensor>,
    /// Stacked text contexts of a group of running images, kept while its images stay the same.
    contexts: Vec<(Vec<(usize, u32)>, Tensor)>,
}

impl Run {
    fn member(&self, token: usize) -> Option<&Member> {
        self.members.iter().find(|m| m.token == token)
    }

    /// Images that may start: the free lanes, less what admitted requests still have to start.
    fn room(&self) -> u32 {
        let Some(s) = &self.settings else { return 0 };
        let waiting: u32 = self.members.iter().map(|m| m.req.n - m.started).sum();
        s.lanes.saturating_sub(self.running.len() as u32 + waiting)
    }

    /// Ends request `token` with `result` (a cancel or failure keeps the images it finished), dropping its lanes.
    fn end(&mut self, token: usize, result: Result<(), EngineError>, feed: &mut dyn BatchFeed) {
        self.running.retain(|r| r.token != token);
        self.decoded.retain(|d| d.token != token);
        let Some(at) = self.members.iter().position(|m| m.token == token) else { return };
        let member = self.members.remove(at);
        let out = match result {
            Ok(()) => Ok(GenerateOutput { images: member.images }),
            Err(EngineError::Cancelled { .. }) => Err(EngineError::Cancelled { done: member.images }),
            Err(e) => Err(e),
        };
        feed.finished(token, out);
    }
}

impl CandleEngine {
    pub(super) fn run_joined(
        &mut self,
        first: Vec<(usize, GenerateRequest)>,
        max_images: u32,
        feed: &mut dyn BatchFeed,
    ) {
        let mut run = Run {
            settings: None,
            members: Vec::new(),
            running: Vec::new(),
            decoded: Vec::new(),
            shared_times: None,
            contexts: Vec::new(),
        };
        // Attention slicing, where the batch's plan needs it, holds for the whole run.
        let mut slicing = None;
        // An offloaded UNet is rebuilt for every stretch of steps: joining would make those stretches short.
        let joins = !self.model.unet.offloaded();
        let mut ledger = Ledger::new(self.model.unet.device());
        let mut incoming = first;
        loop {
            ledger.resume(Site::Admit);
            for (token, req) in incoming.drain(..) {
                // What cannot share a batch (an init image, hires fix) runs as it runs alone.
                if req.batch_key().is_none() {
                    let out = self.generate(&req, &mut |p: &Progress| feed.progress(token, p));
                    feed.finished(token, out);
                } else if let Err(e) = self.admit(&mut run, token, req, max_images, &mut slicing) {
                    feed.finished(token, Err(e));
                }
            }
            self.start_lanes(&mut run, feed);
            ledger.queued();
            if run.running.is_empty() {
                // Nothing left to queue: what is on its way is waited for now.
                self.flush(&mut run, feed);
                if run.members.is_empty() && joins {
                    incoming = feed.join(run.room().max(max_images));
                }
                if incoming.is_empty() {
                    break;
                }
                continue;
            }
            // Steps until someone joins (or, offloaded, an image is done); the UNet stays in use meanwhile. What a
            // step reads back (previews, finished images) is waited for once the next step is queued, so the
            // device never idles on the host's reads.
            let stepped =
                self.model.unet.in_use().map_err(|e| failed(format!("unet: {e}"))).map(|unet| loop {
                    ledger.resume(Site::Step(run.running.len()));
                    if let Err((tokens, e)) = self.step(&mut run, &unet, feed) {
                        return Some((tokens, e));
                    }
                    ledger.queued();
                    self.flush(&mut run, feed);
                    ledger.resume(Site::Decode);
                    self.report(&mut run, feed);
                    if !joins {
                        if run.running.iter().any(|r| r.lane.done()) {
                            return None;
                        }
                    } else {
                        self.start_decodes(&mut run, feed);
                    }
                    ledger.queued();
                    if run.running.is_empty() {
                        return None;
                    }
                    if joins && run.room() > 0 {
                        incoming = feed.join(run.room());
                        if !incoming.is_empty() {
                            return None;
                        }
                    }
                });
            match stepped {
                Ok(None) => {}
                Ok(Some((tokens, e))) => {
                    for token in tokens {
                        run.end(token, Err(copy_error(&e)), feed);
                    }
                }
                Err(e) => {
                    for token in run.members.iter().map(|m| m.token).collect::<Vec<_>>() {
                        run.end(token, Err(copy_error(&e)), feed);
                    }
                }
            }
            // The UNet is out of use: an offloaded model decodes now. What is on its way is handed on after the
            // next step is queued.
            ledger.resume(Site::Decode);
            self.start_decodes(&mut run, feed);
            ledger.queued();
            if joins && incoming.is_empty() && run.room() > 0 {
                incoming = feed.join(run.room());
            }
        }
        self.flush(&mut run, feed);
        ledger.report();
        drop(slicing);
    }

    /// Checks `req` against the batch (the first request sets the batch's size, plan and LoRAs), encodes its
    /// prompts and makes its time rows.
    fn admit(
        &mut self,
        run: &mut Run,
        token: usize,
        req: GenerateRequest,
        max_images: u32,
        slicing: &mut Option<sdhive_models::ops::ScoreLimitGuard>,
    ) -> Result<(), EngineError> {
        req.validate(&self.limits)?;
        let size = req.output_size(self.model.native_size);
        self.check_model_fit(&req, size.0, size.1)?;
        let guided = f64::from(req.cfg_scale) > 1.0;
        match &run.settings {
            Some(s) if s.size != size => {
                return Err(EngineError::Invalid(ValidationError {
                    field: "width",
                    message: "requests of one batch must have one size".into(),
                }))
            }
            Some(s) if s.guided != guided => {
                return Err(EngineError::Invalid(ValidationError {
                    field: "cfg_scale",
                    message: "requests of one batch must all use classifier-free guidance or all not".into(),
                }))
            }
            Some(s) if Some(&s.key) != req.batch_key().as_ref() => {
                return Err(EngineError::Invalid(ValidationError {
                    field: "sampler",
                    message: "requests of one batch must share steps, sampler, schedule and LoRAs".into(),
                }))
            }
            Some(_) => {}
            None => {
                self.model.set_loras(&req.loras).map_err(|e| lora_error(&e))?;
                let kept = self.model.loras.kept_bytes();
                let recorded = sdhive_models::batch_graph_memory(self.model.unet.device());
                let (lanes, plan) = self.memory.batch_plan(size, guided, max_images, (kept, recorded))?;
                *slicing = super::follow_plan(&plan, size);
                self.preview.new_job((size.0 as usize, size.1 as usize));
                let key = req.batch_key().ok_or_else(|| failed("the request cannot share a batch".into()))?;
                run.settings = Some(Settings { size, guided, lanes, plan, key });
            }
        }
        self.set_embeddings(&req)?;
        let prompt = strip_networks(&req.prompt);
        let text_failed = |e: candle_core::Error| failed(format!("text encoder: {e}"));
        let (positive, negative) =
            encode(&self.model, &prompt, &req.negative_prompt, req.clip_skip, guided).map_err(text_failed)?;
        let cond = UnetConditioning::new(
            &self.model,
            &positive,
            negative.as_ref(),
            (size.0 as usize, size.1 as usize),
        )
        .map_err(text_failed)?;
        let seed = req.seed.unwrap_or_else(random_seed);
        let rows = if guided { 2 } else { 1 };
        let times = match (&cond.added, &run.shared_times) {
            (None, Some(shared)) => shared.clone(),
            (added, _) => {
                let timesteps = schedule_timesteps(&self.model, &self.lane_job(&req, size, seed))
                    .map_err(pipeline_error)?;
                let t = self
                    .model
                    .unet
                    .with(|unet| unet.time_rows(&timesteps, rows, added.as_ref()))
                    .and_then(|r| r)
                    .map_err(|e| failed(format!("unet time embedding: {e}")))?;
                if added.is_none() {
                    run.shared_times = Some(t.clone());
                }
                t
            }
        };
        run.members.push(Member {
            token,
            req,
            seed,
            cond,
            times,
            started: 0,
            images: Vec::new(),
            held: None,
        });
        Ok(())
    }

    /// The image job of one of `req`'s images.
    fn lane_job<'a>(&self, req: &'a GenerateRequest, size: (u32, u32), seed: u64) -> ImageJob<'a> {
        ImageJob {
            width: size.0 as usize,
            height: size.1 as usize,
            steps: req.steps as usize,
            cfg_scale: f64::from(req.cfg_scale),
            sampler: req.sampler,
            schedule: req.schedule,
            seed,
            init_image: None,
            init_latents: None,
            mask: None,
            strength: 1.0,
            vae_tiling: false,
        }
    }

    /// Starts the images of admitted requests, oldest first, while lanes are free.
    fn start_lanes(&self, run: &mut Run, feed: &mut dyn BatchFeed) {
        let Some(settings) = &run.settings else { return };
        let (lanes, size) = (settings.lanes as usize, settings.size);
        let mut failed_tokens = Vec::new();
        for m in run.members.iter_mut() {
            while m.started < m.req.n && run.running.len() < lanes {
                let seed = m.seed.wrapping_add(u64::from(m.started));
                match Lane::new(&self.model, &self.lane_job(&m.req, size, seed)) {
                    Ok(lane) => run.running.push(Running { token: m.token, index: m.started, lane }),
                    Err(e) => {
                        failed_tokens.push((m.token, pipeline_error(e)));
                        break;
                    }
                }
                m.started += 1;
            }
        }
        for (token, e) in failed_tokens {
            run.end(token, Err(e), feed);
        }
    }

    /// One step of every running image (a UNet call per group of images whose contexts have one length). On a
    /// failure, the requests of the failed call and the error.
    fn step(
        &self,
        run: &mut Run,
        unet: &sdhive_models::UNet2DConditionModel,
        feed: &mut dyn BatchFeed,
    ) -> Result<(), (Vec<usize>, EngineError)> {
        if run.settings.is_none() {
            return Ok(());
        }
        // Prompts of more 77-token chunks make longer contexts, which cannot share a call.
        let mut groups: Vec<(Vec<usize>, Vec<usize>)> = Vec::new();
        for (i, r) in run.running.iter().enumerate() {
            let dims = run.member(r.token).map(|m| m.cond.context.dims().to_vec()).unwrap_or_default();
            match groups.iter_mut().find(|(d, _)| *d == dims) {
                Some((_, at)) => at.push(i),
                None => groups.push((dims, vec![i])),
            }
        }
        let mut contexts = std::mem::take(&mut run.contexts);
        contexts.retain(|(key, _)| groups.iter().any(|(_, at)| *key == group_key(run, at)));
        for (_, at) in &groups {
            let key = group_key(run, at);
            let tokens: Vec<usize> = at.iter().map(|&i| run.running[i].token).collect();
            if let Err(e) = self.call(run, at, &key, &mut contexts, unet) {
                run.contexts = contexts;
                return Err((tokens, e));
            }
            feed.denoised(at.len() as u32);
            self.preview.step();
        }
        run.contexts = contexts;
        Ok(())
    }

    /// One UNet call for the running images at positions `at` (one group), their contexts stacked once per group
    /// of images (`contexts`).
    fn call(
        &self,
        run: &mut Run,
        at: &[usize],
        key: &[(usize, u32)],
        contexts: &mut Vec<(Vec<(usize, u32)>, Tensor)>,
        unet: &sdhive_models::UNet2DConditionModel,
    ) -> Result<(), EngineError> {
        let guided = run.settings.as_ref().is_some_and(|s| s.guided);
        let members: Vec<&Member> = at.iter().filter_map(|&i| run.member(run.running[i].token)).collect();
        if members.len() != at.len() {
            return Err(failed("a running image lost its request".into()));
        }
        let context = match contexts.iter().find(|(k, _)| k == key) {
            Some((_, c)) => c.clone(),
            None => {
                let c = stack(members.iter().map(|m| m.cond.context.clone()).collect(), guided)
                    .map_err(|e| failed(format!("context: {e}")))?;
                contexts.push((key.to_vec(), c.clone()));
                c
            }
        };
        let temb = members
            .iter()
            .zip(at)
            .map(|(m, &i)| m.times.get(run.running[i].lane.steps_done()))
            .collect::<candle_core::Result<Vec<_>>>()
            .and_then(|rows| stack(rows, guided))
            .map_err(|e| failed(format!("unet time rows: {e}")))?;
        let scales: Vec<f64> = members.iter().map(|m| f64::from(m.req.cfg_scale)).collect();
        let mut lanes: Vec<&mut Lane> = run
            .running
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| at.contains(i))
            .map(|(_, r)| &mut r.lane)
            .collect();
        step_lanes(&self.model, unet, &mut lanes, &scales, (guided, &temb, &context)).map_err(pipeline_error)
    }

    /// Each request's report for this step, on its first running image; a report with a preview on its way is
    /// held until [`Self::flush`].
    fn report(&self, run: &mut Run, feed: &mut dyn BatchFeed) {
        let Some(settings) = &run.settings else { return };
        let full_size_fits = !settings.plan.vae_tiling;
        let mut cancelled = Vec::new();
        for m in run.members.iter_mut() {
            let Some(r) = run.running.iter().find(|r| r.token == m.token) else { continue };
            let (step, steps) = (r.lane.steps_done(), r.lane.timesteps().len());
            let wants = m.req.preview_every > 0 && step.is_multiple_of(m.req.preview_every as usize);
            let preview = if wants {
                self.preview.start(&self.model, r.lane.estimate(), full_size_fits, m.req.preview_approx)
            } else {
                None
            };
            let p = Progress {
                image: r.index,
                images: m.req.n,
                step: step as u32,
                steps: steps as u32,
                preview: None,
            };
            match preview {
                Some(pending) if pending.is_queued() => m.held = Some((p, pending)),
                preview => {
                    let p = Progress { preview: preview.and_then(PendingPreview::finish), ..p };
                    if feed.progress(m.token, &p) == Control::Cancel {
                        cancelled.push(m.token);
                    }
                }
            }
        }
        for token in cancelled {
            run.end(token, Err(EngineError::Cancelled { done: Vec::new() }), feed);
        }
    }

    /// Sends the held reports (a request that cancels ends here), then hands on the decoded images and the
    /// requests that have all of theirs.
    fn flush(&self, run: &mut Run, feed: &mut dyn BatchFeed) {
        let mut cancelled = Vec::new();
        for m in run.members.iter_mut() {
            if let Some((p, pending)) = m.held.take() {
                let p = Progress { preview: pending.finish(), ..p };
                if feed.progress(m.token, &p) == Control::Cancel {
                    cancelled.push(m.token);
                }
            }
        }
        for token in cancelled {
            run.end(token, Err(EngineError::Cancelled { done: Vec::new() }), feed);
        }
        let Some(size) = run.settings.as_ref().map(|s| s.size) else { return };
        for d in std::mem::take(&mut run.decoded) {
            let Some(m) = run.members.iter_mut().find(|m| m.token == d.token) else { continue };
            match d.image.finish() {
                Ok(image) => {
                    let seed = m.seed.wrapping_add(u64::from(d.index));
                    let finished = self.finished(&m.req, image, seed, size);
                    m.images.push(finished);
                    if m.images.len() == m.req.n as usize {
                        run.end(d.token, Ok(()), feed);
                    }
                }
                Err(e) => run.end(d.token, Err(failed(format!("vae decode: {e}"))), feed),
            }
        }
    }

    /// Queues the decode of every image whose schedule ended (its lane leaves); [`Self::flush`] hands them on.
    fn start_decodes(&self, run: &mut Run, feed: &mut dyn BatchFeed) {
        let Some(tiled) = run.settings.as_ref().map(|s| s.plan.vae_tiling) else { return };
        let (done, running): (Vec<Running>, Vec<Running>) =
            std::mem::take(&mut run.running).into_iter().partition(|r| r.lane.done());
        run.running = running;
        for r in done {
            match start_decode(&self.model, r.lane.latents(), tiled) {
                Ok(image) => run.decoded.push(Decoded { token: r.token, index: r.index, image }),
                Err(e) => run.end(r.token, Err(pipeline_error(e)), feed),
            }
        }
    }
}

/// Which images a group holds: `(token, image)` of each, in order.
fn group_key(run: &Run, at: &[usize]) -> Vec<(usize, u32)> {
    at.iter().map(|&i| (run.running[i].token, run.running[i].index)).collect()
}

/// Each image's `(2 when guided else 1, …)` rows of a call (its context, or its time rows), stacked as the UNet
/// takes them: `[negatives…, positives…]` when guided. A single image's come back as they are, so a lone image's
/// calls see the context tensor its job alone passes.
fn stack(parts: Vec<Tensor>, guided: bool) -> candle_core::Result<Tensor> {
    if let [only] = parts.as_slice() {
        return Ok(only.clone());
    }
    let halves: Vec<Tensor> = if guided {
        let neg = parts.iter().map(|t| t.narrow(0, 0, 1));
        let pos = parts.iter().map(|t| t.narrow(0, 1, 1));
        neg.chain(pos).collect::<candle_core::Result<_>>()?
    } else {
        parts
    };
    Tensor::cat(&halves, 0)
}

#[cfg(test)]
#[path = "joined_tests.rs"]
mod tests;
