//! Choosing a worker: cache overlap against load.
//!
//! ## Cost
//! Every worker gets a cost in **block-equivalents of prefill work** (one block = the prefill of
//! one KV block of the request, 16 tokens by default); the lowest cost wins:
//!
//! ```text
//! cost(w) = prefill_weight × (total_blocks − overlap_credit × credited_blocks(w))
//!         + inflight_weight × inflight(w)
//!         + pending_prefill_weight × prefill_blocks(w)
//!         + waiting_weight × waiting(w)        (when known)
//!         + running_weight × running(w)        (when known)
//!         + kv_usage_weight × kv_usage(w)      (when known, 0..1)
//! ```
//!
//! `credited_blocks(w)` is the matched prefix of `w` from the index, except that a worker that
//! is herding ahead of the others gets 0 (see [`ScoringConfig::herding_margin`]).
//!
//! The first line is Dynamo's `prefill_blocks − overlap_credit × cached_blocks` (overlap
//! credit 1.0). Dynamo adds the worker's active decode blocks; the router here counts what it
//! knows without scraping, its own in-flight requests and their remaining prefill, plus the
//! engine's queue metrics when they are scraped. llm-d weighs normalised scores (queue 2,
//! kv-utilisation 2, prefix 3, i.e. prefix ≈ 43% of the total); here all terms are in the same
//! unit, so a weight says directly how many blocks of cache hit one unit of load is worth.
//! With the defaults, a worker holding a 64-block (1k-token) prefix is preferred over an idle
//! worker until it has 16 more requests in flight, or 8 (the herding margin) more requests in
//! flight than the least-loaded worker, whichever comes first.
//!
//! ## Choice
//! With `temperature` 0 the lowest cost wins. Costs within 1e-9 (relative) of the best are
//! ties: the tied worker with the fewest in-flight requests wins, and among those `random`
//! picks one, so equal workers share the traffic instead of the lowest index taking it all.
//! With `temperature > 0`, costs are min-max normalised to 0..1 over the workers and a worker
//! is sampled with probability ∝ `exp(−normalised / temperature)`, using `random`.
//!
//! `random` is mixed (splitmix64) before use, so a plain counter works; the result is a pure
//! function of the arguments.
//!
//! ## Robustness
//! Zero workers → `None`. Negative metrics count as 0 and `kv_usage` is clamped to 0..1. A
//! NaN or infinite metric makes that worker's cost infinite: it is chosen only if every worker
//! is in that state (then by in-flight count and `random`). Matched counts above
//! `total_blocks` are clamped to it.

use crate::config::ConfigError;

/// Scoring weights. Every field is optional in the JSON configuration; the defaults below are
/// the documented ones.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScoringConfig {
    /// Fraction of a matched block's prefill that counts as saved (default 1.0, as Dynamo's
    /// overlap credit: a cached block costs nothing to prefill). 0 ignores the cache (pure
    /// load balancing); above 1 over-weights cache hits. Unit: dimensionless, finite, >= 0.
    pub overlap_credit: f64,
    /// Cost of one uncached block of the request (default 1.0). This defines the cost unit;
    /// raising it makes cache overlap count more against the load terms. Unit: cost per
    /// block, finite, >= 0.
    pub prefill_weight: f64,
    /// Cost of one request routed to the worker and not finished (default 4.0 blocks per
    /// request). A request in flight mostly decodes, which slows the new request's prefill by
    /// a share of each engine step rather than by its own prompt: a few blocks' worth. It is
    /// the router's freshest load signal (metrics lag a scrape interval).
    pub inflight_weight: f64,
    /// Cost of one block still to prefill among the worker's in-flight requests (default 1.0:
    /// a block of another request waiting for prefill delays the new one as much as one of its
    /// own). Unit: cost per block, at whatever block size the router is configured with.
    pub pending_prefill_weight: f64,
    /// Cost of one request waiting in the engine's queue, from `vllm:num_requests_waiting`
    /// (default 16.0 blocks per request, a typical 256-token prompt; vLLM queues requests
    /// only when it is out of KV space or sequence slots, so a queue is a strong signal).
    pub waiting_weight: f64,
    /// Cost of one request running in the engine, from `vllm:num_requests_running` (default
    /// 2.0 blocks per request: half of `inflight_weight`, because running requests include
    /// this router's own in-flight ones, already counted).
    pub running_weight: f64,
    /// Cost of a full KV cache, from `vllm:kv_cache_usage_perc` (0..1) (default 32.0 blocks at
    /// 100%): between workers of equal overlap the emptier wins (50% vs 90% is 12.8 blocks),
    /// while a cache hit of more than 32 blocks still wins. Near full, the engine evicts cached
    /// blocks and preempts requests.
    pub kv_usage_weight: f64,
    /// Softmax temperature over min-max normalised costs (default 0 = always the lowest
    /// cost). 0.1 picks a worker whose normalised cost is 0.1 worse e^1 ≈ 2.7 times less
    /// often than the best. Finite, >= 0.
    pub temperature: f64,
    /// Hot-prefix herding guard (default 8 requests; `null` or 0 disables). A worker whose
    /// in-flight count exceeds the least-loaded worker's by more than this gets no credit for
    /// its cached blocks, so a stream of requests sharing one hot prefix spills to other
    /// workers (which then cache the prefix too) once the hot worker is this many requests
    /// ahead, instead of queueing behind it. 8 tolerates bursts of a few requests without
    /// throwing away cache hits, and stays well below vLLM's batch sizes, where queueing
    /// starts to cost whole prefills.
    pub herding_margin: Option<u32>,
}

