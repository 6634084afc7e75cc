//! The monitor: keeps the backlog gauges and the server clock estimate fresh, and tells
//! [`crate::service::progress`] which record is the oldest unclaimed one.

use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use tokio_util::sync::CancellationToken;

use crate::metrics as m;
use crate::service::health::Health;
use crate::store::pacing::Pacing;
use crate::store::shapes::Shapes;
use crate::store::{Store, StoreError};

/// The shortest wait between two turns of the monitor, whatever asks for a sooner reading.
const MONITOR_MIN_WAIT: Duration = Duration::from_millis(10);

/// How often the server clock offset and the backlog gauges are refreshed.
pub const MONITOR_INTERVAL: Duration = Duration::from_secs(15);

/// Keeps the backlog gauges and the server clock estimate fresh, with one cheap set of
/// queries every [`MONITOR_INTERVAL`], independent of the poll rate, and tells
/// [`crate::service::progress`] which record is the oldest unclaimed one (reading again sooner while
/// one is suspected of being left unclaimed). The reading depends on nothing the claim path
/// keeps ([`crate::store::backlog`]). Each of its queries is bounded by `operation_timeout`, not the
/// whole reading by one deadline: an outer deadline would drop the reading halfway on a slow
/// database and leave the gauges stale. The two readings run side by side, each paced on its
/// own: the clock is never read later because the backlog's queries are slow or failing
/// (found in review: it waited behind them and their back-off, read every 50 s instead of 15,
/// and a step back of the server's clock went unseen that much longer). The clock was read
/// just before this starts, so its first reading is one interval later.
pub async fn run(
    store: Store,
    shapes: Shapes,
    health: Arc<Health>,
    rate_limited: Vec<String>,
    shutdown: CancellationToken,
) {
    tokio::select! {
        () = backlog(&store, &shapes, &health, &rate_limited) => {}
        () = clock(&store, &health) => {}
        () = shutdown.cancelled() => {}
    }
}

/// Reads the backlog gauges, again and again, never sooner than its pacing allows.
async fn backlog(store: &Store, shapes: &Shapes, health: &Health, rate_limited: &[String]) {
    let parking = store.parking();
    // After a failure the reading is skipped until its back-off has passed, after a timeout
    // until the abandoned run has ended on the server.
    let mut pacing = Pacing::new(store.operation_timeout());
    loop {
        if pacing.ready() {
            let at = Instant::now();
            let reading = Store::timed("backlog", async {
                let shapes = shapes.checked(MONITOR_INTERVAL)?;
                tokio::try_join!(
                    store.read_backlog(
                        &shapes,
                        crate::store::census::BACKLOG_COUNTED_UP_TO,
                        rate_limited
                    ),
                    store.bounded("count parked records", parking.count())
                )
            })
            .await;
            pacing.record(&reading);
            match reading {
                Ok((r, parked)) => {
                    m::backlog(r.due, r.oldest_due_age_seconds);
                    m::paused_backlog(r.paused_due);
                    m::parked_records(parked);
                    let oldest = r.oldest_unclaimed.as_ref();
                    let oldest = oldest.map(|(id, due)| (id, due.timestamp_millis()));
                    health.progress().observed(at, oldest);
                    m::due_unclaimed(health.progress().unclaimed_for());
                }
                Err(e) => tracing::debug!(error = %e, "backlog query failed"),
            }
        }
        // Never sooner than the backlog query's pacing allows: a reading due now while a
        // failed query waits out its back-off made this loop spin without a wait (found by
        // the simulation, issue 25: seeds 42 and 65 hung a core, the clock never advancing).
        let wait = health
            .progress()
            .next_reading_in()
            .map_or(MONITOR_INTERVAL, |d| d.min(MONITOR_INTERVAL))
            .max(pacing.next_at().saturating_duration_since(Instant::now()))
            .max(MONITOR_MIN_WAIT);
        tokio::time::sleep(wait).await;
    }
}

/// Reads the server clock every [`MONITOR_INTERVAL`], or later while its pacing says so.
async fn clock(store: &Store, health: &Health) {
    let mut pacing = Pacing::new(store.operation_timeout());
    loop {
        let next = pacing.next_at().max(Instant::now() + MONITOR_INTERVAL);
        tokio::time::sleep_until(next).await;
        if !pacing.ready() {
            continue;
        }
        let result = read_server_clock(store, health).await;
        if let Err(e) = &result {
            tracing::warn!(error = %e, "could not refresh the server clock offset");
        }
        pacing.record(&result);
    }
}

