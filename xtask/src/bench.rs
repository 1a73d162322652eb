//! `cargo xtask bench cpu`: runs `sdhive-bench` (release build) and then, when a Python with diffusers is
//! available, `xtask/bench/bench_cpu_diffusers.py` on the same work, one after the other so neither disturbs the
//! other's timings, and prints both side by side with the ratios and the project's targets. Absolute times vary
//! between machines and with background load; the ratio against diffusers measured in the same invocation is the
//! figure that means something.

use crate::util::{cargo, workspace_root};
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Stdio};

#[derive(Subcommand)]
pub enum Which {
    /// SD1.5 UNet step (256², CFG batch 2) and VAE decode (256²) on the CPU in f32 with random weights, and
    /// peak RSS, next to diffusers when a Python with diffusers is found.
    Cpu {
        /// Python with torch + diffusers (default: $SDHIVE_PYTHON, else `python3`).
        #[arg(long)]
        python: Option<String>,
        /// Timed calls of each network, after one warm-up call.
        #[arg(long, default_value_t = 3)]
        iters: usize,
    },
    /// Per-job overhead of the HTTP path over direct `Engine::generate`, and SSE progress latency, on
    /// loopback with the tiny fixture model.
    Serve {
        /// Timed runs of each path, after one warm-up run.
        #[arg(long, default_value_t = 20)]
        iters: usize,
    },
}

pub fn run(which: Which) -> Result<()> {
    match which {
        Which::Cpu { python, iters } => cpu(python, iters),
        Which::Serve { iters } => crate::bench_serve::run(iters),
    }
}

/// Ratio targets (ours / diffusers) and the absolute peak-RSS target.
const UNET_TARGET: f64 = 0.90;
const VAE_TARGET: f64 = 0.85;
const RSS_TARGET_BYTES: f64 = 4.1e9;

const DIFFUSERS_PREFIX: &str = "SDHIVE_DIFFUSERS_JSON ";
/// The script's exit status for "torch/diffusers cannot be imported".
const NO_DIFFUSERS_EXIT: i32 = 3;

fn cpu(python: Option<String>, iters: usize) -> Result<()> {
    if iters == 0 {
        bail!("--iters must be at least 1");
    }
    let root = workspace_root();
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    cargo(&root, &["build", "--release", "-p", "sdhive-bench"])?;

    let ours = run_sdhive(&root, iters, threads)?;
    let python = python
        .or_else(|| std::env::var("SDHIVE_PYTHON").ok().filter(|p| !p.is_empty()))
        .unwrap_or_else(|| "python3".into());
    let theirs = match run_diffusers(&root, &python, iters, threads) {
        Ok(v) => Some(v),
        Err(e) => {
            eprintln!("xtask: no diffusers reference, showing sdhive's figures alone: {e:#}");
            None
        }
    };

    let out_dir = root.join("target/bench");
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let combined = serde_json::json!({ "threads": threads, "sdhive": ours, "diffusers": theirs });
    let out_file = out_dir.join("cpu.json");
    std::fs::write(&out_file, serde_json::to_string_pretty(&combined)?)
        .with_context(|| format!("writing {}", out_file.display()))?;

    print_table(&ours, theirs.as_ref(), threads)?;
    println!("\nraw figures: {}", out_file.display());
    Ok(())
}

fn run_sdhive(root: &Path, iters: usize, threads: usize) -> Result<Value> {
    let exe = root.join("target/release/sdhive-bench");
    eprintln!("xtask: {} --iters {iters}", exe.display());
    let out = Command::new(&exe)
        .args(["--iters", &iters.to_string()])
        .env("RAYON_NUM_THREADS", threads.to_string())
        .current_dir(root)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", exe.display()))?;
    if !out.status.success() {
        bail!("{} failed ({})", exe.display(), out.status);
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .context("sdhive-bench printed no JSON")?;
    serde_json::from_str(line).with_context(|| format!("parsing sdhive-bench output `{line}`"))
}

fn run_diffusers(root: &Path, python: &str, iters: usize, threads: usize) -> Result<Value> {
    let script = root.join("xtask/bench/bench_cpu_diffusers.py");
    eprintln!("xtask: {python} {} --iters {iters} --threads {threads}", script.display());
    let out = Command::new(python)
        .arg(&script)
        .args(["--iters", &iters.to_string(), "--threads", &threads.to_string()])
        .current_dir(root)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("cannot start `{python}` (pass --python or set SDHIVE_PYTHON)"))?;
    match out.status.code() {
        Some(0) => {}
        Some(NO_DIFFUSERS_EXIT) => {
            bail!("`{python}` cannot import torch/diffusers (pass --python or set SDHIVE_PYTHON)")
        }
        _ => bail!("{} failed under `{python}` ({})", script.display(), out.status),
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix(DIFFUSERS_PREFIX))
        .with_context(|| format!("{} printed no `{}` line", script.display(), DIFFUSERS_PREFIX.trim()))?;
    serde_json::from_str(line).with_context(|| format!("parsing the diffusers report `{line}`"))
}

fn median_ms(report: &Value, work: &str) -> Option<f64> {
    report.get(work)?.get("median_ms")?.as_f64()
}

fn peak_rss(report: &Value) -> Option<f64> {
    report.get("peak_rss_bytes")?.as_f64()
}

fn print_table(ours: &Value, theirs: Option<&Value>, threads: usize) -> Result<()> {
    let header = ["work", "sdhive", "diffusers", "ratio", "target", "met?"];
    let mut rows: Vec<[String; 6]> = Vec::new();
    let timed = [
        ("SD1.5 UNet step, 256² (latent 32²), CFG batch 2", "unet_step_b2", UNET_TARGET),
        ("SD1.5 VAE decode, 256²", "vae_decode", VAE_TARGET),
    ];
    for (label, key, target) in timed {
        let a = median_ms(ours, key).with_context(|| format!("sdhive-bench report lacks {key}"))?;
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
    let a = peak_rss(ours).context("sdhive-bench report lacks peak_rss_bytes")?;
    let b = theirs.and_then(peak_rss);
    rows.push([
        "peak RSS (UNet + VAE built, f32)".into(),
        format!("{:.2} GB", a / 1e9),
        b.map_or("—".into(), |b| format!("{:.2} GB", b / 1e9)),
        b.map_or("—".into(), |b| format!("{:.2}×", a / b)),
        format!("≤ {:.1} GB", RSS_TARGET_BYTES / 1e9),
        yes_no(a <= RSS_TARGET_BYTES),
    ]);

    println!("\nCPU, f32, {threads} threads, median of the timed calls:\n");
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
