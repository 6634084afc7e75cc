//! The rules that reject a configuration that cannot work: every problem at once, each
//! named by the dotted key it concerns.

use std::fmt;

use super::*;

/// One problem found while loading or validating a configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Dotted key, such as `dispatch.batch_size`; empty when the problem is not about one key.
    pub key: String,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.key.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.key, self.message)
        }
    }
}

/// Every problem found in a configuration; displayed one per line.
#[derive(Debug, Clone, thiserror::Error)]
pub struct ConfigError {
    pub problems: Vec<Problem>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.problems.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "invalid configuration: {p}")?;
        }
        Ok(())
    }
}

/// The longest duration any setting but `history.keep` may have.
pub const LONGEST: Duration = Duration::from_secs(365 * 24 * 3600);

/// The largest `dispatch.batch_size`.
pub const MAX_BATCH: u32 = 100_000;

impl Problem {
    pub(super) fn new(key: &str, message: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            message: message.into(),
        }
    }
}

impl ConfigError {
    /// `Ok` when `problems` is empty.
    pub(super) fn check(problems: Vec<Problem>) -> Result<(), Self> {
        match problems.is_empty() {
            true => Ok(()),
            false => Err(Self { problems }),
        }
    }
}

impl Config {
    /// Checks every rule and returns all problems at once.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        let mut bad = |key: &str, message: &str| problems.push(Problem::new(key, message));
        let d = &self.dispatch;
        for (key, value) in [
            ("dispatch.poll_interval", d.poll_interval),
            ("dispatch.lock_lease", d.lock_lease),
            ("dispatch.lease_safety_margin", d.lease_safety_margin),
            ("dispatch.shutdown_timeout", d.shutdown_timeout),
            ("rabbitmq.publish_timeout", self.rabbitmq.publish_timeout),
            ("rabbitmq.connect_timeout", self.rabbitmq.connect_timeout),
            ("mongodb.operation_timeout", self.mongodb.operation_timeout),
            ("retry.base", self.retry.base),
            ("retry.cap", self.retry.cap),
        ] {
            if value.is_zero() {
                bad(key, "must be greater than zero");
            }
        }
        // Durations that parse can be absurd (`300000000000years`), and an instant that far
        // ahead is past what the clock can hold: refused here, never a panic at run time.
        for (key, value) in [
            ("dispatch.poll_interval", Some(d.poll_interval)),
            ("dispatch.lock_lease", Some(d.lock_lease)),
            ("dispatch.lease_safety_margin", Some(d.lease_safety_margin)),
            ("dispatch.shutdown_timeout", Some(d.shutdown_timeout)),
            ("dispatch.look_ahead", d.look_ahead),
            (
                "rabbitmq.publish_timeout",
                Some(self.rabbitmq.publish_timeout),
            ),
            (
                "rabbitmq.connect_timeout",
                Some(self.rabbitmq.connect_timeout),
            ),
            (
                "mongodb.operation_timeout",
                Some(self.mongodb.operation_timeout),
            ),
            ("retry.base", Some(self.retry.base)),
            ("retry.cap", Some(self.retry.cap)),
            ("reaper.interval", self.reaper.interval),
        ] {
            if value.is_some_and(|v| v > LONGEST) {
                bad(key, "must be at most 1 year");
            }
        }
        if d.batch_size == 0 {
            bad("dispatch.batch_size", "must be greater than zero");
        }
        // A claim's compare-and-swap names every candidate `_id`: far above this, its filter
        // passes MongoDB's 16 MiB document limit and every full claim fails (found in review).
        if d.batch_size > MAX_BATCH {
            bad(
                "dispatch.batch_size",
                &format!("must be at most {MAX_BATCH}"),
            );
        }
        let r = &self.retry;
        if r.cap < r.base {
            bad("retry.cap", "must not be less than retry.base");
        }
        if r.max_attempts == 0 {
            bad("retry.max_attempts", "must be at least 1");
        }
        // Checked: durations from the file can be absurd (`100000000years`); a sum past the
        // largest Duration is simply more than any lease.
        let needed = d
            .lease_safety_margin
            .checked_add(d.poll_interval)
            .and_then(|s| s.checked_add(d.look_ahead()))
            .unwrap_or(Duration::MAX);
        if d.lock_lease <= needed {
            bad(
                "dispatch.lock_lease",
                &format!(
                    "must be larger than dispatch.lease_safety_margin + dispatch.poll_interval + dispatch.look_ahead ({})",
                    humantime::format_duration(needed)
                ),
            );
        }
        let mut names = std::collections::HashSet::new();
        for (i, limit) in d.destination.iter().enumerate() {
            let name = format!("dispatch.destination[{i}].name");
            if limit.name.trim().is_empty() {
                bad(&name, "must not be empty");
            } else if !names.insert(limit.name.as_str()) {
                bad(&name, &format!("`{}` is listed twice", limit.name));
            }
        }
        // Each rate a number above zero that lets a record out within a lease: at a slower
        // one every record past the first is released as soon as it is claimed, and claimed
        // again at once, for ever (found in review: at 0.002/s under a 300 s lease, a
        // claim-and-release loop of whole batches).
        let sendable = d
            .lock_lease
            .saturating_sub(d.lease_safety_margin)
            .as_secs_f64();
        let too_slow = format!(
            "must let one record out per lease: at least {:.6} a second with dispatch.lock_lease {} and dispatch.lease_safety_margin {}",
            1.0 / sendable.max(f64::MIN_POSITIVE),
            humantime::format_duration(d.lock_lease),
            humantime::format_duration(d.lease_safety_margin)
        );
        let rates = d.max_rate.map(|r| ("dispatch.max_rate".to_string(), r));
        let rates = rates.into_iter().chain(
            d.destination
                .iter()
                .enumerate()
                .map(|(i, l)| (format!("dispatch.destination[{i}].max_rate"), l.max_rate)),
        );
        for (key, rate) in rates {
            if !(rate.is_finite() && rate > 0.0) {
                bad(&key, "must be a number of records a second above zero");
            } else if rate * sendable < 1.0 {
                bad(&key, &too_slow);
            }
        }
        if let Some(problem) = self.history.problem() {
            bad("history.keep", &problem);
        }
        // The effective interval: a quarter of the lease when unset, zero for a lease under
        // 4 ns (the reaper's timer cannot tick at zero).
        if self.reaper_interval().is_zero() {
            let message = match self.reaper.interval {
                Some(_) => "must be greater than zero",
                None => {
                    "must be greater than zero (unset, it is dispatch.lock_lease / 4): set it, or a longer dispatch.lock_lease"
                }
            };
            bad("reaper.interval", message);
        }
        for (key, value) in [
            ("mongodb.uri", &self.mongodb.uri),
            ("mongodb.database", &self.mongodb.database),
            ("mongodb.collection", &self.mongodb.collection),
            (
                "mongodb.parked_collection",
                &self.mongodb.parked_collection(),
            ),
            (
                "mongodb.attempts_collection",
                &self.mongodb.attempts_collection(),
            ),
            (
                "mongodb.control_collection",
                &self.mongodb.control_collection(),
            ),
            ("rabbitmq.uri", &self.rabbitmq.uri),
            ("rabbitmq.source_address", &self.rabbitmq.source_address),
            ("rabbitmq.full_type_name", &self.rabbitmq.full_type_name),
        ] {
            if value.trim().is_empty() {
                bad(key, "must not be empty");
            }
        }
        let m = &self.mongodb;
        // Names MongoDB refuses: every call would fail with InvalidNamespace, and the daemon
        // wait for ever for a server that answers (found in review).
        let db = &m.database;
        if !db.trim().is_empty()
            && (db.len() >= 64 || db.contains(['/', '\\', '.', ' ', '"', '$', '\0']))
        {
            bad(
                "mongodb.database",
                "must be a MongoDB database name: under 64 bytes, without / \\ . \" $ or a space",
            );
        }
        // Each name as set; the timeouts collection's with the longest suffix built from it
        // (`_attempts`), which names built from a valid name only lengthen.
        let named = [
            ("mongodb.collection", Some(&m.collection), "_attempts".len()),
            ("mongodb.parked_collection", m.parked_collection.as_ref(), 0),
            (
                "mongodb.attempts_collection",
                m.attempts_collection.as_ref(),
                0,
            ),
            (
                "mongodb.control_collection",
                m.control_collection.as_ref(),
                0,
            ),
        ];
        for (key, name, suffix) in named {
            let Some(name) = name.filter(|n| !n.trim().is_empty()) else {
                continue;
            };
            if name.contains(['$', '\0'])
                || name.starts_with("system.")
                || db.len() + 1 + name.len() + suffix > 255
            {
                bad(
                    key,
                    &format!(
                        "`{name}` is no MongoDB collection name: without $, not starting with system., at most 255 bytes with the database's name (and the suffixes timeoutd adds)"
                    ),
                );
            }
        }
        if m.parked_collection() == m.collection
            || m.attempts_collection() == m.collection
            || m.parked_collection() == m.attempts_collection()
        {
            bad(
                "mongodb.parked_collection",
                "mongodb.collection, mongodb.parked_collection and mongodb.attempts_collection must all differ",
            );
        }
        let control = m.control_collection();
        if [
            &m.collection,
            &m.parked_collection(),
            &m.attempts_collection(),
        ]
        .contains(&&control)
        {
            bad(
                "mongodb.control_collection",
                "must differ from mongodb.collection, mongodb.parked_collection and mongodb.attempts_collection",
            );
        }
        if !has_scheme(&self.mongodb.uri, &["mongodb://", "mongodb+srv://"]) {
            bad(
                "mongodb.uri",
                "must start with mongodb:// or mongodb+srv://",
            );
        }
        // What the driver would refuse at start-up (an exit 1 there, with a stack of causes),
        // said here with the key. Its message is redacted: it may quote a part of the URI.
        if has_scheme(&self.mongodb.uri, &["mongodb://", "mongodb+srv://"])
            && !self.mongodb.uri.is_empty()
            && let Err(e) = mongodb::options::ConnectionString::parse(&self.mongodb.uri)
        {
            let why = crate::redact::redact_text(&e.to_string());
            bad(
                "mongodb.uri",
                &format!("is not a MongoDB connection string the driver accepts: {why}"),
            );
        }
        if uri_has_unacknowledged_write_concern(&self.mongodb.uri) {
            bad(
                "mongodb.uri",
                "w=0 (unacknowledged writes) is refused: guarded deletes and releases would all look successful and lost leases would go unnoticed",
            );
        }
        let rq = &self.rabbitmq;
        // Read, and holding the PEM blocks each needs: a directory, a file the service user
        // cannot read, or one of another kind passed a check of existence alone, and failed
        // at run time (exit 1 naming no key, or a daemon unready for ever whose every TLS
        // connect failed; found in review, helper-38).
        const CERTIFICATE: &str = "-----BEGIN CERTIFICATE-----";
        const PRIVATE_KEY: &str = "PRIVATE KEY-----";
        const CERT: &[&str] = &[CERTIFICATE];
        const KEY: &[&str] = &[PRIVATE_KEY];
        const BOTH: &[&str] = &[CERTIFICATE, PRIVATE_KEY];
        for (key, file, needs) in [
            ("mongodb.tls_ca_file", &m.tls_ca_file, CERT),
            (
                "mongodb.tls_certificate_key_file",
                &m.tls_certificate_key_file,
                BOTH,
            ),
            ("rabbitmq.tls_ca_file", &rq.tls_ca_file, CERT),
            ("rabbitmq.tls_cert_file", &rq.tls_cert_file, CERT),
            ("rabbitmq.tls_key_file", &rq.tls_key_file, KEY),
        ] {
            let Some(path) = file else { continue };
            match std::fs::read(path) {
                Err(e) => bad(key, &format!("cannot read {}: {e}", path.display())),
                Ok(bytes) => {
                    let text = String::from_utf8_lossy(&bytes);
                    if let Some(missing) = needs.iter().find(|n| !text.contains(**n)) {
                        let what = match *missing {
                            CERTIFICATE => "a PEM certificate",
                            _ => "a PEM private key",
                        };
                        bad(key, &format!("{} holds no {what}", path.display()));
                    }
                }
            }
        }
        if rq.tls_cert_file.is_some() != rq.tls_key_file.is_some() {
            bad(
                "rabbitmq.tls_key_file",
                "rabbitmq.tls_cert_file and rabbitmq.tls_key_file go together",
            );
        }
        for problem in crate::config::nodes::problems(&self.rabbitmq.uri) {
            bad("rabbitmq.uri", &problem);
        }
        if tracing_subscriber::EnvFilter::try_new(&self.log.level).is_err() {
            bad(
                "log.level",
                &format!(
                    "`{}` is not a level or filter (trace, debug, info, warn, error)",
                    self.log.level
                ),
            );
        }
        ConfigError::check(problems)
    }
}

/// Whether `uri` is empty (reported separately) or starts with one of `schemes`.
fn has_scheme(uri: &str, schemes: &[&str]) -> bool {
    uri.is_empty() || schemes.iter().any(|s| uri.starts_with(s))
}

/// Whether a MongoDB URI asks for `w=0`.
fn uri_has_unacknowledged_write_concern(uri: &str) -> bool {
    let Some((_, query)) = uri.split_once('?') else {
        return false;
    };
    query.split('&').any(|kv| {
        kv.split_once('=')
            .is_some_and(|(k, v)| k.eq_ignore_ascii_case("w") && v.trim() == "0")
    })
}
