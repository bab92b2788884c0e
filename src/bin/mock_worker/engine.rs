//! The emulated engine: a FIFO waiting queue, at most `max_num_seqs` running sequences, the
//! KV block pool with prefix caching, an mm cache, and a timing model.
//!
//! ## Scheduling (after vLLM v1's FCFS scheduler)
//! A request waits in a FIFO queue. The head is admitted when fewer than `max_num_seqs` run
//! and the pool can give it the blocks it lacks; nothing behind the head overtakes it. On
//! admission the longest cached prefix of its full blocks is looked up (at most
//! `prompt_len - 1` tokens, as `KVCacheManager.get_computed_blocks` caps it, so a fully
//! cached prompt still recomputes its last block), hit blocks are referenced and the rest of
//! the sequence (prompt + `max_tokens`) is allocated at once, evicting least recently freed
//! cached blocks. (vLLM allocates decode blocks step by step and preempts when out of
//! blocks; the mock reserves up front and never preempts.) The prefix-cache counters move
//! then, as vLLM's `record_prefix_cache_stats`: queries += prompt tokens, hits += hit tokens.
//!
//! ## Timing
//! Prefill (encoder time for images that need it, plus uncached tokens at
//! `prefill_tokens_per_sec`) runs on one shared "GPU" lane: prefills queue behind each other,
//! so load and cache misses show in time-to-first-token. The first output token comes at the
//! end of prefill; each further one after `1 / decode_tokens_per_sec` (decode is batched: it
//! does not contend). Every duration is multiplied by `time_scale`; 0 never sleeps.
//! An image needs the encoder when it is not in the mm cache and its placeholders are not all
//! inside the cached prefix.
//!
//! ## Caching
//! The prompt's full blocks enter the prefix cache when the request is admitted, before its
//! prefill has run: vLLM v1's `KVCacheManager.allocate_slots` calls `cache_blocks` for the
//! tokens it schedules in a step, before the forward pass that computes them, so a request
//! scheduled after another finds that one's prompt blocks cached even while they are still
//! being computed (its own prefill comes after on the lane, as in the engine, where each
//! layer writes its KV before attention reads it). The mock schedules a whole prompt at once,
//! as vLLM does for a prompt within `max_num_batched_tokens`; a longer prompt's later chunks
//! would enter vLLM's cache step by step. The full blocks of prompt + output are cached at
//! the end (vLLM caches generated blocks too, as each fills).

use crate::histogram::Histogram;
#[cfg(test)]
use crate::prefix_cache::NoEvents;
use crate::prefix_cache::{
    BlockId, BlockPool, HashedBlock, KvEventSink, MmRange, hash_request_blocks,
};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// The engine's knobs (see `cli::Config` for defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    pub block_size: usize,
    pub num_gpu_blocks: u32,
    pub max_num_seqs: usize,
    pub prefill_tokens_per_sec: f64,
    pub decode_tokens_per_sec: f64,
    pub encoder_ms_per_image: f64,
    pub time_scale: f64,
    pub mm_cache_items: usize,
}

/// A request ready to run: rendered, tokenised, hashed.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub tokens: Vec<u32>,
    pub mm: Vec<MmRange>,
    /// The prompt's full blocks.
    pub blocks: Vec<HashedBlock>,
    pub cache_salt: Option<String>,
    pub max_tokens: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineError {
    /// The sequence can never fit in the pool.
    TooLong {
        prompt_tokens: usize,
        max_tokens: usize,
        needed_blocks: usize,
        num_gpu_blocks: usize,
    },
}

impl fmt::Display for EngineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EngineError::TooLong {
                prompt_tokens,
                max_tokens,
                needed_blocks,
                num_gpu_blocks,
            } => write!(
                f,
                "this request needs {needed_blocks} KV blocks ({prompt_tokens} prompt tokens + \
                 max_tokens {max_tokens}) but the KV cache has only {num_gpu_blocks} \
                 (--num-gpu-blocks)"
            ),
        }
    }
}

