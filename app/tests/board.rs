//! Board awareness end to end: `herald probe` derives settings for every recorded board
//! snapshot (through HERALD_HW_PROFILE), a bundle that cannot fit is refused before anything is
//! written, `herald calibrate --chart` stores a schedule that `speak` then uses (and says so),
//! and a corrupt or foreign calibration file is ignored with one warning.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Output;

mod common;

use common::{bundle, repo};

fn tmp(name: &str) -> PathBuf {
    common::tmp("board", name)
}

fn herald(args: &[&str], env: &[(&str, &str)]) -> Output {
    common::run(args, env, None)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The JSON profile of a recorded board snapshot (board/tests/fixtures).
fn snapshot_profile(name: &str, dir: &Path) -> PathBuf {
    let p = board::probe::probe(&repo().join("board/tests/fixtures").join(name)).unwrap();
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, p.to_json()).unwrap();
    path
}

#[test]
fn probe_derives_settings_for_every_snapshot() {
    let d = tmp("probe");
    let b = bundle();
    // (snapshot, talker CPUs, vocoder CPUs) — the splits of board/tests/probe.rs
    let cases = [
        ("jetson-orin-nano", "[0, 1, 2, 3]", "[4, 5]", "jetson"),
        ("rpi5", "[0, 1, 2]", "[3]", "arm64_cpu"),
        ("rb3gen2", "[7, 4, 5]", "[6]", "snapdragon_npu"),
        ("rk3588", "[4, 5, 6]", "[7]", "arm64_cpu"),
        ("x86", "[0]", "[1]", "x86_cpu"),
    ];
    let mut prints = Vec::new();
    for (name, t, v, class) in cases {
        let profile = snapshot_profile(name, &d);
        let o = herald(&["probe", "--bundle", b.to_str().unwrap()], &[("HERALD_HW_PROFILE", profile.to_str().unwrap())]);
        assert!(o.status.success(), "{name}: {}", text(&o.stderr));
        let out = text(&o.stdout);
        assert!(out.contains(&format!("class={class}")), "{name}: {out}");
        assert!(out.contains(&format!("derived     talker CPUs {t}, vocoder CPUs {v}")), "{name}: {out}");
        assert!(out.contains("derived     memory budget") && out.contains("derived     KV capacity 4096 positions"), "{name}: {out}");
        assert!(out.contains("calibration none yet"), "{name}: {out}");
        let fp = out.lines().find_map(|l| l.strip_prefix("fingerprint ")).unwrap().trim().to_string();
        assert_eq!(fp.len(), 16, "{out}");
        prints.push(fp);
    }
    // five boards, five fingerprints
    prints.sort();
    prints.dedup();
    assert_eq!(prints.len(), 5);
    // the live board too
    let o = herald(&["probe", "--bundle", b.to_str().unwrap()], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(text(&o.stdout).contains("source=probe") && text(&o.stdout).contains("derived     dtype fp32"));
}

/// A calibration is measured in one vocoder arithmetic: `runtime.vocoder_precision` is part of
/// the fingerprint, so a board calibrated in float32 measures again when switched to fp16 (and
/// back), while the same settings always name the same file.
#[test]
fn the_vocoder_precision_is_part_of_the_fingerprint() {
    let d = tmp("precision");
    let b = bundle();
    let profile = snapshot_profile("rpi5", &d);
    let print = |precision: &str| {
        let o = herald(
            &["probe", "--bundle", b.to_str().unwrap()],
            &[("HERALD_HW_PROFILE", profile.to_str().unwrap()), ("HERALD_RUNTIME_VOCODER_PRECISION", precision)],
        );
        assert!(o.status.success(), "{precision}: {}", text(&o.stderr));
        let out = text(&o.stdout);
        out.lines().find_map(|l| l.strip_prefix("fingerprint ")).unwrap_or_else(|| panic!("{out}")).trim().to_string()
    };
    let fp32 = print("fp32");
    let fp16 = print("fp16");
    let auto = print("auto");
    assert_eq!(fp32.len(), 16);
    assert_ne!(fp32, fp16);
    assert_ne!(fp32, auto);
    assert_ne!(fp16, auto);
    assert_eq!(print("fp32"), fp32, "the same settings name the same calibration file");
}

#[test]
fn a_bundle_that_cannot_fit_is_refused_before_any_output() {
    let d = tmp("refuse");
    // 1 GiB board with 600 MB available: 572 MiB - weights - 512 MiB - 1 GiB headroom < 0
    let profile = d.join("small.json");
    std::fs::write(
        &profile,
        r#"{"class":"arm64_cpu","arch":"aarch64","n_logical":4,"ram_total_bytes":1073741824,"ram_available_bytes":600000000}"#,
    )
    .unwrap();
    let wav = d.join("out.wav");
    let o = herald(
        &["speak", "Hello.", "--bundle", bundle().to_str().unwrap(), "--out", wav.to_str().unwrap()],
        &[("HERALD_HW_PROFILE", profile.to_str().unwrap())],
    );
    assert_eq!(o.status.code(), Some(4), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(err.contains("does not fit in memory") && err.contains("572 MiB available") && err.contains("at least 256"), "{err}");
    assert!(!wav.exists());
    assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1, "only the profile is left");
}

#[test]
fn calibrate_stores_a_schedule_that_speak_uses() {
    let d = tmp("calibrate");
    let cal_dir = d.join("cal");
    let chart = d.join("timeline.svg");
    let b = bundle();
    let env = [("HERALD_RUNTIME_CALIBRATION_DIR", cal_dir.to_str().unwrap())];
    let o = herald(&["calibrate", "--bundle", b.to_str().unwrap(), "--utterances", "2", "--chart", chart.to_str().unwrap()], &env);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    assert!(out.contains("formula     ramp [") && out.contains("schedule    ramp [") && out.contains("stored      "), "{out}");
    // exactly one file, named by the fingerprint `probe` prints, no temporary left
    let files: Vec<PathBuf> = std::fs::read_dir(&cal_dir).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let probe = text(&herald(&["probe", "--bundle", b.to_str().unwrap()], &env).stdout);
    let fp = probe.lines().find_map(|l| l.strip_prefix("fingerprint ")).unwrap().trim().to_string();
    assert_eq!(files[0], cal_dir.join(format!("{fp}.json")));
    assert!(probe.contains(&format!("calibration {}", files[0].display())), "{probe}");
    // the stored schedule follows the formula from the stored measurements
    let cal: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&files[0]).unwrap()).unwrap();
    let ms = cal["measured"]["ms_per_frame"].as_f64().unwrap();
    let jitter = cal["measured"]["jitter_ms"].as_f64().unwrap();
    assert!(jitter >= 20.0);
    // the tiny bundle has a stream graph: the stateful vocoder's default ramp [2] sets steady
    let steady = 2u64;
    let lead = jitter + (ms - 80.0).max(0.0) * steady as f64;
    let first = ((lead / 80.0).ceil() as u64).clamp(1, steady);
    let list = |v: &serde_json::Value| -> Vec<u64> { v.as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect() };
    let formula = list(&cal["formula"]["ramp"]);
    assert_eq!(formula[0], first);
    // the ramp speak uses: the formula's, or one with a larger first chunk where the formula's
    // would stall on this board; doubling to the steady chunk either way
    let ramp = list(&cal["schedule"]["ramp"]);
    assert!(ramp[0] >= first, "{ramp:?} vs {formula:?}");
    for r in [&formula, &ramp] {
        assert_eq!(*r.last().unwrap(), steady);
        assert!(r.windows(2).all(|w| w[1] == (w[0] * 2).min(steady)), "{r:?}");
    }
    let margin = cal["formula"]["safety_margin_ms"].as_f64().unwrap();
    assert!((margin - (jitter + ms).clamp(20.0, 400.0)).abs() < 1e-9);
    // the chart is an SVG with both timelines
    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("default ramp [2]") && svg.contains("calibrated ramp"));

    // speak picks it up and says so
    let wav = d.join("a.wav");
    let speak = |wav: &Path| {
        herald(
            &["speak", "Calibrated.", "--bundle", b.to_str().unwrap(), "--seed", "3", "--out", wav.to_str().unwrap()],
            &[env[0], ("RUST_LOG", "info")],
        )
    };
    let o = speak(&wav);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let ramp_text = format!("{ramp:?}");
    assert!(
        text(&o.stderr).contains(&format!("using calibration {}: chunk ramp {ramp_text}", files[0].display())),
        "{}",
        text(&o.stderr)
    );
    // an explicit synthesis.ramp wins over the calibration
    let o = herald(
        &["speak", "Configured.", "--bundle", b.to_str().unwrap(), "--out", d.join("c.wav").to_str().unwrap()],
        &[env[0], ("RUST_LOG", "info"), ("HERALD_SYNTHESIS_RAMP", "3,25")],
    );
    assert!(o.status.success() && text(&o.stderr).contains("chunk ramp [3, 25] from synthesis.ramp"), "{}", text(&o.stderr));

    // foreign: a calibration written for another fingerprint, under this one's name
    let original = std::fs::read_to_string(&files[0]).unwrap();
    std::fs::write(&files[0], original.replace(&fp, "0000000000000000")).unwrap();
    let o = speak(&d.join("b.wav"));
    assert!(o.status.success(), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert_eq!(err.matches("ignoring calibration").count(), 1, "{err}");
    assert!(err.contains("written for fingerprint 0000000000000000") && err.contains("default chunk ramp [2]"), "{err}");
    // corrupt
    std::fs::write(&files[0], &original[..original.len() / 2]).unwrap();
    let o = speak(&d.join("b.wav"));
    assert!(o.status.success(), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert_eq!(err.matches("ignoring calibration").count(), 1, "{err}");
    assert!(err.contains("not a calibration file"), "{err}");
}

#[test]
fn calibrate_on_every_snapshot() {
    let d = tmp("calibrate-snapshots");
    let b = bundle();
    let cal = d.join("cal");
    for name in ["jetson-orin-nano", "rpi5", "rb3gen2", "rk3588", "x86"] {
        let profile = snapshot_profile(name, &d);
        let chart = d.join(format!("{name}.svg"));
        // What differs between boards is the profile (CPU sets, fingerprint), not the
        // measurement, which is of this machine: a short one (a small left context and ramp, so
        // the vocoder windows measured are 1 to 8 frames, not 1 to 97). The full-length
        // calibration is calibrate_stores_a_schedule_that_speak_uses.
        let o = herald(
            // and short utterances (--frames 30)
            &["calibrate", "--bundle", b.to_str().unwrap(), "--utterances", "1", "--frames", "30", "--chart", chart.to_str().unwrap()],
            &[
                ("HERALD_HW_PROFILE", profile.to_str().unwrap()),
                ("HERALD_RUNTIME_CALIBRATION_DIR", cal.to_str().unwrap()),
                ("HERALD_SYNTHESIS_LEFT_CONTEXT", "4"),
                ("HERALD_SYNTHESIS_RAMP", "2,4"),
            ],
        );
        assert!(o.status.success(), "{name}: {}", text(&o.stderr));
        assert!(chart.is_file(), "{name}");
    }
    // one file per board
    assert_eq!(std::fs::read_dir(&cal).unwrap().count(), 5);
}

#[test]
fn a_missing_amplifier_chip_stops_speak_at_start_up() {
    let d = tmp("amp");
    let o = herald(
        &["speak", "Hello.", "--bundle", bundle().to_str().unwrap()],
        &[("HERALD_AMPLIFIER_CHIP", "no-such-chip"), ("HERALD_AMPLIFIER_LINE", "17"), ("RUST_LOG", "info")],
    );
    assert_eq!(o.status.code(), Some(3), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(err.contains("no GPIO chip labelled 'no-such-chip'"), "{err}");
    // before the model was loaded
    assert!(!err.contains("ready in"), "{err}");
    // writing a file does not touch the amplifier
    let wav = d.join("a.wav");
    let o = herald(
        &["speak", "Hello.", "--bundle", bundle().to_str().unwrap(), "--out", wav.to_str().unwrap()],
        &[("HERALD_AMPLIFIER_CHIP", "no-such-chip")],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(wav.is_file());
}

#[test]
fn serve_opens_the_amplifier_line_at_start_up() {
    let d = tmp("serve-amp");
    let o = herald(
        &["serve", "--bundle", bundle().to_str().unwrap(), "--fifo", d.join("say").to_str().unwrap()],
        &[("HERALD_AMPLIFIER_CHIP", "no-such-chip"), ("RUST_LOG", "info")],
    );
    assert_eq!(o.status.code(), Some(3), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(err.contains("no GPIO chip labelled 'no-such-chip'") && !err.contains("ready"), "{err}");
    assert!(!d.join("say").exists());
}

#[test]
fn calibrate_checks_where_it_writes_before_measuring() {
    let d = tmp("calibrate-paths");
    let b = bundle();
    let file = d.join("a-file");
    std::fs::write(&file, "x").unwrap();
    let missing = d.join("missing/x.svg");
    let cal = d.join("cal");
    let cases: [(&[&str], &str); 4] = [
        (&["--dir", file.to_str().unwrap()], "not a directory"),
        (&["--chart", missing.to_str().unwrap()], "does not exist"),
        (&["--chart", "/dev/null"], "not a regular file"),
        (&["--frames", "29"], "29 is not in 30..=120"),
    ];
    for (extra, needle) in cases {
        let mut args = vec!["calibrate", "--bundle", b.to_str().unwrap()];
        args.extend_from_slice(extra);
        if !extra.contains(&"--dir") {
            args.extend_from_slice(&["--dir", cal.to_str().unwrap()]);
        }
        let o = herald(&args, &[("RUST_LOG", "info")]);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {}", text(&o.stderr));
        let err = text(&o.stderr);
        // refused before the model was loaded and measured
        assert!(err.contains(needle) && !err.contains("warming up"), "{extra:?}: {err}");
    }
    // /dev/null is still a device
    assert!(!std::fs::metadata("/dev/null").unwrap().is_file());
}

#[test]
fn speak_without_a_calibration_stores_one_and_another_herald_version_is_measured_again() {
    let d = tmp("auto-calibration");
    let cal_dir = d.join("cal");
    let b = bundle();
    let env = [("HERALD_RUNTIME_CALIBRATION_DIR", cal_dir.to_str().unwrap()), ("RUST_LOG", "info")];
    let speak = |name: &str| {
        let wav = d.join(name);
        herald(
            &["speak", "Measure me while you speak.", "--bundle", b.to_str().unwrap(), "--seed", "3", "--out", wav.to_str().unwrap()],
            &env,
        )
    };
    // no calibration: the utterance measures one and stores it
    let o = speak("a.wav");
    let err = text(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("the first utterances measure one"), "{err}");
    let files: Vec<PathBuf> = std::fs::read_dir(&cal_dir).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(err.contains("calibration measured by the first 1 utterances") && err.contains(&files[0].display().to_string()), "{err}");
    let cal: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&files[0]).unwrap()).unwrap();
    assert_eq!(cal["measured"]["source"], "automatic");
    assert_eq!(cal["measured"]["utterances"], 1);
    assert_eq!(cal["herald"], env!("CARGO_PKG_VERSION"));
    let ms = cal["measured"]["ms_per_frame"].as_f64().unwrap();
    assert!(ms > 0.0 && (cal["measured"]["rtf"].as_f64().unwrap() - ms / 80.0).abs() < 1e-9, "{cal}");
    assert!(cal["measured"]["jitter_ms"].as_f64().unwrap() >= 20.0);

    // the next start uses it and measures nothing
    let o = speak("b.wav");
    let err = text(&o.stderr);
    assert!(o.status.success() && err.contains(&format!("using calibration {}", files[0].display())), "{err}");
    assert!(!err.contains("calibration measured"), "{err}");

    // written by another herald version: ignored with both versions named, and measured again
    std::fs::write(
        &files[0],
        serde_json::to_string(&{
            let mut c = cal.clone();
            c["herald"] = "0.0.0-old".into();
            c
        })
        .unwrap(),
    )
    .unwrap();
    let o = speak("c.wav");
    let err = text(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("written by herald 0.0.0-old") && err.contains("calibration measured by the first 1 utterances"), "{err}");
    let again: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&files[0]).unwrap()).unwrap();
    assert_eq!(again["herald"], env!("CARGO_PKG_VERSION"));
}
