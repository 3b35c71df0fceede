//! The vocoders on tract: the windowed graph (codes `[1, 16, frames]` int64 → PCM
//! `[1, frames × 1920]`) and the stateful stream graph (the chunk's codes plus the carried
//! state → the chunk's PCM plus the next state).

use std::sync::Arc;

use model::backend::{VocoderError, VocoderSession};
use model::frame::{CODEBOOKS, Frame};
use tract_onnx::prelude::*;

use crate::graph::Graph;
use crate::stack::{view, view_mut};

/// A vocoder state for windows of at most `max_window` frames; keeps the last chunk's samples.
pub struct TractVocoder {
    state: TypedSimpleState,
    codes: Arc<Tensor>,
    max_window: usize,
    samples_per_frame: usize,
}

impl std::fmt::Debug for TractVocoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TractVocoder").field("max_window", &self.max_window).finish_non_exhaustive()
    }
}

fn err(e: impl std::fmt::Display) -> VocoderError {
    VocoderError(format!("{e:#}"))
}

impl TractVocoder {
    /// A state of `graph` for windows of at most `max_window` frames of `samples_per_frame`.
    ///
    /// # Errors
    /// [`VocoderError`] when tract cannot spawn the plan.
    pub(crate) fn new(graph: &Graph, max_window: usize, samples_per_frame: usize) -> Result<Self, VocoderError> {
        let state = graph.plan.spawn().map_err(err)?;
        let codes = Arc::new(Tensor::zero::<i64>(&[1, CODEBOOKS, 1]).map_err(err)?);
        Ok(TractVocoder { state, codes, max_window, samples_per_frame })
    }
}

impl VocoderSession for TractVocoder {
    fn decode(&mut self, window: &[Frame], n: usize, out: &mut [f32]) -> Result<(), VocoderError> {
        let t = window.len();
        let spf = self.samples_per_frame;
        if n == 0 || n > t || t > self.max_window || out.len() != n * spf {
            return Err(VocoderError(format!("bad window: {t} frames, chunk {n}, output {} samples", out.len())));
        }
        // exact-size input (tract copies inputs by allocation size): reallocated only when the
        // window length changes, i.e. during the ramp, not in the steady state
        if self.codes.shape() != [1, CODEBOOKS, t] {
            self.codes = Arc::new(Tensor::zero::<i64>(&[1, CODEBOOKS, t]).map_err(err)?);
        }
        let codes = Arc::get_mut(&mut self.codes).ok_or_else(|| VocoderError("codes buffer still shared".into()))?;
        let buf = view_mut::<i64>(codes).map_err(err)?;
        for (f, frame) in window.iter().enumerate() {
            for (q, &c) in frame.iter().enumerate() {
                buf[q * t + f] = i64::from(c);
            }
        }
        let outputs = self.state.run(tvec![self.codes.clone().into_tvalue()]).map_err(err)?;
        let wav = view::<f32>(&outputs[0]).map_err(err)?;
        if wav.len() != t * spf {
            return Err(VocoderError(format!("returned {} samples for {t} frames, expected {}", wav.len(), t * spf)));
        }
        out.copy_from_slice(&wav[(t - n) * spf..]);
        Ok(())
    }

    fn reset(&mut self) {}

    fn form(&self) -> model::backend::VocoderForm {
        model::backend::VocoderForm::Windowed
    }
}

/// Frames per run of the stateful vocoder's one plan: a chunk runs as runs of exactly this many
/// frames. tract picks its faster convolution kernels only for concrete shapes (lazy im2col
/// instead of a materialized one): measured at 0.6B dimensions on one thread of the build
/// machine (`herald bench --profile vocoder --profile-concrete`), 88 ms per frame for 2-frame
/// runs against 140 ms per frame for one symbolic 25-frame run; 2-frame runs were as fast as 8-
/// or 25-frame ones (docs/performance.md "Vocoder (issue 13)"). One plan, because each plan
/// packs its own copy of the weights (467 MB at 0.6B): an odd chunk's last frame runs padded
/// and is decoded again at the start of the next chunk ([`TractStreamVocoder`]).
pub const STREAM_PLAN_FRAMES: [usize; 1] = [2];

