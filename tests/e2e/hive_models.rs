//! The hive routing by model: real `hive` and two `sd-worker-cpu` processes on loopback over a models dir of
//! tiny fixture checkpoints (SD 1.x, SDXL and SD 2.x v-prediction diffusers folders, and the SD 1.x weights as
//! a single file). Native, OpenAI and A1111 requests for the three folders (three different images),
//! interleaved, each give the image `sd-worker-cpu generate` makes with that model and seed, with a bounded
//! number of model switches; the model lists say
//! where each model is loaded; unknown names are refused with the closest titles; `options` switches the
//! default; a job whose worker is killed mid-run is run again with the same (hive-drawn) seed; and under load
//! from 12 clients, a worker killed with `kill -9` costs no request. A model wanted while the only worker is
//! busy gets a worker of its own on the CPU "device" given room (`--device-memory`), stopped again once idle;
//! an external worker's library is routed to. Every wait has a deadline.
//!
//! The tests run one at a time (each keeps CPU workers busy on a small CI machine).

mod support;

use sdhive_tests::{fixtures, hive, run_worker};
use serde_json::json;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::*;

static SERIAL: Mutex<()> = Mutex::new(());

/// The models requests alternate between, by file name in the models dir: three different images.
const MODELS: [&str; 3] = ["sd1", "sdxl", "sd2v"];
/// Also in the library: the SD 1.x weights as a single file (the same image as `sd1`).
const SINGLE_FILE: &str = "sd1.safetensors";

/// A models dir holding copies of the fixture models (the catalogue refuses symlinks that lead outside it),
/// and a hash cache of its own.
struct Library {
    dir: tempfile::TempDir,
}

impl Library {
    fn new() -> Library {
        Library::of(&[MODELS[0], MODELS[1], MODELS[2], SINGLE_FILE])
    }

    fn of(models: &[&str]) -> Library {
        let dir = tempfile::tempdir().unwrap();
        for m in models {
            copy_tree(&fixtures().join("models").join(m), &dir.path().join("models").join(m));
        }
        Library { dir }
    }

    fn models_dir(&self) -> PathBuf {
        std::fs::canonicalize(self.dir.path().join("models")).unwrap()
    }

    fn path(&self, model: &str) -> String {
        self.models_dir().join(model).display().to_string()
    }
}

/// `hive serve` with two CPU workers over the library, preloading `preload` (paths), and `extra` flags.
fn start(lib: &Library, preload: &[&str], extra: &[&str]) -> (Proc, String) {
    let mut cmd = Command::new(hive());
    cmd.args(["serve", "--bind", "127.0.0.1:0", "--token", TOKEN, "--heartbeat-interval", "1"]);
    cmd.args(["--cpu", "always", "--backend", "cpu", "--cpu-workers", "2"]);
    cmd.arg("--models-dir").arg(lib.models_dir());
    for m in preload {
        cmd.args(["--model", &lib.path(m)]);
    }
    cmd.args(extra);
    cmd.env("SDHIVE_RESTART_INITIAL_SECS", "0.5")
        .env("SDHIVE_DRAIN_GRACE_SECS", "5")
        .env("SDHIVE_STOP_GRACE_SECS", "5")
        .env("SDHIVE_HASH_CACHE", lib.dir.path().join("hashes.json"));
    let p = Proc::spawn(cmd);
    let addr = p.wait_listening("hive listening on http://");
    wait_for("two ready workers", Duration::from_secs(120), || {
        (workers(&addr).iter().filter(|w| w["state"] == "ready").count() == 2).then_some(())
    });
    (p, addr)
}

const STEPS: u32 = 2;
const SIZE: u32 = 64;

