//! Each worker's load as the router sees it (`<ns>.load`): requests in flight, a prefill
//! queue clock and the new blocks routed there that its engine has not stored yet. Every VM
//! updates it with CAS on the request path (the state writer too, from the sidecar's feed); it
//! is 16 bytes per slot.
//!
//! ## The prefill queue clock
//! An engine prefills one batch after another, first come first served (vLLM's FCFS
//! scheduler), so what a new request waits for is the prefill still queued ahead of it. The
//! router keeps that as a time: `queue_until` is when the worker will have finished the
//! prefill of everything routed to it so far. Routing a request whose uncached prompt takes
//! `p` to prefill sets `start = max(now, queue_until)`, `queue_until = start + p`, and the
//! request's own prefill is estimated to end at `queue_until`.
//!
//! The clock follows each request's phases:
//! - **Streaming**: prefill ends at the first response body chunk (vLLM sends the response
//!   headers before prefill, the first chunk after it). If it came at `t` while it was
//!   expected at `e`, the work queued behind it starts at `t`, not `e`:
//!   `queue_until = t + max(0, queue_until - e)`.
//! - **Non-streaming**: the answer comes after decoding, so the first byte says nothing about
//!   prefill; the clock simply passes the estimate. An answer that arrives before the estimate
//!   proves prefill was faster, and corrects the clock the same way.
//! - **Reset or error before prefill ended**: the engine drops the request, so its remaining
//!   share of the queue is taken out.
//!
//! Nothing has to be released for the clock to stay right: a lost `on_log` (a VM that
//! trapped, a reload) leaves a clock that drains by itself.
//!
//! ## Blocks not yet stored
//! The queue clock overstates what the engine will allocate before it admits a new request:
//! vLLM allocates (and stores, with a `BlockStored` event) a request's blocks when it admits
//! it, and the requests admitted but still in prefill are on the clock too. So each slot also
//! counts the new blocks routed to it that its engine has not stored yet: routing adds the
//! request's new blocks, the engine's stored blocks (from the sidecar's feed) take them off.
//! Where that count is smaller than the queue clock's prefill in blocks, the admission cut
//! uses it (`scoring.admission_pending`). Blocks the engine never stores (it found them
//! cached after all, or dropped the request before admitting it) leave the count with the
//! engine's next stores, or when a request is routed after the queue clock has drained.
//!
//! ## In-flight counts
//! Released on completion, reset and stream error (`on_log`). A VM that traps loses its
//! streams' releases, so the state writer reconciles the counts with the engine: when a
//! worker's count stays above `vllm:num_requests_running + vllm:num_requests_waiting` for
//! three fresh polls in a row, it is lowered to that (see [`super::writer`]).

use super::wire::Reader;
use super::{SharedStore, cas_update};

/// One slot's load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Load {
    /// Requests routed to the worker and not finished.
    pub inflight: u32,
    /// When the worker's queued prefill will be done (µs since the epoch).
    pub queue_until_us: u64,
    /// New blocks routed to the worker that its engine has not stored yet: what the
    /// admissions of the requests still waiting there will allocate (precise mode; see
    /// "Blocks not yet stored").
    pub pending_blocks: u32,
}

impl Load {
    /// A prefill estimated to end at `expected_us` ended at `at_us`: what queued behind it
    /// moves by the difference.
    fn prefill_ended(&mut self, at_us: u64, expected_us: u64) {
        let behind = self.queue_until_us.saturating_sub(expected_us);
        self.queue_until_us = at_us.saturating_add(behind);
    }

    /// A request routed at `now_us` with `prefill_us` of prefill and `new_blocks` to allocate
    /// queues behind the others; returns when its prefill is estimated to end.
    fn routed(&mut self, now_us: u64, prefill_us: u64, new_blocks: u32) -> u64 {
        self.inflight = self.inflight.saturating_add(1);
        if self.queue_until_us <= now_us {
            // Every request routed before has been prefilled, so admitted and stored: what
            // the count still holds were blocks the engine found cached.
            self.pending_blocks = 0;
        }
        self.pending_blocks = self.pending_blocks.saturating_add(new_blocks);
        let start = self.queue_until_us.max(now_us);
        self.queue_until_us = start.saturating_add(prefill_us);
        self.queue_until_us
    }

