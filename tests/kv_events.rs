//! The KV-event decoder against vLLM's own encodings (tests/fixtures/kv_events, written by
//! scripts/make-kv-event-fixtures.py with the event classes of the vLLM 0.33.0, 0.23.0 and
//! 0.9.0 wheels), hand-built edge cases, and properties: encode → decode round trips in both
//! forms and both hash encodings, truncation at every byte, hostile lengths.

use mmrouter::kv_events::*;
use proptest::prelude::*;
use serde_json::{Value, json};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::PathBuf;

// ---------------------------------------------------------------------------------------
// Bytes allocated by the current thread (to show hostile lengths allocate nothing).

struct Counting;

thread_local! {
    static ALLOCATED: Cell<usize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATED.try_with(|c| c.set(c.get().saturating_add(layout.size())));
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocated_by<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = ALLOCATED.with(|c| c.get());
    let out = f();
    (out, ALLOCATED.with(|c| c.get()) - before)
}

// ---------------------------------------------------------------------------------------
// The fixtures

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kv_events")
}

struct Fixture {
    name: String,
    bytes: Vec<u8>,
    meta: Value,
}

fn fixtures() -> Vec<Fixture> {
    let doc: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture_dir().join("expected.json")).unwrap(),
    )
    .unwrap();
    doc["fixtures"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| Fixture {
            name: f["name"].as_str().unwrap().to_string(),
            bytes: std::fs::read(fixture_dir().join(f["file"].as_str().unwrap())).unwrap(),
            meta: f.clone(),
        })
        .collect()
}

