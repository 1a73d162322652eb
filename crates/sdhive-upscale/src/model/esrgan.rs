//! ESRGAN's RRDBNet as spandrel runs it (`architectures/ESRGAN`): recognised from the old ESRGAN keys
//! (`model.0`, `model.1.sub.N.RDBk.convj.0`, the upsampling convolutions at `model.3·i`), BasicSR / Real-ESRGAN's
//! (`conv_first`, `body.N.rdbk.convj`, `conv_body`, `conv_up1`, `conv_hr`, `conv_last`) or BSRGAN's
//! (`RRDB_trunk`, `trunk_conv`, `upconv1`, `HRconv`), with features, blocks, growth channels and ×2 upsamplings
//! read from the shapes; Real-ESRGAN's ×2 and ×1 models (12 or 48 input channels) pixel-unshuffle their input by 2
//! or 4 after a reflect pad to a multiple of that, and crop the output back.

use super::file::Entries;
use super::ops::{self, Builder, Conv, Storage};
use crate::error::UpscaleError;
use candle_core::{Result, Tensor};
use sdhive_models::ops::MapLayout;

pub(crate) const ARCH: &str = "ESRGAN";

/// The tensor names of one file's layout, resolved for its sizes.
#[derive(Debug, Clone)]
struct Names {
    first: String,
    /// `[block][rdb][conv]`.
    rdb: Vec<[[String; 5]; 3]>,
    body: String,
    ups: Vec<String>,
    hr: String,
    last: String,
}

/// An RRDBNet's sizes and names.
#[derive(Debug, Clone)]
pub(crate) struct Spec {
    names: Names,
    nf: usize,
    gc: usize,
    in_nc: usize,
    out_nc: usize,
    /// The pixel-unshuffle factor of the input (1: none).
    shuffle: usize,
}

fn shape<'a>(entries: &'a Entries, name: &str) -> Option<&'a [usize]> {
    entries.get(&format!("{name}.weight")).map(|e| &e.shape[..])
}

/// The largest `N` with a key `{prefix}N.…` plus one (spandrel's `get_seq_len`), 0 without one.
fn seq_len(entries: &Entries, prefix: &str) -> usize {
    entries
        .keys()
        .filter_map(|k| k.strip_prefix(prefix)?.split('.').next()?.parse::<usize>().ok())
        .max()
        .map_or(0, |m| m + 1)
}

