//! A standalone VAE file (A1111's `sd_vae`) through stable-diffusion.cpp on the random SD1.5 (`common`): the
//! random VAE `cargo xtask random-model` writes beside the model, in A1111's layout, decodes the same latents as
//! diffusers' `AutoencoderKL.from_single_file` of that file does (golden `sd15_random_vae`), far from the model's
//! own VAE's image; a file that is no usable VAE fails the switch naming the file, and the model loaded before
//! serves again, computing as before. Ignored by default because it needs that 2 GB model; `cargo xtask vulkan`
//! writes the model and runs it.

mod common;

use sdhive_engine::{BoxError, Engine, ModelHost, ModelSpec, SwitchError};
use sdhive_modelsource::{ModelLocation, ResolvedModel};
use sdhive_sdcpp::{LoadError, SdCppEngine};
use std::path::{Path, PathBuf};

/// Agreement required with diffusers' image, as `cargo xtask vulkan` requires of the plain image. Measured on
/// ggml's CPU backend (f16 weights, 2 cores): PSNR 61.9 dB, mean |diff| 0.04 levels, max 1.
const MIN_PSNR_DB: f64 = 45.0;
const MAX_MEAN_ABS_DIFF: f64 = 1.0;

fn resolved(spec: &ModelSpec) -> ResolvedModel {
    ResolvedModel {
        name: spec.name.clone(),
        location: ModelLocation::DiffusersDir(PathBuf::from(&spec.source)),
        vae: spec.vae.clone(),
    }
}

fn load(spec: &ModelSpec) -> Result<Box<dyn Engine>, BoxError> {
    Ok(Box::new(SdCppEngine::load(&resolved(spec), common::load_options())?))
}

/// A copy of `file` cut short, as an interrupted download leaves it.
fn truncated_copy(file: &Path, dir: &Path) -> PathBuf {
    let bytes = std::fs::read(file).expect("VAE file");
    let out = dir.join("cut.safetensors");
    std::fs::write(&out, &bytes[..bytes.len() / 2]).expect("write the truncated VAE");
    out
}

#[test]
#[ignore = "needs the random SD1.5 named by SDHIVE_SD15_RANDOM; cargo xtask vulkan runs it"]
fn a_standalone_vae_decodes_as_diffusers_and_a_broken_one_leaves_the_model_serving() {
    let dir = common::model_dir();
    let vae_file = dir.join("VAE/sd15_random_vae.safetensors");
    assert!(vae_file.is_file(), "{} is missing: run `cargo xtask random-model`", vae_file.display());
    let (req, theirs) = common::golden_case("sd15_random_vae");
    let (own_req, own_vae_image) = common::golden_case("sd15_random_fast");
    // Both goldens are one request, with and without the VAE file.
    assert_eq!(format!("{req:?}"), format!("{own_req:?}"));

    let with_vae = ModelSpec::new("sd15-random", dir.to_string_lossy()).with_vae(Some(vae_file.clone()));
    let mut host = ModelHost::new(Box::new(load));
    host.load_model(&with_vae).unwrap_or_else(|e| panic!("{e}"));
    let ours = common::image(host.engine().expect("loaded"), &req);
    let cmp = common::compare(&ours, &theirs);
    let own = common::compare(&ours, &own_vae_image);
    eprintln!(
        "with {}: vs diffusers with that VAE {cmp:?}; vs the model's own VAE {own:?}",
        vae_file.display()
    );
    assert!(
        cmp.psnr_db >= MIN_PSNR_DB && cmp.mean_abs <= MAX_MEAN_ABS_DIFF,
        "the image with the VAE file is too far from diffusers' ({cmp:?}; bounds: PSNR ≥ {MIN_PSNR_DB} dB, mean \
         |diff| ≤ {MAX_MEAN_ABS_DIFF})"
    );
    // diffusers' two images differ by 74 levels on average: an ignored VAE file would land here.
    assert!(own.mean_abs > 30.0, "the image is close to the model's own VAE's: was the file used? {own:?}");

    // A truncated file is refused before stable-diffusion.cpp reads anything, naming the file.
    let tmp = tempfile::tempdir().expect("temp dir");
    let cut = truncated_copy(&vae_file, tmp.path());
    let err =
        SdCppEngine::load(&resolved(&with_vae.clone().with_vae(Some(cut.clone()))), common::load_options())
            .err()
            .expect("a truncated VAE must not load");
    assert!(matches!(err, LoadError::Vae { .. }), "{err:?}");
    assert!(err.to_string().contains(&*cut.to_string_lossy()), "{err}");

    // A file that is no VAE at all (here the model's LoRA) would be taken by stable-diffusion.cpp for a VAE that
    // changes nothing; the switch fails naming it, and the model before it is loaded again and computes as before.
    let not_a_vae = dir.join("Lora/sd15_random_lora.safetensors");
    let err = host.load_model(&with_vae.clone().with_vae(Some(not_a_vae.clone()))).unwrap_err();
    let SwitchError::Load { restored, reason, .. } = &err;
    assert!(restored, "the previous model was not restored: {err}");
    assert!(reason.contains(&*not_a_vae.to_string_lossy()) && reason.contains("VAE"), "{reason}");
    assert_eq!(host.current_model(), Some(&with_vae));
    let again = common::image(host.engine().expect("restored"), &req);
    assert!(
        again == ours,
        "the restored model's image differs from the same request before the failed switch"
    );
}
