//! The bookkeeping of a batch whose images start and end together (SD3's): requests of one
//! [`sdhive_engine::BatchKey`] become rows of one batch (each request's prompts encoded once, each image with its
//! own seed and CFG scale), cut into chunks the memory plan admits at once; a cancelled request stops reporting
//! and keeps the images it finished, while the other rows run on. Its tests run on both engines' batches.

use super::failed;
use candle_core::Tensor;
use sdhive_engine::{
    random_seed, Control, EngineError, GenerateOutput, GenerateRequest, GeneratedImage, Progress, RgbImage,
    ValidationError,
};

/// One request's part in a batch run.
pub(crate) struct Member<'a> {
    pub(crate) req: &'a GenerateRequest,
    pub(crate) seed: u64,
    pub(crate) images: Vec<GeneratedImage>,
    /// Why it ended early (a failure, or `Cancelled` with its finished images taken at the end).
    pub(crate) ended: Option<EngineError>,
}

impl<'a> Member<'a> {
    /// The members of `reqs`, each with its seed (drawn when the request has none).
    pub(crate) fn of(reqs: &[&'a GenerateRequest]) -> Vec<Self> {
        reqs.iter()
            .map(|req| Member {
                req,
                seed: req.seed.unwrap_or_else(random_seed),
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
    pub(crate) fn seed(&self, members: &[Member<'_>]) -> u64 {
        members[self.member].seed.wrapping_add(u64::from(self.index))
    }
}

/// Each member's result: its images, or why it ended (a cancel keeping the images it finished).
pub(crate) fn results(members: Vec<Member<'_>>) -> Vec<Result<GenerateOutput, EngineError>> {
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
pub(crate) fn check_sizes(
    members: &mut [Member<'_>],
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
pub(crate) fn end_running(members: &mut [Member<'_>], rows: Option<&[Row]>, error: &EngineError) {
    match rows {
        Some(rows) => {
            for r in rows {
                let m = &mut members[r.member];
                if m.ended.is_none() {
                    m.ended = Some(copy_error(error));
                }
            }
        }
        None => {
            for m in members.iter_mut().filter(|m| m.ended.is_none()) {
                m.ended = Some(copy_error(error));
            }
        }
    }
}

/// The same error for each request a failed call ends.
pub(crate) fn copy_error(e: &EngineError) -> EngineError {
    match e {
        EngineError::Invalid(v) => EngineError::Invalid(v.clone()),
        EngineError::InsufficientMemory(i) => EngineError::InsufficientMemory(*i),
        EngineError::OutOfMemory(m) => EngineError::OutOfMemory(m.clone()),
        other => failed(other.to_string()),
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
    pub(crate) fn report(
        &mut self,
        members: &[Member<'_>],
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
    pub(crate) fn end_cancelled(&self, members: &mut [Member<'_>]) {
        for (member, c) in self.cancelled.iter().enumerate() {
            if *c {
                members[member].ended = Some(EngineError::Cancelled { done: Vec::new() });
            }
        }
    }
}

/// Decodes the rows of `latents` (the chunk `rows`, in order) whose members still run, and gives each member its
/// image (`finish(request, image, seed)`); a failed decode ends that member.
pub(crate) fn decode_rows(
    members: &mut [Member<'_>],
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
pub(crate) fn running_rows<'a>(
    members: &[Member<'a>],
    rows: &[Row],
) -> Option<(Vec<Row>, &'a GenerateRequest)> {
    let rows: Vec<Row> = rows.iter().copied().filter(|r| members[r.member].ended.is_none()).collect();
    let lead = members[rows.first()?.member].req;
    Some((rows, lead))
}

/// The rows of every member still running, member by member, each request's images in order.
pub(crate) fn rows_of(members: &[Member<'_>], live: impl Fn(&Member<'_>) -> bool) -> Vec<Row> {
    members
        .iter()
        .enumerate()
        .filter(|(_, m)| live(m))
        .flat_map(|(member, m)| (0..m.req.n).map(move |index| Row { member, index }))
        .collect()
}

#[cfg(test)]
#[path = "batch_tests.rs"]
pub(crate) mod tests;
