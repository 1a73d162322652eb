//! The SD3 / SD3.5 denoiser: diffusers' `SD3Transformer2DModel` (MMDiT), configured from
//! `transformer/config.json` and loaded from diffusers weight names. One type covers SD3-medium (joint blocks with
//! AdaLayerNormZero, the last block's context stream reduced to its attention input), SD3.5-medium's MMDiT-X
//! (`dual_attention_layers`: a second self-attention of the image stream in those blocks) and SD3.5-large
//! (`qk_norm: "rms_norm"` on every query and key head, image and context alike).

use crate::config::read_json;
use crate::error::{input_err, invalid, weights_err, Result, TensorContext};
use crate::graphed::{Graphs, Refresh};
use crate::layers::{linear, stack_linears};
use crate::ops;
use crate::unet::{TimestepEmbedding, Timesteps};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::{Linear, VarBuilder};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::{Arc, Mutex};

const MODEL: &str = "sd3 transformer";

/// The sinusoidal timestep features' width (diffusers' `CombinedTimestepTextProjEmbeddings` fixes it).
const TIME_CHANNELS: usize = 256;

/// The epsilon of every norm in the network (diffusers hard-codes 1e-6 throughout SD3).
const EPS: f64 = 1e-6;

/// `transformer/config.json`; defaults are diffusers' `SD3Transformer2DModel` defaults (SD3-medium's sizes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SD3TransformerConfig {
    pub sample_size: usize,
    pub patch_size: usize,
    pub in_channels: usize,
    pub num_layers: usize,
    pub attention_head_dim: usize,
    pub num_attention_heads: usize,
    pub joint_attention_dim: usize,
    pub caption_projection_dim: usize,
    pub pooled_projection_dim: usize,
    pub out_channels: Option<usize>,
    pub pos_embed_max_size: Option<usize>,
    /// Blocks with the MMDiT-X second self-attention (SD3.5-medium: the first 13).
    pub dual_attention_layers: Vec<usize>,
    /// `None` or `"rms_norm"` (SD3.5).
    pub qk_norm: Option<String>,
}

impl Default for SD3TransformerConfig {
    fn default() -> Self {
        Self {
            sample_size: 128,
            patch_size: 2,
            in_channels: 16,
            num_layers: 18,
            attention_head_dim: 64,
            num_attention_heads: 18,
            joint_attention_dim: 4096,
            caption_projection_dim: 1152,
            pooled_projection_dim: 2048,
            out_channels: Some(16),
            pos_embed_max_size: Some(96),
            dual_attention_layers: Vec::new(),
            qk_norm: None,
        }
    }
}

impl SD3TransformerConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let cfg: Self = read_json(path)?;
        cfg.validate(&path.display().to_string())?;
        Ok(cfg)
    }

    /// The width of both streams, `num_attention_heads · attention_head_dim`.
    pub fn inner_dim(&self) -> usize {
        self.num_attention_heads * self.attention_head_dim
    }

    pub fn out_channels(&self) -> usize {
        self.out_channels.unwrap_or(self.in_channels)
    }

    fn rms_qk_norm(&self) -> bool {
        self.qk_norm.is_some()
    }

    pub fn validate(&self, origin: &str) -> Result<()> {
        let positive = [
            ("patch_size", self.patch_size),
            ("in_channels", self.in_channels),
            ("num_layers", self.num_layers),
            ("attention_head_dim", self.attention_head_dim),
            ("num_attention_heads", self.num_attention_heads),
            ("joint_attention_dim", self.joint_attention_dim),
            ("pooled_projection_dim", self.pooled_projection_dim),
            ("out_channels", self.out_channels()),
        ];
        if let Some((field, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(invalid(origin, field, "must be > 0"));
        }
        // The context stream joins the image stream's attention, so both must have the same width.
        if self.caption_projection_dim != self.inner_dim() {
            return Err(invalid(
                origin,
                "caption_projection_dim",
                format!(
                    "{} differs from num_attention_heads · attention_head_dim = {}",
                    self.caption_projection_dim,
                    self.inner_dim()
                ),
            ));
        }
        // The 2-D sin-cos table gives each axis half the width, as sin and cos pairs.
        if !self.inner_dim().is_multiple_of(4) {
            return Err(invalid(origin, "attention_head_dim", "the inner width must be a multiple of 4"));
        }
        if let Some(q) = self.qk_norm.as_deref().filter(|q| *q != "rms_norm") {
            return Err(invalid(
                origin,
                "qk_norm",
                format!("`{q}` is not supported (SD3 uses none or rms_norm)"),
            ));
        }
        if let Some(&l) = self.dual_attention_layers.iter().find(|&&l| l >= self.num_layers) {
            return Err(invalid(
                origin,
                "dual_attention_layers",
                format!("layer {l} does not exist ({} layers)", self.num_layers),
            ));
        }
        if self.pos_embed_max_size == Some(0) {
            return Err(invalid(origin, "pos_embed_max_size", "must be > 0"));
        }
        if self.sample_size < self.patch_size {
            return Err(invalid(origin, "sample_size", "smaller than patch_size"));
        }
        Ok(())
    }
}

