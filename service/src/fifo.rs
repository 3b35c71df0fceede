//! The FIFO front-end of `herald serve`: lines of UTF-8 text written to a named pipe, each
//! spoken as one job through the speaker's [`Queue`].
//!
//! Lines are spoken in order, one at a time: the reader submits a line and waits for it (the
//! pipe holds what is written meanwhile), so the watchdog's heartbeat, beaten by the reader
//! between lines and by the job for every chunk, stops when a line hangs. A line that cannot be
//! spoken (not UTF-8, too long, nothing to say, a failing device) is logged with its number and
//! skipped. A socket front-end (Wyoming, HTTP) is a sibling of this module: it submits jobs with
//! [`Queue::try_submit`] and answers "busy" when refused.

use std::fs::File;
use std::io::{ErrorKind, Read};
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::OFlag;
use nix::poll::{PollFd, PollFlags};
use nix::sys::stat::Mode;

use board::audio::{AlsaSink, AudioSink};

use crate::cancel::Stop;
use crate::device::DeviceHealth;
use crate::live::Live;
use crate::notify::{Heartbeat, Notifier, NotifyState};
use crate::output::Target;
use crate::queue::Queue;
use crate::speaker::Job;

/// Permissions of the FIFO herald creates: the service's user may read and write, its group
/// may write (root may always write).
pub const FIFO_MODE: u32 = 0o620;

/// How often the read loop wakes up to check for a stop and to prove it is alive, ms.
const POLL_MS: i32 = 200;

/// The longest line accepted, in bytes: the longest text herald reads
/// ([`engine::segment::MAX_LONG_TEXT_CHARS`]), 4 bytes a character.
pub const MAX_LINE_BYTES: usize = engine::segment::MAX_LONG_TEXT_CHARS * 4;

