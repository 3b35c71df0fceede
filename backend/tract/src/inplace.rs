//! Folding reshapes of constant weights in place, before tract's constant folding copies them.
//!
//! tract's `Conv` and `Deconv` codegen wire a chain of axis changes in front of each kernel
//! (`AxisOp` reshapes, then an `IntoShape`) and a packing op after it; its `PropConst` pass
//! then evaluates the chain on the constant. Each step copies the whole kernel, because the
//! constant's tensor is shared (by the `Const` op, by its fact, by the walk's own clone), so
//! `into_tensor` cannot take it: at 0.6B the vocoder's 467 MB of kernels were copied twice on
//! every start before being packed (docs/performance.md, "Since: one-pass NNEF reading and
//! huge pages"). [`FoldReshapeInPlace`] runs first in each optimizer round: for every
//! `AxisOp` or `IntoShape` node whose only input is a plain constant read by nothing else, it
//! takes the constant's tensor out of the graph (the last reference, so no copy), changes its
//! geometry in place (an `AxisOp::Move` is a real transposition and still copies once) and
//! makes the node that constant. The result is the tensor tract's own folding produces, so
//! the optimized plan is the same; the tests check that against tract's plain `optimize`.

use std::sync::Arc;

use tract_onnx::prelude::*;
use tract_onnx::tract_core::internal::ensure;
use tract_onnx::tract_core::ops::change_axes::{AxisOp, IntoShape};
use tract_onnx::tract_core::ops::konst::Const;
use tract_onnx::tract_core::optim::{OptimizerSession, TypedPass};

/// An optimizer pass that only mutates the model directly ([`TypedPass::run_direct`]): folds
/// every reshape of a sole-consumer plain constant into that constant without copying it (see
/// the module documentation).
#[derive(Clone, Debug, Default)]
pub(crate) struct FoldReshapeInPlace;

impl TypedPass for FoldReshapeInPlace {
    fn reset(&mut self) -> TractResult<()> {
        Ok(())
    }

    fn next(&mut self, _session: &mut OptimizerSession, _model: &TypedModel) -> TractResult<Option<TypedModelPatch>> {
        Ok(None)
    }

    fn run_direct(&mut self, model: &mut TypedModel) -> TractResult<bool> {
        let mut changed = false;
        // nodes are numbered in graph order, so a sweep usually folds a whole chain; one more
        // sweep confirms that nothing is left
        loop {
            let mut folded = false;
            for id in 0..model.nodes.len() {
                folded |= fold_one(model, id)?;
            }
            if !folded {
                return Ok(changed);
            }
            changed = true;
        }
    }
}

