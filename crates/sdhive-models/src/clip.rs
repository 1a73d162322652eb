//! The CLIP text encoder (transformers' `CLIPTextModel` / `CLIPTextModelWithProjection`),
//! configured from `text_encoder/config.json` and loaded from transformers weight names. On CUDA its layers replay
//! from a CUDA graph (`graphed.rs`): run kernel by kernel, a prompt's few hundred small launches cost the host
//! several milliseconds per request while the GPU waits.

use crate::config::read_json;
use crate::error::{input_err, invalid, weights_err, ModelError, Result, TensorContext};
use crate::graphed::{Graphs, Refresh};
use crate::layers::{linear, LayerNorm};
use crate::ops;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Embedding, Linear, VarBuilder};
use serde::{Deserialize, Serialize};
use std::path::Path;

const MODEL: &str = "clip text encoder";

/// The feed-forward activation named by `hidden_act`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClipActivation {
    QuickGelu,
    /// Exact (erf) GELU, as `nn.functional.gelu`.
    Gelu,
    /// tanh-approximated GELU, which transformers calls `gelu_new` / `gelu_pytorch_tanh`.
    #[serde(alias = "gelu_pytorch_tanh")]
    GeluNew,
}

/// `text_encoder/config.json`; defaults are transformers' `CLIPTextConfig` defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ClipTextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub projection_dim: Option<usize>,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub max_position_embeddings: usize,
    pub hidden_act: ClipActivation,
    pub layer_norm_eps: f64,
    pub pad_token_id: Option<u32>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
}

impl Default for ClipTextConfig {
    fn default() -> Self {
        Self {
            vocab_size: 49408,
            hidden_size: 512,
            intermediate_size: 2048,
            projection_dim: Some(512),
            num_hidden_layers: 12,
            num_attention_heads: 8,
            max_position_embeddings: 77,
            hidden_act: ClipActivation::QuickGelu,
            layer_norm_eps: 1e-5,
            pad_token_id: Some(1),
            bos_token_id: Some(49406),
            eos_token_id: Some(49407),
        }
    }
}

impl ClipTextConfig {
    /// Reads `config.json`; a full `CLIPConfig` (with a `text_config` section) also works.
    pub fn from_file(path: &Path) -> Result<Self> {
        let value: serde_json::Value = read_json(path)?;
        let section = match value.get("text_config") {
            Some(tc) if tc.is_object() && value.get("hidden_size").is_none() => tc.clone(),
            _ => value,
        };
        let cfg: Self = serde_json::from_value(section)
            .map_err(|source| ModelError::ConfigParse { path: path.to_path_buf(), source })?;
        cfg.validate(&path.display().to_string())?;
        Ok(cfg)
    }

    pub fn validate(&self, origin: &str) -> Result<()> {
        if self.num_attention_heads == 0 || !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(invalid(
                origin,
                "num_attention_heads",
                format!("{} heads do not divide hidden_size {}", self.num_attention_heads, self.hidden_size),
            ));
        }
        if self.max_position_embeddings == 0 {
            return Err(invalid(origin, "max_position_embeddings", "must be > 0"));
        }
        Ok(())
    }

    /// openai/clip-vit-large-patch14 text tower, as in SD1.x `text_encoder/config.json`.
    pub fn sd15() -> Self {
        Self {
            hidden_size: 768,
            intermediate_size: 3072,
            projection_dim: Some(768),
            num_hidden_layers: 12,
            num_attention_heads: 12,
            hidden_act: ClipActivation::QuickGelu,
            bos_token_id: Some(0),
            eos_token_id: Some(2),
            ..Self::default()
        }
    }

    /// OpenCLIP ViT-bigG text tower, as in SDXL `text_encoder_2/config.json`.
    pub fn sdxl_text_encoder_2() -> Self {
        Self {
            hidden_size: 1280,
            intermediate_size: 5120,
            projection_dim: Some(1280),
            num_hidden_layers: 32,
            num_attention_heads: 20,
            hidden_act: ClipActivation::Gelu,
            bos_token_id: Some(0),
            eos_token_id: Some(2),
            ..Self::default()
        }
    }
}

/// Everything the pipelines read from one encoder pass.
#[derive(Debug, Clone)]
pub struct ClipTextOutput {
    /// Embedding output followed by each layer's output (transformers' `hidden_states`), so
    /// `hidden_states[len - 1 - k]` is the input to clip-skip `k`; none of them is final-normed.
    pub hidden_states: Vec<Tensor>,
    /// The last layer's output after `final_layer_norm`, `(B, S, H)`.
    pub last_hidden_state: Tensor,
    /// `last_hidden_state` at each sequence's EOS position, `(B, H)`.
    pub pooled: Tensor,
    /// `text_projection(pooled)`, `(B, P)`, only with the projection head.
    pub text_embeds: Option<Tensor>,
}

