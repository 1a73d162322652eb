//! The T5 v1.1 encoder of SD3's third text encoder (transformers' `T5EncoderModel`), configured from
//! `text_encoder_3/config.json` and loaded from transformers weight names (`shared.weight`,
//! `encoder.block.{i}.layer.{0,1}.…`, `encoder.final_layer_norm.weight`; one file or a sharded index).
//!
//! What makes it T5 rather than a plain transformer, each as transformers computes it:
//! * no position embeddings: the first layer's self-attention owns a table of learned biases per head for
//!   bucketed relative distances (bidirectional buckets: half for keys after the query; within each half,
//!   exact distances below a quarter of `relative_attention_num_buckets`, then logarithmic bins up to
//!   `relative_attention_max_distance`); the bias is computed once and added to every layer's scores;
//! * scores are `q·kᵀ` without the `1/√d` scale;
//! * RMS layer norms (no mean, no bias, the mean square taken in f32);
//! * a gated feed-forward for `feed_forward_proj = "gated-gelu"` (`gelu_tanh(wi_0 x) · wi_1 x → wo`).
//!
//! diffusers' SD3 pipeline calls the encoder without an attention mask, so padding positions attend and are
//! attended to; [`T5EncoderModel::forward_masked`] takes transformers' key mask for callers that want it.
//! In f16, `wo` stays in f32 and the residual stream is promoted to f32 from the first feed-forward on, as
//! transformers' `_keep_in_fp32_modules = ["wo"]` makes it (bf16 keeps every weight in bf16).

use crate::config::read_json;
use crate::error::{input_err, invalid, weights_err, Result, TensorContext};
use crate::ops;
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{Embedding, Linear, VarBuilder};
use serde::{Deserialize, Serialize};
use std::path::Path;

const MODEL: &str = "t5 text encoder";

/// The feed-forward activation, from `feed_forward_proj` as transformers' `T5Config` derives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum T5Activation {
    Relu,
    /// Exact (erf) GELU, transformers' `gelu`.
    Gelu,
    /// tanh-approximated GELU (`gelu_new`), which `"gated-gelu"` selects.
    GeluNew,
    Silu,
}

/// `text_encoder_3/config.json`; defaults are transformers' `T5Config` defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct T5Config {
    pub vocab_size: usize,
    pub d_model: usize,
    pub d_kv: usize,
    pub d_ff: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub relative_attention_num_buckets: usize,
    pub relative_attention_max_distance: usize,
    pub layer_norm_epsilon: f64,
    /// `"{act}"` or `"gated-{act}"`; `dense_act_fn` / `is_gated_act` in the file are derived from it.
    pub feed_forward_proj: String,
}

impl Default for T5Config {
    fn default() -> Self {
        Self {
            vocab_size: 32128,
            d_model: 512,
            d_kv: 64,
            d_ff: 2048,
            num_layers: 6,
            num_heads: 8,
            relative_attention_num_buckets: 32,
            relative_attention_max_distance: 128,
            layer_norm_epsilon: 1e-6,
            feed_forward_proj: "relu".into(),
        }
    }
}

impl T5Config {
    pub fn from_file(path: &Path) -> Result<Self> {
        let cfg: Self = read_json(path)?;
        cfg.validate(&path.display().to_string())?;
        Ok(cfg)
    }

    /// google/t5-v1_1-xxl's encoder, as in SD3's `text_encoder_3/config.json`.
    pub fn t5_v1_1_xxl() -> Self {
        Self {
            d_model: 4096,
            d_kv: 64,
            d_ff: 10240,
            num_layers: 24,
            num_heads: 64,
            feed_forward_proj: "gated-gelu".into(),
            ..Self::default()
        }
    }

    /// The activation and whether the feed-forward is gated, by transformers' rule: `"gated-gelu"` means
    /// `gelu_new`, otherwise the last `-`-separated word names the activation.
    pub fn activation(&self, origin: &str) -> Result<(T5Activation, bool)> {
        let parts: Vec<&str> = self.feed_forward_proj.split('-').collect();
        let gated = match parts.as_slice() {
            [_] => false,
            ["gated", _] => true,
            _ => {
                return Err(invalid(
                    origin,
                    "feed_forward_proj",
                    format!("`{}` is not `{{act}}` or `gated-{{act}}`", self.feed_forward_proj),
                ))
            }
        };
        if self.feed_forward_proj == "gated-gelu" {
            return Ok((T5Activation::GeluNew, true));
        }
        let act = match parts[parts.len() - 1] {
            "relu" => T5Activation::Relu,
            "gelu" => T5Activation::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" => T5Activation::GeluNew,
            "silu" | "swish" => T5Activation::Silu,
            other => {
                return Err(invalid(
                    origin,
                    "feed_forward_proj",
                    format!("activation `{other}` is not supported"),
                ))
            }
        };
        Ok((act, gated))
    }

