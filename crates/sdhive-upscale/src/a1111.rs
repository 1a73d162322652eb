//! A1111's upscaling flow around an upscaler's single pass: `Upscaler.upscale` (modules/upscaler.py: up to three
//! passes until the image covers the destination, whose sides are rounded down to multiples of 8, then a Pillow
//! LANCZOS resize to it), the built-in "None" / "Lanczos" / "Nearest" upscalers' pass, the extras tab's "Upscale"
//! step behind `/sdapi/v1/extra-single-image` (scripts/postprocessing_upscale.py: by a scale, or to a size with an
//! optional centred crop; a second upscaler blended in) and `images.resize_image`'s three modes.

use crate::pillow::{black, blend, paste};
use crate::resize::{resize, resize_box, Filter};
use sdhive_engine::{HiresUpscaler, RgbImage, UpscaleRequest, UpscaleSize};

/// A1111's destination for `scale`: `int((side · scale) // 8 · 8)`.
pub fn destination(img: &RgbImage, scale: f64) -> (u32, u32) {
    let side = |s: u32| ((f64::from(s) * scale) / 8.0).floor().max(0.0) as u32 * 8;
    (side(img.width), side(img.height))
}

/// `Upscaler.upscale(img, scale)`: [`destination`], then [`upscale_to`]'s loop, except that at a scale of exactly 1
/// the first pass runs even though the image already covers the destination (A1111's `i > 0 or scale != 1`).
pub fn upscale_by<E>(
    img: &RgbImage,
    scale: f64,
    pass: impl FnMut(&RgbImage) -> Result<RgbImage, E>,
) -> Result<RgbImage, E> {
    let (w, h) = destination(img, scale);
    upscale_loop(img, (w, h), scale == 1.0, pass)
}

/// The loop of A1111's `Upscaler.upscale` towards `dest_w`×`dest_h`: at most three passes, none once the image is at
/// least that large, stopping early when a pass leaves the size unchanged; then a LANCZOS resize to exactly the
/// destination if the size differs.
pub fn upscale_to<E>(
    img: &RgbImage,
    dest_w: u32,
    dest_h: u32,
    pass: impl FnMut(&RgbImage) -> Result<RgbImage, E>,
) -> Result<RgbImage, E> {
    upscale_loop(img, (dest_w, dest_h), false, pass)
}

fn upscale_loop<E>(
    img: &RgbImage,
    (dest_w, dest_h): (u32, u32),
    first_pass_always: bool,
    mut pass: impl FnMut(&RgbImage) -> Result<RgbImage, E>,
) -> Result<RgbImage, E> {
    let mut img = std::borrow::Cow::Borrowed(img);
    for i in 0..3 {
        if img.width >= dest_w && img.height >= dest_h && (i > 0 || !first_pass_always) {
            break;
        }
        let before = (img.width, img.height);
        img = std::borrow::Cow::Owned(pass(&img)?);
        if (img.width, img.height) == before {
            break;
        }
    }
    if (img.width, img.height) != (dest_w, dest_h) {
        return Ok(resize(&img, dest_w, dest_h, Filter::Lanczos));
    }
    Ok(img.into_owned())
}

/// The pass of A1111's built-in upscalers "None" (`filter` `None`: the image unchanged), "Lanczos" and
/// "Nearest": a Pillow resize to `int(side · scale)`, `scale` being the whole upscale's.
pub fn builtin_pass(
    filter: Option<Filter>,
    scale: f64,
) -> impl FnMut(&RgbImage) -> Result<RgbImage, BuiltinError> {
    move |img: &RgbImage| {
        let Some(filter) = filter else { return Ok(img.clone()) };
        let (w, h) = ((f64::from(img.width) * scale) as u32, (f64::from(img.height) * scale) as u32);
        if w == 0 || h == 0 {
            return Err(BuiltinError { width: img.width, height: img.height, scale });
        }
        Ok(resize(img, w, h, filter))
    }
}

