//! Memory planning for a job, shared by both engines: an estimate of what a request needs on the device beyond
//! the resident weights (UNet or MMDiT activations and attention scores for the CFG batch, the VAE decode), checked
//! against the device's free memory. The plan turns on VAE tiling or attention slicing when the plain run would
//! not fit, and refuses the job — with the amount it needs — when even those would not. The estimates are upper
//! bounds from the architectures' shapes (live feature maps per latent pixel or per token, the largest
//! attention-score matrix and the VAE's full-resolution block and mid-block attention), not measurements.

use serde::Serialize;
use thiserror::Error;

/// What the planner needs to know about a loaded model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ModelShape {
    /// Bytes of weights resident on the device.
    pub weights_bytes: u64,
    /// Bytes per activation value (2 for f16/bf16, 4 for f32).
    pub activation_bytes: u64,
    /// The VAE's downsampling factor (8 for every SD family).
    pub vae_factor: u32,
    /// Number of the first UNet level with attention (0: SD1/SD2; 1: SDXL) and its head count.
    pub first_attention_level: u32,
    pub heads_at_first_attention: u32,
    /// Whether the engine computes attention without materialising the score matrix.
    pub fused_attention: bool,
    /// The most attention-score elements the engine materialises at once (it splits the queries beyond that);
    /// `None` when it builds the whole matrix.
    pub score_chunk_elements: Option<u64>,
    /// Latent pixels a side of one VAE tile when the engine decodes in tiles.
    pub vae_tile_latent: u64,
    /// An SD3-family MMDiT in place of a UNet (the attention level and heads above are then unused).
    pub mmdit: Option<MmditShape>,
}

/// What the planner needs of an MMDiT: one attention over the image's patch tokens and the text tokens joined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MmditShape {
    /// The transformer's width and attention heads.
    pub hidden: u32,
    pub heads: u32,
    /// Latent pixels a side of one patch token.
    pub patch: u32,
    /// Text tokens joined to the image's (77 of CLIP + T5's).
    pub context_tokens: u32,
}

/// The text tokens an SD3 MMDiT attends with the image's, as diffusers and the candle engine build the joint
/// context: CLIP's 77 and T5's 256 (zeros when T5 is left out).
pub const SD3_CONTEXT_TOKENS: u32 = 77 + 256;

/// Live MMDiT activations, in widths per token per image: the image and text residual streams, the normed and
/// modulated input, q, k and v and a second set of them in MMDiT-X's dual-attention blocks, the attention output,
/// and the MLP's 4× hidden before and after its GELU.
const MMDIT_WIDTHS_PER_TOKEN: u64 = 2 + 1 + 6 + 1 + 8;

/// Live UNet feature maps, in channel-equivalents per latent pixel per image: the skip connections kept for the
/// up path (≈1,700 for SD1.5's 320/640/1280 levels), the widest working tensors of the full-resolution up
/// block (concatenations, norms, conv outputs), and the im2col buffer both engines' 3×3 convolutions build there
/// (640 concatenated input channels × 9 = 5,760).
const UNET_CHANNELS_PER_LATENT_PIXEL: u64 = 3_000 + 5_760;
/// The VAE decoder's full-resolution block per output pixel: a 256-channel upsampled input, its normed copy and
/// the 128-channel conv output alive together, plus the im2col buffer of its first 3×3 convolution
/// (256 input channels × 9 = 2,304).
const VAE_CHANNELS_PER_PIXEL: u64 = 640 + 2_304;
/// Attention slicing computes the score matrix in this many query chunks at most.
pub const ATTENTION_SLICES: u64 = 16;
/// Headroom kept free for allocator fragmentation and driver buffers.
const MARGIN_BYTES: u64 = 512 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct JobPlan {
    /// Decode the VAE in tiles (bounded memory, slight seams possible).
    pub vae_tiling: bool,
    /// Compute attention scores in query chunks.
    pub attention_slicing: bool,
    /// Estimated device memory the job needs beyond the weights.
    pub activation_bytes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error(
    "a {width}×{height} job needs about {} MiB of device memory beyond the model's weights, but {} MiB are free; \
     use a smaller size or fewer images per request",
    needed_bytes >> 20,
    available_bytes >> 20
)]
pub struct InsufficientMemory {
    pub width: u32,
    pub height: u32,
    pub needed_bytes: u64,
    pub available_bytes: u64,
}

impl ModelShape {
    fn unet_bytes(&self, width: u32, height: u32, batch: u64, slicing: bool) -> u64 {
        let f = u64::from(self.vae_factor.max(1));
        let latent_pixels = (u64::from(width) / f) * (u64::from(height) / f);
        let (maps, tokens, heads) = match self.mmdit {
            None => (
                UNET_CHANNELS_PER_LATENT_PIXEL * latent_pixels * batch * self.activation_bytes,
                latent_pixels >> (2 * self.first_attention_level),
                u64::from(self.heads_at_first_attention),
            ),
            Some(m) => {
                let patch = u64::from(m.patch.max(1));
                let tokens = latent_pixels / (patch * patch) + u64::from(m.context_tokens);
                let maps =
                    MMDIT_WIDTHS_PER_TOKEN * u64::from(m.hidden) * tokens * batch * self.activation_bytes;
                (maps, tokens, u64::from(m.heads))
            }
        };
        if self.fused_attention {
            return maps;
        }
        let scores = self.score_bytes(batch * heads * tokens * tokens);
        maps + if slicing { scores.div_ceil(ATTENTION_SLICES) } else { scores }
    }

