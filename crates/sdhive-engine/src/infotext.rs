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
    if req.mask.is_some() {
        fields.push(("Mask", "yes".to_string()));
    }
    if req.clip_skip > 1 {
        fields.push(("Clip skip", req.clip_skip.to_string()));
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
    fn omits_empty_negative_and_quotes_separators() {
        let req = GenerateRequest { prompt: "x".into(), cfg_scale: 7.5, ..Default::default() };
        let ctx = InfotextContext { seed: 1, width: 64, height: 64, model: "a, b", version: "v" };
        let text = infotext(&req, &ctx);
        assert!(!text.contains("Negative prompt"));
        assert!(text.contains("CFG scale: 7.5,"));
        assert!(text.contains("Model: \"a, b\""));
    }
}
