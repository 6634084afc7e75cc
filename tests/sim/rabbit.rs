//! An in-memory model of a RabbitMQ cluster behind [`Broker`] and [`Link`], for the
//! simulation (`tests/simulate.rs`) and held honest by `tests/conformance_rabbitmq.rs`.
//!
//! One [`RabbitModel`] (cheap to clone) is a cluster: nodes addressed by the `host:port` of the
//! URIs the publisher's node list gives, queues by name (publishing to the default exchange
//! routes to the queue named by the routing key), and the connections ("links") opened to it.
//! It runs single-threaded under a paused current-thread tokio runtime: every delay is a
//! `tokio::time` sleep and every random choice comes from the seed it was made with.
//!
//! How it works: every publish is a *server event* (the broker reads and routes it, at a time
//! after it was written) and every answer a *client event* (a `basic.return`, an ack or nack
//! that may cover several tags, `connection.blocked`/`unblocked`, a close), all on one agenda
//! ordered by virtual time. The agenda is run lazily: every call into the model, and every
//! future waiting on it, first runs what is due by now, so a state change (a node stopped, an
//! alarm set) always lands between the events before and after it. A future waiting for an
//! answer sleeps until the next event; the deliveries and fates it logs carry the event's own
//! time, whoever ran it.
//!
//! What it models, each as the real broker and lapin do (the conformance suite checks them):
//! - a mandatory publish nobody can route: `basic.return` (312 NO_ROUTE) before its ack; lapin
//!   hands a waiting return to whichever confirm it completes next, and completes the tags of a
//!   multiple-ack in hash order, so a return can come with *another* message's ack
//!   ([`ReturnAttach::Lapin`]); a confirm dropped before its answer loses the return it drew;
//! - nacks (a queue that rejects publishes), and confirms withheld (a quorum queue without
//!   its majority: no answer until the link dies or the majority is back);
//! - a memory alarm: the broker keeps reading a connection until it publishes; that publish's
//!   method frame blocks it (the message is read and routed only once unblocked) and the
//!   broker sends `connection.blocked`; lapin then writes nothing more, so later publishes'
//!   written futures wait ([`BlockMode`]);
//! - `frame_max` per node (lapin's `?frame_max=` in the URI lowers it); a content header frame
//!   larger than it by more than RabbitMQ's 8-byte fudge makes the broker close the
//!   connection (501 FRAME_ERROR); bodies are split;
//! - the headers `CC` and `BCC` (exactly so named) as more routing keys: an array routes to
//!   the queues its strings name too, and `BCC` is removed before delivery; any other value
//!   there makes the broker refuse the message and close the channel (406), and that close
//!   may overtake the acks of messages routed just before;
//! - a link closed by the server (`rabbitmqctl close_connection`), a node stopped (links reset,
//!   opens refused) or unreachable (opens hang, links silent until the dead-peer timeout), a
//!   node stalled (reads nothing, writes fill the socket buffer), a node whose replies are
//!   held (it routes, the client hears nothing);
//! - latency per open, per publish (written to routed) and per answer (routed to seen).
#![allow(dead_code)]

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures::future::BoxFuture;
use lapin::BasicProperties;
use lapin::types::AMQPValue;
use timeoutd::rabbit::link::{Answer, Broker, Confirm, Link, LinkError, LinkStatus, Returned};
use tokio::sync::oneshot;
use tokio::time::Instant;

/// RabbitMQ's reply code for a mandatory message no queue is bound for.
pub const NO_ROUTE: u16 = 312;

/// How many bytes past `frame_max` RabbitMQ lets a frame run (`?FRAME_SIZE_FUDGE` in
/// `rabbit_reader`; seen in `tests/conformance_rabbitmq.rs`).
pub const FRAME_SIZE_FUDGE: usize = 8;

/// The smallest `frame_max` lapin and RabbitMQ accept.
pub const FRAME_MIN_SIZE: u32 = 4096;

/// A small deterministic random source (SplitMix64), seeded by the simulation.
#[derive(Debug, Clone)]
pub struct SimRng(u64);

impl SimRng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.unit() < p
    }

    /// Uniform in `[lo, hi]`.
    pub fn between(&mut self, (lo, hi): (Duration, Duration)) -> Duration {
        if hi <= lo {
            return lo;
        }
        let span = u64::try_from((hi - lo).as_nanos()).unwrap_or(u64::MAX);
        lo + Duration::from_nanos(self.below(span.saturating_add(1)))
    }

    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = usize::try_from(self.below(i as u64 + 1)).unwrap_or(0);
            v.swap(i, j);
        }
    }
}

/// Which confirm a waiting `basic.return` comes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReturnAttach {
    /// As lapin does: each completed confirm takes the oldest waiting return, and the tags of
    /// one multiple-ack complete in an arbitrary (seeded) order.
    Lapin,
    /// Each return comes with its own message's confirm (an idealised client).
    Own,
}

/// When the broker blocks a connection during a memory alarm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockMode {
    /// As RabbitMQ does: a connection is blocked when it next publishes; the broker stops
    /// reading it at that publish (routing it only once unblocked) and sends
    /// `connection.blocked`. A connection that does not publish is not blocked.
    OnNextPublish,
    /// Every open connection is blocked (and told so) as soon as the alarm is set.
    OnAlarm,
}

/// How a stopped node fails the clients that try it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DownMode {
    /// The node's host answers with a reset: opens are refused and its links fail at once.
    Refuse,
    /// The node is unreachable: opens hang (the caller's deadline ends them) and its links
    /// fall silent until the client's dead-peer timeout.
    Hang,
}

/// How long a client takes to find a silent link dead (two missed heartbeats of 60 s).
pub const DEAD_PEER_TIMEOUT: Duration = Duration::from_secs(120);

/// The model-wide behaviour, drawn by the simulation per seed.
#[derive(Debug, Clone)]
pub struct Behaviour {
    /// Connecting and opening the confirm-mode channel.
    pub open_latency: (Duration, Duration),
    /// From a publish written to the broker routing it.
    pub publish_latency: (Duration, Duration),
    /// From the broker's answer to the client seeing it.
    pub confirm_latency: (Duration, Duration),
    /// The chance that an ack is held back and sent as one multiple-ack with the next.
    pub ack_multiple: f64,
    pub returns: ReturnAttach,
    pub block: BlockMode,
    /// Bytes a link may have written that the broker did not read yet before further writes
    /// wait (the sockets' buffers; a message larger than this goes alone).
    pub socket_buffer: usize,
    /// The chance that the broker nacks any one publish.
    pub nack_rate: f64,
    /// How long a client takes to notice a silent peer (missed heartbeats).
    pub dead_peer_timeout: Duration,
}