impl Default for ScoringConfig {
    fn default() -> Self {
        ScoringConfig {
            overlap_credit: 1.0,
            prefill_weight: 1.0,
            inflight_weight: 4.0,
            pending_prefill_weight: 1.0,
            waiting_weight: 16.0,
            running_weight: 2.0,
            kv_usage_weight: 32.0,
            temperature: 0.0,
            herding_margin: Some(8),
        }
    }
}

impl ScoringConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let weights = [
            ("overlap_credit", self.overlap_credit),
            ("prefill_weight", self.prefill_weight),
            ("inflight_weight", self.inflight_weight),
            ("pending_prefill_weight", self.pending_prefill_weight),
            ("waiting_weight", self.waiting_weight),
            ("running_weight", self.running_weight),
            ("kv_usage_weight", self.kv_usage_weight),
            ("temperature", self.temperature),
        ];
        for (name, value) in weights {
            if !value.is_finite() || value < 0.0 {
                return Err(ConfigError::new(
                    format!("scoring.{name}"),
                    "must be a finite number >= 0",
                ));
            }
        }
        Ok(())
    }

    /// The effective herding margin (None when disabled).
    fn margin(&self) -> Option<u32> {
        self.herding_margin.filter(|&m| m > 0)
    }
}

/// What the router knows of one worker's load.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WorkerLoad {
    /// Requests this router sent to the worker that have not finished.
    pub inflight: u32,
    /// Blocks of those requests still to prefill (their uncached prompt, rounded up to whole
    /// blocks, until their first response byte).
    pub prefill_blocks: u64,
    /// Engine queue depth (`vllm:num_requests_waiting`), when scraped.
    pub waiting: Option<f64>,
    /// Running requests (`vllm:num_requests_running`), when scraped.
    pub running: Option<f64>,
    /// KV cache usage 0..1 (`vllm:kv_cache_usage_perc`), when scraped.
    pub kv_usage: Option<f64>,
}

/// The chosen worker and what the choice was based on (enough for the log line
/// `[ROUTING] Best: <worker> with <matched_blocks>/<total_blocks> blocks overlap`).
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub worker: usize,
    /// Blocks of the request the chosen worker holds (from the index, at most `total_blocks`).
    pub matched_blocks: usize,
    pub total_blocks: usize,
    /// Blocks credited in the cost: `matched_blocks`, or 0 when the herding guard removed the
    /// chosen worker's advantage.
    pub credited_blocks: usize,
    /// The chosen worker's cost (infinite only if every worker's was).
    pub cost: f64,
    /// The longest match over all workers (shows when the best cache was passed over).
    pub best_matched: usize,
    /// Workers whose cache credit the herding guard removed.
    pub herded: usize,
}

/// Chooses a worker for a request of `total_blocks` keyed blocks. `matched[w]` is the prefix
/// worker `w` holds (missing entries count as 0) and `loads[w]` its load; the workers are
/// `0..loads.len()`. See the module docs for the cost and the use of `random`.
pub fn choose(
    total_blocks: usize,
    matched: &[usize],
    loads: &[WorkerLoad],
    config: &ScoringConfig,
    random: u64,
) -> Option<Choice> {
    let mut costs = Vec::new();
    choose_with_costs(total_blocks, matched, loads, config, random, &mut costs)
}

/// [`choose`], also writing every worker's cost into `costs` (for logs and metrics;
/// `costs[w]` is worker `w`'s cost). Reusing the buffer saves `choose`'s one allocation.
pub fn choose_with_costs(
    total_blocks: usize,
    matched: &[usize],
    loads: &[WorkerLoad],
    config: &ScoringConfig,
    random: u64,
    costs: &mut Vec<f64>,
) -> Option<Choice> {
    let scorer = Scorer::new(total_blocks, matched, loads, config);
    costs.clear();
    costs.extend((0..loads.len()).map(|w| scorer.cost(w)));
    scorer.choose(random, costs)
}

struct Scorer<'a> {
    total: usize,
    matched: &'a [usize],
    loads: &'a [WorkerLoad],
    config: &'a ScoringConfig,
    /// In-flight count above which a worker loses its cache credit.
    herd_limit: Option<u64>,
}

