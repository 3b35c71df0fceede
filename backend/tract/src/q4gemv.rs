//! herald's own Q4_0 matrix products for the decode steps, in place of tract's.
//!
//! A decode step multiplies one activation row by every weight of the talker or the code
//! predictor: a matrix-vector product (GEMV) whose floor is the memory bandwidth. tract
//! 0.23.9 runs a Q4_0 weight through its general block-quant matmul (`fma_mmm_f32_32x1` on
//! x86, panels of 32 rows), which unpacks the nibbles through a byte-shuffling path and ran at
//! about 6.6 GB/s of int4 weights on the build machine: 20–28 % of the bandwidth floor
//! (docs/performance.md). [`Q4MatMul`] replaces each such product whose weight is a constant
//! Q4_0 tensor (`com.microsoft.MatMulNBits`, bits 4, block 32, as tract-onnx wires it: an
//! `EinSum` `..k, gnk -> ..n` with `g = 1`) by a kernel written for this shape:
//!
//! - the weights are kept in **groups** of four Q4_0 blocks (128 weights, one 64-byte cache
//!   line of nibbles) and **panels** of four rows, a panel one sequential stream of groups
//!   ([`Q4Weights`]), the f16 block scales in a separate array;
//! - AVX-512: a group is one 512-bit load of sixteen 32-bit lanes holding eight nibbles each;
//!   nibble `i` of every lane is `lane >> 4i`, looked up in a 16-entry table of `(q − 8) · d`
//!   (`vpermps` reads only the low four bits of each index, so no mask is needed; the table is
//!   multiplied by the block's scale once per block): per block and row two shifts, two
//!   permutations and two FMAs per activation row; the panel's stream prefetched
//!   [`x86::PREFETCH`] bytes ahead;
//! - AVX2 + FMA + F16C: the same lanes in two 256-bit halves, nibbles masked and converted,
//!   the `− 8` taken out as `8 · Σ x` per block;
//! - elsewhere (and as the tests' reference): a plain loop, `Σ_b d_b Σ_j (q_j − 8) x_j`.
//!
//! Up to [`MAX_X_ROWS`] activation rows share each pass over the weights (the code
//! predictor's two-position prefill costs little more than one step); longer inputs (the
//! talker's prompt prefill) take passes of four rows.
//!
//! These kernels keep the activations and the accumulation in f32, as tract's kernel and
//! onnxruntime's `MatMulNBits` with `accuracy_level` 0 do: the products differ from theirs by
//! summation order only.
//!
//! On a bundle whose fidelity gate measured int8 activations (`[quantization] activations =
//! "int8"`: the exporter writes `accuracy_level = 4`), a CPU with AVX-512 VNNI runs
//! [`Kernel::Avx512Vnni`] instead: each activation row is quantized per block of 32 to int8
//! (GGML's Q8_0, [`QGroup`]), the weights kept in [`Layout::BlockDwords`], and per group and
//! weight row two `vpdpbusd` sum sixteen lanes of four nibble × int8 products in integers, one
//! FMA scales them by `d_w · d_x`: about a third of the float kernel's instructions per weight
//! (docs/performance.md). It computes what onnxruntime computes with `accuracy_level = 4`, up
//! to summation order; the parity test runs onnxruntime in whichever numerics herald picked
//! ([`crate::q4_int8_activations`]).

use std::sync::Arc;

use tract_linalg::block_quant::{BlockQuantFact, BlockQuantStorage, Q4_0};
use tract_onnx::prelude::*;
use tract_onnx::tract_core::optim::{OptimizerSession, TypedPass};
use tract_onnx::tract_hir::internal::*;

use crate::q4pack::{BLOCK_BYTES, BLOCK_LEN};
use crate::stack::{view, view_mut};

/// Weights per group: four Q4_0 blocks, whose 64 bytes of nibbles fill one cache line.
const GROUP_LEN: usize = 4 * BLOCK_LEN;
/// Activation rows that share one pass over the weights (the kernels hold `4 × MAX_X_ROWS`
/// accumulators in registers).
const MAX_X_ROWS: usize = 4;

/// One group of one row: 64 bytes, 64-byte aligned. Byte `4l + h` is byte `l` of the group's
/// block `h` (GGML order: weight `l` of the block in the low nibble, weight `l + 16` in the
/// high one), so the 32-bit lane `l` holds in its nibble `i` the weight `16 i + l` of the
/// group.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
struct Group([u8; 64]);

/// A Q4_0 weight `[n, k]` in the layout of herald's kernels: **panels** of four rows, each
/// panel one sequential stream of groups (group 0 of its rows 0–3, then group 1 of rows 0–3,
/// …), so that the kernel reads the weights strictly in order and one prefetch stream covers
/// them (a stream per row ran at 7.5 GB/s for rows of 3072 weights on the build machine, the
/// panel at 12.2–12.4 GB/s for every row length). The f16 block scales (bits) in runs of
/// sixteen blocks per row: per panel and run, rows 0–3 sixteen scales each.
///
/// Padding: `k` rounds up to whole runs of 512 weights and `n` to whole panels, with blocks of
/// scale 0 (weights exactly 0); at 0.6B dimensions (`k` of 1024, 2048 or 3072, `n` a
/// multiple of 4) there is none.
#[derive(Debug)]
pub(crate) struct Q4Weights {
    /// Output features (rows).
    n: usize,
    /// Input features (columns), a positive multiple of 32.
    k: usize,
    /// Groups per row, `⌈k / 128⌉`.
    groups: usize,
    /// `[⌈n / 4⌉ panels][groups][4 rows]`.
    nibbles: Vec<Group>,
    /// `[⌈n / 4⌉ panels][⌈groups / 4⌉ runs][4 rows][16 blocks]`.
    scales: Vec<u16>,
    /// The order of the bytes within a group ([`Layout`]).
    layout: Layout,
}

