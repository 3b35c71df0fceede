//! Loading a bundle's ONNX graphs into tract: sanitize, validate against the manifest, optimize.
//!
//! Each graph is read once (memory-mapped protobuf), passed through [`crate::sanitize`],
//! checked against the IO the manifest declares (names, order, dtypes, fixed and symbolic
//! dims), then typed, decluttered and optimized by tract into a runnable plan. Plans are shared
//! (`Arc`) and reused across utterances; each thread spawns its own state from them.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use tract_onnx::pb;
use tract_onnx::pb::tensor_shape_proto::dimension::Value as PbDim;
use tract_onnx::prelude::*;

use model::backend::BackendError as GraphError;
use model::manifest::{Dim, GraphInfo, TensorSpec};

/// A change to a decluttered model before it is optimized ([`load_plans`]).
pub(crate) type EditModel = dyn Fn(&mut TypedModel) -> TractResult<()> + Sync;

/// A loaded, optimized graph.
#[derive(Debug, Clone)]
pub(crate) struct Graph {
    /// The optimized plan, shared by all states.
    pub plan: Arc<TypedRunnableModel>,
    /// Input names in plan order.
    pub inputs: Vec<String>,
    /// Output names in plan order.
    pub outputs: Vec<String>,
    /// Seconds spent reading, sanitizing and optimizing.
    pub load_seconds: f64,
    /// Whether the decluttered model came from the graph cache ([`crate::cache`]).
    pub cached: bool,
    /// The code predictor's heads when they were split off the graph ([`crate::heads`]): the
    /// output named `logits` is then the final norm's output `hn [1, S, H]`, and the logits
    /// are head k's product of its last row.
    pub heads: Option<Arc<crate::heads::Heads>>,
}

impl Graph {
    /// Index of output `name` in the plan's output order.
    pub fn output(&self, name: &str) -> Option<usize> {
        self.outputs.iter().position(|n| n == name)
    }
}

fn elem_name(t: i32) -> &'static str {
    match t {
        1 => "float32",
        10 => "float16",
        7 => "int64",
        6 => "int32",
        9 => "bool",
        _ => "other",
    }
}

fn check_io(path: &Path, kind: &str, got: &[&pb::ValueInfoProto], want: &[TensorSpec]) -> Result<(), GraphError> {
    let mismatch = |message: String| GraphError::Mismatch { path: path.to_owned(), message };
    let got_names: Vec<&str> = got.iter().map(|v| v.name.as_str()).collect();
    let want_names: Vec<&str> = want.iter().map(|v| v.name.as_str()).collect();
    if got_names != want_names {
        return Err(mismatch(format!("{kind}s are {got_names:?}, bundle.toml declares {want_names:?}")));
    }
    for (g, w) in got.iter().zip(want) {
        let Some(pb::type_proto::Value::TensorType(t)) = g.r#type.as_ref().and_then(|t| t.value.as_ref()) else {
            return Err(mismatch(format!("{kind} {} has no tensor type", g.name)));
        };
        if elem_name(t.elem_type) != w.dtype {
            return Err(mismatch(format!("{kind} {} is {}, bundle.toml declares {}", g.name, elem_name(t.elem_type), w.dtype)));
        }
        let dims: Vec<Dim> = t
            .shape
            .as_ref()
            .map(|s| {
                s.dim
                    .iter()
                    .map(|d| match &d.value {
                        Some(PbDim::DimValue(v)) => Dim::Fixed(*v as u64),
                        Some(PbDim::DimParam(p)) => Dim::Symbol(p.clone()),
                        None => Dim::Symbol(String::new()),
                    })
                    .collect()
            })
            .unwrap_or_default();
        if dims != w.shape {
            return Err(mismatch(format!("{kind} {} has shape {:?}, bundle.toml declares {:?}", g.name, dims, w.shape)));
        }
    }
    Ok(())
}

/// Load `dir/<info.file>`: decode, sanitize, validate IO against `info`, optimize.
///
/// # Errors
/// [`GraphError::Load`] for a missing or undecodable file, [`GraphError::Mismatch`] when the
/// graph's IO differs from `info`, [`GraphError::Runtime`] when tract cannot optimize it.
pub(crate) fn load(dir: &Path, name: &str, info: &GraphInfo, int8_activations: bool) -> Result<Graph, GraphError> {
    let mut plans = load_plans(dir, name, info, &[None], false, int8_activations, &[false], None)?;
    plans.pop().ok_or_else(|| GraphError::Unsupported(format!("{name}: no plan")))
}

