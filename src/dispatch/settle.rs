//! Settling claimed records once their fate is known: remove what the broker confirmed,
//! release what could not be sent, retry or park what the broker refused, park what can never
//! be sent. The machine queues each [`Settle`] in one bounded [`SettleQueue`]; the driver runs
//! each as a task ([`Settler::run`]). Every write is guarded by the claim's owner and live
//! lease, and bounded by `[mongodb] operation_timeout`.
//!
//! Long, as one concept: the settling work, its one queue and the `Unremoved` guard share the
//! lease-margin rule and the accounting of what a removal may leave (about 540 lines of code, the
//! rest its tests).

use std::collections::VecDeque;
use std::time::Duration;

use bson::{Bson, DateTime, Document};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::leased::Leased;
use crate::config::RetryConfig;
use crate::metrics as m;
use crate::rabbit::publisher::SendOutcome;
use crate::record::field;
use crate::record::{TimeoutRecord, display_id};
use crate::service::health::Health;
use crate::store::Store;
use crate::store::history::{self, Ended, HistorySink};
use crate::store::lease::Lease;
use crate::store::pacing::Pacing;
use crate::store::parking::{ParkReason, Parked};

/// Why a record is being parked, and after how many failed sends.
#[derive(Debug, Clone)]
pub struct Failure {
    pub reason: ParkReason,
    pub error: String,
    pub attempts: u32,
}

