//! The daemon's background services besides the dispatch loop: the reaper that frees
//! expired and stuck leases and takes the census of records nothing fires on its own
//! (`reaper`, over [`crate::store::census`]), and the task that keeps each instance obeying
//! the control collection (`controlwatch`).

pub mod controlwatch;
pub mod reaper;
