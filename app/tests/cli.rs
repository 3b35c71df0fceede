//! The `herald` binary end to end: WAV, raw and ALSA outputs agree sample for sample (ALSA
//! through alsa-lib's `file` plugin, no sound hardware needed), and every documented exit code.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::Output;

mod common;

use common::{bundle, parse_wav, stderr};

fn tmp(name: &str) -> PathBuf {
    common::tmp("cli", name)
}

/// Run herald with a clean environment ([`common::run`]); `env` adds variables.
fn herald(args: &[&str], env: &[(&str, &str)], stdin: Option<&[u8]>) -> Output {
    common::run(args, env, stdin)
}

const TEXT: &str = "Every output agrees.";

#[test]
fn wav_raw_pipe_and_alsa_outputs_are_identical() {
    let b = bundle();
    let bs = b.to_str().unwrap();
    let d = tmp("outputs");
    let wav = d.join("out.wav");
    let o = herald(&["speak", TEXT, "--bundle", bs, "--seed", "11", "--out", wav.to_str().unwrap()], &[], None);
    assert!(o.status.success(), "{}", stderr(&o));
    let (rate, ch, bits, pcm) = parse_wav(&std::fs::read(&wav).unwrap());
    assert_eq!((rate, ch, bits), (24000, 1, 16));
    // tiny models never emit eos: "Every output agrees." caps at 40 + 10 n frames; plus 2 x 0 ms silence
    assert_eq!(pcm.len() % (1920 * 2), 0, "whole frames of S16 samples");
    assert!(pcm.len() >= 40 * 1920 * 2);
    // WAV to a pipe: streaming header, same samples
    let o = herald(&["speak", TEXT, "--bundle", bs, "--seed", "11", "--out", "-"], &[], None);
    assert!(o.status.success(), "{}", stderr(&o));
    let (r2, c2, b2, pcm2) = parse_wav(&o.stdout);
    assert_eq!((r2, c2, b2), (24000, 1, 16));
    assert_eq!(pcm2, pcm, "WAV through a pipe differs from the WAV file");
    // raw: no header, same bytes
    let o = herald(&["speak", TEXT, "--bundle", bs, "--seed", "11", "--raw"], &[], None);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_ne!(&o.stdout[..4], b"RIFF");
    assert_eq!(o.stdout, pcm, "raw output differs from the WAV data");
    // ALSA: the default PCM is alsa-lib's file plugin over null, recording what herald wrote
    let capture = d.join("capture.raw");
    let conf = d.join("asound.conf");
    std::fs::write(
        &conf,
        format!("pcm.!default {{\n type file\n slave.pcm {{ type null }}\n file \"{}\"\n format \"raw\"\n}}\n", capture.display()),
    )
    .unwrap();
    let o = herald(&["speak", TEXT, "--bundle", bs, "--seed", "11"], &[("ALSA_CONFIG_PATH", conf.to_str().unwrap())], None);
    assert!(o.status.success(), "{}", stderr(&o));
    let captured = std::fs::read(&capture).unwrap();
    assert_eq!(captured.len(), pcm.len(), "ALSA captured another number of samples");
    assert_eq!(captured, pcm, "ALSA capture differs from the WAV output");
    assert!(stderr(&o).contains("xruns 0") || !stderr(&o).contains("xrun"), "{}", stderr(&o));
}

#[test]
fn text_from_stdin_and_shaping_from_the_config() {
    let b = bundle();
    let d = tmp("stdin");
    let cfg = d.join("herald.toml");
    std::fs::write(
        &cfg,
        format!(
            "[model]\nbundle = \"{}\"\n[audio]\nleading_silence_ms = 100\ntrailing_silence_ms = 50\n[synthesis]\nsampling = \"greedy\"\n",
            b.display()
        ),
    )
    .unwrap();
    let o = herald(&["--config", cfg.to_str().unwrap(), "speak", "--raw"], &[], Some("Read me from standard input.".as_bytes()));
    assert!(o.status.success(), "{}", stderr(&o));
    let lead = 2400 * 2;
    let trail = 1200 * 2;
    assert!(o.stdout[..lead].iter().all(|&x| x == 0), "100 ms of leading silence");
    assert!(o.stdout[o.stdout.len() - trail..].iter().all(|&x| x == 0), "50 ms of trailing silence");
    assert_eq!((o.stdout.len() - lead - trail) % (1920 * 2), 0);
    // greedy is deterministic: the same again
    let o2 = herald(&["--config", cfg.to_str().unwrap(), "speak", "--raw", "-"], &[], Some("Read me from standard input.".as_bytes()));
    assert_eq!(o.stdout, o2.stdout);
}

