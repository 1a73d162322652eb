//! The AUTOMATIC1111 routes over real loopback HTTP, served in-process with the tiny SD1 fixture model:
//! txt2img/img2img images pixel-identical to `CandleEngine` for the same parameters (seeds, batch × iterations,
//! sampler aliases, clip skip from options), the `info` string clients `json.loads`, progress / interrupt /
//! disconnect semantics, the listing routes, 400s naming the field, and an A1111-style Python client.

use base64::Engine as _;
use candle_core::{DType, Device};
use sdhive_candle::{CandleEngine, LoadOptions};
use sdhive_engine::{
    decode_image, decode_mask, encode_image, Control, Engine, GenerateRequest, GrayImage, ImageFormat,
    OutputFormat, RgbImage, Sampler, Schedule,
};
use sdhive_protocol::JobState;
use sdhive_server::{AppState, ServerConfig};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(rel)
}

fn load_engine() -> CandleEngine {
    let path = fixture("models/sd1");
    // A local folder needs no network; offline makes sure a resolution bug cannot reach for one.
    let offline = sdhive_modelsource::ResolveOptions { offline: true, ..Default::default() };
    let model = sdhive_modelsource::resolve(&path.to_string_lossy(), &offline)
        .expect("the sd1 fixture model resolves");
    let opts = LoadOptions::single_device(&Device::Cpu, DType::F32, "cpu", "cpu");
    CandleEngine::load(&model, opts).expect("the sd1 fixture model loads")
}

fn reference(req: &GenerateRequest) -> Vec<RgbImage> {
    let output = load_engine().generate(req, &mut |_| Control::Continue).expect("reference generation");
    output.images.into_iter().map(|g| g.image).collect()
}

struct Server {
    base: String,
    state: AppState,
    http: reqwest::Client,
}

async fn start(config: ServerConfig) -> Server {
    let engine = tokio::task::spawn_blocking(load_engine).await.expect("engine loader thread");
    let state = AppState::new(ServerConfig { model_name: "sd1".into(), ..config }, Box::new(engine));
    let app = sdhive_server::router(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind a loopback port");
    let addr = listener.local_addr().expect("local address");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("test server stopped: {e}");
        }
    });
    let http = reqwest::Client::builder().timeout(Duration::from_secs(300)).build().expect("http client");
    Server { base: format!("http://{addr}"), state, http }
}

impl Server {
    async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let response = self.http.post(format!("{}{path}", self.base)).json(body).send().await.expect("POST");
        let status = response.status().as_u16();
        (status, response.json().await.expect("a JSON body"))
    }

    async fn get(&self, path: &str) -> (u16, Value) {
        let response = self.http.get(format!("{}{path}", self.base)).send().await.expect("GET");
        let status = response.status().as_u16();
        (status, response.json().await.expect("a JSON body"))
    }
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn decode_b64_png(value: &Value) -> RgbImage {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(value.as_str().expect("a base64 string"))
        .expect("valid base64");
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "images are PNGs");
    decode_image(&bytes, 1 << 24).expect("a decodable PNG")
}

fn images(got: &Value) -> Vec<RgbImage> {
    got["images"].as_array().expect("images is a list").iter().map(decode_b64_png).collect()
}

fn info(got: &Value) -> Value {
    serde_json::from_str(got["info"].as_str().expect("info is a string")).expect("info is a JSON string")
}

fn init_png() -> Vec<u8> {
    std::fs::read(fixture("images/init.png")).expect("init.png fixture")
}

fn mask_png() -> Vec<u8> {
    std::fs::read(fixture("images/mask.png")).expect("mask.png fixture")
}