    /// Prefill time still queued ahead of a request arriving at `now_us`.
    pub fn queued_us(&self, now_us: u64) -> u64 {
        self.queue_until_us.saturating_sub(now_us)
    }
}

const ENTRY: usize = 16;

/// Decodes the table (a malformed value reads as all zeros; missing slots are zeros).
pub fn decode(bytes: &[u8], slots: usize) -> Vec<Load> {
    let mut out = vec![Load::default(); slots];
    if !bytes.len().is_multiple_of(ENTRY) {
        return out;
    }
    let mut r = Reader::new(bytes);
    for load in out.iter_mut() {
        let (Some(inflight), Some(pending), Some(until)) = (r.u32(), r.u32(), r.u64()) else {
            break;
        };
        *load = Load {
            inflight,
            queue_until_us: until,
            pending_blocks: pending,
        };
    }
    out
}

pub fn encode(loads: &[Load]) -> Vec<u8> {
    let mut out = Vec::with_capacity(loads.len() * ENTRY);
    for l in loads {
        out.extend_from_slice(&l.inflight.to_le_bytes());
        out.extend_from_slice(&l.pending_blocks.to_le_bytes());
        out.extend_from_slice(&l.queue_until_us.to_le_bytes());
    }
    out
}

/// The load table as one read saw it.
#[derive(Debug, Clone)]
pub struct LoadSnapshot {
    pub loads: Vec<Load>,
    read: Option<(Vec<u8>, u32)>,
}

/// The table `bytes` with `f` applied to `slot` (grown to hold it), encoded.
fn modified(bytes: &[u8], slot: usize, f: &impl Fn(&mut Load)) -> Option<Vec<u8>> {
    let n = (bytes.len() / ENTRY).max(slot + 1);
    let mut loads = decode(bytes, n);
    f(loads.get_mut(slot)?);
    Some(encode(&loads))
}

/// The load table of one configuration.
#[derive(Debug, Clone)]
pub struct LoadTable {
    key: String,
}

impl LoadTable {
    pub fn new(key: String) -> LoadTable {
        LoadTable { key }
    }

    /// Every slot's load, `slots` entries.
    pub fn read(&self, store: &dyn SharedStore, slots: usize) -> Vec<Load> {
        self.snapshot(store, slots).loads
    }

    /// Every slot's load with the bytes and CAS token they were read at, so that the update
    /// that follows a read ([`LoadTable::route_after`]) costs one write when no other VM wrote
    /// in between.
    pub fn snapshot(&self, store: &dyn SharedStore, slots: usize) -> LoadSnapshot {
        match store.get(&self.key) {
            Ok(Some((bytes, cas))) => LoadSnapshot {
                loads: decode(&bytes, slots),
                read: Some((bytes, cas)),
            },
            _ => LoadSnapshot {
                loads: vec![Load::default(); slots],
                read: None,
            },
        }
    }

    fn update(&self, store: &dyn SharedStore, slot: usize, f: impl Fn(&mut Load)) -> bool {
        cas_update(store, &self.key, |bytes| modified(bytes, slot, &f))
    }

    /// [`LoadTable::route`], trying first to write over `snapshot` (one host call); on a lost
    /// race it reads again, as `route` does.
    pub fn route_after(
        &self,
        store: &dyn SharedStore,
        snapshot: &LoadSnapshot,
        slot: usize,
        now_us: u64,
        prefill_us: u64,
        new_blocks: u32,
    ) -> Option<u64> {
        let end = std::cell::Cell::new(None);
        let apply = |l: &mut Load| end.set(Some(l.routed(now_us, prefill_us, new_blocks)));
        if let Some((bytes, cas)) = &snapshot.read
            && let Some(next) = modified(bytes, slot, &apply)
            && store.set(&self.key, &next, Some(*cas)).is_ok()
        {
            return end.get();
        }
        self.route(store, slot, now_us, prefill_us, new_blocks)
    }

    /// A request was routed to `slot` at `now_us` with `prefill_us` of prefill to do and
    /// `new_blocks` to allocate. Returns when its prefill is estimated to end (None when the
    /// update was lost).
    pub fn route(
        &self,
        store: &dyn SharedStore,
        slot: usize,
        now_us: u64,
        prefill_us: u64,
        new_blocks: u32,
    ) -> Option<u64> {
        let end = std::cell::Cell::new(None);
        let ok = self.update(store, slot, |l| {
            end.set(Some(l.routed(now_us, prefill_us, new_blocks)));
        });
        if ok { end.get() } else { None }
    }

