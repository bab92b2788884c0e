//! Prefix caching as vLLM v1 does it: chained block hashes and a block pool with LRU eviction.
//!
//! Emulates, independently of the router's `src/layout.rs` (the mock stands for the engine):
//!
//! - `vllm/v1/core/kv_cache_utils.py` `hash_block_tokens(parent, tokens, extra_keys)`: a full
//!   block's hash covers its parent's hash (a fixed root for the first block), its token ids and
//!   its extra keys: one `("mm", identifier, offset - block_start)` for every image whose
//!   placeholder range overlaps the block, then `("cache_salt", salt)` on the first block only.
//!   Only full blocks are hashed. The hash function is xxh3-128 over a length-framed byte
//!   encoding (vLLM's `--prefix-caching-hash-algo xxhash` is xxh3-128 over pickle bytes; the
//!   exact bytes differ, the structure is the same). [`BlockHash::event_id`] gives the low 64
//!   bits, as vLLM puts int block hashes in its KV events.
//! - `vllm/v1/core/block_pool.py`: a fixed number of blocks; a free queue ordered for eviction
//!   (least recently freed first) that also holds cached blocks nobody references; a map from
//!   hash to cached block. Taking a block from the free queue evicts its cached content. A
//!   finished request's blocks are freed in reverse order, so the tail of a sequence is evicted
//!   before its head, as in vLLM. Referenced blocks (of running requests) are never evicted.
//!
//! ## Hook for KV events
//! Every place where a block's content enters or leaves the cache goes through
//! [`KvEventSink`]: [`KvEventSink::blocks_stored`] with everything vLLM's `BlockStored` carries
//! (hashes, parent hash, token ids, block size, extra keys) and [`KvEventSink::blocks_removed`]
//! with the evicted hashes (`BlockRemoved`), and [`KvEventSink::all_blocks_cleared`] when
//! [`BlockPool::reset_prefix_cache`] forgets everything (`AllBlocksCleared`). The pool counts
//! stored and removed blocks itself; `kv_publisher::ZmqSink` publishes them over ZMQ.

use std::collections::{BTreeMap, HashMap};
use xxhash_rust::xxh3::{Xxh3, xxh3_128};

/// The hash of one full block (xxh3-128).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

impl BlockHash {
    /// The id KV events carry: the low 64 bits, like vLLM's int block hashes
    /// (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`).
    pub fn event_id(self) -> u64 {
        self.0 as u64
    }
}

/// The parent of a request's first block (vLLM's `NONE_HASH`; fixed here, where vLLM's is
/// random per process unless `PYTHONHASHSEED` is set).
pub fn none_hash() -> BlockHash {
    BlockHash(xxh3_128(b"mock-worker/none-hash"))
}

/// One extra key of a block, as in vLLM's `generate_block_hash_extra_keys`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtraKey {
    /// A multimodal item overlapping the block: its identifier and its placeholder start
    /// minus the block start (0, -16, -32, ... for an item spanning blocks).
    Mm { identifier: String, offset: i64 },
    /// The request's `cache_salt` (first block only).
    CacheSalt(String),
}

/// A multimodal item's placeholder range in the token sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MmRange {
    pub identifier: String,
    /// First placeholder token.
    pub offset: usize,
    /// Number of placeholder tokens.
    pub length: usize,
}

/// A hashed full block with everything a `BlockStored` event reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HashedBlock {
    pub hash: BlockHash,
    /// `None` for the first block of a sequence.
    pub parent: Option<BlockHash>,
    pub tokens: Vec<u32>,
    pub extra_keys: Vec<ExtraKey>,
}

/// vLLM's `hash_block_tokens`: hash of (parent or NONE_HASH, tokens, extra keys).
pub fn hash_block_tokens(
    parent: Option<BlockHash>,
    tokens: &[u32],
    extra_keys: &[ExtraKey],
) -> BlockHash {
    let mut h = Xxh3::new();
    h.update(&parent.unwrap_or_else(none_hash).0.to_le_bytes());
    h.update(&(tokens.len() as u64).to_le_bytes());
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    h.update(&(extra_keys.len() as u64).to_le_bytes());
    for key in extra_keys {
        match key {
            ExtraKey::Mm { identifier, offset } => {
                h.update(b"mm\0");
                h.update(&(identifier.len() as u64).to_le_bytes());
                h.update(identifier.as_bytes());
                h.update(&offset.to_le_bytes());
            }
            ExtraKey::CacheSalt(salt) => {
                h.update(b"cache_salt\0");
                h.update(&(salt.len() as u64).to_le_bytes());
                h.update(salt.as_bytes());
            }
        }
    }
    BlockHash(h.digest128())
}

