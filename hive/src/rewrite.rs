//! What the hive changes in a request before a worker sees it: the resolved model written in explicitly (so
//! every worker runs the model the hive routed by, whatever it has selected itself), and a seed drawn here when
//! the client asked for a random one — a generation is then reproducible, so a request whose worker was lost
//! can be run again elsewhere and give the image the first run would have given. JSON bodies (native, OpenAI
//! generations, A1111) and OpenAI's multipart edits.

use serde_json::{json, Map, Value};

/// A seed below 2^32 (usable unchanged in A1111 and ComfyUI), as the workers draw them.
pub fn random_seed() -> u64 {
    let mut buf = [0u8; 4];
    if getrandom::fill(&mut buf).is_err() {
        // Only variety matters; fall back on the clock.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        buf = nanos.to_le_bytes();
    }
    u64::from(u32::from_le_bytes(buf))
}

/// Whether a JSON seed value asks for a random seed: absent, `null`, or `-1` (A1111's "random").
fn random_requested(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => true,
        Some(v) => v.as_i64() == Some(-1) || v.as_f64() == Some(-1.0),
    }
}

/// Draws the seed of a request that asked for a random one; a given seed is left alone.
pub fn pin_seed(body: &mut Map<String, Value>) {
    if random_requested(body.get("seed")) {
        body.insert("seed".into(), json!(random_seed()));
    }
}

/// A native job or OpenAI generation: `model` and `seed` at the top level.
pub fn json_request(body: &mut Value, model: Option<&str>) {
    if let Some(obj) = body.as_object_mut() {
        if let Some(m) = model {
            obj.insert("model".into(), json!(m));
        }
        pin_seed(obj);
    }
}

/// An A1111 txt2img/img2img: the model goes into `override_settings.sd_model_checkpoint` (the client's
/// `override_settings_restore_afterwards` stays as sent).
pub fn a1111_request(body: &mut Value, model: Option<&str>) {
    let Some(obj) = body.as_object_mut() else { return };
    if let Some(m) = model {
        let settings = obj.entry("override_settings").or_insert_with(|| json!({}));
        if !settings.is_object() {
            *settings = json!({});
        }
        if let Some(s) = settings.as_object_mut() {
            s.insert("sd_model_checkpoint".into(), json!(m));
        }
    }
    pin_seed(obj);
}

/// The boundary of a `multipart/form-data` content type.
pub fn multipart_boundary(content_type: &str) -> Option<String> {
    let (kind, params) = content_type.split_once(';')?;
    if !kind.trim().eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    params
        .split(';')
        .find_map(|p| {
            let (k, v) = p.split_once('=')?;
            k.trim().eq_ignore_ascii_case("boundary").then(|| v.trim().trim_matches('"').to_string())
        })
        .filter(|b| !b.is_empty())
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    hay.get(from..)?.windows(needle.len()).position(|w| w == needle).map(|p| p + from)
}

/// The text fields (parts without a file name) of a multipart body, in order, as `(name, value)`.
pub fn multipart_text_fields(body: &[u8], boundary: &str) -> Vec<(String, String)> {
    let delimiter = format!("--{boundary}").into_bytes();
    let mut out = Vec::new();
    let Some(mut at) = find(body, &delimiter, 0) else { return out };
    loop {
        let start = at + delimiter.len();
        if body.get(start..start + 2) == Some(b"--") {
            break;
        }
        let Some(next) = find(body, &[b"\r\n", delimiter.as_slice()].concat(), start) else { break };
        let part = body.get(start..next).unwrap_or_default();
        let part = part.strip_prefix(b"\r\n").unwrap_or(part);
        if let Some(split) = find(part, b"\r\n\r\n", 0) {
            let head = String::from_utf8_lossy(&part[..split]);
            let disposition =
                head.lines().find(|l| l.to_ascii_lowercase().starts_with("content-disposition:"));
            let param = |d: &str, key: &str| {
                d.split(';').find_map(|p| {
                    let (k, v) = p.split_once('=')?;
                    (k.trim() == key).then(|| v.trim().trim_matches('"').to_string())
                })
            };
            if let Some(d) = disposition {
                if let (Some(name), None) = (param(d, "name"), param(d, "filename")) {
                    out.push((name, String::from_utf8_lossy(&part[split + 4..]).into_owned()));
                }
            }
        }
        at = next + 2;
    }
    out
}

