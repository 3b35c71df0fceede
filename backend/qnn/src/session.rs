//! A step session on context binaries: static shapes, one position per execution, KV caches
//! kept by the host in the binaries' own I/O buffers.
//!
//! The contract is the step graph's (docs/bundle.md "Step graphs"), at the static sizes the
//! exporter compiled: `seq` = 1 and `past` = the tier's slot count. A step of `s` positions runs
//! `s` executions. The tiers of one stack are binaries of the same graph at growing slot counts
//! (e.g. 256, 1024, 4096 for the talker; 16 for the code predictor); a session starts on the
//! smallest and moves up when the positions held reach its slots, copying the filled part of the
//! `full` caches once (the same move tract's caches make when they double). `sliding` layers are
//! a ring of window − 1 slots in every tier ([`model::kv::Ring`]). Every buffer is allocated
//! when a tier is entered; a steady step allocates nothing.

use std::ffi::{CString, c_void};
use std::sync::Arc;

use half::f16;
use model::backend::{KvStats, StepError, StepInput, StepOutput, StepSession};
use model::kv::{Ring, Rope, fill_full_masks};

use crate::ffi::{DataType, RawTensor, TensorInfo};
use crate::{QNN, Runtime, Tier};

fn runtime(stack: &str, message: String) -> StepError {
    StepError::Runtime { stack: stack.to_owned(), backend: QNN, message }
}

/// Where each graph input comes from: the contract's names, shared with every backend.
type Feed = StepInput;

/// One host buffer in the binary's element type, with what the descriptor needs.
pub(crate) struct Buf {
    pub(crate) info: TensorInfo,
    name: CString,
    dims: Vec<u32>,
    /// u64 storage keeps every element type aligned.
    data: Vec<u64>,
    pub(crate) bytes: usize,
}

impl Buf {
    pub(crate) fn new(info: &TensorInfo) -> Result<Self, String> {
        let size = info.dtype.size().ok_or_else(|| format!("{} has element type {}", info.name, info.dtype.name()))?;
        let bytes = info
            .dims
            .iter()
            .try_fold(size, |acc, &d| acc.checked_mul(d as usize))
            .filter(|&b| b <= u32::MAX as usize)
            .ok_or_else(|| format!("{} of shape {:?} is larger than 4 GiB", info.name, info.dims))?;
        Ok(Buf {
            name: CString::new(info.name.clone()).map_err(|_| format!("tensor name {:?} holds a NUL", info.name))?,
            dims: info.dims.clone(),
            data: vec![0u64; bytes.div_ceil(8)],
            bytes,
            info: info.clone(),
        })
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        // SAFETY: u64 storage viewed as its bytes; `bytes` ≤ 8 × len.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr().cast::<u8>(), self.bytes) }
    }

