//! Capped exponential back-off with jitter, for reconnecting and retrying.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

/// Delays that grow from a base to a cap, each with random jitter; never runs out.
#[derive(Debug)]
pub struct Backoff {
    builder: ExponentialBuilder,
    current: ExponentialBackoff,
    cap: Duration,
}

impl Backoff {
    /// From `base` doubling up to `cap`, with jitter.
    pub fn new(base: Duration, cap: Duration) -> Self {
        let builder = ExponentialBuilder::new()
            .with_min_delay(base)
            .with_max_delay(cap)
            .with_factor(2.0)
            .with_jitter()
            .with_jitter_seed(crate::host::random_range(0..u64::MAX))
            .without_max_times();
        Self {
            current: builder.build(),
            builder,
            cap,
        }
    }

    /// The schedule for reconnecting to MongoDB or RabbitMQ: 100 ms doubling to 10 s.
    pub fn reconnect() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(10))
    }

    /// The next delay.
    pub fn next_delay(&mut self) -> Duration {
        self.current.next().unwrap_or(self.cap).min(self.cap)
    }

    /// Starts again from the base after a success.
    pub fn reset(&mut self) {
        self.current = self.builder.build();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_to_the_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(10), Duration::from_millis(100));
        let first = b.next_delay();
        assert!(first >= Duration::from_millis(10) && first <= Duration::from_millis(20));
        let later: Vec<_> = (0..20).map(|_| b.next_delay()).collect();
        assert!(later.iter().all(|d| *d <= Duration::from_millis(100)));
        assert!(later.last().unwrap() >= &Duration::from_millis(50));
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(20));
    }
}
