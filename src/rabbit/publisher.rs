//! The publisher: one RabbitMQ connection with a publisher-confirm channel, to one node of
//! `[rabbitmq] uri` at a time ([`crate::config::nodes`]: a failed link fails over to the next node).
//!
//! A batch is published pipelined (every `basic.publish` goes out before any confirm is
//! awaited), then the confirms are awaited together. Each message gets its own
//! [`SendOutcome`]; only [`SendOutcome::Confirmed`] may lead to deleting its record.
//!
//! Long, as one concept: one connection's life: failover, a wave's pipelined publishes and their
//! confirms, returns matched to them, and the suspect-link policy share its state (about 500 lines
//! of code, the rest its tests).

use futures::FutureExt;
use futures::future::join_all;
use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::Poll;
use std::time::Duration;

use crate::config::RabbitConfig;
use crate::config::nodes::Nodes;
use crate::metrics as m;
use crate::rabbit::lapinlink::LapinBroker;
use crate::rabbit::link::{Answer, Broker, Confirm, Link};
use tokio_util::sync::CancellationToken;

use crate::record::message::OutgoingMessage;

pub use super::PublishError;

/// The fate of one published message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendOutcome {
    /// The broker confirmed it and routed it to a queue.
    Confirmed,
    /// Returned by the broker: no queue matches the routing key (mandatory publish).
    Returned,
    /// The broker nacked it.
    Nacked,
    /// No confirm arrived before the publisher stopped waiting: the message may or may not
    /// have been delivered. Also an ack whose message's `basic.return` may have gone with a
    /// confirm the publisher stopped waiting for ([`settle`]): it may or may not have been
    /// routed.
    TimedOut,
    /// The connection or channel failed after the message went out: it may or may not have
    /// been delivered.
    Connection(String),
    /// The connection was down before the message went out: it was not delivered.
    NotSent(String),
}

impl SendOutcome {
    /// A short label for logs and metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            SendOutcome::Confirmed => "confirmed",
            SendOutcome::Returned => "returned",
            SendOutcome::Nacked => "nacked",
            SendOutcome::TimedOut => "timeout",
            SendOutcome::Connection(_) | SendOutcome::NotSent(_) => "connection",
        }
    }

    /// Whether this is the broker's answer to the message (a confirm, with or without a
    /// return, or a nack): the link answers.
    pub fn is_answer(&self) -> bool {
        matches!(
            self,
            SendOutcome::Confirmed | SendOutcome::Returned | SendOutcome::Nacked
        )
    }

    /// Whether the broker may have delivered the message although no confirm says so.
    pub fn outcome_unknown(&self) -> bool {
        matches!(self, SendOutcome::TimedOut | SendOutcome::Connection(_))
    }
}

/// How the wait for one message's answer ended.
#[derive(Debug)]
enum Waited {
    /// The broker answered. `late`: read after the wave's deadline had passed, or after a
    /// publish of the wave failed (either may have abandoned a confirm before this answer).
    Answer { answer: Answer, late: bool },
    /// Its publish or its confirm was given up on while still pending: the confirm may yet
    /// arrive, and carry the `basic.return` of another message of the channel, which is then
    /// lost with it.
    Abandoned,
    /// Failed, or never sent.
    Failed(SendOutcome),
}

