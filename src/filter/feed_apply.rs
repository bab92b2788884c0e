//! Precise mode: applying the sidecar's feed ([`crate::feed`]) to the shared state.
//!
//! - **Membership** is the feed's worker list: workers join and leave with no Envoy restart.
//! - **Metrics** (waiting, running, KV usage, prefill speed, capacity, health) replace the
//!   writer's own `/metrics` polls while the feed is fresh.
//! - **Allocation clocks** of a worker whose KV events are connected move by the blocks its
//!   engine really stored (`stored_total` deltas, converted to the router's block size), not by
//!   the router's estimate: so the router forgets what the worker has forgotten, whoever sent
//!   the traffic (other proxy replicas included). An `AllBlocksCleared` (a `cleared_total`
//!   delta) jumps the clock past the capacity.
//! - **Image residency**: the per-worker image block counts go into the image buckets, where a
//!   lookup caps a worker's match at an image its engine evicted.
//!
//! The text blocks keep the router's own keys from its decisions: the router has no tokenizer,
//! so it cannot recompute vLLM's hashes of text blocks (see `docs/SIDECAR.md`).
//! A new sidecar epoch (a restarted sidecar) resets the totals: its counters start again.

use super::events::{Event, membership_events};
use super::router::Router;
use crate::feed;
use crate::state::SharedStore;
use crate::state::load::LoadTable;
use crate::state::workers::flag;
use crate::state::writer::{
    engine_requests, over_engine, read_live, read_members, set_images, sync_members, update_live,
};
use std::collections::HashMap;

/// What the writer remembers between feeds.
#[derive(Debug, Clone, Default)]
pub struct FeedState {
    epoch: Option<u64>,
    cursor: u64,
    /// Per worker name: (stored_total, cleared_total) at the last feed.
    totals: HashMap<String, (u64, u32)>,
}

impl FeedState {
    /// The `since` of the next poll.
    pub fn cursor(&self) -> u64 {
        self.cursor
    }

