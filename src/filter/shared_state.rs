//! State shared by every VM of the filter through proxy-wasm shared data.
//!
//! Envoy runs one VM per worker thread. Each VM has its own memory, so the router's picture of
//! the workers (which blocks they hold, how loaded they are) must go through shared data: a
//! process-wide key-value store where every `get` copies the value into the VM and every `set`
//! may carry a CAS token (checked only when the key exists).
//!
//! Two structures live there, under a prefix that changes with the worker list so a
//! reconfiguration never reads another configuration's layout:
//!
//! - **Load table** (`<prefix>.load`): 12 bytes per worker (in-flight requests u32, prefill
//!   blocks outstanding u64, little-endian). Updated with a CAS loop: read value and CAS token,
//!   modify, write with the token; on `CAS_MISMATCH` another VM wrote in between, so read again
//!   and retry. No update is lost; a VM that loses the race only retries. Reading all loads is
//!   one `get` of 12 × workers bytes.
//! - **Decision log** (`<prefix>.log.head` and `<prefix>.log.<slot>`): a ring of `log_slots`
//!   records, one per routing decision (worker, time, block keys). Appending claims a sequence
//!   number by a CAS increment of `head`, then writes the record into slot `seq % log_slots`.
//!   Every VM keeps its own prefix index and a cursor; before each decision (and on its tick) it
//!   reads `head` (8 bytes) and replays only the records it has not seen. So no VM ever copies a
//!   large snapshot per request: the per-request cost is one 8-byte read plus the new records,
//!   and all VMs converge on the same index because they apply the same records in the same
//!   order. A VM that falls more than `log_slots` behind skips what was overwritten (counted).
//!
//! - **Worker metrics** (`<prefix>.metrics`): 24 bytes per worker (waiting, running, KV usage as
//!   f32; consecutive poll failures u32; time of the last good poll u64), written by the one VM
//!   that holds the **poller lease** (`<prefix>.poller`: holder id and expiry, taken and renewed
//!   with CAS), so a fleet of Envoy threads scrapes each worker once per period, not once per
//!   thread.
//!
//! Everything here goes through the [`SharedStore`] trait, so it is tested natively with an
//! in-memory store that has Envoy's semantics, and runs in Envoy over the proxy-wasm host calls.

use crate::scoring::WorkerLoad;
use crate::worker_metrics::WorkerMetrics;
use xxhash_rust::xxh3::xxh3_64;

/// Why a shared-data operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreError {
    /// The CAS token was stale: another VM wrote the key in between.
    CasMismatch,
    /// Any other host status (its numeric code).
    Host(u32),
}

/// proxy-wasm shared data, as the filter uses it.
pub trait SharedStore {
    /// The value and its CAS token, or None when the key does not exist.
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError>;
    /// Writes a value; with `cas`, only if the key's token still equals it (or the key does
    /// not exist, as in Envoy).
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError>;
}

/// How many times a CAS loop retries before giving up (and counting a lost update).
pub const CAS_RETRIES: usize = 64;

/// One routing decision, as written to the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub seq: u64,
    pub worker: u32,
    pub time_ms: u64,
    pub keys: Vec<u64>,
}

const RECORD_HEADER: usize = 8 + 8 + 4 + 4;

impl Record {
    fn encode(seq: u64, worker: u32, time_ms: u64, keys: &[u64]) -> Vec<u8> {
        let mut out = Vec::with_capacity(RECORD_HEADER + keys.len() * 8);
        out.extend_from_slice(&seq.to_le_bytes());
        out.extend_from_slice(&time_ms.to_le_bytes());
        out.extend_from_slice(&worker.to_le_bytes());
        out.extend_from_slice(&(keys.len() as u32).to_le_bytes());
        for k in keys {
            out.extend_from_slice(&k.to_le_bytes());
        }
        out
    }

