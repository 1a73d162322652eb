//! The latent autoencoder: diffusers `AutoencoderKL` (encoder to a diagonal Gaussian, decoder
//! back to pixels) built from `vae/config.json` and diffusers weight names.

use crate::config::{check_act, check_divides, read_json, IntOrList};
use crate::error::{check_latent, input_err, invalid, weights_err, Result, TensorContext};
use crate::graphed::{Graphs, Refresh};
use crate::layers::{
    conv2d_nchw, linear, Conv2d, Downsample2D, EdgeConv, GroupNorm, ResnetBlock2D, ResnetSpec, Upsample2D,
};
use crate::ops::{self, ConvExtras, MapLayout};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Linear, VarBuilder};
use serde::{Deserialize, Serialize};
use std::path::Path;

const MODEL: &str = "vae";

/// The encoder/decoder resnets' eps, fixed in diffusers whatever the config says.
const VAE_EPS: f64 = 1e-6;

/// `vae/config.json` with diffusers' `AutoencoderKL` defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AutoencoderKLConfig {
    pub in_channels: usize,
    pub out_channels: usize,
    pub down_block_types: Vec<String>,
    pub up_block_types: Vec<String>,
    pub block_out_channels: Vec<usize>,
    pub layers_per_block: usize,
    pub act_fn: String,
    pub latent_channels: usize,
    pub norm_num_groups: usize,
    pub scaling_factor: f64,
    pub shift_factor: Option<f64>,
    pub latents_mean: Option<Vec<f64>>,
    pub latents_std: Option<Vec<f64>>,
    pub force_upcast: bool,
    pub use_quant_conv: bool,
    pub use_post_quant_conv: bool,
    pub mid_block_add_attention: bool,
    /// The image side the VAE was trained at (an int, or a list of which diffusers reads the first); it sets
    /// the tile size of tiled decoding.
    pub sample_size: IntOrList,
}

impl Default for AutoencoderKLConfig {
    fn default() -> Self {
        Self {
            in_channels: 3,
            out_channels: 3,
            down_block_types: vec!["DownEncoderBlock2D".into()],
            up_block_types: vec!["UpDecoderBlock2D".into()],
            block_out_channels: vec![64],
            layers_per_block: 1,
            act_fn: "silu".into(),
            latent_channels: 4,
            norm_num_groups: 32,
            scaling_factor: 0.18215,
            shift_factor: None,
            latents_mean: None,
            latents_std: None,
            force_upcast: true,
            use_quant_conv: true,
            use_post_quant_conv: true,
            mid_block_add_attention: true,
            sample_size: IntOrList::Int(32),
        }
    }
}

impl AutoencoderKLConfig {
    /// diffusers' `tile_latent_min_size`: the latent side of one tile when decoding in tiles.
    pub fn tile_latent_size(&self) -> usize {
        let factor = 1usize << self.block_out_channels.len().saturating_sub(1);
        (self.tile_sample_size() / factor).max(1)
    }

    /// diffusers' `tile_sample_min_size`: `sample_size`, or its first entry when it is a list.
    pub fn tile_sample_size(&self) -> usize {
        match &self.sample_size {
            IntOrList::Int(v) => *v,
            IntOrList::List(v) => v.first().copied().unwrap_or(32),
        }
    }

    /// Reads and validates `vae/config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let cfg: Self = read_json(path)?;
        cfg.validate(&path.display().to_string())?;
        Ok(cfg)
    }

    pub fn validate(&self, origin: &str) -> Result<()> {
        let n = self.block_out_channels.len();
        if n == 0 {
            return Err(invalid(origin, "block_out_channels", "is empty"));
        }
        check_act(origin, "act_fn", &self.act_fn)?;
        for (field, types, expect) in [
            ("down_block_types", &self.down_block_types, "DownEncoderBlock2D"),
            ("up_block_types", &self.up_block_types, "UpDecoderBlock2D"),
        ] {
            if types.len() != n {
                return Err(invalid(
                    origin,
                    field,
                    format!("has {} entries, block_out_channels has {n}", types.len()),
                ));
            }
            if let Some(t) = types.iter().find(|t| t.as_str() != expect) {
                return Err(invalid(
                    origin,
                    field,
                    format!("block type `{t}` is not supported (only {expect})"),
                ));
            }
        }
        for &c in &self.block_out_channels {
            check_divides(origin, "norm_num_groups", self.norm_num_groups, c)?;
        }
        Ok(())
    }
}

