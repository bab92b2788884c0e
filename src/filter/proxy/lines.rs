//! What the filter writes to Envoy's log: the state plane's events, and what the URL fetches of
//! a decision did (the `[ROUTING]` line itself is `Decision::log_line`). Only numbers,
//! validated worker names and fixed words: nothing from a request reaches the log.

use super::Shared;
use super::host::log;
use crate::filter::events::Event;
use crate::filter::fetch::Plan;
use crate::filter::router::Decision;
use proxy_wasm::types::LogLevel;

impl Shared {
    pub(super) fn log_events(&self, events: &[Event]) {
        for e in events {
            self.metrics.event(e);
            let line = match e {
                Event::BecameWriter => Some((
                    LogLevel::Info,
                    "this VM now writes the shared state".to_string(),
                )),
                Event::Joined { name, address } => {
                    Some((LogLevel::Info, format!("worker {name} joined at {address}")))
                }
                Event::Left { name } => Some((LogLevel::Info, format!("worker {name} left"))),
                Event::Poll {
                    name,
                    ok: false,
                    why,
                    transition: true,
                } => Some((
                    LogLevel::Warn,
                    format!(
                        "worker {name} is unhealthy: its polls fail: {}",
                        why.as_deref().unwrap_or("?")
                    ),
                )),
                Event::Poll {
                    name,
                    ok: true,
                    transition: true,
                    ..
                } => Some((LogLevel::Info, format!("worker {name} is healthy again"))),
                Event::Feed { ok: false, why } => Some((
                    LogLevel::Warn,
                    format!(
                        "sidecar feed poll failed: {}",
                        why.as_deref().unwrap_or("?")
                    ),
                )),
                Event::Precise(true) => Some((
                    LogLevel::Info,
                    "sidecar feed fresh: routing in precise mode".to_string(),
                )),
                Event::Precise(false) => Some((
                    LogLevel::Warn,
                    "sidecar feed stale or gone: routing in approximate mode".to_string(),
                )),
                _ => None,
            };
            if let Some((level, line)) = line {
                log(level, &line);
            }
        }
    }
}

/// `; images by URL: 1 fetched, 1 cached, 1 failed (no_response)`.
pub(super) fn fetch_line(plan: &Plan) -> String {
    let (fetched, cached, failed) = plan.counts();
    if fetched + cached + failed == 0 {
        return String::new();
    }
    let mut line = format!("; images by URL: {fetched} fetched, {cached} cached, {failed} failed");
    let reasons: Vec<&str> = plan.failures().iter().map(|f| f.reason()).collect();
    if !reasons.is_empty() {
        line.push_str(&format!(" ({})", reasons.join(", ")));
    }
    line
}

/// `[SPEED] w1: measured 15234 tokens/s (2345 uncached tokens, first chunk after 154.0 ms on
/// an empty queue)`: a probe of the worker's prefill speed (`Router::measure_speed`).
pub(super) fn speed_line(d: &Decision, tps: f64) -> String {
    let (tokens, ms) = d.speed_probe.map_or((0, 0.0), |p| {
        (
            p.tokens,
            p.tokens as f64 / tps.max(f64::MIN_POSITIVE) * 1000.0,
        )
    });
    format!(
        "[SPEED] {}: measured {tps:.0} tokens/s ({tokens} uncached tokens, first chunk after {ms:.1} ms on an empty queue)",
        d.target.name
    )
}
