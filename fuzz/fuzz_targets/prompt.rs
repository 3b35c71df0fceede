//! Text → prompt: the prompt layout and the long-text segmenter over the tiny bundle's
//! tokenizer (`HERALD_FUZZ_BUNDLE`, default `build/bundles/tiny-0.6b`). The first two bytes pick
//! the language, the prompt mode and the segment limits; the rest is the text. Checked: no
//! panic; segments are ordered, disjoint, trimmed and non-empty, keep every non-white-space
//! character in order, and none has more tokens than the hard limit.

#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use model::prompt::{PromptMode, Prompter};
use model::segment::{SegmentLimits, segments};

fn prompter() -> &'static Prompter {
    static P: OnceLock<Prompter> = OnceLock::new();
    P.get_or_init(|| {
        let dir = std::env::var_os("HERALD_FUZZ_BUNDLE")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../build/bundles/tiny-0.6b"));
        let manifest = engine::read_manifest(&dir).unwrap_or_else(|e| panic!("HERALD_FUZZ_BUNDLE: {e}"));
        engine::read_prompter(&dir, &manifest).unwrap_or_else(|e| panic!("HERALD_FUZZ_BUNDLE: {e}"))
    })
}

fuzz_target!(|data: &[u8]| {
    let [a, b, rest @ ..] = data else { return };
    let Ok(text) = std::str::from_utf8(rest) else { return };
    let p = prompter();
    let languages: Vec<&str> = p.languages().collect();
    let language = match usize::from(*a) % (languages.len() + 1) {
        0 => "auto",
        i => languages[i - 1],
    };
    let mode = if a & 0x80 == 0 { PromptMode::Streaming } else { PromptMode::NonStreaming };
    let _ = p.layout(text, Some(language), None, mode);

    // the hard limit's floor is one character's most tokens (model::segment::MAX_CHAR_TOKENS)
    let max = model::segment::MAX_CHAR_TOKENS + usize::from(*b) * 2;
    let limits = SegmentLimits { target_tokens: 1 + usize::from(*b) % max, max_tokens: max };
    let ranges = segments(text, limits, &mut |s| p.count_tokens(s));
    let mut end = 0;
    for r in &ranges {
        assert!(r.start >= end && r.start < r.end, "ordered, disjoint, non-empty: {ranges:?}");
        let s = &text[r.clone()];
        assert_eq!(s, s.trim(), "trimmed");
        let n = p.count_tokens(s);
        assert!(n <= max, "{s:?} has {n} tokens, over the limit {max}");
        end = r.end;
    }
    let kept: String = ranges.iter().flat_map(|r| text[r.clone()].chars()).filter(|c| !c.is_whitespace()).collect();
    let all: String = text.chars().filter(|c| !c.is_whitespace()).collect();
    assert_eq!(kept, all, "every non-white-space character, in order");
});
