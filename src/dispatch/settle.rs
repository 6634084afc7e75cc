//! Settling claimed records once their fate is known: remove what the broker confirmed,
//! release what could not be sent, retry or park what the broker refused, park what can never
//! be sent. Each is one [`Settle`] item that the dispatch loop runs as a background task; every
//! write is guarded by the claim's owner and live lease, and bounded by
//! `[mongodb] operation_timeout`.

use std::collections::VecDeque;
use std::time::Duration;

use bson::{Bson, DateTime, Document};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::held::Ready;
use crate::config::RetryConfig;
use crate::dispatch::publisher::SendOutcome;
use crate::host::backoff::Backoff;
use crate::metrics as m;
use crate::record::field;
use crate::record::{TimeoutRecord, display_id};
use crate::service::health::Health;
use crate::store::Store;
use crate::store::history::{self, Ended, HistorySink};
use crate::store::lease::Lease;
use crate::store::parking::{ParkReason, Parked};

/// Why a record is being parked, and after how many failed sends.
#[derive(Debug, Clone)]
pub struct Failure {
    pub reason: ParkReason,
    pub error: String,
    pub attempts: u32,
}

impl Failure {
    /// A record no attempt can fix: parked at once.
    pub fn poison(reason: ParkReason, error: String) -> Self {
        Self {
            reason,
            error,
            attempts: 0,
        }
    }
}

/// One piece of settling work.
#[derive(Debug)]
pub enum Settle {
    /// Free records under their claim's owner guard.
    Release {
        lease: Lease,
        ids: Vec<Bson>,
        reason: &'static str,
    },
    /// A send the broker refused: retry after back-off, or park after `max_attempts`.
    Refused {
        ready: Box<Ready>,
        outcome: SendOutcome,
    },
    /// Move a record to the parking collection.
    Park {
        id: Bson,
        raw: Box<Document>,
        destination: String,
        lease: Lease,
        failure: Failure,
    },
}

/// Settling work waiting for a slot, in one queue: the confirmed records waiting for a
/// removal, and the rest (releases first, then retries and parkings, in order).
///
/// It is bounded by what the loop lets in: while it holds `cap` records or more
/// ([`SettleQueue::is_full`]) no claim starts, so a destination that refuses every send
/// cannot pile up more work than the database settles (issue 25, 8.3: refused records queued
/// without bound, outlived their leases and were claimed again). And nothing in it outlives
/// its lease: work whose lease comes within the safety margin before it got a slot is
/// released instead ([`SettleQueue::release_expiring`]).
#[derive(Debug, Default)]
pub struct SettleQueue {
    /// Confirmed records waiting for a removal slot (removals have slots of their own).
    pub confirmed: Vec<Ready>,
    work: VecDeque<Settle>,
}

impl SettleQueue {
    /// How many records wait: confirmed ones and those of the other work.
    pub fn records(&self) -> usize {
        self.confirmed.len() + self.work.iter().map(Settle::records).sum::<usize>()
    }

    /// Whether no claim may start: `cap` records or more wait to settle.
    pub fn is_full(&self, cap: usize) -> bool {
        self.records() >= cap.max(1)
    }

    pub fn is_empty(&self) -> bool {
        self.confirmed.is_empty() && self.work.is_empty()
    }

    pub fn push_back(&mut self, work: Settle) {
        self.work.push_back(work);
    }

    pub fn push_front(&mut self, work: Settle) {
        self.work.push_front(work);
    }

    pub fn pop_front(&mut self) -> Option<Settle> {
        self.work.pop_front()
    }

    /// The work other than removals, in the order it runs.
    #[cfg(test)]
    pub fn work(&self) -> impl Iterator<Item = &Settle> {
        self.work.iter()
    }

