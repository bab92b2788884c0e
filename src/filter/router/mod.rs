//! One VM's request path: read the shared worker state, match the request's blocks, score the
//! workers, record the decision; and release a request's load as its phases end.
//!
//! Host-independent: it talks to shared data through [`SharedStore`] and takes the time and a
//! random number as arguments, so every path is tested natively and the proxy-wasm shell only
//! moves bytes between Envoy and this type. Per request it reads the live table and the load
//! table (one `get` each), the membership table only when its version moved, O(log n) block
//! buckets, and in precise mode one image bucket per image in the matched prefix; it writes
//! the load table (one CAS update) and enqueues one decision record.

mod decision;
mod homes;
mod phases;
mod surviving;
#[cfg(test)]
mod tests;

pub use decision::{
    Conversation, Decision, Fallback, Held, LetGo, SPEED_PROBE_MIN_TOKENS, SpeedProbe, Target,
};

use super::config::FilterConfig;
use crate::analysis::{Analysis, AnalyzeError, analyze};
use crate::scoring::{
    Candidate, Choice, Estimate, RequestSize, bounds_lifted, choose, conversation_load, copy_fits,
    pick_below, queued_blocks, slower_than_choice, splitmix64, unlifted,
    wait_past_a_copy_that_fits,
};
use crate::state::blocks::Bucket;
use crate::state::homes::Homes;
use crate::state::load::{Load, LoadTable};
use crate::state::lookup::{default_probes, match_prefix};
use crate::state::workers::{FUTURE_CAPACITIES, Live, LiveTable, Members, flag};
use crate::state::writer::{read_live, read_members};
use crate::state::{Keys, SharedStore, cas_update, decisions, ensure_key};
use homes::HomeOutcome;

/// A VM's router.
#[derive(Debug)]
pub struct Router {
    pub config: FilterConfig,
    keys: Keys,
    load: LoadTable,
    /// The membership table as last read (re-read when the live table's version of it moves).
    members: Members,
}

impl Router {
    pub fn new(config: FilterConfig) -> Router {
        let keys = Keys::new(config.state.namespace(config.router.block_size));
        let load = LoadTable::new(keys.load());
        Router {
            config,
            keys,
            load,
            members: Members::default(),
        }
    }

    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// Creates the keys every VM writes with their initial value (at configuration time,
    /// before traffic: see "First writes" in [`crate::state`]).
    pub fn prepare(&self, store: &dyn SharedStore) -> bool {
        let load = ensure_key(store, &self.keys.load(), &[]);
        let homes = !self.config.router.scoring.home_hold
            || ensure_key(store, &self.keys.homes(), &Homes::default().encode());
        // The URL cache's buckets exist before traffic, so that every claim is a CAS.
        let urls = !self.config.fetch.enabled
            || crate::state::urls::prepare(store, &self.keys, &self.config.fetch.cache);
        load && homes && urls
    }

    /// The membership and live tables, re-reading membership only when it moved.
    fn tables(&mut self, store: &dyn SharedStore) -> LiveTable {
        let live = read_live(store, &self.keys);
        if live.members_version != self.members.version || self.members.slots.is_empty() {
            self.members = read_members(store, &self.keys);
        }
        live
    }

    /// Decides where a complete body goes, and records the decision in shared state. None
    /// when no worker is known yet (the request then takes Envoy's default route).
    pub fn route(
        &mut self,
        body: &[u8],
        store: &dyn SharedStore,
        now_us: u64,
        random: u64,
    ) -> (Option<Decision>, Option<Analysis>) {
        if body.len() > self.config.router.limits.max_body_bytes {
            return (
                self.route_without_body(Fallback::TooLarge, store, now_us, random),
                None,
            );
        }
        let analysis = analyze(body, &self.config.router);
        self.route_analyzed(analysis, store, now_us, random)
    }

