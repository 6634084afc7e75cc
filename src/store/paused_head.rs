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
//! is dropped at once, and a read already running sets none; by another, or a lease that runs out: seen at the next read from the
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

/// The lower bound of the next claim's read while destinations are left out. One per claim
/// path ([`crate::store::claim::ClaimPath`]).
#[derive(Debug, Default)]
pub struct PausedHead(Mutex<Inner>);

#[derive(Debug, Default)]
struct Inner {
    head: Option<Head>,
    /// How many times the bound was forgotten: a read that began before the latest time says
    /// nothing of the records freed since, and sets no bound.
    forgotten: u64,
}

/// When a read began, as [`PausedHead::update`] needs to know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Began(u64);

impl PausedHead {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where the next claim leaving out `excluded` may start reading (`None`: from the
    /// start), and when it began, for its [`PausedHead::update`].
    pub fn start(&self, excluded: &[String]) -> (Option<DateTime>, Began) {
        self.start_at(excluded, Instant::now())
    }

    fn start_at(&self, excluded: &[String], at: Instant) -> (Option<DateTime>, Began) {
        let inner = self.lock();
        let began = Began(inner.forgotten);
        match &inner.head {
            Some(h)
                if !excluded.is_empty()
                    && h.excluded == excluded
                    && at.saturating_duration_since(h.at) < FULL_READ_EVERY =>
            {
                (Some(DateTime::from_millis(h.from_ms)), began)
            }
            _ => (None, began),
        }
    }

    /// A claim leaving out `excluded` that `began` read from `read_from` (`None`: the start)
    /// at the server's `now`, and the oldest record it found was due at `first` (`None`: it
    /// found none up to its horizon `to`).
    pub fn update(
        &self,
        read: (&[String], Began),
        read_from: Option<DateTime>,
        now: DateTime,
        first: Option<DateTime>,
        to: DateTime,
    ) {
        self.update_at(read, read_from, now, first, to, Instant::now());
    }

    fn update_at(
        &self,
        (excluded, began): (&[String], Began),
        read_from: Option<DateTime>,
        now: DateTime,
        first: Option<DateTime>,
        to: DateTime,
        at: Instant,
    ) {
        let mut inner = self.lock();
        if excluded.is_empty() {
            inner.head = None;
            return;
        }
        // Records this instance freed while the read ran may lie before what it found.
        if began.0 != inner.forgotten {
            return;
        }
        // A record found due at `first` may lie up to 1 ms before it: a due instant in .NET
        // ticks is rounded up to the millisecond, and others in that millisecond may be
        // claimable still (past the batch, or their take failed). From the one before.
        let first = first.map(|f| DateTime::from_millis(f.timestamp_millis().saturating_sub(1)));
        let bound = first.unwrap_or(to).min(now).timestamp_millis();
        match (read_from, inner.head.as_mut()) {
            (None, _) => {
                inner.head = Some(Head {
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

    /// This instance freed records that may be due before the bound: read from the start,
    /// and take no bound from a read already running.
    pub fn forget(&self) {
        let mut inner = self.lock();
        inner.head = None;
        inner.forgotten = inner.forgotten.wrapping_add(1);
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

    /// A read leaving out `paused()` that `began`, as [`PausedHead::update`] takes it.
    /// (Instants in ms.)
    fn read(
        h: &PausedHead,
        began: Began,
        from: Option<i64>,
        now: i64,
        first: Option<i64>,
        to: i64,
        t: Instant,
    ) {
        let (from, first) = (from.map(at), first.map(at));
        h.update_at((&paused(), began), from, at(now), first, at(to), t);
    }

    impl PausedHead {
        /// A read beginning now.
        fn began(&self) -> Began {
            Began(self.lock().forgotten)
        }
    }

    /// Found in review: a read from the start answered before this instance's release of a
    /// record landed, but handed back after the release ended, set a bound past the freed
    /// record, and claims passed it over for up to `FULL_READ_EVERY`. A read that began
    /// before the bound was forgotten sets none.
    #[test]
    fn a_read_running_when_the_bound_was_forgotten_sets_none() {
        let h = PausedHead::default();
        let t0 = Instant::now();
        let (from, began) = h.start_at(&paused(), t0);
        assert_eq!(from, None);
        h.forget();
        read(&h, began, None, 10_000, Some(4_000), 12_000, t0);
        assert_eq!(
            h.start_at(&paused(), t0).0,
            None,
            "a bound from a read that missed the release"
        );
        let began = h.began();
        read(&h, began, None, 10_000, Some(4_000), 12_000, t0);
        assert_eq!(
            h.start_at(&paused(), t0).0,
            Some(at(3_999)),
            "a read begun after it sets one"
        );
    }

    #[test]
    fn a_read_from_the_start_sets_the_bound_and_later_reads_move_it_on() {
        let h = PausedHead::default();
        let t0 = Instant::now();
        assert_eq!(
            h.start_at(&paused(), t0).0,
            None,
            "nothing known: from the start"
        );
        read(&h, h.began(), None, 10_000, Some(4_000), 12_000, t0);
        assert_eq!(h.start_at(&paused(), t0).0, Some(at(3_999)));
        read(&h, h.began(), Some(3_999), 11_000, Some(6_000), 13_000, t0);
        assert_eq!(h.start_at(&paused(), t0).0, Some(at(5_999)));
        // Nothing found: up to the server's now, never into the look-ahead.
        read(&h, h.began(), Some(5_999), 12_000, None, 14_000, t0);
        assert_eq!(h.start_at(&paused(), t0).0, Some(at(12_000)));
        // A slice read past the bound leaves it.
        read(&h, h.began(), Some(20_000), 30_000, None, 32_000, t0);
        assert_eq!(h.start_at(&paused(), t0).0, Some(at(12_000)));
    }

    /// Found in review (helper-26): the bound was the millisecond the first record found was
    /// due at, which for a `Time` in .NET ticks is rounded up; the next read, from there,
    /// passed over records between the ticks and that millisecond that this claim did not
    /// take (a batch cut within one millisecond), for up to `FULL_READ_EVERY`.
    #[test]
    fn the_bound_lies_before_the_millisecond_a_record_was_rounded_up_to() {
        let h = PausedHead::default();
        let t0 = Instant::now();
        // Ticks at 3,999.5 ms: due at 4,000.
        let due = crate::record::ticks_to_ms(crate::record::ms_to_ticks(3_999) + 5_000);
        assert_eq!(due, 4_000);
        read(&h, h.began(), None, 10_000, Some(due), 12_000, t0);
        let from = h.start_at(&paused(), t0).0.expect("a bound");
        assert!(
            crate::record::ms_to_ticks(from.timestamp_millis())
                <= crate::record::ms_to_ticks(3_999) + 5_000,
            "the next read starts past the record's ticks: {from}"
        );
    }

    #[test]
    fn the_bound_lapses_changes_with_the_set_and_is_forgotten() {
        let h = PausedHead::default();
        let t0 = Instant::now();
        read(&h, h.began(), None, 10_000, Some(4_000), 12_000, t0);
        assert_eq!(
            h.start_at(&paused(), t0 + FULL_READ_EVERY).0,
            None,
            "lapsed"
        );
        assert_eq!(
            h.start_at(&["other".to_string()], t0).0,
            None,
            "another set"
        );
        assert_eq!(
            h.start_at(&[], t0).0,
            None,
            "nothing left out: from the start"
        );
        h.forget();
        assert_eq!(h.start_at(&paused(), t0).0, None, "forgotten");
        read(&h, h.began(), None, 10_000, Some(4_000), 12_000, t0);
        h.update_at((&[], h.began()), None, at(10_000), None, at(12_000), t0);
        assert_eq!(
            h.start_at(&paused(), t0).0,
            None,
            "a claim leaving nothing out drops it"
        );
    }
}
