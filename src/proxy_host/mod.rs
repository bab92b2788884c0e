//! A Wasmtime host for proxy-wasm modules (ABI 0.2.1), to test a compiled filter `.wasm`
//! quickly and deterministically, without Envoy.
//!
//! It emulates what Envoy does around a filter: one VM per worker thread, each with its own
//! root context and tick; ONE shared-data store, shared queues and one stats store for all of
//! them (keyed by `vm_id`); a virtual clock that only moves when the test says so; outbound
//! HTTP calls that the test answers (or fails, or lets time out); Envoy's order of callbacks
//! and its body buffering. Imports it does not implement trap with the import's name.
//!
//! ```no_run
//! # fn main() -> Result<(), mmrouter::proxy_host::HostError> {
//! use mmrouter::proxy_host::{Host, WasmModule};
//! let module = WasmModule::load("target/wasm32-wasip1/wasm/my_filter.wasm")?;
//! let host = Host::new(&module)?;
//! let vm = host.vm(r#"{"some":"config"}"#)?;
//! let s = vm
//!     .request()
//!     .header(":path", "/v1/chat/completions")
//!     .body(b"{}")
//!     .send()?;
//! assert_eq!(s.request_header("x-added"), Some("1"));
//! # Ok(()) }
//! ```
//!
//! See `docs/PROXY_HOST.md` for the semantics in detail.

pub mod abi;
pub mod build;
mod imports;
pub mod shared;
mod vm;

pub use abi::{Action, HeaderMap, LogLevel, MetricKind, Status, StreamType};
pub use shared::MetricValue;
pub use vm::{
    Callback, Exchange, HttpCall, HttpCallOutcome, HttpResponse, LocalResponse, LogEntry,
    LogSource, RequestBuilder, Response, Vm, VmConfig,
};

use shared::{Metrics, QueueTarget, SharedData, SharedQueues};
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Everything that can go wrong hosting a module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostError {
    /// The `.wasm` could not be read or compiled.
    Load { path: String, message: String },
    /// Linking or instantiation failed (e.g. an import with an unexpected signature).
    Instantiate(String),
    /// The module does not export `proxy_abi_version_0_2_1` (or `_0_2_0`).
    UnsupportedAbi,
    /// A callback trapped (a Rust panic in the SDK, an unimplemented import, `proc_exit`...).
    /// `logs` are the module's last error/critical log lines (the panic message, usually).
    Trap {
        callback: String,
        context_id: u32,
        message: String,
        logs: Vec<String>,
    },
    /// `proxy_on_vm_start` returned false.
    VmStartRejected { logs: Vec<String> },
    /// `proxy_on_configure` returned false (Envoy refuses the plugin configuration).
    ConfigureRejected { logs: Vec<String> },
    /// The VM trapped earlier; Envoy would have failed it too.
    VmFailed(String),
    /// A callback returned a value outside the ABI (e.g. an action other than 0/1).
    Abi(String),
    /// No open or completed stream with this context id.
    UnknownStream(u32),
    /// No pending HTTP call with this token.
    UnknownHttpCall(u32),
    /// Pending events kept producing events (queue ping-pong, a responder that never ends).
    Runaway(String),
    /// Building a `.wasm` with cargo failed.
    Build(String),
}

