//! TAESD, the tiny distilled autoencoder for SD1/SD2 (`taesd`) and SDXL (`taesdxl`) latents: its decoder as
//! diffusers' `AutoencoderTiny.decode` computes it (`DecoderTiny`: `tanh(z / 3) · 3`, a 3×3 convolution and ReLU,
//! stages of `AutoencoderTinyBlock`s each followed by a nearest ×2 upsample and a bias-free convolution, a last
//! biased convolution, then `2x − 1`), loaded from either layout people have: a diffusers folder or file
//! (`config.json` + `diffusion_pytorch_model.safetensors`, `decoder.layers.N.*`) or madebyollin/taesd's own
//! `taesd_decoder.safetensors` / `taesdxl_decoder.safetensors` (A1111's `models/VAE-taesd/`: taesd.py's
//! `Decoder()` `nn.Sequential`, whose module 0 is the parameter-free clamp, so diffusers' `layers.N` is `N+1`
//! there). Without a `config.json` the architecture is read from the tensors' names and shapes.

use crate::config::read_json;
use crate::error::{check_latent, invalid, weights_err, ModelError, Result, TensorContext};
use crate::graphed::{Graphs, Refresh};
use crate::layers::{conv2d, Conv2d, EdgeConv};
use crate::loading::{find_weight_files, open_safetensors};
use crate::ops::{self, ConvExtras, MapLayout};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const MODEL: &str = "taesd";

/// `config.json` of an `AutoencoderTiny`, with diffusers' defaults (those of madebyollin/taesd and taesdxl).
/// Only the decoder's fields are used; `latent_magnitude` and `latent_shift` belong to diffusers' quantisation
/// of latents into bytes (`scale_latents`), which decoding never applies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AutoencoderTinyConfig {
    pub out_channels: usize,
    pub decoder_block_out_channels: Vec<usize>,
    pub num_decoder_blocks: Vec<usize>,
    pub act_fn: String,
    pub upsample_fn: String,
    pub latent_channels: usize,
    pub upsampling_scaling_factor: usize,
    pub latent_magnitude: f64,
    pub latent_shift: f64,
    /// A pipeline decodes `latents / scaling_factor` (1.0 for TAESD: it reads the UNet's latents as they are).
    pub scaling_factor: f64,
    pub shift_factor: Option<f64>,
}

impl Default for AutoencoderTinyConfig {
    fn default() -> Self {
        AutoencoderTinyConfig {
            out_channels: 3,
            decoder_block_out_channels: vec![64; 4],
            num_decoder_blocks: vec![3, 3, 3, 1],
            act_fn: "relu".into(),
            upsample_fn: "nearest".into(),
            latent_channels: 4,
            upsampling_scaling_factor: 2,
            latent_magnitude: 3.0,
            latent_shift: 0.5,
            scaling_factor: 1.0,
            shift_factor: Some(0.0),
        }
    }
}

impl AutoencoderTinyConfig {
    /// Checks what diffusers' `DecoderTiny` would build (or fail to run) from this config.
    pub fn validate(&self, origin: &str) -> Result<()> {
        let n = self.decoder_block_out_channels.len();
        if n == 0 {
            return Err(invalid(origin, "decoder_block_out_channels", "is empty"));
        }
        if self.num_decoder_blocks.len() != n {
            return Err(invalid(
                origin,
                "num_decoder_blocks",
                format!("has {} entries, decoder_block_out_channels has {n}", self.num_decoder_blocks.len()),
            ));
        }
        let width = self.decoder_block_out_channels[0];
        if width == 0 || self.decoder_block_out_channels.iter().any(|&c| c != width) {
            // Each stage's closing convolution keeps its width, so the next stage's blocks read that width:
            // diffusers builds such a decoder but cannot run it.
            return Err(invalid(
                origin,
                "decoder_block_out_channels",
                format!("{:?}: every stage must have the same width", self.decoder_block_out_channels),
            ));
        }
        if self.latent_channels == 0 || self.out_channels == 0 {
            return Err(invalid(origin, "latent_channels", "latent and output channels must be at least 1"));
        }
        if self.act_fn != "relu" {
            return Err(invalid(origin, "act_fn", format!("`{}` is not supported (only relu)", self.act_fn)));
        }
        if self.upsample_fn != "nearest" {
            return Err(invalid(
                origin,
                "upsample_fn",
                format!("`{}` is not supported (only nearest)", self.upsample_fn),
            ));
        }
        if self.upsampling_scaling_factor == 0 {
            return Err(invalid(origin, "upsampling_scaling_factor", "must be at least 1"));
        }
        if !self.scaling_factor.is_finite() || self.scaling_factor == 0.0 {
            return Err(invalid(origin, "scaling_factor", "must be a non-zero number"));
        }
        Ok(())
    }

