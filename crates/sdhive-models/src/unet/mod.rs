//! The denoising network: diffusers `UNet2DConditionModel` (SD1.x, SD2.x, SDXL, inpainting
//! variants) built from `unet/config.json` and diffusers weight names.

mod blocks;
mod config;
mod embeddings;
mod tables;
mod transformer;

pub use config::{
    sd15_inpaint_unet_config, sd15_unet_config, sd21_unet_config, sdxl_unet_config, UNet2DConditionConfig,
};
pub use embeddings::{TimestepEmbedding, Timesteps};
pub use transformer::{CrossAttention, Transformer2DModel, TransformerSpec};

use crate::error::{input_err, weights_err, Result, TensorContext};
use crate::graphed::{Graphs, Refresh};
use crate::layers::{EdgeConv, GroupNorm};
use crate::ops::{self, MapLayout};
use blocks::{BlockCommon, DownBlock, MidBlock, UpBlock};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::path::Path;
use tables::{ContextTable, ScheduleKey, ScheduleTable};

const MODEL: &str = "unet";

/// SDXL's extra conditioning (`added_cond_kwargs`).
#[derive(Debug, Clone)]
pub struct SdxlConditioning {
    /// Pooled, projected text embedding of the second encoder, `(B, P)`.
    pub text_embeds: Tensor,
    /// `(original size, crop top-left, target size)` as `(B, 6)`.
    pub time_ids: Tensor,
}

#[derive(Debug, Clone)]
struct AddEmbedding {
    time_proj: Timesteps,
    embedding: TimestepEmbedding,
    proj_input_dim: usize,
}

/// diffusers `UNet2DConditionModel`.
#[derive(Debug, Clone)]
pub struct UNet2DConditionModel {
    conv_in: EdgeConv,
    time_proj: Timesteps,
    time_embedding: TimestepEmbedding,
    add_embedding: Option<AddEmbedding>,
    down_blocks: Vec<DownBlock>,
    mid_block: MidBlock,
    up_blocks: Vec<UpBlock>,
    tables: tables::ConditioningTables,
    conv_norm_out: GroupNorm,
    conv_out: EdgeConv,
    config: UNet2DConditionConfig,
    dtype: DType,
    device: Device,
    layout: MapLayout,
    /// The step body's recordings; the text context's k/v table is copied in only when it changes.
    graphs: Graphs<3>,
    context_table: ContextTable,
    schedule: ScheduleTable,
}

impl UNet2DConditionModel {
    /// Builds the network from diffusers tensor names under `vb`.
    pub fn new(vb: VarBuilder, cfg: &UNet2DConditionConfig) -> Result<Self> {
        let plan = cfg.plan("unet config")?;
        let build = || -> candle_core::Result<Self> {
            let c0 = cfg.block_out_channels[0];
            let conv_in = EdgeConv::first(
                vb.pp("conv_in"),
                cfg.in_channels,
                c0,
                cfg.conv_in_kernel,
                (cfg.conv_in_kernel - 1) / 2,
            )?;
            let time_proj = Timesteps::new(c0, cfg.flip_sin_to_cos, cfg.freq_shift);
            let time_embedding = TimestepEmbedding::new(vb.pp("time_embedding"), c0, plan.time_embed_dim)?;
            let add_embedding = match plan.text_time {
                Some((time_dim, proj_dim)) => Some(AddEmbedding {
                    time_proj: Timesteps::new(time_dim, cfg.flip_sin_to_cos, cfg.freq_shift),
                    embedding: TimestepEmbedding::new(vb.pp("add_embedding"), proj_dim, plan.time_embed_dim)?,
                    proj_input_dim: proj_dim,
                }),
                None => None,
            };
            let common = BlockCommon {
                temb_channels: plan.time_embed_dim,
                groups: plan.groups,
                eps: cfg.norm_eps,
                use_linear_projection: cfg.use_linear_projection,
                upcast_attention: cfg.upcast_attention,
                downsample_padding: cfg.downsample_padding,
                mid_block_scale_factor: cfg.mid_block_scale_factor,
            };
            let mut down_blocks = plan
                .down
                .iter()
                .enumerate()
                .map(|(i, p)| DownBlock::new(vb.pp(format!("down_blocks.{i}")), p, &common))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let mut mid_block = MidBlock::new(vb.pp("mid_block"), &plan.mid, &common)?;
            let mut up_blocks = plan
                .up
                .iter()
                .enumerate()
                .map(|(i, p)| UpBlock::new(vb.pp(format!("up_blocks.{i}")), p, &common))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let tables = tables::ConditioningTables::stack(&mut down_blocks, &mut mid_block, &mut up_blocks)?;
            let conv_norm_out = GroupNorm::new(vb.pp("conv_norm_out"), plan.groups, c0, cfg.norm_eps)?;
            let conv_out = EdgeConv::last(
                vb.pp("conv_out"),
                c0,
                cfg.out_channels,
                cfg.conv_out_kernel,
                (cfg.conv_out_kernel - 1) / 2,
            )?;
            Ok(Self {
                conv_in,
                time_proj,
                time_embedding,
                add_embedding,
                down_blocks,
                mid_block,
                up_blocks,
                tables,
                conv_norm_out,
                conv_out,
                config: cfg.clone(),
                dtype: vb.dtype(),
                device: vb.device().clone(),
                layout: MapLayout::of(&vb),
                graphs: Graphs::new(MODEL, [Refresh::Always, Refresh::Always, Refresh::WhenAnotherTensor])
                    .batched(),
                context_table: ContextTable::default(),
                schedule: ScheduleTable::default(),
            })
        };
        build().map_err(weights_err(MODEL))
    }

