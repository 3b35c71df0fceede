//! The Q4_0 products on aarch64 (issue 36), on the layouts of [`crate::q4`]:
//!
//! - [`gemm_sdot`]: int8 activations ([`QGroup`], weights in [`Layout::BlockDwords`]) with the
//!   dot-product instruction `sdot` (`asimddp`: Cortex-A55, A76, A78 and later). The same
//!   integer numerics as the x86 VNNI kernel and the portable int8 reference: per block the
//!   exact `Σ w q − 8 Σ q` (nibbles 0–15 times signed `q`, started from the group's `−8 Σ q`),
//!   then one FMA by `d_w · d_x` per block. A 128-bit register holds one byte quadruple of each
//!   of the group's four blocks, so the four registers of a group sum in integers to the four
//!   blocks' totals (eight `sdot` per group and activation row) before the one conversion.
//! - [`gemm_neon`]: float32 activations (weights in [`Layout::Interleaved`]) on plain NEON, for
//!   cores without `sdot` (Cortex-A53, A72): the AVX2 kernel's arithmetic on four lanes,
//!   nibbles shifted, masked and converted, the `− 8` taken out as `8 · Σ x` per block.
//!
//! `sdot` is written as inline assembly: its intrinsic (`vdotq_s32`) is not stable in Rust
//! 1.91–1.95. The f16 block scales become f32 with `fcvtl`, part of base ASIMD (the half-
//! precision *arithmetic* of FEAT_FP16 is not needed), also inline assembly since the f16
//! vector types are not stable either.
//!
//! [`Layout::BlockDwords`]: crate::q4::Layout::BlockDwords
//! [`Layout::Interleaved`]: crate::q4::Layout::Interleaved

use std::arch::aarch64::*;
use std::arch::asm;

use std::ops::Range;

use crate::q4::{Group, Q4Weights, QGroup};

/// How far ahead of the kernel a panel's stream is prefetched, in bytes: two groups of its
/// four rows, as on x86 (`x86_64::q4::PREFETCH`); not measured on an ARM core yet.
pub(crate) const PREFETCH: usize = 512;

/// Four f16 (bits) as f32, `fcvtl` (every ARMv8-A core: conversions are base ASIMD).
#[inline]
#[target_feature(enable = "neon")]
fn f16x4_to_f32(h: uint16x4_t) -> float32x4_t {
    let f: float32x4_t;
    // SAFETY: a register-only conversion.
    unsafe { asm!("fcvtl {0:v}.4s, {1:v}.4h", out(vreg) f, in(vreg) h, options(pure, nomem, nostack, preserves_flags)) };
    f
}

/// The sixteen f16 scales at `src` as f32 into `dst`.
///
/// # Safety
/// NEON; 16 scales readable at `src`.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn scales_f32(src: *const u16, dst: &mut [f32; 16]) {
    for c in 0..4 {
        // SAFETY: 16 u16 read (the caller), 16 f32 written.
        unsafe { vst1q_f32(dst.as_mut_ptr().add(4 * c), f16x4_to_f32(vld1_u16(src.add(4 * c)))) };
    }
}

/// Loads run `run`'s scales of a panel's four rows (sixteen f16 per row, from the panel's
/// scales at `sc`) into `d` as f32.
///
/// # Safety
/// NEON; the panel holds run `run` (4 rows × 16 scales per run from `sc`).
#[inline]
#[target_feature(enable = "neon")]
unsafe fn run_scales(sc: *const u16, run: usize, d: &mut [[f32; 16]; 4]) {
    for (i, di) in d.iter_mut().enumerate() {
        // SAFETY: a run holds 4 rows × 16 scales (the caller).
        unsafe { scales_f32(sc.add((run * 4 + i) * 16), di) };
    }
}

/// Prefetches the four cache lines [`PREFETCH`] bytes past the group at `at`: a hint only,
/// so prefetching past the end of a panel is harmless.
#[inline(always)]
fn prefetch_ahead(at: *const Group) {
    let ahead = at.cast::<u8>().wrapping_add(PREFETCH);
    for line in 0..4 {
        // SAFETY: `prfm` is a hint that never faults, whatever the address.
        unsafe { asm!("prfm pldl1keep, [{0}]", in(reg) ahead.wrapping_add(64 * line), options(nostack, preserves_flags, readonly)) };
    }
}

/// `acc + ` the four-byte dot products of `a` and `b` per 32-bit lane (`sdot`).
#[inline]
#[target_feature(enable = "neon,dotprod")]
fn sdot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: a register-only instruction of the dotprod feature this function requires.
    unsafe {
        asm!("sdot {0:v}.4s, {1:v}.16b, {2:v}.16b", inout(vreg) acc, in(vreg) a, in(vreg) b, options(pure, nomem, nostack, preserves_flags))
    };
    acc
}

