//! Target `state`: the decoders of the shared state's values (`src/state/`), which every VM
//! reads on every request, and the state writer's drain over whatever the store holds.
//!
//! Input: a selector byte, then the value. Properties, per selector (mod 8):
//!
//! 0. block bucket: a malformed value decodes as empty; a decoded bucket re-encodes to the
//!    value's leading bytes (what follows a complete bucket is ignored) and decodes to itself;
//!    [`holders_of`] (the request path's read without decoding) finds each key's holders as
//!    the full decode does, the first entry's when a key repeats;
//! 1. image bucket: the same, and [`resident_blocks`] agrees with the decode;
//! 2. decision record: a record decodes exactly when it re-encodes to the whole value;
//! 3. membership table and 4. live table: a decoded table re-encodes to the value's leading
//!    bytes and decodes to the same bytes again; at most `MAX_SLOTS` slots, none from nothing;
//! 5. load table: as many loads as slots asked for; a value that is a whole number of entries
//!    reads entry by entry, anything else reads as zeros;
//! 6. prefix match ([`match_prefix`]) of keys against buckets that hold the input: one depth
//!    per slot, each at most the number of keys, within the probe budget (+2);
//! 7. the writer's drain of garbage decision records against a garbage live table and
//!    buckets: never more records applied and dropped than queued, and every bucket it writes
//!    is well-formed.
//!
//! Values 6 and 7 are cut into parts by [`parts`] (u16 length prefixes).

use mmrouter::state::blocks::{BlocksConfig, Bucket, holders_of};
use mmrouter::state::decisions::DecisionRecord;
use mmrouter::state::images::{ImageBucket, resident_blocks};
use mmrouter::state::load;
use mmrouter::state::lookup::match_prefix;
use mmrouter::state::workers::{LiveTable, MAX_SLOTS, Members};
use mmrouter::state::writer::drain;
use mmrouter::state::{Keys, MemoryStore, SharedStore, StateConfig};

pub fn check(data: &[u8]) -> bool {
    let Some((&selector, value)) = data.split_first() else {
        return true;
    };
    match selector % 8 {
        0 => block_bucket(value),
        1 => image_bucket(value),
        2 => decision(value),
        3 => members(value),
        4 => live(value),
        5 => loads(value),
        6 => prefix(value),
        _ => drained(value),
    }
    true
}

fn block_bucket(value: &[u8]) {
    let b = Bucket::decode(value);
    if b == Bucket::default() {
        return;
    }
    let encoded = b.encode();
    assert!(value.starts_with(&encoded), "re-encodes to other bytes");
    assert_eq!(Bucket::decode(&encoded), b);
    for e in &b.entries {
        let mut found = Vec::new();
        holders_of(value, e.key, &mut found);
        let first = b
            .entries
            .iter()
            .find(|f| f.key == e.key)
            .map(|f| &f.holders);
        assert_eq!(Some(&found), first, "holders_of {:x}", e.key);
    }
}

fn image_bucket(value: &[u8]) {
    let b = ImageBucket::decode(value);
    if b == ImageBucket::default() {
        return;
    }
    let encoded = b.encode();
    assert!(value.starts_with(&encoded), "re-encodes to other bytes");
    assert_eq!(ImageBucket::decode(&encoded), b);
    for e in &b.entries {
        for h in &e.holders {
            let first = b
                .entries
                .iter()
                .find(|f| f.image == e.image)
                .and_then(|f| {
                    f.holders
                        .iter()
                        .find(|g| g.slot == h.slot && g.incarnation == h.incarnation)
                })
                .map(|g| g.blocks);
            assert_eq!(
                resident_blocks(value, e.image, h.slot, h.incarnation),
                first
            );
        }
    }
}

fn decision(value: &[u8]) {
    match DecisionRecord::decode(value) {
        Some(r) => assert_eq!(r.encode(), value),
        None => {
            // u8 version 3 | u16 slot | u64 time | u32 new blocks | u32 first | u8 has stamp |
            // u32 stamp (0 without) | u32 n | n × u64
            let well_formed = value.len() >= 28 && value[0] == 3 && {
                let has = value[19];
                let stamp = u32::from_le_bytes([value[20], value[21], value[22], value[23]]);
                let n = u32::from_le_bytes([value[24], value[25], value[26], value[27]]);
                (has == 1 || (has == 0 && stamp == 0))
                    && u64::from(n) * 8 == (value.len() - 28) as u64
            };
            assert!(!well_formed, "a well-framed record did not decode");
        }
    }
}

fn members(value: &[u8]) {
    let m = Members::decode(value);
    assert!(m.slots.len() <= value.len() / 3);
    if m == Members::default() {
        return;
    }
    assert!(m.slots.len() <= MAX_SLOTS, "{} slots", m.slots.len());
    let encoded = m.encode();
    // A slot's `active` byte is read as "not zero": only that re-encodes (as 0 or 1).
    let mut expected = value.get(..encoded.len()).unwrap_or(value).to_vec();
    let mut at = 10;
    for _ in &m.slots {
        if let Some(active) = expected.get_mut(at) {
            *active = u8::from(*active != 0);
        }
        let name = usize::from(encoded.get(at + 1).copied().unwrap_or(0));
        let address = usize::from(encoded.get(at + 2 + name).copied().unwrap_or(0));
        at += 3 + name + address;
    }
    assert_eq!(expected, encoded, "re-encodes to other bytes");
    assert_eq!(Members::decode(&encoded), m);
}

