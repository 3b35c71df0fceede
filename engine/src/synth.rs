//! The generation loop and the windowed vocoder: text in, codec frames and PCM out.
//!
//! [`Decoder`] runs the talker and the code predictor frame by frame, exactly as
//! `tools/export/reference.py` does (its module docstring is the contract): prefill over the
//! prompt, then per frame c0 from the talker through the logits processors, 15 code-predictor
//! sub-steps with a fresh cache (2-position prefill, then 14 steps, head k for codebook k+1), and
//! the next talker input `C(c0) + Σ E_k(c_k) + next trailing text embedding`. [`Vocoder`] decodes
//! windows of frames (left context + chunk) and keeps the last chunk × 1920 samples;
//! [`ChunkSchedule`] decides when a chunk is due.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use tract_onnx::prelude::*;

use crate::graph::{self, Graph, GraphError};
use crate::manifest::{Manifest, ManifestError};
use crate::prompt::{PromptError, PromptLayout, PromptMode, Prompter};
use crate::sampler::{Sampler, SamplerError, SplitMix64};
use crate::stack::{Stack, StepError};
use crate::tables::{Embedding, Tables, TablesError};

/// Codebooks per frame this build handles (the 12 Hz family has 16).
pub const CODEBOOKS: usize = 16;

/// One codec frame: codebook 0 (the talker's c0) then codebooks 1..15.
pub type Frame = [u32; CODEBOOKS];

