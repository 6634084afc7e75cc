//! Which part of the due range a claim reads.
//!
//! A claim reads the oldest claimable records due by its horizon. SecantusDB scans the
//! `"Time.0"` index from the start up to the upper bound and reads every record there before
//! it applies the limit: a claim against 50k due records costs 230 ms where a range of 1,000
//! costs 70 ms. So while a backlog drains, [`ReadWindow`] keeps an upper bound about one batch
//! past the last full read, and the claim reads only that far.
//!
//! Several instances draining one backlog would all read the same oldest records and race
//! for them. For [`RACE_MEMORY`] after a claim lost records to a racing instance, claims read
//! a random slice instead: one of the next [`SLICES`] batch-wide spans past the bound (with a
//! lower bound as well), or, one time in `SLICES`, from the start. Other claims always read
//! from the start, so no record is passed over for good.
//!
//! Nothing here is a lease rule: the window only decides what a claim looks at. Every record
//! it reads is still claimed by the compare-and-swap of [`crate::store::lease`].

use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

use bson::DateTime;

/// How many batch-wide slices past the bound a contended claim picks from.
pub const SLICES: i64 = 4;

/// How long claims read random slices after one met a racing instance.
pub const RACE_MEMORY: Duration = Duration::from_secs(2);

/// The due range one claim reads: `from` (inclusive, when set) to `to` (inclusive).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    pub from: Option<DateTime>,
    pub to: DateTime,
    /// Set from the window rather than the full horizon.
    bounded: bool,
}

/// The upper bound of the next claim's read, and how wide a batch was when it was set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Bound {
    to: i64,
    span: i64,
}

/// The read window of one instance's claims, kept by its claim path ([`crate::store::claim::ClaimPath`]).
#[derive(Debug, Default)]
pub struct ReadWindow(Mutex<State>);

#[derive(Debug, Default)]
struct State {
    bound: Option<Bound>,
    /// When a claim last lost records to a racing instance.
    raced_at: Option<Instant>,
}

impl State {
    fn contended(&self) -> bool {
        self.raced_at.is_some_and(|t| t.elapsed() < RACE_MEMORY)
    }
}

impl ReadWindow {
    /// Notes that a claim lost records to a racing instance.
    pub fn raced(&self) {
        self.lock().raced_at = Some(Instant::now());
    }

