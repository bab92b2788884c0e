//! The streaming scanner against the pipeline it replaced: for generated chat and completion
//! bodies (text with escapes and unicode, images of every fixture format as data URLs in many
//! spellings, URLs, uuids, salts, random key order, random extra fields) and for every fixture,
//! the new `analyze` equals the old one (media reports and layout), whole and cut into pieces.
//! Where the new behaviour differs on purpose (parts skipped instead of failing the body, part
//! shapes the old parser did not know), the new behaviour is tested on its own.

#[path = "support/reference_analysis.rs"]
mod reference;
#[path = "support/reference_image_header.rs"]
mod reference_header;
#[path = "../src/bin/mock_worker/request.rs"]
mod reference_request;

use base64::Engine as _;
use mmrouter::analysis::{Analysis, AnalyzeError, Analyzer, analyze};
use mmrouter::config::RouterConfig;
use mmrouter::identity::MediaId;
use mmrouter::request::{Limits, MediaKind, RequestError};
use mmrouter::scan::{BodyScanner, MediaContent, SkipReason, scan};
use proptest::prelude::*;
use reference::OldAnalysis;
use std::path::PathBuf;
use std::sync::OnceLock;

// ------------------------------------------------------------------ fixtures and comparison

fn fixtures() -> &'static [(String, Vec<u8>)] {
    static ALL: OnceLock<Vec<(String, Vec<u8>)>> = OnceLock::new();
    ALL.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/images");
        let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e != "json"))
            .map(|p| {
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                (name, std::fs::read(&p).unwrap())
            })
            .collect();
        out.sort();
        assert!(out.len() >= 20);
        out
    })
}

fn config() -> RouterConfig {
    RouterConfig::default()
}

fn same(old: &OldAnalysis, new: &Analysis) -> bool {
    old.model == new.model
        && old.profile == new.profile
        && old.stream == new.stream
        && old.media == new.media
        && old.layout == new.layout
        && new.skipped_count == 0
        && new.sites.len() == new.media.len()
}

/// The analyzer fed `body` cut at `cuts`.
fn in_pieces(body: &[u8], cuts: &[usize]) -> Result<Analysis, AnalyzeError> {
    let config = config();
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
    cuts.sort_unstable();
    let mut a = Analyzer::new(&config);
    let mut from = 0;
    for c in cuts {
        a.feed(&body[from..c])?;
        from = c;
    }
    a.feed(&body[from..])?;
    a.finish(&config)
}

fn byte_by_byte(body: &[u8]) -> Result<Analysis, AnalyzeError> {
    let config = config();
    let mut a = Analyzer::new(&config);
    for b in body.chunks(1) {
        a.feed(b)?;
    }
    a.finish(&config)
}

/// The new analysis whole, cut at `cuts`, and byte by byte must agree exactly.
fn new_analysis(body: &[u8], cuts: &[usize]) -> Result<Analysis, AnalyzeError> {
    let whole = analyze(body, &config());
    assert_eq!(in_pieces(body, cuts), whole, "cut at {cuts:?}");
    if body.len() <= 64 * 1024 {
        assert_eq!(byte_by_byte(body), whole, "byte by byte");
    }
    whole
}

/// A body both pipelines must read alike: the same analysis, or the same error. Media errors
/// must be equal values (same item, same message); request errors the same reason.
fn assert_equivalent(body: &[u8], cuts: &[usize]) {
    let old = reference::analyze(body, &config());
    let new = new_analysis(body, cuts);
    match (&old, &new) {
        (Ok(o), Ok(n)) => assert!(same(o, n), "{}\nold {o:#?}\nnew {n:#?}", show(body)),
        (Err(o @ AnalyzeError::Media { .. }), Err(n)) => assert_eq!(o, n, "{}", show(body)),
        (Err(o), Err(n)) => assert_eq!(o.reason(), n.reason(), "{}\nold {o}\nnew {n}", show(body)),
        _ => panic!("{}\nold {old:?}\nnew {new:?}", show(body)),
    }
}

fn show(body: &[u8]) -> String {
    let s = String::from_utf8_lossy(body);
    if s.len() > 3000 {
        format!("{}…", &s[..s.floor_char_boundary(3000)])
    } else {
        s.into_owned()
    }
}

// ------------------------------------------------------------------ rendering JSON with noise

/// A small deterministic generator for rendering choices (escapes, white space, key order).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }
}

/// A JSON value to render. Strings carry how eagerly to escape them (1 in `escape` characters;
/// 0 = only what must be escaped).
#[derive(Debug, Clone)]
enum J {
    Null,
    Bool(bool),
    /// Number text, written as is.
    Num(String),
    Str(String, u64),
    /// Raw bytes inside quotes (invalid UTF-8 for skipped fields).
    RawStr(Vec<u8>),
    Arr(Vec<J>),
    Obj(Vec<(String, J)>),
}

fn s(text: &str) -> J {
    J::Str(text.to_string(), 0)
}

