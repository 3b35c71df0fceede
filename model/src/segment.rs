//! Long texts, read as one stream: the text is cut into segments at sentence boundaries, each
//! short enough in text tokens that its generation cannot exhaust the talker's KV cache, and the
//! segments are spoken back to back (the service's job).
//!
//! Boundaries, in the order they are tried:
//! 1. **Paragraphs**: a line that is empty or only whitespace ends a segment always.
//! 2. **Sentences**: after `.` `!` `?` `…` `;` (Latin, Cyrillic, Korean), `。` `！` `？` `．` `；` (CJK
//!    full-width), `।` (danda), `؟` `۔` (Arabic), including the closing quotes and brackets
//!    that follow them. The half-width terminators need white space (or the end) after them, so
//!    `45.6`, `3.14`, `e.g.x`, `example.com` and `v1.2.3` never split; the full-width ones do
//!    not. A `.` does not end a sentence after one of [`ABBREVIATIONS`] or after a single
//!    letter (initials: `J. R. R. Tolkien`, `U.S.`). Sentences are packed into one segment
//!    while the segment stays within the target length.
//! 3. **Clauses**, only inside a sentence longer than the hard limit: after `,` `:` (followed by
//!    white space) and `，` `、` `：`.
//! 4. **Words** (white space), then **characters**, for a clause still too long (a long run of
//!    CJK without punctuation, a URL): pieces of at most `max_tokens` UTF-8 bytes, each counted
//!    again and halved (at character boundaries) while it has more tokens than `max_tokens`: a
//!    byte-level BPE token covers at least one byte, but of the *normalized* text, and the
//!    tokenizer's NFC may make one character several (U+0344 becomes U+0308 U+0301; found by
//!    the `prompt` fuzz target, fuzz/regressions/prompt). A single character has at most
//!    [`MAX_CHAR_TOKENS`] tokens, the floor of the hard limit.
//!
//! A text that fits within the target is one segment, the text itself: short texts are spoken
//! exactly as before. Segments are byte ranges of the text; together they cover every
//! non-whitespace character exactly once, in order.

use std::ops::Range;

use crate::prompt::{CAP_BASE_FRAMES, CAP_FRAMES_PER_TEXT_TOKEN};

/// Most characters (Unicode scalar values) of one long text, the limit of `herald speak`'s
/// standard input, the FIFO and the network front-ends: about 100 minutes of speech. Chosen on
/// the Rust side (issue 17).
pub const MAX_LONG_TEXT_CHARS: usize = 100_000;

/// Default target length of a segment, in text tokens (`synthesis.segment_tokens`): about 90
/// English words, some 30 s of speech, well inside the hard limit of the default KV capacity
/// (4096 positions: 367 tokens).
pub const DEFAULT_SEGMENT_TOKENS: usize = 120;

/// Words after which a `.` does not end a sentence (compared case-insensitively, without the
/// dot). English titles and Latin abbreviations, and the common German, French, Spanish,
/// Italian and Portuguese ones of the bundle's languages. A single letter is never a sentence
/// end either (initials).
pub const ABBREVIATIONS: &[&str] = &[
    // English
    "mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "vs", "etc", "e.g", "i.e", "no", "fig", "inc", "ltd", "co", "mt", "approx",
    "dept", "est", "gen", "gov", "sgt", "capt", "col", "lt", "rev", "vol", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep",
    "sept", "oct", "nov", "dec", "a.m", "p.m", "u.s", "u.k", // German
    "z.b", "bzw", "usw", "ca", "nr", "hr", "fr", "str", "d.h", "u.a", // French, Spanish, Italian, Portuguese
    "mme", "mlle", "sra", "sr", "srta", "dña", "sig", "dott", "pág", "p.ex",
];

/// Rows of the talker prompt besides the text tokens, at most (role, codec control rows,
/// speaker and language rows and the closing markers: reference.py `prompt_layout`, module
/// docstring §1). An upper bound used only to size segments.
pub const PROMPT_OVERHEAD_ROWS: usize = 16;

/// The most tokens one character can have: 12. Unicode's NFC turns one code point into at most
/// three (U+1D160 MUSICAL SYMBOL EIGHTH NOTE becomes U+1D158 U+1D165 U+1D16E, 12 UTF-8 bytes;
/// Unicode Standard Annex #15, "Stabilization" and the composition exclusions), and a byte-level
/// BPE token covers at least one byte of the normalized text.
pub const MAX_CHAR_TOKENS: usize = 12;

