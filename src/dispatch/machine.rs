//! The dispatch core: one state machine that does no I/O, in the style of `quinn-proto`'s
//! `Connection`. [`Machine::handle`] takes what happened ([`Input`]), [`Machine::poll_command`]
//! says what to do next ([`Command`]), [`Machine::poll_timeout`] the next instant it cares
//! about. It reads no clock (every call is given [`Now`]) and spawns nothing; the driver
//! (`driver.rs`) runs its commands as tasks and feeds their results back.
//!
//! `ARCHITECTURE.md` ("One record, from claim to delete") follows one record through it.
//!
//! Long, as one concept: the rules a record meets from claim to delete, which ARCHITECTURE.md asks
//! a reader to follow in one reading; the claim schedule (`claims.rs`), the leased type
//! (`leased.rs`), the settling work (`settle.rs`) and the tests (`machine_tests.rs`) are apart.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::time::Instant;

use bson::{Bson, DateTime, Document};

use super::claims::{Claims, Gate, Step};
use super::control::Control;
use super::delivered::Delivered;
use super::leased::{Held, Leased, instant_of, triage};
use super::settle::{Failure, Settle, SettleQueue, by_lease};
use super::summary::WaveSummary;
use crate::config::Config;
use crate::host::backoff::Backoff;
use crate::metrics as m;
use crate::rabbit::publisher::{PublishError, SendOutcome};
use crate::record::message::{self, OutgoingMessage};
use crate::service::health::Health;
use crate::store::StoreError;
use crate::store::claim::{Candidates, Claim, ClaimedRow};
use crate::store::control::Snapshot;
use crate::store::history::{self, Row};
use crate::store::lease::{Lease, PrePublish};
use crate::store::pacing::Pacing;
use crate::store::parking::ParkReason;

/// The log line when a blocked connection makes the loop release what it holds (said in two
/// places).
const BLOCKED: &str = "releasing claimed records: RabbitMQ blocks the connection";

/// Most settling tasks at once.
pub const MAX_SETTLING: usize = 8;

/// The instant, as the machine is told it: monotonic, and the server's clock as this instance
/// can bound it ([`crate::store::clock::ServerClock`]).
#[derive(Debug, Clone, Copy)]
pub struct Now {
    pub at: Instant,
    /// The earliest the server's clock can read: "is it due?".
    pub earliest: DateTime,
    /// The best estimate: stamps.
    pub server: DateTime,
    /// The latest it can read: "how much of the lease is left?".
    pub latest: DateTime,
    /// This host's wall clock, for the message's own timestamp.
    pub wall: SystemTime,
}

/// What happened.
#[derive(Debug)]
pub enum Input {
    /// SIGTERM or SIGINT, or a failure elsewhere in the daemon.
    Shutdown,
    /// A record was inserted due before the next poll.
    Inserted,
    /// The pauses and ramps in force (the same `Arc` again is no change).
    Control(Arc<Snapshot>),
    /// Whether the broker blocks the open connection (only a change counts).
    Blocked(bool),
    /// The link was found closed (heeded only while it is idle).
    LinkLost,
    /// A connect ended: the connection's `frame_max`, or why it failed.
    Connected(Result<u32, PublishError>),
    /// The broker answered one publish of the wave in flight.
    Answered,
    /// The wave ended: one outcome per message, and the connection's `frame_max` if it is
    /// still open.
    WaveSent {
        outcomes: Vec<SendOutcome>,
        open: Option<u32>,
    },
    /// The task that had the link died (panicked): the wave's outcomes are unknown.
    LinkDied,
    /// A claim's read came back.
    Candidates(Result<Candidates, StoreError>),
    /// A claim's take came back.
    Claimed(Result<Claim, StoreError>),
    /// Settling work of `records` records ended; `refused`: the destination of a refused
    /// send it retried or parked. A removal's: the records it was `removing`, and those it
    /// left `lapsed`, their lease over first (delivered all the same).
    Settled {
        records: usize,
        refused: Option<String>,
        removing: Vec<Bson>,
        lapsed: Vec<Bson>,
    },
    /// Time passed (a deadline of [`Machine::poll_timeout`], or the heartbeat).
    Timeout,
}

