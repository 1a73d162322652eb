//! TAESD decoder parity with diffusers' `AutoencoderTiny.decode` on the tiny random decoders of
//! `xtask/fixtures/gen_taesd.py` (`tests/fixtures/taesd/`), CPU f32: the raw sample, the 8-bit image a pipeline
//! makes of it, and the two key layouts (diffusers folder, taesd.py's single file) loading the same network.

use candle_core::{DType, Device, Tensor};
use sdhive_models::{AutoencoderTinyConfig, TaesdDecoder};
use std::collections::HashMap;
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    match std::env::var_os("SDHIVE_FIXTURES") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"),
    }
    .join("taesd")
}

fn goldens() -> HashMap<String, Tensor> {
    let path = fixtures().join("golden.safetensors");
    assert!(path.is_file(), "{} is missing: run xtask/fixtures/gen_taesd.py", path.display());
    candle_core::safetensors::load(&path, &Device::Cpu).expect("goldens")
}

fn get<'a>(g: &'a HashMap<String, Tensor>, key: &str) -> &'a Tensor {
    g.get(key).unwrap_or_else(|| panic!("golden `{key}` missing"))
}

fn load(rel: &str) -> TaesdDecoder {
    let path = fixtures().join(rel);
    TaesdDecoder::load(&path, DType::F32, &Device::Cpu).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    (a - b).and_then(|d| d.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()).expect("diff")
}

/// diffusers' `VaeImageProcessor.postprocess(output_type="pil")`: `(x / 2 + 0.5).clamp(0, 1)`, `× 255`, numpy's
/// round half to even; HWC bytes.
fn to_image(sample: &Tensor) -> Vec<u8> {
    let x =
        sample.squeeze(0).and_then(|x| x.permute((1, 2, 0))?.flatten_all()?.to_vec1::<f32>()).expect("hwc");
    x.iter().map(|&v| ((v / 2.0 + 0.5).clamp(0.0, 1.0) * 255.0).round_ties_even() as u8).collect()
}

#[test]
fn both_layouts_decode_as_diffusers_autoencoder_tiny() {
    let g = goldens();
    for name in ["taesd", "taesdxl"] {
        let folder = load(name);
        let single = load(&format!("VAE-taesd/{name}_decoder.safetensors"));
        // The folder's config.json and the shapes of the single file describe the same decoder.
        assert_eq!(folder.config(), single.config(), "{name}");
        let want_cfg = AutoencoderTinyConfig {
            decoder_block_out_channels: vec![8; 4],
            num_decoder_blocks: vec![2, 1, 1, 1],
            ..AutoencoderTinyConfig::default()
        };
        assert_eq!(folder.config(), &want_cfg, "{name}");
        for latent in ["latent_8x8", "latent_4x6"] {
            let z = get(&g, latent);
            let want = get(&g, &format!("decoded/{name}/{latent}"));
            let ours = folder.decode(z).expect("decode");
            let gap = max_diff(&ours, want);
            assert!(gap < 2e-5, "{name} {latent}: {gap}");
            let by_file = single.decode(z).expect("decode");
            // taesdxl's file is float16 holding the folder's float32 values exactly.
            assert_eq!(max_diff(&ours, &by_file), 0.0, "{name} {latent}: the two layouts differ");

            let image =
                get(&g, &format!("image/{name}/{latent}")).flatten_all().unwrap().to_vec1::<u8>().unwrap();
            let ours = to_image(&ours);
            let off = ours.iter().zip(&image).filter(|(a, b)| a != b).count();
            let worst = ours.iter().zip(&image).map(|(&a, &b)| a.abs_diff(b)).max().unwrap_or(0);
            assert!(
                worst <= 1 && off * 100 <= image.len(),
                "{name} {latent}: {off} values off, worst {worst}"
            );
        }
    }
}

#[test]
fn the_two_decoders_are_different_networks() {
    // A reader that loaded one decoder for both families would pass the parity test above only if the
    // fixtures were the same network.
    let g = goldens();
    let z = get(&g, "latent_8x8");
    let sd = load("taesd").decode(z).unwrap();
    let xl = load("taesdxl").decode(z).unwrap();
    assert!(max_diff(&sd, &xl) > 0.1);
}

#[test]
fn bad_files_and_inputs_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let vae = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/sd1/vae");
    let err = TaesdDecoder::load(&vae.join("diffusion_pytorch_model.safetensors"), DType::F32, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("diffusion_pytorch_model.safetensors") && err.contains("TAESD"), "{err}");
    let garbage = dir.path().join("taesd_decoder.safetensors");
    std::fs::write(&garbage, b"not a safetensors file").unwrap();
    let err = TaesdDecoder::load(&garbage, DType::F32, &Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("taesd_decoder.safetensors"), "{err}");
    // A diffusers folder whose config is another class's.
    let err = TaesdDecoder::load(&vae, DType::F32, &Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("AutoencoderKL") && err.contains("config.json"), "{err}");

    let decoder = load("taesd");
    let wrong = Tensor::zeros((1, 16, 8, 8), DType::F32, &Device::Cpu).unwrap();
    let err = decoder.decode(&wrong).unwrap_err().to_string();
    assert!(err.contains("16 channels"), "{err}");
}

/// The released decoder's size (64 channels, blocks (3, 3, 3, 1)) with random weights, timed on this machine's
/// CPU at 64×64 latents (a 512² preview) and 128×128 (1024²), the figures behind `serve --preview auto` keeping
/// CPU workers on latent previews: `cargo test -p sdhive-models --test taesd -- --ignored --nocapture`.
#[test]
#[ignore]
fn full_size_decode_time_on_cpu() {
    use sdhive_models::{random_var_builder, TaesdLayout};
    let dev = Device::Cpu;
    let cfg = AutoencoderTinyConfig::default();
    let decoder =
        TaesdDecoder::new(random_var_builder(DType::F32, &dev), &cfg, TaesdLayout::Diffusers).unwrap();
    for side in [64usize, 128] {
        let z = Tensor::randn(0f32, 1.0, (1, 4, side, side), &dev).unwrap();
        decoder.decode(&z).unwrap();
        let runs = 3;
        let start = std::time::Instant::now();
        for _ in 0..runs {
            let out = decoder.decode(&z).unwrap();
            assert_eq!(out.dims(), &[1, 3, side * 8, side * 8]);
        }
        let per = start.elapsed().as_secs_f64() / runs as f64;
        eprintln!(
            "taesd decode {side}x{side} latents on {} threads: {:.3} s",
            candle_core::utils::get_num_threads(),
            per
        );
    }
}
