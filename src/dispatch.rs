//! The dispatch loop: claim a batch of records due now or within the look-ahead, publish each
//! at its due instant (those already due at once, pipelined), then remove what the broker
//! confirmed (owner- and lease-guarded), retry or park what it refused, and release what
//! could not be sent.
//!
//! Nothing is deleted unless its publish was confirmed and the claim's lease still held
//! afterwards; when in doubt a record is left for a later poll.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bson::{Bson, Document};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::config::Config;
use crate::health::Health;
use crate::lease::{Lease, PrePublish};
use crate::message;
use crate::metrics as m;
use crate::parking::{ParkReason, Parked};
use crate::publisher::{Publisher, SendOutcome};
use crate::record::{TimeoutRecord, display_id};
use crate::store::{Claim, Store};

/// A claimed record ready to send: its `_id`, the stored document, the decoded record and
/// the lease of the claim that took it.
#[derive(Debug)]
struct Ready {
    id: Bson,
    raw: Document,
    record: TimeoutRecord,
    lease: Lease,
}

/// A record whose publish the broker confirmed, waiting to be removed.
type Sent = (Bson, TimeoutRecord, Lease);

/// Why a record is being parked, and after how many failed sends.
#[derive(Debug)]
struct Failure {
    reason: ParkReason,
    error: String,
    attempts: u32,
}

impl Failure {
    /// A record no attempt can fix: parked at once.
    fn poison(reason: ParkReason, error: String) -> Self {
        Self {
            reason,
            error,
            attempts: 0,
        }
    }
}

/// While the next wave is at least this far off, the records confirmed so far are removed
/// instead of waiting for the end of the batch.
const REMOVE_WHEN_IDLE_MS: u64 = 20;

/// The dispatch loop's state. One per process.
#[derive(Debug)]
pub struct Dispatcher {
    config: Arc<Config>,
    store: Store,
    publisher: Publisher,
    health: Arc<Health>,
    shutdown: CancellationToken,
    /// The last batch had publishes whose outcome is unknown: back off before the next
    /// claim, so that a link that withholds confirms does not resend the same records hot.
    unconfirmed: bool,
    /// Signalled when a record was inserted due before the next poll (change stream).
    wake: Arc<Notify>,
}

impl Dispatcher {
    pub fn new(
        config: Arc<Config>,
        store: Store,
        publisher: Publisher,
        health: Arc<Health>,
        shutdown: CancellationToken,
        wake: Arc<Notify>,
    ) -> Self {
        Self {
            config,
            store,
            publisher,
            health,
            shutdown,
            unconfirmed: false,
            wake,
        }
    }

    /// Runs until the shutdown token is cancelled; then finishes or releases what it holds,
    /// closes the broker connection and returns.
    pub async fn run(mut self) {
        let d = self.config.dispatch.clone();
        let mut backoff = Backoff::reconnect();
        while !self.shutdown.is_cancelled() {
            if let Err(e) = self.publisher.connect().await {
                self.health.set_up(m::RABBITMQ, false);
                let wait = backoff.next_delay();
                tracing::warn!(error = %e, retry_in = ?wait, "RabbitMQ unreachable; not claiming");
                self.health.waiting(wait);
                self.pause(wait).await;
                continue;
            }
            self.health.set_up(m::RABBITMQ, true);
            let started = std::time::Instant::now();
            let claim = self
                .store
                .claim_window(d.batch_size, d.lock_lease, d.look_ahead())
                .await;
            let claim = match claim {
                Ok(c) => c,
                Err(e) => {
                    self.health.set_up(m::MONGODB, false);
                    let wait = backoff.next_delay();
                    tracing::warn!(error = %e, retry_in = ?wait, "claim failed");
                    self.health.waiting(wait);
                    self.pause(wait).await;
                    continue;
                }
            };
            self.health.set_up(m::MONGODB, true);
            m::claim_duration(started.elapsed());
            let claimed = claim.rows.len();
            let more = claim.more;
            if claimed > 0 {
                tracing::debug!(owner = %claim.lease.owner, claimed, "claimed batch");
                m::claimed(claimed);
                m::leases_held(claimed);
                self.process(claim).await;
                m::leases_held(0);
            }
            self.health.poll_completed();
            if std::mem::take(&mut self.unconfirmed) {
                let wait = backoff.next_delay();
                tracing::warn!(retry_in = ?wait, "publishes went unconfirmed; backing off before the next claim");
                self.health.waiting(wait);
                self.pause(wait).await;
                continue;
            }
            backoff.reset();
            // Poll every poll_interval (counted from this claim), or at once while more is due,
            // or when a record was inserted due sooner.
            if !more {
                tokio::select! {
                    _ = self.pause(d.poll_interval.saturating_sub(started.elapsed())) => {}
                    _ = self.wake.notified() => {}
                }
            }
        }
        self.publisher.close().await;
        tracing::info!("dispatch loop stopped");
    }

