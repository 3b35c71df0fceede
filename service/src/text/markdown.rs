//! Markdown reduced to the text a person would read aloud (`text.markdown`), on pulldown-cmark's
//! CommonMark parser with the GitHub extensions language models use (tables, strikethrough,
//! task lists, footnotes, alerts) and `~subscript~`.
//!
//! - **Emphasis**, strong, `~subscript~`: their words; **strikethrough** (`~~a~~`): nothing,
//!   it is struck out.
//! - **Headings**: their words, ending as a sentence (a trailing `:` becomes `.`).
//! - **Paragraphs**: their words, lines joined; a paragraph that ends without punctuation gets
//!   a full stop.
//! - **List items**: each a sentence on its own line (a full stop added when an item does not end
//!   in `.` `!` `?` `…` `;` `:` or their full-width forms; a trailing `,` or dash becomes one);
//!   the markers and numbers are not read; task-list boxes neither.
//! - **Tables**: row by row, header first; the cells of a row joined with `, `, each row a
//!   sentence (`，` between the cells of CJK text); a cell without a letter or digit (empty, `—`)
//!   is left out. A row the parser
//!   did not see as a table (a stream's line, without its header) is read the same way.
//! - **Links**: their text (the URL is not read); **images**: nothing (a listener cannot see
//!   them; their alt text is not read either).
//! - **Code**, fenced and inline: left out, or read as text ([`Code`]).
//! - **Block quotes**: their text; an alert's kind (`[!NOTE]`) is not read.
//! - **HTML**: tags and comments dropped, the text between them kept.
//! - **Footnotes**: references and definitions left out. Rules (`---`): a paragraph break.
//!
//! The full stop added is `。` when the last word is CJK text (Han, kana), else `.`. Blocks at the top of the document are separated
//! by a blank line (a paragraph for the segmenter, [`engine::segment`]); the items of a list,
//! the rows of a table and the paragraphs inside a quote or an item by a line break. A list or
//! table right after a paragraph that ends with `:` continues that paragraph.

use std::sync::LazyLock;

use pulldown_cmark::{Event, Options, Parser, Tag, TagEnd};
use regex::Regex;

use super::emoji::is_cjk;
use super::{Code, own_regex};