/// Everything that can go wrong in the engine, by stage. Messages name the file, key or input.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// bundle.toml is unreadable, malformed or unsupported.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// tables.safetensors is unreadable or disagrees with the manifest.
    #[error(transparent)]
    Tables(#[from] TablesError),
    /// A graph is unreadable, disagrees with the manifest, or tract cannot run it.
    #[error(transparent)]
    Graph(#[from] GraphError),
    /// The text or the voice options are not usable.
    #[error(transparent)]
    Prompt(#[from] PromptError),
    /// Sampling failed (non-finite logits, bad parameters).
    #[error(transparent)]
    Sampler(#[from] SamplerError),
    /// A step graph failed.
    #[error(transparent)]
    Step(#[from] StepError),
    /// The vocoder failed or returned the wrong number of samples.
    #[error("vocoder: {0}")]
    Vocoder(String),
    /// The bundle's parts do not fit together (manifest against graphs or tokenizer).
    #[error("{0}")]
    Bundle(String),
    /// The request does not fit the settings (prompt longer than one prefill, bad ramp).
    #[error("{0}")]
    Config(String),
    /// The request was cancelled.
    #[error("cancelled")]
    Cancelled,
}

/// Engine settings that do not come from the bundle.
#[derive(Debug, Clone)]
pub struct EngineSettings {
    /// Talker KV cache capacity in positions (prompt + frames); preallocated per layer.
    pub kv_capacity: usize,
    /// Chunk ramp in frames (default: the bundle's `vocoder.ramp`).
    pub ramp: Option<Vec<usize>>,
    /// Vocoder left context in frames (default: the bundle's `vocoder.left_context_frames`).
    pub left_context: Option<usize>,
    /// CPUs of the decode stage (talker + code predictor): its thread and its matrix-product
    /// threads are pinned there. Empty: unpinned, the process-wide executor.
    pub talker_cpus: Vec<usize>,
    /// CPUs of the vocoder stage, disjoint from `talker_cpus` on a board with more than one.
    /// Empty: unpinned.
    pub vocoder_cpus: Vec<usize>,
    /// Bytes of freed blocks each stage's frame pool may keep ([`crate::pool::FramePool`]):
    /// the decode and the vocoder thread each get one. A stage whose working set fits (and
    /// whose largest block is at most a quarter of it) stays off the heap in the steady state;
    /// 0 turns pooling off.
    pub pool_bytes: usize,
}

/// Default [`EngineSettings::pool_bytes`]: 512 MiB per stage. Measured (docs/engine.md
/// "Allocations"): it holds the whole decode working set at 0.6B (19 MiB) and all but the 45
/// largest of the vocoder's 5,356 blocks per chunk, for 0.24 GB more peak memory than no pool.
pub const DEFAULT_POOL_BYTES: usize = 512 << 20;

impl Default for EngineSettings {
    fn default() -> Self {
        EngineSettings { kv_capacity: 4096, ramp: None, left_context: None, talker_cpus: Vec::new(), vocoder_cpus: Vec::new(), pool_bytes: DEFAULT_POOL_BYTES }
    }
}

/// A loaded bundle: manifest, tables, tokenizer and optimized graphs. Load once, share.
#[derive(Debug)]
pub struct Bundle {
    /// Bundle directory.
    pub dir: PathBuf,
    /// The manifest.
    pub manifest: Manifest,
    /// Memory-mapped embedding tables.
    pub tables: Arc<Tables>,
    /// Tokenizer and prompt layout.
    pub prompter: Arc<Prompter>,
    /// Talker step graph.
    pub talker: Graph,
    /// Code-predictor step graph.
    pub predictor: Graph,
    /// Vocoder graph.
    pub vocoder: Graph,
    /// Seconds from open to ready.
    pub load_seconds: f64,
}

impl Bundle {
    /// Open and validate a bundle directory and load its graphs into tract.
    ///
    /// # Errors
    /// Any [`EngineError`] of the loading stages, naming the file at fault.
    pub fn open(dir: &Path) -> Result<Self, EngineError> {
        let t0 = Instant::now();
        let manifest = Manifest::load(dir)?;
        let tables = Arc::new(Tables::open(dir, &manifest)?);
        let prompter = Arc::new(Prompter::new(dir, &manifest).map_err(|e| EngineError::Bundle(e.to_string()))?);
        let g = |name: &str| -> Result<Graph, EngineError> {
            let info = manifest.graphs.get(name).ok_or_else(|| EngineError::Bundle(format!("bundle.toml has no graph {name:?}")))?;
            Ok(graph::load(dir, name, info)?)
        };
        for (key, stack) in [("talker", &manifest.talker), ("code_predictor", &manifest.code_predictor)] {
            check_caches(dir, &manifest, key, stack)?;
        }
        let talker = g(&manifest.talker.graph)?;
        let predictor = g(&manifest.code_predictor.graph)?;
        let vocoder = g(&manifest.vocoder.graph)?;
        let load_seconds = t0.elapsed().as_secs_f64();
        log::info!(
            "bundle {}: {} {} {} loaded in {:.2} s (talker {:.2} s, predictor {:.2} s, vocoder {:.2} s)",
            dir.display(),
            manifest.model.family,
            manifest.model.size,
            manifest.model.dtype,
            load_seconds,
            talker.load_seconds,
            predictor.load_seconds,
            vocoder.load_seconds
        );
        Ok(Bundle { dir: dir.to_owned(), manifest, tables, prompter, talker, predictor, vocoder, load_seconds })
    }
}

/// Every layer's declared cache inputs must match the manifest's cache kind: a `full` layer takes
/// `[1, past, KV, head_dim]`, a `sliding` one `[1, window - 1, KV, head_dim]`. Checked before any
/// buffer is sized from the manifest, so an absurd window is an error, not an allocation.
fn check_caches(dir: &Path, m: &Manifest, key: &str, stack: &crate::manifest::StackInfo) -> Result<(), EngineError> {
    use crate::manifest::{CacheKind, Dim};
    let file = dir.join("bundle.toml");
    let g = m.graphs.get(&stack.graph).ok_or_else(|| EngineError::Bundle(format!("{}: {key}.graph {:?} is not in [graphs]", file.display(), stack.graph)))?;
    for (i, kind) in stack.cache.iter().enumerate() {
        for kv in ["k", "v"] {
            let name = format!("{kv}_cache_{i}");
            let spec = g.inputs.iter().find(|t| t.name == name).ok_or_else(|| {
                EngineError::Bundle(format!("{}: graph {} has no input {name} for {key}.cache[{i}]", file.display(), stack.graph))
            })?;
            let rows_ok = match (kind, spec.shape.get(1)) {
                (CacheKind::Full, Some(Dim::Symbol(_))) => true,
                (CacheKind::Sliding { window }, Some(Dim::Fixed(r))) => u64::from(*window) == r + 1,
                _ => false,
            };
            let tail = spec.shape.get(2..) == Some(&[Dim::Fixed(u64::from(stack.kv_heads)), Dim::Fixed(u64::from(stack.head_dim))][..]);
            if !rows_ok || !tail || spec.shape.len() != 4 {
                return Err(EngineError::Bundle(format!(
                    "{}: {key}.cache[{i}] is {kind:?} with {} kv heads x {}, but graph input {name} has shape {:?}",
                    file.display(),
                    stack.kv_heads,
                    stack.head_dim,
                    spec.shape
                )));
            }
        }
    }
    Ok(())
}

/// What to say and how.
#[derive(Debug, Clone)]
pub struct Request {
    /// The text (UTF-8; a Rust string cannot hold lone surrogates).
    pub text: String,
    /// Language name from the bundle's `[languages]`, or None / "auto".
    pub language: Option<String>,
    /// Speaker name from the bundle's `[speakers]`.
    pub speaker: Option<String>,
    /// Streaming-text (default) or non-streaming prompt.
    pub mode: PromptMode,
    /// `Some(seed)`: seeded sampling (SplitMix64 contract); `None`: greedy.
    pub seed: Option<u64>,
    /// Override of the runaway frame cap.
    pub max_frames: Option<usize>,
    /// Test hook: force c0 = eos at this frame (that many frames are produced).
    pub force_eos_at: Option<usize>,
}

impl Request {
    /// A greedy, streaming-text request with automatic language and no speaker.
    pub fn new(text: impl Into<String>) -> Self {
        Request { text: text.into(), language: None, speaker: None, mode: PromptMode::Streaming, seed: None, max_frames: None, force_eos_at: None }
    }
}

/// Why the frame loop stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The talker sampled eos.
    Eos,
    /// The test hook forced eos.
    Forced,
    /// The runaway frame cap was reached (logged as a warning).
    Cap,
    /// The KV cache capacity (`synthesis.kv_capacity`) ended the utterance before the text was
    /// spoken: the text is too long for the configured capacity.
    Capacity,
}

/// Where the time of the last frame went.
#[derive(Debug, Clone, Copy, Default)]
pub struct FrameTiming {
    /// The talker decode step that followed the frame (None when the loop ended instead).
    pub talker: Option<std::time::Duration>,
    /// The 15 code-predictor sub-steps, sampling included.
    pub predictor: std::time::Duration,
    /// All sampling of the frame (c1..c15, and the next c0).
    pub sampling: std::time::Duration,
}

/// The frame loop of one utterance: talker, code predictor, sampling, next input.
pub struct Decoder {
    timing: FrameTiming,
    bundle: Arc<Bundle>,
    talker: Stack,
    predictor: Stack,
    sampler: Sampler,
    hidden: usize,
    /// Input rows of the prefill, `[rows, H]`, reused.
    prefill: Vec<f32>,
    /// Next talker input, `[H]`.
    next: Vec<f32>,
    /// Code-predictor input, `[2, H]`.
    cp_in: Vec<f32>,
    /// Talker hidden state of the last position, `[H]`.
    past_hidden: Vec<f32>,
    logits: Vec<f32>,
    history: Vec<u32>,
    trailing: Vec<u32>,
    rng: Option<SplitMix64>,
    /// Talker KV capacity in positions.
    capacity: usize,
    /// The frame cap comes from the KV capacity, not from the text.
    capacity_limited: bool,
    cap: usize,
    force_eos_at: Option<usize>,
    pending_c0: Option<u32>,
    done: Option<StopReason>,
}

impl std::fmt::Debug for Decoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decoder").field("frames", &self.history.len()).field("done", &self.done).finish_non_exhaustive()
    }
}

/// Maximum prompt rows a prefill may carry (the chat wrapping adds about 10 rows to the text).
pub const MAX_PREFILL_ROWS: usize = 2048;

impl Decoder {
    /// Build the decoder's stacks and buffers for `bundle` (allocates the KV caches).
    ///
    /// # Errors
    /// [`EngineError::Step`] when the graphs do not follow the step contract,
    /// [`EngineError::Sampler`] for unusable sampling defaults.
    pub fn new(bundle: Arc<Bundle>, settings: &EngineSettings) -> Result<Self, EngineError> {
        let m = &bundle.manifest;
        let h = m.talker.hidden as usize;
        let cap = settings.kv_capacity.max(16);
        let mask_fill = m.attention.mask_fill;
        let talker = Stack::new("talker", bundle.talker.clone(), &m.talker, h, &m.model.dtype, cap, MAX_PREFILL_ROWS.min(cap), mask_fill)?;
        let predictor = Stack::new("code_predictor", bundle.predictor.clone(), &m.code_predictor, h, &m.model.dtype, CODEBOOKS, 2, mask_fill)?;
        let sampler = Sampler::from_manifest(m)?;
        let vocab = m.codec.vocab_size as usize;
        Ok(Decoder {
            talker,
            predictor,
            sampler,
            hidden: h,
            prefill: Vec::with_capacity(MAX_PREFILL_ROWS * h),
            next: vec![0.0; h],
            cp_in: vec![0.0; 2 * h],
            past_hidden: vec![0.0; h],
            logits: vec![0.0; vocab.max(m.audio.codebook_size as usize)],
            history: Vec::with_capacity(cap),
            trailing: Vec::with_capacity(cap),
            rng: None,
            capacity: cap,
            capacity_limited: false,
            cap: 0,
            force_eos_at: None,
            pending_c0: None,
            done: None,
            timing: FrameTiming::default(),
            bundle,
        })
    }

    /// The talker stack (for tests and stats).
    pub fn talker(&self) -> &Stack {
        &self.talker
    }

    /// Prefill the talker over the prompt of `req` and choose the first c0.
    ///
    /// Returns the prompt layout used. The frame cap is `min(max_new_tokens, 40 + 10 n)` for n
    /// text tokens (the reference's contract), further limited by the KV capacity; `max_frames`
    /// overrides it.
    ///
    /// # Errors
    /// [`EngineError::Prompt`] for unusable text or voice options (nothing has run then);
    /// step or sampling errors.
    pub fn start(&mut self, req: &Request) -> Result<PromptLayout, EngineError> {
        self.talker.clear();
        self.history.clear();
        self.trailing.clear();
        self.done = None;
        self.pending_c0 = None;
        let b = Arc::clone(&self.bundle);
        let lang = req.language.as_deref();
        let layout = b.prompter.layout(&req.text, lang, req.speaker.as_deref(), req.mode)?;
        let rows = layout.rows.len();
        let limit = MAX_PREFILL_ROWS.min(self.capacity);
        if rows > limit {
            return Err(EngineError::Config(format!(
                "the prompt needs {rows} positions, more than the {limit} one prefill can take; split the text"
            )));
        }
        let h = self.hidden;
        self.prefill.clear();
        self.prefill.resize(rows * h, 0.0);
        for (r, row) in layout.rows.iter().enumerate() {
            let out = &mut self.prefill[r * h..(r + 1) * h];
            b.tables.add(Embedding::Text(row.text), out).map_err(|e| EngineError::Bundle(e.to_string()))?;
            if let Some(c) = row.codec {
                b.tables.add(Embedding::Codec(c), out).map_err(|e| EngineError::Bundle(e.to_string()))?;
            }
        }
        self.trailing.extend_from_slice(&layout.trailing);
        let formula = crate::prompt::frame_cap(layout.n_text_tokens(), b.manifest.sampling.talker.max_new_tokens);
        let room = self.capacity.saturating_sub(rows);
        let wanted = req.max_frames.unwrap_or(formula);
        self.cap = wanted.min(room);
        self.capacity_limited = wanted > room;
        self.force_eos_at = req.force_eos_at;
        self.rng = req.seed.map(SplitMix64::new);
        let outputs = self.talker.step(&self.prefill, rows, None)?;
        let logits = self.talker.last_logits(&outputs);
        self.logits[..logits.len()].copy_from_slice(logits);
        if let Some(hd) = self.talker.last_hidden(&outputs) {
            self.past_hidden.copy_from_slice(hd);
        }
        drop(outputs);
        self.choose_c0()?;
        Ok(layout)
    }

    fn choose_c0(&mut self) -> Result<(), EngineError> {
        let vocab = self.bundle.manifest.codec.vocab_size as usize;
        let frame = self.history.len();
        let c0 = if self.force_eos_at == Some(frame) {
            self.done = Some(StopReason::Forced);
            None
        } else if frame >= self.cap {
            self.done = Some(self.cap_reached());
            None
        } else {
            let id = self.sampler.choose_c0(&mut self.logits[..vocab], &self.history, self.rng.as_mut())?;
            if id == self.bundle.manifest.codec.eos {
                self.done = Some(StopReason::Eos);
                None
            } else {
                Some(id)
            }
        };
        self.pending_c0 = c0;
        Ok(())
    }

    fn cap_reached(&self) -> StopReason {
        if self.capacity_limited {
            log::warn!(
                "the KV cache is full after {} frames ({} positions): the rest of the text is not spoken; \
                 raise synthesis.kv_capacity or split the text",
                self.cap,
                self.capacity
            );
            StopReason::Capacity
        } else {
            log::warn!("frame cap of {} frames reached without eos; ending the utterance (runaway guard)", self.cap);
            StopReason::Cap
        }
    }

    /// Why the loop stopped, once it has.
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.done
    }

    /// Produce the next frame, or `None` when the utterance has ended.
    ///
    /// # Errors
    /// Step or sampling errors; the decoder must be restarted with [`Decoder::start`] then.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, EngineError> {
        let Some(c0) = self.pending_c0.take() else { return Ok(None) };
        let b = Arc::clone(&self.bundle);
        let h = self.hidden;
        let map = |e: crate::tables::OutOfRange| EngineError::Bundle(e.to_string());
        // code predictor: fresh cache, 2-position prefill [past_hidden, C(c0)], head 0
        let mut frame: Frame = [0; CODEBOOKS];
        frame[0] = c0;
        self.predictor.clear();
        self.cp_in[..h].copy_from_slice(&self.past_hidden);
        self.cp_in[h..].fill(0.0);
        b.tables.add(Embedding::Codec(c0), &mut self.cp_in[h..]).map_err(map)?;
        let pv = b.manifest.audio.codebook_size as usize;
        let t_pred = Instant::now();
        let mut sampling = std::time::Duration::ZERO;
        for k in 1..CODEBOOKS {
            let outputs = if k == 1 {
                self.predictor.step(&self.cp_in, 2, Some(0))?
            } else {
                self.cp_in[..h].fill(0.0);
                b.tables.add(Embedding::Residual { table: k - 2, code: frame[k - 1] }, &mut self.cp_in[..h]).map_err(map)?;
                self.predictor.step(&self.cp_in[..h], 1, Some((k - 1) as i64))?
            };
            let l = self.predictor.last_logits(&outputs);
            self.logits[..pv].copy_from_slice(l);
            drop(outputs);
            let ts = Instant::now();
            frame[k] = self.sampler.choose_code(&mut self.logits[..pv], self.rng.as_mut())?;
            sampling += ts.elapsed();
        }
        let predictor = t_pred.elapsed();
        let mut talker = None;
        // next talker input: C(c0) + E_1(c1) + ... + E_15(c15) + trailing text (or tts_pad)
        let step = self.history.len();
        self.history.push(c0);
        self.next.fill(0.0);
        b.tables.add(Embedding::Codec(c0), &mut self.next).map_err(map)?;
        for (k, &code) in frame.iter().enumerate().skip(1) {
            b.tables.add(Embedding::Residual { table: k - 1, code }, &mut self.next).map_err(map)?;
        }
        let text = self.trailing.get(step).copied().unwrap_or(b.manifest.text.tts_pad);
        b.tables.add(Embedding::Text(text), &mut self.next).map_err(map)?;
        // decide whether another frame follows before paying for a talker step
        let frame_no = self.history.len();
        if self.force_eos_at == Some(frame_no) {
            self.done = Some(StopReason::Forced);
        } else if frame_no >= self.cap {
            self.done = Some(self.cap_reached());
        } else {
            let tt = Instant::now();
            let outputs = self.talker.step(&self.next, 1, None)?;
            let logits = self.talker.last_logits(&outputs);
            let vocab = logits.len();
            self.logits[..vocab].copy_from_slice(logits);
            if let Some(hd) = self.talker.last_hidden(&outputs) {
                self.past_hidden.copy_from_slice(hd);
            }
            drop(outputs);
            talker = Some(tt.elapsed());
            let ts = Instant::now();
            self.choose_c0()?;
            sampling += ts.elapsed();
        }
        self.timing = FrameTiming { talker, predictor, sampling };
        Ok(Some(frame))
    }

    /// Timing of the last frame.
    pub fn last_timing(&self) -> FrameTiming {
        self.timing
    }

    /// The frame cap of the current utterance.
    pub fn frame_cap(&self) -> usize {
        self.cap
    }

    /// The frames' codebook-0 ids so far.
    pub fn history(&self) -> &[u32] {
        &self.history
    }
}

