//! The Wyoming TTS server (`herald serve`, `serve.wyoming`): what Home Assistant's Wyoming
//! integration and the PyPI `wyoming` client speak.
//!
//! Framing (OHF-Voice/wyoming `event.py`): one JSON header line `{"type", "data"?,
//! "data_length"?, "payload_length"?, "version"?}` and a newline, then `data_length` bytes of
//! JSON merged into `data`, then `payload_length` bytes of binary payload. Events handled:
//!
//! - `describe` → `info` with one `tts` program, its voices the bundle's speakers, then the
//!   voice aliases (their `description` says what each stands for: `echo: another name for
//!   ryan (…)`), languages as ISO 639-1 codes ([`crate::front::LANGUAGE_CODES`]), and
//!   `supports_synthesize_streaming`;
//! - `synthesize` {text, voice?{name, language, speaker}} (`name`: a speaker, an alias or
//!   `default`, in any case, [`crate::front::resolve_voice`]) → `audio-start` {rate 24000, width 2,
//!   channels 1}, `audio-chunk`s (S16LE, as the engine produces them, at most
//!   [`CHUNK_SAMPLES`] samples each), `audio-stop`; the whole text is one job, so the PCM
//!   equals `herald speak --raw` of the same text, voice and seed;
//! - streaming: `synthesize-start` {voice?}, `synthesize-chunk` {text}…, the compatibility
//!   `synthesize` (ignored inside a stream), `synthesize-stop` → for each completed sentence
//!   ([`split_sentences`]; a fenced code block as one piece, [`split_stream`])
//!   `audio-start`/`audio-chunk`s/`audio-stop`, then
//!   `synthesize-stopped`;
//! - `ping` → `pong`; any other type is ignored (the protocol's rule for unknown events).
//!
//! A request that cannot be spoken (bad text, unknown voice or language, queue full) gets an
//! `error` event {text, code} and the connection stays usable. A framing error (a header line
//! over [`MAX_HEADER_BYTES`], data or payload over their limits, malformed JSON, an event that
//! does not arrive within `request_timeout` once it started) gets an `error` event and the
//! connection is closed: the stream cannot be trusted after it. A client that goes away while
//! its audio is being made cancels its job within a frame (the socket is watched while the job
//! runs; a failing write ends it too), and the next job starts cleanly.

use std::io::{self, ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags};
use serde_json::{Map, Value, json};

use crate::conns::{Activity, Closer, RefusalLog, Table, Tracker};
use crate::front::{Front, RequestError, Slot, language_code};
use crate::live::Reloadable;
use crate::queue::Refused;
use crate::speaker::JobError;

/// The longest header line accepted, bytes (a `synthesize` of the longest text fits: the text
/// normally travels in the data part, which has its own limit).
pub const MAX_HEADER_BYTES: usize = 1 << 20;
/// The most bytes of JSON data an event may carry (`data_length`): 4 bytes for each of
/// 100 000 characters of text, and room for the rest.
pub const MAX_DATA_BYTES: usize = 1 << 20;
/// The largest binary payload accepted (`payload_length`); herald's TTS server takes none
/// (audio from clients is for the `snd` service, which it does not offer), so it is read and
/// dropped up to this size.
pub const MAX_PAYLOAD_BYTES: usize = 1 << 20;
/// Samples per `audio-chunk` at most (wyoming-piper sends 1024).
pub const CHUNK_SAMPLES: usize = 1024;
/// How often the accept loop and a waiting connection look at the stop and the client.
const POLL: Duration = Duration::from_millis(50);
/// How often a full accept loop ([`crate::conns::Table::full`]) looks for room again.
const FULL_POLL: Duration = Duration::from_millis(2);
/// The wire version written into every header (the `wyoming` package's version this server
/// was tested against).
pub const PROTOCOL_VERSION: &str = "1.10.2";

/// The settings of the Wyoming server (`[serve]`).
#[derive(Debug, Clone)]
pub struct WyomingSettings {
    /// The most connections served at once ([`crate::conns`]: at the limit an idle or slow
    /// one makes room; when none may, a new one is told `busy` and closed).
    pub max_connections: usize,
    /// An event must arrive in full within this much time of its first byte (slow clients).
    pub request_timeout: Duration,
    /// A connection that sends nothing for this long is closed.
    pub idle_timeout: Duration,
}

/// The running server: an accept thread and one thread per connection.
#[derive(Debug)]
pub struct WyomingServer {
    addr: SocketAddr,
    shutdown: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    conns: Table,
    settings: Reloadable<WyomingSettings>,
}

/// A handle on a running Wyoming server's [`WyomingSettings`], for a reload (SIGHUP): clones
/// share them. A new `max_connections` applies at once ([`Table::set_max`]); the timeouts
/// apply from each connection's next event on (a connection waiting for one already waits with
/// the timeout it began with).
#[derive(Debug, Clone)]
pub struct WyomingReload {
    settings: Reloadable<WyomingSettings>,
    conns: Table,
}

impl WyomingReload {
    /// Apply `settings` (see the type's doc for when each takes effect).
    pub fn apply(&self, settings: WyomingSettings) {
        self.conns.set_max(settings.max_connections);
        self.settings.set(settings);
    }
}

impl WyomingServer {
    /// Serve on `listener` (bound already; it may come from systemd's socket activation) until
    /// [`shutdown`](Self::shutdown) or the process-wide stop.
    ///
    /// # Errors
    /// The listener cannot be made non-blocking or the thread cannot be started.
    pub fn start(listener: TcpListener, slot: Slot, settings: WyomingSettings) -> io::Result<WyomingServer> {
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shutdown = Arc::new(AtomicBool::new(false));
        let conns = Table::new(settings.max_connections);
        let settings = Reloadable::new(settings);
        let thread = {
            let (shutdown, conns, settings) = (Arc::clone(&shutdown), conns.clone(), settings.clone());
            std::thread::Builder::new()
                .name("herald-wyoming".into())
                .spawn(move || accept_loop(&listener, &slot, &settings, &shutdown, &conns))?
        };
        log::info!("wyoming: listening on tcp://{addr}");
        Ok(WyomingServer { addr, shutdown, thread: Some(thread), conns, settings })
    }

