//! The state writer: what the lease-holding VM does on its tick. It keeps the membership and
//! live tables, applies the queued routing decisions to the block buckets and allocation
//! clocks, and records what the workers' engines report (their `/metrics` in approximate mode;
//! the sidecar's feed in precise mode).
//!
//! Every write is a CAS read-modify-write ([`super::cas_update`]), so a lease hand-over in the
//! middle of a tick loses nothing that was written, only work that is redone.

use super::blocks::Bucket;
use super::decisions::DecisionRecord;
use super::images::ImageBucket;
use super::load::LoadTable;
use super::workers::{Live, LiveTable, MAX_SLOTS, Member, Members, flag};
use super::{Keys, SharedStore, StateConfig, cas_update};
use crate::worker_metrics::EngineScrape;
use std::collections::BTreeMap;

/// Reads the membership table.
pub fn read_members(store: &dyn SharedStore, keys: &Keys) -> Members {
    match store.get(&keys.members()) {
        Ok(Some((bytes, _))) => Members::decode(&bytes),
        _ => Members::default(),
    }
}

/// Reads the live table.
pub fn read_live(store: &dyn SharedStore, keys: &Keys) -> LiveTable {
    match store.get(&keys.live()) {
        Ok(Some((bytes, _))) => LiveTable::decode(&bytes),
        _ => LiveTable::default(),
    }
}

/// Updates the live table under CAS; `f` returns whether it changed anything.
pub fn update_live(
    store: &dyn SharedStore,
    keys: &Keys,
    now_ms: u64,
    mut f: impl FnMut(&mut LiveTable) -> bool,
) -> bool {
    cas_update(store, &keys.live(), |bytes| {
        let mut table = LiveTable::decode(bytes);
        if !f(&mut table) {
            return None;
        }
        table.version = table.version.wrapping_add(1);
        table.written_ms = now_ms;
        Some(table.encode())
    })
}

/// What a membership change did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MembershipChange {
    /// `(slot, name)` of the workers that joined.
    pub joined: Vec<(usize, String)>,
    /// `(slot, name)` of the workers that left.
    pub left: Vec<(usize, String)>,
    /// Workers that could not get a slot (all [`MAX_SLOTS`] taken).
    pub refused: usize,
}

impl MembershipChange {
    pub fn is_empty(&self) -> bool {
        self.joined.is_empty() && self.left.is_empty()
    }
}

/// Makes the active members exactly `desired` (`(name, address)` pairs; a name that comes back
/// with another address is a new worker). Joined workers take freed slots first; their slot's
/// clock jumps past its capacity and its incarnation moves, so nothing of a previous occupant
/// stays valid; their load is zeroed.
pub fn sync_members(
    store: &dyn SharedStore,
    keys: &Keys,
    config: &StateConfig,
    desired: &[(String, String)],
    now_ms: u64,
) -> MembershipChange {
    let mut change = MembershipChange::default();
    let ok = cas_update(store, &keys.members(), |bytes| {
        let mut members = Members::decode(bytes);
        change = MembershipChange::default();
        for (slot, m) in members.slots.iter_mut().enumerate() {
            let wanted = desired.iter().any(|(n, a)| *n == m.name && *a == m.address);
            if m.active && !wanted {
                m.active = false;
                change.left.push((slot, m.name.clone()));
            }
        }
        for (name, address) in desired {
            if members
                .slots
                .iter()
                .any(|m| m.active && m.name == *name && m.address == *address)
            {
                continue;
            }
            let member = Member {
                name: name.clone(),
                address: address.clone(),
                active: true,
            };
            let slot = match members.slots.iter().position(|m| !m.active) {
                Some(free) => free,
                None if members.slots.len() < MAX_SLOTS.min(config.max_workers) => {
                    members.slots.push(member.clone());
                    members.slots.len() - 1
                }
                None => {
                    change.refused += 1;
                    continue;
                }
            };
            if let Some(m) = members.slots.get_mut(slot) {
                *m = member;
            }
            change.joined.push((slot, name.clone()));
        }
        if change.is_empty() && !bytes.is_empty() {
            return None;
        }
        members.version = members.version.wrapping_add(1);
        Some(members.encode())
    });
    if !ok {
        return MembershipChange::default();
    }
    let version = read_members(store, keys).version;
    let load = LoadTable::new(keys.load());
    update_live(store, keys, now_ms, |table| {
        let mut changed = table.members_version != version;
        table.members_version = version;
        for (slot, _) in &change.left {
            if let Some(l) = table.slots.get_mut(*slot) {
                l.flags = 0;
                changed = true;
            }
        }
        for (slot, _) in &change.joined {
            while table.slots.len() <= *slot {
                table.slots.push(Live::default());
            }
            if let Some(l) = table.slots.get_mut(*slot) {
                let jump = u64::from(l.capacity.max(config.capacity_blocks)) + 1;
                *l = Live {
                    clock: l.clock.wrapping_add(jump),
                    capacity: config.capacity_blocks,
                    flags: flag::ACTIVE | flag::HEALTHY,
                    incarnation: l.incarnation.wrapping_add(1),
                    footprint_ms: now_ms,
                    tokens_total: -1.0,
                    prefill_seconds_total: -1.0,
                    ..Live::default()
                };
                changed = true;
            }
        }
        changed
    });
    for (slot, _) in &change.joined {
        load.reset(store, *slot);
    }
    change
}

