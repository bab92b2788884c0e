//! Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5: transformers' `smart_resize` (the Qwen2-VL
//! image processor, which transformers uses for all of them), and the two named parameter sets.

use super::kind::Kind;
use super::python_arith::{int_div, to_u64};
use super::{TokenError, bad_size};

/// Qwen2-VL and Qwen2.5-VL: patch 14, merge 2 (factor 28), 3136..=12845056 pixels.
pub(super) const QWEN25: Kind = Kind::SmartResize {
    patch_size: 14,
    merge_size: 2,
    min_pixels: 3136,
    max_pixels: 12_845_056,
};
/// Qwen3-VL and Qwen3.5: patch 16, merge 2 (factor 32), 65536..=16777216 pixels.
pub(super) const QWEN3: Kind = Kind::SmartResize {
    patch_size: 16,
    merge_size: 2,
    min_pixels: 65_536,
    max_pixels: 16_777_216,
};

/// transformers' `smart_resize` (Qwen2-VL image processor), returning (height, width).
pub(super) fn smart_resize(
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
