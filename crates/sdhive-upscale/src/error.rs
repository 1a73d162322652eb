//! The crate's error: every failure to read or recognise a model file names the file, and where one tensor is at
//! fault, the tensor.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum UpscaleError {
    #[error("{}: cannot read the file: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `.pth` / `.pt` / `.ckpt` / `.bin` / `.pkl`: loading them means unpickling, which can run code.
    #[error(
        "{}: a pickled PyTorch file ({ext}) is not loaded (unpickling can run code); convert it to .safetensors \
         first, e.g. `python -c \"import torch, safetensors.torch as s; s.save_file(torch.load('{name}', \
         weights_only=True), '{stem}.safetensors')\"` (or spandrel's / chaiNNer's converters)",
        path.display()
    )]
    Pickle { path: PathBuf, ext: String, name: String, stem: String },
    #[error("{}: not a valid safetensors file: {reason}", path.display())]
    BadFile { path: PathBuf, reason: String },
    #[error(
        "{}: not an upscaler this build knows (ESRGAN / Real-ESRGAN RRDBNet, Real-ESRGAN SRVGGNetCompact): {reason}",
        path.display()
    )]
    UnknownArchitecture { path: PathBuf, reason: String },
    #[error("{}: {arch}: tensor `{tensor}` {problem}", path.display())]
    Tensor { path: PathBuf, arch: &'static str, tensor: String, problem: String },
    #[error("{}: {arch}: {reason}", path.display())]
    Unsupported { path: PathBuf, arch: &'static str, reason: String },
    #[error("cannot upscale a {width}x{height} image with this model: {reason}")]
    Image { width: u32, height: u32, reason: String },
    #[error("tiling: {0}")]
    Tile(String),
    #[error("running the upscaler: {0}")]
    Candle(#[from] candle_core::Error),
}
