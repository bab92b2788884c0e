//! The data of a token-estimation profile: how it counts ([`Kind`]), a named profile before
//! overrides ([`Named`]) and a resolved one ([`Profile`]). Parsing and counting are in
//! `profile`, the overrides in `params`, each family's arithmetic in its own module.

use std::fmt;

/// How a profile counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// Qwen's `smart_resize`.
    SmartResize {
        patch_size: u32,
        merge_size: u32,
        min_pixels: u64,
        max_pixels: u64,
    },
    /// Gemma 4's aspect-ratio-preserving resize into a soft-token budget.
    Gemma4 {
        patch_size: u32,
        pooling: u32,
        budget: u32,
    },
    /// InternVL's dynamic tiling (448-px tiles plus a thumbnail).
    Tiles {
        max_tiles: u32,
        tokens_per_tile: u32,
    },
    Fixed {
        tokens: u32,
    },
    Factor {
        factor: u64,
    },
}

/// A named profile before overrides.
pub(super) struct Named {
    pub(super) name: &'static str,
    pub(super) kind: Kind,
    pub(super) markers: u32,
    /// The key a bare number in the spec sets (`gemma4:560`, `fixed:576`).
    pub(super) positional: Option<&'static str>,
}

/// A resolved token-estimation profile.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    /// Canonical spec, e.g. `qwen2.5-vl`, `gemma4:560`, `fixed:576`,
    /// `qwen2.5-vl:max_pixels=1003520`: the name, then the positional number if it differs from
    /// the default, then every parameter that differs from the named profile. Parsing it gives
    /// the same profile back. Also what `Display` prints.
    pub spec: String,
    pub(super) name: &'static str,
    pub(super) kind: Kind,
    pub(super) markers: u32,
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.spec)
    }
}
