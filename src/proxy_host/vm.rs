//! One VM (an Envoy worker thread's Wasm instance): its store, its contexts and streams, and
//! the test-facing API to drive requests through it.

use super::abi::{Action, HeaderMap, LogLevel, StreamType};
use super::{Host, HostError, HostShared, MAX_PENDING_EVENTS, lock};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use wasmtime::{Instance, Store, Val};

/// How a VM is configured; everything but the plugin configuration has a default.
#[derive(Clone, Debug)]
pub struct VmConfig {
    /// Bytes returned for `PLUGIN_CONFIGURATION` (Envoy: `plugin_config.configuration`).
    /// Default: empty.
    pub plugin_config: Vec<u8>,
    /// Bytes returned for `VM_CONFIGURATION` (Envoy: `vm_config.configuration`). Default: empty.
    pub vm_config: Vec<u8>,
    /// Namespace of shared data and queues (Envoy: `vm_config.vm_id`). Default: "" (Envoy's).
    pub vm_id: String,
    /// `plugin_name` property. Default: "proxy-host".
    pub plugin_name: String,
    /// `plugin_root_id` property. Default: "".
    pub root_id: String,
    /// Lowest level recorded and returned by `proxy_get_log_level`. Default: Trace (record
    /// everything; Envoy's default is Info).
    pub log_level: LogLevel,
    /// Envoy's `allow_on_headers_stop_iteration` (Envoy >= 1.35). Default: false, as in Envoy:
    /// then a Pause from `proxy_on_request_headers` withholds the body callbacks until the
    /// filter calls `proxy_continue_stream`.
    pub allow_on_headers_stop_iteration: bool,
    /// WASI environment (Envoy: `vm_config.environment_variables`). Default: none.
    pub env: Vec<(String, String)>,
    /// Extra properties (path parts → value) for `proxy_get_property`. Default: none.
    pub properties: Vec<(Vec<String>, Vec<u8>)>,
    /// Seed of the deterministic `random_get`. Default: 0 = derived from the VM's number.
    pub random_seed: u64,
}

impl Default for VmConfig {
    fn default() -> Self {
        VmConfig {
            plugin_config: Vec::new(),
            vm_config: Vec::new(),
            vm_id: String::new(),
            plugin_name: "proxy-host".to_string(),
            root_id: String::new(),
            log_level: LogLevel::Trace,
            allow_on_headers_stop_iteration: false,
            env: Vec::new(),
            properties: Vec::new(),
            random_seed: 0,
        }
    }
}

impl VmConfig {
    pub fn new(plugin_config: impl Into<Vec<u8>>) -> VmConfig {
        VmConfig {
            plugin_config: plugin_config.into(),
            ..VmConfig::default()
        }
    }
    pub fn vm_config(mut self, bytes: impl Into<Vec<u8>>) -> Self {
        self.vm_config = bytes.into();
        self
    }
    pub fn vm_id(mut self, id: &str) -> Self {
        self.vm_id = id.to_string();
        self
    }
    pub fn log_level(mut self, level: LogLevel) -> Self {
        self.log_level = level;
        self
    }
    pub fn allow_on_headers_stop_iteration(mut self, allow: bool) -> Self {
        self.allow_on_headers_stop_iteration = allow;
        self
    }
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_string(), value.to_string()));
        self
    }
    pub fn property(mut self, path: &[&str], value: impl Into<Vec<u8>>) -> Self {
        self.properties
            .push((path.iter().map(|s| s.to_string()).collect(), value.into()));
        self
    }
}

impl From<&str> for VmConfig {
    fn from(s: &str) -> Self {
        VmConfig::new(s)
    }
}
impl From<String> for VmConfig {
    fn from(s: String) -> Self {
        VmConfig::new(s)
    }
}
impl From<Vec<u8>> for VmConfig {
    fn from(s: Vec<u8>) -> Self {
        VmConfig::new(s)
    }
}
impl From<&[u8]> for VmConfig {
    fn from(s: &[u8]) -> Self {
        VmConfig::new(s)
    }
}

/// Where a log line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogSource {
    /// `proxy_log`.
    ProxyLog,
    /// WASI `fd_write` to stdout (level Info) or stderr (level Error), one entry per line.
    Stdout,
    Stderr,
}

/// One log line of the module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogEntry {
    pub level: LogLevel,
    pub message: String,
    /// The effective context when it was logged.
    pub context_id: u32,
    pub source: LogSource,
}

/// A stream callback whose action is recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Callback {
    RequestHeaders,
    RequestBody,
    ResponseHeaders,
    ResponseBody,
}

/// A reply the filter sent with `proxy_send_local_response`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalResponse {
    pub status: u32,
    pub details: String,
    pub body: Vec<u8>,
    pub headers: HeaderMap,
    pub grpc_status: i32,
}

/// An outbound call the module made with `proxy_http_call`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpCall {
    pub token: u32,
    /// The context that made the call (the root context or a stream).
    pub context_id: u32,
    /// The cluster name (Envoy: an upstream cluster).
    pub upstream: String,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
    pub trailers: HeaderMap,
    pub timeout: Duration,
    /// Virtual time at which the call times out.
    pub deadline: Duration,
}

