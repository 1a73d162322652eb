//! Hires fix as A1111 defines it: a first pass at the request's size, an upscale (of the latents, or of the
//! decoded image by a resampling filter or an upscaler model), and a second img2img pass at the new size. This
//! module owns the settings, the upscaler names and the target-size arithmetic both engines share.

use crate::request::ValidationError;
use crate::sampler::{Sampler, Schedule};
use std::path::PathBuf;

/// PyTorch `interpolate` modes behind A1111's `Latent …` upscalers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LatentMode {
    Bilinear,
    BilinearAntialiased,
    Bicubic,
    BicubicAntialiased,
    Nearest,
    NearestExact,
}

/// A1111's latent upscalers (`shared.latent_upscale_modes`), in its order: name and mode.
pub const LATENT_UPSCALERS: [(&str, LatentMode); 6] = [
    ("Latent", LatentMode::Bilinear),
    ("Latent (antialiased)", LatentMode::BilinearAntialiased),
    ("Latent (bicubic)", LatentMode::Bicubic),
    ("Latent (antialiased bicubic)", LatentMode::BicubicAntialiased),
    ("Latent (nearest)", LatentMode::Nearest),
    ("Latent (nearest-exact)", LatentMode::NearestExact),
];

/// The resampling upscalers every node has, by A1111's names.
pub const BUILTIN_IMAGE_UPSCALERS: [&str; 3] = ["None", "Lanczos", "Nearest"];

impl LatentMode {
    /// `(torch mode, antialias)` as A1111 passes them to `F.interpolate`.
    pub fn torch(self) -> (&'static str, bool) {
        match self {
            LatentMode::Bilinear => ("bilinear", false),
            LatentMode::BilinearAntialiased => ("bilinear", true),
            LatentMode::Bicubic => ("bicubic", false),
            LatentMode::BicubicAntialiased => ("bicubic", true),
            LatentMode::Nearest => ("nearest", false),
            LatentMode::NearestExact => ("nearest-exact", false),
        }
    }

    pub fn name(self) -> &'static str {
        LATENT_UPSCALERS.iter().find(|(_, m)| *m == self).map_or("Latent", |(n, _)| n)
    }
}

/// What enlarges the first pass's result.
#[derive(Debug, Clone, PartialEq)]
pub enum HiresUpscaler {
    /// Interpolates the latents; no decode before the second pass.
    Latent(LatentMode),
    /// A1111's `None`: the decoded image resized with Lanczos.
    None,
    Lanczos,
    /// Nearest-neighbour enlargement, then Lanczos to the exact size (A1111's `UpscalerNearest`).
    Nearest,
    /// An upscaler model file (ESRGAN, Real-ESRGAN, SRVGG), run until the image is at least the target size.
    Model {
        name: String,
        path: PathBuf,
    },
}

impl HiresUpscaler {
    /// The name as A1111 writes it in `hr_upscaler` and the infotext.
    pub fn name(&self) -> &str {
        match self {
            HiresUpscaler::Latent(m) => m.name(),
            HiresUpscaler::None => "None",
            HiresUpscaler::Lanczos => "Lanczos",
            HiresUpscaler::Nearest => "Nearest",
            HiresUpscaler::Model { name, .. } => name,
        }
    }

    /// A built-in upscaler by name (case-insensitive, as A1111 matches); model upscalers are the catalogue's.
    pub fn builtin(name: &str) -> Option<HiresUpscaler> {
        if let Some((_, m)) = LATENT_UPSCALERS.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)) {
            return Some(HiresUpscaler::Latent(*m));
        }
        match name.to_ascii_lowercase().as_str() {
            "none" => Some(HiresUpscaler::None),
            "lanczos" => Some(HiresUpscaler::Lanczos),
            "nearest" => Some(HiresUpscaler::Nearest),
            _ => None,
        }
    }
}

/// The second pass and how the first pass's result is enlarged for it. `None` fields follow the first pass.
#[derive(Debug, Clone, PartialEq)]
pub struct HiresFix {
    pub upscaler: HiresUpscaler,
    /// Used when neither resize dimension is given.
    pub scale: f32,
    /// `hr_resize_x` / `hr_resize_y`; 0 derives that side from the other and the first pass's aspect.
    pub resize_x: u32,
    pub resize_y: u32,
    /// Steps of the second pass's schedule (0 = the first pass's); img2img runs `steps × denoising_strength`.
    pub steps: u32,
    pub denoising_strength: f32,
    pub sampler: Option<Sampler>,
    pub schedule: Option<Schedule>,
    pub prompt: Option<String>,
    pub negative_prompt: Option<String>,
    pub cfg_scale: Option<f32>,
}

impl Default for HiresFix {
    fn default() -> Self {
        HiresFix {
            upscaler: HiresUpscaler::Latent(LatentMode::Bilinear),
            scale: 2.0,
            resize_x: 0,
            resize_y: 0,
            steps: 0,
            denoising_strength: 0.7,
            sampler: None,
            schedule: None,
            prompt: None,
            negative_prompt: None,
            cfg_scale: None,
        }
    }
}

/// Where the second pass runs: the size the first pass's result is enlarged to, and the centred crop of it the
/// second pass keeps (A1111's truncation when both resize sides are given and the aspect differs). All multiples
/// of 8.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HiresTarget {
    pub upscaled: (u32, u32),
    pub output: (u32, u32),
    /// Pixels cut from the left and the top of the upscaled image.
    pub crop_origin: (u32, u32),
}

fn invalid(field: &'static str, message: impl Into<String>) -> ValidationError {
    ValidationError { field, message: message.into() }
}

