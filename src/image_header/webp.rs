//! WebP: the checks of `image_webp::WebPDecoder::new`, replayed over the stream, and the EXIF/XMP
//! chunk walk.
//!
//! Size: the VP8 frame size, the VP8L header size, or the VP8X canvas size (which is what Pillow
//! reports for alpha and animated files). An input shorter than its RIFF size is `Truncated`
//! (the EXIF chunk usually comes last, and vLLM cannot decode a cut file anyway). Orientation:
//! the first `EXIF` and the first `XMP ` chunk of an extended (VP8X) file, as libwebp's demuxer
//! (which Pillow uses) returns them; Pillow strips any leading `Exif\0\0` from the EXIF chunk.
//!
//! `WebPDecoder::new` reads the first chunk's header, then for VP8X walks every chunk header up
//! to the RIFF end (seeking over data, reading a duration and a sub-chunk header inside each
//! `ANMF` frame), checks that the chunks the VP8X flags announce exist, and finally seeks back
//! to read the `ANIM` chunk and the first frame's sub-chunk headers. [`FrameWalk`] follows the
//! same headers forward and keeps what the backward reads need: the `ANIM` chunk's extent and
//! the first frame's first sub-chunk size (the crate reads the second sub-chunk header from
//! where the first ended, not from where the first sub-chunk ends; so do we). Errors are the
//! crate's own values, so their messages are the ones the slice reader reported.

use super::exif::{Tag, Whole, XmpMatcher, combine, exif_orientation};
use super::{HeaderError, ImageFormat, fill, le32, oriented};
use image_webp::DecodingError;

const F: ImageFormat = ImageFormat::Webp;
/// RIFF header, first chunk header, and the first chunk's first 10 bytes: all that
/// `WebPDecoder::new` reads before its chunk walk.
const HEAD_LEN: usize = 30;

#[derive(Debug)]
pub(super) struct WebpReader {
    /// Bytes seen so far.
    len: u64,
    head: [u8; HEAD_LEN],
    head_len: usize,
    started: bool,
    frames: Option<FrameWalk>,
    meta: Option<MetaWalk>,
}

/// How a read at the end of the file ended: the crate reads through `io::Read`, so a read past
/// the end is an `UnexpectedEof` I/O error, which is `Truncated` here.
#[derive(Debug)]
enum Fail {
    Eof,
    Decoder(DecodingError),
}

impl From<DecodingError> for Fail {
    fn from(e: DecodingError) -> Fail {
        Fail::Decoder(e)
    }
}

/// Kinds of chunk the walk records (the crate's chunk map keeps the first of each).
#[derive(Debug, Clone, Copy)]
#[repr(u8)]
enum Kind {
    Vp8 = 1,
    Vp8l = 2,
    Anim = 4,
    Anmf = 8,
    Exif = 16,
    Xmp = 32,
}

/// The VP8X chunk walk of `WebPDecoder::new`.
#[derive(Debug)]
struct FrameWalk {
    /// File offset of the next byte this walk has not seen.
    pos: u64,
    /// The walk reads chunk headers while their offset is below this.
    max: u64,
    state: FrameState,
    is_lossy: bool,
    found: u8,
    /// Offset and size of the first `ANIM` chunk's data.
    anim: Option<(u64, u64)>,
    /// The first `ANMF` chunk: data offset, data end, and its first sub-chunk's rounded size.
    anmf: Option<(u64, u64, Option<u64>)>,
}

#[derive(Debug)]
enum FrameState {
    /// Reading `want` bytes at file offset `at`.
    Read {
        at: u64,
        want: usize,
        buf: [u8; 8],
        got: usize,
        why: Why,
    },
    /// The loop ended (past the RIFF end).
    Ended,
    /// An `ANMF` chunk shorter than its fixed fields: `InvalidChunkSize`.
    BadFrameSize,
}

