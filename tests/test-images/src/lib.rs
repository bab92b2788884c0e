//! Image files built in code, and the image fixtures, for mmrouter's tests: one copy of the
//! PNG and CRC-32 builders and of the base64/data-URL helpers that the unit tests in `src/` and
//! the integration tests in `tests/` share.
//!
//! The builders write what a header reader looks at (signature, chunk lengths, CRCs, IHDR);
//! the pixel data is whatever the test passes, never a valid compressed image unless it says
//! so, because header readers never inflate it.
//!
//! ```
//! let file = test_images::Png::new(640, 480).idat(&test_images::noise(64, 7)).bytes();
//! assert_eq!(&file[..8], b"\x89PNG\r\n\x1a\n");
//! assert_eq!(&file[16..24], [0, 0, 2, 128, 0, 0, 1, 224]); // IHDR width and height
//! ```
#![deny(missing_docs)]

use base64::Engine as _;
use std::path::{Path, PathBuf};

/// The CRC-32 of PNG chunks (ISO 3309, polynomial 0xEDB88320), bit by bit.
pub fn crc32(data: &[u8]) -> u32 {
    let mut crc = 0xFFFF_FFFFu32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// Appends a PNG chunk: length, type, data, and the CRC of type and data.
pub fn png_chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    let len = u32::try_from(data.len()).expect("a PNG chunk holds less than 4 GiB");
    out.extend_from_slice(&len.to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
}

/// A PNG file: the signature, an IHDR that says `width`×`height` (8 bits per sample), one IDAT
/// chunk and IEND, every CRC correct.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Png {
    width: u32,
    height: u32,
    color_type: u8,
    idat: Vec<u8>,
}

/// An empty zlib stream: the IDAT of [`Png::new`] and [`png`].
pub const EMPTY_ZLIB: [u8; 4] = [0x78, 0x9c, 0x03, 0x00];

impl Png {
    /// RGB (colour type 2), with an empty zlib stream ([`EMPTY_ZLIB`]) as its IDAT.
    pub fn new(width: u32, height: u32) -> Png {
        Png {
            width,
            height,
            color_type: 2,
            idat: EMPTY_ZLIB.to_vec(),
        }
    }

    /// Sets the IHDR colour type (0 grey, 2 RGB, 3 palette, 4 grey+alpha, 6 RGBA).
    pub fn color_type(mut self, color_type: u8) -> Png {
        self.color_type = color_type;
        self
    }

    /// Sets the IDAT chunk's data (e.g. [`noise`], so that files of one size differ).
    pub fn idat(mut self, data: &[u8]) -> Png {
        self.idat = data.to_vec();
        self
    }

    /// The file.
    pub fn bytes(&self) -> Vec<u8> {
        let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
        let mut ihdr = Vec::with_capacity(13);
        ihdr.extend_from_slice(&self.width.to_be_bytes());
        ihdr.extend_from_slice(&self.height.to_be_bytes());
        ihdr.extend_from_slice(&[8, self.color_type, 0, 0, 0]);
        png_chunk(&mut out, b"IHDR", &ihdr);
        png_chunk(&mut out, b"IDAT", &self.idat);
        png_chunk(&mut out, b"IEND", &[]);
        out
    }
}

/// `Png::new(width, height).bytes()`: an RGB PNG of that size with an empty IDAT.
pub fn png(width: u32, height: u32) -> Vec<u8> {
    Png::new(width, height).bytes()
}

/// `len` pseudo-random bytes, the same for the same `seed` (xorshift64), different for
/// different seeds: pixel data that makes otherwise equal files distinct.
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Standard base64 with padding, as in `data:` URLs.
pub fn base64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// A `data:<mime>;base64,...` URL of `bytes`.
pub fn data_url(mime: &str, bytes: &[u8]) -> String {
    format!("data:{mime};base64,{}", base64(bytes))
}

/// The directory of the image fixtures made by Pillow (`tests/fixtures/images`).
pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/images")
}

/// The bytes of the image fixture `name` (in [`fixtures_dir`]); panics naming the file when it
/// cannot be read.
pub fn fixture(name: &str) -> Vec<u8> {
    let path = fixtures_dir().join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_matches_the_standard_check_value() {
        // The CRC-32 check value of "123456789".
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
    }

    #[test]
    fn png_has_signature_ihdr_idat_iend_with_correct_crcs() {
        let file = Png::new(3, 2).color_type(6).idat(b"xyz").bytes();
        let mut at = 8;
        let mut kinds = Vec::new();
        while at < file.len() {
            let len = u32::from_be_bytes(file[at..at + 4].try_into().unwrap()) as usize;
            let body = &file[at + 4..at + 8 + len];
            let crc = u32::from_be_bytes(file[at + 8 + len..at + 12 + len].try_into().unwrap());
            assert_eq!(crc, crc32(body));
            kinds.push(String::from_utf8(body[..4].to_vec()).unwrap());
            at += 12 + len;
        }
        assert_eq!(kinds, ["IHDR", "IDAT", "IEND"]);
        assert_eq!(&file[16..29], [0, 0, 0, 3, 0, 0, 0, 2, 8, 6, 0, 0, 0]);
        assert_eq!(&file[41..44], b"xyz");
        assert_eq!(png(3, 2), Png::new(3, 2).idat(&EMPTY_ZLIB).bytes());
    }

    #[test]
    fn noise_is_deterministic_per_seed() {
        assert_eq!(noise(32, 1), noise(32, 1));
        assert_ne!(noise(32, 1), noise(32, 2));
        assert_eq!(noise(0, 1), Vec::<u8>::new());
    }

    #[test]
    fn data_urls_carry_padded_base64() {
        assert_eq!(base64(b"ab"), "YWI=");
        assert_eq!(data_url("image/png", b"abc"), "data:image/png;base64,YWJj");
        assert_eq!(&fixture("png_rgb8_37x23.png")[..4], b"\x89PNG");
    }
}
