//! Base64 decoded as it streams, into a sink, with the exact leniency and errors of
//! [`crate::identity::decode_base64`].
//!
//! That function strips ASCII white space, then decodes with the standard alphabet, then with
//! the URL-safe one, both with padding optional and trailing bits allowed (the `base64` crate's
//! `GeneralPurpose` engine, `DecodePaddingMode::Indifferent`), and reports the standard
//! alphabet's error. Streaming gives the same bytes and the same verdict:
//!
//! - Both alphabets decode the symbols they share alike, so the stream is decoded with their
//!   union and the verdict is taken at the end: the standard alphabet succeeds when no `-`/`_`
//!   was seen and the union succeeded, the URL-safe one when no `+`/`/` was seen.
//! - The `base64` crate decodes every complete quad but the last 1 to 4 symbols strictly (`=` is
//!   an invalid byte there) and the last ones leniently (padding, trailing bits). A quad is
//!   therefore decoded only once a symbol after it has arrived; the last quad waits for the end.
//! - The error is rebuilt from the first symbol each alphabet rejects, the symbol count and the
//!   last symbols, in the crate's order of checks, and formatted by the crate's own
//!   `DecodeError`.
//!
//! State: the symbol count, at most 4 held symbols, the first rejected symbol per alphabet and
//! a 3 KiB output buffer that is handed to the sink whenever it fills.

use crate::identity::DecodeError;

/// Where decoded bytes go.
pub(crate) trait Sink {
    fn bytes(&mut self, bytes: &[u8]);
}

const INVALID: u8 = 0xFF;

// The tables are built at compile time: an index out of range would fail the build, not a
// request.
#[allow(clippy::indexing_slicing)]
const fn table(extra62: u8, extra63: u8) -> [u8; 256] {
    let mut t = [INVALID; 256];
    let mut i = 0;
    while i < 26 {
        t[b'A' as usize + i] = i as u8;
        t[b'a' as usize + i] = 26 + i as u8;
        i += 1;
    }
    let mut d = 0;
    while d < 10 {
        t[b'0' as usize + d] = 52 + d as u8;
        d += 1;
    }
    t[extra62 as usize] = 62;
    t[extra63 as usize] = 63;
    t
}

const STANDARD: [u8; 256] = table(b'+', b'/');
const URL_SAFE: [u8; 256] = table(b'-', b'_');
/// Both alphabets: what a symbol decodes to whichever alphabet the payload turns out to use.
#[allow(clippy::indexing_slicing)]
const UNION: [u8; 256] = {
    let mut t = STANDARD;
    t[b'-' as usize] = 62;
    t[b'_' as usize] = 63;
    t
};

/// Decoded bytes are gathered here before going to the sink.
const OUT: usize = 3 * 1024;
/// Input symbols decoded per fast-path block.
const BLOCK: usize = OUT / 3 * 4;

fn value(table: &[u8; 256], b: u8) -> u8 {
    table.get(usize::from(b)).copied().unwrap_or(INVALID)
}

#[derive(Debug)]
pub(crate) struct Base64Stream {
    /// Symbols (non-white-space bytes) seen.
    n: usize,
    /// The last 1..=4 symbols, not decoded yet (0 only before the first symbol).
    held: [u8; 4],
    held_len: usize,
    /// The first symbol each alphabet rejects (`=` included: it is only padding at the end).
    bad_standard: Option<(usize, u8)>,
    bad_url_safe: Option<(usize, u8)>,
    /// A symbol of only one alphabet was seen.
    standard_only: bool,
    url_safe_only: bool,
    /// A complete quad before the last symbols had a symbol of neither alphabet: the payload
    /// is invalid whatever follows, so nothing more is decoded (symbols are still counted).
    dead: bool,
    /// Bytes handed to the sink.
    decoded: usize,
    out: [u8; OUT],
    out_len: usize,
}

impl Default for Base64Stream {
    fn default() -> Self {
        Self::new()
    }
}

impl Base64Stream {
    pub(crate) fn new() -> Base64Stream {
        Base64Stream {
            n: 0,
            held: [0; 4],
            held_len: 0,
            bad_standard: None,
            bad_url_safe: None,
            standard_only: false,
            url_safe_only: false,
            dead: false,
            decoded: 0,
            out: [0; OUT],
            out_len: 0,
        }
    }

