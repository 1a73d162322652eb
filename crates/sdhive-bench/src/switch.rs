//! Model switches timed as a serving worker makes them (`--switch A --switch B`): the loaded engine is dropped,
//! then the next model is loaded, either from disk (the files in the page cache: each model is read once,
//! untimed, first) or from the RAM cache of recently used checkpoints, which a worker keeps by default. The
//! device's used memory is recorded after every cached switch, so growth across switches shows.

use crate::{sync, Timing};
use anyhow::{Context, Result};
use candle_core::{DType, Device};
use sdhive_candle::{CandleEngine, HostCache, LoadOptions};
use sdhive_modelsource::{ResolveOptions, ResolvedModel};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Instant;

/// Timed loads of each model straight from disk.
const DISK_LOADS: usize = 3;

fn load(
    model: &ResolvedModel,
    dev: &Device,
    dtype: DType,
    cache: Option<&mut HostCache>,
) -> Result<(CandleEngine, f64)> {
    let opts = LoadOptions::single_device(dev, dtype, "bench", "bench");
    let t = Instant::now();
    let engine = match cache {
        Some(cache) => CandleEngine::load_cached(model, opts, cache),
        None => CandleEngine::load(model, opts),
    }
    .with_context(|| format!("loading {}", model.location.path().display()))?;
    sync(dev)?;
    Ok((engine, t.elapsed().as_secs_f64() * 1e3))
}

fn used_bytes(dev: &Device) -> Option<u64> {
    match shared_worker::memory(&shared_worker::DeviceHandle::Candle(dev.clone())) {
        (Some(total), Some(free)) => Some(total.saturating_sub(free)),
        _ => None,
    }
}

pub fn run(dirs: &[PathBuf], dev: &Device, dtype: DType, switches: usize) -> Result<Value> {
    let opts = ResolveOptions { offline: true, ..ResolveOptions::from_env() };
    let models: Vec<ResolvedModel> = dirs
        .iter()
        .map(|d| {
            sdhive_modelsource::resolve(&d.display().to_string(), &opts)
                .with_context(|| d.display().to_string())
        })
        .collect::<Result<_>>()?;
    let name = |i: usize| dirs[i].display().to_string();

    // Page cache warm, kernels compiled: one untimed load of each.
    for m in &models {
        drop(load(m, dev, dtype, None)?);
    }
    let mut disk: Vec<Vec<f64>> = vec![Vec::new(); models.len()];
    for _ in 0..DISK_LOADS {
        for (i, m) in models.iter().enumerate() {
            let (engine, ms) = load(m, dev, dtype, None)?;
            drop(engine);
            sync(dev)?;
            disk[i].push(ms);
            eprintln!("disk {}: {ms:.0} ms", name(i));
        }
    }

    let mut cache = HostCache::new(models.len());
    let mut engine = None;
    // Filling the cache reads each model once more: a worker's first load of a model, through the cache.
    let mut fill = Vec::with_capacity(models.len());
    for (i, m) in models.iter().enumerate() {
        drop(engine.take());
        sync(dev)?;
        let (e, ms) = load(m, dev, dtype, Some(&mut cache))?;
        engine = Some(e);
        fill.push(ms);
        eprintln!("disk into the cache {}: {ms:.0} ms", name(i));
    }
    let mut ram: Vec<Vec<f64>> = vec![Vec::new(); models.len()];
    let mut used = Vec::with_capacity(switches);
    for s in 0..switches {
        let i = s % models.len();
        // As the worker's model host does: the loaded engine goes before the next is built.
        drop(engine.take());
        sync(dev)?;
        let (e, ms) = load(&models[i], dev, dtype, Some(&mut cache))?;
        engine = Some(e);
        ram[i].push(ms);
        used.push(used_bytes(dev));
        eprintln!(
            "ram {}: {ms:.0} ms, device used {:?} MiB",
            name(i),
            used.last().copied().flatten().map(|u| u >> 20)
        );
    }
    drop(engine);
    let timing = |calls: &[f64]| {
        let calls: Vec<crate::Call> = calls.iter().map(|&ms| crate::Call { ms, cpu_ms: 0.0 }).collect();
        Timing::new(&calls)
    };
    let per_model: Vec<Value> = (0..models.len())
        .map(|i| {
            json!({
                "model": name(i),
                "disk": timing(&disk[i]),
                "disk_into_cache_ms": fill[i],
                "ram": timing(&ram[i]),
            })
        })
        .collect();
    Ok(json!({
        "switch": per_model,
        "switches": switches,
        "device_used_bytes": used,
        "host_cache_bytes": cache.bytes(),
    }))
}