    pub fn validate(&self, origin: &str) -> Result<()> {
        self.activation(origin)?;
        for (field, v) in [
            ("d_model", self.d_model),
            ("d_kv", self.d_kv),
            ("d_ff", self.d_ff),
            ("num_heads", self.num_heads),
            ("vocab_size", self.vocab_size),
        ] {
            if v == 0 {
                return Err(invalid(origin, field, "must be > 0"));
            }
        }
        // Bidirectional buckets halve the count and use half of each half for exact distances; below 4 the
        // logarithmic bins have no room and transformers computes NaN bucket positions.
        if self.relative_attention_num_buckets < 4 {
            return Err(invalid(origin, "relative_attention_num_buckets", "must be at least 4"));
        }
        if self.relative_attention_max_distance <= self.relative_attention_num_buckets / 4 {
            return Err(invalid(
                origin,
                "relative_attention_max_distance",
                format!(
                    "must exceed relative_attention_num_buckets / 4 = {}",
                    self.relative_attention_num_buckets / 4
                ),
            ));
        }
        if !(self.layer_norm_epsilon.is_finite() && self.layer_norm_epsilon >= 0.0) {
            return Err(invalid(origin, "layer_norm_epsilon", "must be a finite number >= 0"));
        }
        Ok(())
    }
}

/// transformers' `_relative_position_bucket` with `bidirectional=True` for `relative = key - query`, in the
/// same f32 arithmetic (the logarithmic bins' boundaries depend on it).
fn relative_position_bucket(relative: i64, num_buckets: usize, max_distance: usize) -> u32 {
    let half = (num_buckets / 2) as i64;
    let mut bucket = if relative > 0 { half } else { 0 };
    let distance = relative.abs();
    let max_exact = half / 2;
    bucket += if distance < max_exact {
        distance
    } else {
        // Python divides the two ints as floats and takes math.log in f64; torch then scales in f32.
        let log_ratio = (max_distance as f64 / max_exact as f64).ln() as f32;
        let scaled = (distance as f32 / max_exact as f32).ln() / log_ratio * (half - max_exact) as f32;
        (max_exact + scaled as i64).min(half - 1)
    };
    bucket as u32
}

/// T5's RMS norm: `weight · x / √(mean(x²) + eps)`, the mean square in f32, the result in the weight's dtype.
#[derive(Debug, Clone)]
struct T5LayerNorm {
    weight: Tensor,
    eps: f64,
}

impl T5LayerNorm {
    fn new(vb: VarBuilder, dim: usize, eps: f64) -> candle_core::Result<Self> {
        Ok(Self { weight: vb.get(dim, "weight")?, eps })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = x.to_dtype(DType::F32)?;
        let variance = x.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = x.broadcast_mul(&(variance + self.eps)?.sqrt()?.recip()?)?;
        normed.to_dtype(self.weight.dtype())?.broadcast_mul(&self.weight)
    }
}

/// `a + b`, in f32 when their dtypes differ (torch's promotion of an f16 state meeting `wo`'s f32 output).
fn add_promoting(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    if a.dtype() == b.dtype() {
        a + b
    } else {
        a.to_dtype(DType::F32)? + b.to_dtype(DType::F32)?
    }
}

/// transformers' guard for f16 states: clamp to the largest finite value, 1000 below it once an inf appeared.
fn clamp_f16(x: Tensor) -> candle_core::Result<Tensor> {
    if x.dtype() != DType::F16 {
        return Ok(x);
    }
    let max = f64::from(half::f16::MAX);
    let largest = x.abs()?.flatten_all()?.max(0)?.to_dtype(DType::F32)?.to_scalar::<f32>()?;
    let limit = if largest.is_infinite() { max - 1000.0 } else { max };
    x.clamp(-limit, limit)
}

