//! The RabbitMQ link and waves: connecting, publishing the records that fell due (one wave at
//! a time, by a task that owns the link for the length of the wave), and settling each record
//! of a wave as soon as the wave's outcomes are known.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime};

use tokio_util::sync::CancellationToken;

use super::settle::{Failure, Settle};
use super::{Dispatcher, Done, LinkWork, WaveSignals};
use crate::history;
use crate::lease::PrePublish;
use crate::message::{self, OutgoingMessage};
use crate::metrics as m;
use crate::parking::ParkReason;
use crate::publisher::{PublishError, SendOutcome};

impl Dispatcher {
    pub(super) fn on_connected(&mut self, result: Result<(), PublishError>) {
        match result {
            Ok(()) => {
                self.health.set_up(m::RABBITMQ, true);
                self.link_backoff.reset();
            }
            Err(e) => {
                self.health.set_up(m::RABBITMQ, false);
                let wait = self.link_backoff.next_delay();
                tracing::warn!(error = %e, retry_in = ?wait, "RabbitMQ unreachable; not claiming");
                self.next_connect = Instant::now() + wait;
            }
        }
    }

    /// A wave's outcomes are known: each record is settled now, the wave is summarised in
    /// one line, and the confirmed records go to history (which nothing here waits for).
    pub(super) fn on_wave_sent(
        &mut self,
        outcomes: Vec<SendOutcome>,
        message_ids: Vec<Option<String>>,
        took: Duration,
    ) {
        m::publish_confirm(took);
        self.health.set_up(m::RABBITMQ, self.link_up);
        let confirmed_at = self.store.clock().now();
        let mut failed = Vec::new();
        let mut unconfirmed = false;
        let mut summary = WaveSummary::default();
        let mut fired = Vec::new();
        for (i, (r, outcome)) in std::mem::take(&mut self.in_flight)
            .into_iter()
            .zip(outcomes)
            .enumerate()
        {
            let (id, destination, owner) = (r.record.id, &r.record.destination, r.lease.owner);
            let correlation_id = r.record.process_manager_id;
            match outcome {
                SendOutcome::Confirmed => {
                    let late_ms = confirmed_at
                        .timestamp_millis()
                        .saturating_sub(r.record.due.timestamp_millis());
                    tracing::debug!(timeout_id = %id, %correlation_id, %destination, %owner, late_ms, "timeout sent");
                    m::dispatched(r.record.due, confirmed_at);
                    summary.confirmed(destination, late_ms);
                    if self.history.is_some() {
                        let message_id = message_ids.get(i).cloned().flatten();
                        fired.push(history::fired(&r.id, &r.record, message_id, confirmed_at));
                    }
                    self.confirmed.push(r);
                }
                SendOutcome::Returned | SendOutcome::Nacked => {
                    summary.refused += 1;
                    m::publish_failure(outcome.reason());
                    self.settle_queue.push_back(Settle::Refused {
                        ready: Box::new(r),
                        outcome,
                    });
                }
                other => {
                    summary.failed += 1;
                    if other.outcome_unknown() {
                        // The broker may have it: releasing lets a peer send it again, a
                        // possible duplicate, counted as a lost lease.
                        tracing::warn!(timeout_id = %id, %correlation_id, %destination, %owner, reason = other.reason(), detail = ?other, "publish outcome unknown; releasing (it may be sent again)");
                        m::lease_lost(1);
                        unconfirmed = true;
                    } else {
                        tracing::warn!(timeout_id = %id, %correlation_id, %destination, %owner, reason = other.reason(), detail = ?other, "publish failed; releasing");
                    }
                    m::publish_failure(other.reason());
                    failed.push((r.id, r.lease));
                }
            }
        }
        summary.log(took);
        if let Some(sink) = &self.history {
            sink.record(fired);
        }
        self.release(failed, "publish_failed");
        if unconfirmed {
            // A link that withholds confirms must not get the same records again at once.
            let wait = self.link_backoff.next_delay();
            tracing::warn!(retry_in = ?wait, "publishes went unconfirmed; backing off before the next claim");
            self.claims.hold_off(wait);
        }
    }

    pub(super) fn start_connect(&mut self) {
        let Some(mut publisher) = self.publisher.take() else {
            return;
        };
        let shutdown = self.shutdown.clone();
        let handle = self.tasks.spawn(async move {
            let result = tokio::select! {
                r = publisher.connect() => r,
                _ = shutdown.cancelled() => Ok(()),
            };
            Done::Link {
                publisher: Box::new(publisher),
                work: LinkWork::Connected(result),
            }
        });
        self.link_task = Some(handle.id());
    }