/// The most text tokens one segment may have so that its whole generation fits in a KV cache
/// of `kv_capacity` positions: the prompt (at most `n + PROMPT_OVERHEAD_ROWS` rows) plus the
/// frame cap `40 + 10 n` ([`crate::prompt::frame_cap`]) must fit, so
/// `n = (kv_capacity - 16 - 40) / 11`, at least [`MAX_CHAR_TOKENS`] (below that a segment could
/// not always be cut; a KV capacity under 188 positions then ends such segments early, as it
/// would any text).
pub fn max_segment_tokens(kv_capacity: usize) -> usize {
    (kv_capacity.saturating_sub(PROMPT_OVERHEAD_ROWS + CAP_BASE_FRAMES) / (CAP_FRAMES_PER_TEXT_TOKEN + 1)).max(MAX_CHAR_TOKENS)
}

/// How long a segment may be, in text tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentLimits {
    /// Sentences are packed into one segment up to this many tokens (a single longer sentence
    /// stays whole up to `max_tokens`).
    pub target_tokens: usize,
    /// No segment has more ([`max_segment_tokens`] of the KV capacity); at least
    /// [`MAX_CHAR_TOKENS`] for the guarantee of the character cut.
    pub max_tokens: usize,
}

impl SegmentLimits {
    /// Limits with the target `target_tokens`, for a KV cache of `kv_capacity` positions; the
    /// target is lowered to the hard limit when it is above it.
    pub fn new(target_tokens: usize, kv_capacity: usize) -> Self {
        let max_tokens = max_segment_tokens(kv_capacity);
        SegmentLimits { target_tokens: target_tokens.clamp(1, max_tokens), max_tokens }
    }
}

/// Cut `text` into segments (byte ranges of `text`, trimmed of white space, never empty) of at
/// most `limits.max_tokens` tokens as counted by `count` (the bundle's tokenizer on the bare
/// text), at the boundaries of the module documentation. A text of only white space gives no
/// segment; a text within `limits.target_tokens` gives one, the trimmed text.
pub fn segments(text: &str, limits: SegmentLimits, count: &mut dyn FnMut(&str) -> usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let whole = trim(text, 0..text.len());
    if whole.is_empty() {
        return out;
    }
    if count(&text[whole.clone()]) <= limits.target_tokens {
        out.push(whole);
        return out;
    }
    for para in paragraphs(text) {
        let mut pieces = Vec::new();
        for sentence in sentences(text, para) {
            let n = count(&text[sentence.clone()]);
            if n <= limits.max_tokens {
                pieces.push((sentence, n));
            } else {
                split_long(text, sentence, limits.max_tokens, count, &mut pieces);
            }
        }
        pack(text, &pieces, limits, count, &mut out);
    }
    out
}

/// Join consecutive pieces (of one paragraph) while the joined text stays within the target.
fn pack(
    text: &str,
    pieces: &[(Range<usize>, usize)],
    limits: SegmentLimits,
    count: &mut dyn FnMut(&str) -> usize,
    out: &mut Vec<Range<usize>>,
) {
    let mut current: Option<(Range<usize>, usize)> = None;
    for (r, n) in pieces {
        current = match current.take() {
            None => Some((r.clone(), *n)),
            Some((c, cn)) => {
                let joined = c.start..r.end;
                // the sum is the estimate; the joined count decides (merges across the seam)
                let jn = if cn + n <= limits.target_tokens { count(&text[joined.clone()]) } else { usize::MAX };
                if jn <= limits.target_tokens {
                    Some((joined, jn))
                } else {
                    out.push(c);
                    Some((r.clone(), *n))
                }
            }
        };
    }
    if let Some((c, _)) = current {
        out.push(c);
    }
}

