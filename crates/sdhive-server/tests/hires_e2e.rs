//! Hires fix and the upscalers end to end: the real candle engine on the tiny SD1 fixture with the fixture
//! upscaler models, served over loopback HTTP and driven through the A1111, native and OpenAI routes, by the
//! clients people script them with (`webuiapi`, the `openai` SDK) and with SillyTavern's request body. Images are
//! held to the goldens: `golden/hires.json` (diffusers composed as the hires fix documents it) and
//! `upscalers/cases.json` (A1111's upscale flow with spandrel); bad input must be a 400 naming the field.
//!
//! One worker (model loaded once) serves every test of this file.

mod pyclients;
mod realworker;

use base64::Engine as _;
use realworker::{fixtures, Client};
use sdhive_engine::{decode_image, RgbImage};
use sdhive_server::ServerConfig;
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;

const PROMPT: &str = "a photo of an astronaut riding a horse";

fn config() -> ServerConfig {
    let upscalers = sdhive_catalog::UpscalersConfig {
        upscaler_dirs: vec![fixtures().join("upscalers/models")],
        models_dirs: Vec::new(),
    };
    ServerConfig { upscalers, ..ServerConfig::default() }
}

fn shared() -> &'static str {
    realworker::shared(config)
}

fn image_of(b64: &Value) -> RgbImage {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64.as_str().expect("a base64 image"))
        .expect("base64");
    decode_image(&bytes, 1 << 24).expect("a decodable image")
}

fn read_png(path: &Path) -> RgbImage {
    decode_image(&std::fs::read(path).expect("an image file"), 1 << 24).expect("a decodable image")
}

/// At most 1% of the channel values more than one level off `want` (the engine parity tests' tolerance).
fn assert_close(got: &RgbImage, want: &RgbImage, what: &str) {
    assert_eq!((got.width, got.height), (want.width, want.height), "{what}: size");
    let off = got.data.iter().zip(&want.data).filter(|(a, b)| a.abs_diff(**b) > 1).count();
    assert!(off * 100 <= want.data.len(), "{what}: {off}/{} values more than one level off", want.data.len());
}

fn hires_golden(case: &str) -> RgbImage {
    read_png(&fixtures().join(format!("golden/hires_{case}.png")))
}

fn upscale_golden(name: &str) -> RgbImage {
    let bytes = std::fs::read(fixtures().join("upscalers/goldens.safetensors")).expect("upscaler goldens");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("goldens.safetensors");
    let t = st.tensor(name).unwrap_or_else(|e| panic!("golden {name}: {e}"));
    RgbImage { width: t.shape()[1] as u32, height: t.shape()[0] as u32, data: t.data().to_vec() }
}

/// A1111's `Upscaler.upscale(input, 2)` with the ×4 model at its default tiling (192-pixel tiles: the small input
/// is one black-padded tile): the tiled pass spandrel computed, then Pillow's LANCZOS to the destination 40×32.
fn esrgan_by_2_golden() -> RgbImage {
    sdhive_upscale::resize(&upscale_golden("tiled/esrgan_x4_192_8"), 40, 32, sdhive_upscale::Filter::Lanczos)
}

fn input_b64() -> String {
    base64::engine::general_purpose::STANDARD
        .encode(std::fs::read(fixtures().join("upscalers/input.png")).unwrap())
}

/// The golden case's first pass as an A1111 body.
fn golden_body() -> Value {
    json!({"prompt": PROMPT, "negative_prompt": "", "steps": 8, "cfg_scale": 7.5, "seed": 42, "width": 64,
           "height": 64, "sampler_name": "Euler"})
}