/// The answer to an [`HttpCall`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpResponse {
    pub headers: HeaderMap,
    pub body: Vec<u8>,
    pub trailers: HeaderMap,
}

impl HttpResponse {
    /// A response with `:status` set.
    pub fn new(status: u16) -> HttpResponse {
        let mut headers = HeaderMap::new();
        headers.add(":status", status.to_string().as_bytes());
        HttpResponse {
            headers,
            body: Vec::new(),
            trailers: HeaderMap::new(),
        }
    }
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.add(name, value.as_bytes());
        self
    }
    pub fn body(mut self, body: impl Into<Vec<u8>>) -> Self {
        self.body = body.into();
        self
    }
    pub fn trailer(mut self, name: &str, value: &str) -> Self {
        self.trailers.add(name, value.as_bytes());
        self
    }
}

/// How a scripted responder settles a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HttpCallOutcome {
    /// Deliver this response.
    Respond(HttpResponse),
    /// Deliver a failure now (Envoy: connection failure/reset → 0 headers, 0 body).
    Fail,
    /// Leave it pending (it times out when the clock passes its deadline, or the test answers
    /// it with [`Vm::answer_http_call`]).
    Pending,
}

/// Properties: path parts → value.
type Properties = Vec<(Vec<String>, Vec<u8>)>;

type Responder = Box<dyn FnMut(&HttpCall) -> HttpCallOutcome + Send>;

/// The upstream response a stream receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub headers: HeaderMap,
    pub chunks: Vec<Vec<u8>>,
}

impl Response {
    pub fn new(status: u16) -> Response {
        let mut headers = HeaderMap::new();
        headers.add(":status", status.to_string().as_bytes());
        Response {
            headers,
            chunks: Vec::new(),
        }
    }
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.add(name, value.as_bytes());
        self
    }
    /// Appends a body chunk (each chunk is one `proxy_on_response_body`).
    pub fn body(mut self, chunk: impl Into<Vec<u8>>) -> Self {
        self.chunks.push(chunk.into());
        self
    }
}

/// Everything the host knows about one HTTP stream (one request/response).
#[derive(Debug, Clone, Default)]
pub(crate) struct StreamRecord {
    pub(crate) id: u32,
    pub(crate) request_headers: HeaderMap,
    pub(crate) request_trailers: HeaderMap,
    /// `HTTP_REQUEST_BODY` as the filter sees it (accumulates while the filter pauses).
    pub(crate) request_body: Vec<u8>,
    pending_request_chunks: VecDeque<Vec<u8>>,
    request_headers_delivered: bool,
    request_paused: bool,
    stop_all: bool,
    pub(crate) resume_request: bool,
    upstream_headers: Option<HeaderMap>,
    upstream_body: Vec<u8>,
    response: Option<Response>,
    pub(crate) response_headers: HeaderMap,
    pub(crate) response_trailers: HeaderMap,
    pub(crate) response_body: Vec<u8>,
    pending_response_chunks: VecDeque<Vec<u8>>,
    response_headers_delivered: bool,
    response_paused: bool,
    pub(crate) resume_response: bool,
    downstream_headers: Option<HeaderMap>,
    downstream_body: Vec<u8>,
    pub(crate) local_response: Option<LocalResponse>,
    pub(crate) closed: Option<StreamType>,
    reset: bool,
    actions: Vec<(Callback, Action)>,
    pub(crate) properties: HashMap<Vec<String>, Vec<u8>>,
    log_called: bool,
    done_called: bool,
    pub(crate) done_pending: bool,
    complete: bool,
    cancelled_calls: Vec<u32>,
}

/// The state a VM's host functions work on (the wasmtime store data).
pub(crate) struct VmState {
    pub(crate) host: Arc<HostShared>,
    pub(crate) index: u64,
    pub(crate) config: VmConfig,
    pub(crate) root_context: u32,
    pub(crate) effective: u32,
    pub(crate) streams: BTreeMap<u32, StreamRecord>,
    pub(crate) properties: HashMap<Vec<String>, Vec<u8>>,
    pub(crate) logs: Vec<LogEntry>,
    pub(crate) stdout_partial: Vec<u8>,
    pub(crate) stderr_partial: Vec<u8>,
    pub(crate) tick_period: Option<Duration>,
    pub(crate) next_tick: Option<Duration>,
    pub(crate) http_calls: BTreeMap<u32, HttpCall>,
    /// Calls the responder has not seen yet.
    pub(crate) unoffered_calls: Vec<u32>,
    /// The response being delivered by `proxy_on_http_call_response`.
    pub(crate) call_response: Option<HttpResponse>,
    pub(crate) rng: u64,
    /// Contexts for which the module called `proxy_done`.
    pub(crate) done_requests: Vec<u32>,
}

impl VmState {
    pub(crate) fn now(&self) -> Duration {
        lock(&self.host.state).now
    }

