//! The longest prefix each worker holds, in O(log n) bucket reads.
//!
//! A request's block keys are chained (each covers its parent), and a worker holds a block
//! only together with its ancestors: routing records a request's whole prefix at once, and a
//! block's ancestors are touched whenever it is, so they are never older than it. Whether a
//! worker holds key `i` is therefore monotone in `i`, and its matched prefix is the first key
//! it does not hold: a binary search. One probe (one bucket read) answers "does w hold key i"
//! for every worker at once, so the search runs over all workers together:
//!
//! 1. probe the last key: its holders hold the whole request (an exact repeat costs 1 read);
//! 2. probe key 0: the workers that hold anything (none: nobody has this prefix, 2 reads);
//! 3. repeatedly take the unresolved worker with the longest known prefix and probe the middle
//!    of its interval, updating every worker's bounds with the answer,
//!
//! until every worker is resolved or `max_probes` is spent (then a worker's depth is the
//! longest prefix proven, never more). With k distinct depths among the workers it costs about
//! k·log2(n) probes; the longest matches, the ones routing turns on, resolve first.
//!
//! Positive evidence wins over negative: a worker seen holding key `i` holds the first `i + 1`
//! keys even if an earlier probe found it missing a shallower key. That happens in the moments
//! after a decision, when the deciding VM has recorded the request's last key itself and the
//! state writer has not yet recorded the rest (see `filter::router`), and when a full bucket
//! dropped an ancestor the engine still holds.

use super::blocks::{BlocksConfig, Holder, holders_of};
use super::workers::Live;

/// The result of [`match_prefix`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PrefixMatch {
    /// Leading keys held, per slot.
    pub depths: Vec<usize>,
    /// Per slot, the stamp of the deepest key it was seen holding (the oldest stamp of its
    /// match: a request's stamps only get older along its chain).
    pub deepest_stamps: Vec<Option<u32>>,
    /// Per slot, the stamp of the request's first key when it was read (the newest stamp of
    /// its match). None when key 0 was not read: a match proven by the last key alone.
    pub first_stamps: Vec<Option<u32>>,
    /// Bucket reads made.
    pub probes: usize,
}

impl PrefixMatch {
    pub fn depth(&self, slot: usize) -> usize {
        self.depths.get(slot).copied().unwrap_or(0)
    }

    pub fn best(&self) -> usize {
        self.depths.iter().copied().max().unwrap_or(0)
    }
}

/// A good probe budget for `n` keys: enough for a handful of distinct depths.
pub fn default_probes(n: usize) -> usize {
    let log = (usize::BITS - n.leading_zeros()) as usize;
    2 + 4 * log
}

/// Matches `keys` against the block buckets. `fetch(bucket)` reads one bucket (None when it
/// does not exist or cannot be read); `live` validates holders.
pub fn match_prefix(
    keys: &[u64],
    live: &[Live],
    config: &BlocksConfig,
    max_probes: usize,
    fetch: &mut dyn FnMut(u32) -> Option<Vec<u8>>,
) -> PrefixMatch {
    let slots = live.len();
    let n = keys.len();
    let mut lo = vec![0usize; slots];
    let mut hi = vec![n; slots];
    let mut result = PrefixMatch {
        depths: vec![0; slots],
        deepest_stamps: vec![None; slots],
        first_stamps: vec![None; slots],
        probes: 0,
    };
    // Per slot, the stamp seen at its deepest held key so far (that depth is `lo`).
    let mut stamps: Vec<Option<u32>> = vec![None; slots];
    let mut firsts: Vec<Option<u32>> = vec![None; slots];
    if n == 0 || slots == 0 {
        return result;
    }
    let mut holders: Vec<Holder> = Vec::new();
    let mut present = vec![false; slots];
    let mut probe = |i: usize, lo: &mut [usize], hi: &mut [usize], probes: &mut usize| {
        let Some(&key) = keys.get(i) else {
            return;
        };
        *probes += 1;
        holders.clear();
        if let Some(bytes) = fetch(config.bucket_of(key)) {
            holders_of(&bytes, key, &mut holders);
        }
        present.iter_mut().for_each(|p| *p = false);
        for h in &holders {
            let s = usize::from(h.slot);
            if live.get(s).is_some_and(|l| l.holds(h.stamp))
                && let Some(p) = present.get_mut(s)
            {
                *p = true;
                if i == 0
                    && let Some(f) = firsts.get_mut(s)
                {
                    *f = Some(h.stamp);
                }
                if let (Some(d), Some(&l)) = (stamps.get_mut(s), lo.get(s))
                    && (d.is_none() || i + 1 > l)
                {
                    *d = Some(h.stamp);
                }
            }
        }
        for ((l, h), &held) in lo.iter_mut().zip(hi.iter_mut()).zip(present.iter()) {
            if held {
                *l = (*l).max(i + 1);
                *h = (*h).max(*l);
            } else if i >= *l {
                *h = (*h).min(i);
            }
        }
    };
    probe(n - 1, &mut lo, &mut hi, &mut result.probes);
    if n > 1 && lo.iter().any(|&l| l < n) {
        probe(0, &mut lo, &mut hi, &mut result.probes);
    }
    if lo.iter().all(|&l| l == 0) {
        return result;
    }
    while result.probes < max_probes {
        // The unresolved worker with the longest proven prefix.
        let next = lo
            .iter()
            .zip(hi.iter())
            .enumerate()
            .filter(|(_, (l, h))| l < h && **l > 0)
            .max_by_key(|(s, (l, _))| (**l, std::cmp::Reverse(*s)))
            .map(|(_, (l, h))| (*l + *h) / 2);
        let Some(mid) = next else {
            break;
        };
        probe(mid, &mut lo, &mut hi, &mut result.probes);
    }
    result.depths = lo;
    result.deepest_stamps = stamps;
    result.first_stamps = firsts;
    result
}

