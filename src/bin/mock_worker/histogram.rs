//! The mock's phase-timing histograms, over vLLM's buckets (written out by [`crate::metrics`]).

/// vLLM's `REQUEST_LATENCY_BUCKETS` (`vllm/v1/metrics/buckets.py`), the default buckets of
/// its request phase-timing histograms, `request_prefill_time_seconds` among them.
pub const REQUEST_LATENCY_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A Prometheus histogram over [`REQUEST_LATENCY_BUCKETS`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    /// Observations per bucket (not cumulative); the last one is above every bound.
    pub(crate) counts: [u64; REQUEST_LATENCY_BUCKETS.len() + 1],
    pub sum: f64,
    pub count: u64,
}

impl Histogram {
    pub fn observe(&mut self, v: f64) {
        let i = REQUEST_LATENCY_BUCKETS
            .iter()
            .position(|&le| v <= le)
            .unwrap_or(REQUEST_LATENCY_BUCKETS.len());
        if let Some(c) = self.counts.get_mut(i) {
            *c += 1;
        }
        self.sum += v;
        self.count += 1;
    }
}
