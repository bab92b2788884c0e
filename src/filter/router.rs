//! One VM's request path: read the shared worker state, match the request's blocks, score the
//! workers, record the decision; and release a request's load as its phases end.
//!
//! Host-independent: it talks to shared data through [`SharedStore`] and takes the time and a
//! random number as arguments, so every path is tested natively and the proxy-wasm shell only
//! moves bytes between Envoy and this type. Per request it reads the live table and the load
//! table (one `get` each), the membership table only when its version moved, O(log n) block
//! buckets, and in precise mode one image bucket per image in the matched prefix; it writes
//! the load table (one CAS update) and enqueues one decision record.

use super::config::FilterConfig;
use crate::analysis::{Analysis, AnalyzeError, analyze};
use crate::identity::IdSource;
use crate::scoring::{
    Candidate, Choice, Estimate, RequestSize, choose, goes_home, pick_below, splitmix64,
};
use crate::state::blocks::Bucket;
use crate::state::homes::{Eligible, Homes};
use crate::state::images::resident_blocks;
use crate::state::load::{Load, LoadTable};
use crate::state::lookup::{PrefixMatch, default_probes, match_prefix, surviving_depth};
use crate::state::workers::{Live, LiveTable, Members, flag};
use crate::state::writer::{read_live, read_members};
use crate::state::{Keys, SharedStore, cas_update, decisions, ensure_key};
use std::collections::HashMap;

/// A group is held to its home while it has at most this many workers' shares of the traffic
/// (`scoring.home_hold`).
const HOME_MAX_SHARES: f64 = 1.5;

/// Groups the homes table keeps (`scoring.home_hold`): about 23 bytes each, so one read of
/// the table copies at most 6 KiB.
const HOME_GROUPS: usize = 256;

/// Why a request was routed without its cache affinity (to the least-loaded worker).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// The body could not be analysed: [`AnalyzeError::reason`] (`bad_json`, `bad_image`, ...).
    Analyze(&'static str),
    /// The body was larger than `limits.max_body_bytes`.
    TooLarge,
    /// A routed path with no body.
    NoBody,
    /// A compressed body (`content-encoding` other than identity): not read.
    Encoded,
}

impl Fallback {
    pub fn reason(&self) -> &'static str {
        match self {
            Fallback::Analyze(r) => r,
            Fallback::TooLarge => "too_large",
            Fallback::NoBody => "no_body",
            Fallback::Encoded => "encoded_body",
        }
    }
}

/// The worker a decision names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub slot: usize,
    pub name: String,
    pub address: String,
}

/// A routing decision.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub target: Target,
    /// The next-best workers' addresses, best first (for retries), without the target.
    pub alternates: Vec<String>,
    pub matched_blocks: usize,
    pub total_blocks: usize,
    /// The chosen worker's estimate: wait, prefill, recompute, cost.
    pub estimate: Estimate,
    /// The best-matched worker when another was chosen: its name, matched blocks and estimate
    /// (what the decision weighed against).
    pub passed_over: Option<(String, usize, Estimate)>,
    /// The request's estimated prefill window on the worker's queue clock, µs since the epoch
    /// (None when the load update was lost).
    pub prefill_window: Option<(u64, u64)>,
    /// The client asked for a stream (prefill then ends at the first response chunk).
    pub stream: bool,
    /// Media items in the request.
    pub media: usize,
    /// Block buckets read.
    pub probes: usize,
    /// The decision used the engine's KV events (the sidecar's feed was fresh).
    pub precise: bool,
    pub fallback: Option<Fallback>,
    /// The request went to its group's home instead of its lowest-cost worker
    /// (`scoring.home_hold`).
    pub home: bool,
    /// False when the load update or the decision record was lost (counted, not fatal).
    pub recorded: bool,
    /// What the engine frees when the request ends, for [`Router::released`] (None for a
    /// fallback).
    pub held: Option<Held>,
}

/// The blocks a routed request holds on its worker until it ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// The request's block keys (as recorded).
    pub keys: Vec<u64>,
    /// The worker's allocation clock and incarnation when the request was routed.
    pub clock: u64,
    pub incarnation: u8,
    /// Blocks the request itself allocates (they move the clock in approximate mode).
    pub new_blocks: u32,
}

