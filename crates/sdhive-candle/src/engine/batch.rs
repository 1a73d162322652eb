//! Batched generation: requests of one [`sdhive_engine::BatchKey`] denoised together. Their images become rows of
//! one batch (each request's prompts encoded once, each image with its own seed and CFG scale), cut into chunks the
//! memory plan admits at once; a cancelled request stops reporting and keeps the images it finished, while the
//! other rows run on.

use super::{encode, failed, lora_error, CandleEngine, CFG_BATCH};
use crate::pipeline::UnetConditioning;
use crate::pipeline::{decode, denoise_batch, BatchRow, ImageJob, PipelineError, StepReport};
use sdhive_engine::extra_networks::strip_networks;
use sdhive_engine::{
    random_seed, Control, EngineError, GenerateOutput, GenerateRequest, GeneratedImage, JobPlan, Progress,
    ValidationError,
};

/// One request's part in a batch run.
struct Member<'a> {
    req: &'a GenerateRequest,
    seed: u64,
    cond: Option<UnetConditioning>,
    images: Vec<GeneratedImage>,
    /// Why it ended early (a failure, or `Cancelled` with its finished images taken at the end).
    ended: Option<EngineError>,
}

/// One image to make: which member, and its index within that member's request.
#[derive(Clone, Copy)]
struct Row {
    member: usize,
    index: u32,
}

impl CandleEngine {
    pub(super) fn run_batch(
        &mut self,
        reqs: &[&GenerateRequest],
        max_images: u32,
        progress: &mut dyn FnMut(usize, &Progress) -> Control,
    ) -> Vec<Result<GenerateOutput, EngineError>> {
        let mut members: Vec<Member<'_>> = reqs
            .iter()
            .map(|req| Member {
                req,
                seed: req.seed.unwrap_or_else(random_seed),
                cond: None,
                images: Vec::new(),
                ended: None,
            })
            .collect();
        if let Some((width, height)) = self.prepare(&mut members) {
            self.denoise_members(&mut members, (width, height), max_images, progress);
        }
        members
            .into_iter()
            .map(|m| match m.ended {
                Some(EngineError::Cancelled { .. }) => Err(EngineError::Cancelled { done: m.images }),
                Some(e) => Err(e),
                None => Ok(GenerateOutput { images: m.images }),
            })
            .collect()
    }