/// Turns the answers of one batch into one outcome per message.
///
/// A `basic.return` precedes its message's ack, but the client hands each return to whichever
/// confirm it resolves next (lapin pops the oldest waiting return for each ack or nack), which
/// under pipelining and multiple-acks is often another message's. So returns are matched to
/// messages by `MessageId`, never by the ack they came with. A return that names no message of
/// the batch makes every acked message of the batch count as returned: sent again rather than
/// lost.
///
/// When a confirm was abandoned ([`Waited::Abandoned`], or a publish that failed after its
/// confirm was registered: `publish_failed`), a return may be lost with it. An ack read before any
/// confirm was abandoned, carrying no return or its own, is still sure: every return waiting
/// when it resolved was handed to a confirm resolved before it, whose answer was read. Any
/// other ack (read late, or carrying another message's return, so its own may still have been
/// waiting) is of unknown outcome: the broker acked it, but whether it was routed is unknown.
/// It counts as [`SendOutcome::TimedOut`], released rather than deleted (a possible duplicate,
/// counted as such), never as confirmed.
///
/// A confirm that failed (its channel closed) took no return, and lapin drops the returns still
/// waiting then: an ack carrying another message's return, whose own may have been among them,
/// is of unknown outcome too, [`SendOutcome::Connection`] as the failure was. One carrying no
/// return or its own stays sure: a failed confirm took no return from it.
fn settle(
    message_ids: &[Option<String>],
    waits: Vec<Waited>,
    publish_failed: bool,
) -> Vec<SendOutcome> {
    let mut returned: HashSet<String> = HashSet::new();
    let mut unattributed = false;
    for w in &waits {
        if let Waited::Answer {
            answer: Answer::Ack(Some(r)) | Answer::Nack(Some(r)),
            ..
        } = w
        {
            match &r.message_id {
                Some(id) if message_ids.iter().flatten().any(|m| m == id) => {
                    returned.insert(id.clone());
                }
                _ => unattributed = true,
            }
        }
    }
    let given_up = publish_failed || waits.iter().any(|w| matches!(w, Waited::Abandoned));
    let confirm_failed = waits.iter().find_map(|w| match w {
        Waited::Failed(SendOutcome::Connection(why)) => Some(why.clone()),
        _ => None,
    });
    waits
        .into_iter()
        .zip(message_ids)
        .map(|(w, id)| {
            let was_returned = id.as_ref().is_some_and(|id| returned.contains(id));
            match w {
                Waited::Answer {
                    answer: Answer::Ack(_),
                    ..
                } if was_returned || unattributed => SendOutcome::Returned,
                Waited::Answer {
                    answer: Answer::Ack(carried),
                    late,
                } => {
                    let carried_another = carried
                        .as_ref()
                        .is_some_and(|r| r.message_id.as_deref() != id.as_deref());
                    if given_up && (late || carried_another) {
                        SendOutcome::TimedOut
                    } else if let Some(why) = confirm_failed.as_ref().filter(|_| carried_another) {
                        SendOutcome::Connection(why.clone())
                    } else {
                        SendOutcome::Confirmed
                    }
                }
                Waited::Answer {
                    answer: Answer::Nack(_),
                    ..
                } => SendOutcome::Nacked,
                Waited::Answer {
                    answer: Answer::NotRequested,
                    ..
                } => SendOutcome::Connection("channel is not in confirm mode".into()),
                Waited::Abandoned => SendOutcome::TimedOut,
                Waited::Failed(outcome) => outcome,
            }
        })
        .collect()
}

/// Awaits `fut` unless `stop` is cancelled: `Some((output, late))`, `late` when `stop` was
/// already cancelled as the output was read; `None` when `fut` was found pending after `stop`
/// was cancelled (it is then dropped, abandoned). An answer that is ready always wins over the
/// deadline (as a `biased` select would), and the deadline is read *before* `fut` is polled,
/// so an abandoned `fut` was still pending after the deadline passed: whatever it resolves to
/// later resolves after every answer read as not late ([`settle`] relies on it).
async fn until_stopped<F: Future + Unpin>(
    mut fut: F,
    stop: &CancellationToken,
) -> Option<(F::Output, bool)> {
    let cancelled = stop.cancelled();
    tokio::pin!(cancelled);
    std::future::poll_fn(|cx| {
        let late = stop.is_cancelled();
        if let Poll::Ready(out) = fut.poll_unpin(cx) {
            return Poll::Ready(Some((out, late)));
        }
        if late {
            return Poll::Ready(None);
        }
        // Registers the wake-up for the deadline; if it passed just now, look again at once.
        if cancelled.as_mut().poll(cx).is_ready() {
            cx.waker().wake_by_ref();
        }
        Poll::Pending
    })
    .await
}

/// What the dispatch loop reads while a wave owns the publisher: whether the broker blocked
/// the open link (`connection.blocked`, a memory or disk alarm) and has not unblocked it yet,
/// read from the link itself. It also keeps the [`Broker`], so that a publisher recreated
/// after its task died ([`Publisher::renewed`]) opens its links the same way and shows them to
/// the same watch: the loop then follows the new link by construction.
#[derive(Debug, Clone)]
pub struct LinkWatch {
    link: Arc<Mutex<Option<Weak<dyn Link>>>>,
    broker: Arc<dyn Broker>,
}

impl LinkWatch {
    /// Whether the open link is blocked by the broker.
    pub fn blocked(&self) -> bool {
        let link = self
            .link
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .and_then(Weak::upgrade);
        link.is_some_and(|l| {
            let status = l.status();
            status.connected && status.blocked
        })
    }

