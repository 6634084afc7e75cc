//! Records the broker confirmed that this instance does not know removed: one place a claim
//! asks "was this delivered already?". A claim of this instance that takes one again (its
//! lease ran out while its removal waited, ran or failed, or before its confirm came) removes
//! it under the new lease instead of sending it a second time. A peer that takes it sends it
//! again; that is counted where the lease was lost (`docs/guarantees.md`).
//!
//! A record is the one delivered only at the `Time` it was delivered for: one moved to
//! another instant since (`timeoutd reschedule`, a ServiceConnect writer), free once its lease
//! ran out, is a timeout to fire again, at its new instant. Known by id alone (found in review,
//! helper-37), it was removed unsent.

use std::collections::HashMap;

use bson::{Bson, DateTime};
use tokio::time::Instant;

use crate::record::id_key;

/// By id ([`id_key`]): filled when a removal is queued or a confirm comes after the lease may
/// have run out, emptied when the removal ends or, for what it could not remove, a lease later.
#[derive(Debug, Default)]
pub struct Delivered {
    ids: HashMap<Vec<u8>, Entry>,
}

#[derive(Debug)]
struct Entry {
    /// The due instant it was delivered for.
    due: DateTime,
    /// Removals queued or running that have the record.
    removals: u32,
    /// Delivered with nothing removing it (confirmed after its lease may have run out, or left
    /// by a removal that ran out of lease): known until then, a lease later.
    until: Option<Instant>,
}

impl Delivered {
    fn entry(&mut self, id: &Bson, due: DateTime) -> &mut Entry {
        let entry = self.ids.entry(id_key(id)).or_insert(Entry {
            due,
            removals: 0,
            until: None,
        });
        entry.due = due;
        entry
    }

    /// A removal of `records` (each id with the due instant it was delivered for) was queued.
    pub fn removing<'a>(&mut self, records: impl IntoIterator<Item = (&'a Bson, DateTime)>) {
        for (id, due) in records {
            self.entry(id, due).removals += 1;
        }
    }

    /// A removal of `ids` ended. It left `lapsed` (their lease ran out first), known until
    /// `until`; it removed the rest.
    pub fn removed(&mut self, ids: &[Bson], lapsed: &[Bson], until: Instant) {
        for id in lapsed {
            if let Some(entry) = self.ids.get_mut(&id_key(id)) {
                entry.until = Some(until);
            }
        }
        for id in ids {
            let key = id_key(id);
            if let Some(entry) = self.ids.get_mut(&key) {
                entry.removals = entry.removals.saturating_sub(1);
                if entry.removals == 0 && entry.until.is_none() {
                    self.ids.remove(&key);
                }
            }
        }
    }

    /// `records` (each id with the due instant it was delivered for) were delivered and
    /// nothing removes them: known until `until`.
    pub fn left<'a>(
        &mut self,
        records: impl IntoIterator<Item = (&'a Bson, DateTime)>,
        until: Instant,
    ) {
        for (id, due) in records {
            self.entry(id, due).until = Some(until);
        }
    }

    /// Whether `id`, due at `due`, was delivered and is not known removed at `at`.
    pub fn has(&self, id: &Bson, due: DateTime, at: Instant) -> bool {
        self.ids
            .get(&id_key(id))
            .is_some_and(|e| e.due == due && (e.removals > 0 || e.until.is_some_and(|u| at < u)))
    }

    /// Forgets what nothing removes once it is a lease old at `at`.
    pub fn prune(&mut self, at: Instant) {
        self.ids
            .retain(|_, e| e.removals > 0 || e.until.is_some_and(|u| at < u));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_record_is_delivered_while_a_removal_has_it_and_a_lease_after_it_lapsed() {
        let at = Instant::now();
        let lease = at + Duration::from_secs(30);
        let due = DateTime::from_millis(1_800_000_000_000);
        let (x, y) = (Bson::Int32(1), Bson::Int64(1));
        let mut d = Delivered::default();
        d.removing([(&x, due)]);
        // Ids of different types stay apart.
        assert!(d.has(&x, due, at) && !d.has(&y, due, at));
        // Moved to another instant since: a timeout to fire again.
        let moved = DateTime::from_millis(1_800_000_060_000);
        assert!(!d.has(&x, moved, at), "rescheduled");
        // Taken again while the first removal runs: a second removal has it too.
        d.removing([(&x, due)]);
        d.removed(std::slice::from_ref(&x), &[], at);
        assert!(d.has(&x, due, at), "the second removal still has it");
        d.removed(std::slice::from_ref(&x), std::slice::from_ref(&x), lease);
        assert!(
            d.has(&x, due, at),
            "left by a removal that ran out of lease"
        );
        d.prune(lease);
        assert!(!d.has(&x, due, lease) && d.ids.is_empty(), "a lease later");
        d.left([(&y, due)], lease);
        d.removing([(&y, due)]);
        d.removed(std::slice::from_ref(&y), &[], at);
        assert!(d.has(&y, due, at), "confirmed late: known for a lease");
    }
}
