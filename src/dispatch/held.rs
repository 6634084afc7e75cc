//! The dispatch loop's bookkeeping: the claimed records waiting for their due instant
//! ([`Held`]), and when the next claim runs ([`ClaimSchedule`]). Plain data, no I/O.

use std::collections::BTreeMap;
use std::time::Duration;
use tokio::time::Instant;

use bson::{Bson, DateTime, Document};

use crate::record::TimeoutRecord;
use crate::store::lease::Lease;

/// A claimed record ready to send: its stored `_id` (what every guarded write matches), the
/// stored document (for parking it as it was), the decoded record and its claim's lease.
#[derive(Debug, Clone)]
pub struct Ready {
    pub id: Bson,
    pub raw: Document,
    pub record: TimeoutRecord,
    pub lease: Lease,
}

/// Claimed records waiting for their due instant, soonest first.
#[derive(Debug, Default)]
pub struct Held {
    queue: BTreeMap<(i64, u64), Ready>,
    seq: u64,
}

impl Held {
    pub fn push(&mut self, r: Ready) {
        self.seq += 1;
        self.queue
            .insert((r.record.due.timestamp_millis(), self.seq), r);
    }

    pub fn len(&self) -> usize {
        self.queue.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Puts a record back to be taken again at `at_ms` (server clock), not before: a send a
    /// rate limit holds back. Its due instant, and so its lateness, stay as they were.
    pub fn defer(&mut self, r: Ready, at_ms: i64) {
        self.seq += 1;
        self.queue.insert((at_ms, self.seq), r);
    }

    /// Takes every record `matches` selects (a paused destination's).
    pub fn take_matching(&mut self, matches: impl Fn(&Ready) -> bool) -> Vec<Ready> {
        let keys: Vec<(i64, u64)> = self
            .queue
            .iter()
            .filter(|(_, r)| matches(r))
            .map(|(k, _)| *k)
            .collect();
        keys.iter().filter_map(|k| self.queue.remove(k)).collect()
    }

    /// How many records of `destination` are held.
    pub fn count_of(&self, destination: &str) -> usize {
        self.queue
            .values()
            .filter(|r| r.record.destination == destination)
            .count()
    }

    /// When the soonest record is to be taken: its due instant, or later when a rate limit
    /// deferred it.
    pub fn next_due(&self) -> Option<DateTime> {
        self.queue
            .keys()
            .next()
            .map(|(ms, _)| DateTime::from_millis(*ms))
    }

    /// Takes every record due at or before `now`, soonest first.
    pub fn take_due(&mut self, now: DateTime) -> Vec<Ready> {
        // Sequence numbers never reach u64::MAX, so every record due at `now` stays before it.
        let later = self.queue.split_off(&(now.timestamp_millis(), u64::MAX));
        std::mem::replace(&mut self.queue, later)
            .into_values()
            .collect()
    }

    /// Takes every record.
    pub fn take_all(&mut self) -> Vec<Ready> {
        std::mem::take(&mut self.queue).into_values().collect()
    }
}

/// The monotonic instant at which a record due at `due` (server clock, read as `now`) falls
/// due. Saturates: a `Time` at either end of the BSON date range neither overflows nor waits
/// past the far future.
pub fn instant_of(due: DateTime, now: DateTime, at: Instant) -> Instant {
    let wait_ms = due
        .timestamp_millis()
        .saturating_sub(now.timestamp_millis());
    let wait = Duration::from_millis(u64::try_from(wait_ms).unwrap_or(0));
    at.checked_add(wait)
        .unwrap_or_else(|| at + Duration::from_secs(86_400 * 365))
}

/// When the next claim runs: every poll interval counted from the start of the last claim, at
/// once while more is due, at once after a wake-up (even one that came while a claim ran),
/// later after a failure.
#[derive(Debug)]
pub struct ClaimSchedule {
    poll: Duration,
    next_at: Instant,
    running: bool,
    /// A wake-up arrived while a claim ran: claim again as soon as it returns.
    woken: bool,
    /// No claim before this, whatever else says "at once": set by [`ClaimSchedule::hold_off`]
    /// (publishes went unconfirmed), and kept through the claim that was running then, a
    /// wake-up and a failure.
    not_before: Instant,
}

impl ClaimSchedule {
    /// The first claim runs at once.
    pub fn new(poll: Duration) -> Self {
        let now = Instant::now();
        Self {
            poll,
            next_at: now,
            running: false,
            woken: false,
            not_before: now,
        }
    }

    /// Whether a claim should start at `now`.
    pub fn is_due(&self, now: Instant) -> bool {
        !self.running && now >= self.next_at()
    }

    pub fn is_running(&self) -> bool {
        self.running
    }

    /// When the next claim is due (meaningless while one runs).
    pub fn next_at(&self) -> Instant {
        self.next_at.max(self.not_before)
    }

    pub fn started(&mut self) {
        self.running = true;
        self.woken = false;
    }