    /// Decides where a body goes from its analysis (done in one call, or fed piece by piece
    /// through an [`crate::analysis::Analyzer`] as the body arrived), or routes it without its
    /// cache affinity when the analysis failed.
    pub fn route_analyzed(
        &mut self,
        analysis: Result<Analysis, AnalyzeError>,
        store: &dyn SharedStore,
        now_us: u64,
        random: u64,
    ) -> (Option<Decision>, Option<Analysis>) {
        match analysis {
            Ok(a) => (self.route_analysis(&a, store, now_us, random), Some(a)),
            Err(e) => {
                let why = match e.reason() {
                    "too_large" => Fallback::TooLarge,
                    reason => Fallback::Analyze(reason),
                };
                (self.route_without_body(why, store, now_us, random), None)
            }
        }
    }

    /// Routing of an analysed request: prefix match, scoring, record.
    pub fn route_analysis(
        &mut self,
        analysis: &Analysis,
        store: &dyn SharedStore,
        now_us: u64,
        random: u64,
    ) -> Option<Decision> {
        let live = self.tables(store);
        let eligible = eligible_slots(&live);
        if eligible.is_empty() {
            return None;
        }
        let max = self.config.state.max_record_blocks as usize;
        let all_keys = &analysis.layout.keys;
        let keys = all_keys.get(..max.min(all_keys.len())).unwrap_or(all_keys);
        let probes = match self.config.state.max_probes {
            0 => default_probes(keys.len()),
            n => n as usize,
        };
        let blocks = &self.config.state.blocks;
        let keyspace = &self.keys;
        let mut prefix = match_prefix(keys, &live.slots, blocks, probes, &mut |b| {
            store
                .get(&keyspace.block_bucket(b))
                .ok()
                .flatten()
                .map(|(v, _)| v)
        });
        if live.precise {
            self.cap_by_images(analysis, &live, &mut prefix.depths, store);
        }
        let snapshot = self.load.snapshot(store, live.slots.len());
        let loads = &snapshot.loads;
        // Before the admission cut: the worker that holds a follow-up's conversation, whole
        // or at least the partial hold's share (`scoring.conversation_hold`), and the one
        // holding the longest prefix, for the decision log.
        let conversation_at = self.conversation_worker(analysis, &eligible, &prefix.depths);
        let mut longest_held = None;
        if live.precise && self.config.router.scoring.admission_match {
            longest_held = longest(&eligible, &prefix.depths);
            self.cut_to_admission(&live, loads, &eligible, &mut prefix, now_us);
        }
        let now_ms = now_us / 1000;
        let half_life = self.config.router.scoring.footprint_half_life_ms;
        let fresh_for = self.metrics_fresh_for_ms();
        let mut candidates: Vec<Candidate> = eligible
            .iter()
            .map(|&s| {
                let l = live.get(s).copied().unwrap_or_default();
                let load = loads.get(s).copied().unwrap_or_default();
                let mut c = candidate(&l, &load, prefix.depth(s), now_us, now_ms, half_life);
                let continued = analysis.layout.continued_blocks;
                c.holds_conversation = continued > 0 && prefix.depth(s) >= continued;
                if now_ms.saturating_sub(l.metrics_ms) > fresh_for {
                    // Stale engine metrics say nothing about now.
                    c.waiting = None;
                    c.running = None;
                }
                c
            })
            .collect();
        // A worker whose speed is not known yet (it just joined) is assumed as fast as the
        // fleet's mean, not the configured default: new workers are usually like the others.
        if let Some(mean) = mean_known_speed(&live, &eligible) {
            for c in candidates.iter_mut().filter(|c| c.prefill_tps.is_none()) {
                c.prefill_tps = Some(mean);
            }
        }
        let block_size = analysis.layout.block_size.max(1);
        let request = RequestSize {
            total_blocks: keys.len(),
            prompt_tokens: analysis.layout.prompt_tokens,
            block_size,
        };
        let mut choice = choose(request, &candidates, &self.config.router.scoring, random)?;
        let cost_choice = choice.index;
        let outcome = if self.config.router.scoring.home_hold {
            self.hold_home(
                keys,
                analysis.layout.preamble_blocks,
                &live,
                &eligible,
                &candidates,
                &mut choice,
                store,
                now_ms,
            )
        } else {
            HomeOutcome::Nothing
        };
        let conversation = self.back_to_conversation(
            conversation_at,
            analysis.layout.continued_blocks,
            &eligible,
            &candidates,
            &mut choice,
        );
        let home_let_go = match outcome {
            HomeOutcome::LetGo(slot, why) => self.target(slot).map(|t| (t.name, why)),
            _ => None,
        };
        let slot = eligible.get(choice.index).copied()?;
        let target = self.target(slot)?;
        let estimate = choice.estimate();
        let matched = prefix.depth(slot).min(keys.len());
        let prefill_us = (estimate.prefill_s * 1e6) as u64;
        let new_blocks = (keys.len() - matched) as u32;
        let end = self
            .load
            .route_after(store, &snapshot, slot, now_us, prefill_us, new_blocks);
        // Its prefill starts now (nothing queued ahead by the router's clock): the time to its
        // first chunk measures the worker's speed.
        let uncached = analysis
            .layout
            .prompt_tokens
            .saturating_sub(matched.saturating_mul(block_size));
        let speed_probe = match (end, live.get(slot)) {
            (Some(e), Some(l))
                if analysis.stream
                    && e.saturating_sub(prefill_us) <= now_us
                    && uncached >= SPEED_PROBE_MIN_TOKENS as usize =>
            {
                Some(SpeedProbe {
                    routed_us: now_us,
                    tokens: uncached.min(u32::MAX as usize) as u32,
                    incarnation: l.incarnation,
                })
            }
            _ => None,
        };
        // The stamp of the request's first key: the worker's clock once it has allocated the
        // request's new blocks (key `i` gets this minus `i`). In precise mode the engine's
        // `BlockStored` events move the clock by them only after routing, and the request's
        // blocks start to age no earlier: stamped with the clock at routing, a request about
        // as large as a tight cache looked evicted as soon as its engine stored it (the
        // predicted overlap was 67-103 tokens per request short at 256 blocks per worker,
        // docs/BENCHMARKS.md, thirty-first run). The record carries it for such a worker;
        // in approximate mode the state writer moves the clock by the decision's new blocks,
        // in the order it drains them, and then stamps. With `scoring.admission_stamps` the
        // engine stores the prefill queued ahead of the request first: the request touches its
        // prefix (a group's preamble) again only then, so the stamp is that much later, and a
        // request queued behind it finds the prefix the queue ahead of both would have evicted.
        let scoring = &self.config.router.scoring;
        let ahead = match candidates.get(choice.index) {
            Some(c) if scoring.admission_stamps => queued_blocks(c, block_size, scoring) as u64,
            _ => 0,
        };
        let (stamp, events) = live.get(slot).map_or((0, false), |l| {
            let events = l.flags & flag::EVENTS != 0;
            // Stamps stay within what `Live::holds` counts ahead of the clock.
            let room = u64::from(l.capacity.max(1))
                .saturating_mul(u64::from(FUTURE_CAPACITIES))
                .saturating_sub(u64::from(new_blocks) + 1);
            let ahead = if events { ahead.min(room) } else { 0 };
            let stamp = l.clock.wrapping_add(u64::from(new_blocks) + ahead) as u32;
            (stamp, events)
        });
        if matched < keys.len() {
            self.record_last_key(store, &live, slot, keys, stamp);
        }
        // A request the worker holds in full, whose deepest (oldest) stamp is still fresh
        // (within 1/16 of the worker's capacity), adds nothing the buckets do not say: its
        // keys stay out of the record. Only full matches are skipped, so every key of a
        // chain is restamped whenever the chain grows and stamps stay monotone along it.
        let first = match (
            prefix.deepest_stamps.get(slot).copied().flatten(),
            live.get(slot),
        ) {
            (Some(stamp), Some(l)) if matched == keys.len() && l.age(stamp) <= 1.0 / 16.0 => {
                matched
            }
            _ => 0,
        };
        let enqueued = store
            .enqueue(
                &self.keys.decisions(),
                &decisions::encode(
                    slot as u16,
                    now_ms,
                    new_blocks,
                    first as u32,
                    events.then_some(stamp),
                    keys.get(first..).unwrap_or(&[]),
                ),
            )
            .is_ok();
        let named = |i: usize| {
            let s = *eligible.get(i)?;
            let t = self.target(s)?;
            Some((t.name, prefix.depth(s), *choice.estimates.get(i)?))
        };
        let passed_over = choice.passed_over(&candidates).and_then(named);
        let overruled = (choice.index != cost_choice)
            .then(|| named(cost_choice))
            .flatten();
        // The conversation hold decided last: where it sent the request back, the home did not.
        let back_to_conversation = matches!(conversation, Some(Conversation::Held(_)));
        let cut_at_admission = longest_held
            .filter(|&(s, held)| prefix.depth(s) < held)
            .and_then(|(s, held)| Some((self.target(s)?.name, held, prefix.depth(s))));
        let alternates = choice
            .ranking
            .iter()
            .skip(1)
            .filter_map(|&i| self.target(*eligible.get(i)?).map(|t| t.address))
            .collect();
        Some(Decision {
            target,
            alternates,
            matched_blocks: matched,
            total_blocks: keys.len(),
            estimate,
            passed_over,
            overruled,
            cut_at_admission,
            prefill_window: end.map(|e| (e.saturating_sub(prefill_us), e)),
            stream: analysis.stream,
            speed_probe,
            media: analysis.media.len(),
            probes: prefix.probes,
            precise: live.precise,
            fallback: None,
            home: match outcome {
                HomeOutcome::Held(hold) if !back_to_conversation => Some(hold),
                _ => None,
            },
            conversation,
            home_let_go,
            recorded: end.is_some() && enqueued,
            held: live.get(slot).map(|l| Held {
                keys: keys.to_vec(),
                clock: l.clock,
                incarnation: l.incarnation,
                new_blocks,
            }),
        })
    }

