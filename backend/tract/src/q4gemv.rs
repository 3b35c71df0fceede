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
//! - the weights are kept row by row, each row's nibbles contiguous (`k / 2` bytes, GGML's
//!   order within a block: byte `j` holds weight `j` low and `j + 16` high) and its f16 block
//!   scales in a separate array, so that a row is one sequential stream;
//! - AVX-512: sixteen nibbles become sixteen f32 lanes with one zero-extension and one
//!   permutation through a 16-entry table of `q - 8` (`vpermps` reads only the low four bits
//!   of each index, so no mask is needed); four rows share each activation load;
//! - AVX2 + FMA + F16C: the same with eight lanes, the `- 8` taken out as `8 · Σ x` per block;
//! - elsewhere (and as the tests' reference): a plain loop, `Σ_b d_b Σ_j (q_j − 8) x_j`.
//!
//! Activations and accumulation stay f32, as in tract's kernel and onnxruntime's default
//! `MatMulNBits`: the products differ from theirs by summation order only (the parity test
//! against onnxruntime keeps checking codes and PCM).
//!
//! For more than one activation row (the prefill), each tile of [`TILE_ROWS`] weight rows is
//! dequantized once to f32 and every activation row is multiplied against it, so the weights
//! are still read from memory once.

use std::sync::Arc;

use tract_linalg::block_quant::{BlockQuantFact, BlockQuantStorage, Q4_0};
use tract_onnx::prelude::*;
use tract_onnx::tract_core::ops::einsum::EinSum;
use tract_onnx::tract_core::ops::einsum::einsum_matmul::EinSumMatMul;
use tract_onnx::tract_core::optim::{OptimizerSession, TypedPass};
use tract_onnx::tract_hir::internal::*;

use crate::stack::{view, view_mut};

/// Weights per Q4_0 block (GGML's `QK4_0`).
const BLOCK_LEN: usize = 32;
/// Bytes per GGML Q4_0 block: an f16 scale, then 16 bytes of nibbles.
const BLOCK_BYTES: usize = 18;
/// Weight rows dequantized at once for a product of several activation rows: 16 rows of
/// `k = 3072` are 192 KB of f32, which stays in the L2 cache while every row multiplies them.
const TILE_ROWS: usize = 16;

/// A Q4_0 weight `[n, k]` in the layout of herald's kernels: for row `r`, its `k / 2` nibble
/// bytes at `nibbles[r * k / 2..]` (per block of 32 weights, byte `j` holds weight `j` in its
/// low nibble and weight `j + 16` in its high nibble; a weight is `(q − 8) · scale`) and its
/// `k / 32` block scales, f16 bits, at `scales[r * k / 32..]`.
#[derive(Debug)]
pub(crate) struct Q4Weights {
    /// Output features (rows).
    n: usize,
    /// Input features (columns), a positive multiple of 32.
    k: usize,
    nibbles: Vec<u8>,
    scales: Vec<u16>,
}

impl Q4Weights {
    /// From GGML Q4_0 blocks (`n` rows of `k / 32` blocks of 18 bytes, rows one after the
    /// other), or `None` when `k` is not a positive multiple of 32 or the length does not match.
    pub(crate) fn from_q4_0(blocks: &[u8], n: usize, k: usize) -> Option<Q4Weights> {
        if n == 0 || k == 0 || !k.is_multiple_of(BLOCK_LEN) || blocks.len() != n * k / BLOCK_LEN * BLOCK_BYTES {
            return None;
        }
        let mut nibbles = Vec::with_capacity(n * k / 2);
        let mut scales = Vec::with_capacity(n * k / BLOCK_LEN);
        for block in blocks.chunks_exact(BLOCK_BYTES) {
            scales.push(u16::from_le_bytes([block[0], block[1]]));
            nibbles.extend_from_slice(&block[2..]);
        }
        Some(Q4Weights { n, k, nibbles, scales })
    }

    /// Bytes held: the nibbles and the f16 scales (0.5625 bytes per weight).
    pub(crate) fn bytes(&self) -> usize {
        self.nibbles.len() + 2 * self.scales.len()
    }

    fn row_nibbles(&self, r: usize) -> &[u8] {
        &self.nibbles[r * self.k / 2..][..self.k / 2]
    }

    fn row_scales(&self, r: usize) -> &[u16] {
        &self.scales[r * self.k / BLOCK_LEN..][..self.k / BLOCK_LEN]
    }