impl<'a> Scorer<'a> {
    fn new(
        total: usize,
        matched: &'a [usize],
        loads: &'a [WorkerLoad],
        config: &'a ScoringConfig,
    ) -> Scorer<'a> {
        let min_inflight = loads.iter().map(|l| l.inflight).min();
        let herd_limit = match (config.margin(), min_inflight) {
            (Some(m), Some(min)) => Some(u64::from(min) + u64::from(m)),
            _ => None,
        };
        Scorer {
            total,
            matched,
            loads,
            config,
            herd_limit,
        }
    }

    fn matched(&self, w: usize) -> usize {
        self.matched.get(w).copied().unwrap_or(0).min(self.total)
    }

    fn load(&self, w: usize) -> WorkerLoad {
        self.loads.get(w).copied().unwrap_or_default()
    }

    fn herded(&self, w: usize) -> bool {
        self.herd_limit
            .is_some_and(|limit| u64::from(self.load(w).inflight) > limit)
    }

    fn credited(&self, w: usize) -> usize {
        if self.herded(w) { 0 } else { self.matched(w) }
    }

    fn cost(&self, w: usize) -> f64 {
        let c = self.config;
        let load = self.load(w);
        let mut cost = c.prefill_weight
            * (self.total as f64 - c.overlap_credit * self.credited(w) as f64)
            + c.inflight_weight * f64::from(load.inflight)
            + c.pending_prefill_weight * load.prefill_blocks as f64;
        for (value, weight, max) in [
            (load.waiting, c.waiting_weight, f64::INFINITY),
            (load.running, c.running_weight, f64::INFINITY),
            (load.kv_usage, c.kv_usage_weight, 1.0),
        ] {
            if let Some(v) = value {
                if !v.is_finite() {
                    return f64::INFINITY;
                }
                cost += weight * v.clamp(0.0, max);
            }
        }
        if cost.is_nan() { f64::INFINITY } else { cost }
    }

    fn choose(&self, random: u64, costs: &[f64]) -> Option<Choice> {
        if costs.is_empty() {
            return None;
        }
        let random = splitmix64(random);
        let worker = if self.config.temperature > 0.0 {
            self.sample(random, costs)
                .unwrap_or_else(|| self.argmin(random, costs))
        } else {
            self.argmin(random, costs)
        };
        let mut best_matched = 0;
        let mut herded = 0;
        for w in 0..costs.len() {
            let m = self.matched(w);
            best_matched = best_matched.max(m);
            if m > 0 && self.herded(w) {
                herded += 1;
            }
        }
        Some(Choice {
            worker,
            matched_blocks: self.matched(worker),
            total_blocks: self.total,
            credited_blocks: self.credited(worker),
            cost: costs.get(worker).copied().unwrap_or(f64::INFINITY),
            best_matched,
            herded,
        })
    }

    /// Lowest cost; ties by fewest in-flight, then by `random`.
    fn argmin(&self, random: u64, costs: &[f64]) -> usize {
        let best = costs.iter().copied().fold(f64::INFINITY, f64::min);
        let tol = 1e-9 * best.abs().max(1.0);
        let tied = |c: f64| c == best || (best.is_finite() && c - best <= tol);
        let candidates = || {
            costs
                .iter()
                .enumerate()
                .filter(move |&(_, &c)| tied(c))
                .map(|(w, _)| (w, self.load(w).inflight))
        };
        let fewest = candidates().map(|(_, i)| i).min().unwrap_or(0);
        let count = candidates().filter(|&(_, i)| i == fewest).count();
        let pick = pick_below(random, count);
        candidates()
            .filter(|&(_, i)| i == fewest)
            .nth(pick)
            .map_or(0, |(w, _)| w)
    }

    /// Softmax sample over normalised finite costs; None if no cost is finite.
    fn sample(&self, random: u64, costs: &[f64]) -> Option<usize> {
        let finite = || costs.iter().copied().filter(|c| c.is_finite());
        let min = finite().fold(f64::INFINITY, f64::min);
        let max = finite().fold(f64::NEG_INFINITY, f64::max);
        if !min.is_finite() {
            return None;
        }
        let range = max - min;
        let t = self.config.temperature;
        let weight = |c: f64| {
            if !c.is_finite() {
                0.0
            } else if range > 0.0 {
                (-((c - min) / range) / t).exp()
            } else {
                1.0
            }
        };
        let sum: f64 = costs.iter().map(|&c| weight(c)).sum();
        // The best worker has weight 1, so sum >= 1.
        let mut target = unit_f64(random) * sum;
        let mut last = None;
        for (w, &c) in costs.iter().enumerate() {
            let p = weight(c);
            if p > 0.0 {
                last = Some(w);
                if target < p {
                    return Some(w);
                }
                target -= p;
            }
        }
        last
    }
}

/// splitmix64's finaliser: spreads a counter or a weak random over all 64 bits.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Uniform in [0, 1) from the top 53 bits.
fn unit_f64(r: u64) -> f64 {
    (r >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Uniform in 0..n (0 when n is 0) by a multiply-high.
fn pick_below(r: u64, n: usize) -> usize {
    ((u128::from(r) * n as u128) >> 64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_spreads_a_counter() {
        let picks: Vec<usize> = (0..1000).map(|i| pick_below(splitmix64(i), 4)).collect();
        for k in 0..4 {
            let c = picks.iter().filter(|&&p| p == k).count();
            assert!((200..300).contains(&c), "{k}: {c}");
        }
        assert!(unit_f64(u64::MAX) < 1.0);
    }
}
