//! Dispatch: claim due records, publish them, settle each by its outcome. `ARCHITECTURE.md`
//! says what each file holds; [`machine`] is the core, `driver` ([`Dispatcher`]) runs it.
//!
//! Nothing is deleted unless its publish was confirmed and its claim's lease still held; when
//! in doubt a record is left for a later poll.

mod claims;
mod control;
mod delivered;
mod driver;
pub mod leased;
pub mod machine;
pub mod ratelimit;
mod settle;
mod summary;

use std::sync::Arc;

use tokio::sync::Notify;

pub use driver::Dispatcher;
pub use leased::triage;

/// What ends the dispatch loop other than a clean shutdown.
#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    #[error("a dispatch handler panicked: {0}")]
    Panicked(String),
}

/// What tells the loop to look again before its next poll, one signal per source: the daemon
/// makes them and hands each to the task that sends it.
#[derive(Debug, Clone, Default)]
pub struct Signals {
    /// A record was inserted due within the look-ahead (the insert watcher, a background
    /// service beside the loop).
    pub inserted: Arc<Notify>,
    /// The pauses or ramps in force changed (the control watcher).
    pub control: Arc<Notify>,
}