/// The order of a [`Group`]'s 64 bytes, set by the kernel family that reads them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Layout {
    /// For the float32-activation kernels: byte `4l + h` is byte `l` of block `h`, so the
    /// 32-bit lane `l` holds in its nibble `i` the weight `16 i + l` of the group.
    Interleaved,
    /// For the int8-activation kernels: byte `16j + 4h + t` is byte `4j + t` of block `h`, so
    /// the 32-bit lane `4j + h` holds four consecutive bytes of block `h` (its weights
    /// `4j .. 4j + 4` in the low nibbles, `16 + 4j .. 16 + 4j + 4` in the high ones): a
    /// `vpdpbusd` of the lane sums within one block, and the block scales repeat every four
    /// lanes.
    BlockDwords,
}

impl Layout {
    /// Where byte `l` of block `h` lies in a group.
    fn position(self, h: usize, l: usize) -> usize {
        match self {
            Layout::Interleaved => 4 * l + h,
            Layout::BlockDwords => 16 * (l / 4) + 4 * h + l % 4,
        }
    }
}

impl Q4Weights {
    /// From GGML Q4_0 blocks (`n` rows of `k / 32` blocks of 18 bytes, rows one after the
    /// other) in `layout`, or `None` when `k` is not a positive multiple of 32 or the length
    /// does not match.
    pub(crate) fn from_q4_0(blocks: &[u8], n: usize, k: usize, layout: Layout) -> Option<Q4Weights> {
        if n == 0 || k == 0 || !k.is_multiple_of(BLOCK_LEN) || blocks.len() != n * k / BLOCK_LEN * BLOCK_BYTES {
            return None;
        }
        let (groups, panels) = (k.div_ceil(GROUP_LEN), n.div_ceil(4));
        let runs = groups.div_ceil(4);
        let mut nibbles = vec![Group([0; 64]); panels * groups * 4];
        let mut scales = vec![0u16; panels * runs * 64];
        for (b, block) in blocks.chunks_exact(BLOCK_BYTES).enumerate() {
            let (r, c) = (b / (k / BLOCK_LEN), b % (k / BLOCK_LEN));
            let (p, i) = (r / 4, r % 4);
            scales[((p * runs + c / 16) * 4 + i) * 16 + c % 16] = u16::from_le_bytes([block[0], block[1]]);
            let (group, h) = (&mut nibbles[(p * groups + c / 4) * 4 + i], c % 4);
            for (l, &byte) in block[2..].iter().enumerate() {
                group.0[layout.position(h, l)] = byte;
            }
        }
        Some(Q4Weights { n, k, groups, nibbles, scales, layout })
    }

    /// Bytes held: the nibbles and the f16 scales (0.5625 bytes per weight without padding).
    pub(crate) fn bytes(&self) -> usize {
        self.nibbles.len() * 64 + 2 * self.scales.len()
    }

    /// Columns the kernels read per activation row: `k` rounded up to a whole group.
    fn padded_k(&self) -> usize {
        self.groups * GROUP_LEN
    }

    /// Panels of four rows (the last may hold padding rows).
    fn panels(&self) -> usize {
        self.n.div_ceil(4)
    }

    /// Runs of sixteen blocks per row.
    fn runs(&self) -> usize {
        self.groups.div_ceil(4)
    }

    /// Panel `p`'s groups, `[groups][4 rows]`.
    fn panel_groups(&self, p: usize) -> &[Group] {
        &self.nibbles[p * self.groups * 4..][..self.groups * 4]
    }

    /// Panel `p`'s scales, `[runs][4 rows][16 blocks]`.
    fn panel_scales(&self, p: usize) -> &[u16] {
        &self.scales[p * self.runs() * 64..][..self.runs() * 64]
    }
}

/// Which kernel a product runs on, and with it the numerics of the activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// Plain Rust, any CPU; float32 activations.
    Portable,
    /// AVX2 + FMA + F16C (x86-64); float32 activations.
    Avx2,
    /// AVX-512F (x86-64); float32 activations.
    Avx512,
    /// Plain Rust, any CPU; int8 activations ([`QGroup`]): the reference of [`Kernel::Avx512Vnni`].
    PortableInt8,
    /// AVX-512F + BW + VNNI (x86-64); int8 activations ([`QGroup`]), `vpdpbusd` products.
    Avx512Vnni,
}

