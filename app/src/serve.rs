//! `herald serve`: the appliance mode that the systemd unit runs.
//!
//! herald loads the bundle once, creates a FIFO (default [`DEFAULT_FIFO`]) and speaks every
//! line of UTF-8 text written to it, one line at a time, through the configured ALSA device (or
//! into one WAV file per line with `--out-dir`). A line that cannot be spoken (not UTF-8, too
//! long, nothing to say, a failing device) is logged with its line number and skipped; the
//! service keeps running. SIGTERM or SIGINT stops the current line within a frame (with a
//! fade-out) and exits with code 0.
//!
//! systemd integration follows the sd_notify(3) protocol, written here without libsystemd: when
//! `$NOTIFY_SOCKET` is set, herald sends datagrams of newline-separated `KEY=VALUE` assignments
//! to that `AF_UNIX` socket (a path, or an abstract name when it starts with `@`):
//! `READY=1` once the engine is loaded, `STATUS=…` as it works, `WATCHDOG=1` every half of
//! `$WATCHDOG_USEC` while its loop is alive (the keep-alive stops when a line hangs, so systemd's
//! `WatchdogSec=` restarts a stuck service), and `STOPPING=1` on shutdown.

use std::fs::File;
use std::io::{ErrorKind, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use board::audio::{AlsaSink, AudioSink, WavSink};
use engine::prompt::{PromptError, PromptMode};
use engine::{Engine, Request, StopReason};

use crate::config::{CliOverrides, Config, SynthesisMode};
use crate::{EXIT_BUNDLE, EXIT_INPUT, Failure, FileOut, INTERRUPTED, engine_code, fail, init_logging, load_config, rss_mb};

/// The FIFO `herald serve` reads when `--fifo` is not given (in systemd's
/// `RuntimeDirectory=herald`).
pub const DEFAULT_FIFO: &str = "/run/herald/say";

/// Permissions of the FIFO herald creates: the service's user may read and write, its group
/// may write (root may always write).
const FIFO_MODE: u32 = 0o620;

/// How often the read loop wakes up to check for a stop signal and to prove it is alive.
const POLL_MS: i32 = 200;

/// The longest line accepted, in bytes: the longest text the engine takes, 4 bytes a character.
const MAX_LINE_BYTES: usize = engine::prompt::MAX_TEXT_CHARS * 4;

/// The flags of `herald serve`.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// The FIFO to read lines of text from (created when missing; removed on exit if herald
    /// created it).
    #[arg(long, value_name = "PATH", default_value = DEFAULT_FIFO)]
    fifo: PathBuf,
    /// Write each line's audio as a 16-bit mono WAV `DIR/NNNNNN.wav` (NNNNNN = the line's
    /// number since start, from 000001) instead of playing it.
    #[arg(long, value_name = "DIR")]
    out_dir: Option<PathBuf>,
    /// Bundle directory (overrides model.bundle).
    #[arg(long, value_name = "DIR")]
    bundle: Option<PathBuf>,
    /// ALSA playback PCM (overrides audio.device).
    #[arg(long, value_name = "PCM")]
    device: Option<String>,
}