/// How much of a worker's match is still cached when the request is admitted.
///
/// The engine admits a request after those queued before it, and allocates their blocks
/// first, evicting the least recently freed: `ahead` is those blocks as a share of the
/// worker's capacity. A matched key survives while its age (a share of the capacity, see
/// [`Live::age`]) plus `ahead` stays below 1. A chain's stamps only get older with depth,
/// so the first key is the newest: the ages between the first and the deepest key are
/// interpolated, and the match is cut where they cross. `first_age` None: the match was
/// proven by its last key alone (one request wrote it whole), every key as old as it. Ages
/// may be negative (see [`Live::signed_age`]): a request's blocks are stamped with the clock
/// its worker will have once it has stored them, and only the queue beyond that ages them.
pub fn surviving_depth(
    depth: usize,
    first_age: Option<f64>,
    deepest_age: f64,
    ahead: f64,
) -> usize {
    let room = 1.0 - ahead.max(0.0);
    let deepest = deepest_age;
    let first = first_age.map_or(deepest, |a| a.min(deepest));
    if depth == 0 || !room.is_finite() || deepest < room {
        return depth;
    }
    if first >= room || depth == 1 {
        return 0;
    }
    // Key i's age: first + (deepest - first) * i / (depth - 1); keep those below room.
    let last = (room - first) / (deepest - first) * (depth - 1) as f64;
    if last.is_finite() {
        ((last.floor() as usize) + 1).min(depth)
    } else {
        depth
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::blocks::Bucket;
    use crate::state::workers::flag;
    use std::collections::HashMap;

    /// Buckets where slot `s` holds the first `depths[s]` of `keys`.
    fn buckets(
        keys: &[u64],
        depths: &[usize],
        config: &BlocksConfig,
        live: &[Live],
    ) -> HashMap<u32, Vec<u8>> {
        let mut map: HashMap<u32, Bucket> = HashMap::new();
        for (slot, &d) in depths.iter().enumerate() {
            for &k in keys.iter().take(d) {
                map.entry(config.bucket_of(k))
                    .or_default()
                    .touch(k, slot as u16, 0, live, config);
            }
        }
        map.into_iter().map(|(b, v)| (b, v.encode())).collect()
    }

    fn live(n: usize) -> Vec<Live> {
        vec![
            Live {
                capacity: 1 << 20,
                flags: flag::ACTIVE,
                ..Live::default()
            };
            n
        ]
    }

    fn run(n_keys: usize, depths: &[usize], max_probes: usize) -> PrefixMatch {
        let config = BlocksConfig::default();
        let keys: Vec<u64> = (0..n_keys as u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
            .collect();
        let l = live(depths.len());
        let b = buckets(&keys, depths, &config, &l);
        match_prefix(&keys, &l, &config, max_probes, &mut |i| b.get(&i).cloned())
    }

    #[test]
    fn a_match_survives_the_queue_ahead_only_where_its_blocks_are_young_enough() {
        // Nothing queued ahead: the whole match, whatever its age below 1.
        assert_eq!(surviving_depth(100, Some(0.1), 0.9, 0.0), 100);
        // 0.3 of the capacity queued ahead: blocks older than 0.7 go first.
        assert_eq!(surviving_depth(100, Some(0.1), 0.6, 0.3), 100);
        assert_eq!(surviving_depth(100, Some(0.8), 0.9, 0.3), 0);
        // First key 0.1 old, deepest 0.9, a quarter queued ahead: key i is 0.1 + 0.008 i
        // old, and keys 0..=81 are younger than 0.75.
        let cut = surviving_depth(101, Some(0.1), 0.9, 0.25);
        assert_eq!(cut, 82);
        // The deeper the queue, the shorter the match, never longer.
        let mut last = 101;
        for ahead in [0.0, 0.1, 0.2, 0.4, 0.6, 0.8, 0.95, 1.0, 3.0] {
            let d = surviving_depth(101, Some(0.1), 0.9, ahead);
            assert!(d <= last, "{ahead}: {d} > {last}");
            last = d;
        }
        assert_eq!(last, 0);
        // Proven by its last key alone: the chain is as old as that key.
        assert_eq!(surviving_depth(50, None, 0.5, 0.4), 50);
        assert_eq!(surviving_depth(50, None, 0.7, 0.4), 0);
        // Stamped ahead of the clock (a request whose engine has not stored its blocks yet):
        // only the part of the queue beyond the stamp ages them.
        assert_eq!(surviving_depth(50, Some(-0.3), -0.2, 0.9), 50);
        assert_eq!(surviving_depth(50, Some(-0.3), -0.2, 1.3), 0);
        assert_eq!(surviving_depth(101, Some(-0.1), 0.1, 1.0), 51);
        // Bad numbers never panic and never lengthen a match.
        for (f, d, a) in [
            (Some(f64::NAN), 0.5, 0.2),
            (Some(0.9), 0.1, 0.5),
            (None, f64::NAN, 0.1),
            (None, 0.5, f64::NAN),
            (None, 0.5, -1.0),
            (Some(0.2), f64::NAN, 0.5),
            (Some(-0.5), -0.1, f64::INFINITY),
        ] {
            assert!(surviving_depth(10, f, d, a) <= 10);
        }
        assert_eq!(surviving_depth(0, Some(0.0), 0.0, 0.0), 0);
    }

    #[test]
    fn new_content_costs_two_reads_and_an_exact_repeat_one() {
        let m = run(200, &[0, 0, 0], 100);
        assert_eq!(m.depths, vec![0, 0, 0]);
        assert_eq!(m.probes, 2);
        let m = run(200, &[200, 200], 100);
        assert_eq!(m.depths, vec![200, 200]);
        assert_eq!(m.probes, 1);
    }

    #[test]
    fn a_recorded_last_key_proves_the_whole_prefix() {
        // Only the last key is recorded yet (the decision's first write).
        let config = BlocksConfig::default();
        let keys: Vec<u64> = (1..=50).collect();
        let l = live(2);
        let mut b = Bucket::default();
        b.touch(50, 1, 0, &l, &config);
        let bytes = b.encode();
        let bucket = config.bucket_of(50);
        let m = match_prefix(&keys, &l, &config, 20, &mut |i| {
            (i == bucket).then(|| bytes.clone())
        });
        assert_eq!(m.depths, vec![0, 50]);
    }

    #[test]
    fn every_depth_is_found_exactly_with_enough_probes() {
        let depths = [150, 10, 10, 0, 200, 37];
        let m = run(200, &depths, 1000);
        assert_eq!(m.depths, depths.to_vec());
        assert!(m.probes <= 4 * 8 + 2, "{} probes", m.probes);
    }

    #[test]
    fn the_longest_match_resolves_within_a_log_budget() {
        let depths = [141, 2, 2, 2];
        let m = run(150, &depths, default_probes(150));
        assert_eq!(m.depth(0), 141);
        assert!(m.probes <= default_probes(150));
        // A tiny budget never over-states a depth.
        for budget in 0..12 {
            let m = run(150, &depths, budget);
            for (s, &d) in depths.iter().enumerate() {
                assert!(m.depth(s) <= d, "budget {budget}: slot {s}");
            }
        }
    }

    #[test]
    fn the_deepest_stamp_seen_is_reported_per_slot() {
        let config = BlocksConfig::default();
        let keys: Vec<u64> = (1..=8).collect();
        let l = live(2);
        let mut b: HashMap<u32, Bucket> = HashMap::new();
        for (i, &k) in keys.iter().enumerate() {
            // Slot 0 holds all with stamps 100 - i (head freshest), slot 1 nothing.
            b.entry(config.bucket_of(k))
                .or_default()
                .touch(k, 0, 100 - i as u32, &l, &config);
        }
        let enc: HashMap<u32, Vec<u8>> = b.into_iter().map(|(k, v)| (k, v.encode())).collect();
        let m = match_prefix(&keys, &l, &config, 20, &mut |i| enc.get(&i).cloned());
        assert_eq!(m.depths, vec![8, 0]);
        assert_eq!(m.deepest_stamps, vec![Some(93), None]);
    }

    #[test]
    fn expired_holders_do_not_match() {
        let config = BlocksConfig::default();
        let keys = [11u64, 22, 33];
        let mut l = live(2);
        l[0].capacity = 4;
        let b = buckets(&keys, &[3, 3], &config, &l);
        l[0].clock = 4; // four newer blocks allocated on slot 0: evicted
        let m = match_prefix(&keys, &l, &config, 20, &mut |i| b.get(&i).cloned());
        assert_eq!(m.depths, vec![0, 3]);
    }
}
