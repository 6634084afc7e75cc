//! The parking lot: records timeoutd gave up on, and the count of failed sends per record.
//!
//! A record the broker refuses (no queue bound to its `Destination`, or a nack) is retried
//! with back-off: its lease is kept and `LockExpiresAt` moved to the next attempt, so its
//! `Time` and its shape stay as ServiceConnect wrote them. The count of failed sends lives in
//! `<collection>_attempts`, never in the record. After `[retry] max_attempts` failures, or at
//! once for a record the decoder rejects, the record is copied to `<collection>_parked` with
//! the reason, and only then deleted from `Timeouts` under the owner guard: a crash in between
//! leaves two copies, never none. Parking is all or nothing with respect to the lease: when
//! the guarded delete matches nothing (the lease ran out, another owner holds the record, or
//! sent it and deleted it), the parked copy is removed again and the failed-send count, which
//! is the new holder's now, is left alone.

use std::time::Duration;

use bson::{Bson, DateTime, Document, doc};
use serde::Serialize;
use uuid::Uuid;

use crate::record::{display_id, field};
use crate::store::clock::ServerClock;
use crate::store::coll::Coll;
use crate::store::indexes::{create_index, index_spec};
use crate::store::lease;
use crate::store::{StoreError, date, int, text};

/// How long a failed-send count is kept after its last failure. A record that was sent in
/// the end leaves its count behind; MongoDB's TTL monitor removes it after this.
pub const ATTEMPTS_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// Fields of a document in `<collection>_parked` (the record itself is kept unchanged under
/// `record`). Never written to a `Timeouts` document.
pub mod parked_field {
    pub const RECORD: &str = "record";
    pub const REASON: &str = "reason";
    pub const ERROR: &str = "error";
    pub const ATTEMPTS: &str = "attempts";
    pub const PARKED_AT: &str = "parked_at";
    /// A fresh UUID per park: tells one parked copy of a record from the next.
    pub const PARK_ID: &str = "park_id";
    /// Set by `parked requeue` before it puts the record back in `Timeouts`: a park may
    /// replace this copy, and no other (see [`super::Parking::park`]).
    pub const REQUEUED: &str = "requeued";
}

/// Fields of a failed-send count in `<collection>_attempts`, whose `_id` is the record's
/// `_id`. Never written to a `Timeouts` document.
mod attempt_field {
    pub const ATTEMPTS: &str = "attempts";
    pub const LAST_ERROR: &str = "last_error";
    pub const FIRST_FAILED_AT: &str = "first_failed_at";
    pub const LAST_FAILED_AT: &str = "last_failed_at";
    pub const EXPIRE_AT: &str = "expire_at";
}

/// Why a record was parked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParkReason {
    /// The broker returned it `max_attempts` times: no queue is bound to its `Destination`.
    Unroutable,
    /// The broker nacked it `max_attempts` times.
    Nacked,
    /// The decoder rejected it (a `Time`, id or `Headers` of the wrong type).
    Undecodable,
    /// It has no `Destination`.
    EmptyDestination,
    /// No message can carry it as it stands: a `Destination` longer than a routing key may
    /// be, headers larger than the broker's frame, or a builder failure (the error says which).
    Unsendable,
}

impl ParkReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unroutable => "unroutable",
            Self::Nacked => "nacked",
            Self::Undecodable => "undecodable",
            Self::EmptyDestination => "empty_destination",
            Self::Unsendable => "unsendable",
        }
    }
}

/// What parking did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parked {
    /// Copied to the parking collection and removed from `Timeouts`.
    Moved,
    /// Not parked: the record was no longer ours to delete (the lease ran out or another
    /// owner holds it). The parked copy was removed again and the failed-send count left to
    /// whoever holds the record now; nothing was changed.
    LeaseLost,
}

/// One parked record, as `timeoutd parked list` shows it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ParkedRecord {
    pub id: String,
    pub destination: Option<String>,
    pub reason: String,
    pub error: String,
    pub attempts: i64,
    /// RFC 3339.
    pub parked_at: String,
}

/// What `parked requeue` did with one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requeued {
    /// Back in `Timeouts`, free, with its original `Time`; its count reset.
    Requeued,
    /// `Timeouts` still holds a record with this `_id` (a crash or a lost lease left two
    /// copies): the parked copy was dropped.
    AlreadyInTimeouts,
    /// Requeued, but a daemon claimed it, failed again and parked it again before the old
    /// parked copy was deleted: the new parked copy is kept.
    ParkedAgain,
}

/// Access to the parking and attempts collections; cheap to clone.
#[derive(Debug, Clone)]
pub struct Parking {
    pub(super) timeouts: Coll,
    pub(super) parked: Coll,
    pub(super) attempts: Coll,
    pub(super) clock: ServerClock,
}

impl Parking {
    /// The TTL index that clears old failed-send counts, and the parked listing order.
    pub async fn ensure_indexes(&self) -> Result<(), StoreError> {
        let ttl = index_spec(
            "timeoutd_attempts_ttl",
            doc! { attempt_field::EXPIRE_AT: 1 },
            Some(Duration::ZERO),
        );
        create_index(&self.attempts, ttl).await?;
        let by_time = index_spec(
            "timeoutd_parked_at",
            doc! { parked_field::PARKED_AT: 1 },
            None,
        );
        create_index(&self.parked, by_time).await?;
        Ok(())
    }

