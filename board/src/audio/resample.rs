//! Streaming mono sample-rate conversion (rubato's synchronous FFT resampler) with an exact
//! output length per utterance.

use rubato::audioadapter_buffers::direct::InterleavedSlice;
use rubato::{Fft, FixedSync, Indexing, Resampler};

use super::SinkError;

/// Input frames per resampler call: 20 ms at 24 kHz. The delay of rubato's FFT resampler grows
/// with it, so it stays small; it does not change the output, only how it is batched.
const CHUNK_FRAMES: usize = 480;

/// A streaming mono resampler for one fixed ratio, fed in chunks of any size.
///
/// Wraps `rubato::Fft` (synchronous, fixed input chunk): input is gathered into fixed chunks,
/// so the output does not depend on how the caller splits the input. The resampler's delay
/// ([`rubato::Resampler::output_delay`]) is trimmed from the start, and [`finish`](Self::finish)
/// flushes it with zeros and cuts the output so that an utterance of `n` input samples yields
/// exactly `round(n · out_rate / in_rate)` output samples (half rounds up), aligned with the
/// input (output sample `j` is at time `j / out_rate`, as input sample `i` is at `i / in_rate`).
pub struct StreamResampler {
    inner: Fft<f32>,
    in_rate: u32,
    out_rate: u32,
    /// Input gathered for the next call; always `inner.input_frames_next()` long.
    chunk: Vec<f32>,
    filled: usize,
    /// Output of one call; `inner.output_frames_max()` long.
    scratch: Vec<f32>,
    /// Delay frames still to drop from the start of the output.
    to_trim: usize,
    consumed: u64,
    emitted: u64,
}

impl std::fmt::Debug for StreamResampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamResampler")
            .field("in_rate", &self.in_rate)
            .field("out_rate", &self.out_rate)
            .field("delay", &self.inner.output_delay())
            .finish()
    }
}

impl StreamResampler {
    /// A resampler from `in_rate` to `out_rate` Hz (both > 0).
    ///
    /// Errors: [`SinkError::Resampler`] if rubato rejects the rates.
    pub fn new(in_rate: u32, out_rate: u32) -> Result<Self, SinkError> {
        let inner = Fft::<f32>::new(in_rate as usize, out_rate as usize, CHUNK_FRAMES, 1, FixedSync::Input)
            .map_err(|e| SinkError::Resampler { from: in_rate, to: out_rate, message: e.to_string() })?;
        let chunk = vec![0.0; inner.input_frames_max()];
        let scratch = vec![0.0; inner.output_frames_max()];
        let to_trim = inner.output_delay();
        Ok(Self { inner, in_rate, out_rate, chunk, filled: 0, scratch, to_trim, consumed: 0, emitted: 0 })
    }

    /// Input rate in Hz.
    pub fn in_rate(&self) -> u32 {
        self.in_rate
    }

    /// Output rate in Hz.
    pub fn out_rate(&self) -> u32 {
        self.out_rate
    }

    /// Output length for `n` input samples: `round(n · out_rate / in_rate)`, half up.
    pub fn output_len(&self, n: u64) -> u64 {
        let (i, o) = (u64::from(self.in_rate), u64::from(self.out_rate));
        (n * o + i / 2) / i
    }

    /// Start a new utterance: clears all state (the delay line starts silent again).
    pub fn reset(&mut self) {
        self.inner.reset();
        self.filled = 0;
        self.to_trim = self.inner.output_delay();
        self.consumed = 0;
        self.emitted = 0;
    }

    /// Resample one chunk: appends whatever output is ready to `out` (not cleared).
    pub fn process(&mut self, mut input: &[f32], out: &mut Vec<f32>) -> Result<(), SinkError> {
        self.consumed += input.len() as u64;
        while !input.is_empty() {
            let need = self.inner.input_frames_next();
            let take = (need - self.filled).min(input.len());
            self.chunk[self.filled..self.filled + take].copy_from_slice(&input[..take]);
            self.filled += take;
            input = &input[take..];
            if self.filled == need {
                self.run(None, u64::MAX, out)?;
                self.filled = 0;
            }
        }
        Ok(())
    }

