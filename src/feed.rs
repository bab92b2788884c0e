//! The sidecar's feed: what `GET /v1/feed?since=<cursor>` answers, in a compact binary form
//! the filter's poller decodes without a JSON parser.
//!
//! One answer carries the complete worker membership with each worker's scraped metrics and
//! event counters, and the image-residency changes since the cursor the poller passed back
//! (or, with the snapshot flag, the full residency). All integers and floats are
//! little-endian. Version 1:
//!
//! ```text
//! magic        4 bytes  "MMRF"
//! version      u16      1
//! flags        u16      bit 0: snapshot (the images below are the full set, not a delta)
//! epoch        u64      random per sidecar start: a change means "forget what the events said"
//! cursor       u64      pass back as ?since= next time (0 = "I have nothing": a snapshot)
//! now_ms       u64      the sidecar's clock, ms since the Unix epoch
//! n_workers    u32      the complete current membership
//!   name         u8 length + bytes   1-64 chars of [A-Za-z0-9_.-]
//!   address      u8 length + bytes   "ip:port" of the worker's HTTP server ("[ip]:port" for IPv6)
//!   flags        u8       bit 0 healthy, bit 1 metrics valid, bit 2 events connected
//!   capacity     u32      num_gpu_blocks (0 = unknown)
//!   block_size   u16      tokens per block (0 = unknown)
//!   waiting      f32      vllm:num_requests_waiting
//!   running      f32      vllm:num_requests_running
//!   kv_usage     f32      vllm:kv_cache_usage_perc, 0..1
//!   prefill_tps  f32      observed uncached prompt tokens per second of prefill (0 = unknown)
//!   metrics_age  u32      ms since the last good scrape (u32::MAX = never)
//!   resident     u32      blocks held now per the events (0 without events)
//!   stored_total u64      blocks stored per the events since the sidecar started
//!   removed_total u64     blocks removed per the events since the sidecar started
//!   cleared_total u32     AllBlocksCleared seen since the sidecar started
//!   event_gaps   u32      sequence gaps seen (replayed or not)
//! n_images     u32
//!   worker       u32      index into this answer's worker list
//!   image        u64      the router's image key (`MediaId::key64`)
//!   blocks       u32      blocks carrying the image the worker holds now (0 = none left)
//! ```
//!
//! Decoding is strict and bounded: every length is checked against the bytes that remain
//! before anything is allocated, so a hostile or truncated answer costs at most its own size
//! and is a [`FeedError`], never a panic. Flag bits this version does not define are ignored.
//! A non-finite float, a name or address outside its syntax, a duplicate worker name, an image
//! entry pointing past the worker list, and bytes after the last entry are errors: the sidecar
//! never writes them, so they mean a corrupt or foreign answer.
//! Within one answer each (worker, image) pair appears at most once.

use std::fmt;
use std::net::SocketAddr;

/// The first four bytes of every feed.
pub const MAGIC: [u8; 4] = *b"MMRF";
/// The version this module writes and reads.
pub const VERSION: u16 = 1;
/// The HTTP content type of a feed answer.
pub const CONTENT_TYPE: &str = "application/x-mmrouter-feed";
/// `metrics_age_ms` of a worker never scraped successfully.
pub const AGE_NEVER: u32 = u32::MAX;
/// Longest worker name, in bytes.
pub const MAX_NAME_BYTES: usize = 64;

const FLAG_SNAPSHOT: u16 = 1;
const WORKER_HEALTHY: u8 = 1;
const WORKER_METRICS_VALID: u8 = 1 << 1;
const WORKER_EVENTS_CONNECTED: u8 = 1 << 2;

/// Bytes of the fixed header (magic to n_workers).
const HEADER_BYTES: usize = 4 + 2 + 2 + 8 + 8 + 8 + 4;
/// Bytes of a worker entry besides its name and address bytes.
const WORKER_FIXED_BYTES: usize = 1 + 1 + 1 + 4 + 2 + 4 * 4 + 4 + 4 + 8 + 8 + 4 + 4;
/// Smallest worker entry: a one-byte name and a 9-byte address ("1.2.3.4:5").
const WORKER_MIN_BYTES: usize = WORKER_FIXED_BYTES + 1 + 9;
/// Bytes of an image entry.
const IMAGE_BYTES: usize = 4 + 8 + 4;

