//! URLs and e-mail addresses (`text.urls`), then white space and punctuation, so that what is
//! left reads well and the segmenter ([`engine::segment`]) still finds its sentences.

use std::sync::LazyLock;

use regex::{Captures, Regex};

use super::{Urls, own_regex};

/// A URL (`http`, `https`, `ftp` or `www.`…) or an e-mail address (with an optional `mailto:`).
/// A URL runs to the next white space, quote or angle bracket; what it ends with is trimmed off
/// by [`url_end`].
const LINK: &str =
    r"(?i)\b(?:(?:https?|ftp)://|www\.)[^\s<>'`]+|(?:\bmailto:)?\b[a-z0-9._%+-]+@[a-z0-9-]+(?:\.[a-z0-9-]+)*\.[a-z]{2,}\b";

static LINKS: LazyLock<Option<Regex>> = LazyLock::new(|| own_regex(LINK));

/// Where a URL matched as `candidate` really ends: sentence punctuation, quotes and an
/// unbalanced closing bracket at its end belong to the text around it (`(see
/// https://x.org/a_(b))` keeps `a_(b)`).
fn url_end(candidate: &str) -> usize {
    let mut end = candidate.len();
    loop {
        let s = &candidate[..end];
        let Some(last) = s.chars().next_back() else { return end };
        let drop = match last {
            '.' | ',' | ';' | ':' | '!' | '?' | '"' | '\'' | '»' | '”' | '’' | '。' | '，' | '、' | '！' | '？' | '）' | '」' => {
                true
            }
            ')' => s.matches('(').count() < s.matches(')').count(),
            ']' => s.matches('[').count() < s.matches(']').count(),
            _ => false,
        };
        if !drop {
            return end;
        }
        end -= last.len_utf8();
    }
}

/// The host of `url`, lower-case, without `www.`, a user or a port: what `urls = "host"` reads.
pub fn host(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or(rest);
    let authority = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let host = match authority.strip_prefix('[') {
        // an IPv6 literal keeps its colons
        Some(v6) => v6.split(']').next().unwrap_or(v6),
        None => authority.split(':').next().unwrap_or(authority),
    };
    let host = host.to_lowercase();
    match host.strip_prefix("www.") {
        Some(h) if !h.is_empty() => h.to_owned(),
        _ => host,
    }
}

/// `text` with its URLs and e-mail addresses as `mode` says: `host` reads a URL as its host
/// ([`host`]) and an address `name@example.com` as `name at example.com`; `skip` leaves both
/// out; `keep` leaves them.
pub fn urls(text: &str, mode: Urls) -> String {
    let Some(links) = LINKS.as_ref().filter(|_| mode != Urls::Keep) else { return text.to_owned() };
    links
        .replace_all(text, |c: &Captures<'_>| {
            let m = &c[0];
            let is_url = m.contains("://") || m.get(..4).is_some_and(|p| p.eq_ignore_ascii_case("www."));
            if is_url {
                let end = url_end(m);
                let (url, tail) = m.split_at(end);
                match mode {
                    Urls::Host => format!("{}{tail}", host(url)),
                    _ => tail.to_owned(),
                }
            } else {
                let address = m.get(..7).filter(|p| p.eq_ignore_ascii_case("mailto:")).map_or(m, |_| &m[7..]);
                match (mode, address.rsplit_once('@')) {
                    (Urls::Host, Some((name, domain))) => format!("{name} at {}", domain.to_lowercase()),
                    (Urls::Host, None) => address.to_owned(),
                    _ => String::new(),
                }
            }
        })
        .into_owned()
}

/// One rule of [`tidy`]: a pattern and what it becomes.
struct Tidy {
    re: Regex,
    with: &'static str,
}

