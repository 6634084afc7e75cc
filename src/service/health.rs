//! Health: what `/healthz` and `/readyz` report. The dispatch loop stamps every turn (it turns
//! at least once a second, and no handler awaits, so a loop that stops turning is wedged); the
//! tasks that talk to MongoDB and RabbitMQ record whether they answer; shutdown sets draining;
//! the supervisor marks the daemon failed when an essential task ends or panics; the monitor
//! and the dispatch loop tell [`Progress`] whether the claims reach the due records (a loop
//! that turns and claims nothing while records wait is not ready).

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;
use tokio::time::Instant;

use serde::Serialize;

use crate::metrics as m;
use crate::service::progress::Progress;

/// Shared health state; one per daemon.
#[derive(Debug)]
pub struct Health {
    started: Instant,
    poll_interval: Duration,
    /// Milliseconds since `started` of the last completed poll; -1 before the first.
    last_poll_ms: AtomicI64,
    mongodb_up: AtomicBool,
    rabbitmq_up: AtomicBool,
    /// The broker blocked the connection (`connection.blocked`) and has not unblocked it.
    rabbitmq_blocked: AtomicBool,
    draining: AtomicBool,
    /// The essential task that ended or panicked, once one has.
    failed: Mutex<Option<&'static str>>,
    progress: Progress,
}

/// The `/readyz` body.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Readiness {
    pub ready: bool,
    pub problems: Vec<&'static str>,
}

impl Health {
    pub fn new(poll_interval: Duration) -> Self {
        Self {
            started: Instant::now(),
            poll_interval,
            last_poll_ms: AtomicI64::new(-1),
            mongodb_up: AtomicBool::new(false),
            rabbitmq_up: AtomicBool::new(false),
            rabbitmq_blocked: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            failed: Mutex::new(None),
            // The default lease_safety_margin (2 s) and twice the default operation_timeout.
            progress: Progress::new(
                poll_interval
                    .saturating_mul(3)
                    .saturating_add(Duration::from_secs(22)),
            ),
        }
    }

    /// The same, judging progress over `stall_after` ([`crate::service::progress::stall_after`]).
    pub fn with_stall_after(mut self, stall_after: Duration) -> Self {
        self.progress = Progress::new(stall_after);
        self
    }

    /// Whether the claims reach the due records.
    pub fn progress(&self) -> &Progress {
        &self.progress
    }

    /// The dispatch loop turned.
    pub fn beat(&self) {
        self.waiting(Duration::ZERO);
    }

    /// An essential task ended or panicked: `/healthz` and `/readyz` are 503 from now on.
    pub fn fail(&self, task: &'static str) {
        let mut failed = self.failed.lock().unwrap_or_else(PoisonError::into_inner);
        failed.get_or_insert(task);
    }

