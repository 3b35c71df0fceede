//! The Q4_0 products on x86-64 (AVX-512F, AVX2 + FMA + F16C, AVX-512 VNNI): moved here
//! unchanged from `backend_tract::q4gemv` (issue 36), and AVX-VNNI ([`gemm_avxvnni`], new); [`crate::q4`] describes the layouts and
//! [`crate::q4::Kernel`] dispatches to them.

use std::arch::x86_64::*;

use std::ops::Range;

use crate::q4::{Group, Q4Weights, QGroup};

/// How far ahead of the kernel a panel's stream is prefetched, in bytes: two groups of its
/// four rows. Measured on the build machine (AMD EPYC, panels streamed from memory):
/// 12.3–12.4 GB/s of int4 weights from 256 to 2048 bytes ahead.
/// On an Intel Xeon host (2026-12-05, VNNI kernel, talker step): 29.5–31.8 ms from 512 to
/// 16384 bytes ahead, no trend (docs/performance.md "Another host").
pub(crate) const PREFETCH: usize = 512;

/// Loads run `run`'s scales of a panel's four rows (sixteen f16 per row, from the panel's
/// scales at `sc`) into `d` as f32.
///
/// # Safety
/// F16C; the panel holds run `run` (4 rows × 16 scales per run from `sc`).
#[target_feature(enable = "avx2,f16c")]
#[inline]
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
    let ahead = at.cast::<i8>().wrapping_add(PREFETCH);
    for line in 0..4 {
        // SAFETY: SSE is in every x86_64 CPU, and a prefetch never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line)) };
    }
}

/// The sixteen f16 scales at `src` as f32 into `dst`.
///
/// # Safety
/// F16C; 16 scales readable at `src`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn scales_f32(src: *const u16, dst: &mut [f32; 16]) {
    // SAFETY: 16 u16 read (the caller), 16 f32 written.
    unsafe {
        let h = _mm256_loadu_si256(src.cast());
        _mm256_storeu_ps(dst.as_mut_ptr(), _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
        _mm256_storeu_ps(dst.as_mut_ptr().add(8), _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(h)));
    }
}

/// Block `h` of a group for one weight row against `M` activation rows: the nibbles
/// `v >> LO` (weights `32 h .. 32 h + 16` of the group) and `v >> HI` (the next 16) looked
/// up in `table`, the block's `(q − 8) · d`.
#[target_feature(enable = "avx512f,avx2,f16c,fma")]
#[inline]
unsafe fn block_avx512<const M: usize, const LO: u32, const HI: u32>(
    v: __m512i,
    table: __m512,
    xb: [*const f32; M],
    mut acc: [__m512; M],
) -> [__m512; M] {
    let wl = _mm512_permutexvar_ps(if LO == 0 { v } else { _mm512_srli_epi32::<LO>(v) }, table);
    let wh = _mm512_permutexvar_ps(_mm512_srli_epi32::<HI>(v), table);
    for m in 0..M {
        // SAFETY: the caller passes 32 readable floats at each xb[m].
        unsafe {
            acc[m] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(xb[m]), acc[m]);
            acc[m] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xb[m].add(16)), acc[m]);
        }
    }
    acc
}

/// One group of one weight row: its 64 bytes at `group`, its four block scales at `d`,
/// the `M` activation rows' 128 floats at `xg`.
#[target_feature(enable = "avx512f,avx2,f16c,fma")]
#[inline]
unsafe fn group_avx512<const M: usize>(group: *const Group, d: *const f32, xg: [*const f32; M], acc: [__m512; M]) -> [__m512; M] {
    let lut = _mm512_setr_ps(-8., -7., -6., -5., -4., -3., -2., -1., 0., 1., 2., 3., 4., 5., 6., 7.);
    // SAFETY: the caller passes a whole group, four scales and 128 floats per row.
    unsafe {
        let v = _mm512_load_si512(group.cast());
        let at = |h: usize| -> [*const f32; M] { std::array::from_fn(|m| xg[m].add(32 * h)) };
        let table = |h: usize| _mm512_mul_ps(lut, _mm512_set1_ps(*d.add(h)));
        let acc = block_avx512::<M, 0, 4>(v, table(0), at(0), acc);
        let acc = block_avx512::<M, 8, 12>(v, table(1), at(1), acc);
        let acc = block_avx512::<M, 16, 20>(v, table(2), at(2), acc);
        block_avx512::<M, 24, 28>(v, table(3), at(3), acc)
    }
}

