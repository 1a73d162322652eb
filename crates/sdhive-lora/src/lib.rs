//! Extra networks as A1111 knows them: LoRA and LyCORIS files (kohya, diffusers/PEFT, LoCon, LoHa, LoKr) read
//! into per-weight deltas named as the diffusers networks name their weights, and textual-inversion embeddings.
//!
//! Use: [`LoraFile::read`] a file, [`LoraFile::resolve`] it against the loaded model's [`ModelParams`] (which
//! refuses a LoRA made for another model family), then for each [`Patch`] add `multiplier · `[`LoraFile::delta`]
//! to the named weight. The formulas are A1111's (extensions-builtin/Lora), so results match its images. SD3/SD3.5
//! LoRAs resolve against the MMDiT in diffusers' names and in SAI's (kohya sd-scripts), fused layers included.

mod delta;
mod embedding;
mod error;
mod file;
mod header;
mod names;
#[cfg(test)]
mod testutil;

pub use delta::ModuleKind;
pub use embedding::{read_embedding_header, Embedding, EmbeddingInfo};
pub use error::LoraError;
pub use file::{LoraFile, LoraModule, ModuleName};
pub use header::read_metadata;
pub use names::{sd3_sai_module, Denoiser, ModelParams, Network, Patch, Rows, Slot};
