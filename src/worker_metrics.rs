//! A worker's load as its own `/metrics` reports it (vLLM's Prometheus text format).
//!
//! The router counts what it sent (in-flight requests, prefill tokens); the engine knows what
//! it is actually doing. From vLLM's metrics this reads:
//!
//! | metric | meaning | several series (DP ranks, engines) |
//! |---|---|---|
//! | `vllm:num_requests_waiting` | requests queued, not yet scheduled | summed |
//! | `vllm:num_requests_running` | requests running | summed |
//! | `vllm:kv_cache_usage_perc` | fraction of KV blocks in use, 0..1 | mean |
//!
//! (`vllm:gpu_cache_usage_perc`, the name before vLLM 0.10, is read when the new one is absent.)
//! The parser is a line scanner: comments and other metrics are skipped, label values may hold
//! any character, and a value that is not a finite number is ignored.
//!
//! [`parse_vllm_scrape`] reads more for the sidecar (`mmrouter-sidecar`), all summed over
//! series:
//!
//! | metric | what for |
//! |---|---|
//! | `vllm:cache_config_info{num_gpu_blocks, block_size}` (labels of an info gauge) | the worker's KV capacity in blocks and its block size |
//! | `vllm:prompt_tokens_total` | prompt tokens prefilled or hit in the cache |
//! | `vllm:prefix_cache_hits_total` | prompt tokens served from the prefix cache |
//! | `vllm:request_prefill_time_seconds_sum` | total time requests spent in prefill |
//!
//! and [`PrefillSpeed`] turns successive scrapes of the last three into the worker's observed
//! prefill speed.

use std::fmt;

/// Engine-reported load of one worker.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct WorkerMetrics {
    pub waiting: f64,
    pub running: f64,
    /// 0..1.
    pub kv_usage: f64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricsError {
    /// None of the vLLM load metrics is in the text.
    NoVllmMetrics,
}

impl fmt::Display for MetricsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetricsError::NoVllmMetrics => f.write_str(
                "no vllm:num_requests_waiting, vllm:num_requests_running or vllm:kv_cache_usage_perc",
            ),
        }
    }
}

impl std::error::Error for MetricsError {}

/// Reads a worker's load from its `/metrics` text.
pub fn parse_vllm_metrics(text: &str) -> Result<WorkerMetrics, MetricsError> {
    parse_vllm_scrape(text).map(|s| s.load)
}

/// Everything the sidecar reads from one `/metrics` scrape.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineScrape {
    pub load: WorkerMetrics,
    /// `num_gpu_blocks` of `vllm:cache_config_info`, summed over engines.
    pub num_gpu_blocks: Option<u64>,
    /// `block_size` of `vllm:cache_config_info` (the first series that has one).
    pub block_size: Option<u32>,
    /// The counters behind the prefill speed (absent when the worker does not export all three).
    pub prefill: Option<PrefillCounters>,
}

/// Reads load, cache configuration and prefill counters from a worker's `/metrics` text.
pub fn parse_vllm_scrape(text: &str) -> Result<EngineScrape, MetricsError> {
    let mut waiting = None::<f64>;
    let mut running = None::<f64>;
    let (mut kv_sum, mut kv_n) = (0.0f64, 0u32);
    let (mut old_kv_sum, mut old_kv_n) = (0.0f64, 0u32);
    let mut num_gpu_blocks = None::<u64>;
    let mut block_size = None::<u32>;
    let mut prompt_tokens = None::<f64>;
    let mut hit_tokens = None::<f64>;
    let mut prefill_seconds = None::<f64>;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, labels, value)) = sample(line) else {
            continue;
        };
        match name {
            "vllm:num_requests_waiting" => *waiting.get_or_insert(0.0) += value,
            "vllm:num_requests_running" => *running.get_or_insert(0.0) += value,
            "vllm:kv_cache_usage_perc" => {
                kv_sum += value;
                kv_n += 1;
            }
            "vllm:gpu_cache_usage_perc" => {
                old_kv_sum += value;
                old_kv_n += 1;
            }
            "vllm:cache_config_info" => {
                // vLLM writes `str()` of each field: "27264", or "None" before profiling.
                if let Some(n) =
                    label_value(labels, "num_gpu_blocks").and_then(|v| v.parse::<u64>().ok())
                {
                    let total = num_gpu_blocks.get_or_insert(0);
                    *total = total.saturating_add(n);
                }
                if block_size.is_none() {
                    block_size = label_value(labels, "block_size").and_then(|v| v.parse().ok());
                }
            }
            "vllm:prompt_tokens_total" => *prompt_tokens.get_or_insert(0.0) += value,
            "vllm:prefix_cache_hits_total" => *hit_tokens.get_or_insert(0.0) += value,
            "vllm:request_prefill_time_seconds_sum" => *prefill_seconds.get_or_insert(0.0) += value,
            _ => {}
        }
    }
    let kv_usage = if kv_n > 0 {
        Some(kv_sum / f64::from(kv_n))
    } else if old_kv_n > 0 {
        Some(old_kv_sum / f64::from(old_kv_n))
    } else {
        None
    };
    if waiting.is_none() && running.is_none() && kv_usage.is_none() {
        return Err(MetricsError::NoVllmMetrics);
    }
    let prefill = match (prompt_tokens, hit_tokens, prefill_seconds) {
        (Some(prompt_tokens), Some(hit_tokens), Some(prefill_seconds)) => Some(PrefillCounters {
            prompt_tokens,
            hit_tokens,
            prefill_seconds,
        }),
        _ => None,
    };
    Ok(EngineScrape {
        load: WorkerMetrics {
            waiting: waiting.unwrap_or(0.0).max(0.0),
            running: running.unwrap_or(0.0).max(0.0),
            kv_usage: kv_usage.unwrap_or(0.0).clamp(0.0, 1.0),
        },
        num_gpu_blocks,
        block_size,
        prefill,
    })
}

