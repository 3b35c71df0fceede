//! Faults from the world, each with its documented outcome (docs/reliability.md): a full disk
//! under `herald speak --out` and `herald calibrate`, a bundle on a read-only filesystem, a
//! bundle file cut short under a running service, and `herald calibrate` killed at any point.
//! Nothing is ever left half-written.
//!
//! The full disk is a 64 KiB tmpfs and the read-only filesystem a read-only bind mount, both
//! made in a private user and mount namespace (`unshare -rm`, util-linux), so the tests need no
//! privileges beyond what unprivileged user namespaces give (root works too).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::{StderrTail, assert_one_error_line, bundle, parse_wav, stderr};

fn tmp(name: &str) -> PathBuf {
    common::tmp("faults", name)
}

/// `unshare -rm` works here, or the test fails saying what it needs (never a silent skip).
fn require_namespaces() {
    let ok = Command::new("unshare").args(["-rm", "true"]).status().is_ok_and(|s| s.success());
    assert!(
        ok,
        "this test mounts a small tmpfs or a read-only bind mount in a private user and mount namespace: \
         `unshare -rm true` (util-linux) must work (unprivileged user namespaces enabled, or root)"
    );
}

/// The herald command `c` ([`common::command`]: its program, arguments and environment) run
/// through `wrapper` (a program and its first arguments, ending where herald's command line
/// goes: `sh -c '… exec "$@"' sh`).
fn wrapped(c: &Command, wrapper: &[&std::ffi::OsStr]) -> Command {
    let mut w = Command::new(wrapper[0]);
    w.args(&wrapper[1..]).arg(c.get_program()).args(c.get_args());
    for (k, v) in c.get_envs() {
        match v {
            Some(v) => w.env(k, v),
            None => w.env_remove(k),
        };
    }
    w.stdin(Stdio::null());
    w
}

/// What [`in_namespace`] saw in a folder after herald ran: `name size` per entry, sorted.
type Listing = Vec<String>;

/// Run the herald command `c` ([`common::command`]: its arguments and environment) inside a
/// new user and mount namespace, after the shell commands `setup` (which mount what the test
/// needs; a failing one fails the test). Returns herald's output and the entries of `list`
/// after it ran, read inside the namespace (its mounts vanish with it).
fn in_namespace(c: &Command, setup: &str, list: &Path) -> (Output, Listing) {
    const MARK: &str = "--- herald test listing ---";
    let script = format!(
        "set -e\n{setup}\nset +e\n\"$@\"\nrc=$?\necho '{MARK}'\nfind '{}' -mindepth 1 -maxdepth 1 -printf '%f %s\\n' | sort\nexit $rc\n",
        list.display()
    );
    let o = wrapped(c, &["unshare".as_ref(), "-rm".as_ref(), "sh".as_ref(), "-c".as_ref(), script.as_ref(), "sh".as_ref()])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let Some((_, listing)) = out.split_once(MARK) else {
        panic!("the namespace's setup failed:\n{setup}\n{}", stderr(&o));
    };
    let listing = listing.lines().filter(|l| !l.is_empty()).map(String::from).collect();
    (o, listing)
}

#[test]
fn a_full_disk_fails_the_write_names_the_file_and_leaves_the_old_one() {
    require_namespaces();
    let b = bundle();
    let bs = b.to_str().unwrap();
    let d = tmp("full-disk");
    let m = d.join("mnt");
    std::fs::create_dir_all(&m).unwrap();
    let ms = m.display();
    // a 64 KiB tmpfs holding an old out.wav and chart.svg (3 bytes each), then filled up
    let setup = format!(
        "mount -t tmpfs -o size=64k tmpfs '{ms}'\nprintf old > '{ms}/out.wav'\nprintf old > '{ms}/chart.svg'\n\
         dd if=/dev/zero of='{ms}/filler' bs=4k 2>/dev/null || true"
    );
    let before = |listing: &Listing| {
        let names: Vec<&str> = listing.iter().map(|l| l.split(' ').next().unwrap()).collect();
        assert_eq!(names, ["chart.svg", "filler", "out.wav"], "nothing new, nothing partial: {listing:?}");
        assert!(listing.contains(&"out.wav 3".to_string()) && listing.contains(&"chart.svg 3".to_string()), "{listing:?}");
    };

    let out = m.join("out.wav");
    let c = common::command(&["speak", "A full disk.", "--bundle", bs, "--out", out.to_str().unwrap()], &[]);
    let (o, listing) = in_namespace(&c, &setup, &m);
    eprintln!("speak: {}", stderr(&o).lines().last().unwrap_or(""));
    assert_one_error_line(&o, 2, &format!("WAV output {}: No space left on device", out.display()));
    before(&listing);

    let chart = m.join("chart.svg");
    let c = common::command(
        &["calibrate", "--bundle", bs, "--utterances", "2", "--dir", m.to_str().unwrap(), "--chart", chart.to_str().unwrap()],
        &[],
    );
    let (o, listing) = in_namespace(&c, &setup, &m);
    eprintln!("calibrate: {}", stderr(&o).lines().last().unwrap_or(""));
    assert_one_error_line(&o, 2, "No space left on device");
    assert!(stderr(&o).lines().last().unwrap().contains(&ms.to_string()), "names the file: {}", stderr(&o));
    before(&listing);
}

