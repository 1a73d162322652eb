//! Batched images equal the images each request gets alone: mixed prompts, negative prompts, seeds, CFG scales
//! and prompt lengths, chunks smaller than the batch, ancestral and multistep samplers, SDXL's added
//! conditioning, and a cancel of one request inside a batch that leaves the others' images as they were.

use super::super::{CandleEngine, LoadOptions};
use crate::model::SdModel;
use crate::parity_tests::fixtures;
use crate::test_device::test_device;
use sdhive_engine::{Control, Engine, EngineError, GenerateRequest, Progress, RgbImage, Sampler};

fn engine(name: &str) -> CandleEngine {
    let (dev, dtype) = (&test_device().device, test_device().dtype);
    let model = SdModel::from_diffusers_dir(name, &fixtures().join("models").join(name), dev, dtype)
        .unwrap_or_else(|e| panic!("loading fixture model {name}: {e}"));
    CandleEngine::from_model(model, LoadOptions::single_device(dev, dtype, "test", &test_device().label))
}

pub(crate) fn req(prompt: &str, seed: u64, cfg_scale: f32, n: u32, sampler: Sampler) -> GenerateRequest {
    GenerateRequest {
        prompt: prompt.into(),
        negative_prompt: String::new(),
        steps: 4,
        cfg_scale,
        width: Some(64),
        height: Some(64),
        seed: Some(seed),
        n,
        sampler,
        ..GenerateRequest::default()
    }
}

pub(crate) fn alone(engine: &mut dyn Engine, r: &GenerateRequest) -> Vec<RgbImage> {
    let out = engine.generate(r, &mut |_: &Progress| Control::Continue).expect("generate alone");
    out.images.into_iter().map(|i| i.image).collect()
}

/// Images of one request within the parity tests' tolerance: on the CPU in f32 no channel value more than one
/// level off (a batch's products sum in another order, so the last bit of a value may differ), else the parity
/// tests' share of channel values more than one level off.
pub(crate) fn assert_same(what: &str, got: &[RgbImage], want: &[RgbImage]) {
    assert_eq!(got.len(), want.len(), "{what}: image count");
    let cpu_f32 = test_device().device.is_cpu() && test_device().dtype == candle_core::DType::F32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!((g.width, g.height), (w.width, w.height), "{what} image {i}: size");
        let off = g.data.iter().zip(&w.data).filter(|(a, b)| a.abs_diff(**b) > 1).count();
        let max = g.data.iter().zip(&w.data).map(|(a, b)| a.abs_diff(*b)).max().unwrap_or(0);
        if cpu_f32 {
            assert!(max <= 1, "{what} image {i}: batched differs from alone by up to {max} levels");
        } else {
            let share = off as f32 / g.data.len() as f32;
            assert!(
                share <= test_device().tolerance.pixels_off,
                "{what} image {i}: {:.3}% of values more than one level off (max {max})",
                share * 100.0
            );
        }
    }
}

fn check_batch(model: &str, reqs: &[GenerateRequest], max_images: u32) {
    check_batch_on(&mut engine(model), model, reqs, max_images);
}

/// `reqs` batched on `engine` (chunks of `max_images`) give each request the images it gets alone, and every
/// request hears of every step.
pub(crate) fn check_batch_on(
    engine: &mut dyn Engine,
    model: &str,
    reqs: &[GenerateRequest],
    max_images: u32,
) {
    let want: Vec<Vec<RgbImage>> = reqs.iter().map(|r| alone(engine, r)).collect();
    let refs: Vec<&GenerateRequest> = reqs.iter().collect();
    let mut reports = vec![0u32; reqs.len()];
    let results = engine.generate_batch(&refs, max_images, &mut |i, _| {
        reports[i] += 1;
        Control::Continue
    });
    for (i, (result, want)) in results.into_iter().zip(&want).enumerate() {
        let got: Vec<RgbImage> = result.expect("batched").images.into_iter().map(|i| i.image).collect();
        assert_same(&format!("{model} request {i}"), &got, want);
        assert!(reports[i] >= reqs[i].steps, "request {i} reported {} steps", reports[i]);
    }
    // Different seeds and prompts must give different images, or the comparison proves nothing.
    assert_ne!(want[0][0].data, want[1][0].data, "the fixture requests give the same image");
}

