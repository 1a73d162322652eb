//! The text encoders. CLIP ViT-L keeps its transformers names inside original checkpoints and
//! only loses the checkpoint prefix; OpenCLIP towers (SD2's ViT-H, SDXL's ViT-bigG) are renamed
//! to transformers' `CLIPTextModel` layout, their fused `in_proj` split into q/k/v and the
//! `text_projection` matrix transposed into a Linear weight.

use crate::error::{CheckpointError, Result};
use crate::file::CheckpointFile;
use crate::layout::{Tower, TowerKind};
use crate::plan::{Op, Plan, Shapes};
use std::collections::BTreeSet;

/// OpenCLIP resblock leaf → transformers CLIPEncoderLayer leaf (in_proj is handled apart).
const OPENCLIP_LAYER_LEAVES: &[(&str, &str)] = &[
    ("ln_1", "layer_norm1"),
    ("ln_2", "layer_norm2"),
    ("attn.out_proj", "self_attn.out_proj"),
    ("mlp.c_fc", "mlp.fc1"),
    ("mlp.c_proj", "mlp.fc2"),
];

/// OpenCLIP top-level tensors → transformers names.
const OPENCLIP_TOP: &[(&str, &str)] = &[
    ("token_embedding.weight", "text_model.embeddings.token_embedding.weight"),
    ("positional_embedding", "text_model.embeddings.position_embedding.weight"),
    ("ln_final.weight", "text_model.final_layer_norm.weight"),
    ("ln_final.bias", "text_model.final_layer_norm.bias"),
];

/// transformers CLIP text-model heads that carry weights.
const HF_HEADS: &[&str] = &["embeddings", "encoder", "final_layer_norm"];

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ClipStructure {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub max_position_embeddings: usize,
    /// Encoder layers present in the checkpoint.
    pub layers: usize,
    /// Output width of `text_projection`, when the tower has one.
    pub projection_dim: Option<usize>,
}

pub(crate) fn plan(
    file: &CheckpointFile,
    tower: Tower,
    component: &'static str,
    skipped: &mut Vec<String>,
) -> Result<(Plan, ClipStructure)> {
    let mut plan = Plan::default();
    let unexpected = |key: &str| CheckpointError::UnexpectedTensor {
        path: file.path.clone(),
        tensor: key.to_string(),
        component,
    };
    let p = tower.prefix;
    match tower.kind {
        TowerKind::HfClip => {
            for key in file.names_with_prefix(p) {
                let rest = &key[p.len()..];
                // Very old exports lack transformers' `text_model.` wrapper.
                let inner = rest.strip_prefix("text_model.").unwrap_or(rest);
                let head = inner.split('.').next().unwrap_or_default();
                if inner == "embeddings.position_ids" || rest.starts_with("text_projection") {
                    // position_ids is a derived buffer; CLIPTextModel has no projection.
                    skipped.push(key.to_string());
                } else if HF_HEADS.contains(&head) {
                    plan.add(file, format!("text_model.{inner}"), key, Op::Copy)?;
                } else {
                    return Err(unexpected(key));
                }
            }
        }
        TowerKind::OpenClip { with_projection } => {
            for key in file.names_with_prefix(p) {
                let rest = &key[p.len()..];
                if let Some((_, new)) = OPENCLIP_TOP.iter().find(|(old, _)| *old == rest) {
                    plan.add(file, (*new).to_string(), key, Op::Copy)?;
                } else if rest == "text_projection" {
                    if with_projection {
                        plan.add(file, "text_projection.weight".into(), key, Op::Transpose)?;
                    } else {
                        // SD2 conditions on hidden states; its text encoder is a plain CLIPTextModel.
                        skipped.push(key.to_string());
                    }
                } else if matches!(rest, "logit_scale" | "attn_mask") || rest.starts_with("visual.") {
                    skipped.push(key.to_string());
                } else if let Some(layer) = rest.strip_prefix("transformer.resblocks.") {
                    let (idx, leaf) = layer.split_once('.').ok_or_else(|| unexpected(key))?;
                    let idx: usize = idx.parse().map_err(|_| unexpected(key))?;
                    let base = format!("text_model.encoder.layers.{idx}.");
                    if let Some(kind) = leaf.strip_prefix("attn.in_proj_") {
                        for (index, q) in ["q_proj", "k_proj", "v_proj"].iter().enumerate() {
                            let op = Op::Chunk { index, parts: 3 };
                            plan.add(file, format!("{base}self_attn.{q}.{kind}"), key, op)?;
                        }
                    } else {
                        let (old, new) = OPENCLIP_LAYER_LEAVES
                            .iter()
                            .find(|(old, _)| leaf.strip_prefix(old).is_some_and(|r| r.starts_with('.')))
                            .ok_or_else(|| unexpected(key))?;
                        plan.add(file, format!("{base}{new}{}", &leaf[old.len()..]), key, Op::Copy)?;
                    }
                } else {
                    return Err(unexpected(key));
                }
            }
        }
    }
    let structure = check(file, tower, &plan)?;
    Ok((plan, structure))
}

