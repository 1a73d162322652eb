//! Sniffing safetensors files without loading them: the header (an 8-byte little-endian length and a JSON table of
//! tensors, capped so a corrupt length cannot allocate gigabytes) and what its tensor names say the file is.
//! Nothing here reads tensor data (GGUF headers: `gguf.rs`).

use std::fs::File;
use std::io::Read;
use std::path::Path;

/// A real header is a few hundred KB at most; the cap stops a corrupt length from allocating gigabytes.
pub(crate) const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;

/// What a `.safetensors` file under a models dir holds, judged by its tensor names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Checkpoint,
    Vae,
    /// LoRA, embedding, text encoder, ControlNet...: not ours to list.
    Other,
}

/// A safetensors header: every tensor's name and shape, in the file's order, and the `__metadata__` strings.
#[derive(Debug, Clone, Default)]
pub(crate) struct Header {
    pub tensors: Vec<(String, Vec<u64>)>,
    pub metadata: serde_json::Map<String, serde_json::Value>,
}

/// The tensor names of a safetensors file, or why its header is unusable. Also checks that every tensor lies
/// inside the file, so a truncated download is reported at scan time instead of at load time.
pub(crate) fn tensor_names(path: &Path) -> Result<Vec<String>, String> {
    Ok(read_header(path)?.tensors.into_iter().map(|(name, _)| name).collect())
}

/// The whole header of a safetensors file, checked as `tensor_names` says.
pub(crate) fn read_header(path: &Path) -> Result<Header, String> {
    let mut file = File::open(path).map_err(|e| format!("cannot open it: {e}"))?;
    let file_len = file.metadata().map_err(|e| format!("cannot stat it: {e}"))?.len();
    if file_len < 8 {
        return Err(format!("the file is only {file_len} bytes long"));
    }
    let mut len_bytes = [0u8; 8];
    file.read_exact(&mut len_bytes).map_err(|e| format!("cannot read the header length: {e}"))?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_BYTES {
        return Err(format!("header length {header_len} exceeds the 100 MB cap (not a safetensors file?)"));
    }
    if header_len > file_len - 8 {
        return Err(format!("header length {header_len} does not fit a {file_len}-byte file (truncated?)"));
    }
    // Bounded by MAX_HEADER_BYTES above, so the cast cannot truncate.
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(|e| format!("cannot read the header: {e}"))?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| format!("the header is not a JSON object: {e}"))?;
    let data_len = file_len - 8 - header_len;
    let mut out = Header { tensors: Vec::with_capacity(header.len()), metadata: serde_json::Map::new() };
    for (name, info) in header {
        if name == "__metadata__" {
            if let serde_json::Value::Object(m) = info {
                out.metadata = m;
            }
            continue;
        }
        let (start, end) = info
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .and_then(|o| Some((o.first()?.as_u64()?, o.get(1)?.as_u64()?)))
            .ok_or_else(|| format!("tensor `{name}` has no valid data_offsets"))?;
        if start > end || end > data_len {
            return Err(format!(
                "tensor `{name}` spans bytes {start}..{end} but the data section is {data_len} bytes (truncated?)"
            ));
        }
        let shape = info
            .get("shape")
            .and_then(|s| s.as_array())
            .map(|dims| dims.iter().filter_map(|d| d.as_u64()).collect())
            .unwrap_or_default();
        out.tensors.push((name, shape));
    }
    Ok(out)
}

/// Classifies by tensor names; `file_name` (lower-cased) breaks the tie for VAEs whose keys are unusual.
pub(crate) fn classify(names: &[String], file_name: &str) -> Kind {
    if names.iter().any(|n| n.starts_with("model.diffusion_model.")) {
        return Kind::Checkpoint;
    }
    // diffusers' `AutoencoderTiny` (TAESD, a preview decoder) numbers its layers; an `AutoencoderKL` does not.
    if names.iter().any(|n| n.starts_with("decoder.layers.") || n.starts_with("encoder.layers.")) {
        return Kind::Other;
    }
    let vae_keys = names.iter().any(|n| {
        n.starts_with("encoder.") || n.starts_with("decoder.") || n.starts_with("first_stage_model.")
    });
    if vae_keys || file_name.ends_with(".vae.safetensors") {
        Kind::Vae
    } else {
        Kind::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn classifies_by_tensor_names() {
        let ckpt = names(&["first_stage_model.decoder.x", "model.diffusion_model.input_blocks.0.0.weight"]);
        assert_eq!(classify(&ckpt, "a.safetensors"), Kind::Checkpoint);
        assert_eq!(classify(&names(&["decoder.conv_in.weight"]), "v.safetensors"), Kind::Vae);
        assert_eq!(classify(&names(&["first_stage_model.encoder.x"]), "v.safetensors"), Kind::Vae);
        assert_eq!(classify(&names(&["odd.weight"]), "a.vae.safetensors"), Kind::Vae);
        assert_eq!(classify(&names(&["lora_unet_down.lora_down.weight"]), "l.safetensors"), Kind::Other);
        assert_eq!(classify(&[], "empty.safetensors"), Kind::Other);
        let taesd = names(&["decoder.layers.0.weight", "encoder.layers.0.weight"]);
        assert_eq!(classify(&taesd, "diffusion_pytorch_model.safetensors"), Kind::Other);
        assert_eq!(
            classify(&names(&["1.weight", "3.conv.0.weight"]), "taesd_decoder.safetensors"),
            Kind::Other
        );
    }
}
