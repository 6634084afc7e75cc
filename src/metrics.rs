//! Metric names and the small functions that record them, through the `metrics` facade.
//! Recording is a no-op until an exporter is installed. [`SERIES`] is the one list of every
//! series, its HELP text and its known label values; [`describe_all`] gives each its HELP line
//! and registers every counter, histogram and known label value at zero, so a scrape shows
//! them before their first event (Prometheus's `increase()` needs the zero to see the first).

use std::time::Duration;

use bson::DateTime;
use metrics::Unit;

pub const MONGODB: &str = "mongodb";
pub const RABBITMQ: &str = "rabbitmq";

/// `timeoutd_skipped_total{reason}`.
pub const SKIPPED_REASONS: &[&str] = &[
    "undecodable",
    "empty_destination",
    "margin",
    "unsendable",
    "paused",
];
/// `timeoutd_parked_total{reason}`.
pub const PARKED_REASONS: &[&str] = &[
    "undecodable",
    "empty_destination",
    "unroutable",
    "nacked",
    "unsendable",
];
/// `timeoutd_released_total{reason}`.
pub const RELEASED_REASONS: &[&str] = &[
    "shutdown",
    "margin",
    "publish_failed",
    "supervisor",
    "paused",
];
/// `timeoutd_held_back_total{reason}`.
pub const HELD_BACK_REASONS: &[&str] = &["paused", "rate_limit"];
/// `timeoutd_publish_failures_total{reason}`.
pub const PUBLISH_FAILURE_REASONS: &[&str] = &["returned", "nacked", "timeout", "connection"];
/// `timeoutd_dependency_up{dependency}`.
pub const DEPENDENCIES: &[&str] = &[MONGODB, RABBITMQ];
/// `timeoutd_mongodb_call_seconds{call}`: the dispatch path's calls, one per lease step, then
/// the background ones (the monitor's backlog gauges, the census, the reaper's pass and the
/// `Time` shape probe).
pub const MONGODB_CALLS: &[&str] = &[
    "find",
    "claim",
    "read_back",
    "remove",
    "release",
    "backlog",
    "census",
    "reap",
    "shapes",
];
/// The background entries of [`MONGODB_CALLS`]: what the database spends on timeoutd besides
/// the lease protocol's own calls.
pub const BACKGROUND_CALLS: &[&str] = &["backlog", "census", "reap", "shapes"];
/// `timeoutd_task_failures_total{task}`: the daemon's supervised tasks.
pub const TASKS: &[&str] = &[
    "dispatch", "reaper", "monitor", "wakeup", "http", "systemd", "control", "history",
];
/// `timeoutd_history_lost_total{reason}`.
pub const HISTORY_LOST_REASONS: &[&str] = &["write_failed", "backlog"];

/// A series' Prometheus type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// How a series is registered before its first value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// At zero, once per known label value (or once without labels).
    Zero,
    /// Only described: the gauge appears with its first reading, since a zero before it
    /// would be a false reading (backlog, clock offset), or it is set at start-up anyway.
    FirstReading,
}