    /// `scoring.conversation_hold`: for a follow-up turn (a request that continues a
    /// conversation beyond its preamble), the candidate (index into `eligible`) that holds its
    /// whole conversation in `depths` (with `scoring.conversation_hold_partial`, at least
    /// `conversation_hold_partial_share` of it past the preamble, and one block), the longest
    /// such match, the first of equals.
    fn conversation_worker(
        &self,
        analysis: &Analysis,
        eligible: &[usize],
        depths: &[usize],
    ) -> Option<usize> {
        let continued = analysis.layout.continued_blocks;
        let preamble = analysis.layout.preamble_blocks;
        let scoring = &self.config.router.scoring;
        if scoring.conversation_hold <= 0.0 || continued <= preamble {
            return None;
        }
        let least = if scoring.conversation_hold_partial {
            // `past` >= 1 (checked above); a NaN share casts to 0 and takes one block.
            let past = continued - preamble;
            let share = scoring.conversation_hold_partial_share.clamp(0.0, 1.0);
            preamble + ((past as f64 * share).ceil() as usize).max(1).min(past)
        } else {
            continued
        };
        eligible
            .iter()
            .enumerate()
            .filter_map(|(i, &s)| Some((i, *depths.get(s)?)))
            .filter(|&(_, d)| d >= least)
            .fold(None, |best, (i, d)| match best {
                Some((_, b)) if b >= d => best,
                _ => Some((i, d)),
            })
            .map(|(i, _)| i)
    }

