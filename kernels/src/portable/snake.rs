//! SnakeBeta's arithmetic in plain Rust (the reference, and the loop every vector form
//! compiles; [`crate::snake`]).

/// 1/π in float32.
pub(crate) const INV_PI: f32 = std::f32::consts::FRAC_1_PI;
/// π = PI_A + PI_B + PI_C to about 1e-14 (Cody–Waite): PI_A and PI_B have 11 significant bits,
/// so `k·PI_A` and `k·PI_B` are exact in float32 for |k| < 2^13.
pub(crate) const PI_A: f32 = 3.140_625;
pub(crate) const PI_B: f32 = 9.675_026e-4;
pub(crate) const PI_C: f32 = 1.509_958e-7;
/// 1.5 · 2^23: adding and subtracting it rounds a float32 of magnitude below 2^22 to the nearest
/// integer (ties to even) without a libm call, so the loop vectorizes.
pub(crate) const ROUND_MAGIC: f32 = 12_582_912.0;
/// Largest |u/π| reduced with the polynomial (where the reduction above is exact); beyond it the
/// scalar `f32::sin` runs.
pub(crate) const REDUCE_LIMIT: f32 = 8192.0;

/// sin² of `u`, in a form that vectorizes (no branch, no call).
#[inline(always)]
pub(crate) fn sin2_poly(u: f32) -> f32 {
    let k = (u * INV_PI + ROUND_MAGIC) - ROUND_MAGIC;
    let r = ((u - k * PI_A) - k * PI_B) - k * PI_C;
    let r2 = r * r;
    // Taylor coefficients of sin: (-1)^n / (2n+1)!
    let p = -2.505_210_8e-8_f32;
    let p = p * r2 + 2.755_731_9e-6;
    let p = p * r2 - 1.984_127e-4;
    let p = p * r2 + 8.333_333e-3;
    let p = p * r2 - 0.166_666_67;
    let s = r + r * r2 * p;
    s * s
}

/// SnakeBeta of one channel's samples, `out = x + inv_b · sin²(a · x)`, every `|a·x/π|` below
/// [`REDUCE_LIMIT`]; a loop without branches or calls, which the compiler vectorizes.
#[inline(always)]
pub(crate) fn snake_row_body(xs: &[f32], out: &mut [f32], a: f32, inv_b: f32) {
    for (o, &x) in out.iter_mut().zip(xs) {
        *o = x + inv_b * sin2_poly(x * a);
    }
}
