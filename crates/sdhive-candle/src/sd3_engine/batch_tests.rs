//! Batched SD3 images equal the images each request gets alone (the SD1/SDXL batch tests' checks, on the SD3
//! fixtures): mixed prompts, negative prompts, seeds, CFG scales and clip skips, chunks smaller than the batch,
//! DPM++ 2M's multistep state per row, unguided rows, SD3.5's dual-attention MMDiT, a cancel of one request inside
//! a batch that leaves the others' images as they were, and a request the model cannot run failing alone.

use super::Sd3Engine;
use crate::engine::batch::tests::{check_bad_size_on, check_batch_on, check_cancel_on, req};
use crate::sd3_tests::load_model;
use crate::test_device::test_device;
use sdhive_engine::{GenerateRequest, Sampler};

fn engine(model: &str) -> Sd3Engine {
    Sd3Engine::from_model(load_model(model), model, test_device().dtype, ("test", &test_device().label))
}

fn small(r: GenerateRequest) -> GenerateRequest {
    GenerateRequest { steps: 3, ..r }
}

#[test]
fn sd3_mixed_prompts_seeds_and_scales_equal_their_images_alone() {
    let reqs = [
        small(req("a red cube", 1, 7.0, 2, Sampler::Euler)),
        GenerateRequest {
            negative_prompt: "blurry".into(),
            clip_skip: 2,
            ..small(req("a blue ball", 5, 3.5, 1, Sampler::Euler))
        },
        small(req("a green cone", 2, 9.0, 1, Sampler::Euler)),
    ];
    check_batch_on(&mut engine("sd3"), "sd3", &reqs, 8);
}

#[test]
fn sd3_chunks_smaller_than_the_batch_with_dpm_and_unguided_rows() {
    let mut engine = engine("sd3");
    let reqs =
        [small(req("one", 3, 7.0, 3, Sampler::DpmPp2M)), small(req("two", 4, 5.0, 2, Sampler::DpmPp2M))];
    check_batch_on(&mut engine, "sd3", &reqs, 2);
    let reqs = [small(req("one", 3, 1.0, 1, Sampler::Euler)), small(req("two", 4, 1.0, 2, Sampler::Euler))];
    check_batch_on(&mut engine, "sd3", &reqs, 8);
}

#[test]
fn sd35_medium_rows_equal_their_images_alone() {
    let reqs = [
        small(req("a red cube", 1, 7.0, 1, Sampler::Euler)),
        small(req("a blue ball", 6, 4.0, 2, Sampler::Euler)),
    ];
    check_batch_on(&mut engine("sd35m"), "sd35m", &reqs, 8);
}

#[test]
fn sd3_cancelling_one_request_leaves_the_others_as_alone() {
    check_cancel_on(&mut engine("sd3"), Sampler::Euler);
}

#[test]
fn sd3_a_request_the_model_cannot_run_fails_alone() {
    check_bad_size_on(&mut engine("sd3"), 72, Sampler::Euler);
}
