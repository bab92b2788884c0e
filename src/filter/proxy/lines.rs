//! What the filter writes to Envoy's log: the state plane's events, and the `[ROUTING]` line
//! of every decision. Only numbers, validated worker names and fixed words: nothing from a
//! request reaches the log.

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

/// The `[ROUTING]` log line: what was chosen and what it was weighed against. Only numbers,
/// validated worker names and fixed words: nothing from the request reaches the log.
pub(super) fn decision_line(d: &Decision) -> String {
    match d.fallback {
        Some(why) => format!(
            "[ROUTING] Fallback: {} (least loaded), reason {}",
            d.target.name,
            why.reason()
        ),
        None => {
            let e = d.estimate;
            let mut line = format!(
                "[ROUTING] Best: {} with {}/{} blocks overlap; wait {:.1} ms, prefill {:.1} ms, recompute {:.1} ms ({})",
                d.target.name,
                d.matched_blocks,
                d.total_blocks,
                e.wait_s * 1e3,
                e.prefill_s * 1e3,
                e.recompute_s * 1e3,
                if d.precise { "precise" } else { "approximate" },
            );
            if d.home {
                line.push_str("; its group's home");
            }
            if let Some((name, matched, alt)) = &d.passed_over {
                line.push_str(&format!(
                    "; passed over {name} with {matched}/{} blocks: wait {:.1} ms, cost {:.1} ms > {:.1} ms",
                    d.total_blocks,
                    alt.wait_s * 1e3,
                    alt.cost_s * 1e3,
                    e.cost_s * 1e3,
                ));
            }
            line
        }
    }
}
