//! The HTTP server (`herald serve`, `serve.http`): an OpenAI-compatible speech API, so that the
//! PyPI `openai` client, curl and anything else that speaks `/v1/audio/speech` can use herald.
//!
//! hyper's HTTP/1.1 server on a current-thread tokio runtime of its own thread; the engine runs
//! on the speaker's worker thread ([`crate::queue`]), so the runtime only moves bytes.
//!
//! # Endpoints
//!
//! - `GET /` → herald's web page ([`crate::page`]): `text/html`, with a strict
//!   `Content-Security-Policy` and `Cache-Control: no-cache`. Never needs the API key (the
//!   page holds no secret; it asks for the key when the API answers 401).
//! - `POST /v1/audio/speech` — JSON `{model, input, voice, response_format?, speed?,
//!   instructions?, stream_format?, language?}` → `200` with the audio, streamed with chunked
//!   transfer as the engine makes it: the response head goes out when the job starts (a job
//!   waits in the queue first when another is speaking), the first samples with the engine's
//!   first chunk, not after the whole utterance.
//!   - `model`: any string (clients send `tts-1`; one that is not [`Front::model`] is logged
//!     at debug level); may be missing.
//!   - `input`: the text, required, at most `serve.max_text_chars` characters.
//!   - `voice`: a speaker of the bundle, an alias ([`crate::front::Aliases`]: the
//!     configuration's `[voices.aliases]` and the built-in `echo`, `nova`, … where the bundle
//!     has their speakers), or `default` (the configured voice), in any case; a string or
//!     `{"id": "…"}`. One of OpenAI's built-in voices ([`OPENAI_VOICES`]: `alloy`, `nova`, …)
//!     that is neither a speaker nor an alias means the configured voice too (logged at debug
//!     level), since integrations hard-code them. Any other unknown voice is refused (400,
//!     `param: voice`) with the list of names allowed.
//!   - `response_format` (any case): `mp3` (`audio/mpeg`, LAME, 64 kbit/s CBR mono), `opus`
//!     (`audio/ogg`: Opus in Ogg, libopus, 48 kbit/s VBR mono), `flac`
//!     (`audio/flac`, lossless), `wav` (`audio/wav`, 16-bit mono WAV with a streaming header:
//!     RIFF and data sizes `0xFFFFFFFF`, since the length is not known when it starts) or `pcm`
//!     (`audio/pcm`, headerless S16LE mono at 24 kHz, the bytes of `herald speak --raw`).
//!     **Missing means `mp3`**, OpenAI's default. mp3, opus and flac are encoded chunk by chunk
//!     as the engine makes the audio ([`crate::encode`]), so they stream like the others. `aac`
//!     is refused (400, `param: response_format`, saying no encoder for it is built in:
//!     [`Codec`] says why), anything else likewise as unknown.
//!   - `speed`: 0.25 to 4.0 (OpenAI's range; missing or `null`: the configured
//!     `synthesis.speed`), a pitch-preserving time stretch of the audio as it streams
//!     ([`crate::stretch`]): 2.0 is half as long; anything else → 400 (`param: speed`).
//!   - `instructions`: accepted and ignored (logged at debug level).
//!   - `stream_format`: `audio` (or missing); `sse` → 400.
//!   - `language` (herald's extension): `auto`, a bundle language or an ISO 639-1 code / BCP 47
//!     tag (`en`, `de-DE`); missing: the configured language.
//!
//!   A job that fails after the audio began ends the response with an error: hyper aborts the
//!   connection without the closing chunk, so the client sees a truncated transfer, never a
//!   valid short file. A job cut by the process-wide stop (SIGTERM) ends its stream normally
//!   (the audio so far, faded out).
//!
//!   At most [`QUEUED_AUDIO_BYTES`] of audio wait for a slow client in herald (besides hyper's
//!   write buffer and the socket's send buffer, [`SEND_BUFFER_BYTES`], which the kernel
//!   doubles); then the speaker waits for it. A response that makes no progress (the client's
//!   socket takes no byte of it) for `request_timeout` is cut: the connection is reset and the
//!   job cancelled (one stalled reader must not hold the one speaker).
//!
//!   A client that shuts down only its sending side after its request (`shutdown(SHUT_WR)`,
//!   `nc -N`) still gets its answer. TCP does not tell that from a client that closed the
//!   whole connection until the server sends it something, which the latter answers with a
//!   reset: so a client that goes away mid-stream has its job cancelled within
//!   [`WATCH_INTERVAL`] and a frame of the next audio sent to it (at once when it closed with
//!   audio unread: that close is a reset already), and a client whose FIN comes while its job
//!   waits in the queue gets the response head at once: one that closed answers it with a
//!   reset and its job is cancelled before it starts; one that only half-closed waits for its
//!   audio (should that job then fail before its audio, the transfer is cut instead of
//!   answered with an error status).
//! - `POST /v1/say` — JSON `{input, voice?, language?, speed?}`: plays on the device's own output and
//!   answers when the job has ended: `200 {"spoken": true, "samples": n, "sample_rate": 24000}`
//!   (`spoken: false` when the stop cut it short; `samples` at the model rate), or an error
//!   (503 `audio_device_unavailable` naming the device while it cannot be opened, 500 for
//!   another device failure, with its message). A client that disconnects does not cancel a
//!   say: the announcement is played to the end.
//! - `GET /v1/audio/voices` → `{"voices": [{"id", "name", "alias_of", "languages"}, …]}`: the
//!   bundle's speakers (`alias_of` null), then the aliases (`alias_of` the speaker, or
//!   `default` for the configured voice), `languages` the bundle's names ([`Front::listing`]).
//!   The shape Open WebUI and other OpenAI-compatible servers use (`name` is for people: an
//!   alias's says what it stands for).
//! - `GET /v1/models` → the OpenAI list format with the one model ([`Front::model`]);
//!   `GET /v1/models/{id}` → that model, or 404.
//! - `GET /healthz` → `200 {"status":"ready"}` once the model is loaded, else `503
//!   {"status":"loading"}` (or `"stopping"` after SIGTERM). Never needs the API key.
//!
//! Anything else → 404; a known path with the wrong method → 405 with `Allow`. Every error is
//! OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`, with `type`
//! `invalid_request_error` for the client's mistakes and `server_error` otherwise.
//!
//! # Admission
//!
//! A request that is valid but finds the queue full gets `503` with `Retry-After: 1` and code
//! `busy`; one that arrives while the model loads gets `503` with `Retry-After: 1` and code
//! `loading`; after the stop, `503` with code `stopping` and no `Retry-After` (deliberately: the
//! server may not come back). (The `openai` client retries 503 by itself, `max_retries` times.)
//!
//! # Limits (issue 16, "safe by default")
//!
//! - Request body: [`MAX_BODY_BYTES`], or [`BODY_BYTES_PER_CHAR`] × `serve.max_text_chars` + 4 KiB
//!   when that is more ([`body_limit`]); over it → `413` and the connection is closed. A
//!   `Content-Length` over the limit is refused before anything is read.
//! - Request head (request line and headers): [`MAX_HEAD_BYTES`] and [`MAX_HEADERS`] headers;
//!   over either → `431` from hyper, and the connection is closed. hyper answers the requests it
//!   cannot parse itself (`400`: an HTTP/0.9 or `HTTP/2.0` request line, a duplicate or negative
//!   `Content-Length`, garbage), and those two answers have an empty body (`content-length: 0`,
//!   `connection: close`), not OpenAI's JSON; an HTTP/2 connection preface is closed unanswered.
//! - JSON nesting: serde_json's recursion limit (128 levels); deeper → 400.
//! - Bad JSON, a body that is not an object, fields of the wrong type → 400 naming the field.
//! - `request_timeout`: a request's head must arrive within this time of its first byte, or the
//!   connection is closed without an answer (slowloris); a body that does not arrive in time is
//!   answered `408` (OpenAI's JSON) and the connection closed. Neither holds up anyone else. A
//!   response that makes no progress for this long is cut (above).
//! - `idle_timeout`: a connection with no request in progress (before the first, or between
//!   keep-alive requests) is closed after this long.
//! - `max_connections`: connections served at once, counted until their sockets are closed
//!   ([`crate::conns`], shared with Wyoming). When one more arrives, a connection with no
//!   request in progress, or whose request head or body is still arriving (slowloris), is closed
//!   to make room, by per-address fairness then oldest first (a connection that has sent
//!   nothing yet gets [`FRESH_GRACE`](crate::conns::FRESH_GRACE) first); only when there is none
//!   (every connection answering a request, or just opened) is the new one answered `503` (code
//!   `busy`, `Retry-After: 1`, `Connection: close`) and closed without being read as a request.
//!   At most [`slack`](crate::conns::slack) connections on their way out count besides the
//!   limit. `max_connections` refused connections at a time get up
//!   to a second to take that answer; the ones beyond get it as far as their fresh socket takes
//!   it at once (a request that arrives after the close may reset it away). Refusals are logged
//!   at info level at most once every 10 s, else at debug level.
//! - `api_key`: when set, every route but `/` and `/healthz` needs `Authorization: Bearer <key>`;
//!   without it or with another key → `401` (code `invalid_api_key`).
//! - No request names a file: the audio goes to the client or the device, nothing else.
//!
//! The server stays up after every bad request; a panic in a handler (a bug) ends only that
//! connection. No request or connection of a client is logged above info level (a job's own
//! failure, in the engine or the device, is an error).
//!
//! # Shutdown
//!
//! [`HttpServer::begin_shutdown`] (or the process-wide stop) closes the listening socket and the
//! idle connections at once; a connection with a request in progress closes after its response
//! (a job cut by the stop ends its stream normally). [`HttpServer::finish_shutdown`] waits for
//! them until a deadline and closes what is left.

use std::convert::Infallible;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use nix::poll::{PollFd, PollFlags};
use serde_json::{Map, Value, json};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{Notify, mpsc, oneshot, watch};

use crate::conns::{Activity, Closer, Member, RefusalLog, Table, Tracker};
use crate::encode::Codec;
use crate::front::{Front, RequestError, Slot};
use crate::live::Reloadable;
use crate::queue::{JobHandle, Refused};
use crate::speaker::{JobError, Spoken};

/// The smallest request body limit, bytes (64 KiB): enough for a JSON request with 4096
/// characters of text even if every one is written as a 12-byte escaped surrogate pair
/// (`\ud83d\ude00`, what `json.dumps` makes of an emoji).
pub const MAX_BODY_BYTES: usize = 64 * 1024;
/// JSON bytes a character of text may take (an escaped surrogate pair), for [`body_limit`].
pub const BODY_BYTES_PER_CHAR: usize = 12;
/// The longest request head (request line and headers), bytes; over it → 431 and the
/// connection is closed.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// The most header fields a request may carry; over it → 431 and the connection is closed.
pub const MAX_HEADERS: usize = 64;
/// How often a job's watcher looks whether its response is still wanted, and how often a
/// connection with a response in progress looks at its client's socket: a client that went
/// away has its job cancelled within about twice this time (and one frame of the engine) of
/// the server noticing.
pub const WATCH_INTERVAL: Duration = Duration::from_millis(20);
/// The most audio, bytes, that waits between the speaker and a response (besides hyper's
/// write buffer, [`MAX_BODY_BYTES`], and the socket's send buffer, [`SEND_BUFFER_BYTES`])
/// before the speaker waits for the client.
pub const QUEUED_AUDIO_BYTES: usize = 256 * 1024;
/// The largest message of audio between the speaker and a response: an engine chunk (up to
/// about 96 KB) is cut into messages of this size, so that [`QUEUED_AUDIO_BYTES`] bounds the
/// bytes, not the chunks.
const MESSAGE_BYTES: usize = 16 * 1024;
/// Messages that may wait between the speaker and a response.
const CHANNEL_MESSAGES: usize = QUEUED_AUDIO_BYTES / MESSAGE_BYTES;
/// The send buffer asked of the kernel for each connection, bytes (Linux doubles it, and no
/// longer grows it by itself): audio is 48 kB a second, so this is seconds of audio even on a
/// slow link, while a client that does not read fills it, and is noticed, soon.
pub const SEND_BUFFER_BYTES: u32 = 128 * 1024;
/// `Retry-After` of a busy or loading answer, seconds.
const RETRY_AFTER_S: u32 = 1;
/// How long a refused connection (over `max_connections`) is given to take its 503.
const REFUSE_TIME: Duration = Duration::from_secs(1);
/// The response formats herald makes, for messages.
const FORMATS: &str = "mp3, opus, flac, wav, pcm";
/// The voices OpenAI's speech API has built in. Integrations hard-code them, so one that is
/// neither a speaker of the bundle nor an alias means the configured voice (logged at debug
/// level) instead of a 400.
pub const OPENAI_VOICES: &[&str] =
    &["alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage", "shimmer", "verse"];

