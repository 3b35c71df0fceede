//! Text → prompt layout: the chat wrapping, tokenization and the dual-track (text, codec) rows
//! of the talker prefill, exactly as reference.py's `Reference.prompt_layout` (module docstring
//! §1; upstream `generate` L2134-2233, wrapper L269-276).
//!
//! The text is chat-wrapped as `<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n`
//! and tokenized with the bundle's `tokenizer.json` (no added special tokens). The ids are
//! sliced by fixed counts: `ids[..3]` the role prefix, `ids[3..len-5]` the text, `ids[len-5..]`
//! the closing markers. As upstream, a text starting with `\n` merges that newline into the
//! role's `\n` token, and special-token strings written in the text (e.g. `<|im_end|>`) are
//! tokenized as those special tokens.
//!
//! Input rules added on the Rust side (reference.py is to mirror them; see [`clean_text`]):
//! - longer than [`MAX_TEXT_CHARS`] Unicode scalar values: [`PromptError::TextTooLong`];
//! - line endings `\r\n` and lone `\r` become `\n`; every other C0 control (U+0000..U+001F)
//!   except `\t` and `\n`, DEL (U+007F) and every C1 control (U+0080..U+009F) becomes a space;
//! - empty: [`PromptError::EmptyText`]; nothing but whitespace after that cleaning
//!   (Unicode `White_Space`): [`PromptError::BlankText`]. The service refuses more at its
//!   entry: a text without a letter or digit in any script ([`has_words`]: punctuation such as
//!   `?!...,;:` alone makes a model babble) is refused with the same error; the layout itself
//!   keeps such texts (the parity tests decode one).
//!
//! A Rust `&str` is valid UTF-8, so it cannot hold a lone surrogate (U+D800..U+DFFF); such input
//! must be rejected or replaced where bytes become a `String` (the caller's decoding step).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::PathBuf;

use tokenizers::Tokenizer;

use crate::manifest::Manifest;

/// Most Unicode scalar values (Rust `char`s, Python `len(str)`) one text may have. Chosen on
/// the Rust side: about 20 minutes of speech, far beyond one utterance, small enough that
/// tokenization and the prompt stay cheap.
pub const MAX_TEXT_CHARS: usize = 20_000;

/// Frame cap base (reference.py `CAP_BASE_FRAMES`, module docstring §5).
pub const CAP_BASE_FRAMES: usize = 40;
/// Frame cap per text token (reference.py `CAP_FRAMES_PER_TEXT_TOKEN`).
pub const CAP_FRAMES_PER_TEXT_TOKEN: usize = 10;

/// Characters that print nothing and are not `White_Space`: zero-width space/joiners, word
/// joiner, BOM. A text made only of these (and whitespace) has nothing to say.
pub const INVISIBLE: [char; 5] = ['\u{200B}', '\u{200C}', '\u{200D}', '\u{2060}', '\u{FEFF}'];

/// Whether `text` has something to say: a letter or a digit in any script (a character with
/// the Unicode property `Alphabetic` or `Numeric`: Latin, CJK, Arabic, Devanagari, digits…).
/// Text of only whitespace, punctuation (`?!...,;:`), symbols or [`INVISIBLE`] characters has
/// none.
pub fn has_words(text: &str) -> bool {
    text.chars().any(char::is_alphanumeric)
}

/// Tokens before the text in the chat-wrapped ids (`<|im_start|>`, `assistant`, `\n`).
const ROLE_TOKENS: usize = 3;
/// Tokens after the text (`<|im_end|>`, `\n`, `<|im_start|>`, `assistant`, `\n`).
const CLOSING_TOKENS: usize = 5;

/// The most frames one generation may produce:
/// `min(max_new_tokens, 40 + 10 * n_text_tokens)` (reference.py `frame_cap`, module docstring
/// §5), where `n_text_tokens` = [`PromptLayout::n_text_tokens`] and `max_new_tokens` comes from
/// `[sampling.talker]`. Saturates instead of overflowing.
pub fn frame_cap(n_text_tokens: usize, max_new_tokens: u32) -> usize {
    let by_text = n_text_tokens.saturating_mul(CAP_FRAMES_PER_TEXT_TOKEN).saturating_add(CAP_BASE_FRAMES);
    by_text.min(usize::try_from(max_new_tokens).unwrap_or(usize::MAX))
}

