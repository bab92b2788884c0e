use super::*;
use crate::scoring::WaitPast;
use crate::state::MemoryStore;
use crate::state::writer::{drain, read_live, record_poll, sync_members};
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
    load.route(&store, home, 1_000_000, (full_s * 0.5 * 1e6) as u64, 0);
    let again = route(&mut r, &store, &b, 1000, 0);
    assert_eq!(again.target.slot, home, "wait {:?}", again.estimate);
    assert!(again.estimate.wait_s > 0.0);
    r.finished(&store, &again, 1_000_000, false);
    // Its queue now holds six times the prompt's prefill: more than the recompute weighed
    // for the two requests in flight there (one per worker on average: twice, plus the
    // request's own time). Moving is cheaper.
    load.route(&store, home, 2_000_000, (full_s * 6.0 * 1e6) as u64, 0);
    let moved = route(&mut r, &store, &b, 2000, 0);
    assert_ne!(moved.target.slot, home);
    let (name, matched, alt) = moved
        .passed_over
        .clone()
        .expect("names what it passed over");
    assert_eq!(name, first.target.name);
    assert_eq!(matched, moved.total_blocks);
    let line = moved.log_line();
    assert!(
        line.starts_with(&format!("[ROUTING] Best: {} with 0/", moved.target.name))
            && line.contains(&format!(
                "; passed over {name} with {matched}/{matched} blocks: wait "
            ))
            && line.contains(" ms (approximate); "),
        "{line}"
    );
    let header = moved.header_value();
    assert!(
        header.starts_with("wait_ms=") && header.ends_with("; mode=approximate"),
        "{header}"
    );
    assert!(
        alt.wait_s > moved.estimate.recompute_s,
        "{alt:?} vs {:?}",
        moved.estimate
    );
}

/// A second turn of the conversation `with_system(system, image, question)` started.
fn second_turn(system: &str, image: &[u8], question: &str) -> Vec<u8> {
    let b64 = base64::engine::general_purpose::STANDARD.encode(image);
    format!(
        r#"{{"model":"m","messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{b64}"}}}},{{"type":"text","text":"{question}"}}]}},{{"role":"assistant","content":"A harbour at dusk, with three boats."}},{{"role":"user","content":"And the boats?"}}]}}"#
    )
    .into_bytes()
}

/// A conversation's second turn on 8 workers, its first turn's worker with `in_flight`
/// requests on it and six times the turn's prefill queued: the second turn's decision, and
/// the first turn's worker.
fn follow_up_behind_a_queue(conversation_hold: f64, in_flight: u32) -> (Decision, usize) {
    follow_up_behind_a_queue_with(conversation_hold, in_flight, false)
}

/// [`follow_up_behind_a_queue`] with `scoring.conversation_wait_where_copy_fits` set to
/// `wait_rule`.
fn follow_up_behind_a_queue_with(
    conversation_hold: f64,
    in_flight: u32,
    wait_rule: bool,
) -> (Decision, usize) {
    follow_up_behind_a_queue_tuned(in_flight, second_turn, |s| {
        s.conversation_hold = conversation_hold;
        s.conversation_wait_where_copy_fits = wait_rule;
    })
}

/// [`follow_up_behind_a_queue`] with the follow-up `next(system, image, question)` built and
/// the scoring configuration `tune`d.
fn follow_up_behind_a_queue_tuned(
    in_flight: u32,
    next: fn(&str, &[u8], &str) -> Vec<u8>,
    tune: impl FnOnce(&mut crate::scoring::ScoringConfig),
) -> (Decision, usize) {
    follow_up_behind_a_queue_on(in_flight, next, tune, None)
}

/// [`follow_up_behind_a_queue_tuned`] where, with `home_speed` `Some(share)`, the
/// conversation's worker prefills at that share of the others' speed (10,000 tokens/s).
fn follow_up_behind_a_queue_on(
    in_flight: u32,
    next: fn(&str, &[u8], &str) -> Vec<u8>,
    tune: impl FnOnce(&mut crate::scoring::ScoringConfig),
    home_speed: Option<f32>,
) -> (Decision, usize) {
    let store = MemoryStore::default();
    let mut c = config(8);
    tune(&mut c.router.scoring);
    // Not its group's home either (that hold is tested on its own).
    c.router.scoring.home_hold = false;
    let mut r = start(&store, c);
    let system = "You look at pictures. ".repeat(10);
    let image = png(1280, 960);
    let first = route(
        &mut r,
        &store,
        &with_system(&system, &image, "What is this?"),
        0,
        0,
    );
    assert!(r.finished(&store, &first, 10_000, true));
    apply(&store, &r, 10);
    let home = first.target.slot;
    if let Some(share) = home_speed {
        let speeds: Vec<f32> = (0..8)
            .map(|slot| {
                if slot == home {
                    10_000.0 * share
                } else {
                    10_000.0
                }
            })
            .collect();
        set_speeds(&store, &r, &speeds);
    }
    let load = LoadTable::new(r.keys().load());
    let queued_us = (first.estimate.prefill_s * 6.0 * 1e6) as u64;
    for i in 0..in_flight {
        let prefill_us = if i == 0 { queued_us } else { 0 };
        load.route(&store, home, 1_000_000, prefill_us, 0);
    }
    let next = next(&system, &image, "What is this?");
    (route(&mut r, &store, &next, 1000, 0), home)
}

/// The follow-up of [`follow_up_behind_a_queue`] with 4 in flight left its conversation's
/// worker, which carried 5 with it, past the hold's limit of 4.
fn assert_let_go(away: &Decision, home: usize) {
    assert_ne!(away.target.slot, home);
    assert_eq!(
        away.conversation,
        Some(Conversation::LetGo {
            name: format!("w{home}"),
            carries: 5.0,
            limit: 4.0
        })
    );
}

/// A third turn of the conversation `with_system(system, image, question)` started, whose
/// second turn no worker saw.
fn third_turn(system: &str, image: &[u8], question: &str) -> Vec<u8> {
    let b64 = base64::engine::general_purpose::STANDARD.encode(image);
    let answer =
        "The boats are red, blue and white, moored side by side along the quay. ".repeat(4);
    format!(
        r#"{{"model":"m","messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{b64}"}}}},{{"type":"text","text":"{question}"}}]}},{{"role":"assistant","content":"A harbour at dusk, with three boats."}},{{"role":"user","content":"And the boats?"}},{{"role":"assistant","content":"{answer}"}},{{"role":"user","content":"Which is nearest?"}}]}}"#
    )
    .into_bytes()
}

#[test]
fn a_follow_up_goes_back_to_the_worker_holding_part_of_its_conversation_with_the_partial_hold() {
    // The first turn's worker holds the system prompt, the image and the first question, not
    // the second turn: part of the conversation past the preamble. Without the partial hold
    // no worker holds the whole conversation, and the cost moves the turn off the queue.
    let (moved, home) =
        follow_up_behind_a_queue_tuned(1, third_turn, |s| s.conversation_hold_partial = false);
    assert_ne!(moved.target.slot, home);
    assert_eq!(moved.conversation, None);
    // With it (the default), the turn goes back to the worker with the longest part, within
    // the hold's bound.
    let defaults = crate::scoring::ScoringConfig::default();
    assert!(defaults.conversation_hold_partial);
    let (back, home) = follow_up_behind_a_queue_tuned(1, third_turn, |_| {});
    assert_eq!(back.target.slot, home);
    assert!(back.matched_blocks > moved.matched_blocks);
    assert!(matches!(&back.conversation, Some(Conversation::Held(n)) if *n == format!("w{home}")));
    assert!(
        back.log_line().contains("; back to its conversation"),
        "{}",
        back.log_line()
    );
    // The worker holds most of the conversation past the preamble (the image and the first
    // question, not the second turn): held with the default share bound of a half, not with
    // a bound of the whole.
    assert_eq!(defaults.conversation_hold_partial_share, 0.5);
    let (whole, home) = follow_up_behind_a_queue_tuned(1, third_turn, |s| {
        s.conversation_hold_partial_share = 1.0;
    });
    assert_ne!(whole.target.slot, home);
    assert_eq!(whole.conversation, None);
    // Past the hold's bound (5 in flight there with it), it is let go as a whole one is.
    let (away, home) = follow_up_behind_a_queue_tuned(4, third_turn, |_| {});
    assert_ne!(away.target.slot, home);
    assert!(
        matches!(&away.conversation, Some(Conversation::LetGo { name, .. }) if *name == format!("w{home}"))
    );
}

