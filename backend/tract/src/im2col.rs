//! herald's im2col for the vocoder's one-dimensional convolutions: the same packed panels as
//! tract's `Im2col`, written a panel row at a time.
//!
//! tract 0.23.9 runs a convolution of kernel length above 1 (the vocoder's kernel-7 residual
//! convolutions, dilations 1, 3 and 9, and its kernel-7 input and output convolutions) as an
//! `Im2col` node that lays the input out as the `[k = c_in · kernel, n = t_out]` right-hand
//! side of a matrix product, directly in the kernel's panel layout (`PackedFormat`: panels of
//! `r` output positions, each `[k][r]`), followed by the product. Its writer copies whole
//! slices only when they fit in the current panel; a row of `t_out` positions crosses a panel
//! every `r` values, so it goes one value at a time. At 0.6B dimensions that was 520 ms of a
//! 2120 ms 25-frame stateful vocoder chunk on one thread of the build machine (`herald bench
//! --profile vocoder`): about 38 MB written per 80 ms frame at 1.8 GB/s.
//!
//! [`PanelIm2Col`] writes the same bytes panel by panel: for each panel of `r` output
//! positions, each input channel and each kernel tap, one copy of `r` contiguous input values.
//! It covers the stateful vocoder's convolutions: float32, one batch, channels first, one
//! spatial axis, stride 1, one group and no padding (the stream graph carries the left context
//! in its state, so its convolutions are valid). Any other convolution keeps tract's node; at
//! run time, a shape outside that form (a batch above 1, an input shorter than the kernel's
//! reach) is handed to tract's own `Im2col`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tract_linalg::mmm::{EagerPackedInput, MMMInputValue, PackedExoticFact, PackedMatrixStorage};
use tract_linalg::pack::PackedFormat;
use tract_onnx::prelude::*;
use tract_onnx::tract_core::ops::cnn::PaddingSpec;
use tract_onnx::tract_core::ops::cnn::conv::Im2Col;
use tract_onnx::tract_core::ops::nn::DataFormat;
use tract_onnx::tract_core::optim::{OptimizerSession, TypedPass};
use tract_onnx::tract_hir::internal::*;

use crate::stack::view;

/// The packed right-hand side of a valid, stride-1, one-group 1-D float32 convolution:
/// input `[1, c, t]` (or `[c, t]`), output what tract's `Im2col` would give, one
/// `EagerPackedInput` of `k = c · kernel` rows by `n = t − (kernel − 1) · dilation` columns in
/// `format`. Row `ci · kernel + j` holds input channel `ci` shifted by `j · dilation` positions
/// (tract's order: channel outer, tap inner).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PanelIm2Col {
    /// tract's node, which evaluates whatever the fast path does not cover.
    tract: Im2Col,
    /// Input channels.
    channels: usize,
    /// Kernel length (taps).
    kernel: usize,
    /// Spacing of the taps, in positions.
    dilation: usize,
    /// The product's panel layout (float32, `r` columns per panel).
    format: PackedFormat,
}

impl PanelIm2Col {
    /// Rows of the packed matrix: `channels · kernel`.
    fn k(&self) -> usize {
        self.channels * self.kernel
    }

    /// The packed panels of `x` (`channels · t` float32 values, channel-major) for `n` output
    /// positions: `n.div_ceil(r)` panels of `single_panel_len(k)` values each, the columns past
    /// `n` of the last panel and the rows past `k` of every panel zero.
    fn pack(&self, x: &[f32], t: usize, n: usize) -> TractResult<Tensor> {
        let (r, k) = (self.format.r, self.k());
        let panel_len = self.format.single_panel_len(k);
        let panels = n.div_ceil(r);
        // SAFETY: `Conv1d::pack` writes every element (copies, then zeros for what they leave).
        let mut data = unsafe { Tensor::uninitialized_aligned_dt(f32::datum_type(), &[panels * panel_len], self.format.alignment())? };
        let out = crate::stack::view_mut::<f32>(&mut data)?;
        kernels::im2col::Conv1d { channels: self.channels, kernel: self.kernel, dilation: self.dilation }
            .pack(x, t, n, r, panel_len, out);
        Ok(data)
    }
}

impl Op for PanelIm2Col {
    fn name(&self) -> StaticName {
        "HeraldIm2col".into()
    }

    op_as_typed_op!();
}

impl EvalOp for PanelIm2Col {
    op_out_of_plan!();