impl Kernel {
    /// The widest float32-activation kernel this CPU runs.
    pub(crate) fn detect() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                return Kernel::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                return Kernel::Avx2;
            }
        }
        Kernel::Portable
    }

    /// The int8-activation kernel this CPU runs, `None` without AVX-512 VNNI.
    pub(crate) fn detect_int8() -> Option<Kernel> {
        #[cfg(target_arch = "x86_64")]
        {
            if Kernel::detect() == Kernel::Avx512
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vnni")
            {
                return Some(Kernel::Avx512Vnni);
            }
        }
        None
    }

    /// Whether the kernel quantizes the activations to int8 (per block of 32, [`QGroup`]).
    pub(crate) fn int8(self) -> bool {
        matches!(self, Kernel::PortableInt8 | Kernel::Avx512Vnni)
    }

    /// The byte order of the weights this kernel reads.
    fn layout(self) -> Layout {
        if self.int8() { Layout::BlockDwords } else { Layout::Interleaved }
    }

    /// The kernel the optimizer puts in place of tract's Q4_0 products, or `None` to keep
    /// tract's. `int8_activations`: the bundle's fidelity gate measured its q4 products with
    /// int8 activations (`[quantization] activations = "int8"`, docs/bundle.md), so they may
    /// run that way. From the environment variable `HERALD_Q4_KERNEL`:
    ///
    /// - unset or empty: where the CPU has AVX-512, herald's AVX-512 VNNI kernel when
    ///   `int8_activations` and the CPU has VNNI, else herald's float32 AVX-512 kernel (both
    ///   measured faster than tract's end to end, docs/performance.md); tract's kernels
    ///   elsewhere (aarch64 today, and x86 without AVX-512, where herald's AVX2 kernel was not
    ///   measured against tract's);
    /// - `herald`: herald's widest float32 kernel for this CPU ([`Kernel::detect`]), tract's on
    ///   a CPU without AVX2;
    /// - `vnni`: the AVX-512 VNNI kernel whatever the bundle says (for comparisons; a warning
    ///   when the bundle's gate did not measure int8 activations), the default without VNNI;
    /// - `tract`: tract's kernels; `portable`, `portable-int8`: herald's plain loops (for tests
    ///   and comparisons).
    ///
    /// Any other value is ignored with a warning (the default applies).
    pub(crate) fn chosen(int8_activations: bool) -> Option<Kernel> {
        let default = || match Kernel::detect() {
            Kernel::Avx512 => Some(Kernel::detect_int8().filter(|_| int8_activations).unwrap_or(Kernel::Avx512)),
            _ => None,
        };
        match std::env::var("HERALD_Q4_KERNEL").ok().as_deref() {
            None | Some("") => default(),
            Some("tract") => None,
            Some("portable") => Some(Kernel::Portable),
            Some("portable-int8") => Some(Kernel::PortableInt8),
            Some("herald") => Some(Kernel::detect()).filter(|k| *k != Kernel::Portable),
            Some("vnni") => match Kernel::detect_int8() {
                Some(k) => {
                    if !int8_activations {
                        log::warn!("HERALD_Q4_KERNEL=vnni: int8 activations on a bundle whose fidelity gate measured float32 ones");
                    }
                    Some(k)
                }
                None => {
                    log::warn!("HERALD_Q4_KERNEL=vnni: this CPU has no AVX-512 VNNI: using the default");
                    default()
                }
            },
            Some(other) => {
                log::warn!("HERALD_Q4_KERNEL={other:?} is not one of tract, herald, vnni, portable, portable-int8: using the default");
                default()
            }
        }
    }

    /// `y[m][r] = Σ_c w[r][c] · x[m][c]` for every weight row `r < n` and `M` activation rows
    /// `x` (row `m` at `x[m * w.padded_k()..]`, zero past `k`) into `y` (row `m` at
    /// `y[m * y_stride..]`, column `r`).
    fn gemm<const M: usize>(self, w: &Q4Weights, x: &[f32], y: &mut [f32], y_stride: usize) {
        assert!((1..=MAX_X_ROWS).contains(&M) && x.len() >= M * w.padded_k());
        assert!(y_stride >= w.n && y.len() >= (M - 1) * y_stride + w.n);
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `detect` found AVX-512F, AVX2, FMA and F16C on this CPU (the only way to
            // get this variant outside the tests, which check the features themselves); the
            // asserts above bound every read of x and write of y.
            Kernel::Avx512 => unsafe { x86::gemm_avx512::<M>(w, x, y, y_stride) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, AVX2, FMA and F16C.
            Kernel::Avx2 => unsafe { x86::gemm_avx2::<M>(w, x, y, y_stride) },
            Kernel::PortableInt8 | Kernel::Avx512Vnni => unreachable!("{self:?} takes int8 activations (gemm_int8)"),
            _ => gemm_portable::<M>(w, x, y, y_stride),
        }
    }

    /// As [`Kernel::gemm`] with the `M` activation rows quantized ([`quantize_row`]): row `m`
    /// is `xq[m * w.groups..][..w.groups]`.
    fn gemm_int8<const M: usize>(self, w: &Q4Weights, xq: &[QGroup], y: &mut [f32], y_stride: usize) {
        assert!((1..=MAX_X_ROWS).contains(&M) && xq.len() >= M * w.groups && w.layout == Layout::BlockDwords);
        assert!(y_stride >= w.n && y.len() >= (M - 1) * y_stride + w.n);
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `detect_int8` found AVX-512F, BW, VNNI, AVX2, FMA and F16C on this CPU
            // (the only way to get this variant outside the tests, which check the features
            // themselves); the asserts above bound every read of xq and write of y.
            Kernel::Avx512Vnni => unsafe { x86::gemm_vnni::<M>(w, xq, y, y_stride) },
            k if k.int8() => gemm_portable_int8::<M>(w, xq, y, y_stride),
            _ => unreachable!("{self:?} takes float32 activations (gemm)"),
        }
    }
}

/// One group (128 values, four blocks of 32) of an activation row quantized to int8 per block
/// of 32, as GGML's Q8_0 and onnxruntime's `MatMulNBits` with `accuracy_level = 4` do: per
/// block `d = max |x| / 127`, `q = round_half_even(x / d)` (computed as `x · (1 / d)`, 0 when
/// `d` is 0), in the order of [`Layout::BlockDwords`] so that one `vpdpbusd` pairs each lane
/// of weights with its activations. 256 bytes, 64-byte aligned.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
pub(crate) struct QGroup {
    /// Byte `16j + 4h + t`: `q` of value `4j + t` of block `h` (the low nibbles' partners).
    lo: [i8; 64],
    /// Byte `16j + 4h + t`: `q` of value `16 + 4j + t` of block `h` (the high nibbles').
    hi: [i8; 64],
    /// Lane `4j + h`: `−8 ·` the sum of the lane's eight `q` (the weights' offset of 8,
    /// `Σ (w − 8) q = Σ w q − 8 Σ q`, started from here).
    corr: [i32; 16],
    /// Lane `4j + h`: block `h`'s scale `d`.
    d: [f32; 16],
}

impl QGroup {
    const ZERO: QGroup = QGroup { lo: [0; 64], hi: [0; 64], corr: [0; 16], d: [0.0; 16] };
}