    /// The next bytes of the payload (already JSON-unescaped). Returns the index of the first
    /// byte that is not printable ASCII (a control byte or part of a UTF-8 sequence), which
    /// the JSON lexer has to look at; every other byte was seen to be plain.
    pub(crate) fn feed(&mut self, input: &[u8], sink: &mut impl Sink) -> Option<usize> {
        let mut first_odd = None;
        let mut at = 0;
        while let Some(rest) = input.get(at..).filter(|r| !r.is_empty()) {
            // Scalar until the held quad is complete, then the fast path over whole quads that
            // are certainly not the last ones (at least one byte stays behind for `held`). The
            // held quad is decoded only when a symbol follows it: white space after the last
            // quad (a payload padded with spaces or line breaks) leaves it the last one.
            let next_is_space = rest.first().is_some_and(u8::is_ascii_whitespace);
            if self.dead || self.held_len != 4 || rest.len() < 8 || next_is_space {
                let Some(&b) = rest.first() else {
                    break;
                };
                if !(0x20..0x80).contains(&b) {
                    first_odd.get_or_insert(at);
                }
                self.symbol(b, sink);
                at += 1;
                continue;
            }
            self.decode_held(sink);
            self.held_len = 0;
            let whole = (rest.len() - 1) / 4 * 4;
            let quads = rest.get(..whole.min(BLOCK)).unwrap_or_default();
            if !self.fast(quads, sink) {
                // Something other than plain symbols: the scalar path sorts it out.
                for (k, &b) in quads.iter().enumerate() {
                    if !(0x20..0x80).contains(&b) {
                        first_odd.get_or_insert(at + k);
                    }
                    self.symbol(b, sink);
                }
            }
            at += quads.len();
        }
        first_odd
    }

    /// Decodes whole quads of plain symbols of one alphabet; false (and nothing done) when
    /// `quads` holds anything else.
    fn fast(&mut self, quads: &[u8], sink: &mut impl Sink) -> bool {
        if self.out_len + quads.len() / 4 * 3 > OUT {
            self.flush(sink);
        }
        let dst = self.out.get_mut(self.out_len..).unwrap_or_default();
        let Some((written, table)) = decode_quads(quads, dst) else {
            return false;
        };
        // Record the alphabet's own symbols, as the scalar path would.
        let (a, b) = if table { (b'+', b'/') } else { (b'-', b'_') };
        let seen = if table {
            &mut self.standard_only
        } else {
            &mut self.url_safe_only
        };
        if !*seen && let Some(i) = memchr::memchr2(a, b, quads) {
            *seen = true;
            let at = (self.n + i, quads.get(i).copied().unwrap_or(0));
            let other = if table {
                &mut self.bad_url_safe
            } else {
                &mut self.bad_standard
            };
            if other.is_none() {
                *other = Some(at);
            }
        }
        self.n += quads.len();
        self.out_len += written;
        // The last quad is held back, as the scalar path holds it.
        if let Some(last) = quads.len().checked_sub(4).and_then(|i| quads.get(i..)) {
            self.out_len -= 3;
            self.held.copy_from_slice(last);
            self.held_len = 4;
        }
        true
    }

    fn symbol(&mut self, b: u8, sink: &mut impl Sink) {
        if b.is_ascii_whitespace() {
            return;
        }
        let at = self.n;
        self.n += 1;
        if value(&STANDARD, b) == INVALID && self.bad_standard.is_none() {
            self.bad_standard = Some((at, b));
        }
        if value(&URL_SAFE, b) == INVALID && self.bad_url_safe.is_none() {
            self.bad_url_safe = Some((at, b));
        }
        match b {
            b'+' | b'/' => self.standard_only = true,
            b'-' | b'_' => self.url_safe_only = true,
            _ => {}
        }
        if self.held_len == 4 {
            self.decode_held(sink);
            self.held_len = 0;
        }
        if let Some(slot) = self.held.get_mut(self.held_len) {
            *slot = b;
        }
        self.held_len += 1;
    }

    /// The held quad is followed by another symbol: decode it strictly.
    fn decode_held(&mut self, sink: &mut impl Sink) {
        if self.dead {
            return;
        }
        let [a, b, c, d] = self.held.map(|s| value(&UNION, s));
        if a == INVALID || b == INVALID || c == INVALID || d == INVALID {
            self.dead = true;
            return;
        }
        let v = (u32::from(a) << 18) | (u32::from(b) << 12) | (u32::from(c) << 6) | u32::from(d);
        if self.out_len + 3 > OUT {
            self.flush(sink);
        }
        if let Some(dst) = self.out.get_mut(self.out_len..self.out_len + 3) {
            dst.copy_from_slice(&v.to_be_bytes()[1..]);
            self.out_len += 3;
        }
    }

