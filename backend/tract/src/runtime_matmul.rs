//! herald's product of two run-time float32 operands: the attention of a decode step.
//!
//! A talker or code-predictor step multiplies the new query by the cached keys (`[1, kv, g·s,
//! d] · [1, past, kv, d]ᵀ`) and the attention weights by the cached values. tract 0.23.9 runs
//! these as general matrix products whose run-time right-hand side it first packs into its panel
//! layout (`OptMatMulPack`), on every step and for every layer, with kernels tiled for many
//! rows where a step has `g · s = 2`: at 0.6B q4 the attention took 12.9 ms of a 32.7 ms talker
//! step at 64 past positions (docs/performance.md), growing with the past. [`RuntimeMatMul`]
//! evaluates such an einsum directly on the operands as they lie in memory:
//!
//! - a dot product per output element when the one summed axis is contiguous in both operands
//!   (the scores `q · kᵀ`, summed over the head dimension);
//! - an `axpy` per summed index when an output axis is contiguous in the right operand and the
//!   output (the weighted sum `p · v`, whose values rows are contiguous);
//! - other forms, and operands that broadcast, stay with tract (plain loops over a large
//!   product would be far slower than its kernels); at run time, shapes that leave neither
//!   fast path (an axis of size 1 where the graph had a symbol) take plain loops.
//!
//! The sums are float32 with a different order than tract's kernels (the parity tests against
//! the reference decoder and onnxruntime keep checking codes and PCM).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tract_onnx::prelude::*;
use tract_onnx::tract_core::ops::einsum::EinSum;
use tract_onnx::tract_core::ops::einsum::einsum_matmul::EinSumMatMul;
use tract_onnx::tract_core::optim::{OptimizerSession, TypedPass};
use tract_onnx::tract_hir::internal::*;

use crate::stack::{view, view_mut};

/// Where one einsum axis lies: its position in the left operand, the right one and the output.
type AxisPlace = (Option<usize>, Option<usize>, Option<usize>);

/// `y = Σ_k a · b` over the einsum's summed axes, both operands float32 tensors computed at run
/// time (not constants). Every axis lies in at most one position of each operand and the output;
/// an axis in one operand only and not in the output must have size 1.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RuntimeMatMul {
    /// Per axis, its positions (`a`, `b`, output).
    axes: TVec<AxisPlace>,
    /// Ranks of `a`, `b` and the output.
    ranks: (usize, usize, usize),
}

/// One axis at evaluation: its size and its element strides in `a`, `b` and the output (0
/// where absent).
#[derive(Clone, Copy, Debug)]
struct Stride {
    size: usize,
    a: usize,
    b: usize,
    y: usize,
}

fn strides(shape: &[usize]) -> TVec<usize> {
    let mut s: TVec<usize> = tvec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Calls `f(offset_a, offset_b, offset_y)` for every index of the axes `outer` (an odometer).
fn for_each(outer: &[Stride], mut f: impl FnMut(usize, usize, usize)) {
    let total: usize = outer.iter().map(|s| s.size).product();
    let mut idx: TVec<usize> = tvec![0; outer.len()];
    let (mut oa, mut ob, mut oy) = (0usize, 0usize, 0usize);
    for _ in 0..total {
        f(oa, ob, oy);
        for (i, s) in outer.iter().enumerate().rev() {
            idx[i] += 1;
            oa += s.a;
            ob += s.b;
            oy += s.y;
            if idx[i] < s.size {
                break;
            }
            idx[i] = 0;
            oa -= s.a * s.size;
            ob -= s.b * s.size;
            oy -= s.y * s.size;
        }
    }
}

/// `Σ a[i] · b[i]` in sixteen running sums (which the compiler turns into vector lanes).
#[inline(always)]
fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_lanes(a, b)
}

/// `Σ a[i] · b[i]`, `a.len() == b.len()`.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked just above).
        return unsafe { dot_avx2(a, b) };
    }
    dot_lanes(a, b)
}

