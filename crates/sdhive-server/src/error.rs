//! `ApiError`: every failure a route can answer with, rendered as `{"error": {"message", "type", "param",
//! "code"}}` with the matching HTTP status (and `Retry-After` for a full queue). Route families with another
//! error shape (A1111) convert from the same value.

use crate::jobs::{LookupError, RunError, SubmitError};
use crate::models::ModelError;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use sdhive_engine::ValidationError;
use sdhive_protocol::{ErrorBody, ErrorDetail};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub body: ErrorBody,
    /// Seconds for a `Retry-After` header (429, 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(
        status: StatusCode,
        kind: &str,
        code: Option<&str>,
        param: Option<String>,
        message: String,
    ) -> Self {
        ApiError {
            status,
            body: ErrorBody {
                error: ErrorDetail { message, kind: kind.into(), param, code: code.map(Into::into) },
            },
            retry_after: None,
        }
    }

    /// 400 about one request field.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("invalid_value"),
            Some(param.into()),
            message.into(),
        )
    }

    /// 400 about the body as a whole (not JSON, wrong top-level type).
    pub fn bad_body(code: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", Some(code), None, message.into())
    }

    /// 401, saying which credentials `accepted` would take.
    pub fn unauthorized(accepted: &sdhive_protocol::Credentials) -> Self {
        let send = match (accepted.api_key.is_some(), !accepted.basic.is_empty()) {
            (true, true) => "`Authorization: Bearer <key>` or `Authorization: Basic <user:password>`",
            (false, true) => "`Authorization: Basic <user:password>` (the --api-auth credentials)",
            _ => "`Authorization: Bearer <key>`",
        };
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            Some("invalid_api_key"),
            None,
            format!("missing or wrong credentials: send {send}"),
        )
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found_error", Some("not_found"), None, message.into())
    }

    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            Some("body_too_large"),
            None,
            format!("request body is larger than the {limit}-byte limit"),
        )
    }

    pub fn queue_full(retry_after_secs: u64) -> Self {
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            Some("queue_full"),
            None,
            format!("the job queue is full; retry in about {retry_after_secs} s"),
        );
        e.retry_after = Some(retry_after_secs);
        e
    }

    pub fn unavailable(code: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", Some(code), None, message.into())
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            Some("internal_error"),
            None,
            message.into(),
        )
    }

    pub fn message(&self) -> &str {
        &self.body.error.message
    }

    pub fn param(&self) -> Option<&str> {
        self.body.error.param.as_deref()
    }
}

impl From<ValidationError> for ApiError {
    fn from(e: ValidationError) -> Self {
        // The Display form names the field ("invalid `steps`: …"), for clients that only show the message.
        ApiError::invalid(e.field, e.to_string())
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::QueueFull { retry_after_secs } => ApiError::queue_full(retry_after_secs),
            SubmitError::ShuttingDown => {
                let mut e = ApiError::unavailable("shutting_down", "the worker is shutting down");
                e.retry_after = Some(10);
                e
            }
            SubmitError::Model(e) => ApiError::from(e),
        }
    }
}

impl From<ModelError> for ApiError {
    /// An unknown model is a 404 `model_not_found` (OpenAI's answer for a model it does not have), naming the
    /// closest ones; the rest are the request's to fix (400).
    fn from(e: ModelError) -> Self {
        let (status, code, param) = match &e {
            ModelError::UnknownCheckpoint { .. } => (StatusCode::NOT_FOUND, "model_not_found", "model"),
            ModelError::UnknownVae { .. } => (StatusCode::BAD_REQUEST, "vae_not_found", "vae"),
            ModelError::NothingSelected => (StatusCode::BAD_REQUEST, "no_model", "model"),
            ModelError::Catalog(_) => {
                (StatusCode::INTERNAL_SERVER_ERROR, "model_library_unreadable", "model")
            }
        };
        ApiError::new(status, "invalid_request_error", Some(code), Some(param.into()), e.to_string())
    }
}

impl From<LookupError> for ApiError {
    fn from(e: LookupError) -> Self {
        match e {
            LookupError::NotFound(id) => Self::new(
                StatusCode::NOT_FOUND,
                "not_found_error",
                Some("job_not_found"),
                None,
                format!("no job {id}"),
            ),
            LookupError::Gone(id) => Self::new(
                StatusCode::GONE,
                "not_found_error",
                Some("job_expired"),
                None,
                format!("job {id} finished and its result has expired"),
            ),
        }
    }
}

impl From<RunError> for ApiError {
    fn from(e: RunError) -> Self {
        match e {
            RunError::Submit(e) => e.into(),
            RunError::Lookup(e) => e.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(&self.body)).into_response();
        if let Some(secs) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}