/// A panel of four weight rows per pass, `M` activation rows (see
/// [`crate::q4::Kernel::gemm`]); per group and row one 64-byte load, per block a table of
/// `(q − 8) · d` and [`block_avx512`].
///
/// # Safety
/// AVX-512F, AVX2, FMA and F16C; `x` holds `M` rows of `w.padded_k()`, `y` writable at
/// `m * y_stride + r` for `m < M` and every row `r < w.n` of the `panels` (`≤ w.panels()`), no
/// other thread touching those while it runs.
#[target_feature(enable = "avx512f,avx2,f16c,fma")]
pub(crate) unsafe fn gemm_avx512<const M: usize>(w: &Q4Weights, x: &[f32], y: *mut f32, y_stride: usize, panels: Range<usize>) {
    let kp = w.padded_k();
    let xp = x.as_ptr();
    for p in panels.clone() {
        let (nib, sc) = (w.panel_groups(p).as_ptr(), w.panel_scales(p).as_ptr());
        let (mut a0, mut a1, mut a2, mut a3) =
            ([_mm512_setzero_ps(); M], [_mm512_setzero_ps(); M], [_mm512_setzero_ps(); M], [_mm512_setzero_ps(); M]);
        let mut d = [[0f32; 16]; 4];
        // runs of four groups (sixteen blocks: one load of scales per row), the last maybe shorter
        for run in 0..w.runs() {
            // SAFETY: the panel holds this run.
            unsafe { run_scales(sc, run, &mut d) };
            let g0 = run * 4;
            for j in 0..(w.groups - g0).min(4) {
                let g = g0 + j;
                // SAFETY: group g < groups of the panel (4 rows each); its four scales in d;
                // the x rows hold kp = 128 · groups floats, so the 128 floats at xg[m] are
                // in bounds.
                unsafe {
                    let at = nib.add(4 * g);
                    prefetch_ahead(at);
                    let xg: [*const f32; M] = std::array::from_fn(|m| xp.add(m * kp + g * 128));
                    a0 = group_avx512::<M>(at, d[0].as_ptr().add(4 * j), xg, a0);
                    a1 = group_avx512::<M>(at.add(1), d[1].as_ptr().add(4 * j), xg, a1);
                    a2 = group_avx512::<M>(at.add(2), d[2].as_ptr().add(4 * j), xg, a2);
                    a3 = group_avx512::<M>(at.add(3), d[3].as_ptr().add(4 * j), xg, a3);
                }
            }
        }
        for (i, a) in [a0, a1, a2, a3].iter().enumerate().take(w.n - 4 * p) {
            for (m, v) in a.iter().enumerate() {
                // SAFETY: row p's outputs are this call's to write (the caller's contract)
                unsafe { y.add(m * y_stride + 4 * p + i).write(_mm512_reduce_add_ps(*v)) };
            }
        }
    }
}

