//! The portable references of the Q4_0 products: plain Rust, any CPU; every vector kernel is
//! tested against these ([`crate::q4`]).

use std::ops::Range;

use crate::q4::{BLOCK_LEN, GROUP_LEN, Q4Weights, QGroup};

/// The reference of the int8 kernels: per block the exact integer `Σ (w − 8) q`, times
/// `d_w · d_x`, summed over the blocks in order.
///
/// # Safety
/// As the vector kernels: `y` writable at `m * y_stride + r` for `m < M` and every row `r` of
/// `panels`, and no other thread touching those while it runs.
pub(crate) unsafe fn gemm_portable_int8<const M: usize>(
    w: &Q4Weights,
    xq: &[QGroup],
    y: *mut f32,
    y_stride: usize,
    panels: Range<usize>,
) {
    for r in 4 * panels.start..(4 * panels.end).min(w.n) {
        let (groups, sc) = (w.panel_groups(r / 4), w.panel_scales(r / 4));
        for m in 0..M {
            let xs = &xq[m * w.groups..][..w.groups];
            let mut acc = 0f32;
            for (g, qg) in xs.iter().enumerate() {
                let group = &groups[g * 4 + r % 4];
                for h in 0..4 {
                    let mut t = 0i32;
                    for l in 0..16 {
                        let byte = group.0[w.layout.position(h, l)];
                        let (lo, hi) = (qg.lo[16 * (l / 4) + 4 * h + l % 4], qg.hi[16 * (l / 4) + 4 * h + l % 4]);
                        t += (i32::from(byte & 0x0F) - 8) * i32::from(lo) + (i32::from(byte >> 4) - 8) * i32::from(hi);
                    }
                    let d = half::f16::from_bits(sc[((g / 4) * 4 + r % 4) * 16 + (g % 4) * 4 + h]).to_f32();
                    acc += t as f32 * (d * qg.d[h]);
                }
            }
            // SAFETY: row r lies in this call's panels (the caller's contract)
            unsafe { y.add(m * y_stride + r).write(acc) };
        }
    }
}

/// The reference product: `Σ_b d_b · Σ_j (q_j − 8) · x_j`, in order (as [`Kernel::gemm`]).
///
/// # Safety
/// As [`gemm_portable_int8`].
pub(crate) unsafe fn gemm_portable<const M: usize>(w: &Q4Weights, x: &[f32], y: *mut f32, y_stride: usize, panels: Range<usize>) {
    let kp = w.padded_k();
    for r in 4 * panels.start..(4 * panels.end).min(w.n) {
        let (groups, sc) = (w.panel_groups(r / 4), w.panel_scales(r / 4));
        for m in 0..M {
            let xs = &x[m * kp..][..kp];
            let mut acc = 0f32;
            for g in 0..w.groups {
                let group = &groups[g * 4 + r % 4];
                for h in 0..4 {
                    let xb = &xs[g * GROUP_LEN + h * BLOCK_LEN..][..BLOCK_LEN];
                    let mut t = 0f32;
                    for l in 0..16 {
                        let byte = group.0[w.layout.position(h, l)];
                        t += ((byte & 0x0F) as f32 - 8.0) * xb[l] + ((byte >> 4) as f32 - 8.0) * xb[l + 16];
                    }
                    let d = sc[((g / 4) * 4 + r % 4) * 16 + (g % 4) * 4 + h];
                    acc += half::f16::from_bits(d).to_f32() * t;
                }
            }
            // SAFETY: row r lies in this call's panels (the caller's contract)
            unsafe { y.add(m * y_stride + r).write(acc) };
        }
    }
}
