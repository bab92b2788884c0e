//! The proxy-wasm shell: Envoy's callbacks in, [`Router`] and [`Poller`] decisions out.
//!
//! Every host call goes through `proxy_wasm::hostcalls` and its `Result`, never through the
//! SDK's trait helpers, which `unwrap()` host statuses and would abort the VM (and every
//! request on it) on an unexpected one.

use super::config::{DecisionLog, FilterConfig};
use super::events::Event;
use super::fetch::guard::{Guard, Target};
use super::fetch::{Plan, Reply};
use super::metrics::Metrics;
use super::poller::{Dispatcher, MAX_POLL_BODY, Poller};
use super::router::{Decision, Fallback, Router};
use super::stamp;
use crate::analysis::{Analysis, AnalyzeError, Analyzer, ImageDigest, Overrides, Scanned};
use crate::state::{SharedStore, StoreError};
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

/// proxy-wasm shared data and queues through the host calls.
#[derive(Default)]
struct HostStore {
    /// Queue name → token (registered once per VM).
    queues: RefCell<HashMap<String, u32>>,
}

impl HostStore {
    fn queue(&self, name: &str) -> Result<u32, StoreError> {
        if let Some(t) = self.queues.borrow().get(name) {
            return Ok(*t);
        }
        let token =
            hostcalls::register_shared_queue(name).map_err(|s| StoreError::Host(s as u32))?;
        self.queues.borrow_mut().insert(name.to_string(), token);
        Ok(token)
    }
}

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

    fn enqueue(&self, queue: &str, value: &[u8]) -> Result<(), StoreError> {
        let token = self.queue(queue)?;
        hostcalls::enqueue_shared_queue(token, Some(value)).map_err(|s| StoreError::Host(s as u32))
    }

    fn dequeue(&self, queue: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let token = self.queue(queue)?;
        hostcalls::dequeue_shared_queue(token).map_err(|s| StoreError::Host(s as u32))
    }
}

/// HTTP calls through `dispatch_http_call`.
struct HostDispatcher;

impl Dispatcher for HostDispatcher {
    fn get(
        &mut self,
        cluster: &str,
        authority: &str,
        path: &str,
        header: Option<(&str, &str)>,
        timeout_ms: u64,
    ) -> Option<u32> {
        let mut headers = vec![
            (":method", "GET"),
            (":path", path),
            (":authority", authority),
        ];
        if let Some(h) = header {
            headers.push(h);
        }
        hostcalls::dispatch_http_call(
            cluster,
            headers,
            None,
            vec![],
            Duration::from_millis(timeout_ms),
        )
        .ok()
    }
}

/// The most body bytes one `get_buffer` copies into the VM (see `feed_new_bytes`).
const READ_WINDOW: usize = 256 * 1024;

fn log(level: LogLevel, message: &str) {
    let _ = hostcalls::log(level, message);
}

fn now_us() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

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

/// A request held until its images by URL are fetched (or its deadline).
struct Waiting {
    scanned: Scanned,
    plan: Plan,
    /// Media index → URL, for a URL waited for that must be claimed again.
    urls: Vec<(usize, String)>,
    body_size: usize,
    content_length: Option<usize>,
    random: u64,
    /// Some image waited for another request's fetch.
    waited: bool,
}

/// Bytes of a fetched image copied into the VM at a time.
const FETCH_PIECE: usize = 64 << 10;

/// Sends the GETs `plan` asks for, from the current context.
fn dispatch_fetches(plan: &mut Plan, s: &Shared, now_ms: u64) {
    let config = &s.router.config.fetch;
    for (pos, target) in plan.to_send() {
        let left = plan.deadline_ms.saturating_sub(now_ms).max(1);
        let timeout = config.timeout_ms.min(left);
        let token = fetch_get(config, &target, timeout);
        plan.sent(pos, token, config, &s.store, s.router.keys(), now_ms);
    }
}