fn ws(out: &mut Vec<u8>, rng: &mut Rng) {
    if rng.one_in(3) {
        for _ in 0..rng.below(3) {
            out.push([b' ', b'\n', b'\t', b'\r'][rng.below(4) as usize]);
        }
    }
}

fn render_str(out: &mut Vec<u8>, text: &str, escape: u64, rng: &mut Rng) {
    out.push(b'"');
    for c in text.chars() {
        let forced = matches!(c, '"' | '\\') || (c as u32) < 0x20;
        if forced || (escape > 0 && rng.one_in(escape)) {
            match (c, rng.below(3)) {
                ('"', 0) => out.extend(b"\\\""),
                ('\\', 0) => out.extend(b"\\\\"),
                ('/', 0) => out.extend(b"\\/"),
                ('\n', 0) => out.extend(b"\\n"),
                ('\t', 0) => out.extend(b"\\t"),
                ('\r', 0) => out.extend(b"\\r"),
                ('\u{8}', 0) => out.extend(b"\\b"),
                ('\u{c}', 0) => out.extend(b"\\f"),
                _ => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        let hex = if rng.one_in(2) {
                            format!("\\u{:04x}", u)
                        } else {
                            format!("\\u{:04X}", u)
                        };
                        out.extend(hex.as_bytes());
                    }
                }
            }
        } else {
            let mut buf = [0; 4];
            out.extend(c.encode_utf8(&mut buf).as_bytes());
        }
    }
    out.push(b'"');
}

fn render(j: &J, out: &mut Vec<u8>, rng: &mut Rng) {
    ws(out, rng);
    match j {
        J::Null => out.extend(b"null"),
        J::Bool(b) => out.extend(if *b { &b"true"[..] } else { b"false" }),
        J::Num(n) => out.extend(n.as_bytes()),
        J::Str(text, escape) => render_str(out, text, *escape, rng),
        J::RawStr(bytes) => {
            out.push(b'"');
            out.extend(bytes);
            out.push(b'"');
        }
        J::Arr(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    ws(out, rng);
                    out.push(b',');
                }
                render(item, out, rng);
            }
            ws(out, rng);
            out.push(b']');
        }
        J::Obj(fields) => {
            // Keys in random order.
            let mut order: Vec<usize> = (0..fields.len()).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
            out.push(b'{');
            for (n, &i) in order.iter().enumerate() {
                let (k, v) = &fields[i];
                if n > 0 {
                    ws(out, rng);
                    out.push(b',');
                }
                ws(out, rng);
                render_str(out, k, 8, rng);
                ws(out, rng);
                out.push(b':');
                render(v, out, rng);
            }
            ws(out, rng);
            out.push(b'}');
        }
    }
    ws(out, rng);
}

fn rendered(j: &J, seed: u64) -> Vec<u8> {
    let mut out = Vec::new();
    render(j, &mut out, &mut Rng(seed));
    out
}

// ------------------------------------------------------------------ body strategies

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z ]{0,40}",
        "[ -~]{0,30}",
        Just("The quick brown fox jumps over the lazy dog. 12345 \"quoted\" \\slash\\".into()),
        Just("日本語のテキスト、絵文字 🦀🎉 and Ünïcödé\n\ttabs\u{1}\u{1f}".into()),
        Just(String::new()),
        "\\PC{0,20}",
    ]
}

/// Extra JSON that routing ignores. `strict` extras (inside content parts) stay valid for the
/// old parser; lax ones (body and message level) may hold what serde_json's IgnoredAny skipped
/// without checking: lone surrogates, invalid UTF-8, numbers out of range.
fn extra_value(strict: bool) -> impl Strategy<Value = J> {
    let leaf = prop_oneof![
        Just(J::Null),
        any::<bool>().prop_map(J::Bool),
        prop_oneof![
            Just("0"),
            Just("-0"),
            Just("12"),
            Just("-3.5e-7"),
            Just("1E+2"),
            Just("0.25"),
            Just("18446744073709551616"),
            Just("1.7976931348623157e308"),
            Just("123456789012345678901234567890"),
        ]
        .prop_map(|n| J::Num(n.to_string())),
        (text(), 0..6u64).prop_map(|(t, e)| J::Str(t, e)),
    ];
    let lax_leaf = prop_oneof![
        Just(J::Num("1e400".into())),
        Just(J::RawStr(b"\xff\xfe bad utf8".to_vec())),
        Just(J::RawStr(b"lone \\ud800 surrogate".to_vec())),
    ];
    let leaf = if strict {
        leaf.boxed()
    } else {
        prop_oneof![8 => leaf, 1 => lax_leaf].boxed()
    };
    leaf.prop_recursive(3, 12, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(J::Arr),
            prop::collection::vec(("[a-z_]{1,8}", inner), 0..4).prop_map(|kv| { J::Obj(kv) }),
        ]
    })
}