/// Block `h` of a group, one 256-bit half of its lanes, for one weight row against `M`
/// activation rows: `Σ q x` of the nibbles `v >> LO` and `v >> HI` into `t`.
#[target_feature(enable = "avx2,f16c,fma")]
#[inline]
unsafe fn half_block_avx2<const M: usize, const LO: i32, const HI: i32>(v: __m256i, xb: [*const f32; M], t: &mut [__m256; M]) {
    let low = _mm256_set1_epi32(0x0F);
    let ql = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32::<LO>(v), low));
    let qh = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32::<HI>(v), low));
    for m in 0..M {
        // SAFETY: the caller passes 24 readable floats at each xb[m].
        unsafe {
            t[m] = _mm256_fmadd_ps(ql, _mm256_loadu_ps(xb[m]), t[m]);
            t[m] = _mm256_fmadd_ps(qh, _mm256_loadu_ps(xb[m].add(16)), t[m]);
        }
    }
}

/// As [`gemm_avx512`] with eight lanes: a group is two 256-bit halves (lanes 0–7 and
/// 8–15); per block `Σ (q − 8) x = Σ q x − 8 Σ x`, the sums of x shared by the four rows.
///
/// # Safety
/// AVX2, FMA and F16C; bounds as [`gemm_avx512`].
#[target_feature(enable = "avx2,f16c,fma")]
#[allow(clippy::needless_range_loop)] // i indexes the rows' groups, scales and accumulators together
pub(crate) unsafe fn gemm_avx2<const M: usize>(w: &Q4Weights, x: &[f32], y: *mut f32, y_stride: usize, panels: Range<usize>) {
    let kp = w.padded_k();
    let xp = x.as_ptr();
    let eight = _mm256_set1_ps(8.0);
    for p in panels.clone() {
        let (nib, sc) = (w.panel_groups(p).as_ptr(), w.panel_scales(p).as_ptr());
        let mut acc = [[_mm256_setzero_ps(); M]; 4];
        let mut d = [[0f32; 16]; 4];
        for g in 0..w.groups {
            if g % 4 == 0 {
                // SAFETY: the panel holds run g / 4.
                unsafe { run_scales(sc, g / 4, &mut d) };
            }
            prefetch_ahead(nib.wrapping_add(4 * g));
            for h in 0..4 {
                // SAFETY: as in gemm_avx512: group g of the panel, 32 floats of each x row
                // at block h of group g.
                unsafe {
                    let xb: [*const f32; M] = std::array::from_fn(|m| xp.add(m * kp + g * 128 + 32 * h));
                    // 8 Σ x of the block, per activation row
                    let sx: [__m256; M] = std::array::from_fn(|m| {
                        let s = _mm256_add_ps(_mm256_loadu_ps(xb[m]), _mm256_loadu_ps(xb[m].add(8)));
                        let s = _mm256_add_ps(s, _mm256_add_ps(_mm256_loadu_ps(xb[m].add(16)), _mm256_loadu_ps(xb[m].add(24))));
                        _mm256_mul_ps(s, eight)
                    });
                    let x8: [*const f32; M] = std::array::from_fn(|m| xb[m].add(8));
                    for i in 0..4 {
                        let q = nib.add(4 * g + i).cast::<__m256i>();
                        let (v0, v1) = (_mm256_load_si256(q), _mm256_load_si256(q.add(1)));
                        let mut t = [_mm256_setzero_ps(); M];
                        match h {
                            0 => {
                                half_block_avx2::<M, 0, 4>(v0, xb, &mut t);
                                half_block_avx2::<M, 0, 4>(v1, x8, &mut t);
                            }
                            1 => {
                                half_block_avx2::<M, 8, 12>(v0, xb, &mut t);
                                half_block_avx2::<M, 8, 12>(v1, x8, &mut t);
                            }
                            2 => {
                                half_block_avx2::<M, 16, 20>(v0, xb, &mut t);
                                half_block_avx2::<M, 16, 20>(v1, x8, &mut t);
                            }
                            _ => {
                                half_block_avx2::<M, 24, 28>(v0, xb, &mut t);
                                half_block_avx2::<M, 24, 28>(v1, x8, &mut t);
                            }
                        }
                        let ds = _mm256_set1_ps(d[i][(g % 4) * 4 + h]);
                        for m in 0..M {
                            acc[i][m] = _mm256_fmadd_ps(_mm256_sub_ps(t[m], sx[m]), ds, acc[i][m]);
                        }
                    }
                }
            }
        }
        for (i, a) in acc.iter().enumerate().take(w.n - 4 * p) {
            for (m, v) in a.iter().enumerate() {
                // SAFETY: row p's outputs are this call's to write (the caller's contract)
                unsafe { y.add(m * y_stride + 4 * p + i).write(hsum256(*v)) };
            }
        }
    }
}

