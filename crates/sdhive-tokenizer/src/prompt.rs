//! AUTOMATIC1111-style prompt emphasis and 75-token chunking.
//!
//! Owns the two steps between a user's prompt string and the `(ids,
//! weights)` rows the engine encodes: [`parse_prompt_attention`] turns
//! `(word)`, `[word]`, `(word:1.3)` and `BREAK` into weighted fragments, and
//! [`weighted_chunks`] tokenizes the fragments into 77-token chunks
//! (bos + 75 + eos) the way the web UI's CLIP hijack does, including its
//! "comma padding backtrack" and its rule that everything after the first
//! eos becomes the pad token.
//!
//! Behaviour kept from the web UI on purpose, because users' prompts rely on
//! it: unbalanced brackets close at the end of the text; a `)` or `]` with
//! nothing open, or a `(x:w)` weight outside parentheses, is literal text; a
//! lone backslash is dropped; weights are products of f64 factors (`[x]`
//! multiplies by `1 / 1.1`, not divides) and only exactly equal neighbours
//! merge; a `BREAK` inside brackets has its marker weight scaled away from
//! -1 and is therefore tokenized as the word "BREAK" with a negative weight.
//! A weight that does not parse as a number (e.g. `(x:1.2.3)`) is kept as
//! literal text, where the web UI would raise an error.

use std::sync::LazyLock;

use regex::Regex;

use crate::clip::ClipTokenizer;

/// Multiplier of one `( )` level.
const ROUND: f64 = 1.1;
/// Multiplier of one `[ ]` level; written as the web UI computes it.
const SQUARE: f64 = 1.0 / 1.1;
/// Marker weight of a `BREAK` fragment.
const BREAK_WEIGHT: f64 = -1.0;
/// The web UI's default "comma padding backtrack".
pub const DEFAULT_COMMA_BACKTRACK: usize = 20;

static ATTENTION: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\\\(|\\\)|\\\[|\\\]|\\\\|\\|\(|\[|:\s*([+-]?[.\d]+)\s*\)|\)|\]|[^\\()\[\]:]+|:")
        .expect("static regex is valid")
});
static BREAK: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?s)\s*\bBREAK\b\s*").expect("static regex is valid"));

/// Splits a prompt into `(text, weight)` fragments with A1111 semantics.
/// `BREAK` appears as `("BREAK", -1.0)`. Weights are f64 so that equality
/// merging and the reported values match the web UI bit for bit.
pub fn parse_prompt_attention(text: &str) -> Vec<(String, f64)> {
    let mut res: Vec<(String, f64)> = Vec::new();
    let mut round: Vec<usize> = Vec::new();
    let mut square: Vec<usize> = Vec::new();

    fn multiply_from(res: &mut [(String, f64)], start: usize, factor: f64) {
        for (_, w) in &mut res[start..] {
            *w *= factor;
        }
    }

    for caps in ATTENTION.captures_iter(text) {
        let Some(whole) = caps.get(0) else { continue };
        let m = whole.as_str();
        let weight = caps.get(1).and_then(|w| w.as_str().parse::<f64>().ok());
        if let Some(literal) = m.strip_prefix('\\') {
            res.push((literal.to_string(), 1.0));
        } else if m == "(" {
            round.push(res.len());
        } else if m == "[" {
            square.push(res.len());
        } else if let (Some(w), Some(start)) = (weight, round.last().copied()) {
            round.pop();
            multiply_from(&mut res, start, w);
        } else if m == ")" && !round.is_empty() {
            if let Some(start) = round.pop() {
                multiply_from(&mut res, start, ROUND);
            }
        } else if m == "]" && !square.is_empty() {
            if let Some(start) = square.pop() {
                multiply_from(&mut res, start, SQUARE);
            }
        } else {
            for (i, part) in BREAK.split(m).enumerate() {
                if i > 0 {
                    res.push(("BREAK".to_string(), BREAK_WEIGHT));
                }
                res.push((part.to_string(), 1.0));
            }
        }
    }

    for start in round {
        multiply_from(&mut res, start, ROUND);
    }
    for start in square {
        multiply_from(&mut res, start, SQUARE);
    }

    if res.is_empty() {
        return vec![(String::new(), 1.0)];
    }

    let mut merged: Vec<(String, f64)> = Vec::with_capacity(res.len());
    for (text, w) in res {
        match merged.last_mut() {
            Some((prev, pw)) if *pw == w => prev.push_str(&text),
            _ => merged.push((text, w)),
        }
    }
    merged
}

