//! The reaper: every `[reaper] interval` (a quarter of the lease by default), frees the
//! records whose lease has expired, so that a crashed or stalled instance's claims become
//! claimable again. Every [`CENSUS_INTERVAL`] (or each pass, if that comes more often) it
//! frees the records locked with no lease expiry (left by ServiceConnect's own poller) once
//! they stayed so for a whole lease, and takes the census of records nothing fires on its own
//! ([`crate::store::census`]) and sets its gauges.
//!
//! The expired-lease query is one index range (`LockExpiresAt`). The other two are not: the
//! census counts records whose `Time` no due branch matches with a `$nor` no index serves (a
//! collection scan), and on a collection with ServiceConnect v7's indexes the stuck-lock
//! query (`Locked: true`, no `LockExpiresAt`) reads every free record through
//! `LockExpiresAt_1`. Both run every five minutes, not every pass: a fleet of three on a
//! million records would otherwise scan it every few seconds.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::metrics as m;
use crate::store::census::CensusState;
use crate::store::pacing::Pacing;
use crate::store::{Store, StoreError};

/// How often stuck locks are looked for and the census gauges refreshed.
pub const CENSUS_INTERVAL: Duration = Duration::from_secs(300);

/// Runs until `shutdown` is cancelled. Each of its three calls is paced
/// ([`crate::store::pacing::Pacing`]): after a failure a tick is skipped until its back-off has
/// passed, and after a timeout until the abandoned run has ended on the server.
pub async fn run(store: Store, interval: Duration, shutdown: CancellationToken) {
    let mut reap = tokio::time::interval(interval);
    reap.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first census one period after start, not at once: a fleet restarted on a backlog
    // spends its first seconds draining it, not scanning the collection.
    let every = CENSUS_INTERVAL.min(interval);
    let mut census = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    census.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // What the census remembers between passes: the stuck records and when each was first
    // seen, the records already named, the last warning about another dispatcher.
    let state = CensusState::default();
    let paced = || Pacing::new(store.operation_timeout());
    let (mut reaping, mut freeing, mut counting) = (paced(), paced(), paced());
    // Each call yields to shutdown too, not only the wait between them: a call waits up to
    // `operation_timeout` on a server that does not answer. (`select!`, not
    // `CancellationToken::run_until_cancelled`, an async fn that holds its future twice: the
    // census's is 34 KB in a debug build, and the simulation's threads overflowed their
    // stacks.)
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            _ = reap.tick() => {
                if reaping.ready() {
                    let result = tokio::select! {
                        biased;
                        _ = shutdown.cancelled() => break,
                        r = pass(&store) => r,
                    };
                    reaping.record(&result);
                }
            }
            _ = census.tick() => {
                if freeing.ready() {
                    let result = tokio::select! {
                        biased;
                        _ = shutdown.cancelled() => break,
                        r = free_stuck(&store, &state) => r,
                    };
                    freeing.record(&result);
                }
                if counting.ready() {
                    let result = tokio::select! {
                        biased;
                        _ = shutdown.cancelled() => break,
                        r = take_census(&store, &state) => r,
                    };
                    counting.record(&result);
                }
            }
        }
    }
}

/// One reaper pass: frees expired leases. Bounded by `[mongodb] operation_timeout`.
pub async fn pass(store: &Store) -> Result<(), StoreError> {
    // Tests only: the reaper panics (supervision tests). The panic is raised here rather than
    // by the fail crate's own `panic` action, which poisons its registry.
    #[cfg(feature = "failpoints")]
    if fail::eval("reaper-panic", |_| ()).is_some() {
        panic!("failpoint reaper-panic");
    }
    match store
        .bounded("reap", Store::timed("reap", store.reap()))
        .await
    {
        Ok(0) => Ok(()),
        Ok(n) => {
            m::reaped(n);
            tracing::info!(freed = n, "reaper freed expired leases");
            Ok(())
        }
        Err(e) => {
            tracing::warn!(error = %e, "reaper pass failed; trying again after a back-off");
            Err(e)
        }
    }
}

/// Frees the records locked with no lease expiry for a whole lease.
async fn free_stuck(store: &Store, state: &CensusState) -> Result<(), StoreError> {
    match store
        .bounded(
            "free stuck locks",
            Store::timed("reap", store.free_stuck(state, store.lock_lease())),
        )
        .await
    {
        Ok(0) => Ok(()),
        Ok(n) => {
            m::stuck_freed(n);
            tracing::warn!(
                freed = n,
                "reaper freed records locked with no lease expiry for a whole lease (left by another dispatcher)"
            );
            Ok(())
        }
        Err(e) => {
            tracing::warn!(error = %e, "freeing stuck locks failed; trying again after a back-off");
            Err(e)
        }
    }
}

async fn take_census(store: &Store, state: &CensusState) -> Result<(), StoreError> {
    match store
        .bounded(
            "take the census",
            Store::timed("census", store.census(state)),
        )
        .await
    {
        Ok(c) => {
            m::census(c.unschedulable, c.stuck_locks, c.odd_locked);
            tracing::debug!(
                unschedulable = c.unschedulable,
                odd_locked = c.odd_locked,
                stuck_locks = c.stuck_locks,
                foreign_locks = c.foreign_locks,
                "census taken"
            );
            Ok(())
        }
        Err(e) => {
            tracing::debug!(error = %e, "census failed; trying again after a back-off");
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;

    /// A shutdown while a pass waits on a server that does not answer ends the reaper at once,
    /// not at the call's deadline (`operation_timeout`), which the drain waited for.
    #[tokio::test(start_paused = true)]
    async fn a_shutdown_during_a_pass_ends_the_reaper_at_once() {
        let (silent, store) = Store::silent();
        let stop = CancellationToken::new();
        let task = crate::host::spawn(run(store.clone(), Duration::from_secs(1), stop.clone()));
        while silent.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        let stopped = tokio::time::Instant::now();
        stop.cancel();
        task.await.expect("the reaper ends at shutdown");
        assert!(
            stopped.elapsed() < store.operation_timeout(),
            "the reaper waited {:?} for its pass after the shutdown",
            stopped.elapsed()
        );
    }
}
