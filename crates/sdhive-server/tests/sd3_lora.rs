//! SD3 LoRAs over HTTP: a `<lora:name:te:unet>` tag on the A1111 route and a structured `loras` entry on the
//! native route reach the SD3 engine (the tiny `sd3` fixture and the LoRA files of
//! `xtask/fixtures/gen_sd3_lora.py`), whose images equal diffusers' goldens and whose infotext names the LoRA's
//! hash; an SDXL LoRA on the SD3 model is a 400 on `loras` naming both families, and the next job is plain.

mod common;

use base64::Engine as _;
use candle_core::{DType, Device};
use common::{config, decode_png_b64, start_with, TestServer};
use sdhive_candle::Sd3Engine;
use sdhive_catalog::NetworksConfig;
use sdhive_engine::{Engine, RgbImage};
use sdhive_protocol::JobState;
use serde_json::{json, Value};
use std::path::PathBuf;

const PROMPT: &str = "a photo of an astronaut riding a horse";

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

async fn serve() -> TestServer {
    let loader = Box::new(|| {
        let dir = fixtures().join("models/sd3");
        let engine = Sd3Engine::load(&dir, "sd3", &Device::Cpu, DType::F32, true, ("cpu", "test cpu"))?;
        Ok(Box::new(engine) as Box<dyn Engine>)
    });
    let networks = NetworksConfig {
        lora_dirs: vec![fixtures().join("models/Lora")],
        // No hash cache: the test must not write into the user's cache folder.
        hash_cache: None,
        ..Default::default()
    };
    start_with(sdhive_server::ServerConfig { networks, ..config() }, loader, None).await
}

/// The 8-bit image of a golden.
fn golden_image(file: &str) -> Vec<u8> {
    let bytes = std::fs::read(fixtures().join("golden").join(file)).expect("golden (run gen_sd3_lora.py)");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    st.tensor("image_u8").expect("image_u8").data().to_vec()
}

fn assert_close(got: &RgbImage, want: &[u8], what: &str) {
    assert_eq!(got.data.len(), want.len(), "{what}: size");
    let worst = got.data.iter().zip(want).map(|(a, b)| a.abs_diff(*b)).max().unwrap_or(0);
    assert!(worst <= 1, "{what}: up to {worst} levels off diffusers");
}

/// The goldens' settings (64², 3 steps, seed 42, CFG 5, negative `blurry`).
fn body(prompt: &str) -> Value {
    json!({"prompt": prompt, "negative_prompt": "blurry", "steps": 3, "cfg_scale": 5, "seed": 42,
           "width": 64, "height": 64, "sampler_name": "Euler"})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sd3_loras_through_the_a1111_and_native_routes() {
    let server = serve().await;

    // A1111: the tag in the prompt, te 0.4 / unet 1.2; the infotext keeps the tag and adds the hash.
    let r = server.post_json("/sdapi/v1/txt2img", &body(&format!("{PROMPT} <lora:sd3_peft:0.4:1.2>"))).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.expect("json");
    let image = decode_png_b64(v["images"][0].as_str().expect("image"));
    assert_close(&image, &golden_image("sd3_lora_peft_te_unet.safetensors"), "A1111 <lora:sd3_peft:0.4:1.2>");
    let info: Value = serde_json::from_str(v["info"].as_str().expect("info")).expect("info json");
    let text = info["infotexts"][0].as_str().expect("infotext");
    let hash = text.split("Lora hashes: \"sd3_peft: ").nth(1).map(|rest| &rest[..12]).unwrap_or_default();
    assert!(hash.len() == 12 && hash.chars().all(|c| c.is_ascii_hexdigit()), "{text}");
    assert!(text.starts_with(&format!("{PROMPT} <lora:sd3_peft:0.4:1.2>")), "{text}");

    // Native: the kohya/SAI-layout file as a structured entry (unet 0.9, te 0.7).
    let native = json!({"prompt": PROMPT, "negative_prompt": "blurry", "steps": 3, "cfg_scale": 5, "seed": 42,
                        "width": 64, "height": 64, "loras": [{"name": "sd3_kohya", "weight": 0.9, "te_weight": 0.7}]});
    let id = server.submit(&native).await;
    let job = server.wait_done(&id).await;
    assert_eq!(job.state, JobState::Succeeded, "{:?}", job.error);
    let bytes =
        base64::engine::general_purpose::STANDARD.decode(&job.images[0].image_base64).expect("base64");
    let image = sdhive_engine::decode_image(&bytes, 1 << 20).expect("png");
    assert_close(&image, &golden_image("sd3_lora_kohya.safetensors"), "native job with sd3_kohya");

    // An SDXL LoRA on SD3: a 400 on `loras` naming both families; then a plain job is the plain golden.
    let r = server.post_json("/sdapi/v1/txt2img", &body(&format!("{PROMPT} <lora:sdxl_kohya:1>"))).await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.expect("json");
    let message = v.to_string();
    assert_eq!(v["field"], "loras", "{v}");
    assert!(message.contains("sdxl_kohya") && message.contains("SD3/SD3.5"), "{message}");
    let r = server.post_json("/sdapi/v1/txt2img", &body(PROMPT)).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.expect("json");
    let image = decode_png_b64(v["images"][0].as_str().expect("image"));
    assert_close(&image, &golden_image("sd3_pipe_sd3.safetensors"), "plain job after the LoRA jobs");
}
