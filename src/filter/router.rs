//! One VM's router: its view of the workers' prefix state, and the decision for one body.
//!
//! Host-independent: it talks to shared data through [`SharedStore`], and takes the time and a
//! random number as arguments, so every path is tested natively and the proxy-wasm shell only
//! moves bytes between Envoy and this type.

use super::config::FilterConfig;
use super::shared_state::{MetricsEntry, SharedState, SharedStore, SyncStats, generation};
use crate::analysis::{Analysis, AnalyzeError, analyze};
use crate::index::PrefixIndex;
use crate::scoring::{WorkerLoad, choose};
use crate::worker_metrics::WorkerMetrics;

/// Why a request was routed without its cache affinity (to the least-loaded worker).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// The body could not be analysed: [`AnalyzeError::reason`] (`bad_json`, `bad_image`, ...).
    Analyze(&'static str),
    /// The body was larger than `limits.max_body_bytes`.
    TooLarge,
    /// A routed path with no body.
    NoBody,
}

impl Fallback {
    pub fn reason(&self) -> &'static str {
        match self {
            Fallback::Analyze(r) => r,
            Fallback::TooLarge => "too_large",
            Fallback::NoBody => "no_body",
        }
    }
}

/// A routing decision.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub worker: usize,
    pub matched_blocks: usize,
    pub total_blocks: usize,
    /// Blocks the worker still has to prefill (estimate), released at first byte.
    pub prefill_blocks: u64,
    /// Media items in the request.
    pub media: usize,
    pub fallback: Option<Fallback>,
    /// False when the shared load or log could not be updated (counted, not fatal).
    pub recorded: bool,
}

/// A VM's router.
#[derive(Debug)]
pub struct Router {
    pub config: FilterConfig,
    shared: SharedState,
    index: PrefixIndex,
    cursor: u64,
    matched: Vec<usize>,
    started: bool,
}

impl Router {
    pub fn new(config: FilterConfig) -> Router {
        let addresses: Vec<&str> = config.workers.iter().map(|w| w.address.as_str()).collect();
        let shared = SharedState::new(
            generation(&addresses, config.state.log_slots),
            config.workers.len(),
            config.state.log_slots,
        );
        let index = PrefixIndex::new(config.router.index.clone(), config.workers.len());
        Router {
            config,
            shared,
            index,
            cursor: 0,
            matched: Vec::new(),
            started: false,
        }
    }

    pub fn workers(&self) -> usize {
        self.config.workers.len()
    }

    /// Replays decisions other VMs (and this one) logged since the last sync.
    pub fn sync(&mut self, store: &dyn SharedStore) -> SyncStats {
        if !self.started {
            self.cursor = self.shared.start_cursor(store);
            self.started = true;
        }
        let index = &mut self.index;
        let workers = self.config.workers.len();
        self.shared.replay(store, &mut self.cursor, |record| {
            let worker = record.worker as usize;
            if worker < workers {
                index.insert(worker, &record.keys, record.time_ms);
            }
        })
    }

    /// Decides where a complete body goes, and records the decision in shared state.
    pub fn route(
        &mut self,
        body: &[u8],
        store: &dyn SharedStore,
        now_ms: u64,
        random: u64,
    ) -> (Decision, Option<Analysis>) {
        if body.len() > self.config.router.limits.max_body_bytes {
            return (
                self.route_without_body(Fallback::TooLarge, store, now_ms, random),
                None,
            );
        }
        let analysis = match analyze(body, &self.config.router) {
            Ok(a) => a,
            Err(e) => {
                let reason = AnalyzeError::reason(&e);
                return (
                    self.route_without_body(Fallback::Analyze(reason), store, now_ms, random),
                    None,
                );
            }
        };
        let decision = self.route_analysis(&analysis, store, now_ms, random);
        (decision, Some(analysis))
    }