/// Run `herald serve` until SIGTERM/SIGINT. Startup errors map to the documented exit codes
/// (2 configuration, FIFO or output folder; 4 bundle); once running, a line that fails is
/// logged and skipped.
pub(crate) fn run(config: Option<&Path>, args: ServeArgs) -> Result<(), Failure> {
    let mut cfg = load_config(config)?;
    init_logging(cfg.log.filter(std::env::var("RUST_LOG").ok().as_deref()));
    let overrides = CliOverrides { bundle: args.bundle, device: args.device, ..CliOverrides::default() };
    cfg.apply_cli(&overrides).map_err(|e| fail(EXIT_INPUT, e))?;
    if let Some(dir) = &args.out_dir
        && !dir.is_dir()
    {
        return Err(fail(EXIT_INPUT, anyhow::anyhow!("--out-dir {}: not a directory", dir.display())));
    }
    let notifier = match Notifier::from_env() {
        Ok(n) => n,
        Err(e) => {
            log::warn!("{e}; running without systemd notifications");
            None
        }
    };
    // The amplifier line (only when playing): a missing chip or line stops here, at start-up.
    let amp = match &args.out_dir {
        None => crate::open_amplifier(&cfg)?.map(std::cell::RefCell::new),
        Some(_) => None,
    };
    let fifo = Fifo::open(&args.fifo).map_err(|e| fail(EXIT_INPUT, e))?;
    let status = |s: &str| {
        if let Some(n) = &notifier {
            n.send(&format!("STATUS={s}"));
        }
    };
    let t0 = Instant::now();
    status(&format!("loading bundle {}", cfg.model.bundle.display()));
    let manifest = engine::read_manifest(&cfg.model.bundle)
        .map_err(|e| fail(EXIT_BUNDLE, anyhow::Error::new(e).context(format!("bundle {}", cfg.model.bundle.display()))))?;
    // The board, as `speak` sees it: thread placement, memory, the calibrated ramp.
    let tuned = crate::tuning::tune(&cfg, &cfg.model.bundle, &manifest).map_err(crate::tune_failure)?;
    tuned.log();
    backend_tract::set_compute_threads(tuned.threads);
    let engine = Engine::load(&cfg.model.bundle, &backend_tract::Tract, &tuned.settings).map_err(|e| {
        let code = engine_code(&e);
        fail(code, anyhow::Error::new(e).context(format!("bundle {}", cfg.model.bundle.display())))
    })?;
    // A language or speaker the bundle lacks would fail every line: refuse to start instead.
    if let Err(e @ (PromptError::UnknownLanguage { .. } | PromptError::UnknownSpeaker { .. })) =
        engine.bundle().prompter.layout("Hello.", Some(&cfg.synthesis.language), cfg.synthesis.speaker.as_deref(), prompt_mode(&cfg))
    {
        return Err(fail(EXIT_INPUT, e));
    }
    let rate = engine.bundle().manifest.audio.sample_rate;
    let ready = format!("ready; reading lines from {}", fifo.path.display());
    log::info!(
        "{ready} (bundle {} loaded in {:.2} s, resident memory {})",
        cfg.model.bundle.display(),
        t0.elapsed().as_secs_f64(),
        rss_mb().map_or_else(|| "unknown".into(), |m| format!("{m:.0} MB"))
    );
    if let Some(n) = &notifier {
        n.send(&format!("READY=1\nSTATUS={ready}"));
    }
    let heartbeat = Heartbeat::new();
    let watchdog = notifier.as_ref().and_then(|n| Watchdog::start(n, &heartbeat));

    let mut server =
        Server { cfg: &cfg, engine: &engine, rate, out_dir: args.out_dir.as_deref(), heartbeat: &heartbeat, amp: amp.as_ref(), spoken: 0, skipped: 0 };
    let result = server.read_loop(&fifo, &status);
    let stopping = format!("stopping; {} line(s) spoken, {} skipped", server.spoken, server.skipped);
    log::info!("{stopping}");
    if let Some(n) = &notifier {
        n.send(&format!("STOPPING=1\nSTATUS={stopping}"));
    }
    if let Some(w) = watchdog {
        w.stop();
    }
    drop(fifo);
    result
}

fn prompt_mode(cfg: &Config) -> PromptMode {
    match cfg.synthesis.mode {
        SynthesisMode::NonStreaming => PromptMode::NonStreaming,
        SynthesisMode::Streaming => PromptMode::Streaming,
    }
}

/// The FIFO herald reads, opened read-write so that it never sees end-of-file when the last
/// writer closes, and non-blocking so that the loop can poll it with a timeout.
struct Fifo {
    path: PathBuf,
    file: File,
    /// herald made the FIFO and removes it when it stops.
    created: bool,
}