    /// Bytes of the attention scores alive at once for a score matrix of `elements`, counted in f32 (the softmax
    /// of both engines' unfused paths may upcast).
    fn score_bytes(&self, elements: u64) -> u64 {
        self.score_chunk_elements.map_or(elements, |cap| elements.min(cap)) * 4
    }

    fn vae_bytes(&self, width: u32, height: u32, tiled: bool) -> u64 {
        let f = u64::from(self.vae_factor.max(1));
        let (w, h) = if tiled {
            let side = self.vae_tile_latent * f;
            (side.min(u64::from(width)), side.min(u64::from(height)))
        } else {
            (u64::from(width), u64::from(height))
        };
        let maps = VAE_CHANNELS_PER_PIXEL * w * h * self.activation_bytes;
        let mid_tokens = (w / f) * (h / f);
        maps + self.score_bytes(mid_tokens * mid_tokens)
    }

    /// Plans a job of `images_per_call` images (2 with classifier-free guidance) at `width`×`height`, given the
    /// device's free memory now (weights already resident). Unknown free memory plans the plain run.
    pub fn plan(
        &self,
        width: u32,
        height: u32,
        images_per_call: u64,
        free_bytes: Option<u64>,
        can_slice_attention: bool,
        can_tile_vae: bool,
    ) -> Result<JobPlan, InsufficientMemory> {
        let plain = JobPlan {
            vae_tiling: false,
            attention_slicing: false,
            activation_bytes: self
                .unet_bytes(width, height, images_per_call, false)
                .max(self.vae_bytes(width, height, false)),
        };
        let Some(free) = free_bytes else { return Ok(plain) };
        let available = free.saturating_sub(MARGIN_BYTES);
        if plain.activation_bytes <= available {
            return Ok(plain);
        }
        // The UNet and the VAE run one after the other, so the job needs the larger of the two.
        let mut best = plain;
        for (slicing, tiling) in [(false, true), (true, false), (true, true)] {
            if (slicing && !can_slice_attention) || (tiling && !can_tile_vae) {
                continue;
            }
            let need = self
                .unet_bytes(width, height, images_per_call, slicing)
                .max(self.vae_bytes(width, height, tiling));
            let candidate =
                JobPlan { vae_tiling: tiling, attention_slicing: slicing, activation_bytes: need };
            if need <= available {
                return Ok(candidate);
            }
            best = if need < best.activation_bytes { candidate } else { best };
        }
        Err(InsufficientMemory {
            width,
            height,
            needed_bytes: best.activation_bytes + MARGIN_BYTES,
            available_bytes: free,
        })
    }
}

/// Free memory as a planner sees it: the device's, capped by what an operator's budget (the most the worker may
/// use, weights included) leaves beside the resident weights. Either may be unknown.
pub fn budgeted_free(free: Option<u64>, budget: Option<u64>, weights_bytes: u64) -> Option<u64> {
    let left = budget.map(|b| b.saturating_sub(weights_bytes));
    match (free, left) {
        (Some(f), Some(l)) => Some(f.min(l)),
        (f, l) => f.or(l),
    }
}

