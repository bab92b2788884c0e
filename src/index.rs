//! Which blocks each worker is believed to hold. (Contract stub: being filled in.)

#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct IndexConfig {
    pub capacity_blocks: usize,
    pub ttl_ms: u64,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            capacity_blocks: 65536,
            ttl_ms: 120_000,
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct PrefixIndex {
    _priv: (),
}

impl IndexConfig {
    pub fn validate(&self) -> Result<(), crate::config::ConfigError> {
        Ok(())
    }
}

impl PrefixIndex {
    pub fn new(config: IndexConfig, workers: usize) -> PrefixIndex {
        let _ = (config, workers);
        PrefixIndex { _priv: () }
    }
    pub fn insert(&mut self, worker: usize, keys: &[u64], now_ms: u64) {
        let _ = (worker, keys, now_ms);
    }
    pub fn match_prefix(&self, keys: &[u64], now_ms: u64, out: &mut Vec<usize>) {
        let _ = (keys, now_ms);
        out.clear();
    }
}
