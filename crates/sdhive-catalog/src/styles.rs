//! A1111's prompt styles (`--styles-file`): a `styles.csv` of `name,prompt,negative_prompt` rows (quoted CSV as
//! Python's `csv` module reads and writes it), or a folder of such files. A request's `styles` are applied as
//! A1111's `modules/styles.py` does: a style prompt containing `{prompt}` has it replaced by the prompt, any other
//! is appended after `", "`; the same for the negative prompt. `extract_styles` undoes that for PNG Info, as
//! A1111's infotext parser does. The file is small and read on each use, so edits apply at once (A1111 reloads on
//! demand).

use serde::Serialize;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// One style, as `GET /sdapi/v1/prompt-styles` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PromptStyle {
    pub name: String,
    pub prompt: String,
    pub negative_prompt: String,
}

#[derive(Debug, Error)]
pub enum StylesError {
    #[error("cannot read the styles file {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the styles file {}: {message}", path.display())]
    Parse { path: PathBuf, message: String },
}

/// The styles of `path`: one CSV file, or every `*.csv` directly in a folder (by file name). A later row of a
/// name already read replaces it in place, as A1111's dictionary does.
pub fn read_styles(path: &Path) -> Result<Vec<PromptStyle>, StylesError> {
    let io = |source| StylesError::Io { path: path.to_path_buf(), source };
    let files = if path.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(io)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && p.extension().is_some_and(|x| x.eq_ignore_ascii_case("csv")))
            .collect();
        files.sort();
        files
    } else {
        vec![path.to_path_buf()]
    };
    let mut out: Vec<PromptStyle> = Vec::new();
    for file in files {
        let bytes = std::fs::read(&file).map_err(|source| StylesError::Io { path: file.clone(), source })?;
        let text = String::from_utf8_lossy(&bytes);
        let styles =
            parse_styles_csv(&text).map_err(|message| StylesError::Parse { path: file.clone(), message })?;
        for style in styles {
            match out.iter_mut().find(|s| s.name == style.name) {
                Some(existing) => *existing = style,
                None => out.push(style),
            }
        }
    }
    Ok(out)
}

/// Rows of CSV text as Python's `csv.reader(…, skipinitialspace=True)` splits them (excel dialect): quoted
/// fields may hold commas, newlines and doubled quotes; blank lines give no row.
fn csv_rows(text: &str) -> Vec<Vec<String>> {
    let mut rows = Vec::new();
    let mut row: Vec<String> = Vec::new();
    let mut field = String::new();
    let mut chars = text.chars().peekable();
    // Where we are in a field: at its start (spaces skipped), inside quotes, or in an unquoted part.
    #[derive(PartialEq)]
    enum At {
        Start,
        Quoted,
        Plain,
    }
    let mut at = At::Start;
    let mut row_started = false;
    while let Some(c) = chars.next() {
        match at {
            At::Quoted => match c {
                '"' if chars.peek() == Some(&'"') => {
                    chars.next();
                    field.push('"');
                }
                '"' => at = At::Plain,
                c => field.push(c),
            },
            At::Start | At::Plain => match c {
                ',' => {
                    row.push(std::mem::take(&mut field));
                    row_started = true;
                    at = At::Start;
                }
                '\r' | '\n' => {
                    if c == '\r' && chars.peek() == Some(&'\n') {
                        chars.next();
                    }
                    if row_started || !field.is_empty() || at == At::Plain {
                        row.push(std::mem::take(&mut field));
                        rows.push(std::mem::take(&mut row));
                    }
                    row_started = false;
                    at = At::Start;
                }
                ' ' if at == At::Start => {}
                '"' if at == At::Start && field.is_empty() => {
                    at = At::Quoted;
                    row_started = true;
                }
                c => {
                    field.push(c);
                    at = At::Plain;
                }
            },
        }
    }
    if row_started || !field.is_empty() || at != At::Start {
        row.push(field);
        rows.push(row);
    }
    rows
}

