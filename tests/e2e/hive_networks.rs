//! LoRAs and embeddings behind the hive: real `hive` and two `sd-worker-cpu` processes on loopback, given
//! `--lora-dir` / `--embeddings-dir` by the hive. The hive's `GET /sdapi/v1/loras` and `/sdapi/v1/embeddings`
//! are its workers' lists as one (one entry per name, though both workers list every file), a refresh reaches
//! every worker, and a request naming an unknown LoRA is refused by the worker with a 400 that the hive passes
//! through, naming the field and the LoRA. The same hive runs with `--api-auth` (HTTP Basic; its workers are not
//! given the credentials, even through the environment) and `--styles-file`: the rest of the A1111 API answers
//! through it (styles, flags and memory from the hive, PNG Info and the empty listings from a worker, txt2img
//! with styles).

#[path = "../../crates/sdhive-server/tests/pyclients/mod.rs"]
mod pyclients;
mod support;

use base64::Engine as _;
use sdhive_tests::{fixtures, hive};
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use support::*;

/// A safetensors file of kohya LoRA tensor names (F32 zeros); what the catalogue lists needs only the header.
fn write_lora(path: &Path, output_name: &str) {
    let header = format!(
        r#"{{"__metadata__":{{"ss_output_name":"{output_name}"}},"lora_unet_x.lora_down.weight":{{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}},"lora_unet_x.lora_up.weight":{{"dtype":"F32","shape":[2,2],"data_offsets":[16,32]}}}}"#
    );
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend([0u8; 32]);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn hive_lists_the_union_of_its_workers_networks() {
    let tmp = tempfile::tempdir().unwrap();
    let models = tmp.path().join("models");
    std::fs::create_dir_all(&models).unwrap();
    std::fs::copy(fixtures().join("models/sd1.safetensors"), models.join("sd1.safetensors")).unwrap();
    // Its diffusers folder beside it is its config (the tiny model's own tokenizer), so it can generate.
    copy_tree(&fixtures().join("models/sd1"), &models.join("sd1"));
    let loras = tmp.path().join("loras");
    write_lora(&loras.join("style.safetensors"), "style_v2");
    write_lora(&loras.join("sub/detail.safetensors"), "detail");
    let emb = tmp.path().join("emb");
    std::fs::create_dir_all(&emb).unwrap();
    for name in ["sd1_emb.safetensors", "sdxl_emb.safetensors"] {
        std::fs::copy(fixtures().join("models/embeddings").join(name), emb.join(name)).unwrap();
    }

    let styles = tmp.path().join("styles.csv");
    std::fs::write(&styles, "name,prompt,negative_prompt\nfilm,\"{prompt}, film grain\",cartoon\n").unwrap();

    let mut cmd = Command::new(hive());
    cmd.args(["serve", "--bind", "127.0.0.1:0", "--token", TOKEN, "--heartbeat-interval", "1"]);
    cmd.args(["--cpu", "always", "--backend", "cpu", "--cpu-workers", "2", "--api-auth", "alice:s3cret-pw"]);
    cmd.arg("--models-dir").arg(&models).arg("--lora-dir").arg(&loras).arg("--styles-file").arg(&styles);
    cmd.arg("--upscaler-dir").arg(fixtures().join("upscalers/models"));
    cmd.env("SDHIVE_EMBEDDINGS_DIRS", &emb)
        .env("SDHIVE_DRAIN_GRACE_SECS", "5")
        .env("SDHIVE_STOP_GRACE_SECS", "5")
        .env("SDHIVE_HASH_CACHE", tmp.path().join("hashes.json"))
        // Were the workers to inherit this, the hive could not reach them.
        .env("API_AUTH", "mallory:inherited");
    let p = Proc::spawn(cmd);
    let addr = p.wait_listening("hive listening on http://");
    // `alice:s3cret-pw`, as A1111 clients send it.
    let auth = [("Authorization", "Basic YWxpY2U6czNjcmV0LXB3")];
    let get = |addr: &str, path: &str| request(addr, "GET", path, &auth, None);
    let post = |addr: &str, path: &str, body: &Value| request(addr, "POST", path, &auth, Some(body));
    let workers =
        |addr: &str| get(addr, "/v1/workers").json()["workers"].as_array().cloned().unwrap_or_default();
    wait_for("two ready workers", Duration::from_secs(180), || {
        (workers(&addr).iter().filter(|w| w["state"] == "ready").count() == 2).then_some(())
    });

    let listed = get(&addr, "/sdapi/v1/loras").json();
    let names: Vec<&str> = listed.as_array().unwrap().iter().map(|l| l["name"].as_str().unwrap()).collect();
    assert_eq!(names, vec!["detail", "style"], "{listed}");
    assert_eq!(listed[1]["alias"], "style_v2");
    assert_eq!(listed[1]["metadata"]["ss_output_name"], "style_v2");

    let embeddings = get(&addr, "/sdapi/v1/embeddings").json();
    assert!(embeddings["loaded"].is_object() && embeddings["skipped"].is_object(), "{embeddings}");
    assert!(embeddings["loaded"].get("sd1_emb").is_some(), "the SD1 embedding fits sd1: {embeddings}");
    assert!(embeddings["skipped"].get("sdxl_emb").is_some(), "{embeddings}");

    // A file added later appears once every worker has rescanned.
    write_lora(&loras.join("late.safetensors"), "late");
    let r = post(&addr, "/sdapi/v1/refresh-loras", &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    let listed = get(&addr, "/sdapi/v1/loras").json();
    assert_eq!(listed.as_array().unwrap().len(), 3, "{listed}");

    // Unknown names: the worker's 400 reaches the client through the hive.
    let r = post(&addr, "/sdapi/v1/txt2img", &json!({"prompt": "a cat <lora:stlye:1>", "steps": 1}));
    assert_eq!(r.status, 400, "{}", r.text());
    let body = r.json();
    assert_eq!(body["field"], "prompt", "{body}");
    assert!(body["detail"].as_str().unwrap().contains("no LoRA `stlye`; closest: style"), "{body}");
    let r = post(&addr, "/v1/jobs", &json!({"prompt": "a cat", "steps": 1, "loras": [{"name": "nope"}]}));
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "loras");

    // Basic auth guards the hive; `/health` stays open; the A1111 routes answer through it.
    assert_eq!(request(&addr, "GET", "/health", &[], None).status, 200);
    for headers in
        [&[][..], &[("Authorization", "Basic ")][..], &[("Authorization", "Basic YWxpY2U6bm9wZQ==")][..]]
    {
        let r = request(&addr, "GET", "/sdapi/v1/loras", headers, None);
        assert_eq!(r.status, 401, "{headers:?}: {}", r.text());
        assert!(r.head.contains("www-authenticate: Basic"), "{}", r.head);
    }
    let listed = get(&addr, "/sdapi/v1/prompt-styles").json();
    assert_eq!(
        listed,
        json!([{"name": "film", "prompt": "{prompt}, film grain", "negative_prompt": "cartoon"}])
    );
    let flags = get(&addr, "/sdapi/v1/cmd-flags").json();
    assert_eq!(
        (flags["role"].as_str(), flags["api_auth"].as_str()),
        (Some("hive"), Some("<redacted>")),
        "{flags}"
    );
    assert_eq!(flags["styles_file"], styles.display().to_string());
    assert_eq!(flags["lora_dir"], loras.display().to_string());
    assert!(!flags.to_string().contains("s3cret"), "{flags}");
    let memory = get(&addr, "/sdapi/v1/memory").json();
    assert!(memory["ram"]["used"].as_u64() > Some(0), "{memory}");
    assert!(memory["cuda"]["error"].is_string(), "CPU workers have no device memory: {memory}");
    for (path, want) in [
        ("/sdapi/v1/face-restorers", json!([])),
        ("/sdapi/v1/scripts", json!({"txt2img": [], "img2img": []})),
        ("/sdapi/v1/hypernetworks", json!([])),
    ] {
        assert_eq!(get(&addr, path).json(), want, "{path}");
    }

    // txt2img with a style, then PNG Info of its image; an unknown style is the worker's 400.
    let r = post(
        &addr,
        "/sdapi/v1/txt2img",
        &json!({"prompt": "a cat", "styles": ["film"], "steps": 1, "seed": 3, "width": 64, "height": 64}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let made = r.json();
    let info: Value = serde_json::from_str(made["info"].as_str().unwrap()).unwrap();
    assert_eq!(
        (info["prompt"].as_str(), info["negative_prompt"].as_str()),
        (Some("a cat, film grain"), Some("cartoon"))
    );
    let parsed = post(&addr, "/sdapi/v1/png-info", &json!({"image": made["images"][0]})).json();
    assert_eq!(parsed["parameters"]["Prompt"], "a cat", "{parsed}");
    assert_eq!(parsed["parameters"]["Styles array"], json!(["film"]), "{parsed}");
    assert_eq!(parsed["parameters"]["Seed"], "3", "{parsed}");
    let r = post(&addr, "/sdapi/v1/png-info", &json!({"image": "bm90IGFuIGltYWdl"}));
    assert_eq!((r.status, r.json()["field"].as_str()), (400, Some("image")), "{}", r.text());
    let r = post(&addr, "/sdapi/v1/txt2img", &json!({"prompt": "a cat", "styles": ["flim"], "steps": 1}));
    assert_eq!((r.status, r.json()["field"].as_str()), (400, Some("styles")), "{}", r.text());

    // Upscalers: the workers' models listed through the hive, hires fix and the extras run on a worker.
    let listed = get(&addr, "/sdapi/v1/upscalers").json();
    let names: Vec<&str> = listed.as_array().unwrap().iter().filter_map(|u| u["name"].as_str()).collect();
    assert!(names.contains(&"Lanczos") && names.contains(&"esrgan_x4_new"), "{listed}");
    assert_eq!(get(&addr, "/sdapi/v1/latent-upscale-modes").json().as_array().map(Vec::len), Some(6));
    let r = post(
        &addr,
        "/sdapi/v1/txt2img",
        &json!({"prompt": "a cat", "steps": 2, "width": 64, "height": 64, "enable_hr": true,
                "hr_upscaler": "esrgan_x4_new", "hr_scale": 2, "denoising_strength": 0.5}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let png =
        base64::engine::general_purpose::STANDARD.decode(r.json()["images"][0].as_str().unwrap()).unwrap();
    // The PNG header's size (IHDR: width, height big-endian at bytes 16..24).
    let side = |at: usize| u32::from_be_bytes(png[at..at + 4].try_into().unwrap());
    assert_eq!((side(16), side(20)), (128, 128));
    let input = base64::engine::general_purpose::STANDARD
        .encode(std::fs::read(fixtures().join("upscalers/input.png")).unwrap());
    let r = post(
        &addr,
        "/sdapi/v1/extra-single-image",
        &json!({"image": input, "upscaler_1": "esrgan_x4_new", "upscaling_resize": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let r = post(&addr, "/sdapi/v1/extra-single-image", &json!({"image": input, "upscaler_1": "nope"}));
    assert_eq!((r.status, r.json()["field"].as_str()), (400, Some("upscaler_1")), "{}", r.text());

    // Every route webuiapi has, through the hive, with A1111's Basic auth as the client sends it.
    if std::env::var_os("SDHIVE_SKIP_PYTHON_TESTS").is_none() {
        let python =
            pyclients::python_with(&["webuiapi", "openai"], "lora-clients-venv").unwrap_or_else(|e| {
                panic!("cannot set up Python with `webuiapi` ({e}); SDHIVE_SKIP_PYTHON_TESTS=1 skips")
            });
        let sweep = fixtures().join("../../crates/sdhive-server/tests/clients/webuiapi_sweep.py");
        let out = Command::new(python)
            .arg(sweep)
            .args(["--base-url", &format!("http://{addr}"), "--user", "alice", "--password", "s3cret-pw"])
            .output()
            .expect("run python");
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "webuiapi through the hive failed:\n{stdout}\n{stderr}");
    }
}
