//! `sd-worker-cpu generate` as a user runs it: bad inputs exit non-zero with a message naming the file or flag
//! at fault, and a good run on the tiny SD 1.x fixture writes PNGs with A1111 infotext.

use sdhive_tests::{fixtures, run_worker};
use std::path::Path;
use std::process::Output;

fn sd1() -> String {
    fixtures().join("models/sd1").display().to_string()
}

/// A quick, valid txt2img invocation on the fixture model writing to `out`; `extra` flag/value pairs replace
/// the defaults of the same flag (clap refuses a flag given twice) or add to them.
fn generate(out: &Path, extra: &[&str]) -> Output {
    let model = sd1();
    let out = out.display().to_string();
    let defaults = [
        ("--model", model.as_str()),
        ("--prompt", "a cat"),
        ("--width", "64"),
        ("--height", "64"),
        ("--steps", "4"),
        ("--sampler", "Euler"),
        ("--seed", "42"),
        ("-o", out.as_str()),
    ];
    let mut args = vec!["generate"];
    for (flag, value) in defaults {
        if !extra.contains(&flag) {
            args.extend([flag, value]);
        }
    }
    args.extend_from_slice(extra);
    run_worker(&args)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts a failed run whose stderr mentions every one of `needles`.
fn assert_fails_with(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert!(!o.status.success(), "expected failure, got success; stderr:\n{err}");
    for needle in needles {
        assert!(err.contains(needle), "stderr does not mention {needle:?}:\n{err}");
    }
}

fn png_text(path: &Path) -> (u32, u32, String) {
    let file = std::io::BufReader::new(std::fs::File::open(path).unwrap());
    let reader = png::Decoder::new(file).read_info().unwrap();
    let info = reader.info();
    let text = info
        .uncompressed_latin1_text
        .iter()
        .filter(|c| c.keyword == "parameters")
        .map(|c| c.text.clone())
        .chain(info.utf8_text.iter().filter(|c| c.keyword == "parameters").map(|c| c.get_text().unwrap()))
        .next()
        .unwrap_or_default();
    (info.width, info.height, text)
}

#[test]
fn version_names_the_backend() {
    let o = run_worker(&["--version"]);
    assert!(o.status.success());
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.starts_with("sd-worker-cpu ") && out.contains("backend: cpu"), "{out}");
}

#[test]
fn missing_model_path_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-model.safetensors");
    let model = missing.display().to_string();
    let out = tmp.path().join("o.png").display().to_string();
    let o = run_worker(&["generate", "--model", &model, "--prompt", "x", "-o", &out]);
    assert_fails_with(&o, &["no-such-model.safetensors", "not found"]);
}

#[test]
fn text_file_model_is_an_unknown_format() {
    let tmp = tempfile::tempdir().unwrap();
    let txt = tmp.path().join("model.txt");
    std::fs::write(&txt, "hello").unwrap();
    let model = txt.display().to_string();
    let out = tmp.path().join("o.png").display().to_string();
    let o = run_worker(&["generate", "--model", &model, "--prompt", "x", "-o", &out]);
    assert_fails_with(&o, &["model.txt", "unknown model format"]);
}

#[test]
fn corrupt_safetensors_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("corrupt.safetensors");
    let mut bytes = 40u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{\"w\": {\"dtype\": \"F32\", \"shape\": [100], \"data_offsets\": [0, 400]}}");
    std::fs::write(&bad, bytes).unwrap();
    let model = bad.display().to_string();
    let out = tmp.path().join("o.png").display().to_string();
    let o = run_worker(&["generate", "--model", &model, "--prompt", "x", "-o", &out]);
    assert_fails_with(&o, &["corrupt.safetensors", "not a valid .safetensors"]);
}

#[test]
fn pickle_checkpoint_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("old.ckpt");
    std::fs::write(&ckpt, b"PK\x03\x04").unwrap();
    let model = ckpt.display().to_string();
    let out = tmp.path().join("o.png").display().to_string();
    let o = run_worker(&["generate", "--model", &model, "--prompt", "x", "-o", &out]);
    assert_fails_with(&o, &["old.ckpt", "only .safetensors"]);
}

#[test]
fn unknown_sampler_lists_valid_names() {
    let tmp = tempfile::tempdir().unwrap();
    let o = generate(&tmp.path().join("o.png"), &["--sampler", "Heun"]);
    assert_fails_with(&o, &["--sampler", "Heun", "Euler a", "DPM++ 2M"]);
}

#[test]
fn conflicting_scheduler_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let o =
        generate(&tmp.path().join("o.png"), &["--sampler", "DPM++ 2M Karras", "--scheduler", "Automatic"]);
    assert_fails_with(&o, &["--scheduler", "Karras"]);
}