/// A copy of the tiny bundle (graphs linked) whose talker stops after `frames` frames:
/// tiny random models never emit eos, and a long text must stay quick to speak.
fn bundle_capped(d: &std::path::Path, frames: u32) -> PathBuf {
    let b = bundle();
    let out = d.join("bundle");
    std::fs::create_dir_all(&out).unwrap();
    for e in std::fs::read_dir(&b).unwrap() {
        let e = e.unwrap();
        if e.file_name() != "bundle.toml" {
            std::os::unix::fs::symlink(e.path(), out.join(e.file_name())).unwrap();
        }
    }
    let toml = std::fs::read_to_string(b.join("bundle.toml")).unwrap();
    assert!(toml.contains("max_new_tokens = 8192"));
    std::fs::write(out.join("bundle.toml"), toml.replace("max_new_tokens = 8192", &format!("max_new_tokens = {frames}"))).unwrap();
    out
}

#[test]
fn a_50000_character_text_from_stdin_is_read_as_one_stream() {
    let d = tmp("long");
    let b = bundle_capped(&d, 3);
    let sentences = [
        "The council met on Tuesday at 7.30 p.m. to discuss the budget of 45.6 million euros.",
        "Dr. Müller said the new bridge would open in spring, weather permitting!",
        "Der Bericht umfasst zwölf Kapitel, und jedes endet mit einer Zusammenfassung.",
        "会议将在下午三点开始。请大家准时参加，谢谢！",
        "Le projet avance bien; la deuxième phase commence en mai.",
        "Was it worth it? Everyone agreed it was.",
    ];
    let mut text = String::new();
    let mut p = 0;
    while text.chars().count() < 50_000 {
        for (i, s) in sentences.iter().enumerate() {
            text.push_str(s);
            text.push(if i % 2 == 0 { ' ' } else { '\n' });
        }
        p += 1;
        if p % 3 == 0 {
            text.push('\n');
        }
    }
    assert!(text.chars().count() >= 50_000);
    let wav = d.join("long.wav");
    let o = herald(
        &["speak", "--bundle", b.to_str().unwrap(), "--greedy", "--out", wav.to_str().unwrap()],
        &[("RUST_LOG", "info")],
        Some(text.as_bytes()),
    );
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    // "segment i of n spoken" once per segment, in order
    let done: Vec<(usize, usize)> = e
        .lines()
        .filter_map(|l| {
            let rest = &l[l.find("segment ")? + 8..];
            let (i, rest) = rest.split_once(" of ")?;
            let (n, _) = rest.split_once(" spoken")?;
            Some((i.parse().ok()?, n.parse().ok()?))
        })
        .collect();
    let n = done.len();
    assert!(n > 100, "{n} segments");
    assert!(done.iter().enumerate().all(|(i, &(k, m))| k == i + 1 && m == n), "every segment once, in order");
    let frames: usize = e
        .lines()
        .filter(|l| l.contains("herald::cmd::speak"))
        .find_map(|l| l.split_once(" frames (").and_then(|(a, _)| a.rsplit(' ').next()?.parse().ok()))
        .expect("the summary line");
    assert!(frames >= 2 * n && frames <= 3 * n, "{frames} frames for {n} segments");
    // one WAV: every segment's frames and a 250 ms pause (the default) between two segments
    let bytes = std::fs::read(&wav).unwrap();
    let (rate, channels, bits, data) = parse_wav(&bytes);
    assert_eq!((rate, channels, bits), (24_000, 1, 16));
    assert_eq!(data.len() / 2, frames * 1920 + (n - 1) * 6000);
}

#[test]
fn a_text_over_100000_characters_is_refused_naming_the_limit() {
    let over = "a".repeat(100_001);
    let o = herald(&["speak", "--bundle", bundle().to_str().unwrap(), "--raw"], &[], Some(over.as_bytes()));
    common::assert_one_error_line(&o, 2, "100000 characters");
    assert!(o.stdout.is_empty(), "nothing was spoken");
}