    /// `scoring.conversation_hold`: a follow-up goes back to candidate `at`, the worker that
    /// held its whole conversation (`continued` blocks; with `conversation_hold_partial`, the
    /// longest part of it, at least `conversation_hold_partial_share`) before the admission
    /// cut, while that
    /// worker's load is within the hold's bound, and with
    /// `scoring.conversation_wait_where_copy_fits` while its extra wait costs no more than
    /// the conversation's weighted prefill on the chosen worker, or a copy there would not
    /// fit in its cache. None where no worker held it or it is the choice.
    fn back_to_conversation(
        &self,
        at: Option<usize>,
        continued: usize,
        eligible: &[usize],
        candidates: &[Candidate],
        choice: &mut Choice,
    ) -> Option<Conversation> {
        let at = at.filter(|&at| at != choice.index)?;
        let name = self.target(*eligible.get(at)?)?.name;
        let scoring = &self.config.router.scoring;
        let kept;
        let scoring = if bounds_lifted(candidates, scoring)
            && ((scoring.conversation_lift_unless_copy_fits
                && copy_fits(choice, candidates, scoring))
                || slower_than_choice(choice, candidates, at, scoring))
        {
            kept = unlifted(scoring);
            &kept
        } else {
            scoring
        };
        let (carries, limit) = conversation_load(candidates, at, scoring);
        if carries > limit {
            return Some(Conversation::LetGo {
                name,
                carries,
                limit,
            });
        }
        // Where the chosen worker's cache holds a copy of the conversation, the copy costs
        // its prefill once; a long queue on the conversation's worker costs the request its
        // wait (with 2 workers the load bound never binds).
        let lacks = candidates
            .get(choice.index)
            .map_or(continued, |c| continued.saturating_sub(c.matched_blocks));
        if scoring.conversation_wait_where_copy_fits
            && let Some(past) =
                wait_past_a_copy_that_fits(choice, candidates, at, lacks, 1.0, scoring)
        {
            return Some(Conversation::LetGoWait { name, past });
        }
        choice.prefer(at);
        Some(Conversation::Held(name))
    }