#[test]
fn a_follow_up_goes_back_to_its_conversation_within_the_holds_bound() {
    // The cost alone: the queue on the conversation's worker costs more than recomputing the
    // history elsewhere, and the turn moves.
    let (moved, home) = follow_up_behind_a_queue(0.0, 1);
    assert_ne!(moved.target.slot, home);
    assert_eq!(moved.conversation, None);
    assert!(
        moved
            .log_line()
            .contains(&format!("; passed over w{home} with ")),
        "{}",
        moved.log_line()
    );
    // With the hold (the default 2), it goes back: 2 in flight there with it, within twice
    // the bound of 2.
    assert_eq!(
        crate::scoring::ScoringConfig::default().conversation_hold,
        2.0
    );
    let (back, home) = follow_up_behind_a_queue(2.0, 1);
    assert_eq!(back.target.slot, home);
    assert!(back.matched_blocks > moved.matched_blocks);
    assert!(back.matched_blocks < back.total_blocks);
    assert!(matches!(&back.conversation, Some(Conversation::Held(n)) if *n == format!("w{home}")));
    assert!(back.home.is_none());
    assert!(
        back.log_line().contains("; back to its conversation"),
        "{}",
        back.log_line()
    );
    assert!(
        matches!(&back.overruled, Some((n, _, alt)) if *n == moved.target.name && alt.cost_s < back.estimate.cost_s),
        "{}",
        back.log_line()
    );
    assert!(back.log_line().contains("; over the cost's choice"));
    // 4 in flight there: 5 with it, past twice the bound (ceil(2 × 5 / 8) = 2, the floor).
    let (away, home) = follow_up_behind_a_queue(2.0, 4);
    assert_let_go(&away, home);
    assert!(
        away.log_line().contains(&format!(
            "; not back to its conversation on w{home}: 5 in flight there past 4"
        )),
        "{}",
        away.log_line()
    );
}

#[test]
fn a_follow_up_waits_on_its_conversations_worker_only_while_the_wait_costs_less_than_a_copy_that_fits()
 {
    // Within the hold's bound (2 in flight there with it), with six times the first turn's
    // prefill queued there: far more than the conversation's prefill on an idle worker,
    // weighed for the 1/8 request in flight per worker (2.125 times).
    let (held, home) = follow_up_behind_a_queue_with(2.0, 1, false);
    assert_eq!(held.target.slot, home);
    let (away, home) = follow_up_behind_a_queue_with(2.0, 1, true);
    assert_ne!(away.target.slot, home);
    let Some(Conversation::LetGoWait {
        name,
        past:
            WaitPast {
                extra_s,
                allowed_s: pays_s,
                small: false,
            },
    }) = &away.conversation
    else {
        panic!("let go for its wait: {:?}", away.conversation);
    };
    assert_eq!(*name, format!("w{home}"));
    assert!(*extra_s > 2.0 * pays_s, "{extra_s} {pays_s}");
    assert!(*pays_s > 0.0);
    assert!(
        away.log_line().contains(&format!(
            "; not back to its conversation on w{home}: its wait there is "
        )),
        "{}",
        away.log_line()
    );
}

/// A group's request whose home (where its first request went) has a long prefill queue,
/// on 4 workers with `scoring.home_wait_where_copy_fits` set to `on` and
/// `scoring.home_wait_allowance` to `allowance`: the decision, and the home.
fn group_request_behind_a_queue(on: bool, allowance: f64) -> (Decision, usize) {
    let mut c = home_hold(4, 1.0);
    c.router.scoring.home_wait_where_copy_fits = Some(on);
    c.router.scoring.home_wait_allowance = allowance;
    group_request_behind_a_queue_with(c)
}

/// [`group_request_behind_a_queue`] with configuration `c`.
fn group_request_behind_a_queue_with(c: FilterConfig) -> (Decision, usize) {
    group_request_behind(c, |_, _| {})
}

/// [`group_request_behind_a_queue_with`], `before_next` called just before the second
/// request is routed.
fn group_request_behind(
    mut c: FilterConfig,
    before_next: impl Fn(&MemoryStore, &Router),
) -> (Decision, usize) {
    let store = MemoryStore::default();
    // The hold on a conversation is tested on its own.
    c.router.scoring.conversation_hold = 0.0;
    let mut r = start(&store, c);
    let system = "You are a careful assistant who looks at pictures. ".repeat(12);
    let first = route(
        &mut r,
        &store,
        &with_system(&system, &png(400, 300), "Describe this image."),
        0,
        0,
    );
    assert!(r.finished(&store, &first, 10_000, true));
    apply(&store, &r, 10);
    let home = first.target.slot;
    // One request in flight there (within the load bound's floor of 2) with a second of
    // prefill queued: far longer than the preamble's copy elsewhere.
    LoadTable::new(r.keys().load()).route(&store, home, 1_000_000, 1_000_000, 0);
    before_next(&store, &r);
    let next = with_system(&system, &png(401, 300), "Describe this image.");
    (route(&mut r, &store, &next, 1000, 0), home)
}

#[test]
fn a_group_waits_at_its_home_only_while_the_wait_costs_less_than_a_copy_that_fits() {
    let (held, home) = group_request_behind_a_queue(false, 1.0);
    assert_eq!(held.target.slot, home);
    assert!(held.home.is_some(), "{}", held.log_line());
    // The log names what the hold overruled: the cost's own choice, cheaper than the home.
    let Some((cost_choice, _, alt)) = &held.overruled else {
        panic!("the hold overruled the cost: {}", held.log_line());
    };
    assert_ne!(*cost_choice, format!("w{home}"));
    assert!(alt.cost_s < held.estimate.cost_s);
    assert!(
        held.log_line()
            .contains(&format!("; over the cost's choice {cost_choice} with 0/")),
        "{}",
        held.log_line()
    );
    let (away, home) = group_request_behind_a_queue(true, 1.0);
    assert_ne!(away.target.slot, home);
    assert!(away.home.is_none());
    let Some((
        name,
        LetGo::Wait(WaitPast {
            extra_s,
            allowed_s: pays_s,
            small: false,
        }),
    )) = &away.home_let_go
    else {
        panic!("let go for its wait: {:?}", away.home_let_go);
    };
    assert_eq!(*name, format!("w{home}"));
    assert!(*extra_s > 0.9 && extra_s > pays_s, "{extra_s} {pays_s}");
    assert!(
        away.log_line().contains(&format!(
            "; not its group's home w{home}: its wait there is "
        )),
        "{}",
        away.log_line()
    );
}

