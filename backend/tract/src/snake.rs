//! SnakeBeta as one vectorized tract op: `y = x + inv_b · sin²(a · x)`, per channel.
//!
//! The vocoder graphs spell SnakeBeta (herald-export's `_snake`, the official
//! `SnakeBeta.forward`) as five ONNX nodes: `Mul(x, a)`, `Sin`, `Mul(s, s)`, `Mul(·, inv_b)`,
//! `Add(x, ·)`, with `a = exp(alpha)` and `inv_b = 1 / (exp(beta) + 1e-9)` folded into `[1, C, 1]`
//! initializers. tract runs that as five passes over the activation, and its `Sin` is a scalar
//! libm call per element: measured on one single pass of 8 frames at 0.6B dimensions on one
//! thread, `Sin` alone took 25 % of the vocoder's time (348 ms of 1,416; onnxruntime 52 ms), the
//! four arithmetic passes another 10 % (docs/performance.md "Vocoder (issue 13)"). [`fuse_snakes`]
//! rewrites exactly that pattern into one `HeraldSnake(x, a, inv_b)` node before tract parses
//! the graph (the bundle's file is not changed, and other runtimes never see the node); [`Snake`]
//! computes it in one pass with a polynomial sine the compiler vectorizes (SSE/AVX on x86_64,
//! NEON on aarch64).
//!
//! The sine: `sin²` has period π, so `u = a·x` is reduced to `r = u − k·π ∈ [−π/2, π/2]`
//! (`k` = u/π rounded; π split in three parts, Cody–Waite, so that `k·π` is exact enough), and
//! `sin r` is its Taylor polynomial to degree 11 (truncation below 6e-8 on that interval, one
//! float32 ulp). Elements with `|u/π| ≥ 2^13`, where the reduction stops being exact, are
//! recomputed with the scalar `f32::sin` (never the case for a working vocoder: its activations
//! are O(1)); NaN and ±inf propagate as in the unfused graph (`sin(±inf)` is NaN).

use tract_onnx::model::ParsingContext;
use tract_onnx::pb;
use tract_onnx::prelude::*;
use tract_onnx::tract_hir::internal::*;
use tract_onnx::tract_hir::ops::expandable::{Expansion, expand};

use crate::stack::{view, view_mut};

/// The custom op type the rewritten graph uses (parsed by [`register`]).
pub(crate) const OP_TYPE: &str = "HeraldSnake";

/// 1/π in float32.
const INV_PI: f32 = std::f32::consts::FRAC_1_PI;
/// π = PI_A + PI_B + PI_C to about 1e-14 (Cody–Waite): PI_A and PI_B have 11 significant bits,
/// so `k·PI_A` and `k·PI_B` are exact in float32 for |k| < 2^13.
const PI_A: f32 = 3.140_625;
const PI_B: f32 = 9.675_026e-4;
const PI_C: f32 = 1.509_958e-7;
/// 1.5 · 2^23: adding and subtracting it rounds a float32 of magnitude below 2^22 to the nearest
/// integer (ties to even) without a libm call, so the loop vectorizes.
const ROUND_MAGIC: f32 = 12_582_912.0;
/// Largest |u/π| reduced with the polynomial (where the reduction above is exact); beyond it the
/// scalar `f32::sin` runs.
const REDUCE_LIMIT: f32 = 8192.0;

/// sin² of `u`, in a form that vectorizes (no branch, no call).
#[inline(always)]
fn sin2_poly(u: f32) -> f32 {
    let k = (u * INV_PI + ROUND_MAGIC) - ROUND_MAGIC;
    let r = ((u - k * PI_A) - k * PI_B) - k * PI_C;
    let r2 = r * r;
    // Taylor coefficients of sin: (-1)^n / (2n+1)!
    let p = -2.505_210_8e-8_f32;
    let p = p * r2 + 2.755_731_9e-6;
    let p = p * r2 - 1.984_127e-4;
    let p = p * r2 + 8.333_333e-3;
    let p = p * r2 - 0.166_666_67;
    let s = r + r * r2 * p;
    s * s
}

