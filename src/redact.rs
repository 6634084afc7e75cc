//! Keeping credentials out of every output: `check-config`, logs, errors and endpoints.
//!
//! - [`redact_uri`] hides what a MongoDB or AMQP URI can carry as a secret: the password of
//!   the user part, the values of the options the MongoDB connection-string spec calls
//!   sensitive (`tlsCertificateKeyFilePassword`, `proxyPassword`, the values of
//!   `authMechanismProperties` such as `AWS_SESSION_TOKEN`), and any option whose name says
//!   password, secret or token.
//! - [`remember`] records the secrets of the configured URIs (and the whole content of a
//!   `uri_file` that is not a URI) once the configuration is loaded; [`redact_text`] replaces
//!   them, and any URI it finds, in free text: driver errors (lapin's "Invalid URL: '...'"
//!   quotes the whole URI), log lines ([`RedactingWriter`]), the command line's error output.

use std::io::Write;
use std::sync::{PoisonError, RwLock};

/// What a hidden value is shown as.
pub const HIDDEN: &str = "***";

/// Connection-string options whose value is a secret (compared in lower case).
const SECRET_OPTIONS: &[&str] = &[
    "password",
    "tlscertificatekeyfilepassword",
    "sslclientcertificatekeypassword",
    "proxypassword",
];

/// Schemes whose URIs [`redact_text`] looks for.
const SCHEMES: &[&str] = &["mongodb+srv://", "mongodb://", "amqps://", "amqp://"];

/// Secrets shorter than this are hidden where a URI holds them, but not searched for in free
/// text (a one-letter password would otherwise blank every such letter of every log line).
const MIN_FREE_TEXT_SECRET: usize = 3;

static SECRETS: RwLock<Vec<String>> = RwLock::new(Vec::new());

fn secret_option(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    SECRET_OPTIONS.contains(&key.as_str())
        || ["password", "secret", "token"]
            .iter()
            .any(|w| key.contains(w))
}

/// `uri` with every credential it carries replaced by `***`. Hosts, user name, database and
/// the other options are kept, so the output still says where timeoutd connects.
pub fn redact_uri(uri: &str) -> String {
    let Some((head, before_query, query)) = parts(uri) else {
        return uri.to_string();
    };
    // The user part ends at the last `@` before the query, so an unencoded `/` in a
    // password is hidden too.
    let shown = match before_query.rsplit_once('@') {
        Some((userinfo, after)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{user}:{HIDDEN}@{after}"),
            None => before_query.to_string(),
        },
        None => before_query.to_string(),
    };
    let mut out = format!("{head}{shown}");
    if let Some(query) = query {
        out.push('?');
        out.push_str(&redact_query(query));
    }
    out
}

/// `uri` as its scheme with `://`, what follows up to the query, and the query.
fn parts(uri: &str) -> Option<(&str, &str, Option<&str>)> {
    let (head, rest) = uri.split_at(uri.find("://")? + 3);
    let (before_query, query) = rest
        .split_once('?')
        .map_or((rest, None), |(b, q)| (b, Some(q)));
    Some((head, before_query, query))
}

fn redact_query(query: &str) -> String {
    let pairs: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((k, _)) if secret_option(k) => format!("{k}={HIDDEN}"),
            Some((k, v)) if k.eq_ignore_ascii_case("authMechanismProperties") => {
                format!("{k}={}", redact_properties(v))
            }
            _ => pair.to_string(),
        })
        .collect();
    pairs.join("&")
}

/// `NAME:value,NAME:value` (possibly percent-encoded) with every value hidden.
fn redact_properties(v: &str) -> String {
    let decoded = percent_decode(v);
    let shown: Vec<String> = decoded
        .split(',')
        .map(|p| match p.split_once(':') {
            Some((name, _)) => format!("{name}:{HIDDEN}"),
            None => HIDDEN.to_string(),
        })
        .collect();
    shown.join(",")
}

/// The secret values `uri` carries, as written and percent-decoded.
fn secrets_of(uri: &str) -> Vec<String> {
    let mut found = Vec::new();
    let Some((_, before_query, query)) = parts(uri) else {
        return found;
    };
    if let Some((userinfo, _)) = before_query.rsplit_once('@')
        && let Some((_, password)) = userinfo.split_once(':')
    {
        found.push(password.to_string());
    }
    for pair in query.unwrap_or_default().split('&') {
        let Some((k, v)) = pair.split_once('=') else {
            continue;
        };
        if secret_option(k) {
            found.push(v.to_string());
        } else if k.eq_ignore_ascii_case("authMechanismProperties") {
            for p in percent_decode(v).split(',') {
                if let Some((_, value)) = p.split_once(':') {
                    found.push(value.to_string());
                }
            }
        }
    }
    let decoded: Vec<String> = found.iter().map(|s| percent_decode(s)).collect();
    found.extend(decoded);
    found.retain(|s| !s.is_empty());
    found.sort();
    found.dedup();
    found
}

