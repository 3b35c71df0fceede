//! Per-node timing of a graph on tract, folded onto ONNX op types: where the vocoder's time goes
//! (`herald bench --profile vocoder`, docs/performance.md "Vocoder (issue 13)") and a talker or
//! code-predictor step's (`--profile talker|code-predictor`, "Quantized weights (issue 14)").

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use model::backend::{BackendError, VocoderForm};
use model::frame::CODEBOOKS;
use model::manifest::Manifest;
use tract_onnx::prelude::*;

/// The time one op type took in one run, summed over its nodes.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct OpTime {
    /// The ONNX op type the nodes came from (herald-export names a node `n_<OpType>_<id>`;
    /// tract names the nodes it derives `<onnx node>.<part>`); a fused SnakeBeta is `SnakeBeta`;
    /// tract's own op name where the ONNX one is unknown.
    pub op: String,
    /// tract's op names for these nodes (e.g. `OptMatMul`, `Im2col` for a `Conv`), with the
    /// median ms of each, largest first.
    pub tract_ops: Vec<(String, f64)>,
    /// Median over the runs of the summed node time, milliseconds.
    pub ms: f64,
    /// Nodes of the optimized plan.
    pub nodes: usize,
}

/// The ONNX op type in a herald-export node name (`scope/n_Conv_12.im2col` → `Conv`).
fn onnx_op(node_name: &str) -> Option<&str> {
    let last = node_name.rsplit('/').next()?;
    let base = last.split('.').next()?;
    let rest = base.strip_prefix("n_")?;
    let (op, id) = rest.rsplit_once('_')?;
    id.chars().all(|c| c.is_ascii_digit()).then_some(op)
}

/// Profile `runs` runs (after one warm-up) of the bundle's vocoder graph in `form` over `frames`
/// frames: windowed, one single pass of `frames` frames; stateful, one chunk of `frames` frames
/// from the zero state. Returns the op types by decreasing time and the median total ms.
///
/// # Errors
/// [`BackendError`] when the graph cannot be loaded or run, or the bundle has no graph of that
/// form.
pub fn profile_vocoder(
    dir: &Path,
    manifest: &Manifest,
    form: VocoderForm,
    frames: usize,
    runs: usize,
    concrete: bool,
) -> Result<(Vec<OpTime>, f64), BackendError> {
    let key =
        manifest.vocoder_graph(form).ok_or_else(|| BackendError::Unsupported(format!("the bundle has no {form} vocoder graph")))?;
    let info = manifest.graphs.get(key).ok_or_else(|| BackendError::Unsupported(format!("bundle.toml has no graph {key:?}")))?;
    let graph = crate::graph::load_plans(dir, key, info, &[concrete.then_some(frames)], false, false, &[false], None)?
        .pop()
        .ok_or_else(|| BackendError::Unsupported(format!("{key}: no plan")))?;
    let path = dir.join(&info.file);
    let rt = |e: TractError| BackendError::Runtime { path: path.clone(), backend: "tract", message: format!("{e:#}") };
    let codes = Tensor::from_shape(
        &[1, CODEBOOKS, frames],
        &(0..CODEBOOKS * frames).map(|i| ((i % frames * 131 + i / frames * 977) % 2048) as i64).collect::<Vec<_>>(),
    )
    .map_err(rt)?;
    let mut inputs: TVec<TValue> = tvec![codes.into_tvalue()];
    if form == VocoderForm::Stateful {
        let zeros = crate::vocoder::zero_states(info).map_err(|e| BackendError::Runtime {
            path: path.clone(),
            backend: "tract",
            message: e.to_string(),
        })?;
        inputs.extend(zeros.into_iter().map(|(_, t)| t));
    }
    time_nodes(&graph, inputs, runs, rt)
}

