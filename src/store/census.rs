//! Counting for operators: `stats`, and the census of records nothing will fire on its own:
//! `Time` of a shape the setting does not serve (unschedulable), `Locked: true` without a
//! lease expiry (stuck, left by ServiceConnect's own poller), and `Locked` missing or not a
//! boolean with no lease expiry (odd: no claim and no reaper pass matches them, and timeoutd
//! never writes to a record it cannot claim under the lease rules, so they are counted and
//! named, not changed). The reaper (`crate::maintenance::reaper`) takes the census and frees stuck
//! records. The monitor's backlog gauges are [`crate::store::backlog`].

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

use bson::{Bson, Document, doc};
use serde::Serialize;

use crate::record::due;
use crate::record::{display_id, field};
use crate::store::lease;
use crate::store::{Store, StoreError};

/// At most this many unschedulable records are named in the logs per census (each once).
pub const NAMED_PER_CENSUS: i64 = 100;
/// At most this many stuck records are tracked at once (public pollers leave one per crash).
pub const STUCK_TRACKED: i64 = 1_000;
/// The monitor counts due records up to this many (`timeoutd_due_backlog`); `stats` counts
/// them all.
pub const BACKLOG_COUNTED_UP_TO: u64 = 10_000;
/// How often the warning about another dispatcher is repeated while it lasts.
pub const FOREIGN_WARNING_EVERY: Duration = Duration::from_secs(600);

/// Counts for `timeoutd stats`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Stats {
    /// Records not due yet and not leased.
    pub pending: u64,
    /// Due records any worker may claim now (free, or leased with an expired lease).
    pub due: u64,
    /// Records under a live lease.
    pub leased: u64,
    /// Records whose lease has expired and that the reaper has not freed yet.
    pub expired_leases: u64,
    /// `Locked: true` with no lease expiry: another dispatcher holds them, or died holding
    /// them; the reaper frees them once they stayed so for a whole lease.
    pub stuck_locks: u64,
    /// Records whose `Time` is of no shape the `time_encoding` setting serves (or outside
    /// .NET's range): they never fire until fixed.
    pub unschedulable: u64,
    /// Records whose `Locked` is missing or not a boolean, with no date in `LockExpiresAt`:
    /// no claim takes them (a claim matches `Locked: false` or an expired lease), so they
    /// never fire until fixed.
    pub odd_locked: u64,
    /// Age of the oldest due record, leased or not, in seconds; `None` when nothing is due.
    pub oldest_due_age_seconds: Option<f64>,
    /// Records in the parking collection.
    pub parked: u64,
    /// Records with failed sends counted (waiting for a retry, or sent in the end).
    pub retrying: u64,
}

/// What one census found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Census {
    pub unschedulable: u64,
    pub stuck_locks: u64,
    /// Records locked as timeoutd never locks them (no expiry, or no owner).
    pub foreign_locks: u64,
    /// `Locked` missing or not a boolean, no lease expiry ([`Stats::odd_locked`]).
    pub odd_locked: u64,
}

/// What the census remembers between passes; the reaper keeps it and hands it in.
#[derive(Debug, Default)]
pub struct CensusState {
    /// Unschedulable records already named in the logs.
    named: Mutex<HashSet<String>>,
    /// Stuck records, by `_id`, and when this instance first saw each.
    stuck_since: Mutex<HashMap<String, (Bson, Instant)>>,
    warned_foreign_at: Mutex<Option<Instant>>,
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn key_of(id: &Bson) -> String {
    format!("{id:?}")
}

/// Records no claim and no reaper pass ever matches: `Locked` missing or not a boolean (the
/// claim matches `Locked: false`, the reaper `Locked: true`), and no date in `LockExpiresAt`
/// (the claim's other branch, an expired lease). ServiceConnect always writes a boolean.
pub fn odd_locked_filter() -> Document {
    doc! { "$and": [
        { field::LOCKED: { "$not": { "$type": "bool" } } },
        { field::LOCK_EXPIRES_AT: { "$not": { "$type": "date" } } },
    ] }
}

impl Store {
    /// How many records of the timeouts collection `filter` matches.
    pub(crate) async fn count(&self, filter: Document) -> Result<u64, StoreError> {
        self.query(self.coll.count_documents(filter)).await
    }

    /// The filter of records no branch of the due query will ever match.
    fn unschedulable_filter(&self) -> Document {
        doc! { "$nor": [due::schedulable(self.encoding)] }
    }

    /// Counts for operators.
    pub async fn stats(&self) -> Result<Stats, StoreError> {
        let shapes = self.shapes().await?;
        let now = self.clock.now();
        let not_due = lease::all_of([
            lease::due_after(now, &shapes),
            doc! { field::LOCKED: false },
        ]);
        let parking = self.parking();
        let (due, pending, leased, expired, stuck, unschedulable, parked, retrying) = tokio::try_join!(
            self.count(lease::due_filter(now, &shapes)),
            self.count(not_due),
            self.count(lease::held_any(now)),
            self.count(lease::expired(now)),
            self.count(lease::stuck()),
            self.count(self.unschedulable_filter()),
            parking.count(),
            parking.count_retrying(),
        )?;
        let odd_locked = self.count(odd_locked_filter()).await?;
        let oldest_due_age_seconds = self.oldest_due_age(now, &shapes, &[]).await?;
        Ok(Stats {
            pending,
            due,
            leased,
            expired_leases: expired,
            stuck_locks: stuck,
            unschedulable,
            odd_locked,
            oldest_due_age_seconds,
            parked,
            retrying,
        })
    }

