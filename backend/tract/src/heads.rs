//! The code predictor's heads, split off its step graph into one constant product each.
//!
//! The step graph selects codebook k+1's head out of the stacked `lm_heads [15, H, V]` with a
//! `Gather` by the `head` input (docs/bundle.md "Step graphs"), so in tract the selected head is a
//! run-time tensor: every sub-step copies it out of the stack (8 MB at 0.6B in float32) and packs
//! it into the matrix kernel's panel layout again, which measured more than the five quantized
//! layers of a q4 sub-step together (docs/performance.md "Quantized weights"). Here the graph's
//! `logits = hn · Gather(lm_heads, head)` is cut at `hn`: the step graph returns `hn` (the final
//! norm's output, `[1, S, H]`) in place of the logits, and each head becomes its own small plan
//! with a constant weight, packed once at load. The arithmetic is the same product on the same
//! float32 weights; only where the weight lives changes.

use std::sync::Arc;

use tract_onnx::prelude::*;
use tract_onnx::tract_core::internal::{DatumExt, SpecialOps};
use tract_onnx::tract_core::ops::array::Gather;
use tract_onnx::tract_core::ops::einsum::EinSum;
use tract_onnx::tract_core::ops::konst::Const;

/// One optimized plan per head: `hidden [1, 1, H]` float32 → `logits [1, 1, V]` float32.
pub(crate) struct Heads {
    plans: Vec<Arc<TypedRunnableModel>>,
    /// The hidden width H (the step graph's `hn`).
    pub hidden: usize,
    /// The vocabulary V (the logits' width).
    pub vocab: usize,
}

impl std::fmt::Debug for Heads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Heads")
            .field("heads", &self.plans.len())
            .field("hidden", &self.hidden)
            .field("vocab", &self.vocab)
            .finish_non_exhaustive()
    }
}

impl Heads {
    /// Number of heads (codebooks 1..=K of a frame).
    pub(crate) fn len(&self) -> usize {
        self.plans.len()
    }
}

/// Cut `model`'s output `logits` (position `logits` in `outputs`) off its head selection when
/// it is `EinSum(hn, Gather(Const [K, H, V], head))` (either operand order), which is how tract
/// declutters the exporter's code-predictor graph: the output becomes `hn` and the `K` heads
/// come back as plans. `Ok(None)` leaves the model untouched when the pattern is not there (a
/// talker, or a graph exported another way).
///
/// # Errors
/// A tract error when a head plan cannot be built or the model cannot be compacted.
pub(crate) fn split(model: &mut TypedModel, outputs: &[String]) -> TractResult<Option<Heads>> {
    let Some(li) = outputs.iter().position(|n| n == "logits") else { return Ok(None) };
    let logits = model.output_outlets()?[li];
    let node = model.node(logits.node);
    let Some(ein) = node.op_as::<EinSum>() else { return Ok(None) };
    if node.inputs.len() != 2 || ein.q_params.is_some() || ein.operating_dt != f32::datum_type() {
        return Ok(None);
    }
    for (hi, wi) in [(0usize, 1usize), (1, 0)] {
        let gnode = model.node(node.inputs[wi].node);
        let Some(gather) = gnode.op_as::<Gather>() else { continue };
        if gather.axis != 0 || gnode.inputs.len() != 2 {
            continue;
        }
        let Some(konst) = model.node(gnode.inputs[0].node).op_as::<Const>() else { continue };
        let stacked = konst.val().clone();
        let index = model.outlet_fact(gnode.inputs[1])?;
        if stacked.rank() != 3 || stacked.datum_type() != f32::datum_type() || index.shape.as_concrete() != Some(&[1]) {
            continue;
        }
        let (k, h, v) = (stacked.shape()[0], stacked.shape()[1], stacked.shape()[2]);
        let hn = node.inputs[hi];
        let hn_fact = model.outlet_fact(hn)?;
        if hn_fact.datum_type != f32::datum_type() || hn_fact.rank() != 3 || hn_fact.shape[2] != h.to_dim() {
            continue;
        }
        let ein = ein.clone();
        let mut plans = Vec::with_capacity(k);
        for i in 0..k {
            let mut m = TypedModel::default();
            let src = m.add_source("hidden", f32::fact([1, 1, h]))?;
            let w = m.add_const("lm_head", stacked.slice(0, i, i + 1)?)?;
            let ins = if hi == 0 { [src, w] } else { [w, src] };
            let out = m.wire_node("logits", ein.clone(), &ins)?;
            m.select_output_outlets(&out)?;
            plans.push(m.into_optimized()?.into_runnable()?);
        }
        let mut outs = model.output_outlets()?.to_vec();
        outs[li] = hn;
        model.select_output_outlets(&outs)?;
        model.compact()?;
        return Ok(Some(Heads { plans, hidden: h, vocab: v }));
    }
    Ok(None)
}

/// Per-session states of [`Heads`]' plans and the input buffer they share.
pub(crate) struct HeadStates {
    states: Vec<TypedSimpleState>,
    input: Arc<Tensor>,
    hidden: usize,
    vocab: usize,
}

impl std::fmt::Debug for HeadStates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeadStates").field("heads", &self.states.len()).finish_non_exhaustive()
    }
}

impl HeadStates {
    /// One state per head.
    ///
    /// # Errors
    /// A tract error when a plan cannot spawn its state.
    pub(crate) fn new(heads: &Heads) -> TractResult<Self> {
        Ok(HeadStates {
            states: heads.plans.iter().map(|p| p.spawn()).collect::<TractResult<_>>()?,
            input: Arc::new(Tensor::zero::<f32>(&[1, 1, heads.hidden])?),
            hidden: heads.hidden,
            vocab: heads.vocab,
        })
    }

    /// Head `k`'s logits `[V]` for the hidden row `hn` `[H]`, appended to `out` (cleared first).
    ///
    /// # Errors
    /// A message when `k` or the row's width is out of range, or tract fails.
    pub(crate) fn run(&mut self, k: usize, hn: &[f32], out: &mut Vec<f32>) -> Result<(), String> {
        let n = self.states.len();
        let state = self.states.get_mut(k).ok_or_else(|| format!("head {k} is out of range (the graph has {n} heads)"))?;
        if hn.len() != self.hidden {
            return Err(format!("hidden row of {} values, the heads take {}", hn.len(), self.hidden));
        }
        let input = Arc::get_mut(&mut self.input).ok_or("the heads' input buffer is still shared after a run")?;
        crate::stack::view_mut::<f32>(input).map_err(|e| e.to_string())?.copy_from_slice(hn);
        let outputs = state.run(tvec!(self.input.clone().into_tvalue())).map_err(|e| format!("{e:#}"))?;
        let lg = crate::stack::view::<f32>(&outputs[0]).map_err(|e| e.to_string())?;
        if lg.len() != self.vocab {
            return Err(format!("head {k} returned {} logits, expected {}", lg.len(), self.vocab));
        }
        out.clear();
        out.extend_from_slice(lg);
        Ok(())
    }
}
