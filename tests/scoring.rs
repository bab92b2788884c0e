//! Behaviour of worker choice: every knob moves the choice in its documented direction.

use mmrouter::index::{IndexConfig, PrefixIndex};
use mmrouter::scoring::{Choice, ScoringConfig, WorkerLoad, choose, choose_with_costs};

fn idle() -> WorkerLoad {
    WorkerLoad::default()
}

fn inflight(n: u32) -> WorkerLoad {
    WorkerLoad {
        inflight: n,
        ..WorkerLoad::default()
    }
}

fn pick(total: usize, matched: &[usize], loads: &[WorkerLoad], config: &ScoringConfig) -> usize {
    choose(total, matched, loads, config, 0).unwrap().worker
}

fn with(f: impl FnOnce(&mut ScoringConfig)) -> ScoringConfig {
    let mut c = ScoringConfig::default();
    f(&mut c);
    c
}

#[test]
fn defaults_are_the_documented_ones_and_valid() {
    let c = ScoringConfig::default();
    assert_eq!(c.overlap_credit, 1.0);
    assert_eq!(c.prefill_weight, 1.0);
    assert_eq!(c.inflight_weight, 4.0);
    assert_eq!(c.pending_prefill_weight, 1.0);
    assert_eq!(c.waiting_weight, 16.0);
    assert_eq!(c.running_weight, 2.0);
    assert_eq!(c.kv_usage_weight, 32.0);
    assert_eq!(c.temperature, 0.0);
    assert_eq!(c.herding_margin, Some(8));
    assert!(c.validate().is_ok());
}

#[test]
fn validation_names_bad_weights() {
    for bad in [-1.0, f64::NAN, f64::INFINITY] {
        let e = with(|c| c.inflight_weight = bad).validate().unwrap_err();
        assert_eq!(e.field, "scoring.inflight_weight");
        let e = with(|c| c.temperature = bad).validate().unwrap_err();
        assert_eq!(e.field, "scoring.temperature");
    }
}

