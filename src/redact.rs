//! Keeping secrets out of what tenants, models and logs see: text from
//! outside (a provider's error message) with anything key-like masked, and
//! URLs reduced to where they point.
//!
//! A leaf: it imports nothing of the project, so every layer may use it.

use std::fmt;
use std::sync::LazyLock;

use percent_encoding::percent_decode_str;
use regex::{Captures, Regex};

/// What stands in for a masked secret.
pub const MASK: &str = "[redacted]";

/// The longest outside message passed on, in characters.
pub const MAX_MESSAGE_CHARS: usize = 500;

/// Secret-shaped pieces of text, most specific first. The last one catches
/// long random-looking tokens (keys, signatures, JWT segments) by their
/// shape; `looks_random` decides.
static PATTERNS: LazyLock<[Regex; 4]> = LazyLock::new(|| {
    [
        // A bearer credential.
        Regex::new(r"(?i)\b(bearer)\s+[A-Za-z0-9._~+/=-]+"),
        // `api_key=…`, `"x-api-key": "…"`, `password: …` and the like; the
        // whole name must match, so `max_tokens: 8192` stays.
        Regex::new(
            r#"(?i)\b((?:x-)?api[_-]?key|key|(?:access|refresh|auth|id)?[_-]?token|(?:client[_-]?)?secret|password|passwd|signature|sig|credentials?)\b(["']?\s*[:=]\s*["']?)[^\s"'&,;}]+"#,
        ),
        // Provider keys: `sk-…`, `sk-ant-…`, `sk-proj-…`, `pk-…`, `rk-…`.
        Regex::new(r"\b(?:sk|pk|rk)-[A-Za-z0-9_-]{6,}"),
        Regex::new(r"[A-Za-z0-9+/=_-]{24,}"),
    ]
    .map(|pattern| pattern.expect("the redaction patterns are valid"))
});

/// Long, and mixing digits with letters, as generated tokens do; words,
/// identifiers in snake case and most model names do not.
fn looks_random(token: &str) -> bool {
    let digits = token.chars().filter(char::is_ascii_digit).count();
    let letters = token.chars().filter(char::is_ascii_alphabetic).count();
    token.len() >= 32 && digits >= 4 && letters >= 4
}

/// The text with anything that looks like a key, token or password masked.
pub fn secrets(text: &str) -> String {
    let [scheme, assignment, provider_key, long] = &*PATTERNS;
    let text = scheme.replace_all(text, |c: &Captures| format!("{} {MASK}", &c[1]));
    let text = assignment.replace_all(&text, |c: &Captures| format!("{}{}{MASK}", &c[1], &c[2]));
    let text = provider_key.replace_all(&text, MASK);
    long.replace_all(&text, |c: &Captures| {
        if looks_random(&c[0]) {
            MASK.to_owned()
        } else {
            c[0].to_owned()
        }
    })
    .into_owned()
}

/// An outside message as it may be shown and stored: secrets masked, at
/// most `MAX_MESSAGE_CHARS` characters.
pub fn message(text: &str) -> String {
    let text = secrets(text.trim());
    match text.char_indices().nth(MAX_MESSAGE_CHARS) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
    }
}

/// Where a URL points, for logs and `Debug`: its scheme, host and port,
/// never its user, path or query (webhook URLs carry tokens there).
pub fn origin(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "<not a URL>".to_owned();
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host = authority.rsplit('@').next().unwrap_or_default();
    format!("{scheme}://{host}")
}

/// Words that make a parameter's name a secret's, whatever its value looks
/// like (`hook_token`, `apiKey`, `X-Amz-Signature`, `client_secret`, `pwd`).
const SECRET_NAMES: [&str; 8] = [
    "token",
    "key",
    "secret",
    "sig",
    "pass",
    "pwd",
    "auth",
    "credential",
];

/// Whether a parameter's name names a secret, read as the server that gets
/// it reads it: percent escapes decoded (`hook%5Ftoken` is `hook_token`).
fn names_a_secret(name: &str) -> bool {
    let name = percent_decode_str(name)
        .decode_utf8_lossy()
        .to_ascii_lowercase();
    SECRET_NAMES.iter().any(|word| name.contains(word))
}

/// `name=value&…` (a query, or a fragment such as an implicit grant's
/// redirect) with the value of every secret-named parameter masked, and
/// anything key-like in the others.
fn parameters(pairs: &str) -> String {
    pairs
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if names_a_secret(name) => format!("{name}={MASK}"),
            _ => secrets(pair),
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// A URL as it may be printed where its owner reads it (a start-up
/// error, an operator's answer): user, host, port, path and query kept, a
/// password removed, the values of secret-named query and fragment
/// parameters masked, and secret-looking text anywhere else masked.
pub fn url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return secrets(url);
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let authority = match authority.rsplit_once('@') {
        Some((user, host)) => {
            let user = user.split(':').next().unwrap_or_default();
            format!("{user}@{host}")
        }
        None => authority.to_owned(),
    };
    let (path, tail) = tail.split_at(tail.find(['?', '#']).unwrap_or(tail.len()));
    let (query, fragment) = tail.split_at(tail.find('#').unwrap_or(tail.len()));
    let query = match query.strip_prefix('?') {
        Some(pairs) => format!("?{}", parameters(pairs)),
        None => String::new(),
    };
    let fragment = match fragment.strip_prefix('#') {
        Some(pairs) if pairs.contains('=') => format!("#{}", parameters(pairs)),
        Some(text) => format!("#{}", secrets(text)),
        None => String::new(),
    };
    format!("{scheme}://{authority}{}{query}{fragment}", secrets(path))
}

