//! PNG Info (`POST /sdapi/v1/png-info`): the generation parameters an image carries and A1111's parse of them.
//! PNGs keep the infotext in a `parameters` text chunk (tEXt, zTXt or iTXt: ours, A1111's, most tools'); A1111
//! writes JPEG and WebP with it in the EXIF `UserComment` (UTF-16 after an `UNICODE\0` prefix, piexif's encoding),
//! which wins when present, as in A1111's `read_info_from_image`. `parse_generation_parameters` is A1111's
//! `modules/infotext_utils.py` function of the same name: the same regular expression over the last line, the same
//! quoting rules, the same defaults for what the text leaves out.

use regex::Regex;
use sdhive_catalog::styles::PromptStyle;
use serde_json::{json, Map, Value};
use std::io::Cursor;
use std::sync::OnceLock;

/// What an image carries: the `parameters` text (None without one) and its other text chunks (A1111's `items`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ImageInfo {
    pub parameters: Option<String>,
    pub items: Map<String, Value>,
}

/// Reads `bytes` (a PNG, JPEG or WebP of at most `max_pixels`, decoded in full so a corrupt file is refused) and
/// the text it carries. The error says what is wrong with the image.
pub fn read_image_info(bytes: &[u8], max_pixels: u64) -> Result<ImageInfo, String> {
    let format = image::guess_format(bytes).map_err(|_| "is not a PNG, JPEG or WebP image".to_string())?;
    let mut info = match format {
        image::ImageFormat::Png => read_png(bytes, max_pixels)?,
        image::ImageFormat::Jpeg | image::ImageFormat::WebP => {
            crate::routes::openai::decode_capped(bytes, max_pixels)?;
            ImageInfo::default()
        }
        other => return Err(format!("is a {other:?} image; PNG, JPEG and WebP are read")),
    };
    if let Some(comment) = exif_of(bytes, format).as_deref().and_then(exif_user_comment) {
        if !comment.is_empty() {
            info.parameters = Some(comment);
        }
    }
    Ok(info)
}

fn read_png(bytes: &[u8], max_pixels: u64) -> Result<ImageInfo, String> {
    let corrupt = |e: png::DecodingError| format!("cannot decode image: {e}");
    let limits = png::Limits { bytes: usize::try_from(max_pixels.saturating_mul(16)).unwrap_or(usize::MAX) };
    let mut reader =
        png::Decoder::new_with_limits(Cursor::new(bytes), limits).read_info().map_err(corrupt)?;
    let (width, height) = (reader.info().width, reader.info().height);
    if u64::from(width) * u64::from(height) > max_pixels {
        return Err(format!("image is {width}x{height}, larger than the {max_pixels}-pixel limit"));
    }
    let size = reader.output_buffer_size().ok_or("cannot decode image: it is too large")?;
    let mut buffer = vec![0u8; size];
    reader.next_frame(&mut buffer).map_err(corrupt)?;
    // Text chunks after the image data too.
    reader.finish().map_err(corrupt)?;
    let png = reader.info();
    let mut chunks: Vec<(String, String)> =
        png.uncompressed_latin1_text.iter().map(|c| (c.keyword.clone(), c.text.clone())).collect();
    for c in &png.compressed_latin1_text {
        chunks.push((c.keyword.clone(), c.get_text().map_err(corrupt)?));
    }
    for c in &png.utf8_text {
        chunks.push((c.keyword.clone(), c.get_text().map_err(corrupt)?));
    }
    let mut info = ImageInfo::default();
    for (keyword, text) in chunks {
        if keyword == "parameters" {
            info.parameters.get_or_insert(text);
        } else {
            info.items.entry(keyword).or_insert(Value::String(text));
        }
    }
    Ok(info)
}

