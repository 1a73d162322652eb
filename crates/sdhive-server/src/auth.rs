//! The optional API key: with `--api-key`, every route but `/health` needs `Authorization: Bearer <key>`,
//! compared in constant time so response timing does not leak the key.

use crate::error::ApiError;
use crate::AppState;
use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;

/// Whether `header` (an `Authorization` value) carries `key` as a bearer token.
pub fn bearer_matches(header: Option<&str>, key: &str) -> bool {
    let Some(token) = header.and_then(|h| {
        let (scheme, token) = h.trim().split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then_some(token.trim())
    }) else {
        return false;
    };
    token.as_bytes().ct_eq(key.as_bytes()).into()
}

pub async fn require_api_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    check(state.config.api_key.as_deref(), req, next).await
}

/// The check itself, shared with the router used while the model loads.
pub(crate) async fn check(api_key: Option<&str>, req: Request, next: Next) -> Response {
    let Some(key) = api_key else {
        return next.run(req).await;
    };
    if req.uri().path() == "/health" {
        return next.run(req).await;
    }
    let header = req.headers().get(AUTHORIZATION).and_then(|v| v.to_str().ok());
    if bearer_matches(header, key) {
        next.run(req).await
    } else {
        let mut response = ApiError::unauthorized().into_response();
        response
            .headers_mut()
            .insert(axum::http::header::WWW_AUTHENTICATE, axum::http::HeaderValue::from_static("Bearer"));
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_parsing() {
        assert!(bearer_matches(Some("Bearer k1"), "k1"));
        assert!(bearer_matches(Some("bearer  k1 "), "k1"));
        assert!(!bearer_matches(Some("Bearer k2"), "k1"));
        assert!(!bearer_matches(Some("Bearer k"), "k1"));
        assert!(!bearer_matches(Some("Basic k1"), "k1"));
        assert!(!bearer_matches(Some("k1"), "k1"));
        assert!(!bearer_matches(None, "k1"));
    }
}
