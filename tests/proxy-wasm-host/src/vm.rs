//! One VM (an Envoy worker thread's Wasm instance): its lifecycle (start, callbacks, traps),
//! what its host functions work on ([`VmState`]), its timers and queue notifications, and
//! the test-facing [`Vm`]. Streams are driven in `stream.rs`, HTTP calls in `http_call.rs`.

use crate::abi::{Action, LogLevel};
use crate::config::VmConfig;
use crate::error::HostError;
use crate::host::{Host, HostShared, MAX_PENDING_EVENTS, lock};
use crate::host_calls::HostCalls;
use crate::http_call::{HttpCall, HttpCallOutcome, HttpResponse, Responder};
use crate::log::{LogEntry, LogSource};
use crate::module::engine;
use crate::stream::StreamRecord;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use wasmtime::{Instance, Store, Val};

/// The state a VM's host functions work on (the wasmtime store data).
pub(crate) struct VmState {
    pub(crate) host: Arc<HostShared>,
    pub(crate) index: u64,
    pub(crate) config: VmConfig,
    pub(crate) root_context: u32,
    /// The context host functions act on (`proxy_set_effective_context` can change it).
    pub(crate) effective: u32,
    /// The export running now, under which host calls are counted.
    pub(crate) callback: &'static str,
    /// Host calls made for the root context (or for no known context).
    pub(crate) root_host_calls: HostCalls,
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

    /// Counts one call of `import` for the effective context, under the running callback.
    pub(crate) fn count_host_call(&mut self, import: &'static str) {
        let callback = self.callback;
        match self.streams.get_mut(&self.effective) {
            Some(stream) => stream.host_calls.record(callback, import),
            None => self.root_host_calls.record(callback, import),
        }
    }
}

/// The VM behind the lock.
pub(crate) struct VmInner {
    pub(crate) store: Store<VmState>,
    instance: Instance,
    /// The trap that broke the VM.
    failed: Option<String>,
    /// The context id of the next stream.
    pub(crate) next_context: u32,
    /// Streams that completed and were not yet handed to the test.
    pub(crate) completed: HashMap<u32, StreamRecord>,
    pub(crate) responder: Option<Responder>,
}

/// The module's last error and critical log lines (a panic message, usually).
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
    /// Fails when an earlier trap broke the VM.
    pub(crate) fn check_alive(&self) -> Result<(), HostError> {
        match &self.failed {
            Some(m) => Err(HostError::VmFailed(m.clone())),
            None => Ok(()),
        }
    }

    /// Calls an export with i32 arguments; `Ok(None)` when the module does not export it
    /// (every callback is optional), `Ok(Some(ret))` with its i32 result (0 when it has none).
    pub(crate) fn call(
        &mut self,
        name: &'static str,
        context: u32,
        args: &[i32],
    ) -> Result<Option<i32>, HostError> {
        self.check_alive()?;
        let Some(func) = self.instance.get_func(&mut self.store, name) else {
            return Ok(None);
        };
        let state = self.store.data_mut();
        state.effective = context;
        state.callback = name;
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

    /// [`VmInner::call`] of a stream callback that returns an action.
    pub(crate) fn call_action(
        &mut self,
        name: &'static str,
        context: u32,
        args: &[i32],
    ) -> Result<Action, HostError> {
        match self.call(name, context, args)? {
            None => Ok(Action::Continue),
            Some(v) => Action::from_i32(v)
                .ok_or_else(|| HostError::Abi(format!("{name} returned action {v}"))),
        }
    }

    /// Envoy's start sequence: `_initialize` (and `main`) or `_start`, the root context,
    /// `proxy_on_vm_start`, `proxy_on_configure`.
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
    pub(crate) fn settle(&mut self) -> Result<(), HostError> {
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

    /// Delivers `proxy_on_queue_ready` to `context` (nothing when the VM failed).
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

pub(crate) fn len_i32(n: usize) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// One VM: an Envoy worker's instance of the module, with its root context (id 1) and tick.
/// Streams get context ids 2, 3, ...
pub struct Vm {
    pub(crate) inner: Arc<Mutex<VmInner>>,
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
            callback: "",
            root_host_calls: HostCalls::default(),
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
        let mut store = Store::new(engine(), state);
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
    pub(crate) fn with<R>(
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

    /// Runs `f` on the locked VM (no callbacks run).
    pub(crate) fn read<R>(&self, f: impl FnOnce(&VmInner) -> R) -> R {
        let g = lock(&self.inner);
        f(&g)
    }

    /// The host this VM belongs to.
    pub fn host(&self) -> &Host {
        &self.host
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

    /// Forgets the log lines recorded so far.
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

    /// The host calls the module made outside any stream so far (VM start and configure,
    /// ticks, queue notifications, HTTP call responses delivered to the root context), per
    /// callback and import. Take a snapshot before an action and use [`HostCalls::since`] to
    /// count what the action cost.
    pub fn root_host_calls(&self) -> HostCalls {
        self.read(|vm| vm.store.data().root_host_calls.clone())
    }
}