    /// The handle a reload applies new settings with.
    pub fn reload_handle(&self) -> WyomingReload {
        WyomingReload { settings: self.settings.clone(), conns: self.conns.clone() }
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stop accepting and close the idle connections at once (those waiting for their next
    /// event); connections with a job or a stream in progress go on (a job cut by the stop
    /// ends its stream with `audio-stop`). Returns at once; [`finish`](Self::finish) waits.
    pub fn begin_shutdown(&mut self) {
        self.shutdown.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            log::error!("wyoming: the accept thread panicked");
        }
        self.conns.close_all(|a| matches!(a, Activity::Idle | Activity::Arriving));
    }

    /// Wait until `deadline` for the busy connections to end, then close what is left.
    pub fn finish(mut self, deadline: Instant) {
        self.begin_shutdown();
        while self.conns.open() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.conns.close_all(|_| true);
    }

    /// [`begin_shutdown`](Self::begin_shutdown), then [`finish`](Self::finish) within `grace`.
    pub fn shutdown(self, grace: Duration) {
        self.finish(Instant::now() + grace);
    }
}

impl Drop for WyomingServer {
    fn drop(&mut self) {
        self.shutdown.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(
    listener: &TcpListener,
    slot: &Slot,
    settings: &Reloadable<WyomingSettings>,
    shutdown: &Arc<AtomicBool>,
    conns: &Table,
) {
    let refusals = RefusalLog::default();
    let stopped = || shutdown.load(Ordering::SeqCst) || slot.get().is_some_and(|f| f.stop_handle().is_stopped());
    while !stopped() {
        if conns.full() {
            // as many connections as may ever be open: accept no more until one has closed
            // (new ones wait in the listen backlog meanwhile)
            std::thread::sleep(FULL_POLL);
            continue;
        }
        let ready = {
            let mut fd = [PollFd::new(listener, PollFlags::POLLIN)];
            nix::poll::poll(&mut fd, POLL.as_millis() as i32).unwrap_or(0)
        };
        if ready == 0 {
            continue;
        }
        let (stream, peer) = match listener.accept() {
            Ok(s) => s,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => continue,
            Err(e) => {
                // EMFILE and friends: keep serving the open connections, try again shortly
                log::warn!("wyoming: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        // the table's handle on the socket, to close it from outside this connection's thread
        let closer: Closer = match stream.try_clone() {
            Ok(dup) => Box::new(move || {
                let _ = dup.shutdown(Shutdown::Both);
            }),
            Err(e) => {
                log::warn!("wyoming: {peer}: {e}");
                continue;
            }
        };
        // at the limit, an idle or slow connection makes room (crate::conns); only when none
        // may is the new one refused
        let member = match conns.admit(peer.ip(), closer) {
            Ok(m) => m,
            Err(refusal) => {
                refusals.log("wyoming", peer, refusal, conns.max(), "told busy");
                let _ = stream.set_nonblocking(false);
                let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
                let mut s = &stream;
                let _ = s.write_all(&encode(
                    "error",
                    &json!({"text": format!("busy: {} connections open already (serve.max_connections)", conns.max()), "code": "busy"}),
                    &[],
                ));
                let _ = stream.shutdown(Shutdown::Both);
                continue;
            }
        };
        let (slot, settings, shutdown) = (slot.clone(), settings.clone(), Arc::clone(shutdown));
        let spawned = std::thread::Builder::new().name("herald-wyoming-conn".into()).spawn(move || {
            // counted until the socket is closed: the member goes last, after the connection
            let member = member;
            let tracker = member.tracker().clone();
            log::debug!("wyoming: {peer}: connected");
            match Connection::new(stream, &slot, settings, &shutdown, tracker.clone(), peer) {
                Ok(mut c) => match c.serve() {
                    Ok(()) => log::debug!("wyoming: {peer}: closed"),
                    Err(_) if tracker.evicted() => {
                        log::debug!("wyoming: {peer}: closed to make room for a new connection (serve.max_connections)");
                    }
                    Err(e) => log::info!("wyoming: {peer}: {e}; connection closed"),
                },
                Err(e) => log::info!("wyoming: {peer}: {e}"),
            }
            drop(member);
        });
        if let Err(e) = spawned {
            log::error!("wyoming: cannot start a connection thread: {e}");
        }
    }
}

/// One event as read from the wire.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// `type`.
    pub kind: String,
    /// `data`, with the `data_length` part merged in.
    pub data: Map<String, Value>,
    /// The payload (`payload_length` bytes; empty when none).
    pub payload: Vec<u8>,
    /// Its JSON held a lone UTF-16 surrogate escape (`"\ud800"`), read as U+FFFD: well framed,
    /// but not text; the event is answered `bad-request` and the connection goes on.
    pub lone_surrogate: bool,
}

/// Why a connection is closed.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// The client closed the connection in the middle of an event.
    #[error("the client closed the connection in the middle of an event")]
    Truncated,
    /// Nothing arrived for `idle_timeout`.
    #[error("idle for {0:?} (serve.idle_timeout_s)")]
    Idle(Duration),
    /// An event did not arrive in full within `request_timeout`.
    #[error("an event did not arrive in full within {0:?} (serve.request_timeout_s)")]
    Slow(Duration),
    /// A part of an event is over its limit.
    #[error("{what} of {len} bytes is over the limit of {limit} bytes")]
    TooLarge {
        /// `header line`, `data_length` or `payload_length`.
        what: &'static str,
        /// What the client sent or announced (for a header line: at least this much).
        len: u64,
        /// The limit.
        limit: usize,
    },
    /// The bytes are not a Wyoming event.
    #[error("malformed event: {0}")]
    Malformed(String),
    /// Reading or writing the socket failed.
    #[error("socket: {0}")]
    Io(#[from] io::Error),
}

impl ProtocolError {
    /// The `code` of the `error` event sent before closing, if the client should get one.
    fn code(&self) -> Option<&'static str> {
        match self {
            ProtocolError::Slow(_) => Some("timeout"),
            ProtocolError::TooLarge { .. } => Some("too-large"),
            ProtocolError::Malformed(_) => Some("malformed"),
            _ => None,
        }
    }
}

/// Encode one event: the header line (with `data_length` and `payload_length` when there is
/// data or a payload), the data, the payload.
pub fn encode(kind: &str, data: &Value, payload: &[u8]) -> Vec<u8> {
    let data_bytes = match data {
        Value::Object(m) if m.is_empty() => Vec::new(),
        Value::Null => Vec::new(),
        d => serde_json::to_vec(d).unwrap_or_default(),
    };
    let mut header = Map::new();
    header.insert("type".into(), Value::from(kind));
    header.insert("version".into(), Value::from(PROTOCOL_VERSION));
    if !data_bytes.is_empty() {
        header.insert("data_length".into(), Value::from(data_bytes.len()));
    }
    if !payload.is_empty() {
        header.insert("payload_length".into(), Value::from(payload.len()));
    }
    let mut out = serde_json::to_vec(&Value::Object(header)).unwrap_or_default();
    out.push(b'\n');
    out.extend_from_slice(&data_bytes);
    out.extend_from_slice(payload);
    out
}

/// What an [`EventReader`] reads from: a socket, whose read timeout bounds each read.
trait Source: Read {
    /// Let the next read wait at most `timeout`.
    fn set_timeout(&mut self, timeout: Duration) -> io::Result<()>;
}

impl Source for TcpStream {
    fn set_timeout(&mut self, timeout: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(timeout))
    }
}

/// Reads events from a socket with the limits and timeouts of the module doc.
struct EventReader<S = TcpStream> {
    stream: S,
    buf: Vec<u8>,
    /// Bytes of `buf` already consumed.
    pos: usize,
    request_timeout: Duration,
    idle_timeout: Duration,
    /// Where the timeouts are read again before each event (a reload changes them); `None`:
    /// the fields as they are (tests).
    settings: Option<Reloadable<WyomingSettings>>,
    /// Told when an event starts to arrive ([`Activity::Arriving`]); `None` in tests.
    tracker: Option<Tracker>,
}

impl<S: Source> EventReader<S> {
    fn arriving(&self) {
        if let Some(t) = &self.tracker {
            t.set(Activity::Arriving);
        }
    }

    /// Read the next event; `Ok(None)` at a clean end of stream (between events).
    fn next(&mut self) -> Result<Option<Event>, ProtocolError> {
        if let Some(s) = &self.settings {
            let s = s.get();
            (self.request_timeout, self.idle_timeout) = (s.request_timeout, s.idle_timeout);
        }
        // the header line: the first byte may take up to the idle timeout, the rest of the
        // event up to the request timeout from there
        let line = match self.line()? {
            Some(l) => l,
            None => return Ok(None),
        };
        let deadline = Instant::now() + self.request_timeout;
        self.arriving();
        let mut lone_surrogate = false;
        let header: Value =
            json_lenient(&line, &mut lone_surrogate).map_err(|e| ProtocolError::Malformed(format!("header line is not JSON: {e}")))?;
        let Value::Object(mut header) = header else {
            return Err(ProtocolError::Malformed("header line is not a JSON object".into()));
        };
        let kind = match header.remove("type") {
            Some(Value::String(s)) => s,
            _ => return Err(ProtocolError::Malformed("header has no \"type\" string".into())),
        };
        let mut data = match header.remove("data") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(m)) => m,
            Some(_) => return Err(ProtocolError::Malformed(format!("{kind}: \"data\" is not an object"))),
        };
        let length = |name: &'static str, limit: usize| -> Result<usize, ProtocolError> {
            match header.get(name) {
                None | Some(Value::Null) => Ok(0),
                Some(v) => match v.as_u64() {
                    Some(n) if n as u128 <= limit as u128 => Ok(n as usize),
                    Some(n) => Err(ProtocolError::TooLarge { what: name, len: n, limit }),
                    None => Err(ProtocolError::Malformed(format!("{kind}: {name} is not a non-negative integer: {v}"))),
                },
            }
        };
        let data_length = length("data_length", MAX_DATA_BYTES)?;
        let payload_length = length("payload_length", MAX_PAYLOAD_BYTES)?;
        if data_length > 0 {
            let bytes = self.exact(data_length, deadline)?;
            let extra: Value = json_lenient(&bytes, &mut lone_surrogate)
                .map_err(|e| ProtocolError::Malformed(format!("{kind}: data part is not JSON: {e}")))?;
            let Value::Object(extra) = extra else {
                return Err(ProtocolError::Malformed(format!("{kind}: data part is not a JSON object")));
            };
            data.extend(extra);
        }
        let payload = if payload_length > 0 { self.exact(payload_length, deadline)? } else { Vec::new() };
        Ok(Some(Event { kind, data, payload, lone_surrogate }))
    }

