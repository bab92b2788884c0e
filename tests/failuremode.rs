//! No input makes the core or the filter's router panic: in the proxy a panic kills the VM and
//! every request on it. Random bytes, random JSON, and valid requests with real images mutated
//! byte by byte all come back as a value (an analysis, or an error / fallback decision).

use base64::Engine as _;
use mmrouter::analysis::analyze;
use mmrouter::config::RouterConfig;
use mmrouter::filter::config::FilterConfig;
use mmrouter::filter::poller::Poller;
use mmrouter::filter::router::Router;
use mmrouter::state::MemoryStore;
use proptest::prelude::*;
use std::path::Path;

fn fixture(name: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/images")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A valid chat body with two real images, a URL image, audio and text.
fn valid_body() -> Vec<u8> {
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let png = b64(&fixture("png_rgb8_37x23.png"));
    let jpg = b64(&fixture("jpeg_progressive_61x35.jpg"));
    format!(
        r#"{{"model":"Qwen/Qwen2.5-VL-7B-Instruct","cache_salt":"s","messages":[
        {{"role":"system","content":"You are terse."}},
        {{"role":"user","content":[
          {{"type":"image_url","image_url":{{"url":"data:image/png;base64,{png}"}}}},
          {{"type":"text","text":"compare with"}},
          {{"type":"image_url","image_url":"data:image/jpeg;base64,{jpg}","uuid":"u-1"}},
          {{"type":"image_url","image_url":{{"url":"https://example.com/a.png?x=1"}}}},
          {{"type":"input_audio","input_audio":{{"data":"AAAA","format":"wav"}}}}]}}]}}"#
    )
    .into_bytes()
}

/// A router over two workers, with its membership written to `store` as at configuration.
fn router_in(store: &MemoryStore) -> Router {
    let r = Router::new(
        FilterConfig::from_json(
            br#"{"workers":[{"name":"a","address":"127.0.0.1:1"},{"name":"b","address":"127.0.0.1:2"}]}"#,
        )
        .expect("config"),
    );
    Poller::configure(&r, store, 0);
    r
}

#[test]
fn the_valid_body_is_valid() {
    let a = analyze(&valid_body(), &RouterConfig::default()).expect("analyses");
    assert_eq!(a.media.len(), 4);
    assert!(!a.layout.keys.is_empty());
}

/// Runs a body through the core and the filter's router; both must return.
fn exercise(body: &[u8], router: &mut Router, store: &MemoryStore) {
    let _ = analyze(body, &RouterConfig::default());
    let (decision, _) = router.route(body, store, 1_000, 7);
    let decision = decision.expect("a worker");
    assert!(decision.target.slot < 2);
    router.finished(store, &decision, 2_000, false);
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Truncate(usize),
    Insert(usize, u8),
    Delete(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Flip(i, b)),
        any::<usize>().prop_map(Mutation::Truncate),
        (
            any::<usize>(),
            prop::sample::select(b"{}[]\",:\\=/+ \n0aA".to_vec())
        )
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
        any::<usize>().prop_map(Mutation::Delete),
    ]
}

fn apply(body: &mut Vec<u8>, m: &Mutation) {
    if body.is_empty() {
        return;
    }
    let n = body.len();
    match *m {
        Mutation::Flip(i, b) => body[i % n] ^= b | 1,
        Mutation::Truncate(i) => body.truncate(i % n),
        Mutation::Insert(i, b) => body.insert(i % (n + 1), b),
        Mutation::Delete(i) => {
            body.remove(i % n);
        }
    }
}

/// Random JSON values, nested.
fn json_value() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::Bool),
        any::<i64>().prop_map(|v| serde_json::json!(v)),
        "[a-z:;,/=+ ]{0,12}".prop_map(serde_json::Value::String),
        Just(serde_json::json!("data:image/png;base64,iVBORw0KGgo=")),
        Just(serde_json::json!("image_url")),
        Just(serde_json::json!("text")),
    ];
    leaf.prop_recursive(4, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
            prop::collection::btree_map(
                prop::sample::select(vec![
                    "model",
                    "messages",
                    "role",
                    "content",
                    "type",
                    "text",
                    "image_url",
                    "url",
                    "uuid",
                    "prompt",
                    "cache_salt",
                    "input_audio",
                    "data",
                    "video_url",
                    "image_embeds",
                    "stream",
                ])
                .prop_map(str::to_string),
                inner,
                0..6
            )
            .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, .. ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(body in prop::collection::vec(any::<u8>(), 0..2048)) {
        let store = MemoryStore::default();
        exercise(&body, &mut router_in(&store), &store);
    }

    #[test]
    fn random_json_never_panics(value in json_value()) {
        let store = MemoryStore::default();
        let body = serde_json::to_vec(&value).expect("serialises");
        exercise(&body, &mut router_in(&store), &store);
    }

    #[test]
    fn mutated_valid_bodies_never_panic(mutations in prop::collection::vec(mutation(), 1..8)) {
        let mut body = valid_body();
        for m in &mutations {
            apply(&mut body, m);
        }
        let store = MemoryStore::default();
        exercise(&body, &mut router_in(&store), &store);
    }
}

#[test]
fn pathological_nesting_is_refused_without_overflowing_the_stack() {
    let deep = format!(
        r#"{{"model":"m","messages":{}{}}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let err = analyze(deep.as_bytes(), &RouterConfig::default()).expect_err("refused");
    assert_eq!(err.reason(), "bad_request");
}

#[test]
fn images_whose_headers_claim_absurd_sizes_are_answered() {
    // A PNG header claiming 2^31-1 × 1 (aspect ratio far over 200 for Qwen): an error value.
    let mut png = fixture("png_rgb8_37x23.png");
    png[16..20].copy_from_slice(&0x7fff_ffffu32.to_be_bytes());
    png[20..24].copy_from_slice(&1u32.to_be_bytes());
    let b64 = base64::engine::general_purpose::STANDARD.encode(&png);
    let body = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"image_url","image_url":"data:image/png;base64,{b64}"}}]}}]}}"#
    );
    // Either the header CRC check refuses it or the token profile does; never a panic.
    let err = analyze(body.as_bytes(), &RouterConfig::default()).expect_err("refused");
    assert!(
        matches!(err.reason(), "bad_image" | "bad_image_size"),
        "{err}"
    );
    let store = MemoryStore::default();
    let (d, _) = router_in(&store).route(body.as_bytes(), &store, 0, 0);
    assert!(d.expect("a worker").fallback.is_some());
}

#[test]
fn a_profile_without_a_cap_cannot_make_a_huge_header_lay_out_billions_of_tokens() {
    // The reproduced crash: factor:1 and a PNG claiming 65535x65535 (4.3e9 tokens).
    let config = RouterConfig::from_json(
        br#"{"profiles": {"builtin_rules": false, "default": "factor:1"}}"#,
    )
    .expect("config");
    let mut png = fixture("png_rgb8_37x23.png");
    png[16..20].copy_from_slice(&65535u32.to_be_bytes());
    png[20..24].copy_from_slice(&65535u32.to_be_bytes());
    // Fix the IHDR CRC so that only the size is absurd.
    let crc = test_images::crc32(&png[12..29]);
    png[29..33].copy_from_slice(&crc.to_be_bytes());
    let b64 = base64::engine::general_purpose::STANDARD.encode(&png);
    let body = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"image_url","image_url":"data:image/png;base64,{b64}"}}]}}]}}"#
    );
    let err = analyze(body.as_bytes(), &config).expect_err("refused");
    assert_eq!(err.reason(), "bad_image_size");
    assert!(err.to_string().contains("max_media_tokens"), "{err}");
}
