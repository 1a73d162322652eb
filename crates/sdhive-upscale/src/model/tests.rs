//! The model upscalers against spandrel's outputs (`xtask/fixtures/gen_upscalers.py`) on the CPU in f32, A1111's
//! tiling against its Python definition, the tiled-vs-whole difference, and refusals of bad files.

use super::*;
use crate::fixtures::{self, diff, Goldens};
use candle_core::{DType, Device};

fn models() -> Vec<(String, serde_json::Value)> {
    let cases = fixtures::cases();
    let models = cases["models"].as_object().expect("models").clone();
    assert!(models.len() >= 6, "the fixtures hold every architecture and key layout");
    models.into_iter().collect()
}

fn load(record: &serde_json::Value) -> UpscaleModel {
    let path = fixtures::dir().join(record["file"].as_str().expect("file"));
    UpscaleModel::load(&path, &Device::Cpu, DType::F32).unwrap_or_else(|e| panic!("{e}"))
}

/// Each architecture and key layout (ESRGAN x4 old and new keys, Real-ESRGAN x2 and x1 with pixel unshuffle and odd
/// sides, f16 files, SRVGGNetCompact x4 and x2) within one level of spandrel, untiled.
#[test]
fn every_architecture_matches_spandrel() {
    let goldens = Goldens::load();
    let input = fixtures::image("input.png");
    for (name, record) in models() {
        let model = load(&record);
        assert_eq!(model.arch_name(), record["arch"].as_str().expect("arch"), "{name}");
        assert_eq!(u64::from(model.scale()), record["scale"].as_u64().expect("scale"), "{name}");
        let path = fixtures::dir().join(record["file"].as_str().expect("file"));
        assert_eq!(UpscaleModel::inspect(&path).expect("inspect"), model.info(), "{name}");
        let out = model.upscale(&input, Tile::NONE).expect("upscale");
        let want = goldens.get(record["golden"].as_str().expect("golden"));
        let (max, mean) = diff(&out, &want);
        eprintln!("{name} ({}): max {max}, mean {mean:.4} levels from spandrel", model.description());
        assert!(max <= 1, "{name}: {max} levels from spandrel (mean {mean:.4})");
    }
}

/// A1111's `split_grid` / `combine_grid` (tiles of 12 overlapping by 4; A1111's 192/8, one black-padded tile),
/// each tile through the model: within one level of the same tiling around spandrel.
#[test]
fn tiles_match_a1111() {
    let goldens = Goldens::load();
    let input = fixtures::image("input.png");
    let mut checked = 0;
    for (name, record) in models() {
        let model = load(&record);
        for (key, t) in record["tiled"].as_object().expect("tiled") {
            let (size, overlap) = key.split_once('_').expect("size_overlap");
            let tile = Tile { size: size.parse().expect("size"), overlap: overlap.parse().expect("overlap") };
            let out = model.upscale(&input, tile).expect("tiled upscale");
            let (max, mean) = diff(&out, &goldens.get(t["golden"].as_str().expect("golden")));
            assert!(max <= 1, "{name} {tile:?}: {max} levels from A1111's tiling (mean {mean:.4})");
            checked += 1;
        }
    }
    assert!(checked >= 8);
}

/// What tiling costs against one pass over the whole image (tiles of 12 overlapping by 4 on the 23x17 input; the
/// tiny networks see a tile's edge within a few pixels, so this is a worst case for the overlap A1111 uses).
/// Measured: ESRGAN x4 max 4 / mean 0.17 levels; Real-ESRGAN x2 (unshuffle 2: 6x6 maps per tile) 32 / 2.6;
/// x1 (unshuffle 4: 3x3 maps) 68 / 9.5; Compact x4 2 / 0.035; Compact x2 1 / 0.011.
#[test]
fn tiled_against_whole() {
    let input = fixtures::image("input.png");
    let bound = |name: &str| match name {
        n if n.starts_with("esrgan_x4") => (5, 0.25),
        "esrgan_x2_new" => (36, 3.0),
        "esrgan_x1_old" => (75, 10.5),
        _ => (3, 0.05),
    };
    for (name, record) in models() {
        let model = load(&record);
        let whole = model.upscale(&input, Tile::NONE).expect("whole");
        let tiled = model.upscale(&input, Tile { size: 12, overlap: 4 }).expect("tiled");
        let (max, mean) = diff(&whole, &tiled);
        eprintln!("{name}: tiled (12/4) vs whole: max {max}, mean {mean:.4} levels");
        let (max_bound, mean_bound) = bound(&name);
        assert!(max <= max_bound && mean <= mean_bound, "{name}: tiled vs whole max {max}, mean {mean:.4}");
    }
}

fn rewrite(
    from: &Path,
    to: &Path,
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>, &mut Vec<u8>),
) {
    let bytes = std::fs::read(from).expect("read");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).expect("header");
    let mut data = bytes[8 + n..].to_vec();
    edit(&mut header, &mut data);
    let json = serde_json::to_vec(&header).expect("json");
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend(json);
    out.extend(data);
    std::fs::write(to, out).expect("write");
}

fn message(r: Result<UpscaleModel, UpscaleError>) -> String {
    match r {
        Ok(_) => panic!("loaded a bad file"),
        Err(e) => e.to_string(),
    }
}

/// `good` rewritten by `edit` into `dir/file`, whose load must fail naming the file and saying each of `words`.
fn refused_edit(
    good: &Path,
    dir: &Path,
    file: &str,
    words: &[&str],
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>, &mut Vec<u8>),
) -> PathBuf {
    let path = dir.join(file);
    rewrite(good, &path, edit);
    let m = message(UpscaleModel::load(&path, &Device::Cpu, DType::F32));
    assert!(m.contains(file) && words.iter().all(|w| m.contains(w)), "{m}");
    path
}