    /// A record was inserted due before the next poll.
    pub fn wake(&mut self) {
        if self.running {
            self.woken = true;
        } else {
            self.next_at = Instant::now();
        }
    }

    /// The claim that started at `started` returned; `more` when it saw more to claim.
    pub fn finished(&mut self, started: Instant, more: bool) {
        self.running = false;
        self.next_at = if more || std::mem::take(&mut self.woken) {
            Instant::now()
        } else {
            started + self.poll
        };
    }

    /// The claim failed: try again after `wait` (a wake-up does not hurry a failing server).
    pub fn failed(&mut self, wait: Duration) {
        self.running = false;
        self.woken = false;
        self.next_at = Instant::now() + wait;
    }

    /// No claim before `wait` from now (publishes went unconfirmed).
    pub fn hold_off(&mut self, wait: Duration) {
        self.not_before = self.not_before.max(Instant::now() + wait);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready(due_ms: i64) -> Ready {
        Ready {
            id: Bson::Int64(due_ms),
            raw: Document::new(),
            record: TimeoutRecord {
                id: crate::host::uuid(),
                destination: "q".into(),
                process_manager_id: crate::host::uuid(),
                due: DateTime::from_millis(due_ms),
                headers: Document::new(),
            },
            lease: Lease::new(DateTime::from_millis(0), Duration::from_secs(1)),
        }
    }

    #[test]
    fn held_records_come_out_soonest_first_and_only_when_due() {
        let mut held = Held::default();
        for ms in [30, 10, 20, 10, i64::MAX, i64::MIN] {
            held.push(ready(ms));
        }
        assert_eq!(held.next_due(), Some(DateTime::from_millis(i64::MIN)));
        let due: Vec<i64> = held
            .take_due(DateTime::from_millis(20))
            .iter()
            .map(|r| r.record.due.timestamp_millis())
            .collect();
        assert_eq!(due, [i64::MIN, 10, 10, 20]);
        assert_eq!(held.len(), 2);
        assert_eq!(held.take_due(DateTime::from_millis(i64::MAX)).len(), 2);
        assert!(held.is_empty());
    }

    #[test]
    fn instants_saturate_at_the_ends_of_the_date_range() {
        let at = Instant::now();
        let now = DateTime::from_millis(1_000);
        assert_eq!(instant_of(DateTime::from_millis(i64::MIN), now, at), at);
        assert_eq!(
            instant_of(DateTime::from_millis(1_250), now, at),
            at + Duration::from_millis(250)
        );
        // The far end neither overflows nor panics.
        assert!(
            instant_of(
                DateTime::from_millis(i64::MAX),
                DateTime::from_millis(i64::MIN),
                at
            ) > at
        );
    }

    #[test]
    fn a_wake_up_during_a_claim_is_not_lost() {
        let poll = Duration::from_secs(60);
        let mut s = ClaimSchedule::new(poll);
        let started = Instant::now();
        s.started();
        s.wake();
        s.finished(started, false);
        assert!(
            s.is_due(Instant::now()),
            "claims again at once, not a poll later"
        );
        // Without a wake-up, the next claim waits for the poll.
        let started = Instant::now();
        s.started();
        s.finished(started, false);
        assert!(!s.is_due(Instant::now()));
        assert_eq!(s.next_at(), started + poll);
        s.wake();
        assert!(s.is_due(Instant::now()));
    }

    #[test]
    fn failures_and_unconfirmed_publishes_hold_claims_off() {
        let mut s = ClaimSchedule::new(Duration::from_millis(10));
        s.started();
        s.wake();
        s.failed(Duration::from_secs(30));
        assert!(!s.is_due(Instant::now()));
        let mut s = ClaimSchedule::new(Duration::from_millis(10));
        s.hold_off(Duration::from_secs(30));
        assert!(!s.is_due(Instant::now() + Duration::from_secs(1)));
    }

    #[test]
    fn a_hold_off_set_while_a_claim_runs_outlasts_it() {
        // An unconfirmed wave sets the hold-off while a claim runs; the claim then returns
        // with more to take, or after a wake-up, or fails. None of these may claim (and
        // publish the records just released) again before the hold-off ends.
        let wait = Duration::from_secs(30);
        for end in ["more", "woken", "failed"] {
            let mut s = ClaimSchedule::new(Duration::from_millis(10));
            let started = Instant::now();
            s.started();
            s.hold_off(wait);
            match end {
                "more" => s.finished(started, true),
                "woken" => {
                    s.wake();
                    s.finished(started, false);
                }
                _ => s.failed(Duration::from_millis(1)),
            }
            let soon = Instant::now() + Duration::from_secs(1);
            assert!(!s.is_due(soon), "{end}: claims again during the hold-off");
            assert!(s.next_at() >= started + wait, "{end}");
            s.wake();
            assert!(!s.is_due(soon), "{end}: a wake-up cuts the hold-off short");
            assert!(s.is_due(started + wait + Duration::from_secs(1)), "{end}");
        }
    }
}
