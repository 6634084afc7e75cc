//! The daemon's background services besides the dispatch loop: the reaper that frees
//! expired and stuck leases (`reaper`), the census of records nothing fires on its own and
//! the counts for `stats` (`census`), and the task that keeps each instance obeying the
//! control collection (`controlwatch`).

pub mod census;
pub mod controlwatch;
pub mod reaper;
