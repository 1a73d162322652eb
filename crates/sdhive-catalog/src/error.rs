//! Everything that can go wrong while scanning the model library or hashing one of its files, each naming the
//! folder or file at fault; and `NotFound`, the answer to a checkpoint name that matched nothing, which carries
//! the closest titles so the user can correct the name rather than list the folder.

use std::fmt;
use std::path::PathBuf;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum CatalogError {
    /// A configured models or VAE folder is missing or unreadable: the operator named it, so it is never skipped
    /// silently.
    #[error("{kind} dir {} cannot be read: {source}", path.display())]
    Dir {
        kind: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{kind} dir {} is not a folder", path.display())]
    NotADir { kind: &'static str, path: PathBuf },

    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A hash of a file that is still being copied would be cached as the file's identity, so it is refused.
    #[error(
        "{} changed while it was being hashed (size or modification time differs); hash it again once it is \
         complete",
        path.display()
    )]
    ChangedWhileHashing { path: PathBuf },

    #[error("no checkpoint at index {index}: the catalog lists {len}")]
    NoSuchCheckpoint { index: usize, len: usize },

    #[error("no VAE at index {index}: the catalog lists {len}")]
    NoSuchVae { index: usize, len: usize },

    #[error("no {kind} at index {index}: the catalog lists {len}")]
    NoSuchNetwork { kind: &'static str, index: usize, len: usize },
}

impl CatalogError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        CatalogError::Io { path: path.into(), source }
    }
}

/// A checkpoint name that matched no entry, with the titles most like it (best first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotFound {
    pub query: String,
    pub closest: Vec<String>,
}

impl fmt::Display for NotFound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.closest.is_empty() {
            return write!(f, "no checkpoint `{}`: no checkpoints in the models dirs", self.query);
        }
        if self.query.trim().is_empty() {
            return write!(f, "no checkpoint given; available: {}", self.closest.join(", "));
        }
        write!(f, "no checkpoint `{}`; closest: {}", self.query, self.closest.join(", "))
    }
}

impl std::error::Error for NotFound {}
