//! Settling claimed records once their fate is known: remove what the broker confirmed,
//! release what could not be sent, retry or park what the broker refused, park what can never
//! be sent. Each is one [`Settle`] item that the dispatch loop runs as a background task; every
//! write is guarded by the claim's owner and live lease, and bounded by
//! `[mongodb] operation_timeout`.

use bson::{Bson, Document};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::held::Ready;
use crate::backoff::Backoff;
use crate::config::RetryConfig;
use crate::dispatch::publisher::SendOutcome;
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
        owner: Uuid,
        failure: Failure,
    },
}

impl Settle {
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
                owner,
                failure,
            } => park(store, &id, &raw, &destination, owner, &failure, history).await,
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
        Ok(parked) => {
            if parked == Parked::Moved {
                m::parked(reason.as_str());
                tracing::warn!(%timeout_id, correlation_id, destination, %owner, reason = reason.as_str(), attempts, error, "record parked");
            } else {
                m::lease_lost(1);
                tracing::warn!(%timeout_id, correlation_id, destination, %owner, reason = reason.as_str(), "record copied to parking, but its lease was lost: it is also still in Timeouts");
            }
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

/// Deletes the confirmed records of one claim under its owner guard, after checking that the
/// lease still holds; retries a failed delete while it does and shutdown has not begun. A
/// shortfall is a lost lease: the message may be sent again by whoever holds the record now.
pub async fn remove(
    store: &Store,
    health: &Health,
    confirmed: &[(Bson, TimeoutRecord)],
    lease: &Lease,
    shutdown: &CancellationToken,
) {
    if confirmed.is_empty() {
        return;
    }
    let owner = lease.owner;
    let ids: Vec<Bson> = confirmed.iter().map(|(id, _)| id.clone()).collect();
    let mut backoff = Backoff::reconnect();
    loop {
        if !lease.is_live(store.clock().now()) {
            for (_, r) in confirmed {
                tracing::warn!(timeout_id = %r.id, correlation_id = %r.process_manager_id, destination = %r.destination, %owner, "lease expired during the publish; not removing (a peer may have re-claimed it)");
            }
            m::lease_lost(confirmed.len());
            return;
        }
        let removal = store
            .bounded("remove sent records", store.remove_held(&ids, owner))
            .await;
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
                let live = lease.is_live(store.clock().now());
                let gone = if short > 0 {
                    account_for_shortfall(store, &ids, confirmed, owner, short, live).await
                } else {
                    0
                };
                m::removed(deleted as usize + gone);
                return;
            }
            Err(e) if shutdown.is_cancelled() => {
                m::lease_lost(confirmed.len());
                tracing::warn!(%owner, records = ids.len(), error = %e, "removing sent records failed during shutdown; they stay leased and may be sent again after the lease");
                return;
            }
            Err(e) => {
                health.set_up(m::MONGODB, false);
                let wait = backoff
                    .next_delay()
                    .min(lease.remaining(store.clock().now()));
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
        m::lease_lost(short);
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
            m::lease_lost(lost);
            short.saturating_sub(lost)
        }
        Err(e) => {
            m::lease_lost(short);
            tracing::warn!(%owner, error = %e, records = short, "lease lost on some sent records; could not name them");
            0
        }
    }
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
