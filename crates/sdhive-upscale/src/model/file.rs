//! Reading an upscaler file: pickles refused by extension, the safetensors header alone (tensor names, shapes and
//! types, for listing without reading the weights) or the whole file, and spandrel's key canonicalisation (a
//! `module.` / `netG.` prefix on every key removed).

use crate::error::UpscaleError;
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

/// Extensions of pickled PyTorch checkpoints.
const PICKLE_EXTENSIONS: [&str; 5] = ["pth", "pt", "ckpt", "bin", "pkl"];

/// A header larger than this is not an upscaler's (real ones are a few kB; this bounds the allocation a corrupt
/// length could ask for).
const MAX_HEADER: u64 = 64 << 20;

/// One tensor's entry in the header.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Byte range in the data section.
    pub offsets: (usize, usize),
    /// The name in the file (before canonicalisation).
    pub file_name: String,
}

/// The tensors of a file by canonical name.
pub(crate) type Entries = BTreeMap<String, Entry>;

pub(crate) fn refuse_pickle(path: &Path) -> Result<(), UpscaleError> {
    let ext = path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
    match ext {
        Some(ext) if PICKLE_EXTENSIONS.contains(&ext.as_str()) => Err(UpscaleError::Pickle {
            path: path.to_path_buf(),
            ext: format!(".{ext}"),
            name: path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
            stem: path.file_stem().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        }),
        _ => Ok(()),
    }
}

fn bad(path: &Path, reason: impl Into<String>) -> UpscaleError {
    UpscaleError::BadFile { path: path.to_path_buf(), reason: reason.into() }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> UpscaleError + '_ {
    move |source| UpscaleError::Io { path: path.to_path_buf(), source }
}

/// The header of `path` (read without the data) and the data section's length.
pub(crate) fn read_header(path: &Path) -> Result<(Entries, u64), UpscaleError> {
    refuse_pickle(path)?;
    let mut f = std::fs::File::open(path).map_err(io(path))?;
    let file_len = f.metadata().map_err(io(path))?.len();
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(|_| bad(path, format!("{file_len} bytes, too short for a header")))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER || n > file_len - 8 {
        return Err(bad(path, format!("the header claims {n} bytes of a {file_len}-byte file (truncated?)")));
    }
    let mut json = vec![0u8; n as usize];
    f.read_exact(&mut json).map_err(io(path))?;
    let entries = parse_header(path, &json, file_len - 8 - n)?;
    Ok((entries, file_len - 8 - n))
}

/// The whole file: its header and data section.
pub(crate) fn read_file(path: &Path) -> Result<(Entries, Vec<u8>), UpscaleError> {
    refuse_pickle(path)?;
    let bytes = std::fs::read(path).map_err(io(path))?;
    let n = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
        .ok_or_else(|| bad(path, format!("{} bytes, too short for a header", bytes.len())))?;
    let start = 8u64.saturating_add(n);
    if n > MAX_HEADER || start > bytes.len() as u64 {
        return Err(bad(
            path,
            format!("the header claims {n} bytes of a {}-byte file (truncated?)", bytes.len()),
        ));
    }
    let start = start as usize;
    let entries = parse_header(path, &bytes[8..start], (bytes.len() - start) as u64)?;
    let mut bytes = bytes;
    bytes.drain(..start);
    Ok((entries, bytes))
}

fn parse_header(path: &Path, json: &[u8], data_len: u64) -> Result<Entries, UpscaleError> {
    let value: serde_json::Value =
        serde_json::from_slice(json).map_err(|e| bad(path, format!("the header is not JSON: {e}")))?;
    let object = value.as_object().ok_or_else(|| bad(path, "the header is not a JSON object"))?;
    let mut raw = Vec::with_capacity(object.len());
    for (name, v) in object {
        if name == "__metadata__" {
            continue;
        }
        let field =
            |key: &str| v.get(key).ok_or_else(|| bad(path, format!("tensor `{name}` has no `{key}`")));
        let dtype = match field("dtype")?.as_str() {
            Some("F32") => DType::F32,
            Some("F16") => DType::F16,
            Some("BF16") => DType::BF16,
            Some("F64") => DType::F64,
            other => {
                return Err(bad(
                    path,
                    format!(
                    "tensor `{name}` has dtype {other:?}; an upscaler's weights are F32, F16, BF16 or F64"
                ),
                ))
            }
        };
        let dims = |key: &str| -> Result<Vec<usize>, UpscaleError> {
            field(key)?
                .as_array()
                .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect::<Option<Vec<_>>>())
                .ok_or_else(|| bad(path, format!("tensor `{name}`: `{key}` is not a list of integers")))
        };
        let shape = dims("shape")?;
        let offsets = match dims("data_offsets")?[..] {
            [a, b] if a <= b && b as u64 <= data_len => (a, b),
            ref o => {
                return Err(bad(
                    path,
                    format!("tensor `{name}`: data offsets {o:?} outside the {data_len}-byte data"),
                ))
            }
        };
        let want = shape.iter().product::<usize>() * dtype.size_in_bytes();
        if offsets.1 - offsets.0 != want {
            return Err(bad(
                path,
                format!("tensor `{name}`: {} bytes for shape {shape:?} of {dtype:?}", offsets.1 - offsets.0),
            ));
        }
        raw.push((name.clone(), Entry { dtype, shape, offsets, file_name: name.clone() }));
    }
    // spandrel's `remove_common_prefix(state_dict, ["module.", "netG."])`.
    for prefix in ["module.", "netG."] {
        if !raw.is_empty() && raw.iter().all(|(n, _)| n.starts_with(prefix)) {
            for (n, _) in raw.iter_mut() {
                n.drain(..prefix.len());
            }
            break;
        }
    }
    Ok(raw.into_iter().collect())
}

/// Reads tensors out of a loaded file as f32 on the CPU (transforms at load are made there, then one cast).
pub(crate) struct Weights<'a> {
    pub path: PathBuf,
    pub arch: &'static str,
    pub entries: &'a Entries,
    pub data: &'a [u8],
}

impl Weights<'_> {
    pub fn get(&self, name: &str) -> Result<Tensor, UpscaleError> {
        let e = self.entries.get(name).ok_or_else(|| UpscaleError::Tensor {
            path: self.path.clone(),
            arch: self.arch,
            tensor: name.to_string(),
            problem: "is missing".into(),
        })?;
        let bytes = &self.data[e.offsets.0..e.offsets.1];
        Ok(Tensor::from_raw_buffer(bytes, e.dtype, &e.shape, &Device::Cpu)?.to_dtype(DType::F32)?)
    }
}
