//! Behaviour of the prefix index: LRU capacity, TTL, removal, prefix matching, memory bound.

use mmrouter::index::{IndexConfig, PrefixIndex};

fn index(capacity_blocks: usize, ttl_ms: u64, workers: usize) -> PrefixIndex {
    PrefixIndex::new(
        IndexConfig {
            capacity_blocks,
            ttl_ms,
        },
        workers,
    )
}

fn matches(index: &PrefixIndex, keys: &[u64], now_ms: u64) -> Vec<usize> {
    let mut out = Vec::new();
    index.match_prefix(keys, now_ms, &mut out);
    out
}

/// Whether `worker` holds `key` (as a one-key prefix).
fn holds(index: &PrefixIndex, worker: usize, key: u64, now_ms: u64) -> bool {
    matches(index, &[key], now_ms)[worker] == 1
}

#[test]
fn capacity_evicts_least_recently_used_and_touches_refresh() {
    let mut ix = index(3, 0, 1);
    ix.insert(0, &[1], 0);
    ix.insert(0, &[2], 1);
    ix.insert(0, &[3], 2);
    // Touch 1: now 2 is the least recently used.
    ix.insert(0, &[1], 3);
    ix.insert(0, &[4], 4);
    assert!(!holds(&ix, 0, 2, 5), "2 was least recently used");
    for k in [1, 3, 4] {
        assert!(holds(&ix, 0, k, 5), "{k} must remain");
    }
    ix.insert(0, &[5], 6);
    assert!(!holds(&ix, 0, 3, 7), "then 3");
    assert_eq!(ix.blocks(0), 3);
    ix.check_consistency().unwrap();
}

#[test]
fn a_request_tail_is_evicted_before_its_head() {
    let mut ix = index(4, 0, 1);
    ix.insert(0, &[10, 11, 12, 13], 0);
    ix.insert(0, &[20], 1);
    // The tail block 13 goes first, so the prefix 10,11,12 still matches.
    assert_eq!(matches(&ix, &[10, 11, 12, 13], 2), vec![3]);
    // A request longer than the capacity keeps its head.
    ix.insert(0, &[30, 31, 32, 33, 34, 35], 3);
    assert_eq!(matches(&ix, &[30, 31, 32, 33, 34, 35], 4), vec![4]);
    ix.check_consistency().unwrap();
}

#[test]
fn ttl_expires_exactly_at_insert_time_plus_ttl() {
    let mut ix = index(100, 1000, 2);
    ix.insert(0, &[1, 2], 5000);
    assert_eq!(matches(&ix, &[1, 2], 5999), vec![2, 0]);
    assert_eq!(matches(&ix, &[1, 2], 6000), vec![0, 0]);
    // A touch extends the expiry from the touch time.
    ix.insert(1, &[1, 2], 5000);
    ix.insert(1, &[1], 5500);
    assert_eq!(matches(&ix, &[1, 2], 6499), vec![0, 1]);
    assert_eq!(matches(&ix, &[1, 2], 6500), vec![0, 0]);
}

#[test]
fn ttl_zero_never_expires_and_pinned_entries_stay_pinned() {
    let mut ix = index(100, 0, 1);
    ix.insert(0, &[1], 0);
    assert_eq!(matches(&ix, &[1], u64::MAX), vec![1]);

    let mut ix = index(100, 1000, 1);
    ix.insert_with_ttl(0, &[7], 0, 0); // precise source: no expiry
    ix.insert(0, &[7], 10); // an approximate touch does not shorten it
    assert_eq!(matches(&ix, &[7], 1_000_000), vec![1]);
}

#[test]
fn expired_entries_are_reclaimed_by_later_inserts_and_expire() {
    let mut ix = index(1000, 100, 2);
    ix.insert(0, &(0..50).collect::<Vec<u64>>(), 0);
    ix.insert(1, &(100..150).collect::<Vec<u64>>(), 0);
    assert_eq!(ix.entries(), 100);
    // An insert into worker 0 after expiry reclaims worker 0's entries (and sweeps one other).
    ix.insert(0, &[500], 200);
    assert!(ix.blocks(0) == 1, "{}", ix.blocks(0));
    ix.insert(0, &[501], 201);
    assert_eq!(ix.blocks(1), 0, "round-robin sweep reached worker 1");
    assert_eq!(ix.entries(), 2);
    assert_eq!(ix.expire(301), 2);
    assert_eq!(ix.entries(), 0);
    assert_eq!(ix.keys(), 0);
    ix.check_consistency().unwrap();
}