    fn decode(bytes: &[u8]) -> Option<Record> {
        let seq = u64::from_le_bytes(bytes.get(0..8)?.try_into().ok()?);
        let time_ms = u64::from_le_bytes(bytes.get(8..16)?.try_into().ok()?);
        let worker = u32::from_le_bytes(bytes.get(16..20)?.try_into().ok()?);
        let n = u32::from_le_bytes(bytes.get(20..24)?.try_into().ok()?) as usize;
        let body = bytes.get(RECORD_HEADER..)?;
        if body.len() != n.checked_mul(8)? {
            return None;
        }
        let keys = body
            .chunks_exact(8)
            .filter_map(|c| c.try_into().ok().map(u64::from_le_bytes))
            .collect();
        Some(Record {
            seq,
            worker,
            time_ms,
            keys,
        })
    }
}

/// What a replay did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SyncStats {
    pub applied: u64,
    /// Records overwritten before this VM read them.
    pub skipped: u64,
}

/// One worker's entry in the shared metrics table.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MetricsEntry {
    /// The last good poll's values (None before the first one).
    pub metrics: Option<WorkerMetrics>,
    /// When the last good poll arrived (ms since the epoch; 0 = never).
    pub updated_ms: u64,
    /// Polls that failed since the last good one.
    pub failures: u32,
}

const METRICS_ENTRY: usize = 24;

/// The shared structures of one configuration.
#[derive(Debug, Clone)]
pub struct SharedState {
    metrics_key: String,
    lease_key: String,
    load_key: String,
    head_key: String,
    slot_prefix: String,
    workers: usize,
    slots: u64,
}

impl SharedState {
    /// `generation` identifies the configuration's layout (see [`generation`]).
    pub fn new(generation: u64, workers: usize, log_slots: u32) -> SharedState {
        let prefix = format!("mmrouter.{generation:016x}");
        SharedState {
            metrics_key: format!("{prefix}.metrics"),
            lease_key: format!("{prefix}.poller"),
            load_key: format!("{prefix}.load"),
            head_key: format!("{prefix}.log.head"),
            slot_prefix: format!("{prefix}.log."),
            workers,
            slots: u64::from(log_slots.max(1)),
        }
    }

    // ---- load table --------------------------------------------------------------------

    /// Every worker's router-side load (zeros where nothing was recorded yet).
    pub fn loads(&self, store: &dyn SharedStore) -> Vec<WorkerLoad> {
        let bytes = match store.get(&self.load_key) {
            Ok(Some((bytes, _))) => bytes,
            _ => Vec::new(),
        };
        self.decode_loads(&bytes)
    }

    fn decode_loads(&self, bytes: &[u8]) -> Vec<WorkerLoad> {
        let mut loads = vec![WorkerLoad::default(); self.workers];
        if bytes.len() != self.workers * 12 {
            return loads;
        }
        for (load, chunk) in loads.iter_mut().zip(bytes.chunks_exact(12)) {
            let (a, b) = chunk.split_at(4);
            load.inflight = a.try_into().map(u32::from_le_bytes).unwrap_or(0);
            load.prefill_blocks = b.try_into().map(u64::from_le_bytes).unwrap_or(0);
        }
        loads
    }

    /// Adds `d_inflight` and `d_prefill` to one worker's load (saturating at 0). Returns false
    /// when every CAS retry lost the race or the host refused.
    pub fn add_load(
        &self,
        store: &dyn SharedStore,
        worker: usize,
        d_inflight: i64,
        d_prefill: i64,
    ) -> bool {
        if worker >= self.workers {
            return false;
        }
        cas_update(store, &self.load_key, |bytes| {
            let mut loads = self.decode_loads(bytes);
            if let Some(load) = loads.get_mut(worker) {
                load.inflight = add_signed(u64::from(load.inflight), d_inflight)
                    .try_into()
                    .unwrap_or(u32::MAX);
                load.prefill_blocks = add_signed(load.prefill_blocks, d_prefill);
            }
            let mut out = Vec::with_capacity(self.workers * 12);
            for l in &loads {
                out.extend_from_slice(&l.inflight.to_le_bytes());
                out.extend_from_slice(&l.prefill_blocks.to_le_bytes());
            }
            out
        })
    }

