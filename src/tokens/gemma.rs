//! Gemma 4: the aspect-ratio-preserving resize into a soft-token budget. (Gemma 3 is a fixed
//! 256 tokens, a `Fixed` profile.)

use super::python_arith::{int_div, to_u64};
use super::{TokenError, bad_size};

/// Gemma 4's allowed budgets (transformers' `_SUPPORTED_SOFT_TOKENS`).
pub const GEMMA4_BUDGETS: [u32; 5] = [70, 140, 280, 560, 1120];

/// transformers' Gemma 4 `get_aspect_ratio_preserving_size` and the processor's token count.
pub(super) fn gemma4_tokens(
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