impl Default for Behaviour {
    fn default() -> Self {
        Self {
            open_latency: (Duration::from_millis(1), Duration::from_millis(3)),
            publish_latency: (Duration::from_micros(100), Duration::from_millis(1)),
            confirm_latency: (Duration::from_micros(100), Duration::from_millis(1)),
            ack_multiple: 0.3,
            returns: ReturnAttach::Lapin,
            block: BlockMode::OnNextPublish,
            socket_buffer: 1 << 20,
            nack_rate: 0.0,
            dead_peer_timeout: DEAD_PEER_TIMEOUT,
        }
    }
}

/// One node's settings.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The `frame_max` the broker offers (RabbitMQ's default is 131072).
    pub frame_max: u32,
    pub version: Option<String>,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            frame_max: 131_072,
            version: None,
        }
    }
}

/// A message the broker routed to a queue.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// Order of routing, from 0.
    pub seq: u64,
    pub queue: String,
    pub properties: BasicProperties,
    pub body: Vec<u8>,
    /// When the broker routed it (virtual time).
    pub at: Instant,
    /// The node (`host:port`) and connection name it came through.
    pub node: String,
    pub connection: String,
}

impl Delivery {
    pub fn message_id(&self) -> Option<String> {
        self.properties.message_id().as_ref().map(|s| s.to_string())
    }

    pub fn correlation_id(&self) -> Option<String> {
        self.properties
            .correlation_id()
            .as_ref()
            .map(|s| s.to_string())
    }

    pub fn header(&self, name: &str) -> Option<AMQPValue> {
        self.properties
            .headers()
            .as_ref()
            .and_then(|t| t.inner().get(name).cloned())
    }

    /// A header's value as text (long or short string).
    pub fn header_str(&self, name: &str) -> Option<String> {
        match self.header(name)? {
            AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            AMQPValue::ShortString(s) => Some(s.to_string()),
            _ => None,
        }
    }
}

/// What the broker did with one publish it read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fate {
    /// Routed to the queue and acked.
    Routed,
    /// Mandatory and unroutable: returned (312), then acked.
    Returned,
    /// Not mandatory and unroutable: dropped, then acked.
    Dropped,
    /// Nacked; not routed.
    Nacked,
    /// Held by a queue without its majority: no answer yet.
    Withheld,
    /// Its content header frame exceeded `frame_max`: the broker closed the connection.
    FrameError,
    /// `CC` or `BCC` was not an array: the broker closed the channel (406).
    Refused,
}

/// One publish the broker read, with its fate.
#[derive(Debug, Clone)]
pub struct Processed {
    pub at: Instant,
    pub connection: String,
    pub node: String,
    pub routing_key: String,
    pub message_id: Option<String>,
    pub fate: Fate,
}

/// A link as the broker sees it, for tests and the checker.
#[derive(Debug, Clone)]
pub struct LinkInfo {
    pub id: u64,
    pub name: String,
    pub node: String,
    pub open: bool,
    pub blocked: bool,
    pub frame_max: u32,
    /// Confirms awaited and not answered yet.
    pub pending_confirms: usize,
}

#[derive(Debug, Clone)]
struct Message {
    routing_key: String,
    body: Vec<u8>,
    properties: BasicProperties,
    mandatory: bool,
    /// The content header frame's size.
    header_len: usize,
}

impl Message {
    fn new(routing_key: &str, body: Vec<u8>, properties: BasicProperties, mandatory: bool) -> Self {
        let header_len = header_frame_len(&properties);
        Self {
            routing_key: routing_key.to_string(),
            body,
            properties,
            mandatory,
            header_len,
        }
    }

    /// Bytes on the wire: method, header and body frames (approximately for the method).
    fn size(&self) -> usize {
        (40 + self.routing_key.len())
            .saturating_add(self.header_len)
            .saturating_add(self.body.len())
    }
}

/// The size of the content header frame lapin writes for `properties`: frame header (7),
/// class, weight and body size (12), the properties with their flags, frame end (1).
/// Computed with the protocol crate's own encoder, independently of timeoutd's estimate.
pub fn header_frame_len(properties: &BasicProperties) -> usize {
    let encode = lapin::protocol::basic::gen_properties::<Vec<u8>>(properties);
    match encode(Vec::new().into()) {
        Ok(ctx) => 20 + usize::try_from(ctx.position).unwrap_or(usize::MAX - 20),
        Err(_) => usize::MAX,
    }
}

/// The routing keys the headers `CC` and `BCC` add, as RabbitMQ reads them
/// (`rabbit_basic:header_routes`): exactly so named, each an array whose long strings count
/// (anything else in it is skipped). Any other value is an error, in the broker's words.
fn header_routes(properties: &BasicProperties) -> Result<Vec<String>, String> {
    let mut routes = Vec::new();
    for name in ["CC", "BCC"] {
        match properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(name))
        {
            None => {}
            Some(AMQPValue::FieldArray(keys)) => {
                routes.extend(keys.as_slice().iter().filter_map(|k| match k {
                    AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into()),
                    _ => None,
                }));
            }
            Some(v) => {
                return Err(format!(
                    "{{unacceptable_type_in_header,\"{name}\",{}}}",
                    type_name(v)
                ));
            }
        }
    }
    Ok(routes)
}

/// RabbitMQ's name of a field's type (`rabbit_binary_parser`), as lapin writes it.
fn type_name(v: &AMQPValue) -> &'static str {
    match v {
        AMQPValue::Boolean(_) => "bool",
        AMQPValue::ShortShortInt(_) => "byte",
        AMQPValue::ShortShortUInt(_) => "unsignedbyte",
        AMQPValue::ShortInt(_) => "short",
        AMQPValue::ShortUInt(_) => "unsignedshort",
        AMQPValue::LongInt(_) => "signedint",
        AMQPValue::LongUInt(_) => "unsignedint",
        AMQPValue::LongLongInt(_) => "long",
        AMQPValue::Float(_) => "float",
        AMQPValue::Double(_) => "double",
        AMQPValue::DecimalValue(_) => "decimal",
        AMQPValue::LongString(_) => "longstr",
        // Not modelled: RabbitMQ cannot read lapin's short string field at all and closes the
        // connection (541 INTERNAL_ERROR), whatever the header.
        AMQPValue::ShortString(_) => "shortstr",
        AMQPValue::FieldArray(_) => "array",
        AMQPValue::Timestamp(_) => "timestamp",
        AMQPValue::FieldTable(_) => "table",
        AMQPValue::ByteArray(_) => "binary",
        AMQPValue::Void => "void",
    }
}