/// Counters since start (all monotonic).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub mm_queries: u64,
    pub mm_hits: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    /// Requests finished by reaching `max_tokens` (finished_reason="length").
    pub success_length: u64,
    /// Requests that left before finishing (client gone).
    pub aborted: u64,
    pub encoder_runs: u64,
    /// Admission to first token, per request (vLLM's `request_prefill_time_seconds`:
    /// `first_token_ts - scheduled_ts`), wall-clock seconds.
    pub prefill_time: Histogram,
}

/// A consistent view for `/metrics`.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub running: usize,
    pub waiting: usize,
    pub kv_usage: f64,
    pub stats: Stats,
    pub blocks_stored: u64,
    pub blocks_removed: u64,
    pub cached_blocks: usize,
    pub image_fetches: u64,
}

/// LRU set of mm identifiers.
struct MmCache {
    capacity: usize,
    stamps: HashMap<String, u64>,
    order: BTreeMap<u64, String>,
    next: u64,
}

impl MmCache {
    fn new(capacity: usize) -> MmCache {
        MmCache {
            capacity,
            stamps: HashMap::new(),
            order: BTreeMap::new(),
            next: 0,
        }
    }

    /// Whether `id` is cached; either way it becomes the most recently used entry.
    fn query_and_insert(&mut self, id: &str) -> bool {
        if self.capacity == 0 {
            return false;
        }
        let stamp = self.next;
        self.next += 1;
        let hit = match self.stamps.get_mut(id) {
            Some(old) => {
                self.order.remove(old);
                *old = stamp;
                true
            }
            None => {
                self.stamps.insert(id.to_string(), stamp);
                false
            }
        };
        self.order.insert(stamp, id.to_string());
        while self.stamps.len() > self.capacity {
            let Some((_, evicted)) = self.order.pop_first() else {
                break;
            };
            self.stamps.remove(&evicted);
        }
        hit
    }
}

struct Waiter {
    id: u64,
    job: Prepared,
    arrived: Instant,
    tx: oneshot::Sender<Ticket>,
}

struct State {
    pool: BlockPool,
    mm_cache: MmCache,
    waiting: VecDeque<Waiter>,
    running: usize,
    stats: Stats,
}

pub struct Engine {
    cfg: EngineConfig,
    state: Mutex<State>,
    /// The prefill lane: one prefill at a time.
    gpu: tokio::sync::Mutex<()>,
    /// http image fetches (counted by the media loader).
    pub image_fetches: AtomicU64,
    next_waiter: AtomicU64,
}

/// An admitted, running request. Dropping it frees its blocks and its seat.
pub struct Ticket {
    engine: Arc<Engine>,
    job: Prepared,
    blocks: Vec<BlockId>,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    /// Images that ran through the encoder.
    pub encoder_images: usize,
    /// Time spent in the waiting queue.
    pub queued: Duration,
    /// When it was admitted (vLLM's `scheduled_ts`).
    admitted: Instant,
    finished: bool,
}

/// What admission decided, before it becomes a [`Ticket`] (built outside the lock).
struct Admitted {
    waiter: Waiter,
    blocks: Vec<BlockId>,
    cached_tokens: usize,
    encoder_images: usize,
}

impl Engine {
    /// An engine that reports no KV events.
    #[cfg(test)]
    pub fn new(cfg: EngineConfig) -> Arc<Engine> {
        Engine::with_events(cfg, Box::new(NoEvents))
    }

