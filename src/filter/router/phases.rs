//! A routed request's load follows its phases: its prefill ends at the first response chunk
//! (streamed) or at the answer (complete), its load is released when the stream ends, and the
//! blocks it frees are stamped again when the worker did other work meanwhile.

use super::{Decision, Router};
use crate::state::SharedStore;
use crate::state::decisions;
use crate::state::load::Load;
use crate::state::writer::{read_live, update_live};

impl Router {
    /// The request's first response chunk arrived at `now_us` (prefill done).
    pub fn prefill_done(&self, store: &dyn SharedStore, d: &Decision, now_us: u64) -> bool {
        match d.prefill_window {
            Some((_, end)) => self.load.prefill_done(store, d.target.slot, now_us, end),
            None => false,
        }
    }

    /// The first chunk of a request routed to an empty queue ([`Decision::speed_probe`])
    /// arrived at `now_us`: counts the speed it measured (its uncached tokens over the time
    /// from routing to its first chunk) into the worker's peak (`Live::prefill_tps_peak`), and
    /// returns it. One live-table CAS; nothing for a request that probes nothing.
    pub fn measure_speed(&self, store: &dyn SharedStore, d: &Decision, now_us: u64) -> Option<f64> {
        let (slot, p) = (d.target.slot, d.speed_probe?);
        let elapsed_us = now_us.saturating_sub(p.routed_us);
        if elapsed_us == 0 {
            return None;
        }
        let tps = f64::from(p.tokens) * 1e6 / elapsed_us as f64;
        update_live(store, &self.keys, now_us / 1000, |table| {
            table.slots.get_mut(slot).is_some_and(|l| {
                l.incarnation == p.incarnation && l.active() && l.observe_probe(tps)
            })
        })
        .then_some(tps)
    }

    /// The stream ended (completed, reset or failed): release its load. `prefill_seen` says
    /// whether its prefill was seen to end.
    pub fn finished(
        &self,
        store: &dyn SharedStore,
        d: &Decision,
        now_us: u64,
        prefill_seen: bool,
    ) -> bool {
        let unfinished = if prefill_seen { None } else { d.prefill_window };
        self.load
            .finish(store, d.target.slot, now_us, unfinished, None)
    }

    /// A complete (non-streamed) answer came at `answered_us`, before the estimated end of
    /// the request's prefill: prefill was faster than estimated, and the work queued behind it
    /// moves up ([`Router::prefill_done`]). Applied when the stream ends, with its release, in
    /// one write: a complete answer comes when the request is over anyway.
    pub fn finished_answered(
        &self,
        store: &dyn SharedStore,
        d: &Decision,
        now_us: u64,
        answered_us: u64,
    ) -> bool {
        let answered = d
            .prefill_window
            .and_then(|(_, end)| (answered_us < end).then_some((answered_us, end)));
        self.load
            .finish(store, d.target.slot, now_us, None, answered)
    }

    /// The request ended after its worker prefilled it: the engine frees its blocks now, and
    /// a freed block's place in the engine's eviction order is its free time (vLLM appends a
    /// finished request's blocks to the free queue, tail first), not the time it was routed.
    /// Where the worker allocated more than 1/16 of its capacity for other requests since
    /// this one was routed (it queued, or decoded long), its keys are stamped again, with no
    /// new blocks: otherwise the router would think them evicted while the worker still
    /// holds them, and move the conversation's next turn away from its history (measured on
    /// the tight-cache families of `scripts/bench-compare`). One live-table read and at most
    /// one enqueue.
    pub fn released(&self, store: &dyn SharedStore, d: &Decision, now_us: u64) -> bool {
        let Some(held) = &d.held else {
            return false;
        };
        if held.keys.is_empty() {
            return false;
        }
        let live = read_live(store, &self.keys);
        let Some(l) = live.get(d.target.slot) else {
            return false;
        };
        let others = l
            .clock
            .wrapping_sub(held.clock)
            .saturating_sub(u64::from(held.new_blocks));
        if l.incarnation != held.incarnation
            || !l.active()
            || others > u64::MAX / 2
            || others * 16 <= u64::from(l.capacity.max(1))
        {
            return false;
        }
        store
            .enqueue(
                &self.keys.decisions(),
                &decisions::encode(d.target.slot as u16, now_us / 1000, 0, 0, None, &held.keys),
            )
            .is_ok()
    }

    /// Every slot's load, as the shared table has it.
    pub fn loads(&self, store: &dyn SharedStore, slots: usize) -> Vec<Load> {
        self.load.read(store, slots)
    }
}
