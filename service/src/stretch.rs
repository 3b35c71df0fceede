//! Speaking speed (issue 39): HTTP `speed`, `herald speak --speed`, `synthesis.speed`, as a
//! pitch-preserving time stretch of the model's PCM, chunk by chunk as it is made.
//!
//! The stretch is WSOLA (waveform-similarity overlap-add) from the `wsola` crate: 15 ms hops of a
//! 30 ms Hann window, each placed where its waveform best continues the last within ±12 ms, so
//! the pitch stays and there is no click where two pieces join. Streaming gives the same samples
//! as stretching the whole utterance at once (the crate waits for the full search range before
//! each hop), so herald's chunk borders are not audible either. It holds back about 45 ms of
//! audio (a frame and the search range) until the next chunk or the end.
//!
//! Length: an utterance of `n` samples comes out as exactly `round(n / speed)` samples: WSOLA's
//! own output ends within a hop of that, and [`StretchSink::finish`] cuts the last hop or pads it
//! with digital silence to the exact count.
//!
//! Speed `1.0` does not pass through here at all ([`wrap`]): the output is bit-identical to an
//! unstretched one.

use std::num::{NonZeroU16, NonZeroU32};

use board::audio::{AudioSink, SinkError, SinkErrorKind, SinkStats};
use wsola::TimeStretch;

/// Slowest speed: a quarter of the model's (OpenAI's `speed` range; WSOLA's `MIN_TEMPO` too).
pub const MIN_SPEED: f32 = 0.25;
/// Fastest speed: four times the model's (OpenAI's `speed` range; WSOLA's `MAX_TEMPO` too).
pub const MAX_SPEED: f32 = 4.0;

/// Hops pulled from the stretcher per call (15 ms each at any rate: 240 ms of audio at most).
const HOPS_PER_PULL: usize = 16;

/// `sink` at `speed`: itself for 1.0 (and for anything that is not a finite number), else a
/// [`StretchSink`] around it. `speed` is clamped to [`MIN_SPEED`]..=[`MAX_SPEED`]; the
/// front-ends refuse values outside it before this.
pub fn wrap(sink: Box<dyn AudioSink + Send>, speed: f32) -> Box<dyn AudioSink + Send> {
    if speed == 1.0 || !speed.is_finite() { sink } else { Box::new(StretchSink::new(sink, speed)) }
}

/// An [`AudioSink`] that time-stretches what it is given by `speed` (pitch kept) and writes the
/// result into `inner`: `speed` 2.0 halves the duration, 0.5 doubles it.
pub struct StretchSink<S> {
    inner: S,
    speed: f32,
    stretch: Option<TimeStretch>,
    buf: Vec<f32>,
    /// Samples given to this utterance, at the model rate.
    given: u64,
    /// Samples written into `inner` for it.
    written: u64,
}

impl<S: AudioSink> StretchSink<S> {
    /// A sink writing `speed` times faster audio into `inner` (clamped to
    /// [`MIN_SPEED`]..=[`MAX_SPEED`]).
    pub fn new(inner: S, speed: f32) -> Self {
        let speed = if speed.is_finite() { speed.clamp(MIN_SPEED, MAX_SPEED) } else { 1.0 };
        StretchSink { inner, speed, stretch: None, buf: Vec::new(), given: 0, written: 0 }
    }

    /// The sink it writes into.
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// Write what the stretcher has ready into `inner`, at most `limit` samples in all.
    fn pump(&mut self, limit: u64) -> Result<(), SinkError> {
        let Some(ts) = self.stretch.as_mut() else {
            return Err(SinkError::Config("write before begin".into()));
        };
        loop {
            let n = match ts.pull(&mut self.buf) {
                Ok(0) | Err(wsola::Error::NotEnoughInput) => return Ok(()),
                Ok(n) => n,
                // the buffer is a multiple of the stretcher's hop and it is mono: cannot happen
                Err(e) => return Err(SinkError::other(SinkErrorKind::Config, format!("time stretch: {e}"))),
            };
            let room = usize::try_from(limit.saturating_sub(self.written)).unwrap_or(usize::MAX);
            let n = n.min(room);
            if n > 0 {
                self.inner.write(&self.buf[..n])?;
                self.written += n as u64;
            }
        }
    }