    pub(crate) fn log(&mut self, level: LogLevel, message: String, source: LogSource) {
        if level >= self.config.log_level {
            self.logs.push(LogEntry {
                level,
                message,
                context_id: self.effective,
                source,
            });
        }
    }

    pub(crate) fn next_random(&mut self) -> u64 {
        // xorshift64*: deterministic per VM.
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub(crate) fn stream_mut(&mut self) -> Option<&mut StreamRecord> {
        let id = self.effective;
        self.streams.get_mut(&id)
    }
}

/// The VM behind the lock.
pub(crate) struct VmInner {
    pub(crate) store: Store<VmState>,
    instance: Instance,
    failed: Option<String>,
    next_context: u32,
    completed: HashMap<u32, StreamRecord>,
    responder: Option<Responder>,
}

fn last_error_logs(state: &VmState) -> Vec<String> {
    let mut v: Vec<String> = state
        .logs
        .iter()
        .rev()
        .filter(|l| l.level >= LogLevel::Error)
        .take(4)
        .map(|l| l.message.clone())
        .collect();
    v.reverse();
    v
}

impl VmInner {
    fn check_alive(&self) -> Result<(), HostError> {
        match &self.failed {
            Some(m) => Err(HostError::VmFailed(m.clone())),
            None => Ok(()),
        }
    }

    /// Calls an export with i32 arguments; `Ok(None)` when the module does not export it
    /// (every callback is optional), `Ok(Some(ret))` with its i32 result (0 when it has none).
    fn call(&mut self, name: &str, context: u32, args: &[i32]) -> Result<Option<i32>, HostError> {
        self.check_alive()?;
        let Some(func) = self.instance.get_func(&mut self.store, name) else {
            return Ok(None);
        };
        self.store.data_mut().effective = context;
        let params: Vec<Val> = args.iter().map(|a| Val::I32(*a)).collect();
        let n_results = func.ty(&self.store).results().len();
        let mut results = vec![Val::I32(0); n_results];
        match func.call(&mut self.store, &params, &mut results) {
            Ok(()) => {
                let ret = match results.first() {
                    Some(Val::I32(v)) => *v,
                    _ => 0,
                };
                Ok(Some(ret))
            }
            Err(e) => {
                let message = format!("{e:#}");
                let err = HostError::Trap {
                    callback: name.to_string(),
                    context_id: context,
                    message,
                    logs: last_error_logs(self.store.data()),
                };
                self.failed = Some(err.to_string());
                Err(err)
            }
        }
    }

    fn call_action(&mut self, name: &str, context: u32, args: &[i32]) -> Result<Action, HostError> {
        match self.call(name, context, args)? {
            None => Ok(Action::Continue),
            Some(v) => Action::from_i32(v)
                .ok_or_else(|| HostError::Abi(format!("{name} returned action {v}"))),
        }
    }

    fn start(&mut self) -> Result<(), HostError> {
        let exports: Vec<String> = self
            .instance
            .exports(&mut self.store)
            .map(|e| e.name().to_string())
            .collect();
        let has = |n: &str| exports.iter().any(|e| e == n);
        if !has("proxy_abi_version_0_2_1") && !has("proxy_abi_version_0_2_0") {
            return Err(HostError::UnsupportedAbi);
        }
        if has("_initialize") {
            self.call("_initialize", 0, &[])?;
            if has("main") {
                self.call("main", 0, &[0, 0])?;
            }
        } else if has("_start") {
            self.call("_start", 0, &[])?;
        }
        let root = self.store.data().root_context;
        self.call("proxy_on_context_create", root, &[root as i32, 0])?;
        let vm_len = len_i32(self.store.data().config.vm_config.len());
        if self.call("proxy_on_vm_start", root, &[root as i32, vm_len])? == Some(0) {
            return Err(HostError::VmStartRejected {
                logs: last_error_logs(self.store.data()),
            });
        }
        let cfg_len = len_i32(self.store.data().config.plugin_config.len());
        if self.call("proxy_on_configure", root, &[root as i32, cfg_len])? == Some(0) {
            return Err(HostError::ConfigureRejected {
                logs: last_error_logs(self.store.data()),
            });
        }
        self.settle()
    }

    /// Runs what a callback left to do: streams it resumed or closed, `proxy_done`s, HTTP
    /// calls a scripted responder answers.
    fn settle(&mut self) -> Result<(), HostError> {
        for _ in 0..MAX_PENDING_EVENTS {
            let flagged: Vec<u32> = self
                .store
                .data()
                .streams
                .values()
                .filter(|s| {
                    s.resume_request
                        || s.resume_response
                        || s.closed.is_some()
                        || s.local_response.is_some()
                })
                .map(|s| s.id)
                .collect();
            let done: Vec<u32> = std::mem::take(&mut self.store.data_mut().done_requests);
            let mut progressed = !flagged.is_empty() || !done.is_empty();
            for id in flagged {
                self.drive(id)?;
            }
            for id in done {
                self.proxy_done_for(id)?;
            }
            let unoffered = std::mem::take(&mut self.store.data_mut().unoffered_calls);
            for token in unoffered {
                let Some(call) = self.store.data().http_calls.get(&token).cloned() else {
                    continue;
                };
                let outcome = match self.responder.as_mut() {
                    Some(r) => r(&call),
                    None => HttpCallOutcome::Pending,
                };
                match outcome {
                    HttpCallOutcome::Pending => {}
                    HttpCallOutcome::Respond(r) => {
                        progressed = true;
                        self.deliver_call(token, Some(r))?;
                    }
                    HttpCallOutcome::Fail => {
                        progressed = true;
                        self.deliver_call(token, None)?;
                    }
                }
            }
            if !progressed {
                return Ok(());
            }
        }
        Err(HostError::Runaway(
            "streams/calls kept producing work".to_string(),
        ))
    }

