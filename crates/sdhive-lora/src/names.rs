//! Which model weight a LoRA module changes. LoRA files name layers three ways: kohya's underscored diffusers
//! paths (`lora_unet_down_blocks_0_attentions_0_proj_in`), kohya's underscored original LDM/SGM paths (SDXL and
//! LyCORIS: `lora_unet_input_blocks_1_1_proj_in`), and diffusers/PEFT dotted paths. Rather than parse underscored
//! names (ambiguous: `to_out_0`, `ff_net_0_proj`), every weight the model has is written out in each spelling and
//! looked up; the LDM numbering is derived from the diffusers name and `layers_per_block`, as A1111's
//! `convert_diffusers_name_to_compvis` and diffusers' `_maybe_map_sgm_blocks_to_diffusers` do in reverse.
//!
//! SD3's MMDiT has a second spelling too, SAI's (its single files, and kohya sd-scripts' SD3 LoRAs:
//! `lora_unet_joint_blocks_0_x_block_attn_qkv`), where one layer may hold several diffusers weights: the fused
//! `qkv` is `to_q`, `to_k` and `to_v` stacked, and the final layer's and the last block's context adaLN hold
//! `(shift, scale)` where diffusers holds `(scale, shift)`. Such a module resolves to one [`Patch`] per weight, each
//! taking its [`Rows`] of the module's update, as diffusers' `convert_sd3_transformer_checkpoint_to_diffusers`
//! takes them of the weights.

use crate::delta::fits;
use crate::file::ModuleName;
use crate::{LoraError, LoraFile};
use std::collections::{HashMap, HashSet};

/// The network a weight belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Network {
    /// The denoiser: the UNet, or SD3's MMDiT transformer (A1111's `unet` multiplier applies to either).
    Unet,
    /// 0 = `text_encoder` (CLIP-L, or SD2's OpenCLIP-H), 1 = `text_encoder_2` (SDXL's and SD3's OpenCLIP bigG),
    /// 2 = SD3's T5 (kohya's `lora_te3_`), which no model here lets a LoRA change.
    TextEncoder(usize),
}

/// Which kind of denoiser a model has, and so which names its LoRAs use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Denoiser {
    /// SD1.x, SD2.x, SDXL.
    #[default]
    Unet,
    /// SD3 / SD3.5's `SD3Transformer2DModel`.
    Mmdit,
}

impl Denoiser {
    /// The model families, for messages.
    pub fn families(self) -> &'static str {
        match self {
            Denoiser::Unet => "SD1.x/SD2.x/SDXL",
            Denoiser::Mmdit => "SD3/SD3.5",
        }
    }
}

/// Every weight of the loaded model, by diffusers parameter name, with its shape.
#[derive(Debug, Clone, Default)]
pub struct ModelParams {
    /// The denoiser's parameter name (`down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight`, SD3's
    /// `transformer_blocks.0.attn.to_q.weight`) → shape.
    pub unet: HashMap<String, Vec<usize>>,
    /// Per text encoder (index as in [`Network::TextEncoder`]): parameter name
    /// (`text_model.encoder.layers.0.self_attn.q_proj.weight`) → shape.
    pub text: Vec<HashMap<String, Vec<usize>>>,
    /// The UNet config's `layers_per_block` (2 for SD1/SD2/SDXL); it fixes the LDM block numbering.
    pub unet_layers_per_block: usize,
    /// Number of UNet down blocks (4 for SD1/SD2, 3 for SDXL).
    pub unet_down_blocks: usize,
    /// What `unet` is: a UNet or an MMDiT (whose SAI names are looked up too).
    pub denoiser: Denoiser,
}

/// One module of a LoRA file matched to one model weight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Patch {
    pub network: Network,
    /// Full parameter name, ending in `.weight`, as in [`ModelParams`].
    pub target: String,
    /// Index into [`LoraFile::modules`].
    pub module: usize,
    /// The part of the module's update that is the target's.
    pub rows: Rows,
}

/// The part of a module's update a weight takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Rows {
    /// The whole update.
    #[default]
    All,
    /// Rows `start..start + len` of an update `of` rows long: one weight of a layer that fuses several (`to_k` is
    /// the second third of SAI's `qkv`).
    Slice { start: usize, len: usize, of: usize },
    /// The whole update with its first and second halves of rows exchanged (SAI's `(shift, scale)` adaLN rows
    /// where diffusers has `(scale, shift)`).
    SwapHalves,
}

impl Rows {
    /// The shape the module's update has for a target of shape `target`.
    pub fn update_shape(self, target: &[usize]) -> Vec<usize> {
        match self {
            Rows::All | Rows::SwapHalves => target.to_vec(),
            Rows::Slice { of, .. } => std::iter::once(of).chain(target.iter().skip(1).copied()).collect(),
        }
    }

    /// Whether a target shaped `target` can take these rows.
    pub(crate) fn fit(self, target: &[usize]) -> bool {
        match self {
            Rows::All => true,
            Rows::Slice { start, len, of } => target.first() == Some(&len) && start + len <= of,
            Rows::SwapHalves => target.first().is_some_and(|r| r % 2 == 0),
        }
    }
}

/// Underscored module name (any spelling) → parameter name, for one network.
type Table = HashMap<String, String>;

fn underscored(path: &str) -> String {
    path.replace('.', "_")
}

