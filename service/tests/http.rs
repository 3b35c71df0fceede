//! The HTTP server with the real engine on the tiny bundle, over plain sockets: the audio it
//! streams is the raw sink's, sample for sample, and starts before the utterance ends; a
//! client that goes away cancels its job, also while it waits in the queue; one that takes no
//! audio has its job cancelled and its connection closed; one that only shuts down its sending
//! side gets all its audio; a full queue answers busy and nothing interleaves; the stop ends a
//! stream cleanly; OpenAI's voice names that are no alias mean the configured voice; an alias
//! speaks exactly as its speaker, `GET /v1/audio/voices` lists it, and an unknown voice is a 400
//! naming the voices and aliases; every format (mp3, the
//! default, flac, wav) decodes with ffmpeg to the pcm answer's samples, within each codec's
//! frame and SNR floor. (tests/net/test_http.py drives `herald serve` with the `openai`
//! client and curl.)

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engine::EngineSettings;
use service::http::{HttpServer, HttpSettings};
use service::{Aliases, Front, FrontSettings, OutputSettings, Reading, Seeding, Slot, Speaker, SpeakerSettings, Stop, Voice};

/// The tiny bundle: from HERALD_TEST_BUNDLES (scripts/test exports it), else exported once
/// into the target's temporary folder.
fn bundle() -> PathBuf {
    if let Some(d) = std::env::var_os("HERALD_TEST_BUNDLES").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("tiny-0.6b");
    }
    // the tests of this file run in parallel: one exports, the others wait
    static EXPORT: Mutex<()> = Mutex::new(());
    let _one = EXPORT.lock().unwrap_or_else(|p| p.into_inner());
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("service-bundle");
    if !out.join("bundle.toml").is_file() {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let st = Command::new(repo.join("tools/export/export"))
            .args(["export", "--tiny", "tiny-0.6b", "--seed", "7", "--quiet", "--out"])
            .arg(&out)
            .status()
            .unwrap();
        assert!(st.success());
    }
    out
}

struct Served {
    server: Option<HttpServer>,
    slot: Slot,
    stop: Stop,
}

impl Served {
    fn addr(&self) -> SocketAddr {
        self.server.as_ref().unwrap().local_addr()
    }

    fn front(&self) -> &Front {
        self.slot.get().unwrap()
    }
}

fn serve(queue_length: usize) -> Served {
    serve_with(queue_length, Duration::from_secs(5))
}

fn serve_with(queue_length: usize, request_timeout: Duration) -> Served {
    let stop = Stop::new();
    let voice = Voice {
        language: "auto".into(),
        speaker: None,
        mode: Default::default(),
        seeding: Seeding::fixed(5),
        text: Default::default(),
        speed: 1.0,
    };
    let settings = SpeakerSettings {
        voice,
        amplifier: None,
        output: OutputSettings::default(),
        reading: Reading::default(),
        start: Default::default(),
    };
    let engine = EngineSettings { kv_capacity: 1024, ..EngineSettings::default() };
    let speaker = Speaker::prepare(settings, stop.clone()).unwrap().load(&bundle(), &engine).unwrap();
    // `[voices.aliases]`: kitchen = "vivian", Hall = "default"; and the built-in ones
    let (voices, _) = service::front::catalog(&speaker.engine().bundle().manifest);
    let user: std::collections::BTreeMap<String, String> =
        [("kitchen", "vivian"), ("Hall", "default")].map(|(a, v)| (a.to_owned(), v.to_owned())).into();
    let aliases = Aliases::new(&voices, &user).unwrap();
    let front = Front::start(speaker, &FrontSettings { queue_length, max_text_chars: 4096, aliases }).unwrap();
    let slot = Slot::new();
    slot.fill(front).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let settings = HttpSettings { max_connections: 16, request_timeout, idle_timeout: Duration::from_secs(10), api_key: None };
    let server = HttpServer::start(listener, slot.clone(), settings).unwrap();
    Served { server: Some(server), slot, stop }
}