#[test]
fn churn_with_ttl_stays_bounded_by_live_entries() {
    // Capacity is large; only the TTL keeps the index small under churn.
    let mut ix = index(1 << 20, 1000, 4);
    let mut next = 0u64;
    for t in 0..20_000u64 {
        let keys: Vec<u64> = (next..next + 8).collect();
        next += 8;
        ix.insert((t % 4) as usize, &keys, t * 10);
    }
    // 100 inserts of 8 keys live per 1000 ms window, plus what the sweep has not reached.
    assert!(ix.entries() <= 2 * 100 * 8, "{}", ix.entries());
    ix.check_consistency().unwrap();
}

#[test]
fn remove_and_clear_forget_keys() {
    let mut ix = index(100, 0, 2);
    ix.insert(0, &[1, 2, 3], 0);
    ix.insert(1, &[1, 2, 3], 0);
    ix.remove(0, &[2, 99]);
    assert_eq!(matches(&ix, &[1, 2, 3], 0), vec![1, 3]);
    assert_eq!(ix.blocks(0), 2);
    ix.clear(1);
    assert_eq!(matches(&ix, &[1, 2, 3], 0), vec![1, 0]);
    assert_eq!(ix.blocks(1), 0);
    assert_eq!(ix.entries(), 2);
    // Unknown workers are ignored, not a panic.
    ix.remove(7, &[1]);
    ix.clear(7);
    ix.insert(7, &[1], 0);
    ix.check_consistency().unwrap();
}

#[test]
fn prefix_stops_at_the_first_miss() {
    let mut ix = index(100, 0, 1);
    ix.insert(0, &[1, 2, 3, 4, 5], 0);
    ix.remove(0, &[3]);
    // Keys 4 and 5 are held but do not count: the chain broke at 3.
    assert_eq!(matches(&ix, &[1, 2, 3, 4, 5], 0), vec![2]);
    assert_eq!(matches(&ix, &[2, 3], 0), vec![1]);
    assert_eq!(matches(&ix, &[9, 1, 2], 0), vec![0]);
    assert_eq!(matches(&ix, &[], 0), vec![0]);
}

#[test]
fn several_workers_match_their_own_prefixes() {
    let mut ix = index(100, 0, 4);
    ix.insert(0, &[1, 2, 3, 4], 0);
    ix.insert(1, &[1, 2], 0);
    ix.insert(2, &[1, 2, 3, 4, 5, 6], 0);
    ix.insert(3, &[2, 3, 4], 0); // not a prefix of the request
    let mut out = vec![42; 9]; // stale contents are overwritten
    let best = ix.match_prefix(&[1, 2, 3, 4, 5, 7], 0, &mut out);
    assert_eq!(out, vec![4, 2, 5, 0]);
    assert_eq!(best, 5);
    ix.check_consistency().unwrap();
}

#[test]
fn set_workers_keeps_remaining_state_and_drops_the_rest() {
    let mut ix = index(100, 0, 3);
    ix.insert(0, &[1, 2], 0);
    ix.insert(1, &[1, 2, 3], 0);
    ix.insert(2, &[1, 4], 0);
    ix.set_workers(2);
    assert_eq!(ix.workers(), 2);
    assert_eq!(matches(&ix, &[1, 2, 3], 0), vec![2, 3]);
    assert_eq!(ix.entries(), 5);
    assert_eq!(
        matches(&ix, &[1, 4], 0),
        vec![1, 1],
        "key 4 went with worker 2"
    );
    ix.set_workers(4);
    assert_eq!(matches(&ix, &[1, 2, 3], 0), vec![2, 3, 0, 0]);
    ix.insert(3, &[1], 0);
    assert_eq!(matches(&ix, &[1], 0), vec![1, 1, 0, 1]);
    ix.check_consistency().unwrap();
}

/// A small deterministic generator (the test must not depend on a rand crate's stream).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

#[test]
fn memory_bound_holds_under_100k_random_inserts() {
    let workers = 8;
    let capacity = 500;
    let mut ix = index(capacity, 0, workers);
    let mut rng = Lcg(7);
    let mut out = Vec::new();
    for i in 0..100_000u64 {
        let w = (rng.next() % workers as u64) as usize;
        // Keys from a space larger than the total capacity, with shared prefixes.
        let base = rng.next() % 3000;
        let len = 1 + rng.next() % 16;
        let keys: Vec<u64> = (base..base + len).collect();
        match rng.next() % 20 {
            0 => ix.remove(w, &keys),
            1 if i % 1000 == 1 => ix.clear(w),
            _ => ix.insert(w, &keys, i),
        }
        assert!(ix.entries() <= workers * capacity);
        assert!(ix.blocks(w) <= capacity);
        if i % 10_000 == 0 {
            ix.check_consistency().unwrap();
            let best = ix.match_prefix(&keys, i, &mut out);
            assert!(out.iter().all(|&m| m <= keys.len()) && best <= keys.len());
        }
    }
    ix.check_consistency().unwrap();
    assert!(ix.entries() >= workers * capacity / 2, "index filled up");
    // Bytes stay within the documented ~108 bytes per entry (plus spilled holder vectors).
    let bound = workers * capacity * 108 + 64 * 1024;
    assert!(
        ix.approx_bytes() <= bound,
        "{} > {bound}",
        ix.approx_bytes()
    );
}

