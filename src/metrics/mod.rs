//! Metric names and the small functions that record them (`recording.rs`), through the
//! `metrics` facade. Recording is a no-op until an exporter is installed. [`SERIES`] is the
//! one list of every series, its HELP text and its known label values; [`describe_all`] gives
//! each its HELP line and registers every counter, histogram and known label value at zero,
//! so a scrape shows them before their first event (Prometheus's `increase()` needs the zero
//! to see the first).

mod recording;

/// Tests: the sum of the series of a rendered exposition whose lines start with `prefix` (a
/// name and a space, or a name with its labels).
#[cfg(test)]
pub fn rendered(metrics: &metrics_exporter_prometheus::PrometheusHandle, prefix: &str) -> f64 {
    let value = |l: &str| l.rsplit(' ').next()?.parse::<f64>().ok();
    let text = metrics.render();
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(value)
        .sum()
}

pub use recording::*;

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
    "rate_limit",
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
    "blocked",
    "margin",
    "publish_failed",
    "supervisor",
    "paused",
    "rate_limit",
];
/// `timeoutd_held_back_total{reason}`.
pub const HELD_BACK_REASONS: &[&str] = &["paused", "rate_limit"];
/// `timeoutd_publish_failures_total{reason}`.
pub const PUBLISH_FAILURE_REASONS: &[&str] = &["returned", "nacked", "timeout", "connection"];
/// `timeoutd_possible_duplicates_total{cause}`: why a record may be delivered twice.
pub const POSSIBLE_DUPLICATE_CAUSES: &[&str] = &[
    DUPLICATE_TIMEOUT,
    DUPLICATE_CONNECTION,
    DUPLICATE_PANIC,
    DUPLICATE_SHUTDOWN,
    DUPLICATE_LEASE_LOST,
];
/// No confirm came before the publisher stopped waiting (confirms withheld, a slow broker).
pub const DUPLICATE_TIMEOUT: &str = "timeout";
/// The connection or channel failed after the message went out.
pub const DUPLICATE_CONNECTION: &str = "connection";
/// The task publishing a wave panicked or was cancelled with the wave in flight, or a removal
/// of confirmed records panicked.
pub const DUPLICATE_PANIC: &str = "panic";
/// Confirmed, but shutdown cut the removal short (or the loop ended unsettled): the record stays leased and is sent again
/// after its lease.
pub const DUPLICATE_SHUTDOWN: &str = "shutdown";
/// Confirmed, but the lease was lost before the removal: whoever holds the record now sends it.
pub const DUPLICATE_LEASE_LOST: &str = "lease_lost";
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
    "dispatch", "reaper", "monitor", "wakeup", "http", "systemd", "control", "indexes", "history",
    "shapes",
];
/// `timeoutd_history_lost_total{reason}`.
pub const HISTORY_LOST_REASONS: &[&str] = &["write_failed", "backlog", "shutdown"];

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