/// The int8-activation kernel ([`QGroup`], weights in
/// [`crate::q4::Layout::BlockDwords`]): per group and weight row one 64-byte load, the low and
/// high nibbles masked out (`vpandd`, `vpsrlw` + `vpandd`), two `vpdpbusd` per activation
/// row (unsigned nibbles times signed `q`, started from the row's `−8 Σ q`), and one FMA of
/// the lanes' integer sums by `d_w · d_x` (the four block scales repeat every four lanes).
///
/// # Safety
/// AVX-512F, BW, VNNI, AVX2, FMA and F16C; `xq` holds `M` rows of `w.groups` groups, `y` writable at
/// `m * y_stride + r` for `m < M` and every row `r < w.n` of the `panels` (`≤ w.panels()`), no
/// other thread touching those while it runs.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c,fma")]
pub(crate) unsafe fn gemm_vnni<const M: usize>(w: &Q4Weights, xq: &[QGroup], y: *mut f32, y_stride: usize, panels: Range<usize>) {
    let groups = w.groups;
    let xp = xq.as_ptr();
    let nibble = _mm512_set1_epi8(0x0F);
    for p in panels.clone() {
        let (nib, sc) = (w.panel_groups(p).as_ptr(), w.panel_scales(p).as_ptr());
        let mut acc = [[_mm512_setzero_ps(); M]; 4];
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
                    let xg: [*const QGroup; M] = std::array::from_fn(|m| xp.add(m * groups + g));
                    for (i, (acc, di)) in acc.iter_mut().zip(&d).enumerate() {
                        let v = _mm512_load_si512(at.add(i).cast());
                        let lo = _mm512_and_si512(v, nibble);
                        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nibble);
                        let dw = _mm512_broadcast_f32x4(_mm_loadu_ps(di.as_ptr().add(4 * j)));
                        for (a, &x) in acc.iter_mut().zip(&xg) {
                            let q = std::ptr::addr_of!((*x).corr).cast::<__m512i>();
                            let s =
                                _mm512_dpbusd_epi32(_mm512_load_si512(q), lo, _mm512_load_si512(std::ptr::addr_of!((*x).lo).cast()));
                            let s = _mm512_dpbusd_epi32(s, hi, _mm512_load_si512(std::ptr::addr_of!((*x).hi).cast()));
                            let dx = _mm512_load_ps(std::ptr::addr_of!((*x).d).cast());
                            *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx), *a);
                        }
                    }
                }
            }
        }
        for (i, a) in acc.iter().enumerate().take(w.n - 4 * p) {
            for (m, v) in a.iter().enumerate() {
                // SAFETY: row p's outputs are this call's to write (the caller's contract)
                unsafe { y.add(m * y_stride + 4 * p + i).write(_mm512_reduce_add_ps(*v)) };
            }
        }
    }
}

