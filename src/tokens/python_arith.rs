//! Python-exact arithmetic, so that token counts are bit-identical to transformers: Python's
//! int/int true division (correctly rounded) and `int()` of a float.

/// Python's `a / b` for non-negative ints: the correctly rounded quotient (round half to even).
/// `b` must be non-zero (callers check); returns +inf for b = 0 rather than panicking.
pub(super) fn int_div(a: u128, b: u128) -> f64 {
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
pub(super) fn to_u64(x: f64) -> u64 {
    // `as` saturates (and maps NaN to 0) for float-to-int casts.
    x as u64
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
}