/// The LDM/SGM name of a diffusers UNet module, or `None` for names that have no LDM counterpart.
fn sgm_name(path: &str, lpb: usize, up_with_attention: &HashSet<usize>) -> Option<String> {
    let parts: Vec<&str> = path.split('.').collect();
    let resnet = |rest: &[&str]| -> String {
        let (first, tail) = match rest.split_first() {
            Some((f, t)) => (*f, t),
            None => return String::new(),
        };
        let first = match first {
            "conv1" => "in_layers.2",
            "conv2" => "out_layers.3",
            "norm1" => "in_layers.0",
            "norm2" => "out_layers.0",
            "time_emb_proj" => "emb_layers.1",
            "conv_shortcut" => "skip_connection",
            other => other,
        };
        std::iter::once(first).chain(tail.iter().copied()).collect::<Vec<_>>().join(".")
    };
    let num = |s: &str| s.parse::<usize>().ok();
    let join = |head: String, rest: String| if rest.is_empty() { head } else { format!("{head}.{rest}") };
    Some(match parts.as_slice() {
        ["conv_in"] => "input_blocks.0.0".into(),
        ["conv_norm_out"] => "out.0".into(),
        ["conv_out"] => "out.2".into(),
        ["time_embedding", "linear_1"] => "time_embed.0".into(),
        ["time_embedding", "linear_2"] => "time_embed.2".into(),
        ["add_embedding", "linear_1"] => "label_emb.0.0".into(),
        ["add_embedding", "linear_2"] => "label_emb.0.2".into(),
        ["down_blocks", b, "resnets", l, rest @ ..] => {
            join(format!("input_blocks.{}.0", 1 + num(b)? * (lpb + 1) + num(l)?), resnet(rest))
        }
        ["down_blocks", b, "attentions", l, rest @ ..] => {
            join(format!("input_blocks.{}.1", 1 + num(b)? * (lpb + 1) + num(l)?), rest.join("."))
        }
        ["down_blocks", b, "downsamplers", "0", "conv"] => {
            format!("input_blocks.{}.0.op", 1 + num(b)? * (lpb + 1) + lpb)
        }
        ["mid_block", "resnets", j, rest @ ..] => join(format!("middle_block.{}", 2 * num(j)?), resnet(rest)),
        ["mid_block", "attentions", "0", rest @ ..] => join("middle_block.1".into(), rest.join(".")),
        ["up_blocks", b, "resnets", l, rest @ ..] => {
            join(format!("output_blocks.{}.0", num(b)? * (lpb + 1) + num(l)?), resnet(rest))
        }
        ["up_blocks", b, "attentions", l, rest @ ..] => {
            join(format!("output_blocks.{}.1", num(b)? * (lpb + 1) + num(l)?), rest.join("."))
        }
        ["up_blocks", b, "upsamplers", "0", "conv"] => {
            let b = num(b)?;
            // The upsampler follows the block's last layer: after its attention when it has one.
            let slot = if up_with_attention.contains(&b) { 2 } else { 1 };
            format!("output_blocks.{}.{slot}.conv", b * (lpb + 1) + lpb)
        }
        _ => return None,
    })
}

/// Every weight by its module path with `.` written `_` (kohya's spelling of diffusers names).
fn underscored_table(params: &HashMap<String, Vec<usize>>) -> Table {
    params
        .keys()
        .filter_map(|name| Some((underscored(name.strip_suffix(".weight")?), name.clone())))
        .collect()
}

fn unet_table(params: &HashMap<String, Vec<usize>>, lpb: usize) -> Table {
    let up_with_attention: HashSet<usize> = params
        .keys()
        .filter_map(|k| {
            let rest = k.strip_prefix("up_blocks.")?;
            let (b, rest) = rest.split_once('.')?;
            rest.starts_with("attentions.").then(|| b.parse().ok()).flatten()
        })
        .collect();
    let mut table = underscored_table(params);
    for name in params.keys() {
        let Some(module) = name.strip_suffix(".weight") else { continue };
        if let Some(sgm) = sgm_name(module, lpb, &up_with_attention) {
            table.entry(underscored(&sgm)).or_insert_with(|| name.clone());
        }
    }
    table
}

/// Which part of an SAI module a diffusers MMDiT weight is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Slot {
    Whole,
    /// q, k or v of a fused `qkv`.
    Third(usize),
    /// The whole layer with its two halves of rows exchanged (an adaLN whose `(scale, shift)` diffusers swapped).
    Swapped,
}

/// The dotted SAI module of a diffusers MMDiT module path (`transformer_blocks.0.attn.to_k` →
/// `joint_blocks.0.x_block.attn.qkv`, its second third) in a model of `blocks` blocks, whose last block's context
/// stream ends there; `None` for a path SAI's MMDiT has no layer for.
pub fn sd3_sai_module(path: &str, blocks: usize) -> Option<(String, Slot)> {
    let pre_only: HashSet<usize> = blocks.checked_sub(1).into_iter().collect();
    sai_name(path, &pre_only)
}

/// The SAI name of a diffusers MMDiT module (`transformer_blocks.0.attn.to_k` → `joint_blocks.0.x_block.attn.qkv`,
/// its second third), the inverse of diffusers' `convert_sd3_transformer_checkpoint_to_diffusers`. `pre_only`: the
/// blocks whose context stream ends in them (their context adaLN is AdaLayerNormContinuous, halves swapped).
fn sai_name(path: &str, pre_only: &HashSet<usize>) -> Option<(String, Slot)> {
    let parts: Vec<&str> = path.split('.').collect();
    let third = |c: &str| ["q", "k", "v"].iter().position(|x| *x == c);
    let whole = |s: &str| Some((s.to_string(), Slot::Whole));
    match parts.as_slice() {
        ["pos_embed", "proj"] => whole("x_embedder.proj"),
        ["context_embedder"] => whole("context_embedder"),
        ["time_text_embed", "timestep_embedder", "linear_1"] => whole("t_embedder.mlp.0"),
        ["time_text_embed", "timestep_embedder", "linear_2"] => whole("t_embedder.mlp.2"),
        ["time_text_embed", "text_embedder", "linear_1"] => whole("y_embedder.mlp.0"),
        ["time_text_embed", "text_embedder", "linear_2"] => whole("y_embedder.mlp.2"),
        ["proj_out"] => whole("final_layer.linear"),
        ["norm_out", "linear"] => Some(("final_layer.adaLN_modulation.1".into(), Slot::Swapped)),
        ["transformer_blocks", i, rest @ ..] => {
            let block: usize = i.parse().ok()?;
            let b = |s: &str| format!("joint_blocks.{block}.{s}");
            let qkv = |layer: &str, c: &str| Some((b(layer), Slot::Third(third(c)?)));
            match rest {
                ["attn", p] if p.starts_with("to_") && p.len() == 4 => qkv("x_block.attn.qkv", &p[3..]),
                ["attn", p] if p.starts_with("add_") && p.ends_with("_proj") && p.len() == 10 => {
                    qkv("context_block.attn.qkv", &p[4..5])
                }
                ["attn2", p] if p.starts_with("to_") && p.len() == 4 => qkv("x_block.attn2.qkv", &p[3..]),
                ["attn", "to_out", "0"] => Some((b("x_block.attn.proj"), Slot::Whole)),
                ["attn2", "to_out", "0"] => Some((b("x_block.attn2.proj"), Slot::Whole)),
                ["attn", "to_add_out"] => Some((b("context_block.attn.proj"), Slot::Whole)),
                ["norm1", "linear"] => Some((b("x_block.adaLN_modulation.1"), Slot::Whole)),
                ["norm1_context", "linear"] => {
                    let slot = if pre_only.contains(&block) { Slot::Swapped } else { Slot::Whole };
                    Some((b("context_block.adaLN_modulation.1"), slot))
                }
                ["ff", "net", "0", "proj"] => Some((b("x_block.mlp.fc1"), Slot::Whole)),
                ["ff", "net", "2"] => Some((b("x_block.mlp.fc2"), Slot::Whole)),
                ["ff_context", "net", "0", "proj"] => Some((b("context_block.mlp.fc1"), Slot::Whole)),
                ["ff_context", "net", "2"] => Some((b("context_block.mlp.fc2"), Slot::Whole)),
                _ => None,
            }
        }
        _ => None,
    }
}

