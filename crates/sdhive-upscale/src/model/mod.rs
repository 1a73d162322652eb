//! Model upscalers from `.safetensors` files: the architecture recognised from the tensor names and shapes as
//! spandrel recognises it (ESRGAN's RRDBNet in its key layouts, Real-ESRGAN's SRVGGNetCompact), every tensor checked
//! against what that architecture reads, and A1111's image path around the network (`upscaler_utils`: RGB flipped to
//! BGR, `/255` in double precision then the model's dtype, the output clamped to [0, 1], `×255` in single precision,
//! rounded half to even, flipped back), whole or in A1111's overlapping tiles.

mod compact;
mod esrgan;
mod file;
mod ops;

use crate::error::UpscaleError;
use crate::grid::{upscale_tiled, Tile};
use candle_core::{DType, Device, Tensor};
use sdhive_engine::RgbImage;
use std::path::{Path, PathBuf};

/// The architectures this crate runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    /// ESRGAN's RRDBNet (ESRGAN, BSRGAN, Real-ESRGAN ×4/×2/×1 and the community models trained on it).
    Esrgan,
    /// Real-ESRGAN's SRVGGNetCompact.
    Compact,
}

impl Arch {
    /// spandrel's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Esrgan => esrgan::ARCH,
            Arch::Compact => compact::ARCH,
        }
    }
}

/// What a file holds, from its header alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelInfo {
    pub arch: Arch,
    /// Output size over input size.
    pub scale: u32,
}

#[derive(Debug, Clone)]
enum Spec {
    Esrgan(esrgan::Spec),
    Compact(compact::Spec),
}

impl Spec {
    fn arch(&self) -> Arch {
        match self {
            Spec::Esrgan(_) => Arch::Esrgan,
            Spec::Compact(_) => Arch::Compact,
        }
    }

    fn scale(&self) -> u32 {
        match self {
            Spec::Esrgan(s) => s.scale(),
            Spec::Compact(s) => s.scale(),
        }
    }

    fn expected(&self) -> Vec<(String, Vec<usize>)> {
        match self {
            Spec::Esrgan(s) => s.expected(),
            Spec::Compact(s) => s.expected(),
        }
    }

    fn channels(&self) -> (usize, usize) {
        match self {
            Spec::Esrgan(s) => s.channels(),
            Spec::Compact(s) => s.channels(),
        }
    }

    fn describe(&self) -> String {
        match self {
            Spec::Esrgan(s) => s.describe(),
            Spec::Compact(s) => s.describe(),
        }
    }
}

/// The architecture of `entries`, its tensors all checked: none missing, none of another shape, none left over.
fn recognise(path: &Path, entries: &file::Entries) -> Result<Spec, UpscaleError> {
    let unknown = |reason: String| UpscaleError::UnknownArchitecture { path: path.to_path_buf(), reason };
    let unsupported = |arch: &'static str| {
        move |reason: String| UpscaleError::Unsupported { path: path.to_path_buf(), arch, reason }
    };
    let spec = if let Some(s) = esrgan::detect(entries).map_err(unsupported(esrgan::ARCH))? {
        Spec::Esrgan(s)
    } else if let Some(s) = compact::detect(entries).map_err(unsupported(compact::ARCH))? {
        Spec::Compact(s)
    } else {
        let some: Vec<&str> = entries.values().take(4).map(|e| e.file_name.as_str()).collect();
        return Err(unknown(format!("{} tensors, none of their key sets (first: {some:?})", entries.len())));
    };
    let arch = spec.arch().name();
    let tensor = |name: &str, problem: String| UpscaleError::Tensor {
        path: path.to_path_buf(),
        arch,
        tensor: entries.get(name).map_or(name, |e| e.file_name.as_str()).to_string(),
        problem,
    };
    let expected = spec.expected();
    for (name, shape) in &expected {
        match entries.get(name) {
            None => return Err(tensor(name, format!("is missing (a {})", spec.describe()))),
            Some(e) if &e.shape != shape => {
                return Err(tensor(
                    name,
                    format!("has shape {:?}; a {} needs {shape:?}", e.shape, spec.describe()),
                ))
            }
            Some(_) => {}
        }
    }
    if expected.len() != entries.len() {
        let known: std::collections::HashSet<&str> = expected.iter().map(|(n, _)| n.as_str()).collect();
        if let Some(extra) = entries.keys().find(|k| !known.contains(k.as_str())) {
            return Err(tensor(extra, format!("is not part of a {} (unexpected tensor)", spec.describe())));
        }
    }
    if spec.channels() != (3, 3) {
        return Err(unsupported(arch)(format!(
            "{:?} image channels in and out; A1111 upscales RGB (3 and 3)",
            spec.channels()
        )));
    }
    if spec.scale() == 0 {
        return Err(unsupported(arch)("the output is smaller than the input".into()));
    }
    Ok(spec)
}

