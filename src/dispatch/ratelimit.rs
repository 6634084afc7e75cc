//! Send-rate limits, applied per instance at the moment a record would be published:
//! `[dispatch] max_rate` for all of the instance's sends, `[[dispatch.destination]] name,
//! max_rate` for one queue, and the ramp of `timeoutd resume DESTINATION --ramp DURATION`,
//! which raises a queue's rate from a trickle ([`TRICKLE`] per second) to its limit (or to
//! [`RAMP_CEILING`] when it has none) exponentially, and lifts it at the end.
//!
//! Token buckets: a limit of `r` per second refills `r` tokens a second and holds at most
//! `max(1, r / 10)`, so that over any span `t` no more than `r x t + max(1, r / 10)` records go out.
//! A record that finds no token waits in the dispatch loop (still under its lease, its
//! lateness still measured from its due instant) until one comes. Limits are per instance:
//! `n` instances sending to one queue can together send `n` times its limit.

use std::collections::HashMap;
use std::time::Duration;
use tokio::time::Instant;

use crate::config::DispatchConfig;
use crate::store::control::Ramp;

/// The longest a record is judged to wait for its token, in seconds: longer than any lease
/// (validation caps `lock_lease` at a year), so that the cap only keeps a tiny rate's wait
/// finite. It was an hour (found in review: under a 2 h lease, 199 records of 200 at 0.01/s
/// were held where 71 can go out).
pub const LONGEST_WAIT: f64 = 2.0 * 366.0 * 24.0 * 3600.0;

/// Records per second at the start of a resume ramp.
pub const TRICKLE: f64 = 1.0;
/// Records per second at the end of a ramp for a queue without a limit of its own.
pub const RAMP_CEILING: f64 = 1_000.0;

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn refill(&mut self, rate: f64, now: Instant) {
        let capacity = (rate / 10.0).max(1.0);
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate).min(capacity);
        self.at = now;
    }

    /// How long until a token is there at `rate`.
    fn wait(&self, rate: f64) -> Duration {
        if self.tokens >= 1.0 || rate <= 0.0 {
            return Duration::ZERO;
        }
        Duration::from_secs_f64(((1.0 - self.tokens) / rate).min(LONGEST_WAIT))
    }
}

/// The buckets of one instance.
#[derive(Debug)]
pub struct RateLimits {
    instance: Option<f64>,
    per_destination: HashMap<String, f64>,
    buckets: HashMap<Option<String>, Bucket>,
}

impl RateLimits {
    pub fn new(config: &DispatchConfig) -> Self {
        Self {
            instance: config.max_rate,
            per_destination: config
                .destination
                .iter()
                .map(|d| (d.name.clone(), d.max_rate))
                .collect(),
            buckets: HashMap::new(),
        }
    }

    /// The limit on `destination` now: its own, lowered by a ramp in progress (`now_ms` on
    /// the server clock). `None`: unlimited.
    pub fn destination_rate(
        &self,
        destination: &str,
        ramp: Option<&Ramp>,
        now_ms: i64,
    ) -> Option<f64> {
        let own = self.per_destination.get(destination).copied();
        let Some(ramp) = ramp.filter(|r| now_ms < r.until) else {
            return own;
        };
        let ceiling = own.unwrap_or(RAMP_CEILING).max(TRICKLE);
        // Saturating: `from` and `until` are stored dates, any `i64`.
        let span = ramp.until.saturating_sub(ramp.from).max(1) as f64;
        let done = (now_ms.saturating_sub(ramp.from) as f64 / span).clamp(0.0, 1.0);
        let ramped = TRICKLE * (ceiling / TRICKLE).powf(done);
        // A ramp only ever lowers the rate: a limit below the trickle stays as it is (found
        // in review: a queue limited to 0.1/s got 1/s for the whole ramp).
        Some(own.map_or(ramped, |own| ramped.min(own)))
    }

