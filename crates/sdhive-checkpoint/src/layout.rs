//! Recognising what a checkpoint is from its tensor names: the model family (SD1.x, SD2.x,
//! SDXL), the UNet input variant, where each component lives, and what a file that is not a
//! full checkpoint most likely is.

use crate::error::{CheckpointError, Result};
use crate::file::CheckpointFile;
use serde::{Deserialize, Serialize};

pub(crate) const UNET: &str = "model.diffusion_model.";
pub(crate) const VAE: &str = "first_stage_model.";
pub(crate) const SD1_CLIP: &str = "cond_stage_model.transformer.";
pub(crate) const SD2_OPENCLIP: &str = "cond_stage_model.model.";
pub(crate) const SDXL_CLIP: &str = "conditioner.embedders.0.transformer.";
pub(crate) const SDXL_OPENCLIP: &str = "conditioner.embedders.1.model.";
const SDXL_REFINER_OPENCLIP: &str = "conditioner.embedders.0.model.";

/// The Stable Diffusion generation a checkpoint belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// SD1.x: CLIP ViT-L/14 text encoder (transformers naming inside the checkpoint).
    Sd1,
    /// SD2.x: OpenCLIP ViT-H/14 text encoder, linear `proj_in`, 64-wide attention heads.
    Sd2,
    /// SDXL base: CLIP ViT-L/14 plus OpenCLIP ViT-bigG/14, `text_time` add-embedding.
    Sdxl,
}

impl Family {
    pub fn as_str(self) -> &'static str {
        match self {
            Family::Sd1 => "sd1",
            Family::Sd2 => "sd2",
            Family::Sdxl => "sdxl",
        }
    }
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Family::Sd1 => "Stable Diffusion 1.x",
            Family::Sd2 => "Stable Diffusion 2.x",
            Family::Sdxl => "Stable Diffusion XL",
        })
    }
}

/// What the UNet's first convolution expects, read from its input channel count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Variant {
    /// 4 latent channels.
    Standard,
    /// 9 channels: latents, the downsampled mask and the masked image's latents.
    Inpainting,
    /// 8 channels: latents and the conditioning image's latents (InstructPix2Pix-style).
    ImageEdit,
    /// Any other input width (depth-conditioned and the like); the weights convert, the
    /// caller must know what to feed.
    Other { in_channels: usize },
}