/// A1111's `StyleDatabase.load_from_csv`: a header row naming the columns (`name` and `prompt`, or the older
/// `text`; `negative_prompt` optional), then one style per row; rows whose name starts with `#` are comments.
pub fn parse_styles_csv(text: &str) -> Result<Vec<PromptStyle>, String> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut rows = csv_rows(text).into_iter();
    let Some(header) = rows.next() else { return Ok(Vec::new()) };
    let column = |name: &str| header.iter().position(|h| h == name);
    let name_col = column("name").ok_or("the header row has no `name` column")?;
    let prompt_col = column("prompt")
        .or_else(|| column("text"))
        .ok_or("the header row has no `prompt` (or `text`) column")?;
    let negative_col = column("negative_prompt");
    let cell = |row: &[String], col: Option<usize>| col.and_then(|c| row.get(c)).cloned().unwrap_or_default();
    let mut out: Vec<PromptStyle> = Vec::new();
    for row in rows {
        let name = cell(&row, Some(name_col));
        if name.starts_with('#') || row.iter().all(String::is_empty) {
            continue;
        }
        let style = PromptStyle {
            name,
            prompt: cell(&row, Some(prompt_col)),
            negative_prompt: cell(&row, negative_col),
        };
        match out.iter_mut().find(|s| s.name == style.name) {
            Some(existing) => *existing = style,
            None => out.push(style),
        }
    }
    Ok(out)
}