/// The image `sd-worker-cpu generate` makes from `model` (a path) and `seed`: what a single worker loaded with
/// that model gives.
fn reference(lib: &Library, model: &str, seed: u64, steps: u32, size: u32) -> Vec<u8> {
    let out = lib.dir.path().join(format!("ref-{}-{seed}-{steps}-{size}.png", model.replace('/', "_")));
    let (steps, size, seed) = (steps.to_string(), size.to_string(), seed.to_string());
    let path = lib.path(model);
    let args = [
        "generate",
        "--model",
        &path,
        "--prompt",
        "a cat",
        "--steps",
        &steps,
        "--width",
        &size,
        "--height",
        &size,
        "--seed",
        &seed,
        "--sampler",
        "Euler",
        "--cfg-scale",
        "7",
    ];
    let mut args: Vec<&str> = args.to_vec();
    let out_arg = out.display().to_string();
    args.extend(["-o", &out_arg]);
    let run = run_worker(&args);
    assert!(run.status.success(), "generate {model}: {}", String::from_utf8_lossy(&run.stderr));
    png_pixels(&std::fs::read(&out).unwrap()).2
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Api {
    Native,
    OpenAi,
    A1111,
}

/// One generation of "a cat" through `api`, naming the model as `name`; the image's pixels, or the failure.
fn generate(addr: &str, api: Api, name: &str, seed: Option<u64>) -> Result<Vec<u8>, String> {
    let seed = seed.map(|s| json!(s)).unwrap_or(json!(-1));
    let (path, body) = match api {
        Api::Native => (
            "/v1/jobs",
            json!({"prompt": "a cat", "steps": STEPS, "width": SIZE, "height": SIZE,
            "seed": seed, "sampler": "Euler", "cfg_scale": 7, "model": name}),
        ),
        Api::OpenAi => (
            "/v1/images/generations",
            json!({"prompt": "a cat", "size": format!("{SIZE}x{SIZE}"),
            "steps": STEPS, "seed": seed, "sampler": "Euler", "cfg_scale": 7, "model": name}),
        ),
        Api::A1111 => (
            "/sdapi/v1/txt2img",
            json!({"prompt": "a cat", "steps": STEPS, "width": SIZE,
            "height": SIZE, "seed": seed, "sampler_name": "Euler", "cfg_scale": 7,
            "override_settings": {"sd_model_checkpoint": name}}),
        ),
    };
    let r = try_request(addr, "POST", path, &[], Some(&body), Duration::from_secs(300))
        .map_err(|e| format!("{api:?} {name}: {e}"))?;
    let fail = |r: &Reply| format!("{api:?} {name}: {} {}", r.status, r.text());
    // The worker's split of its time reaches the client through the hive.
    let synchronous = matches!(api, Api::OpenAi | Api::A1111);
    if synchronous && r.status == 200 && !r.head.to_ascii_lowercase().contains("server-timing: prepare;dur=")
    {
        return Err(format!("{api:?} {name}: no Server-Timing in {}", r.head));
    }
    let b64 = match api {
        Api::Native => {
            if r.status != 202 {
                return Err(fail(&r));
            }
            let id = r.json()["id"].as_str().unwrap_or_default().to_string();
            let job = wait_job(addr, &id, Duration::from_secs(300));
            if job["state"] != "succeeded" {
                return Err(format!("{api:?} {name}: job {id} {job}"));
            }
            job["images"][0]["png_base64"].as_str().map(String::from)
        }
        Api::OpenAi if r.status == 200 => r.json()["data"][0]["b64_json"].as_str().map(String::from),
        Api::A1111 if r.status == 200 => r.json()["images"][0].as_str().map(String::from),
        _ => return Err(fail(&r)),
    };
    let b64 = b64.ok_or_else(|| fail(&r))?;
    Ok(pixels(&b64).2)
}

fn metric(addr: &str, name: &str) -> u64 {
    let text = get(addr, "/metrics").text();
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

/// Model id → the ids of the workers holding it, from `GET /v1/models`.
fn loaded_on(addr: &str) -> HashMap<String, Vec<String>> {
    let list = get(addr, "/v1/models").json();
    list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let on =
                m["loaded_on"].as_array().unwrap().iter().map(|w| w.as_str().unwrap().to_string()).collect();
            (m["id"].as_str().unwrap().to_string(), on)
        })
        .collect()
}

