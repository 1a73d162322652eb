//! The native asynchronous job API: submit (`POST /v1/jobs` → 202), poll (`GET /v1/jobs/{id}`), follow
//! (`GET /v1/jobs/{id}/events`, server-sent events) and cancel (`POST /v1/jobs/{id}/cancel`).

use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::jobs::JobManager;
use crate::models::VaeChoice;
use crate::validation::build_request;
use crate::AppState;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::stream::{self, Stream};
use sdhive_protocol::{JobAccepted, JobEvent, JobId, JobLinks, JobRequest};
use std::collections::VecDeque;
use std::convert::Infallible;
use tokio::sync::broadcast;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/jobs", post(submit))
        .route("/v1/jobs/{id}", get(get_job))
        .route("/v1/jobs/{id}/events", get(events))
        .route("/v1/jobs/{id}/cancel", post(cancel))
}

async fn submit(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<JobRequest>,
) -> Result<Response, ApiError> {
    let mut req = build_request(&body, &state.config.limits, state.config.max_decode_pixels)?;
    if let Some(hr) = &body.hires {
        let strength = sdhive_engine::HiresFix::default().denoising_strength;
        crate::hires::attach(&state, &mut req, hr, &crate::hires::NATIVE_FIELDS, strength)?;
    }
    if let Some(styles) = body.styles.as_deref().filter(|s| !s.is_empty()) {
        crate::styles::apply(&state.config, styles, &mut req)?;
        // The styled prompts are what the limits apply to.
        req.validate(&state.config.limits)?;
    }
    let vae = body.vae.as_deref().map(VaeChoice::parse);
    if let Some(choice) = &vae {
        state.library.check_vae(choice)?;
    }
    let model = state.library.resolve(body.model.as_deref(), vae.as_ref())?;
    let req =
        state.resolve_networks_async(req, body.loras.clone().unwrap_or_default(), model.clone()).await?;
    let id = state.jobs.submit_for(req, model)?;
    let view = state.jobs.view(&id)?;
    let links = JobLinks::for_job(&id);
    let location = links.self_.clone();
    let accepted = JobAccepted { id, state: view.state, queue_position: view.queue_position, links };
    Ok((StatusCode::ACCEPTED, [(header::LOCATION, location)], Json(accepted)).into_response())
}

async fn get_job(State(state): State<AppState>, Path(id): Path<String>) -> Result<Response, ApiError> {
    let view = state.jobs.view(&JobId(id))?;
    Ok(Json(view.to_snapshot()).into_response())
}

async fn cancel(State(state): State<AppState>, Path(id): Path<String>) -> Result<Response, ApiError> {
    let view = state.jobs.cancel(&JobId(id))?;
    Ok(Json(view.to_snapshot()).into_response())
}

async fn events(State(state): State<AppState>, Path(id): Path<String>) -> Result<Response, ApiError> {
    let id = JobId(id);
    let (view, rx) = state.jobs.subscribe(&id)?;
    let pending: VecDeque<JobEvent> = view.replay_events().into();
    let rx = (!view.state.is_terminal()).then_some(rx);
    let stream = event_stream(EventCursor { jobs: state.jobs.clone(), id, pending, rx });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()).into_response())
}

struct EventCursor {
    jobs: JobManager,
    id: JobId,
    /// Replayed or resynchronised events to send before reading the channel again.
    pending: VecDeque<JobEvent>,
    /// `None` once the terminal event was queued: the stream then ends after `pending`.
    rx: Option<broadcast::Receiver<JobEvent>>,
}

impl EventCursor {
    async fn next(&mut self) -> Option<JobEvent> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                if event.is_terminal() {
                    self.rx = None;
                    self.pending.clear();
                }
                return Some(event);
            }
            let rx = self.rx.as_mut()?;
            match rx.recv().await {
                Ok(event) => {
                    if event.is_terminal() {
                        self.rx = None;
                    }
                    return Some(event);
                }
                // Fell behind the step events: continue from the job's present state instead of replaying.
                Err(broadcast::error::RecvError::Lagged(_)) => match self.jobs.view(&self.id) {
                    Ok(view) => {
                        let mut events: VecDeque<JobEvent> = view.replay_events().into();
                        // Queued/started were already sent; only the latest progress and any ending are new.
                        events.retain(|e| !matches!(e, JobEvent::Queued { .. } | JobEvent::Started { .. }));
                        self.pending = events;
                    }
                    Err(_) => return None,
                },
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }
}

fn event_stream(cursor: EventCursor) -> impl Stream<Item = Result<Event, Infallible>> {
    stream::unfold(cursor, |mut cursor| async move {
        let event = cursor.next().await?;
        let sse = Event::default().event(event.name()).json_data(&event).unwrap_or_else(|e| {
            // Our own types always serialise; if not, say so on the stream rather than dropping the event.
            Event::default().event("error").data(e.to_string())
        });
        Some((Ok(sse), cursor))
    })
}