/// diffusers' `get_2d_sincos_pos_embed` for a `gh × gw` grid (`(gh·gw, dim)`, rows in raster order), in f64 then
/// rounded to f32 as diffusers does; `base_size` is the training grid (`sample_size / patch_size`).
fn sincos_2d(dim: usize, (gh, gw): (usize, usize), base_size: usize) -> Vec<f32> {
    // The grid coordinates are made in f32, as torch's `arange(float32) / (n / base)` makes them.
    let axis = |n: usize| -> Vec<f32> {
        let step = (n as f64 / base_size as f64) as f32;
        (0..n).map(|i| i as f32 / step).collect()
    };
    let (ys, xs) = (axis(gh), axis(gw));
    let quarter = dim / 4;
    // Each axis gets `dim / 2` channels: `dim / 4` frequencies, as sin then cos.
    let omega: Vec<f64> = (0..quarter).map(|i| 1.0 / 10000f64.powf(i as f64 / quarter as f64)).collect();
    let mut out = Vec::with_capacity(gh * gw * dim);
    for &y in &ys {
        for &x in &xs {
            // diffusers' meshgrid puts the column coordinate first.
            for pos in [x, y] {
                let pos = pos as f64;
                out.extend(omega.iter().map(|w| (pos * w).sin() as f32));
                out.extend(omega.iter().map(|w| (pos * w).cos() as f32));
            }
        }
    }
    out
}

/// RMSNorm over the last dimension (each attention head), statistics in f32, with its learned scale.
#[derive(Debug, Clone)]
struct RmsNorm {
    weight: Tensor,
}

impl RmsNorm {
    fn new(vb: VarBuilder, dim: usize) -> candle_core::Result<Self> {
        Ok(Self { weight: vb.get_with_hints(dim, "weight", candle_nn::Init::Const(1.))? })
    }

    /// `x` `(B, S, H·D)` normalised per head of width `D`.
    fn forward_heads(&self, x: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
        if ops::fused_rms_norm_applies(x, &self.weight) {
            return ops::fused_rms_norm(x, &self.weight, EPS);
        }
        let (b, s, hd) = x.dims3()?;
        let dtype = x.dtype();
        let x = x.reshape((b, s, heads, hd / heads))?.to_dtype(DType::F32)?;
        let variance = x.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = x.broadcast_div(&(variance + EPS)?.sqrt()?)?;
        normed.to_dtype(dtype)?.broadcast_mul(&self.weight)?.reshape((b, s, hd))
    }
}

/// One stream's projections into the joint attention: q, k and v as one product (their weights stacked; a LoRA
/// still finds each by its name), read back as column ranges of that product's rows in place.
#[derive(Debug, Clone)]
struct Projections {
    qkv: Linear,
    dim: usize,
    norm_q: Option<RmsNorm>,
    norm_k: Option<RmsNorm>,
}

impl Projections {
    fn new(
        vb: &VarBuilder,
        names: [&str; 5],
        dim: usize,
        cfg: &SD3TransformerConfig,
    ) -> candle_core::Result<Self> {
        let [q, k, v, nq, nk] = names;
        let head = cfg.attention_head_dim;
        let norm = |name: &str| cfg.rms_qk_norm().then(|| RmsNorm::new(vb.pp(name), head)).transpose();
        let parts = [q, k, v].map(|name| linear(vb.pp(name), dim, dim, true));
        let [q, k, v] = parts;
        Ok(Self { qkv: stack_linears(&[q?, k?, v?])?, dim, norm_q: norm(nq)?, norm_k: norm(nk)? })
    }

    /// The `(B, S, 3·C)` product of `x` with q, k and v side by side.
    fn product(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        ops::linear(&self.qkv, x, None)
    }

    /// Column range `i` (0: q, 1: k, 2: v) of [`Projections::product`]'s rows.
    fn part(&self, product: &Tensor, i: usize) -> candle_core::Result<Tensor> {
        product.narrow(2, i * self.dim, self.dim)
    }

