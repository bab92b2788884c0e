//! Behaviour of the decision rule: wait against recompute, in time (src/scoring.rs).

use mmrouter::config::RouterConfig;
use mmrouter::scoring::{
    Candidate, RequestSize, ScoringConfig, choose, conversation_load, goes_home,
    home_wait_pays_for_preamble, queued_blocks, slower_than_choice,
};

const SPEED: f64 = 8000.0;

fn config() -> ScoringConfig {
    ScoringConfig {
        prefill_tokens_per_sec: SPEED,
        ..ScoringConfig::default()
    }
}

/// The configuration with the load bounds binding at any load (`load_bounds_lift_at` 0).
fn bounded() -> ScoringConfig {
    ScoringConfig {
        load_bounds_lift_at: 0.0,
        ..config()
    }
}

/// The bounded configuration with `home_load_slack` and no floor under the home's bound.
fn slack(home_load_slack: f64) -> ScoringConfig {
    ScoringConfig {
        home_load_slack,
        home_load_floor: 0,
        ..bounded()
    }
}

/// A request of `blocks` full blocks of 16 tokens.
fn request(blocks: usize) -> RequestSize {
    RequestSize {
        total_blocks: blocks,
        prompt_tokens: blocks * 16,
        block_size: 16,
    }
}

fn worker(matched: usize, queued_s: f64) -> Candidate {
    Candidate {
        matched_blocks: matched,
        queued_s,
        ..Candidate::default()
    }
}

fn pick(req: RequestSize, ws: &[Candidate], config: &ScoringConfig, random: u64) -> usize {
    choose(req, ws, config, random).expect("a choice").index
}

#[test]
fn defaults_are_the_documented_ones_and_valid() {
    let c = ScoringConfig::default();
    assert_eq!(c.prefill_tokens_per_sec, 10_000.0);
    assert_eq!(c.footprint_weight, 0.5);
    assert_eq!(c.footprint_half_life_ms, 60_000);
    assert_eq!(c.running_ms, 0.0);
    assert_eq!(c.temperature, 0.0);
    assert_eq!(c.recompute_weight, 1.0);
    assert!(c.admission_match);
    assert!(!c.admission_stamps);
    assert!(c.admission_pending);
    assert!(c.recompute_grows_with_load);
    assert!(c.home_hold);
    assert_eq!(c.home_load_slack, 1.0);
    assert_eq!(c.load_bounds_lift_at, 2.0);
    assert_eq!(c.load_bounds_lift_max_shares, 1.0);
    assert_eq!(c.load_bounds_lift_min_speed, 0.0);
    assert!(!c.speed_capped_by_peak);
    assert_eq!(c.home_load_floor, 2);
    assert_eq!(c.home_fit_load_factor, 2.0);
    assert_eq!(c.home_max_shares, 1.5);
    assert!(c.home_fit_lifts_share_limit);
    assert_eq!(c.home_fit_max_traffic, 0.5);
    assert!(c.home_fewest_groups);
    assert_eq!(c.home_share_min_requests, 4.0);
    assert_eq!(c.home_rebalance_above, 0.0);
    assert_eq!(c.conversation_hold, 2.0);
    assert!(c.conversation_hold_partial);
    assert_eq!(c.conversation_hold_partial_share, 0.5);
    assert_eq!(c.home_wait_where_copy_fits, None);
    assert!(c.home_wait_applies(2) && !c.home_wait_applies(3));
    assert_eq!(c.home_wait_allowance, 4.0);
    assert_eq!(c.small_copy_share, 1.0 / 16.0);
    assert!(!c.conversation_wait_where_copy_fits);
    assert!(c.home_speed_weighted);
    assert!(c.validate().is_ok());
}

