//! The slice-based image header reader as it was before the incremental reader replaced it
//! (`src/image_header.rs` at the commit before the scanner branch), kept unchanged as the oracle
//! of the differential tests (`tests/header_stream.rs`). Read its module docs in git history;
//! the rules it implements are documented in `src/image_header/mod.rs`.

#![allow(dead_code)]

use mmrouter::image_header::{HeaderError, ImageFormat, ImageInfo};
use std::io::{self, Cursor};

const PNG_SIGNATURE: &[u8; 8] = b"\x89PNG\r\n\x1a\n";

/// Reads format, width and height from the start of an image file.
///
/// The size is the one vLLM's image processor sees: EXIF/XMP orientations 5..=8 swap width and
/// height (see the module docs for the source). Never panics; allocates nothing proportional to
/// the image.
pub fn read_image_header(bytes: &[u8]) -> Result<ImageInfo, HeaderError> {
    let (format, width, height) = match sniff(bytes)? {
        ImageFormat::Png => png_size(bytes)?,
        ImageFormat::Jpeg => jpeg_size(bytes)?,
        ImageFormat::Webp => webp_size(bytes)?,
        ImageFormat::Gif => gif_size(bytes)?,
    };
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

fn is_eof(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::UnexpectedEof
}

fn be16(b: &[u8], at: usize) -> Option<u16> {
    let s = b.get(at..at.checked_add(2)?)?;
    Some(u16::from_be_bytes([*s.first()?, *s.get(1)?]))
}

fn be32(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at.checked_add(4)?)?;
    Some(u32::from_be_bytes(s.try_into().ok()?))
}

fn le32(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes(s.try_into().ok()?))
}

/// Applies an EXIF orientation: 5..=8 swap the axes, everything else keeps them.
fn oriented(
    format: ImageFormat,
    w: u32,
    h: u32,
    orientation: Option<u32>,
) -> (ImageFormat, u32, u32) {
    match orientation {
        Some(5..=8) => (format, h, w),
        _ => (format, w, h),
    }
}

// ---------------------------------------------------------------- PNG

fn png_size(bytes: &[u8]) -> Result<(ImageFormat, u32, u32), HeaderError> {
    const F: ImageFormat = ImageFormat::Png;
    let mut decoder = png::Decoder::new(Cursor::new(bytes));
    let (w, h) = match decoder.read_header_info() {
        Ok(info) => (info.width, info.height),
        Err(png::DecodingError::IoError(e)) if is_eof(&e) => return Err(HeaderError::Truncated(F)),
        Err(e) => return Err(HeaderError::Corrupt(F, e.to_string())),
    };
    let orientation = png_orientation(bytes).ok_or(HeaderError::Truncated(F))?;
    Ok(oriented(F, w, h, orientation))
}

/// Walks the PNG chunks (lengths only, no CRC, no inflate) for Pillow's orientation sources.
/// `None` when the chunk list ends before `IEND`: Pillow may look for `eXIf` after the image
/// data, so a cut file could hide the orientation (and vLLM fails to decode it anyway).
fn png_orientation(b: &[u8]) -> Option<Option<u32>> {
    // (eXIf payload, XMP text) seen before the first IDAT, and in the whole file.
    let mut exif_before: Option<&[u8]> = None;
    let mut xmp_before: Option<&[u8]> = None;
    let mut exif_all: Option<&[u8]> = None;
    let mut xmp_all: Option<&[u8]> = None;
    let mut seen_idat = false;
    let mut at = PNG_SIGNATURE.len();
    loop {
        let (Some(len), Some(kind)) = (be32(b, at), b.get(at + 4..at + 8)) else {
            return None;
        };
        let start = at + 8;
        let data = start
            .checked_add(len as usize)
            .and_then(|end| b.get(start..end))?;
        match kind {
            b"IDAT" => seen_idat = true,
            b"IEND" => break,
            b"eXIf" => {
                exif_all = Some(data);
                if !seen_idat {
                    exif_before = Some(data);
                }
            }
            b"tEXt" | b"iTXt" => {
                if let Some(xmp) = png_xmp_text(kind, data) {
                    xmp_all = Some(xmp);
                    if !seen_idat {
                        xmp_before = Some(xmp);
                    }
                }
            }
            _ => {}
        }
        at = start + len as usize + 4;
    }
    // Pillow's PngImageFile.getexif() loads the rest of the file only when no eXIf came before
    // the image data; then both the late eXIf and the late text chunks count.
    let (exif, xmp) = if exif_before.is_some() {
        (exif_before, xmp_before)
    } else {
        (exif_all, xmp_all)
    };
    Some(exif_or_xmp_orientation(exif, xmp))
}

