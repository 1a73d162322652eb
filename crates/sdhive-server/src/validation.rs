//! Turns wire requests into a checked [`GenerateRequest`]: defaults, sampler and schedule names, base64 image
//! uploads (decoded under a pixel cap) and the operator's limits. Every error names the request field, so the
//! routes can answer 400 with `param` set. Shared by all route families.

use base64::Engine as _;
use sdhive_engine::{
    decode_image, decode_mask, GenerateRequest, GrayImage, ImageError, ImageFormat, Limits, OutputFormat,
    RgbImage, Sampler, Schedule, SkipLayerGuidance, ValidationError,
};
use sdhive_protocol::{JobRequest, SkipLayerGuidanceRequest};

fn invalid(field: &'static str, message: impl Into<String>) -> ValidationError {
    ValidationError { field, message: message.into() }
}

/// Decodes standard or URL-safe base64, with or without padding, optionally wrapped in a `data:…;base64,` URL
/// (browsers and A1111 clients send both).
pub fn decode_base64(field: &'static str, data: &str) -> Result<Vec<u8>, ValidationError> {
    let data = data.trim();
    let payload = match data.strip_prefix("data:") {
        Some(rest) => match rest.split_once(',') {
            Some((meta, payload)) if meta.ends_with(";base64") => payload,
            _ => {
                return Err(invalid(field, "a data: URL must be base64-encoded (`data:image/png;base64,…`)"))
            }
        },
        None => data,
    };
    let compact: String = payload.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    let engines = [
        &base64::engine::general_purpose::STANDARD,
        &base64::engine::general_purpose::STANDARD_NO_PAD,
        &base64::engine::general_purpose::URL_SAFE,
        &base64::engine::general_purpose::URL_SAFE_NO_PAD,
    ];
    engines
        .iter()
        .find_map(|engine| engine.decode(&compact).ok())
        .ok_or_else(|| invalid(field, "is not valid base64"))
}

fn image_error(field: &'static str, e: ImageError) -> ValidationError {
    invalid(field, e.to_string())
}

/// A base64 image upload, decoded to RGB; larger than `max_pixels` is refused before decoding.
pub fn decode_base64_image(
    field: &'static str,
    data: &str,
    max_pixels: u64,
) -> Result<RgbImage, ValidationError> {
    decode_image(&decode_base64(field, data)?, max_pixels).map_err(|e| image_error(field, e))
}

/// A base64 mask upload, decoded to luminance (white = repaint).
pub fn decode_base64_mask(
    field: &'static str,
    data: &str,
    max_pixels: u64,
) -> Result<GrayImage, ValidationError> {
    decode_mask(&decode_base64(field, data)?, max_pixels).map_err(|e| image_error(field, e))
}

/// Sampler and schedule from their names; a combined name (`DPM++ 2M Karras`) and an explicit scheduler must
/// agree. `sampler_field` and `scheduler_field` are the request's spellings for error messages.
pub fn parse_sampler(
    sampler: Option<&str>,
    scheduler: Option<&str>,
    sampler_field: &'static str,
    scheduler_field: &'static str,
) -> Result<(Sampler, Schedule), ValidationError> {
    let (sampler, implied) = match sampler.map(str::trim).filter(|s| !s.is_empty()) {
        Some(name) => Sampler::parse(name).ok_or_else(|| {
            invalid(
                sampler_field,
                format!(
                    "unknown sampler `{name}`; available: {}",
                    Sampler::ALL.iter().map(|s| s.name()).collect::<Vec<_>>().join(", ")
                ),
            )
        })?,
        None => (Sampler::EulerA, None),
    };
    let given = scheduler
        .map(|s| {
            Schedule::parse(s).ok_or_else(|| {
                invalid(scheduler_field, format!("unknown scheduler `{s}`; use Automatic or Karras"))
            })
        })
        .transpose()?;
    let schedule = match (implied, given) {
        (Some(implied), Some(given)) if implied != given && given != Schedule::Automatic => {
            return Err(invalid(
                scheduler_field,
                format!("conflicts with the sampler name, which implies {implied}"),
            ))
        }
        (Some(s), _) | (None, Some(s)) => s,
        (None, None) => Schedule::Automatic,
    };
    Ok((sampler, schedule))
}