/// One series: name, type, HELP text, and its label with the known values. Its unit is
/// seconds when its name ends with `_seconds`, else a count.
#[derive(Debug, Clone, Copy)]
pub struct Series {
    pub name: &'static str,
    pub kind: Kind,
    pub help: &'static str,
    pub label: Option<(&'static str, &'static [&'static str])>,
    pub start: Start,
}

impl Series {
    /// Counters and histograms start at zero, gauges with their first reading.
    const fn new(kind: Kind, name: &'static str, help: &'static str) -> Self {
        let start = match kind {
            Kind::Gauge => Start::FirstReading,
            _ => Start::Zero,
        };
        Self {
            name,
            kind,
            help,
            label: None,
            start,
        }
    }

    const fn by(self, label: &'static str, values: &'static [&'static str]) -> Self {
        Self {
            label: Some((label, values)),
            ..self
        }
    }

    const fn at_zero(self) -> Self {
        Self {
            start: Start::Zero,
            ..self
        }
    }
}

const fn counter(name: &'static str, help: &'static str) -> Series {
    Series::new(Kind::Counter, name, help)
}

const fn gauge(name: &'static str, help: &'static str) -> Series {
    Series::new(Kind::Gauge, name, help)
}

const fn histogram(name: &'static str, help: &'static str) -> Series {
    Series::new(Kind::Histogram, name, help)
}

/// Every series timeoutd exports, in the order of the metrics table in docs/operations.md.
pub const SERIES: &[Series] = &[
    counter("timeoutd_claimed_total", "Records this instance claimed (leased) for dispatch."),
    counter("timeoutd_dispatched_total", "Timeout messages the broker confirmed."),
    counter("timeoutd_removed_total", "Records deleted from Timeouts after a confirmed publish."),
    counter(
        "timeoutd_publish_failures_total",
        "Publishes that failed, by reason (returned: no queue bound to the destination; connection: the link failed during the publish, or was down, waiting out its reconnect back-off, when the record fell due, so that it was released untried for an instance whose broker answers).",
    )
    .by("reason", PUBLISH_FAILURE_REASONS),
    counter(
        "timeoutd_released_total",
        "Leased records given back unsent, by reason.",
    )
    .by("reason", RELEASED_REASONS),
    counter(
        "timeoutd_lease_lost_total",
        "Records whose guarded write (the removal after a confirmed send, a refused send's deferral, parking) matched nothing because their lease had run out or another owner held them: a lease problem (lock_lease too short for the database or the settle work). Duplicates are counted in timeoutd_possible_duplicates_total.",
    ),
    counter(
        "timeoutd_possible_duplicates_total",
        "Records that may be delivered twice, by cause: timeout (no confirm before the publisher stopped waiting), connection (the link failed after the publish), panic (the publishing task died mid-wave, a removal of confirmed records panicked, or the dispatch loop panicked with records unsettled), shutdown (confirmed, but shutdown cut the removal short), lease_lost (confirmed, but the lease was lost before the removal).",
    )
    .by("cause", POSSIBLE_DUPLICATE_CAUSES),
    counter("timeoutd_reaped_total", "Expired leases the reaper freed."),
    counter(
        "timeoutd_skipped_total",
        "Claimed records not sent this time, by reason.",
    )
    .by("reason", SKIPPED_REASONS),
    counter(
        "timeoutd_retries_total",
        "Refused sends scheduled for another attempt after back-off.",
    ),
    counter(
        "timeoutd_parked_total",
        "Records moved to the parking collection, by reason.",
    )
    .by("reason", PARKED_REASONS),
    gauge(
        "timeoutd_parked_records",
        "Records in the parking collection at the last monitor reading.",
    ),
    histogram(
        "timeoutd_dispatch_lateness_seconds",
        "Broker confirm time minus due time of each dispatched record, on the database server clock.",
    ),
    histogram("timeoutd_claim_duration_seconds", "Duration of each claim of a batch in MongoDB."),
    histogram(
        "timeoutd_mongodb_call_seconds",
        "Duration of each MongoDB call, by lease step: find (the candidate read), claim (the compare-and-swap updateMany), read_back, remove (the guarded deleteMany) and release; and in the background: backlog (the monitor's gauges), census, reap (the reaper's pass) and shapes (learning and probing the Time shapes).",
    )
    .by("call", MONGODB_CALLS),
    histogram(
        "timeoutd_publish_confirm_seconds",
        "Duration from publishing a batch to the broker's last confirm.",
    ),
    gauge(
        "timeoutd_due_backlog",
        "Due and claimable records of destinations not paused at the last monitor reading, counted up to 10000 (a bigger backlog reads 10000; timeoutd stats counts them all). Read from the collection, independent of what the claims learned.",
    ),
    gauge(
        "timeoutd_oldest_due_age_seconds",
        "Age of the oldest due record (leased or not) of a destination not paused at the last monitor reading; 0 when none is due.",
    ),
    gauge(
        "timeoutd_due_unclaimed_seconds",
        "How long the oldest due record of a destination neither paused nor rate-limited has stayed unclaimed while no claim of this instance read a due record and nothing was sent; 0 while it makes progress. /readyz is 503 past 3 x poll_interval + lease_safety_margin + 2 x operation_timeout.",
    )
    .at_zero(),
    gauge("timeoutd_leases_held", "Records this instance holds leased now."),
    gauge(
        "timeoutd_clock_offset_seconds",
        "Database server clock minus this host's clock at the last monitor reading.",
    ),
    gauge(
        "timeoutd_dependency_up",
        "Whether the dependency answered at its last use: 1 up, 0 down.",
    )
    .by("dependency", DEPENDENCIES).at_zero(),
    counter(
        "timeoutd_rabbitmq_failovers_total",
        "Times the link to the RabbitMQ node in use failed and another node of [rabbitmq] uri answered.",
    ),
    gauge(
        "timeoutd_rabbitmq_node",
        "The RabbitMQ node in use, by node (host:port): 1 for the node in use, 0 for the others of [rabbitmq] uri.",
    )
    .by("node", &[]),
    gauge(
        "timeoutd_rabbitmq_blocked",
        "1 while the broker blocks the connection (connection.blocked: a memory or disk alarm); no claims then.",
    )
    .at_zero(),
    counter(
        "timeoutd_task_failures_total",
        "Essential tasks that stopped or panicked while the daemon was not shutting down, by task; the process then exits 1 to be restarted.",
    )
    .by("task", TASKS),
    gauge(
        "timeoutd_ready",
        "1 while /readyz answers 200 (MongoDB and RabbitMQ answer, due records get claimed, not draining), else 0; read at each scrape.",
    ),
    gauge(
        "timeoutd_up",
        "1 while the daemon runs its tasks; 0 once one has stopped and the daemon is exiting.",
    ),
    counter(
        "timeoutd_stuck_locks_freed_total",
        "Records locked without a lease expiry, or with one that is no date (left by another dispatcher or writer), that the reaper freed.",
    ),
    gauge(
        "timeoutd_unschedulable_records",
        "Records whose Time no branch of the due query matches, at the last census.",
    ),
    gauge(
        "timeoutd_stuck_locks",
        "Records locked without a lease expiry, or with one that is no date, at the last census.",
    ),
    gauge(
        "timeoutd_odd_locked_records",
        "Records whose Locked is missing or not a boolean and whose LockExpiresAt is no date, at the last census: no claim takes them, so they never fire until fixed.",
    ),
    gauge(
        "timeoutd_build_info",
        "Always 1; the version and revision (git commit, or unknown) labels name the running build.",
    ),
    gauge(
        "timeoutd_paused_destinations",
        "Destinations paused fleet-wide (timeoutd pause), as this instance applies them now.",
    )
    .at_zero(),
    gauge(
        "timeoutd_longest_pause_seconds",
        "How long the oldest pause in force has lasted; 0 when no destination is paused.",
    )
    .at_zero(),
    gauge(
        "timeoutd_paused_backlog",
        "Records of paused destinations due now (held back by the pause), at the last monitor reading, counted up to 10000.",
    )
    .at_zero(),
    counter(
        "timeoutd_held_back_total",
        "Claimed records not sent when due, by reason: paused (released unsent), rate_limit (each wait for a send-rate token).",
    )
    .by("reason", HELD_BACK_REASONS),
    counter(
        "timeoutd_history_written_total",
        "History rows written ([history] keep): fired, parked and cancelled timeouts.",
    ),
    counter(
        "timeoutd_history_lost_total",
        "History rows not written, by reason: write_failed (the write failed or timed out), backlog (the writer was too far behind), shutdown (still queued when the shutdown's drain ended); the timeouts themselves were unaffected.",
    )
    .by("reason", HISTORY_LOST_REASONS),
    gauge(
        "timeoutd_mongodb_calls_in_flight",
        "MongoDB calls this instance may have running on the server: started and not returned, or abandoned at their deadline less than twice operation_timeout after they started (the server's maxTimeMS ends them).",
    )
    .at_zero(),
    gauge(
        "timeoutd_indexes_missing",
        "Indexes timeoutd asked for that do not exist yet (being built, or their creation failed): those of the timeouts collection, and each set of its own collections (parking, control, history) not created yet; claims use the indexes that exist meanwhile.",
    )
    .at_zero(),
];

/// Gives every series its HELP text and registers the counters, histograms and known label
/// values at zero. Call once, after the recorder is installed and before anything records.
pub fn describe_all() {
    for s in SERIES {
        let unit = if s.name.ends_with("_seconds") {
            Unit::Seconds
        } else {
            Unit::Count
        };
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