/// Hashes every full block of `tokens` (vLLM's `hash_request_tokens`). `mm` must be sorted
/// by offset (prompt order).
pub fn hash_request_blocks(
    tokens: &[u32],
    mm: &[MmRange],
    cache_salt: Option<&str>,
    block_size: usize,
) -> Vec<HashedBlock> {
    let block_size = block_size.max(1);
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    let mut parent: Option<BlockHash> = None;
    let mut first_item = 0usize;
    for (i, chunk) in tokens.chunks_exact(block_size).enumerate() {
        let start = i * block_size;
        let end = start + block_size;
        let mut extra = Vec::new();
        // Items that end before this block never overlap a later one.
        while mm
            .get(first_item)
            .is_some_and(|r| r.offset + r.length <= start)
        {
            first_item += 1;
        }
        for r in mm.get(first_item..).unwrap_or(&[]) {
            if r.offset >= end {
                break;
            }
            if r.length == 0 || r.offset + r.length <= start {
                continue;
            }
            extra.push(ExtraKey::Mm {
                identifier: r.identifier.clone(),
                offset: r.offset as i64 - start as i64,
            });
        }
        if i == 0
            && let Some(salt) = cache_salt
        {
            extra.push(ExtraKey::CacheSalt(salt.to_string()));
        }
        let hash = hash_block_tokens(parent, chunk, &extra);
        out.push(HashedBlock {
            hash,
            parent,
            tokens: chunk.to_vec(),
            extra_keys: extra,
        });
        parent = Some(hash);
    }
    out
}

/// Where cache content changes are reported (the KV-event publisher).
pub trait KvEventSink: Send {
    /// Blocks whose content was just cached, in sequence order (a vLLM `BlockStored`).
    fn blocks_stored(&mut self, blocks: &[&HashedBlock], block_size: usize);
    /// Cached blocks that were just evicted (a vLLM `BlockRemoved`).
    fn blocks_removed(&mut self, hashes: &[BlockHash]);
    /// Every cached block was forgotten (a vLLM `AllBlocksCleared`).
    fn all_blocks_cleared(&mut self);
}

/// The default sink: reports nothing (the pool counts stored/removed blocks itself).
pub struct NoEvents;

impl KvEventSink for NoEvents {
    fn blocks_stored(&mut self, _blocks: &[&HashedBlock], _block_size: usize) {}
    fn blocks_removed(&mut self, _hashes: &[BlockHash]) {}
    fn all_blocks_cleared(&mut self) {}
}

/// Index of a block in the pool.
pub type BlockId = u32;

#[derive(Debug, Default)]
struct Block {
    /// The cached content's hash, while the block holds cached content.
    hash: Option<BlockHash>,
    ref_cnt: u32,
    /// Position in the free queue, while free.
    free_stamp: Option<u64>,
}

/// A fixed pool of KV blocks with prefix caching and LRU eviction.
pub struct BlockPool {
    block_size: usize,
    blocks: Vec<Block>,
    /// Free queue: eviction order by stamp (smallest first).
    free: BTreeMap<u64, BlockId>,
    next_stamp: u64,
    cached: HashMap<BlockHash, BlockId>,
    sink: Box<dyn KvEventSink>,
    /// Blocks whose content was cached, since start.
    pub stored_total: u64,
    /// Cached blocks evicted, since start.
    pub removed_total: u64,
}

impl BlockPool {
    pub fn new(num_blocks: u32, block_size: usize, sink: Box<dyn KvEventSink>) -> BlockPool {
        let mut pool = BlockPool {
            block_size: block_size.max(1),
            blocks: (0..num_blocks).map(|_| Block::default()).collect(),
            free: BTreeMap::new(),
            next_stamp: 0,
            cached: HashMap::new(),
            sink,
            stored_total: 0,
            removed_total: 0,
        };
        for id in 0..num_blocks {
            pool.push_free(id);
        }
        pool
    }

