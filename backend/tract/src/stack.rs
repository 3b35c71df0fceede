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
//! grows a full cache, the filled part once ([`KvStats`]).

use std::sync::Arc;

use model::Dtype;
use model::backend::{KvStats, StepError, StepInput, StepOutput, StepSession};
use model::kv::{Ring, Rope, fill_full_masks, slots_for};
use model::manifest::{CacheKind, StackInfo};
use tract_onnx::prelude::*;

use crate::graph::Graph;

/// The backend's name in messages.
const TRACT: &str = "tract";

fn runtime(stack: &str, message: String) -> StepError {
    StepError::Runtime { stack: stack.to_owned(), backend: TRACT, message }
}

#[derive(Debug)]
struct LayerCache {
    /// Sliding layer (a ring of window - 1 slots) rather than full.
    sliding: bool,
    k: Arc<Tensor>,
    v: Arc<Tensor>,
}

/// Where each plan input comes from: the contract's names, shared with every backend.
type Feed = StepInput;

/// A step graph plus its caches and input buffers: one sequence at a time.
pub struct Stack {
    name: String,
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
    /// The ring of the sliding layers (one window for all of them), if any.
    ring: Option<Ring>,
    next_pos: usize,
    rope: Rope,
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
    last: KvStats,
    /// The last step's logits of its last position, `[V]`, copied out of tract's outputs.
    logits: Vec<f32>,
    /// The last step's hidden state of its last position, `[H]` (empty without a `hidden` output).
    hidden: Vec<f32>,
    /// The code predictor's heads when split off the graph ([`crate::heads`]): the `logits`
    /// output is then `hn [1, S, H]` and the logits come from head k's plan.
    heads: Option<crate::heads::HeadStates>,
}

impl std::fmt::Debug for Stack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stack").field("name", &self.name).field("next_pos", &self.next_pos).finish_non_exhaustive()
    }
}

/// `tensor` must be uniquely owned between steps; tract has dropped its references by then.
fn unique<'a>(name: &str, t: &'a mut Arc<Tensor>) -> Result<&'a mut Tensor, StepError> {
    Arc::get_mut(t).ok_or_else(|| runtime(name, "a buffer is still shared after the step".into()))
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
        *t = alloc(dt, shape).map_err(|e| runtime(name, format!("{e:#}")))?;
    }
    unique(name, t)
}

