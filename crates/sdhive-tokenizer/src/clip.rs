//! The CLIP byte-level BPE tokenizer: loading (HF tokenizer folder or the
//! bundled OpenAI merges file), text to ids, and the fixed-length layout the
//! diffusers pipelines feed their text encoders.
//!
//! Encoding follows transformers' Python `CLIPTokenizer`:
//! 1. special tokens typed into the text (bos, eos, unk, pad and any added
//!    tokens) are cut out verbatim, case-sensitively, longest match first;
//!    with pad `"!"` that includes every exclamation mark, which therefore
//!    encodes as id 0 instead of a BPE token — that is what diffusers does
//!    for SD 2.x and SDXL's second encoder;
//! 2. each remaining piece is cleaned ([`TextNormalization`]) and split into
//!    words by CLIP's regex (`'s`-style contractions, letter runs, single
//!    digits, punctuation runs);
//! 3. each word is mapped byte-wise to printable characters, gets `</w>` on
//!    its last symbol and is merged pair by pair in merge-rank order;
//!    symbols missing from the vocabulary become the unk id.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{LazyLock, Mutex};

use regex::Regex;
use serde_json::Value;

use crate::error::TokenizerError;
use crate::normalize::TextNormalization;

const BOS: &str = "<|startoftext|>";
const EOS: &str = "<|endoftext|>";
/// Longest sequence CLIP's text encoders accept, bos and eos included.
const DEFAULT_MAX_LEN: usize = 77;
/// transformers reads merges only up to this line (exclusive), whatever the
/// file holds: 49152 tokens minus 256 bytes minus the two specials, plus the
/// header line.
const MERGES_END: usize = 49152 - 256 - 2 + 1;
/// Word-level cache bound: a long-running worker sees unbounded distinct
/// words, so the cache is dropped when it grows past this.
const CACHE_LIMIT: usize = 50_000;

const BUNDLED_NAME: &str = "assets/bpe_simple_vocab_16e6.txt.gz";
static BUNDLED_GZ: &[u8] = include_bytes!("../assets/bpe_simple_vocab_16e6.txt.gz");

/// CLIP's word split as the Python tokenizer runs it. Python compiles it
/// case-insensitively; the only character where that changes a class is
/// U+0345 (combining ypogegrammeni, which folds to iota): Python's `regex`
/// then matches it with no alternative, so it is silently dropped, hence
/// its explicit exclusion here with case folding limited to the literals.
static WORD_SPLIT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i:<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d)|\p{L}+|\p{N}|[^\s\p{L}\p{N}\x{345}]+")
        .expect("static regex is valid")
});
/// The split of the `tokenizers` pipeline: the same pattern, but
/// case-sensitive.
static WORD_SPLIT_TOKENIZERS: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|\p{L}+|\p{N}|[^\s\p{L}\p{N}]+")
        .expect("static regex is valid")
});

/// The padding token of a bundled (folder-less) tokenizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PadToken {
    /// Pad with `<|endoftext|>` (SD 1.x, SDXL's first encoder).
    EndOfText,
    /// Pad with `"!"`, id 0 (SD 2.x, SDXL's second encoder, i.e. the
    /// OpenCLIP-trained models).
    Exclamation,
}

impl PadToken {
    fn as_str(self) -> &'static str {
        match self {
            PadToken::EndOfText => EOS,
            PadToken::Exclamation => "!",
        }
    }
}

/// A CLIP tokenizer. Cheap to share (`&self` everywhere); the per-word BPE
/// cache is internally synchronised.
pub struct ClipTokenizer {
    encoder: HashMap<String, u32>,
    /// Merge rank keyed by `"left right"` (symbols never contain a space
    /// after byte encoding).
    ranks: HashMap<String, u32>,
    /// Texts cut out before normalisation, longest first, with their ids.
    specials: Vec<(String, u32)>,
    bos: u32,
    eos: u32,
    pad: u32,
    unk: u32,
    max_len: usize,
    normalization: TextNormalization,
    cache: Mutex<HashMap<String, Vec<u32>>>,
}