/// The all-zero carried state of a stream graph's IO `info`: `(name without "state.", tensor)`
/// for every input after `codes`, in graph order (the start of an utterance).
///
/// # Errors
/// [`VocoderError`] when an input after `codes` is not a `state.*` one, has a symbolic
/// dimension, or is neither float32 nor int64.
pub(crate) fn zero_states(info: &model::manifest::GraphInfo) -> Result<Vec<(String, TValue)>, VocoderError> {
    use model::manifest::Dim;
    info.inputs
        .iter()
        .skip(1)
        .map(|spec| {
            let name = spec
                .name
                .strip_prefix("state.")
                .ok_or_else(|| VocoderError(format!("stream graph input {} is neither codes nor a state.* input", spec.name)))?;
            let shape = spec
                .shape
                .iter()
                .map(|d| match d {
                    Dim::Fixed(n) => usize::try_from(*n).map_err(err),
                    Dim::Symbol(s) => Err(VocoderError(format!("state.{name} has a symbolic dimension {s:?}"))),
                })
                .collect::<Result<Vec<_>, _>>()?;
            let zero = match spec.dtype.as_str() {
                "float32" => Tensor::zero::<f32>(&shape),
                "int64" => Tensor::zero::<i64>(&shape),
                other => return Err(VocoderError(format!("state.{name} is {other}; float32 or int64 expected"))),
            }
            .map_err(err)?;
            Ok((name.to_owned(), zero.into_tvalue()))
        })
        .collect()
}

/// The stateful streaming vocoder on tract (`[vocoder].stream_graph`): codes `[1, 16, p]` plus
/// the carried `state.<name>` tensors → PCM `[1, p × 1920]` plus `next.<name>` (docs/bundle.md
/// "Stateful vocoder"), run as one concrete plan of `p` frames ([`STREAM_PLAN_FRAMES`]).
///
/// A chunk whose frames (with the ones held over, below) are not a multiple of `p` ends with a
/// run padded by repeating its last frame: the stream graph is causal (a frame's samples depend
/// on it and earlier frames only, which is why any split of an utterance decodes exactly), so
/// the real frames' samples of that run are exact and are written out; the state it returns
/// would include the padding, so it is dropped, and the real frames are held over and decoded
/// again, from the state before them, at the start of the next chunk (their samples then
/// skipped). The cost is at most p - 1 frames decoded twice per chunk and the same number of
/// padding frames. With p = 2 and steady 25-frame chunks that is, every other chunk, one frame
/// decoded twice and one padding frame (the chunk after an odd one starts with its held frame
/// and comes out even), against a second plan's packed weights.
///
/// The session owns the state between calls (tract values, swapped for the outputs after each
/// run; no copy) and resets it to zeros per utterance. Buffers are allocated once.
pub struct TractStreamVocoder {
    frames: usize,
    state: TypedSimpleState,
    codes: Arc<Tensor>,
    /// The all-zero state of an utterance's start, one tensor per `state.*` input in graph order.
    zeros: Vec<TValue>,
    /// The state the next chunk starts from.
    carried: Vec<TValue>,
    /// The state at the start of the chunk in progress (restored when a run fails); its
    /// capacity is kept, so saving it allocates nothing.
    before: Vec<TValue>,
    /// The state a padded run advances, then dropped.
    trial: Vec<TValue>,
    /// The frames decoded by a padded run whose state was dropped: decoded again first thing
    /// in the next chunk (their samples are already out). Fewer than `frames`.
    held: Vec<Frame>,
    /// `held` at the start of the chunk in progress (restored when a run fails).
    held_before: Vec<Frame>,
    /// One run's frames (the held ones, the chunk's, the padding).
    run_frames: Vec<Frame>,
    /// One run's samples, `frames × samples_per_frame`.
    run_out: Vec<f32>,
    /// For each graph output, the `carried` slot its `next.*` value goes to (`None`: `wav`).
    slot_of_output: Vec<Option<usize>>,
    max_chunk: usize,
    samples_per_frame: usize,
}

