//! The sections of the configuration file, one struct per TOML table, with their defaults.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::V7_FULL_TYPE_NAME;

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
    /// `name`, or `<collection>_<suffix>` when absent.
    fn beside(&self, name: &Option<String>, suffix: &str) -> String {
        name.clone()
            .unwrap_or_else(|| format!("{}_{suffix}", self.collection))
    }

    /// The collection parked records are moved to.
    pub fn parked_collection(&self) -> String {
        self.beside(&self.parked_collection, "parked")
    }

    /// The control collection: pauses, ramps and the audit of operator actions.
    pub fn control_collection(&self) -> String {
        self.beside(&self.control_collection, "control")
    }

    /// The collection that counts failed sends per record.
    pub fn attempts_collection(&self) -> String {
        self.beside(&self.attempts_collection, "attempts")
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
    /// One node's URI, or several ([`crate::config::nodes`]): a TOML array, or comma-separated.
    #[serde(
        deserialize_with = "crate::config::nodes::deserialize",
        serialize_with = "crate::config::nodes::serialize"
    )]
    pub uri: String,
    /// A file holding the URI or URIs (a mounted secret); replaces `uri` when set.
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
        self.look_ahead
            .unwrap_or(self.poll_interval.saturating_mul(2))
    }

    /// What one instance's claims reach over: a poll interval and the look-ahead (saturating:
    /// the durations of a file can be absurd).
    pub fn claim_window(&self) -> Duration {
        self.poll_interval.saturating_add(self.look_ahead())
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

/// MongoDB keeps `expireAfterSeconds` in a 32-bit integer.
pub const MAX_KEEP_SECS: u64 = i32::MAX as u64;

/// `[history]`: whether and how long fired, parked and cancelled timeouts are kept.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct HistoryConfig {
    /// How long a row is kept; `0s` (the default): no history is written.
    #[serde(with = "humantime_serde")]
    pub keep: Duration,
}

impl HistoryConfig {
    pub fn is_on(&self) -> bool {
        !self.keep.is_zero()
    }

    /// What is wrong with `keep`, if anything.
    pub fn problem(&self) -> Option<String> {
        let secs = self.keep.as_secs();
        if self.is_on() && secs == 0 {
            Some("must be 0s (off) or at least 1s".into())
        } else if secs > MAX_KEEP_SECS {
            Some(format!(
                "must be at most {MAX_KEEP_SECS}s (MongoDB's TTL limit)"
            ))
        } else {
            None
        }
    }
}
