//! The WIT component (`wit/router.wit`, `src/component.rs`) in Wasmtime: every export is
//! called and compared with the native core on the same inputs (real image fixtures).
//!
//! The component is built by a cargo subprocess (`$CARGO build --lib --target wasm32-wasip2
//! --features component --profile wasm`) into `<target>/component-wasm`, where `<target>` is
//! `CARGO_TARGET_DIR` or the target directory this test binary lives in. Needs the
//! `wasm32-wasip2` rust target (`scripts/setup rust`). Run with
//! `cargo test --test component`.

use ::mmrouter::analysis::{Overrides, analyze, analyze_with, describe_image as native_describe};
use ::mmrouter::config::RouterConfig;
use ::mmrouter::report::inspect_json;
use ::mmrouter::scoring::Candidate;
use ::mmrouter::shell::{WorkerState, score as native_score};
use ::mmrouter::tokens::Profile;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use wasmtime::component::{Component, Linker, ResourceTable};
use wasmtime::{Engine, Store};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

/// The host side of `wit/router.wit` (in a module: the WIT package is also named `mmrouter`).
mod wit {
    wasmtime::component::bindgen!({
        path: "wit",
        world: "router",
    });
}

use wit::Router;
use wit::mmrouter::core::types::{
    IdSource, ImageFormat, InspectOptions, Inspection, MediaKind, Worker,
};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/images");
const IMAGES: &[&str] = &[
    "png_rgb8_37x23.png",
    "jpeg_baseline_37x23.jpg",
    "webp_lossy_37x23.webp",
    "gif_still_37x23.gif",
    "png_wide_1000x7.png",
];

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(Path::new(FIXTURES).join(name)).unwrap()
}

fn target_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(dir);
    }
    // <target>/<profile>/deps/component-<hash>
    let exe = std::env::current_exe().unwrap();
    exe.ancestors().nth(3).unwrap().to_path_buf()
}

/// Builds the component once per test binary and compiles it for Wasmtime.
fn component() -> &'static (Engine, Component) {
    static BUILT: OnceLock<(Engine, Component)> = OnceLock::new();
    BUILT.get_or_init(|| {
        let dir = target_dir().join("component-wasm");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
        let status = Command::new(cargo)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("CARGO_TARGET_DIR", &dir)
            .args([
                "build",
                "--lib",
                "--target",
                "wasm32-wasip2",
                "--features",
                "component",
                "--profile",
                "wasm",
            ])
            .status()
            .unwrap();
        assert!(status.success(), "building the component failed: {status}");
        let wasm = dir.join("wasm32-wasip2/wasm/mmrouter.wasm");
        let engine = Engine::default();
        let component = Component::from_file(&engine, &wasm).unwrap();
        (engine, component)
    })
}

struct Host {
    wasi: WasiCtx,
    table: ResourceTable,
}

impl WasiView for Host {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

fn instance() -> (Store<Host>, Router) {
    let (engine, component) = component();
    let mut linker: Linker<Host> = Linker::new(engine);
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker).unwrap();
    let mut store = Store::new(
        engine,
        Host {
            wasi: WasiCtx::builder().build(),
            table: ResourceTable::new(),
        },
    );
    let router = Router::instantiate(&mut store, component, &linker).unwrap();
    (store, router)
}

fn options() -> InspectOptions {
    InspectOptions {
        profile: None,
        model: None,
        config_json: None,
    }
}

/// The component's record written as the `mmrouter inspect` JSON, to compare with
/// `report::inspect_json`.
fn as_report(i: &Inspection) -> Value {
    let images: Vec<Value> = i
        .images
        .iter()
        .map(|m| {
            json!({
                "index": m.index,
                "kind": match m.kind {
                    MediaKind::Image => "image",
                    MediaKind::Video => "video",
                    MediaKind::Audio => "audio",
                    MediaKind::Embeds => "embeds",
                },
                "id": m.id,
                "source": match m.source {
                    IdSource::Inline => "inline",
                    IdSource::Url => "url",
                    IdSource::Uuid => "uuid",
                },
                "format": m.format.map(format_name),
                "width": m.width,
                "height": m.height,
                "tokens": m.tokens,
                "markers": m.markers,
            })
        })
        .collect();
    let blocks: Vec<Value> = i
        .blocks
        .iter()
        .map(|b| {
            let images: Vec<Value> = b
                .images
                .iter()
                .map(|o| json!({"id": o.id, "offset": o.offset}))
                .collect();
            json!({"key": format!("{:016x}", b.key), "images": images})
        })
        .collect();
    json!({
        "model": i.model,
        "profile": i.profile,
        "images": images,
        "prompt_tokens": i.prompt_tokens,
        "block_size": i.block_size,
        "blocks": blocks,
    })
}

