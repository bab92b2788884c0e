//! Scrapes one worker's `/metrics` every `--scrape-ms` over a kept-alive HTTP/1.1
//! connection, with a timeout; the result feeds health, load, capacity and prefill speed.

use crate::log;
use crate::registry::Registry;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::client::conn::http1::SendRequest;
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use mmrouter::worker_metrics::parse_vllm_scrape;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Largest `/metrics` body read (vLLM's is tens to hundreds of KiB with histograms).
pub const MAX_METRICS_BYTES: usize = 16 << 20;

/// A failed scrape is logged when it starts a streak, then every this many in a row.
const LOG_EVERY_FAILURES: u32 = 100;

/// One GET of `/metrics` on `conn` (connected first when there is none).
async fn fetch(
    conn: &mut Option<SendRequest<Empty<Bytes>>>,
    addr: SocketAddr,
) -> Result<String, String> {
    if conn.as_ref().is_none_or(|c| c.is_closed()) {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("cannot connect: {e}"))?;
        let _ = stream.set_nodelay(true);
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("HTTP handshake failed: {e}"))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        *conn = Some(sender);
    }
    let Some(sender) = conn.as_mut() else {
        return Err("no connection".into());
    };
    sender
        .ready()
        .await
        .map_err(|e| format!("connection lost: {e}"))?;
    let request = Request::get("/metrics")
        .header(hyper::header::HOST, addr.to_string())
        .body(Empty::<Bytes>::new())
        .map_err(|e| format!("bad request: {e}"))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("request failed: {e}"))?;
    let status = response.status();
    let body = Limited::new(response.into_body(), MAX_METRICS_BYTES)
        .collect()
        .await
        .map_err(|e| format!("reading the body failed: {e}"))?
        .to_bytes();
    if status != StatusCode::OK {
        return Err(format!("HTTP {status}"));
    }
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// Scrapes until the task is aborted (the worker left).
pub async fn run(
    name: Arc<str>,
    addr: SocketAddr,
    interval: Duration,
    timeout: Duration,
    registry: Arc<Mutex<Registry>>,
) {
    let mut conn = None;
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let result = match tokio::time::timeout(timeout, fetch(&mut conn, addr)).await {
            Ok(r) => r,
            Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
        };
        let result = result.and_then(|text| parse_vllm_scrape(&text).map_err(|e| e.to_string()));
        let mut reg = registry.lock().unwrap_or_else(|e| e.into_inner());
        match result {
            Ok(scrape) => {
                let recovered = reg.get(&name).map_or(0, |w| w.failures_in_row);
                if reg.scrape_ok(&name, scrape) {
                    let capacity = scrape
                        .num_gpu_blocks
                        .map_or("?".to_string(), |n| n.to_string());
                    let block = scrape.block_size.map_or("?".to_string(), |n| n.to_string());
                    log!("worker {name} {addr}: healthy ({capacity} blocks of {block} tokens)");
                } else if recovered > 0 {
                    log!("worker {name} {addr}: scrape ok again after {recovered} failures");
                }
            }
            Err(e) => {
                // Drop the connection: the next scrape starts a fresh one.
                conn = None;
                let turned = reg.scrape_failed(&name, e.clone());
                let n = reg.get(&name).map_or(0, |w| w.failures_in_row);
                if turned {
                    log!("worker {name} {addr}: unhealthy after {n} failed scrapes: {e}");
                } else if n == 1 || n.is_multiple_of(LOG_EVERY_FAILURES) {
                    log!("worker {name} {addr}: scrape failed ({n} in a row): {e}");
                }
            }
        }
    }
}
