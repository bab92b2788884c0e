//! The proxy-wasm shell: Envoy's callbacks in, [`Router`] and [`Poller`] decisions out.
//!
//! Every host call goes through `proxy_wasm::hostcalls` and its `Result`, never through the
//! SDK's trait helpers, which `unwrap()` host statuses and would abort the VM (and every
//! request on it) on an unexpected one.

mod held;
mod host;
mod lines;

use self::held::{Waiting, complete, on_fetch_reply, poll_waiting};
use self::host::{HostDispatcher, HostStore, log, now_us};
use self::lines::{fetch_line, speed_line};
use super::config::{DecisionLog, FilterConfig};
use super::fetch::Plan;
use super::fetch::guard::Guard;
use super::metrics::Metrics;
use super::poller::{MAX_POLL_BODY, Poller};
use super::router::{Decision, Fallback, Router};
use super::stamp;
use crate::analysis::{Analysis, Analyzer};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};
use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::rc::Rc;
use std::time::Duration;
use xxhash_rust::xxh3::xxh3_64;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(FilterRoot::default()) });
}}

/// Client headers that could steer ORIGINAL_DST: always removed.
const STEERING_HEADERS: [&str; 2] = [
    "x-gateway-destination-endpoint",
    "x-envoy-original-dst-host",
];

/// The most body bytes one `get_buffer` copies into the VM (see `feed_new_bytes`).
const READ_WINDOW: usize = 256 * 1024;

struct Shared {
    router: Router,
    poller: Poller,
    metrics: Metrics,
    store: HostStore,
    /// Whether the `[ROUTING]` line is logged at all (its level is on at the host).
    decision_level: Option<LogLevel>,
    /// The SSRF guard, when fetching is on.
    guard: Option<Guard>,
    /// This VM's random id (claims in the URL cache are made unique with it).
    holder: u64,
    /// Requests whose body is complete, waiting for their images by URL, by context id.
    waiting: HashMap<u32, Waiting>,
    /// Decisions made outside a stream's own callbacks (a fetch answered, a tick), picked up
    /// by the stream's next callback.
    decided: HashMap<u32, Decision>,
}

/// Runs `f` on the VM's shared state: None when it is not configured, or already borrowed
/// (callbacks do not nest, so that would be a bug to survive, not to panic on).
fn with_shared<R>(
    shared: Option<Rc<RefCell<Shared>>>,
    f: impl FnOnce(&mut Shared) -> R,
) -> Option<R> {
    let shared = shared?;
    let mut s = shared.try_borrow_mut().ok()?;
    Some(f(&mut s))
}

#[derive(Default)]
struct FilterRoot {
    shared: Option<Rc<RefCell<Shared>>>,
}

impl Context for FilterRoot {
    /// A call sent from the root context answered (see [`on_call_response`]).
    fn on_http_call_response(
        &mut self,
        token: u32,
        num_headers: usize,
        body_size: usize,
        _: usize,
    ) {
        with_shared(self.shared.clone(), |s| {
            on_call_response(s, token, num_headers, body_size)
        });
    }
}

/// A root context's call answered: a fetch sent from it (a URL claimed again on a tick), or a
/// poll (or its failure: Envoy reports a failure as 0 headers).
fn on_call_response(s: &mut Shared, token: u32, num_headers: usize, body_size: usize) {
    let owner = s
        .waiting
        .iter()
        .find(|(_, w)| w.plan.has_token(token))
        .map(|(ctx, _)| *ctx);
    if let Some(ctx) = owner {
        on_fetch_reply(s, ctx, token, num_headers, body_size, true);
        return;
    }
    let status = if num_headers == 0 {
        None
    } else {
        hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status")
            .ok()
            .flatten()
            .and_then(|v| v.parse::<u16>().ok())
    };
    let body = match status {
        Some(200) => hostcalls::get_buffer(
            BufferType::HttpCallResponseBody,
            0,
            body_size.min(MAX_POLL_BODY),
        )
        .ok()
        .flatten(),
        _ => None,
    };
    let events = s.poller.on_response(
        &s.router,
        &s.store,
        token,
        status,
        body.as_deref(),
        now_us() / 1000,
    );
    s.log_events(&events);
}

