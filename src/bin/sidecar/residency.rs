//! One worker's resident KV blocks as its events tell them, and the images they carry.
//!
//! A block is its engine hash (`EngineHash`, 64 bits) with the router image keys of the
//! multimodal items that overlap it. vLLM may hold several physical blocks with one hash
//! (two requests that computed the same block at once, or one block on two tiers), and emits
//! a `BlockStored` / `BlockRemoved` for each, so a hash is counted: it stays resident until
//! as many removes as stores arrived.
//!
//! Bounded: at most `limit` distinct hashes are kept (the worker's `num_gpu_blocks` when
//! known, capped by `--max-blocks-per-worker`); storing past it drops the hash stored
//! longest ago, as the engine's LRU free queue would have (and as missed removals, after an
//! event gap, require). Memory per resident hash, on 64-bit: 40 bytes in the hash map
//! (hash, store stamp, reference count, image list pointer) plus its control byte at a load
//! factor of at most 7/8, about 47 bytes; 16 bytes in the store-order queue, which holds at
//! most two entries per live hash (stale entries are compacted away), so at most 32 bytes;
//! 8 bytes per image key of a block that has images (plus the allocator's overhead for that
//! list). About 80 bytes per block without images. Per distinct image: 16 bytes plus a
//! control byte in the image map, about 19 bytes.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet, VecDeque};

/// An engine block hash (`kv_events::EngineHash`).
pub type BlockHash = u64;

struct Block {
    /// When the hash was first stored (its place in `order`).
    stamp: u64,
    /// Stores minus removes.
    refs: u32,
    /// Router image keys of the items overlapping the block (distinct; empty = none).
    images: Box<[u64]>,
}

/// The resident blocks of one worker.
pub struct Residency {
    blocks: HashMap<BlockHash, Block>,
    /// Hashes in store order with their stamp; an entry whose stamp no longer matches the
    /// block's is stale (the hash was removed, maybe stored again later).
    order: VecDeque<(BlockHash, u64)>,
    next_stamp: u64,
    images: HashMap<u64, u32>,
    /// Physical blocks: the sum of the reference counts.
    physical: u64,
    limit: usize,
    /// Hashes dropped by the bound rather than by an event.
    dropped_by_bound: u64,
    /// Removes of hashes this residency did not hold.
    unknown_removes: u64,
}

/// Image keys whose resident block count changed, with the new count (0 = none left).
pub type ImageChanges = Vec<(u64, u32)>;

impl Residency {
    pub fn new(limit: usize) -> Residency {
        Residency {
            blocks: HashMap::new(),
            order: VecDeque::new(),
            next_stamp: 0,
            images: HashMap::new(),
            physical: 0,
            limit: limit.max(1),
            dropped_by_bound: 0,
            unknown_removes: 0,
        }
    }

    /// Distinct resident hashes.
    pub fn distinct(&self) -> usize {
        self.blocks.len()
    }

    /// Resident physical blocks (hashes counted as often as stored).
    pub fn physical(&self) -> u64 {
        self.physical
    }

    /// Images with at least one resident block.
    pub fn image_count(&self) -> usize {
        self.images.len()
    }

    /// Resident blocks carrying `image`.
    pub fn image_blocks(&self, image: u64) -> u32 {
        self.images.get(&image).copied().unwrap_or(0)
    }

