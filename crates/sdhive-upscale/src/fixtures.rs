//! Test access to `tests/fixtures/upscalers/` (written by `xtask/fixtures/gen_upscalers.py`): the input images, the
//! golden images by name and the case list.

use sdhive_engine::RgbImage;
use std::path::PathBuf;

pub fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/upscalers")
}

pub fn image(name: &str) -> RgbImage {
    let bytes = std::fs::read(dir().join(name)).unwrap_or_else(|e| panic!("reading fixture {name}: {e}"));
    sdhive_engine::decode_image(&bytes, u64::MAX).unwrap_or_else(|e| panic!("decoding fixture {name}: {e}"))
}

pub fn cases() -> serde_json::Value {
    let text = std::fs::read_to_string(dir().join("cases.json")).expect("reading cases.json");
    serde_json::from_str(&text).expect("parsing cases.json")
}

/// The golden images, uint8 `(H, W, 3)` tensors of `goldens.safetensors`.
pub struct Goldens(Vec<u8>);

impl Goldens {
    pub fn load() -> Self {
        Goldens(std::fs::read(dir().join("goldens.safetensors")).expect("reading goldens.safetensors"))
    }

    pub fn get(&self, name: &str) -> RgbImage {
        let st = safetensors::SafeTensors::deserialize(&self.0).expect("parsing goldens.safetensors");
        let t = st.tensor(name).unwrap_or_else(|e| panic!("golden {name}: {e}"));
        let [h, w, 3] = t.shape()[..] else { panic!("golden {name} has shape {:?}", t.shape()) };
        RgbImage { width: w as u32, height: h as u32, data: t.data().to_vec() }
    }
}

/// The largest and the mean absolute difference of two images of one size, in levels.
pub fn diff(a: &RgbImage, b: &RgbImage) -> (u8, f64) {
    assert_eq!((a.width, a.height), (b.width, b.height), "image sizes differ");
    let d: Vec<u8> = a.data.iter().zip(&b.data).map(|(x, y)| x.abs_diff(*y)).collect();
    let max = d.iter().copied().max().unwrap_or(0);
    (max, d.iter().map(|&v| f64::from(v)).sum::<f64>() / d.len().max(1) as f64)
}
