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
    let mut waiting = None::<f64>;
    let mut running = None::<f64>;
    let (mut kv_sum, mut kv_n) = (0.0f64, 0u32);
    let (mut old_kv_sum, mut old_kv_n) = (0.0f64, 0u32);
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, value)) = sample(line) else {
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
    Ok(WorkerMetrics {
        waiting: waiting.unwrap_or(0.0).max(0.0),
        running: running.unwrap_or(0.0).max(0.0),
        kv_usage: kv_usage.unwrap_or(0.0).clamp(0.0, 1.0),
    })
}

/// Everything the router reads from one scrape: the load, the KV capacity, and the totals the
/// prefill speed is derived from.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineStats {
    pub load: WorkerMetrics,
    /// `vllm:cache_config_info{num_gpu_blocks=..}` (summed over engines).
    pub num_gpu_blocks: Option<u64>,
    /// `vllm:cache_config_info{block_size=..}`.
    pub block_size: Option<u32>,
    /// `vllm:prompt_tokens_total − vllm:prefix_cache_hits_total`: prompt tokens the engine
    /// actually prefilled.
    pub uncached_prompt_tokens: Option<f64>,
    /// `vllm:request_prefill_time_seconds_sum`.
    pub prefill_seconds: Option<f64>,
}

/// Reads [`EngineStats`] from a worker's `/metrics` text. The load part must be there (as for
/// [`parse_vllm_metrics`]); the rest is optional.
pub fn parse_engine_stats(text: &str) -> Result<EngineStats, MetricsError> {
    let load = parse_vllm_metrics(text)?;
    let mut stats = EngineStats {
        load,
        ..EngineStats::default()
    };
    let (mut prompt, mut hits) = (None::<f64>, None::<f64>);
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, value)) = sample(line) else {
            continue;
        };
        match name {
            "vllm:cache_config_info" => {
                if let Some(n) = label(line, "num_gpu_blocks").and_then(|v| v.parse::<u64>().ok()) {
                    *stats.num_gpu_blocks.get_or_insert(0) += n;
                }
                if let Some(b) = label(line, "block_size").and_then(|v| v.parse::<u32>().ok()) {
                    stats.block_size = Some(b);
                }
            }
            "vllm:prompt_tokens_total" => *prompt.get_or_insert(0.0) += value,
            "vllm:prefix_cache_hits_total" => *hits.get_or_insert(0.0) += value,
            "vllm:request_prefill_time_seconds_sum" => {
                *stats.prefill_seconds.get_or_insert(0.0) += value;
            }
            _ => {}
        }
    }
    stats.uncached_prompt_tokens = prompt.map(|p| (p - hits.unwrap_or(0.0)).max(0.0));
    Ok(stats)
}

/// Prefill speed between two scrapes, in uncached prompt tokens per second: tokens prefilled
/// over prefill seconds spent in between. None when too little prefill happened (under 10 ms)
/// or the totals went backwards (an engine restart).
pub fn prefill_tps(
    (tokens_before, seconds_before): (f64, f64),
    (tokens_now, seconds_now): (f64, f64),
) -> Option<f64> {
    let tokens = tokens_now - tokens_before;
    let seconds = seconds_now - seconds_before;
    (seconds >= 0.01 && tokens > 0.0 && tokens.is_finite()).then(|| tokens / seconds)
}

/// The value of label `name` in a sample line (`name{a="1",b="2"} v`), unescaped lazily (the
/// values read here are numbers).
fn label<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let open = line.find('{')?;
    let labels = line.get(open + 1..)?;
    let mut rest = labels;
    loop {
        let eq = rest.find('=')?;
        let key = rest.get(..eq)?.trim().trim_start_matches(',').trim();
        let after = rest.get(eq + 1..)?.strip_prefix('"')?;
        let mut end = None;
        let mut escaped = false;
        for (i, c) in after.char_indices() {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                end = Some(i);
                break;
            }
        }
        let end = end?;
        if key == name {
            return after.get(..end);
        }
        rest = after.get(end + 1..)?;
        if rest.trim_start().starts_with('}') {
            return None;
        }
    }
}

/// Splits `name{labels} value [timestamp]` into name and a finite value.
fn sample(line: &str) -> Option<(&str, f64)> {
    let name_end = line
        .find(|c: char| c == '{' || c.is_ascii_whitespace())
        .unwrap_or(line.len());
    let name = line.get(..name_end)?;
    let mut rest = line.get(name_end..)?;
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
        rest = rest.get(end? + 1..)?;
    }
    let value: f64 = rest.split_ascii_whitespace().next()?.parse().ok()?;
    value.is_finite().then_some((name, value))
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
    fn reads_capacity_and_prefill_totals() {
        let text = format!(
            "{VLLM}vllm:cache_config_info{{block_size=\"16\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"4096\"}} 1.0\n\
             vllm:prompt_tokens_total{{engine=\"0\"}} 5.0e4\n\
             vllm:request_prefill_time_seconds_sum{{engine=\"0\"}} 4.5\n"
        );
        let s = parse_engine_stats(&text).expect("parses");
        assert_eq!(s.num_gpu_blocks, Some(4096));
        assert_eq!(s.block_size, Some(16));
        assert_eq!(s.uncached_prompt_tokens, Some(5.0e4 - 1.2e4));
        assert_eq!(s.prefill_seconds, Some(4.5));
        assert_eq!(s.load.waiting, 5.0);
        let bare = parse_engine_stats("vllm:num_requests_running 1\n").expect("parses");
        assert_eq!(bare.num_gpu_blocks, None);
        assert_eq!(bare.uncached_prompt_tokens, None);
        assert_eq!(prefill_tps((1000.0, 1.0), (9000.0, 2.0)), Some(8000.0));
        assert_eq!(
            prefill_tps((1000.0, 1.0), (1000.0, 1.0)),
            None,
            "no prefill"
        );
        assert_eq!(prefill_tps((9000.0, 2.0), (10.0, 0.1)), None, "restarted");
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
}