    /// Reads and validates an `AutoencoderTiny` `config.json` (another class's config is refused).
    pub fn from_file(path: &Path) -> Result<Self> {
        let origin = path.display().to_string();
        let value: serde_json::Value = read_json(path)?;
        if let Some(class) = value.get("_class_name").and_then(|c| c.as_str()) {
            if class != "AutoencoderTiny" {
                return Err(invalid(&origin, "_class_name", format!("`{class}` is not AutoencoderTiny")));
            }
        }
        let cfg: Self = serde_json::from_value(value)
            .map_err(|source| ModelError::ConfigParse { path: path.to_path_buf(), source })?;
        cfg.validate(&origin)?;
        Ok(cfg)
    }

    /// Pixels per latent along each side.
    pub fn upscale(&self) -> usize {
        self.upsampling_scaling_factor.pow(self.decoder_block_out_channels.len().saturating_sub(1) as u32)
    }
}

/// Which naming a TAESD decoder's weights use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaesdLayout {
    /// diffusers' `AutoencoderTiny`: `decoder.layers.N.*` (beside the encoder's tensors, if any).
    Diffusers,
    /// madebyollin/taesd's `taesd.py` `Decoder()`: `N.*`, one more than diffusers' `N`.
    Original,
}

impl TaesdLayout {
    /// Where diffusers' `decoder.layers.0` is in this layout.
    fn prefix_and_offset(self) -> (&'static str, usize) {
        match self {
            TaesdLayout::Diffusers => ("decoder.layers.", 0),
            TaesdLayout::Original => ("", 1),
        }
    }

    /// The layout of a file whose tensors have these names; `None` when it is neither.
    pub fn detect<'a>(names: impl IntoIterator<Item = &'a str>) -> Option<Self> {
        let mut original = false;
        for name in names {
            if name.starts_with("decoder.layers.") {
                return Some(TaesdLayout::Diffusers);
            }
            original |= name.split_once('.').is_some_and(|(head, _)| head.parse::<usize>().is_ok());
        }
        original.then_some(TaesdLayout::Original)
    }
}

/// What sits at one index of the decoder's `nn.Sequential`, as its tensors say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Module {
    Conv { in_c: usize, out_c: usize, bias: bool },
    Block { width: usize },
}