/// What one drain did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DrainStats {
    /// Decisions applied.
    pub applied: u64,
    /// Records that could not be decoded or named no active slot.
    pub dropped: u64,
    /// Bucket writes (buckets whose holders changed).
    pub buckets_written: u64,
    /// Bucket writes lost to contention.
    pub lost: u64,
}

/// Takes up to `max` records off the queue and applies the decisions among them: each moves its
/// worker's allocation clock by its new blocks (unless the worker's engine events drive the
/// clock) and footprint, and stamps its block keys with the worker's clock (or, where engine
/// events drive it, with the stamp the record carries). The engine frees a finished request's
/// blocks tail first, so its head stays cached longest: key `i` of a request is stamped
/// `clock - i`. Updates are grouped per bucket: one read and at most one write per bucket
/// touched, whatever the number of decisions.
pub fn drain(
    store: &dyn SharedStore,
    keys: &Keys,
    config: &StateConfig,
    footprint_half_life_ms: u64,
    now_ms: u64,
    max: usize,
) -> DrainStats {
    let mut stats = DrainStats::default();
    let mut records = Vec::new();
    let queue = keys.decisions();
    // `max` bounds the records taken off the queue, malformed ones included: a queue full of
    // records this version cannot read (a writer of another version) costs one tick `max`
    // dequeues, not the whole queue (found by the fuzz target `state`).
    for _ in 0..max {
        match store.dequeue(&queue) {
            Ok(Some(bytes)) => match DecisionRecord::decode(&bytes) {
                Some(r) => records.push(r),
                None => stats.dropped += 1,
            },
            _ => break,
        }
    }
    if records.is_empty() {
        return stats;
    }
    // Clocks and footprints first: the stamps are the clocks after each decision.
    let mut touches: BTreeMap<u32, Vec<(u64, u16, u32)>> = BTreeMap::new();
    let mut live_after = Vec::new();
    update_live(store, keys, now_ms, |table| {
        touches.clear();
        stats.applied = 0;
        let mut dropped = 0;
        for r in &records {
            let Some(l) = table.slots.get_mut(usize::from(r.slot)) else {
                dropped += 1;
                continue;
            };
            if !l.active() {
                dropped += 1;
                continue;
            }
            if l.flags & flag::EVENTS == 0 {
                l.clock = l.clock.wrapping_add(u64::from(r.new_blocks));
            }
            l.add_footprint(
                f64::from(r.new_blocks),
                r.time_ms.max(l.footprint_ms),
                footprint_half_life_ms,
            );
            // Where the engine's events drive the clock, the record carries the stamp: the
            // clock once the engine stored the request's new blocks, which its events move
            // the clock by later (see `Router::route_analysis`).
            let stamp = match r.stamp {
                Some(at) if l.flags & flag::EVENTS != 0 => at,
                _ => l.stamp(),
            };
            for (j, &k) in r.keys.iter().enumerate() {
                let i = r.first.wrapping_add(j as u32);
                touches
                    .entry(config.blocks.bucket_of(k))
                    .or_default()
                    .push((k, r.slot, stamp.wrapping_sub(i)));
            }
            stats.applied += 1;
        }
        stats.dropped += dropped;
        live_after = table.slots.clone();
        true
    });
    for (bucket, updates) in &touches {
        let mut wrote = false;
        let ok = cas_update(store, &keys.block_bucket(*bucket), |bytes| {
            let mut b = Bucket::decode(bytes);
            let mut changed = false;
            for &(k, slot, stamp) in updates {
                changed |= b.touch(k, slot, stamp, &live_after, &config.blocks);
            }
            wrote = changed;
            changed.then(|| b.encode())
        });
        if !ok {
            stats.lost += 1;
        } else if wrote {
            stats.buckets_written += 1;
        }
    }
    stats
}