#[derive(Debug, Clone)]
struct T5Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    heads: usize,
}

impl T5Attention {
    fn new(vb: VarBuilder, cfg: &T5Config) -> candle_core::Result<Self> {
        let inner = cfg.num_heads * cfg.d_kv;
        Ok(Self {
            q: candle_nn::linear_no_bias(cfg.d_model, inner, vb.pp("q"))?,
            k: candle_nn::linear_no_bias(cfg.d_model, inner, vb.pp("k"))?,
            v: candle_nn::linear_no_bias(cfg.d_model, inner, vb.pp("v"))?,
            o: candle_nn::linear_no_bias(inner, cfg.d_model, vb.pp("o"))?,
            heads: cfg.num_heads,
        })
    }

    /// `bias` is the position bias (plus any key mask) as `(B·H, S, S)`.
    fn forward(&self, x: &Tensor, bias: &Tensor) -> candle_core::Result<Tensor> {
        let q = ops::split_heads(&ops::linear(&self.q, x, None)?, self.heads)?;
        let k = ops::split_heads(&ops::linear(&self.k, x, None)?, self.heads)?;
        let v = ops::split_heads(&ops::linear(&self.v, x, None)?, self.heads)?;
        let o = ops::attention(&q, &k, &v, 1.0, Some(bias), false)?;
        ops::linear(&self.o, &ops::merge_heads(&o, self.heads)?, None)
    }
}

#[derive(Debug, Clone)]
struct T5FeedForward {
    /// `wi` of the plain form, `wi_0` (the activated half) of the gated one.
    wi_0: Linear,
    wi_1: Option<Linear>,
    wo: Linear,
    act: T5Activation,
}

impl T5FeedForward {
    fn new(vb: VarBuilder, cfg: &T5Config, act: T5Activation, gated: bool) -> candle_core::Result<Self> {
        let (d, ff) = (cfg.d_model, cfg.d_ff);
        let (wi_0, wi_1) = if gated {
            (
                candle_nn::linear_no_bias(d, ff, vb.pp("wi_0"))?,
                Some(candle_nn::linear_no_bias(d, ff, vb.pp("wi_1"))?),
            )
        } else {
            (candle_nn::linear_no_bias(d, ff, vb.pp("wi"))?, None)
        };
        let wo_vb = if vb.dtype() == DType::F16 { vb.pp("wo").set_dtype(DType::F32) } else { vb.pp("wo") };
        Ok(Self { wi_0, wi_1, wo: candle_nn::linear_no_bias(ff, d, wo_vb)?, act })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = ops::linear(&self.wi_0, x, None)?;
        let h = match self.act {
            T5Activation::Relu => h.relu()?,
            T5Activation::Gelu => h.gelu_erf()?,
            T5Activation::GeluNew => h.gelu()?,
            T5Activation::Silu => ops::silu(&h)?,
        };
        let h = match &self.wi_1 {
            Some(wi_1) => (h * ops::linear(wi_1, x, None)?)?,
            None => h,
        };
        ops::linear(&self.wo, &h.to_dtype(self.wo.weight().dtype())?, None)
    }
}

#[derive(Debug, Clone)]
struct T5Block {
    attn_norm: T5LayerNorm,
    attn: T5Attention,
    ff_norm: T5LayerNorm,
    ff: T5FeedForward,
}

impl T5Block {
    fn new(vb: VarBuilder, cfg: &T5Config, act: T5Activation, gated: bool) -> candle_core::Result<Self> {
        let (sa, ff) = (vb.pp("layer.0"), vb.pp("layer.1"));
        Ok(Self {
            attn_norm: T5LayerNorm::new(sa.pp("layer_norm"), cfg.d_model, cfg.layer_norm_epsilon)?,
            attn: T5Attention::new(sa.pp("SelfAttention"), cfg)?,
            ff_norm: T5LayerNorm::new(ff.pp("layer_norm"), cfg.d_model, cfg.layer_norm_epsilon)?,
            ff: T5FeedForward::new(ff.pp("DenseReluDense"), cfg, act, gated)?,
        })
    }

    fn forward(&self, x: &Tensor, bias: &Tensor) -> candle_core::Result<Tensor> {
        let x = clamp_f16(add_promoting(x, &self.attn.forward(&self.attn_norm.forward(x)?, bias)?)?)?;
        clamp_f16(add_promoting(&x, &self.ff.forward(&self.ff_norm.forward(&x)?)?)?)
    }
}

