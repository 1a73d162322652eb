//! The UNet (`model.diffusion_model.*`): LDM's flat input_blocks / middle_block /
//! output_blocks numbering regrouped into diffusers' down_blocks / mid_block / up_blocks, and
//! the network's structure (channels, layers, transformer depth, conditioning widths) read
//! from names and shapes while doing so.
//!
//! Block boundaries come from the layout itself (a downsampler `op` closes a down block, an
//! upsampler `conv` closes an up block), never from a config, so the same code serves every
//! family and every layers-per-block count.

use crate::error::{CheckpointError, Result};
use crate::file::CheckpointFile;
use crate::layout::UNET;
use crate::plan::{Op, Plan, Shapes};
use std::collections::BTreeMap;

/// LDM `ResBlock` leaf → diffusers `ResnetBlock2D` leaf.
const RESNET_LEAVES: &[(&str, &str)] = &[
    ("in_layers.0", "norm1"),
    ("in_layers.2", "conv1"),
    ("out_layers.0", "norm2"),
    ("out_layers.3", "conv2"),
    ("emb_layers.1", "time_emb_proj"),
    ("skip_connection", "conv_shortcut"),
];

/// Top-level LDM modules → diffusers modules.
const TOP_LEVEL: &[(&str, &str)] = &[
    ("time_embed.0", "time_embedding.linear_1"),
    ("time_embed.2", "time_embedding.linear_2"),
    ("label_emb.0.0", "add_embedding.linear_1"),
    ("label_emb.0.2", "add_embedding.linear_2"),
    ("input_blocks.0.0", "conv_in"),
    ("out.0", "conv_norm_out"),
    ("out.2", "conv_out"),
];

/// First name segments a `SpatialTransformer` may have; diffusers' `Transformer2DModel`
/// uses the same names, so attention tensors keep their tails.
const ATTENTION_HEADS: &[&str] = &["norm", "proj_in", "proj_out", "transformer_blocks"];

const COMPONENT: &str = "UNet";

/// What the UNet's names and shapes say about its architecture.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct UnetStructure {
    pub in_channels: usize,
    pub out_channels: usize,
    pub conv_in_kernel: usize,
    pub conv_out_kernel: usize,
    pub block_out_channels: Vec<usize>,
    /// Resnets per down block (up blocks have one more).
    pub layers_per_block: Vec<usize>,
    pub down_attention: Vec<bool>,
    pub up_attention: Vec<bool>,
    /// Transformer blocks per attention, per down block; `None` where the block has none.
    pub down_depth: Vec<Option<usize>>,
    /// Transformer blocks per attention, per up block and layer (empty without attention).
    pub up_depth: Vec<Vec<usize>>,
    pub mid_depth: Option<usize>,
    pub cross_attention_dim: Option<usize>,
    pub linear_projection: Option<bool>,
    pub time_embed_dim: usize,
    /// Input width of SDXL's `label_emb` (pooled text embedding + micro-conditioning).
    pub adm_in_channels: Option<usize>,
    /// Channel counts of every GroupNorm, to pick a group count that divides them all.
    pub norm_channels: Vec<usize>,
}

/// One LDM sub-module (`input_blocks.4.1`, …) and the tensors under it.
#[derive(Debug, Default)]
struct Group {
    /// (tail after the sub-module prefix, full checkpoint key)
    keys: Vec<(String, String)>,
}

impl Group {
    fn has(&self, head: &str) -> bool {
        self.keys.iter().any(|(t, _)| t.split('.').next() == Some(head))
    }
    fn is_resnet(&self) -> bool {
        self.has("in_layers")
    }
    fn is_attention(&self) -> bool {
        self.has("proj_in") || self.has("transformer_blocks")
    }
    fn is_resample(&self, leaf: &str) -> bool {
        !self.keys.is_empty() && self.keys.iter().all(|(t, _)| t.split('.').next() == Some(leaf))
    }
}