/// The text of a `tEXt` or uncompressed `iTXt` chunk keyed `XML:com.adobe.xmp`.
fn png_xmp_text<'a>(kind: &[u8], data: &'a [u8]) -> Option<&'a [u8]> {
    const KEY: &[u8] = b"XML:com.adobe.xmp\0";
    let rest = data.strip_prefix(KEY)?;
    if kind == b"tEXt" {
        return Some(rest);
    }
    // iTXt: compression flag, method, language\0, translated keyword\0, text.
    let (&flag, rest) = rest.split_first()?;
    if flag != 0 {
        return None; // compressed: not inflated (module docs)
    }
    let rest = rest.get(1..)?;
    let lang_end = rest.iter().position(|&c| c == 0)?;
    let rest = rest.get(lang_end + 1..)?;
    let tk_end = rest.iter().position(|&c| c == 0)?;
    rest.get(tk_end + 1..)
}

// ---------------------------------------------------------------- JPEG

fn jpeg_size(b: &[u8]) -> Result<(ImageFormat, u32, u32), HeaderError> {
    const F: ImageFormat = ImageFormat::Jpeg;
    let truncated = || HeaderError::Truncated(F);
    let corrupt = |why: String| HeaderError::Corrupt(F, why);
    let mut size: Option<(u32, u32)> = None;
    let mut exif: Option<&[u8]> = None;
    let mut xmp: Option<&[u8]> = None;
    let mut at = 2; // after SOI
    loop {
        // Pillow: skip non-FF junk; FF FF is padding; FF 00 is skipped; then a marker.
        let Some(&byte) = b.get(at) else {
            return Err(truncated());
        };
        if byte != 0xFF {
            at += 1;
            continue;
        }
        let Some(&marker) = b.get(at + 1) else {
            return Err(truncated());
        };
        match marker {
            0xFF => {
                at += 1;
                continue;
            }
            0x00 => {
                at += 2;
                continue;
            }
            // standalone markers: TEM, RSTn, SOI, EOI, JPG (Pillow has no handler for these)
            0x01 | 0xC8 | 0xD0..=0xD8 => {
                at += 2;
                continue;
            }
            0xD9 => return Err(corrupt("end of image before start of scan".into())),
            0xC0..=0xC7 | 0xC9..=0xCF | 0xDA..=0xDF | 0xE0..=0xEF | 0xFE => {}
            m => return Err(corrupt(format!("unknown marker 0xFF{m:02X}"))),
        }
        let len = be16(b, at + 2).ok_or_else(truncated)? as usize;
        if len < 2 {
            return Err(corrupt(format!(
                "segment 0xFF{marker:02X} with length {len}"
            )));
        }
        let start = at + 4;
        let end = at + 2 + len;
        if marker == 0xDA {
            // SOS: the header is complete; its length must be inside the file too.
            if end > b.len() {
                return Err(truncated());
            }
            break;
        }
        let seg = b.get(start..end).ok_or_else(truncated)?;
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
                size = Some((u32::from(w), u32::from(h)));
            }
            0xE1 => {
                if let Some(tiff) = seg.strip_prefix(b"Exif\0\0") {
                    // Pillow keeps the first Exif segment as the TIFF structure.
                    if exif.is_none() {
                        exif = Some(tiff);
                    }
                } else if let Some(x) = seg.strip_prefix(b"http://ns.adobe.com/xap/1.0/\0") {
                    xmp = Some(x); // last one wins, as in Pillow
                }
            }
            _ => {}
        }
        at = end;
    }
    let (w, h) = size.ok_or_else(|| corrupt("start of scan before any SOF segment".into()))?;
    Ok(oriented(F, w, h, exif_or_xmp_orientation(exif, xmp)))
}

// ---------------------------------------------------------------- WebP

fn webp_size(bytes: &[u8]) -> Result<(ImageFormat, u32, u32), HeaderError> {
    const F: ImageFormat = ImageFormat::Webp;
    // The RIFF size says how long the file should be; an error on a shorter input is truncation.
    let short = le32(bytes, 4).is_none_or(|riff| (bytes.len() as u64) < u64::from(riff) + 8);
    // A cut file is an error even when the frame header survived: the EXIF chunk that may
    // rotate the size usually comes last, and vLLM cannot decode the file anyway.
    if short {
        return Err(HeaderError::Truncated(F));
    }
    let (w, h) = match image_webp::WebPDecoder::new(Cursor::new(bytes)) {
        Ok(d) => d.dimensions(),
        Err(image_webp::DecodingError::IoError(e)) if is_eof(&e) => {
            return Err(HeaderError::Truncated(F));
        }
        Err(e) => return Err(HeaderError::Corrupt(F, e.to_string())),
    };
    Ok(oriented(F, w, h, webp_orientation(bytes)))
}