/// An answer: status, headers (lower-case names), body, and when the first body byte and the
/// end arrived (from the request).
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    first_byte: Option<Duration>,
    total: Duration,
    /// The body ended with the closing chunk (a chunked answer that was not cut).
    complete: bool,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

fn post(addr: SocketAddr, path: &str, json: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(s, "POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{json}", json.len())
        .unwrap();
    s
}

/// Read an answer off `s` (sent at `t0`): the head, then a chunked or sized body.
fn read_answer(s: TcpStream, t0: Instant) -> Answer {
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let (n, v) = l.split_once(':').unwrap();
        headers.push((n.trim().to_ascii_lowercase(), v.trim().to_owned()));
    }
    let mut body = Vec::new();
    let mut first_byte = None;
    let mut complete = false;
    let chunked = headers.iter().any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"));
    if chunked {
        loop {
            line.clear();
            if r.read_line(&mut line).unwrap_or(0) == 0 {
                break;
            }
            let Ok(size) = usize::from_str_radix(line.trim(), 16) else { break };
            if size == 0 {
                complete = true;
                break;
            }
            first_byte.get_or_insert_with(|| t0.elapsed());
            let mut chunk = vec![0; size + 2];
            if r.read_exact(&mut chunk).is_err() {
                break;
            }
            body.extend_from_slice(&chunk[..size]);
        }
    } else {
        let n: usize = headers.iter().find(|(n, _)| n == "content-length").map_or(0, |(_, v)| v.parse().unwrap());
        body.resize(n, 0);
        r.read_exact(&mut body).unwrap();
        complete = true;
    }
    Answer { status, headers, body, first_byte, total: t0.elapsed(), complete }
}

fn speech(addr: SocketAddr, json: &str) -> Answer {
    let t0 = Instant::now();
    read_answer(post(addr, "/v1/audio/speech", json), t0)
}

/// A `Write` into shared memory, for the speaker's own raw sink.
#[derive(Clone, Default)]
struct Shared(Arc<Mutex<Vec<u8>>>);