/// The decoded batch in the schema of expected.json.
fn to_json(b: &EventBatch) -> Value {
    let keys = |ks: &[Vec<ExtraKey>]| -> Value {
        ks.iter()
            .map(|entry| {
                entry
                    .iter()
                    .map(|k| match k {
                        ExtraKey::Mm { identifier, offset } => json!({"mm": [identifier, offset]}),
                        ExtraKey::Text(s) => json!({ "text": s }),
                        ExtraKey::Other => json!({ "other": null }),
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let events: Vec<Value> = b
        .events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored(s) => json!({
                "type": "BlockStored",
                "block_hashes": s.block_hashes,
                "parent_block_hash": s.parent_block_hash,
                "token_ids": s.token_ids,
                "block_size": s.block_size,
                "lora_name": s.lora_name,
                "medium": s.medium,
                "extra_keys": keys(&s.extra_keys),
                "group_idx": s.group_idx,
                "kv_cache_spec_kind": s.kv_cache_spec_kind,
            }),
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx,
            } => json!({
                "type": "BlockRemoved",
                "block_hashes": block_hashes,
                "medium": medium,
                "group_idx": group_idx,
            }),
            KvEvent::AllBlocksCleared { medium } => {
                json!({"type": "AllBlocksCleared", "medium": medium})
            }
            KvEvent::Unknown { kind } => json!({"type": "Unknown", "kind": kind}),
        })
        .collect();
    json!({"ts": b.ts, "events": events, "data_parallel_rank": b.data_parallel_rank})
}

#[test]
fn every_vllm_fixture_decodes_to_what_vllms_objects_hold() {
    let all = fixtures();
    assert!(all.len() >= 13, "fixtures missing: {}", all.len());
    let mut forms = std::collections::BTreeSet::new();
    let mut types = std::collections::BTreeSet::new();
    for f in &all {
        let b = decode_batch(&f.bytes, &KvEventLimits::default())
            .unwrap_or_else(|e| panic!("{}: {e}", f.name));
        assert_eq!(to_json(&b), f.meta["batch"], "fixture {}", f.name);
        forms.insert((
            f.meta["vllm"].as_str().unwrap().to_string(),
            f.meta["form"].as_str().unwrap().to_string(),
            f.meta["hashes"].as_str().unwrap().to_string(),
        ));
        for e in f.meta["batch"]["events"].as_array().unwrap() {
            types.insert(e["type"].as_str().unwrap().to_string());
        }
    }
    // Both forms from vLLM's own classes, with both hash encodings, and every event type.
    for want in [
        ("0.33.0", "tagged", "int"),
        ("0.33.0", "tagged", "bytes"),
        ("0.23.0", "positional", "int"),
        ("0.23.0", "positional", "bytes"),
        ("0.9.0", "positional", "int"),
    ] {
        assert!(
            forms.contains(&(want.0.into(), want.1.into(), want.2.into())),
            "{want:?}"
        );
    }
    let want_types = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "Unknown"];
    assert_eq!(types.into_iter().collect::<Vec<_>>(), want_types);
}

#[test]
fn the_decoded_fixtures_carry_the_values_the_router_needs() {
    // Spot checks in Rust terms, independent of the JSON schema above.
    let f = fixtures();
    let get = |n: &str| {
        let f = f.iter().find(|f| f.name == n).unwrap();
        decode_batch(&f.bytes, &KvEventLimits::default()).unwrap()
    };
    let b = get("current-int-hashes");
    let KvEvent::BlockStored(s) = &b.events[0] else {
        panic!()
    };
    assert_eq!(s.block_hashes, vec![u64::MAX, 1 << 63, 0x0123456789ABCDEF]);
    assert_eq!(
        s.extra_keys[2],
        vec![
            ExtraKey::Mm {
                identifier: "5d41402abc4b2a76b9719d911017c592".into(),
                offset: -27
            },
            ExtraKey::Mm {
                identifier: "7d793037a0760186574b0282f2f435e7".into(),
                offset: 3
            },
        ]
    );
    assert_eq!(b.data_parallel_rank, Some(0));
    let b = get("current-lora-salt-embeds");
    let KvEvent::BlockStored(s) = &b.events[0] else {
        panic!()
    };
    assert_eq!(s.lora_name.as_deref(), Some("sql-adapter"));
    assert_eq!(s.kv_cache_spec_kind.as_deref(), Some("sliding_window"));
    assert_eq!(s.group_idx, Some(1));
    assert_eq!(s.extra_keys[0][0], ExtraKey::Text("sql-adapter".into()));
    assert_eq!(s.extra_keys[0][2], ExtraKey::Text("tenant-7-salt".into()));
    assert_eq!(s.extra_keys[0][3], ExtraKey::Other);
    // A bytes hash keeps its last 8 bytes; shorter ones are left-padded, empty is 0.
    let b = get("current-bytes-hashes");
    let KvEvent::BlockRemoved { block_hashes, .. } = &b.events[1] else {
        panic!()
    };
    let digest =
        |i: u64, n: u64| -> Vec<u8> { (0..n).map(|j| ((i * 37 + j * 11) & 255) as u8).collect() };
    let last8 = |d: Vec<u8>| {
        d[d.len().saturating_sub(8)..]
            .iter()
            .fold(0u64, |a, &x| a << 8 | x as u64)
    };
    assert_eq!(
        block_hashes,
        &vec![last8(digest(1, 32)), last8(digest(9, 4)), 0]
    );
    assert_eq!(get("oldest-positional").data_parallel_rank, None);
    assert_eq!(
        get("current-unknown-type").events[0],
        KvEvent::Unknown {
            kind: "BlockUpdated".into()
        }
    );
}

#[test]
fn encode_batch_writes_the_bytes_vllm_writes() {
    let mut checked = 0;
    for f in fixtures() {
        let form = match f.meta["encode_exact"].as_str() {
            Some("tagged-int") => WireForm::Tagged,
            Some("positional-int") => WireForm::Positional,
            _ => continue,
        };
        let b = decode_batch(&f.bytes, &KvEventLimits::default()).unwrap();
        assert_eq!(
            encode_batch(&b, form, HashEncoding::Int),
            f.bytes,
            "fixture {}",
            f.name
        );
        checked += 1;
    }
    assert_eq!(checked, 2);
}

#[test]
fn every_truncation_of_every_fixture_is_an_error() {
    for f in fixtures() {
        for n in 0..f.bytes.len() {
            let r = decode_batch(&f.bytes[..n], &KvEventLimits::default());
            assert!(r.is_err(), "{} cut at {n} decoded: {r:?}", f.name);
        }
    }
}

#[test]
fn corrupted_fixtures_never_panic() {
    for f in fixtures() {
        for i in 0..f.bytes.len() {
            for x in [0x00, 0xc1, 0xdd, 0xff, f.bytes[i] ^ 0x80] {
                let mut b = f.bytes.clone();
                b[i] = x;
                let _ = decode_batch(&b, &KvEventLimits::default());
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Hand-built payloads

/// A msgpack value for hand-built payloads.
enum V {
    Nil,
    I(i64),
    F(f64),
    S(&'static str),
    B(Vec<u8>),
    A(Vec<V>),
    M(Vec<(V, V)>),
}

fn mp(v: &V, out: &mut Vec<u8>) {
    match v {
        V::Nil => out.push(0xc0),
        V::I(i) => {
            out.push(0xd3);
            out.extend_from_slice(&i.to_be_bytes());
        }
        V::F(x) => {
            out.push(0xcb);
            out.extend_from_slice(&x.to_be_bytes());
        }
        V::S(s) => {
            out.push(0xdb);
            out.extend_from_slice(&(s.len() as u32).to_be_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        V::B(b) => {
            out.push(0xc6);
            out.extend_from_slice(&(b.len() as u32).to_be_bytes());
            out.extend_from_slice(b);
        }
        V::A(items) => {
            out.push(0xdd);
            out.extend_from_slice(&(items.len() as u32).to_be_bytes());
            for i in items {
                mp(i, out);
            }
        }
        V::M(entries) => {
            out.push(0xdf);
            out.extend_from_slice(&(entries.len() as u32).to_be_bytes());
            for (k, v) in entries {
                mp(k, out);
                mp(v, out);
            }
        }
    }
}

fn bytes(v: V) -> Vec<u8> {
    let mut out = Vec::new();
    mp(&v, &mut out);
    out
}

fn decode(v: V) -> Result<EventBatch, KvEventError> {
    decode_batch(&bytes(v), &KvEventLimits::default())
}

#[test]
fn maps_at_both_levels_with_the_tag_anywhere_and_unknown_fields_skipped() {
    let b = decode(V::M(vec![
        (V::S("future_field"), V::A(vec![V::M(vec![])])),
        (V::S("data_parallel_rank"), V::I(4)),
        (
            V::S("events"),
            V::A(vec![V::M(vec![
                (V::S("locality"), V::S("LOCAL")),
                (V::S("block_hashes"), V::A(vec![V::I(-1), V::B(vec![1, 2])])),
                (V::S("medium"), V::S("CPU")),
                (V::S("type"), V::S("BlockRemoved")),
                (V::S("group_idx"), V::I(2)),
            ])]),
        ),
        (V::S("ts"), V::F(2.5)),
    ]))
    .unwrap();
    assert_eq!(
        b,
        EventBatch {
            ts: 2.5,
            events: vec![KvEvent::BlockRemoved {
                block_hashes: vec![u64::MAX, 0x0102],
                medium: Some("CPU".into()),
                group_idx: Some(2),
            }],
            data_parallel_rank: Some(4),
        }
    );
}

#[test]
fn extra_keys_that_are_not_pairs_or_strings_are_kept_as_other() {
    let stored = |keys: V| {
        V::A(vec![
            V::F(0.0),
            V::A(vec![V::M(vec![
                (V::S("type"), V::S("BlockStored")),
                (V::S("block_hashes"), V::A(vec![V::I(1)])),
                (V::S("extra_keys"), V::A(vec![keys])),
            ])]),
        ])
    };
    let b = decode(stored(V::A(vec![
        V::A(vec![V::S("id"), V::I(-16)]),
        V::A(vec![V::I(1), V::I(2)]),
        V::A(vec![V::S("id"), V::S("not an offset")]),
        V::A(vec![V::S("a"), V::I(1), V::I(2)]),
        V::B(vec![0; 32]),
        V::I(7),
        V::Nil,
        V::S("salt"),
    ])))
    .unwrap();
    let KvEvent::BlockStored(s) = &b.events[0] else {
        panic!()
    };
    assert_eq!(
        s.extra_keys,
        vec![vec![
            ExtraKey::Mm {
                identifier: "id".into(),
                offset: -16
            },
            ExtraKey::Other,
            ExtraKey::Other,
            ExtraKey::Other,
            ExtraKey::Other,
            ExtraKey::Other,
            ExtraKey::Other,
            ExtraKey::Text("salt".into()),
        ]]
    );
    assert_eq!(s.block_size, 0, "a missing field takes its default");
    // An over-long string key is opaque rather than an error.
    let small = KvEventLimits {
        max_string_bytes: 3,
        ..KvEventLimits::default()
    };
    let b = decode_batch(&bytes(stored(V::A(vec![V::S("longer")]))), &small).unwrap();
    let KvEvent::BlockStored(s) = &b.events[0] else {
        panic!()
    };
    assert_eq!(s.extra_keys, vec![vec![ExtraKey::Other]]);
}

#[test]
fn malformed_events_are_errors_that_say_what_is_wrong() {
    let batch = |e: V| V::A(vec![V::F(0.0), V::A(vec![e]), V::Nil]);
    let cases: Vec<(V, &str)> = vec![
        (
            batch(V::M(vec![(V::S("type"), V::S("BlockStored"))])),
            "BlockStored event without block_hashes",
        ),
        (
            batch(V::M(vec![(V::S("block_hashes"), V::A(vec![]))])),
            "without a \"type\" key",
        ),
        (batch(V::A(vec![])), "an event array without its type"),
        (
            batch(V::I(3)),
            "event: expected a map or an array, found an integer",
        ),
        (
            batch(V::A(vec![V::S("BlockRemoved"), V::A(vec![V::S("x")])])),
            "block_hashes: expected an integer or bytes hash, found a string",
        ),
        (
            batch(V::A(vec![
                V::S("BlockStored"),
                V::A(vec![]),
                V::Nil,
                V::A(vec![V::I(-1)]),
            ])),
            "token_ids: -1 is out of range",
        ),
        (
            V::A(vec![V::F(0.0)]),
            "needs [ts, events, ...], got 1 elements",
        ),
        (
            V::S("x"),
            "event batch: expected an array or a map, found a string",
        ),
        (
            V::M(vec![(V::S("ts"), V::F(1.0))]),
            "needs \"ts\" and \"events\"",
        ),
    ];
    for (v, want) in cases {
        let e = decode(v).unwrap_err().to_string();
        assert!(e.contains(want), "{e:?} should say {want:?}");
    }
    let mut p = bytes(V::A(vec![V::F(0.0), V::A(vec![])]));
    p.push(0xc0);
    assert_eq!(
        decode_batch(&p, &KvEventLimits::default()),
        Err(KvEventError::TrailingBytes {
            offset: p.len() - 1,
            extra: 1
        })
    );
}

#[test]
fn huge_declared_lengths_fail_fast_without_allocating() {
    let prefix = [0x93u8, 0x00]; // [ts=0, ...
    let hostile: Vec<Vec<u8>> = vec![
        [&prefix[..], &[0xdd, 0xff, 0xff, 0xff, 0xff]].concat(), // events: 4G entries
        [&prefix[..], &[0x91, 0x92, 0xdb, 0xff, 0xff, 0xff, 0xff]].concat(), // type: 4 GiB string
        [&prefix[..], &[0x91, 0xdf, 0xff, 0xff, 0xff, 0xff]].concat(), // event map: 4G entries
        [
            &prefix[..],
            &[0x91, 0x92, 0xac],
            b"BlockRemoved",
            &[0xdd, 0xff, 0xff, 0xff, 0xff],
        ]
        .concat(), // 4G hashes
        [
            &prefix[..],
            &[0x91, 0x92, 0xac],
            b"BlockRemoved",
            &[0x91, 0xc6, 0xff, 0xff, 0xff, 0xff],
        ]
        .concat(), // a 4 GiB bytes hash
        [
            &prefix[..],
            &[0x91, 0x99, 0xab],
            b"BlockStored",
            &[
                0x90, 0xc0, 0x90, 0x10, 0xc0, 0xc0, 0xc0, 0xdd, 0xff, 0xff, 0xff, 0xff,
            ],
        ]
        .concat(), // 4G extra_keys entries
        [
            &prefix[..],
            &[0x91, 0x92, 0xa1, b'X', 0xc9, 0xff, 0xff, 0xff, 0xff, 0x01],
        ]
        .concat(), // ext32
    ];
    for p in hostile {
        let (r, bytes) = allocated_by(|| decode_batch(&p, &KvEventLimits::default()));
        let e = r.unwrap_err();
        assert!(
            matches!(
                e,
                KvEventError::LengthBeyondEnd {
                    declared: 0xffff_ffff,
                    ..
                }
            ),
            "{p:02x?}: {e}"
        );
        assert!(bytes < 4096, "{p:02x?} allocated {bytes} bytes");
    }
    // Lengths that fit the bytes but pass a limit.
    let limits = KvEventLimits {
        max_events: 2,
        max_hashes: 3,
        ..KvEventLimits::default()
    };
    let three_events = bytes(V::A(vec![V::F(0.0), V::A(vec![V::Nil, V::Nil, V::Nil])]));
    assert!(matches!(
        decode_batch(&three_events, &limits),
        Err(KvEventError::Limit {
            what: "events in one batch",
            limit: 2
        })
    ));
    let removed = |n: usize| {
        V::A(vec![
            V::S("BlockRemoved"),
            V::A((0..n).map(|_| V::I(1)).collect()),
        ])
    };
    let four_hashes = bytes(V::A(vec![V::F(0.0), V::A(vec![removed(2), removed(2)])]));
    assert!(matches!(
        decode_batch(&four_hashes, &limits),
        Err(KvEventError::Limit {
            what: "block hashes in one batch",
            limit: 3
        })
    ));
    let big = vec![0u8; 33 << 20];
    assert!(matches!(
        decode_batch(&big, &KvEventLimits::default()),
        Err(KvEventError::PayloadTooLarge { .. })
    ));
}

#[test]
fn amplifying_payloads_stop_at_the_decoded_size_cap() {
    // 600,000 one-byte empty strings as extra keys would be ~19 MB of ExtraKey::Text from
    // 600 KB: the cap (16x the payload plus 64 KiB) stops it.
    let n = 600_000u32;
    let mut p = vec![0x93, 0x00, 0x91, 0x83, 0xa4];
    p.extend_from_slice(b"type");
    p.push(0xab);
    p.extend_from_slice(b"BlockStored");
    p.push(0xac);
    p.extend_from_slice(b"block_hashes");
    p.extend_from_slice(&[0x91, 0x01]);
    p.push(0xaa);
    p.extend_from_slice(b"extra_keys");
    p.extend_from_slice(&[0x91, 0xdd]);
    p.extend_from_slice(&n.to_be_bytes());
    p.extend(std::iter::repeat_n(0xa0, n as usize));
    p.push(0x00);
    let (r, allocated) = allocated_by(|| decode_batch(&p, &KvEventLimits::default()));
    assert!(
        matches!(r, Err(KvEventError::Limit { .. })),
        "{:?}",
        r.map(|b| b.events.len())
    );
    assert!(
        allocated <= 16 * p.len() + (64 << 10) + 4096,
        "allocated {allocated}"
    );
}

#[test]
fn messages_are_topic_seq_payload_and_the_replay_marker_is_recognised() {
    let payload = encode_batch(
        &EventBatch {
            ts: 1.0,
            events: vec![KvEvent::AllBlocksCleared { medium: None }],
            data_parallel_rank: Some(0),
        },
        WireForm::Tagged,
        HashEncoding::Int,
    );
    let seq = 42u64.to_be_bytes();
    let m = decode_message(
        &[b"kv@pod@model", &seq, &payload],
        &KvEventLimits::default(),
    )
    .unwrap();
    assert_eq!(m.topic, b"kv@pod@model");
    assert_eq!(m.seq, 42);
    assert_eq!(m.batch.events.len(), 1);
    // As a DEALER receives a replayed batch: the empty delimiter first.
    let m = decode_message(&[b"", b"t", &seq, &payload], &KvEventLimits::default()).unwrap();
    assert_eq!((m.topic.as_slice(), m.seq), (&b"t"[..], 42));
    let end = (-1i64).to_be_bytes();
    assert!(is_replay_end(&[b"", &end, b""]));
    assert!(is_replay_end(&[b"", b"", &end, b""]));
    assert!(!is_replay_end(&[b"", &seq, b""]));
    assert!(!is_replay_end(&[b"t", &seq, &payload]));
    assert!(decode_message(&[b"", &end, b""], &KvEventLimits::default()).is_err());
    let e = decode_message(&[b"t", b"\x01\x02", &payload], &KvEventLimits::default()).unwrap_err();
    assert!(e.to_string().contains("2 bytes, expected 8"), "{e}");
    let e = decode_message(&[b"t", &payload], &KvEventLimits::default()).unwrap_err();
    assert!(e.to_string().contains("got 2"), "{e}");
}

// ---------------------------------------------------------------------------------------
// Properties

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z0-9]{0,40}",
        any::<String>().prop_map(|s| s.chars().take(40).collect()),
        "[a-f0-9]{32}",
    ]
}

fn extra_key() -> impl Strategy<Value = ExtraKey> {
    prop_oneof![
        (text(), any::<i64>()).prop_map(|(identifier, offset)| ExtraKey::Mm { identifier, offset }),
        text().prop_map(ExtraKey::Text),
        Just(ExtraKey::Other),
    ]
}

fn stored() -> impl Strategy<Value = KvEvent> {
    (
        prop::collection::vec(any::<u64>(), 0..6),
        any::<bool>(),
        (
            any::<Option<u64>>(),
            prop::collection::vec(any::<u32>(), 0..40),
            any::<u32>(),
            prop::option::of(text()),
            prop::option::of(text()),
        ),
        (any::<Option<i64>>(), prop::option::of(text())),
        prop::collection::vec(prop::collection::vec(extra_key(), 0..4), 6),
    )
        .prop_map(
            |(
                block_hashes,
                with_keys,
                (parent, token_ids, block_size, lora, medium),
                (g, k),
                keys,
            )| {
                // One entry per block, or none at all (decoding pads to one per block).
                let extra_keys = if with_keys || !block_hashes.is_empty() {
                    keys.into_iter().take(block_hashes.len()).collect()
                } else {
                    Vec::new()
                };
                KvEvent::BlockStored(BlockStored {
                    block_hashes,
                    parent_block_hash: parent,
                    token_ids,
                    block_size,
                    lora_name: lora,
                    medium,
                    extra_keys,
                    group_idx: g,
                    kv_cache_spec_kind: k,
                })
            },
        )
}

fn event() -> impl Strategy<Value = KvEvent> {
    prop_oneof![
        stored(),
        (
            prop::collection::vec(any::<u64>(), 0..6),
            prop::option::of(text()),
            any::<Option<i64>>()
        )
            .prop_map(|(block_hashes, medium, group_idx)| KvEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx
            }),
        prop::option::of(text()).prop_map(|medium| KvEvent::AllBlocksCleared { medium }),
        "[A-Z][A-Za-z]{0,15}"
            .prop_filter("a known type", |k| {
                !["BlockStored", "BlockRemoved", "AllBlocksCleared"].contains(&k.as_str())
            })
            .prop_map(|kind| KvEvent::Unknown { kind }),
    ]
}

fn batch() -> impl Strategy<Value = EventBatch> {
    (
        prop::num::f64::NORMAL | prop::num::f64::ZERO | prop::num::f64::SUBNORMAL,
        prop::collection::vec(event(), 0..6),
        any::<Option<i64>>(),
    )
        .prop_map(|(ts, events, data_parallel_rank)| EventBatch {
            ts,
            events,
            data_parallel_rank,
        })
}

const FORMS: [(WireForm, HashEncoding); 4] = [
    (WireForm::Tagged, HashEncoding::Int),
    (WireForm::Tagged, HashEncoding::Bytes),
    (WireForm::Positional, HashEncoding::Int),
    (WireForm::Positional, HashEncoding::Bytes),
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn encode_then_decode_gives_the_batch_back_in_every_form(b in batch()) {
        for (form, hashes) in FORMS {
            let bytes = encode_batch(&b, form, hashes);
            let back = decode_batch(&bytes, &KvEventLimits::default());
            prop_assert_eq!(back.as_ref(), Ok(&b), "{:?} {:?}", form, hashes);
        }
    }

    #[test]
    fn every_truncation_is_an_error_never_a_panic(b in batch()) {
        for (form, hashes) in FORMS {
            let bytes = encode_batch(&b, form, hashes);
            for n in 0..bytes.len() {
                prop_assert!(decode_batch(&bytes[..n], &KvEventLimits::default()).is_err());
            }
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes, &KvEventLimits::default());
        let _ = decode_message(&[b"", &bytes[..bytes.len().min(8)], &bytes], &KvEventLimits::default());
    }

    #[test]
    fn mutated_encodings_never_panic(b in batch(), at in any::<prop::sample::Index>(), x in any::<u8>()) {
        let mut bytes = encode_batch(&b, WireForm::Tagged, HashEncoding::Int);
        let i = at.index(bytes.len());
        bytes[i] = x;
        let _ = decode_batch(&bytes, &KvEventLimits::default());
    }
}