/// First `EXIF` and first `XMP ` chunk of an extended (VP8X) file, as libwebp's demuxer (which
/// Pillow uses) returns them.
fn webp_orientation(b: &[u8]) -> Option<u32> {
    if b.get(12..16)? != b"VP8X" {
        return None;
    }
    let mut exif = None;
    let mut xmp = None;
    let mut at = 12usize;
    while let (Some(kind), Some(len)) = (b.get(at..at + 4), le32(b, at + 4)) {
        let start = at + 8;
        let len = len as usize;
        let Some(data) = start.checked_add(len).and_then(|end| b.get(start..end)) else {
            break;
        };
        match kind {
            b"EXIF" if exif.is_none() => exif = Some(data),
            b"XMP " if xmp.is_none() => xmp = Some(data),
            _ => {}
        }
        at = start + len + (len & 1);
    }
    // Pillow's Exif.load strips any leading "Exif\0\0" (some writers add it to the chunk).
    let exif = exif.map(strip_exif_prefix);
    exif_or_xmp_orientation(exif, xmp)
}

fn strip_exif_prefix(mut d: &[u8]) -> &[u8] {
    while let Some(rest) = d.strip_prefix(b"Exif\0\0") {
        d = rest;
    }
    d
}

// ---------------------------------------------------------------- GIF

fn gif_size(bytes: &[u8]) -> Result<(ImageFormat, u32, u32), HeaderError> {
    const F: ImageFormat = ImageFormat::Gif;
    let map = |e: gif::DecodingError| match e {
        gif::DecodingError::UnexpectedEof => HeaderError::Truncated(F),
        gif::DecodingError::Io(e) if is_eof(&e) => HeaderError::Truncated(F),
        e => HeaderError::Corrupt(F, e.to_string()),
    };
    let mut options = gif::DecodeOptions::new();
    // Header reading allocates at most palettes and app extensions; keep any stray metadata
    // small (the default limit is 50 MB).
    options.set_memory_limit(gif::MemoryLimit::Bytes(
        std::num::NonZeroU64::MIN.saturating_add(1 << 20),
    ));
    let mut decoder = options.read_info(Cursor::new(bytes)).map_err(map)?;
    let (screen_w, screen_h) = (u32::from(decoder.width()), u32::from(decoder.height()));
    // Pillow grows the size to contain the first frame (GifImageFile._seek(0)).
    let frame = decoder.next_frame_info().map_err(map)?;
    let Some(frame) = frame else {
        return Err(HeaderError::Corrupt(F, "no image in file".into()));
    };
    let right = u32::from(frame.left) + u32::from(frame.width);
    let bottom = u32::from(frame.top) + u32::from(frame.height);
    Ok((F, screen_w.max(right), screen_h.max(bottom)))
}

// ---------------------------------------------------------------- EXIF / XMP

/// Pillow's `getexif()` orientation: the EXIF IFD0 tag 0x0112 if present, else the XMP
/// `tiff:Orientation` (only when IFD0 has no 0x0112 entry at all).
fn exif_or_xmp_orientation(exif: Option<&[u8]>, xmp: Option<&[u8]>) -> Option<u32> {
    match exif.map(exif_orientation) {
        Some(Tag::Value(v)) => Some(v),
        Some(Tag::PresentUnusable) => None,
        Some(Tag::Absent) | None => xmp.and_then(xmp_orientation),
    }
}

enum Tag {
    Absent,
    /// The tag exists but its value is not an integer Pillow would map to a transpose.
    PresentUnusable,
    Value(u32),
}

