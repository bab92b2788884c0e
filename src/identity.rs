//! Content identity of media items.
//!
//! - Inline `data:` URLs: the base64 payload is decoded (line breaks and spaces tolerated) and
//!   the decoded FILE bytes are hashed with xxh3-128, written as 32 lowercase hex characters.
//!   vLLM hashes the same original encoded bytes, so two requests carry the same id exactly
//!   when the engine would see the same item, whatever their MIME label or line wrapping.
//! - http(s) URLs the filter fetched: xxh3-128 of the fetched bytes, the same id as the same
//!   bytes sent inline (marked [`IdSource::Fetched`]).
//! - http(s) URLs not fetched: xxh3-128 of the normalised URL (lowercase scheme and host,
//!   default port and fragment dropped, query kept), marked [`IdSource::Url`].
//! - A client `uuid` on the part: used verbatim, as vLLM does.

use base64::Engine as _;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use std::fmt;
use xxhash_rust::xxh3::{xxh3_64, xxh3_128};

/// Where an identity came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IdSource {
    /// xxh3-128 of the decoded bytes of an inline image.
    Inline,
    /// xxh3-128 of the bytes of an image the filter fetched from its URL (the same id as the
    /// same bytes inline).
    Fetched,
    /// xxh3-128 of the normalised URL (the bytes were not seen).
    Url,
    /// The client's `uuid`, verbatim.
    Uuid,
}

/// A media item's identity.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize)]
pub struct MediaId {
    pub id: String,
    pub source: IdSource,
}

impl MediaId {
    /// The identity of file bytes.
    pub fn of_bytes(bytes: &[u8]) -> MediaId {
        MediaId::of_digest(xxh3_128(bytes))
    }

    /// The identity of file bytes whose xxh3-128 is `digest` (hashed as they streamed).
    pub fn of_digest(digest: u128) -> MediaId {
        MediaId {
            id: hex128(digest),
            source: IdSource::Inline,
        }
    }

    /// The identity of an image fetched from its URL, whose bytes hash to `digest`: the same
    /// id as the same bytes inline, marked as fetched.
    pub fn of_fetched(digest: u128) -> MediaId {
        MediaId {
            id: hex128(digest),
            source: IdSource::Fetched,
        }
    }

    /// Whether the identity is of the image's bytes (inline or fetched), not of a URL or a
    /// client's uuid.
    pub fn is_content(&self) -> bool {
        matches!(self.source, IdSource::Inline | IdSource::Fetched)
    }

    /// The identity of a URL whose bytes were not seen.
    pub fn of_url(url: &str) -> MediaId {
        MediaId {
            id: hex128(xxh3_128(normalise_url(url).as_bytes())),
            source: IdSource::Url,
        }
    }

    pub fn of_uuid(uuid: &str) -> MediaId {
        MediaId {
            id: uuid.to_string(),
            source: IdSource::Uuid,
        }
    }

    /// 64 bits that stand for the identity inside block keys.
    pub fn key64(&self) -> u64 {
        xxh3_64(self.id.as_bytes())
    }
}

impl fmt::Display for MediaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.id)
    }
}

fn hex128(v: u128) -> String {
    format!("{v:032x}")
}

/// Why a data URL could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// `data:` URL without `;base64` (vLLM accepts only base64 data URLs).
    NotBase64,
    /// A byte that is not in the base64 alphabet, or a wrong length.
    InvalidBase64(String),
    Empty,
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::NotBase64 => f.write_str("data URL is not base64 (needs `;base64,`)"),
            DecodeError::InvalidBase64(e) => write!(f, "invalid base64 in data URL: {e}"),
            DecodeError::Empty => f.write_str("data URL has no data"),
        }
    }
}

impl std::error::Error for DecodeError {}

const STANDARD_LENIENT: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new()
        .with_decode_padding_mode(DecodePaddingMode::Indifferent)
        .with_decode_allow_trailing_bits(true),
);
const URL_SAFE_LENIENT: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::URL_SAFE,
    GeneralPurposeConfig::new()
        .with_decode_padding_mode(DecodePaddingMode::Indifferent)
        .with_decode_allow_trailing_bits(true),
);

/// Decodes a base64 payload, tolerating ASCII white space (line breaks from MIME wrapping) and
/// missing padding. Standard alphabet first, URL-safe alphabet as a fallback.
pub fn decode_base64(payload: &str) -> Result<Vec<u8>, DecodeError> {
    let bytes = payload.as_bytes();
    if bytes.is_empty() {
        return Err(DecodeError::Empty);
    }
    // Fast path: white space is in neither alphabet, so a payload that decodes as it is had
    // none to strip. Scanning for white space first cost more than the decode itself on a
    // 1 MiB image (docs/BENCHMARKS.md, "Request path").
    let raw_error = match STANDARD_LENIENT.decode(bytes) {
        Ok(v) => return Ok(v),
        Err(e) => e,
    };
    let compact: std::borrow::Cow<'_, [u8]> = if bytes.iter().any(u8::is_ascii_whitespace) {
        bytes
            .iter()
            .copied()
            .filter(|b| !b.is_ascii_whitespace())
            .collect::<Vec<u8>>()
            .into()
    } else {
        bytes.into()
    };
    if compact.is_empty() {
        return Err(DecodeError::Empty);
    }
    let first = match &compact {
        // Without white space `compact` is the raw payload, already tried.
        std::borrow::Cow::Borrowed(_) => raw_error,
        std::borrow::Cow::Owned(stripped) => match STANDARD_LENIENT.decode(stripped) {
            Ok(v) => return Ok(v),
            Err(e) => e,
        },
    };
    URL_SAFE_LENIENT
        .decode(&compact)
        .map_err(|_| DecodeError::InvalidBase64(first.to_string()))
}

