//! Benchmarks of the routing hot path on the shared state plane: the prefix lookup over the
//! block buckets (what every request pays), the state writer's drain (what the lease holder
//! pays per decision), and the scoring over every worker. Plus the process-wide bytes the
//! buckets hold once full.
//!
//! `cargo bench --bench routing -- --warm-up-time 1 --measurement-time 3`
//!
//! Traffic model: requests of 256 blocks; the first 128 come from one of 64 shared prefixes
//! (system prompt + a popular image), the other 128 are the request's own. The state is filled
//! with 4,000 such decisions spread over the workers; the request looked up continues one of
//! them: 192 blocks held by one worker (its shared prefix and 64 of its own) and 64 new ones.
//! The store is the in-memory one (`MemoryStore`): host-call costs are not in these numbers,
//! only the work the filter does around them (docs/BENCHMARKS.md has Envoy's side).

use criterion::{BenchmarkId, Criterion, Throughput};
use mmrouter::scoring::{Candidate, RequestSize, ScoringConfig, choose};
use mmrouter::state::lookup::{default_probes, match_prefix};
use mmrouter::state::writer::{drain, read_live, sync_members};
use mmrouter::state::{Keys, MemoryStore, SharedStore, StateConfig, decisions};
use std::hint::black_box;

fn chain(prefix: u64, own: u64, len: usize) -> Vec<u64> {
    (0..len as u64)
        .map(|i| {
            let seed = if i < 128 { prefix } else { own };
            xxhash_rust::xxh3::xxh3_64(&[seed.to_le_bytes(), i.to_le_bytes()].concat())
        })
        .collect()
}

struct World {
    store: MemoryStore,
    keys: Keys,
    config: StateConfig,
}

fn world(workers: usize, decisions_n: u64) -> World {
    let store = MemoryStore::default();
    let keys = Keys::new(1);
    let config = StateConfig {
        capacity_blocks: 1 << 20,
        max_workers: 4096,
        ..StateConfig::default()
    };
    let desired: Vec<(String, String)> = (0..workers)
        .map(|i| {
            (
                format!("w{i}"),
                format!("10.0.{}.{}:8000", i / 250, i % 250),
            )
        })
        .collect();
    sync_members(&store, &keys, &config, &desired, 0);
    for d in 0..decisions_n {
        let c = chain(d % 64, 1000 + d, 256);
        let slot = (d % workers as u64) as u16;
        store
            .enqueue(
                &keys.decisions(),
                &decisions::encode(slot, d, 128, 0, None, &c),
            )
            .ok();
        if d % 100 == 99 {
            drain(&store, &keys, &config, 60_000, d, 1000);
        }
    }
    drain(&store, &keys, &config, 60_000, decisions_n, 100_000);
    World {
        store,
        keys,
        config,
    }
}

fn lookup(c: &mut Criterion) {
    let mut g = c.benchmark_group("lookup");
    for workers in [8usize, 64, 256, 1024] {
        let w = world(workers, 4000);
        let live = read_live(&w.store, &w.keys);
        // Continues decision 7: its 128 shared + 64 own blocks, then 64 new ones.
        let mut req = chain(7, 1007, 192);
        req.extend(chain(99, 999_999, 256).into_iter().skip(192));
        let probes = default_probes(req.len());
        g.throughput(Throughput::Elements(1));
        g.bench_with_input(BenchmarkId::from_parameter(workers), &req, |b, req| {
            b.iter(|| {
                let m = match_prefix(req, &live.slots, &w.config.blocks, probes, &mut |i| {
                    w.store
                        .get(&w.keys.block_bucket(i))
                        .ok()
                        .flatten()
                        .map(|(v, _)| v)
                });
                black_box(m.best())
            })
        });
        if workers == 8 {
            let m = match_prefix(&req, &live.slots, &w.config.blocks, probes, &mut |i| {
                w.store
                    .get(&w.keys.block_bucket(i))
                    .ok()
                    .flatten()
                    .map(|(v, _)| v)
            });
            eprintln!(
                "lookup: best match {} of {} blocks in {} bucket reads",
                m.best(),
                req.len(),
                m.probes
            );
        }
        eprintln!(
            "state for {workers} workers after 4000 decisions of 256 blocks: {} keys, {} bytes of values (bound {} bytes)",
            w.store.keys(),
            w.store.value_bytes(),
            w.config.blocks.max_bytes()
        );
    }
    g.finish();
}

fn writer(c: &mut Criterion) {
    let mut g = c.benchmark_group("drain");
    let w = world(64, 1000);
    let mut d = 10_000u64;
    g.throughput(Throughput::Elements(100));
    g.bench_function("100 decisions of 256 blocks", |b| {
        b.iter(|| {
            for _ in 0..100 {
                d += 1;
                let c = chain(d % 64, d, 256);
                w.store
                    .enqueue(
                        &w.keys.decisions(),
                        &decisions::encode((d % 64) as u16, d, 128, 0, None, &c),
                    )
                    .ok();
            }
            black_box(drain(&w.store, &w.keys, &w.config, 60_000, d, 1000))
        })
    });
    g.finish();
}

fn scoring(c: &mut Criterion) {
    let mut g = c.benchmark_group("choose");
    for workers in [8usize, 64, 256, 1024] {
        let candidates: Vec<Candidate> = (0..workers)
            .map(|i| Candidate {
                matched_blocks: if i % 7 == 0 { 192 } else { 128 },
                queued_s: (i % 5) as f64 * 0.01,
                waiting: Some((i % 3) as f64),
                running: Some((i % 9) as f64),
                prefill_tps: Some(8000.0 + i as f64),
                peak_prefill_tps: Some(8000.0 + i as f64),
                footprint: (i % 11) as f64 * 10.0,
                capacity_blocks: Some(16384.0),
                inflight: (i % 4) as u32,
                holds_conversation: false,
            })
            .collect();
        let req = RequestSize {
            total_blocks: 256,
            prompt_tokens: 4100,
            block_size: 16,
        };
        let config = ScoringConfig::default();
        g.throughput(Throughput::Elements(1));
        g.bench_with_input(
            BenchmarkId::from_parameter(workers),
            &candidates,
            |b, cand| b.iter(|| black_box(choose(req, cand, &config, 7).map(|c| c.index))),
        );
    }
    g.finish();
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    lookup(&mut c);
    writer(&mut c);
    scoring(&mut c);
    c.final_summary();
}
