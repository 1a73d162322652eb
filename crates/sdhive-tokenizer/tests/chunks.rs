//! A1111-style chunking on top of the real CLIP vocabulary. Expected layouts
//! are derived from the web UI's documented rules (75 tokens per chunk,
//! comma backtrack 20, BREAK, pad after the first eos), using ids that the
//! golden tests pin: "a" = 320, "b" = 321, "," = 267.

mod common;

use common::optional_fixture;
use sdhive_tokenizer::{
    all_unweighted, empty_chunk, pad_chunk_counts, weighted_chunks, weighted_chunks_with, ChunkOptions,
    ClipTokenizer, PadToken,
};

const A: u32 = 320;
const B: u32 = 321;
const COMMA: u32 = 267;
const BOS: u32 = 49406;
const EOS: u32 = 49407;

fn sd1() -> ClipTokenizer {
    ClipTokenizer::bundled(PadToken::EndOfText).unwrap()
}

fn row(body: &[u32], pad: u32) -> Vec<u32> {
    let mut v = vec![BOS];
    v.extend_from_slice(body);
    v.push(EOS);
    v.resize(77, pad);
    v
}

fn words(w: &str, n: usize) -> String {
    vec![w; n].join(" ")
}

#[test]
fn short_plain_prompt_equals_encode_padded() {
    let texts = [
        "",
        "a photo of an astronaut riding a horse on mars",
        "masterpiece, best quality, 1girl",
        "Hello!! a photo, 4k",
    ];
    for tok in [sd1(), ClipTokenizer::bundled(PadToken::Exclamation).unwrap()] {
        for text in texts {
            let chunks = weighted_chunks(&tok, text);
            assert_eq!(chunks.len(), 1, "{text:?}");
            assert_eq!(chunks[0].ids, tok.encode_padded(text), "{text:?}");
            assert!(chunks[0].is_unweighted());
            assert_eq!(chunks[0].weights.len(), 77);
        }
    }
    for dir in ["models/sd1/tokenizer", "models/sd2v/tokenizer"] {
        let Some(dir) = optional_fixture(dir) else {
            continue;
        };
        let tok = ClipTokenizer::from_dir(&dir).unwrap();
        for text in texts {
            assert_eq!(weighted_chunks(&tok, text)[0].ids, tok.encode_padded(text));
        }
    }
}

#[test]
fn overflow_without_comma_splits_at_75() {
    let tok = sd1();
    let chunks = weighted_chunks(&tok, &words("a", 80));
    assert_eq!(chunks.len(), 2);
    assert_eq!(chunks[0].ids, row(&[A; 75], EOS));
    assert_eq!(chunks[1].ids, row(&[A; 5], EOS));
}

#[test]
fn overflow_backtracks_to_a_recent_comma() {
    let tok = sd1();
    // 70 a, comma at index 70, then 10 b: the chunk fills after 4 b, the
    // comma is 5 back (<= 20), so the 4 b move to the next chunk.
    let text = format!("{}, {}", words("a", 70), words("b", 10));
    let chunks = weighted_chunks(&tok, &text);
    let mut first = vec![A; 70];
    first.push(COMMA);
    assert_eq!(chunks.len(), 2);
    assert_eq!(chunks[0].ids, row(&first, EOS));
    assert_eq!(chunks[1].ids, row(&[B; 10], EOS));

    // Disabled backtrack: a plain split at 75.
    let opts = ChunkOptions { comma_backtrack: 0, ..ChunkOptions::default() };
    let chunks = weighted_chunks_with(&tok, &text, &opts);
    let mut first = vec![A; 70];
    first.push(COMMA);
    first.extend([B; 4]);
    assert_eq!(chunks[0].ids, row(&first, EOS));
    assert_eq!(chunks[1].ids, row(&[B; 6], EOS));
}

#[test]
fn comma_too_far_back_is_ignored() {
    let tok = sd1();
    // Comma at index 10: 75 - 10 = 65 > 20.
    let text = format!("{}, {}", words("a", 10), words("b", 70));
    let chunks = weighted_chunks(&tok, &text);
    let mut first = vec![A; 10];
    first.push(COMMA);
    first.extend([B; 64]);
    assert_eq!(chunks[0].ids, row(&first, EOS));
    assert_eq!(chunks[1].ids, row(&[B; 6], EOS));
}