impl Fifo {
    fn open(path: &Path) -> anyhow::Result<Fifo> {
        let created = match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_fifo() => false,
            Ok(_) => anyhow::bail!("--fifo {}: exists and is not a FIFO", path.display()),
            Err(e) if e.kind() == ErrorKind::NotFound => {
                let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
                    .map_err(|_| anyhow::anyhow!("--fifo {}: the path contains a NUL byte", path.display()))?;
                // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
                if unsafe { libc::mkfifo(c.as_ptr(), FIFO_MODE) } != 0 {
                    let e = std::io::Error::last_os_error();
                    anyhow::bail!("--fifo {}: cannot create the FIFO: {e}", path.display());
                }
                // mkfifo applies the umask; set the documented mode
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(FIFO_MODE))
                    .map_err(|e| anyhow::anyhow!("--fifo {}: cannot set its permissions: {e}", path.display()))?;
                true
            }
            Err(e) => anyhow::bail!("--fifo {}: {e}", path.display()),
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .map_err(|e| anyhow::anyhow!("--fifo {}: cannot open: {e}", path.display()));
        let file = match file {
            Ok(f) => f,
            Err(e) => {
                if created {
                    let _ = std::fs::remove_file(path);
                }
                return Err(e);
            }
        };
        Ok(Fifo { path: path.to_owned(), file, created })
    }

    /// Wait up to `timeout_ms` for data; `Ok(true)` when there is some to read.
    fn wait_readable(&self, timeout_ms: i32) -> std::io::Result<bool> {
        let mut pfd = libc::pollfd { fd: self.file.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            return if e.kind() == ErrorKind::Interrupted { Ok(false) } else { Err(e) };
        }
        Ok(n > 0 && pfd.revents & libc::POLLIN != 0)
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
struct LineSplitter {
    pending: Vec<u8>,
    max: usize,
    /// Bytes of the current over-long line that were dropped.
    overflow: usize,
    number: u64,
}

/// One complete line from the FIFO.
#[derive(Debug, PartialEq)]
enum Line {
    /// The line's bytes (not yet checked for UTF-8).
    Text(u64, Vec<u8>),
    /// The line was longer than the limit; its length in bytes.
    TooLong(u64, usize),
}

impl LineSplitter {
    fn new(max: usize) -> Self {
        LineSplitter { pending: Vec::new(), max, overflow: 0, number: 0 }
    }

    fn push(&mut self, mut bytes: &[u8], out: &mut Vec<Line>) {
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

/// Proof of life of the read loop: the time of its last sign, in milliseconds since `start`.
#[derive(Clone)]
struct Heartbeat {
    start: Instant,
    last_ms: Arc<AtomicU64>,
}

impl Heartbeat {
    fn new() -> Self {
        Heartbeat { start: Instant::now(), last_ms: Arc::new(AtomicU64::new(0)) }
    }

    fn beat(&self) {
        self.last_ms.store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    fn age(&self) -> Duration {
        let now = self.start.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.last_ms.load(Ordering::Relaxed)))
    }
}

struct Server<'a> {
    cfg: &'a Config,
    engine: &'a Engine,
    rate: u32,
    out_dir: Option<&'a Path>,
    heartbeat: &'a Heartbeat,
    /// The amplifier line, opened at start-up (None: not configured, or writing files).
    amp: Option<&'a std::cell::RefCell<board::gpio::LineAmplifier>>,
    spoken: u64,
    skipped: u64,
}

/// Turns the amplifier off when a line ends, however it ends.
struct AmpOff<'a>(&'a std::cell::RefCell<board::gpio::LineAmplifier>);

impl Drop for AmpOff<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.0.borrow_mut().disable() {
            log::warn!("{e}");
        }
    }
}