    // ---- worker metrics and the poller lease -------------------------------------------

    /// Every worker's metrics entry.
    pub fn metrics(&self, store: &dyn SharedStore) -> Vec<MetricsEntry> {
        let bytes = match store.get(&self.metrics_key) {
            Ok(Some((bytes, _))) => bytes,
            _ => Vec::new(),
        };
        self.decode_metrics(&bytes)
    }

    fn decode_metrics(&self, bytes: &[u8]) -> Vec<MetricsEntry> {
        let mut out = vec![MetricsEntry::default(); self.workers];
        if bytes.len() != self.workers * METRICS_ENTRY {
            return out;
        }
        for (entry, c) in out.iter_mut().zip(bytes.chunks_exact(METRICS_ENTRY)) {
            let f = |at: usize| {
                c.get(at..at + 4)
                    .and_then(|b| b.try_into().ok())
                    .map(f32::from_le_bytes)
                    .map(f64::from)
                    .unwrap_or(0.0)
            };
            entry.failures = c
                .get(12..16)
                .and_then(|b| b.try_into().ok())
                .map(u32::from_le_bytes)
                .unwrap_or(0);
            entry.updated_ms = c
                .get(16..24)
                .and_then(|b| b.try_into().ok())
                .map(u64::from_le_bytes)
                .unwrap_or(0);
            if entry.updated_ms > 0 {
                entry.metrics = Some(WorkerMetrics {
                    waiting: f(0),
                    running: f(4),
                    kv_usage: f(8),
                });
            }
        }
        out
    }

    /// Records one poll of one worker: its metrics, or a failure (None). CAS loop as for loads.
    pub fn record_poll(
        &self,
        store: &dyn SharedStore,
        worker: usize,
        polled: Option<WorkerMetrics>,
        now_ms: u64,
    ) -> bool {
        if worker >= self.workers {
            return false;
        }
        cas_update(store, &self.metrics_key, |bytes| {
            let mut entries = self.decode_metrics(bytes);
            if let Some(e) = entries.get_mut(worker) {
                match polled {
                    Some(m) => {
                        e.metrics = Some(m);
                        e.updated_ms = now_ms.max(1);
                        e.failures = 0;
                    }
                    None => e.failures = e.failures.saturating_add(1),
                }
            }
            let mut out = Vec::with_capacity(self.workers * METRICS_ENTRY);
            for e in &entries {
                let m = e.metrics.unwrap_or_default();
                for v in [m.waiting, m.running, m.kv_usage] {
                    out.extend_from_slice(&(v as f32).to_le_bytes());
                }
                out.extend_from_slice(&e.failures.to_le_bytes());
                out.extend_from_slice(&e.updated_ms.to_le_bytes());
            }
            out
        })
    }

    /// Takes or renews the poller lease for `holder` until `now_ms + ttl_ms`. True when this
    /// holder has it: it was free, expired, or already this holder's.
    pub fn try_lease(
        &self,
        store: &dyn SharedStore,
        holder: u64,
        now_ms: u64,
        ttl_ms: u64,
    ) -> bool {
        let (current, cas) = match store.get(&self.lease_key) {
            Ok(Some((bytes, cas))) => (bytes, Some(cas)),
            Ok(None) => (Vec::new(), None),
            Err(_) => return false,
        };
        let read = |at: usize| {
            current
                .get(at..at + 8)
                .and_then(|b| b.try_into().ok())
                .map(u64::from_le_bytes)
        };
        if let (Some(owner), Some(expiry)) = (read(0), read(8))
            && owner != holder
            && expiry > now_ms
        {
            return false;
        }
        let mut value = holder.to_le_bytes().to_vec();
        value.extend_from_slice(&now_ms.saturating_add(ttl_ms).to_le_bytes());
        store.set(&self.lease_key, &value, cas).is_ok()
    }

    // ---- decision log ------------------------------------------------------------------