    /// Applies one feed body. Err says why it was refused (nothing applied).
    pub fn apply(
        &mut self,
        router: &Router,
        store: &dyn SharedStore,
        bytes: &[u8],
        now_ms: u64,
    ) -> Result<Vec<Event>, String> {
        let f = feed::decode(bytes).map_err(|e| e.to_string())?;
        if self.epoch != Some(f.epoch) {
            self.epoch = Some(f.epoch);
            self.totals.clear();
        }
        let config = &router.config;
        let keys = router.keys();
        let desired: Vec<(String, String)> = f
            .workers
            .iter()
            .filter(|w| super::config::valid_worker_name(&w.name))
            .map(|w| (w.name.clone(), w.address.clone()))
            .collect();
        let change = sync_members(store, keys, &config.state, &desired, now_ms);
        let events = membership_events(change, &desired);
        let members = read_members(store, keys);
        let router_bs = config.router.block_size.max(1) as u64;
        let mut totals = std::mem::take(&mut self.totals);
        let mut next_totals = HashMap::new();
        let load = LoadTable::new(keys.load());
        let loads = load.read(store, members.slots.len());
        // Per slot: blocks its engine stored since the last feed, and the request count to
        // cap its in-flight count at (reconciliation).
        let mut reports: HashMap<usize, (u64, Option<u32>)> = HashMap::new();
        update_live(store, keys, now_ms, |table| {
            next_totals.clear();
            reports.clear();
            for w in &f.workers {
                let Some(slot) = members.slot_of(&w.name) else {
                    continue;
                };
                let Some(l) = table.slots.get_mut(slot) else {
                    continue;
                };
                let engine_bs = if w.block_size > 0 {
                    u64::from(w.block_size)
                } else {
                    router_bs
                };
                if w.capacity > 0 {
                    l.capacity = (u64::from(w.capacity) * engine_bs / router_bs)
                        .clamp(1, u64::from(u32::MAX)) as u32;
                }
                if w.healthy {
                    l.flags |= flag::HEALTHY;
                    l.failures = 0;
                } else {
                    l.flags &= !flag::HEALTHY;
                }
                if w.metrics_valid {
                    l.flags |= flag::METRICS;
                    l.waiting = w.waiting;
                    l.running = w.running;
                    l.kv_usage = w.kv_usage;
                    if w.prefill_tps > 0.0 {
                        l.prefill_tps = w.prefill_tps;
                    }
                    l.metrics_ms = now_ms.saturating_sub(u64::from(w.metrics_age_ms));
                    let engine = engine_requests(f64::from(w.running), f64::from(w.waiting));
                    let inflight = loads.get(slot).map_or(0, |l| l.inflight);
                    if over_engine(l, inflight, engine) {
                        reports.entry(slot).or_default().1 = Some(engine);
                    }
                }
                if w.events_connected {
                    l.flags |= flag::EVENTS;
                } else {
                    l.flags &= !flag::EVENTS;
                }
                if let Some(&(stored, cleared)) = totals.get(&w.name) {
                    if w.events_connected && w.stored_total >= stored {
                        let blocks = (w.stored_total - stored) * engine_bs / router_bs;
                        l.clock = l.clock.wrapping_add(blocks);
                        if blocks > 0 {
                            reports.entry(slot).or_default().0 = blocks;
                        }
                    }
                    if w.cleared_total > cleared {
                        l.forget_cache(now_ms);
                    }
                }
                next_totals.insert(w.name.clone(), (w.stored_total, w.cleared_total));
            }
            true
        });
        totals.clear();
        self.totals = next_totals;
        for (slot, (blocks, running)) in reports {
            load.engine_report(store, slot, blocks, running);
        }
        let live = read_live(store, keys);
        let updates: Vec<(usize, u64, u32)> = f
            .images
            .iter()
            .filter_map(|i| {
                let w = f.workers.get(i.worker as usize)?;
                Some((members.slot_of(&w.name)?, i.image, i.blocks))
            })
            .collect();
        set_images(store, keys, &config.state, &live, &updates);
        self.cursor = f.cursor;
        Ok(events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::{Analysis, analyze};
    use crate::feed::{Feed, FeedWorker, ImageResidency, encode};
    use crate::filter::config::FilterConfig;
    use crate::filter::router::Decision;
    use crate::state::MemoryStore;
    use crate::state::writer::drain;

    fn worker(name: &str, stored: u64, cleared: u32) -> FeedWorker {
        FeedWorker {
            name: name.into(),
            address: format!("10.0.0.{}:8000", name.len()),
            healthy: true,
            events_connected: true,
            capacity: 1000,
            block_size: 16,
            stored_total: stored,
            cleared_total: cleared,
            ..FeedWorker::default()
        }
    }

    fn feed(workers: Vec<FeedWorker>, images: Vec<ImageResidency>) -> Vec<u8> {
        encode(&Feed {
            epoch: 9,
            workers,
            images,
            ..Feed::default()
        })
    }

    fn setup() -> (MemoryStore, Router, FeedState) {
        let store = MemoryStore::default();
        let router = Router::new(FilterConfig::from_json(br#"{"sidecar":{}}"#).expect("config"));
        router.prepare(&store);
        (store, router, FeedState::default())
    }

    /// What the poller does while the feed is fresh.
    fn mark_precise(store: &MemoryStore, router: &Router) {
        update_live(store, router.keys(), 1, |t| {
            t.precise = true;
            true
        });
    }

    /// Routes `analysis` at t = 1 s, ends it after its prefill and lets the state writer
    /// apply the decision.
    fn route_and_record(router: &mut Router, store: &MemoryStore, analysis: &Analysis) -> Decision {
        let d = router
            .route_analysis(analysis, store, 1_000_000, 1)
            .expect("routed");
        router.finished(store, &d, 1_100_000, true);
        drain(
            store,
            router.keys(),
            &router.config.state,
            60_000,
            1100,
            100,
        );
        d
    }

    fn body(text: &str) -> Vec<u8> {
        // A 2x2 PNG inline, then text.
        let png = "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGP8z8DAwMDAxMDAwMDAAAANHQEDasKb6QAAAABJRU5ErkJggg==";
        format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"{text}"}},{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{png}"}}}},{{"type":"text","text":"what is it"}}]}}]}}"#
        )
        .into_bytes()
    }

    #[test]
    fn the_engines_stored_blocks_move_the_clock_and_a_clear_empties_the_worker() {
        let (store, router, mut state) = setup();
        state
            .apply(&router, &store, &feed(vec![worker("a", 0, 0)], vec![]), 1)
            .expect("applies");
        let live = read_live(&store, router.keys());
        let start = live.slots[0].clock;
        assert_eq!(live.slots[0].capacity, 1000);
        assert!(live.slots[0].flags & flag::EVENTS != 0);
        // The engine stored 40 blocks of 32 tokens: 80 of the router's 16.
        let mut w = worker("a", 40, 0);
        w.block_size = 32;
        state
            .apply(&router, &store, &feed(vec![w], vec![]), 2)
            .expect("applies");
        let live = read_live(&store, router.keys());
        assert_eq!(live.slots[0].clock, start + 80);
        assert_eq!(live.slots[0].capacity, 2000);
        // An AllBlocksCleared jumps past the capacity and forgets the worker's footprint.
        update_live(&store, router.keys(), 2, |t| {
            t.slots[0].add_footprint(50.0, 2, 60_000);
            true
        });
        state
            .apply(&router, &store, &feed(vec![worker("a", 40, 1)], vec![]), 3)
            .expect("applies");
        let live = read_live(&store, router.keys());
        assert!(live.slots[0].clock > start + 80 + 1000);
        assert_eq!(live.slots[0].footprint, 0.0);
        // A new sidecar epoch starts its totals again: no jump from the reset counters.
        let before = read_live(&store, router.keys()).slots[0].clock;
        let mut restarted = Feed {
            epoch: 10,
            workers: vec![worker("a", 0, 0)],
            ..Feed::default()
        };
        state
            .apply(&router, &store, &encode(&restarted), 4)
            .expect("applies");
        restarted.workers = vec![worker("a", 5, 0)];
        state
            .apply(&router, &store, &encode(&restarted), 5)
            .expect("applies");
        assert_eq!(read_live(&store, router.keys()).slots[0].clock, before + 5);
        assert!(state.apply(&router, &store, b"garbage", 6).is_err());
    }

    #[test]
    fn a_worker_whose_engine_evicted_the_image_stops_attracting_requests_for_it() {
        let (store, mut router, mut state) = setup();
        let workers = || vec![worker("a", 0, 0), worker("b", 0, 0)];
        state
            .apply(&router, &store, &feed(workers(), vec![]), 1)
            .expect("applies");
        mark_precise(&store, &router);
        let b = body(&"a long shared system prompt ".repeat(20));
        let analysis = analyze(&b, &router.config.router).expect("analyses");
        let image = analysis.media[0].id.key64();
        let first = route_and_record(&mut router, &store, &analysis);
        let slot = first.target.slot as u32;
        // The engine reports it holds the image's blocks: the next request matches fully.
        state
            .apply(
                &router,
                &store,
                &feed(
                    workers(),
                    vec![ImageResidency {
                        worker: slot,
                        image,
                        blocks: 4,
                    }],
                ),
                1200,
            )
            .expect("applies");
        let again = router
            .route_analysis(&analysis, &store, 2_000_000, 1)
            .expect("routed");
        assert!(again.precise);
        assert_eq!(again.target, first.target);
        assert_eq!(again.matched_blocks, again.total_blocks);
        router.finished(&store, &again, 2_100_000, true);
        // It evicted them: the match stops where the image starts.
        state
            .apply(
                &router,
                &store,
                &feed(
                    workers(),
                    vec![ImageResidency {
                        worker: slot,
                        image,
                        blocks: 0,
                    }],
                ),
                2200,
            )
            .expect("applies");
        let after = router
            .route_analysis(&analysis, &store, 3_000_000, 1)
            .expect("routed");
        let image_block = analysis
            .layout
            .media
            .iter()
            .map(|m| m.block as usize)
            .min()
            .expect("image blocks");
        assert!(
            after.matched_blocks <= image_block,
            "{} > {image_block}",
            after.matched_blocks
        );
    }

    #[test]
    fn in_precise_mode_a_match_counts_only_what_survives_the_queue_ahead() {
        let (store, mut router, mut state) = setup();
        let workers = |stored: [u64; 2]| {
            vec![
                FeedWorker {
                    capacity: 4000,
                    ..worker("a", stored[0], 0)
                },
                FeedWorker {
                    capacity: 4000,
                    ..worker("b", stored[1], 0)
                },
            ]
        };
        state
            .apply(&router, &store, &feed(workers([0, 0]), vec![]), 1)
            .expect("applies");
        mark_precise(&store, &router);
        let b = body(&"a long shared system prompt with many words ".repeat(120));
        let analysis = analyze(&b, &router.config.router).expect("analyses");
        let n = analysis.layout.keys.len();
        assert!(n >= 50, "{n} blocks");
        let first = route_and_record(&mut router, &store, &analysis);
        // Its engine stored half its capacity since: the first key is 0.5 old, the
        // deepest (stamped n - 1 earlier, as the engine frees a request tail first) older.
        let mut stored = [0, 0];
        stored[first.target.slot] = 2000;
        state
            .apply(&router, &store, &feed(workers(stored), vec![]), 1200)
            .expect("applies");
        // Both workers have 0.6 of their capacity queued ahead (at the default 10,000
        // tokens/s), not admitted yet: by admission every matched block is gone.
        let load = LoadTable::new(router.keys().load());
        let queued_us = (0.6 * 4000.0 * 16.0 / 10_000.0 * 1e6) as u64;
        for slot in 0..2 {
            load.route(&store, slot, 2_000_000, queued_us, 2400);
        }
        let cut = router
            .route_analysis(&analysis, &store, 2_000_000, 1)
            .expect("routed");
        assert_eq!(cut.matched_blocks, 0, "{:?}", cut.estimate);
        // The decision says what the cut took: the worker holds the request whole now.
        let (name, held, kept) = cut.cut_at_admission.clone().expect("names the cut");
        assert_eq!((name, held, kept), (first.target.name.clone(), n, 0));
        let line = cut.log_line();
        assert!(
            line.contains(&format!(
                "; {} holds {n}/{n} blocks now, 0 at admission",
                first.target.name
            )),
            "{line}"
        );
        // With admission_match off, the router counts what the worker holds now.
        let mut now = Router::new(
            FilterConfig::from_json(br#"{"sidecar":{},"scoring":{"admission_match":false}}"#)
                .expect("config"),
        );
        let held = now
            .route_analysis(&analysis, &store, 2_000_000, 1)
            .expect("routed");
        assert_eq!(held.matched_blocks, n);
        assert_eq!(held.cut_at_admission, None);
        // Without a queue, the half-capacity-old match survives whole.
        let mut calm = Router::new(FilterConfig::from_json(br#"{"sidecar":{}}"#).expect("config"));
        let later = calm
            .route_analysis(&analysis, &store, 60_000_000, 1)
            .expect("routed");
        assert_eq!(later.matched_blocks, n);
        assert_eq!(later.cut_at_admission, None, "nothing was cut");
        assert!(!later.log_line().contains("at admission"));
    }

    /// One worker whose engine stored a quarter of its capacity since a request was routed
    /// there, then `queued` blocks of prefill queued ahead (at the default speed), of which
    /// the engine admitted and stored `admitted`: how much of the request a repeat is
    /// predicted to find at admission, and its blocks.
    fn behind_an_admitted_queue(config: &[u8], queued: u64, admitted: u64) -> (usize, usize) {
        let store = MemoryStore::default();
        let mut router = Router::new(FilterConfig::from_json(config).expect("config"));
        router.prepare(&store);
        let mut state = FeedState::default();
        let workers = |stored: u64| {
            vec![FeedWorker {
                capacity: 4000,
                ..worker("a", stored, 0)
            }]
        };
        state
            .apply(&router, &store, &feed(workers(0), vec![]), 1)
            .expect("applies");
        mark_precise(&store, &router);
        let b = body(&"a long shared system prompt with many words ".repeat(120));
        let analysis = analyze(&b, &router.config.router).expect("analyses");
        route_and_record(&mut router, &store, &analysis);
        state
            .apply(&router, &store, &feed(workers(1000), vec![]), 1200)
            .expect("applies");
        let load = LoadTable::new(router.keys().load());
        let queued_us = (queued as f64 * 16.0 / 10_000.0 * 1e6) as u64;
        load.route(&store, 0, 1_500_000, queued_us, queued as u32);
        state
            .apply(
                &router,
                &store,
                &feed(workers(1000 + admitted), vec![]),
                1600,
            )
            .expect("applies");
        mark_precise(&store, &router);
        let again = router
            .route_analysis(&analysis, &store, 1_700_000, 2)
            .expect("routed");
        (again.matched_blocks, analysis.layout.keys.len())
    }

    #[test]
    fn the_queue_ahead_that_its_engine_admitted_already_is_not_counted_twice() {
        let pending = br#"{"sidecar":{}}"#;
        let clock_only = br#"{"sidecar":{},"scoring":{"admission_pending":false}}"#;
        // The match is a quarter of the capacity old. 0.6 of a capacity queued, none of it
        // admitted: it survives (0.85); 0.9 queued: it is gone.
        let (matched, n) = behind_an_admitted_queue(pending, 2400, 0);
        assert_eq!(matched, n);
        assert_eq!(behind_an_admitted_queue(pending, 3600, 0).0, 0);
        // The engine admitted 1,600 of the 2,400 blocks: the match is 0.65 old now and 0.2 is
        // left to allocate: it survives whole, as before the admissions.
        assert_eq!(behind_an_admitted_queue(pending, 2400, 1600).0, n);
        // Counted on the queue clock alone, the admitted blocks age the match twice (by the
        // engine's clock and as queue ahead, 1.25): cut to nothing.
        assert_eq!(behind_an_admitted_queue(clock_only, 2400, 1600).0, 0);
    }

    /// One worker with more prefill queued than its cache holds; a request routed there
    /// (not yet stored by its engine), then the same request again: how much of it the
    /// second one is predicted to find at admission.
    fn behind_a_long_queue(config: &[u8]) -> (usize, usize) {
        let store = MemoryStore::default();
        let mut router = Router::new(FilterConfig::from_json(config).expect("config"));
        router.prepare(&store);
        let mut state = FeedState::default();
        let workers = vec![FeedWorker {
            capacity: 4000,
            ..worker("a", 0, 0)
        }];
        state
            .apply(&router, &store, &feed(workers, vec![]), 1)
            .expect("applies");
        mark_precise(&store, &router);
        let load = LoadTable::new(router.keys().load());
        // 1.2 capacities of prefill ahead (at the default 10,000 tokens/s), not admitted.
        load.route(
            &store,
            0,
            1_000_000,
            (1.2 * 4000.0 * 16.0 / 10_000.0 * 1e6) as u64,
            4800,
        );
        let b = body(&"a long shared system prompt with many words ".repeat(120));
        let analysis = analyze(&b, &router.config.router).expect("analyses");
        let first = router
            .route_analysis(&analysis, &store, 1_000_000, 1)
            .expect("routed");
        drain(
            &store,
            router.keys(),
            &router.config.state,
            60_000,
            1001,
            100,
        );
        let again = router
            .route_analysis(&analysis, &store, 1_010_000, 2)
            .expect("routed");
        assert_eq!(first.target.slot, again.target.slot);
        (again.matched_blocks, analysis.layout.keys.len())
    }

    #[test]
    fn with_admission_stamps_a_prefix_a_queued_request_shares_survives_the_queue_ahead_of_it() {
        // Stamped for its own blocks only, the first request's prefix looks evicted by the
        // queue ahead of both by the time the second is admitted.
        let (matched, _) = behind_a_long_queue(br#"{"sidecar":{}}"#);
        assert_eq!(matched, 0);
        // Stamped for its admission (after the queue ahead of it), the first request touches
        // it again just before the second: it is found whole.
        let (matched, n) =
            behind_a_long_queue(br#"{"sidecar":{},"scoring":{"admission_stamps":true}}"#);
        assert_eq!(matched, n);
    }

    /// Routes a request to one worker whose cache holds it one and a half times over, lets
    /// the engine store its blocks, and routes it again (precise mode). Returns the second
    /// match and the request's blocks.
    fn repeat_after_its_engine_stored_it() -> (usize, usize) {
        let (store, mut router, mut state) = setup();
        let b = body(&"a long shared system prompt with many words ".repeat(120));
        let analysis = analyze(&b, &router.config.router).expect("analyses");
        let n = analysis.layout.keys.len();
        let workers = |stored: u64| {
            vec![FeedWorker {
                capacity: (n * 3 / 2) as u32,
                ..worker("a", stored, 0)
            }]
        };
        state
            .apply(&router, &store, &feed(workers(0), vec![]), 1)
            .expect("applies");
        mark_precise(&store, &router);
        let first = route_and_record(&mut router, &store, &analysis);
        assert_eq!(first.matched_blocks, 0);
        // The engine stored the request's blocks (its events moved the clock by them): the
        // request's tail was allocated last and freed first, its head is the oldest block
        // but still younger than the capacity.
        state
            .apply(&router, &store, &feed(workers(n as u64), vec![]), 1500)
            .expect("applies");
        mark_precise(&store, &router);
        let again = router
            .route_analysis(&analysis, &store, 2_000_000, 1)
            .expect("routed");
        (again.matched_blocks, n)
    }

    #[test]
    fn a_request_almost_as_large_as_the_cache_is_matched_whole_after_its_engine_stored_it() {
        // Stamped with the clock at routing, its own n blocks would have aged it by n, and
        // only the keys younger than the capacity minus n (about half) would be left.
        let (matched, n) = repeat_after_its_engine_stored_it();
        assert_eq!(matched, n, "stamped with the clock after its own blocks");
    }

    #[test]
    fn the_queue_ahead_of_a_worker_of_unknown_speed_drains_at_the_fleets_mean_speed() {
        let (store, mut router, mut state) = setup();
        // `speeds[slot]`: prefill tokens/s reported for the worker in that slot (0 = unknown).
        let workers = |stored: [u64; 2], speeds: [f32; 2]| {
            vec![
                FeedWorker {
                    capacity: 4000,
                    metrics_valid: true,
                    prefill_tps: speeds[0],
                    ..worker("a", stored[0], 0)
                },
                FeedWorker {
                    capacity: 4000,
                    metrics_valid: true,
                    prefill_tps: speeds[1],
                    ..worker("b", stored[1], 0)
                },
            ]
        };
        state
            .apply(
                &router,
                &store,
                &feed(workers([0, 0], [0.0, 0.0]), vec![]),
                1,
            )
            .expect("applies");
        mark_precise(&store, &router);
        let b = body(&"a long shared system prompt with many words ".repeat(120));
        let analysis = analyze(&b, &router.config.router).expect("analyses");
        let n = analysis.layout.keys.len();
        let first = route_and_record(&mut router, &store, &analysis);
        let home = first.target.slot;
        // The matched worker's speed is unknown; the other one prefills 1,000 tokens/s, a
        // tenth of the configured default.
        let (mut stored, mut speeds) = ([0, 0], [1000.0, 1000.0]);
        stored[home] = 2000;
        speeds[home] = 0.0;
        state
            .apply(
                &router,
                &store,
                &feed(workers(stored, speeds), vec![]),
                1200,
            )
            .expect("applies");
        // 3.84 s queued on each: 0.6 of the capacity at the default speed (the whole match
        // evicted by admission), 0.06 at the fleet's mean (it survives).
        let load = LoadTable::new(router.keys().load());
        for slot in 0..2 {
            load.route(&store, slot, 2_000_000, 3_840_000, 2400);
        }
        let cut = router
            .route_analysis(&analysis, &store, 2_000_000, 1)
            .expect("routed");
        assert_eq!(cut.target.slot, home, "{:?}", cut.estimate);
        assert_eq!(cut.matched_blocks, n, "{:?}", cut.estimate);
    }
}
