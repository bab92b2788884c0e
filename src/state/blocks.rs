//! Block buckets (`<ns>.b.<i>`): which workers hold each of the router's block keys.
//!
//! The key space is fixed: a block key `k` lives in bucket `k mod buckets`. A bucket holds at
//! most `bucket_entries` keys, each with at most `max_holders` holders `(slot, stamp)`, where
//! `stamp` is the holder's allocation clock when it last touched the block (see the module
//! docs of [`crate::state`]). Value layout, little-endian:
//!
//! ```text
//! u8 version (1) | u16 entries | entries × ( u64 key | u8 holders | holders × (u16 slot | u32 stamp) )
//! ```
//!
//! So the process-wide total is bounded by `buckets × bucket_entries × (11 + 6 × max_holders)`
//! bytes whatever the number of workers and blocks, and one read copies one bucket
//! (`bucket_entries` keys at most) into the VM. When a bucket is full, entries nobody validly
//! holds go first, then the entry whose freshest holder is oldest relative to that worker's
//! capacity; when a key has `max_holders` holders, the relatively oldest holder makes room.
//! Touching a block that a worker already holds with a stamp less than 1/16 of its capacity
//! old changes nothing, so a hot prefix does not rewrite its buckets on every request.

use super::wire::Reader;
use super::workers::Live;
use crate::config_error::ConfigError;

/// Sizes of the block buckets.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct BlocksConfig {
    /// Number of buckets (default 16384).
    pub buckets: u32,
    /// Keys per bucket at most (default 64): a read copies at most this many.
    pub bucket_entries: u16,
    /// Holders per key at most (default 8): a prefix held by more workers keeps the 8 that
    /// touched it most recently (relative to their capacity).
    pub max_holders: u8,
}

impl Default for BlocksConfig {
    fn default() -> Self {
        BlocksConfig {
            buckets: 16384,
            bucket_entries: 64,
            max_holders: 8,
        }
    }
}

impl BlocksConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=1 << 20).contains(&self.buckets) {
            return Err(ConfigError::new("state.buckets", "must be 1..=1048576"));
        }
        if !(1..=1024).contains(&self.bucket_entries) {
            return Err(ConfigError::new("state.bucket_entries", "must be 1..=1024"));
        }
        if self.max_holders == 0 {
            return Err(ConfigError::new("state.max_holders", "must be 1..=255"));
        }
        Ok(())
    }

    /// The bucket a block key lives in.
    pub fn bucket_of(&self, key: u64) -> u32 {
        (key % u64::from(self.buckets.max(1))) as u32
    }

    /// The largest size the buckets can take together, in bytes.
    pub fn max_bytes(&self) -> u64 {
        u64::from(self.buckets)
            * (3 + u64::from(self.bucket_entries) * (9 + 6 * u64::from(self.max_holders)))
    }
}

/// One worker holding one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holder {
    pub slot: u16,
    pub stamp: u32,
}

impl Holder {
    fn live<'a>(&self, live: &'a [Live]) -> Option<&'a Live> {
        live.get(usize::from(self.slot))
    }

    fn valid(&self, live: &[Live]) -> bool {
        self.live(live).is_some_and(|l| l.holds(self.stamp))
    }

    /// Age relative to capacity; a holder of an unknown slot is infinitely old.
    fn age(&self, live: &[Live]) -> f64 {
        match self.live(live) {
            Some(l) if l.holds(self.stamp) => l.age(self.stamp),
            _ => f64::INFINITY,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub key: u64,
    pub holders: Vec<Holder>,
}

/// A decoded bucket.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Bucket {
    pub entries: Vec<Entry>,
}

const VERSION: u8 = 1;