/// Quantizes one activation row `x` (`k` values, zero past `k` up to `out.len()` groups of 128)
/// into `out` ([`QGroup`]).
fn quantize_row(x: &[f32], out: &mut [QGroup]) {
    for (g, qg) in out.iter_mut().enumerate() {
        *qg = QGroup::ZERO;
        for h in 0..4 {
            let start = (g * 4 + h) * BLOCK_LEN;
            let xb: [f32; BLOCK_LEN] = std::array::from_fn(|i| x.get(start + i).copied().unwrap_or(0.0));
            let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
            // NaN (a NaN activation) casts to 0; |x · inv| ≤ 127 up to rounding
            let q: [i8; BLOCK_LEN] = std::array::from_fn(|i| (xb[i] * inv).round_ties_even().clamp(-127.0, 127.0) as i8);
            for j in 0..4 {
                let mut sum = 0i32;
                for t in 0..4 {
                    let (lo, hi) = (q[4 * j + t], q[16 + 4 * j + t]);
                    qg.lo[16 * j + 4 * h + t] = lo;
                    qg.hi[16 * j + 4 * h + t] = hi;
                    sum += i32::from(lo) + i32::from(hi);
                }
                qg.corr[4 * j + h] = -8 * sum;
                qg.d[4 * j + h] = d;
            }
        }
    }
}

/// The reference of the int8 kernels: per block the exact integer `Σ (w − 8) q`, times
/// `d_w · d_x`, summed over the blocks in order.
fn gemm_portable_int8<const M: usize>(w: &Q4Weights, xq: &[QGroup], y: &mut [f32], y_stride: usize) {
    for r in 0..w.n {
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
            y[m * y_stride + r] = acc;
        }
    }
}

/// The reference product: `Σ_b d_b · Σ_j (q_j − 8) · x_j`, in order (as [`Kernel::gemm`]).
fn gemm_portable<const M: usize>(w: &Q4Weights, x: &[f32], y: &mut [f32], y_stride: usize) {
    let kp = w.padded_k();
    for r in 0..w.n {
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
            y[m * y_stride + r] = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Group, Q4Weights};

    /// How far ahead of the kernel a panel's stream is prefetched, in bytes: two groups of its
    /// four rows. Measured on the build machine (AMD EPYC, panels streamed from memory):
    /// 12.3–12.4 GB/s of int4 weights from 256 to 2048 bytes ahead.
    /// On an Intel Xeon host (2026-12-05, VNNI kernel, talker step): 29.5–31.8 ms from 512 to
    /// 16384 bytes ahead, no trend (docs/performance.md "Another host").
    pub(super) const PREFETCH: usize = 512;

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
    /// [`super::Kernel::gemm`]); per group and row one 64-byte load, per block a table of
    /// `(q − 8) · d` and [`block_avx512`].
    ///
    /// # Safety
    /// AVX-512F, AVX2, FMA and F16C; `x` holds `M` rows of `w.padded_k()`, `y` `M` rows of
    /// `y_stride ≥ w.n`.
    #[target_feature(enable = "avx512f,avx2,f16c,fma")]
    pub(super) unsafe fn gemm_avx512<const M: usize>(w: &Q4Weights, x: &[f32], y: &mut [f32], y_stride: usize) {
        let kp = w.padded_k();
        let xp = x.as_ptr();
        for p in 0..w.panels() {
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
                    y[m * y_stride + 4 * p + i] = _mm512_reduce_add_ps(*v);
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
    pub(super) unsafe fn gemm_avx2<const M: usize>(w: &Q4Weights, x: &[f32], y: &mut [f32], y_stride: usize) {
        let kp = w.padded_k();
        let xp = x.as_ptr();
        let eight = _mm256_set1_ps(8.0);
        for p in 0..w.panels() {
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
                    y[m * y_stride + 4 * p + i] = hsum256(*v);
                }
            }
        }
    }

    /// The int8-activation kernel ([`super::QGroup`], weights in
    /// [`super::Layout::BlockDwords`]): per group and weight row one 64-byte load, the low and
    /// high nibbles masked out (`vpandd`, `vpsrlw` + `vpandd`), two `vpdpbusd` per activation
    /// row (unsigned nibbles times signed `q`, started from the row's `−8 Σ q`), and one FMA of
    /// the lanes' integer sums by `d_w · d_x` (the four block scales repeat every four lanes).
    ///
    /// # Safety
    /// AVX-512F, BW, VNNI, AVX2, FMA and F16C; `xq` holds `M` rows of `w.groups` groups, `y`
    /// `M` rows of `y_stride ≥ w.n`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c,fma")]
    pub(super) unsafe fn gemm_vnni<const M: usize>(w: &Q4Weights, xq: &[super::QGroup], y: &mut [f32], y_stride: usize) {
        let groups = w.groups;
        let xp = xq.as_ptr();
        let nibble = _mm512_set1_epi8(0x0F);
        for p in 0..w.panels() {
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
                        let xg: [*const super::QGroup; M] = std::array::from_fn(|m| xp.add(m * groups + g));
                        for (i, (acc, di)) in acc.iter_mut().zip(&d).enumerate() {
                            let v = _mm512_load_si512(at.add(i).cast());
                            let lo = _mm512_and_si512(v, nibble);
                            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nibble);
                            let dw = _mm512_broadcast_f32x4(_mm_loadu_ps(di.as_ptr().add(4 * j)));
                            for (a, &x) in acc.iter_mut().zip(&xg) {
                                let q = std::ptr::addr_of!((*x).corr).cast::<__m512i>();
                                let s = _mm512_dpbusd_epi32(
                                    _mm512_load_si512(q),
                                    lo,
                                    _mm512_load_si512(std::ptr::addr_of!((*x).lo).cast()),
                                );
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
                    y[m * y_stride + 4 * p + i] = _mm512_reduce_add_ps(*v);
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
}

/// The product `y [.., n] = x [.., k] · Wᵀ` with a constant Q4_0 weight `W [n, k]`, on
/// herald's kernels (module docs). Input `x` float32 whose axes, permuted, make rows of `k`;
/// output float32 with the rows' leading axes (and size-1 axes), then the axes `n` unflattens
/// into ([`ProductShape`]).
#[derive(Debug, Clone)]
pub struct Q4MatMul {
    weights: Arc<Q4Weights>,
    kernel: Kernel,
    shape: ProductShape,
}

impl PartialEq for Q4MatMul {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.weights, &other.weights) && self.kernel == other.kernel && self.shape == other.shape
    }
}

impl Eq for Q4MatMul {}

impl Q4MatMul {
    /// `y = x · Wᵀ` for f32 `x` of `rows × k` (row-major) into `y` of `rows × n`: passes of up
    /// to [`MAX_X_ROWS`] activation rows over the weights. When `k` is not a multiple of 128
    /// (tiny bundles only) each pass copies its rows into a zero-padded buffer. An int8 kernel
    /// quantizes each pass's rows ([`quantize_row`]) into a buffer of the calling thread, kept
    /// between calls (a decode step allocates nothing once warm).
    fn product(&self, x: &[f32], y: &mut [f32]) {
        let w = &*self.weights;
        let (n, k, kp) = (w.n, w.k, w.padded_k());
        if self.kernel.int8() {
            thread_local! {
                static QUANTIZED: std::cell::RefCell<Vec<QGroup>> = const { std::cell::RefCell::new(Vec::new()) };
            }
            QUANTIZED.with_borrow_mut(|xq| {
                for (xs, ys) in x.chunks(MAX_X_ROWS * k).zip(y.chunks_mut(MAX_X_ROWS * n)) {
                    let m = xs.len() / k;
                    if xq.len() < m * w.groups {
                        xq.resize(m * w.groups, QGroup::ZERO);
                    }
                    for (row, out) in xs.chunks_exact(k).zip(xq.chunks_exact_mut(w.groups)) {
                        quantize_row(row, out);
                    }
                    match m {
                        1 => self.kernel.gemm_int8::<1>(w, xq, ys, n),
                        2 => self.kernel.gemm_int8::<2>(w, xq, ys, n),
                        3 => self.kernel.gemm_int8::<3>(w, xq, ys, n),
                        _ => self.kernel.gemm_int8::<4>(w, xq, ys, n),
                    }
                }
            });
            return;
        }
        let mut padded = Vec::new();
        for (xs, ys) in x.chunks(MAX_X_ROWS * k).zip(y.chunks_mut(MAX_X_ROWS * n)) {
            let m = xs.len() / k;
            let xs = if kp == k {
                xs
            } else {
                padded.clear();
                padded.resize(m * kp, 0f32);
                for (src, dst) in xs.chunks_exact(k).zip(padded.chunks_exact_mut(kp)) {
                    dst[..k].copy_from_slice(src);
                }
                &padded[..]
            };
            match m {
                1 => self.kernel.gemm::<1>(w, xs, ys, n),
                2 => self.kernel.gemm::<2>(w, xs, ys, n),
                3 => self.kernel.gemm::<3>(w, xs, ys, n),
                _ => self.kernel.gemm::<4>(w, xs, ys, n),
            }
        }
    }
}

impl Op for Q4MatMul {
    fn name(&self) -> StaticName {
        "HeraldQ4MatMul".into()
    }

    fn info(&self) -> TractResult<Vec<String>> {
        Ok(vec![format!("W [{}, {}] Q4_0 ({} bytes), {:?} kernel", self.weights.n, self.weights.k, self.weights.bytes(), self.kernel)])
    }

    op_as_typed_op!();
}

impl EvalOp for Q4MatMul {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let x = args_1!(inputs);
        let ps = &self.shape;
        let k = self.weights.k;
        let xs: TVec<usize> = x.shape().into();
        if x.datum_type() != f32::datum_type()
            || xs.len() != ps.x_perm.len()
            || ps.x_perm[ps.x_perm.len() - ps.k_rank..].iter().map(|&a| xs[a]).product::<usize>() != k
        {
            bail!(
                "HeraldQ4MatMul: x must be float32 of rank {} with {k} summed values, got {:?} {xs:?}",
                ps.x_perm.len(),
                x.datum_type()
            );
        }
        let shape: TVec<usize> = ps.y_lead.iter().map(|a| a.map_or(1, |a| xs[a])).chain(ps.n_shape.iter().copied()).collect();
        // rows of k in memory already when the axes that move are all of size 1
        let moved: Vec<usize> = ps.x_perm.iter().copied().filter(|&a| xs[a] != 1).collect();
        let x = if moved.windows(2).all(|w| w[0] < w[1]) { x.into_tensor() } else { x.into_tensor().permute_axes(&ps.x_perm)? };
        // SAFETY: every element is written by `product` (n per row of x).
        let mut y = unsafe { Tensor::uninitialized::<f32>(&shape)? };
        let xv = view::<f32>(&x)?;
        let rows: usize = shape[..shape.len() - ps.n_shape.len()].iter().product();
        if xv.len() != rows * k {
            bail!("HeraldQ4MatMul: x {xs:?} holds {} values, not the {rows} rows of {k} its output {shape:?} needs", xv.len());
        }
        if !xv.is_empty() {
            self.product(xv, view_mut::<f32>(&mut y)?);
        }
        Ok(tvec!(y.into_tvalue()))
    }
}

