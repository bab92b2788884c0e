//! PNG: `IHDR` through the `png` crate, orientation through a chunk walk over the stream.
//!
//! Size: `IHDR` width and height (the `png` crate validates the signature, the chunk length, the
//! CRC and the bit-depth/colour-type combination from the first 33 bytes). The chunk list must
//! reach `IEND` (lengths are followed, data is not read, CRCs are not checked), because Pillow
//! may take `eXIf` from after the image data. Orientation: the `eXIf` chunk (the last one before
//! the first `IDAT`; if there is none, the last one of the file), then the XMP text chunk
//! `XML:com.adobe.xmp` (`tEXt` or uncompressed `iTXt`, with the same before/after rule).

use super::exif::{Tag, Whole, XmpMatcher, combine, exif_orientation};
use super::{HeaderError, ImageFormat, fill, oriented};
use std::io::Cursor;

const F: ImageFormat = ImageFormat::Png;
/// Signature and `IHDR` chunk: all the `png` crate reads for the header.
const HEAD_LEN: usize = 33;
const XMP_KEY: &[u8; 18] = b"XML:com.adobe.xmp\0";

#[derive(Debug)]
pub(super) struct PngReader {
    head: [u8; HEAD_LEN],
    head_len: usize,
    /// The `IHDR` size, once [`HEAD_LEN`] bytes were seen.
    header: Option<Result<(u32, u32), HeaderError>>,
    walk: Walk,
    seen_idat: bool,
    /// Orientation metadata before the first `IDAT`, and in the whole file (last one wins).
    exif_before: Option<Tag>,
    exif_all: Option<Tag>,
    xmp_before: Option<Option<u32>>,
    xmp_all: Option<Option<u32>>,
}

#[derive(Debug)]
enum Walk {
    /// This many signature bytes still to skip.
    Signature(usize),
    /// A chunk's length and type.
    Header { bytes: [u8; 8], got: usize },
    /// A chunk's data, `left` bytes still to come.
    Data {
        kind: [u8; 4],
        left: u64,
        what: ChunkData,
    },
    /// This many CRC bytes still to skip.
    Crc(usize),
    /// `IEND` and its data seen: nothing after it matters.
    End,
}

#[derive(Debug)]
enum ChunkData {
    Skip,
    Exif(Whole),
    Text(Text),
}

/// A `tEXt` or `iTXt` chunk read as far as it takes to tell an XMP packet.
#[derive(Debug)]
enum Text {
    /// This many bytes of [`XMP_KEY`] matched.
    Key {
        itxt: bool,
        got: usize,
    },
    /// `iTXt`: compression flag, method, language tag, translated keyword.
    Flag,
    Method,
    Language,
    Keyword,
    Packet(XmpMatcher),
    NotXmp,
}

impl PngReader {
    pub(super) fn new() -> PngReader {
        PngReader {
            head: [0; HEAD_LEN],
            head_len: 0,
            header: None,
            walk: Walk::Signature(8),
            seen_idat: false,
            exif_before: None,
            exif_all: None,
            xmp_before: None,
            xmp_all: None,
        }
    }

    pub(super) fn feed(&mut self, mut input: &[u8]) {
        if self.head_len < HEAD_LEN {
            fill(&mut self.head, &mut self.head_len, input);
            if self.head_len == HEAD_LEN {
                self.header = Some(header(&self.head));
            }
        }
        if matches!(self.header, Some(Err(_))) {
            return;
        }
        while !input.is_empty() && !matches!(self.walk, Walk::End) {
            let used = self.step(input);
            if used == 0 {
                break;
            }
            input = input.get(used..).unwrap_or_default();
        }
    }

