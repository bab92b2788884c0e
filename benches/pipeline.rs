//! Benchmarks of the request path: `analyze()` end to end and its parts, against the floor of
//! base64 decode + xxh3-128 of the same image bytes.
//!
//! `cargo bench --bench pipeline -- --warm-up-time 1 --measurement-time 3`
//!
//! Cases (made at start-up by `benches/wasm/src/cases.rs`, shared with the wasm benchmark):
//! `text_8k` (a text-only chat of ~8 KiB), `jpeg_1m` (one 1920×1080 JPEG of ~1 MiB, inline),
//! `mixed_4x256k` (PNG, JPEG, PNG, JPEG of ~256 KiB each, inline). Groups:
//!
//! - `analyze/<case>`: `mmrouter::analysis::analyze`, default configuration; throughput in
//!   bytes of body.
//! - `analyze_pieces/<case>`: `mmrouter::analysis::Analyzer` fed the body in 16 KiB pieces, as
//!   a proxy receives it; bytes of body.
//! - `parts/<part>/<case>`: each step alone, on the inputs `analyze` gives it: `scan` (the
//!   single pass over the body: JSON, base64 decode, xxh3-128 and header of every inline image;
//!   bytes of body), `xxh3_128` (`MediaId::of_bytes` of each file: hash and hex; bytes of
//!   file), `header` (`read_image_header` + the profile's token count, per request), `layout`
//!   (the block layout and key chain of the request; per request).
//! - `floor/<what>/<case>`: `copy` (the body copied once, as the filter's `get_buffer` does),
//!   `base64_reused` (decode into a reused buffer) and `base64_xxh3` (decode into a reused
//!   buffer + xxh3-128): what no router that hashes the image bytes can beat; bytes of body.

#[path = "wasm/src/cases.rs"]
mod cases;

use base64::Engine as _;
use cases::Case;
use criterion::{Criterion, Throughput};
use mmrouter::analysis::{Analyzer, analyze};
use mmrouter::config::RouterConfig;
use mmrouter::identity::MediaId;
use mmrouter::image_header::read_image_header;
use mmrouter::layout::{PlacedMedia, layout};
use mmrouter::request::Limits;
use mmrouter::scan::scan;
use std::hint::black_box;
use xxhash_rust::xxh3::xxh3_128;

/// The piece size of `analyze_pieces` (Envoy hands the body over in buffers of this order).
const PIECE: usize = 16 * 1024;

fn bench_analyze(c: &mut Criterion, cases: &[Case], config: &RouterConfig) {
    let mut g = c.benchmark_group("analyze");
    for case in cases {
        let Ok(a) = analyze(&case.body, config) else {
            panic!("{}: analyze failed", case.name)
        };
        assert_eq!(a.media.len(), case.images.len());
        g.throughput(Throughput::Bytes(case.body.len() as u64));
        g.bench_function(case.name, |b| {
            b.iter(|| analyze(black_box(&case.body), config))
        });
    }
    g.finish();
    let mut g = c.benchmark_group("analyze_pieces");
    for case in cases {
        g.throughput(Throughput::Bytes(case.body.len() as u64));
        g.bench_function(case.name, |b| {
            b.iter(|| {
                let mut a = Analyzer::new(config);
                for piece in black_box(&case.body).chunks(PIECE) {
                    if a.feed(piece).is_err() {
                        break;
                    }
                }
                a.finish(config).map(|a| a.layout.keys.len())
            })
        });
    }
    g.finish();
}

