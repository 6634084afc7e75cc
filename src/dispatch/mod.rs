//! The dispatch loop: one loop over named events, one handler each, in the way River's
//! producer runs its fetch loop.
//!
//! One record's path, start to end:
//! 1. **Claim** ([`Dispatcher::start_claim`], a background task): a batch of records due now
//!    or within the look-ahead is leased under a fresh owner ([`crate::store`],
//!    [`crate::store::lease`]). [`Event::Claimed`] hands the rows to [`Dispatcher::on_claimed`]: a
//!    record that does not decode, or has no destination, is parked at once; the rest wait in
//!    [`Held`], soonest first.
//! 2. **Wave** ([`Dispatcher::start_wave`]): when records fall due ([`Event::Due`]) they are
//!    checked against the lease margin, turned into messages (a record no message can carry
//!    is parked with the reason, the rest go on) and published pipelined by a background
//!    task that owns the RabbitMQ link for as long as the wave lasts.
//! 3. **Settle** ([`Dispatcher::on_wave_sent`], [`settle`]): as soon as the wave's outcomes
//!    are known, confirmed records are removed (owner- and lease-guarded), refused ones retried
//!    or parked, and the rest released, each in a background task.
//!
//! Nothing is deleted unless its publish was confirmed and its claim's lease still held; when
//! in doubt a record is left for a later poll. No handler awaits: every call to MongoDB or
//! RabbitMQ runs in a task, under a deadline, and reports back as an event, so the loop always
//! turns, and each turn tells [`Health`] it is live. A handler that panics is caught: the
//! daemon is marked failed, the loop releases what it holds and returns an error, and the
//! process exits non-zero.
//!
//! This file is longer than the others (about 460 lines) on purpose: the loop's state, its
//! events and the dispatch of each event to its handler read best whole; the handlers of
//! each step live in the sibling files.

mod claim;
mod control;
mod held;
pub mod lapinlink;
pub mod link;
#[cfg(test)]
mod linktests;
pub mod publisher;
pub mod ratelimit;
mod settle;
mod summary;
pub mod wakeup;
mod wave;

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use bson::Bson;
use futures::FutureExt;
use tokio::sync::Notify;
use tokio::task::{JoinError, JoinSet};
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::dispatch::publisher::{PublishError, Publisher, SendOutcome};
use crate::host::backoff::Backoff;
use crate::metrics as m;
use crate::record::TimeoutRecord;
use crate::service::health::Health;
use crate::service::supervisor::panic_message;
use crate::store::serverload::Pacing;
use crate::store::{Claim, Store, StoreError};
use claim::WaveSignals;
pub use claim::triage;
pub use held::{ClaimSchedule, Held, Ready};
use settle::{Settle, SettleQueue};

/// How often the loop turns when nothing happens, so that liveness keeps being reported.
const HEARTBEAT: Duration = Duration::from_secs(1);

/// Most background removals at once, and most other settling tasks at once.
const MAX_REMOVALS: usize = 4;
const MAX_SETTLING: usize = 4;

/// What ends the dispatch loop other than a clean shutdown.
#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    #[error("a dispatch handler panicked: {0}")]
    Panicked(String),
    #[error(transparent)]
    Publisher(#[from] PublishError),
}

/// What a background task reports when it ends.
enum Done {
    Claim {
        started: Instant,
        /// Time spent waiting for the broker's answer to the wave in flight.
        waited: Duration,
        result: Result<Claim, StoreError>,
    },
    /// The task that had the RabbitMQ link gives it back.
    Link {
        publisher: Box<Publisher>,
        work: LinkWork,
    },
    Removed,
    /// Settling work ended; `refused`: the destination of a refused send it retried or parked.
    Settled {
        refused: Option<String>,
    },
}

enum LinkWork {
    Connected(Result<(), PublishError>),
    Wave {
        outcomes: Vec<SendOutcome>,
        /// The `MessageId` of each message, in wave order (for history).
        message_ids: Vec<Option<String>>,
        took: Duration,
    },
}

/// The events the loop waits for.
enum Event {
    /// SIGTERM or SIGINT (or a failure elsewhere in the daemon).
    Shutdown,
    /// A background task ended.
    Finished(Result<Done, JoinError>),
    /// The change stream saw a record inserted due before the next poll.
    WokenUp,
    /// The control watcher read new pauses or ramps.
    ControlChanged,
    /// The soonest held record fell due.
    Due,
    /// A poll, a reconnect or a heartbeat is due.
    Tick,
}

