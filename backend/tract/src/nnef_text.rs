//! A fast reader for the graph body of the `graph.nnef` files the graph cache writes.
//!
//! tract 0.23.9 parses NNEF text with a `nom` grammar that parses every atom without a
//! subscript twice (`sub` tries `atom "[" … "]"` and then `atom` again, so an invocation's
//! arguments are parsed 2^depth times) and allocates a `VerboseError` on every failed
//! alternative. On a 2-core machine it took 0.3–0.6 s of CPU per 0.6B graph, about a third
//! of a warm start (perf, `docs/performance.md`).
//!
//! What tract's writer prints is a small, regular subset of NNEF: one assignment per line,
//! invocations (optionally generic, `variable<scalar>(…)`) with positional and named
//! arguments, identifiers, numeric, string and logical literals, arrays, tuples, and binary
//! `+ - * /` always in parentheses (`(2 * seq)`, from `tract_nnef::ser::tdim`). [`parse_document`]
//! reads that subset in one pass and builds the very AST tract's parser builds; the header
//! (version, extensions, fragments, the graph's signature) is short and still goes through
//! tract's parser. Anything outside the subset (a comprehension, a subscript, a comparison,
//! a unary operator, an escaped identifier, text tract itself would reject) makes the whole
//! document go through tract's parser, so the result never depends on which path read it.

use tract_nnef::ast::{Argument, Assignment, Document, Identifier, Invocation, LValue, Literal, RValue, TypeName};
use tract_nnef::internal::TractResult;

/// Parse a whole NNEF document as tract's `parse_document` would: the graph body by the fast
/// path when it stays within the subset tract's writer prints, the rest (and any document
/// outside that subset) by tract's parser.
///
/// # Errors
/// tract's parse error, when the document is not valid NNEF.
pub(crate) fn parse_document(text: &str) -> TractResult<Document> {
    match fast(text) {
        Some(doc) => Ok(doc),
        None => {
            log::debug!("graph.nnef: outside the fast reader's subset, read by tract's parser");
            tract_nnef::ast::parse::parse_document(text)
        }
    }
}

/// The fast path: `None` when any part of the body is outside the subset (or tract rejects
/// the header).
pub(crate) fn fast(text: &str) -> Option<Document> {
    // the graph definition is the document's last item; tract's writer puts `graph` at the
    // start of a line, and a newline never occurs inside its strings (they are escaped)
    let graph = if text.starts_with("graph ") { 0 } else { text.find("\ngraph ")? + 1 };
    let open = graph + text[graph..].find('{')?;
    let mut header = String::with_capacity(open + 4);
    header.push_str(&text[..=open]);
    header.push_str("\n}\n");
    let mut doc = tract_nnef::ast::parse::parse_document(&header).ok()?;
    // a `{` found before the real body's (one in a comment of the signature) would make the
    // header swallow assignments
    if !doc.graph_def.body.is_empty() {
        return None;
    }
    let mut p = Parser { s: text.as_bytes(), text, i: open + 1 };
    let mut body = Vec::new();
    loop {
        p.ws();
        if p.eat(b'}') {
            break;
        }
        body.push(p.assignment()?);
    }
    p.ws();
    if p.i != p.s.len() {
        return None;
    }
    doc.graph_def.body = body;
    Some(doc)
}

