//! Optional authentication: with `--api-key` and/or A1111's `--api-auth user:pass[,…]`, every route but
//! `/health` needs `Authorization: Bearer <key>` or `Authorization: Basic <user:pass>` (either credential that is
//! configured), compared in constant time so response timing does not leak them (`sdhive_protocol::auth`).

use crate::error::ApiError;
use crate::AppState;
use axum::extract::{Request, State};
use axum::http::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sdhive_protocol::Credentials;

/// Whether `header` (an `Authorization` value) carries `key` as a bearer token.
pub fn bearer_matches(header: Option<&str>, key: &str) -> bool {
    Credentials::new(Some(key.to_string()), Default::default()).accepts(header)
}

pub async fn require_credentials(State(state): State<AppState>, req: Request, next: Next) -> Response {
    check(&state.config.credentials(), req, next).await
}

/// The check itself, shared with the router used while the model loads.
pub(crate) async fn check(credentials: &Credentials, req: Request, next: Next) -> Response {
    if !credentials.required() || req.uri().path() == "/health" {
        return next.run(req).await;
    }
    let header = req.headers().get(AUTHORIZATION).and_then(|v| v.to_str().ok());
    if credentials.accepts(header) {
        return next.run(req).await;
    }
    let mut response = ApiError::unauthorized(credentials).into_response();
    for challenge in credentials.challenges() {
        response.headers_mut().append(WWW_AUTHENTICATE, HeaderValue::from_static(challenge));
    }
    response
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
