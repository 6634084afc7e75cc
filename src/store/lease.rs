//! The lease rules, all in one place.
//!
//! A claim takes a batch of due records under one fresh owner UUID with
//! `LockExpiresAt = now + lease`. Every later write on a claimed record (delete after a
//! confirmed publish, release after a failed one) is guarded by owner *and* live lease, so a
//! worker whose lease expired can never delete or free a record another worker now holds.
//! All instants are the database server's clock ([`crate::store::clock::ServerClock`]), put into the
//! queries as literal values so that indexes serve them and every server accepts them.
//!
//! This module only builds filters and decides; [`crate::store`] runs the queries.

use std::time::Duration;

use bson::{Bson, DateTime, Document, doc};
use uuid::Uuid;

use crate::config::UuidRepresentation;
use crate::record::due::{self, Shape};
use crate::record::field;
use crate::record::guid;

/// A claim's owner and the instant its lease runs out (server clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub owner: Uuid,
    pub expires_at: DateTime,
}

/// What to do with a claimed record just before publishing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrePublish {
    /// Enough lease is left: publish.
    Publish,
    /// Less than the safety margin is left: a publish could outlive the lease, so release it
    /// for another claim instead.
    TooLittleLease,
}

impl Lease {
    /// A new lease with a fresh random owner, running `lease` from `now`.
    pub fn new(now: DateTime, lease: Duration) -> Self {
        Self {
            owner: crate::host::uuid(),
            expires_at: add(now, lease),
        }
    }

    /// Time left at `now`; zero once expired.
    pub fn remaining(&self, now: DateTime) -> Duration {
        let ms = self
            .expires_at
            .timestamp_millis()
            .saturating_sub(now.timestamp_millis());
        Duration::from_millis(ms.max(0) as u64)
    }

    /// Whether the lease still holds at `now`.
    pub fn is_live(&self, now: DateTime) -> bool {
        now < self.expires_at
    }

    /// The pre-send check: skip a record whose lease has less than `margin` left.
    pub fn before_publish(&self, now: DateTime, margin: Duration) -> PrePublish {
        if self.remaining(now) < margin {
            PrePublish::TooLittleLease
        } else {
            PrePublish::Publish
        }
    }
}

/// `t + d` on BSON dates.
pub fn add(t: DateTime, d: Duration) -> DateTime {
    DateTime::from_millis(
        t.timestamp_millis()
            .saturating_add(d.as_millis().min(i64::MAX as u128) as i64),
    )
}

/// Free, or leased with an expired lease: what any worker may claim. A claim or a reaper
/// pass passes the earliest the server's clock can read as `now`, so that no lease that may
/// still hold on the server counts as expired.
pub fn claimable(now: DateTime) -> Document {
    doc! { "$or": [
        { field::LOCKED: false },
        { field::LOCK_EXPIRES_AT: { "$lte": now } },
    ] }
}

/// Due at `now` and claimable at `now`.
pub fn due_filter(now: DateTime, shapes: &[Shape]) -> Document {
    due_within(now, None, now, shapes)
}

/// `Time` at or before `t`, in any of `shapes`.
pub fn due_by(t: DateTime, shapes: &[Shape]) -> Document {
    due::any_of(shapes, |s| s.due_between(None, t))
}

/// Not due yet at `t`, in any of `shapes`.
pub fn due_after(t: DateTime, shapes: &[Shape]) -> Document {
    due::any_of(shapes, |s| s.due_after(t))
}

/// Due by `horizon` (`now` plus the look-ahead), and no earlier than `from` when set (a
/// slice of the due range, see [`crate::store::read_window`]), and claimable at `now`: what a claim
/// takes. Records due after `now` are held under the lease and sent at their due instant.
///
/// One query per shape serves best (each branch is one index range, oldest first); a list of
/// several shapes becomes an `$or` of them.
pub fn due_within(
    now: DateTime,
    from: Option<DateTime>,
    horizon: DateTime,
    shapes: &[Shape],
) -> Document {
    all_of([
        due::any_of(shapes, |s| s.due_between(from, horizon)),
        claimable(now),
    ])
}

/// [`due_within`] for every destination but `excluded` (paused ones, and those this
/// instance holds enough of under a rate limit): one more clause at the end of the same
/// `$and`, so the index bounds of the first clause stay as they are.
pub fn due_within_except(
    now: DateTime,
    from: Option<DateTime>,
    horizon: DateTime,
    shapes: &[Shape],
    excluded: &[String],
) -> Document {
    let filter = due_within(now, from, horizon, shapes);
    except(filter, excluded)
}