impl std::fmt::Debug for ClipTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClipTokenizer")
            .field("vocab_size", &self.encoder.len())
            .field("merges", &self.ranks.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("pad", &self.pad)
            .field("max_len", &self.max_len)
            .field("normalization", &self.normalization)
            .finish_non_exhaustive()
    }
}

/// Special-token names as they end up after reading the config files, with
/// the file each came from (for error messages).
struct SpecialNames {
    bos: (String, PathBuf),
    eos: (String, PathBuf),
    unk: (String, PathBuf),
    pad: (String, PathBuf),
}

impl ClipTokenizer {
    /// Loads an HF tokenizer folder: `vocab.json` and `merges.txt` are
    /// required; `tokenizer_config.json` (model_max_length, special tokens,
    /// added tokens) and `special_tokens_map.json` (which wins, as in
    /// transformers) are optional.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let vocab_path = dir.join("vocab.json");
        let merges_path = dir.join("merges.txt");
        let encoder = parse_vocab(&vocab_path, &read_text(&vocab_path)?)?;
        let ranks = parse_merges(&merges_path, &read_text(&merges_path)?)?;

        let config_path = dir.join("tokenizer_config.json");
        let config = read_optional_json(&config_path)?;
        let map_path = dir.join("special_tokens_map.json");
        let map = read_optional_json(&map_path)?;

