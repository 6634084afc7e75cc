//! `timeoutd run`: wires the store, the publisher, the dispatch loop, the reaper and the clock
//! refresher together, one task per concern, and stops them all when the shutdown token is
//! cancelled.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::clock::ServerClock;
use crate::config::Config;
use crate::dispatch::Dispatcher;
use crate::metrics as m;
use crate::publisher::Publisher;
use crate::reaper;
use crate::store::{Store, StoreError};

/// How often the server clock offset is re-estimated.
pub const CLOCK_REFRESH: Duration = Duration::from_secs(30);

/// Runs the daemon until `shutdown` is cancelled. Fails only on what retrying cannot fix
/// (an invalid URI, an unacknowledged write concern).
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), StoreError> {
    run_with_clock(config, ServerClock::default(), shutdown).await
}

/// [`run`] with a given clock (tests inject a skewed host clock).
pub async fn run_with_clock(
    config: Config,
    clock: ServerClock,
    shutdown: CancellationToken,
) -> Result<(), StoreError> {
    let config = Arc::new(config);
    let store = Store::connect(&config.mongodb, clock).await?;
    tracing::info!(
        database = %config.mongodb.database,
        collection = %config.mongodb.collection,
        time_encoding = ?config.mongodb.time_encoding,
        "timeoutd starting"
    );
    if !wait_for_mongodb(&store, &shutdown).await {
        return Ok(());
    }
    store.ensure_indexes().await?;

    let clock_task = tokio::spawn(refresh_clock(store.clone(), shutdown.clone()));
    let reaper_task = tokio::spawn(reaper::run(
        store.clone(),
        config.reaper_interval(),
        shutdown.clone(),
    ));
    let publisher = Publisher::new(&config.rabbitmq.uri, &config.rabbitmq.source_address);
    let dispatcher = Dispatcher::new(config.clone(), store, publisher, shutdown.clone());
    let dispatch_task = tokio::spawn(dispatcher.run());

    shutdown.cancelled().await;
    tracing::info!(
        timeout = ?config.dispatch.shutdown_timeout,
        "shutting down: no new claims; finishing or releasing what is held"
    );
    // The dispatch loop bounds its own wait by shutdown_timeout; the margin covers the
    // releases that follow.
    let grace = config.dispatch.shutdown_timeout + Duration::from_secs(5);
    if tokio::time::timeout(grace, dispatch_task).await.is_err() {
        tracing::warn!("dispatch loop did not stop in time; its leases will expire");
    }
    let _ = tokio::join!(clock_task, reaper_task);
    tracing::info!("timeoutd stopped");
    Ok(())
}

/// Retries the first round trip to MongoDB with back-off. `false` if shutdown came first.
async fn wait_for_mongodb(store: &Store, shutdown: &CancellationToken) -> bool {
    let mut backoff = Backoff::reconnect();
    loop {
        match store.refresh_clock().await {
            Ok(offset) => {
                m::dependency_up(m::MONGODB, true);
                m::clock_offset(offset);
                tracing::info!(clock_offset_ms = offset, "MongoDB reachable");
                return true;
            }
            Err(e) => {
                m::dependency_up(m::MONGODB, false);
                let wait = backoff.next_delay();
                tracing::warn!(error = %e, retry_in = ?wait, "MongoDB unreachable");
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = shutdown.cancelled() => return false,
                }
            }
        }
    }
}

/// Keeps the server clock estimate fresh.
async fn refresh_clock(store: Store, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(CLOCK_REFRESH) => {}
            _ = shutdown.cancelled() => return,
        }
        match store.refresh_clock().await {
            Ok(offset) => m::clock_offset(offset),
            Err(e) => tracing::warn!(error = %e, "could not refresh the server clock offset"),
        }
    }
}