#[test]
fn a_bundle_on_a_read_only_filesystem_is_used_as_it_is() {
    require_namespaces();
    let b = bundle();
    let d = tmp("read-only");
    let ro = d.join("ro");
    std::fs::create_dir_all(&ro).unwrap();
    let (bs, ros) = (b.display(), ro.display());
    // the bundle bind-mounted read-only; the graph cache pointed into it (unwritable)
    let setup = format!(
        "mount --bind '{bs}' '{ros}'\nmount -o remount,bind,ro '{ros}'\nif touch '{ros}/x' 2>/dev/null; then echo 'not read-only' >&2; exit 1; fi"
    );
    let env = [("HERALD_RUNTIME_GRAPH_CACHE_DIR", ro.join("graph-cache")), ("RUST_LOG", "warn".into())];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.to_str().unwrap())).collect();
    let want = d.join("want.wav");
    let o =
        common::run(&["speak", "Read only.", "--bundle", &bs.to_string(), "--seed", "3", "--out", want.to_str().unwrap()], &[], None);
    assert!(o.status.success(), "{}", stderr(&o));

    let got = d.join("got.wav");
    let c =
        common::command(&["speak", "Read only.", "--bundle", &ros.to_string(), "--seed", "3", "--out", got.to_str().unwrap()], &env);
    let (o, listing) = in_namespace(&c, &setup, &ro);
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(e.contains("graph cache") && e.contains("not written"), "the unwritable cache costs one warning: {e}");
    assert_eq!(std::fs::read(&got).unwrap(), std::fs::read(&want).unwrap(), "the same audio as from the writable bundle");
    assert!(!listing.iter().any(|l| l.starts_with("graph-cache")), "{listing:?}");

    // writing into it: exit 2 naming the target (not a temporary file), nothing left
    let inside = ro.join("out.wav");
    let c = common::command(&["speak", "Read only.", "--bundle", &bs.to_string(), "--out", inside.to_str().unwrap()], &[]);
    let (o, after) = in_namespace(&c, &setup, &ro);
    assert_one_error_line(&o, 2, &format!("audio output {}: create failed: Read-only file system", inside.display()));
    assert!(!stderr(&o).contains(".tmp"), "{}", stderr(&o));
    assert_eq!(after, listing, "nothing written");

    let c = common::command(&["info", "--verify", "--bundle", &ros.to_string()], &[]);
    let (o, _) = in_namespace(&c, &setup, &ro);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("verified"), "{}", String::from_utf8_lossy(&o.stdout));
}

