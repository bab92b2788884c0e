//! The state plane: what the router knows about the workers, kept ONCE per Envoy process in
//! proxy-wasm shared data and read by every VM (one per Envoy worker thread).
//!
//! proxy-wasm shared data is a process-wide key-value store: every `get` copies the value into
//! the VM, every `set` may carry a CAS token that is checked only when the key exists, and no
//! key can ever be removed. So the state lives in a fixed key space of small values:
//!
//! | key | what | written by | read by |
//! |---|---|---|---|
//! | `<ns>.members` | worker slots: name, address, active ([`workers`]) | the state writer | every VM, when its version moves |
//! | `<ns>.live` | per slot: allocation clock, capacity, health, engine metrics, footprint ([`workers`]) | the state writer | every request |
//! | `<ns>.load` | per slot: requests in flight, prefill queue clock, new blocks not yet stored ([`load`]) | every VM, CAS | every request |
//! | `<ns>.b.<i>` | block buckets: router block key → holders ([`blocks`]) | the state writer | O(log n) per request ([`lookup`]) |
//! | `<ns>.i.<i>` | image buckets: image key → holders with resident block counts ([`images`]) | the state writer (precise mode) | per image in the matched prefix |
//! | `<ns>.u.<i>` | URL cache: image URL → content id and size, a failure, or an in-flight marker ([`urls`]) | every VM, CAS (filters with `fetch` on) | per fetchable image URL |
//! | `<ns>.homes` | the worker each request group (shared preamble) is kept on, with `scoring.home_hold` ([`homes`]) | every VM, CAS | every request with a preamble |
//! | `<ns>.lease` | which VM is the state writer ([`lease`]) | any VM, CAS | the writer's tick |
//! | queue `<ns>.decisions` | routing decisions waiting to be applied ([`decisions`]) | every VM, one enqueue per request | the state writer |
//!
//! **One writer.** One VM per process holds the lease (taken by CAS, renewed on its tick,
//! taken over when its holder stops renewing). Only that VM writes the block and image buckets
//! and the worker tables: it drains the decision queue, applies the sidecar's feed (precise
//! mode) or its own `/metrics` polls (approximate mode). Requests only read, plus one enqueue
//! and the CAS updates of the small load table. There is no per-VM copy of the prefix state
//! and no per-VM replay of a log.
//!
//! **Eviction without a global LRU list.** Each worker slot has an *allocation clock*: the
//! number of blocks the worker has allocated so far (new blocks of the requests routed to it in
//! approximate mode, the engine's own `BlockStored` count in precise mode). A holder entry
//! records the clock when the worker last touched that block. The holder is valid while fewer
//! than `capacity` blocks were allocated since: `clock - stamp < capacity`. That is vLLM's
//! block pool LRU (a cached block is evicted once `capacity` newer blocks have taken the free
//! queue's head) evaluated lazily at read time, per worker, with each worker's own capacity
//! (`vllm:cache_config_info` `num_gpu_blocks`). A cleared cache or a reused slot moves the
//! clock by more than the capacity, which invalidates every old entry at once.
//!
//! **First writes.** Envoy checks a CAS token only when the key exists, so two VMs that both
//! find a key missing can both write it. Keys written by several VMs (the load table, the
//! lease) are created with their initial value in `on_configure`, before any traffic, where
//! concurrent creators write the same bytes; after that every write is a CAS on an existing
//! key. Buckets have one writer; a bucket first written during a lease hand-over can lose one
//! writer's entries, which only makes the approximate state forget a few blocks.

pub mod blocks;
pub mod decisions;
pub mod homes;
pub mod images;
pub mod lease;
pub mod load;
pub mod lookup;
pub mod urls;
pub(crate) mod wire;
pub mod workers;
pub mod writer;

use crate::config_error::ConfigError;
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};

/// The state plane's sizes and periods (the `state` object of the filter configuration).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct StateConfig {
    pub blocks: blocks::BlocksConfig,
    pub images: images::ImagesConfig,
    /// KV capacity assumed for a worker, in router blocks, until its metrics report
    /// `num_gpu_blocks` (default 16384).
    pub capacity_blocks: u32,
    /// Most workers at once (default 1024, at most 4096).
    pub max_workers: usize,
    /// Most block keys of one request that are matched and recorded (default 8192: 131k
    /// tokens at 16 per block); a longer prompt is matched on its head.
    pub max_record_blocks: u32,
    /// Bucket reads per lookup at most (default 0: 2 + 4·log2(blocks)).
    pub max_probes: u32,
    /// The writer's tick, ms (default 20): how soon a decision is visible to other VMs.
    pub tick_ms: u64,
    /// The writer's lease, ms (default 1000): how long a stuck writer blocks the others.
    pub lease_ms: u64,
    /// Decisions applied per tick at most (default 20000).
    pub drain_max: usize,
}