    /// The next line without its newline; `None` at end of stream before any byte.
    fn line(&mut self) -> Result<Option<Vec<u8>>, ProtocolError> {
        let mut deadline: Option<Instant> = None;
        loop {
            if let Some(i) = self.buf[self.pos..].iter().position(|&b| b == b'\n') {
                let line = self.buf[self.pos..self.pos + i].to_vec();
                self.pos += i + 1;
                return Ok(Some(line));
            }
            let pending = self.buf.len() - self.pos;
            if pending > MAX_HEADER_BYTES {
                return Err(ProtocolError::TooLarge { what: "header line", len: pending as u64, limit: MAX_HEADER_BYTES });
            }
            if pending > 0 && deadline.is_none() {
                deadline = Some(Instant::now() + self.request_timeout);
                self.arriving();
            }
            let timeout = match deadline {
                Some(d) => Wait::Request(d),
                None => Wait::Idle,
            };
            if self.fill(timeout)? == 0 {
                return if pending == 0 { Ok(None) } else { Err(ProtocolError::Truncated) };
            }
        }
    }

    /// Exactly `n` bytes, by `deadline`.
    fn exact(&mut self, n: usize, deadline: Instant) -> Result<Vec<u8>, ProtocolError> {
        while self.buf.len() - self.pos < n {
            if self.fill(Wait::Request(deadline))? == 0 {
                return Err(ProtocolError::Truncated);
            }
        }
        let out = self.buf[self.pos..self.pos + n].to_vec();
        self.pos += n;
        Ok(out)
    }

