//! The sidecar's HTTP face: `GET /v1/feed?since=N[&epoch=E]` (binary, `mmrouter::feed`),
//! `GET /v1/state` (JSON for people), `GET /metrics` (Prometheus), `GET /health`.

use crate::log;
use crate::registry::{FeedKind, Registry};
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

pub async fn serve(
    listener: tokio::net::TcpListener,
    registry: Arc<Mutex<Registry>>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            biased;
            _ = &mut shutdown => break,
            a = listener.accept() => a,
        };
        let (stream, _) = match accepted {
            Ok(s) => s,
            Err(e) => {
                log!("accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let registry = registry.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let registry = registry.clone();
                async move { Ok::<_, Infallible>(route(&registry, &req)) }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

fn respond(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

fn text(status: StatusCode, body: impl Into<String>) -> Response<Full<Bytes>> {
    respond(status, "text/plain; charset=utf-8", body.into())
}

/// The value of `key` in a query string.
fn query_param<'a>(query: &'a str, key: &str) -> Option<&'a str> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('=').or(Some((kv, ""))))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
}

/// `since` and `epoch` of a feed request (both default to 0 / none).
pub fn feed_params(query: &str) -> Result<(u64, Option<u64>), String> {
    let since = match query_param(query, "since") {
        None | Some("") => 0,
        Some(v) => v
            .parse()
            .map_err(|_| format!("since: `{v}` is not an unsigned integer"))?,
    };
    let epoch = match query_param(query, "epoch") {
        None | Some("") => None,
        Some(v) => Some(
            v.parse()
                .map_err(|_| format!("epoch: `{v}` is not an unsigned integer"))?,
        ),
    };
    Ok((since, epoch))
}

fn route(registry: &Mutex<Registry>, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n");
    }
    let lock = || registry.lock().unwrap_or_else(|e| e.into_inner());
    match req.uri().path() {
        "/v1/feed" => {
            let (since, epoch) = match feed_params(req.uri().query().unwrap_or("")) {
                Ok(p) => p,
                Err(e) => return text(StatusCode::BAD_REQUEST, format!("{e}\n")),
            };
            let (feed, kind) = lock().feed(since, epoch);
            if kind == FeedKind::Snapshot && since != 0 {
                log!(
                    "feed: snapshot for since={since}: the cursor is from another run or \
                     older than the journal (now {})",
                    feed.cursor
                );
            }
            respond(
                StatusCode::OK,
                mmrouter::feed::CONTENT_TYPE,
                mmrouter::feed::encode(&feed),
            )
        }
        "/v1/state" => {
            let v = lock().state_json();
            let body = serde_json::to_vec_pretty(&v).unwrap_or_default();
            respond(StatusCode::OK, "application/json", body)
        }
        "/metrics" => {
            let mut body = lock().prometheus();
            body.push_str(&crate::dns_guard::prometheus());
            respond(
                StatusCode::OK,
                "text/plain; version=0.0.4; charset=utf-8",
                body,
            )
        }
        "/health" => text(StatusCode::OK, "ok\n"),
        other => text(StatusCode::NOT_FOUND, format!("no route {other}\n")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn feed_parameters() {
        assert_eq!(feed_params(""), Ok((0, None)));
        assert_eq!(feed_params("since=42"), Ok((42, None)));
        assert_eq!(feed_params("epoch=7&since=42&x=1"), Ok((42, Some(7))));
        assert!(feed_params("since=-1").unwrap_err().contains("since"));
        assert!(
            feed_params("since=1&epoch=z")
                .unwrap_err()
                .contains("epoch")
        );
    }
}