/// When chunks are due: a ramp of chunk sizes in frames, the last repeated.
#[derive(Debug, Clone)]
pub struct ChunkSchedule {
    ramp: Vec<usize>,
    next: usize,
}

impl ChunkSchedule {
    /// A schedule over `ramp` (sizes in frames, each ≥ 1; the last repeats).
    ///
    /// # Errors
    /// [`EngineError::Config`] for an empty ramp or a zero size.
    pub fn new(ramp: &[usize]) -> Result<Self, EngineError> {
        if ramp.is_empty() || ramp.contains(&0) {
            return Err(EngineError::Config(format!("chunk ramp {ramp:?} must list positive frame counts")));
        }
        Ok(ChunkSchedule { ramp: ramp.to_vec(), next: 0 })
    }

    /// Size of the next chunk in frames.
    pub fn due(&self) -> usize {
        self.ramp[self.next.min(self.ramp.len() - 1)]
    }

    /// Frames to emit now, given `pending` undecoded frames and whether the utterance ended.
    pub fn take(&mut self, pending: usize, finished: bool) -> Option<usize> {
        let due = self.due();
        if pending >= due {
            self.next += 1;
            Some(due)
        } else if finished && pending > 0 {
            self.next += 1;
            Some(pending)
        } else {
            None
        }
    }