/// [`load`] for the code predictor: its stacked heads are split off into constant products
/// ([`crate::heads::split`]) before tract optimizes, when the graph has them.
///
/// # Errors
/// As [`load`].
pub(crate) fn load_predictor(dir: &Path, name: &str, info: &GraphInfo, int8_activations: bool) -> Result<Graph, GraphError> {
    let mut plans = load_plans(dir, name, info, &[None], true, int8_activations, &[false], None)?;
    plans.pop().ok_or_else(|| GraphError::Unsupported(format!("{name}: no plan")))
}

/// One plan's decluttered model before optimization: the model, its ONNX input and output
/// names in plan order, the seconds it took, and whether it came from the graph cache.
type Decluttered = (TypedModel, Vec<String>, Vec<String>, f64, bool);

/// [`load`] once per entry of `frames`, parsing the file once: `Some(n)` fixes the first
/// input's symbolic dimension to `n` (a vocoder graph's `codes [1, 16, frames]`) before tract
/// optimizes, because tract picks its faster convolution kernels (lazy im2col, direct spatial)
/// only for concrete shapes; `None` keeps it symbolic. Each plan holds its own optimized
/// (packed) weights.
///
/// With a graph cache directory set ([`crate::cache`]), the decluttered models come from the
/// cache when it holds every plan (the ONNX file is then not read), and are written to it
/// after a parse; optimizing (CPU-specific) always runs. `split_heads` splits a code
/// predictor's heads off before optimizing ([`load_predictor`]); the cache keeps the whole graph.
/// `half` lists the plans made per frame count: `false` float32 as exported, `true` with its
/// convolutions in half precision ([`crate::fp16`]); the result holds `frames.len() ×
/// half.len()` plans, frame count outer. `edit_half` changes each half-precision model after
/// the conversion (a deliberate fault, to show the gate failing: [`crate::fp16_vocoder_gate`]).
///
/// # Errors
/// As [`load`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_plans(
    dir: &Path,
    name: &str,
    info: &GraphInfo,
    frames: &[Option<usize>],
    split_heads: bool,
    int8_activations: bool,
    half: &[bool],
    edit_half: Option<&EditModel>,
) -> Result<Vec<Graph>, GraphError> {
    let path = dir.join(&info.file);
    let tract_err = |e: TractError| GraphError::Runtime { path: path.clone(), backend: "tract", message: format!("{e:#}") };
    let entries: Vec<Option<crate::cache::Entry>> = frames.iter().map(|f| crate::cache::entry(dir, name, info, *f)).collect();
    // every plan from the cache when it has them all; else the ONNX file is parsed once
    let mut decluttered: Vec<Decluttered> = Vec::with_capacity(frames.len());
    for e in &entries {
        let t = Instant::now();
        match e.as_ref().and_then(|e| e.read(info)) {
            Some((m, i, o)) => decluttered.push((m, i, o, t.elapsed().as_secs_f64(), true)),
            None => {
                decluttered.clear();
                break;
            }
        }
    }
    if decluttered.is_empty() {
        decluttered = parse_and_declutter(dir, name, info, frames)?;
        for (e, (m, i, o, _, _)) in entries.iter().zip(&decluttered) {
            if let Some(e) = e {
                e.write(m, i, o);
            }
        }
    }
    let mut plans = Vec::with_capacity(frames.len());
    for (f, (mut decluttered, inputs, outputs, before, cached)) in frames.iter().zip(decluttered) {
        for (v, &in_half) in half.iter().enumerate() {
            let mut model = if v + 1 == half.len() { std::mem::take(&mut decluttered) } else { decluttered.clone() };
            let t = Instant::now();
            let converted =
                if in_half { crate::fp16::convolutions_to_f16(&mut model, *f).map_err(tract_err)? } else { Default::default() };
            if in_half && let Some(edit) = edit_half {
                edit(&mut model).map_err(tract_err)?;
            }
            if in_half {
                let share = converted.macs_f16 / (converted.macs_f16 + converted.macs_kept).max(1.0);
                log::info!(
                    "{name}: {} convolutions in half precision ({:.1} % of the products' multiply-adds), {} at the frame rate kept float32",
                    converted.products,
                    100.0 * share,
                    converted.kept
                );
            }
            let heads = if split_heads { crate::heads::split(&mut model, &outputs).map_err(tract_err)?.map(Arc::new) } else { None };
            if split_heads {
                log::debug!(
                    "{name}: {}",
                    match &heads {
                        Some(h) => format!("{} heads split off into constant products ({} x {})", h.len(), h.hidden, h.vocab),
                        None => "no stacked heads to split off (the logits stay in the graph)".into(),
                    }
                );
            }
            let q4 = crate::q4pack::optimize(&mut model, int8_activations).map_err(tract_err)?;
            let plan = model.into_runnable().map_err(tract_err)?;
            let optimize = t.elapsed().as_secs_f64();
            log::debug!(
                "{name}: loaded {} ({f:?} frames) in {:.2} s: {} {before:.2} s, optimize {optimize:.2} s (Q4_0 products: {} on herald's {} kernel, {} packed for tract's)",
                path.display(),
                before + optimize,
                if cached { "cached decluttered model" } else { "read, parse, type and declutter" },
                q4.herald,
                q4.kernel.map_or_else(|| "(no)".to_string(), |k| format!("{k:?}")),
                q4.packed,
            );
            plans.push(Graph {
                plan,
                inputs: inputs.clone(),
                outputs: outputs.clone(),
                load_seconds: before + optimize,
                cached,
                heads,
            });
        }
    }
    Ok(plans)
}