type Groups = BTreeMap<usize, BTreeMap<usize, Group>>;

/// Plans the UNet. `text_width` is the width of the hidden states it cross-attends to (the
/// text encoders', concatenated for SDXL); every cross-attention is held to it.
pub(crate) fn plan(file: &CheckpointFile, text_width: usize) -> Result<(Plan, UnetStructure)> {
    let unexpected = |key: &str| CheckpointError::UnexpectedTensor {
        path: file.path.clone(),
        tensor: key.to_string(),
        component: COMPONENT,
    };
    let mut plan = Plan::default();
    let mut inputs: Groups = BTreeMap::new();
    let mut outputs: Groups = BTreeMap::new();
    let mut middle: BTreeMap<usize, Group> = BTreeMap::new();

    for key in file.names_with_prefix(UNET) {
        let rest = &key[UNET.len()..];
        if let Some((old, new)) = TOP_LEVEL.iter().find(|(old, _)| strip(rest, old).is_some()) {
            let tail = strip(rest, old).unwrap_or_default();
            plan.add(file, format!("{new}.{tail}"), key, Op::Copy)?;
            continue;
        }
        let segs: Vec<&str> = rest.splitn(4, '.').collect();
        let idx = |s: Option<&&str>| s.and_then(|s| s.parse::<usize>().ok());
        match segs.first().copied() {
            Some(which @ ("input_blocks" | "output_blocks")) if segs.len() == 4 => {
                let (Some(i), Some(j)) = (idx(segs.get(1)), idx(segs.get(2))) else {
                    return Err(unexpected(key));
                };
                let groups = if which == "input_blocks" { &mut inputs } else { &mut outputs };
                groups.entry(i).or_default().entry(j).or_default().keys.push((segs[3].into(), key.into()));
            }
            Some("middle_block") if segs.len() >= 3 => {
                let Some(j) = idx(segs.get(1)) else { return Err(unexpected(key)) };
                let tail = rest.splitn(3, '.').nth(2).unwrap_or_default();
                middle.entry(j).or_default().keys.push((tail.into(), key.into()));
            }
            _ => return Err(unexpected(key)),
        }
    }

    let sh = Shapes { file };
    let k = |s: &str| format!("{UNET}{s}");
    let conv_in = sh.rank(&k("input_blocks.0.0.weight"), 4, "conv_in")?;
    let (c0, in_channels, conv_in_kernel) = (conv_in[0], conv_in[1], conv_in[2]);
    let temb =
        sh.expect(&k("time_embed.0.weight"), &[None, Some(c0)], "time embedding from the base width")?[0];
    sh.expect(&k("time_embed.2.weight"), &[Some(temb), Some(temb)], "time embedding")?;
    let conv_out = sh.expect(&k("out.2.weight"), &[None, Some(c0), None, None], "conv_out")?;
    sh.expect(&k("out.0.weight"), &[Some(c0)], "conv_norm_out")?;
    let adm_in_channels = match file.shape(&k("label_emb.0.0.weight")) {
        Some(_) => {
            let s = sh.expect(&k("label_emb.0.0.weight"), &[Some(temb), None], "add-embedding")?;
            sh.expect(&k("label_emb.0.2.weight"), &[Some(temb), Some(temb)], "add-embedding")?;
            Some(s[1])
        }
        None => None,
    };

    let mut ctx = Context { sh: &sh, temb, text_width, cross: None, linear: None, norm_channels: vec![c0] };

    // Down blocks: input_blocks 1.. in order; an `op` downsampler closes the current block.
    let mut down: Vec<DownBlock> = vec![DownBlock::default()];
    let expected_inputs = inputs.len();
    for (pos, (&i, subs)) in inputs.iter().enumerate() {
        // input_blocks.0.0 is conv_in, already planned as a top-level module.
        if i != pos + 1 {
            return match subs.values().next().and_then(|g| g.keys.first()) {
                Some((_, key)) if i == 0 => Err(unexpected(key)),
                _ => Err(gap(file, "input_blocks", pos + 1)),
            };
        }
        let b = down.len() - 1;
        let block = down.last_mut().ok_or_else(|| gap(file, "input_blocks", i))?;
        let first = subs.get(&0).ok_or_else(|| gap(file, &format!("input_blocks.{i}"), 0))?;
        if first.is_resample("op") {
            if subs.len() != 1 || block.layers.is_empty() {
                return Err(unexpected(&first.keys[0].1));
            }
            let c = block.channels;
            for (tail, key) in &first.keys {
                let param = strip(tail, "op").ok_or_else(|| unexpected(key))?;
                plan.add(file, format!("down_blocks.{b}.downsamplers.0.conv.{param}"), key, Op::Copy)?;
            }
            sh.expect(
                &k(&format!("input_blocks.{i}.0.op.weight")),
                &[Some(c), Some(c), None, None],
                "downsampler",
            )?;
            down.push(DownBlock { channels: c, ..DownBlock::default() });
            continue;
        }
        let l = block.layers.len();
        let prev_out = if b == 0 && l == 0 { c0 } else { block.channels };
        let (cin, cout) = ctx.resnet(&format!("{UNET}input_blocks.{i}.0."))?;
        if cin != prev_out {
            return Err(sh.fail(
                &k(&format!("input_blocks.{i}.0.in_layers.2.weight")),
                format!("{prev_out} input channels, the width of the layer before"),
            ));
        }
        if l > 0 && cout != block.channels {
            return Err(sh.fail(
                &k(&format!("input_blocks.{i}.0.in_layers.2.weight")),
                format!("{} output channels like the rest of its block", block.channels),
            ));
        }
        block.channels = cout;
        map_resnet(file, &mut plan, first, &format!("down_blocks.{b}.resnets.{l}"))?;
        let mut depth = None;
        for (&j, g) in subs {
            match j {
                0 => {}
                1 if g.is_attention() => {
                    depth = Some(ctx.attention(&format!("{UNET}input_blocks.{i}.1."), g, cout)?);
                    map_attention(file, &mut plan, g, &format!("down_blocks.{b}.attentions.{l}"))?;
                }
                _ => return Err(unexpected(&g.keys[0].1)),
            }
        }
        block.layers.push(depth);
    }
    if expected_inputs == 0 || down.last().is_some_and(|b| b.layers.is_empty()) {
        return Err(CheckpointError::UnknownLayout {
            path: file.path.clone(),
            reason: "the UNet's input_blocks end with a downsampler or are empty".into(),
        });
    }

    // Mid block: resnets and an attention, in order.
    let c_last = down.last().map(|b| b.channels).unwrap_or(c0);
    let (mut mid_resnets, mut mid_depth) = (0usize, None);
    for (&j, g) in &middle {
        if g.is_resnet() {
            let (cin, cout) = ctx.resnet(&format!("{UNET}middle_block.{j}."))?;
            if cin != c_last || cout != c_last {
                return Err(sh.fail(
                    &k(&format!("middle_block.{j}.in_layers.2.weight")),
                    format!("[{c_last}, {c_last}, _, _] (mid block at the deepest width)"),
                ));
            }
            map_resnet(file, &mut plan, g, &format!("mid_block.resnets.{mid_resnets}"))?;
            mid_resnets += 1;
        } else if g.is_attention() && mid_depth.is_none() {
            mid_depth = Some(ctx.attention(&format!("{UNET}middle_block.{j}."), g, c_last)?);
            map_attention(file, &mut plan, g, "mid_block.attentions.0")?;
        } else {
            return Err(unexpected(&g.keys[0].1));
        }
    }
    if mid_resnets != 2 {
        return Err(CheckpointError::UnknownLayout {
            path: file.path.clone(),
            reason: format!("the UNet middle_block has {mid_resnets} resnets, expected 2"),
        });
    }

    // Up blocks: output_blocks in order; an upsampler `conv` closes the current block.
    let n = down.len();
    let mut up: Vec<UpBlock> = vec![UpBlock::default()];
    for (pos, (&i, subs)) in outputs.iter().enumerate() {
        if i != pos {
            return Err(gap(file, "output_blocks", pos));
        }
        let b = up.len() - 1;
        let want = down.get(n.saturating_sub(1 + b)).map(|d| d.channels).unwrap_or(0);
        let first = subs.get(&0).ok_or_else(|| gap(file, &format!("output_blocks.{i}"), 0))?;
        if !first.is_resnet() {
            return Err(unexpected(&first.keys[0].1));
        }
        let l = up[b].layers.len();
        let (_, cout) = ctx.resnet(&format!("{UNET}output_blocks.{i}.0."))?;
        if cout != want {
            return Err(sh.fail(
                &k(&format!("output_blocks.{i}.0.in_layers.2.weight")),
                format!(
                    "{want} output channels (up block {b} mirrors down block {})",
                    n.saturating_sub(1 + b)
                ),
            ));
        }
        map_resnet(file, &mut plan, first, &format!("up_blocks.{b}.resnets.{l}"))?;
        let (mut depth, mut closes) = (None, false);
        for (&j, g) in subs {
            match j {
                0 => {}
                1 | 2 if g.is_resample("conv") && !closes => {
                    for (tail, key) in &g.keys {
                        plan.add(file, format!("up_blocks.{b}.upsamplers.0.{tail}"), key, Op::Copy)?;
                    }
                    sh.expect(
                        &k(&format!("output_blocks.{i}.{j}.conv.weight")),
                        &[Some(cout), Some(cout), None, None],
                        "upsampler",
                    )?;
                    closes = true;
                }
                1 if g.is_attention() => {
                    depth = Some(ctx.attention(&format!("{UNET}output_blocks.{i}.1."), g, cout)?);
                    map_attention(file, &mut plan, g, &format!("up_blocks.{b}.attentions.{l}"))?;
                }
                _ => return Err(unexpected(&g.keys[0].1)),
            }
        }
        up[b].layers.push(depth);
        if closes {
            up.push(UpBlock::default());
        }
    }
    if up.last().is_some_and(|u| u.layers.is_empty()) {
        up.pop();
    }

    let layout_err = |reason: String| CheckpointError::UnknownLayout { path: file.path.clone(), reason };
    if up.len() != n {
        return Err(layout_err(format!("the UNet has {n} down blocks but {} up blocks", up.len())));
    }
    let mut down_attention = Vec::with_capacity(n);
    let mut down_depth = Vec::with_capacity(n);
    for (b, d) in down.iter().enumerate() {
        let (attn, depth) = uniform(&d.layers)
            .ok_or_else(|| layout_err(format!("down block {b} mixes layers with and without attention")))?;
        down_attention.push(attn);
        down_depth.push(depth);
    }
    let mut up_attention = Vec::with_capacity(n);
    let mut up_depth = Vec::with_capacity(n);
    for (b, u) in up.iter().enumerate() {
        let mirror = &down[n - 1 - b];
        if u.layers.len() != mirror.layers.len() + 1 {
            return Err(layout_err(format!(
                "up block {b} has {} layers; down block {} has {}, so it should have {}",
                u.layers.len(),
                n - 1 - b,
                mirror.layers.len(),
                mirror.layers.len() + 1
            )));
        }
        let attn = u.layers.iter().all(Option::is_some);
        if !attn && u.layers.iter().any(Option::is_some) {
            return Err(layout_err(format!("up block {b} mixes layers with and without attention")));
        }
        up_attention.push(attn);
        up_depth.push(u.layers.iter().flatten().copied().collect());
    }

    let structure = UnetStructure {
        in_channels,
        out_channels: conv_out[0],
        conv_in_kernel,
        conv_out_kernel: conv_out[2],
        block_out_channels: down.iter().map(|d| d.channels).collect(),
        layers_per_block: down.iter().map(|d| d.layers.len()).collect(),
        down_attention,
        up_attention,
        down_depth,
        up_depth,
        mid_depth,
        cross_attention_dim: ctx.cross,
        linear_projection: ctx.linear,
        time_embed_dim: temb,
        adm_in_channels,
        norm_channels: ctx.norm_channels,
    };
    Ok((plan, structure))
}

