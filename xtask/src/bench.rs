//! `cargo xtask bench cpu`: the SD1.5 UNet step (256², CFG batch 2) and VAE decode (256²) on the CPU in f32,
//! sdhive (`sdhive-bench`, release build) next to diffusers (`xtask/bench/bench_cpu_diffusers.py`) when a Python
//! with diffusers is available, and the table of ratios against the project's targets.
//!
//! Both implementations build their networks once in their own process and then run one call at a time on
//! request, alternating (sdhive, diffusers, diffusers, sdhive, …), so they never run at the same time and slow
//! drifts in background load hit both alike. The ratio against diffusers measured in the same invocation is the
//! figure that means something; absolute times vary between machines and with load.

use crate::util::{cargo, workspace_root};
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

#[derive(Subcommand)]
pub enum Which {
    /// SD1.5 UNet step (256², CFG batch 2) and VAE decode (256²) on the CPU in f32 with random weights, and
    /// peak RSS, next to diffusers when a Python with diffusers is found.
    Cpu {
        /// Python with torch + diffusers (default: $SDHIVE_PYTHON, else `python3`).
        #[arg(long)]
        python: Option<String>,
        /// Timed calls of each network per implementation, after one warm-up call.
        #[arg(long, default_value_t = 5)]
        iters: usize,
    },
    /// Prepares the CUDA benchmark for a GPU machine without Rust (binaries, reference wheels, scripts in one
    /// folder); there, `bash FOLDER/run.sh OUT` prints sdhive next to diffusers eager and compiled.
    Cuda {
        /// Where the folder goes (default: target/bench-cuda).
        #[arg(long)]
        out: Option<std::path::PathBuf>,
        /// The Python whose pip downloads the reference wheels.
        #[arg(long, env = "SDHIVE_PYTHON", default_value = "python3")]
        python: String,
    },
    /// A gateway's cost per request against a node hive, and how fast it re-runs a lost node's jobs (CPU, loopback).
    Gateway {
        /// Requests per path, one client, after three warm-ups.
        #[arg(long, default_value_t = 40)]
        iters: usize,
    },
    /// Per-job overhead of the HTTP path over direct engine calls, and SSE progress latency.
    Serve {
        /// Jobs per path after one warm-up each.
        #[arg(long, default_value_t = 20)]
        iters: usize,
    },
}

pub fn run(which: Which) -> Result<()> {
    match which {
        Which::Cpu { python, iters } => cpu(python, iters),
        Which::Serve { iters } => crate::bench_serve::run(iters),
        Which::Gateway { iters } => crate::bench_serve::gateway(iters),
        Which::Cuda { out, python } => crate::bench_cuda::run(out, &python),
    }
}

/// Ratio targets (sdhive / diffusers) and the absolute peak-RSS target.
const UNET_TARGET: f64 = 0.90;
const VAE_TARGET: f64 = 0.85;
const RSS_TARGET_BYTES: f64 = 4.1e9;

/// The diffusers script's exit status for "torch/diffusers cannot be imported".
const NO_DIFFUSERS_EXIT: i32 = 3;

const WORK: [&str; 2] = ["unet", "vae"];

