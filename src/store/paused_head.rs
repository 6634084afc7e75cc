//! Where a claim starts reading while some destinations are left out (paused, or held enough
//! of under a rate limit).
//!
//! The claim leaves them out with `Destination: {$nin: [...]}`, but the server still walks
//! the due index over every due record of theirs before it reaches the others: with 100k
//! records of a paused destination at the head of the due range, every claim took about
//! 450 ms on SecantusDB instead of 10-30 ms. A claim that read from the start and found its
//! first claimable record of another destination due at `t` shows that none is due before
//! `t`; [`PausedHead`] keeps that bound, and later claims read from it (never past the server's
//! `now` at that read, so a record inserted due within the look-ahead is not passed over).
//!
//! What can become claimable behind the bound: records released (by this instance: the bound
//! is dropped at once; by another, or a lease that runs out: seen at the next read from the
//! start), records inserted already overdue, records rescheduled earlier. So the bound is
//! dropped every [`FULL_READ_EVERY`], and whenever the set of destinations left out changes:
//! such a record waits at most that long, and only while something is left out. Nothing here
//! is a lease rule: every record read is still claimed by the compare-and-swap of
//! [`crate::store::lease`].

use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

use bson::DateTime;

/// How long a bound serves before a claim reads from the start again.
pub const FULL_READ_EVERY: Duration = Duration::from_secs(5);

#[derive(Debug, Clone)]
struct Head {
    excluded: Vec<String>,
    from_ms: i64,
    /// When the read from the start that set it ran.
    at: Instant,
}

/// The lower bound of the next claim's read while destinations are left out. Shared by the
/// clones of a store.
#[derive(Debug, Default)]
pub struct PausedHead(Mutex<Option<Head>>);

impl PausedHead {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Head>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where the next claim leaving out `excluded` may start reading; `None`: from the start.
    pub fn start(&self, excluded: &[String]) -> Option<DateTime> {
        self.start_at(excluded, Instant::now())
    }

    fn start_at(&self, excluded: &[String], at: Instant) -> Option<DateTime> {
        if excluded.is_empty() {
            return None;
        }
        match &*self.lock() {
            Some(h)
                if h.excluded == excluded
                    && at.saturating_duration_since(h.at) < FULL_READ_EVERY =>
            {
                Some(DateTime::from_millis(h.from_ms))
            }
            _ => None,
        }
    }

    /// A claim leaving out `excluded` read from `read_from` (`None`: the start) at the
    /// server's `now`, and the oldest record it found was due at `first` (`None`: it found
    /// none up to its horizon `to`).
    pub fn update(
        &self,
        excluded: &[String],
        read_from: Option<DateTime>,
        now: DateTime,
        first: Option<DateTime>,
        to: DateTime,
    ) {
        self.update_at(excluded, read_from, now, first, to, Instant::now());
    }

    fn update_at(
        &self,
        excluded: &[String],
        read_from: Option<DateTime>,
        now: DateTime,
        first: Option<DateTime>,
        to: DateTime,
        at: Instant,
    ) {
        let mut head = self.lock();
        if excluded.is_empty() {
            *head = None;
            return;
        }
        let bound = first.unwrap_or(to).min(now).timestamp_millis();
        match (read_from, head.as_mut()) {
            (None, _) => {
                *head = Some(Head {
                    excluded: excluded.to_vec(),
                    from_ms: bound,
                    at,
                });
            }
            // A read that started at or before the bound moves it on; one that started past
            // it (a slice of the read window) says nothing of what lies between.
            (Some(from), Some(h))
                if h.excluded == excluded && from.timestamp_millis() <= h.from_ms =>
            {
                h.from_ms = h.from_ms.max(bound);
            }
            _ => {}
        }
    }

    /// This instance freed records that may be due before the bound: read from the start.
    pub fn forget(&self) {
        *self.lock() = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: i64) -> DateTime {
        DateTime::from_millis(ms)
    }

    fn paused() -> Vec<String> {
        vec!["paused".to_string()]
    }

    #[test]
    fn a_read_from_the_start_sets_the_bound_and_later_reads_move_it_on() {
        let h = PausedHead::default();
        let t0 = Instant::now();
        assert_eq!(
            h.start_at(&paused(), t0),
            None,
            "nothing known: from the start"
        );
        h.update_at(&paused(), None, at(10_000), Some(at(4_000)), at(12_000), t0);
        assert_eq!(h.start_at(&paused(), t0), Some(at(4_000)));
        h.update_at(
            &paused(),
            Some(at(4_000)),
            at(11_000),
            Some(at(6_000)),
            at(13_000),
            t0,
        );
        assert_eq!(h.start_at(&paused(), t0), Some(at(6_000)));
        // Nothing found: up to the server's now, never into the look-ahead.
        h.update_at(&paused(), Some(at(6_000)), at(12_000), None, at(14_000), t0);
        assert_eq!(h.start_at(&paused(), t0), Some(at(12_000)));
        // A slice read past the bound leaves it.
        h.update_at(
            &paused(),
            Some(at(20_000)),
            at(30_000),
            None,
            at(32_000),
            t0,
        );
        assert_eq!(h.start_at(&paused(), t0), Some(at(12_000)));
    }

    #[test]
    fn the_bound_lapses_changes_with_the_set_and_is_forgotten() {
        let h = PausedHead::default();
        let t0 = Instant::now();
        h.update_at(&paused(), None, at(10_000), Some(at(4_000)), at(12_000), t0);
        assert_eq!(h.start_at(&paused(), t0 + FULL_READ_EVERY), None, "lapsed");
        assert_eq!(h.start_at(&["other".to_string()], t0), None, "another set");
        assert_eq!(
            h.start_at(&[], t0),
            None,
            "nothing left out: from the start"
        );
        h.forget();
        assert_eq!(h.start_at(&paused(), t0), None, "forgotten");
        h.update_at(&paused(), None, at(10_000), Some(at(4_000)), at(12_000), t0);
        h.update_at(&[], None, at(10_000), None, at(12_000), t0);
        assert_eq!(
            h.start_at(&paused(), t0),
            None,
            "a claim leaving nothing out drops it"
        );
    }
}