    /// q, k and v of `x`, q and k RMS-normalised per head with qk norm.
    fn project(&self, x: &Tensor, heads: usize) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let y = self.product(x)?;
        let norm = |t: Tensor, n: Option<&RmsNorm>| match n {
            Some(n) => n.forward_heads(&t, heads),
            None => Ok(t),
        };
        Ok((
            norm(self.part(&y, 0)?, self.norm_q.as_ref())?,
            norm(self.part(&y, 1)?, self.norm_k.as_ref())?,
            self.part(&y, 2)?,
        ))
    }
}

/// diffusers' `Attention` with `JointAttnProcessor2_0`: the image tokens' projections, and (joint blocks) the
/// context tokens' `add_*_proj`, attended together.
#[derive(Debug, Clone)]
struct JointAttention {
    image: Projections,
    context: Option<Projections>,
    to_out: Linear,
    /// Absent in the last block, whose context output nothing reads.
    to_add_out: Option<Linear>,
    heads: usize,
    scale: f64,
}

impl JointAttention {
    fn new(
        vb: VarBuilder,
        cfg: &SD3TransformerConfig,
        joint: bool,
        context_pre_only: bool,
    ) -> candle_core::Result<Self> {
        let dim = cfg.inner_dim();
        let image = Projections::new(&vb, ["to_q", "to_k", "to_v", "norm_q", "norm_k"], dim, cfg)?;
        let context = joint
            .then(|| {
                Projections::new(
                    &vb,
                    ["add_q_proj", "add_k_proj", "add_v_proj", "norm_added_q", "norm_added_k"],
                    dim,
                    cfg,
                )
            })
            .transpose()?;
        let to_add_out =
            (joint && !context_pre_only).then(|| linear(vb.pp("to_add_out"), dim, dim, true)).transpose()?;
        Ok(Self {
            image,
            context,
            to_out: linear(vb.pp("to_out.0"), dim, dim, true)?,
            to_add_out,
            heads: cfg.num_attention_heads,
            scale: (cfg.attention_head_dim as f64).powf(-0.5),
        })
    }

    /// The image tokens' output and, where the block keeps a context stream, the context tokens'.
    fn forward(&self, x: &Tensor, context: Option<&Tensor>) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        let h = self.heads;
        let (Some(proj), Some(c)) = (&self.context, context) else {
            let (q, k, v) = self.image.project(x, h)?;
            let o = ops::multi_head_attention(&q, &k, &v, h, self.scale, false)?;
            return Ok((ops::linear(&self.to_out, &o, None)?, None));
        };
        let (image, context) = (self.image.product(x)?, proj.product(c)?);
        // Part `i` of the joint sequence, each stream's rows through its own norm.
        let joint_part = |i: usize, norms: (Option<&RmsNorm>, Option<&RmsNorm>)| {
            joint((&self.image.part(&image, i)?, norms.0), (&proj.part(&context, i)?, norms.1), h)
        };
        let k = joint_part(1, (self.image.norm_k.as_ref(), proj.norm_k.as_ref()))?;
        let v = joint_part(2, (None, None))?;
        let Some(to_add_out) = &self.to_add_out else {
            // Each query's softmax runs over all keys alone, so the image queries give the same rows without the
            // context queries, whose outputs this block drops.
            let q = self.image.part(&image, 0)?;
            let q = match &self.image.norm_q {
                Some(n) => n.forward_heads(&q, h)?,
                None => q,
            };
            let o = ops::multi_head_attention(&q, &k, &v, h, self.scale, false)?;
            return Ok((ops::linear(&self.to_out, &o, None)?, None));
        };
        let n = x.dim(1)?;
        let q = joint_part(0, (self.image.norm_q.as_ref(), proj.norm_q.as_ref()))?;
        let o = ops::multi_head_attention(&q, &k, &v, h, self.scale, false)?;
        // Each stream's rows are read in place where the GPU products can (`ops::linear`).
        let o_x = o.narrow(1, 0, n)?;
        let o_c = o.narrow(1, n, o.dim(1)? - n)?;
        Ok((ops::linear(&self.to_out, &o_x, None)?, Some(ops::linear(to_add_out, &o_c, None)?)))
    }
}

