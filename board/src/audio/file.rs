//! File and stream sinks: WAV (file or pipe), raw S16LE, and a counting null sink.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::Path;

use super::{AudioSink, SampleFormat, ShaperSettings, ShapingStage, SinkError, SinkStats};
use crate::pcm::f32_to_s16le;

/// The 44-byte header of a 16-bit PCM mono WAV stream of unknown length.
///
/// `RIFF` and `data` sizes are `0xFFFFFFFF` (the largest value, as streaming WAV writers do
/// when they cannot seek back): readers that honour the sizes read until end of stream.
/// Fields: PCM format tag 1, 1 channel, `sample_rate` Hz, byte rate `2·sample_rate`, block
/// align 2, 16 bits per sample.
pub fn streaming_wav_header(sample_rate: u32) -> [u8; 44] {
    let mut h = [0u8; 44];
    h[0..4].copy_from_slice(b"RIFF");
    h[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    h[8..12].copy_from_slice(b"WAVE");
    h[12..16].copy_from_slice(b"fmt ");
    h[16..20].copy_from_slice(&16u32.to_le_bytes());
    h[20..22].copy_from_slice(&1u16.to_le_bytes()); // WAVE_FORMAT_PCM
    h[22..24].copy_from_slice(&1u16.to_le_bytes()); // channels
    h[24..28].copy_from_slice(&sample_rate.to_le_bytes());
    h[28..32].copy_from_slice(&(sample_rate.wrapping_mul(2)).to_le_bytes()); // byte rate
    h[32..34].copy_from_slice(&2u16.to_le_bytes()); // block align
    h[34..36].copy_from_slice(&16u16.to_le_bytes()); // bits per sample
    h[36..40].copy_from_slice(b"data");
    h[40..44].copy_from_slice(&u32::MAX.to_le_bytes());
    h
}

enum WavOut {
    /// A regular file, opened; the hound writer is made at the first `begin` (it needs the rate).
    Pending(BufWriter<File>),
    /// A regular file: hound writes a correct header and patches the sizes on every `finish`.
    File(hound::WavWriter<BufWriter<File>>),
    /// A pipe, FIFO, terminal or any other `Write`: streaming header, never a seek.
    Stream { w: Box<dyn Write + Send>, header_written: bool },
    /// After `close`.
    Closed,
}

/// 16-bit PCM mono WAV at the model rate, to a regular file or to a stream.
///
/// - Regular file ([`WavSink::create`] on a path that is a regular file or does not exist): a
///   correct RIFF header, written by hound; the sizes are patched at every `finish`, so the file
///   is valid after each utterance.
/// - Anything else — `-` (stdout), a FIFO, `/dev/stdout`, or [`WavSink::stream`] over any
///   `Write`: the header of [`streaming_wav_header`] (sizes `0xFFFFFFFF`) is written at the
///   first `begin` and nothing ever seeks, so pipes get the whole stream (the piper "Illegal
///   seek" / truncated-pipe problem cannot happen).
///
/// Several utterances go into the same file back to back (each with its own lead/trail silence
/// and fades); they must share one sample rate, since a WAV file has one.
pub struct WavSink {
    stage: ShapingStage,
    target: String,
    out: WavOut,
    rate: Option<u32>,
    bytes: Vec<u8>,
}

impl WavSink {
    /// Write to `path`; `-` means stdout. A path that is not a regular file (FIFO, character
    /// device) gets the streaming header. The file is created (truncated) now.
    ///
    /// Errors: [`SinkError::Io`] if it cannot be opened.
    pub fn create(path: &Path, shaper: ShaperSettings) -> Result<Self, SinkError> {
        if path.as_os_str() == "-" {
            return Ok(Self::stdout(shaper));
        }
        let target = path.display().to_string();
        let file = OpenOptions::new().write(true).create(true).truncate(true).open(path).map_err(|source| SinkError::Io {
            target: target.clone(),
            op: "create",
            source,
        })?;
        let regular =
            file.metadata().map_err(|source| SinkError::Io { target: target.clone(), op: "stat", source })?.file_type().is_file();
        let out = if regular {
            WavOut::Pending(BufWriter::new(file))
        } else {
            WavOut::Stream { w: Box::new(BufWriter::with_capacity(1 << 16, file)), header_written: false }
        };
        Ok(Self { stage: ShapingStage::new(shaper), target, out, rate: None, bytes: Vec::new() })
    }

    /// Stream to stdout (streaming header, flushed at every `finish`).
    pub fn stdout(shaper: ShaperSettings) -> Self {
        Self::stream(BufWriter::with_capacity(1 << 16, std::io::stdout()), "stdout", shaper)
    }

    /// Stream to any writer (streaming header; `target` names it in errors). Needs no `Seek`.
    pub fn stream(w: impl Write + Send + 'static, target: &str, shaper: ShaperSettings) -> Self {
        Self {
            stage: ShapingStage::new(shaper),
            target: target.to_string(),
            out: WavOut::Stream { w: Box::new(w), header_written: false },
            rate: None,
            bytes: Vec::new(),
        }
    }

    /// Finish the output: for a file, finalize the header (also done on drop, where errors are
    /// lost); for a stream, flush. Call after the last `finish`.
    pub fn close(mut self) -> Result<(), SinkError> {
        let target = self.target.clone();
        match std::mem::replace(&mut self.out, WavOut::Closed) {
            WavOut::File(w) => w.finalize().map_err(|source| SinkError::Wav { target, source }),
            WavOut::Stream { mut w, .. } => w.flush().map_err(|source| SinkError::Io { target, op: "flush", source }),
            WavOut::Pending(mut f) => f.flush().map_err(|source| SinkError::Io { target, op: "flush", source }),
            WavOut::Closed => Ok(()),
        }
    }

    /// Write what the stage shaped last.
    fn write_shaped(&mut self) -> Result<(), SinkError> {
        let target = &self.target;
        let shaped = self.stage.shaped();
        match &mut self.out {
            WavOut::File(w) => {
                let mut sw = w.get_i16_writer(shaped.len() as u32);
                for &s in shaped {
                    sw.write_sample(crate::pcm::f32_to_s16(s));
                }
                sw.flush().map_err(|source| SinkError::Wav { target: target.clone(), source })
            }
            WavOut::Stream { w, .. } => {
                f32_to_s16le(shaped, &mut self.bytes);
                w.write_all(&self.bytes).map_err(|source| SinkError::Io { target: target.clone(), op: "write", source })
            }
            WavOut::Pending(_) | WavOut::Closed => Err(SinkError::Config(format!("WAV output {target}: not open"))),
        }
    }
}

impl AudioSink for WavSink {
    fn begin(&mut self, sample_rate: u32) -> Result<(), SinkError> {
        if let Some(r) = self.rate
            && r != sample_rate
        {
            return Err(SinkError::Config(format!(
                "WAV output {}: utterance at {sample_rate} Hz after {r} Hz (one file has one rate)",
                self.target
            )));
        }
        self.stage.begin(sample_rate)?;
        let target = &self.target;
        match std::mem::replace(&mut self.out, WavOut::Closed) {
            WavOut::Pending(f) => {
                let spec = hound::WavSpec { channels: 1, sample_rate, bits_per_sample: 16, sample_format: hound::SampleFormat::Int };
                let w = hound::WavWriter::new(f, spec).map_err(|source| SinkError::Wav { target: target.clone(), source })?;
                self.out = WavOut::File(w);
            }
            WavOut::Stream { mut w, header_written } => {
                if !header_written {
                    w.write_all(&streaming_wav_header(sample_rate)).map_err(|source| SinkError::Io {
                        target: target.clone(),
                        op: "write header",
                        source,
                    })?;
                }
                self.out = WavOut::Stream { w, header_written: true };
            }
            other @ WavOut::File(_) => self.out = other,
            WavOut::Closed => return Err(SinkError::Config(format!("WAV output {target}: closed"))),
        }
        self.rate = Some(sample_rate);
        Ok(())
    }

    fn write(&mut self, samples: &[f32]) -> Result<(), SinkError> {
        self.stage.process(samples)?;
        self.write_shaped()
    }

    fn finish(&mut self) -> Result<SinkStats, SinkError> {
        self.stage.finish()?;
        self.write_shaped()?;
        let target = &self.target;
        match &mut self.out {
            WavOut::File(w) => w.flush().map_err(|source| SinkError::Wav { target: target.clone(), source })?,
            WavOut::Stream { w, .. } => w.flush().map_err(|source| SinkError::Io { target: target.clone(), op: "flush", source })?,
            WavOut::Pending(_) | WavOut::Closed => {}
        }
        Ok(self.stage.stats(SampleFormat::S16))
    }

    fn abort(&mut self) {
        // Whatever was written stays written; only the held-back tail is dropped.
        self.stage.abort();
    }
}

/// Headerless S16LE mono samples at the model rate to any writer (stdout for `aplay -t raw`,
/// a socket, a file). Byte-exact: 2 bytes per sample, nothing else, flushed at each `finish`.
pub struct RawSink {
    stage: ShapingStage,
    target: String,
    w: Box<dyn Write + Send>,
    bytes: Vec<u8>,
}

impl RawSink {
    /// Raw samples to `w`; `target` names it in error messages.
    pub fn new(w: impl Write + Send + 'static, target: &str, shaper: ShaperSettings) -> Self {
        Self { stage: ShapingStage::new(shaper), target: target.to_string(), w: Box::new(w), bytes: Vec::new() }
    }

    /// Raw samples to stdout.
    pub fn stdout(shaper: ShaperSettings) -> Self {
        Self::new(BufWriter::with_capacity(1 << 16, std::io::stdout()), "stdout", shaper)
    }

    /// Write what the stage shaped last.
    fn put(&mut self) -> Result<(), SinkError> {
        let target = &self.target;
        f32_to_s16le(self.stage.shaped(), &mut self.bytes);
        self.w.write_all(&self.bytes).map_err(|source| SinkError::Io { target: target.clone(), op: "write", source })
    }
}

impl AudioSink for RawSink {
    fn begin(&mut self, sample_rate: u32) -> Result<(), SinkError> {
        self.stage.begin(sample_rate)
    }

    fn write(&mut self, samples: &[f32]) -> Result<(), SinkError> {
        self.stage.process(samples)?;
        self.put()
    }

    fn finish(&mut self) -> Result<SinkStats, SinkError> {
        self.stage.finish()?;
        self.put()?;
        let target = &self.target;
        self.w.flush().map_err(|source| SinkError::Io { target: target.clone(), op: "flush", source })?;
        Ok(self.stage.stats(SampleFormat::S16))
    }

    fn abort(&mut self) {
        self.stage.abort();
    }
}

/// Discards the audio but shapes and counts it like the other sinks (benchmarks, dry runs).
pub struct NullSink {
    stage: ShapingStage,
}

impl NullSink {
    /// A null sink with these shaper settings (they change the counted length).
    pub fn new(shaper: ShaperSettings) -> Self {
        Self { stage: ShapingStage::new(shaper) }
    }
}

impl AudioSink for NullSink {
    fn begin(&mut self, sample_rate: u32) -> Result<(), SinkError> {
        self.stage.begin(sample_rate)
    }

    fn write(&mut self, samples: &[f32]) -> Result<(), SinkError> {
        self.stage.process(samples)?;
        Ok(())
    }

    fn finish(&mut self) -> Result<SinkStats, SinkError> {
        self.stage.finish()?;
        Ok(self.stage.stats(SampleFormat::S16))
    }

    fn abort(&mut self) {
        self.stage.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audio::Shaper;
    use std::io::Read;
    use std::sync::{Arc, Mutex};

    /// A `Write` (no `Seek`) that keeps what it got.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn signal() -> Vec<f32> {
        (0..1000).map(|i| (i as f32 * 0.05).sin() * 0.9).collect()
    }

    fn play(sink: &mut dyn AudioSink, rate: u32, x: &[f32]) -> SinkStats {
        sink.begin(rate).unwrap();
        for c in x.chunks(333) {
            sink.write(c).unwrap();
        }
        sink.finish().unwrap()
    }

    fn expected_s16(x: &[f32], st: ShaperSettings, rate: u32) -> Vec<u8> {
        let mut s = Shaper::new(st);
        s.begin(rate);
        let mut f = Vec::new();
        s.process(x, &mut f);
        s.finish(&mut f);
        let mut b = Vec::new();
        f32_to_s16le(&f, &mut b);
        b
    }

    #[test]
    fn streaming_header_bytes() {
        let h = streaming_wav_header(24000);
        let expect: [u8; 44] = [
            b'R', b'I', b'F', b'F', 0xff, 0xff, 0xff, 0xff, b'W', b'A', b'V', b'E', b'f', b'm', b't', b' ', 16, 0, 0, 0, 1, 0, 1, 0,
            0xc0, 0x5d, 0, 0, 0x80, 0xbb, 0, 0, 2, 0, 16, 0, b'd', b'a', b't', b'a', 0xff, 0xff, 0xff, 0xff,
        ];
        assert_eq!(h, expect);
    }

    #[test]
    fn wav_to_a_pipe_streams_without_seeking() {
        let (mut reader, writer) = std::io::pipe().unwrap();
        let st = ShaperSettings { lead_silence_ms: 10, trail_silence_ms: 5, ..ShaperSettings::default() };
        let x = signal();
        let handle = std::thread::spawn(move || {
            let mut v = Vec::new();
            reader.read_to_end(&mut v).unwrap();
            v
        });
        let mut sink = WavSink::stream(writer, "pipe", st);
        let a = play(&mut sink, 24000, &x);
        let b = play(&mut sink, 24000, &x[..10]);
        sink.close().unwrap();
        let bytes = handle.join().unwrap();
        assert_eq!(&bytes[..44], &streaming_wav_header(24000));
        let mut body = expected_s16(&x, st, 24000);
        body.extend(expected_s16(&x[..10], st, 24000));
        assert_eq!(&bytes[44..], &body[..]);
        assert_eq!(a.frames_written, 240 + 1000 + 120);
        assert_eq!(b.input_samples, 10);
    }

    #[test]
    fn wav_to_a_fifo_path_streams() {
        let dir = std::env::temp_dir().join(format!("herald-wav-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("out.wav");
        let _ = std::fs::remove_file(&fifo);
        let ok = std::process::Command::new("mkfifo").arg(&fifo).status().map(|s| s.success()).unwrap_or(false);
        if !ok {
            eprintln!("mkfifo unavailable; FIFO case covered by the in-process pipe test");
            return;
        }
        let f2 = fifo.clone();
        let reader = std::thread::spawn(move || std::fs::read(&f2).unwrap());
        let x = signal();
        let mut sink = WavSink::create(&fifo, ShaperSettings::default()).unwrap();
        play(&mut sink, 16000, &x);
        sink.close().unwrap();
        let bytes = reader.join().unwrap();
        assert_eq!(&bytes[..44], &streaming_wav_header(16000));
        assert_eq!(&bytes[44..], &expected_s16(&x, ShaperSettings::default(), 16000)[..]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn wav_file_has_a_correct_header_and_the_same_body() {
        let dir = std::env::temp_dir().join(format!("herald-wav-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("out.wav");
        let x = signal();
        let st = ShaperSettings::default();
        let mut sink = WavSink::create(&path, st).unwrap();
        play(&mut sink, 24000, &x);
        // Valid after the first utterance, before close.
        let r = hound::WavReader::open(&path).unwrap();
        assert_eq!(r.len(), 1000);
        play(&mut sink, 24000, &x);
        assert!(matches!(sink.begin(22050), Err(SinkError::Config(_))));
        sink.close().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let r = hound::WavReader::open(&path).unwrap();
        let spec = r.spec();
        assert_eq!((spec.channels, spec.sample_rate, spec.bits_per_sample), (1, 24000, 16));
        assert_eq!(r.len(), 2000);
        // Same header as the stream but with real sizes.
        let mut h = streaming_wav_header(24000);
        h[4..8].copy_from_slice(&(36u32 + 4000).to_le_bytes());
        h[40..44].copy_from_slice(&4000u32.to_le_bytes());
        assert_eq!(&bytes[..44], &h);
        let mut body = expected_s16(&x, st, 24000);
        body.extend(expected_s16(&x, st, 24000));
        assert_eq!(&bytes[44..], &body[..]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn raw_output_is_byte_exact_without_riff() {
        let buf = Shared::default();
        let st = ShaperSettings { gain: 2.0, ..ShaperSettings::passthrough() };
        let mut sink = RawSink::new(buf.clone(), "vec", st);
        let x = [0.0f32, 0.25, -0.25, 0.75, -1.0, f32::NAN];
        let stats = play(&mut sink, 24000, &x);
        let got = buf.0.lock().unwrap().clone();
        // ×2 then clamp: 0, 0.5, -0.5, 1 (clamped), -1 (clamped), NaN → 0.
        let expect: Vec<u8> = [0i16, 16384, -16384, 32767, -32767, 0].iter().flat_map(|s| s.to_le_bytes()).collect();
        assert_eq!(got, expect);
        assert!(!got.windows(4).any(|w| w == b"RIFF"));
        assert_eq!((stats.frames_written, stats.channels, stats.device_rate), (6, 1, 24000));
    }

    #[test]
    fn null_sink_counts_and_misuse_is_a_config_error() {
        let st = ShaperSettings { lead_silence_ms: 1, trail_silence_ms: 2, ..ShaperSettings::default() };
        let mut sink = NullSink::new(st);
        assert!(matches!(sink.write(&[0.0]), Err(SinkError::Config(_))));
        assert!(matches!(sink.begin(0), Err(SinkError::Config(_))));
        let s = play(&mut sink, 1000, &[0.5; 100]);
        assert_eq!((s.input_samples, s.frames_written), (100, 103));
        assert_eq!(SinkError::Config(String::new()).kind(), super::super::SinkErrorKind::Config);
    }
}
