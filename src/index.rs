//! Which blocks each worker is believed to hold.
//!
//! A request is a list of chained block keys ([`crate::layout`]): key `i` depends on keys
//! `0..i`, so "worker `w` holds the first `n` blocks" is checked key by key, stopping at the first
//! key `w` does not hold. The index keeps, per worker, the set of keys it is believed to hold,
//! fed from two sides:
//!
//! - the router's own decisions (*approximate*): [`PrefixIndex::insert`] when a request is
//!   routed; entries expire after [`IndexConfig::ttl_ms`] unless touched again, like Dynamo's
//!   approximate mode (120 s);
//! - an external precise source (the engine's KV events): [`PrefixIndex::insert_with_ttl`] with
//!   ttl 0 (no expiry), [`PrefixIndex::remove`], [`PrefixIndex::clear`].
//!
//! ## Structure
//! - A global hash map `key → holders`, the workers holding the key (sorted by worker, stored
//!   inline when there is one, the common case for request-specific blocks). Each holder is
//!   `(worker: u32, slot: u32, expires_at_ms: u64)`.
//! - Per worker, an LRU list of its keys: a slab of nodes `(key: u64, prev: u32, next: u32)`
//!   linked most-recent first, with a free list. Touching, inserting and evicting are O(1).
//!
//! [`PrefixIndex::match_prefix`] walks the request's keys and, for each, the holders of that
//! key, advancing the workers still matching; it stops when none is left. Its cost is
//! O(workers) to size the output plus the holders of the walked keys: linear in the request's
//! matched blocks, independent of how many blocks the index holds.
//!
//! ## Eviction order
//! [`PrefixIndex::insert`] touches a request's keys from the last to the first, so the first
//! block of a request is the most recently used and the tail of a request is evicted before its
//! head, as vLLM frees a finished request's blocks tail-first. Evicting a head block first would
//! make the whole rest of the chain unmatchable.
//!
//! ## Expiry
//! An entry inserted or touched at `t` with a ttl of `d > 0` ms is live while `now_ms < t + d`
//! and expired from `now_ms >= t + d` on (it matches at `t + d - 1`, not at `t + d`). A touch
//! never shortens an expiry (an entry pinned by the precise source stays pinned). Expired entries
//! do not match; they are reclaimed from the LRU end of a worker's list on every insert into that
//! worker, plus one other worker per insert in round-robin, and by [`PrefixIndex::expire`].
//! Reclamation is amortised O(1) per entry (each entry is reclaimed once).
//!
//! ## Memory bound
//! The number of entries (worker, key) never exceeds `workers × capacity_blocks`: inserting a
//! new key into a full worker first evicts that worker's least-recently used key. One entry
//! costs, on a 64-bit target:
//!
//! - 16 bytes of LRU node (slab grown in steps but never beyond `capacity_blocks` nodes);
//! - 16 bytes of holder, inline in the map value when the key has one holder, else in a
//!   sorted `Vec` (16 bytes per holder, up to twice that in spare capacity);
//! - per distinct key, one map slot of 32 bytes (key and value) + 1 control byte, at a load of
//!   between 7/16 and 7/8 (the table doubles), i.e. 38 to 76 bytes per distinct key.
//!
//! So with keys held by one worker each (request-specific blocks) an entry costs
//! 32 + 38..76 = **70 to 108 bytes**, and the bound is `workers × capacity_blocks × 108`
//! bytes (the default 65,536 blocks per worker is at most ~7 MiB per worker). Keys shared by
//! many workers (a system prompt) cost less per entry: 16 (node) + 16..32 (holder) + the map
//! slot shared by all holders. `benches/routing.rs` measures the real allocation with a
//! counting allocator (see docs/BENCHMARKS.md); [`PrefixIndex::approx_bytes`] reports the
//! same figure from the structures' capacities. No memory is reserved up front: a worker's
//! slab grows with its entries.
//!
//! ## Determinism
//! No randomness and no clock: time is always passed in as `now_ms` (any monotonic
//! millisecond clock; a clock that goes backwards only delays expiry). The map's hasher is a
//! fixed mix of the (already hashed) key.

use crate::config::ConfigError;
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::hash::{BuildHasherDefault, Hasher};

/// Largest accepted [`IndexConfig::capacity_blocks`]: slots are 32-bit.
pub const MAX_CAPACITY_BLOCKS: usize = 1 << 31;

