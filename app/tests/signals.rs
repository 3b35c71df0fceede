//! What SIGINT, SIGTERM and SIGHUP do to the `herald` binary (docs/reliability.md "Signals"):
//! `herald serve` reloads its configuration on SIGHUP and goes on (the next line's audio is the
//! reloaded volume's; a key that needs a restart is named; the network limits, the API key and
//! the voice aliases apply to the next request), and stops on SIGTERM naming it;
//! `herald speak` waiting for its text on a pipe stops on the first SIGINT or SIGTERM; a second
//! signal during `--out` says what it left behind.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::{KillOnDrop, StderrTail, bundle, parse_wav};

fn kill(child: &Child, signal: &str) {
    let st = Command::new("kill").args([&format!("-{signal}"), &child.id().to_string()]).status().unwrap();
    assert!(st.success(), "kill -{signal}");
}

fn wait_for_file(p: &Path, timeout: Duration) {
    let end = Instant::now() + timeout;
    while !p.is_file() {
        assert!(Instant::now() < end, "{} not written within {timeout:?}", p.display());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The exit status within `timeout`, and the rest of standard error.
fn wait_exit(child: &mut Child, timeout: Duration) -> std::process::ExitStatus {
    let end = Instant::now() + timeout;
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        assert!(Instant::now() < end, "herald did not exit within {timeout:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn samples(wav: &Path) -> Vec<i16> {
    let (_, _, _, pcm) = parse_wav(&std::fs::read(wav).unwrap());
    pcm.chunks_exact(2).map(|b| i16::from_le_bytes([b[0], b[1]])).collect()
}

#[test]
fn sighup_reloads_serve_and_sigterm_stops_it_naming_the_signal() {
    let b = bundle();
    let d = common::tmp("signals", "reload");
    let cfg = d.join("herald.toml");
    std::fs::write(&cfg, "[audio]\nvolume = 1.0\n").unwrap();
    let fifo = d.join("say");
    let out = d.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let mut child = common::command(
        &[
            "--config",
            cfg.to_str().unwrap(),
            "serve",
            "--bundle",
            b.to_str().unwrap(),
            "--fifo",
            fifo.to_str().unwrap(),
            "--out-dir",
            out.to_str().unwrap(),
        ],
        &[("HERALD_SYNTHESIS_SEED", "11"), ("HERALD_SERVE_WYOMING", "off"), ("HERALD_SERVE_HTTP", "off")],
    )
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let _guard = KillOnDrop(child.id());
    let mut err = StderrTail::new(&mut child);
    err.wait_for("ready; reading lines from", "\0", Duration::from_secs(300));
    let say = |text: &str| {
        let mut w = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
        writeln!(w, "{text}").unwrap();
    };
    say("Every line is spoken.");
    wait_for_file(&out.join("000001.wav"), Duration::from_secs(120));

    // half the volume, and a key that needs a restart
    std::fs::write(&cfg, "[audio]\nvolume = 0.5\n[serve]\nzeroconf = \"off\"\n[amplifier]\nlead_ms = 80\n").unwrap();
    kill(&child, "HUP");
    let reloaded = err.wait_for("SIGHUP: reloaded audio.volume = 0.5", "\0", Duration::from_secs(30));
    assert!(reloaded.contains("amplifier.lead_ms = 80"), "{reloaded}");
    err.wait_for("serve.zeroconf changed, which needs a restart", "\0", Duration::from_secs(30));
    assert!(child.try_wait().unwrap().is_none(), "SIGHUP stopped herald serve");
    say("Every line is spoken.");
    wait_for_file(&out.join("000002.wav"), Duration::from_secs(120));
    let (loud, quiet) = (samples(&out.join("000001.wav")), samples(&out.join("000002.wav")));
    assert_eq!(loud.len(), quiet.len(), "the same text and seed: the same length");
    assert!(loud.iter().any(|&s| s.abs() > 100), "the first line is not silent");
    for (i, (&l, &q)) in loud.iter().zip(&quiet).enumerate() {
        // gain 0.5 on the same float samples, each rounded to 16 bits once
        assert!((f64::from(l) / 2.0 - f64::from(q)).abs() <= 1.0, "sample {i}: {l} at volume 1.0, {q} at 0.5");
    }

    // punctuation only: nothing to say, logged and skipped, no file
    say("?!...,;:");
    err.wait_for("line 3: text has nothing to say", "\0", Duration::from_secs(30));
    // a configuration with an error changes nothing, and herald goes on
    std::fs::write(&cfg, "[audio]\nvolume = 3.5\n").unwrap();
    kill(&child, "HUP");
    err.wait_for("nothing was changed", "\0", Duration::from_secs(30));

    kill(&child, "TERM");
    let st = wait_exit(&mut child, Duration::from_secs(30));
    err.wait_for("stopping on SIGTERM", "\0", Duration::from_secs(5));
    assert_eq!(st.code(), Some(0), "{}", err.seen.join("\n"));
    assert!(!out.join("000003.wav").exists());
}

/// The status line of `GET path` on `addr`, with `key` as the bearer token when given.
fn get_status(addr: &str, path: &str, key: Option<&str>) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let auth = key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n").unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    answer.lines().next().unwrap_or_default().to_owned()
}

/// What `GET /v1/audio/voices` on `addr` (with `key` as the bearer token) says the voice `id`
/// stands for: `Some(null)` for a speaker, `None` when it is not listed.
fn alias_of(addr: &str, key: &str, id: &str) -> Option<serde_json::Value> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "GET /v1/audio/voices HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n\r\n").unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200 "), "{answer}");
    let voices: serde_json::Value = serde_json::from_str(body).unwrap();
    voices["voices"].as_array().unwrap().iter().find(|v| v["id"] == id).map(|v| v["alias_of"].clone())
}