/// Errors of the FIFO (the path is the one given with `--fifo`).
#[derive(Debug, thiserror::Error)]
pub enum FifoError {
    /// Something other than a FIFO is at the path.
    #[error("--fifo {}: exists and is not a FIFO", .0.display())]
    NotAFifo(PathBuf),
    /// The FIFO's directory does not exist (`/run/herald` outside the systemd unit that makes it).
    #[error(
        "--fifo {}: the directory {} does not exist; create it, name another FIFO with --fifo PATH \
         (serve.fifo), turn the FIFO off with serve.fifo = \"off\" (--fifo off), or run herald from its \
         systemd unit, whose RuntimeDirectory=herald makes /run/herald",
        .path.display(),
        .dir.display()
    )]
    NoDirectory {
        /// The FIFO.
        path: PathBuf,
        /// Its directory, which is missing.
        dir: PathBuf,
    },
    /// The path cannot be passed to the kernel.
    #[error("--fifo {}: the path contains a NUL byte", .0.display())]
    Nul(PathBuf),
    /// The FIFO could not be created or opened; `op` says what was done.
    #[error("--fifo {}: {op}{source}", path.display())]
    Io {
        /// The FIFO.
        path: PathBuf,
        /// What was done, with its separator: "cannot create the FIFO: ", "cannot open: ", ….
        op: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Polling or reading the open FIFO failed (the kernel's fault, or a bug).
    #[error("--fifo {}: {op}{source}", path.display())]
    Read {
        /// The FIFO.
        path: PathBuf,
        /// "poll failed: " or "read failed: ".
        op: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// The FIFO herald reads, opened read-write so that it never sees end-of-file when the last
/// writer closes, and non-blocking so that the loop can poll it with a timeout. A FIFO herald
/// created is removed when this is dropped.
#[derive(Debug)]
pub struct Fifo {
    path: PathBuf,
    file: File,
    created: bool,
}

impl Fifo {
    /// Open the FIFO at `path`, creating it (mode [`FIFO_MODE`]) when missing.
    ///
    /// # Errors
    /// [`FifoError`]: something else is at the path, the folder does not exist, no permission.
    pub fn open(path: &Path) -> Result<Fifo, FifoError> {
        let io = |op, source| FifoError::Io { path: path.to_owned(), op, source };
        let created = match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_fifo() => false,
            Ok(_) => return Err(FifoError::NotAFifo(path.to_owned())),
            Err(e) if e.kind() == ErrorKind::NotFound => {
                if path.as_os_str().as_encoded_bytes().contains(&0) {
                    return Err(FifoError::Nul(path.to_owned()));
                }
                let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
                if !dir.is_dir() {
                    return Err(FifoError::NoDirectory { path: path.to_owned(), dir: dir.to_owned() });
                }
                nix::unistd::mkfifo(path, Mode::from_bits_truncate(FIFO_MODE))
                    .map_err(|e| io("cannot create the FIFO: ", e.into()))?;
                // mkfifo applies the umask; set the documented mode
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(FIFO_MODE))
                    .map_err(|e| io("cannot set its permissions: ", e))?;
                true
            }
            Err(e) => return Err(io("", e)),
        };
        let file = std::fs::OpenOptions::new().read(true).write(true).custom_flags(OFlag::O_NONBLOCK.bits()).open(path);
        match file {
            Ok(file) => Ok(Fifo { path: path.to_owned(), file, created }),
            Err(e) => {
                if created {
                    let _ = std::fs::remove_file(path);
                }
                Err(io("cannot open: ", e))
            }
        }
    }

    /// The FIFO's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Wait up to `timeout_ms` for data; `Ok(true)` when there is some to read.
    fn wait_readable(&self, timeout_ms: i32) -> std::io::Result<bool> {
        let mut fds = [PollFd::new(&self.file, PollFlags::POLLIN)];
        match nix::poll::poll(&mut fds, timeout_ms) {
            Ok(n) => Ok(n > 0 && fds[0].revents().is_some_and(|r| r.contains(PollFlags::POLLIN))),
            Err(nix::errno::Errno::EINTR) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }
}

impl AsFd for Fifo {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.file.as_fd()
    }
}

impl Drop for Fifo {
    fn drop(&mut self) {
        if self.created {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Splits the bytes read from the FIFO into lines (`\n`, an optional `\r` before it removed),
/// numbering every line from 1; a line longer than `max` bytes is reported as [`Line::TooLong`]
/// and its remaining bytes are dropped up to its newline.
#[derive(Debug)]
pub struct LineSplitter {
    pending: Vec<u8>,
    max: usize,
    /// Bytes of the current over-long line that were dropped.
    overflow: usize,
    number: u64,
}

/// One complete line from the FIFO.
#[derive(Debug, PartialEq)]
pub enum Line {
    /// The line's number and bytes (not yet checked for UTF-8).
    Text(u64, Vec<u8>),
    /// The line was longer than the limit: its number and length in bytes.
    TooLong(u64, usize),
}

impl LineSplitter {
    /// A splitter for lines of at most `max` bytes.
    pub fn new(max: usize) -> Self {
        LineSplitter { pending: Vec::new(), max, overflow: 0, number: 0 }
    }

    /// Split `bytes` (continuing the previous call's partial line) and append the complete
    /// lines to `out`.
    pub fn push(&mut self, mut bytes: &[u8], out: &mut Vec<Line>) {
        while !bytes.is_empty() {
            let (part, rest, complete) = match bytes.iter().position(|&b| b == b'\n') {
                Some(i) => (&bytes[..i], &bytes[i + 1..], true),
                None => (bytes, &[][..], false),
            };
            if self.overflow > 0 || self.pending.len() + part.len() > self.max {
                self.overflow += self.pending.len() + part.len();
                self.pending.clear();
            } else {
                self.pending.extend_from_slice(part);
            }
            if complete {
                self.number += 1;
                if self.overflow > 0 {
                    out.push(Line::TooLong(self.number, self.overflow));
                    self.overflow = 0;
                } else {
                    let mut line = std::mem::take(&mut self.pending);
                    if line.last() == Some(&b'\r') {
                        line.pop();
                    }
                    out.push(Line::Text(self.number, line));
                }
            }
            bytes = rest;
        }
    }
}

/// What the FIFO front-end speaks with.
#[derive(Debug, Clone)]
pub struct FifoSettings {
    /// The voice of every line and the settings of its output, as they are when it is read
    /// (a reload changes them for the next line).
    pub live: Live,
    /// The playback device's state (when playing): a line's device failure marks it missing,
    /// a line played marks it present. Every line tries the device again.
    pub device: Option<DeviceHealth>,
    /// Write each line's audio as `DIR/NNNNNN.wav` (the line's number) instead of playing it.
    pub out_dir: Option<PathBuf>,
    /// The model's sample rate, Hz (for the seconds of audio in the log).
    pub sample_rate: u32,
    /// The configured KV capacity (`synthesis.kv_capacity`), named when a line is cut short.
    pub kv_capacity: usize,
}

/// What the read loop did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Served {
    /// Lines spoken (also those a stop cut short).
    pub spoken: u64,
    /// Lines that could not be spoken.
    pub skipped: u64,
}

/// Read lines from `fifo` and speak each through `queue` until `stop`, sending `STATUS=` to
/// `notifier` as it goes and beating `heartbeat` while alive.
///
/// # Errors
/// Polling or reading the FIFO failed ([`FifoError::Read`]); `served` holds the counts so far.
pub fn serve(
    fifo: &Fifo,
    queue: &Queue,
    settings: &FifoSettings,
    notifier: Option<&Notifier>,
    heartbeat: &Heartbeat,
    stop: &Stop,
    served: &mut Served,
) -> Result<(), FifoError> {
    let status = |s: &str| {
        if let Some(n) = notifier {
            n.notify(&[NotifyState::Status(s)]);
        }
    };
    let io = |op, source| FifoError::Read { path: fifo.path.clone(), op, source };
    let mut splitter = LineSplitter::new(MAX_LINE_BYTES);
    let mut buf = vec![0u8; 64 * 1024];
    let mut lines = Vec::new();
    let mut file = &fifo.file;
    while !stop.is_stopped() {
        heartbeat.beat();
        if !fifo.wait_readable(POLL_MS).map_err(|e| io("poll failed: ", e))? {
            continue;
        }
        let n = match file.read(&mut buf) {
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => continue,
            Err(e) => return Err(io("read failed: ", e)),
        };
        splitter.push(&buf[..n], &mut lines);
        for line in lines.drain(..) {
            if stop.is_stopped() {
                break;
            }
            let (number, bytes) = match line {
                Line::TooLong(number, bytes) => {
                    log::error!(
                        "line {number}: {bytes} bytes, longer than the longest text herald accepts ({} characters); skipped",
                        engine::segment::MAX_LONG_TEXT_CHARS
                    );
                    served.skipped += 1;
                    continue;
                }
                Line::Text(number, bytes) => (number, bytes),
            };
            let text = match String::from_utf8(bytes) {
                Ok(t) => t,
                Err(e) => {
                    log::error!("line {number}: not valid UTF-8 (first bad byte at offset {}); skipped", e.utf8_error().valid_up_to());
                    served.skipped += 1;
                    continue;
                }
            };
            if text.trim().is_empty() {
                log::debug!("line {number}: empty; nothing to say");
                continue;
            }
            status(&format!("speaking line {number}"));
            if speak_line(queue, settings, heartbeat, stop, number, &text) {
                served.spoken += 1;
            } else {
                served.skipped += 1;
            }
            status(&format!("ready; {} line(s) spoken, {} skipped", served.spoken, served.skipped));
        }
    }
    Ok(())
}

/// Speak one line as a job and log how it went; `true` when it was spoken.
fn speak_line(queue: &Queue, settings: &FifoSettings, heartbeat: &Heartbeat, stop: &Stop, number: u64, text: &str) -> bool {
    // the device is open only while speaking, so other clients can use it in between
    let live = settings.live.get();
    let target = match &settings.out_dir {
        Some(dir) => match Target::File(dir.join(format!("{number:06}.wav"))).open(&live.output) {
            Ok(sink) => Target::Sink { sink, plays: false },
            Err(e) => {
                log::error!("line {number}: {}; skipped", crate::one_line(&e));
                return false;
            }
        },
        None => {
            let sink: Box<dyn AudioSink + Send> = Box::new(AlsaSink::new(live.output.alsa, live.output.shaper));
            Target::Sink { sink, plays: true }
        }
    };
    let plays = target.plays();
    let chars = text.chars().count();
    let hb = heartbeat.clone();
    let mut job = Job::new(live.voice.request(text), target).speed(live.voice.speed);
    if let Some(lead) = live.amp_lead {
        job = job.amp_lead(lead);
    }
    let job = job
        .on_begin(move |req| match req.seed {
            Some(s) => log::info!("line {number}: {chars} characters, seed {s}"),
            None => log::info!("line {number}: {chars} characters, greedy"),
        })
        .on_chunk(move || hb.beat());
    let outcome = match queue.submit(job) {
        Ok(handle) => handle.wait(),
        Err(refused) => {
            log::error!("line {number}: {refused}; skipped");
            return false;
        }
    };
    if plays && let Some(device) = &settings.device {
        device.note(outcome.as_ref().map(|_| ()));
    }
    let spoken = match outcome {
        Ok(s) => s,
        Err(e) => {
            log::error!("line {number}: {}; skipped", crate::one_line(&e));
            return false;
        }
    };
    let Some(report) = spoken.report else {
        let why = if stop.is_stopped() { "stopped by a signal" } else { "cancelled" };
        log::info!("line {number}: {why}; the audio so far was finished cleanly");
        return true;
    };
    log::info!(
        "line {number}: {} frames ({:.2} s of audio) in {:.2} s, time to first audio {:.0} ms, xruns {}",
        report.frames,
        report.samples as f64 / f64::from(settings.sample_rate),
        report.total,
        report.ttfa * 1e3,
        spoken.stats.xruns
    );
    if report.stop == engine::StopReason::Capacity {
        log::warn!(
            "line {number}: cut short: the KV cache (synthesis.kv_capacity = {}) filled after {} frames; raise it or split the text",
            settings.kv_capacity,
            report.frames
        );
    }
    true
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    fn split(chunks: &[&[u8]], max: usize) -> Vec<Line> {
        let mut s = LineSplitter::new(max);
        let mut out = Vec::new();
        for c in chunks {
            s.push(c, &mut out);
        }
        out
    }

    #[test]
    fn lines_are_split_across_reads_and_numbered() {
        let out = split(&[b"Hel", b"lo.\nSecond\r\n\nthi", b"rd"], 100);
        assert_eq!(out, vec![Line::Text(1, b"Hello.".to_vec()), Line::Text(2, b"Second".to_vec()), Line::Text(3, Vec::new())]);
    }

    #[test]
    fn an_overlong_line_is_dropped_up_to_its_newline() {
        let out = split(&[b"12345", b"6789\nok\n"], 8);
        assert_eq!(out, vec![Line::TooLong(1, 9), Line::Text(2, b"ok".to_vec())]);
        // exactly the limit is accepted
        let out = split(&[b"12345678\n"], 8);
        assert_eq!(out, vec![Line::Text(1, b"12345678".to_vec())]);
    }

    #[test]
    fn the_fifo_is_created_polled_and_removed() {
        let d = std::env::temp_dir().join(format!("herald-service-fifo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("say");
        let f = Fifo::open(&p).unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, FIFO_MODE);
        assert!(!f.wait_readable(10).unwrap());
        {
            use std::io::Write;
            let mut w = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
            w.write_all(b"hi\n").unwrap();
        }
        assert!(f.wait_readable(1000).unwrap());
        // an existing FIFO is reused and left in place
        let again = Fifo::open(&p).unwrap();
        drop(again);
        assert!(p.exists());
        drop(f);
        assert!(!p.exists());
        std::fs::write(&p, b"x").unwrap();
        assert!(matches!(Fifo::open(&p), Err(FifoError::NotAFifo(_))));
        let e = Fifo::open(&d.join("no/such/say")).unwrap_err().to_string();
        let dir = d.join("no/such");
        assert!(e.contains(&format!("the directory {} does not exist", dir.display())), "{e}");
        for fix in ["--fifo PATH", "serve.fifo = \"off\"", "RuntimeDirectory=herald"] {
            assert!(e.contains(fix), "{fix}: {e}");
        }
        std::fs::remove_dir_all(&d).unwrap();
    }
}
