//! Pass 1: `Where(IsNaN(t), c, t)` NaN guards are dropped (see the module documentation).

use std::collections::{HashMap, HashSet};

use tract_onnx::pb;

use super::Ctx;
use super::proto::*;

/// Rewrite 1: `Where(IsNaN(t), c, t)` / `Where(Not(IsNaN(t)), t, c)` → `t`.
pub(super) fn remove_nan_guards(graph: &mut pb::GraphProto, outer: &Consts, ranks: &HashMap<String, usize>, ctx: &mut Ctx) {
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
            match graph.node[cond_node].input.first().and_then(|c| producer.get(c)) {
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
pub(super) fn is_harmless_replacement(
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
