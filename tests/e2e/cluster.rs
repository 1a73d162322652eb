//! A cluster of hives on one machine (#40): a gateway hive (`--gateway`, no workers of its own) and two node
//! hives, each in a network namespace of its own on one bridge (`support::netns` says why a switch namespace,
//! and how the test reaches the hosts), talking only over their own addresses; each node runs one CPU worker
//! over a models dir of tiny fixture checkpoints (`n1`: SD 1.x and SDXL, `n2`: SD 1.x, under the same names).
//! Native, OpenAI and A1111 requests through the gateway reach both nodes and make the image a node makes
//! when asked directly; SDXL requests all go to the only node holding it; a node cut off from the network or
//! killed with `kill -9` mid-job costs no request (its jobs run again on the other node) and it joins again
//! once back; a hive or worker with a wrong token cannot join; a restarted gateway has its nodes back within
//! two heartbeats; the gateway's `/v1/workers` is the tree of hives and their workers. Every wait has a
//! deadline; the tests run one at a time (each keeps two CPU workers busy).

mod support;

use sdhive_tests::{fixtures, hive, worker_cpu};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use support::netns::Net;
use support::*;

static SERIAL: Mutex<()> = Mutex::new(());

const PORT: u16 = 7833;
/// The API key of every hive, and the one the gateway reaches its nodes with (`worker_api_key`): admin routes
/// (`/v1/workers`) are disabled on a hive that listens beyond loopback without one.
const KEY: &str = "cluster-key";
/// The registration token each node hive gives its own workers (the gateway's is [`TOKEN`]).
const NODE_TOKEN: &str = "node-token-456";
/// The gateway's heartbeat interval: how fast a lost node is noticed and a restarted gateway found again.
const HEARTBEAT_SECS: u64 = 1;
const NODES: [&str; 2] = ["n1", "n2"];

/// Requests to one hive, with [`KEY`].
#[derive(Clone)]
struct Api(String);

impl Api {
    fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        timeout: Duration,
    ) -> std::io::Result<Reply> {
        let auth = format!("Bearer {KEY}");
        try_request(&self.0, method, path, &[("Authorization", &auth)], body, timeout)
    }
    fn get(&self, path: &str) -> Reply {
        self.call("GET", path, None, Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("GET {}{path}: {e}", self.0))
    }
    fn workers(&self) -> Vec<Value> {
        let r = self.get("/v1/workers");
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["workers"].as_array().cloned().unwrap_or_default()
    }
    fn metric(&self, name: &str) -> u64 {
        let text = self.get("/metrics").text();
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
    }
    /// Generation requests this hive took: native jobs and forwarded OpenAI/A1111 requests.
    fn served(&self) -> u64 {
        self.metric("sdhive_hive_jobs_submitted_total") + self.metric("sdhive_hive_sync_requests_total")
    }
}

#[derive(Debug, Clone, Copy)]
enum Route {
    Native,
    OpenAi,
    A1111,
}

const ROUTES: [Route; 3] = [Route::Native, Route::OpenAi, Route::A1111];

/// What a request asks for besides its route: every route given the same gets the same image.
#[derive(Debug, Clone, Copy)]
struct Ask {
    model: &'static str,
    seed: u64,
    steps: u32,
    size: u32,
}

/// Small and quick.
const QUICK: Ask = Ask { model: "sd1", seed: 42, steps: 8, size: 64 };
/// Long enough (about 4 s on CPU) to be caught running with a good part left.
const SLOW: Ask = Ask { model: "sd1", seed: 7, steps: 80, size: 128 };