    fn proxy_done_for(&mut self, id: u32) -> Result<(), HostError> {
        let pending = self
            .store
            .data()
            .streams
            .get(&id)
            .is_some_and(|s| s.done_pending);
        if pending {
            self.call("proxy_on_delete", id, &[id as i32])?;
            self.complete_stream(id);
        }
        Ok(())
    }

    fn complete_stream(&mut self, id: u32) {
        let state = self.store.data_mut();
        if let Some(mut rec) = state.streams.remove(&id) {
            rec.complete = true;
            rec.done_pending = false;
            // Envoy cancels a context's in-flight calls when it is destroyed.
            let cancelled: Vec<u32> = state
                .http_calls
                .iter()
                .filter(|(_, c)| c.context_id == id)
                .map(|(t, _)| *t)
                .collect();
            for t in &cancelled {
                state.http_calls.remove(t);
            }
            rec.cancelled_calls = cancelled;
            self.completed.insert(id, rec);
        }
    }

    fn rec(&mut self, id: u32) -> Option<&mut StreamRecord> {
        self.store.data_mut().streams.get_mut(&id)
    }

    /// Moves a stream forward as far as Envoy would without outside events.
    fn drive(&mut self, id: u32) -> Result<(), HostError> {
        let allow = self.store.data().config.allow_on_headers_stop_iteration;
        for _ in 0..MAX_PENDING_EVENTS {
            let Some(rec) = self.rec(id) else {
                return Ok(());
            };
            if rec.done_pending {
                return Ok(());
            }
            if rec.local_response.is_some() || rec.closed.is_some() || rec.reset {
                return self.finish(id);
            }
            // Request path.
            if !rec.request_headers_delivered {
                rec.request_headers_delivered = true;
                let eos = rec.pending_request_chunks.is_empty();
                let n = len_i32(rec.request_headers.len());
                let action =
                    self.call_action("proxy_on_request_headers", id, &[id as i32, n, eos as i32])?;
                let Some(rec) = self.rec(id) else {
                    return Ok(());
                };
                rec.actions.push((Callback::RequestHeaders, action));
                match action {
                    Action::Continue => rec.upstream_headers = Some(rec.request_headers.clone()),
                    Action::Pause => {
                        rec.request_paused = true;
                        rec.stop_all = !allow;
                    }
                }
                continue;
            }
            if rec.resume_request {
                rec.resume_request = false;
                if rec.request_paused {
                    rec.request_paused = false;
                    rec.stop_all = false;
                    release_request(rec);
                }
                continue;
            }
            if !rec.stop_all
                && let Some(chunk) = rec.pending_request_chunks.pop_front()
            {
                rec.request_body.extend_from_slice(&chunk);
                let eos = rec.pending_request_chunks.is_empty();
                let size = len_i32(rec.request_body.len());
                let action =
                    self.call_action("proxy_on_request_body", id, &[id as i32, size, eos as i32])?;
                let Some(rec) = self.rec(id) else {
                    return Ok(());
                };
                rec.actions.push((Callback::RequestBody, action));
                match action {
                    Action::Continue => {
                        rec.request_paused = false;
                        release_request(rec);
                    }
                    Action::Pause => rec.request_paused = true,
                }
                continue;
            }
            let request_done = rec.upstream_headers.is_some()
                && rec.pending_request_chunks.is_empty()
                && !rec.request_paused;
            if !request_done {
                return Ok(()); // the filter holds the request
            }
            // Response path.
            if !rec.response_headers_delivered {
                let Some(resp) = rec.response.take() else {
                    return Ok(()); // waiting for the test to respond
                };
                rec.response_headers = resp.headers;
                rec.pending_response_chunks = resp.chunks.into_iter().collect();
                rec.response_headers_delivered = true;
                let eos = rec.pending_response_chunks.is_empty();
                let n = len_i32(rec.response_headers.len());
                let action =
                    self.call_action("proxy_on_response_headers", id, &[id as i32, n, eos as i32])?;
                let Some(rec) = self.rec(id) else {
                    return Ok(());
                };
                rec.actions.push((Callback::ResponseHeaders, action));
                match action {
                    Action::Continue => rec.downstream_headers = Some(rec.response_headers.clone()),
                    Action::Pause => rec.response_paused = true,
                }
                continue;
            }
            if rec.resume_response {
                rec.resume_response = false;
                if rec.response_paused {
                    rec.response_paused = false;
                    release_response(rec);
                }
                continue;
            }
            if let Some(chunk) = rec.pending_response_chunks.pop_front() {
                rec.response_body.extend_from_slice(&chunk);
                let eos = rec.pending_response_chunks.is_empty();
                let size = len_i32(rec.response_body.len());
                let action =
                    self.call_action("proxy_on_response_body", id, &[id as i32, size, eos as i32])?;
                let Some(rec) = self.rec(id) else {
                    return Ok(());
                };
                rec.actions.push((Callback::ResponseBody, action));
                match action {
                    Action::Continue => {
                        rec.response_paused = false;
                        release_response(rec);
                    }
                    Action::Pause => rec.response_paused = true,
                }
                continue;
            }
            if rec.downstream_headers.is_some() && !rec.response_paused {
                return self.finish(id);
            }
            return Ok(()); // the filter holds the response
        }
        Err(HostError::Runaway(format!("stream {id} never settles")))
    }