    /// Sends every held record that is due: too-late ones are released, unsendable ones
    /// parked, the rest published pipelined by a task that owns the link.
    pub(super) fn start_wave(&mut self, now: bson::DateTime) {
        let margin = self.config.dispatch.lease_safety_margin;
        let sent_at = SystemTime::now();
        let mut too_late = Vec::new();
        let mut messages: Vec<OutgoingMessage> = Vec::new();
        let due = self.held.take_due(now);
        for r in self.hold_back(due, now) {
            if r.lease.before_publish(now, margin) != PrePublish::Publish {
                too_late.push((r.id, r.lease));
                continue;
            }
            match message::build_contained(
                &r.record,
                &self.config.rabbitmq,
                sent_at,
                self.frame_max,
            ) {
                Ok(m) => {
                    messages.push(m);
                    self.in_flight.push(r);
                }
                Err(unsendable) => {
                    m::skipped("unsendable", 1);
                    self.settle_queue.push_back(Settle::Park {
                        id: r.id,
                        destination: r.record.destination.clone(),
                        raw: Box::new(r.raw),
                        owner: r.lease.owner,
                        failure: Failure::poison(ParkReason::Unsendable, unsendable.to_string()),
                    });
                }
            }
        }
        if !too_late.is_empty() {
            m::skipped("margin", too_late.len());
            self.release(too_late, "margin");
        }
        if messages.is_empty() {
            return;
        }
        let Some(mut publisher) = self.publisher.take() else {
            return;
        };
        let stop_waiting = self.confirm_deadline();
        tracing::debug!(records = messages.len(), "publishing a wave");
        let message_ids: Vec<Option<String>> = messages
            .iter()
            .map(|m| m.properties.message_id().as_ref().map(|id| id.to_string()))
            .collect();
        let alive = CancellationToken::new();
        self.wave = Some(WaveSignals {
            answered: alive.clone(),
            over: stop_waiting.clone(),
        });
        let handle = self.tasks.spawn(async move {
            let started = Instant::now();
            let outcomes = match publisher.connect().await {
                Ok(()) => {
                    publisher
                        .publish_batch(&messages, &stop_waiting, &alive)
                        .await
                }
                Err(e) => vec![SendOutcome::NotSent(e.to_string()); messages.len()],
            };
            stop_waiting.cancel();
            Done::Link {
                publisher: Box::new(publisher),
                work: LinkWork::Wave {
                    outcomes,
                    message_ids,
                    took: started.elapsed(),
                },
            }
        });
        self.link_task = Some(handle.id());
    }

    /// A token cancelled when a wave's publishes and confirms should no longer be awaited:
    /// after `publish_timeout`, or `shutdown_timeout` after shutdown starts, whichever first.
    pub(super) fn confirm_deadline(&self) -> CancellationToken {
        let stop = CancellationToken::new();
        let publish_timeout = self.config.rabbitmq.publish_timeout;
        let shutdown_timeout = self.config.dispatch.shutdown_timeout;
        let shutdown = self.shutdown.clone();
        let token = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(publish_timeout) => {}
                _ = async { shutdown.cancelled().await; tokio::time::sleep(shutdown_timeout).await } => {}
                _ = token.cancelled() => {}
            }
            token.cancel();
        });
        stop
    }
}

/// Most destinations a wave summary names; the rest are counted.
const SUMMARY_DESTINATIONS: usize = 20;

/// One info line per wave: how many records, how late, to which destinations.
#[derive(Debug, Default)]
struct WaveSummary {
    sent: usize,
    refused: usize,
    failed: usize,
    late_ms: Option<(i64, i64)>,
    destinations: BTreeMap<String, usize>,
}

impl WaveSummary {
    fn confirmed(&mut self, destination: &str, late_ms: i64) {
        self.sent += 1;
        let (lo, hi) = self.late_ms.unwrap_or((late_ms, late_ms));
        self.late_ms = Some((lo.min(late_ms), hi.max(late_ms)));
        if let Some(n) = self.destinations.get_mut(destination) {
            *n += 1;
            return;
        }
        let key = match self.destinations.len() < SUMMARY_DESTINATIONS {
            true => destination,
            false => "(others)",
        };
        *self.destinations.entry(key.to_string()).or_default() += 1;
    }

    /// `q1=3 q2=5`.
    fn destinations(&self) -> String {
        let shown: Vec<String> = self
            .destinations
            .iter()
            .map(|(d, n)| format!("{d}={n}"))
            .collect();
        shown.join(" ")
    }

    fn log(&self, took: Duration) {
        let (late_min, late_max) = self.late_ms.unwrap_or_default();
        tracing::info!(
            sent = self.sent,
            refused = self.refused,
            failed = self.failed,
            late_ms_min = late_min,
            late_ms_max = late_max,
            destinations = %self.destinations(),
            took_ms = took.as_millis() as u64,
            "wave sent"
        );
    }
}
