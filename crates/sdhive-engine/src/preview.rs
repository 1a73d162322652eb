//! Live previews (`preview_every`): the operator's choice of preview decoder (`serve --preview`) and the
//! decoder an engine actually runs for its loaded model, as `/v1/info` reports it.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// What `--preview` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PreviewMode {
    /// TAESD where its weights are found and the worker runs on a GPU, else the latent preview.
    #[default]
    Auto,
    /// TAESD (the tiny autoencoder) decodes each preview at the output size; its weights must be found.
    Taesd,
    /// The linear latent-to-RGB map at 1/8 of the output size.
    Latent,
    /// No previews: `preview_every` is accepted and ignored.
    Off,
}

impl PreviewMode {
    pub const ALL: [PreviewMode; 4] =
        [PreviewMode::Auto, PreviewMode::Taesd, PreviewMode::Latent, PreviewMode::Off];

    pub fn name(self) -> &'static str {
        match self {
            PreviewMode::Auto => "auto",
            PreviewMode::Taesd => "taesd",
            PreviewMode::Latent => "latent",
            PreviewMode::Off => "off",
        }
    }
}

impl fmt::Display for PreviewMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PreviewMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let wanted = s.trim().to_ascii_lowercase();
        PreviewMode::ALL
            .into_iter()
            .find(|m| m.name() == wanted)
            .ok_or_else(|| format!("`{s}` is not a preview mode (auto, taesd, latent, off)"))
    }
}

/// The decoder an engine makes its previews with for the model it has loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PreviewDecoder {
    /// No previews.
    Off,
    /// The linear latent-to-RGB map at latent resolution.
    #[default]
    Latent,
    /// TAESD for the model's family (`taesd` for SD1/SD2, `taesdxl` for SDXL), at the output size.
    Taesd,
}

impl PreviewDecoder {
    pub fn name(self) -> &'static str {
        match self {
            PreviewDecoder::Off => "off",
            PreviewDecoder::Latent => "latent",
            PreviewDecoder::Taesd => "taesd",
        }
    }
}

impl fmt::Display for PreviewDecoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_by_name_and_round_trip() {
        for mode in PreviewMode::ALL {
            assert_eq!(mode.name().parse::<PreviewMode>(), Ok(mode));
            assert_eq!(serde_json::to_value(mode).unwrap(), serde_json::json!(mode.name()));
        }
        assert_eq!(" TAESD ".parse::<PreviewMode>(), Ok(PreviewMode::Taesd));
        let err = "vae".parse::<PreviewMode>().unwrap_err();
        assert!(err.contains("`vae`") && err.contains("auto, taesd, latent, off"), "{err}");
        assert_eq!(serde_json::to_value(PreviewDecoder::Taesd).unwrap(), serde_json::json!("taesd"));
        assert_eq!(PreviewDecoder::default(), PreviewDecoder::Latent);
    }
}
