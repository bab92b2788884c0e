//! The state writer's tick, on whichever VM holds the lease: keep the membership, drain the
//! decisions into the block buckets, poll the sidecar's feed (precise mode) or the workers'
//! `/metrics` (approximate mode, or while the feed is stale), and apply the answers.
//!
//! Host-independent: HTTP calls go out through [`Dispatcher`] and come back through
//! [`Poller::on_response`], so every path is tested natively; the proxy-wasm shell maps them
//! to `dispatch_http_call` and `on_http_call_response`. What happened is returned as
//! [`Event`]s for the shell to count and log.

use super::config::FilterConfig;
use super::events::{Event, membership_events};
use super::router::Router;
use crate::state::SharedStore;
use crate::state::lease::try_lease;
use crate::state::writer::{
    drain, read_live, read_members, record_poll, sync_members, update_live,
};
use crate::worker_metrics::parse_vllm_scrape;
use std::collections::HashMap;

/// Sends the poller's HTTP GETs.
pub trait Dispatcher {
    /// GET `path` through Envoy cluster `cluster` with `:authority` `authority` and, when
    /// given, one extra header (the destination header that sends a poll to one worker).
    /// Returns the call's token, or None when the host refused to dispatch it.
    fn get(
        &mut self,
        cluster: &str,
        authority: &str,
        path: &str,
        header: Option<(&str, &str)>,
        timeout_ms: u64,
    ) -> Option<u32>;
}

#[derive(Debug, Clone)]
enum Pending {
    Metrics { slot: usize, name: String },
    Feed,
}

/// The writer role of one VM.
#[derive(Debug)]
pub struct Poller {
    holder: u64,
    writer: bool,
    last_tick_ms: u64,
    last_feed_ms: u64,
    last_good_feed_ms: Option<u64>,
    pending: HashMap<u32, Pending>,
    /// When each slot was last polled, and the next slot to consider.
    last_polled: HashMap<usize, u64>,
    poll_cursor: usize,
    /// Consecutive failed polls per slot (for the log lines on health changes).
    failing: HashMap<usize, u32>,
    pub(super) feed: super::feed_apply::FeedState,
}

/// The largest `/metrics` or feed body read (vLLM's metrics are tens of KiB; a feed of 4096
/// workers is about 400 KiB).
pub const MAX_POLL_BODY: usize = 8 << 20;

impl Poller {
    /// `holder` identifies this VM for the lease (random per VM).
    pub fn new(holder: u64) -> Poller {
        Poller {
            holder,
            writer: false,
            last_tick_ms: 0,
            last_feed_ms: 0,
            last_good_feed_ms: None,
            pending: HashMap::new(),
            last_polled: HashMap::new(),
            poll_cursor: 0,
            failing: HashMap::new(),
            feed: super::feed_apply::FeedState::default(),
        }
    }

    /// Whether this VM held the lease at its last tick.
    pub fn is_writer(&self) -> bool {
        self.writer
    }

    /// The tick period this poller wants (the host may tick it more often).
    pub fn period_ms(config: &FilterConfig) -> u64 {
        let mut p = config.state.tick_ms;
        if config.metrics.poll_ms > 0 {
            p = p.min(config.metrics.poll_ms);
        }
        if let Some(sc) = &config.sidecar {
            p = p.min(sc.poll_ms);
        }
        p.max(1)
    }

    /// Sets the static membership (every VM does this at configuration time, before traffic;
    /// identical writes, so concurrent VMs agree). With a sidecar, the static list only seeds
    /// an empty table.
    pub fn configure(router: &Router, store: &dyn SharedStore, now_ms: u64) -> Vec<Event> {
        router.prepare(store);
        let config = &router.config;
        if config.sidecar.is_some()
            && (config.workers.is_empty()
                || read_members(store, router.keys()).active().count() > 0)
        {
            return Vec::new();
        }
        let desired: Vec<(String, String)> = config
            .workers
            .iter()
            .map(|w| (w.name.clone(), w.address.clone()))
            .collect();
        membership_events(
            sync_members(store, router.keys(), &config.state, &desired, now_ms),
            &desired,
        )
    }