/// The settings of the HTTP server (`[serve]`).
#[derive(Clone)]
pub struct HttpSettings {
    /// The most connections served at once. When one more arrives, an idle connection or one
    /// whose request is still arriving is closed to make room ([`crate::conns`]); only when
    /// none may is the new one answered 503 and closed. 0 counts as 1.
    pub max_connections: usize,
    /// A request's head and body must arrive within this time of its first byte, else the
    /// connection is closed (slow clients); also how long a response may make no progress (the
    /// client's socket takes no byte of it) before the connection is closed and its job
    /// cancelled.
    pub request_timeout: Duration,
    /// A connection with no request in progress is closed after this long.
    pub idle_timeout: Duration,
    /// `Some`: every route but `/healthz` and the page (`/`) needs `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
}

impl std::fmt::Debug for HttpSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpSettings")
            .field("max_connections", &self.max_connections)
            .field("request_timeout", &self.request_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("api_key", &self.api_key.as_ref().map(|_| "<set>"))
            .finish()
    }
}

/// What the server is told to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Control {
    Run,
    /// Stop accepting, close the idle connections, let the responses in progress go on.
    Drain,
    /// As `Drain`, and close whatever is still open at this instant.
    Until(Instant),
}

/// The running server: one thread with a tokio runtime, a task per connection.
#[derive(Debug)]
pub struct HttpServer {
    addr: SocketAddr,
    control: watch::Sender<Control>,
    thread: Option<JoinHandle<()>>,
    reload: HttpReload,
}

/// A handle on a running HTTP server's [`HttpSettings`], for a reload (SIGHUP): clones share
/// them. A new `max_connections` applies at once ([`Table::set_max`]); the timeouts apply to
/// every connection from its next watchdog tick on (at most 250 ms), the API key from the next
/// request on.
#[derive(Debug, Clone)]
pub struct HttpReload {
    settings: Reloadable<HttpSettings>,
    conns: Table,
}

impl HttpReload {
    /// Apply `settings` (see the type's doc for when each takes effect).
    pub fn apply(&self, settings: HttpSettings) {
        self.conns.set_max(settings.max_connections);
        self.settings.set(settings);
    }
}

impl HttpServer {
    /// Serve on `listener` (bound already; it may come from systemd's socket activation) on a
    /// thread of its own, until [`shutdown`](Self::shutdown). Requests that need the model are
    /// answered 503 `loading` until `slot` is filled. Once the process-wide stop is set
    /// (SIGTERM) the server stops accepting, closes its idle connections and closes each other
    /// one after its response.
    ///
    /// # Errors
    /// The listener cannot be made non-blocking or handed to tokio, or the runtime or the
    /// thread cannot be started.
    pub fn start(listener: std::net::TcpListener, slot: Slot, settings: HttpSettings) -> io::Result<HttpServer> {
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let listener = {
            let _entered = runtime.enter();
            tokio::net::TcpListener::from_std(listener)?
        };
        let (control, control_rx) = watch::channel(Control::Run);
        let reload = HttpReload { conns: Table::new(settings.max_connections), settings: Reloadable::new(settings) };
        let shared = Shared::new(slot, &reload);
        let thread = std::thread::Builder::new().name("herald-http".into()).spawn(move || {
            runtime.block_on(serve(listener, shared, control_rx));
            // what is left (connections past the deadline) is dropped: their sockets close,
            // and a streaming job whose response is gone is cancelled by its watcher
            runtime.shutdown_timeout(Duration::from_millis(100));
        })?;
        log::info!("http: listening on http://{addr}");
        Ok(HttpServer { addr, control, thread: Some(thread), reload })
    }

    /// The handle a reload applies new settings with.
    pub fn reload_handle(&self) -> HttpReload {
        self.reload.clone()
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Begin the shutdown and return at once: stop accepting (the listening socket is closed),
    /// close the idle connections (no request in progress) at once, and let each response in
    /// progress end (a job cut by the stop ends its stream normally), closing its connection
    /// after it. [`finish_shutdown`](Self::finish_shutdown) waits for them.
    pub fn begin_shutdown(&self) {
        self.control.send_if_modified(|c| {
            let run = *c == Control::Run;
            if run {
                *c = Control::Drain;
            }
            run
        });
    }

    /// Wait until every connection has closed or `deadline` has come, close whatever is still
    /// open then, and join the thread. Begins the shutdown first when
    /// [`begin_shutdown`](Self::begin_shutdown) was not called.
    pub fn finish_shutdown(mut self, deadline: Instant) {
        self.finish(deadline);
    }

    /// [`begin_shutdown`](Self::begin_shutdown), then
    /// [`finish_shutdown`](Self::finish_shutdown) `grace` from now.
    pub fn shutdown(self, grace: Duration) {
        self.begin_shutdown();
        self.finish_shutdown(Instant::now() + grace);
    }

    fn finish(&mut self, deadline: Instant) {
        self.control.send_replace(Control::Until(deadline));
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            log::error!("http: the server thread panicked");
        }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.finish(Instant::now());
        }
    }
}

/// What every connection shares.
struct Shared {
    slot: Slot,
    /// Read afresh at each use: a reload changes them ([`HttpReload`]).
    settings: Reloadable<HttpSettings>,
    /// The connections being served ([`crate::conns`]): counted from the accept until the
    /// socket is closed.
    conns: Table,
    /// Connections being refused (over `max_connections`) with time to take their 503.
    refusing: AtomicUsize,
    /// Requests so far, for log lines.
    requests: AtomicU64,
    /// The refused connections' log lines.
    refusals: RefusalLog,
}

impl Shared {
    fn new(slot: Slot, reload: &HttpReload) -> Self {
        Shared {
            slot,
            conns: reload.conns.clone(),
            settings: reload.settings.clone(),
            refusing: AtomicUsize::new(0),
            requests: AtomicU64::new(0),
            refusals: RefusalLog::default(),
        }
    }

    fn stopped(&self) -> bool {
        self.slot.get().is_some_and(|f| f.stop_handle().is_stopped())
    }

    fn max_connections(&self) -> usize {
        self.conns.max()
    }

    /// The settings now.
    fn settings(&self) -> HttpSettings {
        self.settings.get()
    }
}

/// Counts a refused connection while it takes its 503.
struct Refusing(Arc<Shared>);

impl Refusing {
    fn new(shared: &Arc<Shared>) -> Self {
        shared.refusing.fetch_add(1, Ordering::SeqCst);
        Refusing(Arc::clone(shared))
    }
}

