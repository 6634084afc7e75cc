//! The driver: runs the [`Machine`]'s commands as tasks and feeds their results back, through
//! one `select!`. It owns everything the machine must not touch: the clocks, the store, the
//! publisher, the tasks, the signals of the rest of the daemon.
//!
//! Every call to MongoDB or RabbitMQ runs in a task under a deadline, so the loop turns at
//! least once a [`HEARTBEAT`], and each turn tells [`Health`] it is live. A panic in the
//! machine is caught: the daemon is marked failed, the loop releases what it holds and
//! returns an error, and the process exits non-zero. A task that panics is told apart by its
//! id: the machine hears which one died.
//!
//! Long, as one concept: each command's task and the one `select!` that turns its result into an
//! input belong side by side, so that a reader sees which input every task returns (about 480 lines
//! of code, the rest its tests).

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::{Id, JoinSet};
use tokio::time::Instant;

use bson::Bson;

use tokio_util::sync::CancellationToken;

use super::machine::{Command, Input, Machine, Now};
use super::settle::{Settle, Settler};
use super::{DispatchError, Signals};
use crate::config::Config;
use crate::metrics as m;
use crate::operator::control::ControlState;
use crate::rabbit::publisher::{LinkWatch, PublishError, Publisher, SendOutcome};
use crate::record::message::OutgoingMessage;
use crate::service::health::Health;
use crate::service::supervisor::panic_message;
use crate::store::StoreError;
use crate::store::claim::{Candidates, Claim, ClaimPath};
use crate::store::history::HistorySink;
use crate::store::shapes::Shapes;

/// How often the loop turns when nothing happens, so that liveness keeps being reported.
const HEARTBEAT: Duration = Duration::from_secs(1);

/// What a task reports when it ends.
enum Done {
    Read(Result<Candidates, StoreError>),
    Taken(Result<Claim, StoreError>),
    /// The task that had the link gives it back.
    Connected(Box<Publisher>, Result<(), PublishError>),
    Sent(Box<Publisher>, Vec<SendOutcome>),
    Settled {
        refused: Option<String>,
        /// The work released records.
        released: bool,
        /// Sent records a removal left when their lease ran out.
        lapsed: Vec<Bson>,
    },
}

/// The tokens of the wave in flight: the publisher cancels `answered` at the broker's first
/// answer; the driver cancels `stop_waiting` when the machine says so.
struct WaveTokens {
    answered: CancellationToken,
    stop_waiting: CancellationToken,
}

/// Which task an id is, for one that panicked.
#[derive(Debug, Clone, PartialEq)]
enum Role {
    Claim,
    Link,
    /// Settling work of this many records; a removal's, of the records `removing`.
    Settle {
        records: usize,
        removing: Vec<Bson>,
    },
}

/// The records a task of `role` settles, and those it removes (none, for a task that does
/// not settle).
fn settles(role: Option<Role>) -> (usize, Vec<Bson>) {
    match role {
        Some(Role::Settle { records, removing }) => (records, removing),
        _ => (0, Vec::new()),
    }
}

/// The dispatch loop: the machine and what runs its commands. One per process.
pub struct Dispatcher {
    config: Arc<Config>,
    claims: Arc<ClaimPath>,
    /// The learner's `Time` shapes: a change wakes the claims.
    shapes: Shapes,
    health: Arc<Health>,
    shutdown: CancellationToken,
    signals: Signals,
    control: Arc<ControlState>,
    machine: Machine,
    /// The RabbitMQ link; `None` while a task uses it.
    publisher: Option<Publisher>,
    /// Whether the broker blocks the open connection, read while a task has the publisher.
    watch: LinkWatch,
    tasks: JoinSet<Done>,
    roles: HashMap<Id, Role>,
    /// The wave in flight's tokens.
    wave: Option<WaveTokens>,
    /// What settling runs against, history's sink among it.
    settler: Settler,
    failed: Option<String>,
}

