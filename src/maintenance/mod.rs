//! The daemon's background services beside the dispatch loop, one file each, named for its
//! role, each with one shape: `pub async fn run(.., shutdown: CancellationToken)`, a loop
//! that returns only once `shutdown` is cancelled, spawned by `timeoutd run` under the
//! supervisor (`tests/suite/architecture.rs` checks the signature).
//! - `reaper`: frees expired and stuck leases, and takes the census of records nothing fires
//!   on its own ([`crate::store::census`]).
//! - `controlwatch`: keeps each instance obeying the control collection.
//! - `wakeup`: wakes the dispatch loop for a record inserted due within the look-ahead.
//! - `monitor`: the backlog gauges, the server clock estimate, the progress check's reading.

pub mod controlwatch;
pub mod monitor;
pub mod reaper;
pub mod wakeup;
