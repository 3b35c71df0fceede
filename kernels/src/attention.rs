//! The attention's products of a decode step on the operands as they lie in memory (moved here
//! from `backend_tract::runtime_matmul`, which matches tract's einsums and walks their axes;
//! issue 36): the scores `q · kᵀ` as dot products over the head dimension, the weighted sum
//! `p · v` as `axpy`s over the cached values' rows, and tiles of both that read each cached row
//! once for all the query heads that share it ([`dots`], [`axpys`]: AVX-512 on x86-64, NEON on
//! aarch64). The dot product and `axpy` are plain loops (`crate::portable::attention`) that the
//! compiler vectorizes, compiled for AVX2 + FMA where the CPU has them
//! (`crate::x86_64::attention`) and for NEON on aarch64 (the baseline there). The sums are
//! float32 in an order of their own (sixteen running sums in [`dot`]).

use crate::portable::attention::{axpy_lanes, dot_lanes};

/// One axis of a strided product: its size and its element strides in `a`, `b` and the output
/// (0 where absent).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stride {
    /// Elements along the axis.
    pub size: usize,
    /// Stride in `a`.
    pub a: usize,
    /// Stride in `b`.
    pub b: usize,
    /// Stride in the output.
    pub y: usize,
}

/// One tile: the offsets of its first row of `a`, row of `b` and output element, the axis
/// of `a`'s rows (`g`: a stride 0 in `b`), the axis walked in `b` (`p`: the positions) and the
/// width of a row (the summed axis of the dots, the output axis of the axpys).
#[derive(Clone, Copy, Debug)]
pub struct Tile {
    /// Offset of the tile's first row in `a`.
    pub oa: usize,
    /// Offset of the tile's first row in `b`.
    pub ob: usize,
    /// Offset of the tile's first output element.
    pub oy: usize,
    /// The axis of `a`'s rows (stride 0 in `b`).
    pub g: Stride,
    /// The axis walked in `b` (the positions).
    pub p: Stride,
    /// Width of a row.
    pub width: usize,
}

/// Whether [`dots`] takes a tile of `rows` rows of width `k` on this CPU (2 to 4 rows, `k` a
/// multiple of 16 up to 512; on x86-64 with AVX-512F, on aarch64 with NEON); false elsewhere,
/// where the callers' loops of [`dot`] run.
pub fn dots_fit(rows: usize, k: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::x86_64::attention::tiles::dots_fit(rows, k)
    }
    #[cfg(target_arch = "aarch64")]
    {
        crate::aarch64::attention::dots_fit(rows, k)
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        let _ = (rows, k);
        false
    }
}

/// Whether [`axpys`] takes a tile of `rows` rows of width `n` on this CPU (as [`dots_fit`]).
pub fn axpys_fit(rows: usize, n: usize) -> bool {
    dots_fit(rows, n)
}

/// `y[oy + i·g.y + j·p.y] = Σ_c a[oa + i·g.a + c] · b[ob + j·p.b + c]` for every row `i` of the
/// axis `g` and `j` of `p`, `c < width`, of the tile `t`, where [`dots_fit`] takes it; returns
/// whether it did (nothing is written otherwise).
///
/// # Panics
/// When an index above is out of bounds (a caller's bug).
pub fn dots(a: &[f32], b: &[f32], y: &mut [f32], t: Tile) -> bool {
    if !dots_fit(t.g.size, t.width) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: dots_fit checked AVX-512F, the row count and the width; the tile kernels index
    // the operands through bounds-checked slices.
    unsafe {
        crate::x86_64::attention::tiles::dots(a, b, y, t)
    };
    #[cfg(target_arch = "aarch64")]
    // SAFETY: as above (NEON is part of every aarch64 target).
    unsafe {
        crate::aarch64::attention::dots(a, b, y, t)
    };
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = (a, b, y);
    true
}

/// `y[oy + i·g.y + c] = Σ_j a[oa + i·g.a + j·p.a] · b[ob + j·p.b + c]` for every row `i` of the
/// axis `g` and `c < width`, summed over `j` of `p`, of the tile `t`, where [`axpys_fit`] takes
/// it; returns whether it did (nothing is written otherwise).
///
/// # Panics
/// When an index above is out of bounds (a caller's bug).
pub fn axpys(a: &[f32], b: &[f32], y: &mut [f32], t: Tile) -> bool {
    if !axpys_fit(t.g.size, t.width) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as in `dots`.
    unsafe {
        crate::x86_64::attention::tiles::axpys(a, b, y, t)
    };
    #[cfg(target_arch = "aarch64")]
    // SAFETY: as in `dots`.
    unsafe {
        crate::aarch64::attention::axpys(a, b, y, t)
    };
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = (a, b, y);
    true
}