    /// Read more bytes (0 at end of stream).
    fn fill(&mut self, wait: Wait) -> Result<usize, ProtocolError> {
        if self.pos > 0 && self.pos == self.buf.len() {
            self.buf.clear();
            self.pos = 0;
        } else if self.pos > 64 * 1024 {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        let timeout = match wait {
            Wait::Idle => self.idle_timeout,
            Wait::Request(d) => d.saturating_duration_since(Instant::now()),
        };
        if timeout.is_zero() {
            return Err(ProtocolError::Slow(self.request_timeout));
        }
        self.stream.set_timeout(timeout)?;
        let mut chunk = [0u8; 16 * 1024];
        loop {
            match self.stream.read(&mut chunk) {
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    return Ok(n);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Err(match wait {
                        Wait::Idle => ProtocolError::Idle(self.idle_timeout),
                        Wait::Request(_) => ProtocolError::Slow(self.request_timeout),
                    });
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// Parse JSON; JSON that fails only for its lone UTF-16 surrogate escapes (`\ud800` without
/// its pair, which JSON's grammar allows but no Unicode text holds) is read with U+FFFD in their
/// place and `lone` set, so that the event is refused as a bad request instead of closing the
/// connection as a malformed stream.
fn json_lenient(bytes: &[u8], lone: &mut bool) -> Result<Value, serde_json::Error> {
    match serde_json::from_slice(bytes) {
        Ok(v) => Ok(v),
        Err(e) => match replace_lone_surrogates(bytes) {
            Some(fixed) => {
                let v = serde_json::from_slice(&fixed).map_err(|_| e)?;
                *lone = true;
                Ok(v)
            }
            None => Err(e),
        },
    }
}

/// `bytes` with every `\uXXXX` escape of a lone surrogate (a high one not followed by a low
/// one, or a low one alone) replaced by `\ufffd`; `None` when there is none.
fn replace_lone_surrogates(bytes: &[u8]) -> Option<Vec<u8>> {
    let unit = |at: usize| -> Option<u16> {
        let esc = bytes.get(at..at + 6)?;
        if esc[0] != b'\\' || esc[1] != b'u' {
            return None;
        }
        u16::from_str_radix(std::str::from_utf8(&esc[2..]).ok()?, 16).ok()
    };
    let mut out = Vec::with_capacity(bytes.len());
    let mut replaced = false;
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'\\' {
            out.push(bytes[i]);
            i += 1;
            continue;
        }
        match unit(i) {
            Some(0xD800..=0xDBFF) if matches!(unit(i + 6), Some(0xDC00..=0xDFFF)) => {
                out.extend_from_slice(&bytes[i..i + 12]);
                i += 12;
            }
            Some(0xD800..=0xDFFF) => {
                out.extend_from_slice(b"\\ufffd");
                replaced = true;
                i += 6;
            }
            // any other escape: the backslash and the character it escapes
            _ => {
                out.extend_from_slice(&bytes[i..(i + 2).min(bytes.len())]);
                i += 2;
            }
        }
    }
    replaced.then_some(out)
}

#[derive(Clone, Copy)]
enum Wait {
    /// Between events.
    Idle,
    /// Inside an event that must be complete by then.
    Request(Instant),
}

/// Bytes already received (the fuzz targets): no read waits.
#[cfg(feature = "fuzzing")]
impl Source for &[u8] {
    fn set_timeout(&mut self, _: Duration) -> io::Result<()> {
        Ok(())
    }
}

/// The event parser and the checks of an event's fields, over `bytes` as if a client had sent
/// them and closed the connection, for the fuzz targets (`fuzz/`): every event read is checked
/// as the connection would (`voice`, `text`, the sentence splitter) and encoded again, which
/// must read back as the same event. Returns the events read before the end or the first
/// protocol error.
///
/// # Panics
/// When an event does not survive the round trip (a bug the fuzzer is to find).
#[cfg(feature = "fuzzing")]
// a fuzz oracle: its panic is the fuzzer's finding
#[allow(clippy::panic, clippy::expect_used)]
pub fn fuzz_events(bytes: &[u8]) -> usize {
    fn reader(stream: &[u8]) -> EventReader<&[u8]> {
        let hour = Duration::from_secs(3600);
        EventReader { stream, buf: Vec::new(), pos: 0, request_timeout: hour, idle_timeout: hour, settings: None, tracker: None }
    }
    let mut events = reader(bytes);
    let mut n = 0;
    while let Ok(Some(ev)) = events.next() {
        n += 1;
        let _ = voice_of(&ev.data);
        if let Ok(text) = text_of(&ev.kind, &ev.data) {
            let (sentences, rest) = split_sentences(&text);
            let joined: usize = sentences.iter().map(String::len).sum::<usize>() + rest.len();
            assert!(joined <= text.len(), "the splitter invents text");
            let (pieces, rest) = split_stream(&text);
            let joined: usize = pieces.iter().map(String::len).sum::<usize>() + rest.len();
            assert!(joined <= text.len(), "the stream splitter invents text");
        }
        let wire = encode(&ev.kind, &Value::Object(ev.data.clone()), &ev.payload);
        let mut again = reader(wire.as_slice());
        match again.next() {
            Ok(Some(a)) => {
                assert_eq!(a.kind, ev.kind);
                assert_eq!(a.payload, ev.payload);
                assert!(a.data.keys().eq(ev.data.keys()), "data keys survive the round trip");
            }
            other => panic!("an event read once does not read again after encoding: {other:?}"),
        }
    }
    n
}

/// The writing side of a connection, shared by the connection's thread (replies) and the
/// speaker's worker (audio chunks of its job).
#[derive(Clone)]
struct Writer(Arc<Mutex<TcpStream>>);

impl Writer {
    fn lock(&self) -> MutexGuard<'_, TcpStream> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn send(&self, kind: &str, data: &Value) -> io::Result<()> {
        self.lock().write_all(&encode(kind, data, &[]))
    }
}

/// The job's audio as `audio-chunk` events: every write (S16LE bytes from the raw sink) goes
/// out as chunks of at most [`CHUNK_SAMPLES`] samples.
struct ChunkWriter {
    out: Writer,
    rate: u32,
}

impl Write for ChunkWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let format = json!({"rate": self.rate, "width": 2, "channels": 1});
        let mut stream = self.out.lock();
        for part in buf.chunks(CHUNK_SAMPLES * 2) {
            stream.write_all(&encode("audio-chunk", &format, part))?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.lock().flush()
    }
}

/// The voice fields of a `synthesize` / `synthesize-start`.
#[derive(Debug, Clone, Default, PartialEq)]
struct VoiceAsk {
    /// `voice.name`, or `voice.speaker` when no name is given.
    name: Option<String>,
    /// `voice.language`.
    language: Option<String>,
}

/// The `voice` of an event's data; a `voice` that is not an object, or a field of it that is
/// not a string, is refused (speaking in another voice than the one asked for is worse).
fn voice_of(data: &Map<String, Value>) -> Result<VoiceAsk, String> {
    let v = match data.get("voice") {
        None | Some(Value::Null) => return Ok(VoiceAsk::default()),
        Some(Value::Object(v)) => v,
        Some(other) => return Err(format!("\"voice\" is not an object: {other}")),
    };
    let field = |k: &str| -> Result<Option<String>, String> {
        match v.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone()).filter(|s| !s.trim().is_empty())),
            Some(other) => Err(format!("\"voice.{k}\" is not a string: {other}")),
        }
    };
    let (name, speaker, language) = (field("name")?, field("speaker")?, field("language")?);
    Ok(VoiceAsk { name: name.or(speaker), language })
}