/// A built-in upscaler asked for an empty image (Pillow refuses those).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("upscaling {width}x{height} by {scale} gives an empty image")]
pub struct BuiltinError {
    pub width: u32,
    pub height: u32,
    pub scale: f64,
}

/// The extras "Upscale" step's size: `resize_mode` 0 (`upscaling_resize`) or 1 (`upscaling_resize_w`,
/// `upscaling_resize_h`, `upscaling_crop`) of `/sdapi/v1/extra-single-image`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExtrasResize {
    /// Upscale by this factor.
    By(f64),
    /// Upscale by `max(width / w, height / h)`; with `crop`, the result centred on a `width`×`height` black canvas
    /// (cropping what overhangs; A1111's sides rounded down to multiples of 8 can leave a thin black border).
    /// Without `crop` the upscaled image is returned as it is, as A1111 does.
    To { width: u32, height: u32, crop: bool },
}

impl ExtrasResize {
    /// The factor A1111 upscales `img` by.
    pub fn scale_for(&self, img: &RgbImage) -> f64 {
        match *self {
            ExtrasResize::By(s) => s,
            ExtrasResize::To { width, height, .. } => {
                (f64::from(width) / f64::from(img.width)).max(f64::from(height) / f64::from(img.height))
            }
        }
    }
}

/// The extras "Upscale" step with one upscaler (`pass`): [`upscale_by`] at [`ExtrasResize::scale_for`], then the
/// crop of [`ExtrasResize::To`].
pub fn extras_upscale<E>(
    img: &RgbImage,
    resize_to: ExtrasResize,
    pass: impl FnMut(&RgbImage) -> Result<RgbImage, E>,
) -> Result<RgbImage, E> {
    let up = upscale_by(img, resize_to.scale_for(img), pass)?;
    Ok(match resize_to {
        ExtrasResize::To { width, height, crop: true } => centred(&up, width, height),
        _ => up,
    })
}

/// The extras step's second upscaler: `Image.blend(first, second, visibility)` of the two results.
pub fn blend_second(first: &RgbImage, second: &RgbImage, visibility: f64) -> RgbImage {
    if visibility <= 0.0 {
        return first.clone();
    }
    blend(first, second, visibility).unwrap_or_else(|| first.clone())
}

/// `img` pasted centred on a black `width`×`height` canvas (`(W // 2 − w // 2, H // 2 − h // 2)`).
fn centred(img: &RgbImage, width: u32, height: u32) -> RgbImage {
    let mut canvas = black(width, height);
    let x = i64::from(width / 2) - i64::from(img.width / 2);
    let y = i64::from(height / 2) - i64::from(img.height / 2);
    paste(&mut canvas, img, x, y);
    canvas
}

/// An upscaler's single pass, as [`resize_image`] takes it.
pub type Pass<'a, E> = &'a mut dyn FnMut(&RgbImage) -> Result<RgbImage, E>;

/// `images.resize_image`'s `resize_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResizeMode {
    /// 0, "Just resize": to the size, aspect ratio ignored.
    Just,
    /// 1, "Crop and resize": cover the size keeping the aspect ratio, centred, the overhang cropped.
    CropAndResize,
    /// 2, "Resize and fill": fit inside the size keeping the aspect ratio, centred, the empty bands filled with
    /// the image's edge rows or columns stretched (BICUBIC over a zero-height source box, as A1111 does it).
    ResizeAndFill,
}