#[test]
fn a_request_goes_home_only_where_its_chosen_worker_would_recompute_the_preamble() {
    // 40 blocks, of which the first 10 are the group's preamble; the home is worker 1.
    let preamble = 10;
    let chosen = |ws: &[Candidate]| choose(request(40), ws, &config(), 0).expect("a choice");
    let busy_home = |matched: usize| Candidate {
        inflight: 1,
        ..worker(matched, 0.2)
    };
    // The idle worker 0 holds nothing: it would recompute the preamble, so the request goes
    // home (1 in flight there, this one included 2, within ceil(2 × 2 / 2) = 2).
    let ws = [worker(0, 0.0), busy_home(preamble)];
    let c = chosen(&ws);
    assert_eq!(c.index, 0, "the cost alone picks the idle worker");
    assert!(goes_home(&c, &ws, 1, preamble, &slack(1.0)));
    // Worker 0 holds the preamble (or more): the request finds its prefix there; no hold.
    for held in [preamble, preamble + 5] {
        let ws = [worker(held, 0.0), busy_home(preamble)];
        let c = chosen(&ws);
        assert_eq!(c.index, 0);
        assert!(
            !goes_home(&c, &ws, 1, preamble, &slack(1.0)),
            "{held} blocks held"
        );
    }
    // Past the load bound: 3 in flight at home against 0, ceil(1.25 × 4 / 2) = 3 < 4.
    let ws = [
        worker(0, 0.0),
        Candidate {
            inflight: 3,
            ..worker(preamble, 0.2)
        },
    ];
    let c = chosen(&ws);
    assert!(!goes_home(&c, &ws, 1, preamble, &slack(0.25)));
    assert!(
        goes_home(&c, &ws, 1, preamble, &slack(1.0)),
        "ceil(2 × 2) = 4 holds it"
    );
    // At low load the bound is small: 1 in flight at home and none elsewhere on 4 workers
    // gives ceil(2 × 2 / 4) = 1 < 2, so the second request of a group copies the preamble
    // elsewhere. A floor of 2 lets it join the first.
    let ws = [
        worker(0, 0.0),
        busy_home(preamble),
        worker(0, 0.0),
        worker(0, 0.0),
    ];
    let c = chosen(&ws);
    assert_ne!(c.index, 1, "the cost alone leaves the busy home");
    assert!(!goes_home(&c, &ws, 1, preamble, &slack(1.0)));
    let floored = ScoringConfig {
        home_load_floor: 2,
        ..slack(1.0)
    };
    assert!(goes_home(&c, &ws, 1, preamble, &floored));
    let ws = [
        worker(0, 0.0),
        Candidate {
            inflight: 2,
            ..worker(preamble, 0.2)
        },
        worker(0, 0.0),
        worker(0, 0.0),
    ];
    let c = chosen(&ws);
    assert!(
        !goes_home(&c, &ws, 1, preamble, &floored),
        "3 in flight at home is past both the bound (ceil(2 × 3 / 4) = 2) and the floor"
    );
    // Home already chosen: nothing to change.
    let ws = [worker(0, 0.5), worker(preamble, 0.0)];
    let c = chosen(&ws);
    assert_eq!(c.index, 1);
    assert!(!goes_home(&c, &ws, 1, preamble, &slack(1.0)));
}

#[test]
fn where_every_worker_carries_the_lift_load_the_load_bounds_do_not_bind() {
    // 4 workers, 15 in flight, 16 with this request: the mean is 4. The home (worker 1) would
    // carry 10, past its bound of ceil(2 × 4) = 8.
    let preamble = 10;
    let ws = [
        worker(0, 0.0),
        Candidate {
            inflight: 9,
            ..worker(preamble, 1.0)
        },
        Candidate {
            inflight: 3,
            ..worker(0, 0.3)
        },
        Candidate {
            inflight: 3,
            ..worker(0, 0.3)
        },
    ];
    let c = choose(request(40), &ws, &config(), 0).expect("a choice");
    assert_ne!(c.index, 1, "the cost alone leaves the busy home");
    let lift = |at: f64| ScoringConfig {
        load_bounds_lift_at: at,
        ..config()
    };
    assert!(!goes_home(&c, &ws, 1, preamble, &lift(0.0)), "10 > 8");
    assert!(
        goes_home(&c, &ws, 1, preamble, &config()),
        "lifted at 2 by default"
    );
    assert!(goes_home(&c, &ws, 1, preamble, &lift(4.0)), "mean 4 >= 4");
    assert!(goes_home(&c, &ws, 1, preamble, &lift(3.0)));
    assert!(!goes_home(&c, &ws, 1, preamble, &lift(4.5)), "mean 4 < 4.5");
    // The conversation hold's limit is then every request in flight times the hold: 16 × 2.
    assert_eq!(conversation_load(&ws, 1, &lift(4.0)), (10.0, 32.0));
    assert_eq!(conversation_load(&ws, 1, &lift(0.0)), (10.0, 16.0));
    // And the hold off stays off.
    let off = ScoringConfig {
        conversation_hold: 0.0,
        ..lift(4.0)
    };
    assert_eq!(conversation_load(&ws, 1, &off).1, 0.0);
    // Below the lift load (8 workers, the same 15 in flight: mean 2) the bound, ceil(2 × 2) =
    // 4, binds as before.
    let mut wide = ws.to_vec();
    wide.resize(8, worker(0, 0.0));
    let c = choose(request(40), &wide, &config(), 0).expect("a choice");
    assert!(!goes_home(&c, &wide, 1, preamble, &lift(3.0)), "mean 2 < 3");
    assert!(goes_home(&c, &wide, 1, preamble, &lift(2.0)), "mean 2 >= 2");
    assert!(
        ScoringConfig {
            load_bounds_lift_at: -1.0,
            ..config()
        }
        .validate()
        .is_err()
    );
}

