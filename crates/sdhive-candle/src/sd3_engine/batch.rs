//! Batched SD3 generation: requests of one [`sdhive_engine::BatchKey`] (text to image, one size, steps, sampler,
//! CFG on or off, LoRA set) denoised together, each image a row of one MMDiT call per step with its own prompts,
//! seed and CFG scale ([`Sd3Model::denoise_batch`]), cut into chunks the memory plan admits at once, on the batch
//! bookkeeping of `engine::batch`. A request that fails its checks ends alone; a cancelled one stops
//! reporting and keeps the images it finished, while the other rows run on.

use super::{flow_sampler, ran_request, Sd3Engine};
use crate::engine::batch::{
    check_sizes, decode_rows, end_running, results, rows_of, running_rows, Member, Reporters, Row,
};
use crate::engine::{finished_image, follow_plan, lora_error};
use crate::preview::sd3_latent_preview;
use crate::sd3::{Sd3Error, Sd3Model, Sd3Request, Sd3Row, StepEstimate};
use candle_core::Tensor;
use sdhive_engine::extra_networks::strip_networks;
use sdhive_engine::{
    Control, Engine, EngineError, GenerateOutput, GenerateRequest, Progress, ValidationError,
};
use sdhive_tokenizer::T5_DEFAULT_MAX_LEN;

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
        let mut members = Member::of(reqs);
        if let Some(size) = check_sizes(&mut members, |req| self.checked(req)) {
            self.denoise_members(&mut members, size, max_images, progress);
        }
        results(members)
    }

    /// Applies the batch's LoRAs, then denoises the members' rows chunk by chunk under the batch's memory plan.
    fn denoise_members(
        &mut self,
        members: &mut [Member<'_>],
        size: (u32, u32),
        max_images: u32,
        progress: &mut dyn FnMut(usize, &Progress) -> Control,
    ) {
        let Some(first) = members.iter().find(|m| m.ended.is_none()) else { return };
        let (loras, guided) = (first.req.loras.clone(), first.req.cfg_scale > 1.0);
        if let Err(e) = self.loras.set(&mut self.model, &loras) {
            end_running(members, None, &lora_error(&e));
            return;
        }
        let (chunk, plan) =
            match self.memory.batch_plan(size, guided, max_images, (self.loras.kept_bytes(), 0)) {
                Ok(p) => p,
                Err(e) => {
                    end_running(members, None, &e);
                    return;
                }
            };
        // Dropped at the end of the batch, restoring the engine thread's default.
        let _slicing = follow_plan(&plan, size);
        self.model.vae_tiling = plan.vae_tiling;
        for chunk_rows in rows_of(members, |m| m.ended.is_none()).chunks(chunk as usize) {
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
        let Some((rows, lead)) = running_rows(members, rows) else { return };
        let template = Sd3Request {
            width: width as usize,
            height: height as usize,
            steps: lead.steps as usize,
            sampler: flow_sampler(lead.sampler).unwrap_or_default(),
            max_sequence_length: T5_DEFAULT_MAX_LEN,
            ..Sd3Request::new("", 0)
        };
        let sd3_rows: Vec<Sd3Row> = rows
            .iter()
            .map(|r| {
                let req = members[r.member].req;
                Sd3Row {
                    prompt: strip_networks(&req.prompt),
                    negative_prompt: req.negative_prompt.clone(),
                    seed: r.seed(members),
                    guidance_scale: f64::from(req.cfg_scale),
                    clip_skip: req.clip_skip,
                }
            })
            .collect();
        let mut reporters = Reporters::new(&rows, members.len());
        let result = {
            let model: &Sd3Model = &self.model;
            let mut on_step = |step: usize, steps: usize, estimate: &StepEstimate<'_>| {
                let mut preview = |at: usize, _: &GenerateRequest| {
                    sd3_latent_preview(&estimate.latents().and_then(|e| e.narrow(0, at, 1)).ok()?)
                };
                reporters.report(members, &rows, (step, steps), &mut preview, progress)
            };
            model.denoise_batch(&template, &sd3_rows, &mut on_step)
        };
        reporters.end_cancelled(members);
        let latents = match result {
            Ok(l) => l,
            // Every member of the chunk cancelled.
            Err(Sd3Error::Cancelled) => return,
            Err(e) => {
                end_running(members, Some(&rows), &sd3_error(e));
                return;
            }
        };
        let mut decode = |row: &Tensor| self.model.decode(row).map_err(sd3_error);
        let finish = |req: &GenerateRequest, image, seed| {
            finished_image(&ran_request(req).1, image, seed, (width, height), &self.name)
        };
        decode_rows(members, &rows, &latents, &mut decode, &finish);
    }
}