/// A copy of the tiny bundle (real copies: the test damages them).
fn bundle_copy(d: &std::path::Path) -> PathBuf {
    let out = d.join("bundle");
    std::fs::create_dir_all(&out).unwrap();
    for e in std::fs::read_dir(bundle()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), out.join(e.file_name())).unwrap();
    }
    out
}

#[test]
fn damaged_bundle_files_are_named_and_refused_with_exit_4() {
    let d = tmp("damaged");
    let b = bundle_copy(&d);
    let bs = b.to_str().unwrap();
    let o = herald(&["info", "--bundle", bs, "--verify"], &[], None);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("SHA-256 as in bundle.toml"));
    // one byte changed, same length: only the checksum sees it
    let talker = b.join("talker.onnx");
    let mut bytes = std::fs::read(&talker).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x55;
    std::fs::write(&talker, &bytes).unwrap();
    let o = herald(&["info", "--bundle", bs, "--verify"], &[], None);
    common::assert_one_error_line(&o, 4, "talker.onnx");
    assert!(stderr(&o).contains("damaged or was replaced"), "{}", stderr(&o));
    let wav = d.join("x.wav");
    let o = herald(&["speak", "Hello.", "--bundle", bs, "--out", wav.to_str().unwrap()], &[("HERALD_MODEL_VERIFY", "true")], None);
    common::assert_one_error_line(&o, 4, "talker.onnx");
    assert!(!wav.exists(), "nothing written");
    // a graph replaced by an empty file: named, exit 4, with or without verification
    std::fs::write(b.join("code_predictor.onnx"), b"").unwrap();
    for verify in ["true", "false"] {
        let o = herald(&["speak", "Hello.", "--bundle", bs, "--out", wav.to_str().unwrap()], &[("HERALD_MODEL_VERIFY", verify)], None);
        assert_eq!(o.status.code(), Some(4), "verify={verify}: {}", stderr(&o));
        assert!(stderr(&o).contains("code_predictor.onnx"), "verify={verify}: {}", stderr(&o));
        assert!(!wav.exists(), "nothing written");
    }
    // the tables cut short (a copy that stopped half-way): named at the start; cut short while
    // herald runs, see tests/faults.rs
    let fresh = bundle_copy(&d.join("tables"));
    let tables = fresh.join("tables.safetensors");
    let len = std::fs::metadata(&tables).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&tables).unwrap().set_len(len / 2).unwrap();
    let o = herald(&["speak", "Hello.", "--bundle", fresh.to_str().unwrap(), "--out", wav.to_str().unwrap()], &[], None);
    common::assert_one_error_line(&o, 4, "tables.safetensors");
    assert!(stderr(&o).contains("truncated"), "{}", stderr(&o));
    let o = herald(&["info", "--verify", "--bundle", fresh.to_str().unwrap()], &[], None);
    common::assert_one_error_line(&o, 4, "tables.safetensors");
    assert!(stderr(&o).contains("truncated"), "{}", stderr(&o));
    // a folder where a graph should be
    std::fs::remove_file(fresh.join("talker.onnx")).unwrap();
    std::fs::create_dir(fresh.join("talker.onnx")).unwrap();
    let o = herald(&["info", "--bundle", fresh.to_str().unwrap()], &[], None);
    common::assert_one_error_line(&o, 4, "names talker.onnx, which is not a file in the bundle");
    assert!(!wav.exists(), "nothing written");
}

