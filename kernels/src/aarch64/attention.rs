//! The attention's tiles on NEON (issue 36): [`crate::attention::dots`] and
//! [`crate::attention::axpys`] as the x86-64 AVX-512 tiles compute them, on four lanes: up to
//! [`MAX_ROWS`] rows of `a` against each row of `b`, read once for all of them, the sums in
//! registers. Plain loops, no `array::from_fn` (see `aarch64::q4`).

use std::arch::aarch64::*;

use crate::attention::Tile;

/// Most rows of `a` per tile (query heads per KV head: 2 in Qwen3-TTS).
pub(crate) const MAX_ROWS: usize = 4;
/// Widest summed (dot) or output (axpy) axis taken, floats (the head dimension: 128 at 0.6B).
const MAX_WIDTH: usize = 512;

/// Whether the tiles take `rows` rows of width `k` (a multiple of 16: four registers per step).
pub(crate) fn dots_fit(rows: usize, k: usize) -> bool {
    (2..=MAX_ROWS).contains(&rows) && k.is_multiple_of(16) && (16..=MAX_WIDTH).contains(&k)
}

/// `y[oy + i·g.y + j·p.y] = Σ_c a[oa + i·g.a + c] · b[ob + j·p.b + c]` (see
/// [`crate::attention::dots`]).
///
/// # Safety
/// NEON (every aarch64 target); [`dots_fit`] holds for `t.g.size` and `t.width`.
pub(crate) unsafe fn dots(a: &[f32], b: &[f32], y: &mut [f32], t: Tile) {
    // SAFETY: the caller's contract, with the row count as a constant.
    unsafe {
        match t.g.size {
            2 => dots_g::<2>(a, b, y, t),
            3 => dots_g::<3>(a, b, y, t),
            _ => dots_g::<4>(a, b, y, t),
        }
    }
}

/// [`dots`] for `G` rows: four running sums per row (FMA latency), each `b` row read once.
#[target_feature(enable = "neon")]
#[allow(clippy::needless_range_loop)] // i indexes the rows and their sums together
unsafe fn dots_g<const G: usize>(a: &[f32], b: &[f32], y: &mut [f32], t: Tile) {
    let Tile { oa, ob, oy, g, p, width: k } = t;
    let mut rows = [&a[..0]; G];
    for i in 0..G {
        rows[i] = &a[oa + i * g.a..][..k];
    }
    for j in 0..p.size {
        let r = &b[ob + j * p.b..][..k];
        let mut acc = [[vdupq_n_f32(0.0); 4]; G];
        for c in (0..k).step_by(16) {
            for v in 0..4 {
                // SAFETY: 4 floats at c + 4v ≤ k − 4 of slices of k (k a multiple of 16).
                unsafe {
                    let x = vld1q_f32(r.as_ptr().add(c + 4 * v));
                    for i in 0..G {
                        acc[i][v] = vfmaq_f32(acc[i][v], vld1q_f32(rows[i].as_ptr().add(c + 4 * v)), x);
                    }
                }
            }
        }
        for i in 0..G {
            let s = vaddq_f32(vaddq_f32(acc[i][0], acc[i][1]), vaddq_f32(acc[i][2], acc[i][3]));
            y[oy + i * g.y + j * p.y] = vaddvq_f32(s);
        }
    }
}

/// `y[oy + i·g.y + c] = Σ_j a[oa + i·g.a + j·p.a] · b[ob + j·p.b + c]` (see
/// [`crate::attention::axpys`]).
///
/// # Safety
/// NEON (every aarch64 target); [`dots_fit`] holds for `t.g.size` and `t.width`.
pub(crate) unsafe fn axpys(a: &[f32], b: &[f32], y: &mut [f32], t: Tile) {
    // SAFETY: the caller's contract, with the row count as a constant.
    unsafe {
        match t.g.size {
            2 => axpys_g::<2>(a, b, y, t),
            3 => axpys_g::<3>(a, b, y, t),
            _ => axpys_g::<4>(a, b, y, t),
        }
    }
}

/// [`axpys`] for `G` rows: sixteen output columns at a time (four registers per row), summed
/// over every position in registers.
#[target_feature(enable = "neon")]
#[allow(clippy::needless_range_loop)] // i indexes the rows and their sums together
unsafe fn axpys_g<const G: usize>(a: &[f32], b: &[f32], y: &mut [f32], t: Tile) {
    let Tile { oa, ob, oy, g, p, width: n } = t;
    for c in (0..n).step_by(16) {
        let mut acc = [[vdupq_n_f32(0.0); 4]; G];
        for j in 0..p.size {
            let r = &b[ob + j * p.b..][..n];
            for v in 0..4 {
                // SAFETY: 4 floats at c + 4v ≤ n − 4 of a slice of n (n a multiple of 16).
                let x = unsafe { vld1q_f32(r.as_ptr().add(c + 4 * v)) };
                for i in 0..G {
                    acc[i][v] = vfmaq_n_f32(acc[i][v], x, a[oa + i * g.a + j * p.a]);
                }
            }
        }
        for i in 0..G {
            let out = &mut y[oy + i * g.y..][..n];
            for v in 0..4 {
                // SAFETY: as above.
                unsafe { vst1q_f32(out.as_mut_ptr().add(c + 4 * v), acc[i][v]) };
            }
        }
    }
}
