//! Orientation metadata: the EXIF orientation tag (IFD0 0x0112) of a TIFF structure, the XMP
//! `tiff:Orientation` fallback searched as the packet streams by, and Pillow's rule for which
//! of the two wins.

use super::EXIF_CAP;

/// What IFD0 says about the orientation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Tag {
    Absent,
    /// The tag exists but its value is not an integer Pillow would map to a transpose.
    PresentUnusable,
    Value(u32),
}

/// Pillow's `getexif()` orientation: the EXIF IFD0 tag 0x0112 if present, else the XMP
/// `tiff:Orientation` (only when IFD0 has no 0x0112 entry at all). `xmp` is the search result of
/// the XMP packet that counts (`None` when there is no packet).
pub(super) fn combine(exif: Option<Tag>, xmp: Option<Option<u32>>) -> Option<u32> {
    match exif {
        Some(Tag::Value(v)) => Some(v),
        Some(Tag::PresentUnusable) => None,
        Some(Tag::Absent) | None => xmp.flatten(),
    }
}

/// Reads IFD0 tag 0x0112 from a TIFF structure (an EXIF payload without the `Exif\0\0`
/// prefix). Bounded by the slice; malformed data yields `Absent` or what was read so far.
pub(super) fn exif_orientation(tiff: &[u8]) -> Tag {
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

/// A payload of known length that is needed whole (an EXIF TIFF structure), received in pieces.
/// A payload that arrives inside one piece is read in place; otherwise its first [`EXIF_CAP`]
/// bytes are copied (the rest is counted, not kept). Either way the reader sees the same first
/// `min(length, EXIF_CAP)` bytes.
#[derive(Debug, Default)]
pub(super) struct Whole {
    remaining: u64,
    /// The payload's first bytes, when it spans pieces.
    kept: Vec<u8>,
    started: bool,
    /// The payload was handed to `done`.
    finished: bool,
}

impl Whole {
    pub(super) fn new(length: u64) -> Whole {
        Whole {
            remaining: length,
            kept: Vec::new(),
            started: false,
            finished: false,
        }
    }

    /// Takes bytes of the payload from `input`; returns how many were taken and, once the last
    /// byte is in, the payload's first `min(length, EXIF_CAP)` bytes to `done`.
    pub(super) fn take<R>(
        &mut self,
        input: &[u8],
        done: impl FnOnce(&[u8]) -> R,
    ) -> (usize, Option<R>) {
        if self.finished {
            return (0, None);
        }
        let n = usize::try_from(self.remaining)
            .unwrap_or(usize::MAX)
            .min(input.len());
        let piece = input.get(..n).unwrap_or_default();
        let first = !self.started;
        self.started = true;
        self.remaining -= n as u64;
        if first && self.remaining == 0 {
            // The whole payload in this piece: read it in place.
            self.finished = true;
            let end = piece.len().min(EXIF_CAP);
            return (n, Some(done(piece.get(..end).unwrap_or_default())));
        }
        if self.kept.capacity() == 0 {
            // One allocation of what will be kept.
            let total = self.remaining + n as u64;
            self.kept
                .reserve_exact(usize::try_from(total).unwrap_or(EXIF_CAP).min(EXIF_CAP));
        }
        let room = EXIF_CAP.saturating_sub(self.kept.len());
        self.kept
            .extend_from_slice(piece.get(..room.min(piece.len())).unwrap_or_default());
        if self.remaining == 0 {
            self.finished = true;
            let kept = std::mem::take(&mut self.kept);
            return (n, Some(done(&kept)));
        }
        (n, None)
    }
}

const NEEDLE: &[u8; 16] = b"tiff:Orientation";

/// Pillow's XMP fallback, `tiff:Orientation(="|>)([0-9])` (first match), searched over a
/// packet that arrives in pieces. Keeps only how much of the pattern it has seen.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct XmpMatcher {
    phase: Phase,
    found: Option<u32>,
}

#[derive(Debug, Clone, Copy, Default)]
enum Phase {
    #[default]
    Start,
    /// This many bytes of [`NEEDLE`] matched.
    Needle(u8),
    /// The needle, then `=`, then `"`, or `>`: a digit completes the match.
    Equals,
    Quote,
    Digit,
}