    /// Retries and parkings whose lease has less than `margin` left at `now` (server clock)
    /// are released instead, ahead of the rest: a guarded write that lands after the lease ran
    /// out matches nothing, and the record would come back to a claim as a lost lease. The
    /// refusal is not counted then: the record is sent again by the next claim and counted
    /// on that attempt. Returns how many were released.
    pub fn release_expiring(&mut self, now: DateTime, margin: Duration) -> usize {
        let expiring = |s: &Settle| match s.lease() {
            Some(lease) => lease.remaining(now) < margin,
            None => false,
        };
        if !self.work.iter().any(expiring) {
            return 0;
        }
        let (late, kept): (Vec<Settle>, Vec<Settle>) = std::mem::take(&mut self.work)
            .into_iter()
            .partition(expiring);
        self.work = kept.into();
        let held: Vec<(Bson, Lease)> = late
            .into_iter()
            .filter_map(|s| match s {
                Settle::Refused { ready, .. } => Some((ready.id, ready.lease)),
                Settle::Park { id, lease, .. } => Some((id, lease)),
                Settle::Release { .. } => None,
            })
            .collect();
        let n = held.len();
        tracing::warn!(
            records = n,
            margin = ?margin,
            "settling did not start before the lease safety margin; releasing instead"
        );
        for work in Settle::releases(held, "margin").into_iter().rev() {
            self.work.push_front(work);
        }
        n
    }
}

impl Settle {
    /// How many records the work settles.
    pub fn records(&self) -> usize {
        match self {
            Settle::Release { ids, .. } => ids.len(),
            Settle::Refused { .. } | Settle::Park { .. } => 1,
        }
    }

    /// The destination of a refused send this work retries or parks.
    pub fn refused_destination(&self) -> Option<String> {
        match self {
            Settle::Refused { ready, .. } => Some(ready.record.destination.clone()),
            Settle::Release { .. } | Settle::Park { .. } => None,
        }
    }

    /// The lease a retry or a parking needs (a release needs none: it may match nothing).
    fn lease(&self) -> Option<&Lease> {
        match self {
            Settle::Release { .. } => None,
            Settle::Refused { ready, .. } => Some(&ready.lease),
            Settle::Park { lease, .. } => Some(lease),
        }
    }

    /// Releases grouped by claim, one item per claim.
    pub fn releases(held: Vec<(Bson, Lease)>, reason: &'static str) -> Vec<Settle> {
        by_lease(held, |(_, l)| *l)
            .into_iter()
            .map(|(lease, batch)| Settle::Release {
                lease,
                ids: batch.into_iter().map(|(id, _)| id).collect(),
                reason,
            })
            .collect()
    }

    /// Runs the work; parked records go to `history` when it is on.
    pub async fn run(self, store: &Store, retry: &RetryConfig, history: Option<&HistorySink>) {
        match self {
            Settle::Release { lease, ids, reason } => {
                release(store, &ids, lease.owner, reason).await
            }
            Settle::Refused { ready, outcome } => {
                retry_or_park(store, retry, *ready, outcome, history).await
            }
            Settle::Park {
                id,
                raw,
                destination,
                lease,
                failure,
            } => {
                park(
                    store,
                    &id,
                    &raw,
                    &destination,
                    lease.owner,
                    &failure,
                    history,
                )
                .await
            }
        }
    }
}

/// Frees records under the owner guard. A shortfall means their lease ran out first: another
/// instance may hold them now, which is what a release is for. It is not counted as a lost
/// lease: a record released unsent can cause no duplicate, and one released after a publish of
/// unknown outcome was counted when that outcome came in.
pub async fn release(store: &Store, ids: &[Bson], owner: Uuid, reason: &'static str) {
    match store
        .bounded("release", store.release_many(ids, owner))
        .await
    {
        Ok(freed) => {
            m::released(reason, freed as usize);
            let expired = ids.len().saturating_sub(freed as usize);
            if expired > 0 {
                tracing::info!(%owner, reason, expired, "some records to release were no longer held: their lease had run out");
            }
        }
        Err(e) => {
            tracing::warn!(%owner, reason, records = ids.len(), error = %e, "release failed; the leases will expire and the reaper frees them")
        }
    }
}