impl Drop for Refusing {
    fn drop(&mut self) {
        self.0.refusing.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How often the accept loop looks at the process-wide stop.
const STOP_POLL: Duration = Duration::from_millis(50);
/// How often a full accept loop ([`crate::conns::Table::full`]) looks for room again.
const FULL_POLL: Duration = Duration::from_millis(2);

async fn serve(listener: tokio::net::TcpListener, shared: Shared, mut control: watch::Receiver<Control>) {
    let shared = Arc::new(shared);
    let (closing, closing_rx) = watch::channel(false);
    let mut stop_poll = tokio::time::interval(STOP_POLL);
    loop {
        if *control.borrow_and_update() != Control::Run {
            break;
        }
        let full = shared.conns.full();
        tokio::select! {
            // as many connections as may ever be open: accept no more until one has closed
            // (new ones wait in the listen backlog meanwhile)
            () = tokio::time::sleep(FULL_POLL), if full => {}
            accepted = listener.accept(), if !full => match accepted {
                Ok((stream, peer)) => admit(stream, peer, &shared, &closing_rx),
                Err(e) => {
                    // EMFILE and friends: wait a little instead of spinning
                    log::warn!("http: accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            changed = control.changed() => if changed.is_err() {
                break;
            },
            _ = stop_poll.tick() => if shared.stopped() {
                log::info!("http: stopping: no new connections");
                break;
            }
        }
    }
    drop(listener);
    // idle connections close at once, the others after their response
    closing.send_replace(true);
    loop {
        let open = shared.conns.open();
        if open == 0 {
            break;
        }
        let deadline = match *control.borrow() {
            Control::Until(d) => Some(d),
            Control::Run | Control::Drain => None,
        };
        if deadline.is_some_and(|d| Instant::now() >= d) {
            log::warn!("http: closing {open} connection(s) still open after the shutdown grace");
            break;
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(10)) => {}
            changed = control.changed() => if changed.is_err() {
                // the server is gone without a deadline: no grace at all
                break;
            }
        }
    }
    // wait for finish_shutdown() before the runtime goes (the connections past the deadline
    // with it)
    while !matches!(*control.borrow(), Control::Until(_)) {
        if control.changed().await.is_err() {
            break;
        }
    }
}

fn admit(stream: TcpStream, peer: SocketAddr, shared: &Arc<Shared>, closing: &watch::Receiver<bool>) {
    let state = Arc::new(ConnState::new(Instant::now()));
    let closer: Closer = {
        let state: Weak<ConnState> = Arc::downgrade(&state);
        Box::new(move || {
            if let Some(s) = state.upgrade() {
                s.evict.notify_one();
            }
        })
    };
    let member = match shared.conns.admit(peer.ip(), closer) {
        Ok(m) => m,
        Err(refusal) => {
            if shared.refusing.load(Ordering::SeqCst) >= shared.max_connections() {
                // as many are taking their 503 already: this one gets it at once, as far as
                // its socket takes it, and no time
                shared.refusals.log("http", peer, refusal, shared.max_connections(), "answered busy, as far as the socket took it");
                refuse_now(stream);
                return;
            }
            shared.refusals.log("http", peer, refusal, shared.max_connections(), "answered busy");
            let refusing = Refusing::new(shared);
            tokio::spawn(async move {
                refuse(stream).await;
                drop(refusing);
            });
            return;
        }
    };
    let _ = state.tracker.set(member.tracker().clone());
    let closing = closing.clone();
    let shared = Arc::clone(shared);
    tokio::spawn(async move {
        connection(stream, peer, shared, state, member, closing).await;
    });
}

/// The answer to a connection over `max_connections`: 503 `busy`, and the connection closes.
fn busy_answer() -> Vec<u8> {
    let body =
        error_json("too many connections at once (serve.max_connections); try again shortly", "server_error", None, Some("busy"));
    let mut answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: {RETRY_AFTER_S}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    answer.extend_from_slice(&body);
    answer
}

/// Answer a connection over `max_connections` with 503 and close it, reading what the client
/// sent meanwhile (for at most [`REFUSE_TIME`]) so that the close does not reset the answer
/// away.
async fn refuse(mut stream: TcpStream) {
    let _ = tokio::time::timeout(REFUSE_TIME, async {
        stream.write_all(&busy_answer()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        io::Result::Ok(())
    })
    .await;
}

/// Answer a connection over `max_connections` with 503 without waiting: what its fresh socket
/// takes at once (all of it, in practice), then the close. What the client sent already is
/// read first; a request that arrives after the close may reset the answer away.
fn refuse_now(stream: TcpStream) {
    let Ok(mut s) = stream.into_std() else { return };
    let _ = s.write_all(&busy_answer());
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut sink = [0u8; 4096];
    for _ in 0..16 {
        if !matches!(s.read(&mut sink), Ok(n) if n > 0) {
            break;
        }
    }
}

/// Where a connection is between requests, for the idle and request timeouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No request in progress since this instant.
    Idle(Instant),
    /// A request's first byte came at this instant; its head or body is still arriving.
    Request(Instant),
    /// The request has arrived; the answer is being made or sent (a queued job may wait, a
    /// long utterance streams for long: only a response that makes no progress is timed out).
    Responding,
}

/// Why a connection is closed by its watchdog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expired {
    Idle,
    Request,
    /// The client's socket took no byte of the response for `request_timeout`.
    Stalled,
}

/// A connection's state as its watchdog sees it.
#[derive(Debug)]
struct Watched {
    phase: Phase,
    /// Since when a write to the client's socket has been waiting for room (`None`: the last
    /// write went through).
    write_blocked: Option<Instant>,
    /// The client closed its side (its FIN came) while a response was in progress.
    peer_closed: bool,
}

/// A connection's [`Watched`] state, shared by its socket (bytes read and written), its
/// handler, its response body (dropped once sent) and the accept loop (which may ask an idle
/// connection to close).
#[derive(Debug)]
struct ConnState {
    watched: Mutex<Watched>,
    /// Told once when the client closed its side while a response was in progress: a speech
    /// response still waiting for its job then sends its head at once (see [`speech`]).
    closed_early: Notify,
    /// Told when the connection is to close to make room for a new one.
    evict: Notify,
    /// Its entry in the connection table, told of each phase ([`crate::conns`]).
    tracker: OnceLock<Tracker>,
}

impl ConnState {
    fn new(now: Instant) -> Self {
        ConnState {
            watched: Mutex::new(Watched { phase: Phase::Idle(now), write_blocked: None, peer_closed: false }),
            closed_early: Notify::new(),
            evict: Notify::new(),
            tracker: OnceLock::new(),
        }
    }

    fn watched(&self) -> MutexGuard<'_, Watched> {
        // plain values stay consistent whatever panicked while holding them
        self.watched.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Tell the connection table what the connection does.
    fn track(&self, activity: Activity) {
        if let Some(t) = self.tracker.get() {
            t.set(activity);
        }
    }

    /// Bytes came in: an idle connection now has a request arriving.
    fn read(&self, now: Instant) {
        let mut w = self.watched();
        if let Phase::Idle(_) = w.phase {
            w.phase = Phase::Request(now);
            drop(w);
            self.track(Activity::Arriving);
        }
    }

    /// A write to the socket went through (`true`) or has to wait for room (`false`).
    fn wrote(&self, through: bool, now: Instant) {
        let mut w = self.watched();
        if through {
            w.write_blocked = None;
        } else {
            w.write_blocked.get_or_insert(now);
        }
    }

    /// The handler got a request (its head parsed): when it started.
    fn request_started(&self, now: Instant) -> Instant {
        let mut w = self.watched();
        match w.phase {
            Phase::Request(t) => t,
            // read ahead while the previous answer was sent (pipelining)
            Phase::Idle(_) | Phase::Responding => {
                w.phase = Phase::Request(now);
                drop(w);
                self.track(Activity::Arriving);
                now
            }
        }
    }

    /// The request is in; only a stalled response is timed out until the answer is sent.
    fn responding(&self) {
        self.watched().phase = Phase::Responding;
        self.track(Activity::Busy);
    }

    fn is_responding(&self) -> bool {
        self.watched().phase == Phase::Responding
    }

    /// The answer was sent.
    fn idle(&self, now: Instant) {
        self.watched().phase = Phase::Idle(now);
        self.track(Activity::Idle);
    }

    /// The client closed its side during a response: tell [`closed_early`](Self::closed_early)
    /// the first time.
    fn peer_closed(&self) {
        let mut w = self.watched();
        if !std::mem::replace(&mut w.peer_closed, true) {
            self.closed_early.notify_one();
        }
    }

    /// Whether a timeout of `settings` ran out at `now`.
    fn expired(&self, now: Instant, settings: &HttpSettings) -> Option<Expired> {
        let w = self.watched();
        if w.write_blocked.is_some_and(|t| now.saturating_duration_since(t) >= settings.request_timeout) {
            return Some(Expired::Stalled);
        }
        match w.phase {
            Phase::Idle(t) if now.saturating_duration_since(t) >= settings.idle_timeout => Some(Expired::Idle),
            Phase::Request(t) if now.saturating_duration_since(t) >= settings.request_timeout => Some(Expired::Request),
            _ => None,
        }
    }
}

/// How often a connection's watchdog looks at its timeouts: a tenth of the shorter one,
/// between 10 and 250 ms ([`WATCH_INTERVAL`] while a response is in progress).
fn watchdog_tick(settings: &HttpSettings) -> Duration {
    (settings.idle_timeout.min(settings.request_timeout) / 10).clamp(Duration::from_millis(10), Duration::from_millis(250))
}

/// What a look at the client's socket found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Peer {
    /// Nothing new (or bytes of another request).
    There,
    /// Its FIN came: it closed its side, or the whole connection (TCP does not tell which
    /// until the server sends it something).
    Closed,
    /// The connection was reset (a client that closed answers data with a reset) or failed.
    Gone,
}

/// Look at the client's socket without reading it (a second descriptor of it: hyper owns the
/// first and, with half-close allowed, does not read while it answers).
fn look(socket: &std::net::TcpStream) -> Peer {
    let mut fds = [PollFd::new(socket, PollFlags::POLLIN)];
    if !matches!(nix::poll::poll(&mut fds, 0), Ok(n) if n > 0) {
        return Peer::There;
    }
    let events = fds[0].revents().unwrap_or_else(PollFlags::empty);
    if events.intersects(PollFlags::POLLHUP | PollFlags::POLLERR | PollFlags::POLLNVAL) {
        return Peer::Gone;
    }
    let mut one = [0u8; 1];
    if events.contains(PollFlags::POLLIN) && matches!(socket.peek(&mut one), Ok(0)) { Peer::Closed } else { Peer::There }
}

/// The client's socket, telling its [`ConnState`] when bytes come in and whether writes go
/// through.
struct Tracked {
    inner: TcpStream,
    state: Arc<ConnState>,
}

impl Tracked {
    fn track(&self, polled: Poll<io::Result<usize>>) -> Poll<io::Result<usize>> {
        match &polled {
            Poll::Pending => self.state.wrote(false, Instant::now()),
            Poll::Ready(Ok(n)) if *n > 0 => self.state.wrote(true, Instant::now()),
            Poll::Ready(_) => {}
        }
        polled
    }
}

impl AsyncRead for Tracked {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.state.read(Instant::now());
        }
        polled
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.track(polled)
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.track(polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// A second descriptor of `stream`'s socket, to [`look`] at it while hyper owns `stream`, with
/// its send buffer set to [`SEND_BUFFER_BYTES`]. It must not outlive the connection (the
/// socket closes when the last descriptor does).
fn probe(stream: &TcpStream) -> Option<std::net::TcpStream> {
    let probe = std::net::TcpStream::from(stream.as_fd().try_clone_to_owned().ok()?);
    set_option(&probe, |s| s.set_send_buffer_size(SEND_BUFFER_BYTES));
    Some(probe)
}

/// Set a socket option of `socket` (through a descriptor of its own, closed again).
fn set_option(socket: &std::net::TcpStream, set: impl FnOnce(&tokio::net::TcpSocket) -> io::Result<()>) {
    if let Ok(dup) = socket.try_clone() {
        let _ = set(&tokio::net::TcpSocket::from_std_stream(dup));
    }
}

/// Serve one connection until it closes; `member` counts it until then (dropped after the
/// socket and its probe are).
async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    state: Arc<ConnState>,
    member: Member,
    closing: watch::Receiver<bool>,
) {
    serve_connection(stream, peer, &shared, &state, closing).await;
    state.track(Activity::Closing);
    drop(member);
}

async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    shared: &Arc<Shared>,
    state: &Arc<ConnState>,
    mut closing: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let probe = probe(&stream);
    let io = TokioIo::new(Tracked { inner: stream, state: Arc::clone(state) });
    let service = {
        let (shared, state) = (Arc::clone(shared), Arc::clone(state));
        service_fn(move |req: Request<Incoming>| {
            let (shared, state) = (Arc::clone(&shared), Arc::clone(&state));
            async move { Ok::<_, Infallible>(handle(req, peer, &shared, state).await) }
        })
    };
    let conn = http1::Builder::new()
        .keep_alive(true)
        // a client that shuts down its sending side after its request still gets its answer;
        // the watchdog below tells a client that closed entirely by the reset its socket
        // answers the response with
        .half_close(true)
        .max_headers(MAX_HEADERS)
        .max_header_size(MAX_HEAD_BYTES)
        .max_buf_size(MAX_BODY_BYTES)
        // the watchdog below does the timeouts (hyper's would count idle time as head time)
        .header_read_timeout(None)
        .serve_connection(io, service);
    let mut conn = std::pin::pin!(conn);
    let tick = shared.settings.read(watchdog_tick);
    let mut shutting = false;
    loop {
        if !shutting && *closing.borrow() {
            // hyper closes an idle connection at once, a busy one after its response
            shutting = true;
            conn.as_mut().graceful_shutdown();
        }
        let responding = state.is_responding();
        let wait = if responding { tick.min(WATCH_INTERVAL) } else { tick };
        tokio::select! {
            // first: a connection chosen to make room was idle or had its request arriving
            // then; it must not answer a request completed since
            biased;
            () = state.evict.notified(), if !shutting => {
                log::debug!("http: {peer}: closed to make room for a new connection (serve.max_connections)");
                return;
            }
            ended = conn.as_mut() => {
                // what hyper answered itself (400 for what it cannot parse, 431), or a client that
                // hung up mid-request
                if let Err(e) = ended {
                    log::info!("http: {peer}: {e}; connection closed");
                }
                return;
            }
            _ = closing.changed(), if !shutting => {}
            () = tokio::time::sleep(wait) => {
                match shared.settings.read(|s| state.expired(Instant::now(), s)) {
                    Some(Expired::Idle) => {
                        log::debug!("http: {peer}: idle for {:?} (serve.idle_timeout); closed", shared.settings().idle_timeout);
                        return;
                    }
                    Some(Expired::Request) => {
                        log::info!(
                            "http: {peer}: the request did not arrive within {:?} (serve.request_timeout); closed",
                            shared.settings().request_timeout
                        );
                        return;
                    }
                    Some(Expired::Stalled) => {
                        log::info!(
                            "http: {peer}: took no byte of its response for {:?} (serve.request_timeout); closed",
                            shared.settings().request_timeout
                        );
                        // a reset: what the client did not take is dropped now, not kept
                        // for it by the kernel
                        if let Some(p) = &probe {
                            set_option(p, tokio::net::TcpSocket::set_zero_linger);
                        }
                        return;
                    }
                    None => {}
                }
                if responding && let Some(p) = &probe {
                    match look(p) {
                        Peer::Gone => {
                            log::debug!("http: {peer}: the connection was reset; closed");
                            return;
                        }
                        Peer::Closed => state.peer_closed(),
                        Peer::There => {}
                    }
                }
            }
        }
    }
}

/// The routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Page,
    Speech,
    Say,
    Voices,
    Models,
    Model,
    Health,
    NotFound,
    /// A known path with another method; the methods it takes.
    WrongMethod(&'static str),
}

/// The route of `method` on `path` (without the query).
fn route(method: &Method, path: &str) -> Route {
    let (want, route) = match path {
        "/" => (Method::GET, Route::Page),
        "/v1/audio/speech" => (Method::POST, Route::Speech),
        "/v1/say" => (Method::POST, Route::Say),
        "/v1/audio/voices" => (Method::GET, Route::Voices),
        "/v1/models" => (Method::GET, Route::Models),
        "/healthz" => (Method::GET, Route::Health),
        p if p.strip_prefix("/v1/models/").is_some_and(|id| !id.is_empty() && !id.contains('/')) => (Method::GET, Route::Model),
        _ => return Route::NotFound,
    };
    // a HEAD gets the GET's answer without its body (hyper leaves the body out)
    if *method == want || (want == Method::GET && *method == Method::HEAD) {
        route
    } else {
        Route::WrongMethod(if want == Method::GET { "GET, HEAD" } else { "POST" })
    }
}