    /// Row `r` as f32 weights, `(q − 8) · scale` (`out.len() == k`).
    fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let (nib, sc) = (self.row_nibbles(r), self.row_scales(r));
        for (b, (q, o)) in nib.chunks_exact(BLOCK_LEN / 2).zip(out.chunks_exact_mut(BLOCK_LEN)).enumerate() {
            let d = half::f16::from_bits(sc[b]).to_f32();
            for (j, &byte) in q.iter().enumerate() {
                o[j] = ((byte & 0x0F) as f32 - 8.0) * d;
                o[j + 16] = ((byte >> 4) as f32 - 8.0) * d;
            }
        }
    }
}

/// Which kernel a product runs on: the widest the CPU has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// Plain Rust, any CPU.
    Portable,
    /// AVX2 + FMA + F16C (x86-64).
    Avx2,
    /// AVX-512F (x86-64).
    Avx512,
}

impl Kernel {
    /// The widest kernel this CPU runs.
    pub(crate) fn detect() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
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

    /// Whether this CPU has a kernel worth using in place of tract's: a vector one. On other
    /// CPUs (aarch64 today) tract's own Q4_0 kernels stay.
    pub(crate) fn available() -> bool {
        Kernel::detect() != Kernel::Portable
    }

    /// The kernel the optimizer puts in place of tract's Q4_0 products, or `None` to keep
    /// tract's. Opt-in for now, through the environment variable `HERALD_Q4_KERNEL`: `herald`
    /// picks [`Kernel::detect`] when [`Kernel::available`], `portable` the plain loop; unset,
    /// empty or `tract` keeps tract's kernels (the default: herald's do not yet beat them end
    /// to end, docs/performance.md). Any other value is ignored with a warning.
    pub(crate) fn chosen() -> Option<Kernel> {
        match std::env::var("HERALD_Q4_KERNEL").ok().as_deref() {
            None | Some("") | Some("tract") => None,
            Some("portable") => Some(Kernel::Portable),
            Some("herald") => Kernel::available().then(Kernel::detect),
            Some(other) => {
                log::warn!("HERALD_Q4_KERNEL={other:?} is not one of tract, herald, portable: keeping tract's kernels");
                None
            }
        }
    }

