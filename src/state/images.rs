//! Image residency (`<ns>.i.<i>`), precise mode: for each image key, the workers whose engine
//! reported blocks that carry it (KV events' extra keys), and how many such blocks each holds.
//!
//! The engine's events name an image by its multimodal identifier, which is the `uuid` the
//! filter stamps on image parts (the router's content id), so an event's identifier maps to
//! the router's image key without a tokenizer (see `docs/SIDECAR.md`). The sidecar turns the
//! events into per-worker counts; the state writer stores them here; a lookup caps a worker's
//! matched prefix at an image the engine says it evicted.
//!
//! An entry with 0 blocks is kept as a tombstone: "this worker had the image and evicted it".
//! A worker with no entry for an image is not capped: the router may have just sent it there
//! and the engine's events have not arrived yet.
//!
//! Value layout, little-endian:
//! `u8 version (1) | u16 entries | entries × ( u64 image | u8 holders | holders × (u16 slot | u8 incarnation | u32 blocks) )`.
//! A holder counts only while its slot still has the same incarnation (the same worker).
//! Entries are kept in update order; a full bucket drops its least recently updated entry.

use super::wire::Reader;
use crate::config_error::ConfigError;

/// Sizes of the image buckets.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ImagesConfig {
    /// Number of buckets (default 4096).
    pub buckets: u32,
    /// Images per bucket at most (default 32).
    pub bucket_entries: u16,
}

impl Default for ImagesConfig {
    fn default() -> Self {
        ImagesConfig {
            buckets: 4096,
            bucket_entries: 32,
        }
    }
}

impl ImagesConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=1 << 20).contains(&self.buckets) {
            return Err(ConfigError::new(
                "state.image_buckets",
                "must be 1..=1048576",
            ));
        }
        if !(1..=1024).contains(&self.bucket_entries) {
            return Err(ConfigError::new(
                "state.image_bucket_entries",
                "must be 1..=1024",
            ));
        }
        Ok(())
    }

    pub fn bucket_of(&self, image: u64) -> u32 {
        (image % u64::from(self.buckets.max(1))) as u32
    }
}

/// One worker's residency of one image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageHolder {
    pub slot: u16,
    pub incarnation: u8,
    /// Blocks carrying the image that the worker holds (0 = it evicted them all).
    pub blocks: u32,
}

/// Holders of one image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageEntry {
    pub image: u64,
    pub holders: Vec<ImageHolder>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ImageBucket {
    pub entries: Vec<ImageEntry>,
}

const VERSION: u8 = 1;
/// Holders per image at most (a slot index is u16; more than this many workers holding one
/// image keep the most recently updated).
const MAX_HOLDERS: usize = 64;

impl ImageBucket {
    pub fn decode(bytes: &[u8]) -> ImageBucket {
        let mut r = Reader::new(bytes);
        let mut entries = Vec::new();
        let ok = (|| {
            if r.u8()? != VERSION {
                return None;
            }
            for _ in 0..r.u16()? {
                let image = r.u64()?;
                let k = r.u8()?;
                let mut holders = Vec::with_capacity(usize::from(k));
                for _ in 0..k {
                    holders.push(ImageHolder {
                        slot: r.u16()?,
                        incarnation: r.u8()?,
                        blocks: r.u32()?,
                    });
                }
                entries.push(ImageEntry { image, holders });
            }
            Some(())
        })();
        match ok {
            Some(()) => ImageBucket { entries },
            None => ImageBucket::default(),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let n = self.entries.len().min(usize::from(u16::MAX));
        let mut out = Vec::with_capacity(3 + n * 15);
        out.push(VERSION);
        out.extend_from_slice(&(n as u16).to_le_bytes());
        for e in self.entries.iter().take(n) {
            out.extend_from_slice(&e.image.to_le_bytes());
            let k = e.holders.len().min(255);
            out.push(k as u8);
            for h in e.holders.iter().take(k) {
                out.extend_from_slice(&h.slot.to_le_bytes());
                out.push(h.incarnation);
                out.extend_from_slice(&h.blocks.to_le_bytes());
            }
        }
        out
    }

    /// Sets how many blocks carrying `image` the worker in `slot` (of `incarnation`) holds
    /// (0 = it evicted them all).
    pub fn set(
        &mut self,
        image: u64,
        slot: u16,
        incarnation: u8,
        blocks: u32,
        config: &ImagesConfig,
    ) {
        let mut entry = match self.entries.iter().position(|e| e.image == image) {
            Some(i) => self.entries.remove(i),
            None => ImageEntry {
                image,
                holders: Vec::new(),
            },
        };
        entry.holders.retain(|h| h.slot != slot);
        if entry.holders.len() >= MAX_HOLDERS {
            entry.holders.remove(0);
        }
        entry.holders.push(ImageHolder {
            slot,
            incarnation,
            blocks,
        });
        while self.entries.len() >= usize::from(config.bucket_entries) && !self.entries.is_empty() {
            self.entries.remove(0);
        }
        self.entries.push(entry);
    }
}

/// What the engine reported for `image` on `slot` (while it has `incarnation`): Some(blocks)
/// when it reported anything (Some(0) = evicted), None when it never did.
pub fn resident_blocks(bytes: &[u8], image: u64, slot: u16, incarnation: u8) -> Option<u32> {
    ImageBucket::decode(bytes)
        .entries
        .iter()
        .find(|e| e.image == image)
        .and_then(|e| {
            e.holders
                .iter()
                .find(|h| h.slot == slot && h.incarnation == incarnation)
                .map(|h| h.blocks)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn residency_is_set_updated_and_tombstoned() {
        let cfg = ImagesConfig::default();
        let mut b = ImageBucket::default();
        b.set(10, 1, 0, 5, &cfg);
        b.set(10, 2, 0, 3, &cfg);
        b.set(10, 1, 0, 0, &cfg);
        let bytes = b.encode();
        assert_eq!(ImageBucket::decode(&bytes), b);
        assert_eq!(resident_blocks(&bytes, 10, 1, 0), Some(0), "evicted");
        assert_eq!(resident_blocks(&bytes, 10, 2, 0), Some(3));
        assert_eq!(resident_blocks(&bytes, 10, 3, 0), None, "never reported");
        assert_eq!(resident_blocks(&bytes, 11, 2, 0), None);
        assert_eq!(
            resident_blocks(&bytes, 10, 2, 1),
            None,
            "another worker in the same slot"
        );
    }

    #[test]
    fn a_full_bucket_drops_the_least_recently_updated_image() {
        let cfg = ImagesConfig {
            buckets: 1,
            bucket_entries: 2,
        };
        let mut b = ImageBucket::default();
        b.set(1, 0, 0, 1, &cfg);
        b.set(2, 0, 0, 1, &cfg);
        b.set(1, 0, 0, 2, &cfg); // 1 is now the most recent
        b.set(3, 0, 0, 1, &cfg);
        let images: Vec<u64> = b.entries.iter().map(|e| e.image).collect();
        assert_eq!(images, vec![1, 3]);
        assert_eq!(ImageBucket::decode(b"\x01\xff\xff"), ImageBucket::default());
    }
}