#[test]
fn a_writer_killed_at_any_point_leaves_no_partial_wav() {
    let d = tmp("killed");
    let b = bundle();
    let bs = b.to_str().unwrap();
    let out = d.join("out.wav");
    let os = out.to_str().unwrap();
    let text = "Killed while it writes, at any point of the run.";
    let whole = |bytes: &[u8]| {
        let riff = u32::from_le_bytes(bytes[4..8].try_into().unwrap()) as usize;
        assert_eq!(riff + 8, bytes.len(), "the RIFF size is the file's");
        let (_, _, _, data) = parse_wav(bytes);
        assert!(!data.is_empty() && data.len() % 3840 == 0, "whole frames: {} bytes", data.len());
    };
    let writing = || {
        std::fs::read_dir(&d).unwrap().any(|e| {
            let n = e.unwrap().file_name().to_string_lossy().into_owned();
            n.starts_with(".out.wav.") && n.ends_with(".tmp")
        })
    };
    // killed while it starts (before the output exists), then at points while it writes
    for (mid_write, ms) in [(false, 0u64), (false, 300), (true, 0), (true, 30), (true, 100), (true, 300), (true, 600), (true, 1000)] {
        let mut child = common::command(&["speak", text, "--bundle", bs, "--seed", "3", "--out", os], &[])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let t0 = std::time::Instant::now();
        while mid_write && !writing() && child.try_wait().unwrap().is_none() && t0.elapsed().as_secs() < 60 {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        std::thread::sleep(std::time::Duration::from_millis(ms));
        let _ = child.kill(); // SIGKILL
        let _ = child.wait();
        // the target is absent or a whole WAV of an earlier run that finished; never partial
        if out.exists() {
            whole(&std::fs::read(&out).unwrap());
        }
    }
    // killed mid-write, they left their temporary files (they could not remove them) ...
    let temps = std::fs::read_dir(&d).unwrap().filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".tmp")).count();
    assert!(temps > 0, "some run was killed while it wrote");
    // ... which the next writer removes, writing the whole file
    let o = herald(&["speak", text, "--bundle", bs, "--seed", "3", "--out", os], &[], None);
    assert!(o.status.success(), "{}", stderr(&o));
    whole(&std::fs::read(&out).unwrap());
    let left: Vec<String> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(left, ["out.wav"]);
}