/// The monotonic counters of one scrape that the prefill speed is derived from.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PrefillCounters {
    /// `vllm:prompt_tokens_total`.
    pub prompt_tokens: f64,
    /// `vllm:prefix_cache_hits_total`.
    pub hit_tokens: f64,
    /// `vllm:request_prefill_time_seconds_sum`.
    pub prefill_seconds: f64,
}

/// A worker's observed prefill speed: uncached prompt tokens per second of prefill,
///
/// `d(prompt_tokens_total - prefix_cache_hits_total) / d(request_prefill_time_seconds_sum)`
///
/// between successive scrapes, smoothed as a ratio of exponentially decayed sums: each scrape
/// that shows new prefill time adds its token and time deltas to the sums after decaying them
/// by `0.5^(t / HALF_LIFE_MS)`, `t` being the time since the previous scrape that showed some.
/// So a request weighs by its prefill time, the estimate follows a change of speed within a
/// few half-lives of busy time, and an idle worker keeps its last estimate. A counter that
/// goes backwards (the engine restarted) starts the deltas over without forgetting the sums.
///
/// vLLM counts prompt tokens when a request is scheduled and observes its prefill time when
/// it finishes, so single deltas are noisy; the decayed sums spread that over several scrapes.
///
/// The speed stays unknown until the sums hold [`PrefillSpeed::MIN_SECONDS`] of prefill time:
/// over a few milliseconds, the scheduler's jitter decides the ratio (measured: two idle mock
/// engines at 5,300 and 12,100 tokens/s), and a worker measured slow by chance would lose every
/// close choice and get no traffic that could correct it. Unknown, it counts as fast as the
/// fleet (see `docs/ROUTING.md`).
#[derive(Debug, Clone, Default)]
pub struct PrefillSpeed {
    last: Option<PrefillCounters>,
    /// ms since the last scrape that showed new prefill time.
    since_data_ms: f64,
    tokens: f64,
    seconds: f64,
}

impl PrefillSpeed {
    /// Half-life of the smoothing, in ms of wall time between scrapes with new prefill time.
    pub const HALF_LIFE_MS: f64 = 5_000.0;
    /// Prefill time the (decayed) sums must hold before the speed is known, in seconds.
    pub const MIN_SECONDS: f64 = 0.5;

    pub fn new() -> PrefillSpeed {
        PrefillSpeed::default()
    }

    /// Feeds one scrape's counters, `elapsed_ms` after the previous one.
    pub fn observe(&mut self, c: PrefillCounters, elapsed_ms: f64) {
        let last = self.last.replace(c);
        if elapsed_ms.is_finite() && elapsed_ms > 0.0 {
            self.since_data_ms += elapsed_ms;
        }
        let Some(last) = last else { return };
        let d_prompt = c.prompt_tokens - last.prompt_tokens;
        let d_hits = c.hit_tokens - last.hit_tokens;
        let d_secs = c.prefill_seconds - last.prefill_seconds;
        if d_prompt < 0.0 || d_hits < 0.0 || d_secs < 0.0 {
            return; // a counter reset: this scrape is the new baseline
        }
        if d_secs <= 0.0 || !d_secs.is_finite() {
            return;
        }
        let w = 0.5f64.powf(self.since_data_ms / Self::HALF_LIFE_MS);
        self.tokens = self.tokens * w + (d_prompt - d_hits).max(0.0);
        self.seconds = self.seconds * w + d_secs;
        self.since_data_ms = 0.0;
    }