/// An output format and JPEG quality from a request's fields (`fields` are their names): a format name
/// ([`ImageFormat::parse`]; absent = PNG) and a quality of 0–100 (absent = `default_quality`).
pub fn parse_output(
    format: Option<&str>,
    quality: Option<u32>,
    default_quality: u8,
    fields: (&'static str, &'static str),
) -> Result<OutputFormat, ValidationError> {
    let format = match format {
        None => ImageFormat::Png,
        Some(name) => ImageFormat::parse(name)
            .ok_or_else(|| invalid(fields.0, format!("must be {}, got `{name}`", ImageFormat::EXPECTED)))?,
    };
    let quality = match quality {
        None => default_quality,
        Some(q) => u8::try_from(q)
            .ok()
            .filter(|q| *q <= 100)
            .ok_or_else(|| invalid(fields.1, format!("must be between 0 and 100, got {q}")))?,
    };
    Ok(OutputFormat::new(format, quality))
}

/// The `skip_layer_guidance` object as the engine takes it, diffusers' defaults filling in what it leaves out; its
/// values are checked with the rest of the request (`GenerateRequest::validate`), the layers by the engine, which
/// knows the model's blocks.
pub fn skip_layer_guidance(req: Option<&SkipLayerGuidanceRequest>) -> Option<SkipLayerGuidance> {
    req.map(|r| SkipLayerGuidance {
        layers: r.layers.iter().map(|&l| l as usize).collect(),
        scale: r.scale.unwrap_or(SkipLayerGuidance::DEFAULT_SCALE),
        start: r.start.unwrap_or(SkipLayerGuidance::DEFAULT_START),
        stop: r.stop.unwrap_or(SkipLayerGuidance::DEFAULT_STOP),
    })
}

