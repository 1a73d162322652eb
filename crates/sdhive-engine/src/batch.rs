//! Which requests can be denoised together: the [`BatchKey`] of a request names everything that shapes the UNet's
//! calls (size, steps, sampler, schedule, whether CFG runs, the LoRA weights merged into the network), so requests
//! with equal keys differ only in what each batch row carries on its own (prompt, negative prompt, seed, CFG scale,
//! clip skip, embeddings). An engine that batches runs such requests as one batch and each image equals the image
//! its request gets alone.

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

    #[test]
    fn image_jobs_run_alone() {
        let img = RgbImage { width: 8, height: 8, data: vec![0; 192] };
        assert!(GenerateRequest { init_image: Some(img), ..req() }.batch_key().is_none());
        let slg = Some(crate::request::SkipLayerGuidance::with_layers(vec![7]));
        assert!(GenerateRequest { skip_layer_guidance: slg, ..req() }.batch_key().is_none());
    }
}
