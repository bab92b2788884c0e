//! Targets `header_png`, `header_jpeg`, `header_webp`, `header_gif`: the image header readers.
//!
//! Input: an image file as it is (so every corpus file opens in an image viewer or Pillow); a
//! file that does not start with the target's magic bytes is not for the target. Properties:
//!
//! - [`read_image_header`] (the file in one slice) equals [`HeaderReader`] fed the file one
//!   byte at a time and cut at points chosen by the file's hash;
//! - a size it reports is non-zero and of the target's format;
//! - differential against a reference decoder: whenever the reference decodes the file (the
//!   first frame, pixels and all, within [`REFERENCE_BYTES`] of output), the reader reports
//!   the same format and size. The reader applies the EXIF/XMP orientation as vLLM's loader
//!   does (orientations 5-8 swap width and height) and the references do not, so a swapped
//!   size is accepted when the file carries an orientation tag (TIFF tag 0x0112 in either
//!   byte order, or the XMP `Orientation` property). The references: the `png`, `gif` and
//!   `image-webp` crates that mmrouter uses for parts of the header (here decoding whole
//!   files), and `jpeg-decoder` for JPEG against the hand-written marker walker. Where they
//!   disagree, Pillow is the judge (`scripts/judge-image-headers.py`, verdicts in
//!   docs/FUZZING.md), and the cases it judged for the reader are exempted below, each with
//!   its verdict.

use super::split::seeded_pieces;
use mmrouter::image_header::{
    HeaderError, HeaderReader, ImageFormat, ImageInfo, read_image_header,
};
use std::io::Cursor;
use xxhash_rust::xxh3::xxh3_64;

/// The most output bytes a reference decoder may produce for one file (larger files are
/// compared on the streaming property only).
pub const REFERENCE_BYTES: usize = 8 << 20;

const PNG_MAGIC: &[u8] = b"\x89PNG\r\n\x1a\n";
const JPEG_MAGIC: &[u8] = b"\xff\xd8\xff";
const GIF_MAGIC: &[u8] = b"GIF8";
const WEBP_MAGIC: &[u8] = b"RIFF";

pub fn check_png(data: &[u8]) -> bool {
    check(data, PNG_MAGIC, ImageFormat::Png, reference_png)
}

pub fn check_jpeg(data: &[u8]) -> bool {
    check(data, JPEG_MAGIC, ImageFormat::Jpeg, reference_jpeg)
}

pub fn check_webp(data: &[u8]) -> bool {
    check(data, WEBP_MAGIC, ImageFormat::Webp, reference_webp)
}

pub fn check_gif(data: &[u8]) -> bool {
    check(data, GIF_MAGIC, ImageFormat::Gif, reference_gif)
}

fn check(
    data: &[u8],
    magic: &[u8],
    format: ImageFormat,
    reference: fn(&[u8]) -> Option<(u32, u32)>,
) -> bool {
    if !data.starts_with(magic) {
        return false;
    }
    let whole = read_image_header(data);
    assert_eq!(fed(data.chunks(1)), whole, "fed one byte at a time");
    let cut = seeded_pieces(data, xxh3_64(data));
    assert_eq!(fed(cut.iter().copied()), whole, "fed in pieces");
    if let Ok(info) = &whole {
        assert_eq!(info.format, format);
        assert!(info.width > 0 && info.height > 0);
    }
    if let Some(size) = reference(data).filter(|&(w, h)| w > 0 && h > 0) {
        agree(data, format, size, &whole);
    }
    true
}

fn fed<'a>(pieces: impl Iterator<Item = &'a [u8]>) -> Result<ImageInfo, HeaderError> {
    let mut r = HeaderReader::new();
    for p in pieces {
        r.feed(p);
    }
    r.finish()
}

fn agree(
    data: &[u8],
    format: ImageFormat,
    (w, h): (u32, u32),
    ours: &Result<ImageInfo, HeaderError>,
) {
    if ours.is_err() && judged_refused(data, format) {
        return;
    }
    let Ok(info) = ours else {
        panic!("the reference decodes {format} {w}x{h}, the header reader says {ours:?}");
    };
    assert_eq!(info.format, format);
    let same = (info.width, info.height) == (w, h);
    let swapped = (info.width, info.height) == (h, w) && has_orientation_tag(data);
    assert!(
        same || swapped,
        "the reference decodes {format} {w}x{h}, the header reader says {}x{}",
        info.width,
        info.height
    );
}

