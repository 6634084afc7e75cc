//! Progress, not only turns: whether this instance's claims reach the due records they
//! should, judged against the monitor's own reading of the collection ([`crate::store::backlog`]),
//! which depends on nothing the claim path keeps.
//!
//! The rule. The monitor names the oldest due record any worker may claim now, of a
//! destination neither paused nor under a send-rate limit (a limit lets records wait by
//! design). When a later reading, at least [`stall_after`] after the first, names the same
//! record (or one due at the same instant: the index does not order ties), and in between
//! this instance made no progress, the instance is stalled:
//! `/readyz` answers 503 and `timeoutd_due_unclaimed_seconds` says for how long. Progress is
//! a claim that read due records (whether it took them or lost them to a racing instance),
//! a confirmed send, or holding what the instance-wide `max_rate` lets it send.
//!
//! What this leaves alone: an instance of a fleet whose peers take the records (the record
//! is claimed, so the next reading names another or none), a paused destination's records,
//! records held back by a rate limit, and a claim that is merely slow: the window,
//! [`stall_after`], covers three polls, the lease safety margin and a claim's two calls
//! each taking up to `operation_timeout` (a claim that takes longer fails, and MongoDB is
//! then reported down anyway).

use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

use bson::Bson;

use crate::config::Config;

/// How long the same due record may stay unclaimed, with no progress of this instance, before
/// the instance is stalled: 3 x `poll_interval` + `lease_safety_margin` + 2 x
/// `operation_timeout` (25 s with the defaults).
pub fn stall_after(config: &Config) -> Duration {
    let d = &config.dispatch;
    // Saturating: a configuration with absurd durations must not panic here.
    d.poll_interval
        .saturating_mul(3)
        .saturating_add(d.lease_safety_margin)
        .saturating_add(config.mongodb.operation_timeout.saturating_mul(2))
}

/// What this instance knows of its own progress; one per daemon, in [`crate::service::health::Health`].
#[derive(Debug)]
pub struct Progress {
    stall_after: Duration,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The last progress of this instance.
    progress_at: Option<Instant>,
    /// The record the last reading named as the oldest unclaimed one.
    suspect: Option<Suspect>,
}

#[derive(Debug)]
struct Suspect {
    key: String,
    due_ms: i64,
    first_seen: Instant,
    /// A later reading named the same record, with no progress since `first_seen`.
    seen_again: bool,
}

impl State {
    fn progressed_since(&self, t: Instant) -> bool {
        self.progress_at.is_some_and(|p| p >= t)
    }

    /// The suspect, while no progress came after it was first seen.
    fn live_suspect(&self) -> Option<&Suspect> {
        self.suspect
            .as_ref()
            .filter(|s| !self.progressed_since(s.first_seen))
    }
}

impl Progress {
    pub fn new(stall_after: Duration) -> Self {
        Self {
            stall_after,
            state: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The window of [`stall_after`] this instance was given.
    pub fn window(&self) -> Duration {
        self.stall_after
    }

    /// This instance made progress now: a claim read due records, a send was confirmed, or
    /// it holds what its rate limit lets it send.
    pub fn made(&self) {
        self.lock().progress_at = Some(Instant::now());
    }

    /// A reading that started at `at` named `oldest` (the `_id` and due instant, Unix ms, of
    /// the oldest due record any worker may claim, of a destination neither paused nor
    /// rate-limited), or none.
    pub fn observed(&self, at: Instant, oldest: Option<(&Bson, i64)>) {
        let mut s = self.lock();
        let Some((id, due_ms)) = oldest else {
            s.suspect = None;
            return;
        };
        let key = format!("{id:?}");
        let same = s
            .live_suspect()
            .is_some_and(|x| x.key == key || x.due_ms == due_ms);
        if same && let Some(x) = s.suspect.as_mut() {
            x.seen_again = true;
            return;
        }
        s.suspect = Some(Suspect {
            key,
            due_ms,
            first_seen: at,
            seen_again: false,
        });
    }

    /// How long the same due record has stayed unclaimed with no progress of this instance:
    /// zero until a second reading confirmed it.
    pub fn unclaimed_for(&self) -> Duration {
        self.confirmed().unwrap_or(Duration::ZERO)
    }

    /// Whether due records have stayed unclaimed for the whole window.
    pub fn stalled(&self) -> bool {
        self.confirmed().is_some_and(|d| d >= self.stall_after)
    }

    fn confirmed(&self) -> Option<Duration> {
        let s = self.lock();
        let x = s.live_suspect().filter(|x| x.seen_again)?;
        Some(x.first_seen.elapsed())
    }

    /// When the monitor should read again: once the window has passed since the suspect was
    /// first seen (to confirm or clear it), then every window while it stays. `None` when
    /// there is nothing to confirm.
    pub fn next_reading_in(&self) -> Option<Duration> {
        let s = self.lock();
        let x = s.live_suspect()?;
        Some(match x.seen_again {
            true => self.stall_after,
            false => self.stall_after.saturating_sub(x.first_seen.elapsed()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Record `n`, due at `n` ms.
    fn id(n: i32) -> (Bson, i64) {
        (Bson::Int32(n), i64::from(n))
    }

    fn seen(p: &Progress, r: &(Bson, i64)) {
        p.observed(Instant::now(), Some((&r.0, r.1)));
    }

    #[test]
    fn the_same_record_seen_again_without_progress_is_a_stall() {
        let p = Progress::new(Duration::ZERO);
        let first = Instant::now();
        p.observed(first, Some((&id(1).0, 1)));
        assert!(!p.stalled(), "one reading proves nothing");
        assert_eq!(p.next_reading_in(), Some(Duration::ZERO));
        seen(&p, &id(1));
        assert!(p.stalled());
        p.made();
        assert!(!p.stalled(), "progress clears it at once");
        assert_eq!(p.unclaimed_for(), Duration::ZERO);
        assert_eq!(p.next_reading_in(), None);
    }

    #[test]
    fn another_record_or_none_starts_over() {
        let p = Progress::new(Duration::ZERO);
        seen(&p, &id(1));
        seen(&p, &id(2));
        assert!(
            !p.stalled(),
            "a peer took the first: not this instance's stall"
        );
        seen(&p, &id(2));
        assert!(p.stalled());
        p.observed(Instant::now(), None);
        assert!(!p.stalled());
    }

    #[test]
    fn a_record_due_at_the_same_instant_is_the_same_wait() {
        let p = Progress::new(Duration::ZERO);
        seen(&p, &(Bson::Int32(1), 5));
        seen(&p, &(Bson::Int32(2), 5));
        assert!(p.stalled(), "ties come back in any order");
    }

    #[test]
    fn progress_between_the_readings_counts() {
        let p = Progress::new(Duration::ZERO);
        seen(&p, &id(1));
        p.made();
        seen(&p, &id(1));
        assert!(
            !p.stalled(),
            "the claims read records since the first reading"
        );
        seen(&p, &id(1));
        assert!(p.stalled(), "and then none again");
    }

    #[test]
    fn a_stall_needs_the_whole_window() {
        let p = Progress::new(Duration::from_secs(3_600));
        seen(&p, &id(1));
        seen(&p, &id(1));
        assert!(!p.stalled());
        assert!(p.next_reading_in().is_some_and(|d| d > Duration::ZERO));
    }

    #[test]
    fn the_window_follows_the_configuration() {
        let c = Config::default();
        assert_eq!(stall_after(&c), Duration::from_secs(25));
    }
}