impl std::fmt::Debug for TractStreamVocoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TractStreamVocoder")
            .field("frames_per_run", &self.frames)
            .field("states", &self.zeros.len())
            .field("held", &self.held.len())
            .field("max_chunk", &self.max_chunk)
            .finish_non_exhaustive()
    }
}

impl TractStreamVocoder {
    /// A session of the stream graph's concrete plan `plan` (frames per run, plan; IO `info`)
    /// for chunks of at most `max_chunk` frames of `samples_per_frame` samples.
    ///
    /// # Errors
    /// [`VocoderError`] when the plan runs no frames, the graph's IO is not `codes, state.*` →
    /// `wav, next.*` with a `next.<name>` for every `state.<name>`, a state has a symbolic
    /// dimension or an unsupported dtype (float32, int64), or tract cannot spawn the plan.
    pub(crate) fn new(
        plan: (usize, &Graph),
        info: &model::manifest::GraphInfo,
        max_chunk: usize,
        samples_per_frame: usize,
    ) -> Result<Self, VocoderError> {
        let (frames, graph) = plan;
        if frames == 0 {
            return Err(VocoderError("the stateful vocoder's plan runs no frames".into()));
        }
        if graph.inputs.first().map(String::as_str) != Some("codes") || graph.outputs.first().map(String::as_str) != Some("wav") {
            return Err(VocoderError(format!(
                "stream graph IO must start with input codes and output wav, has {:?} -> {:?}",
                graph.inputs, graph.outputs
            )));
        }
        let mut zeros = Vec::new();
        let mut slot_of_output = vec![None; graph.outputs.len()];
        for (slot, (name, zero)) in zero_states(info)?.into_iter().enumerate() {
            let next = graph
                .output(&format!("next.{name}"))
                .ok_or_else(|| VocoderError(format!("stream graph has input state.{name} but no output next.{name}")))?;
            slot_of_output[next] = Some(slot);
            zeros.push(zero);
        }
        if info.inputs.len() != graph.inputs.len() {
            return Err(VocoderError("stream graph inputs differ from bundle.toml".into()));
        }
        if zeros.is_empty() {
            return Err(VocoderError(
                "the stream graph carries no state (no state.* inputs with next.* outputs): it is not a stateful vocoder graph (is [vocoder].stream_graph the windowed graph?)".into(),
            ));
        }
        Ok(TractStreamVocoder {
            frames,
            state: graph.plan.spawn().map_err(err)?,
            codes: Arc::new(Tensor::zero::<i64>(&[1, CODEBOOKS, frames]).map_err(err)?),
            carried: zeros.clone(),
            before: zeros.clone(),
            trial: zeros.clone(),
            zeros,
            held: Vec::with_capacity(frames),
            held_before: Vec::with_capacity(frames),
            run_frames: Vec::with_capacity(frames),
            run_out: vec![0.0; frames * samples_per_frame],
            slot_of_output,
            max_chunk,
            samples_per_frame,
        })
    }

