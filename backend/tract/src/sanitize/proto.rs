//! Reading and editing ONNX protobufs: op tests, constants, names, use counts, renames.

use std::collections::{HashMap, HashSet};

use tract_onnx::pb;
use tract_onnx::pb::tensor_proto::{DataLocation, DataType};

/// The default-domain opset of `model` (`None` when it imports none).
pub(super) fn default_opset(model: &pb::ModelProto) -> Option<i64> {
    model.opset_import.iter().find(|o| o.domain.is_empty() || o.domain == "ai.onnx").map(|o| o.version)
}

pub(super) fn is_default_domain(node: &pb::NodeProto) -> bool {
    node.domain.is_empty() || node.domain == "ai.onnx"
}

pub(super) fn is_op(node: &pb::NodeProto, op: &str) -> bool {
    node.op_type == op && is_default_domain(node)
}

/// Tensors small enough to be worth remembering as constants (axes, shapes, scalars).
pub(super) const SMALL_CONST: i64 = 64;

/// A constant known by name: an initializer or the output of a `Constant` node.
pub(super) type Consts = HashMap<String, pb::TensorProto>;

/// Ranks known from this graph's declarations (inputs, outputs, value_info, initializers).
pub(super) fn known_ranks(graph: &pb::GraphProto) -> HashMap<String, usize> {
    let mut ranks = HashMap::new();
    for vi in graph.input.iter().chain(&graph.output).chain(&graph.value_info) {
        if let Some(pb::type_proto::Value::TensorType(t)) = vi.r#type.as_ref().and_then(|t| t.value.as_ref())
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
pub(super) fn local_consts(graph: &pb::GraphProto) -> Consts {
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
pub(super) fn constant_node_tensor(node: &pb::NodeProto) -> Option<pb::TensorProto> {
    let attr = node.attribute.first()?;
    match attr.name.as_str() {
        "value" => attr.t.clone(),
        "value_int" => Some(pb::TensorProto { data_type: DataType::Int64 as i32, int64_data: vec![attr.i], ..Default::default() }),
        "value_ints" => Some(pb::TensorProto {
            dims: vec![attr.ints.len() as i64],
            data_type: DataType::Int64 as i32,
            int64_data: attr.ints.clone(),
            ..Default::default()
        }),
        "value_float" => Some(pb::TensorProto { data_type: DataType::Float as i32, float_data: vec![attr.f], ..Default::default() }),
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
pub(super) fn numel(t: &pb::TensorProto) -> i64 {
    t.dims.iter().try_fold(1i64, |acc, &d| acc.checked_mul(d)).unwrap_or(i64::MAX)
}

pub(super) fn is_external(t: &pb::TensorProto) -> bool {
    t.data_location == Some(DataLocation::External as i32)
}

/// The integer values of an inline int64/int32 tensor; `None` when external or not an integer.
pub(super) fn int_values(t: &pb::TensorProto) -> Option<Vec<i64>> {
    if is_external(t) {
        return None;
    }
    let n = usize::try_from(numel(t)).ok()?;
    let values: Vec<i64> = if t.data_type == DataType::Int64 as i32 {
        if t.raw_data.is_empty() {
            t.int64_data.clone()
        } else {
            t.raw_data.chunks_exact(8).map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])).collect()
        }
    } else if t.data_type == DataType::Int32 as i32 {
        if t.raw_data.is_empty() {
            t.int32_data.iter().map(|&v| i64::from(v)).collect()
        } else {
            t.raw_data.chunks_exact(4).map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]]))).collect()
        }
    } else {
        return None;
    };
    (values.len() == n).then_some(values)
}

/// Looks `name` up among this graph's constants, then the outer scopes'.
pub(super) fn lookup_const(graph: &pb::GraphProto, outer: &Consts, name: &str) -> Option<pb::TensorProto> {
    if graph.input.iter().any(|i| i.name == name) {
        return None; // a graph input (even one with an initializer as default) is not a constant
    }
    if let Some(init) = graph.initializer.iter().find(|i| i.name == name) {
        return Some(init.clone());
    }
    for node in &graph.node {
        if node.output.iter().any(|o| o == name) {
            return if is_op(node, "Constant") { constant_node_tensor(node) } else { None };
        }
    }
    outer.get(name).cloned()
}

/// Names a graph defines: its inputs, initializers and node outputs.
pub(super) fn defined_names(graph: &pb::GraphProto) -> HashSet<String> {
    let mut defined: HashSet<String> = graph.input.iter().map(|i| i.name.clone()).collect();
    defined.extend(graph.initializer.iter().map(|i| i.name.clone()));
    defined.extend(graph.node.iter().flat_map(|n| n.output.iter().cloned()));
    defined
}

/// Names `graph` reads from enclosing scopes (recursively through its own subgraphs).
pub(super) fn free_uses(graph: &pb::GraphProto, out: &mut HashSet<String>) {
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

pub(super) fn subgraphs(node: &pb::NodeProto) -> impl Iterator<Item = &pb::GraphProto> {
    node.attribute.iter().flat_map(|a| a.g.iter().chain(a.graphs.iter()))
}

/// Every use of each value in `graph`: node inputs, subgraph outer-scope reads, graph outputs.
pub(super) fn use_counts(graph: &pb::GraphProto) -> HashMap<String, usize> {
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
pub(super) fn rename_free(graph: &mut pb::GraphProto, from: &str, to: &str) {
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
pub(super) fn rename_in_node(node: &mut pb::NodeProto, from: &str, to: &str) {
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
pub(super) fn producers(graph: &pb::GraphProto) -> HashMap<String, usize> {
    let mut map = HashMap::new();
    for (i, node) in graph.node.iter().enumerate() {
        for o in node.output.iter().filter(|o| !o.is_empty()) {
            map.insert(o.clone(), i);
        }
    }
    map
}

pub(super) fn remove_nodes(graph: &mut pb::GraphProto, drop: &HashSet<usize>) {
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

/// Fresh value names, unique across the whole model.
#[derive(Default)]
pub(super) struct NameGen {
    pub(super) taken: HashSet<String>,
}

impl NameGen {
    pub(super) fn fresh(&mut self, base: &str) -> String {
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

pub(super) fn collect_names(graph: &pb::GraphProto, taken: &mut HashSet<String>) {
    taken.extend(graph.input.iter().chain(&graph.output).chain(&graph.value_info).map(|v| v.name.clone()));
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
