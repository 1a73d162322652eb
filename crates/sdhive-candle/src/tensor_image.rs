//! Conversions between 8-bit images and the tensors the VAE reads and writes, with diffusers'
//! `VaeImageProcessor` arithmetic (x/255 → 2x−1 in; x·0.5+0.5, clamp, ·255, round out) and its mask handling.

use candle_core::{DType, Device, Result, Tensor};
use sdhive_engine::{GrayImage, RgbImage};

/// `[1, 3, H, W]` f32 in [-1, 1].
pub fn image_to_tensor(img: &RgbImage, device: &Device) -> Result<Tensor> {
    let (w, h) = (img.width as usize, img.height as usize);
    let data: Vec<f32> = img.data.iter().map(|&v| 2.0 * (f32::from(v) / 255.0) - 1.0).collect();
    Tensor::from_vec(data, (h, w, 3), device)?.permute((2, 0, 1))?.unsqueeze(0)?.contiguous()
}

/// diffusers' mask processor: luminance/255 binarised at 0.5, `[1, 1, H, W]` f32 of 0/1.
pub fn mask_to_tensor(mask: &GrayImage, device: &Device) -> Result<Tensor> {
    let (w, h) = (mask.width as usize, mask.height as usize);
    let data: Vec<f32> =
        mask.data.iter().map(|&v| if f32::from(v) / 255.0 < 0.5 { 0.0 } else { 1.0 }).collect();
    Tensor::from_vec(data, (1, 1, h, w), device)
}

/// `torch.nn.functional.interpolate(mask, size)` in its default nearest mode: output pixel i reads input
/// pixel floor(i * in / out).
pub fn nearest_downsample(mask: &Tensor, out_h: usize, out_w: usize) -> Result<Tensor> {
    let (_, _, in_h, in_w) = mask.dims4()?;
    let rows: Vec<u32> = (0..out_h).map(|i| (i * in_h / out_h) as u32).collect();
    let cols: Vec<u32> = (0..out_w).map(|i| (i * in_w / out_w) as u32).collect();
    let dev = mask.device();
    mask.index_select(&Tensor::new(rows, dev)?, 2)?.index_select(&Tensor::new(cols, dev)?, 3)
}

/// 2²³: an f32 in [0, 2²³) plus this is rounded to a whole number, half to even (the add's own rounding), and taking
/// it away again is exact.
const ROUNDING: f64 = 8_388_608.0;

/// The decoded VAE output `[1, 3, H, W]` (any float dtype) → 8-bit RGB.
pub fn tensor_to_image(decoded: &Tensor) -> Result<RgbImage> {
    start_image(decoded)?.finish()
}

/// A decoded image whose bytes may still be on their way from the device ([`start_image`]).
pub enum PendingImage {
    Queued { bytes: sdhive_cuda_kernels::Readback<u8>, width: u32, height: u32 },
    Done(RgbImage),
}

impl PendingImage {
    /// The image, once its bytes have landed.
    pub fn finish(self) -> Result<RgbImage> {
        match self {
            PendingImage::Queued { bytes, width, height } => {
                Ok(RgbImage { width, height, data: bytes.values()? })
            }
            PendingImage::Done(image) => Ok(image),
        }
    }
}

/// [`tensor_to_image`] with the bytes left on their way to the host: on a CUDA device the conversion and the copy
/// are queued behind the decode, and [`PendingImage::finish`] waits for them.
pub fn start_image(decoded: &Tensor) -> Result<PendingImage> {
    let (_, _, h, w) = decoded.dims4()?;
    let (width, height) = (w as u32, h as u32);
    if decoded.device().is_cuda() {
        // On the device: a quarter of the bytes come back (a quarter of a 512² decode's time was the f32 read
        // and the host's loop), into page-locked memory.
        let bytes = sdhive_cuda_kernels::start_readback::<u8>(&rgb8_tensor(decoded)?)?;
        return Ok(PendingImage::Queued { bytes, width, height });
    }
    let hwc = unit(decoded)?.permute((1, 2, 0))?.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
    // numpy's round() rounds half to even; f32::round_ties_even matches it.
    let data = hwc.iter().map(|&v| (v * 255.0).round_ties_even() as u8).collect();
    Ok(PendingImage::Done(RgbImage { width, height, data }))
}

