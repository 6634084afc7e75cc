//! The parking lot: records timeoutd gave up on, and the count of failed sends per record.
//!
//! A record the broker refuses (no queue bound to its `Destination`, or a nack) is retried
//! with back-off: its lease is kept and `LockExpiresAt` moved to the next attempt, so its
//! `Time` and its shape stay as ServiceConnect wrote them. The count of failed sends lives in
//! `<collection>_attempts`, never in the record. After `[retry] max_attempts` failures, or at
//! once for a record the decoder rejects, the record is copied to `<collection>_parked` with
//! the reason, and only then deleted from `Timeouts` under the owner guard (the copy is written
//! again after that delete, for a `parked requeue` may have taken it meanwhile): a crash in
//! between leaves two copies, never none. Parking is all or nothing with respect to the lease: when
//! the guarded delete matches nothing (the lease ran out, another owner holds the record, or
//! sent it and deleted it), the parked copy is removed again (unless a racing park that
//! deleted the record found it there and kept it) and the failed-send count, which is the new
//! holder's now, is left alone.
//!
//! Long, as one concept: the retry counts and the parked copies are one protocol over two
//! collections, with the rules for a race between two instances parking one record (about 440 lines
//! of code, the rest its tests).

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
    /// Set by a park that found this copy there and relies on it when it deletes the record
    /// from `Timeouts`: the park that wrote it no longer takes it back (see
    /// [`super::Parking::park`]).
    pub const KEPT: &str = "kept";
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
    /// The parked copy holds no record with its `_id` (it was not written by a park), or one
    /// read with bytes that were not UTF-8 (`crate::record::from_stored`): left as it is, and
    /// nothing put into `Timeouts`.
    Unreadable,
    /// An earlier requeue of this copy was cut short, or one runs now: it may have put the
    /// record back, and the record may have fired since. Not put back again unless forced.
    RequeuedBefore,
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
    /// later `parked requeue` cannot send a record another owner has delivered meanwhile;
    /// unless a racing park marked it kept, having deleted the record with this copy as the
    /// only one (a crash of that park before it wrote its own would otherwise lose the record).
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
        let replaceable = doc! { field::ID: id.clone(), parked_field::REQUEUED: true };
        let mut mine = match self
            .parked
            .replace_one(replaceable.clone(), parked.clone())
            .upsert(true)
            .await
        {
            Ok(_) => true,
            Err(e) if is_duplicate_key(&e) => false,
            Err(e) => return Err(e.into()),
        };
        if !mine {
            // The copy there may be one a racing park is about to take back (its lease was
            // lost to this one): marked kept, it stays, so that the delete below never leaves
            // the record in neither collection, whatever happens before this park's own copy
            // replaces it. Taken back already, this park's copy goes in its place (a copy
            // that is there again is an error: the record stays leased).
            let marked = self
                .parked
                .update_one(
                    doc! { field::ID: id.clone() },
                    doc! { "$set": { parked_field::KEPT: true } },
                )
                .await?;
            if marked.matched == 0 {
                self.parked
                    .replace_one(replaceable, parked.clone())
                    .upsert(true)
                    .await?;
                mine = true;
            }
        }
        let deleted = self
            .timeouts
            .delete_one(lease::held_one(id, owner, self.clock.now()))
            .await?;
        if deleted.deleted == 1 {
            // The record's fate is this park's now, and its copy is written again under a
            // park_id of its own: the copy there may be one a crashed park left, and this
            // park's own may have been taken by a `parked requeue` that read it before this
            // delete and found the record still in `Timeouts` (found in review: the record
            // was then in neither collection). A requeue that read the copy before this
            // rewrite deletes only the copy it read.
            let mut parked = parked;
            parked.insert(
                parked_field::PARK_ID,
                crate::record::uuid_bson(crate::host::uuid()),
            );
            match self
                .parked
                .replace_one(doc! { field::ID: id.clone() }, parked)
                .upsert(true)
                .await
            {
                // A racing upsert wrote a copy first: it is there.
                Ok(_) => {}
                Err(e) if is_duplicate_key(&e) => {}
                Err(e) => return Err(e.into()),
            }
            self.attempts
                .delete_one(doc! { field::ID: id.clone() })
                .await?;
            return Ok(Parked::Moved);
        }
        // Not ours any more: take back this copy, and only this one, unless a park that
        // deleted the record relies on it. Taken back even if this park is cut short here
        // (its deadline) or the call fails: left, a later `parked requeue` would put back a
        // record another owner has delivered meanwhile (found in review, helper-37).
        if mine {
            let copy = doc! {
                field::ID: id.clone(),
                parked_field::PARK_ID: park_id,
                parked_field::KEPT: { "$ne": true },
            };
            let mut take_back = TakeBack(Some((self.parked.clone(), copy.clone())));
            self.parked.delete_one(copy).await?;
            take_back.0 = None;
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
    /// `force` puts back a copy an earlier requeue marked ([`Requeued::RequeuedBefore`]).
    pub async fn requeue(&self, id: &Bson, force: bool) -> Result<Option<Requeued>, StoreError> {
        let Some(parked) = self.parked.find_one(doc! { field::ID: id.clone() }).await? else {
            return Ok(None);
        };
        self.requeue_parked(&parked, force).await.map(Some)
    }

    /// [`Parking::requeue`] of the parked copy `parked` as it was read. The parked copy is
    /// then deleted only if it is still that copy: a daemon may claim the requeued record,
    /// fail again and park it again in between, and that new parked copy is the only one left.
    pub async fn requeue_parked(
        &self,
        parked: &Document,
        force: bool,
    ) -> Result<Requeued, StoreError> {
        let id = parked.get(field::ID).cloned().unwrap_or(Bson::Null);
        // Only the record a park wrote, under its own `_id`, as it was stored: anything else
        // would put a document into `Timeouts` that is no record of it, and one read with
        // bytes that were not UTF-8 was altered by the read (`crate::record::from_stored`).
        let record = match parked.get(parked_field::RECORD) {
            Some(Bson::Document(r))
                if r.get(field::ID) == Some(&id) && !r.contains_key(field::INVALID_UTF8) =>
            {
                r.clone()
            }
            _ => return Ok(Requeued::Unreadable),
        };
        // Copies parked before park_id existed have none: null matches a missing field.
        let this_copy = doc! {
            field::ID: id.clone(),
            parked_field::PARK_ID: parked.get(parked_field::PARK_ID).cloned().unwrap_or(Bson::Null),
        };
        // Marked first: a park of the record once it is back may replace this copy. Only
        // one requeue marks it: a copy marked already is one an earlier requeue, cut short
        // after its insert (a deadline, a Ctrl-C) or running now, may have put back, and the
        // record may have fired since. Before (found in review), running the requeue again,
        // as its error invited, put the record back and it fired a second time.
        let mut unmarked = this_copy.clone();
        if !force {
            unmarked.insert(parked_field::REQUEUED, doc! { "$ne": true });
        }
        let marked = self
            .parked
            .update_one(unmarked, doc! { "$set": { parked_field::REQUEUED: true } })
            .await?;
        if marked.matched == 0 && !force {
            return Ok(Requeued::RequeuedBefore);
        }
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
        // Not a copy a racing park marked kept: that park deleted the record from `Timeouts`
        // with this copy as the only other, and may be cut before it writes its own.
        let mut unkept = this_copy;
        unkept.insert(parked_field::KEPT, doc! { "$ne": true });
        let deleted = self.parked.delete_one(unkept).await?;
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

/// A parked copy to take back, once more in a task of its own, if the park that wrote it
/// ends before its own take-back answered (dropped at its deadline, or the call failed).
struct TakeBack(Option<(Coll, Document)>);

impl Drop for TakeBack {
    fn drop(&mut self) {
        let Some((parked, copy)) = self.0.take() else {
            return;
        };
        let copy_id = copy.get(field::ID).cloned();
        crate::host::spawn(async move {
            let limit = parked.max_time();
            let taken = tokio::time::timeout(limit, parked.delete_one(copy).into_future()).await;
            if !matches!(taken, Ok(Ok(_))) {
                let id = crate::record::display_id(copy_id.as_ref().unwrap_or(&Bson::Null));
                tracing::warn!(timeout_id = %id, "could not take back the parked copy of a record whose lease was lost: `timeoutd parked requeue` could send it again; drop the copy (`timeoutd parked drop`)");
            }
        });
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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    use futures::future::BoxFuture;
    use tokio::sync::Notify;

    use super::*;
    use crate::config::MongoConfig;
    use crate::store::backend::{Backend, ChangeStream, MongoError, Op, Reply, Written};

    fn write_error(code: i32) -> MongoError {
        let reply = doc! { "code": code, "codeName": "DuplicateKey", "errmsg": "E11000" };
        match bson::from_document::<mongodb::error::WriteError>(reply) {
            Ok(e) => MongoError::from(mongodb::error::ErrorKind::Write(
                mongodb::error::WriteFailure::WriteError(e),
            )),
            Err(e) => MongoError::custom(e.to_string()),
        }
    }

    /// A write's reply: `n` documents matched, modified or deleted.
    fn written(n: u64) -> Result<Reply, MongoError> {
        Ok(Reply::Written(Written {
            matched: n,
            modified: n,
            deleted: n,
            ..Written::default()
        }))
    }

    /// A flat filter (equality and `$ne`) on one document.
    fn matches(filter: &Document, d: &Document) -> bool {
        filter.iter().all(|(k, v)| match v {
            Bson::Document(ne) if ne.contains_key("$ne") => d.get(k) != ne.get("$ne"),
            v => d.get(k) == Some(v),
        })
    }

    /// One record, in `Timeouts` under `holder`'s live lease, and the parking collection.
    /// A guarded delete by any other owner waits until the holder's has run (it lost its
    /// lease to the holder); the holder's rewrite of the parked copy after its delete waits
    /// until the other owner's park has ended, then fails as a lost connection does.
    #[derive(Default)]
    struct Race {
        holder: Mutex<Option<Bson>>,
        record: Mutex<Option<Document>>,
        parked: Mutex<HashMap<String, Document>>,
        holder_deleted: Notify,
        other_done: Notify,
        parked_coll: String,
        timeouts_coll: String,
    }

    #[derive(Clone)]
    struct Model(Arc<Race>);

    impl std::fmt::Debug for Model {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Model")
        }
    }

    impl Model {
        fn key(d: &Document) -> String {
            format!("{:?}", d.get(field::ID))
        }

        fn parked_op(&self, op: Op) -> Result<Reply, MongoError> {
            let mut parked = self.0.parked.lock().unwrap_or_else(|e| e.into_inner());
            let found = parked
                .iter()
                .find(|(_, d)| matches(op_filter(&op), d))
                .map(|(k, _)| k.clone());
            match op {
                Op::Replace {
                    replacement,
                    upsert,
                    ..
                } => match found {
                    Some(k) => {
                        parked.insert(k, replacement);
                        written(1)
                    }
                    None if upsert && parked.contains_key(&Self::key(&replacement)) => {
                        Err(write_error(11000))
                    }
                    None => {
                        parked.insert(Self::key(&replacement), replacement);
                        written(0)
                    }
                },
                Op::Update { update, .. } => match found {
                    Some(k) => {
                        let set = update.get_document("$set").cloned().unwrap_or_default();
                        parked.entry(k).and_modify(|d| d.extend(set));
                        written(1)
                    }
                    None => written(0),
                },
                Op::Delete { .. } => match found {
                    Some(k) => {
                        parked.remove(&k);
                        written(1)
                    }
                    None => written(0),
                },
                other => panic!("not modelled: {other:?}"),
            }
        }
    }

    fn op_filter(op: &Op) -> &Document {
        match op {
            Op::Replace { filter, .. } | Op::Update { filter, .. } | Op::Delete { filter, .. } => {
                filter
            }
            other => panic!("not modelled: {other:?}"),
        }
    }

    /// Whether the guarded delete names `holder` among the owners it accepts.
    fn by_holder(filter: &Document, holder: &Bson) -> bool {
        let guard = filter
            .get_array("$and")
            .ok()
            .and_then(|c| c.get(1))
            .and_then(Bson::as_document);
        let owners = guard
            .and_then(|g| g.get_document(field::LOCKED_BY).ok())
            .and_then(|o| o.get_array("$in").ok());
        owners.is_some_and(|o| o.contains(holder))
    }

    impl Backend for Model {
        fn run(&self, collection: &str, op: Op) -> BoxFuture<'static, Result<Reply, MongoError>> {
            let model = self.clone();
            let collection = collection.to_owned();
            Box::pin(async move {
                let race = &model.0;
                if collection == race.timeouts_coll {
                    let Op::Delete { filter, .. } = op else {
                        panic!("not modelled: {op:?}")
                    };
                    let holder = race
                        .holder
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .clone()
                        .expect("a holder");
                    let mine = by_holder(&filter, &holder);
                    if !mine {
                        race.holder_deleted.notified().await;
                        return Ok(Reply::Written(Written::default()));
                    }
                    let gone = race.record.lock().unwrap_or_else(|e| e.into_inner()).take();
                    race.holder_deleted.notify_one();
                    return Ok(Reply::Written(Written {
                        deleted: u64::from(gone.is_some()),
                        ..Written::default()
                    }));
                }
                if collection == race.parked_coll {
                    let rewrite = matches!(&op, Op::Replace { filter, .. } if !filter.contains_key(parked_field::REQUEUED));
                    if rewrite {
                        race.other_done.notified().await;
                        return Err(MongoError::from(std::io::Error::from(
                            std::io::ErrorKind::ConnectionReset,
                        )));
                    }
                    return model.parked_op(op);
                }
                Ok(Reply::Written(Written::default()))
            })
        }

        fn command(&self, _: Document) -> BoxFuture<'static, Result<Document, MongoError>> {
            Box::pin(async { Ok(doc! { "ok": 1 }) })
        }

        fn watch(
            &self,
            _: &str,
            _: Vec<Document>,
        ) -> BoxFuture<'static, Result<ChangeStream, MongoError>> {
            Box::pin(async { Err(MongoError::custom("no change streams")) })
        }

        fn shutdown(&self) -> BoxFuture<'static, ()> {
            Box::pin(async {})
        }
    }

    /// A park whose lease was lost takes its parked copy back even when it is cut short
    /// during that take-back (its deadline): left, a `parked requeue` would put back a record
    /// another owner has delivered meanwhile.
    #[tokio::test(start_paused = true)]
    async fn a_park_cut_short_taking_its_copy_back_still_takes_it_back() {
        use crate::store::backend::Answer;
        let take_backs: Arc<Mutex<u32>> = Arc::default();
        let counted = take_backs.clone();
        let backend = crate::store::backend::Answering::new(move |op: Op| match op {
            Op::Delete { filter, .. } if filter.contains_key(parked_field::PARK_ID) => {
                let mut n = counted.lock().unwrap_or_else(|e| e.into_inner());
                *n += 1;
                match *n {
                    1 => Answer::Never,
                    _ => Answer::Now(written(1)),
                }
            }
            // The record's guarded delete: the lease was lost.
            Op::Delete { .. } => Answer::Now(written(0)),
            _ => Answer::Now(written(1)),
        });
        let store = crate::store::Store::with_backend(
            Arc::new(backend),
            &MongoConfig::default(),
            ServerClock::default(),
        );
        let parking = store.parking();
        let id = crate::record::uuid_bson(crate::host::uuid());
        let raw = doc! { field::ID: id.clone(), field::DESTINATION: "q" };
        let owner = crate::host::uuid();
        let park = parking.park(&id, &raw, owner, ParkReason::Unroutable, "returned", 5);
        let cut = tokio::time::timeout(Duration::from_secs(5), park).await;
        assert!(cut.is_err(), "the take-back never answers: {cut:?}");
        let asked = || *take_backs.lock().unwrap_or_else(|e| e.into_inner());
        for _ in 0..600 {
            if asked() >= 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(asked(), 2, "the copy was not taken back again");
    }

    /// A parked copy without the record document (written by hand, or by another tool) is
    /// left as it is: nothing is put into `Timeouts`. Before, an empty document in the free
    /// shape was inserted there (the driver gave it an `_id` of its own) and the parked copy
    /// was deleted as requeued.
    #[tokio::test]
    async fn a_parked_copy_without_its_record_is_not_requeued() {
        let id = crate::record::uuid_bson(crate::host::uuid());
        let other = crate::record::uuid_bson(crate::host::uuid());
        for record in [
            None,
            Some(Bson::String("x".into())),
            Some(Bson::Document(doc! { field::DESTINATION: "q" })),
            Some(Bson::Document(
                doc! { field::ID: other, field::DESTINATION: "q" },
            )),
            // Read with bytes that were not UTF-8: its `Destination` is not what was stored.
            Some(Bson::Document(doc! {
                field::ID: id.clone(),
                field::DESTINATION: "q\u{FFFD}",
                field::INVALID_UTF8: { "fields": ["Destination"] },
            })),
        ] {
            let mut parked = doc! { field::ID: id.clone(), parked_field::PARK_ID: 1 };
            if let Some(r) = record {
                parked.insert(parked_field::RECORD, r);
            }
            let asked: Arc<Mutex<Vec<Op>>> = Arc::default();
            let ops = asked.clone();
            let backend = crate::store::backend::Answering::new(move |op: Op| {
                let reply = match &op {
                    Op::Find { .. } => Reply::Docs(vec![parked.clone()]),
                    _ => Reply::Written(Written {
                        matched: 1,
                        modified: 1,
                        deleted: 1,
                        inserted: 1,
                        ..Written::default()
                    }),
                };
                ops.lock().unwrap_or_else(|e| e.into_inner()).push(op);
                Ok(reply)
            });
            let store = crate::store::Store::with_backend(
                Arc::new(backend),
                &MongoConfig::default(),
                ServerClock::default(),
            );
            let outcome = store.parking().requeue(&id, false).await.expect("requeue");
            assert_eq!(outcome, Some(Requeued::Unreadable));
            let ops = asked.lock().unwrap_or_else(|e| e.into_inner()).clone();
            assert!(
                ops.iter().all(|op| matches!(op, Op::Find { .. })),
                "{ops:?}"
            );
        }
    }

    /// Found in review (helper-30): a requeue cut short after its insert (the CLI's deadline,
    /// a Ctrl-C) left the parked copy, and running it again, as its error invited, put back
    /// a record that had fired meanwhile: it fired twice. The second run now leaves it,
    /// unless forced.
    #[tokio::test(start_paused = true)]
    async fn a_requeue_run_again_after_one_cut_short_puts_nothing_back_unless_forced() {
        use crate::store::backend::Answer;
        let id = crate::record::uuid_bson(crate::host::uuid());
        let copy = doc! {
            field::ID: id.clone(),
            parked_field::PARK_ID: 1,
            parked_field::RECORD: { field::ID: id.clone(), field::DESTINATION: "q" },
        };
        let stored = Arc::new(Mutex::new(copy));
        let inserts = Arc::new(Mutex::new(0));
        let (parked, inserted) = (stored.clone(), inserts.clone());
        let backend = crate::store::backend::Answering::new(move |op: Op| {
            let mut parked = parked.lock().unwrap_or_else(|e| e.into_inner());
            let mut inserted = inserted.lock().unwrap_or_else(|e| e.into_inner());
            match op {
                Op::Find { .. } => Answer::Now(Ok(Reply::Docs(vec![parked.clone()]))),
                Op::Update { filter, update, .. } if matches(&filter, &parked) => {
                    parked.extend(update.get_document("$set").cloned().unwrap_or_default());
                    Answer::Now(written(1))
                }
                Op::Update { .. } => Answer::Now(written(0)),
                Op::Insert { .. } => {
                    *inserted += 1;
                    Answer::Now(written(1))
                }
                // The first run is cut short before it deletes the failed-send count.
                Op::Delete { .. } if *inserted == 1 => Answer::Never,
                Op::Delete { .. } => Answer::Now(written(1)),
                other => panic!("not modelled: {other:?}"),
            }
        });
        let store = crate::store::Store::with_backend(
            Arc::new(backend),
            &MongoConfig::default(),
            crate::store::clock::ServerClock::default(),
        );
        let parking = store.parking();
        let first = tokio::time::timeout(Duration::from_secs(5), parking.requeue(&id, false));
        assert!(first.await.is_err(), "the first requeue is cut short");
        // The record put back fires and is removed; the operator runs the requeue again.
        let again = parking.requeue(&id, false).await.expect("requeue");
        assert_eq!(again, Some(Requeued::RequeuedBefore));
        assert_eq!(*inserts.lock().unwrap(), 1, "put back a second time");
        let forced = parking.requeue(&id, true).await.expect("requeue --force");
        assert_eq!(forced, Some(Requeued::Requeued));
        assert_eq!(*inserts.lock().unwrap(), 2);
    }

    /// Found in review: a requeue racing a park of the record it put back. The park found
    /// this copy in its way, marked it kept, and deleted the record from `Timeouts`; the
    /// requeue's last delete took the copy all the same, and a park cut before it wrote its
    /// own copy left the record in neither collection. A copy marked kept stays.
    #[tokio::test]
    async fn a_requeue_leaves_a_copy_a_racing_park_marked_kept() {
        let id = crate::record::uuid_bson(crate::host::uuid());
        let copy = doc! {
            field::ID: id.clone(),
            parked_field::PARK_ID: 1,
            parked_field::RECORD: { field::ID: id.clone(), field::DESTINATION: "q" },
            parked_field::KEPT: true,
        };
        let stored = Arc::new(Mutex::new(Some(copy.clone())));
        let parked = stored.clone();
        let backend = crate::store::backend::Answering::new(move |op: Op| {
            let mut parked = parked.lock().unwrap_or_else(|e| e.into_inner());
            match op {
                // The record is back in `Timeouts`, held by the park.
                Op::Insert { .. } => Err(write_error(11000)),
                Op::Update { filter, update, .. } => match parked.as_mut() {
                    Some(d) if matches(&filter, d) => {
                        d.extend(update.get_document("$set").cloned().unwrap_or_default());
                        written(1)
                    }
                    _ => written(0),
                },
                // The parked copy's delete names its park_id; the failed-send count's does not.
                Op::Delete { filter, .. } if filter.contains_key(parked_field::PARK_ID) => {
                    match parked.as_ref() {
                        Some(d) if matches(&filter, d) => {
                            *parked = None;
                            written(1)
                        }
                        _ => written(0),
                    }
                }
                Op::Delete { .. } => written(0),
                other => panic!("not modelled: {other:?}"),
            }
        });
        let store = crate::store::Store::with_backend(
            Arc::new(backend),
            &MongoConfig::default(),
            ServerClock::default(),
        );
        let outcome = store.parking().requeue_parked(&copy, false).await;
        assert_eq!(outcome.expect("requeue"), Requeued::ParkedAgain);
        assert!(
            stored.lock().unwrap().is_some(),
            "the copy the park relies on was deleted"
        );
    }

    /// Found in review: a park that wrote the only copy races a `parked requeue` of it. The
    /// requeue reads the copy, finds the record still in `Timeouts` (the park holds it) and
    /// deletes the copy as a duplicate; the park's guarded delete then takes the record.
    /// Before, the record was in neither collection; the park now writes its copy again.
    #[tokio::test(start_paused = true)]
    async fn a_park_racing_a_requeue_of_its_own_copy_keeps_the_record() {
        let parked: Arc<Mutex<HashMap<String, Document>>> = Arc::default();
        let coll = parked.clone();
        let backend = crate::store::backend::Answering::new(move |op: Op| {
            use crate::store::backend::Answer;
            let mut parked = coll.lock().unwrap_or_else(|e| e.into_inner());
            let found = |f: &Document, parked: &HashMap<String, Document>| {
                parked
                    .iter()
                    .find(|(_, d)| matches(f, d))
                    .map(|(k, _)| k.clone())
            };
            match op {
                // The record is in `Timeouts` until the park's guarded delete, which answers
                // late: the requeue runs in between.
                Op::Insert { .. } => Answer::Now(Err(write_error(11000))),
                Op::Delete { filter, .. } if filter.contains_key("$and") => {
                    Answer::After(Duration::from_secs(1), written(1))
                }
                Op::Delete { filter, .. } if filter.contains_key(parked_field::PARK_ID) => {
                    let k = found(&filter, &parked);
                    Answer::Now(written(u64::from(
                        k.and_then(|k| parked.remove(&k)).is_some(),
                    )))
                }
                // The failed-send count.
                Op::Delete { .. } => Answer::Now(written(0)),
                Op::Update { filter, update, .. } => match found(&filter, &parked) {
                    Some(k) => {
                        let set = update.get_document("$set").cloned().unwrap_or_default();
                        parked.entry(k).and_modify(|d| d.extend(set));
                        Answer::Now(written(1))
                    }
                    None => Answer::Now(written(0)),
                },
                Op::Replace {
                    filter,
                    replacement,
                    upsert,
                    ..
                } => {
                    let key = Model::key(&replacement);
                    match found(&filter, &parked) {
                        Some(k) => {
                            parked.insert(k, replacement);
                            Answer::Now(written(1))
                        }
                        None if upsert && parked.contains_key(&key) => {
                            Answer::Now(Err(write_error(11000)))
                        }
                        None => {
                            parked.insert(key, replacement);
                            Answer::Now(written(0))
                        }
                    }
                }
                other => panic!("not modelled: {other:?}"),
            }
        });
        let store = crate::store::Store::with_backend(
            Arc::new(backend),
            &MongoConfig::default(),
            ServerClock::default(),
        );
        let id = crate::record::uuid_bson(crate::host::uuid());
        let raw = doc! { field::ID: id.clone(), field::DESTINATION: "q" };
        let parking = store.parking();
        let park = {
            let parking = store.parking();
            let (id, raw) = (id.clone(), raw.clone());
            crate::host::spawn(async move {
                let owner = crate::host::uuid();
                parking
                    .park(&id, &raw, owner, ParkReason::Unroutable, "returned", 5)
                    .await
            })
        };
        // The park wrote its copy and waits on its delete.
        let copy = loop {
            let copy = parked.lock().unwrap().values().next().cloned();
            if let Some(copy) = copy {
                break copy;
            }
            tokio::task::yield_now().await;
        };
        let requeued = parking.requeue_parked(&copy, false).await.expect("requeue");
        assert_eq!(requeued, Requeued::AlreadyInTimeouts);
        assert_eq!(park.await.expect("park").expect("park"), Parked::Moved);
        assert_eq!(
            parked.lock().unwrap().len(),
            1,
            "the record is in neither collection"
        );
    }

    /// Two parks of one record race: one by an instance whose lease ran out (its copy is
    /// written first, its delete finds the record held by the other and it takes its copy
    /// back), one by the instance that holds the record now (its copy meets the first's, its
    /// delete succeeds, and writing its own copy then fails). The record must be left in one
    /// of the two collections; before, the first park took back the copy the second relied
    /// on, and the record was in neither.
    #[tokio::test]
    async fn a_park_that_relies_on_another_parks_copy_keeps_it() {
        let config = MongoConfig::default();
        let race = Arc::new(Race {
            parked_coll: config.parked_collection(),
            timeouts_coll: config.collection.clone(),
            ..Race::default()
        });
        let model = Model(race.clone());
        let store =
            crate::store::Store::with_backend(Arc::new(model), &config, ServerClock::default());
        let parking = store.parking();
        let id = crate::record::uuid_bson(crate::host::uuid());
        let raw = doc! { field::ID: id.clone(), field::DESTINATION: "q" };
        let (lost, holder) = (crate::host::uuid(), crate::host::uuid());
        *race.holder.lock().unwrap() = Some(crate::record::uuid_bson(holder));
        *race.record.lock().unwrap() = Some(raw.clone());
        let first = async {
            let r = parking
                .park(&id, &raw, lost, ParkReason::Unroutable, "returned", 5)
                .await;
            race.other_done.notify_one();
            r
        };
        let second = parking.park(&id, &raw, holder, ParkReason::Unroutable, "returned", 5);
        let (first, second) = tokio::join!(first, second);
        assert_eq!(first.expect("the first park answers"), Parked::LeaseLost);
        assert!(second.is_err(), "the second park's rewrite failed");
        assert!(
            race.record.lock().unwrap().is_none(),
            "the holder deleted the record"
        );
        assert_eq!(
            race.parked.lock().unwrap().len(),
            1,
            "the record is in neither collection"
        );
    }
}