/// Whether `authorization` carries `Bearer <key>` (the scheme in any case). The key is
/// compared in time that does not depend on where it differs. An empty key matches nothing.
fn bearer_ok(authorization: Option<&HeaderValue>, key: &str) -> bool {
    if key.is_empty() {
        return false;
    }
    let Some(value) = authorization.and_then(|v| v.to_str().ok()) else { return false };
    let Some((scheme, token)) = value.trim().split_once(' ') else { return false };
    scheme.eq_ignore_ascii_case("bearer") && same_bytes(token.trim().as_bytes(), key.as_bytes())
}

fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The request body limit for a front with `max_text_chars` (`None` while loading): at least
/// [`MAX_BODY_BYTES`], or [`BODY_BYTES_PER_CHAR`] bytes a character (an escaped surrogate pair,
/// `\ud83d\ude00`) and 4 KiB for the rest.
pub fn body_limit(max_text_chars: Option<usize>) -> usize {
    max_text_chars.map_or(MAX_BODY_BYTES, |n| MAX_BODY_BYTES.max(n.saturating_mul(BODY_BYTES_PER_CHAR).saturating_add(4096)))
}

/// The audio formats herald answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AudioFormat {
    /// 16-bit mono WAV with a streaming header (sizes `0xFFFFFFFF`).
    Wav,
    /// Headerless S16LE mono at the model rate (24 kHz).
    Pcm,
    /// An encoded format ([`Codec`]: mp3, flac, opus).
    Encoded(Codec),
}

impl AudioFormat {
    /// The `Content-Type` of the answer.
    pub fn content_type(self) -> &'static str {
        match self {
            AudioFormat::Wav => "audio/wav",
            AudioFormat::Pcm => "audio/pcm",
            AudioFormat::Encoded(c) => c.content_type(),
        }
    }

    /// `response_format` (any case): `mp3`, `opus`, `flac`, `wav` or `pcm`; missing means
    /// `mp3`, as OpenAI's API does.
    ///
    /// # Errors
    /// An [`ApiError`] naming `response_format` and the formats herald makes (`aac` with the
    /// reason: [`Codec`]).
    fn parse(given: Option<&str>) -> Result<AudioFormat, ApiError> {
        let Some(given) = given else { return Ok(AudioFormat::Encoded(Codec::Mp3)) };
        match given.trim().to_ascii_lowercase().as_str() {
            "mp3" => Ok(AudioFormat::Encoded(Codec::Mp3)),
            "opus" => Ok(AudioFormat::Encoded(Codec::Opus)),
            "flac" => Ok(AudioFormat::Encoded(Codec::Flac)),
            "wav" => Ok(AudioFormat::Wav),
            "pcm" => Ok(AudioFormat::Pcm),
            codec @ "aac" => Err(ApiError::invalid(
                Some("response_format"),
                format!("herald does not produce {codec} (no encoder for it is built in); response_format must be one of: {FORMATS}"),
            )),
            _ => Err(ApiError::invalid(
                Some("response_format"),
                format!("unknown response_format {given:?}; response_format must be one of: {FORMATS}"),
            )),
        }
    }
}

/// A `POST /v1/audio/speech` request, checked as far as it can be without the model.
#[derive(Debug, Clone, PartialEq)]
struct SpeechParams {
    model: Option<String>,
    input: String,
    voice: Option<String>,
    format: AudioFormat,
    language: Option<String>,
    instructions: Option<String>,
    /// `speed`, 0.25..=4.0; `None`: the configured `synthesis.speed`.
    speed: Option<f32>,
}

/// A `POST /v1/say` request.
#[derive(Debug, Clone, PartialEq)]
struct SayParams {
    input: String,
    voice: Option<String>,
    language: Option<String>,
    /// `speed`, as in [`SpeechParams`].
    speed: Option<f32>,
}

/// The body as a JSON object (serde_json's recursion limit bounds its nesting).
fn json_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid(None, "the request body is empty; expected a JSON object".into()));
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(ApiError::invalid(None, format!("the request body must be a JSON object, not {}", type_name(&other)))),
        Err(e) => Err(ApiError::invalid(None, format!("the request body is not valid JSON: {e}"))),
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The string field `name` of `map` (`None` when missing or null).
fn string_field(map: &Map<String, Value>, name: &'static str) -> Result<Option<String>, ApiError> {
    match map.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(ApiError::invalid(Some(name), format!("'{name}' must be a string, not {}", type_name(other)))),
    }
}

fn required_string(map: &Map<String, Value>, name: &'static str) -> Result<String, ApiError> {
    string_field(map, name)?.ok_or_else(|| ApiError::invalid(Some(name), format!("missing required parameter: '{name}'")))
}

/// `voice`: a string, or OpenAI's `{"id": "…"}`.
fn voice_field(map: &Map<String, Value>) -> Result<Option<String>, ApiError> {
    match map.get("voice") {
        Some(Value::Object(o)) => match o.get("id") {
            Some(Value::String(id)) => Ok(Some(id.clone())),
            _ => Err(ApiError::invalid(Some("voice"), "'voice' must be a string or an object with a string 'id'".into())),
        },
        _ => string_field(map, "voice"),
    }
}

/// `speed`: a number from 0.25 to 4.0 (OpenAI's range), or missing / `null`.
fn speed_field(map: &Map<String, Value>) -> Result<Option<f32>, ApiError> {
    let (min, max) = (crate::stretch::MIN_SPEED, crate::stretch::MAX_SPEED);
    match map.get("speed") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_f64() {
            Some(v) if (f64::from(min)..=f64::from(max)).contains(&v) => Ok(Some(v as f32)),
            _ => Err(ApiError::invalid(Some("speed"), format!("speed {n} is out of range; allowed: {min:.2} to {max:.1}"))),
        },
        Some(other) => Err(ApiError::invalid(
            Some("speed"),
            format!("'speed' must be a number from {min:.2} to {max:.1}, not {}", type_name(other)),
        )),
    }
}

fn parse_speech(body: &[u8]) -> Result<SpeechParams, ApiError> {
    let map = json_object(body)?;
    let input = required_string(&map, "input")?;
    let model = string_field(&map, "model")?;
    let voice = voice_field(&map)?;
    let format = AudioFormat::parse(string_field(&map, "response_format")?.as_deref())?;
    let speed = speed_field(&map)?;
    if let Some(f) = string_field(&map, "stream_format")?
        && !f.trim().eq_ignore_ascii_case("audio")
    {
        return Err(ApiError::invalid(Some("stream_format"), format!("stream_format {f:?} is not supported; allowed: audio")));
    }
    let instructions = string_field(&map, "instructions")?;
    let language = string_field(&map, "language")?;
    Ok(SpeechParams { model, input, voice, format, language, instructions, speed })
}

/// A request body parsed as the route `path` (`/v1/audio/speech` or `/v1/say`) parses it, for
/// the fuzz targets (`fuzz/`): `Err` with the status and the JSON error body a client would
/// get.
///
/// # Panics
/// When an error body is not the JSON object OpenAI's clients expect (a bug the fuzzer is to
/// find).
#[cfg(feature = "fuzzing")]
// a fuzz oracle: its panic is the fuzzer's finding
#[allow(clippy::panic, clippy::expect_used)]
pub fn fuzz_body(path: &str, body: &[u8]) -> Result<(), (u16, String)> {
    let parsed = if path == "/v1/say" { parse_say(body).map(|_| ()) } else { parse_speech(body).map(|_| ()) };
    parsed.map_err(|e| {
        let json = error_json(&e.message, e.kind, e.param, e.code);
        let v: Value = serde_json::from_slice(&json).expect("an error body is JSON");
        assert!(v["error"]["message"].is_string(), "an error body has error.message");
        (e.status.as_u16(), e.message)
    })
}

fn parse_say(body: &[u8]) -> Result<SayParams, ApiError> {
    let map = json_object(body)?;
    Ok(SayParams {
        input: required_string(&map, "input")?,
        voice: voice_field(&map)?,
        language: string_field(&map, "language")?,
        speed: speed_field(&map)?,
    })
}

/// An answer in OpenAI's error shape.
#[derive(Debug, Clone, PartialEq)]
struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<&'static str>,
    code: Option<&'static str>,
    /// `Retry-After`, seconds.
    retry_after: Option<u32>,
    /// Close the connection after it (the request body was not read, or cannot be trusted).
    close: bool,
}

impl ApiError {
    fn new(status: StatusCode, message: String) -> Self {
        let kind = if status.is_server_error() { "server_error" } else { "invalid_request_error" };
        ApiError { status, message, kind, param: None, code: None, retry_after: None, close: false }
    }

    /// 400 about `param`.
    fn invalid(param: Option<&'static str>, message: String) -> Self {
        ApiError { param, ..ApiError::new(StatusCode::BAD_REQUEST, message) }
    }

    /// 503 `audio_device_unavailable`: the playback device cannot be opened.
    fn no_device(e: &crate::NoDevice) -> Self {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()).code("audio_device_unavailable")
    }

    fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    fn retry(mut self) -> Self {
        self.retry_after = Some(RETRY_AFTER_S);
        self
    }

    fn closing(mut self) -> Self {
        self.close = true;
        self
    }

    fn loading() -> Self {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the model is loading; try again shortly".into()).code("loading").retry()
    }

    fn stopping() -> Self {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "herald is stopping".into()).code("stopping")
    }

    fn refused(refused: &Refused) -> Self {
        match refused {
            Refused::Full { .. } => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, format!("{refused}; try again shortly")).code("busy").retry()
            }
            Refused::Stopped(_) => ApiError::stopping(),
        }
    }

    fn request(e: &RequestError) -> Self {
        let param = match e {
            RequestError::TooLong { .. } => "input",
            RequestError::UnknownVoice { .. } => "voice",
            RequestError::Prompt(engine::prompt::PromptError::UnknownLanguage { .. }) => "language",
            RequestError::Prompt(engine::prompt::PromptError::UnknownSpeaker { .. }) => "voice",
            RequestError::Prompt(_) => "input",
        };
        ApiError::invalid(Some(param), crate::one_line(e))
    }

    /// A job that failed before its audio began.
    fn job(e: &JobError) -> Self {
        match e {
            JobError::Cancelled => ApiError::stopping(),
            JobError::Engine(engine::EngineError::Prompt(p)) => ApiError::invalid(Some("input"), crate::one_line(p)),
            JobError::Sink(s) if s.kind() == board::audio::SinkErrorKind::Busy => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, crate::one_line(e)).code("device_busy").retry()
            }
            _ => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, crate::one_line(e)),
        }
    }

    fn body(&self) -> Bytes {
        error_json(&self.message, self.kind, self.param, self.code)
    }

    fn response(&self) -> Response<Out> {
        let mut r = json_response(self.status, self.body());
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if self.close {
            r.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        r
    }
}

fn error_json(message: &str, kind: &str, param: Option<&str>, code: Option<&str>) -> Bytes {
    Bytes::from(json!({"error": {"message": message, "type": kind, "param": param, "code": code}}).to_string())
}