/// The `text` of an event's data.
fn text_of(kind: &str, data: &Map<String, Value>) -> Result<String, String> {
    match data.get("text") {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(format!("{kind}: \"text\" is not a string: {other}")),
        None => Err(format!("{kind}: no \"text\"")),
    }
}

/// What a connection is doing between events.
enum Mode {
    /// Plain events.
    Single,
    /// Inside `synthesize-start` … `synthesize-stop`: the voice, the text not yet spoken, and
    /// whether the stream went over `serve.max_text_chars` (its rest is then dropped).
    Streaming { voice: VoiceAsk, pending: String, overflowed: bool },
}

struct Connection<'a> {
    reader: EventReader,
    out: Writer,
    slot: &'a Slot,
    shutdown: &'a AtomicBool,
    mode: Mode,
    /// What it does, for the connection limit ([`crate::conns`]).
    tracker: Tracker,
    /// The client, for log lines.
    peer: SocketAddr,
}

impl<'a> Connection<'a> {
    fn new(
        stream: TcpStream,
        slot: &'a Slot,
        reloadable: Reloadable<WyomingSettings>,
        shutdown: &'a AtomicBool,
        tracker: Tracker,
        peer: SocketAddr,
    ) -> io::Result<Self> {
        stream.set_nonblocking(false)?;
        stream.set_nodelay(true)?;
        let settings = reloadable.get();
        // a client that stops reading cannot hold the speaker: a write blocked this long fails
        // the job's sink
        stream.set_write_timeout(Some(settings.request_timeout.max(Duration::from_secs(1))))?;
        let out = Writer(Arc::new(Mutex::new(stream.try_clone()?)));
        let reader = EventReader {
            stream,
            buf: Vec::new(),
            pos: 0,
            request_timeout: settings.request_timeout,
            idle_timeout: settings.idle_timeout,
            settings: Some(reloadable),
            tracker: Some(tracker.clone()),
        };
        Ok(Connection { reader, out, slot, shutdown, mode: Mode::Single, tracker, peer })
    }

    fn serve(&mut self) -> Result<(), ProtocolError> {
        let result = self.events();
        if let Err(e) = &result
            && let Some(code) = e.code()
        {
            let _ = self.out.send("error", &json!({"text": e.to_string(), "code": code}));
        }
        self.tracker.set(Activity::Closing);
        let _ = self.reader.stream.shutdown(Shutdown::Both);
        result
    }

    fn events(&mut self) -> Result<(), ProtocolError> {
        loop {
            if self.shutdown.load(Ordering::SeqCst) || self.slot.get().is_some_and(|f| f.stop_handle().is_stopped()) {
                return Ok(());
            }
            let Some(event) = self.reader.next()? else { return Ok(()) };
            if !self.tracker.set(Activity::Busy) {
                // closed to make room just as the event came in: not answered
                return Ok(());
            }
            let handled = self.event(event);
            // idle again (evictable, closed at once on shutdown); an open stream is evictable
            // too, but given the shutdown grace
            self.tracker.set(if matches!(self.mode, Mode::Streaming { .. }) { Activity::Stream } else { Activity::Idle });
            handled?;
        }
    }

    /// Handle one event. `Err` only when the connection is unusable.
    fn event(&mut self, event: Event) -> Result<(), ProtocolError> {
        let Some(front) = self.slot.get() else {
            self.error("herald is loading its model; try again shortly", "loading")?;
            return Ok(());
        };
        log::debug!("wyoming: event {}", event.kind);
        if event.lone_surrogate {
            self.error(
                &format!("{}: the JSON holds a lone UTF-16 surrogate escape (such as \\ud800), which is not text", event.kind),
                "bad-request",
            )?;
            return Ok(());
        }
        match event.kind.as_str() {
            "describe" => {
                self.out.send("info", &info(front))?;
                log::info!("wyoming: {}: describe: info sent", self.peer);
            }
            "ping" => self.out.send("pong", &json!({"text": event.data.get("text").cloned().unwrap_or(Value::Null)}))?,
            // inside a stream it is sent for old servers only; the stream's chunks say it all
            "synthesize" if matches!(self.mode, Mode::Streaming { .. }) => {}
            "synthesize" => match (text_of("synthesize", &event.data), voice_of(&event.data)) {
                (Ok(text), Ok(voice)) => self.speak(front, &text, &voice)?,
                (Err(msg), _) | (_, Err(msg)) => self.error(&msg, "bad-request")?,
            },
            "synthesize-start" => match voice_of(&event.data) {
                Ok(voice) => {
                    if let Mode::Streaming { pending, .. } = &self.mode
                        && !pending.trim().is_empty()
                    {
                        log::info!("wyoming: a new synthesize-start drops {} unspoken characters", pending.chars().count());
                    }
                    self.mode = Mode::Streaming { voice, pending: String::new(), overflowed: false };
                }
                Err(msg) => self.error(&msg, "bad-request")?,
            },
            "synthesize-chunk" => {
                let limit = front.max_text_chars();
                let Mode::Streaming { pending, overflowed, .. } = &mut self.mode else {
                    return Ok(self.error("synthesize-chunk outside synthesize-start … synthesize-stop", "bad-request")?);
                };
                if *overflowed {
                    // the rest of a stream that went over the limit is dropped, not spoken
                    return Ok(());
                }
                let text = match text_of("synthesize-chunk", &event.data) {
                    Ok(t) => t,
                    Err(msg) => return Ok(self.error(&msg, "bad-request")?),
                };
                if pending.chars().count() + text.chars().count() > limit {
                    pending.clear();
                    *overflowed = true;
                    return Ok(self.error(
                        &format!(
                            "the unspoken text of the stream is over {limit} characters (serve.max_text_chars); \
                             the rest of this stream is dropped"
                        ),
                        "too-long",
                    )?);
                }
                pending.push_str(&text);
                let (sentences, rest) = split_stream(pending);
                *pending = rest.to_owned();
                let voice = match &self.mode {
                    Mode::Streaming { voice, .. } => voice.clone(),
                    Mode::Single => VoiceAsk::default(),
                };
                // a stream's piece with nothing to say once read (a stray quote or dash between
                // sentences, only emoji) is dropped, not answered with an error mid-stream
                for s in sentences.into_iter().filter(|s| front.has_words(s)) {
                    self.speak(front, &s, &voice)?;
                }
            }
            "synthesize-stop" => {
                let Mode::Streaming { voice, pending, overflowed } = std::mem::replace(&mut self.mode, Mode::Single) else {
                    return Ok(self.error("synthesize-stop outside synthesize-start … synthesize-stop", "bad-request")?);
                };
                if !overflowed && front.has_words(&pending) {
                    self.speak(front, pending.trim(), &voice)?;
                }
                self.out.send("synthesize-stopped", &Value::Null)?;
                log::info!("wyoming: {}: synthesize-stop: the stream ended", self.peer);
            }
            other => log::debug!("wyoming: ignoring event {other:?}"),
        }
        Ok(())
    }