/// `images.resize_image(mode, img, width, height, upscaler_name)`: each resize inside it is A1111's `resize`:
/// without an upscaler (`None`, A1111's "None") a LANCZOS resize; with one, [`upscale_by`] first when the image must
/// grow, then a LANCZOS resize to the exact size if needed.
pub fn resize_image<E>(
    mode: ResizeMode,
    img: &RgbImage,
    width: u32,
    height: u32,
    mut upscaler: Option<Pass<'_, E>>,
) -> Result<RgbImage, E> {
    let mut fit = |im: &RgbImage, w: u32, h: u32| -> Result<RgbImage, E> {
        let Some(pass) = upscaler.as_deref_mut() else { return Ok(resize(im, w, h, Filter::Lanczos)) };
        let scale = (f64::from(w) / f64::from(im.width)).max(f64::from(h) / f64::from(im.height));
        let up = if scale > 1.0 { upscale_by(im, scale, &mut *pass)? } else { im.clone() };
        Ok(if (up.width, up.height) != (w, h) { resize(&up, w, h, Filter::Lanczos) } else { up })
    };
    let ratio = f64::from(width) / f64::from(height);
    let src_ratio = f64::from(img.width) / f64::from(img.height);
    // Python's integer `//` on non-negative ints.
    let (iw, ih) = (u64::from(img.width), u64::from(img.height));
    let scaled_w = (iw * u64::from(height) / ih) as u32;
    let scaled_h = (ih * u64::from(width) / iw) as u32;
    match mode {
        ResizeMode::Just => fit(img, width, height),
        ResizeMode::CropAndResize => {
            let src_w = if ratio > src_ratio { width } else { scaled_w };
            let src_h = if ratio <= src_ratio { height } else { scaled_h };
            let resized = fit(img, src_w, src_h)?;
            Ok(centred_at(&resized, width, height, src_w, src_h))
        }
        ResizeMode::ResizeAndFill => {
            let src_w = if ratio < src_ratio { width } else { scaled_w };
            let src_h = if ratio >= src_ratio { height } else { scaled_h };
            let resized = fit(img, src_w, src_h)?;
            let mut res = centred_at(&resized, width, height, src_w, src_h);
            let (rw, rh) = (resized.width as f32, resized.height as f32);
            if ratio < src_ratio {
                let fill = height / 2 - src_h / 2;
                if fill > 0 {
                    let top =
                        resize_box(&resized, width, fill, Filter::Bicubic, [0.0, 0.0, width as f32, 0.0]);
                    paste(&mut res, &top, 0, 0);
                    let bottom =
                        resize_box(&resized, width, fill, Filter::Bicubic, [0.0, rh, width as f32, rh]);
                    paste(&mut res, &bottom, 0, i64::from(fill + src_h));
                }
            } else if ratio > src_ratio {
                let fill = width / 2 - src_w / 2;
                if fill > 0 {
                    let left =
                        resize_box(&resized, fill, height, Filter::Bicubic, [0.0, 0.0, 0.0, height as f32]);
                    paste(&mut res, &left, 0, 0);
                    let right =
                        resize_box(&resized, fill, height, Filter::Bicubic, [rw, 0.0, rw, height as f32]);
                    paste(&mut res, &right, i64::from(fill + src_w), 0);
                }
            }
            Ok(res)
        }
    }
}

/// `res = Image.new("RGB", (width, height)); res.paste(resized, (width // 2 − src_w // 2, height // 2 − src_h // 2))`.
fn centred_at(resized: &RgbImage, width: u32, height: u32, src_w: u32, src_h: u32) -> RgbImage {
    let mut res = black(width, height);
    let x = i64::from(width / 2) - i64::from(src_w / 2);
    let y = i64::from(height / 2) - i64::from(src_h / 2);
    paste(&mut res, resized, x, y);
    res
}

/// The resampling pass of a built-in upscaler (`None`, `Lanczos`, `Nearest`) inside an upscale by `scale`; `None`
/// for upscaler models and latent upscalers, whose passes the engines run.
pub fn builtin_for(
    upscaler: &HiresUpscaler,
    scale: f64,
) -> Option<impl FnMut(&RgbImage) -> Result<RgbImage, BuiltinError>> {
    let filter = match upscaler {
        HiresUpscaler::None => None,
        HiresUpscaler::Lanczos => Some(Filter::Lanczos),
        HiresUpscaler::Nearest => Some(Filter::Nearest),
        HiresUpscaler::Model { .. } | HiresUpscaler::Latent(_) => return None,
    };
    Some(builtin_pass(filter, scale))
}

