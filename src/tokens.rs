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

use std::fmt;

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

fn bad_spec(msg: impl Into<String>) -> TokenError {
    TokenError::BadSpec(msg.into())
}

fn bad_size(msg: impl Into<String>) -> TokenError {
    TokenError::BadSize(msg.into())
}

/// Gemma 4's allowed budgets (transformers' `_SUPPORTED_SOFT_TOKENS`).
pub const GEMMA4_BUDGETS: [u32; 5] = [70, 140, 280, 560, 1120];

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

/// How a profile counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
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
struct Named {
    name: &'static str,
    kind: Kind,
    markers: u32,
    /// The key a bare number in the spec sets (`gemma4:560`, `fixed:576`).
    positional: Option<&'static str>,
}

const QWEN25: Kind = Kind::SmartResize {
    patch_size: 14,
    merge_size: 2,
    min_pixels: 3136,
    max_pixels: 12_845_056,
};
const QWEN3: Kind = Kind::SmartResize {
    patch_size: 16,
    merge_size: 2,
    min_pixels: 65_536,
    max_pixels: 16_777_216,
};

fn named(name: &str) -> Option<Named> {
    let (name, kind, markers, positional): (&'static str, Kind, u32, Option<&'static str>) =
        match name {
            "qwen2.5-vl" => ("qwen2.5-vl", QWEN25, 2, None),
            "qwen2-vl" => ("qwen2-vl", QWEN25, 2, None),
            "qwen3-vl" => ("qwen3-vl", QWEN3, 2, None),
            "qwen3.5" => ("qwen3.5", QWEN3, 2, None),
            "gemma3" => ("gemma3", Kind::Fixed { tokens: 256 }, 4, None),
            "gemma4" => (
                "gemma4",
                Kind::Gemma4 {
                    patch_size: 16,
                    pooling: 3,
                    budget: 280,
                },
                2,
                Some("budget"),
            ),
            "llava" => ("llava", Kind::Fixed { tokens: 576 }, 0, None),
            "internvl" => (
                "internvl",
                Kind::Tiles {
                    max_tiles: 12,
                    tokens_per_tile: 256,
                },
                2,
                Some("max_tiles"),
            ),
            // `fixed` and `factor` need their number; 0 marks "not given yet".
            "fixed" => ("fixed", Kind::Fixed { tokens: u32::MAX }, 0, Some("tokens")),
            "factor" => ("factor", Kind::Factor { factor: 0 }, 0, Some("factor")),
            _ => return None,
        };
    Some(Named {
        name,
        kind,
        markers,
        positional,
    })
}

const NAMES: &str = "qwen2.5-vl, qwen2-vl, qwen3-vl, qwen3.5, gemma3, gemma4[:BUDGET], llava, \
                     internvl[:MAX_TILES], fixed:N, factor:F";

/// A resolved token-estimation profile.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    /// Canonical spec, e.g. `qwen2.5-vl`, `gemma4:560`, `fixed:576`,
    /// `qwen2.5-vl:max_pixels=1003520`: the name, then the positional number if it differs from
    /// the default, then every parameter that differs from the named profile. Parsing it gives
    /// the same profile back. Also what `Display` prints.
    pub spec: String,
    name: &'static str,
    kind: Kind,
    markers: u32,
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.spec)
    }
}

fn parse_num<T: std::str::FromStr>(key: &str, value: &str) -> Result<T, TokenError> {
    value.trim().parse::<T>().map_err(|_| {
        bad_spec(format!(
            "`{key}` needs a non-negative integer, got `{value}`"
        ))
    })
}

