//! The request bodies of the request-path benchmarks, made deterministically at start-up.
//!
//! Shared by `benches/pipeline.rs` (native, criterion) and `benches/wasm` (the same cases
//! compiled to wasm32-wasip1), so both measure byte-identical bodies. Nothing here is timed.
//!
//! The images are real files, encoded here rather than committed: JPEGs by the `jpeg-encoder`
//! crate (baseline, 4:2:0, like a camera or a browser canvas), PNGs by the `png` crate. Their
//! pixels are a smooth two-colour gradient with a few soft discs (something an encoder can
//! compress, as in a photo) plus deterministic noise that sets the file size. The amplitudes
//! below were chosen so the files land near their nominal sizes; [`cases`] checks that they
//! do (±15%) and that the router reads back the encoded width and height.

use base64::Engine as _;

/// The model of every body: resolves to the `qwen2.5-vl` profile (28-px patches after merge).
pub const MODEL: &str = "Qwen/Qwen2.5-VL-7B-Instruct";

/// One benchmark case.
pub struct Case {
    /// Short name used in benchmark ids and output (`text_8k`, `jpeg_1m`, `mixed_4x256k`).
    pub name: &'static str,
    /// The whole request body.
    pub body: Vec<u8>,
    /// The image files inside it, in request order (what the router decodes).
    pub images: Vec<Image>,
}

/// One image of a case.
pub struct Image {
    pub mime: &'static str,
    pub width: u32,
    pub height: u32,
    pub file: Vec<u8>,
    /// `file` in standard base64 (the data-URL payload as it appears in the body).
    pub base64: String,
}

/// xorshift64*: small, deterministic, the same on every target.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// RGB pixels: gradient + discs + uniform noise of `noise` levels (0..=255), row-major.
fn pixels(width: u32, height: u32, seed: u64, noise: u8) -> Vec<u8> {
    let mut rng = Rng(seed | 1);
    let (w, h) = (width as usize, height as usize);
    let c0 = [
        rng.below(256) as f32,
        rng.below(256) as f32,
        rng.below(256) as f32,
    ];
    let c1 = [
        rng.below(256) as f32,
        rng.below(256) as f32,
        rng.below(256) as f32,
    ];
    let discs: Vec<(f32, f32, f32, [f32; 3])> = (0..6)
        .map(|_| {
            (
                rng.below(w as u64) as f32,
                rng.below(h as u64) as f32,
                (w.min(h) as f32) * (0.05 + rng.below(20) as f32 / 100.0),
                [
                    rng.below(256) as f32 - 128.0,
                    rng.below(256) as f32 - 128.0,
                    rng.below(256) as f32 - 128.0,
                ],
            )
        })
        .collect();
    let mut out = Vec::with_capacity(w * h * 3);
    for y in 0..h {
        for x in 0..w {
            let t = (x + y) as f32 / (w + h) as f32;
            let mut px = [0f32; 3];
            for (c, p) in px.iter_mut().enumerate() {
                *p = c0[c] * (1.0 - t) + c1[c] * t;
            }
            for (cx, cy, r, tint) in &discs {
                let d2 = (x as f32 - cx).powi(2) + (y as f32 - cy).powi(2);
                if d2 < r * r {
                    let k = 1.0 - d2 / (r * r);
                    for (c, p) in px.iter_mut().enumerate() {
                        *p += tint[c] * k * 0.5;
                    }
                }
            }
            let n = if noise == 0 {
                0.0
            } else {
                rng.below(u64::from(noise) * 2 + 1) as f32 - f32::from(noise)
            };
            for p in px {
                out.push((p + n).clamp(0.0, 255.0) as u8);
            }
        }
    }
    out
}

/// A baseline JPEG (quality 90, 4:2:0) of the synthetic picture.
pub fn jpeg(width: u32, height: u32, seed: u64, noise: u8) -> Vec<u8> {
    let rgb = pixels(width, height, seed, noise);
    let mut out = Vec::new();
    let enc = jpeg_encoder::Encoder::new(&mut out, 90);
    let (w, h) = (
        u16::try_from(width).unwrap_or(u16::MAX),
        u16::try_from(height).unwrap_or(u16::MAX),
    );
    if let Err(e) = enc.encode(&rgb, w, h, jpeg_encoder::ColorType::Rgb) {
        panic!("jpeg encode: {e}");
    }
    out
}

/// An 8-bit RGB PNG of the synthetic picture (default compression and filtering).
pub fn png(width: u32, height: u32, seed: u64, noise: u8) -> Vec<u8> {
    let rgb = pixels(width, height, seed, noise);
    let mut out = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut out, width, height);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let result = enc
            .write_header()
            .and_then(|mut writer| writer.write_image_data(&rgb));
        if let Err(e) = result {
            panic!("png encode: {e}");
        }
    }
    out
}