/// One answer of `GET /v1/feed`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Feed {
    /// The images are the full residency (not changes since a cursor).
    pub snapshot: bool,
    /// Random per sidecar start.
    pub epoch: u64,
    /// Pass back as `?since=` on the next poll.
    pub cursor: u64,
    /// The sidecar's clock, ms since the Unix epoch.
    pub now_ms: u64,
    /// The complete current membership.
    pub workers: Vec<FeedWorker>,
    /// Image residency: changes since the cursor asked for, or all of it with `snapshot`.
    pub images: Vec<ImageResidency>,
}

/// One worker as the sidecar sees it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FeedWorker {
    /// 1-64 chars of `[A-Za-z0-9_.-]`, unique in the feed.
    pub name: String,
    /// `ip:port` of the worker's HTTP server (`[ip]:port` for IPv6).
    pub address: String,
    /// The last `/metrics` scrape succeeded and the worker is not failing.
    pub healthy: bool,
    /// `waiting`, `running`, `kv_usage`, `capacity`, `block_size` come from a scrape.
    pub metrics_valid: bool,
    /// A KV-event subscription to the worker is live.
    pub events_connected: bool,
    /// `num_gpu_blocks` from `vllm:cache_config_info` (0 = unknown).
    pub capacity: u32,
    /// `block_size` from `vllm:cache_config_info` (0 = unknown).
    pub block_size: u16,
    pub waiting: f32,
    pub running: f32,
    /// 0..1.
    pub kv_usage: f32,
    /// Observed prefill speed, uncached prompt tokens per second (0 = unknown).
    pub prefill_tps: f32,
    /// ms since the last good scrape ([`AGE_NEVER`] = never).
    pub metrics_age_ms: u32,
    /// Blocks the worker holds now per its events.
    pub resident: u32,
    /// Blocks stored per events since the sidecar started (monotonic).
    pub stored_total: u64,
    /// Blocks removed per events since the sidecar started (monotonic).
    pub removed_total: u64,
    /// `AllBlocksCleared` events since the sidecar started (monotonic).
    pub cleared_total: u32,
    /// Event sequence gaps seen (monotonic, replayed or not).
    pub event_gaps: u32,
}

/// How many blocks carrying one image one worker holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ImageResidency {
    /// Index into [`Feed::workers`].
    pub worker: u32,
    /// The router's image key (`MediaId::key64`).
    pub image: u64,
    /// 0 = none left.
    pub blocks: u32,
}

/// Why bytes are not a feed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FeedError {
    /// The bytes end inside `what`.
    Truncated { what: &'static str, offset: usize },
    /// The first four bytes are not "MMRF".
    BadMagic,
    /// A version this decoder does not read.
    UnsupportedVersion(u16),
    /// A count that the remaining bytes cannot hold.
    CountTooLarge {
        what: &'static str,
        count: u32,
        remaining: usize,
    },
    /// A worker name that is empty, longer than 64 bytes or outside `[A-Za-z0-9_.-]`.
    BadWorkerName { index: usize },
    /// A worker address that is not `ip:port`.
    BadWorkerAddress { index: usize },
    /// Two workers with one name.
    DuplicateWorker { index: usize },
    /// A NaN or infinite metric.
    NonFinite { index: usize, field: &'static str },
    /// An image entry whose worker index is past the worker list.
    WorkerOutOfRange {
        entry: usize,
        worker: u32,
        workers: usize,
    },
    /// Bytes after the last image entry.
    TrailingBytes(usize),
}

impl fmt::Display for FeedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FeedError::Truncated { what, offset } => {
                write!(f, "feed truncated in {what} at byte {offset}")
            }
            FeedError::BadMagic => f.write_str("not an mmrouter feed (magic is not \"MMRF\")"),
            FeedError::UnsupportedVersion(v) => write!(
                f,
                "feed version {v} is not supported (this build reads version {VERSION})"
            ),
            FeedError::CountTooLarge {
                what,
                count,
                remaining,
            } => write!(
                f,
                "feed declares {count} {what} but only {remaining} bytes remain"
            ),
            FeedError::BadWorkerName { index } => write!(
                f,
                "worker {index}: name must be 1-{MAX_NAME_BYTES} chars of [A-Za-z0-9_.-]"
            ),
            FeedError::BadWorkerAddress { index } => {
                write!(f, "worker {index}: address is not ip:port")
            }
            FeedError::DuplicateWorker { index } => {
                write!(f, "worker {index}: name already used by an earlier worker")
            }
            FeedError::NonFinite { index, field } => {
                write!(f, "worker {index}: {field} is not a finite number")
            }
            FeedError::WorkerOutOfRange {
                entry,
                worker,
                workers,
            } => write!(
                f,
                "image entry {entry}: worker index {worker} but the feed has {workers} workers"
            ),
            FeedError::TrailingBytes(n) => write!(f, "{n} bytes after the last image entry"),
        }
    }
}

