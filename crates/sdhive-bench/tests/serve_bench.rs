//! The serving benchmark end to end on the CPU worker and the tiny SD1.5 fixture: `sdhive-bench --serve-bench`
//! starts `sd-worker-cpu`, loads it through HTTP and prints one report with every part filled. Ignored (it needs a
//! built worker and takes seconds); run with
//! `cargo build -p sd-worker-cpu && cargo test -p sdhive-bench --test serve_bench -- --ignored`
//! (`SD_WORKER_CPU_BIN` names another worker binary).

use std::path::PathBuf;
use std::process::Command;

fn worker() -> PathBuf {
    if let Some(bin) = std::env::var_os("SD_WORKER_CPU_BIN") {
        return bin.into();
    }
    // The test binary lives in target/<profile>/deps; the worker beside its parent.
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent().and_then(|deps| deps.parent()).expect("target dir").join("sd-worker-cpu")
}

#[test]
#[ignore = "needs a built sd-worker-cpu; seconds"]
fn serve_bench_reports_every_part() {
    let worker = worker();
    assert!(
        worker.is_file(),
        "no worker at {} (build sd-worker-cpu or set SD_WORKER_CPU_BIN)",
        worker.display()
    );
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/models/sd1");
    let out = Command::new(env!("CARGO_BIN_EXE_sdhive-bench"))
        .args(["--serve-bench"])
        .arg(&worker)
        .args(["--serve-model", fixture, "--size", "64", "--steps", "4", "--warmup", "1"])
        .args(["--latency-requests", "3", "--clients", "1,3", "--requests-per-level", "3"])
        .args(["--preview-images", "2", "--preview-every", "2"])
        .args(["--", "--max-queue", "8"])
        .output()
        .expect("running sdhive-bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "sdhive-bench failed:\n{stderr}");
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("report is not JSON ({e}):\n{stderr}"));
    assert_eq!(report["worker_args"], serde_json::json!(["--max-queue", "8"]));
    assert_eq!(report["latency"]["n"], 3);
    assert!(report["latency"]["median_ms"].as_f64().is_some_and(|ms| ms > 0.0));
    let levels = report["levels"].as_array().expect("levels");
    assert_eq!(levels.len(), 2);
    for (level, clients) in levels.iter().zip([1, 3]) {
        assert_eq!(level["clients"], clients);
        // At least two rounds per client, whatever --requests-per-level says.
        assert_eq!(level["requests"], clients * 3usize.div_ceil(clients).max(2));
        assert!(level["images_per_s"].as_f64().is_some_and(|v| v > 0.0));
        // The first pass, before the steady state reported: as many requests, timed apart.
        let first = &level["first_pass"];
        assert!(first["images_per_s"].as_f64().is_some_and(|v| v > 0.0));
        assert_eq!(first["latency"]["n"], level["requests"]);
        assert!(level["peak"]["rss_mib"].as_u64().is_some_and(|v| v > 0), "no RSS sampled");
    }
    let previews = &report["previews"];
    assert_eq!(previews["images_per_setting"], 2);
    assert_eq!(previews["with"][0]["preview_every"], 2);
    assert_eq!(previews["with"][0]["previews_per_image"], 2);
    assert!(previews["step_ms"].as_f64().is_some());
}

#[test]
fn a_worker_that_cannot_start_is_named() {
    let out = Command::new(env!("CARGO_BIN_EXE_sdhive-bench"))
        .args(["--serve-bench", "/nonexistent/sd-worker", "--serve-model", "x"])
        .output()
        .expect("running sdhive-bench");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/nonexistent/sd-worker"), "{stderr}");
}