/// A sentence over `max` tokens: clauses, then words, then byte-bounded character runs.
fn split_long(
    text: &str,
    sentence: Range<usize>,
    max: usize,
    count: &mut dyn FnMut(&str) -> usize,
    pieces: &mut Vec<(Range<usize>, usize)>,
) {
    for clause in split_after(text, sentence, is_clause_end) {
        let n = count(&text[clause.clone()]);
        if n <= max {
            pieces.push((clause, n));
            continue;
        }
        // words, packed up to `max`
        let mut run: Option<Range<usize>> = None;
        for word in words(text, clause) {
            if word.len() > max && count(&text[word.clone()]) > max {
                if let Some(r) = run.take() {
                    fit(text, r, max, count, pieces);
                }
                for part in by_bytes(text, word, max) {
                    fit(text, part, max, count, pieces);
                }
                continue;
            }
            run = Some(match run.take() {
                None => word,
                Some(r) => {
                    let joined = r.start..word.end;
                    // a run of at most `max` bytes is taken without counting, and is counted
                    // when it is pushed (`fit`): normalization can make it more tokens than bytes
                    if joined.len() <= max || count(&text[joined.clone()]) <= max {
                        joined
                    } else {
                        fit(text, r, max, count, pieces);
                        word
                    }
                }
            });
        }
        if let Some(r) = run {
            fit(text, r, max, count, pieces);
        }
    }
}

/// Push `text[r]`, halved at character boundaries until each piece has at most `max` tokens or
/// is one character (the tokenizer's normalization can make a run of `max` bytes more than
/// `max` tokens). A run holds the white space between its words, so a half can begin or end
/// with some: each piece is trimmed, and one of only white space is dropped.
fn fit(text: &str, r: Range<usize>, max: usize, count: &mut dyn FnMut(&str) -> usize, pieces: &mut Vec<(Range<usize>, usize)>) {
    let r = trim(text, r);
    if r.is_empty() {
        return;
    }
    let n = count(&text[r.clone()]);
    let chars = text[r.clone()].char_indices().count();
    if n <= max || chars < 2 {
        pieces.push((r, n));
        return;
    }
    let mid = r.start + text[r.clone()].char_indices().nth(chars / 2).map_or(0, |(i, _)| i);
    fit(text, r.start..mid, max, count, pieces);
    fit(text, mid..r.end, max, count, pieces);
}

/// Trim white space off both ends of `text[r]`.
fn trim(text: &str, r: Range<usize>) -> Range<usize> {
    let s = &text[r.clone()];
    let start = r.start + (s.len() - s.trim_start().len());
    let end = r.end - (s.len() - s.trim_end().len());
    if start >= end { start..start } else { start..end }
}

/// Paragraphs: separated by lines holding only white space; trimmed, non-empty.
fn paragraphs(text: &str) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut line_start = 0;
    for (i, c) in text.char_indices() {
        if c == '\n' {
            let line = &text[line_start..i];
            if line.trim().is_empty() && line_start > start {
                let p = trim(text, start..line_start);
                if !p.is_empty() {
                    out.push(p);
                }
                start = i + 1;
            }
            line_start = i + 1;
        }
    }
    let p = trim(text, start..text.len());
    if !p.is_empty() {
        out.push(p);
    }
    out
}

/// Characters that end a sentence without white space after them (full-width forms).
fn is_full_width_end(c: char) -> bool {
    matches!(c, '。' | '！' | '？' | '．' | '；' | '।' | '؟' | '۔')
}

/// Characters that end a sentence when white space (or the end) follows.
fn is_half_width_end(c: char) -> bool {
    matches!(c, '.' | '!' | '?' | '…' | ';')
}

/// Closing quotes and brackets that belong to the sentence before them.
fn is_closer(c: char) -> bool {
    matches!(c, '"' | '\'' | ')' | ']' | '}' | '”' | '’' | '»' | '›' | '」' | '』' | '）' | '】' | '》' | '〉')
}

/// Characters that end a clause inside a sentence that is too long: a [`split_after`] rule.
fn is_clause_end(text: &str, i: usize, c: char) -> bool {
    match c {
        '，' | '、' | '：' => true,
        ',' | ':' => next_is_space(text, i + c.len_utf8()),
        _ => false,
    }
}

fn next_is_space(text: &str, at: usize) -> bool {
    text[at..].chars().next().is_none_or(char::is_whitespace)
}

/// Whether the `.` at byte `i` follows an abbreviation or a single letter.
fn after_abbreviation(text: &str, i: usize) -> bool {
    let before = &text[..i];
    let word_start = before
        .rfind(|c: char| c.is_whitespace() || c == '(' || c == '"' || c == '“')
        .map_or(0, |p| p + before[p..].chars().next().map_or(1, char::len_utf8));
    let word = &before[word_start..];
    if word.is_empty() {
        return false;
    }
    let mut letters = word.chars().filter(|c| c.is_alphabetic());
    if word.chars().all(char::is_alphabetic) && letters.next().is_some() && letters.next().is_none() {
        return true; // a single letter: an initial
    }
    let lower = word.to_lowercase();
    // "U.S" of "U.S.", "e.g" of "e.g.": dotted abbreviations are in the list with inner dots
    ABBREVIATIONS.contains(&lower.as_str()) || (lower.contains('.') && lower.split('.').all(|p| p.chars().count() <= 1))
}