/// A1111's extras "Upscale" step on each image of `req`: [`extras_upscale`] with the first upscaler, and the second
/// blended in at its visibility. `pass(upscaler, scale, image)` is one pass of `upscaler` inside an upscale by
/// `scale` (the engines run models on their device; [`builtin_for`] gives the resampling ones).
pub fn extras<E>(
    req: &UpscaleRequest,
    mut pass: impl FnMut(&HiresUpscaler, f64, &RgbImage) -> Result<RgbImage, E>,
) -> Result<Vec<RgbImage>, E> {
    let size = match req.size {
        UpscaleSize::By(s) => ExtrasResize::By(s),
        UpscaleSize::To { width, height, crop } => ExtrasResize::To { width, height, crop },
    };
    let mut out = Vec::with_capacity(req.images.len());
    for img in &req.images {
        let scale = size.scale_for(img);
        let first = extras_upscale(img, size, |i: &RgbImage| pass(&req.upscaler, scale, i))?;
        out.push(match &req.second {
            Some((second, visibility)) if *visibility > 0.0 => {
                let other = extras_upscale(img, size, |i: &RgbImage| pass(second, scale, i))?;
                blend_second(&first, &other, f64::from(*visibility))
            }
            _ => first,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn img(w: u32, h: u32) -> RgbImage {
        RgbImage { width: w, height: h, data: (0..w * h * 3).map(|i| (i * 31 % 256) as u8).collect() }
    }

    /// A pass that doubles the size by repeating pixels (a stand-in ×2 model), counting its calls.
    fn doubler(calls: &mut usize) -> impl FnMut(&RgbImage) -> Result<RgbImage, ()> + '_ {
        move |im: &RgbImage| {
            *calls += 1;
            Ok(resize(im, im.width * 2, im.height * 2, Filter::Nearest))
        }
    }

    #[test]
    fn passes_until_the_destination_is_covered() {
        let mut calls = 0;
        // 23x17 by 5: destination 115//8*8 = 112, 85//8*8 = 80; ×2 passes: 46, 92, 184 (three passes).
        let out = upscale_by(&img(23, 17), 5.0, doubler(&mut calls)).expect("upscale");
        assert_eq!((calls, out.width, out.height), (3, 112, 80));
        let mut calls = 0;
        let out = upscale_by(&img(23, 17), 2.0, doubler(&mut calls)).expect("upscale");
        assert_eq!((calls, out.width, out.height), (1, 40, 32));
        // Scale 1 still runs the model once; a pass that keeps the size stops the loop.
        let mut calls = 0;
        upscale_by(&img(24, 16), 1.0, doubler(&mut calls)).expect("upscale");
        assert_eq!(calls, 1);
        let mut calls = 0;
        let out = upscale_by(&img(24, 16), 2.0, |im: &RgbImage| {
            calls += 1;
            Ok::<_, ()>(im.clone())
        })
        .expect("upscale");
        assert_eq!((calls, out.width, out.height), (1, 48, 32));
        let mut calls = 0;
        upscale_to(&img(24, 16), 24, 16, doubler(&mut calls)).expect("upscale");
        assert_eq!(calls, 0);
    }

    #[test]
    fn extras_to_size_crops_centred() {
        let src = img(10, 5);
        let out =
            extras_upscale(&src, ExtrasResize::To { width: 30, height: 20, crop: true }, |im: &RgbImage| {
                Ok::<_, ()>(resize(im, im.width * 4, im.height * 4, Filter::Nearest))
            })
            .expect("extras");
        // Scale max(3, 4) = 4: 40x20 upscaled, fitted to the destination 40x16 (sides rounded down to 8), then
        // centred at (15 - 20, 10 - 8): two black rows above and below, five columns cut on each side.
        let up = resize(&resize(&src, 40, 20, Filter::Nearest), 40, 16, Filter::Lanczos);
        let mut want = black(30, 20);
        paste(&mut want, &up, -5, 2);
        assert_eq!(out, want);
        assert!(out.data[..30 * 2 * 3].iter().all(|&v| v == 0));
        let plain =
            extras_upscale(&src, ExtrasResize::To { width: 30, height: 20, crop: false }, |im: &RgbImage| {
                Ok::<_, ()>(resize(im, im.width * 4, im.height * 4, Filter::Nearest))
            })
            .expect("extras");
        assert_eq!((plain.width, plain.height), (40, 16), "A1111 returns the upscale, sides rounded to 8");
    }

    /// A1111's loop, extras crop and resize modes against the fixtures' Python runs of A1111's code: exact for the
    /// built-in upscalers; within a few levels where an upscaling model (itself within a level of spandrel) runs.
    #[test]
    fn matches_a1111() {
        let goldens = crate::fixtures::Goldens::load();
        let cases = crate::fixtures::cases();
        let src = crate::fixtures::image("input.png");
        let dir = crate::fixtures::dir();
        let cases = cases["a1111"].as_array().expect("a1111 cases");
        assert!(cases.len() >= 8);
        for case in cases {
            let name = case["name"].as_str().expect("name");
            let num = |k: &str| case[k].as_f64().unwrap_or_else(|| panic!("{name}: {k}"));
            let size = |k: &str| num(k) as u32;
            let builtin = |scale: f64| match case["upscaler"].as_str() {
                Some("Lanczos") => builtin_pass(Some(Filter::Lanczos), scale),
                Some("Nearest") => builtin_pass(Some(Filter::Nearest), scale),
                _ => builtin_pass(None, scale),
            };
            let (out, tolerance) = match case["op"].as_str() {
                Some("upscale_by")
                    if case["upscaler"].as_str().is_some_and(|u| u.ends_with(".safetensors")) =>
                {
                    let path = dir.join(case["upscaler"].as_str().expect("upscaler"));
                    let model =
                        crate::UpscaleModel::load(&path, &candle_core::Device::Cpu, candle_core::DType::F32)
                            .expect("model");
                    (
                        upscale_by(&src, num("scale"), |im: &RgbImage| model.upscale_patch(im))
                            .expect("model"),
                        3,
                    )
                }
                Some("upscale_by") => {
                    (upscale_by(&src, num("scale"), builtin(num("scale"))).expect("upscale"), 0)
                }
                Some("extras_to") => {
                    let to = ExtrasResize::To { width: size("width"), height: size("height"), crop: true };
                    (extras_upscale(&src, to, builtin(to.scale_for(&src))).expect("extras"), 0)
                }
                Some("resize_image") => {
                    let mode = match size("mode") {
                        0 => ResizeMode::Just,
                        1 => ResizeMode::CropAndResize,
                        _ => ResizeMode::ResizeAndFill,
                    };
                    (resize_image::<()>(mode, &src, size("width"), size("height"), None).expect("resize"), 0)
                }
                other => panic!("{name}: op {other:?}"),
            };
            let want = goldens.get(case["golden"].as_str().expect("golden"));
            let (max, mean) = crate::fixtures::diff(&out, &want);
            assert!(
                max <= tolerance,
                "{name}: up to {max} levels from A1111 (mean {mean:.3}), allowed {tolerance}"
            );
        }
    }

    #[test]
    fn resize_modes_keep_the_size() {
        for mode in [ResizeMode::Just, ResizeMode::CropAndResize, ResizeMode::ResizeAndFill] {
            for (w, h) in [(40, 16), (16, 40), (30, 30)] {
                let out = resize_image::<()>(mode, &img(23, 17), w, h, None).expect("resize");
                assert_eq!((out.width, out.height, out.data.len()), (w, h, (w * h * 3) as usize), "{mode:?}");
            }
        }
    }
}