/// The rules of [`tidy`], in order.
static TIDY: LazyLock<Vec<Tidy>> = LazyLock::new(|| {
    [
        // invisible: zero width space, word joiner, byte order mark, soft hyphen (the zero
        // width joiner and non-joiner stay: Indic and Persian text need them)
        (r"[\u{200B}\u{2060}\u{FEFF}\u{00AD}]", ""),
        // the emoji forms of `!!` and `!?` that stayed, as punctuation
        (r"‼", "!"),
        (r"[⁉⁈⁇]", "?"),
        // separator lines and runs: ---, ***, ===, ___, ~~~, ###
        (r"[-_=*~#]{3,}", " "),
        // repeated punctuation
        (r"[!?]*\?[!?]*\?[!?]*|[!?]*![!?]*\?[!?]*|[!?]*\?[!?]*![!?]*", "?"),
        (r"!{2,}", "!"),
        (r"[！？]*？[！？]*[！？]+|[！]+？[！？]*", "？"),
        (r"！{2,}", "！"),
        (r"(?:\.{3,}|…)[.…]*", "…"),
        (r"。{2,}", "。"),
        (r",{2,}", ","),
        (r";{2,}", ";"),
        (r"，{2,}", "，"),
        (r"、{2,}", "、"),
        // brackets left empty (a link or code taken out of them)
        (r"\(\s*\)|\[\s*\]|（\s*）", " "),
        // white space: runs of blanks in a line, blanks at the ends of lines, blank lines
        (r"[^\S\n]+", " "),
        (r"(?m)^ | $", ""),
        (r"\n{3,}", "\n\n"),
        // no blank before punctuation that ends a clause or sentence
        (r" ([,.;:!?…])(\s|$)", "$1$2"),
        (r" ?([，。！？、；：）」』】]) ?", "$1"),
        (r" ?([（「『【]) ?", "$1"),
    ]
    .into_iter()
    .filter_map(|(p, with)| Some(Tidy { re: own_regex(p)?, with }))
    .collect()
});

/// Bullets that start a line of plain text: `•` `◦` `‣` `∙` `·` `▪` `▫`.
const BULLETS: &[char] = &['•', '◦', '‣', '∙', '·', '▪', '▫'];

/// `text` with the bullet at the start of a line removed and that line ended as a sentence,
/// like a markdown list item.
fn bullets(text: &str) -> String {
    if !text.contains(BULLETS) {
        return text.to_owned();
    }
    let mut out = Vec::new();
    for line in text.split('\n') {
        let t = line.trim_start();
        match t.strip_prefix(BULLETS).filter(|rest| rest.starts_with([' ', '\t'])) {
            Some(item) => {
                let mut item = item.trim().to_owned();
                super::markdown::end_sentence(&mut item, super::markdown::Kind::Sentence);
                out.push(item);
            }
            None => out.push(line.to_owned()),
        }
    }
    out.join("\n")
}