#[derive(Debug)]
struct Node {
    up: bool,
    down: DownMode,
    stalled: bool,
    /// The node reads and acts on everything, but what it sends is held back.
    holds_replies: bool,
    alarm: bool,
    config: NodeConfig,
}

#[derive(Debug, Default)]
struct Queue {
    withhold: bool,
    /// A quorum queue with a member on every node: it withholds confirms while fewer than
    /// a majority of the nodes are up.
    quorum: bool,
    /// What it holds is forgotten rather than delivered when it can commit again.
    lose_held: bool,
    nack: bool,
    held: Vec<(u64, u64, Message)>,
}

#[derive(Debug)]
enum ClientEvent {
    Return(u64, Returned),
    Ack { tags: Vec<u64>, nack: bool },
    Blocked,
    Unblocked,
    Closed(String),
}

#[derive(Debug)]
enum EventKind {
    /// The broker reads and routes a publish.
    Process { tag: u64, msg: Box<Message> },
    /// The broker reads the client's `connection.close`.
    CloseRequest,
    /// The client sees something the broker sent.
    Client(ClientEvent),
}

#[derive(Debug)]
struct Event {
    link: u64,
    kind: EventKind,
}

type Key = (Instant, u64);

struct PendingWrite {
    tag: u64,
    msg: Message,
    written: oneshot::Sender<Result<(), LinkError>>,
}

struct LinkState {
    name: String,
    node: String,
    frame_max: u32,
    version: Option<String>,
    /// The client's view: open until it learns of a close.
    open: bool,
    closing: bool,
    closed: Option<String>,
    /// The broker's view: it reads and answers nothing more on this link.
    server_gone: bool,
    /// The broker will block this link when it next publishes (memory alarm).
    server_blocking: bool,
    /// The broker does not read this link (blocked by an alarm).
    server_blocked: bool,
    /// The client received `connection.blocked` (and no `unblocked` since): lapin writes
    /// nothing.
    client_blocked: bool,
    next_tag: u64,
    unread: usize,
    writes: VecDeque<PendingWrite>,
    deferred: VecDeque<EventKind>,
    client_deferred: VecDeque<ClientEvent>,
    confirms: BTreeMap<u64, oneshot::Sender<Result<Answer, LinkError>>>,
    waiting_returns: VecDeque<(u64, Returned)>,
    closed_waiters: Vec<oneshot::Sender<()>>,
    last_proc: Instant,
    last_arrival: Instant,
    /// The last ack still on its way, which the next ack may join (a multiple-ack).
    open_ack: Option<Key>,
}

struct State {
    rng: SimRng,
    behaviour: Behaviour,
    nodes: BTreeMap<String, Node>,
    queues: BTreeMap<String, Queue>,
    links: BTreeMap<u64, LinkState>,
    agenda: BTreeMap<Key, Event>,
    /// Bumped whenever an event is added, so that a future sleeping until what was the next
    /// event looks again.
    wake: tokio::sync::watch::Sender<u64>,
    seq: u64,
    next_link: u64,
    deliveries: Vec<Delivery>,
    /// Per queue, the first delivery [`RabbitModel::take_queue`] has not taken.
    taken: BTreeMap<String, u64>,
    processed: Vec<Processed>,
    returns_elsewhere: u64,
}

/// The model of a RabbitMQ cluster. Clones share the cluster.
#[derive(Clone)]
pub struct RabbitModel(Arc<Mutex<State>>);

impl fmt::Debug for RabbitModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.lock();
        f.debug_struct("RabbitModel")
            .field("nodes", &s.nodes.keys().collect::<Vec<_>>())
            .field("queues", &s.queues.len())
            .field("links", &s.links.len())
            .field("deliveries", &s.deliveries.len())
            .finish()
    }
}

/// `host:port` of an AMQP URI (lowercase host, default ports), and the `frame_max` it asks
/// for (lapin's `?frame_max=`), 0 for none.
pub fn node_key(uri: &str) -> (String, u32) {
    let (scheme, rest) = uri.split_once("://").unwrap_or(("amqp", uri));
    let (authority, tail) = match rest.find(['/', '?']) {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    let hostport = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let default_port = if scheme.eq_ignore_ascii_case("amqps") {
        5671
    } else {
        5672
    };
    let key = if hostport
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
    {
        hostport.to_ascii_lowercase()
    } else {
        format!("{}:{default_port}", hostport.to_ascii_lowercase())
    };
    let frame_max = tail
        .split_once('?')
        .map(|(_, q)| q)
        .into_iter()
        .flat_map(|q| q.split('&'))
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == "frame_max")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    (key, frame_max)
}

impl RabbitModel {
    /// A cluster of the nodes at `uris` (each up, with the default [`NodeConfig`]).
    pub fn new<S: AsRef<str>>(uris: &[S], seed: u64, behaviour: Behaviour) -> Self {
        let model = Self(Arc::new(Mutex::new(State {
            rng: SimRng::new(seed),
            behaviour,
            nodes: BTreeMap::new(),
            queues: BTreeMap::new(),
            links: BTreeMap::new(),
            agenda: BTreeMap::new(),
            wake: tokio::sync::watch::Sender::new(0),
            seq: 0,
            next_link: 1,
            deliveries: Vec::new(),
            taken: BTreeMap::new(),
            processed: Vec::new(),
            returns_elsewhere: 0,
        })));
        for uri in uris {
            model.add_node(uri.as_ref(), NodeConfig::default());
        }
        model
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs the agenda up to now and returns the state.
    fn now(&self) -> MutexGuard<'_, State> {
        let mut s = self.lock();
        s.advance(Instant::now());
        s
    }

    pub fn add_node(&self, uri: &str, config: NodeConfig) {
        let (key, _) = node_key(uri);
        self.now().nodes.insert(
            key,
            Node {
                up: true,
                down: DownMode::Refuse,
                stalled: false,
                holds_replies: false,
                alarm: false,
                config,
            },
        );
    }

    pub fn set_behaviour(&self, f: impl FnOnce(&mut Behaviour)) {
        f(&mut self.now().behaviour);
    }

    /// The `frame_max` the node offers to links opened from now on.
    pub fn set_frame_max(&self, uri: &str, frame_max: u32) {
        let (key, _) = node_key(uri);
        if let Some(n) = self.now().nodes.get_mut(&key) {
            n.config.frame_max = frame_max;
        }
    }