#[test]
fn documented_exit_codes_with_one_line_reasons() {
    let b = bundle();
    let bs = b.to_str().unwrap();
    let d = tmp("codes");
    let check = |o: Output, code: i32, needle: &str| common::assert_one_error_line(&o, code, needle);
    check(herald(&["speak", "hi", "--bogus"], &[], None), 2, "--bogus");
    check(herald(&["speak", "hi", "--bundle", "/nonexistent/bundle", "--out", "/dev/null"], &[], None), 4, "/nonexistent/bundle");
    check(herald(&["speak", "hi", "--bundle", bs, "--device", "no_such_pcm"], &[], None), 3, "no_such_pcm");
    let bad = d.join("bad.toml");
    std::fs::write(&bad, "[audio]\nvolume = 3.5\n").unwrap();
    check(herald(&["--config", bad.to_str().unwrap(), "speak", "hi"], &[], None), 2, "audio.volume");
    std::fs::write(&bad, "[audio\nvolume = 1\n").unwrap();
    check(herald(&["--config", bad.to_str().unwrap(), "speak", "hi"], &[], None), 2, "bad.toml");
    check(herald(&["speak", "", "--bundle", bs, "--out", "/dev/null"], &[], None), 2, "empty");
    check(herald(&["speak", "hi", "--bundle", bs, "--speaker", "nobody", "--out", "/dev/null"], &[], None), 2, "nobody");
    check(herald(&["speak", "--bundle", bs, "--out", "/dev/null"], &[], Some(&[0x66, 0xff, 0xfe])), 2, "UTF-8");
    check(herald(&["speak", "hi", "--bundle", bs], &[("HERALD_AUDIO_VOLUMEX", "1")], None), 2, "HERALD_AUDIO_VOLUMEX");
    // a broken bundle: manifest present, a graph truncated
    let broken = d.join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    for f in std::fs::read_dir(&b).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, broken.join(f.file_name().unwrap())).unwrap();
    }
    let g = broken.join("talker.onnx");
    let data = std::fs::read(&g).unwrap();
    std::fs::write(&g, &data[..data.len() / 2]).unwrap();
    check(herald(&["speak", "hi", "--bundle", broken.to_str().unwrap(), "--out", "/dev/null"], &[], None), 4, "talker.onnx");
    // a failed run never truncates an existing --out file
    let keep = d.join("keep.wav");
    std::fs::write(&keep, b"precious").unwrap();
    check(herald(&["speak", "  ", "--bundle", bs, "--out", keep.to_str().unwrap()], &[], None), 2, "nothing to say");
    // punctuation alone has no letter or digit: nothing to say either (a model would babble)
    check(herald(&["speak", "?!...,;:", "--bundle", bs, "--out", keep.to_str().unwrap()], &[], None), 2, "nothing to say");
    // nothing left once the text front-end has read it (only emoji, only code): nothing to say
    check(herald(&["speak", "🎉🎉 👍🏽", "--bundle", bs, "--out", keep.to_str().unwrap()], &[], None), 2, "nothing to say");
    check(herald(&["speak", "```\nls -la\n```", "--bundle", bs, "--out", keep.to_str().unwrap()], &[], None), 2, "nothing to say");
    // a bad replacement rule is a configuration error naming the file and the line
    let rules = d.join("rules.txt");
    std::fs::write(&rules, "# words\nHA => Home Assistant\n/(unclosed/ => x\n").unwrap();
    let env = [("HERALD_TEXT_REPLACEMENTS", rules.to_str().unwrap())];
    check(
        herald(&["speak", "hi", "--bundle", bs, "--out", keep.to_str().unwrap()], &env, None),
        2,
        "rules.txt:3: bad replacement rule",
    );
    let env = [("HERALD_TEXT_REPLACEMENTS", "/nonexistent/rules.txt")];
    check(herald(&["speak", "hi", "--bundle", bs, "--out", keep.to_str().unwrap()], &env, None), 2, "/nonexistent/rules.txt");
    check(
        herald(&["speak", "hi", "--bundle", broken.to_str().unwrap(), "--out", keep.to_str().unwrap()], &[], None),
        4,
        "talker.onnx",
    );
    assert_eq!(std::fs::read(&keep).unwrap(), b"precious");
    // and leaves no temporary file (board::fsutil names them `.keep.wav.<pid>-<random>.tmp`)
    assert!(!std::fs::read_dir(&d).unwrap().any(|e| e.unwrap().file_name().to_string_lossy().starts_with(".keep.wav.")));
    // standard input is read only up to what a text may hold
    let huge = vec![b'a'; 500_000];
    check(herald(&["speak", "-", "--bundle", bs, "--out", "/dev/null"], &[], Some(&huge)), 2, "longer than the longest text");
    // a text that does not fit the KV cache is spoken as far as it fits, then exit 2 naming the key
    let words = "word ".repeat(60);
    // (seeded: an unseeded run may sample eos before the cache fills)
    let o = herald(
        &["speak", &words, "--bundle", bs, "--seed", "1", "--out", d.join("kv.wav").to_str().unwrap()],
        &[("HERALD_SYNTHESIS_KV_CAPACITY", "64")],
        None,
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("synthesis.kv_capacity"));
    // sanitize never renames over a device node
    check(herald(&["sanitize", b.join("talker.onnx").to_str().unwrap(), "/dev/null"], &[], None), 2, "not a regular file");
    assert!(!std::fs::metadata("/dev/null").unwrap().is_file());
    // info and sanitize
    let o = herald(&["info", "--bundle", bs], &[], None);
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stdout).contains("speakers    dylan, eric, ryan, serena, vivian"));
    check(herald(&["sanitize", "/nonexistent.onnx", d.join("o.onnx").to_str().unwrap()], &[], None), 2, "/nonexistent.onnx");
    let o = herald(&["sanitize", b.join("talker.onnx").to_str().unwrap(), d.join("t.onnx").to_str().unwrap()], &[], None);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(d.join("t.onnx").is_file());
}

#[test]
fn probe_reports_this_board_and_honours_the_override() {
    let o = herald(&["probe"], &[], None);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(out.starts_with("class=") && out.contains("source=probe"), "{out}");
    let d = tmp("probe");
    let p = d.join("rb3.json");
    std::fs::write(&p, r#"{"class":"snapdragon_npu","arch":"aarch64","n_logical":8,"clusters":[{"max_khz":2707200,"cpus":[7]},{"max_khz":1958400,"cpus":[0,1,2,3]}]}"#).unwrap();
    let o = herald(&["probe"], &[("HERALD_HW_PROFILE", p.to_str().unwrap())], None);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(out.contains("class=snapdragon_npu") && out.contains("source=override:"), "{out}");
    // one prime core: both stages share it
    assert!(out.contains("talker stage on CPUs [7], vocoder stage on CPUs [7]"), "{out}");
    let o = herald(&["probe"], &[("HERALD_HW_PROFILE", "/nonexistent/profile.json")], None);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("/nonexistent/profile.json"));
}

