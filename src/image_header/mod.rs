//! Image size from the file header, without decoding pixels, read as the bytes arrive.
//!
//! [`HeaderReader`] takes the decoded bytes of an image in pieces of any size ([`HeaderReader::feed`])
//! and returns the format and the size *as the model's image processor sees it* at
//! [`HeaderReader::finish`], which for a vLLM worker means the size of the PIL image after vLLM's
//! loader has run. [`read_image_header`] is the same reader fed one slice. It reads only headers
//! and metadata segments: no pixel is decoded, nothing proportional to `width * height` is
//! allocated, no input can make it panic, and the result never depends on how the input was cut
//! into pieces.
//!
//! # What it keeps while the bytes stream by
//!
//! Each format is a state machine over the byte stream (modules `png`, `jpeg`, `webp`, `gif`)
//! that skips what it does not need by length, so a reader holds at most:
//!
//! * the first 12 bytes (format sniffing), PNG's first 33 (signature and `IHDR`, handed to the
//!   `png` crate) and WebP's first 30 (RIFF header and first chunk header);
//! * one EXIF payload at a time, only while it streams by, and only when it does not arrive in
//!   one piece (a payload inside one [`HeaderReader::feed`] slice is read in place), capped at
//!   [`EXIF_CAP`] bytes (64 KiB, JPEG's segment limit): only the orientation is kept from it;
//! * a few bytes of matcher state for XMP packets (searched as they stream by, never stored);
//! * for GIF, the `gif` crate's streaming decoder (its palettes and one 255-byte sub-block).
//!
//! One divergence from the slice reader this module replaced: an EXIF payload of a PNG or WebP
//! file is read from its first [`EXIF_CAP`] bytes only, so an orientation tag stored beyond
//! 64 KiB into the TIFF structure is not seen (cameras write IFD0 right after the 8-byte TIFF
//! header; JPEG segments cannot be longer anyway).
//!
//! # What vLLM does with EXIF orientation (and so what this module does)
//!
//! vLLM loads every image part (URL, `data:` URL, file) through
//! `ImageMediaIO.load_bytes` in `vllm/multimodal/media/image.py`. Since vLLM PR #44974
//! ("\[Security\] Fix image EXIF orientation and tRNS transparency handling", merged June 2026,
//! before the 0.33 release that the rest of this project follows) that path calls
//! `normalize_image()` from `vllm/multimodal/image.py` right after `Image.open`, and
//! `normalize_image` is `PIL.ImageOps.exif_transpose`. In the newest `image.py` we could read
//! (`load_bytes` -> `load_bytes_many`) the Pillow path calls `normalize_image(image)` for every
//! image and the nvImageCodec GPU path re-applies it when the EXIF orientation is 2..=8; PR
//! #47566 (July 2026) extended the same normalisation to direct `PIL.Image` inputs and
//! describes the bytes path as "JPEG EXIF orientation is applied to pixels". Older vLLM
//! (`load_bytes` = `Image.open` + mode conversion only) did not transpose.
//!
//! So the processor sees the size AFTER `exif_transpose`: width and height are swapped when the
//! orientation is 5, 6, 7 or 8 (transpose, rotate 270, transverse, rotate 90) and unchanged for
//! 1..=4. Pillow 13's `exif_transpose` takes the orientation from `Image.getexif()`, which reads:
//!
//! * JPEG: the first APP1 `Exif\0\0` segment (a TIFF structure; IFD0 tag 0x0112). Only if IFD0
//!   has no 0x0112 entry at all, the XMP packet (the last APP1 `http://ns.adobe.com/xap/1.0/\0`
//!   segment) is searched for `tiff:Orientation="N` or `tiff:Orientation>N`.
//! * PNG: the `eXIf` chunk (the last one before the first `IDAT`; if there is none, Pillow loads
//!   the file and takes the last one after the image data), then the XMP text chunk
//!   `XML:com.adobe.xmp` (`tEXt` or uncompressed `iTXt`).
//! * WebP: the first `EXIF` chunk, then the first `XMP ` chunk (extended files only).
//! * GIF: Pillow keeps no EXIF or XMP for GIF, so GIF is never transposed.
//!
//! Known divergences from Pillow, all for files no camera or encoder writes: compressed PNG text
//! (`zTXt`, compressed `iTXt`) and ImageMagick's `Raw profile type exif` text are not inflated
//! (that would need a zlib stream on the hot path); BigTIFF-in-EXIF is ignored; an IFD entry
//! whose value lies outside the first JPEG Exif segment (Pillow would read it from the
//! concatenation of later Exif segments) is ignored. In each case we report the stored size.
//! Malformed EXIF is treated as "no orientation", never as an error.
//!
//! # Size rules per format (what Pillow reports)
//!
//! * PNG: `IHDR` width and height. The chunk list must reach `IEND` (lengths are followed,
//!   data is not read), because Pillow may take `eXIf` from after the image data.
//! * JPEG: the last SOFn segment before SOS (any of SOF0-3, 5-7, 9-11, 13-15 and DHP, as in
//!   Pillow); width = bytes 3-4, height = bytes 1-2. Pillow refuses precisions other than 8 bit
//!   and component counts other than 1, 3 or 4, and so do we (`Corrupt`).
//! * WebP: the VP8 frame size, the VP8L header size, or the VP8X canvas size (which is what
//!   Pillow reports for alpha and animated files). An input shorter than its RIFF size is
//!   `Truncated` (the EXIF chunk usually comes last).
//! * JPEG needs every segment up to and including the SOS header; a cut before it is
//!   `Truncated`.
//! * GIF: the logical screen size, enlarged to contain the first frame: Pillow's
//!   `GifImageFile._seek(0)` grows the size to `max(screen, frame left + width, frame top +
//!   height)`.
//!
//! Zero width or height is `Corrupt` (no processor accepts it).
//!
//! # Crate choices (evaluated for the issue: header-only, panic-free, wasm, no big allocation)
//!
//! * PNG: [`::png`] 0.18, `Decoder::read_header_info` (default features off; pure Rust). It reads
//!   the signature and `IHDR` only (the crate refuses any other first chunk and any `IHDR`
//!   length but 13, so it never needs more than the first 33 bytes), validates the CRC and the
//!   bit-depth/colour-type combination (Pillow rejects the same files), and allocates nothing
//!   image-sized (about 19.5 KB of decoder state per call, measured). `read_info` was not used:
//!   it also inflates iCCP/text chunks up to its memory limit, and it stops at the first `IDAT`,
//!   which is not where Pillow looks for a late `eXIf`. The orientation metadata walk is a
//!   separate chunk walk over the stream.
//! * GIF: [`::gif`] 0.14 (features: `std` only; `color_quant`/`raii_no_panic` are encoder
//!   features). Its `StreamingDecoder` is fed the pieces as they come, and module `gif` replays the
//!   event handling of `DecodeOptions::read_info` + `Decoder::next_frame_info` (which stops at
//!   the first image descriptor, the frame extent Pillow uses), including the 1 MiB limit on
//!   XMP/ICC application data that the slice reader set; the data itself is counted, not kept.
//! * WebP: the validation of [`image_webp`] 0.2's `WebPDecoder::new` (no features), replayed
//!   over the stream by module `webp`: `new` seeks backwards (to the `ANIM` chunk and into the
//!   first `ANMF` frame) after walking every chunk header, which a stream cannot do, so the reader
//!   walks the same headers forward, keeps the few bytes `new` reads (the `ANIM` payload, the
//!   first frame's sub-chunk header) and reports the crate's own error values. The EXIF/XMP
//!   chunks are found by a second walk, as before.
//! * JPEG: hand-written marker walker, and neither JPEG crate. `jpeg-decoder` 0.3 is deprecated
//!   upstream in favour of `zune-jpeg`. `zune-jpeg` 0.5 `decode_headers` parses and allocates the
//!   Huffman and quantisation tables and copies ICC/EXIF/XMP segments into `Vec`s, its defaults
//!   pull in SIMD features, and it rejects SOF3, SOF5-7 and the arithmetic-coded SOF9-15 that
//!   Pillow (libjpeg-turbo) opens, so it would report errors for files vLLM accepts. Finding the
//!   size is a segment walk up to SOS, which we need anyway to find the EXIF APP1 segment; fed in
//!   one slice it allocates nothing (the EXIF segment is read in place).
//!   The walker follows Pillow's loop: fill bytes (`FF FF`), stray `FF 00` and non-`FF` junk
//!   between segments are skipped, standalone markers (RSTn, TEM, SOI) carry no length, and an
//!   unknown marker is an error.
//!
//! All three crates build for `wasm32-unknown-unknown`, `wasm32-wasip1` and `wasm32-wasip2`
//! (no threads, no filesystem, no C).