fn cpu(python: Option<String>, iters: usize) -> Result<()> {
    if iters == 0 {
        bail!("--iters must be at least 1");
    }
    let root = workspace_root();
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    cargo(&root, &["build", "--release", "-p", "sdhive-bench"])?;

    let exe = root.join("target/release/sdhive-bench");
    let mut ours = Server::start(
        "sdhive",
        Command::new(&exe).arg("--serve").env("RAYON_NUM_THREADS", threads.to_string()),
        &root,
    )?;
    let python = python
        .or_else(|| std::env::var("SDHIVE_PYTHON").ok().filter(|p| !p.is_empty()))
        .unwrap_or_else(|| "python3".into());
    let script = root.join("xtask/bench/bench_cpu_diffusers.py");
    let mut theirs = match Server::start(
        "diffusers",
        Command::new(&python).arg(&script).args(["--serve", "--threads", &threads.to_string()]),
        &root,
    ) {
        Ok(s) => Some(s),
        Err(e) => {
            eprintln!("xtask: no diffusers reference, showing sdhive's figures alone: {e:#}");
            eprintln!("xtask: (pass --python or set SDHIVE_PYTHON to a Python with torch and diffusers)");
            None
        }
    };

    // Warm-up: one untimed call of each network in each process.
    for work in WORK {
        ours.call(work)?;
        if let Some(t) = theirs.as_mut() {
            t.call(work)?;
        }
    }
    let mut ours_ms: [Vec<Value>; 2] = [Vec::new(), Vec::new()];
    let mut theirs_ms: [Vec<Value>; 2] = [Vec::new(), Vec::new()];
    for i in 0..iters {
        for (w, work) in WORK.iter().enumerate() {
            // Alternate who goes first, so neither always runs right after the other.
            let ours_first = i % 2 == 0;
            if ours_first {
                ours_ms[w].push(ours.call(work)?);
            }
            if let Some(t) = theirs.as_mut() {
                theirs_ms[w].push(t.call(work)?);
            }
            if !ours_first {
                ours_ms[w].push(ours.call(work)?);
            }
            let last = |v: &[Value]| v.last().and_then(|c| c.get("ms")).and_then(Value::as_f64);
            eprintln!(
                "xtask: round {i} {work}: sdhive {:.0} ms, diffusers {}",
                last(&ours_ms[w]).unwrap_or(f64::NAN),
                last(&theirs_ms[w]).map_or("—".into(), |ms| format!("{ms:.0} ms"))
            );
        }
    }
    let ours_report = ours.finish()?;
    let theirs_report = match theirs {
        Some(t) => Some(t.finish()?),
        None => None,
    };

    let summary = |calls: &[Vec<Value>; 2], report: &Value| -> Result<Value> {
        let mut s = serde_json::json!({
            "peak_rss_bytes": report.get("peak_rss_bytes"),
            "report": report,
        });
        for (w, work) in WORK.iter().enumerate() {
            let ms: Vec<f64> = calls[w].iter().filter_map(|c| c.get("ms").and_then(Value::as_f64)).collect();
            let cpu: Vec<f64> =
                calls[w].iter().filter_map(|c| c.get("cpu_ms").and_then(Value::as_f64)).collect();
            s[work] = serde_json::json!({
                "ms": ms,
                "cpu_ms": cpu,
                "median_ms": median(&ms),
                "min_ms": ms.iter().copied().fold(f64::INFINITY, f64::min),
            });
        }
        Ok(s)
    };
    let ours_summary = summary(&ours_ms, &ours_report)?;
    let theirs_summary = match &theirs_report {
        Some(r) => Some(summary(&theirs_ms, r)?),
        None => None,
    };

    let out_dir = root.join("target/bench");
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let combined = serde_json::json!({
        "threads": threads,
        "iters": iters,
        "sdhive": ours_summary,
        "diffusers": theirs_summary,
    });
    let out_file = out_dir.join("cpu.json");
    std::fs::write(&out_file, serde_json::to_string_pretty(&combined)?)
        .with_context(|| format!("writing {}", out_file.display()))?;

    print_table(&ours_summary, theirs_summary.as_ref(), threads, iters)?;
    println!("\nraw figures (every call, wall and CPU time, min and median): {}", out_file.display());
    Ok(())
}