impl Decision {
    /// The destination header's value: the chosen worker, then up to `alternates` next-best
    /// ones for retries (`ip:port,ip:port`).
    pub fn destination(&self, alternates: usize) -> String {
        let mut out = self.target.address.clone();
        for a in self.alternates.iter().take(alternates) {
            out.push(',');
            out.push_str(a);
        }
        out
    }
}

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
        if live.precise && self.config.router.scoring.admission_match {
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
        let home = self.config.router.scoring.home_hold
            && self.hold_home(
                keys,
                analysis.layout.preamble_blocks,
                &live,
                &eligible,
                &candidates,
                &mut choice,
                store,
                now_ms,
            );
        let slot = eligible.get(choice.index).copied()?;
        let target = self.target(slot)?;
        let estimate = choice.estimate();
        let matched = prefix.depth(slot).min(keys.len());
        let prefill_us = (estimate.prefill_s * 1e6) as u64;
        let end = self
            .load
            .route_after(store, &snapshot, slot, now_us, prefill_us);
        let new_blocks = (keys.len() - matched) as u32;
        if matched < keys.len() {
            self.record_last_key(store, &live, slot, keys, new_blocks);
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
                    keys.get(first..).unwrap_or(&[]),
                ),
            )
            .is_ok();
        let passed_over = choice.passed_over(&candidates).and_then(|i| {
            let s = *eligible.get(i)?;
            let t = self.target(s)?;
            Some((t.name, prefix.depth(s), *choice.estimates.get(i)?))
        });
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
            prefill_window: end.map(|e| (e.saturating_sub(prefill_us), e)),
            stream: analysis.stream,
            media: analysis.media.len(),
            probes: prefix.probes,
            precise: live.precise,
            fallback: None,
            home,
            recorded: end.is_some() && enqueued,
            held: live.get(slot).map(|l| Held {
                keys: keys.to_vec(),
                clock: l.clock,
                incarnation: l.incarnation,
                new_blocks,
            }),
        })
    }

    /// `scoring.home_hold`: counts the request in its group's home (the group is named by the
    /// key of the preamble's last block) and sends it there when [`goes_home`] says so.
    /// Returns whether it changed the choice.
    #[allow(clippy::too_many_arguments)]
    fn hold_home(
        &self,
        keys: &[u64],
        preamble_blocks: usize,
        live: &LiveTable,
        eligible: &[usize],
        candidates: &[Candidate],
        choice: &mut Choice,
        store: &dyn SharedStore,
        now_ms: u64,
    ) -> bool {
        let preamble = preamble_blocks.min(keys.len());
        let Some(&group) = preamble.checked_sub(1).and_then(|i| keys.get(i)) else {
            return false;
        };
        let workers: Vec<Eligible> = eligible
            .iter()
            .filter_map(|&slot| {
                live.get(slot).map(|l| Eligible {
                    slot,
                    incarnation: l.incarnation,
                })
            })
            .collect();
        let preferred = eligible.get(choice.index).copied().unwrap_or(usize::MAX);
        let half_life = self.config.router.scoring.footprint_half_life_ms;
        let (mut home, mut table) = (None, Homes::default());
        cas_update(store, &self.keys.homes(), |bytes| {
            let mut homes = Homes::decode(bytes);
            home = homes.visit(group, &workers, preferred, now_ms, half_life, HOME_GROUPS);
            let encoded = homes.encode();
            table = homes;
            Some(encoded)
        });
        let Some(index) = home.and_then(|h| eligible.iter().position(|&s| s == h)) else {
            return false;
        };
        let slack = self.config.router.scoring.home_load_slack;
        if !goes_home(choice, candidates, index, preamble, slack) {
            return false;
        }
        // A group with clearly more than one worker's share of the traffic (one application's
        // system prompt on every request, say) cannot keep to one worker: the cost spreads it.
        // Up to 1.5 shares are held, so that groups of about one share each (as many groups
        // as workers) are not let go whenever their recent rates wobble above it. Checked
        // last: it decays every group's rate, and most requests stop at `goes_home`.
        if table.share(group, now_ms, half_life) * workers.len() as f64 > HOME_MAX_SHARES {
            return false;
        }
        choice.prefer(index);
        true
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
        new_blocks: u32,
    ) {
        let (Some(&last), Some(l)) = (keys.last(), live.get(slot)) else {
            return;
        };
        let advance = if l.flags & flag::EVENTS == 0 {
            u64::from(new_blocks)
        } else {
            0
        };
        let stamp = (l.clock.wrapping_add(advance) as u32).wrapping_sub((keys.len() - 1) as u32);
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

    /// Precise mode: a worker's match is what its engine will still hold when it admits the
    /// request, after allocating the blocks of the prefill queued before it (the router's
    /// queue clock, at the worker's speed). In approximate mode the router's own decisions
    /// moved the worker's allocation clock already.
    fn cut_to_admission(
        &self,
        live: &LiveTable,
        loads: &[Load],
        eligible: &[usize],
        prefix: &mut PrefixMatch,
        now_us: u64,
    ) {
        let block = self.config.router.block_size.max(1) as f64;
        // A worker whose speed is not known yet drains its queue at the fleet's mean speed, as
        // in the cost (`route_analysis`); the configured default only when no speed is known.
        let unknown_tps = mean_known_speed(live, eligible)
            .unwrap_or(self.config.router.scoring.prefill_tokens_per_sec);
        for &s in eligible {
            let depth = prefix.depth(s);
            let (Some(l), Some(stamp)) =
                (live.get(s), prefix.deepest_stamps.get(s).copied().flatten())
            else {
                continue;
            };
            if depth == 0 {
                continue;
            }
            let speed = if l.prefill_tps > 0.0 {
                f64::from(l.prefill_tps)
            } else {
                unknown_tps
            };
            let queued_s = loads.get(s).map_or(0, |x| x.queued_us(now_us)) as f64 / 1e6;
            let ahead = queued_s * speed / block / f64::from(l.capacity.max(1));
            let first_age = prefix
                .first_stamps
                .get(s)
                .copied()
                .flatten()
                .map(|f| l.age(f));
            let keep = surviving_depth(depth, first_age, l.age(stamp), ahead);
            if let Some(d) = prefix.depths.get_mut(s) {
                *d = keep;
            }
        }
    }

    /// Precise mode: a worker's matched prefix stops at an image whose blocks its engine
    /// reported evicted. One image bucket read per image inside some worker's match.
    fn cap_by_images(
        &self,
        analysis: &Analysis,
        live: &LiveTable,
        depths: &mut [usize],
        store: &dyn SharedStore,
    ) {
        let mut spans: HashMap<u32, (usize, usize)> = HashMap::new();
        for m in &analysis.layout.media {
            let e = spans
                .entry(m.media)
                .or_insert((m.block as usize, m.block as usize));
            e.0 = e.0.min(m.block as usize);
            e.1 = e.1.max(m.block as usize);
        }
        let deepest = depths.iter().copied().max().unwrap_or(0);
        for (media, (first, last)) in spans {
            if first >= deepest {
                continue;
            }
            let Some(report) = analysis.media.get(media as usize) else {
                continue;
            };
            if report.id.source == IdSource::Url {
                continue;
            }
            let image = report.id.key64();
            let bucket = self.config.state.images.bucket_of(image);
            let Ok(Some((bytes, _))) = store.get(&self.keys.image_bucket(bucket)) else {
                continue;
            };
            let span = last - first + 1;
            for (slot, depth) in depths.iter_mut().enumerate() {
                if *depth <= first {
                    continue;
                }
                let Some(l) = live.get(slot) else { continue };
                match resident_blocks(&bytes, image, slot as u16, l.incarnation) {
                    Some(0) => *depth = first,
                    // The engine evicts a sequence's tail first: the image's first blocks
                    // are the ones left (engine and router blocks are the same size, offset by
                    // at most one block).
                    Some(b) if (b as usize) + 1 < span => *depth = (*depth).min(first + b as usize),
                    _ => {}
                }
            }
        }
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
        let end = self.load.route_after(store, &snapshot, slot, now_us, 0);
        Some(Decision {
            target,
            alternates: Vec::new(),
            matched_blocks: 0,
            total_blocks: 0,
            estimate: Estimate::default(),
            passed_over: None,
            prefill_window: None,
            stream: false,
            media: 0,
            probes: 0,
            precise: live.precise,
            fallback: Some(why),
            home: false,
            recorded: end.is_some(),
            held: None,
        })
    }

    /// The request's first response chunk arrived at `now_us` (prefill done).
    pub fn prefill_done(&self, store: &dyn SharedStore, d: &Decision, now_us: u64) -> bool {
        match d.prefill_window {
            Some((_, end)) => self.load.prefill_done(store, d.target.slot, now_us, end),
            None => false,
        }
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
                &decisions::encode(d.target.slot as u16, now_us / 1000, 0, 0, &held.keys),
            )
            .is_ok()
    }

    /// Every slot's load, as the shared table has it.
    pub fn loads(&self, store: &dyn SharedStore, slots: usize) -> Vec<Load> {
        self.load.read(store, slots)
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
        footprint: l.footprint_at(now_ms, half_life_ms),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::MemoryStore;
    use crate::state::writer::{drain, record_poll, sync_members};
    use crate::worker_metrics::{EngineScrape, WorkerMetrics};
    use base64::Engine as _;
    use test_images::png;

    fn config(workers: usize) -> FilterConfig {
        let ws: Vec<String> = (0..workers)
            .map(|i| format!(r#"{{"name":"w{i}","address":"127.0.0.1:{}"}}"#, 8000 + i))
            .collect();
        FilterConfig::from_json(format!(r#"{{"workers":[{}]}}"#, ws.join(",")).as_bytes())
            .expect("config")
    }

    /// A router over `n` workers whose membership the state writer has set up.
    fn router(store: &MemoryStore, n: usize) -> Router {
        start(store, config(n))
    }

    /// A router for `config`, its keys prepared and its configured workers the members.
    fn start(store: &MemoryStore, config: FilterConfig) -> Router {
        let r = Router::new(config);
        assert!(r.prepare(store));
        let desired: Vec<(String, String)> = r
            .config
            .workers
            .iter()
            .map(|w| (w.name.clone(), w.address.clone()))
            .collect();
        sync_members(store, r.keys(), &r.config.state, &desired, 0);
        r
    }

    fn apply(store: &MemoryStore, r: &Router, now_ms: u64) {
        drain(store, r.keys(), &r.config.state, 60_000, now_ms, 1000);
    }

    fn body(image: &[u8], text: &str) -> Vec<u8> {
        let b64 = base64::engine::general_purpose::STANDARD.encode(image);
        format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{b64}"}}}},{{"type":"text","text":"{text}"}}]}}]}}"#
        )
        .into_bytes()
    }

    fn route(r: &mut Router, store: &MemoryStore, b: &[u8], now_ms: u64, random: u64) -> Decision {
        r.route(b, store, now_ms * 1000, random)
            .0
            .expect("a worker")
    }

    #[test]
    fn same_image_goes_back_to_the_worker_that_has_it_even_from_another_vm() {
        let store = MemoryStore::default();
        let mut vm1 = router(&store, 4);
        let mut vm2 = Router::new(config(4));
        let b = body(&png(640, 480), "what is this");
        let first = route(&mut vm1, &store, &b, 1000, 3);
        assert_eq!(first.fallback, None);
        assert!(first.total_blocks > 10);
        assert_eq!(first.matched_blocks, 0);
        assert!(first.recorded);
        assert!(vm1.finished(&store, &first, 1_100_000, true));
        apply(&store, &vm1, 1001);
        let second = route(&mut vm2, &store, &b, 2000, 1);
        assert_eq!(second.target, first.target);
        assert_eq!(second.matched_blocks, second.total_blocks);
        assert_eq!(second.estimate.recompute_s, 0.0);
    }

    #[test]
    fn an_exact_repeat_matches_before_the_writer_has_applied_the_decision() {
        let store = MemoryStore::default();
        let mut r = router(&store, 4);
        let b = body(&png(500, 400), "same again");
        let first = route(&mut r, &store, &b, 1000, 3);
        r.prefill_done(&store, &first, 1_000_400);
        r.finished(&store, &first, 1_000_500, true);
        let second = route(&mut r, &store, &b, 1001, 9);
        assert_eq!(second.target, first.target);
        assert_eq!(second.matched_blocks, second.total_blocks);
    }

    /// The keys of every decision record waiting on the queue, as (first, key count).
    fn queued_records(store: &MemoryStore, r: &Router) -> Vec<(u32, usize)> {
        let mut out = Vec::new();
        while let Ok(Some(bytes)) = store.dequeue(&r.keys().decisions()) {
            let rec = decisions::DecisionRecord::decode(&bytes).expect("a record");
            out.push((rec.first, rec.keys.len()));
        }
        out
    }

    #[test]
    fn a_fresh_repeat_costs_the_writer_no_keys_and_a_grown_conversation_restamps_its_chain() {
        let store = MemoryStore::default();
        let mut r = router(&store, 2);
        let b = body(&png(500, 400), "same again");
        let first = route(&mut r, &store, &b, 1000, 3);
        r.finished(&store, &first, 1_000_500, true);
        assert_eq!(queued_records(&store, &r), vec![(0, first.total_blocks)]);
        // Before the writer applies it, the repeat matches through the last-key hint, whose
        // fresh stamp already stands for the whole chain.
        let again = route(&mut r, &store, &b, 1001, 9);
        r.finished(&store, &again, 1_001_500, true);
        let n = again.total_blocks as u32;
        assert_eq!(queued_records(&store, &r), vec![(n, 0)]);
        apply(&store, &r, 1002);
        let third = route(&mut r, &store, &b, 1003, 5);
        assert_eq!(third.matched_blocks, third.total_blocks);
        assert_eq!(queued_records(&store, &r), vec![(n, 0)]);
        // A longer prompt over the same prefix is recorded from its first key.
        let longer = body(&png(500, 400), &"and more words ".repeat(80));
        let grown = route(&mut r, &store, &longer, 1004, 5);
        assert!(grown.total_blocks > third.total_blocks);
        assert_eq!(queued_records(&store, &r), vec![(0, grown.total_blocks)]);
    }

    #[test]
    fn a_conversation_stays_on_its_kv_unless_the_wait_costs_more_than_the_recompute() {
        let store = MemoryStore::default();
        let mut r = router(&store, 2);
        let b = body(&png(1280, 960), "a long question about this picture");
        let first = route(&mut r, &store, &b, 0, 0);
        r.finished(&store, &first, 10_000, true);
        apply(&store, &r, 10);
        let home = first.target.slot;
        // Its worker has a little prefill queued: it still wins.
        let load = LoadTable::new(r.keys().load());
        let full_s = first.estimate.prefill_s;
        load.route(&store, home, 1_000_000, (full_s * 0.5 * 1e6) as u64);
        let again = route(&mut r, &store, &b, 1000, 0);
        assert_eq!(again.target.slot, home, "wait {:?}", again.estimate);
        assert!(again.estimate.wait_s > 0.0);
        r.finished(&store, &again, 1_000_000, false);
        // Its queue now holds six times the prompt's prefill: more than the recompute weighed
        // for the two requests in flight there (one per worker on average: twice, plus the
        // request's own time). Moving is cheaper.
        load.route(&store, home, 2_000_000, (full_s * 6.0 * 1e6) as u64);
        let moved = route(&mut r, &store, &b, 2000, 0);
        assert_ne!(moved.target.slot, home);
        let (name, matched, alt) = moved
            .passed_over
            .clone()
            .expect("names what it passed over");
        assert_eq!(name, first.target.name);
        assert_eq!(matched, moved.total_blocks);
        assert!(
            alt.wait_s > moved.estimate.recompute_s,
            "{alt:?} vs {:?}",
            moved.estimate
        );
    }

    #[test]
    fn distinct_images_behind_a_shared_prefix_spread_over_idle_workers() {
        let store = MemoryStore::default();
        let mut r = router(&store, 4);
        let mut used = std::collections::HashSet::new();
        for i in 0..4u32 {
            let b = body(&png(300 + i, 300), "Describe this image.");
            let d = route(&mut r, &store, &b, u64::from(i) * 1000, u64::from(i));
            // Each finishes before the next arrives: only the cache footprint tells them apart.
            r.finished(&store, &d, u64::from(i) * 1_000_000 + 500_000, true);
            apply(&store, &r, u64::from(i) * 1000 + 600);
            used.insert(d.target.slot);
        }
        assert_eq!(used.len(), 4, "new content spreads: {used:?}");
    }

    fn with_system(system: &str, image: &[u8], text: &str) -> Vec<u8> {
        let b64 = base64::engine::general_purpose::STANDARD.encode(image);
        format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{b64}"}}}},{{"type":"text","text":"{text}"}}]}}]}}"#
        )
        .into_bytes()
    }

    fn home_hold(workers: usize, slack: f64) -> FilterConfig {
        let ws: Vec<String> = (0..workers)
            .map(|i| format!(r#"{{"name":"w{i}","address":"127.0.0.1:{}"}}"#, 8000 + i))
            .collect();
        let json = format!(
            r#"{{"workers":[{}],"scoring":{{"home_hold":true,"home_load_slack":{slack}}}}}"#,
            ws.join(",")
        );
        FilterConfig::from_json(json.as_bytes()).expect("config")
    }

    /// Two applications (system prompts) taking turns two requests at a time, each with a new image, none
    /// finished before the next: (group, worker, went home) of each.
    fn two_groups(r: &mut Router, store: &MemoryStore) -> Vec<(usize, usize, bool)> {
        let systems = [
            "You are assistant one. ".repeat(20),
            "You are assistant two. ".repeat(20),
        ];
        // Both applications seen a few times (their requests finished): each has half the
        // traffic, no more than one worker's share.
        for i in 0..6u32 {
            let g = (i % 2) as usize;
            let b = with_system(&systems[g], &png(500 + i, 600), "Describe this image.");
            let d = route(r, store, &b, 0, u64::from(i));
            apply(store, r, 1);
            assert!(r.finished(store, &d, 2000, true));
        }
        let mut out = Vec::new();
        for i in 0..8u32 {
            let g = (i / 2 % 2) as usize;
            let b = with_system(&systems[g], &png(600 + i, 600), "Describe this image.");
            let t = u64::from(i);
            // None finishes: the load spreads them, and only the homes keep groups together.
            let d = route(r, store, &b, t, u64::from(i));
            apply(store, r, t + 600);
            out.push((g, d.target.slot, d.home));
        }
        out
    }

    #[test]
    fn with_home_hold_each_group_keeps_to_one_worker_and_the_groups_to_different_ones() {
        let store = MemoryStore::default();
        let mut r = start(&store, home_hold(2, 1.0));
        let went = two_groups(&mut r, &store);
        let homes: Vec<std::collections::HashSet<usize>> = (0..2)
            .map(|g| went.iter().filter(|w| w.0 == g).map(|w| w.1).collect())
            .collect();
        assert_eq!(homes[0].len(), 1, "group 0 on one worker: {went:?}");
        assert_eq!(homes[1].len(), 1, "group 1 on one worker: {went:?}");
        assert_ne!(
            homes[0], homes[1],
            "the groups on different workers: {went:?}"
        );
        assert!(
            went.iter().any(|w| w.2),
            "some went home against the cost: {went:?}"
        );
        // Without it, the queues spread each group over both workers.
        let store = MemoryStore::default();
        let mut off = home_hold(2, 1.0);
        off.router.scoring.home_hold = false;
        let mut plain = start(&store, off);
        let went = two_groups(&mut plain, &store);
        assert!(went.iter().all(|w| !w.2));
        let spread = (0..2)
            .filter(|&g| {
                let used: std::collections::HashSet<usize> =
                    went.iter().filter(|w| w.0 == g).map(|w| w.1).collect();
                used.len() > 1
            })
            .count();
        assert!(spread > 0, "{went:?}");
    }

    #[test]
    fn a_home_past_its_load_bound_is_not_held_to() {
        let store = MemoryStore::default();
        let mut r = start(&store, home_hold(2, 0.25));
        let system = "You are assistant one. ".repeat(20);
        // Another application's traffic first (finished), so that this one's is no more than
        // one worker's share.
        let other = "You are assistant two. ".repeat(20);
        for i in 0..8u32 {
            let b = with_system(&other, &png(300 + i, 600), "Describe this image.");
            let d = route(&mut r, &store, &b, u64::from(i), u64::from(i));
            apply(&store, &r, u64::from(i) + 1);
            assert!(r.finished(&store, &d, (u64::from(i) + 1) * 1000, true));
        }
        // None finishes: the home fills up to the bound (ceil(1.25 × mean)), then the rest go
        // to the other worker.
        let (mut slots, mut held) = (Vec::new(), false);
        for i in 0..8u32 {
            let b = with_system(&system, &png(600 + i, 600), "Describe this image.");
            let d = route(&mut r, &store, &b, u64::from(i), u64::from(i));
            apply(&store, &r, u64::from(i) + 1);
            slots.push(d.target.slot);
            held |= d.home;
        }
        assert!(
            held,
            "the hold kept some at home against the cost: {slots:?}"
        );
        let home = slots[0];
        let at_home = slots.iter().filter(|&&s| s == home).count();
        assert!(
            (4..=5).contains(&at_home),
            "at most ceil(1.25 × 8 / 2) = 5 at home, and not spread evenly by cost alone: {slots:?}"
        );
    }

    #[test]
    fn an_application_whose_prompt_is_on_every_request_is_not_held_to_one_worker() {
        // One system prompt on all traffic: more than one worker's share, so the cost
        // spreads its new content as without homes (with the hold, at 2 workers and the
        // default bound, every request would go to the one home).
        let store = MemoryStore::default();
        let mut r = start(&store, home_hold(2, 1.0));
        let system = "You are assistant one. ".repeat(20);
        let mut slots = Vec::new();
        for i in 0..8u32 {
            let t = 200 + u64::from(i) * 10;
            let b = with_system(&system, &png(900 + i, 500), "Describe this image.");
            let d = route(&mut r, &store, &b, t, u64::from(i));
            apply(&store, &r, t + 1);
            assert!(!d.home, "request {i} held home");
            assert!(r.finished(&store, &d, (t + 5) * 1000, true));
            slots.push(d.target.slot);
        }
        let on_first = slots.iter().filter(|&&s| s == slots[0]).count();
        assert!(on_first < slots.len(), "spread over both: {slots:?}");
    }

    #[test]
    fn the_destination_lists_the_next_best_workers_for_retries() {
        let store = MemoryStore::default();
        let mut r = router(&store, 4);
        let d = route(&mut r, &store, &body(&png(90, 90), "x"), 0, 0);
        assert_eq!(d.destination(0), d.target.address);
        let list = d.destination(2);
        let parts: Vec<&str> = list.split(',').collect();
        assert_eq!(parts.len(), 3);
        assert_eq!(parts[0], d.target.address);
        assert_eq!(&parts[1..], &d.alternates[..2]);
        assert!(!d.alternates.contains(&d.target.address));
        assert_eq!(
            d.destination(9).split(',').count(),
            4,
            "at most every worker once"
        );
    }

    #[test]
    fn load_is_counted_and_released_through_the_phases() {
        let store = MemoryStore::default();
        let mut r = router(&store, 2);
        let d = route(&mut r, &store, &body(&png(100, 100), "x"), 0, 0);
        let (start, end) = d.prefill_window.expect("window");
        assert!(end > start);
        let loads = r.loads(&store, 2);
        assert_eq!(loads[d.target.slot].inflight, 1);
        assert_eq!(loads[d.target.slot].queue_until_us, end);
        assert!(r.prefill_done(&store, &d, start + 10));
        assert_eq!(r.loads(&store, 2)[d.target.slot].queue_until_us, start + 10);
        assert!(r.finished(&store, &d, start + 20, true));
        assert_eq!(r.loads(&store, 2)[d.target.slot].inflight, 0);
    }

    /// Moves `slot`'s allocation clock by `blocks` (other requests' allocations).
    fn allocate_elsewhere(store: &MemoryStore, r: &Router, slot: usize, blocks: u64) {
        crate::state::writer::update_live(store, r.keys(), 0, |t| {
            if let Some(l) = t.slots.get_mut(slot) {
                l.clock += blocks;
            }
            true
        });
    }

    #[test]
    fn a_request_that_ends_late_keeps_its_blocks_cached_from_its_end_not_its_start() {
        let capacity = u64::from(config(2).state.capacity_blocks);
        let image = png(300, 200);
        let matched_after = |release: bool| {
            let store = MemoryStore::default();
            let mut r = router(&store, 2);
            let d = route(&mut r, &store, &body(&image, "what is this?"), 0, 0);
            apply(&store, &r, 1);
            // The request queued and decoded while its worker allocated 0.9 of its capacity
            // for others; then it ended and its engine freed its blocks.
            allocate_elsewhere(&store, &r, d.target.slot, capacity * 9 / 10);
            if release {
                assert!(
                    r.released(&store, &d, 2_000),
                    "blocks freed after 0.9 capacity are restamped"
                );
                apply(&store, &r, 2);
            }
            // Half a capacity more: by the routing-time stamps they are evicted.
            allocate_elsewhere(&store, &r, d.target.slot, capacity / 2);
            let again = route(&mut r, &store, &body(&image, "what is this?"), 3, 1);
            (
                again.target.slot == d.target.slot,
                again.matched_blocks,
                d.total_blocks,
            )
        };
        let (same, matched, total) = matched_after(true);
        assert!(same && matched == total, "{matched}/{total} after release");
        let (_, matched, _) = matched_after(false);
        assert_eq!(matched, 0, "without the release the model forgets them");
    }

    #[test]
    fn a_request_that_ends_soon_adds_no_record() {
        let store = MemoryStore::default();
        let mut r = router(&store, 2);
        let d = route(&mut r, &store, &body(&png(300, 200), "x"), 0, 0);
        apply(&store, &r, 1);
        assert!(!r.released(&store, &d, 1_000), "nothing allocated since");
        assert!(queued_records(&store, &r).is_empty());
    }

    #[test]
    fn bad_bodies_fall_back_to_the_least_loaded_worker() {
        let store = MemoryStore::default();
        let mut r = router(&store, 3);
        let busy = route(&mut r, &store, &body(&png(64, 64), "a"), 0, 0);
        let (d, a) = r.route(b"not json", &store, 0, 0);
        let d = d.expect("a worker");
        assert_eq!(d.fallback, Some(Fallback::Analyze("bad_json")));
        assert!(a.is_none());
        assert_ne!(d.target, busy.target, "least loaded, not the busy one");
        let mut corrupt = png(64, 64);
        corrupt.truncate(20);
        let d = route(&mut r, &store, &body(&corrupt, "a"), 0, 0);
        assert_eq!(d.fallback, Some(Fallback::Analyze("bad_image")));
        let mut small = config(3);
        small.router.limits.max_body_bytes = 10;
        let mut r = Router::new(small);
        let d = route(&mut r, &store, &body(&png(64, 64), "a"), 0, 0);
        assert_eq!(d.fallback, Some(Fallback::TooLarge));
    }

    #[test]
    fn no_known_worker_means_no_decision() {
        let store = MemoryStore::default();
        let mut r = Router::new(config(2));
        assert_eq!(r.route(&body(&png(8, 8), "x"), &store, 0, 0).0, None);
    }

    #[test]
    fn failing_workers_are_skipped_and_come_back_with_their_cache() {
        let store = MemoryStore::default();
        let mut r = router(&store, 2);
        let idle = EngineScrape {
            load: WorkerMetrics::default(),
            ..EngineScrape::default()
        };
        let b = body(&png(300, 300), "again");
        let first = route(&mut r, &store, &b, 2000, 5);
        r.finished(&store, &first, 2_100_000, true);
        apply(&store, &r, 2100);
        let keys = r.keys().clone();
        for t in 0..3 {
            assert!(!record_poll(
                &store,
                &keys,
                16,
                3,
                first.target.slot,
                None,
                2100 + t
            ));
        }
        let second = route(&mut r, &store, &b, 2300, 5);
        assert_ne!(second.target, first.target);
        let (fallback, _) = r.route(b"{", &store, 2_300_000, 5);
        assert_ne!(
            fallback.expect("a worker").target,
            first.target,
            "fallbacks avoid it too"
        );
        assert!(record_poll(
            &store,
            &keys,
            16,
            3,
            first.target.slot,
            Some(idle),
            2400
        ));
        r.finished(&store, &second, 2_400_000, true);
        // w0 is eligible again and its cache was kept (w1 has a copy now too: the one with
        // less recent new content wins).
        let third = route(&mut r, &store, &b, 2500, 5);
        assert_eq!(third.matched_blocks, third.total_blocks);
        let w0_full = third.target == first.target
            || third
                .passed_over
                .as_ref()
                .is_some_and(|(name, m, _)| *name == first.target.name && *m == third.total_blocks);
        assert!(w0_full, "{third:?}");
    }

    #[test]
    fn least_loaded_spreads_ties() {
        let loads = vec![Load::default(); 4];
        let slots = [0, 1, 2, 3];
        let picks: std::collections::HashSet<usize> = (0..16)
            .filter_map(|r| least_loaded(&slots, &loads, 0, r))
            .collect();
        assert_eq!(picks.len(), 4);
        let mut loads = loads;
        for l in loads.iter_mut().take(3) {
            l.inflight = 1;
        }
        assert_eq!(least_loaded(&slots, &loads, 0, 12345), Some(3));
        assert_eq!(
            least_loaded(&[0, 1], &loads, 0, 12345).map(|s| s < 2),
            Some(true)
        );
        assert_eq!(least_loaded(&[], &loads, 0, 1), None);
    }
}