    /// Counts one more failed send of record `id` by `owner`; returns the count so far, or
    /// `None` when `owner` no longer holds the record under a live lease (nothing counted: the
    /// send is the new holder's to count, and counting it here too would park the record
    /// before `max_attempts` sends of it failed). The count lives in another collection, so
    /// the guard is a read of the lease just before: a lease that runs out in between is one
    /// the caller's margin left too little of.
    pub async fn count_failure(
        &self,
        id: &Bson,
        owner: Uuid,
        error: &str,
    ) -> Result<Option<u32>, StoreError> {
        let now = self.clock.now();
        let held = self
            .timeouts
            .find_one(lease::held_one(id, owner, now))
            .projection(doc! { field::ID: 1 })
            .await?;
        if held.is_none() {
            return Ok(None);
        }
        let after = self
            .attempts
            .find_one_and_update(
                doc! { field::ID: id.clone() },
                doc! {
                    "$inc": { attempt_field::ATTEMPTS: 1 },
                    "$set": {
                        attempt_field::LAST_ERROR: error,
                        attempt_field::LAST_FAILED_AT: now,
                        attempt_field::EXPIRE_AT: lease::add(now, ATTEMPTS_RETENTION),
                    },
                    "$setOnInsert": { attempt_field::FIRST_FAILED_AT: now },
                },
            )
            .upsert(true)
            .return_new(true)
            .await?;
        let n = after
            .and_then(|d| int(&d, attempt_field::ATTEMPTS))
            .unwrap_or(1);
        Ok(Some(n.clamp(1, i64::from(u32::MAX)) as u32))
    }

    /// Keeps record `id` leased by `owner` until `until`; `false` if the lease was lost.
    pub async fn defer(&self, id: &Bson, owner: Uuid, until: DateTime) -> Result<bool, StoreError> {
        let r = self
            .timeouts
            .update_one(
                lease::held_one(id, owner, self.clock.now()),
                lease::defer_update(until),
            )
            .await?;
        Ok(r.matched == 1)
    }

    /// Copies `raw` (record `id`, held by `owner`) to the parking collection, then deletes it
    /// from `Timeouts` under the owner guard (owner and live lease). Only when that delete
    /// matched is its failed-send count forgotten; when it matched nothing the lease was lost,
    /// and this parked copy (told from any other by its `park_id`) is deleted again, so that a
    /// later `parked requeue` cannot send a record another owner has delivered meanwhile.
    pub async fn park(
        &self,
        id: &Bson,
        raw: &Document,
        owner: Uuid,
        reason: ParkReason,
        error: &str,
        attempts: u32,
    ) -> Result<Parked, StoreError> {
        let park_id = crate::record::uuid_bson(crate::host::uuid());
        let parked = doc! {
            field::ID: id.clone(),
            parked_field::RECORD: lease::as_free(raw.clone()),
            parked_field::REASON: reason.as_str(),
            parked_field::ERROR: error,
            parked_field::ATTEMPTS: i64::from(attempts),
            parked_field::PARKED_AT: self.clock.now(),
            parked_field::PARK_ID: park_id.clone(),
        };
        // The copy is written where none is, or over one that `parked requeue` is putting
        // back, never over another park's: an instance whose lease ran out could otherwise
        // replace the copy of the instance that took the record over and parked it, then take
        // its own copy back, and the record was in neither collection (simulation seed 4580).
        // A copy that is there already (another park's, or one a crash left between this
        // write and the delete) makes the upsert's insert a duplicate key.
        let mine = match self
            .parked
            .replace_one(
                doc! { field::ID: id.clone(), parked_field::REQUEUED: true },
                parked.clone(),
            )
            .upsert(true)
            .await
        {
            Ok(_) => true,
            Err(e) if is_duplicate_key(&e) => false,
            Err(e) => return Err(e.into()),
        };
        let deleted = self
            .timeouts
            .delete_one(lease::held_one(id, owner, self.clock.now()))
            .await?;
        if deleted.deleted == 1 {
            if !mine {
                // The copy there was left by a park that crashed before its delete: the
                // record's fate is this park's now, so its copy says why.
                self.parked
                    .replace_one(doc! { field::ID: id.clone() }, parked)
                    .upsert(true)
                    .await?;
            }
            self.attempts
                .delete_one(doc! { field::ID: id.clone() })
                .await?;
            return Ok(Parked::Moved);
        }
        // Not ours any more: take back this copy, and only this one.
        if mine {
            self.parked
                .delete_one(doc! { field::ID: id.clone(), parked_field::PARK_ID: park_id })
                .await?;
        }
        Ok(Parked::LeaseLost)
    }