    pub(crate) fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.data.as_mut_ptr().cast::<u8>(), self.bytes) }
    }

    pub(crate) fn descriptor(&mut self) -> RawTensor {
        let len = self.bytes as u32;
        let data = self.data.as_mut_ptr().cast::<c_void>();
        self.info.descriptor(self.name.as_ptr(), self.dims.as_ptr(), data, len)
    }

    /// Write `values` (float32) at element `at`, converted to the buffer's type.
    pub(crate) fn write_f32(&mut self, at: usize, values: &[f32]) {
        let dtype = self.info.dtype;
        let quant = self.info.quant;
        let b = self.as_bytes_mut();
        match dtype {
            DataType::F32 => {
                for (i, v) in values.iter().enumerate() {
                    b[(at + i) * 4..(at + i + 1) * 4].copy_from_slice(&v.to_ne_bytes());
                }
            }
            DataType::F16 => {
                for (i, v) in values.iter().enumerate() {
                    b[(at + i) * 2..(at + i + 1) * 2].copy_from_slice(&f16::from_f32(*v).to_ne_bytes());
                }
            }
            DataType::U16Fixed | DataType::U8Fixed => {
                let q = quant.unwrap_or(crate::ffi::ScaleOffset { scale: 1.0, offset: 0 });
                let max = if dtype == DataType::U16Fixed { 65535.0 } else { 255.0 };
                for (i, v) in values.iter().enumerate() {
                    let code = ((v / q.scale).round() - q.offset as f32).clamp(0.0, max);
                    if dtype == DataType::U16Fixed {
                        b[(at + i) * 2..(at + i + 1) * 2].copy_from_slice(&(code as u16).to_ne_bytes());
                    } else {
                        b[at + i] = code as u8;
                    }
                }
            }
            // other element types were refused when the binary was checked
            _ => {}
        }
    }

    /// Elements `[at, at + out.len())` as float32.
    pub(crate) fn read_f32(&self, at: usize, out: &mut [f32]) {
        let b = self.as_bytes();
        let q = self.info.quant.unwrap_or(crate::ffi::ScaleOffset { scale: 1.0, offset: 0 });
        for (i, o) in out.iter_mut().enumerate() {
            let k = at + i;
            *o = match self.info.dtype {
                DataType::F32 => f32::from_ne_bytes([b[k * 4], b[k * 4 + 1], b[k * 4 + 2], b[k * 4 + 3]]),
                DataType::F16 => f16::from_ne_bytes([b[k * 2], b[k * 2 + 1]]).to_f32(),
                DataType::U16Fixed => (f32::from(u16::from_ne_bytes([b[k * 2], b[k * 2 + 1]])) + q.offset as f32) * q.scale,
                DataType::U8Fixed => (f32::from(b[k]) + q.offset as f32) * q.scale,
                _ => f32::NAN,
            };
        }
    }

    /// Whether every element is finite (floating types; fixed point always is).
    pub(crate) fn all_finite(&self) -> bool {
        let b = self.as_bytes();
        match self.info.dtype {
            DataType::F32 => b.chunks_exact(4).all(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]).is_finite()),
            DataType::F16 => b.chunks_exact(2).all(|c| f16::from_ne_bytes([c[0], c[1]]).is_finite()),
            _ => true,
        }
    }
}

/// The buffers of one tier: every input and output of its binary.
struct TierIo {
    tier: usize,
    inputs: Vec<Buf>,
    outputs: Vec<Buf>,
    in_desc: Vec<RawTensor>,
    out_desc: Vec<RawTensor>,
}

impl TierIo {
    fn new(tier: usize, t: &Tier) -> Result<Self, String> {
        let mut inputs = t.info.inputs.iter().map(Buf::new).collect::<Result<Vec<_>, _>>()?;
        let mut outputs = t.info.outputs.iter().map(Buf::new).collect::<Result<Vec<_>, _>>()?;
        // descriptors point into the buffers; the Vecs never reallocate after this
        let in_desc = inputs.iter_mut().map(Buf::descriptor).collect();
        let out_desc = outputs.iter_mut().map(Buf::descriptor).collect();
        Ok(TierIo { tier, inputs, outputs, in_desc, out_desc })
    }
}

/// A step graph's tiers plus the host-side state of one sequence.
pub struct QnnStack {
    name: String,
    runtime: Arc<Runtime>,
    tiers: Vec<Arc<Tier>>,
    io: Option<TierIo>,
    /// Input index per feed, output indices of logits, hidden, k_new_i and v_new_i.
    feeds: Vec<Feed>,
    out_logits: usize,
    out_hidden: Option<usize>,
    out_k: Vec<usize>,
    out_v: Vec<usize>,
    sliding: Vec<bool>,
    ring: Option<Ring>,
    rope: Rope,
    mask_fill: f32,
    hidden_in: usize,

    capacity: usize,
    max_seq: usize,
    /// Heads the code predictor has (`lm_heads`, else num_codebooks - 1); the talker has one.
    heads: usize,
    next_pos: usize,
    last: KvStats,
    // scratch, sized once
    cos: Vec<f32>,
    sin: Vec<f32>,
    past: Vec<f32>,
    new: Vec<f32>,
    ring_past: Vec<f32>,
    ring_new: Vec<f32>,
    logits: Vec<f32>,
    hidden: Vec<f32>,
    /// The sliding layers' buffers before a multi-position step, to undo it if it fails.
    ring_undo: Vec<Vec<u8>>,
}

