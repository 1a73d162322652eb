//! Repo ids: finding a complete snapshot in the standard Hugging Face cache layout
//! (`models--org--name/refs/<revision>` → `snapshots/<commit>/…`), and otherwise downloading just the files
//! generation needs into that same cache with `hf-hub`, so Python tools and this crate share one copy.

use crate::diffusers::{self, ModelIndex};
use crate::repo_id::{is_commit_hash, RepoRef};
use crate::{ModelLocation, ResolveOptions, ResolvedModel, SourceError};
use std::path::{Path, PathBuf};

pub(crate) fn resolve_repo(repo: &RepoRef, opts: &ResolveOptions) -> Result<ResolvedModel, SourceError> {
    let repo_dir = opts.hub_cache.join(repo.cache_folder());
    let missing = match cached_snapshot(&repo_dir, &repo.revision) {
        Some(snapshot) => match diffusers::check_complete(&snapshot) {
            Ok(_) => return resolved(repo, &snapshot),
            Err(SourceError::IncompleteDiffusers { missing, .. }) => {
                format!("missing {}", missing.join(", "))
            }
            Err(e) => format!("{e}"),
        },
        None => format!("no snapshot for revision `{}` under {}", repo.revision, repo_dir.display()),
    };
    if opts.offline {
        return Err(SourceError::NotCachedOffline {
            repo: repo.id.clone(),
            revision: repo.revision.clone(),
            cache: opts.hub_cache.clone(),
            missing,
        });
    }
    tracing::info!(repo = %repo.id, revision = %repo.revision, %missing, "downloading from the Hugging Face hub");
    let snapshot = download_snapshot(repo, opts)?;
    diffusers::check_complete(&snapshot)?;
    resolved(repo, &snapshot)
}

/// The snapshot folder `revision` points at, if the cache has one. A ref whose content is not a commit hash is
/// ignored rather than joined to a path.
pub(crate) fn cached_snapshot(repo_dir: &Path, revision: &str) -> Option<PathBuf> {
    let snapshots = repo_dir.join("snapshots");
    let commit = match std::fs::read_to_string(repo_dir.join("refs").join(revision)) {
        Ok(content) => content.trim().to_string(),
        // huggingface_hub writes no ref for a revision that is itself a commit hash.
        Err(_) if is_commit_hash(revision) => revision.to_string(),
        Err(_) => return None,
    };
    if !is_commit_hash(&commit) {
        tracing::warn!(path = %repo_dir.join("refs").join(revision).display(), "ignoring a ref that is not a commit hash");
        return None;
    }
    let dir = snapshots.join(commit);
    dir.is_dir().then_some(dir)
}

fn resolved(repo: &RepoRef, snapshot: &Path) -> Result<ResolvedModel, SourceError> {
    let canonical = std::fs::canonicalize(snapshot).map_err(|e| SourceError::io(snapshot, e))?;
    let name =
        if repo.revision == "main" { repo.id.clone() } else { format!("{}@{}", repo.id, repo.revision) };
    Ok(ResolvedModel { name, location: ModelLocation::DiffusersDir(canonical), vae: None })
}

/// Downloads whatever the snapshot of `repo` lacks and returns the snapshot folder. Kept small on purpose: it
/// is the one part of resolution that needs the network, so the test suite cannot exercise it; everything it
/// decides (file choice, completeness) lives in `diffusers` and is tested there.
fn download_snapshot(repo: &RepoRef, opts: &ResolveOptions) -> Result<PathBuf, SourceError> {
    use hf_hub::api::sync::ApiBuilder;
    use hf_hub::{Cache, Repo, RepoType};

    let fail = |file: &str, reason: String| SourceError::Download {
        repo: repo.id.clone(),
        revision: repo.revision.clone(),
        file: file.to_string(),
        cache: opts.hub_cache.clone(),
        reason,
    };
    let mut builder = ApiBuilder::from_cache(Cache::new(opts.hub_cache.clone())).with_progress(opts.progress);
    // Only override when given: otherwise hf-hub reads the token file that `hf auth login` wrote.
    if opts.token.is_some() {
        builder = builder.with_token(opts.token.clone());
    }
    if let Some(endpoint) = &opts.endpoint {
        builder = builder.with_endpoint(endpoint.clone());
    }
    let api = builder.build().map_err(|e| fail("(client setup)", e.to_string()))?;
    let hub_repo = Repo::with_revision(repo.id.clone(), RepoType::Model, repo.revision.clone());
    let remote = api.repo(hub_repo.clone());
    let info = remote.info().map_err(|e| fail("(repo file list)", e.to_string()))?;
    if !is_commit_hash(&info.sha) {
        return Err(fail("(repo file list)", format!("the hub returned an invalid commit {:?}", info.sha)));
    }
    let snapshot = opts.hub_cache.join(repo.cache_folder()).join("snapshots").join(&info.sha);
    let fetch = |file: &str| -> Result<PathBuf, SourceError> {
        let local = snapshot.join(file);
        if local.is_file() {
            return Ok(local);
        }
        remote.download(file).map_err(|e| fail(file, e.to_string()))
    };

    let index = ModelIndex::read_file(&fetch("model_index.json")?)?;
    let siblings: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
    let plan =
        diffusers::plan_downloads(&index, &siblings).map_err(|problems| SourceError::UnsupportedRepo {
            repo: repo.id.clone(),
            revision: repo.revision.clone(),
            reason: problems.join("; "),
        })?;
    for file in plan {
        let path = fetch(&file)?;
        if diffusers::is_shard_index(&file) {
            let component = file.rsplit_once('/').map_or("", |(dir, _)| dir);
            for shard in diffusers::shard_names(&path)? {
                fetch(&format!("{component}/{shard}"))?;
            }
        }
    }
    // A snapshot that was already complete on disk got no download, hence no ref; later offline runs need one.
    Cache::new(opts.hub_cache.clone())
        .repo(hub_repo)
        .create_ref(&info.sha)
        .map_err(|e| SourceError::io(opts.hub_cache.join(repo.cache_folder()).join("refs"), e))?;
    Ok(snapshot)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HASH: &str = "0123456789abcdef0123456789abcdef01234567";

    #[test]
    fn snapshot_lookup_follows_refs_and_ignores_bad_ones() {
        let dir = tempfile::tempdir().unwrap();
        let repo_dir = dir.path().join("models--org--m");
        std::fs::create_dir_all(repo_dir.join("refs")).unwrap();
        std::fs::create_dir_all(repo_dir.join("snapshots").join(HASH)).unwrap();
        assert_eq!(cached_snapshot(&repo_dir, "main"), None);
        std::fs::write(repo_dir.join("refs/main"), format!("{HASH}\n")).unwrap();
        assert_eq!(cached_snapshot(&repo_dir, "main"), Some(repo_dir.join("snapshots").join(HASH)));
        assert_eq!(cached_snapshot(&repo_dir, HASH), Some(repo_dir.join("snapshots").join(HASH)));
        std::fs::write(repo_dir.join("refs/evil"), "../../../etc").unwrap();
        assert_eq!(cached_snapshot(&repo_dir, "evil"), None);
    }
}