/// The raw EXIF block (TIFF header first) of a PNG (`eXIf`), JPEG (`APP1`) or WebP (`EXIF`) image.
fn exif_of(bytes: &[u8], format: image::ImageFormat) -> Option<Vec<u8>> {
    use image::ImageDecoder;
    let exif = match format {
        image::ImageFormat::Jpeg => {
            image::codecs::jpeg::JpegDecoder::new(Cursor::new(bytes)).ok()?.exif_metadata().ok()?
        }
        image::ImageFormat::WebP => {
            image::codecs::webp::WebPDecoder::new(Cursor::new(bytes)).ok()?.exif_metadata().ok()?
        }
        image::ImageFormat::Png => {
            image::codecs::png::PngDecoder::new(Cursor::new(bytes)).ok()?.exif_metadata().ok()?
        }
        _ => None,
    }?;
    // WebP files written through piexif keep the JPEG segment's `Exif\0\0` prefix.
    Some(exif.strip_prefix(b"Exif\0\0").map(<[u8]>::to_vec).unwrap_or(exif))
}

/// The EXIF `UserComment` (tag 0x9286, in the Exif sub-IFD or, from some writers, IFD0) as text.
fn exif_user_comment(tiff: &[u8]) -> Option<String> {
    let big = match tiff.get(..4)? {
        b"MM\0*" => true,
        b"II*\0" => false,
        _ => return None,
    };
    let u16_at = |at: usize| -> Option<u16> {
        let b: [u8; 2] = tiff.get(at..at + 2)?.try_into().ok()?;
        Some(if big { u16::from_be_bytes(b) } else { u16::from_le_bytes(b) })
    };
    let u32_at = |at: usize| -> Option<u32> {
        let b: [u8; 4] = tiff.get(at..at + 4)?.try_into().ok()?;
        Some(if big { u32::from_be_bytes(b) } else { u32::from_le_bytes(b) })
    };
    // (count, where the value is) of `tag` in the IFD at `ifd`.
    let find = |ifd: usize, tag: u16| -> Option<(usize, usize)> {
        let entries = usize::from(u16_at(ifd)?);
        (0..entries).find_map(|i| {
            let entry = ifd + 2 + 12 * i;
            (u16_at(entry)? == tag).then_some(())?;
            let count = usize::try_from(u32_at(entry + 4)?).ok()?;
            let at = if count <= 4 { entry + 8 } else { usize::try_from(u32_at(entry + 8)?).ok()? };
            Some((count, at))
        })
    };
    let ifd0 = usize::try_from(u32_at(4)?).ok()?;
    let exif_ifd = find(ifd0, 0x8769).and_then(|(_, at)| usize::try_from(u32_at(at)?).ok());
    let (count, at) = exif_ifd.and_then(|ifd| find(ifd, 0x9286)).or_else(|| find(ifd0, 0x9286))?;
    decode_user_comment(tiff.get(at..at.checked_add(count)?)?)
}

/// piexif's `UserComment.load`, lenient where it would fail (A1111 then decodes the bytes as UTF-8).
fn decode_user_comment(data: &[u8]) -> Option<String> {
    let (prefix, body) = (data.get(..8)?, &data[8..]);
    let text = if prefix == b"UNICODE\0" {
        // piexif writes big-endian; some tools write little-endian, with or without a byte-order mark. Without
        // one, mostly-ASCII text gives itself away by where its zero bytes fall.
        let (big, body) = match body.get(..2) {
            Some([0xFE, 0xFF]) => (true, &body[2..]),
            Some([0xFF, 0xFE]) => (false, &body[2..]),
            _ => {
                let zeros = |from: usize| body.iter().skip(from).step_by(2).filter(|&&b| b == 0).count();
                (zeros(1) <= zeros(0), body)
            }
        };
        let units: Vec<u16> = body
            .chunks_exact(2)
            .map(|c| if big { u16::from_be_bytes([c[0], c[1]]) } else { u16::from_le_bytes([c[0], c[1]]) })
            .collect();
        String::from_utf16_lossy(&units)
    } else {
        String::from_utf8_lossy(if prefix == b"ASCII\0\0\0" { body } else { data }).into_owned()
    };
    Some(text.trim_matches('\0').to_string())
}

