//! The vocoder's convolutions in half precision (issue 36): every `Conv` and `Deconv` of a
//! decluttered graph and every `EinSum` tract made of a 1×1 convolution, with their constant
//! kernels (and biases), rewritten to float16 (weights stored
//! as f16, activations cast to f16 at the product's input and back to float32 at its output),
//! while everything else (SnakeBeta, the residual adds, the vocoder's transformer, the graph's
//! inputs and outputs) stays float32.
//!
//! On a core with FP16 arithmetic (aarch64 `fphp`/`asimdhp`: Cortex-A55/A76/A78, Oryon) tract
//! runs these products on its `arm64fp16` kernels (8 halves per NEON register, twice float32's
//! lanes, accumulating in f16 as those kernels do); elsewhere it runs them on kernels that
//! widen f16 to float32 (x86: the float32 FMA kernels over f16-packed panels), which gives the
//! same rounding of weights and activations without the speed. Public ports that ran the
//! whole Code2Wav in fp16 report overflow (docs/bundle.md), which is why only the products
//! are converted; the result is checked against the float32 vocoder by [`crate::vocoder::
//! fp16_gate`] before herald uses it.

use std::collections::{HashMap, HashSet};

use tract_onnx::prelude::*;
use tract_onnx::tract_core::floats::FloatPrecisionTranslator;
use tract_onnx::tract_core::internal::translator::Translate;
use tract_onnx::tract_core::ops::cast::cast;
use tract_onnx::tract_core::ops::cnn::{Conv, Deconv};
use tract_onnx::tract_core::ops::einsum::EinSum;
use tract_onnx::tract_core::ops::konst::Const;
use tract_onnx::tract_core::ops::source::TypedSource;

/// Positions per frame below which a product stays float32 ([`convolutions_to_f16`]): the
/// products that run at the frame rate, before the decoder's upsampling blocks (the codes'
/// `pre_conv`, the two 2× upsampling stages, the decoder's input convolution: 1, 2 and 4
/// positions per 80 ms frame), keep float32. They are a few percent of the vocoder's
/// multiply-adds, and on the random 0.6B bundle the decoder's input convolution alone was the
/// largest f16 error: all products in f16 28.1 dB against float32, all but that one 32.7 dB
/// (x86, docs/backend.md). From the decoder blocks on, the time axis runs at 32 or more
/// positions per frame (the first block upsamples 8×).
pub const MIN_F16_POSITIONS_PER_FRAME: usize = 8;

/// What [`convolutions_to_f16`] converted.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Converted {
    /// Products converted to f16.
    pub products: usize,
    /// Products kept float32 (fewer than [`MIN_F16_POSITIONS_PER_FRAME`] positions per frame).
    pub kept: usize,
    /// Multiply-adds per run of the converted products and of the kept ones (concrete shapes
    /// only; 0 when the time axis is symbolic).
    pub macs_f16: f64,
    /// See `macs_f16`.
    pub macs_kept: f64,
}