/// Files a reference decoder accepts and Pillow refuses (`scripts/judge-image-headers.py`;
/// the cases are in docs/FUZZING.md and fuzz/regressions/header_*): the reader may refuse
/// them too.
///
/// - JPEG whose frame precision is not 8 bits: `jpeg-decoder` decodes 12-bit and lossless
///   frames, Pillow refuses them.
/// - WebP whose RIFF header claims more bytes than the file has: `image-webp` decodes the
///   first frame if its bytes are there, Pillow (libwebp's demuxer) refuses every such file
///   ("could not create decoder object"), still or animated.
///
/// (A reference "decoding" an image with a zero dimension is not counted as a decode at all,
/// see [`check`]: the `gif` crate accepts a 0-wide logical screen and frame, Pillow refuses
/// the file, "cannot identify image file".)
fn judged_refused(data: &[u8], format: ImageFormat) -> bool {
    match format {
        ImageFormat::Jpeg => jpeg_precision(data).is_some_and(|p| p != 8),
        ImageFormat::Webp => data.get(4..8).is_some_and(|b| {
            let riff = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            8 + u64::from(riff) > data.len() as u64
        }),
        _ => false,
    }
}

/// The sample precision of the frame header that `jpeg-decoder` reads: the first SOF marker
/// (SOF0-SOF15 but DHT, JPG and DAC) met by walking the segments after SOI as the decoder
/// does. Bytes before a marker that are not `FF` are skipped (libjpeg's tolerance, which
/// `jpeg-decoder` copies), fill `FF`s are skipped, `FF 00` is not a marker, and every other
/// segment is stepped over by its length. A byte scan is not enough: `FF C0` inside an APP
/// segment is not a frame header (fuzz/regressions/header_jpeg/sof0-inside-app0-before-9-bit-sof3).
/// It follows the reference's walk, not the reader's (`mmrouter::image_header`): the reader is
/// what the check judges, so its walker cannot be the judge.
///
/// `jpeg-decoder` decodes 12-bit and lossless (2-16 bit) frames; Pillow refuses every JPEG whose
/// precision is not 8 ("cannot identify image file", judged on
/// fuzz/regressions/header_jpeg/lossless-9-bit-pillow-refuses), and so may the reader.
fn jpeg_precision(data: &[u8]) -> Option<u8> {
    if data.get(..2)? != [0xFF, 0xD8] {
        return None;
    }
    let mut at = 2;
    loop {
        at += data.get(at..)?.iter().position(|&b| b == 0xFF)?;
        at += data.get(at..)?.iter().position(|&b| b != 0xFF)?;
        let marker = *data.get(at)?;
        at += 1;
        match marker {
            0x00 => continue,
            0xC4 | 0xC8 | 0xCC => {}
            0xC0..=0xCF => return data.get(at + 2).copied(),
            // SOS before a frame, RST, EOI or TEM: the decoder finds no frame here.
            0x01 | 0xD0..=0xDA => return None,
            _ => {}
        }
        let length = usize::from(u16::from_be_bytes([*data.get(at)?, *data.get(at + 1)?]));
        if length < 2 {
            return None;
        }
        at += length;
    }
}

/// Whether the file carries something that can be an orientation: TIFF tag 0x0112 in either
/// byte order, or XMP's `Orientation`.
fn has_orientation_tag(data: &[u8]) -> bool {
    data.windows(2)
        .any(|w| w == [0x01, 0x12] || w == [0x12, 0x01])
        || data.windows(11).any(|w| w == b"Orientation")
}

fn reference_png(data: &[u8]) -> Option<(u32, u32)> {
    let decoder = png::Decoder::new_with_limits(
        Cursor::new(data),
        png::Limits {
            bytes: REFERENCE_BYTES,
        },
    );
    let mut reader = decoder.read_info().ok()?;
    let size = reader.output_buffer_size()?;
    if size > REFERENCE_BYTES {
        return None;
    }
    let mut buf = vec![0; size];
    reader.next_frame(&mut buf).ok()?;
    reader.finish().ok()?;
    let info = reader.info();
    Some((info.width, info.height))
}