    fn head(&self, store: &dyn SharedStore) -> Result<(u64, Option<u32>), StoreError> {
        Ok(match store.get(&self.head_key)? {
            Some((bytes, cas)) => (
                bytes
                    .get(0..8)
                    .and_then(|b| b.try_into().ok())
                    .map(u64::from_le_bytes)
                    .unwrap_or(0),
                Some(cas),
            ),
            None => (0, None),
        })
    }

    /// Appends a decision; returns its sequence number.
    pub fn append(
        &self,
        store: &dyn SharedStore,
        worker: u32,
        time_ms: u64,
        keys: &[u64],
    ) -> Result<u64, StoreError> {
        let mut claimed = None;
        for _ in 0..CAS_RETRIES {
            let (head, cas) = self.head(store)?;
            match store.set(&self.head_key, &(head + 1).to_le_bytes(), cas) {
                Ok(()) => {
                    claimed = Some(head);
                    break;
                }
                Err(StoreError::CasMismatch) => continue,
                Err(e) => return Err(e),
            }
        }
        let seq = claimed.ok_or(StoreError::CasMismatch)?;
        let record = Record::encode(seq, worker, time_ms, keys);
        store.set(&self.slot_key(seq), &record, None)?;
        Ok(seq)
    }

    fn slot_key(&self, seq: u64) -> String {
        format!("{}{}", self.slot_prefix, seq % self.slots)
    }

    /// Where a new VM starts reading: the oldest record still in the ring.
    pub fn start_cursor(&self, store: &dyn SharedStore) -> u64 {
        self.head(store)
            .map(|(head, _)| head.saturating_sub(self.slots))
            .unwrap_or(0)
    }

    /// Replays the records from `*cursor` up to the head into `apply`, advancing the cursor.
    /// A record whose slot was already overwritten by a later lap is skipped; one not written
    /// yet (its writer claimed the number a moment ago, on another thread) stops the replay
    /// until the next call, unless the head is far past it (its writer died).
    pub fn replay(
        &self,
        store: &dyn SharedStore,
        cursor: &mut u64,
        mut apply: impl FnMut(&Record),
    ) -> SyncStats {
        let mut stats = SyncStats::default();
        let Ok((head, _)) = self.head(store) else {
            return stats;
        };
        if head.saturating_sub(*cursor) > self.slots {
            let from = head - self.slots;
            stats.skipped += from - *cursor;
            *cursor = from;
        }
        while *cursor < head {
            let seq = *cursor;
            let record = match store.get(&self.slot_key(seq)) {
                Ok(Some((bytes, _))) => Record::decode(&bytes),
                _ => None,
            };
            match record {
                Some(r) if r.seq == seq => {
                    apply(&r);
                    stats.applied += 1;
                }
                Some(r) if r.seq > seq => stats.skipped += 1,
                // Not written yet: wait for it unless the writer is long gone.
                _ if head - seq <= self.slots / 2 => break,
                _ => stats.skipped += 1,
            }
            *cursor += 1;
        }
        stats
    }
}

/// Read-modify-write of one key under CAS: `modify` maps the current value (empty when the key
/// does not exist) to the new one; on `CAS_MISMATCH` another VM wrote in between, so read
/// again and retry, up to [`CAS_RETRIES`] times. False when the retries ran out or the host
/// refused.
fn cas_update(
    store: &dyn SharedStore,
    key: &str,
    mut modify: impl FnMut(&[u8]) -> Vec<u8>,
) -> bool {
    for _ in 0..CAS_RETRIES {
        let (bytes, cas) = match store.get(key) {
            Ok(Some((bytes, cas))) => (bytes, Some(cas)),
            Ok(None) => (Vec::new(), None),
            Err(_) => return false,
        };
        match store.set(key, &modify(&bytes), cas) {
            Ok(()) => return true,
            Err(StoreError::CasMismatch) => continue,
            Err(StoreError::Host(_)) => return false,
        }
    }
    false
}

fn add_signed(v: u64, d: i64) -> u64 {
    if d >= 0 {
        v.saturating_add(d.unsigned_abs())
    } else {
        v.saturating_sub(d.unsigned_abs())
    }
}

