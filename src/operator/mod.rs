//! What operators do to records and destinations, as library calls: `list` (`listing`),
//! `cancel` and `reschedule` (`ops`), pauses, ramps and the audit of operator actions
//! (`control`). Each is an extension of [`crate::store::Store`] that keeps to the lease
//! rules; the command line (`crate::cli`) and the daemon's tasks call them.

pub mod control;
pub mod listing;
pub mod ops;