/// How the text enters the talker (reference.py `MODES`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum PromptMode {
    /// Upstream `non_streaming_mode=False` (the default of upstream `generate`): only the first
    /// text token is in the prefill, the rest is fed one per frame.
    #[default]
    Streaming,
    /// Upstream `non_streaming_mode=True` (what the wrapper's `generate_custom_voice` and
    /// `generate_voice_design` pass): the whole text is in the prefill.
    NonStreaming,
}

impl PromptMode {
    /// The reference's name: `streaming` or `non-streaming`.
    pub fn as_str(self) -> &'static str {
        match self {
            PromptMode::Streaming => "streaming",
            PromptMode::NonStreaming => "non-streaming",
        }
    }
}

impl std::fmt::Display for PromptMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One prefill position: `T(text) + C(codec)` (codec absent for the 3 role rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptRow {
    /// Text id (a row of the text embedding table; every row has one).
    pub text: u32,
    /// Codec id (a row of the codec embedding table), `None` for the role rows.
    pub codec: Option<u32>,
}

/// The prompt as ids (reference.py `PromptLayout`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptLayout {
    /// Prefill rows, in position order. Length `3 + (P + s + 1) + 1` (streaming) or
    /// `3 + (P + s + 1) + (n + 1) + 1` (non-streaming), P = 3 (auto) or 4 (a language),
    /// s = 1 with a speaker, n = text tokens.
    pub rows: Vec<PromptRow>,
    /// Text ids added to the talker input of frames 0, 1, ... (after them: `tts_pad`).
    /// Streaming: `text[1..]` then `tts_eos`; non-streaming: `[tts_pad]`.
    pub trailing: Vec<u32>,
    /// The text's own token ids (`ids[3..len-5]` of the chat wrapping), never empty.
    pub text_ids: Vec<u32>,
    /// Codec id of the language after the dialect override; `None` for auto.
    pub language_id: Option<u32>,
    /// Codec id of the speaker, if one was given.
    pub speaker_id: Option<u32>,
}

impl PromptLayout {
    /// Number of text tokens (the `n_text_tokens` of [`frame_cap`]).
    pub fn n_text_tokens(&self) -> usize {
        self.text_ids.len()
    }
}

/// Why a prompt cannot be built. Messages are meant for the person who typed the text.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    /// The bundle's tokenizer file could not be read or parsed.
    #[error("{path}: cannot load the tokenizer: {source}")]
    TokenizerLoad {
        /// The tokenizer file.
        path: PathBuf,
        /// The `tokenizers` crate's reason.
        source: tokenizers::Error,
    },
    /// The bundle's tokenizer and manifest do not fit together.
    #[error("bundle tokenizer/manifest mismatch: {message}")]
    Bundle {
        /// What does not fit.
        message: String,
    },
    /// The text is empty.
    #[error("text is empty")]
    EmptyText,
    /// The text holds nothing but whitespace and control characters (or, refused by the
    /// service, no letter or digit in any script: [`has_words`]).
    #[error("text has nothing to say (no letter or digit)")]
    BlankText,
    /// The text is longer than [`MAX_TEXT_CHARS`].
    #[error("text is {chars} characters long; the limit is {limit} characters (split it)")]
    TextTooLong {
        /// Unicode scalar values in the text.
        chars: usize,
        /// [`MAX_TEXT_CHARS`].
        limit: usize,
    },
    /// The text yields no tokens of its own (e.g. a lone `\n`, which merges into the role's
    /// newline token).
    #[error("text {text:?} has no tokens of its own")]
    NoTokens {
        /// The text (cleaned).
        text: String,
    },
    /// The language is neither `auto` nor one of the bundle's `[languages]`.
    #[error("unknown language {given:?}; allowed: {allowed}")]
    UnknownLanguage {
        /// What was asked for.
        given: String,
        /// `auto` and the bundle's languages, comma separated.
        allowed: String,
    },
    /// The speaker is not one of the bundle's `[speakers]`.
    #[error("unknown speaker {given:?}; allowed: {allowed}")]
    UnknownSpeaker {
        /// What was asked for.
        given: String,
        /// The bundle's speakers, comma separated (or a note that there are none).
        allowed: String,
    },
    /// A malformed pause tag ([`crate::pause`]), refused only in strict mode
    /// (`text.pause_tags = "strict"`); otherwise it is read as text.
    #[error("malformed pause tag {tag:?}: {reason} (text.pause_tags = \"strict\")")]
    PauseTag {
        /// The tag as written, brackets included.
        tag: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The tokenizer failed on the text.
    #[error("tokenizing the text failed: {source}")]
    Tokenize {
        /// The `tokenizers` crate's reason.
        source: tokenizers::Error,
    },
    /// The chat markers did not come out as the expected atomic ids (a tokenizer that does not
    /// belong to this bundle).
    #[error("tokenizer does not keep the chat markers atomic: {head:?} ... {tail:?}")]
    MarkersNotAtomic {
        /// The first ids of the wrapped text.
        head: Vec<u32>,
        /// The last ids of the wrapped text.
        tail: Vec<u32>,
    },
}

