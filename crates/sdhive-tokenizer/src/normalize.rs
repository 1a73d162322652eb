//! Text clean-up applied before BPE, in the two flavours found in the wild.
//!
//! * [`TextNormalization::TransformersSlow`]: transformers' Python
//!   `CLIPTokenizer` (v4 and earlier) when `ftfy` is not installed, which is
//!   the usual diffusers setup. It runs BERT's basic clean-up with no accent
//!   stripping and no punctuation splitting: control characters dropped,
//!   every Unicode space made an ASCII space, CJK ideographs spaced apart (so
//!   each becomes its own word), NFC, whitespace split, per-word lowercase.
//! * [`TextNormalization::Tokenizers`]: the Rust `tokenizers` pipeline used by
//!   `CLIPTokenizerFast` and by transformers v5's `CLIPTokenizer`: NFC,
//!   whitespace runs to one space, per-character lowercase. Control
//!   characters survive (and get byte-level tokens), CJK runs stay one word
//!   and a final capital sigma lowercases to `σ`, not `ς`.
//!
//! Both agree on ordinary prompts; they differ only on the inputs above.
//! Character data comes from the Rust crates (Unicode 16), while Python 3.11
//! uses Unicode 14: characters assigned after 14 count as unassigned there
//! and are dropped by the slow clean-up, but are kept here.

use std::sync::LazyLock;

use regex::Regex;
use unicode_normalization::UnicodeNormalization;

/// Which reference tokenizer's text clean-up to reproduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TextNormalization {
    /// Python `CLIPTokenizer` without `ftfy` (transformers <= 4.x).
    #[default]
    TransformersSlow,
    /// `tokenizers`-backed `CLIPTokenizerFast` / transformers 5.x.
    Tokenizers,
}

/// Characters BERT's clean-up deletes: NUL, U+FFFD and every "other"
/// (control, format, unassigned, private-use) character except the three
/// that it treats as whitespace.
static DROPPED: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"[\x00\x{FFFD}[\p{C}--[\t\n\r]]]+").expect("static regex is valid"));
/// Characters BERT's clean-up turns into a plain space.
static SPACES: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"[\t\n\r\p{Zs}]").expect("static regex is valid"));
static WHITESPACE_RUNS: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\s+").expect("static regex is valid"));

impl TextNormalization {
    /// Cleans `text` the way the chosen reference does before its word
    /// splitting regex runs.
    pub(crate) fn apply(self, text: &str) -> String {
        match self {
            TextNormalization::TransformersSlow => slow_clean(text),
            TextNormalization::Tokenizers => {
                let nfc: String = text.nfc().collect();
                let spaced = WHITESPACE_RUNS.replace_all(&nfc, " ");
                spaced.chars().flat_map(char::to_lowercase).collect()
            }
        }
    }
}

fn slow_clean(text: &str) -> String {
    let kept = DROPPED.replace_all(text, "");
    let spaced = SPACES.replace_all(&kept, " ");
    let mut cjk_split = String::with_capacity(spaced.len());
    for c in spaced.chars() {
        if is_cjk_ideograph(c) {
            cjk_split.push(' ');
            cjk_split.push(c);
            cjk_split.push(' ');
        } else {
            cjk_split.push(c);
        }
    }
    let nfc: String = cjk_split.nfc().collect();
    let mut out = String::with_capacity(nfc.len());
    // Lowercasing per word matters: the final-sigma rule looks at word ends.
    for word in nfc.split_whitespace() {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(&word.to_lowercase());
    }
    out
}

/// The CJK blocks BERT's basic tokenizer isolates (unified ideographs and
/// their extensions plus compatibility ideographs; not kana or hangul).
fn is_cjk_ideograph(c: char) -> bool {
    matches!(
        c as u32,
        0x4E00..=0x9FFF
            | 0x3400..=0x4DBF
            | 0x20000..=0x2A6DF
            | 0x2A700..=0x2B73F
            | 0x2B740..=0x2B81F
            | 0x2B820..=0x2CEAF
            | 0xF900..=0xFAFF
            | 0x2F800..=0x2FA1F
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slow_flavour_matches_bert_basic_cleanup() {
        let slow = TextNormalization::TransformersSlow;
        assert_eq!(slow.apply("  A\tPhoto\n\nOF\u{a0}x  "), "a photo of x");
        assert_eq!(slow.apply("\u{7}bell\u{200b}z\u{0}"), "bellz");
        assert_eq!(slow.apply("中文x"), "中 文 x");
        // Decomposed e + acute composes under NFC.
        assert_eq!(slow.apply("Cafe\u{301}"), "caf\u{e9}");
        assert_eq!(slow.apply("ΣΑΣ"), "σας");
        assert_eq!(slow.apply("a\u{2028}b"), "a b");
    }

    #[test]
    fn tokenizers_flavour_keeps_controls_and_cjk_runs() {
        let fast = TextNormalization::Tokenizers;
        assert_eq!(fast.apply("\u{7}Bell 中文"), "\u{7}bell 中文");
        assert_eq!(fast.apply("ΣΑΣ"), "σασ");
    }
}
