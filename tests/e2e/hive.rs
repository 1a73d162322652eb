//! The hive as an operator runs it: real `hive` and `sd-worker-cpu` processes on loopback with the tiny SD 1.x
//! fixture. Spawned workers register and serve images identical to a direct worker call; a worker killed
//! mid-job is restarted, its queued jobs still complete and its running job is run again (native or
//! synchronous); an external
//! worker finds a restarted hive again; killing the hive with SIGKILL leaves no worker behind; registration
//! needs the token and a live worker id cannot be taken over. Every wait has a deadline.

mod support;

use sdhive_tests::{fixtures, hive, worker_cpu};
use serde_json::{json, Value};
use std::net::TcpListener;
use std::process::Command;
use std::time::Duration;
use support::*;

fn sd1() -> String {
    fixtures().join("models/sd1").display().to_string()
}

/// `hive serve` on a free loopback port with the fixture model (or none), 1 s heartbeats, and `extra` flags.
fn start_hive(bind: &str, with_model: bool, extra: &[&str]) -> (Proc, String) {
    start_hive_with(bind, with_model, extra, &[])
}

/// [`start_hive`] with environment overrides on top of the tests' short grace periods.
fn start_hive_with(bind: &str, with_model: bool, extra: &[&str], env: &[(&str, &str)]) -> (Proc, String) {
    let mut cmd = Command::new(hive());
    cmd.args(["serve", "--bind", bind, "--token", TOKEN, "--heartbeat-interval", "1", "--cpu", "always"]);
    if with_model {
        cmd.args(["--model", &sd1(), "--model-root", &fixtures().join("models").display().to_string()]);
    }
    cmd.args(extra);
    cmd.env("SDHIVE_RESTART_INITIAL_SECS", "0.5")
        .env("SDHIVE_DRAIN_GRACE_SECS", "5")
        .env("SDHIVE_STOP_GRACE_SECS", "5")
        .envs(env.iter().copied());
    let p = Proc::spawn(cmd);
    let addr = p.wait_listening("hive listening on http://");
    (p, addr)
}

