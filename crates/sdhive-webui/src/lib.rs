//! The web page, embedded: `web/dist` (built from `web/` with Vite, committed) compiled into the binary by
//! `build.rs`, and [`router`], which serves it at `/` for the hive and the worker alike.
//!
//! The page's files need no credentials (the page itself asks for the API key and sends it with its API calls).
//! Names are fixed (no content hashes), so every answer says `no-cache` and carries an `ETag`: a browser
//! revalidates and gets `304` until the binary changes. Text files are gzip-compressed once, on first request.

use axum::http::header::{
    ACCEPT_ENCODING, CACHE_CONTROL, CONTENT_ENCODING, CONTENT_SECURITY_POLICY, CONTENT_TYPE, ETAG,
    IF_NONE_MATCH, REFERRER_POLICY, VARY, X_CONTENT_TYPE_OPTIONS,
};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use std::io::Write as _;
use std::sync::OnceLock;

/// One embedded file of `web/dist`.
pub struct Asset {
    /// Path under `web/dist`, `/`-separated (`index.html`, `assets/app.js`).
    pub path: &'static str,
    pub bytes: &'static [u8],
    /// A quoted content tag, as `ETag` wants it.
    pub etag: &'static str,
}

include!(concat!(env!("OUT_DIR"), "/assets.rs"));

/// Every embedded file.
pub fn assets() -> &'static [Asset] {
    ASSETS
}

/// The page's own origin only: the page may not load or call anything elsewhere, and inline script never runs.
/// Images come back from the API as base64 (`data:`) and from canvases (`blob:`).
const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; \
                   img-src 'self' data: blob:; connect-src 'self'; object-src 'none'; base-uri 'none'; \
                   frame-ancestors 'none'; form-action 'self'";

/// `GET /` (the page) and `GET /<path>` for every other file in `web/dist`. Merge it into a router *after* the
/// authentication layer, so the page loads without credentials.
pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    let mut router = Router::new();
    for (index, asset) in ASSETS.iter().enumerate() {
        let handler = move |headers: HeaderMap| async move { serve(index, &headers) };
        if asset.path == "index.html" {
            router = router.route("/", get(handler));
        }
        router = router.route(&format!("/{}", asset.path), get(handler));
    }
    router
}

fn serve(index: usize, request: &HeaderMap) -> Response {
    let asset = &ASSETS[index];
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type(asset.path)));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(ETAG, HeaderValue::from_static(asset.etag));
    headers.insert(X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    if asset.path.ends_with(".html") {
        headers.insert(CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    }
    let compressible = is_text(asset.path);
    if compressible {
        headers.insert(VARY, HeaderValue::from_static("Accept-Encoding"));
    }
    let fresh = request
        .get_all(IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|tag| tag.trim() == asset.etag || tag.trim() == "*");
    if fresh {
        return (StatusCode::NOT_MODIFIED, headers).into_response();
    }
    if compressible && accepts_gzip(request) {
        headers.insert(CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        return (headers, gzipped(index)).into_response();
    }
    (headers, asset.bytes).into_response()
}

fn gzipped(index: usize) -> &'static [u8] {
    static GZIP: OnceLock<Vec<OnceLock<Vec<u8>>>> = OnceLock::new();
    let cells = GZIP.get_or_init(|| ASSETS.iter().map(|_| OnceLock::new()).collect());
    cells[index].get_or_init(|| {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        // Writing into a Vec cannot fail.
        let _ = encoder.write_all(ASSETS[index].bytes);
        encoder.finish().unwrap_or_default()
    })
}

fn accepts_gzip(request: &HeaderMap) -> bool {
    request.get_all(ACCEPT_ENCODING).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(',')).any(
        |coding| {
            let mut parts = coding.split(';');
            let name = parts.next().unwrap_or("").trim();
            let refused = parts.any(|p| matches!(p.trim(), "q=0" | "q=0.0" | "q=0.00" | "q=0.000"));
            (name.eq_ignore_ascii_case("gzip") || name == "*") && !refused
        },
    )
}

fn extension(path: &str) -> &str {
    path.rsplit_once('.').map(|(_, ext)| ext).unwrap_or("")
}

fn is_text(path: &str) -> bool {
    matches!(extension(path), "html" | "js" | "mjs" | "css" | "svg" | "json" | "map" | "txt" | "webmanifest")
}

fn content_type(path: &str) -> &'static str {
    match extension(path) {
        "html" => "text/html; charset=utf-8",
        "js" | "mjs" => "text/javascript; charset=utf-8",
        "css" => "text/css; charset=utf-8",
        "svg" => "image/svg+xml",
        "json" | "map" => "application/json",
        "webmanifest" => "application/manifest+json",
        "txt" => "text/plain; charset=utf-8",
        "png" => "image/png",
        "ico" => "image/x-icon",
        "webp" => "image/webp",
        "woff2" => "font/woff2",
        _ => "application/octet-stream",
    }
}

#[cfg(test)]
mod tests;