/// Underscored SAI module name → the MMDiT weights it holds and the rows of its update each takes. A fused layer
/// is listed only when the model has all of its parts.
type FusedTable = HashMap<String, Vec<(String, Rows)>>;

fn sai_table(params: &HashMap<String, Vec<usize>>) -> FusedTable {
    // The block whose context stream ends there has a context adaLN but no context output projection.
    let pre_only: HashSet<usize> = params
        .keys()
        .filter_map(|k| {
            let block =
                k.strip_prefix("transformer_blocks.")?.strip_suffix(".norm1_context.linear.weight")?;
            let block: usize = block.parse().ok()?;
            (!params.contains_key(&format!("transformer_blocks.{block}.attn.to_add_out.weight")))
                .then_some(block)
        })
        .collect();
    let mut groups: HashMap<String, Vec<(Slot, String)>> = HashMap::new();
    for name in params.keys() {
        let Some(module) = name.strip_suffix(".weight") else { continue };
        if let Some((sai, slot)) = sai_name(module, &pre_only) {
            groups.entry(underscored(&sai)).or_default().push((slot, name.clone()));
        }
    }
    let mut table = FusedTable::new();
    for (sai, mut parts) in groups {
        parts.sort();
        let rows: Option<Vec<(String, Rows)>> = match parts.as_slice() {
            [(Slot::Whole, target)] => Some(vec![(target.clone(), Rows::All)]),
            [(Slot::Swapped, target)] => Some(vec![(target.clone(), Rows::SwapHalves)]),
            [(Slot::Third(0), _), (Slot::Third(1), _), (Slot::Third(2), _)] => {
                let len = |t: &String| params.get(t).and_then(|s| s.first().copied()).unwrap_or(0);
                let of = parts.iter().map(|(_, t)| len(t)).sum();
                let mut start = 0;
                Some(
                    parts
                        .iter()
                        .map(|(_, t)| {
                            let rows = Rows::Slice { start, len: len(t), of };
                            start += len(t);
                            (t.clone(), rows)
                        })
                        .collect(),
                )
            }
            _ => None,
        };
        if let Some(rows) = rows {
            table.insert(sai, rows);
        }
    }
    table
}

/// The family a module's name says it was made for, where it says (the denoiser's top-level layers differ).
fn family_of(name: &ModuleName) -> Option<Denoiser> {
    const MMDIT: &[&str] = &[
        "joint_blocks_",
        "transformer_blocks_",
        "x_embedder_",
        "context_embedder",
        "t_embedder_",
        "y_embedder_",
        "final_layer_",
        "pos_embed_",
        "time_text_embed_",
        "norm_out_",
    ];
    const UNET: &[&str] = &[
        "down_blocks_",
        "up_blocks_",
        "mid_block_",
        "input_blocks_",
        "middle_block_",
        "output_blocks_",
        "conv_in",
        "conv_out",
        "time_embedding_",
        "add_embedding_",
        "time_embed_",
        "label_emb_",
    ];
    let name = match name {
        ModuleName::Kohya { network: Network::Unet, name } => name.clone(),
        ModuleName::Diffusers { network: Network::Unet, path } => underscored(path),
        _ => return None,
    };
    if MMDIT.iter().any(|p| name.starts_with(p)) {
        Some(Denoiser::Mmdit)
    } else if UNET.iter().any(|p| name.starts_with(p)) {
        Some(Denoiser::Unet)
    } else {
        None
    }
}

fn text_table(params: &HashMap<String, Vec<usize>>) -> Table {
    let mut table = underscored_table(params);
    // LoRA files always say `text_model.` for the encoder layers while a model's map may put top-level weights
    // (`text_projection`) beside it, or drop the prefix altogether; either spelling finds the weight.
    for name in params.keys() {
        let Some(module) = name.strip_suffix(".weight") else { continue };
        let alias = match module.strip_prefix("text_model.") {
            Some(bare) => bare.to_string(),
            None => format!("text_model.{module}"),
        };
        table.entry(underscored(&alias)).or_insert_with(|| name.clone());
    }
    table
}

struct Tables<'a> {
    params: &'a ModelParams,
    unet: Table,
    /// The MMDiT's SAI names (empty for a UNet).
    sai: FusedTable,
    text: Vec<Table>,
}

impl<'a> Tables<'a> {
    fn new(params: &'a ModelParams) -> Self {
        let (unet, sai) = match params.denoiser {
            Denoiser::Unet => (unet_table(&params.unet, params.unet_layers_per_block), FusedTable::new()),
            Denoiser::Mmdit => (underscored_table(&params.unet), sai_table(&params.unet)),
        };
        Tables { params, unet, sai, text: params.text.iter().map(text_table).collect() }
    }

    fn network(&self, network: Network) -> Option<(&'a HashMap<String, Vec<usize>>, &Table)> {
        match network {
            Network::Unet => Some((&self.params.unet, &self.unet)),
            Network::TextEncoder(i) => Some((self.params.text.get(i)?, self.text.get(i)?)),
        }
    }

