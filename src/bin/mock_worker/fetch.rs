//! Fetching image URLs, as vLLM's `MediaConnector` does.
//!
//! Only `http://` is supported (hyper 1 client over a plain TCP connection, one request per
//! connection, no redirects). `https://` is refused with a clear error: the mock carries no TLS
//! stack. The whole fetch (connect, headers, body) has a timeout of
//! `VLLM_IMAGE_FETCH_TIMEOUT` seconds (read from the environment, default 5 as in vLLM).

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::Request;
use hyper_util::rt::TokioIo;
use std::fmt;
use std::time::Duration;

/// Largest image accepted from a URL, in bytes.
pub const MAX_FETCH_BYTES: usize = 64 << 20;

#[derive(Debug, Clone, PartialEq)]
pub enum FetchError {
    /// `https://`: the mock has no TLS.
    HttpsUnsupported,
    /// Not an http(s) URL.
    UnsupportedScheme(String),
    BadUrl(String),
    Timeout(f64),
    Connect(String),
    Status(u16),
    Body(String),
}

impl fmt::Display for FetchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FetchError::HttpsUnsupported => f.write_str(
                "https:// image URLs are not supported by mock-worker (it has no TLS); \
                 use an http:// URL or a data: URL",
            ),
            FetchError::UnsupportedScheme(s) => write!(
                f,
                "unsupported image URL scheme `{s}`: expected http:// or data:"
            ),
            FetchError::BadUrl(u) => write!(f, "malformed image URL: {u}"),
            FetchError::Timeout(s) => write!(f, "timed out after {s} s fetching the image"),
            FetchError::Connect(e) => write!(f, "cannot connect to fetch the image: {e}"),
            FetchError::Status(s) => write!(f, "image fetch returned HTTP {s}"),
            FetchError::Body(e) => write!(f, "cannot read the image body: {e}"),
        }
    }
}

/// The fetch timeout: `VLLM_IMAGE_FETCH_TIMEOUT` seconds, default 5.
pub fn fetch_timeout() -> Duration {
    let secs = std::env::var("VLLM_IMAGE_FETCH_TIMEOUT")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(5.0);
    Duration::from_secs_f64(secs)
}

/// `(host, port, path-and-query)` of an `http://` URL.
pub fn split_http_url(url: &str) -> Result<(String, u16, String), FetchError> {
    let url = url.trim();
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(FetchError::BadUrl(url.into()));
    };
    match scheme.to_ascii_lowercase().as_str() {
        "http" => {}
        "https" => return Err(FetchError::HttpsUnsupported),
        other => return Err(FetchError::UnsupportedScheme(other.into())),
    }
    let rest = rest.split('#').next().unwrap_or(rest);
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let hostport = authority.rsplit('@').next().unwrap_or(authority);
    let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
        let (h, after) = v6
            .split_once(']')
            .ok_or_else(|| FetchError::BadUrl(url.into()))?;
        let port = match after.strip_prefix(':') {
            Some(p) => p.parse().map_err(|_| FetchError::BadUrl(url.into()))?,
            None => 80,
        };
        (h.to_string(), port)
    } else {
        match hostport.rsplit_once(':') {
            Some((h, p)) => (
                h.to_string(),
                p.parse().map_err(|_| FetchError::BadUrl(url.into()))?,
            ),
            None => (hostport.to_string(), 80),
        }
    };
    if host.is_empty() {
        return Err(FetchError::BadUrl(url.into()));
    }
    let path = if tail.is_empty() {
        "/".to_string()
    } else if tail.starts_with('?') {
        format!("/{tail}")
    } else {
        tail.to_string()
    };
    Ok((host, port, path))
}

/// Fetches an `http://` URL's body.
pub async fn fetch_http(url: &str) -> Result<Bytes, FetchError> {
    let (host, port, path) = split_http_url(url)?;
    let timeout = fetch_timeout();
    match tokio::time::timeout(timeout, get(&host, port, &path)).await {
        Ok(r) => r,
        Err(_) => Err(FetchError::Timeout(timeout.as_secs_f64())),
    }
}

async fn get(host: &str, port: u16, path: &str) -> Result<Bytes, FetchError> {
    let stream = tokio::net::TcpStream::connect((host, port))
        .await
        .map_err(|e| FetchError::Connect(e.to_string()))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| FetchError::Connect(e.to_string()))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let authority = if port == 80 {
        host.to_string()
    } else if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let req = Request::get(path)
        .header(hyper::header::HOST, authority)
        .header(hyper::header::USER_AGENT, "mock-worker")
        .body(Empty::<Bytes>::new())
        .map_err(|e| FetchError::BadUrl(e.to_string()))?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| FetchError::Connect(e.to_string()))?;
    let status = resp.status();
    if !status.is_success() {
        return Err(FetchError::Status(status.as_u16()));
    }
    let body = Limited::new(resp.into_body(), MAX_FETCH_BYTES)
        .collect()
        .await
        .map_err(|e| FetchError::Body(e.to_string()))?;
    Ok(body.to_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_split_into_host_port_path() {
        assert_eq!(
            split_http_url("http://127.0.0.1:9000/a.png?x=1#f"),
            Ok(("127.0.0.1".into(), 9000, "/a.png?x=1".into()))
        );
        assert_eq!(
            split_http_url("HTTP://example.com"),
            Ok(("example.com".into(), 80, "/".into()))
        );
        assert_eq!(
            split_http_url("http://[::1]:81?q"),
            Ok(("::1".into(), 81, "/?q".into()))
        );
        assert_eq!(
            split_http_url("https://example.com/a.png"),
            Err(FetchError::HttpsUnsupported)
        );
        assert!(matches!(
            split_http_url("ftp://x/y"),
            Err(FetchError::UnsupportedScheme(_))
        ));
        assert!(split_http_url("http://:80/").is_err());
        assert!(split_http_url("http://h:port/").is_err());
    }
}
