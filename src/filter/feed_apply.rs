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

use super::poller::{Event, membership_events};
use super::router::Router;
use crate::feed;
use crate::state::SharedStore;
use crate::state::workers::flag;
use crate::state::writer::{read_live, read_members, set_images, sync_members, update_live};
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
        update_live(store, keys, now_ms, |table| {
            next_totals.clear();
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
                    }
                    if w.cleared_total > cleared {
                        l.clock = l.clock.wrapping_add(u64::from(l.capacity) + 1);
                    }
                }
                next_totals.insert(w.name.clone(), (w.stored_total, w.cleared_total));
            }
            true
        });
        totals.clear();
        self.totals = next_totals;
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
