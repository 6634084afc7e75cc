//! Wake-ups: a change stream on the timeouts collection tells the dispatch loop when a record
//! is inserted due within the look-ahead, so that it is claimed and fired on time instead of
//! at the next poll. Where the server offers no change streams (a standalone MongoDB), this
//! task says so once and polling alone serves.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::record::TimeoutRecord;
use crate::store::Store;

/// How long to wait before opening the change stream again after it failed.
const RETRY: Duration = Duration::from_secs(30);

/// Watches inserts until shutdown; signals `wake` for each record due within `look_ahead`.
pub async fn run(
    store: Store,
    look_ahead: Duration,
    wake: Arc<Notify>,
    shutdown: CancellationToken,
) {
    let mut told = false;
    let mut opening = crate::store::serverload::Pacing::new(store.operation_timeout());
    while !shutdown.is_cancelled() {
        let mut retry = RETRY;
        match store
            .bounded("open the change stream", store.watch_inserts())
            .await
        {
            Ok(mut stream) => {
                opening.record(&Ok::<(), crate::store::StoreError>(()));
                tracing::debug!("watching inserts (change stream)");
                told = false;
                loop {
                    let event = tokio::select! {
                        e = stream.next() => e,
                        _ = shutdown.cancelled() => return,
                    };
                    match event {
                        Some(Ok(event)) => {
                            let due = event
                                .get_document("fullDocument")
                                .ok()
                                .and_then(|d| TimeoutRecord::decode_due(d, store.encoding()));
                            let soon = crate::store::lease::add(store.clock().now(), look_ahead);
                            if due.is_some_and(|due| due <= soon) {
                                wake.notify_one();
                            }
                        }
                        Some(Err(e)) => {
                            tracing::warn!(error = %e, "change stream failed; reopening");
                            break;
                        }
                        None => break,
                    }
                }
            }
            Err(e) => {
                retry = retry.max(opening.failed(&e));
                if !told {
                    tracing::info!(error = %e, "no change stream on the timeouts collection: records inserted due sooner than the next poll fire at that poll");
                    told = true;
                } else {
                    tracing::debug!(error = %e, "change stream still unavailable");
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(retry) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}
