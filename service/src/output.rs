//! Where a job's audio goes: the sink factory ([`Target`] + [`OutputSettings`]). Files are
//! written atomically through board's [`AtomicFile`] (the one way herald replaces a file).

use std::path::{Path, PathBuf};

pub use board::fsutil::{AtomicFile, write_atomic};

use crate::encode::{Codec, EncodedSink};
use board::audio::{AlsaSettings, AlsaSink, AudioSink, RawSink, ShaperSettings, SinkError, SinkStats, WavSink};

/// The settings every sink the factory makes shares: the utterance shaping, and the ALSA device.
#[derive(Debug, Clone, Default)]
pub struct OutputSettings {
    /// Gain, silences and fades of every utterance (the same for every sink).
    pub shaper: ShaperSettings,
    /// The playback device of [`Target::Device`].
    pub alsa: AlsaSettings,
}

/// Where one job's audio goes. The speaker opens it when the job starts (after the text was
/// checked), so a waiting job holds no device and no file.
pub enum Target {
    /// The ALSA playback device of [`OutputSettings::alsa`], with the amplifier line switched
    /// around the utterance.
    Device,
    /// A 16-bit mono WAV file, written atomically ([`AtomicFile`]; renamed into place when the
    /// utterance finished, also after a cancel).
    File(PathBuf),
    /// An encoded file ([`Codec`]: mp3, flac, opus), written atomically like [`Target::File`].
    Encoded {
        /// The file.
        path: PathBuf,
        /// Its format.
        codec: Codec,
    },
    /// WAV to standard output (streaming header).
    WavStdout,
    /// Raw S16LE samples to standard output.
    RawStdout,
    /// A sink the caller made (not begun, or begun by [`crate::Preparing::begin_early`]);
    /// `plays` switches the amplifier line around it like [`Target::Device`].
    Sink {
        /// The sink.
        sink: Box<dyn AudioSink + Send>,
        /// Whether it plays through the speaker (the amplifier line is switched).
        plays: bool,
    },
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Device => f.write_str("Device"),
            Target::File(p) => f.debug_tuple("File").field(p).finish(),
            Target::Encoded { path, codec } => f.debug_struct("Encoded").field("path", path).field("codec", codec).finish(),
            Target::WavStdout => f.write_str("WavStdout"),
            Target::RawStdout => f.write_str("RawStdout"),
            Target::Sink { plays, .. } => f.debug_struct("Sink").field("plays", plays).finish_non_exhaustive(),
        }
    }
}

impl Target {
    /// Whether the audio goes to the speaker (the amplifier line is switched around it).
    pub fn plays(&self) -> bool {
        match self {
            Target::Device => true,
            Target::Sink { plays, .. } => *plays,
            _ => false,
        }
    }

    /// The sink factory: make this target's sink with `out`'s settings (not begun). A file is
    /// created now (under its temporary name).
    ///
    /// # Errors
    /// The file cannot be created ([`SinkError::Io`]).
    pub fn open(self, out: &OutputSettings) -> Result<Box<dyn AudioSink + Send>, SinkError> {
        Ok(match self {
            Target::Device => Box::new(AlsaSink::new(out.alsa.clone(), out.shaper)),
            Target::File(path) => Box::new(WavFile::create(&path, out.shaper)?),
            Target::Encoded { path, codec } => Box::new(EncodedFile::create(&path, codec, out.shaper)?),
            Target::WavStdout => Box::new(WavSink::stdout(out.shaper)),
            Target::RawStdout => Box::new(RawSink::stdout(out.shaper)),
            Target::Sink { sink, .. } => sink,
        })
    }
}

/// A WAV file written through an [`AtomicFile`]: committed (renamed into place) by the first
/// successful `finish`.
pub struct WavFile {
    wav: WavSink,
    file: Option<AtomicFile>,
    /// The target's path, for messages (the WAV writer only knows the temporary file's).
    target: String,
}

impl WavFile {
    /// Create the temporary file for `path` and a [`WavSink`] on it.
    ///
    /// # Errors
    /// [`SinkError::Io`] when the file cannot be created.
    pub fn create(path: &Path, shaper: ShaperSettings) -> Result<Self, SinkError> {
        let file =
            AtomicFile::create(path).map_err(|source| SinkError::Io { target: path.display().to_string(), op: "create", source })?;
        let target = path.display().to_string();
        let wav = WavSink::create(file.path(), shaper).map_err(|e| name_target(e, &target))?;
        Ok(WavFile { wav, file: Some(file), target })
    }
}

