//! The rest of the A1111 API over loopback HTTP, on a fast stand-in engine that writes real infotexts: PNG Info
//! (our PNGs, A1111-style text, corrupt uploads), `memory`, `cmd-flags`, the empty listings, prompt styles (listed,
//! applied to A1111 and native requests, unknown ones refused), `--api-auth` Basic credentials beside the bearer
//! key, an interrupted batch answering with the images it finished, and the same (with `samples_format`) through the
//! real `webuiapi` client (`tests/clients/a1111_extras_client.py`).

mod common;
mod pyclients;

use base64::Engine as _;
use sdhive_engine::{
    infotext, Control, Engine, EngineError, EngineInfo, GenerateOutput, GenerateRequest, GeneratedImage,
    InfotextContext, Progress, RgbImage, Sampler,
};
use sdhive_protocol::{parse_api_auth, DeviceDescription};
use sdhive_server::ServerConfig;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Requests with this prompt record their `preview_approx` in [`PROBED`].
const PROBE: &str = "preview-kind probe";
static PROBED: std::sync::Mutex<Vec<bool>> = std::sync::Mutex::new(Vec::new());

/// 8×8 images, one colour per seed, with the infotext the real engines write; `per_step` per denoising step;
/// a cancel returns the images already finished, as both engines do.
struct InfotextEngine {
    per_step: Duration,
}

impl Engine for InfotextEngine {
    fn info(&self) -> EngineInfo {
        EngineInfo {
            engine: "fake".into(),
            backend: "cpu".into(),
            device: "none".into(),
            dtype: "f32".into(),
            model: "fake-model".into(),
            family: "sd1".into(),
            native_width: 8,
            native_height: 8,
            samplers: Sampler::ALL.iter().map(|s| s.name().to_string()).collect(),
            supports_img2img: true,
            supports_inpaint: false,
            memory: None,
            text_widths: Vec::new(),
            preview: Default::default(),
        }
    }

    fn generate(
        &mut self,
        req: &GenerateRequest,
        progress: &mut dyn FnMut(&Progress) -> Control,
    ) -> Result<GenerateOutput, EngineError> {
        if req.prompt == PROBE {
            PROBED.lock().unwrap().push(req.preview_approx);
        }
        let mut images = Vec::new();
        let (width, height) = req.output_size((8, 8));
        for image in 0..req.n {
            for step in 1..=req.steps {
                std::thread::sleep(self.per_step);
                let p = Progress { image, images: req.n, step, steps: req.steps, preview: None };
                if progress(&p) == Control::Cancel {
                    return Err(EngineError::Cancelled { done: images });
                }
            }
            let seed = req.seed.unwrap_or(0).wrapping_add(u64::from(image));
            let ctx = InfotextContext { seed, width, height, model: "fake-model", version: "sdhive test" };
            let data = vec![(seed % 251) as u8; (width * height * 3) as usize];
            images.push(GeneratedImage {
                image: RgbImage { width, height, data },
                seed,
                infotext: infotext(req, &ctx),
            });
        }
        Ok(GenerateOutput { images })
    }

    /// The extras' stand-in: the images as they came.
    fn upscale(&mut self, req: &sdhive_engine::UpscaleRequest) -> Result<Vec<RgbImage>, EngineError> {
        Ok(req.images.clone())
    }
}

fn loader(per_step: Duration) -> sdhive_server::EngineLoader {
    Box::new(move || Ok(Box::new(InfotextEngine { per_step }) as Box<dyn Engine>))
}

const STYLES_CSV: &str = "name,prompt,negative_prompt\n\
                          film,\"{prompt}, film grain, 35mm\",cartoon\n\
                          tail,masterpiece,\"lowres, bad hands\"\n";

/// A styles file in a folder of its own under the target directory (removed with the test's run).
fn styles_file(tag: &str) -> PathBuf {
    let dir =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("a1111-extras-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create the styles folder");
    let path = dir.join("styles.csv");
    std::fs::write(&path, STYLES_CSV).expect("write styles.csv");
    path
}

fn config(styles: Option<PathBuf>) -> ServerConfig {
    ServerConfig { styles_file: styles, ..common::config() }
}

