//! Resolving a client's checkpoint string the way AUTOMATIC1111 does (`sd_models.get_closet_checkpoint_match`
//! over its `checkpoint_aliases`), so every name, title or hash that selects a model in A1111 selects the same
//! one here; then, where A1111 would give up, a case-insensitive pass; and the suggestions for a miss.

use crate::entry::Checkpoint;

/// Index of the checkpoint `query` names, in this order:
/// 1. an exact alias (A1111's ids plus the canonical path);
/// 2. the shortest title containing `query`;
/// 3. both again with a trailing ` [checksum]` stripped, so a title with a stale hash still finds its file;
/// 4. steps 1–3 ignoring case (A1111 has no such step, so it only decides what A1111 would reject).
pub(crate) fn find_index(checkpoints: &[Checkpoint], query: &str) -> Option<usize> {
    if query.trim().is_empty() {
        return None;
    }
    let stripped = strip_checksum(query).filter(|s| !s.trim().is_empty() && *s != query);
    let queries: Vec<&str> = std::iter::once(query).chain(stripped).collect();
    for fold in [false, true] {
        for q in &queries {
            let found = alias(checkpoints, q, fold).or_else(|| substring(checkpoints, q, fold));
            if found.is_some() {
                return found;
            }
        }
    }
    None
}

/// A1111's `re_strip_checksum` (`\s*\[[^]]+]\s*$`) applied once: `query` without its trailing bracketed part,
/// or `None` when it has none.
pub(crate) fn strip_checksum(query: &str) -> Option<&str> {
    let body = query.trim_end().strip_suffix(']')?;
    // The bracketed part may not contain `]`, so it starts after the last one; the leftmost `[` there gives the
    // leftmost (regex) match.
    let from = body.rfind(']').map_or(0, |i| i + 1);
    let open = from + body[from..].find('[')?;
    if open + 1 == body.len() {
        return None;
    }
    Some(body[..open].trim_end())
}

/// A checkpoint's alias strings, strongest first. A1111 keeps one dict where a later file's alias silently
/// replaces an earlier one's; tiers make the choice deterministic instead: a full name or hash beats a
/// `model_name`, which beats a bare file stem shared by files in different folders.
fn alias_tiers(c: &Checkpoint) -> [Vec<String>; 3] {
    let mut strong = vec![c.name.clone(), c.title(), c.path.to_string_lossy().into_owned()];
    let mut middle = vec![c.model_name.clone()];
    if let (Some(sha), Some(short)) = (&c.sha256, c.shorthash()) {
        strong.push(sha.clone());
        middle.push(short.to_string());
        middle.push(format!("{} [{short}]", c.model_name));
    }
    [strong, middle, vec![c.name_for_extra().to_string()]]
}

fn alias(checkpoints: &[Checkpoint], query: &str, fold: bool) -> Option<usize> {
    let query_folded = query.to_lowercase();
    let matches = |a: &String| if fold { a.to_lowercase() == query_folded } else { a == query };
    let tiers: Vec<[Vec<String>; 3]> = checkpoints.iter().map(alias_tiers).collect();
    (0..3).find_map(|tier| tiers.iter().position(|t| t[tier].iter().any(matches)))
}

/// The shortest title containing `query` (the first of equals, as Python's stable sort).
fn substring(checkpoints: &[Checkpoint], query: &str, fold: bool) -> Option<usize> {
    let query_folded = query.to_lowercase();
    checkpoints
        .iter()
        .enumerate()
        .filter_map(|(i, c)| {
            let title = c.title();
            let hit = if fold { title.to_lowercase().contains(&query_folded) } else { title.contains(query) };
            hit.then(|| (i, title.chars().count()))
        })
        .min_by_key(|&(_, len)| len)
        .map(|(i, _)| i)
}

/// The `n` distinct titles most similar to `query`, best first: normalised edit distance between the lower-cased
/// query (checksum stripped) and each checkpoint's `model_name`, `name_for_extra` and `name`, best of the three.
pub(crate) fn closest_titles(checkpoints: &[Checkpoint], query: &str, n: usize) -> Vec<String> {
    let query = strip_checksum(query).unwrap_or(query).trim().to_lowercase();
    let query: Vec<char> = query.chars().collect();
    let mut scored: Vec<(f64, usize)> = checkpoints
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let keys = [c.model_name.as_str(), c.name_for_extra(), c.name.as_str()];
            let best = keys.iter().map(|k| similarity(&query, &k.to_lowercase())).fold(0.0, f64::max);
            (best, i)
        })
        .collect();
    // Stable sort: equally similar entries keep catalogue order.
    scored.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut titles: Vec<String> = Vec::with_capacity(n);
    for (_, i) in scored {
        if titles.len() == n {
            break;
        }
        let title = checkpoints[i].title();
        if !titles.contains(&title) {
            titles.push(title);
        }
    }
    titles
}

/// 1 − Levenshtein distance / longer length, over chars.
pub(crate) fn similarity(a: &[char], b: &str) -> f64 {
    let b: Vec<char> = b.chars().collect();
    let longest = a.len().max(b.len());
    if longest == 0 {
        return 1.0;
    }
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for (i, ca) in a.iter().enumerate() {
        cur[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substitute = prev[j] + usize::from(ca != cb);
            cur[j + 1] = substitute.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    1.0 - prev[b.len()] as f64 / longest as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_like_a1111_regex() {
        assert_eq!(strip_checksum("a.safetensors [0123456789]"), Some("a.safetensors"));
        assert_eq!(strip_checksum("a.safetensors [0123456789]  "), Some("a.safetensors"));
        assert_eq!(strip_checksum("a.safetensors[abc]"), Some("a.safetensors"));
        assert_eq!(strip_checksum("x [a] [b]"), Some("x [a]"));
        assert_eq!(strip_checksum("x [a [b]"), Some("x"));
        assert_eq!(strip_checksum("x []"), None);
        assert_eq!(strip_checksum("x"), None);
        assert_eq!(strip_checksum("x]"), None);
    }

    #[test]
    fn edit_distance() {
        let a: Vec<char> = "kitten".chars().collect();
        assert!((similarity(&a, "sitting") - (1.0 - 3.0 / 7.0)).abs() < 1e-9);
        assert_eq!(similarity(&a, "kitten"), 1.0);
        assert_eq!(similarity(&[], ""), 1.0);
    }
}
