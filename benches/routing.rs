//! Benchmarks of the routing hot path: prefix index lookup, worker choice, index insert; and
//! the index's memory per block, counted by a global allocator.
//!
//! `cargo bench --bench routing -- --warm-up-time 1 --measurement-time 3`
//!
//! The index holds 10^6 (worker, block) entries in total, spread over 8/64/256/1024 workers.
//! Traffic model: requests of 256 blocks; the first 128 come from one of 64 shared prefixes
//! (system prompt + a popular image), the other 128 are specific to the request. The request
//! looked up continues an earlier request: 192 blocks of it (its shared prefix and 64 of its
//! own blocks, held by one worker) and 64 new ones.

use criterion::{BenchmarkId, Criterion, Throughput};
use mmrouter::index::{IndexConfig, PrefixIndex};
use mmrouter::scoring::{ScoringConfig, WorkerLoad, choose};
use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;

static ALLOCATED: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator and only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        ALLOCATED.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATED.fetch_add(new_size, Ordering::Relaxed);
        ALLOCATED.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const TOTAL_ENTRIES: usize = 1_000_000;
const REQUEST_BLOCKS: u64 = 256;
const SHARED_BLOCKS: u64 = 128;
const FAMILIES: u64 = 64;
const WORKER_COUNTS: [usize; 4] = [8, 64, 256, 1024];

/// xorshift64*: deterministic and dependency-free.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

fn mix(a: u64, b: u64) -> u64 {
    let m = u128::from(a ^ b.rotate_left(32)) * 0x9E37_79B9_7F4A_7C15_u128;
    (m as u64) ^ ((m >> 64) as u64) ^ b
}

/// A request: `SHARED_BLOCKS` of family `family`, then blocks unique to `id`.
fn request(family: u64, id: u64) -> Vec<u64> {
    (0..REQUEST_BLOCKS)
        .map(|i| {
            if i < SHARED_BLOCKS {
                mix(family + 1, i)
            } else {
                mix(id.wrapping_add(1 << 40), i)
            }
        })
        .collect()
}

struct Setup {
    index: PrefixIndex,
    query: Vec<u64>,
    loads: Vec<WorkerLoad>,
    next_id: u64,
}

/// An index of `workers` workers filled to `TOTAL_ENTRIES` entries.
fn setup(workers: usize) -> Setup {
    let capacity = TOTAL_ENTRIES / workers;
    let mut index = PrefixIndex::new(
        IndexConfig {
            capacity_blocks: capacity,
            ttl_ms: 0,
        },
        workers,
    );
    let mut rng = Rng(0x1234_5678 + workers as u64);
    let mut id = 0u64;
    let mut last = Vec::new();
    // Fill every worker to capacity, round-robin.
    while index.entries() < workers * capacity {
        for w in 0..workers {
            let keys = request(rng.next() % FAMILIES, id);
            id += 1;
            index.insert(w, &keys, 0);
            last = keys;
        }
    }
    // Continue the last request: 192 of its blocks, then 64 new ones.
    let mut query: Vec<u64> = last.iter().copied().take(192).collect();
    query.extend((0..64).map(|i| mix(u64::MAX - i, 7)));
    let loads = (0..workers)
        .map(|_| WorkerLoad {
            inflight: (rng.next() % 8) as u32,
            prefill_blocks: rng.next() % 256,
            waiting: Some((rng.next() % 4) as f64),
            running: Some((rng.next() % 32) as f64),
            kv_usage: Some((rng.next() % 100) as f64 / 100.0),
        })
        .collect();
    Setup {
        index,
        query,
        loads,
        next_id: id,
    }
}

