//! The incremental header reader against the slice reader it replaced
//! (`tests/support/reference_image_header.rs`): on every fixture, every truncation of every
//! fixture, every way of cutting a file into pieces, and on mutated files.

#[path = "support/reference_image_header.rs"]
mod reference;

use mmrouter::image_header::{EXIF_CAP, HeaderError, HeaderReader, ImageInfo, read_image_header};
use proptest::prelude::*;
use std::path::PathBuf;

fn fixtures() -> Vec<(String, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/images");
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e != "json"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect();
    out.sort();
    assert!(out.len() >= 20, "fixture set shrank");
    out
}

/// The reader fed `bytes` cut at `cuts` (offsets, any order, duplicates allowed).
fn in_pieces(bytes: &[u8], cuts: &[usize]) -> Result<ImageInfo, HeaderError> {
    let mut cuts: Vec<usize> = cuts.iter().map(|&c| c.min(bytes.len())).collect();
    cuts.sort_unstable();
    let mut r = HeaderReader::new();
    let mut from = 0;
    for c in cuts {
        r.feed(&bytes[from..c]);
        from = c;
    }
    r.feed(&bytes[from..]);
    r.finish()
}

fn byte_by_byte(bytes: &[u8]) -> Result<ImageInfo, HeaderError> {
    let mut r = HeaderReader::new();
    for b in bytes.chunks(1) {
        r.feed(b);
    }
    r.finish()
}

#[test]
fn every_fixture_reads_as_the_slice_reader_read_it_whole_and_byte_by_byte() {
    for (name, bytes) in fixtures() {
        let want = reference::read_image_header(&bytes);
        assert!(want.is_ok(), "{name}: {want:?}");
        assert_eq!(read_image_header(&bytes), want, "{name}");
        assert_eq!(byte_by_byte(&bytes), want, "{name} byte by byte");
    }
}

#[test]
fn every_truncation_of_every_fixture_reads_as_the_slice_reader_read_it() {
    for (name, bytes) in fixtures() {
        for cut in 0..=bytes.len() {
            let part = &bytes[..cut];
            let want = reference::read_image_header(part);
            assert_eq!(read_image_header(part), want, "{name} cut at {cut}");
            assert_eq!(
                byte_by_byte(part),
                want,
                "{name} cut at {cut}, byte by byte"
            );
        }
    }
}

/// Mutations that keep a file's structure mostly intact: byte overwrites, insertions, deletions.
#[derive(Debug, Clone)]
enum Mutation {
    Set(usize, u8),
    Insert(usize, Vec<u8>),
    Delete(usize, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        1 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..40))
            .prop_map(|(i, v)| Mutation::Insert(i, v)),
        1 => (any::<usize>(), 1..40usize).prop_map(|(i, n)| Mutation::Delete(i, n)),
    ]
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    if bytes.is_empty() {
        return;
    }
    match m {
        Mutation::Set(i, b) => {
            let i = i % bytes.len();
            bytes[i] = *b;
        }
        Mutation::Insert(i, v) => {
            let i = i % (bytes.len() + 1);
            bytes.splice(i..i, v.iter().copied());
        }
        Mutation::Delete(i, n) => {
            let i = i % bytes.len();
            let end = (i + n).min(bytes.len());
            bytes.drain(i..end);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512)))]

    #[test]
    fn any_way_of_cutting_a_fixture_gives_the_same_result(
        pick in any::<prop::sample::Index>(),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
    ) {
        let all = fixtures();
        let (name, bytes) = &all[pick.index(all.len())];
        let cuts: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
        prop_assert_eq!(in_pieces(bytes, &cuts), reference::read_image_header(bytes), "{} {:?}", name, cuts);
    }

    #[test]
    fn mutated_fixtures_read_as_the_slice_reader_reads_them(
        pick in any::<prop::sample::Index>(),
        mutations in prop::collection::vec(mutation(), 1..6),
        cuts in prop::collection::vec(any::<usize>(), 0..6),
    ) {
        let all = fixtures();
        let (name, bytes) = &all[pick.index(all.len())];
        let mut bytes = bytes.clone();
        for m in &mutations {
            apply(&mut bytes, m);
        }
        let want = reference::read_image_header(&bytes);
        prop_assert_eq!(read_image_header(&bytes), want.clone(), "{} {:?}", name, mutations);
        let cuts: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
        prop_assert_eq!(in_pieces(&bytes, &cuts), want, "{} {:?} cut {:?}", name, mutations, cuts);
    }
}

// ------------------------------------------------------------------ hand-made files

fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// A 37x23 PNG with the given extra chunks between IHDR and IDAT.
fn png_with(chunks: &[(&[u8; 4], Vec<u8>)]) -> Vec<u8> {
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut chunk = |kind: &[u8], data: &[u8]| {
        png.extend((data.len() as u32).to_be_bytes());
        let mut body = kind.to_vec();
        body.extend(data);
        png.extend(&body);
        png.extend(crc32(&body).to_be_bytes());
    };
    let mut ihdr = 37u32.to_be_bytes().to_vec();
    ihdr.extend(23u32.to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]);
    chunk(b"IHDR", &ihdr);
    for (kind, data) in chunks {
        chunk(&kind[..], data);
    }
    chunk(b"IDAT", &[0x78, 0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01]);
    chunk(b"IEND", &[]);
    png
}

/// A little-endian TIFF whose IFD0, at `ifd`, holds orientation 6; `len` bytes in all.
fn tiff_orientation_6(ifd: usize, len: usize) -> Vec<u8> {
    let mut t = vec![0u8; len.max(ifd + 18)];
    t[..4].copy_from_slice(b"II*\0");
    t[4..8].copy_from_slice(&(ifd as u32).to_le_bytes());
    t[ifd..ifd + 2].copy_from_slice(&1u16.to_le_bytes());
    let e = ifd + 2;
    t[e..e + 2].copy_from_slice(&0x0112u16.to_le_bytes());
    t[e + 2..e + 4].copy_from_slice(&3u16.to_le_bytes());
    t[e + 4..e + 8].copy_from_slice(&1u32.to_le_bytes());
    t[e + 8..e + 10].copy_from_slice(&6u16.to_le_bytes());
    t
}

#[test]
fn a_large_exif_payload_is_read_from_its_first_64_kib() {
    // IFD0 right after the TIFF header, 100 KiB of payload after it: as before, in any cuts.
    let near = png_with(&[(b"eXIf", tiff_orientation_6(8, 100 << 10))]);
    let want = reference::read_image_header(&near);
    assert_eq!(want.as_ref().map(|i| (i.width, i.height)), Ok((23, 37)));
    assert_eq!(read_image_header(&near), want);
    assert_eq!(in_pieces(&near, &[100, 5000, 70_000]), want);
    // IFD0 past the first 64 KiB: the one documented divergence, the stored size.
    let far = png_with(&[(b"eXIf", tiff_orientation_6(EXIF_CAP + 100, EXIF_CAP + 200))]);
    let old = reference::read_image_header(&far).unwrap();
    assert_eq!((old.width, old.height), (23, 37));
    let new = read_image_header(&far).unwrap();
    assert_eq!((new.width, new.height), (37, 23));
    assert_eq!(in_pieces(&far, &[100, 5000, 70_000]), Ok(new));
}

/// A GIF whose application extension `name` carries `payload` bytes before the image.
fn gif_with_application(name: &[u8; 11], payload: usize) -> Vec<u8> {
    let mut gif = b"GIF89a".to_vec();
    gif.extend(37u16.to_le_bytes());
    gif.extend(23u16.to_le_bytes());
    gif.extend([0x80, 0, 0, 0, 0, 0, 255, 255, 255]);
    gif.extend([0x21, 0xFF, 11]);
    gif.extend(name);
    let mut left = payload;
    while left > 0 {
        let n = left.min(255);
        gif.push(n as u8);
        gif.extend(std::iter::repeat_n(b'x', n));
        left -= n;
    }
    gif.push(0);
    gif.extend([0x2C, 0, 0, 0, 0]);
    gif.extend(37u16.to_le_bytes());
    gif.extend(23u16.to_le_bytes());
    gif.extend([0, 2, 2, 0x4C, 0x01, 0, 0x3B]);
    gif
}

#[test]
fn gif_metadata_over_the_limit_fails_as_it_did_whole_and_in_pieces() {
    for (name, payload) in [
        (b"XMP DataXMP", 1 << 19),
        (b"XMP DataXMP", 1 << 20),
        (b"ICCRGBG1012", (1 << 20) + 1),
        (b"ICCRGBG1012", (1 << 20) + 2),
        (b"NETSCAPE2.0", 3 << 20),
    ] {
        let gif = gif_with_application(name, payload);
        let want = reference::read_image_header(&gif);
        assert_eq!(read_image_header(&gif), want, "{payload}");
        assert_eq!(
            in_pieces(&gif, &[7, 300, 70_000, 1 << 20]),
            want,
            "{payload}"
        );
    }
    let over = reference::read_image_header(&gif_with_application(b"XMP DataXMP", 1 << 20));
    assert!(matches!(over, Err(HeaderError::Corrupt(_, ref m)) if m == "Memory limit reached"));
}

#[test]
fn an_animation_frame_larger_than_the_file_reads_as_the_webp_crate_reads_it() {
    // Found by the mutation test: the crate reads the first frame's second sub-chunk header
    // from where the first header ended, not from where the first sub-chunk ends.
    let mut b = std::fs::read(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/images/webp_animated_47x25.webp"),
    )
    .unwrap();
    b.splice(48..48, [0u8, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0]);
    let want = reference::read_image_header(&b);
    assert!(want.is_ok());
    assert_eq!(read_image_header(&b), want);
    assert_eq!(byte_by_byte(&b), want);
}
