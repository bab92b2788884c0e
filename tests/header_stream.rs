//! The incremental header reader against the slice reader it replaced
//! (`tests/support/reference_image_header.rs`): on every fixture, every truncation of every
//! fixture, every way of cutting a file into pieces, and on mutated files.

#[path = "support/reference_image_header.rs"]
mod reference;

use mmrouter::image_header::{HeaderError, HeaderReader, ImageInfo, read_image_header};
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