fn json_response(status: StatusCode, body: Bytes) -> Response<Out> {
    let mut r = Response::new(Out::full(body));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// A response body: a whole JSON answer, or audio as the speaker makes it. Dropping it (hyper
/// does once it is sent, or when the client is gone) marks the connection idle.
struct Out {
    kind: OutKind,
    state: Option<Arc<ConnState>>,
}

enum OutKind {
    Full(Option<Bytes>),
    Stream(Streamed),
}

impl Out {
    fn full(body: Bytes) -> Self {
        Out { kind: OutKind::Full(Some(body)), state: None }
    }
}

impl Drop for Out {
    fn drop(&mut self) {
        if let Some(s) = &self.state {
            s.idle(Instant::now());
        }
    }
}

impl Body for Out {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        match &mut self.get_mut().kind {
            OutKind::Full(body) => Poll::Ready(body.take().map(|b| Ok(Frame::data(b)))),
            OutKind::Stream(s) => s.poll(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(&self.kind, OutKind::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            OutKind::Full(body) => SizeHint::with_exact(body.as_ref().map_or(0, |b| b.len() as u64)),
            OutKind::Stream(_) => SizeHint::default(),
        }
    }
}

/// What the speaker's side of a stream sends.
#[derive(Debug)]
enum Event {
    /// The job started (its sink is begun).
    Began,
    /// Bytes of audio (and the WAV header).
    Data(Bytes),
}

/// How a job that failed is told to its response: set before the last sender is dropped.
type Failure = Arc<OnceLock<JobFailure>>;

#[derive(Debug)]
struct JobFailure {
    /// The answer, when the audio had not begun.
    error: ApiError,
}

/// The audio half of a streaming response.
struct Streamed {
    rx: mpsc::Receiver<Event>,
    failure: Failure,
    /// Audio received before the response was made.
    pending: Option<Bytes>,
}

impl Streamed {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        if let Some(b) = self.pending.take() {
            return Poll::Ready(Some(Ok(Frame::data(b))));
        }
        loop {
            match self.rx.poll_recv(cx) {
                Poll::Ready(Some(Event::Began)) => {}
                Poll::Ready(Some(Event::Data(b))) => return Poll::Ready(Some(Ok(Frame::data(b)))),
                // every sender is gone: the job has ended; a failure aborts the response
                Poll::Ready(None) => return Poll::Ready(self.failure.get().map(|f| Err(io::Error::other(f.error.message.clone())))),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// The `Write` a job's sink writes into: each write goes to the response as messages of at
/// most [`MESSAGE_BYTES`], waiting (the speaker's thread) while the channel is full, at most
/// `stall`. Once the response is gone, writes are dropped: the job's watcher cancels the job
/// within [`WATCH_INTERVAL`] (a failed write would be logged as a failure).
struct ChannelWriter {
    tx: mpsc::Sender<Event>,
    stall: Duration,
}

impl Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        for piece in buf.chunks(MESSAGE_BYTES) {
            match send_bounded(&self.tx, Event::Data(Bytes::copy_from_slice(piece)), self.stall) {
                Err(e) if e.kind() == io::ErrorKind::BrokenPipe => break,
                other => other?,
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Send `event` from a thread outside the runtime, waiting while the channel is full for at
/// most `stall` (polling, from 1 to 8 ms apart).
fn send_bounded(tx: &mpsc::Sender<Event>, event: Event, stall: Duration) -> io::Result<()> {
    let end = Instant::now() + stall;
    let mut event = event;
    let mut nap = Duration::from_millis(1);
    loop {
        match tx.try_send(event) {
            Ok(()) => return Ok(()),
            Err(mpsc::error::TrySendError::Closed(_)) => {
                return Err(io::Error::new(io::ErrorKind::BrokenPipe, "the HTTP client went away"));
            }
            Err(mpsc::error::TrySendError::Full(e)) => {
                if Instant::now() >= end {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("the HTTP client took no audio for {stall:?} (serve.request_timeout)"),
                    ));
                }
                event = e;
                std::thread::sleep(nap);
                nap = (nap * 2).min(Duration::from_millis(8));
            }
        }
    }
}

async fn handle(req: Request<Incoming>, peer: SocketAddr, shared: &Shared, state: Arc<ConnState>) -> Response<Out> {
    let started = state.request_started(Instant::now());
    let number = shared.requests.fetch_add(1, Ordering::Relaxed) + 1;
    let (method, path) = (req.method().clone(), req.uri().path().to_owned());
    log::debug!("http: request {number} from {peer}: {method} {path}");
    let route = route(&method, &path);
    let mut response = match respond(req, number, peer, shared, &state, started).await {
        Ok(r) => {
            // a speech or a say logs its outcome when its job ends; the health check, which
            // monitors poll, only at debug level
            match route {
                Route::Speech | Route::Say => {}
                Route::Health => log::debug!("http: request {number} from {peer}: {method} {path}: {}", r.status().as_u16()),
                _ => log::info!("http: request {number} from {peer}: {method} {path}: {}", r.status().as_u16()),
            }
            r
        }
        Err(e) => {
            // a job's own failure (500) is logged where it failed
            if e.status == StatusCode::INTERNAL_SERVER_ERROR {
                log::debug!("http: request {number} from {peer}: {method} {path}: {} {}", e.status.as_u16(), e.message);
            } else {
                log::info!("http: request {number} from {peer}: {method} {path}: {} {}", e.status.as_u16(), e.message);
            }
            e.response()
        }
    };
    state.responding();
    response.body_mut().state = Some(state);
    response
}

async fn respond(
    req: Request<Incoming>,
    number: u64,
    peer: SocketAddr,
    shared: &Shared,
    state: &ConnState,
    started: Instant,
) -> Result<Response<Out>, ApiError> {
    let route = route(req.method(), req.uri().path());
    // a body that is not read makes the connection unusable for the next request
    let unread = !req.body().is_end_stream();
    let close = |e: ApiError| if unread { e.closing() } else { e };
    // the page holds no secret: it asks for the key its API calls need
    match route {
        Route::Health => return Ok(health(shared)),
        Route::Page => return Ok(page()),
        _ => {}
    }
    if !shared.settings.read(|s| s.api_key.as_ref().is_none_or(|key| bearer_ok(req.headers().get(header::AUTHORIZATION), key))) {
        let e =
            ApiError::new(StatusCode::UNAUTHORIZED, "missing or wrong API key: send 'Authorization: Bearer <serve.api_key>'".into())
                .code("invalid_api_key");
        return Err(close(e));
    }
    match route {
        Route::Health => Ok(health(shared)),
        Route::Page => Ok(page()),
        Route::NotFound => {
            Err(close(ApiError::new(StatusCode::NOT_FOUND, format!("no such endpoint: {} {}", req.method(), req.uri().path()))))
        }
        Route::WrongMethod(allow) => {
            let mut r = close(ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("{} takes {allow}, not {}", req.uri().path(), req.method()),
            ))
            .response();
            r.headers_mut().insert(header::ALLOW, HeaderValue::from_static(allow));
            Ok(r)
        }
        Route::Voices => {
            let front = shared.slot.get().ok_or_else(ApiError::loading)?;
            Ok(json_response(StatusCode::OK, Bytes::from(voices_json(front).to_string())))
        }
        Route::Models => {
            let front = shared.slot.get().ok_or_else(ApiError::loading)?;
            Ok(json_response(StatusCode::OK, Bytes::from(json!({"object": "list", "data": [model_json(front)]}).to_string())))
        }
        Route::Model => {
            let front = shared.slot.get().ok_or_else(ApiError::loading)?;
            let id = req.uri().path().trim_start_matches("/v1/models/");
            if id != front.model() {
                return Err(ApiError::new(StatusCode::NOT_FOUND, format!("no model {id:?}; this herald serves {}", front.model()))
                    .code("model_not_found"));
            }
            Ok(json_response(StatusCode::OK, Bytes::from(model_json(front).to_string())))
        }
        Route::Speech | Route::Say => {
            let body = read_body(req, shared, started + shared.settings().request_timeout).await?;
            state.responding();
            if route == Route::Speech {
                speech(&body, number, peer, shared, state).await
            } else {
                say(&body, number, peer, shared).await
            }
        }
    }
}

/// `GET /`: the page ([`crate::page`]), with its Content-Security-Policy; revalidated on
/// every load (`no-cache`), so that a new herald's page is seen at once.
fn page() -> Response<Out> {
    let mut r = Response::new(Out::full(Bytes::from_static(crate::page::PAGE.as_bytes())));
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    // the policy is made of the page's own hashes: ASCII, never an invalid header value
    if let Ok(csp) = HeaderValue::from_str(crate::page::content_security_policy()) {
        h.insert(header::CONTENT_SECURITY_POLICY, csp);
    }
    r
}

/// `GET /v1/audio/voices`'s answer (see the module doc).
fn voices_json(front: &Front) -> Value {
    let voices: Vec<Value> = front
        .listing()
        .into_iter()
        .map(|v| {
            let name = match &v.alias_of {
                None => v.name.clone(),
                Some(to) if to == crate::front::DEFAULT_VOICE => format!("{} (the configured voice)", v.name),
                Some(to) => format!("{} ({to})", v.name),
            };
            json!({"id": v.name, "name": name, "alias_of": v.alias_of, "languages": v.languages})
        })
        .collect();
    json!({ "voices": voices })
}

fn model_json(front: &Front) -> Value {
    json!({"id": front.model(), "object": "model", "created": 0, "owned_by": "herald"})
}

fn health(shared: &Shared) -> Response<Out> {
    let (status, word) = match shared.slot.get() {
        None => (StatusCode::SERVICE_UNAVAILABLE, "loading"),
        Some(f) if f.stop_handle().is_stopped() => (StatusCode::SERVICE_UNAVAILABLE, "stopping"),
        Some(_) => (StatusCode::OK, "ready"),
    };
    json_response(status, Bytes::from(json!({"status": word}).to_string()))
}

/// The whole body, at most [`body_limit`] bytes, by `deadline`.
async fn read_body(req: Request<Incoming>, shared: &Shared, deadline: Instant) -> Result<Bytes, ApiError> {
    let limit = body_limit(shared.slot.get().map(Front::max_text_chars));
    let too_large = || {
        ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("the request body is larger than {limit} bytes"))
            .code("body_too_large")
            .closing()
    };
    if content_length(req.headers()).is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let collected = tokio::time::timeout_at(deadline.into(), Limited::new(req.into_body(), limit).collect()).await;
    match collected {
        Err(_) => {
            Err(ApiError::new(StatusCode::REQUEST_TIMEOUT, "the request body did not arrive in time (serve.request_timeout)".into())
                .closing())
        }
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => Err(too_large()),
        Ok(Err(e)) => Err(ApiError::invalid(None, format!("cannot read the request body: {e}")).closing()),
        Ok(Ok(c)) => Ok(c.to_bytes()),
    }
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(header::CONTENT_LENGTH)?.to_str().ok()?.trim().parse().ok()
}

/// Whether `voice` is one of OpenAI's built-in voices ([`OPENAI_VOICES`]) that `resolved`
/// (what [`Front::resolve_voice`] made of it) says is neither a speaker nor an alias: it then
/// means the configured voice.
fn openai_voice_unknown(voice: &str, resolved: &Result<Option<String>, RequestError>) -> bool {
    let v = voice.trim();
    OPENAI_VOICES.iter().any(|o| o.eq_ignore_ascii_case(v)) && resolved.is_err()
}

/// A thread started before its job is queued (so that a thread that cannot be started refuses
/// the request instead of stranding a queued job), which runs `f` with the job's handle once
/// it is sent; a sender dropped unsent (the job was refused) ends it.
fn job_thread(name: &str, f: impl FnOnce(JobHandle) + Send + 'static) -> Result<std::sync::mpsc::SyncSender<JobHandle>, ApiError> {
    let (tx, rx) = std::sync::mpsc::sync_channel::<JobHandle>(1);
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            if let Ok(handle) = rx.recv() {
                f(handle);
            }
        })
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot start a thread: {e}")))?;
    Ok(tx)
}

/// Hand `handle` to its [`job_thread`]; should that thread be gone, the job is cancelled.
fn hand_over(thread: &std::sync::mpsc::SyncSender<JobHandle>, handle: JobHandle) -> Result<(), ApiError> {
    thread.send(handle).map_err(|std::sync::mpsc::SendError(h)| {
        h.cancel();
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the job's thread ended".into())
    })
}

async fn speech(body: &[u8], number: u64, peer: SocketAddr, shared: &Shared, state: &ConnState) -> Result<Response<Out>, ApiError> {
    let params = parse_speech(body)?;
    let front = shared.slot.get().ok_or_else(ApiError::loading)?;
    if let Some(model) = params.model.as_deref().filter(|m| *m != front.model()) {
        log::debug!("http: request {number}: model {model:?} asked for; speaking with {}", front.model());
    }
    if let Some(i) = &params.instructions {
        log::debug!("http: request {number}: instructions ignored ({} characters)", i.chars().count());
    }
    let voice = match params.voice.as_deref() {
        Some(v) if openai_voice_unknown(v, &front.resolve_voice(Some(v))) => {
            log::debug!(
                "http: request {number}: OpenAI's voice {:?} is neither a speaker nor an alias; speaking with the configured voice",
                v.trim()
            );
            None
        }
        v => v,
    };
    let request = front.request(&params.input, voice, params.language.as_deref()).map_err(|e| ApiError::request(&e))?;
    let chars = params.input.chars().count();
    let what = format!("{number} from {peer}: speech of {chars} characters");
    let (tx, mut rx) = mpsc::channel::<Event>(CHANNEL_MESSAGES);
    // the connection's watchdog closes a response that makes no progress for request_timeout
    // (and that cancels the job); this is the backstop should the speaker wait that long anyway
    let writer = ChannelWriter { tx: tx.clone(), stall: shared.settings().request_timeout + Duration::from_secs(1) };
    let failure: Failure = Arc::default();
    let watcher = {
        let (failure, tx) = (Arc::clone(&failure), tx.clone());
        job_thread("herald-http-job", move |handle| watch_job(handle, tx, &failure, &what))?
    };
    let target = format!("HTTP client {peer}");
    let sink = match params.format {
        AudioFormat::Wav => front.wav_sink(writer, &target),
        AudioFormat::Pcm => front.raw_sink(writer, &target),
        AudioFormat::Encoded(codec) => front.encoded_sink(codec, writer, &target),
    };
    let began = tx.clone();
    let handle = front
        .submit(request, sink, params.speed, move |_| {
            log::debug!("http: request {number}: speaking {chars} characters");
            // the channel is empty but for the WAV header at this point; a full one only
            // loses the early head, and the audio makes the response anyway
            let _ = began.try_send(Event::Began);
        })
        .map_err(|r| ApiError::refused(&r))?;
    drop(tx);
    hand_over(&watcher, handle)?;
    // the head goes out when the job starts (or its first audio arrives), so that a job that
    // fails before it gets an error answer; or at once when the client closes its side
    // meanwhile: a client that shut down only its sending side waits for its audio, one that
    // closed entirely answers the head with a reset, and the job is cancelled before it starts
    let pending = tokio::select! {
        got = rx.recv() => match got {
            Some(Event::Began) => None,
            Some(Event::Data(b)) => Some(b),
            None => {
                return Err(failure.get().map(|f| f.error.clone()).unwrap_or_else(|| {
                    if shared.stopped() {
                        ApiError::stopping()
                    } else {
                        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the job ended without audio".into())
                    }
                }));
            }
        },
        () = state.closed_early.notified() => {
            log::debug!("http: request {number}: the client closed its side while its job waits; the head goes out now");
            None
        }
    };
    let mut r = Response::new(Out { kind: OutKind::Stream(Streamed { rx, failure, pending }), state: None });
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(params.format.content_type()));
    r.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r.headers_mut().insert("x-sample-rate", HeaderValue::from(front.sample_rate()));
    Ok(r)
}

