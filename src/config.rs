//! Configuration: the TOML file, `TIMEOUTD_<SECTION>__<KEY>` environment overrides, defaults,
//! and the validation rules that reject what cannot work.
//!
//! Every problem is reported with the dotted name of the key it concerns, so that an operator
//! can fix a config from the error alone.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Serialize};

pub use crate::redact::redact_uri;

/// The file used when `--config` is not given and it exists.
pub const LOCAL_CONFIG_PATH: &str = "config/timeoutd.toml";
/// The file used when `--config` is not given and [`LOCAL_CONFIG_PATH`] does not exist.
pub const SYSTEM_CONFIG_PATH: &str = "/etc/timeoutd/timeoutd.toml";
/// Prefix of environment overrides: `TIMEOUTD_<SECTION>__<KEY>`.
pub const ENV_PREFIX: &str = "TIMEOUTD_";

/// ServiceConnect v7's assembly-qualified name of `TimeoutMessage`.
pub const V7_FULL_TYPE_NAME: &str = "ServiceConnect.Interfaces.TimeoutMessage, ServiceConnect.Interfaces, Version=7.0.0.0, Culture=neutral, PublicKeyToken=null";

/// The whole configuration, one struct per TOML section.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub mongodb: MongoConfig,
    pub rabbitmq: RabbitConfig,
    pub dispatch: DispatchConfig,
    pub retry: RetryConfig,
    pub reaper: ReaperConfig,
    pub http: HttpConfig,
    pub log: LogConfig,
    pub history: crate::history::HistoryConfig,
}

/// `[mongodb]`: where the ServiceConnect `Timeouts` collection lives.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct MongoConfig {
    pub uri: String,
    /// A file holding the URI (a mounted secret); replaces `uri` when set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uri_file: Option<PathBuf>,
    pub database: String,
    pub collection: String,
    pub time_encoding: TimeEncoding,
    /// How `schedule` and the lease fields write GUIDs. Both representations are read.
    pub uuid_representation: UuidRepresentation,
    /// Where parked records go; `<collection>_parked` when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parked_collection: Option<String>,
    /// Where failed-send counts are kept; `<collection>_attempts` when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attempts_collection: Option<String>,
    /// timeoutd's control collection (pauses, ramps, the audit of operator actions);
    /// `<collection>_control` when absent. Never the timeouts collection.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub control_collection: Option<String>,
    /// PEM file of the CA that signed the server's certificate; turns TLS on. (The URI's own
    /// `tls=true&tlsCAFile=...` options work too.)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_ca_file: Option<PathBuf>,
    /// PEM file holding the client certificate and its key, for x.509 client authentication.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_certificate_key_file: Option<PathBuf>,
    /// Deadline of every single call to MongoDB (a claim, a delete, a release, a count).
    #[serde(with = "humantime_serde")]
    pub operation_timeout: Duration,
}

impl MongoConfig {
    /// The collection parked records are moved to.
    pub fn parked_collection(&self) -> String {
        self.parked_collection
            .clone()
            .unwrap_or_else(|| format!("{}_parked", self.collection))
    }

    /// The control collection: pauses, ramps and the audit of operator actions.
    pub fn control_collection(&self) -> String {
        self.control_collection
            .clone()
            .unwrap_or_else(|| format!("{}_control", self.collection))
    }

    /// The collection that counts failed sends per record.
    pub fn attempts_collection(&self) -> String {
        self.attempts_collection
            .clone()
            .unwrap_or_else(|| format!("{}_attempts", self.collection))
    }
}

impl Default for MongoConfig {
    fn default() -> Self {
        Self {
            uri: "mongodb://127.0.0.1:27017".into(),
            uri_file: None,
            database: PUBLIC_DATABASE.into(),
            collection: "Timeouts".into(),
            time_encoding: TimeEncoding::Auto,
            uuid_representation: UuidRepresentation::Standard,
            parked_collection: None,
            attempts_collection: None,
            control_collection: None,
            tls_ca_file: None,
            tls_certificate_key_file: None,
            operation_timeout: Duration::from_secs(10),
        }
    }
}

/// The default database, as every public ServiceConnect release spells it.
pub const PUBLIC_DATABASE: &str = "RMessageBusPersistantStore";
/// The database name of the lease-era ServiceConnect documents (the default before 0.2).
pub const LEASE_ERA_DATABASE: &str = "RMessageBusPersistentStore";

