//! The text front-end on real-looking language-model answers (`tests/text/corpus.txt`, each
//! with its spoken text written out by hand), and the segmenter on what it makes.
//!
//! The corpus format: a case starts with `=== NAME`, an optional `options: key=value …` line
//! (`markdown`, `emoji`, `code`, `urls`, as in `[text]`), then `--- input` and `--- spoken`,
//! each followed by its text up to the next `---` or `===` line. Texts are taken as written,
//! without the line break before the next marker.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use engine::segment::{SegmentLimits, segments};
use service::text::{self, Code, Emoji, Markdown, Replacements, TextOptions, Urls};

struct Case {
    name: String,
    options: TextOptions,
    input: String,
    spoken: String,
}

fn options(line: &str) -> TextOptions {
    let mut o = TextOptions::default();
    for pair in line.split_whitespace() {
        let (k, v) = pair.split_once('=').unwrap_or_else(|| panic!("option {pair:?} is not key=value"));
        match (k, v) {
            ("markdown", "auto") => o.markdown = Markdown::Auto,
            ("markdown", "on") => o.markdown = Markdown::On,
            ("markdown", "off") => o.markdown = Markdown::Off,
            ("emoji", "remove") => o.emoji = Emoji::Remove,
            ("emoji", "keep") => o.emoji = Emoji::Keep,
            ("code", "skip") => o.code = Code::Skip,
            ("code", "read") => o.code = Code::Read,
            ("urls", "host") => o.urls = Urls::Host,
            ("urls", "skip") => o.urls = Urls::Skip,
            ("urls", "keep") => o.urls = Urls::Keep,
            _ => panic!("unknown option {pair:?}"),
        }
    }
    o
}

fn corpus() -> Vec<Case> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/text/corpus.txt");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut cases = Vec::new();
    for block in text.split("\n=== ").skip(1) {
        let (head, body) = block.split_once('\n').unwrap();
        let (opts, body) = match body.strip_prefix("options: ") {
            Some(rest) => {
                let (line, body) = rest.split_once('\n').unwrap();
                (options(line), body)
            }
            None => (TextOptions::default(), body),
        };
        let body = body.strip_prefix("--- input\n").unwrap_or_else(|| panic!("{head}: `--- input` expected"));
        let (input, spoken) = body.split_once("\n--- spoken\n").unwrap_or_else(|| panic!("{head}: `--- spoken` expected"));
        cases.push(Case {
            name: head.trim().to_owned(),
            options: opts,
            input: input.to_owned(),
            spoken: spoken.strip_suffix('\n').unwrap_or(spoken).to_owned(),
        });
    }
    cases
}

#[test]
fn text_corpus_reads_as_written_by_hand() {
    let cases = corpus();
    assert!(cases.len() >= 30, "the corpus has {} cases", cases.len());
    let mut names: Vec<&str> = cases.iter().map(|c| c.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), cases.len(), "case names are unique");
    let mut failed = Vec::new();
    for c in &cases {
        let got = text::spoken(&c.input, &c.options);
        if got != c.spoken {
            failed.push(format!("=== {}\n--- want\n{}\n--- got\n{}\n", c.name, c.spoken, got));
        }
        // reading the result again changes nothing more (no rule feeds another)
        let again = text::spoken(&got, &TextOptions { markdown: Markdown::Off, ..c.options.clone() });
        if again != got {
            failed.push(format!("=== {} (read twice)\n--- once\n{got}\n--- twice\n{again}\n", c.name));
        }
    }
    assert!(failed.is_empty(), "{} of {} cases differ:\n{}", failed.len(), cases.len(), failed.join("\n"));
}

#[test]
fn text_corpus_results_have_no_markdown_emoji_or_urls_left() {
    for c in corpus().iter().filter(|c| c.options == TextOptions::default()) {
        let got = text::spoken(&c.input, &c.options);
        for sign in ["**", "__", "```", "](", "http://", "https://", "<b>", "|", "# "] {
            assert!(!got.contains(sign), "{}: {sign:?} is left in {got:?}", c.name);
        }
        assert!(!got.chars().any(text::emoji::is_pictograph), "{}: a pictograph is left in {got:?}", c.name);
        assert!(!got.contains("\n\n\n") && !got.contains("  "), "{}: white space is tidy in {got:?}", c.name);
    }
}

/// Whether `s` ends a sentence (`.` `!` `?` `…` `;` or a full-width stop, a closing quote or
/// bracket after it): the test's own rule, apart from the segmenter's.
fn ends_with_sentence_end(s: &str) -> bool {
    let s = s.trim_end_matches(['"', '\'', ')', '”', '’', '」', '）']);
    s.ends_with(['.', '!', '?', '…', ';', '。', '！', '？', '；'])
}

/// The segments of `text` with a target of `target` "tokens", counted as words (CJK
/// characters one each): small enough that several sentences cannot share a segment.
fn cut(text: &str, target: usize) -> Vec<Range<usize>> {
    let limits = SegmentLimits { target_tokens: target, max_tokens: 400 };
    let mut count = |s: &str| s.split_whitespace().count() + s.chars().filter(|c| text::emoji::is_cjk(*c)).count();
    segments(text, limits, &mut count)
}

#[test]
fn text_results_are_cut_by_the_segmenter_at_sentence_ends() {
    let cases = corpus();
    for name in ["recipe-pancakes", "ha-device-table", "ha-weather-week", "zh-weather-list", "ja-schedule", "code-answer-python"] {
        let c = cases.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no case {name}"));
        let spoken = text::spoken(&c.input, &c.options);
        let parts = cut(&spoken, 4);
        assert!(parts.len() >= 3, "{name}: {} segments of {spoken:?}", parts.len());
        for r in &parts {
            let seg = &spoken[r.clone()];
            assert!(ends_with_sentence_end(seg) || seg.ends_with([':', '：']), "{name}: the segment {seg:?} does not end a sentence");
        }
        // every segment boundary falls where the hand-written text has a sentence end
        let ends: Vec<&str> = parts.iter().map(|r| &spoken[r.clone()]).collect();
        assert_eq!(ends.concat().split_whitespace().collect::<String>(), spoken.split_whitespace().collect::<String>(), "{name}");
    }
}

#[test]
fn text_list_items_become_the_segmenters_sentences() {
    let spoken =
        text::spoken("## Steps\n- Mix the flour and eggs\n- Rest for 10 minutes\n- Fry until golden", &TextOptions::default());
    let parts: Vec<&str> = cut(&spoken, 1).into_iter().map(|r| &spoken[r]).collect();
    assert_eq!(parts, ["Steps.", "Mix the flour and eggs.", "Rest for 10 minutes.", "Fry until golden."]);
    let cjk = text::spoken("## 步骤\n- 先把面粉和鸡蛋混合\n- 静置十分钟", &TextOptions::default());
    let parts: Vec<&str> = cut(&cjk, 1).into_iter().map(|r| &cjk[r]).collect();
    assert_eq!(parts, ["步骤。", "先把面粉和鸡蛋混合。", "静置十分钟。"]);
}

#[test]
fn text_replacement_rules_apply_after_the_rest() {
    let rules = Replacements::parse(Path::new("rules.txt"), "HA => Home Assistant\n/(\\d+) ?°C/ => $1 degrees\n").unwrap();
    let opts = TextOptions { replacements: Some(Arc::new(rules)), ..TextOptions::default() };
    assert_eq!(text::spoken("**HA** says: 21 °C ☀️", &opts), "Home Assistant says: 21 degrees.");
}
