//! The workers the sidecar knows and what it knows of each (membership, scrapes, event
//! stream, residency), with the journal of image-residency changes; one mutex guards it all.
//! It answers the three views: the binary feed, `/v1/state` JSON and Prometheus text.

use crate::journal::{Change, Journal};
use crate::membership::WorkerSpec;
use crate::residency::{Changes, ImageChanges, Residency};
use mmrouter::feed::{AGE_NEVER, Feed, FeedWorker, ImageResidency};
use mmrouter::worker_metrics::{EngineScrape, PrefillSpeed};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// A worker's KV-event stream as seen so far.
#[derive(Debug, Default, Clone)]
pub struct EventStatus {
    /// The PUB endpoint subscribed to (None with `--no-events`).
    pub endpoint: Option<String>,
    pub replay_endpoint: Option<String>,
    /// A subscription is live.
    pub connected: bool,
    /// The last sequence number applied.
    pub seq: Option<u64>,
    /// Sequence gaps seen (a first message after the start of the stream counts).
    pub gaps: u32,
    /// Batches recovered through the replay endpoint.
    pub replayed: u64,
    /// Batches a gap lost for good (replay off, failed, or past the publisher's buffer).
    pub lost: u64,
    /// Batches applied (live and replayed).
    pub batches: u64,
    pub last_event: Option<Instant>,
    /// Connections made after the first one.
    pub reconnects: u64,
    pub decode_errors: u64,
    pub unknown_events: u64,
    /// Blocks in `BlockStored` / `BlockRemoved` events since the sidecar started.
    pub stored_total: u64,
    pub removed_total: u64,
    /// `AllBlocksCleared` events, and engine restarts (seen from the events or the scrapes):
    /// each tells the filter that the worker's cache is empty.
    pub cleared_total: u32,
    /// The publisher's sequence went backwards (it restarted): residency was cleared.
    pub publisher_restarts: u32,
    /// The engine's `vllm:prompt_tokens_total` went backwards between two good scrapes (it
    /// restarted) with no clear from the event stream in between: residency was cleared.
    pub scrape_restarts: u32,
    /// The event stream cleared the residency since the last good scrape (a restart seen there
    /// first is not cleared again by the scrape, which would drop what was stored since).
    pub cleared_since_scrape: bool,
}

/// Everything known of one worker.
pub struct WorkerState {
    pub name: Arc<str>,
    pub spec: WorkerSpec,
    pub joined: Instant,
    pub scrape: Option<EngineScrape>,
    pub last_ok: Option<Instant>,
    pub failures_in_row: u32,
    pub scrapes_total: u64,
    pub scrape_failures_total: u64,
    pub last_error: Option<String>,
    pub prefill: PrefillSpeed,
    last_scrape_at: Option<Instant>,
    pub events: EventStatus,
    pub residency: Residency,
}

/// Sidecar-wide counters for `/metrics`.
#[derive(Debug, Default)]
pub struct Counters {
    pub feed_snapshots: u64,
    pub feed_deltas: u64,
    pub joins: u64,
    pub leaves: u64,
}

pub struct Registry {
    pub epoch: u64,
    started: Instant,
    workers: BTreeMap<Arc<str>, WorkerState>,
    journal: Journal,
    max_blocks: usize,
    unhealthy_after: u32,
    pub sources: Vec<String>,
    pub counters: Counters,
}

/// A random u64 (std's per-process random hasher keys, the clock and the pid).
pub fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish()
}

pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn ms_since(t: Option<Instant>, now: Instant) -> Option<u64> {
    t.map(|t| now.saturating_duration_since(t).as_millis() as u64)
}

/// Why a feed was a snapshot (for the log and `/metrics`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeedKind {
    Delta,
    Snapshot,
}

