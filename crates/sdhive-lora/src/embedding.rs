//! Textual-inversion embeddings in the layouts A1111 accepts from safetensors files (`create_embedding_from_data`):
//! A1111's own `emb_params`, `string_to_param.*` converted from its .pt files, diffusers' one-tensor
//! `learned_embeds` (`{token: vector}`), and SDXL's `clip_l` + `clip_g` pair. Pickled .pt/.bin embeddings are
//! refused rather than unpickled.

use crate::header::{read_header, TensorInfo};
use crate::LoraError;
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

/// A textual-inversion embedding: `n_vectors` token vectors for each text encoder it was trained for.
#[derive(Debug, Clone)]
pub struct Embedding {
    /// The file stem: the word a prompt uses to call it, as in A1111.
    pub name: String,
    /// One `(n_vectors, width)` f32 CPU tensor per text encoder: `[0]` = `clip_l` (or the only one), `[1]` =
    /// `clip_g`.
    pub vectors: Vec<Tensor>,
    pub n_vectors: usize,
}

/// What an embedding file holds, from its header alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbeddingInfo {
    pub n_vectors: usize,
    /// Vector width per text encoder, in [`Embedding::vectors`] order (768 for SD1/CLIP-L, 1024 for SD2, 1280 for
    /// SDXL's `clip_g`).
    pub dims: Vec<usize>,
}

/// Which tensors of the file hold the vectors.
enum Layout {
    Single(String),
    Pair { l: String, g: String },
}

fn embedding_error(path: &Path, reason: String) -> LoraError {
    LoraError::Embedding { path: path.to_path_buf(), reason }
}

fn layout(path: &Path, tensors: &BTreeMap<String, TensorInfo>) -> Result<Layout, LoraError> {
    let stp: Vec<&String> = tensors.keys().filter(|k| k.starts_with("string_to_param.")).collect();
    match stp.as_slice() {
        [one] => return Ok(Layout::Single((*one).clone())),
        [] => {}
        many => {
            let keys = many.iter().map(|k| k.as_str()).collect::<Vec<_>>().join(", ");
            return Err(embedding_error(
                path,
                format!("holds several terms ({keys}); A1111 takes one per file"),
            ));
        }
    }
    if tensors.contains_key("clip_l") && tensors.contains_key("clip_g") {
        return Ok(Layout::Pair { l: "clip_l".into(), g: "clip_g".into() });
    }
    if tensors.contains_key("emb_params") {
        return Ok(Layout::Single("emb_params".into()));
    }
    let mut keys = tensors.keys();
    match (keys.next(), keys.next()) {
        (Some(only), None) => Ok(Layout::Single(only.clone())),
        (None, _) => Err(embedding_error(path, "holds no tensors".into())),
        (Some(_), Some(_)) => {
            let keys: Vec<&str> = tensors.keys().take(8).map(String::as_str).collect();
            Err(embedding_error(
                path,
                format!(
                    "tensors {} are none of emb_params, string_to_param.*, clip_l+clip_g or a single vector set",
                    keys.join(", ")
                ),
            ))
        }
    }
}

/// `(rows, width)` of an embedding tensor: a 1-D tensor is one vector; leading dimensions count vectors.
fn rows_width(path: &Path, key: &str, shape: &[usize]) -> Result<(usize, usize), LoraError> {
    match shape.split_last() {
        Some((&width, lead)) if width > 0 => {
            let rows = lead.iter().product::<usize>();
            if rows == 0 {
                return Err(embedding_error(path, format!("{key} has shape {shape:?}: no vectors")));
            }
            Ok((rows, width))
        }
        _ => Err(embedding_error(path, format!("{key} has shape {shape:?}; vectors are needed"))),
    }
}

fn keys_of(layout: &Layout) -> Vec<&str> {
    match layout {
        Layout::Single(k) => vec![k.as_str()],
        Layout::Pair { l, g } => vec![l.as_str(), g.as_str()],
    }
}

/// `(n_vectors, [(key, width)])`, checking that every encoder's tensor has the same number of vectors.
fn plan(
    path: &Path,
    tensors: &BTreeMap<String, TensorInfo>,
) -> Result<(usize, Vec<(String, usize)>), LoraError> {
    let layout = layout(path, tensors)?;
    let mut n = None;
    let mut parts = Vec::new();
    for key in keys_of(&layout) {
        let (rows, width) = rows_width(path, key, &tensors[key].shape)?;
        if n.is_some_and(|n| n != rows) {
            return Err(embedding_error(
                path,
                "clip_l and clip_g hold different numbers of vectors".to_string(),
            ));
        }
        n = Some(rows);
        parts.push((key.to_string(), width));
    }
    Ok((n.unwrap_or(0), parts))
}

/// Vector count and widths of an embedding file, read from its header only.
pub fn read_embedding_header(path: &Path) -> Result<EmbeddingInfo, LoraError> {
    let header = read_header(path)?;
    let (n_vectors, parts) = plan(path, &header.tensors)?;
    Ok(EmbeddingInfo { n_vectors, dims: parts.into_iter().map(|(_, w)| w).collect() })
}