    fn error(&self, text: &str, code: &str) -> io::Result<()> {
        log::info!("wyoming: {}: error {code}: {text}", self.peer);
        self.out.send("error", &json!({"text": text, "code": code}))
    }

    /// Speak `text` into this connection as one job: `audio-start`, chunks, `audio-stop`, or
    /// an `error` event. `Err` only when the connection is unusable.
    fn speak(&mut self, front: &Front, text: &str, voice: &VoiceAsk) -> Result<(), ProtocolError> {
        let request = match front.request(text, voice.name.as_deref(), voice.language.as_deref()) {
            Ok(r) => r,
            Err(e) => {
                let code = match e {
                    RequestError::TooLong { .. } => "too-long",
                    RequestError::UnknownVoice { .. } => "unknown-voice",
                    RequestError::Prompt(_) => "bad-request",
                };
                self.error(&crate::one_line(&e), code)?;
                return Ok(());
            }
        };
        let rate = front.sample_rate();
        let sink = front.raw_sink(ChunkWriter { out: self.out.clone(), rate }, "wyoming client");
        let started = Arc::new(AtomicBool::new(false));
        let on_begin = {
            let (out, started) = (self.out.clone(), Arc::clone(&started));
            move |_: &engine::Request| {
                if out.send("audio-start", &json!({"rate": rate, "width": 2, "channels": 1})).is_ok() {
                    started.store(true, Ordering::SeqCst);
                }
            }
        };
        let handle = match front.submit(request, sink, None, on_begin) {
            Ok(h) => h,
            Err(refused) => {
                let code = match refused {
                    Refused::Full { .. } => "busy",
                    Refused::Stopped(_) => "stopping",
                };
                self.error(&refused.to_string(), code)?;
                return Ok(());
            }
        };
        // wait, watching the client: gone (end of stream or an error) → cancel the job
        let mut gone = false;
        let outcome = loop {
            if let Some(o) = handle.wait_timeout(POLL) {
                break o;
            }
            if !gone && client_gone(&self.reader.stream) {
                log::info!("wyoming: {}: the client went away; cancelling its job", self.peer);
                handle.cancel();
                gone = true;
            }
        };
        if gone {
            // a client that only closed its sending side (nc -N) still reads this
            let _ = self.out.send(
                "error",
                &json!({"text": "the client closed its side of the connection, which herald takes as leaving: the job was \
                        cancelled (keep the connection open until audio-stop)", "code": "client-closed"}),
            );
            return Err(ProtocolError::Io(io::Error::new(ErrorKind::ConnectionAborted, "the client went away mid-stream")));
        }
        match outcome {
            Ok(spoken) => {
                match &spoken.report {
                    Some(report) => log::info!(
                        "wyoming: {}: spoke {} characters: {} frames ({:.2} s of audio) in {:.2} s, time to first audio {:.0} ms",
                        self.peer,
                        text.chars().count(),
                        report.frames,
                        spoken.stats.input_samples as f64 / f64::from(spoken.stats.device_rate.max(1)),
                        report.total,
                        report.ttfa * 1e3
                    ),
                    None => log::info!("wyoming: {}: the job was cut short (stopping)", self.peer),
                }
                if !started.load(Ordering::SeqCst) {
                    self.out.send("audio-start", &json!({"rate": rate, "width": 2, "channels": 1}))?;
                }
                self.out.send("audio-stop", &Value::Null)?;
                Ok(())
            }
            Err(JobError::Cancelled) => {
                self.error("cancelled: herald is stopping", "stopping")?;
                Ok(())
            }
            Err(JobError::Sink(e)) => Err(ProtocolError::Io(io::Error::new(ErrorKind::BrokenPipe, e.to_string()))),
            Err(e) => {
                log::error!("wyoming: {}: the job failed: {}", self.peer, crate::one_line(&e));
                self.error(&crate::one_line(&e), "synthesis-failed")?;
                Ok(())
            }
        }
    }
}

/// Whether the client closed its side (or the socket failed): readable with nothing to read.
fn client_gone(stream: &TcpStream) -> bool {
    let mut fd = [PollFd::new(stream, PollFlags::POLLIN)];
    match nix::poll::poll(&mut fd, 0) {
        Ok(0) => false,
        Ok(_) => {
            let revents = fd[0].revents().unwrap_or(PollFlags::empty());
            if revents.intersects(PollFlags::POLLERR | PollFlags::POLLHUP) {
                return true;
            }
            let mut b = [0u8; 1];
            // data waiting (the next events of a stream) is not a goodbye
            matches!(stream.peek(&mut b), Ok(0) | Err(_))
        }
        Err(_) => false,
    }
}