/// The body with text fields appended before the closing delimiter; a later field of the same name wins on
/// the worker, so these replace the client's. `None` when the body has no closing delimiter.
pub fn multipart_append(body: &[u8], boundary: &str, fields: &[(&str, String)]) -> Option<Vec<u8>> {
    let closing = format!("\r\n--{boundary}--").into_bytes();
    let at = body.windows(closing.len()).rposition(|w| w == closing.as_slice())?;
    let mut out = Vec::with_capacity(body.len() + 128 * fields.len());
    out.extend_from_slice(&body[..at]);
    for (name, value) in fields {
        out.extend_from_slice(
            format!("\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}")
                .as_bytes(),
        );
    }
    out.extend_from_slice(&body[at..]);
    Some(out)
}

/// An OpenAI edit: the model and (when random) the seed appended as form fields.
pub fn multipart_request(body: &[u8], boundary: &str, model: Option<&str>) -> Option<Vec<u8>> {
    let fields = multipart_text_fields(body, boundary);
    let seed = fields.iter().rev().find(|(k, _)| k == "seed").map(|(_, v)| v.trim().to_string());
    let seed_value = seed.as_deref().and_then(|s| serde_json::from_str::<Value>(s).ok());
    let mut add: Vec<(&str, String)> = Vec::new();
    if let Some(m) = model {
        add.push(("model", m.to_string()));
    }
    if seed.as_deref().is_none_or(|s| s.is_empty()) || random_requested(seed_value.as_ref()) {
        add.push(("seed", random_seed().to_string()));
    }
    if add.is_empty() {
        return Some(body.to_vec());
    }
    multipart_append(body, boundary, &add)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_seeds_are_pinned_and_given_ones_kept() {
        for asked in [json!({}), json!({"seed": -1}), json!({"seed": -1.0}), json!({"seed": null})] {
            let mut body = asked.clone();
            json_request(&mut body, Some("/m/a"));
            assert!(body["seed"].as_u64().is_some_and(|s| s < 1 << 32), "{asked} → {body}");
            assert_eq!(body["model"], "/m/a");
        }
        let mut body = json!({"seed": 7, "model": "dall-e-3"});
        json_request(&mut body, None);
        assert_eq!(body, json!({"seed": 7, "model": "dall-e-3"}), "no model resolved: the client's stays");
    }

    #[test]
    fn a1111_model_goes_into_override_settings() {
        let mut body = json!({"prompt": "x", "override_settings": {"CLIP_stop_at_last_layers": 2},
            "override_settings_restore_afterwards": false});
        a1111_request(&mut body, Some("/m/b"));
        assert_eq!(body["override_settings"]["sd_model_checkpoint"], "/m/b");
        assert_eq!(body["override_settings"]["CLIP_stop_at_last_layers"], 2);
        assert_eq!(body["override_settings_restore_afterwards"], false);
        assert!(body["seed"].is_u64());
        let mut bare = json!({"prompt": "x", "override_settings": null, "seed": 3});
        a1111_request(&mut bare, Some("/m/b"));
        assert_eq!(bare["override_settings"], json!({"sd_model_checkpoint": "/m/b"}));
        assert_eq!(bare["seed"], 3);
    }

    #[test]
    fn multipart_fields_are_read_and_appended() {
        let ct = "multipart/form-data; boundary=\"XyZ\"";
        let b = multipart_boundary(ct).unwrap();
        assert_eq!(b, "XyZ");
        let body = b"--XyZ\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\na cat\r\n\
--XyZ\r\nContent-Disposition: form-data; name=\"image\"; filename=\"i.png\"\r\nContent-Type: image/png\r\n\r\n\x89PNG\r\n--XyZ\r\n\
Content-Disposition: form-data; name=\"model\"\r\n\r\nsdxl\r\n--XyZ--\r\n";
        let fields = multipart_text_fields(body, &b);
        assert_eq!(fields, [("prompt".into(), "a cat".into()), ("model".into(), "sdxl".into())]);
        let out = multipart_request(body, &b, Some("/m/sdxl")).unwrap();
        let fields = multipart_text_fields(&out, &b);
        let last = |k: &str| fields.iter().rev().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        assert_eq!(last("model").as_deref(), Some("/m/sdxl"));
        assert!(last("seed").and_then(|s| s.parse::<u64>().ok()).is_some(), "{fields:?}");
        assert!(out.ends_with(b"--XyZ--\r\n"));
        // A given seed stays, and nothing else to add leaves the body as it was.
        let seeded = multipart_append(body, &b, &[("seed", "5".into())]).unwrap();
        assert_eq!(multipart_request(&seeded, &b, None).unwrap(), seeded);
        assert!(multipart_boundary("application/json").is_none());
    }
}
