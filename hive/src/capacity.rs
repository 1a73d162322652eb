//! Workers started on demand: when a request waits for a model that no worker has loaded and that no worker
//! can switch to without thrashing (all busy, or their models have requests waiting), the hive starts another
//! worker for it on a device that has room — below its worker cap (`max_workers_per_device`,
//! `max_cpu_workers`) and with free memory, read again when deciding, that fits the model's estimated
//! footprint — so that two models can sit on one large GPU. Such a worker that has had nothing to do for
//! `idle_worker_secs` is stopped again, so its memory returns. The estimate (`estimate`), the decision over
//! the devices (`decide`) and the loop that applies both (`run`) are here; the policy is documented in
//! `docs/operations.md` ("Workers on demand").

use crate::detect;
use crate::plan::{self, Row, Status};
use crate::registry::{OnDemand, WorkerStatus};
use crate::router;
use crate::supervisor::{self, Spec};
use crate::{models, Hive, State};
use sdhive_engine::memory::{MmditShape, ModelShape, SD3_CONTEXT_TOKENS};
use sdhive_protocol::WorkerState;
use serde::Serialize;
use shared_worker::Backend;
use std::collections::HashMap;
use std::io::Read;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What one more worker process costs beyond its model, on a GPU: the driver context, the BLAS/DNN
/// workspaces and the allocator's slack (a CUDA context alone is 0.3–0.6 GiB).
pub const GPU_WORKER_OVERHEAD_BYTES: u64 = 1 << 30;
/// The same on the CPU: the process, its thread pools and the allocator's slack.
pub const CPU_WORKER_OVERHEAD_BYTES: u64 = 256 << 20;
/// A safetensors header is a few hundred KB; the cap stops a corrupt length from allocating gigabytes.
const MAX_HEADER_BYTES: u64 = 100 << 20;
/// How long a device gets no on-demand worker after one failed to come up there.
const FAILED_START_COOLDOWN: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Sd1,
    Sd2,
    Sdxl,
    /// SD3 / SD3.5: an MMDiT in place of the UNet.
    Sd3,
}

/// The device memory a model needs in a worker of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Footprint {
    pub family: Family,
    /// The weights the engines load (UNet, text encoders, VAE), counted in the device's dtype.
    pub weights_bytes: u64,
    /// The engines' activation plan for one image with classifier-free guidance at the model's native size.
    pub activation_bytes: u64,
    pub overhead_bytes: u64,
}

impl Footprint {
    pub fn total(&self) -> u64 {
        self.weights_bytes + self.activation_bytes + self.overhead_bytes
    }
}

/// One tensor of a safetensors header: its dtype, shape and element count.
struct Tensor {
    name: String,
    dtype: String,
    shape: Vec<u64>,
    elements: u64,
}

fn read_tensors(path: &Path) -> Result<Vec<Tensor>, String> {
    let mut file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(|e| format!("{}: cannot read the header: {e}", path.display()))?;
    let len = u64::from_le_bytes(len);
    if len > MAX_HEADER_BYTES {
        return Err(format!("{}: header length {len} is not a safetensors header", path.display()));
    }
    let mut header = Vec::new();
    file.take(len)
        .read_to_end(&mut header)
        .map_err(|e| format!("{}: cannot read the header: {e}", path.display()))?;
    let table: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)
        .map_err(|e| format!("{}: the header is not a JSON object: {e}", path.display()))?;
    Ok(table
        .into_iter()
        .filter(|(name, _)| name != "__metadata__")
        .map(|(name, info)| {
            let dtype = info["dtype"].as_str().unwrap_or("F32").to_string();
            let shape: Option<Vec<u64>> =
                info["shape"].as_array().map(|dims| dims.iter().map(|d| d.as_u64().unwrap_or(0)).collect());
            // A scalar's shape is empty: one element.
            let elements = shape.as_ref().map_or(0, |dims| dims.iter().product());
            let shape = shape.unwrap_or_default();
            Tensor { name, dtype, shape, elements }
        })
        .collect())
}

/// Bytes of one element of `dtype` on a device computing in `float_bytes`-byte floats (integers keep theirs).
fn element_bytes(dtype: &str, float_bytes: u64) -> u64 {
    match dtype {
        "F64" | "F32" | "F16" | "BF16" | "F8_E4M3" | "F8_E5M2" => float_bytes,
        "I64" | "U64" => 8,
        "I32" | "U32" => 4,
        "I16" | "U16" => 2,
        _ => 1,
    }
}

/// The shape the engines plan activations with, by family (single files carry no config): native side,
/// first UNet level with attention, heads there.
fn family_defaults(family: Family) -> (u32, u32, u32) {
    match family {
        Family::Sd1 => (512, 0, 8),
        Family::Sd2 => (768, 0, 5),
        Family::Sdxl => (1024, 1, 10),
        Family::Sd3 => (1024, 0, 0),
    }
}

struct Parts {
    family: Family,
    /// Elements of each network's float tensors as (elements, dtype) — the VAE apart, which SDXL runs in f32.
    unet_and_text: Vec<(u64, String)>,
    vae: Vec<(u64, String)>,
    native: u32,
    first_attention_level: u32,
    heads: u32,
    /// SD3's MMDiT, which the planner counts over patch and text tokens.
    mmdit: Option<MmditShape>,
}