/// Reads IFD0 tag 0x0112 from a TIFF structure (an EXIF payload without the `Exif\0\0`
/// prefix). Bounded by the slice; malformed data yields `Absent` or what was read so far.
fn exif_orientation(tiff: &[u8]) -> Tag {
    let little = match tiff.get(0..2) {
        Some(b"II") => true,
        Some(b"MM") => false,
        _ => return Tag::Absent,
    };
    let u16_at = |at: usize| -> Option<u16> {
        let s = tiff.get(at..at.checked_add(2)?)?;
        let a = [*s.first()?, *s.get(1)?];
        Some(if little {
            u16::from_le_bytes(a)
        } else {
            u16::from_be_bytes(a)
        })
    };
    let u32_at = |at: usize| -> Option<u32> {
        let a: [u8; 4] = tiff.get(at..at.checked_add(4)?)?.try_into().ok()?;
        Some(if little {
            u32::from_le_bytes(a)
        } else {
            u32::from_be_bytes(a)
        })
    };
    // Pillow accepts 42 in either byte order after II/MM; BigTIFF (43) is not handled here.
    if !matches!(u16_at(2), Some(42) | Some(0x2A00)) {
        return Tag::Absent;
    }
    let Some(ifd) = u32_at(4).map(|o| o as usize) else {
        return Tag::Absent;
    };
    let Some(count) = u16_at(ifd) else {
        return Tag::Absent;
    };
    let mut found = Tag::Absent;
    for i in 0..usize::from(count) {
        let entry = ifd + 2 + i * 12;
        let (Some(tag), Some(typ), Some(n)) = (u16_at(entry), u16_at(entry + 2), u32_at(entry + 4))
        else {
            break; // truncated IFD: Pillow keeps the entries read so far
        };
        if tag != 0x0112 {
            continue;
        }
        // (unit size, kind) per TIFF type; unknown types are skipped by Pillow.
        let unit: usize = match typ {
            1 | 2 | 6 | 7 => 1,
            3 | 8 => 2,
            4 | 9 | 11 | 13 => 4,
            5 | 10 | 12 | 16 => 8,
            _ => continue,
        };
        let Some(size) = (n as usize).checked_mul(unit) else {
            continue;
        };
        let value_at = if size > 4 {
            match u32_at(entry + 8) {
                Some(o) => o as usize,
                None => continue,
            }
        } else {
            entry + 8
        };
        if size == 0
            || value_at
                .checked_add(size)
                .is_none_or(|end| end > tiff.len())
        {
            continue; // Pillow: "Possibly corrupt EXIF data", entry skipped
        }
        // Pillow's Orientation tag is declared single-valued: a multi-valued entry still
        // yields its first value.
        let v: Option<f64> = match typ {
            1 | 7 => tiff.get(value_at).map(|&x| f64::from(x)),
            6 => tiff.get(value_at).map(|&x| f64::from(x as i8)),
            3 => u16_at(value_at).map(f64::from),
            8 => u16_at(value_at).map(|x| f64::from(x as i16)),
            4 | 13 => u32_at(value_at).map(f64::from),
            9 => u32_at(value_at).map(|x| f64::from(x as i32)),
            5 | 10 => {
                let (num, den) = (u32_at(value_at), u32_at(value_at + 4));
                match (num, den) {
                    (Some(num), Some(den)) if den != 0 => {
                        if typ == 5 {
                            Some(f64::from(num) / f64::from(den))
                        } else {
                            Some(f64::from(num as i32) / f64::from(den as i32))
                        }
                    }
                    _ => None,
                }
            }
            11 => u32_at(value_at).map(|x| f64::from(f32::from_bits(x))),
            12 | 16 => {
                let hi = u32_at(value_at);
                let lo = u32_at(value_at + 4);
                match (hi, lo) {
                    (Some(a), Some(b)) => {
                        let bits = if little {
                            (u64::from(b) << 32) | u64::from(a)
                        } else {
                            (u64::from(a) << 32) | u64::from(b)
                        };
                        Some(if typ == 12 {
                            f64::from_bits(bits)
                        } else {
                            bits as f64
                        })
                    }
                    _ => None,
                }
            }
            _ => None, // ASCII: a string never matches Pillow's integer keys
        };
        // Duplicate entries: the last one wins (Pillow stores them in a dict).
        found = match v {
            Some(x) if x.fract() == 0.0 && (1.0..=8.0).contains(&x) => Tag::Value(x as u32),
            _ => Tag::PresentUnusable,
        };
    }
    found
}

/// Pillow's XMP fallback: the first match of `tiff:Orientation(="|>)([0-9])`.
fn xmp_orientation(xmp: &[u8]) -> Option<u32> {
    const NEEDLE: &[u8] = b"tiff:Orientation";
    let mut from = 0;
    while let Some(rest) = xmp.get(from..) {
        let pos = rest.windows(NEEDLE.len()).position(|w| w == NEEDLE)?;
        let after = from + pos + NEEDLE.len();
        let digit = match (xmp.get(after), xmp.get(after + 1), xmp.get(after + 2)) {
            (Some(b'='), Some(b'"'), Some(d)) if d.is_ascii_digit() => Some(*d),
            (Some(b'>'), Some(d), _) if d.is_ascii_digit() => Some(*d),
            _ => None,
        };
        if let Some(d) = digit {
            return Some(u32::from(d - b'0'));
        }
        from = after;
    }
    None
}
