//! The daemon task that keeps each instance obeying the control collection
//! ([`crate::operator::control`]): it reads the pauses and ramps every poll interval, and at once when
//! the collection's change stream (where the server has one) reports a write.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::operator::control::ControlState;
use crate::store::Store;
use crate::store::StoreError;
use crate::store::serverload::Pacing;

/// How long to wait before opening the control collection's change stream again.
const REOPEN_STREAM: Duration = Duration::from_secs(30);

/// Reads the control collection every `interval` until shutdown, and at once when its change
/// stream (where the server has one) reports a write, into `state`; logs
/// each change and signals `changed` (the dispatch loop's wake-up, so it applies the change
/// and claims at once).
pub async fn watch(
    store: Store,
    state: Arc<ControlState>,
    interval: Duration,
    changed: Arc<tokio::sync::Notify>,
    shutdown: CancellationToken,
) {
    let mut stream = None;
    let mut opened_at: Option<tokio::time::Instant> = None;
    // After a failed read, the next waits out its back-off ([`crate::store::serverload`]).
    let mut reading = Pacing::new(store.operation_timeout());
    loop {
        if reading.ready() {
            let result = read_once(&store, &state, &changed).await;
            reading.record(&result);
        }
        if stream.is_none() && opened_at.is_none_or(|t| t.elapsed() >= REOPEN_STREAM) {
            opened_at = Some(tokio::time::Instant::now());
            stream = store
                .bounded("watch the control collection", store.watch_control())
                .await
                .ok();
        }
        let next_write = async {
            match stream.as_mut() {
                Some(s) => futures::StreamExt::next(s).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            event = next_write => {
                if !matches!(event, Some(Ok(_))) {
                    stream = None;
                }
            }
            _ = shutdown.cancelled() => return,
        }
    }
}

async fn read_once(
    store: &Store,
    state: &ControlState,
    changed: &tokio::sync::Notify,
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