#[test]
fn by_default_the_wait_bounds_a_home_only_where_its_load_bound_cannot_with_two_workers() {
    // The same second of queue at home, the defaults otherwise: with 2 workers (the load
    // bound is every request in flight) the request leaves; with 4 it is held.
    let (away, home) = group_request_behind_a_queue_with(home_hold(2, 1.0));
    assert_ne!(away.target.slot, home, "{}", away.log_line());
    let Some((
        name,
        LetGo::Wait(WaitPast {
            extra_s,
            allowed_s,
            small: false,
        }),
    )) = &away.home_let_go
    else {
        panic!("let go for its wait: {:?}", away.home_let_go);
    };
    assert_eq!(*name, format!("w{home}"));
    assert!(
        *extra_s > 0.9 && extra_s > allowed_s,
        "{extra_s} {allowed_s}"
    );
    assert!(
        away.log_line()
            .contains("ms its preamble allows, and the copy fits here"),
        "{}",
        away.log_line()
    );
    let (held, home) = group_request_behind_a_queue_with(home_hold(4, 1.0));
    assert_eq!(held.target.slot, home, "{}", held.log_line());
    assert!(held.home.is_some() && held.home_let_go.is_none());
}

#[test]
fn a_small_copy_is_let_go_from_a_slow_home_where_the_cache_turns_over() {
    // The same second of queue at home with 2 workers, and both workers took a whole cache's
    // worth of new blocks in the last moment (a cache that turns over in seconds): the copy
    // never fits on top of that. Where it is at most `small_copy_share` (1/16) of the cache
    // it is let go anyway; a larger one, or with the share at 0, the hold stands.
    let blocks = group_request_behind_a_queue_with(home_hold(2, 1.0))
        .0
        .total_blocks as u32;
    let run = |capacity: u32, share: f64| {
        let mut c = home_hold(2, 1.0);
        c.state.capacity_blocks = capacity;
        c.router.scoring.small_copy_share = share;
        let half_life = c.router.scoring.footprint_half_life_ms;
        group_request_behind(c, move |store, r| {
            crate::state::writer::update_live(store, r.keys(), 0, |t| {
                for l in t.slots.iter_mut() {
                    l.add_footprint(f64::from(capacity), 1000, half_life);
                }
                true
            });
        })
    };
    let default_share = crate::scoring::ScoringConfig::default().small_copy_share;
    let (away, home) = run(20 * blocks, default_share);
    assert_ne!(away.target.slot, home, "{}", away.log_line());
    let Some((name, LetGo::Wait(WaitPast { small: true, .. }))) = &away.home_let_go else {
        panic!("let go for a small copy: {}", away.log_line());
    };
    assert_eq!(*name, format!("w{home}"));
    assert!(
        away.log_line()
            .contains("ms its preamble allows, and the copy is a small share of the cache here"),
        "{}",
        away.log_line()
    );
    for (capacity, share) in [(20 * blocks, 0.0), (8 * blocks, default_share)] {
        let (held, home) = run(capacity, share);
        assert_eq!(
            held.target.slot,
            home,
            "{capacity} {share}: {}",
            held.log_line()
        );
        assert!(
            held.home.is_some() && held.home_let_go.is_none(),
            "{}",
            held.log_line()
        );
    }
}