    /// Stops a node: its links fail (at once for [`DownMode::Refuse`], after the dead-peer
    /// timeout for [`DownMode::Hang`]) and opens to it fail or hang.
    pub fn node_down(&self, uri: &str, mode: DownMode) {
        let (key, _) = node_key(uri);
        let now = Instant::now();
        let mut s = self.now();
        let Some(n) = s.nodes.get_mut(&key) else {
            return;
        };
        n.up = false;
        n.down = mode;
        let ids: Vec<u64> = s.links_of(&key);
        for id in ids {
            match mode {
                DownMode::Refuse => {
                    s.fail_link(id, "Connection reset by peer (os error 104)".into());
                }
                DownMode::Hang => {
                    let timeout = s.behaviour.dead_peer_timeout;
                    if let Some(l) = s.links.get_mut(&id) {
                        l.server_gone = true;
                    }
                    // Silent from now on: what the broker sent is lost on the way.
                    s.agenda
                        .retain(|_, e| e.link != id || !matches!(e.kind, EventKind::Client(_)));
                    s.schedule_client_at(
                        id,
                        now + timeout,
                        ClientEvent::Closed("missed heartbeats from the server".into()),
                    );
                }
            }
        }
    }

    pub fn node_up(&self, uri: &str) {
        let (key, _) = node_key(uri);
        let now = Instant::now();
        let mut s = self.now();
        if let Some(n) = s.nodes.get_mut(&key) {
            n.up = true;
        }
        s.release_held(now);
    }

    /// A node that stops reading and answering (a stalled network or process) and, when
    /// released, catches up in order. Opens to it hang meanwhile.
    pub fn stall_node(&self, uri: &str, stalled: bool) {
        let (key, _) = node_key(uri);
        let now = Instant::now();
        let mut s = self.now();
        let Some(n) = s.nodes.get_mut(&key) else {
            return;
        };
        let was = n.stalled;
        n.stalled = stalled;
        if was && !stalled {
            for id in s.links_of(&key) {
                s.resume_link(id, now);
            }
        }
    }

    /// A node whose replies are held back (as the test proxy's `HoldReplies`): it reads and
    /// routes every publish, and the client hears nothing until released.
    pub fn hold_replies(&self, uri: &str, hold: bool) {
        let (key, _) = node_key(uri);
        let now = Instant::now();
        let mut s = self.now();
        let Some(n) = s.nodes.get_mut(&key) else {
            return;
        };
        let was = n.holds_replies;
        n.holds_replies = hold;
        if was && !hold {
            for id in s.links_of(&key) {
                s.resume_link(id, now);
            }
        }
    }

    /// A memory alarm on a node; RabbitMQ blocks publishers cluster-wide while any node has
    /// one.
    pub fn set_memory_alarm(&self, uri: &str, alarm: bool) {
        let (key, _) = node_key(uri);
        let now = Instant::now();
        let mut s = self.now();
        let before = s.alarmed();
        if let Some(n) = s.nodes.get_mut(&key) {
            n.alarm = alarm;
        }
        let after = s.alarmed();
        let ids: Vec<u64> = s.links.keys().copied().collect();
        if !before && after {
            let mode = s.behaviour.block;
            for id in ids {
                let Some(l) = s.links.get_mut(&id) else {
                    continue;
                };
                if l.server_gone {
                    continue;
                }
                l.server_blocking = true;
                if mode == BlockMode::OnAlarm {
                    l.server_blocked = true;
                    s.schedule_client(id, now, ClientEvent::Blocked);
                }
            }
        } else if before && !after {
            for id in ids {
                let Some(l) = s.links.get_mut(&id) else {
                    continue;
                };
                if l.server_gone {
                    continue;
                }
                l.server_blocking = false;
                if l.server_blocked {
                    l.server_blocked = false;
                    s.schedule_client(id, now, ClientEvent::Unblocked);
                    s.resume_link(id, now);
                }
            }
        }
    }

    /// Declares a queue (idempotent).
    pub fn declare_queue(&self, name: &str) {
        self.now().queues.entry(name.to_string()).or_default();
    }

    /// Deletes a queue: later publishes to its name are unroutable. Messages it held are
    /// lost.
    pub fn delete_queue(&self, name: &str) {
        self.now().queues.remove(name);
    }

    /// A queue that nacks every publish (as one with `x-overflow: reject-publish` when full).
    pub fn set_queue_nacks(&self, name: &str, nack: bool) {
        if let Some(q) = self.now().queues.get_mut(name) {
            q.nack = nack;
        }
    }

    /// A quorum queue that lost its majority: publishes to it get no answer. When the majority
    /// is back (`withhold` false), what it held is delivered and acked on links still open,
    /// unless `lose_held` was given (when withholding or now): then it is forgotten (a leader
    /// change that dropped it) and its confirms stay unanswered until their links die.
    pub fn set_queue_withholds(&self, name: &str, withhold: bool, lose_held: bool) {
        let now = Instant::now();
        let mut s = self.now();
        let Some(q) = s.queues.get_mut(name) else {
            return;
        };
        q.withhold = withhold;
        q.lose_held = q.lose_held || lose_held;
        s.release_held(now);
        if let Some(q) = s.queues.get_mut(name)
            && q.held.is_empty()
            && !withhold
        {
            q.lose_held = false;
        }
    }

    /// Declares a quorum queue (idempotent): it withholds confirms while a majority of the
    /// nodes is down, and delivers and acks what it held once the majority is back.
    pub fn declare_quorum_queue(&self, name: &str) {
        self.now()
            .queues
            .entry(name.to_string())
            .or_default()
            .quorum = true;
    }