    /// The end of a stream: `proxy_on_log`, `proxy_on_done`, then `proxy_on_delete` (or, when
    /// `proxy_on_done` returned false, when the module calls `proxy_done`).
    fn finish(&mut self, id: u32) -> Result<(), HostError> {
        let Some(rec) = self.rec(id) else {
            return Ok(());
        };
        if !rec.log_called {
            rec.log_called = true;
            self.call("proxy_on_log", id, &[id as i32])?;
        }
        let Some(rec) = self.rec(id) else {
            return Ok(());
        };
        if !rec.done_called {
            rec.done_called = true;
            let done = self.call("proxy_on_done", id, &[id as i32])?;
            if done == Some(0) {
                if let Some(rec) = self.rec(id) {
                    rec.done_pending = true;
                }
                return Ok(());
            }
        }
        self.call("proxy_on_delete", id, &[id as i32])?;
        self.complete_stream(id);
        Ok(())
    }

    fn deliver_call(
        &mut self,
        token: u32,
        response: Option<HttpResponse>,
    ) -> Result<(), HostError> {
        let Some(call) = self.store.data_mut().http_calls.remove(&token) else {
            return Err(HostError::UnknownHttpCall(token));
        };
        let (nh, nb, nt) = match &response {
            Some(r) => (
                len_i32(r.headers.len()),
                len_i32(r.body.len()),
                len_i32(r.trailers.len()),
            ),
            None => (0, 0, 0),
        };
        self.store.data_mut().call_response = response;
        let r = self.call(
            "proxy_on_http_call_response",
            call.context_id,
            &[call.context_id as i32, token as i32, nh, nb, nt],
        );
        self.store.data_mut().call_response = None;
        r?;
        Ok(())
    }

    pub(crate) fn deliver_queue_ready(
        &mut self,
        context: u32,
        token: u32,
    ) -> Result<(), HostError> {
        if self.failed.is_some() {
            return Ok(());
        }
        self.call(
            "proxy_on_queue_ready",
            context,
            &[context as i32, token as i32],
        )?;
        self.settle()
    }

    /// The earliest tick or call deadline of this VM.
    pub(crate) fn next_event(&self) -> Option<Duration> {
        if self.failed.is_some() {
            return None;
        }
        let st = self.store.data();
        let call = st.http_calls.values().map(|c| c.deadline).min();
        match (st.next_tick, call) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Fires what is due at `t`: timed-out calls first, then the tick.
    pub(crate) fn fire_due(&mut self, t: Duration) -> Result<(), HostError> {
        let due: Vec<u32> = self
            .store
            .data()
            .http_calls
            .values()
            .filter(|c| c.deadline <= t)
            .map(|c| c.token)
            .collect();
        for token in due {
            self.deliver_call(token, None)?;
        }
        let st = self.store.data_mut();
        if let (Some(next), Some(period)) = (st.next_tick, st.tick_period)
            && next <= t
        {
            st.next_tick = Some(t + period);
            let root = st.root_context;
            self.call("proxy_on_tick", root, &[root as i32])?;
        }
        self.settle()
    }
}

fn release_request(rec: &mut StreamRecord) {
    if rec.upstream_headers.is_none() {
        rec.upstream_headers = Some(rec.request_headers.clone());
    }
    let body = std::mem::take(&mut rec.request_body);
    rec.upstream_body.extend_from_slice(&body);
}

fn release_response(rec: &mut StreamRecord) {
    if rec.downstream_headers.is_none() {
        rec.downstream_headers = Some(rec.response_headers.clone());
    }
    let body = std::mem::take(&mut rec.response_body);
    rec.downstream_body.extend_from_slice(&body);
}

pub(crate) fn len_i32(n: usize) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// One VM: an Envoy worker's instance of the module, with its root context (id 1) and tick.
/// Streams get context ids 2, 3, ...
pub struct Vm {
    inner: Arc<Mutex<VmInner>>,
    host: Host,
    index: u64,
}

impl fmt::Debug for Vm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Vm").field("index", &self.index).finish()
    }
}

