//! What operators decide, applied by the dispatch loop: pauses (a paused destination's held
//! records are released and none of its records is claimed or sent) and send-rate limits
//! (a record that finds no token waits, held, until one comes; see [`crate::dispatch::ratelimit`]).

use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use super::{Dispatcher, Ready};
use crate::metrics as m;
use crate::store::lease::{self, PrePublish};

impl Dispatcher {
    /// Takes in the latest pauses and ramps; on a change, releases what this instance holds
    /// of a destination paused now. Never awaits.
    pub(super) fn apply_control(&mut self) {
        let latest = self.control_state.get();
        if Arc::ptr_eq(&latest, &self.control) {
            return;
        }
        self.control = latest;
        let paused = self.control.paused.clone();
        let held = self
            .held
            .take_matching(|r| paused.contains(&r.record.destination));
        if !held.is_empty() {
            tracing::info!(
                records = held.len(),
                "releasing held records of paused destinations"
            );
            m::held_back("paused", held.len());
            m::skipped("paused", held.len());
            self.release_records(held, "paused");
        }
        m::paused_destinations(paused.len());
    }

    /// Destinations the next claim leaves out: the paused ones, those the broker refused
    /// lately (see `Dispatcher::refusing`), and those with a send-rate
    /// limit of which this instance already holds what it may send over a poll interval
    /// and the look-ahead (more would only wait here, out of reach of other instances).
    pub(super) fn excluded_destinations(&self) -> Vec<String> {
        let mut excluded = self.control.paused.clone();
        let now = Instant::now();
        for (d, until) in &self.refusing {
            if *until > now && !excluded.contains(d) {
                excluded.push(d.clone());
            }
        }
        let d = &self.config.dispatch;
        let window = d.claim_window().as_secs_f64();
        let now_ms = self.store.clock().now().timestamp_millis();
        let limited = d
            .destination
            .iter()
            .map(|l| l.name.clone())
            .chain(self.control.ramps.keys().cloned());
        for name in limited {
            let rate = self
                .limits
                .destination_rate(&name, self.control.ramps.get(&name), now_ms);
            if let Some(rate) = rate
                && self.held.count_of(&name) as f64 >= (rate * window).max(1.0)
                && !excluded.contains(&name)
            {
                excluded.push(name);
            }
        }
        excluded
    }

    /// Whether this instance holds what its own `max_rate` lets it send over a poll
    /// interval and the look-ahead: then it claims nothing more for now.
    pub(super) fn rate_saturated(&self) -> bool {
        let d = &self.config.dispatch;
        let window = d.claim_window().as_secs_f64();
        d.max_rate
            .is_some_and(|r| self.held.len() as f64 >= (r * window).max(1.0))
    }

    /// Sorts the records that fell due: sendable now, or held back by a pause (released) or
    /// by a rate limit (held until a token comes, or released when the token would come too
    /// late for the lease). `now` is the earliest the server's clock can read, `latest` the
    /// latest.
    pub(super) fn hold_back(
        &mut self,
        due: Vec<Ready>,
        now: bson::DateTime,
        latest: bson::DateTime,
    ) -> Vec<Ready> {
        let control = self.control.clone();
        let rated = self.limits.any(!control.ramps.is_empty());
        let (at, now_ms) = (Instant::now(), now.timestamp_millis());
        let margin = self.config.dispatch.lease_safety_margin;
        let mut send = Vec::with_capacity(due.len());
        let mut paused = Vec::new();
        let mut outlasting = Vec::new();
        let mut later: Vec<(Ready, Duration)> = Vec::new();
        for r in due {
            let destination = r.record.destination.as_str();
            if control.paused.iter().any(|p| p == destination) {
                paused.push((r.id, r.lease));
                continue;
            }
            if rated {
                let rate = self.limits.destination_rate(
                    destination,
                    control.ramps.get(destination),
                    now_ms,
                );
                if let Err(wait) = self.limits.take(destination, rate, at) {
                    // Held only while its token comes within the lease: a record held past
                    // it would sit here on a dead lease, out of every claim's reach (this
                    // instance leaves the destination out while it holds some), until its
                    // turn found it too late (simulation seed 102: 87 records at 2 a second
                    // under a 3 s lease stalled for 26 s at a time). Released now, a later
                    // claim, here or on another instance, takes it again.
                    // The wave's own pre-publish check, at the instant the token comes.
                    let token_at = lease::add(latest, wait);
                    if r.lease.before_publish(token_at, margin) != PrePublish::Publish {
                        outlasting.push((r.id, r.lease));
                    } else {
                        later.push((r, wait));
                    }
                    continue;
                }
            }
            send.push(r);
        }
        if !paused.is_empty() {
            m::held_back("paused", paused.len());
            m::skipped("paused", paused.len());
            self.release(paused, "paused");
        }
        if !outlasting.is_empty() {
            m::held_back("rate_limit", outlasting.len());
            m::skipped("rate_limit", outlasting.len());
            self.release(outlasting, "rate_limit");
        }
        if !later.is_empty() {
            m::held_back("rate_limit", later.len());
            for (r, wait) in later {
                let wait_ms = i64::try_from(wait.as_millis()).unwrap_or(i64::MAX).max(1);
                self.held.defer(r, now_ms.saturating_add(wait_ms));
            }
        }
        send
    }
}
