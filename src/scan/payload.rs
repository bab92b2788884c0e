//! A media payload string as it streams: a URL, or a `data:` URL whose base64 is decoded into
//! the content hash and the image header reader without being kept.
//!
//! The rules are those of the parser this replaces: a string whose first five bytes are
//! `data:` (any case) is a data URL; its metadata runs to the first `,`; it is base64 when the
//! part after the metadata's last `;` (or all of it), trimmed of white space, is `base64` in any
//! case; anything else is a URL, kept verbatim for its identity. `input_audio.data` is base64
//! without the `data:` wrapper.

use super::MediaContent;
use super::base64::{Base64Stream, Sink};
use crate::identity::DecodeError;
use crate::image_header::HeaderReader;
use xxhash_rust::xxh3::Xxh3;

/// Decoded bytes go to the content hash, the header reader (images) and the byte count.
#[derive(Default)]
pub(super) struct Digest {
    hasher: Xxh3,
    header: Option<HeaderReader>,
}

impl Sink for Digest {
    fn bytes(&mut self, bytes: &[u8]) {
        self.hasher.update(bytes);
        if let Some(h) = &mut self.header {
            h.feed(bytes);
        }
    }
}

/// Base64 decoded into a digest.
pub(super) struct Decode {
    stream: Base64Stream,
    digest: Digest,
}

impl Decode {
    pub(super) fn new(image: bool) -> Box<Decode> {
        Box::new(Decode {
            stream: Base64Stream::new(),
            digest: Digest {
                hasher: Xxh3::new(),
                header: image.then(HeaderReader::new),
            },
        })
    }

    fn feed(&mut self, bytes: &[u8]) -> Option<usize> {
        self.stream.feed(bytes, &mut self.digest)
    }

    fn finish(self) -> MediaContent {
        let Decode { stream, mut digest } = self;
        match stream.finish(&mut digest) {
            Ok(bytes) => MediaContent::Inline {
                hash: digest.hasher.digest128(),
                bytes,
                header: digest.header.map(HeaderReader::finish),
            },
            Err(e) => MediaContent::Invalid(e),
        }
    }
}

/// Where a media string is.
pub(super) enum Payload {
    /// Fewer than five bytes, all matching `data:` so far.
    Prefix { bytes: [u8; 5], got: usize },
    /// Not a data URL: the whole string, kept.
    Url(Vec<u8>),
    /// A data URL's metadata, up to the first `,`.
    Meta { segment: Segment, pending: Utf8Char },
    /// Base64 into the digest.
    Data(Box<Decode>),
    /// A data URL that is not base64: the rest is not read.
    NotBase64,
    /// Decoding is off (media limit reached, or an earlier item failed): the string is only
    /// validated; its content is never reported.
    Unread,
}

/// The part of a data URL's metadata after its last `;`, against `\s*base64\s*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Segment {
    /// White space only so far.
    Lead,
    /// This many characters of `base64` matched.
    Word(u8),
    /// `base64` then white space.
    Trail,
    /// Anything else.
    No,
}

/// A UTF-8 character cut between two pieces of the metadata.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Utf8Char {
    bytes: [u8; 4],
    len: usize,
}

const WORD: &[u8; 6] = b"base64";

impl Segment {
    fn push(self, c: char) -> Segment {
        match self {
            Segment::Lead if c.is_whitespace() => Segment::Lead,
            Segment::Lead | Segment::Word(_) => {
                let k = match self {
                    Segment::Word(k) => k,
                    _ => 0,
                };
                match WORD.get(usize::from(k)) {
                    Some(&w) if c.is_ascii() && (c as u8).eq_ignore_ascii_case(&w) => {
                        Segment::Word(k + 1)
                    }
                    None if c.is_whitespace() => Segment::Trail,
                    _ => Segment::No,
                }
            }
            Segment::Trail if c.is_whitespace() => Segment::Trail,
            Segment::Trail | Segment::No => Segment::No,
        }
    }

    fn is_base64(self) -> bool {
        matches!(self, Segment::Word(6) | Segment::Trail)
    }
}

impl Payload {
    /// A media string starts; `decode` is false when its bytes must not be decoded.
    pub(super) fn url(decode: bool) -> Payload {
        if decode {
            Payload::Prefix {
                bytes: [0; 5],
                got: 0,
            }
        } else {
            Payload::Unread
        }
    }

    /// An `input_audio.data` string starts: base64 from its first byte.
    pub(super) fn base64(decode: bool) -> Payload {
        if decode {
            Payload::Data(Decode::new(false))
        } else {
            Payload::Unread
        }
    }