/// What to do next.
#[derive(Debug)]
pub enum Command {
    /// Read up to `batch` claimable records due within `ahead`, leaving out `excluded`.
    Read {
        batch: u32,
        ahead: Duration,
        excluded: Vec<String>,
    },
    /// Lease the candidates read for `lease`.
    Take {
        candidates: Candidates,
        lease: Duration,
    },
    /// Open the link.
    Connect,
    /// Publish a wave built against `frame_max`, beginning no message's publish at or after
    /// its `begin_by` (one per message: its lease within the safety margin); it reports
    /// [`Input::Answered`] at the first answer and [`Input::WaveSent`] at its end.
    Publish {
        messages: Vec<OutgoingMessage>,
        frame_max: u32,
        begin_by: Vec<Instant>,
    },
    /// The wave's deadline passed: stop waiting for its publishes and confirms.
    StopWaiting,
    Settle(Settle),
    /// Confirmed waves, for `[history] keep`.
    History(Vec<Row>),
    /// The shutdown's drain is over: removals still running give up.
    DrainOver,
}

/// The RabbitMQ link, as the machine knows it.
#[derive(Debug)]
pub enum Link {
    /// Closed; the next connect may start at `retry_at`.
    Down {
        retry_at: Instant,
    },
    Opening,
    /// Open, with the connection's `frame_max`.
    Idle {
        frame_max: u32,
    },
    /// A wave is out.
    Publishing(Wave),
}

/// The wave in flight.
#[derive(Debug)]
pub struct Wave {
    /// Its records, in message order, and each message's `MessageId` (for history).
    records: Vec<Leased>,
    message_ids: Vec<Option<String>>,
    started: Instant,
    /// When its publishes and confirms stop being awaited.
    deadline: Instant,
    stopped: bool,
    /// The broker answered one of its publishes.
    answered: bool,
}

/// The settling tasks running and the records they settle.
#[derive(Debug, Default)]
struct Settling {
    tasks: usize,
    records: usize,
}

/// The dispatch core's state. One per process.
pub struct Machine {
    config: Arc<Config>,
    health: Arc<Health>,
    link: Link,
    /// Spaces the reconnects; reset by a connect that succeeds.
    reconnect: Backoff,
    /// The broker blocks the open connection (a memory or disk alarm).
    blocked: bool,
    claims: Claims,
    held: Held,
    /// Records the broker confirmed that are not known removed: a claim of this instance
    /// that takes one again removes it instead of sending it again.
    delivered: Delivered,
    settle: SettleQueue,
    settling: Settling,
    control: Control,
    history: bool,
    /// When shutdown began.
    stopping: Option<Instant>,
    drained: bool,
    /// A turn panicked: what is left unsettled at the drop counts as cause `panic`.
    panicked: bool,
    /// Commands decided by an input, given out before anything else.
    outbox: VecDeque<Command>,
}

impl Machine {
    pub fn new(config: Arc<Config>, health: Arc<Health>, at: Instant) -> Self {
        Self {
            claims: Claims {
                poll: config.dispatch.poll_interval,
                step: Step::Idle,
                next_at: at,
                woken: false,
                cut_at: None,
                not_before: at,
                failures: Pacing::new(config.mongodb.operation_timeout),
                unconfirmed: Backoff::reconnect(),
            },
            control: Control::new(config.clone()),
            config,
            health,
            link: Link::Down { retry_at: at },
            reconnect: Backoff::reconnect(),
            blocked: false,
            held: Held::default(),
            delivered: Delivered::default(),
            settle: SettleQueue::default(),
            settling: Settling::default(),
            history: false,
            stopping: None,
            drained: false,
            panicked: false,
            outbox: VecDeque::new(),
        }
    }

    /// Whether confirmed waves are recorded (`[history] keep`).
    pub fn record_history(&mut self, on: bool) {
        self.history = on;
    }

    /// A turn panicked (the driver caught it and stops the machine).
    pub fn panicked(&mut self) {
        self.panicked = true;
    }

    /// Whether it was told of shutdown.
    pub fn is_stopping(&self) -> bool {
        self.stopping.is_some()
    }

    /// Whether a wave waits for the broker's first answer.
    pub fn awaits_answer(&self) -> bool {
        matches!(&self.link, Link::Publishing(w) if !w.answered && !w.stopped)
    }

    /// Records this instance holds under a lease and has not settled: held, in flight,
    /// waiting to settle and settling. A removal that retries through a MongoDB outage holds
    /// its records all the while (they counted as none: `tests/suite/faults.rs`,
    /// `mongodb_cut_between_publish_and_delete_restored_within_the_lease`, read the removals
    /// before they had ended).
    pub fn leases_held(&self) -> usize {
        self.held.len() + self.in_flight() + self.settle.records() + self.settling.records
    }

    /// The records of the wave in flight.
    fn in_flight(&self) -> usize {
        match &self.link {
            Link::Publishing(w) => w.records.len(),
            _ => 0,
        }
    }

    /// Whether it holds what its own `max_rate` lets it send: records wait by design.
    pub fn rate_saturated(&self) -> bool {
        self.control.saturated(self.held.len())
    }