impl TypedOp for Q4MatMul {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        let ps = &self.shape;
        if inputs.len() != 1 || inputs[0].datum_type != f32::datum_type() || inputs[0].rank() != ps.x_perm.len() {
            bail!("HeraldQ4MatMul takes one float32 input of rank {}; got {inputs:?}", ps.x_perm.len());
        }
        let x = inputs[0];
        let shape: TVec<TDim> = ps
            .y_lead
            .iter()
            .map(|a| a.map_or(1.to_dim(), |a| x.shape[a].clone()))
            .chain(ps.n_shape.iter().map(|d| d.to_dim()))
            .collect();
        Ok(tvec!(f32::fact(shape)))
    }

    fn cost(&self, inputs: &[&TypedFact]) -> TractResult<TVec<(Cost, TDim)>> {
        let rows: TDim = self.shape.y_lead.iter().flatten().map(|&a| inputs[0].shape[a].clone()).product();
        Ok(tvec!((Cost::FMA(f32::datum_type()), rows * (self.weights.n * self.weights.k))))
    }

    as_op!();
}

/// An optimizer pass: replaces every `EinSum` that multiplies a float32 activation by a
/// constant Q4_0 weight `[1, n, k]` or `[n, k]` as `..k, gnk -> ..n` (or `..k, nk -> ..n`) (what tract-onnx wires for
/// `MatMulNBits` with bits 4 and block 32) with a [`Q4MatMul`] on `kernel`. Anything else is
/// left to tract.
#[derive(Clone, Debug)]
pub(crate) struct UseQ4MatMul {
    pub(crate) kernel: Kernel,
    /// Products replaced so far (shared by the clones tract's optimizer session makes).
    pub(crate) replaced: Arc<std::sync::atomic::AtomicUsize>,
}