    /// The writer's tick: renew (or take) the lease; if held, drain decisions and send polls
    /// that are due.
    pub fn tick(
        &mut self,
        router: &Router,
        store: &dyn SharedStore,
        now_ms: u64,
        out: &mut dyn Dispatcher,
    ) -> Vec<Event> {
        let config = &router.config;
        let mut events = Vec::new();
        if now_ms.saturating_sub(self.last_tick_ms) < Self::period_ms(config) {
            return events;
        }
        self.last_tick_ms = now_ms;
        let holds = try_lease(
            store,
            &router.keys().lease(),
            self.holder,
            now_ms,
            config.state.lease_ms,
        );
        if holds && !self.writer {
            events.push(Event::BecameWriter);
        }
        self.writer = holds;
        if !holds {
            self.pending.clear();
            return events;
        }
        let s = drain(
            store,
            router.keys(),
            &config.state,
            config.router.scoring.footprint_half_life_ms,
            now_ms,
            config.state.drain_max,
        );
        if s.applied > 0 {
            events.push(Event::Drained {
                decisions: s.applied,
                buckets: s.buckets_written,
            });
        }
        let precise_now = self.feed_fresh(config, now_ms);
        events.extend(set_precise(router, store, precise_now, now_ms));
        if let Some(sc) = &config.sidecar
            && now_ms.saturating_sub(self.last_feed_ms) >= sc.poll_ms
            && !self.pending.values().any(|p| matches!(p, Pending::Feed))
        {
            self.last_feed_ms = now_ms;
            let path = format!("{}?since={}", sc.path, self.feed.cursor());
            match out.get(&sc.cluster, &sc.authority, &path, None, sc.timeout_ms) {
                Some(token) => {
                    self.pending.insert(token, Pending::Feed);
                }
                None => events.push(Event::Feed {
                    ok: false,
                    why: Some("dispatch refused (is the sidecar cluster configured?)".into()),
                }),
            }
        }
        let poll = &config.metrics;
        if poll.poll_ms > 0 && !precise_now {
            self.poll_due_workers(router, store, now_ms, out, &mut events);
        }
        events
    }

    /// Polls the workers whose poll is due, round robin from where the last tick stopped, at
    /// most `metrics.max_inflight` at a time: a large fleet's polls spread over the period
    /// instead of bursting on one tick.
    fn poll_due_workers(
        &mut self,
        router: &Router,
        store: &dyn SharedStore,
        now_ms: u64,
        out: &mut dyn Dispatcher,
        events: &mut Vec<Event>,
    ) {
        let config = &router.config;
        let poll = &config.metrics;
        let members = read_members(store, router.keys());
        let n = members.slots.len();
        if n == 0 {
            return;
        }
        let in_flight: Vec<usize> = self
            .pending
            .values()
            .filter_map(|p| match p {
                Pending::Metrics { slot, .. } => Some(*slot),
                Pending::Feed => None,
            })
            .collect();
        let mut budget = poll.max_inflight.saturating_sub(in_flight.len());
        let start = self.poll_cursor;
        for step in 0..n {
            if budget == 0 {
                break;
            }
            let slot = (start + step) % n;
            let Some(m) = members.slots.get(slot).filter(|m| m.active) else {
                continue;
            };
            let last = self.last_polled.get(&slot).copied().unwrap_or(0);
            if now_ms.saturating_sub(last) < poll.poll_ms || in_flight.contains(&slot) {
                continue;
            }
            self.last_polled.insert(slot, now_ms);
            self.poll_cursor = (slot + 1) % n;
            budget -= 1;
            let header = Some((config.destination_header.as_str(), m.address.as_str()));
            match out.get(
                &poll.cluster,
                &m.address,
                &poll.path,
                header,
                poll.timeout_ms,
            ) {
                Some(token) => {
                    self.pending.insert(
                        token,
                        Pending::Metrics {
                            slot,
                            name: m.name.clone(),
                        },
                    );
                }
                None => {
                    let ok = record_poll(
                        store,
                        router.keys(),
                        config.router.block_size,
                        poll.unhealthy_after,
                        slot,
                        None,
                        now_ms,
                    );
                    let transition = self.poll_outcome(slot, ok, poll.unhealthy_after);
                    events.push(Event::Poll {
                        name: m.name.clone(),
                        ok,
                        why: Some("dispatch refused".into()),
                        transition,
                    });
                }
            }
        }
    }

