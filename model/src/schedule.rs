//! The chunk schedule: when the vocoder stage decodes a chunk, and how many frames it holds.
//!
//! A ramp of chunk sizes in frames, the last size repeated. The windowed vocoder's default ramp
//! is `[2, 4, 8, 16, 25]` (small first chunks for a short time to first audio, then larger ones
//! that amortize the left context each window decodes again); the stateful vocoder's is
//! [`STATEFUL_RAMP`] (docs/engine.md).

use crate::backend::VocoderForm;

/// The stateful vocoder's default ramp: chunks of 2 frames throughout.
///
/// The stateful vocoder decodes each frame once, whatever the chunk, so a large steady chunk
/// saves nothing: it only leaves the vocoder idle while the chunk's frames are decoded and
/// then makes the end of an utterance wait for the whole last chunk. Its cost per frame is the
/// same or lower for small chunks (at 0.6B q4, one thread of the build machine: 75.5 ms per
/// frame in chunks of 2, 84.8 in chunks of 25; `herald bench --profile vocoder
/// --profile-frames N`). 2 is its one plan's length (an odd chunk costs a padded extra frame).
/// Measured with `herald speak` (60 frames, docs/performance.md): RTF 1.03 and no playback
/// stall with `[2]`, against 1.44 and 3.6 s of stalls with `[2, 4, 8, 16, 25]`.
pub const STATEFUL_RAMP: [usize; 1] = [2];

/// The ramp to use when none is configured: [`STATEFUL_RAMP`] for the stateful vocoder,
/// `bundle_ramp` (the bundle's `vocoder.ramp`) for the windowed one.
pub fn default_ramp(form: VocoderForm, bundle_ramp: &[usize]) -> Vec<usize> {
    match form {
        VocoderForm::Stateful => STATEFUL_RAMP.to_vec(),
        VocoderForm::Windowed => bundle_ramp.to_vec(),
    }
}

/// A ramp that cannot be used: empty, or listing a zero.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("chunk ramp {0:?} must list positive frame counts")]
pub struct BadRamp(pub Vec<usize>);

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
    /// [`BadRamp`] for an empty ramp or a zero size.
    pub fn new(ramp: &[usize]) -> Result<Self, BadRamp> {
        if ramp.is_empty() || ramp.contains(&0) {
            return Err(BadRamp(ramp.to_vec()));
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

    /// Start over at the first size of the ramp (a new utterance).
    pub fn restart(&mut self) {
        self.next = 0;
    }

    /// The ramp, frames.
    pub fn ramp(&self) -> &[usize] {
        &self.ramp
    }

    /// The largest chunk the schedule emits.
    pub fn max_chunk(&self) -> usize {
        self.ramp.iter().copied().max().unwrap_or(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ramp_then_repeat_then_the_tail() {
        let mut s = ChunkSchedule::new(&[2, 4]).unwrap();
        assert_eq!(s.take(1, false), None);
        assert_eq!(s.take(2, false), Some(2));
        assert_eq!(s.take(3, false), None);
        assert_eq!(s.take(4, false), Some(4));
        assert_eq!(s.take(5, false), Some(4));
        assert_eq!(s.take(3, true), Some(3));
        assert_eq!(s.take(0, true), None);
        s.restart();
        assert_eq!(s.due(), 2);
        assert_eq!(s.max_chunk(), 4);
    }

    #[test]
    fn an_empty_or_zero_ramp_is_refused_by_value() {
        assert_eq!(ChunkSchedule::new(&[]).unwrap_err().to_string(), "chunk ramp [] must list positive frame counts");
        assert!(ChunkSchedule::new(&[2, 0]).is_err());
    }
}