    fn flush(&mut self, sink: &mut impl Sink) {
        if self.out_len > 0 {
            sink.bytes(self.out.get(..self.out_len).unwrap_or_default());
            self.decoded += self.out_len;
            self.out_len = 0;
        }
    }

    /// The end of the payload: the decoded length, or the error `decode_base64` reports.
    pub(crate) fn finish(mut self, sink: &mut impl Sink) -> Result<usize, DecodeError> {
        if self.n == 0 {
            return Err(DecodeError::Empty);
        }
        let standard = self.verdict(&STANDARD, self.bad_standard);
        let url_safe = self.verdict(&URL_SAFE, self.bad_url_safe);
        let ok =
            (standard.is_ok() && !self.url_safe_only) || (url_safe.is_ok() && !self.standard_only);
        if !ok || self.dead {
            let e = match standard {
                Err(e) => e,
                // Standard passed the structure but a URL-safe symbol is there: it is the
                // first symbol the standard alphabet rejects.
                Ok(()) => {
                    let (at, b) = self.bad_standard.unwrap_or((0, 0));
                    ::base64::DecodeError::InvalidByte(at, b)
                }
            };
            return Err(DecodeError::InvalidBase64(e.to_string()));
        }
        // The last symbols: 2 to 4 of them give 1 to 3 bytes (trailing bits dropped).
        let mut acc = 0u32;
        let mut morsels = 0;
        for &s in self.held.get(..self.held_len).unwrap_or_default() {
            if s != b'=' {
                acc |= u32::from(value(&UNION, s)) << (26 - 6 * morsels);
                morsels += 1;
            }
        }
        let tail = acc.to_be_bytes();
        let tail = tail.get(..morsels * 6 / 8).unwrap_or_default();
        self.flush(sink);
        sink.bytes(tail);
        Ok(self.decoded + tail.len())
    }

    /// The `base64` crate's checks for one alphabet, in its order: a trailing invalid byte
    /// after a complete quad, then the first invalid byte before the last symbols, then the
    /// last symbols (padding position, symbols after padding, length).
    fn verdict(
        &self,
        table: &[u8; 256],
        bad: Option<(usize, u8)>,
    ) -> Result<(), ::base64::DecodeError> {
        use ::base64::DecodeError::{InvalidByte, InvalidLength};
        let n = self.n;
        let held = self.held.get(..self.held_len).unwrap_or_default();
        let last = held.last().copied().unwrap_or(0);
        if n % 4 == 1 && last != b'=' && value(table, last) == INVALID {
            return Err(InvalidByte(n - 1, last));
        }
        let start = n - held.len();
        if let Some((at, b)) = bad
            && at < start
        {
            return Err(InvalidByte(at, b));
        }
        let mut morsels = 0;
        let mut padding: Option<usize> = None;
        for (k, &b) in held.iter().enumerate() {
            if b == b'=' {
                if k < 2 {
                    return Err(InvalidByte(start + k, b));
                }
                padding.get_or_insert(k);
                continue;
            }
            if let Some(p) = padding {
                return Err(InvalidByte(start + p, b'='));
            }
            if value(table, b) == INVALID {
                return Err(InvalidByte(start + k, b));
            }
            morsels += 1;
        }
        if morsels < 2 {
            return Err(InvalidLength(start + morsels));
        }
        Ok(())
    }
}

/// Decodes `quads` (a multiple of 4 symbols, no padding) into `dst` with the standard
/// alphabet, else with the URL-safe one. Returns the bytes written and whether it was the
/// standard alphabet; `None` when neither alphabet decodes every symbol.
///
/// `base64-simd` where it wins (docs/BENCHMARKS.md, "Base64"): natively (it picks AVX2/SSE4.1
/// or NEON at run time) and in wasm built with `+simd128`; the table loop below in wasm
/// without SIMD, where `base64-simd`'s own fallback is no faster.
#[cfg(not(all(target_arch = "wasm32", not(target_feature = "simd128"))))]
fn decode_quads(quads: &[u8], dst: &mut [u8]) -> Option<(usize, bool)> {
    decode_quads_simd(quads, dst)
}