/// Extra keys that none of the scanner's objects knows.
fn extras(strict: bool) -> impl Strategy<Value = Vec<(String, J)>> {
    prop::collection::vec(
        (
            prop_oneof![
                Just("detail".to_string()),
                Just("cache_control".to_string()),
                Just("x_extra".to_string()),
                Just("metadata".to_string()),
            ],
            extra_value(strict),
        ),
        0..2,
    )
    .prop_map(|mut v| {
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v.dedup_by(|a, b| a.0 == b.0);
        v
    })
}

/// How an image's bytes are written as a data URL.
#[derive(Debug, Clone)]
struct Spelling {
    prefix: &'static str,
    url_safe: bool,
    pad: bool,
    wrap: Option<(usize, &'static str)>,
    escape: u64,
}

fn spelling() -> impl Strategy<Value = Spelling> {
    (
        prop_oneof![
            Just("data:image/png;base64,"),
            Just("data:image/jpeg;base64,"),
            Just("DATA:image/webp;BASE64,"),
            Just("data:;base64,"),
            Just("data:base64,"),
            Just("data:image/gif;charset=utf-8;base64,"),
            Just("data:image/png; base64 ,"),
            Just("data:application/octet-stream;base64,"),
        ],
        any::<bool>(),
        any::<bool>(),
        prop_oneof![
            4 => Just(None),
            1 => Just(Some((76, "\r\n"))),
            1 => Just(Some((64, "\n"))),
            1 => Just(Some((7, " "))),
        ],
        prop_oneof![3 => Just(0u64), 1 => Just(40u64), 1 => Just(3u64)],
    )
        .prop_map(|(prefix, url_safe, pad, wrap, escape)| Spelling {
            prefix,
            url_safe,
            pad,
            wrap,
            escape,
        })
}

fn data_url(bytes: &[u8], sp: &Spelling) -> J {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    let b64 = match (sp.url_safe, sp.pad) {
        (false, true) => STANDARD.encode(bytes),
        (false, false) => STANDARD_NO_PAD.encode(bytes),
        (true, true) => URL_SAFE.encode(bytes),
        (true, false) => URL_SAFE_NO_PAD.encode(bytes),
    };
    let b64 = match sp.wrap {
        Some((every, sep)) => b64
            .as_bytes()
            .chunks(every)
            .map(|c| std::str::from_utf8(c).unwrap())
            .collect::<Vec<_>>()
            .join(sep),
        None => b64,
    };
    J::Str(format!("{}{b64}", sp.prefix), sp.escape)
}

/// The bytes of an image part: a fixture, a cut or damaged fixture, or not an image.
fn image_bytes() -> impl Strategy<Value = Vec<u8>> {
    let n = fixtures().len();
    prop_oneof![
        8 => (0..n).prop_map(|i| fixtures()[i].1.clone()),
        1 => (0..n, any::<prop::sample::Index>())
            .prop_map(|(i, cut)| {
                let b = &fixtures()[i].1;
                b[..cut.index(b.len())].to_vec()
            }),
        1 => (0..n, any::<prop::sample::Index>(), any::<u8>()).prop_map(|(i, at, v)| {
            let mut b = fixtures()[i].1.clone();
            let at = at.index(b.len());
            b[at] = v;
            b
        }),
        1 => prop::collection::vec(any::<u8>(), 0..40),
    ]
}

fn media_payload(image: bool) -> impl Strategy<Value = J> {
    let inline = (
        if image {
            image_bytes().boxed()
        } else {
            prop::collection::vec(any::<u8>(), 0..300).boxed()
        },
        spelling(),
    )
        .prop_map(|(b, sp)| data_url(&b, &sp));
    prop_oneof![
        6 => inline,
        2 => prop_oneof![
            Just("https://example.com/cat.png"),
            Just("HTTPS://Example.COM:443/a/b.jpg?x=1#frag"),
            Just("http://10.0.0.1:8080/img"),
            Just("data"),
        ]
        .prop_map(s),
        1 => prop_oneof![
            Just("data:image/png,iVBORw0KGgo="),
            Just("data:image/png;base64,"),
            Just("data:image/png;base64,ab$d"),
            Just("data:image/png;base64,QQ==QUJD"),
            Just("data:image/png;base64, \n"),
            Just("data:nocomma"),
        ]
        .prop_map(s),
    ]
}

fn uuid() -> impl Strategy<Value = Option<J>> {
    prop_oneof![
        3 => Just(None),
        1 => "[a-f0-9-]{1,36}".prop_map(|u| Some(s(&u))),
        1 => Just(Some(J::Null)),
    ]
}

/// A content part the old parser understood.
fn part() -> impl Strategy<Value = J> {
    let text_part = (
        prop_oneof![Just("text"), Just("input_text")],
        text(),
        0..5u64,
        extras(true),
    )
        .prop_map(|(ty, t, e, mut x)| {
            x.push(("type".into(), s(ty)));
            x.push(("text".into(), J::Str(t, e)));
            J::Obj(x)
        });
    let image = (
        prop_oneof![Just("image_url"), Just("input_image")],
        media_payload(true),
        any::<bool>(),
        uuid(),
        extras(true),
    )
        .prop_map(|(ty, url, bare, uuid, mut x)| {
            let value = if bare {
                url
            } else {
                J::Obj(vec![("url".into(), url), ("detail".into(), s("high"))])
            };
            x.push(("type".into(), s(ty)));
            x.push(("image_url".into(), value));
            if let Some(u) = uuid {
                x.push(("uuid".into(), u));
            }
            J::Obj(x)
        });
    let other = (
        prop_oneof![Just("video_url"), Just("audio_url")],
        media_payload(false),
        any::<bool>(),
        uuid(),
    )
        .prop_map(|(ty, url, bare, uuid)| {
            let value = if bare {
                url
            } else {
                J::Obj(vec![("url".into(), url)])
            };
            let mut x = vec![("type".to_string(), s(ty)), (ty.to_string(), value)];
            if let Some(u) = uuid {
                x.push(("uuid".into(), u));
            }
            J::Obj(x)
        });
    let audio = (prop::collection::vec(any::<u8>(), 1..200), uuid()).prop_map(|(b, uuid)| {
        let data = base64::engine::general_purpose::STANDARD.encode(b);
        let mut x = vec![
            ("type".to_string(), s("input_audio")),
            (
                "input_audio".to_string(),
                J::Obj(vec![("data".into(), s(&data)), ("format".into(), s("wav"))]),
            ),
        ];
        if let Some(u) = uuid {
            x.push(("uuid".into(), u));
        }
        J::Obj(x)
    });
    prop_oneof![4 => text_part, 4 => image, 1 => other, 1 => audio]
}

fn message() -> impl Strategy<Value = J> {
    let role = prop_oneof![
        Just(Some(s("user"))),
        Just(Some(s("system"))),
        Just(Some(s("assistant"))),
        Just(Some(J::Str("tool ✓".into(), 2))),
        Just(Some(J::Null)),
        Just(None),
    ];
    let content = prop_oneof![
        2 => (text(), 0..5u64).prop_map(|(t, e)| Some(J::Str(t, e))),
        5 => prop::collection::vec(part(), 0..4).prop_map(|p| Some(J::Arr(p))),
        1 => Just(Some(J::Null)),
        1 => Just(None),
    ];
    (role, content, extras(false)).prop_map(|(role, content, mut x)| {
        if let Some(r) = role {
            x.push(("role".into(), r));
        }
        if let Some(c) = content {
            x.push(("content".into(), c));
        }
        J::Obj(x)
    })
}

fn model() -> impl Strategy<Value = J> {
    prop_oneof![
        Just(s("Qwen/Qwen2.5-VL-7B-Instruct")),
        Just(s("qwen3-vl-8b")),
        Just(s("google/gemma-3-4b-it")),
        Just(s("llava-hf/llava-1.5-7b-hf")),
        Just(J::Str("m\\odel/with \"quotes\" ✓".into(), 3)),
        "[a-z0-9/._-]{0,20}".prop_map(|m| J::Str(m, 4)),
    ]
}

fn common() -> impl Strategy<Value = Vec<(String, J)>> {
    (
        prop_oneof![
            2 => Just(None),
            1 => (text(), 0..4u64).prop_map(|(t, e)| Some(J::Str(t, e))),
            1 => Just(Some(J::Null)),
        ],
        prop_oneof![
            Just(None),
            Just(Some(J::Bool(true))),
            Just(Some(J::Bool(false))),
            Just(Some(J::Null))
        ],
        prop::collection::vec(
            (
                prop_oneof![
                    Just("temperature".to_string()),
                    Just("max_tokens".to_string()),
                    Just("tools".to_string()),
                    Just("stream_options".to_string()),
                ],
                extra_value(false),
            ),
            0..3,
        ),
    )
        .prop_map(|(salt, stream, mut x)| {
            x.sort_by(|a, b| a.0.cmp(&b.0));
            x.dedup_by(|a, b| a.0 == b.0);
            if let Some(v) = salt {
                x.push(("cache_salt".into(), v));
            }
            if let Some(v) = stream {
                x.push(("stream".into(), v));
            }
            x
        })
}

fn chat_body() -> impl Strategy<Value = J> {
    (model(), prop::collection::vec(message(), 0..4), common()).prop_map(|(m, msgs, mut x)| {
        x.push(("model".into(), m));
        x.push(("messages".into(), J::Arr(msgs)));
        J::Obj(x)
    })
}

fn completion_body() -> impl Strategy<Value = J> {
    let prompt = prop_oneof![
        (text(), 0..4u64).prop_map(|(t, e)| J::Str(t, e)),
        prop::collection::vec((text(), 0..4u64).prop_map(|(t, e)| J::Str(t, e)), 0..4)
            .prop_map(J::Arr),
        prop::collection::vec(any::<u64>().prop_map(|n| J::Num(n.to_string())), 0..8)
            .prop_map(J::Arr),
        // Not a prompt the old parser accepted: mixed, signed, fractional.
        Just(J::Arr(vec![J::Num("1".into()), s("a")])),
        Just(J::Arr(vec![J::Num("-1".into())])),
        Just(J::Arr(vec![J::Num("1.0".into())])),
        Just(J::Arr(vec![J::Num("18446744073709551616".into())])),
    ];
    (model(), prompt, common()).prop_map(|(m, p, mut x)| {
        x.push(("model".into(), m));
        x.push(("prompt".into(), p));
        J::Obj(x)
    })
}

fn body() -> impl Strategy<Value = (J, u64)> {
    (
        prop_oneof![4 => chat_body(), 1 => completion_body()],
        any::<u64>(),
    )
}

fn cases(default: u32) -> ProptestConfig {
    ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default),
    )
}

