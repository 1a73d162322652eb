//! Encoding time and size of one finished image, 512² and 1024², in every output format: the PNG encoders the
//! worker used before (zlib's default level, then fdeflate with adaptive filters, then with the Sub filter, all on
//! one thread), today's PNG (Sub filter, strips deflated in parallel), JPEG at A1111's default quality (80) and at ours (90), and lossless WebP, each with a typical
//! infotext. Prints a Markdown table (`docs/benchmarks.md`).
//!
//! The image is a generated landscape (sky with clouds, textured hills, fine grain) whose PNG compresses like a
//! photograph's; `--image FILE` takes a real image instead, centre-cropped and resized to each side, and `--noise`
//! a noise-like one (each channel value random), as random-weight models make.
//!
//!     cargo bench -p sdhive-engine --bench encode [-- --image photo.jpg | --noise] [-- --iters 15] [-- --idle-ms 100]

use sdhive_engine::{encode_image, ImageFormat, OutputFormat, RgbImage};
use std::time::Instant;

const INFOTEXT: &str = "a photo of an astronaut riding a horse on the moon, highly detailed, 8k\n\
    Negative prompt: blurry, lowres\n\
    Steps: 20, Sampler: Euler a, Schedule type: Automatic, CFG scale: 7, Seed: 1234, Size: 512x512, \
    Model hash: 6ce0161689, Model: v1-5-pruned-emaonly, Version: sdhive 0.1.0";

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let photo = value("--image");
    let iters: usize = value("--iters").and_then(|v| v.parse().ok()).unwrap_or(9);
    let idle_ms: u64 = value("--idle-ms").and_then(|v| v.parse().ok()).unwrap_or(0);
    let noisy = args.iter().any(|a| a == "--noise");
    let source = photo.as_deref().unwrap_or(if noisy { "noise" } else { "generated landscape" });
    println!("Encoding one RGB image with its infotext ({source}; median of {iters})\n");
    println!("| format | 512² ms | 512² KiB | 1024² ms | 1024² KiB |");
    println!("|---|---:|---:|---:|---:|");
    let images: Vec<RgbImage> = [512u32, 1024]
        .iter()
        .map(|&side| match &photo {
            Some(path) => load(path, side),
            None if noisy => noise(side),
            None => landscape(side),
        })
        .collect();
    type Encode = Box<dyn Fn(&RgbImage) -> Vec<u8>>;
    let with = |output: OutputFormat| -> Encode {
        Box::new(move |img: &RgbImage| encode_image(img, Some(INFOTEXT), output).expect("encodes"))
    };
    let rows: Vec<(&str, Encode)> = vec![
        (
            "PNG, before (zlib level 6, adaptive filter)",
            Box::new(|img: &RgbImage| png_crate(img, None, png::Filter::Adaptive)),
        ),
        (
            "PNG, before (fdeflate, adaptive filter)",
            Box::new(|img: &RgbImage| {
                png_crate(img, Some(png::DeflateCompression::FdeflateUltraFast), png::Filter::Adaptive)
            }),
        ),
        (
            "PNG, before (fdeflate, Sub filter, one thread)",
            Box::new(|img: &RgbImage| {
                png_crate(img, Some(png::DeflateCompression::FdeflateUltraFast), png::Filter::Sub)
            }),
        ),
        ("PNG (Sub filter, strips deflated in parallel)", with(OutputFormat::PNG)),
        ("JPEG quality 80", with(OutputFormat::new(ImageFormat::Jpeg, 80))),
        ("JPEG quality 90", with(OutputFormat::new(ImageFormat::Jpeg, 90))),
        ("WebP (lossless)", with(OutputFormat::new(ImageFormat::Webp, 90))),
    ];
    for (name, encode) in rows {
        let cells: Vec<String> = images
            .iter()
            .map(|img| {
                let (ms, bytes) = time(iters, idle_ms, || encode(img));
                format!("{ms:.1} | {:.0}", bytes as f64 / 1024.0)
            })
            .collect();
        println!("| {name} | {} |", cells.join(" | "));
    }
}

