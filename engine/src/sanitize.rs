//! ONNX graph sanitizer: rewrites the patterns torch exporters leave in graphs that trip runtimes.
//!
//! herald's own exporter never emits these patterns, but users may bring graphs that carry them
//! (`herald sanitize IN OUT`). The rewrites work on the ONNX protobuf itself
//! ([`tract_onnx::pb::ModelProto`]), in the main graph and, recursively, in every subgraph
//! (`If` / `Loop` / `Scan` bodies held in `g` / `graphs` attributes):
//!
//! 1. **NaN guards**: `Where(IsNaN(t), c, t)` (or the mirrored `Where(Not(IsNaN(t)), t, c)`), where
//!    `c` is a one-element constant, is the identity on `t` except where `t` is NaN. The `Where` is
//!    dropped and its consumers read `t`; the `IsNaN` (and `Not`) go too when nothing else uses
//!    them. When the `Where`'s output is a graph output, its name is kept: the `Where` becomes
//!    `Identity(t)`. A guard whose replacement is not a one-element constant (it could broadcast
//!    `t` to a larger shape) is left alone and counted as kept. The rewrite changes behaviour only
//!    on NaN inputs (they propagate instead of being replaced).
//! 2. **`Reshape(allowzero=1)`**: when the target shape is a constant without a literal 0, the
//!    attribute is removed (`allowzero=0`), which is then exactly equivalent. A shape holding a 0
//!    (a genuinely zero-sized dimension) or computed at run time is left alone and counted as kept.
//! 3. **Rank-0 `axes`** on `Unsqueeze` / `Squeeze` (opset ≥ 13, axes as the second input): a
//!    rank-0 initializer or `Constant` output is given shape `[1]`. When the constant is also used
//!    by something else (a `Gather` index needing a scalar, a graph input/output, a subgraph, an
//!    outer scope), a new rank-1 initializer is added for the axes instead.
//! 4. **`value_info`**: every entry is dropped. They go stale after rewrites and tract applies
//!    them, which surfaces as "Impossible to unify" errors.
//!
//! Initializers stored as external data keep their `external_data` entries untouched: the
//! external files are never rewritten. [`sanitize_file`] copies them next to the output when the
//! output lives in another directory, so the relative locations still resolve.
//!
//! Decoding with tract's protobuf types drops fields those types do not know (recent additions
//! such as node `metadata_props`, sequence/map value types). tract ignores them anyway.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt;
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use prost::Message;
use tract_onnx::pb;
use tract_onnx::pb::attribute_proto::AttributeType;
use tract_onnx::pb::tensor_proto::{DataLocation, DataType};

/// Counts of what [`sanitize`] rewrote (and what it recognised but had to keep).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SanitizeReport {
    /// `IsNaN`→`Where` guards removed (the `Where` dropped or turned into an `Identity`).
    pub nan_guards_removed: usize,
    /// `IsNaN`→`Where` guards recognised but kept: the replacement value is not a one-element
    /// constant, so removing the `Where` could change the output shape.
    pub nan_guards_kept: usize,
    /// `Reshape` nodes whose `allowzero=1` was removed (constant shape without zeros).
    pub allowzero_cleared: usize,
    /// `Reshape` nodes left with `allowzero=1`: the shape holds a literal 0 or is not a constant.
    pub allowzero_kept: usize,
    /// `Unsqueeze` / `Squeeze` nodes whose rank-0 `axes` now has shape `[1]`.
    pub scalar_axes_fixed: usize,
    /// `value_info` entries dropped.
    pub value_info_dropped: usize,
    /// Graphs visited: the main graph plus every subgraph.
    pub graphs: usize,
}

impl SanitizeReport {
    /// Number of rewrites applied (kept patterns and visited graphs do not count).
    pub fn rewrites(&self) -> usize {
        self.nan_guards_removed
            + self.allowzero_cleared
            + self.scalar_axes_fixed
            + self.value_info_dropped
    }

    /// True when the model was left unchanged.
    pub fn is_unchanged(&self) -> bool {
        self.rewrites() == 0
    }
}

impl fmt::Display for SanitizeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "sanitize: {} NaN guard(s) removed ({} kept), {} allowzero cleared ({} kept), \
             {} scalar axes fixed, {} value_info dropped, {} graph(s)",
            self.nan_guards_removed,
            self.nan_guards_kept,
            self.allowzero_cleared,
            self.allowzero_kept,
            self.scalar_axes_fixed,
            self.value_info_dropped,
            self.graphs
        )
    }
}

/// Why [`sanitize_file`] failed. Every variant names the file concerned.
#[derive(Debug, thiserror::Error)]
pub enum SanitizeError {
    /// The input model could not be read (missing, a directory, no permission…).
    #[error("cannot read ONNX model {}: {source}", path.display())]
    Read {
        /// The input path.
        path: PathBuf,
        /// The underlying I/O error.
        source: io::Error,
    },
    /// The input is not an ONNX model (protobuf decoding failed, or no graph).
    #[error("{} is not an ONNX model: {reason}", path.display())]
    NotOnnx {
        /// The input path.
        path: PathBuf,
        /// What was wrong with it.
        reason: String,
    },
    /// The sanitized model could not be written.
    #[error("cannot write sanitized model {}: {source}", path.display())]
    Write {
        /// The output path.
        path: PathBuf,
        /// The underlying I/O error.
        source: io::Error,
    },
    /// An external-data location is not a relative path inside the model's directory.
    #[error("model {} references external data {location:?}: {reason}", model.display())]
    ExternalLocation {
        /// The input model.
        model: PathBuf,
        /// The `location` entry as written in the model.
        location: String,
        /// Why it is refused.
        reason: String,
    },
    /// An external-data file referenced by the model could not be read.
    #[error("cannot read external data {} of model {}: {source}", path.display(), model.display())]
    ExternalRead {
        /// The input model.
        model: PathBuf,
        /// The external-data file.
        path: PathBuf,
        /// The underlying I/O error.
        source: io::Error,
    },
    /// A different file with the external-data file's name already sits next to the output.
    #[error(
        "refusing to overwrite {}: it differs from the external data {} the model needs",
        path.display(),
        original.display()
    )]
    ExternalConflict {
        /// The existing file next to the output.
        path: PathBuf,
        /// The external-data file next to the input.
        original: PathBuf,
    },
    /// An external-data file could not be copied next to the output.
    #[error("cannot copy external data {} to {}: {source}", from.display(), to.display())]
    ExternalCopy {
        /// The external-data file next to the input.
        from: PathBuf,
        /// Where it was being copied.
        to: PathBuf,
        /// The underlying I/O error.
        source: io::Error,
    },
}

/// Sanitizes `model` in place (see the module documentation) and reports what changed.
///
/// Only the default (`ai.onnx`) domain's operators are touched; `model.functions` and
/// `training_info` are left as they are.
pub fn sanitize(model: &mut pb::ModelProto) -> SanitizeReport {
    let opset = default_opset(model);
    let report = SanitizeReport::default();
    let Some(graph) = model.graph.as_mut() else {
        return report;
    };
    let mut ctx = Ctx {
        opset,
        names: NameGen::default(),
        orphans: HashSet::new(),
        report,
    };
    collect_names(graph, &mut ctx.names.taken);
    sanitize_graph(graph, &HashMap::new(), &mut ctx);
    ctx.report
}

