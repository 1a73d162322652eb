//! A diffusers `SD3Transformer2DModel` file written back in Stability's layout (`model.diffusion_model.*`): the
//! exact inverse of the MMDiT conversion in `sd3.rs` (diffusers' `convert_sd3_transformer_checkpoint_to_diffusers`):
//! q/k/v fused again into `qkv` (rows in q, k, v order), the adaLN halves of `norm_out` and of the last block's
//! context stream swapped back, every other tensor renamed. Bytes and dtypes are kept as stored; the file is
//! streamed from the mapping, so memory stays flat for any model size. stable-diffusion.cpp reads SD3 only in this
//! layout (its own diffusers renaming neither fuses q/k/v nor swaps the halves).

use crate::error::{CheckpointError, Result};
use crate::file::CheckpointFile;
use crate::sd3::MMDIT;
use safetensors::tensor::Dtype;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

/// How one output tensor is made from the input's.
enum Make {
    /// One tensor, renamed.
    Copy(String),
    /// One tensor with its two halves (along the first dimension) swapped.
    Swap(String),
    /// Tensors concatenated along the first dimension.
    Fuse(Vec<String>),
}

/// Writes the diffusers MMDiT file `src` as SAI's MMDiT tensors to `out` (replacing it); returns the bytes of
/// tensor data written.
pub fn write_sd3_transformer_as_sai(src: &Path, out: &Path) -> Result<u64> {
    let file = CheckpointFile::open(src)?;
    let plan = plan(&file)?;
    let io = |source| CheckpointError::Io { path: out.to_path_buf(), source };

    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    let mut sized = Vec::with_capacity(plan.len());
    for (name, make) in &plan {
        let (dtype, shape, len) = describe(&file, make)?;
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype_name(dtype), "shape": shape, "data_offsets": [offset, offset + len]}),
        );
        offset += len;
        sized.push((name, make));
    }
    let mut header = serde_json::to_vec(&header).map_err(|e| CheckpointError::Tensor {
        path: out.to_path_buf(),
        tensor: "(header)".into(),
        reason: e.to_string(),
    })?;
    header.resize(header.len().div_ceil(8) * 8, b' ');

    let tmp = out.with_extension("partial");
    let mut w = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(&tmp).map_err(io)?);
    w.write_all(&(header.len() as u64).to_le_bytes()).map_err(io)?;
    w.write_all(&header).map_err(io)?;
    for (_, make) in sized {
        match make {
            Make::Copy(src) => w.write_all(file.bytes(src)?).map_err(io)?,
            Make::Swap(src) => {
                let bytes = file.bytes(src)?;
                let (a, b) = bytes.split_at(bytes.len() / 2);
                w.write_all(b).map_err(io)?;
                w.write_all(a).map_err(io)?;
            }
            Make::Fuse(parts) => {
                for p in parts {
                    w.write_all(file.bytes(p)?).map_err(io)?;
                }
            }
        }
    }
    w.into_inner().map_err(|e| io(e.into_error()))?.sync_all().map_err(io)?;
    std::fs::rename(&tmp, out).map_err(io)?;
    Ok(offset as u64)
}

fn dtype_name(dtype: Dtype) -> String {
    // safetensors' own spelling (`F16`, `BF16`, `F32`, …).
    format!("{dtype:?}")
}

/// The output tensor's dtype, shape and byte length; fused parts must agree in dtype and trailing shape, a
/// swapped tensor must split in two.
fn describe(file: &CheckpointFile, make: &Make) -> Result<(Dtype, Vec<usize>, usize)> {
    let shape_error = |tensor: &str, shape: &[usize], expected: &str| CheckpointError::Shape {
        path: file.path.clone(),
        tensor: tensor.to_string(),
        shape: shape.to_vec(),
        expected: expected.to_string(),
    };
    match make {
        Make::Copy(src) | Make::Swap(src) => {
            let meta = file.meta(src)?;
            let len = file.bytes(src)?.len();
            if matches!(make, Make::Swap(_))
                && (meta.shape.first().is_none_or(|d| d % 2 != 0) || len % 2 != 0)
            {
                return Err(shape_error(src, &meta.shape, "an even first dimension (two halves)"));
            }
            Ok((meta.dtype, meta.shape.clone(), len))
        }
        Make::Fuse(parts) => {
            let first = file.meta(&parts[0])?;
            let mut shape = first.shape.clone();
            let mut len = 0;
            for (i, p) in parts.iter().enumerate() {
                let meta = file.meta(p)?;
                if meta.dtype != first.dtype
                    || meta.shape.get(1..) != first.shape.get(1..)
                    || meta.shape.is_empty()
                {
                    return Err(shape_error(
                        p,
                        &meta.shape,
                        &format!("the dtype and trailing shape of `{}`", parts[0]),
                    ));
                }
                if i > 0 {
                    shape[0] += meta.shape[0];
                }
                len += file.bytes(p)?.len();
            }
            Ok((first.dtype, shape, len))
        }
    }
}