    /// Counts a poll outcome for `slot`; true when it changed the worker's health (it became
    /// unhealthy, or a good poll ended a failing streak), the only polls worth a log line.
    fn poll_outcome(&mut self, slot: usize, ok: bool, unhealthy_after: u32) -> bool {
        let failing = self.failing.entry(slot).or_insert(0);
        let threshold = unhealthy_after.max(1);
        if ok {
            let was = *failing;
            *failing = 0;
            was >= threshold
        } else {
            *failing = failing.saturating_add(1);
            *failing == threshold
        }
    }

    fn feed_fresh(&self, config: &FilterConfig, now_ms: u64) -> bool {
        match (&config.sidecar, self.last_good_feed_ms) {
            (Some(sc), Some(t)) => now_ms.saturating_sub(t) <= sc.stale_ms,
            _ => false,
        }
    }

    /// A poll answered. `status` is the HTTP status (None: no response: connection failure,
    /// timeout, reset); `body` the response body when there was one.
    pub fn on_response(
        &mut self,
        router: &Router,
        store: &dyn SharedStore,
        token: u32,
        status: Option<u16>,
        body: Option<&[u8]>,
        now_ms: u64,
    ) -> Vec<Event> {
        let Some(pending) = self.pending.remove(&token) else {
            return Vec::new();
        };
        let config = &router.config;
        match pending {
            Pending::Metrics { slot, name } => {
                let (stats, why) = match (status, body) {
                    (None, _) => (
                        None,
                        Some("no response (connection failed or timed out)".into()),
                    ),
                    (Some(200), Some(b)) => match parse_vllm_scrape(&String::from_utf8_lossy(b)) {
                        Ok(s) => (Some(s), None),
                        Err(e) => (None, Some(e.to_string())),
                    },
                    (Some(code), _) => (None, Some(format!("status {code}"))),
                };
                let ok = record_poll(
                    store,
                    router.keys(),
                    config.router.block_size,
                    config.metrics.unhealthy_after,
                    slot,
                    stats,
                    now_ms,
                );
                let transition = self.poll_outcome(slot, ok, config.metrics.unhealthy_after);
                vec![Event::Poll {
                    name,
                    ok,
                    why,
                    transition,
                }]
            }
            Pending::Feed => {
                let result = match (status, body) {
                    (None, _) => Err("no response (connection failed or timed out)".to_string()),
                    (Some(200), Some(b)) => self.feed.apply(router, store, b, now_ms),
                    (Some(code), _) => Err(format!("status {code}")),
                };
                match result {
                    Ok(mut events) => {
                        self.last_good_feed_ms = Some(now_ms);
                        events.push(Event::Feed {
                            ok: true,
                            why: None,
                        });
                        events.extend(set_precise(router, store, true, now_ms));
                        events
                    }
                    Err(why) => vec![Event::Feed {
                        ok: false,
                        why: Some(why),
                    }],
                }
            }
        }
    }
}

