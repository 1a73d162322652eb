//! The serving lifecycle: listen at once (so `/health` answers and `/ready` says 503 while the model loads),
//! load the model off the async runtime, switch to the full router, register with the hive, and on a shutdown
//! signal drain — refuse new jobs, give the running one a grace period then cancel it, deregister, stop.

use crate::auth;
use crate::error::ApiError;
use crate::models::ModelLibrary;
use crate::registration::{RegistrationConfig, RegistrationError, Uplink, WorkerRegistrant};
use crate::{router, AppState, ServerConfig};
use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use sdhive_engine::{Engine, EngineFactory, ModelHost, ModelSpec};
use serde_json::json;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tower::ServiceExt;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Loads the engine; runs on a blocking thread, so it may read files and download for minutes.
pub type EngineLoader = Box<dyn FnOnce() -> Result<Box<dyn Engine>, BoxError> + Send>;

/// A worker that switches models: its library, the factory that loads from it, and the model loaded before it
/// is ready (none: it starts empty and loads what the first job asks for).
pub struct LibraryStartup {
    pub library: Arc<ModelLibrary>,
    pub factory: Box<dyn EngineFactory>,
    pub initial: Option<ModelSpec>,
    /// Whether a failure to load `initial` stops the worker (the operator named it) or only leaves it without a
    /// model (it was the library's first checkpoint, picked for them).
    pub initial_required: bool,
}

/// How `serve` gets its model: one engine for life, or a model library.
pub enum Startup {
    Engine(EngineLoader),
    Library(LibraryStartup),
}

impl From<EngineLoader> for Startup {
    fn from(loader: EngineLoader) -> Self {
        Startup::Engine(loader)
    }
}

impl From<LibraryStartup> for Startup {
    fn from(startup: LibraryStartup) -> Self {
        Startup::Library(startup)
    }
}

enum Loaded {
    Engine(Box<dyn Engine>),
    Host(Arc<ModelLibrary>, ModelHost),
}

