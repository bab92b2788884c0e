//! [`ProfileParams`]: parameter overrides, given as an object or as `key=value` spec items,
//! and how they apply to a named profile: which keys fit which profile, their ranges, and the
//! canonical spec of the result.

use super::gemma::GEMMA4_BUDGETS;
use super::kind::{Kind, Named, Profile};
use super::{TokenError, bad_spec};

/// Parameter overrides applied on top of a named profile (see the module docs for which key
/// applies to which profile). `None` keeps the profile's value.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProfileParams {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub patch_size: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub merge_size: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_pixels: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_pixels: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tiles: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub factor: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub markers: Option<u32>,
}

pub(super) fn parse_num<T: std::str::FromStr>(key: &str, value: &str) -> Result<T, TokenError> {
    value.trim().parse::<T>().map_err(|_| {
        bad_spec(format!(
            "`{key}` needs a non-negative integer, got `{value}`"
        ))
    })
}

impl ProfileParams {
    /// Sets one key from its text value (spec syntax `key=value`).
    pub(super) fn set(&mut self, key: &str, value: &str) -> Result<(), TokenError> {
        match key {
            "patch_size" => self.patch_size = Some(parse_num(key, value)?),
            "merge_size" => self.merge_size = Some(parse_num(key, value)?),
            "min_pixels" => self.min_pixels = Some(parse_num(key, value)?),
            "max_pixels" => self.max_pixels = Some(parse_num(key, value)?),
            "budget" => self.budget = Some(parse_num(key, value)?),
            "max_tiles" => self.max_tiles = Some(parse_num(key, value)?),
            "tokens" => self.tokens = Some(parse_num(key, value)?),
            "factor" => self.factor = Some(parse_num(key, value)?),
            "markers" => self.markers = Some(parse_num(key, value)?),
            _ => {
                return Err(bad_spec(format!(
                    "unknown parameter `{key}` (known: patch_size, merge_size, min_pixels, \
                     max_pixels, budget, max_tiles, tokens, factor, markers)"
                )));
            }
        }
        Ok(())
    }

    /// `other`'s values win where given.
    pub(super) fn overlay(&mut self, other: &ProfileParams) {
        macro_rules! take {
            ($($f:ident),*) => { $( if other.$f.is_some() { self.$f = other.$f; } )* };
        }
        take!(
            patch_size, merge_size, min_pixels, max_pixels, budget, max_tiles, tokens, factor,
            markers
        );
    }

    /// The keys that are set, in canonical order.
    fn given(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        macro_rules! push {
            ($($f:ident),*) => { $( if self.$f.is_some() { out.push(stringify!($f)); } )* };
        }
        push!(
            patch_size, merge_size, min_pixels, max_pixels, budget, max_tiles, tokens, factor,
            markers
        );
        out
    }
}