/// The signs of markdown that [`looks_like_markdown`] looks for, one per line of this pattern:
/// a heading (`# `), a list item (`- `, `* `, `+ `, `1. `, `1) `), a code fence, a block quote
/// (`> `), a table row (`| a | b |`), a rule (`---`, `***`, `___`), strong emphasis (`**a**`,
/// `__a__`), emphasis (`*a*`), strikethrough (`~~a~~`), a link or an image (`[a](b)`,
/// `![a](b)`), a footnote (`[^1]`), inline code (`` `a` ``), an HTML tag or comment (`<b>`,
/// `</p>`, `<br/>`, `<!--`).
const SIGNS: &str = r"(?m)^[ \t]{0,3}#{1,6}[ \t]+\S
|^[ \t]*(?:[-*+]|\d{1,3}[.)])[ \t]+\S
|^[ \t]{0,3}(?:```|~~~)
|^[ \t]{0,3}>[ \t]*\S
|^[ \t]*\|.*\|[ \t]*$
|^[ \t]{0,3}(?:(?:-[ \t]*){3,}|(?:\*[ \t]*){3,}|(?:_[ \t]*){3,})$
|\*\*[^*\s][^*\n]*\*\*|__[^_\s][^_\n]*__
|(?:^|[\s(])\*[^*\s][^*\n]*[^*\s]\*(?:$|[\s).,!?:;])
|~~[^~\s][^~\n]*~~
|!?\[[^\]\n]+\]\([^)\s]+\)|\[\^[^\]\s]+\]
|`[^`\n]+`
|<(?:[A-Za-z][A-Za-z0-9-]*(?:\s[^<>\n]*)?/?|/[A-Za-z][A-Za-z0-9-]*\s*)>|<!--";

static MARKDOWN_SIGNS: LazyLock<Option<Regex>> = LazyLock::new(|| own_regex(&SIGNS.replace('\n', "")));

/// Whether `text` shows one of markdown's signs ([`SIGNS`]): what `text.markdown = "auto"`
/// parses as markdown. A plain sentence, `5 * 3`, `a - b` or `C#` does not.
pub fn looks_like_markdown(text: &str) -> bool {
    MARKDOWN_SIGNS.as_ref().is_some_and(|re| re.is_match(text))
}

/// Characters that end a sentence (the segmenter's, [`engine::segment`]).
fn is_sentence_end(c: char) -> bool {
    matches!(c, '.' | '!' | '?' | '…' | ';' | '。' | '！' | '？' | '．' | '；' | '।' | '؟' | '۔')
}

/// Closing quotes and brackets, which may follow a sentence's end.
fn is_closer(c: char) -> bool {
    matches!(c, '"' | '\'' | ')' | ']' | '}' | '”' | '’' | '»' | '›' | '」' | '』' | '）' | '】' | '》' | '〉')
}

/// What a line of output was in the markdown: how it ends as a sentence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// A paragraph, a list item, a table row.
    Sentence,
    /// A heading: a trailing colon becomes a full stop too.
    Heading,
    /// A code block that is read: as it is.
    Code,
}

/// `line` made to end as a sentence (see the [module](self) docs).
pub(super) fn end_sentence(line: &mut String, kind: Kind) {
    if kind == Kind::Code {
        return;
    }
    let body = line.trim_end_matches(is_closer);
    let Some(last) = body.chars().next_back() else { return };
    if is_sentence_end(last) {
        return;
    }
    if matches!(last, ':' | '：') && kind != Kind::Heading {
        return;
    }
    // the stop of the script of the last word: `。` after Han or kana (`12 度` too)
    let stop = if body.chars().rev().find(|c| c.is_alphabetic()).is_some_and(is_cjk) { "。" } else { "." };
    if matches!(last, ':' | '：' | ',' | '，' | '、' | '-' | '–' | '—') {
        // the trailing mark becomes the stop (a closer after it is rare enough to drop)
        line.truncate(body.len() - last.len_utf8());
    }
    line.push_str(stop);
}

/// A table row's cells as one sentence: joined with `, `, or with `，` when a cell holds CJK
/// text.
fn join_cells(cells: &[String]) -> String {
    let cjk = cells.iter().any(|c| c.chars().any(is_cjk));
    cells.join(if cjk { "，" } else { ", " })
}

/// Collapse white space (newlines included) into single spaces, trimmed.
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

static TAGS: LazyLock<Option<Regex>> = LazyLock::new(|| own_regex(r"(?s)<!--.*?-->|</?[A-Za-z][^>]*>"));

static BREAK_TAG: LazyLock<Option<Regex>> =
    LazyLock::new(|| own_regex(r"(?i)^</?(?:br|p|div|li|ul|ol|tr|td|th|h[1-6]|hr|table|blockquote)\b"));

/// HTML without its tags and comments (entities stay as they are).
fn strip_tags(html: &str) -> String {
    match &*TAGS {
        Some(re) => re.replace_all(html, " ").into_owned(),
        None => html.to_owned(),
    }
}

/// The separator before the next line of output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Break {
    /// A line break: the next item, row or inner paragraph.
    Line,
    /// A blank line: the next block of the document.
    Paragraph,
}

struct Writer {
    code: Code,
    out: String,
    /// The text of the line being gathered.
    line: String,
    kind: Kind,
    brk: Break,
    /// Containers open (lists, quotes, tables, items, footnotes): a block inside one is not at
    /// the top of the document.
    depth: usize,
    /// Inside what is not read (images, struck text, footnote definitions, skipped code blocks).
    skip: usize,
    /// The cells of the table row being gathered.
    cells: Vec<String>,
}

