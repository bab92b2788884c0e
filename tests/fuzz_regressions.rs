//! The fuzz targets' corpus and every crash they ever found, replayed on stable through the
//! same property checks (`fuzz/src`, compiled into this test by path) so that `cargo test`
//! keeps them: `fuzz/corpus/<target>/` (seeds written from the fixtures by `write_seeds`
//! below, plus what `cargo fuzz cmin` kept of the fuzzers' finds) and
//! `fuzz/regressions/<target>/` (inputs that once failed a property; each named for what it
//! found). Each input runs under its target's allocation cap, as in the fuzzer: an input over
//! the cap aborts this test binary with an `alloc_cap:` line. See docs/FUZZING.md.
//!
//! `cargo test --test fuzz_regressions -- --ignored write_seeds` rewrites the seeds (the
//! `seed-*` files) from `tests/fixtures`; the fuzzers' finds are left as they are.

#[path = "../fuzz/src/lib.rs"]
#[allow(dead_code)]
mod fuzz;

use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The allocation cap counts the whole process's heap: one replay at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    out.retain(|p| p.is_file());
    out.sort();
    out
}

/// Replays the target's corpus and regressions; returns how many inputs ran. Every seed must
/// be an input the target is about (its check returns true), so that a seed that drifts off
/// target (a format change) is noticed.
fn replay(name: &str) -> usize {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let target = fuzz::target(name).unwrap_or_else(|| panic!("no fuzz target {name}"));
    let corpus = files(&fuzz_dir().join("corpus").join(name));
    let seeds = corpus
        .iter()
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("seed-"))
        })
        .count();
    assert!(
        seeds > 0,
        "fuzz/corpus/{name} has no seeds: run write_seeds"
    );
    let regressions = files(&fuzz_dir().join("regressions").join(name));
    for path in corpus.iter().chain(&regressions) {
        let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let result = std::panic::catch_unwind(|| fuzz::run(target, &data));
        match result {
            Ok(on_target) => {
                let seed = path
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("seed-"));
                assert!(on_target || !seed, "{} is not for {name}", path.display());
            }
            Err(_) => panic!("{} fails a property of {name}", path.display()),
        }
    }
    corpus.len() + regressions.len()
}

#[test]
fn analyze_corpus_keeps_whole_and_split_analysis_equal() {
    assert!(replay("analyze") > 0);
}

#[test]
fn base64_corpus_keeps_slice_and_streaming_decoders_equal() {
    assert!(replay("base64") > 0);
}

#[test]
fn png_corpus_keeps_the_header_reader_in_line_with_the_png_crate() {
    assert!(replay("header_png") > 0);
}

#[test]
fn jpeg_corpus_keeps_the_marker_walker_in_line_with_jpeg_decoder() {
    assert!(replay("header_jpeg") > 0);
}

#[test]
fn webp_corpus_keeps_the_header_reader_in_line_with_image_webp() {
    assert!(replay("header_webp") > 0);
}

#[test]
fn gif_corpus_keeps_the_header_reader_in_line_with_the_gif_crate() {
    assert!(replay("header_gif") > 0);
}

#[test]
fn router_config_corpus_round_trips_and_stays_bounded() {
    assert!(replay("config_router") > 0);
}

#[test]
fn filter_config_corpus_starts_the_filter_and_stays_bounded() {
    assert!(replay("config_filter") > 0);
}

#[test]
fn kv_event_corpus_round_trips_within_the_limits() {
    assert!(replay("kv_events") > 0);
}

#[test]
fn feed_corpus_round_trips() {
    assert!(replay("feed") > 0);
}

#[test]
fn state_corpus_round_trips() {
    assert!(replay("state") > 0);
}

#[test]
fn every_target_has_a_corpus_directory() {
    for t in fuzz::TARGETS {
        assert!(
            fuzz_dir().join("corpus").join(t.name).is_dir(),
            "fuzz/corpus/{} is missing",
            t.name
        );
    }
}

#[test]
fn the_allocation_cap_sees_what_an_input_holds() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let cap = fuzz::alloc_cap::Cap::set(64 << 20);
    let held = vec![1u8; 3 << 20];
    // The counter is the whole process's: another test thread of this binary may free a few
    // bytes between the set and the allocation (a CI run saw the peak 24 bytes short), so the
    // peak is held to the allocation less a slack far below it; without the count it is ~0.
    let slack = 64 << 10;
    assert!(
        cap.peak() + slack >= held.len(),
        "peak {} under 3 MiB less {slack} bytes",
        cap.peak()
    );
    drop(held);
    // The configuration of issue 14's VM crash (no size cap) and a PNG claiming 65535x65535
    // stay far under the analyze target's cap.
    let cap = fuzz::alloc_cap::Cap::set(64 << 20);
    let png = fuzz::config::test_image::png_claiming(65535, 65535);
    let mut input = fuzz::split::header(2, &[]);
    input.extend(fuzz::config::test_image::chat(
        "m",
        &fuzz::config::test_image::image_part("image/png", &png),
    ));
    assert!(fuzz::analyze::check(&input));
    assert!(cap.peak() < 16 << 20, "peak {} bytes", cap.peak());
}