/// `Debug` for an optional secret: whether it is there, never what it is.
pub struct Hidden<'a, T>(pub &'a Option<T>);

impl<T> fmt::Debug for Hidden<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(_) => write!(f, "Some({MASK})"),
            None => f.write_str("None"),
        }
    }
}

/// `Debug` for a URL that may carry a secret: its origin only.
pub struct Origin<'a>(pub &'a str);

impl fmt::Debug for Origin<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{}/{MASK}\"", origin(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_tokens_and_assignments_are_masked() {
        let cases = [
            (
                "invalid x-api-key sk-ant-api03-AbCdEf123456",
                "invalid x-api-key [redacted]",
            ),
            (
                "Incorrect API key provided: sk-proj-abc123XYZ",
                "Incorrect API key provided: [redacted]",
            ),
            (
                "header Authorization: Bearer eyJhbGciOi.e30.sig",
                "header Authorization: Bearer [redacted]",
            ),
            (
                "GET /hook?api_key=hunter2&x=1",
                "GET /hook?api_key=[redacted]&x=1",
            ),
            (r#"{"password": "p4ss"}"#, r#"{"password": "[redacted]"}"#),
            (
                "signed with 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
                "signed with [redacted]",
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(secrets(text), expected, "{text}");
        }
    }

    #[test]
    fn ordinary_words_and_model_names_stay() {
        for text in [
            "model: claude-3-5-sonnet-20241022 not found",
            "overloaded_error: the servers are overloaded right now",
            "max_tokens: 8192 > 4096, which is the maximum allowed",
            "request_id req_011CSHoEeqs5C35K2UUqR7Fy",
        ] {
            assert_eq!(secrets(text), text);
        }
    }

    #[test]
    fn messages_are_capped_on_a_character_boundary() {
        let long = "é".repeat(MAX_MESSAGE_CHARS + 10);
        let capped = message(&long);
        assert_eq!(capped.chars().count(), MAX_MESSAGE_CHARS + 1);
        assert!(capped.ends_with('…'));
        assert_eq!(message("  short  "), "short");
    }

    #[test]
    fn urls_lose_their_password_only() {
        assert_eq!(
            url("postgres://tether:s3cr3t@db.internal:5433/tether?sslmode=require&password=p"),
            "postgres://tether@db.internal:5433/tether?sslmode=require&password=[redacted]"
        );
        assert_eq!(
            url("postgres://postgres@127.0.0.1:1/x"),
            "postgres://postgres@127.0.0.1:1/x"
        );
        assert_eq!(
            url("sqlite:///no/such/dir/t.db?mode=rwc"),
            "sqlite:///no/such/dir/t.db?mode=rwc"
        );
        assert_eq!(url("sqlite:t.db"), "sqlite:t.db");
    }

    #[test]
    fn secret_named_query_parameters_are_masked_whatever_their_value() {
        assert_eq!(
            url("https://hooks.example.com/in?hook_token=abc&channel=ops&apiKey=k#top"),
            "https://hooks.example.com/in?hook_token=[redacted]&channel=ops&apiKey=[redacted]#top"
        );
        assert_eq!(
            url("https://s3.example.com/b/o?X-Amz-Signature=f00&X-Amz-Expires=60"),
            "https://s3.example.com/b/o?X-Amz-Signature=[redacted]&X-Amz-Expires=60"
        );
    }

    #[test]
    fn encoded_names_short_names_and_fragment_parameters_are_masked() {
        // A name written with percent escapes names the same parameter.
        assert_eq!(
            url("https://h.example.com/in?hook%5Ftoken=abc&%61pi_key=k&x=1"),
            "https://h.example.com/in?hook%5Ftoken=[redacted]&%61pi_key=[redacted]&x=1"
        );
        assert_eq!(
            url("ftp://h.example.com/f?user=u&pwd=hunter2"),
            "ftp://h.example.com/f?user=u&pwd=[redacted]"
        );
        // An implicit grant's redirect carries its token in the fragment.
        assert_eq!(
            url("https://app.example.com/cb#access_token=abc&state=s&expires_in=3600"),
            "https://app.example.com/cb#access_token=[redacted]&state=s&expires_in=3600"
        );
        assert_eq!(
            url("https://app.example.com/cb?x=1#id%5Ftoken=abc"),
            "https://app.example.com/cb?x=1#id%5Ftoken=[redacted]"
        );
    }

    #[test]
    fn origins_drop_user_path_and_query() {
        assert_eq!(
            origin("https://user:pw@hooks.example.com:8443/T0/B1/s3cr3t?token=x#f"),
            "https://hooks.example.com:8443"
        );
        assert_eq!(origin("http://127.0.0.1:9?key=k"), "http://127.0.0.1:9");
        assert_eq!(origin("s3cr3t"), "<not a URL>");
        let hidden = format!(
            "{:?} {:?}",
            Hidden(&Some("s3cr3t")),
            Hidden::<String>(&None)
        );
        assert_eq!(hidden, "Some([redacted]) None");
        assert_eq!(
            format!("{:?}", Origin("http://h:1/p/s3cr3t")),
            "\"http://h:1/[redacted]\""
        );
    }
}