use std::fmt;

mod exif;
mod gif;
mod jpeg;
mod png;
mod webp;

/// The most bytes of one EXIF payload that are read for the orientation (JPEG's segment limit).
pub const EXIF_CAP: usize = 64 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ImageFormat {
    Png,
    Jpeg,
    Webp,
    Gif,
}

impl fmt::Display for ImageFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ImageFormat::Png => "PNG",
            ImageFormat::Jpeg => "JPEG",
            ImageFormat::Webp => "WebP",
            ImageFormat::Gif => "GIF",
        })
    }
}

/// Size as the model's image processor sees it (after EXIF orientation, see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ImageInfo {
    pub format: ImageFormat,
    pub width: u32,
    pub height: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderError {
    /// Not PNG, JPEG, WebP or GIF.
    Unrecognised,
    /// The header ends before the size is known: `truncated PNG header`.
    Truncated(ImageFormat),
    /// The header is there but wrong.
    Corrupt(ImageFormat, String),
}

impl fmt::Display for HeaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HeaderError::Unrecognised => f.write_str("unrecognised image format"),
            HeaderError::Truncated(fmt) => write!(f, "truncated {fmt} header"),
            HeaderError::Corrupt(fmt, why) => write!(f, "corrupt {fmt} header: {why}"),
        }
    }
}

