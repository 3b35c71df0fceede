//! The attention's products on x86-64: the dot product and `axpy` compiled for AVX2 + FMA, and
//! AVX-512 tiles (up to [`tiles::MAX_ROWS`] rows of `a` against one row of `b` at a time, each `b` row
//! read once for all of them, the sums in registers); moved here unchanged from
//! `backend_tract::runtime_matmul` ([`crate::attention`]; issue 36).

use crate::portable::attention::{axpy_lanes, dot_lanes};

/// `Σ a[i] · b[i]` on AVX2 + FMA ([`dot_lanes`]).
#[target_feature(enable = "avx2,fma")]
pub(crate) fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_lanes(a, b)
}

/// `y[i] += s · b[i]` on AVX2 + FMA ([`axpy_lanes`]).
#[target_feature(enable = "avx2,fma")]
pub(crate) fn axpy_avx2(y: &mut [f32], s: f32, b: &[f32]) {
    axpy_lanes(y, s, b)
}

/// The AVX-512 tiles.
pub(crate) mod tiles {
    use std::arch::x86_64::*;

    use crate::attention::Tile;

    /// Most rows of `a` per tile (query heads per KV head: 2 in Qwen3-TTS's talker and
    /// predictor, 16 query heads over 8 KV heads).
    pub(crate) const MAX_ROWS: usize = 4;
    /// Widest summed (dot) or output (axpy) axis taken, floats (the head dimension: 128 at
    /// 0.6B): a row of `a` stays in L1 while the rows of `b` stream past it.
    const MAX_WIDTH: usize = 512;

    fn avx512() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
    }

    /// Whether [`dots`] (and [`axpys`]) take `rows` rows of width `k` on this CPU (a single row has no `b` row
    /// to share: the general loops take it; axes of size 1 are gone before this point anyway).
    pub(crate) fn dots_fit(rows: usize, k: usize) -> bool {
        (2..=MAX_ROWS).contains(&rows) && k.is_multiple_of(16) && (16..=MAX_WIDTH).contains(&k) && avx512()
    }

    /// `y[oy + i·g.y + j·p.y] = Σ_c a[oa + i·g.a + c] · b[ob + j·p.b + c]` for every row `i` of
    /// the axis `g` and `j` of `p`, `c < k` (the tile's width), of the tile `t`.
    ///
    /// # Safety
    /// AVX-512F; every index above is in bounds; `2 ≤ g.size ≤ MAX_ROWS`, `k` a multiple of 16
    /// up to `MAX_WIDTH`.
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

    #[target_feature(enable = "avx512f")]
    unsafe fn dots_g<const G: usize>(a: &[f32], b: &[f32], y: &mut [f32], t: Tile) {
        let Tile { oa, ob, oy, g, p, width: k } = t;
        let rows: [&[f32]; G] = std::array::from_fn(|i| &a[oa + i * g.a..][..k]);
        for j in 0..p.size {
            let r = &b[ob + j * p.b..][..k];
            let mut acc = [_mm512_setzero_ps(); G];
            for c in (0..k).step_by(16) {
                // SAFETY: 16 floats at c ≤ k − 16 of slices of k.
                unsafe {
                    let x = _mm512_loadu_ps(r.as_ptr().add(c));
                    for i in 0..G {
                        acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(rows[i].as_ptr().add(c)), x, acc[i]);
                    }
                }
            }
            for (i, s) in acc.iter().enumerate() {
                y[oy + i * g.y + j * p.y] = _mm512_reduce_add_ps(*s);
            }
        }
    }

    /// `y[oy + i·g.y + c] = Σ_j a[oa + i·g.a + j·p.a] · b[ob + j·p.b + c]` for every row `i` of
    /// the axis `g` and `c < n` (the tile's width), summed over `j` of `p`, of the tile `t`.
    ///
    /// # Safety
    /// AVX-512F; every index above is in bounds; `2 ≤ g.size ≤ MAX_ROWS`, `n` a multiple of 16
    /// up to `MAX_WIDTH`.
    pub(crate) unsafe fn axpys(a: &[f32], b: &[f32], y: &mut [f32], t: Tile) {
        // SAFETY: the caller's contract, with the row count as a constant.
        unsafe {
            match (t.g.size, t.width) {
                (2, 128) => axpys_rows::<2, 8>(a, b, y, t),
                (2, 64) => axpys_rows::<2, 4>(a, b, y, t),
                (2, _) => axpys_g::<2>(a, b, y, t),
                (3, _) => axpys_g::<3>(a, b, y, t),
                _ => axpys_g::<4>(a, b, y, t),
            }
        }
    }

    /// [`axpys`] for rows of `16 V` floats (the head dimensions 64 and 128): each `b` row read
    /// whole, in order, the `G × V` sums in registers.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::needless_range_loop)]
    unsafe fn axpys_rows<const G: usize, const V: usize>(a: &[f32], b: &[f32], y: &mut [f32], t: Tile) {
        let Tile { oa, ob, oy, g, p, .. } = t;
        let mut acc = [[_mm512_setzero_ps(); V]; G];
        for j in 0..p.size {
            let r = &b[ob + j * p.b..][..16 * V];
            let s: [__m512; G] = std::array::from_fn(|i| _mm512_set1_ps(a[oa + i * g.a + j * p.a]));
            for c in 0..V {
                // SAFETY: 16 floats at 16·c of a slice of 16·V.
                let x = unsafe { _mm512_loadu_ps(r.as_ptr().add(16 * c)) };
                for i in 0..G {
                    acc[i][c] = _mm512_fmadd_ps(s[i], x, acc[i][c]);
                }
            }
        }
        for (i, row) in acc.iter().enumerate() {
            let out = &mut y[oy + i * g.y..][..16 * V];
            for (c, v) in row.iter().enumerate() {
                // SAFETY: as above.
                unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(16 * c), *v) };
            }
        }
    }

    /// [`axpys`] for any width: sixteen output columns at a time.
    #[target_feature(enable = "avx512f")]
    unsafe fn axpys_g<const G: usize>(a: &[f32], b: &[f32], y: &mut [f32], t: Tile) {
        let Tile { oa, ob, oy, g, p, width: n } = t;
        // sixteen output columns at a time, summed over every position in registers
        for c in (0..n).step_by(16) {
            let mut acc = [_mm512_setzero_ps(); G];
            for j in 0..p.size {
                let r = &b[ob + j * p.b..][..n];
                // SAFETY: 16 floats at c ≤ n − 16 of a slice of n.
                let x = unsafe { _mm512_loadu_ps(r.as_ptr().add(c)) };
                for i in 0..G {
                    acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(a[oa + i * g.a + j * p.a]), x, acc[i]);
                }
            }
            for (i, s) in acc.iter().enumerate() {
                let out = &mut y[oy + i * g.y..][..n];
                // SAFETY: as above.
                unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(c), *s) };
            }
        }
    }
}