#[test]
fn width_not_a_multiple_of_8_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let o = generate(&tmp.path().join("o.png"), &["--width", "100"]);
    assert_fails_with(&o, &["--width", "100"]);
}

#[test]
fn missing_init_image_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("missing-init.png").display().to_string();
    let o = generate(&tmp.path().join("o.png"), &["--init-image", &missing]);
    assert_fails_with(&o, &["--init-image", "missing-init.png"]);
}

#[test]
fn unreadable_init_image_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let garbage = tmp.path().join("garbage.png");
    std::fs::write(&garbage, b"this is not an image").unwrap();
    let garbage = garbage.display().to_string();
    let o = generate(&tmp.path().join("o.png"), &["--init-image", &garbage]);
    assert_fails_with(&o, &["--init-image", "garbage.png"]);
}

#[test]
fn mask_without_init_image_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let mask = fixtures().join("images/mask.png").display().to_string();
    let o = generate(&tmp.path().join("o.png"), &["--mask", &mask]);
    assert_fails_with(&o, &["--mask", "init image"]);
}

#[test]
fn missing_output_directory_is_refused_before_loading() {
    let tmp = tempfile::tempdir().unwrap();
    let o = generate(&tmp.path().join("absent-dir/o.png"), &[]);
    assert_fails_with(&o, &["absent-dir", "does not exist"]);
}

#[test]
fn model_outside_model_root_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().display().to_string();
    let o = generate(&tmp.path().join("o.png"), &["--model-root", &root]);
    assert_fails_with(&o, &["outside the allowed model roots", "sd1"]);
}

#[test]
fn generates_a_png_with_infotext() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("cat.png");
    let o = generate(&out, &[]);
    assert!(o.status.success(), "generate failed:\n{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("seed 42"));
    let (w, h, params) = png_text(&out);
    assert_eq!((w, h), (64, 64));
    assert!(params.starts_with("a cat\n"), "{params}");
    for field in ["Steps: 4", "Sampler: Euler,", "Seed: 42", "Size: 64x64"] {
        assert!(params.contains(field), "infotext lacks {field:?}: {params}");
    }
}

#[test]
fn the_output_extension_picks_jpeg_or_webp_with_the_infotext() {
    let tmp = tempfile::tempdir().unwrap();
    let jpg = tmp.path().join("cat.jpg");
    let o = generate(&jpg, &[]);
    assert!(o.status.success(), "generate failed:\n{}", stderr(&o));
    let bytes = std::fs::read(&jpg).unwrap();
    assert_eq!(&bytes[..3], [0xff, 0xd8, 0xff], "not a JPEG");
    // A1111's EXIF UserComment: `UNICODE\0` then the infotext in UTF-16BE.
    let utf16: Vec<u8> = "Seed: 42".encode_utf16().flat_map(|u| u.to_be_bytes()).collect();
    assert!(bytes.windows(8).any(|w| w == b"UNICODE\0"), "no EXIF UserComment");
    assert!(bytes.windows(utf16.len()).any(|w| w == utf16), "the infotext is not in the EXIF");
    let webp = tmp.path().join("cat.webp");
    let o = generate(&webp, &[]);
    assert!(o.status.success(), "generate failed:\n{}", stderr(&o));
    let bytes = std::fs::read(&webp).unwrap();
    assert!(&bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP", "not a WebP");
}

#[test]
fn an_unknown_output_extension_is_refused_before_loading() {
    let tmp = tempfile::tempdir().unwrap();
    let o = generate(&tmp.path().join("cat.gif"), &[]);
    assert_fails_with(&o, &["cat.gif", ".gif", ".png, .jpg"]);
    assert!(!tmp.path().join("cat.gif").exists());
}

#[test]
fn batches_write_numbered_files_with_consecutive_seeds() {
    let tmp = tempfile::tempdir().unwrap();
    let o = generate(&tmp.path().join("batch.png"), &["-n", "2", "--steps", "2"]);
    assert!(o.status.success(), "generate failed:\n{}", stderr(&o));
    assert!(!tmp.path().join("batch.png").exists());
    for (i, seed) in [(0, 42), (1, 43)] {
        let (w, h, params) = png_text(&tmp.path().join(format!("batch-{i}.png")));
        assert_eq!((w, h), (64, 64));
        assert!(params.contains(&format!("Seed: {seed},")), "{params}");
    }
}

#[cfg(unix)]
#[test]
fn ctrl_c_cancels_and_exits_non_zero() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("never.png").display().to_string();
    let model = sd1();
    // Long enough (8 images × 150 steps) that it cannot finish before the signal lands.
    let mut child = Command::new(sdhive_tests::worker_cpu())
        .args(["generate", "--model", &model, "--prompt", "x", "--width", "64", "--height", "64"])
        .args(["--steps", "150", "-n", "8", "--seed", "1", "-o", &out])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        assert!(stderr.read_line(&mut line).unwrap() > 0, "worker ended before generating:\n{seen}");
        seen.push_str(&line);
        if line.starts_with("seed: ") {
            break;
        }
    }
    let kill = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(kill.success());
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut rest).unwrap();
    let status = child.wait().unwrap();
    assert!(!status.success(), "worker was not cancelled:\n{seen}{rest}");
    assert!(rest.contains("cancelled"), "{rest}");
    assert!(!tmp.path().join("never-0.png").exists());
}