/// The root context id of every VM.
pub const ROOT_CONTEXT_ID: u32 = 1;

impl Vm {
    pub(crate) fn start(host: Host, config: VmConfig) -> Result<Vm, HostError> {
        let index = host
            .shared
            .next_vm
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let seed = if config.random_seed == 0 {
            0x9E37_79B9_7F4A_7C15u64.wrapping_mul(index) | 1
        } else {
            config.random_seed
        };
        let mut properties = HashMap::new();
        properties.insert(
            vec!["plugin_name".to_string()],
            config.plugin_name.clone().into_bytes(),
        );
        properties.insert(
            vec!["plugin_root_id".to_string()],
            config.root_id.clone().into_bytes(),
        );
        properties.insert(
            vec!["plugin_vm_id".to_string()],
            config.vm_id.clone().into_bytes(),
        );
        for (k, v) in &config.properties {
            properties.insert(k.clone(), v.clone());
        }
        let state = VmState {
            host: host.shared.clone(),
            index,
            config,
            root_context: ROOT_CONTEXT_ID,
            effective: ROOT_CONTEXT_ID,
            streams: BTreeMap::new(),
            properties,
            logs: Vec::new(),
            stdout_partial: Vec::new(),
            stderr_partial: Vec::new(),
            tick_period: None,
            next_tick: None,
            http_calls: BTreeMap::new(),
            unoffered_calls: Vec::new(),
            call_response: None,
            rng: seed,
            done_requests: Vec::new(),
        };
        let mut store = Store::new(super::engine(), state);
        let instance = host
            .pre
            .instantiate(&mut store)
            .map_err(|e| HostError::Instantiate(format!("{e:#}")))?;
        let mut inner = VmInner {
            store,
            instance,
            failed: None,
            next_context: ROOT_CONTEXT_ID + 1,
            completed: HashMap::new(),
            responder: None,
        };
        inner.start()?;
        let inner = Arc::new(Mutex::new(inner));
        lock(&host.shared.vms).push((index, Arc::downgrade(&inner)));
        Ok(Vm { inner, host, index })
    }

    /// Runs `f` on the locked VM, then delivers host-wide pending events.
    fn with<R>(
        &self,
        f: impl FnOnce(&mut VmInner) -> Result<R, HostError>,
    ) -> Result<R, HostError> {
        let r = {
            let mut g = lock(&self.inner);
            f(&mut g)
        }?;
        self.host.run_pending()?;
        Ok(r)
    }

    fn read<R>(&self, f: impl FnOnce(&VmInner) -> R) -> R {
        let g = lock(&self.inner);
        f(&g)
    }

    /// The host this VM belongs to.
    pub fn host(&self) -> &Host {
        &self.host
    }

