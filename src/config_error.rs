//! A configuration that was refused: the one error type every concept's config validation
//! returns (block size, limits, scoring, state sizes, the filter's plugin configuration), so
//! that each concept owns its config type and its checks while [`crate::config::RouterConfig`]
//! only composes them. A leaf: it depends on nothing in the crate.

use std::fmt;

/// A configuration that was refused, naming the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "configuration field `{}`: {}", self.field, self.message)
    }
}

impl std::error::Error for ConfigError {}

impl ConfigError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
        ConfigError {
            field: field.into(),
            message: message.into(),
        }
    }
}
