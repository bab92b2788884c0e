//! Process-wide state shared by every VM of one [`Host`](crate::Host), with Envoy's semantics
//! (proxy-wasm-cpp-host `src/shared_data.cc`): the shared key-value store and shared queues,
//! keyed by `vm_id`, and the metrics (Envoy's stats store).

use crate::abi::{MetricKind, Status};
use std::collections::{BTreeMap, HashMap, VecDeque};

/// The shared key-value store.
///
/// Every successful write gives the key a new CAS value drawn from ONE store-wide counter
/// that starts at 1 and skips 0 when it wraps (0 means "no CAS" on the wire). A write with a
/// non-zero `cas` is checked only when the key exists: it fails with `CAS_MISMATCH` when the
/// key's current CAS differs; a write to a missing key always succeeds, whatever `cas` says.
#[derive(Debug)]
pub struct SharedData {
    next_cas: u32,
    data: HashMap<String, HashMap<String, (Vec<u8>, u32)>>,
}

impl Default for SharedData {
    fn default() -> Self {
        SharedData::with_first_cas(1)
    }
}

impl SharedData {
    /// A store whose counter starts at `first` (0 is skipped). For tests of wrap-around.
    pub fn with_first_cas(first: u32) -> SharedData {
        SharedData {
            next_cas: if first == 0 { 1 } else { first },
            data: HashMap::new(),
        }
    }

    fn take_cas(&mut self) -> u32 {
        let cas = self.next_cas;
        self.next_cas = self.next_cas.wrapping_add(1);
        if self.next_cas == 0 {
            self.next_cas = 1;
        }
        cas
    }

    /// The value and CAS of `key` in `vm_id`'s namespace.
    pub fn get(&self, vm_id: &str, key: &str) -> Option<(&[u8], u32)> {
        self.data
            .get(vm_id)?
            .get(key)
            .map(|(v, cas)| (v.as_slice(), *cas))
    }

    /// Writes `value`; see the type's documentation for the CAS rule.
    pub fn set(&mut self, vm_id: &str, key: &str, value: &[u8], cas: u32) -> Status {
        let exists_with = self
            .data
            .get(vm_id)
            .and_then(|m| m.get(key))
            .map(|(_, c)| *c);
        if let Some(current) = exists_with
            && cas != 0
            && cas != current
        {
            return Status::CasMismatch;
        }
        let new_cas = self.take_cas();
        self.data
            .entry(vm_id.to_string())
            .or_default()
            .insert(key.to_string(), (value.to_vec(), new_cas));
        Status::Ok
    }

    /// The keys of `vm_id`'s namespace, sorted.
    pub fn keys(&self, vm_id: &str) -> Vec<String> {
        let mut keys: Vec<String> = self
            .data
            .get(vm_id)
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        keys.sort();
        keys
    }

    /// Total bytes of keys and values held.
    pub fn bytes(&self) -> usize {
        self.data
            .values()
            .flat_map(|m| m.iter())
            .map(|(k, (v, _))| k.len() + v.len())
            .sum()
    }
}

/// Where `proxy_on_queue_ready` goes: the root context of the VM that registered the queue
/// last (Envoy re-points a queue at every registration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueTarget {
    pub vm: u64,
    pub context_id: u32,
}

#[derive(Debug)]
struct Queue {
    target: QueueTarget,
    items: VecDeque<Vec<u8>>,
}

/// Shared queues: named per `vm_id`, addressed by a token that starts at 1 and is never 0.
#[derive(Debug)]
pub struct SharedQueues {
    next_token: u32,
    tokens: HashMap<(String, String), u32>,
    queues: BTreeMap<u32, Queue>,
}

impl Default for SharedQueues {
    fn default() -> Self {
        SharedQueues {
            next_token: 1,
            tokens: HashMap::new(),
            queues: BTreeMap::new(),
        }
    }
}

impl SharedQueues {
    /// Registers (or re-opens, keeping its items) the queue `name` of `vm_id`, delivering its
    /// notifications to `target` from now on.
    pub fn register(&mut self, vm_id: &str, name: &str, target: QueueTarget) -> u32 {
        let key = (vm_id.to_string(), name.to_string());
        let token = match self.tokens.get(&key) {
            Some(t) => *t,
            None => {
                let mut t = self.next_token;
                while t == 0 || self.queues.contains_key(&t) {
                    t = t.wrapping_add(1);
                }
                self.next_token = t.wrapping_add(1);
                self.tokens.insert(key, t);
                t
            }
        };
        let queue = self.queues.entry(token).or_insert_with(|| Queue {
            target,
            items: VecDeque::new(),
        });
        queue.target = target;
        token
    }

    pub fn resolve(&self, vm_id: &str, name: &str) -> Option<u32> {
        self.tokens
            .get(&(vm_id.to_string(), name.to_string()))
            .copied()
    }

    /// Appends an item; on success gives the target to notify.
    pub fn enqueue(&mut self, token: u32, value: &[u8]) -> Result<QueueTarget, Status> {
        let q = self.queues.get_mut(&token).ok_or(Status::NotFound)?;
        q.items.push_back(value.to_vec());
        Ok(q.target)
    }

