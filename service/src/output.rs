//! Where a job's audio goes: the sink factory ([`Target`] + [`OutputSettings`]) and the one way
//! herald writes a file atomically ([`AtomicFile`], [`write_atomic`]).

use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use board::audio::{AlsaSettings, AlsaSink, AudioSink, RawSink, ShaperSettings, SinkError, SinkStats, WavSink};

/// A file written under a temporary name in its own folder (`.NAME.partial-XXXXXX`) and moved
/// into place by [`commit`](Self::commit) (fsync, then rename): a failure or a crash never leaves
/// a truncated file under the target's name, nor destroys the file that was there. A target that
/// exists and is not a regular file (`/dev/null`, a FIFO) is written directly. The temporary file
/// is removed when the `AtomicFile` is dropped uncommitted.
#[derive(Debug)]
pub struct AtomicFile {
    target: PathBuf,
    temp: Option<tempfile::NamedTempFile>,
}

impl AtomicFile {
    /// Create the temporary file next to `target` (mode 0666 less the umask, like
    /// `File::create`).
    ///
    /// # Errors
    /// `target` is a directory or has no file name; the folder does not take a new file.
    pub fn create(target: &Path) -> io::Result<AtomicFile> {
        match std::fs::metadata(target) {
            Ok(m) if m.is_dir() => return Err(io::Error::new(io::ErrorKind::IsADirectory, "is a directory")),
            Ok(m) if !m.is_file() => return Ok(AtomicFile { target: target.to_owned(), temp: None }),
            _ => {}
        }
        let name = target
            .file_name()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "not a file name"))?
            .to_string_lossy()
            .into_owned();
        let dir = target.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let temp = tempfile::Builder::new()
            .prefix(&format!(".{name}.partial-"))
            .permissions(std::fs::Permissions::from_mode(0o666))
            .tempfile_in(dir)?;
        Ok(AtomicFile { target: target.to_owned(), temp: Some(temp) })
    }

    /// The path to write: the temporary file, or the target itself when it is written directly.
    pub fn path(&self) -> &Path {
        self.temp.as_ref().map_or(&self.target, |t| t.path())
    }

    /// The file's final name.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Flush the temporary file to the disk and rename it over the target.
    ///
    /// # Errors
    /// The fsync or the rename failed (the temporary file is then removed).
    pub fn commit(mut self) -> io::Result<()> {
        if let Some(temp) = self.temp.take() {
            temp.as_file().sync_all()?;
            temp.persist(&self.target).map_err(|e| e.error)?;
        }
        Ok(())
    }
}

/// Write `bytes` to `path` through an [`AtomicFile`].
///
/// # Errors
/// As [`AtomicFile::create`], the write, and [`AtomicFile::commit`].
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let file = AtomicFile::create(path)?;
    match &file.temp {
        Some(t) => t.as_file().write_all(bytes)?,
        None => std::fs::OpenOptions::new().write(true).truncate(true).open(path)?.write_all(bytes)?,
    }
    file.commit()
}

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
}

impl WavFile {
    /// Create the temporary file for `path` and a [`WavSink`] on it.
    ///
    /// # Errors
    /// [`SinkError::Io`] when the file cannot be created.
    pub fn create(path: &Path, shaper: ShaperSettings) -> Result<Self, SinkError> {
        let file = AtomicFile::create(path)
            .map_err(|source| SinkError::Io { target: path.display().to_string(), op: "create", source })?;
        let wav = WavSink::create(file.path(), shaper)?;
        Ok(WavFile { wav, file: Some(file) })
    }
}

impl AudioSink for WavFile {
    fn begin(&mut self, sample_rate: u32) -> Result<(), SinkError> {
        self.wav.begin(sample_rate)
    }

    fn write(&mut self, samples: &[f32]) -> Result<(), SinkError> {
        self.wav.write(samples)
    }

    fn finish(&mut self) -> Result<SinkStats, SinkError> {
        let stats = self.wav.finish()?;
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
        let mut v: Vec<String> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    #[test]
    fn atomic_writes_replace_only_when_committed() {
        let d = scratch("atomic");
        let p = d.join("out.json");
        std::fs::write(&p, b"old").unwrap();
        let f = AtomicFile::create(&p).unwrap();
        assert!(f.path().file_name().unwrap().to_string_lossy().starts_with(".out.json.partial-"));
        std::fs::write(f.path(), b"new").unwrap();
        drop(f);
        assert_eq!(std::fs::read(&p).unwrap(), b"old", "an uncommitted file leaves the target alone");
        assert_eq!(names(&d), ["out.json"], "and no temporary file");
        write_atomic(&p, b"new").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        assert_eq!(names(&d), ["out.json"]);
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_ne!(mode & 0o044, 0, "readable like File::create makes it (umask permitting): {mode:o}");
        assert!(AtomicFile::create(&d).is_err(), "a directory is refused");
        // a device is written directly, never renamed over
        write_atomic(Path::new("/dev/null"), b"x").unwrap();
        assert!(!std::fs::metadata("/dev/null").unwrap().is_file());
        std::fs::remove_dir_all(&d).unwrap();
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
}
