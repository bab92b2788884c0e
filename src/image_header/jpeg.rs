//! JPEG: Pillow's marker loop over the stream, up to and including the start-of-scan header.
//!
//! Size rules: the last SOFn segment before SOS (any of SOF0-3, 5-7, 9-11, 13-15 and DHP, as in
//! Pillow); width = bytes 3-4, height = bytes 1-2. Pillow refuses precisions other than 8 bit
//! and component counts other than 1, 3 or 4, and so do we (`Corrupt`). Every segment up to and
//! including the SOS header must be there; a cut before its end is `Truncated`. Orientation:
//! the first APP1 `Exif\0\0` segment, else the last APP1 XMP packet.
//!
//! Between segments, fill bytes (`FF FF`), stray `FF 00` and non-`FF` junk are skipped,
//! standalone markers (RSTn, TEM, SOI) carry no length, and an unknown marker is an error.
//! Segments are skipped by length; a segment that arrives inside one piece is read in place.

use super::exif::{Tag, Whole, XmpMatcher, combine, exif_orientation};
use super::{HeaderError, ImageFormat, be16, fill, oriented};

const F: ImageFormat = ImageFormat::Jpeg;
const EXIF_PREFIX: &[u8] = b"Exif\0\0";
const XMP_PREFIX: &[u8; 29] = b"http://ns.adobe.com/xap/1.0/\0";

#[derive(Debug)]
pub(super) struct JpegReader {
    state: State,
    size: Option<(u32, u32)>,
    /// The orientation tag of the first Exif segment.
    exif: Option<Tag>,
    /// The search result of the last XMP segment.
    xmp: Option<Option<u32>>,
}

#[derive(Debug)]
enum State {
    /// This many bytes of the SOI marker still to skip.
    Soi(usize),
    /// Between segments, before an `FF`.
    Scan,
    /// After an `FF`.
    Marker,
    /// The big-endian length of segment `marker`.
    Length {
        marker: u8,
        bytes: [u8; 2],
        got: usize,
    },
    /// The `len` payload bytes of segment `marker`, `left` of them still to come.
    Payload {
        marker: u8,
        len: usize,
        left: usize,
        kind: Payload,
    },
    /// The SOS header, `left` bytes still to come.
    ScanHeader {
        left: usize,
    },
    Done(Result<(u32, u32), HeaderError>),
}

/// What is kept of a segment that arrives in pieces.
#[derive(Debug)]
enum Payload {
    Skip,
    Sof {
        bytes: [u8; 6],
        got: usize,
    },
    /// An APP1 segment before its first bytes tell Exif, XMP or neither.
    App1 {
        prefix: [u8; 29],
        got: usize,
    },
    Exif(Whole),
    Xmp(XmpMatcher),
}

fn corrupt(why: String) -> HeaderError {
    HeaderError::Corrupt(F, why)
}

impl JpegReader {
    pub(super) fn new() -> JpegReader {
        JpegReader {
            state: State::Soi(2),
            size: None,
            exif: None,
            xmp: None,
        }
    }

    pub(super) fn feed(&mut self, mut input: &[u8]) {
        while !input.is_empty() {
            let used = self.step(input);
            if used == 0 {
                break;
            }
            input = input.get(used..).unwrap_or_default();
        }
    }