    fn set(&self, link: Option<&Arc<dyn Link>>) {
        *self.link.lock().unwrap_or_else(PoisonError::into_inner) = link.map(Arc::downgrade);
    }
}

/// A RabbitMQ publisher that reconnects on demand.
#[derive(Debug)]
pub struct Publisher {
    nodes: Nodes,
    broker: Arc<dyn Broker>,
    watch: LinkWatch,
    name: String,
    link: Option<Arc<dyn Link>>,
    /// The open link abandoned confirms while the broker blocked it: it is kept so that the
    /// dispatch loop sees the block, but publishes nothing more, and is replaced once the block
    /// lifts (a late confirm of it could carry the return of a later message).
    tainted: bool,
    connect_timeout: Duration,
}

impl Publisher {
    /// A publisher for `[rabbitmq]` through lapin; reads the TLS files now and connects on
    /// [`Publisher::connect`].
    pub fn new(config: &RabbitConfig) -> Result<Self, PublishError> {
        Ok(Self::with_broker(
            config,
            Arc::new(LapinBroker::new(config)?),
        ))
    }

    /// A publisher for `[rabbitmq]` whose links `broker` opens.
    pub fn with_broker(config: &RabbitConfig, broker: Arc<dyn Broker>) -> Self {
        let link = Arc::default();
        Self::with_watch(config, LinkWatch { link, broker })
    }

    /// A new publisher in place of one whose task died: the same broker, and the same watch
    /// (the dispatch loop holds it), now following this publisher's links.
    pub fn renewed(config: &RabbitConfig, watch: &LinkWatch) -> Self {
        watch.set(None);
        Self::with_watch(config, watch.clone())
    }

    fn with_watch(config: &RabbitConfig, watch: LinkWatch) -> Self {
        Self {
            nodes: Nodes::random_start(&config.uri),
            broker: Arc::clone(&watch.broker),
            watch,
            name: config.source_address.clone(),
            link: None,
            tainted: false,
            connect_timeout: config.connect_timeout,
        }
    }

    /// The largest frame the broker accepts on the open connection (its `frame_max`), or
    /// RabbitMQ's default before one is open. A message's content header must fit in it.
    pub fn frame_max(&self) -> u32 {
        match self.link.as_ref().map(|l| l.frame_max()) {
            Some(frame_max) if frame_max > 0 => frame_max,
            _ => crate::record::message::DEFAULT_FRAME_MAX,
        }
    }

    /// Whether the connection and channel are open (a link kept only to show the broker's
    /// block counts as open while the block lasts, and as lost once it lifts).
    pub fn is_connected(&self) -> bool {
        self.link.as_ref().is_some_and(|l| {
            let status = l.status();
            status.connected && (!self.tainted || status.blocked)
        })
    }

    /// Whether the open link may carry a wave.
    fn usable(&self) -> bool {
        !self.tainted && self.link.as_ref().is_some_and(|l| l.status().connected)
    }

    /// The broker's version from the handshake of the open link, when it said.
    pub fn server_version(&self) -> Option<String> {
        self.link.as_ref().and_then(|l| l.server_version())
    }

    /// What the dispatch loop reads to learn whether the broker blocked the connection.
    pub fn watch(&self) -> LinkWatch {
        self.watch.clone()
    }

    /// The node in use (`host:port`), or the one tried first.
    pub fn node(&self) -> String {
        self.nodes.current_label()
    }

    /// Opens the connection and a confirm-mode channel unless one that may carry a wave is
    /// open: to the node in use, or when its link failed (or withheld confirms) to the next
    /// node that answers, each within `[rabbitmq] connect_timeout`.
    pub async fn connect(&mut self) -> Result<(), PublishError> {
        if self.usable() {
            return Ok(());
        }
        if self.tainted {
            tracing::info!(
                "replacing the RabbitMQ link that withheld confirms while the broker blocked it"
            );
        }
        self.give_up_link();
        let mut last = None;
        for (index, uri) in self.nodes.order() {
            match self.open(&uri).await {
                Ok(link) => {
                    let link: Arc<dyn Link> = Arc::from(link);
                    self.watch.set(Some(&link));
                    self.link = Some(link);
                    let failover = self.nodes.connected(index);
                    if let Some(f) = &failover {
                        tracing::warn!(from = %f.from, to = %f.to, nodes = %self.nodes.redacted(), "RabbitMQ failover: the link to the node in use failed; another node answered");
                        m::rabbitmq_failover();
                    }
                    m::rabbitmq_node(&self.node(), &self.nodes.labels());
                    return Ok(());
                }
                Err(e) => {
                    if !self.nodes.single() {
                        tracing::warn!(node = %crate::config::nodes::label(&uri), error = %e, "RabbitMQ node did not answer; trying the next");
                    }
                    last = Some(e);
                }
            }
        }
        match last {
            Some(e) if self.nodes.single() => Err(e),
            last => Err(PublishError::NoNode {
                nodes: self.nodes.redacted(),
                last: last.map_or_else(|| "no node is configured".into(), |e| e.to_string()),
            }),
        }
    }

