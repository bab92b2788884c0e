//! The filter's metrics, defined through proxy-wasm and visible in Envoy's `/stats` and
//! `/stats/prometheus`.
//!
//! proxy-wasm metrics have no tags, so the worker and the fallback reason are part of the name;
//! `envoy/render.py` turns them back into Prometheus labels with `stats_tags`:
//!
//! | name | kind | meaning |
//! |---|---|---|
//! | `mmrouter.requests` | counter | POSTs on routed paths |
//! | `mmrouter.routed.<worker>` | counter | requests sent to each worker |
//! | `mmrouter.fallback.<reason>` | counter | requests routed to the least-loaded worker because the body could not be used: `too_large`, `no_body`, `encoded_body`, `bad_json`, `bad_shape`, `bad_request`, `bad_base64`, `bad_image`, `bad_image_size`, `bad_profile` |
//! | `mmrouter.no_worker` | counter | requests that found no worker known yet (Envoy's default route took them) |
//! | `mmrouter.images` | counter | media items analysed (hashed) |
//! | `mmrouter.blocks_total` / `mmrouter.blocks_matched` | counter | request blocks, and blocks the chosen worker already held: their ratio is the fleet's overlap |
//! | `mmrouter.overlap_percent` | histogram | matched/total blocks per routed request, in percent |
//! | `mmrouter.moved` | counter | requests sent away from the worker holding the longest match, because its wait cost more than the recompute |
//! | `mmrouter.routed_precise` / `mmrouter.routed_approximate` | counter | decisions made with the sidecar's feed fresh, and without it (with a sidecar configured, the second counts the time it was stale or gone) |
//! | `mmrouter.state_unrecorded` | counter | decisions whose load update or decision record was lost |
//! | `mmrouter.decisions_applied` | counter | decisions the state writer applied to the shared block buckets |
//! | `mmrouter.polls_ok` / `mmrouter.polls_failed` | counter | `/metrics` polls of the workers that gave vLLM metrics, and those that did not |
//! | `mmrouter.feed_ok` / `mmrouter.feed_failed` | counter | polls of the sidecar's feed |
//! | `mmrouter.workers_joined` / `mmrouter.workers_left` | counter | membership changes |
//! | `mmrouter.uuids_stamped` | counter | image parts given vLLM's `uuid` (the router's content id) |
//! | `mmrouter.parts_skipped` | counter | content parts of an unknown or unsupported shape, skipped (the rest of the body keeps its cache affinity) |
//! | `mmrouter.fetched` / `mmrouter.fetch_cached` | counter | images by URL identified by their bytes: fetched by this request, or found in the shared URL cache |
//! | `mmrouter.fetch_failed.<reason>` | counter | images by URL that fell back to the URL identity and estimated size: `no_response` (reset, connect failure, timeout), `status`, `too_large`, `not_image`, `deadline` |
//! | `mmrouter.fetch_refused.<reason>` | counter | images by URL the SSRF guard did not fetch: `scheme`, `bad_url`, `credentials`, `not_allowed`, `private_address`, `local_name`, `resolved_special_address` (a name Envoy's guard listener resolved to a special-use address), `too_many` |
//! | `mmrouter.fetch_waited` | counter | requests that waited for another request's fetch of one of their URLs |
//! | `mmrouter.vm_memory_bytes.<vm>` | gauge | each VM's Wasm linear memory (its high-water mark: it never shrinks), set on its tick; `<vm>` is a per-VM random id |

use super::events::Event;
use super::fetch::{Failure, Plan};
use super::router::Decision;
use proxy_wasm::hostcalls::{define_metric, increment_metric, record_metric};
use proxy_wasm::types::MetricType;
use std::collections::HashMap;