/// What tells the loop to look again before its next poll, one signal per source: the daemon
/// makes them and hands each to the task that sends it.
#[derive(Debug, Clone, Default)]
pub struct Signals {
    /// A record was inserted due within the look-ahead ([`wakeup`]).
    pub inserted: Arc<Notify>,
    /// The pauses or ramps in force changed (the control watcher).
    pub control: Arc<Notify>,
}

/// The dispatch loop's state. One per process.
pub struct Dispatcher {
    config: Arc<Config>,
    store: Store,
    health: Arc<Health>,
    shutdown: CancellationToken,
    signals: Signals,
    /// The RabbitMQ link; `None` while a background task uses it (one wave at a time, so that
    /// returns are matched to their own wave's messages).
    publisher: Option<Publisher>,
    link_up: bool,
    /// The broker blocks the open connection ([`crate::dispatch::publisher::LinkWatch`]).
    watch: crate::dispatch::publisher::LinkWatch,
    blocked: bool,
    frame_max: u32,
    next_connect: Instant,
    /// Spaces the reconnects; reset by a connect that succeeds.
    link_backoff: Backoff,
    /// Spaces the claims after waves whose publishes went unconfirmed; reset only by a wave
    /// the broker confirmed. Not the reconnect back-off: the link that withholds confirms
    /// reconnects fine, and the hold-off must grow all the same (issue 25, 8.5).
    unconfirmed_backoff: Backoff,
    claims: ClaimSchedule,
    /// Destinations whose last send the broker refused (no queue bound, or a nack), and until
    /// when this instance's claims leave them out (`[retry] base` after the last of their
    /// refused records was settled, see `Dispatcher::leave_out`): their
    /// backlog, oldest first, would otherwise fill every claim and crowd out every other
    /// destination (issue 25, 8.3, seen from outside). A confirmed send ends it.
    refusing: HashMap<String, Instant>,
    /// When a claim may run again after one failed ([`crate::store::serverload`]).
    claim_pacing: Pacing,
    held: Held,
    /// The records of the wave being published, in message order.
    in_flight: Vec<Ready>,
    /// Settling work waiting for a slot, confirmed records' removals included; bounded by
    /// holding claims back while it is full ([`SettleQueue`]).
    settle: SettleQueue,
    tasks: JoinSet<Done>,
    link_task: Option<tokio::task::Id>,
    /// Some while a wave is publishing: what a claim beside it waits for (`claim::ProofGate`).
    wave: Option<WaveSignals>,
    removals: usize,
    settling: usize,
    /// Cancelled `shutdown_timeout` + half of [`crate::service::shutdown::GRACE`] after
    /// shutdown began: removals still running then give up and count their records as
    /// possible duplicates, so that the loop ends before the daemon's drain deadline aborts it.
    drain_over: CancellationToken,
    failed: Option<String>,
    /// The pauses and ramps last applied ([`control`]).
    control: Arc<crate::store::control::Snapshot>,
    /// Where the control watcher leaves the latest pauses and ramps.
    control_state: Arc<crate::operator::control::ControlState>,
    limits: crate::dispatch::ratelimit::RateLimits,
    /// Where confirmed waves and parked records are recorded, with `[history] keep`.
    history: Option<crate::store::history::HistorySink>,
}

impl Dispatcher {
    pub fn new(
        config: Arc<Config>,
        store: Store,
        control_state: Arc<crate::operator::control::ControlState>,
        publisher: Publisher,
        health: Arc<Health>,
        shutdown: CancellationToken,
        signals: Signals,
    ) -> Self {
        let poll = config.dispatch.poll_interval;
        let claim_pacing = Pacing::new(config.mongodb.operation_timeout);
        let limits = crate::dispatch::ratelimit::RateLimits::new(&config.dispatch);
        Self {
            config,
            store,
            health,
            shutdown,
            signals,
            frame_max: publisher.frame_max(),
            watch: publisher.watch(),
            blocked: false,
            publisher: Some(publisher),
            link_up: false,
            next_connect: Instant::now(),
            link_backoff: Backoff::reconnect(),
            unconfirmed_backoff: Backoff::reconnect(),
            claims: ClaimSchedule::new(poll),
            refusing: HashMap::new(),
            claim_pacing,
            held: Held::default(),
            in_flight: Vec::new(),
            settle: SettleQueue::default(),
            tasks: JoinSet::new(),
            link_task: None,
            wave: None,
            removals: 0,
            settling: 0,
            drain_over: CancellationToken::new(),
            failed: None,
            control: Arc::default(),
            control_state,
            limits,
            history: None,
        }
    }

