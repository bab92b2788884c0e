//! The sidecar's feed (`GET /v1/feed?since=<cursor>`, `application/x-mmrouter-feed`): what the
//! filter's state writer learns from `mmrouter-sidecar` on each poll. Binary, little-endian,
//! version 1; the layout is in `docs/SIDECAR.md` and below.
//!
//! ```text
//! "MMRF" | u16 version | u16 flags (bit 0 snapshot) | u64 epoch | u64 cursor | u64 now_ms
//! u32 workers, each:
//!   u8 len + name | u8 len + address | u8 flags (healthy, metrics valid, events connected)
//!   u32 capacity | u16 block_size | f32 waiting | f32 running | f32 kv_usage | f32 prefill_tps
//!   u32 metrics_age_ms | u32 resident | u64 stored_total | u64 removed_total
//!   u32 cleared_total | u32 event_gaps
//! u32 images, each: u32 worker (index in the list above) | u64 image key | u32 blocks
//! ```
//! Decoding checks every length against the bytes left before allocating, so any input is an
//! error value, never a panic or an outsized allocation.

use crate::state::wire::{Reader, put_short_str};
use std::fmt;

pub const MAGIC: &[u8; 4] = b"MMRF";
pub const VERSION: u16 = 1;
pub const CONTENT_TYPE: &str = "application/x-mmrouter-feed";

/// One worker as the sidecar sees it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FeedWorker {
    pub name: String,
    pub address: String,
    pub healthy: bool,
    pub metrics_valid: bool,
    pub events_connected: bool,
    /// `num_gpu_blocks` (0 = unknown).
    pub capacity: u32,
    /// Engine block size (0 = unknown).
    pub block_size: u16,
    pub waiting: f32,
    pub running: f32,
    pub kv_usage: f32,
    /// Observed prefill speed, tokens per second (0 = unknown).
    pub prefill_tps: f32,
    /// ms since the last good scrape (u32::MAX = never).
    pub metrics_age_ms: u32,
    /// Blocks the worker holds now per its events.
    pub resident: u32,
    /// Blocks stored / removed per events since the sidecar started (monotonic).
    pub stored_total: u64,
    pub removed_total: u64,
    /// AllBlocksCleared seen since the sidecar started (monotonic).
    pub cleared_total: u32,
    pub event_gaps: u32,
}

/// A change of one worker's residency of one image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageResidency {
    /// Index into [`Feed::workers`].
    pub worker: u32,
    /// The router's image key (xxh3-64 of the engine's mm identifier).
    pub image: u64,
    /// Blocks carrying the image that the worker holds now (0 = none left).
    pub blocks: u32,
}

/// One feed answer.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Feed {
    /// `images` is the full residency, not a delta.
    pub snapshot: bool,
    /// Random per sidecar start.
    pub epoch: u64,
    /// Pass back as `since` next time.
    pub cursor: u64,
    pub now_ms: u64,
    /// The complete membership.
    pub workers: Vec<FeedWorker>,
    pub images: Vec<ImageResidency>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FeedError {
    Truncated,
    BadMagic,
    Version(u16),
    /// A name or address that is not UTF-8.
    BadString,
    /// An image entry names a worker index past the list.
    BadWorkerIndex(u32),
    /// Bytes left after the last entry.
    Trailing(usize),
}

impl fmt::Display for FeedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FeedError::Truncated => f.write_str("feed is truncated"),
            FeedError::BadMagic => f.write_str("not an mmrouter feed (bad magic)"),
            FeedError::Version(v) => {
                write!(f, "feed version {v} is not supported (this filter reads 1)")
            }
            FeedError::BadString => f.write_str("feed has a name or address that is not UTF-8"),
            FeedError::BadWorkerIndex(i) => {
                write!(f, "feed image entry names worker {i}, past the list")
            }
            FeedError::Trailing(n) => write!(f, "feed has {n} trailing bytes"),
        }
    }
}

impl std::error::Error for FeedError {}

const WORKER_FIXED: usize = 1 + 4 + 2 + 4 * 4 + 4 + 4 + 8 + 8 + 4 + 4;
const IMAGE: usize = 4 + 8 + 4;

pub fn encode(feed: &Feed) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + feed.workers.len() * 80 + feed.images.len() * IMAGE);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&u16::from(feed.snapshot).to_le_bytes());
    out.extend_from_slice(&feed.epoch.to_le_bytes());
    out.extend_from_slice(&feed.cursor.to_le_bytes());
    out.extend_from_slice(&feed.now_ms.to_le_bytes());
    out.extend_from_slice(&(feed.workers.len() as u32).to_le_bytes());
    for w in &feed.workers {
        put_short_str(&mut out, &w.name);
        put_short_str(&mut out, &w.address);
        out.push(
            u8::from(w.healthy)
                | u8::from(w.metrics_valid) << 1
                | u8::from(w.events_connected) << 2,
        );
        out.extend_from_slice(&w.capacity.to_le_bytes());
        out.extend_from_slice(&w.block_size.to_le_bytes());
        for v in [w.waiting, w.running, w.kv_usage, w.prefill_tps] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&w.metrics_age_ms.to_le_bytes());
        out.extend_from_slice(&w.resident.to_le_bytes());
        out.extend_from_slice(&w.stored_total.to_le_bytes());
        out.extend_from_slice(&w.removed_total.to_le_bytes());
        out.extend_from_slice(&w.cleared_total.to_le_bytes());
        out.extend_from_slice(&w.event_gaps.to_le_bytes());
    }
    out.extend_from_slice(&(feed.images.len() as u32).to_le_bytes());
    for i in &feed.images {
        out.extend_from_slice(&i.worker.to_le_bytes());
        out.extend_from_slice(&i.image.to_le_bytes());
        out.extend_from_slice(&i.blocks.to_le_bytes());
    }
    out
}