    /// The broker closes connections named `name` (as `rabbitmqctl close_connection` does):
    /// it reads nothing more from them; their clients learn it after the answer latency.
    pub fn close_connection(&self, name: &str, reason: &str) {
        let now = Instant::now();
        let mut s = self.now();
        let ids: Vec<u64> = s
            .links
            .iter()
            .filter(|(_, l)| l.name == name && !l.server_gone)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            s.server_close(
                id,
                now,
                format!("connection closed by the server: 320 CONNECTION_FORCED - {reason}"),
            );
        }
    }

    /// Every message routed so far, in order.
    pub fn deliveries(&self) -> Vec<Delivery> {
        self.now().deliveries.clone()
    }

    pub fn deliveries_to(&self, queue: &str) -> Vec<Delivery> {
        self.now()
            .deliveries
            .iter()
            .filter(|d| d.queue == queue)
            .cloned()
            .collect()
    }

    /// Takes what `queue` holds that was not taken yet (as a consumer would), in order. The
    /// delivery log keeps everything.
    pub fn take_queue(&self, queue: &str) -> Vec<Delivery> {
        let mut s = self.now();
        let from = s.taken.get(queue).copied().unwrap_or(0);
        let got: Vec<Delivery> = s
            .deliveries
            .iter()
            .filter(|d| d.queue == queue && d.seq >= from)
            .cloned()
            .collect();
        let upto = s.deliveries.len() as u64;
        s.taken.insert(queue.to_string(), upto);
        got
    }

    /// Every publish the broker read, with its fate, in order.
    pub fn processed(&self) -> Vec<Processed> {
        self.now().processed.clone()
    }

    /// How many returns lapin handed to a confirm other than their own message's.
    pub fn returns_elsewhere(&self) -> u64 {
        self.now().returns_elsewhere
    }

    pub fn links(&self) -> Vec<LinkInfo> {
        self.now()
            .links
            .iter()
            .map(|(id, l)| LinkInfo {
                id: *id,
                name: l.name.clone(),
                node: l.node.clone(),
                open: l.open && !l.closing,
                blocked: l.client_blocked,
                frame_max: l.frame_max,
                pending_confirms: l.confirms.len(),
            })
            .collect()
    }

    /// Waits for `rx`, running the agenda meanwhile (sleeping until its next event, or until
    /// an earlier one is added).
    async fn drive<T>(&self, mut rx: oneshot::Receiver<T>) -> Option<T> {
        let mut added = self.lock().wake.subscribe();
        loop {
            let (next, generation) = {
                let s = self.now();
                (s.agenda.keys().next().map(|k| k.0), *s.wake.borrow())
            };
            let sleep = async {
                match next {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => futures::future::pending::<()>().await,
                }
            };
            tokio::select! {
                biased;
                r = &mut rx => return r.ok(),
                _ = added.wait_for(|g| *g != generation) => {}
                () = sleep => {}
            }
        }
    }

    fn open_link(&self, uri: String, name: String) -> OpenOutcome {
        let mut s = self.now();
        let (key, _) = node_key(&uri);
        let latency = s.behaviour.open_latency;
        let latency = s.rng.between(latency);
        match s.nodes.get(&key) {
            None => OpenOutcome::Fail(latency, "Connection refused (os error 111)".into()),
            Some(n) if n.stalled || (!n.up && n.down == DownMode::Hang) => OpenOutcome::Hang,
            Some(n) if !n.up => {
                OpenOutcome::Fail(latency, "Connection refused (os error 111)".into())
            }
            Some(_) => OpenOutcome::After(latency, key, name),
        }
    }

    fn finish_open(&self, uri: &str, key: String, name: String) -> Result<u64, LinkError> {
        let now = Instant::now();
        let mut s = self.now();
        let alarmed = s.alarmed();
        let block = s.behaviour.block;
        let Some(n) = s.nodes.get(&key) else {
            return Err(LinkError("Connection refused (os error 111)".into()));
        };
        if !n.up || n.stalled {
            return Err(LinkError("Connection reset by peer (os error 104)".into()));
        }
        let (_, asked) = node_key(uri);
        let offered = n.config.frame_max;
        let frame_max = match (offered, asked) {
            (0, 0) => u32::MAX,
            (0, a) | (a, 0) => a,
            (o, a) => o.min(a),
        }
        .max(FRAME_MIN_SIZE);
        let version = n.config.version.clone();
        let id = s.next_link;
        s.next_link += 1;
        s.links.insert(
            id,
            LinkState {
                name,
                node: key,
                frame_max,
                version,
                open: true,
                closing: false,
                closed: None,
                server_gone: false,
                server_blocking: alarmed,
                server_blocked: alarmed && block == BlockMode::OnAlarm,
                client_blocked: false,
                next_tag: 1,
                unread: 0,
                writes: VecDeque::new(),
                deferred: VecDeque::new(),
                client_deferred: VecDeque::new(),
                confirms: BTreeMap::new(),
                waiting_returns: VecDeque::new(),
                closed_waiters: Vec::new(),
                last_proc: now,
                last_arrival: now,
                open_ack: None,
            },
        );
        if alarmed && block == BlockMode::OnAlarm {
            s.schedule_client(id, now, ClientEvent::Blocked);
        }
        Ok(id)
    }
}

enum OpenOutcome {
    Fail(Duration, String),
    Hang,
    After(Duration, String, String),
}

impl State {
    fn next_key(&mut self, at: Instant) -> Key {
        self.seq += 1;
        (at, self.seq)
    }

    fn insert(&mut self, key: Key, event: Event) {
        self.agenda.insert(key, event);
        self.wake.send_modify(|g| *g = g.wrapping_add(1));
    }

    /// Whether more than half of the nodes are up.
    fn majority(&self) -> bool {
        let up = self.nodes.values().filter(|n| n.up).count();
        up * 2 > self.nodes.len()
    }

    /// Queues that can commit again deliver what they held, and ack it on links still open.
    fn release_held(&mut self, now: Instant) {
        let majority = self.majority();
        let names: Vec<String> = self
            .queues
            .iter()
            .filter(|(_, q)| !q.held.is_empty() && !q.withhold && (majority || !q.quorum))
            .map(|(n, _)| n.clone())
            .collect();
        for name in names {
            let held = match self.queues.get_mut(&name) {
                Some(q) if q.lose_held => {
                    q.lose_held = false;
                    q.held.clear();
                    Vec::new()
                }
                Some(q) => std::mem::take(&mut q.held),
                None => Vec::new(),
            };
            for (link, tag, msg) in held {
                self.deliver(now, link, &name, &msg);
                if self.links.get(&link).is_some_and(|l| !l.server_gone) {
                    self.schedule_ack(link, now, tag, false);
                }
            }
        }
    }

    fn alarmed(&self) -> bool {
        self.nodes.values().any(|n| n.alarm)
    }

    fn links_of(&self, node: &str) -> Vec<u64> {
        self.links
            .iter()
            .filter(|(_, l)| l.node == node)
            .map(|(id, _)| *id)
            .collect()
    }

    fn node_stalled(&self, node: &str) -> bool {
        self.nodes.get(node).is_some_and(|n| n.stalled)
    }