/// `filter` (an explicit `$and`) with `Destination` not among `excluded`, when there are any.
pub fn except(mut filter: Document, excluded: &[String]) -> Document {
    if excluded.is_empty() {
        return filter;
    }
    if let Ok(clauses) = filter.get_array_mut("$and") {
        clauses.push(Bson::Document(
            doc! { field::DESTINATION: { "$nin": excluded.to_vec() } },
        ));
        return filter;
    }
    all_of([
        filter,
        doc! { field::DESTINATION: { "$nin": excluded.to_vec() } },
    ])
}

/// The clauses joined by an explicit `$and`. The same query as one document of implicit
/// clauses, but SecantusDB plans it differently: with the clauses in one document it scans
/// the whole `"Time.0"` index (measured: 200 ms with 200k future records), with `$and` it
/// stops at the bound (under 1 ms). MongoDB treats both forms alike.
pub fn all_of<const N: usize>(clauses: [Document; N]) -> Document {
    doc! { "$and": clauses.to_vec() }
}

/// The compare-and-swap claim: the claim's filter again, restricted to the candidates read
/// (their `_id`s). A row a racing worker took since the candidates were read no longer
/// matches and is skipped. A row whose `Time` changed since (rescheduled, by `timeoutd
/// reschedule` or a ServiceConnect writer) is taken if it is still due by the horizon; how
/// the take then schedules it: [`crate::store::claim::ClaimPath::take`].
pub fn claim_filter(
    now: DateTime,
    horizon: DateTime,
    shapes: &[Shape],
    candidates: &[Bson],
) -> Document {
    all_of([
        doc! { field::ID: { "$in": candidates } },
        due_by(horizon, shapes),
        claimable(now),
    ])
}

/// Takes a lease, writing the owner in the fleet's GUID representation.
pub fn claim_update(lease: &Lease, uuids: UuidRepresentation) -> Document {
    doc! { "$set": leased_fields(lease, uuids) }
}

/// The lease fields of a record held under `lease`, as [`claim_update`] sets them.
pub fn leased_fields(lease: &Lease, uuids: UuidRepresentation) -> Document {
    doc! {
        field::LOCKED: true,
        field::LOCKED_BY: guid::to_bson(lease.owner, uuids),
        field::LOCK_EXPIRES_AT: lease.expires_at,
    }
}

/// Rows held by `owner` whose lease is live at `now`. Every write after a claim adds this.
/// The owner matches in either GUID representation, so the guard holds whatever
/// `uuid_representation` the claim wrote.
pub fn held(owner: Uuid, now: DateTime) -> Document {
    doc! {
        field::LOCKED: true,
        field::LOCKED_BY: { "$in": guid::both_forms(owner).to_vec() },
        field::LOCK_EXPIRES_AT: { "$gt": now },
    }
}

/// Rows under any live lease at `now`.
pub fn held_any(now: DateTime) -> Document {
    doc! { field::LOCKED: true, field::LOCK_EXPIRES_AT: { "$gt": now } }
}

/// One record, if `owner` still holds it at `now`.
pub fn held_one(id: &Bson, owner: Uuid, now: DateTime) -> Document {
    all_of([doc! { field::ID: id.clone() }, held(owner, now)])
}

/// Several records, those of them that `owner` still holds at `now`.
pub fn held_many(ids: &[Bson], owner: Uuid, now: DateTime) -> Document {
    all_of([doc! { field::ID: { "$in": ids } }, held(owner, now)])
}

/// Makes a record free again: the only shape ServiceConnect v7 accepts for a free record
/// (the nil GUID in the fleet's representation).
pub fn release_update(uuids: UuidRepresentation) -> Document {
    doc! { "$set": free_fields(uuids) }
}

/// The lock fields of a free record, the nil GUID in `uuids`.
pub fn free_fields(uuids: UuidRepresentation) -> Document {
    doc! {
        field::LOCKED: false,
        field::LOCKED_BY: guid::to_bson(Uuid::nil(), uuids),
        field::LOCK_EXPIRES_AT: Bson::Null,
    }
}

/// A stored record in the free shape, as [`release_update`] leaves it (for parking and
/// requeueing a record as ServiceConnect would see it), the nil GUID in the representation
/// of the record's own `_id`.
pub fn as_free(mut record: Document) -> Document {
    let uuids = record
        .get(field::ID)
        .and_then(guid::representation_of)
        .unwrap_or_default();
    record.extend(free_fields(uuids));
    record
}

/// Keeps a failed record leased until `until`, its next attempt: no worker claims it before
/// then, and its `Time` is untouched.
pub fn defer_update(until: DateTime) -> Document {
    doc! { "$set": { field::LOCK_EXPIRES_AT: until } }
}