pub struct Metrics {
    requests: Option<u32>,
    routed: HashMap<String, Option<u32>>,
    fallbacks: HashMap<&'static str, Option<u32>>,
    no_worker: Option<u32>,
    images: Option<u32>,
    blocks_total: Option<u32>,
    blocks_matched: Option<u32>,
    overlap: Option<u32>,
    moved: Option<u32>,
    precise: Option<u32>,
    approximate: Option<u32>,
    unrecorded: Option<u32>,
    applied: Option<u32>,
    polls_ok: Option<u32>,
    polls_failed: Option<u32>,
    feed_ok: Option<u32>,
    feed_failed: Option<u32>,
    joined: Option<u32>,
    left: Option<u32>,
    vm_memory: Option<u32>,
    stamped: Option<u32>,
    skipped: Option<u32>,
    fetched: Option<u32>,
    fetch_cached: Option<u32>,
    fetch_waited: Option<u32>,
    fetch_failures: HashMap<&'static str, Option<u32>>,
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
    /// `vm` names this VM in the per-VM gauges.
    pub fn define(vm: u64) -> Metrics {
        Metrics {
            requests: counter("mmrouter.requests"),
            routed: HashMap::new(),
            fallbacks: HashMap::new(),
            no_worker: counter("mmrouter.no_worker"),
            images: counter("mmrouter.images"),
            blocks_total: counter("mmrouter.blocks_total"),
            blocks_matched: counter("mmrouter.blocks_matched"),
            overlap: define_metric(MetricType::Histogram, "mmrouter.overlap_percent").ok(),
            moved: counter("mmrouter.moved"),
            precise: counter("mmrouter.routed_precise"),
            approximate: counter("mmrouter.routed_approximate"),
            unrecorded: counter("mmrouter.state_unrecorded"),
            applied: counter("mmrouter.decisions_applied"),
            polls_ok: counter("mmrouter.polls_ok"),
            polls_failed: counter("mmrouter.polls_failed"),
            feed_ok: counter("mmrouter.feed_ok"),
            feed_failed: counter("mmrouter.feed_failed"),
            joined: counter("mmrouter.workers_joined"),
            left: counter("mmrouter.workers_left"),
            stamped: counter("mmrouter.uuids_stamped"),
            skipped: counter("mmrouter.parts_skipped"),
            fetched: counter("mmrouter.fetched"),
            fetch_cached: counter("mmrouter.fetch_cached"),
            fetch_waited: counter("mmrouter.fetch_waited"),
            fetch_failures: HashMap::new(),
            vm_memory: define_metric(
                MetricType::Gauge,
                &format!("mmrouter.vm_memory_bytes.{:08x}", vm as u32),
            )
            .ok(),
        }
    }

    /// Records this VM's linear memory.
    pub fn vm_memory(&self) {
        if let Some(id) = self.vm_memory {
            let pages = core::arch::wasm32::memory_size(0) as u64;
            let _ = record_metric(id, pages * 65536);
        }
    }

    pub fn stamped(&self, n: usize) {
        add(self.stamped, n as u64);
    }

    pub fn skipped(&self, n: usize) {
        add(self.skipped, n as u64);
    }

    /// A request's images by URL, once it is routed.
    pub fn fetch(&mut self, plan: &Plan, waited: bool) {
        let (fetched, cached, _) = plan.counts();
        add(self.fetched, fetched as u64);
        add(self.fetch_cached, cached as u64);
        if waited {
            add(self.fetch_waited, 1);
        }
        for failure in plan.failures() {
            let name = match failure {
                Failure::Refused(_) => "fetch_refused",
                _ => "fetch_failed",
            };
            let reason = failure.reason();
            let id = *self
                .fetch_failures
                .entry(reason)
                .or_insert_with(|| counter(&format!("mmrouter.{name}.{reason}")));
            add(id, 1);
        }
    }

    pub fn request(&self) {
        add(self.requests, 1);
    }

    pub fn no_worker(&self) {
        add(self.no_worker, 1);
    }

    pub fn event(&self, e: &Event) {
        match e {
            Event::Poll { ok: true, .. } => add(self.polls_ok, 1),
            Event::Poll { ok: false, .. } => add(self.polls_failed, 1),
            Event::Feed { ok: true, .. } => add(self.feed_ok, 1),
            Event::Feed { ok: false, .. } => add(self.feed_failed, 1),
            Event::Joined { .. } => add(self.joined, 1),
            Event::Left { .. } => add(self.left, 1),
            Event::Drained { decisions, .. } => add(self.applied, *decisions),
            Event::BecameWriter | Event::Precise(_) => {}
        }
    }

    pub fn routed(&mut self, d: &Decision, sidecar: bool) {
        let name = d.target.name.as_str();
        let id = match self.routed.get(name) {
            Some(id) => *id,
            None => {
                let id = counter(&format!("mmrouter.routed.{name}"));
                self.routed.insert(name.to_string(), id);
                id
            }
        };
        add(id, 1);
        add(self.images, d.media as u64);
        if !d.recorded {
            add(self.unrecorded, 1);
        }
        if sidecar {
            add(
                if d.precise {
                    self.precise
                } else {
                    self.approximate
                },
                1,
            );
        }
        match d.fallback {
            Some(why) => {
                let reason = why.reason();
                let id = *self
                    .fallbacks
                    .entry(reason)
                    .or_insert_with(|| counter(&format!("mmrouter.fallback.{reason}")));
                add(id, 1);
            }
            None => {
                add(self.blocks_total, d.total_blocks as u64);
                add(self.blocks_matched, d.matched_blocks as u64);
                if d.passed_over.is_some() {
                    add(self.moved, 1);
                }
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