    /// Runs every event due by `now`, in time order.
    fn advance(&mut self, now: Instant) {
        while let Some(entry) = self.agenda.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let (key, event) = entry.remove_entry();
            self.handle(key, event);
        }
    }

    fn handle(&mut self, key: Key, event: Event) {
        let at = key.0;
        let id = event.link;
        let Some(link) = self.links.get_mut(&id) else {
            return;
        };
        let stalled = self.nodes.get(&link.node).is_some_and(|n| n.stalled);
        let replies_held = self
            .nodes
            .get(&link.node)
            .is_some_and(|n| n.stalled || n.holds_replies);
        match event.kind {
            EventKind::Process { tag, msg } => {
                if link.server_gone {
                    return;
                }
                if stalled || link.server_blocked {
                    link.deferred.push_back(EventKind::Process { tag, msg });
                    return;
                }
                if link.server_blocking {
                    // As rabbit_reader does: the publish method frame blocks the connection
                    // (`maybe_block`); the rest of that message is read only once unblocked.
                    link.server_blocked = true;
                    let tell = !link.client_blocked;
                    link.deferred.push_back(EventKind::Process { tag, msg });
                    if tell {
                        self.schedule_client(id, at, ClientEvent::Blocked);
                    }
                    return;
                }
                link.unread = link.unread.saturating_sub(msg.size());
                self.process(id, at, tag, *msg);
                self.flush_writes(id, at);
            }
            EventKind::CloseRequest => {
                if link.server_gone {
                    return;
                }
                if stalled || link.server_blocked {
                    link.deferred.push_back(EventKind::CloseRequest);
                    return;
                }
                link.server_gone = true;
                self.schedule_client(
                    id,
                    at,
                    ClientEvent::Closed("connection closed by the client".into()),
                );
            }
            EventKind::Client(ev) => {
                if link.closed.is_some() {
                    return;
                }
                if replies_held && !matches!(ev, ClientEvent::Closed(_)) {
                    link.client_deferred.push_back(ev);
                    return;
                }
                if link.open_ack == Some(key) {
                    link.open_ack = None;
                }
                self.client_event(id, at, ev);
            }
        }
    }

    fn process(&mut self, id: u64, at: Instant, tag: u64, mut msg: Message) {
        let Some(link) = self.links.get(&id) else {
            return;
        };
        let routes = header_routes(&msg.properties);
        if let Some(headers) = msg.properties.headers().as_ref()
            && headers.contains_key("BCC")
        {
            let mut kept = headers.inner().clone();
            kept.remove("BCC");
            msg.properties = msg.properties.with_headers(kept.into());
        }
        let (conn, node, frame_max) = (link.name.clone(), link.node.clone(), link.frame_max);
        let message_id = msg.properties.message_id().as_ref().map(|s| s.to_string());
        let log = |s: &mut State, fate: Fate| {
            s.processed.push(Processed {
                at,
                connection: conn.clone(),
                node: node.clone(),
                routing_key: msg.routing_key.clone(),
                message_id: message_id.clone(),
                fate,
            });
        };
        // RabbitMQ refuses a frame whose payload exceeds `frame_max - 8`, with a fudge of 8
        // bytes for old clients: a whole frame of up to `frame_max + 8` bytes goes.
        let limit = (frame_max as usize).saturating_add(FRAME_SIZE_FUDGE);
        if msg.header_len > limit {
            log(self, Fate::FrameError);
            self.server_close(
                id,
                at,
                format!(
                    "protocol error: AMQP hard error: FRAME-ERROR: FRAME_ERROR - type 2, all octets = <<>>: {{frame_too_large,{},{}}}",
                    msg.header_len.saturating_sub(8),
                    frame_max.saturating_sub(8)
                ),
            );
            return;
        }
        let routes = match routes {
            Ok(routes) => routes,
            Err(reason) => {
                log(self, Fate::Refused);
                // The channel closes before the queues' confirms of what it routed just
                // before reach it: their acks may never be sent.
                if self.rng.chance(0.5) {
                    self.agenda.retain(|_, e| {
                        e.link != id
                            || !matches!(e.kind, EventKind::Client(ClientEvent::Ack { .. }))
                    });
                }
                self.server_close(
                    id,
                    at,
                    format!(
                        "protocol error: AMQP soft error: PRECONDITION-FAILED: PRECONDITION_FAILED - invalid message: {reason}"
                    ),
                );
                return;
            }
        };
        let majority = self.majority();
        let nack_rate = self.behaviour.nack_rate;
        let random_nack = self.rng.chance(nack_rate);
        // The routing key's queue and the ones `CC` and `BCC` name, each once.
        let mut queues: Vec<String> = std::iter::once(msg.routing_key.clone())
            .chain(routes)
            .filter(|k| self.queues.contains_key(k))
            .collect();
        queues.sort();
        queues.dedup();
        if queues.is_empty() {
            if msg.mandatory {
                log(self, Fate::Returned);
                let returned = Returned {
                    message_id: message_id.clone(),
                    reply_code: NO_ROUTE,
                };
                self.schedule_client(id, at, ClientEvent::Return(tag, returned));
            } else {
                log(self, Fate::Dropped);
            }
            self.schedule_ack(id, at, tag, false);
            return;
        }
        // Of several queues, the first that withholds holds the message and its confirm (any
        // other withholding one never gets it); one that nacks does not take it, and the
        // confirm is a nack.
        let holds = |q: &Queue| q.withhold || (q.quorum && !majority);
        let held = queues
            .iter()
            .find(|n| self.queues.get(*n).is_some_and(holds))
            .cloned();
        let nack = random_nack
            || queues
                .iter()
                .any(|n| self.queues.get(n).is_some_and(|q| q.nack));
        if !random_nack {
            for n in &queues {
                if self.queues.get(n).is_some_and(|q| !q.nack && !holds(q)) {
                    self.deliver(at, id, n, &msg);
                }
            }
        }
        if let Some(q) = held.and_then(|n| self.queues.get_mut(&n)) {
            q.held.push((id, tag, msg.clone()));
            log(self, Fate::Withheld);
        } else if nack {
            log(self, Fate::Nacked);
            self.schedule_ack(id, at, tag, true);
        } else {
            log(self, Fate::Routed);
            self.schedule_ack(id, at, tag, false);
        }
    }

    fn deliver(&mut self, at: Instant, link: u64, queue: &str, msg: &Message) {
        let (node, connection) = self
            .links
            .get(&link)
            .map(|l| (l.node.clone(), l.name.clone()))
            .unwrap_or_default();
        let seq = self.deliveries.len() as u64;
        self.deliveries.push(Delivery {
            seq,
            queue: queue.to_string(),
            properties: msg.properties.clone(),
            body: msg.body.clone(),
            at,
            node,
            connection,
        });
    }

    /// Schedules a client event after the answer latency, in order with the link's others.
    fn schedule_client(&mut self, id: u64, at: Instant, ev: ClientEvent) -> Option<Key> {
        let latency = self.behaviour.confirm_latency;
        let delay = self.rng.between(latency);
        self.schedule_client_at(id, at + delay, ev)
    }

    fn schedule_client_at(&mut self, id: u64, at: Instant, ev: ClientEvent) -> Option<Key> {
        let link = self.links.get_mut(&id)?;
        let at = at.max(link.last_arrival);
        link.last_arrival = at;
        if matches!(ev, ClientEvent::Closed(_)) {
            link.open_ack = None;
        }
        let key = self.next_key(at);
        self.insert(
            key,
            Event {
                link: id,
                kind: EventKind::Client(ev),
            },
        );
        Some(key)
    }

    /// An ack (or nack) for `tag`; an ack may join the link's last ack still on its way, and
    /// be sent with it as one multiple-ack after everything sent since.
    fn schedule_ack(&mut self, id: u64, at: Instant, tag: u64, nack: bool) {
        let mut tags = vec![tag];
        let join = self.behaviour.ack_multiple;
        if !nack && self.rng.chance(join) {
            let earlier = self.links.get_mut(&id).and_then(|l| l.open_ack.take());
            if let Some(key) = earlier
                && let Some(Event {
                    kind: EventKind::Client(ClientEvent::Ack { tags: t, .. }),
                    ..
                }) = self.agenda.remove(&key)
            {
                tags = t;
                tags.push(tag);
            }
        }
        let key = self.schedule_client(id, at, ClientEvent::Ack { tags, nack });
        if !nack && let Some(l) = self.links.get_mut(&id) {
            l.open_ack = key;
        }
    }

    fn client_event(&mut self, id: u64, at: Instant, ev: ClientEvent) {
        let mode = self.behaviour.returns;
        match ev {
            ClientEvent::Return(tag, r) => {
                if let Some(l) = self.links.get_mut(&id) {
                    l.waiting_returns.push_back((tag, r));
                }
            }
            ClientEvent::Ack { mut tags, nack } => {
                if mode == ReturnAttach::Lapin {
                    self.rng.shuffle(&mut tags);
                }
                let Some(l) = self.links.get_mut(&id) else {
                    return;
                };
                for tag in tags {
                    let returned = match mode {
                        ReturnAttach::Lapin => l.waiting_returns.pop_front(),
                        ReturnAttach::Own => l
                            .waiting_returns
                            .iter()
                            .position(|(t, _)| *t == tag)
                            .and_then(|i| l.waiting_returns.remove(i)),
                    };
                    if returned.as_ref().is_some_and(|(t, _)| *t != tag) {
                        self.returns_elsewhere += 1;
                    }
                    let returned = returned.map(|(_, r)| r);
                    let answer = if nack {
                        Answer::Nack(returned)
                    } else {
                        Answer::Ack(returned)
                    };
                    if let Some(tx) = l.confirms.remove(&tag) {
                        let _ = tx.send(Ok(answer));
                    }
                }
            }
            ClientEvent::Blocked => {
                if let Some(l) = self.links.get_mut(&id) {
                    l.client_blocked = true;
                }
            }
            ClientEvent::Unblocked => {
                if let Some(l) = self.links.get_mut(&id) {
                    l.client_blocked = false;
                }
                self.flush_writes(id, at);
            }
            ClientEvent::Closed(reason) => self.fail_link(id, reason),
        }
    }

    /// The client learns the link is gone: every confirm awaited and every write waiting
    /// fails.
    fn fail_link(&mut self, id: u64, reason: String) {
        let Some(l) = self.links.get_mut(&id) else {
            return;
        };
        l.open = false;
        l.server_gone = true;
        l.client_blocked = false;
        l.closed = Some(reason.clone());
        l.open_ack = None;
        for (_, tx) in std::mem::take(&mut l.confirms) {
            let _ = tx.send(Err(LinkError(reason.clone())));
        }
        for w in std::mem::take(&mut l.writes) {
            let _ = w.written.send(Err(LinkError(reason.clone())));
        }
        for tx in std::mem::take(&mut l.closed_waiters) {
            let _ = tx.send(());
        }
        l.deferred.clear();
        l.client_deferred.clear();
    }

    /// The broker closes the link: it reads nothing more; the client learns it in order
    /// after what the broker sent before.
    fn server_close(&mut self, id: u64, at: Instant, reason: String) {
        if let Some(l) = self.links.get_mut(&id) {
            l.server_gone = true;
        }
        self.schedule_client(id, at, ClientEvent::Closed(reason));
    }

    fn writable(&self, id: u64, size: usize) -> bool {
        let Some(l) = self.links.get(&id) else {
            return false;
        };
        l.open
            && !l.closing
            && !l.client_blocked
            && (l.unread == 0 || l.unread.saturating_add(size) <= self.behaviour.socket_buffer)
    }

    /// Writes the message: the broker will read it after the publish latency, in order.
    fn write_now(&mut self, id: u64, at: Instant, tag: u64, msg: Message) {
        let latency = self.behaviour.publish_latency;
        let delay = self.rng.between(latency);
        let Some(l) = self.links.get_mut(&id) else {
            return;
        };
        l.unread = l.unread.saturating_add(msg.size());
        let when = (at + delay).max(l.last_proc);
        l.last_proc = when;
        let key = self.next_key(when);
        self.insert(
            key,
            Event {
                link: id,
                kind: EventKind::Process {
                    tag,
                    msg: Box::new(msg),
                },
            },
        );
    }

    /// Writes what waits, in order, while the link takes it.
    fn flush_writes(&mut self, id: u64, at: Instant) {
        loop {
            let Some(size) = self
                .links
                .get(&id)
                .and_then(|l| l.writes.front())
                .map(|w| w.msg.size())
            else {
                return;
            };
            if !self.writable(id, size) {
                return;
            }
            let Some(w) = self.links.get_mut(&id).and_then(|l| l.writes.pop_front()) else {
                return;
            };
            self.write_now(id, at, w.tag, w.msg);
            let _ = w.written.send(Ok(()));
        }
    }

    /// The broker reads the link again (unblocked or no longer stalled): what it deferred
    /// is read in order; what it sent meanwhile arrives.
    fn resume_link(&mut self, id: u64, now: Instant) {
        let Some(l) = self.links.get_mut(&id) else {
            return;
        };
        if l.server_gone {
            return;
        }
        let deferred = std::mem::take(&mut l.deferred);
        let client = std::mem::take(&mut l.client_deferred);
        l.last_proc = l.last_proc.max(now);
        for kind in deferred {
            let latency = self.behaviour.publish_latency;
            let delay = self.rng.between(latency);
            let Some(l) = self.links.get_mut(&id) else {
                return;
            };
            let when = (now + delay).max(l.last_proc);
            l.last_proc = when;
            let key = self.next_key(when);
            self.insert(key, Event { link: id, kind });
        }
        if client.is_empty() {
            return;
        }
        // What was held goes first, then what the broker sent since, each no earlier than it
        // was due.
        let later: Vec<Key> = self
            .agenda
            .iter()
            .filter(|(_, e)| e.link == id && matches!(e.kind, EventKind::Client(_)))
            .map(|(k, _)| *k)
            .collect();
        let open_ack = self.links.get(&id).and_then(|l| l.open_ack);
        let later: Vec<(Key, Event)> = later
            .into_iter()
            .filter_map(|k| self.agenda.remove(&k).map(|e| (k, e)))
            .collect();
        if let Some(l) = self.links.get_mut(&id) {
            l.last_arrival = now;
            l.open_ack = None;
        }
        for ev in client {
            self.schedule_client_at(id, now, ev);
        }
        for (key, event) in later {
            if let EventKind::Client(ev) = event.kind {
                let new = self.schedule_client_at(id, key.0, ev);
                if open_ack == Some(key)
                    && let Some(l) = self.links.get_mut(&id)
                {
                    l.open_ack = new;
                }
            }
        }
    }
}