    /// Records the request's last block key for `slot` now, with the stamp the state writer
    /// will give it: by prefix closure it proves the whole prefix (see [`crate::state::lookup`]),
    /// so a request that repeats this one before the writer's next tick already matches it.
    /// One bucket update; the writer records the other keys from the decision queue.
    fn record_last_key(
        &self,
        store: &dyn SharedStore,
        live: &LiveTable,
        slot: usize,
        keys: &[u64],
        first_stamp: u32,
    ) {
        let Some(&last) = keys.last() else {
            return;
        };
        let stamp = first_stamp.wrapping_sub((keys.len() - 1) as u32);
        let blocks = &self.config.state.blocks;
        cas_update(
            store,
            &self.keys.block_bucket(blocks.bucket_of(last)),
            |bytes| {
                let mut b = Bucket::decode(bytes);
                b.touch(last, slot as u16, stamp, &live.slots, blocks)
                    .then(|| b.encode())
            },
        );
    }

    /// How long engine metrics count: three poll periods of whichever source fills them,
    /// and at least a second.
    fn metrics_fresh_for_ms(&self) -> u64 {
        let mut period = self.config.metrics.poll_ms;
        if let Some(sc) = &self.config.sidecar {
            period = period.max(sc.poll_ms);
        }
        period.saturating_mul(3).max(1000)
    }

    fn target(&self, slot: usize) -> Option<Target> {
        let m = self.members.slots.get(slot)?;
        m.active.then(|| Target {
            slot,
            name: m.name.clone(),
            address: m.address.clone(),
        })
    }

