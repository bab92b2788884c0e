//! The filter's metrics, defined through proxy-wasm and visible in Envoy's `/stats` and
//! `/stats/prometheus`.
//!
//! proxy-wasm metrics have no tags, so the worker and the fallback reason are part of the name;
//! `envoy/envoy.yaml` turns them back into Prometheus labels with `stats_tags`:
//!
//! | name | kind | meaning |
//! |---|---|---|
//! | `mmrouter.requests` | counter | POSTs on routed paths |
//! | `mmrouter.routed.<worker>` | counter | requests sent to each worker |
//! | `mmrouter.fallback.<reason>` | counter | requests routed to the least-loaded worker because the body could not be used: `too_large`, `no_body`, `bad_json`, `bad_shape`, `bad_request`, `bad_base64`, `bad_image`, `bad_image_size`, `bad_profile` |
//! | `mmrouter.images` | counter | media items analysed (hashed) |
//! | `mmrouter.blocks_total` / `mmrouter.blocks_matched` | counter | request blocks, and blocks the chosen worker already held: their ratio is the fleet's overlap |
//! | `mmrouter.overlap_percent` | histogram | matched/total blocks per routed request, in percent |
//! | `mmrouter.state_unrecorded` | counter | decisions whose shared load/log update was lost to contention |
//! | `mmrouter.log_skipped` | counter | logged decisions a VM skipped because it fell behind the ring |
//! | `mmrouter.polls_ok` / `mmrouter.polls_failed` | counter | `/metrics` polls of the workers that gave vLLM metrics, and those that did not (timeout, refused, non-200, garbage) |

use super::router::Decision;
use proxy_wasm::hostcalls::{define_metric, increment_metric, record_metric};
use proxy_wasm::types::MetricType;

pub struct Metrics {
    requests: Option<u32>,
    routed: Vec<Option<u32>>,
    fallbacks: Vec<(&'static str, Option<u32>)>,
    images: Option<u32>,
    blocks_total: Option<u32>,
    blocks_matched: Option<u32>,
    overlap: Option<u32>,
    unrecorded: Option<u32>,
    skipped: Option<u32>,
    polls_ok: Option<u32>,
    polls_failed: Option<u32>,
}

fn counter(name: &str) -> Option<u32> {
    define_metric(MetricType::Counter, name).ok()
}

fn add(id: Option<u32>, n: u64) {
    if let Some(id) = id
        && n > 0
    {
        let _ = increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX));
    }
}

impl Metrics {
    pub fn define(workers: &[&str]) -> Metrics {
        Metrics {
            requests: counter("mmrouter.requests"),
            routed: workers
                .iter()
                .map(|w| counter(&format!("mmrouter.routed.{w}")))
                .collect(),
            fallbacks: Vec::new(),
            images: counter("mmrouter.images"),
            blocks_total: counter("mmrouter.blocks_total"),
            blocks_matched: counter("mmrouter.blocks_matched"),
            overlap: define_metric(MetricType::Histogram, "mmrouter.overlap_percent").ok(),
            unrecorded: counter("mmrouter.state_unrecorded"),
            skipped: counter("mmrouter.log_skipped"),
            polls_ok: counter("mmrouter.polls_ok"),
            polls_failed: counter("mmrouter.polls_failed"),
        }
    }

    pub fn request(&self) {
        add(self.requests, 1);
    }

    pub fn poll(&self, ok: bool) {
        add(if ok { self.polls_ok } else { self.polls_failed }, 1);
    }

    pub fn log_skipped(&self, n: u64) {
        add(self.skipped, n);
    }

    pub fn routed(&mut self, d: &Decision) {
        add(self.routed.get(d.worker).copied().flatten(), 1);
        add(self.images, d.media as u64);
        if !d.recorded {
            add(self.unrecorded, 1);
        }
        match d.fallback {
            Some(why) => {
                let reason = why.reason();
                let id = match self.fallbacks.iter().find(|(r, _)| *r == reason) {
                    Some((_, id)) => *id,
                    None => {
                        let id = counter(&format!("mmrouter.fallback.{reason}"));
                        self.fallbacks.push((reason, id));
                        id
                    }
                };
                add(id, 1);
            }
            None => {
                add(self.blocks_total, d.total_blocks as u64);
                add(self.blocks_matched, d.matched_blocks as u64);
                if d.total_blocks > 0
                    && let Some(id) = self.overlap
                {
                    let pct = (d.matched_blocks * 100 / d.total_blocks) as u64;
                    let _ = record_metric(id, pct);
                }
            }
        }
    }
}