    /// The request's prefill ended at `now_us`; it had been estimated to end at `expected_us`.
    pub fn prefill_done(
        &self,
        store: &dyn SharedStore,
        slot: usize,
        now_us: u64,
        expected_us: u64,
    ) -> bool {
        self.update(store, slot, |l| l.prefill_ended(now_us, expected_us))
    }

    /// The request finished (completed, reset or failed). `unfinished_prefill` is its
    /// estimated prefill window `(start_us, end_us)` when its prefill had not been seen to end:
    /// if that was still ahead (before its estimated end), its whole duration leaves the queue
    /// (the engine drops a request it has not prefilled; where it had started, the work behind
    /// it moves up by at most that much too early, which the next first chunk corrects).
    ///
    /// `answered`: `(at_us, expected_us)` for a request whose complete answer came at `at_us`,
    /// before the estimated end of its prefill `expected_us`: [`LoadTable::prefill_done`] in the
    /// same write (one read and one write per request instead of two of each).
    pub fn finish(
        &self,
        store: &dyn SharedStore,
        slot: usize,
        now_us: u64,
        unfinished_prefill: Option<(u64, u64)>,
        answered: Option<(u64, u64)>,
    ) -> bool {
        self.update(store, slot, |l| {
            if let Some((at_us, expected_us)) = answered {
                l.prefill_ended(at_us, expected_us);
            }
            l.inflight = l.inflight.saturating_sub(1);
            if let Some((start, end)) = unfinished_prefill
                && now_us < end
            {
                let duration = end.saturating_sub(start);
                l.queue_until_us = l.queue_until_us.saturating_sub(duration).max(now_us);
            }
        })
    }

    /// What `slot`'s engine reported, in one write: it stored `blocks` blocks (they leave the
    /// blocks not yet stored) and, with `running`, it has at most that many requests
    /// ([`LoadTable::cap_inflight`]).
    pub fn engine_report(
        &self,
        store: &dyn SharedStore,
        slot: usize,
        blocks: u64,
        running: Option<u32>,
    ) -> bool {
        let blocks = u32::try_from(blocks).unwrap_or(u32::MAX);
        self.update(store, slot, |l| {
            l.pending_blocks = l.pending_blocks.saturating_sub(blocks);
            if let Some(count) = running {
                l.inflight = l.inflight.min(count);
            }
        })
    }

    /// Sets `slot`'s in-flight count to at most `count` (reconciliation with the engine).
    pub fn cap_inflight(&self, store: &dyn SharedStore, slot: usize, count: u32) -> bool {
        self.engine_report(store, slot, 0, Some(count))
    }

