//! `cargo xtask bench gateway`: what a gateway costs and how fast it notices a lost node, on loopback with real
//! processes — a gateway (`hive serve --gateway`) and node hives with one CPU worker each on the tiny SD 1.x
//! fixture. Prints two tables (figures in `docs/benchmarks.md`):
//! - the same 64², 1-step A1111 request sent straight to a node hive and through the gateway, alternating, one
//!   client (median and p90), then 4 concurrent clients (requests/s): the difference is the gateway's cost;
//! - time from a node's loss to its jobs going back to the gateway's queue for the other node (the gateway's
//!   `jobs_rerun` or `jobs_redispatched` counter moving), for
//!   a node killed with `kill -9` (its address then refuses connections) and for a node that falls silent
//!   (`SIGSTOP`, which looks like a cut link: no reset, no answer), with 1-second heartbeats.
//!
//! Ignored: a benchmark, not a check (the cluster's behaviour is checked by `cluster.rs`).

mod support;

use sdhive_tests::{fixtures, hive};
use serde_json::{json, Value};
use std::process::Command;
use std::time::{Duration, Instant};
use support::*;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn node(gateway: &str, id: &str, port: u16, models: &std::path::Path) -> Proc {
    let mut cmd = Command::new(hive());
    cmd.args(["serve", "--bind", &format!("127.0.0.1:{port}"), "--parent", &format!("http://{gateway}")])
        .args(["--parent-token", TOKEN, "--node-id", id, "--cpu", "always", "--heartbeat-interval", "1"])
        .arg("--models-dir")
        .arg(models);
    Proc::spawn(cmd)
}

fn node_state(gateway: &str, id: &str) -> Option<String> {
    workers(gateway).into_iter().find(|w| w["id"] == id).and_then(|w| w["state"].as_str().map(String::from))
}

fn wait_ready(gateway: &str, id: &str) {
    wait_for(&format!("node {id} ready at the gateway"), Duration::from_secs(120), || {
        node_state(gateway, id).filter(|s| s == "ready" || s == "busy")
    });
}

fn counter(addr: &str, name: &str) -> u64 {
    let text = get(addr, "/metrics").text();
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("{name} not in /metrics"))
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn txt2img(addr: &str, seed: u64) -> Duration {
    let body = json!({"prompt": "a cat", "steps": 1, "width": 64, "height": 64, "seed": seed});
    let t = Instant::now();
    let r = post(addr, "/sdapi/v1/txt2img", &body);
    let took = t.elapsed();
    assert_eq!(r.status, 200, "{}", r.text());
    took
}

fn per_second(addr: &str, clients: usize, each: usize) -> f64 {
    let t = Instant::now();
    std::thread::scope(|s| {
        for c in 0..clients {
            s.spawn(move || {
                for i in 0..each {
                    txt2img(addr, (c * each + i) as u64);
                }
            });
        }
    });
    (clients * each) as f64 / t.elapsed().as_secs_f64()
}