    /// `y[i] = Σ_c w[rows.start + i][c] · x[c]` for the rows `rows` of `w` (`x.len() == w.k`,
    /// `y.len() == rows.len()`).
    fn gemv(self, w: &Q4Weights, rows: std::ops::Range<usize>, x: &[f32], y: &mut [f32]) {
        debug_assert_eq!(x.len(), w.k);
        debug_assert_eq!(y.len(), rows.len());
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `detect` found AVX-512F on this CPU (the only way to get this variant
            // outside the tests, which check the feature themselves).
            Kernel::Avx512 => unsafe { x86::gemv_avx512(w, rows, x, y) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, AVX2, FMA and F16C.
            Kernel::Avx2 => unsafe { x86::gemv_avx2(w, rows, x, y) },
            _ => gemv_portable(w, rows, x, y),
        }
    }
}

/// The reference product: `Σ_b d_b · Σ_j (q_j − 8) · x_j`, in order.
fn gemv_portable(w: &Q4Weights, rows: std::ops::Range<usize>, x: &[f32], y: &mut [f32]) {
    for (r, out) in rows.zip(y.iter_mut()) {
        let (nib, sc) = (w.row_nibbles(r), w.row_scales(r));
        let mut acc = 0f32;
        for (b, (q, xs)) in nib.chunks_exact(BLOCK_LEN / 2).zip(x.chunks_exact(BLOCK_LEN)).enumerate() {
            let mut t = 0f32;
            for (j, &byte) in q.iter().enumerate() {
                t += ((byte & 0x0F) as f32 - 8.0) * xs[j] + ((byte >> 4) as f32 - 8.0) * xs[j + 16];
            }
            acc += half::f16::from_bits(sc[b]).to_f32() * t;
        }
        *out = acc;
    }
}

/// `y[r] = Σ_c a[r][c] · x[c]` for f32 rows `a` (`rows × k`, row-major) (the prefill's tile).
fn dot_rows(kernel: Kernel, a: &[f32], k: usize, x: &[f32], y: &mut [f32]) {
    match kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `Kernel::gemv`.
        Kernel::Avx512 => unsafe { x86::dot_rows_avx512(a, k, x, y) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `Kernel::gemv`.
        Kernel::Avx2 => unsafe { x86::dot_rows_avx2(a, k, x, y) },
        _ => {
            for (row, out) in a.chunks_exact(k).zip(y.iter_mut()) {
                *out = row.iter().zip(x).map(|(a, b)| a * b).sum();
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{BLOCK_LEN, Q4Weights};

    /// How far ahead of the kernel each row's nibbles are prefetched, in bytes.
    const PREFETCH: usize = 256;

    /// The f16 block scales `src` as f32 into `dst` (16 at a time with F16C).
    #[inline(always)]
    unsafe fn scales_f32(src: &[u16], dst: &mut [f32; 16]) {
        if src.len() == 16 {
            // SAFETY: 16 u16 read, 16 f32 written; F16C comes with both kernels' features.
            unsafe {
                let h = _mm256_loadu_si256(src.as_ptr().cast());
                _mm256_storeu_ps(dst.as_mut_ptr(), _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
                _mm256_storeu_ps(dst.as_mut_ptr().add(8), _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(h)));
            }
        } else {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = half::f16::from_bits(*s).to_f32();
            }
        }
    }

    /// Four rows at a time, then one at a time; per block, 16 nibble bytes zero-extended to
    /// 16 lanes, the low and high nibbles looked up in a table of `q − 8`.
    #[target_feature(enable = "avx512f,avx2,f16c,fma")]
    #[allow(clippy::needless_range_loop)] // j indexes the blocks, the scales and the row offsets together
    pub(super) unsafe fn gemv_avx512(w: &Q4Weights, rows: std::ops::Range<usize>, x: &[f32], y: &mut [f32]) {
        let blocks = w.k / BLOCK_LEN;
        let lut = _mm512_setr_ps(-8., -7., -6., -5., -4., -3., -2., -1., 0., 1., 2., 3., 4., 5., 6., 7.);
        let xp = x.as_ptr();
        let mut r = rows.start;
        let mut out = 0;
        while r < rows.end {
            let tall = (rows.end - r).min(4);
            let mut nib = [std::ptr::null::<u8>(); 4];
            for (i, p) in nib.iter_mut().enumerate() {
                *p = w.row_nibbles(r + i.min(tall - 1)).as_ptr();
            }
            let mut acc = [_mm512_setzero_ps(); 4];
            let mut d = [[0f32; 16]; 4];
            let mut b0 = 0;
            while b0 < blocks {
                let g = (blocks - b0).min(16);
                for (i, di) in d.iter_mut().enumerate() {
                    // SAFETY: g ≤ 16 scales of the row.
                    unsafe { scales_f32(&w.row_scales(r + i.min(tall - 1))[b0..b0 + g], di) };
                }
                for j in 0..g {
                    let b = b0 + j;
                    if b % 4 == 0 {
                        for p in nib {
                            // a hint only: prefetching past the end of the row is harmless
                            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(b * 16 + PREFETCH).cast());
                        }
                    }
                    // SAFETY: block b < blocks: 32 floats of x and 16 bytes of each row.
                    unsafe {
                        let xl = _mm512_loadu_ps(xp.add(b * BLOCK_LEN));
                        let xh = _mm512_loadu_ps(xp.add(b * BLOCK_LEN + 16));
                        for i in 0..4 {
                            let q = _mm512_cvtepu8_epi32(_mm_loadu_si128(nib[i].add(b * 16).cast()));
                            let wl = _mm512_permutexvar_ps(q, lut);
                            let wh = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), lut);
                            let t = _mm512_fmadd_ps(wh, xh, _mm512_mul_ps(wl, xl));
                            acc[i] = _mm512_fmadd_ps(t, _mm512_set1_ps(d[i][j]), acc[i]);
                        }
                    }
                }
                b0 += g;
            }
            for (i, a) in acc.iter().enumerate().take(tall) {
                y[out + i] = _mm512_reduce_add_ps(*a);
            }
            r += tall;
            out += tall;
        }
    }

