//! The daemon task that keeps each instance obeying the control collection
//! ([`crate::operator::control`]): it reads the pauses and ramps every poll interval, and at once when
//! the collection's change stream (where the server has one; [`crate::store::follow`]) reports a
//! write.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::operator::control::ControlState;
use crate::store::Store;
use crate::store::StoreError;
use crate::store::follow::{Followed, follow};
use crate::store::pacing::Pacing;

const CONTROL: Followed = Followed {
    open: "watch the control collection",
    what: "the control collection",
    unavailable: "no change stream on the control collection: pauses and ramps are read every poll interval",
};

/// Reads the control collection every `interval` until shutdown, and at once when its change
/// stream (where the server has one) reports a write, into `state`; logs each change and
/// signals `changed` (the dispatch loop's control input, so it applies the change and claims
/// at once).
pub async fn run(
    store: Store,
    state: Arc<ControlState>,
    interval: Duration,
    changed: Arc<Notify>,
    shutdown: CancellationToken,
) {
    // A write reported by the change stream, or the stream lost (a write may have gone
    // unseen): read now rather than at the next interval.
    let written = Notify::new();
    let follower = follow(
        &store,
        CONTROL,
        |s| s.watch_control().boxed(),
        |_| written.notify_one(),
        &shutdown,
    );
    let reader = async {
        // After a failed read, the next waits out its back-off ([`crate::store::pacing`]).
        let mut reading = Pacing::new(store.operation_timeout());
        loop {
            if reading.ready() {
                let result = tokio::select! {
                    r = read_once(&store, &state, &changed) => r,
                    _ = shutdown.cancelled() => return,
                };
                reading.record(&result);
            }
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = written.notified() => {}
                _ = shutdown.cancelled() => return,
            }
        }
    };
    tokio::join!(follower, reader);
}

async fn read_once(
    store: &Store,
    state: &ControlState,
    changed: &Notify,
) -> Result<(), StoreError> {
    match store.bounded("read pauses", store.read_control()).await {
        Ok(next) => {
            let now_ms = store.clock().now().timestamp_millis();
            let longest = next
                .oldest_pause_ms
                .map_or(0.0, |t| now_ms.saturating_sub(t).max(0) as f64 / 1000.0);
            crate::metrics::pause_age(longest);
            let before = state.get();
            if state.set(next.clone()) {
                for d in next.paused.iter().filter(|d| !before.paused.contains(d)) {
                    tracing::warn!(destination = %d, "destination paused: not claiming its records");
                }
                for d in before.paused.iter().filter(|d| !next.paused.contains(d)) {
                    tracing::warn!(destination = %d, "destination resumed");
                }
                changed.notify_one();
            }
            Ok(())
        }
        Err(e) => {
            tracing::warn!(error = %e, "could not read pauses; keeping the last ones");
            Err(e)
        }
    }
}
