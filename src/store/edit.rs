//! Operator actions on single records: `cancel` and `reschedule`.
//!
//! Both touch a record only while it is free, by the rules a claim uses
//! ([`crate::store::lease::claimable`]: not locked, or locked with a lease that has run out by
//! the earliest the server's clock can read, as a claim judges it), and
//! put that rule into the write's own filter. A write and a claim's compare-and-swap are each
//! atomic on the document, so one of them wins and the other matches nothing: a record an
//! instance has claimed (to send it now, or to hold it until its instant within the
//! look-ahead, or to retry it later) is under a live lease and is left as it is, and a record
//! cancelled or moved first is never sent as it was. An instance whose lease ran out while it
//! still held a record does not send it either: it checks the lease before each publish
//! ([`crate::store::lease::Lease::before_publish`]).

use std::time::Duration;

use bson::{Bson, DateTime, Document, doc};
use serde::Serialize;
use uuid::Uuid;

use crate::record::field;
use crate::store::control::Actor;
use crate::store::history::{Ended, event};
use crate::store::listing::{Listed, describe, field_clauses, is_free, show_instant};
use crate::store::{Store, StoreError};
use crate::{record::due, store::lease};

/// Most records one `cancel` or `reschedule` by correlation id acts on.
pub const MAX_SELECTED: i64 = 10_000;

/// Why an operator action did not (fully) happen.
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    /// The command names something that is not there, or asks for the impossible: exit 2.
    #[error("{0}")]
    BadInput(String),
    /// Some records were under a live lease and were left as they were: exit 3.
    #[error(
        "{0} record(s) under a live lease were left as they are (being sent, or held for their instant by an instance); --skip-leased accepts that"
    )]
    LeftLeased(usize),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A call failed after some records were changed: those are `done`, and the command
    /// reports and audits them before it fails (exit 1).
    #[error(
        "{error} (stopped there: the records before it were dealt with as listed; run the command again for the rest)"
    )]
    Stopped {
        done: Vec<Outcome>,
        error: StoreError,
    },
}

impl OpsError {
    /// `error`, with what was `done` before it.
    fn after(done: Vec<Outcome>, error: impl Into<OpsError>) -> Self {
        match error.into() {
            OpsError::Store(error) if !done.is_empty() => OpsError::Stopped { done, error },
            other => other,
        }
    }
}

/// Which records an action applies to.
#[derive(Debug, Clone)]
pub enum Selector {
    /// These ids (either GUID representation).
    Ids(Vec<Uuid>),
    /// Every record of one saga, optionally only those sent to one destination.
    Saga {
        correlation_id: Uuid,
        destination: Option<String>,
    },
}

impl Selector {
    fn filter(&self) -> Document {
        match self {
            Selector::Ids(ids) => {
                let forms: Vec<Bson> = ids
                    .iter()
                    .flat_map(|u| crate::record::guid::both_forms(*u))
                    .collect();
                doc! { field::ID: { "$in": forms } }
            }
            Selector::Saga {
                correlation_id,
                destination,
            } => doc! { "$and": field_clauses(destination.as_deref(), Some(*correlation_id)) },
        }
    }
}

/// What happened to one record.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Outcome {
    #[serde(flatten)]
    pub record: Listed,
    /// `cancelled`, `would_cancel`, `rescheduled`, `would_reschedule`, `left_leased`,
    /// `changed` (its `Time` was changed by someone else since it was read), `gone` (fired or
    /// removed meanwhile) or `unreadable` (its `Time` cannot be moved).
    pub outcome: &'static str,
    /// For a reschedule: the new due instant (RFC 3339, UTC).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub new_due: Option<String>,
}

/// How `reschedule` moves `Time`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Move {
    /// To this instant.
    At(DateTime),
    /// To now (server clock) plus this.
    In(Duration),
    /// By this many milliseconds from the record's own due instant (negative: earlier).
    By(i64),
}

