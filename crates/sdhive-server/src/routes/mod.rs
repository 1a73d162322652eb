//! The HTTP route families. Each module exposes `router() -> Router<AppState>`; `crate::router` merges them
//! behind the shared auth and body-limit layers.

pub mod a1111;
pub mod a1111_info;
pub mod a1111_upscale;
pub mod native;
pub mod openai;
pub mod ops;

use crate::error::ApiError;
use axum::http::Uri;

/// Unknown paths get the JSON error body too, not axum's empty 404.
pub async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(format!("no route for {}", uri.path()))
}