#[test]
fn relocated_tokens_keep_their_weights() {
    let tok = sd1();
    let text = format!("{}, ({}:1.5)", words("a", 70), words("b", 10));
    let chunks = weighted_chunks(&tok, &text);
    assert_eq!(chunks.len(), 2);
    assert!(chunks[0].is_unweighted());
    assert_eq!(&chunks[1].weights[1..11], &[1.5f32; 10]);
    assert_eq!(chunks[1].weights[0], 1.0);
    assert_eq!(chunks[1].weights[11], 1.0);
    assert!(!all_unweighted(&chunks));
}

#[test]
fn break_starts_a_new_chunk() {
    let tok = sd1();
    let chunks = weighted_chunks(&tok, "a BREAK b");
    assert_eq!(chunks.len(), 2);
    assert_eq!(chunks[0].ids, row(&[A], EOS));
    assert_eq!(chunks[1].ids, row(&[B], EOS));
    // A leading BREAK yields an empty first chunk, as in the web UI.
    let chunks = weighted_chunks(&tok, "BREAK a");
    assert_eq!(chunks.len(), 2);
    assert_eq!(chunks[0], empty_chunk(&tok));
    // Lowercase "break" is a word.
    assert_eq!(weighted_chunks(&tok, "a break b").len(), 1);
}

#[test]
fn weights_follow_tokens() {
    let tok = sd1();
    let chunks = weighted_chunks(&tok, "a (b:1.3) [a]");
    assert_eq!(chunks.len(), 1);
    assert_eq!(chunks[0].ids, row(&[A, B, A], EOS));
    let w = &chunks[0].weights;
    assert_eq!(w[0], 1.0);
    assert_eq!(w[1], 1.0);
    assert_eq!(w[2], 1.3f64 as f32);
    assert_eq!(w[3], (1.0f64 / 1.1) as f32);
    assert!(w[4..].iter().all(|&x| x == 1.0));
}

#[test]
fn exclamation_pad_follows_first_eos() {
    let tok = ClipTokenizer::bundled(PadToken::Exclamation).unwrap();
    let chunks = weighted_chunks(&tok, &words("a", 80));
    assert_eq!(chunks[1].ids, row(&[A; 5], 0));
    assert_eq!(chunks[0].ids, row(&[A; 75], 0));
}

#[test]
fn chunk_counts_are_padded_with_empty_chunks() {
    let tok = sd1();
    let mut pos = weighted_chunks(&tok, &words("a", 160));
    let mut neg = weighted_chunks(&tok, "blurry");
    assert_eq!((pos.len(), neg.len()), (3, 1));
    pad_chunk_counts(&tok, &mut pos, &mut neg);
    assert_eq!((pos.len(), neg.len()), (3, 3));
    assert_eq!(neg[1].ids, tok.encode_padded(""));
    assert_eq!(neg[2], empty_chunk(&tok));
}

fn emb(name: &str, n: u32) -> sdhive_tokenizer::EmbeddingWord {
    sdhive_tokenizer::EmbeddingWord { name: name.into(), ids: (49408..49408 + n).collect() }
}

/// A textual-inversion word becomes its ids wherever it stands as a whole word, whatever its case, inside
/// emphasis too (with that weight); inside another word it stays text.
#[test]
fn embedding_words_become_their_ids() {
    let tok = sd1();
    let opts = ChunkOptions { embeddings: vec![emb("easyneg", 2)], ..ChunkOptions::default() };
    let chunks = weighted_chunks_with(&tok, "a, EasyNeg b", &opts);
    assert_eq!(chunks[0].ids, row(&[A, COMMA, 49408, 49409, B], EOS));
    let chunks = weighted_chunks_with(&tok, "a (easyneg:1.5)", &opts);
    assert_eq!(&chunks[0].ids[1..4], &[A, 49408, 49409]);
    assert_eq!(&chunks[0].weights[1..4], &[1.0, 1.5, 1.5]);
    let plain = weighted_chunks(&tok, "a xeasyneg_b");
    assert_eq!(weighted_chunks_with(&tok, "a xeasyneg_b", &opts), plain, "not a whole word");
}

/// An embedding that does not fit in what is left of a chunk starts the next one (as the web UI moves it).
#[test]
fn an_embedding_is_never_split_across_chunks() {
    let tok = sd1();
    let opts =
        ChunkOptions { embeddings: vec![emb("big", 4)], comma_backtrack: 0, ..ChunkOptions::default() };
    let text = format!("{} big", words("a", 73));
    let chunks = weighted_chunks_with(&tok, &text, &opts);
    assert_eq!(chunks.len(), 2);
    assert_eq!(chunks[0].ids, row(&vec![A; 73], EOS));
    assert_eq!(chunks[1].ids, row(&[49408, 49409, 49410, 49411], EOS));
}