fn fetch_get(config: &super::fetch::FetchConfig, target: &Target, timeout_ms: u64) -> Option<u32> {
    let cluster = config.cluster_for(target);
    let address = match target.host.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V6(_)) => format!("[{}]:{}", target.host, target.port),
        _ => format!("{}:{}", target.host, target.port),
    };
    let mut headers = vec![
        (":method", "GET"),
        (":path", target.path.as_str()),
        (":authority", target.authority.as_str()),
        (":scheme", target.scheme.name()),
        ("accept", "image/*"),
        // Names the fetcher to image servers (and lets tests tell it from the workers' GETs).
        ("user-agent", "mmrouter-fetch"),
    ];
    if super::fetch::FetchConfig::by_address(target) {
        headers.push((config.address_header.as_str(), address.as_str()));
    }
    hostcalls::dispatch_http_call(
        &cluster,
        headers,
        None,
        vec![],
        Duration::from_millis(timeout_ms),
    )
    .ok()
}

/// Reads the answer to a fetch now being delivered: status, and the image read in pieces
/// (hashed and its header read as they come, nothing kept).
fn read_fetch_reply(num_headers: usize, body_size: usize, max_bytes: u32) -> Reply {
    if num_headers == 0 {
        return Reply::None;
    }
    let header = |name: &str| {
        hostcalls::get_map_value(MapType::HttpCallResponseHeaders, name)
            .ok()
            .flatten()
    };
    let status = header(":status").and_then(|v| v.parse::<u16>().ok());
    if let Some(refusal) = Reply::refusal(
        status,
        header(super::fetch::guard::REFUSED_HEADER).as_deref(),
    ) {
        return Reply::Refused(refusal);
    }
    match status {
        Some(200) => {}
        Some(301 | 302 | 303 | 307 | 308) => {
            return match header("location") {
                Some(l) => Reply::Redirect(l),
                None => Reply::Status,
            };
        }
        _ => return Reply::Status,
    }
    if body_size > max_bytes as usize {
        return Reply::TooLarge;
    }
    let mut digest = ImageDigest::new();
    let mut at = 0;
    while at < body_size {
        let n = FETCH_PIECE.min(body_size - at);
        match hostcalls::get_buffer(BufferType::HttpCallResponseBody, at, n) {
            Ok(Some(piece)) if !piece.is_empty() => {
                at += piece.len();
                digest.feed(&piece);
            }
            _ => return Reply::None,
        }
    }
    Reply::Image(digest.finish())
}

impl Shared {
    fn log_events(&self, events: &[Event]) {
        for e in events {
            self.metrics.event(e);
            let line = match e {
                Event::BecameWriter => Some((
                    LogLevel::Info,
                    "this VM now writes the shared state".to_string(),
                )),
                Event::Joined { name, address } => {
                    Some((LogLevel::Info, format!("worker {name} joined at {address}")))
                }
                Event::Left { name } => Some((LogLevel::Info, format!("worker {name} left"))),
                Event::Poll {
                    name,
                    ok: false,
                    why,
                    transition: true,
                } => Some((
                    LogLevel::Warn,
                    format!(
                        "worker {name} is unhealthy: its polls fail: {}",
                        why.as_deref().unwrap_or("?")
                    ),
                )),
                Event::Poll {
                    name,
                    ok: true,
                    transition: true,
                    ..
                } => Some((LogLevel::Info, format!("worker {name} is healthy again"))),
                Event::Feed { ok: false, why } => Some((
                    LogLevel::Warn,
                    format!(
                        "sidecar feed poll failed: {}",
                        why.as_deref().unwrap_or("?")
                    ),
                )),
                Event::Precise(true) => Some((
                    LogLevel::Info,
                    "sidecar feed fresh: routing in precise mode".to_string(),
                )),
                Event::Precise(false) => Some((
                    LogLevel::Warn,
                    "sidecar feed stale or gone: routing in approximate mode".to_string(),
                )),
                _ => None,
            };
            if let Some((level, line)) = line {
                log(level, &line);
            }
        }
    }
}

