//! The windowed vocoder on tract: codes `[1, 16, frames]` int64 → PCM `[1, frames × 1920]`.

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
}
