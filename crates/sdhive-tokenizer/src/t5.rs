//! The T5 SentencePiece (Unigram) tokenizer of SD3's third text encoder: loading a `tokenizer_3/` folder and
//! the fixed-length ids diffusers' `StableDiffusion3Pipeline` feeds T5 (`padding="max_length"`,
//! `truncation=True`, `add_special_tokens=True`: the text's pieces cut to `max_len - 1`, `</s>` appended,
//! `<pad>` after it).
//!
//! The pipeline is the one transformers 5's `T5Tokenizer` builds, which is not always the one a
//! `tokenizer.json` spells out: transformers takes the file's Unigram vocabulary, its added tokens and the
//! SentencePiece `precompiled_charsmap` of its normaliser, and rebuilds the rest — normaliser `Precompiled`
//! alone (a `Replace(" {2,}")` or `Strip` beside it is dropped), pre-tokeniser whitespace split followed by
//! `Metaspace("▁", prepend always, split)`, post-processor `$A </s>`. The same pipeline is built here. A
//! folder with only `spiece.model` (the SentencePiece protobuf) gets its pieces, scores and charsmap read
//! from the protobuf, plus the `<extra_id_N>` sentinels as T5's own `tokenizer.json` numbers them.
//!
//! Normalisation, pre-tokenisation and the Unigram Viterbi search run in Hugging Face's `tokenizers` crate:
//! it is the code transformers itself calls for `T5TokenizerFast`, so the charsmap's odd corner cases
//! (grapheme-wise lookups, its NUL-terminated entries) and Viterbi's tie-breaking are the reference's by
//! construction. candle-core already links it (default features off, `fancy-regex`), so it adds nothing to
//! the build; no `onig` (C), no progress bars, no `esaxx` C++ (only the trainer uses it).

use std::path::{Path, PathBuf};

use serde_json::Value;
use tokenizers::models::unigram::Unigram;
use tokenizers::normalizers::Precompiled;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
use tokenizers::{AddedToken, PreTokenizerWrapper, Tokenizer};

use crate::error::TokenizerError;

/// diffusers' `max_sequence_length` default for SD3/SD3.5.
pub const T5_DEFAULT_MAX_LEN: usize = 256;
/// The longest `max_sequence_length` diffusers' SD3 pipelines accept.
pub const T5_MAX_LEN: usize = 512;

const EOS: &str = "</s>";
const PAD: &str = "<pad>";
const UNK: &str = "<unk>";
/// T5's sentinel count when `tokenizer_config.json` does not say (`extra_ids`).
const DEFAULT_EXTRA_IDS: usize = 100;

/// A T5 tokenizer. `&self` everywhere, so one instance serves every request.
pub struct T5Tokenizer {
    inner: Tokenizer,
    eos: u32,
    pad: u32,
    unk: u32,
    /// The file the vocabulary came from, for error messages.
    source: PathBuf,
}

impl std::fmt::Debug for T5Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("T5Tokenizer")
            .field("source", &self.source)
            .field("vocab_size", &self.vocab_size())
            .field("eos", &self.eos)
            .field("pad", &self.pad)
            .field("unk", &self.unk)
            .finish_non_exhaustive()
    }
}

/// Special-token names from `tokenizer_config.json` / `special_tokens_map.json` (the latter wins, as in
/// transformers), with T5's defaults.
struct SpecialNames {
    eos: String,
    pad: String,
    unk: String,
    extra_ids: usize,
}