/// The decoder's architecture from its tensors' names and shapes (a file without `config.json`: A1111's
/// `taesd_decoder.safetensors`, or a lone diffusers weights file).
pub fn infer_config<'a>(
    tensors: impl IntoIterator<Item = (&'a str, &'a [usize])>,
    layout: TaesdLayout,
    origin: &str,
) -> Result<AutoencoderTinyConfig> {
    let (prefix, offset) = layout.prefix_and_offset();
    let bad = |reason: String| invalid(origin, "tensors", reason);
    let mut weights: BTreeMap<usize, BTreeMap<String, Vec<usize>>> = BTreeMap::new();
    for (name, shape) in tensors {
        let Some(rest) = name.strip_prefix(prefix) else { continue };
        let Some((index, param)) = rest.split_once('.') else { continue };
        let Ok(index) = index.parse::<usize>() else { continue };
        if index < offset {
            // taesd.py's encoder starts with its first convolution at 0, where the decoder has its clamp.
            return Err(bad(format!(
                "`{name}`: module {index} has weights, which a TAESD decoder's clamp has not (an encoder file?)"
            )));
        }
        weights.entry(index - offset).or_default().insert(param.to_string(), shape.to_vec());
    }
    let module = |index: usize| -> Result<Option<Module>> {
        let Some(params) = weights.get(&index) else { return Ok(None) };
        let dims = |key: &str| params.get(key).map(Vec::as_slice);
        let shown = format!("{prefix}{}", index + offset);
        match (dims("weight"), dims("conv.0.weight")) {
            (Some(&[out_c, in_c, 3, 3]), None) => {
                Ok(Some(Module::Conv { in_c, out_c, bias: params.contains_key("bias") }))
            }
            (None, Some(&[width, in_c, 3, 3])) if width == in_c => {
                if params.keys().any(|k| k.starts_with("skip.")) {
                    return Err(bad(format!(
                        "`{shown}` is a block with a skip convolution, which TAESD has not"
                    )));
                }
                Ok(Some(Module::Block { width }))
            }
            _ => Err(bad(format!(
                "`{shown}.*` ({}) is neither a 3×3 convolution nor a TAESD block",
                params.keys().cloned().collect::<Vec<_>>().join(", ")
            ))),
        }
    };
    let Some(Module::Conv { in_c: latent_channels, out_c: width, bias: true }) = module(0)? else {
        return Err(bad(format!(
            "no first convolution `{prefix}{offset}.weight` with a bias: not a TAESD decoder"
        )));
    };
    let mut cfg = AutoencoderTinyConfig {
        latent_channels,
        decoder_block_out_channels: Vec::new(),
        num_decoder_blocks: Vec::new(),
        ..AutoencoderTinyConfig::default()
    };
    // Module 1 is the first ReLU; then each stage's blocks and, between stages, the upsample (no weights) and a
    // bias-free convolution; the last stage ends in the biased output convolution.
    let mut index = 2;
    let mut blocks = 0;
    loop {
        match module(index)? {
            Some(Module::Block { width: w }) if w == width => {
                blocks += 1;
                index += 1;
            }
            Some(Module::Conv { in_c, out_c, bias: true }) if in_c == width => {
                cfg.decoder_block_out_channels.push(width);
                cfg.num_decoder_blocks.push(blocks);
                cfg.out_channels = out_c;
                break;
            }
            None => match module(index + 1)? {
                Some(Module::Conv { in_c, out_c, bias: false }) if in_c == width && out_c == width => {
                    cfg.decoder_block_out_channels.push(width);
                    cfg.num_decoder_blocks.push(blocks);
                    blocks = 0;
                    index += 2;
                }
                _ => {
                    return Err(bad(format!(
                        "module {} is missing: expected a block, the output convolution, or an upsample \
                         followed by a bias-free {width}-channel convolution",
                        index + offset
                    )))
                }
            },
            Some(other) => {
                return Err(bad(format!(
                    "module {} ({other:?}) does not continue a TAESD decoder of width {width}",
                    index + offset
                )))
            }
        }
    }
    if let Some(extra) = weights.keys().find(|&&i| i > index) {
        return Err(bad(format!("module {} comes after the output convolution", extra + offset)));
    }
    cfg.validate(origin)?;
    Ok(cfg)
}

/// An `AutoencoderTinyBlock`: three 3×3 convolutions with ReLUs between, the input added, a ReLU.
#[derive(Debug, Clone)]
struct TinyBlock {
    convs: [Conv2d; 3],
}