/// A benchmark process speaking the `--serve` line protocol: one command per line on stdin, one JSON line
/// per answer on stdout; its stderr goes straight to ours.
struct Server {
    name: &'static str,
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Server {
    fn start(name: &'static str, cmd: &mut Command, root: &Path) -> Result<Self> {
        eprintln!("xtask: starting {name}: {cmd:?}");
        let mut child = cmd
            .current_dir(root)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("cannot start {name} ({cmd:?})"))?;
        let stdin = child.stdin.take().context("child stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("child stdout")?);
        let mut server = Self { name, child, stdin, stdout };
        let ready = server.read()?;
        if ready.get("ready").and_then(Value::as_bool) != Some(true) {
            bail!("{name} did not report ready: {ready}");
        }
        Ok(server)
    }

    fn read(&mut self) -> Result<Value> {
        let mut line = String::new();
        let n = self.stdout.read_line(&mut line).with_context(|| format!("reading from {}", self.name))?;
        if n == 0 {
            let status = self.child.wait().with_context(|| format!("waiting for {}", self.name))?;
            if status.code() == Some(NO_DIFFUSERS_EXIT) {
                bail!("{} cannot import torch/diffusers", self.name);
            }
            bail!("{} exited ({status}) without answering", self.name);
        }
        serde_json::from_str(line.trim())
            .with_context(|| format!("parsing {}'s answer `{}`", self.name, line.trim()))
    }

    fn call(&mut self, cmd: &str) -> Result<Value> {
        writeln!(self.stdin, "{cmd}")
            .and_then(|()| self.stdin.flush())
            .with_context(|| format!("sending `{cmd}` to {}", self.name))?;
        self.read()
    }

    /// The final report (peak RSS), then a clean exit.
    fn finish(mut self) -> Result<Value> {
        let report = self.call("report")?;
        writeln!(self.stdin, "quit").with_context(|| format!("stopping {}", self.name))?;
        let status = self.child.wait().with_context(|| format!("waiting for {}", self.name))?;
        if !status.success() {
            bail!("{} exited with {status}", self.name);
        }
        Ok(report)
    }
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

fn median_ms(summary: &Value, work: &str) -> Option<f64> {
    summary.get(work)?.get("median_ms")?.as_f64()
}

fn peak_rss(summary: &Value) -> Option<f64> {
    summary.get("peak_rss_bytes")?.as_f64()
}

fn print_table(ours: &Value, theirs: Option<&Value>, threads: usize, iters: usize) -> Result<()> {
    let header = ["work", "sdhive", "diffusers", "ratio", "target", "met?"];
    let mut rows: Vec<[String; 6]> = Vec::new();
    let timed = [
        ("SD1.5 UNet step, 256² (latent 32²), CFG batch 2", "unet", UNET_TARGET),
        ("SD1.5 VAE decode, 256²", "vae", VAE_TARGET),
    ];
    for (label, key, target) in timed {
        let a = median_ms(ours, key).with_context(|| format!("no {key} timings from sdhive-bench"))?;
        let b = theirs.and_then(|t| median_ms(t, key));
        let ratio = b.map(|b| a / b);
        rows.push([
            label.into(),
            format!("{a:.0} ms"),
            b.map_or("—".into(), |b| format!("{b:.0} ms")),
            ratio.map_or("—".into(), |r| format!("{r:.2}×")),
            format!("≤ {target:.2}×"),
            ratio.map_or("n/a".into(), |r| yes_no(r <= target)),
        ]);
    }
    let a = peak_rss(ours).context("no peak RSS from sdhive-bench")?;
    let b = theirs.and_then(peak_rss);
    rows.push([
        "peak RSS (UNet + VAE built, f32)".into(),
        format!("{:.2} GB", a / 1e9),
        b.map_or("—".into(), |b| format!("{:.2} GB", b / 1e9)),
        b.map_or("—".into(), |b| format!("{:.2}×", a / b)),
        format!("≤ {:.1} GB", RSS_TARGET_BYTES / 1e9),
        yes_no(a <= RSS_TARGET_BYTES),
    ]);

    println!("\nCPU, f32, {threads} threads, median of {iters} alternating calls each (GB = 10⁹ bytes):\n");
    let width = |i: usize| {
        rows.iter()
            .map(|r| r[i].chars().count())
            .chain(std::iter::once(header[i].chars().count()))
            .max()
            .unwrap_or(0)
    };
    let widths: Vec<usize> = (0..header.len()).map(width).collect();
    let line = |cells: &[String]| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c}{}", " ".repeat(w - c.chars().count())))
            .collect();
        println!("| {} |", padded.join(" | "));
    };
    line(&header.map(String::from));
    println!("|{}|", widths.iter().map(|w| "-".repeat(w + 2)).collect::<Vec<_>>().join("|"));
    for r in &rows {
        line(r);
    }
    Ok(())
}

fn yes_no(ok: bool) -> String {
    if ok { "yes" } else { "no" }.into()
}
