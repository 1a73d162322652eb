//! Batched SD3 generation: requests of one [`sdhive_engine::BatchKey`] (text to image, one size, steps, sampler,
//! CFG on or off, LoRA set) denoised together, each image a row of one MMDiT call per step with its own prompts,
//! seed and CFG scale ([`Sd3Model::denoise_batch`]), cut into chunks the memory plan admits at once. A request that
//! fails its checks ends alone; a cancelled one stops reporting and keeps the images it finished, while the other
//! rows run on.

use super::{flow_sampler, ran_request, Sd3Engine};
use crate::engine::{finished_image, follow_plan, lora_error, CFG_BATCH};
use crate::preview::sd3_latent_preview;
use crate::sd3::{Sd3Error, Sd3Request, Sd3Row, StepEstimate};
use sdhive_engine::extra_networks::strip_networks;
use sdhive_engine::{
    random_seed, Control, Engine, EngineError, GenerateOutput, GenerateRequest, GeneratedImage, JobPlan,
    Progress, ValidationError,
};
use sdhive_tokenizer::T5_DEFAULT_MAX_LEN;

/// One request's part in a batch run.
struct Member<'a> {
    req: &'a GenerateRequest,
    seed: u64,
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

fn sd3_error(e: Sd3Error) -> EngineError {
    match e {
        Sd3Error::Invalid { field, message } => EngineError::Invalid(ValidationError { field, message }),
        other => EngineError::Failed(other.to_string()),
    }
}

