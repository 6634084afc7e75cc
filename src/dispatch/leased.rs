//! The one type a claimed record has from its claim to its removal, release or parking
//! ([`Leased`]), and the records of this instance waiting for their instant ([`Held`]). Plain
//! data, no I/O.

use std::collections::BTreeMap;
use std::time::Duration;
use tokio::time::Instant;

use bson::{Bson, DateTime, Document};

use crate::record::{DecodeError, TimeoutRecord};
use crate::store::lease::Lease;
use crate::store::parking::ParkReason;

/// A claimed record, decoded once: its stored `_id` (what every guarded write matches), the
/// stored document (for parking it as it was), the decoded record and its claim's lease. It
/// keeps this type until it is removed, released or parked.
#[derive(Debug, Clone)]
pub struct Leased {
    pub id: Bson,
    pub raw: Document,
    pub record: TimeoutRecord,
    pub lease: Lease,
}

/// Claimed records waiting for their due instant, soonest first.
#[derive(Debug, Default)]
pub struct Held {
    queue: BTreeMap<(i64, u64), Leased>,
    seq: u64,
}

impl Held {
    pub fn push(&mut self, r: Leased) {
        let due = r.record.due.timestamp_millis();
        self.defer(r, due);
    }

    pub fn len(&self) -> usize {
        self.queue.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Puts a record back to be taken again at `at_ms` (server clock), not before: a send a
    /// rate limit holds back. Its due instant, and so its lateness, stay as they were.
    pub fn defer(&mut self, r: Leased, at_ms: i64) {
        self.seq += 1;
        self.queue.insert((at_ms, self.seq), r);
    }

    /// Takes every record `matches` selects (a paused destination's).
    pub fn take_matching(&mut self, matches: impl Fn(&Leased) -> bool) -> Vec<Leased> {
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
    pub fn take_due(&mut self, now: DateTime) -> Vec<Leased> {
        // Sequence numbers never reach u64::MAX, so every record due at `now` stays before it.
        let later = self.queue.split_off(&(now.timestamp_millis(), u64::MAX));
        std::mem::replace(&mut self.queue, later)
            .into_values()
            .collect()
    }

    /// Takes every record.
    pub fn take_all(&mut self) -> Vec<Leased> {
        std::mem::take(&mut self.queue).into_values().collect()
    }
}

/// Whether a claimed record can wait for its instant and be sent, or is parked at once with
/// a reason (it does not decode, or names no destination). The message itself is built, and
/// checked against the protocol's limits, when the record falls due
/// ([`crate::record::message::build`]).
pub fn triage(
    record: Result<TimeoutRecord, DecodeError>,
) -> Result<TimeoutRecord, (ParkReason, String)> {
    match record {
        Err(e) => Err((ParkReason::Undecodable, e.to_string())),
        Ok(r) if r.destination.is_empty() => Err((
            ParkReason::EmptyDestination,
            "Destination is missing or empty".into(),
        )),
        Ok(r) => Ok(r),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ready(due_ms: i64) -> Leased {
        Leased {
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
}