/// One part (q, k or v) of the joint sequence: the image tokens' rows `a`, then the context tokens' `b`, each
/// with qk norm through its own per-head RMSNorm. On the GPU the norms and the concatenation are one pass, reading
/// both streams' rows in place.
fn joint(
    (a, a_norm): (&Tensor, Option<&RmsNorm>),
    (b, b_norm): (&Tensor, Option<&RmsNorm>),
    heads: usize,
) -> candle_core::Result<Tensor> {
    let norms = match (a_norm, b_norm) {
        (Some(na), Some(nb)) => Some((&na.weight, &nb.weight)),
        (None, None) => None,
        _ => return Err(candle_core::Error::Msg("qk norm on one stream of a joint attention only".into())),
    };
    if let Some(j) = ops::fused_joint_rows(a, b, norms, a.dim(2)? / heads, EPS)? {
        return Ok(j);
    }
    let (a, b) = match (a_norm, b_norm) {
        (Some(na), Some(nb)) => (na.forward_heads(a, heads)?, nb.forward_heads(b, heads)?),
        _ => (a.clone(), b.clone()),
    };
    Tensor::cat(&[&a, &b], 1)
}

/// diffusers' `FeedForward` with `gelu-approximate`: `net.2(gelu_tanh(net.0.proj(x)))`.
#[derive(Debug, Clone)]
struct FeedForward {
    proj: Linear,
    out: Linear,
}