impl TypedPass for UseQ4MatMul {
    fn reset(&mut self) -> TractResult<()> {
        Ok(())
    }

    fn next(&mut self, _session: &mut OptimizerSession, model: &TypedModel) -> TractResult<Option<TypedModelPatch>> {
        for node in &model.nodes {
            let Some(Matched { weights, shape }) = q4_product(model, node, self.kernel.layout())? else { continue };
            let mut patch = TypedModelPatch::default();
            let x = patch.tap_model(model, node.inputs[0])?;
            let op = Q4MatMul { weights: Arc::new(weights), kernel: self.kernel, shape };
            let y = patch.wire_node(&node.name, op, &[x])?[0];
            patch.shunt_outside(model, OutletId::new(node.id, 0), y)?;
            self.replaced.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Ok(Some(patch));
        }
        Ok(None)
    }
}

/// A Q4_0 product herald's kernels cover, as [`q4_product`] found it.
struct Matched {
    weights: Q4Weights,
    shape: ProductShape,
}

/// How a [`Q4MatMul`]'s operands lie in their tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ProductShape {
    /// The axes of `x` in the order that makes it rows of `k`: the size-1 axes the output
    /// drops, the leading (row) axes in order, then the summed axes in the weight's order.
    x_perm: TVec<usize>,
    /// Summed axes (the last `k_rank` of `x` permuted by `x_perm`), flattening into `k`.
    k_rank: usize,
    /// The output's leading axes: `Some(a)` takes the size of `x`'s axis `a`, `None` is 1.
    y_lead: TVec<Option<usize>>,
    /// The output's trailing axes, which `n` unflattens into.
    n_shape: TVec<usize>,
}