    /// Sleeps, waking early at shutdown.
    async fn pause(&self, d: Duration) {
        tokio::select! {
            _ = tokio::time::sleep(d) => {}
            _ = self.shutdown.cancelled() => {}
        }
    }

    /// Sends one claimed batch, each record at its due instant, and settles every row of it.
    ///
    /// Records already due go out at once, pipelined; records claimed ahead (look-ahead) are
    /// sent in waves as they fall due, from a timer, while their lease holds. A record
    /// inserted due sooner than the next wave (change stream) is claimed at once and joins
    /// the waves. Confirmed records are removed when the batch is done, or earlier whenever
    /// the next wave is far enough off.
    async fn process(&mut self, claim: Claim) {
        let margin = self.config.dispatch.lease_safety_margin;
        let mut pending: VecDeque<Ready> = VecDeque::new();
        self.take_rows(claim, &mut pending).await;
        let mut confirmed: Vec<Sent> = Vec::new();
        let mut failed: Vec<(Bson, Lease)> = Vec::new();
        while let Some(next) = pending.front() {
            let now = self.store.clock().now();
            let wait_ms = next.record.due.timestamp_millis() - now.timestamp_millis();
            if wait_ms > 0 && !self.shutdown.is_cancelled() {
                if wait_ms as u64 >= REMOVE_WHEN_IDLE_MS && !confirmed.is_empty() {
                    self.remove_confirmed(std::mem::take(&mut confirmed)).await;
                    continue;
                }
                let wait = Duration::from_millis(wait_ms as u64);
                self.health.waiting(wait);
                let woken = tokio::select! {
                    _ = self.pause(wait) => false,
                    _ = self.wake.notified() => true,
                };
                if woken {
                    self.claim_more(&mut pending).await;
                }
                continue;
            }
            if self.shutdown.is_cancelled() {
                let held: Vec<(Bson, Lease)> = pending.drain(..).map(|r| (r.id, r.lease)).collect();
                self.release_each(held, "shutdown").await;
                break;
            }
            let due_now = pending.iter().take_while(|r| r.record.due <= now).count();
            let (wave, too_late): (Vec<Ready>, Vec<Ready>) = pending
                .drain(..due_now)
                .partition(|r| r.lease.before_publish(now, margin) == PrePublish::Publish);
            if !too_late.is_empty() {
                m::skipped("margin", too_late.len());
                let held = too_late.into_iter().map(|r| (r.id, r.lease)).collect();
                self.release_each(held, "margin").await;
            }
            if !wave.is_empty() {
                self.send_wave(wave, &mut confirmed, &mut failed).await;
            }
        }
        self.remove_confirmed(confirmed).await;
        self.release_each(failed, "publish_failed").await;
    }