/// Leased records whose lease has expired at `now`: what the reaper frees.
pub fn expired(now: DateTime) -> Document {
    doc! { field::LOCKED: true, field::LOCK_EXPIRES_AT: { "$lte": now } }
}

/// [`expired`] at `now`, restricted to `ids`: the reaper's write, by `_id`, that leaves
/// alone a record claimed again since its lease was read as expired.
pub fn expired_among(ids: &[Bson], now: DateTime) -> Document {
    all_of([doc! { field::ID: { "$in": ids } }, expired(now)])
}

/// Records locked with no lease expiry (missing or null): what public ServiceConnect's own
/// poller leaves when it dies between its `FindAndModify` and its delete; or with one that is
/// no date (a string, a number: no writer of the contract's), which no claim's `$lte` ever
/// matches either. No lease ever frees them; the reaper does once it has seen them locked for
/// a whole lease.
pub fn stuck() -> Document {
    doc! { field::LOCKED: true, field::LOCK_EXPIRES_AT: { "$not": { "$type": "date" } } }
}

/// [`stuck`], restricted to `ids`, for the guarded free.
pub fn stuck_among(ids: &[Bson]) -> Document {
    all_of([doc! { field::ID: { "$in": ids } }, stuck()])
}

/// Records locked in a way timeoutd never locks: no lease expiry, or no owner (missing,
/// null or the nil GUID). Some other dispatcher (ServiceConnect's own poller) claims them.
pub fn foreign_locks() -> Document {
    let mut no_owner = vec![Bson::Null];
    no_owner.extend(guid::both_forms(Uuid::nil()));
    doc! { field::LOCKED: true, "$or": [
        { field::LOCK_EXPIRES_AT: Bson::Null },
        { field::LOCKED_BY: { "$in": no_owner } },
    ] }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn margin_check_uses_the_lease_end() {
        let now = DateTime::from_millis(1_000_000);
        let lease = Lease::new(now, Duration::from_secs(10));
        assert_eq!(lease.remaining(now), Duration::from_secs(10));
        assert_eq!(
            lease.before_publish(add(now, Duration::from_secs(7)), Duration::from_secs(2)),
            PrePublish::Publish
        );
        assert_eq!(
            lease.before_publish(
                add(now, Duration::from_millis(8_001)),
                Duration::from_secs(2)
            ),
            PrePublish::TooLittleLease
        );
        assert!(lease.is_live(add(now, Duration::from_millis(9_999))));
        assert!(!lease.is_live(add(now, Duration::from_secs(10))));
        assert_eq!(
            lease.remaining(add(now, Duration::from_secs(60))),
            Duration::ZERO
        );
    }

    #[test]
    fn fresh_owner_per_lease() {
        let now = crate::host::wall_date();
        assert_ne!(
            Lease::new(now, Duration::from_secs(1)).owner,
            Lease::new(now, Duration::from_secs(1)).owner
        );
    }

    #[test]
    fn due_query_uses_the_ticks_element() {
        let now = DateTime::from_millis(1_767_225_600_000);
        let f = due_filter(now, &[Shape::Ticks(0)]);
        let clauses = f.get_array("$and").unwrap();
        let due = clauses[0].as_document().unwrap();
        assert_eq!(
            due.get_document("Time.0").unwrap().get_i64("$lte").unwrap(),
            639_028_224_000_000_000
        );
        assert!(clauses[1].as_document().unwrap().contains_key("$or"));
    }

    #[test]
    fn the_owner_guard_matches_either_representation() {
        let lease = Lease::new(crate::host::wall_date(), Duration::from_secs(10));
        let written = leased_fields(&lease, UuidRepresentation::CsharpLegacy);
        let guard = held(lease.owner, crate::host::wall_date());
        let accepted = guard
            .get_document(field::LOCKED_BY)
            .unwrap()
            .get_array("$in")
            .unwrap();
        assert!(accepted.contains(written.get(field::LOCKED_BY).unwrap()));
        let standard = leased_fields(&lease, UuidRepresentation::Standard);
        assert!(accepted.contains(standard.get(field::LOCKED_BY).unwrap()));
    }

    #[test]
    fn a_freed_copy_keeps_the_representation_of_its_id() {
        let legacy_id = guid::to_bson(crate::host::uuid(), UuidRepresentation::CsharpLegacy);
        let freed = as_free(doc! { "_id": legacy_id, "Locked": true });
        assert_eq!(
            freed.get(field::LOCKED_BY),
            Some(&guid::to_bson(
                Uuid::nil(),
                UuidRepresentation::CsharpLegacy
            ))
        );
    }
}