#[derive(Debug, Default)]
struct DownBlock {
    channels: usize,
    layers: Vec<Option<usize>>,
}

#[derive(Debug, Default)]
struct UpBlock {
    layers: Vec<Option<usize>>,
}

/// `Some((has_attention, depth))` when every layer agrees on attention and depth.
fn uniform(layers: &[Option<usize>]) -> Option<(bool, Option<usize>)> {
    let first = *layers.first()?;
    layers.iter().all(|d| *d == first).then_some((first.is_some(), first))
}

fn strip<'a>(name: &'a str, module: &str) -> Option<&'a str> {
    name.strip_prefix(module)?.strip_prefix('.')
}

fn gap(file: &CheckpointFile, what: &str, index: usize) -> CheckpointError {
    CheckpointError::MissingTensor {
        path: file.path.clone(),
        tensor: format!("{UNET}{what}.{index}.*"),
        context: "LDM numbers these sub-modules consecutively".into(),
    }
}

fn map_resnet(file: &CheckpointFile, plan: &mut Plan, g: &Group, target: &str) -> Result<()> {
    for (tail, key) in &g.keys {
        let leaf = RESNET_LEAVES
            .iter()
            .find_map(|(old, new)| strip(tail, old).map(|p| format!("{new}.{p}")))
            .ok_or_else(|| CheckpointError::UnexpectedTensor {
                path: file.path.clone(),
                tensor: key.clone(),
                component: COMPONENT,
            })?;
        plan.add(file, format!("{target}.{leaf}"), key, Op::Copy)?;
    }
    Ok(())
}