/// A cursor over the body text. Every method returns `None` for text outside the subset.
struct Parser<'a> {
    s: &'a [u8],
    text: &'a str,
    i: usize,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    /// Skip spaces, tabs, newlines and `#` comments, as tract's `space_and_comments`.
    fn ws(&mut self) {
        while let Some(c) = self.peek() {
            match c {
                b' ' | b'\t' | b'\n' | b'\r' => self.i += 1,
                b'#' => {
                    while !matches!(self.peek(), None | Some(b'\n' | b'\r')) {
                        self.i += 1;
                    }
                }
                _ => break,
            }
        }
    }

    /// After spaces, consume `c` if it is next.
    fn eat(&mut self, c: u8) -> bool {
        self.ws();
        if self.peek() == Some(c) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, c: u8) -> Option<()> {
        self.eat(c).then_some(())
    }

    /// A direct identifier, `[A-Za-z_][A-Za-z0-9_]*` (nom's ASCII `alpha1`/`alphanumeric1`).
    /// An escaped one (`i"…"`) is outside the subset.
    fn identifier(&mut self) -> Option<&'a str> {
        self.ws();
        let start = self.i;
        match self.peek() {
            Some(c) if c.is_ascii_alphabetic() || c == b'_' => self.i += 1,
            _ => return None,
        }
        while matches!(self.peek(), Some(c) if c.is_ascii_alphanumeric() || c == b'_') {
            self.i += 1;
        }
        let id = &self.text[start..self.i];
        if id == "i" && matches!(self.peek(), Some(b'"' | b'\'')) {
            return None;
        }
        Some(id)
    }

    /// `<lvalue> "=" <rvalue> ";"`
    fn assignment(&mut self) -> Option<Assignment> {
        let mut lvalues = vec![self.lvalue()?];
        while self.eat(b',') {
            lvalues.push(self.lvalue()?);
        }
        let left = if lvalues.len() == 1 { lvalues.pop()? } else { LValue::Tuple(lvalues) };
        self.expect(b'=')?;
        if self.peek() == Some(b'=') {
            return None;
        }
        let right = self.rvalue()?;
        self.expect(b';')?;
        Some(Assignment { left, right })
    }

    /// tract's `inner_lvalue`: an identifier, or a bracketed or parenthesized list (kept as a
    /// one-element array or tuple).
    fn lvalue(&mut self) -> Option<LValue> {
        self.ws();
        let (close, array) = match self.peek() {
            Some(b'[') => (b']', true),
            Some(b'(') => (b')', false),
            _ => return Some(LValue::Identifier(Identifier::from(self.identifier()?))),
        };
        self.i += 1;
        let mut items = Vec::new();
        if !self.eat(close) {
            loop {
                items.push(self.lvalue()?);
                if self.eat(close) {
                    break;
                }
                self.expect(b',')?;
            }
        }
        Some(if array { LValue::Array(items) } else { LValue::Tuple(items) })
    }

    /// An atom, optionally followed by one binary `+ - * /` and a second atom: what
    /// `tract_nnef::ser::tdim` prints inside parentheses. A second operator, or any other
    /// operator, subscript or keyword after an atom, is outside the subset.
    fn rvalue(&mut self) -> Option<RValue> {
        let left = self.atom()?;
        self.ws();
        match self.peek()? {
            b',' | b')' | b']' | b';' => Some(left),
            op @ (b'+' | b'-' | b'*' | b'/') => {
                self.i += 1;
                let right = self.atom()?;
                self.ws();
                matches!(self.peek()?, b',' | b')' | b']' | b';')
                    .then(|| RValue::Binary(Box::new(left), (op as char).to_string(), Box::new(right)))
            }
            _ => None,
        }
    }

    fn atom(&mut self) -> Option<RValue> {
        self.ws();
        match self.peek()? {
            b'"' | b'\'' => Some(RValue::Literal(Literal::String(self.string()?))),
            b'0'..=b'9' | b'-' => Some(RValue::Literal(Literal::Numeric(self.numeric()?))),
            b'[' => {
                self.i += 1;
                if self.empty(b']')? {
                    return Some(RValue::Array(vec![]));
                }
                // `[for …` is a comprehension (tract tries it before an array)
                self.ws();
                if self.s[self.i..].starts_with(b"for") {
                    return None;
                }
                Some(RValue::Array(self.list(b']')?))
            }
            b'(' => {
                self.i += 1;
                if self.empty(b')')? {
                    return Some(RValue::Tuple(vec![]));
                }
                let mut items = self.list(b')')?;
                Some(if items.len() == 1 { items.pop()? } else { RValue::Tuple(items) })
            }
            _ => {
                let id = self.identifier()?;
                let after = self.i;
                self.ws();
                match self.peek() {
                    Some(b'(') => self.invocation(id, None),
                    Some(b'<') => {
                        self.i += 1;
                        let name = self.identifier_or_any()?;
                        let generic = match name {
                            "integer" => TypeName::Integer,
                            "scalar" => TypeName::Scalar,
                            "logical" => TypeName::Logical,
                            "string" => TypeName::String,
                            "?" => TypeName::Any,
                            _ => return None,
                        };
                        self.expect(b'>')?;
                        self.ws();
                        (self.peek() == Some(b'(')).then_some(())?;
                        self.invocation(id, Some(generic))
                    }
                    _ => {
                        self.i = after;
                        // tract tries its literals before identifiers: `true`, `false` and
                        // `inf` are literals, and a longer word starting with one of them
                        // is misread by tract (so left to it)
                        match id {
                            "true" => Some(RValue::Literal(Literal::Logical(true))),
                            "false" => Some(RValue::Literal(Literal::Logical(false))),
                            "inf" => Some(RValue::Literal(Literal::Numeric("inf".into()))),
                            _ if ["true", "false", "inf"].iter().any(|k| id.starts_with(k)) => None,
                            _ => Some(RValue::Identifier(Identifier::from(id))),
                        }
                    }
                }
            }
        }
    }

    /// A generic type name: an identifier, or `?`.
    fn identifier_or_any(&mut self) -> Option<&'a str> {
        self.ws();
        if self.peek() == Some(b'?') {
            self.i += 1;
            return Some("?");
        }
        self.identifier()
    }

    /// `id [<type>] "(" [<argument> ("," <argument>)*] ")"`, the cursor on `(`.
    fn invocation(&mut self, id: &str, generic_type_name: Option<TypeName>) -> Option<RValue> {
        let id = Identifier::from(id);
        self.expect(b'(')?;
        let mut arguments = Vec::new();
        if !self.eat(b')') {
            loop {
                arguments.push(self.argument()?);
                if self.eat(b')') {
                    break;
                }
                self.expect(b',')?;
            }
        }
        Some(RValue::Invocation(Invocation { id, generic_type_name, arguments }))
    }

    /// `[<identifier> "="] <rvalue>`
    fn argument(&mut self) -> Option<Argument> {
        self.ws();
        let start = self.i;
        if let Some(name) = self.identifier() {
            let name = Identifier::from(name);
            self.ws();
            if self.peek() == Some(b'=') && self.s.get(self.i + 1) != Some(&b'=') {
                self.i += 1;
                return Some(Argument { id: Some(name), rvalue: self.rvalue()? });
            }
        }
        self.i = start;
        Some(Argument { id: None, rvalue: self.rvalue()? })
    }

    /// After an array's or a tuple's opening bracket: `Some(true)` (and `close` consumed) when
    /// it closes right away, `Some(false)` when an element follows, `None` when only spaces or
    /// comments come before `close`: tract's array and tuple atoms match their brackets with a
    /// plain `tag`, so it rejects `[ ]` and `( )`.
    fn empty(&mut self, close: u8) -> Option<bool> {
        if self.peek() == Some(close) {
            self.i += 1;
            return Some(true);
        }
        let at = self.i;
        self.ws();
        let only_space = self.peek() == Some(close);
        self.i = at;
        (!only_space).then_some(false)
    }

    /// Comma-separated rvalues up to `close` (consumed), at least one.
    fn list(&mut self, close: u8) -> Option<Vec<RValue>> {
        let mut items = Vec::new();
        loop {
            items.push(self.rvalue()?);
            if self.eat(close) {
                return Some(items);
            }
            self.expect(b',')?;
        }
    }

    /// tract's `numeric_literal`, kept as text: `-?(digits|inf)(.digits*)?([eE][+-]?digits)?`.
    fn numeric(&mut self) -> Option<String> {
        let start = self.i;
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        if self.s[self.i..].starts_with(b"inf") {
            self.i += 3;
        } else {
            let d = self.i;
            while matches!(self.peek(), Some(b'0'..=b'9')) {
                self.i += 1;
            }
            if self.i == d {
                // a unary minus, outside the subset
                return None;
            }
        }
        if self.peek() == Some(b'.') {
            self.i += 1;
            while matches!(self.peek(), Some(b'0'..=b'9')) {
                self.i += 1;
            }
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            let mut j = self.i + 1;
            if matches!(self.s.get(j), Some(b'+' | b'-')) {
                j += 1;
            }
            let d = j;
            while matches!(self.s.get(j), Some(b'0'..=b'9')) {
                j += 1;
            }
            if j > d {
                self.i = j;
            }
        }
        // a letter or `_` right after the number (`2x`, `1e`) is text tract misreads
        if matches!(self.peek(), Some(c) if c.is_ascii_alphanumeric() || c == b'_' || c == b'.') {
            return None;
        }
        Some(self.text[start..self.i].to_owned())
    }

    /// tract's `string_literal`: `'…'` or `"…"`; a backslash takes the next character as is
    /// (`\n` reads as `n`), and neither quote may occur unescaped inside.
    fn string(&mut self) -> Option<String> {
        let quote = self.peek()?;
        self.i += 1;
        let mut out = String::new();
        loop {
            let c = self.text.get(self.i..)?.chars().next()?;
            self.i += c.len_utf8();
            match c {
                '\\' => {
                    let e = self.text.get(self.i..)?.chars().next()?;
                    self.i += e.len_utf8();
                    out.push(e);
                }
                '"' | '\'' => return (c as u32 == u32::from(quote)).then_some(out),
                c => out.push(c),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tract(text: &str) -> Document {
        tract_nnef::ast::parse::parse_document(text).unwrap()
    }

    const HEADER: &str = "version 1.0;\n\nextension tract_registry tract_core;\n\ngraph network(x) -> (y) {\n";

    #[test]
    fn what_tract_writes_reads_as_tract_reads_it() {
        let body = r#"
  x = tract_core_external(shape = [1, seq, 1024], datum_type = "F32");
  w = variable<scalar>(label = "layer0/n_Mul_20.fix-rank.1", shape = [1, 1, 1024]);
  a = herald_einsum([x, w], expr = "abk,nk->abn", acc = "f32");
  b = reshape(a, shape = [(2 * seq)], axis_start = 2, axis_count = 2);
  c = herald_slice(b, axis = 1, start = ((past + seq) - 1), end = (past + (2 * seq)));
  ( d, e ) = split(c, axis = 0, ratios = [1, 1]);
  f = mul(d, -1.5e-3, t = true, u = false, v = -inf, s = 'it\"s', n = [], m = ());
  # a comment
  g = tract_core_cast(8, to = "i64", q = (1, "two", [3.0, 4.]), k = 1E+5);
  y = g;
"#;
        let text = format!("{HEADER}{body}}}\n");
        let fast = fast(&text).expect("inside the subset");
        assert_eq!(fast, tract(&text));
        assert_eq!(fast.graph_def.body.len(), 9);
    }

    #[test]
    fn outside_the_subset_goes_to_tracts_parser() {
        for body in [
            "  y = -x;\n",                        // unary minus
            "  y = a + b;\n  z = (a + b * c);\n", // no parentheses / precedence
            "  y = [for i in x yield i];\n",      // comprehension
            "  y = x[0];\n",                      // subscript
            "  y = a if c else b;\n",             // if-else
            "  y = (a == b);\n",                  // comparison
            "  y = i\"odd name\";\n",             // escaped identifier
            "  y = f(info);\n",                   // a word tract reads as `inf` + `o`
            "  y = f(x, n = [ ]);\n",             // tract's `[`…`]` takes no inner space
            "  y = ( # nothing\n );\n",           // nor does its `(`…`)`
        ] {
            let text = format!("{HEADER}{body}}}\n");
            assert!(fast(&text).is_none(), "{body}");
            // and the public entry point still gives tract's answer, or tract's error
            match tract_nnef::ast::parse::parse_document(&text) {
                Ok(doc) => assert_eq!(parse_document(&text).unwrap(), doc, "{body}"),
                Err(_) => assert!(parse_document(&text).is_err(), "{body}"),
            }
        }
    }

    #[test]
    fn broken_text_is_an_error_not_a_different_model() {
        for body in ["  y = f(x;\n", "  y = \"open;\n", "  y = f(x)\n", "  y = f(x);\n  junk\n"] {
            let text = format!("{HEADER}{body}}}\n");
            assert!(fast(&text).is_none(), "{body}");
            assert!(parse_document(&text).is_err(), "{body}");
        }
        assert!(parse_document(&format!("{HEADER}  y = x;\n}}\ntrailing")).is_err());
    }

    #[test]
    fn a_brace_in_a_signature_comment_is_left_to_tract() {
        // the first `{` after `graph` is in a comment: the header would hold an assignment
        let text = "version 1.0;\ngraph\tnet(x) -> (y) {\ngraph = foo(x);\n# {\n  y = bar(graph);\n}\n";
        assert!(fast(text).is_none());
        let doc = parse_document(text).unwrap();
        assert_eq!(doc, tract(text));
        assert_eq!(doc.graph_def.body.len(), 2);
    }
}