#[test]
fn requests_are_routed_by_model_and_make_the_images_of_that_model() {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let lib = Library::new();
    let (hive_proc, addr) = start(&lib, &MODELS, &[]);

    // Two workers, two preloaded models; the third configured model is said to load on demand.
    let listed = get(&addr, "/v1/workers").json();
    let mut preloads: Vec<String> = listed["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["preloads"].as_str().unwrap().to_string())
        .collect();
    preloads.sort();
    assert_eq!(preloads, [lib.path("sd1"), lib.path("sdxl")], "{listed}");
    assert_eq!(listed["on_demand_models"], json!([lib.path("sd2v")]), "{listed}");
    assert!(hive_proc.log().contains("no worker preloads it"), "{}", hive_proc.log());

    // Both lists show all four, and where each is loaded.
    let on = loaded_on(&addr);
    assert_eq!(on.len(), 4, "{on:?}");
    let counts = (on["sd1"].len(), on["sdxl"].len(), on["sd2v"].len(), on[SINGLE_FILE].len());
    assert_eq!(counts, (1, 1, 0, 0), "{on:?}");
    let sd_models = get(&addr, "/sdapi/v1/sd-models").json();
    let titles: Vec<&str> =
        sd_models.as_array().unwrap().iter().map(|m| m["title"].as_str().unwrap()).collect();
    assert_eq!(titles.len(), 4, "{sd_models}");
    assert!(sd_models
        .as_array()
        .unwrap()
        .iter()
        .all(|m| m["loaded_on"].is_array() && m["filename"].is_string()));
    assert!(get(&addr, "/sdapi/v1/sd-vae").json().is_array());

    // Interleaved native, OpenAI and A1111 requests for all three models, nine at once, each naming its model
    // differently; every image must be the one a single worker loaded with that model makes.
    let seed = 42;
    let refs: Vec<Vec<u8>> = MODELS.iter().map(|m| reference(&lib, m, seed, STEPS, SIZE)).collect();
    assert!(refs[0] != refs[1] && refs[0] != refs[2] && refs[1] != refs[2], "three different images");
    // By name, by path, and by title with a stale hash (A1111 strips it).
    let names: [[String; 3]; 3] = [
        ["sd1".into(), "sdxl".into(), "sd2v".into()],
        [lib.path("sd1"), "sdxl".into(), "SD2V".into()],
        ["sd1 [ffffffffff]".into(), lib.path("sdxl"), "sd2v".into()],
    ];
    let switches_before = metric(&addr, "sdhive_hive_model_switches_total");
    let calls: Vec<_> = (0..9)
        .map(|i| {
            let (model, api) = (i % 3, [Api::Native, Api::OpenAi, Api::A1111][i / 3]);
            let (addr, name) = (addr.clone(), names[i / 3][model].clone());
            (model, api, std::thread::spawn(move || generate(&addr, api, &name, Some(seed))))
        })
        .collect();
    for (model, api, call) in calls {
        let image = call.join().unwrap().unwrap_or_else(|e| panic!("{e}\nhive log:\n{}", hive_proc.log()));
        assert!(image == refs[model], "{api:?} {}: not the image of that model", MODELS[model]);
    }
    let switches = metric(&addr, "sdhive_hive_model_switches_total") - switches_before;
    eprintln!("model switches for 9 interleaved requests over 3 models and 2 workers: {switches}");
    assert!(switches <= 4, "{switches} switches: the hive thrashes");
    let on = loaded_on(&addr);
    assert_eq!(on.values().map(Vec::len).sum::<usize>(), 2, "each worker holds one model: {on:?}");
    assert!(hive_proc.log().contains("switching the worker's model"), "sd2v was loaded on demand");

    // Unknown names are refused before they queue, naming the closest titles.
    let r = post(&addr, "/v1/jobs", &json!({"prompt": "a cat", "model": "sd1x"}));
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (404, Some("model_not_found")),
        "{}",
        r.text()
    );
    assert!(r.text().contains("closest: sd1"), "{}", r.text());
    let r = post(&addr, "/v1/jobs?model=sd-xl", &json!({"prompt": "a cat"}));
    assert_eq!(r.status, 404, "{}", r.text());
    assert!(r.text().contains("sdxl"), "{}", r.text());
    let r = post(&addr, "/v1/images/generations", &json!({"prompt": "a cat", "model": "nope"}));
    assert_eq!((r.status, r.json()["error"]["param"].as_str()), (404, Some("model")), "{}", r.text());
    let r = post(
        &addr,
        "/sdapi/v1/txt2img",
        &json!({"prompt": "a cat", "override_settings": {"sd_model_checkpoint": "sdx1"}}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["field"], "override_settings.sd_model_checkpoint", "{}", r.text());
    assert!(
        r.json()["detail"].as_str().unwrap().contains("closest: sd1, sd1.safetensors, sdxl"),
        "{}",
        r.text()
    );
    let r = post(&addr, "/sdapi/v1/options", &json!({"sd_model_checkpoint": "nope"}));
    assert_eq!((r.status, r.json()["code"].as_str()), (400, Some("model_not_found")), "{}", r.text());

    // `options` makes the single file the default: requests naming no model (or an OpenAI name) get it.
    let r = post(&addr, "/sdapi/v1/options", &json!({"sd_model_checkpoint": SINGLE_FILE}));
    assert_eq!(r.status, 200, "{}", r.text());
    let options = get(&addr, "/sdapi/v1/options").json();
    assert!(options["sd_model_checkpoint"].as_str().unwrap().starts_with(SINGLE_FILE), "{options}");
    assert!(!loaded_on(&addr)[SINGLE_FILE].is_empty(), "answered once loaded");
    let progress = get(&addr, "/sdapi/v1/progress").json();
    assert_eq!(progress["state"]["job_count"], 0, "idle after the switch: {progress}");
    let image = generate(&addr, Api::OpenAi, "dall-e-3", Some(seed)).unwrap();
    assert!(image == refs[0], "the selected model (SD 1.x weights) serves requests that name none");
    let on = loaded_on(&addr);
    assert!(on["sd1"].is_empty() || !on[SINGLE_FILE].is_empty(), "{on:?}");

    // While a job runs, progress says so.
    let slow = json!({"prompt": "a cat", "steps": 30, "width": 128, "height": 128, "sampler": "Euler", "model": "sd1"});
    let id = submit(&addr, &slow);
    wait_for("progress to show the job", Duration::from_secs(60), || {
        (get(&addr, "/sdapi/v1/progress").json()["state"]["job_count"].as_u64() > Some(0)).then_some(())
    });
    wait_job(&addr, &id, Duration::from_secs(120));

    // A job without a seed whose worker is killed mid-run runs again with the seed the hive drew: the image is
    // the one that seed makes.
    let slower = json!({"prompt": "a cat", "steps": 60, "width": 128, "height": 128, "sampler": "Euler", "model": "sd1"});
    let id = submit(&addr, &slower);
    wait_for("the job to run", Duration::from_secs(60), || {
        let job = get(&addr, &format!("/v1/jobs/{id}")).json();
        (job["state"] == "running" && job["step"].as_u64() >= Some(1)).then_some(())
    });
    // The only request in flight is this job: its worker is the one with a slot taken.
    let worker = workers(&addr).into_iter().find(|w| w["inflight"].as_u64() > Some(0)).unwrap();
    let pid = worker["pid"].as_u64().unwrap();
    assert!(Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap().success());
    let job = wait_job(&addr, &id, Duration::from_secs(180));
    assert_eq!(job["state"], "succeeded", "{job}\nhive log:\n{}", hive_proc.log());
    let drawn = job["images"][0]["seed"].as_u64().unwrap();
    let image = pixels(job["images"][0]["png_base64"].as_str().unwrap()).2;
    assert!(image == reference(&lib, "sd1", drawn, 60, 128), "the re-run made another image");
    assert_eq!(metric(&addr, "sdhive_hive_jobs_rerun_total"), 1);

    // A model added to the folder is listed once refreshed.
    std::fs::copy(fixtures().join("models/sd1.safetensors"), lib.models_dir().join("new.safetensors"))
        .unwrap();
    assert_eq!(post(&addr, "/sdapi/v1/refresh-checkpoints", &json!({})).status, 200);
    assert_eq!(loaded_on(&addr).len(), 5);
}

#[test]
fn no_request_is_lost_when_a_worker_is_killed_under_load() {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    // The measurement: 300 requests (about 10 s here); SDHIVE_TEST_LOAD_REQUESTS changes it.
    let total: usize =
        std::env::var("SDHIVE_TEST_LOAD_REQUESTS").ok().and_then(|v| v.parse().ok()).unwrap_or(300);
    let clients = 12;
    let lib = Library::new();
    let (hive_proc, addr) = start(&lib, &["sd1", "sdxl"], &[]);
    let seed = 7;
    let refs: Arc<Vec<Vec<u8>>> =
        Arc::new(MODELS.iter().map(|m| reference(&lib, m, seed, STEPS, SIZE)).collect());

    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    let started = Instant::now();
    let threads: Vec<_> = (0..clients)
        .map(|_| {
            let (addr, next, done, failures, refs) =
                (addr.clone(), next.clone(), done.clone(), failures.clone(), refs.clone());
            std::thread::spawn(move || loop {
                let k = next.fetch_add(1, Ordering::SeqCst);
                if k >= total {
                    return;
                }
                let (model, api) = (k % 3, [Api::Native, Api::OpenAi, Api::A1111][(k / 3) % 3]);
                match generate(&addr, api, MODELS[model], Some(seed)) {
                    Ok(image) if image == refs[model] => {}
                    Ok(_) => failures.lock().unwrap().push(format!("{api:?} {}: wrong image", MODELS[model])),
                    Err(e) => failures.lock().unwrap().push(e),
                }
                done.fetch_add(1, Ordering::SeqCst);
            })
        })
        .collect();

    // Midway, kill -9 a worker that is running something.
    wait_for("half of the requests", Duration::from_secs(300), || {
        (done.load(Ordering::SeqCst) >= total / 2).then_some(())
    });
    let victim = wait_for("a busy worker", Duration::from_secs(60), || {
        workers(&addr).into_iter().find(|w| w["running_job"].is_object() && w["pid"].is_u64())
    });
    let pid = victim["pid"].as_u64().unwrap();
    assert!(Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap().success());
    for t in threads {
        t.join().unwrap();
    }
    let elapsed = started.elapsed();

    let failures = failures.lock().unwrap();
    let lost = failures.iter().filter(|f| f.contains("worker_lost")).count();
    let (reruns, requeued, sync_reruns, switches) = (
        metric(&addr, "sdhive_hive_jobs_rerun_total"),
        metric(&addr, "sdhive_hive_jobs_redispatched_total"),
        metric(&addr, "sdhive_hive_sync_rerun_total"),
        metric(&addr, "sdhive_hive_model_switches_total"),
    );
    eprintln!(
        "{total} requests from {clients} clients, worker {} killed midway: {} failed ({lost} worker_lost); \
         native re-runs {reruns} (re-queued {requeued}), synchronous re-runs {sync_reruns}, model switches \
         {switches}; {:.1} s",
        victim["id"],
        failures.len(),
        elapsed.as_secs_f64()
    );
    assert!(failures.is_empty(), "{failures:#?}\nhive log:\n{}", hive_proc.log());
    assert!(reruns + requeued + sync_reruns >= 1, "the killed worker had requests to give back");
}

fn worker_with_model<'a>(workers: &'a [serde_json::Value], path: &str) -> Option<&'a serde_json::Value> {
    workers.iter().find(|w| w["loaded_source"] == path)
}

