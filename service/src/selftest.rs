//! The start-up self-test of `herald serve`: one short sentence spoken through the loaded
//! speaker into a sink that discards it, before herald says it is ready (systemd's `READY=1`,
//! the Wyoming server, the Zeroconf announcement, HTTP's `/healthz`).
//!
//! A server that starts, announces itself and then fails its first request is the worst kind
//! of broken for Home Assistant: it is discovered, added, and fails in the middle of a
//! pipeline. Loading a bundle checks its files' shapes and (with `model.verify`) their
//! checksums, but not that the numbers in them make sound: tables damaged in place with the
//! same length (an erased flash page reads as `0xFF`, which is NaN as float32) load, and the
//! first step of the talker fails. The self-test runs that first step, and every step after
//! it, at start-up.
//!
//! The sentence goes the way a network request goes: [`Front::request`] (the configured voice
//! and text front-end, checked against the bundle), the speaker's queue and worker thread,
//! the engine (prompt, talker, code predictor, sampler, vocoder) and a sink
//! ([`board::audio::NullSink`], which shapes and counts like every other sink, behind a
//! counter of the engine's samples). It never opens the audio device: a device that is absent
//! at start is a warning, not a failure ([`crate::DeviceHealth`]). It is not counted in what
//! the speaker learns for its start policy and automatic calibration ([`Job::unmeasured`]):
//! it runs cold.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use board::audio::{AudioSink, NullSink, SinkError, SinkStats};

use crate::front::{Front, RequestError};
use crate::output::Target;
use crate::speaker::{Job, JobError};

/// The sentence the self-test speaks: short, and words in every language's tokenizer.
pub const TEXT: &str = "Hello.";

/// The most frames the self-test makes (16 × 80 ms = 1.28 s of audio): a real model ends
/// [`TEXT`] by itself within about a second; a model that does not stop (random weights, a
/// damaged end-of-speech logit) is cut here, so the start-up takes a bounded time. 16 frames
/// run the vocoder over the default chunk ramp's first three chunks (2, 4 and 8 frames).
pub const MAX_FRAMES: usize = 16;

/// What a passed self-test measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Proof {
    /// Frames the engine made (at most [`MAX_FRAMES`]).
    pub frames: usize,
    /// Samples of audio the engine made, at `sample_rate`.
    pub samples: u64,
    /// The model's sample rate, Hz.
    pub sample_rate: u32,
    /// From the request to the sink's end, seconds (the worker's queue included: it is empty).
    pub seconds: f64,
    /// From the request to the first chunk of audio, seconds (the engine's TTFA).
    pub ttfa: f64,
    /// The largest absolute sample value (1.0 = full scale).
    pub peak: f32,
}

impl Proof {
    /// Seconds of audio made.
    pub fn audio_seconds(&self) -> f64 {
        self.samples as f64 / f64::from(self.sample_rate.max(1))
    }

    /// Real-time factor: wall seconds per second of audio (below 1: faster than real time).
    pub fn rtf(&self) -> f64 {
        let audio = self.audio_seconds();
        if audio > 0.0 { self.seconds / audio } else { f64::INFINITY }
    }
}

impl std::fmt::Display for Proof {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "spoke {TEXT:?} into a null sink: {} frames ({:.2} s of audio) in {:.2} s, RTF {:.2}, time to first audio {:.0} ms, \
             peak {:.2}",
            self.frames,
            self.audio_seconds(),
            self.seconds,
            self.rtf(),
            self.ttfa * 1e3,
            self.peak
        )
    }
}