async fn start(config: ServerConfig, per_step: Duration) -> common::TestServer {
    common::start_with(config, loader(per_step), None).await
}

async fn json_of(r: reqwest::Response) -> (u16, Value) {
    let status = r.status().as_u16();
    (status, r.json().await.expect("a JSON body"))
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn png_bytes(b64_png: &Value) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(b64_png.as_str().expect("base64 string"))
        .expect("base64")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn png_info_reads_our_images_and_a1111_text() {
    let server = start(config(Some(styles_file("png-info"))), Duration::ZERO).await;
    let body = json!({
        "prompt": "a lighthouse, \"at dusk\"", "negative_prompt": "fog", "styles": ["film", "tail"],
        "steps": 3, "cfg_scale": 6.5, "seed": 77, "sampler_name": "DPM++ 2M", "scheduler": "karras",
        "override_settings": {"CLIP_stop_at_last_layers": 2}, "unknown_field": {"ignored": true},
    });
    let (status, got) = json_of(server.post_json("/sdapi/v1/txt2img", &body).await).await;
    assert_eq!(status, 200, "{got}");
    let info: Value = serde_json::from_str(got["info"].as_str().expect("info")).expect("info JSON");
    assert_eq!(info["prompt"], "a lighthouse, \"at dusk\", film grain, 35mm, masterpiece", "{info}");
    assert_eq!(info["negative_prompt"], "fog, cartoon, lowres, bad hands", "{info}");
    assert_eq!(info["styles"], json!(["film", "tail"]));

    let png = png_bytes(&got["images"][0]);
    let (status, parsed) =
        json_of(server.post_json("/sdapi/v1/png-info", &json!({"image": b64(&png), "extra": 1})).await).await;
    assert_eq!(status, 200, "{parsed}");
    assert_eq!(parsed["info"], info["infotexts"][0], "{parsed}");
    assert_eq!(parsed["items"], json!({}), "{parsed}");
    let p = &parsed["parameters"];
    // The styles file recognises the styled prompts, as A1111's "Apply if any" does.
    assert_eq!(p["Prompt"], "a lighthouse, \"at dusk\"", "{p}");
    assert_eq!(p["Negative prompt"], "fog", "{p}");
    assert_eq!(p["Styles array"], json!(["film", "tail"]), "{p}");
    for (key, want) in [
        ("Steps", "3"),
        ("Sampler", "DPM++ 2M"),
        ("Schedule type", "Karras"),
        ("CFG scale", "6.5"),
        ("Seed", "77"),
        ("Size-1", "8"),
        ("Size-2", "8"),
        ("Model", "fake-model"),
        ("Clip skip", "2"),
    ] {
        assert_eq!(p[key], want, "{key}: {p}");
    }

    // A data: URL, and A1111-written text in an iTXt chunk, with quoted values and hires settings.
    let a1111 = "1girl, solo\nNegative prompt: worst quality\nSteps: 28, Sampler: Euler a, CFG scale: 7, \
                 Seed: 1, Size: 512x768, Model hash: 6ce0161689, Model: v1-5-pruned-emaonly, Denoising strength: \
                 0.5, Hires upscale: 2, Hires upscaler: Latent, Lora hashes: \"a: 0123456789ab, b: ba9876543210\", \
                 Version: v1.10.1";
    let image = sdhive_engine::encode_png(
        &RgbImage { width: 2, height: 2, data: vec![0; 12] },
        Some(&format!("{a1111} \u{2603}")),
    )
    .expect("encode");
    let url = format!("data:image/png;base64,{}", b64(&image));
    let (status, parsed) =
        json_of(server.post_json("/sdapi/v1/png-info", &json!({"image": url})).await).await;
    assert_eq!(status, 200, "{parsed}");
    let p = &parsed["parameters"];
    assert_eq!(
        (p["Prompt"].as_str(), p["Negative prompt"].as_str()),
        (Some("1girl, solo"), Some("worst quality"))
    );
    assert_eq!((p["Size-1"].as_str(), p["Size-2"].as_str()), (Some("512"), Some("768")));
    assert_eq!((p["Hires upscale"].as_str(), p["Hires upscaler"].as_str()), (Some("2"), Some("Latent")));
    assert_eq!(p["Lora hashes"], "a: 0123456789ab, b: ba9876543210");
    assert_eq!(p["Model hash"], "6ce0161689");
    assert_eq!(p["Version"], "v1.10.1 \u{2603}");

    // An image without parameters: info "" and A1111's defaults.
    let plain =
        sdhive_engine::encode_png(&RgbImage { width: 2, height: 2, data: vec![0; 12] }, None).unwrap();
    let (status, parsed) =
        json_of(server.post_json("/sdapi/v1/png-info", &json!({"image": b64(&plain)})).await).await;
    assert_eq!(status, 200, "{parsed}");
    assert_eq!((parsed["info"].as_str(), parsed["parameters"]["Prompt"].as_str()), (Some(""), Some("")));

    // Bad uploads are a 400 naming `image`.
    // The compressed pixels damaged (a damaged text chunk alone passes, as in A1111).
    let mut corrupt = png.clone();
    let at = png.windows(4).position(|w| w == b"IDAT").expect("an IDAT chunk") + 6;
    corrupt[at..at + 4].copy_from_slice(b"\xff\x00\xff\x00");
    for bad in [
        json!({"image": b64(&corrupt)}),
        json!({"image": b64(b"not an image")}),
        json!({"image": "%%%"}),
        json!({}),
    ] {
        let (status, e) = json_of(server.post_json("/sdapi/v1/png-info", &bad).await).await;
        assert_eq!(status, 400, "{bad}: {e}");
        assert_eq!(e["field"], "image", "{e}");
        assert!(e["detail"].as_str().is_some_and(|d| d.contains("image")), "{e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn styles_are_listed_applied_and_checked() {
    let path = styles_file("styles");
    let server = start(config(Some(path.clone())), Duration::ZERO).await;
    let (status, listed) = json_of(server.get("/sdapi/v1/prompt-styles").await).await;
    assert_eq!(status, 200);
    assert_eq!(
        listed,
        json!([
            {"name": "film", "prompt": "{prompt}, film grain, 35mm", "negative_prompt": "cartoon"},
            {"name": "tail", "prompt": "masterpiece", "negative_prompt": "lowres, bad hands"},
        ])
    );

    // Native jobs take `styles` too; an edit to the file applies to the next request.
    std::fs::write(&path, format!("{STYLES_CSV}late,\"sketch of {{prompt}}\",\n")).unwrap();
    let id = server.submit(&json!({"prompt": "a fox", "styles": ["late", "tail"], "steps": 1})).await;
    let job = server.wait_done(&id).await;
    assert_eq!(job.request.prompt, "sketch of a fox, masterpiece");
    assert!(job.images[0]
        .infotext
        .starts_with("sketch of a fox, masterpiece\nNegative prompt: lowres, bad hands\n"));

    // Unknown names: 400 about `styles`, naming the style and what there is, before anything is queued.
    let (status, e) =
        json_of(server.post_json("/sdapi/v1/txt2img", &json!({"prompt": "x", "styles": ["flim"]})).await)
            .await;
    assert_eq!(status, 400, "{e}");
    assert_eq!(e["field"], "styles", "{e}");
    let detail = e["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("`flim`") && detail.contains("film, tail, late"), "{e}");
    let (status, e) =
        json_of(server.post_json("/v1/jobs", &json!({"prompt": "x", "styles": ["nope"]})).await).await;
    assert_eq!((status, e["error"]["param"].as_str()), (400, Some("styles")), "{e}");

    // A server without a styles file lists none and refuses style names.
    let bare = start(config(None), Duration::ZERO).await;
    assert_eq!(json_of(bare.get("/sdapi/v1/prompt-styles").await).await, (200, json!([])));
    let (status, e) =
        json_of(bare.post_json("/sdapi/v1/img2img", &json!({"prompt": "x", "styles": ["film"]})).await).await;
    assert_eq!((status, e["field"].as_str()), (400, Some("styles")), "{e}");
    let (status, _) =
        json_of(bare.post_json("/sdapi/v1/txt2img", &json!({"prompt": "x", "styles": [], "steps": 1})).await)
            .await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_flags_and_empty_listings() {
    let styles = styles_file("flags");
    let networks = sdhive_catalog::NetworksConfig {
        lora_dirs: vec![PathBuf::from("/srv/loras")],
        embeddings_dirs: vec![PathBuf::from("/srv/emb")],
        ..Default::default()
    };
    let cfg = ServerConfig {
        api_key: Some("key-s3cret".into()),
        api_auth: parse_api_auth("alice:pw-s3cret").unwrap(),
        networks,
        ..config(Some(styles.clone()))
    };
    let server = start(cfg, Duration::ZERO).await;

    let (status, memory) = json_of(server.get("/sdapi/v1/memory").await).await;
    assert_eq!(status, 200, "{memory}");
    if cfg!(target_os = "linux") {
        let ram = &memory["ram"];
        let (used, total) = (ram["used"].as_u64().unwrap_or(0), ram["total"].as_u64().unwrap_or(0));
        assert!(used > 0 && used < total && ram["free"].as_u64() == Some(total - used), "{memory}");
    }
    // A CPU worker has no device memory apart from RAM: A1111's error form, no made-up numbers.
    assert!(memory["cuda"]["error"].as_str().is_some_and(|e| e.contains("CPU")), "{memory}");

    let (status, flags) = json_of(server.get("/sdapi/v1/cmd-flags").await).await;
    assert_eq!(status, 200);
    assert_eq!(
        (flags["api"].as_bool(), flags["api_auth"].as_str()),
        (Some(true), Some("<redacted>")),
        "{flags}"
    );
    assert_eq!(flags["api_key"], "<redacted>");
    assert_eq!(
        (flags["lora_dir"].as_str(), flags["embeddings_dir"].as_str()),
        (Some("/srv/loras"), Some("/srv/emb"))
    );
    assert_eq!(flags["styles_file"], styles.display().to_string());
    assert_eq!(flags["listen"], false);
    assert_eq!(
        flags["port"].as_u64(),
        server.base.rsplit(':').next().and_then(|p| p.parse().ok()),
        "{flags}"
    );
    assert!(!flags.to_string().contains("s3cret"), "a secret leaked: {flags}");

    for (path, want) in [
        ("/sdapi/v1/face-restorers", json!([])),
        ("/sdapi/v1/realesrgan-models", json!([])),
        ("/sdapi/v1/scripts", json!({"txt2img": [], "img2img": []})),
        ("/sdapi/v1/script-info", json!([])),
        ("/sdapi/v1/extensions", json!([])),
        ("/sdapi/v1/hypernetworks", json!([])),
    ] {
        assert_eq!(json_of(server.get(path).await).await, (200, want), "{path}");
    }

    // A GPU worker's device memory as the driver reports it; allocator statistics in A1111's error form.
    let device = DeviceDescription {
        backend: "cuda".into(),
        index: 0,
        name: "Test GPU".into(),
        memory_total_bytes: Some(80 << 30),
        memory_free_bytes: Some(60 << 30),
        driver: None,
    };
    let gpu = start(ServerConfig { device, ..config(None) }, Duration::ZERO).await;
    let (_, memory) = json_of(gpu.get("/sdapi/v1/memory").await).await;
    let cuda = &memory["cuda"];
    assert_eq!(
        cuda["system"],
        json!({"free": 60u64 << 30, "used": 20u64 << 30, "total": 80u64 << 30}),
        "{memory}"
    );
    for key in ["active", "allocated", "reserved", "inactive", "events"] {
        assert!(cuda[key]["error"].is_string(), "{key}: {memory}");
    }
    assert_eq!(cuda["device"]["name"], "Test GPU");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn basic_auth_beside_the_api_key() {
    let cfg = ServerConfig {
        api_key: Some("k3y".into()),
        api_auth: parse_api_auth("alice:pw,bob:hunter2").unwrap(),
        ..config(None)
    };
    let server = start(cfg, Duration::ZERO).await;
    let plain = reqwest::Client::new();
    let get = |auth: Option<&str>, path: &str| {
        let mut r = plain.get(server.url(path));
        if let Some(auth) = auth {
            r = r.header("authorization", auth);
        }
        r.send()
    };
    let basic = |user_pass: &str| format!("Basic {}", b64(user_pass.as_bytes()));
    assert_eq!(get(None, "/health").await.unwrap().status(), 200);
    for auth in [None, Some("Basic ".to_string()), Some(basic("alice:hunter2")), Some("Bearer nope".into())] {
        let r = get(auth.as_deref(), "/sdapi/v1/memory").await.unwrap();
        assert_eq!(r.status(), 401, "{auth:?}");
        let challenges: Vec<&str> =
            r.headers().get_all("www-authenticate").iter().filter_map(|v| v.to_str().ok()).collect();
        assert!(
            challenges.iter().any(|c| c.starts_with("Basic")) && challenges.contains(&"Bearer"),
            "{challenges:?}"
        );
        let body: Value = r.json().await.expect("a JSON body");
        assert_eq!(body["error"]["type"], "authentication_error", "{body}");
    }
    for auth in [basic("alice:pw"), basic("bob:hunter2"), "Bearer k3y".into()] {
        assert_eq!(get(Some(&auth), "/sdapi/v1/cmd-flags").await.unwrap().status(), 200, "{auth}");
    }
    let (_, info) = json_of(get(Some(&basic("bob:hunter2")), "/v1/info").await.unwrap()).await;
    assert_eq!(info["auth_required"], true);

    // Without configured credentials, Open WebUI's empty `Basic ` header is no obstacle.
    let open = start(config(None), Duration::ZERO).await;
    let r = plain.get(open.url("/sdapi/v1/memory")).header("authorization", "Basic ").send().await.unwrap();
    assert_eq!(r.status(), 200);
}

/// Waits until the A1111 progress says image `index` of the running job has started; returns the job id.
async fn wait_for_image(server: &common::TestServer, index: u64) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, p) = json_of(server.get("/sdapi/v1/progress").await).await;
        if p["state"]["job_no"].as_u64() == Some(index) && p["state"]["sampling_step"].as_u64() >= Some(1) {
            return p["state"]["job"].as_str().expect("job id").to_string();
        }
        assert!(Instant::now() < deadline, "image {index} never started: {p}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_batch_answers_with_the_images_it_finished() {
    let server = start(config(None), Duration::from_millis(60)).await;
    let url = server.url("/sdapi/v1/txt2img");
    let client = server.client.clone();
    let request = tokio::spawn(async move {
        let body = json!({"prompt": "a batch", "steps": 5, "batch_size": 3, "seed": 10});
        json_of(client.post(url).json(&body).send().await.expect("POST")).await
    });
    let id = wait_for_image(&server, 1).await;
    let (status, _) = json_of(server.post_json("/sdapi/v1/interrupt", &json!({})).await).await;
    assert_eq!(status, 200);
    let (status, got) = request.await.expect("request task");
    assert_eq!(status, 200, "{got}");
    let images = got["images"].as_array().expect("images");
    assert_eq!(images.len(), 1, "{got}");
    let first = common::decode_png_b64(images[0].as_str().unwrap());
    assert_eq!(first.data[0], 10, "the first image (seed 10)");
    let info: Value = serde_json::from_str(got["info"].as_str().unwrap()).unwrap();
    assert_eq!(info["all_seeds"], json!([10, 11, 12]), "{info}");
    assert_eq!(info["infotexts"].as_array().map(Vec::len), Some(1), "{info}");

    // The job record keeps them: cancelled, with its finished image.
    let job = server.job(&id).await;
    assert_eq!(job.state, sdhive_protocol::JobState::Cancelled);
    assert_eq!(job.images.len(), 1);
    assert_eq!(job.images[0].seed, 10);

    // Interrupted before any image finished: 200 with none.
    let url = server.url("/sdapi/v1/txt2img");
    let client = server.client.clone();
    let request = tokio::spawn(async move {
        let body = json!({"prompt": "a batch", "steps": 5, "batch_size": 2});
        json_of(client.post(url).json(&body).send().await.expect("POST")).await
    });
    wait_for_image(&server, 0).await;
    server.post_json("/sdapi/v1/interrupt", &json!({})).await;
    let (status, got) = request.await.expect("request task");
    assert_eq!((status, got["images"].as_array().map(Vec::len)), (200, Some(0)), "{got}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_webuiapi_client_uses_the_extra_routes() {
    if std::env::var_os("SDHIVE_SKIP_PYTHON_TESTS").is_some() {
        eprintln!("SDHIVE_SKIP_PYTHON_TESTS is set: skipping the webuiapi test");
        return;
    }
    // piexif: how A1111 reads the infotext of a JPEG or WebP.
    let setup = || pyclients::python_with(&["webuiapi", "piexif"], "lora-clients-venv");
    let python = tokio::task::spawn_blocking(setup)
        .await
        .expect("setup thread")
        .unwrap_or_else(|e| {
            panic!(
                "cannot set up Python with `webuiapi` and `piexif` ({e}). Install them, point \
                 SDHIVE_TEST_PYTHON at a Python that has them, or set SDHIVE_SKIP_PYTHON_TESTS=1 to skip this test."
            )
        });
    // The key is the harness's (it polls `/ready` with it); the client uses the Basic credentials.
    let cfg = ServerConfig {
        api_key: Some("harness-key".into()),
        api_auth: parse_api_auth("alice:pw").unwrap(),
        ..config(Some(styles_file("webuiapi")))
    };
    let server = start(cfg, Duration::ZERO).await;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/a1111_extras_client.py");
    let mut cmd = Command::new(&python);
    cmd.arg(&script).args(["--base-url", &server.base, "--user", "alice", "--password", "pw"]);
    let out =
        tokio::task::spawn_blocking(move || cmd.output()).await.expect("client thread").expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the webuiapi client failed:\n--- stdout\n{stdout}\n--- stderr\n{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extras_answer_in_the_samples_format() {
    let server = start(config(None), Duration::ZERO).await;
    let client = reqwest::Client::new();
    let url = |path: &str| format!("{}{path}", server.base);
    let png =
        sdhive_engine::encode_png(&RgbImage { width: 4, height: 2, data: vec![200; 24] }, None).unwrap();
    let extras = |body: Value| {
        let (client, url) = (client.clone(), url("/sdapi/v1/extra-single-image"));
        async move { json_of(client.post(url).json(&body).send().await.unwrap()).await }
    };
    let body = json!({"image": b64(&png), "upscaler_1": "None", "upscaling_resize": 1});
    let (status, got) = extras(body.clone()).await;
    assert_eq!(status, 200, "{got}");
    assert!(png_bytes(&got["image"]).starts_with(b"\x89PNG"), "PNG by default");
    for (format, magic) in [("jpg", &b"\xff\xd8\xff"[..]), ("webp", &b"RIFF"[..])] {
        let r = client.post(url("/sdapi/v1/options")).json(&json!({"samples_format": format})).send().await;
        assert_eq!(r.unwrap().status(), 200);
        let (status, got) = extras(body.clone()).await;
        assert_eq!(status, 200, "{got}");
        assert!(png_bytes(&got["image"]).starts_with(magic), "{format}");
        let batch = json!({"imageList": [{"data": b64(&png), "name": "a"}], "upscaler_1": "None"});
        let r = client.post(url("/sdapi/v1/extra-batch-images")).json(&batch).send().await.unwrap();
        let (status, got) = json_of(r).await;
        assert_eq!(status, 200, "{got}");
        assert!(png_bytes(&got["images"][0]).starts_with(magic), "batch {format}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a1111_progress_previews_are_the_approximation_unless_the_options_ask_for_taesd() {
    let server = start(config(None), Duration::ZERO).await;
    let client = reqwest::Client::new();
    let txt2img = || {
        let body = json!({"prompt": PROBE, "steps": 2, "width": 8, "height": 8});
        client.post(format!("{}/sdapi/v1/txt2img", server.base)).json(&body).send()
    };
    assert_eq!(txt2img().await.unwrap().status(), 200);
    let options = |kind: &str| {
        let body = json!({"show_progress_type": kind});
        client.post(format!("{}/sdapi/v1/options", server.base)).json(&body).send()
    };
    assert_eq!(options("TAESD").await.unwrap().status(), 200);
    assert_eq!(txt2img().await.unwrap().status(), 200);
    assert_eq!(options("Approx NN").await.unwrap().status(), 200);
    assert_eq!(txt2img().await.unwrap().status(), 200);
    assert_eq!(*PROBED.lock().unwrap(), [true, false, true]);
}