    /// Starts building a request on a new stream.
    pub fn request(&self) -> RequestBuilder<'_> {
        RequestBuilder {
            vm: self,
            headers: Vec::new(),
            chunks: Vec::new(),
            chunk_size: None,
            properties: Vec::new(),
            response: None,
        }
    }

    fn open_stream(
        &self,
        headers: HeaderMap,
        chunks: Vec<Vec<u8>>,
        properties: Vec<(Vec<String>, Vec<u8>)>,
        response: Option<Response>,
    ) -> Result<Exchange, HostError> {
        self.with(|vm| {
            vm.check_alive()?;
            let id = vm.next_context;
            vm.next_context = vm.next_context.wrapping_add(1).max(ROOT_CONTEXT_ID + 1);
            let rec = StreamRecord {
                id,
                request_headers: headers,
                pending_request_chunks: chunks.into_iter().collect(),
                properties: properties.into_iter().collect(),
                response,
                ..StreamRecord::default()
            };
            vm.store.data_mut().streams.insert(id, rec);
            let root = vm.store.data().root_context;
            vm.call("proxy_on_context_create", id, &[id as i32, root as i32])?;
            vm.drive(id)?;
            vm.settle()?;
            Ok(id)
        })
        .and_then(|id| self.snapshot(id))
    }

    fn snapshot(&self, id: u32) -> Result<Exchange, HostError> {
        let mut g = lock(&self.inner);
        if let Some(rec) = g.completed.remove(&id) {
            return Ok(Exchange { record: rec });
        }
        match g.store.data().streams.get(&id) {
            Some(rec) => Ok(Exchange {
                record: rec.clone(),
            }),
            None => Err(HostError::UnknownStream(id)),
        }
    }

    /// The current state of a stream: a copy while it is open; once complete, the record is
    /// handed over (and forgotten by the VM).
    pub fn stream(&self, id: u32) -> Result<Exchange, HostError> {
        self.snapshot(id)
    }

    /// Context ids of the streams still open (waiting for the filter or for a response).
    pub fn open_streams(&self) -> Vec<u32> {
        self.read(|vm| vm.store.data().streams.keys().copied().collect())
    }

    /// Gives an open stream its upstream response and runs it to completion (as far as the
    /// filter lets it).
    pub fn respond(&self, id: u32, response: Response) -> Result<Exchange, HostError> {
        self.with(|vm| {
            let rec = vm.rec(id).ok_or(HostError::UnknownStream(id))?;
            rec.response = Some(response);
            vm.drive(id)?;
            vm.settle()
        })?;
        self.snapshot(id)
    }

    /// Resets an open stream (client went away, upstream reset): `proxy_on_log`,
    /// `proxy_on_done`, `proxy_on_delete`, with no (further) response.
    pub fn reset(&self, id: u32) -> Result<Exchange, HostError> {
        self.with(|vm| {
            let rec = vm.rec(id).ok_or(HostError::UnknownStream(id))?;
            rec.reset = true;
            vm.drive(id)?;
            vm.settle()
        })?;
        self.snapshot(id)
    }

    /// Outbound calls not yet answered, oldest first.
    pub fn http_calls(&self) -> Vec<HttpCall> {
        self.read(|vm| vm.store.data().http_calls.values().cloned().collect())
    }

    /// Answers a pending call (`proxy_on_http_call_response` with the response's sizes).
    pub fn answer_http_call(&self, token: u32, response: HttpResponse) -> Result<(), HostError> {
        self.with(|vm| {
            vm.deliver_call(token, Some(response))?;
            vm.settle()
        })
    }

    /// Fails a pending call (as Envoy reports a reset or connection failure: 0 headers).
    pub fn fail_http_call(&self, token: u32) -> Result<(), HostError> {
        self.with(|vm| {
            vm.deliver_call(token, None)?;
            vm.settle()
        })
    }

    /// Answers every future call (and every call still unoffered) with `f`, asynchronously:
    /// after the callback that made the call returns, as Envoy's event loop would.
    pub fn set_http_responder(
        &self,
        f: impl FnMut(&HttpCall) -> HttpCallOutcome + Send + 'static,
    ) -> Result<(), HostError> {
        self.with(|vm| {
            vm.responder = Some(Box::new(f));
            let pending: Vec<u32> = vm.store.data().http_calls.keys().copied().collect();
            vm.store.data_mut().unoffered_calls = pending;
            vm.settle()
        })
    }

    /// Fires `proxy_on_tick` now, whatever the period (the clock does not move).
    pub fn tick(&self) -> Result<(), HostError> {
        self.with(|vm| {
            let root = vm.store.data().root_context;
            vm.call("proxy_on_tick", root, &[root as i32])?;
            vm.settle()
        })
    }

    /// The tick period the module set (None when it set none or 0).
    pub fn tick_period(&self) -> Option<Duration> {
        self.read(|vm| vm.store.data().tick_period)
    }

    /// Every log line recorded so far.
    pub fn logs(&self) -> Vec<LogEntry> {
        self.read(|vm| vm.store.data().logs.clone())
    }

    /// Log lines containing `needle`.
    pub fn logs_containing(&self, needle: &str) -> Vec<LogEntry> {
        self.read(|vm| {
            vm.store
                .data()
                .logs
                .iter()
                .filter(|l| l.message.contains(needle))
                .cloned()
                .collect()
        })
    }

    pub fn clear_logs(&self) {
        lock(&self.inner).store.data_mut().logs.clear();
    }

    /// Size of the VM's linear memory `memory` in bytes (it never shrinks: this is the
    /// high-water mark).
    pub fn memory_bytes(&self) -> usize {
        let mut g = lock(&self.inner);
        let VmInner {
            store, instance, ..
        } = &mut *g;
        instance
            .get_memory(&mut *store, "memory")
            .map(|m| m.data_size(&*store))
            .unwrap_or(0)
    }

    /// The trap that broke this VM, if any.
    pub fn failure(&self) -> Option<String> {
        self.read(|vm| vm.failed.clone())
    }

    /// This VM's number within its host (1, 2, ...).
    pub fn index(&self) -> u64 {
        self.index
    }
}

/// Builds one request. Pseudo-headers `:method` (POST), `:scheme` (http), `:authority`
/// (localhost) and `:path` (/) are added first when not given.
pub struct RequestBuilder<'a> {
    vm: &'a Vm,
    headers: Vec<(String, String)>,
    chunks: Vec<Vec<u8>>,
    chunk_size: Option<usize>,
    properties: Vec<(Vec<String>, Vec<u8>)>,
    response: Option<Response>,
}