#[test]
fn bad_files_are_refused_naming_the_file() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let good = fixtures::dir().join("models/compact_x4.safetensors");
    let cpu = &Device::Cpu;

    let pth = dir.join("RealESRGAN_x4plus.pth");
    std::fs::write(&pth, b"PK\x03\x04 a zip of pickles").expect("write");
    let m = message(UpscaleModel::load(&pth, cpu, DType::F32));
    assert!(m.contains("RealESRGAN_x4plus.pth") && m.contains("safetensors") && m.contains("unpickl"), "{m}");
    assert!(UpscaleModel::inspect(&pth).is_err());

    let extra =
        refused_edit(&good, dir, "extra.safetensors", &["`body.1.alpha`", "unexpected"], |h, data| {
            let at = data.len();
            h.insert(
                "body.1.alpha".into(),
                serde_json::json!({"dtype": "F32", "shape": [1], "data_offsets": [at, at + 4]}),
            );
            data.extend([0u8; 4]);
        });
    assert!(UpscaleModel::inspect(&extra).expect_err("inspect").to_string().contains("body.1.alpha"));
    refused_edit(&good, dir, "missing.safetensors", &["`body.3.weight`", "missing"], |h, _| {
        h.remove("body.3.weight");
    });
    refused_edit(&good, dir, "reshaped.safetensors", &["`body.1.weight`", "[2, 4]"], |h, _| {
        h.insert("body.1.weight".into(), serde_json::json!({"dtype": "F32", "shape": [2, 4], "data_offsets": h["body.1.weight"]["data_offsets"]}));
    });
    refused_edit(&good, dir, "unet.safetensors", &["not an upscaler"], |h, _| {
        let v = h.remove("body.0.weight").expect("body.0");
        h.insert("conv_in.weight".into(), v);
    });

    let truncated = dir.join("truncated.safetensors");
    let bytes = std::fs::read(&good).expect("read");
    std::fs::write(&truncated, &bytes[..200]).expect("write");
    for m in [
        message(UpscaleModel::load(&truncated, cpu, DType::F32)),
        UpscaleModel::inspect(&truncated).expect_err("x").to_string(),
    ] {
        assert!(m.contains("truncated.safetensors") && m.contains("not a valid safetensors"), "{m}");
    }
    let short = dir.join("short.safetensors");
    std::fs::write(&short, [7u8, 0, 0]).expect("write");
    assert!(message(UpscaleModel::load(&short, cpu, DType::F32)).contains("short.safetensors"));
    let cut_data = dir.join("cut.safetensors");
    std::fs::write(&cut_data, &bytes[..bytes.len() - 10]).expect("write");
    let m = message(UpscaleModel::load(&cut_data, cpu, DType::F32));
    assert!(m.contains("cut.safetensors") && m.contains("outside"), "{m}");
    let absent = dir.join("absent.safetensors");
    assert!(message(UpscaleModel::load(&absent, cpu, DType::F32)).contains("absent.safetensors"));
}

#[test]
fn images_too_small_for_the_unshuffle_are_refused() {
    let record = &fixtures::cases()["models"]["esrgan_x1_old"];
    let model = load(record);
    let tiny = RgbImage { width: 2, height: 5, data: vec![9; 30] };
    let e = model.upscale(&tiny, Tile::NONE).expect_err("2 px wide, padded to 4 by reflection");
    assert!(e.to_string().contains("2x5"), "{e}");
    let ok = RgbImage { width: 3, height: 5, data: vec![9; 45] };
    let out = model.upscale(&ok, Tile::NONE).expect("3 px: one reflected column");
    assert_eq!((out.width, out.height), (3, 5));
}

/// On a GPU (`SDHIVE_TEST_DEVICE=cuda`; skipped elsewhere): every fixture model in f32, f16 and bf16 (channels-last
/// through cuDNN in a `cudnn` build) against spandrel's f32 output, whole and tiled. Half precision rounds every
/// layer, so its bound is looser than the CPU's one level.
#[test]
fn on_the_test_device() {
    if std::env::var("SDHIVE_TEST_DEVICE").as_deref() != Ok("cuda") {
        return;
    }
    let dev = Device::new_cuda(0).expect("opening cuda:0");
    let goldens = Goldens::load();
    let input = fixtures::image("input.png");
    for (dtype, bound) in [(DType::F32, 1), (DType::F16, 4), (DType::BF16, 16)] {
        for (name, record) in models() {
            let path = fixtures::dir().join(record["file"].as_str().expect("file"));
            let model = UpscaleModel::load(&path, &dev, dtype).unwrap_or_else(|e| panic!("{e}"));
            let out = model.upscale(&input, Tile::NONE).expect("upscale");
            let (max, mean) = diff(&out, &goldens.get(record["golden"].as_str().expect("golden")));
            let tiled = model.upscale(&input, Tile { size: 12, overlap: 4 }).expect("tiled");
            let tiled_golden = goldens.get(record["tiled"]["12_4"]["golden"].as_str().expect("tiled golden"));
            let (tmax, tmean) = diff(&tiled, &tiled_golden);
            eprintln!("{name} {dtype:?}: whole max {max} mean {mean:.4}; tiled max {tmax} mean {tmean:.4}");
            assert!(max <= bound && tmax <= bound, "{name} {dtype:?}: {max} / {tmax} levels from spandrel");
        }
    }
}