    /// An engine whose block pool reports cache changes to `events`.
    pub fn with_events(cfg: EngineConfig, events: Box<dyn KvEventSink>) -> Arc<Engine> {
        let pool = BlockPool::new(cfg.num_gpu_blocks, cfg.block_size, events);
        let mm_cache = MmCache::new(cfg.mm_cache_items);
        Arc::new(Engine {
            state: Mutex::new(State {
                pool,
                mm_cache,
                waiting: VecDeque::new(),
                running: 0,
                stats: Stats::default(),
            }),
            cfg,
            gpu: tokio::sync::Mutex::new(()),
            image_fetches: AtomicU64::new(0),
            next_waiter: AtomicU64::new(0),
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the state half-updated in a way that
        // matters more than stopping: keep serving.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.cfg.block_size.max(1))
    }

    /// Hashes a prompt's full blocks.
    pub fn prepare(
        &self,
        tokens: Vec<u32>,
        mm: Vec<MmRange>,
        cache_salt: Option<String>,
        max_tokens: usize,
    ) -> Result<Prepared, EngineError> {
        let needed = self.blocks_for(tokens.len() + max_tokens);
        let capacity = self.cfg.num_gpu_blocks as usize;
        if needed > capacity {
            return Err(EngineError::TooLong {
                prompt_tokens: tokens.len(),
                max_tokens,
                needed_blocks: needed,
                num_gpu_blocks: capacity,
            });
        }
        let blocks = hash_request_blocks(&tokens, &mm, cache_salt.as_deref(), self.cfg.block_size);
        Ok(Prepared {
            tokens,
            mm,
            blocks,
            cache_salt,
            max_tokens,
        })
    }

    pub fn snapshot(&self) -> Snapshot {
        let st = self.lock();
        Snapshot {
            running: st.running,
            waiting: st.waiting.len(),
            kv_usage: st.pool.usage(),
            stats: st.stats.clone(),
            blocks_stored: st.pool.stored_total,
            blocks_removed: st.pool.removed_total,
            cached_blocks: st.pool.num_cached(),
            image_fetches: self.image_fetches.load(Ordering::Relaxed),
        }
    }

    /// vLLM's `/reset_prefix_cache`: false while running requests hold blocks.
    pub fn reset_prefix_cache(&self) -> bool {
        self.lock().pool.reset_prefix_cache()
    }

    /// Queues `job` and waits for admission.
    pub async fn submit(self: &Arc<Self>, job: Prepared) -> Ticket {
        let id = self.next_waiter.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let ready = {
            let mut st = self.lock();
            st.waiting.push_back(Waiter {
                id,
                job,
                arrived: Instant::now(),
                tx,
            });
            self.schedule(&mut st)
        };
        self.dispatch(ready);
        let guard = WaitGuard {
            engine: self.clone(),
            id,
        };
        let ticket = rx.await;
        drop(guard);
        match ticket {
            Ok(t) => t,
            // The sender lives in the queue until admission, and admission always sends:
            // a closed channel cannot happen while we wait. Wait forever rather than panic.
            Err(_) => std::future::pending().await,
        }
    }

    /// Admits waiting requests from the head while they fit.
    fn schedule(&self, st: &mut State) -> Vec<Admitted> {
        let mut out = Vec::new();
        let bs = self.cfg.block_size.max(1);
        while st.running < self.cfg.max_num_seqs {
            let Some(head) = st.waiting.front() else {
                break;
            };
            let n = head.job.tokens.len();
            let hashes: Vec<_> = head.job.blocks.iter().map(|b| b.hash).collect();
            let max_hit_blocks = n.saturating_sub(1) / bs;
            let hits = st.pool.find_cached_prefix(&hashes, max_hit_blocks);
            let total = self.blocks_for(n + head.job.max_tokens);
            let new_needed = total.saturating_sub(hits.len());
            let available = st.pool.num_free() - st.pool.count_free_among(&hits);
            if available < new_needed {
                break;
            }
            let Some(waiter) = st.waiting.pop_front() else {
                break;
            };
            st.pool.touch(&hits);
            let Some(new_blocks) = st.pool.allocate(new_needed) else {
                // Cannot happen (checked above); undo the touch and stop.
                st.pool.free(&hits);
                st.waiting.push_front(waiter);
                break;
            };
            let cached_tokens = hits.len() * bs;
            let mut blocks = hits;
            blocks.extend(new_blocks);
            // Scheduled is cached (see "Caching" above): the prompt's full blocks.
            let n_full = waiter.job.blocks.len().min(blocks.len());
            st.pool.cache_blocks(
                blocks.get(..n_full).unwrap_or(&[]),
                waiter.job.blocks.get(..n_full).unwrap_or(&[]),
            );
            st.stats.prefix_queries += n as u64;
            st.stats.prefix_hits += cached_tokens as u64;
            let mut encoder_images = 0;
            for item in &waiter.job.mm {
                st.stats.mm_queries += 1;
                let hit = st.mm_cache.query_and_insert(&item.identifier);
                if hit {
                    st.stats.mm_hits += 1;
                }
                let covered = item.offset + item.length <= cached_tokens;
                if !hit && !covered && item.length > 0 {
                    encoder_images += 1;
                }
            }
            st.stats.encoder_runs += encoder_images as u64;
            st.running += 1;
            out.push(Admitted {
                waiter,
                blocks,
                cached_tokens,
                encoder_images,
            });
        }
        out
    }

    /// Hands admissions to their waiters; must be called without the lock held (a ticket
    /// whose waiter left is dropped here, which takes the lock).
    fn dispatch(self: &Arc<Self>, ready: Vec<Admitted>) {
        for a in ready {
            let ticket = Ticket {
                engine: self.clone(),
                queued: a.waiter.arrived.elapsed(),
                admitted: Instant::now(),
                job: a.waiter.job,
                blocks: a.blocks,
                cached_tokens: a.cached_tokens,
                encoder_images: a.encoder_images,
                finished: false,
            };
            // A waiter that left gets its ticket dropped: blocks and seat come back.
            let _ = a.waiter.tx.send(ticket);
        }
    }

    async fn sleep(&self, seconds: f64) {
        let s = seconds * self.cfg.time_scale;
        if s.is_finite() && s > 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(s)).await;
        }
    }
}