/// The `info` event's data: one `tts` program with the bundle's voices and the aliases
/// ([`Front::listing`]).
fn info(front: &Front) -> Value {
    let attribution = json!({"name": "Qwen team, Alibaba Cloud (Qwen3-TTS); herald", "url": "https://github.com/QwenLM/Qwen3-TTS"});
    let voices: Vec<Value> = front
        .listing()
        .iter()
        .map(|v| {
            let mut codes: Vec<&str> = v.languages.iter().map(|l| language_code(l)).collect();
            codes.dedup();
            let mut seen = std::collections::BTreeSet::new();
            codes.retain(|c| seen.insert(*c));
            json!({
                "name": v.name,
                "attribution": attribution,
                "installed": true,
                "description": match v.alias_of.as_deref() {
                    None => format!("{} ({})", v.name, front.model()),
                    Some(crate::front::DEFAULT_VOICE) => format!("{}: the configured voice ({})", v.name, front.model()),
                    Some(to) => format!("{}: another name for {to} ({})", v.name, front.model()),
                },
                "version": null,
                "languages": codes,
                "speakers": null,
            })
        })
        .collect();
    json!({
        "asr": [], "handle": [], "intent": [], "wake": [], "mic": [], "snd": [],
        "tts": [{
            "name": "herald",
            "attribution": attribution,
            "installed": true,
            "description": format!("herald {}: {} on the device", env!("CARGO_PKG_VERSION"), front.model()),
            "version": env!("CARGO_PKG_VERSION"),
            "voices": voices,
            "supports_synthesize_streaming": true,
        }],
    })
}

/// Split `text` into the sentences completed so far and the rest, by the long-text segmenter's
/// sentence rules for a text still arriving ([`engine::segment::complete_sentences`]): after
/// `.` `!` `?` `;` `…` (and closing quotes or brackets right after them) once white space has
/// followed, at once after a full-width stop (`。！？．；`), and at a line break; never inside
/// `45.6`, after an initial (`J. R. R.`) or after a listed abbreviation (`Dr. Smith`).
/// Sentences come back trimmed, empty ones dropped.
pub fn split_sentences(text: &str) -> (Vec<String>, &str) {
    let (sentences, rest) = engine::segment::complete_sentences(text);
    (sentences.into_iter().map(|r| text[r].to_owned()).collect(), &text[rest..])
}