/// One text-encoder input row: `max_len` ids and the emphasis weight of each
/// position (1.0 for bos, eos and padding).
#[derive(Debug, Clone, PartialEq)]
pub struct Chunk {
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
}

impl Chunk {
    /// True when no position is emphasised, so the engine can skip the
    /// re-weighting multiply entirely.
    pub fn is_unweighted(&self) -> bool {
        self.weights.iter().all(|&w| w == 1.0)
    }
}

/// True when none of `chunks` carries emphasis.
pub fn all_unweighted(chunks: &[Chunk]) -> bool {
    chunks.iter().all(Chunk::is_unweighted)
}

/// Knobs of the web UI that change chunking.
#[derive(Debug, Clone, PartialEq)]
pub struct ChunkOptions {
    /// Parse `( )`, `[ ]`, `(x:w)` and `BREAK`; when false the whole prompt
    /// is one weight-1 fragment (the web UI's emphasis "None").
    pub emphasis: bool,
    /// When a chunk fills up and a comma sits within this many tokens of its
    /// end, the text after the comma moves to the next chunk; 0 disables.
    pub comma_backtrack: usize,
    /// Textual-inversion embeddings: each whole-word occurrence of a name
    /// (ignoring case, as CLIP's lower-casing tokenizer does) becomes its ids.
    pub embeddings: Vec<EmbeddingWord>,
}

impl Default for ChunkOptions {
    fn default() -> Self {
        Self { emphasis: true, comma_backtrack: DEFAULT_COMMA_BACKTRACK, embeddings: Vec::new() }
    }
}

/// A textual-inversion embedding as the tokenizer sees it: its word in the
/// prompt and the ids (past the vocabulary, one per vector) that stand for it.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbeddingWord {
    pub name: String,
    pub ids: Vec<u32>,
}