/// How the `Time` field of a record is stored.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum TimeEncoding {
    /// Both shapes below, in one collection (for example during an upgrade).
    Auto,
    /// ServiceConnect v7: `[Int64 ticks, Int32 offsetMinutes]`, a .NET `DateTimeOffset`.
    DotnetTicks,
    /// A plain BSON Date (every public ServiceConnect release, non-.NET producers).
    Date,
}

impl TimeEncoding {
    /// Whether records with `Time` as a BSON date are served.
    pub fn reads_dates(self) -> bool {
        matches!(self, Self::Auto | Self::Date)
    }

    /// Whether records with `Time` as `[ticks, offsetMinutes]` are served.
    pub fn reads_ticks(self) -> bool {
        matches!(self, Self::Auto | Self::DotnetTicks)
    }
}

/// How GUIDs are stored as BSON binary.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum UuidRepresentation {
    /// Binary subtype 4, RFC 4122 byte order (driver setting `uuidRepresentation=standard`).
    #[default]
    Standard,
    /// Binary subtype 3 in the .NET byte order (the C# driver 2.x default `CSharpLegacy`).
    CsharpLegacy,
}

/// `[rabbitmq]`: the broker and the shape of the message.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RabbitConfig {
    pub uri: String,
    /// A file holding the URI (a mounted secret); replaces `uri` when set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uri_file: Option<PathBuf>,
    pub source_address: String,
    pub full_type_name: String,
    pub message_id: MessageIdMode,
    /// Whether the record's stored `Headers` go out with the message (the lease-era
    /// contract); public ServiceConnect releases send the standard headers only.
    pub forward_headers: bool,
    #[serde(with = "humantime_serde")]
    pub publish_timeout: Duration,
    /// Deadline for opening (and for closing) the broker connection and its channel.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// For `amqps://`: PEM file of the CA that signed the broker's certificate (default: the
    /// system's roots).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_ca_file: Option<PathBuf>,
    /// For `amqps://` with client certificates: PEM certificate and PEM (PKCS#8) key files.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key_file: Option<PathBuf>,
}

impl Default for RabbitConfig {
    fn default() -> Self {
        Self {
            uri: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
            uri_file: None,
            source_address: "timeoutd".into(),
            full_type_name: V7_FULL_TYPE_NAME.into(),
            message_id: MessageIdMode::Stable,
            forward_headers: true,
            publish_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
        }
    }
}

/// How the `MessageId` of each sent `TimeoutMessage` is chosen.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum MessageIdMode {
    /// Derived from the record's `_id`: every re-send of one record carries the same id, and a
    /// `TimeoutId` header is added, so receivers can drop duplicates.
    Stable,
    /// A fresh random UUID per send, as ServiceConnect v7 does.
    Random,
}

/// `[dispatch]`: polling, batching and the lease.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DispatchConfig {
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    pub batch_size: u32,
    #[serde(with = "humantime_serde")]
    pub lock_lease: Duration,
    #[serde(with = "humantime_serde")]
    pub lease_safety_margin: Duration,
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: Duration,
    /// How far ahead a claim reaches: records due within it are held under the lease and
    /// sent at their due instant. Twice `poll_interval` when absent, so that each claim's
    /// window overlaps the next one's by a whole poll and a claim's own latency never makes
    /// the start of its window late; `0s` turns it off.
    #[serde(with = "humantime_serde", skip_serializing_if = "Option::is_none")]
    pub look_ahead: Option<Duration>,
    /// Most records a second this instance sends, all destinations together; none when
    /// absent. Per instance: a fleet of `n` sends up to `n` times this.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_rate: Option<f64>,
    /// Per-destination limits (`[[dispatch.destination]] name, max_rate`), per instance.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub destination: Vec<DestinationLimit>,
}

/// `[[dispatch.destination]]`: the most records a second this instance sends to one queue.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DestinationLimit {
    pub name: String,
    pub max_rate: f64,
}

impl DispatchConfig {
    /// The effective look-ahead.
    pub fn look_ahead(&self) -> Duration {
        self.look_ahead.unwrap_or(self.poll_interval * 2)
    }
}

