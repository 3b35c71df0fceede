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

use kernels::attention::{Stride, Tile};

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

/// The axes of a tile of dot products: an output axis of `a` only (`b` stride 0) and one of `b`
/// only (`a` stride 0), as (index in `outer`, index in `outer`).
fn tile_axes(outer: &[Stride]) -> Option<(usize, usize)> {
    let g = outer.iter().position(|s| s.b == 0 && s.a != 0)?;
    let p = outer.iter().position(|s| s.a == 0 && s.b != 0)?;
    Some((g, p))
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
            if let Some((g, p)) = tile_axes(&outer)
                && kernels::attention::dots_fit(outer[g].size, k.size)
            {
                let (ga, pb) = (outer[g], outer[p]);
                let rest: TVec<Stride> = outer.iter().enumerate().filter(|&(i, _)| i != g && i != p).map(|(_, s)| *s).collect();
                for_each(&rest, |oa, ob, oy| {
                    // every row index is within the operands' and the output's extents, as for
                    // the general loops below; dots_fit said the tile is taken
                    kernels::attention::dots(a, b, y, Tile { oa, ob, oy, g: ga, p: pb, width: k.size });
                });
                return;
            }
            for_each(&outer, |oa, ob, oy| y[oy] = kernels::attention::dot(&a[oa..oa + k.size], &b[ob..ob + k.size]));
            return;
        }
        if let Some(i) = outer.iter().position(|s| s.a == 0 && s.b == 1 && s.y == 1) {
            let n = outer.remove(i);
            // the weighted sum of a decode step: each `b` row (a cached position's values) read
            // once for every row of `a` (the query heads of its KV head), the sums in registers
            if let [kp] = summed[..]
                && let Some(g) = outer.iter().position(|s| s.b == 0 && s.a != 0)
                && kernels::attention::axpys_fit(outer[g].size, n.size)
            {
                let ga = outer.remove(g);
                for_each(&outer, |oa, ob, oy| {
                    // indices as for the general loops below; axpys_fit said the tile is taken
                    kernels::attention::axpys(a, b, y, Tile { oa, ob, oy, g: ga, p: kp, width: n.size });
                });
                return;
            }
            for_each(&outer, |oa, ob, oy| {
                for_each(&summed, |ka, kb, _| {
                    kernels::attention::axpy(&mut y[oy..oy + n.size], a[oa + ka], &b[ob + kb..ob + kb + n.size])
                });
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