#[test]
fn a_model_wanted_while_the_only_worker_is_busy_gets_a_worker_of_its_own() {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let lib = Library::of(&["sd1", "sdxl"]);
    // One CPU worker with SD 1.x; room for one more, and 8 GiB of the CPU's memory the hive may fill.
    let mut cmd = Command::new(hive());
    cmd.args(["serve", "--bind", "127.0.0.1:0", "--token", TOKEN, "--heartbeat-interval", "1"]);
    cmd.args(["--cpu", "always", "--backend", "cpu", "--cpu-workers", "1", "--max-cpu-workers", "2"]);
    cmd.args(["--device-memory", "cpu:0=8G", "--model", &lib.path("sd1")]);
    cmd.arg("--models-dir").arg(lib.models_dir());
    cmd.env("SDHIVE_IDLE_WORKER_SECS", "3")
        .env("SDHIVE_DRAIN_GRACE_SECS", "5")
        .env("SDHIVE_STOP_GRACE_SECS", "5")
        .env("SDHIVE_HASH_CACHE", lib.dir.path().join("hashes.json"));
    let hive_proc = Proc::spawn(cmd);
    let addr = hive_proc.wait_listening("hive listening on http://");
    wait_for("the worker", Duration::from_secs(60), || {
        (workers(&addr).iter().filter(|w| w["state"] == "ready").count() == 1).then_some(())
    });
    let table = get(&addr, "/v1/devices").json();
    assert_eq!(table["devices"][0]["max_workers"], 2, "{table}");

    // A slow SD 1.x job keeps the worker busy; an SDXL request meanwhile cannot switch it (busy), so the hive
    // starts a second worker for SDXL instead of waiting or thrashing.
    let (slow_steps, slow_size, seed) = (40, 128, 42);
    let slow = json!({"prompt": "a cat", "steps": slow_steps, "width": slow_size, "height": slow_size,
        "seed": seed, "sampler": "Euler", "cfg_scale": 7, "model": "sd1"});
    let (sdxl_ref, sd1_ref) =
        (reference(&lib, "sdxl", seed, STEPS, SIZE), reference(&lib, "sd1", seed, slow_steps, slow_size));
    let slow_id = submit(&addr, &slow);
    let image = generate(&addr, Api::OpenAi, "sdxl", Some(seed))
        .unwrap_or_else(|e| panic!("{e}\n{}", hive_proc.log()));
    assert!(image == sdxl_ref, "not the SDXL image");
    let job = wait_job(&addr, &slow_id, Duration::from_secs(120));
    assert_eq!(job["state"], "succeeded", "{job}");
    assert!(pixels(job["images"][0]["png_base64"].as_str().unwrap()).2 == sd1_ref, "not the SD 1.x image");

    // Each model had a worker of its own: nothing was switched.
    let now = workers(&addr);
    let extra = worker_with_model(&now, &lib.path("sdxl")).unwrap_or_else(|| panic!("{now:?}"));
    assert_eq!(extra["on_demand"]["model"], lib.path("sdxl").as_str(), "{extra}");
    assert!(extra["on_demand"]["reason"].as_str().unwrap().contains("cpu:0 has"), "{extra}");
    assert!(worker_with_model(&now, &lib.path("sd1")).is_some_and(|w| w["on_demand"].is_null()));
    assert_eq!(metric(&addr, "sdhive_hive_model_switches_total"), 0, "{}", hive_proc.log());
    assert_eq!(metric(&addr, "sdhive_hive_on_demand_workers_started_total"), 1);
    assert!(hive_proc.log().contains("on demand: started worker"), "{}", hive_proc.log());
    let table = get(&addr, "/v1/devices").json();
    assert_eq!(table["devices"][0]["workers"].as_array().map(Vec::len), Some(2), "{table}");

    // Idle for idle_worker_secs, it is stopped: its memory returns.
    let pid = extra["pid"].as_u64().unwrap();
    let id = extra["id"].as_str().unwrap().to_string();
    let stopped = wait_for("the idle worker to stop", Duration::from_secs(20), || {
        workers(&addr).into_iter().find(|w| w["id"] == id.as_str() && w["state"] == "stopped")
    });
    assert!(stopped["on_demand"]["stopped"].as_str().unwrap().contains("idle for"), "{stopped}");
    wait_for("its process to exit", Duration::from_secs(10), || is_dead(pid).then_some(()));
    assert_eq!(metric(&addr, "sdhive_hive_on_demand_workers_stopped_total"), 1);
    // The planned worker stays (on a loaded machine a late heartbeat can show it unhealthy for a moment).
    wait_for("the planned worker to be ready", Duration::from_secs(15), || {
        (workers(&addr).iter().filter(|w| w["state"] == "ready").count() == 1).then_some(())
    });
}