    /// Whether claims are reading random slices.
    #[cfg(test)]
    fn contended(&self) -> bool {
        self.lock().contended()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The range the next claim reads, given its full horizon (now plus the look-ahead) and
    /// a random slice number in `0..SLICES` (used while claims are contended).
    pub fn range(&self, horizon: DateTime, slice: i64) -> Range {
        let full = Range {
            from: None,
            to: horizon,
            bounded: false,
        };
        let mut guard = self.lock();
        let contended = guard.contended();
        let state = &mut guard.bound;
        let Some(b) = *state else {
            return full;
        };
        if b.to >= horizon.timestamp_millis() {
            *state = None;
            return full;
        }
        let (from, to) = if contended && slice > 0 {
            let from = b.to.saturating_add((slice - 1).saturating_mul(b.span));
            (Some(from), from.saturating_add(b.span))
        } else {
            (None, b.to)
        };
        match from {
            Some(f) if f >= horizon.timestamp_millis() => Range {
                from: None,
                to: DateTime::from_millis(b.to),
                bounded: true,
            },
            _ => Range {
                from: from.map(DateTime::from_millis),
                to: DateTime::from_millis(to.min(horizon.timestamp_millis())),
                bounded: true,
            },
        }
    }

    /// Sets the window for the next claim from what a claim of `range` found: the due times
    /// of the records read (oldest first) and whether it read a full `limit`. Returns
    /// whether the next claim should come at once.
    pub fn update(&self, range: &Range, dues: &[DateTime], full: bool) -> bool {
        let mut guard = self.lock();
        let state = &mut guard.bound;
        let span_of = |first: &DateTime, last: &DateTime| {
            last.timestamp_millis()
                .saturating_sub(first.timestamp_millis())
                .max(1)
        };
        match (dues.first(), dues.last()) {
            (Some(first), Some(last)) if full => {
                // A backlog: next time read as far again past the newest record read.
                let span = span_of(first, last);
                *state = Some(Bound {
                    to: last.timestamp_millis().saturating_add(span),
                    span,
                });
                true
            }
            _ if range.bounded => {
                // Little left under the bound: move it on, twice as wide, until it passes
                // the horizon and the window is dropped.
                let span = state.map_or(1, |b| b.span).saturating_mul(2);
                *state = Some(Bound {
                    to: range.to.timestamp_millis().saturating_add(span),
                    span,
                });
                true
            }
            _ => {
                *state = None;
                false
            }
        }
    }

    #[cfg(test)]
    fn bound(&self) -> Option<i64> {
        self.lock().bound.map(|b| b.to)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: i64) -> DateTime {
        DateTime::from_millis(ms)
    }

    fn dues(from: i64, n: i64) -> Vec<DateTime> {
        (0..n).map(|i| at(from + i)).collect()
    }

    #[test]
    fn a_full_read_bounds_the_next_one_past_the_last_record() {
        let w = ReadWindow::default();
        let r = w.range(at(50_000), 0);
        assert_eq!((r.from, r.to), (None, at(50_000)), "no bound to begin with");
        assert!(w.update(&r, &dues(1_000, 10), true));
        // As far again past the newest record read (1,009 + 9).
        let r = w.range(at(50_000), 0);
        assert_eq!((r.from, r.to), (None, at(1_018)));
    }

    #[test]
    fn a_thin_bounded_read_moves_the_bound_on_until_the_horizon_drops_it() {
        let w = ReadWindow::default();
        let r = w.range(at(2_000), 0);
        w.update(&r, &dues(1_000, 10), true);
        let mut r = w.range(at(2_000), 0);
        let mut last = r.to;
        let mut steps = 0;
        while r.to < at(2_000) || r.from.is_some() {
            assert!(w.update(&r, &dues(last.timestamp_millis(), 1), false));
            r = w.range(at(2_000), 0);
            assert!(r.to > last || r.to == at(2_000), "the bound only grows");
            last = r.to;
            steps += 1;
            assert!(steps < 20, "the bound must reach the horizon");
        }
        // At the horizon the window is gone: a read of the whole due range.
        assert_eq!(w.bound(), None);
        assert!(
            !w.update(&r, &dues(1_900, 3), false),
            "nothing more: wait for the poll"
        );
    }

    #[test]
    fn a_contended_claim_reads_a_slice_past_the_bound_or_from_the_start() {
        let w = ReadWindow::default();
        let r = w.range(at(100_000), 0);
        w.update(&r, &dues(1_000, 100), true); // bound 1,198, span 99
        // Uncontended claims always read from the start.
        let plain = w.range(at(100_000), 3);
        assert_eq!(plain.from, None);
        w.raced();
        let start = w.range(at(100_000), 0);
        assert_eq!((start.from, start.to), (None, at(1_198)));
        let s1 = w.range(at(100_000), 1);
        assert_eq!((s1.from, s1.to), (Some(at(1_198)), at(1_297)));
        let s3 = w.range(at(100_000), 3);
        assert_eq!((s3.from, s3.to), (Some(at(1_396)), at(1_495)));
    }

    #[test]
    fn a_slice_never_reads_past_the_horizon() {
        let w = ReadWindow::default();
        let r = w.range(at(1_250), 0);
        w.update(&r, &dues(1_000, 100), true); // bound 1,198, span 99
        w.raced();
        let s3 = w.range(at(1_250), 3);
        assert_eq!(
            (s3.from, s3.to),
            (None, at(1_198)),
            "slice 3 starts past the horizon"
        );
        let s1 = w.range(at(1_250), 1);
        assert_eq!((s1.from, s1.to), (Some(at(1_198)), at(1_250)));
    }

    #[test]
    fn a_race_is_remembered_for_a_while() {
        let w = ReadWindow::default();
        assert!(!w.contended());
        w.raced();
        assert!(w.contended());
        w.lock().raced_at = Some(Instant::now() - RACE_MEMORY);
        assert!(!w.contended());
    }

    #[test]
    fn an_unbounded_read_that_is_not_full_leaves_no_window() {
        let w = ReadWindow::default();
        let r = w.range(at(50_000), 0);
        assert!(!w.update(&r, &dues(1_000, 3), false));
        assert!(!w.update(&r, &[], false));
        assert_eq!(w.bound(), None);
    }
}
