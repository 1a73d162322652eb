//! LoRA merges timed as a serving worker makes them (`--lora-model DIR --lora A --lora B`): the model loaded
//! once, then the first LoRA merged into it (from no LoRA), the merged set switched between the two LoRAs (the
//! one merged taken out, the other put in), and the UNet's step timed plain and with a LoRA merged, on the same
//! network. Each merge reads its file (from the page cache after the first); the device is synchronised before
//! the clock stops. The device memory kept to take the LoRA out again is reported.

use crate::{schedule, sync, timed, Call, Timing};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use sdhive_candle::SdModel;
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

fn used_bytes(dev: &Device) -> Option<u64> {
    match shared_worker::memory(&shared_worker::DeviceHandle::Candle(dev.clone())) {
        (Some(total), Some(free)) => Some(total.saturating_sub(free)),
        _ => None,
    }
}

/// 20-step schedules of CFG steps at the model's native size, queued back to back; the time per step.
fn steps(model: &SdModel, dev: &Device, dtype: DType, iters: usize) -> Result<Timing> {
    let unet = model.unet.get().context("the UNet is offloaded")?;
    let side = model.native_size.0 as usize / model.vae_scale_factor;
    let randn = |shape: &[usize]| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1., shape, &Device::Cpu)?.to_dtype(dtype)?.to_device(dev)?)
    };
    let ctx_dim = match &model.unet_config.cross_attention_dim {
        sdhive_models::IntOrList::Int(n) => *n,
        sdhive_models::IntOrList::List(v) => v.first().copied().context("empty cross_attention_dim")?,
    };
    let sample = randn(&[1, 4, side, side])?;
    let context = randn(&[2, 77, ctx_dim])?;
    let added = match model.family {
        sdhive_candle::Family::Sdxl => {
            let cfg = &model.unet_config;
            let pooled = cfg.projection_class_embeddings_input_dim.unwrap_or(2816)
                - 6 * cfg.addition_time_embed_dim.unwrap_or(256);
            Some(SdxlConditioning { text_embeds: randn(&[2, pooled])?, time_ids: randn(&[2, 6])? })
        }
        sdhive_candle::Family::Sd => None,
    };
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

    // Untimed first merge: reads the file into the page cache.
    model.set_loras(std::slice::from_ref(&a)).context("merging the first LoRA")?;
    let mut apply = Vec::new();
    for i in 0..iters {
        model.set_loras(&[]).context("taking the LoRA out")?;
        sync(dev)?;
        apply.push(timed(dev, || Ok(model.set_loras(std::slice::from_ref(&a))?))?);
        eprintln!("apply {i}: {:.1} ms", apply[i].ms);
    }
    let kept = model.loras.kept_bytes();
    let used_merged = used_bytes(dev);
    let merged_step = steps(&model, dev, dtype, iters)?;
    eprintln!("step with the LoRA merged {:.2} ms", merged_step.median_ms);

    model.set_loras(std::slice::from_ref(&b)).context("merging the second LoRA")?;
    let mut switch = Vec::new();
    for i in 0..iters {
        let next = if i % 2 == 0 { &a } else { &b };
        switch.push(timed(dev, || Ok(model.set_loras(std::slice::from_ref(next))?))?);
        eprintln!("switch {i}: {:.1} ms", switch[i].ms);
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
        "kept_bytes": kept,
        "device_used_bytes": {"plain": used_plain, "merged": used_merged, "after_removal": used_after},
    }))
}
