//! Plain 8-bit image buffers that cross the engine boundary, their decoding from user uploads (with a size cap so
//! a crafted file cannot exhaust memory), and the encoding of finished images as PNG, JPEG or WebP with the
//! generation parameters (A1111's infotext) where A1111 keeps them: a PNG `parameters` text chunk, or the EXIF
//! `UserComment` of a JPEG or WebP (piexif's encoding, as A1111's `save_image_with_geninfo` and its API write it).
//!
//! PNG rows are filtered with Sub and deflated in parallel strips as Huffman-coded literals and zero runs
//! (`png_strips`): fdeflate's way of coding PNG data, about 50× faster than zlib's default level for files about a
//! third larger, on several threads; Sub takes 25-40 % less time than adaptive filters for files 5-10 % larger
//! (`cargo bench -p sdhive-engine --bench encode`; `docs/benchmarks.md`). The encode is on every answer's path. JPEG goes through
//! `jpeg-encoder` (4:2:0 chroma below quality 90, as libjpeg's default); WebP is lossless, the only WebP that
//! pure-Rust encoders write.

use crate::png_strips;
use image::{imageops::FilterType, ImageEncoder as _, ImageReader};
use std::fmt;
use std::io::Cursor;
use thiserror::Error;

/// Interleaved RGB, row-major, 3 bytes per pixel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    pub width: u32,
    pub height: u32,
    pub data: Vec<u8>,
}

/// One byte per pixel (masks: 255 = repaint, 0 = keep).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrayImage {
    pub width: u32,
    pub height: u32,
    pub data: Vec<u8>,
}

#[derive(Debug, Error)]
pub enum ImageError {
    #[error("cannot decode image: {0}")]
    Decode(String),
    #[error("image is {width}x{height}, larger than the {max_pixels}-pixel limit")]
    TooLarge { width: u32, height: u32, max_pixels: u64 },
    #[error("cannot encode {format}: {message}")]
    Encode { format: ImageFormat, message: String },
    /// The infotext does not fit where the format keeps it (a JPEG's EXIF segment holds at most 64 KiB).
    #[error(
        "the generation parameters take {bytes} bytes of EXIF, more than the {max} a {format} can hold; \
         ask for png or webp"
    )]
    InfotextTooLong { format: ImageFormat, bytes: usize, max: usize },
}

/// Largest upload we decode: 8192×8192. Bigger inputs are refused before their pixels are allocated.
pub const DEFAULT_MAX_DECODE_PIXELS: u64 = 8192 * 8192;

fn decode_dynamic(bytes: &[u8], max_pixels: u64) -> Result<image::DynamicImage, ImageError> {
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| ImageError::Decode(e.to_string()))?;
    let (width, height) = reader.into_dimensions().map_err(|e| ImageError::Decode(e.to_string()))?;
    if u64::from(width) * u64::from(height) > max_pixels {
        return Err(ImageError::TooLarge { width, height, max_pixels });
    }
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| ImageError::Decode(e.to_string()))?;
    reader.decode().map_err(|e| ImageError::Decode(e.to_string()))
}

/// Decodes PNG/JPEG/WebP into RGB; transparency is dropped (composited onto nothing, as A1111 does for init images).
pub fn decode_image(bytes: &[u8], max_pixels: u64) -> Result<RgbImage, ImageError> {
    let img = decode_dynamic(bytes, max_pixels)?.to_rgb8();
    Ok(RgbImage { width: img.width(), height: img.height(), data: img.into_raw() })
}

/// Decodes a mask to luminance; an image with an alpha channel uses its luminance too, like A1111's `L` convert.
pub fn decode_mask(bytes: &[u8], max_pixels: u64) -> Result<GrayImage, ImageError> {
    let img = decode_dynamic(bytes, max_pixels)?.to_luma8();
    Ok(GrayImage { width: img.width(), height: img.height(), data: img.into_raw() })
}