/// A send the broker refused: counted, then retried after back-off (the lease is kept until
/// the next attempt), or parked after `max_attempts`.
async fn retry_or_park(
    store: &Store,
    retry: &RetryConfig,
    r: Ready,
    outcome: SendOutcome,
    history: Option<&HistorySink>,
) {
    let owner = r.lease.owner;
    let correlation_id = r.record.process_manager_id;
    let destination = r.record.destination.as_str();
    let (reason, error) = match outcome {
        SendOutcome::Nacked => (
            ParkReason::Nacked,
            "the broker nacked the publish".to_string(),
        ),
        _ => (
            ParkReason::Unroutable,
            format!("returned by the broker: no queue is bound to routing key `{destination}`"),
        ),
    };
    let parking = store.parking();
    let attempts = match store
        .bounded(
            "count a failed send",
            parking.count_failure(&r.id, owner, &error),
        )
        .await
    {
        Ok(Some(n)) => n,
        Ok(None) => {
            m::lease_lost(1);
            tracing::warn!(timeout_id = %r.record.id, %correlation_id, destination, %owner, "send refused and the lease was lost before the failure was counted");
            return;
        }
        Err(e) => {
            tracing::warn!(timeout_id = %r.record.id, %correlation_id, destination, %owner, error = %e, "could not count the failed send; releasing");
            release(store, std::slice::from_ref(&r.id), owner, "publish_failed").await;
            return;
        }
    };
    if attempts >= retry.max_attempts {
        let failure = Failure {
            reason,
            error,
            attempts,
        };
        park(store, &r.id, &r.raw, destination, owner, &failure, history).await;
        return;
    }
    let wait = retry.delay_after(attempts);
    let until = crate::store::lease::add(store.clock().now(), wait);
    match store
        .bounded("defer a retry", parking.defer(&r.id, owner, until))
        .await
    {
        Ok(true) => {
            m::retried();
            tracing::warn!(timeout_id = %r.record.id, %correlation_id, destination, %owner, reason = reason.as_str(), attempt = attempts, max_attempts = retry.max_attempts, retry_in = ?wait, "send refused; retrying after back-off");
        }
        Ok(false) => {
            m::lease_lost(1);
            tracing::warn!(timeout_id = %r.record.id, %correlation_id, destination, %owner, "send refused and the lease was lost before the retry was scheduled");
        }
        Err(e) => {
            tracing::warn!(timeout_id = %r.record.id, %correlation_id, destination, %owner, error = %e, "could not schedule the retry; the record comes back when its lease expires");
        }
    }
}

/// Moves a record to the parking collection (see [`crate::store::parking`]) and, with history on,
/// records that it was parked and why.
async fn park(
    store: &Store,
    id: &Bson,
    raw: &Document,
    destination: &str,
    owner: Uuid,
    failure: &Failure,
    history: Option<&HistorySink>,
) {
    let timeout_id = display_id(id);
    // The stored record, read as it is: a record parked for its shape may lack any of these.
    let correlation_id = raw
        .get(field::PROCESS_MANAGER_ID)
        .and_then(crate::record::guid::from_bson)
        .map(|u| u.to_string());
    let correlation_id = correlation_id.as_deref().unwrap_or("-");
    let destination = match (destination, raw.get(field::DESTINATION)) {
        ("", Some(Bson::String(d))) => d.as_str(),
        (d, _) => d,
    };
    let Failure {
        reason,
        error,
        attempts,
    } = failure;
    let parking = store.parking();
    match store
        .bounded(
            "park a record",
            parking.park(id, raw, owner, *reason, error, *attempts),
        )
        .await
    {
        Ok(Parked::LeaseLost) => {
            m::lease_lost(1);
            tracing::warn!(%timeout_id, correlation_id, destination, %owner, reason = reason.as_str(), "record not parked: its lease was lost (another owner holds it, or it ran out); the parked copy was taken back");
        }
        Ok(Parked::Moved) => {
            m::parked(reason.as_str());
            tracing::warn!(%timeout_id, correlation_id, destination, %owner, reason = reason.as_str(), attempts, error, "record parked");
            if let Some(sink) = history {
                let ended = Ended {
                    event: history::event::PARKED,
                    timeout_id: timeout_id.clone(),
                    correlation_id: (correlation_id != "-").then(|| correlation_id.to_string()),
                    destination: (!destination.is_empty()).then(|| destination.to_string()),
                    due: TimeoutRecord::decode_due(raw, store.encoding()),
                    attempts: Some(i64::from(*attempts)),
                    reason: Some(reason.as_str()),
                    detail: Some(error),
                };
                sink.record(vec![ended.row(store.clock().now())]);
            }
        }
        Err(e) => {
            tracing::warn!(%timeout_id, correlation_id, destination, %owner, error = %e, "parking failed; the record stays leased and comes back when its lease expires");
        }
    }
}