/// Every SAI output tensor (sorted) and how it is made; a diffusers tensor the layout does not explain is an
/// error naming it, and every input is used exactly once.
fn plan(file: &CheckpointFile) -> Result<BTreeMap<String, Make>> {
    let names: Vec<&str> = file.tensors.keys().map(String::as_str).collect();
    let last_block = names
        .iter()
        .filter_map(|n| n.strip_prefix("transformer_blocks.")?.split('.').next()?.parse::<usize>().ok())
        .max();
    let mut plan = BTreeMap::new();
    let mut used = 0usize;
    for &name in &names {
        let unexpected = || CheckpointError::UnexpectedTensor {
            path: file.path.clone(),
            tensor: name.to_string(),
            component: "diffusers SD3 transformer",
        };
        let parts: Vec<&str> = name.split('.').collect();
        let (target, make): (String, Make) = match parts.as_slice() {
            ["pos_embed", "pos_embed"] => ("pos_embed".into(), Make::Copy(name.into())),
            ["pos_embed", "proj", p] => (format!("x_embedder.proj.{p}"), Make::Copy(name.into())),
            ["context_embedder", p] => (format!("context_embedder.{p}"), Make::Copy(name.into())),
            ["time_text_embed", which, linear, p] => {
                let embedder = match *which {
                    "timestep_embedder" => "t_embedder",
                    "text_embedder" => "y_embedder",
                    _ => return Err(unexpected()),
                };
                let layer = match *linear {
                    "linear_1" => 0,
                    "linear_2" => 2,
                    _ => return Err(unexpected()),
                };
                (format!("{embedder}.mlp.{layer}.{p}"), Make::Copy(name.into()))
            }
            ["proj_out", p] => (format!("final_layer.linear.{p}"), Make::Copy(name.into())),
            ["norm_out", "linear", p] => {
                (format!("final_layer.adaLN_modulation.1.{p}"), Make::Swap(name.into()))
            }
            ["transformer_blocks", idx, rest @ ..] => {
                let i: usize = idx.parse().map_err(|_| unexpected())?;
                let b = format!("transformer_blocks.{i}");
                let j = format!("joint_blocks.{i}");
                match rest {
                    ["norm1", "linear", p] => {
                        (format!("{j}.x_block.adaLN_modulation.1.{p}"), Make::Copy(name.into()))
                    }
                    ["norm1_context", "linear", p] => {
                        let target = format!("{j}.context_block.adaLN_modulation.1.{p}");
                        // The last block's context half is diffusers' AdaLayerNormContinuous: (scale, shift).
                        if Some(i) == last_block {
                            (target, Make::Swap(name.into()))
                        } else {
                            (target, Make::Copy(name.into()))
                        }
                    }
                    // q/k/v: planned once, at q, from all three.
                    [attn @ ("attn" | "attn2"), "to_q", p] => {
                        let stream = if *attn == "attn" { "x_block.attn" } else { "x_block.attn2" };
                        let fused = ["q", "k", "v"].map(|c| format!("{b}.{attn}.to_{c}.{p}")).to_vec();
                        (format!("{j}.{stream}.qkv.{p}"), Make::Fuse(fused))
                    }
                    ["attn", "add_q_proj", p] => {
                        let fused = ["q", "k", "v"].map(|c| format!("{b}.attn.add_{c}_proj.{p}")).to_vec();
                        (format!("{j}.context_block.attn.qkv.{p}"), Make::Fuse(fused))
                    }
                    ["attn" | "attn2", "to_k" | "to_v", _] | ["attn", "add_k_proj" | "add_v_proj", _] => {
                        continue;
                    }
                    [attn @ ("attn" | "attn2"), norm @ ("norm_q" | "norm_k"), p] => {
                        let stream = if *attn == "attn" { "x_block.attn" } else { "x_block.attn2" };
                        (format!("{j}.{stream}.ln_{}.{p}", &norm[5..]), Make::Copy(name.into()))
                    }
                    ["attn", norm @ ("norm_added_q" | "norm_added_k"), p] => {
                        (format!("{j}.context_block.attn.ln_{}.{p}", &norm[11..]), Make::Copy(name.into()))
                    }
                    [attn @ ("attn" | "attn2"), "to_out", "0", p] => {
                        let stream = if *attn == "attn" { "x_block.attn" } else { "x_block.attn2" };
                        (format!("{j}.{stream}.proj.{p}"), Make::Copy(name.into()))
                    }
                    ["attn", "to_add_out", p] => {
                        (format!("{j}.context_block.attn.proj.{p}"), Make::Copy(name.into()))
                    }
                    [ff @ ("ff" | "ff_context"), "net", layer, rest @ ..] => {
                        let stream = if *ff == "ff" { "x_block" } else { "context_block" };
                        let fc = match (*layer, rest) {
                            ("0", ["proj", p]) => format!("fc1.{p}"),
                            ("2", [p]) => format!("fc2.{p}"),
                            _ => return Err(unexpected()),
                        };
                        (format!("{j}.{stream}.mlp.{fc}"), Make::Copy(name.into()))
                    }
                    _ => return Err(unexpected()),
                }
            }
            _ => return Err(unexpected()),
        };
        used += match &make {
            Make::Fuse(parts) => parts.len(),
            _ => 1,
        };
        if plan.insert(format!("{MMDIT}{target}"), make).is_some() {
            return Err(unexpected());
        }
    }
    if used != names.len() {
        return Err(CheckpointError::UnknownLayout {
            path: file.path.clone(),
            reason: format!(
                "{} of its {} tensors belong to no SAI tensor (a q/k/v without its q)",
                names.len() - used,
                names.len()
            ),
        });
    }
    Ok(plan)
}