    /// End the utterance: flushes the partial chunk and the delay line, appending exactly the
    /// output still owed so that the utterance's total is [`output_len`](Self::output_len) of
    /// the input count. The resampler is then reset for the next utterance.
    pub fn finish(&mut self, out: &mut Vec<f32>) -> Result<(), SinkError> {
        let target = self.output_len(self.consumed);
        if self.filled > 0 {
            self.run(Some(self.filled), target, out)?;
            self.filled = 0;
        }
        while self.emitted < target {
            self.run(Some(0), target, out)?;
        }
        self.reset();
        Ok(())
    }

    /// One resampler call on `self.chunk` (`partial` valid frames, or all); appends the output
    /// after trimming the delay and capping the utterance total at `cap`.
    fn run(&mut self, partial: Option<usize>, cap: u64, out: &mut Vec<f32>) -> Result<(), SinkError> {
        let (from, to) = (self.in_rate, self.out_rate);
        let err = |m: String| SinkError::Resampler { from, to, message: m };
        let n_in = self.inner.input_frames_next();
        let n_out = self.scratch.len();
        let input = InterleavedSlice::new(&self.chunk[..], 1, n_in).map_err(|e| err(e.to_string()))?;
        let mut output = InterleavedSlice::new_mut(&mut self.scratch[..], 1, n_out).map_err(|e| err(e.to_string()))?;
        let indexing = Indexing { partial_len: partial, ..Indexing::default() };
        let (_, produced) = self.inner.process_into_buffer(&input, &mut output, Some(&indexing)).map_err(|e| err(e.to_string()))?;
        let mut ready = &self.scratch[..produced];
        let trim = self.to_trim.min(ready.len());
        self.to_trim -= trim;
        ready = &ready[trim..];
        let room = (cap - self.emitted).min(ready.len() as u64) as usize;
        out.extend_from_slice(&ready[..room]);
        self.emitted += room as u64;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(r: &mut StreamResampler, input: &[f32], split: &[usize]) -> Vec<f32> {
        let mut out = Vec::new();
        let mut rest = input;
        for &s in split {
            let s = s.min(rest.len());
            r.process(&rest[..s], &mut out).unwrap();
            rest = &rest[s..];
        }
        r.process(rest, &mut out).unwrap();
        r.finish(&mut out).unwrap();
        out
    }

    fn sine(n: usize, freq: f32, rate: f32) -> Vec<f32> {
        (0..n).map(|i| 0.5 * (std::f32::consts::TAU * freq * i as f32 / rate).sin()).collect()
    }

    #[test]
    fn exact_lengths_for_common_device_rates() {
        for (to, n) in [(48000, 1), (48000, 4801), (44100, 1000), (44100, 7), (16000, 3333), (22050, 24000)] {
            let mut r = StreamResampler::new(24000, to).unwrap();
            let input = sine(n, 440.0, 24000.0);
            let out = run(&mut r, &input, &[3, 500, 1]);
            let expect = (n as u64 * to as u64 + 12000) / 24000;
            assert_eq!(out.len() as u64, expect, "24000 -> {to}, n = {n}");
        }
    }

    #[test]
    fn chunking_is_invisible_and_state_resets_between_utterances() {
        let input = sine(5000, 700.0, 24000.0);
        let mut r = StreamResampler::new(24000, 44100).unwrap();
        let a = run(&mut r, &input, &[]);
        let b = run(&mut r, &input, &[1, 2, 479, 480, 481, 1000]);
        assert_eq!(a, b);
    }

    #[test]
    fn doubling_is_aligned_with_the_input() {
        // A band-limited signal upsampled 2x: even output samples sit on the input samples.
        let input = sine(4800, 1000.0, 24000.0);
        let mut r = StreamResampler::new(24000, 48000).unwrap();
        let out = run(&mut r, &input, &[100]);
        assert_eq!(out.len(), 9600);
        let worst = (200..4600).map(|i| (out[2 * i] - input[i]).abs()).fold(0.0f32, f32::max);
        assert!(worst < 1e-3, "misaligned or distorted: worst error {worst}");
    }
}