    /// The largest chunk the schedule emits.
    pub fn max_chunk(&self) -> usize {
        self.ramp.iter().copied().max().unwrap_or(1)
    }
}

/// The windowed vocoder: decodes `left context + chunk` frames, keeps the chunk's samples.
pub struct Vocoder {
    state: TypedSimpleState,
    codes: Arc<Tensor>,
    window_cap: usize,
    samples_per_frame: usize,
    /// Left context in frames.
    pub left_context: usize,
}

impl std::fmt::Debug for Vocoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocoder").field("left_context", &self.left_context).finish_non_exhaustive()
    }
}

impl Vocoder {
    /// A vocoder state for windows of at most `left_context + max_chunk` frames.
    ///
    /// # Errors
    /// [`EngineError::Vocoder`] when tract cannot spawn the plan.
    pub fn new(bundle: &Bundle, left_context: usize, max_chunk: usize) -> Result<Self, EngineError> {
        let verr = |e: TractError| EngineError::Vocoder(format!("{e:#}"));
        let window_cap = left_context + max_chunk;
        let state = bundle.vocoder.plan.spawn().map_err(verr)?;
        let codes = Arc::new(Tensor::zero::<i64>(&[1, CODEBOOKS, 1]).map_err(verr)?);
        Ok(Vocoder { state, codes, window_cap, samples_per_frame: bundle.manifest.audio.samples_per_frame as usize, left_context })
    }

