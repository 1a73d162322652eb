//! The VAE (`first_stage_model.*`): CompVis encoder/decoder names to diffusers' AutoencoderKL
//! names, including the decoder's reversed level numbering and the mid-block attention whose
//! 1x1 convolutions become linears, and the autoencoder's structure read from shapes.

use crate::error::{CheckpointError, Result};
use crate::file::CheckpointFile;
use crate::plan::{Op, Plan, Shapes};
use std::collections::BTreeSet;

const COMPONENT: &str = "VAE";

const RESNET_LEAVES: &[(&str, &str)] = &[
    ("norm1", "norm1"),
    ("conv1", "conv1"),
    ("norm2", "norm2"),
    ("conv2", "conv2"),
    ("nin_shortcut", "conv_shortcut"),
];

/// Mid-block attention leaves; the projections are 1x1 convs in LDM and linears in diffusers.
const ATTENTION_LEAVES: &[(&str, &str, bool)] = &[
    ("norm", "group_norm", false),
    ("q", "to_q", true),
    ("k", "to_k", true),
    ("v", "to_v", true),
    ("proj_out", "to_out.0", true),
];

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct VaeStructure {
    pub in_channels: usize,
    pub out_channels: usize,
    pub latent_channels: usize,
    pub block_out_channels: Vec<usize>,
    pub layers_per_block: usize,
    pub mid_attention: bool,
    pub quant_conv: bool,
    pub post_quant_conv: bool,
    pub norm_channels: Vec<usize>,
}

/// Plans the VAE's tensors found under `prefix` (`first_stage_model.` in a checkpoint, empty in a standalone VAE
/// file).
pub(crate) fn plan(
    file: &CheckpointFile,
    prefix: &str,
    skipped: &mut Vec<String>,
) -> Result<(Plan, VaeStructure)> {
    let unexpected = |key: &str| CheckpointError::UnexpectedTensor {
        path: file.path.clone(),
        tensor: key.to_string(),
        component: COMPONENT,
    };
    let rests: Vec<(&str, &str)> = file.names_with_prefix(prefix).map(|k| (k, &k[prefix.len()..])).collect();
    let levels: BTreeSet<usize> = rests
        .iter()
        .filter_map(|(_, r)| r.strip_prefix("encoder.down.")?.split('.').next()?.parse().ok())
        .collect();
    let n = levels.len();
    if n == 0 || levels.iter().enumerate().any(|(i, l)| i != *l) {
        return Err(CheckpointError::MissingTensor {
            path: file.path.clone(),
            tensor: format!("{prefix}encoder.down.0.*"),
            context: "encoder levels are numbered from 0 without gaps".into(),
        });
    }

    let mut plan = Plan::default();
    for (key, rest) in &rests {
        let s: Vec<&str> = rest.split('.').collect();
        let resnet = |leaf: &str| RESNET_LEAVES.iter().find(|(o, _)| *o == leaf).map(|(_, new)| *new);
        let level = |i: &str| i.parse::<usize>().ok().filter(|i| *i < n);
        let mapped: Option<(String, Op)> =
            match s.as_slice() {
                // A standalone VAE file has no prefix to tell its tensors apart: EMA bookkeeping and the like
                // beside them are not the VAE's.
                [first, ..]
                    if prefix.is_empty()
                        && !matches!(*first, "encoder" | "decoder" | "quant_conv" | "post_quant_conv") =>
                {
                    skipped.push(key.to_string());
                    continue;
                }
                ["loss", ..] => {
                    // Training-time discriminator / LPIPS weights some checkpoints still carry.
                    skipped.push(key.to_string());
                    continue;
                }
                [c @ ("encoder" | "decoder"), m @ ("conv_in" | "conv_out"), p] => {
                    Some((format!("{c}.{m}.{p}"), Op::Copy))
                }
                [c @ ("encoder" | "decoder"), "norm_out", p] => {
                    Some((format!("{c}.conv_norm_out.{p}"), Op::Copy))
                }
                [m @ ("quant_conv" | "post_quant_conv"), p] => Some((format!("{m}.{p}"), Op::Copy)),
                ["encoder", "down", i, "block", j, leaf, p] => level(i)
                    .zip(resnet(leaf))
                    .map(|(i, l)| (format!("encoder.down_blocks.{i}.resnets.{j}.{l}.{p}"), Op::Copy)),
                ["encoder", "down", i, "downsample", "conv", p] => {
                    level(i).map(|i| (format!("encoder.down_blocks.{i}.downsamplers.0.conv.{p}"), Op::Copy))
                }
                // The decoder counts its levels from the bottleneck up; diffusers from the top down.
                ["decoder", "up", i, "block", j, leaf, p] => level(i)
                    .zip(resnet(leaf))
                    .map(|(i, l)| (format!("decoder.up_blocks.{}.resnets.{j}.{l}.{p}", n - 1 - i), Op::Copy)),
                ["decoder", "up", i, "upsample", "conv", p] => level(i)
                    .map(|i| (format!("decoder.up_blocks.{}.upsamplers.0.conv.{p}", n - 1 - i), Op::Copy)),
                [c @ ("encoder" | "decoder"), "mid", b @ ("block_1" | "block_2"), leaf, p] => resnet(leaf)
                    .map(|l| {
                        let r = if *b == "block_1" { 0 } else { 1 };
                        (format!("{c}.mid_block.resnets.{r}.{l}.{p}"), Op::Copy)
                    }),
                [c @ ("encoder" | "decoder"), "mid", "attn_1", leaf, p] => {
                    ATTENTION_LEAVES.iter().find(|(o, _, _)| o == leaf).map(|(_, new, is_proj)| {
                        let op = if *is_proj && *p == "weight" { Op::SqueezeConv } else { Op::Copy };
                        (format!("{c}.mid_block.attentions.0.{new}.{p}"), op)
                    })
                }
                _ => None,
            };
        let (target, op) = mapped.ok_or_else(|| unexpected(key))?;
        plan.add(file, target, key, op)?;
    }

    let structure = check(file, prefix, n)?;
    Ok((plan, structure))
}