    /// More bytes of the (unescaped) string. `image` says whether a data URL here is an image.
    /// Returns the index of the first byte not seen to be printable ASCII (see
    /// [`crate::scan::json::Handler::string_run`]).
    pub(super) fn feed(&mut self, bytes: &[u8], image: bool) -> Option<usize> {
        let mut at = 0;
        let mut first_odd = None;
        while let Some(rest) = bytes.get(at..).filter(|r| !r.is_empty()) {
            match self {
                Payload::Prefix { bytes: prefix, got } => {
                    let Some(&b) = rest.first() else {
                        break;
                    };
                    if !(0x20..0x80).contains(&b) {
                        first_odd.get_or_insert(at);
                    }
                    at += 1;
                    let expected = b"data:".get(*got).copied().unwrap_or(0);
                    if let Some(slot) = prefix.get_mut(*got) {
                        *slot = b;
                    }
                    *got += 1;
                    if !b.eq_ignore_ascii_case(&expected) {
                        let kept = prefix.get(..*got).unwrap_or_default().to_vec();
                        *self = Payload::Url(kept);
                    } else if *got == 5 {
                        *self = Payload::Meta {
                            segment: Segment::Lead,
                            pending: Utf8Char::default(),
                        };
                    }
                }
                Payload::Url(kept) => {
                    kept.extend_from_slice(rest);
                    return first_odd.or(Some(at));
                }
                Payload::Meta { segment, pending } => {
                    let Some(&b) = rest.first() else {
                        break;
                    };
                    if !(0x20..0x80).contains(&b) {
                        first_odd.get_or_insert(at);
                    }
                    at += 1;
                    // The metadata is short; characters are decoded one at a time.
                    if let Some(slot) = pending.bytes.get_mut(pending.len) {
                        *slot = b;
                        pending.len += 1;
                    }
                    let c = match std::str::from_utf8(
                        pending.bytes.get(..pending.len).unwrap_or_default(),
                    ) {
                        Ok(s) => s.chars().next(),
                        Err(e) if e.error_len().is_none() => continue,
                        Err(_) => Some(char::REPLACEMENT_CHARACTER),
                    };
                    pending.len = 0;
                    match c {
                        Some(',') => {
                            *self = if segment.is_base64() {
                                Payload::Data(Decode::new(image))
                            } else {
                                Payload::NotBase64
                            };
                        }
                        Some(';') => *segment = Segment::Lead,
                        Some(c) => *segment = segment.push(c),
                        None => {}
                    }
                }
                Payload::Data(decode) => {
                    let odd = decode.feed(rest).map(|k| at + k);
                    return first_odd.or(odd);
                }
                Payload::NotBase64 | Payload::Unread => return first_odd.or(Some(at)),
            }
        }
        first_odd
    }

    /// The string ended: what the item's content is, or `None` when it was not read.
    pub(super) fn finish(self) -> Option<MediaContent> {
        match self {
            // Shorter than `data:` (or cut inside it): a URL.
            Payload::Prefix { bytes, got } => Some(MediaContent::Url(
                String::from_utf8_lossy(bytes.get(..got).unwrap_or_default()).into_owned(),
            )),
            Payload::Url(kept) => Some(MediaContent::Url(match String::from_utf8(kept) {
                Ok(s) => s,
                Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
            })),
            // No comma: not base64 (and no payload).
            Payload::Meta { .. } | Payload::NotBase64 => {
                Some(MediaContent::Invalid(DecodeError::NotBase64))
            }
            Payload::Data(decode) => Some(decode.finish()),
            Payload::Unread => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::decode_base64;
    use xxhash_rust::xxh3::xxh3_128;

    fn run(s: &str, cut: usize) -> Option<MediaContent> {
        let mut p = Payload::url(true);
        let (a, b) = s.as_bytes().split_at(cut.min(s.len()));
        p.feed(a, true);
        p.feed(b, true);
        p.finish()
    }

    #[test]
    fn data_urls_decode_and_hash_like_the_old_path_wherever_the_string_is_cut() {
        let s = "DATA:image/png; charset=x ;  BaSe64\u{3000} ,aGVsbG8=";
        let bytes = decode_base64("aGVsbG8=").unwrap();
        for cut in 0..=s.len() {
            match run(s, cut) {
                Some(MediaContent::Inline {
                    hash,
                    bytes: n,
                    header,
                }) => {
                    assert_eq!(hash, xxh3_128(&bytes), "cut {cut}");
                    assert_eq!(n, 5);
                    assert!(matches!(header, Some(Err(_))));
                }
                other => panic!("cut {cut}: {other:?}"),
            }
        }
    }

    #[test]
    fn urls_and_non_base64_data_urls() {
        for cut in 0..6 {
            assert!(
                matches!(run("https://e.com/a.png", cut), Some(MediaContent::Url(u)) if u == "https://e.com/a.png")
            );
            assert!(matches!(run("dat", cut), Some(MediaContent::Url(u)) if u == "dat"));
            assert!(matches!(run("", cut), Some(MediaContent::Url(u)) if u.is_empty()));
            for not in [
                "data:image/png,AAAA",
                "data:nocomma",
                "data:base64x,AA",
                "data:b ase64,AA",
            ] {
                assert!(
                    matches!(
                        run(not, cut),
                        Some(MediaContent::Invalid(DecodeError::NotBase64))
                    ),
                    "{not}"
                );
            }
            assert!(matches!(
                run("data:base64,", cut),
                Some(MediaContent::Invalid(DecodeError::Empty))
            ));
        }
    }
}