    /// Routing of an analysed request: prefix match, load, choice, record.
    pub fn route_analysis(
        &mut self,
        analysis: &Analysis,
        store: &dyn SharedStore,
        now_ms: u64,
        random: u64,
    ) -> Decision {
        self.sync(store);
        let keys = &analysis.layout.keys;
        let max = self.config.state.max_record_blocks as usize;
        let keys = keys.get(..max.min(keys.len())).unwrap_or(keys);
        self.index.match_prefix(keys, now_ms, &mut self.matched);
        let (loads, healthy) = self.current_loads(store, now_ms);
        let total = keys.len();
        let (worker, matched) = self.choose_healthy(total, &loads, &healthy, random);
        // What the worker has left to prefill, in the scoring's unit: blocks (the partial last
        // block counts as one).
        let block_size = analysis.layout.block_size.max(1) as u64;
        let prefill = (analysis.layout.prompt_tokens as u64)
            .div_ceil(block_size)
            .saturating_sub(matched as u64);
        let logged = self
            .shared
            .append(store, worker as u32, now_ms, keys)
            .is_ok();
        let loaded = self.shared.add_load(store, worker, 1, prefill as i64);
        Decision {
            worker,
            matched_blocks: matched,
            total_blocks: total,
            prefill_blocks: prefill,
            media: analysis.media.len(),
            fallback: None,
            recorded: logged && loaded,
        }
    }

    /// Router-side loads merged with fresh engine metrics, and which workers are healthy.
    /// Metrics older than three poll periods are ignored; a worker whose last
    /// `unhealthy_after` polls failed is unhealthy, unless every worker is.
    fn current_loads(&self, store: &dyn SharedStore, now_ms: u64) -> (Vec<WorkerLoad>, Vec<bool>) {
        let mut loads = self.shared.loads(store);
        let poll = &self.config.metrics;
        if poll.poll_ms == 0 {
            let all = vec![true; loads.len()];
            return (loads, all);
        }
        let entries = self.shared.metrics(store);
        let fresh_for = poll.poll_ms.saturating_mul(3).max(poll.timeout_ms);
        let mut healthy: Vec<bool> = entries
            .iter()
            .map(|e| poll.unhealthy_after == 0 || e.failures < poll.unhealthy_after)
            .collect();
        healthy.resize(loads.len(), true);
        if !healthy.iter().any(|h| *h) {
            healthy.iter_mut().for_each(|h| *h = true);
        }
        for (load, entry) in loads.iter_mut().zip(&entries) {
            if let MetricsEntry {
                metrics:
                    Some(WorkerMetrics {
                        waiting,
                        running,
                        kv_usage,
                    }),
                updated_ms,
                ..
            } = *entry
                && now_ms.saturating_sub(updated_ms) <= fresh_for
            {
                load.waiting = Some(waiting);
                load.running = Some(running);
                load.kv_usage = Some(kv_usage);
            }
        }
        (loads, healthy)
    }

    /// [`choose`] over the healthy workers only; worker indices are the configuration's.
    fn choose_healthy(
        &self,
        total: usize,
        loads: &[WorkerLoad],
        healthy: &[bool],
        random: u64,
    ) -> (usize, usize) {
        let scoring = &self.config.router.scoring;
        if healthy.iter().all(|h| *h) {
            return match choose(total, &self.matched, loads, scoring, random) {
                Some(c) => (c.worker, c.matched_blocks),
                None => (least_loaded(loads, healthy, random), 0),
            };
        }
        let ids: Vec<usize> = (0..loads.len())
            .filter(|&w| healthy.get(w).copied().unwrap_or(true))
            .collect();
        let sub_loads: Vec<WorkerLoad> =
            ids.iter().filter_map(|&w| loads.get(w).copied()).collect();
        let sub_matched: Vec<usize> = ids
            .iter()
            .map(|&w| self.matched.get(w).copied().unwrap_or(0))
            .collect();
        match choose(total, &sub_matched, &sub_loads, scoring, random) {
            Some(c) => (ids.get(c.worker).copied().unwrap_or(0), c.matched_blocks),
            None => (least_loaded(loads, healthy, random), 0),
        }
    }

    /// Routes a request without its cache affinity (body unusable, over the size limit, or
    /// absent): the least-loaded healthy worker.
    pub fn route_without_body(
        &mut self,
        why: Fallback,
        store: &dyn SharedStore,
        now_ms: u64,
        random: u64,
    ) -> Decision {
        let (loads, healthy) = self.current_loads(store, now_ms);
        let worker = least_loaded(&loads, &healthy, random);
        let recorded = self.shared.add_load(store, worker, 1, 0);
        Decision {
            worker,
            matched_blocks: 0,
            total_blocks: 0,
            prefill_blocks: 0,
            media: 0,
            fallback: Some(why),
            recorded,
        }
    }

    /// Records one `/metrics` poll of `worker`: its text, or None when the poll failed
    /// (timeout, connection refused, non-200). Text without vLLM metrics counts as a failure.
    /// Returns whether the poll was good.
    pub fn record_poll(
        &self,
        store: &dyn SharedStore,
        worker: usize,
        text: Option<&str>,
        now_ms: u64,
    ) -> bool {
        let parsed = text.and_then(|t| crate::worker_metrics::parse_vllm_metrics(t).ok());
        self.shared.record_poll(store, worker, parsed, now_ms);
        parsed.is_some()
    }

