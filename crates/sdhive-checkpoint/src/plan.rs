//! The conversion plan: for every diffusers tensor, which checkpoint tensor it comes from and
//! how it is reshaped. Plans are built and shape-checked from the header alone; tensor data is
//! read from the mapping only when a plan is materialised.

use crate::error::{CheckpointError, Result};
use crate::file::CheckpointFile;
use candle_core::{Device, Tensor};
use std::collections::{BTreeMap, HashMap};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Copy,
    /// `[C_out, C_in, 1, 1]` convolution kernel to the `[C_out, C_in]` linear weight that does the same.
    SqueezeConv,
    /// One of `parts` equal slices along dimension 0 (fused q/k/v projections).
    Chunk {
        index: usize,
        parts: usize,
    },
    /// 2-D transpose (OpenCLIP multiplies `x @ P`, a transformers Linear computes `x @ W^T`).
    Transpose,
    /// The two halves along dimension 0 exchanged: SAI's adaLN modulation emits (shift, scale), diffusers'
    /// `AdaLayerNormContinuous` reads (scale, shift).
    SwapHalves,
}

#[derive(Debug, Clone)]
pub(crate) struct Source {
    pub key: String,
    pub op: Op,
}

#[derive(Debug, Default)]
pub(crate) struct Plan {
    pub entries: BTreeMap<String, Source>,
}

impl Plan {
    pub fn add(&mut self, file: &CheckpointFile, target: String, key: &str, op: Op) -> Result<()> {
        if let Some(prev) = self.entries.get(&target) {
            return Err(CheckpointError::UnknownLayout {
                path: file.path.clone(),
                reason: format!("both `{}` and `{key}` map to diffusers tensor `{target}`", prev.key),
            });
        }
        self.entries.insert(target, Source { key: key.to_string(), op });
        Ok(())
    }

    /// Drops every target for which `keep` is false and returns the checkpoint keys dropped.
    pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) -> Vec<String> {
        let mut dropped = Vec::new();
        self.entries.retain(|target, src| {
            let k = keep(target);
            if !k {
                dropped.push(src.key.clone());
            }
            k
        });
        dropped.sort();
        dropped.dedup();
        dropped
    }

    pub fn materialize(&self, file: &CheckpointFile, device: &Device) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::with_capacity(self.entries.len());
        for (target, src) in &self.entries {
            let meta = file.meta(&src.key)?;
            let bad_shape = || CheckpointError::Shape {
                path: file.path.clone(),
                tensor: src.key.clone(),
                shape: meta.shape.clone(),
                expected: expected_for(src.op).into(),
            };
            let shape = output_shape(&meta.shape, src.op).ok_or_else(bad_shape)?;
            let tensor = match src.op {
                Op::Copy | Op::SqueezeConv => file.load_part(&src.key, 0, 1, &shape, device)?,
                Op::Chunk { index, parts } => file.load_part(&src.key, index, parts, &shape, device)?,
                Op::SwapHalves => {
                    let mut half = shape.clone();
                    half[0] /= 2;
                    let first = file.load_part(&src.key, 0, 2, &half, device)?;
                    let second = file.load_part(&src.key, 1, 2, &half, device)?;
                    Tensor::cat(&[second, first], 0).map_err(|e| CheckpointError::Tensor {
                        path: file.path.clone(),
                        tensor: src.key.clone(),
                        reason: format!("{:?} {:?}: swapping halves: {e}", meta.dtype, meta.shape),
                    })?
                }
                Op::Transpose => {
                    let t = file.load_part(&src.key, 0, 1, &meta.shape, device)?;
                    t.t().and_then(|t| t.contiguous()).map_err(|e| CheckpointError::Tensor {
                        path: file.path.clone(),
                        tensor: src.key.clone(),
                        reason: format!("{:?} {:?}: transpose: {e}", meta.dtype, meta.shape),
                    })?
                }
            };
            out.insert(target.clone(), tensor);
        }
        Ok(out)
    }
}

fn expected_for(op: Op) -> &'static str {
    match op {
        Op::Copy => "any shape",
        Op::SqueezeConv => "[C, C, 1, 1] or [C, C]",
        Op::Chunk { .. } => "a first dimension divisible into equal q/k/v parts",
        Op::Transpose => "a 2-D matrix",
        Op::SwapHalves => "a first dimension of even length (shift and scale halves)",
    }
}

pub(crate) fn output_shape(shape: &[usize], op: Op) -> Option<Vec<usize>> {
    match op {
        Op::Copy => Some(shape.to_vec()),
        Op::SqueezeConv => match shape {
            [o, i, 1, 1] | [o, i] => Some(vec![*o, *i]),
            _ => None,
        },
        Op::Chunk { parts, .. } => match shape.split_first() {
            Some((first, rest)) if parts > 0 && first % parts == 0 => {
                let mut s = vec![first / parts];
                s.extend_from_slice(rest);
                Some(s)
            }
            _ => None,
        },
        Op::Transpose => match shape {
            [a, b] => Some(vec![*b, *a]),
            _ => None,
        },
        Op::SwapHalves => match shape.first() {
            Some(first) if first % 2 == 0 => Some(shape.to_vec()),
            _ => None,
        },
    }
}

/// Shape checks against the checkpoint header, phrased in checkpoint names.
pub(crate) struct Shapes<'a> {
    pub file: &'a CheckpointFile,
}

impl Shapes<'_> {
    pub fn get(&self, key: &str, context: &str) -> Result<&[usize]> {
        self.file.shape(key).ok_or_else(|| CheckpointError::MissingTensor {
            path: self.file.path.clone(),
            tensor: key.to_string(),
            context: context.to_string(),
        })
    }

    pub fn fail(&self, key: &str, expected: impl Into<String>) -> CheckpointError {
        CheckpointError::Shape {
            path: self.file.path.clone(),
            tensor: key.to_string(),
            shape: self.file.shape(key).map(<[usize]>::to_vec).unwrap_or_default(),
            expected: expected.into(),
        }
    }

    /// Requires `key` to have exactly `rank` dimensions and returns them.
    pub fn rank(&self, key: &str, rank: usize, context: &str) -> Result<Vec<usize>> {
        let shape = self.get(key, context)?;
        if shape.len() != rank {
            return Err(self.fail(key, format!("{rank} dimensions ({context})")));
        }
        Ok(shape.to_vec())
    }

    /// Requires `key` to exist and match `want`; `None` entries are free.
    pub fn expect(&self, key: &str, want: &[Option<usize>], context: &str) -> Result<Vec<usize>> {
        let shape = self.get(key, context)?;
        let ok = shape.len() == want.len() && shape.iter().zip(want).all(|(s, w)| w.is_none_or(|w| *s == w));
        if ok {
            Ok(shape.to_vec())
        } else {
            let dims: Vec<String> = want.iter().map(|w| w.map_or("_".into(), |w| w.to_string())).collect();
            Err(self.fail(key, format!("[{}] ({context})", dims.join(", "))))
        }
    }

    /// As [`Shapes::expect`], for tensors a layout may leave out.
    pub fn expect_opt(&self, key: &str, want: &[Option<usize>], context: &str) -> Result<()> {
        if self.file.contains(key) {
            self.expect(key, want, context)?;
        }
        Ok(())
    }
}
