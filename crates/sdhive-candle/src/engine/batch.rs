//! Batched generation: requests of one [`sdhive_engine::BatchKey`] denoised together. Their images become rows of
//! one batch (each request's prompts encoded once, each image with its own seed and CFG scale), cut into chunks the
//! memory plan admits at once; a cancelled request stops reporting and keeps the images it finished, while the
//! other rows run on.

use super::{encode, failed, lora_error, CandleEngine};
use crate::pipeline::UnetConditioning;
use crate::pipeline::{decode, denoise_batch, BatchRow, ImageJob, PipelineError, StepReport};
use candle_core::Tensor;
use sdhive_engine::extra_networks::strip_networks;
use sdhive_engine::{
    random_seed, Control, EngineError, GenerateOutput, GenerateRequest, GeneratedImage, JobPlan, Progress,
    RgbImage, ValidationError,
};

/// One request's part in a batch run (both engines'): `cond` is what the engine prepared for it.
pub(crate) struct Member<'a, C> {
    pub(crate) req: &'a GenerateRequest,
    pub(crate) seed: u64,
    pub(crate) cond: C,
    pub(crate) images: Vec<GeneratedImage>,
    /// Why it ended early (a failure, or `Cancelled` with its finished images taken at the end).
    pub(crate) ended: Option<EngineError>,
}