impl FeedForward {
    fn new(vb: VarBuilder, dim: usize) -> candle_core::Result<Self> {
        Ok(Self {
            proj: linear(vb.pp("net.0.proj"), dim, 4 * dim, true)?,
            out: linear(vb.pp("net.2"), 4 * dim, dim, true)?,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        ops::linear(&self.out, &ops::linear_gelu(&self.proj, x)?, None)
    }
}

/// A LayerNorm without affine parameters (every SD3 norm), through the project's two-pass kernel.
#[derive(Debug, Clone)]
struct PlainNorm {
    ones: Tensor,
    zeros: Tensor,
}

impl PlainNorm {
    fn new(dim: usize, dtype: DType, device: &Device) -> candle_core::Result<Self> {
        Ok(Self { ones: Tensor::ones(dim, dtype, device)?, zeros: Tensor::zeros(dim, dtype, device)? })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        ops::layer_norm(x, &self.ones, &self.zeros, EPS)
    }

    /// `norm(x) · (1 + scale) + shift`, with `(B, D)` modulation rows.
    fn modulate(&self, x: &Tensor, shift: &Tensor, scale: &Tensor) -> candle_core::Result<Tensor> {
        if let Some(fused) = ops::fused_modulated_layer_norm(x, shift, scale, EPS)? {
            return Ok(fused);
        }
        modulate(&self.forward(x)?, shift, scale)
    }
}

fn modulate(normed: &Tensor, shift: &Tensor, scale: &Tensor) -> candle_core::Result<Tensor> {
    normed.broadcast_mul(&(scale + 1.0)?.unsqueeze(1)?)?.broadcast_add(&shift.unsqueeze(1)?)
}

/// `x + gate · y` with a `(B, D)` gate.
fn gated_add(x: &Tensor, gate: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    if let Some(fused) = ops::fused_gated_add(x, gate, y)? {
        return Ok(fused);
    }
    x + y.broadcast_mul(&gate.unsqueeze(1)?)?
}

/// The `(B, n·D)` output of an adaptive norm's linear, as its `n` rows of modulation.
fn chunks(emb: &Tensor, n: usize) -> candle_core::Result<Vec<Tensor>> {
    let d = emb.dim(1)? / n;
    (0..n).map(|i| emb.narrow(1, i * d, d)).collect()
}

/// diffusers' `JointTransformerBlock`.
#[derive(Debug, Clone)]
struct JointBlock {
    /// AdaLayerNormZero (6 rows) or, in MMDiT-X blocks, SD35AdaLayerNormZeroX (9 rows).
    norm1: Linear,
    /// AdaLayerNormZero (6 rows), or AdaLayerNormContinuous (scale, shift) in the context-pre-only last block.
    norm1_context: Linear,
    attn: JointAttention,
    attn2: Option<JointAttention>,
    ff: FeedForward,
    ff_context: Option<FeedForward>,
    context_pre_only: bool,
}

impl JointBlock {
    fn new(vb: VarBuilder, cfg: &SD3TransformerConfig, index: usize) -> candle_core::Result<Self> {
        let dim = cfg.inner_dim();
        let dual = cfg.dual_attention_layers.contains(&index);
        let context_pre_only = index + 1 == cfg.num_layers;
        let rows = if dual { 9 } else { 6 };
        let context_rows = if context_pre_only { 2 } else { 6 };
        Ok(Self {
            norm1: linear(vb.pp("norm1.linear"), dim, rows * dim, true)?,
            norm1_context: linear(vb.pp("norm1_context.linear"), dim, context_rows * dim, true)?,
            attn: JointAttention::new(vb.pp("attn"), cfg, true, context_pre_only)?,
            attn2: dual.then(|| JointAttention::new(vb.pp("attn2"), cfg, false, false)).transpose()?,
            ff: FeedForward::new(vb.pp("ff"), dim)?,
            ff_context: (!context_pre_only)
                .then(|| FeedForward::new(vb.pp("ff_context"), dim))
                .transpose()?,
            context_pre_only,
        })
    }

    /// `temb` is the conditioning already through SiLU (the same for every block). Returns the image tokens and,
    /// unless this is the context-pre-only block, the context tokens.
    fn forward(
        &self,
        x: &Tensor,
        context: &Tensor,
        temb: &Tensor,
        norm: &PlainNorm,
    ) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        let m = chunks(&ops::linear(&self.norm1, temb, None)?, if self.attn2.is_some() { 9 } else { 6 })?;
        let (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp) =
            (&m[0], &m[1], &m[2], &m[3], &m[4], &m[5]);
        let x_in = x;
        let norm_x = norm.modulate(x, shift_msa, scale_msa)?;
        let cm = ops::linear(&self.norm1_context, temb, None)?;
        let (norm_c, cm) = if self.context_pre_only {
            // AdaLayerNormContinuous chunks (scale, shift), the reverse of AdaLayerNormZero's order.
            let c = chunks(&cm, 2)?;
            (norm.modulate(context, &c[1], &c[0])?, None)
        } else {
            let c = chunks(&cm, 6)?;
            (norm.modulate(context, &c[0], &c[1])?, Some(c))
        };
        let (attn_x, attn_c) = self.attn.forward(&norm_x, Some(&norm_c))?;
        let mut x = gated_add(x, gate_msa, &attn_x)?;
        if let Some(attn2) = &self.attn2 {
            // The block's input normalised again: one fused pass, cheaper than keeping the plain norm around.
            let norm_x2 = norm.modulate(x_in, &m[6], &m[7])?;
            x = gated_add(&x, &m[8], &attn2.forward(&norm_x2, None)?.0)?;
        }
        let ff_in = norm.modulate(&x, shift_mlp, scale_mlp)?;
        let x = gated_add(&x, gate_mlp, &self.ff.forward(&ff_in)?)?;
        let (Some(c), Some(attn_c), Some(ff_context)) = (cm, attn_c, &self.ff_context) else {
            return Ok((x, None));
        };
        let context = gated_add(context, &c[2], &attn_c)?;
        let ff_in = norm.modulate(&context, &c[3], &c[4])?;
        let context = gated_add(&context, &c[5], &ff_context.forward(&ff_in)?)?;
        Ok((x, Some(context)))
    }
}

/// The positional rows kept for one `(batch, patch rows, patch columns)`.
type PosRows = ((usize, usize, usize), Tensor);

/// diffusers' `SD3Transformer2DModel`.
#[derive(Debug, Clone)]
pub struct SD3Transformer2DModel {
    /// `pos_embed.proj`, the patchifying convolution, as a linear over flattened `(C, p, p)` patches.
    patch_proj: Linear,
    /// The positional table over the full `pos_embed_max_size²` grid, `(max, max, D)`; `None` without a maximum
    /// (then made per input size).
    pos_table: Option<Tensor>,
    time_proj: Timesteps,
    timestep_embedder: TimestepEmbedding,
    /// PixArtAlphaTextProjection with SiLU: the same `linear_2(silu(linear_1(x)))` as the timestep MLP.
    text_embedder: TimestepEmbedding,
    context_embedder: Linear,
    blocks: Vec<JointBlock>,
    norm_out: Linear,
    proj_out: Linear,
    norm: PlainNorm,
    config: SD3TransformerConfig,
    dtype: DType,
    device: Device,
    /// The CUDA-graph recordings of the step (the patches and the conditioning copied in at each replay; the
    /// context and the positional rows, the same tensors through a job, only when another is passed).
    graphs: Graphs<4>,
    /// The positional rows of the last shape ([`Self::pos_rows`]).
    pos_rows: Arc<Mutex<Option<PosRows>>>,
}

impl SD3Transformer2DModel {
    /// Builds the network from diffusers names; a missing or misshapen tensor is an error naming it.
    pub fn new(vb: VarBuilder, cfg: &SD3TransformerConfig) -> Result<Self> {
        cfg.validate(MODEL)?;
        Self::build(&vb, cfg).map_err(weights_err(MODEL))
    }