impl RootContext for FilterRoot {
    fn on_configure(&mut self, size: usize) -> bool {
        let bytes = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, size)
            .ok()
            .flatten()
            .unwrap_or_default();
        let config = match FilterConfig::from_json(&bytes) {
            Ok(c) => c,
            Err(e) => {
                log(LogLevel::Error, &format!("invalid configuration: {e}"));
                return false;
            }
        };
        let period = Duration::from_millis(Poller::period_ms(&config));
        let holder = RandomState::new().hash_one(now_us());
        let host_level = hostcalls::get_log_level().unwrap_or(LogLevel::Info);
        let decision_level = match config.decision_log {
            DecisionLog::Off => None,
            DecisionLog::Debug => Some(LogLevel::Debug),
            DecisionLog::Info => Some(LogLevel::Info),
        }
        .filter(|l| (*l as u32) >= (host_level as u32));
        log(
            LogLevel::Info,
            &format!(
                "configured {} static workers, sidecar {}, mode {:?}, block size {}",
                config.workers.len(),
                config
                    .sidecar
                    .as_ref()
                    .map_or("none", |s| s.cluster.as_str()),
                config.mode,
                config.router.block_size
            ),
        );
        let router = Router::new(config);
        let store = HostStore::default();
        let guard = if router.config.fetch.enabled {
            router.config.fetch.guard().ok()
        } else {
            None
        };
        let events = Poller::configure(&router, &store, now_us() / 1000);
        let shared = Shared {
            router,
            poller: Poller::new(holder),
            metrics: Metrics::define(holder),
            store,
            decision_level,
            guard,
            holder,
            waiting: HashMap::new(),
            decided: HashMap::new(),
        };
        shared.log_events(&events);
        self.shared = Some(Rc::new(RefCell::new(shared)));
        let _ = hostcalls::set_tick_period(period);
        true
    }

    fn on_tick(&mut self) {
        with_shared(self.shared.clone(), |s| {
            let events = s
                .poller
                .tick(&s.router, &s.store, now_us() / 1000, &mut HostDispatcher);
            s.log_events(&events);
            s.metrics.vm_memory();
            poll_waiting(s);
        });
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(FilterStream {
            context_id,
            shared: self.shared.clone(),
            routing: false,
            content_length: None,
            body_size: 0,
            fed: 0,
            analyzer: None,
            decision: None,
            prefill_seen: false,
            answered: false,
            answered_at: None,
            finished: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct FilterStream {
    context_id: u32,
    shared: Option<Rc<RefCell<Shared>>>,
    /// This stream's body is being buffered for a decision.
    routing: bool,
    /// The request's `content-length`, when it had one (stamping fixes it).
    content_length: Option<usize>,
    /// Bytes of the body buffered so far, and fed to the analysis so far.
    body_size: usize,
    fed: usize,
    /// The incremental analysis of the body while it arrives.
    analyzer: Option<Analyzer>,
    decision: Option<Decision>,
    /// The request's prefill was seen to end (first response chunk of a stream, or an answer
    /// that came before the estimate).
    prefill_seen: bool,
    /// The worker answered 2xx (its blocks are stored and freed when the stream ends).
    answered: bool,
    /// When a complete (non-streamed) answer's headers came, for the load table at the end.
    answered_at: Option<u64>,
    finished: bool,
}

impl Context for FilterStream {
    /// The answer to one of this request's fetches.
    fn on_http_call_response(
        &mut self,
        token: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        with_shared(self.shared.clone(), |s| {
            on_fetch_reply(s, self.context_id, token, num_headers, body_size, false);
            self.pick_up_decision(s);
        });
    }
}

impl FilterStream {
    /// Feeds the body bytes Envoy has buffered since the last call to the analysis (one copy
    /// of each byte into the VM, scanned and hashed as it comes, never kept), at most
    /// [`READ_WINDOW`] bytes per copy: a fast client's whole body, buffered by Envoy before the
    /// first call, would otherwise grow the VM's memory by its size for good.
    fn feed_new_bytes(&mut self) {
        let Some(analyzer) = self.analyzer.as_mut() else {
            return;
        };
        while self.body_size > self.fed {
            let n = (self.body_size - self.fed).min(READ_WINDOW);
            let piece = hostcalls::get_buffer(BufferType::HttpRequestBody, self.fed, n)
                .ok()
                .flatten()
                .unwrap_or_default();
            if piece.is_empty() {
                // Nothing readable where Envoy said there were bytes: the analysis ends with
                // what it has (it reports a truncated body at finish).
                self.fed = self.body_size;
                break;
            }
            self.fed += piece.len();
            // An error is kept by the analyzer and reported at finish.
            let _ = analyzer.feed(&piece);
        }
    }

    /// The body is complete (or already over the limit: a chunked body without
    /// content-length): decide now. An oversize body streams on from here without being read.
    /// True when the request is held for its images by URL.
    fn decide(&mut self, s: &mut Shared) -> bool {
        self.routing = false;
        let now = now_us();
        let random = self.random(now);
        let analyzer = self.analyzer.take();
        let (decision, analysis) = match analyzer {
            Some(_) if self.body_size > s.router.config.router.limits.max_body_bytes => (
                s.router
                    .route_without_body(Fallback::TooLarge, &s.store, now, random),
                None,
            ),
            Some(a) => match a.finish_scan() {
                Err(e) => s.router.route_analyzed(Err(e), &s.store, now, random),
                Ok(scanned) => match self.plan_fetches(s, scanned, now, random) {
                    Some(w) => {
                        self.decision = complete(s, w, None);
                        return false;
                    }
                    None => return true,
                },
            },
            None => (None, None),
        };
        if let Some(a) = &analysis {
            s.metrics.skipped(a.skipped_count);
            if s.router.config.stamp_uuid && decision.is_some() {
                stamp_uuids(a, self.body_size, self.content_length, s);
            }
        }
        self.decision = apply(s, decision, None);
        false
    }

    /// A decision made while this stream was held (see `Shared::decided`).
    fn pick_up_decision(&mut self, s: &mut Shared) {
        if self.decision.is_none() {
            self.decision = s.decided.remove(&self.context_id);
        }
    }

    /// A random number for tie-breaks: this stream's id mixed with the time `now` (the caller
    /// has just read it: one clock call per decision).
    fn random(&self, now: u64) -> u64 {
        let mut buf = [0u8; 12];
        buf[..4].copy_from_slice(&self.context_id.to_le_bytes());
        buf[4..].copy_from_slice(&now.to_le_bytes());
        xxh3_64(&buf)
    }
}

/// Sets the destination header for `decision` (on the current effective context), logs and
/// counts it. `fetch` adds the images by URL to the log line.
fn apply(s: &mut Shared, decision: Option<Decision>, fetch: Option<&Plan>) -> Option<Decision> {
    let Some(decision) = decision else {
        s.metrics.no_worker();
        return None;
    };
    let destination = decision.destination(usize::from(s.router.config.retry_alternates));
    let _ = hostcalls::set_map_value(
        MapType::HttpRequestHeaders,
        &s.router.config.destination_header,
        Some(&destination),
    );
    if let Some(level) = s.decision_level {
        let mut line = decision.log_line();
        if let Some(plan) = fetch {
            line.push_str(&fetch_line(plan));
        }
        log(level, &line);
    }
    s.metrics
        .routed(&decision, s.router.config.sidecar.is_some());
    Some(decision)
}

/// Writes vLLM's `uuid` into the image parts that need one (see [`stamp`]): reads the body up
/// to the last insertion point, replaces that prefix with the stamped one (Envoy replaces a
/// prefix of the buffer, it cannot insert in the middle) and fixes `content-length`.
fn stamp_uuids(
    analysis: &Analysis,
    body_size: usize,
    content_length: Option<usize>,
    s: &mut Shared,
) {
    let insertions = stamp::uuid_insertions(analysis);
    let Some(cut) = stamp::prefix_len(&insertions).filter(|&c| c <= body_size) else {
        return;
    };
    let Some(prefix) = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, cut)
        .ok()
        .flatten()
        .filter(|p| p.len() == cut)
    else {
        return;
    };
    let Some(stamped) = stamp::rewrite_prefix(&prefix, &insertions) else {
        return;
    };
    if hostcalls::set_buffer(BufferType::HttpRequestBody, 0, cut, &stamped).is_err() {
        return;
    }
    if let Some(length) = content_length {
        let new = (length + stamp::added_bytes(&insertions)).to_string();
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, "content-length", Some(&new));
    }
    s.metrics.stamped(insertions.len());
}

impl HttpContext for FilterStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        // One host call for every header this callback needs (instead of one per header).
        let headers = hostcalls::get_map(MapType::HttpRequestHeaders).unwrap_or_default();
        let header = |name: &str| {
            headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        };
        let shared = self.shared.clone();
        let configured = shared
            .as_ref()
            .and_then(|sh| sh.try_borrow().ok())
            .map(|s| s.router.config.destination_header.clone());
        // Client headers that could steer the upstream are removed on every request, routed or
        // not, whatever else happens (only those present: a removal is a host call).
        for h in STEERING_HEADERS
            .iter()
            .copied()
            .chain(configured.as_deref())
        {
            if header(h).is_some() {
                let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, h, None);
            }
        }
        let Some(shared) = shared else {
            return Action::Continue;
        };
        let Ok(mut s) = shared.try_borrow_mut() else {
            return Action::Continue;
        };
        let s = &mut *s;
        let method = header(":method").unwrap_or_default();
        let path = header(":path").unwrap_or_default();
        if !method.eq_ignore_ascii_case("POST") || !s.router.config.routes_path(path) {
            return Action::Continue;
        }
        s.metrics.request();
        // A body announced over the limit is not buffered at all: it streams to the
        // least-loaded worker, and never occupies the VM's memory or Envoy's buffer.
        let limit = s.router.config.router.limits.max_body_bytes;
        let announced = header("content-length").and_then(|v| v.trim().parse::<usize>().ok());
        self.content_length = announced;
        let encoded = header("content-encoding")
            .is_some_and(|v| !v.trim().is_empty() && !v.trim().eq_ignore_ascii_case("identity"));
        let why = if announced.is_some_and(|n| n > limit) {
            Some(Fallback::TooLarge)
        } else if encoded {
            Some(Fallback::Encoded)
        } else if end_of_stream {
            Some(Fallback::NoBody)
        } else {
            None
        };
        if let Some(why) = why {
            let now = now_us();
            let d = s
                .router
                .route_without_body(why, &s.store, now, self.random(now));
            self.decision = apply(s, d, None);
            return Action::Continue;
        }
        self.routing = true;
        self.analyzer = Some(Analyzer::new(&s.router.config.router));
        // Needs `allow_on_headers_stop_iteration: true` in the Wasm filter config, so that Envoy
        // keeps calling on_http_request_body after this pause.
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.routing {
            return Action::Continue;
        }
        self.body_size = body_size;
        let action = with_shared(self.shared.clone(), |s| {
            let over_limit = body_size > s.router.config.router.limits.max_body_bytes;
            if !over_limit {
                self.feed_new_bytes();
            }
            // A request held until its images by URL are fetched is resumed by `complete`.
            if (!end_of_stream && !over_limit) || self.decide(s) {
                Action::Pause
            } else {
                Action::Continue
            }
        });
        action.unwrap_or_else(|| {
            self.routing = false;
            Action::Continue
        })
    }

    /// A body followed by trailers ends here, not with an end-of-stream body call.
    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if !self.routing {
            return Action::Continue;
        }
        match with_shared(self.shared.clone(), |s| self.decide(s)) {
            Some(true) => Action::Pause,
            Some(false) => Action::Continue,
            None => {
                self.routing = false;
                Action::Continue
            }
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        with_shared(self.shared.clone(), |s| self.pick_up_decision(s));
        let Some(shared) = self.shared.clone() else {
            return Action::Continue;
        };
        let Some(decision) = &self.decision else {
            return Action::Continue;
        };
        let Ok(s) = shared.try_borrow() else {
            return Action::Continue;
        };
        self.answered = decision.held.is_some()
            && hostcalls::get_map_value(MapType::HttpResponseHeaders, ":status")
                .ok()
                .flatten()
                .is_some_and(|v| v.starts_with('2'));
        // A complete (non-streamed) answer comes after decoding; if it comes before the
        // estimated end of prefill, prefill was faster than estimated: the load table learns
        // it when the stream ends, in the same write as the release (on_log).
        if !decision.stream && !self.prefill_seen && decision.prefill_window.is_some() {
            self.answered_at = Some(now_us());
            self.prefill_seen = true;
        }
        if s.router.config.response_headers {
            let overlap = format!("{}/{}", decision.matched_blocks, decision.total_blocks);
            let explained = decision.header_value();
            for (name, value) in [
                ("x-mmrouter-worker", decision.target.name.as_str()),
                ("x-mmrouter-overlap", overlap.as_str()),
                ("x-mmrouter-decision", explained.as_str()),
            ] {
                let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(value));
            }
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, _end_of_stream: bool) -> Action {
        // A stream's first chunk comes when prefill is done (vLLM sends the headers first).
        if self.prefill_seen || body_size == 0 {
            return Action::Continue;
        }
        let (Some(decision), Some(shared)) = (&self.decision, self.shared.clone()) else {
            return Action::Continue;
        };
        self.prefill_seen = true;
        if let Ok(s) = shared.try_borrow() {
            let now = now_us();
            if let Some(tps) = s.router.measure_speed(&s.store, decision, now)
                && let Some(level) = s.decision_level
            {
                log(level, &speed_line(decision, tps));
            }
            s.router.prefill_done(&s.store, decision, now);
        }
        Action::Continue
    }

    /// Called when the stream ends, completed or reset: release its load exactly once.
    fn on_log(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        with_shared(self.shared.clone(), |s| {
            self.pick_up_decision(s);
            // Ended while held (a reset): its claims are released, nothing is routed.
            if let Some(mut w) = s.waiting.remove(&self.context_id) {
                w.plan
                    .expire(&s.router.config.fetch, &s.store, s.router.keys());
            }
        });
        let (Some(decision), Some(shared)) = (&self.decision, self.shared.clone()) else {
            return;
        };
        if let Ok(s) = shared.try_borrow() {
            let now = now_us();
            match self.answered_at {
                Some(at) => s.router.finished_answered(&s.store, decision, now, at),
                None => s
                    .router
                    .finished(&s.store, decision, now, self.prefill_seen),
            };
            if self.answered && self.prefill_seen {
                s.router.released(&s.store, decision, now);
            }
        }
    }
}