/// The T5 encoder stack with its shared token embedding.
#[derive(Debug, Clone)]
pub struct T5EncoderModel {
    shared: Embedding,
    /// `(num_buckets, num_heads)`, the first block's `relative_attention_bias`.
    relative_attention_bias: Embedding,
    blocks: Vec<T5Block>,
    final_layer_norm: T5LayerNorm,
    config: T5Config,
    dtype: DType,
    device: Device,
}

impl T5EncoderModel {
    /// Builds the encoder from transformers names. The token table is `shared.weight`, or its tied copy
    /// `encoder.embed_tokens.weight` when a file holds only that one.
    pub fn new(vb: VarBuilder, cfg: &T5Config) -> Result<Self> {
        cfg.validate(MODEL)?;
        let (act, gated) = cfg.activation(MODEL)?;
        let build = || -> candle_core::Result<Self> {
            let table = if !vb.contains_tensor("shared.weight")
                && vb.contains_tensor("encoder.embed_tokens.weight")
            {
                vb.pp("encoder.embed_tokens")
            } else {
                vb.pp("shared")
            };
            let shared = candle_nn::embedding(cfg.vocab_size, cfg.d_model, table)?;
            let enc = vb.pp("encoder");
            let relative_attention_bias = candle_nn::embedding(
                cfg.relative_attention_num_buckets,
                cfg.num_heads,
                enc.pp("block.0.layer.0.SelfAttention.relative_attention_bias"),
            )?;
            let blocks = (0..cfg.num_layers)
                .map(|i| T5Block::new(enc.pp(format!("block.{i}")), cfg, act, gated))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let final_layer_norm =
                T5LayerNorm::new(enc.pp("final_layer_norm"), cfg.d_model, cfg.layer_norm_epsilon)?;
            Ok(Self {
                shared,
                relative_attention_bias,
                blocks,
                final_layer_norm,
                config: cfg.clone(),
                dtype: vb.dtype(),
                device: vb.device().clone(),
            })
        };
        build().map_err(weights_err(MODEL))
    }

    /// Reads `dir/config.json` and the weights in `dir` (`model.safetensors` or a sharded index).
    pub fn from_dir(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let cfg = T5Config::from_file(&dir.join("config.json"))?;
        let vb = crate::loading::load_component(dir, dtype, device)?;
        Self::new(vb, &cfg).map_err(|e| e.with_weight_origin(&crate::loading::describe_weights(dir)))
    }

    pub fn config(&self) -> &T5Config {
        &self.config
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// `last_hidden_state` `(B, S, d_model)` for token ids `(B, S)` (u32 or i64), every position attending to
    /// every other: what diffusers' SD3 pipeline computes.
    pub fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        self.forward_masked(input_ids, None)
    }

    /// [`Self::forward`] with transformers' `attention_mask` `(B, S)`: keys where it is 0 get the dtype's
    /// lowest value added to their scores.
    pub fn forward_masked(&self, input_ids: &Tensor, attention_mask: Option<&Tensor>) -> Result<Tensor> {
        let (b, s) = input_ids
            .dims2()
            .map_err(|e| input_err(MODEL, format!("input_ids must be (batch, seq): {e}")))?;
        if s == 0 || b == 0 {
            return Err(input_err(MODEL, "input_ids is empty"));
        }
        let ids = input_ids.to_device(&self.device).and_then(|t| t.to_dtype(DType::U32)).ctx(MODEL)?;
        // i64 ids below zero wrap to huge u32s, which this check refuses too.
        let max_id =
            ids.flatten_all().and_then(|t| t.max(0)).and_then(|t| t.to_scalar::<u32>()).ctx(MODEL)?;
        if max_id as usize >= self.config.vocab_size {
            return Err(input_err(
                MODEL,
                format!("token id {max_id} >= vocab_size {}", self.config.vocab_size),
            ));
        }
        let mask = match attention_mask {
            Some(m) => {
                if m.dims() != [b, s] {
                    return Err(input_err(
                        MODEL,
                        format!("attention_mask is {:?}, input_ids ({b}, {s})", m.dims()),
                    ));
                }
                Some(self.key_mask(m, (b, s)).ctx(MODEL)?)
            }
            None => None,
        };
        self.run(&ids, mask.as_ref(), (b, s)).ctx(MODEL)
    }