/// Run `graph` on `inputs` `runs` times after one warm-up, timing every node; fold the node
/// times onto ONNX op types. Returns the op types by decreasing time and the median total ms.
fn time_nodes(
    graph: &crate::graph::Graph,
    inputs: TVec<TValue>,
    runs: usize,
    rt: impl Fn(TractError) -> BackendError,
) -> Result<(Vec<OpTime>, f64), BackendError> {
    let model = graph.plan.model();
    let mut state = graph.plan.spawn().map_err(&rt)?;
    let mut per_run: Vec<Vec<f64>> = Vec::new();
    let mut totals = Vec::new();
    for run in 0..=runs.max(1) {
        let mut times = vec![0.0f64; model.nodes().len()];
        let t0 = Instant::now();
        state
            .run_plan_with_eval(inputs.clone(), |ctx, st, node, input| {
                let t = Instant::now();
                let r = tract_onnx::tract_core::plan::eval(ctx, st, node, input);
                times[node.id] += t.elapsed().as_secs_f64();
                r
            })
            .map_err(&rt)?;
        if run > 0 {
            totals.push(t0.elapsed().as_secs_f64() * 1e3);
            per_run.push(times);
        }
    }
    if log::log_enabled!(log::Level::Trace) {
        // the slowest nodes of the last run, by name (`RUST_LOG=backend_tract=trace`)
        let last = per_run.last().cloned().unwrap_or_default();
        let mut slowest: Vec<(usize, f64)> = last.iter().copied().enumerate().collect();
        slowest.sort_by(|a, b| b.1.total_cmp(&a.1));
        for (id, s) in slowest.into_iter().take(40) {
            let node = &model.nodes()[id];
            log::trace!("{:8.2} ms  {} ({})  {:?}", s * 1e3, node.name, node.op().name(), node.outputs.first().map(|o| &o.fact.shape));
        }
    }
    // op type -> (tract op -> ms per run, ms per run, nodes)
    type Acc = (BTreeMap<String, Vec<f64>>, Vec<f64>, usize);
    let mut by_op: BTreeMap<String, Acc> = BTreeMap::new();
    for node in model.nodes() {
        let tract_op = node.op().name().to_string();
        let op = if tract_op == "HeraldSnake" {
            "SnakeBeta".to_owned()
        } else {
            onnx_op(&node.name).map_or_else(|| tract_op.clone(), str::to_owned)
        };
        let e = by_op.entry(op).or_insert_with(|| (BTreeMap::new(), vec![0.0; per_run.len()], 0));
        let sub = e.0.entry(tract_op).or_insert_with(|| vec![0.0; per_run.len()]);
        for (r, times) in per_run.iter().enumerate() {
            e.1[r] += times[node.id] * 1e3;
            sub[r] += times[node.id] * 1e3;
        }
        e.2 += 1;
    }
    let mut out: Vec<OpTime> = by_op
        .into_iter()
        .map(|(op, (subs, mut ms, nodes))| {
            let mut tract_ops: Vec<(String, f64)> =
                subs.into_iter().map(|(name, mut v)| (name, model::stats::median(&mut v))).collect();
            tract_ops.sort_by(|a, b| b.1.total_cmp(&a.1));
            OpTime { op, tract_ops, ms: model::stats::median(&mut ms), nodes }
        })
        .collect();
    out.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    Ok((out, model::stats::median(&mut totals)))
}

/// Profile `runs` one-position steps (after one warm-up) of the bundle's talker
/// (`code_predictor == false`) or code-predictor step graph, with `past` filled cache
/// positions (zeros: the time of a step does not depend on the values). Returns the op types
/// by decreasing time and the median step ms.
///
/// # Errors
/// [`BackendError`] when the graph cannot be loaded or run.
pub fn profile_step(
    dir: &Path,
    manifest: &Manifest,
    code_predictor: bool,
    past: usize,
    runs: usize,
) -> Result<(Vec<OpTime>, f64), BackendError> {
    let key = if code_predictor { &manifest.code_predictor.graph } else { &manifest.talker.graph };
    let info = manifest.graphs.get(key).ok_or_else(|| BackendError::Unsupported(format!("bundle.toml has no graph {key:?}")))?;
    // the code predictor as the engine runs it: its heads split off (their one constant product
    // per sub-step is not in this profile)
    let int8 = manifest.int8_activations();
    let graph =
        if code_predictor { crate::graph::load_predictor(dir, key, info, int8)? } else { crate::graph::load(dir, key, info, int8)? };
    let path = dir.join(&info.file);
    let rt = |e: TractError| BackendError::Runtime { path: path.clone(), backend: "tract", message: format!("{e:#}") };
    let mut inputs: TVec<TValue> = tvec![];
    for spec in &info.inputs {
        let shape: Vec<usize> = spec
            .shape
            .iter()
            .map(|d| match d {
                model::manifest::Dim::Fixed(n) => *n as usize,
                model::manifest::Dim::Symbol(s) if s == "past" => past,
                model::manifest::Dim::Symbol(_) => 1,
            })
            .collect();
        let t = match spec.dtype.as_str() {
            "int64" => Tensor::zero::<i64>(&shape),
            "float16" => Tensor::zero::<half::f16>(&shape),
            _ => Tensor::zero::<f32>(&shape),
        }
        .map_err(rt)?;
        inputs.push(t.into_tvalue());
    }
    time_nodes(&graph, inputs, runs, rt)
}

#[cfg(test)]
mod tests {
    use super::onnx_op;

    #[test]
    fn op_types_come_from_herald_export_node_names() {
        assert_eq!(onnx_op("block4/n_Conv_1497.im2col"), Some("Conv"));
        assert_eq!(onnx_op("pre_transformer/layer2/n_Mul_351"), Some("Mul"));
        assert_eq!(onnx_op("pos/n_ReduceSum_9"), Some("ReduceSum"));
        assert_eq!(onnx_op("out/wav"), None);
        assert_eq!(onnx_op("n_Conv_x"), None);
    }
}