#[test]
fn a_group_waits_at_its_home_while_the_wait_is_within_its_allowance() {
    // The same second of queue at home: let go where it is past the preamble's weighted
    // prefill, held where the allowance makes room for it.
    let (away, home) = group_request_behind_a_queue(true, 1.0);
    let Some((
        _,
        LetGo::Wait(WaitPast {
            extra_s,
            allowed_s: pays_s,
            ..
        }),
    )) = away.home_let_go
    else {
        panic!("let go for its wait: {:?}", away.home_let_go);
    };
    assert_ne!(away.target.slot, home);
    let allowance = 1.5 * extra_s / pays_s;
    let (held, home) = group_request_behind_a_queue(true, allowance);
    assert_eq!(held.target.slot, home, "{}", held.log_line());
    assert!(held.home.is_some() && held.home_let_go.is_none());
    // Just under the wait: let go, and the log names the allowed wait.
    let (away, _) = group_request_behind_a_queue(true, 0.9 * extra_s / pays_s);
    let Some((_, LetGo::Wait(WaitPast { allowed_s, .. }))) = away.home_let_go else {
        panic!("let go for its wait: {:?}", away.home_let_go);
    };
    assert!(
        (allowed_s - 0.9 * extra_s).abs() < 1e-6 * extra_s,
        "{allowed_s} {extra_s}"
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
        out.push((g, d.target.slot, d.home.is_some()));
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

/// Sets the workers' observed prefill speeds (tokens per second), slot by slot, as a first
/// reading (their peaks too).
fn set_speeds(store: &MemoryStore, r: &Router, speeds: &[f32]) {
    crate::state::writer::update_live(store, r.keys(), 0, |table| {
        for (l, &speed) in table.slots.iter_mut().zip(speeds) {
            l.prefill_tps = speed;
            for _ in 0..crate::state::workers::MIN_PROBES {
                l.observe_probe(f64::from(speed));
            }
        }
        true
    });
}

/// Sets the workers' current prefill speed readings only (their peaks stay): a busy worker
/// reads below what it can do.
fn set_readings(store: &MemoryStore, r: &Router, readings: &[f32]) {
    crate::state::writer::update_live(store, r.keys(), 0, |table| {
        for (l, &speed) in table.slots.iter_mut().zip(readings) {
            l.prefill_tps = speed;
        }
        true
    });
}

/// Homes of 8 applications' first requests (each finished before the next) on 2 workers, w1
/// at 0.4 times w0's prefill speed, with `scoring.home_speed_weighted` set to `on`: how many
/// groups are homed on each worker.
fn homes_on_a_mixed_fleet(on: bool) -> [usize; 2] {
    homes_on(on, &[20_000.0, 8_000.0], &[])
}

/// [`homes_on_a_mixed_fleet`] on workers of peak `speeds` that read `readings`.
fn homes_on(on: bool, speeds: &[f32], readings: &[f32]) -> [usize; 2] {
    let store = MemoryStore::default();
    let mut c = home_hold(2, 1.0);
    c.router.scoring.home_speed_weighted = on;
    let mut r = start(&store, c);
    set_speeds(&store, &r, speeds);
    set_readings(&store, &r, readings);
    for g in 0..8u32 {
        let system = format!("You are assistant number {g}. ").repeat(20);
        let b = with_system(&system, &png(500 + g, 600), "Describe this image.");
        let t = u64::from(g) * 1000;
        let d = route(&mut r, &store, &b, t, u64::from(g));
        assert!(r.finished(&store, &d, t * 1000 + 500_000, true));
        apply(&store, &r, t + 600);
    }
    let bytes = store
        .get(&r.keys().homes())
        .ok()
        .flatten()
        .map(|(b, _)| b)
        .unwrap_or_default();
    let table = Homes::decode(&bytes);
    assert_eq!(table.entries.len(), 8);
    let on_slot = |s: u16| table.entries.iter().filter(|h| h.slot == s).count();
    [on_slot(0), on_slot(1)]
}

#[test]
fn with_speed_weighted_homes_a_slower_worker_is_home_to_fewer_groups() {
    // Placed by groups alone the two workers get 4 each; per unit of speed the slower one
    // counts each of its groups as 2.5 and gets 2 or 3 of 8.
    assert_eq!(homes_on_a_mixed_fleet(false), [4, 4]);
    let [fast, slow] = homes_on_a_mixed_fleet(true);
    assert!(fast >= 5 && slow <= 3, "{fast} / {slow}");
    // Equal workers where one reads at 0.4 of the other (busy: its prefill times count their
    // waits): their measured peaks are equal, so homes are placed as on equal workers.
    assert_eq!(homes_on(true, &[20_000.0; 2], &[20_000.0, 8_000.0]), [4, 4]);
    // Peaks at 0.7 of each other are the probes' noise on equal workers (the first probes
    // count image-heavy requests' encoder time): placed as equal. At 0.45, weighted.
    assert_eq!(homes_on(true, &[20_000.0, 14_000.0], &[]), [4, 4]);
    let [fast, slow] = homes_on(true, &[20_000.0, 9_000.0], &[]);
    assert!(fast >= 5 && slow <= 3, "{fast} / {slow}");
}

#[test]
fn at_start_up_the_first_group_seen_is_held_to_its_home() {
    // Four workers, one application's first requests, none finished: the first group the
    // homes table sees is all of its traffic. Counted over that alone, its share (1.0 × 4
    // workers) is past the 1.5 shares a home holds, and each request went where the cost
    // said, copying the system prompt to a new worker. Over at least 4 requests per worker
    // (16 here) it is held.
    let system = "You are assistant one. ".repeat(20);
    let run = |min_requests: f64| {
        let store = MemoryStore::default();
        let mut config = home_hold(4, 1.0);
        config.router.scoring.home_share_min_requests = min_requests;
        config.router.scoring.home_load_floor = 2;
        let mut r = start(&store, config);
        let mut slots = Vec::new();
        for i in 0..2u32 {
            let b = with_system(&system, &png(700 + i, 600), "Describe this image.");
            // Routed 1 ms apart, before the state writer has recorded the first's blocks.
            let d = route(&mut r, &store, &b, u64::from(i), u64::from(i));
            slots.push((d.target.slot, d.home.is_some(), d.log_line()));
        }
        slots
    };
    let held = run(4.0);
    assert_eq!(held[0].0, held[1].0, "both on the group's home: {held:?}");
    assert!(held[1].1, "the second went home against the cost: {held:?}");
    assert!(held[1].2.contains("; its group's home"), "{}", held[1].2);
    let let_go = run(0.0);
    assert_ne!(
        let_go[0].0, let_go[1].0,
        "the cost spreads them: {let_go:?}"
    );
    // The decision log says which home it was not held to, and why: the group is all of the
    // traffic seen, 4 workers' shares.
    let expected = format!(
        "; not its group's home w{}: its group has 4.0 workers' shares of the traffic",
        let_go[0].0
    );
    assert!(let_go[1].2.contains(&expected), "{}", let_go[1].2);
}

/// Two workers, slack 0.25: another application's 8 finished requests, then 8 of this one's,
/// none finished, each with a new image. Returns where the 8 went and whether any was held.
fn fill_home(config: FilterConfig) -> (Vec<usize>, bool) {
    let (slots, held, _) = fill_home_logged(config);
    (slots, held)
}

/// [`fill_home`], with the 8 decisions' log lines.
fn fill_home_logged(config: FilterConfig) -> (Vec<usize>, bool, Vec<String>) {
    fill_home_after(config, 1)
}

/// [`fill_home_logged`] after `others` other applications' 8 finished requests (taking turns).
fn fill_home_after(config: FilterConfig, others: u32) -> (Vec<usize>, bool, Vec<String>) {
    fill_home_on(config, others, &[])
}

/// [`fill_home_after`] on workers of the observed prefill `speeds` ([`set_speeds`]).
fn fill_home_on(
    config: FilterConfig,
    others: u32,
    speeds: &[f32],
) -> (Vec<usize>, bool, Vec<String>) {
    fill_home_read(config, others, speeds, &[])
}

/// [`fill_home_on`] where the workers then read `readings` ([`set_readings`]).
fn fill_home_read(
    config: FilterConfig,
    others: u32,
    speeds: &[f32],
    readings: &[f32],
) -> (Vec<usize>, bool, Vec<String>) {
    let store = MemoryStore::default();
    let mut r = start(&store, config);
    set_speeds(&store, &r, speeds);
    set_readings(&store, &r, readings);
    let system = "You are assistant one. ".repeat(20);
    // Other applications' traffic first (finished), so that this one's is no more than
    // one worker's share.
    let names = ["two", "three", "four", "five", "six"];
    for i in 0..8u32 {
        let name = names.get((i % others.max(1)) as usize).unwrap_or(&"two");
        let other = format!("You are assistant {name}. ").repeat(20);
        let b = with_system(&other, &png(300 + i, 600), "Describe this image.");
        let d = route(&mut r, &store, &b, u64::from(i), u64::from(i));
        apply(&store, &r, u64::from(i) + 1);
        assert!(r.finished(&store, &d, (u64::from(i) + 1) * 1000, true));
    }
    let (mut slots, mut held, mut lines) = (Vec::new(), false, Vec::new());
    for i in 0..8u32 {
        let b = with_system(&system, &png(600 + i, 600), "Describe this image.");
        let d = route(&mut r, &store, &b, u64::from(i), u64::from(i));
        apply(&store, &r, u64::from(i) + 1);
        slots.push(d.target.slot);
        held |= d.home.is_some();
        lines.push(d.log_line());
    }
    (slots, held, lines)
}

/// [`bounded_home`] with room for every footprint and the load bounds lifted at any load
/// (`load_bounds_lift_at` 0.5), then `tune`d.
fn lifted_home(tune: impl FnOnce(&mut crate::scoring::ScoringConfig)) -> FilterConfig {
    let mut config = bounded_home(1.0, config(2).state.capacity_blocks);
    config.router.scoring.load_bounds_lift_at = 0.5;
    tune(&mut config.router.scoring);
    config
}

/// `home_hold(2, 0.25)` with shares over what the table has seen: the other application's
/// 8 requests make this one's no more than one worker's share from its first request on.
fn bounded_home(fit_load_factor: f64, capacity_blocks: u32) -> FilterConfig {
    let mut config = home_hold(2, 0.25);
    config.router.scoring.home_share_min_requests = 0.0;
    config.router.scoring.home_fit_load_factor = fit_load_factor;
    config.state.capacity_blocks = capacity_blocks;
    // The load bound alone (the wait rule, on by default with 2 workers, and the lift of the
    // bounds where the fleet is busy, are tested on their own).
    config.router.scoring.home_wait_where_copy_fits = Some(false);
    config.router.scoring.load_bounds_lift_at = 0.0;
    config
}

#[test]
fn a_home_past_its_load_bound_is_not_held_to() {
    // None finishes: the home fills up to the bound (ceil(1.25 × mean)), then the rest go to
    // the other worker.
    let roomy = config(2).state.capacity_blocks;
    let (slots, held, lines) = fill_home_logged(bounded_home(1.0, roomy));
    assert!(
        held,
        "the hold kept some at home against the cost: {slots:?}"
    );
    let at_home = slots.iter().filter(|&&s| s == slots[0]).count();
    assert!(
        (4..=5).contains(&at_home),
        "at most ceil(1.25 × 8 / 2) = 5 at home, and not spread evenly by cost alone: {slots:?}"
    );
    // The decision log says why the first one sent away was not held: the home would carry
    // more than its bound.
    let away = slots
        .iter()
        .position(|&s| s != slots[0])
        .expect("one went away");
    let line = &lines[away];
    let why = format!("; not its group's home w{}: ", slots[0]);
    let numbers: Vec<u32> = line
        .split(&why)
        .nth(1)
        .and_then(|rest| rest.split(';').next())
        .map(|why| why.split(' ').filter_map(|w| w.parse().ok()).collect())
        .unwrap_or_default();
    assert!(
        line.contains(" in flight there past its bound of "),
        "{line}"
    );
    assert!(
        matches!(numbers[..], [carries, bound] if carries > bound),
        "{line}"
    );
    for (line, &slot) in lines.iter().zip(&slots) {
        if slot == slots[0] {
            assert!(!line.contains("not its group's home"), "{line}");
        }
    }
}

#[test]
fn with_home_load_by_groups_a_home_among_more_groups_than_workers_carries_more() {
    // Two workers; four other applications sent 8 requests before this one's 8: with the
    // option, the bound's slack (0.25) is multiplied by the effective groups per worker
    // (rates 2, 2, 2, 2 and this group's: 2.4 at its third request), so its home is held to
    // longer. With one other application there are no more groups than workers: no change.
    let roomy = config(2).state.capacity_blocks;
    let by_groups = |on: bool| {
        let mut config = bounded_home(1.0, roomy);
        config.router.scoring.home_load_by_groups = on;
        config
    };
    let first_away = |slots: &[usize]| slots.iter().position(|&s| s != slots[0]);
    let (fixed, _, _) = fill_home_after(by_groups(false), 4);
    let (loosened, held, lines) = fill_home_after(by_groups(true), 4);
    assert!(held, "{loosened:?}");
    // At its third request the home may carry ceil(1.25 × 3 / 2) = 2 in flight, loosened
    // ceil((1 + 0.25 × 2.4) × 3 / 2) = 3: the fixed bound lets the third go, the loosened
    // one the fifth (ceil((1 + 0.25 × 2.1) × 5 / 2) = 4).
    assert_eq!(first_away(&fixed), Some(2), "{fixed:?}");
    assert_eq!(first_away(&loosened), Some(4), "{loosened:?}");
    // The decision log says the loosened bound it was let go at.
    assert!(
        lines[4].contains("5 in flight there past its bound of 4"),
        "{}",
        lines[4]
    );
    let (two_groups_fixed, _, _) = fill_home_after(by_groups(false), 1);
    let (two_groups_on, _, _) = fill_home_after(by_groups(true), 1);
    assert_eq!(two_groups_on, two_groups_fixed);
}

#[test]
fn with_the_bounds_lifted_a_group_past_the_lifts_shares_keeps_its_load_bound() {
    // Two workers, the bound ceil(1.25 × mean) (`bounded_home`); another application's 8
    // finished requests first. Without the lift the third request leaves home (above); lifted
    // at any load (`load_bounds_lift_at` 0.5), all 8 stay. With `load_bounds_lift_max_shares`
    // 0.7 this group's shares at its k-th request are 2k / (8 + k): 0.67 at the fourth, 0.77
    // at the fifth, which keeps its bound and leaves (5 in flight, ceil(1.25 × 5 / 2) = 4).
    let lifted = |max_shares: f64| lifted_home(|s| s.load_bounds_lift_max_shares = max_shares);
    let first_away = |slots: &[usize]| slots.iter().position(|&s| s != slots[0]);
    let (fixed, _, _) = fill_home_after(bounded_home(1.0, config(2).state.capacity_blocks), 1);
    let (every, _, _) = fill_home_after(lifted(0.0), 1);
    let (limited, held, lines) = fill_home_after(lifted(0.7), 1);
    assert_eq!(first_away(&fixed), Some(2), "{fixed:?}");
    assert_eq!(first_away(&every), None, "{every:?}");
    assert!(held, "{limited:?}");
    assert_eq!(first_away(&limited), Some(4), "{limited:?}");
    assert!(
        lines[4].contains("5 in flight there past its bound of 4"),
        "{}",
        lines[4]
    );
}

#[test]
fn with_the_bounds_lifted_a_home_keeps_its_bound_where_a_copy_fits_with_the_option() {
    // The lift at any load keeps all 8 at home (above). With
    // `load_bounds_lift_unless_copy_fits`, where the other worker's cache holds a copy (a
    // roomy cache) the home keeps its bound, and the third leaves as without the lift; where
    // it cannot (a cache of about two requests, and the other application's 8 requests
    // there), the lift stands.
    let roomy = config(2).state.capacity_blocks;
    let blocks = {
        let store = MemoryStore::default();
        let mut r = start(&store, config(2));
        let system = "You are assistant one. ".repeat(20);
        let b = with_system(&system, &png(600, 600), "Describe this image.");
        route(&mut r, &store, &b, 0, 0).total_blocks as u32
    };
    let lifted = |unless_copy_fits: bool, capacity: u32| {
        let mut config = bounded_home(1.0, capacity);
        config.router.scoring.load_bounds_lift_at = 0.5;
        config.router.scoring.load_bounds_lift_max_shares = 0.0;
        config.router.scoring.load_bounds_lift_unless_copy_fits = unless_copy_fits;
        config
    };
    let first_away = |slots: &[usize]| slots.iter().position(|&s| s != slots[0]);
    let (every, _, _) = fill_home_after(lifted(false, roomy), 1);
    assert_eq!(first_away(&every), None, "{every:?}");
    let (fits, _, lines) = fill_home_after(lifted(true, roomy), 1);
    assert_eq!(first_away(&fits), Some(2), "{fits:?}");
    assert!(
        lines[2].contains("3 in flight there past its bound of 2"),
        "{}",
        lines[2]
    );
    let (tight, held, _) = fill_home_after(lifted(true, 2 * blocks), 1);
    assert!(held, "{tight:?}");
    assert_eq!(first_away(&tight), None, "{tight:?}");
    assert!(!crate::scoring::ScoringConfig::default().load_bounds_lift_unless_copy_fits);
}

#[test]
fn with_the_bounds_lifted_a_conversation_keeps_its_bound_where_a_copy_fits_with_the_option() {
    // 4 in flight on the conversation's worker, 5 with the follow-up, over 8 workers: the
    // mean 0.625 lifts the bounds at 0.5, and the hold's limit is every request in flight
    // times 2. With `conversation_lift_unless_copy_fits` an idle worker's roomy cache holds
    // the copy, so the hold keeps twice its bound (the floor 2), 4, and lets the turn go.
    let lift = |s: &mut crate::scoring::ScoringConfig| s.load_bounds_lift_at = 0.5;
    let (held, home) = follow_up_behind_a_queue_tuned(4, second_turn, lift);
    assert_eq!(held.target.slot, home);
    assert!(matches!(&held.conversation, Some(Conversation::Held(_))));
    let (away, home) = follow_up_behind_a_queue_tuned(4, second_turn, |s| {
        lift(s);
        s.conversation_lift_unless_copy_fits = true;
    });
    assert_let_go(&away, home);
    assert!(!crate::scoring::ScoringConfig::default().conversation_lift_unless_copy_fits);
}

#[test]
fn with_the_bounds_lifted_a_slower_home_keeps_its_bound_with_the_option() {
    // Two workers, the home 0.4 times the other's speed. The lift at any load keeps all 8
    // on the home; with `load_bounds_lift_min_speed` 0.8 the slow home keeps its bound and the
    // third leaves, as without the lift. On equal workers the option does nothing.
    let lifted = |min_speed: f64| {
        lifted_home(|s| {
            s.load_bounds_lift_max_shares = 0.0;
            s.load_bounds_lift_min_speed = min_speed;
        })
    };
    let first_away = |slots: &[usize]| slots.iter().position(|&s| s != slots[0]);
    // The other application's requests take the idle fast worker first: it is their home,
    // and the slow one this group's.
    let speeds = [10_000.0, 4_000.0];
    let (every, _, _) = fill_home_on(lifted(0.0), 1, &speeds);
    assert_eq!(every[0], 1, "{every:?}");
    assert_eq!(first_away(&every), None, "{every:?}");
    let (slow, held, lines) = fill_home_on(lifted(0.8), 1, &speeds);
    assert!(held, "{slow:?}");
    assert_eq!(slow[0], 1, "{slow:?}");
    assert_eq!(first_away(&slow), Some(2), "{slow:?}");
    assert!(
        lines[2].contains("3 in flight there past its bound of 2"),
        "{}",
        lines[2]
    );
    let (equal, _, _) = fill_home_on(lifted(0.8), 1, &[10_000.0, 10_000.0]);
    assert_eq!(first_away(&equal), None, "{equal:?}");
    // Equal workers where the home reads slow (busy: its prefill times count their waits) but
    // its peak is the other's: as fast, so the lift holds.
    let (busy, _, _) = fill_home_read(lifted(0.8), 1, &[10_000.0, 10_000.0], &[10_000.0, 4_000.0]);
    assert_eq!(busy[0], 1, "{busy:?}");
    assert_eq!(first_away(&busy), None, "{busy:?}");
    assert_eq!(
        crate::scoring::ScoringConfig::default().load_bounds_lift_min_speed,
        0.0
    );
}

#[test]
fn with_the_bounds_lifted_a_slower_conversation_worker_keeps_its_bound_with_the_option() {
    // As above for a conversation's worker at 0.4 times the others' speed: held under the lift,
    // let go with `load_bounds_lift_min_speed` 0.8 (5 in flight past the limit of 4), held
    // again where it is as fast as the rest.
    let lift = |s: &mut crate::scoring::ScoringConfig| s.load_bounds_lift_at = 0.5;
    let min_speed = |s: &mut crate::scoring::ScoringConfig| {
        lift(s);
        s.load_bounds_lift_min_speed = 0.8;
    };
    let (held, home) = follow_up_behind_a_queue_on(4, second_turn, lift, Some(0.4));
    assert_eq!(held.target.slot, home);
    assert!(matches!(&held.conversation, Some(Conversation::Held(_))));
    let (away, home) = follow_up_behind_a_queue_on(4, second_turn, min_speed, Some(0.4));
    assert_let_go(&away, home);
    let (equal, home) = follow_up_behind_a_queue_on(4, second_turn, min_speed, Some(1.0));
    assert_eq!(equal.target.slot, home);
    assert!(matches!(&equal.conversation, Some(Conversation::Held(_))));
}

#[test]
fn with_home_spares_homes_a_request_past_its_bound_stays_rather_than_join_another_home() {
    // Caches of about one request (no home's footprint fits: no fit factor). Another
    // application's 8 requests (a second apart, each finished) make one worker its home;
    // this one's home is another. Past its home's load bound (none of its 8 finishes), this
    // application's request would go to the other application's home, which holds its
    // preamble: with the option it stays home (up to twice the bound, here all 8). With a
    // third worker that is no group's home, it goes there, never to the other home.
    let system = "You are assistant one. ".repeat(20);
    let other = "You are assistant two. ".repeat(20);
    let blocks = {
        let store = MemoryStore::default();
        let mut r = start(&store, config(2));
        let b = with_system(&system, &png(600, 600), "Describe this image.");
        route(&mut r, &store, &b, 0, 0).total_blocks as u32
    };
    let run_within = |on: bool, workers: usize, wait_allowance: f64| {
        let store = MemoryStore::default();
        let mut config = home_hold(workers, 0.25);
        config.router.scoring.home_share_min_requests = 0.0;
        config.router.scoring.home_fit_load_factor = 2.0;
        config.router.scoring.home_wait_where_copy_fits = Some(false);
        config.router.scoring.home_spares_homes = on;
        config.router.scoring.home_wait_allowance = wait_allowance;
        config.state.capacity_blocks = blocks;
        let mut r = start(&store, config);
        let mut other_home = usize::MAX;
        for i in 0..8u64 {
            let b = with_system(&other, &png(300 + i as u32, 600), "Describe this image.");
            let d = route(&mut r, &store, &b, i * 1000, i);
            other_home = d.target.slot;
            apply(&store, &r, i * 1000 + 1);
            assert!(r.finished(&store, &d, (i * 1000 + 500) * 1000, true));
            apply(&store, &r, i * 1000 + 501);
        }
        let (mut slots, mut lines) = (Vec::new(), Vec::new());
        for i in 0..8u64 {
            let b = with_system(&system, &png(600 + i as u32, 600), "Describe this image.");
            let d = route(&mut r, &store, &b, 10_000 + i, i);
            apply(&store, &r, 10_001 + i);
            slots.push(d.target.slot);
            lines.push(d.log_line());
        }
        (slots, lines, other_home)
    };
    let run = |on: bool, workers: usize| run_within(on, workers, 1e6);
    let first_away = |slots: &[usize]| slots.iter().position(|&s| s != slots[0]);
    // Off: the third request, carrying 3 past ceil(1.25 × 3 / 2) = 2, goes away.
    let (off, _, _) = run(false, 2);
    assert_eq!(first_away(&off), Some(2), "{off:?}");
    let (on, lines, _) = run(true, 2);
    assert_eq!(first_away(&on), None, "all at home: {on:?}");
    assert!(
        lines[2].contains("its group's home, 3 in flight there past its bound of 2 and ")
            && lines[2]
                .contains(" ms: the cost's choice is another group's home and holds its preamble"),
        "{}",
        lines[2]
    );
    // Three workers: off, some go to the other application's home; on, the ones let go
    // past the bound go to the third worker, nobody's home, and the log says so for none.
    let (three_off, _, other_home) = run(false, 3);
    assert!(
        three_off.contains(&other_home),
        "{three_off:?} ({other_home})"
    );
    let (three_on, three_lines, other_home) = run(true, 3);
    assert_eq!(first_away(&three_on), Some(2), "{three_on:?}");
    assert!(
        !three_on.contains(&other_home),
        "{three_on:?} ({other_home})"
    );
    assert!(
        three_lines
            .get(2)
            .is_some_and(|l| !l.contains("another group's home"))
    );
    // The limit in time (`home_wait_allowance` times the preamble's weighted prefill): the
    // home's queue of two requests with images waits longer than the preamble's weighted
    // prefill, so at 1 the third request goes as without the option.
    let (short, _, _) = run_within(true, 2, 1.0);
    assert_eq!(first_away(&short), Some(2), "{short:?}");
}

#[test]
fn a_home_whose_cache_holds_what_it_took_recently_is_held_to_past_its_bound() {
    // The same requests with the default `home_fit_load_factor` (2): while the home's cache
    // holds its footprint and the request's new blocks, it carries up to twice the bound,
    // here all 8 (twice ceil(1.25 × 8 / 2) = 10).
    let roomy = config(2).state.capacity_blocks;
    let (slots, held) = fill_home(bounded_home(2.0, roomy));
    assert!(held, "{slots:?}");
    let at_home = slots.iter().filter(|&&s| s == slots[0]).count();
    assert_eq!(at_home, 8, "all at home: {slots:?}");
    // A cache of 3 of these requests: the footprint outgrows it and the bound holds again.
    let blocks = {
        let store = MemoryStore::default();
        let mut r = start(&store, config(2));
        let b = with_system(&"x".repeat(10), &png(600, 600), "Describe this image.");
        route(&mut r, &store, &b, 0, 0).total_blocks as u32
    };
    let (slots, _) = fill_home(bounded_home(2.0, 3 * blocks));
    let at_home = slots.iter().filter(|&&s| s == slots[0]).count();
    assert!(
        (4..=5).contains(&at_home),
        "{blocks} blocks each: {slots:?}"
    );
}

#[test]
fn a_group_whose_home_carries_far_more_than_the_mean_moves_to_the_idler_worker() {
    // Homes are chosen at first sight, before a group's popularity is known: here two
    // applications that turn out popular share worker A (12 and 5 recent requests, against 3
    // on B), and A has a queue. The cost sends the next request of the smaller one (a new
    // image) to idle B. Without the rule, the hold takes it back to A, as it would every
    // request of both while A's queue lasts; with it, its home moves to B and it stays there.
    let systems: Vec<String> = (0..3)
        .map(|k| format!("You are assistant {k}. ").repeat(20))
        .collect();
    let run = |above: f64| {
        let store = MemoryStore::default();
        let mut config = home_hold(2, 1.0);
        config.router.scoring.home_rebalance_above = above;
        // Without the rule the hold takes it back to A: the wait rule (on by default with 2
        // workers) would let it go for A's queue, and is tested on its own.
        config.router.scoring.home_wait_where_copy_fits = Some(false);
        let mut r = start(&store, config);
        // Each application's first request (finished) gives it a home: one worker gets two.
        let mut first = Vec::new();
        for (k, system) in systems.iter().enumerate() {
            let t = k as u64;
            let b = with_system(system, &png(100 + k as u32, 600), "Describe this image.");
            let d = route(&mut r, &store, &b, t, t);
            apply(&store, &r, t + 1);
            assert!(r.finished(&store, &d, (t + 1) * 1000, true));
            first.push(d.target.slot);
        }
        let a = if first[0] == first[1] || first[0] == first[2] {
            first[0]
        } else {
            first[1]
        };
        let on_a: Vec<usize> = (0..3).filter(|&k| first[k] == a).collect();
        assert_eq!(on_a.len(), 2, "{first:?}");
        let (big, small) = (on_a[0], on_a[1]);
        let key = r.keys().homes();
        let (bytes, _) = store.get(&key).expect("store").expect("homes");
        let mut homes = Homes::decode(&bytes);
        assert_eq!(homes.entries.len(), 3);
        for (k, h) in homes.entries.iter_mut().enumerate() {
            assert_eq!(usize::from(h.slot), first[k]);
            h.rate = if k == big {
                12.0
            } else if k == small {
                5.0
            } else {
                3.0
            };
            h.seen_ms = 10;
        }
        store.set(&key, &homes.encode(), None).expect("store");
        let load = LoadTable::new(r.keys().load());
        load.route(&store, a, 10_000, 2_000_000, 0);
        let b = with_system(&systems[small], &png(200, 600), "Describe this image.");
        let d = route(&mut r, &store, &b, 10, 7);
        let (bytes, _) = store.get(&key).expect("store").expect("homes");
        let home = Homes::decode(&bytes)
            .entries
            .get(small)
            .map(|h| usize::from(h.slot));
        (a, d.target.slot, home)
    };
    let (a, slot, home) = run(1.25);
    assert_ne!(slot, a, "stays on the idle worker");
    assert_eq!(home, Some(slot), "its home moved there");
    let (a, slot, home) = run(0.0);
    assert_eq!((slot, home), (a, Some(a)), "held to its busy home");
}

/// One system prompt on all traffic, 2 workers, 16 requests each finished before the next
/// (its prefill not seen to end: the queue clock keeps its estimate), each with a new image,
/// `gap_ms` apart: (worker, went home) of each.
fn one_application(capacity_blocks: Option<u32>, lift: bool, gap_ms: u64) -> Vec<(usize, bool)> {
    let store = MemoryStore::default();
    let mut config = home_hold(2, 1.0);
    config.router.scoring.home_fit_lifts_share_limit = lift;
    if let Some(c) = capacity_blocks {
        config.state.capacity_blocks = c;
    }
    let mut r = start(&store, config);
    let system = "You are assistant one. ".repeat(20);
    (0..16u32)
        .map(|i| {
            let t = 200 + u64::from(i) * gap_ms;
            let b = with_system(&system, &png(900 + i, 500), "Describe this image.");
            let d = route(&mut r, &store, &b, t, u64::from(i));
            apply(&store, &r, t + 1);
            assert!(r.finished(&store, &d, (t + 5) * 1000, true));
            (d.target.slot, d.home.is_some())
        })
        .collect()
}

#[test]
fn an_application_whose_prompt_is_on_every_request_is_not_held_to_a_worker_whose_cache_turns_over()
{
    // One system prompt on all traffic: more than one worker's share. With a cache of three
    // of these requests, the home's footprint outgrows it (so even with
    // `home_fit_lifts_share_limit` the limit applies), and the cost spreads the new
    // content as without homes (with the hold, at 2 workers and the default bound, every
    // request would go to the one home). Its share counts over at least 4 requests per
    // worker (8 here): the first 6 of them (6 / 8 × 2 workers = 1.5 shares) may be held;
    // from the 8th on the table has seen enough.
    let blocks = {
        let store = MemoryStore::default();
        let mut r = start(&store, config(2));
        let b = with_system(&"x".repeat(10), &png(900, 500), "Describe this image.");
        route(&mut r, &store, &b, 0, 0).total_blocks as u32
    };
    // With the lift on the small cache, and without it on the roomy one.
    for (capacity, lift) in [(Some(3 * blocks), true), (None, false)] {
        let spread = one_application(capacity, lift, 1000);
        for (i, &(_, home)) in spread.iter().enumerate().skip(7) {
            assert!(!home, "request {i} held home: {spread:?}");
        }
        let first = spread.get(7).map(|&(s, _)| s);
        assert!(
            spread.iter().skip(7).any(|&(s, _)| Some(s) != first),
            "spread over both: {spread:?}"
        );
    }
}

#[test]
fn with_the_lift_an_application_whose_prompt_is_on_every_request_stays_home_while_its_cache_holds_it()
 {
    // The same traffic with the default cache (room for all of it) and
    // `home_fit_lifts_share_limit`: the share limit does not apply, and every
    // request goes to the worker that holds the system prompt; the hold brings back the ones
    // the cost would send to the idle worker for balance. (Without the lift, the test above.)
    let roomy = one_application(None, true, 1000);
    let home = roomy.first().map(|&(s, _)| s);
    assert!(
        roomy.iter().all(|&(s, _)| Some(s) == home),
        "all on the home: {roomy:?}"
    );
    assert!(roomy.iter().any(|&(_, h)| h), "some held: {roomy:?}");
    // 10 ms apart, each request's estimated prefill (about 0.1 s) is still on the home's
    // queue clock when the next comes: past the group's share, a wait longer than the
    // weighted prefill of its preamble (a few blocks) is not worth it, and the cost spreads the
    // new images over both workers.
    let queued = one_application(None, true, 10);
    let home = queued.first().map(|&(s, _)| s);
    assert!(
        queued.iter().skip(8).any(|&(s, _)| Some(s) != home),
        "spread over both: {queued:?}"
    );
}

/// 4 workers, 30 requests 1 s apart, each finished before the next and each with a new
/// image: of every 5, the first `hot` are of one application (system prompt A) and the
/// rest of three others in turn. (group is A, worker, went home) of each request.
fn hot_group(hot: u32, fit_max_traffic: f64) -> Vec<(bool, usize, bool)> {
    let store = MemoryStore::default();
    let mut config = home_hold(4, 1.0);
    config.router.scoring.home_fit_max_traffic = fit_max_traffic;
    // The rule alone: with the lift, the wait there decides as well.
    config.router.scoring.home_fit_lifts_share_limit = false;
    let mut r = start(&store, config);
    let systems: Vec<String> = ["A", "B", "C", "D"]
        .iter()
        .map(|n| format!("You are assistant {n}. ").repeat(6))
        .collect();
    let mut others = 0;
    (0..30u32)
        .map(|i| {
            let hot_one = i % 5 < hot;
            let g = if hot_one {
                0
            } else {
                others += 1;
                1 + others % 3
            };
            let t = 200 + u64::from(i) * 1000;
            let b = with_system(&systems[g], &png(700 + i, 1000), "Describe this image.");
            let d = route(&mut r, &store, &b, t, u64::from(i));
            apply(&store, &r, t + 1);
            assert!(r.finished(&store, &d, (t + 5) * 1000, true));
            (hot_one, d.target.slot, d.home.is_some())
        })
        .collect()
}

#[test]
fn a_group_with_less_than_half_the_traffic_stays_home_while_its_cache_holds_it() {
    // A has 2 requests in 5: 1.6 workers' shares of 4, past the share limit (1.5). Without
    // `home_fit_max_traffic` the cost spreads its new images over the workers with less
    // footprint, each taking a copy of its system prompt; with 0.5 it is held (its home's
    // cache, the default, holds what it took).
    let a_workers = |went: &[(bool, usize, bool)]| {
        went.iter()
            .filter(|w| w.0)
            .map(|w| w.1)
            .collect::<std::collections::HashSet<usize>>()
    };
    let held = hot_group(2, 0.5);
    assert_eq!(a_workers(&held).len(), 1, "A on its home: {held:?}");
    assert!(
        held.iter().any(|w| w.0 && w.2),
        "held against the cost: {held:?}"
    );
    let spread = hot_group(2, 0.0);
    assert!(a_workers(&spread).len() > 1, "A spread: {spread:?}");
    // An application on every request (4 shares, all of the traffic) is not held by it.
    let all = hot_group(5, 0.5);
    assert!(a_workers(&all).len() > 1, "spread: {all:?}");
}

/// 2 workers: 8 users' first requests at once, three of them of group 3 and two each of
/// groups 4 and 5 (the start-up burst of tight-256, seed 138), then the first requests of
/// groups 2 and 0. How many groups each worker is home to.
fn start_up_homes(fewest_groups: bool) -> [usize; 2] {
    let store = MemoryStore::default();
    let mut config = home_hold(2, 1.0);
    config.router.scoring.home_fewest_groups = fewest_groups;
    let mut r = start(&store, config);
    let systems: Vec<String> = (0..6)
        .map(|n| format!("You are assistant {n}. ").repeat(6))
        .collect();
    let mut homes: std::collections::HashMap<usize, usize> = Default::default();
    for (i, g) in [3, 1, 4, 5, 5, 4, 3, 3, 2, 0].into_iter().enumerate() {
        let i = i as u32;
        let b = with_system(&systems[g], &png(700 + i, 1000), "Describe this image.");
        // The burst within 10 ms, the two later groups 0.2 s on; nothing finishes.
        let t = if i < 8 {
            200 + u64::from(i)
        } else {
            400 + u64::from(i)
        };
        let d = route(&mut r, &store, &b, t, u64::from(i));
        apply(&store, &r, t + 1);
        homes.entry(g).or_insert(d.target.slot);
    }
    let on = |slot| homes.values().filter(|&&s| s == slot).count();
    [on(0), on(1)]
}

#[test]
fn with_fewest_groups_a_start_up_burst_does_not_put_most_groups_on_one_worker() {
    // By the homed rate alone, the worker that took the burst's larger groups looks busier
    // and both later groups go to the other: 2 groups against 4.
    let by_rate = start_up_homes(false);
    assert_eq!(by_rate.iter().max(), Some(&4), "{by_rate:?}");
    // Five requests against three is within the noise of such counts: the groups decide.
    assert_eq!(start_up_homes(true), [3, 3]);
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

/// `body` with `"stream": true`.
fn streamed(body: &[u8]) -> Vec<u8> {
    let text = String::from_utf8_lossy(body);
    text.replacen('{', r#"{"stream":true,"#, 1).into_bytes()
}

#[test]
fn a_streamed_request_on_an_empty_queue_measures_its_workers_peak_speed() {
    let store = MemoryStore::default();
    let mut r = router(&store, 1);
    let keys = r.keys().clone();
    let live = || read_live(&store, &keys).get(0).copied().unwrap_or_default();
    // Not streamed: its first byte is the whole answer, no probe.
    let d = route(&mut r, &store, &body(&png(1000, 1000), "a"), 0, 0);
    assert_eq!(d.speed_probe, None);
    assert_eq!(r.measure_speed(&store, &d, 100_000), None);
    assert!(r.finished(&store, &d, 1_000_000, false));
    // Streamed, on an empty queue: its uncached tokens over the time to its first chunk.
    let d = route(
        &mut r,
        &store,
        &streamed(&body(&png(1001, 1000), "b")),
        2_000,
        0,
    );
    let probe = d.speed_probe.expect("a probe");
    assert_eq!(probe.routed_us, 2_000_000);
    assert!(probe.tokens >= SPEED_PROBE_MIN_TOKENS);
    // A second one, routed while the first's prefill is queued, probes nothing: its time to
    // its first chunk counts its wait.
    let e = route(
        &mut r,
        &store,
        &streamed(&body(&png(1002, 1000), "c")),
        2_001,
        0,
    );
    assert!(e.prefill_window.is_some_and(|(start, _)| start > 2_001_000));
    assert_eq!(e.speed_probe, None);
    let want = f64::from(probe.tokens) / 0.1;
    assert_eq!(r.measure_speed(&store, &e, 2_000_000 + 100_000), None);
    let measured = r.measure_speed(&store, &d, 2_000_000 + 100_000);
    assert!(
        measured.is_some_and(|m| (m - want).abs() < 1.0),
        "{measured:?}"
    );
    assert!(r.prefill_done(&store, &d, 2_000_000 + 100_000));
    assert!((f64::from(live().prefill_tps_peak) - want).abs() < 1.0);
    assert_eq!(live().prefill_probes, 1);
    assert_eq!(live().peak_prefill_tps(), None, "one probe is not enough");
    assert!(r.finished(&store, &d, 3_000_000, true));
    assert!(r.finished(&store, &e, 3_000_000, false));
    // More probes, each alone and slower: the peak decays by one step each, and counts from
    // the eighth probe on.
    let min = crate::state::workers::MIN_PROBES;
    for i in 1..u32::from(min) {
        let at = 10_000 + u64::from(i) * 20_000;
        let f = route(
            &mut r,
            &store,
            &streamed(&body(&png(1003 + i, 1000), "d")),
            at,
            0,
        );
        let slow = f.speed_probe.expect("a probe");
        assert!(
            r.measure_speed(&store, &f, slow.routed_us + 10_000_000)
                .is_some()
        );
        assert!(r.finished(&store, &f, slow.routed_us + 10_000_000, true));
    }
    let decayed = want * crate::state::workers::PEAK_DECAY.powi(i32::from(min) - 1);
    let peak = live().peak_prefill_tps().expect("enough probes");
    assert!((peak - decayed).abs() < 1.0, "{peak} {decayed}");
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
