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
use crate::supervisor::{Supervisor, TaskFailed};
use crate::{http, reaper, systemd, wakeup};

/// How often the server clock offset and the backlog gauges are refreshed.
pub const MONITOR_INTERVAL: Duration = Duration::from_secs(15);

/// How long after `shutdown_timeout` the daemon waits for the dispatch loop's releases.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// What stops the daemon, other than a signal.
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
    #[error(transparent)]
    TaskFailed(#[from] TaskFailed),
}

/// Runs the daemon until `shutdown` is cancelled. Fails on what retrying cannot fix (an
/// invalid URI, an unacknowledged write concern, a port in use) and when an essential task
/// stops (see [`crate::supervisor`]).
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
    let store = Store::connect(&config.mongodb, clock)
        .await?
        .with_settings(&config);
    let publisher = Publisher::new(&config.rabbitmq)?;
    // Kept to close the client at the end, within a deadline, before the runtime goes.
    let client = store.clone();
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
    let mut tasks = Supervisor::new(shutdown.clone(), health.clone());
    let http_stop = CancellationToken::new();
    tasks.spawn_lasting(
        "http",
        ok(http::serve(
            listener,
            health.clone(),
            http::prometheus(),
            http_stop.clone(),
        )),
    );
    tracing::info!(%addr, "HTTP endpoints listening (/metrics, /healthz, /readyz)");
    tasks.spawn(
        "systemd",
        ok(systemd::run(health.clone(), shutdown.clone())),
    );
    on_listen(addr);
    tracing::info!(
        version = crate::buildinfo::VERSION,
        revision = crate::buildinfo::REVISION,
        built = crate::buildinfo::BUILD_DATE,
        instance = %crate::buildinfo::instance(),
        database = %config.mongodb.database,
        collection = %config.mongodb.collection,
        time_encoding = ?config.mongodb.time_encoding,
        "timeoutd starting"
    );

    let mut started = Ok(());
    if wait_for_mongodb(&store, &health, &shutdown).await {
        started = start(&config, store, publisher, &health, &shutdown, &mut tasks).await;
    }
    if started.is_err() {
        shutdown.cancel();
    }
    // The dispatch loop bounds its own wait by shutdown_timeout; the margin covers the
    // releases that follow.
    let drain = config.dispatch.shutdown_timeout + SHUTDOWN_GRACE;
    let supervised = tasks.watch(drain).await;
    // Tests only: keep answering 503 a while after a failure, so that a probe sees it.
    #[cfg(feature = "failpoints")]
    if supervised.is_err()
        && let Some(Some(ms)) = fail::eval("daemon-linger-after-failure", |arg| {
            arg.and_then(|a| a.parse::<u64>().ok())
        })
    {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    http_stop.cancel();
    tasks.finish(SHUTDOWN_GRACE).await;
    if !client.close(SHUTDOWN_GRACE).await {
        tracing::debug!("the MongoDB client did not close in time");
    }
    started?;
    supervised?;
    tracing::info!("timeoutd stopped");
    Ok(())
}

/// Creates the indexes and starts the tasks that need MongoDB.
async fn start(
    config: &Arc<Config>,
    store: Store,
    publisher: Publisher,
    health: &Arc<Health>,
    shutdown: &CancellationToken,
    tasks: &mut Supervisor,
) -> Result<(), DaemonError> {
    match store
        .bounded("check the deployment", store.durability_risks())
        .await
    {
        Ok(risks) => {
            for risk in risks {
                tracing::warn!(%risk, "MongoDB settings weaken the lease");
            }
        }
        Err(e) => tracing::warn!(error = %e, "could not check the MongoDB deployment's settings"),
    }
    store
        .bounded("create indexes", store.ensure_indexes())
        .await?;
    let parking = store.parking();
    if let Err(e) = store
        .bounded("create parking indexes", parking.ensure_indexes())
        .await
    {
        tracing::warn!(error = %e, "could not create the parking and attempts indexes; continuing");
    }
    tasks.spawn(
        "monitor",
        ok(monitor(store.clone(), health.clone(), shutdown.clone())),
    );
    tasks.spawn(
        "reaper",
        ok(reaper::run(
            store.clone(),
            config.reaper_interval(),
            shutdown.clone(),
        )),
    );
    if let Err(e) = store
        .bounded("create control indexes", store.ensure_control_indexes())
        .await
    {
        tracing::warn!(error = %e, "could not create the control collection's indexes; continuing");
    }
    let history = match config.history.is_on() {
        true => {
            if let Err(e) = store
                .bounded(
                    "create history indexes",
                    store.ensure_history_indexes(config.history.keep),
                )
                .await
            {
                tracing::warn!(error = %e, "could not create the history collection's indexes (its TTL among them); continuing");
            }
            let (sink, rows) = crate::history::channel();
            tasks.spawn("history", ok(crate::history::write(store.clone(), rows)));
            Some(sink)
        }
        false => None,
    };
    // Pauses in force before the first claim, so a starting instance claims none of them.
    match store.bounded("read pauses", store.read_control()).await {
        Ok(snapshot) => {
            store.control_state.set(snapshot);
        }
        Err(e) => {
            tracing::warn!(error = %e, "could not read pauses yet; the control watcher retries")
        }
    }
    let wake = Arc::new(tokio::sync::Notify::new());
    tasks.spawn(
        "control",
        ok(crate::controlwatch::watch(
            store.clone(),
            config.dispatch.poll_interval,
            wake.clone(),
            shutdown.clone(),
        )),
    );
    tasks.spawn(
        "wakeup",
        ok(wakeup::run(
            store.clone(),
            config.dispatch.look_ahead(),
            wake.clone(),
            shutdown.clone(),
        )),
    );
    let dispatcher = Dispatcher::new(
        config.clone(),
        store,
        publisher,
        health.clone(),
        shutdown.clone(),
        wake,
    )
    .with_history(history);
    tasks.spawn("dispatch", dispatcher.run());
    m::up(true);
    let (health, shutdown) = (health.clone(), shutdown.clone());
    tokio::spawn(async move {
        shutdown.cancelled().await;
        health.start_draining();
        systemd::stopping().await;
        tracing::info!("shutting down: no new claims; finishing or releasing what is held");
    });
    Ok(())
}

/// A task that cannot fail, as one the supervisor takes.
async fn ok(task: impl std::future::Future<Output = ()>) -> Result<(), std::convert::Infallible> {
    task.await;
    Ok(())
}

/// Re-reads the server clock; records the offset and whether MongoDB answered.
async fn read_server_clock(store: &Store, health: &Health) -> Result<i64, StoreError> {
    let result = store
        .bounded("read the server clock", store.refresh_clock())
        .await;
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
        let counts = Store::timed("backlog", async {
            tokio::try_join!(
                store.backlog(crate::census::BACKLOG_COUNTED_UP_TO),
                parking.count()
            )
        });
        match store.bounded("read the backlog", counts).await {
            Ok(((due, oldest), parked)) => {
                m::backlog(due, oldest);
                m::parked_records(parked);
            }
            Err(e) => tracing::debug!(error = %e, "backlog query failed"),
        }
        match store
            .bounded(
                "read the paused backlog",
                Store::timed("backlog", store.paused_backlogs(false)),
            )
            .await
        {
            Ok(paused) => m::paused_backlog(paused.iter().map(|(_, due, _)| due).sum()),
            Err(e) => tracing::debug!(error = %e, "paused backlog query failed"),
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
