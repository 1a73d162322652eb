//! The A1111 "infotext": the human-readable parameter block stored in PNGs and returned by the sdapi `info`
//! field, so images made here can be re-created or inspected with A1111-compatible tools.

use crate::request::GenerateRequest;
use crate::sampler::Schedule;

/// What generated one image, beyond the request itself.
pub struct InfotextContext<'a> {
    pub seed: u64,
    pub width: u32,
    pub height: u32,
    pub model: &'a str,
    pub version: &'a str,
}

/// A1111 quotes a value when it contains its own separators, so the line parses back unambiguously.
fn quote_if_needed(value: &str) -> String {
    if value.contains([',', ':', '\n', '"']) {
        serde_json::to_string(value).unwrap_or_else(|_| value.to_string())
    } else {
        value.to_string()
    }
}

/// Formats a number without a trailing `.0` for integral values, as Python's str() of A1111's floats does for
/// typical inputs (7.0 → "7", 7.5 → "7.5").
fn number(v: f32) -> String {
    if v.fract() == 0.0 && v.abs() < 1e9 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

pub fn infotext(req: &GenerateRequest, ctx: &InfotextContext<'_>) -> String {
    let mut out = req.prompt.clone();
    if !req.negative_prompt.is_empty() {
        out.push_str("\nNegative prompt: ");
        out.push_str(&req.negative_prompt);
    }
    let mut fields: Vec<(&str, String)> =
        vec![("Steps", req.steps.to_string()), ("Sampler", req.sampler.name().to_string())];
    if req.schedule != Schedule::Automatic {
        fields.push(("Schedule type", req.schedule.name().to_string()));
    }
    fields.push(("CFG scale", number(req.cfg_scale)));
    fields.push(("Seed", ctx.seed.to_string()));
    fields.push(("Size", format!("{}x{}", ctx.width, ctx.height)));
    fields.push(("Model", quote_if_needed(ctx.model)));
    if let Some(strength) = req.effective_strength() {
        fields.push(("Denoising strength", number(strength)));
    }
    if let Some(h) = &req.hires {
        fields.push(("Denoising strength", number(h.denoising_strength)));
        if h.resize_x == 0 && h.resize_y == 0 {
            fields.push(("Hires upscale", number(h.scale)));
        } else {
            fields.push(("Hires resize", format!("{}x{}", h.resize_x, h.resize_y)));
        }
        if h.steps > 0 {
            fields.push(("Hires steps", h.steps.to_string()));
        }
        fields.push(("Hires upscaler", quote_if_needed(h.upscaler.name())));
        if let Some(s) = h.sampler.filter(|s| *s != req.sampler) {
            fields.push(("Hires sampler", s.name().to_string()));
        }
        if let Some(s) = h.schedule.filter(|s| *s != req.schedule) {
            fields.push(("Hires schedule type", s.name().to_string()));
        }
        if let Some(c) = h.cfg_scale.filter(|c| *c != req.cfg_scale) {
            fields.push(("Hires CFG Scale", number(c)));
        }
        if let Some(p) = h.prompt.as_ref().filter(|p| **p != req.prompt) {
            fields.push(("Hires prompt", quote_if_needed(p)));
        }
        if let Some(p) = h.negative_prompt.as_ref().filter(|p| **p != req.negative_prompt) {
            fields.push(("Hires negative prompt", quote_if_needed(p)));
        }
    }
    if req.mask.is_some() {
        fields.push(("Mask", "yes".to_string()));
    }
    if req.clip_skip > 1 {
        fields.push(("Clip skip", req.clip_skip.to_string()));
    }
    // A1111 has no skip-layer guidance; these keys parse back as its other `Key: value` pairs do.
    if let Some(g) = &req.skip_layer_guidance {
        let layers: Vec<String> = g.layers.iter().map(|l| l.to_string()).collect();
        fields.push(("SLG layers", quote_if_needed(&layers.join(", "))));
        fields.push(("SLG scale", g.scale.to_string()));
        fields.push(("SLG start", g.start.to_string()));
        fields.push(("SLG stop", g.stop.to_string()));
    }
    // A1111's Lora extension and its text-encoder hijack add these (in this order) with the name as the prompt
    // wrote it, stripped of the separators, and the 12-digit short hash; unhashed entries are left out.
    let hashes = |entries: Vec<(&str, Option<&str>)>| -> Option<String> {
        let listed: Vec<String> = entries
            .into_iter()
            .filter_map(|(name, hash)| Some(format!("{}: {}", name.replace([':', ','], ""), hash?)))
            .collect();
        (!listed.is_empty()).then(|| quote_if_needed(&listed.join(", ")))
    };
    if let Some(v) = hashes(req.loras.iter().map(|l| (l.name.as_str(), l.hash.as_deref())).collect()) {
        fields.push(("Lora hashes", v));
    }
    if let Some(v) = hashes(req.embeddings.iter().map(|e| (e.name.as_str(), e.hash.as_deref())).collect()) {
        fields.push(("TI hashes", v));
    }
    fields.push(("Version", quote_if_needed(ctx.version)));
    out.push('\n');
    out.push_str(&fields.iter().map(|(k, v)| format!("{k}: {v}")).collect::<Vec<_>>().join(", "));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::Sampler;

    #[test]
    fn formats_like_a1111() {
        let req = GenerateRequest {
            prompt: "a cat".into(),
            negative_prompt: "blurry".into(),
            steps: 20,
            cfg_scale: 7.0,
            sampler: Sampler::DpmPp2M,
            schedule: Schedule::Karras,
            clip_skip: 2,
            ..Default::default()
        };
        let ctx =
            InfotextContext { seed: 42, width: 512, height: 768, model: "sd15", version: "sdhive 0.1.0" };
        assert_eq!(
            infotext(&req, &ctx),
            "a cat\nNegative prompt: blurry\nSteps: 20, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 7, \
             Seed: 42, Size: 512x768, Model: sd15, Clip skip: 2, Version: sdhive 0.1.0"
        );
    }

    #[test]
    fn lora_and_ti_hashes_as_a1111() {
        use crate::request::{EmbeddingUse, LoraUse};
        let lora = |name: &str, hash: Option<&str>| LoraUse {
            name: name.into(),
            path: "/l".into(),
            te: 1.0,
            unet: 1.0,
            hash: hash.map(String::from),
        };
        let req = GenerateRequest {
            prompt: "a <lora:a:1> <lora:b,c:0.5> <lora:d:1>".into(),
            loras: vec![lora("a", Some("0123456789ab")), lora("b,c", Some("ba9876543210")), lora("d", None)],
            embeddings: vec![EmbeddingUse {
                name: "EasyNegative".into(),
                path: "/e".into(),
                hash: Some("c74b4e810b03".into()),
            }],
            ..Default::default()
        };
        let ctx = InfotextContext { seed: 1, width: 64, height: 64, model: "m", version: "v" };
        let text = infotext(&req, &ctx);
        assert!(text.starts_with("a <lora:a:1> <lora:b,c:0.5> <lora:d:1>\n"), "{text}");
        assert!(
            text.ends_with(
                "Model: m, Lora hashes: \"a: 0123456789ab, bc: ba9876543210\", TI hashes: \"EasyNegative: \
                 c74b4e810b03\", Version: v"
            ),
            "{text}"
        );
        let plain = GenerateRequest { loras: vec![lora("d", None)], ..Default::default() };
        assert!(!infotext(&plain, &ctx).contains("hashes"));
    }

    #[test]
    fn hires_settings_as_a1111_writes_them() {
        use crate::hires::{HiresFix, HiresUpscaler};
        let req = GenerateRequest {
            prompt: "x".into(),
            width: Some(512),
            height: Some(512),
            hires: Some(HiresFix {
                upscaler: HiresUpscaler::Lanczos,
                steps: 10,
                denoising_strength: 0.5,
                sampler: Some(Sampler::DpmPp2M),
                cfg_scale: Some(7.0),
                prompt: Some("x, detailed".into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let ctx = InfotextContext { seed: 1, width: 512, height: 512, model: "m", version: "v" };
        let text = infotext(&req, &ctx);
        assert!(
            text.contains(
                "Size: 512x512, Model: m, Denoising strength: 0.5, Hires upscale: 2, Hires steps: 10, Hires \
                 upscaler: Lanczos, Hires sampler: DPM++ 2M, Hires prompt: \"x, detailed\", Version: v"
            ),
            "{text}"
        );
    }

    #[test]
    fn skip_layer_guidance_is_recorded() {
        use crate::request::SkipLayerGuidance;
        let req = GenerateRequest {
            prompt: "x".into(),
            skip_layer_guidance: Some(SkipLayerGuidance {
                start: 0.0,
                stop: 1.0,
                ..SkipLayerGuidance::with_layers(vec![7, 8, 9])
            }),
            ..Default::default()
        };
        let ctx = InfotextContext { seed: 1, width: 64, height: 64, model: "m", version: "v" };
        let text = infotext(&req, &ctx);
        assert!(
            text.ends_with(
                "Model: m, SLG layers: \"7, 8, 9\", SLG scale: 2.8, SLG start: 0, SLG stop: 1, Version: v"
            ),
            "{text}"
        );
        let one =
            GenerateRequest { skip_layer_guidance: Some(SkipLayerGuidance::with_layers(vec![1])), ..req };
        assert!(
            infotext(&one, &ctx).contains("SLG layers: 1, SLG scale: 2.8, SLG start: 0.01, SLG stop: 0.2,")
        );
        assert!(!infotext(&GenerateRequest::default(), &ctx).contains("SLG"));
    }

    #[test]
    fn omits_empty_negative_and_quotes_separators() {
        let req = GenerateRequest { prompt: "x".into(), cfg_scale: 7.5, ..Default::default() };
        let ctx = InfotextContext { seed: 1, width: 64, height: 64, model: "a, b", version: "v" };
        let text = infotext(&req, &ctx);
        assert!(!text.contains("Negative prompt"));
        assert!(text.contains("CFG scale: 7.5,"));
        assert!(text.contains("Model: \"a, b\""));
    }
}