/// `Some` when the keys are one of RRDBNet's layouts; `Err` for ones spandrel knows that this build refuses.
pub(crate) fn detect(entries: &Entries) -> std::result::Result<Option<Spec>, String> {
    let has = |k: &str| entries.contains_key(k);
    let old = has("model.0.weight") && has("model.1.sub.0.RDB1.conv1.0.weight");
    let basicsr = has("conv_first.weight")
        && has("body.0.rdb1.conv1.weight")
        && has("conv_body.weight")
        && has("conv_last.weight");
    let bsrgan = has("conv_first.weight")
        && has("RRDB_trunk.0.RDB1.conv1.weight")
        && has("trunk_conv.weight")
        && has("conv_last.weight");
    if has("model.0.weight") && has("model.1.sub.0.RDB1.conv1x1.weight") {
        return Err("ESRGAN+ (the `conv1x1` residual paths) is not supported".into());
    }
    let names = if old {
        // model.0 conv, model.1 trunk, then [upsample, conv, lrelu] per ×2, then hr conv, lrelu, last conv.
        let len = seq_len(entries, "model.");
        let (nb, ups) = (seq_len(entries, "model.1.sub.").saturating_sub(1), len.saturating_sub(5) / 3);
        Names {
            first: "model.0".into(),
            rdb: blocks(nb, |b, k, j| format!("model.1.sub.{b}.RDB{k}.conv{j}.0")),
            body: format!("model.1.sub.{nb}"),
            ups: (1..=ups).map(|i| format!("model.{}", 3 * i)).collect(),
            hr: format!("model.{}", 3 * ups + 2),
            last: format!("model.{}", 3 * ups + 4),
        }
    } else if basicsr || bsrgan {
        let (trunk, rdb, body) =
            if basicsr { ("body.", "rdb", "conv_body") } else { ("RRDB_trunk.", "RDB", "trunk_conv") };
        let nb = seq_len(entries, trunk);
        let up = if has("upconv1.weight") { "upconv" } else { "conv_up" };
        let ups = (1..).take_while(|i| has(&format!("{up}{i}.weight"))).count();
        Names {
            first: "conv_first".into(),
            rdb: blocks(nb, |b, k, j| format!("{trunk}{b}.{rdb}{k}.conv{j}")),
            body: body.into(),
            ups: (1..=ups).map(|i| format!("{up}{i}")).collect(),
            hr: if has("HRconv.weight") { "HRconv".into() } else { "conv_hr".into() },
            last: "conv_last".into(),
        }
    } else {
        return Ok(None);
    };
    let dims = |name: &str, what: &str| -> std::result::Result<&[usize], String> {
        shape(entries, name)
            .filter(|s| s.len() == 4)
            .ok_or_else(|| format!("no 4-D `{name}.weight` ({what})"))
    };
    let first = dims(&names.first, "first convolution")?;
    let (nf, in_nc) = (first[0], first[1]);
    let gc =
        dims(&names.rdb.first().ok_or("no residual-in-residual blocks")?[0][0], "growth convolution")?[0];
    let out_nc = dims(&names.last, "last convolution")?[0];
    // spandrel: a Real-ESRGAN ×2 / ×1 model reads its 3 channels pixel-unshuffled into 12 / 48.
    let shuffle = match in_nc {
        n if n == out_nc * 4 => 2,
        n if n == out_nc * 16 => 4,
        _ => 1,
    };
    if (1usize << names.ups.len()) < shuffle {
        return Err(format!(
            "{} ×2 upsamplings cannot undo an input unshuffled by {shuffle}",
            names.ups.len()
        ));
    }
    Ok(Some(Spec { names, nf, gc, in_nc, out_nc, shuffle }))
}

fn blocks(nb: usize, name: impl Fn(usize, usize, usize) -> String) -> Vec<[[String; 5]; 3]> {
    (0..nb).map(|b| std::array::from_fn(|k| std::array::from_fn(|j| name(b, k + 1, j + 1)))).collect()
}

impl Spec {
    /// The output's size over the input's.
    pub fn scale(&self) -> u32 {
        (1u32 << self.names.ups.len()) / self.shuffle as u32
    }

    /// The image channels read and written.
    pub fn channels(&self) -> (usize, usize) {
        (self.in_nc / (self.shuffle * self.shuffle), self.out_nc)
    }

    /// Every tensor the network reads, with its shape.
    pub fn expected(&self) -> Vec<(String, Vec<usize>)> {
        let (nf, gc) = (self.nf, self.gc);
        let mut convs = vec![(self.names.first.clone(), nf, self.in_nc)];
        for block in &self.names.rdb {
            for rdb in block {
                for (j, name) in rdb.iter().enumerate() {
                    let out = if j == 4 { nf } else { gc };
                    convs.push((name.clone(), out, nf + j * gc));
                }
            }
        }
        convs.push((self.names.body.clone(), nf, nf));
        convs.extend(self.names.ups.iter().map(|n| (n.clone(), nf, nf)));
        convs.push((self.names.hr.clone(), nf, nf));
        convs.push((self.names.last.clone(), self.out_nc, nf));
        convs
            .into_iter()
            .flat_map(|(n, k, c)| [(format!("{n}.weight"), vec![k, c, 3, 3]), (format!("{n}.bias"), vec![k])])
            .collect()
    }

    /// A short description for logs: `ESRGAN 64nf 23nb 32gc ×4`.
    pub fn describe(&self) -> String {
        let unshuffle =
            if self.shuffle > 1 { format!(" (unshuffle {})", self.shuffle) } else { String::new() };
        format!("{ARCH} {}nf {}nb {}gc ×{}{unshuffle}", self.nf, self.names.rdb.len(), self.gc, self.scale())
    }
}

/// The network, built for one device and dtype.
#[derive(Debug, Clone)]
pub(crate) struct Net {
    first: Conv,
    blocks: Vec<[[Conv; 5]; 3]>,
    body: Conv,
    ups: Vec<Conv>,
    hr: Conv,
    last: Conv,
    layout: MapLayout,
    in_width: usize,
    out_nc: usize,
    shuffle: usize,
    scale: usize,
    /// The dense blocks' residual scale lives in their last convolution (channels-last: cuDNN adds the skip in
    /// its epilogue, so `0.2·conv5 + x` costs no extra pass).
    folded: bool,
}

