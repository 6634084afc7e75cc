//! The reaper: every `[reaper] interval` (a quarter of the lease by default), frees the
//! records whose lease has expired, so that a crashed or stalled instance's claims become
//! claimable again.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::metrics as m;
use crate::store::Store;

/// Runs until `shutdown` is cancelled.
pub async fn run(store: Store, interval: Duration, shutdown: CancellationToken) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = ticker.tick() => {}
        }
        match store.reap().await {
            Ok(0) => {}
            Ok(n) => {
                m::reaped(n);
                tracing::info!(freed = n, "reaper freed expired leases");
            }
            Err(e) => tracing::warn!(error = %e, "reaper pass failed; trying again next interval"),
        }
    }
}
