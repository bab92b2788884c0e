//! `read_image_header` against real encodings made by Pillow (scripts/make-image-fixtures.py),
//! whose expected sizes are what Pillow reports after `ImageOps.exif_transpose` (vLLM's loader).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::path::PathBuf;

use mmrouter::image_header::{HeaderError, ImageFormat, ImageInfo, read_image_header};
use proptest::prelude::*;
use test_images::Png;

// ------------------------------------------------------------- allocation counting

/// Counts the bytes allocated by the current thread (tests run on several threads).
struct Counting;

thread_local! {
    static ALLOCATED: Cell<usize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATED.try_with(|a| a.set(a.get() + layout.size()));
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATED.try_with(|a| a.set(a.get() + new_size));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Runs `read_image_header` and returns its result with the bytes it allocated.
fn measured(bytes: &[u8]) -> (Result<ImageInfo, HeaderError>, usize) {
    let before = ALLOCATED.with(Cell::get);
    let result = read_image_header(bytes);
    let after = ALLOCATED.with(Cell::get);
    (result, after - before)
}

// ------------------------------------------------------------- fixtures

struct Fixture {
    name: String,
    bytes: Vec<u8>,
    format: ImageFormat,
    width: u32,
    height: u32,
}

fn fixtures() -> Vec<Fixture> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/images");
    let expected: BTreeMap<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    assert!(expected.len() >= 20, "fixture set shrank");
    expected
        .into_iter()
        .map(|(name, e)| {
            let format = match e["format"].as_str().unwrap() {
                "png" => ImageFormat::Png,
                "jpeg" => ImageFormat::Jpeg,
                "webp" => ImageFormat::Webp,
                "gif" => ImageFormat::Gif,
                other => panic!("format {other}"),
            };
            Fixture {
                bytes: std::fs::read(dir.join(&name)).unwrap(),
                width: e["width"].as_u64().unwrap() as u32,
                height: e["height"].as_u64().unwrap() as u32,
                name,
                format,
            }
        })
        .collect()
}

fn fixture(name: &str) -> Fixture {
    fixtures().into_iter().find(|f| f.name == name).unwrap()
}

#[test]
fn every_fixture_reports_the_size_pillow_sees_after_exif_transpose() {
    for f in fixtures() {
        let got = read_image_header(&f.bytes);
        assert_eq!(
            got,
            Ok(ImageInfo {
                format: f.format,
                width: f.width,
                height: f.height
            }),
            "{}",
            f.name
        );
    }
}

#[test]
fn fixture_set_covers_every_format_and_the_orientation_swap() {
    let all = fixtures();
    for format in [
        ImageFormat::Png,
        ImageFormat::Jpeg,
        ImageFormat::Webp,
        ImageFormat::Gif,
    ] {
        assert!(
            all.iter().filter(|f| f.format == format).count() >= 3,
            "{format}"
        );
    }
    // The stored size is in the name (`..._WxH.ext`); orientation 6 and 8 must swap it.
    for name in [
        "jpeg_exif_orient6_37x23.jpg",
        "jpeg_exif_orient8_51x29.jpg",
        "jpeg_xmp_orient6_37x23.jpg",
        "png_exif_orient6_37x23.png",
        "webp_exif_orient6_37x23.webp",
    ] {
        let f = fixture(name);
        let stored = name.rsplit('_').next().unwrap().split('.').next().unwrap();
        let (w, h) = stored.split_once('x').unwrap();
        assert_eq!(
            (f.height, f.width),
            (w.parse().unwrap(), h.parse().unwrap()),
            "{name}"
        );
    }
    // Orientation 3 (rotate 180) keeps the axes.
    let f = fixture("jpeg_exif_orient3_45x19.jpg");
    assert_eq!((f.width, f.height), (45, 19));
}

#[test]
fn gif_size_grows_to_contain_the_first_frame_like_pillow() {
    let f = fixture("gif_frame_beyond_screen_37x23.gif");
    // logical screen was patched to 30x9; the frame is 37x23 at (0,0)
    assert_eq!(&f.bytes[6..10], &[30, 0, 9, 0]);
    let info = read_image_header(&f.bytes).unwrap();
    assert_eq!((info.width, info.height), (37, 23));
}

