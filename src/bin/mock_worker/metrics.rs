//! `/metrics` in the Prometheus text format (0.0.4), with vLLM's metric names and labels
//! (`vllm/v1/metrics/loggers.py`): every series carries `model_name` and `engine` ("0").
//! Counters are written as prometheus_client writes them: `# TYPE name_total counter` and a
//! `name_total` sample (vLLM disables the `_created` series). Mock-only series use the
//! `mock:` prefix.

use crate::engine::{EngineConfig, Snapshot};
use crate::histogram::{Histogram, REQUEST_LATENCY_BUCKETS};
use std::fmt::Write as _;

/// Escapes a label value (backslash, double quote, newline).
fn escape(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

fn float(v: f64) -> String {
    // prometheus_client prints floats with a decimal point (`1.0`).
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

struct Writer {
    out: String,
    labels: String,
    model: String,
}

impl Writer {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, extra: &str, value: f64) {
        let sep = if extra.is_empty() { "" } else { "," };
        let _ = writeln!(
            self.out,
            "{name}{{{}{sep}{extra}}} {}",
            self.labels,
            float(value)
        );
    }

    fn gauge(&mut self, name: &str, help: &str, value: f64) {
        self.family(name, "gauge", help);
        self.sample(name, "", value);
    }

    fn counter(&mut self, name: &str, help: &str, value: u64) {
        self.family(name, "counter", help);
        self.sample(name, "", value as f64);
    }

    /// As prometheus_client writes a histogram: cumulative `_bucket` samples with `le`
    /// (labels sorted by name), then `_count` and `_sum`.
    fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.family(name, "histogram", help);
        let mut cumulative = 0u64;
        let bounds = REQUEST_LATENCY_BUCKETS.iter().map(|&le| float(le));
        for (le, n) in bounds.chain(["+Inf".to_string()]).zip(h.counts) {
            cumulative += n;
            let _ = writeln!(
                self.out,
                "{name}_bucket{{engine=\"0\",le=\"{le}\",model_name=\"{}\"}} {}",
                self.model,
                float(cumulative as f64)
            );
        }
        self.sample(&format!("{name}_count"), "", h.count as f64);
        self.sample(&format!("{name}_sum"), "", h.sum);
    }
}