/// `text` with its white space and punctuation tidied, trimmed:
/// - zero width spaces, word joiners, byte order marks and soft hyphens removed;
/// - `‼` as `!`, `⁉` `⁈` `⁇` as `?`;
/// - a bullet (`•` `◦` `‣` `∙` `·` `▪` `▫`) at the start of a line removed, the line ended as
///   a sentence (a list item);
/// - runs of three or more `-` `_` `=` `*` `~` `#` (separators) removed;
/// - repeated punctuation once: `!!!` → `!`, `?!?` → `?`, `...` / `....` / `……` → `…`,
///   `,,` → `,`, and the same for `；` `。` `，` `、` `！` `？`;
/// - brackets left empty removed;
/// - runs of blanks (spaces, tabs, no-break and ideographic spaces) as one space, lines
///   trimmed, no more than one blank line in a row (a paragraph break for the segmenter);
/// - no blank before `,` `.` `;` `:` `!` `?` `…` that a blank or the end follows, nor around
///   full-width punctuation.
pub fn tidy(text: &str) -> String {
    let mut s = bullets(text);
    for rule in TIDY.iter() {
        if let std::borrow::Cow::Owned(t) = rule.re.replace_all(&s, rule.with) {
            s = t;
        }
    }
    s.trim().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_patterns_compile() {
        assert!(LINKS.is_some());
        assert_eq!(TIDY.len(), 21, "every tidy rule compiled");
    }

    #[test]
    fn a_url_is_read_as_its_host() {
        let cases = [
            ("See https://www.home-assistant.io/docs/voice/ for more.", "See home-assistant.io for more."),
            ("Go to http://192.168.1.10:8123/lovelace.", "Go to 192.168.1.10."),
            ("(see https://en.wikipedia.org/wiki/Rust_(programming_language))", "(see en.wikipedia.org)"),
            ("Open www.Example.com/a?b=1, then", "Open example.com, then"),
            ("ftp://user:pw@files.example.net:21/x", "files.example.net"),
            ("http://[::1]:8080/", "::1"),
            ("«https://example.org»", "«example.org»"),
        ];
        for (input, want) in cases {
            assert_eq!(urls(input, Urls::Host), want, "{input:?}");
        }
    }

    #[test]
    fn an_address_is_read_as_name_at_host() {
        assert_eq!(urls("Write to support@Example.COM.", Urls::Host), "Write to support at example.com.");
        assert_eq!(urls("mailto:jane.doe+ha@mail.example.org", Urls::Host), "jane.doe+ha at mail.example.org");
    }

    #[test]
    fn skip_and_keep() {
        let t = "Mail a@b.co or see https://x.org/p.";
        assert_eq!(urls(t, Urls::Skip), "Mail  or see .");
        assert_eq!(urls(t, Urls::Keep), t);
        assert_eq!(tidy(&urls(t, Urls::Skip)), "Mail or see.");
    }

    #[test]
    fn what_is_not_a_url_stays() {
        for s in ["Version 1.2.3 of example.com is out.", "It costs 3.50 €.", "user@localhost says hi", "a@b"] {
            assert_eq!(urls(s, Urls::Host), s);
        }
    }

    #[test]
    fn repeated_punctuation_once() {
        let cases = [
            ("Wow!!!", "Wow!"),
            ("Really??", "Really?"),
            ("What?!", "What?"),
            ("No!?!", "No?"),
            ("Wait....", "Wait…"),
            ("Hmm... ok", "Hmm… ok"),
            ("So……", "So…"),
            ("a,, b;; c", "a, b; c"),
            ("真的！！！", "真的！"),
            ("什么？？", "什么？"),
            ("好。。。", "好。"),
            ("Wait‼ What⁉", "Wait! What?"),
            ("3.14 and 1.5", "3.14 and 1.5"),
        ];
        for (input, want) in cases {
            assert_eq!(tidy(input), want, "{input:?}");
        }
    }

    #[test]
    fn white_space_is_tidied_and_paragraphs_stay() {
        assert_eq!(tidy("  a \t b\u{a0}c  \n\n\n\n  d  "), "a b c\n\nd");
        assert_eq!(tidy("one\ntwo"), "one\ntwo");
        assert_eq!(tidy("Hello , world !"), "Hello, world!");
        assert_eq!(tidy("Costs .5 units"), "Costs .5 units");
        assert_eq!(tidy("你好 ， 世界 。 Next"), "你好，世界。Next");
        assert_eq!(tidy("zero\u{200B}width\u{FEFF} soft\u{AD}hyphen"), "zerowidth softhyphen");
        assert_eq!(tidy("Open the page ( ) now"), "Open the page now");
    }

    #[test]
    fn separators_and_bullets_go() {
        assert_eq!(tidy("Title\n-----\n• first\n• second!\n====="), "Title\n\nfirst.\nsecond!");
        assert_eq!(tidy("•no blank after it"), "•no blank after it");
        assert_eq!(tidy("a - b -- c"), "a - b -- c");
        assert_eq!(tidy("C# and F#"), "C# and F#");
    }
}