impl std::error::Error for FeedError {}

/// Whether `name` is a valid worker name: 1-64 chars of `[A-Za-z0-9_.-]`.
pub fn valid_worker_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// Whether `address` is `ip:port` (`[ip]:port` for IPv6).
pub fn valid_worker_address(address: &str) -> bool {
    address.len() <= usize::from(u8::MAX) && address.parse::<SocketAddr>().is_ok()
}

impl Feed {
    /// The checks [`decode`] makes, on a feed about to be encoded: names, addresses,
    /// duplicates, finite metrics, image worker indexes.
    pub fn validate(&self) -> Result<(), FeedError> {
        let mut names: Vec<&str> = Vec::with_capacity(self.workers.len());
        for (index, w) in self.workers.iter().enumerate() {
            w.validate(index)?;
            names.push(&w.name);
        }
        names.sort_unstable();
        if let Some(pos) = names.windows(2).position(|p| p.first() == p.get(1)) {
            // Report the later of the two in list order.
            let dup = names.get(pos).copied().unwrap_or_default();
            let index = self
                .workers
                .iter()
                .enumerate()
                .filter(|(_, w)| w.name == dup)
                .map(|(i, _)| i)
                .nth(1)
                .unwrap_or(pos);
            return Err(FeedError::DuplicateWorker { index });
        }
        for (entry, e) in self.images.iter().enumerate() {
            if e.worker as usize >= self.workers.len() {
                return Err(FeedError::WorkerOutOfRange {
                    entry,
                    worker: e.worker,
                    workers: self.workers.len(),
                });
            }
        }
        Ok(())
    }
}

impl FeedWorker {
    fn validate(&self, index: usize) -> Result<(), FeedError> {
        if !valid_worker_name(&self.name) {
            return Err(FeedError::BadWorkerName { index });
        }
        if !valid_worker_address(&self.address) {
            return Err(FeedError::BadWorkerAddress { index });
        }
        for (field, v) in [
            ("waiting", self.waiting),
            ("running", self.running),
            ("kv_usage", self.kv_usage),
            ("prefill_tps", self.prefill_tps),
        ] {
            if !v.is_finite() {
                return Err(FeedError::NonFinite { index, field });
            }
        }
        Ok(())
    }
}