const WORDS: &[&str] = &[
    "the",
    "router",
    "sends",
    "each",
    "request",
    "to",
    "a",
    "worker",
    "that",
    "already",
    "holds",
    "its",
    "prefix",
    "cache",
    "blocks",
    "image",
    "tokens",
    "model",
    "prompt",
    "of",
    "and",
    "in",
    "for",
    "with",
    "latency",
    "throughput",
    "describe",
    "picture",
    "what",
    "is",
    "shown",
    "here",
    "please",
    "answer",
    "briefly",
    "configuration",
    "deployment",
    "cluster",
    "kernel",
    "memory",
];

/// Pseudo-English of about `bytes` bytes: words, numbers and punctuation.
fn prose(rng: &mut Rng, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 16);
    while s.len() < bytes {
        if !s.is_empty() {
            s.push(' ');
        }
        match rng.below(20) {
            0 => s.push_str(&rng.below(100_000).to_string()),
            1 => s.push_str("vLLM,"),
            2 => s.push_str("(KV)."),
            _ => s.push_str(WORDS[rng.below(WORDS.len() as u64) as usize]),
        }
        if rng.below(12) == 0 {
            s.push('.');
        }
    }
    s
}

fn json_string(s: &str) -> String {
    match serde_json::to_string(s) {
        Ok(v) => v,
        Err(e) => panic!("json: {e}"),
    }
}

/// A chat body: a system prompt, `turns` user/assistant exchanges of prose, and a last user
/// message with the images (as data URLs) followed by a question.
fn chat_body(seed: u64, text_bytes: usize, turns: usize, images: &[Image]) -> Vec<u8> {
    let mut rng = Rng(seed | 1);
    let per_message = text_bytes / (2 * turns + 2);
    let mut messages = vec![format!(
        r#"{{"role":"system","content":{}}}"#,
        json_string(&prose(&mut rng, per_message))
    )];
    for _ in 0..turns {
        for role in ["user", "assistant"] {
            messages.push(format!(
                r#"{{"role":"{role}","content":{}}}"#,
                json_string(&prose(&mut rng, per_message))
            ));
        }
    }
    let mut parts: Vec<String> = images
        .iter()
        .map(|im| {
            format!(
                r#"{{"type":"image_url","image_url":{{"url":"data:{};base64,{}"}}}}"#,
                im.mime, im.base64
            )
        })
        .collect();
    parts.push(format!(
        r#"{{"type":"text","text":{}}}"#,
        json_string(&prose(&mut rng, per_message))
    ));
    messages.push(format!(
        r#"{{"role":"user","content":[{}]}}"#,
        parts.join(",")
    ));
    format!(
        r#"{{"model":"{MODEL}","stream":true,"max_tokens":256,"messages":[{}]}}"#,
        messages.join(",")
    )
    .into_bytes()
}

fn image(mime: &'static str, width: u32, height: u32, file: Vec<u8>) -> Image {
    let base64 = base64::engine::general_purpose::STANDARD.encode(&file);
    Image {
        mime,
        width,
        height,
        file,
        base64,
    }
}

/// Checks a file's size against its nominal size (±15%) and its header against its size.
fn check(im: &Image, nominal: usize) {
    let lo = nominal * 85 / 100;
    let hi = nominal * 115 / 100;
    assert!(
        (lo..=hi).contains(&im.file.len()),
        "{} {}x{}: {} bytes, wanted about {nominal}",
        im.mime,
        im.width,
        im.height,
        im.file.len()
    );
    let info = match mmrouter::image_header::read_image_header(&im.file) {
        Ok(i) => i,
        Err(e) => panic!("{}: {e}", im.mime),
    };
    assert_eq!((info.width, info.height), (im.width, im.height));
}

/// The three cases:
/// - `text_8k`: a text-only chat of about 8 KiB (system prompt, 3 exchanges, a question);
/// - `jpeg_1m`: one 1920×1080 JPEG of about 1 MiB and a short question;
/// - `mixed_4x256k`: four images of about 256 KiB (PNG 512×384, JPEG 1024×768, PNG, JPEG).
pub fn cases() -> Vec<Case> {
    let text = chat_body(1, 8 << 10, 3, &[]);
    let big = vec![image("image/jpeg", 1920, 1080, jpeg(1920, 1080, 2, 34))];
    check(&big[0], 1 << 20);
    let mixed = vec![
        image("image/png", 512, 384, png(512, 384, 3, 16)),
        image("image/jpeg", 1024, 768, jpeg(1024, 768, 4, 13)),
        image("image/png", 512, 384, png(512, 384, 5, 16)),
        image("image/jpeg", 1024, 768, jpeg(1024, 768, 6, 13)),
    ];
    for im in &mixed {
        check(im, 256 << 10);
    }
    vec![
        Case {
            name: "text_8k",
            body: text,
            images: Vec::new(),
        },
        Case {
            name: "jpeg_1m",
            body: chat_body(7, 256, 0, &big),
            images: big,
        },
        Case {
            name: "mixed_4x256k",
            body: chat_body(8, 256, 0, &mixed),
            images: mixed,
        },
    ]
}
