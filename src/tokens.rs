//! How many tokens a model spends on an image. (Contract stub: being filled in.)

use std::fmt;

/// A resolved token-estimation profile.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    /// Canonical spec, e.g. `qwen2.5-vl`, `gemma4:560`, `fixed:576`.
    pub spec: String,
}

/// Placeholder tokens an image expands to in the prompt, and the marker tokens around them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ImageTokens {
    /// Placeholder tokens (what vLLM's placeholder range covers); markers not included.
    pub tokens: u32,
    /// Start/end marker tokens around the placeholders (e.g. 2 for Qwen's vision_start/end).
    pub markers: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenError {
    BadSpec(String),
    BadSize(String),
}

impl fmt::Display for TokenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenError::BadSpec(s) => write!(f, "bad profile spec: {s}"),
            TokenError::BadSize(s) => write!(f, "image size not accepted: {s}"),
        }
    }
}

impl std::error::Error for TokenError {}

impl Profile {
    pub fn parse(spec: &str) -> Result<Profile, TokenError> {
        Ok(Profile {
            spec: spec.to_string(),
        })
    }

    pub fn image_tokens(&self, width: u32, height: u32) -> Result<ImageTokens, TokenError> {
        let _ = (width, height);
        Ok(ImageTokens {
            tokens: 576,
            markers: 0,
        })
    }
}

/// Which profile a model gets: rules tried in order (first match wins), then `default`.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProfileConfig {
    pub rules: Vec<ProfileRule>,
    pub default: String,
}

#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileRule {
    /// Case-insensitive glob over the model name (`*` any run, `?` one character).
    pub pattern: String,
    pub profile: String,
}

impl Default for ProfileConfig {
    fn default() -> Self {
        ProfileConfig {
            rules: Vec::new(),
            default: "qwen2.5-vl".into(),
        }
    }
}

impl ProfileConfig {
    pub fn resolve(&self, model: &str) -> Result<Profile, TokenError> {
        let _ = model;
        Profile::parse(&self.default)
    }
    pub fn validate(&self) -> Result<(), TokenError> {
        Ok(())
    }
}