#[test]
fn config_validation_rejects_zero_capacity() {
    let bad = IndexConfig {
        capacity_blocks: 0,
        ttl_ms: 0,
    };
    assert_eq!(
        bad.validate().map_err(|e| e.field),
        Err("index.capacity_blocks".to_string())
    );
    assert!(IndexConfig::default().validate().is_ok());
    assert_eq!(IndexConfig::default().capacity_blocks, 65_536);
    assert_eq!(IndexConfig::default().ttl_ms, 120_000);
}

/// A plain reference model: per worker a most-recently-used-first list of (key, expires_at).
struct Model {
    capacity: usize,
    ttl: u64,
    workers: Vec<Vec<(u64, u64)>>,
}

impl Model {
    fn insert(&mut self, w: usize, keys: &[u64], now: u64) {
        let Some(list) = self.workers.get_mut(w) else {
            return;
        };
        let expires = if self.ttl == 0 {
            u64::MAX
        } else {
            now + self.ttl
        };
        for &k in keys.iter().rev() {
            let old = list.iter().position(|e| e.0 == k).map(|i| list.remove(i));
            if old.is_none() && list.len() == self.capacity {
                list.pop();
            }
            list.insert(0, (k, old.map_or(expires, |o| o.1.max(expires))));
        }
    }

    fn matches(&self, keys: &[u64], now: u64) -> Vec<usize> {
        self.workers
            .iter()
            .map(|list| {
                keys.iter()
                    .take_while(|&&k| list.iter().any(|e| e.0 == k && now < e.1))
                    .count()
            })
            .collect()
    }
}

#[derive(Debug, Clone)]
enum Op {
    Insert(usize, u64, u64),
    Remove(usize, u64, u64),
    Clear(usize),
    Advance(u64),
    SetWorkers(usize),
    Match(u64, u64),
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        6 => (0..4usize, 0..30u64, 1..10u64).prop_map(|(w, s, l)| Op::Insert(w, s, l)),
        1 => (0..4usize, 0..30u64, 1..4u64).prop_map(|(w, s, l)| Op::Remove(w, s, l)),
        1 => (0..4usize).prop_map(Op::Clear),
        2 => (0..40u64).prop_map(Op::Advance),
        1 => (1..5usize).prop_map(Op::SetWorkers),
        4 => (0..30u64, 1..12u64).prop_map(|(s, l)| Op::Match(s, l)),
    ]
}

proptest::proptest! {
    /// With a uniform ttl and a monotonic clock the index agrees with the reference model on
    /// every match, whatever mix of inserts, removals, clears and resizes came before.
    #[test]
    fn index_agrees_with_a_reference_lru_model(
        capacity in 1..10usize,
        ttl in proptest::prop_oneof![proptest::strategy::Just(0u64), 20..100u64],
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let mut ix = index(capacity, ttl, 3);
        let mut model = Model { capacity, ttl, workers: vec![Vec::new(); 3] };
        let mut now = 0u64;
        let range = |s: u64, l: u64| (s..s + l).collect::<Vec<u64>>();
        for op in ops {
            match op {
                Op::Insert(w, s, l) => {
                    ix.insert(w, &range(s, l), now);
                    model.insert(w, &range(s, l), now);
                }
                Op::Remove(w, s, l) => {
                    ix.remove(w, &range(s, l));
                    if let Some(list) = model.workers.get_mut(w) {
                        list.retain(|e| !range(s, l).contains(&e.0));
                    }
                }
                Op::Clear(w) => {
                    ix.clear(w);
                    if let Some(list) = model.workers.get_mut(w) {
                        list.clear();
                    }
                }
                Op::Advance(dt) => now += dt,
                Op::SetWorkers(n) => {
                    ix.set_workers(n);
                    model.workers.resize(n, Vec::new());
                }
                Op::Match(s, l) => {
                    proptest::prop_assert_eq!(
                        matches(&ix, &range(s, l), now),
                        model.matches(&range(s, l), now)
                    );
                }
            }
            proptest::prop_assert!(ix.check_consistency().is_ok(), "{:?}", ix.check_consistency());
            for w in 0..ix.workers() {
                proptest::prop_assert!(ix.blocks(w) <= capacity);
            }
        }
    }
}
