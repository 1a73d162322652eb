//! `cargo xtask vulkan`: builds `sd-worker-vulkan` (stable-diffusion.cpp on ggml's Vulkan backend), lints and
//! tests it with its feature on (including the engine's tests on the random SD1.5 on ggml's CPU backend: stopping
//! inside an image, LoRAs, hires fix, a standalone VAE file and a q8_0 GGUF checkpoint against diffusers, and the
//! random SD3.5-medium against diffusers), checks
//! that it refuses to start without a Vulkan device, and checks the engine against diffusers: the full-size SD1.5
//! with deterministic random weights (`cargo xtask random-model`) generates at 64² and the image is compared with
//! diffusers' committed one for the same weights, prompt, seed, with the random LoRA `cargo xtask random-model`
//! writes beside the model (`<lora:sd15_random_lora:0.8>` in the prompt, the file in `--lora-dir`) against
//! diffusers' image with that LoRA fused.
//!
//! The image is computed on Mesa's lavapipe (a CPU Vulkan driver, so any machine can run this): every module on
//! the Vulkan device, through ggml's Vulkan kernels. Debian 12's own lavapipe (Mesa 22.3) corrupts the heap
//! within a few UNet calls of those kernels, so the check uses bookworm-backports' Mesa, unpacked privately by
//! `xtask/scripts/lavapipe.sh`. lavapipe reports itself as a CPU device, which ggml hides unless
//! `GGML_VK_VISIBLE_DEVICES` names it: the worker never picks a CPU "GPU" on its own, and this check opts in
//! explicitly. lavapipe compiles each of ggml's pipelines through LLVM when the graph first needs it and Mesa
//! keeps them in its shader cache: on 2 cores the image took 4 min 46 s with the cache empty, 1 min 42 s filled.