    fn step(&mut self, input: &[u8]) -> usize {
        match &mut self.walk {
            Walk::Signature(n) | Walk::Crc(n) => {
                let k = (*n).min(input.len());
                *n -= k;
                if *n == 0 {
                    self.walk = Walk::Header {
                        bytes: [0; 8],
                        got: 0,
                    };
                }
                k
            }
            Walk::Header { bytes, got } => {
                let used = fill(bytes, got, input);
                if *got == 8 {
                    let len = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
                    let kind = [bytes[4], bytes[5], bytes[6], bytes[7]];
                    let what = match &kind {
                        b"IDAT" => {
                            self.seen_idat = true;
                            ChunkData::Skip
                        }
                        b"eXIf" => ChunkData::Exif(Whole::new(u64::from(len))),
                        b"tEXt" => ChunkData::Text(Text::Key {
                            itxt: false,
                            got: 0,
                        }),
                        b"iTXt" => ChunkData::Text(Text::Key { itxt: true, got: 0 }),
                        _ => ChunkData::Skip,
                    };
                    self.walk = Walk::Data {
                        kind,
                        left: u64::from(len),
                        what,
                    };
                    if len == 0 {
                        self.end_data();
                    }
                }
                used
            }
            Walk::Data { left, what, .. } => {
                let n = usize::try_from(*left)
                    .unwrap_or(usize::MAX)
                    .min(input.len());
                let piece = input.get(..n).unwrap_or_default();
                *left -= n as u64;
                match what {
                    ChunkData::Skip => {}
                    ChunkData::Exif(whole) => {
                        if let (_, Some(tag)) = whole.take(piece, exif_orientation) {
                            self.exif_all = Some(tag);
                            if !self.seen_idat {
                                self.exif_before = Some(tag);
                            }
                        }
                    }
                    ChunkData::Text(text) => text.feed(piece),
                }
                if *left == 0 {
                    self.end_data();
                }
                n
            }
            Walk::End => input.len(),
        }
    }

    /// The last data byte of a chunk is in (or it had none).
    fn end_data(&mut self) {
        let Walk::Data { kind, what, .. } = &mut self.walk else {
            return;
        };
        let kind = *kind;
        match std::mem::replace(what, ChunkData::Skip) {
            ChunkData::Text(Text::Packet(m)) => {
                self.xmp_all = Some(m.result());
                if !self.seen_idat {
                    self.xmp_before = Some(m.result());
                }
            }
            // An empty eXIf chunk reports here (`Whole` reports non-empty ones as they end).
            ChunkData::Exif(mut whole) => {
                if let (_, Some(tag)) = whole.take(&[], exif_orientation) {
                    self.exif_all = Some(tag);
                    if !self.seen_idat {
                        self.exif_before = Some(tag);
                    }
                }
            }
            ChunkData::Text(_) | ChunkData::Skip => {}
        }
        self.walk = if &kind == b"IEND" {
            Walk::End
        } else {
            Walk::Crc(4)
        };
    }

    pub(super) fn finish(self) -> Result<(u32, u32), HeaderError> {
        let size = match self.header {
            Some(h) => h?,
            None => header(self.head.get(..self.head_len).unwrap_or_default())?,
        };
        if !matches!(self.walk, Walk::End) {
            // Pillow may look for eXIf after the image data, so a cut file could hide the
            // orientation (and vLLM fails to decode it anyway).
            return Err(HeaderError::Truncated(F));
        }
        // Pillow's PngImageFile.getexif() loads the rest of the file only when no eXIf came
        // before the image data; then both the late eXIf and the late text chunks count.
        let (exif, xmp) = if self.exif_before.is_some() {
            (self.exif_before, self.xmp_before)
        } else {
            (self.exif_all, self.xmp_all)
        };
        Ok(oriented(size, combine(exif, xmp)))
    }
}

/// `IHDR` through the `png` crate, from the file's first bytes (all of them when shorter).
fn header(head: &[u8]) -> Result<(u32, u32), HeaderError> {
    let mut decoder = ::png::Decoder::new(Cursor::new(head));
    match decoder.read_header_info() {
        Ok(info) => Ok((info.width, info.height)),
        Err(::png::DecodingError::IoError(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            Err(HeaderError::Truncated(F))
        }
        Err(e) => Err(HeaderError::Corrupt(F, e.to_string())),
    }
}

impl Text {
    fn feed(&mut self, piece: &[u8]) {
        let mut rest = piece;
        while let Some((&b, tail)) = rest.split_first() {
            match self {
                Text::Packet(m) => {
                    m.feed(rest);
                    return;
                }
                Text::NotXmp => return,
                Text::Key { itxt, got } => {
                    if XMP_KEY.get(*got) != Some(&b) {
                        *self = Text::NotXmp;
                    } else if *got + 1 == XMP_KEY.len() {
                        *self = if *itxt {
                            Text::Flag
                        } else {
                            Text::Packet(XmpMatcher::default())
                        };
                    } else {
                        *got += 1;
                    }
                }
                // A compressed packet is not inflated (module docs).
                Text::Flag => *self = if b == 0 { Text::Method } else { Text::NotXmp },
                Text::Method => *self = Text::Language,
                Text::Language => {
                    if b == 0 {
                        *self = Text::Keyword;
                    }
                }
                Text::Keyword => {
                    if b == 0 {
                        *self = Text::Packet(XmpMatcher::default());
                    }
                }
            }
            rest = tail;
        }
    }
}