/// Reads the ONNX model at `input`, sanitizes it and writes it to `output` atomically (a
/// temporary file in the output's directory, fsync, rename).
///
/// External-data files (initializers with `data_location == EXTERNAL`) are never modified. When
/// `output` lives in another directory than `input`, each one is copied next to the output (under
/// the same relative location) unless an identical file is already there; a different file of the
/// same name is an error. `input == output` sanitizes in place.
pub fn sanitize_file(input: &Path, output: &Path) -> Result<SanitizeReport, SanitizeError> {
    let bytes = fs::read(input).map_err(|source| SanitizeError::Read {
        path: input.to_path_buf(),
        source,
    })?;
    let mut model = decode_model(input, &bytes)?;
    let report = sanitize(&mut model);

    let write_err = |source| SanitizeError::Write {
        path: output.to_path_buf(),
        source,
    };
    if output.is_dir() {
        return Err(write_err(io::Error::new(
            io::ErrorKind::IsADirectory,
            "the output is a directory",
        )));
    }
    // The output is replaced by a rename: only ever replace a regular file, never a device node,
    // a FIFO or a symlink (renaming over /dev/full would destroy the node).
    if let Ok(meta) = fs::symlink_metadata(output)
        && !meta.file_type().is_file()
    {
        return Err(write_err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the output exists and is not a regular file (a device, FIFO or symlink); choose another path",
        )));
    }
    let out_dir = parent_dir(output);
    let out_dir_canon = out_dir.canonicalize().map_err(write_err)?;
    let in_dir = parent_dir(input);
    let in_dir_canon = in_dir
        .canonicalize()
        .map_err(|source| SanitizeError::Read {
            path: input.to_path_buf(),
            source,
        })?;

    // External data stays where it is when the output sits next to the input; otherwise it is
    // copied (never rewritten) so the relative locations resolve from the output's directory.
    if let Some(graph) = &model.graph
        && in_dir_canon != out_dir_canon
    {
        let mut locations = BTreeSet::new();
        collect_external_locations(graph, &mut locations);
        for location in &locations {
            check_location(input, location)?;
        }
        for location in &locations {
            copy_external(input, &in_dir_canon, &out_dir_canon, location)?;
        }
    }

    write_atomic(output, &model.encode_to_vec()).map_err(write_err)?;
    log::info!("{}: {report}", output.display());
    Ok(report)
}

// ---------------------------------------------------------------------------------------------
// Graph rewrites
// ---------------------------------------------------------------------------------------------

/// The default-domain opset of `model` (`None` when it imports none).
fn default_opset(model: &pb::ModelProto) -> Option<i64> {
    model
        .opset_import
        .iter()
        .find(|o| o.domain.is_empty() || o.domain == "ai.onnx")
        .map(|o| o.version)
}

fn is_default_domain(node: &pb::NodeProto) -> bool {
    node.domain.is_empty() || node.domain == "ai.onnx"
}

fn is_op(node: &pb::NodeProto, op: &str) -> bool {
    node.op_type == op && is_default_domain(node)
}

/// Tensors small enough to be worth remembering as constants (axes, shapes, scalars).
const SMALL_CONST: i64 = 64;

/// A constant known by name: an initializer or the output of a `Constant` node.
type Consts = HashMap<String, pb::TensorProto>;

/// State shared by the whole walk over a model's graphs.
struct Ctx {
    /// The default-domain opset.
    opset: Option<i64>,
    /// Fresh names for new initializers.
    names: NameGen,
    /// Values the rewrites may have left unread (a guard's IsNaN / Not / replacement constant, an
    /// axes constant replaced by a rank-1 copy): dropped at the end of their graph when unread.
    orphans: HashSet<String>,
    report: SanitizeReport,
}

fn sanitize_graph(graph: &mut pb::GraphProto, outer: &Consts, ctx: &mut Ctx) {
    ctx.report.graphs += 1;
    let ranks = known_ranks(graph);

    remove_nan_guards(graph, outer, &ranks, ctx);
    clear_allowzero(graph, outer, &mut ctx.report);
    if ctx.opset.is_some_and(|v| v >= 13) {
        fix_scalar_axes(graph, outer, ctx);
    }
    ctx.report.value_info_dropped += graph.value_info.len();
    graph.value_info.clear();

    // Subgraphs see this graph's constants (shadowing the outer ones).
    let mut scope = outer.clone();
    scope.extend(local_consts(graph));
    for node in &mut graph.node {
        for attr in &mut node.attribute {
            if let Some(g) = attr.g.as_mut() {
                sanitize_graph(g, &scope, ctx);
            }
            for g in &mut attr.graphs {
                sanitize_graph(g, &scope, ctx);
            }
        }
    }
    // After the subgraphs: their rewrites may leave this graph's constants unread.
    drop_orphans(graph, &ctx.orphans);
}

/// Drops the nodes and initializers in `orphans` that nothing reads any more.
fn drop_orphans(graph: &mut pb::GraphProto, orphans: &HashSet<String>) {
    if orphans.is_empty() {
        return;
    }
    let inputs: HashSet<String> = graph.input.iter().map(|i| i.name.clone()).collect();
    loop {
        let uses = use_counts(graph);
        let dead = |name: &String| orphans.contains(name) && !uses.contains_key(name);
        let nodes: HashSet<usize> = graph
            .node
            .iter()
            .enumerate()
            .filter(|(_, n)| {
                !n.output.is_empty() && n.output.iter().all(dead) && subgraphs(n).next().is_none()
            })
            .map(|(i, _)| i)
            .collect();
        let before = graph.initializer.len();
        graph
            .initializer
            .retain(|i| !dead(&i.name) || inputs.contains(&i.name));
        if nodes.is_empty() && graph.initializer.len() == before {
            break;
        }
        remove_nodes(graph, &nodes);
    }
}

/// Ranks known from this graph's declarations (inputs, outputs, value_info, initializers).
fn known_ranks(graph: &pb::GraphProto) -> HashMap<String, usize> {
    let mut ranks = HashMap::new();
    for vi in graph
        .input
        .iter()
        .chain(&graph.output)
        .chain(&graph.value_info)
    {
        if let Some(pb::type_proto::Value::TensorType(t)) =
            vi.r#type.as_ref().and_then(|t| t.value.as_ref())
            && let Some(shape) = &t.shape
        {
            ranks.insert(vi.name.clone(), shape.dim.len());
        }
    }
    for init in &graph.initializer {
        ranks.insert(init.name.clone(), init.dims.len());
    }
    ranks
}

/// Small constants defined in `graph` itself: initializers and `Constant` node outputs.
fn local_consts(graph: &pb::GraphProto) -> Consts {
    let inputs: HashSet<&str> = graph.input.iter().map(|i| i.name.as_str()).collect();
    let mut consts = Consts::new();
    for init in &graph.initializer {
        if numel(init) <= SMALL_CONST && !inputs.contains(init.name.as_str()) {
            consts.insert(init.name.clone(), init.clone());
        }
    }
    for node in graph.node.iter().filter(|n| is_op(n, "Constant")) {
        // Check the size before cloning: a Constant may hold a whole weight matrix.
        let small = node.attribute.first().is_some_and(|a| {
            a.t.as_ref().is_none_or(|t| numel(t) <= SMALL_CONST)
                && a.ints.len() <= SMALL_CONST as usize
                && a.floats.len() <= SMALL_CONST as usize
        });
        if small && let (Some(out), Some(t)) = (node.output.first(), constant_node_tensor(node)) {
            consts.insert(out.clone(), t);
        }
    }
    consts
}