    /// Routes a request without its cache affinity (body unusable, over the size limit, or
    /// absent): the eligible worker with the least prefill queued, then the fewest requests
    /// in flight, ties broken by `random`.
    pub fn route_without_body(
        &mut self,
        why: Fallback,
        store: &dyn SharedStore,
        now_us: u64,
        random: u64,
    ) -> Option<Decision> {
        let live = self.tables(store);
        let eligible = eligible_slots(&live);
        let snapshot = self.load.snapshot(store, live.slots.len());
        let slot = least_loaded(&eligible, &snapshot.loads, now_us, random)?;
        let target = self.target(slot)?;
        let end = self.load.route_after(store, &snapshot, slot, now_us, 0, 0);
        Some(Decision {
            target,
            alternates: Vec::new(),
            matched_blocks: 0,
            total_blocks: 0,
            estimate: Estimate::default(),
            passed_over: None,
            overruled: None,
            cut_at_admission: None,
            prefill_window: None,
            stream: false,
            speed_probe: None,
            media: 0,
            probes: 0,
            precise: live.precise,
            fallback: Some(why),
            home: None,
            home_let_go: None,
            conversation: None,
            recorded: end.is_some(),
            held: None,
        })
    }
}

/// The mean prefill speed of the eligible workers whose speed is known (tokens/s), if any: what
/// a worker of unknown speed (it just joined) is assumed to run at.
fn mean_known_speed(live: &LiveTable, eligible: &[usize]) -> Option<f64> {
    let (sum, n) = eligible
        .iter()
        .filter_map(|&s| live.get(s))
        .filter(|l| l.prefill_tps > 0.0)
        .fold((0.0, 0u32), |(sum, n), l| {
            (sum + f64::from(l.prefill_tps), n + 1)
        });
    (n > 0).then(|| sum / f64::from(n))
}

/// The eligible slot holding the longest prefix (the first of equals), and its length.
fn longest(eligible: &[usize], depths: &[usize]) -> Option<(usize, usize)> {
    eligible
        .iter()
        .filter_map(|&s| Some((s, *depths.get(s)?)))
        .fold(None, |best, (s, d)| match best {
            Some((_, b)) if b >= d => best,
            _ => Some((s, d)),
        })
}

/// What the scorer needs of one worker.
fn candidate(
    l: &Live,
    load: &Load,
    matched: usize,
    now_us: u64,
    now_ms: u64,
    half_life_ms: u64,
) -> Candidate {
    let metrics = l.metrics();
    Candidate {
        matched_blocks: matched,
        queued_s: load.queued_us(now_us) as f64 / 1e6,
        waiting: metrics.map(|m| m.waiting),
        running: metrics.map(|m| m.running),
        prefill_tps: (l.prefill_tps > 0.0).then_some(f64::from(l.prefill_tps)),
        peak_prefill_tps: l.peak_prefill_tps(),
        footprint: l.footprint_at(now_ms, half_life_ms),
        capacity_blocks: (l.capacity > 0).then_some(f64::from(l.capacity)),
        inflight: load.inflight,
        holds_conversation: false,
    }
}

/// Active slots that are healthy; all active slots when none is.
fn eligible_slots(live: &LiveTable) -> Vec<usize> {
    let active = || live.slots.iter().enumerate().filter(|(_, l)| l.active());
    let healthy: Vec<usize> = active()
        .filter(|(_, l)| l.healthy())
        .map(|(s, _)| s)
        .collect();
    if healthy.is_empty() {
        active().map(|(s, _)| s).collect()
    } else {
        healthy
    }
}

/// The slot with the least prefill queued, then the fewest in flight; ties by `random`.
pub fn least_loaded(slots: &[usize], loads: &[Load], now_us: u64, random: u64) -> Option<usize> {
    let key = |s: usize| {
        let l = loads.get(s).copied().unwrap_or_default();
        (l.queued_us(now_us), l.inflight)
    };
    let best = slots.iter().map(|&s| key(s)).min()?;
    let ties: Vec<usize> = slots.iter().copied().filter(|&s| key(s) == best).collect();
    ties.get(pick_below(splitmix64(random), ties.len()))
        .copied()
}
