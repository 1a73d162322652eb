//! Test helpers: safetensors files written byte by byte (with `__metadata__`, which candle's writer cannot add),
//! and synthetic SD1/SDXL/SD3 parameter maps with the real networks' names and shapes, generated from their configs
//! (SD3's at a small width).

use crate::ModelParams;
use std::collections::HashMap;
use std::path::Path;

/// Writes f32 tensors `(key, shape, values)` and metadata as a safetensors file.
pub(crate) fn write_safetensors(
    path: &Path,
    tensors: &[(&str, Vec<usize>, Vec<f32>)],
    metadata: &[(&str, &str)],
) {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        let meta = metadata.iter().map(|(k, v)| (k.to_string(), serde_json::Value::from(*v))).collect();
        header.insert("__metadata__".into(), serde_json::Value::Object(meta));
    }
    let mut data = Vec::new();
    for (key, shape, values) in tensors {
        assert_eq!(shape.iter().product::<usize>(), values.len(), "{key}");
        let start = data.len();
        for v in values {
            data.extend_from_slice(&v.to_le_bytes());
        }
        header.insert(
            key.to_string(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut json = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap();
    // Data starts 8-byte aligned, as the format's own writer pads it.
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&json);
    bytes.extend_from_slice(&data);
    std::fs::write(path, bytes).unwrap();
}

struct UnetConfig {
    channels: &'static [usize],
    /// Transformer depth per down block; 0 = no attention.
    depth: &'static [usize],
    cross: usize,
    linear_proj: bool,
    add_embedding: Option<usize>,
}

fn unet(cfg: &UnetConfig) -> HashMap<String, Vec<usize>> {
    let lpb = 2;
    let mut p = HashMap::new();
    let mut put = |name: String, shape: &[usize]| {
        p.insert(name, shape.to_vec());
    };
    let temb = cfg.channels[0] * 4;
    let c0 = cfg.channels[0];
    put("conv_in.weight".into(), &[c0, 4, 3, 3]);
    put("time_embedding.linear_1.weight".into(), &[temb, c0]);
    put("time_embedding.linear_2.weight".into(), &[temb, temb]);
    if let Some(add) = cfg.add_embedding {
        put("add_embedding.linear_1.weight".into(), &[temb, add]);
        put("add_embedding.linear_2.weight".into(), &[temb, temb]);
    }
    put("conv_norm_out.weight".into(), &[c0]);
    put("conv_out.weight".into(), &[4, c0, 3, 3]);
    let resnet = |put: &mut dyn FnMut(String, &[usize]), pre: String, cin: usize, c: usize| {
        put(format!("{pre}.norm1.weight"), &[cin]);
        put(format!("{pre}.conv1.weight"), &[c, cin, 3, 3]);
        put(format!("{pre}.time_emb_proj.weight"), &[c, temb]);
        put(format!("{pre}.norm2.weight"), &[c]);
        put(format!("{pre}.conv2.weight"), &[c, c, 3, 3]);
        if cin != c {
            put(format!("{pre}.conv_shortcut.weight"), &[c, cin, 1, 1]);
        }
    };
    let attention = |put: &mut dyn FnMut(String, &[usize]), pre: String, c: usize, depth: usize| {
        put(format!("{pre}.norm.weight"), &[c]);
        let proj: &[usize] = if cfg.linear_proj { &[c, c] } else { &[c, c, 1, 1] };
        put(format!("{pre}.proj_in.weight"), proj);
        put(format!("{pre}.proj_out.weight"), proj);
        for t in 0..depth {
            let tb = format!("{pre}.transformer_blocks.{t}");
            for a in ["attn1", "attn2"] {
                let kv = if a == "attn1" { c } else { cfg.cross };
                put(format!("{tb}.{a}.to_q.weight"), &[c, c]);
                put(format!("{tb}.{a}.to_k.weight"), &[c, kv]);
                put(format!("{tb}.{a}.to_v.weight"), &[c, kv]);
                put(format!("{tb}.{a}.to_out.0.weight"), &[c, c]);
            }
            put(format!("{tb}.ff.net.0.proj.weight"), &[8 * c, c]);
            put(format!("{tb}.ff.net.2.weight"), &[c, 4 * c]);
            for n in 1..=3 {
                put(format!("{tb}.norm{n}.weight"), &[c]);
            }
        }
    };
    let n = cfg.channels.len();
    let mut skips = vec![c0];
    let mut cin = c0;
    for (b, &c) in cfg.channels.iter().enumerate() {
        for l in 0..lpb {
            resnet(&mut put, format!("down_blocks.{b}.resnets.{l}"), cin, c);
            if cfg.depth[b] > 0 {
                attention(&mut put, format!("down_blocks.{b}.attentions.{l}"), c, cfg.depth[b]);
            }
            cin = c;
            skips.push(c);
        }
        if b + 1 < n {
            put(format!("down_blocks.{b}.downsamplers.0.conv.weight"), &[c, c, 3, 3]);
            skips.push(c);
        }
    }
    let cm = cfg.channels[n - 1];
    resnet(&mut put, "mid_block.resnets.0".into(), cm, cm);
    attention(&mut put, "mid_block.attentions.0".into(), cm, cfg.depth[n - 1].max(1));
    resnet(&mut put, "mid_block.resnets.1".into(), cm, cm);
    let mut prev = cm;
    for b in 0..n {
        let c = cfg.channels[n - 1 - b];
        let depth = cfg.depth[n - 1 - b];
        for l in 0..=lpb {
            let skip = skips.pop().unwrap_or(c);
            resnet(&mut put, format!("up_blocks.{b}.resnets.{l}"), prev + skip, c);
            if depth > 0 {
                attention(&mut put, format!("up_blocks.{b}.attentions.{l}"), c, depth);
            }
            prev = c;
        }
        if b + 1 < n {
            put(format!("up_blocks.{b}.upsamplers.0.conv.weight"), &[c, c, 3, 3]);
        }
    }
    p
}

fn clip(width: usize, layers: usize, projection: bool) -> HashMap<String, Vec<usize>> {
    let mut p = HashMap::new();
    p.insert("text_model.embeddings.token_embedding.weight".into(), vec![49408, width]);
    p.insert("text_model.embeddings.position_embedding.weight".into(), vec![77, width]);
    for i in 0..layers {
        let l = format!("text_model.encoder.layers.{i}");
        for q in ["q_proj", "k_proj", "v_proj", "out_proj"] {
            p.insert(format!("{l}.self_attn.{q}.weight"), vec![width, width]);
        }
        p.insert(format!("{l}.mlp.fc1.weight"), vec![4 * width, width]);
        p.insert(format!("{l}.mlp.fc2.weight"), vec![width, 4 * width]);
        p.insert(format!("{l}.layer_norm1.weight"), vec![width]);
        p.insert(format!("{l}.layer_norm2.weight"), vec![width]);
    }
    p.insert("text_model.final_layer_norm.weight".into(), vec![width]);
    if projection {
        p.insert("text_projection.weight".into(), vec![width, width]);
    }
    p
}

/// SD1.5's UNet (4 down blocks, attention in the first three, 1×1-conv projections) and CLIP-L (2 layers).
pub(crate) fn sd1_params() -> ModelParams {
    let cfg = UnetConfig {
        channels: &[320, 640, 1280, 1280],
        depth: &[1, 1, 1, 0],
        cross: 768,
        linear_proj: false,
        add_embedding: None,
    };
    ModelParams {
        unet: unet(&cfg),
        text: vec![clip(768, 2, false)],
        unet_layers_per_block: 2,
        unet_down_blocks: 4,
        denoiser: crate::Denoiser::Unet,
    }
}

/// SDXL's UNet (3 down blocks, no attention in the first, depth 2 standing in for 2 and 10) and both encoders.
pub(crate) fn sdxl_params() -> ModelParams {
    let cfg = UnetConfig {
        channels: &[320, 640, 1280],
        depth: &[0, 2, 2],
        cross: 2048,
        linear_proj: true,
        add_embedding: Some(2816),
    };
    ModelParams {
        unet: unet(&cfg),
        text: vec![clip(768, 2, false), clip(1280, 2, true)],
        unet_layers_per_block: 2,
        unet_down_blocks: 3,
        denoiser: crate::Denoiser::Unet,
    }
}

/// An SD3.5-medium-like MMDiT at width 32 (2 blocks: MMDiT-X dual attention in the first, the second the one whose
/// context stream ends there), with SD3's CLIP-L and CLIP-G.
pub(crate) fn sd3_params() -> ModelParams {
    let (d, joint, pooled, patch_out) = (32, 64, 48, 64);
    let mut p: HashMap<String, Vec<usize>> = HashMap::new();
    let mut put = |name: String, shape: &[usize]| {
        p.insert(name, shape.to_vec());
    };
    put("pos_embed.proj.weight".into(), &[d, 16, 2, 2]);
    put("context_embedder.weight".into(), &[d, joint]);
    for (e, width) in [("timestep_embedder", 256), ("text_embedder", pooled)] {
        put(format!("time_text_embed.{e}.linear_1.weight"), &[d, width]);
        put(format!("time_text_embed.{e}.linear_2.weight"), &[d, d]);
    }
    for i in 0..2 {
        let b = format!("transformer_blocks.{i}");
        let (dual, last) = (i == 0, i == 1);
        put(format!("{b}.norm1.linear.weight"), &[if dual { 9 } else { 6 } * d, d]);
        put(format!("{b}.norm1_context.linear.weight"), &[if last { 2 } else { 6 } * d, d]);
        for m in ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0"] {
            put(format!("{b}.attn.{m}.weight"), &[d, d]);
        }
        put(format!("{b}.ff.net.0.proj.weight"), &[4 * d, d]);
        put(format!("{b}.ff.net.2.weight"), &[d, 4 * d]);
        if !last {
            put(format!("{b}.attn.to_add_out.weight"), &[d, d]);
            put(format!("{b}.ff_context.net.0.proj.weight"), &[4 * d, d]);
            put(format!("{b}.ff_context.net.2.weight"), &[d, 4 * d]);
        }
        if dual {
            for m in ["to_q", "to_k", "to_v", "to_out.0"] {
                put(format!("{b}.attn2.{m}.weight"), &[d, d]);
            }
        }
    }
    put("norm_out.linear.weight".into(), &[2 * d, d]);
    put("proj_out.weight".into(), &[patch_out, d]);
    ModelParams {
        unet: p,
        text: vec![clip(768, 2, true), clip(1280, 2, true)],
        unet_layers_per_block: 0,
        unet_down_blocks: 0,
        denoiser: crate::Denoiser::Mmdit,
    }
}
