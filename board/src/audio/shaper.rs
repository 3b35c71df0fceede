//! Utterance shaping shared by every sink: gain, leading/trailing silence and edge fades.

/// Settings of the [`Shaper`]. All durations are in milliseconds and are converted to samples at
/// the utterance's sample rate (rounded to the nearest sample, half up).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShaperSettings {
    /// Linear gain applied to every sample (1.0 = unchanged, 0.5 ≈ −6 dB). The result is not
    /// clamped here; sinks clamp to [-1, 1] when they convert to the output format.
    pub gain: f32,
    /// Silence emitted before the first sample of each utterance, in ms (amplifier wake-up,
    /// USB speakers that clip the start). Not faded; it is digital zero.
    pub lead_silence_ms: u32,
    /// Silence emitted after the last sample of each utterance, in ms.
    pub trail_silence_ms: u32,
    /// Length of the fade-in at the start and the fade-out at the end of the utterance's own
    /// samples, in ms (0 = no fade). Default 5 ms. The shape is a raised cosine (half a Hann
    /// window), see [`fade_weight`].
    pub fade_ms: u32,
}

impl Default for ShaperSettings {
    /// Gain 1, no added silence, 5 ms raised-cosine fades.
    fn default() -> Self {
        Self { gain: 1.0, lead_silence_ms: 0, trail_silence_ms: 0, fade_ms: 5 }
    }
}

impl ShaperSettings {
    /// Settings that pass samples through unchanged (gain 1, no silence, no fades).
    pub fn passthrough() -> Self {
        Self { gain: 1.0, lead_silence_ms: 0, trail_silence_ms: 0, fade_ms: 0 }
    }
}

/// Convert a duration in ms to samples at `sample_rate` Hz, rounding half up.
pub fn ms_to_samples(ms: u32, sample_rate: u32) -> usize {
    ((u64::from(ms) * u64::from(sample_rate) + 500) / 1000) as usize
}

/// Weight of the sample `k` samples away from an utterance edge, for a fade of `len` samples.
///
/// Raised cosine: `w(k) = 0.5 · (1 − cos(π · k / len))` for `k < len`, and 1 from `k = len` on.
/// So the edge sample itself (`k = 0`) is exactly 0, `w(len/2) = 0.5`, and the curve meets 1 with
/// zero slope, which avoids both the click of a step and the corner of a linear ramp. The
/// fade-in uses `k` = index from the first sample; the fade-out uses `k` = index counted back
/// from the last sample (the last sample has `k = 0`).
pub fn fade_weight(k: usize, len: usize) -> f32 {
    if k >= len {
        1.0
    } else {
        let x = std::f64::consts::PI * k as f64 / len as f64;
        (0.5 * (1.0 - x.cos())) as f32
    }
}

/// Per-utterance pre-processing that every sink applies before its own output conversion, so
/// that a WAV file and ALSA playback of the same input carry the same samples.
///
/// Per utterance: `begin(rate)`, any number of `process(chunk, out)`, then `finish(out)`. The
/// output is `lead` zeros, the input × gain with a fade-in over its first `fade` samples and a
/// fade-out over its last `fade` samples, then `trail` zeros: exactly `lead + n + trail`
/// samples for `n` input samples. Because the fade-out needs to know where the input ends,
/// the last `fade` samples are held back until `finish`. When `n < 2·fade` the two fades
/// overlap and both weights apply (their product).
///
/// No allocation in the steady state: the hold-back buffer is sized at `begin`, and output is
/// appended to a caller-owned `Vec` whose capacity the caller reuses.
#[derive(Debug, Clone)]
pub struct Shaper {
    settings: ShaperSettings,
    lead: usize,
    trail: usize,
    fade: usize,
    /// Lead silence still to emit before the first input sample.
    lead_pending: bool,
    /// Input samples seen so far in this utterance (position of the next input sample).
    pos: usize,
    /// The most recent `min(pos, fade)` input samples (raw, before gain), not yet emitted.
    held: Vec<f32>,
}