impl Server<'_> {
    fn read_loop(&mut self, fifo: &Fifo, status: &dyn Fn(&str)) -> Result<(), Failure> {
        let mut splitter = LineSplitter::new(MAX_LINE_BYTES);
        let mut buf = vec![0u8; 64 * 1024];
        let mut lines = Vec::new();
        let mut file = &fifo.file;
        while !INTERRUPTED.load(Ordering::Relaxed) {
            self.heartbeat.beat();
            let readable = fifo
                .wait_readable(POLL_MS)
                .map_err(|e| fail(1, anyhow::anyhow!("--fifo {}: poll failed: {e}", fifo.path.display())))?;
            if !readable {
                continue;
            }
            let n = match file.read(&mut buf) {
                Ok(n) => n,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => continue,
                Err(e) => return Err(fail(1, anyhow::anyhow!("--fifo {}: read failed: {e}", fifo.path.display()))),
            };
            splitter.push(&buf[..n], &mut lines);
            for line in lines.drain(..) {
                if INTERRUPTED.load(Ordering::Relaxed) {
                    break;
                }
                match line {
                    Line::TooLong(number, bytes) => {
                        log::error!("line {number}: {bytes} bytes, longer than the longest text herald accepts ({} characters); skipped", engine::prompt::MAX_TEXT_CHARS);
                        self.skipped += 1;
                    }
                    Line::Text(number, bytes) => {
                        let text = match String::from_utf8(bytes) {
                            Ok(t) => t,
                            Err(e) => {
                                log::error!("line {number}: not valid UTF-8 (first bad byte at offset {}); skipped", e.utf8_error().valid_up_to());
                                self.skipped += 1;
                                continue;
                            }
                        };
                        if text.trim().is_empty() {
                            log::debug!("line {number}: empty; nothing to say");
                            continue;
                        }
                        status(&format!("speaking line {number}"));
                        match self.speak_line(number, &text) {
                            Ok(()) => self.spoken += 1,
                            Err(e) => {
                                log::error!("line {number}: {}; skipped", crate::one_line(&e));
                                self.skipped += 1;
                            }
                        }
                        status(&format!("ready; {} line(s) spoken, {} skipped", self.spoken, self.skipped));
                    }
                }
            }
        }
        Ok(())
    }

    /// Speak one line into a fresh sink (the device is open only while speaking, so other
    /// clients can use it in between).
    fn speak_line(&self, number: u64, text: &str) -> anyhow::Result<()> {
        let cfg = self.cfg;
        let mode = prompt_mode(cfg);
        // Check the text before touching the device.
        self.engine.bundle().prompter.layout(text, Some(&cfg.synthesis.language), cfg.synthesis.speaker.as_deref(), mode)?;
        let seed = cfg.synthesis.utterance_seed();
        let request = Request {
            text: text.to_owned(),
            language: Some(cfg.synthesis.language.clone()),
            speaker: cfg.synthesis.speaker.clone(),
            mode,
            seed,
            max_frames: None,
            force_eos_at: None,
        };
        let shaper = cfg.shaper_settings();
        let file_out = match self.out_dir {
            Some(dir) => Some(FileOut::new(&dir.join(format!("{number:06}.wav")))?),
            None => None,
        };
        let mut sink: Box<dyn AudioSink> = match &file_out {
            Some(f) => Box::new(WavSink::create(f.write_path(), shaper)?),
            None => Box::new(AlsaSink::new(cfg.alsa_settings(), shaper)),
        };
        // The amplifier goes on `lead_ms` before the first sample and off after the drain, on
        // every path out of this function.
        let _amp = match self.amp {
            Some(cell) => {
                let mut a = cell.borrow_mut();
                a.enable()?;
                Some(AmpOff(cell))
            }
            None => None,
        };
        sink.begin(self.rate)?;
        match seed {
            Some(s) => log::info!("line {number}: {} characters, seed {s}", text.chars().count()),
            None => log::info!("line {number}: {} characters, greedy", text.chars().count()),
        }
        let report = match crate::synthesize_into(self.engine, &request, sink.as_mut(), &|| self.heartbeat.beat()) {
            Ok(r) => r,
            Err(crate::PlayError::Sink(e)) => return Err(e.into()),
            Err(crate::PlayError::Engine(e)) => return Err(e.into()),
        };
        // Finish (fade-out, drain, WAV header) also when a stop signal cut the line short.
        let stats = sink.finish()?;
        self.heartbeat.beat();
        drop(sink);
        if let Some(f) = file_out {
            f.commit()?;
        }
        let Some(report) = report else {
            log::info!("line {number}: stopped by a signal; the audio so far was finished cleanly");
            return Ok(());
        };
        log::info!(
            "line {number}: {} frames ({:.2} s of audio) in {:.2} s, time to first audio {:.0} ms, xruns {}",
            report.frames,
            report.samples as f64 / f64::from(self.rate),
            report.total,
            report.ttfa * 1e3,
            stats.xruns
        );
        if report.stop == StopReason::Capacity {
            log::warn!(
                "line {number}: cut short: the KV cache (synthesis.kv_capacity = {}) filled after {} frames; raise it or split the text",
                cfg.synthesis.kv_capacity,
                report.frames
            );
        }
        Ok(())
    }
}

