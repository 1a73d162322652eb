//! Pillow's `Image.resize` of 8-bit RGB images, bit for bit as Pillow 9.5 (A1111's pin) to 12 compute it: the
//! convolution resampler of libImaging's `Resample.c` (BILINEAR, BICUBIC, LANCZOS; horizontal pass first, where
//! Pillow 13 runs the vertical one first when the height shrinks much more than the width) and, for NEAREST, the
//! affine scale of `Geometry.c` that Pillow's `_resize` sends nearest-neighbour resizes to. A1111 resizes with LANCZOS ("Lanczos", "None" and every final
//! fit to size) and NEAREST ("Nearest").

use rayon::prelude::*;
use sdhive_engine::RgbImage;

/// Pillow's `Image.Resampling` members this crate reproduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Filter {
    Nearest,
    Bilinear,
    Bicubic,
    Lanczos,
}

/// Pillow's fixed-point coefficients: 32 bits less 8 for the pixel value and 2 for the filters' overshoot.
const PRECISION_BITS: u32 = 32 - 8 - 2;

impl Filter {
    /// The filter's support at scale 1 (Pillow's `struct filter` tables).
    fn support(self) -> f64 {
        match self {
            Filter::Nearest => 0.0,
            Filter::Bilinear => 1.0,
            Filter::Bicubic => 2.0,
            Filter::Lanczos => 3.0,
        }
    }

    /// The filter's weight at `x`, in Pillow's operation order (so every coefficient rounds the same way).
    fn weight(self, x: f64) -> f64 {
        match self {
            Filter::Nearest => 0.0,
            Filter::Bilinear => {
                let x = x.abs();
                if x < 1.0 {
                    1.0 - x
                } else {
                    0.0
                }
            }
            Filter::Bicubic => {
                const A: f64 = -0.5;
                let x = x.abs();
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }
            Filter::Lanczos => {
                if (-3.0..3.0).contains(&x) {
                    sinc(x) * sinc(x / 3.0)
                } else {
                    0.0
                }
            }
        }
    }
}

fn sinc(x: f64) -> f64 {
    if x == 0.0 {
        return 1.0;
    }
    let x = x * std::f64::consts::PI;
    x.sin() / x
}

/// One pass's coefficients: for each output pixel the first input pixel it reads, how many, and their weights.
struct Coeffs {
    /// `(first, count)` per output pixel.
    bounds: Vec<(usize, usize)>,
    /// `ksize` fixed-point weights per output pixel.
    k: Vec<i32>,
    ksize: usize,
}

/// Pillow's `precompute_coeffs` followed by `normalize_coeffs_8bpc`: the source span `[in0, in1)` of an axis of
/// `in_size` pixels onto `out_size` pixels, the filter widened by the downscale factor, each output pixel's
/// weights normalised in double precision, then rounded to fixed point.
fn coeffs(in_size: usize, in0: f32, in1: f32, out_size: usize, filter: Filter) -> Coeffs {
    // The span is a float difference in Pillow (exact for the integer boxes used here).
    let scale = f64::from(in1 - in0) / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = filterscale * filter.support();
    let ksize = support.ceil() as usize * 2 + 1;
    let mut bounds = Vec::with_capacity(out_size);
    let mut k = vec![0i32; out_size * ksize];
    let mut weights = vec![0f64; ksize];
    for xx in 0..out_size {
        let center = f64::from(in0) + (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        // C's `(int)` truncates toward zero; the clamp at 0 makes that the same as Pillow's rounding intent.
        let xmin = ((center - support + 0.5) as i64).max(0);
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64);
        let count = (xmax - xmin).clamp(0, ksize as i64) as usize;
        let mut ww = 0.0;
        for (x, w) in weights.iter_mut().enumerate().take(count) {
            *w = filter.weight(((x as i64 + xmin) as f64 - center + 0.5) * ss);
            ww += *w;
        }
        for (x, w) in weights.iter().enumerate().take(count) {
            let w = if ww != 0.0 { w / ww } else { *w };
            // `normalize_coeffs_8bpc`: round half away from zero by truncating ±0.5 + w·2²².
            let fixed = w * f64::from(1u32 << PRECISION_BITS);
            k[xx * ksize + x] = if w < 0.0 { (-0.5 + fixed) as i32 } else { (0.5 + fixed) as i32 };
        }
        bounds.push((xmin as usize, count));
    }
    Coeffs { bounds, k, ksize }
}

/// Pillow's `clip8`: the accumulator's integer part, clamped to a byte.
#[inline]
fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