    /// One run of the plan over `run_frames` (exactly its frame count), writing its samples
    /// into `run_out` and advancing `carried` (a state passed in).
    fn run(&mut self, trial: bool) -> Result<(), VocoderError> {
        let n = self.frames;
        let codes = Arc::get_mut(&mut self.codes).ok_or_else(|| VocoderError("codes buffer still shared".into()))?;
        let buf = view_mut::<i64>(codes).map_err(err)?;
        for (f, frame) in self.run_frames.iter().enumerate() {
            for (q, &c) in frame.iter().enumerate() {
                buf[q * n + f] = i64::from(c);
            }
        }
        let carried = if trial { &mut self.trial } else { &mut self.carried };
        let mut inputs: TVec<TValue> = TVec::with_capacity(1 + carried.len());
        inputs.push(self.codes.clone().into_tvalue());
        inputs.extend(carried.iter().cloned());
        let outputs = self.state.run(inputs).map_err(err)?;
        let wav = view::<f32>(&outputs[0]).map_err(err)?;
        if wav.len() != self.run_out.len() {
            return Err(VocoderError(format!("returned {} samples for {n} frames, expected {}", wav.len(), self.run_out.len())));
        }
        self.run_out.copy_from_slice(wav);
        for (next, slot) in outputs.into_iter().zip(&self.slot_of_output) {
            let Some(slot) = *slot else { continue };
            let zero = &self.zeros[slot];
            if next.shape() != zero.shape() {
                return Err(VocoderError(format!(
                    "stream graph returned a state of shape {:?}, expected {:?}",
                    next.shape(),
                    zero.shape()
                )));
            }
            // tract types integer arithmetic that feeds a shape (the position feeds the RoPE
            // Range) as its symbolic-dimension type, TDim: back to the declared int64
            carried[slot] = if next.datum_type() == zero.datum_type() {
                next
            } else {
                next.cast_to_dt(zero.datum_type()).map_err(err)?.into_owned().into_tvalue()
            };
        }
        Ok(())
    }

    /// [`VocoderSession::decode`]'s runs over the held frames then `window`'s `n`.
    fn decode_runs(&mut self, window: &[Frame], n: usize, out: &mut [f32]) -> Result<(), VocoderError> {
        let (p, spf) = (self.frames, self.samples_per_frame);
        let skip = self.held.len();
        let total = skip + n;
        let frame = |held: &[Frame], j: usize| if j < skip { held[j] } else { window[j - skip] };
        let mut start = 0;
        while start < total {
            let real = p.min(total - start);
            self.run_frames.clear();
            for j in start..start + real {
                let f = frame(&self.held, j);
                self.run_frames.push(f);
            }
            let last = self.run_frames[real - 1];
            self.run_frames.resize(p, last);
            let padded = real < p;
            if padded {
                self.trial.clone_from(&self.carried);
            }
            self.run(padded)?;
            for j in start.max(skip)..start + real {
                let (src, dst) = ((j - start) * spf, (j - skip) * spf);
                out[dst..dst + spf].copy_from_slice(&self.run_out[src..src + spf]);
            }
            if padded {
                // the state stays before these frames: they run again next chunk
                self.held.clear();
                self.held.extend_from_slice(&self.run_frames[..real]);
                return Ok(());
            }
            start += real;
        }
        self.held.clear();
        Ok(())
    }
}

impl VocoderSession for TractStreamVocoder {
    fn decode(&mut self, window: &[Frame], n: usize, out: &mut [f32]) -> Result<(), VocoderError> {
        let spf = self.samples_per_frame;
        if n == 0 || window.len() != n || n > self.max_chunk || out.len() != n * spf {
            return Err(VocoderError(format!(
                "bad chunk for the stateful vocoder: {} frames given, chunk {n} (at most {}), output {} samples",
                window.len(),
                self.max_chunk,
                out.len()
            )));
        }
        // a failed run leaves the state (and the held frames) as they were before the chunk
        self.before.clone_from(&self.carried);
        self.held_before.clone_from(&self.held);
        let r = self.decode_runs(window, n, out);
        if r.is_err() {
            self.carried.clone_from(&self.before);
            self.held.clone_from(&self.held_before);
        }
        r
    }

    fn reset(&mut self) {
        self.carried.clone_from(&self.zeros);
        self.held.clear();
    }

    fn form(&self) -> model::backend::VocoderForm {
        model::backend::VocoderForm::Stateful
    }
}

/// The smallest signal-to-noise ratio, dB, of the half-precision vocoder's samples against the
/// float32 vocoder's on the same codes ([`fp16_gate`]) for herald to use it: the threshold the
/// QNN vocoder binaries (which also compute in fp16) must meet at export (`VOCODER_SNR_DB`,
/// docs/bundle.md). 30 dB is an error power a thousandth of the signal's, below what a listener
/// hears next to the codec's own error (docs/backend.md, "The vocoder in half precision").
pub const FP16_SNR_DB: f64 = 30.0;