/// Wait for a streaming job's outcome on a thread of its own, cancelling the job when its
/// client is gone (the response's receiver dropped), and tell the response how it ended before
/// dropping the last sender.
fn watch_job(handle: JobHandle, tx: mpsc::Sender<Event>, failure: &Failure, number: &str) {
    let mut cancelled = false;
    let outcome = loop {
        if let Some(o) = handle.wait_timeout(WATCH_INTERVAL) {
            break o;
        }
        if !cancelled && tx.is_closed() {
            handle.cancel();
            cancelled = true;
            log::info!("http: request {number}: the client went away; its job is cancelled");
        }
    };
    match outcome {
        Ok(spoken) => log_spoken(number, &spoken, cancelled, "the stream was ended cleanly"),
        Err(e) => {
            if cancelled || tx.is_closed() {
                log::debug!("http: request {number}: ended after the client went away: {}", crate::one_line(&e));
            } else if matches!(e, JobError::Sink(_)) {
                // the client's side: it stopped taking audio
                log::info!("http: request {number}: {}; its job is cancelled", crate::one_line(&e));
            } else {
                log_failure(number, &e);
            }
            let _ = failure.set(JobFailure { error: ApiError::job(&e) });
        }
    }
    drop(tx);
}

/// Log a job's outcome; `number` names the request (`5 from 10.0.0.2:4711: say of 16
/// characters`), `stopped` says what a job cut short by the stop did.
fn log_spoken(number: &str, spoken: &Spoken, cancelled: bool, stopped: &str) {
    match &spoken.report {
        Some(report) => log::info!(
            "http: request {number}: {} frames ({:.2} s of audio) in {:.2} s, time to first audio {:.0} ms",
            report.frames,
            spoken.stats.input_samples as f64 / f64::from(spoken.stats.device_rate.max(1)),
            report.total,
            report.ttfa * 1e3
        ),
        None if cancelled => log::info!("http: request {number}: cancelled"),
        None => log::info!("http: request {number}: stopped by a signal; {stopped}"),
    }
}

/// Log a job that failed: at error level only for the server's own failures (the engine, the
/// device, a bug), not for a job the stop cancelled before it started.
fn log_failure(number: &str, e: &JobError) {
    match e {
        JobError::Cancelled => log::info!("http: request {number}: cancelled by the stop before it started"),
        JobError::Engine(engine::EngineError::Prompt(_)) => log::info!("http: request {number}: {}", crate::one_line(e)),
        _ => log::error!("http: request {number}: {}", crate::one_line(e)),
    }
}

