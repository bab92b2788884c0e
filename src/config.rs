//! The router's configuration: one JSON document, every field optional with a documented
//! default. The proxy-wasm filter, the CLI and the demos all read this shape; the filter adds
//! its workers and mode around it.

use crate::layout::DEFAULT_BLOCK_SIZE;
use crate::request::Limits;
use crate::scoring::ScoringConfig;
use crate::tokens::{MediaDefaults, ProfileConfig};

pub use crate::config_error::ConfigError;

#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    /// Tokens per KV block (default 16, vLLM's default). Must match the engine's block size for
    /// overlap counts to mean blocks of the engine.
    pub block_size: usize,
    pub limits: Limits,
    /// Model name → token-estimation profile.
    pub profiles: ProfileConfig,
    /// Token costs of media whose size cannot be read (URLs not fetched, video, audio).
    pub media: MediaDefaults,
    pub scoring: ScoringConfig,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            block_size: DEFAULT_BLOCK_SIZE,
            limits: Limits::default(),
            profiles: ProfileConfig::default(),
            media: MediaDefaults::default(),
            scoring: ScoringConfig::default(),
        }
    }
}

impl RouterConfig {
    /// Parses and validates a JSON configuration.
    pub fn from_json(text: &[u8]) -> Result<RouterConfig, ConfigError> {
        let config: RouterConfig = serde_json::from_slice(text).map_err(|e| json_error(&e))?;
        config.validate()?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=4096).contains(&self.block_size) {
            return Err(ConfigError::new("block_size", "must be 1..=4096"));
        }
        if self.limits.max_body_bytes == 0 {
            return Err(ConfigError::new("limits.max_body_bytes", "must be > 0"));
        }
        if self.limits.max_nesting < 4 {
            return Err(ConfigError::new(
                "limits.max_nesting",
                "must be at least 4 (chat bodies nest 4-6 deep)",
            ));
        }
        self.profiles
            .validate()
            .map_err(|e| ConfigError::new("profiles", e.to_string()))?;
        self.media.validate()?;
        self.scoring.validate()?;
        Ok(())
    }
}

/// serde_json's message names the field for unknown/invalid fields; keep it, and say where.
pub fn json_error(e: &serde_json::Error) -> ConfigError {
    let msg = e.to_string();
    // "unknown field `foo`, expected ..." / "missing field `foo` at line ..." → field foo (a
    // key may hold a backtick, and may be empty: named `""` then, found by the fuzz target
    // `config_router`).
    let field = ["unknown field `", "missing field `"]
        .iter()
        .find_map(|p| msg.strip_prefix(p))
        .and_then(|rest| {
            rest.find("`, ")
                .or_else(|| rest.find("` at "))
                .map(|end| rest.get(..end))
        })
        .flatten()
        .map_or("(document)", |f| if f.is_empty() { "\"\"" } else { f })
        .to_string();
    ConfigError::new(field, msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_document_is_the_default() {
        assert_eq!(RouterConfig::from_json(b"{}"), Ok(RouterConfig::default()));
    }

    #[test]
    fn printed_defaults_read_back_as_the_defaults() {
        let text = serde_json::to_vec(&RouterConfig::default()).expect("serialises");
        assert_eq!(RouterConfig::from_json(&text), Ok(RouterConfig::default()));
    }

    #[test]
    fn an_empty_or_backticked_unknown_key_is_named_as_it_is() {
        let e = RouterConfig::from_json(br#"{"": 1}"#).err();
        assert_eq!(e.map(|e| e.field), Some("\"\"".to_string()));
        let e = RouterConfig::from_json(br#"{"a`b, c": 1}"#).err();
        assert_eq!(e.map(|e| e.field), Some("a`b, c".to_string()));
        let e = RouterConfig::from_json(br#"{"limits": {"max_body_bytes` at x": 1}}"#).err();
        assert_eq!(e.map(|e| e.field), Some("max_body_bytes` at x".to_string()));
    }

    #[test]
    fn bad_fields_are_named() {
        let e = RouterConfig::from_json(br#"{"block_sise":16}"#).err();
        assert_eq!(e.map(|e| e.field), Some("block_sise".to_string()));
        let e = RouterConfig::from_json(br#"{"block_size":0}"#).err();
        assert_eq!(e.map(|e| e.field), Some("block_size".to_string()));
    }
}