/// Whether `node` (an `EinSum`, or tract's `EinSumMatMul` around one) multiplies a float32
/// activation by a constant Q4_0 weight as `y[.., N..] = Σ_K x[.., K..] · W[G.., N.., K..]`:
/// the weight's axes are size-1 axes found nowhere else, then output axes that end the output
/// in the same order, then summed axes that end `x` in the same order; every other axis runs
/// through `x` and the output at the same leading position. (Decluttering folds reshapes into
/// the weight, e.g. `[hidden, heads, head_dim]` for the attention output projection; the
/// blocks still run along the flattened rows.) Returns the weight in herald's layout.
fn q4_product(model: &TypedModel, node: &TypedNode, layout: Layout) -> TractResult<Option<Matched>> {
    let Some(einsum) = crate::runtime_matmul::binary_f32_einsum(node) else { return Ok(None) };
    let x_fact = model.outlet_fact(node.inputs[0])?;
    let w_fact = model.outlet_fact(node.inputs[1])?;
    let y_fact = model.outlet_fact(OutletId::new(node.id, 0))?;
    if x_fact.datum_type != f32::datum_type() || y_fact.datum_type != f32::datum_type() {
        return Ok(None);
    }
    let Some(w) = w_fact.konst.as_ref() else { return Ok(None) };
    if w_fact.exotic_fact.as_ref().and_then(|f| f.downcast_ref::<BlockQuantFact>()).is_none() {
        return Ok(None);
    }
    let Ok(storage) = w.try_storage_as::<BlockQuantStorage>() else { return Ok(None) };
    let q4_0: &dyn tract_linalg::block_quant::BlockQuant = &Q4_0;
    if *storage.format() != *q4_0 {
        return Ok(None);
    }
    let not_covered = |why: &str| {
        log::debug!("{}: a Q4_0 product left to tract ({why}): {} on {:?} and {:?}", node.name, einsum.axes, x_fact, w_fact);
        Ok(None)
    };
    let (xr, yr) = (x_fact.rank(), y_fact.rank());
    let one = |f: &TypedFact, a: usize| f.shape[a].is_one();
    // (weight position, x position) of the summed axes, (weight, output) of the output
    // features, (x, output) of the rows, x's size-1 axes the output drops, the output's
    // size-1 axes found in no operand (left None in `y_lead`)
    let (mut k_axes, mut n_axes, mut rows, mut x_only) = (vec![], vec![], vec![], vec![]);
    for axis in einsum.axes.iter_all_axes() {
        if axis.inputs.len() != 2 || axis.outputs.len() != 1 || axis.inputs.iter().chain(&axis.outputs).any(|p| p.len() > 1) {
            return not_covered("an axis repeated within an operand");
        }
        match (axis.inputs[0].first(), axis.inputs[1].first(), axis.outputs[0].first()) {
            (Some(&x), Some(&w), None) => k_axes.push((w, x)),
            (None, Some(&w), Some(&y)) => n_axes.push((w, y)),
            (None, Some(&w), None) if one(w_fact, w) => {}
            (Some(&x), None, Some(&y)) => rows.push((x, y)),
            (Some(&x), None, None) if one(x_fact, x) => x_only.push(x),
            // a size-1 output axis: `y_lead` below leaves it None
            (None, None, Some(&y)) if one(y_fact, y) => {}
            _ => return not_covered("an axis of the weight kept with x, or a summed axis of size above 1 in one operand"),
        }
    }
    k_axes.sort_unstable();
    n_axes.sort_unstable();
    rows.sort_unstable_by_key(|&(_, y)| y);
    let (kc, nc) = (k_axes.len(), n_axes.len());
    // the weight: output features before summed axes (size-1 axes anywhere); the output:
    // the features last, in the weight's order; rows in the same order in x and the output
    let w_order = n_axes.iter().map(|a| a.0).max() < k_axes.iter().map(|a| a.0).min();
    let y_order = n_axes.iter().enumerate().all(|(i, &(_, y))| y == yr - nc + i);
    let row_order = rows.windows(2).all(|p| p[0].0 < p[1].0);
    if kc == 0 || nc == 0 || !w_order || !y_order || !row_order {
        return not_covered("axes not in the order W [N.., K..], y [.., N..]");
    }
    let x_perm: TVec<usize> = x_only.iter().copied().chain(rows.iter().map(|r| r.0)).chain(k_axes.iter().map(|a| a.1)).collect();
    if x_perm.len() != xr {
        return not_covered("x axes unaccounted for");
    }
    let mut y_lead: TVec<Option<usize>> = tvec![None; yr - nc];
    for &(x, y) in &rows {
        y_lead[y] = Some(x);
    }
    let n_shape: TVec<usize> = n_axes.iter().map(|&(a, _)| w.shape()[a]).collect();
    let k: usize = k_axes.iter().map(|&(a, _)| w.shape()[a]).product();
    let n: usize = n_shape.iter().product();
    let Some(weights) = Q4Weights::from_q4_0(storage.value(), n, k, layout) else {
        return not_covered("k not a multiple of 32 or storage of another size");
    };
    Ok(Some(Matched { weights, shape: ProductShape { x_perm, k_rank: kc, y_lead, n_shape } }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random Q4_0 blocks for `n × k` weights: random nibbles, scales in ±[0.01, 0.1).
    fn blocks(n: usize, k: usize, seed: u64) -> Vec<u8> {
        let mut rng = crate::xorshift(seed);
        let mut out = Vec::new();
        for _ in 0..n * k / BLOCK_LEN {
            let r = rng.next().unwrap();
            let s = (0.01 + (r % 1000) as f32 / 1000.0 * 0.09) * if r & (1 << 20) != 0 { -1.0 } else { 1.0 };
            out.extend_from_slice(&half::f16::from_f32(s).to_bits().to_le_bytes());
            for _ in 0..16 {
                out.push(rng.next().unwrap() as u8);
            }
        }
        out
    }

    fn floats(n: usize, seed: u64) -> Vec<f32> {
        crate::xorshift(seed).take(n).map(|s| (s % 2001) as f32 / 1000.0 - 1.0).collect()
    }

    /// The product from tract's own dequantization (`BlockQuant::dequant_f32`) in f64.
    fn reference(bytes: &[u8], n: usize, k: usize, x: &[f32]) -> Vec<f64> {
        use tract_linalg::block_quant::BlockQuant;
        let w = Q4_0.dequant_f32(bytes).unwrap();
        let w = view::<f32>(&w).unwrap();
        let rows = x.len() / k;
        let mut y = vec![0f64; rows * n];
        for s in 0..rows {
            for r in 0..n {
                y[s * n + r] = (0..k).map(|c| w[r * k + c] as f64 * x[s * k + c] as f64).sum();
            }
        }
        y
    }

    fn kernels() -> Vec<Kernel> {
        let mut v = vec![Kernel::Portable, Kernel::PortableInt8];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                v.push(Kernel::Avx2);
            }
            if Kernel::detect() == Kernel::Avx512 {
                v.push(Kernel::Avx512);
            }
            v.extend(Kernel::detect_int8());
        }
        v
    }

    /// Q8_0 of `x` (rows of `k`) as GGML defines it, written out here independently of
    /// [`quantize_row`]: per block of 32, `d = max |x| / 127` and `q = round_half_even(x / d)`;
    /// returns `q · d` per value (what an int8 kernel multiplies the weights by).
    fn q8_0(x: &[f32]) -> Vec<f32> {
        let mut out = Vec::with_capacity(x.len());
        for b in x.chunks(32) {
            let d = b.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
            out.extend(b.iter().map(|v| if d == 0.0 { 0.0 } else { (v * (1.0 / d)).round_ties_even() * d }));
        }
        out
    }

    /// Every kernel, one row and several, against tract's own dequantization: within float32
    /// rounding of the sum (relative to the sum of absolute terms), for weight-row counts that
    /// leave partial groups of four rows, block counts that leave partial groups of four blocks
    /// (a padded last group) and of sixteen (a partial run of scales), and activation-row counts
    /// of every pass width (1–4) and of several passes (5, 17). The int8 kernels are held to
    /// the same bound against the product of the weights with Q8_0 of x ([`q8_0`]); that
    /// product itself stays within 1 % of Σ |w x| of the float one (the Q8_0 rounding,
    /// at most d/2 per value).
    #[test]
    fn every_kernel_matches_tracts_dequantization() {
        for &(n, k) in &[(1usize, 32usize), (5, 64), (37, 544), (64, 1024), (19, 3072)] {
            let bytes = blocks(n, k, (n * 31 + k) as u64);
            for layout in [Layout::Interleaved, Layout::BlockDwords] {
                let w = Q4Weights::from_q4_0(&bytes, n, k, layout).unwrap();
                // whole groups of 64 nibble bytes and four scales per row
                assert_eq!(w.bytes(), n.div_ceil(4) * 4 * (k.div_ceil(128) * 64 + k.div_ceil(512) * 32));
                if k % 512 == 0 && n % 4 == 0 {
                    assert_eq!(w.bytes(), bytes.len(), "no padding when k is a multiple of 512 and n of 4");
                }
            }
            for rows in [1usize, 2, 3, 4, 5, 17] {
                let x = floats(rows * k, (rows * 7 + k) as u64);
                let xq = q8_0(&x);
                let want = reference(&bytes, n, k, &x);
                let want_q8 = reference(&bytes, n, k, &xq);
                // the scale of the rounding error: Σ |w x| ≤ 8 · 0.1 · Σ |x| per row
                let abs: Vec<f64> = x.chunks(k).map(|r| r.iter().map(|v| v.abs() as f64).sum::<f64>() * 0.8).collect();
                for (i, (a, b)) in want_q8.iter().zip(&want).enumerate() {
                    assert!((a - b).abs() <= 0.01 * abs[i / n], "Q8_0 of x moves [{i}] from {b} to {a}");
                }
                for kernel in kernels() {
                    let op = Q4MatMul {
                        weights: Arc::new(Q4Weights::from_q4_0(&bytes, n, k, kernel.layout()).unwrap()),
                        kernel,
                        shape: ProductShape { x_perm: tvec![0, 1], k_rank: 1, y_lead: tvec![Some(0)], n_shape: tvec![n] },
                    };
                    let mut y = vec![f32::NAN; rows * n];
                    op.product(&x, &mut y);
                    let want = if kernel.int8() { &want_q8 } else { &want };
                    for (i, (a, b)) in y.iter().zip(want).enumerate() {
                        let tol = abs[i / n] * 1e-5 + 1e-6;
                        assert!((*a as f64 - b).abs() <= tol, "{kernel:?} n={n} k={k} rows={rows} [{i}]: {a} vs {b} (tol {tol})");
                    }
                }
            }
        }
    }

    /// [`quantize_row`] against the definition: every value's `q` and its block's `d` where
    /// [`Layout::BlockDwords`] puts them, the lanes' `−8 Σ q`, zeros past `k`; a block of zeros
    /// has `d = 0`, a half rounds to even, the extremes are ±127.
    #[test]
    #[allow(clippy::needless_range_loop)] // g, h, l, j index the layout's positions together
    fn quantizes_as_q8_0() {
        let k = 160; // one whole group and a padded one
        let mut x = floats(k, 3);
        x[32..64].fill(0.0); // block 1: zeros
        // block 2: max 127 so d = 1; 2.5 rounds to 2, -3.5 to -4
        x[64] = 127.0;
        x[65] = 2.5;
        x[66] = -3.5;
        let mut out = vec![QGroup::ZERO; 2];
        quantize_row(&x, &mut out);
        for g in 0..2 {
            for h in 0..4 {
                let start = (g * 4 + h) * 32;
                let block: Vec<f32> = (0..32).map(|i| x.get(start + i).copied().unwrap_or(0.0)).collect();
                let d = block.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
                for l in 0..32 {
                    let want = if d == 0.0 { 0 } else { (block[l] / d).round_ties_even() as i8 };
                    let at = 16 * ((l % 16) / 4) + 4 * h + l % 4;
                    let got = if l < 16 { out[g].lo[at] } else { out[g].hi[at] };
                    assert!((i32::from(got) - i32::from(want)).abs() <= 1, "group {g} block {h} value {l}: {got} vs {want}");
                    if d == 0.0 || (block[l] / d).fract().abs() != 0.5 {
                        // away from ties x · (1/d) and x / d round alike here
                        assert_eq!(got, want, "group {g} block {h} value {l}");
                    }
                }
                for j in 0..4 {
                    assert_eq!(out[g].d[4 * j + h], d);
                    let lane: i32 =
                        (0..4).map(|t| i32::from(out[g].lo[16 * j + 4 * h + t]) + i32::from(out[g].hi[16 * j + 4 * h + t])).sum();
                    assert_eq!(out[g].corr[4 * j + h], -8 * lane);
                }
            }
        }
        assert_eq!(out[0].d[1], 0.0, "a block of zeros");
        // values 0, 1, 2 of block 2 at bytes 8, 9, 10 (j = 0, h = 2)
        assert_eq!((out[0].lo[8], out[0].lo[9], out[0].lo[10], out[0].d[2]), (127, 2, -4, 1.0), "127, 2.5 and -3.5 with d = 1");
        assert!(out[1].d[1..4].iter().all(|&d| d == 0.0), "the padding past k");
    }

    #[test]
    fn rejects_what_it_does_not_cover() {
        for layout in [Layout::Interleaved, Layout::BlockDwords] {
            assert!(Q4Weights::from_q4_0(&[0; 18], 1, 48, layout).is_none(), "k not a multiple of 32");
            assert!(Q4Weights::from_q4_0(&[0; 17], 1, 32, layout).is_none(), "partial block");
            assert!(Q4Weights::from_q4_0(&[], 0, 32, layout).is_none(), "no rows");
        }
    }

    /// In a whole optimize, every Q4_0 einsum becomes a [`Q4MatMul`], and the plan computes
    /// what tract's own kernels compute within float32 rounding, for a decode step and a
    /// prefill batch.
    #[test]
    fn optimized_plan_matches_tracts_kernels() {
        let (m, k) = (96, 128);
        for s in [1usize, 7] {
            let mut ours = crate::q4pack::tests::q4_matmul(m, k, s);
            let done = crate::q4pack::optimize_with(&mut ours, Some(Kernel::detect())).unwrap();
            assert_eq!(done, crate::q4pack::Q4Products { herald: 1, packed: 0, kernel: Some(Kernel::detect()) });
            let ops: Vec<String> = ours.nodes.iter().map(|n| n.op.name().to_string()).collect();
            assert!(ops.iter().any(|o| o == "HeraldQ4MatMul"), "herald's product in the plan: {ops:?}");
            let mut theirs = crate::q4pack::tests::q4_matmul(m, k, s);
            theirs.optimize().unwrap();
            let x: Vec<f32> = floats(s * k, 5);
            let x = Tensor::from_shape(&[1, s, k], &x).unwrap();
            let run = |model: TypedModel| {
                model.into_runnable().unwrap().run(tvec!(x.clone().into_tvalue())).unwrap().remove(0).into_tensor()
            };
            let (a, b) = (run(ours), run(theirs));
            assert_eq!(a.shape(), &[1, s, m]);
            let (a, b) = (view::<f32>(&a).unwrap(), view::<f32>(&b).unwrap());
            let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(scale > 0.0, "a non-trivial product");
            for (i, (p, q)) in a.iter().zip(b).enumerate() {
                assert!((p - q).abs() <= 1e-5 * scale, "[{i}] herald {p} vs tract {q}");
            }
        }
    }
}