impl HiresFix {
    /// A1111's `calculate_target_resolution` for a first pass of `width`×`height`, each side rounded down to a
    /// multiple of 8 (what A1111's latents and VAE make of any size).
    pub fn target(&self, width: u32, height: u32) -> HiresTarget {
        let down8 = |v: u64| (v / 8 * 8) as u32;
        let (w, h) = (u64::from(width), u64::from(height));
        let (rx, ry) = (u64::from(self.resize_x), u64::from(self.resize_y));
        let (up, out) = match (rx, ry) {
            (0, 0) => {
                let s = f64::from(self.scale);
                let up = ((w as f64 * s) as u64, (h as f64 * s) as u64);
                (up, up)
            }
            (x, 0) => ((x, x * h / w), (x, x * h / w)),
            (0, y) => ((y * w / h, y), (y * w / h, y)),
            (x, y) => {
                // Cover the requested box keeping the first pass's aspect, then crop to it.
                let up = if (w as f64 / h as f64) < (x as f64 / y as f64) {
                    (x, x * h / w)
                } else {
                    (y * w / h, y)
                };
                (up, (x, y))
            }
        };
        let upscaled = (down8(up.0), down8(up.1));
        let output = (down8(out.0).min(upscaled.0), down8(out.1).min(upscaled.1));
        // A1111 cuts `(up - target) // 8` latent columns, the smaller half on the left/top.
        let crop_origin = ((upscaled.0 - output.0) / 16 * 8, (upscaled.1 - output.1) / 16 * 8);
        HiresTarget { upscaled, output, crop_origin }
    }

    /// Checks the settings and the target size against the limits; fields are named as A1111's API names them.
    pub fn validate(
        &self,
        width: u32,
        height: u32,
        limits: &crate::request::Limits,
    ) -> Result<HiresTarget, ValidationError> {
        if self.resize_x == 0 && self.resize_y == 0 && !(self.scale.is_finite() && self.scale >= 1.0) {
            return Err(invalid("hr_scale", format!("must be a number ≥ 1, got {}", self.scale)));
        }
        if !(self.denoising_strength > 0.0 && self.denoising_strength <= 1.0) {
            return Err(invalid(
                "denoising_strength",
                format!("must be in (0, 1] for hires fix, got {}", self.denoising_strength),
            ));
        }
        if self.steps > limits.max_steps {
            return Err(invalid(
                "hr_second_pass_steps",
                format!("must be at most {}, got {}", limits.max_steps, self.steps),
            ));
        }
        if let Some(c) = self.cfg_scale {
            if !c.is_finite() || !(0.0..=100.0).contains(&c) {
                return Err(invalid("hr_cfg", format!("must be a number between 0 and 100, got {c}")));
            }
        }
        let target = self.target(width, height);
        let field = if self.resize_x == 0 && self.resize_y == 0 { "hr_scale" } else { "hr_resize_x" };
        let (w, h) = target.upscaled;
        if w < 8 || h < 8 {
            return Err(invalid(field, format!("the hires size {w}x{h} is smaller than 8x8")));
        }
        if w > limits.max_width || h > limits.max_height {
            return Err(invalid(
                field,
                format!(
                    "the hires size {w}x{h} is over this server's limit of {}x{}",
                    limits.max_width, limits.max_height
                ),
            ));
        }
        if let (Some(s), Some(Schedule::Karras)) = (self.sampler, self.schedule) {
            if !s.supports_karras() {
                return Err(invalid(
                    "hr_scheduler",
                    format!("the Karras schedule is not available with sampler {s}"),
                ));
            }
        }
        Ok(target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fix(scale: f32, rx: u32, ry: u32) -> HiresFix {
        HiresFix { scale, resize_x: rx, resize_y: ry, ..Default::default() }
    }

    #[test]
    fn targets_follow_a1111() {
        let t = fix(2.0, 0, 0).target(512, 768);
        assert_eq!((t.upscaled, t.output, t.crop_origin), ((1024, 1536), (1024, 1536), (0, 0)));
        // int(512 * 1.3) = 665 → 664 after rounding to the latent grid.
        assert_eq!(fix(1.3, 0, 0).target(512, 512).output, (664, 664));
        assert_eq!(fix(2.0, 1000, 0).target(512, 768).output, (1000, 1496));
        assert_eq!(fix(2.0, 0, 1024).target(512, 768).output, (680, 1024));
        // Wider box than the image: cover by width (1024x1536), keep 1024x1024 from the middle.
        let t = fix(2.0, 1024, 1024).target(512, 768);
        assert_eq!((t.upscaled, t.output, t.crop_origin), ((1024, 1536), (1024, 1024), (0, 256)));
    }

    #[test]
    fn validation_names_the_a1111_field() {
        let limits = crate::request::Limits::default();
        assert_eq!(fix(4.0, 0, 0).validate(1024, 1024, &limits).unwrap_err().field, "hr_scale");
        assert_eq!(fix(0.5, 0, 0).validate(512, 512, &limits).unwrap_err().field, "hr_scale");
        assert_eq!(fix(2.0, 4096, 0).validate(512, 512, &limits).unwrap_err().field, "hr_resize_x");
        let bad = HiresFix { denoising_strength: 0.0, ..Default::default() };
        assert_eq!(bad.validate(512, 512, &limits).unwrap_err().field, "denoising_strength");
        assert!(fix(2.0, 0, 0).validate(512, 512, &limits).is_ok());
    }

    #[test]
    fn builtin_names_parse_case_insensitively() {
        assert_eq!(
            HiresUpscaler::builtin("latent (Nearest-Exact)").unwrap().name(),
            "Latent (nearest-exact)"
        );
        assert_eq!(HiresUpscaler::builtin("lanczos"), Some(HiresUpscaler::Lanczos));
        assert_eq!(HiresUpscaler::builtin("R-ESRGAN 4x+"), None);
    }
}
