//! InternVL: dynamic tiling into 448-px tiles plus a thumbnail.

use super::python_arith::int_div;

/// InternVL tile count: transformers' `get_optimal_tiled_canvas` over the grids with 1..=max
/// tiles (ordered by tile count, then by columns, as `get_all_supported_aspect_ratios`), plus a
/// thumbnail when the grid has more than one tile.
pub(super) fn internvl_tiles(h: u64, w: u64, max_tiles: u32) -> u32 {
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