/// `y[i] += s · b[i]`.
#[inline(always)]
fn axpy_lanes(y: &mut [f32], s: f32, b: &[f32]) {
    for (o, v) in y.iter_mut().zip(b) {
        *o += s * v;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn axpy_avx2(y: &mut [f32], s: f32, b: &[f32]) {
    axpy_lanes(y, s, b)
}

fn axpy(y: &mut [f32], s: f32, b: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked just above).
        return unsafe { axpy_avx2(y, s, b) };
    }
    axpy_lanes(y, s, b)
}

/// The axes of a tile of dot products: an output axis of `a` only (`b` stride 0) and one of `b`
/// only (`a` stride 0), as (index in `outer`, index in `outer`).
#[cfg(target_arch = "x86_64")]
fn tile_axes(outer: &[Stride]) -> Option<(usize, usize)> {
    let g = outer.iter().position(|s| s.b == 0 && s.a != 0)?;
    let p = outer.iter().position(|s| s.a == 0 && s.b != 0)?;
    Some((g, p))
}

/// AVX-512 tiles of the attention's two products: up to [`x86::MAX_ROWS`] rows of `a` against
/// one row of `b` at a time, each `b` row read once for all of them, the sums in registers.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Stride;
    use std::arch::x86_64::*;

    /// Most rows of `a` per tile (query heads per KV head: 2 in Qwen3-TTS's talker and
    /// predictor, 16 query heads over 8 KV heads).
    pub(super) const MAX_ROWS: usize = 4;
    /// Widest summed (dot) or output (axpy) axis taken, floats (the head dimension: 128 at
    /// 0.6B): a row of `a` stays in L1 while the rows of `b` stream past it.
    const MAX_WIDTH: usize = 512;

    /// One tile: the offsets of its first row of `a`, row of `b` and output element, the axis
    /// of `a`'s rows (`g`: a stride 0 in `b`), the axis walked in `b` (`p`: the positions) and the
    /// width of a row (the summed axis of the dots, the output axis of the axpys).
    #[derive(Clone, Copy, Debug)]
    pub(super) struct Tile {
        pub oa: usize,
        pub ob: usize,
        pub oy: usize,
        pub g: Stride,
        pub p: Stride,
        pub width: usize,
    }

    fn avx512() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
    }

    /// Whether [`dots`] takes `rows` rows of width `k` on this CPU (a single row has no `b` row
    /// to share: the general loops take it; axes of size 1 are gone before this point anyway).
    pub(super) fn dots_fit(rows: usize, k: usize) -> bool {
        (2..=MAX_ROWS).contains(&rows) && k.is_multiple_of(16) && (16..=MAX_WIDTH).contains(&k) && avx512()
    }

    /// Whether [`axpys`] takes `rows` rows of width `n` on this CPU.
    pub(super) fn axpys_fit(rows: usize, n: usize) -> bool {
        dots_fit(rows, n)
    }

    /// `y[oy + i·g.y + j·p.y] = Σ_c a[oa + i·g.a + c] · b[ob + j·p.b + c]` for every row `i` of
    /// the axis `g` and `j` of `p`, `c < k` (the tile's width), of the tile `t`.
    ///
    /// # Safety
    /// AVX-512F; every index above is in bounds; `2 ≤ g.size ≤ MAX_ROWS`, `k` a multiple of 16
    /// up to `MAX_WIDTH`.
    pub(super) unsafe fn dots(a: &[f32], b: &[f32], y: &mut [f32], t: Tile) {
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
    pub(super) unsafe fn axpys(a: &[f32], b: &[f32], y: &mut [f32], t: Tile) {
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

impl RuntimeMatMul {
    /// The product of `a` and `b` (shapes as given) into `y` (row-major, shape `y_shape`).
    fn product(&self, a: &[f32], a_shape: &[usize], b: &[f32], b_shape: &[usize], y: &mut [f32], y_shape: &[usize]) {
        let (sa, sb, sy) = (strides(a_shape), strides(b_shape), strides(y_shape));
        let mut outer: TVec<Stride> = tvec![];
        let mut summed: TVec<Stride> = tvec![];
        for &(pa, pb, py) in &self.axes {
            let size = pa.map(|p| a_shape[p]).or(pb.map(|p| b_shape[p])).or(py.map(|p| y_shape[p])).unwrap_or(1);
            let s = Stride { size, a: pa.map_or(0, |p| sa[p]), b: pb.map_or(0, |p| sb[p]), y: py.map_or(0, |p| sy[p]) };
            if py.is_some() { outer.push(s) } else { summed.push(s) }
        }
        // axes of size 1 take no part in the loops
        outer.retain(|s| s.size != 1);
        summed.retain(|s| s.size != 1);
        y.fill(0.0);
        if let [k] = summed[..]
            && k.a == 1
            && k.b == 1
        {
            // the scores of a decode step: rows of `a` (the query heads of one KV head, an axis
            // `b` lacks) against rows of `b` (the cached positions), each `b` row read once for
            // all of them
            #[cfg(target_arch = "x86_64")]
            if let Some((g, p)) = tile_axes(&outer)
                && x86::dots_fit(outer[g].size, k.size)
            {
                let (ga, pb) = (outer[g], outer[p]);
                let rest: TVec<Stride> = outer.iter().enumerate().filter(|&(i, _)| i != g && i != p).map(|(_, s)| *s).collect();
                for_each(&rest, |oa, ob, oy| {
                    // SAFETY: AVX-512F (dots_fit); every row index is within the operands' and
                    // the output's extents, as for the general loops below.
                    unsafe { x86::dots(a, b, y, x86::Tile { oa, ob, oy, g: ga, p: pb, width: k.size }) }
                });
                return;
            }
            for_each(&outer, |oa, ob, oy| y[oy] = dot(&a[oa..oa + k.size], &b[ob..ob + k.size]));
            return;
        }
        if let Some(i) = outer.iter().position(|s| s.a == 0 && s.b == 1 && s.y == 1) {
            let n = outer.remove(i);
            // the weighted sum of a decode step: each `b` row (a cached position's values) read
            // once for every row of `a` (the query heads of its KV head), the sums in registers
            #[cfg(target_arch = "x86_64")]
            if let [kp] = summed[..]
                && let Some(g) = outer.iter().position(|s| s.b == 0 && s.a != 0)
                && x86::axpys_fit(outer[g].size, n.size)
            {
                let ga = outer.remove(g);
                for_each(&outer, |oa, ob, oy| {
                    // SAFETY: AVX-512F (axpys_fit); indices as for the general loops below.
                    unsafe { x86::axpys(a, b, y, x86::Tile { oa, ob, oy, g: ga, p: kp, width: n.size }) }
                });
                return;
            }
            for_each(&outer, |oa, ob, oy| {
                for_each(&summed, |ka, kb, _| axpy(&mut y[oy..oy + n.size], a[oa + ka], &b[ob + kb..ob + kb + n.size]));
            });
            return;
        }
        for_each(&outer, |oa, ob, oy| {
            let mut acc = 0f32;
            for_each(&summed, |ka, kb, _| acc += a[oa + ka] * b[ob + kb]);
            y[oy] = acc;
        });
    }
}

impl Op for RuntimeMatMul {
    fn name(&self) -> StaticName {
        "HeraldRuntimeMatMul".into()
    }

    op_as_typed_op!();
}

impl EvalOp for RuntimeMatMul {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let (a, b) = args_2!(inputs);
        if a.datum_type() != f32::datum_type() || b.datum_type() != f32::datum_type() {
            bail!("HeraldRuntimeMatMul: operands must be float32, got {:?} and {:?}", a.datum_type(), b.datum_type());
        }
        if a.rank() != self.ranks.0 || b.rank() != self.ranks.1 {
            bail!("HeraldRuntimeMatMul: operands of ranks {:?} expected, got {:?} and {:?}", self.ranks, a.shape(), b.shape());
        }
        let mut y_shape: TVec<usize> = tvec![1; self.ranks.2];
        for &(pa, pb, py) in &self.axes {
            let (da, db) = (pa.map(|p| a.shape()[p]), pb.map(|p| b.shape()[p]));
            if let (Some(x), Some(y)) = (da, db)
                && x != y
            {
                bail!(
                    "HeraldRuntimeMatMul: an axis of size {x} in one operand and {y} in the other ({:?}, {:?})",
                    a.shape(),
                    b.shape()
                );
            }
            let size = da.or(db).unwrap_or(1);
            match py {
                Some(p) => y_shape[p] = size,
                None if (pa.is_none() || pb.is_none()) && size != 1 => {
                    bail!("HeraldRuntimeMatMul: an axis of one operand only, of size {size}, summed away")
                }
                None => {}
            }
        }
        // SAFETY: `product` writes every element (it zero-fills first).
        let mut y = unsafe { Tensor::uninitialized::<f32>(&y_shape)? };
        self.product(view::<f32>(&a)?, a.shape(), view::<f32>(&b)?, b.shape(), view_mut::<f32>(&mut y)?, &y_shape);
        Ok(tvec!(y.into_tvalue()))
    }
}

impl TypedOp for RuntimeMatMul {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        if inputs.len() != 2 || inputs[0].rank() != self.ranks.0 || inputs[1].rank() != self.ranks.1 {
            bail!("HeraldRuntimeMatMul takes two float32 inputs of ranks {:?}; got {inputs:?}", self.ranks);
        }
        let mut shape: TVec<TDim> = tvec![1.to_dim(); self.ranks.2];
        for &(pa, pb, py) in &self.axes {
            if let Some(p) = py {
                shape[p] = match (pa, pb) {
                    (Some(a), _) => inputs[0].shape[a].clone(),
                    (None, Some(b)) => inputs[1].shape[b].clone(),
                    (None, None) => 1.to_dim(),
                };
            }
        }
        Ok(tvec!(f32::fact(shape)))
    }

    fn cost(&self, inputs: &[&TypedFact]) -> TractResult<TVec<(Cost, TDim)>> {
        let mut n: TDim = 1.to_dim();
        for &(pa, pb, _) in &self.axes {
            if let Some(a) = pa {
                n *= inputs[0].shape[a].clone();
            } else if let Some(b) = pb {
                n *= inputs[1].shape[b].clone();
            }
        }
        Ok(tvec!((Cost::FMA(f32::datum_type()), n)))
    }

    as_op!();
}

