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