pub fn decode(bytes: &[u8]) -> Result<Feed, FeedError> {
    let mut r = Reader::new(bytes);
    let t = FeedError::Truncated;
    if r.take(4).ok_or(FeedError::Truncated)? != MAGIC {
        return Err(FeedError::BadMagic);
    }
    let version = r.u16().ok_or(FeedError::Truncated)?;
    if version != VERSION {
        return Err(FeedError::Version(version));
    }
    let flags = r.u16().ok_or(t.clone())?;
    let epoch = r.u64().ok_or(t.clone())?;
    let cursor = r.u64().ok_or(t.clone())?;
    let now_ms = r.u64().ok_or(t.clone())?;
    let n = r.u32().ok_or(t.clone())? as usize;
    // Each worker takes at least two length bytes plus the fixed part.
    if n > r.remaining() / (2 + WORKER_FIXED) {
        return Err(FeedError::Truncated);
    }
    let mut workers = Vec::with_capacity(n);
    for _ in 0..n {
        let name = string(&mut r)?;
        let address = string(&mut r)?;
        let f = r.u8().ok_or(t.clone())?;
        let mut w = FeedWorker {
            name,
            address,
            healthy: f & 1 != 0,
            metrics_valid: f & 2 != 0,
            events_connected: f & 4 != 0,
            ..FeedWorker::default()
        };
        (|| {
            w.capacity = r.u32()?;
            w.block_size = r.u16()?;
            w.waiting = r.f32()?;
            w.running = r.f32()?;
            w.kv_usage = r.f32()?;
            w.prefill_tps = r.f32()?;
            w.metrics_age_ms = r.u32()?;
            w.resident = r.u32()?;
            w.stored_total = r.u64()?;
            w.removed_total = r.u64()?;
            w.cleared_total = r.u32()?;
            w.event_gaps = r.u32()?;
            Some(())
        })()
        .ok_or(t.clone())?;
        workers.push(w);
    }
    let m = r.u32().ok_or(t.clone())? as usize;
    if m > r.remaining() / IMAGE {
        return Err(FeedError::Truncated);
    }
    let mut images = Vec::with_capacity(m);
    for _ in 0..m {
        let (Some(worker), Some(image), Some(blocks)) = (r.u32(), r.u64(), r.u32()) else {
            return Err(FeedError::Truncated);
        };
        if worker as usize >= workers.len() {
            return Err(FeedError::BadWorkerIndex(worker));
        }
        images.push(ImageResidency {
            worker,
            image,
            blocks,
        });
    }
    if r.remaining() > 0 {
        return Err(FeedError::Trailing(r.remaining()));
    }
    Ok(Feed {
        snapshot: flags & 1 != 0,
        epoch,
        cursor,
        now_ms,
        workers,
        images,
    })
}

fn string(r: &mut Reader<'_>) -> Result<String, FeedError> {
    let n = usize::from(r.u8().ok_or(FeedError::Truncated)?);
    let b = r.take(n).ok_or(FeedError::Truncated)?;
    std::str::from_utf8(b)
        .map(str::to_string)
        .map_err(|_| FeedError::BadString)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Feed {
        Feed {
            snapshot: true,
            epoch: 42,
            cursor: 7,
            now_ms: 1_700_000_000_000,
            workers: vec![
                FeedWorker {
                    name: "w0".into(),
                    address: "10.0.0.1:8000".into(),
                    healthy: true,
                    metrics_valid: true,
                    events_connected: true,
                    capacity: 4096,
                    block_size: 16,
                    waiting: 1.0,
                    running: 3.0,
                    kv_usage: 0.5,
                    prefill_tps: 9000.0,
                    metrics_age_ms: 40,
                    resident: 100,
                    stored_total: 1000,
                    removed_total: 900,
                    cleared_total: 1,
                    event_gaps: 0,
                },
                FeedWorker {
                    name: "w1".into(),
                    address: "[::1]:8001".into(),
                    metrics_age_ms: u32::MAX,
                    ..FeedWorker::default()
                },
            ],
            images: vec![ImageResidency {
                worker: 1,
                image: u64::MAX,
                blocks: 0,
            }],
        }
    }

    #[test]
    fn feeds_round_trip() {
        let f = sample();
        assert_eq!(decode(&encode(&f)), Ok(f));
        assert_eq!(decode(&encode(&Feed::default())), Ok(Feed::default()));
    }

    #[test]
    fn every_truncation_and_bad_header_is_an_error() {
        let bytes = encode(&sample());
        for n in 0..bytes.len() {
            assert!(decode(&bytes[..n]).is_err(), "{n}");
        }
        let mut v2 = bytes.clone();
        v2[4] = 2;
        assert_eq!(decode(&v2), Err(FeedError::Version(2)));
        let mut bad = bytes.clone();
        bad[0] = b'X';
        assert_eq!(decode(&bad), Err(FeedError::BadMagic));
        let mut long = bytes.clone();
        long.push(0);
        assert_eq!(decode(&long), Err(FeedError::Trailing(1)));
        // A huge declared count fails at once.
        let mut huge = encode(&Feed::default());
        huge[32..36].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(&huge), Err(FeedError::Truncated));
    }
}