/// The int8-activation kernel on AVX-VNNI (256-bit `vpdpbusd`, for x86 without AVX-512: Alder
/// Lake-N, Intel Core 12th generation and later, AMD Zen 5 client parts): [`gemm_vnni`]'s
/// arithmetic on two 256-bit halves of each group (lanes `4j + h` for `j` = 0, 1 and 2, 3).
/// Both halves' lanes hold the same four blocks in the same order, so their integer sums add
/// before the one conversion: per group and weight row two 32-byte loads, the nibbles masked
/// out, four `vpdpbusd` per activation row started from the sum of the halves' `−8 Σ q`, one
/// FMA by `d_w · d_x`.
///
/// # Safety
/// AVX2, FMA, F16C and AVX-VNNI; `xq` holds `M` rows of `w.groups` groups, `y` writable at
/// `m * y_stride + r` for `m < M` and every row `r < w.n` of the `panels` (`≤ w.panels()`), no
/// other thread touching those while it runs.
#[target_feature(enable = "avx2,f16c,fma,avxvnni")]
#[allow(clippy::needless_range_loop)] // index loops: see the comment in the loop
pub(crate) unsafe fn gemm_avxvnni<const M: usize>(w: &Q4Weights, xq: &[QGroup], y: *mut f32, y_stride: usize, panels: Range<usize>) {
    let groups = w.groups;
    let xp = xq.as_ptr();
    let nibble = _mm256_set1_epi8(0x0F);
    for p in panels.clone() {
        let (nib, sc) = (w.panel_groups(p).as_ptr(), w.panel_scales(p).as_ptr());
        let mut acc = [[_mm256_setzero_ps(); M]; 4];
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
                    // per activation row: the two halves' −8 Σ q added, and d_x of blocks 0–3
                    // twice. Plain loops, not `array::from_fn` or `zip`: their closures and
                    // adapters stay calls inside a #[target_feature] function (release build)
                    let mut xg = [std::ptr::null::<QGroup>(); M];
                    let mut corr = [_mm256_setzero_si256(); M];
                    let mut dx = [_mm256_setzero_ps(); M];
                    for m in 0..M {
                        xg[m] = xp.add(m * groups + g);
                        let c = std::ptr::addr_of!((*xg[m]).corr).cast::<__m256i>();
                        corr[m] = _mm256_add_epi32(_mm256_load_si256(c), _mm256_load_si256(c.add(1)));
                        dx[m] = _mm256_load_ps(std::ptr::addr_of!((*xg[m]).d).cast());
                    }
                    for i in 0..4 {
                        let (acc, di) = (&mut acc[i], &d[i]);
                        let v = at.add(i).cast::<__m256i>();
                        let (v0, v1) = (_mm256_load_si256(v), _mm256_load_si256(v.add(1)));
                        let (lo0, lo1) = (_mm256_and_si256(v0, nibble), _mm256_and_si256(v1, nibble));
                        let (hi0, hi1) = (
                            _mm256_and_si256(_mm256_srli_epi16::<4>(v0), nibble),
                            _mm256_and_si256(_mm256_srli_epi16::<4>(v1), nibble),
                        );
                        let dw = _mm256_broadcast_ps(&_mm_loadu_ps(di.as_ptr().add(4 * j)));
                        for m in 0..M {
                            let (xl, xh) =
                                (std::ptr::addr_of!((*xg[m]).lo).cast::<__m256i>(), std::ptr::addr_of!((*xg[m]).hi).cast::<__m256i>());
                            let s = _mm256_dpbusd_avx_epi32(corr[m], lo0, _mm256_load_si256(xl));
                            let s = _mm256_dpbusd_avx_epi32(s, lo1, _mm256_load_si256(xl.add(1)));
                            let s = _mm256_dpbusd_avx_epi32(s, hi0, _mm256_load_si256(xh));
                            let s = _mm256_dpbusd_avx_epi32(s, hi1, _mm256_load_si256(xh.add(1)));
                            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx[m]), acc[m]);
                        }
                    }
                }
            }
        }
        for (i, a) in acc.iter().enumerate().take(w.n - 4 * p) {
            for (m, v) in a.iter().enumerate() {
                // SAFETY: row p's outputs are this call's to write (the caller's contract)
                unsafe { y.add(m * y_stride + 4 * p + i).write(hsum256(*v)) };
            }
        }
    }
}

/// The sum of the eight lanes.
#[target_feature(enable = "avx2")]
fn hsum256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}