impl Store {
    /// With history on, records the records `cancel` deleted, with the operator's reason and who
    /// ran it. A failed write is reported, and the cancel stands.
    pub async fn record_cancelled(&self, outcomes: &[Outcome], reason: Option<&str>) {
        if !self.history_on() {
            return;
        }
        let by = Actor::current().label();
        let at = self.clock().now();
        let rows: Vec<_> = outcomes
            .iter()
            .filter(|o| o.outcome == "cancelled")
            .map(|o| {
                Ended {
                    event: event::CANCELLED,
                    timeout_id: o.record.id.clone(),
                    correlation_id: o.record.correlation_id.clone(),
                    destination: o.record.destination.clone(),
                    due: o
                        .record
                        .due
                        .as_deref()
                        .and_then(|d| DateTime::parse_rfc3339_str(d).ok()),
                    attempts: None,
                    reason,
                    detail: Some(&by),
                }
                .row(at)
            })
            .collect();
        if rows.is_empty() {
            return;
        }
        let n = rows.len();
        if let Err(e) = self
            .bounded("write history", self.write_history(rows))
            .await
        {
            tracing::warn!(rows = n, error = %e, "the records were cancelled, but the history rows saying so could not be written");
        }
    }

    /// The records `selector` names, as stored. Unknown ids are bad input.
    async fn select(&self, selector: &Selector) -> Result<Vec<Document>, OpsError> {
        let docs: Vec<Document> = self
            .query(self.coll.find(selector.filter()).limit(MAX_SELECTED))
            .await?;
        match selector {
            Selector::Ids(ids) => {
                let found: Vec<Uuid> = docs
                    .iter()
                    .filter_map(|d| d.get(field::ID).and_then(crate::record::guid::from_bson))
                    .collect();
                let unknown: Vec<String> = ids
                    .iter()
                    .filter(|u| !found.contains(u))
                    .map(|u| u.to_string())
                    .collect();
                if !unknown.is_empty() {
                    return Err(OpsError::BadInput(format!(
                        "no timeout record has id {} (already fired, cancelled, or parked: see `timeoutd list --state parked`); nothing was changed",
                        unknown.join(", ")
                    )));
                }
            }
            Selector::Saga { correlation_id, .. } if docs.is_empty() => {
                return Err(OpsError::BadInput(format!(
                    "no timeout record has correlation id {correlation_id} (with that destination); nothing was changed"
                )));
            }
            Selector::Saga { correlation_id, .. } => {
                if docs.len() as i64 >= MAX_SELECTED {
                    tracing::warn!(%correlation_id, records = docs.len(), "this saga has more records than one run acts on: run the command again for the rest");
                }
            }
        }
        Ok(docs)
    }

    /// Deletes the records `selector` names that are free; leaves (and reports) those under
    /// a live lease. With `dry_run`, only reports.
    pub async fn cancel(
        &self,
        selector: &Selector,
        dry_run: bool,
    ) -> Result<Vec<Outcome>, OpsError> {
        let docs = self.select(selector).await?;
        let (now, expired_by) = (self.clock.now(), self.clock.earliest());
        let (free, held): (Vec<Document>, Vec<Document>) =
            docs.into_iter().partition(|d| is_free(d, expired_by));
        let mut outcomes: Vec<Outcome> = held
            .iter()
            .map(|d| outcome(self, d, now, "left_leased", None))
            .collect();
        if dry_run {
            outcomes.extend(
                free.iter()
                    .map(|d| outcome(self, d, now, "would_cancel", None)),
            );
            return Ok(outcomes);
        }
        // One record a delete, as `reschedule` writes: a shortfall of a batched delete cannot
        // tell a record claimed since it was read from one that fired and was removed.
        for d in &free {
            let Some(id) = d.get(field::ID).cloned() else {
                continue;
            };
            // The claim's own rule in the delete's filter: a record claimed since it was read
            // no longer matches.
            let filter =
                lease::all_of([doc! { field::ID: id.clone() }, lease::claimable(expired_by)]);
            let deleted = match self.query(self.coll.delete_one(filter)).await {
                Ok(deleted) => deleted,
                Err(e) => return Err(OpsError::after(outcomes, e)),
            };
            if deleted.deleted == 1 {
                outcomes.push(outcome(self, d, now, "cancelled", None));
                continue;
            }
            match self.not_written(d, id, now).await {
                Ok(o) => outcomes.push(o),
                Err(e) => return Err(OpsError::after(outcomes, e)),
            }
        }
        Ok(outcomes)
    }