impl RequestBuilder<'_> {
    /// Adds a request header (duplicates kept, name lower-cased).
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }
    /// Appends a body chunk: each chunk is one `proxy_on_request_body` call.
    pub fn body(mut self, chunk: impl AsRef<[u8]>) -> Self {
        self.chunks.push(chunk.as_ref().to_vec());
        self
    }
    /// Re-splits the whole body into chunks of `size` bytes (the last may be shorter).
    pub fn chunk_size(mut self, size: usize) -> Self {
        self.chunk_size = Some(size.max(1));
        self
    }
    /// A property visible to `proxy_get_property` from this stream.
    pub fn property(mut self, path: &[&str], value: impl Into<Vec<u8>>) -> Self {
        self.properties
            .push((path.iter().map(|s| s.to_string()).collect(), value.into()));
        self
    }
    /// The upstream response [`send`](Self::send) delivers (default: 200, no body).
    pub fn response(mut self, response: Response) -> Self {
        self.response = Some(response);
        self
    }

    fn parts(self) -> (HeaderMap, Vec<Vec<u8>>, Properties) {
        let mut map = HeaderMap::new();
        let given = |n: &str| self.headers.iter().any(|(k, _)| k.eq_ignore_ascii_case(n));
        for (name, default) in [
            (":method", "POST"),
            (":scheme", "http"),
            (":authority", "localhost"),
            (":path", "/"),
        ] {
            if !given(name) {
                map.add(name, default.as_bytes());
            }
        }
        for (k, v) in &self.headers {
            map.add(k, v.as_bytes());
        }
        let chunks = match self.chunk_size {
            Some(size) => {
                let all: Vec<u8> = self.chunks.concat();
                all.chunks(size).map(|c| c.to_vec()).collect()
            }
            None => self.chunks.into_iter().filter(|c| !c.is_empty()).collect(),
        };
        (map, chunks, self.properties)
    }

    /// Runs the whole stream: request headers and body, then (once the filter has let the
    /// request go upstream) the response, then `proxy_on_log`/`on_done`/`on_delete`. If the
    /// filter holds the request (waiting for an HTTP call, say) the stream stays open and the
    /// returned [`Exchange`] says so; it completes when the filter resumes it.
    pub fn send(mut self) -> Result<Exchange, HostError> {
        let vm = self.vm;
        let response = self.response.take().unwrap_or_else(|| Response::new(200));
        let (headers, chunks, props) = self.parts();
        vm.open_stream(headers, chunks, props, Some(response))
    }

    /// Sends only the request; the stream stays open until [`Vm::respond`] or [`Vm::reset`].
    pub fn send_request(self) -> Result<Exchange, HostError> {
        let vm = self.vm;
        let (headers, chunks, props) = self.parts();
        vm.open_stream(headers, chunks, props, None)
    }
}

/// What happened to one stream (a snapshot).
#[derive(Debug, Clone)]
pub struct Exchange {
    record: StreamRecord,
}

impl Exchange {
    /// The stream's context id.
    pub fn id(&self) -> u32 {
        self.record.id
    }
    /// Log/done/delete have run.
    pub fn is_complete(&self) -> bool {
        self.record.complete
    }
    /// The request went upstream entirely (headers and all of the body).
    pub fn forwarded_upstream(&self) -> bool {
        self.record.upstream_headers.is_some()
            && self.record.pending_request_chunks.is_empty()
            && !self.record.request_paused
    }
    /// A request header as it was sent UPSTREAM (what the router and ORIGINAL_DST see).
    /// `None` when absent or when the headers never went upstream. Changes the filter made
    /// after the headers went upstream are not visible here (nor in Envoy's routing).
    pub fn request_header(&self, name: &str) -> Option<&str> {
        self.record.upstream_headers.as_ref()?.get(name)
    }
    /// The request headers as sent upstream.
    pub fn upstream_request_headers(&self) -> Option<&HeaderMap> {
        self.record.upstream_headers.as_ref()
    }
    /// The request header map as the host holds it now (including late changes).
    pub fn request_headers(&self) -> &HeaderMap {
        &self.record.request_headers
    }
    /// The request body that went upstream.
    pub fn upstream_body(&self) -> &[u8] {
        &self.record.upstream_body
    }
    /// Every stream callback's action, in order.
    pub fn actions(&self) -> &[(Callback, Action)] {
        &self.record.actions
    }
    /// The action of the LAST call of `callback`.
    pub fn action(&self, callback: Callback) -> Option<Action> {
        self.record
            .actions
            .iter()
            .rev()
            .find(|(c, _)| *c == callback)
            .map(|(_, a)| *a)
    }
    /// The reply the filter sent instead of forwarding.
    pub fn local_response(&self) -> Option<&LocalResponse> {
        self.record.local_response.as_ref()
    }
    /// A response header as sent DOWNSTREAM.
    pub fn response_header(&self, name: &str) -> Option<&str> {
        self.record.downstream_headers.as_ref()?.get(name)
    }
    /// The response body sent downstream.
    pub fn downstream_body(&self) -> &[u8] {
        &self.record.downstream_body
    }
    /// The stream the filter closed with `proxy_close_stream`, if it did.
    pub fn closed_by_filter(&self) -> Option<StreamType> {
        self.record.closed
    }
    /// The test reset the stream.
    pub fn was_reset(&self) -> bool {
        self.record.reset
    }
    /// Tokens of HTTP calls of this stream cancelled when it ended.
    pub fn cancelled_calls(&self) -> &[u32] {
        &self.record.cancelled_calls
    }
    /// A property the filter set on this stream.
    pub fn property(&self, path: &[&str]) -> Option<&[u8]> {
        let key: Vec<String> = path.iter().map(|s| s.to_string()).collect();
        self.record.properties.get(&key).map(|v| v.as_slice())
    }
}