/// The Rust-side input cleaning (module doc): `\r\n` and lone `\r` → `\n`; other C0 controls
/// except `\t`/`\n`, DEL and C1 controls → space. Borrows when nothing changes. Python mirror:
///
/// ```text
/// text = text.replace("\r\n", "\n").replace("\r", "\n")
/// text = "".join(" " if (ord(c) < 0x20 and c not in "\t\n") or 0x7F <= ord(c) <= 0x9F else c
///                for c in text)
/// ```
pub fn clean_text(text: &str) -> Cow<'_, str> {
    let is_replaced = |c: char| (c < '\u{20}' && c != '\t' && c != '\n') || ('\u{7f}'..='\u{9f}').contains(&c);
    if !text.chars().any(is_replaced) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\r' => {
                if chars.peek() == Some(&'\n') {
                    chars.next();
                }
                out.push('\n');
            }
            c if is_replaced(c) => out.push(' '),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// The bundle's tokenizer and the ids the prompt is made of.
#[derive(Debug, Clone)]
pub struct Prompter {
    tokenizer: Tokenizer,
    im_start: u32,
    im_end: u32,
    assistant: u32,
    newline: u32,
    tts_pad: u32,
    tts_bos: u32,
    tts_eos: u32,
    codec_pad: u32,
    codec_bos: u32,
    think: u32,
    nothink: u32,
    think_bos: u32,
    think_eos: u32,
    /// Lower-cased language name → codec id.
    languages: BTreeMap<String, u32>,
    /// Lower-cased speaker name → codec id.
    speakers: BTreeMap<String, u32>,
    /// Lower-cased dialect speaker → codec id of its dialect language.
    dialects: BTreeMap<String, u32>,
}

impl Prompter {
    /// A prompter over `tokenizer`, with the ids from the manifest. Language and speaker names
    /// are matched case-insensitively (lower-cased, as reference.py). The id of `assistant` is
    /// `[text] assistant`, else the tokenizer's; the newline id is the first id of `"\n"`.
    /// (Reading the tokenizer file is the engine's: `engine::bundle::read_prompter`.)
    ///
    /// # Errors
    /// [`PromptError::Bundle`] when the tokenizer has no `assistant` token or no newline, or a
    /// dialect names an unknown language.
    pub fn with_tokenizer(tokenizer: Tokenizer, manifest: &Manifest) -> Result<Self, PromptError> {
        let bundle = |message: String| PromptError::Bundle { message };
        let assistant = match manifest.text.assistant {
            Some(id) => id,
            None => tokenizer
                .token_to_id("assistant")
                .ok_or_else(|| bundle("the tokenizer has no token \"assistant\" and [text] names none".into()))?,
        };
        let newline = tokenizer
            .encode_fast("\n", false)
            .map_err(|e| bundle(format!("tokenizing \"\\n\" failed: {e}")))?
            .get_ids()
            .first()
            .copied()
            .ok_or_else(|| bundle("the tokenizer gives no id for \"\\n\"".into()))?;
        let lower = |m: &BTreeMap<String, u32>| m.iter().map(|(k, v)| (k.to_lowercase(), *v)).collect::<BTreeMap<_, _>>();
        let languages = lower(&manifest.languages);
        let speakers = lower(&manifest.speakers);
        let mut dialects = BTreeMap::new();
        for (spk, lang) in &manifest.speaker_dialects {
            let id = languages
                .get(&lang.to_lowercase())
                .ok_or_else(|| bundle(format!("speaker_dialects.{spk} names {lang:?}, which is not in [languages]")))?;
            dialects.insert(spk.to_lowercase(), *id);
        }
        let (t, c) = (&manifest.text, &manifest.codec);
        Ok(Self {
            tokenizer,
            im_start: t.im_start,
            im_end: t.im_end,
            assistant,
            newline,
            tts_pad: t.tts_pad,
            tts_bos: t.tts_bos,
            tts_eos: t.tts_eos,
            codec_pad: c.pad,
            codec_bos: c.bos,
            think: c.think,
            nothink: c.nothink,
            think_bos: c.think_bos,
            think_eos: c.think_eos,
            languages,
            speakers,
            dialects,
        })
    }

