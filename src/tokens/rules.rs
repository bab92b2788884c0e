//! Choosing a profile by model name: [`ProfileConfig`]'s rules, the built-in rules, and the
//! glob they match with.

use super::kind::Profile;
use super::params::ProfileParams;
use super::{TokenError, bad_spec};

/// Built-in model-name rules (glob, spec), tried after the configured rules and before the
/// default. More specific patterns come first.
pub const BUILTIN_RULES: &[(&str, &str)] = &[
    ("*qwen3.5*", "qwen3.5"),
    ("*qwen3*vl*", "qwen3-vl"),
    ("*qwen2.5*vl*", "qwen2.5-vl"),
    ("*qwen2*vl*", "qwen2-vl"),
    ("*gemma-4*", "gemma4"),
    ("*gemma4*", "gemma4"),
    ("*gemma-3*", "gemma3"),
    ("*gemma3*", "gemma3"),
    ("*llava*", "llava"),
    ("*internvl*", "internvl"),
];

/// Case-insensitive glob: `*` matches any run (also empty), `?` exactly one character.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let p: Vec<char> = pattern.chars().flat_map(char::to_lowercase).collect();
    let n: Vec<char> = name.chars().flat_map(char::to_lowercase).collect();
    let (mut pi, mut ni) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        match p.get(pi) {
            Some('*') => {
                star = Some((pi, ni));
                pi += 1;
            }
            Some(c) if *c == '?' || Some(c) == n.get(ni) => {
                pi += 1;
                ni += 1;
            }
            _ => match star {
                Some((sp, sn)) => {
                    pi = sp + 1;
                    ni = sn + 1;
                    star = Some((sp, sn + 1));
                }
                None => return false,
            },
        }
    }
    p.get(pi..)
        .is_some_and(|rest| rest.iter().all(|c| *c == '*'))
}

/// Which profile a model gets: `rules` tried in order (first match wins), then
/// [`BUILTIN_RULES`] (if `builtin_rules`), then `default`.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProfileConfig {
    /// Rules tried first, in order (default: none).
    pub rules: Vec<ProfileRule>,
    /// Whether [`BUILTIN_RULES`] apply after `rules` (default true).
    pub builtin_rules: bool,
    /// Spec for models no rule matches (default `qwen2.5-vl`).
    pub default: String,
    /// Overrides applied to `default` (default none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_params: Option<ProfileParams>,
}

/// One model-name rule: models matching `pattern` get `profile` with `params`.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileRule {
    /// Case-insensitive glob over the model name (`*` any run, `?` one character).
    pub pattern: String,
    /// Profile spec, e.g. `qwen2.5-vl`, `gemma4:560`, `qwen2.5-vl:max_pixels=1003520`.
    pub profile: String,
    /// Overrides applied on top of `profile` (default none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params: Option<ProfileParams>,
}

impl Default for ProfileConfig {
    fn default() -> Self {
        ProfileConfig {
            rules: Vec::new(),
            builtin_rules: true,
            default: "qwen2.5-vl".into(),
            default_params: None,
        }
    }
}

static NO_PARAMS: ProfileParams = ProfileParams {
    patch_size: None,
    merge_size: None,
    min_pixels: None,
    max_pixels: None,
    budget: None,
    max_tiles: None,
    tokens: None,
    factor: None,
    markers: None,
};

impl ProfileConfig {
    /// The spec and overrides `model` resolves to, before parsing.
    pub fn select(&self, model: &str) -> (&str, &ProfileParams) {
        if let Some(rule) = self.rules.iter().find(|r| glob_match(&r.pattern, model)) {
            return (&rule.profile, rule.params.as_ref().unwrap_or(&NO_PARAMS));
        }
        if self.builtin_rules
            && let Some((_, spec)) = BUILTIN_RULES.iter().find(|(p, _)| glob_match(p, model))
        {
            return (spec, &NO_PARAMS);
        }
        (
            &self.default,
            self.default_params.as_ref().unwrap_or(&NO_PARAMS),
        )
    }

    /// The profile for `model`.
    pub fn resolve(&self, model: &str) -> Result<Profile, TokenError> {
        let (spec, params) = self.select(model);
        Profile::with_params(spec, params)
    }

    /// Checks every rule's pattern, spec and overrides, and the default's.
    pub fn validate(&self) -> Result<(), TokenError> {
        for (i, rule) in self.rules.iter().enumerate() {
            if rule.pattern.is_empty() {
                return Err(bad_spec(format!("rule {i}: empty pattern")));
            }
            Profile::with_params(&rule.profile, rule.params.as_ref().unwrap_or(&NO_PARAMS))
                .map_err(|e| {
                    bad_spec(format!(
                        "rule {i} (pattern `{}`): {}",
                        rule.pattern,
                        match e {
                            TokenError::BadSpec(m) | TokenError::BadSize(m) => m,
                        }
                    ))
                })?;
        }
        Profile::with_params(
            &self.default,
            self.default_params.as_ref().unwrap_or(&NO_PARAMS),
        )
        .map_err(|e| {
            bad_spec(format!(
                "default: {}",
                match e {
                    TokenError::BadSpec(m) | TokenError::BadSize(m) => m,
                }
            ))
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_matches_stars_and_questions_case_insensitively() {
        assert!(glob_match("*qwen2.5*vl*", "Qwen/Qwen2.5-VL-7B-Instruct"));
        assert!(glob_match("gemma-?-*", "GEMMA-3-27b"));
        assert!(!glob_match("gemma-?-*", "gemma-31"));
        assert!(glob_match("*", ""));
        assert!(!glob_match("a*b", "acbd"));
        assert!(glob_match("a*b*", "acbd"));
    }
}