/// The ONNX path of [`load_plans`]: read, sanitize, check IO, parse once, then type and
/// declutter once per plan. Returns each plan's decluttered model, its IO names and the
/// seconds it took (the parse counted in the first).
fn parse_and_declutter(dir: &Path, name: &str, info: &GraphInfo, frames: &[Option<usize>]) -> Result<Vec<Decluttered>, GraphError> {
    let t0 = Instant::now();
    let path = dir.join(&info.file);
    let mut onnx = tract_onnx::onnx();
    crate::snake::register(&mut onnx);
    let mut proto =
        onnx.proto_model_for_path(&path).map_err(|e| GraphError::Load { path: path.clone(), message: format!("{e:#}") })?;
    let report = crate::sanitize::sanitize(&mut proto);
    if !report.is_unchanged() {
        log::info!("{}: sanitized: {report}", path.display());
    }
    // the fusion rewrites inner nodes only: the graph IO checked below stays the file's
    let fused = crate::snake::fuse_snakes(&mut proto);
    if fused > 0 {
        log::debug!("{}: {fused} SnakeBeta activations fused into one op each", path.display());
    }
    let graph = proto.graph.as_ref().ok_or_else(|| GraphError::Load { path: path.clone(), message: "model has no graph".into() })?;
    let inits: std::collections::HashSet<&str> = graph.initializer.iter().map(|i| i.name.as_str()).collect();
    let inputs: Vec<&pb::ValueInfoProto> = graph.input.iter().filter(|i| !inits.contains(i.name.as_str())).collect();
    let outputs: Vec<&pb::ValueInfoProto> = graph.output.iter().collect();
    check_io(&path, "input", &inputs, &info.inputs)?;
    check_io(&path, "output", &outputs, &info.outputs)?;
    let input_names: Vec<String> = inputs.iter().map(|v| v.name.clone()).collect();
    let output_names: Vec<String> = outputs.iter().map(|v| v.name.clone()).collect();
    let tract_err = |e: TractError| GraphError::Runtime { path: path.clone(), backend: "tract", message: format!("{e:#}") };
    let dir_str = dir.to_str();
    let mut parsed = onnx.parse(&proto, dir_str).map_err(tract_err)?;
    drop(proto);
    if !parsed.unresolved_inputs.is_empty() {
        return Err(GraphError::Runtime {
            path: path.clone(),
            backend: "tract",
            message: format!("unresolved inputs {:?}", parsed.unresolved_inputs),
        });
    }
    let mut out = Vec::with_capacity(frames.len());
    let mut t = t0;
    for (i, f) in frames.iter().enumerate() {
        let mut model = if i + 1 == frames.len() { std::mem::take(&mut parsed.model) } else { parsed.model.clone() };
        if let Some(n) = *f {
            let fact = model.input_fact(0).map_err(tract_err)?.clone();
            let dt = fact.datum_type().unwrap_or(i64::datum_type());
            model.set_input_fact(0, InferenceFact::dt_shape(dt, [1, model::frame::CODEBOOKS, n])).map_err(tract_err)?;
        }
        let t_typed = Instant::now();
        let typed = model.into_typed().map_err(tract_err)?;
        let t_declutter = Instant::now();
        let model = typed.into_decluttered().map_err(tract_err)?;
        log::debug!(
            "{name}: {} ({f:?} frames): read+parse {:.2} s, typing {:.2} s, declutter {:.2} s",
            path.display(),
            (t_typed - t).as_secs_f64(),
            (t_declutter - t_typed).as_secs_f64(),
            t_declutter.elapsed().as_secs_f64()
        );
        out.push((model, input_names.clone(), output_names.clone(), t.elapsed().as_secs_f64(), false));
        t = Instant::now();
    }
    Ok(out)
}