impl Default for DispatchConfig {
    fn default() -> Self {
        Self {
            poll_interval: Duration::from_secs(1),
            batch_size: 500,
            lock_lease: Duration::from_secs(300),
            lease_safety_margin: Duration::from_secs(2),
            shutdown_timeout: Duration::from_secs(20),
            look_ahead: None,
            max_rate: None,
            destination: Vec::new(),
        }
    }
}

/// `[retry]`: records the broker refuses (no queue bound to the `Destination`, or a nack).
/// Each failed send waits `base * 2^(attempt - 1)`, at most `cap`, before the next; after
/// `max_attempts` failed sends the record is parked.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    #[serde(with = "humantime_serde")]
    pub base: Duration,
    #[serde(with = "humantime_serde")]
    pub cap: Duration,
    pub max_attempts: u32,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            base: Duration::from_secs(5),
            cap: Duration::from_secs(600),
            max_attempts: 10,
        }
    }
}

impl RetryConfig {
    /// How long to wait after the `attempt`-th failed send (1-based).
    pub fn delay_after(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(32);
        self.base
            .checked_mul(1u32 << doublings.min(31))
            .unwrap_or(self.cap)
            .min(self.cap)
    }
}

/// `[reaper]`: freeing expired leases.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ReaperConfig {
    /// `lock_lease / 4` when absent.
    #[serde(with = "humantime_serde", skip_serializing_if = "Option::is_none")]
    pub interval: Option<Duration>,
}

/// `[http]`: metrics and health endpoints.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    pub listen: SocketAddr,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([0, 0, 0, 0], 9464)),
        }
    }
}

/// `[log]`: level and format of the log lines.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    pub level: String,
    pub format: LogFormat,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            level: "info".into(),
            format: LogFormat::Text,
        }
    }
}

/// The format of log lines.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    /// Human-readable, for terminals.
    Text,
    /// One JSON object a line, for Kubernetes and journald.
    Json,
}

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

impl ConfigError {
    fn one(key: &str, message: impl Into<String>) -> Self {
        Self {
            problems: vec![Problem {
                key: key.into(),
                message: message.into(),
            }],
        }
    }
}

/// Which file to read: the one given, else [`LOCAL_CONFIG_PATH`] when it exists, else
/// [`SYSTEM_CONFIG_PATH`]. The second value says whether the file must exist.
pub fn resolve_path(given: Option<&Path>) -> (PathBuf, bool) {
    match given {
        Some(p) => (p.to_path_buf(), true),
        None if Path::new(LOCAL_CONFIG_PATH).exists() => (PathBuf::from(LOCAL_CONFIG_PATH), true),
        None => (PathBuf::from(SYSTEM_CONFIG_PATH), false),
    }
}

impl Config {
    /// Loads defaults, then the file (if any), then `TIMEOUTD_*` environment overrides, then
    /// validates. A missing default file is not an error: defaults and environment apply.
    pub fn load(given: Option<&Path>) -> Result<Self, ConfigError> {
        let (path, required) = resolve_path(given);
        if required && !path.exists() {
            return Err(ConfigError::one(
                "",
                format!("config file {} does not exist", path.display()),
            ));
        }
        let env = Env::prefixed(ENV_PREFIX)
            // Only `SECTION__KEY` names are configuration; `TIMEOUTD_TEST_MONGODB_URI` and the
            // like belong to other tools.
            .filter(|k| k.as_str().contains("__"))
            .split("__");
        let figment = Figment::from(Serialized::defaults(Config::default()))
            .merge(Toml::file(&path))
            .merge(env);
        Self::from_figment(figment)
    }

