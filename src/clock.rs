//! The database server's clock, as seen from here.
//!
//! Lease instants are compared by the database, so they must be stamped with its clock, not
//! this host's: a host whose clock runs slow would otherwise steal live leases. The offset
//! (server minus local) is estimated from the `localTime` of a `hello` reply, taking the
//! midpoint of the round trip, and refreshed periodically by [`crate::store::Store`].

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bson::DateTime;

/// A cheap, cloneable handle to the estimated server clock.
#[derive(Debug, Clone, Default)]
pub struct ServerClock {
    offset_ms: Arc<AtomicI64>,
    /// Added to the local clock before the offset; only tests set it, to simulate a host whose
    /// clock is wrong.
    local_skew_ms: i64,
}

impl ServerClock {
    /// A clock whose host reads `skew` away from the truth (tests and fault injection).
    pub fn with_local_skew_ms(skew: i64) -> Self {
        Self {
            offset_ms: Arc::default(),
            local_skew_ms: skew,
        }
    }

    /// This host's clock in Unix milliseconds (with any injected skew).
    pub fn local_ms(&self) -> i64 {
        let d = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        d.as_millis() as i64 + self.local_skew_ms
    }

    /// The current estimate of the server's clock.
    pub fn now(&self) -> DateTime {
        DateTime::from_millis(self.local_ms() + self.offset_ms.load(Ordering::Relaxed))
    }

    /// Server minus local clock, in milliseconds.
    pub fn offset_ms(&self) -> i64 {
        self.offset_ms.load(Ordering::Relaxed)
    }

    /// Records a server reading `server` taken between local instants `sent_ms` and
    /// `received_ms`, and returns the new offset.
    pub fn observe(&self, server: DateTime, sent_ms: i64, received_ms: i64) -> i64 {
        let midpoint = sent_ms + (received_ms - sent_ms) / 2;
        let offset = server.timestamp_millis() - midpoint;
        self.offset_ms.store(offset, Ordering::Relaxed);
        offset
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offset_uses_round_trip_midpoint() {
        let clock = ServerClock::default();
        let off = clock.observe(DateTime::from_millis(10_050), 1_000, 1_100);
        assert_eq!(off, 9_000);
        let now = clock.now().timestamp_millis();
        assert!((now - (clock.local_ms() + 9_000)).abs() <= 5);
    }

    #[test]
    fn skewed_host_still_reads_server_time_after_observe() {
        let clock = ServerClock::with_local_skew_ms(-180_000);
        let truth = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64;
        let local = clock.local_ms();
        clock.observe(DateTime::from_millis(truth), local, local);
        assert!((clock.now().timestamp_millis() - truth).abs() < 1_000);
    }
}