#[derive(Debug, Clone)]
enum Net {
    Esrgan(esrgan::Net),
    Compact(compact::Net),
}

/// An upscaler loaded onto a device.
#[derive(Debug, Clone)]
pub struct UpscaleModel {
    net: Net,
    info: ModelInfo,
    description: String,
    path: PathBuf,
    device: Device,
    dtype: DType,
}

impl UpscaleModel {
    /// The architecture and scale of `path` from its safetensors header, without reading the weights (for listing
    /// a folder of upscalers). Every tensor's name and shape is checked as [`UpscaleModel::load`] checks them.
    pub fn inspect(path: impl AsRef<Path>) -> Result<ModelInfo, UpscaleError> {
        let path = path.as_ref();
        let (entries, _) = file::read_header(path)?;
        let spec = recognise(path, &entries)?;
        Ok(ModelInfo { arch: spec.arch(), scale: spec.scale() })
    }

    /// Loads `path` (`.safetensors`; pickled `.pth` / `.pt` / `.ckpt` are refused with how to convert them) onto
    /// `device` in `dtype`. On a CUDA device in f16/bf16 with cuDNN the network keeps its maps channels-last.
    pub fn load(path: impl AsRef<Path>, device: &Device, dtype: DType) -> Result<Self, UpscaleError> {
        let path = path.as_ref();
        let (entries, data) = file::read_file(path)?;
        let spec = recognise(path, &entries)?;
        let weights = file::Weights {
            path: path.to_path_buf(),
            arch: spec.arch().name(),
            entries: &entries,
            data: &data,
        };
        let build = ops::Builder::new(&weights, device, dtype);
        let net = match &spec {
            Spec::Esrgan(s) => Net::Esrgan(esrgan::Net::build(s, &build)?),
            Spec::Compact(s) => Net::Compact(compact::Net::build(s, &build)?),
        };
        Ok(Self {
            net,
            info: ModelInfo { arch: spec.arch(), scale: spec.scale() },
            description: spec.describe(),
            path: path.to_path_buf(),
            device: device.clone(),
            dtype,
        })
    }

    pub fn scale(&self) -> u32 {
        self.info.scale
    }

