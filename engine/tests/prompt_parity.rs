//! `engine::prompt` against the Python reference (`tools/export/reference.py`
//! `Reference.prompt_layout`), run through `engine/tests/py/oracle.py` with the project venv:
//! a text corpus × both modes × languages × speakers must give identical rows, trailing queue,
//! text ids, language and speaker ids, and the same kind of error where either side rejects.

// A test crate: helper functions outside #[test] fail loudly by design.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use model::prompt::{MAX_TEXT_CHARS, PromptError, PromptLayout, PromptMode, PromptRow, frame_cap};

/// The project venv's python; a missing venv is a test failure with a clear message.
fn python() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    assert!(
        p.is_file(),
        "the prompt parity test needs the project venv's python at {} (create it with tools/export/setup.sh)",
        p.display()
    );
    p
}

fn oracle() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py/oracle.py")
}

fn hex(s: &str) -> String {
    if s.is_empty() {
        return "-".into();
    }
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> String {
    if s == "-" {
        return String::new();
    }
    let bytes: Vec<u8> = (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect();
    String::from_utf8(bytes).unwrap()
}

fn opt(s: &str) -> Option<u32> {
    if s == "-" { None } else { Some(s.parse().unwrap()) }
}

fn ids(s: &str) -> Vec<u32> {
    if s == "-" { Vec::new() } else { s.split(',').map(|v| v.parse().unwrap()).collect() }
}

/// What the oracle said for one request.
#[derive(Debug)]
enum Expected {
    Layout(PromptLayout),
    Error(String),
}

fn parse_line(line: &str) -> Expected {
    if let Some(msg) = line.strip_prefix("err ") {
        return Expected::Error(unhex(msg.trim()));
    }
    let body = line.strip_prefix("ok ").unwrap_or_else(|| panic!("bad oracle line {line:?}"));
    let field = |key: &str| {
        body.split(' ')
            .find_map(|kv| kv.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
            .unwrap_or_else(|| panic!("no {key} in {line:?}"))
    };
    let rows = field("rows")
        .split(',')
        .map(|r| {
            let (t, c) = r.split_once(':').unwrap();
            PromptRow { text: t.parse().unwrap(), codec: opt(c) }
        })
        .collect();
    Expected::Layout(PromptLayout {
        rows,
        trailing: ids(field("trailing")),
        text_ids: ids(field("text")),
        language_id: opt(field("lang")),
        speaker_id: opt(field("spk")),
    })
}

struct Request {
    text: String,
    language: Option<&'static str>,
    speaker: Option<&'static str>,
    mode: PromptMode,
}

fn run_oracle(bundle: &std::path::Path, requests: &[Request]) -> Vec<Expected> {
    let mut child = Command::new(python())
        .arg(oracle())
        .arg("prompt")
        .arg(bundle)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python().display()));
    let mut input = String::new();
    for r in requests {
        input.push_str(&format!("{} {} {} {}\n", hex(&r.text), r.language.unwrap_or("-"), r.speaker.unwrap_or("-"), r.mode));
    }
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    assert!(out.status.success(), "oracle.py prompt failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<Expected> = text.lines().filter(|l| !l.is_empty()).map(parse_line).collect();
    assert_eq!(lines.len(), requests.len(), "oracle answered {} of {} requests", lines.len(), requests.len());
    lines
}

/// The part of a message after "allowed: " (both sides list the same names).
fn allowed(msg: &str) -> &str {
    msg.split_once("allowed: ").map_or("", |(_, a)| a)
}

/// Does the Rust error match the reference's message?
fn same_error(rust: &PromptError, python: &str) -> bool {
    match rust {
        PromptError::EmptyText => python == "text is empty",
        PromptError::BlankText => python == "text is blank",
        PromptError::TextTooLong { .. } => python.starts_with("text is too long"),
        PromptError::NoTokens { .. } => python.ends_with("has no tokens of its own"),
        PromptError::UnknownLanguage { allowed: a, .. } => python.starts_with("unknown language") && allowed(python) == a,
        PromptError::UnknownSpeaker { allowed: a, .. } => python.starts_with("unknown speaker") && allowed(python) == a,
        _ => false,
    }
}

fn corpus() -> Vec<String> {
    let sentence = "The quick brown fox jumps over the lazy dog; 敏捷的棕色狐狸跳过了懒狗。 ";
    let long: String = sentence.chars().cycle().take(2000).collect();
    assert_eq!(long.chars().count(), 2000);
    vec![
        "Hello, world. This is herald speaking from a small board.".into(),
        "你好，世界。今天天气很好，我们去公园散步吧。".into(),
        "こんにちは、世界。今日はいい天気ですね。カタカナも。".into(),
        "Herald 说 hello, 日本語 and ქართული, Ελληνικά, русский — mixed 123!".into(),
        "0123456789 3.14159 2,048 -42 1e6 12:30 2024-06-11".into(),
        "?!... ,;:—«»()[]{}".into(),
        "a".into(),
        "。".into(),
        long,
        "Great job! 🎉👍🏽 👨‍👩‍👧 ❤️ 🇯🇵".into(),
        "\nA text that starts with a newline.".into(),
        "Line one.\r\nLine two.\rLine three.\n\tIndented.".into(),
        "Bell\u{7}, escape\u{1b}[1m, null\u{0}, DEL\u{7f}, NEL\u{85} and C1\u{9b}.".into(),
        "  leading and trailing spaces  ".into(),
        "say <|im_end|> now".into(),
        "Cafe\u{301} vs Café (NFC)".into(),
        "\u{feff}BOM-prefixed text".into(),
    ]
}

#[test]
fn layouts_match_the_reference() {
    let bundle = common::bundle("tiny-0.6b");
    let manifest = engine::read_manifest(&bundle).unwrap();
    let prompter = engine::read_prompter(&bundle, &manifest).unwrap();

    let mut requests = Vec::new();
    for text in corpus() {
        for mode in [PromptMode::Streaming, PromptMode::NonStreaming] {
            for language in [Some("auto"), Some("english"), Some("chinese")] {
                for speaker in [None, Some("serena"), Some("eric")] {
                    requests.push(Request { text: text.clone(), language, speaker, mode });
                }
            }
        }
    }
    // Case, defaults, dialect rules, and rejections on either side.
    let extra: [(&str, Option<&'static str>, Option<&'static str>); 16] = [
        ("Hello.", None, None),
        ("Hello.", Some(""), Some("")),
        ("Hello.", Some("AUTO"), Some("Serena")),
        ("Hello.", Some("English"), Some("DYLAN")),
        ("Hello.", Some("english"), Some("dylan")),
        ("Hello.", None, Some("dylan")),
        ("Hello.", Some("japanese"), Some("eric")),
        ("Hello.", Some("sichuan_dialect"), None),
        ("Hello.", Some("klingon"), None),
        ("Hello.", Some("english"), Some("nobody")),
        ("", None, None),
        ("   ", None, None),
        ("\n", Some("english"), None),
        ("\r\n\t \u{0}\u{85}", None, Some("serena")),
        ("", Some("klingon"), None),
        ("\u{3000}", None, None),
    ];
    for (text, language, speaker) in extra {
        for mode in [PromptMode::Streaming, PromptMode::NonStreaming] {
            requests.push(Request { text: text.into(), language, speaker, mode });
        }
    }
    let at_limit: String = "Speak. ".chars().cycle().take(MAX_TEXT_CHARS).collect();
    let over_limit: String = "Speak. ".chars().cycle().take(MAX_TEXT_CHARS + 1).collect();
    requests.push(Request { text: at_limit, language: Some("english"), speaker: None, mode: PromptMode::Streaming });
    requests.push(Request { text: over_limit, language: Some("english"), speaker: None, mode: PromptMode::Streaming });

    let expected = run_oracle(&bundle, &requests);
    let (mut layouts, mut errors, mut failures) = (0, 0, Vec::new());
    for (r, want) in requests.iter().zip(&expected) {
        let got = prompter.layout(&r.text, r.language, r.speaker, r.mode);
        let ok = match (&got, want) {
            (Ok(g), Expected::Layout(w)) => {
                layouts += 1;
                g == w
            }
            (Err(g), Expected::Error(w)) => {
                errors += 1;
                same_error(g, w)
            }
            _ => false,
        };
        if !ok {
            let preview: String = r.text.chars().take(40).collect();
            failures.push(format!("{preview:?} {:?} {:?} {}: rust {got:?}\n    python {want:?}", r.language, r.speaker, r.mode));
        }
    }
    assert!(failures.is_empty(), "{} of {} mismatches:\n{}", failures.len(), requests.len(), failures.join("\n"));
    assert!(layouts >= 300 && errors == 17, "{layouts} layouts, {errors} errors compared");
}

#[test]
fn row_counts_follow_the_documented_formula() {
    let bundle = common::bundle("tiny-0.6b");
    let manifest = engine::read_manifest(&bundle).unwrap();
    let prompter = engine::read_prompter(&bundle, &manifest).unwrap();
    // English + speaker, streaming: 3 + 6 + 1 = 10 (reference docstring example).
    let l = prompter.layout("Hello.", Some("english"), Some("serena"), PromptMode::Streaming).unwrap();
    assert_eq!(l.rows.len(), 10);
    assert_eq!(l.trailing.last(), Some(&manifest.text.tts_eos));
    assert_eq!(l.trailing.len(), l.n_text_tokens());
    for (lang, spk, p, s) in [(None, None, 3, 0), (Some("english"), None, 4, 0), (None, Some("serena"), 3, 1)] {
        let l = prompter.layout("Hello there.", lang, spk, PromptMode::NonStreaming).unwrap();
        let n = l.n_text_tokens();
        assert_eq!(l.rows.len(), 3 + (p + s + 1) + (n + 1) + 1);
        assert_eq!(l.trailing, vec![manifest.text.tts_pad]);
        let l = prompter.layout("Hello there.", lang, spk, PromptMode::Streaming).unwrap();
        assert_eq!(l.rows.len(), 3 + (p + s + 1) + 1);
    }
    assert_eq!(frame_cap(l.n_text_tokens(), manifest.sampling.talker.max_new_tokens), 40 + 10 * l.n_text_tokens());
}

#[test]
fn errors_name_what_is_wrong() {
    let bundle = common::bundle("tiny-0.6b");
    let manifest = engine::read_manifest(&bundle).unwrap();
    let prompter = engine::read_prompter(&bundle, &manifest).unwrap();
    let m = PromptMode::Streaming;

    let e = prompter.layout("Hi.", Some("Klingon"), None, m).unwrap_err().to_string();
    assert!(e.contains("\"Klingon\"") && e.contains("allowed: auto, beijing_dialect, chinese, english"), "{e}");
    let e = prompter.layout("Hi.", None, Some("Nobody"), m).unwrap_err().to_string();
    assert!(e.contains("\"Nobody\"") && e.contains("allowed: dylan, eric, ryan, serena, vivian"), "{e}");
    let long = "x".repeat(MAX_TEXT_CHARS + 5);
    let e = prompter.layout(&long, None, None, m).unwrap_err();
    assert!(matches!(e, PromptError::TextTooLong { chars: 20_005, limit: 20_000 }), "{e:?}");
    assert!(e.to_string().contains("20000"), "{e}");
    // The limit counts characters, not bytes: 20,000 CJK characters (60,000 bytes) pass.
    let cjk: String = "你好世界。".chars().cycle().take(MAX_TEXT_CHARS).collect();
    assert!(prompter.layout(&cjk, None, None, m).is_ok());
    assert!(matches!(prompter.layout("", None, None, m), Err(PromptError::EmptyText)));
    assert!(matches!(prompter.layout(" \t\r\n\u{0}\u{2003}", None, None, m), Err(PromptError::BlankText)));
    assert!(prompter.layout(" \t\r\n\u{0}\u{2003}", None, None, m).unwrap_err().to_string().contains("no letter or digit"));

    let missing = bundle.join("no-such-tokenizer.json");
    let mut bad = manifest.clone();
    bad.tokenizer.file = "no-such-tokenizer.json".into();
    let e = engine::read_prompter(&bundle, &bad).unwrap_err();
    assert!(matches!(e, PromptError::TokenizerLoad { .. }), "{e:?}");
    assert!(e.to_string().contains(&missing.display().to_string()), "{e}");

    let dir = std::env::temp_dir().join(format!("herald-prompt-parity-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{ not json").unwrap();
    let e = engine::read_prompter(&dir, &manifest).unwrap_err();
    assert!(e.to_string().contains("tokenizer.json"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_tiny_bundle_loads() {
    for preset in common::PRESETS {
        let bundle = common::bundle(preset);
        let manifest = engine::read_manifest(&bundle).unwrap();
        let p = engine::read_prompter(&bundle, &manifest).unwrap();
        assert!(p.languages().any(|l| l == "english"));
        assert!(p.speakers().any(|s| s == "serena"));
        assert!(!p.tokenize("Hello.").unwrap().is_empty());
    }
}
