//! Pass 2: `Reshape(allowzero=1)` with a constant shape without a literal 0 becomes `allowzero=0`.

use tract_onnx::pb;

use super::SanitizeReport;
use super::proto::*;

/// Rewrite 2: `Reshape(allowzero=1)` with a constant shape free of zeros → `allowzero=0`.
pub(super) fn clear_allowzero(graph: &mut pb::GraphProto, outer: &Consts, report: &mut SanitizeReport) {
    for n in 0..graph.node.len() {
        let node = &graph.node[n];
        if !is_op(node, "Reshape") {
            continue;
        }
        let Some(a) = node.attribute.iter().position(|a| a.name == "allowzero" && a.i != 0) else {
            continue;
        };
        let shape = node.input.get(1).and_then(|s| lookup_const(graph, outer, s)).and_then(|t| int_values(&t));
        match shape {
            Some(values) if !values.contains(&0) => {
                graph.node[n].attribute.remove(a);
                report.allowzero_cleared += 1;
            }
            _ => report.allowzero_kept += 1,
        }
    }
}