impl Dispatcher {
    pub fn new(
        config: Arc<Config>,
        claims: ClaimPath,
        control: Arc<ControlState>,
        publisher: Publisher,
        health: Arc<Health>,
        shutdown: CancellationToken,
        signals: Signals,
    ) -> Self {
        let machine = Machine::new(config.clone(), health.clone(), Instant::now());
        let settler = Settler {
            store: claims.store().clone(),
            retry: config.retry.clone(),
            history: None,
            health: health.clone(),
            shutdown: shutdown.clone(),
            drain_over: CancellationToken::new(),
        };
        Self {
            config,
            shapes: claims.shapes(),
            claims: Arc::new(claims),
            health,
            shutdown,
            signals,
            control,
            machine,
            watch: publisher.watch(),
            publisher: Some(publisher),
            tasks: JoinSet::new(),
            roles: HashMap::new(),
            wave: None,
            settler,
            failed: None,
        }
    }

    /// Records what fires and what is parked through `sink` (`[history] keep`).
    pub fn with_history(mut self, sink: Option<HistorySink>) -> Self {
        self.machine.record_history(sink.is_some());
        self.settler.history = sink;
        self
    }

    /// Runs until shutdown; then releases what it holds (owner-guarded), waits for the wave
    /// in flight (at most `shutdown_timeout`) and for the settling it started, closes the
    /// broker connection and returns. Returns an error if the machine panicked.
    pub async fn run(mut self) -> Result<(), DispatchError> {
        let mut input = Input::Control(self.control.get());
        loop {
            self.health.beat();
            let turn = std::panic::catch_unwind(AssertUnwindSafe(|| self.turn(input)));
            let now = match turn {
                Ok(now) => now,
                Err(panic) if self.contain(panic.as_ref()) => break,
                // Failed: it stops at once, releasing what it holds.
                Err(_) => {
                    let stop = AssertUnwindSafe(|| self.step(Input::Shutdown));
                    match std::panic::catch_unwind(stop) {
                        Ok(now) => now,
                        Err(panic) => {
                            self.contain(panic.as_ref());
                            break;
                        }
                    }
                }
            };
            if self.machine.is_done() {
                break;
            }
            input = self.next_input(&now).await;
            // Tests only: an await that does not return, as an unbounded call would.
            #[cfg(feature = "failpoints")]
            if let Some(Some(ms)) = fail::eval("dispatch-loop-stall", |arg| {
                arg.and_then(|a| a.parse::<u64>().ok())
            }) {
                tokio::time::sleep(Duration::from_millis(ms)).await;
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

    fn now(&self) -> Now {
        let clock = self.claims.store().clock();
        Now {
            at: Instant::now(),
            earliest: clock.earliest(),
            server: clock.now(),
            latest: clock.latest(),
            wall: crate::host::wall_now(),
        }
    }

    /// One turn of the loop.
    fn turn(&mut self, input: Input) -> Now {
        // Tests only: a handler that panics (supervision tests).
        #[cfg(feature = "failpoints")]
        if fail::eval("dispatch-handler-panic", |_| ()).is_some() {
            panic!("failpoint dispatch-handler-panic");
        }
        self.step(input)
    }

    /// Hands the machine `input` and what the driver sees of the link, then runs every
    /// command it gives. Never awaits.
    fn step(&mut self, input: Input) -> Now {
        let now = self.now();
        self.machine.handle(input, &now);
        // The machine heeds each only when it changes something.
        let blocked = self.watch.blocked();
        self.machine.handle(Input::Blocked(blocked), &now);
        if self.publisher.as_ref().is_some_and(|p| !p.is_connected()) {
            self.machine.handle(Input::LinkLost, &now);
        }
        while let Some(command) = self.machine.poll_command(&now) {
            self.run_command(command);
        }
        m::leases_held(self.machine.leases_held());
        if self.machine.rate_saturated() {
            // It holds what `max_rate` lets it send: records waiting meanwhile wait by design.
            self.health.progress().made();
        }
        now
    }

    /// A panic in the machine: the daemon is failed and shuts down, releasing what the loop
    /// holds. Returns `true` if the loop already failed once: then it gives up at once, and
    /// the leases it holds expire.
    fn contain(&mut self, panic: &(dyn std::any::Any + Send)) -> bool {
        self.machine.panicked();
        let what = panic_message(panic);
        if self.failed.is_some() {
            tracing::error!(panic = %what, "dispatch loop panicked again while stopping; its leases will expire");
            return true;
        }
        tracing::error!(panic = %what, "dispatch handler panicked; releasing what is held and stopping");
        // Counted once, by the supervisor, when the loop ends with the failure or outlasts
        // the drain.
        self.health.fail("dispatch");
        self.failed = Some(what);
        self.shutdown.cancel();
        false
    }

    /// Waits for the next input. The only await of the loop.
    async fn next_input(&mut self, now: &Now) -> Input {
        // The machine's own word, not the token's: a shutdown that came during a turn is
        // still handed to it (the token's guard left it unheard, and a connect that stopped
        // for shutdown was retried at once, for ever: simulation seed 1451).
        let stopping = self.machine.is_stopping();
        let tick = self
            .machine
            .poll_timeout(now)
            .map_or(now.at + HEARTBEAT, |t| t.min(now.at + HEARTBEAT))
            .max(now.at);
        let answered = self
            .wave
            .as_ref()
            .filter(|_| self.machine.awaits_answer())
            .map(|w| w.answered.clone());
        let answered = async {
            match answered {
                Some(token) => token.cancelled_owned().await,
                None => std::future::pending().await,
            }
        };
        // Shutdown first; the timer last (every turn acts on whatever time has passed). A wave
        // answered and ended by the same confirm may be heard ended before answered: the
        // machine reads the answer from its outcomes.
        tokio::select! {
            biased;
            _ = self.shutdown.cancelled(), if !stopping => Input::Shutdown,
            Some(done) = self.tasks.join_next_with_id() => self.finished(done),
            _ = self.signals.inserted.notified(), if !stopping => Input::Inserted,
            // Records of a shape the claims did not query may be due.
            _ = self.shapes.changed(), if !stopping => Input::Inserted,
            _ = self.signals.control.notified(), if !stopping => Input::Control(self.control.get()),
            _ = answered => Input::Answered,
            _ = tokio::time::sleep_until(tick) => Input::Timeout,
        }
    }

    /// A task ended: what it reports, as the machine's input.
    fn finished(&mut self, done: Result<(Id, Done), tokio::task::JoinError>) -> Input {
        let (done, role) = match done {
            Ok((id, done)) => (done, self.roles.remove(&id)),
            Err(e) => {
                tracing::error!(error = %e, "a dispatch task died");
                return match self.roles.remove(&e.id()) {
                    Some(Role::Link) => {
                        // The same broker, and the watch the loop reads (issue 25, 8.8: a
                        // publisher built afresh had a watch of its own, and
                        // `connection.blocked` went unseen from then on).
                        self.publisher =
                            Some(Publisher::renewed(&self.config.rabbitmq, &self.watch));
                        self.wave = None;
                        Input::LinkDied
                    }
                    Some(Role::Claim) => {
                        let why = StoreError::Panicked("the claim task died".into());
                        Input::Claimed(Err(why))
                    }
                    role @ (Some(Role::Settle { .. }) | None) => {
                        tracing::error!(
                            "settling panicked; its records come back when their lease expires"
                        );
                        self.claims.released();
                        // A removal that died may have left every record it had.
                        let (records, removing) = settles(role);
                        Input::Settled {
                            records,
                            refused: None,
                            lapsed: removing.clone(),
                            removing,
                        }
                    }
                };
            }
        };
        match done {
            Done::Read(result) => Input::Candidates(result),
            Done::Taken(result) => Input::Claimed(result),
            Done::Connected(publisher, result) => {
                let result = result.map(|()| publisher.frame_max());
                self.publisher = Some(*publisher);
                Input::Connected(result)
            }
            Done::Sent(publisher, outcomes) => {
                let open = publisher.is_connected().then(|| publisher.frame_max());
                self.publisher = Some(*publisher);
                self.wave = None;
                Input::WaveSent { outcomes, open }
            }
            Done::Settled {
                refused,
                released,
                lapsed,
            } => {
                if released {
                    self.claims.released();
                }
                let (records, removing) = settles(role);
                Input::Settled {
                    records,
                    refused,
                    removing,
                    lapsed,
                }
            }
        }
    }

    fn spawn(&mut self, role: Role, task: impl Future<Output = Done> + Send + 'static) {
        let handle = crate::host::spawn_in(&mut self.tasks, task);
        self.roles.insert(handle.id(), role);
    }

    fn run_command(&mut self, command: Command) {
        match command {
            Command::Read {
                batch,
                ahead,
                excluded,
            } => {
                let claims = self.claims.clone();
                self.spawn(Role::Claim, async move {
                    let read = claims.candidates(batch, ahead, &excluded);
                    let store = claims.store();
                    Done::Read(store.bounded("read claim candidates", read).await)
                });
            }
            Command::Take { candidates, lease } => {
                let claims = self.claims.clone();
                self.spawn(Role::Claim, async move {
                    let take = claims.take(candidates, lease);
                    let store = claims.store();
                    Done::Taken(store.bounded("take claim candidates", take).await)
                });
            }
            Command::Connect => {
                let mut publisher = self.take_publisher();
                let shutdown = self.shutdown.clone();
                self.spawn(Role::Link, async move {
                    let result = tokio::select! {
                        r = publisher.connect() => r,
                        // Not `Ok`: a connect cut short says nothing of the broker (issue 25:
                        // it marked RabbitMQ up).
                        _ = shutdown.cancelled() => Err(PublishError::Stopped),
                    };
                    Done::Connected(Box::new(publisher), result)
                });
            }
            Command::Publish {
                messages,
                frame_max,
                begin_by,
            } => self.publish(messages, frame_max, begin_by),
            Command::StopWaiting => {
                if let Some(wave) = &self.wave {
                    wave.stop_waiting.cancel();
                }
            }
            Command::Settle(work) => self.settle(work),
            Command::History(rows) => {
                if let Some(sink) = &self.settler.history {
                    sink.record(rows);
                }
            }
            Command::DrainOver => self.settler.drain_over.cancel(),
        }
    }

    /// The publisher, for a task that connects or publishes. The machine does either only
    /// while the link is down or idle, when the driver holds it; were it ever missing, a new
    /// one over the same broker and watch connects afresh.
    fn take_publisher(&mut self) -> Publisher {
        self.publisher
            .take()
            .unwrap_or_else(|| Publisher::renewed(&self.config.rabbitmq, &self.watch))
    }

    fn settle(&mut self, work: Settle) {
        let refused = match &work {
            Settle::Refused { leased, .. } => Some(leased.record.destination.clone()),
            _ => None,
        };
        // A refused send may be released for a retry too.
        let released = matches!(work, Settle::Release { .. } | Settle::Refused { .. });
        let records = work.records();
        let removing = match &work {
            Settle::Remove { records, .. } => records.iter().map(|r| r.id.clone()).collect(),
            _ => Vec::new(),
        };
        let settling = self.settler.run(work);
        self.spawn(Role::Settle { records, removing }, async move {
            let lapsed = settling.await;
            Done::Settled {
                refused,
                released,
                lapsed,
            }
        });
    }

    /// Publishes a wave pipelined, in a task that owns the link until the wave ends.
    fn publish(&mut self, messages: Vec<OutgoingMessage>, built_for: u32, begin_by: Vec<Instant>) {
        let mut publisher = self.take_publisher();
        let (answered, stop_waiting) = (CancellationToken::new(), CancellationToken::new());
        self.wave = Some(WaveTokens {
            answered: answered.clone(),
            stop_waiting: stop_waiting.clone(),
        });
        let shutdown = self.shutdown.clone();
        self.spawn(Role::Link, async move {
            // The wave's own connect (the link dropped since the wave was built) yields to
            // shutdown like every other connect, and to the wave's deadline: a connect that
            // tries each node in turn could otherwise publish the wave long after the lease
            // margin was checked. Nothing of the wave went out, so its records are released.
            let connected = tokio::select! {
                biased;
                connected = publisher.connect() => connected.map_err(|e| e.to_string()),
                _ = shutdown.cancelled() => {
                    Err("shutdown began before the connection was reopened".to_string())
                }
                _ = stop_waiting.cancelled() => {
                    Err("the wave's deadline passed before the connection was reopened".to_string())
                }
            };
            let not_sent = |why: String| vec![SendOutcome::NotSent(why); messages.len()];
            let outcomes = match connected {
                // The link dropped since the wave was built and the new connection has
                // another limit: the messages were checked against the wrong one.
                Ok(()) if publisher.frame_max() != built_for => not_sent(format!(
                    "the connection was reopened with frame_max {} where the wave was built for {built_for}",
                    publisher.frame_max()
                )),
                Ok(()) => {
                    publisher
                        .publish_batch(&messages, &stop_waiting, &answered, &begin_by)
                        .await
                }
                Err(why) => not_sent(why),
            };
            Done::Sent(Box::new(publisher), outcomes)
        });
    }
}

#[cfg(test)]
mod tests {
    //! The driver's own work: tasks that connect and publish yield to shutdown, and a link
    //! task that dies leaves the loop a publisher whose links its watch follows. MongoDB is
    //! never contacted.

    use super::*;
    use crate::dispatch::settle::tests::silent_server;
    use crate::rabbit::publisher::tests::fake::FakeBroker;
    use crate::record::TimeoutRecord;
    use crate::record::message::DEFAULT_FRAME_MAX;
    use crate::store::Store;
    use crate::store::clock::ServerClock;

    async fn dispatcher(config: Config, publisher: Option<Publisher>) -> Dispatcher {
        let store = Store::connect(&config.mongodb, ServerClock::default())
            .await
            .expect("store");
        let publisher = match publisher {
            Some(p) => p,
            None => Publisher::new(&config.rabbitmq).expect("publisher"),
        };
        let health = Arc::new(Health::new(config.dispatch.poll_interval));
        let claims = ClaimPath::new(store, Shapes::Fixed(Vec::new()));
        Dispatcher::new(
            Arc::new(config),
            claims,
            Arc::default(),
            publisher,
            health,
            CancellationToken::new(),
            Signals::default(),
        )
    }

    /// An instant the test never reaches.
    fn far() -> Instant {
        Instant::now() + Duration::from_secs(86_400)
    }

    /// A message of one record due now.
    fn a_message(d: &Dispatcher) -> OutgoingMessage {
        let record = TimeoutRecord {
            id: crate::host::uuid(),
            destination: "q".into(),
            process_manager_id: crate::host::uuid(),
            due: crate::host::wall_date(),
            headers: bson::doc! {},
        };
        let (rabbit, now) = (&d.config.rabbitmq, crate::host::wall_now());
        crate::record::message::build(&record, rabbit, now, DEFAULT_FRAME_MAX).expect("a message")
    }

    async fn next_input(d: &mut Dispatcher) -> Input {
        let done = tokio::time::timeout(Duration::from_secs(20), d.tasks.join_next_with_id())
            .await
            .expect("a task ends")
            .expect("a task");
        d.finished(done)
    }

    /// A wave whose link dropped, reconnecting to a broker that accepts connections and never
    /// answers, and the listener that keeps it so.
    async fn a_wave_reconnecting_to_a_silent_broker() -> (Dispatcher, std::net::TcpListener) {
        let (server, port) = silent_server();
        let mut config = Config::default();
        config.rabbitmq.uri = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
        config.rabbitmq.connect_timeout = Duration::from_secs(600);
        let mut d = dispatcher(config, None).await;
        d.publish(vec![a_message(&d)], DEFAULT_FRAME_MAX, vec![far()]);
        tokio::time::sleep(Duration::from_secs(1)).await;
        (d, server)
    }

    /// The wave ends at once, its record not sent; returns whether the link is open.
    async fn the_wave_ends_at_once_unsent(d: &mut Dispatcher) -> Option<u32> {
        let began = Instant::now();
        let Input::WaveSent { outcomes, open } = next_input(d).await else {
            panic!("not the wave's end");
        };
        assert!(
            began.elapsed() < Duration::from_secs(1),
            "ended when told, not at its connect's deadline"
        );
        assert!(
            matches!(outcomes.as_slice(), [SendOutcome::NotSent(_)]),
            "{outcomes:?}"
        );
        open
    }

    /// Issue 25, 8.6: a wave whose link dropped reconnects first; that connect did not yield
    /// to shutdown and held the loop's drain for up to `connect_timeout`. It yields now, and
    /// the wave's records, not sent, are released.
    #[tokio::test(start_paused = true)]
    async fn a_waves_own_connect_yields_to_shutdown() {
        let (mut d, _server) = a_wave_reconnecting_to_a_silent_broker().await;
        d.shutdown.cancel();
        assert_eq!(the_wave_ends_at_once_unsent(&mut d).await, None);
    }

    /// A wave's own connect ran past the wave's deadline (each node up to `connect_timeout`),
    /// and then published the wave, long after its lease margin was checked. It yields to the
    /// deadline, and the wave's records, not sent, are released.
    #[tokio::test(start_paused = true)]
    async fn a_waves_own_connect_yields_to_the_waves_deadline() {
        let (mut d, _server) = a_wave_reconnecting_to_a_silent_broker().await;
        d.run_command(Command::StopWaiting);
        the_wave_ends_at_once_unsent(&mut d).await;
    }

    /// Simulation seed 1451: SIGTERM came while the loop was in a turn; the wait for the
    /// next input guarded its shutdown branch by the token, already cancelled, so the machine
    /// never heard of it, and a connect that stopped for shutdown was retried at once, for
    /// ever (virtual time stood still). The machine hears of a shutdown however it came.
    #[tokio::test(start_paused = true)]
    async fn a_shutdown_that_came_during_a_turn_reaches_the_machine() {
        let mut d = dispatcher(Config::default(), None).await;
        d.shutdown.cancel();
        let now = d.now();
        let input = d.next_input(&now).await;
        assert!(matches!(input, Input::Shutdown), "{input:?}");
    }

    /// Every command the machine gives now, not run.
    fn commands(d: &mut Dispatcher, now: &Now) -> Vec<Command> {
        std::iter::from_fn(|| d.machine.poll_command(now)).collect()
    }

    /// A claim that began beside an unanswered wave waits for the broker's first answer
    /// before it takes its candidates. A wave of one message is answered and ends at once
    /// (its one confirm is both): the loop heard the wave's end first, the machine took the
    /// wave as unanswered, and the claim dropped its candidates until the next poll.
    #[tokio::test(start_paused = true)]
    async fn a_claim_beside_a_wave_confirmed_at_once_takes_its_candidates() {
        use crate::rabbit::link::Answer;
        use crate::rabbit::publisher::tests::fake::Script;
        use crate::store::claim::ClaimedRow;
        use crate::store::lease::Lease;
        let broker = Arc::new(FakeBroker::default());
        broker.link(vec![Script::Ready(Answer::Ack(None))], None);
        let config = Config::default();
        let poll = config.dispatch.poll_interval;
        let mut publisher = Publisher::with_broker(&config.rabbitmq, broker);
        publisher.connect().await.expect("connected");
        let mut d = dispatcher(config, Some(publisher)).await;
        let now = d.now();
        assert!(matches!(commands(&mut d, &now)[..], [Command::Connect]));
        d.machine
            .handle(Input::Connected(Ok(DEFAULT_FRAME_MAX)), &now);
        assert!(matches!(commands(&mut d, &now)[..], [Command::Read { .. }]));
        let one = |n| Candidates::of(vec![bson::Bson::Int32(n)]);
        d.machine.handle(Input::Candidates(Ok(one(1))), &now);
        assert!(matches!(commands(&mut d, &now)[..], [Command::Take { .. }]));
        let record = TimeoutRecord {
            id: crate::host::uuid(),
            destination: "q".into(),
            process_manager_id: crate::host::uuid(),
            // Due by the earliest the server's clock can read: `now.server` is read from the
            // wall clock after `now.earliest` and may be a millisecond past it (CI: the record
            // was not due, nothing was sent, and the next claim was not gated).
            due: now.earliest,
            headers: bson::doc! {},
        };
        let row = ClaimedRow {
            id: bson::Bson::Int32(1),
            raw: bson::doc! {},
            record: Ok(record),
        };
        let claim = Claim {
            lease: Lease::new(now.server, Duration::from_secs(60)),
            rows: vec![row],
            more: false,
            read: 1,
        };
        d.machine.handle(Input::Claimed(Ok(claim)), &now);
        let sent = commands(&mut d, &now);
        assert!(matches!(sent[..], [Command::Publish { .. }]), "{sent:?}");
        sent.into_iter().for_each(|c| d.run_command(c));
        // The next claim begins beside the wave, which the broker has not answered yet.
        let mut later = now;
        later.at += poll;
        assert!(matches!(
            commands(&mut d, &later)[..],
            [Command::Read { .. }]
        ));
        d.machine.handle(Input::Candidates(Ok(one(2))), &later);
        assert!(commands(&mut d, &later).is_empty(), "gated");
        // The broker confirms the one message: the wave is answered and ends.
        tokio::time::sleep(Duration::from_millis(10)).await;
        let (mut took, mut confirmed) = (false, false);
        for _ in 0..2 {
            let input = d.next_input(&later).await;
            if let Input::WaveSent { outcomes, .. } = &input {
                confirmed = matches!(outcomes[..], [SendOutcome::Confirmed]);
            }
            d.machine.handle(input, &later);
            let commands = commands(&mut d, &later);
            took |= commands.iter().any(|c| matches!(c, Command::Take { .. }));
        }
        assert!(confirmed, "the wave was confirmed");
        assert!(
            took,
            "the claim took its candidates once the wave was answered"
        );
    }

    fn the_link_task_panics() -> Done {
        panic!("the link task panics (test)")
    }

    /// Issue 25, 8.8: after the task that owned the link died, the publisher was built afresh
    /// with a watch of its own while the loop kept reading the old one: `connection.blocked`
    /// went unseen from then on. The recreated publisher shows its links to the loop's watch.
    #[tokio::test]
    async fn the_blocked_watch_follows_a_publisher_recreated_after_its_task_died() {
        let broker = Arc::new(FakeBroker::default());
        let status = broker.link(Vec::new(), None);
        let config = Config::default();
        let publisher = Publisher::with_broker(&config.rabbitmq, broker);
        let mut d = dispatcher(config, Some(publisher)).await;
        let owned = d.publisher.take();
        d.spawn(Role::Link, async move {
            drop(owned);
            the_link_task_panics()
        });
        assert!(matches!(next_input(&mut d).await, Input::LinkDied));
        assert!(d.publisher.is_some(), "recreated");
        d.run_command(Command::Connect);
        let connected = next_input(&mut d).await;
        assert!(
            matches!(connected, Input::Connected(Ok(_))),
            "{connected:?}"
        );
        status.set_blocked(true);
        d.turn(connected);
        let readiness = d.health.readiness();
        assert!(
            readiness
                .problems
                .iter()
                .any(|p| p.starts_with("rabbitmq blocked")),
            "{readiness:?}"
        );
    }
}