/// Fold node `id` into its constant input when it qualifies; returns whether it did.
fn fold_one(model: &mut TypedModel, id: usize) -> TractResult<bool> {
    let node = &model.nodes[id];
    if !(node.op_is::<AxisOp>() || node.op_is::<IntoShape>()) || node.inputs.len() != 1 {
        return Ok(false);
    }
    let input = node.inputs[0];
    let out_fact = &node.outputs[0].fact;
    let Some(out_shape) = out_fact.shape.as_concrete().map(|s| s.to_vec()) else { return Ok(false) };
    if out_fact.exotic_fact.is_some() || model.outputs.contains(&OutletId::new(id, 0)) {
        return Ok(false);
    }
    let source = &model.nodes[input.node];
    let Some(konst) = source.op_as::<Const>() else { return Ok(false) };
    let fact = &source.outputs[input.slot].fact;
    if konst.exotic_fact().is_some()
        || fact.exotic_fact.is_some()
        || !konst.val().is_plain()
        || source.outputs[input.slot].successors.len() != 1
        || model.outputs.contains(&input)
        || fact.konst.is_none()
    {
        return Ok(false);
    }
    let uniform = fact.uniform.clone();
    // Take the tensor: drop the fact's and the op's references, so that ours is the last one.
    // From here an error leaves the source a placeholder: it aborts the whole optimize (its only
    // caller gives up on the graph), and it cannot happen where tract's own constant folding
    // of the same reshape would succeed.
    let tensor = konst.val().clone();
    let placeholder = Arc::new(tensor0(0f32));
    let source = &mut model.nodes[input.node];
    source.outputs[input.slot].fact.konst = None;
    source.op = Box::new(Const::new(placeholder.clone())?);
    let mut tensor = Arc::try_unwrap(tensor).unwrap_or_else(|shared| (*shared).clone());
    let node = &model.nodes[id];
    if let Some(op) = node.op_as::<AxisOp>() {
        op.change_tensor(&mut tensor, false)?;
    } else if let Some(op) = node.op_as::<IntoShape>() {
        ensure!(tensor.len() == op.len, "IntoShape of {} elements applied to {:?}", op.len, tensor);
        // SAFETY: `IntoShape::eval` does exactly this on the tensor it owns; `dims` and
        // `strides` describe the same `len` elements in the same order
        unsafe { tensor.set_geometry_unchecked(&op.dims, &op.strides) };
    }
    ensure!(
        tensor.shape() == out_shape.as_slice() && tensor.datum_type() == node.outputs[0].fact.datum_type,
        "folding {} in place gave {:?}, its fact says {:?}",
        node.name,
        tensor,
        node.outputs[0].fact
    );
    let tensor = Arc::new(tensor);
    let mut new_fact = node.outputs[0].fact.clone();
    new_fact.konst = Some(tensor.clone());
    if new_fact.uniform.is_none() {
        new_fact.uniform = uniform;
    }
    // The source becomes a dead placeholder (compaction drops it); this node the constant.
    let source = &mut model.nodes[input.node];
    source.outputs[input.slot].successors.clear();
    source.outputs[input.slot].fact = TypedFact::try_from(placeholder)?;
    let node = &mut model.nodes[id];
    node.op = Box::new(Const::new(tensor)?);
    node.inputs.clear();
    node.outputs[0].fact = new_fact;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tract_onnx::tract_core::ops::cnn::{Conv, KernelFormat, PaddingSpec, PoolSpec};
    use tract_onnx::tract_core::ops::nn::DataFormat;

    /// Each op's own `codegen`, one patch at a time (tract's `OpOptim("codegen")` is private).
    #[derive(Clone, Debug)]
    struct Codegen;

    impl TypedPass for Codegen {
        fn reset(&mut self) -> TractResult<()> {
            Ok(())
        }

        fn next(&mut self, _session: &mut OptimizerSession, model: &TypedModel) -> TractResult<Option<TypedModelPatch>> {
            for id in model.eval_order()? {
                let node = model.node(id);
                if let Some(patch) = node.op.codegen(model, node)? {
                    return Ok(Some(patch));
                }
            }
            Ok(None)
        }
    }

    fn values(n: usize, seed: u64) -> Vec<f32> {
        crate::xorshift(seed).take(n).map(|v| (v % 2001) as f32 / 1000.0 - 1.0).collect()
    }

    /// A 1-d convolution (`[1, c_in, t]`, kernel `[c_out, c_in / group, k]`, OIHW), decluttered,
    /// as a vocoder's: tract's codegen reshapes its kernel before packing it.
    fn conv(c_in: usize, c_out: usize, k: usize, group: usize, t: usize) -> TypedModel {
        let mut model = TypedModel::default();
        let x = model.add_source("x", f32::fact([1, c_in, t])).unwrap();
        let w = Tensor::from_shape(&[c_out, c_in / group, k], &values(c_out * c_in / group * k, 3)).unwrap();
        let b = Tensor::from_shape(&[c_out], &values(c_out, 5)).unwrap();
        let w = model.add_const("w", w).unwrap();
        let b = model.add_const("b", b).unwrap();
        let pool_spec = PoolSpec {
            data_format: DataFormat::NCHW,
            kernel_shape: tvec!(k),
            padding: PaddingSpec::Valid,
            dilations: Some(tvec!(2)),
            strides: None,
            input_channels: c_in,
            output_channels: c_out,
        };
        let op = Conv { pool_spec, kernel_fmt: KernelFormat::OIHW, group, q_params: None };
        let y = model.wire_node("y", op, &[x, w, b]).unwrap()[0];
        model.select_output_outlets(&[y]).unwrap();
        model.into_decluttered().unwrap()
    }

    /// The optimizer with the pass in front of tract's codegen passes folds every kernel
    /// reshape in place, and the plan computes bit for bit what tract's own optimize gives,
    /// for plain and grouped convolutions.
    #[test]
    fn plans_match_tracts_own_folding() {
        for (c_in, c_out, k, group) in [(8, 12, 7, 1), (12, 12, 3, 3), (4, 16, 1, 1)] {
            let t = 20;
            let mut ours = conv(c_in, c_out, k, group, t);
            crate::q4pack::optimize(&mut ours, false).unwrap();
            let mut theirs = conv(c_in, c_out, k, group, t);
            theirs.optimize().unwrap();
            let x = Tensor::from_shape(&[1, c_in, t], &values(c_in * t, 9)).unwrap();
            let run = |model: TypedModel| {
                model.into_runnable().unwrap().run(tvec!(x.clone().into_tvalue())).unwrap().remove(0).into_tensor()
            };
            let vals = |t: &Tensor| t.try_as_plain_ram().unwrap().as_slice::<f32>().unwrap().to_vec();
            let (a, b) = (run(ours), run(theirs));
            assert_eq!(a.shape(), b.shape());
            assert_eq!(vals(&a), vals(&b), "conv {c_in}->{c_out} k {k} group {group}");
            assert!(vals(&a).iter().any(|v| *v != 0.0));
        }
    }

    /// The pass itself: a kernel's reshape chain after tract's conv codegen becomes one
    /// constant holding the reshaped tensor; no reshape of a constant is left for `PropConst`.
    #[test]
    fn reshape_chain_becomes_one_constant() {
        use tract_onnx::tract_core::optim::Optimizer;
        let mut model = conv(8, 12, 7, 1, 20);
        // tract's codegen alone, without constant folding: the reshapes are wired, not folded
        Optimizer { passes: vec![Box::new(Codegen)], steps: None }.optimize(&mut model).unwrap();
        let reshapes_of_consts = |m: &TypedModel| {
            m.nodes
                .iter()
                .filter(|n| {
                    (n.op_is::<AxisOp>() || n.op_is::<IntoShape>()) && n.inputs.len() == 1 && m.node(n.inputs[0].node).op_is::<Const>()
                })
                .count()
        };
        assert!(reshapes_of_consts(&model) > 0, "tract's conv codegen reshapes its kernel: {model}");
        let before: Vec<f32> = values(12 * 8 * 7, 3);
        assert!(FoldReshapeInPlace.run_direct(&mut model).unwrap());
        model.compact().unwrap();
        model.check_consistency().unwrap();
        assert_eq!(reshapes_of_consts(&model), 0, "{model}");
        // the kernel's values are unchanged, only its shape: [g, o, i * k]
        let kernel = model
            .nodes
            .iter()
            .filter_map(|n| n.op_as::<Const>())
            .find(|c| c.val().len() == before.len())
            .expect("the kernel constant");
        assert_eq!(kernel.val().shape(), &[1, 12, 8 * 7]);
        assert_eq!(kernel.val().try_as_plain_ram().unwrap().as_slice::<f32>().unwrap(), before.as_slice());
    }
}
