//! Plain 8-bit image buffers that cross the engine boundary, their decoding from user uploads (with a size cap so
//! a crafted file cannot exhaust memory) and PNG encoding with the A1111 `parameters` text chunk.

use image::{imageops::FilterType, ImageReader};
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
    #[error("cannot encode PNG: {0}")]
    Encode(String),
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

/// Encodes RGB8 as PNG; `parameters` becomes a `tEXt` chunk named `parameters`, which A1111's PNG Info tab
/// and most image browsers read back.
pub fn encode_png(img: &RgbImage, parameters: Option<&str>) -> Result<Vec<u8>, ImageError> {
    let mut out = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut out, img.width, img.height);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        if let Some(text) = parameters {
            // tEXt is Latin-1 only; prompts are often not, so non-Latin-1 text goes in an iTXt chunk (UTF-8).
            if text.chars().all(|c| (c as u32) < 256) {
                enc.add_text_chunk("parameters".into(), text.into())
            } else {
                enc.add_itxt_chunk("parameters".into(), text.into())
            }
            .map_err(|e| ImageError::Encode(e.to_string()))?;
        }
        let mut writer = enc.write_header().map_err(|e| ImageError::Encode(e.to_string()))?;
        writer.write_image_data(&img.data).map_err(|e| ImageError::Encode(e.to_string()))?;
        writer.finish().map_err(|e| ImageError::Encode(e.to_string()))?;
    }
    Ok(out)
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
