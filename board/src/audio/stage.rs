//! The shaping stage every sink runs first: the utterance protocol, the [`Shaper`] and its
//! output buffer, and the counts a sink reports.

use super::{SampleFormat, Shaper, ShaperSettings, SinkError, SinkStats};

/// The front of every sink: a sink owns one, calls [`begin`](Self::begin),
/// [`process`](Self::process) and [`finish`](Self::finish) from its own `begin`, `write` and
/// `finish`, and converts the shaped samples it gets back to its output format (S16LE bytes, a
/// device's frames, a socket's packets). So a new sink (a network sink, say) gets the gain,
/// the leading and trailing silence, the edge fades, the call-order checks and the sample
/// counts without re-implementing them, and carries the same samples as the WAV and ALSA
/// sinks.
///
/// Call-order errors are [`SinkError::Config`]: "sample rate 0", "write before begin",
/// "finish before begin".
///
/// No allocation in the steady state: the shaped samples go to a buffer the stage reuses.
#[derive(Debug, Clone)]
pub struct ShapingStage {
    shaper: Shaper,
    shaped: Vec<f32>,
    rate: u32,
    open: bool,
    input_samples: u64,
    output_samples: u64,
}

impl ShapingStage {
    /// A stage with these shaper settings; nothing is open until [`begin`](Self::begin).
    pub fn new(settings: ShaperSettings) -> Self {
        Self { shaper: Shaper::new(settings), shaped: Vec::new(), rate: 0, open: false, input_samples: 0, output_samples: 0 }
    }

    /// The shaper settings in use.
    pub fn settings(&self) -> &ShaperSettings {
        self.shaper.settings()
    }

    /// Start an utterance at `sample_rate` Hz (resets the shaper and the counts).
    ///
    /// # Errors
    /// [`SinkError::Config`] for a rate of 0.
    pub fn begin(&mut self, sample_rate: u32) -> Result<(), SinkError> {
        if sample_rate == 0 {
            return Err(SinkError::Config("sample rate 0".into()));
        }
        self.shaper.begin(sample_rate);
        self.rate = sample_rate;
        self.open = true;
        self.input_samples = 0;
        self.output_samples = 0;
        Ok(())
    }

    /// Shape the next chunk; returns the samples that are final (also [`shaped`](Self::shaped)
    /// until the next call). The last few ms stay held back for the fade-out.
    ///
    /// # Errors
    /// [`SinkError::Config`] when no utterance is open.
    pub fn process(&mut self, samples: &[f32]) -> Result<&[f32], SinkError> {
        if !self.open {
            return Err(SinkError::Config("write before begin".into()));
        }
        self.shaped.clear();
        self.shaper.process(samples, &mut self.shaped);
        self.input_samples += samples.len() as u64;
        self.output_samples += self.shaped.len() as u64;
        Ok(&self.shaped)
    }

    /// End the utterance: returns the rest (the held-back samples with the fade-out, then the
    /// trailing silence; the leading silence too if no sample came).
    ///
    /// # Errors
    /// [`SinkError::Config`] when no utterance is open.
    pub fn finish(&mut self) -> Result<&[f32], SinkError> {
        if !self.open {
            return Err(SinkError::Config("finish before begin".into()));
        }
        self.open = false;
        self.shaped.clear();
        self.shaper.finish(&mut self.shaped);
        self.output_samples += self.shaped.len() as u64;
        Ok(&self.shaped)
    }

    /// Abandon the utterance: what is held back is dropped; the next call must be `begin`.
    pub fn abort(&mut self) {
        self.open = false;
    }

    /// The samples the last [`process`](Self::process) or [`finish`](Self::finish) returned.
    pub fn shaped(&self) -> &[f32] {
        &self.shaped
    }

    /// Whether an utterance is open (between `begin` and `finish` or `abort`).
    pub fn is_open(&self) -> bool {
        self.open
    }

    /// The rate of the current (or last) utterance, Hz; 0 before the first `begin`.
    pub fn rate(&self) -> u32 {
        self.rate
    }

    /// Input samples of the current (or last) utterance.
    pub fn input_samples(&self) -> u64 {
        self.input_samples
    }

    /// Shaped samples handed out for the current (or last) utterance (silence included).
    pub fn output_samples(&self) -> u64 {
        self.output_samples
    }

    /// The stats of a sink that writes every shaped sample, mono at the model rate, in
    /// `format` (the file, stream and null sinks; a network sink too, unless it resamples).
    pub fn stats(&self, format: SampleFormat) -> SinkStats {
        SinkStats {
            input_samples: self.input_samples,
            frames_written: self.output_samples,
            xruns: 0,
            device_rate: self.rate,
            channels: 1,
            format,
            period_frames: 0,
            buffer_frames: 0,
            resampled: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stage_is_the_shaper_with_call_order_checks_and_counts() {
        let st = ShaperSettings { gain: 0.7, lead_silence_ms: 2, trail_silence_ms: 3, fade_ms: 4 };
        let x: Vec<f32> = (0..50).map(|i| (i as f32 * 0.3).sin()).collect();
        let mut reference = Shaper::new(st);
        reference.begin(1000);
        let mut want = Vec::new();
        reference.process(&x[..7], &mut want);
        reference.process(&x[7..], &mut want);
        reference.finish(&mut want);

        let mut stage = ShapingStage::new(st);
        assert!(matches!(stage.process(&x), Err(SinkError::Config(m)) if m == "write before begin"));
        assert!(matches!(stage.finish(), Err(SinkError::Config(m)) if m == "finish before begin"));
        assert!(matches!(stage.begin(0), Err(SinkError::Config(m)) if m == "sample rate 0"));
        for _ in 0..2 {
            stage.begin(1000).unwrap();
            let mut got = stage.process(&x[..7]).unwrap().to_vec();
            got.extend_from_slice(stage.process(&x[7..]).unwrap());
            got.extend_from_slice(stage.finish().unwrap());
            assert_eq!(got, want);
            assert!(!stage.is_open());
            let s = stage.stats(SampleFormat::S16);
            assert_eq!((s.input_samples, s.frames_written, s.device_rate, s.channels), (50, 55, 1000, 1));
        }
        stage.begin(1000).unwrap();
        stage.process(&x).unwrap();
        stage.abort();
        assert!(matches!(stage.process(&x), Err(SinkError::Config(_))));
    }
}