    /// Tokens per second, or `None` until the scrapes showed [`Self::MIN_SECONDS`] of
    /// prefill time.
    pub fn tokens_per_sec(&self) -> Option<f64> {
        (self.seconds >= Self::MIN_SECONDS)
            .then(|| self.tokens / self.seconds)
            .filter(|v| v.is_finite())
    }
}

/// The value of label `key` in a label set `{a="x",b="y"}` (unescaped).
fn label_value(labels: &str, key: &str) -> Option<String> {
    let inner = labels.strip_prefix('{')?;
    let mut rest = inner;
    loop {
        rest = rest.trim_start_matches([',', ' ']);
        let eq = rest.find('=')?;
        let name = rest.get(..eq)?.trim();
        rest = rest.get(eq + 1..)?.trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut escaped = false;
        let mut end = None;
        for (i, c) in rest.char_indices() {
            if escaped {
                value.push(match c {
                    'n' => '\n',
                    c => c,
                });
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                end = Some(i);
                break;
            } else {
                value.push(c);
            }
        }
        rest = rest.get(end? + 1..)?;
        if name == key {
            return Some(value);
        }
    }
}

/// Splits `name{labels} value [timestamp]` into name, label set (`{...}` or empty) and a
/// finite value.
fn sample(line: &str) -> Option<(&str, &str, f64)> {
    let name_end = line
        .find(|c: char| c == '{' || c.is_ascii_whitespace())
        .unwrap_or(line.len());
    let name = line.get(..name_end)?;
    let mut rest = line.get(name_end..)?;
    let mut labels = "";
    if rest.starts_with('{') {
        // Skip the label set, honouring quoted values with escapes.
        let mut in_quotes = false;
        let mut escaped = false;
        let mut end = None;
        for (i, c) in rest.char_indices() {
            if in_quotes {
                if escaped {
                    escaped = false;
                } else if c == '\\' {
                    escaped = true;
                } else if c == '"' {
                    in_quotes = false;
                }
            } else if c == '"' {
                in_quotes = true;
            } else if c == '}' {
                end = Some(i);
                break;
            }
        }
        let end = end?;
        labels = rest.get(..=end)?;
        rest = rest.get(end + 1..)?;
    }
    let value: f64 = rest.split_ascii_whitespace().next()?.parse().ok()?;
    value.is_finite().then_some((name, labels, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen2.5-VL-7B-Instruct"} 3.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen2.5-VL-7B-Instruct"} 2.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen2.5-VL-7B-Instruct"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="a } b \" c"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="x"} 0.75