    /// The bundle's language names (lower-cased, sorted); `auto` is always accepted too.
    pub fn languages(&self) -> impl Iterator<Item = &str> {
        self.languages.keys().map(String::as_str)
    }

    /// The bundle's speaker names (lower-cased, sorted).
    pub fn speakers(&self) -> impl Iterator<Item = &str> {
        self.speakers.keys().map(String::as_str)
    }

    /// (role ids, text ids) of the chat-wrapped text (reference.py `chat_ids`), after the
    /// input rules of the module doc.
    ///
    /// # Errors
    /// [`PromptError::EmptyText`], [`PromptError::TextTooLong`], [`PromptError::BlankText`],
    /// [`PromptError::Tokenize`], [`PromptError::MarkersNotAtomic`], [`PromptError::NoTokens`].
    pub fn chat_ids(&self, text: &str) -> Result<([u32; ROLE_TOKENS], Vec<u32>), PromptError> {
        if text.is_empty() {
            return Err(PromptError::EmptyText);
        }
        let chars = text.chars().count();
        if chars > MAX_TEXT_CHARS {
            return Err(PromptError::TextTooLong { chars, limit: MAX_TEXT_CHARS });
        }
        let text = clean_text(text);
        if text.chars().all(|c| c.is_whitespace() || INVISIBLE.contains(&c)) {
            return Err(PromptError::BlankText);
        }
        let wrapped = format!("<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n");
        let encoding = self.tokenizer.encode_fast(wrapped, false).map_err(|source| PromptError::Tokenize { source })?;
        let ids = encoding.get_ids();
        let closing = [self.im_end, self.newline, self.im_start, self.assistant, self.newline];
        let head = ids.get(..ROLE_TOKENS);
        let tail = ids.len().checked_sub(CLOSING_TOKENS).and_then(|s| ids.get(s..));
        let (Some(head), Some(tail)) = (head, tail) else {
            return Err(PromptError::MarkersNotAtomic { head: ids.to_vec(), tail: Vec::new() });
        };
        if head[..2] != [self.im_start, self.assistant] || tail != closing {
            return Err(PromptError::MarkersNotAtomic { head: head.to_vec(), tail: tail.to_vec() });
        }
        if ids.len() <= ROLE_TOKENS + CLOSING_TOKENS {
            return Err(PromptError::NoTokens { text: text.into_owned() });
        }
        let role = [head[0], head[1], head[2]];
        Ok((role, ids[ROLE_TOKENS..ids.len() - CLOSING_TOKENS].to_vec()))
    }

    /// How many tokens the bundle's tokenizer makes of `text` alone (no chat wrapping, after
    /// [`clean_text`]): what [`crate::segment`] measures segments in. When the tokenizer fails,
    /// the UTF-8 length, an upper bound for a byte-level BPE (every token covers a byte or more).
    pub fn count_tokens(&self, text: &str) -> usize {
        let text = clean_text(text);
        self.tokenizer.encode_fast(text.as_ref(), false).map_or(text.len(), |e| e.get_ids().len())
    }

    /// The text's own token ids (reference.py `tokenize`).
    ///
    /// # Errors
    /// As [`Prompter::chat_ids`].
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, PromptError> {
        Ok(self.chat_ids(text)?.1)
    }