impl Stack {
    /// Build the runner for one stack.
    ///
    /// `capacity` is the number of positions a `full` layer can hold (the longest sequence),
    /// `max_seq` the most positions one step may carry (the longest prefill), `hidden_in` the
    /// width of `x` (the talker hidden size for both stacks), `dtype` the cache dtype,
    /// `mask_fill` the manifest's additive value for hidden keys.
    ///
    /// # Errors
    /// [`StepError::BadInput`] when the graph lacks an input or output the contract needs.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        name: &str,
        graph: Graph,
        info: &StackInfo,
        hidden_in: usize,
        dtype: Dtype,
        capacity: usize,
        max_seq: usize,
        mask_fill: f32,
    ) -> Result<Self, StepError> {
        let bad = |message: String| StepError::BadInput { stack: name.to_owned(), message };
        let terr = |e: TractError| runtime(name, format!("{e:#}"));
        let dt = match dtype {
            Dtype::Fp16 => f16::datum_type(),
            Dtype::Fp32 => f32::datum_type(),
        };
        let kv_heads = info.kv_heads as usize;
        let head_dim = info.head_dim as usize;
        let mut window = None;
        let mut layers = Vec::with_capacity(info.cache.len());
        for kind in &info.cache {
            let (sliding, rows) = match *kind {
                CacheKind::Full => (false, 0),
                CacheKind::Sliding { window: w } => {
                    let w = w as usize;
                    if window.is_some_and(|x| x != w) {
                        return Err(bad("sliding layers with different windows are not supported".into()));
                    }
                    window = Some(w);
                    (true, w - 1)
                }
            };
            layers.push(LayerCache {
                sliding,
                k: alloc(dt, &[1, rows, kv_heads, head_dim]).map_err(terr)?,
                v: alloc(dt, &[1, rows, kv_heads, head_dim]).map_err(terr)?,
            });
        }
        let mut feeds = Vec::new();
        for inp in &graph.inputs {
            let f = Feed::parse(inp, layers.len()).ok_or_else(|| bad(format!("unexpected graph input {inp}")))?;
            feeds.push(f);
        }
        let out = |n: &str| graph.output(n).ok_or_else(|| bad(format!("graph has no output {n}")));
        let out_logits = out("logits")?;
        let out_hidden = graph.output("hidden");
        let out_k = (0..layers.len()).map(|i| out(&format!("k_new_{i}"))).collect::<Result<Vec<_>, _>>()?;
        let out_v = (0..layers.len()).map(|i| out(&format!("v_new_{i}"))).collect::<Result<Vec<_>, _>>()?;
        let d = head_dim;
        let rope = Rope::new(d, info.rope_theta);
        let ring = window.map_or(1, |w| w - 1);
        let f32t = f32::datum_type();
        let state = graph.plan.spawn().map_err(terr)?;
        let heads = graph.heads.as_deref().map(crate::heads::HeadStates::new).transpose().map_err(terr)?;
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
            ring: window.map(Ring::new),
            next_pos: 0,
            rope,
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
            last: KvStats::default(),
            logits: Vec::new(),
            hidden: Vec::new(),
            heads,
        })
    }

    /// Position the next step starts at (= positions held).
    pub fn position(&self) -> usize {
        self.next_pos
    }

    /// Counters of the last successful step.
    pub fn last_stats(&self) -> KvStats {
        self.last
    }

    /// Retire the sequence: empty full caches, every ring slot never-written.
    ///
    /// Buffers are kept (the code predictor clears every frame and must not reallocate), except
    /// full caches grown past 4 × [`model::kv::MIN_SLOTS`], which are released so a short
    /// utterance after a long one does not attend over the long one's slots.
    pub fn clear(&mut self) {
        self.next_pos = 0;
        if let Some(r) = &mut self.ring {
            r.clear();
        }
        let empty = [1, 0, self.kv_heads, self.head_dim];
        for l in &mut self.layers {
            if !l.sliding
                && l.k.shape()[1] > 4 * model::kv::MIN_SLOTS
                && let (Ok(k), Ok(v)) = (alloc(self.dt, &empty), alloc(self.dt, &empty))
            {
                l.k = k;
                l.v = v;
            }
        }
    }

    /// Run one step over `s` new positions starting at [`Stack::position`].
    ///
    /// `x` is `[s, hidden_in]` row-major float32; `head` selects the code predictor's head.
    /// Returns the logits (and hidden state) of the last position, copied out of tract's
    /// outputs. The caches advance by `s` only if every output is valid.
    ///
    /// # Errors
    /// [`StepError`]: wrong input size, capacity exceeded, invalid outputs, tract failure.
    pub fn step(&mut self, x: &[f32], s: usize, head: Option<usize>) -> Result<StepOutput<'_>, StepError> {
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
        let has_full = self.layers.iter().any(|l| !l.sliding);
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
        let outputs = self.state.run(inputs).map_err(|e| runtime(&self.name, format!("{e:#}")))?;
        self.validate(&outputs, s)?;
        // the last position's logits (through its head when the heads were split off the
        // graph) and hidden state, copied so tract's tensors go back now; before the caches
        // move, so a failing head leaves them where they were
        let last = last_row(&outputs[self.out_logits]);
        match &mut self.heads {
            None => {
                self.logits.clear();
                self.logits.extend_from_slice(last);
            }
            Some(h) => {
                let k = head.ok_or_else(|| bad("the code predictor's step needs a head".into()))?;
                h.run(k, last, &mut self.logits).map_err(bad)?;
                if !self.logits.iter().all(|x| x.is_finite()) {
                    return Err(StepError::BadOutput {
                        stack: self.name.clone(),
                        name: "logits".into(),
                        message: "holds non-finite values".into(),
                    });
                }
            }
        }
        let bytes = self.commit(&outputs, s, start)?;
        self.next_pos = start + s;
        self.last = KvStats { bytes_copied: bytes, bytes_regrown: regrown, positions: s, slots: self.last.slots };
        self.hidden.clear();
        if let Some(o) = self.out_hidden {
            self.hidden.extend_from_slice(last_row(&outputs[o]));
        }
        drop(outputs);
        Ok(StepOutput { logits: &self.logits, hidden: self.out_hidden.map(|_| &self.hidden[..]) })
    }

    fn fill_inputs(&mut self, x: &[f32], s: usize, start: usize, head: Option<usize>) -> Result<usize, StepError> {
        let name = self.name.clone();
        let (d, h) = (self.head_dim, self.hidden_in);
        let fill = self.mask_fill;
        let f32t = f32::datum_type();
        fn slice<'a, D: Datum>(name: &str, t: &'a mut Tensor) -> Result<&'a mut [D], StepError> {
            view_mut::<D>(t).map_err(|e| runtime(name, e.to_string()))
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
        // RoPE angles of the step's positions
        ensure(&name, &mut self.cos, f32t, &[1, s, d])?;
        ensure(&name, &mut self.sin, f32t, &[1, s, d])?;
        let (cos, sin) = (unique(&name, &mut self.cos)?, unique(&name, &mut self.sin)?);
        self.rope.fill(start, s, slice::<f32>(&name, cos)?, slice::<f32>(&name, sin)?);
        // full caches: grow (rarely) so the step's entries fit; slots >= start are masked.
        let mut regrown = 0;
        let slots = slots_for(start + s, self.capacity);
        let row = self.kv_heads * self.head_dim;
        for l in &mut self.layers {
            if l.sliding {
                continue;
            }
            for t in [&mut l.k, &mut l.v] {
                let old = t.shape()[1];
                if old < slots {
                    let mut grown = Tensor::zero_dt(self.dt, &[1, slots, self.kv_heads, self.head_dim])
                        .map_err(|e| runtime(&name, format!("{e:#}")))?;
                    let keep = start.min(old) * row * self.dt.size_of();
                    grown.as_bytes_mut()[..keep].copy_from_slice(&t.as_bytes()[..keep]);
                    regrown += keep;
                    *t = Arc::new(grown);
                }
            }
        }
        let full_slots = self.layers.iter().find(|l| !l.sliding).map_or(0, |l| l.k.shape()[1]);
        ensure(&name, &mut self.full_past, f32t, &[1, 1, s, full_slots])?;
        ensure(&name, &mut self.full_new, f32t, &[1, 1, s, s])?;
        let (fp, fnew) = (unique(&name, &mut self.full_past)?, unique(&name, &mut self.full_new)?);
        fill_full_masks(start, s, full_slots, fill, slice::<f32>(&name, fp)?, slice::<f32>(&name, fnew)?);
        // sliding layers: the ring's masks (written slots within the window; causal new block)
        if let Some(ring) = &self.ring {
            let r = ring.len();
            ensure(&name, &mut self.ring_past, f32t, &[1, 1, s, r])?;
            ensure(&name, &mut self.ring_new, f32t, &[1, 1, s, s])?;
            let (rp, rn) = (unique(&name, &mut self.ring_past)?, unique(&name, &mut self.ring_new)?);
            ring.fill_masks(start, s, fill, slice::<f32>(&name, rp)?, slice::<f32>(&name, rn)?);
        }
        // with the heads split off, the graph no longer reads `head` (tract keeps the unused
        // input's tensor between runs), so it is fed unchanged and the head is chosen after
        if let (Some(hd), None) = (head, &self.heads) {
            slice::<i64>(&name, unique(&name, &mut self.head)?)?[0] = hd as i64;
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
                    return Err(bad(
                        format!("{kind}_new_{i}"),
                        format!("is {:?} {:?}, expected {:?} {:?}", t.datum_type(), t.shape(), self.dt, want),
                    ));
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
        let ring = &mut self.ring;
        for (i, l) in self.layers.iter_mut().enumerate() {
            for (t, o) in [(&mut l.k, self.out_k[i]), (&mut l.v, self.out_v[i])] {
                let src = outputs[o].as_bytes();
                let dst = unique(&name, t)?.as_bytes_mut();
                match ring.as_ref().filter(|_| l.sliding) {
                    None => {
                        dst[start * row..(start + s) * row].copy_from_slice(&src[..s * row]);
                        bytes += s * row;
                    }
                    Some(r) => {
                        for j in r.kept(s) {
                            let slot = r.slot(start + j);
                            dst[slot * row..(slot + 1) * row].copy_from_slice(&src[j * row..(j + 1) * row]);
                            bytes += row;
                        }
                    }
                }
            }
        }
        if let Some(r) = ring {
            r.commit(start, s);
        }
        Ok(bytes)
    }
}

impl StepSession for Stack {
    fn position(&self) -> usize {
        Stack::position(self)
    }

    fn clear(&mut self) {
        Stack::clear(self)
    }

    fn step(&mut self, x: &[f32], positions: usize, head: Option<usize>) -> Result<StepOutput<'_>, StepError> {
        Stack::step(self, x, positions, head)
    }

    fn last_stats(&self) -> KvStats {
        Stack::last_stats(self)
    }
}

/// The last row of a `[1, s, w]` float32 output: the last position's values.
fn last_row(t: &Tensor) -> &[f32] {
    let w = t.shape().get(2).copied().unwrap_or(0);
    let all = view::<f32>(t).unwrap_or(&[]);
    &all[all.len().saturating_sub(w)..]
}
