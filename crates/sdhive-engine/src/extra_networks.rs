//! A1111's "extra network" prompt tags: `<lora:name:mult>`, `<lora:name:te:unet>`, named `te=`/`unet=`/`dyn=`,
//! and `<lyco:…>` as an alias of `lora`. Tags are found exactly as A1111's `extra_networks.parse_prompt` finds
//! them (the regex `<(\w+):([^>]+)>`, leftmost match first, arguments split at `:`, an argument with exactly one
//! `=` is named), so a prompt written for A1111 loses the same characters here. Where A1111 silently drops a tag
//! it cannot use (an unknown kind, a multiplier that is not a number raises deep inside it), this parser
//! refuses with an error naming the tag instead. Only the positive prompt carries tags: A1111 leaves them as text
//! in the negative prompt.

use std::fmt;
use thiserror::Error;

/// The extra-network kinds a request may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetworkKind {
    /// `lora` and its alias `lyco` (LyCORIS files are served by the same loader, as in A1111 ≥ 1.5).
    Lora,
}

impl fmt::Display for NetworkKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NetworkKind::Lora => f.write_str("lora"),
        }
    }
}

/// One tag of the prompt, with A1111's multiplier rules applied: `te` = named `te`, else the second positional
/// argument, else 1.0; `unet` = named `unet`, else the third positional argument, else `te`.
#[derive(Debug, Clone, PartialEq)]
pub struct NetworkTag {
    pub kind: NetworkKind,
    /// The first positional argument, as written (A1111 matches it against file names and aliases).
    pub name: String,
    pub te: f32,
    pub unet: f32,
}

/// A tag that cannot be used: what it says and why.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("`{tag}`: {message}")]
pub struct TagError {
    /// The whole tag as written, `<…>` included.
    pub tag: String,
    pub message: String,
}

/// One match of A1111's `<(\w+):([^>]+)>`: byte range in the prompt, the kind and the argument text.
struct RawTag<'a> {
    start: usize,
    end: usize,
    kind: &'a str,
    args: &'a str,
}

/// Python's `\w` for `str` patterns: Unicode letters and digits (plus marks, approximated by alphanumerics) and
/// the underscore.
fn is_word(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The match of the regex starting exactly at `start` (which holds `<`), if any.
fn match_at(prompt: &str, start: usize) -> Option<RawTag<'_>> {
    let rest = &prompt[start + 1..];
    let kind_len = rest.find(|c: char| !is_word(c)).unwrap_or(rest.len());
    if kind_len == 0 || !rest[kind_len..].starts_with(':') {
        return None;
    }
    let args_from = kind_len + 1;
    let close = rest[args_from..].find('>')?;
    if close == 0 {
        return None;
    }
    let args_end = args_from + close;
    Some(RawTag {
        start,
        end: start + 1 + args_end + 1,
        kind: &rest[..kind_len],
        args: &rest[args_from..args_end],
    })
}

/// Every match, left to right and non-overlapping, as `re.sub` visits them.
fn raw_tags(prompt: &str) -> Vec<RawTag<'_>> {
    let mut out = Vec::new();
    let mut pos = 0;
    while let Some(offset) = prompt[pos..].find('<') {
        let start = pos + offset;
        match match_at(prompt, start) {
            Some(tag) => {
                pos = tag.end;
                out.push(tag);
            }
            None => pos = start + 1,
        }
    }
    out
}

/// `prompt` without its extra-network tags, whatever their kind (what A1111 tokenises).
pub fn strip_networks(prompt: &str) -> String {
    let mut out = String::with_capacity(prompt.len());
    let mut pos = 0;
    for tag in raw_tags(prompt) {
        out.push_str(&prompt[pos..tag.start]);
        pos = tag.end;
    }
    out.push_str(&prompt[pos..]);
    out
}