/// A problem with the systemd notification environment (herald then runs without it).
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    /// `$NOTIFY_SOCKET` is neither an absolute path nor an abstract name (`@name`).
    #[error("NOTIFY_SOCKET={0:?} is neither an absolute path nor an abstract socket name (@name)")]
    Address(String),
    /// The address could not be built or the socket could not be created.
    #[error("NOTIFY_SOCKET={addr:?}: {source}")]
    Socket {
        /// `$NOTIFY_SOCKET`.
        addr: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// `$WATCHDOG_USEC` is not a positive integer.
    #[error("WATCHDOG_USEC={0:?} is not a positive number of microseconds")]
    Watchdog(String),
}

/// The sd_notify(3) datagram socket, and the watchdog period systemd asked for.
pub struct Notifier {
    socket: UnixDatagram,
    addr: SocketAddr,
    /// `$WATCHDOG_USEC` when `$WATCHDOG_PID` is unset or names this process.
    watchdog: Option<Duration>,
}

impl Notifier {
    /// The notifier described by the process environment; `Ok(None)` without `$NOTIFY_SOCKET`.
    ///
    /// # Errors
    /// [`NotifyError`] for an unusable `$NOTIFY_SOCKET` or `$WATCHDOG_USEC`.
    pub fn from_env() -> Result<Option<Notifier>, NotifyError> {
        let Some(sock) = std::env::var_os("NOTIFY_SOCKET").filter(|s| !s.is_empty()) else {
            return Ok(None);
        };
        let sock = sock.to_string_lossy().into_owned();
        let pid = std::env::var("WATCHDOG_PID").ok();
        let usec = std::env::var("WATCHDOG_USEC").ok();
        let watchdog = watchdog_period(usec.as_deref(), pid.as_deref(), std::process::id())?;
        let addr = notify_addr(&sock)?;
        let socket = UnixDatagram::unbound().map_err(|source| NotifyError::Socket { addr: sock.clone(), source })?;
        Ok(Some(Notifier { socket, addr, watchdog }))
    }

    /// Send one notification (newline-separated `KEY=VALUE` lines); a failure is logged, never
    /// fatal (systemd may be restarting).
    pub fn send(&self, msg: &str) {
        if let Err(e) = self.socket.send_to_addr(msg.as_bytes(), &self.addr) {
            log::warn!("sd_notify {:?}: {e}", msg.lines().next().unwrap_or(""));
        }
    }
}

/// The socket address `$NOTIFY_SOCKET` names: an absolute path, or with a leading `@` an
/// abstract name (the rest; sd_notify(3) "NOTIFY_SOCKET").
fn notify_addr(sock: &str) -> Result<SocketAddr, NotifyError> {
    let err = |source| NotifyError::Socket { addr: sock.to_owned(), source };
    if let Some(name) = sock.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        SocketAddr::from_abstract_name(name.as_bytes()).map_err(err)
    } else if sock.starts_with('/') {
        SocketAddr::from_pathname(sock).map_err(err)
    } else {
        Err(NotifyError::Address(sock.to_owned()))
    }
}