    /// The parameters `name` refers to, with their shapes and the rows of the module's update each takes: one,
    /// or for a fused SAI layer each weight it holds.
    fn lookup(&self, name: &ModuleName) -> Option<Vec<(String, &'a [usize], Rows)>> {
        let (params, table) = self.network(name.network())?;
        let spelled = match name {
            ModuleName::Kohya { name, .. } => name.clone(),
            ModuleName::Diffusers { path, .. } => {
                let exact = format!("{path}.weight");
                if let Some(shape) = params.get(&exact) {
                    return Some(vec![(exact, shape.as_slice(), Rows::All)]);
                }
                // Dotted LDM/SAI names (ComfyUI's `diffusion_model.input_blocks...`) and prefix variants.
                underscored(path)
            }
        };
        let targets = match table.get(&spelled) {
            Some(target) => vec![(target.clone(), Rows::All)],
            None if name.network() == Network::Unet => self.sai.get(&spelled)?.clone(),
            None => return None,
        };
        targets.into_iter().map(|(t, rows)| Some((t.clone(), params.get(&t)?.as_slice(), rows))).collect()
    }
}

impl LoraFile {
    /// Matches every module of the file to the model weight it changes. Fails on the first module the model has
    /// no layer for ([`LoraError::UnknownModule`]) or whose update has the wrong size ([`LoraError::Shape`]): a
    /// LoRA made for another model family is refused whole rather than applied in part.
    pub fn resolve(&self, params: &ModelParams) -> Result<Vec<Patch>, LoraError> {
        self.resolve_modules(params).map_err(|e| self.family_error(params, e))
    }

    fn resolve_modules(&self, params: &ModelParams) -> Result<Vec<Patch>, LoraError> {
        let tables = Tables::new(params);
        let mut patches = Vec::with_capacity(self.modules.len());
        for (index, module) in self.modules.iter().enumerate() {
            let Some(targets) = tables.lookup(&module.name) else {
                return Err(LoraError::UnknownModule { path: self.path.clone(), key: module.key.clone() });
            };
            let natural = self.natural_shape(module)?;
            for (target, shape, rows) in targets {
                let update = rows.update_shape(shape);
                if !rows.fit(shape) || !fits(&natural, &update) {
                    return Err(LoraError::Shape {
                        path: self.path.clone(),
                        key: module.key.clone(),
                        target,
                        expected: update,
                        got: natural,
                    });
                }
                patches.push(Patch { network: module.name.network(), target, module: index, rows });
            }
        }
        Ok(patches)
    }