    /// Validates every member, applies the batch's LoRAs and encodes each member's prompts; members that fail end
    /// with their error. Returns the batch's output size if any member is left to run.
    fn prepare(&mut self, members: &mut [Member<'_>]) -> Option<(u32, u32)> {
        let mut size = None;
        for m in members.iter_mut() {
            let checked = m.req.validate(&self.limits).map_err(EngineError::from).and_then(|()| {
                let (w, h) = m.req.output_size(self.model.native_size);
                self.check_model_fit(m.req, w, h)?;
                Ok((w, h))
            });
            match checked {
                Ok(s) if size.is_none_or(|first| first == s) => size = Some(s),
                Ok(_) => {
                    m.ended = Some(EngineError::Invalid(ValidationError {
                        field: "width",
                        message: "requests of one batch must have one size".into(),
                    }))
                }
                Err(e) => m.ended = Some(e),
            }
        }
        let size = size?;
        let loras = members.iter().find(|m| m.ended.is_none()).map(|m| m.req.loras.clone())?;
        if let Err(e) = self.model.set_loras(&loras) {
            for m in members.iter_mut().filter(|m| m.ended.is_none()) {
                m.ended = Some(lora_error(&e));
            }
            return None;
        }
        for m in members.iter_mut().filter(|m| m.ended.is_none()) {
            let req = m.req;
            if let Err(e) = self.set_embeddings(req) {
                m.ended = Some(e);
                continue;
            }
            let guided = f64::from(req.cfg_scale) > 1.0;
            let prompt = strip_networks(&req.prompt);
            let cond = encode(&self.model, &prompt, &req.negative_prompt, req.clip_skip, guided).and_then(
                |(positive, negative)| {
                    UnetConditioning::new(
                        &self.model,
                        &positive,
                        negative.as_ref(),
                        (size.0 as usize, size.1 as usize),
                    )
                },
            );
            match cond {
                Ok(c) => m.cond = Some(c),
                Err(e) => m.ended = Some(failed(format!("text encoder: {e}"))),
            }
        }
        Some(size)
    }

    /// The largest batch (in images, at most `max_images`) whose UNet call fits the device's free memory without
    /// slicing attention, with the plan it runs under; a single image may slice and tile as any job does.
    fn batch_plan(
        &self,
        width: u32,
        height: u32,
        guided: bool,
        max_images: u32,
    ) -> Result<(u32, JobPlan), EngineError> {
        let per_image = if guided { CFG_BATCH } else { 1 };
        let mut images = max_images.max(1);
        while images > 1 {
            let free = self.memory.free_for_jobs(self.model.loras.kept_bytes());
            if let Ok(plan) =
                self.memory.shape.plan(width, height, per_image * u64::from(images), free, false, true)
            {
                return Ok((images, plan));
            }
            images /= 2;
        }
        Ok((1, self.plan(width, height)?))
    }

    fn denoise_members(
        &mut self,
        members: &mut [Member<'_>],
        (width, height): (u32, u32),
        max_images: u32,
        progress: &mut dyn FnMut(usize, &Progress) -> Control,
    ) {
        let live = |m: &Member<'_>| m.ended.is_none() && m.cond.is_some();
        let Some(first) = members.iter().find(|m| live(m)) else { return };
        let guided = f64::from(first.req.cfg_scale) > 1.0;
        let (chunk, plan) = match self.batch_plan(width, height, guided, max_images) {
            Ok(p) => p,
            Err(e) => {
                let message = e.to_string();
                for m in members.iter_mut().filter(|m| live(m)) {
                    m.ended = Some(match &e {
                        EngineError::InsufficientMemory(i) => EngineError::InsufficientMemory(*i),
                        _ => failed(message.clone()),
                    });
                }
                return;
            }
        };
        let _slicing = plan.attention_slicing.then(|| {
            sdhive_models::ops::limit_attention_scores(
                sdhive_models::ops::MAX_SCORE_ELEMENTS / sdhive_engine::memory::ATTENTION_SLICES as usize,
            )
        });
        // Rows whose prompts give contexts of different lengths (more 77-token chunks) cannot share a UNet call.
        let mut groups: Vec<(Vec<usize>, Vec<Row>)> = Vec::new();
        for (i, m) in members.iter().enumerate().filter(|(_, m)| live(m)) {
            let dims = m.cond.as_ref().map(|c| c.context.dims().to_vec()).unwrap_or_default();
            let at = match groups.iter().position(|(d, _)| *d == dims) {
                Some(at) => at,
                None => {
                    groups.push((dims, Vec::new()));
                    groups.len() - 1
                }
            };
            groups[at].1.extend((0..m.req.n).map(|index| Row { member: i, index }));
        }
        for (_, rows) in groups {
            for chunk_rows in rows.chunks(chunk as usize) {
                self.run_chunk(members, chunk_rows, (width, height), &plan, progress);
            }
        }
    }

    /// Denoises and decodes one chunk of rows; rows of members that ended meanwhile are skipped.
    fn run_chunk(
        &mut self,
        members: &mut [Member<'_>],
        rows: &[Row],
        (width, height): (u32, u32),
        plan: &JobPlan,
        progress: &mut dyn FnMut(usize, &Progress) -> Control,
    ) {
        let rows: Vec<Row> = rows.iter().copied().filter(|r| members[r.member].ended.is_none()).collect();
        let Some(first) = rows.first() else { return };
        let lead = members[first.member].req;
        let job = ImageJob {
            width: width as usize,
            height: height as usize,
            steps: lead.steps as usize,
            cfg_scale: f64::from(lead.cfg_scale),
            sampler: lead.sampler,
            schedule: lead.schedule,
            seed: 0,
            init_image: None,
            init_latents: None,
            mask: None,
            strength: 1.0,
            vae_tiling: plan.vae_tiling,
        };
        let model = &self.model;
        let previews = &self.preview;
        let batch: Vec<BatchRow<'_>> = rows
            .iter()
            .filter_map(|r| {
                let m = &members[r.member];
                Some(BatchRow {
                    cond: m.cond.as_ref()?,
                    seed: m.seed.wrapping_add(u64::from(r.index)),
                    cfg_scale: f64::from(m.req.cfg_scale),
                })
            })
            .collect();
        // Each member present reports once per step, as its first row in the chunk; a member that answers
        // `Cancel` is done reporting, and the chunk stops early only when every member in it has cancelled.
        let mut reporters: Vec<(usize, usize)> = Vec::new();
        for (at, r) in rows.iter().enumerate() {
            if !reporters.iter().any(|(m, _)| *m == r.member) {
                reporters.push((r.member, at));
            }
        }
        let mut cancelled = vec![false; members.len()];
        let result = {
            let mut on_step = |s: StepReport<'_>| {
                for &(member, at) in &reporters {
                    if cancelled[member] {
                        continue;
                    }
                    let req = members[member].req;
                    let wants_preview =
                        req.preview_every > 0 && s.step.is_multiple_of(req.preview_every as usize);
                    let preview = if wants_preview {
                        let row = s.estimate.narrow(0, at, 1).ok();
                        row.and_then(|row| previews.render(model, &row, !plan.vae_tiling, req.preview_approx))
                    } else {
                        None
                    };
                    let p = Progress {
                        image: rows[at].index,
                        images: req.n,
                        step: s.step as u32,
                        steps: s.steps as u32,
                        preview,
                    };
                    if progress(member, &p) == Control::Cancel {
                        cancelled[member] = true;
                    }
                }
                reporters.iter().any(|(m, _)| !cancelled[*m])
            };
            denoise_batch(model, &batch, &job, &mut on_step)
        };
        for (member, c) in cancelled.iter().enumerate() {
            if *c {
                members[member].ended = Some(EngineError::Cancelled { done: Vec::new() });
            }
        }
        let latents = match result {
            Ok(latents) => latents,
            Err(PipelineError::Cancelled) => return,
            Err(e) => {
                let error = match e {
                    PipelineError::Invalid { field, message } => {
                        EngineError::Invalid(ValidationError { field, message })
                    }
                    other => failed(other.to_string()),
                };
                let message = error.to_string();
                for r in &rows {
                    let m = &mut members[r.member];
                    if m.ended.is_none() {
                        m.ended = Some(match &error {
                            EngineError::Invalid(v) => EngineError::Invalid(v.clone()),
                            _ => failed(message.clone()),
                        });
                    }
                }
                return;
            }
        };
        for (at, r) in rows.iter().enumerate() {
            if members[r.member].ended.is_some() {
                continue;
            }
            let image = latents
                .narrow(0, at, 1)
                .map_err(|e| PipelineError::Failed { what: "vae decode", message: e.to_string() })
                .and_then(|row| decode(&self.model, &row, plan.vae_tiling));
            let m = &mut members[r.member];
            match image {
                Ok(image) => {
                    let seed = m.seed.wrapping_add(u64::from(r.index));
                    m.images.push(self.finished(m.req, image, seed, (width, height)));
                }
                Err(e) => m.ended = Some(failed(e.to_string())),
            }
        }
    }
}

#[cfg(test)]
#[path = "batch_tests.rs"]
pub(crate) mod tests;