#[derive(Debug, Clone, Copy)]
enum Why {
    /// A chunk header (a read past the file end ends the loop).
    Header,
    /// The duration inside the `ANMF` chunk at `chunk` (a read past the end is an error).
    Duration { chunk: u64, rounded: u64 },
    /// The first sub-chunk header inside that `ANMF` chunk.
    Sub { chunk: u64, rounded: u64 },
}

/// The first `EXIF` and `XMP ` chunks, walking from the VP8X chunk to the end of the input.
#[derive(Debug)]
struct MetaWalk {
    pos: u64,
    state: MetaState,
    exif: Option<Tag>,
    xmp: Option<Option<u32>>,
}

#[derive(Debug)]
enum MetaState {
    Header {
        at: u64,
        buf: [u8; 8],
        got: usize,
    },
    Data {
        left: u64,
        next: u64,
        what: MetaData,
    },
    /// Both chunks found.
    Done,
}

#[derive(Debug)]
enum MetaData {
    Skip,
    Exif(Whole),
    Xmp(XmpMatcher),
}

impl WebpReader {
    pub(super) fn new() -> WebpReader {
        WebpReader {
            len: 0,
            head: [0; HEAD_LEN],
            head_len: 0,
            started: false,
            frames: None,
            meta: None,
        }
    }

    pub(super) fn feed(&mut self, input: &[u8]) {
        let offset = self.len;
        self.len += input.len() as u64;
        if self.head_len < HEAD_LEN {
            fill(&mut self.head, &mut self.head_len, input);
            if self.head_len < HEAD_LEN {
                return;
            }
        }
        if !self.started {
            self.start();
        }
        if let Some(w) = &mut self.frames {
            w.feed_at(offset, input);
        }
        if let Some(w) = &mut self.meta {
            w.feed_at(offset, input);
        }
    }

    /// Sets up the walks once the head is known, and shows them the head.
    fn start(&mut self) {
        self.started = true;
        let head = self.head.get(..self.head_len).unwrap_or_default();
        if head.get(12..16) != Some(b"VP8X") {
            return;
        }
        let mut meta = MetaWalk {
            pos: 12,
            state: MetaState::Header {
                at: 12,
                buf: [0; 8],
                got: 0,
            },
            exif: None,
            xmp: None,
        };
        meta.feed_at(0, head);
        self.meta = Some(meta);
        let (Some(riff), Some(first)) = (le32(head, 4), le32(head, 16)) else {
            return;
        };
        // After the first chunk's header (offset 20) and data, up to the RIFF end as the crate
        // computes it.
        let start = 20 + rounded(first);
        let max = start + u64::from(riff.saturating_sub(12));
        let mut frames = FrameWalk {
            pos: start,
            max,
            state: FrameState::Ended,
            is_lossy: false,
            found: 0,
            anim: None,
            anmf: None,
        };
        frames.next_header(start);
        frames.feed_at(0, head);
        self.frames = Some(frames);
    }

    pub(super) fn finish(mut self) -> Result<(u32, u32), HeaderError> {
        if !self.started {
            self.start();
        }
        let head = self.head.get(..self.head_len).unwrap_or_default();
        // The RIFF size says how long the file should be; an error on a shorter input is
        // truncation. A cut file is an error even when the frame header survived.
        let short = le32(head, 4).is_none_or(|riff| self.len < u64::from(riff) + 8);
        if short {
            return Err(HeaderError::Truncated(F));
        }
        let size = match decoder_checks(head, self.frames.as_ref(), self.len) {
            Ok(size) => size,
            Err(Fail::Eof) => return Err(HeaderError::Truncated(F)),
            Err(Fail::Decoder(e)) => return Err(HeaderError::Corrupt(F, e.to_string())),
        };
        let (exif, xmp) = match &self.meta {
            Some(m) => (m.exif, m.xmp),
            None => (None, None),
        };
        Ok(oriented(size, combine(exif, xmp)))
    }
}

/// A chunk size rounded up to even, as the crate rounds it (saturating at `u32::MAX`).
fn rounded(size: u32) -> u64 {
    u64::from(size.saturating_add(size & 1))
}

