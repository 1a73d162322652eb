//! LoRA merges timed as a serving worker makes them (`--lora-model DIR --lora A --lora B`): the model loaded
//! once, then the first LoRA merged into it (from no LoRA), the merged set switched between the two LoRAs (the
//! one merged taken out, the other put in), and the UNet's step timed plain and with a LoRA merged, on the same
//! network. Each merge reads its file (from the page cache after the first); the device is synchronised before
//! the clock stops. The device memory kept to take the LoRA out again is reported.

use crate::{schedule, sync, timed, Call, Timing};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use sdhive_candle::{ChangeTimes, ModuleTarget, SdModel, Targets};
use sdhive_engine::LoraUse;
use sdhive_models::SdxlConditioning;
use serde_json::{json, Value};
use std::path::PathBuf;

fn lora(path: &std::path::Path) -> LoraUse {
    LoraUse {
        name: path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default(),
        path: path.to_path_buf(),
        te: 1.0,
        unet: 1.0,
        hash: None,
    }
}

/// The latent side of the family's native size: the bench models are written from the tiny fixtures, whose
/// configs say 64 pixels.
fn latent_side(model: &SdModel) -> usize {
    match model.family {
        sdhive_candle::Family::Sdxl => 128,
        sdhive_candle::Family::Sd => 64,
    }
}

/// Medians of the host-side phases of set changes.
fn phases(times: &[ChangeTimes]) -> Value {
    let median = |f: fn(&ChangeTimes) -> f64| {
        let mut v: Vec<f64> = times.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    json!({"restore_ms": median(|t| t.restore_ms), "read_ms": median(|t| t.read_ms), "merge_ms": median(|t| t.merge_ms)})
}

fn used_bytes(dev: &Device) -> Option<u64> {
    match shared_worker::memory(&shared_worker::DeviceHandle::Candle(dev.clone())) {
        (Some(total), Some(free)) => Some(total.saturating_sub(free)),
        _ => None,
    }
}

/// Random inputs of a CFG step at the family's native size: the latent sample (shared by both halves), the
/// `(2, 77, ·)` text context and SDXL's added conditioning.
fn step_inputs(
    model: &SdModel,
    dev: &Device,
    dtype: DType,
) -> Result<(Tensor, Tensor, Option<SdxlConditioning>)> {
    let side = latent_side(model);
    let randn = |shape: &[usize]| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1., shape, &Device::Cpu)?.to_dtype(dtype)?.to_device(dev)?)
    };
    let ctx_dim = match &model.unet_config.cross_attention_dim {
        sdhive_models::IntOrList::Int(n) => *n,
        sdhive_models::IntOrList::List(v) => v.first().copied().context("empty cross_attention_dim")?,
    };
    let (sample, context) = (randn(&[1, 4, side, side])?, randn(&[2, 77, ctx_dim])?);
    Ok((sample, context, added_conditioning(model, &randn)?))
}

/// 20-step schedules of CFG steps at the model's native size, queued back to back; the time per step.
fn steps(model: &SdModel, dev: &Device, dtype: DType, iters: usize) -> Result<Timing> {
    let unet = model.unet.get().context("the UNet is offloaded")?;
    let (sample, context, added) = step_inputs(model, dev, dtype)?;
    let schedule = schedule(0.0);
    let run = || -> Result<Call> {
        let call = timed(dev, || {
            unet.prepare_timesteps(&schedule, 2, added.as_ref()).context("UNet time table")?;
            for &t in &schedule {
                unet.forward(&sample, t, &context, added.as_ref()).context("UNet step")?;
            }
            Ok(())
        })?;
        let n = schedule.len() as f64;
        Ok(Call { ms: call.ms / n, cpu_ms: call.cpu_ms / n })
    };
    // Two untimed schedules: the first call of the shape runs eagerly, the second records the step's graph.
    run()?;
    run()?;
    let calls = (0..iters).map(|_| run()).collect::<Result<Vec<_>>>()?;
    Ok(Timing::new(&calls))
}