/// An optimizer pass: replaces every float32 `EinSum` of two run-time operands (neither a
/// constant) whose axes each lie at most once in each operand and the output with a
/// [`RuntimeMatMul`]. Anything else is left to tract.
#[derive(Clone, Debug, Default)]
pub(crate) struct UseRuntimeMatMul {
    /// Products replaced so far (shared by the clones tract's optimizer session makes).
    pub(crate) replaced: Arc<AtomicUsize>,
}

impl TypedPass for UseRuntimeMatMul {
    fn reset(&mut self) -> TractResult<()> {
        Ok(())
    }

    fn next(&mut self, _session: &mut OptimizerSession, model: &TypedModel) -> TractResult<Option<TypedModelPatch>> {
        for node in &model.nodes {
            let Some(op) = runtime_product(model, node)? else { continue };
            let mut patch = TypedModelPatch::default();
            let a = patch.tap_model(model, node.inputs[0])?;
            let b = patch.tap_model(model, node.inputs[1])?;
            let y = patch.wire_node(&node.name, op, &[a, b])?[0];
            patch.shunt_outside(model, OutletId::new(node.id, 0), y)?;
            self.replaced.fetch_add(1, Ordering::Relaxed);
            return Ok(Some(patch));
        }
        Ok(None)
    }
}

