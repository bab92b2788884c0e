//! The URL cache (`<ns>.u.<i>`): what the filter learned by fetching an http(s) image, shared by
//! every VM of the Envoy process, so that a URL is fetched once per TTL whichever thread its
//! requests land on.
//!
//! An entry maps a URL (xxh3-128 of its normalised form, [`url_key`]) to one of:
//!
//! - **fetched**: the image's content id (xxh3-128 of its bytes), format, width, height and byte
//!   length, with the time it was fetched and its expiry (`ttl_ms`);
//! - **failed**: why the fetch failed, cached for the short `failure_ttl_ms` so that a dead or
//!   hanging image server costs one timeout per period, not one per request;
//! - **in flight**: a VM is fetching it right now (with the claimer's id and an expiry of its
//!   own, the fetch timeout plus a margin). Other requests for the URL wait for its result
//!   instead of fetching again; a marker whose fetch died with its stream expires, and the next
//!   request claims the URL again.
//!
//! Expired entries read as absent. Nothing is removed on read (reads stay one `get`).
//!
//! **Bounds.** A fixed key space: `buckets` keys, each holding at most `bucket_entries`
//! entries of at most [`MAX_ENTRY_BYTES`] bytes, so the cache holds at most
//! `buckets × bucket_entries` URLs in at most `buckets × (3 + bucket_entries × 62)` bytes of
//! shared data (8,192 URLs in 509 KB at the defaults). A full bucket drops its expired entries
//! first, then the entry written longest ago.
//!
//! **Writes.** Every VM writes (a claim, a result) with a CAS update of one bucket. Envoy checks
//! a CAS token only when the key exists, so every bucket is created empty at configuration time
//! ([`prepare`]; see "First writes" in [`crate::state`]): two VMs claiming the same URL at once
//! then race on the bucket's token, and exactly one of them wins the claim.
//!
//! Value layout, little-endian: `u8 version (1) | u16 entries | entries × ( u128 url | u8 kind |
//! u64 at_ms | u64 expires_ms | payload )`, the payload by kind: 0 fetched `u128 digest | u8
//! format | u32 width | u32 height | u32 bytes`; 1 failed `u8 reason`; 2 in flight `u64 claim`.

use super::wire::Reader;
use super::{Keys, SharedStore, cas_update, ensure_key};
use crate::analysis::FetchedImage;
use crate::config::ConfigError;
use crate::identity::normalise_url;
use crate::image_header::{ImageFormat, ImageInfo};
use xxhash_rust::xxh3::xxh3_128;

/// Sizes and lifetimes of the URL cache (`fetch.cache` in the filter configuration).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct UrlCacheConfig {
    /// Number of buckets, each one shared-data key (default 256).
    pub buckets: u32,
    /// URLs per bucket at most (default 32).
    pub bucket_entries: u16,
    /// How long a fetched image's identity and size are reused, ms (default 300000: 5 min).
    /// The bytes behind a URL may change; within the TTL the router keeps what it fetched.
    pub ttl_ms: u64,
    /// How long a failed fetch is remembered, ms (default 10000): during it, requests with
    /// that URL fall back to the URL identity at once instead of fetching again.
    pub failure_ttl_ms: u64,
}

impl Default for UrlCacheConfig {
    fn default() -> Self {
        UrlCacheConfig {
            buckets: 256,
            bucket_entries: 32,
            ttl_ms: 300_000,
            failure_ttl_ms: 10_000,
        }
    }
}

impl UrlCacheConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=1 << 16).contains(&self.buckets) {
            return Err(ConfigError::new("fetch.cache.buckets", "must be 1..=65536"));
        }
        if !(1..=1024).contains(&self.bucket_entries) {
            return Err(ConfigError::new(
                "fetch.cache.bucket_entries",
                "must be 1..=1024",
            ));
        }
        if self.ttl_ms == 0 || self.failure_ttl_ms == 0 {
            return Err(ConfigError::new(
                "fetch.cache.ttl_ms",
                "ttl_ms and failure_ttl_ms must be > 0",
            ));
        }
        Ok(())
    }

    pub fn bucket_of(&self, url: u128) -> u32 {
        let mixed = (url as u64) ^ ((url >> 64) as u64);
        (mixed % u64::from(self.buckets.max(1))) as u32
    }

    /// The most bytes of shared data the cache can take.
    pub fn max_bytes(&self) -> usize {
        self.buckets as usize * (3 + usize::from(self.bucket_entries) * MAX_ENTRY_BYTES)
    }
}

