//! [`Host`]: one emulated Envoy process, and the state its VMs share.

use crate::abi::Status;
use crate::config::VmConfig;
use crate::error::HostError;
use crate::imports;
use crate::module::{WasmModule, engine};
use crate::shared::{MetricValue, Metrics, QueueTarget, SharedData, SharedQueues};
use crate::vm::{self, Vm};
use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// What every VM of one host shares.
pub(crate) struct HostShared {
    pub(crate) state: Mutex<SharedState>,
    pub(crate) vms: Mutex<Vec<(u64, Weak<Mutex<vm::VmInner>>)>>,
    pub(crate) next_vm: AtomicU64,
    pub(crate) next_http_token: AtomicU32,
}

/// The host-wide state behind one lock.
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

/// The next HTTP call token of the host (never 0).
pub(crate) fn next_http_token(shared: &HostShared) -> u32 {
    loop {
        let t = shared.next_http_token.fetch_add(1, Ordering::Relaxed);
        if t != 0 {
            return t;
        }
    }
}
