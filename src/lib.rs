//! timeoutd fires the timeouts of ServiceConnect process managers: it claims due records from
//! the shared MongoDB `Timeouts` collection in leased batches, publishes one `TimeoutMessage`
//! per record to RabbitMQ, and removes each record once the broker confirmed it and the lease
//! still held.
//!
//! Modules, one per concern:
//! - [`config`], the TOML file, environment overrides and validation;
//! - [`record`], the ServiceConnect document and its decoding; [`guid`], GUIDs in both BSON
//!   representations; [`due`], the shapes of `Time` and the due query for each;
//! - [`lease`], the lease rules (claim, guarded remove and release, reap) in one place;
//! - [`clock`], the database server's clock;
//! - [`deadline`], the bound on every call to MongoDB and RabbitMQ;
//! - [`durability`], the MongoDB settings the lease relies on, checked at start;
//! - [`store`], the MongoDB collection: [`claim`], the claim; [`window`], which part of the
//!   due range a claim reads; [`head`], where it starts while destinations are paused;
//!   [`shapes`], which `Time` shapes the collection holds;
//!   [`census`], `stats` and the records nothing fires on its own;
//! - [`message`], the `TimeoutMessage` wire format;
//! - [`publisher`], RabbitMQ with publisher confirms; [`ratelimit`], send-rate limits;
//! - [`dispatch`], the dispatch loop;
//! - [`reaper`], freeing expired leases;
//! - [`history`], what fired, was parked or cancelled (opt-in), and [`historycli`], the
//!   `history` command;
//! - [`metrics`], metric names and recording;
//! - [`redact`], keeping credentials out of every output;
//! - [`health`] and [`http`], liveness, readiness and the `/metrics` endpoint;
//! - [`shutdown`], signals;
//! - [`supervisor`], the essential tasks and what happens when one stops;
//! - [`daemon`], `timeoutd run`, wiring the tasks together;
//! - [`listing`], `list`; [`ops`], `cancel` and `reschedule`; [`control`], pauses, ramps and
//!   the audit of operator actions, and [`controlwatch`], the task that obeys them;
//!   [`opscli`] and [`controlcli`], those commands on the
//!   command line;
//! - [`buildinfo`], which build this is and which instance;
//! - [`cli`], the command line.

pub mod backoff;
pub mod buildinfo;
pub mod census;
pub mod claim;
pub mod cli;
pub mod clock;
pub mod config;
pub mod control;
pub mod controlcli;
pub mod controlwatch;
pub mod daemon;
pub mod deadline;
pub mod dispatch;
pub mod due;
pub mod durability;
pub mod guid;
pub mod head;
pub mod health;
pub mod history;
pub mod historycli;
pub mod http;
pub mod lease;
pub mod listing;
pub mod message;
pub mod metrics;
pub mod ops;
pub mod opscli;
pub mod parking;
pub mod publisher;
pub mod ratelimit;
pub mod reaper;
pub mod record;
pub mod redact;
pub mod shapes;
pub mod shutdown;
pub mod store;
pub mod supervisor;
pub mod systemd;
pub mod wakeup;
pub mod window;