/// The prompt without its tags, and the tags. Unknown kinds, empty names and multipliers that are not finite
/// numbers are errors naming the tag. Negative multipliers are allowed, as in A1111.
pub fn parse_networks(prompt: &str) -> Result<(String, Vec<NetworkTag>), TagError> {
    let tags = raw_tags(prompt)
        .iter()
        .map(|raw| {
            parse_tag(raw)
                .map_err(|message| TagError { tag: prompt[raw.start..raw.end].to_string(), message })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((strip_networks(prompt), tags))
}

fn parse_tag(raw: &RawTag<'_>) -> Result<NetworkTag, String> {
    let kind = match raw.kind {
        "lora" | "lyco" => NetworkKind::Lora,
        "hypernet" => return Err("hypernetworks are not supported; only `lora` (and `lyco`) tags are".into()),
        other => {
            return Err(format!(
            "unknown extra network `{other}`: only `lora` (and its alias `lyco`) tags are supported (write \
                 the kind in lower case); A1111 would drop this tag silently"
        ))
        }
    };
    let mut positional: Vec<&str> = Vec::new();
    let mut te_named = None;
    let mut unet_named = None;
    let mut unknown = None;
    for item in raw.args.split(':') {
        // Python's `item.split('=', 2)` yields two parts only for exactly one `=`.
        match item.split_once('=') {
            Some((key, value)) if !value.contains('=') => match key {
                "te" => te_named = Some(value),
                "unet" => unet_named = Some(value),
                // Dynamic rank (`dyn=`) selects a sub-rank of dylora files; accepted and ignored.
                "dyn" => {}
                other => unknown = unknown.or(Some(other)),
            },
            _ => positional.push(item),
        }
    }
    let name = positional.first().map(|n| n.trim()).unwrap_or_default();
    if name.is_empty() {
        return Err("the network name is empty".into());
    }
    if let Some(key) = unknown {
        return Err(format!("unknown argument `{key}=`; use te=, unet= or dyn="));
    }
    if positional.len() > 4 {
        return Err(format!(
            "too many arguments ({}): use <{}:name:multiplier> or <{}:name:te:unet>",
            positional.len(),
            raw.kind,
            raw.kind
        ));
    }
    let te = match te_named.or(positional.get(1).copied()) {
        Some(v) => multiplier("te", v)?,
        None => 1.0,
    };
    let unet = match unet_named.or(positional.get(2).copied()) {
        Some(v) => multiplier("unet", v)?,
        None => te,
    };
    // A fourth positional argument is A1111's dyn; parse it so a typo there is not silently accepted.
    if let Some(d) = positional.get(3) {
        if d.trim().parse::<i64>().is_err() {
            return Err(format!("the dyn argument `{d}` is not an integer"));
        }
    }
    Ok(NetworkTag { kind, name: name.to_string(), te, unet })
}

fn multiplier(what: &str, value: &str) -> Result<f32, String> {
    match value.trim().parse::<f32>() {
        Ok(v) if v.is_finite() => Ok(v),
        Ok(_) => Err(format!("the {what} multiplier `{value}` is not a finite number")),
        Err(_) => Err(format!("the {what} multiplier `{value}` is not a number")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(name: &str, te: f32, unet: f32) -> NetworkTag {
        NetworkTag { kind: NetworkKind::Lora, name: name.into(), te, unet }
    }

    fn parse(p: &str) -> (String, Vec<NetworkTag>) {
        parse_networks(p).unwrap()
    }

    #[test]
    fn every_a1111_form() {
        assert_eq!(parse("a dog <lora:style:0.8>"), ("a dog ".into(), vec![tag("style", 0.8, 0.8)]));
        assert_eq!(parse("<lora:style>"), (String::new(), vec![tag("style", 1.0, 1.0)]));
        assert_eq!(parse("<lora:s:0.5:0.25>").1, vec![tag("s", 0.5, 0.25)]);
        assert_eq!(parse("<lora:s:te=0.5>").1, vec![tag("s", 0.5, 0.5)]);
        assert_eq!(parse("<lora:s:unet=0.3>").1, vec![tag("s", 1.0, 0.3)]);
        assert_eq!(parse("<lora:s:0.7:unet=0.2>").1, vec![tag("s", 0.7, 0.2)]);
        assert_eq!(parse("<lora:s:0.7:te=0.1>").1, vec![tag("s", 0.1, 0.1)]);
        assert_eq!(parse("<lora:s:1:0.5:dyn=16>").1, vec![tag("s", 1.0, 0.5)]);
        assert_eq!(parse("<lora:s:1:0.5:8>").1, vec![tag("s", 1.0, 0.5)]);
        assert_eq!(parse("<lyco:s:0.6>").1, vec![tag("s", 0.6, 0.6)]);
        assert_eq!(parse("<lora:s:-1>").1, vec![tag("s", -1.0, -1.0)]);
        assert_eq!(parse("<lora:s: 0.5 >").1, vec![tag("s", 0.5, 0.5)]);
        let (text, tags) = parse("x, <lora:a:1>, y <lyco:b.v2:0.5:1> z");
        assert_eq!(text, "x, , y  z");
        assert_eq!(tags, vec![tag("a", 1.0, 1.0), tag("b.v2", 0.5, 1.0)]);
    }

    #[test]
    fn matches_like_the_a1111_regex() {
        // No word characters before the colon, no arguments, or no closing bracket: plain text.
        for text in ["<:x>", "<lora:>", "<lora x:1>", "<lora:x", "a < b > c", "<lo-ra:x>"] {
            assert_eq!(parse(text), (text.to_string(), vec![]), "{text}");
        }
        // `[^>]+` runs over a second `<`, as the regex does.
        assert_eq!(strip_networks("a <lora:x<lora:y:1> b"), "a  b");
        assert_eq!(strip_networks("<<lora:x:1>>"), "<>");
        // Emphasis syntax around a tag stays.
        assert_eq!(strip_networks("(cat:1.2) <lora:x:1>"), "(cat:1.2) ");
        // Stripping removes every kind; parsing refuses the unknown ones.
        assert_eq!(strip_networks("a <hypernet:h:1> <foo:bar>"), "a  ");
    }

    #[test]
    fn refuses_what_a1111_would_drop_or_crash_on() {
        let err = |p: &str| parse_networks(p).unwrap_err();
        let e = err("a <lora:x:abc>");
        assert_eq!(e.tag, "<lora:x:abc>");
        assert!(e.message.contains("`abc` is not a number"), "{e}");
        assert!(err("<lora::1>").message.contains("empty"));
        assert!(err("<lora:=1>").message.contains("empty"));
        assert!(err("<lora:x:nan>").message.contains("finite"));
        assert!(err("<lora:x:inf>").message.contains("finite"));
        assert!(err("<lora:x:1:unet=x>").message.contains("unet multiplier"));
        assert!(err("<lora:x:foo=1>").message.contains("foo="));
        let e = err("<hypernet:h:1>");
        assert!(e.message.contains("hypernetworks"), "{e}");
        let e = err("<LoRA:x:1>");
        assert!(e.message.contains("`LoRA`"), "{e}");
        assert_eq!(e.to_string(), format!("`<LoRA:x:1>`: {}", e.message));
    }
}