    /// Takes or renews the poller lease for this VM (`holder` identifies it).
    pub fn poller_lease(&self, store: &dyn SharedStore, holder: u64, now_ms: u64) -> bool {
        let ttl = self.config.metrics.poll_ms.saturating_mul(3);
        self.config.metrics.poll_ms > 0 && self.shared.try_lease(store, holder, now_ms, ttl)
    }

    /// The worker's prefill is done (first response byte): release its prefill blocks.
    pub fn prefill_done(&self, store: &dyn SharedStore, worker: usize, prefill_blocks: u64) {
        if prefill_blocks > 0 {
            self.shared
                .add_load(store, worker, 0, -(prefill_blocks as i64));
        }
    }

    /// The stream ended (completed or reset): release what is left of its load.
    pub fn finished(&self, store: &dyn SharedStore, worker: usize, prefill_blocks: u64) -> bool {
        self.shared
            .add_load(store, worker, -1, -(prefill_blocks as i64))
    }

    /// Every worker's router-side load, as the shared table has it.
    pub fn loads(&self, store: &dyn SharedStore) -> Vec<WorkerLoad> {
        self.shared.loads(store)
    }
}

/// The eligible worker with the fewest in-flight requests (then fewest prefill blocks); ties
/// broken by `random` so that an idle cluster is spread evenly. `eligible[w]` false excludes
/// worker `w` (a missing entry counts as eligible); with no eligible worker, all are.
pub fn least_loaded(loads: &[WorkerLoad], eligible: &[bool], random: u64) -> usize {
    let is_eligible = |w: usize| eligible.get(w).copied().unwrap_or(true);
    let any = (0..loads.len()).any(is_eligible);
    let candidates = || {
        loads
            .iter()
            .enumerate()
            .filter(move |(w, _)| !any || is_eligible(*w))
    };
    let Some(best) = candidates()
        .map(|(_, l)| (l.inflight, l.prefill_blocks))
        .min()
    else {
        return 0;
    };
    let ties: Vec<usize> = candidates()
        .filter(|(_, l)| (l.inflight, l.prefill_blocks) == best)
        .map(|(w, _)| w)
        .collect();
    ties.get((random % ties.len().max(1) as u64) as usize)
        .copied()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::super::shared_state::MemoryStore;
    use super::*;
    use base64::Engine as _;
    use test_images::png;

    fn config(workers: usize) -> FilterConfig {
        let ws: Vec<String> = (0..workers)
            .map(|i| format!(r#"{{"name":"w{i}","address":"127.0.0.1:{}"}}"#, 8000 + i))
            .collect();
        FilterConfig::from_json(format!(r#"{{"workers":[{}]}}"#, ws.join(",")).as_bytes())
            .expect("config")
    }

    fn body(image: &[u8], text: &str) -> Vec<u8> {
        let b64 = base64::engine::general_purpose::STANDARD.encode(image);
        format!(
            r#"{{"model":"Qwen/Qwen2.5-VL-7B-Instruct","messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{b64}"}}}},{{"type":"text","text":"{text}"}}]}}]}}"#
        )
        .into_bytes()
    }

    #[test]
    fn same_image_goes_back_to_the_worker_that_has_it_even_from_another_vm() {
        let store = MemoryStore::default();
        let mut vm1 = Router::new(config(4));
        let mut vm2 = Router::new(config(4));
        let b = body(&png(640, 480), "what is this");
        let (first, _) = vm1.route(&b, &store, 1000, 3);
        assert_eq!(first.fallback, None);
        assert!(first.total_blocks > 10);
        assert_eq!(first.matched_blocks, 0);
        vm1.finished(&store, first.worker, first.prefill_blocks);
        let (second, _) = vm2.route(&b, &store, 2000, 1);
        assert_eq!(second.worker, first.worker);
        assert_eq!(second.matched_blocks, second.total_blocks);
    }

    #[test]
    fn load_is_counted_and_released() {
        let store = MemoryStore::default();
        let mut vm = Router::new(config(2));
        let (d, _) = vm.route(&body(&png(100, 100), "x"), &store, 0, 0);
        let loads = vm.loads(&store);
        assert_eq!(loads[d.worker].inflight, 1);
        assert_eq!(loads[d.worker].prefill_blocks, d.prefill_blocks);
        vm.prefill_done(&store, d.worker, d.prefill_blocks);
        assert_eq!(vm.loads(&store)[d.worker].prefill_blocks, 0);
        vm.finished(&store, d.worker, 0);
        assert_eq!(vm.loads(&store)[d.worker].inflight, 0);
    }

    #[test]
    fn bad_bodies_fall_back_to_the_least_loaded_worker() {
        let store = MemoryStore::default();
        let mut vm = Router::new(config(3));
        let (busy, _) = vm.route(&body(&png(64, 64), "a"), &store, 0, 0);
        let (d, a) = vm.route(b"not json", &store, 0, 0);
        assert_eq!(d.fallback, Some(Fallback::Analyze("bad_json")));
        assert!(a.is_none());
        assert_ne!(d.worker, busy.worker, "least loaded, not the busy one");
        let mut corrupt = png(64, 64);
        corrupt.truncate(20);
        let (d, _) = vm.route(&body(&corrupt, "a"), &store, 0, 0);
        assert_eq!(d.fallback, Some(Fallback::Analyze("bad_image")));
        let mut small = config(3);
        small.router.limits.max_body_bytes = 10;
        let mut vm = Router::new(small);
        let (d, _) = vm.route(&body(&png(64, 64), "a"), &store, 0, 0);
        assert_eq!(d.fallback, Some(Fallback::TooLarge));
    }

    #[test]
    fn engine_metrics_steer_and_failing_workers_are_skipped() {
        let store = MemoryStore::default();
        let mut vm = Router::new(config(2));
        let busy = "vllm:num_requests_waiting 40\nvllm:num_requests_running 60\nvllm:kv_cache_usage_perc 0.95\n";
        let idle = "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0.0\n";
        assert!(vm.record_poll(&store, 0, Some(busy), 1000));
        assert!(vm.record_poll(&store, 1, Some(idle), 1000));
        for seed in 0..8 {
            let (d, _) = vm.route(&body(&png(64 + seed, 64), "q"), &store, 1100, seed as u64);
            assert_eq!(d.worker, 1, "the engine says w0 is saturated");
            vm.finished(&store, d.worker, d.prefill_blocks);
        }
        // Metrics older than three poll periods no longer count.
        let (d0, _) = vm.route(&body(&png(200, 64), "q"), &store, 1000 + 1501, 0);
        let (d1, _) = vm.route(&body(&png(201, 64), "q"), &store, 1000 + 1501, 0);
        assert_ne!(d0.worker, d1.worker, "stale metrics ignored: load spreads");
        vm.finished(&store, d0.worker, d0.prefill_blocks);
        vm.finished(&store, d1.worker, d1.prefill_blocks);
        // w1 stops answering: after 3 failed polls it is skipped, even with its cache.
        let b = body(&png(300, 300), "again");
        let (first, _) = vm.route(&b, &store, 2000, 5);
        vm.finished(&store, first.worker, first.prefill_blocks);
        for t in 0..3 {
            assert!(!vm.record_poll(&store, first.worker, None, 2100 + t));
        }
        assert!(
            !vm.record_poll(&store, first.worker, Some("<html>"), 2200),
            "garbage is a failure"
        );
        let (second, _) = vm.route(&b, &store, 2300, 5);
        assert_ne!(second.worker, first.worker);
        let (fallback, _) = vm.route(b"{", &store, 2300, 5);
        assert_ne!(fallback.worker, first.worker, "fallbacks avoid it too");
        // A good poll brings it back, with its cache.
        assert!(vm.record_poll(&store, first.worker, Some(idle), 2400));
        let (third, _) = vm.route(&b, &store, 2500, 5);
        assert_eq!(third.worker, first.worker);
    }

    #[test]
    fn least_loaded_spreads_ties() {
        let loads = vec![WorkerLoad::default(); 4];
        let picks: std::collections::HashSet<usize> =
            (0..16).map(|r| least_loaded(&loads, &[], r)).collect();
        assert_eq!(picks.len(), 4);
        let mut loads = loads;
        loads[0].inflight = 1;
        loads[1].inflight = 1;
        loads[2].inflight = 1;
        assert_eq!(least_loaded(&loads, &[], 12345), 3);
        // An ineligible worker is passed over however idle; with none eligible, all count.
        assert!(least_loaded(&loads, &[true, true, true, false], 12345) < 3);
        assert_eq!(least_loaded(&loads, &[false; 4], 12345), 3);
    }
}