/// The cache key of a URL: xxh3-128 of its normalised form (the same normalisation as
/// [`crate::identity::MediaId::of_url`]: scheme and host lowercased, default port and fragment
/// dropped).
pub fn url_key(url: &str) -> u128 {
    xxh3_128(normalise_url(url).as_bytes())
}

/// One cache entry's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UrlState {
    Fetched(FetchedImage),
    /// A failure, by its code (the fetch module names the codes).
    Failed(u8),
    /// Being fetched by the request that holds claim `claim`.
    InFlight {
        claim: u64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UrlEntry {
    pub url: u128,
    pub state: UrlState,
    /// When the entry was written (fetched, failed, or claimed), ms since the epoch.
    pub at_ms: u64,
    pub expires_ms: u64,
}

/// The largest entry, in bytes (a fetched one).
pub const MAX_ENTRY_BYTES: usize = 16 + 1 + 8 + 8 + 16 + 1 + 4 + 4 + 4;

const VERSION: u8 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UrlBucket {
    pub entries: Vec<UrlEntry>,
}

fn format_code(f: ImageFormat) -> u8 {
    match f {
        ImageFormat::Png => 0,
        ImageFormat::Jpeg => 1,
        ImageFormat::Webp => 2,
        ImageFormat::Gif => 3,
    }
}

fn format_of(code: u8) -> Option<ImageFormat> {
    Some(match code {
        0 => ImageFormat::Png,
        1 => ImageFormat::Jpeg,
        2 => ImageFormat::Webp,
        3 => ImageFormat::Gif,
        _ => return None,
    })
}

impl UrlBucket {
    /// Decodes a bucket; anything malformed (or of another version) reads as empty.
    pub fn decode(bytes: &[u8]) -> UrlBucket {
        let mut r = Reader::new(bytes);
        let mut entries = Vec::new();
        let ok = (|| {
            if r.u8()? != VERSION {
                return None;
            }
            for _ in 0..r.u16()? {
                let url = r.u128()?;
                let kind = r.u8()?;
                let at_ms = r.u64()?;
                let expires_ms = r.u64()?;
                let state = match kind {
                    0 => UrlState::Fetched(FetchedImage {
                        digest: r.u128()?,
                        info: {
                            let format = format_of(r.u8()?)?;
                            ImageInfo {
                                format,
                                width: r.u32()?,
                                height: r.u32()?,
                            }
                        },
                        bytes: r.u32()?,
                    }),
                    1 => UrlState::Failed(r.u8()?),
                    2 => UrlState::InFlight { claim: r.u64()? },
                    _ => return None,
                };
                entries.push(UrlEntry {
                    url,
                    state,
                    at_ms,
                    expires_ms,
                });
            }
            Some(())
        })();
        match ok {
            Some(()) => UrlBucket { entries },
            None => UrlBucket::default(),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let n = self.entries.len().min(usize::from(u16::MAX));
        let mut out = Vec::with_capacity(3 + n * MAX_ENTRY_BYTES);
        out.push(VERSION);
        out.extend_from_slice(&(n as u16).to_le_bytes());
        for e in self.entries.iter().take(n) {
            out.extend_from_slice(&e.url.to_le_bytes());
            out.push(match e.state {
                UrlState::Fetched(_) => 0,
                UrlState::Failed(_) => 1,
                UrlState::InFlight { .. } => 2,
            });
            out.extend_from_slice(&e.at_ms.to_le_bytes());
            out.extend_from_slice(&e.expires_ms.to_le_bytes());
            match e.state {
                UrlState::Fetched(f) => {
                    out.extend_from_slice(&f.digest.to_le_bytes());
                    out.push(format_code(f.info.format));
                    out.extend_from_slice(&f.info.width.to_le_bytes());
                    out.extend_from_slice(&f.info.height.to_le_bytes());
                    out.extend_from_slice(&f.bytes.to_le_bytes());
                }
                UrlState::Failed(code) => out.push(code),
                UrlState::InFlight { claim } => out.extend_from_slice(&claim.to_le_bytes()),
            }
        }
        out
    }

    /// The live (unexpired) entry for `url`.
    pub fn live(&self, url: u128, now_ms: u64) -> Option<&UrlEntry> {
        self.entries
            .iter()
            .find(|e| e.url == url && e.expires_ms > now_ms)
    }

    /// Puts `entry` in place of any entry for its URL, making room when the bucket is full:
    /// expired entries go first, then the one written longest ago.
    pub fn put(&mut self, entry: UrlEntry, capacity: u16, now_ms: u64) {
        self.entries.retain(|e| e.url != entry.url);
        let capacity = usize::from(capacity.max(1));
        if self.entries.len() >= capacity {
            self.entries.retain(|e| e.expires_ms > now_ms);
        }
        while self.entries.len() >= capacity {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.at_ms)
                .map(|(i, _)| i);
            match oldest {
                Some(i) => {
                    self.entries.remove(i);
                }
                None => break,
            }
        }
        self.entries.push(entry);
    }
}

/// Creates every bucket, empty, if it does not exist yet (at configuration time, before
/// traffic). False when a host call failed.
pub fn prepare(store: &dyn SharedStore, keys: &Keys, config: &UrlCacheConfig) -> bool {
    let empty = UrlBucket::default().encode();
    (0..config.buckets).all(|i| ensure_key(store, &keys.url_bucket(i), &empty))
}

/// What the cache says about a URL now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    Fetched(FetchedImage),
    Failed(u8),
    /// Another request is fetching it; its claim expires at `expires_ms`.
    InFlight {
        expires_ms: u64,
    },
    Miss,
}