/// Re-reads the server clock; records the offset and whether MongoDB answered.
pub async fn read_server_clock(store: &Store, health: &Health) -> Result<i64, StoreError> {
    let result = store.refresh_clock().await;
    health.set_up(m::MONGODB, result.is_ok());
    if let Ok(offset) = &result {
        m::clock_offset(*offset);
    }
    result
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;

    /// A server that answers each `hello` in 400 ms, with `operation_timeout` at 1 s, has its
    /// clock read: the three `hello`s of a reading shared one deadline, so such a server was
    /// never read again, and an instance went on from a reading taken before the server's
    /// clock stepped back, publishing 2.5 s early (the simulation's `early`, seed 24656).
    #[tokio::test(start_paused = true)]
    async fn a_slow_server_has_its_clock_read() {
        use crate::store::backend::{Answer, Answering, Op, Reply};
        let config = crate::config::MongoConfig {
            operation_timeout: Duration::from_secs(1),
            ..Default::default()
        };
        let server_ms = 1_800_000_000_000;
        let hello = move |_: bson::Document| {
            let reply = bson::doc! { "ok": 1, "localTime": bson::DateTime::from_millis(server_ms) };
            Answer::After(Duration::from_millis(400), Ok(reply))
        };
        let ops = |_: Op| Answer::Now(Ok(Reply::Docs(Vec::new())));
        let store = Store::with_backend(
            Arc::new(Answering(ops, hello)),
            &config,
            crate::store::clock::ServerClock::default(),
        );
        let health = Health::new(Duration::from_secs(1));
        let read = read_server_clock(&store, &health).await;
        assert!(read.is_ok(), "{read:?}");
        let now = store.clock().now().timestamp_millis();
        assert!((server_ms..server_ms + 1_000).contains(&now), "{now}");
    }

    /// A server whose backlog queries never answer still has its clock read every
    /// [`MONITOR_INTERVAL`]. The clock was read after the backlog's reading and its back-off:
    /// every 50 s here, not every 15 s.
    #[tokio::test(start_paused = true)]
    async fn the_clock_is_read_on_time_while_the_backlog_queries_hang() {
        use crate::store::backend::{Answer, Answering, Op, Reply};
        use std::sync::atomic::AtomicUsize;
        let hellos = Arc::new(AtomicUsize::new(0));
        let counted = hellos.clone();
        let hello = move |_: bson::Document| {
            counted.fetch_add(1, Ordering::SeqCst);
            let reply =
                bson::doc! { "ok": 1, "localTime": bson::DateTime::from_millis(1_800_000_000_000) };
            Answer::Now(Ok(reply))
        };
        let ops = |_: Op| Answer::<Reply>::Never;
        let store = Store::with_backend(
            Arc::new(Answering(ops, hello)),
            &crate::config::MongoConfig::default(),
            crate::store::clock::ServerClock::default(),
        );
        let shapes = Shapes::Fixed(vec![crate::record::due::Shape::Date]);
        let health = Arc::new(Health::new(Duration::from_secs(1)));
        let stop = CancellationToken::new();
        let task = crate::host::spawn(run(store, shapes, health, Vec::new(), stop.clone()));
        tokio::time::sleep(Duration::from_secs(600)).await;
        let before = hellos.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(300)).await;
        let read = hellos.load(Ordering::SeqCst) - before;
        stop.cancel();
        task.await.expect("the monitor ends at shutdown");
        // A reading is three `hello`s; one every 15 s is 20 readings in 300 s (it was 6).
        let readings = read / 3;
        assert!(readings >= 19, "{readings} clock readings in 300 s");
    }

    /// A shutdown while the server clock is read from a server that does not answer ends the
    /// monitor at once, not at the read's deadline (`operation_timeout`).
    #[tokio::test(start_paused = true)]
    async fn a_shutdown_during_a_clock_reading_ends_the_monitor_at_once() {
        let (silent, store) = Store::silent();
        // No learner runs: every backlog reading fails at once, without a call, so the first
        // call is the clock reading, one MONITOR_INTERVAL after the start.
        let (_, shapes) = crate::store::shapes::learner(&store);
        let health = Arc::new(Health::new(Duration::from_secs(1)));
        let stop = CancellationToken::new();
        let task = crate::host::spawn(run(store.clone(), shapes, health, Vec::new(), stop.clone()));
        while silent.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let stopped = Instant::now();
        stop.cancel();
        task.await.expect("the monitor ends at shutdown");
        // The call began at most 100 ms before the shutdown: waiting for its deadline would
        // take most of an operation_timeout more.
        assert!(
            stopped.elapsed() < store.operation_timeout() / 2,
            "the monitor waited {:?} for the server clock after the shutdown",
            stopped.elapsed()
        );
    }
}
