//! How resolution is configured: model-root confinement and the Hugging Face settings, read from the same
//! environment variables `huggingface_hub` uses so an existing cache and login are picked up unchanged.

use std::path::PathBuf;

#[derive(Debug, Clone)]
pub struct ResolveOptions {
    /// Local model paths must lie inside one of these (after canonicalisation). Empty: no confinement.
    /// Repo ids are not affected: validation already keeps them inside `hub_cache`.
    pub model_roots: Vec<PathBuf>,
    /// The hub cache (`models--org--name/{refs,snapshots,blobs}`), shared with Python tools.
    pub hub_cache: PathBuf,
    /// Never touch the network; an incomplete cached repo is an error.
    pub offline: bool,
    /// Access token for gated/private repos; `None` falls back to the token file next to the cache.
    pub token: Option<String>,
    /// Hub endpoint override (mirrors); `None` is huggingface.co.
    pub endpoint: Option<String>,
    /// Draw download progress bars on stderr.
    pub progress: bool,
}

impl ResolveOptions {
    /// Reads HF_HUB_CACHE / HF_HOME, HF_HUB_OFFLINE, HF_TOKEN and HF_ENDPOINT; no model roots, progress on.
    pub fn from_env() -> Self {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    pub(crate) fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Self {
        let non_empty = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        ResolveOptions {
            model_roots: Vec::new(),
            hub_cache: hub_cache_from(&non_empty),
            offline: non_empty("HF_HUB_OFFLINE").is_some_and(|v| truthy(&v)),
            token: non_empty("HF_TOKEN").map(|t| t.trim().to_string()),
            endpoint: non_empty("HF_ENDPOINT"),
            progress: true,
        }
    }
}

impl Default for ResolveOptions {
    fn default() -> Self {
        Self::from_env()
    }
}

/// HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub — huggingface_hub's own precedence.
pub fn default_hub_cache() -> PathBuf {
    hub_cache_from(&|k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty()))
}

fn hub_cache_from(get: &dyn Fn(&str) -> Option<String>) -> PathBuf {
    if let Some(dir) = get("HF_HUB_CACHE") {
        return PathBuf::from(dir);
    }
    if let Some(home) = get("HF_HOME") {
        return PathBuf::from(home).join("hub");
    }
    let home =
        get("HOME").or_else(|| get("USERPROFILE")).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("huggingface").join("hub")
}

/// huggingface_hub's boolean parsing of environment flags.
fn truthy(v: &str) -> bool {
    matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on" | "y" | "t")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn opts(vars: &[(&str, &str)]) -> ResolveOptions {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        ResolveOptions::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn cache_dir_precedence_matches_huggingface_hub() {
        let o = opts(&[("HF_HUB_CACHE", "/a"), ("HF_HOME", "/b"), ("HOME", "/h")]);
        assert_eq!(o.hub_cache, PathBuf::from("/a"));
        let o = opts(&[("HF_HOME", "/b"), ("HOME", "/h")]);
        assert_eq!(o.hub_cache, PathBuf::from("/b/hub"));
        let o = opts(&[("HOME", "/h"), ("HF_HUB_CACHE", "")]);
        assert_eq!(o.hub_cache, PathBuf::from("/h/.cache/huggingface/hub"));
    }

    #[test]
    fn offline_and_token_come_from_env() {
        assert!(opts(&[("HF_HUB_OFFLINE", "1")]).offline);
        assert!(opts(&[("HF_HUB_OFFLINE", "True")]).offline);
        assert!(!opts(&[("HF_HUB_OFFLINE", "0")]).offline);
        assert!(!opts(&[]).offline);
        assert_eq!(opts(&[("HF_TOKEN", " hf_x \n")]).token.as_deref(), Some("hf_x"));
        assert_eq!(opts(&[("HF_TOKEN", "")]).token, None);
    }
}