/// The value of a `Constant` node as a tensor (`value`, `value_int`, `value_ints`, `value_float`,
/// `value_floats`); `None` for the other forms.
fn constant_node_tensor(node: &pb::NodeProto) -> Option<pb::TensorProto> {
    let attr = node.attribute.first()?;
    match attr.name.as_str() {
        "value" => attr.t.clone(),
        "value_int" => Some(pb::TensorProto {
            data_type: DataType::Int64 as i32,
            int64_data: vec![attr.i],
            ..Default::default()
        }),
        "value_ints" => Some(pb::TensorProto {
            dims: vec![attr.ints.len() as i64],
            data_type: DataType::Int64 as i32,
            int64_data: attr.ints.clone(),
            ..Default::default()
        }),
        "value_float" => Some(pb::TensorProto {
            data_type: DataType::Float as i32,
            float_data: vec![attr.f],
            ..Default::default()
        }),
        "value_floats" => Some(pb::TensorProto {
            dims: vec![attr.floats.len() as i64],
            data_type: DataType::Float as i32,
            float_data: attr.floats.clone(),
            ..Default::default()
        }),
        _ => None,
    }
}

/// Element count of `t` (saturating: dims come from an untrusted file).
fn numel(t: &pb::TensorProto) -> i64 {
    t.dims
        .iter()
        .try_fold(1i64, |acc, &d| acc.checked_mul(d))
        .unwrap_or(i64::MAX)
}

fn is_external(t: &pb::TensorProto) -> bool {
    t.data_location == Some(DataLocation::External as i32)
}

/// The integer values of an inline int64/int32 tensor; `None` when external or not an integer.
fn int_values(t: &pb::TensorProto) -> Option<Vec<i64>> {
    if is_external(t) {
        return None;
    }
    let n = usize::try_from(numel(t)).ok()?;
    let values: Vec<i64> = if t.data_type == DataType::Int64 as i32 {
        if t.raw_data.is_empty() {
            t.int64_data.clone()
        } else {
            t.raw_data
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect()
        }
    } else if t.data_type == DataType::Int32 as i32 {
        if t.raw_data.is_empty() {
            t.int32_data.iter().map(|&v| i64::from(v)).collect()
        } else {
            t.raw_data
                .chunks_exact(4)
                .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .collect()
        }
    } else {
        return None;
    };
    (values.len() == n).then_some(values)
}

/// Looks `name` up among this graph's constants, then the outer scopes'.
fn lookup_const(graph: &pb::GraphProto, outer: &Consts, name: &str) -> Option<pb::TensorProto> {
    if graph.input.iter().any(|i| i.name == name) {
        return None; // a graph input (even one with an initializer as default) is not a constant
    }
    if let Some(init) = graph.initializer.iter().find(|i| i.name == name) {
        return Some(init.clone());
    }
    for node in &graph.node {
        if node.output.iter().any(|o| o == name) {
            return if is_op(node, "Constant") {
                constant_node_tensor(node)
            } else {
                None
            };
        }
    }
    outer.get(name).cloned()
}

/// Names a graph defines: its inputs, initializers and node outputs.
fn defined_names(graph: &pb::GraphProto) -> HashSet<String> {
    let mut defined: HashSet<String> = graph.input.iter().map(|i| i.name.clone()).collect();
    defined.extend(graph.initializer.iter().map(|i| i.name.clone()));
    defined.extend(graph.node.iter().flat_map(|n| n.output.iter().cloned()));
    defined
}

/// Names `graph` reads from enclosing scopes (recursively through its own subgraphs).
fn free_uses(graph: &pb::GraphProto, out: &mut HashSet<String>) {
    let defined = defined_names(graph);
    let mut used = HashSet::new();
    for node in &graph.node {
        used.extend(node.input.iter().filter(|i| !i.is_empty()).cloned());
        for g in subgraphs(node) {
            free_uses(g, &mut used);
        }
    }
    used.extend(graph.output.iter().map(|o| o.name.clone()));
    out.extend(used.into_iter().filter(|n| !defined.contains(n)));
}

fn subgraphs(node: &pb::NodeProto) -> impl Iterator<Item = &pb::GraphProto> {
    node.attribute
        .iter()
        .flat_map(|a| a.g.iter().chain(a.graphs.iter()))
}

/// Every use of each value in `graph`: node inputs, subgraph outer-scope reads, graph outputs.
fn use_counts(graph: &pb::GraphProto) -> HashMap<String, usize> {
    let mut counts: HashMap<String, usize> = HashMap::new();
    for node in &graph.node {
        for i in node.input.iter().filter(|i| !i.is_empty()) {
            *counts.entry(i.clone()).or_default() += 1;
        }
        let mut free = HashSet::new();
        for g in subgraphs(node) {
            free_uses(g, &mut free);
        }
        for name in free {
            *counts.entry(name).or_default() += 1;
        }
    }
    for o in &graph.output {
        *counts.entry(o.name.clone()).or_default() += 1;
    }
    counts
}

/// Renames reads of the outer value `from` to `to` inside `graph` (unless `graph` shadows it).
fn rename_free(graph: &mut pb::GraphProto, from: &str, to: &str) {
    if defined_names(graph).contains(from) {
        return;
    }
    for node in &mut graph.node {
        rename_in_node(node, from, to);
    }
    for o in &mut graph.output {
        if o.name == from {
            o.name = to.to_string();
        }
    }
}

/// Renames the reads of `from` by `node` (its inputs and its subgraphs' outer-scope reads).
fn rename_in_node(node: &mut pb::NodeProto, from: &str, to: &str) {
    for i in &mut node.input {
        if i == from {
            *i = to.to_string();
        }
    }
    for attr in &mut node.attribute {
        if let Some(g) = attr.g.as_mut() {
            rename_free(g, from, to);
        }
        for g in &mut attr.graphs {
            rename_free(g, from, to);
        }
    }
}

/// The producer of each value: output name → node index.
fn producers(graph: &pb::GraphProto) -> HashMap<String, usize> {
    let mut map = HashMap::new();
    for (i, node) in graph.node.iter().enumerate() {
        for o in node.output.iter().filter(|o| !o.is_empty()) {
            map.insert(o.clone(), i);
        }
    }
    map
}

