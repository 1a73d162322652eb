//! The HTTP route families. Each module exposes `router() -> Router<AppState>`; `crate::router` merges them
//! behind the shared auth and body-limit layers.

pub mod a1111;
pub mod a1111_info;
pub mod a1111_upscale;
pub mod native;
pub mod openai;
pub mod ops;

use crate::error::ApiError;
use crate::jobs::JobView;
use axum::http::{HeaderName, HeaderValue, Uri};
use axum::response::Response;
use std::time::{Duration, Instant, SystemTime};

/// Unknown paths get the JSON error body too, not axum's empty 404.
pub async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(format!("no route for {}", uri.path()))
}

/// A generation route's clock: when it started, submitted its job, and had the job's end back, for the
/// `Server-Timing` header of its answer ([`RouteClock::answer`]).
pub(crate) struct RouteClock {
    received: Instant,
    submitted: Option<Instant>,
    ended: Option<(Instant, SystemTime)>,
}

impl RouteClock {
    pub(crate) fn start() -> RouteClock {
        RouteClock { received: Instant::now(), submitted: None, ended: None }
    }

    /// The request is read and checked; its job goes to the queue now.
    pub(crate) fn submitted(&mut self) {
        self.submitted = Some(Instant::now());
    }

    /// The route has the job's end.
    pub(crate) fn ended(&mut self) {
        self.ended = Some((Instant::now(), SystemTime::now()));
    }

    /// Adds the `Server-Timing` header (W3C Server Timing, milliseconds) to `response`, the answer of job `view`:
    /// `prepare` (reading and checking the request), `queue` (waiting for the engine), `engine` (the run until
    /// the engine handed the images over), `encode` (waiting for an encoding thread and encoding them), `wake`
    /// (from the job's end until its route ran again), `answer` (building the answer: base64, JSON) and `total`
    /// (on the server, from the route's start until now). Browsers' developer tools show it;
    /// `sdhive-bench --serve-bench` splits the HTTP path's cost with it.
    pub(crate) fn answer(&self, mut response: Response, view: &JobView) -> Response {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let now = Instant::now();
        let encode = view.encode_duration.unwrap_or_default();
        let engine = view.run_duration.unwrap_or_default().saturating_sub(encode);
        let prepare = self.submitted.map(|s| s.duration_since(self.received)).unwrap_or_default();
        let wake = match (self.ended, view.finished_at) {
            (Some((_, wall)), Some(finished)) => wall.duration_since(finished).unwrap_or_default(),
            _ => Duration::ZERO,
        };
        let answer = self.ended.map(|(t, _)| now.duration_since(t)).unwrap_or_default();
        let value = format!(
            "prepare;dur={:.2}, queue;dur={:.2}, engine;dur={:.2}, encode;dur={:.2}, wake;dur={:.2}, \
             answer;dur={:.2}, total;dur={:.2}",
            ms(prepare),
            ms(view.queue_duration.unwrap_or_default()),
            ms(engine),
            ms(encode),
            ms(wake),
            ms(answer),
            ms(now.duration_since(self.received)),
        );
        if let Ok(value) = HeaderValue::from_str(&value) {
            response.headers_mut().insert(HeaderName::from_static("server-timing"), value);
        }
        response
    }
}

/// Appends `bytes` in base64 as a JSON string to a body written by hand: base64 needs no escaping, and at 512² and
/// up an image's base64 is nearly all of an answer, so it skips serde's escaping pass (about a millisecond a 512²
/// image) and is written in chunks on the encoding threads ([`sdhive_engine::base64_into`]).
pub(crate) fn push_base64_string(body: &mut Vec<u8>, bytes: &[u8]) {
    body.push(b'"');
    let start = body.len();
    body.resize(start + bytes.len().div_ceil(3) * 4, 0);
    sdhive_engine::base64_into(bytes, &mut body[start..]);
    body.push(b'"');
}