/// A single-file checkpoint: the LDM/SGM prefixes the engines load (EMA copies and the rest are not loaded), and
/// SD3's text encoders (`text_encoders.*`; an SD3.5 file's come from its folder and are not counted here).
fn single_file(path: &Path, with_t5: bool) -> Result<Parts, String> {
    let tensors = read_tensors(path)?;
    let sd3_width = tensors
        .iter()
        .find(|t| t.name == "model.diffusion_model.x_embedder.proj.weight")
        .and_then(|t| t.shape.first().copied());
    let family = if sd3_width.is_some() {
        Family::Sd3
    } else if tensors.iter().any(|t| t.name.starts_with("conditioner.embedders.1.")) {
        Family::Sdxl
    } else if tensors.iter().any(|t| t.name.starts_with("cond_stage_model.model.")) {
        Family::Sd2
    } else {
        Family::Sd1
    };
    let mut parts = Parts {
        family,
        unet_and_text: Vec::new(),
        vae: Vec::new(),
        native: 0,
        first_attention_level: 0,
        heads: 0,
        // SAI's MMDiTs have heads of 64 and 2×2 patches.
        mmdit: sd3_width.map(|w| MmditShape {
            hidden: w as u32,
            heads: (w / 64).max(1) as u32,
            patch: 2,
            context_tokens: SD3_CONTEXT_TOKENS,
        }),
    };
    let tensors_of_sd3 = tensors.iter().any(|t| t.name.starts_with("model.diffusion_model.joint_blocks."));
    let names: Vec<String> = tensors.iter().map(|t| t.name.clone()).collect();
    for t in tensors {
        if !with_t5 && t.name.starts_with("text_encoders.t5xxl.") {
            continue;
        }
        if t.name.starts_with("first_stage_model.") {
            parts.vae.push((t.elements, t.dtype));
        } else if ["model.diffusion_model.", "cond_stage_model.", "conditioner.", "text_encoders."]
            .iter()
            .any(|p| t.name.starts_with(p))
        {
            parts.unet_and_text.push((t.elements, t.dtype));
        }
    }
    if parts.unet_and_text.is_empty() {
        return Err(format!("{}: no UNet or text encoder tensors (not a checkpoint)", path.display()));
    }
    // An SD3 file without some text encoder (SD3.5 files carry none) loads it from the diffusers folder of its
    // name beside it, as the worker does.
    if tensors_of_sd3 {
        let beside = path.with_extension("");
        for (prefix, component) in [
            ("text_encoders.clip_l.", "text_encoder"),
            ("text_encoders.clip_g.", "text_encoder_2"),
            ("text_encoders.t5xxl.", "text_encoder_3"),
        ] {
            if names.iter().any(|n| n.starts_with(prefix)) || (!with_t5 && component == "text_encoder_3") {
                continue;
            }
            for file in component_files(&beside.join(component)) {
                for t in read_tensors(&file)? {
                    parts.unet_and_text.push((t.elements, t.dtype));
                }
            }
        }
    }
    (parts.native, parts.first_attention_level, parts.heads) = family_defaults(family);
    Ok(parts)
}

/// The weight files of one diffusers component: the plain ones (every shard), else whatever variant is there.
fn component_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut files: Vec<std::path::PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    let plain: Vec<std::path::PathBuf> = files
        .iter()
        .filter(|p| p.file_stem().is_some_and(|s| !s.to_string_lossy().contains('.')))
        .cloned()
        .collect();
    if plain.is_empty() {
        files
    } else {
        plain
    }
}