    /// Free blocks, cached-but-unreferenced ones included (vLLM's `get_num_free_blocks`).
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks currently holding cached content.
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// Fraction of blocks referenced by running requests (vLLM's `get_usage`).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - self.free.len() as f64 / self.blocks.len() as f64
    }

    fn push_free(&mut self, id: BlockId) {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        if let Some(b) = self.blocks.get_mut(id as usize) {
            b.free_stamp = Some(stamp);
            self.free.insert(stamp, id);
        }
    }

    /// The longest run of cached blocks from the start of `hashes`, at most `max_blocks`.
    pub fn find_cached_prefix(&self, hashes: &[BlockHash], max_blocks: usize) -> Vec<BlockId> {
        hashes
            .iter()
            .take(max_blocks)
            .map_while(|h| self.cached.get(h).copied())
            .collect()
    }

    /// How many of `ids` sit in the free queue (they stop being free once touched).
    pub fn count_free_among(&self, ids: &[BlockId]) -> usize {
        ids.iter()
            .filter(|&&id| {
                self.blocks
                    .get(id as usize)
                    .is_some_and(|b| b.free_stamp.is_some())
            })
            .count()
    }

    /// Takes a reference on each block (cache hits), taking it out of the free queue.
    pub fn touch(&mut self, ids: &[BlockId]) {
        for &id in ids {
            let Some(b) = self.blocks.get_mut(id as usize) else {
                continue;
            };
            if let Some(stamp) = b.free_stamp.take() {
                self.free.remove(&stamp);
            }
            b.ref_cnt += 1;
        }
    }

    /// Takes `n` blocks from the head of the free queue, evicting their cached content.
    /// `None` (and nothing taken) when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if self.free.len() < n {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        let mut removed = Vec::new();
        while out.len() < n {
            let (_, id) = self.free.pop_first()?;
            if let Some(b) = self.blocks.get_mut(id as usize) {
                b.free_stamp = None;
                b.ref_cnt = 1;
                if let Some(hash) = b.hash.take()
                    && self.cached.get(&hash) == Some(&id)
                {
                    self.cached.remove(&hash);
                    removed.push(hash);
                }
            }
            out.push(id);
        }
        if !removed.is_empty() {
            self.removed_total += removed.len() as u64;
            self.sink.blocks_removed(&removed);
        }
        Some(out)
    }

    /// Records the content of computed full blocks: `ids[i]` holds `blocks[i]`. Blocks
    /// already holding content, and hashes already cached in another block, are skipped.
    pub fn cache_blocks(&mut self, ids: &[BlockId], blocks: &[HashedBlock]) {
        let mut stored: Vec<&HashedBlock> = Vec::new();
        for (&id, meta) in ids.iter().zip(blocks) {
            if self.cached.contains_key(&meta.hash) {
                continue;
            }
            let Some(b) = self.blocks.get_mut(id as usize) else {
                continue;
            };
            if b.hash.is_some() {
                continue;
            }
            b.hash = Some(meta.hash);
            self.cached.insert(meta.hash, id);
            stored.push(meta);
        }
        if !stored.is_empty() {
            self.stored_total += stored.len() as u64;
            self.sink.blocks_stored(&stored, self.block_size);
        }
    }

    /// vLLM's `BlockPool.reset_prefix_cache`: refused (false) while a running request holds
    /// blocks; otherwise every cached hash is forgotten (no `BlockRemoved` per block, one
    /// `AllBlocksCleared`). The blocks stay in the free queue in their order.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.blocks.iter().any(|b| b.ref_cnt > 0) {
            return false;
        }
        for b in &mut self.blocks {
            b.hash = None;
        }
        self.cached.clear();
        self.sink.all_blocks_cleared();
        true
    }

    /// Drops one reference from each of a request's blocks, in reverse order, so that a
    /// sequence's tail blocks are evicted before its head.
    pub fn free(&mut self, ids: &[BlockId]) {
        for &id in ids.iter().rev() {
            let Some(b) = self.blocks.get_mut(id as usize) else {
                continue;
            };
            b.ref_cnt = b.ref_cnt.saturating_sub(1);
            if b.ref_cnt == 0 && b.free_stamp.is_none() {
                self.push_free(id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    fn mm(id: &str, offset: usize, length: usize) -> MmRange {
        MmRange {
            identifier: id.into(),
            offset,
            length,
        }
    }

    fn seq(prefix: &[u32], n_pad: usize, suffix: &[u32]) -> Vec<u32> {
        let mut v = prefix.to_vec();
        v.extend(std::iter::repeat_n(7u32, n_pad));
        v.extend_from_slice(suffix);
        v
    }

    fn hashes(blocks: &[HashedBlock]) -> Vec<BlockHash> {
        blocks.iter().map(|b| b.hash).collect()
    }

    #[test]
    fn shared_prefix_shares_hashes_and_chain_links_parents() {
        let a: Vec<u32> = (0..80).collect();
        let mut b = a.clone();
        b.truncate(40);
        b.extend(1000..1040);
        let ha = hash_request_blocks(&a, &[], None, 16);
        let hb = hash_request_blocks(&b, &[], None, 16);
        assert_eq!(ha.len(), 5);
        assert_eq!(hashes(&ha)[..2], hashes(&hb)[..2]);
        assert_ne!(
            ha[2].hash, hb[2].hash,
            "block 2 holds tokens 32..48, 40.. differ"
        );
        assert_ne!(ha[3].hash, hb[3].hash);
        assert_eq!(ha[0].parent, None);
        assert_eq!(ha[1].parent, Some(ha[0].hash));
        // A partial tail block is not hashed.
        assert_eq!(hash_request_blocks(&a[..47], &[], None, 16).len(), 2);
    }

    #[test]
    fn swapped_images_diverge_from_the_first_image_block() {
        // text(5) img(40) img(40) text(11) = 96 tokens = 6 blocks
        let toks = seq(&[1, 2, 3, 4, 5], 80, &[9; 11]);
        let ab = [mm("A", 5, 40), mm("B", 45, 40)];
        let ba = [mm("B", 5, 40), mm("A", 45, 40)];
        let h_ab = hash_request_blocks(&toks, &ab, None, 16);
        let h_ba = hash_request_blocks(&toks, &ba, None, 16);
        assert_eq!(h_ab.len(), 6);
        for i in 0..6 {
            assert_ne!(h_ab[i].hash, h_ba[i].hash, "block {i}");
        }
        // Image A spans blocks 0..=2 with offsets 5, -11, -27; block 2 also holds B (45-32).
        let keys: Vec<_> = h_ab[2].extra_keys.clone();
        assert_eq!(
            keys,
            vec![
                ExtraKey::Mm {
                    identifier: "A".into(),
                    offset: -27
                },
                ExtraKey::Mm {
                    identifier: "B".into(),
                    offset: 13
                }
            ]
        );
        // Same image, same place, same hashes; a different image only changes blocks it touches.
        let ac = [mm("A", 5, 40), mm("C", 45, 40)];
        let h_ac = hash_request_blocks(&toks, &ac, None, 16);
        assert_eq!(h_ab[0].hash, h_ac[0].hash);
        assert_eq!(h_ab[1].hash, h_ac[1].hash);
        assert_ne!(h_ab[2].hash, h_ac[2].hash);
    }

    #[test]
    fn cache_salt_keys_only_the_first_block_but_changes_the_chain() {
        let toks: Vec<u32> = (0..48).collect();
        let plain = hash_request_blocks(&toks, &[], None, 16);
        let salted = hash_request_blocks(&toks, &[], Some("s"), 16);
        assert_eq!(salted[0].extra_keys, vec![ExtraKey::CacheSalt("s".into())]);
        assert!(salted[1].extra_keys.is_empty());
        for i in 0..3 {
            assert_ne!(plain[i].hash, salted[i].hash);
        }
    }

    #[derive(Default)]
    struct Recorder {
        stored: Vec<BlockHash>,
        removed: Vec<BlockHash>,
    }
    struct Shared(Arc<Mutex<Recorder>>);
    impl KvEventSink for Shared {
        fn blocks_stored(&mut self, blocks: &[&HashedBlock], block_size: usize) {
            assert_eq!(block_size, 16);
            let mut r = self.0.lock().unwrap();
            r.stored.extend(blocks.iter().map(|b| b.hash));
        }
        fn blocks_removed(&mut self, hashes: &[BlockHash]) {
            self.0.lock().unwrap().removed.extend_from_slice(hashes);
        }
        fn all_blocks_cleared(&mut self) {}
    }

    #[test]
    fn pool_evicts_least_recently_freed_and_never_referenced_blocks() {
        let rec = Arc::new(Mutex::new(Recorder::default()));
        let mut pool = BlockPool::new(6, 16, Box::new(Shared(rec.clone())));
        let a = hash_request_blocks(&(0..48).collect::<Vec<_>>(), &[], None, 16);
        let b = hash_request_blocks(&(100..148).collect::<Vec<_>>(), &[], None, 16);
        let ids_a = pool.allocate(3).unwrap();
        pool.cache_blocks(&ids_a, &a);
        pool.free(&ids_a);
        assert_eq!(pool.usage(), 0.0);
        assert_eq!(pool.find_cached_prefix(&hashes(&a), 10), ids_a);
        // B takes the 3 never-used blocks first: A stays cached.
        let ids_b = pool.allocate(3).unwrap();
        pool.cache_blocks(&ids_b, &b);
        assert_eq!(pool.find_cached_prefix(&hashes(&a), 10).len(), 3);
        assert_eq!(pool.usage(), 0.5);
        // While B runs its blocks cannot be taken: only A's 3 are free.
        assert!(pool.allocate(4).is_none());
        // Taking 1 evicts A's LAST block first (freed in reverse order).
        let one = pool.allocate(1).unwrap();
        assert_eq!(rec.lock().unwrap().removed, vec![a[2].hash]);
        assert_eq!(pool.find_cached_prefix(&hashes(&a), 10).len(), 2);
        assert_eq!(pool.removed_total, 1);
        pool.free(&one);
        // Touching A's head makes it recently used; freeing B then queues B behind it...
        let hit = pool.find_cached_prefix(&hashes(&a), 10);
        pool.touch(&hit);
        pool.free(&ids_b);
        pool.free(&hit);
        // ... so the next allocations evict the block freed earliest (the uncached one) and
        // then B's tail, not A's head.
        let _ = pool.allocate(3).unwrap();
        assert_eq!(pool.find_cached_prefix(&hashes(&a), 10).len(), 2);
        assert_eq!(pool.find_cached_prefix(&hashes(&b), 10).len(), 1);
        assert_eq!(pool.stored_total, 6);
        assert_eq!(rec.lock().unwrap().stored.len(), 6);
    }

    #[test]
    fn duplicate_content_is_cached_once() {
        let mut pool = BlockPool::new(4, 16, Box::new(NoEvents));
        let a = hash_request_blocks(&(0..32).collect::<Vec<_>>(), &[], None, 16);
        let x = pool.allocate(2).unwrap();
        let y = pool.allocate(2).unwrap();
        pool.cache_blocks(&x, &a);
        pool.cache_blocks(&y, &a);
        assert_eq!(pool.num_cached(), 2);
        assert_eq!(pool.find_cached_prefix(&hashes(&a), 9), x);
    }
}

#[cfg(test)]
mod reset_tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    struct Cleared(Arc<Mutex<usize>>);
    impl KvEventSink for Cleared {
        fn blocks_stored(&mut self, _: &[&HashedBlock], _: usize) {}
        fn blocks_removed(&mut self, _: &[BlockHash]) {}
        fn all_blocks_cleared(&mut self) {
            *self.0.lock().unwrap() += 1;
        }
    }

    #[test]
    fn reset_is_refused_while_blocks_are_held_then_forgets_everything() {
        let n = Arc::new(Mutex::new(0));
        let mut pool = BlockPool::new(4, 16, Box::new(Cleared(n.clone())));
        let a = hash_request_blocks(&(0..32).collect::<Vec<_>>(), &[], None, 16);
        let ids = pool.allocate(2).unwrap();
        pool.cache_blocks(&ids, &a);
        assert!(!pool.reset_prefix_cache(), "a running request holds blocks");
        assert_eq!(*n.lock().unwrap(), 0);
        pool.free(&ids);
        assert!(pool.reset_prefix_cache());
        assert_eq!(*n.lock().unwrap(), 1);
        assert_eq!(pool.num_cached(), 0);
        assert!(pool.find_cached_prefix(&[a[0].hash], 1).is_empty());
        // Forgotten blocks are plain free blocks: allocating them evicts nothing.
        let removed_before = pool.removed_total;
        let _ = pool.allocate(4).unwrap();
        assert_eq!(pool.removed_total, removed_before);
    }
}
