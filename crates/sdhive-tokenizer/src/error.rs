//! The tokenizer's error type: every failure names the file it came from
//! (for the bundled vocabulary, the asset's name) so a broken model folder
//! can be fixed without guessing.

use std::path::PathBuf;

/// Why a tokenizer could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A required file is missing or unreadable.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON file does not parse.
    #[error("{} is not valid JSON: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// A file parses but its content is not what a CLIP tokenizer needs.
    #[error("{}: {detail}", path.display())]
    Invalid { path: PathBuf, detail: String },
    /// A special token (bos/eos/pad/unk) has no id.
    #[error("{}: {field} {token:?} is not in the vocabulary", path.display())]
    UnknownSpecialToken { path: PathBuf, field: &'static str, token: String },
}

impl TokenizerError {
    pub(crate) fn invalid(path: impl Into<PathBuf>, detail: impl Into<String>) -> Self {
        TokenizerError::Invalid { path: path.into(), detail: detail.into() }
    }
}
