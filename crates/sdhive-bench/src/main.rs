//! `sdhive-bench`: times the full-size SD1.5 UNet (one CFG step, batch 2, latent 32² = 256²
//! pixels) and VAE decode (one 256² image) on the CPU in f32 with random weights, and reports the
//! process's peak RSS with both networks built. `cargo xtask bench cpu` runs it next to diffusers.
//!
//! Human-readable progress goes to stderr; stdout carries one JSON object, so the xtask (or a
//! script) can parse it without scraping.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use sdhive_models::{
    random_var_builder, sd15_unet_config, sd15_vae_config, AutoencoderKL, UNet2DConditionModel,
};
use serde::Serialize;
use std::time::Instant;

#[derive(Parser)]
#[command(name = "sdhive-bench", about = "SD1.5 UNet step and VAE decode on the CPU, f32, random weights")]
struct Args {
    /// Timed UNet steps and VAE decodes (each).
    #[arg(long, default_value_t = 3)]
    iters: usize,
    /// Untimed calls of each network first (allocator and caches settle).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Latent side; 32 is a 256² image.
    #[arg(long, default_value_t = 32)]
    latent: usize,
    /// Which work to time.
    #[arg(long, value_enum, default_value_t = Only::Both)]
    only: Only,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Only {
    Both,
    Unet,
    Vae,
}

/// Per-call wall times of one piece of work.
#[derive(Serialize)]
struct Timing {
    ms: Vec<f64>,
    median_ms: f64,
    mean_ms: f64,
    min_ms: f64,
}

impl Timing {
    fn new(ms: Vec<f64>) -> Self {
        let mut sorted = ms.clone();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len().max(1);
        let median_ms = if sorted.is_empty() {
            f64::NAN
        } else if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        let mean_ms = sorted.iter().sum::<f64>() / n as f64;
        let min_ms = sorted.first().copied().unwrap_or(f64::NAN);
        Self { ms, median_ms, mean_ms, min_ms }
    }
}

#[derive(Serialize)]
struct Report {
    threads: usize,
    latent: usize,
    unet_build_ms: f64,
    vae_build_ms: f64,
    unet_step_b2: Option<Timing>,
    vae_decode: Option<Timing>,
    /// VmHWM: the most resident memory the process ever had, with both networks built.
    peak_rss_bytes: u64,
    /// VmRSS once both networks are built (their weights), and VmHWM after the UNet steps:
    /// where the peak comes from.
    rss_after_build_bytes: u64,
    peak_rss_after_unet_bytes: u64,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.iters == 0 {
        bail!("--iters must be at least 1");
    }
    let dev = Device::Cpu;
    let threads = candle_core::utils::get_num_threads();
    eprintln!(
        "sdhive-bench: f32, {threads} threads, latent {0}² ({1}² pixels)",
        args.latent,
        args.latent * 8
    );

    // Both networks stay alive for the whole run, as in the diffusers reference, so the peak RSS
    // covers the UNet and the VAE built together.
    let t = Instant::now();
    let unet = UNet2DConditionModel::new(random_var_builder(DType::F32, &dev), &sd15_unet_config())
        .context("building the SD1.5 UNet with random weights")?;
    let unet_build_ms = ms_since(t);
    let t = Instant::now();
    let vae = AutoencoderKL::new(random_var_builder(DType::F32, &dev), &sd15_vae_config())
        .context("building the SD1.5 VAE with random weights")?;
    let vae_build_ms = ms_since(t);
    let rss_after_build_bytes = status_kb("VmRSS:").context("reading VmRSS from /proc/self/status")?;
    eprintln!(
        "built UNet in {unet_build_ms:.0} ms, VAE in {vae_build_ms:.0} ms; RSS {:.2} GB",
        rss_after_build_bytes as f64 / 1e9
    );

    let unet_step_b2 = match args.only {
        Only::Both | Only::Unet => Some(time_unet(&unet, &args, &dev)?),
        Only::Vae => None,
    };
    let peak_rss_after_unet_bytes = status_kb("VmHWM:").context("reading VmHWM from /proc/self/status")?;
    let vae_decode = match args.only {
        Only::Both | Only::Vae => Some(time_vae(&vae, &args, &dev)?),
        Only::Unet => None,
    };
    let peak_rss_bytes = status_kb("VmHWM:").context("reading VmHWM from /proc/self/status")?;
    eprintln!("peak RSS {:.2} GB", peak_rss_bytes as f64 / 1e9);

    let report = Report {
        threads,
        latent: args.latent,
        unet_build_ms,
        vae_build_ms,
        unet_step_b2,
        vae_decode,
        peak_rss_bytes,
        rss_after_build_bytes,
        peak_rss_after_unet_bytes,
    };
    println!("{}", serde_json::to_string(&report).context("serialising the report")?);
    Ok(())
}

fn time_unet(unet: &UNet2DConditionModel, args: &Args, dev: &Device) -> Result<Timing> {
    let x = Tensor::randn(0f32, 1., (2, 4, args.latent, args.latent), dev)?;
    let ctx = Tensor::randn(0f32, 1., (2, 77, 768), dev)?;
    for i in 0..args.warmup {
        sdhive_models::cpu::prof_dump();
        unet.forward(&x, 500.0 - i as f64, &ctx, None).context("UNet warm-up step")?;
    }
    let mut ms = Vec::with_capacity(args.iters);
    for i in 0..args.iters {
        let t = Instant::now();
        let out = unet.forward(&x, 999.0 - 50.0 * i as f64, &ctx, None).context("UNet step")?;
        ms.push(ms_since(t));
        eprintln!("unet step {i}: {:.0} ms", ms[i]);
        if i == 0 {
            sdhive_models::cpu::prof_dump();
        }
        drop(out);
    }
    Ok(Timing::new(ms))
}

fn time_vae(vae: &AutoencoderKL, args: &Args, dev: &Device) -> Result<Timing> {
    let z = Tensor::randn(0f32, 1., (1, 4, args.latent, args.latent), dev)?;
    for _ in 0..args.warmup {
        vae.decode(&z).context("VAE warm-up decode")?;
    }
    sdhive_models::cpu::prof_dump();
    let mut ms = Vec::with_capacity(args.iters);
    for i in 0..args.iters {
        let t = Instant::now();
        let out = vae.decode(&z).context("VAE decode")?;
        ms.push(ms_since(t));
        eprintln!("vae decode {i}: {:.0} ms", ms[i]);
        if i == 0 {
            sdhive_models::cpu::prof_dump();
        }
        drop(out);
    }
    Ok(Timing::new(ms))
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// A `kB` line of `/proc/self/status` (`VmHWM:`, `VmRSS:`), in bytes.
fn status_kb(key: &str) -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status.lines().find(|l| l.starts_with(key)).with_context(|| format!("no {key} line"))?;
    let kb: u64 = line
        .trim_start_matches(key)
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .with_context(|| format!("unexpected line `{line}`"))?;
    Ok(kb * 1024)
}