impl Writer {
    /// A block starts: at the top of the document it is a new paragraph.
    fn block(&mut self, lead_in: bool) {
        self.flush();
        if self.depth == 0 {
            let continues = lead_in && self.out.trim_end().ends_with([':', '：']);
            self.brk = if continues { Break::Line } else { Break::Paragraph };
        }
    }

    /// The gathered line, ended as a sentence, onto the output.
    fn flush(&mut self) {
        let raw = std::mem::take(&mut self.line);
        let kind = std::mem::replace(&mut self.kind, Kind::Sentence);
        let mut text = if kind == Kind::Code {
            raw.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join("\n")
        } else {
            one_line(&raw)
        };
        if text.is_empty() {
            return;
        }
        end_sentence(&mut text, kind);
        if !self.out.is_empty() {
            self.out.push_str(match self.brk {
                Break::Line => "\n",
                Break::Paragraph => "\n\n",
            });
        }
        self.out.push_str(&text);
        self.brk = Break::Line;
    }

    fn text(&mut self, s: &str) {
        if self.skip == 0 {
            self.line.push_str(s);
        }
    }

    fn event(&mut self, event: Event<'_>) {
        match event {
            Event::Start(tag) => self.start(tag),
            Event::End(tag) => self.end(tag),
            Event::Text(s) => self.text(&s),
            Event::Code(s) => match self.code {
                Code::Read => self.text(&s),
                // a space keeps the words around it apart
                Code::Skip => self.text(" "),
            },
            Event::Html(s) => self.text(&strip_tags(&s)),
            // a tag that breaks a line keeps the words apart; others vanish (`<b>x</b>`)
            Event::InlineHtml(s) if BREAK_TAG.as_ref().is_some_and(|re| re.is_match(&s)) => self.text(" "),
            Event::InlineHtml(_) => {}
            Event::SoftBreak | Event::HardBreak => self.text(" "),
            Event::InlineMath(s) | Event::DisplayMath(s) => self.text(&s),
            Event::Rule => {
                self.flush();
                self.brk = Break::Paragraph;
            }
            Event::FootnoteReference(_) | Event::TaskListMarker(_) => {}
        }
    }

    fn start(&mut self, tag: Tag<'_>) {
        match tag {
            Tag::Paragraph => self.block(false),
            Tag::Heading { .. } => {
                self.block(false);
                self.kind = Kind::Heading;
            }
            Tag::CodeBlock(_) => {
                self.block(false);
                match self.code {
                    Code::Skip => self.skip += 1,
                    Code::Read => self.kind = Kind::Code,
                }
            }
            Tag::HtmlBlock => self.block(false),
            Tag::BlockQuote(_) | Tag::DefinitionList => {
                self.block(false);
                self.depth += 1;
            }
            Tag::List(_) | Tag::Table(_) => {
                self.block(true);
                self.depth += 1;
            }
            Tag::Item | Tag::DefinitionListTitle | Tag::DefinitionListDefinition => {
                self.flush();
                self.depth += 1;
            }
            Tag::TableHead | Tag::TableRow => self.cells.clear(),
            Tag::TableCell => self.line.clear(),
            Tag::FootnoteDefinition(_) => {
                self.flush();
                self.skip += 1;
            }
            Tag::Image { .. } | Tag::Strikethrough => self.skip += 1,
            Tag::Emphasis | Tag::Strong | Tag::Superscript | Tag::Subscript | Tag::Link { .. } | Tag::MetadataBlock(_) => {}
        }
    }