/// Rewrite 1: `Where(IsNaN(t), c, t)` / `Where(Not(IsNaN(t)), t, c)` → `t`.
fn remove_nan_guards(
    graph: &mut pb::GraphProto,
    outer: &Consts,
    ranks: &HashMap<String, usize>,
    ctx: &mut Ctx,
) {
    let producer = producers(graph);
    let outputs: HashSet<String> = graph.output.iter().map(|o| o.name.clone()).collect();
    let mut drop_nodes = HashSet::new();

    for w in 0..graph.node.len() {
        let node = &graph.node[w];
        if !is_op(node, "Where") || node.input.len() != 3 || node.output.len() != 1 {
            continue;
        }
        let Some(&cond_node) = producer.get(&node.input[0]) else {
            continue;
        };
        let (isnan, not) = if is_op(&graph.node[cond_node], "Not") {
            match graph.node[cond_node]
                .input
                .first()
                .and_then(|c| producer.get(c))
            {
                Some(&p) if is_op(&graph.node[p], "IsNaN") => (p, Some(cond_node)),
                _ => continue,
            }
        } else if is_op(&graph.node[cond_node], "IsNaN") {
            (cond_node, None)
        } else {
            continue;
        };
        let Some(t) = graph.node[isnan].input.first().cloned() else {
            continue;
        };
        // Where picks input 1 where the condition holds: with `IsNaN`, that is the NaN branch.
        let (keep, replace) = if not.is_some() { (1, 2) } else { (2, 1) };
        if graph.node[w].input[keep] != t {
            continue; // not a guard of `t`
        }
        let replacement = graph.node[w].input[replace].clone();
        if replacement != t && !is_harmless_replacement(graph, outer, ranks, &replacement, &t) {
            ctx.report.nan_guards_kept += 1;
            continue;
        }

        let x = graph.node[w].output[0].clone();
        if outputs.contains(&x) {
            // Keep the graph output's name: the guard becomes a plain copy of `t`.
            let node = &mut graph.node[w];
            node.op_type = "Identity".to_string();
            node.input = vec![t.clone()];
            node.attribute.clear();
        } else {
            for (i, node) in graph.node.iter_mut().enumerate() {
                if i != w {
                    rename_in_node(node, &x, &t);
                }
            }
            drop_nodes.insert(w);
        }
        for c in not.into_iter().chain([isnan]) {
            ctx.orphans.extend(graph.node[c].output.iter().cloned());
        }
        if replacement != t {
            ctx.orphans.insert(replacement);
        }
        ctx.report.nan_guards_removed += 1;
    }
    remove_nodes(graph, &drop_nodes);
}

/// A replacement constant that cannot change `t`'s shape: a single element of rank 0, or of a
/// rank no larger than `t`'s known rank.
fn is_harmless_replacement(
    graph: &pb::GraphProto,
    outer: &Consts,
    ranks: &HashMap<String, usize>,
    replacement: &str,
    t: &str,
) -> bool {
    let Some(c) = lookup_const(graph, outer, replacement) else {
        return false;
    };
    if numel(&c) != 1 {
        return false;
    }
    c.dims.is_empty() || ranks.get(t).is_some_and(|&r| r >= c.dims.len())
}

fn remove_nodes(graph: &mut pb::GraphProto, drop: &HashSet<usize>) {
    if drop.is_empty() {
        return;
    }
    let mut i = 0;
    graph.node.retain(|_| {
        let keep = !drop.contains(&i);
        i += 1;
        keep
    });
}

/// Rewrite 2: `Reshape(allowzero=1)` with a constant shape free of zeros → `allowzero=0`.
fn clear_allowzero(graph: &mut pb::GraphProto, outer: &Consts, report: &mut SanitizeReport) {
    for n in 0..graph.node.len() {
        let node = &graph.node[n];
        if !is_op(node, "Reshape") {
            continue;
        }
        let Some(a) = node
            .attribute
            .iter()
            .position(|a| a.name == "allowzero" && a.i != 0)
        else {
            continue;
        };
        let shape = node
            .input
            .get(1)
            .and_then(|s| lookup_const(graph, outer, s))
            .and_then(|t| int_values(&t));
        match shape {
            Some(values) if !values.contains(&0) => {
                graph.node[n].attribute.remove(a);
                report.allowzero_cleared += 1;
            }
            _ => report.allowzero_kept += 1,
        }
    }
}

/// Rewrite 3: rank-0 `axes` on `Unsqueeze` / `Squeeze` → shape `[1]`.
fn fix_scalar_axes(graph: &mut pb::GraphProto, outer: &Consts, ctx: &mut Ctx) {
    // Group the offending nodes by axes name.
    let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
    for (n, node) in graph.node.iter().enumerate() {
        if !(is_op(node, "Unsqueeze") || is_op(node, "Squeeze")) {
            continue;
        }
        let Some(axes) = node.input.get(1).filter(|a| !a.is_empty()) else {
            continue;
        };
        let Some(t) = lookup_const(graph, outer, axes) else {
            continue;
        };
        if !t.dims.is_empty() {
            continue;
        }
        match groups.iter_mut().find(|(name, _)| name == axes) {
            Some((_, nodes)) => nodes.push(n),
            None => groups.push((axes.clone(), vec![n])),
        }
    }
    if groups.is_empty() {
        return;
    }

    let uses = use_counts(graph);
    let graph_io: HashSet<String> = graph
        .input
        .iter()
        .chain(&graph.output)
        .map(|v| v.name.clone())
        .collect();
    let mut new_inits = Vec::new();
    let mut fixes = Vec::new();
    for (axes, nodes) in &groups {
        let exclusive =
            uses.get(axes).copied().unwrap_or(0) == nodes.len() && !graph_io.contains(axes);
        let fixed_in_place = exclusive && reshape_local_const(graph, axes);
        if !fixed_in_place {
            let Some(mut t) = lookup_const(graph, outer, axes) else {
                continue;
            };
            let fresh = ctx.names.fresh(&format!("{axes}_axes1d"));
            ctx.orphans.insert(axes.clone());
            t.name = fresh.clone();
            t.dims = vec![1];
            new_inits.push(t);
            fixes.push((fresh, nodes.clone()));
        }
        ctx.report.scalar_axes_fixed += nodes.len();
    }
    for (fresh, nodes) in fixes {
        for n in nodes {
            graph.node[n].input[1] = fresh.clone();
        }
    }
    graph.initializer.extend(new_inits);
}

/// Gives the local rank-0 constant `name` (an initializer or a `Constant` output) shape `[1]`.
/// Returns false when `name` is not such a local constant.
fn reshape_local_const(graph: &mut pb::GraphProto, name: &str) -> bool {
    if let Some(init) = graph.initializer.iter_mut().find(|i| i.name == name) {
        init.dims = vec![1];
        return true;
    }
    let Some(node) = graph
        .node
        .iter_mut()
        .find(|n| n.output.iter().any(|o| o == name))
    else {
        return false;
    };
    if !is_op(node, "Constant") || node.attribute.len() != 1 {
        return false;
    }
    let attr = &mut node.attribute[0];
    match attr.name.as_str() {
        "value" => match attr.t.as_mut() {
            Some(t) => {
                t.dims = vec![1];
                true
            }
            None => false,
        },
        "value_int" => {
            attr.name = "value_ints".to_string();
            attr.r#type = AttributeType::Ints as i32;
            attr.ints = vec![attr.i];
            attr.i = 0;
            true
        }
        _ => false,
    }
}

/// Fresh value names, unique across the whole model.
#[derive(Default)]
struct NameGen {
    taken: HashSet<String>,
}

impl NameGen {
    fn fresh(&mut self, base: &str) -> String {
        let mut name = base.to_string();
        let mut k = 1;
        while self.taken.contains(&name) {
            name = format!("{base}_{k}");
            k += 1;
        }
        self.taken.insert(name.clone());
        name
    }
}