// ------------------------------------------------------------- truncation

#[test]
fn every_truncation_of_every_fixture_is_an_error_or_the_right_size() {
    for f in fixtures() {
        let right = ImageInfo {
            format: f.format,
            width: f.width,
            height: f.height,
        };
        for cut in 0..f.bytes.len() {
            match read_image_header(&f.bytes[..cut]) {
                Ok(info) => assert_eq!(info, right, "{} cut at {cut}", f.name),
                Err(HeaderError::Truncated(format)) => {
                    assert_eq!(format, f.format, "{} cut at {cut}", f.name)
                }
                Err(HeaderError::Unrecognised) => assert_eq!(cut, 0, "{}", f.name),
                Err(e) => panic!("{} cut at {cut}: {e}", f.name),
            }
        }
    }
}

#[test]
fn cuts_inside_the_header_are_truncated_errors_for_each_format() {
    for f in fixtures() {
        // Everything up to the size field plus the magic is certainly header.
        let header_len = match f.format {
            ImageFormat::Png => 33,  // signature + IHDR chunk
            ImageFormat::Jpeg => 20, // SOI + at least the first segment header
            ImageFormat::Webp => 30, // RIFF header + first chunk header + frame header
            ImageFormat::Gif => 13,  // header + logical screen descriptor
        };
        for cut in 1..header_len.min(f.bytes.len()) {
            assert_eq!(
                read_image_header(&f.bytes[..cut]),
                Err(HeaderError::Truncated(f.format)),
                "{} cut at {cut}",
                f.name
            );
        }
    }
}

#[test]
fn jpeg_and_png_cut_before_the_orientation_metadata_never_report_the_unrotated_size() {
    for name in [
        "jpeg_exif_orient6_37x23.jpg",
        "png_exif_orient6_37x23.png",
        "webp_exif_orient6_37x23.webp",
    ] {
        let f = fixture(name);
        for cut in 0..f.bytes.len() {
            if let Ok(info) = read_image_header(&f.bytes[..cut]) {
                assert_eq!((info.width, info.height), (23, 37), "{name} cut at {cut}");
            }
        }
    }
}

#[test]
fn error_messages_name_the_format() {
    assert_eq!(
        read_image_header(b"\x89PNG").unwrap_err().to_string(),
        "truncated PNG header"
    );
    assert_eq!(
        read_image_header(b"\xff\xd8\xff\xe0")
            .unwrap_err()
            .to_string(),
        "truncated JPEG header"
    );
    assert_eq!(
        read_image_header(b"RIFF\x10\0\0\0WEB")
            .unwrap_err()
            .to_string(),
        "truncated WebP header"
    );
    assert_eq!(
        read_image_header(b"GIF8").unwrap_err().to_string(),
        "truncated GIF header"
    );
    assert_eq!(
        read_image_header(b"BM\0\0\0\0").unwrap_err().to_string(),
        "unrecognised image format"
    );
    assert_eq!(read_image_header(b""), Err(HeaderError::Unrecognised));
    assert_eq!(
        read_image_header(b"RIFF\x10\0\0\0WAVEfmt "),
        Err(HeaderError::Unrecognised)
    );
}

// ------------------------------------------------------------- hand-made JPEG headers

fn jpeg(segments: &[(u8, &[u8])]) -> Vec<u8> {
    let mut out = vec![0xFF, 0xD8];
    for (marker, body) in segments {
        out.extend([0xFF, *marker]);
        out.extend(((body.len() + 2) as u16).to_be_bytes());
        out.extend(*body);
    }
    out
}

fn sof(bits: u8, w: u16, h: u16, comps: u8) -> Vec<u8> {
    let mut s = vec![bits];
    s.extend(h.to_be_bytes());
    s.extend(w.to_be_bytes());
    s.push(comps);
    for i in 0..comps {
        s.extend([i + 1, 0x11, 0]);
    }
    s
}

const SOS: &[u8] = &[1, 1, 0, 0, 63, 0];