    /// Takes the oldest item: `NOT_FOUND` for an unknown token, `EMPTY` when there is none.
    pub fn dequeue(&mut self, token: u32) -> Result<Vec<u8>, Status> {
        let q = self.queues.get_mut(&token).ok_or(Status::NotFound)?;
        q.items.pop_front().ok_or(Status::Empty)
    }

    /// Items waiting in the queue; `None` for an unknown token.
    pub fn len(&self, token: u32) -> Option<usize> {
        self.queues.get(&token).map(|q| q.items.len())
    }
}

/// One metric's current value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetricValue {
    /// A counter's value.
    Counter(u64),
    /// A gauge's value.
    Gauge(i64),
    /// Every recorded sample, in order.
    Histogram(Vec<u64>),
}

#[derive(Debug, Clone)]
struct Metric {
    name: String,
    value: MetricValue,
}

/// The stats store: one metric per name, shared by every VM; ids are host-wide.
#[derive(Debug, Default)]
pub struct Metrics {
    metrics: Vec<Metric>,
}

impl Metrics {
    /// Defines (or finds) `name`. Defining an existing name with another kind is
    /// `BAD_ARGUMENT`.
    pub fn define(&mut self, kind: MetricKind, name: &str) -> Result<u32, Status> {
        if let Some(i) = self.metrics.iter().position(|m| m.name == name) {
            let same = matches!(
                (kind, self.metrics.get(i).map(|m| &m.value)),
                (MetricKind::Counter, Some(MetricValue::Counter(_)))
                    | (MetricKind::Gauge, Some(MetricValue::Gauge(_)))
                    | (MetricKind::Histogram, Some(MetricValue::Histogram(_)))
            );
            return if same {
                Ok(index_to_id(i))
            } else {
                Err(Status::BadArgument)
            };
        }
        let value = match kind {
            MetricKind::Counter => MetricValue::Counter(0),
            MetricKind::Gauge => MetricValue::Gauge(0),
            MetricKind::Histogram => MetricValue::Histogram(Vec::new()),
        };
        self.metrics.push(Metric {
            name: name.to_string(),
            value,
        });
        Ok(index_to_id(self.metrics.len() - 1))
    }

    fn get_mut(&mut self, id: u32) -> Result<&mut MetricValue, Status> {
        let i = id.checked_sub(1).ok_or(Status::NotFound)? as usize;
        self.metrics
            .get_mut(i)
            .map(|m| &mut m.value)
            .ok_or(Status::NotFound)
    }

    /// Adds `delta`: a counter refuses a negative delta (`BAD_ARGUMENT`), a histogram refuses
    /// increments (`BAD_ARGUMENT`).
    pub fn increment(&mut self, id: u32, delta: i64) -> Status {
        match self.get_mut(id) {
            Err(s) => s,
            Ok(MetricValue::Counter(v)) => match u64::try_from(delta) {
                Ok(d) => {
                    *v = v.saturating_add(d);
                    Status::Ok
                }
                Err(_) => Status::BadArgument,
            },
            Ok(MetricValue::Gauge(v)) => {
                *v = v.saturating_add(delta);
                Status::Ok
            }
            Ok(MetricValue::Histogram(_)) => Status::BadArgument,
        }
    }

    /// Sets a gauge, records a histogram sample, or raises a counter to `value` (Envoy never
    /// lowers a counter).
    pub fn record(&mut self, id: u32, value: u64) -> Status {
        match self.get_mut(id) {
            Err(s) => s,
            Ok(MetricValue::Counter(v)) => {
                *v = (*v).max(value);
                Status::Ok
            }
            Ok(MetricValue::Gauge(v)) => {
                *v = i64::try_from(value).unwrap_or(i64::MAX);
                Status::Ok
            }
            Ok(MetricValue::Histogram(samples)) => {
                samples.push(value);
                Status::Ok
            }
        }
    }

    /// A counter's or gauge's value (a negative gauge wraps as two's complement, as the ABI's
    /// u64 does); histograms are `BAD_ARGUMENT`.
    pub fn get(&mut self, id: u32) -> Result<u64, Status> {
        match self.get_mut(id)? {
            MetricValue::Counter(v) => Ok(*v),
            MetricValue::Gauge(v) => Ok(*v as u64),
            MetricValue::Histogram(_) => Err(Status::BadArgument),
        }
    }

    pub fn by_name(&self, name: &str) -> Option<&MetricValue> {
        self.metrics
            .iter()
            .find(|m| m.name == name)
            .map(|m| &m.value)
    }

    pub fn all(&self) -> Vec<(String, MetricValue)> {
        self.metrics
            .iter()
            .map(|m| (m.name.clone(), m.value.clone()))
            .collect()
    }
}