/// `node`'s einsum when it is a float32 `EinSum` of two inputs, or tract's `EinSumMatMul`
/// around one, without quantization parameters: what both of herald's product passes start
/// from (here and [`crate::q4gemv`]).
pub(crate) fn binary_f32_einsum(node: &TypedNode) -> Option<&EinSum> {
    let einsum = match (node.op_as::<EinSum>(), node.op_as::<EinSumMatMul>()) {
        (Some(e), _) => e,
        (None, Some(m)) => &m.op,
        (None, None) => return None,
    };
    (node.inputs.len() == 2 && einsum.q_params.is_none() && einsum.operating_dt == f32::datum_type()).then_some(einsum)
}

/// The [`RuntimeMatMul`] for `node`, when it is an `EinSum` (or tract's `EinSumMatMul` around
/// one) of two run-time float32 operands that it covers.
fn runtime_product(model: &TypedModel, node: &TypedNode) -> TractResult<Option<RuntimeMatMul>> {
    let Some(einsum) = binary_f32_einsum(node) else { return Ok(None) };
    let (a, b) = (model.outlet_fact(node.inputs[0])?, model.outlet_fact(node.inputs[1])?);
    let y = model.outlet_fact(OutletId::new(node.id, 0))?;
    let f32t = f32::datum_type();
    if a.datum_type != f32t || b.datum_type != f32t || y.datum_type != f32t {
        return Ok(None);
    }
    if a.konst.is_some() || b.konst.is_some() || a.exotic_fact.is_some() || b.exotic_fact.is_some() {
        return Ok(None);
    }
    let mut axes: TVec<AxisPlace> = tvec![];
    let mut summed = 0;
    for axis in einsum.axes.iter_all_axes() {
        if axis.inputs.len() != 2 || axis.outputs.len() != 1 || axis.inputs.iter().chain(&axis.outputs).any(|p| p.len() > 1) {
            return Ok(None);
        }
        let place = (axis.inputs[0].first().copied(), axis.inputs[1].first().copied(), axis.outputs[0].first().copied());
        match place {
            // broadcasting (size 1 in one operand, more in the other) is left to tract
            (Some(pa), Some(pb), _) if a.shape[pa] != b.shape[pb] => return Ok(None),
            (Some(_), Some(_), None) => summed += 1,
            // summed away from one operand only: covered only when it is known to be 1
            (Some(p), None, None) if a.shape[p].is_one() => {}
            (None, Some(p), None) if b.shape[p].is_one() => {}
            (_, _, Some(_)) => {}
            _ => return Ok(None),
        }
        axes.push(place);
    }
    if summed == 0 {
        return Ok(None);
    }
    // only the forms with a fast path (plain loops are far slower than tract's kernels on
    // large products): the one summed axis of size above 1 last in both operands (the dot),
    // or an output axis of `b` only, last in `b` and in the output (the axpy)
    let last = |f: &TypedFact, p: usize| f.shape[p + 1..].iter().all(|d| d.is_one());
    let dot = {
        let one = |&(pa, pb, _): &AxisPlace| pa.is_some_and(|p| a.shape[p].is_one()) || pb.is_some_and(|p| b.shape[p].is_one());
        let mut k = axes.iter().filter(|place| place.2.is_none() && !one(place));
        matches!((k.next(), k.next()), (Some(&(Some(pa), Some(pb), None)), None) if last(a, pa) && last(b, pb))
    };
    let axpy = axes.iter().any(|&(pa, pb, py)| matches!((pa, pb, py), (None, Some(pb), Some(py)) if last(b, pb) && last(y, py)));
    if !dot && !axpy {
        return Ok(None);
    }
    log::trace!("{}: a run-time product on herald's loops: {}", node.name, einsum.axes);
    Ok(Some(RuntimeMatMul { axes, ranks: (a.rank(), b.rank(), y.rank()) }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn floats(n: usize, seed: u64) -> Vec<f32> {
        crate::xorshift(seed).take(n).map(|s| (s % 2001) as f32 / 1000.0 - 1.0).collect()
    }

    /// A model `y = einsum(expr)(a, b)` over two float32 sources, as tract-onnx wires it, then
    /// decluttered.
    fn model(expr: &str, a: &[usize], b: &[usize]) -> TypedModel {
        let mut m = TypedModel::default();
        let sa = m.add_source("a", f32::fact(a)).unwrap();
        let sb = m.add_source("b", f32::fact(b)).unwrap();
        let axes: AxesMapping = expr.parse().unwrap();
        let y = m.wire_node("einsum", EinSum::new(axes, f32::datum_type()), &[sa, sb]).unwrap();
        m.select_output_outlets(&y).unwrap();
        m.into_decluttered().unwrap()
    }

    /// The attention products of a decode step and of a prefill (the exporter's forms: scores
    /// summed over the head dimension, contiguous in both; the weighted sum over the positions,
    /// values rows contiguous) against tract's own optimized plan; a form with neither fast path
    /// and a broadcasting one stay with tract.
    #[test]
    fn matches_tracts_kernels() {
        // (expression, shapes, whether herald takes it)
        let cases: &[(&str, &[usize], &[usize], bool)] = &[
            // scores: q [1, kv, g·s, d] · kc [1, p, kv, d] -> [1, kv, g·s, p]
            ("akgd,apkd->akgp", &[1, 4, 2, 16], &[1, 9, 4, 16], true),
            ("akgd,apkd->akgp", &[1, 4, 14, 16], &[1, 7, 4, 16], true),
            // the 0.6B talker's shape (16 query heads over 8 KV heads of 128) and odd ones
            // (AVX-512 tiles of 2, 3 and 4 rows, widths 128, 64 and others, where the CPU has it)
            ("akgd,apkd->akgp", &[1, 8, 2, 128], &[1, 33, 8, 128], true),
            ("akgd,apkd->akgp", &[1, 2, 3, 32], &[1, 5, 2, 32], true),
            ("akgp,apkd->akgd", &[1, 8, 2, 33], &[1, 33, 8, 128], true),
            ("akgp,apkd->akgd", &[1, 4, 2, 33], &[1, 33, 4, 64], true),
            ("akgd,apkd->akgp", &[1, 2, 4, 32], &[1, 5, 2, 32], true),
            ("akgp,apkd->akgd", &[1, 2, 4, 5], &[1, 5, 2, 48], true),
            ("akgp,apkd->akgd", &[1, 2, 3, 5], &[1, 5, 2, 32], true),
            // weighted sum: p [1, kv, g·s, p] · vc [1, p, kv, d] -> [1, kv, g·s, d]
            ("akgp,apkd->akgd", &[1, 4, 2, 9], &[1, 9, 4, 16], true),
            ("akgp,apkd->akgd", &[1, 4, 14, 7], &[1, 7, 4, 16], true),
            // neither fast path (summed axes strided, no output axis last in b): left to tract
            ("ikj,kji->ij", &[3, 5, 4], &[5, 4, 3], false),
            // broadcasting over the batch axis: left to tract
            ("bij,bjk->bik", &[1, 3, 5], &[4, 5, 6], false),
        ];
        for &(expr, sa, sb, taken) in cases {
            let a = Tensor::from_shape(sa, &floats(sa.iter().product(), 3)).unwrap();
            let b = Tensor::from_shape(sb, &floats(sb.iter().product(), 4)).unwrap();
            let run = |mut m: TypedModel, ours: bool| {
                if ours {
                    let pass = UseRuntimeMatMul::default();
                    let replaced = pass.replaced.clone();
                    let mut passes = tract_onnx::tract_core::optim::Optimizer::codegen().passes;
                    passes.insert(0, Box::new(pass));
                    let optimizer = tract_onnx::tract_core::optim::Optimizer { passes, steps: None };
                    m.optimize_with_session(&mut optimizer.session()).unwrap();
                    assert_eq!(replaced.load(Ordering::Relaxed), taken as usize, "{expr}: replaced or not");
                    assert_eq!(m.nodes.iter().any(|n| n.op.name() == "HeraldRuntimeMatMul"), taken, "{expr}");
                } else {
                    m.optimize().unwrap();
                }
                m.into_runnable()
                    .unwrap()
                    .run(tvec!(a.clone().into_tvalue(), b.clone().into_tvalue()))
                    .unwrap()
                    .remove(0)
                    .into_tensor()
            };
            let (ours, theirs) = (run(model(expr, sa, sb), true), run(model(expr, sa, sb), false));
            assert_eq!(ours.shape(), theirs.shape(), "{expr}");
            let (p, q) = (view::<f32>(&ours).unwrap(), view::<f32>(&theirs).unwrap());
            let scale = q.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(scale > 0.1, "{expr}: a non-trivial product");
            for (i, (x, y)) in p.iter().zip(q).enumerate() {
                assert!((x - y).abs() <= 1e-5 * scale, "{expr} [{i}]: herald {x} vs tract {y}");
            }
        }
    }
}