impl RgbImage {
    /// Resamples to exactly `width`×`height` (Lanczos3), as A1111's "just resize" mode does.
    pub fn resized(&self, width: u32, height: u32) -> RgbImage {
        if (self.width, self.height) == (width, height) {
            return self.clone();
        }
        let buf = image::RgbImage::from_raw(self.width, self.height, self.data.clone())
            .expect("RgbImage invariant: data.len() == width * height * 3");
        let out = image::imageops::resize(&buf, width, height, FilterType::Lanczos3);
        RgbImage { width, height, data: out.into_raw() }
    }
}

impl GrayImage {
    pub fn resized(&self, width: u32, height: u32) -> GrayImage {
        if (self.width, self.height) == (width, height) {
            return self.clone();
        }
        let buf = image::GrayImage::from_raw(self.width, self.height, self.data.clone())
            .expect("GrayImage invariant: data.len() == width * height");
        let out = image::imageops::resize(&buf, width, height, FilterType::Lanczos3);
        GrayImage { width, height, data: out.into_raw() }
    }
}

/// The file format of an encoded image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ImageFormat {
    #[default]
    Png,
    Jpeg,
    Webp,
}

impl ImageFormat {
    pub const ALL: [ImageFormat; 3] = [ImageFormat::Png, ImageFormat::Jpeg, ImageFormat::Webp];
    /// The names [`ImageFormat::parse`] takes, for error messages.
    pub const EXPECTED: &'static str = "`png`, `jpeg` (or `jpg`) or `webp`";

    /// `png`, `jpeg` or `jpg` (A1111's spelling), `webp`; any case.
    pub fn parse(name: &str) -> Option<ImageFormat> {
        match name.trim().to_ascii_lowercase().as_str() {
            "png" => Some(ImageFormat::Png),
            "jpeg" | "jpg" => Some(ImageFormat::Jpeg),
            "webp" => Some(ImageFormat::Webp),
            _ => None,
        }
    }

    /// The canonical name, which is also the file extension (and OpenAI's `output_format` value).
    pub fn name(self) -> &'static str {
        match self {
            ImageFormat::Png => "png",
            ImageFormat::Jpeg => "jpeg",
            ImageFormat::Webp => "webp",
        }
    }

    pub fn mime(self) -> &'static str {
        match self {
            ImageFormat::Png => "image/png",
            ImageFormat::Jpeg => "image/jpeg",
            ImageFormat::Webp => "image/webp",
        }
    }
}

impl fmt::Display for ImageFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How a request's finished images are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OutputFormat {
    pub format: ImageFormat,
    /// JPEG quality, 0 (smallest file) to 100 (best image). PNG and WebP are lossless and ignore it.
    pub quality: u8,
}

impl OutputFormat {
    /// The JPEG quality of requests that name none.
    pub const DEFAULT_QUALITY: u8 = 90;
    pub const PNG: OutputFormat = OutputFormat { format: ImageFormat::Png, quality: Self::DEFAULT_QUALITY };

    /// `quality` above 100 is taken as 100.
    pub fn new(format: ImageFormat, quality: u8) -> OutputFormat {
        OutputFormat { format, quality: quality.min(100) }
    }
}

impl Default for OutputFormat {
    fn default() -> Self {
        OutputFormat::PNG
    }
}

/// The most EXIF bytes a JPEG carries: one APP1 segment of 64 KiB, less its length field and `Exif\0\0`.
pub const JPEG_MAX_EXIF: usize = 65_535 - 2 - 6;

/// Bytes of the EXIF block [`exif_with_comment`] writes around the comment text.
const EXIF_OVERHEAD: usize = 44 + 8;

/// Whether an infotext of `utf16_units` UTF-16 code units fits in `format`'s metadata.
pub fn infotext_fits(format: ImageFormat, utf16_units: usize) -> bool {
    format != ImageFormat::Jpeg || EXIF_OVERHEAD + 2 * utf16_units <= JPEG_MAX_EXIF
}