impl Write for Shared {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

const TEXT: &str = "Hello there. This is herald speaking. A third sentence makes it longer.";

#[test]
fn speech_streams_the_raw_sinks_samples_as_they_are_made() {
    let s = serve(2);
    // the same job straight into a raw sink
    let direct = Shared::default();
    let request = s.front().request(TEXT, None, None).unwrap();
    let sink = s.front().raw_sink(direct.clone(), "memory");
    s.front().submit(request, sink, None, |_| {}).unwrap().wait().unwrap();
    let direct = direct.0.lock().unwrap().clone();
    assert!(direct.len() > 48_000, "{} bytes", direct.len());

    let pcm = speech(s.addr(), &format!(r#"{{"model":"tts-1","input":"{TEXT}","voice":"default","response_format":"pcm"}}"#));
    assert_eq!(pcm.status, 200, "{}", pcm.text());
    assert_eq!(pcm.header("content-type"), Some("audio/pcm"));
    assert_eq!(pcm.header("transfer-encoding"), Some("chunked"));
    assert!(pcm.complete);
    assert!(pcm.body == direct, "pcm: {} bytes, the raw sink's: {}", pcm.body.len(), direct.len());
    // the first audio goes out long before the last
    let first = pcm.first_byte.unwrap();
    eprintln!("pcm: first byte after {first:?}, all {} bytes after {:?}", pcm.body.len(), pcm.total);
    assert!(first * 3 < pcm.total, "first byte {first:?} of {:?}", pcm.total);

    // WAV: a streaming header and the same samples
    let wav = speech(s.addr(), &format!(r#"{{"input":"{TEXT}","response_format":"wav"}}"#));
    assert_eq!((wav.status, wav.header("content-type")), (200, Some("audio/wav")));
    assert_eq!(&wav.body[..4], b"RIFF");
    assert_eq!(u32::from_le_bytes(wav.body[24..28].try_into().unwrap()), 24_000);
    assert!(wav.body[44..] == direct[..]);

    // OpenAI's voices that are neither speakers nor aliases (alloy's sohee is not in the tiny
    // bundle) are the configured voice; so is an alias of `default`
    let hall = speech(s.addr(), &format!(r#"{{"input":"{TEXT}","voice":"hall","response_format":"pcm"}}"#));
    assert!(hall.status == 200 && hall.body == direct, "{}", hall.text());
    let alloy = speech(s.addr(), &format!(r#"{{"model":"tts-1","input":"{TEXT}","voice":"alloy","response_format":"pcm"}}"#));
    assert_eq!(alloy.status, 200, "{}", alloy.text());
    assert!(alloy.body == direct);
}

#[test]
fn a_client_that_goes_away_cancels_its_job_and_the_next_request_works() {
    let s = serve(2);
    let long = "Many words that take a long while to say, again and again and again and again. ".repeat(3);
    // the whole long utterance, for the time it takes
    let full = speech(s.addr(), &format!(r#"{{"input":"{long}","response_format":"pcm"}}"#));
    assert_eq!(full.status, 200);
    // a client that reads the head and a little audio, then hangs up
    let t0 = Instant::now();
    let mut c = post(s.addr(), "/v1/audio/speech", &format!(r#"{{"input":"{long}","response_format":"pcm"}}"#));
    let mut some = [0u8; 4096];
    c.read_exact(&mut some).unwrap();
    assert!(some.starts_with(b"HTTP/1.1 200 OK"));
    drop(c);
    // the next request is answered soon: the abandoned job did not run to its end
    let next = speech(s.addr(), r#"{"input":"Short.","response_format":"pcm"}"#);
    assert_eq!(next.status, 200, "{}", next.text());
    assert!(next.complete && !next.body.is_empty());
    eprintln!("a long utterance takes {:?}; hang up, then a short one: {:?}", full.total, t0.elapsed());
    assert!(t0.elapsed() < full.total, "{:?} (a full long one: {:?})", t0.elapsed(), full.total);
}

#[test]
fn a_full_queue_answers_busy_and_nothing_interleaves() {
    let s = serve(1);
    let addr = s.addr();
    let json = format!(r#"{{"input":"{TEXT}","response_format":"pcm"}}"#);
    // the first job is running (its head and some audio are on the wire) before the others
    // arrive: the queue's one place then takes one of them and the rest are busy. (Sent all at
    // once, the six can all arrive before the worker takes the first off the queue, and then
    // only one is admitted.)
    let t0 = Instant::now();
    let first = post(addr, "/v1/audio/speech", &json);
    let mut seen = vec![0u8; 1 << 16];
    loop {
        let n = first.peek(&mut seen).unwrap();
        let head = seen[..n].windows(4).position(|w| w == b"\r\n\r\n");
        if head.is_some_and(|h| n > h + 4 + 64) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "no audio from the first request");
        std::thread::sleep(Duration::from_millis(5));
    }
    let (first, others): (Answer, Vec<Answer>) = std::thread::scope(|scope| {
        let first = scope.spawn(move || read_answer(first, t0));
        let clients: Vec<_> = (0..5).map(|_| scope.spawn(|| speech(addr, &json))).collect();
        let others = clients.into_iter().map(|c| c.join().unwrap()).collect();
        (first.join().unwrap(), others)
    });
    assert_eq!(first.status, 200, "{}", first.text());
    let ok: Vec<&Answer> = std::iter::once(&first).chain(others.iter().filter(|a| a.status == 200)).collect();
    let busy: Vec<&Answer> = others.iter().filter(|a| a.status == 503).collect();
    assert_eq!(ok.len() + busy.len(), 6, "{:?}", others.iter().map(|a| a.status).collect::<Vec<_>>());
    assert!(!busy.is_empty() && ok.len() >= 2, "ok {}, busy {}", ok.len(), busy.len());
    for b in &busy {
        assert_eq!(b.header("retry-after"), Some("1"));
        assert!(b.text().contains(r#""code":"busy""#), "{}", b.text());
    }
    // one seed, one text: every answer is the same audio, whole
    for a in &ok {
        assert!(a.complete && a.body == ok[0].body);
    }
}

#[test]
fn the_stop_ends_a_stream_cleanly_and_the_server_shuts_down() {
    let mut s = serve(2);
    let long = "Many words that take a long while to say, again and again and again and again. ".repeat(3);
    let t0 = Instant::now();
    let c = post(s.addr(), "/v1/audio/speech", &format!(r#"{{"input":"{long}","response_format":"pcm"}}"#));
    let stop = s.stop.clone();
    let stopper = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        stop.stop();
    });
    let a = read_answer(c, t0);
    stopper.join().unwrap();
    assert_eq!(a.status, 200);
    assert!(a.complete, "the stream was ended with its closing chunk");
    assert!(!a.body.is_empty() && a.body.len().is_multiple_of(2));
    // a request after the stop is refused (or finds the server closed)
    if let Ok(mut c) = TcpStream::connect(s.addr()) {
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = c.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
        let mut answer = String::new();
        let _ = c.read_to_string(&mut answer);
        assert!(answer.is_empty() || answer.contains("stopping"), "{answer}");
    }
    let t = Instant::now();
    s.server.take().unwrap().shutdown(Duration::from_secs(2));
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}

#[test]
fn bad_requests_name_their_problem_and_the_server_goes_on() {
    let s = serve(2);
    let cases = [
        (r#"{"input":"Hi.","voice":"nobody"}"#, "voice"),
        (r#"{"input":"Hi.","language":"klingon"}"#, "language"),
        (r#"{"input":"   "}"#, "input"),
        (r#"{"input":"Hi.","speed":0.1}"#, "speed"),
    ];
    for (json, param) in cases {
        let a = speech(s.addr(), json);
        assert_eq!(a.status, 400, "{json}: {}", a.text());
        assert!(a.text().contains(&format!(r#""param":"{param}""#)), "{json}: {}", a.text());
    }
    let long = "a".repeat(4097);
    let a = speech(s.addr(), &format!(r#"{{"input":"{long}"}}"#));
    assert_eq!(a.status, 400);
    assert!(a.text().contains("the limit is 4096 characters"), "{}", a.text());
    let t0 = Instant::now();
    let mut c = TcpStream::connect(s.addr()).unwrap();
    c.write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let models = read_answer(c, t0);
    assert_eq!(models.status, 200);
    let v: serde_json::Value = serde_json::from_slice(&models.body).unwrap();
    assert_eq!(v["data"][0]["id"], s.front().model());
    let ok = speech(s.addr(), r#"{"input":"Fine.","response_format":"pcm"}"#);
    assert_eq!(ok.status, 200);
}

/// `GET path` on `addr`: the answer.
fn get(addr: SocketAddr, path: &str) -> Answer {
    let t0 = Instant::now();
    let mut c = TcpStream::connect(addr).unwrap();
    write!(c, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    read_answer(c, t0)
}

#[test]
fn an_alias_speaks_as_its_speaker_and_is_listed_and_unknown_voices_name_the_aliases() {
    let s = serve(2);
    let pcm = |voice: &str| {
        let a = speech(s.addr(), &format!(r#"{{"input":"Good evening.","voice":"{voice}","response_format":"pcm"}}"#));
        assert_eq!(a.status, 200, "{voice}: {}", a.text());
        assert!(a.complete && a.body.len() > 4800, "{voice}: {} bytes", a.body.len());
        a.body
    };
    // the configuration's alias, in any case, and a built-in one: sample for sample the same as
    // their speakers (one seed), and not the configured voice's
    let vivian = pcm("vivian");
    assert!(pcm("kitchen") == vivian && pcm("KITCHEN") == vivian, "kitchen is vivian");
    assert!(pcm("Nova") == vivian, "the built-in nova is vivian");
    assert!(pcm("default") != vivian, "the configured voice (no speaker) differs from vivian");

    let listed = get(s.addr(), "/v1/audio/voices");
    assert_eq!((listed.status, listed.header("content-type")), (200, Some("application/json")), "{}", listed.text());
    let v: serde_json::Value = serde_json::from_slice(&listed.body).unwrap();
    let voices = v["voices"].as_array().unwrap();
    let ids: Vec<&str> = voices.iter().map(|v| v["id"].as_str().unwrap()).collect();
    // the tiny bundle's speakers, then the aliases by name: the built-in ones whose speakers it
    // has (alloy's sohee, fable's aiden and onyx's uncle_fu it has not)
    assert_eq!(ids, ["dylan", "eric", "ryan", "serena", "vivian", "echo", "Hall", "kitchen", "nova", "shimmer"]);
    let by_id = |id: &str| voices.iter().find(|v| v["id"] == id).unwrap();
    assert_eq!(by_id("ryan")["alias_of"], serde_json::Value::Null);
    assert_eq!((by_id("kitchen")["alias_of"].as_str(), by_id("kitchen")["name"].as_str()), (Some("vivian"), Some("kitchen (vivian)")));
    assert_eq!(by_id("echo")["alias_of"], "ryan");
    assert_eq!(by_id("shimmer")["alias_of"], "serena");
    assert_eq!(by_id("Hall")["alias_of"], "default");
    assert_eq!(by_id("kitchen")["languages"], by_id("vivian")["languages"]);
    assert_eq!(by_id("dylan")["languages"], serde_json::json!(["beijing_dialect"]));

    // an unknown voice: 400 naming `voice`, the name and what is allowed, aliases included
    let a = speech(s.addr(), r#"{"input":"Hi.","voice":"kitchn"}"#);
    assert_eq!(a.status, 400, "{}", a.text());
    let e: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
    assert_eq!((e["error"]["param"].as_str(), e["error"]["type"].as_str()), (Some("voice"), Some("invalid_request_error")));
    let message = e["error"]["message"].as_str().unwrap();
    for want in ["\"kitchn\"", "default, dylan, eric, ryan, serena, vivian", "kitchen (vivian)", "echo (ryan)", "Hall (default)"] {
        assert!(message.contains(want), "{want} not in: {message}");
    }
    assert_eq!(pcm("kitchen"), vivian, "the server goes on");
}

/// Read what `s` gives until EOF, an error or `limit` bytes: (bytes, how it ended).
fn drain(s: &mut TcpStream, limit: usize) -> (Vec<u8>, String) {
    let mut got = Vec::new();
    let mut buf = vec![0u8; 65536];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return (got, "EOF".into()),
            Ok(n) => {
                got.extend_from_slice(&buf[..n]);
                if got.len() >= limit {
                    return (got, "limit".into());
                }
            }
            Err(e) => return (got, e.kind().to_string()),
        }
    }
}

#[test]
fn a_client_that_takes_no_audio_has_its_job_cancelled_and_its_connection_closed() {
    let timeout = Duration::from_secs(1);
    let s = serve_with(2, timeout);
    // about 80 s of audio, which takes the engine far longer than the bound below
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(10);
    let t0 = Instant::now();
    let mut stalled = post(s.addr(), "/v1/audio/speech", &format!(r#"{{"input":"{long}","response_format":"pcm"}}"#));
    std::thread::sleep(Duration::from_millis(200));
    // the next request waits for the speaker: it is served once the stalled job is cancelled
    let next = speech(s.addr(), r#"{"input":"Short.","response_format":"pcm"}"#);
    let served = t0.elapsed();
    assert_eq!(next.status, 200, "{}", next.text());
    assert!(next.complete);
    // the stalled client's connection was reset: it finds a little audio, never the end
    stalled.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let (got, ended) = drain(&mut stalled, 16 << 20);
    eprintln!(
        "a client that takes nothing: the next request served after {served:?}; it could read {} bytes, then {ended}",
        got.len()
    );
    assert!(got.starts_with(b"HTTP/1.1 200 OK"));
    assert!(!got.ends_with(b"\r\n0\r\n\r\n"), "the response was cut");
    assert!(got.len() < 1 << 20, "{} bytes waited for the client", got.len());
    assert!(ended == "EOF" || ended == "connection reset", "the connection was left open: {ended}");
    // the kernel's buffers fill within about a second of audio being made, then the timeout
    assert!(served < timeout + Duration::from_secs(8), "{served:?}");
}

#[test]
fn a_client_that_shuts_down_its_sending_side_gets_all_its_audio() {
    let s = serve(2);
    let json = format!(r#"{{"input":"{TEXT}","response_format":"pcm"}}"#);
    let whole = speech(s.addr(), &json);
    assert_eq!(whole.status, 200);
    // at once, and while its job waits in the queue behind another
    let long = "Many words that take a long while to say, again and again and again and again. ".repeat(3);
    let first = post(s.addr(), "/v1/audio/speech", &format!(r#"{{"input":"{long}","response_format":"pcm"}}"#));
    let reader = std::thread::spawn(move || read_answer(first, Instant::now()));
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    let c = post(s.addr(), "/v1/audio/speech", &json);
    c.shutdown(std::net::Shutdown::Write).unwrap();
    let a = read_answer(c, t0);
    assert_eq!(a.status, 200, "{}", a.text());
    assert!(a.complete && a.body == whole.body, "{} bytes of {}", a.body.len(), whole.body.len());
    assert!(reader.join().unwrap().complete);
    let c = post(s.addr(), "/v1/audio/speech", &json);
    c.shutdown(std::net::Shutdown::Write).unwrap();
    let a = read_answer(c, Instant::now());
    assert!(a.complete && a.body == whole.body);
}

#[test]
fn a_client_that_hangs_up_while_its_job_waits_has_it_cancelled_before_it_starts() {
    let s = serve(2);
    let long = "Many words that take a long while to say, again and again and again and again. ".repeat(3);
    let json = format!(r#"{{"input":"{long}","response_format":"pcm"}}"#);
    let t0 = Instant::now();
    let first = post(s.addr(), "/v1/audio/speech", &json);
    let reader = std::thread::spawn(move || {
        let a = read_answer(first, t0);
        (a, t0.elapsed())
    });
    std::thread::sleep(Duration::from_millis(200));
    // queued behind the first, then gone (its FIN, nothing unread)
    let gone = post(s.addr(), "/v1/audio/speech", &json);
    std::thread::sleep(Duration::from_millis(200));
    drop(gone);
    std::thread::sleep(Duration::from_millis(100));
    let next = speech(s.addr(), r#"{"input":"Short.","response_format":"pcm"}"#);
    let next_done = t0.elapsed();
    let (first, first_done) = reader.join().unwrap();
    assert!(first.complete && next.complete);
    eprintln!("the first job took {first_done:?}; the one after the abandoned one ended at {next_done:?}");
    // had the abandoned job run, the next one would have waited about as long again
    assert!(next_done < first_done + first_done / 2, "{next_done:?} vs {first_done:?}");
}

/// ffmpeg's decode of `bytes` to S16LE mono samples at 24 kHz (no resampling: herald's rate),
/// or `None` when there is no ffmpeg (scripts/prereqs installs Debian's).
fn ffmpeg_decode(bytes: &[u8], name: &str) -> Option<Vec<i16>> {
    if Command::new("ffmpeg").arg("-version").output().is_err() {
        return None;
    }
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("formats-{}-{name}", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    let o = Command::new("ffmpeg")
        .args(["-nostdin", "-v", "error", "-i"])
        .arg(&path)
        .args(["-f", "s16le", "-acodec", "pcm_s16le", "-ac", "1", "-ar", "24000", "-"])
        .output()
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(o.status.success(), "ffmpeg on {name}: {}", String::from_utf8_lossy(&o.stderr));
    Some(o.stdout.chunks_exact(2).map(|b| i16::from_le_bytes([b[0], b[1]])).collect())
}

/// The SNR, dB, of `decoded[delay..]` against `pcm` over `pcm`'s length (the decoded tail
/// beyond it, padding, is not compared).
fn snr_db(pcm: &[i16], decoded: &[i16], delay: usize) -> f64 {
    let (mut signal, mut noise) = (0.0f64, 0.0f64);
    for (i, &p) in pcm.iter().enumerate() {
        let d = decoded.get(delay + i).copied().unwrap_or(0);
        signal += f64::from(p).powi(2);
        noise += (f64::from(p) - f64::from(d)).powi(2);
    }
    10.0 * (signal / noise.max(1e-9)).log10()
}

/// MPEG-2 Layer III's frame, samples (24 kHz).
const MP3_FRAME: usize = 576;
/// LAME's encoder delay plus the MPEG decoder's (576 + 529 samples): without a LAME tag (a
/// stream cannot have one) ffmpeg keeps it as leading samples.
const MP3_DELAY: usize = 1105;
/// The mp3 SNR floor, dB. 64 kbit/s mono MP3 is a perceptual codec: it keeps what is heard,
/// not the waveform, so a waveform SNR of speech lands around 10–20 dB, and the tiny bundle's
/// random-weight "speech" is close to noise, which a perceptual coder approximates worst (12.3 dB
/// measured on it with seed and text of this test). 8 dB
/// means the decoded audio is the request's audio, in time (a wrong alignment or other audio
/// gives about 0 dB or less), not that it is transparent.
const MP3_SNR_FLOOR_DB: f64 = 8.0;

/// The opus SNR floor, dB, of the audio without its mean ([`snr_ac_db`]): libopus's encoder
/// removes DC (a 3 Hz high-pass on its input in the `AUDIO` application), and the tiny bundle's
/// random-weight audio carries a DC offset of about a quarter of full scale, inaudible but most
/// of its energy. Like mp3's ([`MP3_SNR_FLOOR_DB`]) a perceptual codec on near-noise: 8.6 dB
/// measured with the seed and text of this test (3.1 dB with the DC counted); other audio of the
/// same power gives about −3 dB, silence 0 dB. The floor says the audio is the request's, in
/// time, not that it is transparent.
const OPUS_SNR_FLOOR_DB: f64 = 5.0;

/// The SNR, dB, of `decoded` against `pcm` over `pcm`'s length, each without its mean over that
/// length (the DC a codec may remove).
fn snr_ac_db(pcm: &[i16], decoded: &[i16]) -> f64 {
    let n = pcm.len();
    let mean = |x: &[i16]| x.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64;
    let (mp, md) = (mean(pcm), mean(&decoded[..n]));
    let (mut signal, mut noise) = (0.0f64, 0.0f64);
    for (&p, &d) in pcm.iter().zip(decoded) {
        let (p, d) = (f64::from(p) - mp, f64::from(d) - md);
        signal += p * p;
        noise += (p - d) * (p - d);
    }
    10.0 * (signal / noise.max(1e-9)).log10()
}

#[test]
fn every_format_decodes_with_ffmpeg_to_the_pcm_answers_samples() {
    let s = serve(2);
    let ask = |format: Option<&str>| {
        let json = match format {
            Some(f) => format!(r#"{{"model":"tts-1","input":"{TEXT}","voice":"default","response_format":"{f}"}}"#),
            None => format!(r#"{{"model":"tts-1","input":"{TEXT}","voice":"default"}}"#),
        };
        let a = speech(s.addr(), &json);
        assert_eq!(a.status, 200, "{format:?}: {}", a.text());
        assert!(a.complete);
        a
    };
    let pcm = ask(Some("pcm"));
    let pcm: Vec<i16> = pcm.body.chunks_exact(2).map(|b| i16::from_le_bytes([b[0], b[1]])).collect();
    assert!(pcm.len() > 24_000, "{} samples", pcm.len());

    // no response_format means mp3, as OpenAI's API does
    let mp3 = ask(None);
    assert_eq!(mp3.header("content-type"), Some("audio/mpeg"));
    // the first bytes go out long before the last, as with pcm
    let first = mp3.first_byte.unwrap();
    assert!(first * 3 < mp3.total, "first byte {first:?} of {:?}", mp3.total);
    let flac = ask(Some("flac"));
    assert_eq!(flac.header("content-type"), Some("audio/flac"));
    let opus = ask(Some("opus"));
    assert_eq!(opus.header("content-type"), Some("audio/ogg"));
    let first = opus.first_byte.unwrap();
    assert!(first * 3 < opus.total, "first byte {first:?} of {:?}", opus.total);
    let wav = ask(Some("wav"));

    let Some(decoded) = ffmpeg_decode(&flac.body, "a.flac") else {
        eprintln!("SKIPPED: no ffmpeg on PATH (scripts/prereqs installs it): the formats were not decoded");
        return;
    };
    // flac is lossless: every sample, no more, no fewer
    assert_eq!(decoded.len(), pcm.len());
    assert!(decoded == pcm, "flac decodes to other samples");
    let decoded = ffmpeg_decode(&wav.body, "a.wav").unwrap();
    assert!(decoded == pcm, "wav: {} samples decoded of {}", decoded.len(), pcm.len());

    // mp3: whole frames; the audio after the codec's delay, padded to a frame at the end
    let decoded = ffmpeg_decode(&mp3.body, "a.mp3").unwrap();
    assert_eq!(decoded.len() % MP3_FRAME, 0, "{} samples", decoded.len());
    let frames = (pcm.len() + MP3_DELAY).div_ceil(MP3_FRAME);
    assert!(
        (frames..=frames + 1).contains(&(decoded.len() / MP3_FRAME)),
        "{} samples decoded for {} (+ {MP3_DELAY} delay)",
        decoded.len(),
        pcm.len()
    );
    // the delay is the one LAME documents: no other alignment matches better
    let best = (0..3 * MP3_FRAME).max_by(|&a, &b| snr_db(&pcm, &decoded, a).total_cmp(&snr_db(&pcm, &decoded, b))).unwrap();
    let snr = snr_db(&pcm, &decoded, MP3_DELAY);
    eprintln!(
        "mp3: {} bytes, {} samples decoded for {}, best delay {best}, SNR {snr:.1} dB",
        mp3.body.len(),
        decoded.len(),
        pcm.len()
    );
    assert_eq!(best, MP3_DELAY);
    assert!(snr > MP3_SNR_FLOOR_DB, "mp3 SNR {snr:.1} dB");

    // opus: the pre-skip and the last page's end trim give back exactly the pcm's length, in
    // time (ffmpeg decodes at 48 kHz and resamples to 24 kHz)
    let decoded = ffmpeg_decode(&opus.body, "a.opus").unwrap();
    assert_eq!(decoded.len(), pcm.len());
    // in time: the samples one earlier or later match worse
    let shifted = |lag: usize| snr_ac_db(&pcm[..pcm.len() - lag], &decoded[lag..]);
    let late = |lag: usize| snr_ac_db(&pcm[lag..], &decoded[..decoded.len() - lag]);
    let snr = snr_ac_db(&pcm, &decoded);
    eprintln!(
        "opus: {} bytes, {} samples decoded for {}, SNR without DC {snr:.1} dB (one sample off: {:.1}, {:.1} dB)",
        opus.body.len(),
        decoded.len(),
        pcm.len(),
        shifted(1),
        late(1)
    );
    assert!(snr > shifted(1) && snr > late(1));
    assert!(snr > OPUS_SNR_FLOOR_DB, "opus SNR {snr:.1} dB");
}

#[test]
fn speed_stretches_the_audio_to_its_length_and_one_leaves_it_alone() {
    let s = serve(2);
    let ask = |speed: &str| speech(s.addr(), &format!(r#"{{"input":"{TEXT}","response_format":"pcm"{speed}}}"#));
    let plain = ask("");
    assert_eq!(plain.status, 200, "{}", plain.text());
    let one = ask(r#","speed":1.0"#);
    assert!(one.body == plain.body, "speed 1.0 changed the audio");
    let n = plain.body.len() / 2;
    for (given, speed) in [("2", 2.0f64), ("0.5", 0.5), ("1.25", 1.25)] {
        let r = ask(&format!(r#","speed":{given}"#));
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(r.complete);
        assert_eq!(r.body.len() / 2, (n as f64 / speed).round() as usize, "speed {given}: {n} samples at 1.0");
    }
    let bad = ask(r#","speed":5"#);
    assert_eq!(bad.status, 400);
    assert!(
        bad.text().contains("speed 5 is out of range; allowed: 0.25 to 4.0") && bad.text().contains(r#""param":"speed""#),
        "{}",
        bad.text()
    );
}