impl XmpMatcher {
    pub(super) fn feed(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if self.found.is_some() {
                return;
            }
            self.step(b);
        }
    }

    fn step(&mut self, b: u8) {
        self.phase = match self.phase {
            Phase::Start => Self::needle_from(0, b),
            Phase::Needle(k) => Self::needle_from(k, b),
            Phase::Equals => match b {
                b'=' => Phase::Quote,
                b'>' => Phase::Digit,
                // No border in the needle: a failed tail restarts the search at this byte.
                _ => Self::needle_from(0, b),
            },
            Phase::Quote if b == b'"' => Phase::Digit,
            Phase::Digit if b.is_ascii_digit() => {
                self.found = Some(u32::from(b - b'0'));
                Phase::Start
            }
            Phase::Quote | Phase::Digit => Self::needle_from(0, b),
        };
    }

    /// The phase after `b` when `k` bytes of the needle matched before it.
    fn needle_from(k: u8, b: u8) -> Phase {
        if NEEDLE.get(usize::from(k)) == Some(&b) {
            if usize::from(k) + 1 == NEEDLE.len() {
                Phase::Equals
            } else {
                Phase::Needle(k + 1)
            }
        } else if k > 0 && NEEDLE.first() == Some(&b) {
            Phase::Needle(1)
        } else {
            Phase::Start
        }
    }

    /// The orientation digit of the first match, if any.
    pub(super) fn result(&self) -> Option<u32> {
        self.found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiff_with_orientation(little: bool, typ: u16, count: u32, value: [u8; 4]) -> Vec<u8> {
        let mut t = Vec::new();
        let p16 = |t: &mut Vec<u8>, v: u16| {
            t.extend(if little {
                v.to_le_bytes()
            } else {
                v.to_be_bytes()
            })
        };
        let p32 = |t: &mut Vec<u8>, v: u32| {
            t.extend(if little {
                v.to_le_bytes()
            } else {
                v.to_be_bytes()
            })
        };
        t.extend(if little { b"II" } else { b"MM" });
        p16(&mut t, 42);
        p32(&mut t, 8);
        p16(&mut t, 1);
        p16(&mut t, 0x0112);
        p16(&mut t, typ);
        p32(&mut t, count);
        t.extend(value);
        p32(&mut t, 0);
        t
    }

    fn xmp(text: &[u8]) -> Option<u32> {
        let mut m = XmpMatcher::default();
        m.feed(text);
        m.result()
    }

    #[test]
    fn exif_short_orientation_read_in_both_byte_orders() {
        let le = tiff_with_orientation(true, 3, 1, [6, 0, 0, 0]);
        let be = tiff_with_orientation(false, 3, 1, [0, 8, 0, 0]);
        assert_eq!(exif_orientation(&le), Tag::Value(6));
        assert_eq!(exif_orientation(&be), Tag::Value(8));
    }

    #[test]
    fn exif_ascii_orientation_blocks_the_xmp_fallback() {
        let t = tiff_with_orientation(true, 2, 2, *b"6\0\0\0");
        assert_eq!(exif_orientation(&t), Tag::PresentUnusable);
        let packet = xmp(br#"<x tiff:Orientation="6"/>"#);
        assert_eq!(packet, Some(6));
        assert_eq!(combine(Some(exif_orientation(&t)), Some(packet)), None);
        assert_eq!(
            combine(Some(exif_orientation(b"II*\0junk")), Some(packet)),
            Some(6)
        );
    }

    #[test]
    fn xmp_orientation_accepts_attribute_and_element_forms() {
        assert_eq!(xmp(br#"a tiff:Orientation="5" b"#), Some(5));
        assert_eq!(xmp(b"<tiff:Orientation>7</tiff:Orientation>"), Some(7));
        assert_eq!(xmp(b"tiff:Orientation tiff:Orientation=\"3\""), Some(3));
        assert_eq!(xmp(b"tiff:Orientation=\"x\""), None);
        assert_eq!(xmp(b"tiff:Orientation=tiff:Orientation>4"), Some(4));
        assert_eq!(xmp(b"ttiff:Orientation>2"), Some(2));
        assert_eq!(xmp(b"tiff:Orientation=\"tiff:Orientation=\"1\""), Some(1));
    }

    #[test]
    fn xmp_search_does_not_depend_on_where_the_packet_is_cut() {
        let packet = br#"<rdf tiff:Orientatio tiff:Orientation= "2" tiff:Orientation="8"/>"#;
        for cut in 0..packet.len() {
            let mut m = XmpMatcher::default();
            m.feed(&packet[..cut]);
            m.feed(&packet[cut..]);
            assert_eq!(m.result(), Some(8), "cut at {cut}");
        }
    }

    #[test]
    fn exif_truncated_or_garbage_is_no_orientation() {
        let t = tiff_with_orientation(true, 3, 1, [6, 0, 0, 0]);
        for cut in 0..t.len() {
            let _ = exif_orientation(&t[..cut]);
        }
        assert_eq!(exif_orientation(&t[..14]), Tag::Absent);
        assert_eq!(exif_orientation(b"XX*\0\x08\0\0\0"), Tag::Absent);
    }

    #[test]
    fn a_payload_reads_the_same_whole_or_in_pieces_and_keeps_at_most_the_cap() {
        let payload: Vec<u8> = (0..EXIF_CAP + 100).map(|i| i as u8).collect();
        let mut whole = Whole::new(payload.len() as u64);
        let (n, got) = whole.take(&payload, |d| d.to_vec());
        assert_eq!(n, payload.len());
        assert_eq!(got.as_deref(), Some(&payload[..EXIF_CAP]));
        let mut pieces = Whole::new(payload.len() as u64);
        let mut out = None;
        for chunk in payload.chunks(1000) {
            let (n, got) = pieces.take(chunk, |d| d.to_vec());
            assert_eq!(n, chunk.len());
            out = out.or(got);
        }
        assert_eq!(out.as_deref(), Some(&payload[..EXIF_CAP]));
        // Bytes past the payload are not taken.
        let mut short = Whole::new(3);
        assert_eq!(
            short.take(b"abcdef", |d| d.to_vec()),
            (3, Some(b"abc".to_vec()))
        );
    }
}