    /// A module that does not fit, in a file whose denoiser modules are named for another family than the model's
    /// (an SD1 LoRA on SD3, an SD3 LoRA on SDXL), is reported as that mismatch.
    fn family_error(&self, params: &ModelParams, e: LoraError) -> LoraError {
        if !matches!(e, LoraError::UnknownModule { .. } | LoraError::Shape { .. }) {
            return e;
        }
        let made_for = self.modules.iter().find_map(|m| Some((family_of(&m.name)?, &m.key)));
        match made_for {
            Some((family, key)) if family != params.denoiser => LoraError::Family {
                path: self.path.clone(),
                key: key.clone(),
                lora: family.families(),
                model: params.denoiser.families(),
            },
            _ => e,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{sd1_params, sd3_params, sdxl_params, write_safetensors};

    fn sgm(params: &ModelParams, module: &str) -> Option<String> {
        let table = unet_table(&params.unet, params.unet_layers_per_block);
        table.get(module).cloned()
    }

    #[test]
    fn sdxl_ldm_names_map_to_diffusers() {
        let p = sdxl_params();
        let cases = [
            ("input_blocks_0_0", "conv_in.weight"),
            ("out_2", "conv_out.weight"),
            ("time_embed_0", "time_embedding.linear_1.weight"),
            ("time_embed_2", "time_embedding.linear_2.weight"),
            ("label_emb_0_0", "add_embedding.linear_1.weight"),
            ("label_emb_0_2", "add_embedding.linear_2.weight"),
            ("input_blocks_1_0_in_layers_2", "down_blocks.0.resnets.0.conv1.weight"),
            ("input_blocks_2_0_out_layers_3", "down_blocks.0.resnets.1.conv2.weight"),
            ("input_blocks_2_0_emb_layers_1", "down_blocks.0.resnets.1.time_emb_proj.weight"),
            ("input_blocks_3_0_op", "down_blocks.0.downsamplers.0.conv.weight"),
            ("input_blocks_4_0_skip_connection", "down_blocks.1.resnets.0.conv_shortcut.weight"),
            (
                "input_blocks_4_1_transformer_blocks_0_attn1_to_q",
                "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight",
            ),
            (
                "input_blocks_8_1_transformer_blocks_1_ff_net_0_proj",
                "down_blocks.2.attentions.1.transformer_blocks.1.ff.net.0.proj.weight",
            ),
            ("middle_block_0_in_layers_2", "mid_block.resnets.0.conv1.weight"),
            ("middle_block_1_proj_in", "mid_block.attentions.0.proj_in.weight"),
            ("middle_block_2_out_layers_3", "mid_block.resnets.1.conv2.weight"),
            (
                "output_blocks_0_1_transformer_blocks_0_attn2_to_k",
                "up_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight",
            ),
            ("output_blocks_2_2_conv", "up_blocks.0.upsamplers.0.conv.weight"),
            ("output_blocks_3_0_skip_connection", "up_blocks.1.resnets.0.conv_shortcut.weight"),
            ("output_blocks_5_2_conv", "up_blocks.1.upsamplers.0.conv.weight"),
            ("output_blocks_8_0_in_layers_2", "up_blocks.2.resnets.2.conv1.weight"),
        ];
        for (ldm, diffusers) in cases {
            assert_eq!(sgm(&p, ldm).as_deref(), Some(diffusers), "{ldm}");
        }
        // SDXL's first down block has no attention: nothing may map there.
        assert_eq!(sgm(&p, "input_blocks_1_1_proj_in"), None);
    }

    #[test]
    fn sd1_ldm_names_map_to_diffusers() {
        let p = sd1_params();
        let cases = [
            ("input_blocks_1_1_proj_in", "down_blocks.0.attentions.0.proj_in.weight"),
            ("input_blocks_9_0_op", "down_blocks.2.downsamplers.0.conv.weight"),
            ("input_blocks_10_0_in_layers_2", "down_blocks.3.resnets.0.conv1.weight"),
            // SD1's first up block has no attention, so its upsampler is the block's second sub-module.
            ("output_blocks_2_1_conv", "up_blocks.0.upsamplers.0.conv.weight"),
            ("output_blocks_5_2_conv", "up_blocks.1.upsamplers.0.conv.weight"),
            ("output_blocks_11_1_proj_out", "up_blocks.3.attentions.2.proj_out.weight"),
            ("middle_block_2_in_layers_2", "mid_block.resnets.1.conv1.weight"),
        ];
        for (ldm, diffusers) in cases {
            assert_eq!(sgm(&p, ldm).as_deref(), Some(diffusers), "{ldm}");
        }
    }

    /// A file of plain rank-1 LoRA modules, one per `(key, out, in)`; conv modules get 4-D down weights.
    fn lora_file(dir: &std::path::Path, modules: &[(&str, Vec<usize>, Vec<usize>)]) -> LoraFile {
        let mut tensors = Vec::new();
        for (key, up, down) in modules {
            let kohya = key.starts_with("lora_");
            let (u, d) = if kohya {
                ("lora_up.weight", "lora_down.weight")
            } else {
                ("lora_B.weight", "lora_A.weight")
            };
            tensors.push((format!("{key}.{u}"), up.clone(), vec![0.5; up.iter().product()]));
            tensors.push((format!("{key}.{d}"), down.clone(), vec![0.5; down.iter().product()]));
        }
        let path = dir.join("l.safetensors");
        let refs: Vec<_> = tensors.iter().map(|(k, s, v)| (k.as_str(), s.clone(), v.clone())).collect();
        write_safetensors(&path, &refs, &[]);
        LoraFile::read(&path).unwrap()
    }

    /// Checks the resolved targets, in any order (modules come in the file's key order).
    fn assert_targets(file: &LoraFile, params: &ModelParams, mut want: Vec<(Network, String)>) {
        let patches = file.resolve(params).unwrap();
        assert_eq!(patches.len(), file.modules.len());
        let mut got: Vec<_> = patches.into_iter().map(|p| (p.network, p.target)).collect();
        got.sort();
        want.sort();
        assert_eq!(got, want);
    }

    #[test]
    fn sd1_kohya_diffusers_style_names() {
        let dir = tempfile::tempdir().unwrap();
        let f = lora_file(
            dir.path(),
            &[
                ("lora_unet_down_blocks_0_attentions_0_proj_in", vec![320, 1], vec![1, 320]),
                (
                    "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_out_0",
                    vec![320, 1],
                    vec![1, 320],
                ),
                (
                    "lora_unet_up_blocks_3_attentions_2_transformer_blocks_0_ff_net_0_proj",
                    vec![2560, 1],
                    vec![1, 320],
                ),
                ("lora_unet_down_blocks_1_resnets_0_conv1", vec![640, 1, 1, 1], vec![1, 320, 3, 3]),
                ("lora_unet_mid_block_resnets_1_time_emb_proj", vec![1280, 1], vec![1, 1280]),
                ("lora_te_text_model_encoder_layers_1_self_attn_q_proj", vec![768, 1], vec![1, 768]),
                ("lora_te_text_model_encoder_layers_0_mlp_fc2", vec![768, 1], vec![1, 3072]),
            ],
        );
        assert_targets(
            &f,
            &sd1_params(),
            vec![
                (Network::Unet, "down_blocks.0.attentions.0.proj_in.weight".into()),
                (
                    Network::Unet,
                    "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0.weight".into(),
                ),
                (Network::Unet, "up_blocks.3.attentions.2.transformer_blocks.0.ff.net.0.proj.weight".into()),
                (Network::Unet, "down_blocks.1.resnets.0.conv1.weight".into()),
                (Network::Unet, "mid_block.resnets.1.time_emb_proj.weight".into()),
                (Network::TextEncoder(0), "text_model.encoder.layers.1.self_attn.q_proj.weight".into()),
                (Network::TextEncoder(0), "text_model.encoder.layers.0.mlp.fc2.weight".into()),
            ],
        );
    }

    #[test]
    fn sdxl_kohya_sgm_names_and_both_text_encoders() {
        let dir = tempfile::tempdir().unwrap();
        let f = lora_file(
            dir.path(),
            &[
                ("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q", vec![640, 1], vec![1, 640]),
                ("lora_unet_input_blocks_1_0_in_layers_2", vec![320, 1, 1, 1], vec![1, 320, 3, 3]),
                ("lora_unet_output_blocks_3_0_out_layers_3", vec![640, 1, 1, 1], vec![1, 640, 3, 3]),
                ("lora_unet_input_blocks_7_0_emb_layers_1", vec![1280, 1], vec![1, 1280]),
                ("lora_unet_output_blocks_6_0_skip_connection", vec![320, 1, 1, 1], vec![1, 960, 1, 1]),
                ("lora_unet_input_blocks_6_0_op", vec![640, 1, 1, 1], vec![1, 640, 3, 3]),
                ("lora_unet_output_blocks_2_2_conv", vec![1280, 1, 1, 1], vec![1, 1280, 3, 3]),
                ("lora_unet_label_emb_0_0", vec![1280, 1], vec![1, 2816]),
                ("lora_te1_text_model_encoder_layers_0_self_attn_k_proj", vec![768, 1], vec![1, 768]),
                ("lora_te2_text_model_encoder_layers_1_self_attn_out_proj", vec![1280, 1], vec![1, 1280]),
            ],
        );
        assert_targets(
            &f,
            &sdxl_params(),
            vec![
                (Network::Unet, "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight".into()),
                (Network::Unet, "down_blocks.0.resnets.0.conv1.weight".into()),
                (Network::Unet, "up_blocks.1.resnets.0.conv2.weight".into()),
                (Network::Unet, "down_blocks.2.resnets.0.time_emb_proj.weight".into()),
                (Network::Unet, "up_blocks.2.resnets.0.conv_shortcut.weight".into()),
                (Network::Unet, "down_blocks.1.downsamplers.0.conv.weight".into()),
                (Network::Unet, "up_blocks.0.upsamplers.0.conv.weight".into()),
                (Network::Unet, "add_embedding.linear_1.weight".into()),
                (Network::TextEncoder(0), "text_model.encoder.layers.0.self_attn.k_proj.weight".into()),
                (Network::TextEncoder(1), "text_model.encoder.layers.1.self_attn.out_proj.weight".into()),
            ],
        );
    }

    #[test]
    fn peft_and_diffusers_dotted_names() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.safetensors");
        let t = |k: &'static str, s: Vec<usize>| (k, s.clone(), vec![0.25; s.iter().product()]);
        write_safetensors(
            &path,
            &[
                t("unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.lora_A.weight", vec![2, 2048]),
                t("unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.lora_B.weight", vec![640, 2]),
                t("mid_block.attentions.0.proj_out.lora.down.weight", vec![2, 1280]),
                t("mid_block.attentions.0.proj_out.lora.up.weight", vec![1280, 2]),
                t("unet.up_blocks.0.attentions.1.transformer_blocks.0.attn1.processor.to_out_lora.down.weight", vec![2, 1280]),
                t("unet.up_blocks.0.attentions.1.transformer_blocks.0.attn1.processor.to_out_lora.up.weight", vec![1280, 2]),
                t("unet.up_blocks.0.attentions.1.transformer_blocks.0.attn1.processor.to_q_lora.down.weight", vec![2, 1280]),
                t("unet.up_blocks.0.attentions.1.transformer_blocks.0.attn1.processor.to_q_lora.up.weight", vec![1280, 2]),
                t("text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_linear_layer.down.weight", vec![2, 768]),
                t("text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_linear_layer.up.weight", vec![768, 2]),
                t("text_encoder.text_model.encoder.layers.1.self_attn.to_out_lora.down.weight", vec![2, 768]),
                t("text_encoder.text_model.encoder.layers.1.self_attn.to_out_lora.up.weight", vec![768, 2]),
                t("text_encoder_2.text_model.encoder.layers.1.mlp.fc1.lora_A.weight", vec![2, 1280]),
                t("text_encoder_2.text_model.encoder.layers.1.mlp.fc1.lora_B.weight", vec![5120, 2]),
                t("text_encoder_2.text_projection.lora_A.weight", vec![2, 1280]),
                t("text_encoder_2.text_projection.lora_B.weight", vec![1280, 2]),
            ],
            &[],
        );
        let f = LoraFile::read(&path).unwrap();
        let want: Vec<(Network, String)> = vec![
            (Network::Unet, "down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.weight".into()),
            (Network::Unet, "mid_block.attentions.0.proj_out.weight".into()),
            (Network::Unet, "up_blocks.0.attentions.1.transformer_blocks.0.attn1.to_out.0.weight".into()),
            (Network::Unet, "up_blocks.0.attentions.1.transformer_blocks.0.attn1.to_q.weight".into()),
            (Network::TextEncoder(0), "text_model.encoder.layers.0.self_attn.q_proj.weight".into()),
            (Network::TextEncoder(0), "text_model.encoder.layers.1.self_attn.out_proj.weight".into()),
            (Network::TextEncoder(1), "text_model.encoder.layers.1.mlp.fc1.weight".into()),
            (Network::TextEncoder(1), "text_projection.weight".into()),
        ];
        assert_targets(&f, &sdxl_params(), want);
    }

    #[test]
    fn a_layer_the_model_lacks_is_unknown_module() {
        let dir = tempfile::tempdir().unwrap();
        // SDXL's depth-2 transformer: SD1 has only transformer_blocks.0.
        let f = lora_file(
            dir.path(),
            &[("lora_unet_input_blocks_4_1_transformer_blocks_1_attn1_to_q", vec![640, 1], vec![1, 640])],
        );
        let err = f.resolve(&sd1_params()).unwrap_err();
        assert!(
            matches!(&err, LoraError::UnknownModule { key, .. } if key.contains("transformer_blocks_1")),
            "{err}"
        );
        assert!(err.to_string().contains("does not fit this model"), "{err}");

        let dir = tempfile::tempdir().unwrap();
        let f = lora_file(
            dir.path(),
            &[("lora_te2_text_model_encoder_layers_0_self_attn_q_proj", vec![1280, 1], vec![1, 1280])],
        );
        assert!(matches!(f.resolve(&sd1_params()), Err(LoraError::UnknownModule { .. })));
    }

    #[test]
    fn a_wrong_size_is_a_shape_error() {
        let dir = tempfile::tempdir().unwrap();
        // SDXL's cross-attention reads 2048-wide text; SD1's reads 768.
        let f = lora_file(
            dir.path(),
            &[("lora_unet_input_blocks_4_1_transformer_blocks_0_attn2_to_k", vec![640, 1], vec![1, 2048])],
        );
        let err = f.resolve(&sd1_params()).unwrap_err();
        match &err {
            LoraError::Shape { target, expected, got, .. } => {
                assert_eq!(target, "down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.weight");
                assert_eq!(expected, &vec![640, 768]);
                assert_eq!(got, &vec![640, 2048]);
            }
            other => panic!("{other}"),
        }
        assert!(err.to_string().contains("does not fit this model"), "{err}");
    }

    #[test]
    fn linear_update_on_a_1x1_conv_and_inpainting_conv_in_fit() {
        let dir = tempfile::tempdir().unwrap();
        // SD1's proj_in is a 1×1 conv; LoRAs trained on linear projections still apply (A1111 reshapes).
        let f = lora_file(
            dir.path(),
            &[("lora_unet_down_blocks_0_attentions_0_proj_in", vec![320, 1], vec![1, 320])],
        );
        let mut p = sd1_params();
        assert_eq!(p.unet["down_blocks.0.attentions.0.proj_in.weight"], vec![320, 320, 1, 1]);
        assert_eq!(f.resolve(&p).unwrap().len(), 1);

        let dir = tempfile::tempdir().unwrap();
        let f = lora_file(dir.path(), &[("lora_unet_conv_in", vec![320, 1, 1, 1], vec![1, 4, 3, 3])]);
        p.unet.insert("conv_in.weight".into(), vec![320, 9, 3, 3]);
        assert_eq!(f.resolve(&p).unwrap()[0].target, "conv_in.weight");
    }

    /// Targets with their rows, sorted.
    fn rows_of(file: &LoraFile, params: &ModelParams) -> Vec<(Network, String, Rows)> {
        let mut got: Vec<_> =
            file.resolve(params).unwrap().into_iter().map(|p| (p.network, p.target, p.rows)).collect();
        got.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        got
    }

    fn unet(target: &str, rows: Rows) -> (Network, String, Rows) {
        (Network::Unet, target.to_string(), rows)
    }

    #[test]
    fn sd3_sai_names_split_fused_layers_and_swap_adaln_halves() {
        let dir = tempfile::tempdir().unwrap();
        let f = lora_file(
            dir.path(),
            &[
                ("lora_unet_joint_blocks_0_x_block_attn_qkv", vec![96, 1], vec![1, 32]),
                ("lora_unet_joint_blocks_1_context_block_attn_qkv", vec![96, 1], vec![1, 32]),
                ("lora_unet_joint_blocks_0_x_block_attn2_qkv", vec![96, 1], vec![1, 32]),
                ("lora_unet_joint_blocks_0_x_block_attn2_proj", vec![32, 1], vec![1, 32]),
                ("lora_unet_joint_blocks_0_context_block_attn_proj", vec![32, 1], vec![1, 32]),
                ("lora_unet_joint_blocks_0_context_block_adaLN_modulation_1", vec![192, 1], vec![1, 32]),
                ("lora_unet_joint_blocks_1_context_block_adaLN_modulation_1", vec![64, 1], vec![1, 32]),
                ("lora_unet_joint_blocks_1_x_block_adaLN_modulation_1", vec![192, 1], vec![1, 32]),
                ("lora_unet_joint_blocks_1_x_block_mlp_fc1", vec![128, 1], vec![1, 32]),
                ("lora_unet_joint_blocks_0_context_block_mlp_fc2", vec![32, 1], vec![1, 128]),
                ("lora_unet_final_layer_adaLN_modulation_1", vec![64, 1], vec![1, 32]),
                ("lora_unet_final_layer_linear", vec![64, 1], vec![1, 32]),
                ("lora_unet_x_embedder_proj", vec![32, 1, 1, 1], vec![1, 16, 2, 2]),
                ("lora_unet_t_embedder_mlp_0", vec![32, 1], vec![1, 256]),
                ("lora_unet_y_embedder_mlp_2", vec![32, 1], vec![1, 32]),
                ("lora_unet_context_embedder", vec![32, 1], vec![1, 64]),
                ("lora_te1_text_model_encoder_layers_0_self_attn_q_proj", vec![768, 1], vec![1, 768]),
                ("lora_te2_text_model_encoder_layers_1_mlp_fc1", vec![5120, 1], vec![1, 1280]),
            ],
        );
        let third = |start| Rows::Slice { start, len: 32, of: 96 };
        let b0 = "transformer_blocks.0";
        let b1 = "transformer_blocks.1";
        let mut want = vec![
            unet(&format!("{b0}.attn.to_q.weight"), third(0)),
            unet(&format!("{b0}.attn.to_k.weight"), third(32)),
            unet(&format!("{b0}.attn.to_v.weight"), third(64)),
            unet(&format!("{b1}.attn.add_q_proj.weight"), third(0)),
            unet(&format!("{b1}.attn.add_k_proj.weight"), third(32)),
            unet(&format!("{b1}.attn.add_v_proj.weight"), third(64)),
            unet(&format!("{b0}.attn2.to_q.weight"), third(0)),
            unet(&format!("{b0}.attn2.to_k.weight"), third(32)),
            unet(&format!("{b0}.attn2.to_v.weight"), third(64)),
            unet(&format!("{b0}.attn2.to_out.0.weight"), Rows::All),
            unet(&format!("{b0}.attn.to_add_out.weight"), Rows::All),
            // A block that goes on has AdaLayerNormZero rows in SAI's order; the last one's are swapped.
            unet(&format!("{b0}.norm1_context.linear.weight"), Rows::All),
            unet(&format!("{b1}.norm1_context.linear.weight"), Rows::SwapHalves),
            unet(&format!("{b1}.norm1.linear.weight"), Rows::All),
            unet(&format!("{b1}.ff.net.0.proj.weight"), Rows::All),
            unet(&format!("{b0}.ff_context.net.2.weight"), Rows::All),
            unet("norm_out.linear.weight", Rows::SwapHalves),
            unet("proj_out.weight", Rows::All),
            unet("pos_embed.proj.weight", Rows::All),
            unet("time_text_embed.timestep_embedder.linear_1.weight", Rows::All),
            unet("time_text_embed.text_embedder.linear_2.weight", Rows::All),
            unet("context_embedder.weight", Rows::All),
            (
                Network::TextEncoder(0),
                "text_model.encoder.layers.0.self_attn.q_proj.weight".into(),
                Rows::All,
            ),
            (Network::TextEncoder(1), "text_model.encoder.layers.1.mlp.fc1.weight".into(), Rows::All),
        ];
        want.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        assert_eq!(rows_of(&f, &sd3_params()), want);
    }

    #[test]
    fn sd3_diffusers_onetrainer_and_dotted_sai_names() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.safetensors");
        let t = |k: &'static str, s: Vec<usize>| (k, s.clone(), vec![0.25; s.iter().product()]);
        write_safetensors(
            &path,
            &[
                t("transformer.transformer_blocks.1.attn.add_k_proj.lora_A.weight", vec![2, 32]),
                t("transformer.transformer_blocks.1.attn.add_k_proj.lora_B.weight", vec![32, 2]),
                t("transformer.norm_out.linear.lora_A.weight", vec![2, 32]),
                t("transformer.norm_out.linear.lora_B.weight", vec![64, 2]),
                t(
                    "lora_transformer_transformer_blocks_0_ff_context_net_0_proj.lora_down.weight",
                    vec![2, 32],
                ),
                t("lora_transformer_transformer_blocks_0_ff_context_net_0_proj.lora_up.weight", vec![128, 2]),
                t("diffusion_model.joint_blocks.1.x_block.attn.qkv.lora_down.weight", vec![2, 32]),
                t("diffusion_model.joint_blocks.1.x_block.attn.qkv.lora_up.weight", vec![96, 2]),
                t("base_model.model.transformer_blocks.0.attn2.to_out.0.lora_A.weight", vec![2, 32]),
                t("base_model.model.transformer_blocks.0.attn2.to_out.0.lora_B.weight", vec![32, 2]),
                t("text_encoder_2.text_projection.lora_A.weight", vec![2, 1280]),
                t("text_encoder_2.text_projection.lora_B.weight", vec![1280, 2]),
            ],
            &[],
        );
        let f = LoraFile::read(&path).unwrap();
        let third = |start| Rows::Slice { start, len: 32, of: 96 };
        let mut want = vec![
            // diffusers' own names: the whole update, even where SAI would swap (norm_out).
            unet("transformer_blocks.1.attn.add_k_proj.weight", Rows::All),
            unet("norm_out.linear.weight", Rows::All),
            unet("transformer_blocks.0.ff_context.net.0.proj.weight", Rows::All),
            unet("transformer_blocks.1.attn.to_q.weight", third(0)),
            unet("transformer_blocks.1.attn.to_k.weight", third(32)),
            unet("transformer_blocks.1.attn.to_v.weight", third(64)),
            unet("transformer_blocks.0.attn2.to_out.0.weight", Rows::All),
            (Network::TextEncoder(1), "text_projection.weight".into(), Rows::All),
        ];
        want.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        assert_eq!(rows_of(&f, &sd3_params()), want);
    }