#[test]
fn jpeg_any_sof_type_pillow_opens_gives_its_size() {
    // lossless, differential and arithmetic-coded frames: Pillow (libjpeg) reads these sizes.
    for marker in [
        0xC0u8, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF,
    ] {
        let file = jpeg(&[(marker, &sof(8, 301, 77, 3)), (0xDA, SOS)]);
        let info = read_image_header(&file).unwrap();
        assert_eq!((info.width, info.height), (301, 77), "SOF 0x{marker:02X}");
    }
}

#[test]
fn jpeg_rejects_what_pillow_rejects() {
    let twelve_bit = jpeg(&[(0xC0, &sof(12, 10, 10, 3)), (0xDA, SOS)]);
    assert!(matches!(
        read_image_header(&twelve_bit),
        Err(HeaderError::Corrupt(ImageFormat::Jpeg, _))
    ));
    let two_comps = jpeg(&[(0xC0, &sof(8, 10, 10, 2)), (0xDA, SOS)]);
    assert!(matches!(
        read_image_header(&two_comps),
        Err(HeaderError::Corrupt(ImageFormat::Jpeg, _))
    ));
    let zero_height = jpeg(&[(0xC0, &sof(8, 10, 0, 3)), (0xDA, SOS)]);
    assert!(matches!(
        read_image_header(&zero_height),
        Err(HeaderError::Corrupt(ImageFormat::Jpeg, _))
    ));
    let no_sof = jpeg(&[(0xDB, &[0; 65]), (0xDA, SOS)]);
    assert!(matches!(
        read_image_header(&no_sof),
        Err(HeaderError::Corrupt(ImageFormat::Jpeg, _))
    ));
    let mut eoi = jpeg(&[(0xC0, &sof(8, 10, 10, 3))]);
    eoi.extend([0xFF, 0xD9]);
    assert!(matches!(
        read_image_header(&eoi),
        Err(HeaderError::Corrupt(ImageFormat::Jpeg, _))
    ));
    let unknown = jpeg(&[(0xF3, &[0; 4]), (0xC0, &sof(8, 10, 10, 3)), (0xDA, SOS)]);
    assert!(matches!(
        read_image_header(&unknown),
        Err(HeaderError::Corrupt(ImageFormat::Jpeg, _))
    ));
}

#[test]
fn jpeg_exif_after_sof_and_junk_between_segments_still_count() {
    let mut tiff = b"Exif\0\0MM\0\x2a\0\0\0\x08\0\x01".to_vec();
    tiff.extend([0x01, 0x12, 0, 3, 0, 0, 0, 1, 0, 6, 0, 0, 0, 0, 0, 0]);
    let mut file = jpeg(&[(0xC0, &sof(8, 640, 480, 3)), (0xE1, &tiff)]);
    // junk bytes, an escaped FF 00 and fill bytes before SOS, as Pillow tolerates
    file.extend([0x12, 0x34, 0xFF, 0x00, 0xFF, 0xFF]);
    file.extend([0xFF, 0xDA, 0, 8]);
    file.extend(SOS);
    let info = read_image_header(&file).unwrap();
    assert_eq!((info.width, info.height), (480, 640));
}

// ------------------------------------------------------------- no image-sized allocation