/// A1111's `merge_prompts`: `{prompt}` in the style is replaced by the prompt; otherwise the two are joined with
/// `", "`, leaving out whichever is blank.
pub fn merge_prompts(style_prompt: &str, prompt: &str) -> String {
    if style_prompt.contains("{prompt}") {
        style_prompt.replace("{prompt}", prompt)
    } else {
        [prompt.trim(), style_prompt.trim()]
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The prompt and negative prompt with the named styles applied in order; an unknown name is an error naming it
/// and the styles there are.
pub fn apply_styles(
    styles: &[PromptStyle],
    names: &[String],
    prompt: &str,
    negative_prompt: &str,
) -> Result<(String, String), String> {
    let (mut prompt, mut negative) = (prompt.to_string(), negative_prompt.to_string());
    for name in names {
        let Some(style) = styles.iter().find(|s| &s.name == name) else {
            let known: Vec<&str> = styles.iter().map(|s| s.name.as_str()).collect();
            return Err(if known.is_empty() {
                format!("no style `{name}`: the styles file lists none")
            } else {
                format!("no style `{name}`; styles: {}", known.join(", "))
            });
        };
        prompt = merge_prompts(&style.prompt, &prompt);
        negative = merge_prompts(&style.negative_prompt, &negative);
    }
    Ok((prompt, negative))
}

/// A1111's `extract_style_text_from_prompt`: whether `prompt` is `style_text` applied to something, and that
/// something.
fn extract_style_text(style_text: &str, prompt: &str) -> Option<String> {
    let (prompt, style_text) = (prompt.trim(), style_text.trim());
    match style_text.split_once("{prompt}") {
        // Python's slice of an overlapping match is empty.
        Some((left, right)) => (prompt.starts_with(left) && prompt.ends_with(right))
            .then(|| prompt.get(left.len()..prompt.len() - right.len()).unwrap_or_default().to_string()),
        None => {
            prompt.strip_suffix(style_text).map(|rest| rest.strip_suffix(", ").unwrap_or(rest).to_string())
        }
    }
}

/// A1111's `extract_styles_from_prompt`: the styles whose text the prompts end with (or wrap them), peeled off
/// one at a time; returns their names in the order they were applied and the prompts without them.
pub fn extract_styles(
    styles: &[PromptStyle],
    prompt: &str,
    negative_prompt: &str,
) -> (Vec<String>, String, String) {
    let (mut prompt, mut negative) = (prompt.to_string(), negative_prompt.to_string());
    let mut candidates: Vec<&PromptStyle> = styles.iter().collect();
    let mut found = Vec::new();
    loop {
        let hit = candidates.iter().enumerate().find_map(|(i, style)| {
            if style.prompt.is_empty() && style.negative_prompt.is_empty() {
                return None;
            }
            let p = extract_style_text(&style.prompt, &prompt)?;
            let n = extract_style_text(&style.negative_prompt, &negative)?;
            Some((i, p, n))
        });
        let Some((i, p, n)) = hit else { break };
        (prompt, negative) = (p, n);
        found.push(candidates.remove(i).name.clone());
    }
    found.reverse();
    (found, prompt, negative)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn style(name: &str, prompt: &str, negative: &str) -> PromptStyle {
        PromptStyle { name: name.into(), prompt: prompt.into(), negative_prompt: negative.into() }
    }

    #[test]
    fn csv_as_python_reads_it() {
        let text = "\u{feff}name,prompt,negative_prompt\r\n\
                    cinematic,\"cinematic still of {prompt}, film grain\",\"blurry, \"\"cartoon\"\"\"\n\
                    \n\
                    # comment,x,y\n\
                    plain, masterpiece,  \n\
                    multi,\"line one\nline two\",\n\
                    short,only\n\
                    plain,replaced,neg\n";
        let styles = parse_styles_csv(text).unwrap();
        assert_eq!(
            styles,
            vec![
                style("cinematic", "cinematic still of {prompt}, film grain", "blurry, \"cartoon\""),
                style("plain", "replaced", "neg"),
                style("multi", "line one\nline two", ""),
                style("short", "only", ""),
            ]
        );
        // The old two-column format.
        assert_eq!(parse_styles_csv("name,text\na,b").unwrap(), vec![style("a", "b", "")]);
        assert_eq!(parse_styles_csv("").unwrap(), vec![]);
        assert!(parse_styles_csv("title,prompt\na,b").unwrap_err().contains("name"));
        assert!(parse_styles_csv("name,negative_prompt\na,b").unwrap_err().contains("prompt"));
    }

    #[test]
    fn styles_apply_as_a1111_merges_them() {
        let styles = vec![
            style("wrap", "cinematic still of {prompt}, film grain", "{prompt}, cartoon"),
            style("tail", "masterpiece", "lowres"),
            style("empty", "", ""),
        ];
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            apply_styles(&styles, &names(&["wrap", "tail"]), "a cat", "").unwrap(),
            ("cinematic still of a cat, film grain, masterpiece".into(), ", cartoon, lowres".into())
        );
        assert_eq!(
            apply_styles(&styles, &names(&["tail"]), "  ", " blurry ").unwrap(),
            ("masterpiece".into(), "blurry, lowres".into())
        );
        assert_eq!(apply_styles(&styles, &names(&["empty"]), "x", "y").unwrap(), ("x".into(), "y".into()));
        let e = apply_styles(&styles, &names(&["nope"]), "x", "").unwrap_err();
        assert!(e.contains("`nope`") && e.contains("wrap, tail, empty"), "{e}");
        assert!(apply_styles(&[], &names(&["x"]), "x", "").unwrap_err().contains("lists none"));
    }

    #[test]
    fn extraction_undoes_application() {
        let styles = vec![
            style("wrap", "cinematic still of {prompt}, film grain", "cartoon, {prompt}"),
            style("tail", "masterpiece", "lowres"),
        ];
        let names = vec!["wrap".to_string(), "tail".to_string()];
        let (p, n) = apply_styles(&styles, &names, "a cat", "blurry").unwrap();
        assert_eq!(extract_styles(&styles, &p, &n), (names, "a cat".into(), "blurry".into()));
        let (found, p, n) = extract_styles(&styles, "a dog", "");
        assert_eq!((found.len(), p.as_str(), n.as_str()), (0, "a dog", ""));
    }

    #[test]
    fn a_folder_of_csv_files_is_read_in_name_order() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("b.csv"), "name,prompt\nx,from b\ny,only b\n").unwrap();
        std::fs::write(dir.path().join("a.csv"), "name,prompt\nx,from a\n").unwrap();
        std::fs::write(dir.path().join("notes.txt"), "not,styles\n").unwrap();
        let styles = read_styles(dir.path()).unwrap();
        assert_eq!(styles, vec![style("x", "from b", ""), style("y", "only b", "")]);
        let missing = read_styles(&dir.path().join("nope.csv")).unwrap_err();
        assert!(missing.to_string().contains("nope.csv"), "{missing}");
    }
}