use crate::random_model;
use crate::util::{cargo, script_output, workspace_root};
use anyhow::{ensure, Context, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Agreement required with diffusers' image, in 8-bit levels. Measured: mean |diff| 0.077, max 1, PSNR 59.3 dB
/// (f16 weights, Mesa 25.0.7's lavapipe, f32 arithmetic, against diffusers in f32). A wrong schedule, seed stream
/// or prompt encoding moves the mean by tens of levels; these bounds leave room for rounding only.
const MAX_MEAN_ABS_DIFF: f64 = 1.0;
const MIN_PSNR_DB: f64 = 45.0;

pub fn run() -> Result<()> {
    let root = workspace_root();
    ensure_vulkan_sdk(&root)?;
    // The same packages and features in every command, so stable-diffusion.cpp (the slowest compile of all) is
    // built once: a different package set can unify build-dependency features differently and rebuild it.
    let scope = [
        "-p",
        "sd-worker-vulkan",
        "-p",
        "sdhive-sdcpp",
        "--features",
        "sd-worker-vulkan/vulkan,sdhive-sdcpp/vulkan",
    ];
    let with = |cmd: &[&str], extra: &[&str]| -> Vec<String> {
        cmd.iter().chain(scope.iter()).chain(extra.iter()).map(|s| s.to_string()).collect()
    };
    let run_cargo = |args: Vec<String>| {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        cargo(&root, &refs)
    };
    run_cargo(with(&["clippy", "--all-targets"], &["--", "-D", "warnings"]))?;
    // The engine's checks against diffusers need the full-size random SD1.5 (which the image check below uses
    // too) and SD3.5-medium; they are ignored in plain `cargo test` runs and included here, but for the SD3.5-medium
    // check at full width with T5, whose 15 GB of weights and diffusers' images are made on a GPU machine
    // (docs/gpu.md).
    let manifest = root.join("tests/fixtures/sd15-random/manifest.json");
    let model = random_model::default_out(&manifest);
    random_model::write(&manifest, &model)?;
    std::env::set_var("SDHIVE_SD15_RANDOM", &model);
    // The SD3.5-medium's 2 GB are written for this step only and removed after it: CI machines' disks are shared
    // and tight by the end of the run, when the CUDA builds come.
    let sd35m_manifest = root.join("tests/fixtures/sd35m-random/manifest.json");
    let sd35m = std::env::temp_dir().join("sdhive-sd35m-random");
    random_model::write(&sd35m_manifest, &sd35m)?;
    std::env::set_var("SDHIVE_SD35M_RANDOM", &sd35m);
    let tested = run_cargo(with(&["test"], &["--", "--include-ignored", "--skip", "full_size_with_t5"]));
    if let Err(e) = std::fs::remove_dir_all(&sd35m) {
        eprintln!("xtask: could not remove {}: {e}", sd35m.display());
    }
    tested?;
    run_cargo(with(&["build"], &[]))?;
    let exe = target_dir(&root).join("debug/sd-worker-vulkan");

    let no_gpu = Command::new(&exe)
        .args(["generate", "--model", "tests/fixtures/models/sd1", "--prompt", "x", "-o"])
        .arg(std::env::temp_dir().join("sdhive-no-gpu.png"))
        .env("VK_ICD_FILENAMES", "/nonexistent.json")
        .env("VK_DRIVER_FILES", "/nonexistent.json")
        .current_dir(&root)
        .output()
        .context("cannot run sd-worker-vulkan")?;
    let stderr = String::from_utf8_lossy(&no_gpu.stderr);
    ensure!(
        !no_gpu.status.success() && stderr.contains("vulkan"),
        "sd-worker-vulkan without a Vulkan driver must fail naming the backend; it said:\n{stderr}"
    );
    eprintln!("xtask: without a Vulkan device sd-worker-vulkan refuses: {}", error_line(&stderr));

    let lavapipe = lavapipe_icd(&root)?;
    // One image, with the LoRA: a lavapipe process spends most of its time loading the model, and the LoRA image
    // checks the whole pipeline as the plain one would (the LoRA only adds to weights), plus the LoRA itself. The
    // plain image after a LoRA job is checked byte for byte on the CPU backend (crates/sdhive-sdcpp/tests).
    let lora_dir = model.join(random_model::LORA_FILE);
    let lora_dir = lora_dir.parent().context("the LoRA has a folder")?;
    check_image(
        &root,
        &exe,
        &model,
        &lavapipe,
        "sd15_random_lora",
        &["--lora-dir".as_ref(), lora_dir.as_os_str()],
    )
}

/// Generates golden case `name` (`tests/fixtures/golden/<name>.json`) with sd-worker-vulkan on lavapipe and
/// compares it with diffusers' image of the case.
fn check_image(
    root: &Path,
    exe: &Path,
    model: &Path,
    lavapipe: &Lavapipe,
    name: &str,
    extra_args: &[&std::ffi::OsStr],
) -> Result<()> {
    let golden_dir = root.join("tests/fixtures/golden");
    let case: Value =
        serde_json::from_str(&std::fs::read_to_string(golden_dir.join(format!("{name}.json")))?)?;
    let out = std::env::temp_dir().join(format!("sdhive-vulkan-{name}.png"));
    let text =
        |k: &str| case[k].as_str().map(str::to_string).with_context(|| format!("golden case lacks {k}"));
    let num =
        |k: &str| case[k].as_f64().map(|v| v.to_string()).with_context(|| format!("golden case lacks {k}"));
    let started = std::time::Instant::now();
    let run = Command::new(exe)
        .arg("generate")
        .arg("--model")
        .arg(model)
        .args(extra_args)
        .args(["--prompt", &text("prompt")?, "--negative-prompt", &text("negative_prompt")?])
        .args(["--steps", &num("steps")?, "--cfg-scale", &num("cfg_scale")?])
        .args(["--width", &num("width")?, "--height", &num("height")?, "--seed", &num("seed")?])
        .args(["--sampler", &text("sampler")?, "-o"])
        .arg(&out)
        .env("VK_ICD_FILENAMES", &lavapipe.manifest)
        .env("GGML_VK_VISIBLE_DEVICES", "0")
        // lavapipe emulates f16 arithmetic: with ggml's f16 shaders this image takes twice as long there (10 min
        // against 5 on 2 cores with an empty shader cache, LLVM compiling them the largest part) and rounds worse
        // (mean 2.4 levels against 0.08). The kernels with f32 arithmetic are those ggml runs on GPUs without
        // shaderFloat16; the f16 ones are checked on NVIDIA's driver (docs/gpu.md).
        .env("GGML_VK_DISABLE_F16", "1")
        .current_dir(root)
        .status()
        .context("cannot run sd-worker-vulkan")?;
    ensure!(run.success(), "sd-worker-vulkan generate on lavapipe failed ({run})");
    let seconds = started.elapsed().as_secs_f64();

    let (ours, theirs) = (read_rgb(&out)?, read_rgb(&golden_dir.join(format!("{name}.png")))?);
    let cmp = compare(&ours, &theirs)?;
    eprintln!(
        "xtask: sd-worker-vulkan on lavapipe ({}) vs diffusers, {name} (SD1.5 random weights 64², {} steps Euler, \
         seed {}): mean |diff| {:.3} levels, max {} levels, {:.2}% of values off by > 8, PSNR {:.2} dB \
         ({seconds:.1} s)",
        lavapipe.version,
        num("steps")?,
        num("seed")?,
        cmp.mean_abs,
        cmp.max_abs,
        100.0 * cmp.over_8,
        cmp.psnr_db
    );
    ensure!(
        cmp.mean_abs <= MAX_MEAN_ABS_DIFF && cmp.psnr_db >= MIN_PSNR_DB,
        "sd-worker-vulkan's image is too far from diffusers' (bounds: mean |diff| ≤ {MAX_MEAN_ABS_DIFF}, \
         PSNR ≥ {MIN_PSNR_DB} dB); ours is at {}",
        out.display()
    );
    Ok(())
}

struct Lavapipe {
    manifest: PathBuf,
    /// Which Mesa, for the log.
    version: String,
}

/// The lavapipe ICD manifest from `SDHIVE_LAVAPIPE_ICD`, or the one `xtask/scripts/lavapipe.sh` prepares.
fn lavapipe_icd(root: &Path) -> Result<Lavapipe> {
    let manifest = match std::env::var_os("SDHIVE_LAVAPIPE_ICD").filter(|v| !v.is_empty()) {
        Some(path) => PathBuf::from(path),
        None => PathBuf::from(script_output(&root.join("xtask/scripts/lavapipe.sh"))?),
    };
    ensure!(manifest.is_file(), "lavapipe's ICD manifest {} does not exist", manifest.display());
    let version = manifest
        .parent()
        .and_then(|dir| std::fs::read_to_string(dir.join("version")).ok())
        .map(|v| v.trim().to_string())
        .unwrap_or_else(|| manifest.display().to_string());
    Ok(Lavapipe { manifest, version })
}

/// Debian 12's Vulkan headers are too old for ggml; unless `VULKAN_SDK` points elsewhere, use the header prefix
/// `xtask/scripts/vulkan-sdk.sh` prepares (Debian 13's headers, unpacked privately).
fn ensure_vulkan_sdk(root: &Path) -> Result<()> {
    if std::env::var_os("VULKAN_SDK").is_some_and(|v| !v.is_empty()) {
        return Ok(());
    }
    let prefix = script_output(&root.join("xtask/scripts/vulkan-sdk.sh"))?;
    eprintln!("xtask: VULKAN_SDK={prefix}");
    std::env::set_var("VULKAN_SDK", prefix);
    Ok(())
}

/// anyhow's `Error: …` line (a backtrace may follow it when RUST_BACKTRACE is set).
fn error_line(s: &str) -> &str {
    s.lines().find(|l| l.starts_with("Error:")).unwrap_or("")
}

fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target"))
}

