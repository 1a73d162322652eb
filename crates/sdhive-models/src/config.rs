//! Shared pieces of the `config.json` readers: the int-or-list fields diffusers allows and
//! reading a config file with errors that name the file.

use crate::error::{invalid, ModelError, Result};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// A diffusers field that is either one value for every block or one value per block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum IntOrList {
    Int(usize),
    List(Vec<usize>),
}

impl IntOrList {
    /// Expands to exactly `n` per-block values, or says why it cannot.
    pub fn per_block(&self, n: usize, origin: &str, field: &str) -> Result<Vec<usize>> {
        match self {
            IntOrList::Int(v) => Ok(vec![*v; n]),
            IntOrList::List(vs) if vs.len() == n => Ok(vs.clone()),
            IntOrList::List(vs) => {
                Err(invalid(origin, field, format!("has {} entries but there are {n} blocks", vs.len())))
            }
        }
    }
}

/// `transformer_layers_per_block` may also be a list of lists (asymmetric UNets), which we
/// parse only to reject it with a clear message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LayersPerBlock {
    Int(usize),
    List(Vec<usize>),
    Nested(Vec<Vec<usize>>),
}

/// Same shape as diffusers' `only_cross_attention`: a bool or one bool per block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum BoolOrList {
    Bool(bool),
    List(Vec<bool>),
}

impl BoolOrList {
    pub fn any(&self) -> bool {
        match self {
            BoolOrList::Bool(b) => *b,
            BoolOrList::List(bs) => bs.iter().any(|b| *b),
        }
    }
}

impl Default for BoolOrList {
    fn default() -> Self {
        BoolOrList::Bool(false)
    }
}

/// Reads and parses a JSON config; serde's message names the field that failed.
pub fn read_json<T: DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| ModelError::ConfigIo { path: path.to_path_buf(), source })?;
    serde_json::from_str(&text).map_err(|source| ModelError::ConfigParse { path: path.to_path_buf(), source })
}

pub(crate) fn check_act(origin: &str, field: &str, act: &str) -> Result<()> {
    match act {
        "silu" | "swish" => Ok(()),
        other => {
            Err(invalid(origin, field, format!("activation `{other}` is not supported (only silu/swish)")))
        }
    }
}

pub(crate) fn check_divides(origin: &str, field: &str, groups: usize, channels: usize) -> Result<()> {
    if groups == 0 || !channels.is_multiple_of(groups) {
        return Err(invalid(origin, field, format!("{groups} groups do not divide {channels} channels")));
    }
    Ok(())
}
