//! Real-ESRGAN's SRVGGNetCompact (`realesr-general-x4v3`, `realesr-animevideov3`) as spandrel runs it
//! (`architectures/Compact`): `body.0` convolution, then PReLU and convolution pairs (`body.2i+1` slopes,
//! `body.2i` filters), a last convolution to `out·scale²` channels, a pixel shuffle, and the input, upsampled
//! nearest, added back. Features, depth and scale come from the shapes (spandrel's `get_scale_and_output_channels`).

use super::file::Entries;
use super::ops::{self, Builder, Conv, Storage};
use crate::error::UpscaleError;
use candle_core::{Result, Tensor};
use sdhive_models::ops::MapLayout;

pub(crate) const ARCH: &str = "RealESRGAN Compact";

#[derive(Debug, Clone)]
pub(crate) struct Spec {
    num_feat: usize,
    num_conv: usize,
    in_nc: usize,
    out_nc: usize,
    scale: usize,
}

/// spandrel's guess of `(scale, out)` with `scale² · out = x`: the first of `in_nc`, 3, 4, 1 that divides `x` into a
/// square.
fn scale_and_channels(x: usize, in_nc: usize) -> Option<(usize, usize)> {
    [in_nc, 3, 4, 1].into_iter().find_map(|c| {
        let q = (c > 0 && x.is_multiple_of(c)).then_some(x / c)?;
        let r = (q as f64).sqrt().round() as usize;
        (r * r == q).then_some((r, c))
    })
}

pub(crate) fn detect(entries: &Entries) -> std::result::Result<Option<Spec>, String> {
    if !(entries.contains_key("body.0.weight") && entries.contains_key("body.1.weight")) {
        return Ok(None);
    }
    let highest = entries
        .keys()
        .filter_map(|k| k.strip_prefix("body.")?.split('.').next()?.parse::<usize>().ok())
        .max()
        .unwrap_or(0);
    let first = entries.get("body.0.weight").map(|e| &e.shape[..]).unwrap_or_default();
    let [num_feat, in_nc, ..] = first[..] else {
        return Err(format!("`body.0.weight` has shape {first:?}, not a convolution's"));
    };
    let last_bias = entries
        .get(&format!("body.{highest}.bias"))
        .and_then(|e| e.shape.first().copied())
        .ok_or_else(|| format!("no `body.{highest}.bias` (the last convolution's)"))?;
    let (scale, out_nc) = scale_and_channels(last_bias, in_nc).ok_or_else(|| {
        format!("the last convolution's {last_bias} outputs are no scale² × 1, 3 or 4 channels")
    })?;
    Ok(Some(Spec { num_feat, num_conv: highest.saturating_sub(2) / 2, in_nc, out_nc, scale }))
}

impl Spec {
    pub fn scale(&self) -> u32 {
        self.scale as u32
    }

    pub fn channels(&self) -> (usize, usize) {
        (self.in_nc, self.out_nc)
    }

    fn last_index(&self) -> usize {
        2 * self.num_conv + 2
    }

    pub fn expected(&self) -> Vec<(String, Vec<usize>)> {
        let nf = self.num_feat;
        let mut out = Vec::new();
        for i in 0..=self.num_conv {
            let c = if i == 0 { self.in_nc } else { nf };
            out.push((format!("body.{}.weight", 2 * i), vec![nf, c, 3, 3]));
            out.push((format!("body.{}.bias", 2 * i), vec![nf]));
            out.push((format!("body.{}.weight", 2 * i + 1), vec![nf]));
        }
        let k = self.out_nc * self.scale * self.scale;
        out.push((format!("body.{}.weight", self.last_index()), vec![k, nf, 3, 3]));
        out.push((format!("body.{}.bias", self.last_index()), vec![k]));
        out
    }

    pub fn describe(&self) -> String {
        format!("{ARCH} {}nf {}nc ×{}", self.num_feat, self.num_conv, self.scale)
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Net {
    /// Each body convolution with the PReLU slopes after it.
    body: Vec<(Conv, Tensor)>,
    last: Conv,
    layout: MapLayout,
    in_width: usize,
    last_channels: usize,
    scale: usize,
}

impl Net {
    pub fn build(spec: &Spec, build: &Builder<'_>) -> std::result::Result<Self, UpscaleError> {
        let in_width = build.width(spec.in_nc);
        let last_channels = spec.out_nc * spec.scale * spec.scale;
        let conv = |i: usize, storage: Storage| build.conv(&format!("body.{i}"), storage);
        let body = (0..=spec.num_conv)
            .map(|i| -> std::result::Result<(Conv, Tensor), UpscaleError> {
                let storage = Storage { in_channels: (i == 0).then_some(in_width), ..Storage::default() };
                let slope = build.tensor(&format!("body.{}.weight", 2 * i + 1))?;
                Ok((conv(2 * i, storage)?, slope))
            })
            .collect::<std::result::Result<_, _>>()?;
        let out_width = build.width(last_channels);
        let last = conv(spec.last_index(), Storage { out_channels: Some(out_width), ..Storage::default() })?;
        Ok(Self { body, last, layout: build.layout, in_width, last_channels, scale: spec.scale })
    }

    /// spandrel's `SRVGGNetCompact.forward` of an NCHW batch.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (_, _, h, w) = x.dims4()?;
        let layout = self.layout;
        let mut fea = layout.from_nchw_padded(x, self.in_width)?;
        for (conv, slope) in &self.body {
            fea = ops::prelu(&conv.forward(&fea, None)?, slope, layout)?;
        }
        let y = ops::to_nchw_narrow(layout, &self.last.forward(&fea, None)?, self.last_channels)?;
        let y = ops::pixel_shuffle(&y, self.scale)?;
        y + x.upsample_nearest2d(h * self.scale, w * self.scale)?
    }
}
