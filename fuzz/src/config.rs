//! Targets `config_router` and `config_filter`: the router's and the filter's configuration
//! parsers, and what an accepted configuration lets a request do.
//!
//! Input: a JSON document. Properties:
//!
//! - a refused document is a [`ConfigError`] naming a field, never a panic;
//! - an accepted [`RouterConfig`] validates, prints as JSON and reads back equal;
//! - an accepted [`FilterConfig`] validates, its router part validates, and the filter can
//!   start with it: the router and poller configure a fresh shared store and route requests;
//!   a decision names one of the configured workers;
//! - whatever an accepted configuration says, analysing a few hostile bodies (images whose
//!   headers claim 65535×65535, many images, long text) stays bounded: media tokens within
//!   `limits.max_media_tokens`, and the whole analysis within the target's allocation cap (the
//!   VM crash of issue 14 was a configuration with no size cap and such a header).

use mmrouter::analysis::analyze;
use mmrouter::config::{ConfigError, RouterConfig};
use mmrouter::filter::config::FilterConfig;
use mmrouter::filter::poller::Poller;
use mmrouter::filter::router::Router;
use mmrouter::state::MemoryStore;
use std::sync::OnceLock;

pub fn check_router(data: &[u8]) -> bool {
    match RouterConfig::from_json(data) {
        Ok(config) => {
            assert_eq!(config.validate(), Ok(()));
            let text = serde_json::to_vec(&config).expect("a config prints as JSON");
            assert_eq!(
                RouterConfig::from_json(&text).as_ref(),
                Ok(&config),
                "printed config {}",
                String::from_utf8_lossy(&text)
            );
            hostile_bodies(&config);
        }
        Err(e) => refused(&e),
    }
    true
}

pub fn check_filter(data: &[u8]) -> bool {
    match FilterConfig::from_json(data) {
        Ok(config) => {
            assert_eq!(config.validate(), Ok(()));
            assert_eq!(config.router.validate(), Ok(()));
            assert_eq!(FilterConfig::from_json(data).as_ref(), Ok(&config));
            hostile_bodies(&config.router);
            starts(config);
        }
        Err(e) => refused(&e),
    }
    true
}

fn refused(e: &ConfigError) {
    assert!(!e.field.is_empty(), "an error without a field: {e:?}");
    assert!(!e.to_string().is_empty());
}

/// The filter's start with `config`, then a few requests.
fn starts(config: FilterConfig) {
    let workers: Vec<String> = config.workers.iter().map(|w| w.name.clone()).collect();
    let sidecar = config.sidecar.is_some();
    let mut router = Router::new(config);
    let store = MemoryStore::default();
    Poller::configure(&router, &store, 1_000);
    for (i, body) in bodies().iter().enumerate() {
        let (decision, _) = router.route(body, &store, 2_000_000 + i as u64, i as u64);
        if let Some(d) = decision {
            assert!(
                sidecar || workers.contains(&d.target.name),
                "routed to {} of {workers:?}",
                d.target.name
            );
        }
    }
}

fn hostile_bodies(config: &RouterConfig) {
    for body in bodies() {
        if let Ok(a) = analyze(body, config) {
            let media: u64 = a
                .media
                .iter()
                .map(|m| u64::from(m.tokens.tokens) + u64::from(m.tokens.markers))
                .sum();
            assert!(media <= config.limits.max_media_tokens);
        }
    }
}

/// Small bodies that cost the most a body of their size can: images claiming 65535×65535 in
/// each format, several of them, and long text.
pub fn bodies() -> &'static [Vec<u8>] {
    static BODIES: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    BODIES.get_or_init(|| {
        let images = [
            ("image/png", test_image::png_claiming(65535, 65535)),
            ("image/jpeg", test_image::jpeg_claiming(65535, 65535)),
            ("image/gif", test_image::gif_claiming(65535, 65535)),
            ("image/webp", test_image::webp_claiming(16384, 16384)),
        ];
        let mut out = Vec::new();
        for model in ["Qwen/Qwen2.5-VL-7B-Instruct", "m"] {
            let parts: Vec<String> = images
                .iter()
                .map(|(mime, bytes)| test_image::image_part(mime, bytes))
                .collect();
            out.push(test_image::chat(model, &parts.join(",")));
            let many: Vec<String> = (0..8).map(|_| parts[0].clone()).collect();
            out.push(test_image::chat(model, &many.join(",")));
        }
        let text = format!(r#"{{"type":"text","text":"{}"}}"#, "word ".repeat(2000));
        out.push(test_image::chat("m", &text));
        out
    })
}