    fn build(vb: &VarBuilder, cfg: &SD3TransformerConfig) -> candle_core::Result<Self> {
        let (dim, p, c) = (cfg.inner_dim(), cfg.patch_size, cfg.in_channels);
        let pe = vb.pp("pos_embed");
        let filter = pe.pp("proj").get((dim, c, p, p), "weight")?;
        let patch_proj =
            Linear::new(filter.reshape((dim, c * p * p))?, Some(pe.pp("proj").get(dim, "bias")?));
        let pos_table = match cfg.pos_embed_max_size {
            Some(max) => Some(Self::pos_table(&pe, cfg, max)?),
            None => None,
        };
        let tt = vb.pp("time_text_embed");
        Ok(Self {
            patch_proj,
            pos_table,
            time_proj: Timesteps::new(TIME_CHANNELS, true, 0.0),
            timestep_embedder: TimestepEmbedding::new(tt.pp("timestep_embedder"), TIME_CHANNELS, dim)?,
            text_embedder: TimestepEmbedding::new(tt.pp("text_embedder"), cfg.pooled_projection_dim, dim)?,
            context_embedder: linear(vb.pp("context_embedder"), cfg.joint_attention_dim, dim, true)?,
            blocks: (0..cfg.num_layers)
                .map(|i| JointBlock::new(vb.pp(format!("transformer_blocks.{i}")), cfg, i))
                .collect::<candle_core::Result<_>>()?,
            norm_out: linear(vb.pp("norm_out.linear"), dim, 2 * dim, true)?,
            proj_out: linear(vb.pp("proj_out"), dim, p * p * cfg.out_channels(), true)?,
            norm: PlainNorm::new(dim, vb.dtype(), vb.device())?,
            config: cfg.clone(),
            dtype: vb.dtype(),
            device: vb.device().clone(),
            graphs: Graphs::new(
                MODEL,
                [Refresh::Always, Refresh::Always, Refresh::WhenAnotherTensor, Refresh::WhenAnotherTensor],
            ),
            pos_rows: Arc::default(),
        })
    }

    /// The saved `pos_embed.pos_embed` buffer where the file has it (diffusers loads it as a persistent buffer),
    /// else the same table computed.
    fn pos_table(pe: &VarBuilder, cfg: &SD3TransformerConfig, max: usize) -> candle_core::Result<Tensor> {
        let dim = cfg.inner_dim();
        let table = if pe.contains_tensor("pos_embed") {
            pe.get((1, max * max, dim), "pos_embed")?
        } else {
            let base = cfg.sample_size / cfg.patch_size;
            Tensor::from_vec(sincos_2d(dim, (max, max), base), (max * max, dim), pe.device())?
                .to_dtype(pe.dtype())?
        };
        table.reshape((max, max, dim))
    }

    /// Reads `dir/config.json` and the weights in `dir` (single file or sharded index).
    pub fn from_dir(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let cfg = SD3TransformerConfig::from_file(&dir.join("config.json"))?;
        let vb = crate::loading::load_component(dir, dtype, device)?;
        Self::new(vb, &cfg).map_err(|e| e.with_weight_origin(&crate::loading::describe_weights(dir)))
    }

    pub fn config(&self) -> &SD3TransformerConfig {
        &self.config
    }