/// The decoded `[1, 3, H, W]` as `(H, W, 3)` bytes on its device, the bytes [`tensor_to_image`] gives: a finished
/// image's and a GPU preview's (read back on their own, `sdhive_cuda_kernels::start_readback`).
pub(crate) fn rgb8_tensor(decoded: &Tensor) -> Result<Tensor> {
    rgb8_from_unit(&unit(decoded)?)
}

/// diffusers' `(x / 2 + 0.5).clamp(0, 1)` in f32, `(3, H, W)`.
fn unit(decoded: &Tensor) -> Result<Tensor> {
    let x = decoded.to_dtype(DType::F32)?.squeeze(0)?;
    ((x * 0.5)? + 0.5)?.clamp(0f32, 1f32)
}

/// `x` `(3, H, W)` f32 in [0, 1] → `(H, W, 3)` u8, as the host's `(v · 255).round_ties_even()` gives them: the
/// product rounded to f32 on its own, then to a whole number half to even by [`ROUNDING`].
fn rgb8_from_unit(x: &Tensor) -> Result<Tensor> {
    (x * 255.0)?
        .affine(1.0, ROUNDING)?
        .affine(1.0, -ROUNDING)?
        .to_dtype(DType::U8)?
        .permute((1, 2, 0))?
        .contiguous()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_tensor_space() {
        let img = RgbImage { width: 2, height: 1, data: vec![0, 128, 255, 10, 20, 30] };
        let t = image_to_tensor(&img, &Device::Cpu).unwrap();
        assert_eq!(t.dims(), &[1, 3, 1, 2]);
        assert_eq!(tensor_to_image(&t).unwrap(), img);
    }

    /// The device's formulation gives the host's bytes for every f16 a decode can output (run here on the CPU:
    /// the same f32 operations in the same order), the ties of `v · 255` at half a level among them.
    #[test]
    fn device_bytes_equal_the_hosts_for_every_f16_value() {
        let all: Vec<half::f16> =
            (0..=u16::MAX).map(half::f16::from_bits).filter(|v| v.is_finite()).collect();
        let n = all.len();
        let x = Tensor::from_vec(all, (1, 1, 1, n), &Device::Cpu).unwrap();
        let ramp = |k: usize| (0..k).map(|i| i as f32 / (k - 1) as f32 * 2.2 - 1.1).collect::<Vec<f32>>();
        let fine = Tensor::from_vec(ramp(1 << 20), (1, 1, 1, 1 << 20), &Device::Cpu).unwrap();
        for decoded in [x.to_dtype(DType::F32).unwrap(), fine] {
            let host = tensor_to_image(&decoded.repeat((1, 3, 1, 1)).unwrap()).unwrap();
            let v = ((decoded.squeeze(0).unwrap() * 0.5).unwrap() + 0.5).unwrap().clamp(0f32, 1f32).unwrap();
            let on_device = rgb8_from_unit(&v).unwrap().flatten_all().unwrap().to_vec1::<u8>().unwrap();
            let host_first: Vec<u8> = host.data.chunks(3).map(|p| p[0]).collect();
            assert_eq!(on_device, host_first);
        }
        let ties: Vec<f32> =
            (0..255).map(|k| (k as f32 + 0.5) / 255.0).filter(|v| (v * 255.0).fract() == 0.5).collect();
        assert!(!ties.is_empty(), "some levels have an exact half-way value");
        let t = Tensor::from_vec(ties.clone(), (1, 1, ties.len()), &Device::Cpu).unwrap();
        let on_device = rgb8_from_unit(&t).unwrap().flatten_all().unwrap().to_vec1::<u8>().unwrap();
        let host: Vec<u8> = ties.iter().map(|v| (v * 255.0).round_ties_even() as u8).collect();
        assert_eq!(on_device, host);
        assert!(
            on_device.iter().zip(&ties).any(|(&b, v)| f32::from(b) < v * 255.0),
            "ties go to even, down too"
        );
    }

    #[test]
    fn mask_binarises_at_half_and_downsamples_nearest() {
        let mask = GrayImage { width: 4, height: 2, data: vec![0, 127, 128, 255, 255, 255, 0, 0] };
        let t = mask_to_tensor(&mask, &Device::Cpu).unwrap();
        assert_eq!(t.flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![0., 0., 1., 1., 1., 1., 0., 0.]);
        let d = nearest_downsample(&t, 1, 2).unwrap();
        assert_eq!(d.flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![0., 1.]);
    }
}