/// The keep-alive period systemd expects: `$WATCHDOG_USEC` microseconds, unless
/// `$WATCHDOG_PID` names another process (sd_watchdog_enabled(3)).
fn watchdog_period(usec: Option<&str>, pid: Option<&str>, me: u32) -> Result<Option<Duration>, NotifyError> {
    let Some(usec) = usec.filter(|u| !u.is_empty()) else { return Ok(None) };
    if let Some(pid) = pid.filter(|p| !p.is_empty())
        && pid.trim().parse::<u32>().ok() != Some(me)
    {
        return Ok(None);
    }
    match usec.trim().parse::<u64>() {
        Ok(n) if n > 0 => Ok(Some(Duration::from_micros(n))),
        _ => Err(NotifyError::Watchdog(usec.to_owned())),
    }
}

/// The thread that sends `WATCHDOG=1` every half period while the read loop's heartbeat is
/// younger than the period.
struct Watchdog {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Watchdog {
    fn start(n: &Notifier, heartbeat: &Heartbeat) -> Option<Watchdog> {
        let period = n.watchdog?;
        let socket = match n.socket.try_clone() {
            Ok(s) => s,
            Err(e) => {
                log::warn!("watchdog: cannot clone the notification socket: {e}; no keep-alive");
                return None;
            }
        };
        let notifier = Notifier { socket, addr: n.addr.clone(), watchdog: None };
        let stop = Arc::new(AtomicBool::new(false));
        let hb = heartbeat.clone();
        let flag = Arc::clone(&stop);
        log::info!("watchdog: keep-alive every {:.1} s", period.as_secs_f64() / 2.0);
        let thread = std::thread::Builder::new()
            .name("herald-watchdog".into())
            .spawn(move || {
                let mut stalled = false;
                while !flag.load(Ordering::Relaxed) {
                    let age = hb.age();
                    if age < period {
                        notifier.send("WATCHDOG=1");
                        stalled = false;
                    } else if !stalled {
                        log::error!("watchdog: no progress for {:.1} s; withholding the keep-alive", age.as_secs_f64());
                        stalled = true;
                    }
                    std::thread::park_timeout(period / 2);
                }
            });
        match thread {
            Ok(thread) => Some(Watchdog { stop, thread }),
            Err(e) => {
                log::warn!("watchdog: cannot start its thread: {e}; no keep-alive");
                None
            }
        }
    }

    fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.thread().unpark();
        let _ = self.thread.join();
    }
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
    fn notify_socket_addresses() {
        use std::os::linux::net::SocketAddrExt;
        let a = notify_addr("@herald/test").unwrap();
        assert_eq!(a.as_abstract_name(), Some(&b"herald/test"[..]));
        let p = notify_addr("/run/systemd/notify").unwrap();
        assert_eq!(p.as_pathname(), Some(Path::new("/run/systemd/notify")));
        assert!(matches!(notify_addr("relative/sock"), Err(NotifyError::Address(_))));
        assert!(matches!(notify_addr("vsock:2:1234"), Err(NotifyError::Address(_))));
    }

    #[test]
    fn watchdog_period_follows_sd_watchdog_enabled() {
        assert_eq!(watchdog_period(None, None, 7).unwrap(), None);
        assert_eq!(watchdog_period(Some("30000000"), None, 7).unwrap(), Some(Duration::from_secs(30)));
        assert_eq!(watchdog_period(Some("30000000"), Some("7"), 7).unwrap(), Some(Duration::from_secs(30)));
        // meant for another process
        assert_eq!(watchdog_period(Some("30000000"), Some("8"), 7).unwrap(), None);
        assert!(watchdog_period(Some("0"), None, 7).is_err());
        assert!(watchdog_period(Some("soon"), None, 7).is_err());
    }
}