fn png_pixels(path: &Path) -> Vec<u8> {
    let mut reader =
        png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap())).read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let frame = reader.next_frame(&mut buf).unwrap();
    buf.truncate(frame.buffer_size());
    buf
}

#[test]
fn offloaded_and_placed_modules_give_the_same_image() {
    let tmp = tempfile::tempdir().unwrap();
    let (plain, moved) = (tmp.path().join("plain.png"), tmp.path().join("moved.png"));
    let o = generate(&plain, &[]);
    assert!(o.status.success(), "generate failed:\n{}", stderr(&o));
    let o = generate(&moved, &["--placement", "te=cpu,vae=cpu", "--offload", "te,vae"]);
    assert!(o.status.success(), "generate with --placement/--offload failed:\n{}", stderr(&o));
    assert_eq!(png_pixels(&plain), png_pixels(&moved), "offloading must not change the image");
}

#[test]
fn placement_on_another_backend_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let o = generate(&tmp.path().join("x.png"), &["--placement", "unet=cuda0"]);
    assert_fails_with(&o, &["cuda0", "sd-worker-cpu"]);
    let o = generate(&tmp.path().join("x.png"), &["--placement", "unet=tpu0"]);
    assert_fails_with(&o, &["--placement", "tpu0"]);
}

/// `--memory-budget` caps what the planner may use: just above the tiny model's weights plus the planner's
/// margin, a 128² job decodes in tiles (different seams, same size); below it, the job is refused with the
/// amount it needs.
#[test]
fn memory_budget_tiles_the_vae_or_refuses_the_job() {
    let tmp = tempfile::tempdir().unwrap();
    let size = ["--width", "128", "--height", "128", "--steps", "2"];
    let plain = tmp.path().join("plain.png");
    let o = generate(&plain, &size);
    assert!(o.status.success(), "generate failed:\n{}", stderr(&o));
    let tiled = tmp.path().join("tiled.png");
    let o = generate(&tiled, &[&size[..], &["--memory-budget", "620M"]].concat());
    assert!(o.status.success(), "generate under a budget failed:\n{}", stderr(&o));
    let (a, b) = (png_pixels(&plain), png_pixels(&tiled));
    assert_eq!(a.len(), b.len());
    assert_ne!(a, b, "a tiled decode blends its seams: the budget did not change the plan");
    let o = generate(&tmp.path().join("refused.png"), &[&size[..], &["--memory-budget", "100M"]].concat());
    assert_fails_with(&o, &["128×128 job needs about", "MiB"]);
}

/// One uint8 tensor of a safetensors file (the format: an 8-byte little-endian header length, a JSON header
/// naming each tensor's byte range, then the data).
fn safetensors_u8(path: &Path, name: &str) -> Vec<u8> {
    let bytes = std::fs::read(path).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    let entry = &header[name];
    assert_eq!(entry["dtype"], "U8", "{name}");
    let range = entry["data_offsets"].as_array().unwrap();
    let (start, end) = (range[0].as_u64().unwrap() as usize, range[1].as_u64().unwrap() as usize);
    bytes[8 + len + start..8 + len + end].to_vec()
}

fn png_rgb(path: &Path) -> Vec<u8> {
    let mut reader =
        png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap())).read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(info.color_type, png::ColorType::Rgb);
    buf.truncate(info.buffer_size());
    buf
}

/// The SD3 pipeline golden's request (`golden/sd3.json`) for `model`, with `extra` flags.
fn generate_sd3(out: &Path, model: &str, extra: &[&str]) -> Output {
    let prompt = "a photo of an astronaut riding a horse";
    let mut args = vec!["--model", model, "--prompt", prompt, "--negative-prompt", "blurry"];
    if !extra.contains(&"--steps") {
        args.extend(["--steps", "3"]);
    }
    args.extend(["--cfg-scale", "5"]);
    args.extend_from_slice(extra);
    generate(out, &args)
}

