//! The user's replacement rules (`text.replacements`): a UTF-8 text file, one rule a line,
//! applied to the spoken text in file order, each to the result of the one before, after the
//! other steps of [`super::spoken`].
//!
//! ```text
//! # a comment; blank lines are ignored
//! HA => Home Assistant
//! /\bkWh\b/ => kilowatt hours
//! /(\d+) ?°C/ => $1 degrees
//! /\bok\b/i => okay
//! (beta) =>
//! ```
//!
//! - `LITERAL => REPLACEMENT`: every occurrence of the literal text, case-sensitive, anywhere
//!   (also inside a word: use a regex with `\b` for whole words).
//! - `/REGEX/ => REPLACEMENT` and `/REGEX/i` (case-insensitive): the `regex` crate's syntax
//!   (<https://docs.rs/regex/latest/regex/#syntax>); the replacement may use the groups, `$1`,
//!   `${name}` (`$$` for a `$`). A `/` or `=>` inside the regex needs no escape: the rule is
//!   cut at the first `=>` that follows a closing `/` (and its flags).
//! - Both sides are trimmed of blanks; an empty replacement deletes. The left side of a literal
//!   rule cannot contain `=>` (a regex can).
//! - A line starting with `#` (after blanks) is a comment; a `#` elsewhere is text.
//!
//! A rule that cannot be read (no `=>`, an empty pattern, a regex that does not compile, an
//! unknown flag) is an error naming the file and the line, at start-up (exit code 2).

use std::path::{Path, PathBuf};

use regex::{Regex, RegexBuilder};

/// The most bytes a replacement file may have: 1 MiB, far more than any list of rules.
pub const MAX_FILE_BYTES: u64 = 1 << 20;

/// A text front-end setting that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// The replacement file cannot be read.
    #[error("{}: cannot read the replacement rules (text.replacements): {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The replacement file is larger than [`MAX_FILE_BYTES`] or not UTF-8.
    #[error("{}: the replacement rules (text.replacements) {problem}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// A rule of the replacement file cannot be read.
    #[error("{}:{line}: bad replacement rule: {problem}", path.display())]
    Rule {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong and what is expected.
        problem: String,
    },
}

/// What a rule looks for.
#[derive(Debug, Clone)]
enum Pattern {
    Literal(String),
    Regex(Regex),
}

/// One rule: what it looks for and what it puts instead.
#[derive(Debug, Clone)]
struct Rule {
    pattern: Pattern,
    with: String,
}

/// The rules of a replacement file (see the [module](self) docs), in order.
#[derive(Debug, Clone)]
pub struct Replacements {
    path: PathBuf,
    /// The file's text, for [`PartialEq`]: two loads of an unchanged file are equal.
    source: String,
    rules: Vec<Rule>,
}

impl PartialEq for Replacements {
    fn eq(&self, other: &Self) -> bool {
        self.path == other.path && self.source == other.source
    }
}

impl Replacements {
    /// Read and check the rules of `path`.
    ///
    /// # Errors
    /// [`TextError::Read`] when the file cannot be read, [`TextError::File`] when it is over
    /// [`MAX_FILE_BYTES`] or not UTF-8, [`TextError::Rule`] for the first bad rule.
    pub fn load(path: &Path) -> Result<Self, TextError> {
        let read = |source| TextError::Read { path: path.to_owned(), source };
        let len = std::fs::metadata(path).map_err(read)?.len();
        if len > MAX_FILE_BYTES {
            return Err(TextError::File {
                path: path.to_owned(),
                problem: format!("are {len} bytes; the limit is {MAX_FILE_BYTES} bytes"),
            });
        }
        let bytes = std::fs::read(path).map_err(read)?;
        let text = String::from_utf8(bytes).map_err(|e| TextError::File {
            path: path.to_owned(),
            problem: format!("are not UTF-8 (first bad byte at offset {})", e.utf8_error().valid_up_to()),
        })?;
        Self::parse(path, &text)
    }

    /// The rules of `text`, a replacement file's contents; `path` names it in errors.
    ///
    /// # Errors
    /// [`TextError::Rule`] for the first bad rule.
    pub fn parse(path: &Path, text: &str) -> Result<Self, TextError> {
        let mut rules = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let bad = |problem: String| TextError::Rule { path: path.to_owned(), line: i + 1, problem };
            let line = line.trim_start_matches('\u{feff}').trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            rules.push(rule(line).map_err(bad)?);
        }
        Ok(Replacements { path: path.to_owned(), source: text.to_owned(), rules })
    }

    /// The file the rules came from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How many rules there are.
    pub fn len(&self) -> usize {
        self.rules.len()
    }

    /// Whether there are no rules.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// `text` after every rule, in order.
    pub fn apply(&self, text: &str) -> String {
        let mut s = text.to_owned();
        for r in &self.rules {
            s = match &r.pattern {
                Pattern::Literal(l) => s.replace(l.as_str(), &r.with),
                Pattern::Regex(re) => re.replace_all(&s, r.with.as_str()).into_owned(),
            };
        }
        s
    }
}