    /// Records what fires and what is parked through `sink` (`[history] keep`).
    pub fn with_history(mut self, sink: Option<crate::store::history::HistorySink>) -> Self {
        self.history = sink;
        self
    }

    /// Runs until shutdown; then releases what it holds (owner-guarded), waits for the wave
    /// in flight (at most `shutdown_timeout`) and for the settling it started, closes the
    /// broker connection and returns. Returns an error if a handler panicked.
    pub async fn run(mut self) -> Result<(), DispatchError> {
        self.start_drain_timer();
        loop {
            self.health.beat();
            let stopping = self.shutdown.is_cancelled();
            let started = std::panic::catch_unwind(AssertUnwindSafe(|| self.start_work(stopping)));
            if let Err(panic) = started
                && self.contain(panic.as_ref())
            {
                break;
            }
            m::leases_held(self.held.len() + self.in_flight.len());
            if stopping && self.is_idle() {
                break;
            }
            let event = self.next_event(stopping).await;
            // Tests only: an await that does not return, as an unbounded call would.
            #[cfg(feature = "failpoints")]
            if let Some(Some(ms)) = fail::eval("dispatch-loop-stall", |arg| {
                arg.and_then(|a| a.parse::<u64>().ok())
            }) {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            let handled = std::panic::catch_unwind(AssertUnwindSafe(|| self.handle(event)));
            if let Err(panic) = handled
                && self.contain(panic.as_ref())
            {
                break;
            }
        }
        if let Some(mut publisher) = self.publisher.take() {
            publisher.close().await;
        }
        crate::service::shutdown::stall().await;
        tracing::info!("dispatch loop stopped");
        match self.failed.take() {
            Some(what) => Err(DispatchError::Panicked(what)),
            None => Ok(()),
        }
    }

    /// Cancels [`Dispatcher::drain_over`] once shutdown has lasted `shutdown_timeout` and half
    /// the daemon's grace (the other half is for what follows the loop).
    fn start_drain_timer(&self) {
        let limit = self
            .config
            .dispatch
            .shutdown_timeout
            .saturating_add(crate::service::shutdown::GRACE / 2);
        let (shutdown, drain_over) = (self.shutdown.clone(), self.drain_over.clone());
        crate::host::spawn(async move {
            tokio::select! {
                _ = async { shutdown.cancelled().await; tokio::time::sleep(limit).await } => {}
                _ = drain_over.cancelled() => {}
            }
            drain_over.cancel();
        });
    }

    /// A handler panicked: the daemon is failed and shuts down, releasing what the loop holds.
    /// Returns `true` if the loop already failed once: then it gives up at once, and the
    /// leases it holds expire.
    fn contain(&mut self, panic: &(dyn std::any::Any + Send)) -> bool {
        let what = panic_message(panic);
        if self.failed.is_some() {
            tracing::error!(panic = %what, "dispatch loop panicked again while stopping; its leases will expire");
            return true;
        }
        tracing::error!(panic = %what, "dispatch handler panicked; releasing what is held and stopping");
        self.health.fail("dispatch");
        m::task_failure("dispatch");
        self.failed = Some(what);
        self.shutdown.cancel();
        false
    }

    /// Waits for the next event. The only await of the loop.
    async fn next_event(&mut self, stopping: bool) -> Event {
        let now = Instant::now();
        let due_at = match (self.held.next_due(), &self.publisher) {
            (Some(due), Some(_)) => Some(held::instant_of(due, self.store.clock().earliest(), now)),
            _ => None,
        };
        let tick = self.next_tick(stopping, now);
        tokio::select! {
            _ = self.shutdown.cancelled(), if !stopping => Event::Shutdown,
            Some(done) = self.tasks.join_next() => Event::Finished(done),
            _ = self.signals.inserted.notified(), if !stopping => Event::WokenUp,
            _ = self.signals.control.notified(), if !stopping => Event::ControlChanged,
            _ = tokio::time::sleep_until(due_at.unwrap_or(now)), if due_at.is_some() => Event::Due,
            _ = tokio::time::sleep_until(tick) => Event::Tick,
        }
    }

    /// The next instant something other than a task or a due record needs the loop: a claim
    /// that can start, a reconnect, or the heartbeat.
    fn next_tick(&self, stopping: bool, now: Instant) -> Instant {
        let mut tick = now + HEARTBEAT;
        if !stopping {
            if self.can_claim() {
                tick = tick.min(self.claims.next_at());
            }
            if self.publisher.is_some() && !self.link_up {
                tick = tick.min(self.next_connect);
            }
        }
        tick.max(now)
    }

    /// One handler per event.
    fn handle(&mut self, event: Event) {
        // Tests only: a handler that panics (supervision tests).
        #[cfg(feature = "failpoints")]
        if fail::eval("dispatch-handler-panic", |_| ()).is_some() {
            panic!("failpoint dispatch-handler-panic");
        }
        match event {
            Event::Shutdown => self.on_shutdown(),
            Event::Finished(Ok(done)) => self.on_finished(done),
            Event::Finished(Err(e)) => self.on_task_died(e),
            Event::WokenUp => self.claims.wake(),
            // `start_work` applies the new control at the top of the loop, before any claim.
            Event::ControlChanged => self.claims.wake(),
            // Due records and due claims are started by `start_work` at the top of the loop.
            Event::Due | Event::Tick => {}
        }
    }

    fn on_finished(&mut self, done: Done) {
        match done {
            Done::Claim {
                started,
                waited,
                result,
            } => self.on_claimed(started, waited, result),
            Done::Link { publisher, work } => {
                self.link_task = None;
                self.end_wave();
                self.frame_max = publisher.frame_max();
                let was_up = std::mem::replace(&mut self.link_up, publisher.is_connected());
                if self.link_up && !was_up {
                    // A first connect, or a reconnect (by a connect or by a wave's own).
                    tracing::info!("RabbitMQ connection open");
                }
                self.publisher = Some(*publisher);
                match work {
                    LinkWork::Connected(result) => self.on_connected(result),
                    LinkWork::Wave {
                        outcomes,
                        message_ids,
                        took,
                    } => self.on_wave_sent(outcomes, message_ids, took),
                }
            }
            Done::Removed => self.removals -= 1,
            Done::Settled { refused } => {
                self.settling -= 1;
                self.leave_out(refused);
            }
        }
    }

    /// The wave in flight ended, whatever its outcome.
    fn end_wave(&mut self) {
        self.wave = None;
    }

    /// Shutdown: no new claims; what is held and not sent is released at once.
    fn on_shutdown(&mut self) {
        let held = self.held.take_all();
        if !held.is_empty() {
            tracing::info!(
                records = held.len(),
                "shutdown: releasing claimed records not yet sent"
            );
        }
        self.release_records(held, "shutdown");
    }

    /// A background task panicked or was cancelled.
    fn on_task_died(&mut self, e: JoinError) {
        tracing::error!(error = %e, "a dispatch task died");
        if self.link_task == Some(e.id()) {
            // The wave's outcomes are unknown: release its records (possible duplicates),
            // and open a new link.
            self.link_task = None;
            self.end_wave();
            let n = self.in_flight.len();
            m::possible_duplicates(m::DUPLICATE_PANIC, n);
            let in_flight = std::mem::take(&mut self.in_flight);
            self.release_records(in_flight, "publish_failed");
            // The same broker, and the watch the loop reads (issue 25, 8.8: a publisher built
            // afresh had a watch of its own, and `connection.blocked` went unseen from then on).
            self.publisher = Some(Publisher::renewed(&self.config.rabbitmq, &self.watch));
            self.link_up = false;
        } else if self.claims.is_running() {
            // Settling tasks catch their own panics, so this was the claim.
            let wait = self
                .claim_pacing
                .failed(&StoreError::Panicked("the claim task died".into()));
            self.claims.failed(wait);
        }
    }

    /// Starts whatever is due: settling, a connect, a wave, a claim. Never awaits.
    fn start_work(&mut self, stopping: bool) {
        if self.link_up && self.publisher.as_ref().is_some_and(|p| !p.is_connected()) {
            tracing::warn!("RabbitMQ connection lost; reconnecting");
            self.link_up = false;
            self.health.set_up(m::RABBITMQ, false);
        }
        if stopping && !self.held.is_empty() {
            self.on_shutdown();
        }
        self.check_blocked();
        if !stopping {
            self.apply_control();
        }
        self.start_settling();
        if stopping {
            return;
        }
        self.start_link_work();
        if self.can_claim() && self.claims.is_due(Instant::now()) {
            self.start_claim();
        }
        if self.rate_saturated() {
            // It holds what `max_rate` lets it send: records waiting meanwhile wait by design.
            self.health.progress().made();
        }
    }

    /// Starts removals and other settling while there are free slots. Releases come first.
    fn start_settling(&mut self) {
        let now = self.store.clock().latest();
        self.settle
            .release_expiring(now, self.config.dispatch.lease_safety_margin);
        while self.removals < MAX_REMOVALS && !self.settle.confirmed.is_empty() {
            let confirmed = std::mem::take(&mut self.settle.confirmed);
            for (lease, batch) in settle::by_lease(confirmed, |r| r.lease) {
                let records: Vec<(Bson, TimeoutRecord)> =
                    batch.into_iter().map(|r| (r.id, r.record)).collect();
                let (store, health, shutdown, drain_over) = (
                    self.store.clone(),
                    self.health.clone(),
                    self.shutdown.clone(),
                    self.drain_over.clone(),
                );
                self.removals += 1;
                crate::host::spawn_in(&mut self.tasks, async move {
                    let removal =
                        settle::remove(&store, &health, &records, &lease, &shutdown, &drain_over);
                    if AssertUnwindSafe(removal).catch_unwind().await.is_err() {
                        tracing::error!(%lease.owner, "removing sent records panicked; they come back when the lease expires");
                    }
                    Done::Removed
                });
            }
        }
        while self.settling < MAX_SETTLING
            && let Some(work) = self.settle.pop_front()
        {
            let (store, retry) = (self.store.clone(), self.config.retry.clone());
            let history = self.history.clone();
            let refused = work.refused_destination();
            self.settling += 1;
            crate::host::spawn_in(&mut self.tasks, async move {
                if AssertUnwindSafe(work.run(&store, &retry, history.as_ref()))
                    .catch_unwind()
                    .await
                    .is_err()
                {
                    tracing::error!(
                        "settling a record panicked; it comes back when its lease expires"
                    );
                }
                Done::Settled { refused }
            });
        }
    }

    /// Queues releases ahead of other settling: a released record is one a peer can send.
    /// [`Dispatcher::release`] of records this instance holds.
    pub(super) fn release_records(&mut self, records: Vec<Ready>, reason: &'static str) {
        let held = records.into_iter().map(|r| (r.id, r.lease)).collect();
        self.release(held, reason);
    }

    pub(super) fn release(
        &mut self,
        held: Vec<(Bson, crate::store::lease::Lease)>,
        reason: &'static str,
    ) {
        for work in Settle::releases(held, reason).into_iter().rev() {
            self.settle.push_front(work);
        }
    }

    fn is_idle(&self) -> bool {
        self.tasks.is_empty()
            && self.settle.is_empty()
            && self.held.is_empty()
            && self.in_flight.is_empty()
    }
}

/// The loop dropped before it settled everything (aborted at the end of the shutdown's drain,
/// or stopped after a second panic): confirmed records that waited for a removal slot, and a
/// wave's records whose outcome never came back, stay leased and are sent again after the
/// lease. They are counted as possible duplicates.
impl Drop for Dispatcher {
    fn drop(&mut self) {
        let unsettled = self.settle.confirmed.len() + self.in_flight.len();
        if unsettled > 0 {
            tracing::warn!(
                records = unsettled,
                "the dispatch loop ended with sent records not removed; they may be sent again after the lease"
            );
            m::possible_duplicates(m::DUPLICATE_SHUTDOWN, unsettled);
        }
    }
}

#[cfg(test)]
mod tests;
