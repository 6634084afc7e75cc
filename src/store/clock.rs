//! The database server's clock, as seen from here.
//!
//! Lease instants are compared by the database, so they must be stamped with its clock, not
//! this host's: a host whose clock runs slow would otherwise steal live leases. Each server
//! reading (the `localTime` of a `hello` reply, taken at the midpoint of the round trip,
//! refreshed periodically by the daemon's monitor) is kept with the monotonic instant it was
//! taken at; the server's time now is that reading plus the monotonic time elapsed since. An
//! NTP step or a VM resume that moves this host's wall clock therefore moves no lease
//! decision. The wall clock is used only before the first reading and for the offset gauge.

use std::sync::{Arc, Mutex};

use tokio::time::Instant;

use bson::DateTime;

/// A server reading: the server's Unix milliseconds at a monotonic instant.
#[derive(Debug, Clone, Copy)]
struct Reading {
    server_ms: i64,
    at: Instant,
}

/// A cheap, cloneable handle to the estimated server clock.
#[derive(Debug, Clone, Default)]
pub struct ServerClock {
    reading: Arc<Mutex<Option<Reading>>>,
    /// Added to this host's wall clock; only tests set it, to simulate a host whose clock is
    /// wrong, or one that steps.
    local_skew_ms: Arc<std::sync::atomic::AtomicI64>,
}

impl ServerClock {
    /// A clock whose host reads `skew` away from the truth (tests and fault injection).
    pub fn with_local_skew_ms(skew: i64) -> Self {
        let clock = Self::default();
        clock.step_local_clock_ms(skew);
        clock
    }

    /// Moves this host's (simulated) wall clock by `ms`, as an NTP step would (tests).
    pub fn step_local_clock_ms(&self, ms: i64) {
        self.local_skew_ms
            .fetch_add(ms, std::sync::atomic::Ordering::Relaxed);
    }

    /// This host's wall clock in Unix milliseconds (with any injected skew).
    pub fn local_ms(&self) -> i64 {
        crate::host::wall_ms().saturating_add(
            self.local_skew_ms
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    fn last(&self) -> Option<Reading> {
        match self.reading.lock() {
            Ok(r) => *r,
            Err(poisoned) => *poisoned.into_inner(),
        }
    }

    /// The current estimate of the server's clock: the last reading plus the monotonic time
    /// since; this host's wall clock before the first reading.
    pub fn now(&self) -> DateTime {
        match self.last() {
            Some(r) => {
                let elapsed = i64::try_from(r.at.elapsed().as_millis()).unwrap_or(i64::MAX);
                DateTime::from_millis(r.server_ms.saturating_add(elapsed))
            }
            None => DateTime::from_millis(self.local_ms()),
        }
    }

    /// Server minus local wall clock, in milliseconds (for the offset gauge and logs).
    pub fn offset_ms(&self) -> i64 {
        self.now()
            .timestamp_millis()
            .saturating_sub(self.local_ms())
    }

    /// Records a server reading `server` taken between the monotonic instants `sent` and
    /// `received`, and returns the new offset to this host's wall clock.
    pub fn observe(&self, server: DateTime, sent: Instant, received: Instant) -> i64 {
        let midpoint = sent + received.saturating_duration_since(sent) / 2;
        let reading = Reading {
            server_ms: server.timestamp_millis(),
            at: midpoint,
        };
        match self.reading.lock() {
            Ok(mut r) => *r = Some(reading),
            Err(poisoned) => *poisoned.into_inner() = Some(reading),
        }
        self.offset_ms()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn truth_ms() -> i64 {
        crate::host::wall_ms()
    }

    #[test]
    fn reading_is_the_round_trip_midpoint() {
        let clock = ServerClock::default();
        let received = Instant::now();
        let sent = received - Duration::from_millis(100);
        clock.observe(DateTime::from_millis(10_050), sent, received);
        // The reading is 10,050 at sent + 50 ms, so at `sent` the server read 10,000.
        let at_sent = clock.now().timestamp_millis() - sent.elapsed().as_millis() as i64;
        assert!((at_sent - 10_000).abs() <= 5, "{at_sent}");
    }

    #[test]
    fn skewed_host_still_reads_server_time_after_observe() {
        let clock = ServerClock::with_local_skew_ms(-180_000);
        let now = Instant::now();
        clock.observe(DateTime::from_millis(truth_ms()), now, now);
        assert!((clock.now().timestamp_millis() - truth_ms()).abs() < 1_000);
        assert!((clock.offset_ms() - 180_000).abs() < 1_000);
    }

    #[test]
    fn a_wall_clock_step_moves_no_lease_decision() {
        let clock = ServerClock::default();
        let now = Instant::now();
        clock.observe(DateTime::from_millis(truth_ms()), now, now);
        let before = clock.now().timestamp_millis();
        // An NTP step (or a VM resume) moves this host's wall clock by an hour.
        clock.step_local_clock_ms(3_600_000);
        let after = clock.now().timestamp_millis();
        assert!(
            (after - before).abs() < 1_000,
            "moved by {}",
            after - before
        );
        assert!((clock.offset_ms() + 3_600_000).abs() < 1_000);
    }
}