fn check(file: &CheckpointFile, prefix: &str, n: usize) -> Result<VaeStructure> {
    let sh = Shapes { file };
    let k = |s: &str| format!("{prefix}{s}");
    let mut norms = Vec::new();
    let conv_in = sh.rank(&k("encoder.conv_in.weight"), 4, "encoder conv_in")?;
    let in_channels = conv_in[1];
    let blocks_at = |coder: &str, i: usize| {
        let p = format!("{prefix}{coder}.{i}.block.");
        let set: BTreeSet<usize> = file
            .names_with_prefix(&p)
            .filter_map(|key| key[p.len()..].split('.').next()?.parse().ok())
            .collect();
        set.len()
    };
    let layers_per_block = blocks_at("encoder.down", 0);
    let mut block_out_channels = Vec::with_capacity(n);
    let mut prev = conv_in[0];
    for i in 0..n {
        if blocks_at("encoder.down", i) != layers_per_block {
            return Err(layout(
                file,
                format!("encoder level {i} has a different number of resnets than level 0"),
            ));
        }
        let mut c = prev;
        for j in 0..layers_per_block {
            let (cin, cout) = resnet(&sh, &k(&format!("encoder.down.{i}.block.{j}.")), &mut norms)?;
            if cin != c {
                return Err(sh.fail(
                    &k(&format!("encoder.down.{i}.block.{j}.conv1.weight")),
                    format!("{c} input channels"),
                ));
            }
            c = cout;
        }
        if i + 1 < n {
            sh.expect(
                &k(&format!("encoder.down.{i}.downsample.conv.weight")),
                &[Some(c), Some(c), None, None],
                "downsampler",
            )?;
        }
        block_out_channels.push(c);
        prev = c;
    }
    let top = prev;
    let mid_attention = file.has_prefix(&k("encoder.mid.attn_1."));
    for coder in ["encoder", "decoder"] {
        for b in ["block_1", "block_2"] {
            let (cin, cout) = resnet(&sh, &k(&format!("{coder}.mid.{b}.")), &mut norms)?;
            if cin != top || cout != top {
                return Err(
                    sh.fail(&k(&format!("{coder}.mid.{b}.conv1.weight")), format!("[{top}, {top}, _, _]"))
                );
            }
        }
        if file.has_prefix(&k(&format!("{coder}.mid.attn_1."))) != mid_attention {
            return Err(layout(file, "only one of encoder and decoder has a mid-block attention".into()));
        }
        if mid_attention {
            let p = |leaf: &str| k(&format!("{coder}.mid.attn_1.{leaf}"));
            sh.expect(&p("norm.weight"), &[Some(top)], "attention group norm")?;
            norms.push(top);
            for leaf in ["q", "k", "v", "proj_out"] {
                let key = p(&format!("{leaf}.weight"));
                match sh.get(&key, "mid-block attention projection")? {
                    [o, i, 1, 1] | [o, i] if *o == top && *i == top => {}
                    _ => return Err(sh.fail(&key, format!("[{top}, {top}, 1, 1] or [{top}, {top}]"))),
                }
                sh.expect_opt(&p(&format!("{leaf}.bias")), &[Some(top)], "mid-block attention projection")?;
            }
        }
    }
    let conv_out_enc =
        sh.expect(&k("encoder.conv_out.weight"), &[None, Some(top), None, None], "encoder conv_out")?;
    sh.expect(&k("encoder.norm_out.weight"), &[Some(top)], "encoder norm_out")?;
    let moments = conv_out_enc[0];
    let dec_in =
        sh.expect(&k("decoder.conv_in.weight"), &[Some(top), None, None, None], "decoder conv_in")?;
    let latent_channels = dec_in[1];
    if moments != 2 * latent_channels {
        return Err(sh.fail(
            &k("encoder.conv_out.weight"),
            format!(
                "{} output channels (mean and log-variance of {latent_channels} latent channels)",
                2 * latent_channels
            ),
        ));
    }
    let quant_conv = file.contains(&k("quant_conv.weight"));
    let post_quant_conv = file.contains(&k("post_quant_conv.weight"));
    sh.expect_opt(&k("quant_conv.weight"), &[Some(moments), Some(moments), Some(1), Some(1)], "quant_conv")?;
    sh.expect_opt(
        &k("post_quant_conv.weight"),
        &[Some(latent_channels), Some(latent_channels), Some(1), Some(1)],
        "post_quant_conv",
    )?;

    // Decoder level i (LDM numbering) works at block_out_channels[i] with one extra resnet.
    let mut c = top;
    for i in (0..n).rev() {
        if blocks_at("decoder.up", i) != layers_per_block + 1 {
            return Err(layout(
                file,
                format!(
                    "decoder level {i} has {} resnets, expected {}",
                    blocks_at("decoder.up", i),
                    layers_per_block + 1
                ),
            ));
        }
        for j in 0..=layers_per_block {
            let (cin, cout) = resnet(&sh, &k(&format!("decoder.up.{i}.block.{j}.")), &mut norms)?;
            if cin != c || cout != block_out_channels[i] {
                return Err(sh.fail(
                    &k(&format!("decoder.up.{i}.block.{j}.conv1.weight")),
                    format!("[{}, {c}, _, _]", block_out_channels[i]),
                ));
            }
            c = cout;
        }
        if i > 0 {
            sh.expect(
                &k(&format!("decoder.up.{i}.upsample.conv.weight")),
                &[Some(c), Some(c), None, None],
                "upsampler",
            )?;
        }
    }
    sh.expect(&k("decoder.norm_out.weight"), &[Some(c)], "decoder norm_out")?;
    let dec_out =
        sh.expect(&k("decoder.conv_out.weight"), &[None, Some(c), None, None], "decoder conv_out")?;
    Ok(VaeStructure {
        in_channels,
        out_channels: dec_out[0],
        latent_channels,
        block_out_channels,
        layers_per_block,
        mid_attention,
        quant_conv,
        post_quant_conv,
        norm_channels: norms,
    })
}