    /// Decode `window` (context frames then the chunk's `n` frames, oldest first) and write the
    /// chunk's `n × samples_per_frame` samples into `out`.
    ///
    /// # Errors
    /// [`EngineError::Vocoder`] when the window is too long, tract fails, or the graph returns
    /// another number of samples than `window.len() × samples_per_frame`.
    pub fn decode(&mut self, window: &[Frame], n: usize, out: &mut [f32]) -> Result<(), EngineError> {
        let t = window.len();
        let spf = self.samples_per_frame;
        if n == 0 || n > t || t > self.window_cap || out.len() != n * spf {
            return Err(EngineError::Vocoder(format!("bad window: {t} frames, chunk {n}, output {} samples", out.len())));
        }
        // exact-size input (tract copies inputs by allocation size): reallocated only when the
        // window length changes, i.e. during the ramp, not in the steady state
        if self.codes.shape() != [1, CODEBOOKS, t] {
            self.codes = Arc::new(Tensor::zero::<i64>(&[1, CODEBOOKS, t]).map_err(|e| EngineError::Vocoder(format!("{e:#}")))?);
        }
        let codes = Arc::get_mut(&mut self.codes).ok_or_else(|| EngineError::Vocoder("codes buffer still shared".into()))?;
        let buf = crate::stack::view_mut::<i64>(codes).map_err(|e| EngineError::Vocoder(e.to_string()))?;
        for (f, frame) in window.iter().enumerate() {
            for (q, &c) in frame.iter().enumerate() {
                buf[q * t + f] = i64::from(c);
            }
        }
        let outputs = self.state.run(tvec![self.codes.clone().into_tvalue()]).map_err(|e| EngineError::Vocoder(format!("{e:#}")))?;
        let wav = crate::stack::view::<f32>(&outputs[0]).map_err(|e| EngineError::Vocoder(e.to_string()))?;
        if wav.len() != t * spf {
            return Err(EngineError::Vocoder(format!("returned {} samples for {t} frames, expected {}", wav.len(), t * spf)));
        }
        out.copy_from_slice(&wav[(t - n) * spf..]);
        Ok(())
    }
}

