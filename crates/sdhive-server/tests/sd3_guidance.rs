//! SD3's samplers and skip-layer guidance over HTTP: the `skip_layer_guidance` object and `DPM++ 2M` through the
//! A1111, native and OpenAI routes reach the SD3 engine (the tiny `sd35m` / `sd3` fixtures of
//! `xtask/fixtures/gen_sd3.py`), whose images equal diffusers' goldens; bad values are a 400 naming the field,
//! before queueing where no model is needed to tell, else when the job runs.

mod common;

use base64::Engine as _;
use candle_core::{DType, Device};
use common::{config, decode_png_b64, start_with, TestServer};
use sdhive_candle::Sd3Engine;
use sdhive_engine::{Engine, RgbImage};
use sdhive_protocol::JobState;
use serde_json::{json, Value};
use std::path::PathBuf;

const PROMPT: &str = "a photo of an astronaut riding a horse";

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

async fn serve(model: &'static str) -> TestServer {
    let loader = Box::new(move || {
        let dir = fixtures().join("models").join(model);
        let engine = Sd3Engine::load(&dir, model, &Device::Cpu, DType::F32, true, ("cpu", "test cpu"))?;
        Ok(Box::new(engine) as Box<dyn Engine>)
    });
    start_with(config(), loader, None).await
}

/// The 8-bit image of a pipeline golden.
fn golden_image(file: &str) -> Vec<u8> {
    let bytes = std::fs::read(fixtures().join("golden").join(file)).expect("golden (run gen_sd3.py)");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    st.tensor("image_u8").expect("image_u8").data().to_vec()
}

fn init_b64() -> String {
    base64::engine::general_purpose::STANDARD
        .encode(std::fs::read(fixtures().join("images/init.png")).expect("images/init.png"))
}

fn assert_close(got: &RgbImage, want: &[u8], what: &str) {
    assert_eq!(got.data.len(), want.len(), "{what}: size");
    let worst = got.data.iter().zip(want).map(|(a, b)| a.abs_diff(*b)).max().unwrap_or(0);
    assert!(worst <= 1, "{what}: up to {worst} levels off diffusers");
}

/// The golden pipelines' settings (64², seed 42, CFG 5, negative `blurry`).
fn body(steps: u32) -> Value {
    json!({"prompt": PROMPT, "negative_prompt": "blurry", "steps": steps, "cfg_scale": 5, "seed": 42,
           "width": 64, "height": 64})
}

fn with(mut body: Value, extra: Value) -> Value {
    for (k, v) in extra.as_object().expect("object") {
        body[k] = v.clone();
    }
    body
}

