//! The text front-end: what a client sent, made into what a person would read aloud, before any
//! front-end builds its [`Request`](engine::Request) ([`crate::Voice::request`], so the FIFO,
//! Wyoming, HTTP and `herald speak` all get it).
//!
//! Language models answer in markdown, with emoji and links; read as they are, a voice says the
//! asterisks, hashes and URLs. [`spoken`] runs these steps, in order (docs/config.md "The text
//! front-end" is the user's description):
//!
//! 1. line endings and control characters as the engine cleans them
//!    ([`engine::prompt::clean_text`]);
//! 2. **emoji and pictographs** removed ([`Emoji`], [`emoji`]): whole grapheme clusters, so ZWJ
//!    sequences, skin tones, flags, keycaps and tag sequences go at once;
//! 3. **markdown** reduced to its spoken text ([`Markdown`], [`markdown`]): headings, list items
//!    and table rows become sentences, links their text, images and HTML tags nothing, code
//!    skipped or read ([`Code`]);
//! 4. **URLs and e-mail addresses** ([`Urls`], [`normalize::urls`]);
//! 5. **white space and repeated punctuation** normalised ([`normalize::tidy`]), so that the
//!    segmenter ([`engine::segment`]) still finds the sentences;
//! 6. the user's **replacement rules** ([`Replacements`], [`replace`]), in file order.
//!
//! [`spoken`] is infallible: the only thing that can fail, the replacement file, is read and
//! checked once, at start-up ([`Replacements::load`]).

pub mod emoji;
pub mod markdown;
pub mod normalize;
pub mod replace;

use std::sync::Arc;

pub use replace::{Replacements, TextError};

/// Whether the text is read as markdown (`text.markdown`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Markdown {
    /// As markdown only when it shows markdown's signs ([`markdown::looks_like_markdown`]).
    #[default]
    Auto,
    /// Always as markdown.
    On,
    /// Never: the text is read as it is (the other steps still apply).
    Off,
}

/// What happens to emoji and pictographs (`text.emoji`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Emoji {
    /// Removed ([`emoji::remove`]).
    #[default]
    Remove,
    /// Left for the model.
    Keep,
}

/// What happens to markdown's code, fenced and inline (`text.code`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Code {
    /// Left out.
    #[default]
    Skip,
    /// Read as text.
    Read,
}

/// What happens to URLs and e-mail addresses (`text.urls`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Urls {
    /// A URL is read as its host (`https://www.example.com/a?b` → `example.com`); an e-mail
    /// address as `name at example.com`.
    #[default]
    Host,
    /// Both left out.
    Skip,
    /// Both read as they are.
    Keep,
}

/// How [`spoken`] treats a text. The default is the configuration's: markdown `auto`, emoji
/// removed, code skipped, URLs as their host, no replacement rules.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TextOptions {
    /// `text.markdown`.
    pub markdown: Markdown,
    /// `text.emoji`.
    pub emoji: Emoji,
    /// `text.code`.
    pub code: Code,
    /// `text.urls`.
    pub urls: Urls,
    /// `text.replacements`: the rules of the file, loaded at start-up; `None`: no rules.
    pub replacements: Option<Arc<Replacements>>,
}

impl TextOptions {
    /// Options that leave a text as the engine would take it, but for the line endings and
    /// controls (no markdown, emoji kept, URLs kept, white space and punctuation tidied).
    pub fn verbatim() -> Self {
        TextOptions { markdown: Markdown::Off, emoji: Emoji::Keep, code: Code::Read, urls: Urls::Keep, replacements: None }
    }
}

/// A regex of the code's own, from a constant pattern: `None` only for an invalid pattern,
/// which the unit tests rule out (each module's `own_patterns_compile`); a rule whose regex is
/// missing does nothing rather than panic.
fn own_regex(pattern: &str) -> Option<regex::Regex> {
    regex::Regex::new(pattern).ok()
}

/// `input` as it is to be spoken under `opts` (the steps of the [module](self) docs). May be
/// empty (a text of only emoji, only code): the caller refuses it as having nothing to say.
pub fn spoken(input: &str, opts: &TextOptions) -> String {
    let text = engine::prompt::clean_text(input);
    let text = match opts.emoji {
        Emoji::Remove => emoji::remove(&text),
        Emoji::Keep => text.into_owned(),
    };
    let is_markdown = match opts.markdown {
        Markdown::On => true,
        Markdown::Off => false,
        Markdown::Auto => markdown::looks_like_markdown(&text),
    };
    let text = if is_markdown { markdown::to_spoken(&text, opts.code) } else { text };
    let text = normalize::urls(&text, opts.urls);
    let text = normalize::tidy(&text);
    match &opts.replacements {
        Some(r) => r.apply(&text).trim().to_owned(),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn default(s: &str) -> String {
        spoken(s, &TextOptions::default())
    }

    #[test]
    fn pause_tags_pass_through_plain_text_and_markdown() {
        assert_eq!(default("Hello [pause:0.8s] world."), "Hello [pause:0.8s] world.");
        assert_eq!(default("**Hello** [pause] world, [pause:800ms] *again*."), "Hello [pause] world, [pause:800ms] again.");
        assert_eq!(default("# Title\n\n- one [pause:1s]\n- two"), "Title.\n\none [pause:1s].\ntwo.");
    }

    #[test]
    fn plain_text_is_left_as_it_is() {
        for s in ["Hello, world.", "The kitchen light is on. It is 21.5 °C inside.", "你好，世界。", "Mr. Smith arrives at 3 p.m."]
        {
            assert_eq!(default(s), s);
        }
    }

    #[test]
    fn the_steps_work_together() {
        let md = "## Weather ☀️\n\n- **Today**: sunny, 24 °C 🌞\n- Details: https://www.met.no/en/forecast?id=1\n";
        assert_eq!(default(md), "Weather.\n\nToday: sunny, 24 °C.\nDetails: met.no.");
        let verbatim = spoken(md, &TextOptions::verbatim());
        assert_eq!(verbatim, "## Weather ☀️\n\n- **Today**: sunny, 24 °C 🌞\n- Details: https://www.met.no/en/forecast?id=1");
    }

    #[test]
    fn only_emoji_or_only_code_leaves_nothing() {
        assert_eq!(default("🎉🎉🎉"), "");
        assert_eq!(default("```\nls -la\n```"), "");
        assert_eq!(default("  \n "), "");
    }
}
