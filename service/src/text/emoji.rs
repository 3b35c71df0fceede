//! Emoji and pictographs out of a text (`text.emoji = "remove"`).
//!
//! The text is walked by extended grapheme clusters (UAX #29, `unicode-segmentation`), so an
//! emoji sequence goes as one piece: a ZWJ sequence (👨‍👩‍👧), a skin tone (👍🏽), a flag (two
//! regional indicators, 🇳🇴), a keycap (1️⃣), a tag sequence (🏴 with U+E0020–E007F tags) and
//! the variation selectors. A cluster goes when its first character is a pictograph
//! ([`is_pictograph`]) or it is a keycap; otherwise only stray emoji components are taken out of
//! it (a variation selector, a skin tone or a tag after a letter), so that letters, digits,
//! `#` and `*` (which Unicode also counts as emoji characters) and the zero width joiner of
//! Indic and Persian text stay.
//!
//! What was removed becomes a space between two words of a spaced script (`Hi😀there` → `Hi
//! there`) and nothing next to white space or CJK text (`晴天☀️，` → `晴天，`).

use unicode_properties::emoji::UnicodeEmoji;
use unicode_segmentation::UnicodeSegmentation;

/// Emoji characters that are kept as text: the copyright, registered and trade mark signs, and
/// `‼` `⁉` (read as punctuation, [`super::normalize::tidy`]).
const TEXT_SYMBOLS: &[char] = &['©', '®', '™', '‼', '⁉'];

/// Whether `c` is a pictograph: a non-ASCII `Emoji=Yes` character (Unicode's emoji data, through
/// `unicode-properties`) other than [`TEXT_SYMBOLS`], or a character of the blocks made of
/// pictographs and symbols used as such: Miscellaneous Symbols and Dingbats (U+2600–27BF,
/// ☀ ★ ✓ ❶), Geometric Shapes (U+25A0–25FF, ■ ● ▶, bullets and icons) and U+1F000–1FAFF
/// (mahjong and playing cards, enclosed alphanumerics, regional indicators, pictographs,
/// emoticons, transport, skin tones, supplemental symbols).
pub fn is_pictograph(c: char) -> bool {
    matches!(c, '\u{2600}'..='\u{27BF}' | '\u{25A0}'..='\u{25FF}' | '\u{1F000}'..='\u{1FAFF}')
        || (!c.is_ascii() && c.is_emoji_char() && !TEXT_SYMBOLS.contains(&c))
}

/// Emoji components that mean nothing on their own: variation selectors 15 and 16, the keycap
/// mark, skin tones (Fitzpatrick modifiers) and tag characters.
fn is_stray_component(c: char) -> bool {
    matches!(c, '\u{FE0E}' | '\u{FE0F}' | '\u{20E3}' | '\u{1F3FB}'..='\u{1F3FF}' | '\u{E0020}'..='\u{E007F}')
}

/// Whether `c` belongs to a script written without spaces between words (Han, kana, and the
/// full-width punctuation and forms of CJK text): no space is put next to it.
pub fn is_cjk(c: char) -> bool {
    matches!(c,
        '\u{2E80}'..='\u{2FDF}'     // CJK radicals, Kangxi radicals
        | '\u{3000}'..='\u{30FF}'   // CJK symbols and punctuation, hiragana, katakana
        | '\u{3400}'..='\u{4DBF}'   // CJK extension A
        | '\u{4E00}'..='\u{9FFF}'   // CJK unified ideographs
        | '\u{F900}'..='\u{FAFF}'   // CJK compatibility ideographs
        | '\u{FF00}'..='\u{FFEF}'   // half-width and full-width forms
        | '\u{20000}'..='\u{3134F}' // CJK extensions B–H
    )
}

/// `text` without its emoji and pictographs (see the [module](self) docs).
pub fn remove(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    // a removed cluster waits here until the next kept one says whether a space goes in
    let mut gap = false;
    for g in text.graphemes(true) {
        let first = g.chars().next().unwrap_or(' ');
        if is_pictograph(first) || g.contains('\u{20E3}') || is_stray_component(first) {
            gap = true;
            continue;
        }
        let next = first;
        if gap {
            gap = false;
            let prev = out.chars().next_back();
            let spaced = |c: char| !c.is_whitespace() && !is_cjk(c);
            if prev.is_some_and(spaced) && spaced(next) {
                out.push(' ');
            }
        }
        if g.chars().any(is_stray_component) {
            out.extend(g.chars().filter(|&c| !is_stray_component(c)));
        } else {
            out.push_str(g);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emoji_of_every_kind_go() {
        let cases = [
            ("Sunny ☀️ and warm", "Sunny  and warm"),
            ("Family 👨‍👩‍👧‍👦 night", "Family  night"),
            ("Thumbs 👍🏽 up", "Thumbs  up"),
            ("Flag 🇳🇴 here", "Flag  here"),
            ("Scotland 🏴\u{E0067}\u{E0062}\u{E0073}\u{E0063}\u{E0074}\u{E007F} wins", "Scotland  wins"),
            ("1️⃣ First step", " First step"),
            ("Done ✅", "Done "),
            ("Stars: ★★★★☆", "Stars: "),
            ("Hi😀there", "Hi there"),
            ("Great!🎉", "Great!"),
            ("🔥🔥🔥", ""),
            ("Heart ❤ plain, ❤️ emoji", "Heart  plain,  emoji"),
            ("▶ Play ■ stop", " Play  stop"),
        ];
        for (input, want) in cases {
            assert_eq!(remove(input), want, "{input:?}");
        }
    }

    #[test]
    fn text_that_unicode_counts_as_emoji_stays() {
        for s in [
            "Call 911 or press # and * then 0.",
            "© 2024 Acme™ and ® marks",
            "Wait‼ What⁉",
            "20 °C, 5 % more, → next",
            // Devanagari and Malayalam conjuncts with the zero width joiner/non-joiner
            "क्‍ष and ന്‍",
            "می‌خواهم",
        ] {
            assert_eq!(remove(s), s);
        }
    }

    #[test]
    fn stray_components_after_letters_go_alone() {
        assert_eq!(remove("a\u{FE0F}b"), "ab");
        assert_eq!(remove("x\u{1F3FD}y"), "xy");
    }

    #[test]
    fn no_space_is_added_in_cjk_text() {
        assert_eq!(remove("今天晴天☀️，气温二十五度🌡️。"), "今天晴天，气温二十五度。");
        assert_eq!(remove("いい天気ですね😊"), "いい天気ですね");
        assert_eq!(remove("Go🚀中文"), "Go中文");
    }
}