impl Shaper {
    /// A shaper with these settings; call [`Shaper::begin`] before each utterance.
    pub fn new(settings: ShaperSettings) -> Self {
        Self { settings, lead: 0, trail: 0, fade: 0, lead_pending: false, pos: 0, held: Vec::new() }
    }

    /// The settings this shaper was built with.
    pub fn settings(&self) -> &ShaperSettings {
        &self.settings
    }

    /// Fade length in samples at the current utterance's rate (0 before the first `begin`).
    pub fn fade_samples(&self) -> usize {
        self.fade
    }

    /// Number of output samples an utterance of `n` input samples produces at the current rate.
    pub fn output_len(&self, n: usize) -> usize {
        self.lead + n + self.trail
    }

    /// Start an utterance at `sample_rate` Hz: converts the ms settings to samples and resets
    /// the state. Emits nothing yet (the leading silence comes out with the first `process` or
    /// with `finish`).
    pub fn begin(&mut self, sample_rate: u32) {
        self.lead = ms_to_samples(self.settings.lead_silence_ms, sample_rate);
        self.trail = ms_to_samples(self.settings.trail_silence_ms, sample_rate);
        self.fade = ms_to_samples(self.settings.fade_ms, sample_rate);
        self.lead_pending = true;
        self.pos = 0;
        self.held.clear();
        self.held.reserve(self.fade);
    }

    fn emit_lead(&mut self, out: &mut Vec<f32>) {
        if self.lead_pending {
            self.lead_pending = false;
            out.resize(out.len() + self.lead, 0.0);
        }
    }

    /// Shape one chunk of input (mono, any length): appends the samples that are final to
    /// `out` (which is not cleared). Up to `fade` of the most recent samples stay held back.
    pub fn process(&mut self, input: &[f32], out: &mut Vec<f32>) {
        self.emit_lead(out);
        let gain = self.settings.gain;
        let fade = self.fade;
        if fade == 0 {
            out.extend(input.iter().map(|&x| x * gain));
            self.pos += input.len();
            return;
        }
        let total = self.held.len() + input.len();
        let emit = total.saturating_sub(fade);
        // Position (from the utterance start) of the first held sample.
        let first = self.pos - self.held.len();
        let from_held = emit.min(self.held.len());
        for (i, &x) in self.held[..from_held].iter().enumerate() {
            out.push(x * gain * fade_weight(first + i, fade));
        }
        let from_input = emit - from_held;
        for (i, &x) in input[..from_input].iter().enumerate() {
            out.push(x * gain * fade_weight(first + from_held + i, fade));
        }
        // Keep the last `min(total, fade)` samples.
        self.held.drain(..from_held);
        self.held.extend_from_slice(&input[from_input..]);
        self.pos += input.len();
    }

