//! `timeoutd run`: wires the store, the publisher, the dispatch loop, the reaper, the monitor
//! (server clock and backlog gauges), the insert watcher (wake-ups), systemd notifications and
//! the HTTP endpoints together, one task per concern,
//! and stops them all when the shutdown token is cancelled.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::clock::ServerClock;
use crate::config::Config;
use crate::dispatch::Dispatcher;
use crate::health::Health;
use crate::metrics as m;
use crate::publisher::Publisher;
use crate::store::{Store, StoreError};
use crate::{http, reaper, systemd, wakeup};

/// How often the server clock offset and the backlog gauges are refreshed.
pub const MONITOR_INTERVAL: Duration = Duration::from_secs(15);

/// How long after `shutdown_timeout` the daemon waits for the dispatch loop's releases.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// What stops the daemon from starting.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Publish(#[from] crate::publisher::PublishError),
    #[error("cannot listen on http.listen {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Runs the daemon until `shutdown` is cancelled. Fails only on what retrying cannot fix
/// (an invalid URI, an unacknowledged write concern, a port in use).
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), DaemonError> {
    run_with(config, ServerClock::default(), shutdown, |_| {}).await
}

/// [`run`] with a given clock (tests inject a skewed host clock) and a callback told the
/// address the HTTP endpoints listen on.
pub async fn run_with(
    config: Config,
    clock: ServerClock,
    shutdown: CancellationToken,
    on_listen: impl FnOnce(SocketAddr),
) -> Result<(), DaemonError> {
    let config = Arc::new(config);
    let store = Store::connect(&config.mongodb, clock).await?;
    let publisher = Publisher::new(&config.rabbitmq)?;
    // Installed before anything records a metric.
    let _ = http::prometheus();
    let health = Arc::new(Health::new(config.dispatch.poll_interval));
    let (listener, addr) =
        http::bind(config.http.listen)
            .await
            .map_err(|source| DaemonError::Listen {
                addr: config.http.listen,
                source,
            })?;
    let http_stop = CancellationToken::new();
    let http_task = tokio::spawn(http::serve(
        listener,
        health.clone(),
        http::prometheus(),
        http_stop.clone(),
    ));
    tracing::info!(%addr, "HTTP endpoints listening (/metrics, /healthz, /readyz)");
    let notify_task = tokio::spawn(systemd::run(health.clone(), shutdown.clone()));
    on_listen(addr);
    tracing::info!(
        database = %config.mongodb.database,
        collection = %config.mongodb.collection,
        time_encoding = ?config.mongodb.time_encoding,
        "timeoutd starting"
    );

    if wait_for_mongodb(&store, &health, &shutdown).await {
        store.ensure_indexes().await?;
        if let Err(e) = store.parking().ensure_indexes().await {
            tracing::warn!(error = %e, "could not create the parking and attempts indexes; continuing");
        }
        let monitor_task = tokio::spawn(monitor(store.clone(), health.clone(), shutdown.clone()));
        let reaper_task = tokio::spawn(reaper::run(
            store.clone(),
            config.reaper_interval(),
            shutdown.clone(),
        ));
        let wake = Arc::new(tokio::sync::Notify::new());
        let wakeup_task = tokio::spawn(wakeup::run(
            store.clone(),
            config.dispatch.look_ahead(),
            wake.clone(),
            shutdown.clone(),
        ));
        let dispatcher = Dispatcher::new(
            config.clone(),
            store,
            publisher,
            health.clone(),
            shutdown.clone(),
            wake,
        );
        let dispatch_task = tokio::spawn(dispatcher.run());

        shutdown.cancelled().await;
        health.start_draining();
        systemd::stopping();
        tracing::info!(
            timeout = ?config.dispatch.shutdown_timeout,
            "shutting down: no new claims; finishing or releasing what is held"
        );
        // The dispatch loop bounds its own wait by shutdown_timeout; the margin covers the
        // releases that follow.
        let grace = config.dispatch.shutdown_timeout + SHUTDOWN_GRACE;
        if tokio::time::timeout(grace, dispatch_task).await.is_err() {
            tracing::warn!("dispatch loop did not stop in time; its leases will expire");
        }
        let _ = tokio::join!(monitor_task, reaper_task, wakeup_task);
    }
    http_stop.cancel();
    let _ = tokio::join!(http_task, notify_task);
    tracing::info!("timeoutd stopped");
    Ok(())
}

/// Re-reads the server clock; records the offset and whether MongoDB answered.
async fn read_server_clock(store: &Store, health: &Health) -> Result<i64, StoreError> {
    let result = store.refresh_clock().await;
    health.set_up(m::MONGODB, result.is_ok());
    if let Ok(offset) = &result {
        m::clock_offset(*offset);
    }
    result
}

/// Retries the first round trip to MongoDB with back-off. `false` if shutdown came first.
async fn wait_for_mongodb(store: &Store, health: &Health, shutdown: &CancellationToken) -> bool {
    let mut backoff = Backoff::reconnect();
    loop {
        match read_server_clock(store, health).await {
            Ok(offset) => {
                tracing::info!(clock_offset_ms = offset, "MongoDB reachable");
                return true;
            }
            Err(e) => {
                let wait = backoff.next_delay();
                tracing::warn!(error = %e, retry_in = ?wait, "MongoDB unreachable");
                health.waiting(wait);
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = shutdown.cancelled() => return false,
                }
            }
        }
    }
}

/// Keeps the backlog gauges and the server clock estimate fresh, with one cheap set of
/// queries every [`MONITOR_INTERVAL`], independent of the poll rate. The clock was read just
/// before this starts, so the first pass only reads the backlog.
async fn monitor(store: Store, health: Arc<Health>, shutdown: CancellationToken) {
    let parking = store.parking();
    loop {
        match tokio::try_join!(store.backlog(), parking.count()) {
            Ok(((due, oldest), parked)) => {
                m::backlog(due, oldest);
                m::parked_records(parked);
            }
            Err(e) => tracing::debug!(error = %e, "backlog query failed"),
        }
        tokio::select! {
            _ = tokio::time::sleep(MONITOR_INTERVAL) => {}
            _ = shutdown.cancelled() => return,
        }
        if let Err(e) = read_server_clock(&store, &health).await {
            tracing::warn!(error = %e, "could not refresh the server clock offset");
        }
    }
}