fn with(mut body: Value, extra: Value) -> Value {
    for (k, v) in extra.as_object().expect("an object") {
        body[k] = v.clone();
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a1111_hires_matches_the_goldens_and_records_its_settings() {
    let c = Client::new(shared());
    let body = with(
        golden_body(),
        json!({"enable_hr": true, "hr_upscaler": "Latent", "hr_scale": 2,
                                           "denoising_strength": 0.6}),
    );
    let (status, got) = c.post("/sdapi/v1/txt2img", &body).await;
    assert_eq!(status, 200, "{got}");
    assert_close(&image_of(&got["images"][0]), &hires_golden("latent"), "A1111 Latent");
    let info: Value = serde_json::from_str(got["info"].as_str().expect("info")).expect("info JSON");
    let text = info["infotexts"][0].as_str().expect("an infotext");
    for part in ["Size: 64x64", "Denoising strength: 0.6", "Hires upscale: 2", "Hires upscaler: Latent"] {
        assert!(text.contains(part), "{part} missing from {text}");
    }
    // An upscaler model through the same route.
    let body = with(
        golden_body(),
        json!({"enable_hr": true, "hr_upscaler": "esrgan_x4_new", "hr_scale": 2,
                                           "denoising_strength": 0.6, "sampler_name": "Euler a"}),
    );
    let (status, got) = c.post("/sdapi/v1/txt2img", &body).await;
    assert_eq!(status, 200, "{got}");
    assert_close(&image_of(&got["images"][0]), &hires_golden("esrgan"), "A1111 ESRGAN");
}

/// SillyTavern's body as its server proxy forwards it (its own `url` and `auth` keys included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sillytavern_body_with_hires_succeeds() {
    let c = Client::new(shared());
    let body = json!({
        "url": c.base, "auth": "", "prompt": PROMPT, "negative_prompt": "blurry", "sampler_name": "Euler",
        "scheduler": "Automatic", "steps": 4, "cfg_scale": 7, "width": 64, "height": 64, "restore_faces": false,
        "enable_hr": true, "hr_upscaler": "Latent (nearest-exact)", "hr_scale": 1.5, "denoising_strength": 0.5,
        "hr_second_pass_steps": 4, "clip_skip": 1,
        "override_settings": {"CLIP_stop_at_last_layers": 1, "sd_vae": "Automatic"},
        "override_settings_restore_afterwards": true, "save_images": false, "send_images": true,
        "do_not_save_grid": false, "do_not_save_samples": false
    });
    let (status, got) = c.post("/sdapi/v1/txt2img", &body).await;
    assert_eq!(status, 200, "{got}");
    let image = image_of(&got["images"][0]);
    assert_eq!((image.width, image.height), (96, 96));
}

/// Open WebUI's A1111 flow: options read, the whole object posted back with the checkpoint picked, then its short
/// txt2img body with the admin's JSON (hires settings) merged in, every call with `authorization: Basic ` (empty
/// when no credentials are set).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_webui_flow_with_hires_in_the_admin_json_succeeds() {
    let c = Client::new(shared());
    let basic = ("authorization", "Basic ");
    let get = |path: &str| c.http.get(format!("{}{path}", c.base)).header(basic.0, basic.1).send();
    let options: Value = get("/sdapi/v1/options").await.expect("GET options").json().await.expect("JSON");
    let models: Value = get("/sdapi/v1/sd-models").await.expect("GET sd-models").json().await.expect("JSON");
    let mut whole = options.clone();
    whole["sd_model_checkpoint"] = models[0]["title"].clone();
    let r = c.http.post(format!("{}/sdapi/v1/options", c.base)).header(basic.0, basic.1).json(&whole);
    assert_eq!(r.send().await.expect("POST options").status().as_u16(), 200);
    let body = json!({"prompt": PROMPT, "batch_size": 1, "width": 64, "height": 64, "steps": 8,
                      "negative_prompt": "", "sampler_name": "Euler", "cfg_scale": 7.5, "seed": 42,
                      "enable_hr": true, "hr_upscaler": "Latent", "hr_scale": 2, "denoising_strength": 0.6});
    let r = c.http.post(format!("{}/sdapi/v1/txt2img", c.base)).header(basic.0, basic.1).json(&body);
    let response = r.send().await.expect("POST txt2img");
    assert_eq!(response.status().as_u16(), 200);
    let got: Value = response.json().await.expect("JSON");
    assert_close(&image_of(&got["images"][0]), &hires_golden("latent"), "Open WebUI hires");
    assert!(got["info"].as_str().is_some_and(|i| i.contains("Hires upscaler")), "{}", got["info"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_hires_job_matches_the_golden() {
    let c = Client::new(shared());
    let job = c
        .job(&json!({"prompt": PROMPT, "steps": 8, "cfg_scale": 7.5, "seed": 42, "width": 64, "height": 64,
                     "sampler": "Euler", "hires": {"upscaler": "Lanczos", "scale": 1.5, "steps": 10,
                                                   "denoising_strength": 0.5}}))
        .await;
    assert_eq!(job["state"], "succeeded", "{job}");
    let image = &job["images"][0];
    assert_eq!((image["width"].as_u64(), image["height"].as_u64()), (Some(96), Some(96)), "{image}");
    assert_close(&image_of(&image["png_base64"]), &hires_golden("lanczos"), "native Lanczos");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upscaler_listings_and_extras_match_a1111() {
    let c = Client::new(shared());
    let upscalers = c.get("/sdapi/v1/upscalers").await;
    let names: Vec<&str> = upscalers.as_array().unwrap().iter().filter_map(|u| u["name"].as_str()).collect();
    for want in ["None", "Lanczos", "Nearest", "compact_x4", "esrgan_x2_new", "esrgan_x4_old"] {
        assert!(names.contains(&want), "{want} not in {names:?}");
    }
    let x2 = upscalers.as_array().unwrap().iter().find(|u| u["name"] == "esrgan_x2_new").unwrap();
    assert_eq!(x2["scale"], 2, "{x2}");
    let modes = c.get("/sdapi/v1/latent-upscale-modes").await;
    assert_eq!(modes.as_array().map(Vec::len), Some(6), "{modes}");
    assert_eq!(modes[0]["name"], "Latent");
    let realesrgan = c.get("/sdapi/v1/realesrgan-models").await;
    assert!(realesrgan.as_array().unwrap().iter().any(|m| m["name"] == "compact_x4" && m["scale"] == 4.0));

    // A1111's Upscaler.upscale(input, 2) with the x4 model, as spandrel computes it in A1111's tiles.
    let (status, got) = c
        .post(
            "/sdapi/v1/extra-single-image",
            &json!({"image": input_b64(), "upscaler_1": "esrgan_x4_new", "upscaling_resize": 2}),
        )
        .await;
    assert_eq!(status, 200, "{got}");
    assert_close(&image_of(&got["image"]), &esrgan_by_2_golden(), "extras ×2 ESRGAN");
    let (status, got) = c
        .post(
            "/sdapi/v1/extra-batch-images",
            &json!({"imageList": [{"data": input_b64(), "name": "a"}], "resize_mode": 1,
                      "upscaling_resize_w": 60, "upscaling_resize_h": 50, "upscaling_crop": true,
                      "upscaler_1": "Lanczos"}),
        )
        .await;
    assert_eq!(status, 200, "{got}");
    let want = upscale_golden("a1111/extras_lanczos_to_60x50_crop");
    assert_eq!(image_of(&got["images"][0]).data, want.data, "extras Lanczos to 60×50 is Pillow's, exactly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_hires_and_extras_input_is_a_400_naming_the_field() {
    let c = Client::new(shared());
    let hr = |extra: Value| with(golden_body(), with(json!({"enable_hr": true}), extra));
    let cases = [
        ("/sdapi/v1/txt2img", hr(json!({"hr_upscaler": "4x-Nope"})), "hr_upscaler"),
        ("/sdapi/v1/txt2img", hr(json!({"hr_scale": 64})), "hr_scale"),
        ("/sdapi/v1/txt2img", hr(json!({"hr_resize_x": 4096})), "hr_resize_x"),
        ("/sdapi/v1/txt2img", hr(json!({"denoising_strength": 0})), "denoising_strength"),
        ("/sdapi/v1/txt2img", hr(json!({"hr_sampler_name": "Heun"})), "hr_sampler_name"),
        ("/sdapi/v1/extra-single-image", json!({"image": input_b64(), "upscaler_1": "Nope"}), "upscaler_1"),
        ("/sdapi/v1/extra-single-image", json!({"image": input_b64(), "upscaler_1": "Latent"}), "upscaler_1"),
        ("/sdapi/v1/extra-single-image", json!({"image": "bm90IGFuIGltYWdl"}), "image"),
        (
            "/sdapi/v1/extra-single-image",
            json!({"image": input_b64(), "upscaling_resize": 0}),
            "upscaling_resize",
        ),
        (
            "/sdapi/v1/extra-single-image",
            json!({"image": input_b64(), "gfpgan_visibility": 1}),
            "gfpgan_visibility",
        ),
        ("/sdapi/v1/extra-batch-images", json!({"imageList": []}), "imageList"),
    ];
    for (path, body, field) in cases {
        let (status, got) = c.post(path, &body).await;
        assert_eq!(status, 400, "{path} {body}: {got}");
        assert_eq!(got["field"], field, "{path} {body}: {got}");
    }
    let (status, got) = c.post("/v1/jobs", &json!({"prompt": "x", "hires": {"upscaler": "Nope"}})).await;
    assert_eq!((status, got["error"]["param"].as_str()), (400, Some("hires.upscaler")), "{got}");
    // The worker still serves after the refusals.
    let (status, _) = c.post("/sdapi/v1/extra-single-image", &json!({"image": input_b64()})).await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webuiapi_and_the_openai_sdk_use_hires_and_upscalers() {
    if std::env::var_os("SDHIVE_SKIP_PYTHON_TESTS").is_some() {
        eprintln!("SDHIVE_SKIP_PYTHON_TESTS is set: skipping the webuiapi / openai hires test");
        return;
    }
    let python =
        tokio::task::spawn_blocking(|| pyclients::python_with(&["webuiapi", "openai"], "lora-clients-venv"))
            .await
            .expect("setup thread")
            .unwrap_or_else(|e| panic!("cannot set up Python with `webuiapi` and `openai` ({e})"));
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("hires-clients-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create the client's folder");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/hires_clients.py");
    let mut cmd = Command::new(&python);
    cmd.arg(&script).args(["--base-url", shared(), "--dir"]).arg(&dir);
    let out =
        tokio::task::spawn_blocking(move || cmd.output()).await.expect("client thread").expect("python");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the client script failed:\n--- stdout\n{stdout}\n--- stderr\n{stderr}");
    assert_close(&read_png(&dir.join("webuiapi-hires.png")), &hires_golden("latent"), "webuiapi hires");
    assert_close(&read_png(&dir.join("openai-hires.png")), &hires_golden("latent"), "openai hires");
    assert_close(&read_png(&dir.join("webuiapi-extras.png")), &esrgan_by_2_golden(), "webuiapi extras");
    let want = upscale_golden("a1111/extras_lanczos_to_60x50_crop");
    for i in 0..2 {
        assert_eq!(read_png(&dir.join(format!("webuiapi-batch-{i}.png"))).data, want.data, "batch image {i}");
    }
    let info: Value =
        serde_json::from_slice(&std::fs::read(dir.join("webuiapi-hires-info.json")).unwrap()).unwrap();
    assert!(info["infotexts"][0].as_str().unwrap_or_default().contains("Hires upscaler: Latent"), "{info}");
    let _ = std::fs::remove_dir_all(&dir);

    // Every route webuiapi has, as its users call them.
    let sweep = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/webuiapi_sweep.py");
    let mut cmd = Command::new(&python);
    cmd.arg(&sweep).args(["--base-url", shared()]);
    let out =
        tokio::task::spawn_blocking(move || cmd.output()).await.expect("client thread").expect("python");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the webuiapi sweep failed:\n--- stdout\n{stdout}\n--- stderr\n{stderr}");
}
