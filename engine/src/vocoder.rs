//! The vocoder driver: chunks of frames through the backend's vocoder session, either windowed
//! (left context + chunk, keeping the chunk's samples) or stateful (the chunk alone, the
//! decoder's state carried by the session).

use model::backend::{VocoderForm, VocoderSession};
use model::frame::Frame;
use model::schedule::ChunkSchedule;

use crate::bundle::Bundle;
use crate::error::EngineError;

/// The vocoder: windowed (decodes `left context + chunk` frames, keeps the chunk's samples) or
/// stateful (decodes the chunk, carrying state; left context 0).
pub struct Vocoder {
    session: Box<dyn VocoderSession>,
    samples_per_frame: usize,
    /// Left context in frames (0 for the stateful vocoder).
    pub left_context: usize,
}

impl std::fmt::Debug for Vocoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocoder").field("left_context", &self.left_context).finish_non_exhaustive()
    }
}

impl Vocoder {
    /// A vocoder in the bundle's loaded form for chunks of at most `max_chunk` frames; a
    /// windowed one decodes windows of `left_context + max_chunk` frames, a stateful one ignores
    /// `left_context`.
    ///
    /// # Errors
    /// [`EngineError::Vocoder`] when the backend cannot prepare its session.
    pub fn new(bundle: &Bundle, left_context: usize, max_chunk: usize) -> Result<Self, EngineError> {
        let left_context = match bundle.vocoder_form {
            VocoderForm::Windowed => left_context,
            VocoderForm::Stateful => 0,
        };
        let session = bundle.graphs.vocoder_session(left_context + max_chunk)?;
        Ok(Vocoder { session, samples_per_frame: bundle.manifest.audio.samples_per_frame as usize, left_context })
    }

    /// The form the session decodes in.
    pub fn form(&self) -> VocoderForm {
        self.session.form()
    }

    /// Start a new utterance (a stateful session forgets its carried state).
    pub fn reset(&mut self) {
        self.session.reset();
    }

    /// PCM samples per frame (1920 for the 12 Hz models).
    pub fn samples_per_frame(&self) -> usize {
        self.samples_per_frame
    }

    /// Decode `window` (context frames then the chunk's `n` frames, oldest first; stateful: the
    /// chunk's `n` frames only) and write the chunk's `n × samples_per_frame` samples into `out`.
    ///
    /// # Errors
    /// [`EngineError::Vocoder`] when the window is too long, the backend fails, or the graph
    /// returns another number of samples than `window.len() × samples_per_frame`.
    pub fn decode(&mut self, window: &[Frame], n: usize, out: &mut [f32]) -> Result<(), EngineError> {
        Ok(self.session.decode(window, n, out)?)
    }
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
    voc.reset();
    while let Some(n) = schedule.take(frames.len() - done, true) {
        let w0 = done.saturating_sub(voc.left_context);
        voc.decode(&frames[w0..done + n], n, &mut out[done * spf..(done + n) * spf])?;
        done += n;
    }
    Ok(out)
}