#[test]
fn a_home_whose_cache_holds_what_it_took_recently_carries_up_to_twice_its_bound() {
    // 40 blocks, 10 of them the preamble: 30 new blocks at the home, which has a cache of
    // 4096 blocks. The other workers are idle and hold nothing.
    let preamble = 10;
    let floored = ScoringConfig {
        home_load_floor: 2,
        ..slack(1.0)
    };
    let home = |inflight: u32, footprint: f64, capacity: Option<f64>| Candidate {
        inflight,
        footprint,
        capacity_blocks: capacity,
        ..worker(preamble, 0.2)
    };
    let fleet = |n: usize, h: Candidate| {
        let mut ws = vec![worker(0, 0.0); n];
        ws[1] = h;
        ws
    };
    let held = |ws: &[Candidate], config: &ScoringConfig| {
        let c = choose(request(40), ws, config, 0).expect("a choice");
        assert_ne!(c.index, 1, "the cost alone leaves the busy home");
        goes_home(&c, ws, 1, preamble, config)
    };
    // 4 workers, 2 in flight at home: 3 with this one, past the bound (the floor, 2).
    let ws = fleet(4, home(2, 1000.0, Some(4096.0)));
    assert!(
        held(&ws, &floored),
        "footprint 1000 + 30 new blocks fit in 4096: up to 2 × 2 = 4 in flight"
    );
    let full = fleet(4, home(2, 4070.0, Some(4096.0)));
    assert!(
        !held(&full, &floored),
        "4070 + 30 blocks do not fit in 4096"
    );
    // The footprint counts at least the prefill queued at the home, which the state writer
    // has not recorded yet in a burst: 0.2 s at 8000 tokens/s is 100 blocks, and with the 30
    // new ones they fill a cache of 120 though the recorded footprint is still 0.
    assert!(
        !held(&fleet(4, home(2, 0.0, Some(120.0))), &floored),
        "100 queued + 30 new blocks do not fit in 120"
    );
    assert!(
        held(&fleet(4, home(2, 0.0, Some(130.0))), &floored),
        "100 queued + 30 new blocks fit in 130"
    );
    let unknown = fleet(4, home(2, 0.0, None));
    assert!(!held(&unknown, &floored), "an unknown capacity is not room");
    let off = ScoringConfig {
        home_fit_load_factor: 1.0,
        ..floored.clone()
    };
    assert!(!held(&ws, &off), "a factor of 1 keeps the bound");
    // 8 workers: 4 in flight at home, 5 with this one, against a bound of 2 (ceil(2 × 5 /
    // 8) = 2): past twice the bound. With 3 in flight, 4 is within it.
    assert!(!held(&fleet(8, home(4, 0.0, Some(4096.0))), &floored));
    assert!(held(&fleet(8, home(3, 0.0, Some(4096.0))), &floored));
    // The factor is validated.
    for bad in [0.5, f64::NAN, f64::INFINITY] {
        let config = ScoringConfig {
            home_fit_load_factor: bad,
            ..config()
        };
        assert!(config.validate().is_err(), "{bad}");
    }
}

