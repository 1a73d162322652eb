//! Writing a GGUF checkpoint with stable-diffusion.cpp's own converter (what `sd --mode convert` runs): a
//! diffusers folder or an original single file in, one `.gguf` out, its weights quantised to the type asked for
//! (sd.cpp keeps biases, norms and embeddings as they are) and its tensors under sd.cpp's own names. The tests
//! make their quantised SD1.5 this way, so that the file is the kind users download, without Python.

use crate::callbacks;
use diffusion_rs_sys as sys;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// The weight types worth converting a Stable Diffusion checkpoint to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufType {
    F16,
    Q8_0,
    Q5_0,
    Q4_0,
}

impl GgufType {
    fn sd_type(self) -> sys::sd_type_t {
        match self {
            GgufType::F16 => sys::sd_type_t::SD_TYPE_F16,
            GgufType::Q8_0 => sys::sd_type_t::SD_TYPE_Q8_0,
            GgufType::Q5_0 => sys::sd_type_t::SD_TYPE_Q5_0,
            GgufType::Q4_0 => sys::sd_type_t::SD_TYPE_Q4_0,
        }
    }
}

#[derive(Debug, Error)]
pub enum ConvertError {
    #[error("{0} contains a NUL byte")]
    Nul(PathBuf),
    #[error(
        "stable-diffusion.cpp could not convert {} to {} (its log, at RUST_LOG=sdcpp=info, says why)",
        input.display(),
        output.display()
    )]
    Failed { input: PathBuf, output: PathBuf },
}

/// Converts the model at `input` (a diffusers folder or a single-file checkpoint) into the GGUF file `output`.
pub fn convert_to_gguf(input: &Path, output: &Path, weights: GgufType) -> Result<(), ConvertError> {
    callbacks::install();
    let c =
        |p: &Path| CString::new(p.to_string_lossy().into_owned()).map_err(|_| ConvertError::Nul(p.into()));
    let (c_input, c_output) = (c(input)?, c(output)?);
    // SAFETY: every string is NUL-terminated and outlives the call. The empty VAE path and type rules are sd.cpp's
    // "none" (the rules become a std::string, so they must not be null); `convert_name` gives the file sd.cpp's
    // own tensor names.
    let ok = unsafe {
        sys::convert(c_input.as_ptr(), c"".as_ptr(), c_output.as_ptr(), weights.sd_type(), c"".as_ptr(), true)
    };
    if ok {
        Ok(())
    } else {
        Err(ConvertError::Failed { input: input.into(), output: output.into() })
    }
}