    pub fn arch_name(&self) -> &'static str {
        self.info.arch.name()
    }

    pub fn info(&self) -> ModelInfo {
        self.info
    }

    /// `ESRGAN 64nf 23nb 32gc ×4` and the like.
    pub fn description(&self) -> &str {
        &self.description
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The network on an NCHW batch in [0, 1] on the model's device and dtype, as spandrel's `model(x)`
    /// (unclamped; `x`'s channel order is the caller's: A1111 feeds BGR).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor, UpscaleError> {
        Ok(match &self.net {
            Net::Esrgan(n) => n.forward(x)?,
            Net::Compact(n) => n.forward(x)?,
        })
    }

    /// A1111's `pil_image_to_torch_bgr(img).unsqueeze(0).to(device, dtype)`: `(1, 3, H, W)`, BGR, `v / 255`
    /// computed in double precision and rounded once to the model's dtype.
    pub fn input(&self, img: &RgbImage) -> Result<Tensor, UpscaleError> {
        let (w, h) = (img.width as usize, img.height as usize);
        if img.data.len() != w * h * 3 {
            return Err(UpscaleError::Image {
                width: img.width,
                height: img.height,
                reason: format!("{} bytes of pixel data, not {}", img.data.len(), w * h * 3),
            });
        }
        // BGR planes: plane 0 is the image's blue channel.
        let planar = |ch: usize| img.data.chunks_exact(3).map(move |p| p[2 - ch]);
        let values = (0..3).flat_map(planar);
        let shape = (1, 3, h, w);
        let cpu = &Device::Cpu;
        let t = match self.dtype {
            DType::F16 => Tensor::from_iter(values.map(|v| half::f16::from_f64(f64::from(v) / 255.0)), cpu)?,
            DType::BF16 => {
                Tensor::from_iter(values.map(|v| half::bf16::from_f64(f64::from(v) / 255.0)), cpu)?
            }
            DType::F64 => Tensor::from_iter(values.map(|v| f64::from(v) / 255.0), cpu)?,
            _ => {
                Tensor::from_iter(values.map(|v| (f64::from(v) / 255.0) as f32), cpu)?.to_dtype(self.dtype)?
            }
        };
        Ok(t.reshape(shape)?.to_device(&self.device)?)
    }

    /// A1111's `torch_bgr_to_pil_image` of a `(1, 3, H, W)` output: `float()`, clamped to [0, 1], `255.0 ·` in single
    /// precision, rounded half to even, bytes, BGR flipped to RGB. Computed where the tensor is, so only the bytes
    /// leave the GPU; adding and then removing 2²³ rounds a float in [0, 2²²) to an integer, ties to even, as numpy's
    /// `round` does.
    pub fn output(&self, y: &Tensor) -> Result<RgbImage, UpscaleError> {
        const ROUND: f64 = (1u32 << 23) as f64;
        let (_, c, h, w) = y.dims4()?;
        if c != 3 {
            return Err(candle_core::Error::Msg(format!("the network gave {c} channels, not 3")).into());
        }
        let bytes = y
            .to_dtype(DType::F32)?
            .clamp(0f32, 1f32)?
            .affine(255.0, 0.0)?
            .affine(1.0, ROUND)?
            .affine(1.0, -ROUND)?
            .to_dtype(DType::U8)?
            .squeeze(0)?;
        let rgb = Tensor::new(&[2u32, 1, 0], bytes.device())?;
        let hwc = bytes.index_select(&rgb, 0)?.permute((1, 2, 0))?.contiguous()?;
        let data = hwc.flatten_all()?.to_device(&Device::Cpu)?.to_vec1::<u8>()?;
        Ok(RgbImage { width: w as u32, height: h as u32, data })
    }

    /// One image through the network whole (A1111's `upscale_pil_patch`).
    pub fn upscale_patch(&self, img: &RgbImage) -> Result<RgbImage, UpscaleError> {
        if img.width == 0 || img.height == 0 {
            return Err(UpscaleError::Image {
                width: img.width,
                height: img.height,
                reason: "it is empty".into(),
            });
        }
        if let Net::Esrgan(n) = &self.net {
            let r = n.shuffle() as u32;
            let pad = |side: u32| (r - side % r) % r;
            if r > 1 && (pad(img.width) >= img.width || pad(img.height) >= img.height) {
                return Err(UpscaleError::Image {
                    width: img.width,
                    height: img.height,
                    reason: format!(
                        "the model reflect-pads its input to a multiple of {r}, which needs more pixels"
                    ),
                });
            }
        }
        self.output(&self.forward(&self.input(img)?)?)
    }

    /// A1111's `upscale_with_model`: the image whole (`tile.size` 0) or in overlapping tiles joined with
    /// feathered overlaps ([`Tile`]), so large images fit in memory.
    pub fn upscale(&self, img: &RgbImage, tile: Tile) -> Result<RgbImage, UpscaleError> {
        if tile.size == 0 {
            return self.upscale_patch(img);
        }
        upscale_tiled(img, tile, |t| self.upscale_patch(t), UpscaleError::Tile)
    }
}

#[cfg(test)]
mod tests;
