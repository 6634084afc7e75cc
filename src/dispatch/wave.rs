//! The RabbitMQ link and waves: connecting, publishing the records that fell due (one wave at
//! a time, by a task that owns the link for the length of the wave), and settling each record
//! of a wave as soon as the wave's outcomes are known.

use std::time::Duration;
use tokio::time::Instant;

use tokio_util::sync::CancellationToken;

use super::settle::{Failure, Settle};
use super::summary::WaveSummary;
use super::{Dispatcher, Done, LinkWork, WaveSignals};
use crate::dispatch::publisher::{PublishError, SendOutcome};
use crate::metrics as m;
use crate::record::message::{self, OutgoingMessage};
use crate::store::history;
use crate::store::lease::PrePublish;
use crate::store::parking::ParkReason;

impl Dispatcher {
    pub(super) fn on_connected(&mut self, result: Result<(), PublishError>) {
        match result {
            Ok(()) if self.link_up => {
                self.health.set_up(m::RABBITMQ, true);
                self.link_backoff.reset();
            }
            Err(PublishError::Stopped) => {
                tracing::debug!("shutdown began before the RabbitMQ connection was open");
            }
            // Open but not marked up (cannot follow a connect that succeeded): nothing to do.
            Ok(()) => {}
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
        let mut any_confirmed = false;
        let mut summary = WaveSummary::default();
        let mut fired = Vec::new();
        let mut refusing = Vec::new();
        let mut unknown = Vec::new();
        for (i, (r, outcome)) in std::mem::take(&mut self.in_flight)
            .into_iter()
            .zip(outcomes)
            .enumerate()
        {
            let (id, destination, owner) = (r.record.id, &r.record.destination, r.lease.owner);
            let correlation_id = r.record.process_manager_id;
            match outcome {
                SendOutcome::Confirmed => {
                    any_confirmed = true;
                    let late_ms = confirmed_at
                        .timestamp_millis()
                        .saturating_sub(r.record.due.timestamp_millis());
                    tracing::debug!(timeout_id = %id, %correlation_id, %destination, %owner, late_ms, "timeout sent");
                    m::dispatched(r.record.due, confirmed_at);
                    self.health.progress().made();
                    summary.confirmed(destination, late_ms);
                    if self.history.is_some() {
                        let message_id = message_ids.get(i).cloned().flatten();
                        fired.push(history::fired(&r.id, &r.record, message_id, confirmed_at));
                    }
                    self.refusing.remove(destination.as_str());
                    self.settle.confirmed.push(r);
                }
                SendOutcome::Returned | SendOutcome::Nacked => {
                    summary.refused += 1;
                    refusing.push(destination.clone());
                    m::publish_failure(outcome.reason());
                    self.settle.push_back(Settle::Refused {
                        ready: Box::new(r),
                        outcome,
                    });
                }
                other => {
                    summary.failed += 1;
                    if other.outcome_unknown() {
                        // The broker may have it: releasing lets a peer send it again, a
                        // possible duplicate, counted by its cause.
                        tracing::warn!(timeout_id = %id, %correlation_id, %destination, %owner, reason = other.reason(), detail = ?other, "publish outcome unknown; releasing (it may be sent again)");
                        let cause = match other {
                            SendOutcome::TimedOut => m::DUPLICATE_TIMEOUT,
                            _ => m::DUPLICATE_CONNECTION,
                        };
                        m::possible_duplicates(cause, 1);
                        unconfirmed = true;
                        unknown.push(r.id.clone());
                    } else {
                        tracing::warn!(timeout_id = %id, %correlation_id, %destination, %owner, reason = other.reason(), detail = ?other, "publish failed; releasing");
                    }
                    m::publish_failure(other.reason());
                    failed.push((r.id, r.lease));
                }
            }
        }
        summary.log(took);
        self.leave_out(refusing);
        if let Some(sink) = &self.history {
            sink.record(fired);
        }
        // A wave that outlived its leases may see a claim of this instance take the same
        // records again meanwhile: those copies must wait for the hold-off too (simulation
        // seed 5067: sent again 2 ms after the wave gave up on them).
        let again = self.held.take_matching(|h| unknown.contains(&h.id));
        failed.extend(again.into_iter().map(|r| (r.id, r.lease)));
        self.release(failed, "publish_failed");
        if unconfirmed {
            // A link that withholds confirms must not get the same records again at once, and
            // gets them later and later while it goes on withholding them: its own back-off,
            // which the reconnect that usually follows does not reset.
            let wait = self.unconfirmed_backoff.next_delay();
            tracing::warn!(retry_in = ?wait, "publishes went unconfirmed; backing off before the next claim");
            self.claims.hold_off(wait);
        } else if any_confirmed {
            self.unconfirmed_backoff.reset();
        }
    }

    /// The broker refused sends to `destinations` (at the end of a wave, and again as each
    /// refused record is settled): this instance's claims leave each out until `[retry] base`
    /// after the last, so that a dead queue's backlog cannot fill every claim while its
    /// refusals are settled, one or two writes each. Its records already held go on as they
    /// are; a claim after the window tries it again.
    pub(super) fn leave_out(&mut self, destinations: impl IntoIterator<Item = String>) {
        let now = Instant::now();
        self.refusing.retain(|_, until| *until > now);
        let until = crate::deadline::later(now, self.config.retry.base);
        for destination in destinations {
            if self.refusing.insert(destination.clone(), until).is_none() {
                tracing::warn!(%destination, retry_in = ?self.config.retry.base, "the broker refuses sends to this destination; leaving it out of claims for a while");
            }
        }
    }

    /// Follows `connection.blocked` and `connection.unblocked`: while blocked nothing is
    /// claimed, what is held is released (it cannot be sent), and `/readyz` is 503.
    pub(super) fn check_blocked(&mut self) {
        let blocked = self.watch.blocked();
        if blocked != self.blocked {
            self.blocked = blocked;
            self.health.set_blocked(blocked);
            m::rabbitmq_blocked(blocked);
            if blocked {
                tracing::warn!(
                    "RabbitMQ blocked the connection (memory or disk alarm): not claiming until it unblocks"
                );
            } else {
                tracing::info!("RabbitMQ unblocked the connection; claiming again");
            }
        }
        if self.blocked && !self.held.is_empty() {
            let held = self.held.take_all();
            tracing::info!(
                records = held.len(),
                "releasing claimed records: RabbitMQ blocks the connection"
            );
            self.release_records(held, "blocked");
        }
    }

    pub(super) fn start_connect(&mut self) {
        let Some(mut publisher) = self.publisher.take() else {
            return;
        };
        let shutdown = self.shutdown.clone();
        let handle = crate::host::spawn_in(&mut self.tasks, async move {
            let result = tokio::select! {
                r = publisher.connect() => r,
                // Not `Ok`: a connect cut short says nothing of the broker (issue 25: it
                // marked RabbitMQ up).
                _ = shutdown.cancelled() => Err(PublishError::Stopped),
            };
            Done::Link {
                publisher: Box::new(publisher),
                work: LinkWork::Connected(result),
            }
        });
        self.link_task = Some(handle.id());
    }

    /// Starts the link's work, while the loop has the link: a connect when it is down and
    /// its back-off has passed, else a wave of what fell due. A wave is built against the
    /// frame_max of the connection that carries it, so while the link is down the connect
    /// comes first (after a suspect link, the frame_max at hand is a default, not the
    /// broker's), and what falls due while the reconnect waits out its back-off is released.
    pub(super) fn start_link_work(&mut self) {
        if self.publisher.is_some() && !self.link_up && Instant::now() >= self.next_connect {
            self.start_connect();
        }
        // Due by the earliest the server's clock can read (never before it is due there).
        let now = self.store.clock().earliest();
        if self.publisher.is_some() && self.held.next_due().is_some_and(|d| d <= now) {
            if self.link_up {
                self.start_wave(now);
            } else {
                self.release_due_while_down(now);
            }
        }
    }

    /// Records that fell due while the link is down and its reconnect waits out a back-off:
    /// released, as a wave that could not connect releases them, so that an instance whose
    /// broker answers can send them. (No wave is built without a link: its frame_max would be
    /// a guess.)
    pub(super) fn release_due_while_down(&mut self, now: bson::DateTime) {
        let due = self.held.take_due(now);
        for _ in &due {
            m::publish_failure("connection");
        }
        self.release_records(due, "publish_failed");
    }

    /// Sends every held record that is due: too-late ones are released, unsendable ones
    /// parked, the rest published pipelined by a task that owns the link.
    pub(super) fn start_wave(&mut self, now: bson::DateTime) {
        let margin = self.config.dispatch.lease_safety_margin;
        let latest = self.store.clock().latest();
        let sent_at = crate::host::wall_now();
        let mut too_late = Vec::new();
        let mut messages: Vec<OutgoingMessage> = Vec::new();
        let due = self.held.take_due(now);
        for r in self.hold_back(due, now, latest) {
            // The lease left by the latest the server's clock can read.
            if r.lease.before_publish(latest, margin) != PrePublish::Publish {
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
                    self.settle.push_back(Settle::Park {
                        id: r.id,
                        destination: r.record.destination.clone(),
                        raw: Box::new(r.raw),
                        lease: r.lease,
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
        let built_for = self.frame_max;
        let shutdown = self.shutdown.clone();
        let handle = crate::host::spawn_in(&mut self.tasks, async move {
            let started = Instant::now();
            // The wave's own connect (the link dropped since the wave was built) yields to
            // shutdown like every other connect: nothing of the wave went out, so its records
            // are released.
            let connected = tokio::select! {
                biased;
                connected = publisher.connect() => connected.map_err(Some),
                _ = shutdown.cancelled() => Err(None),
            };
            let outcomes = match connected {
                // The link dropped since the wave was built and the new connection has
                // another limit: the messages were checked against the wrong one.
                Ok(()) if publisher.frame_max() != built_for => {
                    let why = format!(
                        "the connection was reopened with frame_max {} where the wave was built for {built_for}",
                        publisher.frame_max()
                    );
                    vec![SendOutcome::NotSent(why); messages.len()]
                }
                Ok(()) => {
                    publisher
                        .publish_batch(&messages, &stop_waiting, &alive)
                        .await
                }
                Err(Some(e)) => vec![SendOutcome::NotSent(e.to_string()); messages.len()],
                Err(None) => {
                    let why = "shutdown began before the connection was reopened".to_string();
                    vec![SendOutcome::NotSent(why); messages.len()]
                }
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
        crate::host::spawn(async move {
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use bson::doc;

    use super::super::held::Ready;
    use super::*;
    use crate::config::Config;
    use crate::dispatch::publisher::Publisher;
    use crate::record::TimeoutRecord;
    use crate::service::health::Health;
    use crate::store::Store;
    use crate::store::clock::ServerClock;
    use crate::store::lease::Lease;

    /// The real broker (as the integration tests find it), with the client asking for a
    /// `frame_max` of 8192: the connection negotiates that, RabbitMQ's default being larger.
    fn small_frames() -> String {
        let uri = std::env::var("TIMEOUTD_TEST_AMQP_URI")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
        let sep = if uri.contains('?') { '&' } else { '?' };
        format!("{uri}{sep}frame_max=8192")
    }

    /// Finding 4 of issue 19: after a suspect link (the link dropped; the dispatcher's
    /// frame_max is then the default, not the broker's), a record that fell due was built into
    /// a wave before the reconnect, against the wrong limit. Here a record whose headers fit
    /// the default (131072) but not the connection's 8192 is due while the link is down.
    #[tokio::test]
    async fn a_wave_is_built_against_the_frame_max_of_the_connection_that_carries_it() {
        let mut config = Config::default();
        config.rabbitmq.uri = small_frames();
        // Never contacted: no claim starts and no settling runs in this test.
        let store = Store::connect(&config.mongodb, ServerClock::default())
            .await
            .expect("store");
        let publisher = Publisher::new(&config.rabbitmq).expect("publisher");
        let health = Arc::new(Health::new(config.dispatch.poll_interval));
        let mut d = Dispatcher::new(
            Arc::new(config),
            store,
            Arc::default(),
            publisher,
            health,
            CancellationToken::new(),
            crate::dispatch::Signals::default(),
        );
        assert_eq!(
            d.frame_max,
            message::DEFAULT_FRAME_MAX,
            "as after a suspect link"
        );
        d.claims.hold_off(Duration::from_secs(3600));
        let now = d.store.clock().now();
        d.held.push(Ready {
            id: bson::Bson::Int32(1),
            raw: doc! {},
            record: TimeoutRecord {
                id: crate::host::uuid(),
                destination: "timeoutd-test-frame-max".into(),
                process_manager_id: crate::host::uuid(),
                due: now,
                headers: doc! { "Big": "x".repeat(20_000) },
            },
            lease: Lease::new(now, Duration::from_secs(60)),
        });

        // The record is due and the link is down: the connect comes first, no wave.
        d.start_work(false);
        assert!(
            d.in_flight.is_empty() && d.wave.is_none(),
            "a wave was built while the link was down, against frame_max {}",
            d.frame_max
        );
        assert_eq!(d.held.len(), 1, "the record waits for the connect");
        let connected = tokio::time::timeout(Duration::from_secs(20), d.tasks.join_next())
            .await
            .expect("the connect ends within its deadline")
            .expect("a connect task")
            .expect("the connect task does not panic");
        d.on_finished(connected);
        assert!(d.link_up, "connected to the broker at {}", small_frames());
        assert_eq!(d.frame_max, 8192);

        // Now built against the connection's limit: parked as unsendable, not published.
        d.start_work(false);
        assert!(d.in_flight.is_empty(), "nothing of it was published");
        let parked: Vec<ParkReason> = d
            .settle
            .work()
            .filter_map(|s| match s {
                Settle::Park { failure, .. } => Some(failure.reason),
                _ => None,
            })
            .collect();
        assert_eq!(parked, [ParkReason::Unsendable]);
        if let Some(mut publisher) = d.publisher.take() {
            publisher.close().await;
        }
    }
}