impl Variant {
    pub fn from_in_channels(in_channels: usize) -> Self {
        match in_channels {
            4 => Variant::Standard,
            9 => Variant::Inpainting,
            8 => Variant::ImageEdit,
            n => Variant::Other { in_channels: n },
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TowerKind {
    /// transformers `CLIPTextModel` names, kept as they are.
    HfClip,
    /// OpenCLIP `resblocks` with fused attention.
    OpenClip { with_projection: bool },
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Tower {
    pub prefix: &'static str,
    pub kind: TowerKind,
}

#[derive(Debug, Clone)]
pub(crate) struct Layout {
    pub family: Family,
    pub text_encoder: Tower,
    pub text_encoder_2: Option<Tower>,
}

pub(crate) fn detect(file: &CheckpointFile) -> Result<Layout> {
    let unsupported =
        |reason: &str| Err(CheckpointError::Unsupported { path: file.path.clone(), reason: reason.into() });
    if crate::sd3::is_sd3(file) {
        return unsupported(
            "an SD3/SD3.5 checkpoint (`model.diffusion_model.joint_blocks.*`), not an SD1/SD2/SDXL UNet: it \
             converts through `load_sd3_single_file_on`",
        );
    }
    if !file.has_prefix(UNET) {
        return Err(explain_foreign(file));
    }
    if file.contains("edm_mean") || file.contains("edm_std") {
        return unsupported("Playground v2.5-style EDM checkpoint (edm_mean/edm_std); only SD1.x, SD2.x and SDXL base are converted");
    }
    if file.has_prefix("control_model.") {
        return unsupported("the checkpoint bundles a ControlNet (`control_model.*`)");
    }
    let sdxl_clip = file.has_prefix(SDXL_CLIP);
    let sdxl_open = file.has_prefix(SDXL_OPENCLIP);
    let layout = if sdxl_clip || sdxl_open {
        if !(sdxl_clip && sdxl_open) {
            let (component, prefix) = if sdxl_clip {
                ("SDXL OpenCLIP ViT-bigG text encoder", SDXL_OPENCLIP)
            } else {
                ("SDXL CLIP ViT-L text encoder", SDXL_CLIP)
            };
            return Err(CheckpointError::MissingComponent {
                path: file.path.clone(),
                component,
                prefix: prefix.into(),
            });
        }
        Layout {
            family: Family::Sdxl,
            text_encoder: Tower { prefix: SDXL_CLIP, kind: TowerKind::HfClip },
            text_encoder_2: Some(Tower {
                prefix: SDXL_OPENCLIP,
                kind: TowerKind::OpenClip { with_projection: true },
            }),
        }
    } else if file.has_prefix(SDXL_REFINER_OPENCLIP) {
        return unsupported(
            "SDXL refiner (a single OpenCLIP text encoder under `conditioner.embedders.0.model.`)",
        );
    } else if file.has_prefix(SD1_CLIP) {
        Layout {
            family: Family::Sd1,
            text_encoder: Tower { prefix: SD1_CLIP, kind: TowerKind::HfClip },
            text_encoder_2: None,
        }
    } else if file.has_prefix(SD2_OPENCLIP) {
        Layout {
            family: Family::Sd2,
            text_encoder: Tower {
                prefix: SD2_OPENCLIP,
                kind: TowerKind::OpenClip { with_projection: false },
            },
            text_encoder_2: None,
        }
    } else {
        return Err(CheckpointError::MissingComponent {
            path: file.path.clone(),
            component: "text encoder",
            prefix: format!("{SD1_CLIP}, {SD2_OPENCLIP} or conditioner.embedders.*"),
        });
    };
    if !file.has_prefix(VAE) {
        return Err(CheckpointError::MissingComponent {
            path: file.path.clone(),
            component: "VAE",
            prefix: VAE.into(),
        });
    }
    let label = format!("{UNET}label_emb.");
    match (layout.family, file.has_prefix(&label)) {
        (Family::Sdxl, false) => {
            return Err(CheckpointError::MissingTensor {
                path: file.path.clone(),
                tensor: format!("{label}0.0.weight"),
                context: "SDXL's text_time add-embedding".into(),
            })
        }
        (Family::Sd1 | Family::Sd2, true) => {
            return unsupported(
                "the UNet has a class/label embedding (`label_emb`), as in the SD2 x4 upscaler or unCLIP",
            )
        }
        _ => {}
    }
    Ok(layout)
}

/// Says what a file without an LDM UNet most likely is.
fn explain_foreign(file: &CheckpointFile) -> CheckpointError {
    let any = |p: &str| file.tensors.keys().any(|k| k.starts_with(p) || k.contains(p));
    let reason = if any("lora_unet_") || any("lora_te") || any(".lora_down.") || any(".lora_A.") {
        "this is a LoRA, not a full checkpoint".to_string()
    } else if file.has_prefix("down_blocks.") || file.has_prefix("mid_block.") || file.has_prefix("conv_in.")
    {
        "names are already in diffusers layout (a single diffusers component); load its folder instead"
            .to_string()
    } else if file.has_prefix("control_model.") || file.has_prefix("input_hint_block.") {
        "this is a ControlNet".to_string()
    } else if any("double_blocks.") || any("joint_blocks.") || any("single_blocks.") {
        "this is a transformer (Flux/SD3-style) checkpoint, not a Stable Diffusion 1/2/XL UNet".to_string()
    } else if file.has_prefix("encoder.") && file.has_prefix("decoder.") {
        "this is a standalone VAE".to_string()
    } else if file.has_prefix(VAE) || file.has_prefix(SD1_CLIP) || file.has_prefix("conditioner.") {
        return CheckpointError::MissingComponent {
            path: file.path.clone(),
            component: "UNet",
            prefix: UNET.into(),
        };
    } else {
        let sample: Vec<&str> = file.tensors.keys().take(3).map(String::as_str).collect();
        format!(
            "no `{UNET}*` tensors ({} tensors, e.g. {})",
            file.tensors.len(),
            if sample.is_empty() { "none".into() } else { sample.join(", ") }
        )
    };
    CheckpointError::UnknownLayout { path: file.path.clone(), reason }
}