/// What `/v1/info` shows about memory: the resident weights, the device's memory at load, and the plan for a
/// job at the model's native size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemoryReport {
    pub weights_bytes: u64,
    pub device_total_bytes: Option<u64>,
    pub device_free_bytes: Option<u64>,
    pub native_job: Option<JobPlan>,
    /// What the engine may do when a job does not fit as is.
    pub vae_tiling_available: bool,
    pub attention_slicing_available: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn sd15_f16() -> ModelShape {
        ModelShape {
            weights_bytes: 2 * GIB,
            activation_bytes: 2,
            vae_factor: 8,
            first_attention_level: 0,
            heads_at_first_attention: 8,
            fused_attention: false,
            score_chunk_elements: None,
            vae_tile_latent: 32,
            mmdit: None,
        }
    }

    #[test]
    fn mmdit_estimates_count_patch_and_text_tokens() {
        // SD3.5-medium in bf16 at 1024²: 64² patch tokens + 333 text tokens, width 1536, 24 heads, CFG batch 2.
        let medium = MmditShape { hidden: 1536, heads: 24, patch: 2, context_tokens: 333 };
        let m = ModelShape { mmdit: Some(medium), ..sd15_f16() };
        let tokens = 4096 + 333;
        let maps = MMDIT_WIDTHS_PER_TOKEN * 1536 * tokens * 2 * 2;
        assert_eq!(m.unet_bytes(1024, 1024, 2, false), maps + 2 * 24 * tokens * tokens * 4);
        assert_eq!(m.unet_bytes(1024, 1024, 2, true), maps + (2 * 24 * tokens * tokens * 4).div_ceil(16));
        let fused = ModelShape { fused_attention: true, ..m };
        assert_eq!(fused.unet_bytes(1024, 1024, 2, false), maps);
        // The UNet's fields do not enter an MMDiT's estimate.
        let other = ModelShape { first_attention_level: 1, heads_at_first_attention: 10, ..m };
        assert_eq!(other.unet_bytes(1024, 1024, 2, false), m.unet_bytes(1024, 1024, 2, false));
    }

    #[test]
    fn estimates_follow_the_shapes() {
        let m = sd15_f16();
        let (u, v) = (UNET_CHANNELS_PER_LATENT_PIXEL, VAE_CHANNELS_PER_PIXEL);
        // 512², CFG batch 2: scores 2·8·4096²·4 B = 1 GiB dominate the UNet; maps u·4096·2·2 B.
        assert_eq!(m.unet_bytes(512, 512, 2, false), u * 4096 * 2 * 2 + GIB);
        assert_eq!(m.unet_bytes(512, 512, 2, true), u * 4096 * 2 * 2 + GIB / 16);
        // VAE 512²: v·512²·2 B + (64²)²·4 B.
        assert_eq!(m.vae_bytes(512, 512, false), v * 512 * 512 * 2 + 4096 * 4096 * 4);
        // Tiles are 256² pixels whatever the image size.
        assert_eq!(m.vae_bytes(2048, 2048, true), m.vae_bytes(256, 256, false));
        let xl = ModelShape { first_attention_level: 1, heads_at_first_attention: 10, ..m };
        assert_eq!(xl.unet_bytes(1024, 1024, 2, false), u * 16384 * 2 * 2 + 2 * 10 * 4096 * 4096 * 4);
        let fused = ModelShape { fused_attention: true, ..m };
        assert_eq!(fused.unet_bytes(512, 512, 2, false), u * 4096 * 2 * 2);
        // An engine that splits the queries holds at most one chunk of scores, sliced or not smaller still.
        let chunked = ModelShape { score_chunk_elements: Some(1 << 27), ..m };
        assert_eq!(chunked.unet_bytes(512, 512, 2, false), u * 4096 * 2 * 2 + (1 << 29));
        assert_eq!(chunked.unet_bytes(512, 512, 2, true), u * 4096 * 2 * 2 + (1 << 25));
        assert_eq!(chunked.vae_bytes(2048, 2048, false), v * 2048 * 2048 * 2 + (1 << 29));
        // The tile size is the engine's: 64-latent tiles hold 4× the pixels of 32-latent ones.
        let big_tiles = ModelShape { vae_tile_latent: 64, ..m };
        assert_eq!(big_tiles.vae_bytes(2048, 2048, true), m.vae_bytes(512, 512, false));
    }

    #[test]
    fn budgets_cap_free_memory_beside_the_weights() {
        assert_eq!(budgeted_free(Some(10 * GIB), None, GIB), Some(10 * GIB));
        assert_eq!(budgeted_free(Some(10 * GIB), Some(4 * GIB), GIB), Some(3 * GIB));
        assert_eq!(budgeted_free(Some(GIB), Some(4 * GIB), GIB), Some(GIB));
        assert_eq!(budgeted_free(None, Some(4 * GIB), GIB), Some(3 * GIB));
        assert_eq!(budgeted_free(None, Some(GIB / 2), GIB), Some(0));
        assert_eq!(budgeted_free(None, None, GIB), None);
    }

    #[test]
    fn plans_escalate_then_refuse() {
        let m = sd15_f16();
        let plain = m.plan(512, 512, 2, Some(80 * GIB), true, true).unwrap();
        assert!(!plain.vae_tiling && !plain.attention_slicing);
        assert_eq!(m.plan(512, 512, 2, None, true, true).unwrap(), plain);
        // 2048²: the VAE's mid-block attention alone is (256²)²·4 B = 16 GiB; scores 2·8·65536²·4 B = 256 GiB.
        // With 48 GiB free, sliced attention (16 GiB of scores) and the plain VAE (~39 GiB) fit; with 20 GiB
        // the VAE must be tiled too.
        let roomy = m.plan(2048, 2048, 2, Some(48 * GIB), true, true).unwrap();
        assert!(!roomy.vae_tiling && roomy.attention_slicing, "{roomy:?}");
        let big = m.plan(2048, 2048, 2, Some(20 * GIB), true, true).unwrap();
        assert!(big.vae_tiling && big.attention_slicing, "{big:?}");
        let refused = m.plan(2048, 2048, 2, Some(4 * GIB), true, true).unwrap_err();
        assert!(refused.needed_bytes > 4 * GIB && refused.available_bytes == 4 * GIB);
        assert!(refused.to_string().contains("2048×2048 job needs about"), "{refused}");
        // Without the remedies the same job is refused, naming what the plain run needs.
        let err = m.plan(2048, 2048, 2, Some(40 * GIB), false, false).unwrap_err();
        assert!(err.needed_bytes > 256 * GIB);
    }
}