    /// Parks a claim's poison rows and queues the rest, in due order.
    async fn take_rows(&mut self, claim: Claim, pending: &mut VecDeque<Ready>) {
        let lease = claim.lease;
        let owner = lease.owner;
        for row in claim.rows {
            match row.record {
                Err(e) => {
                    m::skipped("undecodable", 1);
                    let failure = Failure::poison(ParkReason::Undecodable, e.to_string());
                    self.park(&row.id, &row.raw, "", owner, &failure).await;
                }
                Ok(r) if r.destination.is_empty() => {
                    m::skipped("empty_destination", 1);
                    let failure = Failure::poison(
                        ParkReason::EmptyDestination,
                        "Destination is missing or empty".into(),
                    );
                    self.park(&row.id, &row.raw, "", owner, &failure).await;
                }
                Ok(record) => pending.push_back(Ready {
                    id: row.id,
                    raw: row.raw,
                    record,
                    lease,
                }),
            }
        }
        pending
            .make_contiguous()
            .sort_by_key(|r| r.record.due.timestamp_millis());
    }

    /// Claims what fell due in the look-ahead since the batch was claimed (records inserted
    /// due soon) and merges it into the waves. A failure leaves them for the next poll.
    async fn claim_more(&mut self, pending: &mut VecDeque<Ready>) {
        let d = &self.config.dispatch;
        match self
            .store
            .claim_window(d.batch_size, d.lock_lease, d.look_ahead())
            .await
        {
            Ok(claim) if !claim.rows.is_empty() => {
                tracing::debug!(owner = %claim.lease.owner, claimed = claim.rows.len(), "claimed records inserted due soon");
                m::claimed(claim.rows.len());
                self.take_rows(claim, pending).await;
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e, "claim on wake failed; the next poll takes them"),
        }
    }

    /// Publishes one wave pipelined and sorts the outcomes: confirmed records are collected
    /// for removal, refused ones retried or parked, failed ones collected for release.
    async fn send_wave(
        &mut self,
        wave: Vec<Ready>,
        confirmed: &mut Vec<Sent>,
        failed: &mut Vec<(Bson, Lease)>,
    ) {
        let sent_at = SystemTime::now();
        let messages: Vec<_> = wave
            .iter()
            .map(|r| message::build(&r.record, &self.config.rabbitmq, sent_at))
            .collect();
        if let Err(e) = self.publisher.connect().await {
            tracing::debug!(error = %e, "RabbitMQ link down before a wave");
        }
        let stop_waiting = self.confirm_deadline();
        // A wait bounded by publish_timeout is not a stall.
        self.health.waiting(self.config.rabbitmq.publish_timeout);
        let publish_started = std::time::Instant::now();
        let outcomes = self.publisher.publish_batch(&messages, &stop_waiting).await;
        stop_waiting.cancel();
        m::publish_confirm(publish_started.elapsed());

        let confirmed_at = self.store.clock().now();
        let mut refused: Vec<(Ready, SendOutcome)> = Vec::new();
        for (r, outcome) in wave.into_iter().zip(outcomes) {
            let Ready {
                id, record, lease, ..
            } = &r;
            let owner = lease.owner;
            match outcome {
                SendOutcome::Confirmed => {
                    tracing::debug!(timeout_id = %record.id, destination = %record.destination, %owner, late_ms = confirmed_at.timestamp_millis() - record.due.timestamp_millis(), "timeout sent");
                    m::dispatched(record.due, confirmed_at);
                    confirmed.push((r.id, r.record, r.lease));
                }
                SendOutcome::Returned | SendOutcome::Nacked => {
                    m::publish_failure(outcome.reason());
                    refused.push((r, outcome));
                }
                other if other.outcome_unknown() => {
                    // The broker may have it: releasing lets a peer send it again, a possible
                    // duplicate, counted as a lost lease.
                    tracing::warn!(timeout_id = %record.id, destination = %record.destination, %owner, reason = other.reason(), detail = ?other, "publish outcome unknown; releasing (it may be sent again)");
                    m::publish_failure(other.reason());
                    m::lease_lost(1);
                    self.unconfirmed = true;
                    failed.push((id.clone(), *lease));
                }
                other => {
                    tracing::warn!(timeout_id = %record.id, destination = %record.destination, %owner, reason = other.reason(), detail = ?other, "publish failed; releasing");
                    m::publish_failure(other.reason());
                    failed.push((id.clone(), *lease));
                }
            }
        }
        for (r, outcome) in refused {
            self.retry_or_park(r, outcome).await;
        }
    }