/// Encodes `img` as `output` says. `parameters` (the infotext) goes where A1111 puts it: a PNG's `parameters`
/// text chunk (tEXt, or iTXt when it is not Latin-1), a JPEG's or WebP's EXIF `UserComment`.
pub fn encode_image(
    img: &RgbImage,
    parameters: Option<&str>,
    output: OutputFormat,
) -> Result<Vec<u8>, ImageError> {
    let format = output.format;
    let fail = |message: String| ImageError::Encode { format, message };
    let expected = u64::from(img.width) * u64::from(img.height) * 3;
    if img.width == 0 || img.height == 0 || img.data.len() as u64 != expected {
        return Err(fail(format!(
            "a {}x{} RGB image needs {expected} bytes, got {}",
            img.width,
            img.height,
            img.data.len()
        )));
    }
    match format {
        ImageFormat::Png => encode_png_fast(img, parameters).map_err(|e| fail(e.to_string())),
        ImageFormat::Jpeg => encode_jpeg(img, parameters, output.quality),
        ImageFormat::Webp => {
            let mut out = Vec::new();
            let mut enc = image::codecs::webp::WebPEncoder::new_lossless(&mut out);
            if let Some(text) = parameters {
                enc.set_exif_metadata(exif_with_comment(text)).map_err(|e| fail(e.to_string()))?;
            }
            enc.write_image(&img.data, img.width, img.height, image::ExtendedColorType::Rgb8)
                .map_err(|e| fail(e.to_string()))?;
            Ok(out)
        }
    }
}

/// Encodes RGB8 as PNG with the infotext in a `parameters` chunk, which A1111's PNG Info tab and most image
/// browsers read back.
pub fn encode_png(img: &RgbImage, parameters: Option<&str>) -> Result<Vec<u8>, ImageError> {
    encode_image(img, parameters, OutputFormat::PNG)
}

fn encode_png_fast(img: &RgbImage, parameters: Option<&str>) -> Result<Vec<u8>, png::EncodingError> {
    let mut out = Vec::new();
    let mut enc = png::Encoder::new(&mut out, img.width, img.height);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    if let Some(text) = parameters {
        // tEXt is Latin-1 only; prompts are often not, so non-Latin-1 text goes in an iTXt chunk (UTF-8), as
        // Pillow's `PngInfo.add_text` (A1111's writer) does.
        if text.chars().all(|c| (c as u32) < 256) {
            enc.add_text_chunk("parameters".into(), text.into())?;
        } else {
            enc.add_itxt_chunk("parameters".into(), text.into())?;
        }
    }
    let mut writer = enc.write_header()?;
    writer
        .write_chunk(png::chunk::IDAT, &png_strips::zlib_image_data(&img.data, img.width as usize, None))?;
    writer.finish()?;
    Ok(out)
}

/// `bytes` in standard (padded) base64, written into `out`, which must hold `4 * ceil(len / 3)` bytes; returns
/// that length. Large inputs are encoded in chunks on the encoding threads: whole 3-byte groups encode on their
/// own, so the chunks' texts concatenate. A 512² PNG's base64 is nearly all of an answer's body.
pub fn base64_into(bytes: &[u8], out: &mut [u8]) -> usize {
    use base64::Engine as _;
    /// Input bytes per chunk (whole 3-byte groups).
    const CHUNK: usize = 3 * 32 * 1024;
    let len = bytes.len().div_ceil(3) * 4;
    assert!(
        out.len() >= len,
        "base64 of {} bytes needs {len} bytes of output, not {}",
        bytes.len(),
        out.len()
    );
    let encode = |(input, output): (&[u8], &mut [u8])| {
        base64::engine::general_purpose::STANDARD
            .encode_slice(input, output)
            .expect("the output holds the chunk's base64");
    };
    let out = &mut out[..len];
    match png_strips::pool() {
        Some(pool) if bytes.len() > CHUNK => pool.install(|| {
            use rayon::prelude::*;
            bytes.par_chunks(CHUNK).zip(out.par_chunks_mut(CHUNK / 3 * 4)).for_each(encode);
        }),
        _ => bytes.chunks(CHUNK).zip(out.chunks_mut(CHUNK / 3 * 4)).for_each(encode),
    }
    len
}

