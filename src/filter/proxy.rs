//! The proxy-wasm shell: Envoy's callbacks in, [`Router`] decisions out.
//!
//! Every host call goes through `proxy_wasm::hostcalls` and its `Result`, never through the
//! SDK's trait helpers, which `unwrap()` host statuses and would abort the VM (and every
//! request on it) on an unexpected one.

use super::config::FilterConfig;
use super::metrics::Metrics;
use super::router::{Decision, Fallback, Router};
use super::shared_state::{SharedStore, StoreError};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, Status};
use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};
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

/// proxy-wasm shared data through the host calls.
struct HostStore;

impl SharedStore for HostStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(bytes), Some(cas))) => Ok(Some((bytes, cas))),
            Ok((Some(bytes), None)) => Ok(Some((bytes, 0))),
            Ok((None, _)) => Ok(None),
            Err(status) => Err(StoreError::Host(status as u32)),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(StoreError::CasMismatch),
            Err(status) => Err(StoreError::Host(status as u32)),
        }
    }
}

fn log(level: LogLevel, message: &str) {
    let _ = hostcalls::log(level, message);
}

fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

struct Shared {
    router: Router,
    metrics: Metrics,
}

#[derive(Default)]
struct FilterRoot {
    shared: Option<Rc<RefCell<Shared>>>,
    /// This VM's identity for the poller lease (random per VM).
    holder: u64,
    last_poll_ms: u64,
    /// Outstanding `/metrics` polls: call token → worker.
    polls: HashMap<u32, usize>,
}

/// The largest `/metrics` body read (vLLM's is a few tens of KiB).
const MAX_METRICS_BODY: usize = 4 << 20;

impl FilterRoot {
    /// If this VM holds the poller lease and a period has passed, polls every worker.
    fn poll_workers(&mut self, now: u64) {
        let Some(shared) = self.shared.clone() else {
            return;
        };
        let Ok(s) = shared.try_borrow() else {
            return;
        };
        let poll = &s.router.config.metrics;
        if poll.poll_ms == 0 || now.saturating_sub(self.last_poll_ms) < poll.poll_ms {
            return;
        }
        if !s.router.poller_lease(&HostStore, self.holder, now) {
            return;
        }
        self.last_poll_ms = now;
        let timeout = Duration::from_millis(poll.timeout_ms);
        let header = s.router.config.destination_header.as_str();
        for (i, w) in s.router.config.workers.iter().enumerate() {
            let headers = vec![
                (":method", "GET"),
                (":path", poll.path.as_str()),
                (":authority", w.address.as_str()),
                (header, w.address.as_str()),
            ];
            match hostcalls::dispatch_http_call(&poll.cluster, headers, None, vec![], timeout) {
                Ok(token) => {
                    self.polls.insert(token, i);
                }
                Err(status) => {
                    s.router.record_poll(&HostStore, i, None, now);
                    s.metrics.poll(false);
                    log(
                        LogLevel::Warn,
                        &format!("cannot poll {}: dispatch failed: {status:?}", w.name),
                    );
                }
            }
        }
    }
}