impl std::fmt::Debug for QnnStack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QnnStack").field("name", &self.name).field("next_pos", &self.next_pos).finish_non_exhaustive()
    }
}

impl QnnStack {
    /// A session over `tiers` (one stack's binaries, ascending slots, already checked against
    /// the manifest by [`crate::Qnn`]).
    ///
    /// # Errors
    /// [`StepError::BadInput`] when the binaries lack an input or output the contract needs.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        name: &str,
        runtime: Arc<Runtime>,
        tiers: Vec<Arc<Tier>>,
        info: &model::manifest::StackInfo,
        hidden_in: usize,
        capacity: usize,
        max_seq: usize,
        mask_fill: f32,
    ) -> Result<Self, StepError> {
        let bad = |message: String| StepError::BadInput { stack: name.to_owned(), message };
        let first = tiers.first().ok_or_else(|| bad("no context binary for this stack".into()))?.clone();
        let layers = info.cache.len();
        let mut window = None;
        let mut sliding = Vec::with_capacity(layers);
        for kind in &info.cache {
            match *kind {
                model::manifest::CacheKind::Full => sliding.push(false),
                model::manifest::CacheKind::Sliding { window: w } => {
                    if window.is_some_and(|x| x != w) {
                        return Err(bad("sliding layers with different windows are not supported".into()));
                    }
                    window = Some(w);
                    sliding.push(true);
                }
            }
        }
        let mut feeds = Vec::new();
        for t in &first.info.inputs {
            let f = Feed::parse(&t.name, layers).ok_or_else(|| bad(format!("unexpected binary input {}", t.name)))?;
            feeds.push(f);
        }
        let ring_len = window.map_or(0, |w| w as usize - 1);
        for t in &tiers {
            check_tier(t, &first, info, hidden_in, ring_len, &sliding).map_err(|m| bad(format!("{}: {m}", t.file)))?;
        }
        let out = |n: &str| first.info.outputs.iter().position(|t| t.name == n);
        let need = |n: &str| out(n).ok_or_else(|| bad(format!("binary has no output {n}")));
        let out_logits = need("logits")?;
        let out_hidden = out("hidden");
        let out_k = (0..layers).map(|i| need(&format!("k_new_{i}"))).collect::<Result<Vec<_>, _>>()?;
        let out_v = (0..layers).map(|i| need(&format!("v_new_{i}"))).collect::<Result<Vec<_>, _>>()?;
        for i in 0..layers {
            if !feeds.contains(&Feed::K(i)) || !feeds.contains(&Feed::V(i)) {
                return Err(bad(format!("binary lacks the caches of layer {i}")));
            }
        }
        let head_dim = info.head_dim as usize;
        let max_slots = tiers.iter().map(|t| t.slots).max().unwrap_or(0);
        let vocab = first.info.outputs[out_logits].elements();
        Ok(QnnStack {
            name: name.to_owned(),
            runtime,
            tiers,
            io: None,
            feeds,
            out_logits,
            out_hidden,
            out_k,
            out_v,
            sliding,
            ring: window.map(|w| Ring::new(w as usize)),
            rope: Rope::new(head_dim, info.rope_theta),
            mask_fill,
            hidden_in,
            capacity: capacity.min(max_slots),
            max_seq,
            heads: info.lm_heads.map_or(usize::MAX, |h| h as usize),
            next_pos: 0,
            last: KvStats::default(),
            cos: vec![0.0; head_dim],
            sin: vec![0.0; head_dim],
            past: vec![0.0; max_slots],
            new: vec![0.0; 1],
            ring_past: vec![0.0; ring_len],
            ring_new: vec![0.0; 1],
            logits: Vec::with_capacity(vocab),
            hidden: Vec::with_capacity(hidden_in),
            ring_undo: Vec::new(),
        })
    }

    /// The smallest tier holding `positions`.
    fn tier_for(&self, positions: usize) -> Option<usize> {
        self.tiers.iter().position(|t| t.slots >= positions)
    }

    /// Make tier `want` current, moving the filled part of the caches (the first `held`
    /// positions of every full layer, the whole ring of every sliding one) into it. Returns the
    /// bytes moved.
    fn enter(&mut self, want: usize, held: usize) -> Result<usize, StepError> {
        if self.io.as_ref().is_some_and(|io| io.tier == want) {
            return Ok(0);
        }
        let mut io = TierIo::new(want, &self.tiers[want]).map_err(|m| runtime(&self.name, m))?;
        let mut moved = 0;
        if let Some(old) = self.io.take() {
            for (i, f) in self.feeds.iter().enumerate() {
                let layer = match *f {
                    Feed::K(l) | Feed::V(l) => l,
                    _ => continue,
                };
                let src = old.inputs[i].as_bytes();
                let dst = io.inputs[i].as_bytes_mut();
                let n = if self.sliding[layer] {
                    src.len().min(dst.len())
                } else {
                    (held * src.len() / old.inputs[i].dims[1] as usize).min(dst.len())
                };
                dst[..n].copy_from_slice(&src[..n]);
                moved += n;
            }
        }
        self.io = Some(io);
        Ok(moved)
    }

    fn execute_one(&mut self, x: &[f32], pos: usize, head: Option<usize>) -> Result<(), StepError> {
        let name = self.name.clone();
        let fill = self.mask_fill;
        let Some(io) = self.io.as_mut() else {
            return Err(runtime(&name, "no tier entered".into()));
        };
        let slots = self.tiers[io.tier].slots;
        self.rope.fill(pos, 1, &mut self.cos, &mut self.sin);
        fill_full_masks(pos, 1, slots, fill, &mut self.past[..slots], &mut self.new);
        if let Some(r) = &self.ring {
            r.fill_masks(pos, 1, fill, &mut self.ring_past, &mut self.ring_new);
        }
        for (i, f) in self.feeds.iter().enumerate() {
            let b = &mut io.inputs[i];
            match *f {
                Feed::X => b.write_f32(0, x),
                Feed::Cos => b.write_f32(0, &self.cos),
                Feed::Sin => b.write_f32(0, &self.sin),
                Feed::FullPast => b.write_f32(0, &self.past[..slots]),
                Feed::FullNew => b.write_f32(0, &self.new),
                Feed::RingPast => b.write_f32(0, &self.ring_past),
                Feed::RingNew => b.write_f32(0, &self.ring_new),
                Feed::Head => {
                    let h = head.unwrap_or(0);
                    match b.info.dtype {
                        DataType::I64 => b.as_bytes_mut()[..8].copy_from_slice(&(h as i64).to_ne_bytes()),
                        _ => b.as_bytes_mut()[..4].copy_from_slice(&(h as i32).to_ne_bytes()),
                    }
                }
                Feed::K(_) | Feed::V(_) => {}
            }
        }
        let tier = &self.tiers[io.tier];
        {
            let _guard = tier.lock.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: the descriptors point at this TierIo's buffers, sized from the binary's own
            // tensor info; the graph belongs to `self.runtime`, alive while this session is; the
            // tier's lock keeps other sessions off this graph during the call.
            unsafe { self.runtime.htp.execute(tier.graph, &io.in_desc, &mut io.out_desc) }
                .map_err(|e| runtime(&name, e.to_string()))?;
        }
        // validate every output before any cache slot is written
        let bad =
            |out: &str, message: &str| StepError::BadOutput { stack: name.clone(), name: out.to_owned(), message: message.to_owned() };
        for &o in self.out_k.iter().chain(&self.out_v).chain(std::iter::once(&self.out_logits)) {
            if !io.outputs[o].all_finite() {
                return Err(bad(&io.outputs[o].info.name, "holds non-finite values"));
            }
        }
        Ok(())
    }

    /// Copy the executed position's new keys and values into their slots.
    fn commit_one(&mut self, pos: usize) -> usize {
        let Some(io) = self.io.as_mut() else { return 0 };
        let mut bytes = 0;
        for (i, f) in self.feeds.iter().enumerate() {
            let (layer, out) = match *f {
                Feed::K(l) => (l, self.out_k[l]),
                Feed::V(l) => (l, self.out_v[l]),
                _ => continue,
            };
            let slot = match (&self.ring, self.sliding[layer]) {
                (Some(r), true) => r.slot(pos),
                _ => pos,
            };
            let row = io.outputs[out].bytes;
            let src: &[u8] = &io.outputs[out].as_bytes()[..row];
            // inputs and outputs are separate Vecs: no aliasing
            let dst = io.inputs[i].as_bytes_mut();
            dst[slot * row..(slot + 1) * row].copy_from_slice(src);
            bytes += row;
        }
        if let Some(r) = &mut self.ring {
            r.commit(pos, 1);
        }
        bytes
    }

    fn step_inner(&mut self, x: &[f32], s: usize, head: Option<usize>) -> Result<StepOutput<'_>, StepError> {
        let name = self.name.clone();
        if s == 0 || s > self.max_seq || x.len() != s * self.hidden_in {
            return Err(StepError::BadInput {
                stack: name,
                message: format!(
                    "step of {s} positions with {} values (at most {} positions of width {})",
                    x.len(),
                    self.max_seq,
                    self.hidden_in
                ),
            });
        }
        if let Some(h) = head
            && h >= self.heads
        {
            return Err(StepError::BadInput {
                stack: name,
                message: format!("head {h} does not exist (the stack has {})", self.heads),
            });
        }
        let start = self.next_pos;
        let has_full = self.sliding.iter().any(|s| !s);
        let need = if has_full { start + s } else { 1 };
        let tier = match self.tier_for(need) {
            Some(t) if !has_full || need <= self.capacity => t,
            _ => return Err(StepError::Capacity { stack: name, needed: start + s, capacity: self.capacity }),
        };
        let regrown = self.enter(tier, start)?;
        // a multi-position step may overwrite ring slots that earlier positions still see:
        // keep them to undo a failure
        let ring_saved = if s > 1 { self.ring.clone() } else { None };
        if s > 1
            && self.ring.is_some()
            && let Some(io) = &self.io
        {
            self.ring_undo.clear();
            for (i, f) in self.feeds.iter().enumerate() {
                if let Feed::K(l) | Feed::V(l) = *f
                    && self.sliding[l]
                {
                    self.ring_undo.push(io.inputs[i].as_bytes().to_vec());
                }
            }
        }
        let mut bytes = 0;
        for j in 0..s {
            let row = &x[j * self.hidden_in..(j + 1) * self.hidden_in];
            if let Err(e) = self.execute_one(row, start + j, head) {
                self.undo(start, ring_saved, s > 1);
                return Err(e);
            }
            bytes += self.commit_one(start + j);
        }
        self.next_pos = start + s;
        let slots = self.io.as_ref().map_or(0, |io| self.tiers[io.tier].slots);
        self.last = KvStats { bytes_copied: bytes, bytes_regrown: regrown, positions: s, slots };
        let Some(io) = self.io.as_ref() else {
            return Err(runtime(&self.name, "no tier entered".into()));
        };
        let lg = &io.outputs[self.out_logits];
        self.logits.resize(lg.info.elements(), 0.0);
        lg.read_f32(0, &mut self.logits);
        if let Some(h) = self.out_hidden {
            let hb = &io.outputs[h];
            self.hidden.resize(hb.info.elements(), 0.0);
            hb.read_f32(0, &mut self.hidden);
        }
        Ok(StepOutput { logits: &self.logits, hidden: self.out_hidden.map(|_| &self.hidden[..]) })
    }

    /// Put the session back where a failed step found it.
    fn undo(&mut self, start: usize, ring: Option<Ring>, restore_ring_slots: bool) {
        self.next_pos = start;
        // a one-position step fails before it commits: its ring is untouched
        if ring.is_some() {
            self.ring = ring;
        }
        if restore_ring_slots && let Some(io) = self.io.as_mut() {
            let mut saved = self.ring_undo.iter();
            for (i, f) in self.feeds.iter().enumerate() {
                if let Feed::K(l) | Feed::V(l) = *f
                    && self.sliding[l]
                    && let Some(b) = saved.next()
                {
                    io.inputs[i].as_bytes_mut().copy_from_slice(b);
                }
            }
        }
    }
}