#[test]
fn a_bundle_file_cut_short_under_a_running_service_ends_it_with_exit_4_naming_the_file() {
    let d = tmp("cut-short");
    let b = d.join("bundle");
    std::fs::create_dir_all(&b).unwrap();
    for f in std::fs::read_dir(bundle()).unwrap() {
        let f = f.unwrap().path();
        if f.is_file() {
            std::fs::copy(&f, b.join(f.file_name().unwrap())).unwrap();
        }
    }
    let fifo = d.join("say");
    let out = d.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let mut child = common::command(
        &["serve", "--bundle", b.to_str().unwrap(), "--fifo", fifo.to_str().unwrap(), "--out-dir", out.to_str().unwrap()],
        &[("HERALD_SERVE_WYOMING", "tcp://127.0.0.1:0"), ("HERALD_SERVE_HTTP", "127.0.0.1:0")],
    )
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let _kill = common::KillOnDrop(child.id());
    let mut err = StderrTail::new(&mut child);
    err.wait_for("ready; reading lines", "\0", Duration::from_secs(300));
    // the tables (memory-mapped) cut short in place, as a careless update would
    let tables = b.join("tables.safetensors");
    std::fs::OpenOptions::new().write(true).open(&tables).unwrap().set_len(1000).unwrap();
    std::fs::OpenOptions::new().write(true).open(&fifo).unwrap().write_all(b"Still there?\n").unwrap();
    let end = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > end {
            let _ = child.kill();
            panic!("herald serve did not end within 60 s of reading the cut-short file:\n{}", err.seen.join("\n"));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let last = err.wait_for(&format!("error: {}: the file was cut short", tables.display()), "\0", Duration::from_secs(5));
    assert_eq!(status.code(), Some(4), "{}", err.seen.join("\n"));
    assert!(last.contains("rename it into place"), "{last}");
    assert!(!out.join("000001.wav").exists(), "no WAV for the line that was cut off");
}

#[test]
fn calibrate_killed_at_any_point_leaves_no_partial_file() {
    let b = bundle();
    let d = tmp("calibrate-killed");
    let cal = d.join("cal");
    std::fs::create_dir_all(&cal).unwrap();
    let chart = d.join("chart.svg");
    let args = [
        "calibrate",
        "--bundle",
        b.to_str().unwrap(),
        "--utterances",
        "2",
        "--dir",
        cal.to_str().unwrap(),
        "--chart",
        chart.to_str().unwrap(),
    ];
    // complete: the stored schedule parses and has its measurements; the chart is a whole SVG
    let check = |when: &str| {
        let mut stored = Vec::new();
        for e in std::fs::read_dir(&cal).unwrap() {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            if name.starts_with('.') && name.ends_with(".tmp") {
                continue; // a killed writer's temporary file: never the target, removed next time
            }
            let text = std::fs::read_to_string(cal.join(&name)).unwrap();
            let v: serde_json::Value =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{when}: {name} is not whole JSON ({e}):\n{text}"));
            assert!(v["schedule"]["ramp"].is_array() && v["measured"]["ms_per_frame"].is_number(), "{when}: {name}: {text}");
            stored.push(name);
        }
        assert!(stored.len() <= 1, "{when}: {stored:?}");
        if let Ok(svg) = std::fs::read_to_string(&chart) {
            assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{when}: a torn chart");
        }
        stored.len()
    };
    let t = Instant::now();
    let o = common::run(&args, &[], None);
    assert!(o.status.success(), "{}", stderr(&o));
    let whole = t.elapsed();
    assert_eq!(check("after a whole run"), 1);
    // SIGKILL at points spread over a whole run's length, from the start to the write
    for i in 0..8u32 {
        let mut child = common::command(&args, &[]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        std::thread::sleep(whole * (2 * i + 1) / 16);
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(check(&format!("killed after {:?}", whole * (2 * i + 1) / 16)), 1);
    }
    let o = common::run(&args, &[], None);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(check("after the next whole run"), 1);
    let left: Vec<String> = std::fs::read_dir(&cal).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(left.len(), 1, "the next run removed the killed runs' temporary files: {left:?}");
    let temps = std::fs::read_dir(&d).unwrap().filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".tmp")).count();
    assert_eq!(temps, 0, "and the chart's");
}

/// A fresh memory cgroup below this process's own, with `limit` bytes: cgroup v1's memory
/// controller (`memory.limit_in_bytes`), or a v2 group whose parent already delegates the
/// memory controller (`memory.max`). `None` when neither can be made here (not root, no
/// delegation).
fn memory_cgroup(limit: u64) -> Option<PathBuf> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let name = format!("herald-test-{}", std::process::id());
    for line in own.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else { continue };
        let (base, limit_file) = if controllers.split(',').any(|c| c == "memory") {
            (Path::new("/sys/fs/cgroup/memory"), "memory.limit_in_bytes")
        } else if controllers.is_empty() {
            (Path::new("/sys/fs/cgroup"), "memory.max")
        } else {
            continue;
        };
        let mut parent = base.join(path.trim_start_matches('/'));
        if !parent.is_dir() {
            parent = base.to_path_buf(); // a container that sees its group as the mount's root
        }
        let dir = parent.join(&name);
        let _ = std::fs::remove_dir(&dir);
        if std::fs::create_dir(&dir).is_err() {
            continue;
        }
        if std::fs::write(dir.join(limit_file), limit.to_string()).is_ok() {
            return Some(dir);
        }
        let _ = std::fs::remove_dir(&dir);
    }
    None
}

