//! How many tokens a model spends on an image.
//!
//! A [`Profile`] turns an image size into the number of placeholder tokens the image expands to
//! in the engine's prompt ([`ImageTokens::tokens`]) plus the marker tokens around them
//! ([`ImageTokens::markers`]). The counts are bit-identical to the Hugging Face `transformers`
//! image processors (checked by `tests/tokens.rs` against `tests/fixtures/tokens.json`, which
//! `scripts/make-token-fixture.py` computes with transformers itself): integer arithmetic where
//! Python uses ints, `f64` where Python uses floats, Python's round-half-even, and
//! correctly-rounded int/int true division.
//!
//! # Profiles (spec strings)
//!
//! | spec | model family | count |
//! | --- | --- | --- |
//! | `qwen2.5-vl`, `qwen2-vl` | Qwen2-VL, Qwen2.5-VL | `smart_resize` with patch 14, merge 2 (factor 28), min_pixels 3136, max_pixels 12845056; tokens = (h'/28)·(w'/28); aspect ratio > 200 is an error; markers 2 (`<\|vision_start\|>`, `<\|vision_end\|>`) |
//! | `qwen3-vl`, `qwen3.5` | Qwen3-VL, Qwen3.5 | the same `smart_resize` (transformers uses the Qwen2-VL image processor for both) with patch 16, merge 2 (factor 32), min_pixels 65536, max_pixels 16777216; markers 2 |
//! | `gemma3` | Gemma 3 | 256; markers 4 (`\n\n`, `<start_of_image>`, `<end_of_image>`, `\n\n`) |
//! | `gemma4[:BUDGET]` | Gemma 4 | BUDGET ∈ {70, 140, 280, 560, 1120}, default 280; patch 16, pooling 3; the image is resized to the largest multiple-of-48 size within BUDGET·9 patches (transformers' `get_aspect_ratio_preserving_size`, including its thin-image rules); tokens = (H/16)·(W/16)/9; markers 2 (`<boi>`, `<eoi>`) |
//! | `llava` | LLaVA-1.5 | 576; markers 0 |
//! | `internvl[:MAX_TILES]` | InternVL | 448-px tiles: the grid with 1..=MAX_TILES (default 12) tiles whose aspect ratio is closest to the image's (ties: the larger grid while the image covers more than half of it), plus a thumbnail tile when the grid has more than one tile; 256 tokens per tile; markers 2 (`<img>`, `</img>`) |
//! | `fixed:N` | any | N; markers 0 |
//! | `factor:F` | llm-d's estimate | max(1, ⌊W·H/F⌋) (llm-d's `countFromDims`); markers 0 |
//!
//! # Parameter overrides
//!
//! Deployments change the processor configuration, so every parameter can be overridden, in the
//! spec (`qwen2.5-vl:max_pixels=1003520`, `gemma4:560:markers=2`, items separated by `:` or `,`)
//! or as a [`ProfileParams`] object on a [`ProfileRule`] or on the default. Keys:
//!
//! | key | applies to | meaning |
//! | --- | --- | --- |
//! | `patch_size` | qwen*, gemma4 | vision patch side in pixels (1..=1024) |
//! | `merge_size` | qwen*, gemma4 | spatial merge (Qwen) / pooling kernel (Gemma 4) side (1..=32) |
//! | `min_pixels`, `max_pixels` | qwen* | `smart_resize` pixel bounds (max ≥ 1, min ≤ max) |
//! | `budget` | gemma4 | max soft tokens, one of 70, 140, 280, 560, 1120 |
//! | `max_tiles` | internvl | most tiles (1..=256) |
//! | `tokens` | gemma3, llava, fixed, internvl (per tile) | a fixed count |
//! | `factor` | factor | pixels per token (≥ 1) |
//! | `markers` | all | marker tokens around the placeholders (0..=64) |
//!
//! A key that does not apply to the profile is an error, as are unknown keys and bad values.
//!
//! # Choosing a profile by model name
//!
//! [`ProfileConfig::resolve`] tries the configured [`ProfileRule`]s in order (case-insensitive
//! globs: `*` any run, `?` one character; first match wins), then [`BUILTIN_RULES`] (unless
//! `builtin_rules` is false), then `default`.
//!
//! # Where each part lives
//!
//! [`Profile`], its kinds and named profiles are data in `kind.rs`, parsed and counted in
//! `profile.rs`; [`ProfileParams`], the spec items and their validation in `params.rs`; the
//! model-name rules ([`ProfileConfig`]) in `rules.rs`.
//! The counts per family: Qwen's `smart_resize` in `qwen.rs`, Gemma 4's resize in `gemma.rs`,
//! InternVL's tiles in `internvl.rs` (`fixed` and `factor` are one line each in
//! [`Profile::image_tokens`]); the Python-exact arithmetic they share in `python_arith.rs`.

mod gemma;
mod internvl;
mod kind;
mod media_defaults;
mod params;
mod profile;
mod python_arith;
mod qwen;
mod rules;

pub use gemma::GEMMA4_BUDGETS;
pub use kind::Profile;
pub use media_defaults::MediaDefaults;
pub use params::ProfileParams;
pub use rules::{BUILTIN_RULES, ProfileConfig, ProfileRule, glob_match};

use std::fmt;

/// Placeholder tokens an image expands to in the prompt, and the marker tokens around them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ImageTokens {
    /// Placeholder tokens (what vLLM's placeholder range covers); markers not included.
    pub tokens: u32,
    /// Start/end marker tokens around the placeholders (e.g. 2 for Qwen's vision_start/end).
    pub markers: u32,
}

/// Why a profile or an image size is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenError {
    /// The profile spec, a parameter override or a rule is not valid.
    BadSpec(String),
    /// The image size is refused (zero side, aspect ratio over 200 for Qwen, a count that
    /// overflows u32), as the model's processor would refuse it.
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

pub(crate) fn bad_spec(msg: impl Into<String>) -> TokenError {
    TokenError::BadSpec(msg.into())
}

pub(crate) fn bad_size(msg: impl Into<String>) -> TokenError {
    TokenError::BadSize(msg.into())
}