// ---------------------------------------------------------------------------------------------------------
// A1111's parse_generation_parameters
// ---------------------------------------------------------------------------------------------------------

/// `re_param`: `key: value` pairs, a value quoted when it holds commas.
fn re_param() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| {
        Regex::new(r#"\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)"#)
            .expect("a valid regular expression")
    })
}

/// A1111's `unquote`: a JSON string literal becomes its text; anything else stays as it is.
fn unquote(text: &str) -> String {
    if text.len() < 2 || !text.starts_with('"') || !text.ends_with('"') {
        return text.to_string();
    }
    serde_json::from_str::<String>(text).unwrap_or_else(|_| text.to_string())
}

/// `WIDTHxHEIGHT`.
fn image_size(v: &str) -> Option<(&str, &str)> {
    let (w, h) = v.split_once('x')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (digits(w) && digits(h)).then_some((w, h))
}

/// A1111's `parse_generation_parameters`: the prompt lines, the `Negative prompt:` lines, and the key/value pairs
/// of the last line (when it has at least three), with A1111's defaults for what is missing. Values from the
/// text stay strings as in A1111; `styles` are the styles file's, peeled off the prompts as A1111's default
/// "Apply if any" does (`Styles array`).
pub fn parse_generation_parameters(text: &str, styles: &[PromptStyle]) -> Map<String, Value> {
    let mut res = Map::new();
    let text = text.trim();
    let mut lines: Vec<&str> = text.split('\n').collect();
    let mut lastline = lines.pop().unwrap_or_default();
    if re_param().captures_iter(lastline).count() < 3 {
        lines.push(lastline);
        lastline = "";
    }
    let (mut prompt, mut negative) = (String::new(), String::new());
    let mut done_with_prompt = false;
    for line in lines {
        let mut line = line.trim();
        if let Some(rest) = line.strip_prefix("Negative prompt:") {
            done_with_prompt = true;
            line = rest.trim();
        }
        let target = if done_with_prompt { &mut negative } else { &mut prompt };
        if !target.is_empty() {
            target.push('\n');
        }
        target.push_str(line);
    }
    let (found, prompt, negative) = sdhive_catalog::styles::extract_styles(styles, &prompt, &negative);
    if !found.is_empty() {
        res.insert("Styles array".into(), json!(found));
    }
    res.insert("Prompt".into(), json!(prompt));
    res.insert("Negative prompt".into(), json!(negative));

    for caps in re_param().captures_iter(lastline) {
        let key = &caps[1];
        let value = &caps[2];
        // A1111 skips an empty value (its `v[0]` raises).
        if value.is_empty() {
            continue;
        }
        let value =
            if value.starts_with('"') && value.ends_with('"') { unquote(value) } else { value.into() };
        match image_size(&value) {
            Some((w, h)) => {
                res.insert(format!("{key}-1"), json!(w));
                res.insert(format!("{key}-2"), json!(h));
            }
            None => {
                res.insert(key.to_string(), json!(value));
            }
        }
    }

    let mut default = |key: &str, value: Value| {
        if !res.contains_key(key) {
            res.insert(key.into(), value);
        }
    };
    default("Clip skip", json!("1"));
    if let Some(hypernet) = res.get("Hypernet").and_then(Value::as_str).map(String::from) {
        let strength = res.get("Hypernet strength").and_then(Value::as_str).unwrap_or("1.0").to_string();
        let prompt = res["Prompt"].as_str().unwrap_or_default().to_string();
        res.insert("Prompt".into(), json!(format!("{prompt}<hypernet:{hypernet}:{strength}>")));
    }
    if !res.contains_key("Hires resize-1") {
        res.insert("Hires resize-1".into(), json!(0));
        res.insert("Hires resize-2".into(), json!(0));
    }
    let mut default = |key: &str, value: Value| {
        if !res.contains_key(key) {
            res.insert(key.into(), value);
        }
    };
    default("Hires sampler", json!("Use same sampler"));
    default("Hires checkpoint", json!("Use same checkpoint"));
    default("Hires prompt", json!(""));
    default("Hires negative prompt", json!(""));
    default("Mask mode", json!("Inpaint masked"));
    default("Masked content", json!("original"));
    default("Inpaint area", json!("Whole picture"));
    default("Masked area padding", json!(32));
    restore_old_hires_fix_params(&mut res);
    let mut default = |key: &str, value: Value| {
        if !res.contains_key(key) {
            res.insert(key.into(), value);
        }
    };
    default("RNG", json!("GPU"));
    default("Schedule type", json!("Automatic"));
    default("Schedule max sigma", json!(0));
    default("Schedule min sigma", json!(0));
    default("Schedule rho", json!(0));
    default("VAE Encoder", json!("Full"));
    default("VAE Decoder", json!("Full"));
    default("FP8 weight", json!("Disable"));
    if !res.contains_key("Cache FP16 weight for LoRA") && res["FP8 weight"] != "Disable" {
        res.insert("Cache FP16 weight for LoRA".into(), json!(false));
    }
    backcompat(&mut res);
    res
}