fn encode_jpeg(img: &RgbImage, parameters: Option<&str>, quality: u8) -> Result<Vec<u8>, ImageError> {
    let fail = |message: String| ImageError::Encode { format: ImageFormat::Jpeg, message };
    let (Ok(width), Ok(height)) = (u16::try_from(img.width), u16::try_from(img.height)) else {
        return Err(fail(format!("{}x{} is larger than a JPEG's 65535x65535", img.width, img.height)));
    };
    let mut out = Vec::new();
    // The encoder's scale starts at 1; Pillow's quality 0 is as coarse as its 1.
    let mut enc = jpeg_encoder::Encoder::new(&mut out, quality.clamp(1, 100));
    if let Some(text) = parameters {
        let exif = exif_with_comment(text);
        if exif.len() > JPEG_MAX_EXIF {
            return Err(ImageError::InfotextTooLong {
                format: ImageFormat::Jpeg,
                bytes: exif.len(),
                max: JPEG_MAX_EXIF,
            });
        }
        enc.add_exif_metadata(&exif).map_err(|e| fail(e.to_string()))?;
    }
    enc.encode(&img.data, width, height, jpeg_encoder::ColorType::Rgb).map_err(|e| fail(e.to_string()))?;
    Ok(out)
}

/// The EXIF block (TIFF, big-endian, no `Exif\0\0` prefix) that A1111 writes for JPEG and WebP:
/// `piexif.dump({"Exif": {UserComment: UserComment.dump(text, encoding="unicode")}})`, i.e. IFD0 holding only the
/// Exif-IFD pointer, and the Exif IFD holding only the `UserComment`: `UNICODE\0` then the text in UTF-16BE.
/// Unlike piexif, the Exif IFD ends with the next-IFD offset TIFF requires, for strict EXIF readers.
pub fn exif_with_comment(text: &str) -> Vec<u8> {
    const TYPE_LONG: u16 = 4;
    const TYPE_UNDEFINED: u16 = 7;
    let mut comment = b"UNICODE\0".to_vec();
    comment.extend(text.encode_utf16().flat_map(u16::to_be_bytes));
    let mut tiff = Vec::with_capacity(EXIF_OVERHEAD + comment.len());
    tiff.extend_from_slice(b"MM\0*");
    tiff.extend(8u32.to_be_bytes());
    // IFD0 at 8: one entry (2 + 12 bytes) and the next-IFD offset (4) put the Exif IFD at 26.
    let mut entry = |tag: u16, kind: u16, count: u32, value: u32| {
        tiff.extend(1u16.to_be_bytes());
        tiff.extend(tag.to_be_bytes());
        tiff.extend(kind.to_be_bytes());
        tiff.extend(count.to_be_bytes());
        tiff.extend(value.to_be_bytes());
        tiff.extend(0u32.to_be_bytes());
    };
    entry(0x8769, TYPE_LONG, 1, 26);
    // The Exif IFD at 26 is 18 bytes long: the comment follows at 44. An over-long comment is refused by the
    // caller (JPEG) or cannot occur (WebP takes 4 GiB, prompts are capped far below that).
    entry(0x9286, TYPE_UNDEFINED, u32::try_from(comment.len()).unwrap_or(u32::MAX), 44);
    tiff.extend(comment);
    tiff
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_text_chunks(png_bytes: &[u8]) -> Vec<(String, String)> {
        let decoder = png::Decoder::new(Cursor::new(png_bytes));
        let reader = decoder.read_info().unwrap();
        let info = reader.info();
        let mut chunks: Vec<(String, String)> =
            info.uncompressed_latin1_text.iter().map(|c| (c.keyword.clone(), c.text.clone())).collect();
        for c in &info.utf8_text {
            chunks.push((c.keyword.clone(), c.get_text().unwrap()));
        }
        chunks
    }

    #[test]
    fn base64_in_chunks_equals_base64_whole() {
        use base64::Engine as _;
        for len in [0usize, 1, 2, 3, 4, 98_303, 98_304, 98_305, 300_001, 1_000_000] {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
            let mut out = vec![0; len.div_ceil(3) * 4];
            assert_eq!(base64_into(&bytes, &mut out), out.len());
            assert!(
                out == base64::engine::general_purpose::STANDARD.encode(&bytes).into_bytes(),
                "{len} bytes"
            );
        }
    }

    #[test]
    fn png_round_trip_keeps_pixels_and_parameters() {
        let img = RgbImage { width: 3, height: 2, data: (0..18).map(|v| v * 10).collect() };
        let bytes = encode_png(&img, Some("a cat\nSteps: 20, Seed: 1")).unwrap();
        let back = decode_image(&bytes, DEFAULT_MAX_DECODE_PIXELS).unwrap();
        assert_eq!(back, img);
        assert_eq!(read_text_chunks(&bytes), vec![("parameters".into(), "a cat\nSteps: 20, Seed: 1".into())]);
    }

    #[test]
    fn non_latin1_parameters_survive_as_utf8() {
        let img = RgbImage { width: 1, height: 1, data: vec![1, 2, 3] };
        let bytes = encode_png(&img, Some("猫 🐱")).unwrap();
        assert_eq!(read_text_chunks(&bytes), vec![("parameters".into(), "猫 🐱".into())]);
    }

    /// A smooth 48×40 gradient with texture: JPEG keeps it close, and no row is flat.
    fn gradient() -> RgbImage {
        let (width, height) = (48u32, 40u32);
        let data = (0..height)
            .flat_map(|y| {
                (0..width).flat_map(move |x| [(x * 5) as u8, (y * 6) as u8, ((x * 3 + y * 2) % 256) as u8])
            })
            .collect();
        RgbImage { width, height, data }
    }

    fn exif_of(bytes: &[u8], format: ImageFormat) -> Option<Vec<u8>> {
        use image::ImageDecoder;
        match format {
            ImageFormat::Jpeg => {
                image::codecs::jpeg::JpegDecoder::new(Cursor::new(bytes)).unwrap().exif_metadata().unwrap()
            }
            ImageFormat::Webp => {
                image::codecs::webp::WebPDecoder::new(Cursor::new(bytes)).unwrap().exif_metadata().unwrap()
            }
            ImageFormat::Png => None,
        }
    }

    #[test]
    fn every_format_round_trips_with_its_infotext() {
        let img = gradient();
        let text = "a cat, caf\u{e9} 猫\nNegative prompt: dog\nSteps: 20, Seed: 1, Size: 48x40";
        for format in ImageFormat::ALL {
            let bytes = encode_image(&img, Some(text), OutputFormat::new(format, 90)).unwrap();
            let guessed = image::guess_format(&bytes).unwrap();
            let expected = match format {
                ImageFormat::Png => image::ImageFormat::Png,
                ImageFormat::Jpeg => image::ImageFormat::Jpeg,
                ImageFormat::Webp => image::ImageFormat::WebP,
            };
            assert_eq!(guessed, expected, "{format}");
            let back = decode_image(&bytes, DEFAULT_MAX_DECODE_PIXELS).unwrap();
            assert_eq!((back.width, back.height), (img.width, img.height), "{format}");
            if format == ImageFormat::Jpeg {
                let mean_error =
                    back.data.iter().zip(&img.data).map(|(a, b)| f64::from(a.abs_diff(*b))).sum::<f64>()
                        / img.data.len() as f64;
                assert!(mean_error < 4.0, "JPEG q90 is {mean_error} levels off on average");
            } else {
                assert_eq!(back, img, "{format} is lossless");
            }
            match format {
                ImageFormat::Png => {
                    assert_eq!(read_text_chunks(&bytes), vec![("parameters".into(), text.into())])
                }
                _ => assert_eq!(exif_of(&bytes, format), Some(exif_with_comment(text)), "{format}"),
            }
            let bare = encode_image(&img, None, OutputFormat::new(format, 90)).unwrap();
            assert!(bare.len() < bytes.len(), "{format}: the infotext takes room");
            if format != ImageFormat::Png {
                assert_eq!(exif_of(&bare, format), None, "{format} without an infotext has no EXIF");
            }
        }
    }

    #[test]
    fn exif_block_is_what_piexif_dumps() {
        // piexif.dump({"Exif": {37510: UserComment.dump("a\u{e9}", encoding="unicode")}})[6:], plus the Exif IFD's
        // next-IFD offset, which TIFF requires and piexif leaves out (so the comment starts at 44, not 40);
        // piexif.load reads both.
        let want: Vec<u8> = [
            &b"MM\0*\0\0\0\x08"[..],
            b"\0\x01\x87\x69\0\x04\0\0\0\x01\0\0\0\x1a\0\0\0\0",
            b"\0\x01\x92\x86\0\x07\0\0\0\x0c\0\0\0\x2c\0\0\0\0",
            b"UNICODE\0\0a\0\xe9",
        ]
        .concat();
        assert_eq!(exif_with_comment("a\u{e9}"), want);
    }

    #[test]
    fn jpeg_quality_trades_size_for_fidelity() {
        let img = gradient();
        let size = |q| encode_image(&img, None, OutputFormat::new(ImageFormat::Jpeg, q)).unwrap().len();
        assert!(size(0) < size(50) && size(50) < size(100), "{} {} {}", size(0), size(50), size(100));
        assert_eq!(OutputFormat::new(ImageFormat::Jpeg, 250).quality, 100);
    }

    #[test]
    fn an_infotext_too_long_for_a_jpeg_is_refused_and_fits_elsewhere() {
        let img = gradient();
        let units = (JPEG_MAX_EXIF - EXIF_OVERHEAD) / 2;
        assert!(infotext_fits(ImageFormat::Jpeg, units) && !infotext_fits(ImageFormat::Jpeg, units + 1));
        let fits = "x".repeat(units);
        assert!(encode_image(&img, Some(&fits), OutputFormat::new(ImageFormat::Jpeg, 80)).is_ok());
        let long = "x".repeat(units + 1);
        let e = encode_image(&img, Some(&long), OutputFormat::new(ImageFormat::Jpeg, 80)).unwrap_err();
        assert!(matches!(e, ImageError::InfotextTooLong { format: ImageFormat::Jpeg, .. }), "{e}");
        assert!(e.to_string().contains("png or webp"), "{e}");
        for format in [ImageFormat::Png, ImageFormat::Webp] {
            assert!(infotext_fits(format, units * 4));
            let bytes = encode_image(&img, Some(&long), OutputFormat::new(format, 80)).unwrap();
            assert!(decode_image(&bytes, DEFAULT_MAX_DECODE_PIXELS).is_ok());
        }
    }

    #[test]
    fn formats_parse_by_their_names() {
        for format in ImageFormat::ALL {
            assert_eq!(ImageFormat::parse(format.name()), Some(format));
            assert_eq!(ImageFormat::parse(&format.name().to_uppercase()), Some(format));
        }
        assert_eq!(ImageFormat::parse(" jpg "), Some(ImageFormat::Jpeg));
        assert_eq!(ImageFormat::parse("gif"), None);
        assert_eq!(OutputFormat::default().format, ImageFormat::Png);
    }

    #[test]
    fn malformed_buffers_are_errors_not_panics() {
        for format in ImageFormat::ALL {
            let short = RgbImage { width: 4, height: 4, data: vec![0; 47] };
            assert!(matches!(
                encode_image(&short, None, OutputFormat::new(format, 80)),
                Err(ImageError::Encode { .. })
            ));
            let empty = RgbImage { width: 0, height: 4, data: vec![] };
            assert!(encode_image(&empty, None, OutputFormat::new(format, 80)).is_err());
        }
        let wide = RgbImage { width: 70_000, height: 1, data: vec![0; 210_000] };
        assert!(encode_image(&wide, None, OutputFormat::new(ImageFormat::Jpeg, 80)).is_err());
    }

    #[test]
    fn garbage_and_oversized_inputs_are_errors() {
        assert!(matches!(decode_image(b"not an image", 100), Err(ImageError::Decode(_))));
        let img = RgbImage { width: 20, height: 20, data: vec![0; 1200] };
        let bytes = encode_png(&img, None).unwrap();
        assert!(matches!(decode_image(&bytes, 100), Err(ImageError::TooLarge { .. })));
        assert!(matches!(decode_image(&bytes[..bytes.len() / 2], 1000), Err(ImageError::Decode(_))));
    }

    #[test]
    fn mask_decodes_to_luma() {
        let img = RgbImage { width: 2, height: 1, data: vec![255, 255, 255, 0, 0, 0] };
        let bytes = encode_png(&img, None).unwrap();
        let m = decode_mask(&bytes, 100).unwrap();
        assert_eq!(m.data, vec![255, 0]);
    }
}