impl Broker for RabbitModel {
    fn open(&self, uri: &str, name: &str) -> BoxFuture<'static, Result<Box<dyn Link>, LinkError>> {
        let model = self.clone();
        let uri = uri.to_string();
        let name = name.to_string();
        Box::pin(async move {
            match model.open_link(uri.clone(), name) {
                OpenOutcome::Fail(latency, e) => {
                    tokio::time::sleep(latency).await;
                    Err(LinkError(e))
                }
                OpenOutcome::Hang => futures::future::pending().await,
                OpenOutcome::After(latency, key, name) => {
                    tokio::time::sleep(latency).await;
                    let id = model.finish_open(&uri, key, name)?;
                    Ok(Box::new(ModelLink { model, id }) as Box<dyn Link>)
                }
            }
        })
    }
}

/// One link of the model.
#[derive(Clone)]
pub struct ModelLink {
    model: RabbitModel,
    id: u64,
}

impl fmt::Debug for ModelLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelLink").field("id", &self.id).finish()
    }
}

impl Link for ModelLink {
    fn status(&self) -> LinkStatus {
        let s = self.model.now();
        s.links
            .get(&self.id)
            .map_or(LinkStatus::default(), |l| LinkStatus {
                connected: l.open && !l.closing,
                blocked: l.open && l.client_blocked,
            })
    }

