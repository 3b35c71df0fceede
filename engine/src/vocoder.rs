//! The vocoder driver: windows of frames (left context + chunk) through the backend's vocoder,
//! keeping the chunk's samples.

use model::backend::VocoderSession;
use model::frame::Frame;
use model::schedule::ChunkSchedule;

use crate::bundle::Bundle;
use crate::error::EngineError;

/// The windowed vocoder: decodes `left context + chunk` frames, keeps the chunk's samples.
pub struct Vocoder {
    session: Box<dyn VocoderSession>,
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
    /// A vocoder for windows of at most `left_context + max_chunk` frames.
    ///
    /// # Errors
    /// [`EngineError::Vocoder`] when the backend cannot prepare its session.
    pub fn new(bundle: &Bundle, left_context: usize, max_chunk: usize) -> Result<Self, EngineError> {
        let session = bundle.graphs.vocoder_session(left_context + max_chunk)?;
        Ok(Vocoder { session, samples_per_frame: bundle.manifest.audio.samples_per_frame as usize, left_context })
    }

    /// PCM samples per frame (1920 for the 12 Hz models).
    pub fn samples_per_frame(&self) -> usize {
        self.samples_per_frame
    }

    /// Decode `window` (context frames then the chunk's `n` frames, oldest first) and write the
    /// chunk's `n × samples_per_frame` samples into `out`.
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
    while let Some(n) = schedule.take(frames.len() - done, true) {
        let w0 = done.saturating_sub(voc.left_context);
        voc.decode(&frames[w0..done + n], n, &mut out[done * spf..(done + n) * spf])?;
        done += n;
    }
    Ok(out)
}