/// A fragment's text split around the embedding words it contains.
enum Piece<'a> {
    Text(&'a str),
    Embedding(&'a [u32]),
}

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The earliest whole-word occurrence of an embedding name in `text` (the
/// longest name where two start at the same place): (start, end, ids).
fn find_embedding<'a>(text: &str, embeddings: &'a [EmbeddingWord]) -> Option<(usize, usize, &'a [u32])> {
    let lower = text.to_lowercase();
    // Lower-casing may change byte lengths outside ASCII; matching is then skipped rather than misplaced.
    if lower.len() != text.len() {
        return None;
    }
    let mut best: Option<(usize, usize, &[u32])> = None;
    for e in embeddings {
        let name = e.name.to_lowercase();
        if name.is_empty() {
            continue;
        }
        let mut from = 0;
        while let Some(at) = lower[from..].find(&name).map(|i| i + from) {
            let end = at + name.len();
            let before = lower[..at].chars().next_back().is_none_or(|c| !is_word_char(c));
            let after = lower[end..].chars().next().is_none_or(|c| !is_word_char(c));
            if before && after {
                let better = match best {
                    None => true,
                    Some((s, e2, _)) => at < s || (at == s && end > e2),
                };
                if better {
                    best = Some((at, end, e.ids.as_slice()));
                }
                break;
            }
            from = at + name.chars().next().map_or(1, char::len_utf8);
        }
    }
    best
}

fn split_embeddings<'a>(mut text: &'a str, embeddings: &'a [EmbeddingWord]) -> Vec<Piece<'a>> {
    let mut pieces = Vec::new();
    while let Some((start, end, ids)) = find_embedding(text, embeddings) {
        if start > 0 {
            pieces.push(Piece::Text(&text[..start]));
        }
        pieces.push(Piece::Embedding(ids));
        text = &text[end..];
    }
    if !text.is_empty() {
        pieces.push(Piece::Text(text));
    }
    pieces
}

/// [`weighted_chunks_with`] using the web UI's defaults.
pub fn weighted_chunks(tok: &ClipTokenizer, text: &str) -> Vec<Chunk> {
    weighted_chunks_with(tok, text, &ChunkOptions::default())
}

/// Tokenizes a prompt into chunks of `tok.max_len()` ids (at least one).
/// For a plain prompt of at most 75 tokens the single chunk's ids equal
/// [`ClipTokenizer::encode_padded`].
pub fn weighted_chunks_with(tok: &ClipTokenizer, text: &str, opts: &ChunkOptions) -> Vec<Chunk> {
    let parsed = if opts.emphasis { parse_prompt_attention(text) } else { vec![(text.to_string(), 1.0)] };
    let body = tok.max_len().saturating_sub(2).max(1);
    let comma = tok.token_to_id(",</w>");

    let mut chunks = Vec::new();
    let mut ids: Vec<u32> = Vec::with_capacity(body);
    let mut weights: Vec<f64> = Vec::with_capacity(body);
    let mut last_comma: Option<usize> = None;

    for (fragment, weight) in &parsed {
        if fragment == "BREAK" && *weight == BREAK_WEIGHT {
            chunks.push(finish_chunk(tok, &ids, &weights));
            ids.clear();
            weights.clear();
            last_comma = None;
            continue;
        }
        for piece in split_embeddings(fragment, &opts.embeddings) {
            let tokens = match piece {
                Piece::Text(text) => tok.encode(text),
                Piece::Embedding(vectors) => {
                    // An embedding is never split across chunks (the web UI moves it whole to the next one).
                    if !ids.is_empty() && ids.len() + vectors.len() > body {
                        chunks.push(finish_chunk(tok, &ids, &weights));
                        ids.clear();
                        weights.clear();
                        last_comma = None;
                    }
                    ids.extend_from_slice(vectors);
                    weights.extend(std::iter::repeat_n(*weight, vectors.len()));
                    continue;
                }
            };
            for token in tokens {
                if Some(token) == comma {
                    last_comma = Some(ids.len());
                } else if let Some(at) = last_comma.filter(|&c| {
                    opts.comma_backtrack != 0 && ids.len() == body && ids.len() - c <= opts.comma_backtrack
                }) {
                    // Cut right after the comma and carry the tail over, so a
                    // comma-separated phrase is not split across chunks.
                    let moved_ids = ids.split_off(at + 1);
                    let moved_weights = weights.split_off(at + 1);
                    chunks.push(finish_chunk(tok, &ids, &weights));
                    ids = moved_ids;
                    weights = moved_weights;
                    last_comma = None;
                }
                if ids.len() == body {
                    chunks.push(finish_chunk(tok, &ids, &weights));
                    ids.clear();
                    weights.clear();
                    last_comma = None;
                }
                ids.push(token);
                weights.push(*weight);
            }
        }
    }
    if !ids.is_empty() || chunks.is_empty() {
        chunks.push(finish_chunk(tok, &ids, &weights));
    }
    chunks
}

/// The chunk of an empty prompt: bos, eos, padding; all weights 1.
pub fn empty_chunk(tok: &ClipTokenizer) -> Chunk {
    finish_chunk(tok, &[], &[])
}

/// Appends empty chunks to the shorter list so both prompts (e.g. positive
/// and negative) have the same number of chunks, as the web UI does before
/// classifier-free guidance.
pub fn pad_chunk_counts(tok: &ClipTokenizer, a: &mut Vec<Chunk>, b: &mut Vec<Chunk>) {
    let n = a.len().max(b.len());
    for list in [a, b] {
        while list.len() < n {
            list.push(empty_chunk(tok));
        }
    }
}

/// Wraps up to 75 tokens into a full row: eos-fill, bos/eos around, then
/// everything after the first eos becomes pad (a no-op where pad is eos).
fn finish_chunk(tok: &ClipTokenizer, ids: &[u32], weights: &[f64]) -> Chunk {
    let body = tok.max_len().saturating_sub(2).max(1);
    let mut out_ids = Vec::with_capacity(body + 2);
    let mut out_w = Vec::with_capacity(body + 2);
    out_ids.push(tok.bos_id());
    out_w.push(1.0f32);
    out_ids.extend_from_slice(ids);
    // The web UI keeps weights in f64 and hands them to torch as float32.
    out_w.extend(weights.iter().map(|&w| w as f32));
    while out_ids.len() < body + 1 {
        out_ids.push(tok.eos_id());
        out_w.push(1.0);
    }
    out_ids.push(tok.eos_id());
    out_w.push(1.0);
    if tok.pad_id() != tok.eos_id() {
        if let Some(first) = out_ids.iter().position(|&t| t == tok.eos_id()) {
            for t in &mut out_ids[first + 1..] {
                *t = tok.pad_id();
            }
        }
    }
    Chunk { ids: out_ids, weights: out_w }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(text: &str) -> Vec<(String, f64)> {
        parse_prompt_attention(text)
    }

    fn v(items: &[(&str, f64)]) -> Vec<(String, f64)> {
        items.iter().map(|(s, w)| (s.to_string(), *w)).collect()
    }

    // The cases below are the examples in the web UI's own documentation of
    // parse_prompt_attention.
    #[test]
    fn documented_examples() {
        assert_eq!(p("normal text"), v(&[("normal text", 1.0)]));
        assert_eq!(p("an (important) word"), v(&[("an ", 1.0), ("important", 1.1), (" word", 1.0)]));
        assert_eq!(p("(unbalanced"), v(&[("unbalanced", 1.1)]));
        assert_eq!(p(r"\(literal\]"), v(&[("(literal]", 1.0)]));
        assert_eq!(p("(unnecessary)(parens)"), v(&[("unnecessaryparens", 1.1)]));
        assert_eq!(
            p("a (((house:1.3)) [on] a (hill:0.5), sun, (((sky)))."),
            v(&[
                ("a ", 1.0),
                ("house", 1.5730000000000004),
                (" ", 1.1),
                ("on", 1.0),
                (" a ", 1.1),
                ("hill", 0.55),
                (", sun, ", 1.1),
                ("sky", 1.4641000000000006),
                (".", 1.1),
            ])
        );
    }

    #[test]
    fn break_and_edge_cases() {
        assert_eq!(p("a BREAK b"), v(&[("a", 1.0), ("BREAK", -1.0), ("b", 1.0)]));
        // Not standalone / not uppercase: plain text.
        assert_eq!(p("aBREAK Break"), v(&[("aBREAK Break", 1.0)]));
        assert_eq!(p(""), v(&[("", 1.0)]));
        assert_eq!(p("()"), v(&[("", 1.0)]));
        assert_eq!(p("a) b]"), v(&[("a) b]", 1.0)]));
        assert_eq!(p("x:1.5) y"), v(&[("x:1.5) y", 1.0)]));
        assert_eq!(p(r"a\b \\ c"), v(&[(r"ab \ c", 1.0)]));
        assert_eq!(p("[a]"), v(&[("a", 1.0 / 1.1)]));
        assert_eq!(p("(a: -0.5 )"), v(&[("a", -0.5)]));
        assert_eq!(p("(a:1.2.3)"), v(&[("a:1.2.3)", 1.1)]));
        // A bracketed BREAK loses its marker weight.
        assert_eq!(p("(a BREAK b)"), v(&[("a", 1.1), ("BREAK", -1.1), ("b", 1.1)]));
    }
}