    /// The prompt of `text` (reference.py `prompt_layout`).
    ///
    /// `language`: `None`, `""` or `auto` (any case) for auto, else a bundle language (any
    /// case). `speaker`: `None` or `""` for none, else a bundle speaker (any case). A dialect
    /// speaker replaces the language by its dialect when the language is `chinese` or auto.
    ///
    /// # Errors
    /// [`PromptError::UnknownLanguage`], [`PromptError::UnknownSpeaker`] (checked first, in that
    /// order), then those of [`Prompter::chat_ids`].
    pub fn layout(
        &self,
        text: &str,
        language: Option<&str>,
        speaker: Option<&str>,
        mode: PromptMode,
    ) -> Result<PromptLayout, PromptError> {
        let lang = language.filter(|l| !l.is_empty()).map_or_else(|| "auto".to_owned(), str::to_lowercase);
        let mut language_id = None;
        if lang != "auto" {
            match self.languages.get(&lang) {
                Some(&id) => language_id = Some(id),
                None => {
                    let mut allowed = String::from("auto");
                    for name in self.languages.keys() {
                        allowed.push_str(", ");
                        allowed.push_str(name);
                    }
                    return Err(PromptError::UnknownLanguage { given: language.unwrap_or_default().to_owned(), allowed });
                }
            }
        }
        let spk = speaker.filter(|s| !s.is_empty()).map(str::to_lowercase);
        let speaker_id = match &spk {
            None => None,
            Some(name) => match self.speakers.get(name) {
                Some(&id) => Some(id),
                None => {
                    let allowed = if self.speakers.is_empty() {
                        "none (this bundle has no speakers)".to_owned()
                    } else {
                        self.speakers.keys().map(String::as_str).collect::<Vec<_>>().join(", ")
                    };
                    return Err(PromptError::UnknownSpeaker { given: speaker.unwrap_or_default().to_owned(), allowed });
                }
            },
        };
        let (role, text_ids) = self.chat_ids(text)?;

        if let Some(name) = &spk
            && (lang == "chinese" || lang == "auto")
            && let Some(&dialect) = self.dialects.get(name)
        {
            language_id = Some(dialect);
        }
        let mut codec = match language_id {
            None => vec![self.nothink, self.think_bos, self.think_eos],
            Some(id) => vec![self.think, self.think_bos, id, self.think_eos],
        };
        codec.extend(speaker_id);
        codec.push(self.codec_pad);

        let mut rows: Vec<PromptRow> = role.iter().map(|&text| PromptRow { text, codec: None }).collect();
        let last = codec.len() - 1;
        for (i, &cid) in codec.iter().enumerate() {
            let text = if i == last { self.tts_bos } else { self.tts_pad };
            rows.push(PromptRow { text, codec: Some(cid) });
        }
        let Some((&first, rest)) = text_ids.split_first() else {
            return Err(PromptError::NoTokens { text: text.to_owned() });
        };
        let trailing = match mode {
            PromptMode::Streaming => {
                rows.push(PromptRow { text: first, codec: Some(self.codec_bos) });
                let mut trailing = rest.to_vec();
                trailing.push(self.tts_eos);
                trailing
            }
            PromptMode::NonStreaming => {
                for &tid in text_ids.iter().chain([self.tts_eos].iter()) {
                    rows.push(PromptRow { text: tid, codec: Some(self.codec_pad) });
                }
                rows.push(PromptRow { text: self.tts_pad, codec: Some(self.codec_bos) });
                vec![self.tts_pad]
            }
        };
        Ok(PromptLayout { rows, trailing, text_ids, language_id, speaker_id })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_without_a_letter_or_digit_has_nothing_to_say() {
        for blank in ["?!...,;:", " \t\n", "\u{200B}\u{FEFF}", "。！？…", "-- ** ##", "\u{1F600}"] {
            assert!(!has_words(blank), "{blank:?}");
        }
        for words in ["a", "7", "?!a", "中", "ок", "مرحبا", "नमस्ते", "Ⅻ", "٣"] {
            assert!(has_words(words), "{words:?}");
        }
    }

    #[test]
    fn frame_cap_is_min_of_limit_and_text_rule() {
        assert_eq!(frame_cap(0, 8192), 40);
        assert_eq!(frame_cap(3, 8192), 70);
        assert_eq!(frame_cap(1000, 8192), 8192);
        assert_eq!(frame_cap(3, 50), 50);
        assert_eq!(frame_cap(usize::MAX, 7), 7);
    }

    #[test]
    fn clean_text_line_endings_and_controls() {
        assert!(matches!(clean_text("Hello, world.\n\tok"), Cow::Borrowed(_)));
        assert_eq!(clean_text("a\r\nb\rc\n\rd"), "a\nb\nc\n\nd");
        assert_eq!(clean_text("a\u{0}b\u{1b}[1mc\u{7f}d\u{85}e\u{9f}f\u{a0}g"), "a b [1mc d e f\u{a0}g");
        assert_eq!(clean_text("\r"), "\n");
        assert_eq!(clean_text("\r\r\n"), "\n\n");
        // Not controls: format characters and non-breaking space stay.
        assert_eq!(clean_text("\u{feff}x\u{200b}y"), "\u{feff}x\u{200b}y");
    }

    #[test]
    fn mode_names_match_the_reference() {
        assert_eq!(PromptMode::default(), PromptMode::Streaming);
        assert_eq!(PromptMode::Streaming.to_string(), "streaming");
        assert_eq!(PromptMode::NonStreaming.to_string(), "non-streaming");
    }
}
