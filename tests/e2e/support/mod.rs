//! What the hive's end-to-end tests share: a minimal HTTP/1.1 client (no client library among the test
//! dependencies), polling with deadlines, child processes killed when a test ends, and the hive API calls
//! every test makes; `netns`, hosts in network namespaces for the cluster tests. Each test binary uses a part
//! of it.
#![allow(dead_code)]

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub mod netns;

/// The registration token the tests give their hives.
pub const TOKEN: &str = "test-token-123";

// ---- a minimal HTTP/1.1 client (no client library among the test dependencies) ----

pub struct Reply {
    pub status: u16,
    pub head: String,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

pub fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = body.windows(2).position(|w| w == b"\r\n") else { return out };
        let size =
            std::str::from_utf8(&body[..eol]).ok().and_then(|s| usize::from_str_radix(s.trim(), 16).ok());
        let Some(size) = size.filter(|&s| s > 0) else { return out };
        let start = eol + 2;
        let end = (start + size).min(body.len());
        out.extend_from_slice(&body[start..end]);
        body = body.get(end + 2..).unwrap_or(&[]);
    }
}

pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> Reply {
    try_request(addr, method, path, headers, body, Duration::from_secs(120))
        .unwrap_or_else(|e| panic!("{method} {addr}{path}: {e}"))
}

pub fn try_request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&Value>,
    timeout: Duration,
) -> std::io::Result<Reply> {
    // Bounded like the read (a host cut off from the network never answers the SYN); every address of a name is
    // tried, as `TcpStream::connect` does.
    let mut last = std::io::Error::from(std::io::ErrorKind::InvalidInput);
    let mut stream = None;
    for to in std::net::ToSocketAddrs::to_socket_addrs(addr)? {
        match TcpStream::connect_timeout(&to, timeout) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = e,
        }
    }
    let mut s = stream.ok_or(last)?;
    s.set_read_timeout(Some(timeout))?;
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() || method == "POST" {
        req.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len()));
    }
    req.push_str("\r\n");
    req.push_str(&body);
    s.write_all(req.as_bytes())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or(std::io::ErrorKind::UnexpectedEof)?;
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut body = raw[split + 4..].to_vec();
    if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    Ok(Reply { status, head, body })
}

pub fn get(addr: &str, path: &str) -> Reply {
    request(addr, "GET", path, &[], None)
}

pub fn post(addr: &str, path: &str, body: &Value) -> Reply {
    request(addr, "POST", path, &[], Some(body))
}

/// Polls `f` until it returns `Some`, or fails naming `what`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

// ---- processes ----

/// A child process killed (SIGKILL) when the test ends, whatever happens; its stderr is collected.
pub struct Proc {
    pub child: Child,
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    pub fn spawn(mut cmd: Command) -> Proc {
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
        // Stray SDHIVE_* settings of the developer's shell must not change what the test runs.
        for (k, _) in std::env::vars() {
            if k.starts_with("SDHIVE_") {
                cmd.env_remove(k);
            }
        }
        let mut child = cmd.spawn().expect("cannot spawn");
        let log = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().expect("stderr is piped");
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        Proc { child, log }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// The address from the `… listening on http://ADDR` line.
    pub fn wait_listening(&self, marker: &str) -> String {
        wait_for(&format!("`{marker}` in the log"), Duration::from_secs(60), || {
            self.log.lock().unwrap().iter().find_map(|l| l.split(marker).nth(1).map(|a| a.trim().to_string()))
        })
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill").args([sig, &self.pid().to_string()]).status().map(|s| s.success());
        assert!(matches!(ok, Ok(true)), "kill {sig} {} failed", self.pid());
    }

    /// Waits for exit; `None` on timeout.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Copies `from` (a file, or a folder with everything below it) to `to`: the fixture models a test's models dir
/// holds (the catalogue refuses symlinks that lead outside it).
pub fn copy_tree(from: &std::path::Path, to: &std::path::Path) {
    if from.is_dir() {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            copy_tree(&entry.path(), &to.join(entry.file_name()));
        }
    } else {
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(from, to).unwrap();
    }
}

pub fn workers(addr: &str) -> Vec<Value> {
    get(addr, "/v1/workers").json()["workers"].as_array().cloned().unwrap_or_default()
}

/// The first worker in `state`, once there is one.
pub fn wait_worker(addr: &str, state: &str, timeout: Duration) -> Value {
    wait_for(&format!("a {state} worker"), timeout, || {
        workers(addr).into_iter().find(|w| w["state"] == state)
    })
}

pub fn wait_job(addr: &str, id: &str, timeout: Duration) -> Value {
    wait_for(&format!("job {id} to finish"), timeout, || {
        let job = get(addr, &format!("/v1/jobs/{id}")).json();
        matches!(job["state"].as_str(), Some("succeeded" | "failed" | "cancelled")).then_some(job)
    })
}

pub fn submit(addr: &str, body: &Value) -> String {
    let r = post(addr, "/v1/jobs", body);
    assert_eq!(r.status, 202, "{}", r.text());
    assert!(r.head.to_ascii_lowercase().contains("location: /v1/jobs/job_"), "{}", r.head);
    r.json()["id"].as_str().unwrap().to_string()
}

/// A base64 PNG's size and pixels (its text chunks, which name the route and time, left out).
pub fn pixels(b64: &str) -> (u32, u32, Vec<u8>) {
    use base64::Engine;
    let bytes = base64::engine::general_purpose::STANDARD.decode(b64).expect("base64");
    png_pixels(&bytes)
}

pub fn png_pixels(bytes: &[u8]) -> (u32, u32, Vec<u8>) {
    let mut reader = png::Decoder::new(std::io::Cursor::new(bytes)).read_info().expect("png");
    let mut buf = vec![0; reader.output_buffer_size().expect("size")];
    let info = reader.next_frame(&mut buf).expect("frame");
    buf.truncate(info.buffer_size());
    (info.width, info.height, buf)
}

pub fn is_dead(pid: u64) -> bool {
    // A zombie is dead too; it only waits for its new parent to reap it.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat.rsplit(')').next().and_then(|r| r.split_whitespace().next()) == Some("Z"),
    }
}
