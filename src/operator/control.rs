//! The pauses and ramps in force, shared between the tasks of one instance: the control
//! watcher ([`crate::maintenance::controlwatch`]) reads the control collection
//! ([`crate::store::control`]) into [`ControlState`], and the dispatch loop consults it: it
//! names the paused destinations to each claim.

use std::sync::{Arc, PoisonError, RwLock};

use crate::store::control::Snapshot;

/// The latest [`Snapshot`]: the control watcher sets it, the dispatch loop reads it. The
/// daemon makes one and hands it to both.
#[derive(Debug, Default)]
pub struct ControlState(RwLock<Arc<Snapshot>>);

impl ControlState {
    pub fn get(&self) -> Arc<Snapshot> {
        self.0.read().map(|s| s.clone()).unwrap_or_default()
    }

    /// Replaces the snapshot; `true` when it changed.
    pub fn set(&self, next: Snapshot) -> bool {
        let mut guard = self.0.write().unwrap_or_else(PoisonError::into_inner);
        if **guard == next {
            return false;
        }
        *guard = Arc::new(next);
        true
    }
}