impl Registry {
    pub fn new(max_blocks: usize, journal_entries: usize, unhealthy_after: u32) -> Registry {
        let epoch = random_u64() | 1;
        // Cursors of this run start at a random point in [2^32, 2^62).
        let base = (1u64 << 32) + random_u64() % ((1u64 << 62) - (1u64 << 32));
        Registry {
            epoch,
            started: Instant::now(),
            workers: BTreeMap::new(),
            journal: Journal::new(base, journal_entries),
            max_blocks,
            unhealthy_after: unhealthy_after.max(1),
            sources: Vec::new(),
            counters: Counters::default(),
        }
    }

    #[cfg(test)]
    pub fn cursor(&self) -> u64 {
        self.journal.cursor()
    }

    pub fn get(&self, name: &str) -> Option<&WorkerState> {
        self.workers.get(name)
    }

    /// Adds a worker (replacing one of the same name) and returns its shared name.
    pub fn join(
        &mut self,
        spec: WorkerSpec,
        events: Option<String>,
        replay: Option<String>,
    ) -> Arc<str> {
        if self.workers.contains_key(spec.name.as_str()) {
            self.leave(&spec.name);
        }
        let name: Arc<str> = Arc::from(spec.name.as_str());
        self.counters.joins += 1;
        self.workers.insert(
            name.clone(),
            WorkerState {
                name: name.clone(),
                spec,
                joined: Instant::now(),
                scrape: None,
                last_ok: None,
                failures_in_row: 0,
                scrapes_total: 0,
                scrape_failures_total: 0,
                last_error: None,
                prefill: PrefillSpeed::new(),
                last_scrape_at: None,
                events: EventStatus {
                    endpoint: events,
                    replay_endpoint: replay,
                    ..EventStatus::default()
                },
                residency: Residency::new(self.max_blocks),
            },
        );
        name
    }

    /// Drops a worker and its state; its images are journaled as gone, so a poller that
    /// sees the name again (a new worker under an old name) starts it from nothing.
    pub fn leave(&mut self, name: &str) -> bool {
        let Some(w) = self.workers.remove(name) else {
            return false;
        };
        self.counters.leaves += 1;
        let mut images: Vec<u64> = w.residency.images().map(|(k, _)| k).collect();
        images.sort_unstable();
        for image in images {
            self.journal.push(Change {
                worker: w.name.clone(),
                image,
                blocks: 0,
            });
        }
        true
    }

    /// Runs `f` on a worker's state and journals the image changes it returns.
    pub fn update<R>(
        &mut self,
        name: &str,
        f: impl FnOnce(&mut WorkerState) -> (R, ImageChanges),
    ) -> Option<R> {
        let w = self.workers.get_mut(name)?;
        let (r, changes) = f(w);
        let worker = w.name.clone();
        for (image, blocks) in changes {
            self.journal.push(Change {
                worker: worker.clone(),
                image,
                blocks,
            });
        }
        Some(r)
    }

    /// Records a good scrape. Returns true when the worker turned healthy with it.
    pub fn scrape_ok(&mut self, name: &str, s: EngineScrape) -> bool {
        let max_blocks = self.max_blocks;
        let unhealthy_after = self.unhealthy_after;
        self.update(name, |w| {
            let now = Instant::now();
            let was = w.healthy(unhealthy_after);
            let elapsed = ms_since(w.last_scrape_at, now).unwrap_or(0) as f64;
            if let Some(c) = s.prefill {
                w.prefill.observe(c, elapsed);
            }
            let mut changes = Changes::default();
            // A restarted engine comes back with an empty cache; its counters start again.
            // Seen here at the scrape that makes it healthy again, before any request reaches
            // it, while its first KV event comes only after one did.
            let went_back = matches!(
                (w.scrape.and_then(|old| old.prefill), s.prefill),
                (Some(old), Some(new)) if new.prompt_tokens < old.prompt_tokens
            );
            if went_back && !w.events.cleared_since_scrape {
                w.events.scrape_restarts += 1;
                w.events.cleared_total = w.events.cleared_total.saturating_add(1);
                // The new publisher numbers from 0 again.
                w.events.seq = None;
                w.residency.clear(&mut changes);
            }
            w.events.cleared_since_scrape = false;
            w.last_scrape_at = Some(now);
            w.scrapes_total += 1;
            w.failures_in_row = 0;
            w.last_ok = Some(now);
            w.last_error = None;
            w.scrape = Some(s);
            let limit = match s.num_gpu_blocks {
                Some(n) if n > 0 => max_blocks.min(usize::try_from(n).unwrap_or(usize::MAX)),
                _ => max_blocks,
            };
            if limit != w.residency.limit() {
                w.residency.set_limit(limit, &mut changes);
            }
            (!was, changes.finish(&w.residency))
        })
        .unwrap_or(false)
    }