#[test]
fn languages_and_the_default_speaker_take_the_words_of_http_and_wyoming() {
    let b = bundle();
    let bs = b.to_str().unwrap();
    let d = tmp("words");
    let speak = |name: &str, extra: &[&str]| -> Vec<u8> {
        let out = d.join(format!("{name}.wav"));
        let mut args = vec!["speak", "Hello.", "--bundle", bs, "--seed", "5", "--speaker", "ryan", "--out", out.to_str().unwrap()];
        args.extend_from_slice(extra);
        let o = herald(&args, &[], None);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        std::fs::read(out).unwrap()
    };
    let want = speak("name", &["--language", "english"]);
    assert_eq!(speak("code", &["--language", "en"]), want, "--language en");
    assert_eq!(speak("tag", &["--language", "en-US"]), want, "--language en-US");
    assert_eq!(speak("case", &["--language", "English"]), want, "--language English");
    // a voice alias is its speaker: a built-in one (echo → ryan), and one of the configuration
    // in another case
    let aliased = |name: &str, speaker: &str, env: &[(&str, &str)]| -> Vec<u8> {
        let out = d.join(format!("{name}.wav"));
        let args = ["speak", "Hello.", "--bundle", bs, "--seed", "5", "--speaker", speaker, "--language", "english", "--out"];
        let o = herald(&[&args[..], &[out.to_str().unwrap()]].concat(), env, None);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        std::fs::read(out).unwrap()
    };
    assert_eq!(aliased("echo", "echo", &[]), want, "--speaker echo");
    assert_eq!(aliased("kitchen", "Kitchen", &[("HERALD_VOICES_ALIASES", "kitchen=RYAN")]), want, "kitchen=RYAN");
    // an alias the bundle cannot serve stops `speak` naming the key
    common::assert_one_error_line(
        &herald(&["speak", "Hello.", "--bundle", bs, "--out", "/dev/null"], &[("HERALD_VOICES_ALIASES", "kitchen=nobody")], None),
        2,
        "env HERALD_VOICES_ALIASES: voices.aliases.kitchen = \"nobody\": the bundle has no speaker",
    );
    // `default` is no speaker: the bundle's default voice, as without --speaker
    let plain = d.join("plain.wav");
    let o = herald(&["speak", "Hello.", "--bundle", bs, "--seed", "5", "--out", plain.to_str().unwrap()], &[], None);
    assert!(o.status.success(), "{}", stderr(&o));
    let deflt = d.join("default.wav");
    let o = herald(
        &["speak", "Hello.", "--bundle", bs, "--seed", "5", "--speaker", "default", "--out", deflt.to_str().unwrap()],
        &[],
        None,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::read(deflt).unwrap(), std::fs::read(plain).unwrap());
    // a code the bundle has no language for is refused, naming the languages
    common::assert_one_error_line(
        &herald(&["speak", "Hello.", "--bundle", bs, "--language", "xx", "--out", "/dev/null"], &[], None),
        2,
        "xx",
    );
}

