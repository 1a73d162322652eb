//! Running managed workers as child processes: spawning them (argv only, never a shell) so that they die with
//! the hive, logging their output under their worker id, restarting them with exponential backoff when they
//! exit (not those started on demand: the hive starts another when it needs one), giving up after a crash
//! loop, and stopping them (SIGTERM, then SIGKILL after a grace period).

use crate::plan::PlannedWorker;
use crate::registry::{OnDemand, WorkerEntry, WorkerStatus};
use crate::{router, Hive};
use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, watch, Notify};

/// Delay before restart number `n` (1-based consecutive failures): `min(initial · 2^(n−1), max)`.
pub fn backoff(n: u32, initial: Duration, max: Duration) -> Duration {
    let factor = 2f64.powi(n.saturating_sub(1).min(62) as i32);
    Duration::try_from_secs_f64(initial.as_secs_f64() * factor).unwrap_or(max).min(max)
}

/// Failure times within the crash-loop window.
#[derive(Debug, Default)]
pub struct CrashLoop {
    failures: VecDeque<Instant>,
}

impl CrashLoop {
    /// Records a failure; `true` when `limit` failures fell within `window`.
    pub fn record(&mut self, at: Instant, window: Duration, limit: u32) -> bool {
        self.failures.push_back(at);
        while self.failures.front().is_some_and(|&t| at.saturating_duration_since(t) > window) {
            self.failures.pop_front();
        }
        self.failures.len() >= limit.max(1) as usize
    }
}

type SpawnRequest = (Command, oneshot::Sender<std::io::Result<Child>>);

/// Spawns children from one long-lived thread. `PR_SET_PDEATHSIG` fires when the *thread* that forked the
/// child exits, not the process; async runtimes may retire threads, this one lives as long as the hive.
pub struct Spawner {
    tx: Mutex<mpsc::Sender<SpawnRequest>>,
}

