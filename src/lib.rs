//! timeoutd fires the timeouts of ServiceConnect process managers: it claims due records from
//! the shared MongoDB `Timeouts` collection in leased batches, publishes one `TimeoutMessage`
//! per record to RabbitMQ, and removes each record once the broker confirmed it and the lease
//! still held.
//!
//! Subsystems, lowest layer first (a module uses only those before it; ARCHITECTURE.md has
//! the code map and one record's path through them):
//! - [`host`]: the wall clock, randomness, and the jittered retry back-off drawn from them;
//! - [`redact`], [`deadline`], [`metrics`]: credentials out of every output, the bound on every
//!   call, every metric series;
//! - [`config`], the TOML file, environment overrides and validation;
//! - [`service`], the process shell: health, supervision, HTTP, systemd, signals;
//! - [`record`], the ServiceConnect document, GUIDs, the `Time` shapes, the wire message;
//! - [`store`], the MongoDB collections: the lease rules, the claim, parking, and every
//!   query behind the operator commands;
//! - [`rabbit`], the RabbitMQ publisher and the link seam under it;
//! - [`operator`], the pauses and ramps in force;
//! - [`maintenance`], the reaper, the census and the control watcher;
//! - [`dispatch`], the dispatch core (a machine that does no I/O) and its driver, settling,
//!   rate limits and wake-ups;
//! - [`cli`], the command line and `timeoutd run`.

pub mod cli;
pub mod config;
pub mod deadline;
pub mod dispatch;
pub mod host;
pub mod maintenance;
pub mod metrics;
pub mod operator;
pub mod rabbit;
pub mod record;
pub mod redact;
pub mod service;
pub mod store;