/// Marks the live table precise (feed fresh) or approximate; an event when it changed.
fn set_precise(
    router: &Router,
    store: &dyn SharedStore,
    precise: bool,
    now_ms: u64,
) -> Option<Event> {
    if read_live(store, router.keys()).precise == precise {
        return None;
    }
    update_live(store, router.keys(), now_ms, |t| {
        let changed = t.precise != precise;
        t.precise = precise;
        changed
    });
    Some(Event::Precise(precise))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::feed::{Feed, FeedWorker, encode};
    use crate::state::MemoryStore;

    #[derive(Default)]
    struct Calls {
        sent: Vec<(u32, String, String)>,
        next: u32,
    }

    impl Dispatcher for Calls {
        fn get(
            &mut self,
            cluster: &str,
            _authority: &str,
            path: &str,
            _header: Option<(&str, &str)>,
            _timeout_ms: u64,
        ) -> Option<u32> {
            self.next += 1;
            self.sent.push((self.next, cluster.into(), path.into()));
            Some(self.next)
        }
    }

    fn feed(cursor: u64, names: &[&str]) -> Vec<u8> {
        encode(&Feed {
            epoch: 1,
            cursor,
            workers: names
                .iter()
                .enumerate()
                .map(|(i, n)| FeedWorker {
                    name: (*n).into(),
                    address: format!("10.0.0.{i}:8000"),
                    healthy: true,
                    ..FeedWorker::default()
                })
                .collect(),
            ..Feed::default()
        })
    }

    #[test]
    fn a_large_fleets_polls_spread_over_the_period_at_most_max_inflight_at_a_time() {
        let store = MemoryStore::default();
        let workers: Vec<String> = (0..200)
            .map(|i| {
                format!(
                    r#"{{"name":"w{i}","address":"10.0.{}.{}:8000"}}"#,
                    i / 200,
                    i % 200
                )
            })
            .collect();
        let config = FilterConfig::from_json(
            format!(
                r#"{{"workers":[{}],"metrics":{{"poll_ms":500,"timeout_ms":400,"max_inflight":64}}}}"#,
                workers.join(",")
            )
            .as_bytes(),
        )
        .expect("config");
        let router = Router::new(config);
        Poller::configure(&router, &store, 0);
        let mut p = Poller::new(1);
        let mut calls = Calls::default();
        let mut polled_at: HashMap<String, Vec<u64>> = HashMap::new();
        let t0 = 1_000_000u64;
        for tick in 0..60u64 {
            let now = t0 + tick * 20;
            let before = calls.sent.len();
            p.tick(&router, &store, now, &mut calls);
            let new: Vec<(u32, String, String)> = calls.sent[before..].to_vec();
            assert!(new.len() <= 64, "tick {tick}: {} polls", new.len());
            for (token, _, _) in new {
                let Some(Pending::Metrics { name, .. }) = p.pending.get(&token).cloned() else {
                    continue;
                };
                polled_at.entry(name).or_default().push(now);
                // Answered at once: the next tick may use the slot.
                p.on_response(
                    &router,
                    &store,
                    token,
                    Some(200),
                    Some(b"vllm:num_requests_running 0\n"),
                    now,
                );
            }
        }
        assert_eq!(polled_at.len(), 200, "every worker polled");
        for (name, times) in &polled_at {
            for pair in times.windows(2) {
                assert!(
                    pair[1] - pair[0] >= 500,
                    "{name} polled twice within poll_ms: {times:?}"
                );
            }
        }
    }

    #[test]
    fn a_good_feed_makes_routing_precise_at_once_and_a_stale_one_approximate() {
        let store = MemoryStore::default();
        let config = FilterConfig::from_json(
            br#"{"sidecar":{"poll_ms":100,"timeout_ms":90,"stale_ms":300}}"#,
        )
        .expect("config");
        let router = Router::new(config);
        Poller::configure(&router, &store, 0);
        let mut p = Poller::new(1);
        let mut calls = Calls::default();
        let t0 = 1_000_000;
        let events = p.tick(&router, &store, t0, &mut calls);
        assert!(events.contains(&Event::BecameWriter));
        let (token, cluster, path) = calls.sent.last().cloned().expect("a feed poll");
        assert_eq!(
            (cluster.as_str(), path.as_str()),
            ("mmrouter_sidecar", "/v1/feed?since=0")
        );
        let events = p.on_response(
            &router,
            &store,
            token,
            Some(200),
            Some(&feed(5, &["a"])),
            t0 + 10,
        );
        assert!(events.contains(&Event::Precise(true)), "{events:?}");
        assert!(read_live(&store, router.keys()).precise);
        assert_eq!(p.feed.cursor(), 5);
        // No good feed for longer than stale_ms: approximate, and the workers are polled.
        let mut t = t0 + 10;
        let mut went_stale = false;
        while t < t0 + 500 {
            t += 20;
            let events = p.tick(&router, &store, t, &mut calls);
            went_stale |= events.contains(&Event::Precise(false));
        }
        assert!(went_stale);
        assert!(!read_live(&store, router.keys()).precise);
        assert!(calls.sent.iter().any(|(_, c, _)| c == "mmrouter_endpoint"));
    }
}