impl Startup {
    fn load(self) -> Result<Loaded, BoxError> {
        match self {
            Startup::Engine(loader) => Ok(Loaded::Engine(loader()?)),
            Startup::Library(LibraryStartup { library, factory, initial, initial_required }) => {
                let mut host = ModelHost::new(factory);
                if let Some(spec) = initial {
                    match host.load_model(&spec) {
                        Ok(()) => {
                            library.select_checkpoint(&spec);
                            library.hash_in_background(&spec);
                        }
                        Err(e) if !initial_required => {
                            tracing::error!("{e}; starting without a model (requests must name one)")
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                Ok(Loaded::Host(library, host))
            }
        }
    }
}

/// How long a cancelled job may take to stop (one denoising step) before shutdown goes on without it.
const CANCEL_WAIT: Duration = Duration::from_secs(60);
/// How long open connections get to finish once everything else has stopped.
const HTTP_DRAIN: Duration = Duration::from_secs(5);

#[derive(Debug, Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the async runtime")]
    Runtime(#[source] std::io::Error),
    #[error("cannot load the model")]
    Load(#[source] BoxError),
    #[error("the model loader panicked")]
    LoaderPanicked,
    #[error(transparent)]
    Registration(#[from] RegistrationError),
    #[error("the HTTP server failed")]
    Http(#[source] std::io::Error),
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!("cannot listen for Ctrl-C: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

/// Blocking entry point for binaries: binds `host:port` (port 0 picks a free one), reports the bound address to
/// `on_listening`, serves until SIGINT/SIGTERM, and returns once drained.
pub fn run(
    host: &str,
    port: u16,
    config: ServerConfig,
    startup: impl Into<Startup>,
    registration: Option<RegistrationConfig>,
    on_listening: impl FnOnce(SocketAddr),
) -> Result<(), ServeError> {
    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(ServeError::Runtime)?;
    runtime.block_on(async move {
        let addr = format!("{host}:{port}");
        let listener = TcpListener::bind(&addr)
            .await
            .map_err(|source| ServeError::Bind { addr: addr.clone(), source })?;
        let local = listener.local_addr().map_err(|source| ServeError::Bind { addr, source })?;
        on_listening(local);
        let signal = async {
            shutdown_signal().await;
            // The drain can take a while (grace period, a slow step); a second signal means "now".
            tokio::spawn(async {
                shutdown_signal().await;
                eprintln!("second signal: exiting without draining");
                std::process::exit(130);
            });
        };
        serve(listener, config, startup, registration, signal).await
    })
}

/// The router while the model loads: liveness yes, everything else 503.
fn loading_router(credentials: sdhive_protocol::Credentials) -> Router {
    let credentials = Arc::new(credentials);
    Router::new()
        .route("/health", get(crate::routes::ops::health))
        .route(
            "/ready",
            get(|| async { (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "loading"}))) }),
        )
        .fallback(|| async {
            let mut e = ApiError::unavailable("model_loading", "the model is still loading; retry shortly");
            e.retry_after = Some(5);
            e.into_response()
        })
        .layer(axum::middleware::from_fn(move |req: Request, next: axum::middleware::Next| {
            let credentials = Arc::clone(&credentials);
            async move { auth::check(&credentials, req, next).await }
        }))
        // The page answers while the model loads; it shows the loading state from `/ready`.
        .merge(sdhive_webui::router())
}

/// Serves on `listener` until `shutdown` resolves, then drains and returns. Registration (if configured) starts
/// once the model is loaded.
pub async fn serve(
    listener: TcpListener,
    config: ServerConfig,
    startup: impl Into<Startup>,
    registration: Option<RegistrationConfig>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let local =
        listener.local_addr().map_err(|source| ServeError::Bind { addr: "listener".into(), source })?;
    let full: Arc<OnceLock<Router>> = Arc::new(OnceLock::new());
    let config = ServerConfig { listen: Some(local), ..config };
    let loading = loading_router(config.credentials());
    let switch = {
        let full = Arc::clone(&full);
        tower::service_fn(move |req: Request| {
            let target = full.get().cloned().unwrap_or_else(|| loading.clone());
            async move { target.oneshot(req).await }
        })
    };
    let app = Router::new().fallback_service(switch);
    let (http_stop_tx, mut http_stop_rx) = watch::channel(false);
    let mut http = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = http_stop_rx.wait_for(|s| *s).await;
            })
            .await
    });
    let mut shutdown = std::pin::pin!(shutdown);
    let load_started = Instant::now();
    let startup: Startup = startup.into();
    let load = tokio::task::spawn_blocking(move || startup.load());
    let engine = tokio::select! {
        loaded = load => loaded,
        _ = &mut shutdown => {
            tracing::info!("shutdown requested while the model was loading");
            return stop_http(&http_stop_tx, &mut http).await;
        }
    };
    let engine = match engine {
        Ok(Ok(engine)) => engine,
        Ok(Err(e)) => {
            let _ = stop_http(&http_stop_tx, &mut http).await;
            return Err(ServeError::Load(e));
        }
        Err(_) => {
            let _ = stop_http(&http_stop_tx, &mut http).await;
            return Err(ServeError::LoaderPanicked);
        }
    };
    let state = match engine {
        Loaded::Engine(engine) => AppState::new(config, engine),
        Loaded::Host(library, host) => AppState::with_library(config, library, host),
    };
    // Ready once the engine thread has warmed the batch sizes up (where batching is on): requests and the hive
    // then never meet a size's first step.
    let jobs = state.jobs.clone();
    let warm = tokio::task::spawn_blocking(move || jobs.wait_warm());
    tokio::select! {
        _ = warm => {}
        _ = &mut shutdown => {
            tracing::info!("shutdown requested while the engine warmed up");
            let jobs = state.jobs.clone();
            let _ = tokio::task::spawn_blocking(move || jobs.stop_engine_blocking()).await;
            return stop_http(&http_stop_tx, &mut http).await;
        }
    }
    let load_time = load_started.elapsed();
    state.metrics.set_model_load_time(load_time);
    tracing::info!(model = %state.info().model, seconds = load_time.as_secs_f64(), "model loaded; ready");
    // Only ever set here, once; a second set cannot happen.
    let _ = full.set(router(state.clone()));

    let (link_stop_tx, link_stop_rx) = watch::channel(false);
    let link = match registration {
        Some(reg) => {
            let base_url = reg.base_url.clone().unwrap_or_else(|| default_base_url(local));
            let link = Arc::new(Uplink::new(reg, WorkerRegistrant { state: state.clone(), base_url })?);
            let task = tokio::spawn({
                let link = Arc::clone(&link);
                async move { link.run(link_stop_rx).await }
            });
            Some((link, task))
        }
        None => None,
    };

    tokio::select! {
        _ = &mut shutdown => {}
        result = &mut http => {
            // The server stopped by itself: nothing can reach the jobs any more, so shut down too.
            tracing::error!("the HTTP server stopped unexpectedly");
            drain(&state).await;
            return match result {
                Ok(Err(e)) => Err(ServeError::Http(e)),
                _ => Ok(()),
            };
        }
    }
    tracing::info!("shutting down: refusing new jobs");
    drain(&state).await;
    if let Some((link, task)) = link {
        let _ = link_stop_tx.send(true);
        let _ = task.await;
        link.deregister("shutdown").await;
    }
    let jobs = state.jobs.clone();
    let _ = tokio::task::spawn_blocking(move || jobs.stop_engine_blocking()).await;
    stop_http(&http_stop_tx, &mut http).await?;
    tracing::info!("stopped");
    Ok(())
}

/// Asks the HTTP server to finish its open requests and waits for it, up to [`HTTP_DRAIN`].
async fn stop_http(
    stop: &watch::Sender<bool>,
    http: &mut tokio::task::JoinHandle<std::io::Result<()>>,
) -> Result<(), ServeError> {
    let _ = stop.send(true);
    match tokio::time::timeout(HTTP_DRAIN, &mut *http).await {
        Ok(Ok(Ok(()))) => Ok(()),
        Ok(Ok(Err(e))) => Err(ServeError::Http(e)),
        // A panicked server task has already reported itself; it is stopped either way.
        Ok(Err(_)) => Ok(()),
        Err(_) => {
            http.abort();
            Ok(())
        }
    }
}

/// Refuses new jobs, fails queued ones (`shutting_down`), lets the running job finish within the grace period,
/// then stops it.
pub async fn drain(state: &AppState) {
    let jobs = state.jobs.clone();
    let grace = state.config.shutdown_grace;
    let _ = tokio::task::spawn_blocking(move || {
        jobs.begin_shutdown();
        if jobs.wait_idle_blocking(grace) {
            return;
        }
        if let Some(id) = jobs.cancel_current_for_shutdown() {
            tracing::warn!(job = %id, "grace period over; cancelling the running job");
        }
        if !jobs.wait_idle_blocking(CANCEL_WAIT) {
            tracing::error!("the running job did not stop after cancellation; exiting anyway");
        }
    })
    .await;
}

/// `http://<bound address>`; a wildcard bind has no single address others can use, so loopback stands in (and
/// operators should pass the public URL).
fn default_base_url(local: SocketAddr) -> String {
    if local.ip().is_unspecified() {
        tracing::warn!("bound to {local}: advertising loopback to the hive; pass --public-url to override");
        let loopback = if local.is_ipv4() { "127.0.0.1".to_string() } else { "[::1]".to_string() };
        format!("http://{loopback}:{}", local.port())
    } else {
        format!("http://{local}")
    }
}
