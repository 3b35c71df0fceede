//! herald's own Q4_0 matrix products for the decode steps, in place of tract's: the op
//! ([`Q4MatMul`]) and the optimizer pass that puts it in the graphs ([`UseQ4MatMul`]). The
//! arithmetic (weight layouts, the int8 quantization of the activations, the kernels per
//! architecture and their portable references) is the `kernels` crate's [`kernels::q4`];
//! this file matches tract's Q4_0 products (`com.microsoft.MatMulNBits`, bits 4, block 32, as
//! tract-onnx wires it: an `EinSum` `..k, gnk -> ..n` with `g = 1`) and chooses the kernel
//! ([`chosen`]). The parity test runs onnxruntime in whichever numerics herald picked
//! ([`crate::q4_int8_activations`]).

use std::sync::Arc;

use kernels::q4::{Kernel, Layout, Q4Weights};
use tract_linalg::block_quant::{BlockQuantFact, BlockQuantStorage, Q4_0};
use tract_onnx::prelude::*;
use tract_onnx::tract_core::optim::{OptimizerSession, TypedPass};
use tract_onnx::tract_hir::internal::*;

use crate::stack::{view, view_mut};

/// The kernel the optimizer puts in place of tract's Q4_0 products, or `None` to keep
/// tract's. `int8_activations`: the bundle's fidelity gate measured its q4 products with
/// int8 activations (`[quantization] activations = "int8"`, docs/bundle.md), so they may
/// run that way. From the environment variable `HERALD_Q4_KERNEL`:
///
/// - unset or empty: where the CPU has AVX-512, herald's AVX-512 VNNI kernel when
///   `int8_activations` and the CPU has VNNI, else herald's float32 AVX-512 kernel (both
///   measured faster than tract's end to end, docs/performance.md); on x86 without AVX-512
///   but with AVX-VNNI (Alder Lake-N), herald's AVX-VNNI kernel when `int8_activations`; on
///   aarch64 with `int8_activations`, herald's `sdot` kernel where the CPU has the
///   dot-product instructions, else herald's float32 NEON kernel (tract 0.23.9's aarch64 Q4_0 product is
///   `arm64simd_mmm_f32_32x1` with the `q40f32` packing: float32 activations on panels of 32
///   rows, the design of its x86 kernel that ran at 6.6 GB/s; neither of herald's kernels has
///   been timed against it on an ARM board yet); tract's kernels elsewhere (aarch64 on a bundle
///   gated for float32 activations; x86 without AVX-512 on a bundle gated for float32
///   activations or without AVX-VNNI, where herald's AVX2 kernel was not measured against
///   tract's);
/// - `herald`: herald's widest float32 kernel for this CPU ([`Kernel::detect`]: AVX-512, AVX2
///   or NEON), tract's on a CPU without any;
/// - `vnni` or `sdot` (the same): herald's int8-activation kernel for this CPU
///   ([`Kernel::detect_int8`]: AVX-512 VNNI, AVX-VNNI or NEON `sdot`) whatever the bundle
///   says (for comparisons; a warning when the bundle's gate did not measure int8
///   activations), the default on a CPU without one; `avxvnni`: the AVX-VNNI kernel likewise,
///   also on a CPU with AVX-512 VNNI (to compare the two);
/// - `tract`: tract's kernels; `portable`, `portable-int8`: herald's plain loops (for tests
///   and comparisons).
///
/// Any other value is ignored with a warning (the default applies).
pub(crate) fn chosen(int8_activations: bool) -> Option<Kernel> {
    let default = || match Kernel::detect() {
        Kernel::Avx512 => Some(Kernel::detect_int8().filter(|_| int8_activations).unwrap_or(Kernel::Avx512)),
        Kernel::Avx2 if int8_activations => Kernel::detect_int8(),
        Kernel::Neon if int8_activations => Some(Kernel::detect_int8().unwrap_or(Kernel::Neon)),
        _ => None,
    };
    match std::env::var("HERALD_Q4_KERNEL").ok().as_deref() {
        None | Some("") => default(),
        Some("tract") => None,
        Some("portable") => Some(Kernel::Portable),
        Some("portable-int8") => Some(Kernel::PortableInt8),
        Some("herald") => Some(Kernel::detect()).filter(|k| *k != Kernel::Portable),
        Some(name @ ("vnni" | "sdot" | "avxvnni")) => {
            match Kernel::detect_int8().map(|k| if name == "avxvnni" { Kernel::AvxVnni } else { k }).filter(|k| k.runs_here()) {
                Some(k) => {
                    if !int8_activations {
                        log::warn!("HERALD_Q4_KERNEL={name}: int8 activations on a bundle whose fidelity gate measured float32 ones");
                    }
                    Some(k)
                }
                None => {
                    log::warn!(
                        "HERALD_Q4_KERNEL={name}: this CPU has no such int8 dot-product kernel (AVX-512 VNNI, AVX-VNNI, NEON sdot): using the default"
                    );
                    default()
                }
            }
        }
        Some(other) => {
            log::warn!(
                "HERALD_Q4_KERNEL={other:?} is not one of tract, herald, vnni, sdot, avxvnni, portable, portable-int8: using the default"
            );
            default()
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

impl Op for Q4MatMul {
    fn name(&self) -> StaticName {
        "HeraldQ4MatMul".into()
    }

    fn info(&self) -> TractResult<Vec<String>> {
        Ok(vec![format!(
            "W [{}, {}] Q4_0 ({} bytes), {:?} kernel",
            self.weights.n(),
            self.weights.k(),
            self.weights.bytes(),
            self.kernel
        )])
    }

    op_as_typed_op!();
}

impl EvalOp for Q4MatMul {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let x = args_1!(inputs);
        let ps = &self.shape;
        let k = self.weights.k();
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
            let yv = view_mut::<f32>(&mut y)?;
            crate::compute::with_split(|split| self.kernel.product_split(&self.weights, xv, yv, split));
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
        Ok(tvec!((Cost::FMA(f32::datum_type()), rows * (self.weights.n() * self.weights.k()))))
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
        for _ in 0..n * k / kernels::q4::BLOCK_LEN {
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

    /// Q8_0 of `x` (rows of `k`) as GGML defines it, written out here independently of
    /// `kernels::q4::quantize_row`: per block of 32, `d = max |x| / 127` and `q = round_half_even(x / d)`;
    /// returns `q · d` per value (what an int8 kernel multiplies the weights by).
    fn q8_0(x: &[f32]) -> Vec<f32> {
        let mut out = Vec::with_capacity(x.len());
        for b in x.chunks(32) {
            let d = b.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
            out.extend(b.iter().map(|v| if d == 0.0 { 0.0 } else { (v * (1.0 / d)).round_ties_even() * d }));
        }
        out
    }

    /// Every kernel this CPU runs, one row and several, against tract's own dequantization
    /// (which checks that `kernels::q4` reads GGML's Q4_0 blocks as tract does): within float32
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
                for kernel in Kernel::available() {
                    let w = Q4Weights::from_q4_0(&bytes, n, k, kernel.layout()).unwrap();
                    let mut y = vec![f32::NAN; rows * n];
                    kernel.product(&w, &x, &mut y);
                    let want = if kernel.int8() { &want_q8 } else { &want };
                    for (i, (a, b)) in y.iter().zip(want).enumerate() {
                        let tol = abs[i / n] * 1e-5 + 1e-6;
                        assert!((*a as f64 - b).abs() <= tol, "{kernel:?} n={n} k={k} rows={rows} [{i}]: {a} vs {b} (tol {tol})");
                    }
                }
            }
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
