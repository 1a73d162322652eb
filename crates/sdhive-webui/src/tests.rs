//! The embedded page as a browser fetches it: types, revalidation, compression, and that the page's own
//! references all resolve to embedded files.

use super::*;
use axum::body::Body;
use axum::http::Request;
use std::io::Read as _;
use tower::ServiceExt as _;

async fn fetch(path: &str, headers: &[(&str, &str)]) -> (StatusCode, HeaderMap, Vec<u8>) {
    let mut req = Request::get(path);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let res = router::<()>().oneshot(req.body(Body::empty()).unwrap()).await.unwrap();
    let (parts, body) = res.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    (parts.status, parts.headers, bytes.to_vec())
}

fn asset(path: &str) -> &'static Asset {
    ASSETS.iter().find(|a| a.path == path).unwrap_or_else(|| panic!("{path} is not embedded"))
}

#[tokio::test]
async fn root_is_the_page_with_a_strict_policy() {
    let (status, headers, body) = fetch("/", &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers[CONTENT_TYPE], "text/html; charset=utf-8");
    assert_eq!(body, asset("index.html").bytes);
    let csp = headers[CONTENT_SECURITY_POLICY].to_str().unwrap();
    assert!(csp.contains("connect-src 'self'") && csp.contains("script-src 'self'"), "{csp}");
    assert_eq!(fetch("/index.html", &[]).await.2, body);
}

#[tokio::test]
async fn every_file_the_page_references_is_embedded_and_typed() {
    let html = std::str::from_utf8(asset("index.html").bytes).unwrap();
    let mut refs = Vec::new();
    for attr in ["src=\"", "href=\""] {
        for part in html.split(attr).skip(1) {
            let url = part.split('"').next().unwrap();
            // In-page anchors (a skip link's `#main`) fetch nothing.
            if !url.starts_with('#') {
                refs.push(url.to_string());
            }
        }
    }
    assert!(refs.iter().any(|r| r.ends_with(".js")), "no script in index.html: {refs:?}");
    for url in refs {
        assert!(
            url.starts_with('/') && !url.starts_with("//"),
            "{url}: the page must load from its server only"
        );
        let (status, headers, body) = fetch(&url, &[]).await;
        assert_eq!(status, StatusCode::OK, "{url}");
        assert_ne!(headers[CONTENT_TYPE], "application/octet-stream", "{url}");
        assert_eq!(body, asset(url.trim_start_matches('/')).bytes, "{url}");
    }
}

#[tokio::test]
async fn gzip_when_accepted_and_identical_once_inflated() {
    let js = ASSETS.iter().find(|a| a.path.ends_with(".js")).unwrap();
    let path = format!("/{}", js.path);
    let (status, headers, body) = fetch(&path, &[("accept-encoding", "br, gzip;q=0.8")]).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers[CONTENT_ENCODING], "gzip");
    let mut plain = Vec::new();
    flate2::read::GzDecoder::new(&body[..]).read_to_end(&mut plain).unwrap();
    assert_eq!(plain, js.bytes);
    let (_, headers, body) = fetch(&path, &[("accept-encoding", "gzip;q=0, identity")]).await;
    assert!(!headers.contains_key(CONTENT_ENCODING));
    assert_eq!(body, js.bytes);
}

#[tokio::test]
async fn a_known_etag_revalidates_to_304() {
    let (_, headers, _) = fetch("/", &[]).await;
    let tag = headers[ETAG].to_str().unwrap().to_string();
    let (status, _, body) = fetch("/", &[("if-none-match", &tag)]).await;
    assert_eq!(status, StatusCode::NOT_MODIFIED);
    assert!(body.is_empty());
    let (status, _, _) = fetch("/", &[("if-none-match", "\"0000000000000000\"")]).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn unknown_files_are_not_routed() {
    let res =
        router::<()>().oneshot(Request::get("/assets/nope.js").body(Body::empty()).unwrap()).await.unwrap();
    assert_eq!(res.status(), StatusCode::NOT_FOUND);
}