impl Spawner {
    pub fn start() -> Spawner {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("hive-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .map_err(|e| tracing::error!("cannot start the spawner thread: {e}"))
            .ok();
        Spawner { tx: Mutex::new(tx) }
    }

    pub async fn spawn(&self, cmd: Command) -> std::io::Result<Child> {
        let (reply, rx) = oneshot::channel();
        let sent = self.tx.lock().unwrap_or_else(|p| p.into_inner()).send((cmd, reply));
        if sent.is_err() {
            return Err(std::io::Error::other("the spawner thread is gone"));
        }
        rx.await.map_err(|_| std::io::Error::other("the spawner thread is gone"))?
    }
}

/// Makes the child die with the hive and keeps it out of the terminal's process group (so Ctrl-C reaches
/// only the hive, which then stops the workers in order).
fn harden(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    cmd.process_group(0);
    #[cfg(target_os = "linux")]
    {
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: the closure runs in the forked child before exec, where only async-signal-safe functions
        // may be called. It calls prctl(2) and getppid(2), both async-signal-safe, touches no locks, and does
        // not allocate (the error is built from a raw errno).
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The hive may have died between fork and prctl; then nobody would ever signal us.
                if libc::getppid() != parent {
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
    }
}

/// Handle kept by the hive to stop a supervised worker.
pub struct Handle {
    pub stop: watch::Sender<bool>,
    /// Kills the running child (SIGKILL) so that it is restarted: for a worker that stopped heartbeating.
    /// `notify_waiters` only reaches a child being waited on, so a stale kill never hits its successor.
    pub kill: Arc<Notify>,
    pub task: tokio::task::JoinHandle<()>,
}

/// What a managed worker runs.
#[derive(Debug, Clone)]
pub struct Spec {
    pub worker: PlannedWorker,
    /// `--port`; 0 lets the worker choose (it reports the port in its registration).
    pub port: u16,
    /// Started on demand (for this model, for this reason): not restarted when it exits.
    pub on_demand: Option<OnDemand>,
}

impl Spec {
    pub fn planned(worker: PlannedWorker, port: u16) -> Spec {
        Spec { worker, port, on_demand: None }
    }
}

fn command(hive: &Hive, spec: &Spec) -> Command {
    let w = &spec.worker;
    let mut cmd = Command::new(&w.binary);
    cmd.arg("serve");
    // Without `--model` a worker loads the first checkpoint of its models dirs.
    if let Some(model) = &w.model {
        cmd.arg("--model").arg(model);
    }
    cmd.arg("--device")
        .arg(w.device_index.to_string())
        .arg("--host")
        .arg("127.0.0.1")
        .arg("--port")
        .arg(spec.port.to_string())
        .arg("--worker-id")
        .arg(&w.worker_id)
        .arg("--callback-url")
        .arg(&hive.callback_url);
    for root in hive.config.worker_roots() {
        cmd.arg("--model-root").arg(root);
    }
    // Every worker gets the whole library, so any of them can switch to any of its checkpoints.
    for dir in &hive.config.models_dirs {
        cmd.arg("--models-dir").arg(dir);
    }
    for dir in &hive.config.vae_dirs {
        cmd.arg("--vae-dir").arg(dir);
    }
    for dir in &hive.config.lora_dirs {
        cmd.arg("--lora-dir").arg(dir);
    }
    for dir in &hive.config.upscaler_dirs {
        cmd.arg("--upscaler-dir").arg(dir);
    }
    for dir in &hive.config.embeddings_dirs {
        cmd.arg("--embeddings-dir").arg(dir);
    }
    if let Some(styles) = &hive.config.styles_file {
        cmd.arg("--styles-file").arg(styles);
    }
    // Always passed, so that a PREVIEW variable in the hive's environment cannot change it behind its back.
    cmd.arg("--preview").arg(hive.config.preview.name());
    if hive.config.no_t5 {
        cmd.arg("--no-t5");
    }
    // Secrets go through the environment: argv is readable by every user in /proc/<pid>/cmdline.
    cmd.env("WORKER_TOKEN", &hive.token);
    match &hive.config.worker_api_key {
        Some(key) => cmd.env("API_KEY", key),
        None => cmd.env_remove("API_KEY"),
    };
    // The hive's clients' Basic credentials are the hive's to check: a worker that required them would lock the
    // hive out (it authenticates with the worker API key).
    cmd.env_remove("API_AUTH");
    if std::env::var_os("RUST_LOG").is_none() {
        cmd.env("RUST_LOG", "info");
    }
    cmd.env("NO_COLOR", "1");
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    harden(&mut cmd);
    cmd
}

/// Removes terminal colour codes that a worker may print even into a pipe.
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn pipe_lines(hive: Arc<Hive>, id: String, reader: impl std::io::Read + Send + 'static, keep: bool) {
    let name = format!("log-{id}");
    let spawned = std::thread::Builder::new().name(name.clone()).spawn(move || {
        for line in BufReader::new(reader).lines() {
            let Ok(line) = line else { break };
            let line = strip_ansi(&line);
            tracing::info!(target: "worker", worker = %id, "{line}");
            if keep {
                if let Some(w) = hive.lock().workers.get_mut(&id) {
                    w.push_stderr(line);
                }
            }
        }
    });
    if let Err(e) = spawned {
        tracing::warn!("cannot start the {name} thread: {e}");
    }
}

/// Adds the managed worker to the table and starts supervising it.
pub fn start(hive: &Arc<Hive>, spec: Spec) -> Handle {
    let w = &spec.worker;
    let mut entry = WorkerEntry::managed(&w.worker_id, w.backend.name(), w.device_index, w.model.as_deref());
    {
        let mut state = hive.lock();
        // What it will report once loaded: routing can count on it before it registers.
        entry.planned_source = match &w.model {
            Some(m) => Some(crate::models::planned_source(&state.catalog, m)),
            None => state.catalog.checkpoints.first().map(|c| c.path.to_string_lossy().into_owned()),
        };
        entry.loaded = entry.planned_source.clone();
        entry.on_demand = spec.on_demand.clone();
        state.workers.insert(w.worker_id.clone(), entry);
    }
    let (stop, stop_rx) = watch::channel(false);
    let kill = Arc::new(Notify::new());
    let task = tokio::spawn(supervise(hive.clone(), spec, stop_rx, kill.clone()));
    Handle { stop, kill, task }
}

fn set_status(hive: &Hive, id: &str, f: impl FnOnce(&mut WorkerEntry)) {
    if let Some(w) = hive.lock().workers.get_mut(id) {
        f(w);
    }
}

async fn supervise(hive: Arc<Hive>, spec: Spec, mut stop: watch::Receiver<bool>, kill: Arc<Notify>) {
    let id = spec.worker.worker_id.clone();
    let c = &hive.config;
    let initial = Duration::from_secs_f64(c.restart_initial_secs);
    let max = Duration::from_secs_f64(c.restart_max_secs);
    let reset_after = Duration::from_secs_f64(c.restart_reset_secs);
    let window = Duration::from_secs_f64(c.crash_loop_window_secs);
    let mut crash_loop = CrashLoop::default();
    let mut consecutive = 0u32;
    loop {
        if *stop.borrow() {
            break;
        }
        let started = Instant::now();
        let outcome = match hive.spawner.spawn(command(&hive, &spec)).await {
            Ok(mut child) => {
                let pid = child.id();
                tracing::info!(worker = %id, pid, binary = %spec.worker.binary.display(), "worker started");
                set_status(&hive, &id, |w| {
                    w.pid = Some(pid);
                    w.status = WorkerStatus::Starting;
                    w.registration = None;
                });
                if let Some(out) = child.stdout.take() {
                    pipe_lines(hive.clone(), id.clone(), out, false);
                }
                if let Some(err) = child.stderr.take() {
                    pipe_lines(hive.clone(), id.clone(), err, true);
                }
                run_child(&hive, &id, child, &mut stop, &kill).await
            }
            Err(e) => Err(format!("cannot start {}: {e}", spec.worker.binary.display())),
        };
        let stopping = *stop.borrow();
        let why = match &outcome {
            Ok(status) => format!("exited: {status}"),
            Err(e) => e.clone(),
        };
        // A worker started on demand is not restarted: the hive starts another when it needs one.
        let ends = stopping || spec.on_demand.is_some();
        let starts = {
            let mut state = hive.lock();
            let mut epoch = 0;
            // Unroutable first, so the re-queued jobs are not handed straight back to the dead process.
            if let Some(w) = state.workers.get_mut(&id) {
                epoch = w.epoch;
                w.registration = None;
                w.pid = None;
                w.last_exit = Some(why.clone());
                w.status = if ends { WorkerStatus::Stopped } else { WorkerStatus::Starting };
                if let Some(o) = w.on_demand.as_mut().filter(|o| o.ended.is_none()) {
                    let failed = !stopping;
                    let what = if failed { format!("it {why}") } else { "stopped".to_string() };
                    o.ended = Some((Instant::now(), what, failed));
                }
            }
            router::worker_lost(&hive, &mut state, &id, epoch, &why)
        };
        router::start_dispatches(&hive, starts);
        if stopping {
            tracing::info!(worker = %id, "worker stopped");
            break;
        }
        if ends {
            tracing::warn!(worker = %id, "worker started on demand {why}; not restarted");
            break;
        }
        tracing::warn!(worker = %id, "worker {why}");
        let now = Instant::now();
        if now.duration_since(started) >= reset_after {
            consecutive = 0;
        }
        consecutive += 1;
        if crash_loop.record(now, window, c.crash_loop_failures) {
            tracing::error!(worker = %id, failures = c.crash_loop_failures, "crash loop: giving up on this worker");
            set_status(&hive, &id, |w| w.status = WorkerStatus::Failed);
            break;
        }
        let delay = backoff(consecutive, initial, max);
        tracing::info!(worker = %id, delay_secs = delay.as_secs_f64(), "restarting after backoff");
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = stop.wait_for(|s| *s) => {
                set_status(&hive, &id, |w| w.status = WorkerStatus::Stopped);
                break;
            }
        }
        set_status(&hive, &id, |w| w.restarts += 1);
        hive.lock().metrics.worker_restarts += 1;
    }
}

/// Waits for the child; on a stop request, SIGTERM (the worker drains itself) and SIGKILL after the grace.
async fn run_child(
    hive: &Hive,
    id: &str,
    child: Child,
    stop: &mut watch::Receiver<bool>,
    kill: &Notify,
) -> Result<std::process::ExitStatus, String> {
    let pid = child.id();
    let child = Arc::new(Mutex::new(child));
    let waiter = {
        let child = child.clone();
        // `try_wait` polling keeps the Child reachable for `kill`; the blocking `wait` would hold its lock.
        tokio::spawn(async move {
            loop {
                let status = child.lock().unwrap_or_else(|p| p.into_inner()).try_wait();
                match status {
                    Ok(Some(s)) => return Ok(s),
                    Ok(None) => tokio::time::sleep(Duration::from_millis(100)).await,
                    Err(e) => return Err(format!("cannot wait for the worker: {e}")),
                }
            }
        })
    };
    let mut waiter = std::pin::pin!(waiter);
    let killed = tokio::select! {
        r = &mut waiter => return r.unwrap_or_else(|e| Err(e.to_string())),
        _ = stop.wait_for(|s| *s) => false,
        _ = kill.notified() => true,
    };
    if killed {
        tracing::warn!(worker = %id, pid, "no heartbeat for too long: killing the worker to restart it");
        if let Err(e) = child.lock().unwrap_or_else(|p| p.into_inner()).kill() {
            tracing::warn!(worker = %id, "cannot kill: {e}");
        }
        let status = waiter.await.unwrap_or_else(|e| Err(e.to_string()))?;
        return Err(format!("killed after missing heartbeats ({status})"));
    }
    tracing::info!(worker = %id, pid, "stopping worker (SIGTERM)");
    set_status(hive, id, |w| w.status = WorkerStatus::Draining);
    {
        let mut c = child.lock().unwrap_or_else(|p| p.into_inner());
        if let Ok(None) = c.try_wait() {
            // SAFETY: plain kill(2). Under the lock nobody else reaps the child, and `try_wait` just said it
            // has not exited, so the pid is still this child's and cannot have been reused.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGTERM);
            }
        }
    }
    let grace = Duration::from_secs_f64(hive.config.stop_grace_secs);
    match tokio::time::timeout(grace, &mut waiter).await {
        Ok(r) => r.unwrap_or_else(|e| Err(e.to_string())),
        Err(_) => {
            tracing::warn!(worker = %id, pid, "worker ignored SIGTERM; SIGKILL");
            if let Err(e) = child.lock().unwrap_or_else(|p| p.into_inner()).kill() {
                tracing::warn!(worker = %id, "cannot kill: {e}");
            }
            waiter.await.unwrap_or_else(|e| Err(e.to_string()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let s = Duration::from_secs;
        let delays: Vec<Duration> = (1..=8).map(|n| backoff(n, s(1), s(60))).collect();
        assert_eq!(delays, [s(1), s(2), s(4), s(8), s(16), s(32), s(60), s(60)]);
        assert_eq!(backoff(1000, s(1), s(60)), s(60), "no overflow on long runs");
        assert_eq!(backoff(3, Duration::from_millis(250), s(60)), Duration::from_secs(1));
    }

    #[test]
    fn crash_loop_needs_the_failures_within_the_window() {
        let w = Duration::from_secs(60);
        let t0 = Instant::now();
        let mut c = CrashLoop::default();
        assert!(!c.record(t0, w, 3));
        assert!(!c.record(t0 + Duration::from_secs(10), w, 3));
        assert!(c.record(t0 + Duration::from_secs(20), w, 3));
        let mut spread = CrashLoop::default();
        for i in 0..10 {
            assert!(!spread.record(t0 + Duration::from_secs(40 * i), w, 3), "failure {i}");
        }
    }

    fn worker_args(config: crate::config::HiveConfig) -> Vec<String> {
        let hive = Hive::new(config, "t".into(), "http://hive".into()).unwrap();
        let worker = PlannedWorker {
            worker_id: "w".into(),
            backend: shared_worker::Backend::Cpu,
            device_index: 0,
            model: None,
            binary: "sd-worker-cpu".into(),
        };
        let cmd = command(&hive, &Spec::planned(worker, 0));
        cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect()
    }

    #[test]
    fn workers_get_the_hives_preview_mode() {
        let args = worker_args(crate::config::HiveConfig {
            preview: sdhive_engine::PreviewMode::Off,
            ..crate::config::HiveConfig::default()
        });
        let at = args.iter().position(|a| a == "--preview").expect("--preview passed");
        assert_eq!(args.get(at + 1).map(String::as_str), Some("off"), "{args:?}");
        assert!(!args.iter().any(|a| a == "--no-t5"), "{args:?}");
    }

    #[test]
    fn workers_leave_t5_out_when_the_hive_says_so() {
        let args =
            worker_args(crate::config::HiveConfig { no_t5: true, ..crate::config::HiveConfig::default() });
        assert!(args.iter().any(|a| a == "--no-t5"), "{args:?}");
    }

    #[test]
    fn ansi_codes_are_stripped() {
        assert_eq!(strip_ansi("\u{1b}[2m2024\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m hi"), "2024  INFO hi");
    }
}
