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

/// Frames per run of the stateful vocoder's plans, largest first: a chunk of n frames runs as
/// n / 2 runs of a plan optimized for exactly 2 frames, plus one run of the 1-frame plan when n
/// is odd. The stateful decoder is exact for any split, and tract picks its faster convolution
/// kernels only for concrete shapes (lazy im2col instead of a materialized one): measured at 0.6B
/// dimensions on one thread of the build machine (`herald bench --profile vocoder
/// --profile-concrete`), 88 ms per frame for 2-frame runs against 140 ms per frame for one
/// symbolic 25-frame run; 2-frame runs were as fast as 8- or 25-frame ones with a concrete
/// plan, and 1-frame runs about 25 % slower (docs/performance.md "Vocoder (issue 13)").
pub const STREAM_PLAN_FRAMES: [usize; 2] = [2, 1];

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

/// One concrete plan of the stream graph and its state.
struct StreamPlan {
    frames: usize,
    state: TypedSimpleState,
    codes: Arc<Tensor>,
}

/// The stateful streaming vocoder on tract (`[vocoder].stream_graph`): codes `[1, 16, n]` of the
/// chunk's new frames plus the carried `state.<name>` tensors → PCM `[1, n × 1920]` plus
/// `next.<name>` (docs/bundle.md "Stateful vocoder"), run as plans of fixed frame counts
/// ([`STREAM_PLAN_FRAMES`]).
///
/// The session owns the state between calls (tract values, swapped for the outputs after each
/// run; no copy) and resets it to zeros per utterance. The codes inputs are allocated once per
/// plan.
pub struct TractStreamVocoder {
    plans: Vec<StreamPlan>,
    /// The all-zero state of an utterance's start, one tensor per `state.*` input in graph order.
    zeros: Vec<TValue>,
    /// The state the next chunk starts from.
    carried: Vec<TValue>,
    /// The state at the start of the chunk in progress (restored when a run fails); its
    /// capacity is kept, so saving it allocates nothing.
    before: Vec<TValue>,
    /// For each graph output, the `carried` slot its `next.*` value goes to (`None`: `wav`).
    slot_of_output: Vec<Option<usize>>,
    max_chunk: usize,
    samples_per_frame: usize,
}

impl std::fmt::Debug for TractStreamVocoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TractStreamVocoder")
            .field("plans", &self.plans.iter().map(|p| p.frames).collect::<Vec<_>>())
            .field("states", &self.zeros.len())
            .field("max_chunk", &self.max_chunk)
            .finish_non_exhaustive()
    }
}

impl TractStreamVocoder {
    /// A session of the stream graph's concrete plans `plans` (frames per run, plan; one of
    /// them for 1 frame; IO `info`) for chunks of at most `max_chunk` frames of
    /// `samples_per_frame` samples.
    ///
    /// # Errors
    /// [`VocoderError`] when there is no 1-frame plan, the graph's IO is not `codes, state.*` →
    /// `wav, next.*` with a `next.<name>` for every `state.<name>`, a state has a symbolic
    /// dimension or an unsupported dtype (float32, int64), or tract cannot spawn a plan.
    pub(crate) fn new(
        plans: &[(usize, &Graph)],
        info: &model::manifest::GraphInfo,
        max_chunk: usize,
        samples_per_frame: usize,
    ) -> Result<Self, VocoderError> {
        let graph = plans
            .iter()
            .find(|(n, _)| *n == 1)
            .map(|(_, g)| *g)
            .ok_or_else(|| VocoderError("the stateful vocoder needs a 1-frame plan".into()))?;
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
        let mut ps = plans
            .iter()
            .map(|(n, g)| {
                if g.outputs != graph.outputs || g.inputs != graph.inputs {
                    return Err(VocoderError(format!("the {n}-frame plan has other IO than the 1-frame one")));
                }
                Ok(StreamPlan {
                    frames: *n,
                    state: g.plan.spawn().map_err(err)?,
                    codes: Arc::new(Tensor::zero::<i64>(&[1, CODEBOOKS, *n]).map_err(err)?),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        ps.sort_by_key(|p| std::cmp::Reverse(p.frames));
        let carried = zeros.clone();
        let before = zeros.clone();
        Ok(TractStreamVocoder { plans: ps, zeros, carried, before, slot_of_output, max_chunk, samples_per_frame })
    }

    /// One run of the plan `p` over `frames` (exactly its frame count), writing its samples
    /// into `out` and advancing `carried`.
    fn run(
        p: &mut StreamPlan,
        carried: &mut [TValue],
        zeros: &[TValue],
        slot_of_output: &[Option<usize>],
        frames: &[Frame],
        out: &mut [f32],
    ) -> Result<(), VocoderError> {
        let n = p.frames;
        let codes = Arc::get_mut(&mut p.codes).ok_or_else(|| VocoderError("codes buffer still shared".into()))?;
        let buf = view_mut::<i64>(codes).map_err(err)?;
        for (f, frame) in frames.iter().enumerate() {
            for (q, &c) in frame.iter().enumerate() {
                buf[q * n + f] = i64::from(c);
            }
        }
        let mut inputs: TVec<TValue> = TVec::with_capacity(1 + carried.len());
        inputs.push(p.codes.clone().into_tvalue());
        inputs.extend(carried.iter().cloned());
        let outputs = p.state.run(inputs).map_err(err)?;
        let wav = view::<f32>(&outputs[0]).map_err(err)?;
        if wav.len() != out.len() {
            return Err(VocoderError(format!("returned {} samples for {n} frames, expected {}", wav.len(), out.len())));
        }
        out.copy_from_slice(wav);
        for (next, slot) in outputs.into_iter().zip(slot_of_output) {
            let Some(slot) = *slot else { continue };
            let zero = &zeros[slot];
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
        // a failed run leaves the state as it was before the chunk
        self.before.clone_from(&self.carried);
        let mut done = 0;
        while done < n {
            let Some(p) = self.plans.iter_mut().find(|p| p.frames <= n - done) else {
                return Err(VocoderError("no plan fits the rest of the chunk".into()));
            };
            let k = p.frames;
            let r = Self::run(
                p,
                &mut self.carried,
                &self.zeros,
                &self.slot_of_output,
                &window[done..done + k],
                &mut out[done * spf..(done + k) * spf],
            );
            if let Err(e) = r {
                self.carried.clone_from(&self.before);
                return Err(e);
            }
            done += k;
        }
        Ok(())
    }

    fn reset(&mut self) {
        self.carried.clone_from(&self.zeros);
    }

    fn form(&self) -> model::backend::VocoderForm {
        model::backend::VocoderForm::Stateful
    }
}
