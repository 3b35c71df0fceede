//! Inline pause tags (issue 39): `[pause]`, `[pause:0.8s]`, `[pause:800ms]` anywhere in a text
//! become that much digital silence between the words around them (the service's job plan,
//! `service::speaker::plan`).
//!
//! Grammar, case-insensitive, white space allowed inside the brackets:
//! `[` `pause` ( `:` NUMBER ( `ms` | `s` ) )? `]`, NUMBER a decimal (`800`, `0.8`, `.5`).
//! `[pause]` alone is [`DEFAULT_PAUSE`]; a longer pause than [`MAX_PAUSE`] is clamped to it (a
//! sleeping speaker is a different feature). Something that opens like a tag (`[pause` followed
//! by neither a letter or digit nor white space and a word) and does not parse (`[pause:]`, `[pause:2]`,
//! `[pause:fast]`, `[pause 2s]`, `[pause:-1s]`) is *malformed*: in the default lenient mode it
//! is read as text, as it was before tags existed; in strict mode it is an error naming it.
//! `[pauses]`, `[paused]` and `[Pause for thought]`… are not tags at all.

use std::ops::Range;
use std::time::Duration;

/// The pause of a bare `[pause]`: 500 ms, about a comma and a breath (Kokoro-FastAPI's and
/// SSML's `break` defaults are of this order; chosen here).
pub const DEFAULT_PAUSE: Duration = Duration::from_millis(500);

/// The longest pause one tag gives: 10 s. Longer values are clamped to it.
pub const MAX_PAUSE: Duration = Duration::from_secs(10);

/// The longest text between `[` and `]` looked at as a tag (`pause : 10000.000 ms` fits).
const MAX_TAG_CHARS: usize = 32;

/// One tag found in a text.
#[derive(Debug, Clone, PartialEq)]
pub struct Tag {
    /// Byte range of the tag in the text, brackets included.
    pub range: Range<usize>,
    /// What it says.
    pub kind: TagKind,
}

/// What a [`Tag`] says.
#[derive(Debug, Clone, PartialEq)]
pub enum TagKind {
    /// A well-formed tag: this much silence (clamped to [`MAX_PAUSE`]).
    Pause {
        /// The silence.
        duration: Duration,
        /// The tag asked for more than [`MAX_PAUSE`].
        clamped: bool,
    },
    /// A tag that does not parse, and why (for strict mode's error).
    Malformed {
        /// What is wrong with it, e.g. "a duration needs a unit: ms or s".
        reason: &'static str,
    },
}

/// The pause tags of `text`, in order, well-formed and malformed. Never fails.
pub fn tags(text: &str) -> Vec<Tag> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(off) = text[from..].find('[') {
        let open = from + off;
        from = open + 1;
        // the closing bracket, within MAX_TAG_CHARS and before any other `[`
        let rest = &text[open + 1..];
        let Some((len, _)) = rest.char_indices().take(MAX_TAG_CHARS + 1).take_while(|&(_, c)| c != '[').find(|&(_, c)| c == ']')
        else {
            continue;
        };
        let inner = rest[..len].trim();
        let Some(kind) = parse(inner) else { continue };
        let end = open + 1 + len + 1;
        out.push(Tag { range: open..end, kind });
        from = end;
    }
    out
}