impl Lookup {
    fn of(entry: Option<&UrlEntry>) -> Lookup {
        match entry {
            None => Lookup::Miss,
            Some(e) => match e.state {
                UrlState::Fetched(f) => Lookup::Fetched(f),
                UrlState::Failed(code) => Lookup::Failed(code),
                UrlState::InFlight { .. } => Lookup::InFlight {
                    expires_ms: e.expires_ms,
                },
            },
        }
    }
}

/// Reads what the cache holds for `url` (one `get`). A read error is a miss.
pub fn lookup(
    store: &dyn SharedStore,
    keys: &Keys,
    config: &UrlCacheConfig,
    url: u128,
    now_ms: u64,
) -> Lookup {
    let key = keys.url_bucket(config.bucket_of(url));
    match store.get(&key) {
        Ok(Some((bytes, _))) => Lookup::of(UrlBucket::decode(&bytes).live(url, now_ms)),
        _ => Lookup::Miss,
    }
}

/// The result of trying to claim a URL for fetching.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// This request now holds the URL: it fetches, then [`record`]s the result.
    Claimed,
    /// The URL has a live entry (fetched, failed, or claimed by someone else): no claim.
    Taken(Lookup),
    /// The bucket could not be written (a host error, or CAS races lost every retry).
    Failed,
}