impl ProfileParams {
    /// Sets one key from its text value (spec syntax `key=value`).
    fn set(&mut self, key: &str, value: &str) -> Result<(), TokenError> {
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
    fn overlay(&mut self, other: &ProfileParams) {
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

impl Profile {
    /// Parses a spec: `NAME[:ITEM]*` where an item is a bare number (the profile's positional
    /// parameter: gemma4's budget, internvl's max tiles, fixed's count, factor's divisor) or
    /// `key=value`; items may also be separated by `,`. Names are case-insensitive.
    pub fn parse(spec: &str) -> Result<Profile, TokenError> {
        Profile::with_params(spec, &ProfileParams::default())
    }

    /// Parses `spec` and applies `params` on top (params win over values in the spec).
    pub fn with_params(spec: &str, params: &ProfileParams) -> Result<Profile, TokenError> {
        let spec_lower = spec.trim().to_ascii_lowercase();
        let mut items = spec_lower.split([':', ',']);
        let name = items.next().unwrap_or("").trim();
        let base = named(name).ok_or_else(|| {
            bad_spec(format!(
                "unknown profile `{}` (known: {NAMES})",
                spec.trim()
            ))
        })?;
        let mut given = ProfileParams::default();
        let mut positional_seen = false;
        for item in items {
            let item = item.trim();
            if item.is_empty() {
                return Err(bad_spec(format!("empty item in `{}`", spec.trim())));
            }
            if let Some((key, value)) = item.split_once('=') {
                given.set(key.trim(), value)?;
            } else {
                let key = base.positional.ok_or_else(|| {
                    bad_spec(format!(
                        "`{}` takes no bare value (got `{item}`); use key=value",
                        base.name
                    ))
                })?;
                if positional_seen {
                    return Err(bad_spec(format!(
                        "`{}` takes one bare value, got another: `{item}`",
                        base.name
                    )));
                }
                positional_seen = true;
                given.set(key, item)?;
            }
        }
        given.overlay(params);
        build(&base, &given)
    }

    /// The profile's name (`qwen2.5-vl`, `gemma4`, ...).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Marker tokens around each image's placeholders.
    pub fn markers(&self) -> u32 {
        self.markers
    }

    /// Placeholder and marker tokens for an image of `width` × `height` pixels.
    pub fn image_tokens(&self, width: u32, height: u32) -> Result<ImageTokens, TokenError> {
        if width == 0 || height == 0 {
            return Err(bad_size(format!("{width}x{height}: zero width or height")));
        }
        let (w, h) = (u64::from(width), u64::from(height));
        let tokens: u128 = match self.kind {
            Kind::SmartResize {
                patch_size,
                merge_size,
                min_pixels,
                max_pixels,
            } => {
                let factor = u64::from(patch_size) * u64::from(merge_size);
                let (rh, rw) = smart_resize(h, w, factor, min_pixels, max_pixels)?;
                u128::from(rh / factor) * u128::from(rw / factor)
            }
            Kind::Gemma4 {
                patch_size,
                pooling,
                budget,
            } => gemma4_tokens(h, w, u64::from(patch_size), u64::from(pooling), budget)?,
            Kind::Tiles {
                max_tiles,
                tokens_per_tile,
            } => u128::from(internvl_tiles(h, w, max_tiles)) * u128::from(tokens_per_tile),
            Kind::Fixed { tokens } => u128::from(tokens),
            Kind::Factor { factor } => {
                (u128::from(w) * u128::from(h) / u128::from(factor.max(1))).max(1)
            }
        };
        let tokens = u32::try_from(tokens).map_err(|_| {
            bad_size(format!(
                "{width}x{height}: {tokens} tokens under `{}` overflow u32",
                self.spec
            ))
        })?;
        Ok(ImageTokens {
            tokens,
            markers: self.markers,
        })
    }
}

/// Applies `given` to `base`, validates, and writes the canonical spec.
fn build(base: &Named, given: &ProfileParams) -> Result<Profile, TokenError> {
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

// ---------------------------------------------------------------------------------------------
// Python-exact arithmetic

/// Python's `a / b` for non-negative ints: the correctly rounded quotient (round half to even).
/// `b` must be non-zero (callers check); returns +inf for b = 0 rather than panicking.
pub(crate) fn int_div(a: u128, b: u128) -> f64 {
    const EXACT: u128 = 1 << 53;
    if b == 0 {
        return f64::INFINITY;
    }
    if a < EXACT && b < EXACT {
        // Both convert exactly; IEEE division is correctly rounded.
        return a as f64 / b as f64;
    }
    if a == 0 {
        return 0.0;
    }
    // q = floor(a * 2^k / b) with at least 55 significant bits, plus a sticky bit; then round
    // to 53 bits (half to even) and scale by 2^-k. Inputs here are below 2^70, so a * 2^k fits.
    let bits = |x: u128| 128 - x.leading_zeros() as i32;
    let k = (55 + bits(b) - bits(a)).max(0);
    let Some(num) = a.checked_shl(k as u32).filter(|n| n >> k == a) else {
        return a as f64 / b as f64; // unreachable for our inputs; approximate, never panic
    };
    let mut q = num / b;
    let mut sticky = num % b != 0;
    let mut exp = -k;
    // Reduce q to exactly 54 bits (53 + one rounding bit), folding dropped bits into sticky.
    while bits(q) > 54 {
        sticky |= q & 1 == 1;
        q >>= 1;
        exp += 1;
    }
    let round_bit = q & 1 == 1;
    let mut m = q >> 1;
    exp += 1;
    if round_bit && (sticky || m & 1 == 1) {
        m += 1;
    }
    // m < 2^54 converts exactly; scaling by a power of two is exact in the normal range.
    (m as f64) * 2f64.powi(exp)
}

/// Python's `int(x)` / `math.floor` result for a finite non-negative float, saturating.
fn to_u64(x: f64) -> u64 {
    // `as` saturates (and maps NaN to 0) for float-to-int casts.
    x as u64
}

/// transformers' `smart_resize` (Qwen2-VL image processor), returning (height, width).
fn smart_resize(
    h: u64,
    w: u64,
    factor: u64,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(u64, u64), TokenError> {
    let (long, short) = (h.max(w), h.min(w));
    if short == 0 || factor == 0 {
        return Err(bad_size("zero width or height"));
    }
    let ratio = int_div(u128::from(long), u128::from(short));
    if ratio > 200.0 {
        return Err(bad_size(format!(
            "{w}x{h}: absolute aspect ratio must be at most 200, got {ratio}"
        )));
    }
    let f = factor as f64;
    let round = |x: u64| to_u64(int_div(u128::from(x), u128::from(factor)).round_ties_even());
    let mut h_bar = round(h).saturating_mul(factor);
    let mut w_bar = round(w).saturating_mul(factor);
    let area = u128::from(h) * u128::from(w);
    let bar_area = u128::from(h_bar) * u128::from(w_bar);
    if bar_area > u128::from(max_pixels) {
        let beta = int_div(area, u128::from(max_pixels)).sqrt();
        h_bar = factor.max(to_u64((h as f64 / beta / f).floor()).saturating_mul(factor));
        w_bar = factor.max(to_u64((w as f64 / beta / f).floor()).saturating_mul(factor));
    } else if bar_area < u128::from(min_pixels) {
        let beta = int_div(u128::from(min_pixels), area).sqrt();
        h_bar = to_u64((h as f64 * beta / f).ceil()).saturating_mul(factor);
        w_bar = to_u64((w as f64 * beta / f).ceil()).saturating_mul(factor);
    }
    Ok((h_bar, w_bar))
}

/// transformers' Gemma 4 `get_aspect_ratio_preserving_size` and the processor's token count.
fn gemma4_tokens(
    h: u64,
    w: u64,
    patch: u64,
    pooling: u64,
    budget: u32,
) -> Result<u128, TokenError> {
    let max_patches = u128::from(budget) * u128::from(pooling * pooling);
    let target_px = max_patches * u128::from(patch * patch);
    let total_px = u128::from(h) * u128::from(w);
    if total_px == 0 {
        return Err(bad_size("zero width or height"));
    }
    let factor = int_div(target_px, total_px).sqrt();
    let ideal_h = factor * h as f64;
    let ideal_w = factor * w as f64;
    let side = patch * pooling;
    let sidef = side as f64;
    let mut th = u128::from(to_u64((ideal_h / sidef).floor())) * u128::from(side);
    let mut tw = u128::from(to_u64((ideal_w / sidef).floor())) * u128::from(side);
    if th == 0 && tw == 0 {
        return Err(bad_size(format!(
            "{w}x{h}: resizes to 0x0 under gemma4 (side multiple {side})"
        )));
    }
    let max_side = (max_patches / u128::from(pooling * pooling)) * u128::from(side);
    if th == 0 {
        th = u128::from(side);
        let q = u128::from(to_u64(int_div(u128::from(w), u128::from(h)).floor()));
        tw = (q * u128::from(side)).min(max_side);
    } else if tw == 0 {
        tw = u128::from(side);
        let q = u128::from(to_u64(int_div(u128::from(h), u128::from(w)).floor()));
        th = (q * u128::from(side)).min(max_side);
    }
    if th * tw > target_px {
        return Err(bad_size(format!(
            "{w}x{h}: resizes to {tw}x{th}, more than {max_patches} patches"
        )));
    }
    let p = u128::from(patch);
    Ok((th / p) * (tw / p) / u128::from(pooling * pooling))
}

/// InternVL tile count: transformers' `get_optimal_tiled_canvas` over the grids with 1..=max
/// tiles (ordered by tile count, then by columns, as `get_all_supported_aspect_ratios`), plus a
/// thumbnail when the grid has more than one tile.
fn internvl_tiles(h: u64, w: u64, max_tiles: u32) -> u32 {
    const TILE: u128 = 448;
    let aspect = int_div(u128::from(w), u128::from(h));
    let area = u128::from(w) * u128::from(h);
    let mut best_diff = f64::INFINITY;
    let mut best = 1u32;
    for tiles in 1..=max_tiles {
        for cols in 1..=tiles {
            if tiles % cols != 0 {
                continue;
            }
            let rows = tiles / cols;
            let diff = (aspect - int_div(u128::from(cols), u128::from(rows))).abs();
            if diff < best_diff {
                best_diff = diff;
                best = tiles;
            } else if diff == best_diff && 2 * area > TILE * TILE * u128::from(tiles) {
                // Python: area > 0.5 * 448 * 448 * cols * rows (exact in both).
                best = tiles;
            }
        }
    }
    if best > 1 { best + 1 } else { 1 }
}

// ---------------------------------------------------------------------------------------------
// Model-name rules

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
    fn int_div_matches_python_true_division_bit_for_bit() {
        // (a, b, repr(a / b)) printed by CPython 3.11.
        let cases: [(u128, u128, f64); 20] = [
            (9007199254740993, 1, 9007199254740992.0),
            (9007199254740995, 1, 9007199254740996.0),
            (18446744073709551615, 3, 6.148914691236517e+18),
            (100000000000000000001, 7, 1.4285714285714287e+19),
            (3458764513820540929, 288230376151711745, 12.0),
            (18446744065119617025, 12845056, 1436096819283.5918),
            (12845056, 9223372056182128635, 1.3926637591715032e-12),
            (73786976294838214657, 8192, 9007199254740994.0),
            (17485029721327973433, 108729892840529, 160811.61550460427),
            (52043324769939697460, 2996, 1.7370936171541956e+16),
            (56410123510666598494, 691672907343361485, 81.55606922256301),
            (7713914763314685787, 194804717, 39598192908.823074),
            (7830996856503103183, 62093, 126117225073729.78),
            (48526483038975438938, 148, 3.278816421552394e+17),
            (7317463276519295734, 25008887, 292594519560.9583),
            (15835947990754891583, 40454894147, 391447025.74705),
            (39066371340976677869, 895759484249, 43612567.91350606),
            (3333813313834826389, 12495589, 266799213213.14478),
            (46997590065355503059, 289, 1.626214189112647e+17),
            (
                11418711589407294901,
                9808507260218814805,
                1.1641640553929262,
            ),
        ];
        for (a, b, want) in cases {
            assert_eq!(int_div(a, b).to_bits(), want.to_bits(), "{a} / {b}");
        }
        assert_eq!(int_div(1, 3), 1.0 / 3.0);
        assert_eq!(int_div(0, 3), 0.0);
        assert_eq!(int_div(3, 0), f64::INFINITY);
    }

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
