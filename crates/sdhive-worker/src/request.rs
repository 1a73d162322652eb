//! Turns `generate` arguments into a validated [`GenerateRequest`]: sampler and schedule names, init image and
//! mask files, and the contract's limits. Errors name the flag (and file) the user has to fix. Apart from
//! reading the two image files this is pure, so every rule is unit-tested without a model.

use crate::cli::GenerateArgs;
use sdhive_engine::image_io::DEFAULT_MAX_DECODE_PIXELS;
use sdhive_engine::{
    decode_image, decode_mask, GenerateRequest, ImageError, Limits, Sampler, Schedule, ValidationError,
};
use std::path::{Path, PathBuf};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ArgsError {
    #[error("unknown --sampler `{name}`; valid samplers: {valid} (Euler and DPM++ 2M also take a ` Karras` suffix)")]
    UnknownSampler { name: String, valid: String },
    #[error("unknown --scheduler `{0}`; valid schedulers: Automatic, Karras")]
    UnknownScheduler(String),
    #[error(
        "--sampler `{sampler}` implies the {implied} schedule, which conflicts with --scheduler {given}"
    )]
    SchedulerConflict { sampler: String, implied: Schedule, given: Schedule },
    #[error("cannot read {flag} {}: {source}", path.display())]
    ReadImage {
        flag: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot use {flag} {}: {source}", path.display())]
    DecodeImage {
        flag: &'static str,
        path: PathBuf,
        #[source]
        source: ImageError,
    },
    #[error("invalid {flag}: {message}")]
    Invalid { flag: String, message: String },
}

/// The command-line spelling of a request field, so validation errors point at what the user typed.
pub fn flag_for_field(field: &str) -> String {
    match field {
        "n" => "-n".to_string(),
        other => format!("--{}", other.replace('_', "-")),
    }
}

impl From<ValidationError> for ArgsError {
    fn from(e: ValidationError) -> Self {
        ArgsError::Invalid { flag: flag_for_field(e.field), message: e.message }
    }
}

/// Parses the sampler, letting a combined name (`DPM++ 2M Karras`) set the schedule unless `--scheduler`
/// explicitly says otherwise.
pub fn sampler_and_schedule(
    sampler: &str,
    scheduler: Option<&str>,
) -> Result<(Sampler, Schedule), ArgsError> {
    let (parsed, implied) = Sampler::parse(sampler).ok_or_else(|| ArgsError::UnknownSampler {
        name: sampler.to_string(),
        valid: Sampler::ALL.iter().map(|s| s.name()).collect::<Vec<_>>().join(", "),
    })?;
    let given = scheduler
        .map(|s| Schedule::parse(s).ok_or_else(|| ArgsError::UnknownScheduler(s.to_string())))
        .transpose()?;
    let schedule = match (implied, given) {
        (Some(implied), Some(given)) if implied != given => {
            return Err(ArgsError::SchedulerConflict { sampler: sampler.to_string(), implied, given })
        }
        (Some(s), _) | (None, Some(s)) => s,
        (None, None) => Schedule::Automatic,
    };
    Ok((parsed, schedule))
}

fn read_file(flag: &'static str, path: &Path) -> Result<Vec<u8>, ArgsError> {
    std::fs::read(path).map_err(|source| ArgsError::ReadImage { flag, path: path.to_path_buf(), source })
}