/// Configuration of the [`PrefixIndex`].
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct IndexConfig {
    /// Most blocks remembered per worker (default 65,536 = 1 Mi tokens at 16 tokens per block,
    /// around the KV capacity of one large GPU for a mid-size model). Beyond it the worker's
    /// least-recently used block is forgotten. Must be 1..=2^31. Memory: up to ~108 bytes per
    /// block (see the module docs), so the default is at most ~7 MiB per worker.
    pub capacity_blocks: usize,
    /// Milliseconds after its last insert/touch that an entry stops matching (default 120,000,
    /// Dynamo's approximate-mode TTL: a block not reused for two minutes has likely been evicted
    /// by the engine under load). 0 = entries never expire (only capacity evicts them).
    pub ttl_ms: u64,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            capacity_blocks: 65536,
            ttl_ms: 120_000,
        }
    }
}

impl IndexConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=MAX_CAPACITY_BLOCKS).contains(&self.capacity_blocks) {
            return Err(ConfigError::new(
                "index.capacity_blocks",
                format!("must be 1..={MAX_CAPACITY_BLOCKS}"),
            ));
        }
        Ok(())
    }
}

const NIL: u32 = u32::MAX;
/// `expires_at_ms` of an entry that never expires.
const NEVER: u64 = u64::MAX;

/// Whether an entry expiring at `expires_at` is expired at `now_ms`.
#[inline]
fn expired(expires_at: u64, now_ms: u64) -> bool {
    expires_at != NEVER && now_ms >= expires_at
}

/// A hasher for keys that are already hashes (xxh3 or engine block hashes): a fixed
/// 128-bit folded multiply, so that even small integer keys spread over the table.
#[derive(Default, Clone, Copy)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Not used for u64 keys; a simple fallback keeps the trait total.
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, k: u64) {
        let m = u128::from(k ^ self.0) * 0x9E37_79B9_7F4A_7C15_u128;
        self.0 = (m as u64) ^ ((m >> 64) as u64);
    }
}

type KeyMap = HashMap<u64, Holders, BuildHasherDefault<KeyHasher>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holder {
    worker: u32,
    slot: u32,
    expires_at: u64,
}

/// The workers holding one key, sorted by worker.
#[derive(Debug, Clone)]
enum Holders {
    One(Holder),
    Many(Vec<Holder>),
}

impl Holders {
    fn as_slice(&self) -> &[Holder] {
        match self {
            Holders::One(h) => std::slice::from_ref(h),
            Holders::Many(v) => v,
        }
    }

    fn find_mut(&mut self, worker: u32) -> Option<&mut Holder> {
        match self {
            Holders::One(h) => (h.worker == worker).then_some(h),
            Holders::Many(v) => match v.binary_search_by_key(&worker, |h| h.worker) {
                Ok(i) => v.get_mut(i),
                Err(_) => None,
            },
        }
    }

    fn find(&self, worker: u32) -> Option<&Holder> {
        let s = self.as_slice();
        match s.binary_search_by_key(&worker, |h| h.worker) {
            Ok(i) => s.get(i),
            Err(_) => None,
        }
    }

    /// Adds `h` (whose worker is not present). Returns the change in spilled capacity.
    fn add(&mut self, h: Holder) -> isize {
        match self {
            Holders::One(first) => {
                let first = *first;
                let mut v = Vec::with_capacity(2);
                if first.worker < h.worker {
                    v.push(first);
                    v.push(h);
                } else {
                    v.push(h);
                    v.push(first);
                }
                let cap = v.capacity() as isize;
                *self = Holders::Many(v);
                cap
            }
            Holders::Many(v) => {
                let before = v.capacity() as isize;
                let pos = v.partition_point(|x| x.worker < h.worker);
                v.insert(pos, h);
                v.capacity() as isize - before
            }
        }
    }