fn index_to_id(i: usize) -> u32 {
    u32::try_from(i + 1).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cas_values_come_from_one_counter_and_a_stale_cas_is_refused() {
        let mut s = SharedData::default();
        assert_eq!(s.set("", "a", b"1", 0), Status::Ok);
        let (_, cas_a) = s.get("", "a").unwrap();
        assert_eq!(cas_a, 1);
        assert_eq!(s.set("", "b", b"x", 0), Status::Ok);
        assert_eq!(s.get("", "b").unwrap().1, 2, "one counter for all keys");
        // correct CAS succeeds and moves the CAS
        assert_eq!(s.set("", "a", b"2", cas_a), Status::Ok);
        let (v, cas_a2) = s.get("", "a").unwrap();
        assert_eq!((v, cas_a2), (b"2".as_slice(), 3));
        // the old CAS is now stale
        assert_eq!(s.set("", "a", b"3", cas_a), Status::CasMismatch);
        assert_eq!(
            s.get("", "a").unwrap().0,
            b"2",
            "a refused write changes nothing"
        );
        // cas 0 = unconditional
        assert_eq!(s.set("", "a", b"4", 0), Status::Ok);
        assert_eq!(s.get("", "a").unwrap().0, b"4");
    }

    #[test]
    fn cas_is_checked_only_when_the_key_exists() {
        let mut s = SharedData::default();
        assert_eq!(s.set("", "fresh", b"v", 12345), Status::Ok);
        assert_eq!(s.get("", "fresh").unwrap().0, b"v");
    }

    #[test]
    fn the_cas_counter_skips_zero_when_it_wraps() {
        let mut s = SharedData::with_first_cas(u32::MAX);
        s.set("", "k", b"1", 0);
        assert_eq!(s.get("", "k").unwrap().1, u32::MAX);
        s.set("", "k", b"2", u32::MAX);
        assert_eq!(s.get("", "k").unwrap().1, 1, "0 is never handed out");
    }

    #[test]
    fn namespaces_are_per_vm_id() {
        let mut s = SharedData::default();
        s.set("vm1", "k", b"1", 0);
        assert!(s.get("vm2", "k").is_none());
        assert_eq!(s.keys("vm1"), vec!["k".to_string()]);
    }

    #[test]
    fn queues_keep_fifo_order_and_report_empty_and_not_found() {
        let mut q = SharedQueues::default();
        let t = QueueTarget {
            vm: 1,
            context_id: 1,
        };
        let token = q.register("", "jobs", t);
        assert_ne!(token, 0);
        assert_eq!(q.resolve("", "jobs"), Some(token));
        assert_eq!(q.resolve("other", "jobs"), None);
        assert_eq!(q.dequeue(token), Err(Status::Empty));
        assert_eq!(q.enqueue(token, b"a"), Ok(t));
        q.enqueue(token, b"b").unwrap();
        assert_eq!(q.len(token), Some(2));
        assert_eq!(q.dequeue(token).unwrap(), b"a");
        assert_eq!(q.dequeue(token).unwrap(), b"b");
        assert_eq!(q.dequeue(token), Err(Status::Empty));
        assert_eq!(q.dequeue(token + 100), Err(Status::NotFound));
        assert_eq!(q.enqueue(token + 100, b"x"), Err(Status::NotFound));
    }

    #[test]
    fn re_registering_a_queue_keeps_items_and_moves_the_target() {
        let mut q = SharedQueues::default();
        let a = QueueTarget {
            vm: 1,
            context_id: 1,
        };
        let b = QueueTarget {
            vm: 2,
            context_id: 1,
        };
        let token = q.register("", "q", a);
        q.enqueue(token, b"x").unwrap();
        assert_eq!(q.register("", "q", b), token);
        assert_eq!(q.len(token), Some(1));
        assert_eq!(q.enqueue(token, b"y"), Ok(b));
    }

    #[test]
    fn metrics_follow_envoys_rules_per_kind() {
        let mut m = Metrics::default();
        let c = m.define(MetricKind::Counter, "c").unwrap();
        let g = m.define(MetricKind::Gauge, "g").unwrap();
        let h = m.define(MetricKind::Histogram, "h").unwrap();
        assert_eq!(
            m.define(MetricKind::Counter, "c"),
            Ok(c),
            "same name, same id"
        );
        assert_eq!(m.define(MetricKind::Gauge, "c"), Err(Status::BadArgument));
        assert_eq!(m.increment(c, 2), Status::Ok);
        assert_eq!(m.increment(c, -1), Status::BadArgument);
        assert_eq!(m.get(c), Ok(2));
        assert_eq!(m.increment(g, -3), Status::Ok);
        assert_eq!(m.get(g), Ok((-3i64) as u64));
        assert_eq!(m.record(g, 7), Status::Ok);
        assert_eq!(m.get(g), Ok(7));
        assert_eq!(m.record(h, 5), Status::Ok);
        assert_eq!(m.record(h, 9), Status::Ok);
        assert_eq!(m.by_name("h"), Some(&MetricValue::Histogram(vec![5, 9])));
        assert_eq!(m.get(h), Err(Status::BadArgument));
        assert_eq!(m.increment(h, 1), Status::BadArgument);
        assert_eq!(m.increment(999, 1), Status::NotFound);
        assert_eq!(m.get(0), Err(Status::NotFound));
    }
}