impl TinyBlock {
    fn new(vb: VarBuilder, width: usize) -> candle_core::Result<Self> {
        let conv = |i: usize| conv2d(vb.pp(format!("conv.{i}")), width, width, 3, 1, 1);
        Ok(TinyBlock { convs: [conv(0)?, conv(2)?, conv(4)?] })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let [a, b, c] = &self.convs;
        let h = ops::conv2d(a, x, ConvExtras::default())?.relu()?;
        let h = ops::conv2d(b, &h, ConvExtras::default())?.relu()?;
        ops::conv2d(c, &h, ConvExtras { residual: Some(x), ..Default::default() })?.relu()
    }
}

#[derive(Debug, Clone)]
struct Stage {
    blocks: Vec<TinyBlock>,
    /// Every stage but the last: the bias-free convolution after the upsample.
    up: Option<Conv2d>,
}

/// The TAESD decoder (diffusers' `DecoderTiny` inside `AutoencoderTiny`).
#[derive(Debug, Clone)]
pub struct TaesdDecoder {
    conv_in: EdgeConv,
    stages: Vec<Stage>,
    conv_out: EdgeConv,
    config: AutoencoderTinyConfig,
    layout: MapLayout,
    dtype: DType,
    device: Device,
    /// Its decodes replayed from CUDA graphs: otherwise its ~45 small launches leave the device waiting on the
    /// host, so a preview's device time would be the host's.
    graphs: Graphs<1>,
}

impl TaesdDecoder {
    /// Builds the decoder from `vb` (the file's root) in `layout`'s names.
    pub fn new(vb: VarBuilder, cfg: &AutoencoderTinyConfig, layout: TaesdLayout) -> Result<Self> {
        cfg.validate("taesd config")?;
        let (prefix, offset) = layout.prefix_and_offset();
        let root = match prefix.strip_suffix('.') {
            Some(p) => vb.pp(p),
            None => vb.clone(),
        };
        let at = |index: usize| root.pp((index + offset).to_string());
        let width = cfg.decoder_block_out_channels[0];
        let build = || -> candle_core::Result<Self> {
            let map_layout = MapLayout::of(&vb);
            let conv_in = EdgeConv::first(at(0), cfg.latent_channels, width, 3, 1)?;
            let mut stages = Vec::with_capacity(cfg.num_decoder_blocks.len());
            let mut index = 2;
            let mut conv_out = None;
            for (i, &n) in cfg.num_decoder_blocks.iter().enumerate() {
                let blocks =
                    (0..n).map(|j| TinyBlock::new(at(index + j), width)).collect::<Result<Vec<_>, _>>()?;
                index += n;
                let up = if i + 1 < cfg.num_decoder_blocks.len() {
                    // Module `index` is the upsample; the convolution after it has no bias.
                    let filter = at(index + 1).get((width, width, 3, 3), "weight")?;
                    index += 2;
                    Some(Conv2d::new(filter, None, 1, 1, map_layout)?)
                } else {
                    conv_out = Some(EdgeConv::last(at(index), width, cfg.out_channels, 3, 1)?);
                    None
                };
                stages.push(Stage { blocks, up });
            }
            let conv_out = conv_out.ok_or_else(|| candle_core::Error::Msg("taesd: no stages".into()))?;
            Ok(TaesdDecoder {
                conv_in,
                stages,
                conv_out,
                config: cfg.clone(),
                layout: map_layout,
                dtype: vb.dtype(),
                device: vb.device().clone(),
                graphs: Graphs::new(MODEL, [Refresh::Always]),
            })
        };
        build().map_err(weights_err(MODEL))
    }

