//! Records the broker confirmed that this instance does not know removed: one place a claim
//! asks "was this delivered already?". A claim of this instance that takes one again (its
//! lease ran out while its removal waited, ran or failed, or before its confirm came) removes
//! it under the new lease instead of sending it a second time. A peer that takes it sends it
//! again; that is counted where the lease was lost (`docs/guarantees.md`).

use std::collections::HashMap;

use bson::Bson;
use tokio::time::Instant;

use crate::record::id_key;

/// By id ([`id_key`]): filled when a removal is queued or a confirm comes after the lease may
/// have run out, emptied when the removal ends or, for what it could not remove, a lease later.
#[derive(Debug, Default)]
pub struct Delivered {
    ids: HashMap<Vec<u8>, Entry>,
}

#[derive(Debug, Default)]
struct Entry {
    /// Removals queued or running that have the record.
    removals: u32,
    /// Delivered with nothing removing it (confirmed after its lease may have run out, or left
    /// by a removal that ran out of lease): known until then, a lease later.
    until: Option<Instant>,
}

impl Delivered {
    /// A removal of `ids` was queued.
    pub fn removing<'a>(&mut self, ids: impl IntoIterator<Item = &'a Bson>) {
        for id in ids {
            self.ids.entry(id_key(id)).or_default().removals += 1;
        }
    }

    /// A removal of `ids` ended. It left `lapsed` (their lease ran out first), known until
    /// `until`; it removed the rest.
    pub fn removed(&mut self, ids: &[Bson], lapsed: &[Bson], until: Instant) {
        for id in ids {
            let key = id_key(id);
            if let Some(entry) = self.ids.get_mut(&key) {
                entry.removals = entry.removals.saturating_sub(1);
                if entry.removals == 0 && entry.until.is_none() {
                    self.ids.remove(&key);
                }
            }
        }
        self.left(lapsed, until);
    }

    /// `ids` were delivered and nothing removes them: known until `until`.
    pub fn left(&mut self, ids: &[Bson], until: Instant) {
        for id in ids {
            self.ids.entry(id_key(id)).or_default().until = Some(until);
        }
    }

    /// Whether `id` was delivered and is not known removed at `at`.
    pub fn has(&self, id: &Bson, at: Instant) -> bool {
        self.ids
            .get(&id_key(id))
            .is_some_and(|e| e.removals > 0 || e.until.is_some_and(|u| at < u))
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
        let (x, y) = (Bson::Int32(1), Bson::Int64(1));
        let mut d = Delivered::default();
        d.removing([&x]);
        // Ids of different types stay apart.
        assert!(d.has(&x, at) && !d.has(&y, at));
        // Taken again while the first removal runs: a second removal has it too.
        d.removing([&x]);
        d.removed(std::slice::from_ref(&x), &[], at);
        assert!(d.has(&x, at), "the second removal still has it");
        d.removed(std::slice::from_ref(&x), std::slice::from_ref(&x), lease);
        assert!(d.has(&x, at), "left by a removal that ran out of lease");
        d.prune(lease);
        assert!(!d.has(&x, lease) && d.ids.is_empty(), "a lease later");
        d.left(std::slice::from_ref(&y), lease);
        d.removing([&y]);
        d.removed(std::slice::from_ref(&y), &[], at);
        assert!(d.has(&y, at), "confirmed late: known for a lease");
    }
}
