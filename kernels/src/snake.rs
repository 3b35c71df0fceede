//! SnakeBeta, `y = x + inv_b · sin²(a · x)` per channel, in one pass with a polynomial sine
//! that the compiler vectorizes (moved here from `backend_tract::snake`, which fuses the
//! vocoder graphs' five-node spelling into one op that calls [`snake_row`]; issue 36).
//!
//! The sine: `sin²` has period π, so `u = a·x` is reduced to `r = u − k·π ∈ [−π/2, π/2]`
//! (`k` = u/π rounded; π split in three parts, Cody–Waite, so that `k·π` is exact enough), and
//! `sin r` is its Taylor polynomial to degree 11 (truncation below 6e-8 on that interval, one
//! float32 ulp). Elements with `|u/π| ≥ 2^13`, where the reduction stops being exact, are
//! recomputed with the scalar `f32::sin` (never the case for a working vocoder: its activations
//! are O(1)); NaN and ±inf propagate as in the unfused graph (`sin(±inf)` is NaN).
//!
//! The loop (`crate::portable::snake`) is written without branches or calls so that it
//! vectorizes: SSE2 in the portable build on x86-64, AVX2 + FMA where the CPU has them
//! (`crate::x86_64::snake`, chosen at run time), NEON on aarch64 (the baseline there, four
//! lanes, no separate form).

use crate::portable::snake::{INV_PI, REDUCE_LIMIT, sin2_poly, snake_row_body};

/// SnakeBeta of one row with the widest vectors the CPU has.
fn snake_row_widest(xs: &[f32], out: &mut [f32], a: f32, inv_b: f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: both features were detected at run time.
        unsafe { crate::x86_64::snake::snake_row_avx2(xs, out, a, inv_b) };
        return;
    }
    snake_row_body(xs, out, a, inv_b);
}

/// SnakeBeta of one channel's samples, `out[i] = xs[i] + inv_b · sin²(a · xs[i])` for
/// `i < min(xs.len(), out.len())`, with the widest vectors the CPU has; the far elements done
/// exactly: a vectorized max of `|x|` over the row
/// decides whether any element is far (NaN and ±inf need no special case: the polynomial
/// returns NaN for them, as `sin` does); only then does a per-element loop run.
pub fn snake_row(xs: &[f32], out: &mut [f32], a: f32, inv_b: f32) {
    let max = xs.iter().fold(0.0f32, |m, &x| m.max(x.abs()));
    if max * a.abs() * INV_PI < REDUCE_LIMIT {
        snake_row_widest(xs, out, a, inv_b);
    } else {
        for (o, &x) in out.iter_mut().zip(xs) {
            let u = x * a;
            let s = if (u * INV_PI).abs() < REDUCE_LIMIT { sin2_poly(u) } else { u.sin() * u.sin() };
            *o = x + inv_b * s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_polynomial_matches_sin_squared() {
        let mut worst = 0f32;
        for i in -200_000..=200_000 {
            let u = i as f32 * 1e-3; // |u| <= 200, far beyond the vocoder's activations
            let want = (f64::from(u).sin().powi(2)) as f32;
            worst = worst.max((sin2_poly(u) - want).abs());
        }
        assert!(worst < 2e-6, "max abs error {worst}");
    }

    #[test]
    fn every_vector_width_gives_the_same_rows() {
        let xs: Vec<f32> = (0..1037).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let (mut wide, mut plain) = (vec![0.0f32; xs.len()], vec![0.0f32; xs.len()]);
        snake_row_widest(&xs, &mut wide, 0.9, 1.3);
        snake_row_body(&xs, &mut plain, 0.9, 1.3);
        for ((w, p), &x) in wide.iter().zip(&plain).zip(&xs) {
            let exact = f64::from(x) + 1.3 * (0.9 * f64::from(x)).sin().powi(2);
            assert!((f64::from(*w) - exact).abs() < 1e-5 && (f64::from(*p) - exact).abs() < 1e-5, "{w} {p} {exact}");
        }
    }

    #[test]
    fn far_and_special_values_follow_the_scalar_formula() {
        let (a, inv_b) = (1.7f32, 0.6f32);
        let xs = vec![0.5f32, 1e9, -3e8, f32::INFINITY, f32::NAN, -0.25];
        let want: Vec<f32> = xs.iter().map(|&x| x + inv_b * (x * a).sin() * (x * a).sin()).collect();
        let mut got = vec![0.0f32; xs.len()];
        snake_row(&xs, &mut got, a, inv_b);
        for (g, w) in got.iter().zip(&want) {
            assert!((g.is_nan() && w.is_nan()) || (g - w).abs() <= 1e-6 * w.abs().max(1.0), "{g} vs {w}");
        }
    }
}
