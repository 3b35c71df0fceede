//! Audio output: the [`AudioSink`] trait and its sinks (ALSA playback, WAV, raw S16LE, null).
//!
//! Every sink takes mono `f32` samples at the model rate (24 kHz for Qwen3-TTS, but any rate
//! works), one utterance per `begin` … `finish`, and runs them through the same
//! [`ShapingStage`] (the [`Shaper`]'s gain, leading/trailing silence and 5 ms raised-cosine edge
//! fades, plus the call-order checks and sample counts) before its own conversion, so a WAV
//! file and ALSA playback of the same input carry the same samples. Float to 16-bit conversion
//! is [`crate::pcm::f32_to_s16`] everywhere (clamp to [-1, 1], ×32767, round half away from
//! zero).
//!
//! Errors are [`SinkError`]; [`SinkError::kind`] sorts them for exit codes. A sink this module
//! does not know (a network sink, a wrapper such as the amplifier gate in `crate::gpio`)
//! reports its own failure as [`SinkError::Io`] (its socket's I/O error) or
//! [`SinkError::Other`] (any error, with the [`SinkErrorKind`] it chooses).
//!
//! A new sink: own a [`ShapingStage`], call its `begin`/`process`/`finish` from the sink's
//! own, convert the samples it returns, and report [`ShapingStage::stats`] (or your own
//! [`SinkStats`] when the output is not the model rate).
//!
//! Dependencies point one way: `audio` uses only [`crate::pcm`]; `crate::gpio` uses `audio`.

mod alsa_sink;
mod file;
mod resample;
mod shaper;
mod stage;

pub use alsa_sink::{AlsaSettings, AlsaSink, DeviceInfo, Openable, list_playback_devices, openable, probe_device, quiet};
pub use file::{NullSink, RawSink, WavSink, streaming_wav_header};
pub use resample::StreamResampler;
pub use shaper::{Shaper, ShaperSettings, fade_weight, ms_to_samples};
pub use stage::ShapingStage;

/// A destination for synthesized speech.
///
/// Protocol: `begin(rate)`, any number of `write(samples)`, then `finish()`; repeat per
/// utterance. `samples` are mono `f32` in [-1, 1] (values outside are clamped on output) at
/// the `sample_rate` given to `begin`; chunks may have any length, including 0. `write` may
/// block for as long as the device needs to make room (ALSA plays in real time).
pub trait AudioSink {
    /// Start an utterance of mono samples at `sample_rate` Hz (opens the device for ALSA).
    fn begin(&mut self, sample_rate: u32) -> Result<(), SinkError>;
    /// Queue the next chunk of the utterance.
    fn write(&mut self, samples: &[f32]) -> Result<(), SinkError>;
    /// End the utterance: flush everything held back (fade-out, resampler delay, trailing
    /// silence), wait until it has been played or written, and report what was done.
    fn finish(&mut self) -> Result<SinkStats, SinkError>;
    /// Abandon the current utterance at once (barge-in, shutdown): pending audio is dropped and
    /// the device released. A no-op when no utterance is open. The default just does nothing.
    fn abort(&mut self) {}
}

impl<S: AudioSink + ?Sized> AudioSink for Box<S> {
    fn begin(&mut self, sample_rate: u32) -> Result<(), SinkError> {
        (**self).begin(sample_rate)
    }
    fn write(&mut self, samples: &[f32]) -> Result<(), SinkError> {
        (**self).write(samples)
    }
    fn finish(&mut self) -> Result<SinkStats, SinkError> {
        (**self).finish()
    }
    fn abort(&mut self) {
        (**self).abort()
    }
}

/// Sample format of a sink's output (native endianness, which is little-endian on every
/// target herald supports).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SampleFormat {
    /// Signed 16-bit (ALSA `S16_LE`; WAV and raw output).
    S16,
    /// Signed 32-bit (ALSA `S32_LE`), holding the S16 value in the top 16 bits.
    S32,
    /// 32-bit float in [-1, 1] (ALSA `FLOAT_LE`), clamped like the integer formats.
    F32,
}

impl std::fmt::Display for SampleFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SampleFormat::S16 => "S16_LE",
            SampleFormat::S32 => "S32_LE",
            SampleFormat::F32 => "FLOAT_LE",
        })
    }
}