    /// Reads `dir/config.json` and the weights in `dir`.
    pub fn from_dir(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let cfg = UNet2DConditionConfig::from_file(&dir.join("config.json"))?;
        let vb = crate::loading::load_component(dir, dtype, device)?;
        Self::new(vb, &cfg).map_err(|e| e.with_weight_origin(&crate::loading::describe_weights(dir)))
    }

    /// Drops what was computed from the weights and kept across calls (the text context's k/v table, the
    /// schedule's time table): to be called after the weights are changed in place. The step's CUDA graph stays:
    /// it reads the weights' buffers, which keep their addresses.
    pub fn weights_changed(&self) {
        self.context_table.clear();
        self.schedule.clear();
    }

    pub fn config(&self) -> &UNet2DConditionConfig {
        &self.config
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// How many input shapes replay their step from a recorded CUDA graph (none off CUDA), and why recording
    /// failed for the others.
    pub fn graph_status(&self) -> (usize, Vec<String>) {
        self.graphs.status()
    }

    /// Makes the time embedding's contribution to every ResNet for each of `timesteps` in one pass, for calls of
    /// [`Self::forward`] at batch `batch` with `added` (the same tensors). A denoising loop calls this once with
    /// its schedule; each step then reads its row instead of running the time embedding and its projections.
    /// Steps at other timesteps, batches or conditioning still work, computing theirs as they go, as every step
    /// does with `SDHIVE_TIME_TABLE=0`.
    pub fn prepare_timesteps(
        &self,
        timesteps: &[f64],
        batch: usize,
        added: Option<&SdxlConditioning>,
    ) -> Result<()> {
        self.require_added(added)?;
        if let Some(bad) = timesteps.iter().find(|t| !t.is_finite()) {
            return Err(input_err(MODEL, format!("timestep {bad} is not a finite number")));
        }
        // The switch keeps the per-step path measurable against the table (`SDHIVE_TIME_TABLE=0`).
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if !*ON.get_or_init(|| std::env::var("SDHIVE_TIME_TABLE").map_or(true, |v| v != "0")) {
            return Ok(());
        }
        let key = self.schedule_key(batch, added);
        if let Some(distinct) = self.schedule.missing(timesteps, key) {
            let rows = self.schedule_rows(&distinct, batch, added)?;
            self.schedule.store(&distinct, key, rows).ctx(MODEL)?;
        }
        Ok(())
    }

    /// Whether a [`Self::forward`] at `timestep` with this batch and `added` reads its time rows from the table
    /// of [`Self::prepare_timesteps`].
    pub fn prepared_timestep(&self, timestep: f64, batch: usize, added: Option<&SdxlConditioning>) -> bool {
        matches!(self.schedule.row(timestep, self.schedule_key(batch, added)), Ok(Some(_)))
    }

    /// SDXL's networks need their added conditioning on every call that embeds a timestep.
    fn require_added(&self, added: Option<&SdxlConditioning>) -> Result<()> {
        if self.add_embedding.is_some() && added.is_none() {
            return Err(input_err(
                MODEL,
                "addition_embed_type \"text_time\" needs text_embeds and time_ids (SDXL)",
            ));
        }
        Ok(())
    }

    fn schedule_key(&self, batch: usize, added: Option<&SdxlConditioning>) -> ScheduleKey {
        // SD1.x/2.x ignore `added`: their rows depend on the timestep alone.
        let added =
            added.filter(|_| self.add_embedding.is_some()).map(|a| (a.text_embeds.id(), a.time_ids.id()));
        ScheduleKey { batch, added }
    }

    /// The ResNets' time table of each of `ts`: `(n, B, ΣC)`.
    fn schedule_rows(&self, ts: &[f64], b: usize, added: Option<&SdxlConditioning>) -> Result<Tensor> {
        let n = ts.len();
        let features = self.time_proj.forward_scalars(ts, self.dtype, &self.device).ctx(MODEL)?;
        let emb = self.time_embedding.forward(&features).ctx(MODEL)?;
        let aug = match (&self.add_embedding, added) {
            (Some(add), Some(cond)) => Some(self.add_embed(add, cond, b)?),
            _ => None,
        };
        let rows = || -> candle_core::Result<Tensor> {
            match aug {
                // Every sample's row differs: (n, B, T) through the projections.
                Some(aug) => {
                    let emb = emb.unsqueeze(1)?.broadcast_add(&aug.unsqueeze(0)?)?;
                    let t = emb.dim(2)?;
                    let table = self.tables.time(&ops::silu(&emb.reshape((n * b, t))?)?)?;
                    table.reshape((n, b, ()))
                }
                // The batch shares each row: n rows through the projections, then repeated.
                None => {
                    let table = self.tables.time(&ops::silu(&emb)?)?;
                    let c = table.dim(1)?;
                    table.unsqueeze(1)?.broadcast_as((n, b, c))?.contiguous()
                }
            }
        };
        rows().ctx(MODEL)
    }

    /// Predicts noise (or v) for `sample` `(B, C, H, W)` at one `timestep` shared by the
    /// batch, conditioned on `encoder_hidden_states` `(B, T, D)` and, for SDXL, `added`.
    ///
    /// A `sample` of batch 1 (or `k`) with `B` contexts is shared by all of them (by rows `j`, `k + j`, …), as
    /// classifier-free guidance shares its latents between the negative and the positive prompt, and the output
    /// has batch `B`. Where every sample's time rows are the same (no SDXL conditioning), the network runs once up
    /// to its first attention to the context, the first point at which the samples differ (SD1.5: the first
    /// ResNet and self-attention at 64²); otherwise the sample is repeated first.
    pub fn forward(
        &self,
        sample: &Tensor,
        timestep: f64,
        encoder_hidden_states: &Tensor,
        added: Option<&SdxlConditioning>,
    ) -> Result<Tensor> {
        let b = self.check_inputs(sample, encoder_hidden_states)?;
        self.require_added(added)?;
        let temb = match self.schedule.row(timestep, self.schedule_key(b, added)).ctx(MODEL)? {
            Some(row) => row,
            None => {
                let emb = self.time_embed(timestep, b, added)?;
                self.tables.time(&ops::silu(&emb).ctx(MODEL)?).ctx(MODEL)?
            }
        };
        self.forward_with_time(sample, &temb, encoder_hidden_states)
    }

    /// The time rows of each of `timesteps` for calls at batch `batch` with `added` (the same tensors):
    /// `(n, batch, ΣC)`, made in one pass as [`Self::prepare_timesteps`] makes its table. Rows of these, one per
    /// sample, are what [`Self::forward_rows`] takes.
    pub fn time_rows(
        &self,
        timesteps: &[f64],
        batch: usize,
        added: Option<&SdxlConditioning>,
    ) -> Result<Tensor> {
        self.require_added(added)?;
        if let Some(bad) = timesteps.iter().find(|t| !t.is_finite()) {
            return Err(input_err(MODEL, format!("timestep {bad} is not a finite number")));
        }
        self.schedule_rows(timesteps, batch, added)
    }

    /// [`Self::forward`] with each sample's own time rows `temb` `(B, ΣC)` (rows of [`Self::time_rows`]), so
    /// samples at different timesteps, or with different SDXL conditioning, share one call. As in
    /// [`Self::forward`], a guided batch passes its `k` samples once with `2k` contexts and time rows laid out
    /// `[negatives…, positives…]`: sample `j` is shared by rows `j` and `k + j`, whose time rows must then be the
    /// same where the network shares states (no SDXL conditioning).
    pub fn forward_rows(
        &self,
        sample: &Tensor,
        temb: &Tensor,
        encoder_hidden_states: &Tensor,
    ) -> Result<Tensor> {
        let b = self.check_inputs(sample, encoder_hidden_states)?;
        let rows = temb.dim(0).map_err(|e| input_err(MODEL, format!("time rows must be (B, C): {e}")))?;
        if rows != b {
            return Err(input_err(MODEL, format!("{rows} time rows for a batch of {b}")));
        }
        self.forward_with_time(sample, temb, encoder_hidden_states)
    }

    /// Checks a call's sample and context; returns the call's batch (the context's).
    fn check_inputs(&self, sample: &Tensor, encoder_hidden_states: &Tensor) -> Result<usize> {
        let (sb, c, _, _) =
            sample.dims4().map_err(|e| input_err(MODEL, format!("sample must be (B, C, H, W): {e}")))?;
        if c != self.config.in_channels {
            return Err(input_err(
                MODEL,
                format!("sample has {c} channels, the config says in_channels {}", self.config.in_channels),
            ));
        }
        let (b, _, _) = encoder_hidden_states
            .dims3()
            .map_err(|e| input_err(MODEL, format!("encoder_hidden_states must be (B, T, D): {e}")))?;
        if sb == 0 || !b.is_multiple_of(sb) {
            return Err(input_err(
                MODEL,
                format!(
                    "encoder_hidden_states batch {b} is not a whole number of sample batches ({sb}): samples are \
                     shared whole"
                ),
            ));
        }
        Ok(b)
    }

    /// The network on checked inputs with the time rows `temb` `(B, ΣC)`.
    fn forward_with_time(
        &self,
        sample: &Tensor,
        temb: &Tensor,
        encoder_hidden_states: &Tensor,
    ) -> Result<Tensor> {
        let b = encoder_hidden_states.dim(0).ctx(MODEL)?;
        let sb = sample.dim(0).ctx(MODEL)?;
        let sample = if sb != b && self.add_embedding.is_some() {
            ops::expand_batch(sample, b).ctx(MODEL)?
        } else {
            sample.clone()
        };
        let context = self
            .context_table
            .get(encoder_hidden_states, |c| {
                self.tables.context(&c.to_device(&self.device)?.to_dtype(self.dtype)?)
            })
            .ctx(MODEL)?;
        let out = if sdhive_cuda_kernels::graphs_on(&self.device) {
            self.run_graphed(&sample, temb, &context).ctx(MODEL)
        } else {
            self.run(&sample, temb, &context).ctx(MODEL)
        };
        crate::cpu::release_scratch();
        out
    }

    fn time_embed(&self, timestep: f64, b: usize, added: Option<&SdxlConditioning>) -> Result<Tensor> {
        let t_emb = self.time_proj.forward_scalar(timestep, b, self.dtype, &self.device).ctx(MODEL)?;
        let mut emb = self.time_embedding.forward(&t_emb).ctx(MODEL)?;
        if let (Some(add), Some(cond)) = (&self.add_embedding, added) {
            let aug = self.add_embed(add, cond, b)?;
            emb = (emb + aug).ctx(MODEL)?;
        }
        Ok(emb)
    }

    /// SDXL: sinusoidal features of each `time_ids` entry, flattened per sample, appended to
    /// `text_embeds`, through `add_embedding`.
    fn add_embed(&self, add: &AddEmbedding, cond: &SdxlConditioning, b: usize) -> Result<Tensor> {
        let (tb, n_ids) =
            cond.time_ids.dims2().map_err(|e| input_err(MODEL, format!("time_ids must be (B, N): {e}")))?;
        let (eb, text_dim) = cond
            .text_embeds
            .dims2()
            .map_err(|e| input_err(MODEL, format!("text_embeds must be (B, D): {e}")))?;
        if tb != b || eb != b {
            return Err(input_err(
                MODEL,
                format!("time_ids batch {tb} / text_embeds batch {eb} != sample batch {b}"),
            ));
        }
        let time_dim = self.config.addition_time_embed_dim.unwrap_or(0);
        if text_dim + n_ids * time_dim != add.proj_input_dim {
            return Err(input_err(
                MODEL,
                format!(
                    "text_embeds dim {text_dim} + {n_ids} time_ids × {time_dim} != \
                     projection_class_embeddings_input_dim {}",
                    add.proj_input_dim
                ),
            ));
        }
        let run = || -> candle_core::Result<Tensor> {
            let ids = cond.time_ids.to_device(&self.device)?.flatten_all()?;
            let time_embeds = add.time_proj.forward(&ids)?.reshape((b, ()))?;
            let text = cond.text_embeds.to_device(&self.device)?.to_dtype(DType::F32)?;
            let add_embeds = Tensor::cat(&[&text, &time_embeds], 1)?.to_dtype(self.dtype)?;
            add.embedding.forward(&add_embeds)
        };
        run().ctx(MODEL)
    }

    /// [`Self::run`] replayed from a CUDA graph once a shape has been seen twice.
    fn run_graphed(&self, sample: &Tensor, temb: &Tensor, context: &Tensor) -> candle_core::Result<Tensor> {
        let prepare = |t: &Tensor| t.to_device(&self.device)?.to_dtype(self.dtype)?.contiguous();
        let (sample, temb, context) = (prepare(sample)?, prepare(temb)?, prepare(context)?);
        self.graphs.run([&sample, &temb, &context], |[s, t, c]| self.run(s, t, c))
    }

    /// The network on `sample`, the ResNets' table of the activated time embedding's projections `temb` `(B, ΣC)`
    /// and `context`, the transformer blocks' table of the text context's k and v ([`ContextTable`]). A `sample`
    /// of batch 1 runs at batch 1 until the first transformer block's attention to the context makes it `B`
    /// (see [`Self::forward`]).
    fn run(&self, sample: &Tensor, temb: &Tensor, context: &Tensor) -> candle_core::Result<Tensor> {
        let sample = sample.to_device(&self.device)?.to_dtype(self.dtype)?;
        let sample = if self.config.center_input_sample { ((sample * 2.0)? - 1.0)? } else { sample };

        // diffusers passes explicit sizes to the upsamplers when the latent is not a multiple
        // of 2^(number of upsamplers), so odd sizes round-trip.
        let n_up = self.up_blocks.len().saturating_sub(1);
        let (_, _, h, w) = sample.dims4()?;
        let factor = 1usize << n_up;
        let forward_upsample_size = h % factor != 0 || w % factor != 0;

        let layout = self.layout;
        let mut x = self.conv_in.forward(&sample)?;
        let mut skips = vec![x.clone()];
        for block in &self.down_blocks {
            let (out, res) = block.forward(&x, temb, context)?;
            x = out;
            skips.extend(res);
        }
        // States made before the samples parted (all of them, in a down path without attention) are the batch's.
        let batch = context.dim(0)?;
        x = ops::expand_batch(&x, batch)?;
        for skip in &mut skips {
            *skip = ops::expand_batch(skip, batch)?;
        }
        x = self.mid_block.forward(&x, temb, context)?;
        let n_blocks = self.up_blocks.len();
        for (i, block) in self.up_blocks.iter().enumerate() {
            let take = block.num_resnets();
            let split = skips.len().checked_sub(take).ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "up block {i} needs {take} skip states, only {} left",
                    skips.len()
                ))
            })?;
            let res = skips.split_off(split);
            let upsample_size = if i + 1 != n_blocks && forward_upsample_size {
                let last = skips
                    .last()
                    .ok_or_else(|| candle_core::Error::Msg("no skip state for upsample size".into()))?;
                let (_, _, sh, sw) = layout.dims(last)?;
                Some((sh, sw))
            } else {
                None
            };
            x = block.forward(&x, &res, temb, context, upsample_size)?;
        }
        self.conv_out.forward(&self.conv_norm_out.forward_silu(&x)?)
    }
}