impl T5Tokenizer {
    /// Loads a `tokenizer_3/` folder: `tokenizer.json` when present, else `spiece.model`;
    /// `tokenizer_config.json` and `special_tokens_map.json` are optional.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let names = read_special_names(dir)?;
        let json = dir.join("tokenizer.json");
        if json.is_file() {
            return Self::from_tokenizer_json(&json, &names);
        }
        let spiece = dir.join("spiece.model");
        if spiece.is_file() {
            return Self::from_spiece_model(&spiece, &names);
        }
        Err(TokenizerError::Io {
            path: json,
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "neither tokenizer.json nor spiece.model is in the T5 tokenizer folder",
            ),
        })
    }

    fn from_tokenizer_json(path: &Path, names: &SpecialNames) -> Result<Self, TokenizerError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| TokenizerError::Io { path: path.to_path_buf(), source })?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|source| TokenizerError::Json { path: path.to_path_buf(), source })?;
        let model_type = value.pointer("/model/type").and_then(Value::as_str);
        if model_type != Some("Unigram") {
            return Err(TokenizerError::invalid(
                path,
                format!("model.type is {model_type:?}; a T5 tokenizer is a Unigram model"),
            ));
        }
        let charsmap = precompiled_charsmap(value.get("normalizer"), path)?;
        let mut inner: Tokenizer = text.parse().map_err(|e| {
            TokenizerError::invalid(path, format!("not a tokenizers serialisation this crate reads: {e}"))
        })?;
        inner.with_truncation(None).map_err(|e| TokenizerError::invalid(path, e.to_string()))?;
        inner.with_padding(None);
        Self::finish(inner, charsmap, names, path)
    }

    fn from_spiece_model(path: &Path, names: &SpecialNames) -> Result<Self, TokenizerError> {
        let bytes =
            std::fs::read(path).map_err(|source| TokenizerError::Io { path: path.to_path_buf(), source })?;
        let model = spiece::parse(&bytes).map_err(|detail| TokenizerError::invalid(path, detail))?;
        let unk = model.unk_id.ok_or_else(|| {
            TokenizerError::invalid(path, "no piece of type UNKNOWN in the SentencePiece model")
        })?;
        let pieces = model.pieces.len();
        let unigram = Unigram::from(model.pieces, Some(unk), false)
            .map_err(|e| TokenizerError::invalid(path, format!("Unigram vocabulary: {e}")))?;
        let mut inner = Tokenizer::new(unigram);
        // T5's tokenizer.json numbers the sentinels after the pieces, counting down: `<extra_id_0>` last.
        let sentinels: Vec<AddedToken> =
            (0..names.extra_ids).rev().map(|i| AddedToken::from(format!("<extra_id_{i}>"), true)).collect();
        inner
            .add_special_tokens(sentinels)
            .map_err(|e| TokenizerError::invalid(path, format!("cannot add the sentinels: {e}")))?;
        if inner.get_vocab_size(true) != pieces + names.extra_ids {
            return Err(TokenizerError::invalid(
                path,
                "the SentencePiece model already holds <extra_id_N> pieces",
            ));
        }
        Self::finish(inner, model.charsmap, names, path)
    }

    /// Installs transformers 5's T5 pipeline around the vocabulary and resolves the special tokens.
    fn finish(
        mut inner: Tokenizer,
        charsmap: Option<Vec<u8>>,
        names: &SpecialNames,
        path: &Path,
    ) -> Result<Self, TokenizerError> {
        let normalizer = match charsmap {
            Some(bytes) => Some(Precompiled::from(&bytes).map_err(|e| {
                TokenizerError::invalid(path, format!("precompiled_charsmap does not parse: {e}"))
            })?),
            None => None,
        };
        inner.with_normalizer(normalizer).map_err(|e| TokenizerError::invalid(path, e.to_string()))?;
        let pre: Vec<PreTokenizerWrapper> =
            vec![WhitespaceSplit.into(), Metaspace::new('\u{2581}', PrependScheme::Always, true).into()];
        inner.with_pre_tokenizer(Some(Sequence::new(pre)));
        // The post-processing (truncate, `</s>`, pad) is done by `encode` itself.
        inner.with_post_processor(None::<tokenizers::PostProcessorWrapper>);
        // transformers adds eos/unk/pad as special tokens, so typed into a prompt they are cut out whole.
        let specials: Vec<AddedToken> = [&names.eos, &names.unk, &names.pad]
            .iter()
            .map(|t| AddedToken::from(t.to_string(), true))
            .collect();
        inner
            .add_special_tokens(specials)
            .map_err(|e| TokenizerError::invalid(path, format!("cannot add the special tokens: {e}")))?;
        let id = |field: &'static str, token: &str| {
            inner.token_to_id(token).ok_or_else(|| TokenizerError::UnknownSpecialToken {
                path: path.to_path_buf(),
                field,
                token: token.to_string(),
            })
        };
        let (eos, pad, unk) =
            (id("eos_token", &names.eos)?, id("pad_token", &names.pad)?, id("unk_token", &names.unk)?);
        Ok(Self { inner, eos, pad, unk, source: path.to_path_buf() })
    }

    pub fn eos_id(&self) -> u32 {
        self.eos
    }

    pub fn pad_id(&self) -> u32 {
        self.pad
    }

    pub fn unk_id(&self) -> u32 {
        self.unk
    }

    /// Vocabulary size with the added tokens (the ids this tokenizer can produce are below it).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The text's piece ids followed by `</s>`, neither truncated nor padded.
    pub fn encode_unpadded(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| TokenizerError::invalid(&self.source, format!("cannot encode the prompt: {e}")))?;
        let mut ids = encoding.get_ids().to_vec();
        ids.push(self.eos);
        Ok(ids)
    }

    /// diffusers' `tokenizer_3(text, padding="max_length", max_length=max_len, truncation=True,
    /// add_special_tokens=True).input_ids`: exactly `max_len` ids (`1..=T5_MAX_LEN`).
    pub fn encode(&self, text: &str, max_len: usize) -> Result<Vec<u32>, TokenizerError> {
        if max_len == 0 || max_len > T5_MAX_LEN {
            return Err(TokenizerError::invalid(
                &self.source,
                format!("max_sequence_length {max_len} is outside 1..={T5_MAX_LEN}"),
            ));
        }
        let mut ids = self.encode_unpadded(text)?;
        if ids.len() > max_len {
            // The pieces are cut, `</s>` stays last (truncation leaves room for the special token).
            ids.truncate(max_len - 1);
            ids.push(self.eos);
        }
        ids.resize(max_len, self.pad);
        Ok(ids)
    }

    /// The prompt's pieces dropped by [`Self::encode`] at `max_len`, as diffusers warns about them.
    pub fn truncated_pieces(&self, text: &str, max_len: usize) -> Result<usize, TokenizerError> {
        Ok(self.encode_unpadded(text)?.len().saturating_sub(max_len))
    }
}