impl Default for StateConfig {
    fn default() -> Self {
        StateConfig {
            blocks: blocks::BlocksConfig::default(),
            images: images::ImagesConfig::default(),
            capacity_blocks: 16384,
            max_workers: 1024,
            max_record_blocks: 8192,
            max_probes: 0,
            tick_ms: 20,
            lease_ms: 1000,
            drain_max: 20_000,
        }
    }
}

impl StateConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.blocks.validate()?;
        self.images.validate()?;
        if self.capacity_blocks == 0 {
            return Err(ConfigError::new("state.capacity_blocks", "must be > 0"));
        }
        if !(1..=workers::MAX_SLOTS).contains(&self.max_workers) {
            return Err(ConfigError::new("state.max_workers", "must be 1..=4096"));
        }
        if !(1..=1 << 16).contains(&self.max_record_blocks) {
            return Err(ConfigError::new(
                "state.max_record_blocks",
                "must be 1..=65536",
            ));
        }
        if self.tick_ms == 0 || self.lease_ms <= self.tick_ms {
            return Err(ConfigError::new(
                "state.lease_ms",
                "tick_ms must be > 0 and lease_ms longer than tick_ms",
            ));
        }
        if self.drain_max == 0 {
            return Err(ConfigError::new("state.drain_max", "must be > 0"));
        }
        Ok(())
    }

    /// The namespace of the keys: changes with the value layouts.
    pub fn namespace(&self, block_size: usize) -> u64 {
        let text = format!(
            "v1/{}/{}/{}/{}/{}/{block_size}",
            self.blocks.buckets,
            self.blocks.bucket_entries,
            self.blocks.max_holders,
            self.images.buckets,
            self.images.bucket_entries
        );
        xxhash_rust::xxh3::xxh3_64(text.as_bytes())
    }
}

/// Why a shared-data operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreError {
    /// The CAS token was stale: another VM wrote the key in between.
    CasMismatch,
    /// Any other host status (its numeric code).
    Host(u32),
}

/// proxy-wasm shared data and shared queues, as the router uses them.
pub trait SharedStore {
    /// The value and its CAS token, or None when the key does not exist.
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError>;
    /// Writes a value; with `cas`, only if the key's token still equals it (or the key does
    /// not exist, as in Envoy).
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError>;
    /// Appends to a shared queue (created on first use).
    fn enqueue(&self, queue: &str, value: &[u8]) -> Result<(), StoreError>;
    /// Takes the oldest item of a shared queue, None when it is empty.
    fn dequeue(&self, queue: &str) -> Result<Option<Vec<u8>>, StoreError>;
}

/// How many times a CAS loop retries before giving up (and counting a lost update).
pub const CAS_RETRIES: usize = 64;

/// Read-modify-write of one key under CAS: `modify` maps the current value (empty when the key
/// does not exist) to the new one, or None to leave the key as it is; on `CAS_MISMATCH`
/// another VM wrote in between, so read again and retry, up to [`CAS_RETRIES`] times.
/// Returns whether the update was applied (true also when `modify` chose not to write).
pub fn cas_update(
    store: &dyn SharedStore,
    key: &str,
    mut modify: impl FnMut(&[u8]) -> Option<Vec<u8>>,
) -> bool {
    for _ in 0..CAS_RETRIES {
        let (bytes, cas) = match store.get(key) {
            Ok(Some((bytes, cas))) => (bytes, Some(cas)),
            Ok(None) => (Vec::new(), None),
            Err(_) => return false,
        };
        let Some(next) = modify(&bytes) else {
            return true;
        };
        match store.set(key, &next, cas) {
            Ok(()) => return true,
            Err(StoreError::CasMismatch) => continue,
            Err(StoreError::Host(_)) => return false,
        }
    }
    false
}