/// A stream's text cut as [`split_sentences`] does, except that a fenced code block
/// ([`crate::text::markdown::first_fence`]) is one piece, from its opening to its closing line,
/// and an open one holds everything from its opening line on until it closes (or the stream
/// stops): the text front-end then skips or reads the block as a whole (`text.code`), never
/// its lines one by one as text.
pub fn split_stream(text: &str) -> (Vec<String>, &str) {
    let Some(fence) = crate::text::markdown::first_fence(text) else { return split_sentences(text) };
    // the fence starts a line, so the text before it ends at a line break: all of it is complete
    let (mut pieces, before) = split_sentences(&text[..fence.start]);
    if !before.trim().is_empty() {
        pieces.push(before.trim().to_owned());
    }
    let Some(end) = fence.end else { return (pieces, &text[fence.start..]) };
    let block = text[fence.start..end].trim();
    if !block.is_empty() {
        pieces.push(block.to_owned());
    }
    let (more, rest) = split_stream(&text[end..]);
    pieces.extend(more);
    (pieces, rest)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    #[test]
    fn sentences_end_at_terminators_followed_by_space_and_at_cjk_stops() {
        let (s, rest) = split_sentences("Hello there. It is 45.6 degrees! Is it? Dr");
        assert_eq!(s, ["Hello there.", "It is 45.6 degrees!", "Is it?"]);
        assert_eq!(rest, " Dr");
        let (s, rest) = split_sentences("你好。今天很好！还有");
        assert_eq!(s, ["你好。", "今天很好！"]);
        assert_eq!(rest, "还有");
        // a terminator at the very end may still be followed by more (a number, "...")
        let (s, rest) = split_sentences("Wait... what?\" he said.");
        assert_eq!(s, ["Wait...", "what?\""]);
        assert_eq!(rest, " he said.");
        let (s, rest) = split_sentences("line one\nline two");
        assert_eq!(s, ["line one"]);
        assert_eq!(rest, "line two");
        assert_eq!(split_sentences("").0, Vec::<String>::new());
        // the long-text rules: no cut after an abbreviation or an initial
        let (s, rest) = split_sentences("Dr. Smith met J. R. R. Tolkien, e.g. here. Then");
        assert_eq!(s, ["Dr. Smith met J. R. R. Tolkien, e.g. here."]);
        assert_eq!(rest, " Then");
    }

    #[test]
    fn a_stream_holds_a_code_block_together() {
        let (s, rest) = split_stream("Try this:\n```python\nprint('hi')\nx = 1\n");
        assert_eq!(s, ["Try this:"]);
        assert_eq!(rest, "```python\nprint('hi')\nx = 1\n");
        let (s, rest) = split_stream("Try this:\n```python\nprint('hi')\n```\nIt prints hi. And");
        assert_eq!(s, ["Try this:", "```python\nprint('hi')\n```", "It prints hi."]);
        assert_eq!(rest, " And");
        let (s, rest) = split_stream("One. Two\n");
        assert_eq!((s, rest), (vec!["One.".to_owned(), "Two".to_owned()], ""));
    }

    #[test]
    fn encoding_matches_the_wire_format() {
        let e = encode("audio-chunk", &json!({"rate": 24000, "width": 2, "channels": 1}), &[1, 2, 3, 4]);
        let nl = e.iter().position(|&b| b == b'\n').unwrap();
        let header: Value = serde_json::from_slice(&e[..nl]).unwrap();
        assert_eq!(header["type"], "audio-chunk");
        let dl = header["data_length"].as_u64().unwrap() as usize;
        assert_eq!(header["payload_length"], 4);
        let data: Value = serde_json::from_slice(&e[nl + 1..nl + 1 + dl]).unwrap();
        assert_eq!(data, json!({"rate": 24000, "width": 2, "channels": 1}));
        assert_eq!(&e[nl + 1 + dl..], &[1, 2, 3, 4]);
        // no data, no payload: the header alone
        let e = encode("audio-stop", &Value::Null, &[]);
        assert_eq!(e.iter().filter(|&&b| b == b'\n').count(), 1);
        assert!(serde_json::from_slice::<Value>(&e[..e.len() - 1]).unwrap().get("data_length").is_none());
    }

    /// A reader over one end of a socket pair whose other end `bytes` were written to.
    fn reader_for(bytes: &[u8], close: bool) -> (EventReader, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (server, _) = l.accept().unwrap();
        client.write_all(bytes).unwrap();
        if close {
            client.shutdown(Shutdown::Write).unwrap();
        }
        let r = EventReader {
            stream: server,
            buf: Vec::new(),
            pos: 0,
            request_timeout: Duration::from_millis(300),
            idle_timeout: Duration::from_millis(300),
            settings: None,
            tracker: None,
        };
        (r, client)
    }

    #[test]
    fn events_are_read_with_data_merged_and_payload() {
        let mut bytes = encode("synthesize", &json!({"text": "Hi.", "voice": {"name": "ryan"}}), &[]);
        bytes.extend(br#"{"type": "describe"}"#);
        bytes.push(b'\n');
        bytes.extend(br#"{"type": "x", "data": {"a": 1}, "data_length": 8, "payload_length": 2}"#);
        bytes.push(b'\n');
        bytes.extend(br#"{"b": 2}"#);
        bytes.extend([9, 9]);
        let (mut r, _c) = reader_for(&bytes, true);
        let e = r.next().unwrap().unwrap();
        assert_eq!(e.kind, "synthesize");
        assert_eq!(text_of("synthesize", &e.data).unwrap(), "Hi.");
        assert_eq!(voice_of(&e.data), Ok(VoiceAsk { name: Some("ryan".into()), language: None }));
        let bad = |v: Value| voice_of(json!({"voice": v}).as_object().unwrap());
        assert!(bad(json!(5)).unwrap_err().contains("not an object"));
        assert!(bad(json!({"name": 7})).unwrap_err().contains("voice.name"));
        assert_eq!(
            bad(json!({"speaker": "eric", "language": "zh"})),
            Ok(VoiceAsk { name: Some("eric".into()), language: Some("zh".into()) })
        );
        assert_eq!(r.next().unwrap().unwrap().kind, "describe");
        let e = r.next().unwrap().unwrap();
        assert_eq!(Value::Object(e.data), json!({"a": 1, "b": 2}));
        assert_eq!(e.payload, [9, 9]);
        assert!(r.next().unwrap().is_none(), "clean end of stream");
    }

    #[test]
    fn lone_surrogates_are_read_as_replacement_characters_and_flagged() {
        let mut bytes = br#"{"type": "synthesize", "data": {"text": "a\ud800b \udc00 \ud83d\ude00 \\ud800 \ud800\ud800"}}"#.to_vec();
        bytes.push(b'\n');
        bytes.extend(br#"{"type": "synthesize", "data_length": 24}"#);
        bytes.push(b'\n');
        bytes.extend(br#"{"text": "\ud83d\ude00"}"#);
        let (mut r, _c) = reader_for(&bytes, true);
        let e = r.next().unwrap().unwrap();
        assert!(e.lone_surrogate);
        // a pair stays a pair, an escaped backslash is no escape, each lone one is U+FFFD
        assert_eq!(text_of("synthesize", &e.data).unwrap(), "a\u{fffd}b \u{fffd} \u{1f600} \\ud800 \u{fffd}\u{fffd}");
        let e = r.next().unwrap().unwrap();
        assert!(!e.lone_surrogate);
        assert_eq!(text_of("synthesize", &e.data).unwrap(), "\u{1f600}");
        // JSON broken otherwise stays malformed
        let mut broken = br#"{"type": "a\ud800"#.to_vec();
        broken.push(b'\n');
        let (mut r, _c) = reader_for(&broken, true);
        assert!(matches!(r.next(), Err(ProtocolError::Malformed(_))));
    }

    #[test]
    fn bad_frames_are_refused_with_their_reason() {
        let (mut r, _c) = reader_for(b"not json\n", true);
        assert!(matches!(r.next(), Err(ProtocolError::Malformed(_))));
        let (mut r, _c) = reader_for(b"{\"data\": {}}\n", true);
        assert!(matches!(r.next(), Err(ProtocolError::Malformed(m)) if m.contains("type")));
        let (mut r, _c) = reader_for(b"{\"type\": \"a\", \"payload_length\": 99999999999}\n", true);
        assert!(matches!(r.next(), Err(ProtocolError::TooLarge { what: "payload_length", .. })));
        let (mut r, _c) = reader_for(b"{\"type\": \"a\", \"data_length\": -1}\n", true);
        assert!(matches!(r.next(), Err(ProtocolError::Malformed(_))));
        // a payload length that lies: fewer bytes, then the client waits → timeout; or closes → truncated
        let (mut r, _c) = reader_for(b"{\"type\": \"a\", \"payload_length\": 10}\nabc", false);
        assert!(matches!(r.next(), Err(ProtocolError::Slow(_))));
        let (mut r, _c) = reader_for(b"{\"type\": \"a\", \"payload_length\": 10}\nabc", true);
        assert!(matches!(r.next(), Err(ProtocolError::Truncated)));
        // half a header line, then silence: a slow client
        let (mut r, _c) = reader_for(b"{\"type\": \"desc", false);
        assert!(matches!(r.next(), Err(ProtocolError::Slow(_))));
        // nothing at all: idle
        let (mut r, _c) = reader_for(b"", false);
        assert!(matches!(r.next(), Err(ProtocolError::Idle(_))));
        // a header line without end, over the limit
        let big = vec![b'x'; MAX_HEADER_BYTES + 10];
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let writer = std::thread::spawn(move || {
            let mut c = TcpStream::connect(addr).unwrap();
            let _ = c.write_all(&big);
            std::thread::sleep(Duration::from_millis(500));
        });
        let (server, _) = l.accept().unwrap();
        let mut r = EventReader {
            stream: server,
            buf: Vec::new(),
            pos: 0,
            request_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(5),
            settings: None,
            tracker: None,
        };
        assert!(matches!(r.next(), Err(ProtocolError::TooLarge { what: "header line", .. })));
        writer.join().unwrap();
    }
}
