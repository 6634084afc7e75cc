//! What the daemon reads from its host besides the network: the wall clock and randomness.
//!
//! Monotonic time is `tokio::time::Instant` everywhere (virtual under a paused runtime).
//! The wall clock ([`wall_ms`], [`wall_now`]) and every random draw ([`uuid`],
//! [`random_range`]) go through this module, so that a simulation can run
//! several instances in one process, each with a host of its own: a seeded source of
//! randomness and a wall clock that runs on the runtime's clock, with a skew and steps.
//! Outside a simulation no [`Host`] is in scope and the real clock and a thread-local
//! generator serve. A task spawned with [`spawn`] (or a future wrapped by [`inherit`])
//! keeps the host of the task that spawned it. `clippy.toml` keeps the direct calls out.
//! [`backoff`] is the jittered retry delay, its jitter drawn here.

pub mod backoff;

use std::future::Future;
use std::ops::Range;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use uuid::Uuid;

/// A simulated host: its wall clock and its randomness.
#[derive(Debug)]
pub struct Host {
    /// Unix milliseconds of the wall clock at `start`, before any skew.
    start_ms: i64,
    start: tokio::time::Instant,
    /// Added to the wall clock: the host's skew, and every step since.
    skew_ms: AtomicI64,
    rng: Mutex<StdRng>,
}

impl Host {
    /// A host whose wall clock reads `start_ms + skew_ms` now and runs on the runtime's
    /// clock, with randomness drawn from `seed`.
    pub fn simulated(seed: u64, start_ms: i64, skew_ms: i64) -> Arc<Self> {
        Arc::new(Self {
            start_ms,
            start: tokio::time::Instant::now(),
            skew_ms: AtomicI64::new(skew_ms),
            rng: Mutex::new(StdRng::seed_from_u64(seed)),
        })
    }

    /// Moves the wall clock by `ms`, as an NTP step or a VM resume would.
    pub fn step_ms(&self, ms: i64) {
        self.skew_ms.fetch_add(ms, Ordering::Relaxed);
    }

    fn wall_ms(&self) -> i64 {
        let elapsed = tokio::time::Instant::now().saturating_duration_since(self.start);
        self.start_ms
            .saturating_add(i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX))
            .saturating_add(self.skew_ms.load(Ordering::Relaxed))
    }

    fn with_rng<T>(&self, f: impl FnOnce(&mut StdRng) -> T) -> T {
        f(&mut self.rng.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

tokio::task_local! {
    static HOST: Arc<Host>;
}

fn current() -> Option<Arc<Host>> {
    HOST.try_with(Arc::clone).ok()
}

/// Runs `fut` on `host` (the simulation's entry point for each instance).
pub async fn scope<F: Future>(host: Arc<Host>, fut: F) -> F::Output {
    HOST.scope(host, fut).await
}

/// `fut`, run on the host of the caller (for `JoinSet::spawn` and the like).
pub fn inherit<F: Future>(fut: F) -> impl Future<Output = F::Output> {
    let host = current();
    async move {
        match host {
            Some(host) => HOST.scope(host, fut).await,
            None => fut.await,
        }
    }
}

/// `tokio::spawn`, keeping the caller's host.
#[allow(clippy::disallowed_methods)]
pub fn spawn<F>(fut: F) -> tokio::task::JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    tokio::spawn(inherit(fut))
}

/// `set.spawn(fut)`, keeping the caller's host.
#[allow(clippy::disallowed_methods)]
pub fn spawn_in<T, F>(set: &mut tokio::task::JoinSet<T>, fut: F) -> tokio::task::AbortHandle
where
    F: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    set.spawn(inherit(fut))
}

/// The wall clock in Unix milliseconds.
#[allow(clippy::disallowed_methods)]
pub fn wall_ms() -> i64 {
    match current() {
        Some(host) => host.wall_ms(),
        None => {
            let d = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or(Duration::ZERO);
            i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
        }
    }
}

/// The wall clock.
pub fn wall_now() -> SystemTime {
    let ms = wall_ms();
    if ms >= 0 {
        UNIX_EPOCH + Duration::from_millis(ms.unsigned_abs())
    } else {
        UNIX_EPOCH
            .checked_sub(Duration::from_millis(ms.unsigned_abs()))
            .unwrap_or(UNIX_EPOCH)
    }
}

/// The wall clock as a BSON date.
pub fn wall_date() -> bson::DateTime {
    bson::DateTime::from_millis(wall_ms())
}

/// A random (version 4) UUID.
#[allow(clippy::disallowed_methods)]
pub fn uuid() -> Uuid {
    match current() {
        Some(host) => host.with_rng(|r| uuid::Builder::from_random_bytes(r.random()).into_uuid()),
        None => Uuid::new_v4(),
    }
}

/// A random number in `range` (`range.start` when it is empty).
#[allow(clippy::disallowed_methods)]
pub fn random_range(range: Range<u64>) -> u64 {
    if range.is_empty() {
        return range.start;
    }
    match current() {
        Some(host) => host.with_rng(|r| r.random_range(range)),
        None => rand::random_range(range),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_simulated_host_is_repeatable_and_its_clock_runs_with_the_runtime() {
        let draw = |seed| async move {
            let host = Host::simulated(seed, 1_000_000, 250);
            scope(host.clone(), async {
                let before = wall_ms();
                tokio::time::sleep(Duration::from_secs(2)).await;
                let spawned = spawn(async { (uuid(), random_range(0..1000)) })
                    .await
                    .unwrap();
                host.step_ms(-100);
                (before, wall_ms(), spawned)
            })
            .await
        };
        let (a, b) = (draw(7).await, draw(7).await);
        assert_eq!(a.0, 1_000_250);
        assert_eq!(a.1, 1_002_150);
        assert_eq!(a.2, b.2, "the same seed draws the same values");
        assert_ne!(draw(8).await.2, a.2);
    }

    #[test]
    fn without_a_host_the_real_clock_serves() {
        let ms = wall_ms();
        assert!(ms > 1_700_000_000_000, "{ms}");
        assert_ne!(uuid(), uuid());
    }
}
