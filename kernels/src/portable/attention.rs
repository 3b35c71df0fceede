//! The attention's dot product and `axpy` in plain Rust: the reference, and the loops the
//! vector forms compile ([`crate::attention`]).

/// `Σ a[i] · b[i]` in sixteen running sums (which the compiler turns into vector lanes).
#[inline(always)]
pub(crate) fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..16 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    acc.iter().sum::<f32>() + tail
}

/// `y[i] += s · b[i]`.
#[inline(always)]
pub(crate) fn axpy_lanes(y: &mut [f32], s: f32, b: &[f32]) {
    for (o, v) in y.iter_mut().zip(b) {
        *o += s * v;
    }
}