/// One series: name, type, unit, HELP text, and its label with the known values.
#[derive(Debug, Clone, Copy)]
pub struct Series {
    pub name: &'static str,
    pub kind: Kind,
    pub unit: Option<Unit>,
    pub help: &'static str,
    pub label: Option<(&'static str, &'static [&'static str])>,
    pub start: Start,
}

const fn series(name: &'static str, kind: Kind, unit: Option<Unit>, help: &'static str) -> Series {
    let start = match kind {
        Kind::Gauge => Start::FirstReading,
        _ => Start::Zero,
    };
    Series {
        name,
        kind,
        unit,
        help,
        label: None,
        start,
    }
}

const fn labelled(
    s: Series,
    label: &'static str,
    values: &'static [&'static str],
    start: Start,
) -> Series {
    Series {
        label: Some((label, values)),
        start,
        ..s
    }
}

use Kind::{Counter, Gauge, Histogram};

/// Every series timeoutd exports, in the order of the README's metrics table.
pub const SERIES: &[Series] = &[
    series(
        "timeoutd_claimed_total",
        Counter,
        Some(Unit::Count),
        "Records this instance claimed (leased) for dispatch.",
    ),
    series(
        "timeoutd_dispatched_total",
        Counter,
        Some(Unit::Count),
        "Timeout messages the broker confirmed.",
    ),
    series(
        "timeoutd_removed_total",
        Counter,
        Some(Unit::Count),
        "Records deleted from Timeouts after a confirmed publish.",
    ),
    labelled(
        series(
            "timeoutd_publish_failures_total",
            Counter,
            Some(Unit::Count),
            "Publishes that failed, by reason (returned: no queue bound to the destination).",
        ),
        "reason",
        PUBLISH_FAILURE_REASONS,
        Start::Zero,
    ),
    labelled(
        series(
            "timeoutd_released_total",
            Counter,
            Some(Unit::Count),
            "Leased records given back unsent, by reason.",
        ),
        "reason",
        RELEASED_REASONS,
        Start::Zero,
    ),
    series(
        "timeoutd_lease_lost_total",
        Counter,
        Some(Unit::Count),
        "Guarded deletes or releases that matched nothing because the lease had passed to another owner: a possible duplicate delivery.",
    ),
    series(
        "timeoutd_reaped_total",
        Counter,
        Some(Unit::Count),
        "Expired leases the reaper freed.",
    ),
    labelled(
        series(
            "timeoutd_skipped_total",
            Counter,
            Some(Unit::Count),
            "Claimed records not sent this time, by reason.",
        ),
        "reason",
        SKIPPED_REASONS,
        Start::Zero,
    ),
    series(
        "timeoutd_retries_total",
        Counter,
        Some(Unit::Count),
        "Refused sends scheduled for another attempt after back-off.",
    ),
    labelled(
        series(
            "timeoutd_parked_total",
            Counter,
            Some(Unit::Count),
            "Records moved to the parking collection, by reason.",
        ),
        "reason",
        PARKED_REASONS,
        Start::Zero,
    ),
    series(
        "timeoutd_parked_records",
        Gauge,
        Some(Unit::Count),
        "Records in the parking collection at the last monitor reading.",
    ),
    series(
        "timeoutd_dispatch_lateness_seconds",
        Histogram,
        Some(Unit::Seconds),
        "Broker confirm time minus due time of each dispatched record, on the database server clock.",
    ),
    series(
        "timeoutd_claim_duration_seconds",
        Histogram,
        Some(Unit::Seconds),
        "Duration of each claim of a batch in MongoDB.",
    ),
    labelled(
        series(
            "timeoutd_mongodb_call_seconds",
            Histogram,
            Some(Unit::Seconds),
            "Duration of each MongoDB call, by lease step: find (the candidate read), claim (the compare-and-swap updateMany), read_back, remove (the guarded deleteMany) and release; and in the background: backlog (the monitor's gauges), census, reap (the reaper's pass) and shapes (learning and probing the Time shapes).",
        ),
        "call",
        MONGODB_CALLS,
        Start::Zero,
    ),
    series(
        "timeoutd_publish_confirm_seconds",
        Histogram,
        Some(Unit::Seconds),
        "Duration from publishing a batch to the broker's last confirm.",
    ),
    series(
        "timeoutd_due_backlog",
        Gauge,
        Some(Unit::Count),
        "Due and claimable records at the last monitor reading, counted up to 10000 (a bigger backlog reads 10000; timeoutd stats counts them all).",
    ),
    series(
        "timeoutd_oldest_due_age_seconds",
        Gauge,
        Some(Unit::Seconds),
        "Age of the oldest due and claimable record at the last monitor reading; 0 when none is due.",
    ),
    series(
        "timeoutd_leases_held",
        Gauge,
        Some(Unit::Count),
        "Records this instance holds leased now.",
    ),
    series(
        "timeoutd_clock_offset_seconds",
        Gauge,
        Some(Unit::Seconds),
        "Database server clock minus this host's clock at the last monitor reading.",
    ),
    labelled(
        series(
            "timeoutd_dependency_up",
            Gauge,
            None,
            "Whether the dependency answered at its last use: 1 up, 0 down.",
        ),
        "dependency",
        DEPENDENCIES,
        Start::Zero,
    ),
    labelled(
        series(
            "timeoutd_task_failures_total",
            Counter,
            Some(Unit::Count),
            "Essential tasks that stopped or panicked while the daemon was not shutting down, by task; the process then exits 1 to be restarted.",
        ),
        "task",
        TASKS,
        Start::Zero,
    ),
    series(
        "timeoutd_ready",
        Gauge,
        None,
        "1 while /readyz answers 200 (MongoDB and RabbitMQ answer, not draining), else 0; read at each scrape.",
    ),
    series(
        "timeoutd_up",
        Gauge,
        None,
        "1 while the daemon runs its tasks; 0 once one has stopped and the daemon is exiting.",
    ),
    series(
        "timeoutd_stuck_locks_freed_total",
        Counter,
        Some(Unit::Count),
        "Records locked without a lease expiry (left by another dispatcher) that the reaper freed.",
    ),
    series(
        "timeoutd_unschedulable_records",
        Gauge,
        None,
        "Records whose Time no branch of the due query matches, at the last census.",
    ),
    series(
        "timeoutd_stuck_locks",
        Gauge,
        None,
        "Records locked without a lease expiry, at the last census.",
    ),
    series(
        "timeoutd_build_info",
        Gauge,
        None,
        "Always 1; the version and revision (git commit, or unknown) labels name the running build.",
    ),
    Series {
        start: Start::Zero,
        ..series(
            "timeoutd_paused_destinations",
            Gauge,
            None,
            "Destinations paused fleet-wide (timeoutd pause), as this instance applies them now.",
        )
    },
    Series {
        start: Start::Zero,
        ..series(
            "timeoutd_longest_pause_seconds",
            Gauge,
            Some(Unit::Seconds),
            "How long the oldest pause in force has lasted; 0 when no destination is paused.",
        )
    },
    Series {
        start: Start::Zero,
        ..series(
            "timeoutd_paused_backlog",
            Gauge,
            None,
            "Records of paused destinations due now (held back by the pause), at the last monitor reading.",
        )
    },
    labelled(
        series(
            "timeoutd_held_back_total",
            Counter,
            Some(Unit::Count),
            "Claimed records not sent when due, by reason: paused (released unsent), rate_limit (each wait for a send-rate token).",
        ),
        "reason",
        HELD_BACK_REASONS,
        Start::Zero,
    ),
    series(
        "timeoutd_history_written_total",
        Counter,
        Some(Unit::Count),
        "History rows written ([history] keep): fired, parked and cancelled timeouts.",
    ),
    labelled(
        series(
            "timeoutd_history_lost_total",
            Counter,
            Some(Unit::Count),
            "History rows not written, by reason: write_failed (the write failed or timed out), backlog (the writer was too far behind); the timeouts themselves were unaffected.",
        ),
        "reason",
        HISTORY_LOST_REASONS,
        Start::Zero,
    ),
];

/// Gives every series its HELP text and registers the counters, histograms and known label
/// values at zero. Call once, after the recorder is installed and before anything records.
pub fn describe_all() {
    for s in SERIES {
        let unit = s.unit.unwrap_or(Unit::Count);
        match s.kind {
            Kind::Counter => metrics::describe_counter!(s.name, unit, s.help),
            Kind::Gauge => metrics::describe_gauge!(s.name, unit, s.help),
            Kind::Histogram => metrics::describe_histogram!(s.name, unit, s.help),
        }
        if s.start != Start::Zero {
            continue;
        }
        match s.label {
            None => register_zero(s.kind, s.name, Vec::new()),
            Some((label, values)) => {
                for value in values {
                    register_zero(s.kind, s.name, vec![metrics::Label::new(label, *value)]);
                }
            }
        }
    }
}

fn register_zero(kind: Kind, name: &'static str, labels: Vec<metrics::Label>) {
    match kind {
        Kind::Counter => metrics::counter!(name, labels).increment(0),
        // Registered: rendered with empty buckets until the first observation.
        Kind::Histogram => {
            let _ = metrics::histogram!(name, labels);
        }
        Kind::Gauge => metrics::gauge!(name, labels).set(0.0),
    }
}

pub fn claimed(n: usize) {
    metrics::counter!("timeoutd_claimed_total").increment(n as u64);
}

/// A confirmed publish of a record due at `due`, confirmed at `confirmed_at` (server clock).
pub fn dispatched(due: DateTime, confirmed_at: DateTime) {
    metrics::counter!("timeoutd_dispatched_total").increment(1);
    let late_ms = confirmed_at
        .timestamp_millis()
        .saturating_sub(due.timestamp_millis())
        .max(0);
    metrics::histogram!("timeoutd_dispatch_lateness_seconds").record(late_ms as f64 / 1000.0);
}

pub fn removed(n: usize) {
    metrics::counter!("timeoutd_removed_total").increment(n as u64);
}

pub fn publish_failure(reason: &'static str) {
    metrics::counter!("timeoutd_publish_failures_total", "reason" => reason).increment(1);
}

pub fn released(reason: &'static str, n: usize) {
    metrics::counter!("timeoutd_released_total", "reason" => reason).increment(n as u64);
}

pub fn lease_lost(n: usize) {
    metrics::counter!("timeoutd_lease_lost_total").increment(n as u64);
}

pub fn reaped(n: u64) {
    metrics::counter!("timeoutd_reaped_total").increment(n);
}

pub fn skipped(reason: &'static str, n: usize) {
    metrics::counter!("timeoutd_skipped_total", "reason" => reason).increment(n as u64);
}

/// A record moved to the parking collection.
pub fn parked(reason: &'static str) {
    metrics::counter!("timeoutd_parked_total", "reason" => reason).increment(1);
}

/// A refused send scheduled for another attempt after back-off.
pub fn retried() {
    metrics::counter!("timeoutd_retries_total").increment(1);
}

/// How many records wait in the parking collection (from the monitor's periodic query).
pub fn parked_records(n: u64) {
    metrics::gauge!("timeoutd_parked_records").set(n as f64);
}

pub fn claim_duration(d: Duration) {
    metrics::histogram!("timeoutd_claim_duration_seconds").record(d.as_secs_f64());
}

/// One MongoDB call on the dispatch path (`call` is one of [`MONGODB_CALLS`]).
pub fn mongodb_call(call: &'static str, d: Duration) {
    metrics::histogram!("timeoutd_mongodb_call_seconds", "call" => call).record(d.as_secs_f64());
}

pub fn publish_confirm(d: Duration) {
    metrics::histogram!("timeoutd_publish_confirm_seconds").record(d.as_secs_f64());
}

pub fn dependency_up(dependency: &'static str, up: bool) {
    metrics::gauge!("timeoutd_dependency_up", "dependency" => dependency).set(if up {
        1.0
    } else {
        0.0
    });
}

/// Readiness as `/readyz` reports it, set just before each scrape renders.
pub fn ready(ready: bool) {
    metrics::gauge!("timeoutd_ready").set(if ready { 1.0 } else { 0.0 });
}

pub fn clock_offset(offset_ms: i64) {
    metrics::gauge!("timeoutd_clock_offset_seconds").set(offset_ms as f64 / 1000.0);
}

pub fn leases_held(n: usize) {
    metrics::gauge!("timeoutd_leases_held").set(n as f64);
}

/// The periodic backlog reading: due and claimable records, and the oldest due age.
pub fn backlog(due: u64, oldest_due_age_seconds: Option<f64>) {
    metrics::gauge!("timeoutd_due_backlog").set(due as f64);
    metrics::gauge!("timeoutd_oldest_due_age_seconds").set(oldest_due_age_seconds.unwrap_or(0.0));
}

/// An essential task of the daemon ended or panicked while it was not shutting down.
pub fn task_failure(task: &'static str) {
    metrics::counter!("timeoutd_task_failures_total", "task" => task).increment(1);
}

/// Locks without a lease expiry the reaper freed (left by ServiceConnect's own poller).
pub fn stuck_freed(n: u64) {
    metrics::counter!("timeoutd_stuck_locks_freed_total").increment(n);
}

/// The census: records whose `Time` no branch of the due query serves, and records locked
/// with no lease expiry.
pub fn census(unschedulable: u64, stuck_locks: u64) {
    metrics::gauge!("timeoutd_unschedulable_records").set(unschedulable as f64);
    metrics::gauge!("timeoutd_stuck_locks").set(stuck_locks as f64);
}

/// Whether the daemon runs all its essential tasks.
pub fn up(up: bool) {
    metrics::gauge!("timeoutd_up").set(if up { 1.0 } else { 0.0 });
}

/// The destinations paused now, as the dispatch loop applies them.
pub fn paused_destinations(n: usize) {
    metrics::gauge!("timeoutd_paused_destinations").set(n as f64);
}

/// How long the oldest pause in force has lasted.
pub fn pause_age(longest_seconds: f64) {
    metrics::gauge!("timeoutd_longest_pause_seconds").set(longest_seconds);
}

/// The due records paused destinations hold back (from the monitor's periodic query).
pub fn paused_backlog(n: u64) {
    metrics::gauge!("timeoutd_paused_backlog").set(n as f64);
}

/// Claimed records held back from a send, by reason.
pub fn held_back(reason: &'static str, n: usize) {
    metrics::counter!("timeoutd_held_back_total", "reason" => reason).increment(n as u64);
}

/// History rows written.
pub fn history_written(n: usize) {
    metrics::counter!("timeoutd_history_written_total").increment(n as u64);
}

/// History rows lost, by reason (one of [`HISTORY_LOST_REASONS`]).
pub fn history_lost(reason: &'static str, n: usize) {
    metrics::counter!("timeoutd_history_lost_total", "reason" => reason).increment(n as u64);
}