struct Rgb {
    width: u32,
    height: u32,
    data: Vec<u8>,
}

fn read_rgb(path: &Path) -> Result<Rgb> {
    let file = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut decoder = png::Decoder::new(std::io::BufReader::new(file));
    decoder.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = decoder.read_info().with_context(|| format!("{} is not a PNG", path.display()))?;
    let mut buf = vec![0; reader.output_buffer_size().context("PNG too large")?];
    let frame = reader.next_frame(&mut buf).with_context(|| format!("cannot decode {}", path.display()))?;
    ensure!(
        frame.color_type == png::ColorType::Rgb,
        "{}: expected RGB, got {:?}",
        path.display(),
        frame.color_type
    );
    buf.truncate(frame.buffer_size());
    Ok(Rgb { width: frame.width, height: frame.height, data: buf })
}

struct Comparison {
    mean_abs: f64,
    max_abs: u8,
    over_8: f64,
    psnr_db: f64,
}

fn compare(a: &Rgb, b: &Rgb) -> Result<Comparison> {
    ensure!(
        (a.width, a.height) == (b.width, b.height),
        "sizes differ: {}×{} vs {}×{}",
        a.width,
        a.height,
        b.width,
        b.height
    );
    let n = a.data.len() as f64;
    let diffs: Vec<u8> = a.data.iter().zip(&b.data).map(|(x, y)| x.abs_diff(*y)).collect();
    let mse = diffs.iter().map(|d| f64::from(*d).powi(2)).sum::<f64>() / n;
    Ok(Comparison {
        mean_abs: diffs.iter().map(|d| f64::from(*d)).sum::<f64>() / n,
        max_abs: diffs.iter().copied().max().unwrap_or(0),
        over_8: diffs.iter().filter(|d| **d > 8).count() as f64 / n,
        psnr_db: if mse == 0.0 { f64::INFINITY } else { 10.0 * (255.0f64.powi(2) / mse).log10() },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comparison_measures_what_it_says() {
        let a = Rgb { width: 2, height: 1, data: vec![0, 10, 20, 30, 40, 50] };
        let b = Rgb { width: 2, height: 1, data: vec![0, 10, 20, 30, 40, 62] };
        let c = compare(&a, &b).unwrap();
        assert_eq!(c.max_abs, 12);
        assert!((c.mean_abs - 2.0).abs() < 1e-12);
        assert!((c.over_8 - 1.0 / 6.0).abs() < 1e-12);
        assert!((c.psnr_db - 10.0 * (255f64.powi(2) / 24.0).log10()).abs() < 1e-9);
        assert!(compare(&a, &a).unwrap().psnr_db.is_infinite());
        assert!(compare(&a, &Rgb { width: 1, height: 2, data: a.data.clone() }).is_err());
    }
}
