//! Paths shared by the tokenizer integration tests (fixtures live at the
//! workspace root and may be absent in a partial checkout).

#![allow(dead_code)]

use std::path::PathBuf;

pub fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/")).join(rel)
}

/// The fixture path, or `None` (with a note on stderr) when it is missing.
pub fn optional_fixture(rel: &str) -> Option<PathBuf> {
    let p = fixture(rel);
    if p.exists() {
        Some(p)
    } else {
        eprintln!("skipping: {} not present", p.display());
        None
    }
}