#[derive(Default)]
struct FilterRoot {
    shared: Option<Rc<RefCell<Shared>>>,
}

impl Context for FilterRoot {
    /// A poll answered (or failed: Envoy reports a failure as 0 headers).
    fn on_http_call_response(
        &mut self,
        token: u32,
        num_headers: usize,
        body_size: usize,
        _: usize,
    ) {
        let Some(shared) = self.shared.clone() else {
            return;
        };
        let Ok(mut s) = shared.try_borrow_mut() else {
            return;
        };
        // A fetch sent from this root context (a URL claimed again on a tick).
        let owner = s
            .waiting
            .iter()
            .find(|(_, w)| w.plan.has_token(token))
            .map(|(ctx, _)| *ctx);
        if let Some(ctx) = owner {
            on_fetch_reply(&mut s, ctx, token, num_headers, body_size, true);
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
        let s = &mut *s;
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
        let Some(shared) = self.shared.clone() else {
            return;
        };
        let Ok(mut s) = shared.try_borrow_mut() else {
            return;
        };
        let s = &mut *s;
        let events = s
            .poller
            .tick(&s.router, &s.store, now_us() / 1000, &mut HostDispatcher);
        s.log_events(&events);
        s.metrics.vm_memory();
        poll_waiting(s);
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
        let Some(shared) = self.shared.clone() else {
            return;
        };
        let Ok(mut s) = shared.try_borrow_mut() else {
            return;
        };
        on_fetch_reply(
            &mut s,
            self.context_id,
            token,
            num_headers,
            body_size,
            false,
        );
        self.pick_up_decision(&mut s);
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

    /// The request's images by URL (fetching on): fetched in parallel, or found in the shared
    /// cache. None when the request waits (held in `s.waiting` until settled or its deadline),
    /// else the settled request to route now.
    fn plan_fetches(
        &mut self,
        s: &mut Shared,
        scanned: Scanned,
        now_us: u64,
        random: u64,
    ) -> Option<Waiting> {
        let urls: Vec<(usize, String)> = match &s.guard {
            Some(_) => scanned
                .url_images()
                .into_iter()
                .map(|(i, u)| (i, u.to_string()))
                .collect(),
            None => Vec::new(),
        };
        let now_ms = now_us / 1000;
        let mut plan = match &s.guard {
            Some(guard) if !urls.is_empty() => {
                let refs: Vec<(usize, &str)> = urls.iter().map(|(i, u)| (*i, u.as_str())).collect();
                let claim = xxh3_64(
                    &[
                        s.holder.to_le_bytes(),
                        u64::from(self.context_id).to_le_bytes(),
                        now_us.to_le_bytes(),
                    ]
                    .concat(),
                );
                Plan::new(
                    &refs,
                    &s.router.config.fetch,
                    guard,
                    &s.store,
                    s.router.keys(),
                    claim,
                    now_ms,
                )
            }
            _ => Plan::empty(),
        };
        dispatch_fetches(&mut plan, s, now_ms);
        let waited = plan
            .items
            .iter()
            .any(|i| i.step == super::fetch::Step::Waiting);
        let w = Waiting {
            scanned,
            plan,
            urls,
            body_size: self.body_size,
            content_length: self.content_length,
            random,
            waited,
        };
        if w.plan.settled() {
            return Some(w);
        }
        s.waiting.insert(self.context_id, w);
        None
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
        let mut line = decision_line(&decision);
        if let Some(plan) = fetch {
            line.push_str(&fetch_line(plan));
        }
        log(level, &line);
    }
    s.metrics
        .routed(&decision, s.router.config.sidecar.is_some());
    Some(decision)
}

/// `; images by URL: 1 fetched, 1 cached, 1 failed (no_response)`.
fn fetch_line(plan: &Plan) -> String {
    let (fetched, cached, failed) = plan.counts();
    if fetched + cached + failed == 0 {
        return String::new();
    }
    let mut line = format!("; images by URL: {fetched} fetched, {cached} cached, {failed} failed");
    let reasons: Vec<&str> = plan.failures().iter().map(|f| f.reason()).collect();
    if !reasons.is_empty() {
        line.push_str(&format!(" ({})", reasons.join(", ")));
    }
    line
}

/// Routes a request whose images by URL are settled: analysis with the fetched identities,
/// decision, stamping, destination header. `ctx`: the held stream's id when this runs outside
/// its own callbacks (the decision is then kept in `s.decided` and the request resumed).
/// Returns the decision when `ctx` is None.
fn complete(s: &mut Shared, w: Waiting, ctx: Option<u32>) -> Option<Decision> {
    if let Some(ctx) = ctx {
        let _ = hostcalls::set_effective_context(ctx);
    }
    let Waiting {
        scanned,
        plan,
        body_size,
        content_length,
        random,
        waited,
        ..
    } = w;
    let result: Result<Analysis, AnalyzeError> = scanned.finish(
        &s.router.config.router,
        Overrides::default(),
        &plan.fetched(),
    );
    let (decision, analysis) = s.router.route_analyzed(result, &s.store, now_us(), random);
    if let Some(a) = &analysis {
        s.metrics.skipped(a.skipped_count);
        if s.router.config.stamp_uuid && decision.is_some() {
            stamp_uuids(a, body_size, content_length, s);
        }
    }
    if !plan.items.is_empty() {
        s.metrics.fetch(&plan, waited);
    }
    let decision = apply(s, decision, Some(&plan));
    match ctx {
        None => decision,
        Some(ctx) => {
            if let Some(d) = decision {
                s.decided.insert(ctx, d);
            }
            let _ = hostcalls::resume_http_request();
            None
        }
    }
}

/// The answer to a fetch of held stream `ctx`.
fn on_fetch_reply(
    s: &mut Shared,
    ctx: u32,
    token: u32,
    num_headers: usize,
    body_size: usize,
    from_root: bool,
) {
    let Some(mut w) = s.waiting.remove(&ctx) else {
        return;
    };
    let reply = read_fetch_reply(num_headers, body_size, s.router.config.fetch.max_bytes);
    let now_ms = now_us() / 1000;
    if let Some(guard) = &s.guard {
        w.plan.on_reply(
            token,
            reply,
            &s.router.config.fetch,
            guard,
            &s.store,
            s.router.keys(),
            now_ms,
        );
    }
    if from_root {
        // Sent from the root context, their answers come back to it.
        dispatch_fetches(&mut w.plan, s, now_ms);
    } else {
        let _ = hostcalls::set_effective_context(ctx);
        dispatch_fetches(&mut w.plan, s, now_ms);
    }
    settle_or_hold(s, ctx, w);
}

fn settle_or_hold(s: &mut Shared, ctx: u32, w: Waiting) {
    if w.plan.settled() {
        complete(s, w, Some(ctx));
    } else {
        s.waiting.insert(ctx, w);
    }
}

/// On the root's tick: the held requests look again at the URLs they wait for (another
/// request's fetch), take over claims that expired, and give up at their deadline.
fn poll_waiting(s: &mut Shared) {
    if s.waiting.is_empty() {
        return;
    }
    let Some(guard) = s.guard.clone() else {
        return;
    };
    let now_ms = now_us() / 1000;
    let ids: Vec<u32> = s.waiting.keys().copied().collect();
    for ctx in ids {
        let Some(mut w) = s.waiting.remove(&ctx) else {
            continue;
        };
        let urls = w.urls.clone();
        let url_of = move |i: usize| urls.iter().find(|(j, _)| *j == i).map(|(_, u)| u.clone());
        w.plan.poll(
            &s.router.config.fetch,
            &guard,
            &s.store,
            s.router.keys(),
            now_ms,
            &url_of,
        );
        // Sent from the root context: their answers come to the root, which hands them on.
        dispatch_fetches(&mut w.plan, s, now_ms);
        settle_or_hold(s, ctx, w);
    }
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

/// The `[ROUTING]` log line: what was chosen and what it was weighed against. Only numbers,
/// validated worker names and fixed words: nothing from the request reaches the log.
fn decision_line(d: &Decision) -> String {
    match d.fallback {
        Some(why) => format!(
            "[ROUTING] Fallback: {} (least loaded), reason {}",
            d.target.name,
            why.reason()
        ),
        None => {
            let e = d.estimate;
            let mut line = format!(
                "[ROUTING] Best: {} with {}/{} blocks overlap; wait {:.1} ms, prefill {:.1} ms, recompute {:.1} ms ({})",
                d.target.name,
                d.matched_blocks,
                d.total_blocks,
                e.wait_s * 1e3,
                e.prefill_s * 1e3,
                e.recompute_s * 1e3,
                if d.precise { "precise" } else { "approximate" },
            );
            if d.home {
                line.push_str("; its group's home");
            }
            if let Some((name, matched, alt)) = &d.passed_over {
                line.push_str(&format!(
                    "; passed over {name} with {matched}/{} blocks: wait {:.1} ms, cost {:.1} ms > {:.1} ms",
                    d.total_blocks,
                    alt.wait_s * 1e3,
                    alt.cost_s * 1e3,
                    e.cost_s * 1e3,
                ));
            }
            line
        }
    }
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
        let Some(shared) = self.shared.clone() else {
            self.routing = false;
            return Action::Continue;
        };
        let Ok(mut s) = shared.try_borrow_mut() else {
            self.routing = false;
            return Action::Continue;
        };
        let over_limit = body_size > s.router.config.router.limits.max_body_bytes;
        if !over_limit {
            self.feed_new_bytes();
        }
        if !end_of_stream && !over_limit {
            return Action::Pause;
        }
        if self.decide(&mut s) {
            // Held until its images by URL are fetched: resumed by `complete`.
            return Action::Pause;
        }
        Action::Continue
    }

    /// A body followed by trailers ends here, not with an end-of-stream body call.
    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if !self.routing {
            return Action::Continue;
        }
        let Some(shared) = self.shared.clone() else {
            self.routing = false;
            return Action::Continue;
        };
        if let Ok(mut s) = shared.try_borrow_mut()
            && self.decide(&mut s)
        {
            return Action::Pause;
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Some(shared) = self.shared.clone() else {
            return Action::Continue;
        };
        if let Ok(mut s) = shared.try_borrow_mut() {
            self.pick_up_decision(&mut s);
        }
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
            let e = decision.estimate;
            let explained = format!(
                "wait_ms={:.1}; prefill_ms={:.1}; recompute_ms={:.1}; mode={}",
                e.wait_s * 1e3,
                e.prefill_s * 1e3,
                e.recompute_s * 1e3,
                if decision.precise {
                    "precise"
                } else {
                    "approximate"
                }
            );
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
            s.router.prefill_done(&s.store, decision, now_us());
        }
        Action::Continue
    }

    /// Called when the stream ends, completed or reset: release its load exactly once.
    fn on_log(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        let Some(shared) = self.shared.clone() else {
            return;
        };
        if let Ok(mut s) = shared.try_borrow_mut() {
            self.pick_up_decision(&mut s);
            // Ended while held (a reset): its claims are released, nothing is routed.
            if let Some(mut w) = s.waiting.remove(&self.context_id) {
                let s = &mut *s;
                w.plan
                    .expire(&s.router.config.fetch, &s.store, s.router.keys());
            }
        }
        let Some(decision) = &self.decision else {
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
