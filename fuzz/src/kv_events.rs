//! Target `kv_events`: the decoder of vLLM's KV-cache events (msgpack).
//!
//! Input: one `EventBatch` payload as the PUB socket sends it (the corpus starts from the
//! fixtures written by `scripts/make-kv-event-fixtures.py` from vLLM's own classes).
//! Properties, under the default limits and under tight ones:
//!
//! - [`decode_message`] of `[topic, seq, payload]` (and of the replayed form
//!   `["", topic, seq, payload]`) is [`decode_batch`] of the payload with that topic and seq;
//! - a decoded batch respects every cap of [`KvEventLimits`], and what it holds (events, hashes,
//!   tokens, extra keys, strings) is at most 16 times the payload plus 64 KiB, the documented
//!   bound;
//! - round trip: a decoded batch encoded again ([`encode_batch`], both wire forms, both hash
//!   encodings) decodes to itself, and encodes to the same bytes once more.

use mmrouter::kv_events::{
    EventBatch, ExtraKey, HashEncoding, KvEvent, KvEventLimits, WireForm, decode_batch,
    decode_message, encode_batch, is_replay_end,
};
use std::mem::size_of;
use xxhash_rust::xxh3::xxh3_64;

fn tight() -> KvEventLimits {
    KvEventLimits {
        max_payload_bytes: 2048,
        max_events: 4,
        max_hashes: 16,
        max_string_bytes: 16,
        max_depth: 6,
    }
}

pub fn check(data: &[u8]) -> bool {
    for limits in [KvEventLimits::default(), tight()] {
        one(data, &limits);
    }
    true
}

fn one(payload: &[u8], limits: &KvEventLimits) {
    let batch = decode_batch(payload, limits);
    let seq = xxh3_64(payload).to_be_bytes();
    let topic: &[u8] = b"kv@worker";
    for frames in [
        vec![topic, &seq[..], payload],
        vec![&[][..], topic, &seq[..], payload],
    ] {
        assert!(!is_replay_end(&frames) || payload.is_empty());
        let message = decode_message(&frames, limits);
        match (&batch, &message) {
            (Ok(b), Ok(m)) => {
                assert_eq!(m.topic, topic);
                assert_eq!(m.seq, u64::from_be_bytes(seq));
                assert!(same_batch(&m.batch, b), "message and batch differ");
            }
            (Err(a), Err(b)) => assert_eq!(a, b),
            (a, b) => panic!("batch {a:?}, message {b:?}"),
        }
    }
    let Ok(batch) = batch else {
        return;
    };
    bounded(&batch, payload.len(), limits);
    for form in [WireForm::Tagged, WireForm::Positional] {
        for hashes in [HashEncoding::Int, HashEncoding::Bytes] {
            let encoded = encode_batch(&batch, form, hashes);
            let again = decode_batch(&encoded, &KvEventLimits::default())
                .unwrap_or_else(|e| panic!("{form:?}/{hashes:?} encoding does not decode: {e}"));
            assert!(
                same_batch(&again, &batch),
                "{form:?}/{hashes:?} round trip: {batch:?} came back as {again:?}"
            );
            assert_eq!(
                encode_batch(&again, form, hashes),
                encoded,
                "encoding is stable"
            );
        }
    }
}

/// Equality with the timestamp compared bit for bit (NaN is a valid msgpack float).
fn same_batch(a: &EventBatch, b: &EventBatch) -> bool {
    a.ts.to_bits() == b.ts.to_bits()
        && a.events == b.events
        && a.data_parallel_rank == b.data_parallel_rank
}

fn bounded(batch: &EventBatch, len: usize, limits: &KvEventLimits) {
    assert!(batch.events.len() <= limits.max_events);
    let mut hashes = 0usize;
    let mut held = batch.events.len() * size_of::<KvEvent>();
    let string = |s: &Option<String>| {
        let n = s.as_ref().map_or(0, String::len);
        assert!(n <= limits.max_string_bytes, "a string over the limit");
        n
    };
    for e in &batch.events {
        match e {
            KvEvent::BlockStored(s) => {
                hashes += s.block_hashes.len();
                held += s.block_hashes.len() * 8 + s.token_ids.len() * 4;
                held += string(&s.lora_name) + string(&s.medium) + string(&s.kv_cache_spec_kind);
                assert!(s.extra_keys.len() <= limits.max_hashes);
                held += s.extra_keys.len() * size_of::<Vec<ExtraKey>>();
                for keys in &s.extra_keys {
                    held += keys.len() * size_of::<ExtraKey>();
                    for k in keys {
                        held += match k {
                            ExtraKey::Mm { identifier, .. } => identifier.len(),
                            ExtraKey::Text(t) => t.len(),
                            ExtraKey::Other => 0,
                        };
                    }
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
                ..
            } => {
                hashes += block_hashes.len();
                held += block_hashes.len() * 8 + string(medium);
            }
            KvEvent::AllBlocksCleared { medium } => held += string(medium),
            KvEvent::Unknown { kind } => held += kind.len(),
        }
    }
    assert!(hashes <= limits.max_hashes);
    assert!(
        held <= len * 16 + (64 << 10),
        "{held} bytes decoded from {len}"
    );
}