    /// `round(given / speed)`: the length of the stretched utterance, samples.
    fn want(&self) -> u64 {
        (self.given as f64 / f64::from(self.speed)).round() as u64
    }
}

impl<S: AudioSink> AudioSink for StretchSink<S> {
    fn begin(&mut self, sample_rate: u32) -> Result<(), SinkError> {
        let rate = NonZeroU32::new(sample_rate).ok_or_else(|| SinkError::Config("sample rate 0".into()))?;
        let mut ts = TimeStretch::new(rate, NonZeroU16::MIN)
            .map_err(|e| SinkError::other(SinkErrorKind::Config, format!("time stretch: {e}")))?;
        ts.set_tempo(self.speed);
        self.buf = vec![0.0; ts.min_output_buff_size() * HOPS_PER_PULL];
        self.stretch = Some(ts);
        (self.given, self.written) = (0, 0);
        self.inner.begin(sample_rate)
    }

    fn write(&mut self, samples: &[f32]) -> Result<(), SinkError> {
        let Some(ts) = self.stretch.as_mut() else {
            return Err(SinkError::Config("write before begin".into()));
        };
        ts.push(samples);
        self.given += samples.len() as u64;
        self.pump(u64::MAX)
    }

    fn finish(&mut self) -> Result<SinkStats, SinkError> {
        if let Some(ts) = self.stretch.as_mut() {
            ts.set_draining();
            let want = self.want();
            self.pump(want)?;
            // WSOLA ends within a hop of the exact length: pad the rest with silence
            let zeros = [0.0f32; 1024];
            while self.written < want {
                let n = usize::try_from(want - self.written).unwrap_or(zeros.len()).min(zeros.len());
                self.inner.write(&zeros[..n])?;
                self.written += n as u64;
            }
            self.stretch = None;
        }
        self.inner.finish()
    }