#[test]
#[ignore = "a benchmark: cargo xtask bench gateway"]
fn gateway_figures() {
    let iters: usize = std::env::var("SDHIVE_BENCH_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(40);
    let lib = tempfile::tempdir().unwrap();
    copy_tree(&fixtures().join("models/sd1"), &lib.path().join("models/sd1"));
    let models = lib.path().join("models");

    let mut gw_cmd = Command::new(hive());
    gw_cmd.args([
        "serve",
        "--gateway",
        "--bind",
        "127.0.0.1:0",
        "--token",
        TOKEN,
        "--heartbeat-interval",
        "1",
    ]);
    let gw_proc = Proc::spawn(gw_cmd);
    let gw = gw_proc.wait_listening("hive listening on http://");
    let n1_port = free_port();
    let mut n1 = node(&gw, "n1", n1_port, &models);
    let n1_addr = format!("127.0.0.1:{n1_port}");
    wait_ready(&gw, "n1");

    // One client, alternating so that drifts in the machine's load hit both paths alike.
    for seed in 0..3 {
        txt2img(&n1_addr, seed);
        txt2img(&gw, seed);
    }
    let (mut direct, mut through) = (Vec::new(), Vec::new());
    for i in 0..iters as u64 {
        direct.push(txt2img(&n1_addr, i).as_secs_f64() * 1e3);
        through.push(txt2img(&gw, i).as_secs_f64() * 1e3);
    }
    direct.sort_by(f64::total_cmp);
    through.sort_by(f64::total_cmp);
    let each = (iters / 2).max(4);
    let direct_rps = per_second(&n1_addr, 4, each);
    let through_rps = per_second(&gw, 4, each);
    println!(
        "\nGateway cost (loopback, SD 1.x fixture 64², 1 step, A1111 txt2img; {iters} requests per path)"
    );
    println!("| path | p50 ms | p90 ms | req/s, 4 clients |");
    println!("|---|---|---|---|");
    for (name, t, rps) in
        [("straight to the node hive", &direct, direct_rps), ("through the gateway", &through, through_rps)]
    {
        println!("| {name} | {:.2} | {:.2} | {rps:.1} |", percentile(t, 0.5), percentile(t, 0.9));
    }
    println!(
        "gateway overhead: p50 {:+.2} ms per request (target ≤ 2 ms), throughput {:.3}× the node's",
        percentile(&through, 0.5) - percentile(&direct, 0.5),
        through_rps / direct_rps
    );

    // A second node takes over what the lost one was running.
    let n2_port = free_port();
    let _n2 = node(&gw, "n2", n2_port, &models);
    wait_ready(&gw, "n2");
    let mut rows = Vec::new();
    for (kind, signal) in
        [("kill -9 (address refuses connections)", "-KILL"), ("silent (SIGSTOP, as a cut link)", "-STOP")]
    {
        let mut times = Vec::new();
        for trial in 0..3u64 {
            let rerouted = || {
                counter(&gw, "sdhive_hive_jobs_rerun_total")
                    + counter(&gw, "sdhive_hive_jobs_redispatched_total")
            };
            let before = rerouted();
            let long = json!({"prompt": "a cat", "steps": 150, "width": 256, "height": 256, "seed": trial});
            // Enough to fill both nodes' slots: one of n1's is running when it is lost.
            let ids: Vec<String> = (0..4).map(|_| submit(&gw, &long)).collect();
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let ws: Vec<(Value, Value, Value)> = workers(&gw)
                    .into_iter()
                    .map(|w| (w["id"].clone(), w["inflight"].clone(), w["state"].clone()))
                    .collect();
                let states: Vec<Value> = ids
                    .iter()
                    .map(|id| get(&gw, &format!("/v1/jobs/{id}")).json()["state"].clone())
                    .collect();
                let n1_busy = ws.iter().any(|(id, inflight, _)| id == "n1" && inflight.as_u64() > Some(0));
                if n1_busy && states.iter().filter(|s| *s == "running").count() >= 2 {
                    break;
                }
                let seen = format!("workers {ws:?}, jobs {states:?}");
                assert!(Instant::now() < deadline, "no job running on n1: {seen}");
                std::thread::sleep(Duration::from_millis(50));
            }
            // Right after a heartbeat, the worst moment for a silence to be noticed.
            let hb = |v: &Value| v["last_heartbeat_secs_ago"].as_f64();
            wait_for("a fresh heartbeat from n1", Duration::from_secs(5), || {
                let w = workers(&gw).into_iter().find(|w| w["id"] == "n1")?;
                hb(&w).filter(|&s| s < 0.1).map(|_| ())
            });
            let lost_at = Instant::now();
            n1.signal(signal);
            let took = wait_for("the lost node's jobs to be sent elsewhere", Duration::from_secs(30), || {
                (rerouted() > before).then(|| lost_at.elapsed())
            });
            times.push(took.as_secs_f64());
            for id in &ids {
                post(&gw, &format!("/v1/jobs/{id}/cancel"), &json!({}));
            }
            // A fresh node each time: a stopped one would still be running its copy of the job when it woke.
            if signal == "-STOP" {
                n1.signal("-KILL");
            }
            n1.wait_exit(Duration::from_secs(5));
            n1 = node(&gw, "n1", n1_port, &models);
            wait_ready(&gw, "n1");
            wait_for("both nodes idle", Duration::from_secs(60), || {
                workers(&gw).iter().all(|w| w["inflight"] == 0).then_some(())
            });
        }
        rows.push((kind, times));
    }
    println!("\nLost node → its jobs re-routed to the other node (heartbeat interval 1 s; 3 trials each)");
    println!("| loss | mean s | max s |");
    println!("|---|---|---|");
    for (kind, t) in rows {
        let max = t.iter().copied().fold(0.0, f64::max);
        let mean = t.iter().sum::<f64>() / t.len() as f64;
        println!("| {kind} | {mean:.2} | {max:.2} |");
    }
    drop(gw_proc);
}
