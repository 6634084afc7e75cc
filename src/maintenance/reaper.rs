//! The reaper: every `[reaper] interval` (a quarter of the lease by default), frees the
//! records whose lease has expired, so that a crashed or stalled instance's claims become
//! claimable again. Every [`CENSUS_INTERVAL`] (or sooner under a shorter lease or `[reaper]
//! interval`: [`census_every`]) it frees the records locked with no lease expiry (left by ServiceConnect's own poller) once they stayed so for a whole lease,
//! and takes the census of records nothing fires on its own ([`crate::store::census`]) and
//! sets its gauges.
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

/// How often the census is taken: every [`CENSUS_INTERVAL`], or sooner under a shorter
/// lease (a stuck lock is freed once it stayed so for a whole lease) or a shorter
/// `[reaper] interval` set explicitly. Not every pass of the default interval (found in
/// review: it was the shorter of the two, every 75 s under the default lease, four times the
/// scans the docs promise).
pub fn census_every(lease: Duration, interval_set: Option<Duration>) -> Duration {
    let every = CENSUS_INTERVAL.min(lease);
    interval_set.map_or(every, |set| set.min(every))
}

/// Runs until `shutdown` is cancelled, which ends a call waiting on a server that does not
/// answer too. The passes and the census run side by side, each on its own ticks: either may
/// take its whole interval (a slow server) without starving the other (found in review: in
/// one `select!`, whichever was listed first ran again and again). Each of the three calls is
/// paced ([`crate::store::pacing::Pacing`]): after a failure a tick is skipped until its
/// back-off has passed, and after a timeout until the abandoned run has ended on the server.
/// (`select!`, not `CancellationToken::run_until_cancelled`, an async fn that holds its future
/// twice: the census's is 34 KB in a debug build, and the simulation's threads overflowed
/// their stacks.)
pub async fn run(
    store: Store,
    interval: Duration,
    census_every: Duration,
    shutdown: CancellationToken,
) {
    tokio::select! {
        biased;
        _ = shutdown.cancelled() => {}
        () = passes(&store, interval) => {}
        () = censuses(&store, census_every) => {}
    }
}

/// A pass every `interval`.
async fn passes(store: &Store, interval: Duration) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut pacing = Pacing::new(store.operation_timeout());
    loop {
        ticks.tick().await;
        if pacing.ready() {
            let result = pass(store).await;
            pacing.record(&result);
        }
    }
}

/// The stuck locks freed and the census taken every `every`, the first one period after
/// start, not at once: a fleet restarted on a backlog spends its first seconds draining it,
/// not scanning the collection.
async fn censuses(store: &Store, every: Duration) {
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // What the census remembers between passes: the stuck records and when each was first
    // seen, the records already named, the last warning about another dispatcher.
    let state = CensusState::default();
    let paced = || Pacing::new(store.operation_timeout());
    let (mut freeing, mut counting) = (paced(), paced());
    loop {
        ticks.tick().await;
        if freeing.ready() {
            let result = free_stuck(store, &state).await;
            freeing.record(&result);
        }
        if counting.ready() {
            let result = take_census(store, &state).await;
            counting.record(&result);
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
            tracing::warn!(error = %e, "census failed; trying again after a back-off");
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    use crate::config::MongoConfig;
    use crate::store::backend::{Answer, Answering, Op, Reply, Written};
    use crate::store::clock::ServerClock;

    /// Runs the reaper for `span` of paused time at `interval`, on a server whose reads take
    /// `read_delay`; returns how many censuses (of four counts each) it took.
    async fn censuses(interval: Duration, read_delay: Duration, span: Duration) -> usize {
        let counts = Arc::new(AtomicUsize::new(0));
        let counted = counts.clone();
        let backend = Answering::new(move |op: Op| match op {
            Op::Count { .. } => {
                counted.fetch_add(1, Ordering::SeqCst);
                Answer::Now(Ok(Reply::Count(0)))
            }
            Op::Find { .. } => Answer::After(read_delay, Ok(Reply::Docs(Vec::new()))),
            _ => Answer::Now(Ok(Reply::Written(Written::default()))),
        });
        let store = Store::with_backend(
            Arc::new(backend),
            &MongoConfig::default(),
            ServerClock::default(),
        );
        let stop = CancellationToken::new();
        let every = census_every(Duration::from_secs(300), None);
        let task = crate::host::spawn(run(store, interval, every, stop.clone()));
        tokio::time::sleep(span).await;
        stop.cancel();
        task.await.expect("the reaper ends at shutdown");
        counts.load(Ordering::SeqCst) / 4
    }

    /// Under the default lease (5 minutes, passes every 75 s) the census's collection scans
    /// run every five minutes, as documented, not every pass: it ran every 75 s.
    #[tokio::test(start_paused = true)]
    async fn the_census_runs_every_five_minutes_not_every_pass() {
        let span = Duration::from_secs(610);
        let taken = censuses(Duration::from_secs(75), Duration::ZERO, span).await;
        assert_eq!(taken, 2, "censuses in 610 s");
    }

    /// Passes that each take their whole interval (a slow server) leave the census its
    /// turn, and censuses as slow leave the passes theirs: listed after the pass in one
    /// biased `select!`, the census never ran (and listed first, the passes would not).
    #[tokio::test(start_paused = true)]
    async fn slow_passes_leave_the_census_its_turn() {
        let slow = Duration::from_millis(1_500);
        let taken = censuses(Duration::from_secs(1), slow, Duration::from_secs(610)).await;
        assert!(taken >= 1, "no census in 610 s of slow passes");
    }

    /// A shutdown while a pass waits on a server that does not answer ends the reaper at once,
    /// not at the call's deadline (`operation_timeout`), which the drain waited for.
    #[tokio::test(start_paused = true)]
    async fn a_shutdown_during_a_pass_ends_the_reaper_at_once() {
        let (silent, store) = Store::silent();
        let stop = CancellationToken::new();
        let every = census_every(Duration::from_secs(300), Some(Duration::from_secs(1)));
        let task = crate::host::spawn(run(
            store.clone(),
            Duration::from_secs(1),
            every,
            stop.clone(),
        ));
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