/// Applies `given` to `base`, validates, and writes the canonical spec.
pub(super) fn build(base: &Named, given: &ProfileParams) -> Result<Profile, TokenError> {
    let inapplicable = |key: &str| {
        bad_spec(format!(
            "parameter `{key}` does not apply to profile `{}`",
            base.name
        ))
    };
    let mut kind = base.kind;
    match &mut kind {
        Kind::SmartResize {
            patch_size,
            merge_size,
            min_pixels,
            max_pixels,
        } => {
            for key in ["budget", "max_tiles", "tokens", "factor"] {
                if given.given().contains(&key) {
                    return Err(inapplicable(key));
                }
            }
            *patch_size = given.patch_size.unwrap_or(*patch_size);
            *merge_size = given.merge_size.unwrap_or(*merge_size);
            *min_pixels = given.min_pixels.unwrap_or(*min_pixels);
            *max_pixels = given.max_pixels.unwrap_or(*max_pixels);
            check_range("patch_size", u64::from(*patch_size), 1, 1024)?;
            check_range("merge_size", u64::from(*merge_size), 1, 32)?;
            if *max_pixels == 0 {
                return Err(bad_spec("`max_pixels` must be at least 1"));
            }
            if *min_pixels > *max_pixels {
                return Err(bad_spec(format!(
                    "`min_pixels` ({min_pixels}) is greater than `max_pixels` ({max_pixels})"
                )));
            }
        }
        Kind::Gemma4 {
            patch_size,
            pooling,
            budget,
        } => {
            for key in ["min_pixels", "max_pixels", "max_tiles", "tokens", "factor"] {
                if given.given().contains(&key) {
                    return Err(inapplicable(key));
                }
            }
            *patch_size = given.patch_size.unwrap_or(*patch_size);
            *pooling = given.merge_size.unwrap_or(*pooling);
            *budget = given.budget.unwrap_or(*budget);
            check_range("patch_size", u64::from(*patch_size), 1, 1024)?;
            check_range("merge_size", u64::from(*pooling), 1, 32)?;
            if !GEMMA4_BUDGETS.contains(budget) {
                return Err(bad_spec(format!(
                    "gemma4 budget must be one of 70, 140, 280, 560, 1120, got {budget}"
                )));
            }
        }
        Kind::Tiles {
            max_tiles,
            tokens_per_tile,
        } => {
            for key in [
                "patch_size",
                "merge_size",
                "min_pixels",
                "max_pixels",
                "budget",
                "factor",
            ] {
                if given.given().contains(&key) {
                    return Err(inapplicable(key));
                }
            }
            *max_tiles = given.max_tiles.unwrap_or(*max_tiles);
            *tokens_per_tile = given.tokens.unwrap_or(*tokens_per_tile);
            check_range("max_tiles", u64::from(*max_tiles), 1, 256)?;
        }
        Kind::Fixed { tokens } => {
            for key in [
                "patch_size",
                "merge_size",
                "min_pixels",
                "max_pixels",
                "budget",
                "max_tiles",
                "factor",
            ] {
                if given.given().contains(&key) {
                    return Err(inapplicable(key));
                }
            }
            *tokens = given.tokens.unwrap_or(*tokens);
            if base.name == "fixed" && given.tokens.is_none() {
                return Err(bad_spec("`fixed` needs a count, e.g. `fixed:576`"));
            }
        }
        Kind::Factor { factor } => {
            for key in [
                "patch_size",
                "merge_size",
                "min_pixels",
                "max_pixels",
                "budget",
                "max_tiles",
                "tokens",
            ] {
                if given.given().contains(&key) {
                    return Err(inapplicable(key));
                }
            }
            *factor = given.factor.ok_or_else(|| {
                bad_spec("`factor` needs a divisor, e.g. `factor:1024` (llm-d's default)")
            })?;
            if *factor == 0 {
                return Err(bad_spec("`factor` must be at least 1"));
            }
        }
    }
    let markers = given.markers.unwrap_or(base.markers);
    check_range("markers", u64::from(markers), 0, 64)?;

    // Canonical spec: name, positional (if it differs from the default or is required), then
    // the other keys that differ from the named profile.
    let value_of = |kind: &Kind, markers: u32, key: &str| -> Option<u64> {
        let v = match (kind, key) {
            (_, "markers") => u64::from(markers),
            (Kind::SmartResize { patch_size, .. }, "patch_size")
            | (Kind::Gemma4 { patch_size, .. }, "patch_size") => u64::from(*patch_size),
            (Kind::SmartResize { merge_size, .. }, "merge_size")
            | (
                Kind::Gemma4 {
                    pooling: merge_size,
                    ..
                },
                "merge_size",
            ) => u64::from(*merge_size),
            (Kind::SmartResize { min_pixels, .. }, "min_pixels") => *min_pixels,
            (Kind::SmartResize { max_pixels, .. }, "max_pixels") => *max_pixels,
            (Kind::Gemma4 { budget, .. }, "budget") => u64::from(*budget),
            (Kind::Tiles { max_tiles, .. }, "max_tiles") => u64::from(*max_tiles),
            (
                Kind::Tiles {
                    tokens_per_tile, ..
                },
                "tokens",
            ) => u64::from(*tokens_per_tile),
            (Kind::Fixed { tokens }, "tokens") => u64::from(*tokens),
            (Kind::Factor { factor }, "factor") => *factor,
            _ => return None,
        };
        Some(v)
    };
    let mut spec = base.name.to_string();
    if let Some(key) = base.positional {
        let now = value_of(&kind, markers, key);
        let required = matches!(base.name, "fixed" | "factor");
        if let Some(v) = now
            && (required || now != value_of(&base.kind, base.markers, key))
        {
            spec.push(':');
            spec.push_str(&v.to_string());
        }
    }
    let mut rest = Vec::new();
    for key in [
        "patch_size",
        "merge_size",
        "min_pixels",
        "max_pixels",
        "budget",
        "max_tiles",
        "tokens",
        "factor",
        "markers",
    ] {
        if Some(key) == base.positional {
            continue;
        }
        let now = value_of(&kind, markers, key);
        if let Some(v) = now
            && now != value_of(&base.kind, base.markers, key)
        {
            rest.push(format!("{key}={v}"));
        }
    }
    if !rest.is_empty() {
        spec.push(':');
        spec.push_str(&rest.join(","));
    }
    Ok(Profile {
        spec,
        name: base.name,
        kind,
        markers,
    })
}

fn check_range(key: &str, v: u64, lo: u64, hi: u64) -> Result<(), TokenError> {
    if (lo..=hi).contains(&v) {
        Ok(())
    } else {
        Err(bad_spec(format!("`{key}` must be {lo}..={hi}, got {v}")))
    }
}
