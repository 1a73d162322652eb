//! A CPU worker built from its command line (`serve …`, parsed as `sd-worker-cpu` parses it) and served in this
//! process on loopback, for the worker's integration tests; and the fixture files they copy.

#![allow(dead_code)]

use clap::Parser;
use serde_json::Value;
use shared_worker::Backend;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// The repository's `tests/fixtures`.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// `serve --port 0 --models-dir <models> --hash-cache <hash_file> <extra…>`, parsed.
pub fn serve_args(models: &Path, hash_file: &Path, extra: &[&str]) -> sdhive_worker::serve::ServeArgs {
    let mut argv: Vec<String> =
        ["sd-worker-cpu", "serve", "--port", "0", "--models-dir"].iter().map(|s| s.to_string()).collect();
    argv.push(models.display().to_string());
    argv.extend(["--hash-cache".to_string(), hash_file.display().to_string()]);
    argv.extend(extra.iter().map(|s| s.to_string()));
    match sdhive_worker::cli::Cli::try_parse_from(argv).unwrap().command {
        sdhive_worker::cli::Command::Serve(args) => args,
        other => panic!("expected serve, got {other:?}"),
    }
}

pub struct Worker {
    pub base: String,
    pub client: reqwest::Client,
    stop: Option<oneshot::Sender<()>>,
    handle: tokio::task::JoinHandle<Result<(), sdhive_server::ServeError>>,
    _hashes: tempfile::TempDir,
}

impl Worker {
    /// Serves the library in `models` (hashes cached in a fresh folder) and waits until it is ready.
    pub async fn start(models: &Path, extra: &[&str]) -> Worker {
        let hashes = tempfile::tempdir().unwrap();
        let args = serve_args(models, &hashes.path().join("hashes.json"), extra);
        let prepared = sdhive_worker::serve::prepare(Backend::Cpu, &args).expect("prepare");
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = oneshot::channel::<()>();
        let handle =
            tokio::spawn(sdhive_server::serve(listener, prepared.config, prepared.startup, None, async {
                let _ = rx.await;
            }));
        let worker = Worker { base, client: reqwest::Client::new(), stop: Some(tx), handle, _hashes: hashes };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !matches!(worker.client.get(worker.url("/ready")).send().await, Ok(r) if r.status() == 200) {
            assert!(!worker.handle.is_finished(), "the worker stopped while loading");
            assert!(Instant::now() < deadline, "never ready");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        worker
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub async fn get(&self, path: &str) -> Value {
        let r = self.client.get(self.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 200, "GET {path}");
        r.json().await.unwrap()
    }

    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(60), self.handle).await;
    }
}
