//! What the `herald` binary tests share: the tiny bundle, scratch folders, and running herald
//! with a clean environment (no HERALD_*, ALSA, RUST_LOG or systemd variables of the caller,
//! an empty config file instead of /etc/herald/herald.toml).

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The binary under test.
pub const HERALD: &str = env!("CARGO_BIN_EXE_herald");

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The tiny bundle: from HERALD_TEST_BUNDLES (scripts/test exports it), else exported once
/// into the target's temporary folder.
pub fn bundle() -> PathBuf {
    if let Some(d) = std::env::var_os("HERALD_TEST_BUNDLES").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("tiny-0.6b");
    }
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli-bundle");
    if !out.join("bundle.toml").is_file() {
        let st = Command::new(repo().join("tools/export/export"))
            .args(["export", "--tiny", "tiny-0.6b", "--seed", "7", "--quiet", "--out"])
            .arg(&out)
            .status()
            .unwrap();
        assert!(st.success());
    }
    out
}

/// A fresh, empty scratch folder `<area>/<name>` in the target's temporary folder.
pub fn tmp(area: &str, name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(area).join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// herald with the caller's HERALD_*, ALSA, RUST_LOG and systemd variables removed, an empty
/// config file and a calibration directory of its own (a `speak` on a board without a
/// calibration stores one: it must not land in the machine's /var/lib/herald, nor reach the
/// next test); `env` adds variables.
pub fn command(args: &[&str], env: &[(&str, &str)]) -> Command {
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let mut c = Command::new(HERALD);
    c.args(args);
    for k in ["RUST_LOG", "ALSA_CONFIG_PATH", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"] {
        c.env_remove(k);
    }
    for (k, _) in std::env::vars() {
        if k.starts_with("HERALD_") {
            c.env_remove(k);
        }
    }
    let empty = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("empty.toml");
    std::fs::write(&empty, "").unwrap();
    c.env("HERALD_CONFIG", &empty);
    let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let calibration = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("calibration-{}-{run}", std::process::id()));
    c.env("HERALD_RUNTIME_CALIBRATION_DIR", calibration);
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

/// Run herald to the end ([`command`]), feeding `stdin` if given; stdout and stderr captured.
pub fn run(args: &[&str], env: &[(&str, &str)], stdin: Option<&[u8]>) -> Output {
    let mut c = command(args, env);
    c.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() }).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    if let Some(input) = stdin {
        // herald may stop reading early (a text that is too long): a broken pipe here is fine
        let _ = child.stdin.take().unwrap().write_all(input);
    }
    child.wait_with_output().unwrap()
}

/// Standard error as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// herald exited with `code` and said why in exactly one `error:` line containing `needle`.
pub fn assert_one_error_line(o: &Output, code: i32, needle: &str) {
    let e = stderr(o);
    assert_eq!(o.status.code(), Some(code), "{e}");
    let lines: Vec<&str> = e.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "{e}");
    assert!(lines[0].contains(needle), "{e}");
}

/// Standard error of a running herald, line by line, as it comes.
pub struct StderrTail {
    rx: mpsc::Receiver<String>,
    /// Every line read so far.
    pub seen: Vec<String>,
}

impl StderrTail {
    /// Take `child`'s piped standard error and read it on a thread.
    pub fn new(child: &mut Child) -> Self {
        let err = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(err).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        StderrTail { rx, seen: Vec::new() }
    }

    /// The first line (from now on) containing `needle` and not `not`.
    pub fn wait_for(&mut self, needle: &str, not: &str, timeout: Duration) -> String {
        let end = Instant::now() + timeout;
        loop {
            match self.rx.recv_timeout(end.saturating_duration_since(Instant::now())) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(needle) && !line.contains(not) {
                        return line;
                    }
                }
                Err(_) => panic!("no stderr line with {needle:?} within {timeout:?}; got:\n{}", self.seen.join("\n")),
            }
        }
    }
}

/// (sample rate, channels, bits, PCM bytes) of a WAV; `streaming` accepts the 0xFFFFFFFF sizes.
pub fn parse_wav(b: &[u8]) -> (u32, u16, u16, Vec<u8>) {
    assert_eq!(&b[0..4], b"RIFF");
    assert_eq!(&b[8..12], b"WAVE");
    let mut p = 12;
    let (mut rate, mut ch, mut bits) = (0, 0, 0);
    loop {
        let id = &b[p..p + 4];
        let len = u32::from_le_bytes(b[p + 4..p + 8].try_into().unwrap()) as usize;
        if id == b"fmt " {
            ch = u16::from_le_bytes([b[p + 10], b[p + 11]]);
            rate = u32::from_le_bytes(b[p + 12..p + 16].try_into().unwrap());
            bits = u16::from_le_bytes([b[p + 22], b[p + 23]]);
        }
        if id == b"data" {
            let end = if len == u32::MAX as usize || p + 8 + len > b.len() { b.len() } else { p + 8 + len };
            return (rate, ch, bits, b[p + 8..end].to_vec());
        }
        p += 8 + len;
    }
}

/// Kills the process `pid` (SIGKILL) when dropped, so that a test that fails while a herald it
/// started is still running does not leave that herald behind. Harmless after the process
/// has exited and been waited for.
pub struct KillOnDrop(pub u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = Command::new("kill").args(["-KILL", &self.0.to_string()]).stderr(Stdio::null()).status();
    }
}

/// The address after `prefix` (`"HTTP on http://"`, `"Wyoming on tcp://"`) in `herald serve`'s
/// ready line.
pub fn ready_addr(ready: &str, prefix: &str) -> String {
    let addr = ready.split(prefix).nth(1).and_then(|r| r.split([' ', ',', ')']).next());
    addr.unwrap_or_else(|| panic!("no {prefix} in the ready line: {ready}")).to_owned()
}
