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
//!
//! One file per pass ([`nan_guards`], [`allowzero`], [`scalar_axes`], [`value_info`]), the
//! protobuf helpers they share in [`proto`], the file I/O of [`sanitize_file`] in [`file`].

mod allowzero;
mod file;
mod nan_guards;
mod proto;
mod scalar_axes;
mod value_info;

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::io;
use std::path::PathBuf;

use tract_onnx::pb;

use proto::*;

pub use file::sanitize_file;

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
        self.nan_guards_removed + self.allowzero_cleared + self.scalar_axes_fixed + self.value_info_dropped
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
    let mut ctx = Ctx { opset, names: NameGen::default(), orphans: HashSet::new(), report };
    collect_names(graph, &mut ctx.names.taken);
    sanitize_graph(graph, &HashMap::new(), &mut ctx);
    ctx.report
}

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

    nan_guards::remove_nan_guards(graph, outer, &ranks, ctx);
    allowzero::clear_allowzero(graph, outer, &mut ctx.report);
    if ctx.opset.is_some_and(|v| v >= 13) {
        scalar_axes::fix_scalar_axes(graph, outer, ctx);
    }
    value_info::drop_value_info(graph, &mut ctx.report);

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
            .filter(|(_, n)| !n.output.is_empty() && n.output.iter().all(dead) && subgraphs(n).next().is_none())
            .map(|(i, _)| i)
            .collect();
        let before = graph.initializer.len();
        graph.initializer.retain(|i| !dead(&i.name) || inputs.contains(&i.name));
        if nodes.is_empty() && graph.initializer.len() == before {
            break;
        }
        remove_nodes(graph, &nodes);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::path::Path;

    use prost::Message;
    use tract_onnx::pb::attribute_proto::AttributeType;
    use tract_onnx::pb::tensor_proto::{DataLocation, DataType};

    use super::file::*;
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
        pb::AttributeProto { name: name.to_string(), r#type: AttributeType::Int as i32, i, ..Default::default() }
    }

    fn graph_attr(name: &str, g: pb::GraphProto) -> pb::AttributeProto {
        pb::AttributeProto { name: name.to_string(), r#type: AttributeType::Graph as i32, g: Some(g), ..Default::default() }
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
        let a =
            pb::AttributeProto { name: "value".to_string(), r#type: AttributeType::Tensor as i32, t: Some(t), ..Default::default() };
        with_attr(node("Constant", &[], &[out]), a)
    }

    fn vi(name: &str, dims: &[i64]) -> pb::ValueInfoProto {
        use pb::tensor_shape_proto::{Dimension, dimension::Value};
        let shape = pb::TensorShapeProto {
            dim: dims.iter().map(|&d| Dimension { value: Some(Value::DimValue(d)), ..Default::default() }).collect(),
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
            opset_import: vec![pb::OperatorSetIdProto { domain: String::new(), version: opset }],
            graph: Some(g),
            ..Default::default()
        }
    }

    fn ops(g: &pb::GraphProto) -> Vec<&str> {
        g.node.iter().map(|n| n.op_type.as_str()).collect()
    }

    fn find<'a>(g: &'a pb::GraphProto, op: &str) -> &'a pb::NodeProto {
        g.node.iter().find(|n| n.op_type == op).unwrap_or_else(|| panic!("no {op} in {:?}", ops(g)))
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
        assert_eq!(ops(g), ["Softmax", "Relu"], "the guard and its zero are gone");
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
        let g = graph(vec![node("IsNaN", &["x"], &["nan"]), zero(), node("Where", &["nan", "zero", "x"], &["y"])], &["x"], &["y"]);
        let mut m = model(g, 17);
        assert_eq!(sanitize(&mut m).nan_guards_removed, 1);
        let g = m.graph.as_ref().unwrap();
        assert_eq!(ops(g), ["Identity"]);
        let id = find(g, "Identity");
        assert_eq!((id.input.as_slice(), id.output.as_slice()), (&["x".to_string()][..], &["y".to_string()][..]));
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
        assert_eq!(m.graph.unwrap().node.iter().filter(|n| n.op_type == "Where").count(), 3);
    }

    #[test]
    fn one_element_replacement_of_known_lower_rank_is_removed() {
        let mut g = graph(
            vec![node("IsNaN", &["x"], &["nan"]), node("Where", &["nan", "z1", "x"], &["g"]), node("Relu", &["g"], &["y"])],
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
        else_branch.initializer.push(f32_tensor("g", &[2, 3], &[0.0; 6]));
        let iff = with_attr(
            with_attr(node("If", &["c"], &["y"]), graph_attr("then_branch", then_branch)),
            graph_attr("else_branch", else_branch),
        );
        let g = graph(
            vec![node("IsNaN", &["x"], &["nan"]), zero(), node("Where", &["nan", "zero", "x"], &["g"]), iff],
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
                with_attr(node("Reshape", &["x", "s_init"], &["a"]), int_attr("allowzero", 1)),
                with_attr(node("Reshape", &["a", "s_raw"], &["b"]), int_attr("allowzero", 1)),
                constant("s_const", i64_tensor("s_const", &[1], &[-1])),
                with_attr(node("Reshape", &["b", "s_const"], &["c"]), int_attr("allowzero", 1)),
                with_attr(node("Reshape", &["c", "s_zero"], &["d"]), int_attr("allowzero", 1)),
                with_attr(node("Reshape", &["d", "s_runtime"], &["e"]), int_attr("allowzero", 1)),
                with_attr(node("Reshape", &["e", "s_init"], &["y"]), int_attr("allowzero", 0)),
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
            .map(|n| n.attribute.iter().find(|a| a.name == "allowzero").map(|a| a.i))
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
        assert_eq!((a.name.as_str(), a.r#type, a.ints.as_slice()), ("value_ints", AttributeType::Ints as i32, &[1][..]));
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
        let new = g.initializer.iter().find(|i| i.name == "idx_axes1d_1").unwrap();
        assert_eq!((new.dims.as_slice(), new.int64_data.as_slice()), (&[1][..], &[0][..]));
        assert!(g.initializer.iter().find(|i| i.name == "idx").unwrap().dims.is_empty());
    }

    #[test]
    fn outer_scope_scalar_axes_get_a_local_initializer() {
        let body = graph(vec![node("Unsqueeze", &["x", "ax"], &["t"])], &[], &["t"]);
        let other = graph(vec![node("Identity", &["x"], &["e"])], &[], &["e"]);
        let iff = with_attr(with_attr(node("If", &["c"], &["y"]), graph_attr("then_branch", body)), graph_attr("else_branch", other));
        let gather = node("Gather", &["x", "ax"], &["row"]);
        let mut g = graph(vec![iff.clone(), gather], &["x", "c"], &["y", "row"]);
        g.initializer.push(i64_tensor("ax", &[], &[0]));
        let mut m = model(g, 17);
        assert_eq!(sanitize(&mut m).scalar_axes_fixed, 1);
        let g = m.graph.as_ref().unwrap();
        assert!(g.initializer[0].dims.is_empty(), "outer initializer untouched");
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
        let mut g = graph(vec![node("Unsqueeze", &["x", "ax"], &["y"])], &["x"], &["y"]);
        g.initializer.push(i64_tensor("ax", &[], &[0]));
        let mut m = model(g, 11);
        assert_eq!(sanitize(&mut m).scalar_axes_fixed, 0);
        assert!(m.graph.unwrap().initializer[0].dims.is_empty());
    }

    #[test]
    fn external_scalar_axes_keep_their_external_data() {
        let ext = vec![
            pb::StringStringEntryProto { key: "location".to_string(), value: "w.bin".to_string() },
            pb::StringStringEntryProto { key: "offset".to_string(), value: "0".to_string() },
            pb::StringStringEntryProto { key: "length".to_string(), value: "8".to_string() },
        ];
        let mut g = graph(
            vec![
                node("Unsqueeze", &["x", "ax"], &["u"]),
                with_attr(node("Reshape", &["u", "shape"], &["y"]), int_attr("allowzero", 1)),
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
        assert!(g.node[0].attribute[0].graphs.iter().all(|b| b.value_info.is_empty()));
    }

    #[test]
    fn report_is_one_line() {
        let r = SanitizeReport { nan_guards_removed: 2, value_info_dropped: 3, graphs: 1, ..Default::default() };
        let s = r.to_string();
        assert!(!s.contains('\n'));
        assert!(s.contains("2 NaN guard(s) removed") && s.contains("3 value_info dropped"), "{s}");
        assert_eq!(r.rewrites(), 5);
        assert!(!r.is_unchanged());
        assert!(SanitizeReport::default().is_unchanged());
    }

    #[test]
    fn model_without_graph_is_left_alone() {
        let mut m = pb::ModelProto { ir_version: 8, ..Default::default() };
        assert_eq!(sanitize(&mut m), SanitizeReport::default());
        assert!(matches!(decode_model(Path::new("m.onnx"), &m.encode_to_vec()), Err(SanitizeError::NotOnnx { .. })));
    }

    #[test]
    fn external_locations_must_stay_inside_the_model_directory() {
        let m = Path::new("m.onnx");
        assert!(check_location(m, "weights.bin").is_ok());
        assert!(check_location(m, "./sub/weights.bin").is_ok());
        for bad in ["", ".", "/etc/passwd", "../weights.bin", "sub/../../w.bin"] {
            let err = check_location(m, bad).expect_err(bad);
            assert!(matches!(err, SanitizeError::ExternalLocation { .. }), "{bad}: {err}");
        }
    }

    #[test]
    fn parent_of_a_bare_file_name_is_the_current_directory() {
        assert_eq!(parent_dir(Path::new("m.onnx")), Path::new("."));
        assert_eq!(parent_dir(Path::new("a/m.onnx")), Path::new("a"));
    }
}