/// `Σ a[i] · b[i]`, `a.len() == b.len()`.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked just above).
        return unsafe { crate::x86_64::attention::dot_avx2(a, b) };
    }
    dot_lanes(a, b)
}

/// `y[i] += s · b[i]` for `i < min(y.len(), b.len())`, with the widest vectors the CPU has.
pub fn axpy(y: &mut [f32], s: f32, b: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked just above).
        return unsafe { crate::x86_64::attention::axpy_avx2(y, s, b) };
    }
    axpy_lanes(y, s, b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn floats(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// [`dot`] and [`axpy`] against f64 sums, within `1e-6 · Σ |a b|` (float32 rounding of at
    /// most a few hundred terms), on lengths around the sixteen lanes (tails of 0–15).
    #[test]
    fn dot_and_axpy_match_the_sums() {
        for n in [0usize, 1, 5, 15, 16, 17, 31, 64, 127, 128, 133] {
            let (a, b) = (floats(n, 3 + n as u64), floats(n, 5 + n as u64));
            let want: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
            let abs: f64 = a.iter().zip(&b).map(|(x, y)| f64::from((x * y).abs())).sum();
            assert!((f64::from(dot(&a, &b)) - want).abs() <= 1e-6 * abs + 1e-12, "dot, n = {n}");
            let mut y = floats(n, 7);
            let y0 = y.clone();
            axpy(&mut y, 0.75, &b);
            for i in 0..n {
                assert_eq!(y[i], y0[i] + 0.75 * b[i], "axpy [{i}] of {n}");
            }
        }
    }

    /// The tiles, where this CPU takes them, against [`dot`] and [`axpy`] loops over the same
    /// strided axes (the talker's shape: rows of 2 query heads; 3 and 4 rows; widths 64, 128
    /// and 48), within float32 rounding; elsewhere they decline and write nothing.
    #[test]
    fn tiles_match_the_loops() {
        for &(rows, width, positions) in &[(2usize, 128usize, 33usize), (2, 64, 5), (3, 48, 7), (4, 128, 9)] {
            // a: rows × width (dots) or rows × positions (axpys); b: positions × width
            let b = floats(positions * width, 11);
            let a = floats(rows * width.max(positions), 13);
            let g = Stride { size: rows, a: width, b: 0, y: positions };
            let p = Stride { size: positions, a: 0, b: width, y: 1 };
            let mut y = vec![f32::NAN; rows * positions];
            let taken = dots(&a, &b, &mut y, Tile { oa: 0, ob: 0, oy: 0, g, p, width });
            assert_eq!(taken, dots_fit(rows, width));
            if taken {
                for i in 0..rows {
                    for j in 0..positions {
                        let want = dot(&a[i * width..][..width], &b[j * width..][..width]);
                        let got = y[i * positions + j];
                        assert!((got - want).abs() <= 1e-5 * want.abs().max(1.0), "dots [{i}][{j}]: {got} vs {want}");
                    }
                }
            } else {
                assert!(y.iter().all(|v| v.is_nan()), "a declined tile writes nothing");
            }
            // the weighted sum: a rows of `positions` weights, output rows of `width`
            let g = Stride { size: rows, a: positions, b: 0, y: width };
            let p = Stride { size: positions, a: 1, b: width, y: 0 };
            let mut y = vec![f32::NAN; rows * width];
            let taken = axpys(&a, &b, &mut y, Tile { oa: 0, ob: 0, oy: 0, g, p, width });
            assert_eq!(taken, axpys_fit(rows, width));
            if taken {
                for i in 0..rows {
                    let mut want = vec![0f32; width];
                    for j in 0..positions {
                        axpy(&mut want, a[i * positions + j], &b[j * width..][..width]);
                    }
                    for c in 0..width {
                        let got = y[i * width + c];
                        assert!((got - want[c]).abs() <= 1e-5 * want[c].abs().max(1.0), "axpys [{i}][{c}]: {got} vs {}", want[c]);
                    }
                }
            }
        }
    }
}