fn map_attention(file: &CheckpointFile, plan: &mut Plan, g: &Group, target: &str) -> Result<()> {
    for (tail, key) in &g.keys {
        if !ATTENTION_HEADS.iter().any(|h| tail.split('.').next() == Some(h)) {
            return Err(CheckpointError::UnexpectedTensor {
                path: file.path.clone(),
                tensor: key.clone(),
                component: COMPONENT,
            });
        }
        plan.add(file, format!("{target}.{tail}"), key, Op::Copy)?;
    }
    Ok(())
}

/// Cross-block facts gathered while checking shapes.
struct Context<'a> {
    sh: &'a Shapes<'a>,
    temb: usize,
    text_width: usize,
    cross: Option<usize>,
    linear: Option<bool>,
    norm_channels: Vec<usize>,
}

impl Context<'_> {
    /// Checks one LDM ResBlock at `p` (with trailing dot) and returns (in, out) channels.
    fn resnet(&mut self, p: &str) -> Result<(usize, usize)> {
        let sh = self.sh;
        let key = |leaf: &str| format!("{p}{leaf}");
        let conv1 = sh.rank(&key("in_layers.2.weight"), 4, "resnet conv1")?;
        let (cout, cin) = (conv1[0], conv1[1]);
        let v = |c: usize| [Some(c)];
        sh.expect(&key("in_layers.0.weight"), &v(cin), "resnet norm1 over the input channels")?;
        sh.expect_opt(&key("in_layers.0.bias"), &v(cin), "resnet norm1")?;
        sh.expect_opt(&key("in_layers.2.bias"), &v(cout), "resnet conv1")?;
        sh.expect(&key("emb_layers.1.weight"), &[Some(cout), Some(self.temb)], "time embedding projection")?;
        sh.expect_opt(&key("emb_layers.1.bias"), &v(cout), "time embedding projection")?;
        sh.expect(&key("out_layers.0.weight"), &v(cout), "resnet norm2")?;
        sh.expect_opt(&key("out_layers.0.bias"), &v(cout), "resnet norm2")?;
        sh.expect(&key("out_layers.3.weight"), &[Some(cout), Some(cout), None, None], "resnet conv2")?;
        sh.expect_opt(&key("out_layers.3.bias"), &v(cout), "resnet conv2")?;
        if cin != cout {
            sh.expect(
                &key("skip_connection.weight"),
                &[Some(cout), Some(cin), Some(1), Some(1)],
                "1x1 shortcut",
            )?;
        } else {
            sh.expect_opt(
                &key("skip_connection.weight"),
                &[Some(cout), Some(cin), Some(1), Some(1)],
                "1x1 shortcut",
            )?;
        }
        self.norm_channels.extend([cin, cout]);
        Ok((cin, cout))
    }

    /// Checks one SpatialTransformer at `p` over `c` channels and returns its depth.
    fn attention(&mut self, p: &str, g: &Group, c: usize) -> Result<usize> {
        let sh = self.sh;
        let key = |leaf: &str| format!("{p}{leaf}");
        sh.expect(&key("norm.weight"), &[Some(c)], "attention group norm")?;
        self.norm_channels.push(c);
        let proj_in = sh.get(&key("proj_in.weight"), "attention input projection")?.to_vec();
        let linear = match proj_in.as_slice() {
            [_, i] if *i == c => true,
            [_, i, 1, 1] if *i == c => false,
            _ => {
                return Err(
                    sh.fail(&key("proj_in.weight"), format!("[_, {c}] (linear) or [_, {c}, 1, 1] (conv)"))
                )
            }
        };
        if *self.linear.get_or_insert(linear) != linear {
            return Err(sh.fail(
                &key("proj_in.weight"),
                "the same projection kind (linear or 1x1 conv) as the other attentions",
            ));
        }
        let inner = proj_in[0];
        let proj_out =
            if linear { vec![Some(c), Some(inner)] } else { vec![Some(c), Some(inner), Some(1), Some(1)] };
        sh.expect(&key("proj_out.weight"), &proj_out, "attention output projection")?;

        let mut blocks: Vec<usize> = g
            .keys
            .iter()
            .filter_map(|(t, _)| t.strip_prefix("transformer_blocks.")?.split('.').next()?.parse().ok())
            .collect();
        blocks.sort_unstable();
        blocks.dedup();
        if blocks.iter().enumerate().any(|(i, b)| i != *b) || blocks.is_empty() {
            return Err(CheckpointError::MissingTensor {
                path: sh.file.path.clone(),
                tensor: key("transformer_blocks.0.*"),
                context: "transformer blocks are numbered from 0 without gaps".into(),
            });
        }
        let sq = [Some(inner), Some(inner)];
        for t in &blocks {
            let bk = |leaf: &str| key(&format!("transformer_blocks.{t}.{leaf}"));
            for leaf in
                ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_out.0"]
            {
                sh.expect(&bk(&format!("{leaf}.weight")), &sq, "attention projection")?;
            }
            let text = [Some(inner), Some(self.text_width)];
            let why = "cross-attention over the text encoder hidden states";
            sh.expect(&bk("attn2.to_k.weight"), &text, why)?;
            sh.expect(&bk("attn2.to_v.weight"), &text, why)?;
            self.cross = Some(self.text_width);
            for leaf in ["norm1", "norm2", "norm3"] {
                sh.expect(&bk(&format!("{leaf}.weight")), &[Some(inner)], "transformer layer norm")?;
            }
            let ff = sh.expect(&bk("ff.net.0.proj.weight"), &[None, Some(inner)], "GEGLU projection")?[0];
            sh.expect(&bk("ff.net.2.weight"), &[Some(inner), Some(ff / 2)], "feed-forward output")?;
        }
        Ok(blocks.len())
    }
}