    /// Every image with its resident block count.
    pub fn images(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.images.iter().map(|(k, v)| (*k, *v))
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    pub fn dropped_by_bound(&self) -> u64 {
        self.dropped_by_bound
    }

    pub fn unknown_removes(&self) -> u64 {
        self.unknown_removes
    }

    /// Changes the bound, dropping the oldest hashes if over it.
    pub fn set_limit(&mut self, limit: usize, changes: &mut Changes) {
        self.limit = limit.max(1);
        self.enforce_limit(changes);
    }

    /// A `BlockStored`: `images[i]` are the image keys of block `i` (missing = none).
    pub fn store(&mut self, hashes: &[BlockHash], images: &[Vec<u64>], changes: &mut Changes) {
        for (i, &hash) in hashes.iter().enumerate() {
            self.physical += 1;
            match self.blocks.entry(hash) {
                Entry::Occupied(mut e) => {
                    let b = e.get_mut();
                    b.refs = b.refs.saturating_add(1);
                }
                Entry::Vacant(v) => {
                    let mut keys: Vec<u64> = images.get(i).cloned().unwrap_or_default();
                    keys.sort_unstable();
                    keys.dedup();
                    for &k in &keys {
                        *self.images.entry(k).or_insert(0) += 1;
                        changes.touch(k);
                    }
                    let stamp = self.next_stamp;
                    self.next_stamp += 1;
                    v.insert(Block {
                        stamp,
                        refs: 1,
                        images: keys.into_boxed_slice(),
                    });
                    self.order.push_back((hash, stamp));
                }
            }
        }
        self.enforce_limit(changes);
    }

    /// A `BlockRemoved`.
    pub fn remove(&mut self, hashes: &[BlockHash], changes: &mut Changes) {
        for hash in hashes {
            let Entry::Occupied(mut e) = self.blocks.entry(*hash) else {
                self.unknown_removes += 1;
                continue;
            };
            self.physical = self.physical.saturating_sub(1);
            let b = e.get_mut();
            b.refs = b.refs.saturating_sub(1);
            if b.refs == 0 {
                let b = e.remove();
                self.release_images(&b.images, changes);
            }
        }
        self.compact();
    }

    /// An `AllBlocksCleared` (or a restarted publisher): everything goes.
    pub fn clear(&mut self, changes: &mut Changes) {
        for image in self.images.keys() {
            changes.touch(*image);
        }
        self.blocks.clear();
        self.order.clear();
        self.images.clear();
        self.physical = 0;
    }

    fn release_images(&mut self, images: &[u64], changes: &mut Changes) {
        for k in images {
            if let Entry::Occupied(mut e) = self.images.entry(*k) {
                *e.get_mut() = e.get().saturating_sub(1);
                if *e.get() == 0 {
                    e.remove();
                }
                changes.touch(*k);
            }
        }
    }

    fn enforce_limit(&mut self, changes: &mut Changes) {
        while self.blocks.len() > self.limit {
            let Some((hash, stamp)) = self.order.pop_front() else {
                break;
            };
            if self.blocks.get(&hash).is_some_and(|b| b.stamp == stamp)
                && let Some(b) = self.blocks.remove(&hash)
            {
                self.physical = self.physical.saturating_sub(u64::from(b.refs));
                self.dropped_by_bound += 1;
                self.release_images(&b.images, changes);
            }
        }
        self.compact();
    }

    /// Drops stale order entries once they outnumber the live ones.
    fn compact(&mut self) {
        if self.order.len() > 2 * self.blocks.len() + 64 {
            let blocks = &self.blocks;
            self.order
                .retain(|(h, s)| blocks.get(h).is_some_and(|b| b.stamp == *s));
        }
    }

    /// The store-order queue's length (for the memory bound's test).
    #[cfg(test)]
    fn order_len(&self) -> usize {
        self.order.len()
    }
}

/// The images touched while applying events; [`Changes::finish`] reads their final counts.
#[derive(Default)]
pub struct Changes {
    touched: HashSet<u64>,
}

impl Changes {
    pub fn touch(&mut self, image: u64) {
        self.touched.insert(image);
    }