    /// Moves the `Time` of the records `selector` names that are free, written in each
    /// record's own encoding; leaves (and reports) those under a live lease.
    pub async fn reschedule(
        &self,
        selector: &Selector,
        to: Move,
        dry_run: bool,
    ) -> Result<Vec<Outcome>, OpsError> {
        let docs = self.select(selector).await?;
        let (now, expired_by) = (self.clock.now(), self.clock.earliest());
        // Every new instant is checked before anything is written.
        let mut planned = Vec::with_capacity(docs.len());
        for d in &docs {
            planned.push(plan(self, d, to, now)?);
        }
        let mut outcomes = Vec::new();
        for (d, plan) in docs.iter().zip(planned) {
            if !is_free(d, expired_by) {
                outcomes.push(outcome(self, d, now, "left_leased", None));
                continue;
            }
            let Some((old, new_time, new_due)) = plan else {
                outcomes.push(outcome(self, d, now, "unreadable", None));
                continue;
            };
            let shown = show_instant(new_due);
            if dry_run {
                outcomes.push(outcome(self, d, now, "would_reschedule", shown));
                continue;
            }
            let Some(id) = d.get(field::ID).cloned() else {
                continue;
            };
            // The record as read, still free: a claim or another reschedule since then makes
            // this match nothing.
            let filter = lease::all_of([
                doc! { field::ID: id.clone(), field::TIME: old },
                lease::claimable(expired_by),
            ]);
            // A lease that ran out ends with the move: its holder's late removal, guarded by
            // its owner, then misses the record, which fires at its new instant. Before
            // (found in review), the record kept the owner, and a removal sent before the
            // lease ran out and landing after the move deleted a record said `rescheduled`.
            let mut set = doc! { field::TIME: new_time };
            if d.get(field::LOCKED) != Some(&Bson::Boolean(false)) {
                set.extend(lease::free_fields(self.uuids));
            }
            let moved = match self
                .query(self.coll.update_one(filter, doc! { "$set": set }))
                .await
            {
                Ok(moved) => moved,
                Err(e) => return Err(OpsError::after(outcomes, e)),
            };
            if moved.matched == 1 {
                outcomes.push(outcome(self, d, now, "rescheduled", shown));
                continue;
            }
            match self.not_written(d, id, now).await {
                Ok(o) => outcomes.push(o),
                Err(e) => return Err(OpsError::after(outcomes, e)),
            }
        }
        Ok(outcomes)
    }

    /// The outcome for a record a guarded write missed: claimed since it was read
    /// (`left_leased`), free but with another `Time` (`changed`: rescheduled meanwhile by
    /// someone else), or fired or removed meanwhile (`gone`).
    async fn not_written(
        &self,
        d: &Document,
        id: Bson,
        now: DateTime,
    ) -> Result<Outcome, OpsError> {
        let current = self
            .query(self.coll.find_one(doc! { field::ID: id }))
            .await?;
        Ok(match current {
            // Before (found in review), a free record whose `Time` had changed was reported
            // under a live lease, beside its own state saying otherwise.
            Some(c) if is_free(&c, self.clock.earliest()) => {
                outcome(self, &c, now, "changed", None)
            }
            Some(c) => outcome(self, &c, now, "left_leased", None),
            None => outcome(self, d, now, "gone", None),
        })
    }
}