#[test]
fn a_group_past_its_share_goes_home_only_while_the_wait_there_costs_less_than_its_preamble() {
    // The cost chose idle worker 0; the home (1) holds the preamble and has a queue. A
    // preamble of 30 blocks is 480 tokens, 0.06 s at 8000 tokens/s; with nothing in flight
    // the recompute weighs once more for those behind it: going home saves 0.12 s.
    let pays = |preamble: usize, home_wait: f64, inflight: u32| {
        let ws = vec![
            Candidate {
                inflight,
                ..worker(0, 0.0)
            },
            Candidate {
                inflight,
                ..worker(preamble, home_wait)
            },
        ];
        let mut c = choose(request(40), &ws, &config(), 0).expect("a choice");
        c.prefer(0);
        home_wait_pays_for_preamble(&c, &ws, 1, preamble, &config())
    };
    assert!(pays(30, 0.10, 0));
    assert!(!pays(30, 0.15, 0));
    // Two in flight per worker: the recompute weighs 3 times more, 0.24 s in all.
    assert!(pays(30, 0.20, 2));
    assert!(!pays(30, 0.30, 2));
    // Two blocks of preamble in front of a new image (8 ms, twice) are not worth 0.1 s.
    assert!(!pays(2, 0.10, 0));
    assert!(pays(2, 0.005, 0));
}

