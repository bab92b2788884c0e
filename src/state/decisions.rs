//! Routing decisions on their way to the state writer: every VM enqueues one record per routed
//! request on the shared queue `<ns>.decisions` (one host call), and the state writer drains
//! the queue on its tick and applies the records to the block buckets and allocation clocks
//! ([`super::writer`]).
//!
//! Record layout, little-endian:
//! `u8 version (3) | u16 slot | u64 time_ms | u32 new_blocks | u32 first | u8 has_stamp |
//! u32 stamp | u32 keys | keys × u64`.
//!
//! A record carries the request's keys from index `first` on: the deciding VM leaves out a
//! request its worker holds in full with fresh stamps (rewriting them would change nothing), so
//! a repeated prompt costs the writer no bucket access. Key `first + j` is stamped as the
//! request's `(first + j)`-th block.

use super::wire::Reader;

/// One routing decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecisionRecord {
    pub slot: u16,
    pub time_ms: u64,
    /// Blocks the worker has to allocate for the request (its uncached blocks plus the
    /// expected output): what moves the worker's allocation clock in approximate mode.
    pub new_blocks: u32,
    /// Index in the request of the first key below.
    pub first: u32,
    /// Precise mode: the stamp of the request's first key, the worker's allocation clock at
    /// routing plus the request's new blocks (its engine's events move the clock by them
    /// later). None: the state writer moves the clock by `new_blocks` and stamps with it.
    pub stamp: Option<u32>,
    /// The request's block keys from `first` on, in prefix order.
    pub keys: Vec<u64>,
}

const VERSION: u8 = 3;
const HEADER: usize = 1 + 2 + 8 + 4 + 4 + 1 + 4 + 4;

impl DecisionRecord {
    pub fn encode(&self) -> Vec<u8> {
        encode(
            self.slot,
            self.time_ms,
            self.new_blocks,
            self.first,
            self.stamp,
            &self.keys,
        )
    }

    /// Decodes a record; None when it is malformed.
    pub fn decode(bytes: &[u8]) -> Option<DecisionRecord> {
        let mut r = Reader::new(bytes);
        if r.u8()? != VERSION {
            return None;
        }
        let slot = r.u16()?;
        let time_ms = r.u64()?;
        let new_blocks = r.u32()?;
        let first = r.u32()?;
        let has_stamp = r.u8()?;
        let stamp = r.u32()?;
        let stamp = match (has_stamp, stamp) {
            (0, 0) => None,
            (1, s) => Some(s),
            _ => return None,
        };
        let n = r.u32()? as usize;
        if r.remaining() != n.checked_mul(8)? {
            return None;
        }
        let mut keys = Vec::with_capacity(n);
        for _ in 0..n {
            keys.push(r.u64()?);
        }
        Some(DecisionRecord {
            slot,
            time_ms,
            new_blocks,
            first,
            stamp,
            keys,
        })
    }
}

/// Encodes a record without building a [`DecisionRecord`] (the request path's one copy):
/// `keys` are the request's keys from index `first` on.
pub fn encode(
    slot: u16,
    time_ms: u64,
    new_blocks: u32,
    first: u32,
    stamp: Option<u32>,
    keys: &[u64],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + keys.len() * 8);
    out.push(VERSION);
    out.extend_from_slice(&slot.to_le_bytes());
    out.extend_from_slice(&time_ms.to_le_bytes());
    out.extend_from_slice(&new_blocks.to_le_bytes());
    out.extend_from_slice(&first.to_le_bytes());
    out.push(u8::from(stamp.is_some()));
    out.extend_from_slice(&stamp.unwrap_or(0).to_le_bytes());
    out.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for k in keys {
        out.extend_from_slice(&k.to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_garbage_is_refused() {
        let r = DecisionRecord {
            slot: 3,
            time_ms: 123_456,
            new_blocks: 40,
            first: 3,
            stamp: Some(77),
            keys: vec![1, u64::MAX, 7],
        };
        let bytes = r.encode();
        assert_eq!(DecisionRecord::decode(&bytes), Some(r.clone()));
        let none = DecisionRecord { stamp: None, ..r };
        let none_bytes = none.encode();
        assert_eq!(DecisionRecord::decode(&none_bytes), Some(none));
        assert_eq!(DecisionRecord::decode(&bytes[..bytes.len() - 1]), None);
        assert_eq!(DecisionRecord::decode(b""), None);
        let mut wrong = bytes.clone();
        wrong[0] = 9;
        assert_eq!(DecisionRecord::decode(&wrong), None);
        // No stamp is written as a zero: anything else is not a record this version wrote.
        let mut stray = none_bytes.clone();
        stray[20] = 1;
        assert_eq!(DecisionRecord::decode(&stray), None);
    }
}
