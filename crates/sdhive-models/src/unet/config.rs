//! `unet/config.json` (diffusers `UNet2DConditionModel`) with diffusers' defaults, its
//! validation, and its resolution into per-block shapes.

use crate::config::{check_act, check_divides, read_json, BoolOrList, IntOrList, LayersPerBlock};
use crate::error::{invalid, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Every field diffusers' constructor takes that changes the network; unknown keys (such as
/// `_class_name` or `sample_size`) are ignored. Options this crate does not implement are
/// parsed so that [`UNet2DConditionConfig::validate`] can reject them by name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct UNet2DConditionConfig {
    pub in_channels: usize,
    pub out_channels: usize,
    pub center_input_sample: bool,
    pub flip_sin_to_cos: bool,
    pub freq_shift: f64,
    pub down_block_types: Vec<String>,
    pub mid_block_type: Option<String>,
    pub up_block_types: Vec<String>,
    pub only_cross_attention: BoolOrList,
    pub block_out_channels: Vec<usize>,
    pub layers_per_block: IntOrList,
    pub downsample_padding: usize,
    pub mid_block_scale_factor: f64,
    pub act_fn: String,
    pub norm_num_groups: Option<usize>,
    pub norm_eps: f64,
    pub cross_attention_dim: IntOrList,
    pub transformer_layers_per_block: LayersPerBlock,
    pub reverse_transformer_layers_per_block: Option<serde_json::Value>,
    pub encoder_hid_dim: Option<usize>,
    pub encoder_hid_dim_type: Option<String>,
    /// With `num_attention_heads` null this is really the number of heads (diffusers quirk).
    pub attention_head_dim: Option<IntOrList>,
    pub num_attention_heads: Option<IntOrList>,
    pub dual_cross_attention: bool,
    pub use_linear_projection: bool,
    pub class_embed_type: Option<String>,
    pub addition_embed_type: Option<String>,
    pub addition_time_embed_dim: Option<usize>,
    pub num_class_embeds: Option<usize>,
    pub upcast_attention: bool,
    pub resnet_time_scale_shift: String,
    pub resnet_skip_time_act: bool,
    pub resnet_out_scale_factor: f64,
    pub time_embedding_type: String,
    pub time_embedding_dim: Option<usize>,
    pub time_embedding_act_fn: Option<String>,
    pub timestep_post_act: Option<String>,
    pub time_cond_proj_dim: Option<usize>,
    pub conv_in_kernel: usize,
    pub conv_out_kernel: usize,
    pub projection_class_embeddings_input_dim: Option<usize>,
    pub attention_type: String,
    pub class_embeddings_concat: bool,
    pub mid_block_only_cross_attention: Option<bool>,
    pub cross_attention_norm: Option<String>,
}

impl Default for UNet2DConditionConfig {
    fn default() -> Self {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        Self {
            in_channels: 4,
            out_channels: 4,
            center_input_sample: false,
            flip_sin_to_cos: true,
            freq_shift: 0.0,
            down_block_types: s(&[
                "CrossAttnDownBlock2D",
                "CrossAttnDownBlock2D",
                "CrossAttnDownBlock2D",
                "DownBlock2D",
            ]),
            mid_block_type: Some("UNetMidBlock2DCrossAttn".into()),
            up_block_types: s(&[
                "UpBlock2D",
                "CrossAttnUpBlock2D",
                "CrossAttnUpBlock2D",
                "CrossAttnUpBlock2D",
            ]),
            only_cross_attention: BoolOrList::Bool(false),
            block_out_channels: vec![320, 640, 1280, 1280],
            layers_per_block: IntOrList::Int(2),
            downsample_padding: 1,
            mid_block_scale_factor: 1.0,
            act_fn: "silu".into(),
            norm_num_groups: Some(32),
            norm_eps: 1e-5,
            cross_attention_dim: IntOrList::Int(1280),
            transformer_layers_per_block: LayersPerBlock::Int(1),
            reverse_transformer_layers_per_block: None,
            encoder_hid_dim: None,
            encoder_hid_dim_type: None,
            attention_head_dim: Some(IntOrList::Int(8)),
            num_attention_heads: None,
            dual_cross_attention: false,
            use_linear_projection: false,
            class_embed_type: None,
            addition_embed_type: None,
            addition_time_embed_dim: None,
            num_class_embeds: None,
            upcast_attention: false,
            resnet_time_scale_shift: "default".into(),
            resnet_skip_time_act: false,
            resnet_out_scale_factor: 1.0,
            time_embedding_type: "positional".into(),
            time_embedding_dim: None,
            time_embedding_act_fn: None,
            timestep_post_act: None,
            time_cond_proj_dim: None,
            conv_in_kernel: 3,
            conv_out_kernel: 3,
            projection_class_embeddings_input_dim: None,
            attention_type: "default".into(),
            class_embeddings_concat: false,
            mid_block_only_cross_attention: None,
            cross_attention_norm: None,
        }
    }
}