    /// Loads a decoder from `path`: a diffusers folder (`config.json` and its weights), or one `.safetensors`
    /// file in either layout (architecture read from its tensors).
    pub fn load(path: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let (files, config) = if path.is_dir() {
            let config = path.join("config.json");
            let config = config.is_file().then(|| AutoencoderTinyConfig::from_file(&config)).transpose()?;
            (find_weight_files(path)?, config)
        } else {
            (vec![path.to_path_buf()], None)
        };
        let origin = files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", ");
        let tensors = tensor_shapes(&files)?;
        let names = tensors.iter().map(|(n, _)| n.as_str());
        let layout = TaesdLayout::detect(names).ok_or_else(|| {
            invalid(
                &origin,
                "tensors",
                "neither diffusers' `decoder.layers.N.*` nor taesd.py's `N.*` names: not a TAESD decoder",
            )
        })?;
        let config = match config {
            Some(c) => c,
            None => infer_config(tensors.iter().map(|(n, s)| (n.as_str(), s.as_slice())), layout, &origin)?,
        };
        let vb = open_safetensors(&files, dtype, device)?;
        Self::new(vb, &config, layout).map_err(|e| e.with_weight_origin(&origin))
    }

    pub fn config(&self) -> &AutoencoderTinyConfig {
        &self.config
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// `AutoencoderTiny.decode(z).sample`: latents `(B, latent_channels, h, w)` (already divided by
    /// `scaling_factor`, as the pipeline does) to images `(B, out_channels, h·f, w·f)` in about [-1, 1], not
    /// clamped; in the decoder's dtype.
    pub fn decode(&self, z: &Tensor) -> Result<Tensor> {
        check_latent(MODEL, z, self.config.latent_channels)?;
        let run = || -> candle_core::Result<Tensor> {
            let z = z.to_device(&self.device)?.to_dtype(self.dtype)?.contiguous()?;
            if sdhive_cuda_kernels::graphs_on(&self.device) {
                return self.graphs.run([&z], |[z]| self.forward(z));
            }
            self.forward(&z)
        };
        let out = run().ctx(MODEL);
        crate::cpu::release_scratch();
        out
    }

    /// The decoder on contiguous latents in its dtype and device.
    fn forward(&self, z: &Tensor) -> candle_core::Result<Tensor> {
        let z = ((z / 3.0)?.tanh()? * 3.0)?;
        let mut x = self.conv_in.forward(&z)?.relu()?;
        for stage in &self.stages {
            for block in &stage.blocks {
                x = block.forward(&x)?;
            }
            if let Some(up) = &stage.up {
                x = self.upsample_conv(up, &x)?;
            }
        }
        self.conv_out.forward(&x)?.affine(2.0, -1.0)
    }

    /// `nn.Upsample(scale_factor, mode="nearest")` then `up`.
    fn upsample_conv(&self, up: &Conv2d, x: &Tensor) -> candle_core::Result<Tensor> {
        let factor = self.config.upsampling_scaling_factor;
        if factor == 2 {
            // The convolution reads its input as if upsampled where it can (CPU); nothing 4× larger is built.
            return ops::conv2d(up, x, ConvExtras { upsample: true, ..Default::default() });
        }
        let (_, _, h, w) = self.layout.dims(x)?;
        let big = self.layout.to_nchw(x)?.upsample_nearest2d(h * factor, w * factor)?;
        ops::conv2d(up, &self.layout.from_nchw(&big)?, ConvExtras::default())
    }
}