/// Counts the confirmed records of a removal that did not finish as possible duplicates, when
/// it is dropped before [`Unremoved::settled`]: a removal task aborted at the end of the
/// shutdown's drain, or one that panicked. Its records stay leased, and whoever claims them
/// once the lease ran out sends them again.
struct Unremoved<'a> {
    confirmed: &'a [(Bson, TimeoutRecord)],
    owner: Uuid,
    settled: bool,
}

impl Unremoved<'_> {
    /// The removal accounted for its records itself.
    fn settled(&mut self) {
        self.settled = true;
    }
}

impl Drop for Unremoved<'_> {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let owner = self.owner;
        for (_, r) in self.confirmed {
            tracing::warn!(timeout_id = %r.id, correlation_id = %r.process_manager_id, destination = %r.destination, %owner, "removal of a sent record abandoned; it stays leased and may be sent again after the lease");
        }
        m::possible_duplicates(m::DUPLICATE_SHUTDOWN, self.confirmed.len());
    }
}

/// Deletes the confirmed records of one claim under its owner guard, after checking that the
/// lease still holds; retries a failed delete while it does and shutdown has not begun. A
/// shortfall is a lost lease: the message may be sent again by whoever holds the record now.
/// Once `drain_over` is cancelled (the shutdown's drain is ending) it gives up and counts the
/// records it could not remove as possible duplicates, as it does if it is dropped unfinished.
pub async fn remove(
    store: &Store,
    health: &Health,
    confirmed: &[(Bson, TimeoutRecord)],
    lease: &Lease,
    shutdown: &CancellationToken,
    drain_over: &CancellationToken,
) {
    if confirmed.is_empty() {
        return;
    }
    let owner = lease.owner;
    let mut unremoved = Unremoved {
        confirmed,
        owner,
        settled: false,
    };
    removal_attempts(store, health, confirmed, lease, shutdown, drain_over).await;
    unremoved.settled();
}