#[test]
fn huge_declared_sizes_are_read_without_allocating_for_the_pixels() {
    // PNG 60000x50000 RGBA: IHDR with a correct CRC, one empty IDAT, IEND.
    let png = Png::new(60000, 50000).color_type(6).idat(&[]).bytes();

    let jpg = jpeg(&[(0xC2, &sof(8, 65535, 65500, 3)), (0xDA, SOS)]);

    let mut gif = b"GIF89a".to_vec();
    gif.extend(65535u16.to_le_bytes());
    gif.extend(65000u16.to_le_bytes());
    gif.extend([0x80, 0, 0, 0, 0, 0, 255, 255, 255]); // 2-colour global palette
    gif.extend([0x2C, 0, 0, 0, 0]);
    gif.extend(65535u16.to_le_bytes());
    gif.extend(65000u16.to_le_bytes());
    gif.extend([0, 2, 0, 0x3B]);

    // WebP VP8X canvas 16384x16383 with a 1x1 lossless frame.
    let vp8l = [0x2F, 0, 0, 0, 0, 0, 0, 0, 0];
    let mut chunks = b"VP8X".to_vec();
    chunks.extend(10u32.to_le_bytes());
    chunks.extend([0, 0, 0, 0]);
    chunks.extend((16384u32 - 1).to_le_bytes()[..3].iter());
    chunks.extend((16383u32 - 1).to_le_bytes()[..3].iter());
    chunks.extend(b"VP8L");
    chunks.extend((vp8l.len() as u32).to_le_bytes());
    chunks.extend(vp8l);
    chunks.push(0); // pad to even
    let mut webp = b"RIFF".to_vec();
    webp.extend(((chunks.len() + 4) as u32).to_le_bytes());
    webp.extend(b"WEBP");
    webp.extend(chunks);

    for (file, (w, h)) in [
        (&png, (60000, 50000)),
        (&jpg, (65535, 65500)),
        (&gif, (65535, 65000)),
        (&webp, (16384, 16383)),
    ] {
        let (result, allocated) = measured(file);
        let info = result.unwrap();
        assert_eq!((info.width, info.height), (w, h), "{:?}", info.format);
        assert!(
            allocated < 64 * 1024,
            "{:?} allocated {allocated} bytes",
            info.format
        );
    }
}

#[test]
fn fixture_headers_allocate_little_and_jpeg_allocates_nothing() {
    for f in fixtures() {
        let (result, allocated) = measured(&f.bytes);
        assert!(result.is_ok(), "{}", f.name);
        match f.format {
            ImageFormat::Jpeg => assert_eq!(allocated, 0, "{}", f.name),
            _ => assert!(allocated < 64 * 1024, "{}: {allocated} bytes", f.name),
        }
    }
}

// ------------------------------------------------------------- garbage never panics

fn check_sane(result: Result<ImageInfo, HeaderError>) {
    if let Ok(info) = result {
        assert!(info.width > 0 && info.height > 0);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        check_sane(read_image_header(&bytes));
    }

    #[test]
    fn random_bytes_after_each_magic_never_panic(
        magic in 0usize..4,
        tail in proptest::collection::vec(any::<u8>(), 0..512),
    ) {
        let head: &[u8] = match magic {
            0 => b"\x89PNG\r\n\x1a\n",
            1 => b"\xff\xd8\xff",
            2 => b"GIF89a",
            _ => b"RIFF\xff\xff\0\0WEBPVP8X",
        };
        let mut bytes = head.to_vec();
        bytes.extend(tail);
        check_sane(read_image_header(&bytes));
    }

    #[test]
    fn mutated_fixtures_never_panic(
        which in any::<prop::sample::Index>(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let all = fixtures();
        let f = &all[which.index(all.len())];
        let mut bytes = f.bytes.clone();
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        check_sane(read_image_header(&bytes));
        let end = cut.index(bytes.len() + 1);
        check_sane(read_image_header(&bytes[..end]));
    }
}

#[test]
fn a_reader_fed_in_pieces_keeps_at_most_64_kib_of_an_exif_segment() {
    // A JPEG whose Exif segment (orientation 6, padded to ~60 KiB) arrives in 1 KiB pieces.
    let mut tiff = b"Exif\0\0MM\0\x2a\0\0\0\x08\0\x01".to_vec();
    tiff.extend([0x01, 0x12, 0, 3, 0, 0, 0, 1, 0, 6, 0, 0, 0, 0, 0, 0]);
    tiff.resize(60_000, 0);
    let file = jpeg(&[(0xE1, &tiff), (0xC0, &sof(8, 640, 480, 3)), (0xDA, SOS)]);
    let before = ALLOCATED.with(Cell::get);
    let mut r = mmrouter::image_header::HeaderReader::new();
    for piece in file.chunks(1024) {
        r.feed(piece);
    }
    let info = r.finish().unwrap();
    let allocated = ALLOCATED.with(Cell::get) - before;
    assert_eq!((info.width, info.height), (480, 640));
    assert!(
        allocated <= mmrouter::image_header::EXIF_CAP + 1024,
        "{allocated} bytes"
    );
    // Whole, it is read in place.
    let (whole, allocated) = measured(&file);
    assert_eq!(whole, Ok(info));
    assert_eq!(allocated, 0);
}