    /// Each touched image with its count now, sorted by image key.
    pub fn finish(self, r: &Residency) -> ImageChanges {
        let mut out: ImageChanges = self
            .touched
            .into_iter()
            .map(|k| (k, r.image_blocks(k)))
            .collect();
        out.sort_unstable();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn apply(r: &mut Residency, f: impl FnOnce(&mut Residency, &mut Changes)) -> ImageChanges {
        let mut c = Changes::default();
        f(r, &mut c);
        c.finish(r)
    }

    #[test]
    fn images_count_the_distinct_blocks_that_carry_them() {
        let mut r = Residency::new(100);
        // Blocks 1..=3 carry image 7 (it spans them); block 3 also carries image 9 twice.
        let ch = apply(&mut r, |r, c| {
            r.store(&[1, 2, 3, 4], &[vec![7], vec![7], vec![7, 9, 9], vec![]], c)
        });
        assert_eq!(ch, [(7, 3), (9, 1)]);
        assert_eq!((r.distinct(), r.physical(), r.image_count()), (4, 4, 2));
        let ch = apply(&mut r, |r, c| r.remove(&[3], c));
        assert_eq!(ch, [(7, 2), (9, 0)]);
        assert_eq!(r.image_count(), 1);
        let ch = apply(&mut r, |r, c| r.remove(&[4, 99], c));
        assert!(ch.is_empty());
        assert_eq!(r.unknown_removes(), 1);
    }

    #[test]
    fn a_hash_stored_twice_stays_until_removed_twice() {
        let mut r = Residency::new(100);
        apply(&mut r, |r, c| r.store(&[1], &[vec![7]], c));
        let ch = apply(&mut r, |r, c| r.store(&[1], &[vec![7]], c));
        assert!(ch.is_empty(), "no change in distinct blocks");
        assert_eq!((r.distinct(), r.physical()), (1, 2));
        assert_eq!(apply(&mut r, |r, c| r.remove(&[1], c)), []);
        assert_eq!(r.image_blocks(7), 1);
        assert_eq!(apply(&mut r, |r, c| r.remove(&[1], c)), [(7, 0)]);
        assert_eq!((r.distinct(), r.physical()), (0, 0));
    }

    #[test]
    fn clear_reports_every_image_gone() {
        let mut r = Residency::new(100);
        apply(&mut r, |r, c| r.store(&[1, 2], &[vec![5], vec![6]], c));
        assert_eq!(apply(&mut r, |r, c| r.clear(c)), [(5, 0), (6, 0)]);
        assert_eq!((r.distinct(), r.physical(), r.image_count()), (0, 0, 0));
    }

    #[test]
    fn the_bound_drops_the_oldest_hashes_first() {
        let mut r = Residency::new(3);
        apply(&mut r, |r, c| {
            r.store(&[1, 2, 3], &[vec![10], vec![], vec![]], c)
        });
        // A re-store of 1 does not make it younger: the engine's events say nothing of use.
        apply(&mut r, |r, c| r.store(&[1], &[], c));
        let ch = apply(&mut r, |r, c| r.store(&[4], &[vec![11]], c));
        assert_eq!(ch, [(10, 0), (11, 1)]);
        assert_eq!(r.distinct(), 3);
        assert_eq!(r.physical(), 3);
        assert_eq!(r.dropped_by_bound(), 1);
        // Lowering the limit (the worker reported fewer GPU blocks) drops more.
        let ch = apply(&mut r, |r, c| r.set_limit(1, c));
        assert!(ch.is_empty(), "blocks 2 and 3 carried no image: {ch:?}");
        assert_eq!((r.distinct(), r.physical()), (1, 1));
        assert_eq!(r.image_blocks(11), 1);
    }

    #[test]
    fn churn_keeps_the_order_queue_bounded() {
        let mut r = Residency::new(1000);
        for round in 0..10_000u64 {
            apply(&mut r, |r, c| r.store(&[round % 50], &[], c));
            apply(&mut r, |r, c| r.remove(&[round % 50], c));
        }
        assert_eq!(r.distinct(), 0);
        assert!(r.order_len() <= 64, "{}", r.order_len());
        for h in 0..5000u64 {
            apply(&mut r, |r, c| r.store(&[h], &[], c));
        }
        assert_eq!(r.distinct(), 1000);
        assert!(r.order_len() <= 2 * 1000 + 64);
    }
}