impl Embedding {
    /// Reads a `.safetensors` embedding; pickle files are refused by extension.
    pub fn read(path: &Path) -> Result<Embedding, LoraError> {
        let header = read_header(path)?;
        let (n_vectors, parts) = plan(path, &header.tensors)?;
        // SAFETY: embedding files are read-only inputs; we rely on nobody truncating them while mapped. The vectors
        // are copied out before the map is dropped.
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(path) }
            .map_err(|e| LoraError::Header { path: path.to_path_buf(), reason: e.to_string() })?;
        let mut vectors = Vec::with_capacity(parts.len());
        for (key, width) in parts {
            let t = st
                .load(&key, &Device::Cpu)
                .and_then(|t| t.to_dtype(DType::F32))
                .and_then(|t| t.reshape((n_vectors, width)))
                .map_err(|source| LoraError::Tensor {
                    path: path.to_path_buf(),
                    key,
                    source: Box::new(source),
                })?;
            vectors.push(t);
        }
        let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        Ok(Embedding { name, vectors, n_vectors })
    }

    /// The vectors for text encoder `encoder`, whose token embeddings are `width` wide; `None` when the embedding
    /// has no vectors of that width (an SD1 embedding on SD2, or on SDXL's second encoder): A1111 skips such an
    /// embedding, so a caller should treat `None` on any encoder as "does not fit this model".
    pub fn for_encoder(&self, encoder: usize, width: usize) -> Option<&Tensor> {
        let wide = |t: &&Tensor| t.dims().last() == Some(&width);
        self.vectors.get(encoder).filter(wide).or_else(|| self.vectors.iter().find(wide))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::write_safetensors;

    fn range(n: usize, start: f32) -> Vec<f32> {
        (0..n).map(|i| start + i as f32).collect()
    }

    #[test]
    fn a1111_emb_params() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad-hands.safetensors");
        write_safetensors(&path, &[("emb_params", vec![3, 768], range(3 * 768, 0.0))], &[]);
        let e = Embedding::read(&path).unwrap();
        assert_eq!((e.name.as_str(), e.n_vectors, e.vectors.len()), ("bad-hands", 3, 1));
        assert_eq!(e.vectors[0].dims(), &[3, 768]);
        let v = e.vectors[0].to_vec2::<f32>().unwrap();
        assert_eq!((v[0][0], v[1][0], v[2][767]), (0.0, 768.0, (3 * 768 - 1) as f32));
        assert!(e.for_encoder(0, 768).is_some());
        assert!(e.for_encoder(0, 1024).is_none());
        assert_eq!(read_embedding_header(&path).unwrap(), EmbeddingInfo { n_vectors: 3, dims: vec![768] });
    }

    #[test]
    fn diffusers_single_1d_vector() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cat-toy.safetensors");
        write_safetensors(&path, &[("<cat-toy>", vec![768], range(768, 1.0))], &[]);
        let e = Embedding::read(&path).unwrap();
        assert_eq!(e.n_vectors, 1);
        assert_eq!(e.vectors[0].dims(), &[1, 768]);
        assert_eq!(e.vectors[0].to_vec2::<f32>().unwrap()[0][5], 6.0);
        assert_eq!(read_embedding_header(&path).unwrap(), EmbeddingInfo { n_vectors: 1, dims: vec![768] });
    }

    #[test]
    fn string_to_param() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("style.safetensors");
        write_safetensors(
            &path,
            &[
                ("string_to_param.*", vec![2, 1024], range(2048, 0.0)),
                ("string_to_token.*", vec![1], vec![265.0]),
            ],
            &[],
        );
        let e = Embedding::read(&path).unwrap();
        assert_eq!((e.n_vectors, e.vectors[0].dims()), (2, &[2usize, 1024][..]));
    }

    #[test]
    fn sdxl_clip_l_and_clip_g() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("xl.safetensors");
        write_safetensors(
            &path,
            &[
                ("clip_g", vec![2, 1280], range(2 * 1280, 100.0)),
                ("clip_l", vec![2, 768], range(2 * 768, 0.0)),
            ],
            &[],
        );
        let e = Embedding::read(&path).unwrap();
        assert_eq!(e.n_vectors, 2);
        assert_eq!(e.vectors[0].dims(), &[2, 768]);
        assert_eq!(e.vectors[1].dims(), &[2, 1280]);
        assert_eq!(e.for_encoder(0, 768).unwrap().dims(), &[2, 768]);
        assert_eq!(e.for_encoder(1, 1280).unwrap().to_vec2::<f32>().unwrap()[0][0], 100.0);
        assert_eq!(
            read_embedding_header(&path).unwrap(),
            EmbeddingInfo { n_vectors: 2, dims: vec![768, 1280] }
        );

        write_safetensors(
            &path,
            &[("clip_g", vec![2, 1280], range(2560, 0.0)), ("clip_l", vec![3, 768], range(2304, 0.0))],
            &[],
        );
        assert!(matches!(Embedding::read(&path), Err(LoraError::Embedding { .. })));
    }

    #[test]
    fn unknown_layouts_and_pickles_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("two.safetensors");
        write_safetensors(
            &path,
            &[("a", vec![1, 768], vec![0.0; 768]), ("b", vec![1, 768], vec![0.0; 768])],
            &[],
        );
        let err = Embedding::read(&path).unwrap_err();
        assert!(
            matches!(err, LoraError::Embedding { .. }) && err.to_string().contains("two.safetensors"),
            "{err}"
        );
        assert!(matches!(Embedding::read(Path::new("/x/emb.pt")), Err(LoraError::Pickle { .. })));
        assert!(matches!(read_embedding_header(Path::new("/x/emb.bin")), Err(LoraError::Pickle { .. })));
    }
}
