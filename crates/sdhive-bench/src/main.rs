//! `sdhive-bench`: times the full-size SD1.5 UNet (one CFG step, batch 2, latent 32² = 256²
//! pixels) and VAE decode (one 256² image) on the CPU in f32 with random weights, and reports the
//! process's peak RSS with both networks built. With the `cuda` feature, `--device cuda --dtype f16`
//! times the same work on an NVIDIA GPU (`--model sdxl` for the SDXL UNet), and `--write-model`
//! writes a full-size random-weight diffusers folder for end-to-end runs of the workers. `--upscale-bench` times the
//! ESRGAN upscaler instead (`upscale.rs`, against spandrel's `xtask/bench/bench_esrgan_spandrel.py`).
//! `--serve-bench WORKER` starts a worker and loads it over HTTP instead (`serving.rs`).
//!
//! Two modes. By default it warms up, times `--iters` calls of each network (and, on a GPU, `--iters`
//! 20-step schedules of UNet steps issued back to back, as a denoising loop issues them) and prints one JSON
//! report on stdout (progress on stderr). With `--serve` it builds the networks, prints a `ready`
//! line and then runs one call per command read from stdin (`unet`, `vae`, `report`, `quit`),
//! answering each with one JSON line: `cargo xtask bench cpu` drives this and diffusers' script
//! in alternation, so both see the same background load.

