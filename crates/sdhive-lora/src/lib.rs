//! Extra networks as A1111 knows them: LoRA and LyCORIS files (kohya, diffusers/PEFT, LoCon, LoHa, LoKr) read
//! into per-weight deltas named as the diffusers networks name their weights, and textual-inversion embeddings.
