//! The reaper: every `[reaper] interval` (a quarter of the lease by default), frees the
//! records whose lease has expired, so that a crashed or stalled instance's claims become
//! claimable again, and the records locked with no lease expiry (left by ServiceConnect's own
//! poller) once they stayed so for a whole lease. Every [`CENSUS_INTERVAL`] (or each pass,
//! if that comes more often) it takes the census of records nothing fires on its own
//! ([`crate::census`]) and sets its gauges.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::metrics as m;
use crate::store::Store;

/// How often the census gauges are refreshed.
pub const CENSUS_INTERVAL: Duration = Duration::from_secs(15);

/// Runs until `shutdown` is cancelled.
pub async fn run(store: Store, interval: Duration, shutdown: CancellationToken) {
    let mut reap = tokio::time::interval(interval);
    reap.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut census = tokio::time::interval(CENSUS_INTERVAL.min(interval));
    census.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = reap.tick() => pass(&store).await,
            _ = census.tick() => take_census(&store).await,
        }
    }
}

/// One reaper pass: expired leases, then stuck locks. Each call is bounded by `[mongodb]
/// operation_timeout`.
pub async fn pass(store: &Store) {
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
        Ok(0) => {}
        Ok(n) => {
            m::reaped(n);
            tracing::info!(freed = n, "reaper freed expired leases");
        }
        Err(e) => tracing::warn!(error = %e, "reaper pass failed; trying again next interval"),
    }
    match store
        .bounded(
            "free stuck locks",
            Store::timed("reap", store.free_stuck(store.lock_lease())),
        )
        .await
    {
        Ok(0) => {}
        Ok(n) => {
            m::stuck_freed(n);
            tracing::warn!(
                freed = n,
                "reaper freed records locked with no lease expiry for a whole lease (left by another dispatcher)"
            );
        }
        Err(e) => {
            tracing::warn!(error = %e, "freeing stuck locks failed; trying again next interval")
        }
    }
}

async fn take_census(store: &Store) {
    match store
        .bounded("take the census", Store::timed("census", store.census()))
        .await
    {
        Ok(c) => {
            m::census(c.unschedulable, c.stuck_locks);
            tracing::debug!(
                unschedulable = c.unschedulable,
                stuck_locks = c.stuck_locks,
                foreign_locks = c.foreign_locks,
                "census taken"
            );
        }
        Err(e) => tracing::debug!(error = %e, "census failed; trying again"),
    }
}
