//! Content hashes and their persistent cache. A checkpoint's sha256 is its identity for A1111 clients (titles,
//! infotext `Model hash`), but hashing a library means reading every byte of it, so hashes are computed only on
//! request and remembered in a JSON file keyed by canonical path and valid only while the file's size and
//! modification time are unchanged. Several workers on one node may share the file: writes re-read it, merge
//! one entry and replace it atomically, and a corrupt file is only ever a cache miss.

use crate::CatalogError;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, UNIX_EPOCH};

/// What identifies a file's content cheaply: an entry is trusted only while both still match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stamp {
    pub size: u64,
    /// Nanoseconds since the Unix epoch; `None` where the platform gives no mtime (then nothing is cached).
    pub mtime_ns: Option<i64>,
}

impl Stamp {
    pub(crate) fn of(meta: &fs::Metadata) -> Stamp {
        let mtime_ns = meta.modified().ok().and_then(|t| match t.duration_since(UNIX_EPOCH) {
            Ok(d) => i64::try_from(d.as_nanos()).ok(),
            Err(before) => i64::try_from(before.duration().as_nanos()).ok().map(|n| -n),
        });
        Stamp { size: meta.len(), mtime_ns }
    }

    pub(crate) fn of_path(path: &Path) -> Result<Stamp, CatalogError> {
        fs::metadata(path).map(|m| Stamp::of(&m)).map_err(|e| CatalogError::io(path, e))
    }
}

/// One cached hash. `mtime` is in nanoseconds since the Unix epoch: float seconds would lose the precision that
/// tells two quick writes apart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct CacheEntry {
    size: u64,
    mtime: i64,
    sha256: String,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct HashCache {
    file: Option<PathBuf>,
    entries: BTreeMap<String, CacheEntry>,
}

impl HashCache {
    /// Loads `file`; a missing file is an empty cache and an unreadable or corrupt one is ignored with a warning,
    /// since a cache must never stop a server from starting.
    pub(crate) fn load(file: Option<&Path>) -> HashCache {
        let entries = match file {
            None => BTreeMap::new(),
            Some(f) => read_entries(f).unwrap_or_else(|reason| {
                tracing::warn!("ignoring hash cache {}: {reason}", f.display());
                BTreeMap::new()
            }),
        };
        HashCache { file: file.map(Path::to_path_buf), entries }
    }

    /// The cached sha256 of `path`, if its entry still matches `stamp`.
    pub(crate) fn lookup(&self, path: &Path, stamp: Stamp) -> Option<String> {
        self.lookup_kind(path, stamp, HashKind::File)
    }

    pub(crate) fn lookup_kind(&self, path: &Path, stamp: Stamp, kind: HashKind) -> Option<String> {
        valid(self.entries.get(&cache_key(path, kind)?)?, stamp)
    }

    /// The sha256 of `path`: from the cache when still valid (re-reading the cache file, which another worker may
    /// have filled since this catalog was scanned), else computed and recorded. Returns the stamp it belongs to.
    pub(crate) fn hash(&mut self, path: &Path) -> Result<(String, Stamp), CatalogError> {
        self.hash_kind(path, HashKind::File)
    }

    /// `hash` for either kind of hash; each kind has its own cache entries.
    pub(crate) fn hash_kind(&mut self, path: &Path, kind: HashKind) -> Result<(String, Stamp), CatalogError> {
        let before = Stamp::of_path(path)?;
        if let Some(sha) = self.lookup_kind(path, before, kind) {
            return Ok((sha, before));
        }
        if let (Some(file), Some(key)) = (&self.file, cache_key(path, kind)) {
            if let Some(entry) = read_entries(file).ok().and_then(|mut disk| disk.remove(&key)) {
                if let Some(sha) = valid(&entry, before) {
                    self.entries.insert(key, entry);
                    return Ok((sha, before));
                }
            }
        }
        let started = Instant::now();
        tracing::info!("hashing {} ({:.2} GB)", path.display(), before.size as f64 / 1e9);
        let sha = match kind {
            HashKind::File => sha256_file(path),
            HashKind::AfterHeader => sha256_after_header(path),
        }
        .map_err(|e| CatalogError::io(path, e))?;
        if Stamp::of_path(path)? != before {
            return Err(CatalogError::ChangedWhileHashing { path: path.to_path_buf() });
        }
        tracing::info!("sha256 of {} is {sha} ({:.1?})", path.display(), started.elapsed());
        self.record(path, before, &sha, kind);
        Ok((sha, before))
    }