/// Records one `/metrics` poll of `slot` (approximate mode, or the sidecar is stale): the
/// engine's load, its KV capacity (`num_gpu_blocks`, converted to the router's block size),
/// its prefill speed from the totals, health; `None` is a failed poll (timeout, refused,
/// non-200, no vLLM metrics). An engine whose totals went backwards restarted: its cache is
/// empty, so its clock jumps past its capacity. Then reconciles the router's in-flight count
/// with the engine's (see [`super::load`]). Returns whether the poll was good.
#[allow(clippy::too_many_arguments)]
pub fn record_poll(
    store: &dyn SharedStore,
    keys: &Keys,
    router_block_size: usize,
    unhealthy_after: u32,
    slot: usize,
    polled: Option<EngineScrape>,
    now_ms: u64,
) -> bool {
    let mut engine_count = None;
    let mut reconcile = false;
    let inflight = LoadTable::new(keys.load())
        .read(store, slot + 1)
        .get(slot)
        .map_or(0, |l| l.inflight);
    update_live(store, keys, now_ms, |table| {
        let Some(l) = table.slots.get_mut(slot) else {
            return false;
        };
        if !l.active() {
            return false;
        }
        match &polled {
            None => {
                l.failures = l.failures.saturating_add(1);
                if unhealthy_after > 0 && u32::from(l.failures) >= unhealthy_after {
                    l.flags &= !flag::HEALTHY;
                }
            }
            Some(s) => {
                l.failures = 0;
                l.flags |= flag::HEALTHY | flag::METRICS;
                l.waiting = s.load.waiting as f32;
                l.running = s.load.running as f32;
                l.kv_usage = s.load.kv_usage as f32;
                l.metrics_ms = now_ms;
                if let Some(blocks) = s.num_gpu_blocks {
                    let engine_bs = u64::from(s.block_size.unwrap_or(router_block_size as u32));
                    let router_bs = router_block_size.max(1) as u64;
                    l.capacity = (blocks.saturating_mul(engine_bs) / router_bs)
                        .clamp(1, u64::from(u32::MAX)) as u32;
                }
                if let Some(c) = s.prefill {
                    let tokens = (c.prompt_tokens - c.hit_tokens).max(0.0);
                    let seconds = c.prefill_seconds;
                    // A restart resets every counter. Only raw counters tell: `prompt - hits`
                    // goes down between two scrapes of a healthy engine too, because vLLM
                    // counts a request's cache hits when it is scheduled and its prompt tokens
                    // when its prefill ends. Taking that for a restart forgot the worker's
                    // whole cache on a busy worker, again and again.
                    let restarted =
                        l.prefill_seconds_total >= 0.0 && seconds < l.prefill_seconds_total;
                    if restarted {
                        if l.flags & flag::EVENTS == 0 {
                            l.forget_cache(now_ms);
                        }
                        l.tokens_total = tokens;
                        l.prefill_seconds_total = seconds;
                    } else if l.tokens_total < 0.0 || tokens >= l.tokens_total {
                        if l.tokens_total >= 0.0
                            && let Some(tps) = prefill_tps(
                                (l.tokens_total, l.prefill_seconds_total),
                                (tokens, seconds),
                            )
                        {
                            let old = f64::from(l.prefill_tps);
                            let smoothed = if old > 0.0 {
                                0.7 * old + 0.3 * tps
                            } else {
                                tps
                            };
                            l.prefill_tps = smoothed as f32;
                        }
                        l.tokens_total = tokens;
                        l.prefill_seconds_total = seconds;
                    }
                    // Else hits were counted ahead of their prompt tokens: the totals stay
                    // as they were until the prompt tokens catch up.
                }
                let count = engine_requests(s.load.running, s.load.waiting);
                engine_count = Some(count);
                reconcile = over_engine(l, inflight, count);
            }
        }
        true
    });
    if reconcile && let Some(count) = engine_count {
        LoadTable::new(keys.load()).cap_inflight(store, slot, count);
    }
    polled.is_some()
}

