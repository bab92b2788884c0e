//! Target `feed`: the decoder of the sidecar's feed (`GET /v1/feed`, binary).
//!
//! Input: a feed answer. Properties:
//!
//! - a refused answer is a [`FeedError`], never a panic;
//! - an accepted feed passes [`Feed::validate`], holds no more entries than its bytes can
//!   frame, and round-trips: [`encode`] writes exactly as many bytes, which decode to the same
//!   feed, and encoding that is byte-for-byte stable. (An answer may set flag bits this version
//!   does not define; they are ignored, so only those bits may differ from the input.)

use mmrouter::feed::{Feed, FeedError, decode, encode};

/// Bytes of the fixed header and of the smallest worker and image entries (see mmrouter::feed).
const HEADER_BYTES: usize = 4 + 2 + 2 + 8 + 8 + 8 + 4;
/// A worker entry's bytes besides its name and address: two length bytes, then from the flags
/// byte on.
const WORKER_FIXED_BYTES: usize = 2 + WORKER_AFTER_ADDRESS;
const WORKER_AFTER_ADDRESS: usize = 1 + 4 + 2 + 4 * 4 + 4 + 4 + 8 + 8 + 4 + 4;
/// The smallest worker entry: a one-byte name and a 9-byte address (`1.2.3.4:5`).
const WORKER_MIN_BYTES: usize = WORKER_FIXED_BYTES + 1 + 9;
const IMAGE_BYTES: usize = 4 + 8 + 4;

pub fn check(data: &[u8]) -> bool {
    match decode(data) {
        Ok(feed) => accepted(data, &feed),
        Err(e) => refused(&e),
    }
    true
}

fn refused(e: &FeedError) {
    assert!(!e.to_string().is_empty());
}

fn accepted(data: &[u8], feed: &Feed) {
    assert_eq!(feed.validate(), Ok(()));
    assert!(
        feed.workers.len() * WORKER_MIN_BYTES + feed.images.len() * IMAGE_BYTES + HEADER_BYTES + 4
            <= data.len()
    );
    let encoded = encode(feed);
    assert_eq!(encoded.len(), data.len(), "re-encoded length");
    let differing: Vec<usize> = encoded
        .iter()
        .zip(data)
        .enumerate()
        .filter(|(_, (a, b))| a != b)
        .map(|(i, _)| i)
        .collect();
    // Only flag bytes may differ: the header's flags (bytes 6-7) and the workers' flag bytes.
    for &i in &differing {
        assert!(
            (6..8).contains(&i) || worker_flag_offsets(&encoded).contains(&i),
            "byte {i} re-encodes differently"
        );
    }
    let again = decode(&encoded).expect("an encoded feed decodes");
    assert_eq!(&again, feed, "round trip");
    assert_eq!(encode(&again), encoded, "encoding is stable");
}

/// Offsets of the workers' flag bytes in a well-formed feed.
fn worker_flag_offsets(bytes: &[u8]) -> Vec<usize> {
    let mut out = Vec::new();
    let n = u32::from_le_bytes(
        bytes[HEADER_BYTES - 4..HEADER_BYTES]
            .try_into()
            .unwrap_or_default(),
    );
    let mut at = HEADER_BYTES;
    for _ in 0..n {
        let name = usize::from(bytes[at]);
        at += 1 + name;
        let address = usize::from(bytes[at]);
        at += 1 + address;
        out.push(at);
        at += WORKER_AFTER_ADDRESS;
    }
    out
}