    /// End the utterance: appends the held-back samples with the fade-out applied, then the
    /// trailing silence. Emits the leading silence too if no input came at all.
    pub fn finish(&mut self, out: &mut Vec<f32>) {
        self.emit_lead(out);
        let gain = self.settings.gain;
        let fade = self.fade;
        let m = self.held.len();
        let first = self.pos - m;
        for (j, &x) in self.held.iter().enumerate() {
            let w = fade_weight(first + j, fade) * fade_weight(m - 1 - j, fade);
            out.push(x * gain * w);
        }
        self.held.clear();
        out.resize(out.len() + self.trail, 0.0);
        // A later `process` without `begin` must not emit the lead again.
        self.lead_pending = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(settings: ShaperSettings, rate: u32, chunks: &[&[f32]]) -> Vec<f32> {
        let mut s = Shaper::new(settings);
        s.begin(rate);
        let mut out = Vec::new();
        for c in chunks {
            s.process(c, &mut out);
        }
        s.finish(&mut out);
        out
    }

    #[test]
    fn fade_weights_by_hand() {
        // len 4: 0.5·(1 − cos(πk/4)) for k = 0..3: 0, 0.1464466, 0.5, 0.8535534; then 1.
        let expect = [0.0, 0.146_446_6, 0.5, 0.853_553_4, 1.0, 1.0];
        for (k, e) in expect.iter().enumerate() {
            assert!((fade_weight(k, 4) - e).abs() < 1e-6, "k={k}: {}", fade_weight(k, 4));
        }
        assert_eq!(fade_weight(0, 0), 1.0);
    }

    #[test]
    fn gain_silence_and_fades_at_the_edges() {
        // 1000 Hz: 3 ms lead = 3 samples, 2 ms trail = 2 samples, 4 ms fade = 4 samples.
        let st = ShaperSettings { gain: 0.5, lead_silence_ms: 3, trail_silence_ms: 2, fade_ms: 4 };
        let input = [1.0f32; 12];
        let out = shape(st, 1000, &[&input[..5], &input[5..6], &input[6..]]);
        assert_eq!(out.len(), 3 + 12 + 2);
        let w = [0.0, 0.146_446_6, 0.5, 0.853_553_4];
        let mut expect = vec![0.0f32; 3];
        expect.extend(w.iter().map(|x| 0.5 * x));
        expect.extend([0.5; 4]);
        expect.extend(w.iter().rev().map(|x| 0.5 * x));
        expect.extend([0.0; 2]);
        for (i, (a, b)) in out.iter().zip(&expect).enumerate() {
            assert!((a - b).abs() < 1e-6, "sample {i}: {a} vs {b}");
        }
    }

    #[test]
    fn chunking_does_not_change_the_output() {
        let st = ShaperSettings { gain: 0.8, lead_silence_ms: 1, trail_silence_ms: 1, fade_ms: 5 };
        let input: Vec<f32> = (0..1000).map(|i| ((i as f32) * 0.01).sin()).collect();
        let whole = shape(st, 8000, &[&input]);
        let pieces = shape(st, 8000, &[&input[..1], &input[1..7], &input[7..40], &input[40..41], &input[41..]]);
        assert_eq!(whole, pieces);
        assert_eq!(whole.len(), 8 + 1000 + 8);
    }

    #[test]
    fn short_input_gets_overlapping_fades() {
        let st = ShaperSettings { gain: 1.0, lead_silence_ms: 0, trail_silence_ms: 0, fade_ms: 4 };
        let out = shape(st, 1000, &[&[1.0, 1.0, 1.0]]);
        // k_in = 0,1,2 and k_out = 2,1,0.
        let e = [0.0, fade_weight(1, 4) * fade_weight(1, 4), 0.0];
        assert_eq!(out.len(), 3);
        for (a, b) in out.iter().zip(e) {
            assert!((a - b).abs() < 1e-7);
        }
    }

    #[test]
    fn empty_utterance_is_lead_plus_trail() {
        let st = ShaperSettings { gain: 1.0, lead_silence_ms: 2, trail_silence_ms: 3, fade_ms: 5 };
        assert_eq!(shape(st, 1000, &[]), vec![0.0; 5]);
    }

    #[test]
    fn passthrough_is_identity_and_rounding_of_ms() {
        let input = [0.25f32, -1.5, 0.0, 0.75];
        assert_eq!(shape(ShaperSettings::passthrough(), 24000, &[&input]), input.to_vec());
        assert_eq!(ms_to_samples(5, 24000), 120);
        assert_eq!(ms_to_samples(5, 22050), 110); // 110.25
        assert_eq!(ms_to_samples(1, 22500), 23); // 22.5 rounds up
    }

    #[test]
    fn steady_state_does_not_reallocate() {
        let mut s = Shaper::new(ShaperSettings::default());
        s.begin(24000);
        let input = vec![0.1f32; 1920];
        let mut out = Vec::with_capacity(4096);
        s.process(&input, &mut out);
        let (cap_held, cap_out) = (s.held.capacity(), out.capacity());
        for _ in 0..50 {
            out.clear();
            s.process(&input, &mut out);
        }
        assert_eq!((s.held.capacity(), out.capacity()), (cap_held, cap_out));
    }
}