/// Reads `N` bytes at `at` of the head, or `Eof` when the file ends before them.
fn read<const N: usize>(head: &[u8], at: usize) -> Result<[u8; N], Fail> {
    head.get(at..at + N)
        .and_then(|s| s.try_into().ok())
        .ok_or(Fail::Eof)
}

fn u24(b: [u8; 3]) -> u32 {
    u32::from(b[0]) | (u32::from(b[1]) << 8) | (u32::from(b[2]) << 16)
}

/// `WebPDecoder::new` on the whole file: the first chunk from the head, the VP8X walk's record,
/// and the reads it does after the walk, against the file length.
fn decoder_checks(
    head: &[u8],
    frames: Option<&FrameWalk>,
    file_len: u64,
) -> Result<(u32, u32), Fail> {
    let riff_fourcc: [u8; 4] = read(head, 0)?;
    let _riff_size: [u8; 4] = read(head, 4)?;
    if &riff_fourcc != b"RIFF" {
        return Err(DecodingError::ChunkHeaderInvalid(*b"RIFF").into());
    }
    let webp: [u8; 4] = read(head, 8)?;
    if &webp != b"WEBP" {
        return Err(DecodingError::WebpSignatureInvalid(webp).into());
    }
    let chunk: [u8; 4] = read(head, 12)?;
    let _size: [u8; 4] = read(head, 16)?;
    match &chunk {
        b"VP8 " => {
            let tag = u24(read(head, 20)?);
            if tag & 1 != 0 {
                return Err(
                    DecodingError::UnsupportedFeature("Non-keyframe frames".to_owned()).into(),
                );
            }
            let magic: [u8; 3] = read(head, 23)?;
            if magic != [0x9d, 0x01, 0x2a] {
                return Err(DecodingError::Vp8MagicInvalid(magic).into());
            }
            let w = u16::from_le_bytes(read(head, 26)?);
            let h = u16::from_le_bytes(read(head, 28)?);
            let (width, height) = (u32::from(w & 0x3FFF), u32::from(h & 0x3FFF));
            if width == 0 || height == 0 {
                return Err(DecodingError::InconsistentImageSizes.into());
            }
            Ok((width, height))
        }
        b"VP8L" => {
            let [signature] = read::<1>(head, 20)?;
            if signature != 0x2f {
                return Err(DecodingError::LosslessSignatureInvalid(signature).into());
            }
            let header = u32::from_le_bytes(read(head, 21)?);
            let version = header >> 29;
            if version != 0 {
                return Err(DecodingError::VersionNumberInvalid(version as u8).into());
            }
            Ok(((1 + header) & 0x3FFF, (1 + (header >> 14)) & 0x3FFF))
        }
        b"VP8X" => {
            let [flags] = read::<1>(head, 20)?;
            let _reserved: [u8; 3] = read(head, 21)?;
            let width = u24(read(head, 24)?) + 1;
            let height = u24(read(head, 27)?) + 1;
            if width.checked_mul(height).is_none() {
                return Err(DecodingError::ImageTooLarge.into());
            }
            let animation = flags & 0b0000_0010 != 0;
            let exif = flags & 0b0000_1000 != 0;
            let xmp = flags & 0b0000_0100 != 0;
            let Some(walk) = frames else {
                return Err(Fail::Eof);
            };
            match &walk.state {
                FrameState::BadFrameSize => return Err(DecodingError::InvalidChunkSize.into()),
                // A chunk header cut by the end of the file ends the loop; a cut read inside
                // an ANMF chunk is an error.
                FrameState::Read {
                    why: Why::Duration { .. } | Why::Sub { .. },
                    ..
                } => return Err(Fail::Eof),
                FrameState::Read {
                    why: Why::Header, ..
                }
                | FrameState::Ended => {}
            }
            let has = |k: Kind| walk.found & (k as u8) != 0;
            if animation && (!has(Kind::Anim) || !has(Kind::Anmf))
                || exif && !has(Kind::Exif)
                || xmp && !has(Kind::Xmp)
                || !animation && has(Kind::Vp8) == has(Kind::Vp8l)
            {
                return Err(DecodingError::ChunkMissing.into());
            }
            if animation {
                // The ANIM chunk is read whole (at most 6 bytes), then its 6 bytes parsed.
                let Some((start, size)) = walk.anim else {
                    return Err(DecodingError::ChunkMissing.into());
                };
                if size > 6 {
                    return Err(DecodingError::InvalidChunkSize.into());
                }
                if start + size > file_len || size < 6 {
                    return Err(Fail::Eof);
                }
            }
            if let Some((start, end, first)) = walk.anmf {
                // The first frame's sub-chunk headers: the first (at start + 16) was read by the
                // walk. The crate reads the second if the first sub-chunk leaves room for one in
                // the frame, but without seeking to it: from where the first header ended.
                let Some(first) = first else {
                    return Err(Fail::Eof);
                };
                if start + 16 + 8 + first + 8 <= end && start + 32 > file_len {
                    return Err(Fail::Eof);
                }
            }
            Ok((width, height))
        }
        _ => Err(DecodingError::ChunkHeaderInvalid(chunk).into()),
    }
}