fn memory_report() {
    println!("## index memory (counting allocator)");
    for workers in WORKER_COUNTS {
        let before = ALLOCATED.load(Ordering::Relaxed);
        let s = setup(workers);
        let bytes = ALLOCATED.load(Ordering::Relaxed)
            - before
            - s.query.capacity() * 8
            - s.loads.capacity() * size_of::<WorkerLoad>();
        let entries = s.index.entries();
        println!(
            "mixed traffic, {workers:>4} workers: {entries} entries, {} distinct keys, \
             {bytes} bytes allocated = {:.1} B/entry (approx_bytes {:.1} B/entry)",
            s.index.keys(),
            bytes as f64 / entries as f64,
            s.index.approx_bytes() as f64 / entries as f64,
        );
    }
    // Worst case per entry: every key held by one worker.
    for (label, workers, shared) in [
        ("all keys distinct", 8usize, false),
        ("all keys on all 8 workers", 8, true),
    ] {
        let before = ALLOCATED.load(Ordering::Relaxed);
        let mut index = PrefixIndex::new(
            IndexConfig {
                capacity_blocks: TOTAL_ENTRIES / workers,
                ttl_ms: 0,
            },
            workers,
        );
        let per = TOTAL_ENTRIES / workers;
        let mut keys = Vec::with_capacity(256);
        for w in 0..workers {
            for chunk in 0..per / 256 {
                keys.clear();
                let base = if shared { 0 } else { w * per } + chunk * 256;
                keys.extend((base..base + 256).map(|k| mix(k as u64, 3)));
                index.insert(w, &keys, 0);
            }
        }
        let bytes = ALLOCATED.load(Ordering::Relaxed) - before - keys.capacity() * 8;
        println!(
            "{label}: {} entries, {} keys, {bytes} bytes = {:.1} B/entry (approx_bytes {:.1})",
            index.entries(),
            index.keys(),
            bytes as f64 / index.entries() as f64,
            index.approx_bytes() as f64 / index.entries() as f64,
        );
    }
}

fn benches(c: &mut Criterion) {
    let config = ScoringConfig::default();
    let mut group = c.benchmark_group("prefix_index");
    for workers in WORKER_COUNTS {
        let mut s = setup(workers);
        let mut out = Vec::new();
        let best = s.index.match_prefix(&s.query, 1, &mut out);
        let holders = out.iter().filter(|&&m| m > 0).count();
        println!(
            "{workers} workers: query of {} blocks, best match {best}, {holders} workers match >0",
            s.query.len()
        );
        group.throughput(Throughput::Elements(s.query.len() as u64));
        group.bench_with_input(
            BenchmarkId::new("match_prefix", workers),
            &workers,
            |b, _| b.iter(|| black_box(s.index.match_prefix(black_box(&s.query), 1, &mut out))),
        );
        let matched = out.clone();
        group.bench_with_input(BenchmarkId::new("choose", workers), &workers, |b, _| {
            let mut r = 0u64;
            b.iter(|| {
                r += 1;
                black_box(choose(s.query.len(), &matched, &s.loads, &config, r))
            })
        });
        group.bench_with_input(
            BenchmarkId::new("match_and_choose", workers),
            &workers,
            |b, _| {
                let mut r = 0u64;
                b.iter(|| {
                    r += 1;
                    s.index.match_prefix(&s.query, 1, &mut out);
                    black_box(choose(s.query.len(), &out, &s.loads, &config, r))
                })
            },
        );
        // Insert a new request (128 shared blocks touched, 128 new ones evicting old ones):
        // the index stays full, so this is the steady-state cost.
        group.throughput(Throughput::Elements(REQUEST_BLOCKS));
        let mut rng = Rng(99);
        let mut next_id = s.next_id;
        group.bench_with_input(BenchmarkId::new("insert", workers), &workers, |b, _| {
            b.iter_batched(
                || {
                    next_id += 1;
                    (
                        (rng.next() % workers as u64) as usize,
                        request(rng.next() % FAMILIES, next_id),
                    )
                },
                |(w, keys)| s.index.insert(w, &keys, 2),
                criterion::BatchSize::SmallInput,
            )
        });
        assert!(s.index.entries() <= TOTAL_ENTRIES);
    }
    group.finish();
}

fn main() {
    memory_report();
    let mut c = Criterion::default().configure_from_args();
    benches(&mut c);
    c.final_summary();
}