/// SnakeBeta of one channel's samples, `out = x + inv_b · sin²(a · x)`, every `|a·x/π|` below
/// [`REDUCE_LIMIT`].
#[inline(always)]
fn snake_row_body(xs: &[f32], out: &mut [f32], a: f32, inv_b: f32) {
    for (o, &x) in out.iter_mut().zip(xs) {
        *o = x + inv_b * sin2_poly(x * a);
    }
}

/// [`snake_row_body`] compiled for AVX2 + FMA (8 lanes instead of SSE2's 4; 3.4× faster
/// measured on this build machine's AMD EPYC).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn snake_row_avx2(xs: &[f32], out: &mut [f32], a: f32, inv_b: f32) {
    snake_row_body(xs, out, a, inv_b);
}

/// SnakeBeta of one row with the widest vectors the CPU has.
fn snake_row(xs: &[f32], out: &mut [f32], a: f32, inv_b: f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: both features were detected at run time.
        unsafe { snake_row_avx2(xs, out, a, inv_b) };
        return;
    }
    snake_row_body(xs, out, a, inv_b);
}

/// The fused SnakeBeta node: inputs `x` float32 `[N, C, L]`, `a` and `inv_b` float32 with `C`
/// elements (`[1, C, 1]` as exported); output `x + inv_b · sin²(a · x)` with the shape of `x`.
#[derive(Debug, Clone, Default, Hash, PartialEq, Eq)]
pub struct Snake;

impl Op for Snake {
    fn name(&self) -> StaticName {
        OP_TYPE.into()
    }

    op_as_typed_op!();
}

impl EvalOp for Snake {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let (x, a, inv_b) = args_3!(inputs);
        let shape = x.shape().to_vec();
        let (a, inv_b) = (view::<f32>(&a)?, view::<f32>(&inv_b)?);
        let &[n, c, l] = &shape[..] else { bail!("HeraldSnake expects x of rank 3, got shape {shape:?}") };
        if a.len() != c || inv_b.len() != c {
            bail!("HeraldSnake: {c} channels but {} and {} parameters", a.len(), inv_b.len());
        }
        // out of place: x is usually still needed (the residual adds it back), so writing into
        // a fresh tensor reads and writes each element once, where in place would copy x first
        // SAFETY: every element is written below (rows of l samples, n × c of them).
        let mut out = unsafe { Tensor::uninitialized::<f32>(&shape)? };
        if l > 0 {
            let xs = view::<f32>(&x)?;
            let os = view_mut::<f32>(&mut out)?;
            for (row, (src, dst)) in xs.chunks_exact(l).zip(os.chunks_exact_mut(l)).enumerate().take(n * c) {
                let ch = row % c;
                snake_row_exact(src, dst, a[ch], inv_b[ch]);
            }
        }
        Ok(tvec!(out.into_tvalue()))
    }
}

/// [`snake_row`] with the far elements done exactly: a vectorized max of `|x|` over the row
/// decides whether any element is far (NaN and ±inf need no special case: the polynomial
/// returns NaN for them, as `sin` does); only then does a per-element loop run.
fn snake_row_exact(xs: &[f32], out: &mut [f32], a: f32, inv_b: f32) {
    let max = xs.iter().fold(0.0f32, |m, &x| m.max(x.abs()));
    if max * a.abs() * INV_PI < REDUCE_LIMIT {
        snake_row(xs, out, a, inv_b);
    } else {
        for (o, &x) in out.iter_mut().zip(xs) {
            let u = x * a;
            let s = if (u * INV_PI).abs() < REDUCE_LIMIT { sin2_poly(u) } else { u.sin() * u.sin() };
            *o = x + inv_b * s;
        }
    }
}

