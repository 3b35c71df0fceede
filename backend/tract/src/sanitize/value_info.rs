//! Pass 4: every `value_info` entry is dropped (they go stale after rewrites and tract applies
//! them, which surfaces as "Impossible to unify" errors).

use tract_onnx::pb;

use super::SanitizeReport;

/// Drop `graph`'s `value_info` entries, counting them.
pub(super) fn drop_value_info(graph: &mut pb::GraphProto, report: &mut SanitizeReport) {
    report.value_info_dropped += graph.value_info.len();
    graph.value_info.clear();
}