/// The native job request, with defaults, decoded images and every limit checked.
pub fn build_request(
    req: &JobRequest,
    limits: &Limits,
    max_decode_pixels: u64,
) -> Result<GenerateRequest, ValidationError> {
    let (sampler, schedule) =
        parse_sampler(req.sampler.as_deref(), req.scheduler.as_deref(), "sampler", "scheduler")?;
    // Cheap checks before any image is decoded.
    let defaults = GenerateRequest::default();
    let mut out = GenerateRequest {
        prompt: req.prompt.clone(),
        negative_prompt: req.negative_prompt.clone().unwrap_or_default(),
        steps: req.steps.unwrap_or(defaults.steps),
        cfg_scale: req.cfg_scale.unwrap_or(defaults.cfg_scale),
        width: req.width,
        height: req.height,
        seed: req.seed.and_then(|s| s.fixed()),
        n: req.n.unwrap_or(1),
        sampler,
        schedule,
        clip_skip: req.clip_skip.unwrap_or(1),
        init_image: None,
        strength: req.strength.unwrap_or(defaults.strength),
        mask: None,
        preview_every: req.preview_every.unwrap_or(0),
        preview_approx: false,

        loras: Vec::new(),
        embeddings: Vec::new(),
        hires: None,
        output: parse_output(
            req.output_format.as_deref(),
            req.output_quality,
            OutputFormat::DEFAULT_QUALITY,
            ("output_format", "output_quality"),
        )?,
        skip_layer_guidance: skip_layer_guidance(req.skip_layer_guidance.as_ref()),
    };
    out.validate(limits)?;
    if req.mask.is_some() && req.init_image.is_none() {
        return Err(invalid("mask", "a mask needs an init image to inpaint"));
    }
    if req.strength.is_some() && req.init_image.is_none() {
        return Err(invalid("strength", "only applies with an init image"));
    }
    if req.preview_every == Some(0) {
        return Err(invalid("preview_every", "must be at least 1"));
    }
    if let Some(data) = &req.init_image {
        out.init_image = Some(decode_base64_image("init_image", data, max_decode_pixels)?);
    }
    if let Some(data) = &req.mask {
        out.mask = Some(decode_base64_mask("mask", data, max_decode_pixels)?);
    }
    out.validate(limits)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sdhive_engine::encode_png;
    use sdhive_protocol::Seed;

    fn req() -> JobRequest {
        JobRequest { prompt: "a cat".into(), ..Default::default() }
    }

    fn field(r: &JobRequest) -> &'static str {
        build_request(r, &Limits::default(), 1 << 20).unwrap_err().field
    }

    #[test]
    fn defaults_match_the_engine_contract() {
        let r = build_request(&req(), &Limits::default(), 1 << 20).unwrap();
        assert_eq!(
            (r.steps, r.n, r.sampler, r.schedule, r.seed),
            (20, 1, Sampler::EulerA, Schedule::Automatic, None)
        );
        let r = build_request(
            &JobRequest { seed: Some(Seed::Fixed(7)), sampler: Some("DPM++ 2M Karras".into()), ..req() },
            &Limits::default(),
            1 << 20,
        )
        .unwrap();
        assert_eq!((r.seed, r.sampler, r.schedule), (Some(7), Sampler::DpmPp2M, Schedule::Karras));
    }

    #[test]
    fn bad_fields_are_named() {
        assert_eq!(field(&JobRequest { steps: Some(0), ..req() }), "steps");
        assert_eq!(field(&JobRequest { width: Some(100), ..req() }), "width");
        assert_eq!(field(&JobRequest { sampler: Some("Heun".into()), ..req() }), "sampler");
        assert_eq!(field(&JobRequest { scheduler: Some("weird".into()), ..req() }), "scheduler");
        assert_eq!(field(&JobRequest { mask: Some("AAAA".into()), ..req() }), "mask");
        assert_eq!(field(&JobRequest { init_image: Some("%%%".into()), ..req() }), "init_image");
        assert_eq!(field(&JobRequest { init_image: Some("aGVsbG8=".into()), ..req() }), "init_image");
        assert_eq!(field(&JobRequest { strength: Some(0.5), ..req() }), "strength");
        assert_eq!(field(&JobRequest { preview_every: Some(0), ..req() }), "preview_every");
        assert_eq!(field(&JobRequest { output_format: Some("gif".into()), ..req() }), "output_format");
        assert_eq!(field(&JobRequest { output_quality: Some(101), ..req() }), "output_quality");
        assert_eq!(field(&JobRequest { output_quality: Some(u32::MAX), ..req() }), "output_quality");
    }

    #[test]
    fn skip_layer_guidance_reaches_the_request_with_diffusers_defaults() {
        let slg = |layers: Vec<u32>, start: Option<f64>, stop: Option<f64>| JobRequest {
            skip_layer_guidance: Some(SkipLayerGuidanceRequest { layers, scale: None, start, stop }),
            ..req()
        };
        let r = build_request(&slg(vec![7, 8, 9], None, None), &Limits::default(), 1 << 20).unwrap();
        assert_eq!(
            r.skip_layer_guidance,
            Some(SkipLayerGuidance { layers: vec![7, 8, 9], scale: 2.8, start: 0.01, stop: 0.2 })
        );
        assert_eq!(build_request(&req(), &Limits::default(), 1 << 20).unwrap().skip_layer_guidance, None);
        assert_eq!(field(&slg(vec![], None, None)), "skip_layer_guidance.layers");
        assert_eq!(field(&slg(vec![1], Some(-0.1), None)), "skip_layer_guidance.start");
        assert_eq!(field(&slg(vec![1], None, Some(1.5))), "skip_layer_guidance.stop");
        // A start after the default stop is named as the start.
        assert_eq!(field(&slg(vec![1], Some(0.5), None)), "skip_layer_guidance.start");
        let scale = JobRequest {
            skip_layer_guidance: Some(SkipLayerGuidanceRequest {
                layers: vec![1],
                scale: Some(-1.0),
                ..Default::default()
            }),
            ..req()
        };
        assert_eq!(field(&scale), "skip_layer_guidance.scale");
    }

    #[test]
    fn output_format_and_quality_reach_the_request() {
        let build = |r: &JobRequest| build_request(r, &Limits::default(), 1 << 20).unwrap().output;
        assert_eq!(build(&req()), OutputFormat::PNG);
        let jpeg = JobRequest { output_format: Some("JPG".into()), output_quality: Some(0), ..req() };
        assert_eq!(build(&jpeg), OutputFormat::new(ImageFormat::Jpeg, 0));
        let webp = JobRequest { output_format: Some("webp".into()), ..req() };
        assert_eq!(build(&webp), OutputFormat::new(ImageFormat::Webp, OutputFormat::DEFAULT_QUALITY));
    }

    #[test]
    fn images_decode_from_plain_and_data_url_base64_under_a_cap() {
        let img = RgbImage { width: 16, height: 16, data: vec![128; 16 * 16 * 3] };
        let b64 = base64::engine::general_purpose::STANDARD.encode(encode_png(&img, None).unwrap());
        let with_url = format!("data:image/png;base64,{b64}");
        for data in [b64.clone(), with_url] {
            let r = build_request(
                &JobRequest {
                    init_image: Some(data.clone()),
                    mask: Some(data),
                    strength: Some(0.5),
                    ..req()
                },
                &Limits::default(),
                1 << 20,
            )
            .unwrap();
            assert_eq!(r.init_image.unwrap().width, 16);
            assert!(r.mask.is_some());
        }
        let e = build_request(&JobRequest { init_image: Some(b64), ..req() }, &Limits::default(), 100)
            .unwrap_err();
        assert_eq!(e.field, "init_image");
        assert!(e.message.contains("limit"), "{}", e.message);
    }
}