/// The public SD1.x/SD2.x `vae/config.json`.
pub fn sd15_vae_config() -> AutoencoderKLConfig {
    AutoencoderKLConfig {
        down_block_types: vec!["DownEncoderBlock2D".into(); 4],
        up_block_types: vec!["UpDecoderBlock2D".into(); 4],
        block_out_channels: vec![128, 256, 512, 512],
        layers_per_block: 2,
        sample_size: IntOrList::Int(512),
        ..AutoencoderKLConfig::default()
    }
}

/// The public SDXL `vae/config.json` (same network, different scaling factor and training size).
pub fn sdxl_vae_config() -> AutoencoderKLConfig {
    AutoencoderKLConfig { scaling_factor: 0.13025, sample_size: IntOrList::Int(1024), ..sd15_vae_config() }
}

/// The encoder's posterior `N(mean, exp(logvar))`, logvar clamped to [-30, 20] like diffusers.
#[derive(Debug, Clone)]
pub struct DiagonalGaussian {
    pub mean: Tensor,
    pub logvar: Tensor,
}

impl DiagonalGaussian {
    pub fn std(&self) -> Result<Tensor> {
        (&self.logvar * 0.5).and_then(|t| t.exp()).ctx(MODEL)
    }

    /// `mean + std · noise`, with caller-supplied standard-normal `noise` of `mean`'s shape so
    /// the random stream stays under the caller's control.
    pub fn sample_with(&self, noise: &Tensor) -> Result<Tensor> {
        let std = self.std()?;
        noise.to_dtype(self.mean.dtype()).and_then(|n| self.mean.add(&std.mul(&n)?)).ctx(MODEL)
    }

    pub fn mode(&self) -> &Tensor {
        &self.mean
    }
}

/// diffusers `Attention` as the VAE mid block uses it: one head over all pixels, with its own
/// GroupNorm, biased projections and a residual connection.
#[derive(Debug, Clone)]
struct VaeAttention {
    group_norm: GroupNorm,
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
    scale: f64,
    layout: MapLayout,
}

