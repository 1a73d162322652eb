//! The safetensors header: the `__metadata__` strings and each tensor's dtype and shape, read without touching the
//! tensor data (the catalogue lists hundreds of LoRAs by their metadata), and the refusal of pickle files, which
//! is decided by extension so that nothing is ever unpickled.

use crate::LoraError;
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

/// Headers larger than this are not safetensors headers but garbage or a hostile file; the format's own reader
/// uses the same bound.
const MAX_HEADER: u64 = 100 * 1024 * 1024;

/// One tensor as the header describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TensorInfo {
    pub dtype: String,
    pub shape: Vec<usize>,
}

/// The parsed header of a safetensors file.
#[derive(Debug, Clone, Default)]
pub(crate) struct Header {
    pub metadata: BTreeMap<String, String>,
    pub tensors: BTreeMap<String, TensorInfo>,
}

/// Refuses `.pt`, `.ckpt`, `.pth` and `.bin` files: these are pickles, and reading one means executing it.
pub(crate) fn refuse_pickle(path: &Path) -> Result<(), LoraError> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
    if matches!(ext.as_str(), "pt" | "ckpt" | "pth" | "bin") {
        return Err(LoraError::Pickle { path: path.to_path_buf() });
    }
    Ok(())
}

/// Reads and parses the header only.
pub(crate) fn read_header(path: &Path) -> Result<Header, LoraError> {
    refuse_pickle(path)?;
    let io = |source| LoraError::Io { path: path.to_path_buf(), source };
    let bad = |reason: String| LoraError::Header { path: path.to_path_buf(), reason };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(|_| bad("shorter than the 8-byte header length".into()))?;
    let len = u64::from_le_bytes(len);
    if len > MAX_HEADER || len > file_len.saturating_sub(8) {
        return Err(bad(format!("header length {len} does not fit a {file_len}-byte file")));
    }
    let mut json = vec![0u8; len as usize];
    file.read_exact(&mut json).map_err(io)?;
    parse_header(&json).map_err(bad)
}

fn parse_header(json: &[u8]) -> Result<Header, String> {
    let value: serde_json::Value =
        serde_json::from_slice(json).map_err(|e| format!("header is not JSON: {e}"))?;
    let serde_json::Value::Object(map) = value else {
        return Err("header is not a JSON object".into());
    };
    let mut header = Header::default();
    for (key, entry) in map {
        if key == "__metadata__" {
            let serde_json::Value::Object(meta) = entry else {
                return Err("__metadata__ is not an object".into());
            };
            for (k, v) in meta {
                // The format says strings only, but some writers put numbers or nested JSON here; keeping them as
                // their JSON text loses nothing a reader of kohya's `ss_*` fields would want.
                let v = match v {
                    serde_json::Value::String(s) => s,
                    other => other.to_string(),
                };
                header.metadata.insert(k, v);
            }
            continue;
        }
        let dtype = entry.get("dtype").and_then(|d| d.as_str()).ok_or_else(|| format!("{key}: no dtype"))?;
        let shape = entry
            .get("shape")
            .and_then(|s| s.as_array())
            .ok_or_else(|| format!("{key}: no shape"))?
            .iter()
            .map(|d| d.as_u64().map(|d| d as usize))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| format!("{key}: shape is not a list of sizes"))?;
        header.tensors.insert(key, TensorInfo { dtype: dtype.to_string(), shape });
    }
    Ok(header)
}

/// The `__metadata__` strings of a safetensors file (kohya's `ss_*` training notes, diffusers' adapter config),
/// read from the header alone.
pub fn read_metadata(path: &Path) -> Result<BTreeMap<String, String>, LoraError> {
    Ok(read_header(path)?.metadata)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::write_safetensors;

    #[test]
    fn metadata_and_shapes_come_from_the_header() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.safetensors");
        write_safetensors(
            &path,
            &[("x.alpha", vec![], vec![4.0]), ("x.lora_down.weight", vec![2, 3], vec![0.0; 6])],
            &[("ss_network_dim", "2"), ("ss_base_model_version", "sdxl_base_v1-0")],
        );
        let meta = read_metadata(&path).unwrap();
        assert_eq!(meta.get("ss_network_dim").map(String::as_str), Some("2"));
        assert_eq!(meta.get("ss_base_model_version").map(String::as_str), Some("sdxl_base_v1-0"));
        let header = read_header(&path).unwrap();
        assert_eq!(header.tensors["x.lora_down.weight"].shape, vec![2, 3]);
        assert_eq!(header.tensors["x.alpha"].shape, Vec::<usize>::new());
    }

    #[test]
    fn pickles_are_refused_by_extension_without_opening() {
        for ext in ["pt", "ckpt", "PTH", "bin"] {
            // The file does not exist: the refusal must come before any attempt to open it.
            let err = read_metadata(Path::new(&format!("/nonexistent/lora.{ext}"))).unwrap_err();
            assert!(matches!(err, LoraError::Pickle { .. }), "{ext}: {err}");
            assert!(err.to_string().contains("safetensors"), "{err}");
        }
    }

    #[test]
    fn garbage_is_a_header_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("junk.safetensors");
        std::fs::write(&path, b"\xff\xff\xff\xff\xff\xff\xff\x7fhello").unwrap();
        assert!(matches!(read_metadata(&path), Err(LoraError::Header { .. })));
        std::fs::write(&path, b"\x05\0\0\0\0\0\0\0[1,2]").unwrap();
        assert!(matches!(read_metadata(&path), Err(LoraError::Header { .. })));
    }
}