/// Rewrites `model`'s float32 `Conv`/`Deconv` nodes and 1×1-convolution `EinSum`s (and their
/// constant inputs) to float16, in place; the inputs and outputs of the graph keep their
/// types. With `frames` (the plan's frames per run, concrete shapes), a product whose output
/// has fewer than [`MIN_F16_POSITIONS_PER_FRAME`] positions per frame on its last (time) axis
/// stays float32. Nothing converted leaves `model` as it was.
///
/// # Errors
/// When tract cannot type the rewritten graph (a bug: the ops are generic over float types).
pub(crate) fn convolutions_to_f16(model: &mut TypedModel, frames: Option<usize>) -> TractResult<Converted> {
    let mut chosen = HashSet::new();
    let mut converted = Converted::default();
    for node in &model.nodes {
        // a 1×1 convolution is an EinSum after decluttering, named after its ONNX Conv node
        // (`<name>.einsum`); the vocoder transformer's products are EinSums too, and stay float32
        let one_by_one = node.op_is::<EinSum>() && node.name.to_ascii_lowercase().contains("conv");
        if !(node.op_is::<Conv>() || node.op_is::<Deconv>() || one_by_one) {
            continue;
        }
        if node.inputs.first().map(|i| model.outlet_fact(*i)).transpose()?.is_none_or(|f| f.datum_type != f32::datum_type()) {
            continue;
        }
        // the time axis (last) of the output and of the input, when concrete
        let time = |f: &TypedFact| f.shape.last().and_then(|d| d.to_i64().ok()).and_then(|d| usize::try_from(d).ok());
        let out_t = time(model.outlet_fact(OutletId::new(node.id, 0))?);
        let in_t = time(model.outlet_fact(node.inputs[0])?);
        let kernel: usize = node
            .inputs
            .iter()
            .skip(1)
            .filter_map(|i| model.outlet_fact(*i).ok().and_then(|f| f.konst.as_ref()).map(|k| k.len()))
            .max()
            .unwrap_or(0);
        let positions = if node.op_is::<Deconv>() { in_t } else { out_t };
        let macs = (kernel * positions.unwrap_or(0)) as f64;
        if let (Some(f), Some(t)) = (frames.filter(|f| *f > 0), out_t)
            && t < MIN_F16_POSITIONS_PER_FRAME * f
        {
            converted.kept += 1;
            converted.macs_kept += macs;
            continue;
        }
        converted.products += 1;
        converted.macs_f16 += macs;
        chosen.insert(node.id);
        for input in &node.inputs {
            let producer = model.node(input.node);
            if producer.op_is::<Const>() && model.outlet_fact(*input)?.datum_type == f32::datum_type() {
                chosen.insert(producer.id);
            }
        }
    }
    if converted.products == 0 {
        return Ok(converted);
    }
    let translator = Chosen { inner: FloatPrecisionTranslator::new(f32::datum_type(), f16::datum_type()), chosen };
    let mut half = translator.translate_model(model)?;
    // the graph's outputs keep their float32 type
    for (ix, outlet) in half.outputs.clone().into_iter().enumerate() {
        let want = model.outlet_fact(model.outputs[ix])?.datum_type;
        if half.outlet_fact(outlet)?.datum_type != want {
            let name = format!("{}.to-{want:?}", half.node(outlet.node).name);
            half.outputs[ix] = half.wire_node(name, cast(want), &[outlet])?[0];
        }
    }
    // folds the kernels' Cast(Const) into float16 constants (the float32 copies are dropped)
    half.declutter()?;
    *model = half;
    Ok(converted)
}

/// A deliberate fault ([`crate::Fp16Fault::KernelScale`]): the first float16 constant of
/// `model` with more than one value (the first converted convolution's kernel, in eval order)
/// multiplied by `factor`, rounded to f16 (infinite past its range).
///
/// # Errors
/// When `model` has no such constant.
pub(crate) fn scale_first_kernel(model: &mut TypedModel, factor: f32) -> TractResult<()> {
    for id in model.eval_order()? {
        let node = &mut model.nodes[id];
        let Some(konst) = node.op_as::<Const>() else { continue };
        let val = konst.val();
        if val.datum_type() != f16::datum_type() || val.len() < 2 {
            continue;
        }
        let mut t = val.clone().into_tensor();
        for v in crate::stack::view_mut::<f16>(&mut t)? {
            *v = f16::from_f32(v.to_f32() * factor);
        }
        let t = t.into_arc_tensor();
        let fact = TypedFact::try_from(&t)?;
        node.op = Box::new(Const::new(t)?);
        node.outputs[0].fact = fact;
        return Ok(());
    }
    Err(TractError::msg("no float16 kernel to scale"))
}