impl FrameWalk {
    /// The loop's next iteration: a chunk header at `at`, if still below the RIFF end.
    fn next_header(&mut self, at: u64) {
        self.state = if at < self.max {
            FrameState::Read {
                at,
                want: 8,
                buf: [0; 8],
                got: 0,
                why: Why::Header,
            }
        } else {
            FrameState::Ended
        };
    }

    /// Bytes of the file starting at offset `offset`.
    fn feed_at(&mut self, offset: u64, bytes: &[u8]) {
        let end = offset + bytes.len() as u64;
        while self.pos < end {
            let FrameState::Read {
                at,
                want,
                buf,
                got,
                why,
            } = &mut self.state
            else {
                return;
            };
            if self.pos < *at {
                // Seek over data.
                self.pos = (*at).min(end);
                continue;
            }
            let from = usize::try_from(self.pos - offset).unwrap_or(usize::MAX);
            let avail = bytes.get(from..).unwrap_or_default();
            let before = *got;
            let view = buf.get_mut(..*want).unwrap_or_default();
            fill(view, got, avail);
            self.pos += (*got - before) as u64;
            if *got < *want {
                return;
            }
            let (at, buf, why) = (*at, *buf, *why);
            self.read_done(at, buf, why);
        }
    }

    fn read_done(&mut self, at: u64, buf: [u8; 8], why: Why) {
        match why {
            Why::Header => {
                let fourcc = [buf[0], buf[1], buf[2], buf[3]];
                let size = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]);
                let rounded = rounded(size);
                let kind = match &fourcc {
                    b"VP8 " => Some(Kind::Vp8),
                    b"VP8L" => Some(Kind::Vp8l),
                    b"ANIM" => Some(Kind::Anim),
                    b"ANMF" => Some(Kind::Anmf),
                    b"EXIF" => Some(Kind::Exif),
                    b"XMP " => Some(Kind::Xmp),
                    _ => None,
                };
                if let Some(kind) = kind
                    && self.found & (kind as u8) == 0
                {
                    self.found |= kind as u8;
                    match kind {
                        Kind::Anim => self.anim = Some((at + 8, u64::from(size))),
                        Kind::Anmf => self.anmf = Some((at + 8, at + 8 + u64::from(size), None)),
                        _ => {}
                    }
                }
                if matches!(kind, Some(Kind::Anmf)) {
                    if size < 24 {
                        self.state = FrameState::BadFrameSize;
                        return;
                    }
                    self.state = FrameState::Read {
                        at: at + 20,
                        want: 4,
                        buf: [0; 8],
                        got: 0,
                        why: Why::Duration { chunk: at, rounded },
                    };
                } else {
                    self.next_header(at + 8 + rounded);
                }
            }
            Why::Duration { chunk, rounded } => {
                if self.is_lossy {
                    self.next_header(chunk + 8 + rounded);
                } else {
                    self.state = FrameState::Read {
                        at: chunk + 24,
                        want: 8,
                        buf: [0; 8],
                        got: 0,
                        why: Why::Sub { chunk, rounded },
                    };
                }
            }
            Why::Sub { chunk, rounded } => {
                if matches!(&buf[..4], b"VP8 " | b"ALPH") {
                    self.is_lossy = true;
                }
                if let Some((start, _, first @ None)) = &mut self.anmf
                    && *start == chunk + 8
                {
                    let size = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]);
                    *first = Some(self::rounded(size));
                }
                self.next_header(chunk + 8 + rounded);
            }
        }
    }
}