    fn end(&mut self, tag: TagEnd) {
        match tag {
            TagEnd::Paragraph | TagEnd::Heading(_) | TagEnd::HtmlBlock => self.flush(),
            TagEnd::CodeBlock => match self.code {
                Code::Skip => self.skip = self.skip.saturating_sub(1),
                Code::Read => self.flush(),
            },
            TagEnd::BlockQuote(_)
            | TagEnd::DefinitionList
            | TagEnd::List(_)
            | TagEnd::Table
            | TagEnd::Item
            | TagEnd::DefinitionListTitle
            | TagEnd::DefinitionListDefinition => {
                self.flush();
                self.depth = self.depth.saturating_sub(1);
            }
            TagEnd::TableCell => {
                let cell = one_line(&std::mem::take(&mut self.line));
                // a cell without a letter or digit (empty, `—`, `-`) says nothing
                if engine::prompt::has_words(&cell) {
                    self.cells.push(cell);
                }
            }
            TagEnd::TableHead | TagEnd::TableRow => {
                self.line = join_cells(&self.cells);
                self.cells.clear();
                self.flush();
            }
            TagEnd::FootnoteDefinition | TagEnd::Image | TagEnd::Strikethrough => self.skip = self.skip.saturating_sub(1),
            TagEnd::Emphasis | TagEnd::Strong | TagEnd::Superscript | TagEnd::Subscript | TagEnd::Link | TagEnd::MetadataBlock(_) => {}
        }
    }
}

/// A line that is a table's delimiter row (`|---|:--:|`), alone.
static DELIMITER_ROW: LazyLock<Option<Regex>> = LazyLock::new(|| own_regex(r"^\|[ \t:|-]*-[ \t:|-]*\.?$"));

/// Table rows the parser left as paragraphs (a row without its header and delimiter, as a
/// stream brings them one line at a time): `| Mon | 20 °C |` → `Mon, 20 °C.`; a delimiter row
/// alone goes.
fn loose_rows(text: String) -> String {
    if !text.contains('|') {
        return text;
    }
    let mut out = Vec::new();
    for line in text.split('\n') {
        let t = line.trim();
        if DELIMITER_ROW.as_ref().is_some_and(|re| re.is_match(t)) {
            continue;
        }
        let row = t.strip_suffix('.').unwrap_or(t);
        match row.strip_prefix('|').and_then(|r| r.strip_suffix('|')) {
            Some(cells) => {
                let cells: Vec<String> =
                    cells.split('|').map(str::trim).filter(|c| engine::prompt::has_words(c)).map(String::from).collect();
                let mut joined = join_cells(&cells);
                end_sentence(&mut joined, Kind::Sentence);
                out.push(joined);
            }
            None => out.push(line.to_owned()),
        }
    }
    out.join("\n")
}

/// A fenced code block of a text ([`first_fence`]): byte offsets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fence {
    /// Where its opening line starts.
    pub start: usize,
    /// Where its closing line ends (after the line break, when there is one); `None` while the
    /// block is open.
    pub end: Option<usize>,
}

/// The first fenced code block of `text` (a line of at most 3 spaces and then three or more
/// `` ` `` or `~`, closed by a line of at least as many of the same character), so that a
/// stream's text can hold a block together until it is closed (the Wyoming front-end).
pub fn first_fence(text: &str) -> Option<Fence> {
    let mut offset = 0;
    let mut open: Option<(usize, char, usize)> = None;
    for line in text.split_inclusive('\n') {
        let t = line.trim_end_matches(['\n', '\r']);
        let body = t.trim_start_matches(' ');
        let indent = t.len() - body.len();
        if let Some(c @ ('`' | '~')) = body.chars().next()
            && indent <= 3
        {
            let n = body.chars().take_while(|&x| x == c).count();
            if n >= 3 {
                match open {
                    None => open = Some((offset, c, n)),
                    Some((start, oc, on)) if c == oc && n >= on && body[n..].trim().is_empty() => {
                        return Some(Fence { start, end: Some(offset + line.len()) });
                    }
                    Some(_) => {}
                }
            }
        }
        offset += line.len();
    }
    open.map(|(start, ..)| Fence { start, end: None })
}