/// Renders every metric.
pub fn render(model: &str, cfg: &EngineConfig, s: &Snapshot) -> String {
    let mut w = Writer {
        out: String::with_capacity(8192),
        labels: format!("engine=\"0\",model_name=\"{}\"", escape(model)),
        model: escape(model),
    };
    w.gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        s.running as f64,
    );
    w.gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        s.waiting as f64,
    );
    w.gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        s.kv_usage,
    );
    let st = &s.stats;
    w.counter(
        "vllm:prefix_cache_queries_total",
        "Prefix cache queries, in terms of number of queried tokens.",
        st.prefix_queries,
    );
    w.counter(
        "vllm:prefix_cache_hits_total",
        "Prefix cache hits, in terms of number of cached tokens.",
        st.prefix_hits,
    );
    w.counter(
        "vllm:mm_cache_queries_total",
        "Multi-modal cache queries, in terms of number of queried items.",
        st.mm_queries,
    );
    w.counter(
        "vllm:mm_cache_hits_total",
        "Multi-modal cache hits, in terms of number of cached items.",
        st.mm_hits,
    );
    w.counter(
        "vllm:prompt_tokens_total",
        "Number of prefill tokens processed.",
        st.prompt_tokens,
    );
    w.counter(
        "vllm:generation_tokens_total",
        "Number of generation tokens processed.",
        st.generation_tokens,
    );
    w.family(
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
    );
    for (reason, n) in [("stop", 0), ("length", st.success_length), ("abort", 0)] {
        w.sample(
            "vllm:request_success_total",
            &format!("finished_reason=\"{reason}\""),
            n as f64,
        );
    }
    w.histogram(
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        &st.prefill_time,
    );
    // An info metric: the value is 1, the configuration is in the labels. vLLM writes all
    // CacheConfig fields; the ones that matter to a router are here.
    let info = "vllm:cache_config_info";
    w.family(info, "gauge", "Information of the LLMEngine CacheConfig");
    let _ = writeln!(
        w.out,
        "{info}{{block_size=\"{}\",enable_prefix_caching=\"True\",engine=\"0\",\
         num_gpu_blocks=\"{}\"}} 1.0",
        cfg.block_size, cfg.num_gpu_blocks
    );
    w.counter(
        "mock:image_fetches_total",
        "Image URLs fetched over http by the mock worker.",
        s.image_fetches,
    );
    w.counter(
        "mock:encoder_runs_total",
        "Images run through the emulated encoder (not in the mm cache, not in the cached prefix).",
        st.encoder_runs,
    );
    w.counter(
        "mock:kv_blocks_stored_total",
        "KV blocks whose content entered the prefix cache (BlockStored).",
        s.blocks_stored,
    );
    w.counter(
        "mock:kv_blocks_removed_total",
        "Cached KV blocks evicted from the prefix cache (BlockRemoved).",
        s.blocks_removed,
    );
    w.gauge(
        "mock:kv_cached_blocks",
        "KV blocks currently holding cached content.",
        s.cached_blocks as f64,
    );
    w.counter(
        "mock:requests_aborted_total",
        "Requests whose client left before they finished.",
        st.aborted,
    );
    w.out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Stats;

    #[test]
    fn samples_carry_model_and_engine_labels() {
        let cfg = EngineConfig {
            block_size: 16,
            num_gpu_blocks: 99,
            max_num_seqs: 1,
            prefill_tokens_per_sec: 1.0,
            decode_tokens_per_sec: 1.0,
            encoder_ms_per_image: 0.0,
            time_scale: 0.0,
            mm_cache_items: 0,
        };
        let snap = Snapshot {
            running: 2,
            waiting: 3,
            kv_usage: 0.25,
            stats: Stats {
                prefix_hits: 7,
                ..Stats::default()
            },
            blocks_stored: 0,
            blocks_removed: 0,
            cached_blocks: 0,
            image_fetches: 1,
        };
        let text = render("a\"b", &cfg, &snap);
        assert!(
            text.contains("vllm:num_requests_waiting{engine=\"0\",model_name=\"a\\\"b\"} 3.0\n")
        );
        assert!(
            text.contains("vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"a\\\"b\"} 0.25\n")
        );
        assert!(
            text.contains("vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"a\\\"b\"} 7.0\n")
        );
        assert!(text.contains("num_gpu_blocks=\"99\"} 1.0\n"));
        assert!(text.contains("# TYPE vllm:prefix_cache_queries_total counter\n"));
    }

    #[test]
    fn prefill_time_is_a_cumulative_histogram_over_vllms_buckets() {
        let mut h = Histogram::default();
        for v in [0.1, 0.3, 0.31, 9000.0] {
            h.observe(v);
        }
        let snap = Snapshot {
            running: 0,
            waiting: 0,
            kv_usage: 0.0,
            stats: Stats {
                prefill_time: h,
                ..Stats::default()
            },
            blocks_stored: 0,
            blocks_removed: 0,
            cached_blocks: 0,
            image_fetches: 0,
        };
        let cfg = EngineConfig {
            block_size: 16,
            num_gpu_blocks: 1,
            max_num_seqs: 1,
            prefill_tokens_per_sec: 1.0,
            decode_tokens_per_sec: 1.0,
            encoder_ms_per_image: 0.0,
            time_scale: 0.0,
            mm_cache_items: 0,
        };
        let text = render("m", &cfg, &snap);
        let p = "vllm:request_prefill_time_seconds";
        assert!(text.contains(&format!("# TYPE {p} histogram\n")));
        for (le, n) in [
            ("0.3", "2.0"),
            ("0.5", "3.0"),
            ("7680.0", "3.0"),
            ("+Inf", "4.0"),
        ] {
            let line = format!("{p}_bucket{{engine=\"0\",le=\"{le}\",model_name=\"m\"}} {n}\n");
            assert!(text.contains(&line), "{line} in\n{text}");
        }
        assert!(text.contains(&format!("{p}_count{{engine=\"0\",model_name=\"m\"}} 4.0\n")));
        assert!(text.contains(&format!(
            "{p}_sum{{engine=\"0\",model_name=\"m\"}} 9000.71\n"
        )));
        assert_eq!(text.matches(&format!("{p}_bucket")).count(), 22);
    }
}