    /// Takes a token for one send to `destination` at `rate` (and one of the instance's), or
    /// says how long to wait for them.
    pub fn take(
        &mut self,
        destination: &str,
        rate: Option<f64>,
        now: Instant,
    ) -> Result<(), Duration> {
        let mut wait = Duration::ZERO;
        let limits = [(None, self.instance), (Some(destination.to_string()), rate)];
        for (key, rate) in &limits {
            if let Some(rate) = rate {
                let b = self.buckets.entry(key.clone()).or_insert(Bucket {
                    tokens: 1.0,
                    at: now,
                });
                b.refill(*rate, now);
                wait = wait.max(b.wait(*rate));
            }
        }
        if !wait.is_zero() {
            return Err(wait);
        }
        for (key, rate) in limits {
            if rate.is_some()
                && let Some(b) = self.buckets.get_mut(&key)
            {
                b.tokens -= 1.0;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DestinationLimit;

    fn limits(instance: Option<f64>, dest: &[(&str, f64)]) -> RateLimits {
        let config = DispatchConfig {
            max_rate: instance,
            destination: dest
                .iter()
                .map(|(n, r)| DestinationLimit {
                    name: n.to_string(),
                    max_rate: *r,
                })
                .collect(),
            ..DispatchConfig::default()
        };
        RateLimits::new(&config)
    }

    /// Sends over 10 s of simulated time, trying every millisecond, to each of `dests` in
    /// turn.
    fn sent_over_10s(l: &mut RateLimits, dests: &[&str]) -> usize {
        let start = Instant::now();
        let mut sent = 0;
        for ms in 0..10_000 {
            let dest = dests[ms % dests.len()];
            let (rate, at) = (
                l.destination_rate(dest, None, 0),
                start + Duration::from_millis(ms as u64),
            );
            while l.take(dest, rate, at).is_ok() {
                sent += 1;
            }
        }
        sent
    }

    #[test]
    fn a_destination_limit_holds_and_others_run_free() {
        let mut l = limits(None, &[("slow", 50.0)]);
        let sent = sent_over_10s(&mut l, &["slow"]);
        assert!((495..=506).contains(&sent), "{sent}");
        assert_eq!(l.destination_rate("fast", None, 0), None);
        assert!(l.take("fast", None, Instant::now()).is_ok());
    }

    #[test]
    fn the_instance_limit_covers_every_destination() {
        let sent = sent_over_10s(&mut limits(Some(100.0), &[]), &["a", "b"]);
        assert!((995..=1_011).contains(&sent), "{sent}");
    }

    #[test]
    fn a_ramp_rises_from_a_trickle_to_the_limit_then_lifts() {
        let l = limits(None, &[("capped", 200.0)]);
        let ramp = Ramp {
            from: 0,
            until: 10_000,
        };
        assert_eq!(l.destination_rate("q", Some(&ramp), 0), Some(TRICKLE));
        let mid = l.destination_rate("q", Some(&ramp), 5_000).unwrap();
        assert!((mid - (RAMP_CEILING).sqrt()).abs() < 0.01, "{mid}");
        assert_eq!(l.destination_rate("q", Some(&ramp), 10_000), None);
        let near_end = l.destination_rate("capped", Some(&ramp), 9_999).unwrap();
        assert!(near_end <= 200.0 && near_end > 190.0, "{near_end}");
        assert_eq!(
            l.destination_rate("capped", Some(&ramp), 10_000),
            Some(200.0)
        );
    }

    #[test]
    fn a_ramp_never_raises_a_limit_below_the_trickle() {
        let l = limits(None, &[("slow", 0.1)]);
        let ramp = Ramp {
            from: 0,
            until: 10_000,
        };
        for at in [0, 5_000, 9_999] {
            let rate = l.destination_rate("slow", Some(&ramp), at);
            assert_eq!(rate, Some(0.1), "at {at} ms");
        }
    }

    #[test]
    fn a_ramp_stored_with_dates_at_the_ends_of_the_range_does_not_overflow() {
        let l = limits(None, &[]);
        let ramp = Ramp {
            from: i64::MIN,
            until: i64::MAX,
        };
        let rate = l.destination_rate("q", Some(&ramp), 0).unwrap();
        assert!((TRICKLE..=RAMP_CEILING).contains(&rate), "{rate}");
        let late = Ramp {
            from: i64::MIN,
            until: 10,
        };
        assert!(l.destination_rate("q", Some(&late), i64::MAX).is_none());
        assert!(l.destination_rate("q", Some(&late), 0).is_some());
    }
}
