//! Running a step graph (talker or code predictor) with host-owned KV caches.
//!
//! The contract is docs/bundle.md "Step graphs". The host keeps, per layer, a position-major
//! buffer `[1, slots, KV, head_dim]`: for a `full` layer `slots` grows geometrically (the next
//! power of two ≥ the positions needed, at least [`MIN_SLOTS`]) and slots beyond the filled
//! length are masked; for a `sliding` layer it is a ring of window-1 slots, slot = position mod
//! (window-1). Every tensor handed to tract is exactly the size of its allocation (tract
//! deep-copies inputs by allocation size, so a buffer larger than its shape is unsound); buffers
//! are reused from step to step and reallocated only when a shape changes (a cache growing, a
//! prefill). After a step the new entries `k_new_i`/`v_new_i` `[1, S, KV, D]` are validated for
//! every layer (shape, dtype, finiteness) before any slot is written, then copied into their
//! slots in place: per step the host copies exactly the new entries, plus, on the rare step that
//! grows a full cache, the filled part once ([`StepStats`]).

use std::sync::Arc;

use tract_onnx::prelude::*;

use crate::graph::Graph;
use crate::manifest::{CacheKind, StackInfo};

/// Why a step could not run. The cache is unchanged when a step fails.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// The step would start at another position than the cache expects.
    #[error("{stack}: step at position {got}, the cache is at {expected} (stale or repeated step)")]
    Stale {
        /// talker / code_predictor.
        stack: String,
        /// Position the caller asked for.
        got: usize,
        /// Position the cache is at.
        expected: usize,
    },
    /// The sequence would exceed the cache capacity.
    #[error("{stack}: {needed} positions exceed the KV cache capacity of {capacity}")]
    Capacity {
        /// talker / code_predictor.
        stack: String,
        /// Positions the step needs.
        needed: usize,
        /// Configured capacity.
        capacity: usize,
    },
    /// The step's inputs have the wrong size.
    #[error("{stack}: {message}")]
    BadInput {
        /// talker / code_predictor.
        stack: String,
        /// What is wrong.
        message: String,
    },
    /// An output failed validation; nothing was written to the cache.
    #[error("{stack}: output {name} {message}; cache left unchanged")]
    BadOutput {
        /// talker / code_predictor.
        stack: String,
        /// Output name.
        name: String,
        /// What is wrong with it.
        message: String,
    },
    /// tract failed to run the graph.
    #[error("{stack}: tract: {message}")]
    Tract {
        /// talker / code_predictor.
        stack: String,
        /// tract's error chain.
        message: String,
    },
}

/// Smallest number of slots a `full` cache is allocated with.
pub const MIN_SLOTS: usize = 64;

/// Counters of the last step (for tests and stats).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepStats {
    /// Bytes of new entries the host copied into the KV caches.
    pub bytes_copied: usize,
    /// Bytes copied to move filled entries into a grown buffer (0 unless the step grew a cache).
    pub bytes_regrown: usize,
    /// Positions in the step.
    pub positions: usize,
    /// Slots of the full caches during the step (≥ positions held + positions of the step).
    pub slots: usize,
}

#[derive(Debug)]
struct LayerCache {
    /// `None`: full; `Some(w)`: sliding with window w (ring of w - 1 slots).
    window: Option<usize>,
    k: Arc<Tensor>,
    v: Arc<Tensor>,
}

/// Where each plan input comes from.
#[derive(Debug, Clone, Copy)]
enum Feed {
    X,
    Cos,
    Sin,
    FullPast,
    FullNew,
    RingPast,
    RingNew,
    Head,
    K(usize),
    V(usize),
}