/// What one utterance did, returned by [`AudioSink::finish`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SinkStats {
    /// Mono samples received through `write`, at the model rate (before shaping).
    pub input_samples: u64,
    /// Frames handed to the output at `device_rate` (one frame = `channels` samples), including
    /// the shaper's silence and after resampling; for ALSA, frames the device accepted.
    pub frames_written: u64,
    /// Underruns (EPIPE) recovered during the utterance; each was logged with `log::warn!`.
    /// Always 0 for file sinks.
    pub xruns: u32,
    /// Output rate in Hz: the device's granted rate for ALSA, the model rate otherwise.
    pub device_rate: u32,
    /// Output channels (the mono signal is copied into each).
    pub channels: u32,
    /// Output sample format.
    pub format: SampleFormat,
    /// ALSA period size in frames as granted (0 for file sinks).
    pub period_frames: u32,
    /// ALSA buffer size in frames as granted (0 for file sinks).
    pub buffer_frames: u32,
    /// Whether herald resampled in-process (device rate ≠ model rate).
    pub resampled: bool,
}

impl SinkStats {
    /// What a sink reports that took `samples` mono samples at `rate` Hz and wrote them one for
    /// one in `format`: no device buffer, no silence added, no resampling, no xrun (a memory or
    /// test sink).
    pub fn passthrough(samples: u64, rate: u32, format: SampleFormat) -> Self {
        SinkStats {
            input_samples: samples,
            frames_written: samples,
            xruns: 0,
            device_rate: rate,
            channels: 1,
            format,
            period_frames: 0,
            buffer_frames: 0,
            resampled: false,
        }
    }
}

/// How a [`SinkError`] should be treated; the binary maps these to exit codes
/// (suggested: `Config` → 2 "bad input or config", everything about the audio device → 3,
/// `Output` → 2 when a path could not be created, or quietly 0 on a broken pipe). A sink
/// outside this module picks one for its [`SinkError::Other`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SinkErrorKind {
    /// The device exists but another user holds it (EBUSY), after the bounded retry.
    Busy,
    /// No such PCM / card (ENOENT, ENODEV, ENXIO).
    NotFound,
    /// The device cannot play what herald can produce (access, format, channels, rate, period).
    Unsupported,
    /// The device failed while playing (I/O error, unrecoverable xrun, stall, permission).
    Device,
    /// Writing a WAV/raw file, a pipe or a network peer's socket failed.
    Output,
    /// Bad settings or API misuse (empty device name, rate 0, `write` before `begin`).
    Config,
}