    fn abort(&mut self) {
        self.stretch = None;
        self.inner.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Captures what is written.
    #[derive(Default)]
    struct Capture {
        samples: Vec<f32>,
        finished: bool,
    }

    impl AudioSink for Capture {
        fn begin(&mut self, _: u32) -> Result<(), SinkError> {
            self.samples.clear();
            Ok(())
        }
        fn write(&mut self, samples: &[f32]) -> Result<(), SinkError> {
            self.samples.extend_from_slice(samples);
            Ok(())
        }
        fn finish(&mut self) -> Result<SinkStats, SinkError> {
            self.finished = true;
            Ok(SinkStats::passthrough(self.samples.len() as u64, RATE, board::audio::SampleFormat::F32))
        }
    }

    const RATE: u32 = 24_000;

    /// A voiced, speech-like test signal: a 180 Hz fundamental with four harmonics, its
    /// loudness moving at 4 Hz (syllables) and 0.3 s of silence in the middle.
    fn voice(seconds: f64) -> Vec<f32> {
        let n = (seconds * f64::from(RATE)) as usize;
        (0..n)
            .map(|i| {
                let t = i as f64 / f64::from(RATE);
                if (t - seconds / 2.0).abs() < 0.15 {
                    return 0.0;
                }
                let tone: f64 = (1..=5).map(|k| (2.0 * std::f64::consts::PI * 180.0 * k as f64 * t).sin() / k as f64).sum();
                (0.3 * tone * (0.6 + 0.4 * (2.0 * std::f64::consts::PI * 4.0 * t).sin())) as f32
            })
            .collect()
    }

    /// `input` through a [`StretchSink`] at `speed`, given in pieces of `chunk` samples.
    fn stretched(input: &[f32], speed: f32, chunk: usize) -> Vec<f32> {
        let mut s = StretchSink::new(Capture::default(), speed);
        s.begin(RATE).unwrap();
        for piece in input.chunks(chunk) {
            s.write(piece).unwrap();
        }
        s.finish().unwrap();
        let inner = s.into_inner();
        assert!(inner.finished);
        inner.samples
    }

    /// The fundamental of `x` by autocorrelation over lags of 60-500 Hz, Hz.
    fn pitch(x: &[f32]) -> f64 {
        let (lo, hi) = ((RATE / 500) as usize, (RATE / 60) as usize);
        let best = (lo..=hi)
            .max_by(|&a, &b| {
                let r = |lag: usize| x.iter().zip(&x[lag..]).map(|(p, q)| f64::from(*p) * f64::from(*q)).sum::<f64>();
                r(a).total_cmp(&r(b))
            })
            .unwrap();
        f64::from(RATE) / best as f64
    }

    #[test]
    fn the_duration_is_exactly_the_input_over_the_speed() {
        let input = voice(1.5);
        for speed in [0.25f32, 0.5, 0.8, 1.25, 1.5, 2.0, 3.0, 4.0] {
            let out = stretched(&input, speed, 1920);
            let want = (input.len() as f64 / f64::from(speed)).round() as usize;
            assert_eq!(out.len(), want, "speed {speed}");
        }
        // an utterance shorter than WSOLA's window is still the exact length (silence)
        assert_eq!(stretched(&input[..300], 2.0, 1920).len(), 150);
    }

    #[test]
    fn the_pitch_stays_where_it_was() {
        let input = voice(1.5);
        let at = |x: &[f32]| pitch(&x[x.len() / 8..x.len() / 8 + 4800]);
        let before = at(&input);
        assert!((before - 180.0).abs() < 2.0, "{before}");
        for speed in [0.5f32, 0.75, 1.5, 2.0] {
            let after = at(&stretched(&input, speed, 1920));
            assert!((after - before).abs() / before < 0.02, "speed {speed}: {after:.1} Hz, was {before:.1} Hz");
        }
    }

    #[test]
    fn chunk_borders_are_not_in_the_output() {
        // the stretch of the whole at once, against the same audio given in the engine's
        // chunk sizes (one 80 ms frame, a ramp's first chunks) and in odd pieces: sample for
        // sample the same, so no border of a chunk can be heard
        let input = voice(1.2);
        for speed in [0.5f32, 1.5, 2.5] {
            let whole = stretched(&input, speed, input.len());
            for chunk in [1920, 3840, 7680, 1001, 97] {
                assert!(stretched(&input, speed, chunk) == whole, "speed {speed}, chunks of {chunk}");
            }
        }
    }

    #[test]
    fn no_clicks_where_pieces_join() {
        // a click is a jump between two samples far above what the signal itself does
        let input = voice(1.5);
        let steepest = |x: &[f32]| x.windows(2).map(|w| (w[1] - w[0]).abs()).fold(0.0f32, f32::max);
        let own = steepest(&input);
        for speed in [0.5f32, 2.0] {
            let out = stretched(&input, speed, 1920);
            assert!(steepest(&out) < 1.5 * own, "speed {speed}: a step of {} (the signal's own steepest: {own})", steepest(&out));
            assert!(out.iter().all(|s| s.is_finite() && s.abs() <= 1.0));
        }
    }

    #[test]
    fn speed_one_is_the_sink_itself() {
        let mut s = wrap(Box::new(Capture::default()), 1.0);
        s.begin(RATE).unwrap();
        s.write(&[0.25, -0.5]).unwrap();
        assert_eq!(s.finish().unwrap().input_samples, 2, "nothing held back or added");
        let mut s = wrap(Box::new(Capture::default()), 2.0);
        s.begin(RATE).unwrap();
        s.write(&[0.25; 4800]).unwrap();
        assert_eq!(s.finish().unwrap().input_samples, 2400);
    }

    #[test]
    fn write_before_begin_is_an_error_not_a_panic() {
        let mut s = StretchSink::new(Capture::default(), 2.0);
        assert!(matches!(s.write(&[0.0; 10]), Err(SinkError::Config(_))));
        s.abort();
    }
}