fn quick_job() -> Value {
    json!({"prompt": "a cat", "steps": 4, "width": 64, "height": 64, "seed": 42, "sampler": "Euler"})
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

// ---- tests ----

#[test]
fn hive_spawns_a_worker_and_serves_identical_images() {
    let (hive_proc, addr) = start_hive("127.0.0.1:0", true, &[]);
    let w = wait_worker(&addr, "ready", Duration::from_secs(120));
    assert_eq!(w["managed"], true);
    assert_eq!(w["backend"], "cpu");
    assert_eq!(get(&addr, "/ready").status, 200);
    let worker_url = w["base_url"].as_str().unwrap().trim_start_matches("http://").to_string();

    let id = submit(&addr, &quick_job());
    let job = wait_job(&addr, &id, Duration::from_secs(120));
    assert_eq!(job["state"], "succeeded", "{job}");
    assert_eq!(job["id"], id.as_str(), "the hive shows its own job id");
    let via_hive = pixels(job["images"][0]["png_base64"].as_str().unwrap());

    // The worker's own validation answer comes back as it would from the worker.
    let bad = json!({"prompt": "a cat", "steps": 0});
    let (via, direct) = (post(&addr, "/v1/jobs", &bad), post(&worker_url, "/v1/jobs", &bad));
    assert_eq!((via.status, direct.status), (400, 400), "{}", via.text());
    assert_eq!(via.json(), direct.json());
    let typo = post(&addr, "/v1/jobs", &json!({"prompt": "a cat", "step": 3}));
    assert_eq!(typo.status, 400);
    assert!(typo.text().contains("step"), "{}", typo.text());

    let direct_id = submit(&worker_url, &quick_job());
    let direct = wait_job(&worker_url, &direct_id, Duration::from_secs(120));
    let direct = pixels(direct["images"][0]["png_base64"].as_str().unwrap());
    assert_eq!((via_hive.0, via_hive.1), (64, 64));
    assert!(via_hive == direct, "the image through the hive differs from the worker's own");

    // The OpenAI route, forwarded synchronously, gives the same picture.
    let r = post(
        &addr,
        "/v1/images/generations",
        &json!({"prompt": "a cat", "size": "64x64", "steps": 4, "seed": 42, "sampler": "Euler", "model": "dall-e-2"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(pixels(r.json()["data"][0]["b64_json"].as_str().unwrap()) == direct);

    // Events replay through the hive under the hive's id.
    let events = get(&addr, &format!("/v1/jobs/{id}/events")).text();
    assert!(events.contains("event: completed"), "{events}");
    assert!(events.contains(&format!("\"id\":\"{id}\"")), "{events}");

    let metrics = get(&addr, "/metrics").text();
    assert!(metrics.contains("sdhive_hive_jobs_succeeded_total 1"), "{metrics}");
    let devices = get(&addr, "/v1/devices").json();
    assert!(devices["devices"]
        .as_array()
        .unwrap()
        .iter()
        .any(|d| d["backend"] == "cpu" && d["status"] == "selected"));
    drop(hive_proc);
}

#[test]
fn killed_worker_is_restarted_and_every_job_completes_the_running_one_run_again() {
    let (hive_proc, addr) = start_hive("127.0.0.1:0", true, &["--worker-slots", "2", "--queue-size", "1"]);
    let w = wait_worker(&addr, "ready", Duration::from_secs(120));
    let pid = w["pid"].as_u64().unwrap();

    // A runs long enough to be killed mid-way (and then runs again in full); B waits on the worker; C waits in
    // the hive; D is refused.
    let slow = json!({"prompt": "a slow cat", "steps": 60, "width": 128, "height": 128, "seed": 1, "sampler": "Euler"});
    let a = submit(&addr, &slow);
    let b = submit(&addr, &quick_job());
    let c = submit(&addr, &quick_job());
    let d = post(&addr, "/v1/jobs", &quick_job());
    assert_eq!(d.status, 429, "{}", d.text());
    assert_eq!(d.json()["error"]["code"], "queue_full");

    wait_for("job A to be running", Duration::from_secs(60), || {
        let job = get(&addr, &format!("/v1/jobs/{a}")).json();
        (job["state"] == "running" && job["step"].as_u64() >= Some(1)).then_some(())
    });
    let killed = Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap();
    assert!(killed.success());

    for id in [&a, &b, &c] {
        let job = wait_job(&addr, id, Duration::from_secs(240));
        assert_eq!(job["state"], "succeeded", "job {id}: {job}\nhive log:\n{}", hive_proc.log());
    }
    let metrics = get(&addr, "/metrics").text();
    assert!(metrics.contains("sdhive_hive_jobs_rerun_total 1"), "A ran again: {metrics}");
    assert!(metrics.contains("sdhive_hive_jobs_worker_lost_total 0"), "{metrics}");
    let w = wait_worker(&addr, "ready", Duration::from_secs(30));
    assert!(w["restarts"].as_u64() >= Some(1), "{w}");
    assert_ne!(w["pid"].as_u64(), Some(pid), "a new process serves");
    assert!(!w["last_exit"].is_null(), "{w}");
}

#[test]
fn external_worker_reregisters_with_a_restarted_hive() {
    let port = free_port();
    let bind = format!("127.0.0.1:{port}");
    let (mut first, addr) = start_hive(&bind, false, &[]);
    let callback = format!("http://{addr}/v1/workers/register");
    let mut cmd = Command::new(worker_cpu());
    cmd.args([
        "serve",
        "--model",
        &sd1(),
        "--port",
        "0",
        "--worker-id",
        "ext-1",
        "--callback-url",
        &callback,
    ]);
    cmd.env("WORKER_TOKEN", TOKEN).env("RUST_LOG", "info");
    let worker = Proc::spawn(cmd);
    let w = wait_worker(&addr, "ready", Duration::from_secs(120));
    assert_eq!((w["id"].as_str(), w["managed"].as_bool()), (Some("ext-1"), Some(false)));

    first.signal("-TERM");
    assert!(first.wait_exit(Duration::from_secs(20)).is_some(), "the hive did not stop:\n{}", first.log());
    assert!(!is_dead(u64::from(worker.pid())), "stopping the hive must not stop an external worker");

    let (_second, addr2) = start_hive(&bind, false, &[]);
    assert_eq!(addr, addr2);
    let w = wait_worker(&addr2, "ready", Duration::from_secs(20));
    assert_eq!(w["id"], "ext-1", "worker log:\n{}", worker.log());
    let id = submit(&addr2, &quick_job());
    let job = wait_job(&addr2, &id, Duration::from_secs(120));
    assert_eq!(job["state"], "succeeded", "{job}");
}

#[test]
fn killing_the_hive_leaves_no_worker_behind() {
    let (hive_proc, addr) = start_hive("127.0.0.1:0", true, &[]);
    let w = wait_worker(&addr, "ready", Duration::from_secs(120));
    let pid = w["pid"].as_u64().unwrap();
    assert!(!is_dead(pid));
    hive_proc.signal("-KILL");
    wait_for("the worker to die with the hive", Duration::from_secs(5), || is_dead(pid).then_some(()));
}

#[test]
fn registration_needs_the_token_and_a_unique_live_id() {
    let (_hive_proc, addr) = start_hive("127.0.0.1:0", false, &[]);
    let registration = |id: &str, url: &str| {
        json!({
            "protocol_version": 1, "worker_id": id, "base_url": url, "api_key_required": false, "backend": "cpu",
            "device": {"backend": "cpu", "index": 0, "name": "x", "memory_total_bytes": null,
                       "memory_free_bytes": null, "driver": null},
            "model": "m", "model_family": "sd1",
            "capabilities": {"engine": "candle", "dtype": "f32", "samplers": [], "schedulers": [],
                "native_width": 64, "native_height": 64, "max_width": 64, "max_height": 64, "max_steps": 4,
                "max_n": 1, "max_prompt_chars": 10, "max_queue": 1, "max_body_bytes": 100,
                "img2img": false, "inpaint": false, "preview": false},
            "version": "0", "pid": 4242, "started_at": 0.0
        })
    };
    let auth = format!("Bearer {TOKEN}");
    let with_token = [("Authorization", auth.as_str())];
    let reg = |id: &str, url: &str, headers: &[(&str, &str)]| {
        request(&addr, "POST", "/v1/workers/register", headers, Some(&registration(id, url)))
    };

    // Nothing to route to: refused at once rather than queued forever.
    let r = post(&addr, "/v1/jobs", &quick_job());
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "no_workers");

    let forged = reg("w1", "http://127.0.0.1:9", &[]);
    assert_eq!(forged.status, 401, "{}", forged.text());
    assert_eq!(forged.json()["error"]["type"], "authentication_error");
    assert_eq!(reg("w1", "http://127.0.0.1:9", &[("Authorization", "Bearer wrong")]).status, 401);
    assert!(workers(&addr).is_empty(), "a refused registration leaves no trace");

    let ok = reg("w1", "http://127.0.0.1:9", &with_token);
    assert_eq!(ok.status, 201, "{}", ok.text());
    assert_eq!(ok.json()["heartbeat_interval_secs"], 1);
    let listed = workers(&addr);
    assert_eq!(
        (listed.len(), listed[0]["id"].as_str(), listed[0]["managed"].as_bool()),
        (1, Some("w1"), Some(false))
    );
    let dup = reg("w1", "http://127.0.0.1:10", &with_token);
    assert_eq!(dup.status, 409, "{}", dup.text());
    assert_eq!(reg("w1", "http://127.0.0.1:9", &with_token).status, 201, "same id + same URL re-registers");
    assert_eq!(reg("w2", "file:///etc/passwd", &with_token).status, 400);
    assert_eq!(reg("bad id;rm", "http://127.0.0.1:9", &with_token).status, 400);

    let hb = json!({"worker_id": "ghost", "state": "idle", "queue_depth": 0, "running_job": null,
        "memory_total_bytes": null, "memory_free_bytes": null, "jobs_succeeded": 0, "jobs_failed": 0,
        "jobs_cancelled": 0, "uptime_secs": 1.0});
    let r = request(&addr, "POST", "/v1/workers/ghost/heartbeat", &with_token, Some(&hb));
    assert_eq!(r.status, 404, "unknown workers are told to register again");
    let r = request(&addr, "POST", "/v1/workers/ghost/heartbeat", &[], Some(&hb));
    assert_eq!(r.status, 401, "heartbeats need the token too");
}

#[test]
fn crash_loop_fails_the_worker_with_its_stderr_and_admin_spawns_and_stops() {
    let roots = fixtures().join("models").display().to_string();
    // A workers folder with only the CPU worker: the build folder may also hold an sd-worker-cuda (CI builds one
    // into the same cached target directory), and this test needs a backend whose binary is missing.
    let workers = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(worker_cpu(), workers.path().join("sd-worker-cpu")).unwrap();
    let mut cmd = Command::new(hive());
    cmd.args(["serve", "--bind", "127.0.0.1:0", "--token", TOKEN, "--heartbeat-interval", "1"]);
    cmd.args(["--model-root", &roots]);
    cmd.arg("--workers-dir").arg(workers.path());
    cmd.env("SDHIVE_RESTART_INITIAL_SECS", "0.2").env("SDHIVE_CRASH_LOOP_FAILURES", "3");
    let hive_proc = Proc::spawn(cmd);
    let addr = hive_proc.wait_listening("hive listening on http://");

    let missing = fixtures().join("models/no-such-model").display().to_string();
    let r = post(&addr, "/v1/workers", &json!({"backend": "cpu", "model": missing, "worker_id": "broken"}));
    assert_eq!(r.status, 201, "{}", r.text());
    let broken = wait_for("the broken worker to be failed", Duration::from_secs(60), || {
        let w = get(&addr, "/v1/workers/broken").json();
        (w["state"] == "failed").then_some(w)
    });
    let stderr: Vec<&str> =
        broken["stderr_tail"].as_array().unwrap().iter().filter_map(|l| l.as_str()).collect();
    assert!(stderr.iter().any(|l| l.contains("no-such-model")), "{broken}");
    assert!(broken["last_exit"].as_str().is_some_and(|e| e.contains("exited")), "{broken}");
    assert_eq!(broken["restarts"], 2, "3 failures = 2 restarts, then no more: {broken}");

    let r = post(&addr, "/v1/workers", &json!({"backend": "cuda", "model": sd1()}));
    assert_eq!(r.status, 400);
    assert!(r.text().contains("sd-worker-cuda"), "a missing binary is named: {}", r.text());
    let r = post(&addr, "/v1/workers", &json!({"backend": "cpu", "model": sd1(), "worker_id": "x;rm -rf"}));
    assert_eq!(r.status, 400);

    let r = post(&addr, "/v1/workers", &json!({"backend": "cpu", "model": sd1(), "worker_id": "extra"}));
    assert_eq!(r.status, 201, "{}", r.text());
    let extra = wait_worker(&addr, "ready", Duration::from_secs(120));
    assert_eq!(extra["id"], "extra");
    let pid = extra["pid"].as_u64().unwrap();
    let r = request(&addr, "DELETE", "/v1/workers/extra", &[], None);
    assert_eq!(r.status, 202, "{}", r.text());
    wait_for("the stopped worker", Duration::from_secs(30), || {
        (get(&addr, "/v1/workers/extra").json()["state"] == "stopped").then_some(())
    });
    wait_for("the stopped worker's process to exit", Duration::from_secs(10), || is_dead(pid).then_some(()));
    assert_eq!(get(&addr, "/ready").status, 503, "no worker is left to route to");
}

#[test]
fn sigterm_drains_the_running_job_then_stops_the_workers() {
    // A drain grace far beyond the job's length however loaded the machine is: the job must end by itself.
    let (mut hive_proc, addr) =
        start_hive_with("127.0.0.1:0", true, &[], &[("SDHIVE_DRAIN_GRACE_SECS", "300")]);
    let w = wait_worker(&addr, "ready", Duration::from_secs(120));
    let pid = w["pid"].as_u64().unwrap();
    let slow = json!({"prompt": "a slow cat", "steps": 30, "width": 192, "height": 192, "seed": 3, "sampler": "Euler"});
    let id = submit(&addr, &slow);
    wait_for("the job to run", Duration::from_secs(60), || {
        (get(&addr, &format!("/v1/jobs/{id}")).json()["state"] == "running").then_some(())
    });
    // Follow the job's events from before the signal to their end.
    let events = {
        let (addr, id) = (addr.clone(), id.clone());
        std::thread::spawn(move || get(&addr, &format!("/v1/jobs/{id}/events")).text())
    };
    hive_proc.signal("-TERM");
    wait_for("the hive to refuse new jobs", Duration::from_secs(10), || {
        let r =
            try_request(&addr, "POST", "/v1/jobs", &[], Some(&quick_job()), Duration::from_secs(10)).ok()?;
        (r.status == 503).then(|| assert_eq!(r.json()["error"]["code"], "shutting_down"))
    });
    let events = events.join().unwrap();
    assert!(
        events.contains("event: completed"),
        "the running job did not finish during the drain:\n{events}"
    );
    let status = hive_proc.wait_exit(Duration::from_secs(60));
    assert!(status.is_some_and(|s| s.success()), "hive exit: {status:?}\n{}", hive_proc.log());
    assert!(is_dead(pid), "the worker was stopped with the hive");
}

#[test]
fn api_key_guards_everything_but_the_probes() {
    let (_hive_proc, addr) =
        start_hive("127.0.0.1:0", false, &["--api-key", "k3y", "--api-auth", "bob:hunter2"]);
    let key = [("Authorization", "Bearer k3y")];
    // `bob:hunter2` as HTTP Basic (A1111's --api-auth) is accepted as well as the key, admin routes included.
    let basic = [("Authorization", "Basic Ym9iOmh1bnRlcjI=")];
    assert_eq!(request(&addr, "GET", "/v1/workers", &basic, None).status, 200);
    let flags = request(&addr, "GET", "/sdapi/v1/cmd-flags", &basic, None);
    assert_eq!(flags.status, 200, "{}", flags.text());
    assert_eq!(
        (flags.json()["api_key"].as_str(), flags.json()["api_auth"].as_str()),
        (Some("<redacted>"), Some("<redacted>"))
    );
    assert!(!flags.text().contains("hunter2") && !flags.text().contains("k3y"), "{}", flags.text());
    let r = request(&addr, "GET", "/sdapi/v1/prompt-styles", &[("Authorization", "Basic ")], None);
    assert_eq!(r.status, 401);
    let head = r.head.to_ascii_lowercase();
    assert!(
        head.contains("www-authenticate: basic") && head.contains("www-authenticate: bearer"),
        "{}",
        r.head
    );
    assert_eq!(request(&addr, "GET", "/sdapi/v1/prompt-styles", &basic, None).json(), json!([]));
    assert_eq!(get(&addr, "/health").status, 200);
    // Probes carry no credentials; `/ready` says only whether a worker is routable (none here yet: 503).
    let ready = get(&addr, "/ready");
    assert_eq!(
        (ready.status, ready.json()["status"].as_str()),
        (503, Some("no_workers")),
        "{}",
        ready.text()
    );
    for (method, path) in
        [("GET", "/v1/workers"), ("GET", "/v1/devices"), ("GET", "/metrics"), ("POST", "/v1/jobs")]
    {
        let body = (method == "POST").then(quick_job);
        let r = request(&addr, method, path, &[], body.as_ref());
        assert_eq!(r.status, 401, "{method} {path}: {}", r.text());
        assert_eq!(r.json()["error"]["code"], "invalid_api_key");
        let wrong = request(&addr, method, path, &[("Authorization", "Bearer nope")], body.as_ref());
        assert_eq!(wrong.status, 401, "{method} {path}");
    }
    assert_eq!(request(&addr, "GET", "/v1/workers", &key, None).status, 200);
    assert_eq!(request(&addr, "GET", "/metrics", &key, None).status, 200);
    // The API key is not the registration token.
    let r = request(&addr, "POST", "/v1/workers/register", &key, Some(&json!({})));
    assert_eq!(r.status, 401);
}

#[test]
fn devices_and_config_commands() {
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut cmd = Command::new(hive());
        cmd.args(args);
        for (k, _) in std::env::vars() {
            if k.starts_with("SDHIVE_") {
                cmd.env_remove(k);
            }
        }
        cmd.envs(env.iter().copied());
        let out = cmd.output().expect("cannot run hive");
        assert!(out.status.success(), "hive {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let table = run(&["devices", "--model", "m", "--workers-dir", "/nonexistent"], &[]);
    assert!(table.contains("cpu"), "{table}");
    assert!(
        table.contains("MISSING worker binary /nonexistent/sd-worker-cpu"),
        "reported, not skipped:\n{table}"
    );
    // Every configured model is accounted for: preloaded by a worker, or said to load on demand.
    let models = fixtures().join("models");
    let (m0, m1) = (models.join("sd1").display().to_string(), models.join("sdxl").display().to_string());
    let dir = models.display().to_string();
    let args = [
        "devices",
        "--cpu",
        "always",
        "--backend",
        "cpu",
        "--models-dir",
        &dir,
        "--model",
        &m0,
        "--model",
        &m1,
    ];
    let table = run(&args, &[]);
    assert!(table.contains(&format!("(preloads {m0})")), "{table}");
    assert!(
        table.contains(&format!("model {m1}: no worker preloads it")) && table.contains("loaded on demand"),
        "{table}"
    );
    let table = run(&args, &[("SDHIVE_CPU_WORKERS", "2")]);
    assert!(
        table.contains(&format!("(preloads {m0})")) && table.contains(&format!("(preloads {m1})")),
        "{table}"
    );
    let rows: Value = serde_json::from_str(&run(&["devices", "--json"], &[])).unwrap();
    assert!(
        rows.as_array().unwrap().iter().any(|r| r["backend"] == "cpu" && r["binary_present"] == true),
        "{rows}"
    );

    let config = run(
        &["config", "--token", "s3cret", "--queue-size", "5"],
        &[("SDHIVE_QUEUE_SIZE", "9"), ("SDHIVE_WORKER_SLOTS", "3")],
    );
    assert!(!config.contains("s3cret") && config.contains("<redacted>"), "{config}");
    assert!(config.contains("queue_size = 5"), "the flag beats the environment:\n{config}");
    assert!(config.contains("worker_slots = 3"), "the environment beats the default:\n{config}");
}

#[test]
fn synchronous_requests_hold_a_slot_and_run_again_when_the_worker_dies() {
    let (_hive_proc, addr) = start_hive("127.0.0.1:0", true, &["--worker-slots", "1"]);
    let w = wait_worker(&addr, "ready", Duration::from_secs(120));
    let pid = w["pid"].as_u64().unwrap();
    // No seed: the hive draws one, so that the run after the worker's death makes the image the first would have.
    let body = json!({"prompt": "a slow cat", "size": "192x192", "steps": 60, "sampler": "Euler"});
    let sync = {
        let (addr, body) = (addr.clone(), body.clone());
        std::thread::spawn(move || post(&addr, "/v1/images/generations", &body))
    };
    wait_for("the synchronous job to run on the worker", Duration::from_secs(60), || {
        let w = workers(&addr).into_iter().next()?;
        (w["inflight"] == 1 && w["running_job"]["step"].as_u64() >= Some(1)).then_some(())
    });
    // The worker's only slot is taken by the synchronous request: a native job waits in the hive.
    let queued = submit(&addr, &quick_job());
    let job = get(&addr, &format!("/v1/jobs/{queued}")).json();
    assert_eq!((job["state"].as_str(), job["queue_position"].as_u64()), (Some("queued"), Some(0)), "{job}");

    assert!(Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap().success());
    let r = sync.join().unwrap();
    assert_eq!(r.status, 200, "run again on the restarted worker: {}", r.text());
    let job = wait_job(&addr, &queued, Duration::from_secs(180));
    assert_eq!(job["state"], "succeeded", "the waiting job ran on the restarted worker: {job}");
    let metrics = get(&addr, "/metrics").text();
    assert!(metrics.contains("sdhive_hive_sync_rerun_total 1"), "{metrics}");
    assert!(metrics.contains("sdhive_hive_sync_worker_lost_total 0"), "{metrics}");
}

#[test]
fn a_silent_worker_is_unhealthy_then_restarted() {
    let (_hive_proc, addr) = start_hive("127.0.0.1:0", true, &[]);
    let w = wait_worker(&addr, "ready", Duration::from_secs(120));
    let pid = w["pid"].as_u64().unwrap();
    // A stopped process keeps its socket open but answers nothing: only the missing heartbeats tell.
    assert!(Command::new("kill").args(["-STOP", &pid.to_string()]).status().unwrap().success());
    wait_worker(&addr, "unhealthy", Duration::from_secs(10));
    assert_eq!(get(&addr, "/ready").status, 503, "an unhealthy worker is not routed to");
    let w = wait_for("a restarted worker", Duration::from_secs(60), || {
        workers(&addr).into_iter().find(|w| w["state"] == "ready" && w["pid"].as_u64() != Some(pid))
    });
    assert!(w["last_exit"].as_str().is_some_and(|e| e.contains("missing heartbeats")), "{w}");
    wait_for("the hung process to be gone", Duration::from_secs(10), || is_dead(pid).then_some(()));
}

#[test]
fn a_model_no_worker_can_serve_is_said_so_not_dropped() {
    // One CPU worker, two models, no models dir: the second can be loaded by nobody.
    let sdxl = fixtures().join("models/sdxl").display().to_string();
    let (hive_proc, addr) = start_hive("127.0.0.1:0", true, &["--model", &sdxl]);
    wait_worker(&addr, "ready", Duration::from_secs(120));
    let listed = get(&addr, "/v1/workers").json();
    assert_eq!(listed["on_demand_models"], json!([sdxl]), "{listed}");
    assert!(hive_proc.log().contains(&format!("model {sdxl}: NOT SERVED")), "{}", hive_proc.log());
    let r = post(&addr, "/v1/jobs", &json!({"prompt": "a cat", "model": "sdxl"}));
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (503, Some("model_unavailable")),
        "{}",
        r.text()
    );
    assert!(r.text().contains("outside every models dir"), "{}", r.text());
}