impl<'a, C: Default> Member<'a, C> {
    /// The members of `reqs`, each with its seed (drawn when the request has none).
    pub(crate) fn of(reqs: &[&'a GenerateRequest]) -> Vec<Self> {
        reqs.iter()
            .map(|req| Member {
                req,
                seed: req.seed.unwrap_or_else(random_seed),
                cond: C::default(),
                images: Vec::new(),
                ended: None,
            })
            .collect()
    }
}

/// One image to make: which member, and its index within that member's request.
#[derive(Clone, Copy)]
pub(crate) struct Row {
    pub(crate) member: usize,
    pub(crate) index: u32,
}

impl Row {
    pub(crate) fn seed<C>(&self, members: &[Member<'_, C>]) -> u64 {
        members[self.member].seed.wrapping_add(u64::from(self.index))
    }
}

/// Each member's result: its images, or why it ended (a cancel keeping the images it finished).
pub(crate) fn results<C>(members: Vec<Member<'_, C>>) -> Vec<Result<GenerateOutput, EngineError>> {
    members
        .into_iter()
        .map(|m| match m.ended {
            Some(EngineError::Cancelled { .. }) => Err(EngineError::Cancelled { done: m.images }),
            Some(e) => Err(e),
            None => Ok(GenerateOutput { images: m.images }),
        })
        .collect()
}

/// Checks every member with `checked` (its output size, or why it cannot run); members that fail, or whose size
/// differs from the first's, end with their error. Returns the batch's size if any member is left.
pub(crate) fn check_sizes<C>(
    members: &mut [Member<'_, C>],
    mut checked: impl FnMut(&GenerateRequest) -> Result<(u32, u32), EngineError>,
) -> Option<(u32, u32)> {
    let mut size = None;
    for m in members.iter_mut() {
        match checked(m.req) {
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
    size
}

/// Ends every member still running with `error` (or a plain failure of its message).
pub(crate) fn end_running<C>(members: &mut [Member<'_, C>], rows: Option<&[Row]>, error: &EngineError) {
    let message = error.to_string();
    let copy = || match error {
        EngineError::Invalid(v) => EngineError::Invalid(v.clone()),
        EngineError::InsufficientMemory(i) => EngineError::InsufficientMemory(*i),
        _ => failed(message.clone()),
    };
    match rows {
        Some(rows) => {
            for r in rows {
                let m = &mut members[r.member];
                if m.ended.is_none() {
                    m.ended = Some(copy());
                }
            }
        }
        None => {
            for m in members.iter_mut().filter(|m| m.ended.is_none()) {
                m.ended = Some(copy());
            }
        }
    }
}

/// A chunk's progress reports: each member present reports once per step, as its first row in the chunk; a member
/// that answers `Cancel` is done reporting, and the chunk stops early only when every member in it has cancelled.
pub(crate) struct Reporters {
    /// Member and its first row's position in the chunk.
    first_rows: Vec<(usize, usize)>,
    cancelled: Vec<bool>,
}

impl Reporters {
    pub(crate) fn new(rows: &[Row], members: usize) -> Self {
        let mut first_rows: Vec<(usize, usize)> = Vec::new();
        for (at, r) in rows.iter().enumerate() {
            if !first_rows.iter().any(|(m, _)| *m == r.member) {
                first_rows.push((r.member, at));
            }
        }
        Reporters { first_rows, cancelled: vec![false; members] }
    }

    /// Reports step `step` of `steps` for every member still listening (`preview(at, req)`: its preview from
    /// row `at`, where it asks for one); whether any still is.
    pub(crate) fn report<C>(
        &mut self,
        members: &[Member<'_, C>],
        rows: &[Row],
        (step, steps): (usize, usize),
        preview: &mut dyn FnMut(usize, &GenerateRequest) -> Option<RgbImage>,
        progress: &mut dyn FnMut(usize, &Progress) -> Control,
    ) -> bool {
        for &(member, at) in &self.first_rows {
            if self.cancelled[member] {
                continue;
            }
            let req = members[member].req;
            let wants = req.preview_every > 0 && step.is_multiple_of(req.preview_every as usize);
            let p = Progress {
                image: rows[at].index,
                images: req.n,
                step: step as u32,
                steps: steps as u32,
                preview: if wants { preview(at, req) } else { None },
            };
            if progress(member, &p) == Control::Cancel {
                self.cancelled[member] = true;
            }
        }
        self.first_rows.iter().any(|(m, _)| !self.cancelled[*m])
    }

    /// Marks the members that cancelled as ended.
    pub(crate) fn end_cancelled<C>(&self, members: &mut [Member<'_, C>]) {
        for (member, c) in self.cancelled.iter().enumerate() {
            if *c {
                members[member].ended = Some(EngineError::Cancelled { done: Vec::new() });
            }
        }
    }
}

/// Decodes the rows of `latents` (the chunk `rows`, in order) whose members still run, and gives each member its
/// image (`finish(request, image, seed)`); a failed decode ends that member.
pub(crate) fn decode_rows<C>(
    members: &mut [Member<'_, C>],
    rows: &[Row],
    latents: &Tensor,
    decode: &mut dyn FnMut(&Tensor) -> Result<RgbImage, EngineError>,
    finish: &dyn Fn(&GenerateRequest, RgbImage, u64) -> GeneratedImage,
) {
    for (at, r) in rows.iter().enumerate() {
        if members[r.member].ended.is_some() {
            continue;
        }
        let image =
            latents.narrow(0, at, 1).map_err(|e| failed(format!("vae decode: {e}"))).and_then(|l| decode(&l));
        let seed = r.seed(members);
        let m = &mut members[r.member];
        match image {
            Ok(image) => m.images.push(finish(m.req, image, seed)),
            Err(e) => m.ended = Some(e),
        }
    }
}

/// The rows of a chunk whose members still run, and the request of the first (the chunk's shared settings); `None`
/// when every member of the chunk has ended.
pub(crate) fn running_rows<'a, C>(
    members: &[Member<'a, C>],
    rows: &[Row],
) -> Option<(Vec<Row>, &'a GenerateRequest)> {
    let rows: Vec<Row> = rows.iter().copied().filter(|r| members[r.member].ended.is_none()).collect();
    let lead = members[rows.first()?.member].req;
    Some((rows, lead))
}

/// The rows of every member still running, member by member, each request's images in order.
pub(crate) fn rows_of<C>(members: &[Member<'_, C>], live: impl Fn(&Member<'_, C>) -> bool) -> Vec<Row> {
    members
        .iter()
        .enumerate()
        .filter(|(_, m)| live(m))
        .flat_map(|(member, m)| (0..m.req.n).map(move |index| Row { member, index }))
        .collect()
}

/// A member of an SD1/SDXL batch: its prompts' conditioning once encoded.
type SdMember<'a> = Member<'a, Option<UnetConditioning>>;

impl CandleEngine {
    pub(super) fn run_batch(
        &mut self,
        reqs: &[&GenerateRequest],
        max_images: u32,
        progress: &mut dyn FnMut(usize, &Progress) -> Control,
    ) -> Vec<Result<GenerateOutput, EngineError>> {
        let mut members = SdMember::of(reqs);
        if let Some((width, height)) = self.prepare(&mut members) {
            self.denoise_members(&mut members, (width, height), max_images, progress);
        }
        results(members)
    }

    /// Validates every member, applies the batch's LoRAs and encodes each member's prompts; members that fail end
    /// with their error. Returns the batch's output size if any member is left to run.
    fn prepare(&mut self, members: &mut [SdMember<'_>]) -> Option<(u32, u32)> {
        let size = check_sizes(members, |req| {
            req.validate(&self.limits)?;
            let (w, h) = req.output_size(self.model.native_size);
            self.check_model_fit(req, w, h)?;
            Ok((w, h))
        })?;
        let loras = members.iter().find(|m| m.ended.is_none()).map(|m| m.req.loras.clone())?;
        if let Err(e) = self.model.set_loras(&loras) {
            end_running(members, None, &lora_error(&e));
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

    fn denoise_members(
        &mut self,
        members: &mut [SdMember<'_>],
        (width, height): (u32, u32),
        max_images: u32,
        progress: &mut dyn FnMut(usize, &Progress) -> Control,
    ) {
        let live = |m: &SdMember<'_>| m.ended.is_none() && m.cond.is_some();
        let Some(first) = members.iter().find(|m| live(m)) else { return };
        let guided = f64::from(first.req.cfg_scale) > 1.0;
        let kept = self.model.loras.kept_bytes();
        let (chunk, plan) = match self.memory.batch_plan((width, height), guided, max_images, kept) {
            Ok(p) => p,
            Err(e) => {
                end_running(members, None, &e);
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
        for row in rows_of(members, live) {
            let m = &members[row.member];
            let dims = m.cond.as_ref().map(|c| c.context.dims().to_vec()).unwrap_or_default();
            match groups.iter_mut().find(|(d, _)| *d == dims) {
                Some((_, rows)) => rows.push(row),
                None => groups.push((dims, vec![row])),
            }
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
        members: &mut [SdMember<'_>],
        rows: &[Row],
        (width, height): (u32, u32),
        plan: &JobPlan,
        progress: &mut dyn FnMut(usize, &Progress) -> Control,
    ) {
        let Some((rows, lead)) = running_rows(members, rows) else { return };
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
                    seed: r.seed(members),
                    cfg_scale: f64::from(m.req.cfg_scale),
                })
            })
            .collect();
        let mut reporters = Reporters::new(&rows, members.len());
        let result = {
            let mut on_step = |s: StepReport<'_>| {
                let mut preview = |at: usize, req: &GenerateRequest| {
                    let row = s.estimate.narrow(0, at, 1).ok()?;
                    previews.render(model, &row, !plan.vae_tiling, req.preview_approx)
                };
                reporters.report(members, &rows, (s.step, s.steps), &mut preview, progress)
            };
            denoise_batch(model, &batch, &job, &mut on_step)
        };
        reporters.end_cancelled(members);
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
                end_running(members, Some(&rows), &error);
                return;
            }
        };
        let mut decode_row =
            |row: &Tensor| decode(&self.model, row, plan.vae_tiling).map_err(|e| failed(e.to_string()));
        let finish = |req: &GenerateRequest, image, seed| self.finished(req, image, seed, (width, height));
        decode_rows(members, &rows, &latents, &mut decode_row, &finish);
    }
}

#[cfg(test)]
#[path = "batch_tests.rs"]
pub(crate) mod tests;