#[test]
fn under_a_cgroup_memory_limit_below_the_need_herald_refuses_at_start_with_the_numbers() {
    let b = bundle();
    let d = tmp("cgroup");
    // the tiny bundle needs 13 MiB of weights + 512 activations + 2048 headroom on an x86 CPU
    // (herald probe): 1 GiB is far too little, and far more than herald uses before it refuses
    let Some(group) = memory_cgroup(1 << 30) else {
        eprintln!(
            "SKIPPED: no memory cgroup can be made here (needs root with cgroup v1's memory controller, or a v2 group \
             that delegates memory); the limit arithmetic is tested on recorded cgroup files in board/tests/probe.rs"
        );
        return;
    };
    let out = d.join("out.wav");
    // herald started inside the group
    let in_group = |args: &[&str]| {
        let join = ["sh".as_ref(), "-c".as_ref(), "echo $$ > \"$0/cgroup.procs\" && exec \"$@\"".as_ref(), group.as_os_str()];
        wrapped(&common::command(args, &[]), &join).output().unwrap()
    };
    let o = in_group(&["speak", "Not enough memory.", "--bundle", b.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    let probe = in_group(&["probe"]);
    let _ = std::fs::remove_dir(&group);
    eprintln!("{}", stderr(&o).lines().last().unwrap_or(""));
    assert_one_error_line(&o, 4, "does not fit in memory");
    let line = stderr(&o).lines().find(|l| l.starts_with("error:")).unwrap().to_string();
    assert!(line.contains("(the cgroup's memory limit - its usage)") && line.contains("2048 MiB headroom"), "{line}");
    // what it counted: at most the 1024 MiB limit
    let available: i64 = line.split(" MiB available").next().unwrap().rsplit(' ').next().unwrap().parse().unwrap();
    assert!((1..=1024).contains(&available), "{line}");
    assert!(!out.exists(), "refused before any output");
    let p = String::from_utf8_lossy(&probe.stdout);
    assert!(p.lines().next().unwrap_or("").contains("cgroup_room="), "herald probe shows the limit: {p}");
}

fn argv(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn sigint_and_sigterm_cut_speak_at_a_frame_boundary_and_leave_a_valid_wav() {
    let b = bundle();
    let d = tmp("signals");
    let text = "many words ".repeat(40);
    let args = |out: &Path| -> Vec<String> {
        ["speak", &text, "--bundle", b.to_str().unwrap(), "--seed", "5", "--out", out.to_str().unwrap()].map(String::from).to_vec()
    };
    let whole = d.join("whole.wav");
    let o = common::run(&argv(&args(&whole)), &[], None);
    assert!(o.status.success(), "{}", stderr(&o));
    let (_, _, _, full) = parse_wav(&std::fs::read(&whole).unwrap());
    for signal in ["INT", "TERM"] {
        let out = d.join(format!("{signal}.wav"));
        let child = common::command(&argv(&args(&out)), &[]).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        // once 20 frames are in the (temporary) WAV file
        let end = Instant::now() + Duration::from_secs(120);
        let written = || {
            std::fs::read_dir(&d).unwrap().flatten().any(|e| {
                e.file_name().to_string_lossy().starts_with(&format!(".{signal}.wav."))
                    && e.metadata().is_ok_and(|m| m.len() > 44 + 20 * 3840)
            })
        };
        while !written() {
            assert!(Instant::now() < end, "no audio within 120 s");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(Command::new("kill").args([&format!("-{signal}"), &child.id().to_string()]).status().unwrap().success());
        let o = child.wait_with_output().unwrap();
        assert_one_error_line(&o, 130, "interrupted; the audio so far was finished cleanly");
        // a valid file: the RIFF and data sizes match its length
        let wav = std::fs::read(&out).unwrap();
        assert_eq!(u32::from_le_bytes(wav[4..8].try_into().unwrap()) as usize, wav.len() - 8, "SIG{signal}: RIFF size");
        let (rate, _, _, pcm) = parse_wav(&wav);
        let at = wav.windows(4).position(|w| w == b"data").unwrap();
        assert_eq!(u32::from_le_bytes(wav[at + 4..at + 8].try_into().unwrap()) as usize, pcm.len(), "SIG{signal}: data size");
        assert_eq!(rate, 24000);
        // cut at a frame boundary (1920 samples), shorter than the whole, and the same audio up
        // to the fade-out (audio.fade_ms = 5: the last 120 samples)
        let samples = pcm.len() / 2;
        eprintln!("SIG{signal}: {} frames of {}", samples / 1920, full.len() / 2 / 1920);
        assert!(samples % 1920 == 0 && samples >= 20 * 1920 && pcm.len() < full.len(), "SIG{signal}: {samples} samples");
        let keep = pcm.len() - 120 * 2;
        assert_eq!(pcm[..keep], full[..keep], "SIG{signal}: the audio before the fade-out differs from the whole run's");
    }
}