/// [`remove`]'s attempts; each way out accounts for every record.
async fn removal_attempts(
    store: &Store,
    health: &Health,
    confirmed: &[(Bson, TimeoutRecord)],
    lease: &Lease,
    shutdown: &CancellationToken,
    drain_over: &CancellationToken,
) {
    let owner = lease.owner;
    let ids: Vec<Bson> = confirmed.iter().map(|(id, _)| id.clone()).collect();
    let mut backoff = Backoff::reconnect();
    loop {
        // "Does the lease still hold?" asks the latest the server's clock can read, here as
        // for the wait below: with the midpoint here, a reading in between (live by the
        // midpoint, over by the latest) made the wait zero and a delete that failed at once
        // (connection refused) a busy loop (simulation seed 78).
        if !lease.is_live(store.clock().latest()) {
            for (_, r) in confirmed {
                tracing::warn!(timeout_id = %r.id, correlation_id = %r.process_manager_id, destination = %r.destination, %owner, "lease expired during the publish; not removing (a peer may have re-claimed it)");
            }
            sent_and_lost(confirmed.len());
            return;
        }
        let removal = tokio::select! {
            biased;
            removal = store.bounded("remove sent records", store.remove_held(&ids, owner)) => removal,
            _ = drain_over.cancelled() => {
                // The delete may still land on the server; if it does not, the records are
                // sent again after the lease.
                m::possible_duplicates(m::DUPLICATE_SHUTDOWN, confirmed.len());
                tracing::warn!(%owner, records = ids.len(), "removing sent records did not finish before the end of the shutdown's drain; they may stay leased and be sent again after the lease");
                return;
            }
        };
        // Tests only: the server applied the delete, but its answer was lost.
        #[cfg(feature = "failpoints")]
        let removal = match fail::eval("remove-answer-lost", |_| ()) {
            Some(()) if removal.is_ok() => Err(crate::deadline::Elapsed {
                what: "remove sent records",
                limit: std::time::Duration::ZERO,
            }
            .into()),
            _ => removal,
        };
        match removal {
            Ok(deleted) => {
                let short = ids.len().saturating_sub(deleted as usize);
                // Only while the lease still holds can a record that is gone have been deleted
                // by this removal's own earlier attempt; after it ran out, a peer may have
                // claimed, sent and deleted it.
                let live = lease.is_live(store.clock().latest());
                let gone = if short > 0 {
                    account_for_shortfall(store, &ids, confirmed, owner, short, live).await
                } else {
                    0
                };
                m::removed(deleted as usize + gone);
                return;
            }
            Err(e) if shutdown.is_cancelled() => {
                m::possible_duplicates(m::DUPLICATE_SHUTDOWN, confirmed.len());
                tracing::warn!(%owner, records = ids.len(), error = %e, "removing sent records failed during shutdown; they stay leased and may be sent again after the lease");
                return;
            }
            Err(e) => {
                health.set_up(m::MONGODB, false);
                let wait = backoff
                    .next_delay()
                    .min(lease.remaining(store.clock().latest()));
                tracing::warn!(%owner, records = ids.len(), error = %e, retry_in = ?wait, "removing sent records failed; retrying while the lease holds");
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = shutdown.cancelled() => {}
                }
            }
        }
    }
}

/// A guarded delete removed `short` fewer records than it was given. Those still in the
/// collection are held by another owner now: lost leases, possible duplicates, each named.
/// While the lease is `live`, those gone were deleted by an earlier attempt of this removal
/// whose answer was lost (a deadline or a cut connection after the server applied it): nobody
/// else can delete a record under this instance's live lease. Once it ran out, a peer may have
/// sent and deleted them: lost leases too. Returns how many count as removed.
async fn account_for_shortfall(
    store: &Store,
    ids: &[Bson],
    confirmed: &[(Bson, TimeoutRecord)],
    owner: Uuid,
    short: usize,
    live: bool,
) -> usize {
    if !live {
        sent_and_lost(short);
        tracing::warn!(%owner, records = short, "lease ran out before the sent records could be removed; a peer may send them again");
        return 0;
    }
    match store.bounded("name lost leases", store.existing(ids)).await {
        Ok(still_there) => {
            let lost = confirmed
                .iter()
                .filter(|(id, _)| still_there.contains(id))
                .inspect(|(_, r)| {
                    tracing::warn!(timeout_id = %r.id, correlation_id = %r.process_manager_id, destination = %r.destination, %owner, "lease lost: record was sent but is held by another owner now; it may be sent again");
                })
                .count();
            sent_and_lost(lost);
            short.saturating_sub(lost)
        }
        Err(e) => {
            sent_and_lost(short);
            tracing::warn!(%owner, error = %e, records = short, "lease lost on some sent records; could not name them");
            0
        }
    }
}

/// `n` confirmed records whose lease was lost before their removal: a lost lease, and a
/// possible duplicate (whoever holds them now sends them again).
fn sent_and_lost(n: usize) {
    m::lease_lost(n);
    m::possible_duplicates(m::DUPLICATE_LEASE_LOST, n);
}

/// Groups items by the lease of the claim that took them, in first-seen order.
pub fn by_lease<T>(items: Vec<T>, lease_of: impl Fn(&T) -> Lease) -> Vec<(Lease, Vec<T>)> {
    let mut groups: Vec<(Lease, Vec<T>)> = Vec::new();
    for item in items {
        let lease = lease_of(&item);
        match groups.iter_mut().find(|(l, _)| l.owner == lease.owner) {
            Some((_, g)) => g.push(item),
            None => groups.push((lease, vec![item])),
        }
    }
    groups
}