/// The stored `Time`, the new one and its instant, for a record whose `Time` decodes; an
/// error when the new instant is out of range.
fn plan(
    store: &Store,
    d: &Document,
    to: Move,
    now: DateTime,
) -> Result<Option<(Bson, Bson, DateTime)>, OpsError> {
    let old = d.get(field::TIME).cloned().unwrap_or(Bson::Null);
    let Some(old_due) = crate::record::TimeoutRecord::decode_due(d, store.encoding) else {
        return Ok(None);
    };
    let new_due = match to {
        Move::At(t) => t,
        Move::In(d) => lease::add(now, d),
        Move::By(ms) => DateTime::from_millis(old_due.timestamp_millis().saturating_add(ms)),
    };
    let new_time = same_shape(&old, new_due).ok_or_else(|| {
        OpsError::BadInput(format!(
            "the new due instant {} is outside .NET's range (years 1 to 9999); nothing was changed",
            show_instant(new_due).unwrap_or_else(|| new_due.timestamp_millis().to_string())
        ))
    })?;
    Ok(Some((old, new_time, new_due)))
}

fn outcome(
    store: &Store,
    d: &Document,
    now: DateTime,
    what: &'static str,
    new_due: Option<String>,
) -> Outcome {
    Outcome {
        record: describe(store, d, now, false),
        outcome: what,
        new_due,
    }
}