/// `--out` picks the format from the extension: `.flac` decodes (ffmpeg, where installed) to
/// the `--raw` samples, `.mp3` is MPEG-2 Layer III frames, `.opus` Ogg Opus of the `--raw`
/// length; an extension herald does not write
/// is bad input (exit 2) naming the ones it does, and nothing is written.
#[test]
fn out_picks_the_format_from_the_extension() {
    let b = bundle();
    let bs = b.to_str().unwrap();
    let d = tmp("formats");
    let raw = herald(&["speak", TEXT, "--bundle", bs, "--seed", "11", "--raw"], &[], None);
    assert!(raw.status.success(), "{}", stderr(&raw));
    let flac = d.join("out.FLAC");
    let o = herald(&["speak", TEXT, "--bundle", bs, "--seed", "11", "--out", flac.to_str().unwrap()], &[], None);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(&std::fs::read(&flac).unwrap()[..4], b"fLaC");
    let mp3 = d.join("out.mp3");
    let o = herald(&["speak", TEXT, "--bundle", bs, "--seed", "11", "--out", mp3.to_str().unwrap()], &[], None);
    assert!(o.status.success(), "{}", stderr(&o));
    let bytes = std::fs::read(&mp3).unwrap();
    // MPEG-2 Layer III, 64 kbit/s at 24 kHz: 192-byte frames
    assert_eq!((bytes[0], bytes[1], bytes.len() % 192), (0xFF, 0xF3, 0));

    let opus = d.join("out.opus");
    let o = herald(&["speak", TEXT, "--bundle", bs, "--seed", "11", "--out", opus.to_str().unwrap()], &[], None);
    assert!(o.status.success(), "{}", stderr(&o));
    let bytes = std::fs::read(&opus).unwrap();
    // an Ogg page whose one packet (after the 27-byte header and a 1-byte segment table) is OpusHead
    assert_eq!((&bytes[..4], &bytes[28..36]), (&b"OggS"[..], &b"OpusHead"[..]));

    let aac = d.join("out.aac");
    let o = herald(&["speak", TEXT, "--bundle", bs, "--out", aac.to_str().unwrap()], &[], None);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("herald cannot write .aac files; the extension must be one of .wav, .mp3, .flac, .opus, .ogg"),
        "{}",
        stderr(&o)
    );
    assert_eq!(std::fs::read_dir(&d).unwrap().count(), 3, "a refused --out left a file");

    if std::process::Command::new("ffmpeg").arg("-version").output().is_err() {
        eprintln!("SKIPPED: no ffmpeg on PATH (scripts/prereqs installs it): the flac file was not decoded");
        return;
    }
    // S16LE mono at 24 kHz, as --raw writes it
    let decode = |file: &std::path::Path| {
        let o = std::process::Command::new("ffmpeg")
            .args(["-nostdin", "-v", "error", "-i"])
            .arg(file)
            .args(["-f", "s16le", "-ac", "1", "-ar", "24000", "-"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        o.stdout
    };
    assert!(decode(&flac) == raw.stdout, "the flac file decodes to other samples than --raw");
    // the opus file's end trim: as many samples as --raw (the samples themselves: service/tests/http.rs)
    assert_eq!(decode(&opus).len(), raw.stdout.len());
}

#[test]
fn pauses_and_speed_reach_the_output_and_strict_mode_refuses_a_bad_tag() {
    let b = bundle();
    let bs = b.to_str().unwrap();
    let d = tmp("pauses");
    // one seed, so that each piece is the same alone and in the whole
    let raw = |text: &str, env: &[(&str, &str)]| {
        let o = herald(&["speak", text, "--bundle", bs, "--seed", "11", "--raw"], env, None);
        assert!(o.status.success(), "{text}: {}", stderr(&o));
        o.stdout.len() / 2 // s16le
    };
    let (hello, world) = (raw("Hello.", &[]), raw("World.", &[]));
    // 750 ms at 24 kHz: 18,000 samples
    assert_eq!(raw("Hello. [pause:750ms] World.", &[]), hello + 18_000 + world);
    assert_eq!(raw("Hello. World.", &[("HERALD_SYNTHESIS_SENTENCE_PAUSE_MS", "400")]), hello + 9_600 + world);
    // --speed (and synthesis.speed): exactly round(n / speed) samples; out of range is exit 2
    let o = herald(&["speak", "Hello.", "--bundle", bs, "--seed", "11", "--raw", "--speed", "2"], &[], None);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(o.stdout.len() / 2, hello.div_ceil(2), "--speed 2: round(n / 2), a half rounded up");
    assert_eq!(raw("Hello.", &[("HERALD_SYNTHESIS_SPEED", "0.5")]), 2 * hello);
    let o = herald(&["speak", "Hello.", "--bundle", bs, "--raw", "--speed", "5"], &[], None);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("synthesis.speed = 5"), "{}", stderr(&o));
    // strict: exit 2 naming the tag, nothing written
    let out = d.join("x.wav");
    let o = herald(
        &["speak", "Hello [pause:2] world.", "--bundle", bs, "--out", out.to_str().unwrap()],
        &[("HERALD_TEXT_PAUSE_TAGS", "strict")],
        None,
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("malformed pause tag \"[pause:2]\": a duration needs a unit: ms or s"), "{}", stderr(&o));
    assert!(!out.exists(), "a refused text left a file");
}