        let default = |s: &str| (s.to_string(), vocab_path.clone());
        let mut names =
            SpecialNames { bos: default(BOS), eos: default(EOS), unk: default(EOS), pad: default(EOS) };
        let mut added: Vec<(String, u32)> = Vec::new();
        let mut max_len = DEFAULT_MAX_LEN;
        if let Some(config) = &config {
            apply_special_names(&mut names, config, &config_path)?;
            added = parse_added_tokens(config, &config_path)?;
            max_len = parse_max_len(config, &config_path)?;
        }
        if let Some(map) = &map {
            apply_special_names(&mut names, map, &map_path)?;
        }
        let added_path = dir.join("added_tokens.json");
        if let Some(extra) = read_optional_json(&added_path)? {
            added.extend(parse_added_tokens_json(&extra, &added_path)?);
        }
        Self::assemble(encoder, ranks, names, added, max_len)
    }

    /// The OpenAI CLIP vocabulary compiled into this crate (the
    /// `bpe_simple_vocab_16e6.txt.gz` that open_clip ships), with vocab ids
    /// derived as CLIP does: 256 byte symbols, the same with `</w>`, one id
    /// per merge, then `<|startoftext|>` and `<|endoftext|>`. Equal to the
    /// `tokenizer/` folders of the SD checkpoints on the Hub.
    pub fn bundled(pad: PadToken) -> Result<Self, TokenizerError> {
        let mut text = String::new();
        flate2::read::GzDecoder::new(BUNDLED_GZ)
            .read_to_string(&mut text)
            .map_err(|source| TokenizerError::Io { path: BUNDLED_NAME.into(), source })?;
        let lines: Vec<&str> = text.split('\n').collect();
        if lines.len() < MERGES_END {
            return Err(TokenizerError::invalid(
                BUNDLED_NAME,
                format!("expected at least {MERGES_END} lines, found {}", lines.len()),
            ));
        }
        let merges = &lines[1..MERGES_END];

        let byte_syms = byte_symbols_in_vocab_order();
        let mut vocab: Vec<String> = Vec::with_capacity(256 * 2 + merges.len() + 2);
        vocab.extend(byte_syms.iter().map(|c| c.to_string()));
        vocab.extend(byte_syms.iter().map(|c| format!("{c}</w>")));
        let mut ranks = HashMap::with_capacity(merges.len());
        for (i, line) in merges.iter().enumerate() {
            let (a, b) = split_merge(line).ok_or_else(|| {
                TokenizerError::invalid(
                    BUNDLED_NAME,
                    format!("line {}: expected two symbols, got {line:?}", i + 2),
                )
            })?;
            vocab.push(format!("{a}{b}"));
            ranks.insert(format!("{a} {b}"), i as u32);
        }
        vocab.push(BOS.to_string());
        vocab.push(EOS.to_string());
        let encoder: HashMap<String, u32> =
            vocab.into_iter().enumerate().map(|(i, s)| (s, i as u32)).collect();

        let src = PathBuf::from(BUNDLED_NAME);
        let names = SpecialNames {
            bos: (BOS.into(), src.clone()),
            eos: (EOS.into(), src.clone()),
            unk: (EOS.into(), src.clone()),
            pad: (pad.as_str().into(), src),
        };
        Self::assemble(encoder, ranks, names, Vec::new(), DEFAULT_MAX_LEN)
    }

    fn assemble(
        encoder: HashMap<String, u32>,
        ranks: HashMap<String, u32>,
        names: SpecialNames,
        added: Vec<(String, u32)>,
        max_len: usize,
    ) -> Result<Self, TokenizerError> {
        let added_ids: HashMap<&str, u32> = added.iter().map(|(s, i)| (s.as_str(), *i)).collect();
        let lookup = |field: &'static str, (name, path): &(String, PathBuf)| {
            added_ids.get(name.as_str()).or_else(|| encoder.get(name)).copied().ok_or_else(|| {
                TokenizerError::UnknownSpecialToken { path: path.clone(), field, token: name.clone() }
            })
        };
        let bos = lookup("bos_token", &names.bos)?;
        let eos = lookup("eos_token", &names.eos)?;
        let unk = lookup("unk_token", &names.unk)?;
        let pad = lookup("pad_token", &names.pad)?;

        let mut specials: Vec<(String, u32)> =
            vec![(names.bos.0, bos), (names.eos.0, eos), (names.unk.0, unk), (names.pad.0, pad)];
        specials.extend(added);
        specials.retain(|(s, _)| !s.is_empty());
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        specials.dedup_by(|a, b| a.0 == b.0);

        Ok(Self {
            encoder,
            ranks,
            specials,
            bos,
            eos,
            pad,
            unk,
            max_len,
            normalization: TextNormalization::default(),
            cache: Mutex::new(HashMap::new()),
        })
    }

    /// Switches the text clean-up flavour (default: transformers' Python
    /// tokenizer without ftfy).
    pub fn with_normalization(mut self, normalization: TextNormalization) -> Self {
        self.normalization = normalization;
        self.cache = Mutex::new(HashMap::new());
        self
    }

    /// The text clean-up flavour in use.
    pub fn normalization(&self) -> TextNormalization {
        self.normalization
    }

    /// `<|startoftext|>`'s id.
    pub fn bos_id(&self) -> u32 {
        self.bos
    }

    /// `<|endoftext|>`'s id.
    pub fn eos_id(&self) -> u32 {
        self.eos
    }

    /// The padding id (`eos` or `"!"` = 0, depending on the model).
    pub fn pad_id(&self) -> u32 {
        self.pad
    }

    /// The unknown-symbol id.
    pub fn unk_id(&self) -> u32 {
        self.unk
    }

    /// Sequence length the text encoder takes, bos and eos included (77).
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Number of entries in the vocabulary file.
    pub fn vocab_size(&self) -> usize {
        self.encoder.len()
    }

    /// The id of a vocabulary entry, e.g. `",</w>"`.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.encoder.get(token).copied()
    }

    /// Token ids of `text`, without bos/eos and without truncation.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            match self.find_special(rest) {
                Some((start, len, id)) => {
                    self.encode_plain(&rest[..start], &mut ids);
                    ids.push(id);
                    rest = &rest[start + len..];
                }
                None => {
                    self.encode_plain(rest, &mut ids);
                    break;
                }
            }
        }
        ids
    }

    /// Exactly the `input_ids` diffusers feeds its text encoders:
    /// `tokenizer(text, padding="max_length", max_length=77,
    /// truncation=True)`, i.e. bos, at most 75 ids, eos, then pad to 77.
    pub fn encode_padded(&self, text: &str) -> Vec<u32> {
        let mut ids = self.encode(text);
        ids.truncate(self.max_len.saturating_sub(2));
        let mut out = Vec::with_capacity(self.max_len);
        out.push(self.bos);
        out.extend_from_slice(&ids);
        out.push(self.eos);
        out.resize(self.max_len.max(out.len()), self.pad);
        out
    }

    /// Leftmost occurrence of a special token (longest at that position):
    /// byte offset, byte length, id.
    fn find_special(&self, text: &str) -> Option<(usize, usize, u32)> {
        let mut best: Option<(usize, usize, u32)> = None;
        for (s, id) in &self.specials {
            if let Some(pos) = text.find(s.as_str()) {
                // `specials` is sorted longest first, so on a tie in position
                // the first hit is already the longest.
                if best.is_none_or(|(b, _, _)| pos < b) {
                    best = Some((pos, s.len(), *id));
                }
            }
        }
        best
    }

    fn encode_plain(&self, text: &str, ids: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        let clean = self.normalization.apply(text);
        match self.normalization {
            TextNormalization::TransformersSlow => {
                for m in WORD_SPLIT.find_iter(&clean) {
                    self.encode_word(m.as_str(), ids);
                }
            }
            TextNormalization::Tokenizers => {
                for m in WORD_SPLIT_TOKENIZERS.find_iter(&clean) {
                    let word = m.as_str();
                    // The pipeline's byte-level step re-splits every piece
                    // with GPT-2's pattern. That is a no-op on the pieces
                    // above except the two specials (which get here only
                    // after normalisation, e.g. typed in capitals): they fall
                    // apart into "<|", the name and "|>".
                    match word.strip_prefix("<|").and_then(|w| w.strip_suffix("|>")) {
                        Some(name) if word == BOS || word == EOS => {
                            self.encode_word("<|", ids);
                            self.encode_word(name, ids);
                            self.encode_word("|>", ids);
                        }
                        _ => self.encode_word(word, ids),
                    }
                }
            }
        }
    }

    fn encode_word(&self, word: &str, ids: &mut Vec<u32>) {
        // The Python tokenizer seeds its BPE cache with the two specials, so
        // when its regex isolates them (e.g. after lowercasing
        // "<|EndOfText|>") they map straight to their ids. (The `tokenizers`
        // path never passes them here.)
        if word == BOS || word == EOS {
            ids.push(self.encoder.get(word).copied().unwrap_or(self.unk));
            return;
        }
        if let Ok(cache) = self.cache.lock() {
            if let Some(hit) = cache.get(word) {
                ids.extend_from_slice(hit);
                return;
            }
        }
        let symbols = self.bpe(word);
        let word_ids: Vec<u32> =
            symbols.iter().map(|s| self.encoder.get(s).copied().unwrap_or(self.unk)).collect();
        ids.extend_from_slice(&word_ids);
        // A poisoned lock only means another thread panicked mid-insert; the
        // cache is an optimisation, so skip it rather than propagate.
        if let Ok(mut cache) = self.cache.lock() {
            if cache.len() >= CACHE_LIMIT {
                cache.clear();
            }
            cache.insert(word.to_string(), word_ids);
        }
    }

    /// BPE-merges one regex word into vocabulary symbols.
    fn bpe(&self, word: &str) -> Vec<String> {
        let table = byte_symbols();
        let mut symbols: Vec<String> = word.bytes().map(|b| table[b as usize].to_string()).collect();
        if let Some(last) = symbols.last_mut() {
            last.push_str("</w>");
        }
        let mut key = String::new();
        loop {
            // Lowest-ranked adjacent pair.
            let mut best: Option<(u32, usize)> = None;
            for i in 0..symbols.len().saturating_sub(1) {
                key.clear();
                key.push_str(&symbols[i]);
                key.push(' ');
                key.push_str(&symbols[i + 1]);
                if let Some(&rank) = self.ranks.get(key.as_str()) {
                    if best.is_none_or(|(r, _)| rank < r) {
                        best = Some((rank, i));
                    }
                }
            }
            let Some((_, at)) = best else { break };
            let (first, second) = (symbols[at].clone(), symbols[at + 1].clone());
            // Merge every occurrence of the pair, scanning left to right
            // without overlaps, as the reference does.
            let mut merged = Vec::with_capacity(symbols.len());
            let mut i = 0;
            while i < symbols.len() {
                if i + 1 < symbols.len() && symbols[i] == first && symbols[i + 1] == second {
                    merged.push(format!("{first}{second}"));
                    i += 2;
                } else {
                    merged.push(std::mem::take(&mut symbols[i]));
                    i += 1;
                }
            }
            symbols = merged;
            if symbols.len() == 1 {
                break;
            }
        }
        symbols
    }
}