async fn say(body: &[u8], number: u64, peer: SocketAddr, shared: &Shared) -> Result<Response<Out>, ApiError> {
    let params = parse_say(body)?;
    let front = shared.slot.get().ok_or_else(ApiError::loading)?;
    let request =
        front.request(&params.input, params.voice.as_deref(), params.language.as_deref()).map_err(|e| ApiError::request(&e))?;
    // a missing device: 503 at once, not a job that fails (crate::device)
    front.device_ready().map_err(|e| ApiError::no_device(&e))?;
    let (done, outcome) = oneshot::channel();
    let what = format!("{number} from {peer}: say of {} characters", params.input.chars().count());
    // the say goes on when the client goes away (nobody cancels it), and its outcome is logged
    // by its own thread, whether anyone still waits for it or not
    let waiter = job_thread("herald-http-say", move |handle| {
        let outcome = handle.wait();
        match &outcome {
            Ok(spoken) => log_spoken(&what, spoken, false, "the announcement was cut short"),
            Err(e) => log_failure(&what, e),
        }
        let _ = done.send(outcome);
    })?;
    let handle = front.play(request, params.speed).map_err(|r| ApiError::refused(&r))?;
    log::debug!("http: request {number} from {peer}: say {} characters on the device", params.input.chars().count());
    hand_over(&waiter, handle)?;
    match outcome.await {
        Ok(Ok(spoken)) => {
            front.note_played(Ok(()));
            let body = json!({
                "spoken": spoken.report.is_some(),
                "samples": spoken.stats.input_samples,
                "sample_rate": front.sample_rate(),
            });
            Ok(json_response(StatusCode::OK, Bytes::from(body.to_string())))
        }
        Ok(Err(e)) => Err(front.note_played(Err(&e)).map_or_else(|| ApiError::job(&e), |d| ApiError::no_device(&d))),
        Err(_) => Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the speaker's worker ended".into())),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use std::io::Read;

    fn err(r: Result<SpeechParams, ApiError>) -> ApiError {
        r.expect_err("refused")
    }

    #[test]
    fn a_full_speech_request_parses_and_defaults_to_mp3() {
        let p = parse_speech(br#"{"model":"tts-1","input":"Hello.","voice":"default","speed":1,"instructions":"calm","stream_format":"audio","language":"en"}"#)
            .unwrap();
        assert_eq!(
            p,
            SpeechParams {
                model: Some("tts-1".into()),
                input: "Hello.".into(),
                voice: Some("default".into()),
                format: AudioFormat::Encoded(Codec::Mp3),
                language: Some("en".into()),
                instructions: Some("calm".into()),
                speed: Some(1.0),
            }
        );
        let p = parse_speech(br#"{"input":"x","response_format":"PCM","voice":{"id":"ryan"},"speed":1.0,"extra":[1,2]}"#).unwrap();
        assert_eq!((p.format, p.voice.as_deref(), p.model), (AudioFormat::Pcm, Some("ryan"), None));
        for (given, format, mime) in [
            ("mp3", AudioFormat::Encoded(Codec::Mp3), "audio/mpeg"),
            ("Flac", AudioFormat::Encoded(Codec::Flac), "audio/flac"),
            ("OPUS", AudioFormat::Encoded(Codec::Opus), "audio/ogg"),
            ("wav", AudioFormat::Wav, "audio/wav"),
            ("pcm", AudioFormat::Pcm, "audio/pcm"),
        ] {
            let p = parse_speech(format!(r#"{{"input":"x","response_format":"{given}"}}"#).as_bytes()).unwrap();
            assert_eq!((p.format, p.format.content_type()), (format, mime));
        }
    }

    #[test]
    fn codecs_herald_does_not_make_are_refused_naming_the_field() {
        let e = err(parse_speech(br#"{"input":"x","response_format":"AAC"}"#));
        assert_eq!((e.status, e.param), (StatusCode::BAD_REQUEST, Some("response_format")));
        assert_eq!(
            e.message,
            "herald does not produce aac (no encoder for it is built in); response_format must be one of: mp3, opus, flac, wav, pcm"
        );
        let e = err(parse_speech(br#"{"input":"x","response_format":"ogg"}"#));
        assert_eq!(e.message, "unknown response_format \"ogg\"; response_format must be one of: mp3, opus, flac, wav, pcm");
        let e = err(parse_speech(br#"{"input":"x","response_format":7}"#));
        assert_eq!((e.param, e.message.as_str()), (Some("response_format"), "'response_format' must be a string, not a number"));
    }

    #[test]
    fn speed_is_a_number_from_a_quarter_to_four() {
        for (given, want) in [("0.25", 0.25f32), ("1", 1.0), ("1.5", 1.5), ("4", 4.0), ("4.0", 4.0)] {
            let p = parse_speech(format!(r#"{{"input":"x","speed":{given}}}"#).as_bytes()).unwrap();
            assert_eq!(p.speed, Some(want), "{given}");
        }
        assert_eq!(parse_speech(br#"{"input":"x","speed":null}"#).unwrap().speed, None);
        assert_eq!(parse_speech(br#"{"input":"x"}"#).unwrap().speed, None);
        for given in ["0.2", "4.01", "0", "-1", "1000000000"] {
            let e = err(parse_speech(format!(r#"{{"input":"x","speed":{given}}}"#).as_bytes()));
            assert_eq!((e.status, e.param), (StatusCode::BAD_REQUEST, Some("speed")), "{given}");
            assert_eq!(e.message, format!("speed {given} is out of range; allowed: 0.25 to 4.0"));
        }
        let e = err(parse_speech(br#"{"input":"x","speed":"fast"}"#));
        assert_eq!(e.message, "'speed' must be a number from 0.25 to 4.0, not a string");
        assert_eq!(parse_say(br#"{"input":"x","speed":0.5}"#).unwrap().speed, Some(0.5));
        assert_eq!(parse_say(br#"{"input":"x","speed":5}"#).expect_err("refused").param, Some("speed"));
    }

    #[test]
    fn sse_streams_are_refused() {
        let e = err(parse_speech(br#"{"input":"x","stream_format":"sse"}"#));
        assert_eq!((e.param, e.message.as_str()), (Some("stream_format"), "stream_format \"sse\" is not supported; allowed: audio"));
    }

    #[test]
    fn bad_bodies_are_400s_that_say_what_is_wrong() {
        let cases: &[(&[u8], Option<&str>, &str)] = &[
            (b"", None, "the request body is empty; expected a JSON object"),
            (b"{\"input\": ", None, "the request body is not valid JSON: EOF while parsing a value at line 1 column 10"),
            (b"[1]", None, "the request body must be a JSON object, not an array"),
            (b"{}", Some("input"), "missing required parameter: 'input'"),
            (b"{\"input\": null}", Some("input"), "missing required parameter: 'input'"),
            (b"{\"input\": 5}", Some("input"), "'input' must be a string, not a number"),
            (b"{\"input\": \"x\", \"voice\": true}", Some("voice"), "'voice' must be a string, not a boolean"),
            (
                b"{\"input\": \"x\", \"voice\": {\"name\": \"a\"}}",
                Some("voice"),
                "'voice' must be a string or an object with a string 'id'",
            ),
            (b"{\"input\": \"x\", \"model\": []}", Some("model"), "'model' must be a string, not an array"),
        ];
        for (body, param, message) in cases {
            let e = err(parse_speech(body));
            assert_eq!((e.status, e.param, e.message.as_str()), (StatusCode::BAD_REQUEST, *param, *message), "{body:?}");
        }
        // nesting past serde_json's recursion limit (128) is an error, not a stack overflow
        let deep = format!("{{\"input\":\"x\",\"extra\":{}{}}}", "[".repeat(100_000), "]".repeat(100_000));
        let e = err(parse_speech(deep.as_bytes()));
        assert!(e.message.contains("recursion limit exceeded"), "{}", e.message);
    }

    #[test]
    fn say_takes_input_voice_and_language() {
        let p = parse_say(br#"{"input":"Dinner is ready.","language":"english"}"#).unwrap();
        assert_eq!(p, SayParams { input: "Dinner is ready.".into(), voice: None, language: Some("english".into()), speed: None });
        assert_eq!(parse_say(b"{}").unwrap_err().param, Some("input"));
    }

    #[test]
    fn routes_and_methods() {
        assert_eq!(route(&Method::GET, "/"), Route::Page);
        assert_eq!(route(&Method::HEAD, "/"), Route::Page);
        assert_eq!(route(&Method::POST, "/"), Route::WrongMethod("GET, HEAD"));
        assert_eq!(route(&Method::GET, "/index.html"), Route::NotFound);
        assert_eq!(route(&Method::POST, "/v1/audio/speech"), Route::Speech);
        assert_eq!(route(&Method::GET, "/v1/audio/speech"), Route::WrongMethod("POST"));
        assert_eq!(route(&Method::POST, "/v1/say"), Route::Say);
        assert_eq!(route(&Method::GET, "/v1/models"), Route::Models);
        assert_eq!(route(&Method::GET, "/v1/audio/voices"), Route::Voices);
        assert_eq!(route(&Method::POST, "/v1/audio/voices"), Route::WrongMethod("GET, HEAD"));
        assert_eq!(route(&Method::GET, "/v1/models/qwen3-tts-0b6-base"), Route::Model);
        assert_eq!(route(&Method::GET, "/v1/models/"), Route::NotFound);
        assert_eq!(route(&Method::GET, "/v1/models/a/b"), Route::NotFound);
        assert_eq!(route(&Method::HEAD, "/healthz"), Route::Health);
        assert_eq!(route(&Method::DELETE, "/healthz"), Route::WrongMethod("GET, HEAD"));
        assert_eq!(route(&Method::GET, "/etc/passwd"), Route::NotFound);
        assert_eq!(route(&Method::GET, "/v1/audio/speech/"), Route::NotFound);
    }

    #[test]
    fn the_bearer_token_must_match_exactly() {
        let h = |s: &'static str| HeaderValue::from_static(s);
        assert!(bearer_ok(Some(&h("Bearer s3cret")), "s3cret"));
        assert!(bearer_ok(Some(&h("bearer  s3cret ")), "s3cret"));
        assert!(!bearer_ok(Some(&h("Bearer s3cre")), "s3cret"));
        assert!(!bearer_ok(Some(&h("Bearer s3cretx")), "s3cret"));
        assert!(!bearer_ok(Some(&h("Basic s3cret")), "s3cret"));
        assert!(!bearer_ok(Some(&h("s3cret")), "s3cret"));
        assert!(!bearer_ok(None, "s3cret"));
        assert!(!bearer_ok(Some(&h("Bearer ")), ""), "an empty key opens nothing");
    }

    #[test]
    fn the_body_limit_grows_with_the_text_limit_only() {
        assert_eq!(body_limit(None), MAX_BODY_BYTES);
        assert_eq!(body_limit(Some(4096)), MAX_BODY_BYTES, "4096 escaped surrogate pairs fit in 64 KiB");
        assert_eq!(body_limit(Some(5120)), MAX_BODY_BYTES);
        assert_eq!(body_limit(Some(6000)), 76_096, "6000 emoji as \\ud83d\\ude00 are 72 000 bytes");
        assert_eq!(body_limit(Some(100_000)), 1_204_096);
        assert_eq!(body_limit(Some(usize::MAX)), usize::MAX);
    }

    #[test]
    fn the_timeouts_follow_the_phase() {
        let settings = HttpSettings {
            max_connections: 4,
            request_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(30),
            api_key: None,
        };
        let t0 = Instant::now();
        let s = ConnState::new(t0);
        assert_eq!(s.expired(t0 + Duration::from_secs(29), &settings), None);
        assert_eq!(s.expired(t0 + Duration::from_secs(30), &settings), Some(Expired::Idle));
        // the first byte of a request starts the request timeout
        s.read(t0 + Duration::from_secs(1));
        s.read(t0 + Duration::from_secs(3));
        assert_eq!(s.expired(t0 + Duration::from_millis(5999), &settings), None);
        assert_eq!(s.expired(t0 + Duration::from_secs(6), &settings), Some(Expired::Request));
        assert_eq!(s.request_started(t0 + Duration::from_secs(4)), t0 + Duration::from_secs(1));
        // answering has no timeout; bytes read meanwhile (pipelining) do not start one
        s.responding();
        s.read(t0 + Duration::from_secs(7));
        assert_eq!(s.expired(t0 + Duration::from_secs(1000), &settings), None);
        // but a response whose writes wait for room for request_timeout is cut, whatever
        // went through before
        s.wrote(false, t0 + Duration::from_secs(100));
        s.wrote(false, t0 + Duration::from_secs(101));
        assert_eq!(s.expired(t0 + Duration::from_millis(104_999), &settings), None);
        assert_eq!(s.expired(t0 + Duration::from_secs(105), &settings), Some(Expired::Stalled));
        s.wrote(true, t0 + Duration::from_secs(106));
        assert_eq!(s.expired(t0 + Duration::from_secs(1000), &settings), None);
        s.idle(t0 + Duration::from_secs(1000));
        assert_eq!(s.expired(t0 + Duration::from_secs(1029), &settings), None);
        assert_eq!(s.expired(t0 + Duration::from_secs(1030), &settings), Some(Expired::Idle));
        assert_eq!(watchdog_tick(&settings), Duration::from_millis(250));
        let quick = HttpSettings { request_timeout: Duration::from_millis(20), ..settings };
        assert_eq!(watchdog_tick(&quick), Duration::from_millis(10));
    }

    #[test]
    fn errors_are_openai_shaped() {
        let e = err(parse_speech(br#"{"input":"x","response_format":"aac"}"#));
        let v: Value = serde_json::from_slice(&e.body()).unwrap();
        assert_eq!(
            v,
            json!({"error": {"message": "herald does not produce aac (no encoder for it is built in); response_format must be one of: mp3, opus, flac, wav, pcm",
                "type": "invalid_request_error", "param": "response_format", "code": null}})
        );
        let busy = ApiError::refused(&Refused::Full { job: Box::new(test_job()), capacity: 2 });
        assert_eq!(
            (busy.status, busy.kind, busy.code, busy.retry_after),
            (StatusCode::SERVICE_UNAVAILABLE, "server_error", Some("busy"), Some(1))
        );
        let r = busy.response();
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        assert_eq!(r.headers()[header::CONTENT_TYPE], "application/json");
        assert_eq!(ApiError::job(&JobError::Cancelled).code, Some("stopping"));
    }

    fn test_job() -> crate::Job {
        let request = engine::Request {
            text: "x".into(),
            language: None,
            speaker: None,
            mode: Default::default(),
            seed: None,
            max_frames: None,
            force_eos_at: None,
        };
        crate::Job::new(request, crate::Target::Device)
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
    }

    #[test]
    fn a_stream_ends_cleanly_or_with_an_error_after_its_audio() {
        // the job ended well: the audio, then the end
        let (tx, rx) = mpsc::channel(4);
        let failure: Failure = Arc::default();
        let writer = std::thread::spawn(move || {
            let mut w = ChannelWriter { tx: tx.clone(), stall: Duration::from_secs(5) };
            w.write_all(b"abc").unwrap();
            send_bounded(&tx, Event::Began, Duration::from_secs(1)).unwrap();
            w.write_all(b"def").unwrap();
        });
        let out = Out { kind: OutKind::Stream(Streamed { rx, failure, pending: Some(Bytes::from_static(b"<")) }), state: None };
        let body = rt().block_on(out.collect()).unwrap().to_bytes();
        writer.join().unwrap();
        assert_eq!(&body[..], b"<abcdef");

        // the job failed after its audio began: the body ends with an error
        let (tx, rx) = mpsc::channel(4);
        let failure: Failure = Arc::default();
        ChannelWriter { tx: tx.clone(), stall: Duration::from_secs(1) }.write_all(b"abc").unwrap();
        failure.set(JobFailure { error: ApiError::job(&JobError::Panicked("boom".into())) }).unwrap();
        drop(tx);
        let out = Out { kind: OutKind::Stream(Streamed { rx, failure, pending: None }), state: None };
        let e = rt().block_on(out.collect()).map(|_| ()).unwrap_err();
        assert_eq!(e.to_string(), "internal error (please report it): boom");
    }

    #[test]
    fn a_writer_times_out_when_the_client_takes_nothing_and_drops_audio_nobody_wants() {
        let (tx, rx) = mpsc::channel(1);
        let mut w = ChannelWriter { tx, stall: Duration::from_millis(30) };
        w.write_all(b"a").unwrap();
        let t = Instant::now();
        let e = w.write_all(b"b").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(t.elapsed() >= Duration::from_millis(30));
        // the response is gone: the audio goes nowhere, and the job's watcher cancels the job
        drop(rx);
        w.write_all(b"c").unwrap();
    }

    #[test]
    fn the_audio_waiting_for_a_client_is_bounded_in_bytes() {
        let (tx, mut rx) = mpsc::channel(CHANNEL_MESSAGES);
        let mut w = ChannelWriter { tx, stall: Duration::from_millis(30) };
        // an engine chunk of 25 frames: 25 × 1920 samples × 2 bytes
        let chunk = vec![7u8; 96_000];
        w.write_all(&chunk).unwrap();
        let mut sizes = Vec::new();
        while let Ok(Event::Data(b)) = rx.try_recv() {
            sizes.push(b.len());
        }
        assert_eq!(sizes, [16_384, 16_384, 16_384, 16_384, 16_384, 14_080]);
        // a client that takes nothing: at most QUEUED_AUDIO_BYTES wait, then the speaker is
        // told
        let mut queued = 0;
        let e = loop {
            match w.write_all(&chunk) {
                Ok(()) => queued += chunk.len(),
                Err(e) => break e,
            }
        };
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(queued <= QUEUED_AUDIO_BYTES, "{queued}");
        let mut waiting = 0;
        while let Ok(Event::Data(b)) = rx.try_recv() {
            waiting += b.len();
        }
        assert!(waiting <= QUEUED_AUDIO_BYTES && waiting > QUEUED_AUDIO_BYTES - MESSAGE_BYTES, "{waiting}");
    }

    #[test]
    fn openai_voices_neither_speaker_nor_alias_mean_the_configured_voice() {
        use crate::front::{Aliases, VoiceInfo, resolve_voice};
        let voices = |names: &[&str]| -> Vec<VoiceInfo> {
            names.iter().map(|n| VoiceInfo { name: (*n).into(), languages: vec!["english".into()] }).collect()
        };
        let fallback =
            |v: &str, voices: &[VoiceInfo]| openai_voice_unknown(v, &resolve_voice(voices, &Aliases::builtin(voices), Some(v)));
        // a bundle without speakers offers no built-in alias
        let plain = voices(&["default"]);
        for v in OPENAI_VOICES {
            assert!(fallback(v, &plain), "{v}");
        }
        assert!(fallback(" Alloy ", &plain));
        assert!(!fallback("nobody", &plain), "not an OpenAI voice: still refused");
        assert!(!fallback("default", &plain));
        // a bundle with a speaker of that name speaks with it; a built-in alias with its speaker
        let some = voices(&["nova", "ryan"]);
        assert!(!fallback("nova", &some));
        assert!(!fallback("echo", &some), "echo is the built-in alias of ryan");
        assert!(fallback("fable", &some), "fable's aiden is not in this bundle");
        assert!(fallback("ash", &some));
    }

    /// One raw HTTP/1.1 exchange with `server`; the answer's status line and body.
    fn exchange(addr: SocketAddr, request: &[u8]) -> (String, String) {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(request).unwrap();
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer);
        let answer = String::from_utf8_lossy(&answer).into_owned();
        let status = answer.lines().next().unwrap_or_default().to_owned();
        let body = answer.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
        (status, body)
    }

    fn server(api_key: Option<&str>, max_connections: usize) -> HttpServer {
        server_with(HttpSettings {
            max_connections,
            request_timeout: Duration::from_millis(300),
            idle_timeout: Duration::from_secs(5),
            api_key: api_key.map(Into::into),
        })
    }

    fn server_with(settings: HttpSettings) -> HttpServer {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        HttpServer::start(listener, Slot::new(), settings).unwrap()
    }

    /// A keep-alive connection that has had one `/healthz` answered (and is idle now).
    fn idle_connection(addr: SocketAddr) -> std::net::TcpStream {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut answer = Vec::new();
        let mut buf = [0u8; 1024];
        while !answer.ends_with(br#"{"status":"loading"}"#) {
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0, "{}", String::from_utf8_lossy(&answer));
            answer.extend_from_slice(&buf[..n]);
        }
        s
    }

    /// Whether the server closed `s` within 5 s (EOF or a reset).
    fn closed_by_server(s: &mut std::net::TcpStream) -> bool {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 64];
        match s.read(&mut buf) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => e.kind() == io::ErrorKind::ConnectionReset,
        }
    }

    #[test]
    fn a_loading_server_answers_every_route_and_survives_bad_requests() {
        let server = server(None, 8);
        let a = server.local_addr();
        let (status, body) = exchange(a, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        assert_eq!((status.as_str(), body.as_str()), ("HTTP/1.1 503 Service Unavailable", r#"{"status":"loading"}"#));
        let (status, body) = exchange(a, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        assert_eq!(status, "HTTP/1.1 503 Service Unavailable");
        assert!(body.contains(r#""code":"loading""#), "{body}");
        // a valid request waits for the model; a bad one is refused at once
        let speech = |json: &str| {
            format!("POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{json}", json.len())
        };
        let (status, body) = exchange(a, speech(r#"{"input":"Hi.","response_format":"aac"}"#).as_bytes());
        assert_eq!(status, "HTTP/1.1 400 Bad Request");
        assert!(body.contains(r#""param":"response_format""#), "{body}");
        let (status, _) = exchange(a, speech(r#"{"input":"Hi."}"#).as_bytes());
        assert_eq!(status, "HTTP/1.1 503 Service Unavailable");
        let (status, _) = exchange(a, speech("{not json").as_bytes());
        assert_eq!(status, "HTTP/1.1 400 Bad Request");
        let (status, body) = exchange(a, b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        assert_eq!(status, "HTTP/1.1 404 Not Found");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            v,
            json!({"error": {"message": "no such endpoint: GET /nope", "type": "invalid_request_error", "param": null, "code": null}})
        );
        let (status, _) = exchange(a, b"GET /v1/audio/speech HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        assert_eq!(status, "HTTP/1.1 405 Method Not Allowed");
        // over the body limit: refused from the Content-Length, and from the bytes themselves
        let (status, _) = exchange(a, b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n{");
        assert_eq!(status, "HTTP/1.1 413 Payload Too Large");
        let big = format!("{{\"input\":\"{}\"}}", "a".repeat(MAX_BODY_BYTES));
        let chunked = format!(
            "POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{big}\r\n0\r\n\r\n",
            big.len()
        );
        let (status, _) = exchange(a, chunked.as_bytes());
        assert_eq!(status, "HTTP/1.1 413 Payload Too Large");
        // a header over the head limit
        let long = format!("GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: {}\r\n\r\n", "a".repeat(MAX_HEAD_BYTES));
        let (status, _) = exchange(a, long.as_bytes());
        assert_eq!(status, "HTTP/1.1 431 Request Header Fields Too Large");
        // garbage is answered 400 by hyper, and the server goes on
        let (status, _) = exchange(a, b"\x00\x01\x02 garbage\r\n\r\n");
        assert_eq!(status, "HTTP/1.1 400 Bad Request");
        let (status, _) = exchange(a, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        assert_eq!(status, "HTTP/1.1 503 Service Unavailable");
        server.shutdown(Duration::from_secs(1));
    }

    #[test]
    fn slow_clients_are_cut_off_and_do_not_hold_up_others() {
        let server = server(None, 8);
        let a = server.local_addr();
        let t = Instant::now();
        let mut slow = std::net::TcpStream::connect(a).unwrap();
        slow.write_all(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Le").unwrap();
        // meanwhile another client is served
        let (status, _) = exchange(a, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        assert_eq!(status, "HTTP/1.1 503 Service Unavailable");
        slow.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut rest = Vec::new();
        let n = slow.read_to_end(&mut rest).unwrap();
        assert_eq!(n, 0, "closed without an answer");
        let waited = t.elapsed();
        assert!(waited >= Duration::from_millis(300) && waited < Duration::from_secs(3), "{waited:?}");
        server.shutdown(Duration::from_secs(1));
    }

    #[test]
    fn the_api_key_guards_everything_but_the_health_check() {
        let server = server(Some("s3cret"), 8);
        let a = server.local_addr();
        let (status, body) = exchange(a, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        assert_eq!(status, "HTTP/1.1 401 Unauthorized");
        assert!(body.contains(r#""code":"invalid_api_key""#), "{body}");
        let (status, _) =
            exchange(a, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\nConnection: close\r\n\r\n");
        assert_eq!(status, "HTTP/1.1 401 Unauthorized");
        let (status, _) =
            exchange(a, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\nConnection: close\r\n\r\n");
        assert_eq!(status, "HTTP/1.1 503 Service Unavailable", "past the key: loading");
        let (status, _) = exchange(a, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        assert_eq!(status, "HTTP/1.1 503 Service Unavailable");
        server.shutdown(Duration::from_secs(1));
    }

    #[test]
    fn the_page_needs_no_key_while_the_api_does() {
        let server = server(Some("s3cret"), 8);
        let a = server.local_addr();
        let raw = |request: &[u8]| {
            let mut s = std::net::TcpStream::connect(a).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            s.write_all(request).unwrap();
            let mut answer = Vec::new();
            let _ = s.read_to_end(&mut answer);
            String::from_utf8(answer).unwrap()
        };
        let answer = raw(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        let head = head.to_ascii_lowercase();
        assert!(head.contains("\r\ncontent-type: text/html; charset=utf-8\r\n"), "{head}");
        assert!(head.contains("\r\ncache-control: no-cache\r\n"), "{head}");
        let csp = format!("\r\ncontent-security-policy: {}\r\n", crate::page::content_security_policy().to_ascii_lowercase());
        assert!(head.contains(&csp), "{head}");
        assert!(head.contains(&format!("\r\ncontent-length: {}\r\n", crate::page::PAGE.len())), "{head}");
        assert_eq!(body, crate::page::PAGE);
        // the same head without the body
        let answer = raw(b"HEAD / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n") && head.to_ascii_lowercase().contains("content-security-policy: "), "{head}");
        assert_eq!(body, "");
        // the API behind the page still needs the key
        let (status, body) = exchange(a, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        assert_eq!(status, "HTTP/1.1 401 Unauthorized");
        assert!(body.contains(r#""code":"invalid_api_key""#), "{body}");
        // the page is only got
        let answer =
            raw(b"POST / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        assert!(answer.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"), "{answer}");
        assert!(answer.to_ascii_lowercase().contains("\r\nallow: get, head\r\n"), "{answer}");
        server.shutdown(Duration::from_secs(1));
    }

    #[test]
    fn connections_over_the_limit_are_told_busy() {
        let server = server_with(HttpSettings {
            max_connections: 1,
            request_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(10),
            api_key: None,
        });
        let a = server.local_addr();
        let mut held = std::net::TcpStream::connect(a).unwrap();
        // the first connection has just opened (it gets FRESH_GRACE to send its request)
        std::thread::sleep(Duration::from_millis(100));
        let (status, body) = exchange(a, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        assert_eq!(status, "HTTP/1.1 503 Service Unavailable");
        assert!(body.contains("max_connections") && body.contains(r#""code":"busy""#), "{body}");
        // past max_connections refused ones taking their answer, one more is answered at once
        let mut taking = std::net::TcpStream::connect(a).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let (status, body) = exchange(a, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        assert_eq!(status, "HTTP/1.1 503 Service Unavailable");
        assert!(body.contains(r#""code":"busy""#), "{body}");
        let mut answer = String::new();
        taking.read_to_string(&mut answer).unwrap();
        assert!(answer.starts_with("HTTP/1.1 503") && answer.contains("retry-after: 1"), "{answer}");
        // the fresh connection was not touched: its request is answered
        held.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut first = [0u8; 12];
        held.read_exact(&mut first).unwrap();
        assert_eq!(&first, b"HTTP/1.1 503");
        drop(held);
        let end = Instant::now() + Duration::from_secs(5);
        loop {
            let (status, body) = exchange(a, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
            if body.contains("loading") {
                break;
            }
            assert!(Instant::now() < end, "{status} {body}");
            std::thread::sleep(Duration::from_millis(10));
        }
        server.shutdown(Duration::from_secs(1));
    }

    #[test]
    fn idle_keep_alive_connections_make_room_for_new_ones() {
        let server = server_with(HttpSettings {
            max_connections: 3,
            request_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            api_key: None,
        });
        let a = server.local_addr();
        let healthz = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
        let mut oldest = idle_connection(a);
        std::thread::sleep(Duration::from_millis(20));
        let mut held: Vec<_> = (0..2).map(|_| idle_connection(a)).collect();
        // the limit is reached, but every connection is idle: a new one is served, and the
        // one idle the longest is closed to make room
        let (status, body) = exchange(a, healthz);
        assert_eq!((status.as_str(), body.as_str()), ("HTTP/1.1 503 Service Unavailable", r#"{"status":"loading"}"#));
        assert!(closed_by_server(&mut oldest));
        // again and again: the limit never locks the server out while connections idle
        for _ in 0..3 {
            held.push(idle_connection(a));
        }
        for _ in 0..3 {
            let (_, body) = exchange(a, healthz);
            assert_eq!(body, r#"{"status":"loading"}"#);
        }
        server.shutdown(Duration::from_secs(1));
    }

    #[test]
    fn a_shutdown_closes_idle_connections_at_once() {
        let server = server_with(HttpSettings {
            max_connections: 8,
            request_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            api_key: None,
        });
        let a = server.local_addr();
        let mut kept = idle_connection(a);
        let mut silent = std::net::TcpStream::connect(a).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let t = Instant::now();
        server.begin_shutdown();
        assert!(closed_by_server(&mut kept));
        assert!(closed_by_server(&mut silent));
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        // the listening socket is closed by then
        assert!(std::net::TcpStream::connect(a).is_err());
        server.finish_shutdown(Instant::now() + Duration::from_secs(5));
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    }
}