/// Claims `url` for the request holding `claim` until `now_ms + hold_ms`, unless the cache
/// already has a live entry for it. One CAS update: of two requests that both saw a miss,
/// exactly one claims.
pub fn claim(
    store: &dyn SharedStore,
    keys: &Keys,
    config: &UrlCacheConfig,
    url: u128,
    claim: u64,
    now_ms: u64,
    hold_ms: u64,
) -> Claim {
    let key = keys.url_bucket(config.bucket_of(url));
    let mut seen = Lookup::Miss;
    let written = cas_update(store, &key, |bytes| {
        let mut bucket = UrlBucket::decode(bytes);
        seen = Lookup::of(bucket.live(url, now_ms));
        if seen != Lookup::Miss {
            return None;
        }
        bucket.put(
            UrlEntry {
                url,
                state: UrlState::InFlight { claim },
                at_ms: now_ms,
                expires_ms: now_ms.saturating_add(hold_ms),
            },
            config.bucket_entries,
            now_ms,
        );
        Some(bucket.encode())
    });
    match (written, seen) {
        (false, _) => Claim::Failed,
        (true, Lookup::Miss) => Claim::Claimed,
        (true, other) => Claim::Taken(other),
    }
}

/// Extends the claim on `url` held by `claim` to `now_ms + hold_ms` (a redirect's next hop).
/// False when the claim is gone (expired and taken by another request, or the write failed).
pub fn extend(
    store: &dyn SharedStore,
    keys: &Keys,
    config: &UrlCacheConfig,
    url: u128,
    claim: u64,
    now_ms: u64,
    hold_ms: u64,
) -> bool {
    let key = keys.url_bucket(config.bucket_of(url));
    let mut held = false;
    let written = cas_update(store, &key, |bytes| {
        let mut bucket = UrlBucket::decode(bytes);
        let entry = bucket
            .entries
            .iter_mut()
            .find(|e| e.url == url && e.state == UrlState::InFlight { claim });
        held = entry.is_some();
        let e = entry?;
        e.expires_ms = now_ms.saturating_add(hold_ms);
        Some(bucket.encode())
    });
    written && held
}

/// Records a fetch's result for `url` (fetched: for `config.ttl_ms`; failed: for
/// `config.failure_ttl_ms`), replacing whatever entry the URL had. False when the write failed.
pub fn record(
    store: &dyn SharedStore,
    keys: &Keys,
    config: &UrlCacheConfig,
    url: u128,
    state: UrlState,
    now_ms: u64,
) -> bool {
    let ttl = match state {
        UrlState::Fetched(_) => config.ttl_ms,
        UrlState::Failed(_) | UrlState::InFlight { .. } => config.failure_ttl_ms,
    };
    let key = keys.url_bucket(config.bucket_of(url));
    cas_update(store, &key, |bytes| {
        let mut bucket = UrlBucket::decode(bytes);
        bucket.put(
            UrlEntry {
                url,
                state,
                at_ms: now_ms,
                expires_ms: now_ms.saturating_add(ttl),
            },
            config.bucket_entries,
            now_ms,
        );
        Some(bucket.encode())
    })
}