/// A step graph plus its caches and input buffers: one sequence at a time.
pub struct Stack {
    name: String,
    graph: Graph,
    state: TypedSimpleState,
    feeds: Vec<Feed>,
    out_logits: usize,
    out_hidden: Option<usize>,
    out_k: Vec<usize>,
    out_v: Vec<usize>,
    layers: Vec<LayerCache>,
    dt: DatumType,
    kv_heads: usize,
    head_dim: usize,
    hidden_in: usize,
    capacity: usize,
    max_seq: usize,
    window: Option<usize>,
    /// Position held by each ring slot (-1: never written); shared by all sliding layers.
    slot_pos: Vec<i64>,
    next_pos: usize,
    inv_freq: Vec<f32>,
    mask_fill: f32,
    x: Arc<Tensor>,
    cos: Arc<Tensor>,
    sin: Arc<Tensor>,
    full_past: Arc<Tensor>,
    full_new: Arc<Tensor>,
    ring_past: Arc<Tensor>,
    ring_new: Arc<Tensor>,
    /// The per-step inputs (x, cos, sin and the four masks) of the last step with another
    /// position count: a prefill and the one-position steps after it, or the code predictor's
    /// 2-position prefill and its 1-position steps, each keep their own buffers instead of
    /// reallocating at every switch.
    spare: [Arc<Tensor>; 7],
    head: Arc<Tensor>,
    last: StepStats,
}

impl std::fmt::Debug for Stack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stack").field("name", &self.name).field("next_pos", &self.next_pos).finish_non_exhaustive()
    }
}

/// `tensor` must be uniquely owned between steps; tract has dropped its references by then.
fn unique<'a>(name: &str, t: &'a mut Arc<Tensor>) -> Result<&'a mut Tensor, StepError> {
    Arc::get_mut(t).ok_or_else(|| StepError::Tract { stack: name.to_owned(), message: "a buffer is still shared after the step".into() })
}

/// A tensor's elements as a slice of `D` (its logical length, not its allocation).
pub(crate) fn view<D: Datum>(t: &Tensor) -> TractResult<&[D]> {
    t.try_as_plain_ram()?.as_slice::<D>()
}

/// A tensor's elements as a mutable slice of `D` (its logical length).
pub(crate) fn view_mut<D: Datum>(t: &mut Tensor) -> TractResult<&mut [D]> {
    if t.datum_type() != D::datum_type() {
        return Err(TractError::msg(format!("tensor is {:?}, not {:?}", t.datum_type(), D::datum_type())));
    }
    // SAFETY: the datum type was checked; the slice covers the tensor's logical length, which
    // never exceeds its allocation (see `reshape`).
    Ok(unsafe { t.as_slice_mut_unchecked::<D>() })
}

fn alloc(dt: DatumType, shape: &[usize]) -> TractResult<Arc<Tensor>> {
    Ok(Arc::new(Tensor::zero_dt(dt, shape)?))
}

/// Make `t` a uniquely owned, exact-size tensor of `shape`, reallocating only when the shape
/// changed. Returns the tensor for writing.
fn ensure<'a>(name: &str, t: &'a mut Arc<Tensor>, dt: DatumType, shape: &[usize]) -> Result<&'a mut Tensor, StepError> {
    if t.shape() != shape || t.datum_type() != dt {
        *t = alloc(dt, shape).map_err(|e| StepError::Tract { stack: name.to_owned(), message: format!("{e:#}") })?;
    }
    unique(name, t)
}