/// Frames the half-precision gate decodes, from the all-zero state, in chunks of the plan's
/// frame count: long enough that the carried state (convolution tails, the transformer's
/// cache) takes part in 3 of the 4 runs with the default plan of 2.
pub const FP16_GATE_FRAMES: usize = 8;

/// What [`fp16_gate`] measured: the fp16 vocoder's samples against the float32 one's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fp16Gate {
    /// 10·log10(Σ ref² / Σ (ref − fp16)²) over every sample, dB (infinite when equal).
    pub snr_db: f64,
    /// The largest |ref − fp16| of one sample (samples are in [-1, 1]).
    pub max_abs_error: f32,
    /// The float32 samples' RMS, to read the error against.
    pub rms: f32,
    /// Frames decoded ([`FP16_GATE_FRAMES`]).
    pub frames: usize,
}

impl Fp16Gate {
    /// Whether the gate passes: SNR at least [`FP16_SNR_DB`] (a NaN fails).
    pub fn passed(&self) -> bool {
        self.snr_db >= FP16_SNR_DB
    }
}

impl std::fmt::Display for Fp16Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "samples SNR {:.1} dB ({} {FP16_SNR_DB} dB), max abs error {:.4} on samples of RMS {:.3}, {} frames",
            self.snr_db,
            if self.passed() { ">=" } else { "below" },
            self.max_abs_error,
            self.rms,
            self.frames
        )
    }
}

/// The half-precision gate: decodes [`FP16_GATE_FRAMES`] frames of pseudo-random codes (fixed
/// seed, every code in `0..codebook_size`) through the float32 plan `reference` and the fp16
/// plan `half` of the same stream graph (`info`), both from the all-zero state in chunks of
/// the plans' frame count `frames`, and compares the samples.
///
/// # Errors
/// [`VocoderError`] when either plan cannot run (see [`TractStreamVocoder::new`]).
pub(crate) fn fp16_gate(
    frames: usize,
    reference: &Graph,
    half: &Graph,
    info: &model::manifest::GraphInfo,
    samples_per_frame: usize,
    codebook_size: u32,
) -> Result<Fp16Gate, VocoderError> {
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % u64::from(codebook_size.max(1))) as u32
    };
    let codes: Vec<Frame> = (0..FP16_GATE_FRAMES).map(|_| std::array::from_fn(|_| next())).collect();
    let decode = |g: &Graph| -> Result<Vec<f32>, VocoderError> {
        let mut session = TractStreamVocoder::new((frames, g), info, frames, samples_per_frame)?;
        let mut out = vec![0.0; FP16_GATE_FRAMES * samples_per_frame];
        for (chunk, pcm) in codes.chunks(frames).zip(out.chunks_mut(frames * samples_per_frame)) {
            session.decode(chunk, chunk.len(), &mut pcm[..chunk.len() * samples_per_frame])?;
        }
        Ok(out)
    };
    let (want, got) = (decode(reference)?, decode(half)?);
    Ok(compare(&want, &got, FP16_GATE_FRAMES))
}

/// [`Fp16Gate`]'s numbers for samples `got` against `want` (same length) of `frames` frames.
pub(crate) fn compare(want: &[f32], got: &[f32], frames: usize) -> Fp16Gate {
    let (mut signal, mut noise, mut max) = (0.0f64, 0.0f64, 0.0f32);
    for (&a, &b) in want.iter().zip(got) {
        signal += f64::from(a) * f64::from(a);
        noise += f64::from(a - b) * f64::from(a - b);
        max = if (a - b).abs() > max || (a - b).is_nan() { (a - b).abs() } else { max };
    }
    let snr_db = if noise.is_nan() || signal.is_nan() {
        f64::NAN
    } else if noise == 0.0 {
        f64::INFINITY
    } else {
        10.0 * (signal / noise).log10()
    };
    let rms = (signal / want.len().max(1) as f64).sqrt() as f32;
    Fp16Gate { snr_db, max_abs_error: max, rms, frames }
}