impl fmt::Display for HostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostError::Load { path, message } => write!(f, "cannot load {path}: {message}"),
            HostError::Instantiate(m) => write!(f, "cannot instantiate the module: {m}"),
            HostError::UnsupportedAbi => write!(
                f,
                "the module exports neither proxy_abi_version_0_2_1 nor proxy_abi_version_0_2_0"
            ),
            HostError::Trap {
                callback,
                context_id,
                message,
                logs,
            } => {
                write!(f, "{callback}(context {context_id}) trapped: {message}")?;
                if !logs.is_empty() {
                    write!(f, "; module logs: {}", logs.join(" | "))?;
                }
                Ok(())
            }
            HostError::VmStartRejected { logs } => {
                write!(
                    f,
                    "proxy_on_vm_start returned false; logs: {}",
                    logs.join(" | ")
                )
            }
            HostError::ConfigureRejected { logs } => write!(
                f,
                "proxy_on_configure returned false (configuration refused); logs: {}",
                logs.join(" | ")
            ),
            HostError::VmFailed(m) => write!(f, "the VM failed earlier: {m}"),
            HostError::Abi(m) => write!(f, "ABI violation: {m}"),
            HostError::UnknownStream(id) => write!(f, "no stream with context id {id}"),
            HostError::UnknownHttpCall(t) => write!(f, "no pending HTTP call with token {t}"),
            HostError::Runaway(m) => write!(f, "pending events do not settle: {m}"),
            HostError::Build(m) => write!(f, "building the .wasm failed: {m}"),
        }
    }
}

impl std::error::Error for HostError {}

/// The engine shared by every module of this process (a `Module` belongs to one engine).
fn engine() -> &'static wasmtime::Engine {
    static ENGINE: OnceLock<wasmtime::Engine> = OnceLock::new();
    ENGINE.get_or_init(wasmtime::Engine::default)
}

/// A compiled module. [`WasmModule::load`] compiles each path once per process and then hands
/// out clones (cheap: the compiled code is shared).
#[derive(Clone)]
pub struct WasmModule {
    module: wasmtime::Module,
    name: String,
}

impl fmt::Debug for WasmModule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WasmModule")
            .field("name", &self.name)
            .finish()
    }
}