impl std::error::Error for HeaderError {}

/// Reads format, width and height from an image file held whole: [`HeaderReader`] fed once.
///
/// The size is the one vLLM's image processor sees: EXIF/XMP orientations 5..=8 swap width and
/// height (see the module docs for the source). Never panics; allocates nothing proportional to
/// the image.
pub fn read_image_header(bytes: &[u8]) -> Result<ImageInfo, HeaderError> {
    let mut reader = HeaderReader::new();
    reader.feed(bytes);
    reader.finish()
}

/// Bytes needed to tell the formats apart (`RIFF????WEBP`).
const SNIFF_LEN: usize = 12;

/// An image header read from the file's bytes as they arrive, in pieces of any size.
///
/// `feed` never fails and never needs earlier bytes again; `finish` (at the end of the file)
/// gives what [`read_image_header`] gives for the concatenation of every piece.
#[derive(Debug)]
pub struct HeaderReader {
    state: Reader,
}

#[derive(Debug)]
enum Reader {
    /// Fewer than [`SNIFF_LEN`] bytes seen.
    Sniffing {
        head: [u8; SNIFF_LEN],
        len: usize,
    },
    Png(png::PngReader),
    Jpeg(jpeg::JpegReader),
    Webp(webp::WebpReader),
    Gif(Box<gif::GifReader>),
    Failed(HeaderError),
}

impl Default for HeaderReader {
    fn default() -> Self {
        Self::new()
    }
}

impl HeaderReader {
    pub fn new() -> HeaderReader {
        HeaderReader {
            state: Reader::Sniffing {
                head: [0; SNIFF_LEN],
                len: 0,
            },
        }
    }

    /// The next bytes of the file.
    pub fn feed(&mut self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        match &mut self.state {
            Reader::Sniffing { head, len } => {
                let earlier = *len;
                let take = (SNIFF_LEN - earlier).min(bytes.len());
                if let (Some(dst), Some(src)) =
                    (head.get_mut(earlier..earlier + take), bytes.get(..take))
                {
                    dst.copy_from_slice(src);
                }
                *len += take;
                if *len < SNIFF_LEN {
                    return;
                }
                let head = *head;
                if earlier == 0 {
                    // All of the head is in this piece: the reader gets the piece whole, so a
                    // segment near the start is still read in place.
                    self.state = Reader::unfed(&head);
                    self.feed(bytes);
                } else {
                    self.state = Reader::start(&head);
                    self.feed(bytes.get(take..).unwrap_or_default());
                }
            }
            Reader::Png(r) => r.feed(bytes),
            Reader::Jpeg(r) => r.feed(bytes),
            Reader::Webp(r) => r.feed(bytes),
            Reader::Gif(r) => r.feed(bytes),
            Reader::Failed(_) => {}
        }
    }

    /// The end of the file: the format and size, or why they cannot be read.
    pub fn finish(self) -> Result<ImageInfo, HeaderError> {
        let state = match self.state {
            // A file shorter than the sniffing window: decide on what there is.
            Reader::Sniffing { head, len } => Reader::start(head.get(..len).unwrap_or_default()),
            other => other,
        };
        let (format, size) = match state {
            Reader::Sniffing { .. } => return Err(HeaderError::Unrecognised),
            Reader::Png(r) => (ImageFormat::Png, r.finish()),
            Reader::Jpeg(r) => (ImageFormat::Jpeg, r.finish()),
            Reader::Webp(r) => (ImageFormat::Webp, r.finish()),
            Reader::Gif(r) => (ImageFormat::Gif, r.finish()),
            Reader::Failed(e) => return Err(e),
        };
        let (width, height) = size?;
        if width == 0 || height == 0 {
            return Err(HeaderError::Corrupt(
                format,
                format!("zero image size {width}x{height}"),
            ));
        }
        Ok(ImageInfo {
            format,
            width,
            height,
        })
    }
}

