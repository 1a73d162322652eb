//! What the UNet predicts (noise or velocity). Weights cannot tell: an SD2-768-v checkpoint
//! and an SD2-base one have identical shapes. So this is only ever a hint gathered from
//! outside the tensors (a caller's config, a sidecar `.yaml` next to the file, safetensors
//! metadata, marker tensors some trainers add), and [`Prediction::Unknown`] otherwise.

use crate::file::CheckpointFile;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PredictionType {
    Epsilon,
    VPrediction,
}

impl PredictionType {
    /// The scheduler config spelling.
    pub fn as_diffusers(self) -> &'static str {
        match self {
            PredictionType::Epsilon => "epsilon",
            PredictionType::VPrediction => "v_prediction",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s.trim().trim_matches(|c| c == '"' || c == '\'').to_ascii_lowercase().as_str() {
            "eps" | "epsilon" => Some(PredictionType::Epsilon),
            "v" | "v_prediction" | "v-prediction" | "vpred" | "v_pred" => Some(PredictionType::VPrediction),
            _ => None,
        }
    }
}

/// Where a known prediction type came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PredictionSource {
    /// `prediction_type` in the override scheduler config.
    OverrideConfig,
    /// `parameterization:` in the LDM config beside the checkpoint (`model.yaml` for
    /// `model.safetensors`, the convention web UIs use).
    SidecarYaml(PathBuf),
    /// `modelspec.prediction_type` / a `-v` `modelspec.architecture` in the safetensors header.
    Metadata(String),
    /// A `v_pred` marker tensor, which some SDXL trainers save with v-prediction models.
    MarkerTensor(String),
    /// Set by the caller through [`crate::Converted::set_prediction_type`].
    Caller,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prediction {
    /// Nothing outside the weights said; the scheduler config carries the family's usual
    /// `epsilon` as a placeholder and the caller should decide (CLI flag, request field).
    Unknown,
    Known {
        kind: PredictionType,
        source: PredictionSource,
    },
}

impl Prediction {
    pub fn kind(&self) -> Option<PredictionType> {
        match self {
            Prediction::Unknown => None,
            Prediction::Known { kind, .. } => Some(*kind),
        }
    }
}

/// Hints that travel with the checkpoint file itself, strongest first.
pub(crate) fn from_file(file: &CheckpointFile) -> Prediction {
    if let Some(p) = sidecar_yaml(&file.path) {
        return p;
    }
    if let Some(v) = file.metadata.get("modelspec.prediction_type") {
        if let Some(kind) = PredictionType::parse(v) {
            return Prediction::Known {
                kind,
                source: PredictionSource::Metadata("modelspec.prediction_type".into()),
            };
        }
    }
    if let Some(arch) = file.metadata.get("modelspec.architecture") {
        // ModelSpec names v-models by suffix, e.g. `stable-diffusion-v2-768-v`.
        if arch.trim().ends_with("-v") {
            return Prediction::Known {
                kind: PredictionType::VPrediction,
                source: PredictionSource::Metadata("modelspec.architecture".into()),
            };
        }
    }
    if file.contains("v_pred") {
        return Prediction::Known {
            kind: PredictionType::VPrediction,
            source: PredictionSource::MarkerTensor("v_pred".into()),
        };
    }
    Prediction::Unknown
}

fn sidecar_yaml(checkpoint: &Path) -> Option<Prediction> {
    let path = checkpoint.with_extension("yaml");
    let text = std::fs::read_to_string(&path).ok()?;
    let value = text.lines().find_map(|line| {
        let line = line.split('#').next().unwrap_or_default().trim();
        line.strip_prefix("parameterization:")
    });
    let kind = match value {
        Some(v) => PredictionType::parse(v)?,
        // LatentDiffusion defaults to eps; only trust that for a file that is an LDM config.
        None if text.contains("unet_config") || text.contains("network_config") => PredictionType::Epsilon,
        None => return None,
    };
    Some(Prediction::Known { kind, source: PredictionSource::SidecarYaml(path) })
}