#[test]
fn an_external_worker_is_routed_every_model_of_its_library() {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let lib = Library::of(&["sd1", "sdxl"]);
    // A hive with no model and no models dir: only the external worker serves.
    let mut cmd = Command::new(hive());
    cmd.args(["serve", "--bind", "127.0.0.1:0", "--token", TOKEN, "--heartbeat-interval", "1"]);
    let hive_proc = Proc::spawn(cmd);
    let addr = hive_proc.wait_listening("hive listening on http://");
    let callback = format!("http://{addr}/v1/workers/register");
    let mut cmd = Command::new(sdhive_tests::worker_cpu());
    cmd.args([
        "serve",
        "--model",
        "sd1",
        "--port",
        "0",
        "--worker-id",
        "ext-lib",
        "--callback-url",
        &callback,
    ]);
    cmd.arg("--models-dir").arg(lib.models_dir());
    cmd.env("WORKER_TOKEN", TOKEN).env("SDHIVE_HASH_CACHE", lib.dir.path().join("hashes.json"));
    let worker = Proc::spawn(cmd);
    let w = wait_worker(&addr, "ready", Duration::from_secs(60));
    assert_eq!(
        (w["id"].as_str(), w["managed"].as_bool()),
        (Some("ext-lib"), Some(false)),
        "{}",
        worker.log()
    );

    // Both models are listed, with where they are loaded and where they can run.
    let models = get(&addr, "/v1/models").json();
    let entry = |models: &serde_json::Value, id: &str| {
        models["data"].as_array().unwrap().iter().find(|m| m["id"] == id).cloned()
    };
    let sdxl = entry(&models, "sdxl").unwrap_or_else(|| panic!("{models}"));
    assert_eq!(
        (sdxl["available_on"].clone(), sdxl["loaded_on"].clone()),
        (json!(["ext-lib"]), json!([])),
        "{sdxl}"
    );
    assert_eq!(entry(&models, "sd1").unwrap()["loaded_on"], json!(["ext-lib"]), "{models}");

    // A request for its model that is not loaded goes to it, which switches: that model's image.
    let seed = 42;
    let image = generate(&addr, Api::OpenAi, "sdxl", Some(seed))
        .unwrap_or_else(|e| panic!("{e}\n{}", hive_proc.log()));
    assert!(image == reference(&lib, "sdxl", seed, STEPS, SIZE), "not the SDXL image");
    assert_eq!(loaded_on(&addr)["sdxl"], ["ext-lib"]);
    assert_eq!(metric(&addr, "sdhive_hive_model_switches_total"), 1);

    // A model added to its folder is routed to it too, once refreshed (through the hive).
    copy_tree(&fixtures().join("models/sd2v"), &lib.models_dir().join("sd2v"));
    assert_eq!(post(&addr, "/sdapi/v1/refresh-checkpoints", &json!({})).status, 200);
    wait_for("the hive to list sd2v", Duration::from_secs(10), || {
        entry(&get(&addr, "/v1/models").json(), "sd2v")
    });
    let image = generate(&addr, Api::A1111, "sd2v", Some(seed))
        .unwrap_or_else(|e| panic!("{e}\n{}", hive_proc.log()));
    assert!(image == reference(&lib, "sd2v", seed, STEPS, SIZE), "not the SD 2.x image");
}