impl WasmModule {
    /// Compiles `path`, or returns the module compiled earlier from the same path.
    pub fn load(path: impl AsRef<Path>) -> Result<WasmModule, HostError> {
        static CACHE: OnceLock<Mutex<HashMap<PathBuf, WasmModule>>> = OnceLock::new();
        let path = path.as_ref();
        let key = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
        if let Some(m) = lock(cache).get(&key) {
            return Ok(m.clone());
        }
        let bytes = std::fs::read(path).map_err(|e| HostError::Load {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let name = path.display().to_string();
        let module = match compiled_cache_path(path, &bytes) {
            Some(cwasm) => load_or_compile_cached(&name, &bytes, &cwasm)?,
            None => WasmModule::from_bytes(&name, &bytes)?,
        };
        lock(cache).insert(key, module.clone());
        Ok(module)
    }

    /// Compiles a module from bytes (not cached).
    pub fn from_bytes(name: &str, bytes: &[u8]) -> Result<WasmModule, HostError> {
        let module = wasmtime::Module::new(engine(), bytes).map_err(|e| HostError::Load {
            path: name.to_string(),
            message: format!("{e:#}"),
        })?;
        Ok(WasmModule {
            module,
            name: name.to_string(),
        })
    }

    /// The module's imports as `module::name`, for diagnostics.
    pub fn imports(&self) -> Vec<String> {
        self.module
            .imports()
            .map(|i| format!("{}::{}", i.module(), i.name()))
            .collect()
    }

    /// The module's exports.
    pub fn exports(&self) -> Vec<String> {
        self.module
            .exports()
            .map(|e| e.name().to_string())
            .collect()
    }
}

/// Where [`WasmModule::load`] keeps the compiled code of `wasm`: beside it, named after the
/// xxh3-128 of its bytes and the engine's compatibility hash, so a changed module or another
/// wasmtime never reads a stale file. `None` (no disk cache) when the environment variable
/// `PROXY_HOST_NO_CACHE` is set.
fn compiled_cache_path(wasm: &Path, bytes: &[u8]) -> Option<PathBuf> {
    use std::hash::{Hash, Hasher};
    if std::env::var_os("PROXY_HOST_NO_CACHE").is_some() {
        return None;
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    engine().precompile_compatibility_hash().hash(&mut h);
    let engine_hash = h.finish();
    let wasm_hash = xxhash_rust::xxh3::xxh3_128(bytes);
    let file = wasm.file_name()?.to_string_lossy().into_owned();
    Some(wasm.with_file_name(format!("{file}.{wasm_hash:032x}.{engine_hash:016x}.cwasm")))
}

/// Compiling a filter with a debug build of Cranelift takes tens of seconds; the compiled
/// code is reused across test runs through `cwasm`.
fn load_or_compile_cached(name: &str, bytes: &[u8], cwasm: &Path) -> Result<WasmModule, HostError> {
    if cwasm.exists() {
        // SAFETY: `cwasm` is only ever written below, by `Module::serialize` of this same
        // engine configuration, under a name that carries the hash of the source bytes and of
        // the engine's compatibility settings; wasmtime re-checks its header on load.
        let loaded = unsafe { wasmtime::Module::deserialize_file(engine(), cwasm) };
        if let Ok(module) = loaded {
            return Ok(WasmModule {
                module,
                name: name.to_string(),
            });
        }
    }
    let module = WasmModule::from_bytes(name, bytes)?;
    if let Ok(serialized) = module.module.serialize() {
        // Write-then-rename so a concurrent reader never sees half a file; failures only
        // cost the next run a compile.
        let tmp = cwasm.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, serialized).is_ok() {
            let _ = std::fs::rename(&tmp, cwasm);
        }
    }
    Ok(module)
}

/// What every VM of one host shares.
pub(crate) struct HostShared {
    pub(crate) state: Mutex<SharedState>,
    pub(crate) vms: Mutex<Vec<(u64, Weak<Mutex<vm::VmInner>>)>>,
    pub(crate) next_vm: AtomicU64,
    pub(crate) next_http_token: AtomicU32,
}

pub(crate) struct SharedState {
    pub(crate) data: SharedData,
    pub(crate) queues: SharedQueues,
    pub(crate) metrics: Metrics,
    /// `proxy_on_queue_ready` notifications not yet delivered, in enqueue order.
    pub(crate) queue_ready: VecDeque<(QueueTarget, u32)>,
    /// Virtual time since the host was created.
    pub(crate) now: Duration,
    /// Wall-clock time at `now == 0`.
    pub(crate) epoch: SystemTime,
    /// Simulated races: (key suffix, remaining). See [`Host::race_shared_data`].
    pub(crate) races: Option<(String, u32)>,
}

impl SharedState {
    pub(crate) fn wall_clock_nanos(&self) -> u64 {
        let t = self.epoch + self.now;
        let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
        u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
    }
}

/// Locks a mutex, ignoring poisoning (a panicking test thread must not hide the state).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The default wall-clock time at virtual time 0: 2023-11-14T22:13:20Z.
pub const DEFAULT_EPOCH_SECS: u64 = 1_700_000_000;

/// How many pending events [`Host::run_pending`] delivers before it gives up (default 100,000).
pub const MAX_PENDING_EVENTS: usize = 100_000;

/// One emulated Envoy process for one module: any number of VMs ("worker threads") sharing a
/// shared-data store, shared queues, metrics and a virtual clock. Cheap to clone (shared).
#[derive(Clone)]
pub struct Host {
    pub(crate) shared: Arc<HostShared>,
    pub(crate) pre: wasmtime::InstancePre<vm::VmState>,
    pub(crate) module: WasmModule,
}

impl Host {
    /// A host for `module`, with the virtual clock at [`DEFAULT_EPOCH_SECS`].
    pub fn new(module: &WasmModule) -> Result<Host, HostError> {
        Host::with_epoch(module, UNIX_EPOCH + Duration::from_secs(DEFAULT_EPOCH_SECS))
    }

    /// A host whose virtual wall clock reads `epoch` at virtual time 0.
    pub fn with_epoch(module: &WasmModule, epoch: SystemTime) -> Result<Host, HostError> {
        let linker = imports::linker(engine(), &module.module)
            .map_err(|e| HostError::Instantiate(format!("{e:#}")))?;
        let pre = linker
            .instantiate_pre(&module.module)
            .map_err(|e| HostError::Instantiate(format!("{e:#}")))?;
        Ok(Host {
            shared: Arc::new(HostShared {
                state: Mutex::new(SharedState {
                    data: SharedData::default(),
                    queues: SharedQueues::default(),
                    metrics: Metrics::default(),
                    queue_ready: VecDeque::new(),
                    now: Duration::ZERO,
                    epoch,
                    races: None,
                }),
                vms: Mutex::new(Vec::new()),
                next_vm: AtomicU64::new(1),
                next_http_token: AtomicU32::new(1),
            }),
            pre,
            module: module.clone(),
        })
    }

    /// Starts a VM (an Envoy worker) with this plugin configuration (and defaults for the
    /// rest, see [`VmConfig`]): `_initialize`, `proxy_on_context_create(root, 0)`,
    /// `proxy_on_vm_start`, `proxy_on_configure`.
    pub fn vm(&self, config: impl Into<VmConfig>) -> Result<Vm, HostError> {
        let vm = Vm::start(self.clone(), config.into())?;
        self.run_pending()?;
        Ok(vm)
    }

    /// The module this host runs.
    pub fn module(&self) -> &WasmModule {
        &self.module
    }

    /// Virtual time elapsed since the host was created.
    pub fn now(&self) -> Duration {
        lock(&self.shared.state).now
    }

    /// Moves the virtual clock forward by `by`, firing, in time order, every tick of every VM
    /// and every HTTP-call timeout that falls due (a timed-out call is delivered as Envoy
    /// does: `proxy_on_http_call_response` with 0 headers).
    pub fn advance(&self, by: Duration) -> Result<(), HostError> {
        let target = self.now().saturating_add(by);
        let mut fired = 0usize;
        loop {
            let mut best: Option<(Duration, Arc<Mutex<vm::VmInner>>)> = None;
            for vm in self.live_vms() {
                let due = lock(&vm).next_event();
                if let Some(t) = due
                    && t <= target
                    && best.as_ref().is_none_or(|(b, _)| t < *b)
                {
                    best = Some((t, vm));
                }
            }
            let Some((t, vm)) = best else { break };
            {
                let mut st = lock(&self.shared.state);
                if t > st.now {
                    st.now = t;
                }
            }
            lock(&vm).fire_due(t)?;
            self.run_pending()?;
            fired += 1;
            if fired > MAX_PENDING_EVENTS {
                return Err(HostError::Runaway(format!(
                    "more than {MAX_PENDING_EVENTS} timer events in one advance"
                )));
            }
        }
        let mut st = lock(&self.shared.state);
        if target > st.now {
            st.now = target;
        }
        Ok(())
    }

    fn live_vms(&self) -> Vec<Arc<Mutex<vm::VmInner>>> {
        let mut vms = lock(&self.shared.vms);
        vms.retain(|(_, w)| w.strong_count() > 0);
        vms.iter().filter_map(|(_, w)| w.upgrade()).collect()
    }

    fn vm_by_index(&self, index: u64) -> Option<Arc<Mutex<vm::VmInner>>> {
        lock(&self.shared.vms)
            .iter()
            .find(|(i, _)| *i == index)
            .and_then(|(_, w)| w.upgrade())
    }

    /// Delivers pending `proxy_on_queue_ready` notifications (each to the root context of the
    /// VM that registered the queue) until none are left. Every operation of [`Vm`] and
    /// [`Host`] calls it before returning, like Envoy's event loop running after a callback.
    pub fn run_pending(&self) -> Result<(), HostError> {
        for _ in 0..MAX_PENDING_EVENTS {
            let next = lock(&self.shared.state).queue_ready.pop_front();
            let Some((target, token)) = next else {
                return Ok(());
            };
            // A VM that was dropped gets nothing, as in Envoy when the thread's VM is gone.
            if let Some(vm) = self.vm_by_index(target.vm) {
                lock(&vm).deliver_queue_ready(target.context_id, token)?;
            }
        }
        Err(HostError::Runaway(format!(
            "more than {MAX_PENDING_EVENTS} queue notifications"
        )))
    }

    /// The value and CAS of a shared-data key in the default `vm_id` ("").
    pub fn shared_data(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.shared_data_in("", key)
    }

    /// The value and CAS of a shared-data key in `vm_id`'s namespace.
    pub fn shared_data_in(&self, vm_id: &str, key: &str) -> Option<(Vec<u8>, u32)> {
        lock(&self.shared.state)
            .data
            .get(vm_id, key)
            .map(|(v, c)| (v.to_vec(), c))
    }

    /// Writes shared data as a VM would (`cas` 0 = unconditional), for preloading state.
    pub fn set_shared_data(&self, vm_id: &str, key: &str, value: &[u8], cas: u32) -> Status {
        lock(&self.shared.state).data.set(vm_id, key, value, cas)
    }

    /// Simulates another worker thread winning CAS races: for the next `times` reads
    /// (`proxy_get_shared_data`) of a key ending with `key_suffix`, the host rewrites that key
    /// with its same value right after the read, so the reader's CAS is stale and its next
    /// conditional write fails with `CAS_MISMATCH` — what happens in Envoy when two workers
    /// update the same key at once.
    pub fn race_shared_data(&self, key_suffix: &str, times: u32) {
        lock(&self.shared.state).races = Some((key_suffix.to_string(), times));
    }

    /// Races set up by [`Host::race_shared_data`] that have not happened yet.
    pub fn races_left(&self) -> u32 {
        lock(&self.shared.state)
            .races
            .as_ref()
            .map_or(0, |(_, n)| *n)
    }

    /// The shared-data keys of `vm_id`, sorted.
    pub fn shared_data_keys(&self, vm_id: &str) -> Vec<String> {
        lock(&self.shared.state).data.keys(vm_id)
    }

    /// Total bytes (keys + values) in the shared-data store.
    pub fn shared_data_bytes(&self) -> usize {
        lock(&self.shared.state).data.bytes()
    }

    /// A metric by the name the module defined it with.
    pub fn metric(&self, name: &str) -> Option<MetricValue> {
        lock(&self.shared.state).metrics.by_name(name).cloned()
    }

    /// A counter's or gauge's value as i64 (histograms: the number of samples).
    pub fn metric_value(&self, name: &str) -> Option<i64> {
        self.metric(name).map(|m| match m {
            MetricValue::Counter(v) => i64::try_from(v).unwrap_or(i64::MAX),
            MetricValue::Gauge(v) => v,
            MetricValue::Histogram(s) => i64::try_from(s.len()).unwrap_or(i64::MAX),
        })
    }

    /// Every metric, in definition order.
    pub fn metrics(&self) -> Vec<(String, MetricValue)> {
        lock(&self.shared.state).metrics.all()
    }

    /// The token of queue `name` in `vm_id`, if some VM registered it.
    pub fn resolve_queue(&self, vm_id: &str, name: &str) -> Option<u32> {
        lock(&self.shared.state).queues.resolve(vm_id, name)
    }

    /// Items waiting in a queue.
    pub fn queue_len(&self, token: u32) -> Option<usize> {
        lock(&self.shared.state).queues.len(token)
    }

    /// Enqueues an item as another VM (or a control plane) would, then delivers
    /// `proxy_on_queue_ready`.
    pub fn enqueue(&self, token: u32, value: &[u8]) -> Result<Status, HostError> {
        let status = {
            let mut st = lock(&self.shared.state);
            match st.queues.enqueue(token, value) {
                Ok(target) => {
                    st.queue_ready.push_back((target, token));
                    Status::Ok
                }
                Err(s) => s,
            }
        };
        self.run_pending()?;
        Ok(status)
    }
}

impl fmt::Debug for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Host")
            .field("module", &self.module)
            .field("now", &self.now())
            .finish()
    }
}

pub(crate) fn next_http_token(shared: &HostShared) -> u32 {
    loop {
        let t = shared.next_http_token.fetch_add(1, Ordering::Relaxed);
        if t != 0 {
            return t;
        }
    }
}
