//! Never add load to a struggling database: the rules, in one place.
//!
//! - Every read carries its deadline to the server (`maxTimeMS`, the same
//!   `[mongodb] operation_timeout` as the client's deadline; [`Store::server_limit`]), so that
//!   work timeoutd gave up on stops on the server too. The driver (3.x) has no `maxTimeMS`
//!   for inserts, updates and deletes; those are keyed by `_id`: a write whose records are
//!   found by a range (the reaper's) reads their `_id`s first, under `maxTimeMS` and a limit.
//! - A call that failed is retried after an exponential back-off with jitter ([`Pacing`]),
//!   and one that timed out (the client's deadline, or the server's `maxTimeMS`) not before
//!   one more `operation_timeout` has passed: the abandoned run may still be running on the
//!   server until its own `maxTimeMS` ends it. Every loop that calls MongoDB (the claim, the
//!   reaper, the census, the monitor, the control watcher, the insert watcher) goes through
//!   one [`Pacing`] per call, so no call runs while its previous run may still run; one
//!   exception: a wake-up of the claims (an insert seen) does not wait out a failed claim's
//!   pacing, so that the record inserted fires on time; one claim runs at a time, so at most
//!   one abandoned run is beside it (`dispatch/machine.rs`, `Claims::failed`).
//! - [`crate::deadline::in_flight`] counts the calls timeoutd may have running on the server
//!   (`timeoutd_mongodb_calls_in_flight`): each [`crate::store::Store::bounded`] call from
//!   its start until it returns, or, for one whose future was dropped (its deadline,
//!   shutdown), until the server's `maxTimeMS` has surely ended it.
//!
//! [`Store::server_limit`]: crate::store::Store::server_limit

use std::time::Duration;
use tokio::time::Instant;

use mongodb::error::ErrorKind;

use crate::host::backoff::Backoff;
use crate::store::StoreError;

/// MongoDB's error code for a command stopped by its `maxTimeMS`.
const MAX_TIME_MS_EXPIRED: i32 = 50;

/// The longest back-off between retries of one failing call (on top of the
/// `operation_timeout` a timed-out call waits for).
pub const RETRY_CAP: Duration = Duration::from_secs(30);

/// Whether a call failed by running out of time, on the client or on the server: its run may
/// still be going on the server.
pub fn timed_out(e: &StoreError) -> bool {
    match e {
        StoreError::Deadline(_) => true,
        StoreError::Mongo(e) => match e.kind.as_ref() {
            ErrorKind::Command(c) => c.code == MAX_TIME_MS_EXPIRED,
            ErrorKind::Io(io) => io.kind() == std::io::ErrorKind::TimedOut,
            _ => false,
        },
        _ => false,
    }
}

/// When one recurring MongoDB call may run again.
#[derive(Debug)]
pub struct Pacing {
    backoff: Backoff,
    /// `[mongodb] operation_timeout`: the longest a timed-out run can outlive its caller on a
    /// server that honours `maxTimeMS`.
    server_limit: Duration,
    not_before: Option<Instant>,
}

impl Pacing {
    /// For a call bounded by `operation_timeout`: back-off from 100 ms doubling to
    /// [`RETRY_CAP`], with jitter.
    pub fn new(operation_timeout: Duration) -> Self {
        Self {
            backoff: Backoff::new(Duration::from_millis(100), RETRY_CAP),
            server_limit: operation_timeout,
            not_before: None,
        }
    }

    /// Whether the call may start now.
    pub fn ready(&self) -> bool {
        self.not_before.is_none_or(|t| Instant::now() >= t)
    }

    /// The instant the call may start (now, if it may already).
    pub fn next_at(&self) -> Instant {
        self.not_before.unwrap_or_else(Instant::now)
    }

    /// Records the outcome of a run; returns the wait before the next one after a failure.
    pub fn record<T>(&mut self, result: &Result<T, StoreError>) -> Option<Duration> {
        match result {
            Ok(_) => {
                self.backoff.reset();
                self.not_before = None;
                None
            }
            Err(e) => Some(self.failed(e)),
        }
    }

    /// A run failed: the wait before the next one (and the call is not [`Pacing::ready`]
    /// until it has passed).
    pub fn failed(&mut self, e: &StoreError) -> Duration {
        let wait = self.delay_after(e);
        self.not_before = Some(Instant::now() + wait);
        wait
    }

    /// The wait after the failure `e`, for a caller that keeps its own schedule (the
    /// dispatch machine, which reads no clock): the next back-off, and after a timeout one
    /// more `operation_timeout`.
    pub fn delay_after(&mut self, e: &StoreError) -> Duration {
        let wait = self.backoff.next_delay();
        match timed_out(e) {
            true => wait + self.server_limit,
            false => wait,
        }
    }

    /// A run succeeded: the next failure waits the shortest back-off again.
    pub fn reset(&mut self) {
        self.record(&Ok::<(), StoreError>(()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deadline::Elapsed;

    #[test]
    fn a_timed_out_call_waits_a_whole_operation_timeout_more() {
        let mut p = Pacing::new(Duration::from_secs(5));
        assert!(p.ready());
        let elapsed = StoreError::Deadline(Elapsed {
            what: "x",
            limit: Duration::from_secs(5),
        });
        assert!(timed_out(&elapsed));
        let wait = p.failed(&elapsed);
        assert!(wait >= Duration::from_secs(5), "{wait:?}");
        assert!(!p.ready());
        p.record(&Ok::<(), StoreError>(()));
        assert!(p.ready());
        let other = StoreError::NoServerTime;
        assert!(!timed_out(&other));
        assert!(p.failed(&other) < Duration::from_secs(5));
    }
}