/// `due` as a `Time` of the same shape as `old`: a BSON date stays a date; `[ticks, offset]`
/// keeps its offset (the ticks are the clock time there) and its element types. `None` when
/// `due` is outside .NET's range, or `old` is of no shape timeoutd reads.
pub fn same_shape(old: &Bson, due: DateTime) -> Option<Bson> {
    let ms = due.timestamp_millis();
    if !(due::MIN_DATE_MS..=due::MAX_DATE_MS).contains(&ms) {
        return None;
    }
    match old {
        Bson::DateTime(_) => Some(Bson::DateTime(due)),
        Bson::Array(parts) if parts.len() == 2 => {
            let offset = match parts.get(1) {
                Some(Bson::Int32(o)) => i64::from(*o),
                Some(Bson::Int64(o)) => *o,
                _ => return None,
            };
            if !due::offset_in_range(offset) {
                return None;
            }
            let clock = crate::record::ms_to_ticks(ms)
                .checked_add(offset.checked_mul(due::TICKS_PER_MINUTE)?)?;
            if !(0..=due::MAX_TICKS).contains(&clock) {
                return None;
            }
            let ticks = match parts.first() {
                // Ticks a record kept as Int32 (no instant after the year 1's first minutes
                // fits) widen to the Int64 the C# driver writes, rather than stop the run.
                Some(Bson::Int32(_)) => {
                    i32::try_from(clock).map_or(Bson::Int64(clock), Bson::Int32)
                }
                Some(Bson::Int64(_)) => Bson::Int64(clock),
                _ => return None,
            };
            Some(Bson::Array(vec![ticks, parts.get(1)?.clone()]))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    use crate::config::{MongoConfig, TimeEncoding, UuidRepresentation};
    use crate::record::guid;
    use crate::store::backend::{Answering, Op, Reply, Written};
    use crate::store::clock::ServerClock;

    /// A store whose one record is leased until 2 s after `server`, on a clock that read the
    /// server at `server` somewhere in a round trip of 10 s (the midpoint estimate is 5 s
    /// ahead of the earliest the server's clock can read), and the operations it was asked.
    fn leased_until_two_seconds_on(server: DateTime, id: Uuid) -> (Store, Arc<Mutex<Vec<Op>>>) {
        let std = UuidRepresentation::Standard;
        let record = doc! {
            field::ID: guid::to_bson(id, std),
            field::DESTINATION: "q",
            field::TIME: server,
            field::LOCKED: true,
            field::LOCKED_BY: guid::to_bson(crate::host::uuid(), std),
            field::LOCK_EXPIRES_AT: lease::add(server, Duration::from_secs(2)),
        };
        let asked: Arc<Mutex<Vec<Op>>> = Arc::default();
        let ops = asked.clone();
        let backend = Answering::new(move |op: Op| {
            let reply = match &op {
                Op::Find { .. } => Reply::Docs(vec![record.clone()]),
                Op::Delete { .. } => Reply::Written(Written {
                    deleted: 1,
                    ..Written::default()
                }),
                _ => Reply::Written(Written {
                    matched: 1,
                    modified: 1,
                    ..Written::default()
                }),
            };
            ops.lock().unwrap_or_else(|e| e.into_inner()).push(op);
            Ok(reply)
        });
        let clock = ServerClock::default();
        let received = tokio::time::Instant::now();
        clock.observe(server, received - Duration::from_secs(10), received);
        let store = Store::with_backend(Arc::new(backend), &MongoConfig::default(), clock);
        (store, asked)
    }

    /// A lease that may still hold on the server (its holder may be sending the record) was
    /// taken for run out by the clock's midpoint, up to half a round trip ahead: `cancel`
    /// deleted the record and said `cancelled`, and `reschedule` moved it, while it could
    /// still be sent. Both judge it as a claim does, by the earliest the server's clock can
    /// read.
    #[tokio::test(start_paused = true)]
    async fn a_lease_the_server_may_still_hold_is_left_by_cancel_and_reschedule() {
        let server = DateTime::from_millis(NEW_YEAR_MS);
        let id = crate::host::uuid();
        let (store, ops) = leased_until_two_seconds_on(server, id);
        let cancelled = store.cancel(&Selector::Ids(vec![id]), false).await;
        let outcomes = cancelled.expect("cancel");
        assert_eq!(outcomes.len(), 1);
        assert_eq!(outcomes[0].outcome, "left_leased");
        let moved = store
            .reschedule(&Selector::Ids(vec![id]), Move::By(60_000), false)
            .await;
        let outcomes = moved.expect("reschedule");
        assert_eq!(outcomes[0].outcome, "left_leased");
        let ops = ops.lock().unwrap_or_else(|e| e.into_inner());
        let writes = ops
            .iter()
            .filter(|op| !matches!(op, Op::Find { .. }))
            .count();
        assert_eq!(writes, 0, "{ops:?}");
    }

    /// `reschedule` of a record whose lease ran out kept its owner: the holder's removal,
    /// sent before the lease ran out and landing after the move, deleted a record reported
    /// `rescheduled` (found in review). The move now frees the record too.
    #[tokio::test(start_paused = true)]
    async fn reschedule_frees_a_record_whose_lease_ran_out() {
        let server = DateTime::from_millis(NEW_YEAR_MS);
        let id = crate::host::uuid();
        let (store, ops) = leased_until_two_seconds_on(server, id);
        // The lease ran out by the earliest the server's clock can read.
        tokio::time::advance(Duration::from_secs(60)).await;
        let moved = store
            .reschedule(&Selector::Ids(vec![id]), Move::By(60_000), false)
            .await;
        assert_eq!(moved.expect("reschedule")[0].outcome, "rescheduled");
        let ops = ops.lock().unwrap_or_else(|e| e.into_inner());
        let set = ops.iter().find_map(|op| match op {
            Op::Update { update, .. } => update.get_document("$set").ok().cloned(),
            _ => None,
        });
        let set = set.expect("an update");
        assert!(set.contains_key(field::TIME), "{set}");
        assert_eq!(set.get(field::LOCKED), Some(&Bson::Boolean(false)), "{set}");
        let owner = set.get(field::LOCKED_BY).and_then(guid::from_bson);
        assert_eq!(owner, Some(Uuid::nil()), "{set}");
    }

    /// A reschedule that lost to another one (the record free, its `Time` changed since it
    /// was read) reported the record `left_leased`, under a live lease it did not have.
    #[tokio::test(start_paused = true)]
    async fn a_reschedule_that_lost_to_another_says_changed() {
        let std = UuidRepresentation::Standard;
        let id = crate::host::uuid();
        let at = move |ms| doc! { field::ID: guid::to_bson(id, std), field::DESTINATION: "q", field::TIME: DateTime::from_millis(ms), field::LOCKED: false };
        let reads = Arc::new(Mutex::new(0));
        let backend = Answering::new(move |op: Op| match &op {
            Op::Find { .. } => {
                let mut n = reads.lock().unwrap_or_else(|e| e.into_inner());
                *n += 1;
                // Read as it was, then as another reschedule left it.
                let ms = if *n == 1 {
                    NEW_YEAR_MS
                } else {
                    NEW_YEAR_MS + 5_000
                };
                Ok(Reply::Docs(vec![at(ms)]))
            }
            Op::Update { .. } => Ok(Reply::Written(Written::default())),
            other => panic!("not modelled: {other:?}"),
        });
        let store = Store::with_backend(
            Arc::new(backend),
            &MongoConfig::default(),
            ServerClock::default(),
        );
        let moved = store
            .reschedule(&Selector::Ids(vec![id]), Move::By(60_000), false)
            .await;
        assert_eq!(moved.expect("reschedule")[0].outcome, "changed");
    }

    /// A cancel whose delete failed part-way returned the error alone: the records deleted
    /// before it were neither reported nor audited, nor written to history (found in
    /// review). They now come with the error.
    #[tokio::test(start_paused = true)]
    async fn a_cancel_that_fails_part_way_returns_what_it_did() {
        let std = UuidRepresentation::Standard;
        let (first, second) = (crate::host::uuid(), crate::host::uuid());
        let record = |id| doc! { field::ID: guid::to_bson(id, std), field::DESTINATION: "q", field::TIME: DateTime::from_millis(NEW_YEAR_MS), field::LOCKED: false };
        let both = vec![record(first), record(second)];
        let deletes = Arc::new(Mutex::new(0));
        let backend = Answering::new(move |op: Op| match &op {
            Op::Find { .. } => Ok(Reply::Docs(both.clone())),
            Op::Delete { .. } => {
                let mut n = deletes.lock().unwrap_or_else(|e| e.into_inner());
                *n += 1;
                match *n {
                    1 => Ok(Reply::Written(Written {
                        deleted: 1,
                        ..Written::default()
                    })),
                    _ => Err(crate::store::backend::command_error(
                        91,
                        "ShutdownInProgress",
                        "the server is shutting down",
                    )),
                }
            }
            other => panic!("not modelled: {other:?}"),
        });
        let store = Store::with_backend(
            Arc::new(backend),
            &MongoConfig::default(),
            ServerClock::default(),
        );
        let cancelled = store
            .cancel(&Selector::Ids(vec![first, second]), false)
            .await;
        match cancelled {
            Err(OpsError::Stopped { done, .. }) => {
                assert_eq!(done.len(), 1, "{done:?}");
                assert_eq!(done[0].outcome, "cancelled");
                assert_eq!(done[0].record.id, first.to_string());
            }
            other => panic!("{other:?}"),
        }
    }

    /// A free record that an instance claimed, sent and removed between `cancel`'s read and
    /// its delete was reported `cancelled` (a batched delete's shortfall was put down to the
    /// records still there), and written to history as cancelled beside its `fired` row.
    #[tokio::test(start_paused = true)]
    async fn a_record_that_fired_meanwhile_is_gone_not_cancelled() {
        let std = UuidRepresentation::Standard;
        let (fired, free) = (crate::host::uuid(), crate::host::uuid());
        let record = |id| doc! { field::ID: guid::to_bson(id, std), field::DESTINATION: "q", field::TIME: DateTime::from_millis(NEW_YEAR_MS), field::LOCKED: false };
        let both = vec![record(fired), record(free)];
        let fired_id = guid::to_bson(fired, std);
        let reads = Arc::new(Mutex::new(0));
        let backend = Answering::new(move |op: Op| {
            let reply = match &op {
                Op::Find { .. } => {
                    let mut n = reads.lock().unwrap_or_else(|e| e.into_inner());
                    *n += 1;
                    // The selection reads both; the record that fired is gone afterwards.
                    Reply::Docs(if *n == 1 { both.clone() } else { Vec::new() })
                }
                Op::Delete { filter, .. } => {
                    let of_fired = format!("{filter:?}").contains(&format!("{fired_id:?}"));
                    Reply::Written(Written {
                        deleted: u64::from(!of_fired),
                        ..Written::default()
                    })
                }
                _ => Reply::Written(Written::default()),
            };
            Ok(reply)
        });
        let store = Store::with_backend(
            Arc::new(backend),
            &MongoConfig::default(),
            ServerClock::default(),
        );
        let outcomes = store
            .cancel(&Selector::Ids(vec![fired, free]), false)
            .await
            .expect("cancel");
        let by_id: Vec<(String, &str)> = outcomes
            .iter()
            .map(|o| (o.record.id.clone(), o.outcome))
            .collect();
        assert_eq!(
            by_id,
            vec![(fired.to_string(), "gone"), (free.to_string(), "cancelled")]
        );
    }

    const NEW_YEAR_MS: i64 = 1_767_225_600_000;
    const NEW_YEAR_TICKS: i64 = 639_028_224_000_000_000;

    #[test]
    fn a_moved_time_keeps_its_shape_and_offset() {
        let due = DateTime::from_millis(NEW_YEAR_MS);
        let date = Bson::DateTime(DateTime::from_millis(1));
        assert_eq!(same_shape(&date, due), Some(Bson::DateTime(due)));
        for offset in [-300_i32, 0, 60, 840] {
            let old = Bson::Array(vec![Bson::Int64(5), Bson::Int32(offset)]);
            let new = same_shape(&old, due).unwrap();
            let clock = NEW_YEAR_TICKS + i64::from(offset) * due::TICKS_PER_MINUTE;
            assert_eq!(
                new,
                Bson::Array(vec![Bson::Int64(clock), Bson::Int32(offset)])
            );
            assert_eq!(due::decode(Some(&new), TimeEncoding::Auto), Ok(due));
        }
        let long_offset = Bson::Array(vec![Bson::Int64(5), Bson::Int64(60)]);
        assert!(matches!(
            same_shape(&long_offset, due),
            Some(Bson::Array(a)) if a[1] == Bson::Int64(60)
        ));
    }

    #[test]
    fn nothing_outside_dotnet_range_or_of_an_unknown_shape() {
        let old = Bson::Array(vec![Bson::Int64(5), Bson::Int32(0)]);
        assert_eq!(same_shape(&old, DateTime::from_millis(i64::MAX)), None);
        assert_eq!(
            same_shape(&old, DateTime::from_millis(due::MIN_DATE_MS - 1)),
            None
        );
        let due = DateTime::from_millis(NEW_YEAR_MS);
        for bad in [
            Bson::String("x".into()),
            Bson::Array(vec![Bson::Int64(5)]),
            Bson::Array(vec![Bson::Int64(5), Bson::Int32(5000)]),
            // Int64::MIN, whose `abs()` overflows.
            Bson::Array(vec![Bson::Int64(5), Bson::Int64(i64::MIN)]),
            Bson::Array(vec![Bson::Int64(5), Bson::Int64(i64::MAX)]),
            Bson::Array(vec![Bson::Double(5.0), Bson::Int32(0)]),
        ] {
            assert_eq!(same_shape(&bad, due), None, "{bad:?}");
        }
    }

    /// Found in review: ticks stored as Int32 cannot hold an instant after the year 1's first
    /// minutes, and moving such a record stopped the whole `reschedule` with a message that
    /// blamed the new instant. They widen to Int64, as the C# driver writes them.
    #[test]
    fn int32_ticks_moved_widen_to_int64() {
        let due = DateTime::from_millis(NEW_YEAR_MS);
        let old = Bson::Array(vec![Bson::Int32(5), Bson::Int32(0)]);
        assert_eq!(
            same_shape(&old, due),
            Some(Bson::Array(vec![
                Bson::Int64(NEW_YEAR_TICKS),
                Bson::Int32(0)
            ]))
        );
        let year_one = DateTime::from_millis(due::MIN_DATE_MS);
        assert!(matches!(
            same_shape(&old, year_one),
            Some(Bson::Array(a)) if matches!(a[0], Bson::Int32(_))
        ));
    }
}