    /// Consumes a prefix of `input` (at least one byte unless done); returns its length.
    fn step(&mut self, input: &[u8]) -> usize {
        match &mut self.state {
            State::Soi(n) => {
                let k = (*n).min(input.len());
                *n -= k;
                if *n == 0 {
                    self.state = State::Scan;
                }
                k
            }
            State::Scan => match memchr::memchr(0xFF, input) {
                Some(i) => {
                    self.state = State::Marker;
                    i + 1
                }
                None => input.len(),
            },
            State::Marker => {
                let Some(&m) = input.first() else { return 0 };
                self.state = match m {
                    // FF FF: the second FF may start the marker.
                    0xFF => State::Marker,
                    // stuffed FF 00; standalone markers: TEM, RSTn, SOI, EOI's cousins
                    0x00 | 0x01 | 0xC8 | 0xD0..=0xD8 => State::Scan,
                    0xD9 => State::Done(Err(corrupt("end of image before start of scan".into()))),
                    0xC0..=0xC7 | 0xC9..=0xCF | 0xDA..=0xDF | 0xE0..=0xEF | 0xFE => State::Length {
                        marker: m,
                        bytes: [0; 2],
                        got: 0,
                    },
                    m => State::Done(Err(corrupt(format!("unknown marker 0xFF{m:02X}")))),
                };
                1
            }
            State::Length { marker, bytes, got } => {
                let used = fill(bytes, got, input);
                if *got == 2 {
                    let marker = *marker;
                    let len = usize::from(u16::from_be_bytes(*bytes));
                    self.state = if len < 2 {
                        State::Done(Err(corrupt(format!(
                            "segment 0xFF{marker:02X} with length {len}"
                        ))))
                    } else if marker == 0xDA {
                        State::ScanHeader { left: len - 2 }
                    } else {
                        State::Payload {
                            marker,
                            len: len - 2,
                            left: len - 2,
                            kind: Payload::new(marker),
                        }
                    };
                    self.after_header();
                }
                used
            }
            State::Payload {
                marker,
                len,
                left,
                kind,
            } => {
                let marker = *marker;
                if *left == *len && input.len() >= *len {
                    // The whole segment in this piece: read it in place.
                    let len = *len;
                    let result = self.segment(marker, input.get(..len).unwrap_or_default());
                    self.state = next_state(result);
                    return len;
                }
                let n = (*left).min(input.len());
                let piece = input.get(..n).unwrap_or_default();
                *left -= n;
                let len = *len;
                match kind {
                    Payload::Skip => {}
                    Payload::Sof { bytes, got } => {
                        fill(bytes, got, piece);
                    }
                    Payload::App1 { prefix, got } => {
                        let taken = fill(prefix, got, piece);
                        if *got == prefix.len() {
                            // Decided: the rest of this piece goes to what it turned out to be.
                            let mut next = if prefix.starts_with(EXIF_PREFIX) {
                                if self.exif.is_none() {
                                    let mut whole = Whole::new((len - EXIF_PREFIX.len()) as u64);
                                    let (_, done) = whole.take(
                                        prefix.get(EXIF_PREFIX.len()..).unwrap_or_default(),
                                        exif_orientation,
                                    );
                                    match done {
                                        Some(tag) => {
                                            self.exif = Some(tag);
                                            Payload::Skip
                                        }
                                        None => Payload::Exif(whole),
                                    }
                                } else {
                                    Payload::Skip
                                }
                            } else if prefix == XMP_PREFIX {
                                Payload::Xmp(XmpMatcher::default())
                            } else {
                                Payload::Skip
                            };
                            next.more(piece.get(taken..).unwrap_or_default(), &mut self.exif);
                            *kind = next;
                        }
                    }
                    more => more.more(piece, &mut self.exif),
                }
                if *left == 0 {
                    let result = self.end_segment(marker);
                    self.state = next_state(result);
                }
                n
            }
            State::ScanHeader { left } => {
                let n = (*left).min(input.len());
                *left -= n;
                if *left == 0 {
                    self.state = State::Done(self.result());
                }
                n
            }
            State::Done(_) => input.len(),
        }
    }

    /// An empty segment payload or SOS header ends as soon as its length is read.
    fn after_header(&mut self) {
        match &self.state {
            State::ScanHeader { left: 0 } => self.state = State::Done(self.result()),
            State::Payload {
                marker, left: 0, ..
            } => {
                let marker = *marker;
                let result = self.segment(marker, &[]);
                self.state = next_state(result);
            }
            _ => {}
        }
    }