impl Reader {
    /// The reader for the format that `head` (the file's first bytes: all of them when the
    /// file is shorter than [`SNIFF_LEN`]) starts, already fed `head`.
    fn start(head: &[u8]) -> Reader {
        let mut reader = Reader::unfed(head);
        match &mut reader {
            Reader::Png(r) => r.feed(head),
            Reader::Jpeg(r) => r.feed(head),
            Reader::Webp(r) => r.feed(head),
            Reader::Gif(r) => r.feed(head),
            Reader::Sniffing { .. } | Reader::Failed(_) => {}
        }
        reader
    }

    /// The reader for the format that `head` starts, not fed yet.
    fn unfed(head: &[u8]) -> Reader {
        match sniff(head) {
            Ok(ImageFormat::Png) => Reader::Png(png::PngReader::new()),
            Ok(ImageFormat::Jpeg) => Reader::Jpeg(jpeg::JpegReader::new()),
            Ok(ImageFormat::Webp) => Reader::Webp(webp::WebpReader::new()),
            Ok(ImageFormat::Gif) => Reader::Gif(Box::new(gif::GifReader::new())),
            Err(e) => Reader::Failed(e),
        }
    }
}

const PNG_SIGNATURE: &[u8; 8] = b"\x89PNG\r\n\x1a\n";

/// Decides the format from the magic bytes. A prefix of a magic (a file cut inside its first
/// bytes) is `Truncated` for that format; an empty input is `Unrecognised`.
fn sniff(b: &[u8]) -> Result<ImageFormat, HeaderError> {
    let candidates: [(&[u8], ImageFormat); 4] = [
        (PNG_SIGNATURE, ImageFormat::Png),
        (b"\xff\xd8\xff", ImageFormat::Jpeg),
        (b"GIF8", ImageFormat::Gif),
        (b"RIFF", ImageFormat::Webp),
    ];
    for (magic, format) in candidates {
        if b.starts_with(magic) {
            if format == ImageFormat::Webp {
                // RIFF????WEBP
                return match b.get(8..12) {
                    Some(b"WEBP") => Ok(format),
                    Some(_) => Err(HeaderError::Unrecognised),
                    None if b"WEBP".starts_with(b.get(8..).unwrap_or_default()) => {
                        Err(HeaderError::Truncated(format))
                    }
                    None => Err(HeaderError::Unrecognised),
                };
            }
            return Ok(format);
        }
        if !b.is_empty() && b.len() < magic.len() && magic.starts_with(b) {
            return Err(HeaderError::Truncated(format));
        }
    }
    Err(HeaderError::Unrecognised)
}

/// Applies an EXIF orientation: 5..=8 swap the axes, everything else keeps them.
fn oriented((w, h): (u32, u32), orientation: Option<u32>) -> (u32, u32) {
    match orientation {
        Some(5..=8) => (h, w),
        _ => (w, h),
    }
}

/// Copies as much of `src` as fits into `dst[*filled..]`; returns how many bytes were taken.
fn fill(dst: &mut [u8], filled: &mut usize, src: &[u8]) -> usize {
    let room = dst.len().saturating_sub(*filled);
    let take = room.min(src.len());
    if let (Some(d), Some(s)) = (dst.get_mut(*filled..*filled + take), src.get(..take)) {
        d.copy_from_slice(s);
    }
    *filled += take;
    take
}

fn be16(b: &[u8], at: usize) -> Option<u16> {
    let s = b.get(at..at.checked_add(2)?)?;
    Some(u16::from_be_bytes([*s.first()?, *s.get(1)?]))
}

fn le32(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes(s.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sniffing_waits_for_twelve_bytes_and_decides_short_files_at_the_end() {
        // "RIFF" then a WAVE header: only the bytes 8..12 tell it from WebP.
        let mut r = HeaderReader::new();
        r.feed(b"RIFF\x10\0\0\0WA");
        assert!(matches!(r.state, Reader::Sniffing { len: 10, .. }));
        r.feed(b"VEfmt ");
        assert!(matches!(r.state, Reader::Failed(HeaderError::Unrecognised)));
        let mut short = HeaderReader::new();
        short.feed(b"GIF8");
        assert_eq!(
            short.finish(),
            Err(HeaderError::Truncated(ImageFormat::Gif))
        );
        assert_eq!(HeaderReader::new().finish(), Err(HeaderError::Unrecognised));
    }
}
