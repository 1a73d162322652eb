//! A1111's extras "Upscale" step on the stable-diffusion.cpp engine: the resampling upscalers computed as Pillow
//! does (`sdhive-upscale`), upscaler models run by sd.cpp's ESRGAN upscaler on the engine's ggml device (loaded on
//! first use, kept while jobs name the same file), inside A1111's upscale loop.

use diffusion_rs_sys as sys;
use sdhive_engine::{EngineError, HiresUpscaler, RgbImage, UpscaleRequest, ValidationError};
use sdhive_upscale::a1111;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

/// sd.cpp's tile for its ESRGAN runs (its own default).
const TILE: i32 = 128;

/// One loaded sd.cpp upscaler; freed on drop.
struct Loaded {
    path: PathBuf,
    ctx: NonNull<sys::upscaler_ctx_t>,
}

// SAFETY: the context is used only through `&mut SdCppUpscalers`, one call at a time, on whichever thread holds it.
unsafe impl Send for Loaded {}

impl Drop for Loaded {
    fn drop(&mut self) {
        // SAFETY: `ctx` came from new_upscaler_ctx and is freed once, here.
        unsafe { sys::free_upscaler_ctx(self.ctx.as_ptr()) }
    }
}

#[derive(Default)]
pub struct SdCppUpscalers {
    loaded: Option<Loaded>,
}

fn invalid(message: String) -> EngineError {
    EngineError::Invalid(ValidationError { field: "upscaler_1", message })
}

impl SdCppUpscalers {
    fn context(
        &mut self,
        path: &Path,
        device: &str,
        threads: i32,
    ) -> Result<NonNull<sys::upscaler_ctx_t>, EngineError> {
        if let Some(l) = self.loaded.as_ref().filter(|l| l.path == path) {
            return Ok(l.ctx);
        }
        self.loaded = None;
        let c_path = path
            .to_str()
            .and_then(|p| CString::new(p).ok())
            .ok_or_else(|| invalid(format!("the upscaler's path cannot be passed on: {}", path.display())))?;
        let c_device = CString::new(device).map_err(|_| invalid("the device name holds a NUL".into()))?;
        let empty = c"";
        // SAFETY: every string outlives the call; sd.cpp copies what it keeps.
        let ctx = unsafe {
            sys::new_upscaler_ctx(c_path.as_ptr(), false, threads, TILE, c_device.as_ptr(), empty.as_ptr())
        };
        let ctx = NonNull::new(ctx).ok_or_else(|| {
            invalid(format!(
                "stable-diffusion.cpp cannot load {} as an upscaler: it runs ESRGAN's RRDBNet in BasicSR's key \
                 layout with 64 features and 32 growth channels (RealESRGAN_x4plus and most 4x_* models); its log \
                 at RUST_LOG=sdcpp=info says what did not fit",
                path.display()
            ))
        })?;
        self.loaded = Some(Loaded { path: path.to_path_buf(), ctx });
        Ok(ctx)
    }

    /// One pass of `upscaler` inside an upscale by `scale`.
    fn pass(
        &mut self,
        upscaler: &HiresUpscaler,
        scale: f64,
        device: &str,
        threads: i32,
        img: &RgbImage,
    ) -> Result<RgbImage, EngineError> {
        match (upscaler, a1111::builtin_for(upscaler, scale)) {
            (HiresUpscaler::Model { path, .. }, _) => self.model_pass(path, device, threads, img),
            (_, Some(mut builtin)) => builtin(img).map_err(|e| invalid(e.to_string())),
            (_, None) => Err(invalid("a latent upscaler cannot enlarge an image".into())),
        }
    }

    fn model_pass(
        &mut self,
        path: &Path,
        device: &str,
        threads: i32,
        img: &RgbImage,
    ) -> Result<RgbImage, EngineError> {
        let ctx = self.context(path, device, threads)?;
        // SAFETY: `ctx` is live (owned by `self.loaded`).
        let factor = unsafe { sys::get_upscale_factor(ctx.as_ptr()) }.max(1) as u32;
        let input = sys::sd_image_t {
            width: img.width,
            height: img.height,
            channel: 3,
            data: img.data.as_ptr().cast_mut(),
        };
        // SAFETY: `input` borrows `img`'s pixels for the call; sd.cpp returns a malloc'd image or a null one.
        let out = unsafe { sys::upscale(ctx.as_ptr(), input, factor) };
        let n = out.width as usize * out.height as usize * out.channel as usize;
        if out.data.is_null() || out.channel != 3 || n == 0 {
            return Err(EngineError::Failed(format!(
                "stable-diffusion.cpp's upscaler returned no image for {}",
                path.display()
            )));
        }
        // SAFETY: `out.data` holds width·height·3 bytes, allocated with malloc by sd.cpp, freed once after copying.
        let data = unsafe {
            let data = std::slice::from_raw_parts(out.data, n).to_vec();
            libc_free(out.data.cast());
            data
        };
        Ok(RgbImage { width: out.width, height: out.height, data })
    }

    /// A1111's extras "Upscale" step on each image of `req`.
    pub fn extras(
        &mut self,
        req: &UpscaleRequest,
        device: &str,
        threads: i32,
    ) -> Result<Vec<RgbImage>, EngineError> {
        a1111::extras(req, |upscaler, scale, img| self.pass(upscaler, scale, device, threads, img))
    }
}

unsafe extern "C" {
    #[link_name = "free"]
    fn libc_free(p: *mut std::ffi::c_void);
}