    /// Remembers a hash in memory and in the cache file. A failed write only costs a re-hash later, so it is a
    /// warning, not an error that would withhold a hash already computed.
    fn record(&mut self, path: &Path, stamp: Stamp, sha: &str, kind: HashKind) {
        let (Some(key), Some(mtime)) = (cache_key(path, kind), stamp.mtime_ns) else { return };
        let entry = CacheEntry { size: stamp.size, mtime, sha256: sha.to_string() };
        self.entries.insert(key.clone(), entry.clone());
        let Some(file) = &self.file else { return };
        // Merge into what is on disk now, not our snapshot from scan time, so entries other workers wrote since
        // are kept.
        let mut disk = read_entries(file).unwrap_or_default();
        disk.insert(key, entry);
        let written = serde_json::to_vec_pretty(&disk)
            .map_err(io::Error::other)
            .and_then(|bytes| write_atomic(file, &bytes));
        if let Err(e) = written {
            tracing::warn!(
                "cannot write hash cache {}: {e}; {} will be hashed again next time",
                file.display(),
                path.display()
            );
        }
    }
}

/// Which digest of a file: the whole file (checkpoints, VAEs, embeddings), or A1111's "addnet hash" of a
/// safetensors file (LoRAs), which skips the header so that editing the metadata keeps the identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HashKind {
    File,
    AfterHeader,
}

/// Non-UTF-8 paths are not cached: a lossy key could let two files share an entry. The whole-file hash is keyed
/// by the bare path (the format every earlier version wrote); the addnet hash by a prefix no absolute path has.
fn cache_key(path: &Path, kind: HashKind) -> Option<String> {
    let path = path.to_str()?;
    Some(match kind {
        HashKind::File => path.to_string(),
        HashKind::AfterHeader => format!("addnet:{path}"),
    })
}

fn valid(entry: &CacheEntry, stamp: Stamp) -> Option<String> {
    let matches = Some(entry.mtime) == stamp.mtime_ns && entry.size == stamp.size;
    (matches && is_sha256_hex(&entry.sha256)).then(|| entry.sha256.clone())
}

fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The cache file's entries; a missing file is empty. Malformed entries are dropped one by one so that one bad
/// entry does not discard the rest.
fn read_entries(file: &Path) -> Result<BTreeMap<String, CacheEntry>, String> {
    let bytes = match fs::read(file) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(e.to_string()),
    };
    let value: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| format!("not JSON: {e}"))?;
    let serde_json::Value::Object(map) = value else {
        return Err("not a JSON object".into());
    };
    Ok(map.into_iter().filter_map(|(k, v)| Some((k, serde_json::from_value(v).ok()?))).collect())
}

/// Replaces `file` by a complete new version (temp file in the same folder, then rename), so a reader never
/// sees half a file, creating the folder if needed.
fn write_atomic(file: &Path, bytes: &[u8]) -> io::Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = file
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the path names no file"))?;
    let dir = file.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.{}-{}.tmp",
        name.to_string_lossy(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, file)
    })();
    if result.is_err() {
        // Best effort: the temp file is ours and useless now; failing to remove it changes nothing for the caller.
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Streams the file through sha256 in 1 MiB reads (checkpoints are several GB).
pub(crate) fn sha256_file(path: &Path) -> io::Result<String> {
    sha256_from(File::open(path)?)
}

/// A1111's `addnet_hash_safetensors`: the sha256 of everything after the 8-byte header length and the header.
pub(crate) fn sha256_after_header(path: &Path) -> io::Result<String> {
    use std::io::{Seek, SeekFrom};
    let mut file = File::open(path)?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len)?;
    let header_len = u64::from_le_bytes(len);
    let file_len = file.metadata()?.len();
    if header_len > file_len - 8 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("header length {header_len} does not fit a {file_len}-byte file"),
        ));
    }
    file.seek(SeekFrom::Start(8 + header_len))?;
    sha256_from(file)
}

fn sha256_from(mut file: File) -> io::Result<String> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => hasher.update(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(hasher.finalize().iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_of_known_input() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("abc");
        fs::write(&p, b"abc").unwrap();
        assert_eq!(
            sha256_file(&p).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn malformed_entries_are_dropped_individually() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.json");
        let good = "ab".repeat(32);
        fs::write(
            &p,
            format!(r#"{{"/a": {{"size": 1, "mtime": 2, "sha256": "{good}"}}, "/b": {{"size": "x"}}}}"#),
        )
        .unwrap();
        let entries = read_entries(&p).unwrap();
        assert_eq!(entries.len(), 1);
        assert!(entries.contains_key("/a"));
        fs::write(&p, "[1, 2]").unwrap();
        assert!(read_entries(&p).is_err());
    }

    #[test]
    fn entries_need_a_real_hash_and_a_matching_stamp() {
        let e = CacheEntry { size: 1, mtime: 2, sha256: "ab".repeat(32) };
        assert!(valid(&e, Stamp { size: 1, mtime_ns: Some(2) }).is_some());
        assert!(valid(&e, Stamp { size: 1, mtime_ns: Some(3) }).is_none());
        assert!(valid(&e, Stamp { size: 2, mtime_ns: Some(2) }).is_none());
        assert!(valid(&e, Stamp { size: 1, mtime_ns: None }).is_none());
        let upper = CacheEntry { sha256: "AB".repeat(32), ..e };
        assert!(valid(&upper, Stamp { size: 1, mtime_ns: Some(2) }).is_none());
    }
}