/// Remembers the secrets of a configured URI, and the whole `text` when it came from a file
/// and is not a URI (a misplaced secret), for [`redact_text`].
pub fn remember(text: &str, from_file: bool) {
    let mut secrets = secrets_of(text);
    if from_file && !text.contains("://") && !text.is_empty() {
        secrets.push(text.to_string());
    }
    let mut known = SECRETS.write().unwrap_or_else(PoisonError::into_inner);
    for s in secrets {
        if s.chars().count() >= MIN_FREE_TEXT_SECRET && !known.contains(&s) {
            known.push(s);
        }
    }
    // Longest first, so a secret containing another is replaced whole.
    known.sort_by_key(|s| std::cmp::Reverse(s.len()));
}

/// `text` with every URI in it passed through [`redact_uri`] and every remembered secret
/// replaced by `***`.
pub fn redact_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some((at, scheme)) = SCHEMES
        .iter()
        .filter_map(|s| rest.find(s).map(|i| (i, *s)))
        .min_by_key(|(i, _)| *i)
    {
        out.push_str(&rest[..at]);
        let uri_len = rest[at + scheme.len()..]
            .find(|c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '`' | '<' | '>'))
            .map_or(rest.len() - at, |end| end + scheme.len());
        out.push_str(&redact_uri(&rest[at..at + uri_len]));
        rest = &rest[at + uri_len..];
    }
    out.push_str(rest);
    let known = SECRETS.read().unwrap_or_else(PoisonError::into_inner);
    for secret in known.iter() {
        if out.contains(secret.as_str()) {
            out = out.replace(secret.as_str(), HIDDEN);
        }
    }
    out
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A log writer that passes each formatted event through [`redact_text`] on its way to
/// stderr (tracing-subscriber writes an event with one `write_all`).
#[derive(Debug, Default, Clone, Copy)]
pub struct RedactingWriter;

impl Write for RedactingWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let text = String::from_utf8_lossy(buf);
        std::io::stderr().write_all(redact_text(&text).as_bytes())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for RedactingWriter {
    type Writer = RedactingWriter;

    fn make_writer(&'a self) -> Self::Writer {
        *self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hides_the_password_and_keeps_the_rest() {
        assert_eq!(
            redact_uri("amqp://guest:secret@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            redact_uri("mongodb://u:p@ss@h1:1,h2:2/db?w=majority"),
            "mongodb://u:***@h1:1,h2:2/db?w=majority"
        );
        assert_eq!(
            redact_uri("mongodb://127.0.0.1:27017"),
            "mongodb://127.0.0.1:27017"
        );
        assert_eq!(redact_uri("mongodb://user@h/"), "mongodb://user@h/");
        assert_eq!(redact_uri("amqp://u:a/b@h/v"), "amqp://u:***@h/v");
    }

    #[test]
    fn hides_every_secret_option() {
        let uri = "mongodb://u:pw1@h/db?tls=true&tlsCertificateKeyFilePassword=hunter2\
                   &authMechanism=MONGODB-AWS\
                   &authMechanismProperties=AWS_SESSION_TOKEN:tok3n,SERVICE_NAME:svc\
                   &proxyPassword=prox&sslClientCertificateKeyPassword=legacy&appname=x";
        let shown = redact_uri(uri);
        assert_eq!(
            shown,
            "mongodb://u:***@h/db?tls=true&tlsCertificateKeyFilePassword=***\
             &authMechanism=MONGODB-AWS\
             &authMechanismProperties=AWS_SESSION_TOKEN:***,SERVICE_NAME:***\
             &proxyPassword=***&sslClientCertificateKeyPassword=***&appname=x"
        );
        let encoded = "mongodb://h/?authMechanismProperties=AWS_SESSION_TOKEN%3Atok3n";
        assert!(!redact_uri(encoded).contains("tok3n"));
        assert!(!redact_uri("amqps://h/?password=keypw").contains("keypw"));
    }

    #[test]
    fn finds_uris_and_remembered_secrets_in_free_text() {
        // (The secrets are process-wide: other tests remember theirs, such as "guest".)
        remember("amqp://svc-ft:p%40ssw0rd-ft@h:5672/%2f", false);
        let text = "Invalid URL: 'amqp://svc-ft:p%40ssw0rd-ft@h:5672/%2f' then p@ssw0rd-ft alone";
        let shown = redact_text(text);
        assert!(!shown.contains("ssw0rd"), "{shown}");
        assert!(
            shown.starts_with("Invalid URL: 'amqp://svc-ft:***@h:5672/%2f'"),
            "{shown}"
        );
        remember("not-a-uri-but-secret", true);
        assert_eq!(redact_text("read not-a-uri-but-secret"), "read ***");
        // Short secrets are hidden where a URI holds them, not searched for in prose.
        remember("mongodb://u:ab@h/", false);
        assert_eq!(redact_text("a tab"), "a tab");
    }
}
