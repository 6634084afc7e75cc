//! timeoutd fires the timeouts of ServiceConnect process managers: it claims due records from
//! the shared MongoDB `Timeouts` collection in leased batches, publishes one `TimeoutMessage`
//! per record to RabbitMQ, and removes each record once the broker confirmed it and the lease
//! still held.
//!
//! Modules, one per concern:
//! - [`config`], the TOML file, environment overrides and validation;
//! - [`record`], the ServiceConnect document and its decoding;
//! - [`lease`], the lease rules (claim, guarded remove and release, reap) in one place;
//! - [`clock`], the database server's clock;
//! - [`store`], the MongoDB collection, and [`window`], which part of it a claim reads;
//! - [`message`], the `TimeoutMessage` wire format;
//! - [`publisher`], RabbitMQ with publisher confirms;
//! - [`dispatch`], the dispatch loop;
//! - [`reaper`], freeing expired leases;
//! - [`metrics`], metric names and recording;
//! - [`health`] and [`http`], liveness, readiness and the `/metrics` endpoint;
//! - [`shutdown`], signals;
//! - [`daemon`], `timeoutd run`, wiring the tasks together;
//! - [`cli`], the command line.

pub mod backoff;
pub mod cli;
pub mod clock;
pub mod config;
pub mod daemon;
pub mod dispatch;
pub mod health;
pub mod http;
pub mod lease;
pub mod message;
pub mod metrics;
pub mod parking;
pub mod publisher;
pub mod reaper;
pub mod record;
pub mod shutdown;
pub mod store;
pub mod systemd;
pub mod wakeup;
pub mod window;