    /// Parses a TOML string (with defaults for what it omits) and validates it.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        Self::from_figment(
            Figment::from(Serialized::defaults(Config::default())).merge(Toml::string(text)),
        )
    }

    fn from_figment(figment: Figment) -> Result<Self, ConfigError> {
        let mut config: Config = figment.extract().map_err(|e| ConfigError {
            problems: e.into_iter().map(figment_problem).collect(),
        })?;
        config.read_uri_files()?;
        crate::redact::remember(&config.mongodb.uri, config.mongodb.uri_file.is_some());
        crate::redact::remember(&config.rabbitmq.uri, config.rabbitmq.uri_file.is_some());
        config.validate()?;
        Ok(config)
    }

    /// Replaces each URI whose `uri_file` is set with that file's contents (trimmed), as
    /// Kubernetes and systemd mount secrets.
    fn read_uri_files(&mut self) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        for (key, file, uri) in [
            (
                "mongodb.uri_file",
                &self.mongodb.uri_file,
                &mut self.mongodb.uri,
            ),
            (
                "rabbitmq.uri_file",
                &self.rabbitmq.uri_file,
                &mut self.rabbitmq.uri,
            ),
        ] {
            let Some(path) = file else { continue };
            match std::fs::read_to_string(path) {
                Ok(text) => *uri = text.trim().to_string(),
                Err(e) => problems.push(Problem {
                    key: key.into(),
                    message: format!("cannot read {}: {e}", path.display()),
                }),
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError { problems })
        }
    }

    /// The reaper's period: `[reaper] interval`, or a quarter of the lease.
    pub fn reaper_interval(&self) -> Duration {
        self.reaper.interval.unwrap_or(self.dispatch.lock_lease / 4)
    }

    /// Checks every rule and returns all problems at once.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        let mut bad = |key: &str, message: String| {
            problems.push(Problem {
                key: key.into(),
                message,
            })
        };
        let d = &self.dispatch;
        for (key, value) in [
            ("dispatch.poll_interval", d.poll_interval),
            ("dispatch.lock_lease", d.lock_lease),
            ("dispatch.lease_safety_margin", d.lease_safety_margin),
            ("dispatch.shutdown_timeout", d.shutdown_timeout),
            ("rabbitmq.publish_timeout", self.rabbitmq.publish_timeout),
            ("rabbitmq.connect_timeout", self.rabbitmq.connect_timeout),
            ("mongodb.operation_timeout", self.mongodb.operation_timeout),
        ] {
            if value.is_zero() {
                bad(key, "must be greater than zero".into());
            }
        }
        if d.batch_size == 0 {
            bad("dispatch.batch_size", "must be greater than zero".into());
        }
        let r = &self.retry;
        for (key, value) in [("retry.base", r.base), ("retry.cap", r.cap)] {
            if value.is_zero() {
                bad(key, "must be greater than zero".into());
            }
        }
        if r.cap < r.base {
            bad("retry.cap", "must not be less than retry.base".into());
        }
        if r.max_attempts == 0 {
            bad("retry.max_attempts", "must be at least 1".into());
        }
        let needed = d.lease_safety_margin + d.poll_interval + d.look_ahead();
        if d.lock_lease <= needed {
            bad(
                "dispatch.lock_lease",
                format!(
                    "must be larger than dispatch.lease_safety_margin + dispatch.poll_interval + dispatch.look_ahead ({})",
                    humantime::format_duration(needed)
                ),
            );
        }
        let positive = |r: f64| r.is_finite() && r > 0.0;
        if d.max_rate.is_some_and(|r| !positive(r)) {
            bad(
                "dispatch.max_rate",
                "must be a number of records a second above zero".into(),
            );
        }
        let mut names = std::collections::HashSet::new();
        for (i, limit) in d.destination.iter().enumerate() {
            if limit.name.trim().is_empty() {
                bad(
                    &format!("dispatch.destination[{i}].name"),
                    "must not be empty".into(),
                );
            } else if !names.insert(limit.name.as_str()) {
                bad(
                    &format!("dispatch.destination[{i}].name"),
                    format!("`{}` is listed twice", limit.name),
                );
            }
            if !positive(limit.max_rate) {
                bad(
                    &format!("dispatch.destination[{i}].max_rate"),
                    "must be a number of records a second above zero".into(),
                );
            }
        }
        if let Some(problem) = self.history.problem() {
            bad("history.keep", problem);
        }
        if let Some(i) = self.reaper.interval
            && i.is_zero()
        {
            bad("reaper.interval", "must be greater than zero".into());
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
                bad(key, "must not be empty".into());
            }
        }
        let m = &self.mongodb;
        if m.parked_collection() == m.collection
            || m.attempts_collection() == m.collection
            || m.parked_collection() == m.attempts_collection()
        {
            bad(
                "mongodb.parked_collection",
                "mongodb.collection, mongodb.parked_collection and mongodb.attempts_collection must all differ".into(),
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
                "must differ from mongodb.collection, mongodb.parked_collection and mongodb.attempts_collection".into(),
            );
        }
        if !has_scheme(&self.mongodb.uri, &["mongodb://", "mongodb+srv://"]) {
            bad(
                "mongodb.uri",
                "must start with mongodb:// or mongodb+srv://".into(),
            );
        }
        if uri_has_unacknowledged_write_concern(&self.mongodb.uri) {
            bad(
                "mongodb.uri",
                "w=0 (unacknowledged writes) is refused: guarded deletes and releases would all look successful and lost leases would go unnoticed".into(),
            );
        }
        let rq = &self.rabbitmq;
        for (key, file) in [
            ("mongodb.tls_ca_file", &m.tls_ca_file),
            (
                "mongodb.tls_certificate_key_file",
                &m.tls_certificate_key_file,
            ),
            ("rabbitmq.tls_ca_file", &rq.tls_ca_file),
            ("rabbitmq.tls_cert_file", &rq.tls_cert_file),
            ("rabbitmq.tls_key_file", &rq.tls_key_file),
        ] {
            if let Some(path) = file
                && let Err(e) = std::fs::metadata(path)
            {
                bad(key, format!("cannot read {}: {e}", path.display()));
            }
        }
        if rq.tls_cert_file.is_some() != rq.tls_key_file.is_some() {
            bad(
                "rabbitmq.tls_key_file",
                "rabbitmq.tls_cert_file and rabbitmq.tls_key_file go together".into(),
            );
        }
        if !has_scheme(&self.rabbitmq.uri, &["amqp://", "amqps://"]) {
            bad("rabbitmq.uri", "must start with amqp:// or amqps://".into());
        }
        if tracing_subscriber::EnvFilter::try_new(&self.log.level).is_err() {
            bad(
                "log.level",
                format!(
                    "`{}` is not a level or filter (trace, debug, info, warn, error)",
                    self.log.level
                ),
            );
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError { problems })
        }
    }

    /// The effective configuration as TOML, with every credential in the URIs replaced by
    /// `***` ([`redact_uri`]).
    pub fn to_redacted_toml(&self) -> String {
        let mut shown = self.clone();
        shown.mongodb.uri = redact_uri(&shown.mongodb.uri);
        shown.rabbitmq.uri = redact_uri(&shown.rabbitmq.uri);
        let mut text = toml::to_string_pretty(&shown).unwrap_or_else(|e| format!("# {e}\n"));
        if self.reaper.interval.is_none() {
            text = text.replace(
                "[reaper]\n",
                &format!(
                    "[reaper]\n# interval = lock_lease / 4\ninterval = \"{}\"\n",
                    humantime::format_duration(self.reaper_interval())
                ),
            );
        }
        text
    }
}