    /// Every parked record, oldest first.
    pub async fn list(&self) -> Result<Vec<ParkedRecord>, StoreError> {
        let docs: Vec<Document> = self
            .parked
            .find(doc! {})
            .sort(doc! { parked_field::PARKED_AT: 1 })
            .await?;
        Ok(docs.iter().map(to_listed).collect())
    }

    /// How many records are parked.
    pub async fn count(&self) -> Result<u64, StoreError> {
        Ok(self.parked.count_documents(doc! {}).await?)
    }

    /// How many records have failed sends counted (retrying, or sent in the end and not yet
    /// cleared by the TTL monitor).
    pub async fn count_retrying(&self) -> Result<u64, StoreError> {
        Ok(self.attempts.count_documents(doc! {}).await?)
    }

    /// Finds the parked `_id` that `shown` names (as `parked list` prints it).
    pub async fn find_id(&self, shown: &str) -> Result<Option<Bson>, StoreError> {
        if let Ok(u) = Uuid::parse_str(shown) {
            let id = crate::record::uuid_bson(u);
            if self
                .parked
                .find_one(doc! { field::ID: id.clone() })
                .await?
                .is_some()
            {
                return Ok(Some(id));
            }
        }
        // Poison records may have ids of any type: match them as they are displayed.
        Ok(self
            .all_ids()
            .await?
            .into_iter()
            .find(|id| display_id(id) == shown))
    }

    /// Puts parked record `id` back into `Timeouts`, free and in its original shape, and
    /// resets its count. The insert comes first, so a crash leaves two copies, not none.
    /// `None` if no such record is parked.
    pub async fn requeue(&self, id: &Bson) -> Result<Option<Requeued>, StoreError> {
        let Some(parked) = self.parked.find_one(doc! { field::ID: id.clone() }).await? else {
            return Ok(None);
        };
        self.requeue_parked(&parked).await.map(Some)
    }

    /// [`Parking::requeue`] of the parked copy `parked` as it was read. The parked copy is
    /// then deleted only if it is still that copy: a daemon may claim the requeued record,
    /// fail again and park it again in between, and that new parked copy is the only one left.
    pub async fn requeue_parked(&self, parked: &Document) -> Result<Requeued, StoreError> {
        let id = parked.get(field::ID).cloned().unwrap_or(Bson::Null);
        let record = parked
            .get_document(parked_field::RECORD)
            .cloned()
            .unwrap_or_default();
        // Copies parked before park_id existed have none: null matches a missing field.
        let this_copy = doc! {
            field::ID: id.clone(),
            parked_field::PARK_ID: parked.get(parked_field::PARK_ID).cloned().unwrap_or(Bson::Null),
        };
        // Marked first: a park of the record once it is back may replace this copy.
        self.parked
            .update_one(
                this_copy.clone(),
                doc! { "$set": { parked_field::REQUEUED: true } },
            )
            .await?;
        let outcome = match self.timeouts.insert_one(lease::as_free(record)).await {
            Ok(_) => Requeued::Requeued,
            Err(e) if is_duplicate_key(&e) => Requeued::AlreadyInTimeouts,
            Err(e) => return Err(e.into()),
        };
        // Tests only: the window in which a daemon may claim, fail and park it again.
        #[cfg(feature = "failpoints")]
        if let Some(Some(ms)) = fail::eval("requeue-after-insert", |arg| {
            arg.and_then(|a| a.parse::<u64>().ok())
        }) {
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        }
        self.attempts
            .delete_one(doc! { field::ID: id.clone() })
            .await?;
        let deleted = self.parked.delete_one(this_copy).await?;
        Ok(if deleted.deleted == 1 {
            outcome
        } else {
            Requeued::ParkedAgain
        })
    }

    /// Every parked `_id`, oldest first.
    pub async fn all_ids(&self) -> Result<Vec<Bson>, StoreError> {
        let ids = self.parked.find_ids(doc! {});
        Ok(ids.sort(doc! { parked_field::PARKED_AT: 1 }).await?)
    }

    /// Deletes parked record `id` for good; `false` if it was not parked.
    pub async fn drop(&self, id: &Bson) -> Result<bool, StoreError> {
        let r = self
            .parked
            .delete_one(doc! { field::ID: id.clone() })
            .await?;
        Ok(r.deleted == 1)
    }
}

fn is_duplicate_key(e: &crate::store::backend::MongoError) -> bool {
    matches!(
        *e.kind,
        mongodb::error::ErrorKind::Write(mongodb::error::WriteFailure::WriteError(ref w)) if w.code == 11000
    )
}

fn to_listed(d: &Document) -> ParkedRecord {
    let record = d.get_document(parked_field::RECORD).ok();
    ParkedRecord {
        id: d.get(field::ID).map(display_id).unwrap_or_default(),
        destination: record.and_then(|r| text(r, field::DESTINATION)),
        reason: text(d, parked_field::REASON).unwrap_or_default(),
        error: text(d, parked_field::ERROR).unwrap_or_default(),
        attempts: int(d, parked_field::ATTEMPTS).unwrap_or(0),
        parked_at: date(d, parked_field::PARKED_AT)
            .and_then(|t| t.try_to_rfc3339_string().ok())
            .unwrap_or_default(),
    }
}