#[test]
fn an_sd3_folder_and_its_single_file_make_diffusers_images_and_name_what_they_cannot_run() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("sd3.png");
    let model = fixtures().join("models/sd3").display().to_string();
    let o = generate_sd3(&out, &model, &["--sampler", "Euler a"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let want = safetensors_u8(&fixtures().join("golden/sd3_pipe_sd3.safetensors"), "image_u8");
    let ours = png_rgb(&out);
    assert_eq!(ours.len(), want.len());
    let worst = ours.iter().zip(&want).map(|(a, b)| a.abs_diff(*b)).max().unwrap();
    assert!(worst <= 1, "the image is {worst} levels off diffusers'");
    let (w, h, text) = png_text(&out);
    assert_eq!((w, h), (64, 64));
    assert!(
        text.contains("Sampler: Euler,") && text.contains("Seed: 42") && text.contains("CFG scale: 5"),
        "{text}"
    );
    // The SAI-layout single file (its diffusers folder beside it gives configs and tokenizers): the same image.
    let file = fixtures().join("models/sd3.safetensors").display().to_string();
    let from_file = tmp.path().join("sd3-file.png");
    let o = generate_sd3(&from_file, &file, &["--sampler", "Euler a"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(png_rgb(&from_file), ours, "the single file makes its folder's image");
    // T5 left out: zeros in its place (the context is checked against diffusers' in sdhive-candle's sd3_tests).
    let without_t5 = tmp.path().join("sd3-no-t5.png");
    let o = generate_sd3(&without_t5, &model, &["--no-t5"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_ne!(png_rgb(&without_t5), ours, "--no-t5 reached the model");
    // img2img: diffusers' StableDiffusion3Img2ImgPipeline on the fixture init image (strength 0.6 of 4 steps).
    let img2img = tmp.path().join("sd3-img2img.png");
    let init = fixtures().join("images/init.png").display().to_string();
    let o = generate_sd3(&img2img, &model, &["--init-image", &init, "--strength", "0.6", "--steps", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let want = safetensors_u8(&fixtures().join("golden/sd3_img2img_sd3.safetensors"), "image_u8");
    let worst = png_rgb(&img2img).iter().zip(&want).map(|(a, b)| a.abs_diff(*b)).max().unwrap();
    assert!(worst <= 1, "img2img is {worst} levels off diffusers'");
    // Inpainting: diffusers' StableDiffusion3InpaintPipeline (strength 0.8 of 5 steps), decoded with the VAE's shift.
    let inpaint = tmp.path().join("sd3-inpaint.png");
    let mask = fixtures().join("images/mask.png").display().to_string();
    let o = generate_sd3(
        &inpaint,
        &model,
        &["--init-image", &init, "--mask", &mask, "--strength", "0.8", "--steps", "5"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let want = safetensors_u8(&fixtures().join("golden/sd3_pipe_inpaint_sd3.safetensors"), "image_u8");
    let worst = png_rgb(&inpaint).iter().zip(&want).map(|(a, b)| a.abs_diff(*b)).max().unwrap();
    assert!(worst <= 1, "inpainting is {worst} levels off diffusers'");
    let o = generate(&tmp.path().join("x.png"), &["--model", &model, "--sampler", "DDIM"]);
    assert_fails_with(&o, &["sampler", "flow-matching samplers"]);
    let o = generate(&tmp.path().join("x.png"), &["--model", &model, "--width", "72"]);
    assert_fails_with(&o, &["width", "multiple of 16"]);
}

/// `--offload` and `--placement` on an SD3 model (module `te` is CLIP-L, CLIP-G and T5 together): the plain
/// image, from the folder and from the single file (whose converted weights become the host copies).
#[test]
fn sd3_offloaded_and_placed_modules_give_the_same_image() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixtures().join("models/sd3").display().to_string();
    let file = fixtures().join("models/sd3.safetensors").display().to_string();
    let plain = tmp.path().join("plain.png");
    let o = generate_sd3(&plain, &model, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let want = png_rgb(&plain);
    let runs: [(&str, &str, &[&str]); 2] = [
        ("folder.png", &model, &["--placement", "te=cpu", "--offload", "te,vae"]),
        ("file.png", &file, &["--offload", "te,unet,vae"]),
    ];
    for (name, model, flags) in runs {
        let out = tmp.path().join(name);
        let o = generate_sd3(&out, model, flags);
        assert!(o.status.success(), "{flags:?}: {}", stderr(&o));
        assert_eq!(png_rgb(&out), want, "{flags:?} changed the image");
    }
    let o = generate_sd3(&tmp.path().join("x.png"), &model, &["--placement", "te=cuda0"]);
    assert_fails_with(&o, &["cuda0", "sd-worker-cpu"]);
}