/// The int8-activation kernel: per group and weight row four 16-byte loads, the low and high
/// nibbles masked out, eight `sdot` per activation row (started from the row's `−8 Σ q`), one
/// conversion and one FMA of the four blocks' integer sums by `d_w · d_x` (see the module
/// docs; [`crate::q4::Kernel::gemm`] for the product).
///
/// # Safety
/// NEON and dotprod; `xq` holds `M` rows of `w.groups` groups, `y` writable at
/// `m * y_stride + r` for `m < M` and every row `r < w.n` of the `panels` (`≤ w.panels()`), no
/// other thread touching those while it runs.
#[target_feature(enable = "neon,dotprod")]
#[allow(clippy::needless_range_loop)] // index loops: iterator adapters were not inlined here (see below)
pub(crate) unsafe fn gemm_sdot<const M: usize>(w: &Q4Weights, xq: &[QGroup], y: *mut f32, y_stride: usize, panels: Range<usize>) {
    let groups = w.groups;
    let xp = xq.as_ptr();
    let nibble = vdupq_n_u8(0x0F);
    for p in panels.clone() {
        let (nib, sc) = (w.panel_groups(p).as_ptr(), w.panel_scales(p).as_ptr());
        let mut acc = [[vdupq_n_f32(0.0); M]; 4];
        let mut d = [[0f32; 16]; 4];
        for run in 0..w.runs() {
            // SAFETY: the panel holds this run.
            unsafe { run_scales(sc, run, &mut d) };
            let g0 = run * 4;
            for j in 0..(groups - g0).min(4) {
                let g = g0 + j;
                // SAFETY: group g < groups of the panel (4 rows each), its scales in d; the
                // rows of xq hold `groups` groups each.
                unsafe {
                    let at = nib.add(4 * g);
                    prefetch_ahead(at);
                    // per activation row: Σ over the four quadruples of each block of −8 Σ q,
                    // and the blocks' scales d_x (lanes 0–3 of `d`). Plain loops, not
                    // `array::from_fn` or `map`: their closures would not inline into this
                    // function's target features (a call per row in the release build)
                    let mut xg = [std::ptr::null::<QGroup>(); M];
                    let mut corr = [vdupq_n_s32(0); M];
                    let mut dx = [vdupq_n_f32(0.0); M];
                    for m in 0..M {
                        xg[m] = xp.add(m * groups + g);
                        let c = std::ptr::addr_of!((*xg[m]).corr).cast::<i32>();
                        corr[m] = vaddq_s32(
                            vaddq_s32(vld1q_s32(c), vld1q_s32(c.add(4))),
                            vaddq_s32(vld1q_s32(c.add(8)), vld1q_s32(c.add(12))),
                        );
                        dx[m] = vld1q_f32(std::ptr::addr_of!((*xg[m]).d).cast());
                    }
                    for i in 0..4 {
                        let (acc, di) = (&mut acc[i], &d[i]);
                        let b = at.add(i).cast::<u8>();
                        let (mut lo, mut hi) = ([vdupq_n_s8(0); 4], [vdupq_n_s8(0); 4]);
                        for c in 0..4 {
                            let v = vld1q_u8(b.add(16 * c));
                            lo[c] = vreinterpretq_s8_u8(vandq_u8(v, nibble));
                            hi[c] = vreinterpretq_s8_u8(vshrq_n_u8::<4>(v));
                        }
                        let dw = vld1q_f32(di.as_ptr().add(4 * j));
                        for m in 0..M {
                            let (xl, xh) =
                                (std::ptr::addr_of!((*xg[m]).lo).cast::<i8>(), std::ptr::addr_of!((*xg[m]).hi).cast::<i8>());
                            // two chains of four `sdot` (the low and the high nibbles), not
                            // one of eight: half the latency; integer sums, so the same result
                            let (mut sl, mut sh) = (corr[m], vdupq_n_s32(0));
                            for c in 0..4 {
                                sl = sdot(sl, lo[c], vld1q_s8(xl.add(16 * c)));
                                sh = sdot(sh, hi[c], vld1q_s8(xh.add(16 * c)));
                            }
                            acc[m] = vfmaq_f32(acc[m], vcvtq_f32_s32(vaddq_s32(sl, sh)), vmulq_f32(dw, dx[m]));
                        }
                    }
                }
            }
        }
        for (i, a) in acc.iter().enumerate().take(w.n - 4 * p) {
            for (m, v) in a.iter().enumerate() {
                // SAFETY: row p's outputs are this call's to write (the caller's contract)
                unsafe { y.add(m * y_stride + 4 * p + i).write(vaddvq_f32(*v)) };
            }
        }
    }
}