/// Errors of the audio sinks. Messages name the device or file and the operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The PCM is held by someone else (EBUSY) and stayed so through every retry.
    #[error("audio device '{device}' is busy (held by another process?) after {attempts} attempts over {waited_ms} ms")]
    Busy {
        /// PCM name as given.
        device: String,
        /// Open attempts made.
        attempts: u32,
        /// Total time spent retrying.
        waited_ms: u64,
    },
    /// No PCM of that name exists (or its card is missing).
    #[error("audio device '{device}' not found ({source}); `herald devices` lists the playback PCMs")]
    NotFound {
        /// PCM name as given.
        device: String,
        /// alsa-lib's error.
        source: alsa::Error,
    },
    /// Hardware parameter negotiation failed.
    #[error("audio device '{device}' does not support {what}: {source}{hint}")]
    Unsupported {
        /// PCM name as given.
        device: String,
        /// What was asked for, e.g. "interleaved access" or "S16_LE, S32_LE or FLOAT_LE samples".
        what: String,
        /// alsa-lib's error.
        source: alsa::Error,
        /// Extra advice (may be empty), e.g. to use a `plughw:` or `default` device.
        hint: &'static str,
    },
    /// Any other ALSA failure: `op` names the alsa-lib call.
    #[error("audio device '{device}': {op} failed: {source}")]
    Alsa {
        /// PCM name as given.
        device: String,
        /// The failing operation, e.g. "snd_pcm_writei".
        op: &'static str,
        /// alsa-lib's error.
        source: alsa::Error,
    },
    /// The device went away while it played (ENODEV, ENXIO or ESHUTDOWN from a running
    /// stream: a USB speaker pulled out, a card removed). The next utterance opens it again.
    #[error("audio device '{device}' went away while playing ({op}: {source}); was it unplugged?")]
    Gone {
        /// PCM name as given.
        device: String,
        /// The alsa-lib call that failed, e.g. "snd_pcm_writei".
        op: &'static str,
        /// alsa-lib's error.
        source: alsa::Error,
    },
    /// The device stopped consuming samples for longer than the write timeout.
    #[error("audio device '{device}' stalled: no room in the buffer for {waited_ms} ms")]
    Stalled {
        /// PCM name as given.
        device: String,
        /// How long the write waited.
        waited_ms: u64,
    },
    /// Writing a file, pipe or socket failed (kind [`SinkErrorKind::Output`]).
    #[error("audio output {target}: {op} failed: {source}")]
    Io {
        /// File path, "stdout" / "stream", or the peer of a network sink (e.g.
        /// "wyoming client 192.0.2.7:41234").
        target: String,
        /// What was being done, e.g. "create" or "write".
        op: &'static str,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The WAV encoder (hound) refused something.
    #[error("WAV output {target}: {source}")]
    Wav {
        /// File path.
        target: String,
        /// hound's error.
        source: hound::Error,
    },
    /// The resampler could not be built or failed.
    #[error("resampling {from} Hz -> {to} Hz: {message}")]
    Resampler {
        /// Input rate, Hz.
        from: u32,
        /// Output rate, Hz.
        to: u32,
        /// rubato's message.
        message: String,
    },
    /// Bad settings or calls in the wrong order.
    #[error("audio output: {0}")]
    Config(String),
    /// A failure this enum does not name, reported by a sink or a wrapper around one (a network
    /// sink's protocol error, the amplifier-enable GPIO line): `kind` sorts it, the message is
    /// the source's own. Build it with [`SinkError::other`].
    #[error("{source}")]
    Other {
        /// How to treat it (exit code).
        kind: SinkErrorKind,
        /// What failed; its message names the target and the operation.
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
}

impl SinkError {
    /// A [`SinkError::Other`] of `kind` carrying `source` (any error, or a message).
    pub fn other(kind: SinkErrorKind, source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>) -> Self {
        SinkError::Other { kind, source: source.into() }
    }

    /// Classify this error (see [`SinkErrorKind`]).
    pub fn kind(&self) -> SinkErrorKind {
        match self {
            SinkError::Busy { .. } => SinkErrorKind::Busy,
            SinkError::NotFound { .. } => SinkErrorKind::NotFound,
            SinkError::Unsupported { .. } => SinkErrorKind::Unsupported,
            SinkError::Alsa { .. } | SinkError::Gone { .. } | SinkError::Stalled { .. } => SinkErrorKind::Device,
            SinkError::Io { .. } | SinkError::Wav { .. } => SinkErrorKind::Output,
            SinkError::Resampler { .. } | SinkError::Config(_) => SinkErrorKind::Config,
            SinkError::Other { kind, .. } => *kind,
        }
    }

    /// Whether this is a write to a pipe whose reader has gone (EPIPE on a file descriptor),
    /// which a command-line tool usually treats as a quiet end of output. For
    /// [`SinkError::Other`], whether an I/O error in its source chain is one.
    pub fn is_broken_pipe(&self) -> bool {
        let broken = |e: &std::io::Error| e.kind() == std::io::ErrorKind::BrokenPipe;
        match self {
            SinkError::Io { source, .. } => broken(source),
            SinkError::Wav { source: hound::Error::IoError(e), .. } => broken(e),
            SinkError::Other { source, .. } => {
                let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(source.as_ref());
                while let Some(e) = cause {
                    if e.downcast_ref::<std::io::Error>().is_some_and(broken) {
                        return true;
                    }
                    cause = e.source();
                }
                false
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sinks_can_move_to_the_audio_thread() {
        fn send<T: Send>() {}
        send::<AlsaSink>();
        send::<WavSink>();
        send::<RawSink>();
        send::<NullSink>();
        send::<SinkError>();
        send::<Box<dyn AudioSink + Send>>();
    }

    #[test]
    fn error_kinds_for_exit_codes() {
        let io = |k| SinkError::Io { target: "stdout".into(), op: "write", source: std::io::Error::from(k) };
        assert!(io(std::io::ErrorKind::BrokenPipe).is_broken_pipe());
        assert!(!io(std::io::ErrorKind::PermissionDenied).is_broken_pipe());
        assert_eq!(io(std::io::ErrorKind::PermissionDenied).kind(), SinkErrorKind::Output);
        assert_eq!(SinkError::Stalled { device: "d".into(), waited_ms: 1 }.kind(), SinkErrorKind::Device);
    }

    /// A sink written outside this module, the way a network front-end would: S16LE packets to a
    /// socket, the shaping from [`ShapingStage`], its failures as [`SinkError`]s.
    struct SocketSink {
        stage: ShapingStage,
        peer: std::os::unix::net::UnixStream,
        bytes: Vec<u8>,
        refuse_rate: Option<u32>,
    }

    /// A protocol failure of [`SocketSink`], e.g. the client asked for another format.
    #[derive(Debug, thiserror::Error)]
    #[error("socket client: cannot send {rate} Hz audio: client wants 16000 Hz")]
    struct RateRefused {
        rate: u32,
    }

    impl SocketSink {
        fn send(&mut self) -> Result<(), SinkError> {
            use std::io::Write;
            crate::pcm::f32_to_s16le(self.stage.shaped(), &mut self.bytes);
            self.peer.write_all(&self.bytes).map_err(|source| SinkError::Io { target: "socket client".into(), op: "send", source })
        }
    }

    impl AudioSink for SocketSink {
        fn begin(&mut self, sample_rate: u32) -> Result<(), SinkError> {
            if self.refuse_rate == Some(sample_rate) {
                return Err(SinkError::other(SinkErrorKind::Unsupported, RateRefused { rate: sample_rate }));
            }
            self.stage.begin(sample_rate)
        }
        fn write(&mut self, samples: &[f32]) -> Result<(), SinkError> {
            self.stage.process(samples)?;
            self.send()
        }
        fn finish(&mut self) -> Result<SinkStats, SinkError> {
            self.stage.finish()?;
            self.send()?;
            Ok(self.stage.stats(SampleFormat::S16))
        }
        fn abort(&mut self) {
            self.stage.abort();
        }
    }

    #[test]
    fn a_network_sink_shapes_like_the_others_and_reports_its_own_failures() {
        use std::io::Read;
        let st = ShaperSettings { gain: 0.9, lead_silence_ms: 3, trail_silence_ms: 2, fade_ms: 5 };
        let x: Vec<f32> = (0..2000).map(|i| (i as f32 * 0.07).sin() * 0.8).collect();
        let (a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut sink = SocketSink { stage: ShapingStage::new(st), peer: a, bytes: Vec::new(), refuse_rate: Some(16000) };
        let reader = std::thread::spawn(move || {
            let mut v = Vec::new();
            b.read_to_end(&mut v).unwrap();
            v
        });
        sink.begin(24000).unwrap();
        for c in x.chunks(700) {
            sink.write(c).unwrap();
        }
        let stats = sink.finish().unwrap();
        // the client's own failure, sorted by the sink
        let e = sink.begin(16000).unwrap_err();
        assert_eq!(e.kind(), SinkErrorKind::Unsupported);
        assert_eq!(e.to_string(), "socket client: cannot send 16000 Hz audio: client wants 16000 Hz");
        assert!(!e.is_broken_pipe());
        drop(sink);
        let got = reader.join().unwrap();
        // the same bytes as the raw sink: one shaping stage for every sink
        #[derive(Clone, Default)]
        struct Shared(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Shared {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let raw_out = Shared::default();
        let mut raw = RawSink::new(raw_out.clone(), "vec", st);
        raw.begin(24000).unwrap();
        raw.write(&x).unwrap();
        assert_eq!(raw.finish().unwrap(), stats);
        assert_eq!(got, *raw_out.0.lock().unwrap());
        assert_eq!(stats.frames_written, 72 + 2000 + 48);

        // the peer hangs up: an I/O error of kind Output that reads as a broken pipe
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        drop(b);
        let mut sink = SocketSink { stage: ShapingStage::new(st), peer: a, bytes: Vec::new(), refuse_rate: None };
        sink.begin(24000).unwrap();
        let e = sink.write(&x).unwrap_err();
        assert_eq!(e.kind(), SinkErrorKind::Output);
        assert!(e.is_broken_pipe(), "{e}");
        assert!(e.to_string().starts_with("audio output socket client: send failed: "), "{e}");
        // the same error boxed by a wrapper keeps its broken-pipe reading
        let wrapped = SinkError::other(SinkErrorKind::Output, e);
        assert!(wrapped.is_broken_pipe());
        assert!(wrapped.to_string().starts_with("audio output socket client: send failed: "));
    }
}