    fn eval(&self, ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let (c, t) = match inputs.first().map(|x| x.shape()) {
            Some(&[1, c, t]) | Some(&[c, t]) => (c, t),
            _ => return self.tract.eval(ctx, inputs),
        };
        let reach = (self.kernel - 1) * self.dilation;
        if inputs.len() != 1 || c != self.channels || t <= reach || inputs[0].datum_type() != f32::datum_type() {
            return self.tract.eval(ctx, inputs);
        }
        let n = t - reach;
        let data = self.pack(view::<f32>(&inputs[0])?, t, n)?;
        let panel_bytes = self.format.single_panel_len(self.k()) * std::mem::size_of::<f32>();
        let value: Box<dyn MMMInputValue> = Box::new(EagerPackedInput {
            fact: PackedExoticFact { format: Box::new(self.format.clone()), mn: n.to_dim(), k: self.k() },
            packed: Arc::new(data.into_blob()?),
            panel_bytes,
            mn: n,
        });
        let output = PackedMatrixStorage::new_batched(&[1, 1], tvec![value]).into_tensor(f32::datum_type());
        Ok(tvec!(output.into_tvalue()))
    }
}

impl TypedOp for PanelIm2Col {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        self.tract.output_facts(inputs)
    }

    fn cost(&self, inputs: &[&TypedFact]) -> TractResult<TVec<(Cost, TDim)>> {
        self.tract.cost(inputs)
    }

    as_op!();
}

/// An optimizer pass (after tract's codegen has made its `Im2col` nodes): replaces every
/// `Im2col` of the form [`PanelIm2Col`] covers with one.
#[derive(Clone, Debug, Default)]
pub(crate) struct UsePanelIm2Col {
    /// Nodes replaced so far (shared by the clones tract's optimizer session makes).
    pub(crate) replaced: Arc<AtomicUsize>,
}

impl TypedPass for UsePanelIm2Col {
    fn reset(&mut self) -> TractResult<()> {
        Ok(())
    }

    fn next(&mut self, _session: &mut OptimizerSession, model: &TypedModel) -> TractResult<Option<TypedModelPatch>> {
        for node in &model.nodes {
            let Some(op) = panel_im2col(model, node)? else { continue };
            let mut patch = TypedModelPatch::default();
            let x = patch.tap_model(model, node.inputs[0])?;
            let y = patch.wire_node(&node.name, op, &[x])?[0];
            patch.shunt_outside(model, OutletId::new(node.id, 0), y)?;
            self.replaced.fetch_add(1, Ordering::Relaxed);
            return Ok(Some(patch));
        }
        Ok(None)
    }
}