/// Whether a sentence ends at the terminator `c` at byte `i`.
fn is_sentence_end(text: &str, i: usize, c: char) -> bool {
    if is_full_width_end(c) {
        return true;
    }
    if !is_half_width_end(c) {
        return false;
    }
    // the terminator run and its closers, then white space or the end
    let rest = &text[i + c.len_utf8()..];
    let tail = rest.trim_start_matches(|x: char| is_half_width_end(x) || is_closer(x));
    if !tail.chars().next().is_none_or(char::is_whitespace) {
        return false;
    }
    !(c == '.' && after_abbreviation(text, i))
}

fn sentences(text: &str, para: Range<usize>) -> Vec<Range<usize>> {
    split_after(text, para, is_sentence_end)
}

/// Split `text[r]` after every character for which `rule(text, byte index, char)` holds (the
/// closers and terminators that follow it stay with it); trimmed, non-empty pieces.
fn split_after(text: &str, r: Range<usize>, rule: fn(&str, usize, char) -> bool) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = r.start;
    for end in split_points(text, r.clone(), rule) {
        push_trimmed(text, start..end, &mut out);
        start = end;
    }
    push_trimmed(text, start..r.end, &mut out);
    out
}

/// The byte offsets in `text[r]` just after every character for which `rule` holds, with the
/// closers and terminators that follow it.
fn split_points(text: &str, r: Range<usize>, rule: fn(&str, usize, char) -> bool) -> Vec<usize> {
    let mut points = Vec::new();
    let mut iter = text[r.clone()].char_indices().peekable();
    while let Some((off, c)) = iter.next() {
        let i = r.start + off;
        if !rule(text, i, c) {
            continue;
        }
        let mut end = i + c.len_utf8();
        while let Some(&(o, n)) = iter.peek() {
            if is_closer(n) || is_half_width_end(n) || is_full_width_end(n) {
                end = r.start + o + n.len_utf8();
                iter.next();
            } else {
                break;
            }
        }
        points.push(end);
    }
    points
}

fn push_trimmed(text: &str, r: Range<usize>, out: &mut Vec<Range<usize>>) {
    let piece = trim(text, r);
    if !piece.is_empty() {
        out.push(piece);
    }
}

/// Whether a sentence of a text that is still arriving ends at `c` at byte `i`: at a line
/// break, at a full-width terminator, or at a sentence end of [`segments`]' rules whose
/// terminator run is followed by white space that has already arrived (at the very end, more
/// may follow: the `45.` of `45.6`, the `..` of `...`).
fn is_streamed_sentence_end(text: &str, i: usize, c: char) -> bool {
    if c == '\n' || is_full_width_end(c) {
        return true;
    }
    let rest = &text[i + c.len_utf8()..];
    let tail = rest.trim_start_matches(|x: char| is_half_width_end(x) || is_closer(x));
    !tail.is_empty() && is_sentence_end(text, i, c)
}

/// The sentences completed so far in a text that is still arriving (a request streamed in
/// chunks): their byte ranges (trimmed, never empty), cut by the sentence rules of
/// [`segments`] (never inside `45.6`, after an initial or after an [`ABBREVIATIONS`] entry),
/// where a half-width terminator counts only once white space after it has arrived, and at
/// every line break; and the byte offset where the unfinished rest begins.
pub fn complete_sentences(text: &str) -> (Vec<Range<usize>>, usize) {
    let mut out = Vec::new();
    let mut start = 0;
    for end in split_points(text, 0..text.len(), is_streamed_sentence_end) {
        push_trimmed(text, start..end, &mut out);
        start = end;
    }
    (out, start)
}

/// The white-space separated words of `text[r]`.
fn words(text: &str, r: Range<usize>) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = None;
    for (off, c) in text[r.clone()].char_indices() {
        let i = r.start + off;
        match (c.is_whitespace(), start) {
            (true, Some(s)) => {
                out.push(s..i);
                start = None;
            }
            (false, None) => start = Some(i),
            _ => {}
        }
    }
    if let Some(s) = start {
        out.push(s..r.end);
    }
    out
}