/// Encodes a feed. The sidecar only encodes feeds that pass [`Feed::validate`]; for one that
/// does not, names and addresses longer than 255 bytes are cut and non-finite floats are
/// written as 0, so the output is always well-framed (though [`decode`] may refuse it).
pub fn encode(feed: &Feed) -> Vec<u8> {
    let strings: usize = feed
        .workers
        .iter()
        .map(|w| w.name.len().min(255) + w.address.len().min(255))
        .sum();
    let mut out = Vec::with_capacity(
        HEADER_BYTES
            + 4
            + feed.workers.len() * (WORKER_FIXED_BYTES)
            + strings
            + feed.images.len() * IMAGE_BYTES,
    );
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    let flags = if feed.snapshot { FLAG_SNAPSHOT } else { 0 };
    out.extend_from_slice(&flags.to_le_bytes());
    out.extend_from_slice(&feed.epoch.to_le_bytes());
    out.extend_from_slice(&feed.cursor.to_le_bytes());
    out.extend_from_slice(&feed.now_ms.to_le_bytes());
    out.extend_from_slice(&count_u32(feed.workers.len()).to_le_bytes());
    for w in &feed.workers {
        put_short_str(&mut out, &w.name);
        put_short_str(&mut out, &w.address);
        let mut flags = 0u8;
        if w.healthy {
            flags |= WORKER_HEALTHY;
        }
        if w.metrics_valid {
            flags |= WORKER_METRICS_VALID;
        }
        if w.events_connected {
            flags |= WORKER_EVENTS_CONNECTED;
        }
        out.push(flags);
        out.extend_from_slice(&w.capacity.to_le_bytes());
        out.extend_from_slice(&w.block_size.to_le_bytes());
        for v in [w.waiting, w.running, w.kv_usage, w.prefill_tps] {
            let v = if v.is_finite() { v } else { 0.0 };
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&w.metrics_age_ms.to_le_bytes());
        out.extend_from_slice(&w.resident.to_le_bytes());
        out.extend_from_slice(&w.stored_total.to_le_bytes());
        out.extend_from_slice(&w.removed_total.to_le_bytes());
        out.extend_from_slice(&w.cleared_total.to_le_bytes());
        out.extend_from_slice(&w.event_gaps.to_le_bytes());
    }
    // More than u32::MAX entries cannot be framed; write as many as the count says.
    let n_images = count_u32(feed.images.len());
    out.extend_from_slice(&n_images.to_le_bytes());
    for e in feed.images.iter().take(n_images as usize) {
        out.extend_from_slice(&e.worker.to_le_bytes());
        out.extend_from_slice(&e.image.to_le_bytes());
        out.extend_from_slice(&e.blocks.to_le_bytes());
    }
    out
}

fn count_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Writes a u8 length and the bytes, cut to 255 bytes at a char boundary.
fn put_short_str(out: &mut Vec<u8>, s: &str) {
    let mut end = s.len().min(255);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    let bytes = s.as_bytes().get(..end).unwrap_or_default();
    out.push(bytes.len() as u8);
    out.extend_from_slice(bytes);
}