/// Whether the server closes `s` (end of stream or a reset) within `timeout`.
fn closed_within(s: &mut TcpStream, timeout: Duration) -> bool {
    s.set_read_timeout(Some(timeout)).unwrap();
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => return false,
            Err(_) => return true,
        }
    }
}

#[test]
fn sighup_reloads_the_network_limits_timeouts_and_api_key() {
    let b = bundle();
    let d = common::tmp("signals", "reload-net");
    let cfg = d.join("herald.toml");
    std::fs::write(
        &cfg,
        "[serve]\nmax_connections = 4\nidle_timeout_s = 120\nqueue_length = 4\n[voices.aliases]\nkitchen = \"vivian\"\n",
    )
    .unwrap();
    let out = d.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let mut child = common::command(
        &[
            "--config",
            cfg.to_str().unwrap(),
            "serve",
            "--bundle",
            b.to_str().unwrap(),
            "--fifo",
            "off",
            "--out-dir",
            out.to_str().unwrap(),
        ],
        &[("HERALD_SERVE_WYOMING", "tcp://127.0.0.1:0"), ("HERALD_SERVE_HTTP", "127.0.0.1:0")],
    )
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let _guard = KillOnDrop(child.id());
    let mut err = StderrTail::new(&mut child);
    let ready = err.wait_for("ready;", "\0", Duration::from_secs(300));
    let (http, wyoming) = (common::ready_addr(&ready, "HTTP on http://"), common::ready_addr(&ready, "Wyoming on tcp://"));
    assert!(get_status(&http, "/v1/models", None).contains(" 200 "), "no key needed yet");
    // three idle connections: within max_connections = 4 and idle_timeout_s = 120
    let mut idle: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(&http).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(300));

    assert_eq!(alias_of(&http, "", "kitchen"), Some(serde_json::json!("vivian")));
    assert_eq!(alias_of(&http, "", "hall"), None);

    std::fs::write(
        &cfg,
        "[serve]\nmax_connections = 1\nidle_timeout_s = 2\nqueue_length = 2\napi_key = \"s3cret-token\"\n\
         [voices.aliases]\nkitchen = \"ryan\"\nhall = \"default\"\n",
    )
    .unwrap();
    kill(&child, "HUP");
    let line = err.wait_for("SIGHUP: reloaded", "\0", Duration::from_secs(30));
    for k in [
        "serve.max_connections = 1",
        "serve.idle_timeout_s = 2",
        "serve.queue_length = 2",
        "serve.api_key (set)",
        r#"voices.aliases = { hall = "default", kitchen = "ryan" }"#,
    ] {
        assert!(line.contains(k), "{k} not in: {line}");
    }
    assert!(!line.contains("s3cret"), "the key was logged: {line}");
    assert!(!line.contains("needs a restart"), "{line}");
    // the lowered limit closes two of the three at once, the shorter idle timeout the last:
    // under the old settings none of them would close for two minutes
    for (i, s) in idle.iter_mut().enumerate() {
        assert!(closed_within(s, Duration::from_secs(10)), "idle HTTP connection {i} still open");
    }
    // the key is required from now on (but not by the health check)
    assert!(get_status(&http, "/v1/models", None).contains(" 401 "));
    assert!(get_status(&http, "/v1/models", Some("s3cret-token")).contains(" 200 "));
    assert!(get_status(&http, "/healthz", None).contains(" 200 "));
    // the aliases are the new ones
    assert_eq!(alias_of(&http, "s3cret-token", "kitchen"), Some(serde_json::json!("ryan")));
    assert_eq!(alias_of(&http, "s3cret-token", "hall"), Some(serde_json::json!("default")));
    assert_eq!(alias_of(&http, "s3cret-token", "ryan"), Some(serde_json::Value::Null), "a speaker");
    // a Wyoming connection opened now has the new idle timeout
    let mut w = TcpStream::connect(&wyoming).unwrap();
    w.write_all(b"{\"type\": \"describe\"}\n").unwrap();
    assert!(closed_within(&mut w, Duration::from_secs(10)), "an idle Wyoming connection outlived idle_timeout_s = 2");

    // an alias the bundle cannot serve changes nothing, naming the key
    std::fs::write(
        &cfg,
        "[serve]\nmax_connections = 1\nidle_timeout_s = 2\nqueue_length = 2\napi_key = \"s3cret-token\"\n\
         [voices.aliases]\nkitchen = \"vivan\"\n",
    )
    .unwrap();
    kill(&child, "HUP");
    let refused = err.wait_for("nothing was changed", "\0", Duration::from_secs(30));
    assert!(refused.contains("voices.aliases.kitchen = \"vivan\""), "{refused}");
    assert_eq!(alias_of(&http, "s3cret-token", "kitchen"), Some(serde_json::json!("ryan")), "the old aliases hold");

    // a key that cannot be a bearer token changes nothing
    std::fs::write(&cfg, "[serve]\nmax_connections = 8\napi_key = \" spaced \"\n").unwrap();
    kill(&child, "HUP");
    let refused = err.wait_for("nothing was changed", "\0", Duration::from_secs(30));
    assert!(refused.contains("serve.api_key"), "{refused}");
    assert!(get_status(&http, "/v1/models", Some("s3cret-token")).contains(" 200 "), "the old key still holds");

    kill(&child, "TERM");
    let st = wait_exit(&mut child, Duration::from_secs(30));
    assert_eq!(st.code(), Some(0), "{}", err.seen.join("\n"));
}