    /// Zeroes a slot (a worker joined a freed slot).
    pub fn reset(&self, store: &dyn SharedStore, slot: usize) -> bool {
        self.update(store, slot, |l| *l = Load::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::MemoryStore;

    #[test]
    fn prefill_queues_behind_earlier_requests_and_drains_with_time() {
        let s = MemoryStore::default();
        let t = LoadTable::new("load".into());
        assert_eq!(t.route(&s, 1, 1_000, 500, 0), Some(1_500));
        assert_eq!(
            t.route(&s, 1, 1_100, 300, 0),
            Some(1_800),
            "queued behind the first"
        );
        let l = t.read(&s, 2);
        assert_eq!(l[1].inflight, 2);
        assert_eq!(l[1].queued_us(1_100), 700);
        assert_eq!(l[1].queued_us(2_000), 0, "the clock drains by itself");
        assert_eq!(l[0], Load::default());
        assert_eq!(t.route(&s, 1, 5_000, 100, 0), Some(5_100), "idle again");
    }

    #[test]
    fn a_route_after_a_read_writes_once_and_retries_when_another_vm_wrote() {
        let s = MemoryStore::default();
        let t = LoadTable::new("load".into());
        t.route(&s, 0, 0, 100, 0).expect("routed");
        let snap = t.snapshot(&s, 2);
        assert_eq!(snap.loads[0].inflight, 1);
        assert_eq!(t.route_after(&s, &snap, 1, 0, 50, 0), Some(50));
        // The snapshot is stale now (another update landed): the route still counts.
        assert_eq!(t.route_after(&s, &snap, 0, 0, 10, 0), Some(110));
        let l = t.read(&s, 2);
        assert_eq!((l[0].inflight, l[1].inflight), (2, 1));
    }

    #[test]
    fn a_late_first_token_delays_what_queued_behind_it() {
        let s = MemoryStore::default();
        let t = LoadTable::new("load".into());
        let first = t.route(&s, 0, 0, 1_000, 0).expect("routed");
        t.route(&s, 0, 0, 1_000, 0).expect("routed");
        // The first request's prefill ended at 1_600, not 1_000: the second ends at 2_600.
        assert!(t.prefill_done(&s, 0, 1_600, first));
        assert_eq!(t.read(&s, 1)[0].queue_until_us, 2_600);
        // An early one pulls it in.
        let s2 = MemoryStore::default();
        let first = t.route(&s2, 0, 0, 1_000, 0).expect("routed");
        t.route(&s2, 0, 0, 1_000, 0).expect("routed");
        assert!(t.prefill_done(&s2, 0, 400, first));
        assert_eq!(t.read(&s2, 1)[0].queue_until_us, 1_400);
        // A complete answer at 400 learnt when its stream ends at 450: the same pull, and the
        // release, in one write.
        let s3 = MemoryStore::default();
        let first = t.route(&s3, 0, 0, 1_000, 0).expect("routed");
        t.route(&s3, 0, 0, 1_000, 0).expect("routed");
        assert!(t.finish(&s3, 0, 450, None, Some((400, first))));
        let l = t.read(&s3, 1)[0];
        assert_eq!((l.inflight, l.queue_until_us), (1, 1_400));
    }

    #[test]
    fn a_reset_before_prefill_takes_its_share_out_and_counts_never_go_negative() {
        let s = MemoryStore::default();
        let t = LoadTable::new("load".into());
        let a = t.route(&s, 0, 0, 1_000, 0).expect("routed");
        let b = t.route(&s, 0, 0, 1_000, 0).expect("routed");
        // The second request is reset at 500 while it waited: its 1_000 leave the queue.
        assert!(t.finish(&s, 0, 500, Some((a, b)), None));
        let l = t.read(&s, 1)[0];
        assert_eq!((l.inflight, l.queue_until_us), (1, 1_000));
        // One reset after its estimated end takes nothing (it had been prefilled).
        let c = t.route(&s, 0, 600, 100, 0).expect("routed");
        assert!(t.finish(&s, 0, 2_000, Some((c - 100, c)), None));
        assert_eq!(t.read(&s, 1)[0].queue_until_us, 1_100);
        assert!(t.finish(&s, 0, 600, None, None));
        assert!(t.finish(&s, 0, 600, None, None));
        assert_eq!(t.read(&s, 1)[0].inflight, 0);
        assert!(t.cap_inflight(&s, 0, 0));
    }

    #[test]
    fn routed_blocks_wait_for_their_engine_to_store_them() {
        let s = MemoryStore::default();
        let t = LoadTable::new("load".into());
        let route = |now, prefill, blocks| {
            let snap = t.snapshot(&s, 1);
            t.route_after(&s, &snap, 0, now, prefill, blocks)
                .expect("routed")
        };
        let pending = || t.read(&s, 1)[0].pending_blocks;
        route(0, 1_000, 40);
        route(0, 1_000, 25);
        assert_eq!(pending(), 65);
        assert!(t.engine_report(&s, 0, 30, None));
        assert_eq!(pending(), 35, "the engine admitted the first");
        // The same report caps the in-flight count (reconciliation): one write.
        assert!(t.engine_report(&s, 0, 100, Some(1)));
        assert_eq!(pending(), 0, "never below zero");
        assert_eq!(t.read(&s, 1)[0].inflight, 1);
        // Blocks the engine found cached are never stored: the count keeps them until the
        // queue has drained, when everything routed before has been admitted.
        route(5_000, 1_000, 10);
        route(5_100, 1_000, 10);
        assert_eq!(pending(), 20);
        route(10_000, 1_000, 7);
        assert_eq!(pending(), 7);
    }
}
