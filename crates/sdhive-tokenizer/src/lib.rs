//! Prompt text to CLIP token ids, the way the reference pipelines do it.
//!
//! * [`ClipTokenizer`]: CLIP's byte-level BPE, loaded from an HF tokenizer
//!   folder or from the OpenAI vocabulary bundled in this crate, producing
//!   ids identical to transformers' `CLIPTokenizer` (see [`clip`] for the
//!   exact pipeline and [`TextNormalization`] for the two text clean-up
//!   flavours).
//! * [`prompt`]: AUTOMATIC1111 emphasis syntax and 75-token chunking, for
//!   prompts longer than one encoder window or with `(weights:1.2)`.

pub mod clip;
mod error;
mod normalize;
pub mod prompt;
pub mod t5;

pub use clip::{ClipTokenizer, PadToken};
pub use error::TokenizerError;
pub use normalize::TextNormalization;
pub use prompt::{
    all_unweighted, empty_chunk, pad_chunk_counts, parse_prompt_attention, weighted_chunks,
    weighted_chunks_with, Chunk, ChunkOptions, EmbeddingWord,
};
pub use t5::{T5Tokenizer, T5_DEFAULT_MAX_LEN, T5_MAX_LEN};