/// Builds and validates the request. `seed` stays `None` when absent; the caller draws one so it can print it.
pub fn build_request(args: &GenerateArgs) -> Result<GenerateRequest, ArgsError> {
    let (sampler, schedule) = sampler_and_schedule(&args.sampler, args.scheduler.as_deref())?;
    // Checked before any file is read: with no init image the mask file's state is irrelevant.
    if args.mask.is_some() && args.init_image.is_none() {
        return Err(ArgsError::Invalid {
            flag: "--mask".into(),
            message: "a mask needs an init image to inpaint (add --init-image)".into(),
        });
    }
    let init_image = match &args.init_image {
        Some(path) => {
            Some(decode_image(&read_file("--init-image", path)?, DEFAULT_MAX_DECODE_PIXELS).map_err(
                |source| ArgsError::DecodeImage { flag: "--init-image", path: path.clone(), source },
            )?)
        }
        None => None,
    };
    let mask = match &args.mask {
        Some(path) => Some(
            decode_mask(&read_file("--mask", path)?, DEFAULT_MAX_DECODE_PIXELS)
                .map_err(|source| ArgsError::DecodeImage { flag: "--mask", path: path.clone(), source })?,
        ),
        None => None,
    };
    let req = GenerateRequest {
        prompt: args.prompt.clone(),
        negative_prompt: args.negative_prompt.clone(),
        steps: args.steps,
        cfg_scale: args.cfg_scale,
        width: args.width,
        height: args.height,
        seed: args.seed,
        n: args.n,
        sampler,
        schedule,
        clip_skip: args.clip_skip,
        init_image,
        strength: args.strength,
        mask,
        // The CLI shows a progress bar, not pictures.
        preview_every: 0,
        preview_approx: false,
        // Filled from the prompt once the model is known (`generate::resolve_networks`).
        loras: Vec::new(),
        embeddings: Vec::new(),
        hires: None,
        // `generate` writes PNG files itself.
        output: Default::default(),
        // Skip-layer guidance is an API option (`skip_layer_guidance`); the CLI has no flags for it.
        skip_layer_guidance: None,
    };
    req.validate(&Limits::default())?;
    Ok(req)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

    fn args(extra: &[&str]) -> GenerateArgs {
        let mut argv = vec!["sd-worker", "generate", "--model", "m", "--prompt", "a cat", "-o", "out.png"];
        argv.extend_from_slice(extra);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Generate(a) => a,
            other => panic!("expected generate, got {other:?}"),
        }
    }

    fn err(extra: &[&str]) -> ArgsError {
        build_request(&args(extra)).unwrap_err()
    }

    #[test]
    fn defaults_make_a_valid_txt2img_request() {
        let req = build_request(&args(&[])).unwrap();
        assert_eq!(
            (req.sampler, req.schedule, req.steps, req.n, req.seed),
            (Sampler::EulerA, Schedule::Automatic, 20, 1, None)
        );
        assert_eq!(req.cfg_scale, 7.0);
        assert!(req.init_image.is_none());
    }

    #[test]
    fn sampler_names_and_schedules() {
        let req = build_request(&args(&["--sampler", "DPM++ 2M Karras", "--seed", "42"])).unwrap();
        assert_eq!((req.sampler, req.schedule, req.seed), (Sampler::DpmPp2M, Schedule::Karras, Some(42)));
        let req = build_request(&args(&["--sampler", "Euler", "--scheduler", "karras"])).unwrap();
        assert_eq!((req.sampler, req.schedule), (Sampler::Euler, Schedule::Karras));
        // Saying the same thing twice is not a conflict.
        build_request(&args(&["--sampler", "DPM++ 2M Karras", "--scheduler", "Karras"])).unwrap();
    }

    #[test]
    fn bad_sampler_lists_the_valid_ones() {
        let e = err(&["--sampler", "Heun"]);
        assert!(matches!(e, ArgsError::UnknownSampler { .. }));
        let msg = e.to_string();
        assert!(msg.contains("--sampler `Heun`") && msg.contains("Euler a, DDIM, DPM++ 2M"), "{msg}");
        assert!(matches!(err(&["--scheduler", "exponential"]), ArgsError::UnknownScheduler(_)));
    }

    #[test]
    fn conflicting_scheduler_is_refused() {
        let e = err(&["--sampler", "DPM++ 2M Karras", "--scheduler", "Automatic"]);
        assert!(matches!(e, ArgsError::SchedulerConflict { .. }), "{e}");
        // Karras on a sampler without it is the contract's validation error, reported against --scheduler.
        let e = err(&["--sampler", "DDIM", "--scheduler", "Karras"]);
        assert!(e.to_string().starts_with("invalid --scheduler"), "{e}");
    }

    #[test]
    fn invalid_sizes_and_ranges_name_the_flag() {
        for (extra, flag) in [
            (&["--width", "100"][..], "--width"),
            (&["--height", "4096"][..], "--height"),
            (&["--steps", "0"][..], "--steps"),
            (&["--cfg-scale", "1000"][..], "--cfg-scale"),
            (&["-n", "0"][..], "-n"),
            (&["--clip-skip", "13"][..], "--clip-skip"),
        ] {
            let msg = err(extra).to_string();
            assert!(msg.starts_with(&format!("invalid {flag}:")), "{extra:?}: {msg}");
        }
    }

    #[test]
    fn missing_or_unreadable_init_image_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.png");
        let e = err(&["--init-image", missing.to_str().unwrap()]);
        assert!(matches!(e, ArgsError::ReadImage { flag: "--init-image", .. }));
        assert!(e.to_string().contains("missing.png"));

        let garbage = dir.path().join("garbage.png");
        std::fs::write(&garbage, b"not a png").unwrap();
        let e = err(&["--init-image", garbage.to_str().unwrap()]);
        assert!(matches!(e, ArgsError::DecodeImage { .. }));
        assert!(e.to_string().contains("garbage.png"), "{e}");
    }

    #[test]
    fn mask_without_init_image_is_refused_before_reading_it() {
        let e = err(&["--mask", "/nonexistent/mask.png"]);
        assert!(e.to_string().starts_with("invalid --mask"), "{e}");
    }

    #[test]
    fn img2img_reads_the_fixture_images() {
        let images = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/images");
        let init = images.join("init.png");
        let mask = images.join("mask.png");
        let req = build_request(&args(&[
            "--init-image",
            init.to_str().unwrap(),
            "--mask",
            mask.to_str().unwrap(),
            "--strength",
            "0.5",
        ]))
        .unwrap();
        assert!(req.init_image.is_some() && req.mask.is_some());
        assert_eq!(req.strength, 0.5);
        let e = err(&["--init-image", init.to_str().unwrap(), "--strength", "1.5"]);
        assert!(e.to_string().starts_with("invalid --strength"), "{e}");
    }
}