    /// Removes `worker`'s holder. Returns (removed holder, now empty, change in spilled
    /// capacity).
    fn remove(&mut self, worker: u32) -> (Option<Holder>, bool, isize) {
        match self {
            Holders::One(h) => {
                if h.worker == worker {
                    (Some(*h), true, 0)
                } else {
                    (None, false, 0)
                }
            }
            Holders::Many(v) => {
                let before = v.capacity() as isize;
                let Ok(i) = v.binary_search_by_key(&worker, |h| h.worker) else {
                    return (None, v.is_empty(), 0);
                };
                let removed = v.remove(i);
                if v.len() == 1 {
                    let only = v.first().copied();
                    if let Some(only) = only {
                        *self = Holders::One(only);
                        return (Some(removed), false, -before);
                    }
                }
                if v.capacity() > 8 && v.len() * 4 < v.capacity() {
                    v.shrink_to(v.len() * 2);
                }
                let after = v.capacity() as isize;
                (Some(removed), v.is_empty(), after - before)
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Node {
    key: u64,
    prev: u32,
    next: u32,
}

/// One worker's keys, most-recently used first.
#[derive(Debug, Clone)]
struct Lru {
    nodes: Vec<Node>,
    head: u32,
    tail: u32,
    free: u32,
    len: usize,
}

impl Default for Lru {
    fn default() -> Self {
        Lru {
            nodes: Vec::new(),
            head: NIL,
            tail: NIL,
            free: NIL,
            len: 0,
        }
    }
}

impl Lru {
    fn node(&self, slot: u32) -> Option<&Node> {
        self.nodes.get(slot as usize)
    }

    fn unlink(&mut self, slot: u32) {
        let Some(&Node { prev, next, .. }) = self.node(slot) else {
            return;
        };
        match self.nodes.get_mut(prev as usize) {
            Some(p) => p.next = next,
            None => self.head = next,
        }
        match self.nodes.get_mut(next as usize) {
            Some(n) => n.prev = prev,
            None => self.tail = prev,
        }
    }

    fn link_front(&mut self, slot: u32) {
        let head = self.head;
        if let Some(n) = self.nodes.get_mut(slot as usize) {
            n.prev = NIL;
            n.next = head;
        }
        match self.nodes.get_mut(head as usize) {
            Some(h) => h.prev = slot,
            None => self.tail = slot,
        }
        self.head = slot;
    }

    fn move_to_front(&mut self, slot: u32) {
        if self.head != slot {
            self.unlink(slot);
            self.link_front(slot);
        }
    }

    /// Stores `key` in a free slot at the front. `capacity` bounds the slab's growth.
    fn push_front(&mut self, key: u64, capacity: usize) -> Option<u32> {
        let slot = if self.free != NIL {
            let slot = self.free;
            self.free = self.node(slot).map_or(NIL, |n| n.next);
            if let Some(n) = self.nodes.get_mut(slot as usize) {
                n.key = key;
            }
            slot
        } else {
            let len = self.nodes.len();
            let slot = u32::try_from(len).ok().filter(|&s| s != NIL)?;
            if len == self.nodes.capacity() {
                // Grow geometrically, but never past `capacity` nodes.
                let room = capacity.saturating_sub(len).max(1);
                self.nodes.reserve_exact(len.max(16).min(room));
            }
            self.nodes.push(Node {
                key,
                prev: NIL,
                next: NIL,
            });
            slot
        };
        self.link_front(slot);
        self.len += 1;
        Some(slot)
    }

    /// Unlinks `slot` and puts it on the free list.
    fn release(&mut self, slot: u32) {
        self.unlink(slot);
        let free = self.free;
        if let Some(n) = self.nodes.get_mut(slot as usize) {
            n.prev = NIL;
            n.next = free;
            self.free = slot;
            self.len = self.len.saturating_sub(1);
        }
    }
}

/// Per-worker sets of block keys with LRU capacity and TTL; see the module docs.
#[derive(Debug, Clone)]
pub struct PrefixIndex {
    config: IndexConfig,
    map: KeyMap,
    workers: Vec<Lru>,
    entries: usize,
    /// Capacity (in holders) of the spilled holder vectors, for [`PrefixIndex::approx_bytes`].
    spilled: usize,
    /// Round-robin cursor of the expiry sweep.
    sweep: usize,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        PrefixIndex::new(IndexConfig::default(), 0)
    }
}

impl PrefixIndex {
    /// An empty index for `workers` workers (ids `0..workers`). Nothing is reserved up front.
    pub fn new(config: IndexConfig, workers: usize) -> PrefixIndex {
        let mut index = PrefixIndex {
            config,
            map: KeyMap::default(),
            workers: Vec::new(),
            entries: 0,
            spilled: 0,
            sweep: 0,
        };
        index.set_workers(workers);
        index
    }

    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// Number of workers (valid ids are `0..workers()`).
    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    /// Entries held for `worker` (0 for an unknown worker). Includes expired entries not yet
    /// reclaimed.
    pub fn blocks(&self, worker: usize) -> usize {
        self.workers.get(worker).map_or(0, |l| l.len)
    }

    /// Total (worker, key) entries; never above `workers() × capacity_blocks`.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Distinct keys held by at least one worker.
    pub fn keys(&self) -> usize {
        self.map.len()
    }

    /// Bytes allocated by the index, computed from the capacities of its structures (hash
    /// table buckets and control bytes, LRU slabs, spilled holder vectors). Allocator overhead
    /// is not included.
    pub fn approx_bytes(&self) -> usize {
        let map_cap = self.map.capacity();
        let buckets = if map_cap == 0 {
            0
        } else if map_cap < 8 {
            (map_cap + 1).next_power_of_two()
        } else {
            (map_cap.saturating_mul(8) / 7).next_power_of_two()
        };
        let map_bytes =
            buckets * (size_of::<(u64, Holders)>() + 1) + if buckets > 0 { 16 } else { 0 };
        let slabs: usize = self
            .workers
            .iter()
            .map(|l| l.nodes.capacity() * size_of::<Node>())
            .sum();
        map_bytes
            + slabs
            + self.workers.capacity() * size_of::<Lru>()
            + self.spilled * size_of::<Holder>()
    }

    /// Resizes to `n` workers. Workers `0..min(n, old)` keep their state; removed workers'
    /// entries are dropped.
    pub fn set_workers(&mut self, n: usize) {
        let n = n.min(NIL as usize);
        while self.workers.len() > n {
            let last = self.workers.len() - 1;
            self.clear(last);
            self.workers.pop();
        }
        self.workers.resize_with(n, Lru::default);
        if self.sweep >= n {
            self.sweep = 0;
        }
        self.maybe_shrink_map();
    }

    /// Records that `worker` holds `keys` from `now_ms` for the configured ttl: adds missing
    /// keys, refreshes present ones (recency and expiry). Keys are touched last to first, so a
    /// request's head outlives its tail. An unknown worker is ignored.
    pub fn insert(&mut self, worker: usize, keys: &[u64], now_ms: u64) {
        self.insert_with_ttl(worker, keys, now_ms, self.config.ttl_ms);
    }

    /// [`PrefixIndex::insert`] with an explicit ttl (0 = never expires, for a precise source
    /// such as the engine's KV events, which later sends removals).
    pub fn insert_with_ttl(&mut self, worker: usize, keys: &[u64], now_ms: u64, ttl_ms: u64) {
        if worker >= self.workers.len() || self.config.capacity_blocks == 0 {
            return;
        }
        let expires_at = if ttl_ms == 0 {
            NEVER
        } else {
            now_ms.saturating_add(ttl_ms)
        };
        self.reclaim_expired(worker, now_ms);
        if !self.workers.is_empty() {
            let other = self.sweep % self.workers.len();
            self.sweep = (other + 1) % self.workers.len();
            if other != worker {
                self.reclaim_expired(other, now_ms);
            }
        }
        for &key in keys.iter().rev() {
            self.touch(worker, key, expires_at);
        }
    }

    fn touch(&mut self, worker: usize, key: u64, expires_at: u64) {
        let w = worker as u32;
        if let Some(holder) = self.map.get_mut(&key).and_then(|h| h.find_mut(w)) {
            holder.expires_at = holder.expires_at.max(expires_at);
            let slot = holder.slot;
            if let Some(lru) = self.workers.get_mut(worker) {
                lru.move_to_front(slot);
            }
            return;
        }
        let capacity = self.config.capacity_blocks;
        while self.blocks(worker) >= capacity {
            if !self.evict_tail(worker) {
                return;
            }
        }
        let Some(lru) = self.workers.get_mut(worker) else {
            return;
        };
        let Some(slot) = lru.push_front(key, capacity) else {
            return;
        };
        let holder = Holder {
            worker: w,
            slot,
            expires_at,
        };
        match self.map.entry(key) {
            Entry::Occupied(mut holders) => {
                let delta = holders.get_mut().add(holder);
                self.spilled = self.spilled.saturating_add_signed(delta);
            }
            Entry::Vacant(slot) => {
                slot.insert(Holders::One(holder));
            }
        }
        self.entries += 1;
    }

    /// Drops `worker`'s least-recently used entry. False if it has none.
    fn evict_tail(&mut self, worker: usize) -> bool {
        let Some(lru) = self.workers.get(worker) else {
            return false;
        };
        let tail = lru.tail;
        let Some(key) = lru.node(tail).map(|n| n.key) else {
            return false;
        };
        self.drop_entry(worker, key, tail);
        true
    }

    /// Removes the entry (worker, key) stored in `slot`, from the map and the LRU.
    fn drop_entry(&mut self, worker: usize, key: u64, slot: u32) {
        if let Some(holders) = self.map.get_mut(&key) {
            let (_, empty, delta) = holders.remove(worker as u32);
            self.spilled = self.spilled.saturating_add_signed(delta);
            if empty {
                self.map.remove(&key);
            }
        }
        if let Some(lru) = self.workers.get_mut(worker) {
            lru.release(slot);
        }
        self.entries = self.entries.saturating_sub(1);
    }

    /// Reclaims `worker`'s expired entries from its LRU end. Returns how many.
    fn reclaim_expired(&mut self, worker: usize, now_ms: u64) -> usize {
        let mut n = 0;
        loop {
            let Some(lru) = self.workers.get(worker) else {
                return n;
            };
            let tail = lru.tail;
            let Some(key) = lru.node(tail).map(|node| node.key) else {
                return n;
            };
            let expires_at = self
                .map
                .get(&key)
                .and_then(|h| h.find(worker as u32))
                .map_or(0, |h| h.expires_at);
            if !expired(expires_at, now_ms) {
                return n;
            }
            self.drop_entry(worker, key, tail);
            n += 1;
        }
    }

    /// Reclaims expired entries of every worker (from each LRU end, stopping at the first live
    /// entry). Returns how many were dropped. Cost: O(workers + dropped).
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let n = (0..self.workers.len())
            .map(|w| self.reclaim_expired(w, now_ms))
            .sum();
        self.maybe_shrink_map();
        n
    }

    /// Forgets that `worker` holds `keys` (e.g. the engine evicted them). Unknown keys and
    /// workers are ignored.
    pub fn remove(&mut self, worker: usize, keys: &[u64]) {
        if worker >= self.workers.len() {
            return;
        }
        for &key in keys {
            let slot = self
                .map
                .get(&key)
                .and_then(|h| h.find(worker as u32))
                .map(|h| h.slot);
            if let Some(slot) = slot {
                self.drop_entry(worker, key, slot);
            }
        }
    }

    /// Forgets everything `worker` holds (e.g. the engine cleared its cache or restarted).
    pub fn clear(&mut self, worker: usize) {
        let Some(lru) = self.workers.get_mut(worker) else {
            return;
        };
        let old = std::mem::take(lru);
        let mut slot = old.head;
        let mut dropped = 0usize;
        while let Some(node) = old.node(slot) {
            if let Some(holders) = self.map.get_mut(&node.key) {
                let (_, empty, delta) = holders.remove(worker as u32);
                self.spilled = self.spilled.saturating_add_signed(delta);
                if empty {
                    self.map.remove(&node.key);
                }
            }
            dropped += 1;
            slot = node.next;
        }
        self.entries = self.entries.saturating_sub(dropped);
        self.maybe_shrink_map();
    }

    /// Releases hash-table memory after large removals.
    fn maybe_shrink_map(&mut self) {
        if self.map.capacity() > 1024 && self.map.len() * 4 < self.map.capacity() {
            self.map.shrink_to(self.map.len() * 2);
        }
    }

    /// Longest live prefix of `keys` held by each worker: `out[w]` = number of leading keys
    /// worker `w` holds (stopping at its first miss), for `w` in `0..workers()`. Returns the
    /// largest of them. Expired entries do not match.
    pub fn match_prefix(&self, keys: &[u64], now_ms: u64, out: &mut Vec<usize>) -> usize {
        out.clear();
        out.resize(self.workers.len(), 0);
        let mut best = 0;
        for (i, key) in keys.iter().enumerate() {
            let Some(holders) = self.map.get(key) else {
                break;
            };
            let mut advanced = 0usize;
            for h in holders.as_slice() {
                if expired(h.expires_at, now_ms) {
                    continue;
                }
                if let Some(count) = out.get_mut(h.worker as usize)
                    && *count == i
                {
                    *count = i + 1;
                    advanced += 1;
                }
            }
            if advanced == 0 {
                break;
            }
            best = i + 1;
        }
        best
    }

    /// Checks the internal invariants (map and LRU lists agree, counts, bounds). O(entries);
    /// for tests and debugging. Returns a description of the first violation.
    pub fn check_consistency(&self) -> Result<(), String> {
        let mut total = 0usize;
        for (w, lru) in self.workers.iter().enumerate() {
            if lru.len > self.config.capacity_blocks {
                return Err(format!("worker {w}: {} entries over capacity", lru.len));
            }
            if lru.nodes.capacity() > self.config.capacity_blocks.max(16) {
                return Err(format!(
                    "worker {w}: slab capacity {}",
                    lru.nodes.capacity()
                ));
            }
            let mut slot = lru.head;
            let mut prev = NIL;
            let mut n = 0usize;
            while let Some(node) = lru.node(slot) {
                if node.prev != prev {
                    return Err(format!("worker {w}: broken prev link at slot {slot}"));
                }
                let h = self
                    .map
                    .get(&node.key)
                    .and_then(|h| h.find(w as u32))
                    .ok_or_else(|| format!("worker {w}: key {:#x} not in map", node.key))?;
                if h.slot != slot {
                    return Err(format!("worker {w}: key {:#x} slot mismatch", node.key));
                }
                n += 1;
                if n > lru.len {
                    return Err(format!("worker {w}: list longer than len"));
                }
                prev = slot;
                slot = node.next;
            }
            if prev != lru.tail || n != lru.len {
                return Err(format!(
                    "worker {w}: tail/len mismatch ({n} vs {})",
                    lru.len
                ));
            }
            total += n;
        }
        if total != self.entries {
            return Err(format!("entries {} but lists hold {total}", self.entries));
        }
        let mut holders = 0usize;
        let mut spilled = 0usize;
        for holder_set in self.map.values() {
            let s = holder_set.as_slice();
            if s.is_empty() {
                return Err("empty holder set".to_string());
            }
            if s.windows(2)
                .any(|p| matches!(p, [a, b] if a.worker >= b.worker))
            {
                return Err("holders not sorted".to_string());
            }
            if let Holders::Many(v) = holder_set {
                spilled += v.capacity();
            }
            holders += s.len();
        }
        if holders != total {
            return Err(format!("map holds {holders} holders, lists {total}"));
        }
        if spilled != self.spilled {
            return Err(format!("spilled {} tracked as {}", spilled, self.spilled));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holder_set_stays_sorted_and_collapses_to_one() {
        let h = |worker| Holder {
            worker,
            slot: 0,
            expires_at: NEVER,
        };
        let mut set = Holders::One(h(5));
        set.add(h(2));
        set.add(h(9));
        set.add(h(7));
        let workers: Vec<u32> = set.as_slice().iter().map(|h| h.worker).collect();
        assert_eq!(workers, vec![2, 5, 7, 9]);
        assert_eq!(set.remove(4).0, None);
        set.remove(2);
        set.remove(9);
        set.remove(5);
        assert!(matches!(set, Holders::One(Holder { worker: 7, .. })));
        assert!(set.remove(7).1);
    }

    #[test]
    fn slab_reuses_freed_slots() {
        let mut index = PrefixIndex::new(
            IndexConfig {
                capacity_blocks: 4,
                ttl_ms: 0,
            },
            1,
        );
        for round in 0..100u64 {
            index.insert(0, &[round * 10, round * 10 + 1, round * 10 + 2], 0);
        }
        assert_eq!(index.blocks(0), 4);
        assert!(index.workers.first().is_some_and(|l| l.nodes.len() <= 4));
        index.check_consistency().unwrap();
    }

    #[test]
    fn approx_bytes_counts_structures() {
        let mut index = PrefixIndex::new(IndexConfig::default(), 2);
        assert!(index.approx_bytes() < 1024);
        let keys: Vec<u64> = (0..1000).collect();
        index.insert(0, &keys, 0);
        let one = index.approx_bytes();
        assert!(one >= 1000 * (16 + 33), "{one}");
        index.insert(1, &keys, 0);
        assert!(index.approx_bytes() >= one + 1000 * (16 + 16));
    }
}