fn figment_problem(e: figment::Error) -> Problem {
    let key = e.path.join(".");
    let source = e
        .metadata
        .as_ref()
        .and_then(|m| m.source.as_ref().map(|s| format!(" (from {s})")))
        .unwrap_or_default();
    let message = match &e.kind {
        figment::error::Kind::UnknownField(_, _) => "unknown key".to_string(),
        kind => kind.to_string(),
    };
    Problem {
        key,
        message: format!("{message}{source}"),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_reaper_defaults_to_quarter_lease() {
        let c = Config::from_toml("").unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.reaper_interval(), Duration::from_secs(75));
    }

    #[test]
    fn shape_settings_parse() {
        let c = Config::from_toml(
            "[mongodb]\ntime_encoding = \"date\"\nuuid_representation = \"csharp-legacy\"\n[rabbitmq]\nforward_headers = false",
        )
        .unwrap();
        assert_eq!(c.mongodb.time_encoding, TimeEncoding::Date);
        assert_eq!(
            c.mongodb.uuid_representation,
            UuidRepresentation::CsharpLegacy
        );
        assert!(!c.rabbitmq.forward_headers);
        let d = Config::default();
        assert_eq!(d.mongodb.time_encoding, TimeEncoding::Auto);
        assert_eq!(d.mongodb.database, "RMessageBusPersistantStore");
        assert!(d.rabbitmq.forward_headers);
    }

    #[test]
    fn durations_parse_humanely() {
        let c = Config::from_toml(
            "[dispatch]\npoll_interval = \"250ms\"\nlock_lease = \"5m\"\n[reaper]\ninterval = \"10s\"",
        )
        .unwrap();
        assert_eq!(c.dispatch.poll_interval, Duration::from_millis(250));
        assert_eq!(c.reaper_interval(), Duration::from_secs(10));
    }

    fn keys_of(text: &str) -> Vec<String> {
        Config::from_toml(text)
            .unwrap_err()
            .problems
            .into_iter()
            .map(|p| p.key)
            .collect()
    }

    #[test]
    fn each_rule_names_its_key() {
        assert_eq!(
            keys_of("[dispatch]\nbatch_size = 0"),
            ["dispatch.batch_size"]
        );
        assert_eq!(
            keys_of("[dispatch]\nbatch_size = -5"),
            ["dispatch.batch_size"]
        );
        assert_eq!(
            keys_of("[dispatch]\npoll_interval = \"0s\""),
            ["dispatch.poll_interval"]
        );
        assert_eq!(
            keys_of("[dispatch]\npoll_interval = \"-1s\""),
            ["dispatch.poll_interval"]
        );
        assert_eq!(
            keys_of("[dispatch]\nlock_lease = \"3s\"\nlease_safety_margin = \"2s\""),
            ["dispatch.lock_lease"]
        );
        assert_eq!(keys_of("[dispatch]\nbogus = 1"), ["dispatch.bogus"]);
        assert_eq!(keys_of("[nosuch]\nx = 1"), ["nosuch"]);
        assert_eq!(
            keys_of("[mongodb]\ntime_encoding = \"unix\""),
            ["mongodb.time_encoding"]
        );
        assert_eq!(
            keys_of("[mongodb]\nuuid_representation = \"java-legacy\""),
            ["mongodb.uuid_representation"]
        );
        assert_eq!(
            keys_of("[rabbitmq]\nforward_headers = \"no\""),
            ["rabbitmq.forward_headers"]
        );
        assert_eq!(
            keys_of("[rabbitmq]\nmessage_id = \"sometimes\""),
            ["rabbitmq.message_id"]
        );
        assert_eq!(keys_of("[log]\nformat = \"xml\""), ["log.format"]);
        assert_eq!(keys_of("[reaper]\ninterval = \"0ms\""), ["reaper.interval"]);
        assert_eq!(keys_of("[rabbitmq]\nuri = \"http://x\""), ["rabbitmq.uri"]);
        assert_eq!(keys_of("[http]\nlisten = \"nope\""), ["http.listen"]);
        assert_eq!(
            keys_of("[mongodb]\nuri = \"mongodb://h/?retryWrites=true&w=0\""),
            ["mongodb.uri"]
        );
    }

    /// One case per validation rule that the test above does not cover.
    #[test]
    fn every_other_rule_names_its_key() {
        let cases = [
            (
                "[dispatch]\nshutdown_timeout = \"0s\"",
                "dispatch.shutdown_timeout",
            ),
            (
                "[dispatch]\nlease_safety_margin = \"0s\"",
                "dispatch.lease_safety_margin",
            ),
            (
                "[rabbitmq]\npublish_timeout = \"0s\"",
                "rabbitmq.publish_timeout",
            ),
            ("[mongodb]\nuri = \"\"", "mongodb.uri"),
            ("[mongodb]\nuri = \"postgres://h\"", "mongodb.uri"),
            ("[mongodb]\ndatabase = \" \"", "mongodb.database"),
            ("[mongodb]\ncollection = \"\"", "mongodb.collection"),
            (
                "[mongodb]\nparked_collection = \"\"",
                "mongodb.parked_collection",
            ),
            (
                "[mongodb]\nattempts_collection = \"\"",
                "mongodb.attempts_collection",
            ),
            (
                "[mongodb]\nparked_collection = \"Timeouts\"",
                "mongodb.parked_collection",
            ),
            (
                "[mongodb]\nuri_file = \"/nonexistent/uri\"",
                "mongodb.uri_file",
            ),
            ("[rabbitmq]\nuri = \"\"", "rabbitmq.uri"),
            (
                "[rabbitmq]\nuri_file = \"/nonexistent/uri\"",
                "rabbitmq.uri_file",
            ),
            (
                "[rabbitmq]\nsource_address = \"\"",
                "rabbitmq.source_address",
            ),
            (
                "[rabbitmq]\nfull_type_name = \"\"",
                "rabbitmq.full_type_name",
            ),
            ("[retry]\nbase = \"0s\"", "retry.base"),
            ("[retry]\nbase = \"1m\"\ncap = \"10s\"", "retry.cap"),
            ("[retry]\nmax_attempts = 0", "retry.max_attempts"),
            ("[retry]\nmax_attempts = -1", "retry.max_attempts"),
            ("[retry]\nbogus = 1", "retry.bogus"),
            ("[history]\nkeep = \"500ms\"", "history.keep"),
            ("[history]\nkeep = \"100years\"", "history.keep"),
            ("[history]\nbogus = 1", "history.bogus"),
            ("[log]\nlevel = \"timeoutd=loud\"", "log.level"),
            ("[http]\nlisten = \"127.0.0.1:99999\"", "http.listen"),
        ];
        for (text, key) in cases {
            let keys = keys_of(text);
            assert!(keys.iter().any(|k| k == key), "{text:?} gave {keys:?}");
        }
    }

    #[test]
    fn uri_files_replace_inline_uris() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("mongodb-uri");
        std::fs::write(&file, "mongodb://u:from-file@db:27017\n").unwrap();
        let c = Config::from_toml(&format!(
            "[mongodb]\nuri = \"mongodb://inline\"\nuri_file = \"{}\"",
            file.display()
        ))
        .unwrap();
        assert_eq!(c.mongodb.uri, "mongodb://u:from-file@db:27017");
        assert!(!c.to_redacted_toml().contains("from-file"));
    }

    #[test]
    fn rate_limits_parse_and_are_checked() {
        let c = Config::from_toml(
            "[dispatch]\nmax_rate = 500\n[[dispatch.destination]]\nname = \"billing\"\nmax_rate = 20.5\n",
        )
        .unwrap();
        assert_eq!(c.dispatch.max_rate, Some(500.0));
        assert_eq!(c.dispatch.destination[0].name, "billing");
        assert_eq!(c.dispatch.destination[0].max_rate, 20.5);
        assert_eq!(
            Config::from_toml(&c.to_redacted_toml()).unwrap().dispatch,
            c.dispatch
        );
        assert_eq!(keys_of("[dispatch]\nmax_rate = 0"), ["dispatch.max_rate"]);
        assert_eq!(
            keys_of("[[dispatch.destination]]\nname = \"\"\nmax_rate = 1"),
            ["dispatch.destination[0].name"]
        );
        assert_eq!(
            keys_of(
                "[[dispatch.destination]]\nname = \"a\"\nmax_rate = 1\n[[dispatch.destination]]\nname = \"a\"\nmax_rate = -1"
            ),
            [
                "dispatch.destination[1].name",
                "dispatch.destination[1].max_rate"
            ]
        );
        assert_eq!(
            keys_of("[mongodb]\ncontrol_collection = \"Timeouts\""),
            ["mongodb.control_collection"]
        );
    }

    #[test]
    fn retry_delays_double_up_to_the_cap() {
        let r = RetryConfig {
            base: Duration::from_secs(5),
            cap: Duration::from_secs(60),
            max_attempts: 10,
        };
        let delays: Vec<u64> = (1..=6).map(|n| r.delay_after(n).as_secs()).collect();
        assert_eq!(delays, [5, 10, 20, 40, 60, 60]);
        assert_eq!(r.delay_after(u32::MAX), Duration::from_secs(60));
    }

    #[test]
    fn reports_all_validation_problems_at_once() {
        let e = Config::from_toml(
            "[dispatch]\nbatch_size = 0\nshutdown_timeout = \"0s\"\n[rabbitmq]\npublish_timeout = \"0s\"",
        )
        .unwrap_err();
        assert_eq!(e.problems.len(), 3, "{e}");
        assert_eq!(e.to_string().lines().count(), 3);
    }

    #[test]
    fn redacted_toml_hides_passwords_and_round_trips() {
        let mut c = Config::default();
        c.mongodb.uri = "mongodb://admin:hunter2@db:27017".into();
        let text = c.to_redacted_toml();
        assert!(!text.contains("hunter2"), "{text}");
        assert!(text.contains("admin:***@db"));
        let back = Config::from_toml(&text).unwrap();
        assert_eq!(back.reaper_interval(), c.reaper_interval());
        assert_eq!(back.dispatch, c.dispatch);
    }
}