/// Decodes a feed (see the module docs for what is refused).
pub fn decode(bytes: &[u8]) -> Result<Feed, FeedError> {
    let mut r = Reader { bytes, pos: 0 };
    if r.take(4, "magic")? != MAGIC {
        return Err(FeedError::BadMagic);
    }
    let version = r.u16("version")?;
    if version != VERSION {
        return Err(FeedError::UnsupportedVersion(version));
    }
    let flags = r.u16("flags")?;
    let epoch = r.u64("epoch")?;
    let cursor = r.u64("cursor")?;
    let now_ms = r.u64("now_ms")?;
    let n_workers = r.u32("n_workers")?;
    r.check_count("workers", n_workers, WORKER_MIN_BYTES)?;
    let mut workers: Vec<FeedWorker> = Vec::with_capacity(n_workers as usize);
    for index in 0..n_workers as usize {
        let name = r.short_str("worker name")?;
        let address = r.short_str("worker address")?;
        let flags = r.u8("worker flags")?;
        let w = FeedWorker {
            name,
            address,
            healthy: flags & WORKER_HEALTHY != 0,
            metrics_valid: flags & WORKER_METRICS_VALID != 0,
            events_connected: flags & WORKER_EVENTS_CONNECTED != 0,
            capacity: r.u32("capacity")?,
            block_size: r.u16("block_size")?,
            waiting: r.f32("waiting")?,
            running: r.f32("running")?,
            kv_usage: r.f32("kv_usage")?,
            prefill_tps: r.f32("prefill_tps")?,
            metrics_age_ms: r.u32("metrics_age")?,
            resident: r.u32("resident")?,
            stored_total: r.u64("stored_total")?,
            removed_total: r.u64("removed_total")?,
            cleared_total: r.u32("cleared_total")?,
            event_gaps: r.u32("event_gaps")?,
        };
        w.validate(index)?;
        workers.push(w);
    }
    let n_images = r.u32("n_images")?;
    r.check_count("images", n_images, IMAGE_BYTES)?;
    let mut images = Vec::with_capacity(n_images as usize);
    for entry in 0..n_images as usize {
        let e = ImageResidency {
            worker: r.u32("image worker")?,
            image: r.u64("image key")?,
            blocks: r.u32("image blocks")?,
        };
        if e.worker as usize >= workers.len() {
            return Err(FeedError::WorkerOutOfRange {
                entry,
                worker: e.worker,
                workers: workers.len(),
            });
        }
        images.push(e);
    }
    let rest = bytes.len().saturating_sub(r.pos);
    if rest != 0 {
        return Err(FeedError::TrailingBytes(rest));
    }
    let feed = Feed {
        snapshot: flags & FLAG_SNAPSHOT != 0,
        epoch,
        cursor,
        now_ms,
        workers,
        images,
    };
    // Per-worker checks ran above; this adds the duplicate-name check.
    feed.validate()?;
    Ok(feed)
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], FeedError> {
        let end = self.pos.checked_add(n);
        let slice = end.and_then(|end| self.bytes.get(self.pos..end));
        match (slice, end) {
            (Some(s), Some(end)) => {
                self.pos = end;
                Ok(s)
            }
            _ => Err(FeedError::Truncated {
                what,
                offset: self.pos,
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], FeedError> {
        let s = self.take(N, what)?;
        <[u8; N]>::try_from(s).map_err(|_| FeedError::Truncated {
            what,
            offset: self.pos,
        })
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, FeedError> {
        Ok(u8::from_le_bytes(self.array(what)?))
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, FeedError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, FeedError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, FeedError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
    fn f32(&mut self, what: &'static str) -> Result<f32, FeedError> {
        Ok(f32::from_le_bytes(self.array(what)?))
    }

    /// A u8 length and that many bytes; non-UTF-8 is returned as a name/address error later
    /// (lossily converted, so the check fails on the replacement character).
    fn short_str(&mut self, what: &'static str) -> Result<String, FeedError> {
        let n = self.u8(what)?;
        let b = self.take(usize::from(n), what)?;
        Ok(String::from_utf8_lossy(b).into_owned())
    }

    /// Refuses a count whose entries (at least `min_bytes` each) cannot fit in the rest.
    fn check_count(
        &self,
        what: &'static str,
        count: u32,
        min_bytes: usize,
    ) -> Result<(), FeedError> {
        let remaining = self.bytes.len().saturating_sub(self.pos);
        if (count as usize).saturating_mul(min_bytes) > remaining {
            return Err(FeedError::CountTooLarge {
                what,
                count,
                remaining,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn worker(name: &str, address: &str) -> FeedWorker {
        FeedWorker {
            name: name.into(),
            address: address.into(),
            healthy: true,
            metrics_valid: true,
            events_connected: false,
            capacity: 4096,
            block_size: 16,
            waiting: 2.0,
            running: 7.0,
            kv_usage: 0.25,
            prefill_tps: 12_345.5,
            metrics_age_ms: 37,
            resident: 1234,
            stored_total: 1 << 40,
            removed_total: 99,
            cleared_total: 1,
            event_gaps: 3,
        }
    }

    fn sample() -> Feed {
        Feed {
            snapshot: true,
            epoch: 0xdead_beef_0123_4567,
            cursor: 42,
            now_ms: 1_760_000_000_000,
            workers: vec![
                worker("w0", "10.0.0.1:8000"),
                FeedWorker {
                    metrics_age_ms: AGE_NEVER,
                    healthy: false,
                    metrics_valid: false,
                    events_connected: true,
                    ..worker("pod-b.ns_1", "[fd00::1]:8000")
                },
            ],
            images: vec![
                ImageResidency {
                    worker: 0,
                    image: u64::MAX,
                    blocks: 7,
                },
                ImageResidency {
                    worker: 1,
                    image: 5,
                    blocks: 0,
                },
            ],
        }
    }

    #[test]
    fn round_trips_every_field() {
        let feed = sample();
        let bytes = encode(&feed);
        assert_eq!(decode(&bytes), Ok(feed));
    }

    #[test]
    fn layout_is_little_endian_as_documented() {
        let feed = Feed {
            snapshot: true,
            epoch: 0x0102_0304_0506_0708,
            cursor: 9,
            now_ms: 10,
            workers: vec![],
            images: vec![],
        };
        let b = encode(&feed);
        let mut want = b"MMRF".to_vec();
        want.extend_from_slice(&[1, 0, 1, 0]);
        want.extend_from_slice(&[8, 7, 6, 5, 4, 3, 2, 1]);
        want.extend_from_slice(&[9, 0, 0, 0, 0, 0, 0, 0]);
        want.extend_from_slice(&[10, 0, 0, 0, 0, 0, 0, 0]);
        want.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(b, want);
        // One worker entry: 2 + name + address + fixed bytes.
        let one = encode(&Feed {
            workers: vec![worker("w", "1.2.3.4:5")],
            ..feed
        });
        assert_eq!(one.len(), want.len() + 2 + 1 + 9 + WORKER_FIXED_BYTES - 2);
        assert_eq!(
            WORKER_FIXED_BYTES - 2,
            1 + 4 + 2 + 16 + 4 + 4 + 8 + 8 + 4 + 4
        );
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = encode(&sample());
        for n in 0..bytes.len() {
            let cut = bytes.get(..n).unwrap();
            assert!(decode(cut).is_err(), "prefix of {n} bytes decoded");
        }
    }

    #[test]
    fn other_versions_and_magic_are_clear_errors() {
        let mut bytes = encode(&sample());
        bytes[4] = 2;
        assert_eq!(decode(&bytes), Err(FeedError::UnsupportedVersion(2)));
        assert!(
            decode(&bytes)
                .unwrap_err()
                .to_string()
                .contains("version 2 is not supported")
        );
        bytes[0] = b'X';
        assert_eq!(decode(&bytes), Err(FeedError::BadMagic));
    }

    #[test]
    fn huge_declared_counts_are_refused_before_allocating() {
        let mut bytes = encode(&Feed::default());
        // n_workers = u32::MAX with nothing after it.
        let at = HEADER_BYTES - 4;
        bytes[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            decode(&bytes),
            Err(FeedError::CountTooLarge {
                what: "workers",
                count: u32::MAX,
                ..
            })
        ));
        let mut bytes = encode(&Feed::default());
        let n = bytes.len();
        bytes[n - 4..].copy_from_slice(&1000u32.to_le_bytes());
        bytes.extend_from_slice(&[0; 16 * 999]);
        assert!(matches!(
            decode(&bytes),
            Err(FeedError::CountTooLarge { what: "images", .. })
        ));
    }

    #[test]
    fn image_entry_past_the_worker_list_is_refused() {
        let mut feed = sample();
        feed.images.push(ImageResidency {
            worker: 2,
            image: 1,
            blocks: 1,
        });
        assert!(matches!(
            decode(&encode(&feed)),
            Err(FeedError::WorkerOutOfRange {
                entry: 2,
                worker: 2,
                workers: 2
            })
        ));
    }

    #[test]
    fn bad_names_addresses_duplicates_and_nan_are_refused() {
        let mut feed = sample();
        feed.workers[1].name = "has space".into();
        assert_eq!(
            decode(&encode(&feed)),
            Err(FeedError::BadWorkerName { index: 1 })
        );
        feed.workers[1].name = "x".repeat(65);
        assert_eq!(
            decode(&encode(&feed)),
            Err(FeedError::BadWorkerName { index: 1 })
        );
        feed.workers[1].name = "w0".into();
        assert_eq!(
            decode(&encode(&feed)),
            Err(FeedError::DuplicateWorker { index: 1 })
        );
        let mut feed = sample();
        feed.workers[0].address = "localhost:8000".into();
        assert_eq!(
            decode(&encode(&feed)),
            Err(FeedError::BadWorkerAddress { index: 0 })
        );
        let mut feed = sample();
        feed.workers[0].kv_usage = f32::NAN;
        assert_eq!(
            feed.validate(),
            Err(FeedError::NonFinite {
                index: 0,
                field: "kv_usage"
            })
        );
        // The encoder writes 0 instead, so the bytes still decode.
        assert_eq!(decode(&encode(&feed)).unwrap().workers[0].kv_usage, 0.0);
        let mut bytes = encode(&sample());
        // waiting of worker 0 sits after the header, the name, the address, flags,
        // capacity and block size.
        let at = HEADER_BYTES + 1 + 2 + 1 + 13 + 1 + 4 + 2;
        bytes[at..at + 4].copy_from_slice(&f32::INFINITY.to_le_bytes());
        assert_eq!(
            decode(&bytes),
            Err(FeedError::NonFinite {
                index: 0,
                field: "waiting"
            })
        );
    }

    #[test]
    fn trailing_bytes_and_unknown_flag_bits() {
        let mut bytes = encode(&sample());
        bytes.push(0);
        assert_eq!(decode(&bytes), Err(FeedError::TrailingBytes(1)));
        let mut bytes = encode(&sample());
        bytes[6] |= 0x80; // an undefined feed flag bit
        let f = decode(&bytes).unwrap();
        assert!(f.snapshot);
    }

    fn arb_name() -> impl Strategy<Value = String> {
        "[A-Za-z0-9_.-]{1,64}"
    }

    fn arb_address() -> impl Strategy<Value = String> {
        prop_oneof![
            (any::<[u8; 4]>(), any::<u16>())
                .prop_map(|(ip, port)| { SocketAddr::from((ip, port)).to_string() }),
            (any::<[u16; 8]>(), any::<u16>()).prop_map(|(ip, port)| {
                SocketAddr::from((std::net::Ipv6Addr::from(ip), port)).to_string()
            }),
        ]
    }

    fn arb_f32() -> impl Strategy<Value = f32> {
        prop_oneof![Just(0.0f32), -1e30f32..1e30f32]
    }

    fn arb_worker() -> impl Strategy<Value = FeedWorker> {
        (
            (arb_name(), arb_address(), any::<[bool; 3]>()),
            (
                any::<u32>(),
                any::<u16>(),
                [arb_f32(), arb_f32(), arb_f32(), arb_f32()],
            ),
            (
                any::<u32>(),
                any::<u32>(),
                any::<u64>(),
                any::<u64>(),
                any::<u32>(),
                any::<u32>(),
            ),
        )
            .prop_map(
                |((name, address, flags), (cap, bs, f), (age, res, st, rm, cl, gaps))| FeedWorker {
                    name,
                    address,
                    healthy: flags[0],
                    metrics_valid: flags[1],
                    events_connected: flags[2],
                    capacity: cap,
                    block_size: bs,
                    waiting: f[0],
                    running: f[1],
                    kv_usage: f[2],
                    prefill_tps: f[3],
                    metrics_age_ms: age,
                    resident: res,
                    stored_total: st,
                    removed_total: rm,
                    cleared_total: cl,
                    event_gaps: gaps,
                },
            )
    }

    fn arb_feed() -> impl Strategy<Value = Feed> {
        (
            any::<(bool, u64, u64, u64)>(),
            proptest::collection::vec(arb_worker(), 0..6),
            proptest::collection::vec(any::<(u32, u64, u32)>(), 0..20),
        )
            .prop_map(|((snapshot, epoch, cursor, now_ms), mut workers, images)| {
                // Unique names, as the sidecar guarantees.
                for (i, w) in workers.iter_mut().enumerate() {
                    w.name.truncate(60);
                    w.name.push_str(&format!("-{i}"));
                }
                let n = workers.len() as u32;
                let images = if n == 0 {
                    vec![]
                } else {
                    images
                        .into_iter()
                        .map(|(w, image, blocks)| ImageResidency {
                            worker: w % n,
                            image,
                            blocks,
                        })
                        .collect()
                };
                Feed {
                    snapshot,
                    epoch,
                    cursor,
                    now_ms,
                    workers,
                    images,
                }
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        #[test]
        fn random_feeds_round_trip(feed in arb_feed()) {
            prop_assert_eq!(feed.validate(), Ok(()));
            let bytes = encode(&feed);
            prop_assert_eq!(decode(&bytes), Ok(feed));
        }

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn corrupted_feeds_never_panic(
            feed in arb_feed(),
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
            cut in any::<usize>(),
        ) {
            let mut bytes = encode(&feed);
            for (at, x) in flips {
                let n = bytes.len();
                bytes[at % n] ^= x;
            }
            let cut = cut % (bytes.len() + 1);
            let _ = decode(&bytes[..cut]);
            let _ = decode(&bytes);
        }
    }
}