/// Block `h` of a group for one weight row against `M` activation rows: the nibbles
/// `v >> LO` (weights `32 h .. 32 h + 16` of the group: of lane `l` of register `c`, weight
/// `32 h + 4 c + l`) and `v >> HI` (the next 16), `Σ q x` per lane into `t`.
///
/// # Safety
/// NEON; 32 readable floats at each `xb[m]`.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn block_neon<const M: usize, const LO: i32, const HI: i32>(
    v: &[uint32x4_t; 4],
    xb: [*const f32; M],
    t: &mut [float32x4_t; M],
) {
    let low = vdupq_n_u32(0x0F);
    let (lo_shift, hi_shift) = (vdupq_n_s32(-LO), vdupq_n_s32(-HI));
    for (c, &v) in v.iter().enumerate() {
        let ql = vcvtq_f32_u32(vandq_u32(vshlq_u32(v, lo_shift), low));
        let qh = vcvtq_f32_u32(vandq_u32(vshlq_u32(v, hi_shift), low));
        for m in 0..M {
            // SAFETY: 32 floats at xb[m] (the caller).
            unsafe {
                t[m] = vfmaq_f32(t[m], ql, vld1q_f32(xb[m].add(4 * c)));
                t[m] = vfmaq_f32(t[m], qh, vld1q_f32(xb[m].add(16 + 4 * c)));
            }
        }
    }
}

/// The float32-activation kernel on plain NEON: as `x86_64::q4::gemm_avx2` with four lanes
/// (a group is four registers, lanes 0–3 … 12–15); per block `Σ (q − 8) x = Σ q x − 8 Σ x`,
/// the sums of x shared by the four rows.
///
/// # Safety
/// NEON; `x` holds `M` rows of `w.padded_k()`, `y` writable at
/// `m * y_stride + r` for `m < M` and every row `r < w.n` of the `panels` (`≤ w.panels()`), no
/// other thread touching those while it runs.
#[target_feature(enable = "neon")]
#[allow(clippy::needless_range_loop)] // i indexes the rows' groups, scales and accumulators together
pub(crate) unsafe fn gemm_neon<const M: usize>(w: &Q4Weights, x: &[f32], y: *mut f32, y_stride: usize, panels: Range<usize>) {
    let kp = w.padded_k();
    let xp = x.as_ptr();
    for p in panels.clone() {
        let (nib, sc) = (w.panel_groups(p).as_ptr(), w.panel_scales(p).as_ptr());
        let mut acc = [[vdupq_n_f32(0.0); M]; 4];
        let mut d = [[0f32; 16]; 4];
        for g in 0..w.groups {
            if g % 4 == 0 {
                // SAFETY: the panel holds run g / 4.
                unsafe { run_scales(sc, g / 4, &mut d) };
            }
            prefetch_ahead(nib.wrapping_add(4 * g));
            for h in 0..4 {
                // SAFETY: group g of the panel; 32 floats of each x row at block h of group g
                // (the rows hold kp = 128 · groups floats).
                unsafe {
                    // 8 Σ x of the block per lane (lane l: the values l mod 4), per activation
                    // row (plain loops: see gemm_sdot)
                    let mut xb = [std::ptr::null::<f32>(); M];
                    let mut sx = [vdupq_n_f32(0.0); M];
                    for m in 0..M {
                        xb[m] = xp.add(m * kp + g * 128 + 32 * h);
                        let mut s = vld1q_f32(xb[m]);
                        for c in 1..8 {
                            s = vaddq_f32(s, vld1q_f32(xb[m].add(4 * c)));
                        }
                        sx[m] = vmulq_n_f32(s, 8.0);
                    }
                    for i in 0..4 {
                        let q = nib.add(4 * g + i).cast::<u32>();
                        let mut v = [vdupq_n_u32(0); 4];
                        for (c, v) in v.iter_mut().enumerate() {
                            *v = vld1q_u32(q.add(4 * c));
                        }
                        let mut t = [vdupq_n_f32(0.0); M];
                        match h {
                            0 => block_neon::<M, 0, 4>(&v, xb, &mut t),
                            1 => block_neon::<M, 8, 12>(&v, xb, &mut t),
                            2 => block_neon::<M, 16, 20>(&v, xb, &mut t),
                            _ => block_neon::<M, 24, 28>(&v, xb, &mut t),
                        }
                        let ds = vdupq_n_f32(d[i][(g % 4) * 4 + h]);
                        for m in 0..M {
                            acc[i][m] = vfmaq_f32(acc[i][m], vsubq_f32(t[m], sx[m]), ds);
                        }
                    }
                }
            }
        }
        for (i, a) in acc.iter().enumerate().take(w.n - 4 * p) {
            for (m, v) in a.iter().enumerate() {
                // SAFETY: row p's outputs are this call's to write (the caller's contract)
                unsafe { y.add(m * y_stride + 4 * p + i).write(vaddvq_f32(*v)) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `fcvtl` against the `half` crate's conversion for every one of the 65 536 f16 bit
    /// patterns (normals, subnormals, zeros, infinities; NaN stays NaN).
    #[test]
    fn scales_convert_as_half_does() {
        let bits: Vec<u16> = (0..=u16::MAX).collect();
        for chunk in bits.chunks_exact(16) {
            let mut out = [0f32; 16];
            // SAFETY: NEON is part of every aarch64 target; 16 values at chunk.
            unsafe { scales_f32(chunk.as_ptr(), &mut out) };
            for (&b, &f) in chunk.iter().zip(&out) {
                let want = half::f16::from_bits(b).to_f32();
                assert!(want.to_bits() == f.to_bits() || (want.is_nan() && f.is_nan()), "{b:#06x}: {f} vs {want}");
            }
        }
    }
}