proptest! {
    #![proptest_config(cases(256))]

    #[test]
    fn generated_bodies_analyse_as_the_old_pipeline_whole_and_in_pieces(
        (body, seed) in body(),
        cuts in prop::collection::vec(any::<usize>(), 0..8),
    ) {
        assert_equivalent(&rendered(&body, seed), &cuts);
    }

    #[test]
    fn damaged_bodies_fail_as_the_old_pipeline_failed(
        (body, seed) in body(),
        damage in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0..3u8), 1..4),
        cuts in prop::collection::vec(any::<usize>(), 0..4),
    ) {
        let mut bytes = rendered(&body, seed);
        for (at, v, how) in &damage {
            if bytes.is_empty() {
                break;
            }
            let i = at.index(bytes.len());
            match how {
                0 => bytes[i] = *v,
                1 => { bytes.insert(i, *v); }
                _ => { bytes.truncate(i); }
            }
        }
        let old = reference::analyze(&bytes, &config());
        let new = new_analysis(&bytes, &cuts);
        match (&old, &new) {
            (Ok(o), Ok(n)) => prop_assert!(same(o, n), "{}", show(&bytes)),
            // Parts the old parser refused are skipped now: anything may follow.
            (Err(o), _) if matches!(o.reason(), "bad_request" | "bad_shape") => {}
            // An array where a struct goes: serde read it positionally (`[]` is a message with
            // no fields) and found the syntax error after it; the scanner refuses the array.
            (Err(o), Err(n))
                if o.reason() == "bad_json" && n.to_string().contains("invalid type: sequence") => {}
            (Err(o @ AnalyzeError::Media { .. }), Err(n)) => prop_assert_eq!(o, n),
            (Err(o), Err(n)) => prop_assert_eq!(o.reason(), n.reason(), "{}\nold {}\nnew {}", show(&bytes), o, n),
            _ => prop_assert!(false, "{}\nold {:?}\nnew {:?}", show(&bytes), old, new),
        }
    }
}