    /// Records a failed scrape. Returns true when the worker turned unhealthy with it.
    pub fn scrape_failed(&mut self, name: &str, error: String) -> bool {
        let unhealthy_after = self.unhealthy_after;
        self.update(name, |w| {
            let was = w.healthy(unhealthy_after);
            w.last_scrape_at = Some(Instant::now());
            w.scrapes_total += 1;
            w.scrape_failures_total += 1;
            w.failures_in_row = w.failures_in_row.saturating_add(1);
            w.last_error = Some(error);
            (was && !w.healthy(unhealthy_after), Vec::new())
        })
        .unwrap_or(false)
    }

    /// The feed for a poller at `since` (and, when it says, at `epoch`).
    pub fn feed(&mut self, since: u64, epoch: Option<u64>) -> (Feed, FeedKind) {
        let now = Instant::now();
        let index: BTreeMap<&str, u32> = self
            .workers
            .keys()
            .enumerate()
            .map(|(i, k)| (&**k, i as u32))
            .collect();
        let delta = if since == 0 || epoch.is_some_and(|e| e != self.epoch) {
            None
        } else {
            self.journal.since(since)
        };
        let (snapshot, images) = match delta {
            Some(changes) => (
                false,
                changes
                    .into_iter()
                    .filter_map(|c| {
                        index.get(&*c.worker).map(|&worker| ImageResidency {
                            worker,
                            image: c.image,
                            blocks: c.blocks,
                        })
                    })
                    .collect(),
            ),
            None => {
                let mut all = Vec::new();
                for (i, w) in self.workers.values().enumerate() {
                    let mut imgs: Vec<(u64, u32)> = w.residency.images().collect();
                    imgs.sort_unstable();
                    all.extend(imgs.into_iter().map(|(image, blocks)| ImageResidency {
                        worker: i as u32,
                        image,
                        blocks,
                    }));
                }
                (true, all)
            }
        };
        let workers = self
            .workers
            .values()
            .map(|w| w.feed_worker(now, self.unhealthy_after))
            .collect();
        if snapshot {
            self.counters.feed_snapshots += 1;
        } else {
            self.counters.feed_deltas += 1;
        }
        let kind = if snapshot {
            FeedKind::Snapshot
        } else {
            FeedKind::Delta
        };
        (
            Feed {
                snapshot,
                epoch: self.epoch,
                cursor: self.journal.cursor(),
                now_ms: unix_ms(),
                workers,
                images,
            },
            kind,
        )
    }

    /// `/v1/state`.
    pub fn state_json(&self) -> Value {
        let now = Instant::now();
        let workers: Vec<Value> = self
            .workers
            .values()
            .map(|w| w.state_json(now, self.unhealthy_after))
            .collect();
        json!({
            "workers": workers,
            "epoch": self.epoch,
            "cursor": self.journal.cursor(),
            "membership": self.sources,
            "uptime_ms": now.saturating_duration_since(self.started).as_millis() as u64,
            "journal": {
                "entries": self.journal.len(),
                "capacity": self.journal.capacity(),
                "oldest_cursor": self.journal.oldest(),
            },
            "max_blocks_per_worker": self.max_blocks,
        })
    }