#[test]
fn mixed_prompts_seeds_and_scales_equal_their_images_alone() {
    let long = "a long prompt ".repeat(30);
    let reqs = [
        req("a red cube", 1, 7.0, 2, Sampler::EulerA),
        GenerateRequest {
            negative_prompt: "blurry".into(),
            clip_skip: 2,
            ..req("a blue ball", 5, 3.5, 1, Sampler::EulerA)
        },
        // Two 77-token chunks: a context of its own length, run as its own group.
        req(&long, 9, 7.0, 1, Sampler::EulerA),
        req("a green cone", 2, 9.0, 1, Sampler::EulerA),
    ];
    check_batch("sd1", &reqs, 8);
}

#[test]
fn chunks_smaller_than_the_batch_and_a_multistep_sampler() {
    let reqs = [req("one", 3, 7.0, 3, Sampler::DpmPp2M), req("two", 4, 5.0, 2, Sampler::DpmPp2M)];
    check_batch("sd1", &reqs, 2);
}

#[test]
fn unguided_rows() {
    let reqs = [req("one", 3, 1.0, 1, Sampler::Euler), req("two", 4, 1.0, 2, Sampler::Euler)];
    check_batch("sd1", &reqs, 8);
}

#[test]
fn sdxl_added_conditioning_per_row() {
    let reqs =
        [req("a red cube", 1, 7.0, 1, Sampler::EulerA), req("a blue ball", 6, 4.0, 2, Sampler::EulerA)];
    check_batch("sdxl", &reqs, 8);
}

#[test]
fn cancelling_one_request_leaves_the_others_as_alone() {
    check_cancel_on(&mut engine("sd1"), Sampler::EulerA);
}

/// Three requests batched on `engine`, the second (two images) cancelled at its second step: it is asked no more
/// and ends with no image, the others get their images alone.
pub(crate) fn check_cancel_on(engine: &mut dyn Engine, sampler: Sampler) {
    let reqs = [
        req("kept", 11, 7.0, 1, sampler),
        req("cancelled", 12, 7.0, 2, sampler),
        req("kept too", 13, 6.0, 1, sampler),
    ];
    let want: Vec<Vec<RgbImage>> = [&reqs[0], &reqs[2]].iter().map(|r| alone(engine, r)).collect();
    let refs: Vec<&GenerateRequest> = reqs.iter().collect();
    let mut after_cancel = 0;
    let results = engine.generate_batch(&refs, 8, &mut |i, p| {
        if i == 1 && p.step >= 2 {
            after_cancel += 1;
            return Control::Cancel;
        }
        Control::Continue
    });
    assert_eq!(after_cancel, 1, "a cancelled request is asked no more");
    let mut results = results.into_iter();
    let first = results.next().expect("three results").expect("first kept");
    match results.next().expect("three results") {
        Err(EngineError::Cancelled { done }) => assert!(done.is_empty(), "its two images ran together"),
        other => panic!("the cancelled request ended {:?}", other.map(|o| o.images.len())),
    }
    let third = results.next().expect("three results").expect("third kept");
    assert_same("kept", &first.images.into_iter().map(|i| i.image).collect::<Vec<_>>(), &want[0]);
    assert_same("kept too", &third.images.into_iter().map(|i| i.image).collect::<Vec<_>>(), &want[1]);
}

#[test]
fn a_request_the_model_cannot_run_fails_alone() {
    check_bad_size_on(&mut engine("sd1"), 60, Sampler::EulerA);
}

/// A `width`-wide request the model cannot run, batched before a good one on `engine`, fails naming `width`;
/// the good one gets its image alone.
pub(crate) fn check_bad_size_on(engine: &mut dyn Engine, width: u32, sampler: Sampler) {
    let good = req("fine", 1, 7.0, 1, sampler);
    let bad = GenerateRequest { width: Some(width), ..req("bad size", 2, 7.0, 1, sampler) };
    let want = alone(engine, &good);
    let results = engine.generate_batch(&[&bad, &good], 8, &mut |_, _| Control::Continue);
    match &results[0] {
        Err(EngineError::Invalid(v)) => assert_eq!(v.field, "width"),
        other => panic!("the {width}-wide request ended {:?}", other.as_ref().map(|o| o.images.len())),
    }
    let got = results.into_iter().nth(1).expect("two results").expect("the good one runs");
    assert_same("good", &got.images.into_iter().map(|i| i.image).collect::<Vec<_>>(), &want);
}