#[test]
fn every_fixture_in_every_spelling_analyses_as_the_old_pipeline() {
    let spellings = [
        ("data:image/png;base64,", false, true, None, 0),
        ("DATA:image/jpeg;BASE64,", true, false, None, 0),
        ("data:;base64,", false, true, Some((76, "\r\n")), 0),
        ("data:image/png; base64 ,", false, false, Some((5, " ")), 3),
        ("data:base64,", true, true, Some((60, "\n")), 50),
    ];
    for (name, bytes) in fixtures() {
        for (k, &(prefix, url_safe, pad, wrap, escape)) in spellings.iter().enumerate() {
            let sp = Spelling {
                prefix,
                url_safe,
                pad,
                wrap,
                escape,
            };
            let body = J::Obj(vec![
                ("model".into(), s("Qwen/Qwen2.5-VL-7B-Instruct")),
                (
                    "messages".into(),
                    J::Arr(vec![J::Obj(vec![
                        ("role".into(), s("user")),
                        (
                            "content".into(),
                            J::Arr(vec![
                                J::Obj(vec![("type".into(), s("text")), ("text".into(), s(name))]),
                                J::Obj(vec![
                                    ("type".into(), s("image_url")),
                                    (
                                        "image_url".into(),
                                        J::Obj(vec![("url".into(), data_url(bytes, &sp))]),
                                    ),
                                ]),
                            ]),
                        ),
                    ])]),
                ),
            ]);
            let body = rendered(&body, k as u64);
            assert_equivalent(&body, &[body.len() / 3, body.len() / 2]);
            let a = analyze(&body, &config()).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(a.media[0].id, MediaId::of_bytes(bytes), "{name}");
        }
    }
}

#[test]
fn every_truncation_of_a_fixture_body_fails_or_reads_as_the_old_pipeline() {
    let (_, png) = &fixtures()[fixtures()
        .iter()
        .position(|(n, _)| n.starts_with("png_exif"))
        .unwrap()];
    let b64 = base64::engine::general_purpose::STANDARD.encode(png);
    let body = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"a\u00e9b"}},{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{b64}"}},"uuid":"u1"}}]}}],"stream":true}}"#
    );
    let body = body.as_bytes();
    for cut in 0..=body.len() {
        assert_equivalent(&body[..cut], &[cut / 2]);
    }
}

// ------------------------------------------------------------------ new behaviour, on purpose

