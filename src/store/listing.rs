//! `timeoutd list`: what will fire, for which saga, and when.
//!
//! One query per `Time` shape the collection holds, each on that shape's due index, in due
//! order and limited to `--limit`, merged by true instant (the way a claim reads, see
//! [`crate::store::claim`]): the rows read and the memory used are bounded by the limit, whatever
//! the size of the collection. The filters become clauses of those queries; `--due-before`
//! and `--due-after` become bounds of the index range.
//!
//! Every value is read as hostile: a row whose fields do not decode is still listed, with
//! `-` for what it lacks.

use std::collections::HashSet;

use bson::{Bson, DateTime, Document, doc};
use serde::Serialize;
use uuid::Uuid;

use crate::record::due::Shape;
use crate::record::{TimeoutRecord, display_id, field};
use crate::store::lease;
use crate::store::{Store, StoreError, date, text};

/// The most rows one `list` returns, whatever `--limit` says.
pub const MAX_LIMIT: u32 = 10_000;

/// A record's state, as `list` shows it and `--state` selects it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Not due yet, and free: it fires at its instant.
    Pending,
    /// Due and claimable: the next claim takes it.
    Due,
    /// Under a live lease: an instance holds it (sending it, or holding it until its
    /// instant within the look-ahead).
    Leased,
    /// Under a live lease after a refused send, waiting for its next attempt.
    Retrying,
    /// In the parking collection: it will not fire until requeued.
    Parked,
    /// Locked with no lease expiry or no owner: another dispatcher holds it.
    #[value(skip)]
    Locked,
    /// Its `Time` is of no shape timeoutd serves.
    #[value(skip)]
    Unschedulable,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Due => "due",
            Self::Leased => "leased",
            Self::Retrying => "retrying",
            Self::Parked => "parked",
            Self::Locked => "locked",
            Self::Unschedulable => "unschedulable",
        }
    }
}

/// What `list` selects.
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    pub destination: Option<String>,
    pub correlation_id: Option<Uuid>,
    /// Due strictly before this instant.
    pub due_before: Option<DateTime>,
    /// Due strictly after this instant.
    pub due_after: Option<DateTime>,
    pub state: Option<State>,
    pub limit: u32,
}

/// One listed record.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Listed {
    /// The GUID as .NET prints it, or the raw `_id` when it is not one.
    pub id: String,
    pub destination: Option<String>,
    pub correlation_id: Option<String>,
    /// RFC 3339, UTC; `None` when `Time` does not decode.
    pub due: Option<String>,
    pub state: State,
    /// The lease owner, for a leased (or retrying, or locked) record.
    pub owner: Option<String>,
    /// RFC 3339, UTC: when the lease ends.
    pub lease_end: Option<String>,
}

/// An instant as `list` prints it: RFC 3339 in UTC with milliseconds.
pub fn show_instant(t: DateTime) -> Option<String> {
    t.try_to_rfc3339_string().ok()
}

/// Whether a stored document is free at `now` by the rules of [`lease::claimable`]: not
/// locked, or locked with a lease that has run out.
pub fn is_free(d: &Document, now: DateTime) -> bool {
    match d.get(field::LOCKED) {
        Some(Bson::Boolean(false)) => true,
        _ => matches!(d.get(field::LOCK_EXPIRES_AT), Some(Bson::DateTime(t)) if *t <= now),
    }
}

/// How a stored document is listed, at `now`; `retrying` when it has failed sends counted.
pub fn describe(store: &Store, d: &Document, now: DateTime, retrying: bool) -> Listed {
    let due = TimeoutRecord::decode_due(d, store.encoding());
    let owner = d
        .get(field::LOCKED_BY)
        .and_then(crate::record::guid::from_bson);
    // Locked with an expiry: timeoutd's lease (locked without one: another dispatcher's).
    let lease = match d.get(field::LOCKED) {
        Some(Bson::Boolean(true)) => date(d, field::LOCK_EXPIRES_AT),
        _ => None,
    };
    let (state, lease_end) = match (is_free(d, now), lease) {
        (false, Some(end)) if retrying => (State::Retrying, Some(end)),
        (false, Some(end)) => (State::Leased, Some(end)),
        (false, _) => (State::Locked, None),
        (true, _) => match due {
            None => (State::Unschedulable, None),
            Some(t) if t <= now => (State::Due, None),
            Some(_) => (State::Pending, None),
        },
    };
    let held = !matches!(state, State::Pending | State::Due | State::Unschedulable);
    Listed {
        id: d
            .get(field::ID)
            .map(display_id)
            .unwrap_or_else(|| "-".into()),
        destination: text(d, field::DESTINATION),
        correlation_id: d
            .get(field::PROCESS_MANAGER_ID)
            .and_then(crate::record::guid::from_bson)
            .map(|u| u.to_string()),
        due: due.and_then(show_instant),
        state,
        owner: owner.filter(|o| held && !o.is_nil()).map(|o| o.to_string()),
        lease_end: lease_end.and_then(show_instant),
    }
}

/// The clauses on a record's own fields: destination and saga.
pub fn field_clauses(destination: Option<&str>, correlation_id: Option<Uuid>) -> Vec<Document> {
    let mut clauses = Vec::new();
    if let Some(d) = destination {
        clauses.push(doc! { field::DESTINATION: d });
    }
    if let Some(c) = correlation_id {
        clauses.push(
            doc! { field::PROCESS_MANAGER_ID: { "$in": crate::record::guid::both_forms(c).to_vec() } },
        );
    }
    clauses
}