/// Median milliseconds of `iters` calls after one warm-up, each after `idle_ms` asleep (as a worker's encoding
/// thread waits between images), and the output's size.
fn time(iters: usize, idle_ms: u64, mut f: impl FnMut() -> Vec<u8>) -> (f64, usize) {
    let bytes = f().len();
    let mut ms: Vec<f64> = (0..iters.max(1))
        .map(|_| {
            std::thread::sleep(std::time::Duration::from_millis(idle_ms));
            let started = Instant::now();
            std::hint::black_box(f());
            started.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    (ms[ms.len() / 2], bytes)
}

/// A PNG as the `png` crate writes it on one thread, as the worker did before: with its default deflate (`None`,
/// zlib's level 6) or the one given.
fn png_crate(img: &RgbImage, deflate: Option<png::DeflateCompression>, filter: png::Filter) -> Vec<u8> {
    let mut out = Vec::new();
    let mut enc = png::Encoder::new(&mut out, img.width, img.height);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    if let Some(deflate) = deflate {
        enc.set_deflate_compression(deflate);
    }
    enc.set_filter(filter);
    enc.add_text_chunk("parameters".into(), INFOTEXT.into()).expect("a Latin-1 text");
    let mut writer = enc.write_header().expect("header");
    writer.write_image_data(&img.data).expect("image data");
    writer.finish().expect("finish");
    out
}

fn load(path: &str, side: u32) -> RgbImage {
    let img = image::open(path).unwrap_or_else(|e| panic!("cannot read {path}: {e}")).to_rgb8();
    let s = img.width().min(img.height());
    let crop =
        image::imageops::crop_imm(&img, (img.width() - s) / 2, (img.height() - s) / 2, s, s).to_image();
    let out = image::imageops::resize(&crop, side, side, image::imageops::FilterType::Triangle);
    RgbImage { width: side, height: side, data: out.into_raw() }
}

/// Every channel value random: a random-weight model's image, which no PNG filter makes compressible.
fn noise(side: u32) -> RgbImage {
    let data = (0..u64::from(side) * u64::from(side) * 3).map(|i| (hash(i) >> 56) as u8).collect();
    RgbImage { width: side, height: side, data }
}

fn hash(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// A value in [0, 1) fixed by the lattice point and `salt`.
fn lattice(i: i64, j: i64, salt: u64) -> f32 {
    let h = hash(
        (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ (j as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9)
            ^ salt,
    );
    (h >> 40) as f32 / (1u64 << 24) as f32
}

/// Smoothly interpolated lattice noise.
fn value_noise(x: f32, y: f32, salt: u64) -> f32 {
    let (xi, yi) = (x.floor(), y.floor());
    let smooth = |t: f32| t * t * (3.0 - 2.0 * t);
    let (sx, sy) = (smooth(x - xi), smooth(y - yi));
    let (i, j) = (xi as i64, yi as i64);
    let top = lattice(i, j, salt) + (lattice(i + 1, j, salt) - lattice(i, j, salt)) * sx;
    let bottom = lattice(i, j + 1, salt) + (lattice(i + 1, j + 1, salt) - lattice(i, j + 1, salt)) * sx;
    top + (bottom - top) * sy
}

/// Octaves of noise with amplitude halving as frequency doubles: the 1/f spectrum of natural images.
fn fractal(x: f32, y: f32, octaves: u32, salt: u64) -> f32 {
    let (mut sum, mut amplitude, mut frequency, mut norm) = (0.0, 1.0, 1.0, 0.0);
    for octave in 0..octaves {
        sum += amplitude * value_noise(x * frequency, y * frequency, salt + u64::from(octave) * 7919);
        norm += amplitude;
        amplitude *= 0.5;
        frequency *= 2.0;
    }
    sum / norm
}

/// Sky with clouds over textured hills, with a little per-pixel grain; features scale with the image, as a
/// model's composition does.
fn landscape(side: u32) -> RgbImage {
    let n = side as f32;
    let mut data = Vec::with_capacity((side * side * 3) as usize);
    for y in 0..side {
        for x in 0..side {
            let (u, v) = (x as f32 / n, y as f32 / n);
            let horizon = 0.45 + 0.24 * (fractal(u * 3.0, 0.5, 4, 11) - 0.5);
            let grain = (lattice(i64::from(x), i64::from(y), 99) - 0.5) * 6.0;
            let rgb = if v < horizon {
                let t = v / horizon;
                let cloud = (fractal(u * 4.0, v * 6.0, 6, 51) - 0.45).max(0.0) * 2.2;
                [
                    90.0 + 100.0 * t + 120.0 * cloud,
                    140.0 + 70.0 * t + 90.0 * cloud,
                    220.0 + 20.0 * t + 30.0 * cloud,
                ]
            } else {
                let t = (v - horizon) / (1.0 - horizon);
                let mix = fractal(u * 5.0, v * 5.0, 5, 71);
                let shade =
                    0.55 + 0.6 * fractal(u * 8.0, v * 8.0, 7, 23) + 0.25 * fractal(u * 64.0, v * 64.0, 3, 37)
                        - 0.2 * t;
                [
                    (60.0 + 80.0 * mix) * shade,
                    (90.0 + 60.0 * (1.0 - mix)) * shade,
                    (40.0 + 30.0 * mix) * shade,
                ]
            };
            data.extend(rgb.map(|c: f32| (c + grain).round().clamp(0.0, 255.0) as u8));
        }
    }
    RgbImage { width: side, height: side, data }
}