#[test]
fn config_parses_from_json_with_defaults() {
    let c: ScoringConfig =
        serde_json::from_str(r#"{"overlap_credit":0.5,"herding_margin":null}"#).unwrap();
    assert_eq!(c.overlap_credit, 0.5);
    assert_eq!(c.herding_margin, None);
    assert_eq!(c.inflight_weight, 4.0);
}

#[test]
fn zero_workers_is_none() {
    assert_eq!(choose(10, &[], &[], &ScoringConfig::default(), 0), None);
    assert_eq!(choose(10, &[5, 5], &[], &ScoringConfig::default(), 0), None);
}

#[test]
fn overlap_wins_against_moderate_load_and_credit_zero_is_pure_load() {
    // Worker 0 holds 64 of 100 blocks but has 3 requests in flight: 36 + 12 < 100.
    let loads = [inflight(3), idle()];
    let c = choose(100, &[64, 0], &loads, &ScoringConfig::default(), 0).unwrap();
    assert_eq!(
        c,
        Choice {
            worker: 0,
            matched_blocks: 64,
            total_blocks: 100,
            credited_blocks: 64,
            cost: 48.0,
            best_matched: 64,
            herded: 0,
        }
    );
    // Without credit the cache is ignored: the idle worker wins.
    assert_eq!(
        pick(100, &[64, 0], &loads, &with(|c| c.overlap_credit = 0.0)),
        1
    );
}

#[test]
fn prefill_weight_makes_overlap_count_more() {
    // 10 matched blocks against 5 in flight: 90 + 20 > 100 by default.
    let loads = [inflight(5), idle()];
    assert_eq!(pick(100, &[10, 0], &loads, &ScoringConfig::default()), 1);
    // ×3: 270 + 20 < 300.
    assert_eq!(
        pick(100, &[10, 0], &loads, &with(|c| c.prefill_weight = 3.0)),
        0
    );
}

#[test]
fn inflight_weight_pushes_away_from_busy_workers() {
    let loads = [inflight(4), idle()];
    // 80 + 16 < 100.
    assert_eq!(pick(100, &[20, 0], &loads, &ScoringConfig::default()), 0);
    // 80 + 24 > 100.
    assert_eq!(
        pick(100, &[20, 0], &loads, &with(|c| c.inflight_weight = 6.0)),
        1
    );
}

#[test]
fn pending_prefill_blocks_count_like_own_blocks() {
    let loads = [
        WorkerLoad {
            prefill_blocks: 40,
            ..idle()
        },
        idle(),
    ];
    // 80 + 40 > 100.
    assert_eq!(pick(100, &[20, 0], &loads, &ScoringConfig::default()), 1);
    assert_eq!(
        pick(
            100,
            &[20, 0],
            &loads,
            &with(|c| c.pending_prefill_weight = 0.0)
        ),
        0
    );
}

#[test]
fn engine_metrics_terms_push_away_in_their_direction() {
    let metric = |waiting, running, kv| WorkerLoad {
        waiting,
        running,
        kv_usage: kv,
        ..idle()
    };
    // Queue: 60 + 3 × 16 > 100.
    let loads = [metric(Some(3.0), None, None), metric(Some(0.0), None, None)];
    assert_eq!(pick(100, &[40, 0], &loads, &ScoringConfig::default()), 1);
    assert_eq!(
        pick(100, &[40, 0], &loads, &with(|c| c.waiting_weight = 0.0)),
        0
    );
    // Running: 90 + 8 × 2 > 100.
    let loads = [metric(None, Some(8.0), None), idle()];
    assert_eq!(pick(100, &[10, 0], &loads, &ScoringConfig::default()), 1);
    assert_eq!(
        pick(100, &[10, 0], &loads, &with(|c| c.running_weight = 0.0)),
        0
    );
    // KV usage: 90 + 28.8 > 100 + 16.
    let loads = [metric(None, None, Some(0.9)), metric(None, None, Some(0.5))];
    assert_eq!(pick(100, &[10, 0], &loads, &ScoringConfig::default()), 1);
    assert_eq!(
        pick(100, &[10, 0], &loads, &with(|c| c.kv_usage_weight = 0.0)),
        0
    );
    // A larger cache hit still beats a fuller cache: 60 + 28.8 < 116.
    assert_eq!(pick(100, &[40, 0], &loads, &ScoringConfig::default()), 0);
    // Out-of-range usage is clamped to 1, negative counts to 0.
    let loads = [metric(Some(-5.0), None, Some(7.0)), idle()];
    let c = choose(100, &[0, 0], &loads, &ScoringConfig::default(), 0).unwrap();
    assert_eq!(c.worker, 1);
    let mut costs = Vec::new();
    choose_with_costs(
        100,
        &[0, 0],
        &loads,
        &ScoringConfig::default(),
        0,
        &mut costs,
    );
    assert_eq!(costs, vec![132.0, 100.0]);
}

#[test]
fn herding_margin_removes_the_cache_advantage_of_a_worker_too_far_ahead() {
    let config = ScoringConfig::default(); // margin 8
    // 8 ahead: still credited (0 + 32 < 64).
    let c = choose(64, &[64, 0, 0], &[inflight(8), idle(), idle()], &config, 0).unwrap();
    assert_eq!((c.worker, c.herded), (0, 0));
    // 9 ahead: no credit, 64 + 36 > 64.
    let loads = [inflight(9), idle(), idle()];
    let c = choose(64, &[64, 0, 0], &loads, &config, 0).unwrap();
    assert_ne!(c.worker, 0);
    assert_eq!((c.herded, c.best_matched), (1, 64));
    // The margin is relative to the least-loaded worker.
    let loads = [inflight(9), inflight(1), inflight(1)];
    assert_eq!(pick(64, &[64, 0, 0], &loads, &config), 0);
    // Disabled (None or 0): the cache wins.
    for margin in [None, Some(0)] {
        let loads = [inflight(9), idle(), idle()];
        let c = with(|c| c.herding_margin = margin);
        assert_eq!(pick(64, &[64, 0, 0], &loads, &c), 0);
    }
}

/// One client hammering one hot prefix: requests arrive faster than they finish.
/// Returns the number of requests each worker received and the largest in-flight gap seen
/// at routing time.
fn hammer(config: &ScoringConfig, requests: u64, duration: u64) -> (Vec<u32>, u32) {
    let workers = 4;
    let mut index = PrefixIndex::new(IndexConfig::default(), workers);
    let mut loads = vec![WorkerLoad::default(); workers];
    let mut finishing: Vec<(u64, usize)> = Vec::new();
    let mut received = vec![0u32; workers];
    let mut matched = Vec::new();
    let mut gap = 0;
    for t in 0..requests {
        // Finish requests whose time has come.
        finishing.retain(|&(end, w)| {
            if end <= t {
                loads[w].inflight -= 1;
                false
            } else {
                true
            }
        });
        // 60 shared blocks of system prompt and image, then 4 blocks of the user's question.
        let mut keys: Vec<u64> = (0..60).collect();
        keys.extend((0..4).map(|i| 1_000_000 + t * 4 + i));
        index.match_prefix(&keys, t, &mut matched);
        let c = choose(keys.len(), &matched, &loads, config, t).unwrap();
        let min = loads.iter().map(|l| l.inflight).min().unwrap();
        gap = gap.max(loads[c.worker].inflight - min);
        index.insert(c.worker, &keys, t);
        loads[c.worker].inflight += 1;
        received[c.worker] += 1;
        finishing.push((t + duration, c.worker));
    }
    (received, gap)
}

#[test]
fn a_single_stream_on_one_hot_prefix_spreads_once_the_hot_worker_is_margin_ahead() {
    // Each request lasts 40 arrivals: ~40 in flight at once.
    let (received, gap) = hammer(&ScoringConfig::default(), 2000, 40);
    // The hot worker is never given a request while more than 8 ahead of the idlest.
    assert!(gap <= 8, "gap {gap}");
    // Every worker takes a real share.
    let min = *received.iter().min().unwrap();
    assert!(min >= 2000 / 4 / 2, "{received:?}");

    // Without the guard the cost model alone lets the hot worker run 15 ahead (60 cached
    // blocks against 4 blocks per request) before anyone else gets traffic.
    let (_, gap) = hammer(&with(|c| c.herding_margin = None), 2000, 40);
    assert!(gap >= 14, "gap without guard {gap}");
}

#[test]
fn temperature_zero_is_deterministic_argmin() {
    let loads = [inflight(2), idle(), inflight(1)];
    for r in 0..1000 {
        let c = choose(50, &[30, 0, 10], &loads, &ScoringConfig::default(), r).unwrap();
        assert_eq!(c.worker, 0);
    }
}

#[test]
fn temperature_samples_the_softmax_of_normalised_costs() {
    let config = with(|c| c.temperature = 0.5);
    let matched = [40, 20, 0];
    let loads = [idle(), idle(), idle()];
    let mut costs = Vec::new();
    choose_with_costs(100, &matched, &loads, &config, 0, &mut costs);
    assert_eq!(costs, vec![60.0, 80.0, 100.0]);
    // Normalised 0, 0.5, 1 → weights e^0, e^-1, e^-2.
    let w = [1.0f64, (-1.0f64).exp(), (-2.0f64).exp()];
    let sum: f64 = w.iter().sum();
    let n = 30_000u64;
    let mut counts = [0u32; 3];
    for r in 0..n {
        counts[choose(100, &matched, &loads, &config, r).unwrap().worker] += 1;
    }
    for i in 0..3 {
        let got = f64::from(counts[i]) / n as f64;
        let want = w[i] / sum;
        assert!((got - want).abs() < 0.015, "worker {i}: {got} vs {want}");
    }
    // Same random, same answer.
    assert_eq!(
        choose(100, &matched, &loads, &config, 12345),
        choose(100, &matched, &loads, &config, 12345)
    );
    // A higher temperature flattens the distribution.
    let hot = with(|c| c.temperature = 5.0);
    let best_share = |config: &ScoringConfig| {
        (0..n)
            .filter(|&r| choose(100, &matched, &loads, config, r).unwrap().worker == 0)
            .count()
    };
    assert!(best_share(&hot) < best_share(&config));
}

#[test]
fn ties_spread_across_equal_workers() {
    let loads = [idle(); 4];
    let mut counts = [0u32; 4];
    for r in 0..4000 {
        counts[choose(10, &[0; 4], &loads, &ScoringConfig::default(), r)
            .unwrap()
            .worker] += 1;
    }
    for (w, &c) in counts.iter().enumerate() {
        assert!((850..1150).contains(&c), "worker {w}: {c} of 4000");
    }
}

#[test]
fn among_equal_costs_fewer_inflight_wins() {
    // Worker 0: 96 + 4 × 1 = 100; worker 1: 100 + 0 = 100. Equal costs, fewer in flight.
    let loads = [inflight(1), idle()];
    for r in 0..100 {
        assert_eq!(
            choose(100, &[4, 0], &loads, &ScoringConfig::default(), r)
                .unwrap()
                .worker,
            1
        );
    }
}

#[test]
fn nan_and_infinite_metrics_never_win_or_panic() {
    let bad = |waiting: Option<f64>, kv: Option<f64>| WorkerLoad {
        waiting,
        kv_usage: kv,
        ..idle()
    };
    let loads = [
        bad(None, Some(f64::NAN)),
        bad(Some(f64::INFINITY), None),
        bad(Some(f64::NEG_INFINITY), None),
        inflight(30), // the worst finite worker
    ];
    for temperature in [0.0, 1.0] {
        let config = with(|c| c.temperature = temperature);
        for r in 0..200 {
            let c = choose(100, &[100, 100, 100, 0], &loads, &config, r).unwrap();
            assert_eq!(c.worker, 3);
            assert!(c.cost.is_finite());
        }
    }
    // All broken: still an answer, no panic.
    let all_bad = [bad(Some(f64::NAN), None), bad(None, Some(f64::INFINITY))];
    for temperature in [0.0, 1.0] {
        let config = with(|c| c.temperature = temperature);
        let c = choose(10, &[0, 0], &all_bad, &config, 3).unwrap();
        assert!(c.worker < 2 && c.cost.is_infinite());
    }
}

#[test]
fn matched_counts_are_clamped_and_may_be_shorter_than_loads() {
    let c = choose(10, &[50], &[idle(), idle()], &ScoringConfig::default(), 0).unwrap();
    assert_eq!((c.worker, c.matched_blocks, c.cost), (0, 10, 0.0));
    // Worker 1 has no matched entry: counts as 0.
    let c = choose(
        10,
        &[],
        &[inflight(1), idle()],
        &ScoringConfig::default(),
        0,
    )
    .unwrap();
    assert_eq!((c.worker, c.matched_blocks), (1, 0));
}