/// Normalises a URL for identity: scheme and host lowercased, default port (80 for http, 443
/// for https) and fragment dropped, path and query kept as written. Not a full RFC 3986
/// normaliser: it does not resolve dot segments or re-encode percent escapes, since the
/// worker fetches the URL as written.
pub fn normalise_url(url: &str) -> String {
    let url = url.trim();
    let without_fragment = url.split('#').next().unwrap_or(url);
    let Some((scheme, rest)) = without_fragment.split_once("://") else {
        return without_fragment.to_string();
    };
    let scheme = scheme.to_ascii_lowercase();
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let (userinfo, hostport) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let mut hostport = hostport.to_ascii_lowercase();
    let default_port = match scheme.as_str() {
        "http" => Some(":80"),
        "https" => Some(":443"),
        _ => None,
    };
    if let Some(port) = default_port
        && hostport.ends_with(port)
    {
        hostport.truncate(hostport.len() - port.len());
    }
    let tail = if tail.is_empty() { "/" } else { tail };
    let tail = if tail.starts_with('?') {
        format!("/{tail}")
    } else {
        tail.to_string()
    };
    match userinfo {
        Some(u) => format!("{scheme}://{u}@{hostport}{tail}"),
        None => format!("{scheme}://{hostport}{tail}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_bytes_same_id_whatever_the_wrapping() {
        let flat = "aGVsbG8gd29ybGQsIHRoaXMgaXMgYW4gaW1hZ2U=";
        let wrapped = "aGVsbG8gd29y\r\nbGQsIHRoaXMg aXMgYW4gaW1h\nZ2U=";
        let a = decode_base64(flat).map(|b| MediaId::of_bytes(&b));
        let b = decode_base64(wrapped).map(|b| MediaId::of_bytes(&b));
        assert_eq!(a, b);
        let unpadded = decode_base64("aGVsbG8gd29ybGQsIHRoaXMgaXMgYW4gaW1hZ2U");
        assert_eq!(unpadded, decode_base64(flat));
        let Ok(id) = a else { panic!("decode failed") };
        assert_eq!(id.id.len(), 32);
        assert!(
            id.id
                .bytes()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_ne!(
            MediaId::of_bytes(b"hello world, this is an image"),
            MediaId::of_bytes(b"hello world, this is an imagf")
        );
    }

    #[test]
    fn bad_base64_is_an_error() {
        assert!(matches!(
            decode_base64("ab$d"),
            Err(DecodeError::InvalidBase64(_))
        ));
        assert_eq!(decode_base64(" \n"), Err(DecodeError::Empty));
    }

    #[test]
    fn url_safe_payloads_decode_flat_or_wrapped() {
        // Bytes whose standard base64 has '+' and '/': "-" and "_" in the URL-safe alphabet.
        let bytes = [0xfb_u8, 0xff, 0xbf, 0xfe, 0x0f, 0xbe];
        let url_safe = "-_-__g--";
        assert_eq!(decode_base64("+/+//g++"), Ok(bytes.to_vec()));
        assert_eq!(decode_base64(url_safe), Ok(bytes.to_vec()));
        assert_eq!(decode_base64("-_-_\r\n_g--\n"), Ok(bytes.to_vec()));
        assert_eq!(decode_base64("+/+/ /g++"), Ok(bytes.to_vec()));
        // Mixed alphabets are neither; the error is the standard alphabet's, on the stripped
        // payload, whether or not there was white space.
        let flat = decode_base64("+_+_");
        let wrapped = decode_base64("+_\n+_");
        assert!(matches!(&flat, Err(DecodeError::InvalidBase64(m)) if m.contains("offset 1")));
        assert_eq!(flat, wrapped);
    }

    #[test]
    fn url_normalisation() {
        let n = normalise_url;
        assert_eq!(
            n("HTTPS://Example.COM:443/a/B.png?x=1#frag"),
            "https://example.com/a/B.png?x=1"
        );
        assert_eq!(n("http://example.com:80"), "http://example.com/");
        assert_eq!(n("http://example.com:8080/x"), "http://example.com:8080/x");
        assert_eq!(n("https://example.com?q"), "https://example.com/?q");
        assert_eq!(
            MediaId::of_url("https://EXAMPLE.com/a.png#x"),
            MediaId::of_url("https://example.com:443/a.png")
        );
        assert_ne!(
            MediaId::of_url("https://example.com/a.png?v=1"),
            MediaId::of_url("https://example.com/a.png?v=2")
        );
        assert_eq!(MediaId::of_url("https://e.com/a").source, IdSource::Url);
    }
}