    /// A segment that arrived in pieces has ended.
    fn end_segment(&mut self, marker: u8) -> Result<(), HeaderError> {
        let State::Payload { kind, .. } = &mut self.state else {
            return Ok(());
        };
        match std::mem::replace(kind, Payload::Skip) {
            Payload::Sof { bytes, got } => {
                self.segment(marker, bytes.get(..got).unwrap_or_default())
            }
            // Shorter than the XMP prefix: all of it is here.
            Payload::App1 { prefix, got } => {
                self.segment(marker, prefix.get(..got).unwrap_or_default())
            }
            Payload::Xmp(m) => {
                self.xmp = Some(m.result());
                Ok(())
            }
            // Exif segments report through `more`; skipped ones need nothing.
            Payload::Exif(_) | Payload::Skip => Ok(()),
        }
    }

    /// A whole segment: SOFn gives the size, APP1 the orientation metadata.
    fn segment(&mut self, marker: u8, seg: &[u8]) -> Result<(), HeaderError> {
        match marker {
            // SOFn (not DHT C4, not DAC CC) and DHP
            0xC0..=0xC3 | 0xC5..=0xC7 | 0xC9..=0xCB | 0xCD..=0xCF | 0xDE => {
                let (Some(&bits), Some(h), Some(w), Some(&layers)) =
                    (seg.first(), be16(seg, 1), be16(seg, 3), seg.get(5))
                else {
                    return Err(corrupt(format!("SOF segment of {} bytes", seg.len())));
                };
                if bits != 8 {
                    return Err(corrupt(format!(
                        "{bits}-bit samples (only 8-bit is decoded)"
                    )));
                }
                if !matches!(layers, 1 | 3 | 4) {
                    return Err(corrupt(format!("{layers} components")));
                }
                self.size = Some((u32::from(w), u32::from(h)));
            }
            0xE1 => {
                if let Some(tiff) = seg.strip_prefix(EXIF_PREFIX) {
                    // Pillow keeps the first Exif segment as the TIFF structure.
                    if self.exif.is_none() {
                        let end = tiff.len().min(super::EXIF_CAP);
                        self.exif = Some(exif_orientation(tiff.get(..end).unwrap_or_default()));
                    }
                } else if let Some(x) = seg.strip_prefix(XMP_PREFIX.as_slice()) {
                    let mut m = XmpMatcher::default();
                    m.feed(x);
                    self.xmp = Some(m.result()); // last one wins, as in Pillow
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn result(&self) -> Result<(u32, u32), HeaderError> {
        let size = self
            .size
            .ok_or_else(|| corrupt("start of scan before any SOF segment".into()))?;
        Ok(oriented(size, combine(self.exif, self.xmp)))
    }

    pub(super) fn finish(self) -> Result<(u32, u32), HeaderError> {
        match self.state {
            State::Done(result) => result,
            _ => Err(HeaderError::Truncated(F)),
        }
    }
}

/// Where the walk goes after a segment: on, or nowhere when it was corrupt.
fn next_state(result: Result<(), HeaderError>) -> State {
    match result {
        Ok(()) => State::Scan,
        Err(e) => State::Done(Err(e)),
    }
}

impl Payload {
    fn new(marker: u8) -> Payload {
        match marker {
            0xC0..=0xC3 | 0xC5..=0xC7 | 0xC9..=0xCB | 0xCD..=0xCF | 0xDE => Payload::Sof {
                bytes: [0; 6],
                got: 0,
            },
            0xE1 => Payload::App1 {
                prefix: [0; 29],
                got: 0,
            },
            _ => Payload::Skip,
        }
    }

    /// More bytes of an Exif or XMP segment (after its prefix).
    fn more(&mut self, piece: &[u8], exif: &mut Option<Tag>) {
        match self {
            Payload::Exif(whole) => {
                if let (_, Some(tag)) = whole.take(piece, exif_orientation) {
                    *exif = Some(tag);
                }
            }
            Payload::Xmp(m) => m.feed(piece),
            Payload::Skip | Payload::Sof { .. } | Payload::App1 { .. } => {}
        }
    }
}