    /// Eight lanes: per block, the four runs of eight weights (bytes 0–7 and 8–15, low and
    /// high nibbles) zero-extended and converted; `Σ (q − 8) x = Σ q x − 8 Σ x`, with the block
    /// sums of `x` taken once.
    #[target_feature(enable = "avx2,f16c,fma")]
    #[allow(clippy::needless_range_loop)] // j indexes the blocks, the scales and the block sums together
    pub(super) unsafe fn gemv_avx2(w: &Q4Weights, rows: std::ops::Range<usize>, x: &[f32], y: &mut [f32]) {
        let blocks = w.k / BLOCK_LEN;
        let sums: Vec<f32> = x.chunks_exact(BLOCK_LEN).map(|c| c.iter().sum::<f32>() * 8.0).collect();
        let xp = x.as_ptr();
        let low = _mm256_set1_epi32(0x0F);
        let mut d = [0f32; 16];
        for (r, out) in rows.zip(y.iter_mut()) {
            let nib = w.row_nibbles(r).as_ptr();
            let sc = w.row_scales(r);
            let mut acc = _mm256_setzero_ps();
            let mut corr = 0f32;
            let mut b0 = 0;
            while b0 < blocks {
                let g = (blocks - b0).min(16);
                // SAFETY: g ≤ 16 scales.
                unsafe { scales_f32(&sc[b0..b0 + g], &mut d) };
                for j in 0..g {
                    let b = b0 + j;
                    // SAFETY: block b < blocks: 32 floats of x, 16 bytes of the row.
                    unsafe {
                        let q0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(nib.add(b * 16).cast()));
                        let q1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(nib.add(b * 16 + 8).cast()));
                        let xb = xp.add(b * BLOCK_LEN);
                        let mut t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q0, low)), _mm256_loadu_ps(xb));
                        t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q1, low)), _mm256_loadu_ps(xb.add(8)), t);
                        t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(q0)), _mm256_loadu_ps(xb.add(16)), t);
                        t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(q1)), _mm256_loadu_ps(xb.add(24)), t);
                        acc = _mm256_fmadd_ps(t, _mm256_set1_ps(d[j]), acc);
                    }
                    corr += d[j] * sums[b];
                }
                b0 += g;
            }
            *out = hsum256(acc) - corr;
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

    /// f32 rows against one vector, four rows sharing each load of `x`.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn dot_rows_avx512(a: &[f32], k: usize, x: &[f32], y: &mut [f32]) {
        let rows = y.len();
        let mut r = 0;
        while r < rows {
            let tall = (rows - r).min(4);
            let p: [*const f32; 4] = std::array::from_fn(|i| a[(r + i.min(tall - 1)) * k..].as_ptr());
            let mut acc = [_mm512_setzero_ps(); 4];
            let mut c = 0;
            while c + 16 <= k {
                // SAFETY: c + 16 ≤ k floats of x and of each row.
                unsafe {
                    let xv = _mm512_loadu_ps(x.as_ptr().add(c));
                    for i in 0..4 {
                        acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(p[i].add(c)), xv, acc[i]);
                    }
                }
                c += 16;
            }
            for i in 0..tall {
                let mut s = _mm512_reduce_add_ps(acc[i]);
                for cc in c..k {
                    s += a[(r + i) * k + cc] * x[cc];
                }
                y[r + i] = s;
            }
            r += tall;
        }
    }

    /// As [`dot_rows_avx512`] with eight lanes.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_rows_avx2(a: &[f32], k: usize, x: &[f32], y: &mut [f32]) {
        for (row, out) in a.chunks_exact(k).zip(y.iter_mut()) {
            let mut acc = _mm256_setzero_ps();
            let mut c = 0;
            while c + 8 <= k {
                // SAFETY: c + 8 ≤ k floats of x and of the row.
                unsafe { acc = _mm256_fmadd_ps(_mm256_loadu_ps(row.as_ptr().add(c)), _mm256_loadu_ps(x.as_ptr().add(c)), acc) };
                c += 8;
            }
            let mut s = hsum256(acc);
            for cc in c..k {
                s += row[cc] * x[cc];
            }
            *out = s;
        }
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
    /// `y = x · Wᵀ` for f32 `x` of `rows × k` (row-major) into `y` of `rows × n`.
    fn product(&self, x: &[f32], y: &mut [f32]) {
        let (n, k) = (self.weights.n, self.weights.k);
        let rows = x.len() / k;
        if rows == 1 {
            self.kernel.gemv(&self.weights, 0..n, x, y);
            return;
        }
        // the prefill: a tile of weight rows dequantized once, every activation row against it
        let mut tile = vec![0f32; TILE_ROWS * k];
        let mut out = [0f32; TILE_ROWS];
        for r0 in (0..n).step_by(TILE_ROWS) {
            let tall = (n - r0).min(TILE_ROWS);
            for i in 0..tall {
                self.weights.dequantize_row(r0 + i, &mut tile[i * k..][..k]);
            }
            for (xs, ys) in x.chunks_exact(k).zip(y.chunks_exact_mut(n)) {
                dot_rows(self.kernel, &tile[..tall * k], k, xs, &mut out[..tall]);
                ys[r0..r0 + tall].copy_from_slice(&out[..tall]);
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
            let Some(Matched { weights, shape }) = q4_product(model, node)? else { continue };
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
fn q4_product(model: &TypedModel, node: &TypedNode) -> TractResult<Option<Matched>> {
    let einsum = match (node.op_as::<EinSum>(), node.op_as::<EinSumMatMul>()) {
        (Some(e), _) => e,
        (None, Some(m)) => &m.op,
        (None, None) => return Ok(None),
    };
    if node.inputs.len() != 2 || einsum.q_params.is_some() || einsum.operating_dt != f32::datum_type() {
        return Ok(None);
    }
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
    // size-1 axes found in no operand
    let (mut k_axes, mut n_axes, mut rows, mut x_only, mut y_only) = (vec![], vec![], vec![], vec![], vec![]);
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
            (None, None, Some(&y)) if one(y_fact, y) => y_only.push(y),
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
    debug_assert!(y_only.iter().all(|&y| y_lead[y].is_none()));
    let n_shape: TVec<usize> = n_axes.iter().map(|&(a, _)| w.shape()[a]).collect();
    let k: usize = k_axes.iter().map(|&(a, _)| w.shape()[a]).product();
    let n: usize = n_shape.iter().product();
    let Some(weights) = Q4Weights::from_q4_0(storage.value(), n, k) else {
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
        let mut v = vec![Kernel::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                v.push(Kernel::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                v.push(Kernel::Avx512);
            }
        }
        v
    }

    /// Every kernel, one row and several, against tract's own dequantization: within float32
    /// rounding of the sum (relative to the sum of absolute terms), for row counts that leave
    /// partial groups of four rows and block counts that leave partial groups of sixteen.
    #[test]
    fn every_kernel_matches_tracts_dequantization() {
        for &(n, k) in &[(1usize, 32usize), (5, 64), (37, 544), (64, 1024), (19, 3072)] {
            let bytes = blocks(n, k, (n * 31 + k) as u64);
            let w = Q4Weights::from_q4_0(&bytes, n, k).unwrap();
            assert_eq!(w.bytes(), bytes.len());
            for rows in [1usize, 3, 17] {
                let x = floats(rows * k, (rows * 7 + k) as u64);
                let want = reference(&bytes, n, k, &x);
                // the scale of the rounding error: Σ |w x| ≤ 8 · 0.1 · Σ |x| per row
                let bound: Vec<f64> = x.chunks(k).map(|r| r.iter().map(|v| v.abs() as f64).sum::<f64>() * 0.8 * 1e-5 + 1e-6).collect();
                for kernel in kernels() {
                    let op = Q4MatMul {
                        weights: Arc::new(Q4Weights::from_q4_0(&bytes, n, k).unwrap()),
                        kernel,
                        shape: ProductShape { x_perm: tvec![0, 1], k_rank: 1, y_lead: tvec![Some(0)], n_shape: tvec![n] },
                    };
                    let mut y = vec![f32::NAN; rows * n];
                    op.product(&x, &mut y);
                    for (i, (a, b)) in y.iter().zip(&want).enumerate() {
                        let tol = bound[i / n];
                        assert!((*a as f64 - b).abs() <= tol, "{kernel:?} n={n} k={k} rows={rows} [{i}]: {a} vs {b} (tol {tol})");
                    }
                }
            }
        }
    }

    #[test]
    fn rejects_what_it_does_not_cover() {
        assert!(Q4Weights::from_q4_0(&[0; 18], 1, 48).is_none(), "k not a multiple of 32");
        assert!(Q4Weights::from_q4_0(&[0; 17], 1, 32).is_none(), "partial block");
        assert!(Q4Weights::from_q4_0(&[], 0, 32).is_none(), "no rows");
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
            assert_eq!(done, crate::q4pack::Q4Products { herald: 1, packed: 0 });
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
