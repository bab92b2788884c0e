//! Choosing a worker: cache overlap against load. (Contract stub: being filled in.)

#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScoringConfig {
    pub overlap_credit: f64,
}

impl Default for ScoringConfig {
    fn default() -> Self {
        ScoringConfig {
            overlap_credit: 1.0,
        }
    }
}

impl ScoringConfig {
    pub fn validate(&self) -> Result<(), crate::config::ConfigError> {
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WorkerLoad {
    pub inflight: u32,
    pub prefill_tokens: u64,
    pub waiting: Option<f64>,
    pub running: Option<f64>,
    pub kv_usage: Option<f64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub worker: usize,
    pub matched_blocks: usize,
    pub total_blocks: usize,
}

pub fn choose(
    total_blocks: usize,
    matched: &[usize],
    loads: &[WorkerLoad],
    config: &ScoringConfig,
    random: u64,
) -> Option<Choice> {
    let _ = (loads, config, random);
    if matched.is_empty() {
        return None;
    }
    Some(Choice {
        worker: 0,
        matched_blocks: matched.first().copied().unwrap_or(0),
        total_blocks,
    })
}