/// The merged network's output against a network built from host weights the deltas were added to (the
/// offload path: the build itself stacks, re-lays out and interleaves the merged weights), for the same inputs:
/// max |difference| over max |output|. Also the plain network's distance, to show the LoRA changes the output.
fn merge_check(
    model: &SdModel,
    dir: &std::path::Path,
    lora: &LoraUse,
    dev: &Device,
    dtype: DType,
) -> Result<Value> {
    let host = ModuleTarget { device: dev.clone(), dtype, offload: true, host_copy: false };
    let targets = Targets { unet: host.clone(), text: host.clone(), vae: host };
    let mut reference =
        SdModel::from_diffusers_dir_on("reference", dir, &targets).context("the host-merged model")?;
    let unet = model.unet.get().context("the UNet is offloaded")?;
    let (sample, context, added) = step_inputs(model, dev, dtype)?;
    let run = |u: &sdhive_models::UNet2DConditionModel| -> Result<Vec<f32>> {
        let y = u.forward(&sample, 500.0, &context, added.as_ref())?;
        Ok(y.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
    };
    let plain = reference.unet.with(run)??;
    reference.set_loras(std::slice::from_ref(lora)).context("merging into the host copy")?;
    let want = reference.unet.with(run)??;
    let got = run(unet)?;
    let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
    let diff = |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale;
    Ok(json!({"merged_vs_host_merged": diff(&got, &want), "plain_vs_host_merged": diff(&plain, &want)}))
}

fn added_conditioning(
    model: &SdModel,
    randn: &dyn Fn(&[usize]) -> Result<Tensor>,
) -> Result<Option<SdxlConditioning>> {
    Ok(match model.family {
        sdhive_candle::Family::Sdxl => {
            let cfg = &model.unet_config;
            let pooled = cfg.projection_class_embeddings_input_dim.unwrap_or(2816)
                - 6 * cfg.addition_time_embed_dim.unwrap_or(256);
            Some(SdxlConditioning { text_embeds: randn(&[2, pooled])?, time_ids: randn(&[2, 6])? })
        }
        sdhive_candle::Family::Sd => None,
    })
}

pub fn run(
    model_dir: &std::path::Path,
    loras: &[PathBuf],
    dev: &Device,
    dtype: DType,
    iters: usize,
) -> Result<Value> {
    let [a, b] = loras else { bail!("--lora-model needs two --lora files") };
    let (a, b) = (lora(a), lora(b));
    let mut model = SdModel::from_diffusers_dir("bench", model_dir, dev, dtype)
        .with_context(|| format!("loading {}", model_dir.display()))?;
    sync(dev)?;
    let used_plain = used_bytes(dev);
    let plain_step = steps(&model, dev, dtype, iters)?;
    eprintln!("plain step {:.2} ms", plain_step.median_ms);

    // The first merge also reads and parses the file (in the page cache: the script wrote it just before). The
    // device's memory pool around it: what a merge holds at most, and what stays reserved.
    let pool = |what: &str| {
        if let Ok((reserved, used, high)) = sdhive_cuda_kernels::pool_usage_then_trim(dev) {
            eprintln!(
                "memory pool {what}: reserved {} MiB, used {} MiB, most used {} MiB",
                reserved >> 20,
                used >> 20,
                high >> 20
            );
        }
    };
    pool("before the first merge");
    let first = timed(dev, || model.set_loras(std::slice::from_ref(&a)).context("merging the first LoRA"))?;
    let first_phases = model.loras.last;
    eprintln!("first merge, file read: {:.1} ms ({first_phases:?})", first.ms);
    pool("after the first merge");
    model.set_loras(&[]).context("taking the LoRA out")?;
    pool("after taking it out");
    model.set_loras(std::slice::from_ref(&a)).context("merging the first LoRA")?;
    let (mut apply, mut apply_phases) = (Vec::new(), Vec::new());
    for i in 0..iters {
        model.set_loras(&[]).context("taking the LoRA out")?;
        sync(dev)?;
        apply.push(timed(dev, || Ok(model.set_loras(std::slice::from_ref(&a))?))?);
        apply_phases.push(model.loras.last);
        eprintln!("apply {i}: {:.1} ms ({:?})", apply[i].ms, model.loras.last);
    }
    let kept = model.loras.kept_bytes();
    let used_merged = used_bytes(dev);
    let merged_step = steps(&model, dev, dtype, iters)?;
    eprintln!("step with the LoRA merged {:.2} ms", merged_step.median_ms);
    let check = merge_check(&model, model_dir, &a, dev, dtype)?;
    eprintln!("merge check: {check}");

    model.set_loras(std::slice::from_ref(&b)).context("merging the second LoRA")?;
    let (mut switch, mut switch_phases) = (Vec::new(), Vec::new());
    for i in 0..iters {
        let next = if i % 2 == 0 { &a } else { &b };
        switch.push(timed(dev, || Ok(model.set_loras(std::slice::from_ref(next))?))?);
        switch_phases.push(model.loras.last);
        eprintln!("switch {i}: {:.1} ms ({:?})", switch[i].ms, model.loras.last);
    }
    let mut remove = Vec::new();
    for i in 0..iters {
        model.set_loras(std::slice::from_ref(&a))?;
        sync(dev)?;
        remove.push(timed(dev, || Ok(model.set_loras(&[])?))?);
        eprintln!("remove {i}: {:.1} ms", remove[i].ms);
    }
    let used_after = used_bytes(dev);
    Ok(json!({
        "model": model_dir, "loras": [a.path, b.path],
        "plain_step": plain_step, "merged_step": merged_step,
        "apply": Timing::new(&apply), "switch": Timing::new(&switch), "remove": Timing::new(&remove),
        "first_merge_ms": first.ms, "first_merge_phases": phases(&[first_phases]),
        "apply_phases": phases(&apply_phases), "switch_phases": phases(&switch_phases),
        "kept_bytes": kept, "merge_check": check,
        "device_used_bytes": {"plain": used_plain, "merged": used_merged, "after_removal": used_after},
    }))
}