/// `e` with the target's path where it names the temporary file: the user asked for
/// `out.wav`, not `.out.wav.1234-abcdef.tmp` (a full disk, say, shows up while writing).
fn name_target(e: SinkError, target: &str) -> SinkError {
    match e {
        SinkError::Io { op, source, .. } => SinkError::Io { target: target.to_owned(), op, source },
        SinkError::Wav { source, .. } => SinkError::Wav { target: target.to_owned(), source },
        other => other,
    }
}

impl AudioSink for WavFile {
    fn begin(&mut self, sample_rate: u32) -> Result<(), SinkError> {
        self.wav.begin(sample_rate).map_err(|e| name_target(e, &self.target))
    }

    fn write(&mut self, samples: &[f32]) -> Result<(), SinkError> {
        self.wav.write(samples).map_err(|e| name_target(e, &self.target))
    }

    fn finish(&mut self) -> Result<SinkStats, SinkError> {
        let stats = self.wav.finish().map_err(|e| name_target(e, &self.target))?;
        if let Some(file) = self.file.take() {
            let target = file.target().display().to_string();
            file.commit().map_err(|source| SinkError::Io { target, op: "rename into place", source })?;
        }
        Ok(stats)
    }

    fn abort(&mut self) {
        self.wav.abort();
    }
}

/// An encoded file ([`Codec`]) written through an [`AtomicFile`]: committed (renamed into
/// place) by the first successful `finish`, removed after an abort like [`WavFile`].
pub struct EncodedFile {
    sink: EncodedSink,
    file: Option<AtomicFile>,
}

impl EncodedFile {
    /// Create the temporary file for `path` and an [`EncodedSink`] of `codec` on it.
    ///
    /// # Errors
    /// [`SinkError::Io`] when the file cannot be created.
    pub fn create(path: &Path, codec: Codec, shaper: ShaperSettings) -> Result<Self, SinkError> {
        let target = path.display().to_string();
        let io = |op, source| SinkError::Io { target: target.clone(), op, source };
        let mut file = AtomicFile::create(path).map_err(|e| io("create", e))?;
        let w = file.file_mut().try_clone().map_err(|e| io("create", e))?;
        let sink = EncodedSink::new(codec, std::io::BufWriter::with_capacity(1 << 16, w), &target, shaper);
        Ok(EncodedFile { sink, file: Some(file) })
    }
}

impl AudioSink for EncodedFile {
    fn begin(&mut self, sample_rate: u32) -> Result<(), SinkError> {
        self.sink.begin(sample_rate)
    }

    fn write(&mut self, samples: &[f32]) -> Result<(), SinkError> {
        self.sink.write(samples)
    }

    fn finish(&mut self) -> Result<SinkStats, SinkError> {
        let stats = self.sink.finish()?;
        if let Some(file) = self.file.take() {
            let target = file.target().display().to_string();
            file.commit().map_err(|source| SinkError::Io { target, op: "rename into place", source })?;
        }
        Ok(stats)
    }

    fn abort(&mut self) {
        self.sink.abort();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("herald-service-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn names(d: &Path) -> Vec<String> {
        let mut v: Vec<String> =
            std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    #[test]
    fn a_wav_file_appears_at_finish_and_not_after_an_abort() {
        let d = scratch("wav");
        let p = d.join("a.wav");
        let mut s = Target::File(p.clone()).open(&OutputSettings::default()).unwrap();
        s.begin(24_000).unwrap();
        s.write(&[0.25; 480]).unwrap();
        assert!(!p.exists());
        s.finish().unwrap();
        let wav = std::fs::read(&p).unwrap();
        assert_eq!(&wav[..4], b"RIFF");
        assert_eq!(wav.len(), 44 + 480 * 2);
        drop(s);
        let q = d.join("b.wav");
        let mut s = Target::File(q.clone()).open(&OutputSettings::default()).unwrap();
        s.begin(24_000).unwrap();
        s.write(&[0.25; 480]).unwrap();
        s.abort();
        drop(s);
        assert_eq!(names(&d), ["a.wav"]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn an_encoded_file_appears_at_finish_and_not_after_an_abort() {
        let d = scratch("enc");
        let p = d.join("a.flac");
        let mut s = Target::Encoded { path: p.clone(), codec: Codec::Flac }.open(&OutputSettings::default()).unwrap();
        s.begin(24_000).unwrap();
        s.write(&[0.25; 480]).unwrap();
        assert!(!p.exists());
        s.finish().unwrap();
        assert_eq!(&std::fs::read(&p).unwrap()[..4], b"fLaC");
        drop(s);
        let mut s = Target::Encoded { path: d.join("b.mp3"), codec: Codec::Mp3 }.open(&OutputSettings::default()).unwrap();
        s.begin(24_000).unwrap();
        s.write(&[0.25; 4800]).unwrap();
        s.abort();
        drop(s);
        assert_eq!(names(&d), ["a.flac"]);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