impl Bucket {
    /// Decodes a bucket; a malformed value decodes as empty.
    pub fn decode(bytes: &[u8]) -> Bucket {
        let mut r = Reader::new(bytes);
        let mut entries = Vec::new();
        let ok = (|| {
            if r.u8()? != VERSION {
                return None;
            }
            let n = r.u16()?;
            for _ in 0..n {
                let key = r.u64()?;
                let k = r.u8()?;
                let mut holders = Vec::with_capacity(usize::from(k));
                for _ in 0..k {
                    holders.push(Holder {
                        slot: r.u16()?,
                        stamp: r.u32()?,
                    });
                }
                entries.push(Entry { key, holders });
            }
            Some(())
        })();
        match ok {
            Some(()) => Bucket { entries },
            None => Bucket::default(),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let n = self.entries.len().min(usize::from(u16::MAX));
        let mut out = Vec::with_capacity(3 + n * 15);
        out.push(VERSION);
        out.extend_from_slice(&(n as u16).to_le_bytes());
        for e in self.entries.iter().take(n) {
            out.extend_from_slice(&e.key.to_le_bytes());
            let k = e.holders.len().min(255);
            out.push(k as u8);
            for h in e.holders.iter().take(k) {
                out.extend_from_slice(&h.slot.to_le_bytes());
                out.extend_from_slice(&h.stamp.to_le_bytes());
            }
        }
        out
    }

    /// Records that `slot` touched `key` at stamp `stamp`. Returns whether the bucket changed.
    pub fn touch(
        &mut self,
        key: u64,
        slot: u16,
        stamp: u32,
        live: &[Live],
        config: &BlocksConfig,
    ) -> bool {
        let fresh_enough = live.get(usize::from(slot)).map_or(0, |l| l.capacity / 16);
        if let Some(entry) = self.entries.iter_mut().find(|e| e.key == key) {
            if let Some(h) = entry.holders.iter_mut().find(|h| h.slot == slot) {
                let h_valid = live
                    .get(usize::from(slot))
                    .is_some_and(|l| l.holds(h.stamp));
                let age = stamp.wrapping_sub(h.stamp);
                // Not newer (clocks only move forward; a wrapped difference means older), or
                // fresh enough: nothing to write.
                if age > u32::MAX / 2 || (h_valid && age <= fresh_enough) {
                    return false;
                }
                h.stamp = stamp;
                return true;
            }
            entry.holders.retain(|h| h.valid(live));
            if entry.holders.len() >= usize::from(config.max_holders) {
                let oldest = entry
                    .holders
                    .iter()
                    .enumerate()
                    .max_by(|(_, a), (_, b)| a.age(live).total_cmp(&b.age(live)))
                    .map(|(i, _)| i);
                if let Some(i) = oldest {
                    entry.holders.swap_remove(i);
                }
            }
            entry.holders.push(Holder { slot, stamp });
            return true;
        }
        if self.entries.len() >= usize::from(config.bucket_entries) {
            self.prune(live);
        }
        if self.entries.len() >= usize::from(config.bucket_entries) {
            let victim = self
                .entries
                .iter()
                .enumerate()
                .map(|(i, e)| {
                    let freshest = e
                        .holders
                        .iter()
                        .map(|h| h.age(live))
                        .fold(f64::INFINITY, f64::min);
                    (i, freshest)
                })
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .map(|(i, _)| i);
            if let Some(i) = victim {
                self.entries.swap_remove(i);
            }
        }
        self.entries.push(Entry {
            key,
            holders: vec![Holder { slot, stamp }],
        });
        true
    }

    /// Drops holders that no longer hold their block, and entries left without holders.
    pub fn prune(&mut self, live: &[Live]) {
        for e in &mut self.entries {
            e.holders.retain(|h| h.valid(live));
        }
        self.entries.retain(|e| !e.holders.is_empty());
    }
}

/// The holders of `key` in an encoded bucket, appended to `out`, without decoding the rest.
pub fn holders_of(bytes: &[u8], key: u64, out: &mut Vec<Holder>) {
    let mut r = Reader::new(bytes);
    let Some(VERSION) = r.u8() else {
        return;
    };
    let Some(n) = r.u16() else {
        return;
    };
    for _ in 0..n {
        let (Some(k), Some(count)) = (r.u64(), r.u8()) else {
            return;
        };
        if k != key {
            if r.take(usize::from(count) * 6).is_none() {
                return;
            }
            continue;
        }
        for _ in 0..count {
            let (Some(slot), Some(stamp)) = (r.u16(), r.u32()) else {
                return;
            };
            out.push(Holder { slot, stamp });
        }
        return;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::workers::flag;

    fn live(n: usize, capacity: u32) -> Vec<Live> {
        vec![
            Live {
                capacity,
                flags: flag::ACTIVE,
                ..Live::default()
            };
            n
        ]
    }

    fn holders(b: &Bucket, key: u64) -> Vec<Holder> {
        let mut out = Vec::new();
        holders_of(&b.encode(), key, &mut out);
        out
    }

    #[test]
    fn touches_are_found_and_round_trip() {
        let cfg = BlocksConfig::default();
        let l = live(3, 100);
        let mut b = Bucket::default();
        assert!(b.touch(7, 0, 0, &l, &cfg));
        assert!(b.touch(7, 2, 0, &l, &cfg));
        assert!(b.touch(9, 1, 0, &l, &cfg));
        assert_eq!(Bucket::decode(&b.encode()), b);
        let slots: Vec<u16> = holders(&b, 7).iter().map(|h| h.slot).collect();
        assert_eq!(slots, vec![0, 2]);
        assert!(holders(&b, 8).is_empty());
        assert!(!b.touch(7, 0, 3, &l, &cfg), "fresh enough: no rewrite");
        assert!(
            b.touch(7, 0, 50, &l, &cfg),
            "older than capacity/16: restamped"
        );
    }

    #[test]
    fn a_full_bucket_evicts_the_relatively_oldest_entry() {
        let cfg = BlocksConfig {
            buckets: 1,
            bucket_entries: 3,
            max_holders: 2,
        };
        let mut l = live(2, 100);
        let mut b = Bucket::default();
        for (key, stamp) in [(1, 0), (2, 10), (3, 20)] {
            l[0].clock = stamp;
            b.touch(key, 0, stamp as u32, &l, &cfg);
        }
        l[0].clock = 30;
        b.touch(4, 0, 30, &l, &cfg);
        let keys: Vec<u64> = b.entries.iter().map(|e| e.key).collect();
        assert_eq!(b.entries.len(), 3);
        assert!(!keys.contains(&1), "the oldest went: {keys:?}");
        // Invalid entries go before valid ones, however recent.
        l[0].clock = 125; // keys 2 (stamp 10) and 3 (20) are now evicted on slot 0
        b.touch(5, 1, 0, &l, &cfg);
        b.touch(6, 1, 0, &l, &cfg);
        let keys: Vec<u64> = b.entries.iter().map(|e| e.key).collect();
        assert!(
            keys.contains(&4) && keys.contains(&5) && keys.contains(&6),
            "{keys:?}"
        );
    }

    #[test]
    fn holders_are_capped_keeping_the_freshest() {
        let cfg = BlocksConfig {
            buckets: 1,
            bucket_entries: 8,
            max_holders: 2,
        };
        let mut l = live(3, 100);
        l[0].clock = 50;
        l[1].clock = 10;
        l[2].clock = 10;
        let mut b = Bucket::default();
        b.touch(1, 0, 0, &l, &cfg); // age 0.5
        b.touch(1, 1, 10, &l, &cfg); // age 0
        b.touch(1, 2, 10, &l, &cfg); // age 0: slot 0 makes room
        let mut slots: Vec<u16> = holders(&b, 1).iter().map(|h| h.slot).collect();
        slots.sort_unstable();
        assert_eq!(slots, vec![1, 2]);
    }

    #[test]
    fn garbage_decodes_empty_and_finds_nothing() {
        for bytes in [&b""[..], b"\x02\x01\x00", b"\x01\x05\x00\x01"] {
            assert_eq!(Bucket::decode(bytes), Bucket::default());
            let mut out = Vec::new();
            holders_of(bytes, 1, &mut out);
            assert!(out.is_empty());
        }
        assert!(BlocksConfig::default().max_bytes() < 200 << 20);
    }
}
