//! The error body of the native and OpenAI-style routes: `{"error": {"message", "type", "param", "code"}}`,
//! the shape OpenAI clients already parse, so one client-side handler covers both families.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `not_found_error`, `rate_limit_error`, `server_error`, …
    #[serde(rename = "type")]
    pub kind: String,
    /// The request field at fault, as the client spelled it; `null` when the error is not about one field.
    pub param: Option<String>,
    /// A stable machine-readable code (`queue_full`, `job_expired`, `body_too_large`, …).
    pub code: Option<String>,
}