/// The charsmap of a `Precompiled` normaliser, alone or inside a `Sequence`, as transformers looks for it.
fn precompiled_charsmap(normalizer: Option<&Value>, path: &Path) -> Result<Option<Vec<u8>>, TokenizerError> {
    let Some(normalizer) = normalizer.filter(|n| !n.is_null()) else { return Ok(None) };
    let list: Vec<&Value> = match normalizer.get("type").and_then(Value::as_str) {
        Some("Sequence") => normalizer
            .get("normalizers")
            .and_then(Value::as_array)
            .map(|a| a.iter().collect())
            .unwrap_or_default(),
        _ => vec![normalizer],
    };
    for n in list {
        if n.get("type").and_then(Value::as_str) != Some("Precompiled") {
            continue;
        }
        let Some(encoded) = n.get("precompiled_charsmap").and_then(Value::as_str) else { continue };
        return base64_decode(encoded)
            .map(Some)
            .ok_or_else(|| TokenizerError::invalid(path, "normalizer.precompiled_charsmap is not base64"));
    }
    Ok(None)
}

/// Standard base64 (with padding), the encoding `tokenizers` writes the charsmap in.
fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let value = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let bytes = text.trim_end_matches('=').as_bytes();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        if chunk.len() == 1 {
            return None;
        }
        let mut acc = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            acc |= value(c)? << (18 - 6 * i);
        }
        let produced = chunk.len() - 1;
        out.extend_from_slice(&acc.to_be_bytes()[1..1 + produced]);
    }
    Some(out)
}

fn read_optional_json(path: &Path) -> Result<Option<Value>, TokenizerError> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|source| TokenizerError::Json { path: path.to_path_buf(), source }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizerError::Io { path: path.to_path_buf(), source }),
    }
}

fn read_special_names(dir: &Path) -> Result<SpecialNames, TokenizerError> {
    let mut names =
        SpecialNames { eos: EOS.into(), pad: PAD.into(), unk: UNK.into(), extra_ids: DEFAULT_EXTRA_IDS };
    for file in ["tokenizer_config.json", "special_tokens_map.json"] {
        let path = dir.join(file);
        let Some(value) = read_optional_json(&path)? else { continue };
        for (key, slot) in
            [("eos_token", &mut names.eos), ("pad_token", &mut names.pad), ("unk_token", &mut names.unk)]
        {
            match value.get(key) {
                None | Some(Value::Null) => {}
                Some(Value::String(s)) => *slot = s.clone(),
                // An `AddedToken` serialised as an object.
                Some(v) => match v.get("content").and_then(Value::as_str) {
                    Some(s) => *slot = s.to_string(),
                    None => {
                        return Err(TokenizerError::invalid(
                            &path,
                            format!("`{key}` is neither a string nor a token"),
                        ))
                    }
                },
            }
        }
        if let Some(v) = value.get("extra_ids") {
            names.extra_ids = v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| TokenizerError::invalid(&path, "`extra_ids` is not a count"))?;
        }
    }
    Ok(names)
}

/// Just enough of SentencePiece's `ModelProto` (protobuf) for a Unigram model: the pieces with their scores
/// and types, and the normaliser's precompiled charsmap.
mod spiece {
    pub struct Model {
        pub pieces: Vec<(String, f64)>,
        pub unk_id: Option<usize>,
        pub charsmap: Option<Vec<u8>>,
    }