/// A number A1111 would `int()`: an integer, or its decimal string.
fn int_of(v: Option<&Value>) -> Option<i64> {
    match v? {
        Value::Number(n) => n.as_i64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// A1111's `restore_old_hires_fix_params`: an old infotext's `First pass size` becomes the size, and the size
/// the hires size (with the `use_old_hires_fix_width_height` option at its default, off).
fn restore_old_hires_fix_params(res: &mut Map<String, Value>) {
    let (Some(first_w), Some(first_h)) =
        (int_of(res.get("First pass size-1")), int_of(res.get("First pass size-2")))
    else {
        return;
    };
    let width = res.get("Size-1").map_or(Some(512), |v| int_of(Some(v)));
    let height = res.get("Size-2").map_or(Some(512), |v| int_of(Some(v)));
    let (Some(width), Some(height)) = (width, height) else { return };
    let (first_w, first_h) = if first_w == 0 || first_h == 0 {
        // processing.old_hires_fix_first_pass_dimensions
        let scale = ((512.0 * 512.0) / (width as f64 * height as f64)).sqrt();
        let round = |v: i64| ((scale * v as f64 / 64.0).ceil() as i64) * 64;
        (round(width), round(height))
    } else {
        (first_w, first_h)
    };
    res.insert("Size-1".into(), json!(first_w));
    res.insert("Size-2".into(), json!(first_h));
    res.insert("Hires resize-1".into(), json!(width));
    res.insert("Hires resize-2".into(), json!(height));
}

/// A version as `packaging.version` orders the ones A1111 writes (`v1.10.1`, `1.7.0-225`, `v1.8.0-RC`):
/// (release, 0 pre / 1 final / 2 post, number). Anything else (`sdhive 0.1.0`, Forge's) is `None`, as
/// A1111's `parse_version` makes it.
fn parse_version(text: &str) -> Option<([u64; 3], u8, u64)> {
    static RE: OnceLock<Regex> = OnceLock::new();
    let re = RE.get_or_init(|| {
        Regex::new(r"(?i)^v?(\d+)(?:\.(\d+))?(?:\.(\d+))?(?:[-_.]?(a|b|c|rc|alpha|beta|pre|preview)(\d*))?(?:-(\d+)|[-_.]?(?:post|rev|r)(\d*))?$")
            .expect("a valid regular expression")
    });
    // A1111 keeps `X-Y` of `X-Y-rest` (`v1.7.0-225-g1234abc` → `v1.7.0-225`).
    let mut parts = text.trim().splitn(3, '-');
    let text = match (parts.next(), parts.next(), parts.next()) {
        (Some(a), Some(b), Some(_)) => format!("{a}-{b}"),
        _ => text.trim().to_string(),
    };
    let caps = re.captures(&text)?;
    let num = |i: usize| {
        caps.get(i).map_or(Some(0), |m| if m.as_str().is_empty() { Some(0) } else { m.as_str().parse().ok() })
    };
    let release = [num(1)?, num(2)?, num(3)?];
    if caps.get(4).is_some() {
        Some((release, 0, num(5)?))
    } else if caps.get(6).is_some() || caps.get(7).is_some() {
        Some((release, 2, num(6)?.max(num(7)?)))
    } else {
        Some((release, 1, 0))
    }
}

/// A1111's `infotext_versions.backcompat` (with `auto_backcompat` at its default, on): what older versions did
/// differently, for pasting their infotexts.
fn backcompat(res: &mut Map<String, Value>) {
    let Some(version) = res.get("Version").and_then(Value::as_str).and_then(parse_version) else { return };
    let v160 = ([1, 6, 0], 1, 0);
    let v170_tsnr = ([1, 7, 0], 2, 225);
    let v180 = ([1, 8, 0], 1, 0);
    let text = |key: &str| res.get(key).and_then(Value::as_str).unwrap_or_default().to_string();
    let flags = [
        ("Old prompt editing timelines", version < v160 && text("Prompt").contains('[')),
        ("Pad conds v0", version < v160 && matches!(text("Sampler").as_str(), "DDIM" | "PLMS")),
        ("Downcast alphas_cumprod", version < v170_tsnr),
        ("Refiner switch by sampling steps", version < v180 && !text("Refiner").is_empty()),
    ];
    for (key, set) in flags {
        if set {
            res.insert(key.into(), json!(true));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sdhive_engine::{
        infotext, EmbeddingUse, GenerateRequest, InfotextContext, LoraUse, Sampler, Schedule,
    };

    fn parse(text: &str) -> Map<String, Value> {
        parse_generation_parameters(text, &[])
    }

    #[test]
    fn our_infotext_round_trips() {
        let lora = LoraUse {
            name: "detail".into(),
            path: "/l".into(),
            te: 1.0,
            unet: 1.0,
            hash: Some("0123456789ab".into()),
        };
        let req = GenerateRequest {
            prompt: "a cat, \"quoted\"\nsecond line <lora:detail:1>".into(),
            negative_prompt: "blurry, lowres".into(),
            steps: 20,
            cfg_scale: 7.5,
            sampler: Sampler::DpmPp2M,
            schedule: Schedule::Karras,
            clip_skip: 2,
            loras: vec![lora],
            embeddings: vec![EmbeddingUse {
                name: "easyneg".into(),
                path: "/e".into(),
                hash: Some("c74b4e810b03".into()),
            }],
            ..Default::default()
        };
        let ctx = InfotextContext {
            seed: 42,
            width: 512,
            height: 768,
            model: "models/v1-5, pruned",
            version: "sdhive 0.1.0",
        };
        let got = parse(&infotext(&req, &ctx));
        let s =
            |k: &str| got.get(k).and_then(Value::as_str).unwrap_or_else(|| panic!("{k} missing: {got:?}"));
        assert_eq!(s("Prompt"), req.prompt);
        assert_eq!(s("Negative prompt"), "blurry, lowres");
        assert_eq!((s("Steps"), s("Sampler"), s("Schedule type")), ("20", "DPM++ 2M", "Karras"));
        assert_eq!((s("CFG scale"), s("Seed"), s("Size-1"), s("Size-2")), ("7.5", "42", "512", "768"));
        assert_eq!((s("Model"), s("Clip skip")), ("models/v1-5, pruned", "2"));
        assert_eq!(s("Lora hashes"), "detail: 0123456789ab");
        assert_eq!(s("TI hashes"), "easyneg: c74b4e810b03");
        assert_eq!(s("Version"), "sdhive 0.1.0");
        assert!(got.get("Downcast alphas_cumprod").is_none(), "not an A1111 version: {got:?}");
        // A1111's defaults for what the text leaves out.
        assert_eq!(
            (got["Hires resize-1"].clone(), got["Masked area padding"].clone()),
            (json!(0), json!(32))
        );
        assert_eq!((s("RNG"), s("Hires sampler"), s("FP8 weight")), ("GPU", "Use same sampler", "Disable"));

        // img2img fields, and no negative prompt.
        let req = GenerateRequest { prompt: "x".into(), strength: 0.6, ..Default::default() };
        let img2img = GenerateRequest {
            init_image: Some(sdhive_engine::RgbImage { width: 8, height: 8, data: vec![0; 192] }),
            ..req
        };
        let got = parse(&infotext(&img2img, &ctx));
        assert_eq!((got["Prompt"].as_str(), got["Negative prompt"].as_str()), (Some("x"), Some("")));
        assert_eq!(got["Denoising strength"], "0.6");
        assert_eq!(got["Clip skip"], "1");
    }

    #[test]
    fn a1111_samples_parse_as_a1111_parses_them() {
        let text = "masterpiece, (best quality), 1girl,\nsitting on a bench\n\
                    Negative prompt: lowres, bad anatomy\nworst quality\n\
                    Steps: 28, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 7, Seed: 3172036446, \
                    Size: 832x1216, Model hash: 31e35c80fc, Model: sd_xl_base_1.0, Denoising strength: 0.4, \
                    Clip skip: 2, Hires upscale: 1.5, Hires steps: 10, Hires upscaler: R-ESRGAN 4x+, \
                    Lora hashes: \"add_detail: 7c6bad76eb54, xl_more_art-full_v1: fe3b4816be83\", \
                    TI hashes: \"EasyNegative: c74b4e810b03\", Emphasis: \"No norm\", Version: v1.10.1";
        let got = parse(text);
        let s = |k: &str| got[k].as_str().unwrap_or_else(|| panic!("{k}: {got:?}")).to_string();
        assert_eq!(s("Prompt"), "masterpiece, (best quality), 1girl,\nsitting on a bench");
        assert_eq!(s("Negative prompt"), "lowres, bad anatomy\nworst quality");
        assert_eq!(
            (s("Size-1"), s("Size-2"), s("Model hash")),
            ("832".into(), "1216".into(), "31e35c80fc".into())
        );
        assert_eq!(
            (s("Hires upscale"), s("Hires steps"), s("Hires upscaler")),
            ("1.5".into(), "10".into(), "R-ESRGAN 4x+".into())
        );
        assert_eq!(s("Lora hashes"), "add_detail: 7c6bad76eb54, xl_more_art-full_v1: fe3b4816be83");
        assert_eq!((s("TI hashes"), s("Emphasis")), ("EasyNegative: c74b4e810b03".into(), "No norm".into()));
        assert_eq!(
            (s("Clip skip"), s("Schedule type"), s("Denoising strength")),
            ("2".into(), "Karras".into(), "0.4".into())
        );
        assert!(got.get("Downcast alphas_cumprod").is_none(), "v1.10.1 is newer: {got:?}");

        // Fewer than three pairs on the last line: it is prompt text. An empty value is skipped, as A1111's
        // parse raises on it. Old versions get their compatibility flags.
        let got = parse("a [cat:dog:5] photo\nSteps: 20, Sampler: DDIM, Seed: 1, Empty: , Version: v1.5.1");
        assert_eq!(got["Prompt"], "a [cat:dog:5] photo");
        assert!(got.get("Empty").is_none(), "{got:?}");
        assert_eq!(
            (got["Old prompt editing timelines"].clone(), got["Pad conds v0"].clone()),
            (json!(true), json!(true))
        );
        assert_eq!(got["Downcast alphas_cumprod"], true);
        let got = parse("just a prompt, Steps: 20");
        assert_eq!(got["Prompt"], "just a prompt, Steps: 20");
        assert!(got.get("Steps").is_none());
        let got = parse("");
        assert_eq!((got["Prompt"].as_str(), got["Clip skip"].as_str()), (Some(""), Some("1")));

        // Old hires fix: the first pass size becomes the size.
        let got = parse("p\nSteps: 20, Size: 1024x1024, First pass size: 0x0, Seed: 1");
        assert_eq!((got["Size-1"].clone(), got["Hires resize-1"].clone()), (json!(512), json!(1024)));
    }

    #[test]
    fn versions_order_as_packaging_does() {
        assert!(parse_version("v1.7.0-225-g1234abc").unwrap() == ([1, 7, 0], 2, 225));
        assert!(parse_version("v1.8.0-RC").unwrap() < parse_version("1.8.0").unwrap());
        assert!(parse_version("1.6").unwrap() < parse_version("v1.6.1").unwrap());
        assert!(parse_version("sdhive 0.1.0").is_none());
        assert!(parse_version("f0.0.17v1.8.0rc-latest-276-g29be1da7").is_none());
    }

    #[test]
    fn styles_are_peeled_off_the_prompts() {
        let style = PromptStyle {
            name: "film".into(),
            prompt: "{prompt}, film grain".into(),
            negative_prompt: "cartoon".into(),
        };
        let got = parse_generation_parameters(
            "a cat, film grain\nNegative prompt: blurry, cartoon\nSteps: 1, Seed: 2, Size: 8x8",
            &[style],
        );
        assert_eq!(
            (got["Prompt"].as_str(), got["Negative prompt"].as_str()),
            (Some("a cat"), Some("blurry"))
        );
        assert_eq!(got["Styles array"], json!(["film"]));
    }

    fn png_with(chunks: &[(&str, &str, bool)]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut enc = png::Encoder::new(&mut out, 2, 2);
        enc.set_color(png::ColorType::Rgb);
        for (k, v, itxt) in chunks {
            if *itxt {
                enc.add_itxt_chunk(k.to_string(), v.to_string()).unwrap();
            } else {
                enc.add_text_chunk(k.to_string(), v.to_string()).unwrap();
            }
        }
        let mut w = enc.write_header().unwrap();
        w.write_image_data(&[7; 12]).unwrap();
        w.finish().unwrap();
        out
    }

    #[test]
    fn text_chunks_and_exif_comments_are_read() {
        let png = png_with(&[
            ("parameters", "a cat\nSteps: 1, Seed: 2, Size: 2x2", false),
            ("Software", "x", true),
        ]);
        let info = read_image_info(&png, 1 << 20).unwrap();
        assert_eq!(info.parameters.as_deref(), Some("a cat\nSteps: 1, Seed: 2, Size: 2x2"));
        assert_eq!(info.items, Map::from_iter([("Software".to_string(), json!("x"))]));
        assert_eq!(read_image_info(&png_with(&[]), 1 << 20).unwrap(), ImageInfo::default());
        assert!(read_image_info(&png, 3).unwrap_err().contains("limit"));

        // A corrupt PNG (image data cut short) and something that is no image are refused.
        let cut = &png[..png.len() - 30];
        assert!(read_image_info(cut, 1 << 20).is_err());
        let mut flipped = png.clone();
        let at = flipped.len() - 20;
        flipped[at] ^= 0xff;
        assert!(read_image_info(&flipped, 1 << 20).is_err());
        assert!(read_image_info(b"GIF89a....", 1 << 20).is_err());
        assert!(read_image_info(b"hello", 1 << 20).is_err());

        // A1111's JPEG: piexif's big-endian EXIF, the comment in UTF-16BE after `UNICODE\0`.
        let comment = "a cat, \u{00e9}t\u{00e9}\nSteps: 3, Seed: 4, Size: 2x2";
        let jpeg = jpeg_with_exif(&exif_block(comment, true));
        let info = read_image_info(&jpeg, 1 << 20).unwrap();
        assert_eq!(info.parameters.as_deref(), Some(comment));
        let jpeg = jpeg_with_exif(&exif_block(comment, false));
        assert_eq!(read_image_info(&jpeg, 1 << 20).unwrap().parameters.as_deref(), Some(comment));
    }

    #[test]
    fn our_images_carry_their_infotext_in_every_format() {
        use sdhive_engine::{encode_image, ImageFormat, OutputFormat, RgbImage};
        let img =
            RgbImage { width: 24, height: 16, data: (0..24 * 16 * 3).map(|v| (v * 7 % 256) as u8).collect() };
        let text =
            "a cat, caf\u{e9} 猫 🐱\nNegative prompt: dog\nSteps: 3, Sampler: Euler, CFG scale: 7, Seed: 4, \
                    Size: 24x16, Version: sdhive 0.1.0";
        for format in ImageFormat::ALL {
            let bytes = encode_image(&img, Some(text), OutputFormat::new(format, 75)).unwrap();
            let info = read_image_info(&bytes, 1 << 20).unwrap();
            assert_eq!(info.parameters.as_deref(), Some(text), "{format}");
            assert!(info.items.is_empty(), "{format}: {:?}", info.items);
            let parsed = parse(info.parameters.as_deref().unwrap_or_default());
            assert_eq!(
                (parsed["Steps"].as_str(), parsed["Size-1"].as_str()),
                (Some("3"), Some("24")),
                "{format}"
            );
            let bare = encode_image(&img, None, OutputFormat::new(format, 75)).unwrap();
            assert_eq!(read_image_info(&bare, 1 << 20).unwrap(), ImageInfo::default(), "{format}");
        }
    }

    /// A TIFF block: IFD0 with an Exif pointer, the Exif IFD with a UserComment.
    fn exif_block(comment: &str, big: bool) -> Vec<u8> {
        let mut body: Vec<u8> = b"UNICODE\0".to_vec();
        for unit in comment.encode_utf16() {
            body.extend(if big { unit.to_be_bytes() } else { unit.to_le_bytes() });
        }
        let u16b = |v: u16| if big { v.to_be_bytes() } else { v.to_le_bytes() };
        let u32b = |v: u32| if big { v.to_be_bytes() } else { v.to_le_bytes() };
        let mut t: Vec<u8> = if big { b"MM\0*".to_vec() } else { b"II*\0".to_vec() };
        t.extend(u32b(8));
        // IFD0 at 8: one entry (ExifIFD pointer, LONG) then next-IFD 0.
        t.extend(u16b(1));
        t.extend(u16b(0x8769));
        t.extend(u16b(4));
        t.extend(u32b(1));
        t.extend(u32b(26));
        t.extend(u32b(0));
        // Exif IFD at 26: one entry (UserComment, UNDEFINED) pointing at 44.
        t.extend(u16b(1));
        t.extend(u16b(0x9286));
        t.extend(u16b(7));
        t.extend(u32b(body.len() as u32));
        t.extend(u32b(44));
        t.extend(u32b(0));
        assert_eq!(t.len(), 44);
        t.extend(body);
        t
    }

    fn jpeg_with_exif(tiff: &[u8]) -> Vec<u8> {
        let img = image::RgbImage::from_pixel(2, 2, image::Rgb([9, 9, 9]));
        let mut jpeg = Vec::new();
        img.write_to(&mut Cursor::new(&mut jpeg), image::ImageFormat::Jpeg).unwrap();
        let mut segment = b"Exif\0\0".to_vec();
        segment.extend_from_slice(tiff);
        let mut out = jpeg[..2].to_vec();
        out.extend([0xFF, 0xE1]);
        out.extend(((segment.len() + 2) as u16).to_be_bytes());
        out.extend(segment);
        out.extend_from_slice(&jpeg[2..]);
        out
    }
}