impl Sd3Engine {
    pub(super) fn run_batch(
        &mut self,
        reqs: &[&GenerateRequest],
        max_images: u32,
        progress: &mut dyn FnMut(usize, &Progress) -> Control,
    ) -> Vec<Result<GenerateOutput, EngineError>> {
        // What cannot share a batch (hires fix, an init image, skip-layer guidance) runs as it runs alone.
        if reqs.iter().any(|r| r.batch_key().is_none()) {
            return reqs
                .iter()
                .enumerate()
                .map(|(i, r)| self.generate(r, &mut |p: &Progress| progress(i, p)))
                .collect();
        }
        let mut members: Vec<Member<'_>> = reqs
            .iter()
            .map(|req| Member {
                req,
                seed: req.seed.unwrap_or_else(random_seed),
                images: Vec::new(),
                ended: None,
            })
            .collect();
        if let Some(size) = self.prepare(&mut members) {
            self.denoise_members(&mut members, size, max_images, progress);
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

    /// Checks every member and applies the batch's LoRAs; members that fail end with their error. Returns the
    /// batch's output size if any member is left to run.
    fn prepare(&mut self, members: &mut [Member<'_>]) -> Option<(u32, u32)> {
        let mut size = None;
        for m in members.iter_mut() {
            match self.checked(m.req) {
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
        if let Err(e) = self.loras.set(&mut self.model, &loras) {
            for m in members.iter_mut().filter(|m| m.ended.is_none()) {
                m.ended = Some(lora_error(&e));
            }
            return None;
        }
        Some(size)
    }

    /// The largest batch (in images, at most `max_images`) whose MMDiT call fits the device's free memory without
    /// slicing attention, with the plan it runs under; a single image may slice and tile as any job does.
    fn batch_plan(
        &self,
        (width, height): (u32, u32),
        guided: bool,
        max_images: u32,
    ) -> Result<(u32, JobPlan), EngineError> {
        let per_image = if guided { CFG_BATCH } else { 1 };
        let kept = self.loras.kept_bytes();
        let mut images = max_images.max(1);
        while images > 1 {
            let free = self.memory.free_for_jobs(kept);
            if let Ok(plan) =
                self.memory.shape.plan(width, height, per_image * u64::from(images), free, false, true)
            {
                return Ok((images, plan));
            }
            images /= 2;
        }
        Ok((1, self.memory.plan(width, height, kept)?))
    }

    fn denoise_members(
        &mut self,
        members: &mut [Member<'_>],
        size: (u32, u32),
        max_images: u32,
        progress: &mut dyn FnMut(usize, &Progress) -> Control,
    ) {
        let Some(first) = members.iter().find(|m| m.ended.is_none()) else { return };
        let guided = first.req.cfg_scale > 1.0;
        let (chunk, plan) = match self.batch_plan(size, guided, max_images) {
            Ok(p) => p,
            Err(e) => {
                let message = e.to_string();
                for m in members.iter_mut().filter(|m| m.ended.is_none()) {
                    m.ended = Some(match &e {
                        EngineError::InsufficientMemory(i) => EngineError::InsufficientMemory(*i),
                        _ => EngineError::Failed(message.clone()),
                    });
                }
                return;
            }
        };
        // Dropped at the end of the batch, restoring the engine thread's default.
        let _slicing = follow_plan(&plan, size);
        self.model.vae_tiling = plan.vae_tiling;
        let rows: Vec<Row> = members
            .iter()
            .enumerate()
            .filter(|(_, m)| m.ended.is_none())
            .flat_map(|(member, m)| (0..m.req.n).map(move |index| Row { member, index }))
            .collect();
        for chunk_rows in rows.chunks(chunk as usize) {
            self.run_chunk(members, chunk_rows, size, progress);
        }
    }

    /// Denoises and decodes one chunk of rows; rows of members that ended meanwhile are skipped.
    fn run_chunk(
        &mut self,
        members: &mut [Member<'_>],
        rows: &[Row],
        (width, height): (u32, u32),
        progress: &mut dyn FnMut(usize, &Progress) -> Control,
    ) {
        let rows: Vec<Row> = rows.iter().copied().filter(|r| members[r.member].ended.is_none()).collect();
        let Some(first) = rows.first() else { return };
        let lead = members[first.member].req;
        let template = Sd3Request {
            width: width as usize,
            height: height as usize,
            steps: lead.steps as usize,
            sampler: flow_sampler(lead.sampler).unwrap_or_default(),
            max_sequence_length: T5_DEFAULT_MAX_LEN,
            ..Sd3Request::new("", 0)
        };
        let seed = |members: &[Member<'_>], r: &Row| members[r.member].seed.wrapping_add(u64::from(r.index));
        let sd3_rows: Vec<Sd3Row> = rows
            .iter()
            .map(|r| {
                let req = members[r.member].req;
                Sd3Row {
                    prompt: strip_networks(&req.prompt),
                    negative_prompt: req.negative_prompt.clone(),
                    seed: seed(members, r),
                    guidance_scale: f64::from(req.cfg_scale),
                    clip_skip: req.clip_skip,
                }
            })
            .collect();
        let mut on_step = |step: usize, steps: usize, estimate: &StepEstimate<'_>| {
            let mut running = false;
            for (i, r) in rows.iter().enumerate() {
                let m = &mut members[r.member];
                if m.ended.is_some() {
                    continue;
                }
                let every = m.req.preview_every as usize;
                let preview = (every > 0 && step.is_multiple_of(every))
                    .then(|| estimate.latents().and_then(|e| e.narrow(0, i, 1)).ok())
                    .flatten()
                    .and_then(|e| sd3_latent_preview(&e));
                let p = Progress {
                    image: r.index,
                    images: m.req.n,
                    step: step as u32,
                    steps: steps as u32,
                    preview,
                };
                if progress(r.member, &p) == Control::Cancel {
                    m.ended = Some(EngineError::Cancelled { done: Vec::new() });
                } else {
                    running = true;
                }
            }
            running
        };
        let latents = match self.model.denoise_batch(&template, &sd3_rows, &mut on_step) {
            Ok(l) => l,
            // Every row's request cancelled (each marked so already).
            Err(Sd3Error::Cancelled) => return,
            Err(e) => {
                let e = sd3_error(e);
                for r in &rows {
                    let m = &mut members[r.member];
                    if m.ended.is_none() {
                        m.ended = Some(match &e {
                            EngineError::Invalid(v) => EngineError::Invalid(v.clone()),
                            other => EngineError::Failed(other.to_string()),
                        });
                    }
                }
                return;
            }
        };
        for (i, r) in rows.iter().enumerate() {
            if members[r.member].ended.is_some() {
                continue;
            }
            let image = latents
                .narrow(0, i, 1)
                .map_err(|e| Sd3Error::Failed { stage: "decode", message: e.to_string() });
            match image.and_then(|l| self.model.decode(&l)) {
                Ok(image) => {
                    let seed = seed(members, r);
                    let m = &mut members[r.member];
                    let (_, ran) = ran_request(m.req);
                    m.images.push(finished_image(&ran, image, seed, (width, height), &self.name));
                }
                Err(e) => members[r.member].ended = Some(sd3_error(e)),
            }
        }
    }
}