    /// The rows each weight takes of a fused update are the rows diffusers' converter gives it of the fused weight.
    #[test]
    fn fused_and_swapped_updates_are_cut_as_the_converter_cuts_weights() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.safetensors");
        let up: Vec<f32> = (0..96).map(|i| i as f32).collect();
        let up2: Vec<f32> = (0..64).map(|i| 1000.0 + i as f32).collect();
        let down: Vec<f32> = (0..32).map(|j| if j == 0 { 1.0 } else { 0.0 }).collect();
        write_safetensors(
            &path,
            &[
                ("lora_unet_joint_blocks_0_x_block_attn_qkv.lora_up.weight", vec![96, 1], up.clone()),
                ("lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight", vec![1, 32], down.clone()),
                ("lora_unet_joint_blocks_0_x_block_attn_qkv.alpha", vec![], vec![0.5]),
                ("lora_unet_final_layer_adaLN_modulation_1.lora_up.weight", vec![64, 1], up2.clone()),
                ("lora_unet_final_layer_adaLN_modulation_1.lora_down.weight", vec![1, 32], down),
            ],
            &[],
        );
        let f = LoraFile::read(&path).unwrap();
        let params = sd3_params();
        // Column 0 of each delta is the up vector (times alpha/rank); every other column is 0.
        let column = |patch: &Patch| -> Vec<f32> {
            let d = f.delta(patch, &params.unet[&patch.target], &candle_core::Device::Cpu).unwrap();
            assert_eq!(d.dims(), params.unet[&patch.target].as_slice());
            d.narrow(1, 0, 1).unwrap().flatten_all().unwrap().to_vec1().unwrap()
        };
        let patches = f.resolve(&params).unwrap();
        let find = |t: &str| patches.iter().find(|p| p.target == t).unwrap_or_else(|| panic!("{t}"));
        let half: Vec<f32> = up.iter().map(|v| v * 0.5).collect();
        assert_eq!(column(find("transformer_blocks.0.attn.to_q.weight")), half[..32]);
        assert_eq!(column(find("transformer_blocks.0.attn.to_k.weight")), half[32..64]);
        assert_eq!(column(find("transformer_blocks.0.attn.to_v.weight")), half[64..]);
        // SAI's (shift, scale) rows become diffusers' (scale, shift).
        let swapped: Vec<f32> = up2[32..].iter().chain(&up2[..32]).copied().collect();
        assert_eq!(column(find("norm_out.linear.weight")), swapped);
    }

    #[test]
    fn a_lora_of_another_family_is_refused_naming_both() {
        let dir = tempfile::tempdir().unwrap();
        // An SD1 LoRA (text encoder modules fit SD3's CLIP-L; the UNet ones do not).
        let sd1 = lora_file(
            dir.path(),
            &[
                ("lora_te_text_model_encoder_layers_0_self_attn_q_proj", vec![768, 1], vec![1, 768]),
                ("lora_unet_down_blocks_0_attentions_0_proj_in", vec![320, 1], vec![1, 320]),
            ],
        );
        let err = sd1.resolve(&sd3_params()).unwrap_err();
        assert!(
            matches!(&err, LoraError::Family { lora: "SD1.x/SD2.x/SDXL", model: "SD3/SD3.5", .. }),
            "{err}"
        );
        let msg = err.to_string();
        assert!(msg.contains("l.safetensors") && msg.contains("SD3/SD3.5"), "{msg}");

        let dir = tempfile::tempdir().unwrap();
        let sd3 =
            lora_file(dir.path(), &[("lora_unet_joint_blocks_0_x_block_attn_qkv", vec![96, 1], vec![1, 32])]);
        for params in [sd1_params(), sdxl_params()] {
            let err = sd3.resolve(&params).unwrap_err();
            assert!(matches!(&err, LoraError::Family { lora: "SD3/SD3.5", .. }), "{err}");
        }

        // Same family, other sizes (an SD3.5-large LoRA on SD3-medium): a shape error, not a family one.
        let dir = tempfile::tempdir().unwrap();
        let wide = lora_file(
            dir.path(),
            &[("lora_unet_joint_blocks_0_x_block_attn_qkv", vec![144, 1], vec![1, 48])],
        );
        let err = wide.resolve(&sd3_params()).unwrap_err();
        assert!(
            matches!(&err, LoraError::Shape { target, expected, .. }
                if target == "transformer_blocks.0.attn.to_q.weight" && expected == &vec![96, 32]),
            "{err}"
        );
        // SD3's T5 takes no LoRA here: refused by name rather than left out.
        let dir = tempfile::tempdir().unwrap();
        let t5 = lora_file(
            dir.path(),
            &[("lora_te3_encoder_block_0_layer_0_SelfAttention_q", vec![32, 1], vec![1, 32])],
        );
        let err = t5.resolve(&sd3_params()).unwrap_err();
        assert!(
            matches!(&err, LoraError::UnknownModule { key, .. } if key.starts_with("lora_te3_")),
            "{err}"
        );
    }
}