/// GPT-2/CLIP's reversible byte-to-character table: printable Latin-1 bytes
/// stand for themselves, the other 68 bytes are shifted to U+0100.. so that
/// no symbol is whitespace or a control character.
fn byte_symbols() -> &'static [char; 256] {
    static TABLE: LazyLock<[char; 256]> = LazyLock::new(|| {
        let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
        let mut order: Vec<u32> = (0..256).filter(|&b| printable(b)).collect();
        let mut chars: Vec<u32> = order.clone();
        let mut next = 256;
        for b in 0..256u32 {
            if !printable(b) {
                order.push(b);
                chars.push(next);
                next += 1;
            }
        }
        let mut table = ['\0'; 256];
        for (b, c) in order.into_iter().zip(chars) {
            table[b as usize] = char::from_u32(c).unwrap_or('\0');
        }
        table
    });
    &TABLE
}

/// Vocabulary order of the byte symbols (printable bytes first): this is
/// the id order CLIP gives them.
fn byte_symbols_in_vocab_order() -> Vec<char> {
    let table = byte_symbols();
    let mut syms: Vec<char> = table.to_vec();
    syms.sort_by_key(|&c| c as u32);
    syms
}

fn split_merge(line: &str) -> Option<(&str, &str)> {
    let mut parts = line.split_whitespace();
    let a = parts.next()?;
    let b = parts.next()?;
    if parts.next().is_some() {
        return None;
    }
    Some((a, b))
}

