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
//! NEON on aarch64): `kernels::snake`, which documents the arithmetic.

use tract_onnx::model::ParsingContext;
use tract_onnx::pb;
use tract_onnx::prelude::*;
use tract_onnx::tract_hir::internal::*;
use tract_onnx::tract_hir::ops::expandable::{Expansion, expand};

use crate::stack::{view, view_mut};

/// The custom op type the rewritten graph uses (parsed by [`register`]).
pub(crate) const OP_TYPE: &str = "HeraldSnake";

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
                kernels::snake::snake_row(src, dst, a[ch], inv_b[ch]);
            }
        }
        Ok(tvec!(out.into_tvalue()))
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
