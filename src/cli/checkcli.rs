//! `timeoutd check-config [--connect] [--json]`: the configuration as loaded, naming the file
//! it came from and the `TIMEOUTD_*` variables that overrode it; with `--connect`, whether
//! MongoDB and RabbitMQ answer, their versions and the clock offset, each call under the
//! configured deadlines (`[mongodb] operation_timeout`, `[rabbitmq] connect_timeout`).
//!
//! The text output stays valid TOML: what is not configuration is written as `#` comments.

use std::path::Path;
use std::sync::Arc;
use tokio::time::Instant;

use serde::Serialize;

use crate::config::{Config, ENV_PREFIX, resolve_path};
use crate::rabbit::lapinlink::LapinBroker;
use crate::rabbit::publisher::Publisher;
use crate::redact::redact_text;
use crate::store::Store;
use crate::store::clock::ServerClock;

/// Where the configuration came from.
#[derive(Debug, Serialize)]
pub struct Source {
    /// The file read, or the one looked for.
    pub file: String,
    /// Whether it existed (only the system default may be missing).
    pub file_read: bool,
    /// The `TIMEOUTD_<SECTION>__<KEY>` variables that were applied, by name.
    pub environment: Vec<String>,
}

impl Source {
    pub fn of(given: Option<&Path>) -> Self {
        let (path, _) = resolve_path(given);
        let mut environment: Vec<String> = std::env::vars_os()
            .filter_map(|(k, _)| k.into_string().ok())
            .filter(|k| k.starts_with(ENV_PREFIX) && k.contains("__"))
            .collect();
        environment.sort();
        Self {
            file_read: path.exists(),
            file: path.display().to_string(),
            environment,
        }
    }

    fn text(&self) -> String {
        let file = if self.file_read {
            format!("# read {}", self.file)
        } else {
            format!("# no file read: {} does not exist (defaults)", self.file)
        };
        if self.environment.is_empty() {
            format!("{file}\n")
        } else {
            format!(
                "{file}, then from the environment: {}\n",
                self.environment.join(", ")
            )
        }
    }
}

/// One dependency's answer to `--connect`.
#[derive(Debug, Serialize)]
pub struct Reached {
    pub ok: bool,
    pub version: Option<String>,
    /// MongoDB's clock minus this host's, in milliseconds (MongoDB only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clock_offset_ms: Option<i64>,
    pub elapsed_ms: u64,
    pub error: Option<String>,
}

impl Reached {
    fn text(&self, name: &str) -> String {
        let version = self.version.as_deref().unwrap_or("unknown");
        match (&self.error, self.clock_offset_ms) {
            (Some(e), _) => format!("# {name}: UNREACHABLE after {} ms: {e}", self.elapsed_ms),
            (None, Some(offset)) => format!(
                "# {name}: answered in {} ms, server version {version}, server clock minus host clock {offset:+} ms",
                self.elapsed_ms
            ),
            (None, None) => format!(
                "# {name}: answered in {} ms (connection and confirm channel opened), server {version}",
                self.elapsed_ms
            ),
        }
    }
}

/// `timeoutd check-config`. With `--connect`, fails (exit 1) when either dependency does not
/// answer, after reporting both.
pub async fn check_config(
    config: &Config,
    source: Source,
    connect: bool,
    json: bool,
) -> anyhow::Result<()> {
    let reached = match connect {
        true => Some(tokio::join!(reach_mongodb(config), reach_rabbitmq(config))),
        false => None,
    };
    if json {
        let shown: toml::Table = toml::from_str(&config.to_redacted_toml())?;
        let mut out = serde_json::json!({ "source": source, "config": shown });
        if let (Some((m, r)), Some(o)) = (&reached, out.as_object_mut()) {
            o.insert(
                "connect".into(),
                serde_json::json!({ "mongodb": m, "rabbitmq": r }),
            );
        }
        say!("{out}");
    } else {
        crate::cli::out(format_args!(
            "{}{}",
            source.text(),
            config.to_redacted_toml()
        ));
        if let Some((m, r)) = &reached {
            say!("{}\n{}", m.text("mongodb"), r.text("rabbitmq"));
        }
    }
    match reached {
        Some((m, r)) if !m.ok || !r.ok => {
            let failed: Vec<&str> = [("MongoDB", &m), ("RabbitMQ", &r)]
                .iter()
                .filter(|(_, x)| !x.ok)
                .map(|(n, _)| *n)
                .collect();
            anyhow::bail!("{} did not answer", failed.join(" and "))
        }
        _ => Ok(()),
    }
}

async fn reach_mongodb(config: &Config) -> Reached {
    let started = Instant::now();
    let limit = config.mongodb.operation_timeout;
    let connect = crate::deadline::within(
        limit,
        "connecting to MongoDB",
        Store::connect(&config.mongodb, ServerClock::default()),
    )
    .await;
    let store = match connect {
        Ok(s) => s.with_settings(config),
        Err(e) => return failed(started, &e),
    };
    let offset = store.refresh_clock().await;
    let version = match &offset {
        Ok(_) => store
            .bounded("read the server version", store.server_version())
            .await
            .ok(),
        Err(_) => None,
    };
    let elapsed_ms = elapsed_ms(started);
    if !store.close(crate::cli::CLOSE_TIMEOUT).await {
        tracing::debug!("the MongoDB client did not close in time");
    }
    match offset {
        Ok(offset) => answered(elapsed_ms, version, Some(offset)),
        Err(e) => failed(started, &e),
    }
}

async fn reach_rabbitmq(config: &Config) -> Reached {
    let started = Instant::now();
    // The version comes from the handshake of the node that answered (lapin does not keep
    // it, so the broker reads it from a Connection.Start of its own, plain `amqp://` only).
    let broker = match LapinBroker::new(&config.rabbitmq) {
        Ok(b) => b.reading_version(),
        Err(e) => return failed(started, &e),
    };
    let mut publisher = Publisher::with_broker(&config.rabbitmq, Arc::new(broker));
    let connected = publisher.connect().await;
    let elapsed_ms = elapsed_ms(started);
    let version = publisher.server_version();
    publisher.close().await;
    if let Err(e) = connected {
        return failed(started, &e);
    }
    let version = version.unwrap_or_else(|| "unknown (not read over amqps://)".into());
    answered(elapsed_ms, Some(version), None)
}

fn elapsed_ms(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX)
}

fn answered(elapsed_ms: u64, version: Option<String>, clock_offset_ms: Option<i64>) -> Reached {
    Reached {
        ok: true,
        version,
        clock_offset_ms,
        elapsed_ms,
        error: None,
    }
}

fn failed(started: Instant, e: &dyn std::fmt::Display) -> Reached {
    Reached {
        ok: false,
        error: Some(redact_text(&e.to_string())),
        ..answered(elapsed_ms(started), None, None)
    }
}