/// Which of the supported diffusers block classes a block is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BlockKind {
    Plain,
    CrossAttn,
}

/// The shapes of one down or up block after diffusers' per-block expansion rules.
#[derive(Debug, Clone)]
pub(crate) struct BlockPlan {
    pub kind: BlockKind,
    pub in_channels: usize,
    pub out_channels: usize,
    /// Up blocks: channels coming from the block below (diffusers' `prev_output_channel`).
    pub prev_output_channels: usize,
    pub resnets: usize,
    pub transformer_layers: usize,
    pub heads: usize,
    pub cross_attention_dim: usize,
    pub resample: bool,
}

/// The validated, expanded form of a config that the model constructor walks.
#[derive(Debug, Clone)]
pub(crate) struct UNetPlan {
    pub groups: usize,
    pub time_embed_dim: usize,
    /// `(addition_time_embed_dim, projection_class_embeddings_input_dim)` for SDXL.
    pub text_time: Option<(usize, usize)>,
    pub down: Vec<BlockPlan>,
    pub mid: BlockPlan,
    pub up: Vec<BlockPlan>,
}

impl UNet2DConditionConfig {
    /// Reads and validates `unet/config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let cfg: Self = read_json(path)?;
        cfg.plan(&path.display().to_string())?;
        Ok(cfg)
    }

    /// Checks that every option is one this crate implements.
    pub fn validate(&self, origin: &str) -> Result<()> {
        self.plan(origin).map(|_| ())
    }

    /// Whether SDXL's `text_embeds`/`time_ids` conditioning is required.
    pub fn uses_text_time(&self) -> bool {
        self.addition_embed_type.as_deref() == Some("text_time")
    }

    /// The first resolution level with attention and its head count (`(0, 8)` for SD1.5, `(1, 10)` for SDXL):
    /// where the largest attention-score matrix is made. `None` for UNets without attention (or invalid ones).
    pub fn first_attention(&self) -> Option<(usize, usize)> {
        let plan = self.plan("unet config").ok()?;
        plan.down.iter().enumerate().find(|(_, b)| b.kind == BlockKind::CrossAttn).map(|(i, b)| (i, b.heads))
    }

    pub(crate) fn plan(&self, origin: &str) -> Result<UNetPlan> {
        self.reject_unsupported(origin)?;
        let n = self.block_out_channels.len();
        if n == 0 {
            return Err(invalid(origin, "block_out_channels", "is empty"));
        }
        if self.down_block_types.len() != n {
            return Err(invalid(
                origin,
                "down_block_types",
                format!("has {} entries, block_out_channels has {n}", self.down_block_types.len()),
            ));
        }
        if self.up_block_types.len() != n {
            return Err(invalid(
                origin,
                "up_block_types",
                format!("has {} entries, block_out_channels has {n}", self.up_block_types.len()),
            ));
        }
        let groups = self
            .norm_num_groups
            .ok_or_else(|| invalid(origin, "norm_num_groups", "null (no norms) is not supported"))?;
        for &c in &self.block_out_channels {
            check_divides(origin, "norm_num_groups", groups, c)?;
        }
        let layers = self.layers_per_block.per_block(n, origin, "layers_per_block")?;
        let cross = self.cross_attention_dim.per_block(n, origin, "cross_attention_dim")?;
        let tlayers = match &self.transformer_layers_per_block {
            LayersPerBlock::Int(v) => vec![*v; n],
            LayersPerBlock::List(v) if v.len() == n => v.clone(),
            LayersPerBlock::List(v) => {
                return Err(invalid(
                    origin,
                    "transformer_layers_per_block",
                    format!("has {} entries but there are {n} blocks", v.len()),
                ))
            }
            LayersPerBlock::Nested(_) => {
                return Err(invalid(
                    origin,
                    "transformer_layers_per_block",
                    "per-layer lists (asymmetric UNets) are not supported",
                ))
            }
        };
        // diffusers: `num_attention_heads = num_attention_heads or attention_head_dim`.
        let (heads_field, heads_src) = match (&self.num_attention_heads, &self.attention_head_dim) {
            (Some(h), _) => ("num_attention_heads", h),
            (None, Some(h)) => ("attention_head_dim", h),
            (None, None) => {
                return Err(invalid(
                    origin,
                    "num_attention_heads",
                    "neither num_attention_heads nor attention_head_dim is set",
                ))
            }
        };
        let heads = heads_src.per_block(n, origin, heads_field)?;

        let kind_of = |field: &str, t: &str, down: bool| -> Result<BlockKind> {
            match (t, down) {
                ("CrossAttnDownBlock2D", true) | ("CrossAttnUpBlock2D", false) => Ok(BlockKind::CrossAttn),
                ("DownBlock2D", true) | ("UpBlock2D", false) => Ok(BlockKind::Plain),
                _ => Err(invalid(origin, field, format!("block type `{t}` is not supported"))),
            }
        };
        let check_heads = |field: &str, h: usize, channels: usize| -> Result<()> {
            if h == 0 || !channels.is_multiple_of(h) {
                return Err(invalid(
                    origin,
                    field,
                    format!("{h} attention heads do not divide {channels} channels"),
                ));
            }
            Ok(())
        };

        let mut down = Vec::with_capacity(n);
        let mut out_c = self.block_out_channels[0];
        for i in 0..n {
            let in_c = out_c;
            out_c = self.block_out_channels[i];
            let kind = kind_of("down_block_types", &self.down_block_types[i], true)?;
            if kind == BlockKind::CrossAttn {
                check_heads(heads_field, heads[i], out_c)?;
            }
            down.push(BlockPlan {
                kind,
                in_channels: in_c,
                out_channels: out_c,
                prev_output_channels: 0,
                resnets: layers[i],
                transformer_layers: tlayers[i],
                heads: heads[i],
                cross_attention_dim: cross[i],
                resample: i + 1 != n,
            });
        }

        match self.mid_block_type.as_deref() {
            Some("UNetMidBlock2DCrossAttn") => {}
            Some(other) => {
                return Err(invalid(origin, "mid_block_type", format!("`{other}` is not supported")))
            }
            None => {
                return Err(invalid(origin, "mid_block_type", "a UNet without mid block is not supported"))
            }
        }
        let last = self.block_out_channels[n - 1];
        check_heads(heads_field, heads[n - 1], last)?;
        let mid = BlockPlan {
            kind: BlockKind::CrossAttn,
            in_channels: last,
            out_channels: last,
            prev_output_channels: 0,
            resnets: 2,
            transformer_layers: tlayers[n - 1],
            heads: heads[n - 1],
            cross_attention_dim: cross[n - 1],
            resample: false,
        };

        let mut up = Vec::with_capacity(n);
        let rev = |v: &[usize], i: usize| v[n - 1 - i];
        let mut out_c = rev(&self.block_out_channels, 0);
        for i in 0..n {
            let prev = out_c;
            out_c = rev(&self.block_out_channels, i);
            let in_c = rev(&self.block_out_channels, (i + 1).min(n - 1));
            let kind = kind_of("up_block_types", &self.up_block_types[i], false)?;
            let h = rev(&heads, i);
            if kind == BlockKind::CrossAttn {
                check_heads(heads_field, h, out_c)?;
            }
            up.push(BlockPlan {
                kind,
                in_channels: in_c,
                out_channels: out_c,
                prev_output_channels: prev,
                resnets: rev(&layers, i) + 1,
                transformer_layers: rev(&tlayers, i),
                heads: h,
                cross_attention_dim: rev(&cross, i),
                resample: i + 1 != n,
            });
        }

        let time_embed_dim = self.time_embedding_dim.unwrap_or(self.block_out_channels[0] * 4);
        let text_time = match self.addition_embed_type.as_deref() {
            None => None,
            Some("text_time") => {
                let t = self.addition_time_embed_dim.ok_or_else(|| {
                    invalid(
                        origin,
                        "addition_time_embed_dim",
                        "required with addition_embed_type \"text_time\"",
                    )
                })?;
                let p = self.projection_class_embeddings_input_dim.ok_or_else(|| {
                    invalid(
                        origin,
                        "projection_class_embeddings_input_dim",
                        "required with addition_embed_type \"text_time\"",
                    )
                })?;
                Some((t, p))
            }
            Some(other) => {
                return Err(invalid(
                    origin,
                    "addition_embed_type",
                    format!("`{other}` is not supported (only \"text_time\")"),
                ))
            }
        };
        Ok(UNetPlan { groups, time_embed_dim, text_time, down, mid, up })
    }

    fn reject_unsupported(&self, origin: &str) -> Result<()> {
        let reject = |field: &str, why: String| Err(invalid(origin, field, why));
        check_act(origin, "act_fn", &self.act_fn)?;
        if self.only_cross_attention.any() {
            return reject("only_cross_attention", "true is not supported".into());
        }
        if self.mid_block_only_cross_attention == Some(true) {
            return reject("mid_block_only_cross_attention", "true is not supported".into());
        }
        if self.dual_cross_attention {
            return reject("dual_cross_attention", "true is not supported".into());
        }
        if self.reverse_transformer_layers_per_block.is_some() {
            return reject(
                "reverse_transformer_layers_per_block",
                "asymmetric UNets are not supported".into(),
            );
        }
        if let Some(t) = &self.encoder_hid_dim_type {
            return reject("encoder_hid_dim_type", format!("`{t}` is not supported"));
        }
        if let Some(d) = self.encoder_hid_dim {
            return reject("encoder_hid_dim", format!("{d}: encoder projection is not supported"));
        }
        if let Some(t) = &self.class_embed_type {
            return reject("class_embed_type", format!("`{t}` is not supported"));
        }
        if let Some(n) = self.num_class_embeds {
            return reject("num_class_embeds", format!("{n}: class embeddings are not supported"));
        }
        if self.class_embeddings_concat {
            return reject("class_embeddings_concat", "true is not supported".into());
        }
        if self.resnet_time_scale_shift != "default" {
            return reject(
                "resnet_time_scale_shift",
                format!("`{}` is not supported (only \"default\")", self.resnet_time_scale_shift),
            );
        }
        if self.resnet_skip_time_act {
            return reject("resnet_skip_time_act", "true is not supported".into());
        }
        if self.time_embedding_type != "positional" {
            return reject(
                "time_embedding_type",
                format!("`{}` is not supported (only \"positional\")", self.time_embedding_type),
            );
        }
        if let Some(a) = &self.time_embedding_act_fn {
            return reject("time_embedding_act_fn", format!("`{a}` is not supported"));
        }
        if let Some(a) = &self.timestep_post_act {
            return reject("timestep_post_act", format!("`{a}` is not supported"));
        }
        if let Some(d) = self.time_cond_proj_dim {
            return reject(
                "time_cond_proj_dim",
                format!("{d}: timestep conditioning (LCM) is not supported"),
            );
        }
        if self.attention_type != "default" {
            return reject(
                "attention_type",
                format!("`{}` is not supported (only \"default\")", self.attention_type),
            );
        }
        if let Some(n) = &self.cross_attention_norm {
            return reject("cross_attention_norm", format!("`{n}` is not supported"));
        }
        for (field, k) in [("conv_in_kernel", self.conv_in_kernel), ("conv_out_kernel", self.conv_out_kernel)]
        {
            if k % 2 == 0 {
                return reject(field, format!("even kernel size {k} is not supported"));
            }
        }
        Ok(())
    }
}