    /// `(B, 1, 1, S)`: 0 where the mask is nonzero, the dtype's lowest value elsewhere.
    fn key_mask(&self, mask: &Tensor, (b, s): (usize, usize)) -> candle_core::Result<Tensor> {
        let lowest = match self.dtype {
            DType::F16 => f64::from(half::f16::MIN),
            DType::BF16 => f64::from(half::bf16::MIN),
            _ => f64::from(f32::MIN),
        };
        let keep = mask.to_device(&self.device)?.to_dtype(DType::F32)?.ne(0f64)?.to_dtype(self.dtype)?;
        // (1 - keep) · lowest, kept in the model's dtype so it never overflows to -inf.
        let blocked = (keep.affine(-1.0, 1.0)? * lowest)?;
        blocked.reshape((b, 1, 1, s))
    }

    /// The relative position bias `(1, H, S, S)` that every layer adds to its scores.
    pub fn position_bias(&self, s: usize) -> Result<Tensor> {
        self.bias_table(s).ctx(MODEL)
    }

    fn bias_table(&self, s: usize) -> candle_core::Result<Tensor> {
        let cfg = &self.config;
        let buckets: Vec<u32> = (0..s as i64)
            .flat_map(|q| {
                (0..s as i64).map(move |k| {
                    relative_position_bucket(
                        k - q,
                        cfg.relative_attention_num_buckets,
                        cfg.relative_attention_max_distance,
                    )
                })
            })
            .collect();
        let buckets = Tensor::from_vec(buckets, (s, s), &self.device)?;
        self.relative_attention_bias.forward(&buckets)?.permute((2, 0, 1))?.unsqueeze(0)
    }

    fn run(
        &self,
        ids: &Tensor,
        mask: Option<&Tensor>,
        (b, s): (usize, usize),
    ) -> candle_core::Result<Tensor> {
        let heads = self.config.num_heads;
        let bias = self.bias_table(s)?;
        let bias = match mask {
            Some(m) => bias.broadcast_add(m)?,
            None => bias.broadcast_as((b, heads, s, s))?,
        };
        let bias = bias.contiguous()?.reshape((b * heads, s, s))?;
        let mut x = self.shared.forward(ids)?;
        for block in &self.blocks {
            x = block.forward(&x, &bias)?;
        }
        self.final_layer_norm.forward(&x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_match_transformers() {
        // transformers' `_relative_position_bucket(torch.arange(0, 40), True, 32, 128)`.
        let want = [
            0, 17, 18, 19, 20, 21, 22, 23, 24, 24, 24, 24, 25, 25, 25, 25, 26, 26, 26, 26, 26, 26, 26, 27,
            27, 27, 27, 27, 27, 27, 27, 27, 28, 28, 28, 28, 28, 28, 28, 28,
        ];
        for (d, &w) in want.iter().enumerate() {
            assert_eq!(relative_position_bucket(d as i64, 32, 128), w, "distance +{d}");
            // Keys before the query use the lower half.
            let back = if d == 0 { 0 } else { w - 16 };
            assert_eq!(relative_position_bucket(-(d as i64), 32, 128), back, "distance -{d}");
        }
        assert_eq!(relative_position_bucket(1000, 32, 128), 31);
        assert_eq!(relative_position_bucket(-1000, 32, 128), 15);
    }

    #[test]
    fn activation_follows_transformers() {
        let cfg = |f: &str| T5Config { feed_forward_proj: f.into(), ..T5Config::default() };
        assert_eq!(cfg("gated-gelu").activation("t").ok(), Some((T5Activation::GeluNew, true)));
        assert_eq!(cfg("gelu").activation("t").ok(), Some((T5Activation::Gelu, false)));
        assert_eq!(cfg("gated-silu").activation("t").ok(), Some((T5Activation::Silu, true)));
        assert_eq!(cfg("relu").activation("t").ok(), Some((T5Activation::Relu, false)));
        let err = cfg("gated-gelu-x").activation("t").map(|_| ()).unwrap_err().to_string();
        assert!(err.contains("feed_forward_proj"), "{err}");
        assert!(cfg("tanh").validate("t").is_err());
    }
}