#[derive(Debug, Clone)]
struct ClipAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    out_proj: Linear,
    heads: usize,
    scale: f64,
}

impl ClipAttention {
    fn new(vb: VarBuilder, cfg: &ClipTextConfig) -> candle_core::Result<Self> {
        let h = cfg.hidden_size;
        Ok(Self {
            q_proj: linear(vb.pp("q_proj"), h, h, true)?,
            k_proj: linear(vb.pp("k_proj"), h, h, true)?,
            v_proj: linear(vb.pp("v_proj"), h, h, true)?,
            out_proj: linear(vb.pp("out_proj"), h, h, true)?,
            heads: cfg.num_attention_heads,
            scale: ((h / cfg.num_attention_heads) as f64).powf(-0.5),
        })
    }

    /// Attention over `x`, plus `residual`, which the output projection adds (on a GPU in its epilogue, as it
    /// adds every projection's bias: the encoders are bound by launching their small kernels).
    /// With the causal `mask` the heads are split and masked by it; without one (where
    /// [`ClipTextModel::fused_causal`]) the causal kernel reads them in place and masks them itself.
    fn forward(&self, x: &Tensor, mask: Option<&Tensor>, residual: &Tensor) -> candle_core::Result<Tensor> {
        let q = ops::linear(&self.q_proj, x, None)?;
        let k = ops::linear(&self.k_proj, x, None)?;
        let v = ops::linear(&self.v_proj, x, None)?;
        let o = match mask {
            None => sdhive_cuda_kernels::causal_attention(&q, &k, &v, self.heads, self.scale)?,
            Some(mask) => {
                let split = |t: &Tensor| ops::split_heads(t, self.heads);
                let o = ops::attention(&split(&q)?, &split(&k)?, &split(&v)?, self.scale, Some(mask), false)?;
                ops::merge_heads(&o, self.heads)?
            }
        };
        ops::linear(&self.out_proj, &o, Some(residual))
    }
}

#[derive(Debug, Clone)]
struct ClipLayer {
    layer_norm1: LayerNorm,
    self_attn: ClipAttention,
    layer_norm2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    act: ClipActivation,
}

impl ClipLayer {
    fn new(vb: VarBuilder, cfg: &ClipTextConfig) -> candle_core::Result<Self> {
        let h = cfg.hidden_size;
        Ok(Self {
            layer_norm1: LayerNorm::new(vb.pp("layer_norm1"), h, cfg.layer_norm_eps)?,
            self_attn: ClipAttention::new(vb.pp("self_attn"), cfg)?,
            layer_norm2: LayerNorm::new(vb.pp("layer_norm2"), h, cfg.layer_norm_eps)?,
            fc1: linear(vb.pp("mlp.fc1"), h, cfg.intermediate_size, true)?,
            fc2: linear(vb.pp("mlp.fc2"), cfg.intermediate_size, h, true)?,
            act: cfg.hidden_act,
        })
    }

    fn forward(&self, x: &Tensor, mask: Option<&Tensor>) -> candle_core::Result<Tensor> {
        let x = self.self_attn.forward(&self.layer_norm1.forward(x)?, mask, x)?;
        let h = ops::linear(&self.fc1, &self.layer_norm2.forward(&x)?, None)?;
        let h = match self.act {
            ClipActivation::QuickGelu => ops::quick_gelu(&h)?,
            ClipActivation::Gelu => h.gelu_erf()?,
            ClipActivation::GeluNew => h.gelu()?,
        };
        ops::linear(&self.fc2, &h, Some(&x))
    }
}

/// CLIP text transformer, optionally with the `text_projection` head.
#[derive(Debug, Clone)]
pub struct ClipTextModel {
    token_embedding: Embedding,
    position_embedding: Embedding,
    layers: Vec<ClipLayer>,
    final_layer_norm: LayerNorm,
    text_projection: Option<Linear>,
    config: ClipTextConfig,
    dtype: DType,
    device: Device,
    /// The layers' recordings, by token shape: the embedded tokens in, every layer's output and the final norm's
    /// stacked out.
    graphs: Graphs<1>,
    graphs_wanted: bool,
}