fn assert_field_error(status: u16, body: &Value, field: &str) {
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["field"], field, "{body}");
    assert!(body["detail"].as_str().is_some_and(|d| !d.is_empty()), "{body}");
    assert!(body["error"].as_str().is_some(), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn txt2img_matches_the_engine_and_reports_info() {
    let server = start(ServerConfig::default()).await;
    let body = json!({
        "prompt": "a castle", "negative_prompt": "fog", "steps": 3, "cfg_scale": 5, "width": 64, "height": 64,
        "seed": 100, "batch_size": 2, "n_iter": 2, "sampler_name": "DPM++ 2M Karras",
        "override_settings": {"CLIP_stop_at_last_layers": 2}, "denoising_strength": 0.3, "save_images": true,
        "styles": [], "restore_faces": false,
    });
    let (status, got) = server.post("/sdapi/v1/txt2img", &body).await;
    assert_eq!(status, 200, "{got}");
    let want = reference(&GenerateRequest {
        prompt: "a castle".into(),
        negative_prompt: "fog".into(),
        steps: 3,
        cfg_scale: 5.0,
        width: Some(64),
        height: Some(64),
        seed: Some(100),
        n: 4,
        sampler: Sampler::DpmPp2M,
        schedule: Schedule::Karras,
        clip_skip: 2,
        ..Default::default()
    });
    assert_eq!(images(&got), want, "pixels differ from the engine's own output");

    let info = info(&got);
    assert_eq!(info["prompt"], "a castle");
    assert_eq!(info["all_prompts"], json!(vec!["a castle"; 4]));
    assert_eq!(info["negative_prompt"], "fog");
    assert_eq!(info["all_negative_prompts"].as_array().map(Vec::len), Some(4));
    assert_eq!(info["seed"], 100);
    assert_eq!(info["all_seeds"], json!([100, 101, 102, 103]));
    assert_eq!(info["subseed"], -1);
    assert_eq!(info["sampler_name"], "DPM++ 2M");
    assert_eq!(info["scheduler"], "karras");
    assert_eq!(info["extra_generation_params"]["Schedule type"], "Karras");
    assert_eq!((info["steps"].clone(), info["cfg_scale"].clone()), (json!(3), json!(5.0)));
    assert_eq!((info["width"].clone(), info["height"].clone()), (json!(64), json!(64)));
    assert_eq!((info["batch_size"].clone(), info["n_iter"].clone()), (json!(2), json!(2)));
    assert_eq!(info["clip_skip"], 2);
    assert_eq!(info["denoising_strength"], 0.0, "txt2img ignores denoising_strength");
    assert_eq!(info["sd_model_name"], server.state.info().model.as_str());
    let infotexts = info["infotexts"].as_array().expect("infotexts");
    assert_eq!(infotexts.len(), 4);
    assert!(infotexts[1].as_str().is_some_and(|t| t.contains("Seed: 101") && t.contains("Clip skip: 2")));
    assert!(info["job_timestamp"]
        .as_str()
        .is_some_and(|t| t.len() == 14 && t.bytes().all(|b| b.is_ascii_digit())));
    assert!(info["version"].as_str().is_some_and(|v| v.starts_with("sdhive")));

    // `parameters` echoes the request with defaults filled in.
    assert_eq!(got["parameters"]["prompt"], "a castle");
    assert_eq!(got["parameters"]["sampler_name"], "DPM++ 2M Karras");
    assert_eq!(got["parameters"]["send_images"], true);
}

/// The `Server-Timing` metrics of an answer, by name, in milliseconds.
fn server_timing(response: &reqwest::Response) -> std::collections::HashMap<String, f64> {
    let header = response.headers().get("server-timing").expect("a Server-Timing header");
    header
        .to_str()
        .expect("an ASCII header")
        .split(',')
        .map(|metric| {
            let (name, dur) =
                metric.trim().split_once(";dur=").unwrap_or_else(|| panic!("metric {metric:?}"));
            (name.to_string(), dur.parse().unwrap_or_else(|e| panic!("duration of {metric:?}: {e}")))
        })
        .collect()
}

/// Both generation routes say where a request's time went: its parts (reading the request, the queue, the engine,
/// the encoding, the route's wake-up and the answer) add up to no more than the server's total, which is no more
/// than what the client waited, and the engine's share is the run itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generations_answer_with_server_timing() {
    let server = start(ServerConfig::default()).await;
    let routes = [
        ("/sdapi/v1/txt2img", json!({"prompt": "a boat", "steps": 2, "width": 64, "height": 64, "seed": 1})),
        (
            "/v1/images/generations",
            json!({"prompt": "a boat", "size": "64x64", "steps": 2, "seed": 1, "response_format": "b64_json"}),
        ),
    ];
    for (path, body) in routes {
        let sent = Instant::now();
        let response =
            server.http.post(format!("{}{path}", server.base)).json(&body).send().await.expect("POST");
        assert_eq!(response.status().as_u16(), 200, "{path}");
        let timing = server_timing(&response);
        let _: Value = response.json().await.expect("a JSON body");
        let waited = sent.elapsed().as_secs_f64() * 1e3;
        let part =
            |name: &str| *timing.get(name).unwrap_or_else(|| panic!("{path}: no `{name}` in {timing:?}"));
        let names = ["prepare", "queue", "engine", "encode", "wake", "answer"];
        let parts: Vec<f64> = names.iter().map(|n| part(n)).collect();
        let (engine, encode, total) = (part("engine"), part("encode"), part("total"));
        assert!(parts.iter().all(|&d| d >= 0.0), "{path}: {timing:?}");
        // Two steps and a VAE decode of the fixture on the CPU take milliseconds; a 64² PNG far less.
        assert!(engine > encode && engine > 1.0, "{path}: {timing:?}");
        // Each part is rounded to 0.01 ms; `wake` is read off the wall clock, the rest off the monotonic one.
        let sum: f64 = parts.iter().sum();
        assert!(sum <= total + 0.5, "{path}: the parts exceed the total: {timing:?}");
        assert!(
            total <= waited,
            "{path}: the server's total {total} ms exceeds the client's wait {waited} ms"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn txt2img_defaults_aliases_random_seed_and_send_images() {
    let server = start(ServerConfig::default()).await;
    // sampler_index (the old field) with a k-diffusion alias; seed -1 = random; width/height default to the model.
    let (status, got) = server
        .post(
            "/sdapi/v1/txt2img",
            &json!({"prompt": "p", "steps": 2, "seed": -1, "sampler_index": "k_euler_a"}),
        )
        .await;
    assert_eq!(status, 200, "{got}");
    let info = info(&got);
    let seed = info["seed"].as_u64().expect("the drawn seed is reported");
    assert!(seed < 1 << 32);
    assert_eq!(info["sampler_name"], "Euler a");
    let native = (server.state.info().native_width, server.state.info().native_height);
    assert_eq!(
        (info["width"].as_u64(), info["height"].as_u64()),
        (Some(native.0.into()), Some(native.1.into()))
    );
    let want = reference(&GenerateRequest {
        prompt: "p".into(),
        steps: 2,
        seed: Some(seed),
        sampler: Sampler::EulerA,
        ..Default::default()
    });
    assert_eq!(images(&got), want, "the reported seed reproduces the image");

    // No sampler at all: A1111's API default is Euler.
    let (status, got) =
        server.post("/sdapi/v1/txt2img", &json!({"prompt": "p", "steps": 1, "send_images": false})).await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["images"], json!([]));
    assert_eq!(info_sampler(&got), "Euler");
}

fn info_sampler(got: &Value) -> String {
    info(got)["sampler_name"].as_str().unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn img2img_and_inpaint_match_the_engine() {
    let server = start(ServerConfig::default()).await;
    let init = decode_image(&init_png(), 1 << 24).expect("init.png");
    let (status, got) = server
        .post(
            "/sdapi/v1/img2img",
            &json!({
                "init_images": [format!("data:image/png;base64,{}", b64(&init_png()))],
                "prompt": "a garden", "steps": 5, "seed": 9, "denoising_strength": 0.5, "sampler_name": "DDIM",
                "resize_mode": 0,
            }),
        )
        .await;
    assert_eq!(status, 200, "{got}");
    let want = reference(&GenerateRequest {
        prompt: "a garden".into(),
        steps: 5,
        seed: Some(9),
        init_image: Some(init.clone()),
        strength: 0.5,
        sampler: Sampler::Ddim,
        ..Default::default()
    });
    assert_eq!(images(&got), want);
    assert_eq!(info(&got)["denoising_strength"], 0.5);
    assert_eq!(got["parameters"]["init_images"], Value::Null, "uploads are not echoed back");

    // Inpainting: the mask is used as given (white = repaint) with mask_blur 0 …
    let mask = decode_mask(&mask_png(), 1 << 24).expect("mask.png");
    let inpaint = |extra: Value| {
        let mut body = json!({
            "init_images": [b64(&init_png())], "mask": b64(&mask_png()), "prompt": "a pond", "steps": 4,
            "seed": 11, "denoising_strength": 1.0, "inpainting_fill": 1, "sampler_name": "Euler",
        });
        body.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
        body
    };
    let reference_with = |mask: GrayImage| {
        reference(&GenerateRequest {
            prompt: "a pond".into(),
            steps: 4,
            seed: Some(11),
            init_image: Some(init.clone()),
            mask: Some(mask),
            strength: 1.0,
            sampler: Sampler::Euler,
            ..Default::default()
        })
    };
    let (status, got) = server.post("/sdapi/v1/img2img", &inpaint(json!({"mask_blur": 0}))).await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(images(&got), reference_with(mask.clone()));
    assert_eq!(info(&got)["extra_generation_params"]["Mask blur"], 0);

    // … inverted on request …
    let inverted = GrayImage { data: mask.data.iter().map(|v| 255 - v).collect(), ..mask.clone() };
    let (status, got) = server
        .post("/sdapi/v1/img2img", &inpaint(json!({"mask_blur": 0, "inpainting_mask_invert": 1})))
        .await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(images(&got), reference_with(inverted));

    // … and blurred by default (A1111's mask_blur 4), which changes the result.
    let (status, got) = server.post("/sdapi/v1/img2img", &inpaint(json!({}))).await;
    assert_eq!(status, 200, "{got}");
    assert_ne!(images(&got), reference_with(mask));
    assert_eq!(info(&got)["extra_generation_params"]["Mask blur"], 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_a_400_naming_the_field() {
    let server = start(ServerConfig::default()).await;
    let init = b64(&init_png());
    let txt = [
        (json!({"prompt": "a", "width": 100, "height": 64}), "width"),
        (json!({"prompt": "a", "height": 7}), "height"),
        (json!({"prompt": "a", "steps": 0}), "steps"),
        (json!({"prompt": "a", "batch_size": 0}), "batch_size"),
        (json!({"prompt": "a", "batch_size": 5, "n_iter": 5}), "batch_size"),
        (json!({"prompt": "a", "sampler_name": "Heun"}), "sampler_name"),
        (json!({"prompt": "a", "sampler_index": "Heun"}), "sampler_index"),
        (json!({"prompt": "a", "sampler_name": "DDIM", "scheduler": "karras"}), "scheduler"),
        (json!({"prompt": "a", "scheduler": "exponential"}), "scheduler"),
        (json!({"prompt": "a", "seed": -3}), "seed"),
        (json!({"prompt": "a", "cfg_scale": "high"}), "cfg_scale"),
        (json!({"prompt": "a", "enable_hr": true, "hr_upscaler": "4x-Nope"}), "hr_upscaler"),
        (
            json!({"prompt": "a", "override_settings": {"CLIP_stop_at_last_layers": 0}}),
            "override_settings.CLIP_stop_at_last_layers",
        ),
        (
            json!({"prompt": "a", "override_settings": {"sd_model_checkpoint": "other.safetensors"}}),
            "override_settings.sd_model_checkpoint",
        ),
    ];
    for (body, field) in txt {
        let (status, got) = server.post("/sdapi/v1/txt2img", &body).await;
        assert_field_error(status, &got, field);
    }
    let img = [
        (json!({"prompt": "a"}), "init_images"),
        (json!({"prompt": "a", "init_images": []}), "init_images"),
        (json!({"prompt": "a", "init_images": ["%%% not base64"]}), "init_images"),
        (json!({"prompt": "a", "init_images": [b64(b"not an image")]}), "init_images"),
        (json!({"prompt": "a", "init_images": [init], "mask": "@@@"}), "mask"),
        (json!({"prompt": "a", "init_images": [init], "denoising_strength": 0}), "denoising_strength"),
        (json!({"prompt": "a", "init_images": [init], "resize_mode": 1}), "resize_mode"),
        (json!({"prompt": "a", "init_images": [init], "inpainting_fill": 7}), "inpainting_fill"),
        (json!({"prompt": "a", "init_images": [init], "mask_blur": 500}), "mask_blur"),
        (
            json!({"prompt": "a", "init_images": [init], "inpainting_mask_invert": 3}),
            "inpainting_mask_invert",
        ),
    ];
    for (body, field) in img {
        let (status, got) = server.post("/sdapi/v1/img2img", &body).await;
        assert_field_error(status, &got, field);
    }
    let response = server
        .http
        .post(format!("{}/sdapi/v1/txt2img", server.base))
        .body("{not json")
        .send()
        .await
        .expect("POST");
    assert_eq!(response.status().as_u16(), 400);
    let (status, got) = server.post("/sdapi/v1/options", &json!({"CLIP_stop_at_last_layers": 40})).await;
    assert_field_error(status, &got, "CLIP_stop_at_last_layers");
    let (status, got) = server.post("/sdapi/v1/options", &json!({"sd_model_checkpoint": "sdxl-base"})).await;
    assert_field_error(status, &got, "sd_model_checkpoint");
    for (options, field) in [
        (json!({"samples_format": "gif"}), "samples_format"),
        (json!({"samples_format": 3}), "samples_format"),
        (json!({"jpeg_quality": 101}), "jpeg_quality"),
        (json!({"jpeg_quality": 7.5}), "jpeg_quality"),
        (json!({"webp_lossless": "yes"}), "webp_lossless"),
        // A bad value refuses the whole request: the valid clip skip beside it is not stored either.
        (json!({"CLIP_stop_at_last_layers": 3, "samples_format": "tiff"}), "samples_format"),
    ] {
        let (status, got) = server.post("/sdapi/v1/options", &options).await;
        assert_field_error(status, &got, field);
        let (status, got) =
            server.post("/sdapi/v1/txt2img", &json!({"prompt": "a", "override_settings": options})).await;
        assert_field_error(status, &got, &format!("override_settings.{field}"));
    }
    let (_, options) = server.get("/sdapi/v1/options").await;
    assert_eq!(
        (&options["samples_format"], &options["CLIP_stop_at_last_layers"]),
        (&json!("png"), &json!(1))
    );
    // The infotext of prompts this long cannot fit a JPEG's EXIF.
    let long = json!({"prompt": "x".repeat(20_000), "negative_prompt": "y".repeat(10_000),
                      "override_settings": {"samples_format": "jpg"}});
    let (status, got) = server.post("/sdapi/v1/txt2img", &long).await;
    assert_field_error(status, &got, "samples_format");
    assert_eq!(server.state.metrics.jobs_entered(JobState::Queued), 0);
}

fn image_bytes(value: &Value) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(value.as_str().expect("a base64 string"))
        .expect("base64")
}

/// `samples_format` (with `jpeg_quality`) picks the format of the response's images, as A1111's API encodes them,
/// from the options or a request's `override_settings`; the infotext is in every format.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn samples_format_picks_the_image_format() {
    let server = start(ServerConfig::default()).await;
    let (_, options) = server.get("/sdapi/v1/options").await;
    assert_eq!(
        (&options["samples_format"], &options["jpeg_quality"], &options["webp_lossless"]),
        (&json!("png"), &json!(80), &json!(false))
    );
    let body = json!({"prompt": "p", "steps": 2, "seed": 5});
    let want = &reference(&GenerateRequest {
        prompt: "p".into(),
        steps: 2,
        seed: Some(5),
        sampler: Sampler::Euler,
        ..Default::default()
    })[0];
    let (status, got) =
        server.post("/sdapi/v1/options", &json!({"samples_format": "jpg", "jpeg_quality": 60})).await;
    assert_eq!((status, got), (200, Value::Null));
    let (_, options) = server.get("/sdapi/v1/options").await;
    assert_eq!((&options["samples_format"], &options["jpeg_quality"]), (&json!("jpg"), &json!(60)));
    // Clients that send the whole options object back (Open WebUI) set what they got.
    let (status, _) = server.post("/sdapi/v1/options", &options).await;
    assert_eq!(status, 200);

    let (status, got) = server.post("/sdapi/v1/txt2img", &body).await;
    assert_eq!(status, 200, "{got}");
    let jpeg = image_bytes(&got["images"][0]);
    assert_eq!(image::guess_format(&jpeg).expect("a known format"), image::ImageFormat::Jpeg);
    // The engine's image, as JPEG at quality 60 (the EXIF beside the pixels changes none of them).
    let expected = encode_image(want, None, OutputFormat::new(ImageFormat::Jpeg, 60)).expect("a JPEG");
    assert_eq!(
        decode_image(&jpeg, 1 << 24).expect("a decodable JPEG"),
        decode_image(&expected, 1 << 24).unwrap()
    );
    let infotext = info(&got)["infotexts"][0].as_str().expect("an infotext").to_string();
    let (status, read) = server.post("/sdapi/v1/png-info", &json!({"image": got["images"][0]})).await;
    assert_eq!((status, read["info"].as_str()), (200, Some(infotext.as_str())), "{read}");

    // A request's overrides: for that request only, unless it says not to restore them.
    let with = |overrides: Value, restore: bool| {
        let mut body = body.clone();
        body["override_settings"] = overrides;
        body["override_settings_restore_afterwards"] = json!(restore);
        body
    };
    let (_, got) = server.post("/sdapi/v1/txt2img", &with(json!({"jpeg_quality": 95}), true)).await;
    assert!(image_bytes(&got["images"][0]).len() > jpeg.len(), "quality 95 is larger than 60");
    let (_, got) = server.post("/sdapi/v1/txt2img", &with(json!({"samples_format": "webp"}), true)).await;
    let webp = image_bytes(&got["images"][0]);
    assert_eq!(image::guess_format(&webp).expect("a known format"), image::ImageFormat::WebP);
    assert_eq!(&decode_image(&webp, 1 << 24).expect("a decodable WebP"), want, "WebP is lossless");
    let (_, read) = server.post("/sdapi/v1/png-info", &json!({"image": got["images"][0]})).await;
    assert_eq!(read["info"].as_str(), Some(infotext.as_str()), "{read}");
    let (_, options) = server.get("/sdapi/v1/options").await;
    assert_eq!((&options["samples_format"], &options["jpeg_quality"]), (&json!("jpg"), &json!(60)));

    let (_, got) = server.post("/sdapi/v1/txt2img", &with(json!({"samples_format": "PNG"}), false)).await;
    assert_eq!(images(&got), std::slice::from_ref(want));
    let (_, options) = server.get("/sdapi/v1/options").await;
    assert_eq!(options["samples_format"], "PNG", "kept, as A1111 keeps it, when not restored");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listings_and_options() {
    let server = start(ServerConfig::default()).await;
    let (status, models) = server.get("/sdapi/v1/sd-models").await;
    assert_eq!(status, 200);
    let model = &models[0];
    for key in ["title", "model_name", "hash", "sha256", "filename", "config"] {
        assert!(model.get(key).is_some(), "sd-models lacks {key}: {model}");
    }
    let title = model["title"].as_str().expect("a title").to_string();

    let (_, samplers) = server.get("/sdapi/v1/samplers").await;
    let names: Vec<&str> =
        samplers.as_array().expect("list").iter().filter_map(|s| s["name"].as_str()).collect();
    assert_eq!(names, ["Euler", "Euler a", "DDIM", "DPM++ 2M", "LCM", "PNDM"]);
    assert!(samplers[1]["aliases"].as_array().is_some_and(|a| a.contains(&json!("k_euler_a"))));
    assert!(samplers[0]["options"].is_object());

    let (_, schedulers) = server.get("/sdapi/v1/schedulers").await;
    assert_eq!(schedulers[0]["name"], "automatic");
    assert_eq!(schedulers[0]["label"], "Automatic");
    assert_eq!(schedulers[1]["name"], "karras");
    assert_eq!(schedulers[1]["label"], "Karras");

    let (_, options) = server.get("/sdapi/v1/options").await;
    assert_eq!(options["sd_model_checkpoint"], title.as_str());
    assert_eq!(options["CLIP_stop_at_last_layers"], 1);
    assert_eq!(options["samples_format"], "png");

    // POST stores clip skip (used by later requests), accepts our own checkpoint, keeps unknown keys.
    let (status, got) = server
        .post(
            "/sdapi/v1/options",
            &json!({"CLIP_stop_at_last_layers": 2, "sd_model_checkpoint": title, "show_progressbar": false}),
        )
        .await;
    assert_eq!((status, got), (200, Value::Null));
    let (_, options) = server.get("/sdapi/v1/options").await;
    assert_eq!(options["CLIP_stop_at_last_layers"], 2);
    assert_eq!(options["show_progressbar"], false);
    assert_eq!(options["samples_format"], "png");
    let (status, got) =
        server.post("/sdapi/v1/txt2img", &json!({"prompt": "p", "steps": 2, "seed": 5})).await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(info(&got)["clip_skip"], 2);
    let want = reference(&GenerateRequest {
        prompt: "p".into(),
        steps: 2,
        seed: Some(5),
        clip_skip: 2,
        sampler: Sampler::Euler,
        ..Default::default()
    });
    assert_eq!(images(&got), want);

    let (status, idle) = server.get("/sdapi/v1/progress").await;
    assert_eq!(status, 200);
    assert_eq!(idle["progress"], 0.0);
    assert_eq!(idle["state"]["job_count"], 0);
    assert_eq!(idle["current_image"], Value::Null);
    let (status, got) = server.post("/sdapi/v1/skip", &json!({})).await;
    assert_eq!(status, 501, "{got}");
}

async fn wait_for_running_job(server: &Server) -> Value {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (_, p) = server.get("/sdapi/v1/progress").await;
        if p["state"]["job"].as_str().is_some_and(|j| !j.is_empty())
            && p["state"]["sampling_step"].as_u64() >= Some(1)
        {
            return p;
        }
        assert!(Instant::now() < deadline, "no job started: {p}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn wait_until_finished(server: &Server, id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, job) = server.get(&format!("/v1/jobs/{id}")).await;
        assert_eq!(status, 200, "{job}");
        if job["state"] != "running" && job["state"] != "queued" {
            return job;
        }
        assert!(Instant::now() < deadline, "job never finished: {job}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const LONG: &str = r#"{"prompt": "a long one", "width": 64, "height": 64, "steps": 150, "batch_size": 8}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_then_interrupt() {
    let server = start(ServerConfig::default()).await;
    let url = format!("{}/sdapi/v1/txt2img", server.base);
    let client = server.http.clone();
    let request = tokio::spawn(async move {
        let response = client.post(url).body(LONG).send().await.expect("POST");
        (response.status().as_u16(), response.json::<Value>().await.expect("json"))
    });
    let p = wait_for_running_job(&server).await;
    let fraction = p["progress"].as_f64().expect("progress is a number");
    assert!(fraction > 0.0 && fraction < 1.0, "{p}");
    assert_eq!(p["state"]["job_count"], 8);
    assert_eq!(p["state"]["sampling_steps"], 150);
    assert_eq!(p["state"]["interrupted"], false);
    assert!(p["eta_relative"].as_f64().is_some_and(|e| e >= 0.0), "{p}");
    assert!(p["state"]["job_timestamp"].as_str().is_some_and(|t| t.len() == 14));
    assert!(p["textinfo"].is_string());
    let id = p["state"]["job"].as_str().expect("job id").to_string();

    let (status, _) = server.post("/sdapi/v1/interrupt", &json!({})).await;
    assert_eq!(status, 200);
    // As in A1111: 200 with the images finished before the interrupt (none: it came during the first).
    let (status, got) = request.await.expect("request task");
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["images"], json!([]), "{got}");
    assert_eq!(info(&got)["all_seeds"].as_array().map(Vec::len), Some(8), "{got}");
    assert_eq!(wait_until_finished(&server, &id).await["state"], "cancelled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_cancels_its_job() {
    let server = start(ServerConfig::default()).await;
    let url = format!("{}/sdapi/v1/txt2img", server.base);
    let client = server.http.clone();
    let request = tokio::spawn(async move { client.post(url).body(LONG).send().await.map(|r| r.status()) });
    let id = wait_for_running_job(&server).await["state"]["job"].as_str().expect("job id").to_string();
    request.abort();
    assert!(request.await.is_err_and(|e| e.is_cancelled()), "the request must still have been in flight");
    assert_eq!(wait_until_finished(&server, &id).await["state"], "cancelled");
    assert_eq!(server.state.metrics.jobs_entered(JobState::Cancelled), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_a1111_style_python_client_works() {
    if std::env::var_os("SDHIVE_SKIP_PYTHON_TESTS").is_some() {
        eprintln!("SDHIVE_SKIP_PYTHON_TESTS is set: skipping the A1111 client test");
        return;
    }
    let python =
        std::env::var_os("SDHIVE_TEST_PYTHON").map(PathBuf::from).unwrap_or_else(|| "python3".into());
    let server = start(ServerConfig::default()).await;
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("a1111-client-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create the client's folder");
    std::fs::write(dir.join("init.png"), init_png()).expect("write init.png");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/a1111_client.py");
    let mut cmd = Command::new(&python);
    cmd.arg(&script).args(["--base-url", &server.base, "--dir"]).arg(&dir);
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .expect("client thread")
        .unwrap_or_else(|e| panic!("cannot run {}: {e} (set SDHIVE_TEST_PYTHON)", python.display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the A1111 client failed:\n--- stdout\n{stdout}\n--- stderr\n{stderr}");

    let read = |name: &str| {
        decode_image(&std::fs::read(dir.join(name)).expect("client output"), 1 << 24).expect("a PNG")
    };
    let want = reference(&GenerateRequest {
        prompt: "a lighthouse at dusk".into(),
        steps: 4,
        seed: Some(1234),
        n: 2,
        width: Some(64),
        height: Some(64),
        sampler: Sampler::EulerA,
        ..Default::default()
    });
    assert_eq!(vec![read("txt2img-0.png"), read("txt2img-1.png")], want);
    let init = decode_image(&init_png(), 1 << 24).expect("init.png");
    let want = reference(&GenerateRequest {
        prompt: "a lighthouse at dawn".into(),
        steps: 4,
        seed: Some(99),
        init_image: Some(init),
        strength: 0.6,
        sampler: Sampler::Euler,
        ..Default::default()
    });
    assert_eq!(read("img2img-0.png"), want[0]);
    // Kept on failure (the asserts above return early) for inspection; removed once the images matched.
    let _ = std::fs::remove_dir_all(&dir);
}