/// The rounding half that every accumulator starts from.
const HALF: i32 = 1 << (PRECISION_BITS - 1);

/// `img` resized to `width`×`height` as Pillow's `img.resize((width, height), resample=filter)`. A zero width
/// or height gives an empty image (Pillow refuses those sizes).
pub fn resize(img: &RgbImage, width: u32, height: u32, filter: Filter) -> RgbImage {
    resize_box(img, width, height, filter, [0.0, 0.0, img.width as f32, img.height as f32])
}

/// Pillow's `img.resize((width, height), resample=filter, box=source_box)`: only the region
/// `(x0, y0, x1, y1)` of the source is scaled onto the output (an empty box along an axis is allowed, as in
/// Pillow: A1111's "resize and fill" stretches the edge rows that way). The box must lie inside the image.
pub fn resize_box(img: &RgbImage, width: u32, height: u32, filter: Filter, source_box: [f32; 4]) -> RgbImage {
    let (w, h) = (width as usize, height as usize);
    if w == 0 || h == 0 {
        return RgbImage { width, height, data: Vec::new() };
    }
    let full = [0.0, 0.0, img.width as f32, img.height as f32];
    if (width, height) == (img.width, img.height) && source_box == full {
        return img.clone();
    }
    // Pillow's `_resize`: an integer box of the output's size is a crop.
    let [x0, y0, x1, y1] = source_box;
    if x0.fract() == 0.0 && y0.fract() == 0.0 && x1 - x0 == w as f32 && y1 - y0 == h as f32 {
        return crate::pillow::crop(img, x0 as i64, y0 as i64, x1 as i64, y1 as i64);
    }
    if filter == Filter::Nearest {
        return nearest(img, w, h, source_box);
    }
    let (in_w, in_h) = (img.width as usize, img.height as usize);
    let horiz = coeffs(in_w, source_box[0], source_box[2], w, filter);
    let vert = coeffs(in_h, source_box[1], source_box[3], h, filter);
    // As `ImagingResampleInner`: a pass runs only where its axis changes.
    let need_horizontal = w != in_w || source_box[0] != 0.0 || source_box[2] != w as f32;
    let need_vertical = h != in_h || source_box[1] != 0.0 || source_box[3] != h as f32;

    // The horizontal pass covers only the rows the vertical one reads.
    let (first_row, last_row) = match (vert.bounds.first(), vert.bounds.last()) {
        (Some(&(f, _)), Some(&(l, n))) => (f, l + n),
        _ => (0, 0),
    };
    let (src, src_w, row0) = if need_horizontal {
        let rows = last_row.saturating_sub(first_row);
        let mut tmp = vec![0u8; rows * w * 3];
        tmp.par_chunks_mut(w * 3).enumerate().for_each(|(r, out)| {
            let row = &img.data[(first_row + r) * in_w * 3..(first_row + r + 1) * in_w * 3];
            horizontal_row(row, out, &horiz);
        });
        (std::borrow::Cow::Owned(tmp), w, first_row)
    } else {
        (std::borrow::Cow::Borrowed(&img.data[..]), in_w, 0)
    };
    if !need_vertical {
        // Only reached with a horizontal pass over every row (the vertical bounds are the identity).
        return RgbImage { width, height, data: src.into_owned() };
    }
    let mut data = vec![0u8; w * h * 3];
    data.par_chunks_mut(w * 3).enumerate().for_each(|(yy, out)| {
        let (ymin, count) = vert.bounds[yy];
        let k = &vert.k[yy * vert.ksize..yy * vert.ksize + count];
        for (xx, px) in out.iter_mut().enumerate() {
            let mut acc = HALF;
            for (y, &ky) in k.iter().enumerate() {
                acc += i32::from(src[(ymin + y - row0) * src_w * 3 + xx]) * ky;
            }
            *px = clip8(acc);
        }
    });
    RgbImage { width, height, data }
}

fn horizontal_row(row: &[u8], out: &mut [u8], c: &Coeffs) {
    for (xx, px) in out.chunks_exact_mut(3).enumerate() {
        let (xmin, count) = c.bounds[xx];
        let k = &c.k[xx * c.ksize..xx * c.ksize + count];
        let (mut s0, mut s1, mut s2) = (HALF, HALF, HALF);
        for (x, &kx) in k.iter().enumerate() {
            let p = &row[(xmin + x) * 3..(xmin + x) * 3 + 3];
            s0 += i32::from(p[0]) * kx;
            s1 += i32::from(p[1]) * kx;
            s2 += i32::from(p[2]) * kx;
        }
        px[0] = clip8(s0);
        px[1] = clip8(s1);
        px[2] = clip8(s2);
    }
}