    /// Shutdown began and nothing is left: nothing held, in flight, queued or running.
    pub fn is_done(&self) -> bool {
        self.stopping.is_some()
            && matches!(self.claims.step, Step::Idle)
            && matches!(self.link, Link::Down { .. } | Link::Idle { .. })
            && self.settling.tasks == 0
            && self.settle.is_empty()
            && self.held.is_empty()
    }

    /// Whether a claim may start once its time comes ([`Machine::claim_ahead`]).
    pub fn can_claim(&self, now: &Now) -> bool {
        self.claim_ahead(now).is_some()
    }

    /// How far ahead a claim may read if one may start once its time comes: the link is up
    /// and not blocked by the broker, no claim is running, fewer than two batches wait to
    /// settle ([`SettleQueue`] says why; two, so that while one batch of refusals settles, a
    /// claim that leaves their destination out still serves the others), and fewer than two
    /// batches are held. With two batches held, one more may be taken of the records due
    /// before the soonest held one, while that is still ahead: a record inserted due sooner
    /// than everything held is not kept waiting behind it (the simulation's `late` invariant,
    /// seed 2938: an instance of batch 1 held two records and sent one inserted due before
    /// both 767 ms late), and an instance whose held records are due takes no more.
    /// The link is up and not blocked by the broker: what is claimed now can be sent.
    fn link_carries(&self) -> bool {
        matches!(self.link, Link::Idle { .. } | Link::Publishing(_)) && !self.blocked
    }

    pub fn claim_ahead(&self, now: &Now) -> Option<Duration> {
        let batch = self.config.dispatch.batch_size as usize;
        let look_ahead = self.config.dispatch.look_ahead();
        let may = self.link_carries()
            && self.stopping.is_none()
            && matches!(self.claims.step, Step::Idle)
            && !self.settle.is_full(2 * batch)
            && !self.rate_saturated();
        match self.held.len() {
            _ if !may => None,
            held if held < 2 * batch => Some(look_ahead),
            held if held < 3 * batch => {
                // Strictly before it: records due at the same instant stay for a later claim.
                let soonest = self.held.next_due()?.timestamp_millis();
                let ahead = soonest
                    .checked_sub(now.server.timestamp_millis())?
                    .saturating_sub(1);
                let ahead = u64::try_from(ahead).ok().filter(|ms| *ms > 0)?;
                Some(Duration::from_millis(ahead).min(look_ahead))
            }
            _ => None,
        }
    }