#[cfg(all(target_arch = "wasm32", not(target_feature = "simd128")))]
fn decode_quads(quads: &[u8], dst: &mut [u8]) -> Option<(usize, bool)> {
    decode_quads_scalar(quads, dst)
}

#[cfg_attr(
    all(target_arch = "wasm32", not(target_feature = "simd128")),
    allow(dead_code)
)]
fn decode_quads_simd(quads: &[u8], dst: &mut [u8]) -> Option<(usize, bool)> {
    // The `_NO_PAD` engines: `=` is never accepted inside a block (padding is only legal
    // among the last symbols, which the scalar path handles).
    let need = quads.len() / 4 * 3;
    let dst = dst.get_mut(..need)?;
    if base64_simd::STANDARD_NO_PAD
        .decode(quads, base64_simd::Out::from_slice(&mut *dst))
        .is_ok()
    {
        return Some((need, true));
    }
    if base64_simd::URL_SAFE_NO_PAD
        .decode(quads, base64_simd::Out::from_slice(dst))
        .is_ok()
    {
        return Some((need, false));
    }
    None
}

/// Without SIMD: the `base64` crate's engines (eight symbols per step into a `u64`, faster
/// than a table loop), in their no-padding configuration, so `=` is refused inside a block as
/// above.
#[cfg_attr(
    not(all(target_arch = "wasm32", not(target_feature = "simd128"))),
    allow(dead_code)
)]
fn decode_quads_scalar(quads: &[u8], dst: &mut [u8]) -> Option<(usize, bool)> {
    use ::base64::Engine as _;
    use ::base64::engine::general_purpose::{STANDARD_NO_PAD, URL_SAFE_NO_PAD};
    let need = quads.len() / 4 * 3;
    let dst = dst.get_mut(..need)?;
    if let Ok(n) = STANDARD_NO_PAD.decode_slice(quads, &mut *dst) {
        return (n == need).then_some((n, true));
    }
    match URL_SAFE_NO_PAD.decode_slice(quads, dst) {
        Ok(n) => (n == need).then_some((n, false)),
        Err(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::decode_base64;
    use proptest::prelude::*;

    impl Sink for Vec<u8> {
        fn bytes(&mut self, bytes: &[u8]) {
            self.extend_from_slice(bytes);
        }
    }

    fn streamed(payload: &[u8], cuts: &[usize]) -> Result<Vec<u8>, DecodeError> {
        let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (payload.len() + 1)).collect();
        cuts.sort_unstable();
        let mut s = Base64Stream::new();
        let mut out = Vec::new();
        let mut from = 0;
        for c in cuts {
            s.feed(&payload[from..c], &mut out);
            from = c;
        }
        s.feed(&payload[from..], &mut out);
        let n = s.finish(&mut out)?;
        assert_eq!(n, out.len());
        Ok(out)
    }

    fn reference(payload: &[u8]) -> Result<Vec<u8>, DecodeError> {
        match std::str::from_utf8(payload) {
            Ok(s) => decode_base64(s),
            Err(_) => unreachable!("payloads are ASCII here"),
        }
    }

    #[test]
    fn white_space_after_the_last_quad_leaves_it_the_last_one() {
        // Found by the `base64` fuzzer: with the last quad held and eight or more bytes of
        // white space after it in one piece, the quad was decoded as if a symbol followed,
        // and the payload ended with no symbols held ("Invalid input length: 8").
        for payload in [
            &b"AXCAIAPN           "[..],
            b"AXCAIAPN\r\n\r\n\r\n\r\n",
            b"AXCA IAPN        \n",
            b"AXCAIAPNAXCA\n\n\n\n\n\n\n\n\nAXCAIAPN        ",
        ] {
            let want = reference(payload);
            assert!(want.is_ok(), "{:?}", String::from_utf8_lossy(payload));
            for cut in 0..=payload.len() {
                assert_eq!(streamed(payload, &[cut]), want, "cut at {cut}");
            }
        }
    }

    #[test]
    fn known_payloads_decode_as_decode_base64_does() {
        for p in [
            "aGVsbG8gd29ybGQsIHRoaXMgaXMgYW4gaW1hZ2U=",
            "aGVsbG8gd29y\r\nbGQsIHRoaXMg aXMgYW4gaW1h\nZ2U=",
            "aGVsbG8gd29ybGQsIHRoaXMgaXMgYW4gaW1hZ2U",
            "+/+//g++",
            "-_-__g--",
            "-_-_\r\n_g--\n",
            "+_+_",
            "+_\n+_",
            "ab$d",
            " \n",
            "",
            "QQ",
            "QQ=",
            "QQ==",
            "QQ===",
            "QQ=Q",
            "Q",
            "QUJD=",
            "QUJDR",
            "QUJD$",
            "Q$JDR",
            "QQ==QUJD",
            "QUJD====",
            "=QUJ",
            "Q=UJ",
            "QUJDQUJDQUJDQUJDQUJDQUJDQUJDQUJDQUJDQUJDQUJD-w",
            "QUJDQUJDQUJDQUJDQUJDQUJDQUJDQUJDQUJDQUJDQUJD+w",
            "QUJDQUJDQUJDQUJDQUJDQUJDQUJDQUJDQUJDQUJDQUJD+w-w",
        ] {
            assert_eq!(
                streamed(p.as_bytes(), &[]),
                reference(p.as_bytes()),
                "{p:?}"
            );
            for cut in 0..=p.len() {
                assert_eq!(
                    streamed(p.as_bytes(), &[cut]),
                    reference(p.as_bytes()),
                    "{p:?} cut at {cut}"
                );
            }
        }
    }

    fn payload() -> impl Strategy<Value = Vec<u8>> {
        // Mostly base64 of random bytes (either alphabet, padded or not), with white space,
        // stray symbols and padding in random places.
        let clean = (
            prop::collection::vec(any::<u8>(), 0..200),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(|(bytes, url, pad)| {
                use ::base64::Engine as _;
                let e = match (url, pad) {
                    (false, true) => ::base64::engine::general_purpose::STANDARD.encode(&bytes),
                    (false, false) => {
                        ::base64::engine::general_purpose::STANDARD_NO_PAD.encode(&bytes)
                    }
                    (true, true) => ::base64::engine::general_purpose::URL_SAFE.encode(&bytes),
                    (true, false) => {
                        ::base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&bytes)
                    }
                };
                e.into_bytes()
            });
        let edit = prop_oneof![
            Just(b' '),
            Just(b'\n'),
            Just(b'\r'),
            Just(b'\t'),
            Just(0x0B),
            Just(0x0C),
            Just(b'='),
            Just(b'+'),
            Just(b'-'),
            Just(b'_'),
            Just(b'/'),
            Just(b'$'),
            Just(b'A'),
        ];
        (clean, prop::collection::vec((any::<usize>(), edit), 0..4)).prop_map(|(mut p, edits)| {
            for (at, b) in edits {
                let at = at % (p.len() + 1);
                p.insert(at, b);
            }
            p
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(2000)))]
        #[test]
        fn streamed_decoding_equals_decode_base64_whatever_the_cuts(
            p in payload(),
            cuts in prop::collection::vec(any::<usize>(), 0..5),
        ) {
            prop_assert_eq!(streamed(&p, &cuts), reference(&p));
        }
    }

    proptest! {
        #[test]
        fn the_simd_and_table_block_decoders_agree(
            quads in prop::collection::vec(
                prop_oneof![
                    20 => prop::sample::select(b"ABCXYZabcxyz0189+/-_".to_vec()),
                    1 => any::<u8>(),
                ],
                0..40,
            ).prop_map(|mut v| { v.truncate(v.len() / 4 * 4); v }),
        ) {
            let (mut a, mut b) = ([0u8; 30], [0u8; 30]);
            let simd = decode_quads_simd(&quads, &mut a);
            let table = decode_quads_scalar(&quads, &mut b);
            prop_assert_eq!(simd, table);
            if let Some((n, _)) = simd {
                prop_assert_eq!(&a[..n], &b[..n]);
            }
        }
    }

    #[test]
    fn long_payloads_take_the_fast_path_and_still_match() {
        use ::base64::Engine as _;
        let bytes: Vec<u8> = (0..100_000u32).map(|i| (i * 7919 % 251) as u8).collect();
        for e in [
            ::base64::engine::general_purpose::STANDARD.encode(&bytes),
            ::base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&bytes),
        ] {
            assert_eq!(streamed(e.as_bytes(), &[]), Ok(bytes.clone()));
            assert_eq!(
                streamed(e.as_bytes(), &[1, 4097, 9000, 70_001]),
                Ok(bytes.clone())
            );
        }
    }
}
