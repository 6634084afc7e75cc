//! Configuration: the TOML file, `TIMEOUTD_<SECTION>__<KEY>` environment overrides, defaults,
//! and the validation rules that reject what cannot work.
//!
//! Every problem is reported with the dotted name of the key it concerns, so that an operator
//! can fix a config from the error alone.

pub mod nodes;
mod sections;
#[cfg(test)]
mod tests;
mod validate;

pub use sections::*;
pub use validate::{ConfigError, Problem};

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
    pub history: HistoryConfig,
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
            let missing = format!("config file {} does not exist", path.display());
            return Err(ConfigError {
                problems: vec![Problem::new("", missing)],
            });
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
        for node in crate::config::nodes::split(&config.rabbitmq.uri) {
            crate::redact::remember(&node, config.rabbitmq.uri_file.is_some());
        }
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
                Err(e) => problems.push(Problem::new(
                    key,
                    format!("cannot read {}: {e}", path.display()),
                )),
            }
        }
        ConfigError::check(problems)
    }

    /// The reaper's period: `[reaper] interval`, or a quarter of the lease.
    pub fn reaper_interval(&self) -> Duration {
        self.reaper.interval.unwrap_or(self.dispatch.lock_lease / 4)
    }

    /// The effective configuration as TOML, with every credential in the URIs replaced by
    /// `***` ([`redact_uri`]).
    pub fn to_redacted_toml(&self) -> String {
        let mut shown = self.clone();
        shown.mongodb.uri = redact_uri(&shown.mongodb.uri);
        shown.rabbitmq.uri = crate::config::nodes::redact_list(&shown.rabbitmq.uri);
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
    Problem::new(&key, format!("{message}{source}"))
}
