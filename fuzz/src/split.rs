//! How a fuzz input says where to cut a body into pieces, for the differential checks of the
//! incremental readers against their whole-input form.
//!
//! Streaming targets start with a control byte: its low nibble is the number `n` of piece
//! sizes that follow (0-15 bytes, each a size 0-255), its high nibble is four flag bits for
//! the target; the rest is the payload. The sizes are used in turn, cyclically, until the
//! payload is used up; a size of 0 feeds an empty piece. No sizes (or only zeros) feeds the
//! payload whole: `[0x00, ...]` feeds the payload whole, `[0x01, 0x01, ...]` one byte at a
//! time, `[0x02, 0x07, 0x00, ...]` seven bytes then an empty piece, and so on.

/// A streaming input taken apart.
pub struct Split<'a> {
    /// The high nibble of the control byte.
    pub flags: u8,
    pub sizes: &'a [u8],
    pub payload: &'a [u8],
}

/// Takes a streaming input apart (an empty input is an empty payload fed whole).
pub fn split(data: &[u8]) -> Split<'_> {
    let Some((&control, rest)) = data.split_first() else {
        return Split {
            flags: 0,
            sizes: &[],
            payload: &[],
        };
    };
    let n = usize::from(control & 0x0f).min(rest.len());
    let (sizes, payload) = rest.split_at(n);
    Split {
        flags: control >> 4,
        sizes,
        payload,
    }
}

/// The control byte and sizes for `flags` and piece `sizes` (how seeds are written).
pub fn header(flags: u8, sizes: &[u8]) -> Vec<u8> {
    let n = sizes.len().min(15);
    let mut out = vec![(flags << 4) | n as u8];
    out.extend_from_slice(&sizes[..n]);
    out
}

/// `payload` cut by `sizes` (see the module docs). Never more than `2 * payload.len() + 1`
/// pieces.
pub fn pieces<'a>(payload: &'a [u8], sizes: &[u8]) -> Vec<&'a [u8]> {
    if sizes.iter().all(|&s| s == 0) {
        return vec![payload];
    }
    let mut out = Vec::new();
    let mut at = 0;
    for &s in sizes.iter().cycle() {
        let end = (at + usize::from(s)).min(payload.len());
        out.push(&payload[at..end]);
        at = end;
        if at == payload.len() {
            break;
        }
    }
    out
}

/// Cuts of `payload` at pseudo-random points chosen by `seed` (1-8 cuts), for inputs that are
/// files as they are (the image targets) and so cannot carry sizes.
pub fn seeded_pieces(payload: &[u8], seed: u64) -> Vec<&[u8]> {
    let mut state = seed;
    let mut next = || {
        // splitmix64
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let n = 1 + (next() % 8) as usize;
    let mut cuts: Vec<usize> = (0..n)
        .map(|_| (next() % (payload.len() as u64 + 1)) as usize)
        .collect();
    cuts.sort_unstable();
    let mut out = Vec::with_capacity(n + 1);
    let mut from = 0;
    for c in cuts {
        out.push(&payload[from..c]);
        from = c;
    }
    out.push(&payload[from..]);
    out
}
