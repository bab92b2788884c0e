//! What a scan allocates: the body is never held and no decoded image byte is kept, so the
//! bytes allocated while an image body streams through the analyzer do not grow with the image.

use base64::Engine as _;
use mmrouter::analysis::Analyzer;
use mmrouter::config::RouterConfig;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::PathBuf;

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

/// A chat body with one inline JPEG of about `size` bytes (a fixture's header and scan, then
/// `size` bytes of entropy-coded-looking filler).
fn body(size: usize) -> Vec<u8> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/images");
    let mut jpeg = std::fs::read(dir.join("jpeg_exif_orient6_37x23.jpg")).unwrap();
    let mut x = 0x9E37_79B9u32;
    jpeg.extend((0..size).map(|_| {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        (x >> 24) as u8
    }));
    let b64 = base64::engine::general_purpose::STANDARD.encode(&jpeg);
    format!(
        r#"{{"model":"Qwen/Qwen2.5-VL-7B-Instruct","messages":[{{"role":"user","content":[{{"type":"text","text":"what is this?"}},{{"type":"image_url","image_url":{{"url":"data:image/jpeg;base64,{b64}"}}}}]}}]}}"#
    )
    .into_bytes()
}

/// Bytes allocated while `body` is analysed in pieces of `piece` bytes.
fn allocated(body: &[u8], piece: usize) -> usize {
    let config = RouterConfig::default();
    let before = ALLOCATED.with(Cell::get);
    let mut a = Analyzer::new(&config);
    for p in body.chunks(piece) {
        a.feed(p).unwrap();
    }
    let analysis = a.finish(&config).unwrap();
    assert_eq!(
        (analysis.media[0].width, analysis.media[0].height),
        (Some(23), Some(37))
    );
    ALLOCATED.with(Cell::get) - before
}

#[test]
fn scanning_an_image_body_allocates_the_same_small_amount_whatever_the_image_size() {
    let small = body(1 << 20);
    let large = body(8 << 20);
    for piece in [16 << 10, 64 << 10] {
        let a = allocated(&small, piece);
        let b = allocated(&large, piece);
        // The decoder state (a 3 KiB buffer, the hasher, the header reader), the text kept, the
        // layout: under 10 KB when measured, against 1.4 and 11 MB of body.
        assert!(a < 32 << 10, "{a} bytes for a 1 MiB image");
        assert!(b < 32 << 10, "{b} bytes for an 8 MiB image");
        assert!(b.abs_diff(a) < 4 << 10, "{a} vs {b}: grows with the image");
    }
}
