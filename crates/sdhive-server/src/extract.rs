//! `ApiJson<T>`: a JSON body extractor whose failures are [`ApiError`]s naming the offending field (413 for an
//! oversized body). Unlike axum's `Json` it does not insist on a `Content-Type`, since many image clients omit it.

use crate::error::ApiError;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = read_body(Bytes::from_request(req, state).await)?;
        parse_json(&bytes).map(ApiJson)
    }
}

/// 413 when the body went over the server's limit (`status` says so), else a 400 with `code` and `what` failed.
pub fn body_error(status: StatusCode, code: &'static str, what: String) -> ApiError {
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            Some("body_too_large"),
            None,
            "request body is larger than this server's limit".into(),
        )
    } else {
        ApiError::bad_body(code, what)
    }
}

/// A raw body, or the error for why it could not be read.
pub fn read_body(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|r| body_error(r.status(), "invalid_body", format!("cannot read the request body: {r}")))
}

/// Parses `bytes` as `T`, reporting which field is wrong.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        json_error(&path, &inner)
    })?;
    de.end().map_err(|e| {
        ApiError::bad_body("invalid_json", format!("trailing characters after the JSON body: {e}"))
    })?;
    Ok(value)
}

fn json_error(path: &str, e: &serde_json::Error) -> ApiError {
    use serde_json::error::Category;
    match e.classify() {
        Category::Syntax | Category::Eof | Category::Io => {
            ApiError::bad_body("invalid_json", format!("the body is not valid JSON: {e}"))
        }
        Category::Data => {
            let message = e.to_string();
            // serde names a missing field only in its message; the path stops at its parent (an unknown
            // field's path already ends with it).
            let named = backticked(&message)
                .filter(|_| message.starts_with("missing field") || message.starts_with("unknown field"));
            let param = match (named, path) {
                (Some(field), "." | "") => field.to_string(),
                (Some(field), path) if path == field || path.ends_with(&format!(".{field}")) => {
                    path.to_string()
                }
                (Some(field), parent) => format!("{parent}.{field}"),
                (None, path) => path.to_string(),
            };
            if param == "." || param.is_empty() {
                ApiError::bad_body("invalid_body", format!("the body must be a JSON object: {e}"))
            } else {
                let message = strip_position(&message);
                ApiError::invalid(param.clone(), format!("invalid `{param}`: {message}"))
            }
        }
    }
}

fn backticked(message: &str) -> Option<&str> {
    let start = message.find('`')? + 1;
    let len = message[start..].find('`')?;
    Some(&message[start..start + len])
}

/// serde_json appends " at line L column C"; clients care about the field, which the message already names.
fn strip_position(message: &str) -> &str {
    message.rfind(" at line ").map(|i| &message[..i]).unwrap_or(message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sdhive_protocol::JobRequest;

    fn param(body: &str) -> Option<String> {
        parse_json::<JobRequest>(body.as_bytes()).unwrap_err().body.error.param
    }

    #[test]
    fn errors_name_the_field() {
        assert_eq!(param(r#"{"prompt": "a", "steps": "many"}"#).as_deref(), Some("steps"));
        assert_eq!(param(r#"{"prompt": "a", "steps": -3}"#).as_deref(), Some("steps"));
        assert_eq!(param(r#"{"steps": 3}"#).as_deref(), Some("prompt"));
        assert_eq!(param(r#"{"prompt": "a", "stepz": 3}"#).as_deref(), Some("stepz"));
        assert_eq!(param(r#"{"prompt": "a", "seed": -5}"#).as_deref(), Some("seed"));
        assert_eq!(param(r#"{"prompt": 5}"#).as_deref(), Some("prompt"));
    }

    #[test]
    fn syntax_errors_and_non_objects() {
        let e = parse_json::<JobRequest>(b"{not json").unwrap_err();
        assert_eq!(e.body.error.code.as_deref(), Some("invalid_json"));
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let e = parse_json::<JobRequest>(b"[1, 2]").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(parse_json::<JobRequest>(br#"{"prompt": "a"} x"#).is_err());
    }
}