fn collect_names(graph: &pb::GraphProto, taken: &mut HashSet<String>) {
    taken.extend(
        graph
            .input
            .iter()
            .chain(&graph.output)
            .chain(&graph.value_info)
            .map(|v| v.name.clone()),
    );
    taken.extend(graph.initializer.iter().map(|i| i.name.clone()));
    for node in &graph.node {
        taken.extend(node.input.iter().chain(&node.output).cloned());
        for attr in &node.attribute {
            for g in attr.g.iter().chain(&attr.graphs) {
                collect_names(g, taken);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Files
// ---------------------------------------------------------------------------------------------

fn decode_model(path: &Path, bytes: &[u8]) -> Result<pb::ModelProto, SanitizeError> {
    let not_onnx = |reason: String| SanitizeError::NotOnnx {
        path: path.to_path_buf(),
        reason,
    };
    let model = pb::ModelProto::decode(bytes)
        .map_err(|e| not_onnx(format!("protobuf decoding failed: {e}")))?;
    if model.ir_version <= 0 {
        return Err(not_onnx("no IR version".to_string()));
    }
    if model.graph.is_none() {
        return Err(not_onnx("no graph".to_string()));
    }
    Ok(model)
}

/// The directory holding `path` (`.` for a bare file name).
fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Every external-data `location` the graph (and its subgraphs) refers to.
fn collect_external_locations(graph: &pb::GraphProto, out: &mut BTreeSet<String>) {
    let mut tensors: Vec<&pb::TensorProto> = graph.initializer.iter().collect();
    for sparse in &graph.sparse_initializer {
        tensors.extend(sparse.values.iter().chain(&sparse.indices));
    }
    for node in &graph.node {
        for attr in &node.attribute {
            tensors.extend(attr.t.iter().chain(&attr.tensors));
            for sparse in attr.sparse_tensor.iter().chain(&attr.sparse_tensors) {
                tensors.extend(sparse.values.iter().chain(&sparse.indices));
            }
            for g in attr.g.iter().chain(&attr.graphs) {
                collect_external_locations(g, out);
            }
        }
    }
    for t in tensors.into_iter().filter(|t| is_external(t)) {
        if let Some(loc) = t.external_data.iter().find(|e| e.key == "location") {
            out.insert(loc.value.clone());
        }
    }
}

/// External-data locations must be relative paths inside the model's directory (as tract and the
/// ONNX checker require).
fn check_location(model: &Path, location: &str) -> Result<(), SanitizeError> {
    let p = Path::new(location);
    let ok = !location.is_empty()
        && p.components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
        && p.components().any(|c| matches!(c, Component::Normal(_)));
    if ok {
        Ok(())
    } else {
        Err(SanitizeError::ExternalLocation {
            model: model.to_path_buf(),
            location: location.to_string(),
            reason: "not a relative path inside the model's directory".to_string(),
        })
    }
}

/// Copies the external-data file `location` from `in_dir` to `out_dir`, unless an identical file
/// is already there.
fn copy_external(
    model: &Path,
    in_dir: &Path,
    out_dir: &Path,
    location: &str,
) -> Result<(), SanitizeError> {
    let from = in_dir.join(location);
    let to = out_dir.join(location);
    let read_err = |source| SanitizeError::ExternalRead {
        model: model.to_path_buf(),
        path: from.clone(),
        source,
    };
    let canon = from.canonicalize().map_err(read_err)?;
    if !canon.starts_with(in_dir) {
        return Err(SanitizeError::ExternalLocation {
            model: model.to_path_buf(),
            location: location.to_string(),
            reason: format!(
                "resolves outside the model's directory (to {})",
                canon.display()
            ),
        });
    }
    if !canon.is_file() {
        return Err(read_err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file",
        )));
    }
    if to.exists() {
        let same = same_contents(&canon, &to).map_err(|source| SanitizeError::ExternalCopy {
            from: from.clone(),
            to: to.clone(),
            source,
        })?;
        return if same {
            Ok(())
        } else {
            Err(SanitizeError::ExternalConflict {
                path: to,
                original: from,
            })
        };
    }
    let copy_err = |source| SanitizeError::ExternalCopy {
        from: from.clone(),
        to: to.clone(),
        source,
    };
    if let Some(parent) = to.parent() {
        fs::create_dir_all(parent).map_err(copy_err)?;
    }
    copy_atomic(&canon, &to).map_err(copy_err)
}

/// Byte-for-byte comparison of two files.
fn same_contents(a: &Path, b: &Path) -> io::Result<bool> {
    let (fa, fb) = (fs::File::open(a)?, fs::File::open(b)?);
    if fa.metadata()?.len() != fb.metadata()?.len() {
        return Ok(false);
    }
    let (mut ra, mut rb) = (io::BufReader::new(fa), io::BufReader::new(fb));
    let (mut ba, mut bb) = (vec![0u8; 1 << 16], vec![0u8; 1 << 16]);
    loop {
        let na = read_full(&mut ra, &mut ba)?;
        let nb = read_full(&mut rb, &mut bb)?;
        if na != nb || ba[..na] != bb[..nb] {
            return Ok(false);
        }
        if na == 0 {
            return Ok(true);
        }
    }
}

/// Reads until `buf` is full or the end of the file; returns the number of bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// A temporary path next to `path`, unique within this process and between processes.
fn temp_path(path: &Path) -> io::Result<PathBuf> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the path has no file name"))?;
    let k = COUNTER.fetch_add(1, Ordering::Relaxed);
    let tmp = format!(".{}.tmp-{}-{k}", name.to_string_lossy(), std::process::id());
    Ok(parent_dir(path).join(tmp))
}

/// Writes `bytes` to `path` through a temporary file in the same directory, fsync and rename.
fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = temp_path(path)?;
    let result = (|| {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)?;
        sync_dir(parent_dir(path));
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Copies `from` to `to` through a temporary file in `to`'s directory, fsync and rename.
fn copy_atomic(from: &Path, to: &Path) -> io::Result<()> {
    let tmp = temp_path(to)?;
    let result = (|| {
        let mut src = fs::File::open(from)?;
        let mut dst = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        io::copy(&mut src, &mut dst)?;
        dst.sync_all()?;
        drop(dst);
        fs::rename(&tmp, to)?;
        sync_dir(parent_dir(to));
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Best-effort fsync of a directory, so a rename into it is durable.
fn sync_dir(dir: &Path) {
    #[cfg(unix)]
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
    #[cfg(not(unix))]
    let _ = dir;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(op: &str, inputs: &[&str], outputs: &[&str]) -> pb::NodeProto {
        pb::NodeProto {
            op_type: op.to_string(),
            name: format!("/{op}_{}", outputs.first().unwrap_or(&"")),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: outputs.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    fn int_attr(name: &str, i: i64) -> pb::AttributeProto {
        pb::AttributeProto {
            name: name.to_string(),
            r#type: AttributeType::Int as i32,
            i,
            ..Default::default()
        }
    }

    fn graph_attr(name: &str, g: pb::GraphProto) -> pb::AttributeProto {
        pb::AttributeProto {
            name: name.to_string(),
            r#type: AttributeType::Graph as i32,
            g: Some(g),
            ..Default::default()
        }
    }

    fn with_attr(mut n: pb::NodeProto, a: pb::AttributeProto) -> pb::NodeProto {
        n.attribute.push(a);
        n
    }

    fn i64_tensor(name: &str, dims: &[i64], values: &[i64]) -> pb::TensorProto {
        pb::TensorProto {
            name: name.to_string(),
            dims: dims.to_vec(),
            data_type: DataType::Int64 as i32,
            int64_data: values.to_vec(),
            ..Default::default()
        }
    }

    fn f32_tensor(name: &str, dims: &[i64], values: &[f32]) -> pb::TensorProto {
        pb::TensorProto {
            name: name.to_string(),
            dims: dims.to_vec(),
            data_type: DataType::Float as i32,
            float_data: values.to_vec(),
            ..Default::default()
        }
    }

    fn constant(out: &str, t: pb::TensorProto) -> pb::NodeProto {
        let a = pb::AttributeProto {
            name: "value".to_string(),
            r#type: AttributeType::Tensor as i32,
            t: Some(t),
            ..Default::default()
        };
        with_attr(node("Constant", &[], &[out]), a)
    }

    fn vi(name: &str, dims: &[i64]) -> pb::ValueInfoProto {
        use pb::tensor_shape_proto::{Dimension, dimension::Value};
        let shape = pb::TensorShapeProto {
            dim: dims
                .iter()
                .map(|&d| Dimension {
                    value: Some(Value::DimValue(d)),
                    ..Default::default()
                })
                .collect(),
        };
        pb::ValueInfoProto {
            name: name.to_string(),
            r#type: Some(pb::TypeProto {
                value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                    elem_type: DataType::Float as i32,
                    shape: Some(shape),
                })),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn graph(nodes: Vec<pb::NodeProto>, inputs: &[&str], outputs: &[&str]) -> pb::GraphProto {
        pb::GraphProto {
            name: "g".to_string(),
            node: nodes,
            input: inputs.iter().map(|n| vi(n, &[2, 3])).collect(),
            output: outputs.iter().map(|n| vi(n, &[2, 3])).collect(),
            ..Default::default()
        }
    }

    fn model(g: pb::GraphProto, opset: i64) -> pb::ModelProto {
        pb::ModelProto {
            ir_version: 8,
            opset_import: vec![pb::OperatorSetIdProto {
                domain: String::new(),
                version: opset,
            }],
            graph: Some(g),
            ..Default::default()
        }
    }

    fn ops(g: &pb::GraphProto) -> Vec<&str> {
        g.node.iter().map(|n| n.op_type.as_str()).collect()
    }

    fn find<'a>(g: &'a pb::GraphProto, op: &str) -> &'a pb::NodeProto {
        g.node
            .iter()
            .find(|n| n.op_type == op)
            .unwrap_or_else(|| panic!("no {op} in {:?}", ops(g)))
    }

    fn zero() -> pb::NodeProto {
        constant("zero", f32_tensor("zero", &[], &[0.0]))
    }

    #[test]
    fn nan_guard_is_removed_and_consumers_rewired() {
        let g = graph(
            vec![
                node("Softmax", &["x"], &["s"]),
                node("IsNaN", &["s"], &["nan"]),
                zero(),
                node("Where", &["nan", "zero", "s"], &["g"]),
                node("Relu", &["g"], &["y"]),
            ],
            &["x"],
            &["y"],
        );
        let mut m = model(g, 17);
        let r = sanitize(&mut m);
        assert_eq!(r.nan_guards_removed, 1);
        assert_eq!(r.nan_guards_kept, 0);
        let g = m.graph.as_ref().unwrap();
        assert_eq!(
            ops(g),
            ["Softmax", "Relu"],
            "the guard and its zero are gone"
        );
        assert_eq!(find(g, "Relu").input, ["s"]);
    }

    #[test]
    fn mirrored_guard_through_not_is_removed() {
        let g = graph(
            vec![
                node("IsNaN", &["x"], &["nan"]),
                node("Not", &["nan"], &["ok"]),
                zero(),
                node("Where", &["ok", "x", "zero"], &["g"]),
                node("Relu", &["g"], &["y"]),
            ],
            &["x"],
            &["y"],
        );
        let mut m = model(g, 17);
        assert_eq!(sanitize(&mut m).nan_guards_removed, 1);
        let g = m.graph.as_ref().unwrap();
        assert_eq!(ops(g), ["Relu"]);
        assert_eq!(find(g, "Relu").input, ["x"]);
    }

    #[test]
    fn mirrored_condition_on_the_wrong_branch_is_not_a_guard() {
        // Where(IsNaN(x), x, 0) keeps x only where it *is* NaN: not a guard.
        // Where(Not(IsNaN(x)), 0, x) likewise.
        let g = graph(
            vec![
                node("IsNaN", &["x"], &["nan"]),
                zero(),
                node("Where", &["nan", "x", "zero"], &["a"]),
                node("Not", &["nan"], &["ok"]),
                node("Where", &["ok", "zero", "x"], &["b"]),
                node("Add", &["a", "b"], &["y"]),
            ],
            &["x"],
            &["y"],
        );
        let mut m = model(g.clone(), 17);
        let r = sanitize(&mut m);
        assert_eq!((r.nan_guards_removed, r.nan_guards_kept), (0, 0));
        assert_eq!(m.graph.unwrap().node, g.node);
    }

    #[test]
    fn guard_feeding_a_graph_output_becomes_identity() {
        let g = graph(
            vec![
                node("IsNaN", &["x"], &["nan"]),
                zero(),
                node("Where", &["nan", "zero", "x"], &["y"]),
            ],
            &["x"],
            &["y"],
        );
        let mut m = model(g, 17);
        assert_eq!(sanitize(&mut m).nan_guards_removed, 1);
        let g = m.graph.as_ref().unwrap();
        assert_eq!(ops(g), ["Identity"]);
        let id = find(g, "Identity");
        assert_eq!(
            (id.input.as_slice(), id.output.as_slice()),
            (&["x".to_string()][..], &["y".to_string()][..])
        );
        assert_eq!(g.output[0].name, "y");
    }

    #[test]
    fn isnan_with_another_consumer_stays() {
        let g = graph(
            vec![
                node("IsNaN", &["x"], &["nan"]),
                zero(),
                node("Where", &["nan", "zero", "x"], &["g"]),
                node("Cast", &["nan"], &["flag"]),
                node("Add", &["g", "flag"], &["y"]),
            ],
            &["x"],
            &["y"],
        );
        let mut m = model(g, 17);
        assert_eq!(sanitize(&mut m).nan_guards_removed, 1);
        let g = m.graph.as_ref().unwrap();
        assert_eq!(ops(g), ["IsNaN", "Cast", "Add"]);
        assert_eq!(find(g, "Add").input, ["x", "flag"]);
    }

    #[test]
    fn guard_with_a_broadcasting_replacement_is_kept() {
        let g = graph(
            vec![
                node("IsNaN", &["x"], &["nan"]),
                // A runtime replacement: could broadcast x to a larger shape.
                node("Where", &["nan", "other", "x"], &["a"]),
                // A constant of several elements.
                constant("zeros", f32_tensor("zeros", &[2], &[0.0, 0.0])),
                node("Where", &["nan", "zeros", "x"], &["b"]),
                // One element but rank 3 > x's rank 2.
                constant("z3", f32_tensor("z3", &[1, 1, 1], &[0.0])),
                node("Where", &["nan", "z3", "x"], &["c"]),
                node("Sum", &["a", "b", "c"], &["y"]),
            ],
            &["x", "other"],
            &["y"],
        );
        let mut m = model(g, 17);
        let r = sanitize(&mut m);
        assert_eq!((r.nan_guards_removed, r.nan_guards_kept), (0, 3));
        assert_eq!(
            m.graph
                .unwrap()
                .node
                .iter()
                .filter(|n| n.op_type == "Where")
                .count(),
            3
        );
    }

    #[test]
    fn one_element_replacement_of_known_lower_rank_is_removed() {
        let mut g = graph(
            vec![
                node("IsNaN", &["x"], &["nan"]),
                node("Where", &["nan", "z1", "x"], &["g"]),
                node("Relu", &["g"], &["y"]),
            ],
            &["x"],
            &["y"],
        );
        g.initializer.push(f32_tensor("z1", &[1, 1], &[0.0]));
        let mut m = model(g, 17);
        assert_eq!(sanitize(&mut m).nan_guards_removed, 1);
        assert_eq!(find(m.graph.as_ref().unwrap(), "Relu").input, ["x"]);
    }

    #[test]
    fn guard_read_by_a_subgraph_is_rewired_there_unless_shadowed() {
        let then_branch = graph(vec![node("Neg", &["g"], &["t"])], &[], &["t"]);
        let mut else_branch = graph(vec![node("Neg", &["g"], &["e"])], &[], &["e"]);
        // `else` defines its own `g` (shadowing): it must not be renamed.
        else_branch
            .initializer
            .push(f32_tensor("g", &[2, 3], &[0.0; 6]));
        let iff = with_attr(
            with_attr(
                node("If", &["c"], &["y"]),
                graph_attr("then_branch", then_branch),
            ),
            graph_attr("else_branch", else_branch),
        );
        let g = graph(
            vec![
                node("IsNaN", &["x"], &["nan"]),
                zero(),
                node("Where", &["nan", "zero", "x"], &["g"]),
                iff,
            ],
            &["x", "c"],
            &["y"],
        );
        let mut m = model(g, 17);
        let r = sanitize(&mut m);
        assert_eq!(r.nan_guards_removed, 1);
        assert_eq!(r.graphs, 3);
        let g = m.graph.as_ref().unwrap();
        assert_eq!(ops(g), ["If"]);
        let iff = find(g, "If");
        assert_eq!(iff.attribute[0].g.as_ref().unwrap().node[0].input, ["x"]);
        assert_eq!(iff.attribute[1].g.as_ref().unwrap().node[0].input, ["g"]);
    }

    #[test]
    fn allowzero_cleared_only_for_constant_shapes_without_zero() {
        let raw: Vec<u8> = [2i64, -1].iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut g = graph(
            vec![
                with_attr(
                    node("Reshape", &["x", "s_init"], &["a"]),
                    int_attr("allowzero", 1),
                ),
                with_attr(
                    node("Reshape", &["a", "s_raw"], &["b"]),
                    int_attr("allowzero", 1),
                ),
                constant("s_const", i64_tensor("s_const", &[1], &[-1])),
                with_attr(
                    node("Reshape", &["b", "s_const"], &["c"]),
                    int_attr("allowzero", 1),
                ),
                with_attr(
                    node("Reshape", &["c", "s_zero"], &["d"]),
                    int_attr("allowzero", 1),
                ),
                with_attr(
                    node("Reshape", &["d", "s_runtime"], &["e"]),
                    int_attr("allowzero", 1),
                ),
                with_attr(
                    node("Reshape", &["e", "s_init"], &["y"]),
                    int_attr("allowzero", 0),
                ),
            ],
            &["x", "s_runtime"],
            &["y"],
        );
        g.initializer.push(i64_tensor("s_init", &[2], &[3, 2]));
        g.initializer.push(pb::TensorProto {
            name: "s_raw".to_string(),
            dims: vec![2],
            data_type: DataType::Int64 as i32,
            raw_data: raw,
            ..Default::default()
        });
        g.initializer.push(i64_tensor("s_zero", &[2], &[0, 6]));
        let mut m = model(g, 17);
        let r = sanitize(&mut m);
        assert_eq!((r.allowzero_cleared, r.allowzero_kept), (3, 2));
        let g = m.graph.as_ref().unwrap();
        let allowzero: Vec<Option<i64>> = g
            .node
            .iter()
            .filter(|n| n.op_type == "Reshape")
            .map(|n| {
                n.attribute
                    .iter()
                    .find(|a| a.name == "allowzero")
                    .map(|a| a.i)
            })
            .collect();
        assert_eq!(allowzero, [None, None, None, Some(1), Some(1), Some(0)]);
    }

    #[test]
    fn exclusive_scalar_axes_are_reshaped_in_place() {
        let mut g = graph(
            vec![
                node("Unsqueeze", &["x", "ax"], &["u"]),
                node("Squeeze", &["u", "ax"], &["s"]),
                constant("ax_c", i64_tensor("ax_c", &[], &[0])),
                node("Unsqueeze", &["s", "ax_c"], &["v"]),
                with_attr(node("Constant", &[], &["ax_i"]), int_attr("value_int", 1)),
                node("Unsqueeze", &["v", "ax_i"], &["y"]),
            ],
            &["x"],
            &["y"],
        );
        g.initializer.push(i64_tensor("ax", &[], &[0]));
        let mut m = model(g, 17);
        let r = sanitize(&mut m);
        assert_eq!(r.scalar_axes_fixed, 4);
        let g = m.graph.as_ref().unwrap();
        assert_eq!(g.initializer.len(), 1);
        assert_eq!(g.initializer[0].dims, [1]);
        assert_eq!(g.node[2].attribute[0].t.as_ref().unwrap().dims, [1]);
        let a = &g.node[4].attribute[0];
        assert_eq!(
            (a.name.as_str(), a.r#type, a.ints.as_slice()),
            ("value_ints", AttributeType::Ints as i32, &[1][..])
        );
        // Sanitizing again finds nothing.
        assert!(sanitize(&mut m).is_unchanged());
    }

    #[test]
    fn shared_scalar_axes_get_a_new_initializer() {
        let mut g = graph(
            vec![
                node("Unsqueeze", &["x", "idx"], &["u"]),
                node("Gather", &["x", "idx"], &["row"]),
                node("Unsqueeze", &["x", "ax_in"], &["v"]),
                node("Concat", &["u", "row", "v"], &["y"]),
            ],
            &["x", "ax_in"],
            &["y"],
        );
        g.initializer.push(i64_tensor("idx", &[], &[0]));
        g.initializer.push(i64_tensor("ax_in", &[], &[1]));
        // A name already taken, so the fresh one must differ.
        g.value_info.push(vi("idx_axes1d", &[1]));
        let mut m = model(g, 17);
        let r = sanitize(&mut m);
        // `ax_in` is a graph input (its initializer a mere default): not a constant, not touched.
        assert_eq!(r.scalar_axes_fixed, 1);
        let g = m.graph.as_ref().unwrap();
        assert_eq!(g.node[0].input[1], "idx_axes1d_1");
        assert_eq!(g.node[1].input[1], "idx", "Gather keeps its scalar index");
        let new = g
            .initializer
            .iter()
            .find(|i| i.name == "idx_axes1d_1")
            .unwrap();
        assert_eq!(
            (new.dims.as_slice(), new.int64_data.as_slice()),
            (&[1][..], &[0][..])
        );
        assert!(
            g.initializer
                .iter()
                .find(|i| i.name == "idx")
                .unwrap()
                .dims
                .is_empty()
        );
    }

    #[test]
    fn outer_scope_scalar_axes_get_a_local_initializer() {
        let body = graph(vec![node("Unsqueeze", &["x", "ax"], &["t"])], &[], &["t"]);
        let other = graph(vec![node("Identity", &["x"], &["e"])], &[], &["e"]);
        let iff = with_attr(
            with_attr(node("If", &["c"], &["y"]), graph_attr("then_branch", body)),
            graph_attr("else_branch", other),
        );
        let gather = node("Gather", &["x", "ax"], &["row"]);
        let mut g = graph(vec![iff.clone(), gather], &["x", "c"], &["y", "row"]);
        g.initializer.push(i64_tensor("ax", &[], &[0]));
        let mut m = model(g, 17);
        assert_eq!(sanitize(&mut m).scalar_axes_fixed, 1);
        let g = m.graph.as_ref().unwrap();
        assert!(
            g.initializer[0].dims.is_empty(),
            "outer initializer untouched"
        );
        let body = g.node[0].attribute[0].g.as_ref().unwrap();
        assert_eq!(body.node[0].input[1], "ax_axes1d");
        assert_eq!(body.initializer[0].dims, [1]);

        // Without the Gather, nothing reads the outer rank-0 `ax` any more: it goes.
        let mut g = graph(vec![iff], &["x", "c"], &["y"]);
        g.initializer.push(i64_tensor("ax", &[], &[0]));
        let mut m = model(g, 17);
        assert_eq!(sanitize(&mut m).scalar_axes_fixed, 1);
        assert!(m.graph.unwrap().initializer.is_empty());
    }

    #[test]
    fn scalar_axes_left_alone_before_opset_13() {
        let mut g = graph(
            vec![node("Unsqueeze", &["x", "ax"], &["y"])],
            &["x"],
            &["y"],
        );
        g.initializer.push(i64_tensor("ax", &[], &[0]));
        let mut m = model(g, 11);
        assert_eq!(sanitize(&mut m).scalar_axes_fixed, 0);
        assert!(m.graph.unwrap().initializer[0].dims.is_empty());
    }

    #[test]
    fn external_scalar_axes_keep_their_external_data() {
        let ext = vec![
            pb::StringStringEntryProto {
                key: "location".to_string(),
                value: "w.bin".to_string(),
            },
            pb::StringStringEntryProto {
                key: "offset".to_string(),
                value: "0".to_string(),
            },
            pb::StringStringEntryProto {
                key: "length".to_string(),
                value: "8".to_string(),
            },
        ];
        let mut g = graph(
            vec![
                node("Unsqueeze", &["x", "ax"], &["u"]),
                with_attr(
                    node("Reshape", &["u", "shape"], &["y"]),
                    int_attr("allowzero", 1),
                ),
            ],
            &["x"],
            &["y"],
        );
        for (name, dims) in [("ax", vec![]), ("shape", vec![2])] {
            g.initializer.push(pb::TensorProto {
                name: name.to_string(),
                dims,
                data_type: DataType::Int64 as i32,
                data_location: Some(DataLocation::External as i32),
                external_data: ext.clone(),
                ..Default::default()
            });
        }
        let mut m = model(g, 17);
        let r = sanitize(&mut m);
        assert_eq!(r.scalar_axes_fixed, 1);
        assert_eq!(r.allowzero_kept, 1, "an external shape cannot be inspected");
        let g = m.graph.as_ref().unwrap();
        for init in &g.initializer {
            assert_eq!(init.external_data, ext);
            assert_eq!(init.data_location, Some(DataLocation::External as i32));
        }
        let mut locations = BTreeSet::new();
        collect_external_locations(g, &mut locations);
        assert_eq!(locations.into_iter().collect::<Vec<_>>(), ["w.bin"]);
    }

    #[test]
    fn value_info_dropped_everywhere() {
        let mut body = graph(vec![node("Neg", &["x"], &["t"])], &[], &["t"]);
        body.value_info.push(vi("t", &[9]));
        let loop_node = pb::NodeProto {
            attribute: vec![pb::AttributeProto {
                name: "bodies".to_string(),
                r#type: AttributeType::Graphs as i32,
                graphs: vec![body.clone(), body],
                ..Default::default()
            }],
            ..node("Custom", &["x"], &["y"])
        };
        let mut g = graph(vec![loop_node], &["x"], &["y"]);
        g.value_info = vec![vi("a", &[1]), vi("b", &[2])];
        let mut m = model(g, 17);
        let r = sanitize(&mut m);
        assert_eq!((r.value_info_dropped, r.graphs), (4, 3));
        let g = m.graph.as_ref().unwrap();
        assert!(g.value_info.is_empty());
        assert!(
            g.node[0].attribute[0]
                .graphs
                .iter()
                .all(|b| b.value_info.is_empty())
        );
    }

    #[test]
    fn report_is_one_line() {
        let r = SanitizeReport {
            nan_guards_removed: 2,
            value_info_dropped: 3,
            graphs: 1,
            ..Default::default()
        };
        let s = r.to_string();
        assert!(!s.contains('\n'));
        assert!(
            s.contains("2 NaN guard(s) removed") && s.contains("3 value_info dropped"),
            "{s}"
        );
        assert_eq!(r.rewrites(), 5);
        assert!(!r.is_unchanged());
        assert!(SanitizeReport::default().is_unchanged());
    }

    #[test]
    fn model_without_graph_is_left_alone() {
        let mut m = pb::ModelProto {
            ir_version: 8,
            ..Default::default()
        };
        assert_eq!(sanitize(&mut m), SanitizeReport::default());
        assert!(matches!(
            decode_model(Path::new("m.onnx"), &m.encode_to_vec()),
            Err(SanitizeError::NotOnnx { .. })
        ));
    }

    #[test]
    fn external_locations_must_stay_inside_the_model_directory() {
        let m = Path::new("m.onnx");
        assert!(check_location(m, "weights.bin").is_ok());
        assert!(check_location(m, "./sub/weights.bin").is_ok());
        for bad in ["", ".", "/etc/passwd", "../weights.bin", "sub/../../w.bin"] {
            let err = check_location(m, bad).expect_err(bad);
            assert!(
                matches!(err, SanitizeError::ExternalLocation { .. }),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn parent_of_a_bare_file_name_is_the_current_directory() {
        assert_eq!(parent_dir(Path::new("m.onnx")), Path::new("."));
        assert_eq!(parent_dir(Path::new("a/m.onnx")), Path::new("a"));
    }
}
