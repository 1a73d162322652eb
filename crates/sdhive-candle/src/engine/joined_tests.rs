//! Requests that join a running batch between steps get the images they get alone, each handed back as soon as
//! it is done; the batch never runs more images than its lanes, a newcomer cancelled mid-run ends alone, and one
//! the batch cannot run fails without touching the others.

use super::super::batch::tests::{alone, assert_same, req};
use super::super::{CandleEngine, LoadOptions};
use crate::model::SdModel;
use crate::parity_tests::fixtures;
use crate::test_device::test_device;
use sdhive_engine::{
    BatchFeed, Control, Engine, EngineError, GenerateOutput, GenerateRequest, Progress, RgbImage, Sampler,
};

fn engine() -> CandleEngine {
    let (dev, dtype) = (&test_device().device, test_device().dtype);
    let model = SdModel::from_diffusers_dir("sd1", &fixtures().join("models").join("sd1"), dev, dtype)
        .unwrap_or_else(|e| panic!("loading fixture model sd1: {e}"));
    CandleEngine::from_model(model, LoadOptions::single_device(dev, dtype, "test", &test_device().label))
}

/// A queue whose requests become available to join once the batch's first request has reported `after` steps.
struct Script {
    waiting: Vec<(u32, usize, GenerateRequest)>,
    /// Token → what happened to it, in order: ("step", n) reports and ("done", images).
    log: Vec<(usize, &'static str, u32)>,
    results: Vec<(usize, Result<GenerateOutput, EngineError>)>,
    first_steps: u32,
    /// Images of each denoising step.
    steps: Vec<u32>,
    /// Token and step of every report that carried a preview.
    previews: Vec<(usize, u32)>,
    cancel: Option<(usize, u32)>,
}

impl Script {
    fn new(waiting: Vec<(u32, usize, GenerateRequest)>) -> Self {
        Script {
            waiting,
            log: Vec::new(),
            results: Vec::new(),
            first_steps: 0,
            steps: Vec::new(),
            previews: Vec::new(),
            cancel: None,
        }
    }

    fn images(&self, token: usize) -> Vec<RgbImage> {
        match self.results.iter().find(|(t, _)| *t == token) {
            Some((_, Ok(out))) => out.images.iter().map(|i| i.image.clone()).collect(),
            Some((_, Err(e))) => panic!("request {token} failed: {e}"),
            None => panic!("request {token} never finished"),
        }
    }
}

impl BatchFeed for Script {
    fn join(&mut self, images: u32) -> Vec<(usize, GenerateRequest)> {
        let mut out = Vec::new();
        let mut left = images;
        while let Some(at) =
            self.waiting.iter().position(|(after, _, r)| *after <= self.first_steps && r.n <= left)
        {
            let (_, token, r) = self.waiting.remove(at);
            left -= r.n;
            out.push((token, r));
        }
        out
    }

    fn progress(&mut self, token: usize, p: &Progress) -> Control {
        if token == 0 {
            self.first_steps = p.step;
        }
        self.log.push((token, "step", p.step));
        if p.preview.is_some() {
            self.previews.push((token, p.step));
        }
        match self.cancel {
            Some((t, step)) if t == token && p.step >= step => Control::Cancel,
            _ => Control::Continue,
        }
    }

    fn finished(&mut self, token: usize, result: Result<GenerateOutput, EngineError>) {
        self.log.push((token, "done", result.as_ref().map_or(0, |o| o.images.len() as u32)));
        self.results.push((token, result));
    }

