//! Metric names and the small functions that record them, through the `metrics` facade.
//! Recording is a no-op until an exporter is installed.

use std::time::Duration;

use bson::DateTime;

pub const MONGODB: &str = "mongodb";
pub const RABBITMQ: &str = "rabbitmq";

pub fn claimed(n: usize) {
    metrics::counter!("timeoutd_claimed_total").increment(n as u64);
}

/// A confirmed publish of a record due at `due`, confirmed at `confirmed_at` (server clock).
pub fn dispatched(due: DateTime, confirmed_at: DateTime) {
    metrics::counter!("timeoutd_dispatched_total").increment(1);
    let late_ms = (confirmed_at.timestamp_millis() - due.timestamp_millis()).max(0);
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