impl Net {
    pub fn build(spec: &Spec, build: &Builder<'_>) -> std::result::Result<Self, UpscaleError> {
        let cl = build.channels_last();
        let in_width = build.width(spec.in_nc);
        let plain = Storage::default();
        let residual = Storage { scale: cl.then_some(0.2), ..plain };
        let blocks = spec
            .names
            .rdb
            .iter()
            .map(|block| -> std::result::Result<[[Conv; 5]; 3], UpscaleError> {
                let rdb = |k: usize| -> std::result::Result<[Conv; 5], UpscaleError> {
                    let n = &block[k];
                    Ok([
                        build.conv(&n[0], plain)?,
                        build.conv(&n[1], plain)?,
                        build.conv(&n[2], plain)?,
                        build.conv(&n[3], plain)?,
                        build.conv(&n[4], residual)?,
                    ])
                };
                Ok([rdb(0)?, rdb(1)?, rdb(2)?])
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(Self {
            first: build.conv(&spec.names.first, Storage { in_channels: Some(in_width), ..plain })?,
            blocks,
            body: build.conv(&spec.names.body, plain)?,
            ups: spec
                .names
                .ups
                .iter()
                .map(|n| build.conv(n, plain))
                .collect::<std::result::Result<_, _>>()?,
            hr: build.conv(&spec.names.hr, plain)?,
            last: build.conv(
                &spec.names.last,
                Storage { out_channels: cl.then(|| build.width(spec.out_nc)), ..plain },
            )?,
            layout: build.layout,
            in_width,
            out_nc: spec.out_nc,
            shuffle: spec.shuffle,
            scale: spec.scale() as usize,
            folded: cl,
        })
    }

    /// The unshuffle factor, whose multiple the input is padded to.
    pub fn shuffle(&self) -> usize {
        self.shuffle
    }

    /// spandrel's `RRDBNet.forward` of an NCHW batch.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (_, _, h, w) = x.dims4()?;
        let x = if self.shuffle > 1 {
            let r = self.shuffle;
            let padded = ops::reflect_pad(x, (r - h % r) % r, (r - w % r) % r)?;
            ops::pixel_unshuffle(&padded, r)?
        } else {
            x.clone()
        };
        let layout = self.layout;
        let fea = self.first.forward(&layout.from_nchw_padded(&x, self.in_width)?, None)?;
        let mut trunk = fea.clone();
        for block in &self.blocks {
            let mut h = trunk.clone();
            for rdb in block {
                h = self.dense_block(rdb, &h)?;
            }
            trunk = ops::scale_add(&h, 0.2, &trunk)?;
        }
        let mut fea = self.body.forward(&trunk, Some(&fea))?;
        drop(trunk);
        for up in &self.ups {
            fea = ops::leaky_relu(&up.forward(&ops::upsample2x(&fea, layout)?, None)?)?;
        }
        let hr = ops::leaky_relu(&self.hr.forward(&fea, None)?)?;
        drop(fea);
        let y = ops::to_nchw_narrow(layout, &self.last.forward(&hr, None)?, self.out_nc)?;
        if self.shuffle > 1 {
            return y.narrow(2, 0, h * self.scale)?.narrow(3, 0, w * self.scale)?.contiguous();
        }
        Ok(y)
    }

    /// `ResidualDenseBlock_5C`: four convolutions each reading every earlier output, LeakyReLU after each, a fifth
    /// back to the block's width, `0.2·x5 + x`.
    fn dense_block(&self, convs: &[Conv; 5], x: &Tensor) -> Result<Tensor> {
        let mut joined = x.clone();
        for conv in &convs[..4] {
            joined = ops::cat_leaky_relu(&joined, &conv.forward(&joined, None)?, self.layout)?;
        }
        if self.folded {
            return convs[4].forward(&joined, Some(x));
        }
        ops::scale_add(&convs[4].forward(&joined, None)?, 0.2, x)
    }
}