    /// The sidecar's own Prometheus metrics.
    pub fn prometheus(&self) -> String {
        let now = Instant::now();
        let mut out = String::with_capacity(1024 + 1024 * self.workers.len());
        let w = &mut out;
        let simple = |w: &mut String, name: &str, kind: &str, help: &str, v: f64| {
            let _ = writeln!(w, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        };
        simple(
            w,
            "mmrouter_sidecar_workers",
            "gauge",
            "Workers in the membership.",
            self.workers.len() as f64,
        );
        simple(
            w,
            "mmrouter_sidecar_uptime_seconds",
            "gauge",
            "Seconds since the sidecar started.",
            now.saturating_duration_since(self.started).as_secs_f64(),
        );
        simple(
            w,
            "mmrouter_sidecar_joins_total",
            "counter",
            "Workers that joined.",
            self.counters.joins as f64,
        );
        simple(
            w,
            "mmrouter_sidecar_leaves_total",
            "counter",
            "Workers that left.",
            self.counters.leaves as f64,
        );
        let _ = writeln!(
            w,
            "# HELP mmrouter_sidecar_feed_requests_total Feed answers by kind.\n\
             # TYPE mmrouter_sidecar_feed_requests_total counter\n\
             mmrouter_sidecar_feed_requests_total{{kind=\"snapshot\"}} {}\n\
             mmrouter_sidecar_feed_requests_total{{kind=\"delta\"}} {}",
            self.counters.feed_snapshots, self.counters.feed_deltas
        );
        simple(
            w,
            "mmrouter_sidecar_journal_entries",
            "gauge",
            "Image-residency changes held for feed deltas.",
            self.journal.len() as f64,
        );
        type Getter = fn(&WorkerState, Instant, u32) -> f64;
        let per_worker: [(&str, &str, &str, Getter); 14] = [
            (
                "mmrouter_sidecar_worker_healthy",
                "gauge",
                "1 when the last scrapes succeeded.",
                |w, _, u| f64::from(u8::from(w.healthy(u))),
            ),
            (
                "mmrouter_sidecar_worker_metrics_age_seconds",
                "gauge",
                "Seconds since the last good scrape (absent: never).",
                |w, now, _| ms_since(w.last_ok, now).map_or(f64::NAN, |ms| ms as f64 / 1000.0),
            ),
            (
                "mmrouter_sidecar_worker_scrapes_total",
                "counter",
                "Scrapes of the worker's /metrics.",
                |w, _, _| w.scrapes_total as f64,
            ),
            (
                "mmrouter_sidecar_worker_scrape_failures_total",
                "counter",
                "Failed scrapes.",
                |w, _, _| w.scrape_failures_total as f64,
            ),
            (
                "mmrouter_sidecar_worker_events_connected",
                "gauge",
                "1 while a KV-event subscription is live.",
                |w, _, _| f64::from(u8::from(w.events.connected)),
            ),
            (
                "mmrouter_sidecar_worker_event_batches_total",
                "counter",
                "KV-event batches applied.",
                |w, _, _| w.events.batches as f64,
            ),
            (
                "mmrouter_sidecar_worker_event_gaps_total",
                "counter",
                "KV-event sequence gaps.",
                |w, _, _| f64::from(w.events.gaps),
            ),
            (
                "mmrouter_sidecar_worker_event_replayed_total",
                "counter",
                "Batches recovered by replay.",
                |w, _, _| w.events.replayed as f64,
            ),
            (
                "mmrouter_sidecar_worker_event_lost_total",
                "counter",
                "Batches lost in gaps.",
                |w, _, _| w.events.lost as f64,
            ),
            (
                "mmrouter_sidecar_worker_event_reconnects_total",
                "counter",
                "KV-event reconnections.",
                |w, _, _| w.events.reconnects as f64,
            ),
            (
                "mmrouter_sidecar_worker_event_decode_errors_total",
                "counter",
                "KV-event messages that did not decode.",
                |w, _, _| w.events.decode_errors as f64,
            ),
            (
                "mmrouter_sidecar_worker_resident_blocks",
                "gauge",
                "Blocks resident per the events.",
                |w, _, _| w.residency.physical() as f64,
            ),
            (
                "mmrouter_sidecar_worker_resident_images",
                "gauge",
                "Images with a resident block.",
                |w, _, _| w.residency.image_count() as f64,
            ),
            (
                "mmrouter_sidecar_worker_blocks_dropped_by_bound_total",
                "counter",
                "Resident blocks dropped by the memory bound.",
                |w, _, _| w.residency.dropped_by_bound() as f64,
            ),
        ];
        for (name, kind, help, get) in per_worker {
            let _ = writeln!(w, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for ws in self.workers.values() {
                let v = get(ws, now, self.unhealthy_after);
                if v.is_finite() {
                    let _ = writeln!(w, "{name}{{worker=\"{}\"}} {v}", ws.name);
                }
            }
        }
        out
    }
}

impl WorkerState {
    pub fn healthy(&self, unhealthy_after: u32) -> bool {
        self.last_ok.is_some() && self.failures_in_row < unhealthy_after
    }

    fn feed_worker(&self, now: Instant, unhealthy_after: u32) -> FeedWorker {
        let s = self.scrape.unwrap_or_default();
        let age = ms_since(self.last_ok, now).map_or(AGE_NEVER, |ms| {
            u32::try_from(ms)
                .unwrap_or(AGE_NEVER - 1)
                .min(AGE_NEVER - 1)
        });
        FeedWorker {
            name: self.name.to_string(),
            address: self.spec.addr.to_string(),
            healthy: self.healthy(unhealthy_after),
            metrics_valid: self.scrape.is_some(),
            events_connected: self.events.connected,
            capacity: s
                .num_gpu_blocks
                .map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX)),
            block_size: s
                .block_size
                .map_or(0, |n| u16::try_from(n).unwrap_or(u16::MAX)),
            waiting: s.load.waiting as f32,
            running: s.load.running as f32,
            kv_usage: s.load.kv_usage as f32,
            prefill_tps: self.prefill.tokens_per_sec().unwrap_or(0.0) as f32,
            metrics_age_ms: age,
            resident: u32::try_from(self.residency.physical()).unwrap_or(u32::MAX),
            stored_total: self.events.stored_total,
            removed_total: self.events.removed_total,
            cleared_total: self.events.cleared_total,
            event_gaps: self.events.gaps,
        }
    }