/// The tag of the text between the brackets: `None` when it is not a pause tag at all.
fn parse(inner: &str) -> Option<TagKind> {
    let head = inner.get(..5)?;
    if !head.eq_ignore_ascii_case("pause") {
        return None;
    }
    let after = &inner[5..];
    if after.chars().next().is_some_and(char::is_alphanumeric) {
        return None; // [pauses], [paused], [pause2]
    }
    let after = after.trim_start();
    if after.chars().next().is_some_and(char::is_alphabetic) {
        return None; // [pause for thought]: words, not a tag
    }
    if after.is_empty() {
        return Some(TagKind::Pause { duration: DEFAULT_PAUSE, clamped: false });
    }
    let Some(value) = after.strip_prefix(':') else {
        return Some(TagKind::Malformed { reason: "a duration follows a colon: [pause:0.8s] or [pause:800ms]" });
    };
    let value = value.trim();
    let split = value.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(value.len());
    let (number, unit) = (&value[..split], value[split..].trim());
    if number.is_empty() {
        return Some(TagKind::Malformed { reason: "the duration is not a number of seconds or milliseconds" });
    }
    let Ok(amount) = number.parse::<f64>() else {
        return Some(TagKind::Malformed { reason: "the duration is not a number of seconds or milliseconds" });
    };
    let seconds = if unit.eq_ignore_ascii_case("ms") {
        amount / 1e3
    } else if unit.eq_ignore_ascii_case("s") {
        amount
    } else if unit.is_empty() {
        return Some(TagKind::Malformed { reason: "a duration needs a unit: ms or s" });
    } else {
        return Some(TagKind::Malformed { reason: "the unit is neither ms nor s" });
    };
    let max = MAX_PAUSE.as_secs_f64();
    // a number of only digits and dots always parses to a finite value >= 0
    let clamped = seconds > max;
    Some(TagKind::Pause { duration: Duration::from_secs_f64(seconds.min(max)), clamped })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pause(ms: u64) -> TagKind {
        TagKind::Pause { duration: Duration::from_millis(ms), clamped: false }
    }

    fn kinds(text: &str) -> Vec<(&str, TagKind)> {
        tags(text).into_iter().map(|t| (&text[t.range.clone()], t.kind)).collect()
    }

    #[test]
    fn well_formed_tags_give_their_duration() {
        assert_eq!(kinds("a [pause] b"), [("[pause]", pause(500))]);
        assert_eq!(kinds("a [pause:0.8s] b"), [("[pause:0.8s]", pause(800))]);
        assert_eq!(kinds("a [pause:800ms] b"), [("[pause:800ms]", pause(800))]);
        assert_eq!(kinds("[PAUSE : 1.5 S]x"), [("[PAUSE : 1.5 S]", pause(1500))]);
        assert_eq!(kinds("[ pause:.25s ]"), [("[ pause:.25s ]", pause(250))]);
        assert_eq!(kinds("[pause:0ms]"), [("[pause:0ms]", pause(0))]);
        assert_eq!(kinds("x[pause][pause:2s]y"), [("[pause]", pause(500)), ("[pause:2s]", pause(2000))]);
    }

    #[test]
    fn a_pause_over_the_maximum_is_clamped() {
        let long = TagKind::Pause { duration: MAX_PAUSE, clamped: true };
        assert_eq!(kinds("[pause:60s]"), [("[pause:60s]", long.clone())]);
        assert_eq!(kinds("[pause:10001ms]"), [("[pause:10001ms]", long)]);
        assert_eq!(kinds("[pause:10s]"), [("[pause:10s]", pause(10_000))]);
    }

    #[test]
    fn malformed_tags_are_found_with_a_reason() {
        for t in
            ["[pause:]", "[pause:2]", "[pause:fast]", "[pause 2s]", "[pause:-1s]", "[pause:1.2.3s]", "[pause:2 min]", "[pause-2s]"]
        {
            let k = kinds(t);
            assert_eq!(k.len(), 1, "{t}: {k:?}");
            assert!(matches!(k[0].1, TagKind::Malformed { .. }), "{t}: {k:?}");
            assert_eq!(k[0].0, t);
        }
    }

    #[test]
    fn other_brackets_are_not_tags() {
        for t in [
            "[pauses]",
            "[paused]",
            "[pause2s]",
            "[Pause for thought]",
            "[pause and think]",
            "[note]",
            "[x](y)",
            "[pause",
            "pause]",
            "[[pause",
        ] {
            assert_eq!(kinds(t), [], "{t}");
        }
        // a `[` inside: only the inner one can be a tag
        assert_eq!(kinds("[a [pause] b]"), [("[pause]", pause(500))]);
        // multibyte text around and inside
        assert_eq!(kinds("你好[pause:1s]世界"), [("[pause:1s]", pause(1000))]);
        assert_eq!(kinds("[pause:１s]").len(), 1, "a full-width digit is malformed, not a crash");
    }
}