impl StepSession for QnnStack {
    fn position(&self) -> usize {
        self.next_pos
    }

    fn clear(&mut self) {
        self.next_pos = 0;
        if let Some(r) = &mut self.ring {
            r.clear();
        }
        // a session that moved up a tier goes back to the smallest on its next step, so a
        // short utterance after a long one neither holds nor attends over the big tier's slots
        if self.io.as_ref().is_some_and(|io| io.tier > 0) {
            self.io = None;
        }
    }

    fn step(&mut self, x: &[f32], positions: usize, head: Option<usize>) -> Result<StepOutput<'_>, StepError> {
        self.step_inner(x, positions, head)
    }

    fn last_stats(&self) -> KvStats {
        self.last
    }
}

impl QnnStack {
    /// Slots of the current tier (0 before the first step).
    pub fn slots(&self) -> usize {
        self.io.as_ref().map_or(0, |io| self.tiers[io.tier].slots)
    }
}

/// Check one tier's tensors against the stack's sizes and the first tier's order (the feeds are
/// computed once, from the first tier): a binary that passed the manifest check but disagrees
/// with the stack's own dimensions is refused here instead of indexing out of a buffer later.
fn check_tier(
    t: &Tier,
    first: &Tier,
    info: &model::manifest::StackInfo,
    hidden_in: usize,
    ring_len: usize,
    sliding: &[bool],
) -> Result<(), String> {
    let names = |v: &[TensorInfo]| v.iter().map(|t| t.name.clone()).collect::<Vec<_>>();
    if names(&t.info.inputs) != names(&first.info.inputs) || names(&t.info.outputs) != names(&first.info.outputs) {
        return Err(format!("inputs or outputs in another order than {}'s", first.file));
    }
    let (kv, d, slots) = (info.kv_heads as usize, info.head_dim as usize, t.slots);
    for x in t.info.inputs.iter().chain(&t.info.outputs) {
        let dims: Vec<usize> = x.dims.iter().map(|&v| v as usize).collect();
        let layer = |p: &str| x.name.strip_prefix(p).and_then(|i| i.parse::<usize>().ok());
        let want: Option<Vec<usize>> = match x.name.as_str() {
            "x" | "hidden" => Some(vec![1, 1, hidden_in]),
            "cos" | "sin" => Some(vec![1, 1, d]),
            "mask_full_past" => Some(vec![1, 1, 1, slots]),
            "mask_full_new" | "mask_sliding_new" => Some(vec![1, 1, 1, 1]),
            "mask_sliding_ring" => Some(vec![1, 1, 1, ring_len]),
            "head" => (x.elements() == 0).then(|| vec![1]),
            "logits" => (x.elements() == 0 || dims.len() != 3).then(|| vec![1, 1, 0]),
            n if n.starts_with("k_new_") || n.starts_with("v_new_") => Some(vec![1, 1, kv, d]),
            _ => match layer("k_cache_").or_else(|| layer("v_cache_")) {
                Some(l) if sliding.get(l) == Some(&true) => Some(vec![1, ring_len, kv, d]),
                Some(_) => Some(vec![1, slots, kv, d]),
                None => None,
            },
        };
        if let Some(w) = want
            && w != dims
        {
            return Err(format!("{} has shape {dims:?}; the stack's sizes need {w:?}", x.name));
        }
    }
    Ok(())
}