async fn a1111_error(server: &TestServer, body: &Value) -> String {
    let r = server.post_json("/sdapi/v1/txt2img", body).await;
    assert_eq!(r.status(), 400, "{body}");
    let v: Value = r.json().await.expect("json");
    v["field"].as_str().unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skip_layer_guidance_through_every_route() {
    let server = serve("sd35m").await;
    let info: Value = server.get("/v1/info").await.json().await.expect("info");
    assert_eq!(info["capabilities"]["samplers"], json!(["Euler", "DPM++ 2M"]), "{info}");
    let slg = json!({"skip_layer_guidance": {"layers": [1], "start": 0.01, "stop": 0.5}});

    // A1111: the golden's run, diffusers' default scale filled in and written into the infotext.
    let r = server
        .post_json("/sdapi/v1/txt2img", &with(with(body(3), slg.clone()), json!({"sampler_name": "Euler"})))
        .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.expect("json");
    let image = decode_png_b64(v["images"][0].as_str().expect("image"));
    assert_close(&image, &golden_image("sd3_pipe_slg_sd35m.safetensors"), "A1111 txt2img with SLG");
    let info: Value = serde_json::from_str(v["info"].as_str().expect("info")).expect("info json");
    let text = info["infotexts"][0].as_str().expect("infotext");
    assert!(text.contains("SLG layers: 1, SLG scale: 2.8, SLG start: 0.01, SLG stop: 0.5"), "{text}");

    // Native: the same, as a job.
    let id = server.submit(&with(body(3), slg.clone())).await;
    let job = server.wait_done(&id).await;
    assert_eq!(job.state, JobState::Succeeded, "{:?}", job.error);
    let bytes =
        base64::engine::general_purpose::STANDARD.decode(&job.images[0].image_base64).expect("base64");
    let image = sdhive_engine::decode_image(&bytes, 1 << 20).expect("png");
    assert_close(&image, &golden_image("sd3_pipe_slg_sd35m.safetensors"), "native job with SLG");

    // Values no model is needed to judge are refused before queueing, naming the field.
    for (bad, field) in [
        (json!({"layers": [1], "stop": 1.5}), "skip_layer_guidance.stop"),
        (json!({"layers": [1], "start": 0.3}), "skip_layer_guidance.start"),
        (json!({"layers": [1], "scale": -2}), "skip_layer_guidance.scale"),
        (json!({"layers": []}), "skip_layer_guidance.layers"),
        (json!({"scale": 2}), "skip_layer_guidance.layers"),
        (json!({"layers": [1], "end": 0.5}), "skip_layer_guidance.end"),
    ] {
        let req = with(body(3), json!({"skip_layer_guidance": bad}));
        let r = server.post_json("/v1/jobs", &req).await;
        assert_eq!(r.status(), 400, "{req}");
        let v: Value = r.json().await.expect("json");
        assert_eq!(v["error"]["param"], field, "{v}");
        assert_eq!(a1111_error(&server, &req).await, field, "A1111 {req}");
    }
    // What needs the model fails the job: a block the tiny transformer (2 blocks) lacks, SLG without CFG or on
    // img2img.
    let id = server.submit(&with(body(3), json!({"skip_layer_guidance": {"layers": [2]}}))).await;
    let job = server.wait_done(&id).await;
    assert_eq!(job.state, JobState::Failed);
    assert_eq!(job.error.and_then(|e| e.param).as_deref(), Some("skip_layer_guidance.layers"));
    let unguided = with(with(body(3), slg.clone()), json!({"cfg_scale": 1}));
    assert_eq!(a1111_error(&server, &unguided).await, "skip_layer_guidance");
    let img2img =
        with(with(body(3), slg.clone()), json!({"init_images": [init_b64()], "denoising_strength": 0.6}));
    let r = server.post_json("/sdapi/v1/img2img", &img2img).await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.expect("json");
    assert_eq!(v["field"], "skip_layer_guidance", "{v}");
    let r =
        server.post_json("/v1/images/generations", &with(with(body(3), slg), json!({"size": "64x64"}))).await;
    assert_eq!(r.status(), 200, "OpenAI generation with SLG");
    let v: Value = r.json().await.expect("json");
    let image = decode_png_b64(v["data"][0]["b64_json"].as_str().expect("b64_json"));
    assert_close(&image, &golden_image("sd3_pipe_slg_sd35m.safetensors"), "OpenAI generation with SLG");
    server.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dpm_pp_2m_and_refused_samplers() {
    let server = serve("sd3").await;
    let r = server.post_json("/sdapi/v1/txt2img", &with(body(4), json!({"sampler_name": "DPM++ 2M"}))).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.expect("json");
    let image = decode_png_b64(v["images"][0].as_str().expect("image"));
    assert_close(&image, &golden_image("sd3_pipe_dpm_sd3.safetensors"), "A1111 DPM++ 2M");
    let info: Value = serde_json::from_str(v["info"].as_str().expect("info")).expect("info json");
    assert!(info["infotexts"][0].as_str().expect("infotext").contains("Sampler: DPM++ 2M,"), "{info}");

    for (extra, field) in [
        (json!({"sampler_name": "DDIM"}), "sampler_name"),
        (json!({"sampler_name": "DPM++ 2M Karras"}), "scheduler"),
    ] {
        assert_eq!(a1111_error(&server, &with(body(4), extra.clone())).await, field, "{extra}");
    }
    // diffusers' SD3 img2img pipeline cannot run DPM++ 2M; Euler runs it.
    let img2img = |sampler: &str| {
        with(
            body(4),
            json!({"sampler_name": sampler, "init_images": [init_b64()], "denoising_strength": 0.6}),
        )
    };
    let r = server.post_json("/sdapi/v1/img2img", &img2img("DPM++ 2M")).await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.expect("json");
    assert_eq!(v["field"], "sampler_name", "{v}");
    let r = server.post_json("/sdapi/v1/img2img", &img2img("Euler")).await;
    assert_eq!(r.status(), 200);
    server.shutdown().await.expect("shutdown");
}