/// Creates `key` with `initial` if it does not exist yet (see "First writes" above).
pub fn ensure_key(store: &dyn SharedStore, key: &str, initial: &[u8]) -> bool {
    match store.get(key) {
        Ok(Some(_)) => true,
        Ok(None) => store.set(key, initial, None).is_ok(),
        Err(_) => false,
    }
}

/// The names of one configuration's keys. `namespace` changes with everything that changes the
/// layout of the values (bucket counts, block size), so a reconfigured filter never reads
/// another layout's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    pub fn new(namespace: u64) -> Keys {
        Keys {
            prefix: format!("mmrouter.{namespace:016x}"),
        }
    }

    pub fn members(&self) -> String {
        format!("{}.members", self.prefix)
    }

    pub fn live(&self) -> String {
        format!("{}.live", self.prefix)
    }

    pub fn load(&self) -> String {
        format!("{}.load", self.prefix)
    }

    pub fn lease(&self) -> String {
        format!("{}.lease", self.prefix)
    }

    pub fn block_bucket(&self, index: u32) -> String {
        format!("{}.b.{index}", self.prefix)
    }

    pub fn image_bucket(&self, index: u32) -> String {
        format!("{}.i.{index}", self.prefix)
    }

    pub fn url_bucket(&self, index: u32) -> String {
        format!("{}.u.{index}", self.prefix)
    }

    pub fn homes(&self) -> String {
        format!("{}.homes", self.prefix)
    }

    pub fn decisions(&self) -> String {
        format!("{}.decisions", self.prefix)
    }
}

/// An in-memory [`SharedStore`] with Envoy's semantics (a CAS token per key that starts at 1
/// and skips 0 on wrap, checked only when the key exists; unbounded FIFO queues), for native
/// hosts, benchmarks and tests. Single-threaded, like one proxy-wasm host call at a time.
#[derive(Debug, Default)]
pub struct MemoryStore {
    map: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    queues: RefCell<HashMap<String, VecDeque<Vec<u8>>>>,
}

impl MemoryStore {
    /// Total bytes of every value held (keys not counted): the process-wide footprint.
    pub fn value_bytes(&self) -> usize {
        self.map.borrow().values().map(|(v, _)| v.len()).sum()
    }

    /// Number of keys.
    pub fn keys(&self) -> usize {
        self.map.borrow().len()
    }
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
                    && cas != 0
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

    fn enqueue(&self, queue: &str, value: &[u8]) -> Result<(), StoreError> {
        self.queues
            .borrow_mut()
            .entry(queue.to_string())
            .or_default()
            .push_back(value.to_vec());
        Ok(())
    }

    fn dequeue(&self, queue: &str) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self
            .queues
            .borrow_mut()
            .get_mut(queue)
            .and_then(VecDeque::pop_front))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cas_is_checked_only_when_the_key_exists() {
        let s = MemoryStore::default();
        s.set("k", b"a", Some(7))
            .expect("missing key: CAS not checked");
        let (_, cas) = s.get("k").expect("get").expect("present");
        assert_eq!(
            s.set("k", b"b", Some(cas + 1)),
            Err(StoreError::CasMismatch)
        );
        s.set("k", b"b", Some(cas)).expect("right token");
        assert_eq!(
            s.get("k").expect("get").map(|(v, _)| v),
            Some(b"b".to_vec())
        );
    }

    #[test]
    fn cas_update_retries_after_a_concurrent_write() {
        let s = MemoryStore::default();
        s.set("n", &[0], None).expect("set");
        let mut first = true;
        let ok = cas_update(&s, "n", |bytes| {
            if first {
                first = false;
                // Another VM writes between our read and our write.
                s.set("n", &[10], None).expect("set");
            }
            Some(vec![bytes.first().copied().unwrap_or(0) + 1])
        });
        assert!(ok);
        assert_eq!(s.get("n").expect("get").map(|(v, _)| v), Some(vec![11]));
    }

    #[test]
    fn queues_are_fifo_per_name() {
        let s = MemoryStore::default();
        s.enqueue("q", b"1").expect("enqueue");
        s.enqueue("q", b"2").expect("enqueue");
        s.enqueue("r", b"x").expect("enqueue");
        assert_eq!(s.dequeue("q"), Ok(Some(b"1".to_vec())));
        assert_eq!(s.dequeue("q"), Ok(Some(b"2".to_vec())));
        assert_eq!(s.dequeue("q"), Ok(None));
        assert_eq!(s.dequeue("r"), Ok(Some(b"x".to_vec())));
    }
}