impl MetaWalk {
    fn feed_at(&mut self, offset: u64, bytes: &[u8]) {
        let end = offset + bytes.len() as u64;
        while self.pos < end {
            let from = usize::try_from(self.pos - offset).unwrap_or(usize::MAX);
            let avail = bytes.get(from..).unwrap_or_default();
            match &mut self.state {
                MetaState::Done => return,
                MetaState::Header { at, buf, got } => {
                    if self.pos < *at {
                        self.pos = (*at).min(end);
                        continue;
                    }
                    let used = fill(buf, got, avail);
                    self.pos += used as u64;
                    if *got < 8 {
                        return;
                    }
                    let at = *at;
                    let len = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]);
                    let what = match &buf[..4] {
                        b"EXIF" if self.exif.is_none() => MetaData::Exif(Whole::new(len.into())),
                        b"XMP " if self.xmp.is_none() => MetaData::Xmp(XmpMatcher::default()),
                        _ => MetaData::Skip,
                    };
                    let len = u64::from(len);
                    self.state = MetaState::Data {
                        left: len,
                        next: at + 8 + len + (len & 1),
                        what,
                    };
                    if len == 0 {
                        self.data_done();
                    }
                }
                MetaState::Data { left, what, .. } => {
                    let n = usize::try_from(*left)
                        .unwrap_or(usize::MAX)
                        .min(avail.len());
                    let piece = avail.get(..n).unwrap_or_default();
                    *left -= n as u64;
                    self.pos += n as u64;
                    match what {
                        MetaData::Skip => {}
                        MetaData::Exif(whole) => {
                            if let (_, Some(tag)) = whole.take(piece, exif_of_chunk) {
                                self.exif = Some(tag);
                            }
                        }
                        MetaData::Xmp(m) => m.feed(piece),
                    }
                    if *left == 0 {
                        self.data_done();
                    }
                }
            }
        }
    }

    /// A chunk's data is complete (a chunk cut by the end of the file never gets here).
    fn data_done(&mut self) {
        let MetaState::Data { next, what, .. } = &mut self.state else {
            return;
        };
        let next = *next;
        match std::mem::replace(what, MetaData::Skip) {
            MetaData::Exif(mut whole) => {
                // An empty chunk reports here; others reported as their last byte came in.
                if let (_, Some(tag)) = whole.take(&[], exif_of_chunk) {
                    self.exif = Some(tag);
                }
            }
            MetaData::Xmp(m) => self.xmp = Some(m.result()),
            MetaData::Skip => {}
        }
        self.state = if self.exif.is_some() && self.xmp.is_some() {
            MetaState::Done
        } else {
            MetaState::Header {
                at: next,
                buf: [0; 8],
                got: 0,
            }
        };
    }
}

/// Pillow's `Exif.load` strips any leading `Exif\0\0` (some writers add it to the chunk).
fn exif_of_chunk(mut d: &[u8]) -> Tag {
    while let Some(rest) = d.strip_prefix(b"Exif\0\0") {
        d = rest;
    }
    exif_orientation(d)
}