impl Context for FilterRoot {
    /// A `/metrics` poll answered (or failed: Envoy reports a failure as 0 headers).
    fn on_http_call_response(
        &mut self,
        token: u32,
        num_headers: usize,
        body_size: usize,
        _: usize,
    ) {
        let Some(worker) = self.polls.remove(&token) else {
            return;
        };
        let Some(shared) = self.shared.clone() else {
            return;
        };
        let Ok(s) = shared.try_borrow() else {
            return;
        };
        let status = if num_headers == 0 {
            None
        } else {
            hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status")
                .ok()
                .flatten()
        };
        let body = match status.as_deref() {
            Some("200") => hostcalls::get_buffer(
                BufferType::HttpCallResponseBody,
                0,
                body_size.min(MAX_METRICS_BODY),
            )
            .ok()
            .flatten(),
            _ => None,
        };
        let text = body.as_deref().map(String::from_utf8_lossy);
        let ok = s
            .router
            .record_poll(&HostStore, worker, text.as_deref(), now_ms());
        s.metrics.poll(ok);
        if !ok && let Some(w) = s.router.config.workers.get(worker) {
            log(
                LogLevel::Warn,
                &format!(
                    "poll of {} failed: {}",
                    w.name,
                    match (num_headers, status.as_deref()) {
                        (0, _) => "no response (connection failed or timed out)".to_string(),
                        (_, Some("200")) => "no vLLM metrics in the body".to_string(),
                        (_, other) => format!("status {}", other.unwrap_or("none")),
                    }
                ),
            );
        }
    }
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
        let mut period_ms = config.state.sync_period_ms;
        if config.metrics.poll_ms > 0 {
            period_ms = period_ms.min(config.metrics.poll_ms);
        }
        let period = Duration::from_millis(period_ms);
        self.holder = RandomState::new().hash_one(now_ms());
        let names: Vec<&str> = config.workers.iter().map(|w| w.name.as_str()).collect();
        let metrics = Metrics::define(&names);
        log(
            LogLevel::Info,
            &format!(
                "configured {} workers, block size {}, mode approximate",
                config.workers.len(),
                config.router.block_size
            ),
        );
        let mut router = Router::new(config);
        router.sync(&HostStore);
        self.shared = Some(Rc::new(RefCell::new(Shared { router, metrics })));
        let _ = hostcalls::set_tick_period(period);
        true
    }

    fn on_tick(&mut self) {
        if let Some(shared) = &self.shared
            && let Ok(mut s) = shared.try_borrow_mut()
        {
            let stats = s.router.sync(&HostStore);
            s.metrics.log_skipped(stats.skipped);
        }
        self.poll_workers(now_ms());
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(FilterStream {
            context_id,
            shared: self.shared.clone(),
            routing: false,
            decision: None,
            prefill_outstanding: 0,
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
    decision: Option<Decision>,
    prefill_outstanding: u64,
    finished: bool,
}

impl Context for FilterStream {}

impl FilterStream {
    fn random(&self) -> u64 {
        let nanos = hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let mut buf = [0u8; 12];
        buf[..4].copy_from_slice(&self.context_id.to_le_bytes());
        buf[4..].copy_from_slice(&nanos.to_le_bytes());
        xxh3_64(&buf)
    }

    fn apply(&mut self, shared: &mut Shared, decision: Decision) {
        let Some(worker) = shared.router.config.workers.get(decision.worker) else {
            return;
        };
        let _ = hostcalls::set_map_value(
            MapType::HttpRequestHeaders,
            &shared.router.config.destination_header,
            Some(&worker.address),
        );
        match decision.fallback {
            None => log(
                LogLevel::Info,
                &format!(
                    "[ROUTING] Best: {} with {}/{} blocks overlap",
                    worker.name, decision.matched_blocks, decision.total_blocks
                ),
            ),
            Some(why) => log(
                LogLevel::Info,
                &format!(
                    "[ROUTING] Fallback: {} (least loaded), reason {}",
                    worker.name,
                    why.reason()
                ),
            ),
        }
        shared.metrics.routed(&decision);
        self.prefill_outstanding = decision.prefill_blocks;
        self.decision = Some(decision);
    }
}

impl HttpContext for FilterStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        for h in STEERING_HEADERS {
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, h, None);
        }
        let Some(shared) = self.shared.clone() else {
            return Action::Continue;
        };
        let Ok(mut s) = shared.try_borrow_mut() else {
            return Action::Continue;
        };
        let configured = s.router.config.destination_header.as_str();
        if !STEERING_HEADERS.contains(&configured) {
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, configured, None);
        }
        let header = |name: &str| {
            hostcalls::get_map_value(MapType::HttpRequestHeaders, name)
                .ok()
                .flatten()
        };
        let method = header(":method").unwrap_or_default();
        let path = header(":path").unwrap_or_default();
        if !method.eq_ignore_ascii_case("POST") || !s.router.config.routes_path(&path) {
            return Action::Continue;
        }
        s.metrics.request();
        // A body announced over the limit is not buffered at all: it streams to the
        // least-loaded worker, and never occupies the VM's memory or Envoy's buffer.
        let limit = s.router.config.router.limits.max_body_bytes;
        let announced = header("content-length").and_then(|v| v.trim().parse::<usize>().ok());
        if announced.is_some_and(|n| n > limit) {
            let d = s.router.route_without_body(
                Fallback::TooLarge,
                &HostStore,
                now_ms(),
                self.random(),
            );
            self.apply(&mut s, d);
            return Action::Continue;
        }
        if end_of_stream {
            let d =
                s.router
                    .route_without_body(Fallback::NoBody, &HostStore, now_ms(), self.random());
            self.apply(&mut s, d);
            return Action::Continue;
        }
        self.routing = true;
        // Needs `allow_on_headers_stop_iteration: true` in the Wasm filter config, so that Envoy
        // keeps calling on_http_request_body after this pause.
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.routing {
            return Action::Continue;
        }
        let Some(shared) = self.shared.clone() else {
            self.routing = false;
            return Action::Continue;
        };
        let Ok(mut s) = shared.try_borrow_mut() else {
            self.routing = false;
            return Action::Continue;
        };
        let over_limit = body_size > s.router.config.router.limits.max_body_bytes;
        if !end_of_stream && !over_limit {
            return Action::Pause;
        }
        // Complete, or already over the limit (a chunked body without content-length): decide
        // now; an oversize body streams on from here without being read.
        self.routing = false;
        let random = self.random();
        let decision = if over_limit {
            s.router
                .route_without_body(Fallback::TooLarge, &HostStore, now_ms(), random)
        } else {
            let body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size)
                .ok()
                .flatten()
                .unwrap_or_default();
            let (decision, _analysis) = s.router.route(&body, &HostStore, now_ms(), random);
            decision
        };
        self.apply(&mut s, decision);
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Some(decision) = &self.decision else {
            return Action::Continue;
        };
        let Some(shared) = self.shared.clone() else {
            return Action::Continue;
        };
        let Ok(s) = shared.try_borrow() else {
            return Action::Continue;
        };
        if self.prefill_outstanding > 0 {
            s.router
                .prefill_done(&HostStore, decision.worker, self.prefill_outstanding);
            self.prefill_outstanding = 0;
        }
        if s.router.config.response_headers
            && let Some(worker) = s.router.config.workers.get(decision.worker)
        {
            let overlap = format!("{}/{}", decision.matched_blocks, decision.total_blocks);
            let _ = hostcalls::set_map_value(
                MapType::HttpResponseHeaders,
                "x-mmrouter-worker",
                Some(&worker.name),
            );
            let _ = hostcalls::set_map_value(
                MapType::HttpResponseHeaders,
                "x-mmrouter-overlap",
                Some(&overlap),
            );
        }
        Action::Continue
    }

    /// Called when the stream ends, completed or reset: release its load exactly once.
    fn on_log(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        let (Some(decision), Some(shared)) = (&self.decision, self.shared.clone()) else {
            return;
        };
        if let Ok(s) = shared.try_borrow() {
            s.router
                .finished(&HostStore, decision.worker, self.prefill_outstanding);
        }
        self.prefill_outstanding = 0;
    }
}
