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

/// Signal-to-noise ratio of `got` against `want`, both s16 little-endian PCM, in dB.
fn pcm_snr_db(want: &[u8], got: &[u8]) -> f64 {
    assert_eq!(want.len(), got.len());
    let (mut signal, mut noise) = (0f64, 0f64);
    for (w, g) in want.chunks_exact(2).zip(got.chunks_exact(2)) {
        let w = f64::from(i16::from_le_bytes([w[0], w[1]]));
        let g = f64::from(i16::from_le_bytes([g[0], g[1]]));
        signal += w * w;
        noise += (w - g) * (w - g);
    }
    assert!(signal > 0.0, "the reference is silent");
    10.0 * (signal / noise.max(1e-30)).log10()
}

#[test]
fn speak_with_the_vocoder_on_the_npu_writes_whole_frames() {
    let Some((libs, b)) = setup() else { return };
    let d = tmp("qnn", "npu-vocoder");
    // 3 frames (the simulator takes seconds per vocoder frame): chunks of 2 and 1 frames
    let frames = 3;
    let mut pcm = Vec::new();
    for place in ["npu", "cpu"] {
        let env = [
            ("HERALD_RUNTIME_QNN_LIB_DIR", libs.as_str()),
            ("HERALD_RUNTIME_QNN_ARCH", "v79"),
            ("HERALD_RUNTIME_QNN_VOCODER", place),
            ("HERALD_TEST_MAX_FRAMES", "3"),
        ];
        let wav = d.join(format!("{place}.wav"));
        let o = herald(&["speak", TEXT, "--bundle", &b, "--greedy", "--backend", "qnn", "--out", wav.to_str().unwrap()], &env, None);
        let e = stderr(&o);
        assert!(o.status.success(), "{place}: {e}");
        let says = if place == "npu" { "vocoder on the NPU (v79 vocoder binaries" } else { "vocoder on the CPU (tract)" };
        assert!(e.contains(says), "{place}: the log does not say where the vocoder runs: {e}");
        let (rate, ch, bits, data) = parse_wav(&std::fs::read(&wav).unwrap());
        assert_eq!((rate, ch, bits), (24000, 1, 16));
        assert_eq!(data.len(), frames * 1920 * 2, "{place}: not exactly {frames} frames of 1920 samples");
        pcm.push(data);
    }
    // the same codes (the talker and code predictor on the NPU both times): the audio differs
    // only by the vocoder's float16 compute
    let snr = pcm_snr_db(&pcm[1], &pcm[0]);
    eprintln!("herald speak, v79, {frames} frames: NPU vocoder against the CPU one: {snr:.1} dB");
    assert!(snr >= 30.0, "NPU vocoder audio SNR {snr:.1} dB < 30 against the CPU vocoder");
    // probe says where the vocoder would run
    let env = [
        ("HERALD_RUNTIME_QNN_LIB_DIR", libs.as_str()),
        ("HERALD_RUNTIME_BACKEND", "qnn"),
        ("HERALD_RUNTIME_QNN_ARCH", "v79"),
        ("HERALD_RUNTIME_QNN_VOCODER", "npu"),
    ];
    let o = herald(&["probe", "--bundle", &b], &env, None);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(out.contains("vocoder on the NPU (v79 vocoder binaries"), "{out}");
    // info lists the vocoder binaries
    let o = herald(&["info", "--bundle", &b], &env, None);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(out.contains("vocoder 1/2 frames per run"), "{out}");
}

#[test]
fn npu_vocoder_without_its_binaries_is_one_line_and_exit_4() {
    let Some((libs, b)) = setup() else { return };
    // the bundle's v73 binaries have no vocoder
    let env =
        [("HERALD_RUNTIME_QNN_LIB_DIR", libs.as_str()), ("HERALD_RUNTIME_QNN_ARCH", "v73"), ("HERALD_RUNTIME_QNN_VOCODER", "npu")];
    let o = herald(&["speak", "Hi.", "--bundle", &b, "--backend", "qnn", "--out", "/dev/null"], &env, None);
    assert_one_error_line(&o, 4, "no v73 vocoder context binaries");
    // the windowed vocoder cannot run on the NPU
    let env = [
        ("HERALD_RUNTIME_QNN_LIB_DIR", libs.as_str()),
        ("HERALD_RUNTIME_QNN_ARCH", "v79"),
        ("HERALD_RUNTIME_QNN_VOCODER", "npu"),
        ("HERALD_SYNTHESIS_VOCODER", "windowed"),
    ];
    let o = herald(&["speak", "Hi.", "--bundle", &b, "--backend", "qnn", "--out", "/dev/null"], &env, None);
    assert_one_error_line(&o, 4, "stateful");
    // an unknown place is bad input
    let env = [("HERALD_RUNTIME_QNN_VOCODER", "gpu")];
    let o = herald(&["speak", "Hi.", "--bundle", &b, "--backend", "qnn", "--out", "/dev/null"], &env, None);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}

#[test]
fn auto_falls_back_to_tract_when_the_qnn_load_fails() {
    let Some((libs, b)) = setup() else { return };
    // a copy of the bundle whose v73 talker binary is damaged: choose() only checks that the
    // binaries are listed, the load then fails describing it
    let d = tmp("qnn", "fallback");
    let copy = d.join("bundle");
    std::fs::create_dir_all(&copy).unwrap();
    for e in std::fs::read_dir(&b).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), copy.join(e.file_name())).unwrap();
    }
    let m = std::fs::read_to_string(copy.join("bundle.toml")).unwrap();
    let talker = m.lines().find(|l| l.starts_with("file = \"qnn_talker_v73_")).unwrap().split('"').nth(1).unwrap().to_owned();
    std::fs::write(copy.join(&talker), b"not a context binary").unwrap();
    let wav = d.join("auto.wav");
    // a Snapdragon board, as far as the probe is concerned (the CPUs are this machine's)
    let profile = d.join("profile.json");
    std::fs::write(
        &profile,
        r#"{"class":"snapdragon_npu","arch":"aarch64","n_logical":2,"n_physical":2,"ram_total_bytes":8589934592,"ram_available_bytes":8589934592,"clusters":[{"max_khz":2707200,"cpus":[0,1]}]}"#,
    )
    .unwrap();
    let env = [
        ("HERALD_RUNTIME_QNN_LIB_DIR", libs.as_str()),
        ("HERALD_RUNTIME_QNN_ARCH", "v73"),
        ("HERALD_HW_PROFILE", profile.to_str().unwrap()),
        ("HERALD_TEST_MAX_FRAMES", "2"),
    ];
    let o = herald(&["speak", "Hi.", "--bundle", copy.to_str().unwrap(), "--greedy", "--out", wav.to_str().unwrap()], &env, None);
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(e.contains("backend qnn (runtime.backend = \"auto\" on a snapdragon_npu board)"), "{e}");
    let line = e.lines().find(|l| l.contains("backend qnn failed to load, using tract instead")).unwrap_or_else(|| panic!("{e}"));
    assert!(line.contains(&talker), "the fallback line does not say why: {line}");
    let (_, _, _, data) = parse_wav(&std::fs::read(&wav).unwrap());
    assert_eq!(data.len(), 2 * 1920 * 2);
    // the same with runtime.backend = "qnn" stops with one line
    let o = herald(&["speak", "Hi.", "--bundle", copy.to_str().unwrap(), "--backend", "qnn", "--out", "/dev/null"], &env, None);
    assert_one_error_line(&o, 4, &talker);
}