/// A diffusers folder: its components' safetensors, and the UNet config for the native size and attention.
fn diffusers(dir: &Path, with_t5: bool) -> Result<Parts, String> {
    let config: serde_json::Value = std::fs::read_to_string(dir.join("unet/config.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    // SD3's denoiser is a transformer with its own config; its sample size gives the native size all the same.
    let transformer: serde_json::Value = std::fs::read_to_string(dir.join("transformer/config.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    let number = |key: &str| transformer[key].as_u64().map(|v| v as u32);
    let mmdit = match (number("num_attention_heads"), number("attention_head_dim")) {
        (Some(heads), Some(head)) => Some(MmditShape {
            hidden: heads * head,
            heads,
            patch: number("patch_size").unwrap_or(2),
            context_tokens: SD3_CONTEXT_TOKENS,
        }),
        _ => None,
    };
    let family = if mmdit.is_some() {
        Family::Sd3
    } else if dir.join("text_encoder_2").is_dir() {
        Family::Sdxl
    } else if config["cross_attention_dim"].as_u64() == Some(1024) {
        Family::Sd2
    } else {
        Family::Sd1
    };
    let (mut native, mut level, mut heads) = family_defaults(family);
    if let Some(side) = config["sample_size"].as_u64().or(transformer["sample_size"].as_u64()) {
        native = (side * 8) as u32;
    }
    let kinds = config["down_block_types"].as_array();
    if let Some(l) =
        kinds.and_then(|k| k.iter().position(|b| b.as_str().is_some_and(|b| b.contains("CrossAttn"))))
    {
        level = l as u32;
        let per_level = |v: &serde_json::Value| v.as_u64().or_else(|| v.get(l).and_then(|x| x.as_u64()));
        if let Some(h) =
            per_level(&config["num_attention_heads"]).or_else(|| per_level(&config["attention_head_dim"]))
        {
            heads = h as u32;
        }
    }
    let mut parts = Parts {
        family,
        unet_and_text: Vec::new(),
        vae: Vec::new(),
        native,
        first_attention_level: level,
        heads,
        mmdit,
    };
    for component in ["unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "vae"] {
        if !with_t5 && component == "text_encoder_3" {
            continue;
        }
        let folder = dir.join(component);
        if !folder.is_dir() {
            continue;
        }
        let files = component_files(&folder);
        if files.is_empty() {
            return Err(format!("{}: no .safetensors weights", folder.display()));
        }
        for file in files {
            for t in read_tensors(&file)? {
                let slot = if component == "vae" { &mut parts.vae } else { &mut parts.unet_and_text };
                slot.push((t.elements, t.dtype));
            }
        }
    }
    if parts.unet_and_text.is_empty() {
        return Err(format!("{}: no UNet or transformer weights", dir.display()));
    }
    Ok(parts)
}

/// The footprint of the checkpoint at `path` (a single file or a diffusers folder) in a worker of `backend`:
/// its weights as the engines load them (the UNet, text encoders and VAE tensors, in the backend's default
/// dtype: f32 on the CPU, f16 on GPUs, the SDXL VAE in f32 as diffusers upcasts it), plus the activation plan
/// of `sdhive_engine::memory` for a native-size image with classifier-free guidance (two images per UNet
/// call, attention scores unchunked: an upper bound), plus the worker's own overhead. Reads headers only.
pub fn estimate(path: &Path, backend: Backend) -> Result<Footprint, String> {
    estimate_with(path, backend, true)
}

/// [`estimate`], with SD3's T5 left out when the workers run without it (`no_t5`).
pub fn estimate_with(path: &Path, backend: Backend, with_t5: bool) -> Result<Footprint, String> {
    let parts = if path.is_dir() { diffusers(path, with_t5)? } else { single_file(path, with_t5)? };
    let float_bytes: u64 = if backend == Backend::Cpu { 4 } else { 2 };
    let vae_float = if parts.family == Family::Sdxl { 4 } else { float_bytes };
    let bytes =
        |list: &[(u64, String)], fb: u64| list.iter().map(|(n, d)| n * element_bytes(d, fb)).sum::<u64>();
    let weights_bytes = bytes(&parts.unet_and_text, float_bytes) + bytes(&parts.vae, vae_float);
    let shape = ModelShape {
        weights_bytes,
        activation_bytes: float_bytes,
        vae_factor: 8,
        first_attention_level: parts.first_attention_level,
        heads_at_first_attention: parts.heads,
        // The candle engine's fused attention on CUDA keeps no score matrix.
        fused_attention: backend == Backend::Cuda,
        score_chunk_elements: None,
        vae_tile_latent: 64,
        mmdit: parts.mmdit,
    };
    let side = parts.native.max(8);
    let activation_bytes =
        shape.plan(side, side, 2, None, true, true).map(|p| p.activation_bytes).unwrap_or(0);
    let overhead_bytes =
        if backend == Backend::Cpu { CPU_WORKER_OVERHEAD_BYTES } else { GPU_WORKER_OVERHEAD_BYTES };
    Ok(Footprint { family: parts.family, weights_bytes, activation_bytes, overhead_bytes })
}

/// One device as the decision sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Room {
    pub backend: Backend,
    pub index: usize,
    /// Workers on it now (up, starting or stopping), and the most it may run.
    pub workers: usize,
    pub cap: usize,
    /// Free memory measured now.
    pub free_bytes: Option<u64>,
    /// `device_memory`, when stated, and the footprints of the models the hive's workers there hold (`None`:
    /// one of them is unknown).
    pub stated_bytes: Option<u64>,
    pub held_bytes: Option<u64>,
    /// An on-demand worker failed to come up here lately.
    pub cooling: bool,
    /// What the wanted model needs in a worker here (footprints differ by backend), or why that is unknown.
    pub need: Result<Footprint, String>,
}

impl Room {
    /// What another worker may use here: the measured free memory, capped by what the stated memory leaves
    /// beside the hive's workers' models; `None` when neither is known.
    pub fn available(&self) -> Option<u64> {
        let left = match (self.stated_bytes, self.held_bytes) {
            (Some(s), Some(h)) => Some(s.saturating_sub(h)),
            (Some(_), None) => Some(0),
            (None, _) => None,
        };
        match (self.free_bytes, left) {
            (Some(f), Some(l)) => Some(f.min(l)),
            (f, l) => f.or(l),
        }
    }

    fn name(&self) -> String {
        format!("{}:{}", self.backend, self.index)
    }
}

/// What [`decide`] found.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Start a worker on this device, which has `available` bytes for a model needing `need`.
    Start { backend: Backend, index: usize, available: u64, need: Footprint },
    /// No device has room; why, device by device.
    NoRoom(String),
}

pub fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// The device with the most room for the wanted model: below its worker cap, not cooling down after a failed
/// start, and with at least the model's footprint available.
pub fn decide(rooms: &[Room]) -> Verdict {
    let mut why = Vec::new();
    let mut best: Option<(&Room, u64, Footprint)> = None;
    for r in rooms {
        if r.workers >= r.cap {
            why.push(format!("{} runs {} of its {} workers", r.name(), r.workers, r.cap));
            continue;
        }
        if r.cooling {
            why.push(format!("{}: an on-demand worker failed to start there lately", r.name()));
            continue;
        }
        let need = match &r.need {
            Ok(fp) => *fp,
            Err(e) => {
                why.push(format!("{}: the model's memory cannot be estimated: {e}", r.name()));
                continue;
            }
        };
        match r.available() {
            None => {
                why.push(format!("{}: its free memory is unknown (state it with device_memory)", r.name()))
            }
            Some(a) if a < need.total() => {
                why.push(format!("{}: {} available, about {} needed", r.name(), gib(a), gib(need.total())))
            }
            Some(a) => {
                if best.is_none_or(|(_, b, _)| a > b) {
                    best = Some((r, a, need));
                }
            }
        }
    }
    match best {
        Some((r, available, need)) => Verdict::Start { backend: r.backend, index: r.index, available, need },
        None if why.is_empty() => Verdict::NoRoom("no device serves workers".into()),
        None => Verdict::NoRoom(why.join("; ")),
    }
}

/// A model that waits with nowhere to go, and the devices it might get a worker on.
struct Want {
    model: String,
    title: String,
    rooms: Vec<Draft>,
}

/// A served device's part of a [`Room`], read under the state lock.
struct Draft {
    backend: Backend,
    index: usize,
    workers: usize,
    cap: usize,
    stated: Option<u64>,
    held: Vec<String>,
    cooling: bool,
    /// The latest free memory a worker there reported, for devices no tool reports on.
    reported_free: Option<u64>,
}

/// The oldest waiting request's model that deserves a worker of its own: one no worker can take now (none
/// holds it with a free slot, none can switch to it without thrashing), from the catalogue (a started worker
/// loads only those), that no worker holds or is starting with. Nothing while any managed worker is still
/// coming up (one start at a time, so each decision sees the memory the last one took), or while the hive
/// drains.
fn wanted(hive: &Hive, state: &State, rows: &[Row], now: Instant) -> Option<Want> {
    if state.draining {
        return None;
    }
    if state.workers.values().any(|w| w.managed && w.status == WorkerStatus::Starting && !w.stop_requested) {
        return None;
    }
    let model = state.queue.iter().find_map(|t| {
        let m = t.model.as_deref()?;
        let wanted = models::in_catalog(&state.catalog, m)
            && !state.workers.values().any(|w| router::may_serve(w) && w.loaded.as_deref() == Some(m))
            && !router::placeable(hive, state, m, t.since, now);
        wanted.then_some(m)
    })?;
    let rooms = rows
        .iter()
        .filter_map(|r| match &r.status {
            Status::Selected { max_workers, .. } => Some((r, *max_workers)),
            _ => None,
        })
        .map(|(r, cap)| {
            let (backend, index) = (r.device.backend, r.device.index);
            let here: Vec<&crate::registry::WorkerEntry> = state
                .workers
                .values()
                .filter(|w| w.managed && w.backend == backend.name() && w.device_index == Some(index))
                .collect();
            let live: Vec<_> = here.iter().filter(|w| w.occupies_device()).collect();
            let cooling = here.iter().any(|w| {
                w.on_demand.as_ref().and_then(|o| o.ended.as_ref()).is_some_and(|(at, _, failed)| {
                    *failed && now.saturating_duration_since(*at) < FAILED_START_COOLDOWN
                })
            });
            Draft {
                backend,
                index,
                workers: live.len(),
                cap,
                stated: hive.config.stated_memory(backend, index),
                held: live.iter().filter_map(|w| w.loaded.clone().or(w.planned_source.clone())).collect(),
                cooling,
                reported_free: live.iter().filter_map(|w| w.heartbeat.as_ref()?.memory_free_bytes).max(),
            }
        })
        .collect();
    Some(Want { model: model.to_string(), title: models::title_of(state, model), rooms })
}

/// Estimates, cached by (model, backend) for the life of the hive (a checkpoint's file does not change
/// under its path without a rescan, and a wrong guess costs one worker at most).
type Estimates = HashMap<(String, Backend), Result<Footprint, String>>;

async fn footprint(
    cache: &mut Estimates,
    model: &str,
    backend: Backend,
    with_t5: bool,
) -> Result<Footprint, String> {
    let key = (model.to_string(), backend);
    if let Some(hit) = cache.get(&key) {
        return hit.clone();
    }
    let path = std::path::PathBuf::from(model);
    let result = tokio::task::spawn_blocking(move || estimate_with(&path, backend, with_t5))
        .await
        .unwrap_or_else(|e| Err(e.to_string()));
    cache.insert(key, result.clone());
    result
}

/// Stops on-demand workers idle for `idle_worker_secs` (nothing of the hive's on them, their worker idle,
/// nothing waiting for their model).
fn stop_idle(hive: &Arc<Hive>, now: Instant) {
    let idle = hive.config.idle_worker();
    let stopping: Vec<(String, String)> = {
        let mut state = hive.lock();
        let waiting: Vec<String> = state.queue.iter().filter_map(|t| t.model.clone()).collect();
        let mut out = Vec::new();
        for w in state.workers.values_mut() {
            let Some(o) = w.on_demand.as_mut() else { continue };
            let quiet = w.heartbeat.as_ref().is_none_or(|h| h.state == WorkerState::Idle);
            let since = w.last_active.unwrap_or(o.started_at);
            let still_wanted = w.loaded.as_ref().is_some_and(|m| waiting.contains(m));
            if o.ended.is_some()
                || w.stop_requested
                || w.status != WorkerStatus::Ready
                || w.inflight > 0
                || !quiet
                || still_wanted
                || now.saturating_duration_since(since) < idle
            {
                continue;
            }
            let secs = now.saturating_duration_since(since).as_secs_f64();
            let why = format!("idle for {secs:.0} s (idle_worker_secs)");
            o.ended = Some((now, why.clone(), false));
            w.stop_requested = true;
            w.status = WorkerStatus::Draining;
            out.push((w.id.clone(), why));
        }
        state.metrics.on_demand_stopped += out.len() as u64;
        out
    };
    for (id, why) in stopping {
        tracing::info!(worker = %id, "stopping a worker started on demand: {why}; its memory returns");
        tokio::spawn(crate::api::drain_and_stop(hive.clone(), id));
    }
}

/// A worker id for the next worker on `backend:index`: `HOST-BACKENDINDEX.k`, the first k free (or held by
/// an on-demand worker that ended).
fn next_id(state: &State, backend: Backend, index: usize) -> String {
    let host = plan::host_prefix();
    (1..64)
        .map(|k| format!("{host}-{backend}{index}.{k}"))
        .find(|id| state.workers.get(id).is_none_or(|w| w.on_demand.is_some() && !w.occupies_device()))
        .unwrap_or_else(|| format!("{host}-{backend}{index}.{}", crate::random_hex(3)))
}

/// Starts a worker for `model` on `backend:index` with `reason`; its id.
fn start_worker(hive: &Arc<Hive>, model: &str, backend: Backend, index: usize, reason: String) -> String {
    let id = next_id(&hive.lock(), backend, index);
    let mut supervisors = hive.supervisors.lock().unwrap_or_else(|p| p.into_inner());
    let port = match hive.config.worker_port_base {
        0 => 0,
        base => base.saturating_add(u16::try_from(supervisors.len()).unwrap_or(u16::MAX)),
    };
    let worker = plan::PlannedWorker {
        worker_id: id.clone(),
        backend,
        device_index: index,
        model: Some(model.to_string()),
        binary: plan::binary_path(&plan::workers_dir(&hive.config), backend),
    };
    let on_demand =
        Some(OnDemand { model: model.to_string(), reason, started_at: Instant::now(), ended: None });
    let handle = supervisor::start(hive, Spec { worker, port, on_demand });
    if let Some(old) = supervisors.insert(id.clone(), handle) {
        old.task.abort();
    }
    id
}

/// What a look decided about a waiting model.
#[derive(Debug, Clone, PartialEq)]
struct Decision {
    model: String,
    started: bool,
    text: String,
}

/// Looks once: stops idle on-demand workers, and (when `read_memory`) starts one for the oldest waiting model
/// that deserves it if a device has room. `None`: nothing to decide.
async fn look(hive: &Arc<Hive>, cache: &mut Estimates, read_memory: bool) -> Option<Decision> {
    let now = Instant::now();
    stop_idle(hive, now);
    if !read_memory {
        return None;
    }
    let rows = hive.devices.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let want = wanted(hive, &hive.lock(), &rows, now)?;
    let mut rooms = Vec::new();
    for d in &want.rooms {
        let with_t5 = !hive.config.no_t5;
        let need = footprint(cache, &want.model, d.backend, with_t5).await;
        let mut held = Some(0u64);
        for m in &d.held {
            let add = footprint(cache, m, d.backend, with_t5).await.ok().map(|f| f.total());
            held = held.zip(add).map(|(a, b)| a + b);
        }
        let free = if d.workers < d.cap && !d.cooling {
            detect::free_memory(d.backend, d.index).await.or(d.reported_free)
        } else {
            None
        };
        rooms.push(Room {
            backend: d.backend,
            index: d.index,
            workers: d.workers,
            cap: d.cap,
            free_bytes: free,
            stated_bytes: d.stated,
            held_bytes: held,
            cooling: d.cooling,
            need,
        });
    }
    let (backend, index, available, fp) = match decide(&rooms) {
        Verdict::Start { backend, index, available, need } => (backend, index, available, need),
        Verdict::NoRoom(why) => {
            let text = format!(
                "{} waits with no worker holding it and none able to switch to it now; no worker started for \
                 it: {why}",
                want.title
            );
            return Some(Decision { model: want.model, started: false, text });
        }
    };
    // Still wanted? Requests may have moved while memory was read.
    {
        let state = hive.lock();
        let still = !state.draining
            && state.queue.iter().any(|t| t.model.as_deref() == Some(want.model.as_str()))
            && !state
                .workers
                .values()
                .any(|w| router::may_serve(w) && w.loaded.as_deref() == Some(want.model.as_str()));
        if !still {
            return None;
        }
    }
    let reason = format!(
        "{} waited with no worker holding it and none able to switch to it without thrashing (all busy, or \
         their models have requests waiting); {backend}:{index} has {} available and the model needs about {} \
         ({} weights, {} activations, {} for the worker)",
        want.title,
        gib(available),
        gib(fp.total()),
        gib(fp.weights_bytes),
        gib(fp.activation_bytes),
        gib(fp.overhead_bytes)
    );
    let id = start_worker(hive, &want.model, backend, index, reason.clone());
    hive.lock().metrics.on_demand_started += 1;
    let text = format!("started worker {id} on {backend}:{index}: {reason}");
    Some(Decision { model: want.model, started: true, text })
}

/// After a look that found no room, memory is read again no sooner than this (reading it runs `nvidia-smi`).
const NO_ROOM_RECHECK: Duration = Duration::from_secs(2);

/// A model's "no room" is logged again after this long at most (its free memory may wobble meanwhile).
const NO_ROOM_LOG_EVERY: Duration = Duration::from_secs(60);

/// The hive's on-demand loop: looks whenever requests are left waiting after a pump (and every second, for
/// idle workers), until the hive shuts down. Every decision is kept for `GET /v1/workers`; starts are logged,
/// and why a model gets no worker when that is new.
pub async fn run(hive: Arc<Hive>) {
    let mut cache = Estimates::new();
    let mut stop = hive.shutdown.subscribe();
    let mut no_room_at: Option<Instant> = None;
    let mut logged: Option<(String, Instant)> = None;
    loop {
        tokio::select! {
            _ = hive.capacity_wake.notified() => {}
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let read_memory = no_room_at.is_none_or(|t| t.elapsed() >= NO_ROOM_RECHECK);
        let Some(d) = look(&hive, &mut cache, read_memory).await else { continue };
        no_room_at = (!d.started).then(Instant::now);
        let repeat = logged.as_ref().is_some_and(|(m, at)| *m == d.model && at.elapsed() < NO_ROOM_LOG_EVERY);
        if d.started || !repeat {
            tracing::info!("on demand: {}", d.text);
            logged = (!d.started).then(|| (d.model.clone(), Instant::now()));
        }
        hive.lock().on_demand_note = Some(d.text);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::HiveConfig;
    use crate::detect::{Device, Vendor};
    use crate::registry::tests::request;
    use crate::registry::WorkerEntry;
    use crate::router::Ticket;

    const GIB: u64 = 1 << 30;

    fn fixture(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models").join(name)
    }

    #[test]
    fn footprints_count_the_loaded_weights_in_the_device_dtype() {
        // SD 1.x single file: f32 on disk, EMA and schedule buffers not loaded.
        let cpu = estimate(&fixture("sd1.safetensors"), Backend::Cpu).unwrap();
        let gpu = estimate(&fixture("sd1.safetensors"), Backend::Cuda).unwrap();
        assert_eq!((cpu.family, gpu.family), (Family::Sd1, Family::Sd1));
        let floats = 1_106_212 + 84_998 + 81_215;
        assert!(cpu.weights_bytes >= floats * 4 && cpu.weights_bytes < floats * 4 + 1000, "{cpu:?}");
        assert!(gpu.weights_bytes >= floats * 2 && gpu.weights_bytes < floats * 2 + 1000, "{gpu:?}");
        // No native size in a single file: SD 1.x plans 512² (the VAE decode dominates: 1.5 GiB in f16), in f32
        // and with unfused attention on the CPU.
        assert_eq!(gpu.activation_bytes, 3 * GIB / 2, "{gpu:?}");
        assert!(cpu.activation_bytes > 2 * gpu.activation_bytes - GIB / 8, "{cpu:?}");
        assert_eq!(
            (cpu.overhead_bytes, gpu.overhead_bytes),
            (CPU_WORKER_OVERHEAD_BYTES, GPU_WORKER_OVERHEAD_BYTES)
        );

        // SDXL single file: f16 on disk; on a GPU the VAE counts in f32 (diffusers upcasts it).
        let xl = estimate(&fixture("sdxl.safetensors"), Backend::Cuda).unwrap();
        assert_eq!(xl.family, Family::Sdxl);
        assert_eq!(xl.weights_bytes, (1_377_124 + 236_867) * 2 + 81_215 * 4);
        assert_eq!(
            estimate(&fixture("sdxl.safetensors"), Backend::Cpu).unwrap().weights_bytes,
            (1_377_124 + 236_867 + 81_215) * 4
        );

        // SD3: the transformer and all three text encoders count, in a folder as in its single file (f32 here, so
        // the same bytes on the CPU); the sample size of the transformer's config gives the native size.
        let sd3 = estimate(&fixture("sd3"), Backend::Cpu).unwrap();
        let file_bytes: u64 = std::fs::read_dir(fixture("sd3"))
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.path().is_dir())
            .flat_map(|e| component_files(&e.path()))
            .map(|f| std::fs::metadata(f).unwrap().len())
            .sum();
        assert!(
            sd3.weights_bytes > file_bytes * 9 / 10 && sd3.weights_bytes <= file_bytes,
            "{sd3:?} vs {file_bytes}"
        );
        // Both are SD3, planned over the MMDiT's patch and text tokens: the folder at its config's native size
        // (64 px), the file, which carries no config, at SD3's 1024² (the VAE decode's 2944 f32 values a pixel).
        let single_file = estimate(&fixture("sd3.safetensors"), Backend::Cpu).unwrap();
        assert_eq!((sd3.family, single_file.family), (Family::Sd3, Family::Sd3));
        assert!(sd3.activation_bytes < 64 << 20, "{sd3:?}");
        assert!(single_file.activation_bytes > 2944 * 1024 * 1024 * 4, "{single_file:?}");
        // The single file lacks CLIP-L's 8×8 projection only (SAI files carry none; the identity stands in).
        let single = single_file.weights_bytes;
        assert_eq!(sd3.weights_bytes - single, 8 * 8 * 4);
        // Without T5 (the hive's `no_t5`) its weights do not count, in the folder as in the file.
        let t5_bytes: u64 = component_files(&fixture("sd3").join("text_encoder_3"))
            .iter()
            .map(|f| std::fs::metadata(f).unwrap().len())
            .sum();
        let folder_without = estimate_with(&fixture("sd3"), Backend::Cpu, false).unwrap().weights_bytes;
        let single_without =
            estimate_with(&fixture("sd3.safetensors"), Backend::Cpu, false).unwrap().weights_bytes;
        assert!(
            folder_without < sd3.weights_bytes && sd3.weights_bytes - folder_without <= t5_bytes,
            "{folder_without} vs {} (T5 files {t5_bytes} bytes)",
            sd3.weights_bytes
        );
        assert_eq!(single - single_without, sd3.weights_bytes - folder_without, "the same T5 in both");
        // An SD3.5 file carries no text encoders: they come from the folder of its name beside it.
        let sd35m = estimate(&fixture("sd35m"), Backend::Cpu).unwrap().weights_bytes;
        let sd35m_file = estimate(&fixture("sd35m.safetensors"), Backend::Cpu).unwrap().weights_bytes;
        let encoders: u64 = ["text_encoder", "text_encoder_2", "text_encoder_3"]
            .iter()
            .flat_map(|c| component_files(&fixture("sd35m").join(c)))
            .map(|f| std::fs::metadata(f).unwrap().len())
            .sum();
        assert!(encoders > 0);
        assert_eq!(
            sd35m_file, sd35m,
            "the file's networks and the folder's encoders are the folder's weights"
        );

        // Diffusers folders: their components' weights, the UNet config's native size (64 px here).
        let folder = estimate(&fixture("sdxl"), Backend::Cpu).unwrap();
        assert_eq!(folder.family, Family::Sdxl);
        assert!(folder.weights_bytes > 0 && folder.activation_bytes < 64 << 20, "{folder:?}");
        assert_eq!(
            estimate(&fixture("sd2v"), Backend::Cpu).unwrap().family,
            Family::Sd1,
            "tiny SD2 fixture: 32-wide text"
        );
        assert_eq!(estimate(&fixture("sd1"), Backend::Cpu).unwrap().family, Family::Sd1);

        // Not a checkpoint: said, not guessed.
        let dir = tempfile::tempdir().unwrap();
        let junk = dir.path().join("x.safetensors");
        std::fs::write(&junk, b"not a safetensors file at all").unwrap();
        assert!(estimate(&junk, Backend::Cpu).is_err());
        assert!(estimate(&dir.path().join("missing"), Backend::Cpu).is_err());
    }

    fn need(total: u64) -> Result<Footprint, String> {
        Ok(Footprint {
            family: Family::Sdxl,
            weights_bytes: total - GIB,
            activation_bytes: 0,
            overhead_bytes: GIB,
        })
    }

    fn gpu(index: usize, workers: usize, free: Option<u64>) -> Room {
        Room {
            backend: Backend::Cuda,
            index,
            workers,
            cap: 2,
            free_bytes: free,
            stated_bytes: None,
            held_bytes: Some(0),
            cooling: false,
            need: need(12 * GIB),
        }
    }

    #[test]
    fn a_worker_starts_on_the_device_with_the_most_room_that_fits_the_model() {
        // An 80 GB H100 with one SDXL worker (about 70 GB free) and a 24 GB card nearly full.
        let rooms = [gpu(0, 1, Some(70 * GIB)), gpu(1, 1, Some(3 * GIB))];
        assert!(
            matches!(decide(&rooms), Verdict::Start { backend: Backend::Cuda, index: 0, available, .. } if available == 70 * GIB)
        );
        // Both fit: the roomier one.
        let rooms = [gpu(0, 1, Some(20 * GIB)), gpu(1, 1, Some(30 * GIB))];
        assert!(matches!(decide(&rooms), Verdict::Start { index: 1, .. }));

        // None fits: each device says why.
        let rooms = [gpu(0, 2, Some(70 * GIB)), gpu(1, 1, Some(3 * GIB)), gpu(2, 1, None)];
        let Verdict::NoRoom(why) = decide(&rooms) else { panic!("nothing fits") };
        assert!(why.contains("cuda:0 runs 2 of its 2 workers"), "{why}");
        assert!(why.contains("cuda:1: 3.0 GiB available, about 12.0 GiB needed"), "{why}");
        assert!(why.contains("cuda:2: its free memory is unknown"), "{why}");

        // A stated budget caps what the measured free memory allows: 40 GB stated, 30 GB held by the workers.
        let mut budget = gpu(0, 1, Some(70 * GIB));
        budget.stated_bytes = Some(40 * GIB);
        budget.held_bytes = Some(30 * GIB);
        assert_eq!(budget.available(), Some(10 * GIB));
        assert!(matches!(decide(std::slice::from_ref(&budget)), Verdict::NoRoom(_)));
        budget.held_bytes = Some(20 * GIB);
        assert!(
            matches!(decide(std::slice::from_ref(&budget)), Verdict::Start { available, .. } if available == 20 * GIB)
        );
        // Stated alone (a device no tool measures) is enough; a held model of unknown size leaves nothing.
        budget.free_bytes = None;
        assert_eq!(budget.available(), Some(20 * GIB));
        budget.held_bytes = None;
        assert_eq!(budget.available(), Some(0));

        // After a failed start the device is left alone for a while; an unestimable model goes nowhere.
        let mut cooling = gpu(0, 1, Some(70 * GIB));
        cooling.cooling = true;
        assert!(matches!(decide(&[cooling]), Verdict::NoRoom(w) if w.contains("failed to start")));
        let mut unknown = gpu(0, 1, Some(70 * GIB));
        unknown.need = Err("no UNet weights".into());
        assert!(matches!(decide(&[unknown]), Verdict::NoRoom(w) if w.contains("no UNet weights")));
    }

    fn device(backend: Backend, index: usize, total: u64, free: u64) -> Device {
        Device {
            backend,
            index,
            vendor: Vendor::Nvidia,
            name: format!("{backend}{index}"),
            memory_total_bytes: Some(total),
            memory_free_bytes: Some(free),
            driver: None,
            software: false,
            arch: None,
        }
    }

    /// A hive over a library of two fixture checkpoints, on two fake 80 GB GPUs each running a busy worker
    /// with the first model, which reports `free` bytes free on its device.
    fn busy_node(free: [u64; 2]) -> (Arc<Hive>, Vec<String>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        for (i, f) in ["sd1.safetensors", "sdxl.safetensors"].iter().enumerate() {
            std::fs::copy(fixture(f), dir.path().join(format!("m{i}.safetensors"))).unwrap();
        }
        let config = HiveConfig {
            worker_slots: 1,
            models_dirs: vec![dir.path().into()],
            workers_dir: Some(dir.path().join("no-workers-here")),
            ..Default::default()
        };
        let (catalog, sources) = models::scan_for_tests(&config);
        let devices =
            [device(Backend::Cuda, 0, 80 * GIB, free[0]), device(Backend::Cuda, 1, 80 * GIB, free[1])];
        let rows = plan::plan(&devices, &config, |_: &std::path::Path| true).rows;
        let hive = Hive::new(config, "t".into(), "http://hive".into()).unwrap();
        *hive.devices.lock().unwrap() = rows;
        {
            let mut state = hive.lock();
            state.catalog = catalog;
            for (i, free) in free.into_iter().enumerate() {
                let id = format!("w{i}");
                state.workers.insert(id.clone(), WorkerEntry::managed(&id, "cuda", i, None));
                let mut req = request(&id, &format!("http://h:{i}"), i as u32 + 1);
                req.backend = "cuda".into();
                req.device.index = i;
                req.model_source = Some(sources[0].clone());
                req.switchable = true;
                state.register(req, Instant::now()).unwrap();
                let w = state.workers.get_mut(&id).unwrap();
                w.inflight = 1;
                w.heartbeat = Some(sdhive_protocol::Heartbeat {
                    worker_id: id.clone(),
                    state: WorkerState::Busy,
                    queue_depth: 0,
                    running_job: None,
                    memory_total_bytes: Some(80 * GIB),
                    memory_free_bytes: Some(free),
                    jobs_succeeded: 0,
                    jobs_failed: 0,
                    jobs_cancelled: 0,
                    uptime_secs: 1.0,
                    model: None,
                    model_source: Some(sources[0].clone()),
                    library: None,
                    node: None,
                });
            }
        }
        (hive, sources, dir)
    }

    fn wait_for(state: &mut State, model: &str) -> tokio::sync::oneshot::Receiver<router::Slot> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        state.queue.push_back(Ticket {
            waiting: router::Waiting::Sync(tx),
            model: Some(model.into()),
            since: Instant::now(),
            avoid: None,
        });
        rx
    }

    #[tokio::test]
    async fn a_model_no_worker_can_take_gets_a_worker_where_memory_allows() {
        let (hive, m, _dir) = busy_node([3 * GIB, 60 * GIB]);
        let mut cache = Estimates::new();
        // Nothing waits: nothing to start.
        assert_eq!(look(&hive, &mut cache, true).await, None);
        // A request for the first model waits for a busy worker that has it: no new worker for it.
        let _a = wait_for(&mut hive.lock(), &m[0]);
        assert_eq!(look(&hive, &mut cache, true).await, None);
        // One for the second model, which no worker has, while both are busy: a worker for it on cuda:1, the
        // device with room.
        let _b = wait_for(&mut hive.lock(), &m[1]);
        let note = look(&hive, &mut cache, true).await.unwrap();
        assert!(note.started && note.model == m[1], "{note:?}");
        let note = note.text;
        assert!(note.starts_with("started worker") && note.contains("on cuda:1"), "{note}");
        assert!(note.contains("60.0 GiB available"), "{note}");
        {
            let state = hive.lock();
            let extra = state.workers.values().find(|w| w.on_demand.is_some()).unwrap();
            assert_eq!((extra.device_index, extra.planned_source.as_deref()), (Some(1), Some(m[1].as_str())));
            assert!(extra.id.ends_with("-cuda1.1"), "{}", extra.id);
            assert!(router::awaited(&state, &m[1]), "other workers are not switched to it meanwhile");
            assert_eq!(state.metrics.on_demand_started, 1);
        }
        // While it comes up, nothing else starts.
        assert_eq!(look(&hive, &mut cache, true).await, None);
        // And an idle worker is not switched to its model meanwhile; once it is gone, one is.
        let mut state = hive.lock();
        state.queue.retain(|t| t.model.as_deref() != Some(m[0].as_str()));
        state.workers.get_mut("w0").unwrap().inflight = 0;
        let now = Instant::now();
        assert!(!router::placeable(&hive, &state, &m[1], now, now));
        let extra = state.workers.values_mut().find(|w| w.on_demand.is_some()).unwrap();
        extra.status = WorkerStatus::Stopped;
        assert!(router::placeable(&hive, &state, &m[1], now, now));
    }

    #[tokio::test]
    async fn no_worker_starts_without_room_or_while_one_can_switch() {
        let (hive, m, _dir) = busy_node([3 * GIB, 2 * GIB]);
        let mut cache = Estimates::new();
        let _b = wait_for(&mut hive.lock(), &m[1]);
        let note = look(&hive, &mut cache, true).await.unwrap();
        assert!(!note.started, "{note:?}");
        let note = note.text;
        assert!(
            note.contains("no worker started for it") && note.contains("cuda:1: 2.0 GiB available"),
            "{note}"
        );
        assert!(hive.lock().workers.values().all(|w| w.on_demand.is_none()));

        // An idle worker whose model nobody waits for is switched instead.
        let (hive, m, _dir) = busy_node([60 * GIB, 60 * GIB]);
        hive.lock().workers.get_mut("w0").unwrap().inflight = 0;
        let _b = wait_for(&mut hive.lock(), &m[1]);
        assert!(router::placeable(&hive, &hive.lock(), &m[1], Instant::now(), Instant::now()));
        assert_eq!(look(&hive, &mut cache, true).await, None);
    }

    #[tokio::test]
    async fn idle_on_demand_workers_are_stopped() {
        let (hive, m, _dir) = busy_node([60 * GIB, 60 * GIB]);
        {
            let mut state = hive.lock();
            let w = state.workers.get_mut("w1").unwrap();
            w.on_demand = Some(OnDemand {
                model: m[0].clone(),
                reason: "test".into(),
                started_at: Instant::now(),
                ended: None,
            });
            w.inflight = 0;
            w.status = WorkerStatus::Ready;
            w.heartbeat.as_mut().unwrap().state = WorkerState::Idle;
            w.last_active = Some(Instant::now());
        }
        // Busy recently: kept.
        stop_idle(&hive, Instant::now());
        assert!(!hive.lock().workers["w1"].stop_requested);
        // Idle longer than idle_worker_secs, but its model is wanted: kept.
        let later = Instant::now() + hive.config.idle_worker() + Duration::from_secs(1);
        let _a = wait_for(&mut hive.lock(), &m[0]);
        stop_idle(&hive, later);
        assert!(!hive.lock().workers["w1"].stop_requested);
        hive.lock().queue.clear();
        stop_idle(&hive, later);
        let state = hive.lock();
        let w = &state.workers["w1"];
        assert!(w.stop_requested && w.status == WorkerStatus::Draining);
        let ended = &w.on_demand.as_ref().unwrap().ended;
        assert!(
            ended.as_ref().is_some_and(|(_, why, failed)| why.contains("idle for") && !failed),
            "{ended:?}"
        );
        assert!(!state.workers["w0"].stop_requested, "planned workers stay");
        assert_eq!(state.metrics.on_demand_stopped, 1);
    }
}