/// Pillow's `COORD`: −1 for negative positions, else truncation.
fn coord(v: f64) -> i64 {
    if v < 0.0 {
        -1
    } else {
        v as i64
    }
}

/// NEAREST as Pillow runs it: `ImagingScaleAffine` with `a = ((x1 - x0) / w, 0, x0, 0, (y1 - y0) / h, y0)`,
/// sampling at pixel centres by repeated addition (the accumulated rounding decides ties, as in Pillow).
fn nearest(img: &RgbImage, w: usize, h: usize, b: [f32; 4]) -> RgbImage {
    let a0 = f64::from(b[2] - b[0]) / w as f64;
    let a4 = f64::from(b[3] - b[1]) / h as f64;
    let (in_w, in_h) = (img.width as i64, img.height as i64);
    let mut xin = vec![None; w];
    let mut xo = f64::from(b[0]) + a0 * 0.5;
    for slot in xin.iter_mut() {
        let x = coord(xo);
        if (0..in_w).contains(&x) {
            *slot = Some(x as usize);
        }
        xo += a0;
    }
    let mut rows = Vec::with_capacity(h);
    let mut yo = f64::from(b[1]) + a4 * 0.5;
    for _ in 0..h {
        let y = coord(yo);
        rows.push((0..in_h).contains(&y).then_some(y as usize));
        yo += a4;
    }
    let in_w = in_w as usize;
    let mut data = vec![0u8; w * h * 3];
    data.par_chunks_mut(w * 3).zip(rows.par_iter()).for_each(|(out, row)| {
        // Pillow fills first: rows and columns that map outside the source stay black.
        let Some(y) = row else { return };
        let src = &img.data[y * in_w * 3..(y + 1) * in_w * 3];
        for (px, x) in out.chunks_exact_mut(3).zip(&xin) {
            if let Some(x) = x {
                px.copy_from_slice(&src[x * 3..x * 3 + 3]);
            }
        }
    });
    RgbImage { width: w as u32, height: h as u32, data }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_size_is_a_copy_and_empty_sizes_are_empty() {
        let img = RgbImage { width: 2, height: 1, data: vec![1, 2, 3, 4, 5, 6] };
        assert_eq!(resize(&img, 2, 1, Filter::Lanczos), img);
        assert!(resize(&img, 0, 3, Filter::Bicubic).data.is_empty());
    }

    /// Every resize golden of the fixtures (up, down, mixed, 1x1, boxes empty along an axis) bit for bit.
    #[test]
    fn matches_pillow_exactly() {
        let goldens = crate::fixtures::Goldens::load();
        let cases = crate::fixtures::cases();
        let cases = cases["resize"].as_array().expect("resize cases");
        assert!(cases.len() >= 40);
        for case in cases {
            let name = case["golden"].as_str().expect("golden");
            let src = crate::fixtures::image(case["source"].as_str().expect("source"));
            let filter = match case["filter"].as_str() {
                Some("lanczos") => Filter::Lanczos,
                Some("nearest") => Filter::Nearest,
                Some("bicubic") => Filter::Bicubic,
                Some("bilinear") => Filter::Bilinear,
                other => panic!("{name}: filter {other:?}"),
            };
            let (w, h) =
                (case["width"].as_u64().expect("width") as u32, case["height"].as_u64().expect("h") as u32);
            let out = match case["box"].as_array() {
                Some(b) => {
                    let b: Vec<f32> = b.iter().map(|v| v.as_f64().expect("box") as f32).collect();
                    resize_box(&src, w, h, filter, [b[0], b[1], b[2], b[3]])
                }
                None => resize(&src, w, h, filter),
            };
            let want = goldens.get(name);
            let (max, _) = crate::fixtures::diff(&out, &want);
            assert_eq!(max, 0, "{name}: differs from Pillow by up to {max} levels");
        }
    }

    #[test]
    fn coefficients_sum_to_one_in_fixed_point() {
        for filter in [Filter::Bilinear, Filter::Bicubic, Filter::Lanczos] {
            for (i, o) in [(23, 50), (50, 23), (17, 7), (7, 17)] {
                let c = coeffs(i, 0.0, i as f32, o, filter);
                for (xx, &(_, n)) in c.bounds.iter().enumerate() {
                    let sum: i32 = c.k[xx * c.ksize..xx * c.ksize + n].iter().sum();
                    assert!((sum - (1 << PRECISION_BITS)).abs() <= n as i32, "{filter:?} {i}->{o}: {sum}");
                }
            }
        }
    }
}