impl Stack {
    /// Build the runner for one stack.
    ///
    /// `capacity` is the number of positions a `full` layer can hold (the longest sequence),
    /// `max_seq` the most positions one step may carry (the longest prefill), `hidden_in` the
    /// width of `x` (the talker hidden size for both stacks), `dtype` the cache dtype (`fp32` or
    /// `fp16`), `mask_fill` the manifest's additive value for hidden keys.
    ///
    /// # Errors
    /// [`StepError::BadInput`] when the graph lacks an input or output the contract needs.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        name: &str,
        graph: Graph,
        info: &StackInfo,
        hidden_in: usize,
        dtype: &str,
        capacity: usize,
        max_seq: usize,
        mask_fill: f32,
    ) -> Result<Self, StepError> {
        let bad = |message: String| StepError::BadInput { stack: name.to_owned(), message };
        let terr = |e: TractError| StepError::Tract { stack: name.to_owned(), message: format!("{e:#}") };
        let dt = if dtype == "fp16" { f16::datum_type() } else { f32::datum_type() };
        let kv_heads = info.kv_heads as usize;
        let head_dim = info.head_dim as usize;
        let mut window = None;
        let mut layers = Vec::with_capacity(info.cache.len());
        for kind in &info.cache {
            let (w, rows) = match *kind {
                CacheKind::Full => (None, 0),
                CacheKind::Sliding { window: w } => {
                    let w = w as usize;
                    if window.is_some_and(|x| x != w) {
                        return Err(bad("sliding layers with different windows are not supported".into()));
                    }
                    window = Some(w);
                    (Some(w), w - 1)
                }
            };
            layers.push(LayerCache {
                window: w,
                k: alloc(dt, &[1, rows, kv_heads, head_dim]).map_err(terr)?,
                v: alloc(dt, &[1, rows, kv_heads, head_dim]).map_err(terr)?,
            });
        }
        let mut feeds = Vec::new();
        for inp in &graph.inputs {
            let f = match inp.as_str() {
                "x" => Feed::X,
                "cos" => Feed::Cos,
                "sin" => Feed::Sin,
                "mask_full_past" => Feed::FullPast,
                "mask_full_new" => Feed::FullNew,
                "mask_sliding_ring" => Feed::RingPast,
                "mask_sliding_new" => Feed::RingNew,
                "head" => Feed::Head,
                other => {
                    let layer = |p: &str| other.strip_prefix(p).and_then(|i| i.parse::<usize>().ok()).filter(|&i| i < layers.len());
                    if let Some(i) = layer("k_cache_") {
                        Feed::K(i)
                    } else if let Some(i) = layer("v_cache_") {
                        Feed::V(i)
                    } else {
                        return Err(bad(format!("unexpected graph input {other}")));
                    }
                }
            };
            feeds.push(f);
        }
        let out = |n: &str| graph.output(n).ok_or_else(|| bad(format!("graph has no output {n}")));
        let out_logits = out("logits")?;
        let out_hidden = graph.output("hidden");
        let out_k = (0..layers.len()).map(|i| out(&format!("k_new_{i}"))).collect::<Result<Vec<_>, _>>()?;
        let out_v = (0..layers.len()).map(|i| out(&format!("v_new_{i}"))).collect::<Result<Vec<_>, _>>()?;
        let d = head_dim;
        let theta = info.rope_theta as f32;
        // inv_freq[j] = 1 / theta^(2j/D), in float32 as transformers computes it.
        let inv_freq = (0..d / 2).map(|j| 1.0f32 / theta.powf((2 * j) as f32 / d as f32)).collect();
        let ring = window.map_or(1, |w| w - 1);
        let f32t = f32::datum_type();
        let state = graph.plan.spawn().map_err(terr)?;
        Ok(Stack {
            name: name.to_owned(),
            state,
            feeds,
            out_logits,
            out_hidden,
            out_k,
            out_v,
            layers,
            dt,
            kv_heads,
            head_dim,
            hidden_in,
            capacity,
            max_seq,
            window,
            slot_pos: vec![-1; window.map_or(0, |w| w - 1)],
            next_pos: 0,
            inv_freq,
            mask_fill,
            x: alloc(f32t, &[1, 1, hidden_in]).map_err(terr)?,
            cos: alloc(f32t, &[1, 1, d]).map_err(terr)?,
            sin: alloc(f32t, &[1, 1, d]).map_err(terr)?,
            full_past: alloc(f32t, &[1, 1, 1, 0]).map_err(terr)?,
            full_new: alloc(f32t, &[1, 1, 1, 1]).map_err(terr)?,
            ring_past: alloc(f32t, &[1, 1, 1, ring]).map_err(terr)?,
            ring_new: alloc(f32t, &[1, 1, 1, 1]).map_err(terr)?,
            spare: [
                alloc(f32t, &[1, 1, hidden_in]).map_err(terr)?,
                alloc(f32t, &[1, 1, d]).map_err(terr)?,
                alloc(f32t, &[1, 1, d]).map_err(terr)?,
                alloc(f32t, &[1, 1, 1, 0]).map_err(terr)?,
                alloc(f32t, &[1, 1, 1, 1]).map_err(terr)?,
                alloc(f32t, &[1, 1, 1, ring]).map_err(terr)?,
                alloc(f32t, &[1, 1, 1, 1]).map_err(terr)?,
            ],
            head: alloc(i64::datum_type(), &[1]).map_err(terr)?,
            graph,
            last: StepStats::default(),
        })
    }

    /// Position the next step starts at (= positions held).
    pub fn position(&self) -> usize {
        self.next_pos
    }

    /// Counters of the last successful step.
    pub fn last_stats(&self) -> StepStats {
        self.last
    }

    /// Retire the sequence: empty full caches, every ring slot never-written.
    ///
    /// Buffers are kept (the code predictor clears every frame and must not reallocate), except
    /// full caches grown past 4 × [`MIN_SLOTS`], which are released so a short utterance after a
    /// long one does not attend over the long one's slots.
    pub fn clear(&mut self) {
        self.next_pos = 0;
        self.slot_pos.iter_mut().for_each(|p| *p = -1);
        let empty = [1, 0, self.kv_heads, self.head_dim];
        for l in &mut self.layers {
            if l.window.is_none()
                && l.k.shape()[1] > 4 * MIN_SLOTS
                && let (Ok(k), Ok(v)) = (alloc(self.dt, &empty), alloc(self.dt, &empty))
            {
                l.k = k;
                l.v = v;
            }
        }
    }

    /// The graph this stack runs.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// Run one step over `s` new positions starting at [`Stack::position`].
    ///
    /// `x` is `[s, hidden_in]` row-major float32; `head` selects the code predictor's head.
    /// Returns tract's outputs (`logits` [1, s, V] float32 first; read them with
    /// [`Stack::logits`] / [`Stack::hidden`]). The caches advance by `s` only if every output
    /// is valid.
    ///
    /// # Errors
    /// [`StepError`]: wrong input size, capacity exceeded, invalid outputs, tract failure.
    pub fn step(&mut self, x: &[f32], s: usize, head: Option<i64>) -> Result<TVec<TValue>, StepError> {
        let name = self.name.clone();
        let bad = |message: String| StepError::BadInput { stack: name.clone(), message };
        if s == 0 || s > self.max_seq || x.len() != s * self.hidden_in {
            return Err(bad(format!(
                "step of {s} positions with {} values (at most {} positions of width {})",
                x.len(),
                self.max_seq,
                self.hidden_in
            )));
        }
        let start = self.next_pos;
        let has_full = self.layers.iter().any(|l| l.window.is_none());
        if has_full && start + s > self.capacity {
            return Err(StepError::Capacity { stack: name, needed: start + s, capacity: self.capacity });
        }
        let regrown = self.fill_inputs(x, s, start, head)?;
        let mut inputs: TVec<TValue> = TVec::with_capacity(self.feeds.len());
        for f in &self.feeds {
            let t = match *f {
                Feed::X => &self.x,
                Feed::Cos => &self.cos,
                Feed::Sin => &self.sin,
                Feed::FullPast => &self.full_past,
                Feed::FullNew => &self.full_new,
                Feed::RingPast => &self.ring_past,
                Feed::RingNew => &self.ring_new,
                Feed::Head => &self.head,
                Feed::K(i) => &self.layers[i].k,
                Feed::V(i) => &self.layers[i].v,
            };
            inputs.push(t.clone().into_tvalue());
        }
        let outputs = self.state.run(inputs).map_err(|e| StepError::Tract { stack: self.name.clone(), message: format!("{e:#}") })?;
        self.validate(&outputs, s)?;
        let bytes = self.commit(&outputs, s, start)?;
        self.next_pos = start + s;
        self.last = StepStats { bytes_copied: bytes, bytes_regrown: regrown, positions: s, slots: self.last.slots };
        Ok(outputs)
    }

    /// The logits of the last position of a step's outputs, `[V]`.
    pub fn last_logits<'a>(&self, outputs: &'a TVec<TValue>) -> &'a [f32] {
        let t = &outputs[self.out_logits];
        let v = t.shape()[2];
        let all = view::<f32>(t).unwrap_or(&[]);
        &all[all.len().saturating_sub(v)..]
    }

    /// All logits of a step, `[s, V]` row-major, and V.
    pub fn logits<'a>(&self, outputs: &'a TVec<TValue>) -> (&'a [f32], usize) {
        let t = &outputs[self.out_logits];
        (view::<f32>(t).unwrap_or(&[]), t.shape()[2])
    }

    /// The post-norm hidden state of the last position (talker only), `[H]`.
    pub fn last_hidden<'a>(&self, outputs: &'a TVec<TValue>) -> Option<&'a [f32]> {
        let t = &outputs[self.out_hidden?];
        let h = t.shape()[2];
        let all = view::<f32>(t).ok()?;
        Some(&all[all.len().saturating_sub(h)..])
    }

    /// Slots of the full caches for a sequence of `needed` positions: the next power of two, at
    /// least [`MIN_SLOTS`] (or the capacity, when smaller: the code predictor's 16).
    fn slots_for(&self, needed: usize) -> usize {
        needed.max(MIN_SLOTS.min(self.capacity)).next_power_of_two()
    }

    fn fill_inputs(&mut self, x: &[f32], s: usize, start: usize, head: Option<i64>) -> Result<usize, StepError> {
        let name = self.name.clone();
        let (d, h) = (self.head_dim, self.hidden_in);
        let fill = self.mask_fill;
        let f32t = f32::datum_type();
        fn slice<'a, D: Datum>(name: &str, t: &'a mut Tensor) -> Result<&'a mut [D], StepError> {
            view_mut::<D>(t).map_err(|e| StepError::Tract { stack: name.to_owned(), message: e.to_string() })
        }
        if self.x.shape()[1] != s {
            let [x, cos, sin, fp, fnew, rp, rn] = &mut self.spare;
            for (cur, other) in [
                (&mut self.x, x),
                (&mut self.cos, cos),
                (&mut self.sin, sin),
                (&mut self.full_past, fp),
                (&mut self.full_new, fnew),
                (&mut self.ring_past, rp),
                (&mut self.ring_new, rn),
            ] {
                std::mem::swap(cur, other);
            }
        }
        let xt = ensure(&name, &mut self.x, f32t, &[1, s, h])?;
        slice::<f32>(&name, xt)?.copy_from_slice(x);
        // RoPE: angle = position * inv_freq (float32), both halves repeated.
        for (t, is_cos) in [(&mut self.cos, true), (&mut self.sin, false)] {
            let buf = slice::<f32>(&name, ensure(&name, t, f32t, &[1, s, d])?)?;
            for r in 0..s {
                let p = (start + r) as f32;
                for (j, f) in self.inv_freq.iter().enumerate() {
                    let a = p * f;
                    let v = if is_cos { a.cos() } else { a.sin() };
                    buf[r * d + j] = v;
                    buf[r * d + j + d / 2] = v;
                }
            }
        }
        // full caches: grow (rarely) so the step's entries fit; slots >= start are masked.
        let mut regrown = 0;
        let slots = self.slots_for(start + s);
        let row = self.kv_heads * self.head_dim;
        for l in &mut self.layers {
            if l.window.is_some() {
                continue;
            }
            for t in [&mut l.k, &mut l.v] {
                let old = t.shape()[1];
                if old < slots {
                    let mut grown = Tensor::zero_dt(self.dt, &[1, slots, self.kv_heads, self.head_dim])
                        .map_err(|e| StepError::Tract { stack: name.clone(), message: format!("{e:#}") })?;
                    let keep = start.min(old) * row * self.dt.size_of();
                    grown.as_bytes_mut()[..keep].copy_from_slice(&t.as_bytes()[..keep]);
                    regrown += keep;
                    *t = Arc::new(grown);
                }
            }
        }
        let full_slots = self.layers.iter().find(|l| l.window.is_none()).map_or(0, |l| l.k.shape()[1]);
        let fp = slice::<f32>(&name, ensure(&name, &mut self.full_past, f32t, &[1, 1, s, full_slots])?)?;
        for q in 0..s {
            for j in 0..full_slots {
                fp[q * full_slots + j] = if j < start { 0.0 } else { fill };
            }
        }
        let fnew = slice::<f32>(&name, ensure(&name, &mut self.full_new, f32t, &[1, 1, s, s])?)?;
        for q in 0..s {
            for k in 0..s {
                fnew[q * s + k] = if k <= q { 0.0 } else { fill };
            }
        }
        // sliding layers: a ring slot is visible when written and within the window; the new
        // block is causal and within the window.
        if let Some(w) = self.window {
            let r = w - 1;
            let rp = slice::<f32>(&name, ensure(&name, &mut self.ring_past, f32t, &[1, 1, s, r])?)?;
            for q in 0..s {
                let qpos = (start + q) as i64;
                for (j, &p) in self.slot_pos.iter().enumerate() {
                    rp[q * r + j] = if p >= 0 && p > qpos - w as i64 { 0.0 } else { fill };
                }
            }
            let rn = slice::<f32>(&name, ensure(&name, &mut self.ring_new, f32t, &[1, 1, s, s])?)?;
            for q in 0..s {
                for k in 0..s {
                    rn[q * s + k] = if k <= q && q - k < w { 0.0 } else { fill };
                }
            }
        }
        if let Some(hd) = head {
            slice::<i64>(&name, unique(&name, &mut self.head)?)?[0] = hd;
        }
        self.last.slots = full_slots;
        Ok(regrown)
    }

    fn validate(&self, outputs: &TVec<TValue>, s: usize) -> Result<(), StepError> {
        let bad = |name: String, message: String| StepError::BadOutput { stack: self.name.clone(), name, message };
        let want = [1, s, self.kv_heads, self.head_dim];
        for (i, (&ko, &vo)) in self.out_k.iter().zip(&self.out_v).enumerate() {
            for (o, kind) in [(ko, "k"), (vo, "v")] {
                let t = &outputs[o];
                if t.shape() != want || t.datum_type() != self.dt {
                    return Err(bad(format!("{kind}_new_{i}"), format!("is {:?} {:?}, expected {:?} {:?}", t.datum_type(), t.shape(), self.dt, want)));
                }
                let finite = if self.dt == f16::datum_type() {
                    view::<f16>(t).map(|v| v.iter().all(|x| x.is_finite())).unwrap_or(false)
                } else {
                    view::<f32>(t).map(|v| v.iter().all(|x| x.is_finite())).unwrap_or(false)
                };
                if !finite {
                    return Err(bad(format!("{kind}_new_{i}"), "holds non-finite values".into()));
                }
            }
        }
        let lg = &outputs[self.out_logits];
        if lg.shape().len() != 3 || lg.shape()[1] != s || lg.datum_type() != f32::datum_type() {
            return Err(bad("logits".into(), format!("has shape {:?}", lg.shape())));
        }
        if !view::<f32>(lg).map(|v| v.iter().all(|x| x.is_finite())).unwrap_or(false) {
            return Err(bad("logits".into(), "holds non-finite values".into()));
        }
        Ok(())
    }

    fn commit(&mut self, outputs: &TVec<TValue>, s: usize, start: usize) -> Result<usize, StepError> {
        let name = self.name.clone();
        let row = self.kv_heads * self.head_dim * self.dt.size_of();
        let mut bytes = 0;
        // ring: a step longer than the ring keeps only its last window-1 positions
        let ring = self.window.map(|w| w - 1);
        for (i, l) in self.layers.iter_mut().enumerate() {
            for (t, o) in [(&mut l.k, self.out_k[i]), (&mut l.v, self.out_v[i])] {
                let src = outputs[o].as_bytes();
                let dst = unique(&name, t)?.as_bytes_mut();
                match l.window {
                    None => {
                        dst[start * row..(start + s) * row].copy_from_slice(&src[..s * row]);
                        bytes += s * row;
                    }
                    Some(_) => {
                        let r = ring.unwrap_or(1);
                        let keep = s.min(r);
                        for j in s - keep..s {
                            let slot = (start + j) % r;
                            dst[slot * row..(slot + 1) * row].copy_from_slice(&src[j * row..(j + 1) * row]);
                            bytes += row;
                        }
                    }
                }
            }
        }
        if let Some(r) = ring {
            let keep = s.min(r);
            for j in s - keep..s {
                self.slot_pos[(start + j) % r] = (start + j) as i64;
            }
        }
        Ok(bytes)
    }
}