    /// One node: the connection and a confirm-mode channel, within `connect_timeout`.
    async fn open(&self, uri: &str) -> Result<Box<dyn Link>, PublishError> {
        let open = self.broker.open(uri, &self.name);
        crate::deadline::within(self.connect_timeout, "connecting to RabbitMQ", async {
            open.await.map_err(PublishError::from)
        })
        .await
    }

    /// Closes the connection politely (at shutdown), within `[rabbitmq] connect_timeout`.
    pub async fn close(&mut self) {
        self.watch.set(None);
        if let Some(link) = self.link.take() {
            let close = link.close(200, "timeoutd shutting down");
            if tokio::time::timeout(self.connect_timeout, close)
                .await
                .is_err()
            {
                tracing::warn!(timeout = ?self.connect_timeout, "RabbitMQ did not answer the close in time; dropping the connection");
            }
        }
    }

    /// Publishes every message pipelined, then awaits the confirms until each arrives or
    /// `stop_waiting` is cancelled. Returns one outcome per message, in order. `answered` is
    /// cancelled at the first answer from the broker (proof that it reads and confirms).
    /// `begin_by` holds one instant per message: its publish does not begin at or after it,
    /// when the message's lease comes within its safety margin (a broker that stopped reading
    /// holds the writes back); that message is not sent, the rest of the wave goes on.
    pub async fn publish_batch(
        &mut self,
        messages: &[OutgoingMessage],
        stop_waiting: &CancellationToken,
        answered: &CancellationToken,
        begin_by: &[tokio::time::Instant],
    ) -> Vec<SendOutcome> {
        let Some(link) = self.link.clone().filter(|_| self.usable()) else {
            return vec![SendOutcome::NotSent("not connected".into()); messages.len()];
        };
        // A publish resolves once its frames reach the socket: a broker that stops reading (a
        // memory or disk alarm) blocks it, so the writes share the confirms' deadline. A
        // publish begun is of unknown outcome once given up on (its frames may still go out);
        // one never begun was not sent.
        let mut pending: Vec<Result<Confirm, Waited>> = Vec::with_capacity(messages.len());
        // Why the rest of the wave is not sent, once a publish failed or was given up on.
        let mut broken: Option<String> = None;
        // A publish that failed may have registered its confirm and dropped it.
        let mut publish_failed = false;
        for (i, m) in messages.iter().enumerate() {
            // A publish is never begun after the deadline (its first poll writes its frames),
            // nor once its lease is within its margin: it could reach the broker after the
            // lease ran out and a peer took the record. That lease is the message's own, not
            // the wave's soonest (found in review: one record near its margin cut the whole
            // wave, and the cut was taken for a link that withheld confirms: given up on).
            if broken.is_none() && stop_waiting.is_cancelled() {
                broken = Some("the wave's deadline passed before it was published".into());
            }
            if let Some(why) = &broken {
                pending.push(Err(Waited::Failed(SendOutcome::NotSent(why.clone()))));
                continue;
            }
            if begin_by
                .get(i)
                .is_none_or(|by| tokio::time::Instant::now() >= *by)
            {
                let why = "its lease came within its safety margin before it was published";
                pending.push(Err(Waited::Failed(SendOutcome::NotSent(why.into()))));
                continue;
            }
            let publish = link.publish(&m.routing_key, m.body.clone(), m.properties.clone(), true);
            match until_stopped(publish, stop_waiting).await {
                Some((Ok(confirm), _)) => pending.push(Ok(confirm)),
                Some((Err(e), _)) => {
                    publish_failed = true;
                    broken = Some(e.to_string());
                    pending.push(Err(Waited::Failed(SendOutcome::NotSent(e.to_string()))));
                }
                None => {
                    broken = Some("an earlier publish of the wave did not finish in time".into());
                    pending.push(Err(Waited::Abandoned));
                }
            }
        }
        let waits = join_all(pending.into_iter().map(|p| async move {
            let confirm = match p {
                Ok(c) => c,
                Err(waited) => return waited,
            };
            match until_stopped(confirm, stop_waiting).await {
                Some((Ok(answer), late)) => {
                    answered.cancel();
                    Waited::Answer {
                        answer,
                        late: late || publish_failed,
                    }
                }
                Some((Err(e), _)) => Waited::Failed(SendOutcome::Connection(e.to_string())),
                None => Waited::Abandoned,
            }
        }))
        .await;
        let ids: Vec<Option<String>> = messages
            .iter()
            .map(|m| m.properties.message_id().as_ref().map(|id| id.to_string()))
            .collect();
        let outcomes = settle(&ids, waits, publish_failed);
        // A link that lost or withheld a confirm is suspect: the next batch opens a new one,
        // to the next node. Not at once when the broker blocks it (a memory or disk alarm,
        // which a new link would soon share): it is kept, so that the dispatch loop sees the
        // block until `connection.unblocked`, claiming nothing meanwhile; but it carries no
        // wave again, as a late confirm of it could carry a later message's return
        // (`tainted`): it is replaced once the block lifts, or by the next connect.
        let status = link.status();
        let withheld = broken.is_some() || outcomes.iter().any(SendOutcome::outcome_unknown);
        if status.connected && status.blocked && withheld {
            tracing::warn!(
                "RabbitMQ blocks a link that withheld confirms; keeping it only to follow the block"
            );
            self.tainted = true;
        } else if !status.connected || withheld {
            // The next connect starts at the next node: one that withholds confirms (a quorum
            // queue without its majority) must not get the next wave.
            self.give_up_link();
        }
        outcomes
    }