/// [`FloatPrecisionTranslator`] restricted to the chosen node ids: a chosen node is translated
/// by tract's translator (its float32 inputs cast to f16); any other node is copied with its f16
/// inputs cast back to float32; sources are copied as they are.
#[derive(Debug)]
struct Chosen {
    inner: FloatPrecisionTranslator,
    chosen: HashSet<usize>,
}

impl Translate<TypedFact, Box<dyn TypedOp>, TypedFact, Box<dyn TypedOp>> for Chosen {
    fn translate_node(
        &self,
        source: &TypedModel,
        node: &TypedNode,
        target: &mut TypedModel,
        mapping: &HashMap<OutletId, OutletId>,
    ) -> TractResult<TVec<OutletId>> {
        if let Some(src) = node.op_as::<TypedSource>() {
            return Ok(tvec!(target.add_source(&node.name, src.fact.clone())?));
        }
        if self.chosen.contains(&node.id) {
            return self.inner.translate_node(source, node, target, mapping);
        }
        let mut inputs = tvec!();
        for (ix, i) in node.inputs.iter().enumerate() {
            let mapped = mapping[i];
            let was = source.outlet_fact(*i)?.datum_type;
            if target.outlet_fact(mapped)?.datum_type != was {
                inputs.push(target.wire_node(format!("{}.cast-{ix}", node.name), cast(was), &[mapped])?[0]);
            } else {
                inputs.push(mapped);
            }
        }
        target.wire_node(&node.name, node.op.clone(), &inputs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tract_onnx::tract_core::ops::cnn::{KernelFormat, PaddingSpec, PoolSpec};
    use tract_onnx::tract_core::ops::nn::DataFormat;

    /// A 1-D convolution `[1, ci, t] -> [1, co, t - (k - 1) · dilation]` followed by a float32
    /// add, with constant kernel and bias from `seed`.
    fn conv_model(ci: usize, co: usize, k: usize, dilation: usize, seed: u64) -> TypedModel {
        conv_model_t(ci, co, k, dilation, seed, None)
    }

    /// [`conv_model`] with the time axis `t` positions long (`None`: symbolic).
    fn conv_model_t(ci: usize, co: usize, k: usize, dilation: usize, seed: u64, t: Option<usize>) -> TypedModel {
        let mut m = TypedModel::default();
        let time = t.map_or_else(|| TDim::Sym(m.sym("T")), |t| t.to_dim());
        let x = m.add_source("x", f32::fact([1.to_dim(), ci.to_dim(), time])).unwrap();
        let mut vals = crate::xorshift(seed).map(|s| (s % 2001) as f32 / 1000.0 - 1.0);
        let w: Vec<f32> = vals.by_ref().take(co * ci * k).collect();
        let b: Vec<f32> = vals.by_ref().take(co).collect();
        let w = m.add_const("w", Tensor::from_shape(&[co, ci, k], &w).unwrap()).unwrap();
        let b = m.add_const("b", Tensor::from_shape(&[co], &b).unwrap()).unwrap();
        let pool = PoolSpec::new(DataFormat::NCHW, tvec!(k), PaddingSpec::Valid, Some(tvec!(dilation)), None, ci, co);
        let y = m.wire_node("conv", Conv::new(pool, KernelFormat::OIHW, 1, None), &[x, w, b]).unwrap()[0];
        let one = m.add_const("one", tensor3(&[[[1.0f32]]])).unwrap();
        let z = m.wire_node("add", tract_onnx::tract_core::ops::math::add(), &[y, one]).unwrap()[0];
        m.select_output_outlets(&[z]).unwrap();
        m.into_decluttered().unwrap()
    }

    /// The converted graph keeps float32 IO, stores the kernel in f16, and computes the same
    /// convolution within f16's rounding: its outputs against the float32 graph's, relative
    /// error of the whole output below 2⁻⁹ (f16 has an 11-bit significand, so each operand
    /// rounds by up to 2⁻¹¹; 48-term sums of such products stay well inside 2⁻⁹ on this data).
    #[test]
    fn converts_only_the_products_and_keeps_their_values() {
        for &(ci, co, k, dil) in &[(16usize, 8usize, 7usize, 1usize), (12, 5, 3, 3), (4, 4, 1, 1)] {
            let f32_model = conv_model(ci, co, k, dil, 3);
            let mut half = f32_model.clone();
            assert_eq!(convolutions_to_f16(&mut half, None).unwrap().products, 1, "{f32_model}");
            assert_eq!(half.input_fact(0).unwrap().datum_type, f32::datum_type());
            assert_eq!(half.output_fact(0).unwrap().datum_type, f32::datum_type());
            let f16_consts =
                half.nodes.iter().filter(|n| n.op_as::<Const>().is_some_and(|c| c.val().datum_type() == f16::datum_type())).count();
            // tract splits the bias off into an Add (stays float32); the kernel is f16
            assert!(f16_consts >= 1, "the kernel stored as an f16 constant:\n{half}");
            let t = 40;
            let x: Vec<f32> = crate::xorshift(9).take(ci * t).map(|s| (s % 2001) as f32 / 1000.0 - 1.0).collect();
            let x = Tensor::from_shape(&[1, ci, t], &x).unwrap();
            let run = |m: TypedModel| {
                let y = m.into_runnable().unwrap().run(tvec!(x.clone().into_tvalue())).unwrap().remove(0).into_tensor();
                y.try_as_plain_ram().unwrap().as_slice::<f32>().unwrap().to_vec()
            };
            let (want, got) = (run(f32_model.into_optimized().unwrap()), run(half.into_optimized().unwrap()));
            assert_eq!(want.len(), co * (t - (k - 1) * dil));
            let err: f64 = want.iter().zip(&got).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum::<f64>().sqrt();
            let norm: f64 = want.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
            assert!(err / norm < 1.0 / 512.0, "ci {ci} co {co} k {k}: relative error {}", err / norm);
            assert!(err > 0.0, "f16 rounding must show somewhere (else nothing was converted)");
        }
    }

    /// With the plan's frame count known, a product with fewer than 8 output positions per frame
    /// stays float32 and one with 8 or more is converted; the multiply-adds are counted
    /// (`co · ci · k` per output position).
    #[test]
    fn frame_rate_products_stay_float32() {
        let (ci, co, k) = (4usize, 3usize, 3usize);
        for (frames, t_out, converted) in [(2usize, 15usize, false), (2, 16, true), (1, 7, false), (1, 40, true)] {
            let mut m = conv_model_t(ci, co, k, 1, 5, Some(t_out + k - 1));
            let c = convolutions_to_f16(&mut m, Some(frames)).unwrap();
            assert_eq!((c.products, c.kept), if converted { (1, 0) } else { (0, 1) }, "frames {frames} t {t_out}");
            let macs = (co * ci * k * t_out) as f64;
            assert_eq!(if converted { c.macs_f16 } else { c.macs_kept }, macs);
            let f16_consts =
                m.nodes.iter().filter(|n| n.op_as::<Const>().is_some_and(|c| c.val().datum_type() == f16::datum_type())).count();
            assert_eq!(f16_consts > 0, converted, "frames {frames} t {t_out}:\n{m}");
        }
    }

    /// A graph without convolutions is left alone.
    #[test]
    fn no_products_no_change() {
        let mut m = TypedModel::default();
        let x = m.add_source("x", f32::fact([4])).unwrap();
        let y = m.wire_node("neg", tract_onnx::tract_core::ops::math::neg(), &[x]).unwrap()[0];
        m.select_output_outlets(&[y]).unwrap();
        let before = format!("{m}");
        assert_eq!(convolutions_to_f16(&mut m, None).unwrap().products, 0);
        assert_eq!(format!("{m}"), before);
    }
}