impl VaeAttention {
    fn new(vb: VarBuilder, c: usize, groups: usize) -> candle_core::Result<Self> {
        Ok(Self {
            group_norm: GroupNorm::new(vb.pp("group_norm"), groups, c, VAE_EPS)?,
            to_q: linear(vb.pp("to_q"), c, c, true)?,
            to_k: linear(vb.pp("to_k"), c, c, true)?,
            to_v: linear(vb.pp("to_v"), c, c, true)?,
            to_out: linear(vb.pp("to_out.0"), c, c, true)?,
            scale: (c as f64).powf(-0.5),
            layout: MapLayout::of(&vb),
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if self.layout == MapLayout::ChannelsLast {
            // Channels-last maps are the tokens already.
            let (b, h, w, c) = x.dims4()?;
            let normed = self.group_norm.forward(x)?.reshape((b, h * w, c))?;
            let q = ops::linear(&self.to_q, &normed, None)?;
            let k = ops::linear(&self.to_k, &normed, None)?;
            let v = ops::linear(&self.to_v, &normed, None)?;
            let o = ops::attention(&q, &k, &v, self.scale, None, true)?;
            return ops::linear(&self.to_out, &o, Some(&x.reshape((b, h * w, c))?))?.reshape((b, h, w, c));
        }
        let (_, _, h, w) = x.dims4()?;
        let normed = self.group_norm.forward(x)?;
        let q = ops::image_to_tokens(&normed, self.to_q.weight(), self.to_q.bias())?;
        let k = ops::image_to_tokens(&normed, self.to_k.weight(), self.to_k.bias())?;
        let v = ops::image_to_tokens(&normed, self.to_v.weight(), self.to_v.bias())?;
        // diffusers upcasts this softmax (upcast_softmax=True).
        let o = ops::attention(&q, &k, &v, self.scale, None, true)?;
        ops::tokens_to_image(&o, self.to_out.weight(), self.to_out.bias(), (h, w), Some(x))
    }
}

#[derive(Debug, Clone)]
struct VaeMidBlock {
    resnet_0: ResnetBlock2D,
    attention: Option<VaeAttention>,
    resnet_1: ResnetBlock2D,
}

impl VaeMidBlock {
    fn new(vb: VarBuilder, c: usize, cfg: &AutoencoderKLConfig) -> candle_core::Result<Self> {
        let spec = resnet_spec(c, c, cfg);
        Ok(Self {
            resnet_0: ResnetBlock2D::new(vb.pp("resnets.0"), spec)?,
            attention: if cfg.mid_block_add_attention {
                Some(VaeAttention::new(vb.pp("attentions.0"), c, cfg.norm_num_groups)?)
            } else {
                None
            },
            resnet_1: ResnetBlock2D::new(vb.pp("resnets.1"), spec)?,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut x = self.resnet_0.forward(x, None)?;
        if let Some(a) = &self.attention {
            x = a.forward(&x)?;
        }
        self.resnet_1.forward(&x, None)
    }
}

fn resnet_spec(in_c: usize, out_c: usize, cfg: &AutoencoderKLConfig) -> ResnetSpec {
    ResnetSpec {
        in_channels: in_c,
        out_channels: out_c,
        temb_channels: None,
        groups: cfg.norm_num_groups,
        eps: VAE_EPS,
        output_scale_factor: 1.0,
    }
}

#[derive(Debug, Clone)]
struct EncoderBlock {
    resnets: Vec<ResnetBlock2D>,
    downsampler: Option<Downsample2D>,
}

#[derive(Debug, Clone)]
struct Encoder {
    conv_in: EdgeConv,
    blocks: Vec<EncoderBlock>,
    mid: VaeMidBlock,
    conv_norm_out: GroupNorm,
    conv_out: EdgeConv,
}

impl Encoder {
    fn new(vb: VarBuilder, cfg: &AutoencoderKLConfig) -> candle_core::Result<Self> {
        let ch = &cfg.block_out_channels;
        let n = ch.len();
        let conv_in = EdgeConv::first(vb.pp("conv_in"), cfg.in_channels, ch[0], 3, 1)?;
        let mut blocks = Vec::with_capacity(n);
        let mut out_c = ch[0];
        for (i, &block_c) in ch.iter().enumerate() {
            let in_c = out_c;
            out_c = block_c;
            let bvb = vb.pp(format!("down_blocks.{i}"));
            let resnets = (0..cfg.layers_per_block)
                .map(|j| {
                    let c = if j == 0 { in_c } else { out_c };
                    ResnetBlock2D::new(bvb.pp(format!("resnets.{j}")), resnet_spec(c, out_c, cfg))
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            let downsampler =
                if i + 1 != n { Some(Downsample2D::new(bvb.pp("downsamplers.0"), out_c, 0)?) } else { None };
            blocks.push(EncoderBlock { resnets, downsampler });
        }
        let last = ch[n - 1];
        Ok(Self {
            conv_in,
            blocks,
            mid: VaeMidBlock::new(vb.pp("mid_block"), last, cfg)?,
            conv_norm_out: GroupNorm::new(vb.pp("conv_norm_out"), cfg.norm_num_groups, last, VAE_EPS)?,
            conv_out: EdgeConv::last(vb.pp("conv_out"), last, 2 * cfg.latent_channels, 3, 1)?,
        })
    }

    /// NCHW images in, NCHW moments out.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut x = self.conv_in.forward(x)?;
        for block in &self.blocks {
            for r in &block.resnets {
                x = r.forward_owned(x, None)?;
            }
            if let Some(d) = &block.downsampler {
                x = d.forward(&x)?;
            }
        }
        x = self.mid.forward(&x)?;
        self.conv_out.forward(&self.conv_norm_out.forward_silu(&x)?)
    }
}

#[derive(Debug, Clone)]
struct DecoderBlock {
    resnets: Vec<ResnetBlock2D>,
    upsampler: Option<Upsample2D>,
}

#[derive(Debug, Clone)]
struct Decoder {
    conv_in: EdgeConv,
    mid: VaeMidBlock,
    blocks: Vec<DecoderBlock>,
    conv_norm_out: GroupNorm,
    conv_out: EdgeConv,
}

impl Decoder {
    fn new(vb: VarBuilder, cfg: &AutoencoderKLConfig) -> candle_core::Result<Self> {
        let ch = &cfg.block_out_channels;
        let n = ch.len();
        let last = ch[n - 1];
        let conv_in = EdgeConv::first(vb.pp("conv_in"), cfg.latent_channels, last, 3, 1)?;
        let mid = VaeMidBlock::new(vb.pp("mid_block"), last, cfg)?;
        let mut blocks = Vec::with_capacity(n);
        let mut out_c = last;
        for i in 0..n {
            let in_c = out_c;
            out_c = ch[n - 1 - i];
            let bvb = vb.pp(format!("up_blocks.{i}"));
            let resnets = (0..cfg.layers_per_block + 1)
                .map(|j| {
                    let c = if j == 0 { in_c } else { out_c };
                    ResnetBlock2D::new(bvb.pp(format!("resnets.{j}")), resnet_spec(c, out_c, cfg))
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            let upsampler =
                if i + 1 != n { Some(Upsample2D::new(bvb.pp("upsamplers.0"), out_c)?) } else { None };
            blocks.push(DecoderBlock { resnets, upsampler });
        }
        Ok(Self {
            conv_in,
            mid,
            blocks,
            conv_norm_out: GroupNorm::new(vb.pp("conv_norm_out"), cfg.norm_num_groups, ch[0], VAE_EPS)?,
            conv_out: EdgeConv::last(vb.pp("conv_out"), ch[0], cfg.out_channels, 3, 1)?,
        })
    }

    /// NCHW latents in, NCHW images out.
    fn forward(&self, z: &Tensor) -> candle_core::Result<Tensor> {
        let mut x = self.conv_in.forward(z)?;
        x = self.mid.forward(&x)?;
        for block in &self.blocks {
            for r in &block.resnets {
                x = r.forward_owned(x, None)?;
            }
            if let Some(u) = &block.upsampler {
                x = u.forward(&x, None)?;
            }
        }
        self.conv_out.forward(&self.conv_norm_out.forward_silu(&x)?)
    }
}

/// diffusers `AutoencoderKL`. `encode`/`decode` work in raw latent space: applying
/// `scaling_factor`/`shift_factor` is the pipeline's business.
#[derive(Debug, Clone)]
pub struct AutoencoderKL {
    encoder: Encoder,
    quant_conv: Option<Conv2d>,
    post_quant_conv: Option<Conv2d>,
    decoder: Decoder,
    config: AutoencoderKLConfig,
    dtype: DType,
    device: Device,
    layout: MapLayout,
    /// The decoder's recordings, by latent shape (a tiled decode's tiles among them).
    graphs: Graphs<1>,
    graphs_wanted: bool,
}

impl AutoencoderKL {
    pub fn new(vb: VarBuilder, cfg: &AutoencoderKLConfig) -> Result<Self> {
        cfg.validate("vae config")?;
        let build = || -> candle_core::Result<Self> {
            let l2 = 2 * cfg.latent_channels;
            let l = cfg.latent_channels;
            Ok(Self {
                encoder: Encoder::new(vb.pp("encoder"), cfg)?,
                quant_conv: if cfg.use_quant_conv {
                    Some(conv2d_nchw(vb.pp("quant_conv"), l2, l2, 1, 1, 0)?)
                } else {
                    None
                },
                post_quant_conv: if cfg.use_post_quant_conv {
                    Some(conv2d_nchw(vb.pp("post_quant_conv"), l, l, 1, 1, 0)?)
                } else {
                    None
                },
                decoder: Decoder::new(vb.pp("decoder"), cfg)?,
                config: cfg.clone(),
                dtype: vb.dtype(),
                device: vb.device().clone(),
                layout: MapLayout::of(&vb),
                graphs: Graphs::new(MODEL, [Refresh::Always]),
                graphs_wanted: true,
            })
        };
        build().map_err(weights_err(MODEL))
    }

    /// Reads `dir/config.json` and the weights in `dir`.
    pub fn from_dir(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let cfg = AutoencoderKLConfig::from_file(&dir.join("config.json"))?;
        let vb = crate::loading::load_component(dir, dtype, device)?;
        Self::new(vb, &cfg).map_err(|e| e.with_weight_origin(&crate::loading::describe_weights(dir)))
    }

    pub fn config(&self) -> &AutoencoderKLConfig {
        &self.config
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether [`Self::decode`] may replay the decoder from CUDA graphs (on by default, where
    /// `sdhive_cuda_kernels::graphs_on`): off, every decode runs kernel by kernel and records nothing.
    pub fn set_cuda_graphs(&mut self, on: bool) {
        self.graphs_wanted = on;
    }

    /// How many latent shapes decode from a recorded CUDA graph now (none off CUDA), and why recording failed for
    /// the others.
    pub fn graph_status(&self) -> (usize, Vec<String>) {
        self.graphs.status()
    }

    /// Whether decodes are recorded: the channels-last decoder on a CUDA device. An NCHW decoder (f32, the upcast
    /// SDXL VAE among them) upsamples through candle's kernel, which uploads its strides from host memory at every
    /// call, something a replay cannot repeat; a recording of it would be refused.
    fn records(&self) -> bool {
        self.graphs_wanted
            && self.layout == MapLayout::ChannelsLast
            && sdhive_cuda_kernels::graphs_on(&self.device)
    }

    /// Images `(B, in_channels, H, W)` in [-1, 1] → latent posterior.
    pub fn encode(&self, x: &Tensor) -> Result<DiagonalGaussian> {
        let (_, c, _, _) =
            x.dims4().map_err(|e| input_err(MODEL, format!("image must be (B, C, H, W): {e}")))?;
        if c != self.config.in_channels {
            return Err(input_err(
                MODEL,
                format!("image has {c} channels, expected {}", self.config.in_channels),
            ));
        }
        let run = || -> candle_core::Result<DiagonalGaussian> {
            let x = x.to_device(&self.device)?.to_dtype(self.dtype)?;
            let mut moments = self.encoder.forward(&x)?;
            if let Some(q) = &self.quant_conv {
                moments = ops::conv2d(q, &moments, ConvExtras::default())?;
            }
            let l = self.config.latent_channels;
            let mean = moments.narrow(1, 0, l)?;
            let logvar = moments.narrow(1, l, l)?.clamp(-30f32, 20f32)?;
            Ok(DiagonalGaussian { mean, logvar })
        };
        let out = run().ctx(MODEL);
        crate::cpu::release_scratch();
        out
    }

    /// [`Self::decode`] in overlapping tiles of [`AutoencoderKLConfig::tile_latent_size`] latents, blended linearly across the
    /// overlap — diffusers' `tiled_decode` (`enable_tiling()`), which bounds memory by the tile size. Latents
    /// that fit in one tile decode as usual, as in diffusers.
    pub fn decode_tiled(&self, z: &Tensor) -> Result<Tensor> {
        let tile = self.config.tile_latent_size();
        let (_, _, h, w) =
            z.dims4().map_err(|e| input_err(MODEL, format!("latent must be (B, C, h, w): {e}")))?;
        if h <= tile && w <= tile {
            return self.decode(z);
        }
        // diffusers' constants: a quarter of each tile overlaps its neighbours.
        let stride = (tile * 3 / 4).max(1);
        let sample_tile = self.config.tile_sample_size();
        let blend = sample_tile / 4;
        let keep = sample_tile - blend;
        let run = || -> candle_core::Result<Tensor> {
            let mut grid: Vec<Vec<Tensor>> = Vec::new();
            for i in (0..h).step_by(stride) {
                let mut row = Vec::new();
                for j in (0..w).step_by(stride) {
                    let part = z.narrow(2, i, tile.min(h - i))?.narrow(3, j, tile.min(w - j))?;
                    let decoded = self.decode(&part).map_err(candle_core::Error::wrap)?;
                    // Each tile is blended with its (already blended) upper and left neighbours.
                    let mut t = decoded;
                    if let Some(above) = grid.last().and_then(|r: &Vec<Tensor>| r.get(row.len())) {
                        t = blend_edge(above, &t, 2, blend)?;
                    }
                    if let Some(left) = row.last() {
                        t = blend_edge(left, &t, 3, blend)?;
                    }
                    row.push(t);
                }
                grid.push(row);
            }
            let rows = grid
                .iter()
                .map(|row| {
                    let cropped = row
                        .iter()
                        .map(|t| {
                            let (_, _, th, tw) = t.dims4()?;
                            t.narrow(2, 0, keep.min(th))?.narrow(3, 0, keep.min(tw))
                        })
                        .collect::<candle_core::Result<Vec<_>>>()?;
                    Tensor::cat(&cropped, 3)
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            Tensor::cat(&rows, 2)
        };
        run().ctx(MODEL)
    }

    /// Latents `(B, latent_channels, h, w)` → images `(B, out_channels, 8h, 8w)`-ish.
    pub fn decode(&self, z: &Tensor) -> Result<Tensor> {
        check_latent(MODEL, z, self.config.latent_channels)?;
        let run = || -> candle_core::Result<Tensor> {
            // Contiguous either way (a tile of `decode_tiled` is a view), so that the fused kernels take it and a
            // recorded decode computes what the kernel-by-kernel one does.
            let z = z.to_device(&self.device)?.to_dtype(self.dtype)?.contiguous()?;
            if self.records() {
                // The second decode of a shape records, later ones replay: the decoder's launches then cost their
                // GPU time alone, not the host's.
                return self.graphs.run([&z], |[z]| self.decoder_forward(z));
            }
            self.decoder_forward(&z)
        };
        let out = run().ctx(MODEL);
        crate::cpu::release_scratch();
        out
    }

    /// `post_quant_conv` and the decoder on latents in the network's dtype and device.
    fn decoder_forward(&self, z: &Tensor) -> candle_core::Result<Tensor> {
        match &self.post_quant_conv {
            Some(p) => self.decoder.forward(&ops::conv2d(p, z, ConvExtras::default())?),
            None => self.decoder.forward(z),
        }
    }
}

/// Linear cross-fade over the first `extent` rows (`dim` 2) or columns (`dim` 3) of `b` from the last ones of
/// `a`: row y of the result is `a[-extent + y]·(1 − y/extent) + b[y]·(y/extent)`, the rest is `b`.
fn blend_edge(a: &Tensor, b: &Tensor, dim: usize, extent: usize) -> candle_core::Result<Tensor> {
    let extent = extent.min(a.dim(dim)?).min(b.dim(dim)?);
    if extent == 0 {
        return Ok(b.clone());
    }
    let dev = b.device();
    let ramp: Vec<f32> = (0..extent).map(|y| y as f32 / extent as f32).collect();
    let mut shape = vec![1usize; 4];
    shape[dim] = extent;
    let wb = Tensor::from_vec(ramp, shape, dev)?.to_dtype(b.dtype())?;
    let wa = wb.affine(-1.0, 1.0)?;
    let tail = a.narrow(dim, a.dim(dim)? - extent, extent)?;
    let head = b.narrow(dim, 0, extent)?;
    let mixed = (tail.broadcast_mul(&wa)? + head.broadcast_mul(&wb)?)?;
    let rest = b.narrow(dim, extent, b.dim(dim)? - extent)?;
    Tensor::cat(&[&mixed, &rest], dim)
}