/// Takes a waiter out of the queue if its future is dropped before admission.
struct WaitGuard {
    engine: Arc<Engine>,
    id: u64,
}

impl Drop for WaitGuard {
    fn drop(&mut self) {
        let mut st = self.engine.lock();
        st.waiting.retain(|w| w.id != self.id);
    }
}

impl Ticket {
    pub fn prompt_tokens(&self) -> usize {
        self.job.tokens.len()
    }

    pub fn max_tokens(&self) -> usize {
        self.job.max_tokens
    }

    /// A seed for the deterministic output: the prompt's content.
    pub fn output_seed(&self) -> u64 {
        let mut bytes = Vec::with_capacity(self.job.tokens.len() * 4);
        for t in &self.job.tokens {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        xxhash_rust::xxh3::xxh3_64(&bytes)
    }

    /// Runs the prefill (encoder + uncached tokens on the shared lane); the prompt's blocks
    /// were cached at admission. The first output token is ready when this returns.
    pub async fn prefill(&mut self) {
        let cfg = &self.engine.cfg;
        let uncached = self.job.tokens.len().saturating_sub(self.cached_tokens);
        let seconds = self.encoder_images as f64 * cfg.encoder_ms_per_image / 1000.0
            + uncached as f64 / cfg.prefill_tokens_per_sec;
        if cfg.time_scale > 0.0 && seconds > 0.0 {
            let _lane = self.engine.gpu.lock().await;
            self.engine.sleep(seconds).await;
        }
        let mut st = self.engine.lock();
        st.stats.prompt_tokens += self.job.tokens.len() as u64;
        st.stats.generation_tokens += 1;
        st.stats
            .prefill_time
            .observe(self.admitted.elapsed().as_secs_f64());
    }

    /// Waits one decode step and counts the token.
    pub async fn decode_step(&self) {
        self.engine
            .sleep(1.0 / self.engine.cfg.decode_tokens_per_sec)
            .await;
        self.engine.lock().stats.generation_tokens += 1;
    }

    /// Caches the full blocks of prompt + output whose KV was computed (all but the last
    /// output token), counts the success, then releases everything.
    pub fn finish(mut self, output_ids: &[u32]) {
        let bs = self.engine.cfg.block_size.max(1);
        let computed = self.job.tokens.len() + output_ids.len().saturating_sub(1);
        let full = computed / bs;
        let mut st = self.engine.lock();
        if full > self.job.blocks.len() {
            let mut seq = self.job.tokens.clone();
            seq.extend_from_slice(output_ids);
            seq.truncate(full * bs);
            let all = hash_request_blocks(&seq, &self.job.mm, self.job.cache_salt.as_deref(), bs);
            let n = all.len().min(self.blocks.len());
            let ids = self.blocks.get(..n).unwrap_or(&[]);
            st.pool.cache_blocks(ids, all.get(..n).unwrap_or(&[]));
        }
        st.stats.success_length += 1;
        self.finished = true;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let ready = {
            let mut st = self.engine.lock();
            if !self.finished {
                st.stats.aborted += 1;
            }
            st.pool.free(&self.blocks);
            st.running = st.running.saturating_sub(1);
            self.engine.schedule(&mut st)
        };
        self.engine.dispatch(ready);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(blocks: u32, seqs: usize) -> EngineConfig {
        EngineConfig {
            block_size: 16,
            num_gpu_blocks: blocks,
            max_num_seqs: seqs,
            prefill_tokens_per_sec: 1000.0,
            decode_tokens_per_sec: 100.0,
            encoder_ms_per_image: 30.0,
            time_scale: 0.0,
            mm_cache_items: 8,
        }
    }

    fn job(e: &Engine, first: u32, n: usize, max_tokens: usize) -> Prepared {
        let tokens: Vec<u32> = (first..first + n as u32).collect();
        e.prepare(tokens, Vec::new(), None, max_tokens).unwrap()
    }

    #[tokio::test]
    async fn fully_cached_prompt_still_recomputes_its_last_block() {
        let e = Engine::new(cfg(64, 4));
        // 64 tokens = exactly 4 blocks; the second time at most 63 tokens may hit: 3 blocks.
        let mut t = e.submit(job(&e, 0, 64, 4)).await;
        assert_eq!(t.cached_tokens, 0);
        t.prefill().await;
        t.finish(&[1, 2, 3, 4]);
        let t = e.submit(job(&e, 0, 64, 4)).await;
        assert_eq!(t.cached_tokens, 48);
        drop(t);
        let s = e.snapshot().stats;
        assert_eq!(s.prefix_queries, 128);
        assert_eq!(s.prefix_hits, 48);
        assert_eq!(s.aborted, 1);
        assert_eq!(s.success_length, 1);
    }

    #[tokio::test]
    async fn a_prompt_is_cached_from_admission_before_its_prefill_runs() {
        // As vLLM's allocate_slots caches the blocks it schedules before the forward pass:
        // a request admitted while the first is still waiting for its prefill hits its blocks.
        let e = Engine::new(cfg(64, 4));
        let first = e.submit(job(&e, 0, 40, 4)).await;
        assert_eq!(first.cached_tokens, 0);
        let second = e.submit(job(&e, 0, 40, 4)).await;
        assert_eq!(
            second.cached_tokens, 32,
            "both full blocks of the first's prompt"
        );
        let other = e.submit(job(&e, 1000, 40, 4)).await;
        assert_eq!(other.cached_tokens, 0, "a different prompt hits nothing");
        assert_eq!(e.snapshot().blocks_stored, 4);
    }

    #[tokio::test]
    async fn head_of_queue_waits_for_a_seat_and_gets_it_on_release() {
        let e = Engine::new(cfg(64, 1));
        let first = e.submit(job(&e, 0, 20, 4)).await;
        let e2 = e.clone();
        let j = job(&e, 100, 20, 4);
        let second = tokio::spawn(async move { e2.submit(j).await.cached_tokens });
        tokio::task::yield_now().await;
        for _ in 0..100 {
            if e.snapshot().waiting == 1 {
                break;
            }
            tokio::task::yield_now().await;
        }
        let s = e.snapshot();
        assert_eq!((s.running, s.waiting), (1, 1));
        assert!(s.kv_usage > 0.0);
        drop(first);
        assert_eq!(second.await.unwrap(), 0);
        let s = e.snapshot();
        assert_eq!((s.running, s.waiting), (0, 0));
        assert_eq!(s.kv_usage, 0.0);
    }

    #[test]
    fn sequences_larger_than_the_pool_are_refused() {
        let e = Engine::new(cfg(4, 1));
        assert!(matches!(
            e.prepare(vec![0; 60], Vec::new(), None, 16),
            Err(EngineError::TooLong {
                needed_blocks: 5,
                ..
            })
        ));
    }

    #[test]
    fn mm_cache_is_lru() {
        let mut c = MmCache::new(2);
        assert!(!c.query_and_insert("a"));
        assert!(!c.query_and_insert("b"));
        assert!(c.query_and_insert("a"));
        assert!(!c.query_and_insert("c")); // evicts b
        assert!(c.query_and_insert("a"));
        assert!(!c.query_and_insert("b"));
    }
}