    fn frame_max(&self) -> u32 {
        self.model
            .lock()
            .links
            .get(&self.id)
            .map_or(0, |l| l.frame_max)
    }

    fn server_version(&self) -> Option<String> {
        self.model
            .lock()
            .links
            .get(&self.id)
            .and_then(|l| l.version.clone())
    }

    fn publish(
        &self,
        routing_key: &str,
        body: Vec<u8>,
        properties: BasicProperties,
        mandatory: bool,
    ) -> BoxFuture<'static, Result<Confirm, LinkError>> {
        let model = self.model.clone();
        let id = self.id;
        let msg = Message::new(routing_key, body, properties, mandatory);
        Box::pin(async move {
            // As lapin: the publish takes its delivery tag and queues its frames when first
            // polled; dropping the future afterwards does not unsend it.
            let (confirm_rx, written_rx) = {
                let now = Instant::now();
                let mut s = model.now();
                let Some(l) = s.links.get_mut(&id) else {
                    return Err(LinkError("no such connection".into()));
                };
                if !l.open || l.closing {
                    let reason = l
                        .closed
                        .clone()
                        .unwrap_or_else(|| "connection is closing".into());
                    return Err(LinkError(format!("invalid connection state: {reason}")));
                }
                let tag = l.next_tag;
                l.next_tag += 1;
                let (ctx, crx) = oneshot::channel();
                l.confirms.insert(tag, ctx);
                let size = msg.size();
                let waiting = !l.writes.is_empty();
                if !waiting && s.writable(id, size) {
                    s.write_now(id, now, tag, msg);
                    (crx, None)
                } else {
                    let (wtx, wrx) = oneshot::channel();
                    if let Some(l) = s.links.get_mut(&id) {
                        l.writes.push_back(PendingWrite {
                            tag,
                            msg,
                            written: wtx,
                        });
                    }
                    (crx, Some(wrx))
                }
            };
            if let Some(rx) = written_rx {
                match model.drive(rx).await {
                    Some(Ok(())) => {}
                    Some(Err(e)) => return Err(e),
                    None => return Err(LinkError("connection dropped".into())),
                }
            }
            let confirm: Confirm = Box::pin(async move {
                model
                    .drive(confirm_rx)
                    .await
                    .unwrap_or_else(|| Err(LinkError("connection dropped".into())))
            });
            Ok(confirm)
        })
    }

    fn close(&self, code: u16, reason: &str) -> BoxFuture<'static, Result<(), LinkError>> {
        let model = self.model.clone();
        let id = self.id;
        let _ = (code, reason);
        Box::pin(async move {
            let rx = {
                let now = Instant::now();
                let mut s = model.now();
                let latency = s.behaviour.publish_latency;
                let delay = s.rng.between(latency);
                let Some(l) = s.links.get_mut(&id) else {
                    return Ok(());
                };
                if l.closed.is_some() {
                    return Ok(());
                }
                l.closing = true;
                for w in std::mem::take(&mut l.writes) {
                    let _ = w
                        .written
                        .send(Err(LinkError("connection is closing".into())));
                }
                let (tx, rx) = oneshot::channel();
                l.closed_waiters.push(tx);
                let when = (now + delay).max(l.last_proc);
                l.last_proc = when;
                let key = s.next_key(when);
                s.insert(
                    key,
                    Event {
                        link: id,
                        kind: EventKind::CloseRequest,
                    },
                );
                rx
            };
            model.drive(rx).await;
            Ok(())
        })
    }
}