    /// Drops the open link, if any, closing it in the background within 5 s; the next connect
    /// starts at the next node.
    fn give_up_link(&mut self) {
        if let Some(link) = self.link.take() {
            self.nodes.link_failed();
            crate::host::spawn(async move {
                let close = link.close(320, "timeoutd: link lost or withheld confirms");
                let _ = tokio::time::timeout(Duration::from_secs(5), close).await;
            });
        }
        self.tainted = false;
        self.watch.set(None);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::rabbit::link::{Answer, Returned};
    use lapin::BasicProperties;

    /// A fake [`Broker`] and [`Link`] for unit tests: each publish is answered by the next
    /// confirm the test scripted, in order, as a channel in confirm mode answers.
    pub(crate) mod fake {
        use std::collections::VecDeque;
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::{Arc, Mutex};

        use futures::FutureExt;
        use futures::future::BoxFuture;
        use lapin::BasicProperties;
        use tokio_util::sync::CancellationToken;

        use crate::rabbit::link::{Answer, Broker, Confirm, Link, LinkError, LinkStatus};

        /// The status of one fake link, which the test changes (`connection.blocked`).
        #[derive(Debug, Clone)]
        pub(crate) struct Status(Arc<Mutex<LinkStatus>>);

        impl Status {
            pub(crate) fn set_blocked(&self, blocked: bool) {
                self.0.lock().unwrap_or_else(|e| e.into_inner()).blocked = blocked;
            }
            fn get(&self) -> LinkStatus {
                *self.0.lock().unwrap_or_else(|e| e.into_inner())
            }
        }

        /// One publish's answer.
        pub(crate) enum Script {
            /// Answered at once.
            Ready(Answer),
            /// Fails at once, as a confirm does when its channel closes.
            Fail(String),
            /// The wave's deadline passes while its confirm is awaited; never answered.
            DeadlineThenNever(CancellationToken),
        }

        impl Script {
            fn confirm(self) -> Confirm {
                match self {
                    Script::Ready(a) => futures::future::ready(Ok(a)).boxed(),
                    Script::Fail(e) => futures::future::ready(Err(LinkError(e))).boxed(),
                    Script::DeadlineThenNever(token) => async move {
                        token.cancel();
                        futures::future::pending().await
                    }
                    .boxed(),
                }
            }
        }

        pub(crate) struct FakeLink {
            status: Status,
            script: Mutex<VecDeque<Confirm>>,
            /// Cancelled when the last scripted publish is written (a deadline that passes
            /// between the writes and the confirms).
            deadline_after_writes: Option<CancellationToken>,
        }

        impl std::fmt::Debug for FakeLink {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct("FakeLink")
                    .field("status", &self.status.get())
                    .finish()
            }
        }

        impl Link for FakeLink {
            fn status(&self) -> LinkStatus {
                self.status.get()
            }
            fn frame_max(&self) -> u32 {
                131_072
            }
            fn server_version(&self) -> Option<String> {
                Some("fake".into())
            }
            fn publish(
                &self,
                _routing_key: &str,
                _body: Vec<u8>,
                _properties: BasicProperties,
                _mandatory: bool,
            ) -> BoxFuture<'static, Result<Confirm, LinkError>> {
                let mut script = self.script.lock().unwrap_or_else(|e| e.into_inner());
                let confirm = script.pop_front();
                if script.is_empty()
                    && let Some(deadline) = &self.deadline_after_writes
                {
                    deadline.cancel();
                }
                futures::future::ready(confirm.ok_or_else(|| LinkError("not scripted".into())))
                    .boxed()
            }
            fn close(
                &self,
                _code: u16,
                _reason: &str,
            ) -> BoxFuture<'static, Result<(), LinkError>> {
                futures::future::ready(Ok(())).boxed()
            }
        }

        /// Opens the links the test prepared, in order; then none (an open that never ends,
        /// as to a node that does not answer).
        #[derive(Debug, Default)]
        pub(crate) struct FakeBroker {
            links: Mutex<VecDeque<FakeLink>>,
            pub(crate) opened: AtomicUsize,
        }

        impl FakeBroker {
            /// Adds a link answering `script`; returns its status handle.
            pub(crate) fn link(
                &self,
                script: Vec<Script>,
                deadline_after_writes: Option<CancellationToken>,
            ) -> Status {
                let status = Status(Arc::new(Mutex::new(LinkStatus {
                    connected: true,
                    blocked: false,
                })));
                let link = FakeLink {
                    status: status.clone(),
                    script: Mutex::new(script.into_iter().map(Script::confirm).collect()),
                    deadline_after_writes,
                };
                self.links
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push_back(link);
                status
            }

            pub(crate) fn opened(&self) -> usize {
                self.opened.load(Ordering::SeqCst)
            }
        }

        impl Broker for FakeBroker {
            fn open(
                &self,
                _uri: &str,
                _name: &str,
            ) -> BoxFuture<'static, Result<Box<dyn Link>, LinkError>> {
                let link = self
                    .links
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .pop_front();
                match link {
                    Some(link) => {
                        self.opened.fetch_add(1, Ordering::SeqCst);
                        futures::future::ready(Ok(Box::new(link) as Box<dyn Link>)).boxed()
                    }
                    None => futures::future::pending().boxed(),
                }
            }
        }
    }

    use fake::{FakeBroker, Script};

    fn returned(id: &str) -> Option<Returned> {
        Some(Returned {
            message_id: Some(id.into()),
            reply_code: 312,
        })
    }

    fn message(id: &str) -> OutgoingMessage {
        OutgoingMessage {
            routing_key: "nowhere".into(),
            body: Vec::new(),
            properties: BasicProperties::default().with_message_id(id.into()),
        }
    }

    /// A runtime whose random choices (an unbiased `select!`'s) are the same on every run.
    fn seeded() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .rng_seed(tokio::runtime::RngSeed::from_bytes(b"rseam"))
            .build()
            .expect("a runtime")
    }

    /// Publishes one message per `(id, answer)` over a fresh link; `None`: the wave's deadline
    /// passes while its confirm is awaited, never answered. With `deadline_after_writes`, the
    /// deadline also passes as the last write goes out.
    async fn wave(
        answers: &[(&str, Option<Answer>)],
        deadline_after_writes: bool,
    ) -> Vec<SendOutcome> {
        let stop = CancellationToken::new();
        let broker = Arc::new(FakeBroker::default());
        let script = answers
            .iter()
            .map(|(_, a)| match a {
                Some(a) => Script::Ready(a.clone()),
                None => Script::DeadlineThenNever(stop.clone()),
            })
            .collect();
        broker.link(script, deadline_after_writes.then(|| stop.clone()));
        let mut p = Publisher::with_broker(&RabbitConfig::default(), broker);
        p.connect().await.expect("the fake link opens");
        let messages: Vec<OutgoingMessage> = answers.iter().map(|(id, _)| message(id)).collect();
        let by = open_ended(messages.len());
        p.publish_batch(&messages, &stop, &CancellationToken::new(), &by)
            .await
    }

    /// Issue 25, 8.1: an ack counts as confirmed only when no return can have been lost with an
    /// abandoned confirm. Each case runs 64 rounds, seeded, so that the unbiased choice the old
    /// wait made between a ready answer and the deadline is the same each run.
    #[test]
    fn an_ack_is_confirmed_only_when_no_return_can_have_been_lost() {
        use SendOutcome::{Confirmed, Returned, TimedOut};
        let ack = |r| Some(Answer::Ack(r));
        let cases = [
            // B's return comes with A's ack (as lapin hands a return to whichever ack it
            // resolves next), and the deadline passes as both are ready: a wait that chose the
            // deadline over A's ready confirm dropped B's return, and B was deleted unsent.
            (
                vec![("A", ack(returned("B"))), ("B", ack(None))],
                true,
                [Confirmed, Returned],
            ),
            // B's ack, read before X's confirm was abandoned, carried X's return: B's own may
            // still have been waiting, for X's confirm to take. B is unknown.
            (
                vec![("B", ack(returned("X"))), ("X", None)],
                false,
                [TimedOut, TimedOut],
            ),
            // An ack read after the deadline, in a wave that abandoned a confirm, may have lost
            // its return to that confirm: unknown.
            (
                vec![("X", None), ("B", ack(None))],
                false,
                [TimedOut, TimedOut],
            ),
            // An ack read before any confirm was abandoned, with no return, stays confirmed: a
            // queue that withholds confirms does not make the rest of the wave sent again.
            (
                vec![("A", ack(None)), ("X", None)],
                false,
                [Confirmed, TimedOut],
            ),
        ];
        seeded().block_on(async {
            for (answers, deadline_after_writes, expected) in cases {
                for round in 0..64 {
                    let outcomes = wave(&answers, deadline_after_writes).await;
                    assert_eq!(outcomes, expected, "{answers:?}, round {round}");
                }
            }
        });
    }

    /// A confirm that failed (its channel closed) took no return: lapin drops the returns still
    /// waiting. B's ack carried X's return, so B's own may have been waiting for X's confirm,
    /// and was dropped with it: B is unknown, not confirmed (it was deleted, perhaps unrouted).
    #[test]
    fn an_ack_carrying_another_return_is_unknown_when_a_confirm_failed() {
        seeded().block_on(async {
            let broker = Arc::new(FakeBroker::default());
            let closed = "channel closed".to_string();
            let script = vec![
                Script::Ready(Answer::Ack(returned("X"))),
                Script::Fail(closed.clone()),
            ];
            broker.link(script, None);
            let mut p = Publisher::with_broker(&RabbitConfig::default(), broker);
            p.connect().await.expect("the fake link opens");
            let (stop, answered) = (CancellationToken::new(), CancellationToken::new());
            let outcomes = p
                .publish_batch(
                    &[message("B"), message("X")],
                    &stop,
                    &answered,
                    &open_ended(2),
                )
                .await;
            let unknown = SendOutcome::Connection(closed);
            assert_eq!(outcomes, [unknown.clone(), unknown]);
        });
    }

    /// The begin-by instants of `n` publishes that may begin any time until their deadline.
    fn open_ended(n: usize) -> Vec<tokio::time::Instant> {
        vec![tokio::time::Instant::now() + Duration::from_secs(86_400); n]
    }

    /// The outcome of one message published on a link that would ack it, once the wave's
    /// deadline passed (`stopped`) or with no publish to begin from `begin_by`.
    fn one_publish(stopped: bool, begin_by: tokio::time::Instant) -> Vec<SendOutcome> {
        seeded().block_on(async {
            let broker = Arc::new(FakeBroker::default());
            broker.link(vec![Script::Ready(Answer::Ack(None))], None);
            let mut p = Publisher::with_broker(&RabbitConfig::default(), broker);
            p.connect().await.expect("the fake link opens");
            let (stop, answered) = (CancellationToken::new(), CancellationToken::new());
            if stopped {
                stop.cancel();
            }
            p.publish_batch(&[message("A")], &stop, &answered, &[begin_by])
                .await
        })
    }

    /// The wave's deadline passed before a publish began: that publish was begun all the
    /// same (its first poll writes its frames) and went out after the deadline. And a broker
    /// that stopped reading held a wave's writes back past the instant its soonest lease came
    /// within the safety margin: the publishes after it began all the same and could reach
    /// the broker after the lease ran out, when a peer may have taken the record. Neither
    /// begins now: not sent.
    #[test]
    fn no_publish_begins_after_the_waves_deadline_or_its_leases_margin() {
        let at_once = tokio::time::Instant::now();
        for (stopped, begin_by) in [(true, open_ended(1)[0]), (false, at_once)] {
            let outcomes = one_publish(stopped, begin_by);
            assert!(
                matches!(outcomes.as_slice(), [SendOutcome::NotSent(_)]),
                "stopped {stopped}: {outcomes:?}"
            );
        }
        assert_eq!(
            one_publish(false, open_ended(1)[0]),
            [SendOutcome::Confirmed]
        );
    }

    /// A message whose lease came within its margin is not sent; the rest of its wave is,
    /// and the link is kept. Before (found in review, helper-35), the wave's soonest lease cut
    /// every publish after it, and the cut gave up a working link, as one that withheld
    /// confirms: a failover, the link down for a back-off, the wave's fresh records released.
    #[test]
    fn a_message_past_its_margin_is_not_sent_and_the_rest_of_its_wave_is() {
        seeded().block_on(async {
            let broker = Arc::new(FakeBroker::default());
            let ack = || Script::Ready(Answer::Ack(None));
            broker.link(vec![ack(), ack()], None);
            let mut p = Publisher::with_broker(&RabbitConfig::default(), broker);
            p.connect().await.expect("the fake link opens");
            let (stop, answered) = (CancellationToken::new(), CancellationToken::new());
            let by = [
                tokio::time::Instant::now(),
                open_ended(1)[0],
                open_ended(1)[0],
            ];
            let outcomes = p
                .publish_batch(
                    &[message("A"), message("B"), message("C")],
                    &stop,
                    &answered,
                    &by,
                )
                .await;
            assert!(
                matches!(
                    outcomes.as_slice(),
                    [
                        SendOutcome::NotSent(_),
                        SendOutcome::Confirmed,
                        SendOutcome::Confirmed
                    ]
                ),
                "{outcomes:?}"
            );
            assert!(p.is_connected(), "the link is kept");
        });
    }

    /// A publisher whose link abandoned a confirm while the broker blocked it, and a second
    /// link ready to answer one ack.
    async fn blocked_after_abandoning() -> (Publisher, Arc<FakeBroker>, fake::Status) {
        let stop = CancellationToken::new();
        let broker = Arc::new(FakeBroker::default());
        let status = broker.link(vec![Script::DeadlineThenNever(stop.clone())], None);
        broker.link(vec![Script::Ready(Answer::Ack(None))], None);
        let mut p = Publisher::with_broker(&RabbitConfig::default(), broker.clone());
        p.connect().await.expect("the fake link opens");
        status.set_blocked(true);
        let outcomes = p
            .publish_batch(
                &[message("A")],
                &stop,
                &CancellationToken::new(),
                &open_ended(1),
            )
            .await;
        assert_eq!(outcomes, [SendOutcome::TimedOut]);
        (p, broker, status)
    }

    async fn publish_b(p: &mut Publisher) -> Vec<SendOutcome> {
        let (stop, answered) = (CancellationToken::new(), CancellationToken::new());
        p.publish_batch(&[message("B")], &stop, &answered, &open_ended(1))
            .await
    }

    /// Issue 25, 8.1: a link the broker blocks is kept while the block lasts (so the loop sees
    /// it), but one that abandoned confirms carries no wave again: the next connect opens a
    /// new link, and once the block lifts it counts as lost.
    #[test]
    fn a_blocked_link_that_abandoned_confirms_is_not_reused() {
        seeded().block_on(async {
            let (mut p, broker, status) = blocked_after_abandoning().await;
            assert!(p.is_connected(), "kept while the block lasts");
            assert!(p.watch().blocked(), "the loop sees the block");
            status.set_blocked(false);
            assert!(!p.is_connected(), "lost once the block lifts");
            p.connect().await.expect("the second link opens");
            assert_eq!(
                broker.opened(),
                2,
                "the link that withheld confirms was replaced"
            );
            assert_eq!(publish_b(&mut p).await, [SendOutcome::Confirmed]);
        });
    }

    /// The same while the block lasts: a wave that starts anyway gets a new link.
    #[test]
    fn a_wave_on_a_blocked_link_that_abandoned_confirms_gets_a_new_link() {
        seeded().block_on(async {
            let (mut p, broker, _status) = blocked_after_abandoning().await;
            assert_eq!(
                publish_b(&mut p).await,
                [SendOutcome::NotSent("not connected".into())],
                "nothing more on the link that withheld confirms"
            );
            p.connect().await.expect("the second link opens");
            assert_eq!(broker.opened(), 2);
        });
    }
}