/// Generate all frames of `req` synchronously (no threads): for tests and tools.
///
/// # Errors
/// Any [`EngineError`] of the frame loop.
pub fn generate_frames(dec: &mut Decoder, req: &Request) -> Result<(Vec<Frame>, StopReason), EngineError> {
    dec.start(req)?;
    let mut frames = Vec::new();
    while let Some(f) = dec.next_frame()? {
        frames.push(f);
    }
    Ok((frames, dec.stop_reason().unwrap_or(StopReason::Eos)))
}

/// Vocode `frames` with `schedule` and `left_context`, synchronously: exactly
/// `frames.len() × samples_per_frame` samples.
///
/// # Errors
/// [`EngineError::Vocoder`].
pub fn vocode_all(voc: &mut Vocoder, frames: &[Frame], schedule: &mut ChunkSchedule) -> Result<Vec<f32>, EngineError> {
    let spf = voc.samples_per_frame;
    let mut out = vec![0.0f32; frames.len() * spf];
    let mut done = 0;
    while let Some(n) = schedule.take(frames.len() - done, true) {
        let w0 = (done).saturating_sub(voc.left_context);
        voc.decode(&frames[w0..done + n], n, &mut out[done * spf..(done + n) * spf])?;
        done += n;
    }
    Ok(out)
}
