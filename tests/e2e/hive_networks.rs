//! LoRAs and embeddings behind the hive: real `hive` and two `sd-worker-cpu` processes on loopback, given
//! `--lora-dir` / `--embeddings-dir` by the hive. The hive's `GET /sdapi/v1/loras` and `/sdapi/v1/embeddings`
//! are its workers' lists as one (one entry per name, though both workers list every file), a refresh reaches
//! every worker, and a request naming an unknown LoRA is refused by the worker with a 400 that the hive passes
//! through, naming the field and the LoRA.

mod support;

use sdhive_tests::{fixtures, hive};
use serde_json::json;
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
    let loras = tmp.path().join("loras");
    write_lora(&loras.join("style.safetensors"), "style_v2");
    write_lora(&loras.join("sub/detail.safetensors"), "detail");
    let emb = tmp.path().join("emb");
    std::fs::create_dir_all(&emb).unwrap();
    for name in ["sd1_emb.safetensors", "sdxl_emb.safetensors"] {
        std::fs::copy(fixtures().join("models/embeddings").join(name), emb.join(name)).unwrap();
    }

    let mut cmd = Command::new(hive());
    cmd.args(["serve", "--bind", "127.0.0.1:0", "--token", TOKEN, "--heartbeat-interval", "1"]);
    cmd.args(["--cpu", "always", "--backend", "cpu", "--cpu-workers", "2"]);
    cmd.arg("--models-dir").arg(&models).arg("--lora-dir").arg(&loras);
    cmd.env("SDHIVE_EMBEDDINGS_DIRS", &emb)
        .env("SDHIVE_DRAIN_GRACE_SECS", "5")
        .env("SDHIVE_STOP_GRACE_SECS", "5")
        .env("SDHIVE_HASH_CACHE", tmp.path().join("hashes.json"));
    let p = Proc::spawn(cmd);
    let addr = p.wait_listening("hive listening on http://");
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
}