fn read_text(path: &Path) -> Result<String, TokenizerError> {
    std::fs::read_to_string(path).map_err(|source| TokenizerError::Io { path: path.to_path_buf(), source })
}

fn read_optional_json(path: &Path) -> Result<Option<Value>, TokenizerError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(TokenizerError::Io { path: path.to_path_buf(), source }),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| TokenizerError::Json { path: path.to_path_buf(), source })
}

fn parse_vocab(path: &Path, text: &str) -> Result<HashMap<String, u32>, TokenizerError> {
    let value: Value = serde_json::from_str(text)
        .map_err(|source| TokenizerError::Json { path: path.to_path_buf(), source })?;
    let Value::Object(map) = value else {
        return Err(TokenizerError::invalid(path, "expected a JSON object mapping tokens to ids"));
    };
    let mut encoder = HashMap::with_capacity(map.len());
    for (token, id) in map {
        let id = id
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .ok_or_else(|| TokenizerError::invalid(path, format!("token {token:?}: id {id} is not a u32")))?;
        encoder.insert(token, id);
    }
    if encoder.is_empty() {
        return Err(TokenizerError::invalid(path, "vocabulary is empty"));
    }
    Ok(encoder)
}

fn parse_merges(path: &Path, text: &str) -> Result<HashMap<String, u32>, TokenizerError> {
    // transformers: `read().strip().split("\n")[1:48895]`; the first line is
    // the "#version" header and is skipped unconditionally.
    let lines: Vec<&str> = text.trim().split('\n').collect();
    let mut ranks = HashMap::new();
    for (i, line) in lines.iter().enumerate().take(MERGES_END).skip(1) {
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() {
            // An empty merge still takes a rank slot in the reference.
            continue;
        }
        let (a, b) = split_merge(line).ok_or_else(|| {
            TokenizerError::invalid(
                path,
                format!("line {}: expected two space-separated symbols, got {line:?}", i + 1),
            )
        })?;
        // Python's dict keeps the last rank of a duplicated merge.
        ranks.insert(format!("{a} {b}"), i as u32 - 1);
    }
    Ok(ranks)
}