/// Identifies a configuration's shared layout: the worker addresses in order and the log size.
pub fn generation(addresses: &[&str], log_slots: u32) -> u64 {
    let mut buf = Vec::new();
    for a in addresses {
        buf.extend_from_slice(a.as_bytes());
        buf.push(0);
    }
    buf.extend_from_slice(&log_slots.to_le_bytes());
    xxh3_64(&buf)
}

/// An in-memory [`SharedStore`] with Envoy's semantics (a CAS token per key that starts at 1
/// and skips 0 on wrap, checked only when the key exists), for tests and native hosts.
#[derive(Debug, Default)]
pub struct MemoryStore {
    map: std::cell::RefCell<std::collections::HashMap<String, (Vec<u8>, u32)>>,
}

impl SharedStore for MemoryStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        Ok(self.map.borrow().get(key).cloned())
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let mut map = self.map.borrow_mut();
        let next = match map.get(key) {
            Some((_, current)) => {
                if let Some(cas) = cas
                    && cas != *current
                {
                    return Err(StoreError::CasMismatch);
                }
                current.checked_add(1).unwrap_or(1)
            }
            None => 1,
        };
        map.insert(key.to_string(), (value.to_vec(), next));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_add_and_saturate() {
        let store = MemoryStore::default();
        let s = SharedState::new(1, 3, 8);
        assert_eq!(s.loads(&store), vec![WorkerLoad::default(); 3]);
        assert!(s.add_load(&store, 1, 1, 500));
        assert!(s.add_load(&store, 1, 1, 100));
        assert!(s.add_load(&store, 2, -1, -5));
        let loads = s.loads(&store);
        assert_eq!((loads[1].inflight, loads[1].prefill_blocks), (2, 600));
        assert_eq!((loads[2].inflight, loads[2].prefill_blocks), (0, 0));
        assert!(!s.add_load(&store, 3, 1, 0), "no such worker");
    }

    /// A store whose first `n` CAS writes fail, as if another VM wrote in between.
    struct Contended {
        inner: MemoryStore,
        fail: std::cell::Cell<usize>,
    }

    impl SharedStore for Contended {
        fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
            if cas.is_some() && self.fail.get() > 0 {
                self.fail.set(self.fail.get() - 1);
                // Another writer bumps the value first.
                let current = self.inner.get(key)?.map(|(v, _)| v).unwrap_or_default();
                self.inner.set(key, &current, None)?;
                return Err(StoreError::CasMismatch);
            }
            self.inner.set(key, value, cas)
        }
    }

    #[test]
    fn cas_mismatch_retries_without_losing_the_update() {
        let store = Contended {
            inner: MemoryStore::default(),
            fail: std::cell::Cell::new(0),
        };
        let s = SharedState::new(1, 2, 8);
        assert!(s.add_load(&store, 0, 1, 0));
        store.fail.set(5);
        assert!(s.add_load(&store, 0, 1, 0));
        assert_eq!(s.loads(&store)[0].inflight, 2);
        store.fail.set(CAS_RETRIES + 1);
        assert!(!s.add_load(&store, 0, 1, 0), "gives up after the retries");
    }

    #[test]
    fn log_replays_in_order_to_every_reader() {
        let store = MemoryStore::default();
        let s = SharedState::new(7, 2, 4);
        let (mut a, mut b) = (s.start_cursor(&store), 0u64);
        assert_eq!(s.append(&store, 1, 10, &[1, 2, 3]), Ok(0));
        assert_eq!(s.append(&store, 0, 11, &[9]), Ok(1));
        let mut seen_a = Vec::new();
        s.replay(&store, &mut a, |r| seen_a.push((r.worker, r.keys.clone())));
        assert_eq!(seen_a, vec![(1, vec![1, 2, 3]), (0, vec![9])]);
        let mut seen_b = Vec::new();
        s.replay(&store, &mut b, |r| seen_b.push((r.worker, r.keys.clone())));
        assert_eq!(seen_a, seen_b);
        // Nothing new: nothing applied.
        let stats = s.replay(&store, &mut a, |_| panic!("replayed twice"));
        assert_eq!(stats.applied, 0);
    }

    #[test]
    fn a_reader_that_falls_behind_skips_overwritten_records() {
        let store = MemoryStore::default();
        let s = SharedState::new(7, 2, 4);
        let mut cursor = 0;
        for i in 0..10u64 {
            assert_eq!(s.append(&store, 0, i, &[i]), Ok(i));
        }
        let mut seen = Vec::new();
        let stats = s.replay(&store, &mut cursor, |r| seen.push(r.keys[0]));
        assert_eq!(seen, vec![6, 7, 8, 9]);
        assert_eq!(stats.skipped, 6);
        assert_eq!(cursor, 10);
        assert_eq!(s.start_cursor(&store), 6);
    }

    #[test]
    fn an_unwritten_slot_waits_then_is_skipped() {
        let store = MemoryStore::default();
        let s = SharedState::new(7, 2, 8);
        // A writer claimed seq 0 but has not written its record.
        store
            .set(
                "mmrouter.0000000000000007.log.head",
                &1u64.to_le_bytes(),
                None,
            )
            .expect("set");
        let mut cursor = 0;
        let stats = s.replay(&store, &mut cursor, |_| {});
        assert_eq!((stats.applied, cursor), (0, 0), "waits for the record");
        for i in 1..8u64 {
            s.append(&store, 0, i, &[i]).expect("append");
        }
        let mut seen = Vec::new();
        s.replay(&store, &mut cursor, |r| seen.push(r.seq));
        assert_eq!(
            seen,
            (1..8).collect::<Vec<_>>(),
            "gives up on the dead writer"
        );
    }

    #[test]
    fn polls_are_recorded_and_failures_counted() {
        let store = MemoryStore::default();
        let s = SharedState::new(1, 2, 8);
        assert_eq!(s.metrics(&store), vec![MetricsEntry::default(); 2]);
        let m = WorkerMetrics {
            waiting: 3.0,
            running: 5.0,
            kv_usage: 0.5,
        };
        assert!(s.record_poll(&store, 1, Some(m), 1000));
        assert!(s.record_poll(&store, 0, None, 1000));
        assert!(s.record_poll(&store, 0, None, 1100));
        let e = s.metrics(&store);
        assert_eq!(e[1].metrics, Some(m));
        assert_eq!((e[1].updated_ms, e[1].failures), (1000, 0));
        assert_eq!((e[0].metrics, e[0].failures), (None, 2));
        assert!(s.record_poll(&store, 0, Some(m), 1200));
        assert_eq!(
            s.metrics(&store)[0].failures,
            0,
            "a good poll resets the count"
        );
    }

    #[test]
    fn one_poller_holds_the_lease_until_it_expires() {
        let store = MemoryStore::default();
        let s = SharedState::new(1, 2, 8);
        assert!(s.try_lease(&store, 11, 0, 100));
        assert!(!s.try_lease(&store, 22, 50, 100), "held by 11");
        assert!(s.try_lease(&store, 11, 90, 100), "11 renews");
        assert!(!s.try_lease(&store, 22, 150, 100), "renewed until 190");
        assert!(s.try_lease(&store, 22, 191, 100), "expired: 22 takes it");
        assert!(!s.try_lease(&store, 11, 200, 100));
    }

    #[test]
    fn records_round_trip_and_garbage_is_refused() {
        let bytes = Record::encode(5, 2, 99, &[u64::MAX, 0, 7]);
        let r = Record::decode(&bytes).expect("decodes");
        assert_eq!(
            (r.seq, r.worker, r.time_ms, r.keys),
            (5, 2, 99, vec![u64::MAX, 0, 7])
        );
        assert_eq!(Record::decode(&bytes[..bytes.len() - 1]), None);
        assert_eq!(Record::decode(b"short"), None);
    }
}