    /// A send the broker refused: counted, then retried after back-off (the lease is kept
    /// until the next attempt), or parked after `max_attempts`.
    async fn retry_or_park(&self, r: Ready, outcome: SendOutcome) {
        let owner = r.lease.owner;
        let retry = &self.config.retry;
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
        let parking = self.store.parking();
        let attempts = match parking.count_failure(&r.id, &error).await {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(timeout_id = %r.record.id, destination, %owner, error = %e, "could not count the failed send; releasing");
                self.release(std::slice::from_ref(&r.id), owner, "publish_failed")
                    .await;
                return;
            }
        };
        if attempts >= retry.max_attempts {
            let failure = Failure {
                reason,
                error,
                attempts,
            };
            self.park(&r.id, &r.raw, destination, owner, &failure).await;
            return;
        }
        let wait = retry.delay_after(attempts);
        let until = crate::lease::add(self.store.clock().now(), wait);
        match parking.defer(&r.id, owner, until).await {
            Ok(true) => {
                m::retried();
                tracing::warn!(timeout_id = %r.record.id, destination, %owner, reason = reason.as_str(), attempt = attempts, max_attempts = retry.max_attempts, retry_in = ?wait, "send refused; retrying after back-off");
            }
            Ok(false) => {
                m::lease_lost(1);
                tracing::warn!(timeout_id = %r.record.id, destination, %owner, "send refused and the lease was lost before the retry was scheduled");
            }
            Err(e) => {
                tracing::warn!(timeout_id = %r.record.id, destination, %owner, error = %e, "could not schedule the retry; the record comes back when its lease expires");
            }
        }
    }

    /// Moves a record to the parking collection (see [`crate::parking`]).
    async fn park(
        &self,
        id: &Bson,
        raw: &Document,
        destination: &str,
        owner: uuid::Uuid,
        failure: &Failure,
    ) {
        let timeout_id = display_id(id);
        let Failure {
            reason,
            error,
            attempts,
        } = failure;
        match self
            .store
            .parking()
            .park(id, raw, owner, *reason, error, *attempts)
            .await
        {
            Ok(Parked::Moved) => {
                m::parked(reason.as_str());
                tracing::warn!(%timeout_id, destination, %owner, reason = reason.as_str(), attempts, error, "record parked");
            }
            Ok(Parked::CopiedLeaseLost) => {
                m::lease_lost(1);
                tracing::warn!(%timeout_id, destination, %owner, reason = reason.as_str(), "record copied to parking, but its lease was lost: it is also still in Timeouts");
            }
            Err(e) => {
                tracing::warn!(%timeout_id, destination, %owner, error = %e, "parking failed; the record stays leased and comes back when its lease expires");
            }
        }
    }

    /// A token cancelled when confirms should no longer be awaited: after `publish_timeout`,
    /// or `shutdown_timeout` after shutdown starts, whichever comes first.
    fn confirm_deadline(&self) -> CancellationToken {
        let stop = CancellationToken::new();
        let publish_timeout = self.config.rabbitmq.publish_timeout;
        let shutdown_timeout = self.config.dispatch.shutdown_timeout;
        let shutdown = self.shutdown.clone();
        let token = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(publish_timeout) => {}
                _ = async { shutdown.cancelled().await; tokio::time::sleep(shutdown_timeout).await } => {}
                _ = token.cancelled() => {}
            }
            token.cancel();
        });
        stop
    }

    /// Deletes the confirmed records under the owner guard, after checking that the lease
    /// still holds. A shortfall is a lost lease: the message may be sent again by whoever
    /// holds the record now.
    async fn remove_confirmed(&self, confirmed: Vec<Sent>) {
        for (lease, batch) in by_lease(confirmed, |(_, _, l)| *l) {
            let batch: Vec<(Bson, TimeoutRecord)> =
                batch.into_iter().map(|(id, r, _)| (id, r)).collect();
            self.remove_held(&batch, &lease).await;
        }
    }

    async fn remove_held(&self, confirmed: &[(Bson, TimeoutRecord)], lease: &Lease) {
        if confirmed.is_empty() {
            return;
        }
        let owner = lease.owner;
        let ids: Vec<Bson> = confirmed.iter().map(|(id, _)| id.clone()).collect();
        let mut backoff = Backoff::reconnect();
        loop {
            if !lease.is_live(self.store.clock().now()) {
                for (_, r) in confirmed {
                    tracing::warn!(timeout_id = %r.id, destination = %r.destination, %owner, "lease expired during the publish; not removing (a peer may have re-claimed it)");
                }
                m::lease_lost(confirmed.len());
                return;
            }
            match self.store.remove_held(&ids, owner).await {
                Ok(deleted) => {
                    m::removed(deleted as usize);
                    let lost = ids.len().saturating_sub(deleted as usize);
                    if lost > 0 {
                        m::lease_lost(lost);
                        self.report_lost(&ids, confirmed, owner).await;
                    }
                    return;
                }
                Err(e) => {
                    self.health.set_up(m::MONGODB, false);
                    let wait = backoff.next_delay();
                    tracing::warn!(%owner, records = ids.len(), error = %e, retry_in = ?wait, "removing sent records failed; retrying while the lease holds");
                    self.health.waiting(wait);
                    tokio::time::sleep(wait.min(lease.remaining(self.store.clock().now()))).await;
                }
            }
        }
    }

    /// Names the records a short delete did not remove.
    async fn report_lost(
        &self,
        ids: &[Bson],
        confirmed: &[(Bson, TimeoutRecord)],
        owner: uuid::Uuid,
    ) {
        match self.store.existing(ids).await {
            Ok(still_there) => {
                for (_, r) in confirmed.iter().filter(|(id, _)| still_there.contains(id)) {
                    tracing::warn!(timeout_id = %r.id, destination = %r.destination, %owner, "lease lost: record was sent but is held by another owner now; it may be sent again");
                }
            }
            Err(e) => {
                tracing::warn!(%owner, error = %e, "lease lost on some sent records; could not name them")
            }
        }
    }

    /// Frees records, each under the guard of its own claim's owner.
    async fn release_each(&self, held: Vec<(Bson, Lease)>, reason: &'static str) {
        for (lease, batch) in by_lease(held, |(_, l)| *l) {
            let ids: Vec<Bson> = batch.into_iter().map(|(id, _)| id).collect();
            self.release(&ids, lease.owner, reason).await;
        }
    }

    /// Frees records under the owner guard. A shortfall is a lost lease.
    async fn release(&self, ids: &[Bson], owner: uuid::Uuid, reason: &'static str) {
        match self.store.release_many(ids, owner).await {
            Ok(freed) => {
                m::released(reason, freed as usize);
                let lost = ids.len().saturating_sub(freed as usize);
                if lost > 0 {
                    m::lease_lost(lost);
                    tracing::warn!(%owner, reason, lost, "release matched fewer records than held: lease lost");
                }
            }
            Err(e) => {
                tracing::warn!(%owner, reason, records = ids.len(), error = %e, "release failed; the leases will expire and the reaper frees them")
            }
        }
    }
}

/// Groups items by the lease of the claim that took them, in first-seen order.
fn by_lease<T>(items: Vec<T>, lease_of: impl Fn(&T) -> Lease) -> Vec<(Lease, Vec<T>)> {
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