/// Verifies every encoder tensor's shape against the widths the embeddings declare. Checked
/// on checkpoint names, so errors point at the tensor as the user's file spells it.
fn check(file: &CheckpointFile, tower: Tower, plan: &Plan) -> Result<ClipStructure> {
    let sh = Shapes { file };
    let src = |target: &str| plan.entries.get(target).map(|s| s.key.clone());
    let need = |target: &str, what: &str| {
        src(target).ok_or_else(|| CheckpointError::MissingTensor {
            path: file.path.clone(),
            tensor: match tower.kind {
                TowerKind::HfClip => format!("{}{target}", tower.prefix),
                TowerKind::OpenClip { .. } => format!("{}{}", tower.prefix, openclip_name(target)),
            },
            context: what.to_string(),
        })
    };
    let tok_key = need("text_model.embeddings.token_embedding.weight", "token embedding")?;
    let tok = sh.rank(&tok_key, 2, "token embedding [vocab, hidden]")?;
    let (vocab_size, hidden) = (tok[0], tok[1]);
    let pos_key = need("text_model.embeddings.position_embedding.weight", "position embedding")?;
    let max_positions =
        sh.expect(&pos_key, &[None, Some(hidden)], "position embedding [positions, hidden]")?[0];
    sh.expect(
        &need("text_model.final_layer_norm.weight", "final layer norm")?,
        &[Some(hidden)],
        "final layer norm",
    )?;

    let layer_ids: BTreeSet<usize> = plan
        .entries
        .keys()
        .filter_map(|t| t.strip_prefix("text_model.encoder.layers.")?.split('.').next()?.parse().ok())
        .collect();
    if layer_ids.is_empty() || layer_ids.iter().enumerate().any(|(i, l)| i != *l) {
        return Err(CheckpointError::MissingTensor {
            path: file.path.clone(),
            tensor: format!("{}…layers.0", tower.prefix),
            context: "encoder layers are numbered from 0 without gaps".into(),
        });
    }
    let mut intermediate = None;
    for i in &layer_ids {
        let t = |leaf: &str| format!("text_model.encoder.layers.{i}.{leaf}");
        match tower.kind {
            TowerKind::OpenClip { .. } => {
                let fused = need(&t("self_attn.q_proj.weight"), "fused attention projection")?;
                sh.expect(
                    &fused,
                    &[Some(3 * hidden), Some(hidden)],
                    "fused q/k/v projection [3·hidden, hidden]",
                )?;
                let fused_b = need(&t("self_attn.q_proj.bias"), "fused attention projection bias")?;
                sh.expect(&fused_b, &[Some(3 * hidden)], "fused q/k/v bias [3·hidden]")?;
            }
            TowerKind::HfClip => {
                for q in ["q_proj", "k_proj", "v_proj"] {
                    let key = need(&t(&format!("self_attn.{q}.weight")), "attention projection")?;
                    sh.expect(&key, &[Some(hidden), Some(hidden)], "attention projection")?;
                }
            }
        }
        let out = need(&t("self_attn.out_proj.weight"), "attention output projection")?;
        sh.expect(&out, &[Some(hidden), Some(hidden)], "attention output projection")?;
        for ln in ["layer_norm1", "layer_norm2"] {
            sh.expect(&need(&t(&format!("{ln}.weight")), "layer norm")?, &[Some(hidden)], "layer norm")?;
        }
        let fc1 = need(&t("mlp.fc1.weight"), "MLP input")?;
        let inter = sh.expect(&fc1, &[intermediate, Some(hidden)], "MLP input [intermediate, hidden]")?[0];
        intermediate = Some(inter);
        sh.expect(&need(&t("mlp.fc2.weight"), "MLP output")?, &[Some(hidden), Some(inter)], "MLP output")?;
    }
    let projection_dim = match src("text_projection.weight") {
        Some(key) => Some(sh.expect(&key, &[Some(hidden), None], "text_projection [hidden, projection]")?[1]),
        None if matches!(tower.kind, TowerKind::OpenClip { with_projection: true }) => {
            return Err(CheckpointError::MissingTensor {
                path: file.path.clone(),
                tensor: format!("{}text_projection", tower.prefix),
                context: "SDXL's pooled text embedding".into(),
            })
        }
        None => None,
    };
    Ok(ClipStructure {
        vocab_size,
        hidden_size: hidden,
        intermediate_size: intermediate.unwrap_or(4 * hidden),
        max_position_embeddings: max_positions,
        layers: layer_ids.len(),
        projection_dim,
    })
}

/// The OpenCLIP spelling of a transformers target, for error messages only.
fn openclip_name(target: &str) -> String {
    OPENCLIP_TOP
        .iter()
        .find(|(_, new)| *new == target)
        .map(|(old, _)| (*old).to_string())
        .unwrap_or_else(|| target.to_string())
}

/// Keeps encoder layers `0..keep` and returns the checkpoint keys of the dropped ones.
pub(crate) fn keep_layers(plan: &mut Plan, keep: usize) -> Vec<String> {
    plan.retain(|target| {
        target
            .strip_prefix("text_model.encoder.layers.")
            .and_then(|r| r.split('.').next())
            .and_then(|i| i.parse::<usize>().ok())
            .is_none_or(|i| i < keep)
    })
}