/// Prefill speed between two scrapes, in uncached prompt tokens per second: tokens prefilled
/// over prefill seconds spent in between. None when too little prefill happened (under 10 ms)
/// or the totals went backwards (an engine restart).
fn prefill_tps(
    (tokens_before, seconds_before): (f64, f64),
    (tokens_now, seconds_now): (f64, f64),
) -> Option<f64> {
    let tokens = tokens_now - tokens_before;
    let seconds = seconds_now - seconds_before;
    (seconds >= 0.01 && tokens > 0.0 && tokens.is_finite()).then(|| tokens / seconds)
}

/// Requests the engine reports (running + waiting).
pub fn engine_requests(running: f64, waiting: f64) -> u32 {
    (running + waiting).max(0.0).round() as u32
}

/// Counts one poll where the router's in-flight count for a slot was (or was not) above the
/// engine's; true when it has been above for three polls in a row, and the count should be
/// capped at the engine's ([`LoadTable::cap_inflight`]).
pub fn over_engine(l: &mut Live, inflight: u32, engine: u32) -> bool {
    if inflight > engine {
        l.over_count = l.over_count.saturating_add(1);
        if l.over_count >= 3 {
            l.over_count = 0;
            return true;
        }
    } else {
        l.over_count = 0;
    }
    false
}

/// Clears what the router believes `slot` holds (its engine cleared its cache): the clock
/// jumps past its capacity.
pub fn clear_slot(store: &dyn SharedStore, keys: &Keys, slot: usize, now_ms: u64) -> bool {
    update_live(store, keys, now_ms, |table| {
        let Some(l) = table.slots.get_mut(slot) else {
            return false;
        };
        l.clock = l.clock.wrapping_add(u64::from(l.capacity) + 1);
        true
    })
}