// ---- seeds -------------------------------------------------------------------------------

fn write(target: &str, name: &str, data: &[u8]) {
    let dir = fuzz_dir().join("corpus").join(target);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let path = dir.join(format!("seed-{name}"));
    std::fs::write(&path, data).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

fn image_fixtures() -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = files(&test_images::fixtures_dir())
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e != "json"))
        .map(|p| {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
            (
                name.unwrap_or_default(),
                std::fs::read(&p).unwrap_or_default(),
            )
        })
        .collect();
    out.sort();
    out
}

fn mime(name: &str) -> &'static str {
    match name.rsplit('.').next() {
        Some("png") => "image/png",
        Some("jpg") => "image/jpeg",
        Some("gif") => "image/gif",
        _ => "image/webp",
    }
}

fn with_header(flags: u8, sizes: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut out = fuzz::split::header(flags, sizes);
    out.extend_from_slice(payload);
    out
}

/// Rewrites the `seed-*` files of every target from the fixtures.
#[test]
#[ignore = "writes fuzz/corpus; run by hand when the fixtures or an input format change"]
fn write_seeds() {
    for t in fuzz::TARGETS {
        for p in files(&fuzz_dir().join("corpus").join(t.name)) {
            if p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("seed-"))
            {
                std::fs::remove_file(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            }
        }
    }
    let images = image_fixtures();
    assert!(images.len() >= 20, "image fixtures missing");
    let stem = |n: &str| n.rsplit_once('.').map_or(n, |(s, _)| s).to_string();

    // Image headers: the fixture files as they are, and each truncated after its header.
    for (name, bytes) in &images {
        let target = match name.rsplit('.').next() {
            Some("png") => "header_png",
            Some("jpg") => "header_jpeg",
            Some("gif") => "header_gif",
            _ => "header_webp",
        };
        write(target, name, bytes);
        write(
            target,
            &format!("{}-cut64", stem(name)),
            &bytes[..bytes.len().min(64)],
        );
    }
    let claims = [
        (
            "png-65535x65535",
            "header_png",
            fuzz::config::test_image::png_claiming(65535, 65535),
        ),
        (
            "jpeg-65535x65535",
            "header_jpeg",
            fuzz::config::test_image::jpeg_claiming(65535, 65535),
        ),
        (
            "gif-65535x65535",
            "header_gif",
            fuzz::config::test_image::gif_claiming(65535, 65535),
        ),
        (
            "webp-16384x16384",
            "header_webp",
            fuzz::config::test_image::webp_claiming(16384, 16384),
        ),
        (
            "png-0x0",
            "header_png",
            fuzz::config::test_image::png_claiming(0, 0),
        ),
        (
            "gif-0x0",
            "header_gif",
            fuzz::config::test_image::gif_claiming(0, 0),
        ),
    ];
    for (name, target, bytes) in &claims {
        write(target, name, bytes);
    }

    // Request bodies: each fixture in a chat body, whole, byte by byte, and in odd pieces;
    // under each configuration (flag bits 0-1, see fuzz/src/analyze.rs).
    let chat = |parts: &str| fuzz::config::test_image::chat("Qwen/Qwen2.5-VL-7B-Instruct", parts);
    for (i, (name, bytes)) in images.iter().enumerate() {
        let part = fuzz::config::test_image::image_part(mime(name), bytes);
        let sizes: &[u8] = match i % 3 {
            0 => &[],
            1 => &[1],
            _ => &[7, 0, 13],
        };
        write(
            "analyze",
            &stem(name),
            &with_header((i % 4) as u8, sizes, &chat(&part)),
        );
    }
    let texts: [(&str, &[u8]); 8] = [
        (
            "text-only",
            br#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hello"}]}"#,
        ),
        (
            "url-image-uuid",
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://example.com/a.png"},"uuid":"u1"},{"type":"text","text":"what?"}]}]}"#,
        ),
        (
            "completions",
            br#"{"model":"m","prompt":"once upon a time","max_tokens":5}"#,
        ),
        (
            "audio-and-video",
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"input_audio","input_audio":{"data":"UklGRg==","format":"wav"}},{"type":"video_url","video_url":{"url":"https://example.com/v.mp4"}}]}]}"#,
        ),
        (
            "unknown-part",
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_embeds","image_embeds":"AAAA"},{"type":"text","text":"x"}]}]}"#,
        ),
        (
            "escapes",
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a\"b\\c\u00e9\ud83d\ude00"},{"type":"image_url","image_url":{"url":"data:image\/png;base64,iVBORw0KGgo="}}]}]}"#,
        ),
        (
            "nested-deep",
            br#"{"model":"m","messages":[{"role":"user","content":"x","extra":[[[[[[[[[[{}]]]]]]]]]]}]}"#,
        ),
        ("truncated", br#"{"model":"m","messages":[{"role":"user","content":[{"type":"te"#),
    ];
    for (i, (name, body)) in texts.iter().enumerate() {
        write("analyze", name, &with_header((i % 4) as u8, &[3, 1], body));
    }
    // Issue 14's VM crash: a profile with no size cap and a PNG claiming 65535x65535.
    let png = fuzz::config::test_image::png_claiming(65535, 65535);
    let part = fuzz::config::test_image::image_part("image/png", &png);
    write(
        "analyze",
        "uncapped-65535x65535",
        &with_header(2, &[], &chat(&part)),
    );

    // Base64: each fixture's base64, in an image data URL (flag 1) or as audio data (flag 0),
    // under each escape mode, whole or in pieces; and a few bad encodings.
    for (i, (name, bytes)) in images.iter().enumerate() {
        let b64 = test_images::base64(bytes);
        let flags = ((i % 4) as u8) << 1 | u8::from(i % 5 != 0);
        let sizes: &[u8] = if i % 2 == 0 { &[] } else { &[5, 64] };
        write(
            "base64",
            &stem(name),
            &with_header(flags, sizes, b64.as_bytes()),
        );
    }
    for (name, payload) in [
        ("bad-padding", "iVBORw0KGgo=="),
        ("no-padding", "iVBORw0KGgoAAAA"),
        ("whitespace", "iVBO Rw0K\nGgo=\r\n"),
        ("bad-symbol", "iVBORw0*KGgo="),
        ("urlsafe", "iVBORw0KGgo-_w=="),
        ("empty", ""),
    ] {
        write("base64", name, &with_header(1, &[2], payload.as_bytes()));
    }

    // Configurations.
    let router = serde_json::to_vec_pretty(&mmrouter::config::RouterConfig::default())
        .unwrap_or_else(|e| panic!("default config: {e}"));
    write("config_router", "defaults", &router);
    for (name, text) in [
        (
            "uncapped",
            r#"{"profiles": {"builtin_rules": false, "default": "factor:1"}}"#,
        ),
        (
            "tight",
            r#"{"block_size": 4, "limits": {"max_body_bytes": 4096, "max_media_items": 2, "max_nesting": 6, "max_media_tokens": 4096}}"#,
        ),
        ("empty", "{}"),
        ("unknown-key", r#"{"blocksize": 16}"#),
        ("not-an-object", "[1, 2]"),
    ] {
        write("config_router", name, text.as_bytes());
    }
    for (name, text) in [
        (
            "one-worker",
            r#"{"workers":[{"name":"w0","address":"127.0.0.1:8001"}]}"#,
        ),
        (
            "four-workers-precise",
            r#"{"workers":[{"name":"w0","address":"127.0.0.1:8001"},{"name":"w1","address":"127.0.0.1:8002"},{"name":"w2","address":"[::1]:8003"},{"name":"w3","address":"10.0.0.4:8000"}],"mode":"precise","stamp_uuid":true,"response_headers":true,"retry_alternates":2}"#,
        ),
        (
            "sidecar",
            r#"{"sidecar":{"cluster":"mmrouter_sidecar","poll_ms":100},"paths":["/v1/chat/completions"],"decision_log":"debug"}"#,
        ),
        (
            "router-keys",
            r#"{"workers":[{"name":"w0","address":"127.0.0.1:8001"}],"block_size":16,"profiles":{"builtin_rules":false,"default":"factor:1"},"limits":{"max_media_items":8},"metrics":{"poll_ms":250,"path":"/metrics","timeout_ms":200,"cluster":"mmrouter_endpoint","unhealthy_after":3}}"#,
        ),
        ("no-workers", r#"{"mode":"approximate"}"#),
    ] {
        write("config_filter", name, text.as_bytes());
    }

    // KV events: the fixtures made from vLLM's own classes.
    let kv = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kv_events");
    let kv_files: Vec<PathBuf> = files(&kv)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "msgpack"))
        .collect();
    assert!(kv_files.len() >= 10, "kv event fixtures missing");
    for p in kv_files {
        let name = p.file_stem().map(|n| n.to_string_lossy().into_owned());
        write(
            "kv_events",
            &name.unwrap_or_default(),
            &std::fs::read(&p).unwrap_or_default(),
        );
    }

    // Feeds.
    use mmrouter::feed::{Feed, FeedWorker, ImageResidency, encode};
    let worker = |i: u32| FeedWorker {
        name: format!("w{i}"),
        address: format!("127.0.0.{}:800{i}", i + 1),
        healthy: i != 2,
        metrics_valid: true,
        events_connected: i.is_multiple_of(2),
        capacity: 16384,
        block_size: 16,
        waiting: i as f32,
        running: 2.5,
        kv_usage: 0.25,
        prefill_tps: 4000.0,
        metrics_age_ms: 120,
        resident: 1000 + i,
        stored_total: 5000,
        removed_total: 4000,
        cleared_total: 1,
        event_gaps: 0,
    };
    let feeds = [
        ("empty", Feed::default()),
        (
            "snapshot-four-workers",
            Feed {
                snapshot: true,
                epoch: 7,
                cursor: 42,
                now_ms: 1_700_000_000_000,
                workers: (0..4).map(worker).collect(),
                images: (0..6)
                    .map(|i| ImageResidency {
                        worker: i % 4,
                        image: 0x1234_5678_9abc_def0 ^ u64::from(i),
                        blocks: 25 * (i + 1),
                    })
                    .collect(),
            },
        ),
        (
            "delta",
            Feed {
                snapshot: false,
                epoch: 7,
                cursor: 43,
                now_ms: 1_700_000_000_100,
                workers: vec![worker(1)],
                images: vec![ImageResidency {
                    worker: 0,
                    image: 1,
                    blocks: 0,
                }],
            },
        ),
    ];
    for (name, feed) in &feeds {
        assert_eq!(feed.validate(), Ok(()), "feed seed {name}");
        write("feed", name, &encode(feed));
    }

    // Shared state values, one per selector (see fuzz/src/state.rs).
    use mmrouter::state::blocks::{Bucket, Entry, Holder};
    use mmrouter::state::images::{ImageBucket, ImageEntry, ImageHolder};
    use mmrouter::state::workers::{LiveTable, Member, Members};
    let bucket = Bucket {
        entries: (0..3)
            .map(|k| Entry {
                key: 0xfeed_0000 + k,
                holders: (0..2)
                    .map(|s| Holder {
                        slot: s,
                        stamp: 100 + s as u32,
                    })
                    .collect(),
            })
            .collect(),
    }
    .encode();
    let images_bucket = ImageBucket {
        entries: vec![ImageEntry {
            image: 99,
            holders: vec![ImageHolder {
                slot: 1,
                incarnation: 2,
                blocks: 25,
            }],
        }],
    }
    .encode();
    let record =
        mmrouter::state::decisions::encode(1, 1_700_000_000_000, 4, 0, Some(4100), &[1, 2, 3]);
    let members = Members {
        version: 3,
        slots: vec![
            Member {
                name: "w0".into(),
                address: "127.0.0.1:8001".into(),
                active: true,
            },
            Member {
                name: "w1".into(),
                address: "127.0.0.1:8002".into(),
                active: false,
            },
        ],
    }
    .encode();
    let live = LiveTable {
        version: 5,
        members_version: 3,
        precise: true,
        written_ms: 1_700_000_000_000,
        slots: vec![Default::default(); 2],
    }
    .encode();
    let loads = mmrouter::state::load::encode(&[
        mmrouter::state::load::Load {
            inflight: 3,
            queue_until_us: 1_700_000_000_000_000,
            pending_blocks: 0,
        },
        Default::default(),
    ]);
    let part = |v: &[u8]| {
        let mut out = (v.len() as u16).to_le_bytes().to_vec();
        out.extend_from_slice(v);
        out
    };
    let keys: Vec<u8> = [0xfeed_0000u64, 0xfeed_0001, 7]
        .iter()
        .flat_map(|k| k.to_le_bytes())
        .collect();
    let mut prefix = part(&live);
    prefix.extend(part(&keys));
    prefix.extend(part(&bucket));
    let mut drained = part(&live);
    drained.extend(part(&bucket));
    drained.extend(part(&record));
    drained.extend(part(&record[..10]));
    let state_seeds: [(&str, u8, &[u8]); 8] = [
        ("block-bucket", 0, &bucket),
        ("image-bucket", 1, &images_bucket),
        ("decision", 2, &record),
        ("members", 3, &members),
        ("live", 4, &live),
        ("loads", 5, &loads),
        ("prefix", 6, &prefix),
        ("drain", 7, &drained),
    ];
    for (name, selector, value) in state_seeds {
        write("state", name, &with_header_byte(selector, value));
    }

    // What was written is on target.
    for t in fuzz::TARGETS {
        replay(t.name);
    }
}

fn with_header_byte(b: u8, value: &[u8]) -> Vec<u8> {
    let mut out = vec![b];
    out.extend_from_slice(value);
    out
}