/// Files whose headers claim a size (as `tests/e2e/test_malformed.py` builds them).
pub mod test_image {
    use base64::Engine as _;

    fn crc32(data: &[u8]) -> u32 {
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

    fn png_chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        let start = out.len();
        out.extend_from_slice(kind);
        out.extend_from_slice(data);
        let crc = crc32(&out[start..]);
        out.extend_from_slice(&crc.to_be_bytes());
    }

    pub fn png_claiming(w: u32, h: u32) -> Vec<u8> {
        let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
        let mut ihdr = Vec::new();
        ihdr.extend_from_slice(&w.to_be_bytes());
        ihdr.extend_from_slice(&h.to_be_bytes());
        ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
        png_chunk(&mut out, b"IHDR", &ihdr);
        // zlib of 64 zero bytes
        png_chunk(
            &mut out,
            b"IDAT",
            &[
                0x78, 0x9c, 0x63, 0x60, 0xa0, 0x0c, 0x00, 0x00, 0x00, 0x40, 0x00, 0x01,
            ],
        );
        png_chunk(&mut out, b"IEND", &[]);
        out
    }

    pub fn jpeg_claiming(w: u16, h: u16) -> Vec<u8> {
        let mut out = vec![0xff, 0xd8, 0xff, 0xc0, 0, 17, 8];
        out.extend_from_slice(&h.to_be_bytes());
        out.extend_from_slice(&w.to_be_bytes());
        out.extend_from_slice(&[3, 1, 0x22, 0, 2, 0x11, 1, 3, 0x11, 1]);
        // SOS for the three components, then the end.
        out.extend_from_slice(&[0xff, 0xda, 0, 12, 3, 1, 0, 2, 0x11, 3, 0x11, 0, 63, 0]);
        out.extend_from_slice(&[0xff, 0xd9]);
        out
    }

    pub fn gif_claiming(w: u16, h: u16) -> Vec<u8> {
        let mut out = b"GIF89a".to_vec();
        out.extend_from_slice(&w.to_le_bytes());
        out.extend_from_slice(&h.to_le_bytes());
        out.extend_from_slice(&[0, 0, 0, 0x2c, 0, 0, 0, 0]);
        out.extend_from_slice(&w.to_le_bytes());
        out.extend_from_slice(&h.to_le_bytes());
        out.extend_from_slice(&[0, 2, 2, 0x44, 1, 0, 0x3b]);
        out
    }

    pub fn webp_claiming(w: u32, h: u32) -> Vec<u8> {
        let bits = ((w - 1) & 0x3fff) | (((h - 1) & 0x3fff) << 14);
        let mut vp8l = vec![0x2f];
        vp8l.extend_from_slice(&bits.to_le_bytes());
        let mut chunk = b"VP8L".to_vec();
        chunk.extend_from_slice(&(vp8l.len() as u32).to_le_bytes());
        chunk.extend_from_slice(&vp8l);
        chunk.push(0); // pad to even
        let mut out = b"RIFF".to_vec();
        out.extend_from_slice(&(4 + chunk.len() as u32).to_le_bytes());
        out.extend_from_slice(b"WEBP");
        out.extend_from_slice(&chunk);
        out
    }

    pub fn image_part(mime: &str, bytes: &[u8]) -> String {
        let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
        format!(r#"{{"type":"image_url","image_url":{{"url":"data:{mime};base64,{b64}"}}}}"#)
    }

    pub fn chat(model: &str, parts: &str) -> Vec<u8> {
        format!(
            r#"{{"model":"{model}","messages":[{{"role":"user","content":[{parts},{{"type":"text","text":"what is this?"}}]}}]}}"#
        )
        .into_bytes()
    }
}
