//! The dispatch loop: claim a batch of due records, publish them pipelined, then remove what
//! the broker confirmed (owner- and lease-guarded) and release what it did not.
//!
//! Nothing is deleted unless its publish was confirmed and the claim's lease still held
//! afterwards; when in doubt a record is left for a later poll.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bson::Bson;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::config::Config;
use crate::health::Health;
use crate::lease::{Lease, PrePublish};
use crate::message;
use crate::metrics as m;
use crate::publisher::{Publisher, SendOutcome};
use crate::record::{TimeoutRecord, display_id};
use crate::store::{Claim, Store};

/// The dispatch loop's state. One per process.
#[derive(Debug)]
pub struct Dispatcher {
    config: Arc<Config>,
    store: Store,
    publisher: Publisher,
    health: Arc<Health>,
    shutdown: CancellationToken,
}

impl Dispatcher {
    pub fn new(
        config: Arc<Config>,
        store: Store,
        publisher: Publisher,
        health: Arc<Health>,
        shutdown: CancellationToken,
    ) -> Self {
        Self {
            config,
            store,
            publisher,
            health,
            shutdown,
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
            let claim = match self.store.claim(d.batch_size, d.lock_lease).await {
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
            backoff.reset();
            let claimed = claim.rows.len();
            if claimed > 0 {
                tracing::debug!(owner = %claim.lease.owner, claimed, "claimed batch");
                m::claimed(claimed);
                m::leases_held(claimed);
                self.process(claim).await;
                m::leases_held(0);
            }
            self.health.poll_completed();
            if claimed < d.batch_size as usize {
                self.pause(d.poll_interval).await;
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

    /// Publishes one claimed batch and settles every row of it.
    async fn process(&mut self, claim: Claim) {
        let lease = claim.lease;
        let owner = lease.owner;
        let margin = self.config.dispatch.lease_safety_margin;
        let now = self.store.clock().now();
        let mut ready: Vec<(Bson, TimeoutRecord)> = Vec::new();
        let mut too_late: Vec<Bson> = Vec::new();
        for row in claim.rows {
            match row.record {
                Err(e) => {
                    // Left leased: it comes back after the lease expires, never hot.
                    tracing::warn!(timeout_id = %display_id(&row.id), %owner, error = %e, "undecodable record left in place");
                    m::skipped("undecodable", 1);
                }
                Ok(r) if r.destination.is_empty() => {
                    tracing::warn!(timeout_id = %r.id, destination = "", %owner, "record has no Destination; left in place, not sent");
                    m::skipped("empty_destination", 1);
                }
                Ok(r) => match lease.before_publish(now, margin) {
                    PrePublish::Publish => ready.push((row.id, r)),
                    PrePublish::TooLittleLease => too_late.push(row.id),
                },
            }
        }
        if !too_late.is_empty() {
            m::skipped("margin", too_late.len());
            self.release(&too_late, owner, "margin").await;
        }
        if ready.is_empty() {
            return;
        }
        if self.shutdown.is_cancelled() {
            let ids: Vec<Bson> = ready.into_iter().map(|(id, _)| id).collect();
            self.release(&ids, owner, "shutdown").await;
            return;
        }

        let sent_at = SystemTime::now();
        let messages: Vec<_> = ready
            .iter()
            .map(|(_, r)| message::build(r, &self.config.rabbitmq, sent_at))
            .collect();
        let stop_waiting = self.confirm_deadline();
        // A wait bounded by publish_timeout is not a stall.
        self.health.waiting(self.config.rabbitmq.publish_timeout);
        let publish_started = std::time::Instant::now();
        let outcomes = self.publisher.publish_batch(&messages, &stop_waiting).await;
        stop_waiting.cancel();
        m::publish_confirm(publish_started.elapsed());

        let confirmed_at = self.store.clock().now();
        let mut confirmed: Vec<(Bson, TimeoutRecord)> = Vec::new();
        let mut failed: Vec<Bson> = Vec::new();
        for ((id, r), outcome) in ready.into_iter().zip(outcomes) {
            match outcome {
                SendOutcome::Confirmed => {
                    tracing::debug!(timeout_id = %r.id, destination = %r.destination, %owner, late_ms = confirmed_at.timestamp_millis() - r.due.timestamp_millis(), "timeout sent");
                    m::dispatched(r.due, confirmed_at);
                    confirmed.push((id, r));
                }
                other => {
                    tracing::warn!(timeout_id = %r.id, destination = %r.destination, %owner, reason = other.reason(), detail = ?other, "publish failed; releasing");
                    m::publish_failure(other.reason());
                    failed.push(id);
                }
            }
        }
        self.remove_confirmed(&confirmed, &lease).await;
        if !failed.is_empty() {
            self.release(&failed, owner, "publish_failed").await;
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
    async fn remove_confirmed(&self, confirmed: &[(Bson, TimeoutRecord)], lease: &Lease) {
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