fn format_name(f: ImageFormat) -> &'static str {
    match f {
        ImageFormat::Png => "png",
        ImageFormat::Jpeg => "jpeg",
        ImageFormat::Webp => "webp",
        ImageFormat::Gif => "gif",
    }
}

fn data_url(name: &str) -> String {
    use base64::Engine as _;
    let mime = match name.rsplit('.').next() {
        Some("png") => "image/png",
        Some("jpg") => "image/jpeg",
        Some("webp") => "image/webp",
        _ => "image/gif",
    };
    let b64 = base64::engine::general_purpose::STANDARD.encode(fixture(name));
    format!("data:{mime};base64,{b64}")
}

/// A chat body with every fixture image inline, one by URL and one with a client uuid.
fn body() -> Vec<u8> {
    let mut content: Vec<Value> = IMAGES
        .iter()
        .map(|n| json!({"type": "image_url", "image_url": {"url": data_url(n)}}))
        .collect();
    content.push(json!({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}));
    content.push(json!({"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}, "uuid": "client-id-7"}));
    content.push(json!({"type": "text", "text": "Compare all of these images, one by one, and say which is largest."}));
    serde_json::to_vec(&json!({
        "model": "Qwen/Qwen2.5-VL-7B-Instruct",
        "messages": [
            {"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": content},
        ],
    }))
    .unwrap()
}

#[test]
fn inspect_export_matches_the_native_report() {
    let (mut store, router) = instance();
    let body = body();
    let got = router
        .call_inspect(&mut store, &body, &options())
        .unwrap()
        .unwrap();
    let native = analyze(&body, &RouterConfig::default()).unwrap();
    assert_eq!(as_report(&got), inspect_json(&native));
    assert_eq!(got.images.len(), IMAGES.len() + 2);
    assert!(matches!(got.images[IMAGES.len()].source, IdSource::Url));
    assert!(matches!(
        got.images[IMAGES.len() + 1].source,
        IdSource::Uuid
    ));
    assert_eq!(got.images[IMAGES.len() + 1].id, "client-id-7");
    assert!(got.blocks.iter().any(|b| !b.images.is_empty()));
}

#[test]
fn inspect_export_honours_profile_model_and_config() {
    let (mut store, router) = instance();
    let body = body();
    let config_json = r#"{"block_size": 8}"#;
    let opts = InspectOptions {
        profile: Some("gemma3".to_string()),
        model: Some("google/gemma-3-4b-it".to_string()),
        config_json: Some(config_json.to_string()),
    };
    let got = router
        .call_inspect(&mut store, &body, &opts)
        .unwrap()
        .unwrap();
    let config = RouterConfig::from_json(config_json.as_bytes()).unwrap();
    let profile = Profile::parse("gemma3").unwrap();
    let native = analyze_with(
        &body,
        &config,
        Overrides {
            model: Some("google/gemma-3-4b-it"),
            profile: Some(&profile),
        },
    )
    .unwrap();
    assert_eq!(as_report(&got), inspect_json(&native));
    assert_eq!(got.block_size, 8);
    assert_eq!(got.model, "google/gemma-3-4b-it");
}

#[test]
fn inspect_export_returns_the_native_error_text() {
    let (mut store, router) = instance();
    let config = RouterConfig::default();
    for bad in [
        &b"{not json"[..],
        br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,aGVsbG8="}}]}]}"#,
    ] {
        let got = router.call_inspect(&mut store, bad, &options()).unwrap();
        let want = analyze(bad, &config).unwrap_err().to_string();
        assert_eq!(got.unwrap_err(), want);
    }
    let opts = InspectOptions {
        config_json: Some(r#"{"block_size": 0}"#.to_string()),
        ..options()
    };
    let e = router
        .call_inspect(&mut store, b"{}", &opts)
        .unwrap()
        .unwrap_err();
    assert!(e.contains("block_size"), "{e}");
}

#[test]
fn describe_image_export_matches_the_native_core_for_every_profile() {
    let (mut store, router) = instance();
    let profiles = router.call_profiles(&mut store).unwrap();
    assert!(profiles.iter().any(|p| p == "qwen2.5-vl"), "{profiles:?}");
    for name in IMAGES {
        let bytes = fixture(name);
        for spec in &profiles {
            let profile = Profile::parse(spec).unwrap();
            let got = router
                .call_describe_image(&mut store, &bytes, spec)
                .unwrap();
            match native_describe(&bytes, &profile) {
                Ok(want) => {
                    let got = got.unwrap();
                    assert_eq!(got.id, want.id.id, "{name}");
                    assert_eq!(Some(got.width), want.width, "{name}");
                    assert_eq!(Some(got.height), want.height, "{name}");
                    assert_eq!(
                        Some(format_name(got.format)),
                        want.format
                            .map(|f| serde_json::to_value(f).unwrap())
                            .as_ref()
                            .and_then(Value::as_str),
                        "{name}"
                    );
                    assert_eq!(got.bytes as usize, bytes.len());
                    assert_eq!(got.tokens, want.tokens.tokens, "{name} {spec}");
                    assert_eq!(got.markers, want.tokens.markers, "{name} {spec}");
                }
                Err(e) => assert_eq!(got.unwrap_err(), e.to_string(), "{name} {spec}"),
            }
        }
    }
    // Not an image, and not a profile.
    let e = router
        .call_describe_image(&mut store, b"plain text", "qwen2.5-vl")
        .unwrap()
        .unwrap_err();
    assert_eq!(
        e,
        native_describe(b"plain text", &Profile::parse("qwen2.5-vl").unwrap())
            .unwrap_err()
            .to_string()
    );
}

#[test]
fn profiles_export_lists_specs_the_native_core_accepts() {
    let (mut store, router) = instance();
    let profiles = router.call_profiles(&mut store).unwrap();
    assert!(profiles.len() >= 3, "{profiles:?}");
    for spec in &profiles {
        assert!(Profile::parse(spec).is_ok(), "{spec}");
    }
}

#[test]
fn score_export_matches_the_native_scorer() {
    let (mut store, router) = instance();
    let keys = analyze(&body(), &RouterConfig::default())
        .unwrap()
        .layout
        .keys;
    assert!(keys.len() >= 4, "{}", keys.len());
    let half = keys.len() / 2;
    // An idle cold worker, an idle worker holding half the prefix, a busy one holding all.
    let workers = [
        (Vec::new(), Candidate::default()),
        (keys[..half].to_vec(), Candidate::default()),
        (
            keys.clone(),
            Candidate {
                queued_s: 2.5,
                inflight: 40,
                waiting: Some(30.0),
                running: Some(64.0),
                prefill_tps: Some(9000.0),
                footprint: 500.0,
                ..Candidate::default()
            },
        ),
    ];
    let wit_workers: Vec<Worker> = workers
        .iter()
        .map(|(held, l)| Worker {
            held: held.clone(),
            inflight: l.inflight,
            queued_ms: l.queued_s * 1000.0,
            waiting: l.waiting,
            running: l.running,
            prefill_tps: l.prefill_tps,
            footprint: l.footprint,
        })
        .collect();
    let config = RouterConfig::default();
    let states: Vec<WorkerState> = workers
        .iter()
        .map(|(held, l)| WorkerState {
            held: held.clone(),
            load: *l,
        })
        .collect();
    for seed in [0u64, 1, 0xdead_beef] {
        let got = router
            .call_score(&mut store, &keys, &wit_workers, None, seed)
            .unwrap()
            .unwrap();
        let want = native_score(&keys, &states, &config, seed).unwrap();
        assert_eq!(want.matched, vec![0, half, keys.len()]);
        assert_eq!(
            want.worker, 1,
            "half the prefix, idle: the busy full match waits too long"
        );
        assert_eq!(got.worker as usize, want.worker, "seed {seed}");
        assert_eq!(got.matched_blocks as usize, want.matched_blocks);
        assert_eq!(got.total_blocks as usize, keys.len());
        let got_matched: Vec<usize> = got.matched.iter().map(|&m| m as usize).collect();
        assert_eq!(got_matched, want.matched);
        assert!((got.cost_ms - want.estimate.cost_s * 1000.0).abs() < 1e-6);
        assert!((got.wait_ms - want.estimate.wait_s * 1000.0).abs() < 1e-6);
        assert!((got.recompute_ms - want.estimate.recompute_s * 1000.0).abs() < 1e-6);
    }
    // With a scoring configuration from JSON, and the errors.
    let e = router
        .call_score(&mut store, &keys, &[], None, 0)
        .unwrap()
        .unwrap_err();
    assert!(e.contains("no workers"), "{e}");
    let e = router
        .call_score(&mut store, &keys, &wit_workers, Some("{\"nope\":1}"), 0)
        .unwrap()
        .unwrap_err();
    assert!(e.contains("nope"), "{e}");
}
