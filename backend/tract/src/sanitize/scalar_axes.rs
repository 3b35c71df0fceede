//! Pass 3: rank-0 `axes` of `Unsqueeze` / `Squeeze` (opset >= 13) become rank 1.

use std::collections::HashSet;

use tract_onnx::pb;
use tract_onnx::pb::attribute_proto::AttributeType;

use super::Ctx;
use super::proto::*;

/// Rewrite 3: rank-0 `axes` on `Unsqueeze` / `Squeeze` → shape `[1]`.
pub(super) fn fix_scalar_axes(graph: &mut pb::GraphProto, outer: &Consts, ctx: &mut Ctx) {
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
    let graph_io: HashSet<String> = graph.input.iter().chain(&graph.output).map(|v| v.name.clone()).collect();
    let mut new_inits = Vec::new();
    let mut fixes = Vec::new();
    for (axes, nodes) in &groups {
        let exclusive = uses.get(axes).copied().unwrap_or(0) == nodes.len() && !graph_io.contains(axes);
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
pub(super) fn reshape_local_const(graph: &mut pb::GraphProto, name: &str) -> bool {
    if let Some(init) = graph.initializer.iter_mut().find(|i| i.name == name) {
        init.dims = vec![1];
        return true;
    }
    let Some(node) = graph.node.iter_mut().find(|n| n.output.iter().any(|o| o == name)) else {
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