/// The most output bytes `jpeg-decoder` may produce for one file. Lower than
/// [`REFERENCE_BYTES`]: a few KiB of fuzzed scan data behind a frame header claiming megapixels
/// made the decoder fill megabytes of output for every input, which held the target at ~1,000
/// executions per second (docs/FUZZING.md). The frame's size is read first, so a larger file
/// is compared on the streaming property only, as for the other formats.
pub const JPEG_REFERENCE_BYTES: usize = 1 << 20;

fn reference_jpeg(data: &[u8]) -> Option<(u32, u32)> {
    let mut decoder = jpeg_decoder::Decoder::new(Cursor::new(data));
    decoder.set_max_decoding_buffer_size(JPEG_REFERENCE_BYTES);
    decoder.read_info().ok()?;
    let info = decoder.info()?;
    let components = match info.pixel_format {
        jpeg_decoder::PixelFormat::L8 => 1,
        jpeg_decoder::PixelFormat::L16 => 2,
        jpeg_decoder::PixelFormat::RGB24 => 3,
        jpeg_decoder::PixelFormat::CMYK32 => 4,
    };
    if usize::from(info.width) * usize::from(info.height) * components > JPEG_REFERENCE_BYTES {
        return None;
    }
    decoder.decode().ok()?;
    let info = decoder.info()?;
    Some((u32::from(info.width), u32::from(info.height)))
}

fn reference_gif(data: &[u8]) -> Option<(u32, u32)> {
    let mut options = gif::DecodeOptions::new();
    options.set_memory_limit(gif::MemoryLimit::Bytes(std::num::NonZeroU64::new(
        REFERENCE_BYTES as u64,
    )?));
    let mut decoder = options.read_info(Cursor::new(data)).ok()?;
    let (sw, sh) = (u32::from(decoder.width()), u32::from(decoder.height()));
    let frame = decoder.read_next_frame().ok()??;
    // Pillow grows the size to hold the first frame (see mmrouter::image_header).
    let w = sw.max(u32::from(frame.left) + u32::from(frame.width));
    let h = sh.max(u32::from(frame.top) + u32::from(frame.height));
    Some((w, h))
}

fn reference_webp(data: &[u8]) -> Option<(u32, u32)> {
    // image-webp allocates a frame's buffer from its VP8/VP8L header before checking it
    // against the canvas (a 416-byte animated file made it allocate 256 MiB:
    // fuzz/regressions/header_webp/frame-claims-16383x16383-reference-allocates-256mib), so
    // files with a frame over the reference's budget are compared on the streaming property
    // only.
    if !webp_frames_within(data, REFERENCE_BYTES) {
        return None;
    }
    let mut decoder = image_webp::WebPDecoder::new(Cursor::new(data)).ok()?;
    let size = decoder.output_buffer_size()?;
    if size > REFERENCE_BYTES {
        return None;
    }
    let mut buf = vec![0; size];
    decoder.read_image(&mut buf).ok()?;
    Some(decoder.dimensions())
}

/// Whether every `VP8 ` and `VP8L` chunk tag anywhere in the file (an over-approximation of
/// its frames) is followed by a frame header of at most `budget` RGBA bytes.
fn webp_frames_within(data: &[u8], budget: usize) -> bool {
    let le16 = |at: usize| {
        data.get(at..at + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    (0..data.len().saturating_sub(3)).all(|i| {
        let size = match data.get(i..i + 4) {
            // VP8: frame tag (3 bytes), start code (3), then 14-bit width and height.
            Some(b"VP8 ") => le16(i + 14)
                .zip(le16(i + 16))
                .map(|(w, h)| (usize::from(w & 0x3fff), usize::from(h & 0x3fff))),
            // VP8L: signature byte, then 14-bit width - 1 and height - 1.
            Some(b"VP8L") => data.get(i + 9..i + 13).map(|b| {
                let bits = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                (
                    (bits & 0x3fff) as usize + 1,
                    ((bits >> 14) & 0x3fff) as usize + 1,
                )
            }),
            _ => None,
        };
        size.is_none_or(|(w, h)| w * h * 4 <= budget)
    })
}