    fn state_json(&self, now: Instant, unhealthy_after: u32) -> Value {
        let s = self.scrape;
        let e = &self.events;
        json!({
            "name": &*self.name,
            "address": self.spec.addr.to_string(),
            "blocks": self.residency.physical(),
            "distinct_blocks": self.residency.distinct(),
            "images": self.residency.image_count(),
            "healthy": self.healthy(unhealthy_after),
            "metrics": s.map(|s| json!({
                "waiting": s.load.waiting,
                "running": s.load.running,
                "kv_usage": s.load.kv_usage,
                "prefill_tps": self.prefill.tokens_per_sec().unwrap_or(0.0),
            })),
            "capacity": s.and_then(|s| s.num_gpu_blocks),
            "block_size": s.and_then(|s| s.block_size),
            "metrics_age_ms": ms_since(self.last_ok, now),
            "events_age_ms": ms_since(e.last_event, now),
            "joined_ms_ago": now.saturating_duration_since(self.joined).as_millis() as u64,
            "scrape": {
                "total": self.scrapes_total,
                "failures": self.scrape_failures_total,
                "failures_in_row": self.failures_in_row,
                "last_error": self.last_error,
            },
            "events": {
                "endpoint": e.endpoint,
                "replay_endpoint": e.replay_endpoint,
                "connected": e.connected,
                "seq": e.seq,
                "gaps": e.gaps,
                "replayed": e.replayed,
                "lost": e.lost,
                "batches": e.batches,
                "reconnects": e.reconnects,
                "decode_errors": e.decode_errors,
                "unknown_events": e.unknown_events,
                "stored_total": e.stored_total,
                "removed_total": e.removed_total,
                "cleared_total": e.cleared_total,
                "publisher_restarts": e.publisher_restarts,
                "scrape_restarts": e.scrape_restarts,
            },
            "residency": {
                "limit": self.residency.limit(),
                "dropped_by_bound": self.residency.dropped_by_bound(),
                "unknown_removes": self.residency.unknown_removes(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mmrouter::worker_metrics::WorkerMetrics;

    fn spec(name: &str, addr: &str) -> WorkerSpec {
        WorkerSpec {
            name: name.into(),
            addr: addr.parse().unwrap(),
            events: None,
            replay: None,
        }
    }

    fn store(r: &mut Registry, name: &str, hashes: &[u64], images: &[Vec<u64>]) {
        r.update(name, |w| {
            let mut c = Changes::default();
            w.residency.store(hashes, images, &mut c);
            ((), c.finish(&w.residency))
        })
        .unwrap();
    }

    #[test]
    fn feed_snapshot_then_deltas_then_snapshot_for_foreign_cursors() {
        let mut r = Registry::new(1000, 100, 2);
        r.join(spec("b", "10.0.0.2:8000"), None, None);
        r.join(spec("a", "10.0.0.1:8000"), None, None);
        store(&mut r, "b", &[1, 2], &[vec![77], vec![77]]);
        let (f, kind) = r.feed(0, None);
        assert_eq!(kind, FeedKind::Snapshot);
        assert!(f.snapshot);
        let names: Vec<_> = f.workers.iter().map(|w| w.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(
            f.images,
            [ImageResidency {
                worker: 1,
                image: 77,
                blocks: 2
            }]
        );
        let c1 = f.cursor;
        let (f, kind) = r.feed(c1, Some(r.epoch));
        assert_eq!((kind, f.images.len()), (FeedKind::Delta, 0));
        store(&mut r, "a", &[9], &[vec![5]]);
        let (f, _) = r.feed(c1, None);
        assert!(!f.snapshot);
        assert_eq!(
            f.images,
            [ImageResidency {
                worker: 0,
                image: 5,
                blocks: 1
            }]
        );
        // Another epoch, a cursor from the future, or 0: snapshots.
        assert!(r.feed(c1, Some(r.epoch ^ 1)).0.snapshot);
        assert!(r.feed(f.cursor + 1, None).0.snapshot);
        // A worker that leaves takes its images with it.
        assert!(r.leave("b"));
        let (f, _) = r.feed(c1, None);
        assert_eq!(f.workers.len(), 1);
        assert_eq!(
            f.images,
            [ImageResidency {
                worker: 0,
                image: 5,
                blocks: 1
            }],
            "b's zeroes are dropped: b is not in the worker list"
        );
        // Back under the same name, before the poller saw it leave: the poller gets 0.
        r.join(spec("b", "10.0.0.9:8000"), None, None);
        let (f, _) = r.feed(c1, None);
        assert!(f.images.contains(&ImageResidency {
            worker: 1,
            image: 77,
            blocks: 0
        }));
        mmrouter::feed::decode(&mmrouter::feed::encode(&f)).unwrap();
    }

    #[test]
    fn a_small_journal_sends_old_cursors_a_snapshot() {
        let mut r = Registry::new(1000, 2, 2);
        r.join(spec("a", "10.0.0.1:8000"), None, None);
        let c0 = r.cursor();
        store(&mut r, "a", &[1, 2, 3], &[vec![1], vec![2], vec![3]]);
        let (f, kind) = r.feed(c0, None);
        assert_eq!(kind, FeedKind::Snapshot);
        assert_eq!(f.images.len(), 3);
    }

    #[test]
    fn health_needs_a_good_scrape_and_fails_after_n_failures() {
        let mut r = Registry::new(1000, 100, 2);
        r.join(spec("a", "10.0.0.1:8000"), None, None);
        assert!(!r.feed(0, None).0.workers[0].healthy);
        let s = EngineScrape {
            load: WorkerMetrics {
                waiting: 1.0,
                running: 2.0,
                kv_usage: 0.5,
            },
            num_gpu_blocks: Some(3),
            block_size: Some(16),
            prefill: None,
        };
        store(&mut r, "a", &[1, 2, 3, 4, 5], &[]);
        assert!(r.scrape_ok("a", s), "turned healthy");
        let w = &r.feed(0, None).0.workers[0];
        assert!(w.healthy && w.metrics_valid);
        assert_eq!(
            (w.capacity, w.block_size, w.waiting, w.kv_usage),
            (3, 16, 1.0, 0.5)
        );
        assert!(w.metrics_age_ms < 1000);
        assert_eq!(w.resident, 3, "the capacity bounds the residency");
        assert!(
            !r.scrape_failed("a", "refused".into()),
            "one failure is tolerated"
        );
        assert!(r.feed(0, None).0.workers[0].healthy);
        assert!(r.scrape_failed("a", "refused".into()));
        let w = &r.feed(0, None).0.workers[0];
        assert!(!w.healthy && w.metrics_valid);
    }

    #[test]
    fn state_and_prometheus_name_every_worker() {
        let mut r = Registry::new(1000, 100, 2);
        r.join(
            spec("a", "10.0.0.1:8000"),
            Some("tcp://10.0.0.1:5557".into()),
            None,
        );
        store(&mut r, "a", &[1], &[vec![5]]);
        let v = r.state_json();
        assert_eq!(v["workers"][0]["name"], "a");
        assert_eq!(v["workers"][0]["address"], "10.0.0.1:8000");
        assert_eq!(v["workers"][0]["blocks"], 1);
        assert_eq!(v["workers"][0]["images"], 1);
        assert_eq!(v["workers"][0]["events"]["endpoint"], "tcp://10.0.0.1:5557");
        assert_eq!(v["epoch"], r.epoch);
        let p = r.prometheus();
        assert!(p.contains("mmrouter_sidecar_workers 1\n"), "{p}");
        assert!(p.contains("mmrouter_sidecar_worker_resident_blocks{worker=\"a\"} 1\n"));
        assert!(
            !p.contains("metrics_age_seconds{"),
            "never scraped: no sample"
        );
    }

    fn scrape_with_prompt_tokens(tokens: f64) -> EngineScrape {
        EngineScrape {
            load: WorkerMetrics {
                waiting: 0.0,
                running: 0.0,
                kv_usage: 0.0,
            },
            num_gpu_blocks: Some(1000),
            block_size: Some(16),
            prefill: Some(mmrouter::worker_metrics::PrefillCounters {
                prompt_tokens: tokens,
                hit_tokens: 0.0,
                prefill_seconds: tokens / 1000.0,
            }),
        }
    }

    #[test]
    fn an_engine_whose_prompt_tokens_went_back_restarted_and_its_residency_is_cleared() {
        let mut r = Registry::new(1000, 100, 2);
        r.join(spec("a", "10.0.0.1:8000"), None, None);
        r.scrape_ok("a", scrape_with_prompt_tokens(500.0));
        store(&mut r, "a", &[1, 2], &[vec![7], vec![7]]);
        r.scrape_ok("a", scrape_with_prompt_tokens(900.0));
        assert_eq!(
            r.feed(0, None).0.workers[0].resident,
            2,
            "counters grew: no restart"
        );
        assert_eq!(r.feed(0, None).0.workers[0].cleared_total, 0);
        // Crashed and back: its counters start again.
        r.scrape_ok("a", scrape_with_prompt_tokens(40.0));
        let w = &r.feed(0, None).0.workers[0];
        assert_eq!((w.resident, w.cleared_total), (0, 1));
        assert_eq!(r.state_json()["workers"][0]["events"]["scrape_restarts"], 1);
        // A restart the event stream saw first (it cleared) is not cleared again by the scrape:
        // what was stored since stays.
        r.update("a", |w| {
            w.events.cleared_total += 1;
            w.events.cleared_since_scrape = true;
            ((), Vec::new())
        });
        store(&mut r, "a", &[3], &[vec![8]]);
        r.scrape_ok("a", scrape_with_prompt_tokens(10.0));
        let w = &r.feed(0, None).0.workers[0];
        assert_eq!((w.resident, w.cleared_total), (1, 2));
    }
}