impl TypedOp for Snake {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        if inputs.len() != 3 || inputs[0].datum_type != f32::datum_type() || inputs[0].rank() != 3 {
            bail!("HeraldSnake takes x float32 [N, C, L], a and inv_b; got {inputs:?}");
        }
        Ok(tvec!(inputs[0].without_value()))
    }

    as_op!();
}

/// The parser-side op: checks arity and types, then wires [`Snake`].
#[derive(Debug, Clone, Default, Hash, PartialEq, Eq)]
struct SnakeExpansion;

impl Expansion for SnakeExpansion {
    fn name(&self) -> StaticName {
        OP_TYPE.into()
    }

    fn wire(&self, prefix: &str, model: &mut TypedModel, inputs: &[OutletId]) -> TractResult<TVec<OutletId>> {
        model.wire_node(prefix, Snake, inputs)
    }

    fn rules<'r, 'p: 'r, 's: 'r>(
        &'s self,
        s: &mut Solver<'r>,
        inputs: &'p [TensorProxy],
        outputs: &'p [TensorProxy],
    ) -> InferenceResult {
        check_input_arity(inputs, 3)?;
        check_output_arity(outputs, 1)?;
        s.equals(&inputs[0].datum_type, f32::datum_type())?;
        s.equals(&outputs[0].datum_type, f32::datum_type())?;
        s.equals(&inputs[0].shape, &outputs[0].shape)?;
        Ok(())
    }
}

fn parse(_ctx: &ParsingContext, _node: &pb::NodeProto) -> TractResult<(Box<dyn InferenceOp>, Vec<String>)> {
    Ok((expand(SnakeExpansion), vec![]))
}

/// Teach tract-onnx the `HeraldSnake` op [`fuse_snakes`] writes.
pub(crate) fn register(onnx: &mut tract_onnx::model::Onnx) {
    onnx.op_register.insert(OP_TYPE, parse);
}