/// `text[r]` in runs of at most `max` bytes (at least one character each), cut at character
/// boundaries.
fn by_bytes(text: &str, r: Range<usize>, max: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = r.start;
    for (off, c) in text[r.clone()].char_indices() {
        let i = r.start + off;
        if i + c.len_utf8() - start > max && i > start {
            out.push(start..i);
            start = i;
        }
    }
    if start < r.end {
        out.push(start..r.end);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Words and punctuation marks as tokens: a stand-in tokenizer for the rules.
    fn count(s: &str) -> usize {
        s.split_whitespace().map(|w| 1 + w.chars().filter(|c| c.is_ascii_punctuation() || !c.is_ascii()).count()).sum()
    }

    fn seg(text: &str, target: usize, max: usize) -> Vec<&str> {
        let limits = SegmentLimits { target_tokens: target, max_tokens: max };
        segments(text, limits, &mut count).into_iter().map(|r| &text[r]).collect()
    }

    #[test]
    fn a_short_text_is_one_segment_untouched() {
        assert_eq!(seg("  Hello there. How are you?  ", 100, 100), ["Hello there. How are you?"]);
        assert!(seg(" \n\t ", 100, 100).is_empty());
    }

    #[test]
    fn sentences_split_but_not_numbers_or_abbreviations() {
        let t = "It costs 45.6 euros, Mr. Smith. See example.com at 3 p.m. today! J. R. R. Tolkien wrote it. \
                 Really?! \"Yes.\" Done";
        assert_eq!(
            seg(t, 1, 100),
            [
                "It costs 45.6 euros, Mr. Smith.",
                "See example.com at 3 p.m. today!",
                "J. R. R. Tolkien wrote it.",
                "Really?!",
                "\"Yes.\"",
                "Done"
            ]
        );
    }

    #[test]
    fn cjk_full_stops_need_no_space() {
        assert_eq!(seg("你好。今天天气很好！你呢？好", 1, 100), ["你好。", "今天天气很好！", "你呢？", "好"]);
    }

    #[test]
    fn sentences_pack_up_to_the_target_and_paragraphs_always_split() {
        let t = "One two. Three four. Five six.\n\nSeven eight.";
        // each sentence is 3 tokens; two fit in 6
        assert_eq!(seg(t, 6, 100), ["One two. Three four.", "Five six.", "Seven eight."]);
        // a single newline is a wrapped line, not a paragraph
        assert_eq!(seg("One two\nthree four. Five six.", 5, 100), ["One two\nthree four.", "Five six."]);
    }

    #[test]
    fn long_sentences_split_at_clauses_then_words_then_bytes() {
        let t = "alpha beta, gamma delta, epsilon zeta eta theta iota kappa.";
        assert_eq!(seg(t, 3, 3), ["alpha beta,", "gamma delta,", "epsilon zeta eta", "theta iota", "kappa."]);
        let cjk = "一二三四五六七八九十";
        let parts = seg(cjk, 1, 7); // 7 bytes: two 3-byte characters
        assert_eq!(parts, ["一二", "三四", "五六", "七八", "九十"]);
    }

    #[test]
    fn segments_cover_every_character_in_order_and_respect_the_limit() {
        let t = "Über 45.6 km, sagte er. Dann: \"Nein!\" 東京は大きい。とても。\n\nA very long line without any \
                 punctuation at all that goes on and on and on and on and on and on";
        for max in [4, 5, 8, 13, 40] {
            let limits = SegmentLimits { target_tokens: max, max_tokens: max };
            let rs = segments(t, limits, &mut count);
            let joined: String = rs.iter().map(|r| &t[r.clone()]).collect::<String>();
            let expect: String = t.chars().filter(|c| !c.is_whitespace()).collect();
            assert_eq!(joined.chars().filter(|c| !c.is_whitespace()).collect::<String>(), expect, "max {max}");
            for w in rs.windows(2) {
                assert!(w[0].end <= w[1].start, "ordered, disjoint");
            }
            for r in &rs {
                let n = count(&t[r.clone()]);
                // a single word over `max` bytes is cut by bytes, which bounds real BPE tokens;
                // the stand-in counts it as one or more words
                assert!(n <= max || t[r.clone()].len() <= max, "{:?} has {n} > {max}", &t[r.clone()]);
            }
        }
    }

    #[test]
    fn a_character_run_is_halved_when_normalization_makes_it_more_tokens_than_bytes() {
        // a stand-in for an NFC byte-level tokenizer: U+0344 (2 bytes) normalizes to U+0308
        // U+0301 (4 bytes), one token a byte; the fuzz target's crash had this
        let mut nfc_bytes = |s: &str| s.len() + 2 * s.matches('\u{344}').count();
        let text = "\u{344}".repeat(40) + "Q\0" + &"\u{344}".repeat(7);
        let max = MAX_CHAR_TOKENS;
        let limits = SegmentLimits { target_tokens: max, max_tokens: max };
        let ranges = segments(&text, limits, &mut nfc_bytes);
        for r in &ranges {
            assert!(nfc_bytes(&text[r.clone()]) <= max, "{:?}: {} tokens", &text[r.clone()], nfc_bytes(&text[r.clone()]));
        }
        let kept: String = ranges.iter().map(|r| &text[r.clone()]).collect();
        assert_eq!(kept, text);
        // the byte cut alone gives 12-byte runs of 6 characters, 24 "tokens": each is halved
        assert!(ranges.len() >= 8, "{}", ranges.len());
    }

    #[test]
    fn a_run_of_words_within_the_byte_limit_is_halved_when_it_has_more_tokens() {
        // the fuzz target's second crash (2026-12-07, fuzz/regressions/prompt): a word of 12
        // bytes, within the limit by bytes, with U+0344 that NFC makes 4 bytes: 14 "tokens" of
        // the stand-in, 13 of the real tokenizer, over the limit 12; it was pushed uncounted
        let mut nfc_bytes = |s: &str| s.len() + 2 * s.matches('\u{344}').count();
        let text = "Some words before it, and a long clause without any end \u{344}Q\09999999\0 then more words after";
        let max = MAX_CHAR_TOKENS;
        let limits = SegmentLimits { target_tokens: max, max_tokens: max };
        let ranges = segments(text, limits, &mut nfc_bytes);
        for r in &ranges {
            assert!(nfc_bytes(&text[r.clone()]) <= max, "{:?}: {} tokens", &text[r.clone()], nfc_bytes(&text[r.clone()]));
        }
        let kept: String = ranges.iter().flat_map(|r| text[r.clone()].chars()).filter(|c| !c.is_whitespace()).collect();
        assert_eq!(kept, text.chars().filter(|c| !c.is_whitespace()).collect::<String>());
    }

    #[test]
    fn the_halves_of_a_run_are_trimmed() {
        // the start of the fuzz target's third crash (2026-12-07, fuzz/regressions/prompt): the
        // run "\u{344}Q\099\n\u{344}Q\0\0", 12 bytes and 16 "tokens" of the stand-in, was halved
        // at its line break, and the second half began with it
        let mut nfc_bytes = |s: &str| s.len() + 2 * s.matches('\u{344}').count();
        let text = "\0\rQ\n\n\u{344}Q\099\n\u{344}Q\0\0 <\0\0\0\0\0\0\0rd\u{2026}ally?ially.\r\nThen more words";
        let max = MAX_CHAR_TOKENS;
        let limits = SegmentLimits { target_tokens: 1, max_tokens: max };
        let ranges = segments(text, limits, &mut nfc_bytes);
        assert!(!ranges.is_empty());
        for r in &ranges {
            let s = &text[r.clone()];
            assert!(!s.is_empty() && s == s.trim(), "{s:?} is not trimmed");
            assert!(nfc_bytes(s) <= max, "{s:?}: {} tokens", nfc_bytes(s));
        }
        let kept: String = ranges.iter().flat_map(|r| text[r.clone()].chars()).filter(|c| !c.is_whitespace()).collect();
        assert_eq!(kept, text.chars().filter(|c| !c.is_whitespace()).collect::<String>());
    }

    #[test]
    fn the_hard_limit_follows_the_kv_capacity() {
        assert_eq!(max_segment_tokens(4096), (4096 - 56) / 11);
        assert_eq!(max_segment_tokens(0), MAX_CHAR_TOKENS);
        let l = SegmentLimits::new(10_000, 4096);
        assert_eq!(l.target_tokens, l.max_tokens);
        // n tokens: prompt rows (n + 16) + frame cap (40 + 10 n) fit
        let n = max_segment_tokens(4096);
        assert!(n + 16 + 40 + 10 * n <= 4096 && (n + 1) + 16 + 40 + 10 * (n + 1) > 4096);
    }
}