impl ClipTextModel {
    /// Builds the encoder from transformers names (`text_model.…`, `text_projection.weight`;
    /// the `text_model.` prefix may be absent, as transformers 5 writes `CLIPTextModel`).
    pub fn new(vb: VarBuilder, cfg: &ClipTextConfig, with_projection: bool) -> Result<Self> {
        cfg.validate(MODEL)?;
        let projection_dim = match (with_projection, cfg.projection_dim) {
            (true, None) => {
                return Err(invalid(MODEL, "projection_dim", "required for CLIPTextModelWithProjection"))
            }
            (_, p) => p,
        };
        let build = || -> candle_core::Result<Self> {
            // transformers < 5 saves every CLIP text tower under `text_model.`; v5 drops the
            // prefix for the plain `CLIPTextModel`, so accept both layouts.
            let bare = !vb.contains_tensor("text_model.embeddings.token_embedding.weight")
                && vb.contains_tensor("embeddings.token_embedding.weight");
            let tm = if bare { vb.clone() } else { vb.pp("text_model") };
            let emb = tm.pp("embeddings");
            let token_embedding =
                candle_nn::embedding(cfg.vocab_size, cfg.hidden_size, emb.pp("token_embedding"))?;
            let position_embedding = candle_nn::embedding(
                cfg.max_position_embeddings,
                cfg.hidden_size,
                emb.pp("position_embedding"),
            )?;
            let layers = (0..cfg.num_hidden_layers)
                .map(|i| ClipLayer::new(tm.pp(format!("encoder.layers.{i}")), cfg))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let final_layer_norm =
                LayerNorm::new(tm.pp("final_layer_norm"), cfg.hidden_size, cfg.layer_norm_eps)?;
            let text_projection = match (with_projection, projection_dim) {
                (true, Some(p)) => Some(linear(vb.pp("text_projection"), cfg.hidden_size, p, false)?),
                _ => None,
            };
            Ok(Self {
                token_embedding,
                position_embedding,
                layers,
                final_layer_norm,
                text_projection,
                config: cfg.clone(),
                dtype: vb.dtype(),
                device: vb.device().clone(),
                graphs: Graphs::new(MODEL, [Refresh::Always]),
                graphs_wanted: true,
            })
        };
        build().map_err(weights_err(MODEL))
    }

    /// Whether the layers may replay from CUDA graphs (on by default, where `sdhive_cuda_kernels::graphs_on`): off,
    /// every call runs kernel by kernel and records nothing.
    pub fn set_cuda_graphs(&mut self, on: bool) {
        self.graphs_wanted = on;
    }

    /// How many token shapes replay from a recorded CUDA graph now (none off CUDA), and why recording failed for
    /// the others.
    pub fn graph_status(&self) -> (usize, Vec<String>) {
        self.graphs.status()
    }

    /// Reads `dir/config.json` and the weights in `dir`.
    pub fn from_dir(dir: &Path, with_projection: bool, dtype: DType, device: &Device) -> Result<Self> {
        let cfg = ClipTextConfig::from_file(&dir.join("config.json"))?;
        let vb = crate::loading::load_component(dir, dtype, device)?;
        Self::new(vb, &cfg, with_projection)
            .map_err(|e| e.with_weight_origin(&crate::loading::describe_weights(dir)))
    }

