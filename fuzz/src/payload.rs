//! Target `base64`: the data-URL / base64 decoder, the slice one against the scanner's
//! streaming one.
//!
//! Input: [`crate::split`]'s control byte and piece sizes, then a base64 payload (taken as
//! UTF-8, invalid sequences replaced). Flag bit 0 puts the payload in an image data URL
//! (`image_url`, so the streaming header reader runs too) instead of `input_audio.data`; bits
//! 1-2 choose how the JSON string escapes it (minimally, every character as `\uXXXX`, `/` as
//! `\/`, or every other character), so the scanner's unescaping feeds the decoder. The body
//! is scanned in the input's pieces. Properties:
//!
//! - [`decode_base64`] and the scanner agree: the same error, or the scanner's item is the
//!   decoded bytes (their length and xxh3-128), and for an image the header that
//!   [`read_image_header`] reads from those bytes;
//! - what decodes has at most 3 bytes per 4 symbols, and re-encoded (standard alphabet,
//!   padded) decodes to the same bytes; white space removed, it decodes the same.

use super::split::{pieces, split};
use base64::Engine as _;
use mmrouter::identity::{DecodeError, decode_base64};
use mmrouter::image_header::read_image_header;
use mmrouter::request::{Limits, MediaKind};
use mmrouter::scan::{BodyScanner, MediaContent};
use xxhash_rust::xxh3::xxh3_128;

pub fn check(data: &[u8]) -> bool {
    let input = split(data);
    let payload = String::from_utf8_lossy(input.payload);
    let image = input.flags & 1 != 0;
    let escape = (input.flags >> 1) & 3;
    let body = body(&payload, image, escape);

    let expected = decode_base64(&payload);
    standalone(&payload, &expected);

    let mut scanner = BodyScanner::new(&Limits::default());
    for piece in pieces(&body, input.sizes) {
        scanner.feed(piece).expect("the body is valid JSON");
    }
    let scanned = scanner.finish().expect("the body is a request");
    assert_eq!(scanned.media.len(), 1, "one media item");
    let item = &scanned.media[0];
    assert_eq!(
        item.kind,
        if image {
            MediaKind::Image
        } else {
            MediaKind::Audio
        }
    );
    match (&expected, &item.content) {
        (
            Ok(bytes),
            MediaContent::Inline {
                hash,
                bytes: len,
                header,
            },
        ) => {
            assert_eq!(*len, bytes.len(), "decoded length");
            assert_eq!(*hash, xxh3_128(bytes), "decoded bytes");
            let want = image.then(|| read_image_header(bytes));
            assert_eq!(header, &want, "streamed header against the slice reader");
        }
        (Err(e), MediaContent::Invalid(got)) => assert_eq!(e, got),
        (want, got) => panic!("decode_base64 gave {want:?}, the scanner {got:?}"),
    }
    true
}

/// A chat body whose one media part carries `payload`.
pub fn body(payload: &str, image: bool, escape: u8) -> Vec<u8> {
    let part = if image {
        let url = format!("data:image/png;base64,{payload}");
        format!(
            r#"{{"type":"image_url","image_url":{{"url":{}}}}}"#,
            json_string(&url, escape)
        )
    } else {
        format!(
            r#"{{"type":"input_audio","input_audio":{{"data":{},"format":"wav"}}}}"#,
            json_string(payload, escape)
        )
    };
    format!(r#"{{"model":"m","messages":[{{"role":"user","content":[{part}]}}]}}"#).into_bytes()
}

/// `s` as a JSON string literal, escaped as `mode` says (see the module docs).
fn json_string(s: &str, mode: u8) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for (i, c) in s.chars().enumerate() {
        let all = mode == 1 || (mode == 3 && i % 2 == 0);
        match c {
            _ if all => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '/' if mode == 2 => out.push_str("\\/"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn standalone(payload: &str, decoded: &Result<Vec<u8>, DecodeError>) {
    let Ok(bytes) = decoded else {
        return;
    };
    let symbols = payload
        .bytes()
        .filter(|b| !b.is_ascii_whitespace() && *b != b'=')
        .count();
    assert!(
        bytes.len() <= symbols * 3 / 4,
        "more bytes than symbols allow"
    );
    if !bytes.is_empty() {
        let again = base64::engine::general_purpose::STANDARD.encode(bytes);
        assert_eq!(decode_base64(&again).as_ref(), Ok(bytes), "re-encoded");
    }
    let compact: String = payload
        .chars()
        .filter(|c| !c.is_ascii_whitespace())
        .collect();
    assert_eq!(
        decode_base64(&compact).as_ref(),
        Ok(bytes),
        "white space removed"
    );
}
