//! Hugging Face repo ids and revisions as users type them (`org/name@revision`), validated strictly because both
//! become path components inside the hub cache: nothing that passes here can name a folder outside it.

use crate::SourceError;

/// A validated `org/name` plus the revision (branch, tag or commit; `main` when omitted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoRef {
    pub id: String,
    pub revision: String,
}

/// Hub limit on each of the two id parts.
const MAX_PART: usize = 96;
const MAX_REVISION: usize = 255;

/// Whether `arg` has the shape of a repo id, so that its validation errors (not "path not found") are reported.
pub(crate) fn looks_like_repo_id(arg: &str) -> bool {
    let id = arg.split_once('@').map_or(arg, |(id, _)| id);
    id.matches('/').count() == 1 && !id.starts_with('/') && !id.contains('\\')
}

impl RepoRef {
    pub fn parse(arg: &str) -> Result<RepoRef, SourceError> {
        let bad =
            |reason: &str| SourceError::InvalidRepoId { id: arg.to_string(), reason: reason.to_string() };
        let (id, revision) = match arg.split_once('@') {
            Some((id, rev)) => (id, rev),
            None => (arg, "main"),
        };
        let parts: Vec<&str> = id.split('/').collect();
        if parts.len() != 2 {
            return Err(bad("expected exactly one `/` between organisation and name"));
        }
        for part in parts {
            validate_part(part).map_err(|r| bad(&r))?;
        }
        validate_revision(revision).map_err(|r| bad(&r))?;
        Ok(RepoRef { id: id.to_string(), revision: revision.to_string() })
    }

    /// The repo's folder in the hub cache, as huggingface_hub names it.
    pub fn cache_folder(&self) -> String {
        format!("models--{}", self.id.replace('/', "--"))
    }
}

fn validate_part(part: &str) -> Result<(), String> {
    if part.is_empty() || part.len() > MAX_PART {
        return Err(format!("each part must be 1 to {MAX_PART} characters"));
    }
    if let Some(c) = part.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))) {
        return Err(format!("character {c:?} is not allowed (letters, digits, `-`, `_`, `.` only)"));
    }
    // `--` is the cache's separator and `..` a parent directory: the hub forbids both for the same reasons.
    if part.contains("..") || part.contains("--") {
        return Err("`..` and `--` are not allowed".into());
    }
    if part.starts_with(['-', '.']) || part.ends_with(['-', '.']) {
        return Err("a part cannot start or end with `-` or `.`".into());
    }
    Ok(())
}

fn validate_revision(rev: &str) -> Result<(), String> {
    if rev.is_empty() || rev.len() > MAX_REVISION {
        return Err(format!("the revision must be 1 to {MAX_REVISION} characters"));
    }
    if let Some(c) = rev.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/')))
    {
        return Err(format!("character {c:?} is not allowed in a revision"));
    }
    // Revisions like `refs/pr/1` become nested folders under refs/, so every segment must be a plain name.
    if rev.contains("..") || rev.split('/').any(|s| s.is_empty() || s == ".") {
        return Err("the revision cannot contain `..`, `.` segments, or empty segments".into());
    }
    Ok(())
}

/// A commit hash as stored in `refs/<revision>`; anything else there is refused rather than joined to a path.
pub(crate) fn is_commit_hash(s: &str) -> bool {
    (7..=64).contains(&s.len()) && s.chars().all(|c| c.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(s: &str) -> RepoRef {
        RepoRef::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn parses_ids_and_revisions() {
        assert_eq!(ok("org/name"), RepoRef { id: "org/name".into(), revision: "main".into() });
        assert_eq!(ok("stabilityai/sd-turbo@fp16").revision, "fp16");
        assert_eq!(ok("a/b@refs/pr/12").revision, "refs/pr/12");
        assert_eq!(ok("Org_1/model.v1-5").cache_folder(), "models--Org_1--model.v1-5");
    }

    #[test]
    fn refuses_anything_that_could_escape_the_cache() {
        for bad in [
            "org/..",
            "../name",
            "org/na..me",
            "org/name/extra",
            "/abs/path",
            "org/",
            "/name",
            "org/a--b",
            "org/.hidden",
            "org/name@../../etc",
            "org/name@refs/../x",
            "org/name@",
            "org/name@/abs",
            "org/name@a//b",
            "org/na me",
            "org\\name",
            "org/name@a@b",
        ] {
            assert!(
                matches!(RepoRef::parse(bad), Err(SourceError::InvalidRepoId { .. })),
                "{bad} should be refused"
            );
        }
    }

    #[test]
    fn shape_detection() {
        assert!(looks_like_repo_id("org/name"));
        assert!(looks_like_repo_id("org/..@x"));
        assert!(!looks_like_repo_id("/abs/x"));
        assert!(!looks_like_repo_id("a/b/c"));
        assert!(!looks_like_repo_id("plain"));
    }

    #[test]
    fn commit_hash_shape() {
        assert!(is_commit_hash("0123456789abcdef0123456789abcdef01234567"));
        assert!(!is_commit_hash("../../etc"));
        assert!(!is_commit_hash("main"));
    }
}