/// Every tensor's name and shape in `files`, from their headers.
fn tensor_shapes(files: &[PathBuf]) -> Result<Vec<(String, Vec<usize>)>> {
    let mut out = Vec::new();
    for f in files {
        // SAFETY: as in `loading::open_safetensors`; only the header is read here.
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(f) }.map_err(|source| {
            ModelError::WeightsOpen { path: f.clone(), source: crate::error::strip_backtrace(source) }
        })?;
        out.extend(st.tensors().into_iter().map(|(name, view)| (name, view.shape().to_vec())));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tensors of a decoder of `cfg` in `layout`, as `save_pretrained` or taesd.py would write them.
    fn tensors_of(cfg: &AutoencoderTinyConfig, layout: TaesdLayout) -> Vec<(String, Vec<usize>)> {
        let (prefix, offset) = layout.prefix_and_offset();
        let w = cfg.decoder_block_out_channels[0];
        let name = |i: usize, p: &str| format!("{prefix}{}.{p}", i + offset);
        let mut out =
            vec![(name(0, "weight"), vec![w, cfg.latent_channels, 3, 3]), (name(0, "bias"), vec![w])];
        let mut index = 2;
        for (s, &n) in cfg.num_decoder_blocks.iter().enumerate() {
            for _ in 0..n {
                for c in [0, 2, 4] {
                    out.push((name(index, &format!("conv.{c}.weight")), vec![w, w, 3, 3]));
                    out.push((name(index, &format!("conv.{c}.bias")), vec![w]));
                }
                index += 1;
            }
            if s + 1 < cfg.num_decoder_blocks.len() {
                out.push((name(index + 1, "weight"), vec![w, w, 3, 3]));
                index += 2;
            } else {
                out.push((name(index, "weight"), vec![cfg.out_channels, w, 3, 3]));
                out.push((name(index, "bias"), vec![cfg.out_channels]));
            }
        }
        out
    }

    fn infer(tensors: &[(String, Vec<usize>)], layout: TaesdLayout) -> Result<AutoencoderTinyConfig> {
        infer_config(tensors.iter().map(|(n, s)| (n.as_str(), s.as_slice())), layout, "test")
    }

    #[test]
    fn the_released_decoders_shapes_give_the_default_config_in_both_layouts() {
        let cfg = AutoencoderTinyConfig::default();
        for layout in [TaesdLayout::Diffusers, TaesdLayout::Original] {
            let tensors = tensors_of(&cfg, layout);
            assert_eq!(TaesdLayout::detect(tensors.iter().map(|(n, _)| n.as_str())), Some(layout));
            assert_eq!(infer(&tensors, layout).expect("inferred"), cfg, "{layout:?}");
        }
        // Diffusers' single file also holds the encoder; it is ignored.
        let mut full = tensors_of(&cfg, TaesdLayout::Diffusers);
        full.push(("encoder.layers.0.weight".into(), vec![64, 3, 3, 3]));
        assert_eq!(infer(&full, TaesdLayout::Diffusers).expect("inferred"), cfg);
    }

    #[test]
    fn other_architectures_are_read_from_the_shapes() {
        let cfg = AutoencoderTinyConfig {
            decoder_block_out_channels: vec![8; 3],
            num_decoder_blocks: vec![0, 2, 1],
            latent_channels: 16,
            ..AutoencoderTinyConfig::default()
        };
        assert_eq!(infer(&tensors_of(&cfg, TaesdLayout::Original), TaesdLayout::Original).expect("ok"), cfg);
    }

    #[test]
    fn files_that_are_not_taesd_decoders_are_refused_with_the_reason() {
        // taesd.py's encoder: its first convolution is module 0.
        let encoder = vec![("0.weight".to_string(), vec![64, 3, 3, 3]), ("0.bias".to_string(), vec![64])];
        let err = infer(&encoder, TaesdLayout::Original).unwrap_err().to_string();
        assert!(err.contains("encoder"), "{err}");
        // A decoder cut short: the upsample's convolution is missing.
        let cfg = AutoencoderTinyConfig::default();
        let mut cut = tensors_of(&cfg, TaesdLayout::Original);
        cut.retain(|(n, _)| !n.starts_with("7."));
        let err = infer(&cut, TaesdLayout::Original).unwrap_err().to_string();
        assert!(err.contains("module 6"), "{err}");
        assert_eq!(TaesdLayout::detect(["first_stage_model.decoder.conv_in.weight"]), None);
        let err = AutoencoderTinyConfig { act_fn: "silu".into(), ..cfg.clone() }.validate("c").unwrap_err();
        assert!(err.to_string().contains("act_fn"), "{err}");
        let uneven = AutoencoderTinyConfig { decoder_block_out_channels: vec![64, 32, 64, 64], ..cfg };
        assert!(uneven.validate("c").unwrap_err().to_string().contains("decoder_block_out_channels"));
    }
}