    /// Counts what nothing will fire on its own, names each unschedulable record in the logs
    /// once, and warns (at most every [`FOREIGN_WARNING_EVERY`]) when records are locked as
    /// timeoutd never locks them: another dispatcher is claiming in this collection.
    pub async fn census(&self, state: &CensusState) -> Result<Census, StoreError> {
        let (unschedulable, stuck_locks, foreign_locks, odd_locked) = tokio::try_join!(
            self.count(self.unschedulable_filter()),
            self.count(lease::stuck()),
            self.count(lease::foreign_locks()),
            self.count(odd_locked_filter()),
        )?;
        // Each named in the logs once (at most NAMED_PER_CENSUS a census), with what it holds.
        let unnamed = match unschedulable {
            0 => Vec::new(),
            _ => {
                self.not_yet_named(state, self.unschedulable_filter(), field::TIME, "")
                    .await?
            }
        };
        for (id, time) in unnamed {
            tracing::warn!(
                timeout_id = %display_id(&id),
                time = time.as_deref().unwrap_or("(missing)"),
                time_encoding = ?self.encoding,
                "record cannot be scheduled: its Time is of no shape the time_encoding setting serves, or outside .NET's range; it will not fire until fixed"
            );
        }
        let unnamed = match odd_locked {
            0 => Vec::new(),
            _ => {
                self.not_yet_named(state, odd_locked_filter(), field::LOCKED, "locked:")
                    .await?
            }
        };
        for (id, value) in unnamed {
            tracing::warn!(
                timeout_id = %display_id(&id),
                locked = value.as_deref().unwrap_or("(missing)"),
                "record cannot be claimed: its Locked is missing or not a boolean and it has no lease expiry, so no claim matches it (ServiceConnect writes Locked: false for a free record); timeoutd does not write to records it cannot claim: set Locked to false to let it fire"
            );
        }
        if foreign_locks > 0 {
            let mut warned = locked(&state.warned_foreign_at);
            if warned.is_none_or(|t| t.elapsed() >= FOREIGN_WARNING_EVERY) {
                *warned = Some(Instant::now());
                tracing::warn!(
                    records = foreign_locks,
                    "records in the timeouts collection are locked with no lease expiry or no owner: another dispatcher (ServiceConnect's own timeout poller?) claims records here, or died holding them. Turn ServiceConnect's poller off where timeoutd runs; the reaper frees such records once they stayed locked for a whole lease"
                );
            }
        }
        Ok(Census {
            unschedulable,
            stuck_locks,
            foreign_locks,
            odd_locked,
        })
    }

    /// The records of `filter` (at most [`NAMED_PER_CENSUS`]) not yet named in the logs under
    /// `kind`, each with its `shown` field as text; they count as named from now on.
    async fn not_yet_named(
        &self,
        state: &CensusState,
        filter: Document,
        shown: &str,
        kind: &str,
    ) -> Result<Vec<(Bson, Option<String>)>, StoreError> {
        let docs: Vec<Document> = self
            .query(
                self.coll
                    .find(filter)
                    .projection(doc! { field::ID: 1, shown: 1, field::DESTINATION: 1 })
                    .limit(NAMED_PER_CENSUS),
            )
            .await?;
        let mut named = locked(&state.named);
        let mut fresh = Vec::new();
        for d in docs {
            let id = d.get(field::ID).cloned().unwrap_or(Bson::Null);
            if named.len() < 100_000 && named.insert(format!("{kind}{}", key_of(&id))) {
                fresh.push((id, d.get(shown).map(|v| v.to_string())));
            }
        }
        Ok(fresh)
    }

    /// Frees the records this instance has seen locked without a lease expiry for at least
    /// `lease` (`$set {Locked: false}` only, so the record keeps its own shape); returns how
    /// many. The age is this instance's own observation, so a record is never freed before
    /// a whole lease has passed since it was first seen stuck.
    pub async fn free_stuck(
        &self,
        state: &CensusState,
        lease_len: Duration,
    ) -> Result<u64, StoreError> {
        let ids = self.coll.find_ids(lease::stuck()).limit(STUCK_TRACKED);
        let ids = self.query(ids).await?;
        let now = Instant::now();
        let old: Vec<Bson> = {
            let mut since = locked(&state.stuck_since);
            let current: HashMap<String, Bson> =
                ids.into_iter().map(|id| (key_of(&id), id)).collect();
            since.retain(|k, _| current.contains_key(k));
            for (k, id) in current {
                since.entry(k).or_insert((id, now));
            }
            since
                .values()
                .filter(|(_, seen)| now.duration_since(*seen) >= lease_len)
                .map(|(id, _)| id.clone())
                .collect()
        };
        if old.is_empty() {
            return Ok(0);
        }
        let freed = self
            .query(self.coll.update_many(
                lease::stuck_among(&old),
                doc! { "$set": { field::LOCKED: false } },
            ))
            .await?;
        let mut since = locked(&state.stuck_since);
        for id in &old {
            since.remove(&key_of(id));
        }
        Ok(freed.modified)
    }
}