/// `text`, parsed as markdown, as the text to read aloud (see the [module](self) docs).
pub fn to_spoken(text: &str, code: Code) -> String {
    let options = Options::ENABLE_TABLES
        | Options::ENABLE_STRIKETHROUGH
        // `~a~` is then subscript (its text is read), only `~~a~~` strikethrough
        | Options::ENABLE_SUBSCRIPT
        | Options::ENABLE_TASKLISTS
        | Options::ENABLE_FOOTNOTES
        | Options::ENABLE_GFM;
    let mut w = Writer {
        code,
        out: String::with_capacity(text.len()),
        line: String::new(),
        kind: Kind::Sentence,
        brk: Break::Paragraph,
        depth: 0,
        skip: 0,
        cells: Vec::new(),
    };
    for event in Parser::new_ext(text, options) {
        w.event(event);
    }
    w.flush();
    loose_rows(w.out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md(s: &str) -> String {
        to_spoken(s, Code::Skip)
    }

    #[test]
    fn own_patterns_compile() {
        assert!(MARKDOWN_SIGNS.is_some() && TAGS.is_some() && BREAK_TAG.is_some() && DELIMITER_ROW.is_some());
    }

    #[test]
    fn markdown_signs_are_seen_and_plain_text_is_not() {
        for s in [
            "# Title",
            "Intro\n## Steps",
            "- one\n- two",
            "* one",
            "1. first",
            "2) second",
            "```\ncode\n```",
            "> quoted",
            "| a | b |\n|---|---|\n| 1 | 2 |",
            "This is **bold**.",
            "This is __bold__.",
            "This is *important*, really.",
            "See [the docs](https://example.com).",
            "![chart](c.png)",
            "Run `ls` first.",
            "Part one\n\n---\n\nPart two",
            "* * *",
            "On ~~Tuesday~~ Wednesday",
            "True[^1].",
            "Sure!<br>Here",
            "A <b>bold</b> move",
            "Hidden <!-- note --> text",
        ] {
            assert!(looks_like_markdown(s), "{s:?}");
        }
        for s in [
            "Hello, world.",
            "5 * 3 * 2 is 30.",
            "a - b and c - d",
            "I like C# and F#.",
            "It costs $5 - $10.",
            "Price: 3*4 = 12",
            "The year 2024. A good one.",
            "email me at a_b@example.com",
            "see snake_case_names here",
            "[not a link] (really)",
            "x < y and y > z",
            "I <3 you",
            "Mail <jane@example.com>",
            "Open <https://example.com>",
            "A -- B --- C",
            "About ~20 minutes",
        ] {
            assert!(!looks_like_markdown(s), "{s:?}");
        }
    }

    #[test]
    fn emphasis_and_headings_keep_their_words() {
        assert_eq!(md("# Hello *there*"), "Hello there.");
        assert_eq!(md("## Ingredients:\nSome **bold** and _italic_ words."), "Ingredients.\n\nSome bold and italic words.");
        assert_eq!(
            md("On ~~Tuesday~~ Wednesday, the ~old~ one, in ~20 to ~30 minutes."),
            "On Wednesday, the old one, in ~20 to ~30 minutes."
        );
        assert_eq!(md("### Done!"), "Done!");
    }

    #[test]
    fn links_give_their_text_and_images_nothing() {
        assert_eq!(md("Read [the guide](https://x.org/guide \"Guide\") now."), "Read the guide now.");
        assert_eq!(md("A chart: ![weather chart](chart.png) shows it."), "A chart: shows it.");
        assert_eq!(md("[![badge](b.svg)](https://ci.example)"), "");
        assert_eq!(md("<https://example.com/a>"), "https://example.com/a.");
    }

    #[test]
    fn code_is_skipped_or_read() {
        let text = "Run `ls -la` here:\n\n```sh\nls -la\ncd /tmp\n```\n\nDone.";
        assert_eq!(to_spoken(text, Code::Skip), "Run here:\n\nDone.");
        assert_eq!(to_spoken(text, Code::Read), "Run ls -la here:\n\nls -la\ncd /tmp\n\nDone.");
    }

    #[test]
    fn list_items_are_sentences() {
        assert_eq!(md("You need:\n\n- flour\n- two eggs,\n- milk!\n"), "You need:\nflour.\ntwo eggs.\nmilk!");
        assert_eq!(md("1. Preheat the oven\n2. Mix: gently\n3. Bake (40 min)"), "Preheat the oven.\nMix: gently.\nBake (40 min).");
        assert_eq!(md("- [x] Lights off\n- [ ] Door locked"), "Lights off.\nDoor locked.");
        let nested = "- Vegetables:\n  - carrots\n  - peas\n- Fruit";
        assert_eq!(md(nested), "Vegetables:\ncarrots.\npeas.\nFruit.");
        let loose = "- First paragraph\n\n  second paragraph\n\n- Next";
        assert_eq!(md(loose), "First paragraph.\nsecond paragraph.\nNext.");
    }

    #[test]
    fn tables_are_read_row_by_row() {
        let t = "| Day | High | Low |\n|-----|------|-----|\n| Mon | 20 °C | 12 °C |\n| Tue | | 11 °C |\n| Wed | — | - |";
        assert_eq!(md(t), "Day, High, Low.\nMon, 20 °C, 12 °C.\nTue, 11 °C.\nWed.");
        assert_eq!(md("Forecast:\n\n| a | b |\n|---|---|\n| 1 | 2 |"), "Forecast:\na, b.\n1, 2.");
    }

    #[test]
    fn quotes_html_footnotes_and_rules() {
        assert_eq!(md("> Be kind.\n> Always."), "Be kind. Always.");
        assert_eq!(md("> [!NOTE]\n> Doors lock at ten."), "Doors lock at ten.");
        assert_eq!(md("Line one<br>line two <b>bold</b>."), "Line one line two bold.");
        assert_eq!(md("<div>\nHidden <em>text</em>\n</div>\n\nAfter"), "Hidden text.\n\nAfter.");
        assert_eq!(md("Fact[^1] here.\n\n[^1]: The source."), "Fact here.");
        assert_eq!(md("One\n\n---\n\nTwo"), "One.\n\nTwo.");
        assert_eq!(md("<!-- hidden -->\nShown"), "Shown.");
    }

    #[test]
    fn cjk_items_end_with_a_full_width_stop() {
        assert_eq!(md("## 天气\n- 晴天\n- 气温：二十五度，"), "天气。\n\n晴天。\n气温：二十五度。");
        assert_eq!(md("- 東京：晴れ"), "東京：晴れ。");
        assert_eq!(md("- 用电量 12 度\n- 费用 6.5\n- total 7"), "用电量 12 度。\n费用 6.5。\ntotal 7.");
        assert_eq!(md("| 日期 | 费用 |\n|---|---|\n| 周一 | ¥6.5 |"), "日期，费用。\n周一，¥6.5。");
    }

    #[test]
    fn table_rows_without_their_table_are_read_as_rows() {
        assert_eq!(md("| Mon | 20 °C | 12 °C |"), "Mon, 20 °C, 12 °C.");
        assert_eq!(md("|---|:---:|"), "");
        assert_eq!(md("Before\n\n| a | b |\n\nAfter"), "Before.\n\na, b.\n\nAfter.");
    }

    #[test]
    fn fences_are_found_open_or_closed() {
        assert_eq!(first_fence("no code"), None);
        assert_eq!(first_fence("Run:\n```sh\nls\n"), Some(Fence { start: 5, end: None }));
        let t = "Run:\n```sh\nls\n```\nDone.";
        assert_eq!(first_fence(t), Some(Fence { start: 5, end: Some(18) }));
        assert_eq!(&t[18..], "Done.");
        // a closing fence needs the same character, as many, and nothing after it
        assert_eq!(first_fence("~~~~\n```\n~~~ x\n").map(|f| f.end), Some(None));
        assert_eq!(first_fence("    ```\nindented code\n"), None);
    }

    #[test]
    fn soft_breaks_join_lines() {
        assert_eq!(md("A line\nwrapped here."), "A line wrapped here.");
        assert_eq!(md("**Hi** there\nfriend"), "Hi there friend.");
    }
}
