use super::encode::Writer;
use super::*;

fn limits() -> KvEventLimits {
    KvEventLimits::default()
}

#[test]
fn ints_are_written_in_their_smallest_msgpack_form() {
    let mut w = Writer {
        out: Vec::new(),
        hashes: HashEncoding::Int,
    };
    for v in [
        0i64,
        127,
        128,
        255,
        256,
        65535,
        65536,
        -1,
        -32,
        -33,
        -128,
        -129,
        i64::MIN,
    ] {
        w.int(v);
    }
    w.uint(u64::MAX);
    let expect: Vec<u8> = [
        &[0x00][..],
        &[0x7f],
        &[0xcc, 0x80],
        &[0xcc, 0xff],
        &[0xcd, 0x01, 0x00],
        &[0xcd, 0xff, 0xff],
        &[0xce, 0, 1, 0, 0],
        &[0xff],
        &[0xe0],
        &[0xd0, 0xdf],
        &[0xd0, 0x80],
        &[0xd1, 0xff, 0x7f],
        &[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0],
        &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
    ]
    .concat();
    assert_eq!(w.out, expect);
}

#[test]
fn every_int_marker_reads_back_as_a_hash() {
    // [ts, [["BlockRemoved", [hashes...], nil]], 0] with each int form.
    let mut p = vec![0x93, 0x00, 0x91, 0x93, 0xac];
    p.extend_from_slice(b"BlockRemoved");
    p.push(0x97);
    p.extend_from_slice(&[0x05]); // fixint
    p.extend_from_slice(&[0xcc, 0xf0]); // uint8
    p.extend_from_slice(&[0xd0, 0xfe]); // int8 -2
    p.extend_from_slice(&[0xd1, 0xff, 0xfe]); // int16 -2
    p.extend_from_slice(&[0xd2, 0xff, 0xff, 0xff, 0xfe]); // int32 -2
    p.extend_from_slice(&[0xc4, 0x02, 0x01, 0x02]); // 2 bytes, left-padded
    p.extend_from_slice(&[0xc4, 0x0a, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8]); // last 8 bytes
    p.extend_from_slice(&[0xc0, 0x00]);
    let b = decode_batch(&p, &limits()).unwrap();
    let KvEvent::BlockRemoved { block_hashes, .. } = &b.events[0] else {
        panic!("{b:?}")
    };
    assert_eq!(
        block_hashes,
        &vec![
            5,
            0xf0,
            u64::MAX - 1,
            u64::MAX - 1,
            u64::MAX - 1,
            0x0102,
            0x0102030405060708
        ]
    );
    assert_eq!(b.ts, 0.0);
}

#[test]
fn deep_nesting_in_a_skipped_field_hits_the_depth_limit_without_recursion() {
    // An event map with an unknown field holding 100,000 nested arrays.
    let mut p = vec![0x93, 0x00, 0x91, 0x82, 0xa4];
    p.extend_from_slice(b"type");
    p.push(0xac);
    p.extend_from_slice(b"SomethingNew");
    p.extend_from_slice(&[0xa1, b'x']);
    p.extend(std::iter::repeat_n(0x91, 100_000));
    p.push(0xc0);
    p.push(0x00);
    let e = decode_batch(&p, &limits()).unwrap_err();
    assert!(
        matches!(
            e,
            KvEventError::Limit {
                what: "levels of nesting",
                ..
            }
        ),
        "{e}"
    );
    let deep = KvEventLimits {
        max_depth: 200_000,
        ..limits()
    };
    let b = decode_batch(&p, &deep).unwrap();
    assert_eq!(
        b.events,
        vec![KvEvent::Unknown {
            kind: "SomethingNew".into()
        }]
    );
}
