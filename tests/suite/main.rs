//! The integration tests that share one process and one test MongoDB server: one binary to
//! build and link instead of one per file, and tests of different files run side by side.
//! The suites that set failpoints in-process (`dropsafe`, `history`, `parking`, `progress`),
//! set server failpoints (`conformance_mongodb`) or drive the models (`conformance_rabbitmq`,
//! `simulate`) keep binaries of their own.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

mod alerts;
mod architecture;
mod cancel;
mod census;
mod cli;
mod cli_contract;
mod cli_environment;
mod cluster;
#[path = "../common/mod.rs"]
mod common;
mod control;
mod dashboard;
mod deployment;
mod dispatch;
mod faults;
mod hostile;
mod identity;
mod kubernetes_labels;
mod lease;
mod message;
mod metrics;
mod mongodb_tls;
mod oneshot;
mod operations;
mod operator_cli;
mod pause;
mod prometheus;
mod redaction;
mod shapes;
mod slowdb;
mod slowness;
mod stalls;
mod tls;

/// A path in this repository.
pub fn repo(path: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// A configuration file holding `text`, removed when dropped.
pub fn temp_config(text: &str) -> tempfile::NamedTempFile {
    let f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
    std::fs::write(f.path(), text).unwrap();
    f
}