fn layout(file: &CheckpointFile, reason: String) -> CheckpointError {
    CheckpointError::UnknownLayout { path: file.path.clone(), reason: format!("VAE: {reason}") }
}

/// Checks one VAE resnet at `p` (with trailing dot); returns (in, out) channels.
fn resnet(sh: &Shapes, p: &str, norms: &mut Vec<usize>) -> Result<(usize, usize)> {
    let key = |leaf: &str| format!("{p}{leaf}");
    let conv1 = sh.rank(&key("conv1.weight"), 4, "resnet conv1")?;
    let (cout, cin) = (conv1[0], conv1[1]);
    sh.expect(&key("norm1.weight"), &[Some(cin)], "resnet norm1 over the input channels")?;
    sh.expect(&key("norm2.weight"), &[Some(cout)], "resnet norm2")?;
    sh.expect(&key("conv2.weight"), &[Some(cout), Some(cout), None, None], "resnet conv2")?;
    let shortcut = [Some(cout), Some(cin), Some(1), Some(1)];
    if cin != cout {
        sh.expect(&key("nin_shortcut.weight"), &shortcut, "1x1 shortcut")?;
    } else {
        sh.expect_opt(&key("nin_shortcut.weight"), &shortcut, "1x1 shortcut")?;
    }
    norms.extend([cin, cout]);
    Ok((cin, cout))
}
