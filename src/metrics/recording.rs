//! The small functions that record each series through the `metrics` facade, one per
//! event or gauge; what each series means is its HELP text in [`super::SERIES`].

use std::time::Duration;

use bson::DateTime;

/// A gauge's value for a yes-or-no reading.
fn flag(on: bool) -> f64 {
    f64::from(u8::from(on))
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

pub fn possible_duplicates(cause: &'static str, n: usize) {
    metrics::counter!("timeoutd_possible_duplicates_total", "cause" => cause).increment(n as u64);
}

pub fn reaped(n: u64) {
    metrics::counter!("timeoutd_reaped_total").increment(n);
}

pub fn skipped(reason: &'static str, n: usize) {
    metrics::counter!("timeoutd_skipped_total", "reason" => reason).increment(n as u64);
}

pub fn parked(reason: &'static str) {
    metrics::counter!("timeoutd_parked_total", "reason" => reason).increment(1);
}

pub fn retried() {
    metrics::counter!("timeoutd_retries_total").increment(1);
}

pub fn parked_records(n: u64) {
    metrics::gauge!("timeoutd_parked_records").set(n as f64);
}

pub fn claim_duration(d: Duration) {
    metrics::histogram!("timeoutd_claim_duration_seconds").record(d.as_secs_f64());
}

pub fn mongodb_call(call: &'static str, d: Duration) {
    metrics::histogram!("timeoutd_mongodb_call_seconds", "call" => call).record(d.as_secs_f64());
}

pub fn publish_confirm(d: Duration) {
    metrics::histogram!("timeoutd_publish_confirm_seconds").record(d.as_secs_f64());
}

pub fn dependency_up(dependency: &'static str, up: bool) {
    metrics::gauge!("timeoutd_dependency_up", "dependency" => dependency).set(flag(up));
}

/// Readiness as `/readyz` reports it, set just before each scrape renders.
pub fn ready(ready: bool) {
    metrics::gauge!("timeoutd_ready").set(flag(ready));
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

pub fn due_unclaimed(d: Duration) {
    metrics::gauge!("timeoutd_due_unclaimed_seconds").set(d.as_secs_f64());
}

pub fn task_failure(task: &'static str) {
    metrics::counter!("timeoutd_task_failures_total", "task" => task).increment(1);
}

pub fn stuck_freed(n: u64) {
    metrics::counter!("timeoutd_stuck_locks_freed_total").increment(n);
}

pub fn census(unschedulable: u64, stuck_locks: u64, odd_locked: u64) {
    metrics::gauge!("timeoutd_unschedulable_records").set(unschedulable as f64);
    metrics::gauge!("timeoutd_stuck_locks").set(stuck_locks as f64);
    metrics::gauge!("timeoutd_odd_locked_records").set(odd_locked as f64);
}

/// `timeoutd_mongodb_calls_in_flight` (see [`crate::deadline::in_flight`]).
pub fn calls_in_flight(n: usize) {
    metrics::gauge!("timeoutd_mongodb_calls_in_flight").set(n as f64);
}

pub fn indexes_missing(n: usize) {
    metrics::gauge!("timeoutd_indexes_missing").set(n as f64);
}

pub fn rabbitmq_failover() {
    metrics::counter!("timeoutd_rabbitmq_failovers_total").increment(1);
}

/// The node in use: 1 for `node`, 0 for every other node of the list.
pub fn rabbitmq_node(node: &str, all: &[String]) {
    for other in all {
        metrics::gauge!("timeoutd_rabbitmq_node", "node" => other.clone()).set(flag(other == node));
    }
}

pub fn rabbitmq_blocked(blocked: bool) {
    metrics::gauge!("timeoutd_rabbitmq_blocked").set(flag(blocked));
}

pub fn history_written(n: usize) {
    metrics::counter!("timeoutd_history_written_total").increment(n as u64);
}

pub fn history_lost(reason: &'static str, n: usize) {
    metrics::counter!("timeoutd_history_lost_total", "reason" => reason).increment(n as u64);
}

pub fn up(up: bool) {
    metrics::gauge!("timeoutd_up").set(flag(up));
}

pub fn paused_destinations(n: usize) {
    metrics::gauge!("timeoutd_paused_destinations").set(n as f64);
}

pub fn pause_age(longest_seconds: f64) {
    metrics::gauge!("timeoutd_longest_pause_seconds").set(longest_seconds);
}

pub fn paused_backlog(n: u64) {
    metrics::gauge!("timeoutd_paused_backlog").set(n as f64);
}

pub fn held_back(reason: &'static str, n: usize) {
    metrics::counter!("timeoutd_held_back_total", "reason" => reason).increment(n as u64);
}