/// The public SD1.5 `unet/config.json`.
pub fn sd15_unet_config() -> UNet2DConditionConfig {
    UNet2DConditionConfig {
        cross_attention_dim: IntOrList::Int(768),
        attention_head_dim: Some(IntOrList::Int(8)),
        ..UNet2DConditionConfig::default()
    }
}

/// The public SD1.5 inpainting `unet/config.json` (9 input channels).
pub fn sd15_inpaint_unet_config() -> UNet2DConditionConfig {
    UNet2DConditionConfig { in_channels: 9, ..sd15_unet_config() }
}

/// The public SD2.1 (768-v) `unet/config.json`.
pub fn sd21_unet_config() -> UNet2DConditionConfig {
    UNet2DConditionConfig {
        cross_attention_dim: IntOrList::Int(1024),
        attention_head_dim: Some(IntOrList::List(vec![5, 10, 20, 20])),
        use_linear_projection: true,
        upcast_attention: true,
        ..UNet2DConditionConfig::default()
    }
}

/// The public SDXL 1.0 base `unet/config.json`.
pub fn sdxl_unet_config() -> UNet2DConditionConfig {
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    UNet2DConditionConfig {
        addition_embed_type: Some("text_time".into()),
        addition_time_embed_dim: Some(256),
        attention_head_dim: Some(IntOrList::List(vec![5, 10, 20])),
        block_out_channels: vec![320, 640, 1280],
        cross_attention_dim: IntOrList::Int(2048),
        down_block_types: s(&["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"]),
        up_block_types: s(&["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"]),
        projection_class_embeddings_input_dim: Some(2816),
        transformer_layers_per_block: LayersPerBlock::List(vec![1, 2, 10]),
        use_linear_projection: true,
        ..UNet2DConditionConfig::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sd15_heads_and_channels() {
        let plan = sd15_unet_config().plan("sd15").expect("sd15 config is valid");
        assert_eq!(plan.time_embed_dim, 1280);
        assert_eq!(plan.down[0].heads, 8);
        assert_eq!(plan.up[0].kind, BlockKind::Plain);
        assert_eq!(plan.up[1].prev_output_channels, 1280);
        assert_eq!(plan.up[3].in_channels, 320);
        assert_eq!(plan.up[3].resnets, 3);
    }

    #[test]
    fn first_attention_level_and_heads() {
        assert_eq!(sd15_unet_config().first_attention(), Some((0, 8)));
        assert_eq!(sdxl_unet_config().first_attention(), Some((1, 10)));
    }

    #[test]
    fn attention_head_dim_is_head_count_when_num_heads_missing() {
        let plan = sd21_unet_config().plan("sd21").expect("sd21 config is valid");
        assert_eq!(plan.down.iter().map(|b| b.heads).collect::<Vec<_>>(), vec![5, 10, 20, 20]);
        // up blocks walk the heads in reverse.
        assert_eq!(plan.up[1].heads, 20);
        assert_eq!(plan.up[3].heads, 5);
    }

    #[test]
    fn sdxl_plan() {
        let plan = sdxl_unet_config().plan("sdxl").expect("sdxl config is valid");
        assert_eq!(plan.text_time, Some((256, 2816)));
        assert_eq!(plan.mid.transformer_layers, 10);
        assert_eq!(plan.up[0].transformer_layers, 10);
        assert_eq!(plan.down[0].kind, BlockKind::Plain);
    }

    #[test]
    fn rejects_unsupported_options_by_name() {
        let json = r#"{"class_embed_type": "timestep", "cross_attention_dim": 32}"#;
        let cfg: UNet2DConditionConfig = serde_json::from_str(json).expect("parses");
        let err = cfg.validate("unet/config.json").expect_err("must reject");
        let msg = err.to_string();
        assert!(msg.contains("class_embed_type") && msg.contains("unet/config.json"), "{msg}");

        let json = r#"{"time_cond_proj_dim": 256}"#;
        let cfg: UNet2DConditionConfig = serde_json::from_str(json).expect("parses");
        assert!(cfg.validate("x").is_err());

        let json = r#"{"transformer_layers_per_block": [[1, 1], [2, 2], [3, 3], [4, 4]]}"#;
        let cfg: UNet2DConditionConfig = serde_json::from_str(json).expect("parses");
        let msg = cfg.validate("x").expect_err("must reject").to_string();
        assert!(msg.contains("transformer_layers_per_block"), "{msg}");
    }

    #[test]
    fn parses_real_diffusers_keys() {
        let json = r#"{
          "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.6.0",
          "act_fn": "silu", "attention_head_dim": 8,
          "block_out_channels": [320, 640, 1280, 1280], "center_input_sample": false,
          "cross_attention_dim": 768,
          "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
          "downsample_padding": 1, "flip_sin_to_cos": true, "freq_shift": 0, "in_channels": 4,
          "layers_per_block": 2, "mid_block_scale_factor": 1, "norm_eps": 1e-05,
          "norm_num_groups": 32, "out_channels": 4, "sample_size": 64,
          "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"]
        }"#;
        let cfg: UNet2DConditionConfig = serde_json::from_str(json).expect("parses");
        assert_eq!(cfg, sd15_unet_config());
    }
}
