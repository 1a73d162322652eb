//! The worker's prompt styles (`--styles-file`, A1111's `styles.csv`): read from the file on each use, so an
//! edit applies to the next request without a restart (A1111 reloads on demand; the file is small). A request's
//! `styles` (A1111's txt2img/img2img field, the native job field) are applied to its prompts before anything
//! else reads them, so `<lora:…>` tags inside a style work as in A1111.

use crate::error::ApiError;
use crate::ServerConfig;
use sdhive_catalog::styles::{apply_styles, read_styles, PromptStyle};
use sdhive_engine::GenerateRequest;

/// The configured styles; none without `--styles-file`. An unreadable or malformed file is a 500 naming it.
pub fn load(config: &ServerConfig) -> Result<Vec<PromptStyle>, ApiError> {
    match &config.styles_file {
        None => Ok(Vec::new()),
        Some(path) => read_styles(path).map_err(|e| ApiError::internal(e.to_string())),
    }
}

/// Applies the named styles to `req`'s prompt and negative prompt, in order (A1111's `apply_styles_to_prompt`).
/// An unknown name is a 400 about `styles`.
pub fn apply(config: &ServerConfig, names: &[String], req: &mut GenerateRequest) -> Result<(), ApiError> {
    if names.is_empty() {
        return Ok(());
    }
    if config.styles_file.is_none() {
        return Err(ApiError::invalid(
            "styles",
            format!(
                "invalid `styles`: no style `{}`: this server has no styles file (--styles-file)",
                names[0]
            ),
        ));
    }
    let styles = load(config)?;
    let (prompt, negative) = apply_styles(&styles, names, &req.prompt, &req.negative_prompt)
        .map_err(|message| ApiError::invalid("styles", format!("invalid `styles`: {message}")))?;
    req.prompt = prompt;
    req.negative_prompt = negative;
    // A hires pass's own prompts are styled too, as A1111 styles its `hr_prompt`s; unset ones follow the first
    // pass's, already styled.
    if let Some(h) = req.hires.as_mut().filter(|h| h.prompt.is_some() || h.negative_prompt.is_some()) {
        let (p, n) = (h.prompt.clone().unwrap_or_default(), h.negative_prompt.clone().unwrap_or_default());
        let (p, n) = apply_styles(&styles, names, &p, &n)
            .map_err(|message| ApiError::invalid("styles", format!("invalid `styles`: {message}")))?;
        h.prompt = h.prompt.as_ref().map(|_| p);
        h.negative_prompt = h.negative_prompt.as_ref().map(|_| n);
    }
    Ok(())
}