/// One piece of settling work.
#[derive(Debug)]
pub enum Settle {
    /// Delete records the broker confirmed, under their claim's owner guard and live lease.
    Remove { lease: Lease, records: Vec<Leased> },
    /// Free records under their claim's owner guard.
    Release {
        lease: Lease,
        ids: Vec<Bson>,
        reason: &'static str,
    },
    /// A send the broker refused: retry after back-off, or park after `max_attempts`.
    Refused {
        leased: Box<Leased>,
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

impl Settle {
    /// How many records the work settles.
    pub fn records(&self) -> usize {
        match self {
            Settle::Release { ids, .. } => ids.len(),
            Settle::Remove { records, .. } => records.len(),
            Settle::Refused { .. } | Settle::Park { .. } => 1,
        }
    }

    /// The queue's order: releases, removals, the rest.
    fn rank(&self) -> u8 {
        match self {
            Settle::Release { .. } => 0,
            Settle::Remove { .. } => 1,
            Settle::Refused { .. } | Settle::Park { .. } => 2,
        }
    }
}

/// Settling work waiting for a slot, in one queue: releases first (a released record is one
/// a peer can send), then removals (a confirmed record must be deleted while its lease holds),
/// then retries and parkings, each kind in order.
///
/// It is bounded by what the machine lets in: while it holds `cap` records or more
/// ([`SettleQueue::is_full`]) no claim starts, so a destination that refuses every send
/// cannot pile up more work than the database settles (issue 25, 8.3: refused records queued
/// without bound, outlived their leases and were claimed again). And no retry or parking in
/// it outlives its lease: one whose lease comes within the safety margin before it got a slot
/// is released instead ([`SettleQueue::release_expiring`]). A removal or a release keeps its
/// place: a removal whose lease runs out first counts its records as lost leases.
#[derive(Debug, Default)]
pub struct SettleQueue {
    work: VecDeque<Settle>,
}

impl SettleQueue {
    /// Whether no claim may start: `cap` records or more wait to settle.
    pub fn is_full(&self, cap: usize) -> bool {
        self.records() >= cap.max(1)
    }

    /// The records waiting to settle.
    pub fn records(&self) -> usize {
        self.work.iter().map(Settle::records).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.work.is_empty()
    }

    /// Queues `work` behind the work of its kind; a removal is merged into one of the same
    /// claim still waiting (one delete per claim).
    pub fn push(&mut self, mut work: Settle) {
        if let Settle::Remove { lease, records } = &mut work
            && let Some(queued) = self.work.iter_mut().find_map(|w| match w {
                Settle::Remove { lease: l, records } if l.owner == lease.owner => Some(records),
                _ => None,
            })
        {
            return queued.append(records);
        }
        let rank = work.rank();
        let at = self.work.iter().take_while(|w| w.rank() <= rank).count();
        self.work.insert(at, work);
    }

    /// Queues the release of `held`, one item per claim.
    pub fn release(&mut self, held: Vec<(Bson, Lease)>, reason: &'static str) {
        for (lease, batch) in by_lease(held, |(_, l)| *l) {
            let ids = batch.into_iter().map(|(id, _)| id).collect();
            self.push(Settle::Release { lease, ids, reason });
        }
    }

    /// Queues the release of records this instance holds.
    pub fn release_all(&mut self, records: Vec<Leased>, reason: &'static str) {
        self.release(
            records.into_iter().map(|r| (r.id, r.lease)).collect(),
            reason,
        );
    }

    /// The next work to run.
    pub fn pop(&mut self) -> Option<Settle> {
        self.work.pop_front()
    }

    /// The work, in the order it runs.
    #[cfg(test)]
    pub fn work(&self) -> impl Iterator<Item = &Settle> {
        self.work.iter()
    }

    /// Confirmed records waiting for a removal: left leased if the machine is dropped.
    pub fn unremoved(&self) -> usize {
        let removal = |w: &Settle| matches!(w, Settle::Remove { .. }).then(|| w.records());
        self.work.iter().filter_map(removal).sum()
    }

    /// Retries and parkings whose lease has less than `margin` left at `now` (server clock)
    /// are released instead, ahead of the rest: a guarded write that lands after the lease ran
    /// out matches nothing, and the record would come back to a claim as a lost lease. The
    /// refusal is not counted then: the record is sent again by the next claim and counted
    /// on that attempt.
    pub fn release_expiring(&mut self, now: DateTime, margin: Duration) {
        let expiring = |s: &Settle| match s {
            Settle::Refused { leased, .. } => leased.lease.remaining(now) < margin,
            Settle::Park { lease, .. } => lease.remaining(now) < margin,
            Settle::Release { .. } | Settle::Remove { .. } => false,
        };
        if !self.work.iter().any(expiring) {
            return;
        }
        let (late, kept): (Vec<Settle>, Vec<Settle>) = std::mem::take(&mut self.work)
            .into_iter()
            .partition(expiring);
        self.work = kept.into();
        let held: Vec<(Bson, Lease)> = late
            .into_iter()
            .filter_map(|s| match s {
                Settle::Refused { leased, .. } => Some((leased.id, leased.lease)),
                Settle::Park { id, lease, .. } => Some((id, lease)),
                Settle::Release { .. } | Settle::Remove { .. } => None,
            })
            .collect();
        tracing::warn!(
            records = held.len(),
            margin = ?margin,
            "settling did not start before the lease safety margin; releasing instead"
        );
        self.release(held, "margin");
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

/// What settling work runs against: the store, the retry rules, history, the health it reports
/// MongoDB's state into, and when to give up removals at shutdown.
#[derive(Clone)]
pub struct Settler {
    pub store: Store,
    pub retry: RetryConfig,
    pub history: Option<HistorySink>,
    pub health: std::sync::Arc<Health>,
    pub shutdown: CancellationToken,
    /// Cancelled when the shutdown's drain ends: removals still running give up.
    pub drain_over: CancellationToken,
}

impl Settler {
    /// Runs `work`; parked records go to history when it is on. A removal's records count as
    /// possible duplicates if it is dropped unfinished from the moment it is handed out, not
    /// from its task's first poll: a task aborted before it ran left them leased all the same.
    /// Returns the ids of sent records a removal left in the collection when their lease ran
    /// out: a claim of this instance that takes one again removes it, not sends it.
    pub fn run(&self, work: Settle) -> impl Future<Output = Vec<Bson>> + Send + 'static {
        let settler = self.clone();
        let work = match work {
            Settle::Remove { lease, records } => Ok(Unremoved {
                records,
                lease,
                health: self.health.clone(),
            }),
            other => Err(other),
        };
        async move {
            match work {
                Ok(removal) => return settler.remove(removal).await,
                Err(Settle::Release { lease, ids, reason }) => {
                    settler.release(&ids, lease.owner, reason).await
                }
                Err(Settle::Refused { leased, outcome }) => {
                    settler.retry_or_park(*leased, outcome).await
                }
                Err(Settle::Park {
                    id,
                    raw,
                    destination,
                    lease,
                    failure,
                }) => {
                    settler
                        .park(&id, &raw, &destination, lease.owner, &failure)
                        .await
                }
                Err(Settle::Remove { .. }) => {}
            }
            Vec::new()
        }
    }

    /// Frees records under the owner guard. A shortfall means their lease ran out first:
    /// another instance may hold them now, which is what a release is for. It is not counted
    /// as a lost lease: a record released unsent can cause no duplicate, and one released
    /// after a publish of unknown outcome was counted when that outcome came in.
    async fn release(&self, ids: &[Bson], owner: Uuid, reason: &'static str) {
        let store = &self.store;
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

    /// A send the broker refused: counted, then retried after back-off (the lease is kept
    /// until the next attempt), or parked after `max_attempts`.
    async fn retry_or_park(&self, r: Leased, outcome: SendOutcome) {
        let (store, retry) = (&self.store, &self.retry);
        let owner = r.lease.owner;
        let correlation_id = r.record.process_manager_id;
        let destination = r.record.destination.as_str();
        let (reason, error) = match outcome {
            SendOutcome::Nacked => (ParkReason::Nacked, "the broker nacked the publish".into()),
            _ => (
                ParkReason::Unroutable,
                format!("returned by the broker: no queue is bound to routing key `{destination}`"),
            ),
        };
        let parking = store.parking();
        let counted = parking.count_failure(&r.id, owner, &error);
        let attempts = match store.bounded("count a failed send", counted).await {
            Ok(Some(n)) => n,
            Ok(None) => {
                m::lease_lost(1);
                tracing::warn!(timeout_id = %r.record.id, %correlation_id, destination, %owner, "send refused and the lease was lost before the failure was counted");
                return;
            }
            Err(e) => {
                tracing::warn!(timeout_id = %r.record.id, %correlation_id, destination, %owner, error = %e, "could not count the failed send; releasing");
                let id = std::slice::from_ref(&r.id);
                return self.release(id, owner, "publish_failed").await;
            }
        };
        if attempts >= retry.max_attempts {
            let failure = Failure {
                reason,
                error,
                attempts,
            };
            return self.park(&r.id, &r.raw, destination, owner, &failure).await;
        }
        let wait = retry.delay_after(attempts);
        let until = crate::store::lease::add(store.clock().now(), wait);
        let deferred = parking.defer(&r.id, owner, until);
        match store.bounded("defer a retry", deferred).await {
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

    /// Moves a record to the parking collection (see [`crate::store::parking`]) and, with
    /// history on, records that it was parked and why.
    async fn park(&self, id: &Bson, raw: &Document, destination: &str, owner: Uuid, f: &Failure) {
        let store = &self.store;
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
        let (reason, error, attempts) = (f.reason.as_str(), f.error.as_str(), f.attempts);
        let parking = store.parking();
        let parked = parking.park(id, raw, owner, f.reason, error, attempts);
        match store.bounded("park a record", parked).await {
            Ok(Parked::LeaseLost) => {
                m::lease_lost(1);
                tracing::warn!(%timeout_id, correlation_id, destination, %owner, reason, "record not parked: its lease was lost (another owner holds it, or it ran out); the parked copy was taken back");
            }
            Ok(Parked::Moved) => {
                m::parked(reason);
                tracing::warn!(%timeout_id, correlation_id, destination, %owner, reason, attempts, error, "record parked");
                if let Some(sink) = &self.history {
                    let ended = Ended {
                        event: history::event::PARKED,
                        timeout_id: timeout_id.clone(),
                        correlation_id: (correlation_id != "-").then(|| correlation_id.into()),
                        destination: (!destination.is_empty()).then(|| destination.into()),
                        due: TimeoutRecord::decode_due(raw, store.encoding()),
                        attempts: Some(i64::from(attempts)),
                        reason: Some(reason),
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

    /// Deletes the confirmed records of one claim under its owner guard, after checking that
    /// the lease still holds; retries a failed delete while it does, during a shutdown's drain
    /// too (a shutdown that begins during a wait retries at once). A shortfall is a lost lease:
    /// the message may be sent again by whoever holds the record now. Once `drain_over` is
    /// cancelled (the shutdown's drain is ending) it gives up and counts the records it could
    /// not remove as possible duplicates, as it does if it is dropped unfinished.
    async fn remove(&self, mut removal: Unremoved) -> Vec<Bson> {
        let lapsed = self
            .removal_attempts(&removal.records, &removal.lease)
            .await;
        // Each way out of the attempts accounted for every record.
        removal.records.clear();
        lapsed
    }

    /// The ids it left because their lease ran out first.
    async fn removal_attempts(&self, confirmed: &[Leased], lease: &Lease) -> Vec<Bson> {
        let store = &self.store;
        let owner = lease.owner;
        let ids: Vec<Bson> = confirmed.iter().map(|r| r.id.clone()).collect();
        let mut pacing = Pacing::new(store.operation_timeout());
        loop {
            // "Does the lease still hold?" asks the latest the server's clock can read, here as
            // for the wait below: with the midpoint here, a reading in between (live by the
            // midpoint, over by the latest) made the wait zero and a delete that failed at once
            // (connection refused) a busy loop (simulation seed 78).
            if !lease.is_live(store.clock().latest()) {
                warn_each(
                    confirmed,
                    owner,
                    "lease expired during the publish; not removing (a peer may have re-claimed it)",
                );
                sent_and_lost(confirmed.len());
                return ids;
            }
            let removal = tokio::select! {
                biased;
                removal = store.bounded("remove sent records", store.remove_held(&ids, owner)) => removal,
                // The delete may still land on the server.
                _ = self.drain_over.cancelled() => {
                    unremoved_at_the_drains_end(owner, &ids, &self.health);
                    return Vec::new();
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
                    // Only while the lease still holds can a record that is gone have been
                    // deleted by this removal's own earlier attempt; after it ran out, a peer
                    // may have claimed, sent and deleted it.
                    let live = lease.is_live(store.clock().latest());
                    let gone = match short {
                        0 => 0,
                        _ => self.shortfall(&ids, confirmed, owner, short, live).await,
                    };
                    m::removed(deleted as usize + gone);
                    // Those left were delivered all the same: a claim of this instance that
                    // takes one again removes it (those removed cannot be taken again).
                    return match short {
                        0 => Vec::new(),
                        _ => ids,
                    };
                }
                // A shutdown's drain is what a failed delete needs most: gave up at its first
                // failure, the records were sent again after the lease (helper-18's finding).
                Err(e) => {
                    self.health.set_up(m::MONGODB, false);
                    let left = lease.remaining(store.clock().latest());
                    let wait = pacing.failed(&e).min(left);
                    tracing::warn!(%owner, records = ids.len(), error = %e, retry_in = ?wait, "removing sent records failed; retrying while the lease holds");
                    let stopping = self.shutdown.is_cancelled();
                    tokio::select! {
                            _ = tokio::time::sleep(wait) => {}
                            _ = self.shutdown.cancelled(), if !stopping => {}
                            _ = self.drain_over.cancelled() => {
                        unremoved_at_the_drains_end(owner, &ids, &self.health);
                        return Vec::new();
                    }
                        }
                }
            }
        }
    }

    /// A guarded delete removed `short` fewer records than it was given. Those still in the
    /// collection are held by another owner now: lost leases, possible duplicates, each named.
    /// While the lease is `live`, those gone were deleted by an earlier attempt of this
    /// removal whose answer was lost (a deadline or a cut connection after the server applied
    /// it): nobody else can delete a record under this instance's live lease. Once it ran
    /// out, a peer may have sent and deleted them: lost leases too. Returns how many count as
    /// removed.
    async fn shortfall(
        &self,
        ids: &[Bson],
        confirmed: &[Leased],
        owner: Uuid,
        short: usize,
        live: bool,
    ) -> usize {
        if !live {
            sent_and_lost(short);
            tracing::warn!(%owner, records = short, "lease ran out before the sent records could be removed; a peer may send them again");
            return 0;
        }
        let store = &self.store;
        let named = tokio::select! {
            biased;
            named = store.bounded("name lost leases", store.existing(ids)) => named,
            // Like the delete, the look-up yields to the end of the shutdown's drain.
            _ = self.drain_over.cancelled() => {
                sent_and_lost(short);
                tracing::warn!(%owner, records = short, "lease lost on some sent records; the shutdown's drain ended before they could be named");
                return 0;
            }
        };
        match named {
            Ok(still_there) => {
                let lost: Vec<&Leased> = confirmed
                    .iter()
                    .filter(|r| still_there.contains(&r.id))
                    .collect();
                warn_each(
                    lost.iter().copied(),
                    owner,
                    "lease lost: record was sent but is held by another owner now; it may be sent again",
                );
                sent_and_lost(lost.len());
                short.saturating_sub(lost.len())
            }
            Err(e) => {
                sent_and_lost(short);
                tracing::warn!(%owner, error = %e, records = short, "lease lost on some sent records; could not name them");
                0
            }
        }
    }
}

/// A removal's confirmed records, counted as possible duplicates if it is dropped unfinished
/// (aborted at the end of the shutdown's drain, before or after it began: cause `shutdown`; or
/// panicked: cause `panic`): they stay leased, and whoever claims them once the lease ran out
/// sends them again.
struct Unremoved {
    records: Vec<Leased>,
    lease: Lease,
    health: std::sync::Arc<Health>,
}

impl Drop for Unremoved {
    fn drop(&mut self) {
        if self.records.is_empty() {
            return;
        }
        warn_each(
            &self.records,
            self.lease.owner,
            "removal of a sent record abandoned; it stays leased and may be sent again after the lease",
        );
        m::possible_duplicates(cut_short_by(&self.health), self.records.len());
    }
}

/// Why a removal was cut short, as the possible duplicates' cause: `panic` when its own task
/// panicked (it drops its future while it unwinds) or the dispatch loop did (the loop then
/// stops and the drain cuts the rest short: one event, one cause), `shutdown` otherwise.
fn cut_short_by(health: &Health) -> &'static str {
    match std::thread::panicking() || health.failed_task() == Some("dispatch") {
        true => m::DUPLICATE_PANIC,
        false => m::DUPLICATE_SHUTDOWN,
    }
}

/// One warning per record, naming it.
fn warn_each<'a>(records: impl IntoIterator<Item = &'a Leased>, owner: Uuid, what: &str) {
    for Leased { record: r, .. } in records {
        tracing::warn!(timeout_id = %r.id, correlation_id = %r.process_manager_id, destination = %r.destination, %owner, "{what}");
    }
}

/// `n` confirmed records whose lease was lost before their removal: a lost lease, and a
/// possible duplicate (whoever holds them now sends them again).
fn sent_and_lost(n: usize) {
    m::lease_lost(n);
    m::possible_duplicates(m::DUPLICATE_LEASE_LOST, n);
}

/// A removal that the end of the shutdown's drain cut short: its records stay leased, unless
/// a delete still lands, and may be sent again after the lease.
fn unremoved_at_the_drains_end(owner: Uuid, ids: &[Bson], health: &Health) {
    m::possible_duplicates(cut_short_by(health), ids.len());
    tracing::warn!(%owner, records = ids.len(), "removing sent records did not finish before the end of the shutdown's drain; they may stay leased and be sent again after the lease");
}

#[cfg(test)]
pub(crate) mod tests {
    //! Removals against a store whose server accepts connections and never answers, on
    //! virtual time.

    use std::sync::Arc;

    use bson::doc;
    use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
    use tokio::time::Instant;

    use super::*;
    use crate::config::Config;
    use crate::store::clock::ServerClock;

    /// A TCP port that accepts connections (the kernel completes them) and never answers: a
    /// server that stalled from before the test began.
    pub(crate) fn silent_server() -> (std::net::TcpListener, u16) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("address").port();
        (listener, port)
    }

    const HOUR: Duration = Duration::from_secs(3600);

    type Removal = (Settler, Vec<Leased>, Lease);

    /// A settler (shutdown begun) on a server that accepts and never answers, with calls
    /// bounded by `timeout`, and `n` confirmed records of one claim leased for `lease`.
    async fn stalled(port: u16, timeout: Duration, n: i32, lease: Duration) -> Removal {
        let mut config = Config::default();
        config.mongodb.uri = format!(
            "mongodb://127.0.0.1:{port}/?directConnection=true&serverSelectionTimeoutMS=36000000"
        );
        config.mongodb.operation_timeout = timeout;
        let store = Store::connect(&config.mongodb, ServerClock::default())
            .await
            .expect("store");
        over(store, n, lease)
    }

    /// A settler (shutdown begun) over `store`, and `n` confirmed records of one claim leased
    /// for `lease`.
    fn over(store: Store, n: i32, lease: Duration) -> Removal {
        let now = store.clock().now();
        let sent = |n| Leased {
            id: Bson::Int32(n),
            raw: doc! {},
            record: TimeoutRecord {
                id: crate::host::uuid(),
                destination: "timeoutd-test-settle-unit".into(),
                process_manager_id: crate::host::uuid(),
                due: now,
                headers: doc! {},
            },
            lease: Lease::new(now, Duration::from_secs(1)),
        };
        let settler = Settler {
            store,
            retry: Config::default().retry,
            history: None,
            health: Arc::new(Health::new(Duration::from_secs(1))),
            shutdown: CancellationToken::new(),
            drain_over: CancellationToken::new(),
        };
        settler.shutdown.cancel();
        (settler, (0..n).map(sent).collect(), Lease::new(now, lease))
    }

    /// The records counted as possible duplicates or lost leases.
    fn possible_duplicates(metrics: &PrometheusHandle) -> f64 {
        let counted = |l: &&str| l.contains("duplicate") || l.contains("lease_lost");
        let value = |l: &str| l.rsplit(' ').next()?.parse::<f64>().ok();
        let text = metrics.render();
        text.lines().filter(counted).filter_map(value).sum()
    }

    /// Issue 25, 8.6: after SIGTERM, a removal still waiting for MongoDB when the daemon's
    /// drain deadline aborted the loop left its confirmed records leased, to be sent again
    /// after the lease, and counted nothing. An abandoned removal counts its records as
    /// possible duplicates.
    #[tokio::test(start_paused = true)]
    async fn a_removal_aborted_unfinished_counts_its_records_as_possible_duplicates() {
        let recorder = PrometheusBuilder::new().build_recorder();
        let _recorder = metrics::set_default_local_recorder(&recorder);
        let (_server, port) = silent_server();
        let (settler, confirmed, lease) = stalled(port, Duration::from_secs(60), 3, HOUR).await;
        let removal = crate::host::spawn(settler.run(Settle::Remove {
            lease,
            records: confirmed,
        }));
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!removal.is_finished(), "the delete waits for the server");
        // As the supervisor does at the drain deadline.
        removal.abort();
        assert!(removal.await.is_err_and(|e| e.is_cancelled()));
        assert_eq!(possible_duplicates(&recorder.handle()), 3.0);
    }

    /// Runs a removal of `confirmed` while the shutdown's drain ends 25 s from now, and checks
    /// that it gave up then (not at its `operation_timeout`).
    async fn removal_until_the_drain_ends(settler: Settler, confirmed: Vec<Leased>, lease: Lease) {
        let over = Instant::now() + Duration::from_secs(25);
        let ending = settler.drain_over.clone();
        crate::host::spawn(async move {
            tokio::time::sleep_until(over).await;
            ending.cancel();
        });
        settler
            .run(Settle::Remove {
                lease,
                records: confirmed,
            })
            .await;
        let now = Instant::now();
        assert!(
            now >= over && now < over + Duration::from_secs(1),
            "it gave up when the drain ended, not at its operation_timeout"
        );
    }

    /// Issue 25, 8.6: removals give up when the shutdown's drain ends (before the daemon
    /// aborts the loop), counting what they could not remove as possible duplicates. When
    /// the drain ends is the machine's rule (`the_drain_ends_...` in `machine.rs`).
    #[tokio::test(start_paused = true)]
    async fn removals_give_up_when_the_drain_ends_and_count_their_records() {
        let recorder = PrometheusBuilder::new().build_recorder();
        let _recorder = metrics::set_default_local_recorder(&recorder);
        // A removal whose delete would wait its whole operation_timeout.
        let (_server, port) = silent_server();
        let (settler, confirmed, lease) = stalled(port, Duration::from_secs(600), 2, HOUR).await;
        removal_until_the_drain_ends(settler, confirmed, lease).await;
        assert_eq!(possible_duplicates(&recorder.handle()), 2.0);
    }

    fn counter(metrics: &PrometheusHandle, name: &str) -> f64 {
        crate::metrics::rendered(metrics, name)
    }

    /// helper-22: after the dispatch loop panicked, a removal the drain's end cut short
    /// counted its records under cause `shutdown`, which the runbook sends to
    /// `shutdown_timeout`, while those the machine still queued counted under `panic`.
    #[tokio::test(start_paused = true)]
    async fn a_removal_cut_short_after_the_loop_panicked_counts_under_panic() {
        let recorder = PrometheusBuilder::new().build_recorder();
        let _recorder = metrics::set_default_local_recorder(&recorder);
        let (_server, port) = silent_server();
        let (settler, confirmed, lease) = stalled(port, Duration::from_secs(600), 2, HOUR).await;
        settler.health.fail("dispatch");
        removal_until_the_drain_ends(settler, confirmed, lease).await;
        let handle = recorder.handle();
        let cause = |c: &str| {
            counter(
                &handle,
                &format!("timeoutd_possible_duplicates_total{{cause=\"{c}\"}}"),
            )
        };
        assert_eq!((cause("panic"), cause("shutdown")), (2.0, 0.0));
    }

    /// A delete that removed fewer records than it was given is followed by a read that names
    /// the lost leases. That read did not yield to the end of the shutdown's drain: the loop
    /// waited up to `operation_timeout` for it, past the drain, and the daemon's abort then
    /// counted every record (those deleted too) as a possible duplicate and none as removed.
    #[tokio::test(start_paused = true)]
    async fn naming_lost_leases_gives_up_when_the_drain_ends() {
        let recorder = PrometheusBuilder::new().build_recorder();
        let _recorder = metrics::set_default_local_recorder(&recorder);
        let mut config = Config::default();
        config.mongodb.operation_timeout = Duration::from_secs(600);
        // A server whose delete removes two of the three records it is given (the test gives
        // it three) and whose reads never answer: the read naming the lost leases hangs.
        use crate::store::backend::{Answer, Answering, Op, Reply, Written};
        let backend = Arc::new(Answering::new(|op: Op| match op {
            Op::Delete { .. } => Answer::Now(Ok(Reply::Written(Written {
                deleted: 2,
                ..Written::default()
            }))),
            _ => Answer::Never,
        }));
        let store = Store::with_backend(backend, &config.mongodb, ServerClock::default());
        let (settler, confirmed, lease) = over(store, 3, HOUR);
        removal_until_the_drain_ends(settler, confirmed, lease).await;
        let handle = recorder.handle();
        assert_eq!(counter(&handle, "timeoutd_removed_total"), 2.0);
        assert_eq!(counter(&handle, "timeoutd_possible_duplicates_total"), 1.0);
    }

    /// helper-18: a removal whose delete failed once during the shutdown's drain gave up at
    /// once, and its records, sent and confirmed, were sent again after the lease. It retries
    /// until the drain ends.
    #[tokio::test(start_paused = true)]
    async fn a_removal_that_fails_during_the_drain_retries() {
        use crate::store::backend::{Answering, MongoError, Op, Reply, Written};
        let recorder = PrometheusBuilder::new().build_recorder();
        let _recorder = metrics::set_default_local_recorder(&recorder);
        let config = Config::default();
        let failed = std::sync::atomic::AtomicBool::new(false);
        let backend = Answering::new(move |op: Op| match op {
            Op::Delete { .. } if !failed.swap(true, std::sync::atomic::Ordering::SeqCst) => Err(
                MongoError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)),
            ),
            Op::Delete { .. } => Ok(Reply::Written(Written {
                deleted: 2,
                ..Written::default()
            })),
            _ => Ok(Reply::Docs(Vec::new())),
        });
        let store = Store::with_backend(Arc::new(backend), &config.mongodb, ServerClock::default());
        let (settler, confirmed, lease) = over(store, 2, HOUR);
        let lapsed = settler
            .run(Settle::Remove {
                lease,
                records: confirmed,
            })
            .await;
        assert!(lapsed.is_empty(), "{lapsed:?}");
        let handle = recorder.handle();
        assert_eq!(counter(&handle, "timeoutd_removed_total"), 2.0);
        assert_eq!(possible_duplicates(&handle), 0.0);
    }

    /// A removal whose deletes fail until the lease runs out names the records it left, for
    /// the machine to remove rather than send again should a claim of its own take them.
    #[tokio::test(start_paused = true)]
    async fn a_removal_that_fails_until_the_lease_runs_out_names_what_it_left() {
        use crate::store::backend::{Answering, MongoError, Op, Reply};
        let config = Config::default();
        let backend = Answering::new(move |op: Op| match op {
            Op::Delete { .. } => Err(MongoError::from(std::io::Error::from(
                std::io::ErrorKind::ConnectionRefused,
            ))),
            _ => Ok(Reply::Docs(Vec::new())),
        });
        let store = Store::with_backend(Arc::new(backend), &config.mongodb, ServerClock::default());
        let (settler, confirmed, lease) = over(store, 2, Duration::from_secs(5));
        let lapsed = settler
            .run(Settle::Remove {
                lease,
                records: confirmed,
            })
            .await;
        assert_eq!(lapsed, [Bson::Int32(0), Bson::Int32(1)]);
    }

    /// A removal whose task panicked, with no shutdown anywhere, counted its records as
    /// possible duplicates of cause `shutdown`. They count as `panic`.
    #[tokio::test(start_paused = true)]
    async fn a_removal_that_panics_counts_its_records_as_duplicates_by_panic() {
        let recorder = PrometheusBuilder::new().build_recorder();
        let _recorder = metrics::set_default_local_recorder(&recorder);
        let config = Config::default();
        // A server whose every operation panics (a bug on the way to it).
        let panicking = crate::store::backend::Answering::new(
            |_| -> Result<crate::store::backend::Reply, crate::store::backend::MongoError> {
                panic!("the removal panics (test)")
            },
        );
        let store =
            Store::with_backend(Arc::new(panicking), &config.mongodb, ServerClock::default());
        // No shutdown.
        let (mut settler, confirmed, lease) = over(store, 3, HOUR);
        settler.shutdown = CancellationToken::new();
        let removal = crate::host::spawn(settler.run(Settle::Remove {
            lease,
            records: confirmed,
        }));
        assert!(removal.await.is_err_and(|e| e.is_panic()));
        let handle = recorder.handle();
        let by = |cause: &str| {
            counter(
                &handle,
                &format!("timeoutd_possible_duplicates_total{{cause=\"{cause}\"}}"),
            )
        };
        assert_eq!((by("panic"), by("shutdown")), (3.0, 0.0));
    }

    /// A removal whose task was aborted before its first poll (the end of the drain, right
    /// after the work was handed out) counted nothing: its guard did not exist yet.
    #[tokio::test(start_paused = true)]
    async fn a_removal_dropped_before_it_ran_counts_its_records_as_possible_duplicates() {
        let recorder = PrometheusBuilder::new().build_recorder();
        let _recorder = metrics::set_default_local_recorder(&recorder);
        let (_server, port) = silent_server();
        let (settler, confirmed, lease) = stalled(port, Duration::from_secs(60), 2, HOUR).await;
        let removal = settler.run(Settle::Remove {
            lease,
            records: confirmed,
        });
        drop(removal);
        assert_eq!(possible_duplicates(&recorder.handle()), 2.0);
    }
}
