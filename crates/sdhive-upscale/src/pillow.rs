//! The few Pillow image operations A1111's upscaling code composes, with Pillow's semantics: `Image.new` (black),
//! `crop` (areas outside the source come back black), `paste` (clipped at the canvas edges, optionally through an
//! "L" mask with libImaging's `BLEND` rounding) and `Image.blend` (float alpha, truncating).

use sdhive_engine::RgbImage;

/// `Image.new("RGB", (width, height))`: black.
pub fn black(width: u32, height: u32) -> RgbImage {
    RgbImage { width, height, data: vec![0; width as usize * height as usize * 3] }
}

/// `img.crop((x0, y0, x1, y1))`: pixels outside `img` are black. An inverted box gives an empty image.
pub fn crop(img: &RgbImage, x0: i64, y0: i64, x1: i64, y1: i64) -> RgbImage {
    let (w, h) = ((x1 - x0).max(0) as u32, (y1 - y0).max(0) as u32);
    let mut out = black(w, h);
    paste(&mut out, img, -x0, -y0);
    out
}

/// Source origin, destination origin and size of a clipped paste.
type Clipped = ((usize, usize), (usize, usize), (usize, usize));

/// The part of `src` (`sw`×`sh`) that lands on a `dw`×`dh` canvas at `(x, y)`: source and destination origins and
/// the size, or `None` when nothing overlaps (Pillow's clipping in `ImagingPaste`).
fn clip((dw, dh): (u32, u32), (sw, sh): (u32, u32), x: i64, y: i64) -> Option<Clipped> {
    let (sx, sy) = ((-x).max(0), (-y).max(0));
    let (dx, dy) = (x.max(0), y.max(0));
    let w = (i64::from(sw) - sx).min(i64::from(dw) - dx);
    let h = (i64::from(sh) - sy).min(i64::from(dh) - dy);
    (w > 0 && h > 0).then_some((
        (sx as usize, sy as usize),
        (dx as usize, dy as usize),
        (w as usize, h as usize),
    ))
}

/// `dst.paste(src, (x, y))`.
pub fn paste(dst: &mut RgbImage, src: &RgbImage, x: i64, y: i64) {
    let Some(((sx, sy), (dx, dy), (w, h))) = clip((dst.width, dst.height), (src.width, src.height), x, y)
    else {
        return;
    };
    let (dst_stride, src_stride) = (dst.width as usize * 3, src.width as usize * 3);
    for r in 0..h {
        let d = (dy + r) * dst_stride + dx * 3;
        let s = (sy + r) * src_stride + sx * 3;
        dst.data[d..d + w * 3].copy_from_slice(&src.data[s..s + w * 3]);
    }
}

/// libImaging's `DIV255`: `v / 255` rounded, in integers.
#[inline]
fn div255(v: u32) -> u8 {
    let t = v + 128;
    (((t >> 8) + t) >> 8) as u8
}

/// `dst.paste(src, (x, y), mask)` with an "L" mask of `src`'s size (`mask[row * width + col]`, 255 = `src`):
/// each byte `BLEND(m, dst, src) = DIV255(dst·(255 − m) + src·m)`.
pub fn paste_masked(dst: &mut RgbImage, src: &RgbImage, mask: &[u8], x: i64, y: i64) {
    let Some(((sx, sy), (dx, dy), (w, h))) = clip((dst.width, dst.height), (src.width, src.height), x, y)
    else {
        return;
    };
    let (dst_stride, src_stride) = (dst.width as usize * 3, src.width as usize * 3);
    for r in 0..h {
        for c in 0..w {
            let m = u32::from(mask[(sy + r) * src.width as usize + sx + c]);
            let d = (dy + r) * dst_stride + (dx + c) * 3;
            let s = (sy + r) * src_stride + (sx + c) * 3;
            for ch in 0..3 {
                let (a, b) = (u32::from(dst.data[d + ch]), u32::from(src.data[s + ch]));
                dst.data[d + ch] = div255(a * (255 - m) + b * m);
            }
        }
    }
}

/// `Image.blend(a, b, alpha)` for images of one size: `a + alpha·(b − a)` in single precision, truncated (libImaging
/// takes alpha as a C float). `None` when the sizes differ. Alpha outside [0, 1] extrapolates, clamped to a byte.
pub fn blend(a: &RgbImage, b: &RgbImage, alpha: f64) -> Option<RgbImage> {
    if (a.width, a.height) != (b.width, b.height) {
        return None;
    }
    let alpha = alpha as f32;
    let data = a
        .data
        .iter()
        .zip(&b.data)
        .map(|(&p, &q)| {
            let v = f32::from(p) + alpha * (f32::from(q) - f32::from(p));
            // In [0, 1] Pillow casts directly; outside it clamps (its second branch).
            v.clamp(0.0, 255.0) as u8
        })
        .collect();
    Some(RgbImage { width: a.width, height: a.height, data })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(w: u32, h: u32) -> RgbImage {
        RgbImage { width: w, height: h, data: (0..w * h * 3).map(|i| (i * 7 % 251) as u8).collect() }
    }

    #[test]
    fn crop_outside_is_black_and_paste_clips() {
        let img = ramp(4, 3);
        let c = crop(&img, -2, -1, 3, 2);
        assert_eq!((c.width, c.height), (5, 3));
        assert_eq!(&c.data[..6 * 3], &[0; 18][..], "row 0 lies above the image");
        // Row 1 of the crop is row 0 of the image, starting 2 pixels in.
        assert_eq!(&c.data[5 * 3 + 6..5 * 3 + 9], &img.data[0..3]);
        let mut canvas = black(3, 3);
        paste(&mut canvas, &img, 1, -1);
        assert_eq!(&canvas.data[3..6], &img.data[4 * 3..4 * 3 + 3]);
        assert_eq!(&canvas.data[0..3], &[0, 0, 0]);
    }

    #[test]
    fn masked_paste_rounds_as_libimaging() {
        let mut dst = RgbImage { width: 1, height: 1, data: vec![10, 200, 255] };
        let src = RgbImage { width: 1, height: 1, data: vec![250, 0, 0] };
        paste_masked(&mut dst, &src, &[127], 0, 0);
        // DIV255(10·128 + 250·127) = DIV255(33030) = 130 (33030/255 = 129.53).
        assert_eq!(dst.data, vec![130, 100, 128]);
    }

    #[test]
    fn blend_truncates() {
        let a = RgbImage { width: 1, height: 1, data: vec![0, 100, 255] };
        let b = RgbImage { width: 1, height: 1, data: vec![255, 101, 0] };
        assert_eq!(blend(&a, &b, 0.5).map(|i| i.data), Some(vec![127, 100, 127]));
    }
}