/// Why the self-test failed; each names what went wrong, and the caller adds the bundle.
#[derive(Debug, thiserror::Error)]
pub enum SelfTestError {
    /// The configured voice or text front-end cannot make a request of [`TEXT`].
    #[error("the configured voice cannot speak {TEXT:?}: {0}")]
    Request(#[source] RequestError),
    /// The job failed: the engine (a step, the sampler, the vocoder) or the sink.
    #[error("{TEXT:?} could not be spoken: {0}")]
    Job(#[source] JobError),
    /// The job ended without a sample of audio.
    #[error("{TEXT:?} made no audio ({frames} frames)")]
    NoAudio {
        /// Frames the engine reported.
        frames: usize,
    },
    /// The vocoder made samples that are not numbers (NaN or infinite).
    #[error("{TEXT:?} made {bad} samples of {samples} that are not finite numbers (NaN or infinite)")]
    NotFinite {
        /// The non-finite samples.
        bad: u64,
        /// All samples.
        samples: u64,
    },
    /// The process-wide stop (SIGINT/SIGTERM) came during the self-test: not a failure.
    #[error("stopped by a signal during the self-test")]
    Stopped,
}

/// What the counting sink saw.
#[derive(Debug, Default)]
struct Tally {
    samples: u64,
    not_finite: u64,
    peak: f32,
}

/// The engine's samples counted (all, non-finite, peak), then shaped and discarded by a
/// [`NullSink`].
struct Counting {
    inner: NullSink,
    tally: Arc<Mutex<Tally>>,
}

impl AudioSink for Counting {
    fn begin(&mut self, sample_rate: u32) -> Result<(), SinkError> {
        self.inner.begin(sample_rate)
    }

    fn write(&mut self, samples: &[f32]) -> Result<(), SinkError> {
        {
            let mut t = self.tally.lock().unwrap_or_else(PoisonError::into_inner);
            t.samples += samples.len() as u64;
            for &s in samples {
                if s.is_finite() {
                    t.peak = t.peak.max(s.abs());
                } else {
                    t.not_finite += 1;
                }
            }
        }
        self.inner.write(samples)
    }

    fn finish(&mut self) -> Result<SinkStats, SinkError> {
        self.inner.finish()
    }

    fn abort(&mut self) {
        self.inner.abort();
    }
}

/// Speak [`TEXT`] (at most [`MAX_FRAMES`] frames) through `front`'s queue into a counting null
/// sink and wait for it (see the module doc).
///
/// # Errors
/// [`SelfTestError`]: the request, the job, no audio or non-finite samples; `Stopped` when the
/// process-wide stop came first.
pub fn run(front: &Front) -> Result<Proof, SelfTestError> {
    let t0 = Instant::now();
    let mut request = front.request(TEXT, None, None).map_err(SelfTestError::Request)?;
    request.max_frames = Some(MAX_FRAMES);
    let tally = Arc::new(Mutex::new(Tally::default()));
    let sink = Counting { inner: NullSink::new(front.live().get().output.shaper), tally: Arc::clone(&tally) };
    let job = Job::new(request, Target::Sink { sink: Box::new(sink), plays: false }).unmeasured();
    // `submit` waits for room (the queue is empty at start-up): it refuses only after the stop
    let Ok(handle) = front.queue().submit(job) else { return Err(SelfTestError::Stopped) };
    let outcome = handle.wait();
    let stopped = front.stop_handle().is_stopped();
    let spoken = match outcome {
        Ok(s) => s,
        Err(JobError::Cancelled) if stopped => return Err(SelfTestError::Stopped),
        Err(e) => return Err(SelfTestError::Job(e)),
    };
    let Some(report) = spoken.report else {
        // cut short: only the stop cancels this job (nobody else holds its handle)
        return Err(SelfTestError::Stopped);
    };
    let seconds = t0.elapsed().as_secs_f64();
    let t = tally.lock().unwrap_or_else(PoisonError::into_inner);
    if t.not_finite > 0 {
        return Err(SelfTestError::NotFinite { bad: t.not_finite, samples: t.samples });
    }
    if t.samples == 0 {
        return Err(SelfTestError::NoAudio { frames: report.frames });
    }
    Ok(Proof { frames: report.frames, samples: t.samples, sample_rate: front.sample_rate(), seconds, ttfa: report.ttfa, peak: t.peak })
}