/// One generation of "a cat" through `route`; the image's pixels, or what went wrong.
fn generate(api: &Api, route: Route, ask: Ask) -> Result<Vec<u8>, String> {
    let Ask { model, seed, steps, size } = ask;
    let (path, body) = match route {
        Route::Native => (
            "/v1/jobs",
            json!({"prompt": "a cat", "steps": steps, "width": size, "height": size, "seed": seed,
                "sampler": "Euler", "cfg_scale": 7, "model": model}),
        ),
        Route::OpenAi => (
            "/v1/images/generations",
            json!({"prompt": "a cat", "size": format!("{size}x{size}"), "steps": steps, "seed": seed,
                "sampler": "Euler", "cfg_scale": 7, "model": model}),
        ),
        Route::A1111 => (
            "/sdapi/v1/txt2img",
            json!({"prompt": "a cat", "steps": steps, "width": size, "height": size, "seed": seed,
                "sampler_name": "Euler", "cfg_scale": 7, "override_settings": {"sd_model_checkpoint": model}}),
        ),
    };
    let what = format!("{route:?} {model} via {}", api.0);
    let r =
        api.call("POST", path, Some(&body), Duration::from_secs(300)).map_err(|e| format!("{what}: {e}"))?;
    let fail = |r: &Reply| format!("{what}: {} {}", r.status, r.text());
    let b64 = match route {
        Route::Native if r.status == 202 => {
            let id = r.json()["id"].as_str().unwrap_or_default().to_string();
            let deadline = Instant::now() + Duration::from_secs(300);
            let job = loop {
                let job = api.call("GET", &format!("/v1/jobs/{id}"), None, Duration::from_secs(30));
                let job = job.map_err(|e| format!("{what}: job {id}: {e}"))?.json();
                if matches!(job["state"].as_str(), Some("succeeded" | "failed" | "cancelled")) {
                    break job;
                }
                if Instant::now() > deadline {
                    return Err(format!("{what}: job {id} unfinished after 300 s: {job}"));
                }
                std::thread::sleep(Duration::from_millis(100));
            };
            if job["state"] != "succeeded" {
                return Err(format!("{what}: job {id} {job}"));
            }
            job["images"][0]["png_base64"].as_str().map(String::from)
        }
        Route::OpenAi if r.status == 200 => r.json()["data"][0]["b64_json"].as_str().map(String::from),
        Route::A1111 if r.status == 200 => r.json()["images"][0].as_str().map(String::from),
        _ => return Err(fail(&r)),
    };
    Ok(pixels(&b64.ok_or_else(|| fail(&r))?).2)
}

/// `requests` sent at once through `api`, each on a thread of its own; collected with [`finish`].
fn send_all(api: &Api, requests: &[(Route, Ask)]) -> Vec<std::thread::JoinHandle<Result<Vec<u8>, String>>> {
    requests
        .iter()
        .map(|&(route, ask)| {
            let api = api.clone();
            std::thread::spawn(move || generate(&api, route, ask))
        })
        .collect()
}

/// Every request's image, each of which must be `expected`.
fn finish(
    calls: Vec<std::thread::JoinHandle<Result<Vec<u8>, String>>>,
    expected: &[u8],
    logs: impl Fn() -> String,
) {
    let results: Vec<_> = calls.into_iter().map(|c| c.join().expect("request thread")).collect();
    let failed: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(failed.is_empty(), "requests failed: {failed:#?}\n{}", logs());
    let wrong = results.iter().filter(|r| r.as_ref().is_ok_and(|image| image != expected)).count();
    assert_eq!(wrong, 0, "{wrong} of {} images differ from a node's own", results.len());
}

/// The last `n` lines of a process's log, headed by `name`.
fn tail(name: &str, p: &Proc, n: usize) -> String {
    let lines = p.log.lock().unwrap();
    format!("--- {name} ---\n{}", lines[lines.len().saturating_sub(n)..].join("\n"))
}

/// The gateway and the node hives in their namespaces of `net`.
struct Cluster<'n> {
    net: &'n Net,
    /// Each node's models dir (copies: the catalogue refuses symlinks leading outside it) and hash cache.
    dir: tempfile::TempDir,
    gateway: Option<Proc>,
    nodes: Vec<(&'static str, Option<Proc>)>,
}