fn live(value: &[u8]) {
    let t = LiveTable::decode(value);
    assert!(t.slots.len() <= MAX_SLOTS);
    if t == LiveTable::default() && t.encode() != value {
        return;
    }
    let encoded = t.encode();
    // The precise word is read as its bit 0 (the others are ignored, as the feed's flags):
    // only that bit re-encodes.
    let mut expected = value.get(..encoded.len()).unwrap_or(value).to_vec();
    if let Some(word) = expected.get_mut(16..20) {
        word.copy_from_slice(&[word[0] & 1, 0, 0, 0]);
    }
    assert_eq!(expected, encoded, "re-encodes to other bytes");
    assert_eq!(LiveTable::decode(&encoded).encode(), encoded);
}

fn loads(value: &[u8]) {
    for slots in [0, 1, 3, 64] {
        let l = load::decode(value, slots);
        assert_eq!(l.len(), slots);
        let whole = value.len().is_multiple_of(16);
        for (i, got) in l.iter().enumerate() {
            let entry = value.get(i * 16..i * 16 + 16).filter(|_| whole);
            let want = entry.map_or(load::Load::default(), |e| load::Load {
                inflight: u32::from_le_bytes([e[0], e[1], e[2], e[3]]),
                pending_blocks: u32::from_le_bytes([e[4], e[5], e[6], e[7]]),
                queue_until_us: u64::from_le_bytes(e[8..16].try_into().unwrap_or_default()),
            });
            assert_eq!(*got, want, "slot {i}");
        }
    }
}

/// `value` cut into parts, each a u16 (LE) length and that many bytes (the last one short).
pub fn parts(mut value: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    while value.len() >= 2 {
        let n = usize::from(u16::from_le_bytes([value[0], value[1]]));
        let rest = &value[2..];
        let n = n.min(rest.len());
        out.push(&rest[..n]);
        value = &rest[n..];
    }
    out
}

fn small_blocks() -> BlocksConfig {
    BlocksConfig {
        buckets: 7,
        bucket_entries: 4,
        max_holders: 2,
    }
}

/// Parts: the live table, block keys (u64 LE), then bucket values (bucket `i` holds part
/// `2 + i % n`).
fn prefix(value: &[u8]) {
    let p = parts(value);
    let live = LiveTable::decode(p.first().copied().unwrap_or_default());
    let keys: Vec<u64> = p
        .get(1)
        .copied()
        .unwrap_or_default()
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
        .collect();
    let buckets = p.get(2..).unwrap_or_default();
    let config = small_blocks();
    let budget = usize::from(value.first().copied().unwrap_or(0) % 16);
    let mut fetch =
        |i: u32| (!buckets.is_empty()).then(|| buckets[i as usize % buckets.len()].to_vec());
    let m = match_prefix(&keys, &live.slots, &config, budget, &mut fetch);
    assert_eq!(m.depths.len(), live.slots.len());
    assert!(m.depths.iter().all(|&d| d <= keys.len()));
    assert!(m.probes <= budget.max(2), "{} probes of {budget}", m.probes);
    assert!(m.best() <= keys.len());
}

/// Parts: the live table, a block bucket value (put in every bucket), then decision records.
fn drained(value: &[u8]) {
    let p = parts(value);
    let config = StateConfig {
        blocks: small_blocks(),
        ..StateConfig::default()
    };
    let keys = Keys::new(config.namespace(16));
    let store = MemoryStore::default();
    let set = |key: &str, v: &[u8]| store.set(key, v, None).expect("memory store");
    if let Some(live) = p.first() {
        set(&keys.live(), live);
    }
    let preset = p.get(1).is_some();
    if let Some(bucket) = p.get(1) {
        for i in 0..config.blocks.buckets {
            set(&keys.block_bucket(i), bucket);
        }
    }
    let records = p.get(2..).unwrap_or_default();
    for r in records {
        store.enqueue(&keys.decisions(), r).expect("memory store");
    }
    let max = 1 + usize::from(value.first().copied().unwrap_or(0) % 8);
    let stats = drain(&store, &keys, &config, 60_000, 1_000_000, max);
    assert!(stats.applied + stats.dropped <= records.len().min(max) as u64);
    for i in 0..config.blocks.buckets {
        let Ok(Some((bytes, version))) = store.get(&keys.block_bucket(i)) else {
            continue;
        };
        if !preset || version > 1 {
            // Written by the drain: well-formed.
            assert_eq!(
                Bucket::decode(&bytes).encode(),
                bytes,
                "bucket {i} as written"
            );
        }
    }
}