/// The [`PanelIm2Col`] for `node` when it is tract's `Im2col` of a float32 convolution of the
/// covered form (see the module's doc) packing for a `PackedFormat` kernel.
fn panel_im2col(model: &TypedModel, node: &TypedNode) -> TractResult<Option<PanelIm2Col>> {
    let Some(im2col) = node.op_as::<Im2Col>() else { return Ok(None) };
    let spec = &im2col.pool_spec;
    let input = model.outlet_fact(node.inputs[0])?;
    let valid = match &spec.padding {
        PaddingSpec::Valid => true,
        PaddingSpec::Explicit(before, after) | PaddingSpec::ExplicitOnnxPool(before, after, _) => {
            before.iter().chain(after).all(|p| *p == 0)
        }
        _ => false,
    };
    let channels_first = matches!(spec.data_format, DataFormat::NCHW | DataFormat::CHW);
    if node.inputs.len() != 1
        || im2col.group != 1
        || input.datum_type != f32::datum_type()
        || !valid
        || !channels_first
        || spec.kernel_shape.len() != 1
        || spec.strides().iter().any(|s| *s != 1)
        || input.rank() != if spec.data_format == DataFormat::NCHW { 3 } else { 2 }
        || input.shape[input.rank() - 2] != spec.input_channels.to_dim()
    {
        return Ok(None);
    }
    let out = model.outlet_fact(OutletId::new(node.id, 0))?;
    let Some(packed) = out.exotic_fact.as_ref().and_then(|f| f.downcast_ref::<PackedExoticFact>()) else { return Ok(None) };
    let Some(format) = packed.format.downcast_ref::<PackedFormat>() else { return Ok(None) };
    let (kernel, dilation) = (spec.kernel_shape[0], spec.dilations()[0]);
    if format.dt != f32::datum_type() || kernel == 0 || packed.k != spec.input_channels * kernel {
        return Ok(None);
    }
    log::trace!(
        "{}: herald's im2col, {} channels, kernel {kernel}, dilation {dilation}, panels of {}",
        node.name,
        spec.input_channels,
        format.r
    );
    Ok(Some(PanelIm2Col { tract: im2col.clone(), channels: spec.input_channels, kernel, dilation, format: format.clone() }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tract_onnx::tract_core::ops::cnn::{Conv, KernelFormat, PoolSpec};
    use tract_onnx::tract_core::optim::Optimizer;

    fn floats(n: usize, seed: u64) -> Vec<f32> {
        crate::xorshift(seed).take(n).map(|s| (s % 2001) as f32 / 1000.0 - 1.0).collect()
    }

    /// `y = conv(x)`: x `[1, c, T]` float32 of a symbolic length (as the stream vocoder's), a
    /// constant kernel `[co, c, kernel]` and bias, decluttered.
    fn model(c: usize, co: usize, kernel: usize, dilation: usize, stride: usize, padding: PaddingSpec) -> TypedModel {
        let mut m = TypedModel::default();
        let t = m.symbols.sym("T");
        let x = m.add_source("x", f32::fact([1.to_dim(), c.to_dim(), t.to_dim()])).unwrap();
        let w = m.add_const("w", Tensor::from_shape(&[co, c, kernel], &floats(co * c * kernel, 5)).unwrap()).unwrap();
        let b = m.add_const("b", Tensor::from_shape(&[co], &floats(co, 6)).unwrap()).unwrap();
        let spec = PoolSpec {
            data_format: DataFormat::NCHW,
            kernel_shape: tvec![kernel],
            padding,
            dilations: Some(tvec![dilation]),
            strides: Some(tvec![stride]),
            input_channels: c,
            output_channels: co,
        };
        let y = m.wire_node("conv", Conv::new(spec, KernelFormat::OIHW, 1, None), &[x, w, b]).unwrap();
        m.select_output_outlets(&y).unwrap();
        m.into_decluttered().unwrap()
    }

    /// Optimized as herald does (tract's codegen, then [`UsePanelIm2Col`]) or as tract alone
    /// does; returns the plan and how many nodes the pass replaced.
    fn plan(mut m: TypedModel, ours: bool) -> (Arc<TypedRunnableModel>, usize) {
        let pass = UsePanelIm2Col::default();
        let replaced = pass.replaced.clone();
        let mut passes = Optimizer::codegen().passes;
        if ours {
            passes.push(Box::new(pass));
        }
        m.optimize_with_session(&mut Optimizer { passes, steps: None }.session()).unwrap();
        (m.into_runnable().unwrap(), replaced.load(Ordering::Relaxed))
    }

    /// The vocoder's convolution forms (kernel 7, dilations 1, 3, 9; kernel 3) at lengths that
    /// leave whole panels, a partial last panel and fewer positions than one panel: the output
    /// is bit for bit tract's, since the packed panels are the same bytes for the same product.
    /// A strided or padded convolution stays with tract.
    #[test]
    fn packs_what_tract_packs() {
        let cases: &[(usize, usize, usize, usize, usize, PaddingSpec, bool)] = &[
            (6, 8, 7, 1, 1, PaddingSpec::Valid, true),
            (5, 4, 7, 3, 1, PaddingSpec::Valid, true),
            (3, 16, 7, 9, 1, PaddingSpec::Explicit(tvec![0], tvec![0]), true),
            (8, 5, 3, 1, 1, PaddingSpec::Valid, true),
            (4, 4, 7, 1, 2, PaddingSpec::Valid, false),
            (4, 4, 7, 1, 1, PaddingSpec::Explicit(tvec![6], tvec![0]), false),
        ];
        for (c, co, kernel, dilation, stride, padding, taken) in cases.iter().cloned() {
            let what = format!("c {c}, co {co}, kernel {kernel}, dilation {dilation}, stride {stride}, {padding:?}");
            let (ours, replaced) = plan(model(c, co, kernel, dilation, stride, padding.clone()), true);
            let (theirs, _) = plan(model(c, co, kernel, dilation, stride, padding), false);
            assert_eq!(replaced, taken as usize, "{what}: replaced or not");
            let reach = (kernel - 1) * dilation;
            for n in [1, 2, 3, 5, 16, 37, 100] {
                let t = reach + n;
                let x = Tensor::from_shape(&[1, c, t], &floats(c * t, 7 + n as u64)).unwrap();
                let run = |p: &Arc<TypedRunnableModel>| p.run(tvec!(x.clone().into_tvalue())).unwrap().remove(0).into_tensor();
                let (y, want) = (run(&ours), run(&theirs));
                assert_eq!(y.shape(), want.shape(), "{what}, n {n}");
                let (p, q) = (view::<f32>(&y).unwrap(), view::<f32>(&want).unwrap());
                assert!(q.iter().any(|v| v.abs() > 0.1), "{what}: a non-trivial output");
                assert!(p.iter().zip(q).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}, n {n}: {p:?} vs {q:?}");
            }
        }
    }
}