/// One rule from its (trimmed, non-comment) line.
fn rule(line: &str) -> Result<Rule, String> {
    const HOW: &str = "expected `TEXT => REPLACEMENT` or `/REGEX/ => REPLACEMENT`";
    if line.starts_with('/') {
        // cut at the first `=>` whose left side is a whole `/REGEX/FLAGS` with known flags
        let mut flag_error = None;
        for (at, _) in line.match_indices("=>") {
            let left = line[..at].trim_end();
            let Some(body) = left.strip_prefix('/') else { continue };
            let Some(close) = body.rfind('/') else { continue };
            let (re, flags) = (&body[..close], &body[close + 1..]);
            if let Some(f) = flags.chars().find(|&c| c != 'i') {
                flag_error.get_or_insert_with(|| format!("unknown flag {f:?} after the regex (the only flag is `i`)"));
                continue;
            }
            if re.is_empty() {
                return Err("the regex is empty".into());
            }
            let re = RegexBuilder::new(re)
                .case_insensitive(!flags.is_empty())
                .build()
                .map_err(|e| format!("the regex /{re}/ does not compile: {}", one_line(&e.to_string())))?;
            let with = line[at + 2..].trim().to_owned();
            // check the replacement's group references now, not on the first text
            if let Some(bad) = missing_group(&re, &with) {
                return Err(format!("the replacement names the group {bad}, which /{}/ does not have", re.as_str()));
            }
            return Ok(Rule { pattern: Pattern::Regex(re), with });
        }
        return Err(flag_error.unwrap_or_else(|| format!("{HOW}; a regex rule is `/REGEX/ => REPLACEMENT` (flags: `i`)")));
    }
    let Some((left, right)) = line.split_once("=>") else { return Err(HOW.into()) };
    let left = left.trim();
    if left.is_empty() {
        return Err(format!("the text to replace is empty; {HOW}"));
    }
    Ok(Rule { pattern: Pattern::Literal(left.to_owned()), with: right.trim().to_owned() })
}

/// The regex crate's multi-line messages (a caret under the pattern) on one line.
fn one_line(s: &str) -> String {
    s.lines().map(str::trim).filter(|l| !l.is_empty() && !l.chars().all(|c| c == '^' || c == ' ')).collect::<Vec<_>>().join(" ")
}

/// The first group reference in `with` (`$1`, `${name}`, `$name`) that `re` does not have.
fn missing_group(re: &Regex, with: &str) -> Option<String> {
    let names: Vec<&str> = re.capture_names().flatten().collect();
    let mut rest = with;
    while let Some(i) = rest.find('$') {
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            rest = tail;
            continue;
        }
        let (name, tail) = if let Some(braced) = after.strip_prefix('{') {
            match braced.split_once('}') {
                Some((n, t)) => (n, t),
                None => return None,
            }
        } else {
            let end = after.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(after.len());
            (&after[..end], &after[end..])
        };
        rest = tail;
        if name.is_empty() {
            continue;
        }
        let known = match name.parse::<usize>() {
            Ok(n) => n < re.captures_len(),
            Err(_) => names.contains(&name),
        };
        if !known {
            return Some(format!("${name}"));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Replacements, TextError> {
        Replacements::parse(Path::new("/etc/herald/words.txt"), text)
    }

    #[test]
    fn rules_apply_in_order() {
        let r = parse(
            "# abbreviations\n\nHA => Home Assistant\n/\\bkWh\\b/ => kilowatt hours\n  /(\\d+) ?°C/ => $1 degrees\n\
             /\\bok\\b/i => okay\n(beta) =>\nHome Assistant => Home Assistant, the hub,\n",
        )
        .unwrap();
        assert_eq!(r.len(), 6);
        assert_eq!(
            r.apply("HA used 3 kWh at 21 °C. OK (beta) then."),
            "Home Assistant, the hub, used 3 kilowatt hours at 21 degrees. okay  then."
        );
    }

    #[test]
    fn literals_are_literal_and_regexes_may_hold_slashes_and_arrows() {
        let r = parse("$5 => five dollars\n/a/b=>c/ => x\n/km\\/h/ => kilometres per hour").unwrap();
        assert_eq!(r.apply("$5 and a/b=>c at 50 km/h"), "five dollars and x at 50 kilometres per hour");
        // a literal replacement takes `$` as it is
        assert_eq!(parse("x => $1").unwrap().apply("x"), "$1");
    }

    #[test]
    fn a_bad_rule_names_the_file_and_line() {
        let cases = [
            ("ok => fine\nno arrow here\n", 2, "expected `TEXT => REPLACEMENT`"),
            ("# c\n\n => nothing", 3, "the text to replace is empty"),
            ("/(unclosed/ => x", 1, "does not compile"),
            ("// => x", 1, "the regex is empty"),
            ("/a/g => x", 1, "unknown flag 'g'"),
            ("/a(b)/ => $2", 1, "names the group $2"),
            ("/(?<n>a)/ => ${m}", 1, "names the group $m"),
            ("/no end => x", 1, "a regex rule is"),
        ];
        for (text, line, want) in cases {
            let e = parse(text).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, TextError::Rule { line: l, .. } if l == line), "{text:?}: {msg}");
            assert!(msg.starts_with(&format!("/etc/herald/words.txt:{line}: bad replacement rule: ")), "{msg}");
            assert!(msg.contains(want), "{text:?}: {msg}");
            assert!(!msg.contains('\n'), "one line: {msg:?}");
        }
    }

    #[test]
    fn groups_that_exist_are_fine() {
        let r = parse("/(?<n>\\d+)x/ => ${n} times $$ $1 $0").unwrap();
        assert_eq!(r.apply("3x"), "3 times $ 3 3x");
    }

    #[test]
    fn load_reads_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rules.txt");
        std::fs::write(&path, "\u{feff}HA => Home Assistant\n").unwrap();
        let r = Replacements::load(&path).unwrap();
        assert_eq!(r.apply("HA"), "Home Assistant");
        assert_eq!(r, Replacements::load(&path).unwrap());
        std::fs::write(&path, b"bad \xff byte").unwrap();
        assert!(Replacements::load(&path).unwrap_err().to_string().contains("not UTF-8"));
        let e = Replacements::load(&dir.path().join("missing.txt")).unwrap_err().to_string();
        assert!(e.contains("missing.txt: cannot read the replacement rules (text.replacements)"), "{e}");
    }
}
