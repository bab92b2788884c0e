//! How a [`Profile`] comes from its spec (the named profiles it starts from, then the
//! overrides), and its count for an image size (dispatching to the family modules).

use super::gemma::gemma4_tokens;
use super::internvl::internvl_tiles;
use super::kind::{Kind, Named, Profile};
use super::params::{ProfileParams, build};
use super::qwen::{QWEN3, QWEN25, smart_resize};
use super::{ImageTokens, TokenError, bad_size, bad_spec};

/// The named profile `name` (lower-case), before overrides.
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