vllm:prefix_cache_hits_total{engine="0",model_name="x"} 1.2e4
"#;

    #[test]
    fn reads_vllm_load_summing_and_averaging_engines() {
        let m = parse_vllm_metrics(VLLM).expect("parses");
        assert_eq!(m.waiting, 5.0);
        assert_eq!(m.running, 7.0);
        assert_eq!(m.kv_usage, 0.5);
    }

    #[test]
    fn old_kv_metric_name_and_missing_series() {
        let m = parse_vllm_metrics("vllm:gpu_cache_usage_perc 0.4\n").expect("parses");
        assert_eq!((m.waiting, m.running, m.kv_usage), (0.0, 0.0, 0.4));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert_eq!(
            parse_vllm_metrics("<html>502 Bad Gateway</html>"),
            Err(MetricsError::NoVllmMetrics)
        );
        assert_eq!(parse_vllm_metrics(""), Err(MetricsError::NoVllmMetrics));
        let weird = "vllm:num_requests_waiting{a=\"unterminated 4\nvllm:num_requests_waiting NaN\nvllm:num_requests_running{} +Inf\nvllm:num_requests_running 2";
        let m = parse_vllm_metrics(weird).expect("the one good sample");
        assert_eq!((m.waiting, m.running), (0.0, 2.0));
    }

    #[test]
    fn reads_cache_config_and_prefill_counters() {
        let text = format!(
            "{VLLM}# TYPE vllm:cache_config_info gauge\n\
             vllm:cache_config_info{{block_size=\"16\",cache_dtype=\"auto\",engine=\"0\",num_gpu_blocks=\"27264\",prefix_caching_hash_algo=\"sha256\"}} 1.0\n\
             vllm:cache_config_info{{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"100\"}} 1.0\n\
             vllm:prompt_tokens_total{{engine=\"0\",model_name=\"x\"}} 5.0e4\n\
             vllm:request_prefill_time_seconds_bucket{{engine=\"0\",le=\"0.3\",model_name=\"x\"}} 4.0\n\
             vllm:request_prefill_time_seconds_sum{{engine=\"0\",model_name=\"x\"}} 2.5\n\
             vllm:request_prefill_time_seconds_sum{{engine=\"1\",model_name=\"x\"}} 0.5\n"
        );
        let s = parse_vllm_scrape(&text).expect("parses");
        assert_eq!(s.load, parse_vllm_metrics(&text).unwrap());
        assert_eq!(s.num_gpu_blocks, Some(27364));
        assert_eq!(s.block_size, Some(16));
        assert_eq!(
            s.prefill,
            Some(PrefillCounters {
                prompt_tokens: 5.0e4,
                hit_tokens: 1.2e4,
                prefill_seconds: 3.0
            })
        );
    }

    #[test]
    fn cache_config_before_profiling_and_missing_counters() {
        let text = "vllm:num_requests_running 1\n\
                    vllm:cache_config_info{block_size=\"32\",num_gpu_blocks=\"None\"} 1.0\n\
                    vllm:prompt_tokens_total 10\n";
        let s = parse_vllm_scrape(text).unwrap();
        assert_eq!((s.num_gpu_blocks, s.block_size), (None, Some(32)));
        assert_eq!(s.prefill, None, "no prefill time series: no counters");
    }

    #[test]
    fn label_values_unescape_and_match_whole_names() {
        let l = r#"{xnum_gpu_blocks="1",a="q\"uo}te,b=\"2\"",num_gpu_blocks="7"}"#;
        assert_eq!(label_value(l, "num_gpu_blocks").as_deref(), Some("7"));
        assert_eq!(label_value(l, "a").as_deref(), Some("q\"uo}te,b=\"2\""));
        assert_eq!(label_value(l, "b"), None);
        assert_eq!(label_value("{a=\"unterminated", "a"), None);
        assert_eq!(label_value("", "a"), None);
    }

    fn counters(prompt: f64, hits: f64, secs: f64) -> PrefillCounters {
        PrefillCounters {
            prompt_tokens: prompt,
            hit_tokens: hits,
            prefill_seconds: secs,
        }
    }

    #[test]
    fn prefill_speed_is_uncached_tokens_over_prefill_time() {
        let mut p = PrefillSpeed::new();
        assert_eq!(p.tokens_per_sec(), None);
        p.observe(counters(1000.0, 0.0, 1.0), 0.0);
        assert_eq!(p.tokens_per_sec(), None, "one scrape has no delta");
        // 12 tokens in 2 ms of prefill: too little to tell a speed from the scheduler's jitter.
        p.observe(counters(1012.0, 0.0, 1.002), 100.0);
        assert_eq!(p.tokens_per_sec(), None);
        // 4000 more prompt tokens of which 1000 hit the cache, in 0.5 s more.
        p.observe(counters(5012.0, 1000.0, 1.502), 100.0);
        let v = p.tokens_per_sec().expect("known after 0.5 s of prefill");
        assert!((v - 6000.0).abs() < 1e-6, "{v}");
        // Idle scrapes (no new prefill time) keep the estimate.
        for _ in 0..100 {
            p.observe(counters(5012.0, 1000.0, 1.502), 100.0);
        }
        assert_eq!(p.tokens_per_sec(), Some(v));
    }

    #[test]
    fn prefill_speed_follows_a_change_and_survives_a_reset() {
        let mut p = PrefillSpeed::new();
        let (mut prompt, mut secs) = (0.0, 0.0);
        p.observe(counters(prompt, 0.0, secs), 0.0);
        for _ in 0..10 {
            prompt += 1000.0;
            secs += 1.0;
            p.observe(counters(prompt, 0.0, secs), 1000.0);
        }
        assert!((p.tokens_per_sec().unwrap() - 1000.0).abs() < 1e-6);
        // Twice as fast for 30 s: within 1% of the new speed (six half-lives).
        for _ in 0..30 {
            prompt += 2000.0;
            secs += 1.0;
            p.observe(counters(prompt, 0.0, secs), 1000.0);
        }
        let v = p.tokens_per_sec().unwrap();
        assert!(v > 1980.0 && v <= 2000.0, "{v}");
        // The engine restarted: counters fall to small values; no negative delta is used.
        p.observe(counters(10.0, 0.0, 0.01), 1000.0);
        assert_eq!(p.tokens_per_sec(), Some(v));
        p.observe(counters(10.0 + 2000.0, 0.0, 1.01), 1000.0);
        assert!(p.tokens_per_sec().unwrap() > 1980.0);
    }
}
