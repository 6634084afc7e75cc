//! What the command line takes from its surroundings besides its arguments: the environment
//! variables it warns about (a `TIMEOUTD_*` name it ignores, an invalid `RUST_LOG`), and the
//! logging set-up.
//!
//! `TIMEOUTD_CONFIG` (the config file when `--config` is not given) is read by clap, see
//! [`crate::cli::Cli`].

use std::ffi::OsString;

use crate::config::{Config, ENV_PREFIX, LogFormat};
use crate::redact::RedactingWriter;

/// The variable naming the config file when `--config` is not given.
pub const CONFIG_ENV: &str = "TIMEOUTD_CONFIG";

/// The configuration's sections (`mongodb`, `rabbitmq`, ...), as `TIMEOUTD_<SECTION>__<KEY>`
/// names them.
fn sections() -> Vec<String> {
    match toml::Table::try_from(Config::default()) {
        Ok(table) => table.keys().cloned().collect(),
        Err(_) => Vec::new(),
    }
}

/// Warnings about the environment, one line each: a variable that reads like a configuration
/// key but is ignored (`TIMEOUTD_MONGODB_URI`: section and key take two underscores), and a
/// `RUST_LOG` that is no valid filter (ignored: `[log] level` applies).
pub fn environment_warnings(vars: impl IntoIterator<Item = (OsString, OsString)>) -> Vec<String> {
    let sections = sections();
    let mut warnings = Vec::new();
    for (name, value) in vars {
        let Some(name) = name.to_str() else { continue };
        if name == "RUST_LOG" {
            let value = value.to_string_lossy();
            if !value.trim().is_empty()
                && let Err(e) = tracing_subscriber::EnvFilter::try_new(value.as_ref())
            {
                warnings.push(format!(
                    "RUST_LOG={value:?} is not a valid log filter ({e}); it is ignored and [log] level applies"
                ));
            }
            continue;
        }
        let Some(rest) = name.strip_prefix(ENV_PREFIX) else {
            continue;
        };
        if name == CONFIG_ENV || rest.contains("__") {
            continue;
        }
        let lower = rest.to_ascii_lowercase();
        let section = sections.iter().find(|s| {
            lower
                .strip_prefix(s.as_str())
                .is_some_and(|key| key.starts_with('_') && key.len() > 1)
        });
        if let Some(section) = section {
            let key = &rest[section.len() + 1..];
            warnings.push(format!(
                "{name} is ignored: a configuration variable separates section and key with two underscores, {ENV_PREFIX}{}__{key}",
                section.to_ascii_uppercase()
            ));
        }
    }
    warnings
}

/// Logging to stderr through [`RedactingWriter`]. `[log] level` applies to the daemon; a
/// one-shot command (stats, schedule, reap, parked) logs warnings and errors only, unless the
/// level is quieter still, so its stderr stays empty when it succeeds. A valid `RUST_LOG`
/// overrides both.
pub fn init_logging(config: &Config, daemon: bool) {
    // lapin logs every returned message in full at WARN; timeoutd logs the failed send itself.
    let from_env = std::env::var("RUST_LOG")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .and_then(|v| tracing_subscriber::EnvFilter::try_new(v).ok());
    let level = match config.log.level.as_str() {
        quieter @ ("error" | "off") => quieter,
        _ if !daemon => "warn",
        level => level,
    };
    let filter = from_env.unwrap_or_else(|| {
        // Operator actions are logged with who ran them (`timeoutd::audit`), also by the
        // one-shot commands.
        let audit = if level == "error" || level == "off" {
            ""
        } else {
            ",timeoutd::audit=info"
        };
        tracing_subscriber::EnvFilter::new(format!("{level},lapin::returned_messages=error{audit}"))
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(RedactingWriter);
    match config.log.format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn warnings(vars: &[(&str, &str)]) -> Vec<String> {
        environment_warnings(vars.iter().map(|(k, v)| ((*k).into(), (*v).into())))
    }

    #[test]
    fn a_single_underscore_is_named_with_the_name_that_works() {
        let w = warnings(&[("TIMEOUTD_MONGODB_URI", "mongodb://x")]);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("TIMEOUTD_MONGODB__URI"), "{w:?}");
        let w = warnings(&[("TIMEOUTD_DISPATCH_BATCH_SIZE", "5")]);
        assert!(w[0].contains("TIMEOUTD_DISPATCH__BATCH_SIZE"), "{w:?}");
    }

    #[test]
    fn configuration_and_other_tools_variables_are_not_warned_about() {
        let w = warnings(&[
            ("TIMEOUTD_MONGODB__URI", "mongodb://x"),
            ("TIMEOUTD_CONFIG", "/etc/timeoutd/timeoutd.toml"),
            ("TIMEOUTD_TEST_MONGODB_URI", "mongodb://x"),
            ("TIMEOUTD_BENCH_SCALE", "1"),
            ("TIMEOUTD_SERVICE_HOST", "10.0.0.1"),
            ("TIMEOUTD_LOG", "x"),
            ("RUST_LOG", "timeoutd=debug,lapin=warn"),
            ("RUST_LOG", ""),
        ]);
        assert!(w.is_empty(), "{w:?}");
    }

    #[test]
    fn an_invalid_rust_log_is_named() {
        let w = warnings(&[("RUST_LOG", "timeoutd=loud")]);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].starts_with("RUST_LOG=\"timeoutd=loud\""), "{w:?}");
    }
}
