//! `herald speak --backend qnn` end to end on the HTP simulator (docs/backend.md), the choice
//! of backend, and what `info` and `probe` say about it.
//!
//! Needs `tiny-0.6b-qnn` under `HERALD_TEST_BUNDLES` and the simulator's libraries
//! (`HERALD_TEST_QNN_LIBS`, else the project venv's `onnxruntime_qnn` folder); where they are
//! missing each test prints `SKIPPED` with the reason, and `HERALD_TEST_QNN=required` makes that
//! a failure.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;

use common::{assert_one_error_line, parse_wav, repo, run as herald, stderr, tmp};

fn libs() -> Result<PathBuf, String> {
    if let Some(d) = std::env::var_os("HERALD_TEST_QNN_LIBS") {
        return Ok(PathBuf::from(d));
    }
    let lib = repo().join(".venv/lib");
    std::fs::read_dir(&lib)
        .ok()
        .and_then(|rd| rd.flatten().map(|e| e.path().join("site-packages/onnxruntime_qnn")).find(|p| p.join("libQnnHtp.so").is_file()))
        .ok_or_else(|| {
            format!("no onnxruntime_qnn libraries under {} (tools/export/setup.sh installs them on Linux x86_64)", lib.display())
        })
}

fn qnn_bundle() -> Result<PathBuf, String> {
    let root = std::env::var_os("HERALD_TEST_BUNDLES").map(PathBuf::from).unwrap_or_else(|| repo().join("build/bundles"));
    let dir = root.join("tiny-0.6b-qnn");
    if dir.join("bundle.toml").is_file() { Ok(dir) } else { Err(format!("no bundle {} (scripts/test exports it)", dir.display())) }
}

fn setup() -> Option<(String, String)> {
    match (libs(), qnn_bundle()) {
        (Ok(l), Ok(b)) => Some((l.to_str().unwrap().to_owned(), b.to_str().unwrap().to_owned())),
        (Err(e), _) | (_, Err(e)) => {
            assert_ne!(std::env::var("HERALD_TEST_QNN").as_deref(), Ok("required"), "HERALD_TEST_QNN=required but {e}");
            eprintln!("SKIPPED: {e}");
            None
        }
    }
}

const TEXT: &str = "Every output agrees.";

#[test]
fn speak_with_the_qnn_backend_writes_whole_frames() {
    let Some((libs, b)) = setup() else { return };
    let d = tmp("qnn", "speak");
    let env = [("HERALD_RUNTIME_QNN_LIB_DIR", libs.as_str()), ("HERALD_RUNTIME_QNN_ARCH", "v73")];
    let mut pcm = Vec::new();
    for backend in ["qnn", "tract"] {
        let wav = d.join(format!("{backend}.wav"));
        let o = herald(&["speak", TEXT, "--bundle", &b, "--greedy", "--backend", backend, "--out", wav.to_str().unwrap()], &env, None);
        let e = stderr(&o);
        assert!(o.status.success(), "{backend}: {e}");
        assert!(e.contains(&format!("backend {backend}")), "{backend}: the log does not say which backend runs: {e}");
        let (rate, ch, bits, data) = parse_wav(&std::fs::read(&wav).unwrap());
        assert_eq!((rate, ch, bits), (24000, 1, 16));
        assert_eq!(data.len() % (1920 * 2), 0, "{backend}: not whole frames of 1920 samples");
        // tiny models never emit eos: the text's frame cap (40 + 10 per text token) decides
        assert!(data.len() >= 40 * 1920 * 2, "{backend}: {} bytes", data.len());
        pcm.push(data);
    }
    assert_eq!(pcm[0].len(), pcm[1].len(), "qnn and tract spoke different numbers of frames");
    let frames = pcm[0].len() / (1920 * 2);
    let first = (0..frames).find(|&f| pcm[0][f * 3840..(f + 1) * 3840] != pcm[1][f * 3840..(f + 1) * 3840]);
    eprintln!("qnn v73 vs tract, greedy, {frames} frames: first frame whose audio differs: {first:?}");
}

#[test]
fn qnn_that_cannot_run_is_one_line_and_exit_4() {
    let Some((libs, b)) = setup() else { return };
    // a bundle without binaries
    let plain = common::bundle();
    let env = [("HERALD_RUNTIME_QNN_LIB_DIR", libs.as_str())];
    let o = herald(&["speak", "Hi.", "--bundle", plain.to_str().unwrap(), "--backend", "qnn", "--out", "/dev/null"], &env, None);
    assert_one_error_line(&o, 4, "no QNN context binaries");
    // no libraries where the configuration says
    let empty = tmp("qnn", "nolibs");
    let env = [("HERALD_RUNTIME_QNN_LIB_DIR", empty.to_str().unwrap()), ("HERALD_RUNTIME_QNN_ARCH", "v73")];
    let o = herald(&["speak", "Hi.", "--bundle", &b, "--backend", "qnn", "--out", "/dev/null"], &env, None);
    assert_one_error_line(&o, 4, "libQnnHtp.so");
    // an architecture the bundle lacks
    let env = [("HERALD_RUNTIME_QNN_LIB_DIR", libs.as_str()), ("HERALD_RUNTIME_QNN_ARCH", "v68")];
    let o = herald(&["speak", "Hi.", "--bundle", &b, "--backend", "qnn", "--out", "/dev/null"], &env, None);
    assert_one_error_line(&o, 4, "v68");
    // several architectures and none chosen
    let env = [("HERALD_RUNTIME_QNN_LIB_DIR", libs.as_str())];
    let o = herald(&["speak", "Hi.", "--bundle", &b, "--backend", "qnn", "--out", "/dev/null"], &env, None);
    assert_one_error_line(&o, 4, "runtime.qnn_arch");
    // a backend name herald does not know is bad input
    let o = herald(&["speak", "Hi.", "--bundle", &b, "--backend", "npu", "--out", "/dev/null"], &[], None);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}

#[test]
fn auto_stays_on_tract_off_a_snapdragon_board_and_says_why() {
    let Some((libs, b)) = setup() else { return };
    let d = tmp("qnn", "auto");
    let wav = d.join("auto.wav");
    let env = [("HERALD_RUNTIME_QNN_LIB_DIR", libs.as_str()), ("HERALD_RUNTIME_QNN_ARCH", "v73")];
    let o = herald(&["speak", "Hi.", "--bundle", &b, "--out", wav.to_str().unwrap()], &env, None);
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(e.contains("backend tract (runtime.backend = \"auto\" on a"), "{e}");
    // info lists the binaries; probe says which backend would run
    let o = herald(&["info", "--bundle", &b], &env, None);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{}", stderr(&o));
    for arch in ["v73", "v79"] {
        assert!(out.contains(&format!("qnn         {arch} fp16 context binaries: talker ")), "{out}");
    }
    let o = herald(&["probe", "--bundle", &b], &env, None);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.contains("backend     backend tract"), "{out}");
    let o = herald(
        &["probe", "--bundle", &b],
        &[("HERALD_RUNTIME_QNN_LIB_DIR", libs.as_str()), ("HERALD_RUNTIME_BACKEND", "qnn"), ("HERALD_RUNTIME_QNN_ARCH", "v79")],
        None,
    );
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(out.contains("backend     backend qnn") && out.contains("v79 binaries"), "{out}");
}