    /// How many input shapes replay their step from a recorded CUDA graph (none off CUDA), and why recording
    /// failed for the others.
    pub fn graph_status(&self) -> (usize, Vec<String>) {
        self.graphs.status()
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The positional rows of an `h × w` patch grid, `(1, h·w, D)`: the centre crop of the table, as diffusers'
    /// `cropped_pos_embed`.
    fn pos_embed(&self, (h, w): (usize, usize)) -> candle_core::Result<Tensor> {
        let dim = self.config.inner_dim();
        match (&self.pos_table, self.config.pos_embed_max_size) {
            (Some(table), Some(max)) => {
                let (top, left) = ((max - h) / 2, (max - w) / 2);
                table.narrow(0, top, h)?.narrow(1, left, w)?.reshape((1, h * w, dim))
            }
            _ => {
                let base = self.config.sample_size / self.config.patch_size;
                Tensor::from_vec(sincos_2d(dim, (h, w), base), (1, h * w, dim), &self.device)?
                    .to_dtype(self.dtype)
            }
        }
    }

    /// Checks the inputs' shapes against the config and each other; returns `(batch, patch rows, patch columns)`.
    fn check_inputs(
        &self,
        latents: &Tensor,
        timestep: &Tensor,
        context: &Tensor,
        pooled: &Tensor,
    ) -> Result<(usize, usize, usize)> {
        let cfg = &self.config;
        let (b, c, hh, ww) =
            latents.dims4().map_err(|e| input_err(MODEL, format!("latents must be (B, C, H, W): {e}")))?;
        if c != cfg.in_channels {
            return Err(input_err(
                MODEL,
                format!("latents have {c} channels, the model takes {}", cfg.in_channels),
            ));
        }
        let p = cfg.patch_size;
        if hh == 0 || ww == 0 || !hh.is_multiple_of(p) || !ww.is_multiple_of(p) {
            return Err(input_err(
                MODEL,
                format!("latent size {hh}×{ww} is not a positive multiple of patch_size {p}"),
            ));
        }
        let (h, w) = (hh / p, ww / p);
        if let Some(max) = cfg.pos_embed_max_size.filter(|&m| h > m || w > m) {
            return Err(input_err(
                MODEL,
                format!("latent size {hh}×{ww} is {h}×{w} patches, more than pos_embed_max_size {max}"),
            ));
        }
        match timestep.dims() {
            [n] if *n == b => {}
            dims => return Err(input_err(MODEL, format!("timestep must be ({b},), got {dims:?}"))),
        }
        let (cb, _, cd) =
            context.dims3().map_err(|e| input_err(MODEL, format!("context must be (B, S, D): {e}")))?;
        if cb != b || cd != cfg.joint_attention_dim {
            return Err(input_err(
                MODEL,
                format!("context is {:?}, expected ({b}, S, {})", context.dims(), cfg.joint_attention_dim),
            ));
        }
        if pooled.dims() != [b, cfg.pooled_projection_dim] {
            return Err(input_err(
                MODEL,
                format!("pooled is {:?}, expected ({b}, {})", pooled.dims(), cfg.pooled_projection_dim),
            ));
        }
        Ok((b, h, w))
    }

    /// One denoiser call: `latents` `(B, in_channels, H, W)`, `timestep` `(B,)` (the flow-match schedule's
    /// timesteps, `σ·1000`), `context` `(B, S, joint_attention_dim)`, `pooled` `(B, pooled_projection_dim)` →
    /// the velocity `(B, out_channels, H, W)`.
    pub fn forward(
        &self,
        latents: &Tensor,
        timestep: &Tensor,
        context: &Tensor,
        pooled: &Tensor,
    ) -> Result<Tensor> {
        self.forward_skipping(latents, timestep, context, pooled, &[])
    }

    /// [`Self::forward`] with diffusers' `skip_layers`: the blocks at these indices are left out, their inputs
    /// passed on unchanged (skip-layer guidance). Skipping the last block keeps the context stream the block
    /// before it made, which nothing reads. An index past the last block is an input error.
    pub fn forward_skipping(
        &self,
        latents: &Tensor,
        timestep: &Tensor,
        context: &Tensor,
        pooled: &Tensor,
        skip_layers: &[usize],
    ) -> Result<Tensor> {
        let (b, h, w) = self.check_inputs(latents, timestep, context, pooled)?;
        if let Some(&l) = skip_layers.iter().find(|&&l| l >= self.blocks.len()) {
            return Err(input_err(
                MODEL,
                format!("skip layer {l} does not exist (layers 0 to {})", self.blocks.len() - 1),
            ));
        }
        let run = || -> candle_core::Result<Tensor> {
            let prepare = |t: &Tensor| t.to_device(&self.device)?.to_dtype(self.dtype)?.contiguous();
            // What copies from the host (the timestep features' table, the layouts of strided copies) happens
            // before the network's body and after it: a recording cannot hold such copies.
            let temb_act = self.conditioning(timestep, &prepare(pooled)?)?;
            let patches = self.patchify(&prepare(latents)?, (b, h, w))?;
            let (context, pos) = (prepare(context)?, self.pos_rows((b, h, w))?);
            let rows = if skip_layers.is_empty() && sdhive_cuda_kernels::graphs_on(&self.device) {
                self.graphs
                    .run([&patches, &temb_act, &context, &pos], |[x, t, c, p]| self.run(x, t, c, p, &[]))?
            } else {
                self.run(&patches, &temb_act, &context, &pos, skip_layers)?
            };
            self.unpatchify(&rows, (b, h, w))
        };
        run().ctx(MODEL)
    }

    /// The blocks' conditioning, already through SiLU: the timestep's embedding plus the pooled text's, `(B, D)`.
    fn conditioning(&self, timestep: &Tensor, pooled: &Tensor) -> candle_core::Result<Tensor> {
        let t = self.time_proj.forward(&timestep.to_device(&self.device)?)?.to_dtype(self.dtype)?;
        let temb = (self.timestep_embedder.forward(&t)? + self.text_embedder.forward(pooled)?)?;
        ops::silu(&temb)
    }

    /// The network on `patches` (the latents cut into `(B, H·W, C·p·p)` patch rows) and `context` (on the device,
    /// in its dtype) with the blocks' conditioning `temb_act` ([`Self::conditioning`]) and the positional rows
    /// `pos` `(B, H·W, D)`, up to `proj_out`: `(B, H·W, p·p·out_channels)`. Nothing in it copies from the host,
    /// so a CUDA graph can hold it.
    fn run(
        &self,
        patches: &Tensor,
        temb_act: &Tensor,
        context: &Tensor,
        pos: &Tensor,
        skip_layers: &[usize],
    ) -> candle_core::Result<Tensor> {
        let mut x = ops::linear(&self.patch_proj, patches, Some(pos))?;
        let mut ctx = Some(ops::linear(&self.context_embedder, context, None)?);
        for (i, block) in self.blocks.iter().enumerate() {
            if skip_layers.contains(&i) {
                continue;
            }
            let Some(cur) = ctx.as_ref() else {
                candle_core::bail!("block {i} follows the context-pre-only block");
            };
            let (nx, nc) = block.forward(&x, cur, temb_act, &self.norm)?;
            x = nx;
            ctx = nc;
        }
        let m = chunks(&ops::linear(&self.norm_out, temb_act, None)?, 2)?;
        let x = self.norm.modulate(&x, &m[1], &m[0])?;
        ops::linear(&self.proj_out, &x, None)
    }

    /// The latents `(B, C, H·p, W·p)` as patch rows `(B, H·W, C·p·p)`, as the patchifying convolution reads them.
    fn patchify(&self, latents: &Tensor, (b, h, w): (usize, usize, usize)) -> candle_core::Result<Tensor> {
        let (p, c) = (self.config.patch_size, self.config.in_channels);
        latents.reshape((b, c, h, p, w, p))?.permute((0, 2, 4, 1, 3, 5))?.contiguous()?.reshape((
            b,
            h * w,
            c * p * p,
        ))
    }

    /// `proj_out`'s rows back to the velocity `(B, out_channels, H·p, W·p)`.
    fn unpatchify(&self, rows: &Tensor, (b, h, w): (usize, usize, usize)) -> candle_core::Result<Tensor> {
        let (p, out_c) = (self.config.patch_size, self.config.out_channels());
        rows.reshape((b, h, w, p, p, out_c))?.permute((0, 5, 1, 3, 2, 4))?.contiguous()?.reshape((
            b,
            out_c,
            h * p,
            w * p,
        ))
    }

    /// The positional rows for `b` samples of `h`×`w` patches, `(B, H·W, D)`: made once per shape and kept, so a
    /// step adds them in the patch projection's epilogue and a recorded step finds the same tensor again.
    fn pos_rows(&self, (b, h, w): (usize, usize, usize)) -> candle_core::Result<Tensor> {
        let mut kept = self.pos_rows.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((shape, rows)) = kept.as_ref() {
            if *shape == (b, h, w) {
                return Ok(rows.clone());
            }
        }
        let dim = self.config.inner_dim();
        let rows = self.pos_embed((h, w))?.broadcast_as((b, h * w, dim))?.contiguous()?;
        *kept = Some(((b, h, w), rows.clone()));
        Ok(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The computed table equals diffusers' formula at points worked by hand: token (row 1, column 2) of a grid
    /// whose coordinates are halved (grid 4, base 2) has x = 1, y = 0.5.
    #[test]
    fn sincos_table_matches_formula() {
        let dim = 8;
        let t = sincos_2d(dim, (4, 4), 2);
        let row = &t[(4 + 2) * dim..(4 + 3) * dim];
        let omega = [1.0f64, 1.0 / 100.0];
        let mut want = Vec::new();
        for pos in [1.0f64, 0.5] {
            want.extend(omega.iter().map(|w| (pos * w).sin()));
            want.extend(omega.iter().map(|w| (pos * w).cos()));
        }
        for (a, b) in row.iter().zip(&want) {
            assert!((*a as f64 - b).abs() < 1e-7, "{row:?} vs {want:?}");
        }
    }

    #[test]
    fn config_rejects_mismatched_widths_and_unknown_norms() {
        let cfg = SD3TransformerConfig { caption_projection_dim: 100, ..Default::default() };
        let e = cfg.validate("t").expect_err("caption width").to_string();
        assert!(e.contains("caption_projection_dim"), "{e}");
        let cfg = SD3TransformerConfig { qk_norm: Some("l2".into()), ..Default::default() };
        assert!(cfg.validate("t").expect_err("qk_norm").to_string().contains("qk_norm"));
        let cfg = SD3TransformerConfig { dual_attention_layers: vec![18], ..Default::default() };
        assert!(cfg.validate("t").expect_err("dual").to_string().contains("dual_attention_layers"));
        assert!(SD3TransformerConfig::default().validate("t").is_ok());
    }
}