    pub fn config(&self) -> &ClipTextConfig {
        &self.config
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn has_projection(&self) -> bool {
        self.text_projection.is_some()
    }

    /// Runs the encoder on token ids `(B, S)` (u32 or i64), `S ≤ max_position_embeddings`.
    pub fn forward(&self, input_ids: &Tensor) -> Result<ClipTextOutput> {
        self.forward_with(input_ids, None)
    }

    /// [`Self::forward`] with textual-inversion vectors `extra` `(N, hidden)`: ids `vocab_size + i` stand for
    /// row `i` (as tokens a tokenizer added for them do in transformers).
    pub fn forward_with(&self, input_ids: &Tensor, extra: Option<&Tensor>) -> Result<ClipTextOutput> {
        let (b, s) = input_ids
            .dims2()
            .map_err(|e| input_err(MODEL, format!("input_ids must be (batch, seq): {e}")))?;
        if s > self.config.max_position_embeddings || s == 0 {
            return Err(input_err(
                MODEL,
                format!("sequence length {s} outside 1..={}", self.config.max_position_embeddings),
            ));
        }
        // Read from the caller's ids (a tokenizer's, on the host): reading them back from the device would wait
        // for everything queued before, a running batch's step included.
        let ids = input_ids.to_dtype(DType::U32).ctx(MODEL)?;
        let host_ids: Vec<Vec<u32>> = ids.to_vec2().ctx(MODEL)?;
        let ids = ids.to_device(&self.device).ctx(MODEL)?;
        let extra_rows = match extra {
            Some(e) => {
                let (rows, width) =
                    e.dims2().map_err(|e| input_err(MODEL, format!("embedding vectors: {e}")))?;
                if width != self.config.hidden_size {
                    return Err(input_err(
                        MODEL,
                        format!(
                            "embedding vectors of width {width}, the encoder's is {}",
                            self.config.hidden_size
                        ),
                    ));
                }
                rows
            }
            None => 0,
        };
        let known = self.config.vocab_size + extra_rows;
        if let Some(bad) = host_ids.iter().flatten().find(|&&t| t as usize >= known) {
            return Err(input_err(MODEL, format!("token id {bad} >= vocab_size {known}")));
        }
        let eos_positions = self.eos_positions(&host_ids);
        self.run(&ids, extra, (b, s), &eos_positions).ctx(MODEL)
    }

    /// transformers' pooling rule: configs still carrying the pre-#24773 `eos_token_id == 2`
    /// take the highest id (the EOS token in CLIP's vocabulary), newer ones the first EOS.
    fn eos_positions(&self, ids: &[Vec<u32>]) -> Vec<usize> {
        let argmax_first = |row: &Vec<u32>, key: &dyn Fn(u32) -> u32| {
            let mut best = 0;
            for (i, &t) in row.iter().enumerate() {
                if key(t) > key(row[best]) {
                    best = i;
                }
            }
            best
        };
        ids.iter()
            .map(|row| match self.config.eos_token_id {
                Some(eos) if eos != 2 => argmax_first(row, &|t| u32::from(t == eos)),
                _ => argmax_first(row, &|t| t),
            })
            .collect()
    }

    fn run(
        &self,
        ids: &Tensor,
        extra: Option<&Tensor>,
        (b, s): (usize, usize),
        eos_positions: &[usize],
    ) -> candle_core::Result<ClipTextOutput> {
        let positions = Tensor::arange(0u32, s as u32, &self.device)?;
        let tokens = match extra {
            Some(extra) => {
                let extra =
                    extra.to_device(&self.device)?.to_dtype(self.token_embedding.embeddings().dtype())?;
                let table = Tensor::cat(&[self.token_embedding.embeddings(), &extra], 0)?;
                table.embedding(&ids.flatten_all()?)?.reshape((b, s, ()))?
            }
            None => self.token_embedding.forward(ids)?,
        };
        let x = tokens.broadcast_add(&self.position_embedding.forward(&positions)?)?;
        let fused = self.fused_causal(&x);
        let (hidden_states, last_hidden_state) =
            if fused && self.graphs_wanted && sdhive_cuda_kernels::graphs_on(&self.device) {
                let stacked = self.graphs.run([&x.contiguous()?], |[x]| {
                    let (mut all, last) = self.layers(x, None)?;
                    all.push(last);
                    Tensor::stack(&all, 0)
                })?;
                let n = self.layers.len() + 1;
                let all = (0..n).map(|i| stacked.get(i)).collect::<candle_core::Result<Vec<_>>>()?;
                (all, stacked.get(n)?)
            } else if fused {
                self.layers(&x, None)?
            } else {
                self.layers(&x, Some(&causal_mask(s, self.dtype, &self.device)?))?
            };
        let pooled = (0..b)
            .map(|i| last_hidden_state.get(i)?.get(eos_positions[i]))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let pooled = Tensor::stack(&pooled, 0)?;
        let text_embeds = match &self.text_projection {
            Some(p) => Some(p.forward(&pooled)?),
            None => None,
        };
        Ok(ClipTextOutput { hidden_states, last_hidden_state, pooled, text_embeds })
    }

    /// Whether the self-attention on tokens like `x` runs on the causal kernel (its q, k and v have `x`'s shape
    /// and layout). Only then are the layers recorded: the unfused attention's split into heads and masked softmax
    /// are strided copies whose layouts candle uploads at every call.
    fn fused_causal(&self, x: &Tensor) -> bool {
        sdhive_cuda_kernels::causal_attention_applies(x, x, x, self.config.num_attention_heads)
    }

    /// The embedded tokens through every layer: the embeddings and each layer's output, and the last one's through
    /// the final norm.
    fn layers(&self, x: &Tensor, mask: Option<&Tensor>) -> candle_core::Result<(Vec<Tensor>, Tensor)> {
        let mut x = x.clone();
        let mut hidden_states = Vec::with_capacity(self.layers.len() + 1);
        hidden_states.push(x.clone());
        for layer in &self.layers {
            x = layer.forward(&x, mask)?;
            hidden_states.push(x.clone());
        }
        let last = self.final_layer_norm.forward(&x)?;
        Ok((hidden_states, last))
    }

    /// Applies the final LayerNorm to an intermediate hidden state (clip-skip).
    pub fn final_layer_norm(&self, hidden: &Tensor) -> Result<Tensor> {
        self.final_layer_norm.forward(hidden).ctx(MODEL)
    }

    /// `text_projection` applied to a pooled output; `None` without the projection head.
    pub fn project(&self, pooled: &Tensor) -> Result<Option<Tensor>> {
        match &self.text_projection {
            Some(p) => p.forward(pooled).map(Some).ctx(MODEL),
            None => Ok(None),
        }
    }
}

fn causal_mask(s: usize, dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
    let mask: Vec<f32> =
        (0..s).flat_map(|i| (0..s).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 })).collect();
    Tensor::from_vec(mask, (s, s), device)?.to_dtype(dtype)
}