/// Sets image residency entries (precise mode): `(slot, image key, blocks)`.
pub fn set_images(
    store: &dyn SharedStore,
    keys: &Keys,
    config: &StateConfig,
    live: &LiveTable,
    updates: &[(usize, u64, u32)],
) -> u64 {
    let mut per_bucket: BTreeMap<u32, Vec<(u64, u16, u8, u32)>> = BTreeMap::new();
    for &(slot, image, blocks) in updates {
        let Some(l) = live.get(slot) else { continue };
        per_bucket
            .entry(config.images.bucket_of(image))
            .or_default()
            .push((image, slot as u16, l.incarnation, blocks));
    }
    let mut lost = 0;
    for (bucket, list) in &per_bucket {
        let ok = cas_update(store, &keys.image_bucket(*bucket), |bytes| {
            let mut b = ImageBucket::decode(bytes);
            for &(image, slot, inc, blocks) in list {
                b.set(image, slot, inc, blocks, &config.images);
            }
            Some(b.encode())
        });
        if !ok {
            lost += 1;
        }
    }
    lost
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::MemoryStore;
    use crate::state::decisions;
    use crate::state::lookup::match_prefix;

    fn setup(n: usize) -> (MemoryStore, Keys, StateConfig) {
        let store = MemoryStore::default();
        let keys = Keys::new(1);
        let config = StateConfig {
            capacity_blocks: 100,
            ..StateConfig::default()
        };
        let desired: Vec<(String, String)> = (0..n)
            .map(|i| (format!("w{i}"), format!("10.0.0.{i}:8000")))
            .collect();
        let change = sync_members(&store, &keys, &config, &desired, 0);
        assert_eq!(change.joined.len(), n);
        (store, keys, config)
    }

    fn depths(store: &MemoryStore, keys: &Keys, config: &StateConfig, chain: &[u64]) -> Vec<usize> {
        let live = read_live(store, keys);
        match_prefix(chain, &live.slots, &config.blocks, 100, &mut |b| {
            store
                .get(&keys.block_bucket(b))
                .ok()
                .flatten()
                .map(|(v, _)| v)
        })
        .depths
    }

    fn decide(store: &MemoryStore, keys: &Keys, slot: u16, new_blocks: u32, chain: &[u64]) {
        store
            .enqueue(
                &keys.decisions(),
                &decisions::encode(slot, 0, new_blocks, 0, None, chain),
            )
            .expect("enqueue");
    }

    #[test]
    fn decisions_become_holdings_and_age_out_after_capacity_new_blocks() {
        let (store, keys, config) = setup(2);
        let chain: Vec<u64> = (1..=10).collect();
        decide(&store, &keys, 1, 10, &chain);
        let s = drain(&store, &keys, &config, 60_000, 10, 100);
        assert_eq!((s.applied, s.dropped), (1, 0));
        assert_eq!(depths(&store, &keys, &config, &chain), vec![0, 10]);
        // 90 more new blocks on slot 1: the chain and they fill its capacity of 100 ...
        let other: Vec<u64> = (1000..1090).collect();
        decide(&store, &keys, 1, 90, &other);
        drain(&store, &keys, &config, 60_000, 20, 100);
        assert_eq!(depths(&store, &keys, &config, &chain), vec![0, 10]);
        // ... one more evicts the least recently used block: the chain's tail, as vLLM frees
        // a finished request's blocks tail first ...
        decide(&store, &keys, 1, 1, &[5000]);
        drain(&store, &keys, &config, 60_000, 30, 100);
        assert_eq!(depths(&store, &keys, &config, &chain), vec![0, 9]);
        // ... and nine more the rest.
        decide(&store, &keys, 1, 9, &[5001]);
        drain(&store, &keys, &config, 60_000, 40, 100);
        assert_eq!(depths(&store, &keys, &config, &chain), vec![0, 0]);
    }

    #[test]
    fn a_drain_takes_at_most_max_records_even_when_they_are_malformed() {
        let (store, keys, config) = setup(2);
        for _ in 0..5 {
            store.enqueue(&keys.decisions(), b"o").expect("enqueue");
        }
        decide(&store, &keys, 1, 4, &[1, 2, 3, 4]);
        let s = drain(&store, &keys, &config, 60_000, 10, 2);
        assert_eq!(
            (s.applied, s.dropped),
            (0, 2),
            "two records taken, both unreadable"
        );
        let s = drain(&store, &keys, &config, 60_000, 10, 100);
        assert_eq!(
            (s.applied, s.dropped),
            (1, 3),
            "the rest, and the decision behind them"
        );
    }

    #[test]
    fn hits_counted_before_their_prompt_tokens_are_no_restart_but_a_counter_reset_is() {
        let (store, keys, config) = setup(1);
        let chain: Vec<u64> = (1..=10).collect();
        decide(&store, &keys, 0, 10, &chain);
        drain(&store, &keys, &config, 60_000, 0, 100);
        let scrape = |prompt: f64, hits: f64, seconds: f64| EngineScrape {
            load: crate::worker_metrics::WorkerMetrics {
                waiting: 0.0,
                running: 1.0,
                kv_usage: 0.1,
            },
            num_gpu_blocks: None,
            block_size: None,
            prefill: Some(crate::worker_metrics::PrefillCounters {
                prompt_tokens: prompt,
                hit_tokens: hits,
                prefill_seconds: seconds,
            }),
        };
        let poll = |s, now| record_poll(&store, &keys, 16, 3, 0, Some(s), now);
        assert!(poll(scrape(5000.0, 1000.0, 1.0), 100));
        // vLLM counts a request's 3000 hit tokens when it schedules it and its prompt tokens
        // when its prefill ends: in between, prompt - hits went down. Nothing restarted.
        assert!(poll(scrape(5000.0, 4000.0, 1.0), 200));
        assert_eq!(depths(&store, &keys, &config, &chain), vec![10]);
        assert!(poll(scrape(8200.0, 4000.0, 1.1), 300));
        assert_eq!(depths(&store, &keys, &config, &chain), vec![10]);
        let tps = read_live(&store, &keys).slots[0].prefill_tps;
        assert!(
            (tps - 2000.0).abs() < 1.0,
            "200 uncached tokens in 0.1 s, got {tps}"
        );
        let before = read_live(&store, &keys).slots[0].footprint;
        assert!(before > 9.0, "the chain's 10 new blocks, got {before}");
        // A restarted engine starts its counters over: its cache is gone, and with it the new
        // content the router put there (so new content goes there again).
        assert!(poll(scrape(300.0, 0.0, 0.05), 400));
        assert_eq!(depths(&store, &keys, &config, &chain), vec![0]);
        assert_eq!(read_live(&store, &keys).slots[0].footprint, 0.0);
    }

    #[test]
    fn touching_a_prefix_again_keeps_it_while_its_tail_ages() {
        let (store, keys, config) = setup(1);
        let chain: Vec<u64> = (1..=10).collect();
        decide(&store, &keys, 0, 10, &chain);
        drain(&store, &keys, &config, 60_000, 0, 100);
        for i in 0..20u64 {
            // The first 5 blocks are shared, 5 new ones each time.
            let mut c: Vec<u64> = chain[..5].to_vec();
            c.extend((0..5).map(|j| 10_000 + i * 10 + j));
            decide(&store, &keys, 0, 5, &c);
            drain(&store, &keys, &config, 60_000, 0, 100);
        }
        let d = depths(&store, &keys, &config, &chain);
        assert_eq!(d, vec![5], "the shared head stays, the old tail is gone");
    }

    #[test]
    fn a_worker_that_leaves_and_one_that_takes_its_slot_share_nothing() {
        let (store, keys, config) = setup(2);
        let chain: Vec<u64> = (1..=4).collect();
        decide(&store, &keys, 0, 4, &chain);
        drain(&store, &keys, &config, 60_000, 0, 100);
        assert_eq!(depths(&store, &keys, &config, &chain), vec![4, 0]);
        let change = sync_members(
            &store,
            &keys,
            &config,
            &[
                ("w1".into(), "10.0.0.1:8000".into()),
                ("w9".into(), "10.0.0.9:8000".into()),
            ],
            5,
        );
        assert_eq!(change.left, vec![(0, "w0".to_string())]);
        assert_eq!(change.joined, vec![(0, "w9".to_string())]);
        let members = read_members(&store, &keys);
        assert_eq!(members.slot_of("w9"), Some(0));
        assert_eq!(read_live(&store, &keys).members_version, members.version);
        assert_eq!(depths(&store, &keys, &config, &chain), vec![0, 0]);
        // A decision for the departed worker's slot number that was queued before it left
        // lands on the new occupant only if it is newer; records naming no active slot drop.
        decide(&store, &keys, 7, 1, &[1]);
        assert_eq!(drain(&store, &keys, &config, 60_000, 9, 100).dropped, 1);
    }

    #[test]
    fn polls_set_capacity_speed_health_and_reconcile_leaked_counts() {
        let (store, keys, _config) = setup(1);
        let stats = |tokens: f64, seconds: f64, running: f64| EngineScrape {
            load: crate::worker_metrics::WorkerMetrics {
                waiting: 0.0,
                running,
                kv_usage: 0.1,
            },
            num_gpu_blocks: Some(1024),
            block_size: Some(32),
            prefill: Some(crate::worker_metrics::PrefillCounters {
                prompt_tokens: tokens + 100.0,
                hit_tokens: 100.0,
                prefill_seconds: seconds,
            }),
        };
        assert!(record_poll(
            &store,
            &keys,
            16,
            3,
            0,
            Some(stats(0.0, 0.0, 0.0)),
            100
        ));
        assert!(record_poll(
            &store,
            &keys,
            16,
            3,
            0,
            Some(stats(8000.0, 1.0, 0.0)),
            200
        ));
        let l = read_live(&store, &keys).slots[0];
        assert_eq!(
            l.capacity, 2048,
            "1024 engine blocks of 32 tokens = 2048 of 16"
        );
        assert!((l.prefill_tps - 8000.0).abs() < 1e-3);
        assert!(l.healthy() && l.has_metrics());
        // The router thinks 5 requests are in flight; the engine runs 1, three polls in a row.
        let load = LoadTable::new(keys.load());
        for _ in 0..5 {
            load.route(&store, 0, 0, 0, 0);
        }
        for t in 0..3 {
            record_poll(
                &store,
                &keys,
                16,
                3,
                0,
                Some(stats(8000.0, 1.0, 1.0)),
                300 + t,
            );
        }
        assert_eq!(load.read(&store, 1)[0].inflight, 1);
        for t in 0..3 {
            assert!(!record_poll(&store, &keys, 16, 3, 0, None, 400 + t));
        }
        assert!(!read_live(&store, &keys).slots[0].healthy());
    }
}
