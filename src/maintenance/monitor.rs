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
/// database and leave the gauges stale. The clock was read just before this starts, so the
/// first pass only reads the backlog.
pub async fn run(
    store: Store,
    shapes: Shapes,
    health: Arc<Health>,
    rate_limited: Vec<String>,
    shutdown: CancellationToken,
) {
    let parking = store.parking();
    let mut clock_read = Instant::now();
    // Each reading is paced on its own: after a failure it is skipped until its back-off has
    // passed, after a timeout until the abandoned run has ended on the server.
    let paced = || Pacing::new(store.operation_timeout());
    let (mut backlog, mut clock) = (paced(), paced());
    loop {
        if backlog.ready() {
            let at = Instant::now();
            let reading = Store::timed("backlog", async {
                let shapes = shapes.checked(MONITOR_INTERVAL)?;
                tokio::try_join!(
                    store.read_backlog(
                        &shapes,
                        crate::store::census::BACKLOG_COUNTED_UP_TO,
                        &rate_limited
                    ),
                    store.bounded("count parked records", parking.count())
                )
            });
            let reading = tokio::select! {
                r = reading => r,
                _ = shutdown.cancelled() => return,
            };
            backlog.record(&reading);
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
            .max(backlog.next_at().saturating_duration_since(Instant::now()))
            .max(MONITOR_MIN_WAIT);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.cancelled() => return,
        }
        if clock_read.elapsed() >= MONITOR_INTERVAL && clock.ready() {
            clock_read = Instant::now();
            let result = read_server_clock(&store, &health).await;
            if let Err(e) = &result {
                tracing::warn!(error = %e, "could not refresh the server clock offset");
            }
            clock.record(&result);
        }
    }
}

/// Re-reads the server clock; records the offset and whether MongoDB answered.
pub async fn read_server_clock(store: &Store, health: &Health) -> Result<i64, StoreError> {
    let result = store
        .bounded("read the server clock", store.refresh_clock())
        .await;
    health.set_up(m::MONGODB, result.is_ok());
    if let Ok(offset) = &result {
        m::clock_offset(*offset);
    }
    result
}
