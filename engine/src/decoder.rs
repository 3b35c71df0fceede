//! The frame loop: text in, codec frames out.
//!
//! [`Decoder`] runs the talker and the code predictor frame by frame, exactly as
//! `tools/export/reference.py` does (its module docstring is the contract): prefill over the
//! prompt, then per frame c0 from the talker through the logits processors, 15 code-predictor
//! sub-steps with a fresh cache (2-position prefill, then 14 steps, head k for codebook k+1), and
//! the next talker input `C(c0) + Σ E_k(c_k) + next trailing text embedding`. The step graphs
//! run behind [`model::backend::StepSession`], so the loop is the same on every backend.

use std::sync::Arc;
use std::time::Instant;

use model::backend::{StackRole, StepSession, StepSpec};
use model::frame::{CODEBOOKS, Frame};
use model::prompt::PromptLayout;
use model::sampler::{Sampler, SplitMix64};

use crate::bundle::Bundle;
use crate::error::EngineError;
use crate::settings::{EngineSettings, Request, StopReason};
use crate::tables::{Embedding, OutOfRange};

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
    talker: Box<dyn StepSession>,
    predictor: Box<dyn StepSession>,
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
        let talker = bundle.graphs.step_session(&StepSpec {
            role: StackRole::Talker,
            capacity: cap,
            max_seq: MAX_PREFILL_ROWS.min(cap),
            hidden_in: h,
        })?;
        let predictor =
            bundle.graphs.step_session(&StepSpec { role: StackRole::CodePredictor, capacity: CODEBOOKS, max_seq: 2, hidden_in: h })?;
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

    /// The talker's step session (for tests and stats).
    pub fn talker(&self) -> &dyn StepSession {
        &*self.talker
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
        let formula = model::prompt::frame_cap(layout.n_text_tokens(), b.manifest.sampling.talker.max_new_tokens);
        let room = self.capacity.saturating_sub(rows);
        let wanted = req.max_frames.unwrap_or(formula);
        self.cap = wanted.min(room);
        self.capacity_limited = wanted > room;
        self.force_eos_at = req.force_eos_at;
        self.rng = req.seed.map(SplitMix64::new);
        let out = self.talker.step(&self.prefill, rows, None)?;
        self.logits[..out.logits.len()].copy_from_slice(out.logits);
        if let Some(hd) = out.hidden {
            self.past_hidden.copy_from_slice(hd);
        }
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
        let map = |e: OutOfRange| EngineError::Bundle(e.to_string());
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
            let out = if k == 1 {
                self.predictor.step(&self.cp_in, 2, Some(0))?
            } else {
                self.cp_in[..h].fill(0.0);
                b.tables.add(Embedding::Residual { table: k - 2, code: frame[k - 1] }, &mut self.cp_in[..h]).map_err(map)?;
                self.predictor.step(&self.cp_in[..h], 1, Some(k - 1))?
            };
            self.logits[..pv].copy_from_slice(out.logits);
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
            let out = self.talker.step(&self.next, 1, None)?;
            self.logits[..out.logits.len()].copy_from_slice(out.logits);
            if let Some(hd) = out.hidden {
                self.past_hidden.copy_from_slice(hd);
            }
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
