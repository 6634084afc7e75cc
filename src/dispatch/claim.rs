//! Claims: when one may start, the background task that runs it, and what becomes of the rows
//! it brings back (parked at once, or held for their instant).

use std::panic::AssertUnwindSafe;
use std::time::Duration;
use tokio::time::Instant;

use futures::FutureExt;
use tokio_util::sync::CancellationToken;

use super::settle::{Failure, Settle};
use super::{Dispatcher, Done, Ready};
use crate::metrics as m;
use crate::record::TimeoutRecord;
use crate::service::supervisor::panic_message;
use crate::store::parking::ParkReason;
use crate::store::{Claim, StoreError};

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
    /// Whether a claim may start once its time comes: the link is up and not blocked by the
    /// broker, no claim is running, and fewer than two batches are held and fewer than two
    /// wait to settle (a destination that refuses every send makes settling work as fast as
    /// claims make records: the claims wait for it, so that nothing waits to settle until its
    /// lease runs out; two, so that while one batch of refusals settles, a claim that leaves
    /// their destination out still serves the others). A claim may start while a wave publishes: it reads
    /// its candidates at once, but takes them ([`ProofGate`]) only once the broker has
    /// answered one of that wave's publishes, so the database is not idle while the broker
    /// works and an instance whose broker stalled hoards nothing.
    pub(super) fn can_claim(&self) -> bool {
        let cap = 2 * self.config.dispatch.batch_size as usize;
        self.link_up
            && !self.blocked
            && !self.claims.is_running()
            && self.held.len() < cap
            && !self.settle.is_full(cap)
            && !self.rate_saturated()
    }

    /// What a claim starting now must wait for before it takes its candidates: the first
    /// answer to the wave in flight, when it has had none yet.
    fn proof_gate(&self) -> Option<ProofGate> {
        let wave = self.wave.as_ref()?;
        (!wave.answered.is_cancelled()).then(|| ProofGate {
            wave: wave.clone(),
            shutdown: self.shutdown.clone(),
        })
    }

    /// A background claim returned.
    pub(super) fn on_claimed(
        &mut self,
        started: Instant,
        waited: Duration,
        result: Result<Claim, StoreError>,
    ) {
        let claim = match result {
            Ok(claim) => claim,
            Err(e) => {
                self.health.set_up(m::MONGODB, false);
                // After a timeout, not before the abandoned run ended on the server.
                let wait = self.claim_pacing.failed(&e);
                tracing::warn!(error = %e, retry_in = ?wait, "claim failed");
                self.claims.failed(wait);
                return;
            }
        };
        self.health.set_up(m::MONGODB, true);
        if claim.read > 0 {
            // The claim path reaches due records (taken, or lost to a racing instance).
            self.health.progress().made();
        }
        self.claim_pacing.record(&Ok::<(), StoreError>(()));
        m::claim_duration(started.elapsed().saturating_sub(waited));
        self.claims.finished(started, claim.more);
        if claim.rows.is_empty() {
            return;
        }
        let lease = claim.lease;
        let owner = lease.owner;
        // At info, with the instance: ties the owner `list` shows to the process holding it.
        tracing::info!(%owner, instance = crate::service::buildinfo::instance(), claimed = claim.rows.len(), "claimed batch");
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
            self.settle.push_back(Settle::Park {
                id: row.id,
                raw: Box::new(row.raw),
                destination: String::new(),
                lease,
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
        let gate = self.proof_gate();
        crate::host::spawn_in(&mut self.tasks, async move {
            let started = Instant::now();
            let mut waited = Duration::ZERO;
            // Tests only: a slow claim (a wake-up must not be lost while it runs).
            #[cfg(feature = "failpoints")]
            if let Some(Some(ms)) =
                fail::eval("claim-delay", |arg| arg.and_then(|a| a.parse::<u64>().ok()))
            {
                tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
            }
            let claim = async {
                let read = store.candidates(batch, ahead, &excluded);
                let candidates = store.bounded("read claim candidates", read).await?;
                if let Some(gate) = gate
                    && !candidates.is_empty()
                {
                    let at = Instant::now();
                    let go = gate.passed().await;
                    waited = at.elapsed();
                    if !go {
                        return Ok(candidates.abandoned(lease, store.clock().now()));
                    }
                }
                store
                    .bounded("take claim candidates", store.take(candidates, lease))
                    .await
            };
            let result = match AssertUnwindSafe(claim).catch_unwind().await {
                Ok(result) => result,
                Err(panic) => Err(StoreError::Panicked(panic_message(panic.as_ref()))),
            };
            Done::Claim {
                started,
                waited,
                result,
            }
        });
    }
}

/// What a claim that started beside an unanswered wave waits for between reading its
/// candidates and taking them: the broker's first answer to that wave (take them), or the
/// wave's end without one, or shutdown (take nothing: the broker may have stalled, and
/// records leased now could not be sent).
pub(super) struct ProofGate {
    wave: WaveSignals,
    shutdown: CancellationToken,
}

/// The signals of the wave in flight.
#[derive(Clone)]
pub(super) struct WaveSignals {
    /// Cancelled by the wave at the broker's first answer to one of its publishes.
    pub(super) answered: CancellationToken,
    /// Cancelled when the wave's publishes and confirms are no longer awaited.
    pub(super) over: CancellationToken,
}

impl ProofGate {
    /// Whether the claim may take its candidates.
    async fn passed(&self) -> bool {
        tokio::select! {
            biased;
            _ = self.wave.answered.cancelled() => {}
            _ = self.wave.over.cancelled() => {}
            _ = self.shutdown.cancelled() => return false,
        }
        self.wave.answered.is_cancelled()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate() -> (
        ProofGate,
        CancellationToken,
        CancellationToken,
        CancellationToken,
    ) {
        let (answered, over, shutdown) = (
            CancellationToken::new(),
            CancellationToken::new(),
            CancellationToken::new(),
        );
        let gate = ProofGate {
            wave: WaveSignals {
                answered: answered.clone(),
                over: over.clone(),
            },
            shutdown: shutdown.clone(),
        };
        (gate, answered, over, shutdown)
    }

    #[tokio::test]
    async fn a_claim_takes_once_the_wave_is_answered() {
        let (gate, answered, _over, _shutdown) = gate();
        let waiting = crate::host::spawn(async move { gate.passed().await });
        answered.cancel();
        assert!(waiting.await.unwrap());
    }

    #[tokio::test]
    async fn a_wave_that_ends_unanswered_makes_the_claim_take_nothing() {
        let (gate, _answered, over, _shutdown) = gate();
        let waiting = crate::host::spawn(async move { gate.passed().await });
        over.cancel();
        assert!(!waiting.await.unwrap());
    }

    #[tokio::test]
    async fn an_answer_at_the_wave_end_still_counts() {
        let (gate, answered, over, _shutdown) = gate();
        answered.cancel();
        over.cancel();
        assert!(gate.passed().await);
    }

    #[tokio::test]
    async fn shutdown_makes_the_claim_take_nothing() {
        let (gate, _answered, _over, shutdown) = gate();
        let waiting = crate::host::spawn(async move { gate.passed().await });
        shutdown.cancel();
        assert!(!waiting.await.unwrap());
    }
}