    /// The next instant the machine cares about: a record falling due, a claim, a
    /// reconnect, the wave's deadline, the end of the shutdown's drain.
    pub fn poll_timeout(&self, now: &Now) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut at = |t: Instant| next = Some(next.map_or(t, |n| n.min(t)));
        match &self.link {
            Link::Down { retry_at } if self.stopping.is_none() => at(*retry_at),
            Link::Publishing(w) if !w.stopped => at(w.deadline),
            _ => {}
        }
        if matches!(self.link, Link::Down { .. } | Link::Idle { .. })
            && let Some(due) = self.held.next_due()
        {
            at(instant_of(due, now.earliest, now.at));
        }
        if self.can_claim(now) {
            at(self.claims.next_at());
        }
        if let Some(began) = self.stopping
            && !self.drained
        {
            at(self.drain_at(began));
        }
        next
    }

    /// What happened.
    pub fn handle(&mut self, input: Input, now: &Now) {
        match input {
            Input::Shutdown => self.on_shutdown(now),
            Input::Inserted => self.claims.wake(now.at),
            Input::Control(snapshot) => {
                if self
                    .control
                    .apply(snapshot, &mut self.held, &mut self.settle)
                {
                    self.claims.wake(now.at);
                }
            }
            Input::Blocked(blocked) => self.on_blocked(blocked),
            Input::LinkLost => {
                if matches!(self.link, Link::Idle { .. }) {
                    let wait = self.reconnect.next_delay();
                    tracing::warn!(retry_in = ?wait, "RabbitMQ connection lost; reconnecting");
                    self.health.set_up(m::RABBITMQ, false);
                    self.link = Link::Down {
                        retry_at: now.at + wait,
                    };
                }
            }
            Input::Connected(result) => self.on_connected(result, now),
            Input::Answered => self.on_answered(now.at),
            Input::WaveSent { outcomes, open } => self.on_wave_sent(outcomes, open, now),
            Input::LinkDied => {
                // Spaced as a failed connect is: a link task that dies in every connect (a
                // panic in the handshake) reconnected at once, for ever.
                let wait = self.reconnect.next_delay();
                tracing::error!(retry_in = ?wait, "the task that had the RabbitMQ link died; reconnecting");
                self.health.set_up(m::RABBITMQ, false);
                let down = Link::Down {
                    retry_at: now.at + wait,
                };
                if let Link::Publishing(wave) = std::mem::replace(&mut self.link, down) {
                    // The wave's outcomes are unknown: possible duplicates, and unanswered.
                    m::possible_duplicates(m::DUPLICATE_PANIC, wave.records.len());
                    let ids: Vec<Bson> = wave.records.iter().map(|r| r.id.clone()).collect();
                    self.settle.release_all(wave.records, "publish_failed");
                    self.unanswered(&ids, now.at);
                    self.end_gate(false, now.at);
                }
            }
            // A failed read or take, or a claim task that died, whichever step it was in.
            Input::Candidates(Err(e)) | Input::Claimed(Err(e)) => {
                if !matches!(self.claims.step, Step::Idle) {
                    self.claim_failed(e, now);
                }
            }
            Input::Candidates(Ok(candidates)) => self.on_candidates(candidates, now),
            Input::Claimed(Ok(claim)) => self.on_claimed(claim, now),
            Input::Settled {
                records,
                refused,
                removing,
                lapsed,
            } => {
                self.settling.tasks = self.settling.tasks.saturating_sub(1);
                self.settling.records = self.settling.records.saturating_sub(records);
                let until = now.at + self.config.dispatch.lock_lease;
                self.delivered.removed(&removing, &lapsed, until);
                self.control.leave_out(refused, now.at);
            }
            Input::Timeout => {}
        }
    }

    /// What to do next; `None` when nothing is due now.
    pub fn poll_command(&mut self, now: &Now) -> Option<Command> {
        if let Some(command) = self.outbox.pop_front() {
            return Some(command);
        }
        if let Some(began) = self.stopping
            && !self.drained
            && now.at >= self.drain_at(began)
        {
            self.drained = true;
            return Some(Command::DrainOver);
        }
        if let Link::Publishing(w) = &mut self.link
            && !w.stopped
            && now.at >= w.deadline
        {
            w.stopped = true;
            let answered = w.answered;
            self.end_gate(answered, now.at);
            return Some(Command::StopWaiting);
        }
        if let Some(work) = self.next_settling(now) {
            return Some(Command::Settle(work));
        }
        if self.stopping.is_some() {
            return None;
        }
        if let Link::Down { retry_at } = self.link
            && now.at >= retry_at
        {
            self.link = Link::Opening;
            return Some(Command::Connect);
        }
        // Due by the earliest the server's clock can read (never before it is due there).
        if self.held.next_due().is_some_and(|d| d <= now.earliest) {
            match self.link {
                Link::Idle { frame_max } => {
                    if let Some(publish) = self.wave(frame_max, now) {
                        return Some(publish);
                    }
                    // Everything due was held back, released or parked: settle it.
                    return self.poll_command(now);
                }
                // No wave is built without a link: its frame_max would be a guess. What
                // falls due while the reconnect waits out its back-off is released, so that
                // an instance whose broker answers can send it.
                Link::Down { .. } => {
                    let due = self.held.take_due(now.earliest);
                    for _ in &due {
                        m::publish_failure("connection");
                    }
                    self.settle.release_all(due, "publish_failed");
                    return self.poll_command(now);
                }
                Link::Opening | Link::Publishing(_) => {}
            }
        }
        // `claim_ahead` says no claim is running.
        let ahead = self.claim_ahead(now);
        let horizon = |ahead: Duration| {
            let ms = i64::try_from(ahead.as_millis()).unwrap_or(i64::MAX);
            now.server.timestamp_millis().saturating_add(ms)
        };
        // The last claim was cut short by held records, and this one may read further: records
        // due in between may fall due before the next poll (the simulation's `late` invariant,
        // seed 7763: an instance of batch 1 holding two records sent a third, due 86 ms after
        // the soonest held, 256 ms late, at the next poll after that one went out).
        if let (Some(ahead), Some(cut_at)) = (ahead, self.claims.cut_at)
            && horizon(ahead) > cut_at
        {
            self.claims.cut_at = None;
            self.claims.wake(now.at);
        }
        if let Some(ahead) = ahead
            && now.at >= self.claims.next_at()
        {
            self.claims.cut_at =
                (ahead < self.config.dispatch.look_ahead()).then(|| horizon(ahead));
            let gate = match &self.link {
                Link::Publishing(w) if !w.answered && w.stopped => Gate::Shut,
                Link::Publishing(w) if !w.answered => Gate::Waiting,
                _ => Gate::Open,
            };
            self.claims.step = Step::Reading {
                started: now.at,
                gate,
            };
            return Some(Command::Read {
                batch: self.config.dispatch.batch_size,
                ahead,
                excluded: self.control.excluded(&self.held, now.at, now.server),
            });
        }
        None
    }

    /// Queues the removal of confirmed records, known delivered until it ends.
    fn remove(&mut self, lease: Lease, records: Vec<Leased>) {
        self.delivered
            .removing(records.iter().map(|r| (&r.id, r.record.due)));
        self.settle.push(Settle::Remove { lease, records });
    }

    /// The next settling work while a slot is free. Work that would outlive its lease is
    /// released first.
    fn next_settling(&mut self, now: &Now) -> Option<Settle> {
        let margin = self.config.dispatch.lease_safety_margin;
        self.settle.release_expiring(now.latest, margin);
        if self.settling.tasks >= MAX_SETTLING {
            return None;
        }
        let work = self.settle.pop()?;
        self.settling.tasks += 1;
        self.settling.records += work.records();
        Some(work)
    }

    /// When the shutdown's drain ends: `shutdown_timeout` and half the daemon's grace after
    /// it began (the other half is for what follows the loop).
    fn drain_at(&self, began: Instant) -> Instant {
        let limit = self.config.dispatch.shutdown_timeout;
        crate::deadline::later(
            began,
            limit.saturating_add(crate::service::shutdown::GRACE / 2),
        )
    }

    /// Shutdown: no new claims; what is held and not sent is released at once; the wave in
    /// flight is waited for at most `shutdown_timeout`. Counted from the first: the driver
    /// says it again after a panic during the drain, which must not move the drain's end.
    fn on_shutdown(&mut self, now: &Now) {
        let began = *self.stopping.get_or_insert(now.at);
        self.release_held(
            "shutdown",
            "shutdown: releasing claimed records not yet sent",
        );
        self.end_gate(false, now.at);
        let limit = self.shutdown_limit(began);
        if let Link::Publishing(w) = &mut self.link {
            w.deadline = w.deadline.min(limit);
        }
    }

    /// How long the wave in flight is waited for after shutdown began.
    fn shutdown_limit(&self, began: Instant) -> Instant {
        crate::deadline::later(began, self.config.dispatch.shutdown_timeout)
    }

    /// Follows `connection.blocked` and `connection.unblocked`: while blocked nothing is
    /// claimed, what is held is released (it cannot be sent), and `/readyz` is 503.
    fn on_blocked(&mut self, blocked: bool) {
        if blocked == self.blocked {
            return;
        }
        self.blocked = blocked;
        self.health.set_blocked(blocked);
        m::rabbitmq_blocked(blocked);
        if blocked {
            tracing::warn!(
                "RabbitMQ blocked the connection (memory or disk alarm): not claiming until it unblocks"
            );
            self.release_held("blocked", BLOCKED);
        } else {
            tracing::info!("RabbitMQ unblocked the connection; claiming again");
        }
    }

    /// Releases every held record, saying `why` when there are some.
    fn release_held(&mut self, reason: &'static str, why: &str) {
        let held = self.held.take_all();
        if !held.is_empty() {
            tracing::info!(records = held.len(), "{why}");
            self.settle.release_all(held, reason);
        }
    }

    fn on_connected(&mut self, result: Result<u32, PublishError>, now: &Now) {
        self.link = match result {
            // The back-off starts again once the link has carried a confirm, not at the
            // connect: a broker that takes the handshake and drops the link (closed by an
            // operator's script, a proxy) was reconnected to at once, for ever (found in
            // review).
            Ok(frame_max) => {
                tracing::info!("RabbitMQ connection open");
                self.health.set_up(m::RABBITMQ, true);
                Link::Idle { frame_max }
            }
            Err(PublishError::Stopped) => {
                tracing::debug!("shutdown began before the RabbitMQ connection was open");
                Link::Down { retry_at: now.at }
            }
            Err(e) => {
                self.health.set_up(m::RABBITMQ, false);
                let wait = self.reconnect.next_delay();
                tracing::warn!(error = %e, retry_in = ?wait, "RabbitMQ unreachable; not claiming");
                Link::Down {
                    retry_at: now.at + wait,
                }
            }
        };
    }

    fn on_candidates(&mut self, candidates: Candidates, now: &Now) {
        let Step::Reading { started, gate } = self.claims.step else {
            return;
        };
        let spent = now.at.saturating_duration_since(started);
        match candidates {
            // Nothing is taken during shutdown, after the wave it waited on ended unanswered,
            // during the hold-off after unconfirmed publishes (the records they released may
            // be among the candidates), or while the link could not carry them (down, or
            // blocked by the broker: they would be released at once).
            candidates
                if self.stopping.is_some()
                    || gate == Gate::Shut
                    || now.at < self.claims.not_before
                    || !self.link_carries() =>
            {
                self.claims.finished(started, candidates.more(), now.at);
            }
            // A claim beside an unanswered wave takes its candidates only once the broker
            // answered that wave: the database is not idle while the broker works, and an
            // instance whose broker stalled hoards nothing.
            candidates if gate == Gate::Waiting && !candidates.is_empty() => {
                self.claims.step = Step::Gated {
                    started,
                    spent,
                    candidates,
                };
            }
            candidates => self.take(started, spent, candidates, now.at),
        }
    }

    fn take(&mut self, started: Instant, spent: Duration, candidates: Candidates, at: Instant) {
        self.claims.step = Step::Taking {
            started,
            spent,
            resumed: at,
        };
        let lease = self.config.dispatch.lock_lease;
        self.outbox.push_back(Command::Take { candidates, lease });
    }

    fn on_answered(&mut self, at: Instant) {
        if let Link::Publishing(w) = &mut self.link {
            w.answered = true;
        }
        self.end_gate(true, at);
    }

    /// The wait of a gated claim is over: it takes its candidates (`take`), or takes nothing
    /// (the wave ended unanswered, or shutdown, or a hold-off after unconfirmed publishes runs). A claim still reading learns it too.
    fn end_gate(&mut self, take: bool, at: Instant) {
        match std::mem::replace(&mut self.claims.step, Step::Idle) {
            Step::Reading {
                started,
                gate: Gate::Waiting,
            } => {
                let gate = if take { Gate::Open } else { Gate::Shut };
                self.claims.step = Step::Reading { started, gate };
            }
            // The claim's duration leaves the wait out.
            Step::Gated {
                started,
                spent,
                candidates,
            } if take && at >= self.claims.not_before && self.link_carries() => {
                self.take(started, spent, candidates, at)
            }
            Step::Gated {
                started,
                candidates,
                ..
            } => self.claims.finished(started, candidates.more(), at),
            step => self.claims.step = step,
        }
    }

    fn claim_failed(&mut self, e: StoreError, now: &Now) {
        // A claim task that panicked is timeoutd's fault, not the database's.
        if !matches!(e, StoreError::Panicked(_)) {
            self.health.set_up(m::MONGODB, false);
        }
        let wait = self.claims.failures.delay_after(&e);
        tracing::warn!(error = %e, retry_in = ?wait, "claim failed");
        self.claims.failed(wait, now.at);
    }

    fn on_claimed(&mut self, claim: Claim, now: &Now) {
        let Step::Taking {
            started,
            spent,
            resumed,
        } = self.claims.step
        else {
            return;
        };
        self.health.set_up(m::MONGODB, true);
        if claim.read > 0 {
            // The claim path reaches due records (taken, or lost to a racing instance).
            self.health.progress().made();
        }
        self.claims.failures.reset();
        m::claim_duration(spent + now.at.saturating_duration_since(resumed));
        self.claims.finished(started, claim.more, now.at);
        if claim.rows.is_empty() {
            return;
        }
        let lease = claim.lease;
        let owner = lease.owner;
        // At info, with the instance: ties the owner `list` shows to the process holding it.
        tracing::info!(%owner, instance = crate::service::buildinfo::instance(), claimed = claim.rows.len(), "claimed batch");
        m::claimed(claim.rows.len());
        // Delivered already (helper-22: a claim running when the confirm came took the record
        // again after its lease ran out, and it was sent a second time): removed under this
        // lease, not sent again, nor released below for a peer to send (helper-25).
        self.delivered.prune(now.at);
        let (again, rows): (Vec<_>, Vec<_>) = (claim.rows.into_iter()).partition(|row| {
            (row.record.as_ref()).is_ok_and(|r| self.delivered.has(&row.id, r.due, now.at))
        });
        let again: Vec<Leased> = again
            .into_iter()
            .filter_map(|row| self.triaged(row, lease))
            .collect();
        if !again.is_empty() {
            self.remove(lease, again);
        }
        if self.stopping.is_some() {
            let rows = rows.into_iter().map(|r| (r.id, lease)).collect();
            return self.settle.release(rows, "shutdown");
        }
        // Publishes went unconfirmed while it was taking: the records they released may be
        // among its rows (their leases ran out during the wave), and none may go out again
        // before the hold-off ends, as none is taken after it began (simulation seed 5067).
        if now.at < self.claims.not_before {
            let rows = rows.into_iter().map(|r| (r.id, lease)).collect();
            return self.settle.release(rows, "publish_failed");
        }
        for row in rows {
            if let Some(leased) = self.triaged(row, lease) {
                self.held.push(leased);
            }
        }
        if self.blocked {
            self.release_held("blocked", BLOCKED);
        }
    }

    /// A claimed row as the leased record it is from now on; `None` when it cannot be sent
    /// (parked, with the reason).
    fn triaged(&mut self, row: ClaimedRow, lease: Lease) -> Option<Leased> {
        match triage(row.record) {
            Ok(record) => Some(Leased {
                id: row.id,
                raw: row.raw,
                record,
                lease,
            }),
            Err(why) => {
                self.park(row.id, row.raw, String::new(), lease, why);
                None
            }
        }
    }

    /// Builds a wave of every held record that is due: too-late ones are released,
    /// unsendable ones parked, held-back ones sorted by [`Control::hold_back`]. `None` when
    /// nothing is left to publish.
    fn wave(&mut self, frame_max: u32, now: &Now) -> Option<Command> {
        let margin = self.config.dispatch.lease_safety_margin;
        // The lease left by the latest the server's clock can read, checked before the rate
        // limits: a record released as too late spends no token a record that goes out needs.
        let (due, too_late): (Vec<Leased>, Vec<Leased>) = self
            .held
            .take_due(now.earliest)
            .into_iter()
            .partition(|r| r.lease.before_publish(now.latest, margin) == PrePublish::Publish);
        let (held, settle) = (&mut self.held, &mut self.settle);
        let send = self
            .control
            .hold_back(due, held, settle, now.at, now.earliest, now.latest);
        let mut messages = Vec::new();
        let mut records = Vec::new();
        for r in send {
            match message::build_contained(&r.record, &self.config.rabbitmq, now.wall, frame_max) {
                Ok(m) => {
                    messages.push(m);
                    records.push(r);
                }
                Err(e) => {
                    let why = (ParkReason::Unsendable, e.to_string());
                    self.park(r.id, r.raw, r.record.destination, r.lease, why);
                }
            }
        }
        if !too_late.is_empty() {
            m::skipped("margin", too_late.len());
            self.settle.release_all(too_late, "margin");
        }
        if messages.is_empty() {
            return None;
        }
        tracing::debug!(records = messages.len(), "publishing a wave");
        let message_ids = messages
            .iter()
            .map(|m| m.properties.message_id().as_ref().map(|id| id.to_string()))
            .collect();
        // Every record passed the margin check: each lease leaves some time before it.
        let begin_by = records
            .iter()
            .map(|r| r.lease.remaining(now.latest).saturating_sub(margin))
            .map(|left| crate::deadline::later(now.at, left))
            .collect();
        let deadline = crate::deadline::later(now.at, self.config.rabbitmq.publish_timeout);
        let limit = self.stopping.map(|began| self.shutdown_limit(began));
        self.link = Link::Publishing(Wave {
            records,
            message_ids,
            started: now.at,
            deadline: limit.map_or(deadline, |l| deadline.min(l)),
            stopped: false,
            answered: false,
        });
        Some(Command::Publish {
            messages,
            frame_max,
            begin_by,
        })
    }

    /// A wave's outcomes are known: each record is settled now, the wave is summarised in
    /// one line, and the confirmed records go to history (which nothing here waits for).
    fn on_wave_sent(&mut self, outcomes: Vec<SendOutcome>, open: Option<u32>, now: &Now) {
        // A link that carried a confirm works: the back-off starts again, before a link lost
        // with this wave takes its next delay (found in review: it took the delay grown by
        // the outage before, up to 10 s).
        let any_confirmed = outcomes.iter().any(|o| matches!(o, SendOutcome::Confirmed));
        if any_confirmed {
            self.reconnect.reset();
        }
        let next = match open {
            Some(frame_max) => Link::Idle { frame_max },
            None => Link::Down {
                retry_at: now.at + self.reconnect.next_delay(),
            },
        };
        let Link::Publishing(wave) = std::mem::replace(&mut self.link, next) else {
            return;
        };
        // A wave answered and ended by the same confirm (one message) may end before the
        // driver passed its first answer on: an answer among its outcomes counts.
        let answered = wave.answered || outcomes.iter().any(SendOutcome::is_answer);
        let took = now.at.saturating_duration_since(wave.started);
        // A wave the broker answered nothing of (not sent, its connect failed, given up on)
        // is not a confirm time.
        if answered {
            m::publish_confirm(took);
        }
        self.health.set_up(m::RABBITMQ, open.is_some());
        let confirmed_at = now.server;
        let mut summary = WaveSummary::default();
        let (mut confirmed, mut failed, mut refusing, mut unknown, mut fired) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let outcomes = outcomes
            .into_iter()
            .chain(std::iter::repeat(SendOutcome::NotSent("no outcome".into())));
        for ((r, outcome), message_id) in
            wave.records.into_iter().zip(outcomes).zip(wave.message_ids)
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
                    self.health.progress().made();
                    summary.confirmed(destination, late_ms);
                    if self.history {
                        fired.push(history::fired(&r.id, &r.record, message_id, confirmed_at));
                    }
                    self.control.accepted(destination);
                    confirmed.push(r);
                }
                SendOutcome::Returned | SendOutcome::Nacked => {
                    summary.refused += 1;
                    refusing.push(destination.clone());
                    m::publish_failure(outcome.reason());
                    self.settle.push(Settle::Refused {
                        leased: Box::new(r),
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
        // A confirmed record this instance holds again (a claim took it while the wave
        // outlived its lease) was delivered: it is removed under the lease that holds it now,
        // not sent again. Only a lease the server's clock may have passed lets a claim take it.
        let lapsed: Vec<(Bson, DateTime)> = confirmed
            .iter()
            .filter(|c| !c.lease.is_live(now.latest))
            .map(|c| (c.id.clone(), c.record.due))
            .collect();
        if !lapsed.is_empty() {
            // A copy due at another instant was moved since: a timeout to fire again.
            let copies = self.held.take_matching(|h| {
                lapsed
                    .iter()
                    .any(|(id, due)| h.id == *id && h.record.due == *due)
            });
            let until = now.at + self.config.dispatch.lock_lease;
            self.delivered
                .left(lapsed.iter().map(|(id, due)| (id, *due)), until);
            confirmed.retain(|c| !copies.iter().any(|h| h.id == c.id));
            confirmed.extend(copies);
        }
        self.control.leave_out(refusing, now.at);
        for (lease, records) in by_lease(confirmed, |r| r.lease) {
            self.remove(lease, records);
        }
        if !fired.is_empty() {
            self.outbox.push_back(Command::History(fired));
        }
        self.settle.release(failed, "publish_failed");
        if !unknown.is_empty() {
            self.unanswered(&unknown, now.at);
        } else if any_confirmed {
            self.claims.unconfirmed.reset();
        }
        // Last: a hold-off this wave set keeps a gated claim from taking.
        self.end_gate(answered, now.at);
    }

    /// Publishes of `ids` went unanswered (given up at the wave's deadline, lost with the
    /// link, or with the task that had it). A link that withholds confirms must not get the
    /// same records again at once, and gets them later and later while it goes on withholding
    /// them: its own back-off, which the reconnect that usually follows does not reset. A wave
    /// that outlived its leases may see a claim of this instance take the same records again
    /// meanwhile: those copies wait for the hold-off too (simulation seed 5067: sent again
    /// 2 ms after the wave gave up on them).
    fn unanswered(&mut self, ids: &[Bson], at: Instant) {
        let again = self.held.take_matching(|h| ids.contains(&h.id));
        self.settle.release_all(again, "publish_failed");
        let wait = self.claims.unconfirmed.next_delay();
        tracing::warn!(retry_in = ?wait, "publishes went unconfirmed; backing off before the next claim");
        self.claims.hold_off(wait, at);
    }

    /// Queues the parking of a record no attempt can fix, with why.
    fn park(
        &mut self,
        id: Bson,
        raw: Document,
        destination: String,
        lease: Lease,
        why: (ParkReason, String),
    ) {
        let (reason, error) = why;
        m::skipped(reason.as_str(), 1);
        let failure = Failure {
            reason,
            error,
            attempts: 0,
        };
        self.settle.push(Settle::Park {
            id,
            raw: Box::new(raw),
            destination,
            lease,
            failure,
        });
    }
}

/// The machine dropped before it settled everything (the loop aborted at the end of the
/// shutdown's drain, or stopped after a second panic): confirmed records that waited for a
/// removal, and a wave's records whose outcome never came back, stay leased and are sent
/// again after the lease. They are counted as possible duplicates, of cause `panic` once a
/// turn panicked (the runbook looks for a bug there, not at `shutdown_timeout`).
impl Drop for Machine {
    fn drop(&mut self) {
        let unsettled = self.settle.unremoved() + self.in_flight();
        if unsettled > 0 {
            tracing::warn!(
                records = unsettled,
                "the dispatch loop ended with sent records not removed; they may be sent again after the lease"
            );
            let cause = match self.panicked {
                true => m::DUPLICATE_PANIC,
                false => m::DUPLICATE_SHUTDOWN,
            };
            m::possible_duplicates(cause, unsettled);
        }
    }
}

#[cfg(test)]
#[path = "machine_tests.rs"]
mod tests;