    /// `ModelProto.pieces` = 1, `ModelProto.normalizer_spec` = 3; `SentencePiece.{piece=1, score=2, type=3}`;
    /// `NormalizerSpec.precompiled_charsmap` = 2; piece type 2 is UNKNOWN.
    pub fn parse(bytes: &[u8]) -> Result<Model, String> {
        let mut model = Model { pieces: Vec::new(), unk_id: None, charsmap: None };
        for field in Fields::new(bytes) {
            match field? {
                (1, Value::Bytes(piece)) => {
                    let (mut text, mut score, mut kind) = (None, 0f32, 1u64);
                    for f in Fields::new(piece) {
                        match f? {
                            (1, Value::Bytes(b)) => {
                                text =
                                    Some(String::from_utf8(b.to_vec()).map_err(|_| "a piece is not UTF-8")?)
                            }
                            (2, Value::Fixed32(v)) => score = f32::from_bits(v),
                            (3, Value::Varint(v)) => kind = v,
                            _ => {}
                        }
                    }
                    let text = text.ok_or("a piece has no text")?;
                    if kind == 2 && model.unk_id.is_none() {
                        model.unk_id = Some(model.pieces.len());
                    }
                    model.pieces.push((text, f64::from(score)));
                }
                (3, Value::Bytes(spec)) => {
                    for f in Fields::new(spec) {
                        if let (2, Value::Bytes(b)) = f? {
                            model.charsmap = Some(b.to_vec());
                        }
                    }
                }
                _ => {}
            }
        }
        if model.pieces.is_empty() {
            return Err("no pieces: not a SentencePiece model".into());
        }
        Ok(model)
    }

    enum Value<'a> {
        Varint(u64),
        Fixed64,
        Bytes(&'a [u8]),
        Fixed32(u32),
    }

    struct Fields<'a> {
        bytes: &'a [u8],
        at: usize,
        failed: bool,
    }

    impl<'a> Fields<'a> {
        fn new(bytes: &'a [u8]) -> Self {
            Self { bytes, at: 0, failed: false }
        }

        fn varint(&mut self) -> Result<u64, String> {
            let mut value = 0u64;
            for shift in (0..64).step_by(7) {
                let b = *self.bytes.get(self.at).ok_or("truncated protobuf varint")?;
                self.at += 1;
                value |= u64::from(b & 0x7f) << shift;
                if b < 0x80 {
                    return Ok(value);
                }
            }
            Err("protobuf varint longer than 64 bits".into())
        }

        fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
            let end = self
                .at
                .checked_add(n)
                .filter(|&e| e <= self.bytes.len())
                .ok_or("truncated protobuf field")?;
            let out = &self.bytes[self.at..end];
            self.at = end;
            Ok(out)
        }

        fn field(&mut self) -> Result<(u64, Value<'a>), String> {
            let key = self.varint()?;
            let value = match key & 7 {
                0 => Value::Varint(self.varint()?),
                1 => {
                    self.take(8)?;
                    Value::Fixed64
                }
                2 => {
                    let n = usize::try_from(self.varint()?).map_err(|_| "protobuf length overflows")?;
                    Value::Bytes(self.take(n)?)
                }
                5 => {
                    let b = self.take(4)?;
                    Value::Fixed32(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                }
                w => return Err(format!("unsupported protobuf wire type {w}")),
            };
            Ok((key >> 3, value))
        }
    }

    impl<'a> Iterator for Fields<'a> {
        type Item = Result<(u64, Value<'a>), String>;

        fn next(&mut self) -> Option<Self::Item> {
            if self.failed || self.at >= self.bytes.len() {
                return None;
            }
            let r = self.field();
            self.failed = r.is_err();
            Some(r)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips_known_vectors() {
        assert_eq!(base64_decode("").as_deref(), Some(&b""[..]));
        assert_eq!(base64_decode("Zg==").as_deref(), Some(&b"f"[..]));
        assert_eq!(base64_decode("Zm8=").as_deref(), Some(&b"fo"[..]));
        assert_eq!(base64_decode("Zm9vYmFy").as_deref(), Some(&b"foobar"[..]));
        assert_eq!(base64_decode("Zm9v!mFy"), None);
    }

    #[test]
    fn protobuf_reader_rejects_truncation() {
        // Field 1, length 5, but only two bytes follow.
        assert!(spiece::parse(&[0x0a, 0x05, 0x01, 0x02]).is_err());
        assert!(spiece::parse(&[]).is_err());
    }
}
