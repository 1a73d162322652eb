//! Embeds `web/dist/**` (the built page, committed so that a Rust build needs no Node.js): generates a table of
//! `(path, bytes, etag)` that `include_bytes!`s every file, so the binaries serve the page offline.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let dist = manifest.join("../../web/dist");
    println!("cargo:rerun-if-changed={}", dist.display());
    let mut files = Vec::new();
    if dist.is_dir() {
        collect(&dist, &dist, &mut files);
    }
    if !files.iter().any(|(rel, _)| rel == "index.html") {
        panic!(
            "{} has no index.html: build the page with `npm ci && npm run build` in web/ (or `cargo xtask webui`)",
            dist.display()
        );
    }
    files.sort();
    let mut out = String::from("pub(crate) static ASSETS: &[Asset] = &[\n");
    for (rel, path) in &files {
        let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        // FNV-1a: a content tag for `ETag`, not a security hash.
        let tag = bytes
            .iter()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3));
        writeln!(
            out,
            "    Asset {{ path: {rel:?}, bytes: include_bytes!({path:?}), etag: \"\\\"{tag:016x}\\\"\" }},",
            path = path.display().to_string()
        )
        .expect("writing to a String");
    }
    out.push_str("];\n");
    let dest = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR")).join("assets.rs");
    std::fs::write(&dest, out).unwrap_or_else(|e| panic!("cannot write {}: {e}", dest.display()));
}

fn collect(root: &Path, dir: &Path, files: &mut Vec<(String, PathBuf)>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()));
    for entry in entries {
        let path = entry.unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display())).path();
        if path.is_dir() {
            collect(root, &path, files);
        } else {
            let rel = path.strip_prefix(root).expect("under the root").to_string_lossy().replace('\\', "/");
            files.push((rel, path));
        }
    }
}
