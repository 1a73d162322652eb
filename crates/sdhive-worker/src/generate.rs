//! The `generate` subcommand: cheap checks first (arguments, output folder), then model resolution, device,
//! engine load and the denoising run with a progress bar and Ctrl-C cancellation, then PNGs with infotext.

use crate::cli::GenerateArgs;
use crate::engine::EngineOptions;
use crate::output::{check_output_path, output_format, output_paths};
use crate::request::{build_request, flag_for_field};
use anyhow::{anyhow, bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use sdhive_engine::{encode_image, Control, EngineError, Placement, Progress};
use sdhive_modelsource::ResolveOptions;
use shared_worker::Backend;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub fn run(backend: Backend, args: &GenerateArgs) -> anyhow::Result<()> {
    let mut req = build_request(args)?;
    let placement = Placement::parse(&args.placement, &args.offload)?;
    check_output_path(&args.output)?;
    let seed = match req.seed {
        Some(seed) => seed,
        None => random_seed()?,
    };
    req.seed = Some(seed);

    let env = ResolveOptions::from_env();
    let opts =
        ResolveOptions { model_roots: args.model_roots.clone(), offline: args.offline || env.offline, ..env };
    let mut model = sdhive_modelsource::resolve(&args.model, &opts)
        .with_context(|| format!("cannot use --model {}", args.model))?;
    model.vae = args
        .vae
        .as_ref()
        .map(|vae| {
            sdhive_modelsource::resolve_vae(vae, &opts)
                .with_context(|| format!("cannot use --vae {}", vae.display()))
        })
        .transpose()?;
    resolve_networks(args, &mut req, model.location.path())?;
    let (device, info) = shared_worker::init(backend, args.device)
        .with_context(|| format!("cannot open --device {} on backend {backend}", args.device))?;
    tracing::info!(model = %model.name, path = %model.location.path().display(), device = %info.name, %placement, "loading");
    let opts = EngineOptions {
        dtype: args.dtype.map(Into::into),
        placement,
        memory_budget: args.memory_budget,
        no_t5: args.no_t5,
        ..EngineOptions::default()
    };
    let mut engine = crate::engine::load(backend, device, &info, &model, opts)?;

    let cancel = install_ctrlc();
    // Printed once Ctrl-C is wired, so a wrapper that waits for this line can rely on clean cancellation.
    eprintln!("seed: {seed}");
    let bar = StepBar::new();
    let result = engine.generate(&req, &mut |p: &Progress| {
        bar.update(p);
        if cancel.load(Ordering::SeqCst) {
            Control::Cancel
        } else {
            Control::Continue
        }
    });
    bar.finish();
    let output = result.map_err(|e| match e {
        EngineError::Cancelled { .. } => anyhow!("cancelled"),
        EngineError::Invalid(v) => anyhow!("invalid {}: {}", flag_for_field(v.field), v.message),
        other => anyhow::Error::new(other).context("generation failed"),
    })?;

    let paths = output_paths(&args.output, req.n);
    if output.images.len() != paths.len() {
        bail!("the engine returned {} images, expected {}", output.images.len(), paths.len());
    }
    let format = sdhive_engine::OutputFormat::new(output_format(&args.output)?, 90);
    for (image, path) in output.images.iter().zip(&paths) {
        let bytes = encode_image(&image.image, Some(&image.infotext), format)
            .with_context(|| format!("cannot encode {}", path.display()))?;
        std::fs::write(path, bytes).with_context(|| format!("cannot write {}", path.display()))?;
        println!("{} (seed {})", path.display(), image.seed);
    }
    Ok(())
}

/// The prompt's `<lora:…>` tags and embedding names, resolved in `--lora-dir` / `--embeddings-dir` as the server
/// resolves them (same names, errors and hashes). Without those flags a tag is an error naming the flag, not text.
fn resolve_networks(
    args: &GenerateArgs,
    req: &mut sdhive_engine::GenerateRequest,
    model: &std::path::Path,
) -> anyhow::Result<()> {
    let config = sdhive_catalog::NetworksConfig {
        lora_dirs: args.lora_dirs.clone(),
        embeddings_dirs: args.embeddings_dirs.clone(),
        models_dirs: Vec::new(),
        hash_cache: sdhive_catalog::default_hash_cache(),
    };
    let networks =
        sdhive_server::Networks::scan(config).context("cannot read --lora-dir / --embeddings-dir")?;
    let spec = sdhive_engine::ModelSpec::new("", model.to_string_lossy());
    let widths = networks.text_widths(&spec, None);
    networks.resolve(req, &[], widths.as_deref()).map_err(|e| {
        let hint = if args.lora_dirs.is_empty() && e.message.contains("no LoRA") {
            " (pass --lora-dir DIR)"
        } else {
            ""
        };
        anyhow!("invalid {}: {}{hint}", flag_for_field(e.field), e.message)
    })
}

/// A seed from OS entropy, below 2^32 so it can be typed into A1111 and ComfyUI unchanged.
fn random_seed() -> anyhow::Result<u64> {
    getrandom::u32()
        .map(u64::from)
        .map_err(|e| anyhow!("cannot draw a random seed from the OS ({e}); pass --seed"))
}

/// First Ctrl-C asks the engine to stop after the current step; a second one exits at once. Installed only for
/// the generation itself, so Ctrl-C during loading keeps its default (immediate) effect.
fn install_ctrlc() -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let handler_flag = Arc::clone(&flag);
    let installed = ctrlc::set_handler(move || {
        if handler_flag.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
        eprintln!("\ncancelling after the current step (Ctrl-C again to quit now)");
    });
    if let Err(e) = installed {
        tracing::warn!("Ctrl-C will not cancel cleanly: {e}");
    }
    flag
}

/// One bar per image, counting that image's steps (img2img runs fewer than --steps).
struct StepBar {
    bar: ProgressBar,
}

impl StepBar {
    fn new() -> Self {
        let bar = ProgressBar::new(0);
        // The template is a literal, so a failure here is a programming error caught by the tests; fall back anyway.
        if let Ok(style) =
            ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} steps, {elapsed} (eta {eta})")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        StepBar { bar }
    }

    fn update(&self, p: &Progress) {
        self.bar.set_length(u64::from(p.steps));
        self.bar.set_message(format!("image {}/{}", p.image + 1, p.images));
        self.bar.set_position(u64::from(p.step));
        if p.step == p.steps && p.image + 1 < p.images {
            self.bar.println(format!("image {}/{} done", p.image + 1, p.images));
        }
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_seeds_fit_in_32_bits() {
        for _ in 0..100 {
            assert!(random_seed().unwrap() < 1 << 32);
        }
    }

    #[test]
    fn progress_template_parses() {
        assert!(
            ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} steps, {elapsed} (eta {eta})").is_ok()
        );
    }
}