/// Rewrite every SnakeBeta spelled as `Add(x, Mul(Mul(Sin(Mul(x, A)), same), B))` (either operand
/// order of each Mul and the Add; `A`, `B` float32 initializers of shape `[1, C, 1]`, i.e. one
/// value per channel of an `[N, C, L]` activation, as [`Snake`] computes it; every
/// intermediate used only inside the pattern) into one `HeraldSnake(x, A, B)` node producing the
/// Add's output. Returns the number of nodes fused. Anything else is left alone.
pub(crate) fn fuse_snakes(proto: &mut pb::ModelProto) -> usize {
    let Some(graph) = proto.graph.as_mut() else { return 0 };
    let inits: std::collections::HashMap<&str, &pb::TensorProto> = graph.initializer.iter().map(|t| (t.name.as_str(), t)).collect();
    // float32 [1, C, 1]: per channel; any other broadcast is not what Snake computes
    let is_param =
        |name: &str| inits.get(name).is_some_and(|t| t.data_type == 1 && t.dims.len() == 3 && t.dims[0] == 1 && t.dims[2] == 1);
    let mut producer = std::collections::HashMap::new();
    let mut uses: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for (i, n) in graph.node.iter().enumerate() {
        for o in &n.output {
            producer.insert(o.as_str(), i);
        }
        for inp in &n.input {
            *uses.entry(inp.as_str()).or_default() += 1;
        }
    }
    for o in &graph.output {
        *uses.entry(o.name.as_str()).or_default() += 1;
    }
    let node = |name: &str, op: &str| -> Option<usize> {
        producer.get(name).copied().filter(|&i| graph.node[i].op_type == op && graph.node[i].output.len() == 1)
    };
    let used = |name: &str| uses.get(name).copied().unwrap_or(0);
    // (add node, [mul_a, sin, square, mul_b], x, A, B)
    let mut found: Vec<(usize, [usize; 4], String, String, String)> = Vec::new();
    for (ai, add) in graph.node.iter().enumerate() {
        if add.op_type != "Add" || add.input.len() != 2 {
            continue;
        }
        for (x, m2) in [(&add.input[0], &add.input[1]), (&add.input[1], &add.input[0])] {
            let Some(mb) = node(m2, "Mul").filter(|_| used(m2) == 1) else { continue };
            let mbn = &graph.node[mb];
            let (sq, b) = match (is_param(&mbn.input[0]), is_param(&mbn.input[1])) {
                (false, true) => (&mbn.input[0], &mbn.input[1]),
                (true, false) => (&mbn.input[1], &mbn.input[0]),
                _ => continue,
            };
            let Some(sqi) = node(sq, "Mul").filter(|_| used(sq) == 1) else { continue };
            let sqn = &graph.node[sqi];
            if sqn.input[0] != sqn.input[1] {
                continue;
            }
            let s = &sqn.input[0];
            let Some(si) = node(s, "Sin").filter(|_| used(s) == 2) else { continue };
            let m1 = &graph.node[si].input[0];
            let Some(ma) = node(m1, "Mul").filter(|_| used(m1) == 1) else { continue };
            let man = &graph.node[ma];
            let a = match (&man.input[0], &man.input[1]) {
                (p, q) if p == x && is_param(q) => q,
                (p, q) if q == x && is_param(p) => p,
                _ => continue,
            };
            found.push((ai, [ma, si, sqi, mb], x.clone(), a.clone(), b.clone()));
            break;
        }
    }
    if found.is_empty() {
        return 0;
    }
    let mut drop = vec![false; graph.node.len()];
    for (ai, parts, x, a, b) in &found {
        for &p in parts {
            drop[p] = true;
        }
        let add = &mut graph.node[*ai];
        // `n_SnakeBeta_<id>`: the profile (crate::profile) reads op types from node names
        add.name = add.name.replacen("n_Add_", "n_SnakeBeta_", 1);
        add.op_type = OP_TYPE.into();
        add.domain = String::new();
        add.attribute.clear();
        add.input = vec![x.clone(), a.clone(), b.clone()];
    }
    let mut i = 0;
    graph.node.retain(|_| {
        let keep = !drop[i];
        i += 1;
        keep
    });
    found.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_polynomial_matches_sin_squared() {
        let mut worst = 0f32;
        for i in -200_000..=200_000 {
            let u = i as f32 * 1e-3; // |u| <= 200, far beyond the vocoder's activations
            let want = (f64::from(u).sin().powi(2)) as f32;
            worst = worst.max((sin2_poly(u) - want).abs());
        }
        assert!(worst < 2e-6, "max abs error {worst}");
    }

    #[test]
    fn every_vector_width_gives_the_same_rows() {
        let xs: Vec<f32> = (0..1037).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let (mut wide, mut plain) = (vec![0.0f32; xs.len()], vec![0.0f32; xs.len()]);
        snake_row(&xs, &mut wide, 0.9, 1.3);
        snake_row_body(&xs, &mut plain, 0.9, 1.3);
        for ((w, p), &x) in wide.iter().zip(&plain).zip(&xs) {
            let exact = f64::from(x) + 1.3 * (0.9 * f64::from(x)).sin().powi(2);
            assert!((f64::from(*w) - exact).abs() < 1e-5 && (f64::from(*p) - exact).abs() < 1e-5, "{w} {p} {exact}");
        }
    }

    #[test]
    fn far_and_special_values_follow_the_scalar_formula() {
        let (a, inv_b) = (1.7f32, 0.6f32);
        let xs = vec![0.5f32, 1e9, -3e8, f32::INFINITY, f32::NAN, -0.25];
        let want: Vec<f32> = xs.iter().map(|&x| x + inv_b * (x * a).sin() * (x * a).sin()).collect();
        let mut got = vec![0.0f32; xs.len()];
        snake_row_exact(&xs, &mut got, a, inv_b);
        for (g, w) in got.iter().zip(&want) {
            assert!((g.is_nan() && w.is_nan()) || (g - w).abs() <= 1e-6 * w.abs().max(1.0), "{g} vs {w}");
        }
    }
}
