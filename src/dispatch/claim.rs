//! Claims: when one may start, the background task that runs it, and what becomes of the rows
//! it brings back (parked at once, or held for their instant).

use std::panic::AssertUnwindSafe;
use std::time::Instant;

use futures::FutureExt;

use super::settle::{Failure, Settle};
use super::{Dispatcher, Done, Ready};
use crate::metrics as m;
use crate::parking::ParkReason;
use crate::record::TimeoutRecord;
use crate::store::{Claim, StoreError};
use crate::supervisor::panic_message;

/// Whether a claimed record can wait for its instant and be sent, or is parked at once with
/// a reason (it does not decode, or names no destination). The message itself is built, and
/// checked against the protocol's limits, when the record falls due ([`message::build`]).
pub fn triage(
    record: Result<TimeoutRecord, crate::record::DecodeError>,
) -> Result<TimeoutRecord, (ParkReason, String)> {
    match record {
        Err(e) => Err((ParkReason::Undecodable, e.to_string())),
        Ok(r) if r.destination.is_empty() => Err((
            ParkReason::EmptyDestination,
            "Destination is missing or empty".into(),
        )),
        Ok(r) => Ok(r),
    }
}

impl Dispatcher {
    /// Whether a claim may start once its time comes: the link is up, no claim is running,
    /// fewer than two batches are held, and no wave is publishing unless the broker has
    /// answered one of that wave's publishes. A wave normally takes tens of milliseconds and
    /// its first confirm a few; the claim then runs beside the rest of it, so the database's
    /// writer is not idle while the broker works. A wave without an answer is a broker that
    /// may have stalled, and an instance claiming meanwhile would hoard records it cannot
    /// send, which a peer could.
    pub(super) fn can_claim(&self) -> bool {
        let cap = 2 * self.config.dispatch.batch_size as usize;
        self.link_up
            && !self.claims.is_running()
            && self.held.len() < cap
            && (self.wave_alive.is_none() || self.wave_proven)
            && !self.rate_saturated()
    }

    /// A background claim returned.
    pub(super) fn on_claimed(&mut self, started: Instant, result: Result<Claim, StoreError>) {
        let claim = match result {
            Ok(claim) => claim,
            Err(e) => {
                self.health.set_up(m::MONGODB, false);
                let wait = self.claim_backoff.next_delay();
                tracing::warn!(error = %e, retry_in = ?wait, "claim failed");
                self.claims.failed(wait);
                return;
            }
        };
        self.health.set_up(m::MONGODB, true);
        self.claim_backoff.reset();
        m::claim_duration(started.elapsed());
        self.claims.finished(started, claim.more);
        if claim.rows.is_empty() {
            return;
        }
        let lease = claim.lease;
        let owner = lease.owner;
        tracing::debug!(%owner, claimed = claim.rows.len(), "claimed batch");
        m::claimed(claim.rows.len());
        if self.shutdown.is_cancelled() {
            let rows = claim.rows.into_iter().map(|r| (r.id, lease)).collect();
            self.release(rows, "shutdown");
            return;
        }
        for row in claim.rows {
            let (reason, error) = match triage(row.record) {
                Ok(record) => {
                    self.held.push(Ready {
                        id: row.id,
                        raw: row.raw,
                        record,
                        lease,
                    });
                    continue;
                }
                Err(poison) => poison,
            };
            let poison = Failure::poison(reason, error);
            m::skipped(poison.reason.as_str(), 1);
            self.settle_queue.push_back(Settle::Park {
                id: row.id,
                raw: Box::new(row.raw),
                destination: String::new(),
                owner,
                failure: poison,
            });
        }
    }

    pub(super) fn start_claim(&mut self) {
        self.claims.started();
        let store = self.store.clone();
        let d = &self.config.dispatch;
        let (batch, lease, ahead) = (d.batch_size, d.lock_lease, d.look_ahead());
        let excluded = self.excluded_destinations();
        self.tasks.spawn(async move {
            let started = Instant::now();
            // Tests only: a slow claim (a wake-up must not be lost while it runs).
            #[cfg(feature = "failpoints")]
            if let Some(Some(ms)) =
                fail::eval("claim-delay", |arg| arg.and_then(|a| a.parse::<u64>().ok()))
            {
                tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
            }
            let claim = store.claim_except(batch, lease, ahead, &excluded);
            let result = match AssertUnwindSafe(store.bounded("claim", claim))
                .catch_unwind()
                .await
            {
                Ok(result) => result,
                Err(panic) => Err(StoreError::Panicked(panic_message(panic.as_ref()))),
            };
            Done::Claim { started, result }
        });
    }
}