fn chat(parts: &str) -> Vec<u8> {
    format!(r#"{{"model":"m","messages":[{{"role":"user","content":[{parts}]}}]}}"#).into_bytes()
}

const PNG_PART: &str = r#"{"type":"image_url","image_url":{"url":"https://example.com/a.png"}}"#;

#[test]
fn an_unknown_part_is_skipped_and_counted_and_the_rest_keeps_its_keys() {
    let with = chat(&format!(
        r#"{{"type":"text","text":"look"}},{{"type":"hologram","hologram":{{"x":1}}}},{PNG_PART},{{"type":"image_url"}}"#
    ));
    let without = chat(&format!(r#"{{"type":"text","text":"look"}},{PNG_PART}"#));
    assert!(
        reference::analyze(&with, &config()).is_err(),
        "the old parser refused it"
    );
    let new = analyze(&with, &config()).unwrap();
    let old = reference::analyze(&without, &config()).unwrap();
    assert_eq!(new.media, old.media);
    assert_eq!(new.layout, old.layout);
    assert_eq!(new.skipped_count, 2);
    assert_eq!(
        new.skipped
            .iter()
            .map(|p| (p.message, p.part, p.reason.clone()))
            .collect::<Vec<_>>(),
        vec![
            (0, 1, SkipReason::UnsupportedType("hologram".into())),
            (0, 3, SkipReason::MissingField("image_url")),
        ]
    );
    assert_eq!(
        new.skipped[0].to_string(),
        "message 0, part 1: unsupported content part type `hologram`"
    );
}

#[test]
fn malformed_parts_are_skipped_with_their_reason() {
    let cases: &[(&str, SkipReason)] = &[
        (r#"{"text":"no type"}"#, SkipReason::MissingType),
        (r#"{"type":7,"text":"x"}"#, SkipReason::TypeNotString),
        (r#"{"type":"text","text":5}"#, SkipReason::BadField("text")),
        (r#"{"type":"text"}"#, SkipReason::MissingField("text")),
        (
            r#"{"type":"text","text":null}"#,
            SkipReason::MissingField("text"),
        ),
        (
            r#"{"type":"image_url","image_url":5}"#,
            SkipReason::BadField("image_url"),
        ),
        (
            r#"{"type":"image_url","image_url":["a"]}"#,
            SkipReason::BadField("image_url"),
        ),
        (
            r#"{"type":"image_url","image_url":{"url":"a","url":"b"}}"#,
            SkipReason::BadField("image_url"),
        ),
        (
            r#"{"type":"image_url","image_url":"a","image_url":"b"}"#,
            SkipReason::BadField("image_url"),
        ),
        (
            r#"{"type":"image_url","image_url":"a","uuid":3}"#,
            SkipReason::BadField("uuid"),
        ),
        (
            r#"{"type":"input_audio","input_audio":"AAAA"}"#,
            SkipReason::BadField("input_audio"),
        ),
        (
            r#"{"type":"image_pil","image_pil":{}}"#,
            SkipReason::MissingField("uuid"),
        ),
        (
            r#"{"type":"prompt_embeds","data":"AAAA"}"#,
            SkipReason::UnsupportedType("prompt_embeds".into()),
        ),
        (
            r#"{"prompt_embeds":"AAAA"}"#,
            SkipReason::UnsupportedType("prompt_embeds".into()),
        ),
        (r#"{"type":""}"#, SkipReason::UnsupportedType(String::new())),
        (r#"42"#, SkipReason::NotAnObject),
        (r#"null"#, SkipReason::NotAnObject),
        (r#"[{"type":"text","text":"x"}]"#, SkipReason::NotAnObject),
    ];
    for (part, reason) in cases {
        let a = analyze(&chat(&format!(r#"{part},{PNG_PART}"#)), &config())
            .unwrap_or_else(|e| panic!("{part}: {e}"));
        assert_eq!(a.skipped_count, 1, "{part}");
        assert_eq!(&a.skipped[0].reason, reason, "{part}");
        assert_eq!(a.media.len(), 1, "{part}");
    }
    let long = format!(r#"{{"type":"{}"}}"#, "é".repeat(100));
    let a = analyze(&chat(&long), &config()).unwrap();
    let SkipReason::UnsupportedType(kept) = &a.skipped[0].reason else {
        panic!()
    };
    assert!(kept.len() <= mmrouter::scan::MAX_TYPE_KEPT && kept.starts_with("éé"));
}

#[test]
fn part_shapes_the_old_parser_refused_read_as_their_spelled_out_equivalents() {
    // (new-only spelling, the spelling the old parser read)
    let pairs: &[(&str, &str)] = &[
        (
            r#""a bare string part""#,
            r#"{"type":"text","text":"a bare string part"}"#,
        ),
        (
            r#"{"type":"output_text","text":"o"}"#,
            r#"{"type":"text","text":"o"}"#,
        ),
        (
            r#"{"type":"thinking","thinking":"hmm","closed":true}"#,
            r#"{"type":"text","text":"hmm"}"#,
        ),
        (
            r#"{"type":"refusal","refusal":"no"}"#,
            r#"{"type":"text","text":"no"}"#,
        ),
        (
            r#"{"type":"tool_reference","name":"get_weather"}"#,
            r#"{"type":"text","text":"get_weather"}"#,
        ),
        (
            r#"{"image_url":{"url":"https://e.com/x.png"}}"#,
            r#"{"type":"image_url","image_url":{"url":"https://e.com/x.png"}}"#,
        ),
        (
            r#"{"video_url":"https://e.com/v.mp4"}"#,
            r#"{"type":"video_url","video_url":"https://e.com/v.mp4"}"#,
        ),
        (
            r#"{"input_audio":{"data":"AAAA"}}"#,
            r#"{"type":"input_audio","input_audio":{"data":"AAAA"}}"#,
        ),
    ];
    for (new_spelling, old_spelling) in pairs {
        let new = analyze(&chat(new_spelling), &config())
            .unwrap_or_else(|e| panic!("{new_spelling}: {e}"));
        let old = reference::analyze(&chat(old_spelling), &config()).unwrap();
        assert!(same(&old, &new), "{new_spelling}");
    }
}

#[test]
fn embeds_and_uuid_only_parts_are_media_items() {
    let body = chat(concat!(
        r#"{"type":"image_embeds","image_embeds":"QUJD","uuid":null},"#,
        r#"{"type":"audio_embeds","audio_embeds":{"a": [1, 2.5]}},"#,
        r#"{"type":"image_url","image_url":null,"uuid":"cached-1"},"#,
        r#"{"image_pil":null,"uuid":"cached-2"},"#,
        r#"{"type":"video_url","uuid":"cached-3"}"#
    ));
    let a = analyze(&body, &config()).unwrap();
    let kinds: Vec<MediaKind> = a.media.iter().map(|m| m.kind).collect();
    assert_eq!(
        kinds,
        [
            MediaKind::Embeds,
            MediaKind::Embeds,
            MediaKind::Image,
            MediaKind::Image,
            MediaKind::Video
        ]
    );
    // Embeds: xxh3-128 of the value's JSON text as written.
    assert_eq!(a.media[0].id, MediaId::of_bytes(br#""QUJD""#));
    assert_eq!(a.media[1].id, MediaId::of_bytes(br#"{"a": [1, 2.5]}"#));
    assert_eq!(a.media[0].tokens.tokens, config().media.embeds_tokens);
    assert_eq!(a.media[2].id, MediaId::of_uuid("cached-1"));
    assert_eq!(a.media[3].id, MediaId::of_uuid("cached-2"));
    assert_eq!(a.media[4].id, MediaId::of_uuid("cached-3"));
    // An image whose bytes were not seen costs what a URL image costs.
    let url = analyze(&chat(PNG_PART), &config()).unwrap();
    assert_eq!(a.media[2].tokens, url.media[0].tokens);
    assert_eq!(a.media[4].tokens.tokens, config().media.video_tokens);
    assert_eq!(a.skipped_count, 0);
}

#[test]
fn media_sites_point_just_after_each_part_opening_brace() {
    let body = chat(concat!(
        r#"{"type":"text","text":"{not a part}"},"#,
        r#" { "type":"image_url","image_url":"https://e.com/1.png"},"#,
        r#"{"uuid":"u","type":"image_url","image_url":"https://e.com/2.png"}"#
    ));
    let a = analyze(&body, &config()).unwrap();
    assert_eq!(a.sites.len(), 2);
    for (site, has_uuid) in a.sites.iter().zip([false, true]) {
        assert_eq!(body[site.offset - 1], b'{');
        assert!(
            body[site.offset..].starts_with(br#" "type":"image_url""#)
                || body[site.offset..].starts_with(br#""uuid":"u""#)
        );
        assert_eq!(site.has_uuid, has_uuid);
    }
    // Stamping a uuid at the site gives a body whose item is identified by it.
    let site = a.sites[0];
    let mut stamped = body[..site.offset].to_vec();
    stamped.extend(br#""uuid":"stamped","#);
    stamped.extend(&body[site.offset..]);
    let b = analyze(&stamped, &config()).unwrap();
    assert_eq!(b.media[0].id, MediaId::of_uuid("stamped"));
    assert_eq!(b.media[1].id, a.media[1].id);
}

#[test]
fn arrays_where_the_old_structs_took_a_sequence_are_shape_errors() {
    // serde reads a struct from a JSON array positionally; no client sends one.
    for body in [
        &br#"["m", []]"#[..],
        br#"{"model":"m","messages":[["user","hi"]]}"#,
    ] {
        assert!(reference::analyze(body, &config()).is_ok());
        assert_eq!(analyze(body, &config()).unwrap_err().reason(), "bad_shape");
    }
}

// ------------------------------------------------------------------ limits inside the pass

#[test]
fn the_body_limit_stops_the_scan_as_soon_as_it_is_crossed() {
    let limits = Limits {
        max_body_bytes: 100,
        ..Limits::default()
    };
    let mut s = BodyScanner::new(&limits);
    s.feed(&[b' '; 60]).unwrap();
    let e = s.feed(&[b' '; 60]).unwrap_err();
    assert_eq!(
        e,
        RequestError::TooLarge {
            bytes: 120,
            limit: 100
        }
    );
    // The error is final.
    assert_eq!(s.feed(b"{}").unwrap_err(), e);
    assert_eq!(s.finish().unwrap_err(), e);
}

#[test]
fn an_error_before_the_body_limit_is_the_error_however_the_body_is_cut() {
    // Invalid JSON (a raw control character in a string) at byte 20, the body over the limit
    // of 100: given whole or in pieces, the error is the invalid JSON, not "too large"
    // (found by the fuzz target `analyze`, fuzz/regressions/analyze/).
    let limits = Limits {
        max_body_bytes: 100,
        ..Limits::default()
    };
    let mut body = br#"{"model":"m","x":"ab"#.to_vec();
    body.push(0x01);
    body.extend_from_slice(&[b'a'; 150]);
    let mut whole = BodyScanner::new(&limits);
    let e = whole.feed(&body).unwrap_err();
    assert!(matches!(e, RequestError::Json(_)), "{e}");
    let mut pieces = BodyScanner::new(&limits);
    let mut first = None;
    for piece in body.chunks(7) {
        if let Err(e) = pieces.feed(piece) {
            first = Some(e);
            break;
        }
    }
    assert_eq!(first.map(|e| e.to_string()), Some(e.to_string()));
    // Without an error under the limit, crossing it is the error.
    let mut s = BodyScanner::new(&limits);
    let e = s.feed(&[b' '; 150]).unwrap_err();
    assert_eq!(
        e,
        RequestError::TooLarge {
            bytes: 150,
            limit: 100
        }
    );
}

#[test]
fn the_nesting_and_media_limits_hold_in_the_pass() {
    let limits = Limits {
        max_nesting: 5,
        max_media_items: 2,
        ..Limits::default()
    };
    let deep = br#"{"model":"m","messages":[{"content":[{"x":[[1]]}]}]}"#;
    assert_eq!(
        scan(deep, &limits).unwrap_err(),
        RequestError::TooDeep { limit: 5 }
    );
    let limits = Limits {
        max_media_items: 2,
        ..Limits::default()
    };
    let three = chat(&[PNG_PART; 3].join(","));
    let mut s = BodyScanner::new(&limits);
    // Fed up to just past the third part: the error comes before the body ends.
    let third_end = three.len() - 4;
    assert_eq!(
        s.feed(&three[..third_end]).unwrap_err(),
        RequestError::TooManyMedia { limit: 2 }
    );
    assert!(scan(&chat(&[PNG_PART; 2].join(",")), &limits).is_ok());
}

#[test]
fn no_payload_is_decoded_after_an_item_failed() {
    let good = base64::engine::general_purpose::STANDARD.encode(&fixtures()[0].1);
    let body = chat(&format!(
        r#"{{"type":"image_url","image_url":"data:image/png;base64,!!"}},{{"type":"image_url","image_url":"data:image/png;base64,{good}"}}"#
    ));
    let scanned = scan(&body, &Limits::default()).unwrap();
    assert!(matches!(scanned.media[0].content, MediaContent::Invalid(_)));
    assert_eq!(scanned.media[1].content, MediaContent::Unread);
    let e = analyze(&body, &config()).unwrap_err();
    assert!(matches!(e, AnalyzeError::Media { index: 0, .. }), "{e}");
    assert_eq!(
        Err::<(), _>(e),
        reference::analyze(&body, &config()).map(|_| ())
    );
}

#[test]
fn odd_bytes_inside_a_payload_fail_as_they_failed_before_wherever_the_body_is_cut() {
    // Raw bytes in the base64 of a data URL: JSON errors (control bytes, bad UTF-8) stay JSON
    // errors even though payload runs are checked by the base64 decoder first; valid UTF-8 is
    // a base64 error of the image.
    let b64 = base64::engine::general_purpose::STANDARD.encode(&fixtures()[3].1);
    for odd in [
        &b"\n"[..],
        b"\x01",
        b"\x7f",
        "é".as_bytes(),
        b"\xff",
        b"\xc3",
        b"\xe2\x82",
        b" ",
    ] {
        for at in [0, 1, 5, b64.len() / 2, b64.len() - 1, b64.len()] {
            let mut payload = b64.as_bytes()[..at].to_vec();
            payload.extend(odd);
            payload.extend(&b64.as_bytes()[at..]);
            let mut body = br#"{"model":"m","messages":[{"content":[{"type":"image_url","image_url":"data:image/png;base64,"#.to_vec();
            body.extend(&payload);
            body.extend(br#""}]}]}"#);
            let prefix = body.len() - payload.len() - 7;
            for cut in [prefix + at, prefix + at + 1, body.len() / 2] {
                assert_equivalent(&body, &[cut]);
            }
        }
    }
}