#[test]
fn speak_waiting_on_standard_input_stops_on_the_first_signal() {
    let b = bundle();
    for signal in ["INT", "TERM"] {
        let mut child = common::command(&["speak", "--bundle", b.to_str().unwrap(), "--out", "/dev/null"], &[])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let _guard = KillOnDrop(child.id());
        // the pipe stays open: herald waits for the text
        let _stdin = child.stdin.take().unwrap();
        std::thread::sleep(Duration::from_millis(500));
        kill(&child, signal);
        let st = wait_exit(&mut child, Duration::from_secs(10));
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
        assert_eq!(st.code(), Some(130), "SIG{signal}: {err}");
        assert!(err.contains("nothing was spoken"), "SIG{signal}: {err}");
        assert_eq!(err.lines().filter(|l| l.starts_with("error:")).count(), 1, "{err}");
    }
}

#[test]
fn a_second_signal_during_out_says_what_it_left() {
    let b = bundle();
    let d = common::tmp("signals", "second");
    let wav = d.join("long.wav");
    let text = "A long text keeps herald busy for a while. ".repeat(20);
    let mut child = common::command(
        &["speak", &text, "--bundle", b.to_str().unwrap(), "--seed", "3", "--out", wav.to_str().unwrap()],
        &[("RUST_LOG", "info")],
    )
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let _guard = KillOnDrop(child.id());
    let mut err = StderrTail::new(&mut child);
    err.wait_for("ready in", "\0", Duration::from_secs(300));
    // two different signals, so that neither merges into the other while pending
    kill(&child, "INT");
    kill(&child, "TERM");
    let st = wait_exit(&mut child, Duration::from_secs(30));
    let line = err.wait_for("again: stopped at once", "\0", Duration::from_secs(5));
    assert_eq!(st.code(), Some(130), "{}", err.seen.join("\n"));
    assert!(line.starts_with("error: SIGTERM again") && line.contains(wav.to_str().unwrap()), "{line}");
    if line.contains("not written; its unfinished temporary file was removed") {
        assert!(!wav.exists(), "{line}");
    } else {
        assert!(line.contains("its audio was finished and is kept"), "{line}");
        assert!(!samples(&wav).is_empty());
    }
    let left: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name()).filter(|n| n != "long.wav").collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}