/// Reads `bos_token`/`eos_token`/`unk_token`/`pad_token` (plain strings or
/// `{"content": ...}` objects) from a config, overriding what is there.
fn apply_special_names(names: &mut SpecialNames, config: &Value, path: &Path) -> Result<(), TokenizerError> {
    let slots: [(&str, &mut (String, PathBuf)); 4] = [
        ("bos_token", &mut names.bos),
        ("eos_token", &mut names.eos),
        ("unk_token", &mut names.unk),
        ("pad_token", &mut names.pad),
    ];
    for (field, slot) in slots {
        match config.get(field) {
            None | Some(Value::Null) => {}
            Some(v) => {
                let content = token_content(v).ok_or_else(|| {
                    TokenizerError::invalid(
                        path,
                        format!("{field}: expected a string or an object with \"content\""),
                    )
                })?;
                *slot = (content.to_string(), path.to_path_buf());
            }
        }
    }
    Ok(())
}

fn token_content(v: &Value) -> Option<&str> {
    match v {
        Value::String(s) => Some(s),
        Value::Object(o) => o.get("content").and_then(Value::as_str),
        _ => None,
    }
}

/// `added_tokens_decoder` of a tokenizer_config.json: `{"49406": {"content":
/// "<|startoftext|>", ...}, ...}`.
fn parse_added_tokens(config: &Value, path: &Path) -> Result<Vec<(String, u32)>, TokenizerError> {
    let Some(decoder) = config.get("added_tokens_decoder") else {
        return Ok(Vec::new());
    };
    let Value::Object(map) = decoder else {
        return Err(TokenizerError::invalid(path, "added_tokens_decoder: expected an object"));
    };
    let mut out = Vec::with_capacity(map.len());
    for (id, entry) in map {
        let id: u32 = id
            .parse()
            .map_err(|_| TokenizerError::invalid(path, format!("added_tokens_decoder: bad id {id:?}")))?;
        let content = token_content(entry).ok_or_else(|| {
            TokenizerError::invalid(path, format!("added_tokens_decoder[{id}]: no content"))
        })?;
        out.push((content.to_string(), id));
    }
    Ok(out)
}

/// Legacy `added_tokens.json`: `{"token": id, ...}`.
fn parse_added_tokens_json(v: &Value, path: &Path) -> Result<Vec<(String, u32)>, TokenizerError> {
    let Value::Object(map) = v else {
        return Err(TokenizerError::invalid(path, "expected an object"));
    };
    map.iter()
        .map(|(token, id)| {
            id.as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .map(|id| (token.clone(), id))
                .ok_or_else(|| TokenizerError::invalid(path, format!("token {token:?}: bad id {id}")))
        })
        .collect()
}

/// `model_max_length`; transformers writes a huge sentinel when the model
/// has no limit, which for CLIP means the standard 77.
fn parse_max_len(config: &Value, path: &Path) -> Result<usize, TokenizerError> {
    let Some(v) = config.get("model_max_length") else {
        return Ok(DEFAULT_MAX_LEN);
    };
    match v.as_f64() {
        Some(n) if n > 1e6 => Ok(DEFAULT_MAX_LEN),
        Some(n) if n >= 3.0 && n.fract() == 0.0 => Ok(n as usize),
        _ => {
            Err(TokenizerError::invalid(path, format!("model_max_length: {v} is not a length of at least 3")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_has_clip_layout() {
        let t = byte_symbols();
        assert_eq!(t[b'!' as usize], '!');
        assert_eq!(t[b' ' as usize], '\u{120}');
        assert_eq!(t[0], '\u{100}');
        let order = byte_symbols_in_vocab_order();
        assert_eq!(order.len(), 256);
        assert_eq!(order[0], '!');
    }
}
