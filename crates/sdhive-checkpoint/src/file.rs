//! The memory-mapped checkpoint: header parsing with errors that say what is wrong with the
//! file, tensor metadata lookups that touch no tensor data, and loading of single tensors
//! (or byte-contiguous slices of them) straight from the mapping.

use crate::error::{CheckpointError, Result};
use candle_core::{DType, Device, Tensor};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensorError, SafeTensors};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Where one tensor lives in the file, as the header declares it.
#[derive(Debug, Clone)]
pub(crate) struct TensorMeta {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    start: usize,
    end: usize,
}

pub(crate) struct CheckpointFile {
    pub path: PathBuf,
    mmap: Mmap,
    data_start: usize,
    pub tensors: BTreeMap<String, TensorMeta>,
    pub metadata: BTreeMap<String, String>,
}

const HEADER_LEN_BYTES: usize = 8;

impl CheckpointFile {
    pub fn open(path: &Path) -> Result<Self> {
        let io = |source| CheckpointError::Io { path: path.to_path_buf(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len < HEADER_LEN_BYTES as u64 {
            return Err(CheckpointError::NotSafetensors {
                path: path.to_path_buf(),
                reason: format!("file is {len} bytes, shorter than the 8-byte safetensors header length"),
            });
        }
        // SAFETY: the mapping is read-only and private to this process. Another process
        // truncating the file while we read it is the usual, documented mmap caveat.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        if let Some(kind) = sniff_foreign_format(&mmap) {
            return Err(CheckpointError::NotSafetensors {
                path: path.to_path_buf(),
                reason: format!("{kind}; only .safetensors single-file checkpoints are supported"),
            });
        }
        let (header_len, meta) =
            SafeTensors::read_metadata(&mmap).map_err(|e| header_error(path, &mmap, e))?;
        let tensors = meta
            .tensors()
            .into_iter()
            .map(|(name, info)| {
                let (start, end) = info.data_offsets;
                (name, TensorMeta { dtype: info.dtype, shape: info.shape.clone(), start, end })
            })
            .collect();
        let metadata = meta.metadata().clone().unwrap_or_default().into_iter().collect();
        Ok(Self {
            path: path.to_path_buf(),
            mmap,
            data_start: HEADER_LEN_BYTES + header_len,
            tensors,
            metadata,
        })
    }

    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|m| m.shape.as_slice())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// All tensor names starting with `prefix`, in order.
    pub fn names_with_prefix<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.tensors
            .range(prefix.to_string()..)
            .map(|(k, _)| k.as_str())
            .take_while(move |k| k.starts_with(prefix))
    }

    /// The stored bytes of tensor `name`.
    pub fn bytes(&self, name: &str) -> Result<&[u8]> {
        let meta = self.meta(name)?;
        Ok(&self.mmap[self.data_start + meta.start..self.data_start + meta.end])
    }

    pub fn has_prefix(&self, prefix: &str) -> bool {
        self.names_with_prefix(prefix).next().is_some()
    }

    pub fn meta(&self, name: &str) -> Result<&TensorMeta> {
        self.tensors.get(name).ok_or_else(|| CheckpointError::MissingTensor {
            path: self.path.clone(),
            tensor: name.to_string(),
            context: "named by the conversion plan".into(),
        })
    }

    /// Loads `name` as a tensor of `shape` built from the `part`-th of `parts` equal byte
    /// ranges of its data. Row-major storage makes a split along dimension 0 (and a reshape)
    /// a plain byte range, so q/k/v splits and 1x1-conv squeezes never copy the whole tensor.
    pub fn load_part(
        &self,
        name: &str,
        part: usize,
        parts: usize,
        shape: &[usize],
        device: &Device,
    ) -> Result<Tensor> {
        let meta = self.meta(name)?;
        let fail = |reason: String| CheckpointError::Tensor {
            path: self.path.clone(),
            tensor: name.to_string(),
            reason: format!("{:?} {:?}: {reason}", meta.dtype, meta.shape),
        };
        let dtype = DType::try_from(meta.dtype).map_err(|e| fail(e.to_string()))?;
        let bytes = &self.mmap[self.data_start + meta.start..self.data_start + meta.end];
        if parts == 0 || bytes.len() % parts != 0 {
            return Err(fail(format!("{} bytes do not split into {parts} equal parts", bytes.len())));
        }
        let step = bytes.len() / parts;
        let slice = &bytes[part * step..(part + 1) * step];
        let elems: usize = shape.iter().product();
        if elems * dtype.size_in_bytes() != slice.len() {
            return Err(fail(format!("{} bytes cannot hold shape {shape:?}", slice.len())));
        }
        Tensor::from_raw_buffer(slice, dtype, shape, device).map_err(|e| fail(e.to_string()))
    }
}