fn bench_parts(c: &mut Criterion, cases: &[Case], config: &RouterConfig) {
    let limits = Limits::default();
    let mut g = c.benchmark_group("parts");
    for case in cases {
        g.throughput(Throughput::Bytes(case.body.len() as u64));
        g.bench_function(format!("scan/{}", case.name), |b| {
            b.iter(|| scan(black_box(&case.body), &limits).map(|r| r.media.len()))
        });

        let Ok(scanned) = scan(&case.body, &limits) else {
            panic!("scan")
        };
        let request = scanned.prompt;
        let Ok(profile) = config.profiles.resolve(&request.model) else {
            panic!("profile")
        };
        if !case.images.is_empty() {
            let file_bytes: usize = case.images.iter().map(|i| i.file.len()).sum();
            g.throughput(Throughput::Bytes(file_bytes as u64));
            g.bench_function(format!("xxh3_128/{}", case.name), |b| {
                b.iter(|| {
                    for im in &case.images {
                        black_box(MediaId::of_bytes(black_box(&im.file)));
                    }
                })
            });
            g.throughput(Throughput::Elements(1));
            g.bench_function(format!("header/{}", case.name), |b| {
                b.iter(|| {
                    for im in &case.images {
                        let info = read_image_header(black_box(&im.file));
                        black_box(info.map(|i| profile.image_tokens(i.width, i.height)).ok());
                    }
                })
            });
        }

        let Ok(analysis) = analyze(&case.body, config) else {
            panic!("analyze")
        };
        let placed: Vec<PlacedMedia> = analysis
            .media
            .iter()
            .map(|m| PlacedMedia {
                key: m.id.key64(),
                tokens: m.tokens,
            })
            .collect();
        assert_eq!(
            layout(&request, &placed, config.block_size),
            analysis.layout
        );
        g.throughput(Throughput::Elements(1));
        g.bench_function(format!("layout/{}", case.name), |b| {
            b.iter(|| {
                layout(black_box(&request), &placed, config.block_size)
                    .keys
                    .len()
            })
        });
    }
    g.finish();
}

fn bench_floor(c: &mut Criterion, cases: &[Case]) {
    let engine = &base64::engine::general_purpose::STANDARD;
    let mut g = c.benchmark_group("floor");
    for case in cases {
        g.throughput(Throughput::Bytes(case.body.len() as u64));
        g.bench_function(format!("copy/{}", case.name), |b| {
            b.iter(|| black_box(&case.body).to_vec())
        });
        if case.images.is_empty() {
            continue;
        }
        let mut buf = vec![0u8; case.images.iter().map(|i| i.file.len()).max().unwrap_or(0)];
        g.bench_function(format!("base64_reused/{}", case.name), |b| {
            b.iter(|| {
                for im in &case.images {
                    black_box(engine.decode_slice(black_box(&im.base64), &mut buf).ok());
                }
            })
        });
        g.bench_function(format!("base64_xxh3/{}", case.name), |b| {
            b.iter(|| {
                for im in &case.images {
                    let len = engine
                        .decode_slice(black_box(&im.base64), &mut buf)
                        .unwrap_or(0);
                    black_box(xxh3_128(buf.get(..len).unwrap_or(&[])));
                }
            })
        });
    }
    g.finish();
}

fn main() {
    let cases = cases::cases();
    let config = RouterConfig::default();
    for case in &cases {
        let Ok(a) = analyze(&case.body, &config) else {
            panic!("{}: analyze failed", case.name)
        };
        let image_tokens: u32 = a.media.iter().map(|m| m.tokens.tokens).sum();
        let sizes: Vec<String> = case
            .images
            .iter()
            .map(|i| format!("{} {}x{} {} B", i.mime, i.width, i.height, i.file.len()))
            .collect();
        eprintln!(
            "case {}: body {} B; {}; {image_tokens} image tokens, {} prompt tokens, {} blocks",
            case.name,
            case.body.len(),
            sizes.join(", "),
            a.layout.prompt_tokens,
            a.layout.keys.len()
        );
    }
    let mut c = Criterion::default().configure_from_args();
    bench_analyze(&mut c, &cases, &config);
    bench_parts(&mut c, &cases, &config);
    bench_floor(&mut c, &cases);
    c.final_summary();
}