#[test]
fn validation_names_bad_values() {
    for (json, field) in [
        (
            r#"{"scoring":{"prefill_tokens_per_sec":0}}"#,
            "scoring.prefill_tokens_per_sec",
        ),
        (
            r#"{"scoring":{"footprint_weight":-1}}"#,
            "scoring.footprint_weight",
        ),
        (r#"{"scoring":{"running_ms":-0.5}}"#, "scoring.running_ms"),
        (
            r#"{"scoring":{"recompute_weight":-1}}"#,
            "scoring.recompute_weight",
        ),
        (
            r#"{"scoring":{"home_rebalance_above":0.5}}"#,
            "scoring.home_rebalance_above",
        ),
        (
            r#"{"scoring":{"home_rebalance_above":-1}}"#,
            "scoring.home_rebalance_above",
        ),
        (
            r#"{"scoring":{"home_max_shares":-1}}"#,
            "scoring.home_max_shares",
        ),
        (
            r#"{"scoring":{"home_fit_max_traffic":1.5}}"#,
            "scoring.home_fit_max_traffic",
        ),
        (
            r#"{"scoring":{"small_copy_share":2}}"#,
            "scoring.small_copy_share",
        ),
        (
            r#"{"scoring":{"small_copy_share":-0.1}}"#,
            "scoring.small_copy_share",
        ),
        (
            r#"{"scoring":{"conversation_hold_partial_share":1.5}}"#,
            "scoring.conversation_hold_partial_share",
        ),
        (
            r#"{"scoring":{"conversation_hold":-1}}"#,
            "scoring.conversation_hold",
        ),
        (
            r#"{"scoring":{"load_bounds_lift_min_speed":-0.5}}"#,
            "scoring.load_bounds_lift_min_speed",
        ),
        (r#"{"scoring":{"inflight_weight":4}}"#, "inflight_weight"),
    ] {
        let e = RouterConfig::from_json(json.as_bytes()).expect_err(json);
        assert_eq!(e.field, field, "{json}: {e}");
    }
}

#[test]
fn a_conversations_worker_may_carry_the_hold_times_the_load_bound() {
    let loaded = |inflight: &[u32]| -> Vec<Candidate> {
        inflight
            .iter()
            .map(|&n| Candidate {
                inflight: n,
                ..worker(0, 0.0)
            })
            .collect()
    };
    // 8 workers, 3 in flight on the conversation's: 4 with this one; the mean is 4/8, the
    // bound the floor of 2, twice that is 4.
    let ws = loaded(&[3, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(conversation_load(&ws, 0, &bounded()), (4.0, 4.0));
    let ws = loaded(&[4, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(conversation_load(&ws, 0, &bounded()), (5.0, 4.0));
    // Busier elsewhere: 20 in flight, 21 with this one, mean 21/8 → bound ceil(5.25) = 6.
    let ws = loaded(&[4, 3, 3, 2, 2, 2, 2, 2]);
    assert_eq!(conversation_load(&ws, 0, &bounded()), (5.0, 12.0));
    // The hold's factor scales the limit; 0 turns it off; a missing candidate never holds.
    let one = ScoringConfig {
        conversation_hold: 1.0,
        ..bounded()
    };
    assert_eq!(conversation_load(&ws, 0, &one).1, 6.0);
    let off = ScoringConfig {
        conversation_hold: 0.0,
        ..bounded()
    };
    assert_eq!(conversation_load(&ws, 0, &off).1, 0.0);
    let (carries, limit) = conversation_load(&ws, 8, &bounded());
    assert!(carries > limit);
}

#[test]
fn zero_workers_is_none() {
    assert!(choose(request(10), &[], &config(), 0).is_none());
}

#[test]
fn the_worked_example_of_the_module_docs() {
    // 150 blocks; A holds 141 with 0.100 s queued; B idle with the 2 system-prompt blocks.
    let req = RequestSize {
        total_blocks: 150,
        prompt_tokens: 2400,
        block_size: 16,
    };
    let ws = [worker(141, 0.100), worker(2, 0.0)];
    let c = choose(req, &ws, &config(), 0).expect("choice");
    assert_eq!(c.index, 0, "stay with the KV");
    let a = c.estimates[0];
    let b = c.estimates[1];
    assert!((a.cost_s - 0.118).abs() < 1e-9, "{a:?}");
    assert!((b.prefill_s - 0.296).abs() < 1e-9, "{b:?}");
    assert!((b.recompute_s - 139.0 * 16.0 / SPEED).abs() < 1e-9);
    assert!((b.cost_s - 0.574).abs() < 1e-9, "{b:?}");
    assert_eq!(a.recompute_s, 0.0);
    // 0.300 s queued on A: the wait costs more than the recompute, not more than twice it.
    let ws = [worker(141, 0.300), worker(2, 0.0)];
    assert_eq!(pick(req, &ws, &config(), 0), 0, "stay");
    // 0.600 s: more than twice.
    let ws = [worker(141, 0.600), worker(2, 0.0)];
    let c = choose(req, &ws, &config(), 0).expect("choice");
    assert_eq!(c.index, 1, "move");
    assert_eq!(c.passed_over(&ws), Some(0));
}

#[test]
fn a_recompute_counts_once_more_per_request_in_flight_as_in_the_worked_example() {
    // The worked example with 3 requests in flight on each worker: B costs
    // 0.296 + 4 x 0.278 = 1.408 s, so A keeps the request up to 1.39 s queued.
    let req = request(150);
    let busy = |matched: usize, queued_s: f64| Candidate {
        inflight: 3,
        ..worker(matched, queued_s)
    };
    let c = choose(req, &[busy(141, 1.30), busy(2, 0.0)], &config(), 0).expect("choice");
    assert_eq!(c.index, 0, "{:?}", c.estimates);
    assert!((c.estimates[1].cost_s - (0.296 + 4.0 * 139.0 * 16.0 / SPEED)).abs() < 1e-9);
    assert_eq!(pick(req, &[busy(141, 1.45), busy(2, 0.0)], &config(), 0), 1);
    // The mean over the candidates counts: one idle worker and one with 6 in flight is 3.
    let uneven = [
        Candidate {
            inflight: 6,
            ..worker(141, 1.30)
        },
        worker(2, 0.0),
    ];
    assert_eq!(pick(req, &uneven, &config(), 0), 0);
    // A fixed weight moves it at 0.600 s, as on idle workers.
    let fixed = ScoringConfig {
        recompute_grows_with_load: false,
        ..config()
    };
    assert_eq!(pick(req, &[busy(141, 0.55), busy(2, 0.0)], &fixed, 0), 0);
    assert_eq!(pick(req, &[busy(141, 0.65), busy(2, 0.0)], &fixed, 0), 1);
}

#[test]
fn a_longer_match_wins_exactly_while_its_wait_is_below_the_weighted_recompute_it_saves() {
    let req = request(100);
    for weight in [0.0, 1.0, 2.5] {
        let config = ScoringConfig {
            recompute_weight: weight,
            ..config()
        };
        for matched in [10usize, 50, 90] {
            let saved_s = matched as f64 * 16.0 / SPEED * (1.0 + weight);
            let stay = [worker(matched, saved_s * 0.99), worker(0, 0.0)];
            assert_eq!(
                pick(req, &stay, &config, 1),
                0,
                "w {weight} matched {matched}"
            );
            let go = [worker(matched, saved_s * 1.01), worker(0, 0.0)];
            assert_eq!(
                pick(req, &go, &config, 1),
                1,
                "w {weight} matched {matched}"
            );
        }
    }
}

#[test]
fn the_engine_queue_counts_only_where_it_says_more_than_the_router_knows() {
    let req = request(20);
    let full_s = 20.0 * 16.0 / SPEED;
    // The router's own clock says 0.5 s; the engine's 2 waiting requests add nothing beyond
    // it (they are the router's own): no double count.
    let mut a = worker(20, 0.5);
    a.waiting = Some(2.0);
    let c = choose(req, &[a], &config(), 0).expect("choice");
    assert!((c.estimates[0].wait_s - 0.5).abs() < 1e-12);
    // Another router's traffic: the engine says 10 waiting, the router knows of none.
    let mut b = worker(20, 0.0);
    b.waiting = Some(10.0);
    let c = choose(req, &[b, worker(0, 0.0)], &config(), 0).expect("choice");
    assert!((c.estimates[0].wait_s - 10.0 * full_s).abs() < 1e-9);
    assert_eq!(c.index, 1, "the hidden queue outweighs the hit");
}

#[test]
fn a_held_worker_is_slower_than_the_choice_only_below_the_share_of_its_peak_speed() {
    // Worker 0 holds the prefix (the hold's worker); worker 1, idle, is the cost's choice.
    // Speeds are compared by the peaks the router measured, not by the readings.
    let req = request(50);
    let at_peak = |held: f64| {
        let mut h = worker(40, 1.0);
        h.prefill_tps = Some(held);
        h.peak_prefill_tps = Some(held);
        let mut idle = worker(0, 0.0);
        idle.prefill_tps = Some(SPEED);
        idle.peak_prefill_tps = Some(SPEED);
        [h, idle]
    };
    let with = |share: f64| ScoringConfig {
        load_bounds_lift_min_speed: share,
        ..config()
    };
    let slow = at_peak(0.4 * SPEED);
    let c = choose(req, &slow, &config(), 0).expect("choice");
    assert_eq!(c.index, 1);
    assert!(slower_than_choice(&c, &slow, 0, &with(0.8)));
    // Off at 0, and never where the speeds are within the share or the worker is the choice.
    assert!(!slower_than_choice(&c, &slow, 0, &config()));
    assert!(!slower_than_choice(&c, &slow, 0, &with(0.3)));
    assert!(!slower_than_choice(&c, &slow, 1, &with(0.8)));
    let near = at_peak(0.9 * SPEED);
    let c = choose(req, &near, &config(), 0).expect("choice");
    assert_eq!(c.index, 1);
    assert!(!slower_than_choice(&c, &near, 0, &with(0.8)));
    // Out of range is no.
    assert!(!slower_than_choice(&c, &near, 7, &with(0.8)));
    // A busy worker reads slow (its requests' prefill times count their wait), but its peak
    // says it is as fast as the choice: not slower.
    let mut busy = at_peak(SPEED);
    busy[0].prefill_tps = Some(0.4 * SPEED);
    let c = choose(req, &busy, &config(), 0).expect("choice");
    assert_eq!(c.index, 1);
    assert!(!slower_than_choice(&c, &busy, 0, &with(0.8)));
    // A slow peak is slow even where the reading says otherwise.
    let mut slow_peak = at_peak(SPEED);
    slow_peak[0].peak_prefill_tps = Some(0.4 * SPEED);
    let c = choose(req, &slow_peak, &config(), 0).expect("choice");
    assert_eq!(c.index, 1);
    assert!(slower_than_choice(&c, &slow_peak, 0, &with(0.8)));
    // Where either peak is unknown (not measured yet), nothing is compared.
    for unknown in [0, 1] {
        let mut u = slow;
        u[unknown].peak_prefill_tps = None;
        assert!(!slower_than_choice(&c, &u, 0, &with(0.8)));
    }
}

#[test]
fn with_speed_capped_by_peak_the_cost_weighs_a_reading_at_most_at_the_peak() {
    // The slow worker's reading overshoots (0.5 of the speed where its peak says 0.4); the
    // fast worker's reading is below its peak (it is busy: the load signal stays).
    let req = request(50);
    let mut slow = worker(0, 0.0);
    slow.prefill_tps = Some(0.5 * SPEED);
    slow.peak_prefill_tps = Some(0.4 * SPEED);
    let mut busy = worker(0, 0.0);
    busy.prefill_tps = Some(0.8 * SPEED);
    busy.peak_prefill_tps = Some(SPEED);
    let capped = ScoringConfig {
        speed_capped_by_peak: true,
        ..config()
    };
    let prefill = |cfg: &ScoringConfig, w: &Candidate| {
        choose(req, &[*w], cfg, 0).expect("choice").estimates[0].prefill_s
    };
    assert!((prefill(&config(), &slow) - 800.0 / (0.5 * SPEED)).abs() < 1e-9);
    assert!((prefill(&capped, &slow) - 800.0 / (0.4 * SPEED)).abs() < 1e-9);
    assert!((prefill(&capped, &busy) - 800.0 / (0.8 * SPEED)).abs() < 1e-9);
    // No peak yet: the reading.
    let mut unmeasured = slow;
    unmeasured.peak_prefill_tps = None;
    assert!((prefill(&capped, &unmeasured) - 800.0 / (0.5 * SPEED)).abs() < 1e-9);
    // The queue the clock holds converts to blocks at the capped speed.
    let mut queued = slow;
    queued.queued_s = 1.0;
    let at = |cfg: &ScoringConfig| queued_blocks(&queued, 16, cfg);
    assert!((at(&config()) - 0.5 * SPEED / 16.0).abs() < 1e-9);
    assert!((at(&capped) - 0.4 * SPEED / 16.0).abs() < 1e-9);
}

#[test]
fn observed_prefill_speed_replaces_the_default() {
    let req = request(50);
    let mut slow = worker(0, 0.0);
    slow.prefill_tps = Some(SPEED / 4.0);
    let fast = worker(0, 0.0);
    let c = choose(req, &[slow, fast], &config(), 0).expect("choice");
    assert_eq!(c.index, 1);
    assert!((c.estimates[0].prefill_s - 4.0 * c.estimates[1].prefill_s).abs() < 1e-9);
    // A nonsense speed falls back to the default.
    let mut bad = worker(0, 0.0);
    bad.prefill_tps = Some(f64::NAN);
    let c = choose(req, &[bad], &config(), 0).expect("choice");
    assert!((c.estimates[0].prefill_s - 800.0 / SPEED).abs() < 1e-9);
}

#[test]
fn new_content_avoids_a_worker_that_took_more_than_its_share() {
    // A short shared prefix (2 of 30 blocks) on a worker that took all recent new content.
    let req = request(30);
    let mut hot = worker(2, 0.0);
    hot.footprint = 300.0;
    let ws = [hot, worker(0, 0.0), worker(0, 0.0), worker(0, 0.0)];
    let c = choose(req, &ws, &config(), 0).expect("choice");
    assert_ne!(c.index, 0, "{:?}", c.estimates);
    assert!(c.estimates[0].footprint_s > 0.0);
    assert_eq!(c.estimates[1].footprint_s, 0.0, "under its share: no term");
    // Turned off, the two blocks win.
    let off = ScoringConfig {
        footprint_weight: 0.0,
        ..config()
    };
    assert_eq!(pick(req, &ws, &off, 0), 0);
}

#[test]
fn a_follow_up_that_adds_an_image_stays_with_its_conversation_despite_the_footprint() {
    // The history is 17 blocks on the worker that took all the recent new content, 15 of them
    // (the shared system prompt) everywhere; the turn adds a 150-block image.
    let req = request(170);
    let mut home = worker(17, 0.0);
    home.footprint = 1000.0;
    let ws = [home, worker(15, 0.0), worker(15, 0.0), worker(15, 0.0)];
    assert_ne!(
        pick(req, &ws, &config(), 0),
        0,
        "a new conversation with that prefix spreads"
    );
    let mut ws = ws;
    ws[0].holds_conversation = true;
    let c = choose(req, &ws, &config(), 0).expect("choice");
    assert_eq!(c.index, 0, "{:?}", c.estimates);
    assert_eq!(c.estimates[0].footprint_s, 0.0);
    // Its queue still counts: twice the recompute of its 2 history blocks moves it.
    ws[0].queued_s = 2.0 * 2.0 * 16.0 / SPEED * 1.01;
    assert_ne!(pick(req, &ws, &config(), 0), 0);
}

#[test]
fn the_footprint_term_cannot_pull_a_conversation_from_its_history() {
    // 95 of 100 blocks cached on a worker with all the recent footprint.
    let req = request(100);
    let mut home = worker(95, 0.0);
    home.footprint = 1000.0;
    let ws = [home, worker(0, 0.0), worker(0, 0.0), worker(0, 0.0)];
    assert_eq!(pick(req, &ws, &config(), 0), 0);
}

#[test]
fn running_ms_charges_busy_batches_when_set() {
    let req = request(10);
    let mut busy = worker(10, 0.0);
    busy.running = Some(100.0);
    let ws = [busy, worker(0, 0.0)];
    assert_eq!(pick(req, &ws, &config(), 0), 0, "off by default");
    let charged = ScoringConfig {
        running_ms: 1.0,
        ..config()
    };
    assert_eq!(pick(req, &ws, &charged, 0), 1);
}

#[test]
fn ties_go_to_fewer_in_flight_then_spread_by_random() {
    let req = request(10);
    let mut ws = vec![worker(0, 0.0); 4];
    let picks: std::collections::HashSet<usize> =
        (0..64).map(|r| pick(req, &ws, &config(), r)).collect();
    assert_eq!(picks.len(), 4, "equal workers share the traffic");
    ws[0].inflight = 2;
    ws[1].inflight = 1;
    ws[2].inflight = 1;
    ws[3].inflight = 3;
    for r in 0..32 {
        let p = pick(req, &ws, &config(), r);
        assert!(p == 1 || p == 2, "{p}");
    }
}

#[test]
fn temperature_zero_is_deterministic_and_temperature_samples_the_softmax() {
    let req = request(40);
    let ws = [worker(40, 0.0), worker(20, 0.0), worker(0, 0.0)];
    for r in 0..16 {
        assert_eq!(pick(req, &ws, &config(), r), 0);
    }
    let warm = ScoringConfig {
        temperature: 0.5,
        ..config()
    };
    let mut counts = [0usize; 3];
    for r in 0..3000 {
        counts[pick(req, &ws, &warm, r)] += 1;
    }
    // Normalised costs 0, 0.5, 1 → weights 1, e^-1, e^-2.
    let total = 1.0 + (-1.0f64).exp() + (-2.0f64).exp();
    for (i, expect) in [1.0, (-1.0f64).exp(), (-2.0f64).exp()].iter().enumerate() {
        let share = counts[i] as f64 / 3000.0;
        assert!((share - expect / total).abs() < 0.04, "{i}: {share}");
    }
}

#[test]
fn ranking_lists_every_candidate_best_first() {
    let req = request(40);
    let ws = [worker(0, 0.0), worker(40, 0.0), worker(20, 0.0)];
    let c = choose(req, &ws, &config(), 0).expect("choice");
    assert_eq!(c.ranking, vec![1, 2, 0]);
}

#[test]
fn bad_numbers_never_win_or_panic() {
    let req = request(10);
    let mut nan = worker(10, f64::NAN);
    nan.waiting = Some(f64::INFINITY);
    nan.running = Some(-3.0);
    nan.footprint = f64::NAN;
    let c = choose(req, &[nan, worker(0, 0.0)], &config(), 0).expect("choice");
    assert!(c.estimates.iter().all(|e| !e.cost_s.is_nan()));
    // Matched counts past the request are clamped.
    let c = choose(request(5), &[worker(500, 0.0)], &config(), 0).expect("choice");
    assert_eq!(c.best_matched, 5);
    assert_eq!(c.estimates[0].prefill_s, 0.0);
}