/// Records of `shape` due strictly after `after` and strictly before `before` (each when
/// set): a range of that shape's due index.
fn due_range(shape: Shape, after: Option<DateTime>, before: Option<DateTime>) -> Document {
    let bound = |t: DateTime| match shape {
        Shape::Date => Bson::DateTime(t),
        Shape::Ticks(o) => Bson::Int64(
            crate::record::ms_to_ticks(t.timestamp_millis())
                .saturating_add(i64::from(o).saturating_mul(crate::record::due::TICKS_PER_MINUTE)),
        ),
    };
    let mut range = Document::new();
    if let Some(b) = before {
        range.insert("$lt", bound(b));
    }
    if let Some(a) = after {
        range.insert("$gt", bound(a));
    }
    match shape {
        Shape::Date if range.is_empty() => doc! { field::TIME: { "$type": "date" } },
        Shape::Date => doc! { field::TIME: range },
        Shape::Ticks(o) if range.is_empty() => doc! { field::TIME_OFFSET: o },
        Shape::Ticks(o) => doc! { field::TIME_OFFSET: o, field::TIME_TICKS: range },
    }
}

impl Store {
    /// The records `filter` selects, soonest first, at most `filter.limit` (and
    /// [`MAX_LIMIT`]).
    pub async fn list(&self, filter: &ListFilter) -> Result<Vec<Listed>, StoreError> {
        let limit = filter.limit.clamp(1, MAX_LIMIT);
        if filter.state == Some(State::Parked) {
            return self.list_parked(filter, limit).await;
        }
        let shapes = self.shapes().await?;
        let now = self.clock.now();
        let (mut after, mut before) = (filter.due_after, filter.due_before);
        let mut clauses = field_clauses(filter.destination.as_deref(), filter.correlation_id);
        match filter.state {
            Some(State::Pending) => {
                after = Some(after.map_or(now, |a| a.max(now)));
                clauses.push(lease::claimable(now));
            }
            Some(State::Due) => {
                // Due at `now` means at or before it: one millisecond past bounds it.
                let limit = lease::add(now, std::time::Duration::from_millis(1));
                before = Some(before.map_or(limit, |b| b.min(limit)));
                clauses.push(lease::claimable(now));
            }
            Some(State::Leased) => clauses.push(lease::held_any(now)),
            Some(State::Retrying) => {
                clauses.push(lease::held_any(now));
                // The `_id`s with failed sends counted (at most [`MAX_LIMIT`] of them).
                let counted = self.attempts.find_ids(doc! {});
                let ids = self.query(counted.limit(i64::from(MAX_LIMIT))).await?;
                clauses.push(doc! { field::ID: { "$in": ids } });
            }
            _ => {}
        }
        let reads = shapes.iter().map(|shape| {
            let mut all = vec![due_range(*shape, after, before)];
            all.extend(clauses.iter().cloned());
            let find = self
                .coll
                .find(doc! { "$and": all })
                .sort(shape.sort())
                .limit(i64::from(limit));
            find.into_future()
        });
        let found = self.query(futures::future::try_join_all(reads)).await?;
        let mut docs: Vec<(i64, Document)> = found
            .into_iter()
            .flatten()
            .map(|d| {
                let due = TimeoutRecord::decode_due(&d, self.encoding)
                    .map_or(i64::MAX, |t| t.timestamp_millis());
                (due, d)
            })
            .collect();
        docs.sort_by_key(|(due, _)| *due);
        docs.truncate(limit as usize);
        let ids: Vec<Bson> = docs
            .iter()
            .filter_map(|(_, d)| d.get(field::ID).cloned())
            .collect();
        // Of the rows, those with failed sends counted, keyed by their debug form.
        let counted = match ids.is_empty() {
            true => Vec::new(),
            false => {
                let counted = self.attempts.find_ids(doc! { field::ID: { "$in": ids } });
                self.query(counted).await?
            }
        };
        let retrying: HashSet<String> = counted.iter().map(|id| format!("{id:?}")).collect();
        let rows = docs
            .iter()
            .map(|(_, d)| {
                let counted = d
                    .get(field::ID)
                    .is_some_and(|id| retrying.contains(&format!("{id:?}")));
                describe(self, d, now, counted)
            })
            // `leased` takes in the retrying records: they are under a live lease too.
            .filter(|r| {
                filter.state.is_none_or(|s| {
                    s == r.state || (s == State::Leased && r.state == State::Retrying)
                })
            })
            .collect();
        Ok(rows)
    }

    /// Parked records as `list` shows them, oldest parked first.
    async fn list_parked(
        &self,
        filter: &ListFilter,
        limit: u32,
    ) -> Result<Vec<Listed>, StoreError> {
        use crate::store::parking::parked_field::{PARKED_AT, RECORD};
        let mut clauses = vec![doc! {}];
        for c in field_clauses(filter.destination.as_deref(), filter.correlation_id) {
            clauses.push(
                c.into_iter()
                    .map(|(k, v)| (format!("{RECORD}.{k}"), v))
                    .collect(),
            );
        }
        let docs: Vec<Document> = self
            .query(
                self.parked
                    .find(doc! { "$and": clauses })
                    .sort(doc! { PARKED_AT: 1 })
                    .limit(i64::from(limit)),
            )
            .await?;
        let now = self.clock.now();
        Ok(docs
            .iter()
            .filter_map(|d| d.get_document(RECORD).ok())
            .map(|r| Listed {
                state: State::Parked,
                owner: None,
                lease_end: None,
                ..describe(self, r, now, false)
            })
            .filter(|r| {
                let due = r
                    .due
                    .as_deref()
                    .and_then(|s| DateTime::parse_rfc3339_str(s).ok());
                filter.due_before.is_none_or(|b| due.is_some_and(|d| d < b))
                    && filter.due_after.is_none_or(|a| due.is_some_and(|d| d > a))
            })
            .collect())
    }
}