    fn denoised(&mut self, images: u32) {
        self.steps.push(images);
    }
}

fn steps(r: GenerateRequest, steps: u32) -> GenerateRequest {
    GenerateRequest { steps, ..r }
}

#[test]
fn requests_joining_mid_run_equal_their_images_alone_and_leave_when_done() {
    let mut engine = engine();
    let first = steps(req("the first", 1, 7.0, 1, Sampler::EulerA), 6);
    // Its previews come back behind the next step (on a GPU): its reports must still arrive in order, before it
    // ends.
    let second =
        GenerateRequest { preview_every: 2, ..steps(req("joins at step 2", 2, 4.0, 1, Sampler::EulerA), 6) };
    let third = GenerateRequest {
        negative_prompt: "blurry".into(),
        ..steps(req("two images, joining at step 4", 3, 9.0, 2, Sampler::EulerA), 6)
    };
    let want: Vec<Vec<RgbImage>> = [&first, &second, &third].iter().map(|r| alone(&mut engine, r)).collect();
    let mut feed = Script::new(vec![(2, 1, second), (4, 2, third)]);
    engine.generate_joined(vec![(0, first)], 8, &mut feed);
    for (token, want) in want.iter().enumerate() {
        assert_same(&format!("request {token}"), &feed.images(token), want);
    }
    // The first leaves after its sixth step, while the others still run: nobody waits for the batch's end.
    let done_at = |token: usize| feed.log.iter().position(|e| *e == (token, "done", e.2)).expect("finished");
    let second_steps_after_first = feed.log[done_at(0)..].iter().filter(|e| **e == (1, "step", e.2)).count();
    assert_eq!(second_steps_after_first, 2, "the second ran its last two steps after the first left");
    assert!(
        done_at(0) < done_at(1) && done_at(1) < done_at(2),
        "each request left when done: {:?}",
        feed.log
    );
    for token in 0..3 {
        let reports: Vec<u32> =
            feed.log[..done_at(token)].iter().filter(|e| e.0 == token).map(|e| e.2).collect();
        assert_eq!(reports, (1..=6).collect::<Vec<_>>(), "request {token}'s reports before its end");
    }
    assert_eq!(feed.previews, [(1, 2), (1, 4), (1, 6)], "the second request's previews");
    // Steps 1–2 alone, 3–4 with the second, 5–6 with all four images, then the two that joined last.
    assert_eq!(feed.steps, vec![1, 1, 2, 2, 4, 4, 3, 3, 2, 2], "images per step");
    assert_ne!(feed.images(0)[0].data, feed.images(1)[0].data, "the fixture requests give the same image");
}

#[test]
fn newcomers_wait_for_a_free_lane_and_one_cancelled_mid_run_ends_alone() {
    let mut engine = engine();
    let first = steps(req("the first", 1, 7.0, 1, Sampler::DpmPp2M), 5);
    let second = steps(req("cancelled", 2, 7.0, 1, Sampler::DpmPp2M), 5);
    let third = steps(req("waits for a lane", 3, 5.0, 1, Sampler::DpmPp2M), 5);
    let bad = GenerateRequest { width: Some(60), ..steps(req("bad size", 4, 7.0, 1, Sampler::DpmPp2M), 5) };
    let want: Vec<Vec<RgbImage>> = [&first, &third].iter().map(|r| alone(&mut engine, r)).collect();
    let mut feed = Script::new(vec![(1, 1, second), (1, 3, bad), (1, 2, third)]);
    feed.cancel = Some((1, 2));
    engine.generate_joined(vec![(0, first)], 2, &mut feed);
    assert!(feed.steps.iter().all(|&n| n <= 2), "more images than lanes: {:?}", feed.steps);
    match feed.results.iter().find(|(t, _)| *t == 1) {
        Some((_, Err(EngineError::Cancelled { done }))) => assert!(done.is_empty()),
        other => {
            panic!("the cancelled request ended {:?}", other.map(|(_, r)| r.as_ref().map(|o| o.images.len())))
        }
    }
    assert_eq!(
        feed.log.iter().filter(|e| e.0 == 1 && e.1 == "step").count(),
        2,
        "asked no more after its cancel"
    );
    match feed.results.iter().find(|(t, _)| *t == 3) {
        Some((_, Err(EngineError::Invalid(v)))) => assert_eq!(v.field, "width"),
        other => {
            panic!("the 60-wide request ended {:?}", other.map(|(_, r)| r.as_ref().map(|o| o.images.len())))
        }
    }
    assert_same("first", &feed.images(0), &want[0]);
    assert_same("the one that waited", &feed.images(2), &want[1]);
}

/// A warmed-up engine (a batching worker's, whose thread records every batch size's step) gives requests joining
/// mid-run the images they get alone; on a GPU its batched steps replay from recordings.
#[test]
fn a_warmed_engine_gives_joiners_their_images_alone() {
    let mut engine = engine();
    let first = steps(req("the first", 1, 7.0, 1, Sampler::EulerA), 6);
    let second = steps(req("joins at step 2", 2, 4.0, 2, Sampler::EulerA), 6);
    let third = steps(req("joins at step 3", 3, 9.0, 1, Sampler::EulerA), 6);
    let want: Vec<Vec<RgbImage>> = [&first, &second, &third].iter().map(|r| alone(&mut engine, r)).collect();
    engine.warm_up(4);
    let mut feed = Script::new(vec![(2, 1, second), (3, 2, third)]);
    engine.generate_joined(vec![(0, first)], 4, &mut feed);
    for (token, want) in want.iter().enumerate() {
        assert_same(&format!("request {token}"), &feed.images(token), want);
    }
    assert_eq!(feed.steps, vec![1, 1, 3, 4, 4, 4, 3, 3, 1], "images per step");
    let (recorded, refused) = engine.model.unet.with(|u| u.graph_status()).unwrap();
    eprintln!("UNet recordings: {recorded}, refused: {refused:?}");
}