/// Drops the claim on `url` held by `claim`, if it still holds (a request that ended before
/// its fetch did: the next request claims the URL at once instead of waiting for the marker to
/// expire).
pub fn release(
    store: &dyn SharedStore,
    keys: &Keys,
    config: &UrlCacheConfig,
    url: u128,
    claim: u64,
) -> bool {
    let key = keys.url_bucket(config.bucket_of(url));
    cas_update(store, &key, |bytes| {
        let mut bucket = UrlBucket::decode(bytes);
        let before = bucket.entries.len();
        bucket
            .entries
            .retain(|e| !(e.url == url && e.state == UrlState::InFlight { claim }));
        (bucket.entries.len() != before).then(|| bucket.encode())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::MemoryStore;

    fn keys() -> Keys {
        Keys::new(7)
    }

    fn fetched(digest: u128) -> UrlState {
        UrlState::Fetched(FetchedImage {
            digest,
            info: ImageInfo {
                format: ImageFormat::Jpeg,
                width: 640,
                height: 480,
            },
            bytes: 12345,
        })
    }

    #[test]
    fn entries_round_trip_and_garbage_reads_as_empty() {
        let mut b = UrlBucket::default();
        b.put(
            UrlEntry {
                url: 1 << 100 | 5,
                state: fetched(u128::MAX - 3),
                at_ms: 10,
                expires_ms: 20,
            },
            4,
            0,
        );
        b.put(
            UrlEntry {
                url: 2,
                state: UrlState::Failed(3),
                at_ms: 11,
                expires_ms: 21,
            },
            4,
            0,
        );
        b.put(
            UrlEntry {
                url: 3,
                state: UrlState::InFlight { claim: 99 },
                at_ms: 12,
                expires_ms: 22,
            },
            4,
            0,
        );
        let bytes = b.encode();
        assert!(bytes.len() <= 3 + 3 * MAX_ENTRY_BYTES);
        assert_eq!(UrlBucket::decode(&bytes), b);
        assert_eq!(
            UrlBucket::decode(&bytes[..bytes.len() - 1]),
            UrlBucket::default()
        );
        assert_eq!(UrlBucket::decode(b"\x02\x00\x00"), UrlBucket::default());
        assert_eq!(UrlBucket::decode(b""), UrlBucket::default());
    }

    #[test]
    fn a_full_bucket_drops_expired_entries_then_the_oldest() {
        let mut b = UrlBucket::default();
        let entry = |url, at_ms, expires_ms| UrlEntry {
            url,
            state: UrlState::Failed(0),
            at_ms,
            expires_ms,
        };
        b.put(entry(1, 100, 1000), 3, 100);
        b.put(entry(2, 50, 200), 3, 100);
        b.put(entry(3, 300, 1000), 3, 300);
        // Full: 2 has expired at 500, so it goes, not 1 (older but live).
        b.put(entry(4, 500, 1000), 3, 500);
        let urls: Vec<u128> = b.entries.iter().map(|e| e.url).collect();
        assert_eq!(urls, vec![1, 3, 4]);
        // Full, nothing expired: the oldest write (1) goes.
        b.put(entry(5, 600, 1000), 3, 600);
        let urls: Vec<u128> = b.entries.iter().map(|e| e.url).collect();
        assert_eq!(urls, vec![3, 4, 5]);
        // A URL already present is replaced, not duplicated.
        b.put(entry(4, 700, 2000), 3, 700);
        assert_eq!(b.entries.len(), 3);
        assert_eq!(b.live(4, 1500).map(|e| e.at_ms), Some(700));
        assert_eq!(b.live(3, 1500), None, "expired entries read as absent");
    }

    #[test]
    fn one_of_two_claimers_wins_and_the_other_sees_the_claim() {
        let s = MemoryStore::default();
        let cfg = UrlCacheConfig::default();
        assert!(prepare(&s, &keys(), &cfg));
        assert_eq!(s.keys(), cfg.buckets as usize);
        let url = url_key("http://example.com/a.png");
        assert_eq!(lookup(&s, &keys(), &cfg, url, 1000), Lookup::Miss);
        assert_eq!(claim(&s, &keys(), &cfg, url, 1, 1000, 500), Claim::Claimed);
        assert_eq!(
            claim(&s, &keys(), &cfg, url, 2, 1001, 500),
            Claim::Taken(Lookup::InFlight { expires_ms: 1500 })
        );
        // The marker expires: the next claimer takes the URL over.
        assert_eq!(lookup(&s, &keys(), &cfg, url, 1500), Lookup::Miss);
        assert_eq!(claim(&s, &keys(), &cfg, url, 2, 1500, 500), Claim::Claimed);
        assert!(!extend(&s, &keys(), &cfg, url, 1, 1600, 500), "1 lost it");
        assert!(extend(&s, &keys(), &cfg, url, 2, 1600, 500));
        assert_eq!(
            lookup(&s, &keys(), &cfg, url, 1601),
            Lookup::InFlight { expires_ms: 2100 }
        );
    }

    #[test]
    fn a_cas_race_on_the_bucket_leaves_exactly_one_claim() {
        // Two VMs read the bucket, both see a miss; the first write wins, the second's CAS
        // fails, it re-reads and sees the claim.
        struct Racing<'a> {
            inner: &'a MemoryStore,
            raced: std::cell::Cell<bool>,
        }
        impl SharedStore for Racing<'_> {
            fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, crate::state::StoreError> {
                let got = self.inner.get(key);
                if !self.raced.replace(true) {
                    // The other VM claims between this read and our write.
                    let cfg = UrlCacheConfig::default();
                    let url = url_key("http://example.com/a.png");
                    assert_eq!(
                        claim(self.inner, &keys(), &cfg, url, 7, 1000, 500),
                        Claim::Claimed
                    );
                }
                got
            }
            fn set(
                &self,
                key: &str,
                value: &[u8],
                cas: Option<u32>,
            ) -> Result<(), crate::state::StoreError> {
                self.inner.set(key, value, cas)
            }
            fn enqueue(&self, q: &str, v: &[u8]) -> Result<(), crate::state::StoreError> {
                self.inner.enqueue(q, v)
            }
            fn dequeue(&self, q: &str) -> Result<Option<Vec<u8>>, crate::state::StoreError> {
                self.inner.dequeue(q)
            }
        }
        let s = MemoryStore::default();
        let cfg = UrlCacheConfig::default();
        assert!(prepare(&s, &keys(), &cfg));
        let racing = Racing {
            inner: &s,
            raced: std::cell::Cell::new(false),
        };
        let url = url_key("http://example.com/a.png");
        assert_eq!(
            claim(&racing, &keys(), &cfg, url, 8, 1000, 500),
            Claim::Taken(Lookup::InFlight { expires_ms: 1500 })
        );
    }

    #[test]
    fn results_replace_the_claim_and_expire_with_their_ttl() {
        let s = MemoryStore::default();
        let cfg = UrlCacheConfig {
            ttl_ms: 1000,
            failure_ttl_ms: 100,
            ..UrlCacheConfig::default()
        };
        assert!(prepare(&s, &keys(), &cfg));
        let (a, b) = (url_key("http://x/a"), url_key("http://x/b"));
        assert_eq!(claim(&s, &keys(), &cfg, a, 1, 0, 500), Claim::Claimed);
        assert!(record(&s, &keys(), &cfg, a, fetched(42), 10));
        assert!(record(&s, &keys(), &cfg, b, UrlState::Failed(2), 10));
        let Lookup::Fetched(f) = lookup(&s, &keys(), &cfg, a, 1009) else {
            panic!("fetched entry expected")
        };
        assert_eq!(f.digest, 42);
        assert_eq!(lookup(&s, &keys(), &cfg, a, 1010), Lookup::Miss, "TTL");
        assert_eq!(lookup(&s, &keys(), &cfg, b, 109), Lookup::Failed(2));
        assert_eq!(
            lookup(&s, &keys(), &cfg, b, 110),
            Lookup::Miss,
            "failure TTL"
        );
    }

    #[test]
    fn a_released_claim_frees_the_url_but_not_another_claimers() {
        let s = MemoryStore::default();
        let cfg = UrlCacheConfig::default();
        assert!(prepare(&s, &keys(), &cfg));
        let url = url_key("http://x/a");
        assert_eq!(claim(&s, &keys(), &cfg, url, 1, 0, 500), Claim::Claimed);
        assert!(release(&s, &keys(), &cfg, url, 2));
        assert!(matches!(
            lookup(&s, &keys(), &cfg, url, 1),
            Lookup::InFlight { .. }
        ));
        assert!(release(&s, &keys(), &cfg, url, 1));
        assert_eq!(lookup(&s, &keys(), &cfg, url, 1), Lookup::Miss);
    }

    #[test]
    fn the_url_key_follows_the_url_identity_normalisation() {
        assert_eq!(
            url_key("HTTP://Example.com:80/a.png#x"),
            url_key("http://example.com/a.png")
        );
        assert_ne!(
            url_key("http://example.com/a.png?sig=1"),
            url_key("http://example.com/a.png?sig=2")
        );
        let cfg = UrlCacheConfig::default();
        assert_eq!(MAX_ENTRY_BYTES, 62);
        assert_eq!(cfg.max_bytes(), 256 * (3 + 32 * 62));
    }
}