    /// The task that failed, if one has.
    pub fn failed_task(&self) -> Option<&'static str> {
        *self.failed.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The dispatch loop handled a failure and will try again after `wait`: it is not
    /// stalled, so liveness counts from the next attempt. (A dependency that is down is
    /// reported by readiness; restarting timeoutd would not bring it back.)
    pub fn waiting(&self, wait: Duration) {
        let at = self.started.elapsed().saturating_add(wait);
        self.last_poll_ms.store(
            i64::try_from(at.as_millis()).unwrap_or(i64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Records whether a dependency answers (and exports it as a gauge).
    pub fn set_up(&self, dependency: &'static str, up: bool) {
        let flag = if dependency == m::MONGODB {
            &self.mongodb_up
        } else {
            &self.rabbitmq_up
        };
        flag.store(up, Ordering::Relaxed);
        m::dependency_up(dependency, up);
    }

    /// Whether the broker blocks the connection (a memory or disk alarm): not ready then, as
    /// nothing can be sent.
    pub fn set_blocked(&self, blocked: bool) {
        self.rabbitmq_blocked.store(blocked, Ordering::Relaxed);
    }

    /// Shutdown has begun.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Live while no essential task failed and the dispatch loop turned within three poll
    /// intervals (at least three seconds). Before the first turn the same allowance runs from
    /// start-up, plus the time to reach the services.
    pub fn is_live(&self) -> bool {
        if self.failed_task().is_some() {
            return false;
        }
        let allowance = i64::try_from(
            self.poll_interval
                .saturating_mul(3)
                .max(Duration::from_secs(3))
                .as_millis(),
        )
        .unwrap_or(i64::MAX);
        let now = self.started.elapsed().as_millis() as i64;
        match self.last_poll_ms.load(Ordering::Relaxed) {
            -1 => now <= allowance.saturating_add(30_000),
            last => now.saturating_sub(last) <= allowance,
        }
    }

    pub fn readiness(&self) -> Readiness {
        let mut problems = Vec::new();
        if self.failed_task().is_some() {
            problems.push("an essential task failed");
        }
        if !self.mongodb_up.load(Ordering::Relaxed) {
            problems.push("mongodb unreachable");
        }
        if !self.rabbitmq_up.load(Ordering::Relaxed) {
            problems.push("rabbitmq unreachable");
        }
        if self.rabbitmq_blocked.load(Ordering::Relaxed) {
            problems.push("rabbitmq blocked the connection (memory or disk alarm)");
        }
        if self.draining.load(Ordering::Relaxed) {
            problems.push("draining");
        } else if self.progress.stalled() {
            problems.push("due records left unclaimed");
        }
        Readiness {
            ready: problems.is_empty(),
            problems,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The review of issue 25: absurd durations (they passed validation then; it now refuses
    /// any over a year) made the sums and products over them panic in debug builds
    /// (`poll_interval * 3` here). The arithmetic stays saturating all the same.
    #[test]
    fn absurd_configured_durations_never_overflow() {
        let years = |n: u64| Duration::from_secs(n.saturating_mul(365 * 24 * 3600));
        let mut c = crate::config::Config::default();
        c.dispatch.poll_interval = years(200_000_000_000);
        c.dispatch.look_ahead = Some(Duration::from_secs(1));
        c.dispatch.lock_lease = years(500_000_000_000);
        c.dispatch.shutdown_timeout = Duration::from_secs(u64::MAX);
        c.mongodb.operation_timeout = years(500_000_000_000);
        assert!(c.validate().is_err(), "refused at start-up");
        let h = Health::new(c.dispatch.poll_interval)
            .with_stall_after(crate::service::progress::stall_after(&c));
        assert!(h.is_live());
        h.waiting(c.dispatch.shutdown_timeout);
        assert!(h.is_live());
        assert_eq!(
            c.dispatch.claim_window(),
            c.dispatch.poll_interval + Duration::from_secs(1)
        );
        let now = tokio::time::Instant::now();
        assert!(crate::deadline::later(now, c.dispatch.shutdown_timeout) > now);
    }

    #[test]
    fn ready_only_with_both_services_and_not_draining() {
        let h = Health::new(Duration::from_millis(10));
        assert_eq!(
            h.readiness().problems,
            ["mongodb unreachable", "rabbitmq unreachable"]
        );
        h.set_up(m::MONGODB, true);
        h.set_up(m::RABBITMQ, true);
        assert!(h.readiness().ready);
        h.set_blocked(true);
        assert_eq!(
            h.readiness().problems,
            ["rabbitmq blocked the connection (memory or disk alarm)"]
        );
        h.set_blocked(false);
        assert!(h.readiness().ready);
        h.start_draining();
        assert_eq!(h.readiness().problems, ["draining"]);
    }

    #[test]
    fn a_failed_task_makes_the_daemon_unhealthy_for_good() {
        let h = Health::new(Duration::from_secs(10));
        h.set_up(m::MONGODB, true);
        h.set_up(m::RABBITMQ, true);
        h.beat();
        assert!(h.is_live() && h.readiness().ready);
        h.fail("reaper");
        h.fail("monitor");
        h.beat();
        assert!(!h.is_live());
        assert_eq!(h.failed_task(), Some("reaper"));
        assert_eq!(h.readiness().problems, ["an essential task failed"]);
    }

    #[test]
    fn due_records_left_unclaimed_make_it_unready_until_progress() {
        let h = Health::new(Duration::from_millis(10)).with_stall_after(Duration::ZERO);
        h.set_up(m::MONGODB, true);
        h.set_up(m::RABBITMQ, true);
        let id = bson::Bson::Int32(7);
        h.progress().observed(Instant::now(), Some((&id, 7)));
        h.progress().observed(Instant::now(), Some((&id, 7)));
        assert_eq!(h.readiness().problems, ["due records left unclaimed"]);
        h.progress().made();
        assert!(h.readiness().ready);
    }

    #[test]
    fn liveness_follows_the_last_poll() {
        let h = Health::new(Duration::from_millis(10));
        h.beat();
        assert!(h.is_live());
        std::thread::sleep(Duration::from_millis(3_050));
        assert!(!h.is_live(), "no turn for over three seconds");
        h.beat();
        assert!(h.is_live());
        h.waiting(Duration::from_millis(3_100));
        std::thread::sleep(Duration::from_millis(3_050));
        assert!(h.is_live(), "waiting out a back-off is not a stall");
    }
}