mod e2e;
mod lora;
mod sd3;
mod serving;
mod switch;
mod text;
mod upscale;
mod write_model;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use sdhive_models::{
    random_var_builder, sd15_unet_config, sd15_vae_config, sdxl_unet_config, sdxl_vae_config, AutoencoderKL,
    SdxlConditioning, UNet2DConditionModel,
};
use serde::Serialize;
use shared_worker::Backend;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser)]
#[command(name = "sdhive-bench", about = "SD UNet step and VAE decode with random weights")]
struct Args {
    /// `cpu`, or `cuda` / `cuda:N` (needs the `cuda` feature).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Weight and activation precision: f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Architecture: sd15 or sdxl.
    #[arg(long, value_enum, default_value_t = Family::Sd15)]
    model: Family,
    /// Instead of timing, write a full-size random-weight diffusers folder of `--model` here (f16 weights).
    #[arg(long, value_name = "DIR")]
    write_model: Option<PathBuf>,
    /// With --write-model: a diffusers folder whose tokenizers, scheduler and model_index.json are copied
    /// (e.g. tests/fixtures/models/sd1 or …/sdxl); the networks themselves are full size.
    #[arg(long, value_name = "DIR")]
    template: Option<PathBuf>,
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
    /// The UNet step's sample: `shared`, one for both prompts as the pipeline passes it (the network runs its
    /// part before the first attention to the text once), or `doubled`, repeated to batch 2 as diffusers does.
    #[arg(long, value_enum, default_value_t = CfgSample::Shared)]
    cfg_sample: CfgSample,
    /// Images per UNet step: CFG batch `2 × N`, each image its own latents (passed once for both prompts with
    /// `--cfg-sample shared`, as a batched job passes them).
    #[arg(long, default_value_t = 1)]
    images: usize,
    /// Run calls on request from stdin instead (see the module docs).
    #[arg(long)]
    serve: bool,
    /// Time whole requests instead: load this diffusers folder into the candle engine and generate
    /// `--size`² images with `--steps` steps and CFG 7.
    #[arg(long, value_name = "DIR")]
    e2e: Option<PathBuf>,
    /// With --e2e: the image side.
    #[arg(long, default_value_t = 512)]
    size: u32,
    /// With --e2e: denoising steps.
    #[arg(long, default_value_t = 20)]
    steps: u32,
    /// With --e2e: also time `--batch` requests (different prompts, seeds, CFG scales) denoised as one batch
    /// against the same requests one by one, and report each batched image's drift from its image alone. With
    /// --sd3: `--batch` images denoised together against the image alone.
    #[arg(long, default_value_t = 1)]
    batch: u32,
    /// With --e2e: hires fix to twice the size ("Latent" upscaler, a second pass of `--steps` steps at denoising
    /// strength 0.5, so half of them run), as `xtask/bench/bench_hires_diffusers.py` composes diffusers.
    #[arg(long)]
    hires: bool,
    /// Time model switches instead, between these diffusers folders (repeat the flag): loads from disk and from
    /// the RAM cache, with the device memory after each switch.
    #[arg(long = "switch", value_name = "DIR")]
    switch: Vec<PathBuf>,
    /// Time LoRA merges instead, on this diffusers folder, with the two `--lora` files: the first merged from no
    /// LoRA, switches between the two, and the UNet step plain and with a LoRA merged.
    #[arg(long, value_name = "DIR")]
    lora_model: Option<PathBuf>,
    /// With --lora-model: a LoRA file (give two).
    #[arg(long = "lora", value_name = "FILE")]
    lora: Vec<PathBuf>,
    /// Time the ESRGAN upscaler instead: a full-size random RRDBNet ×4 (64 features, 23 blocks, 32 growth channels,
    /// Real-ESRGAN's key names, f16 weights) upscaling an `--upscale-size`² image untiled on `--device`.
    #[arg(long)]
    upscale_bench: bool,
    /// With --upscale-bench: the model file (written there first if it does not exist; default: in the temp dir).
    #[arg(long, value_name = "FILE")]
    upscale_model: Option<PathBuf>,
    /// With --upscale-bench: the input image's side.
    #[arg(long, default_value_t = 512)]
    upscale_size: u32,
    /// With --switch: cached switches timed (alternating between the models).
    #[arg(long, default_value_t = 20)]
    switches: usize,
    /// Time an SD3 / SD3.5 diffusers folder instead: its transformer step (CFG batch 2) at `--size`² and whole
    /// images of `--steps` steps (`sd3.rs`).
    #[arg(long, value_name = "DIR")]
    sd3: Option<PathBuf>,
    /// With --sd3: leave T5 out (its part of the context is zeros).
    #[arg(long)]
    no_t5: bool,
    #[command(flatten)]
    serve_bench: serving::ServeBenchArgs,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Family {
    Sd15,
    Sdxl,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum CfgSample {
    Shared,
    Doubled,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Only {
    Both,
    Unet,
    Vae,
    /// The text encoders (prompt and negative prompt), nothing else.
    Text,
}

/// One timed call.
#[derive(Serialize, Clone, Copy)]
pub(crate) struct Call {
    ms: f64,
    /// Process CPU time (all threads, user + system): less disturbed than wall time when other
    /// work shares the cores, and a check that both cores were busy.
    cpu_ms: f64,
}

/// The timed calls of one piece of work.
#[derive(Serialize)]
pub(crate) struct Timing {
    ms: Vec<f64>,
    cpu_ms: Vec<f64>,
    median_ms: f64,
    mean_ms: f64,
    min_ms: f64,
}

impl Timing {
    pub(crate) fn median_ms(&self) -> f64 {
        self.median_ms
    }

    pub(crate) fn new(calls: &[Call]) -> Self {
        let ms: Vec<f64> = calls.iter().map(|c| c.ms).collect();
        let mut sorted = ms.clone();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median_ms = match n {
            0 => f64::NAN,
            _ if n % 2 == 1 => sorted[n / 2],
            _ => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
        };
        let mean_ms = sorted.iter().sum::<f64>() / n.max(1) as f64;
        let min_ms = sorted.first().copied().unwrap_or(f64::NAN);
        Self { cpu_ms: calls.iter().map(|c| c.cpu_ms).collect(), ms, median_ms, mean_ms, min_ms }
    }
}

#[derive(Serialize)]
struct Report {
    device: String,
    dtype: String,
    model: &'static str,
    threads: usize,
    latent: usize,
    /// How the step's sample was passed (`--cfg-sample`).
    cfg_sample: &'static str,
    /// Images per UNet step (`--images`; CFG batch twice that).
    images: usize,
    unet_build_ms: f64,
    vae_build_ms: f64,
    unet_step_b2: Option<Timing>,
    /// The same steps issued back to back as a denoising loop issues them: each timed run is one 20-step
    /// schedule (its time table included) between two device synchronisations, reported per step. The anchors'
    /// diffusers script times its steps this way; `unet_step_b2` also pays the host's launch latency and one
    /// synchronisation per step.
    unet_schedule_b2: Option<Timing>,
    /// Making a 20-step schedule's time-embedding table, once per image (the first step of each schedule in
    /// `unet_step_b2` includes it).
    unet_time_table: Option<Timing>,
    vae_decode: Option<Timing>,
    /// VmHWM: the most resident memory the process ever had, with both networks built.
    peak_rss_bytes: u64,
    /// VmRSS once both networks are built (their weights): how much of the peak is activations.
    rss_after_build_bytes: u64,
}

/// Both networks and their inputs. They stay alive together for the whole run, as in the
/// diffusers reference, so the peak RSS covers the UNet and the VAE built together.
struct Bench {
    device: Device,
    unet: Option<UNet2DConditionModel>,
    vae: Option<AutoencoderKL>,
    sample: Tensor,
    context: Tensor,
    added: Option<SdxlConditioning>,
    latent: Tensor,
    unet_calls: usize,
    table_calls: usize,
    unet_build_ms: f64,
    vae_build_ms: f64,
    rss_after_build_bytes: u64,
}

impl Bench {
    /// Builds only the networks `only` asks for, so a GPU run of the SDXL UNet does not also hold a VAE.
    fn new(
        dev: &Device,
        dtype: DType,
        family: Family,
        latent: usize,
        only: Only,
        cfg_sample: CfgSample,
        images: usize,
    ) -> Result<Self> {
        let (unet_cfg, vae_cfg, ctx_dim) = match family {
            Family::Sd15 => (sd15_unet_config(), sd15_vae_config(), 768),
            Family::Sdxl => (sdxl_unet_config(), sdxl_vae_config(), 2048),
        };
        let t = Instant::now();
        let unet = match only {
            Only::Vae => None,
            _ => Some(
                UNet2DConditionModel::new(random_var_builder(dtype, dev), &unet_cfg)
                    .context("building the UNet with random weights")?,
            ),
        };
        sync(dev)?;
        let unet_build_ms = ms_since(t);
        let t = Instant::now();
        let vae = match only {
            Only::Unet => None,
            _ => Some(
                AutoencoderKL::new(random_var_builder(dtype, dev), &vae_cfg)
                    .context("building the VAE with random weights")?,
            ),
        };
        sync(dev)?;
        let vae_build_ms = ms_since(t);
        let rss_after_build_bytes = status_kb("VmRSS:")?;
        let randn = |shape: &[usize]| -> Result<Tensor> {
            Ok(Tensor::randn(0f32, 1., shape, &Device::Cpu)?.to_dtype(dtype)?.to_device(dev)?)
        };
        let rows = 2 * images.max(1);
        // Shared, each image's latents go in once for both of its prompts, as the engine passes a batch's.
        let samples = if cfg_sample == CfgSample::Shared { images.max(1) } else { rows };
        // SDXL's pooled text embedding and micro-conditioning, as diffusers' benchmark feeds them.
        let added = match family {
            Family::Sd15 => None,
            Family::Sdxl => {
                Some(SdxlConditioning { text_embeds: randn(&[rows, 1280])?, time_ids: randn(&[rows, 6])? })
            }
        };
        Ok(Self {
            device: dev.clone(),
            unet,
            vae,
            sample: randn(&[samples, 4, latent, latent])?,
            context: randn(&[rows, 77, ctx_dim])?,
            added,
            latent: randn(&[1, 4, latent, latent])?,
            unet_calls: 0,
            table_calls: 0,
            unet_build_ms,
            vae_build_ms,
            rss_after_build_bytes,
        })
    }

    /// A whole 20-step schedule of CFG steps, queued without waiting between them (the time table first, as the
    /// pipeline makes it); the call's time is per step.
    fn unet_schedule(&mut self) -> Result<Call> {
        let schedule = schedule(0.0);
        let unet = self.unet.as_ref().context("the UNet was not built (--only vae)")?;
        let batch = self.context.dim(0)?;
        let call = timed(&self.device, || {
            unet.prepare_timesteps(&schedule, batch, self.added.as_ref()).context("UNet time table")?;
            for &t in &schedule {
                unet.forward(&self.sample, t, &self.context, self.added.as_ref()).context("UNet step")?;
            }
            Ok(())
        })?;
        let n = schedule.len() as f64;
        Ok(Call { ms: call.ms / n, cpu_ms: call.cpu_ms / n })
    }

    /// The time-embedding table of a 20-step schedule, made afresh: calls alternate between two schedules a
    /// timestep apart.
    fn unet_time_table(&mut self) -> Result<Call> {
        let shift = (self.table_calls % 2) as f64;
        self.table_calls += 1;
        let schedule = schedule(shift);
        let unet = self.unet.as_ref().context("the UNet was not built (--only vae)")?;
        let batch = self.context.dim(0)?;
        timed(&self.device, || {
            unet.prepare_timesteps(&schedule, batch, self.added.as_ref()).context("UNet time table")?;
            Ok(())
        })
    }

    /// One CFG step of a 20-step schedule, as the pipeline runs it: the timestep moves like a sampler's, and the
    /// first step of each schedule also makes the schedule's time-embedding table (so a mean over whole schedules
    /// carries its share).
    fn unet_step(&mut self) -> Result<Call> {
        let schedule = schedule(0.0);
        let i = self.unet_calls % SCHEDULE_STEPS;
        self.unet_calls += 1;
        let unet = self.unet.as_ref().context("the UNet was not built (--only vae)")?;
        let batch = self.context.dim(0)?;
        timed(&self.device, || {
            if i == 0 {
                unet.prepare_timesteps(&schedule, batch, self.added.as_ref()).context("UNet time table")?;
            }
            unet.forward(&self.sample, schedule[i], &self.context, self.added.as_ref())
                .context("UNet step")?;
            Ok(())
        })
    }

    fn vae_decode(&self) -> Result<Call> {
        let vae = self.vae.as_ref().context("the VAE was not built (--only unet)")?;
        timed(&self.device, || {
            vae.decode(&self.latent).context("VAE decode")?;
            Ok(())
        })
    }
}

fn parse_dtype(s: &str) -> Result<DType> {
    match s {
        "f32" => Ok(DType::F32),
        "f16" => Ok(DType::F16),
        "bf16" => Ok(DType::BF16),
        other => bail!("--dtype {other}: expected f32, f16 or bf16"),
    }
}

/// `cpu`, `cuda` or `cuda:N`, opened (and, for GPUs, verified) the way the workers open devices.
fn open_device(spec: &str) -> Result<(Device, String)> {
    let (backend, index) = match spec.split_once(':') {
        Some((b, i)) => (b, i.parse::<usize>().with_context(|| format!("--device {spec}: bad index"))?),
        None => (spec, 0),
    };
    let backend: Backend = backend.parse()?;
    let (device, info) = shared_worker::init(backend, index).with_context(|| format!("--device {spec}"))?;
    let device = device.candle().cloned().with_context(|| format!("--device {spec}: not a candle device"))?;
    let driver = info.driver.map(|d| format!(", driver {d}")).unwrap_or_default();
    let memory = info.memory_total_bytes.map(|m| format!(", {:.1} GB", m as f64 / 1e9)).unwrap_or_default();
    Ok((device, format!("{backend}:{index} {}{memory}{driver}", info.name)))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dtype = parse_dtype(&args.dtype)?;
    if let Some(dir) = &args.write_model {
        let template = args.template.as_deref().context("--write-model needs --template DIR")?;
        return write_model::write(args.model, template, dir);
    }
    // The worker opens the device; this process stays off it, so the worker's memory is the worker's own.
    if let Some(worker) = &args.serve_bench.serve_bench {
        let report = serving::run(&serving::Settings {
            args: &args.serve_bench,
            worker: worker.clone(),
            size: args.size,
            steps: args.steps,
            dtype: &args.dtype,
            warmup: args.warmup,
        })?;
        println!("{report}");
        return Ok(());
    }
    let (dev, device_name) = open_device(&args.device)?;
    if args.iters == 0 {
        bail!("--iters must be at least 1");
    }
    if !args.switch.is_empty() {
        let mut report = switch::run(&args.switch, &dev, dtype, args.switches)?;
        report["device"] = serde_json::json!(device_name);
        report["dtype"] = serde_json::json!(args.dtype);
        println!("{report}");
        return Ok(());
    }
    if args.upscale_bench {
        let mut report = upscale::run(
            args.upscale_model.as_deref(),
            args.upscale_size,
            &dev,
            dtype,
            args.warmup,
            args.iters,
        )?;
        report["device"] = serde_json::json!(device_name);
        report["dtype"] = serde_json::json!(args.dtype);
        println!("{report}");
        return Ok(());
    }
    if let Some(dir) = &args.sd3 {
        let mut report = sd3::run(
            &sd3::Settings {
                dir,
                dtype,
                size: args.size,
                steps: args.steps,
                with_t5: !args.no_t5,
                warmup: args.warmup,
                iters: args.iters,
                batch: args.batch,
            },
            &dev,
        )?;
        report["device"] = serde_json::json!(device_name);
        report["dtype"] = serde_json::json!(args.dtype);
        println!("{report}");
        return Ok(());
    }
    if let Some(dir) = &args.lora_model {
        let mut report = lora::run(dir, &args.lora, &dev, dtype, args.iters)?;
        report["device"] = serde_json::json!(device_name);
        report["dtype"] = serde_json::json!(args.dtype);
        println!("{report}");
        return Ok(());
    }
    if let Some(dir) = &args.e2e {
        let mut run = e2e::EndToEnd::load(dir, &dev, dtype, args.size, args.steps, args.hires)?;
        let timing = time_calls(&dev, "image", args.warmup, args.iters, || run.generate())?;
        let mut report = serde_json::json!({
            "device": device_name, "dtype": args.dtype, "model": args.model.name(), "size": args.size,
            "steps": args.steps, "hires": args.hires, "e2e": timing,
        });
        if args.batch > 1 {
            let n = args.batch;
            let alone = run.alone(n)?;
            let batched = run.batched(n)?;
            let one_by_one =
                time_calls(&dev, "one by one", args.warmup, args.iters, || run.alone(n).map(|_| ()))?;
            let together =
                time_calls(&dev, "batched", args.warmup, args.iters, || run.batched(n).map(|_| ()))?;
            report["batch"] = serde_json::json!({
                "images": n, "one_by_one": one_by_one, "batched": together,
                "drift": e2e::drift(&batched, &alone),
            });
        }
        println!("{report}");
        return Ok(());
    }
    if args.only == Only::Text {
        let encoders = text::TextEncoders::new(&dev, dtype, args.model)?;
        let timing = time_calls(&dev, "text encode", args.warmup, args.iters, || encoders.encode_pair())?;
        for (recorded, refused) in encoders.graph_status() {
            eprintln!("text encoder: {recorded} shapes replayed from a CUDA graph; refused: {refused:?}");
        }
        let report = serde_json::json!({
            "device": device_name, "dtype": args.dtype, "model": args.model.name(), "text_encode": timing,
        });
        println!("{report}");
        return Ok(());
    }
    let threads = candle_core::utils::get_num_threads();
    eprintln!(
        "sdhive-bench: {device_name}, {dtype:?}, {threads} threads, {} latent {1}² ({2}² pixels)",
        args.model.name(),
        args.latent,
        args.latent * 8
    );
    let mut bench =
        Bench::new(&dev, dtype, args.model, args.latent, args.only, args.cfg_sample, args.images)?;
    eprintln!(
        "built UNet in {:.0} ms, VAE in {:.0} ms; RSS {:.2} GB",
        bench.unet_build_ms,
        bench.vae_build_ms,
        bench.rss_after_build_bytes as f64 / 1e9
    );
    if args.serve {
        return serve(&mut bench, threads);
    }

    let unet_step_b2 = (args.only != Only::Vae)
        .then(|| measure("unet step", args.warmup, args.iters, Profile::Inside, || bench.unet_step()))
        .transpose()?;
    // Outside the profiler range: a profile of the step needs one call, not twenty. Not on the CPU, where a
    // schedule takes minutes and no launch latency hides between steps anyway.
    let unet_schedule_b2 = (args.only != Only::Vae && !dev.is_cpu())
        .then(|| {
            measure("unet schedule, per step", 1, args.iters, Profile::Outside, || bench.unet_schedule())
        })
        .transpose()?;
    let unet_time_table = (args.only != Only::Vae)
        .then(|| {
            measure("unet time table", args.warmup, args.iters, Profile::Inside, || bench.unet_time_table())
        })
        .transpose()?;
    const MIB: f64 = (1 << 20) as f64;
    let graph_mib = || {
        sdhive_cuda_kernels::graph_memory(&dev).map(|(now, most, _)| (now as f64 / MIB, most as f64 / MIB))
    };
    if let Some(unet) = &bench.unet {
        let (recorded, refused) = unet.graph_status();
        eprintln!("UNet steps replayed from a CUDA graph: {}", if recorded > 0 { "yes" } else { "no" });
        for why in refused {
            eprintln!("CUDA graph refused: {why}");
        }
        if let Ok((now, most)) = graph_mib() {
            eprintln!("graph memory after the UNet's calls: {now:.0} MiB reserved (at most {most:.0})");
        }
    }
    let vae_decode = (args.only != Only::Unet)
        .then(|| measure("vae decode", args.warmup, args.iters, Profile::Inside, || bench.vae_decode()))
        .transpose()?;
    if let Some(vae) = &bench.vae {
        let (recorded, refused) = vae.graph_status();
        eprintln!("VAE decodes replayed from a CUDA graph: {}", if recorded > 0 { "yes" } else { "no" });
        for why in refused {
            eprintln!("CUDA graph refused: {why}");
        }
        if let Ok((now, most)) = graph_mib() {
            eprintln!("graph memory after the VAE's calls: {now:.0} MiB reserved (at most {most:.0})");
        }
    }
    let report = Report {
        device: device_name,
        dtype: args.dtype.clone(),
        model: args.model.name(),
        unet_schedule_b2,
        unet_time_table,
        ..report(&bench, threads, args.latent, unet_step_b2, vae_decode)?
    };
    eprintln!("peak RSS {:.2} GB", report.peak_rss_bytes as f64 / 1e9);
    println!("{}", serde_json::to_string(&report).context("serialising the report")?);
    Ok(())
}

fn report(
    bench: &Bench,
    threads: usize,
    latent: usize,
    unet_step_b2: Option<Timing>,
    vae_decode: Option<Timing>,
) -> Result<Report> {
    Ok(Report {
        device: String::new(),
        dtype: String::new(),
        model: "",
        threads,
        latent,
        // One sample for both contexts is `--cfg-sample shared`.
        cfg_sample: if bench.sample.dim(0)? < bench.context.dim(0)? { "shared" } else { "doubled" },
        images: bench.context.dim(0)? / 2,
        unet_build_ms: bench.unet_build_ms,
        vae_build_ms: bench.vae_build_ms,
        unet_step_b2,
        unet_schedule_b2: None,
        unet_time_table: None,
        vae_decode,
        peak_rss_bytes: status_kb("VmHWM:")?,
        rss_after_build_bytes: bench.rss_after_build_bytes,
    })
}

/// The stdin/stdout protocol of `--serve`: one command per line, one JSON line per answer.
fn serve(bench: &mut Bench, threads: usize) -> Result<()> {
    let mut out = std::io::stdout().lock();
    let mut say = |value: serde_json::Value| -> Result<()> {
        writeln!(out, "{value}").and_then(|()| out.flush()).context("writing to stdout")
    };
    say(serde_json::json!({ "ready": true, "threads": threads }))?;
    for line in std::io::stdin().lock().lines() {
        let line = line.context("reading a command from stdin")?;
        match line.trim() {
            "unet" => say(serde_json::to_value(bench.unet_step()?)?)?,
            "vae" => say(serde_json::to_value(bench.vae_decode()?)?)?,
            "report" => {
                say(serde_json::to_value(report(bench, threads, bench.sample.dim(3)?, None, None)?)?)?
            }
            "quit" | "" => break,
            other => bail!("unknown command `{other}` (expected unet, vae, report or quit)"),
        }
    }
    Ok(())
}

/// Whether [`measure`]'s timed calls run inside the CUDA profiler range ([`profiled`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Profile {
    Inside,
    Outside,
}

/// `warmup` untimed calls of `call` (which times itself), then `iters` timed ones.
fn measure(
    what: &str,
    warmup: usize,
    iters: usize,
    profile: Profile,
    mut call: impl FnMut() -> Result<Call>,
) -> Result<Timing> {
    for _ in 0..warmup {
        call()?;
    }
    let mut timed_calls = || {
        (0..iters)
            .map(|i| {
                let c = call()?;
                eprintln!("{what} {i}: {:.2} ms (cpu {:.1} ms)", c.ms, c.cpu_ms);
                Ok(c)
            })
            .collect::<Result<Vec<_>>>()
    };
    let calls = if profile == Profile::Inside { profiled(timed_calls)? } else { timed_calls()? };
    Ok(Timing::new(&calls))
}

/// Runs the timed calls inside a CUDA profiler range, so `ncu --profile-from-start off` (or nsys with
/// `--capture-range=cudaProfilerApi`) records them and not the thousands of launches that build random weights.
pub(crate) fn profiled<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::{profiler_start, profiler_stop};
        let on = profiler_start().is_ok();
        let out = f();
        if on {
            let _ = profiler_stop();
        }
        out
    }
    #[cfg(not(feature = "cuda"))]
    f()
}