/// Common non-safetensors checkpoint containers, recognised by their magic bytes so the user
/// is told what they have instead of "invalid header".
fn sniff_foreign_format(bytes: &[u8]) -> Option<&'static str> {
    if bytes.starts_with(b"PK\x03\x04") {
        Some("this is a zip archive, as PyTorch writes .ckpt/.pt/.bin (pickle) checkpoints")
    } else if bytes.first() == Some(&0x80) && matches!(bytes.get(1), Some(2..=5)) {
        Some("this is a raw Python pickle (legacy .ckpt)")
    } else if bytes.starts_with(b"GGUF") {
        Some("this is a GGUF file")
    } else {
        None
    }
}

fn header_error(path: &Path, bytes: &[u8], err: SafeTensorError) -> CheckpointError {
    let path = path.to_path_buf();
    let declared = bytes
        .get(..HEADER_LEN_BYTES)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_le_bytes)
        .unwrap_or(0);
    let available = bytes.len().saturating_sub(HEADER_LEN_BYTES) as u64;
    let looks_like_json = bytes.get(HEADER_LEN_BYTES) == Some(&b'{');
    match err {
        SafeTensorError::InvalidHeaderLength | SafeTensorError::HeaderTooLarge
            if looks_like_json && declared > available =>
        {
            CheckpointError::Truncated {
                path,
                reason: format!("header declares {declared} bytes but only {available} follow"),
            }
        }
        SafeTensorError::HeaderTooLarge
        | SafeTensorError::HeaderTooSmall
        | SafeTensorError::InvalidHeaderLength => CheckpointError::NotSafetensors {
            path,
            reason: format!(
                "the first 8 bytes declare a {declared}-byte JSON header in a file of {} bytes",
                bytes.len()
            ),
        },
        SafeTensorError::InvalidHeader(_) if !looks_like_json => {
            CheckpointError::NotSafetensors { path, reason: "the header is not UTF-8 JSON".into() }
        }
        SafeTensorError::InvalidHeaderDeserialization(_) if !looks_like_json => {
            CheckpointError::NotSafetensors { path, reason: "the header is not a JSON object".into() }
        }
        SafeTensorError::MetadataIncompleteBuffer => match declared_data_end(bytes) {
            Some(end) if end > available.saturating_sub(declared) => CheckpointError::Truncated {
                path,
                reason: format!(
                    "tensor data needs {end} bytes after the header but only {} are present",
                    available.saturating_sub(declared)
                ),
            },
            Some(end) => CheckpointError::CorruptHeader {
                path,
                reason: format!(
                    "{} bytes of trailing data after the last tensor",
                    available.saturating_sub(declared) - end
                ),
            },
            None => CheckpointError::CorruptHeader {
                path,
                reason: SafeTensorError::MetadataIncompleteBuffer.to_string(),
            },
        },
        SafeTensorError::TensorInvalidInfo => CheckpointError::CorruptHeader {
            path,
            reason: match inconsistent_tensor(bytes) {
                Some(name) => format!("tensor `{name}`: shape and dtype disagree with its data_offsets"),
                None => "a tensor's shape and dtype disagree with its data_offsets".into(),
            },
        },
        other => CheckpointError::CorruptHeader { path, reason: other.to_string() },
    }
}

/// The header as loose JSON, for naming the culprit once the strict parser has refused it.
fn header_json(bytes: &[u8]) -> Option<serde_json::Map<String, serde_json::Value>> {
    let n = usize::try_from(u64::from_le_bytes(bytes.get(..HEADER_LEN_BYTES)?.try_into().ok()?)).ok()?;
    let text = std::str::from_utf8(bytes.get(HEADER_LEN_BYTES..HEADER_LEN_BYTES.checked_add(n)?)?).ok()?;
    match serde_json::from_str(text).ok()? {
        serde_json::Value::Object(map) => Some(map),
        _ => None,
    }
}

fn offsets(info: &serde_json::Value) -> Option<(u64, u64)> {
    let o = info.get("data_offsets")?.as_array()?;
    Some((o.first()?.as_u64()?, o.get(1)?.as_u64()?))
}

fn declared_data_end(bytes: &[u8]) -> Option<u64> {
    let map = header_json(bytes)?;
    map.iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .filter_map(|(_, v)| offsets(v))
        .map(|(_, e)| e)
        .max()
}

fn inconsistent_tensor(bytes: &[u8]) -> Option<String> {
    let map = header_json(bytes)?;
    map.iter().filter(|(k, _)| k.as_str() != "__metadata__").find_map(|(name, info)| {
        let dtype: Dtype = serde_json::from_value(info.get("dtype")?.clone()).ok()?;
        let numel = info
            .get("shape")?
            .as_array()?
            .iter()
            .try_fold(1u64, |acc, d| d.as_u64().and_then(|d| acc.checked_mul(d)))?;
        let (start, end) = offsets(info)?;
        let bits = numel.checked_mul(dtype.bitsize() as u64)?;
        (end.checked_sub(start)? * 8 != bits).then(|| name.clone())
    })
}
