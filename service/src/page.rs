//! herald's web page, `GET /` on the HTTP port ([`crate::http`]): a text box, the voice and
//! language pickers filled from `GET /v1/audio/voices`, the format and the speed; it plays the
//! `pcm` stream of `POST /v1/audio/speech` as it arrives (Web Audio, one `AudioBuffer` per
//! chunk scheduled back to back) and shows the time to first audio and the RTF.
//!
//! The page is one file, `service/src/page.html`, compiled in: inline CSS and JS, no font,
//! script or image from anywhere else, so it works on a LAN without internet. It holds no
//! secret, so it needs no API key; its API calls do, and when `/v1/audio/voices` answers 401
//! it asks for the key and keeps it in the tab's `sessionStorage` only.
//!
//! # Content Security Policy
//!
//! The answer carries a policy that lets the page's own inline `<script>` and `<style>` run by
//! their SHA-256 hashes (computed once from the page, [`content_security_policy`]), not by
//! `'unsafe-inline'`: a script injected into the page some day (an `onclick=` attribute, a
//! `<script>` from text that got into the HTML) would not run. The page makes no inline style
//! attributes or event handler attributes for that reason. Everything else is `'self'`
//! (`fetch` to the API), `blob:` for the downloaded audio in the player, and the page cannot
//! be framed, change its base URL or post a form anywhere.

use std::sync::OnceLock;

use sha2::{Digest, Sha256};

/// The page, as served (UTF-8 HTML).
pub const PAGE: &str = include_str!("page.html");

/// The `Content-Security-Policy` of [`PAGE`]: `default-src 'self'`, its one inline script and
/// its one inline style allowed by their SHA-256 hashes (base64, CSP level 2 hash sources),
/// `blob:` media for the player, no framing, no `<base>`, no form posts.
pub fn content_security_policy() -> &'static str {
    static CSP: OnceLock<String> = OnceLock::new();
    CSP.get_or_init(|| {
        let script = hash_source(inline(PAGE, "script"));
        let style = hash_source(inline(PAGE, "style"));
        format!(
            "default-src 'self'; script-src '{script}'; style-src '{style}'; media-src 'self' blob:; \
             img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
        )
    })
}

/// The text between `<tag>` and `</tag>` in `html` (the first such element), what a browser
/// hashes for a CSP hash source; empty when there is none.
fn inline<'a>(html: &'a str, tag: &str) -> &'a str {
    let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
    html.split_once(&open).and_then(|(_, rest)| rest.split_once(&close)).map_or("", |(body, _)| body)
}

/// `sha256-<base64 of the SHA-256 of text>`, a CSP hash source.
fn hash_source(text: &str) -> String {
    format!("sha256-{}", base64::encode(Sha256::digest(text.as_bytes())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_names_the_hashes_of_the_inline_script_and_style() {
        // the SHA-256 of "abc" (FIPS 180-2's example), in base64
        assert_eq!(hash_source("abc"), "sha256-ungWv48Bz+pBQUDeXa4iI7ADYaOWF3qctBD/YfIAFa0=");
        assert_eq!(inline("<p><script>\nx()\n</script><script>y</script>", "script"), "\nx()\n");
        assert_eq!(inline("<p>", "style"), "");
        let csp = content_security_policy();
        assert!(csp.starts_with("default-src 'self'; script-src 'sha256-"), "{csp}");
        assert!(!csp.contains("unsafe"), "{csp}");
        assert!(csp.contains(&format!("'{}'", hash_source(inline(PAGE, "script")))), "{csp}");
        assert!(csp.contains(&format!("'{}'", hash_source(inline(PAGE, "style")))), "{csp}");
    }

    #[test]
    fn the_page_is_self_contained() {
        assert!(PAGE.starts_with("<!doctype html>"));
        assert_eq!(PAGE.matches("<script").count(), 1, "one inline script, the one the policy hashes");
        assert_eq!(PAGE.matches("<style").count(), 1, "one inline style, the one the policy hashes");
        // nothing from elsewhere: no URL, no src or link, no CSS import
        for external in ["http://", "https://", "src=", "<link", "@import", "url("] {
            assert!(!PAGE.contains(external), "{external:?} in the page");
        }
        // nothing the policy would block in the markup: event handler or style attributes
        let markup = PAGE.replace(inline(PAGE, "script"), "");
        let attribute = regex::Regex::new(r"\s(on[a-z]+|style)\s*=").unwrap();
        assert_eq!(attribute.find(&markup).map(|m| m.as_str()), None);
    }
}
