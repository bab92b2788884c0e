//! The request path compiled to wasm32-wasip1 (or natively): the three cases of
//! `benches/pipeline.rs`, timed with `std::time::Instant` (the WASI monotonic clock in wasm).
//!
//! ```text
//! mmrouter-wasm-bench [--samples N] [--min-sample-ms MS]
//! ```
//! `--samples` (default 15): timed samples per measurement; `--min-sample-ms` (default 20):
//! each sample repeats the operation until it lasts at least this long. Prints one
//! tab-separated line per measurement: case, measurement, body bytes, iterations per sample,
//! median and minimum time per operation in µs, and throughput in MB/s of body (10^6 bytes/s,
//! from the median).
//!
//! Measurements, per case:
//! - `analyze`: `mmrouter::analysis::analyze` with the default configuration (the single pass
//!   over the body: JSON, base64 decode, xxh3-128, header; then tokens, layout);
//! - `pieces`: the same through `mmrouter::analysis::Analyzer` fed 16 KiB pieces, as the filter
//!   feeds it while the body arrives;
//! - `route`: the filter's whole per-request decision, `Router::route` with an in-memory
//!   shared store and 8 workers, then `Router::finished` (analysis + prefix match + scoring +
//!   shared-state log and load updates; what the filter does between `get_buffer` and
//!   `set_header`, less the host calls);
//! - `limit` (image cases): base64 decode into a reused buffer + xxh3-128 of the images alone,
//!   the floor no router that hashes the image bytes can beat.

mod cases;

use base64::Engine as _;
use mmrouter::analysis::{Analyzer, analyze};
use mmrouter::config::RouterConfig;
use mmrouter::filter::config::FilterConfig;
use mmrouter::filter::poller::Poller;
use mmrouter::filter::router::Router;
use mmrouter::state::writer::drain;
use mmrouter::state::{MemoryStore, SharedStore};
use std::hint::black_box;
use std::time::{Duration, Instant};
use xxhash_rust::xxh3::xxh3_128;

struct Options {
    samples: usize,
    min_sample: Duration,
}

fn options() -> Options {
    let mut o = Options {
        samples: 15,
        min_sample: Duration::from_millis(20),
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let value = it.next().and_then(|v| v.parse::<u64>().ok());
        match (a.as_str(), value) {
            ("--samples", Some(n)) if n > 0 => o.samples = n as usize,
            ("--min-sample-ms", Some(ms)) => o.min_sample = Duration::from_millis(ms),
            _ => {
                eprintln!("usage: mmrouter-wasm-bench [--samples N] [--min-sample-ms MS]");
                std::process::exit(2);
            }
        }
    }
    o
}

/// Median and minimum time of one call of `f`, over `samples` samples.
fn time(o: &Options, mut f: impl FnMut()) -> (u64, Duration, Duration) {
    // Warm-up and calibration: double the batch until it lasts min_sample.
    let mut iters = 1u64;
    loop {
        let t = Instant::now();
        for _ in 0..iters {
            f();
        }
        if t.elapsed() >= o.min_sample || iters >= 1 << 20 {
            break;
        }
        iters *= 2;
    }
    let mut per_op: Vec<Duration> = (0..o.samples)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            t.elapsed() / iters as u32
        })
        .collect();
    per_op.sort();
    (iters, per_op[per_op.len() / 2], per_op[0])
}

fn report(o: &Options, case: &str, what: &str, bytes: usize, f: impl FnMut()) {
    let (iters, median, min) = time(o, f);
    let mbps = bytes as f64 / median.as_secs_f64() / 1e6;
    println!(
        "{case}\t{what}\t{bytes}\t{iters}\t{:.1}\t{:.1}\t{mbps:.0}",
        median.as_secs_f64() * 1e6,
        min.as_secs_f64() * 1e6
    );
}

fn router() -> Router {
    let workers: Vec<String> = (0..8)
        .map(|i| format!(r#"{{"name":"w{i}","address":"10.0.0.{i}:8000"}}"#))
        .collect();
    let json = format!(r#"{{"workers":[{}]}}"#, workers.join(","));
    match FilterConfig::from_json(json.as_bytes()) {
        Ok(c) => Router::new(c),
        Err(e) => panic!("filter config: {e}"),
    }
}

fn main() {
    let o = options();
    let config = RouterConfig::default();
    let cases = cases::cases();
    println!("case\tmeasurement\tbody_bytes\titers\tmedian_us\tmin_us\tMB_per_s");
    for case in &cases {
        // The analysis must see every image, with the identity of its file bytes.
        let a = match analyze(&case.body, &config) {
            Ok(a) => a,
            Err(e) => panic!("{}: {e}", case.name),
        };
        assert_eq!(a.media.len(), case.images.len(), "{}", case.name);
        for (m, im) in a.media.iter().zip(&case.images) {
            assert_eq!(m.id.id, format!("{:032x}", xxh3_128(&im.file)));
        }
        let n = case.body.len();
        report(&o, case.name, "analyze", n, || {
            black_box(analyze(black_box(&case.body), &config).is_ok());
        });
        report(&o, case.name, "pieces", n, || {
            let mut a = Analyzer::new(&config);
            for piece in black_box(&case.body).chunks(16 * 1024) {
                if a.feed(piece).is_err() {
                    break;
                }
            }
            black_box(a.finish(&config).is_ok());
        });

        let mut r = router();
        let store = MemoryStore::default();
        // What the filter does with its configuration: the shared state and the workers.
        Poller::configure(&r, &store, 0);
        // The index holds the request: routed once, and the state writer applied it.
        let mut clock = 1_000_000u64;
        if r.route(&case.body, &store, clock, 1).0.is_none() {
            panic!("{}: not routed", case.name);
        }
        let half_life = r.config.router.scoring.footprint_half_life_ms;
        drain(
            &store,
            r.keys(),
            &r.config.state,
            half_life,
            clock / 1000,
            100,
        );
        report(&o, case.name, "route", n, || {
            clock += 1_000;
            let (d, _) = r.route(black_box(&case.body), &store, clock, clock);
            let Some(d) = d else {
                panic!("not routed");
            };
            assert!(d.fallback.is_none());
            r.finished(&store, &d, clock + 500, true);
            // The decision's record (no keys: the worker holds the prompt with fresh stamps)
            // is the state writer's work, off the request path.
            let _ = store.dequeue(&r.keys().decisions());
        });

        if !case.images.is_empty() {
            let engine = &base64::engine::general_purpose::STANDARD;
            let mut buf = vec![0u8; case.images.iter().map(|i| i.file.len()).max().unwrap_or(0)];
            report(&o, case.name, "limit", n, || {
                for im in &case.images {
                    let len = match engine.decode_slice(black_box(&im.base64), &mut buf) {
                        Ok(l) => l,
                        Err(e) => panic!("{e}"),
                    };
                    black_box(xxh3_128(&buf[..len]));
                }
            });
        }
    }
}
