//! Which model weight a LoRA module changes. LoRA files name layers three ways: kohya's underscored diffusers
//! paths (`lora_unet_down_blocks_0_attentions_0_proj_in`), kohya's underscored original LDM/SGM paths (SDXL and
//! LyCORIS: `lora_unet_input_blocks_1_1_proj_in`), and diffusers/PEFT dotted paths. Rather than parse underscored
//! names (ambiguous: `to_out_0`, `ff_net_0_proj`), every weight the model has is written out in each spelling and
//! looked up; the LDM numbering is derived from the diffusers name and `layers_per_block`, as A1111's
//! `convert_diffusers_name_to_compvis` and diffusers' `_maybe_map_sgm_blocks_to_diffusers` do in reverse.

use crate::delta::fits;
use crate::file::ModuleName;
use crate::{LoraError, LoraFile};
use std::collections::{HashMap, HashSet};

/// The network a weight belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Network {
    Unet,
    /// 0 = `text_encoder` (CLIP-L, or SD2's OpenCLIP-H), 1 = `text_encoder_2` (SDXL's OpenCLIP bigG).
    TextEncoder(usize),
}

/// Every weight of the loaded model, by diffusers parameter name, with its shape.
#[derive(Debug, Clone, Default)]
pub struct ModelParams {
    /// UNet parameter name (`down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight`) → shape.
    pub unet: HashMap<String, Vec<usize>>,
    /// Per text encoder (index as in [`Network::TextEncoder`]): parameter name
    /// (`text_model.encoder.layers.0.self_attn.q_proj.weight`) → shape.
    pub text: Vec<HashMap<String, Vec<usize>>>,
    /// The UNet config's `layers_per_block` (2 for SD1/SD2/SDXL); it fixes the LDM block numbering.
    pub unet_layers_per_block: usize,
    /// Number of UNet down blocks (4 for SD1/SD2, 3 for SDXL).
    pub unet_down_blocks: usize,
}

/// One module of a LoRA file matched to one model weight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Patch {
    pub network: Network,
    /// Full parameter name, ending in `.weight`, as in [`ModelParams`].
    pub target: String,
    /// Index into [`LoraFile::modules`].
    pub module: usize,
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

fn unet_table(params: &HashMap<String, Vec<usize>>, lpb: usize) -> Table {
    let up_with_attention: HashSet<usize> = params
        .keys()
        .filter_map(|k| {
            let rest = k.strip_prefix("up_blocks.")?;
            let (b, rest) = rest.split_once('.')?;
            rest.starts_with("attentions.").then(|| b.parse().ok()).flatten()
        })
        .collect();
    let mut table = Table::new();
    for name in params.keys() {
        let Some(module) = name.strip_suffix(".weight") else { continue };
        table.insert(underscored(module), name.clone());
    }
    for name in params.keys() {
        let Some(module) = name.strip_suffix(".weight") else { continue };
        if let Some(sgm) = sgm_name(module, lpb, &up_with_attention) {
            table.entry(underscored(&sgm)).or_insert_with(|| name.clone());
        }
    }
    table
}

fn text_table(params: &HashMap<String, Vec<usize>>) -> Table {
    let mut table = Table::new();
    for name in params.keys() {
        let Some(module) = name.strip_suffix(".weight") else { continue };
        table.insert(underscored(module), name.clone());
    }
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
    text: Vec<Table>,
}

impl<'a> Tables<'a> {
    fn new(params: &'a ModelParams) -> Self {
        Tables {
            params,
            unet: unet_table(&params.unet, params.unet_layers_per_block),
            text: params.text.iter().map(text_table).collect(),
        }
    }

    fn network(&self, network: Network) -> Option<(&'a HashMap<String, Vec<usize>>, &Table)> {
        match network {
            Network::Unet => Some((&self.params.unet, &self.unet)),
            Network::TextEncoder(i) => Some((self.params.text.get(i)?, self.text.get(i)?)),
        }
    }

    /// The parameter `name` refers to, with its shape.
    fn lookup(&self, name: &ModuleName) -> Option<(String, &'a [usize])> {
        let (params, table) = self.network(name.network())?;
        let target = match name {
            ModuleName::Kohya { name, .. } => table.get(name)?.clone(),
            ModuleName::Diffusers { path, .. } => {
                let exact = format!("{path}.weight");
                if params.contains_key(&exact) {
                    exact
                } else {
                    // Dotted LDM names (ComfyUI's `diffusion_model.input_blocks...`) and prefix variants.
                    table.get(&underscored(path))?.clone()
                }
            }
        };
        let shape = params.get(&target)?;
        Some((target, shape.as_slice()))
    }
}

impl LoraFile {
    /// Matches every module of the file to the model weight it changes. Fails on the first module the model has
    /// no layer for ([`LoraError::UnknownModule`]) or whose update has the wrong size ([`LoraError::Shape`]): a
    /// LoRA made for another model family is refused whole rather than applied in part.
    pub fn resolve(&self, params: &ModelParams) -> Result<Vec<Patch>, LoraError> {
        let tables = Tables::new(params);
        let mut patches = Vec::with_capacity(self.modules.len());
        for (index, module) in self.modules.iter().enumerate() {
            let Some((target, shape)) = tables.lookup(&module.name) else {
                return Err(LoraError::UnknownModule { path: self.path.clone(), key: module.key.clone() });
            };
            let natural = self.natural_shape(module)?;
            if !fits(&natural, shape) {
                return Err(LoraError::Shape {
                    path: self.path.clone(),
                    key: module.key.clone(),
                    target,
                    expected: shape.to_vec(),
                    got: natural,
                });
            }
            patches.push(Patch { network: module.name.network(), target, module: index });
        }
        Ok(patches)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{sd1_params, sdxl_params, write_safetensors};

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
}