impl<'n> Cluster<'n> {
    /// A gateway, and both nodes registered with it and ready.
    fn start(net: &'n Net) -> Cluster<'n> {
        let dir = tempfile::tempdir().unwrap();
        let models = fixtures().join("models");
        for (node, held) in [("n1", &["sd1", "sdxl"][..]), ("n2", &["sd1"][..])] {
            for m in held {
                copy_tree(&models.join(m), &dir.path().join(node).join("models").join(m));
            }
        }
        let mut c = Cluster { net, dir, gateway: None, nodes: NODES.iter().map(|&n| (n, None)).collect() };
        c.start_gateway();
        for node in NODES {
            c.start_node(node);
        }
        c.wait_ready(&NODES, Duration::from_secs(90));
        c
    }

    fn addr(&self, host: &str) -> String {
        format!("{}:{PORT}", self.net.ip(host))
    }

    fn gw(&self) -> Api {
        Api(self.addr("gw"))
    }

    fn node(&self, node: &str) -> Api {
        Api(self.addr(node))
    }

    fn models_dir(&self, node: &str) -> PathBuf {
        std::fs::canonicalize(self.dir.path().join(node).join("models")).unwrap()
    }

    fn env(&self, cmd: &mut Command, name: &str) {
        cmd.env("SDHIVE_RESTART_INITIAL_SECS", "0.5")
            .env("SDHIVE_DRAIN_GRACE_SECS", "5")
            .env("SDHIVE_STOP_GRACE_SECS", "5")
            .env("SDHIVE_HASH_CACHE", self.dir.path().join(format!("{name}-hashes.json")));
    }

    /// `hive serve --gateway` on the gateway's address; returns once it listens.
    fn start_gateway(&mut self) -> Instant {
        let addr = self.addr("gw");
        let mut cmd = self.net.command("gw", hive());
        cmd.args(["serve", "--gateway", "--bind", &addr, "--token", TOKEN, "--api-key", KEY]);
        cmd.args(["--heartbeat-interval", &HEARTBEAT_SECS.to_string()]);
        self.env(&mut cmd, "gw");
        cmd.env("SDHIVE_WORKER_API_KEY", KEY);
        let p = Proc::spawn(cmd);
        assert_eq!(p.wait_listening("hive listening on http://"), addr, "{}", p.log());
        self.gateway = Some(p);
        Instant::now()
    }

    /// The command line of a node hive on `port` of `host`'s address, registering as `id` with `parent_token`.
    fn node_command(&self, host: &str, port: u16, id: &str, parent_token: &str, models: &Path) -> Command {
        let ip = self.net.ip(host);
        let (bind, parent) = (format!("{ip}:{port}"), format!("http://{}", self.addr("gw")));
        let mut cmd = self.net.command(host, hive());
        cmd.args(["serve", "--bind", &bind, "--advertise-url", &format!("http://{bind}")]);
        cmd.args(["--parent", &parent, "--parent-token", parent_token, "--node-id", id]);
        cmd.args(["--token", NODE_TOKEN, "--api-key", KEY, "--heartbeat-interval", "1"]);
        cmd.args(["--cpu", "always", "--backend", "cpu", "--cpu-workers", "1"]);
        cmd.arg("--models-dir").arg(models);
        self.env(&mut cmd, id);
        cmd
    }

    fn start_node(&mut self, node: &str) {
        let cmd = self.node_command(node, PORT, node, TOKEN, &self.models_dir(node));
        let p = Proc::spawn(cmd);
        assert_eq!(p.wait_listening("hive listening on http://"), self.addr(node), "{}", p.log());
        self.slot(node).replace(p);
    }

    fn slot(&mut self, node: &str) -> &mut Option<Proc> {
        &mut self.nodes.iter_mut().find(|(n, _)| *n == node).expect("a node of the cluster").1
    }

    /// The gateway's `/v1/workers` entry of `id`.
    fn entry(&self, id: &str) -> Option<Value> {
        self.gw().workers().into_iter().find(|w| w["id"] == id)
    }

    /// Waits until every one of `nodes` is a ready hive in the gateway's table; how long that took.
    fn wait_ready(&self, nodes: &[&str], timeout: Duration) -> Duration {
        let start = Instant::now();
        let what = format!("{nodes:?} ready in the gateway");
        let deadline = start + timeout;
        loop {
            let table = self.gw().workers();
            let ready = |id: &&str| table.iter().any(|w| w["id"] == *id && w["state"] == "ready");
            if nodes.iter().all(ready) {
                return start.elapsed();
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}: {table:#?}\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The tail of every hive's log, for failure messages.
    fn logs(&self) -> String {
        let mut out: Vec<String> = self.gateway.iter().map(|p| tail("gateway", p, 60)).collect();
        for (name, p) in &self.nodes {
            out.extend(p.iter().map(|p| tail(name, p, 40)));
        }
        out.join("\n")
    }
}

/// Runs `body` with a fresh cluster, from inside the network.
fn with_cluster(body: impl FnOnce(&mut Cluster) + Send) {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    // Built before entering the network namespace, where cargo may not reach what it needs.
    hive();
    worker_cpu();
    let net = Net::new(&["gw", "n1", "n2"]);
    net.run(|| body(&mut Cluster::start(&net)));
}

// ---- tests ----

#[test]
fn a_hive_in_a_namespace_serves_on_its_address_and_not_once_cut_off() {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let hive = hive();
    // The namespaces of a test process that is gone are removed by the next one (no pid exceeds pid_max).
    let leftover = format!("sdh-{}-0-sw", u32::MAX);
    assert!(Command::new("ip").args(["netns", "add", &leftover]).status().unwrap().success());
    let net = Net::new(&["n1"]);
    let list = || {
        String::from_utf8_lossy(&Command::new("ip").args(["netns", "list"]).output().unwrap().stdout)
            .into_owned()
    };
    assert!(!list().contains(&leftover), "leftover namespace {leftover} kept");

    let sd1 = fixtures().join("models/sd1").display().to_string();
    net.run(|| {
        let addr = format!("{}:{PORT}", net.ip("n1"));
        let mut cmd = net.command("n1", hive);
        cmd.args(["serve", "--bind", &addr, "--token", TOKEN, "--heartbeat-interval", "1", "--api-key", KEY]);
        cmd.args(["--cpu", "always", "--backend", "cpu", "--cpu-workers", "1", "--model", &sd1]);
        let node = Proc::spawn(cmd);
        assert_eq!(node.wait_listening("hive listening on http://"), addr);
        let api = Api(addr.clone());
        assert_eq!(api.get("/health").status, 200);
        wait_for("a ready worker", Duration::from_secs(60), || {
            api.workers().into_iter().find(|w| w["state"] == "ready")
        });
        let image = generate(&api, Route::A1111, QUICK).unwrap_or_else(|e| panic!("{e}\n{}", node.log()));
        assert_eq!(image.len(), 64 * 64 * 3);

        net.set_link("n1", false);
        let cut = api.call("GET", "/health", None, Duration::from_secs(2));
        assert!(cut.is_err(), "a host cut off still answers");
        net.set_link("n1", true);
        let back = wait_for("the host to answer again", Duration::from_secs(10), || {
            api.call("GET", "/health", None, Duration::from_secs(2)).ok()
        });
        assert_eq!(back.status, 200);
    });
    let ns = net.ns("n1");
    drop(net);
    assert!(!list().contains(&ns), "namespace {ns} left behind");
}

#[test]
fn requests_reach_both_nodes_and_make_a_nodes_own_image() {
    with_cluster(|c| {
        let gw = c.gw();
        // The tree: two hives, each with its CPU worker nested; the gateway itself runs none.
        let table = gw.workers();
        assert_eq!(table.len(), 2, "{table:#?}");
        for node in NODES {
            let e = table.iter().find(|w| w["id"] == node).unwrap_or_else(|| panic!("{node}: {table:#?}"));
            assert_eq!(e["kind"], "hive", "{e:#}");
            assert_eq!(e["base_url"], format!("http://{}", c.addr(node)), "{e:#}");
            let nested = e["workers"].as_array().unwrap_or_else(|| panic!("no nested workers: {e:#}"));
            assert_eq!(nested.len(), 1, "{e:#}");
            assert_eq!(
                (nested[0]["kind"].as_str(), nested[0]["backend"].as_str()),
                (Some("worker"), Some("cpu"))
            );
            assert_eq!(nested[0]["state"], "ready", "{e:#}");
        }
        assert_eq!(gw.get("/ready").status, 200);
        let models = gw.get("/v1/models").json();
        let ids: Vec<&str> =
            models["data"].as_array().unwrap().iter().filter_map(|m| m["id"].as_str()).collect();
        assert!(ids.contains(&"sd1") && ids.contains(&"sdxl"), "{models}");

        // What each node makes when asked directly: the same file gives the same image on both.
        let (n1, n2) = (c.node("n1"), c.node("n2"));
        let sd1 = generate(&n1, Route::OpenAi, QUICK).unwrap();
        assert!(generate(&n2, Route::OpenAi, QUICK).unwrap() == sd1, "the nodes disagree");
        let sdxl_ask = Ask { model: "sdxl", ..QUICK };
        let sdxl = generate(&n1, Route::OpenAi, sdxl_ask).unwrap();
        assert!(sdxl != sd1);

        // Six at once, two per route: both nodes serve, every image is the node's own.
        let before = (n1.served(), n2.served());
        let requests: Vec<(Route, Ask)> = ROUTES.iter().flat_map(|&r| [(r, QUICK), (r, QUICK)]).collect();
        finish(send_all(&gw, &requests), &sd1, || c.logs());
        let by_node = (n1.served() - before.0, n2.served() - before.1);
        eprintln!("6 SD 1.x requests through the gateway: {} on n1, {} on n2", by_node.0, by_node.1);
        assert_eq!(by_node.0 + by_node.1, 6, "{by_node:?}");
        assert!(by_node.0 >= 1 && by_node.1 >= 1, "one node got everything: {by_node:?}\n{}", c.logs());

        // SDXL is only on n1: every such request goes there.
        let before = (n1.served(), n2.served());
        let requests: Vec<(Route, Ask)> = ROUTES.iter().map(|&r| (r, sdxl_ask)).collect();
        finish(send_all(&gw, &requests), &sdxl, || c.logs());
        assert_eq!((n1.served() - before.0, n2.served() - before.1), (3, 0));
    });
}

#[test]
fn wrong_tokens_cannot_join() {
    with_cluster(|c| {
        // A node hive in n2's namespace on another port, and a lone worker in n1's, each with a wrong token.
        let intruder_models = c.models_dir("n2");
        let intruder =
            Proc::spawn(c.node_command("n2", PORT + 1, "intruder", "wrong-token", &intruder_models));
        intruder.wait_listening("hive listening on http://");
        let callback = format!("http://{}/v1/workers/register", c.addr("gw"));
        let mut cmd = c.net.command("n1", worker_cpu());
        cmd.args(["serve", "--host", &c.net.ip("n1"), "--port", "7860", "--worker-id", "rogue"]);
        cmd.arg("--model").arg(c.models_dir("n1").join("sd1"));
        cmd.args(["--callback-url", &callback, "--token", "wrong-token"]);
        cmd.env("SDHIVE_HASH_CACHE", c.dir.path().join("rogue-hashes.json")).env("RUST_LOG", "info");
        let rogue = Proc::spawn(cmd);
        // Both are refused, and say so (sdhive-uplink's message, as a worker's).
        for (name, p) in [("intruder", &intruder), ("rogue", &rogue)] {
            let deadline = Instant::now() + Duration::from_secs(60);
            while !p.log().contains("registration failed: the hive answered 401") {
                assert!(Instant::now() < deadline, "{name} was not refused\n{}", tail(name, p, 40));
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        let ids: Vec<String> =
            c.gw().workers().iter().filter_map(|w| w["id"].as_str().map(String::from)).collect();
        assert_eq!(ids.len(), 2, "{ids:?}");
        assert!(ids.iter().all(|id| NODES.contains(&id.as_str())), "{ids:?}");
        // What they were answered.
        let wrong = [("Authorization", "Bearer wrong-token")];
        let r =
            request(&c.addr("gw"), "POST", "/v1/workers/register", &wrong, Some(&json!({"worker_id": "x"})));
        assert_eq!(
            (r.status, r.json()["error"]["code"].as_str()),
            (401, Some("invalid_token")),
            "{}",
            r.text()
        );
    });
}

/// Slow requests on every route, waits until `victim` runs one of them, calls `strike`, and checks that every
/// request still gets the image a node makes and that the gateway ran something again.
fn strike_mid_job(c: &mut Cluster, victim: &str, strike: impl FnOnce(&mut Cluster)) {
    let gw = c.gw();
    let survivor = NODES.iter().find(|&&n| n != victim).unwrap();
    let reference = generate(&c.node(survivor), Route::OpenAi, SLOW).unwrap();
    let requests: Vec<(Route, Ask)> = ROUTES.iter().map(|&r| (r, SLOW)).collect();
    let calls = send_all(&gw, &requests);
    let node = c.node(victim);
    // The step comes from the worker's last heartbeat (up to a second old): in the first half, the job is
    // still running when struck.
    wait_for(&format!("{victim} to run a job"), Duration::from_secs(60), || {
        let running = |w: &Value| w["running_job"]["step"].as_u64().filter(|&s| s >= 1);
        let half = u64::from(SLOW.steps / 2);
        node.workers().iter().filter_map(running).any(|step| step <= half).then_some(())
    });
    let struck = Instant::now();
    strike(c);
    let gone = wait_for(&format!("the gateway to see {victim} gone"), Duration::from_secs(30), || {
        c.entry(victim).is_none_or(|e| e["state"] != "ready").then(|| struck.elapsed())
    });
    finish(calls, &reference, || c.logs());
    let answered = struck.elapsed();
    let reruns = gw.metric("sdhive_hive_jobs_rerun_total")
        + gw.metric("sdhive_hive_jobs_redispatched_total")
        + gw.metric("sdhive_hive_sync_rerun_total");
    eprintln!(
        "{victim} struck mid-job: not ready in the gateway after {gone:?}; {reruns} requests run again; \
         the last answered {answered:?} after the strike"
    );
    assert!(reruns >= 1, "{victim} was running a request: it must have run again\n{}", c.logs());
    assert_eq!(gw.metric("sdhive_hive_jobs_worker_lost_total"), 0);
    assert_eq!(gw.metric("sdhive_hive_sync_worker_lost_total"), 0);
}

#[test]
fn a_node_cut_off_mid_job_costs_no_request_and_joins_again() {
    with_cluster(|c| {
        strike_mid_job(c, "n2", |c| c.net.set_link("n2", false));
        c.net.set_link("n2", true);
        let back = c.wait_ready(&["n2"], Duration::from_secs(30));
        eprintln!("n2 ready in the gateway {back:?} after its link came back");
        // Routed to again.
        let before = c.node("n2").served();
        let requests: Vec<(Route, Ask)> = [(Route::OpenAi, QUICK); 4].to_vec();
        let reference = generate(&c.node("n1"), Route::OpenAi, QUICK).unwrap();
        finish(send_all(&c.gw(), &requests), &reference, || c.logs());
        assert!(c.node("n2").served() > before, "n2 is not routed to again\n{}", c.logs());
    });
}

#[test]
fn a_node_killed_mid_job_costs_no_request_and_joins_again_when_restarted() {
    with_cluster(|c| {
        strike_mid_job(c, "n1", |c| {
            let node = c.slot("n1").take().unwrap();
            node.signal("-KILL");
            // Kept until the test ends: its log may be wanted.
            c.nodes.push(("n1 (killed)", Some(node)));
        });
        c.start_node("n1");
        let back = c.wait_ready(&["n1"], Duration::from_secs(60));
        eprintln!("restarted n1 ready in the gateway after {back:?}");
    });
}

#[test]
fn a_restarted_gateway_has_its_nodes_back_within_two_heartbeats() {
    with_cluster(|c| {
        let mut old = c.gateway.take().unwrap();
        old.signal("-KILL");
        assert!(old.wait_exit(Duration::from_secs(10)).is_some());
        let listening = c.start_gateway();
        let deadline = listening + Duration::from_secs(30);
        let back = loop {
            let ids: Vec<String> =
                c.gw().workers().iter().filter_map(|w| w["id"].as_str().map(String::from)).collect();
            if NODES.iter().all(|n| ids.iter().any(|id| id == n)) {
                break listening.elapsed();
            }
            assert!(Instant::now() < deadline, "the nodes did not come back: {ids:?}\n{}", c.logs());
            std::thread::sleep(Duration::from_millis(20));
        };
        eprintln!("both nodes registered with the restarted gateway {back:?} after it listened");
        let bound = Duration::from_secs(2 * HEARTBEAT_SECS) + Duration::from_millis(500);
        assert!(back <= bound, "{back:?} > {bound:?}\n{}", c.logs());
        c.wait_ready(&NODES, Duration::from_secs(10));
        let reference = generate(&c.node("n1"), Route::OpenAi, QUICK).unwrap();
        finish(send_all(&c.gw(), &[(Route::Native, QUICK), (Route::A1111, QUICK)]), &reference, || c.logs());
    });
}