/// `warmup` untimed calls of `f`, then `iters` timed ones.
pub(crate) fn time_calls(
    dev: &Device,
    what: &str,
    warmup: usize,
    iters: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<Timing> {
    for _ in 0..warmup {
        f()?;
    }
    let calls = (0..iters)
        .map(|i| {
            let c = timed(dev, &mut f)?;
            eprintln!("{what} {i}: {:.1} ms", c.ms);
            Ok(c)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Timing::new(&calls))
}

/// Times `f` to completion: on a GPU the work is queued asynchronously, so the clock stops only after the device
/// has drained its queue.
pub(crate) fn timed(dev: &Device, f: impl FnOnce() -> Result<()>) -> Result<Call> {
    sync(dev)?;
    let (t, c) = (Instant::now(), cpu_time_ms()?);
    f()?;
    sync(dev)?;
    Ok(Call { ms: ms_since(t), cpu_ms: cpu_time_ms()? - c })
}

pub(crate) fn sync(dev: &Device) -> Result<()> {
    dev.synchronize().context("waiting for the device")
}

impl Family {
    fn name(self) -> &'static str {
        match self {
            Family::Sd15 => "sd15",
            Family::Sdxl => "sdxl",
        }
    }
}

/// utime + stime of the whole process from `/proc/self/stat`, in ms (clock-tick resolution).
fn cpu_time_ms() -> Result<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").context("reading /proc/self/stat")?;
    // The command name (field 2) may hold spaces; the fields after its closing parenthesis do not.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).context("unexpected /proc/self/stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    let ticks = |i: usize| -> Result<f64> {
        fields.get(i).context("short /proc/self/stat")?.parse::<f64>().context("bad /proc/self/stat field")
    };
    Ok((ticks(11)? + ticks(12)?) * 1e3 / CLOCK_TICKS_PER_SEC)
}

/// `sysconf(_SC_CLK_TCK)`: 100 on every Linux configuration this runs on.
const CLOCK_TICKS_PER_SEC: f64 = 100.0;

/// The sampler steps per image that `unet_step` cycles through (the benchmark table's images have 20).
const SCHEDULE_STEPS: usize = 20;

/// A 20-step schedule from 999 down in steps of 50, `shift` lower.
pub(crate) fn schedule(shift: f64) -> Vec<f64> {
    (0..SCHEDULE_STEPS).map(|i| 999.0 - shift - 50.0 * i as f64).collect()
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// A `kB` line of `/proc/self/status` (`VmHWM:`, `VmRSS:`), in bytes.
fn status_kb(key: &str) -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
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
