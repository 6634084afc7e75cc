//! One run of one scenario: a current-thread tokio runtime with a paused clock and a seeded
//! scheduler, the two models, and 1..4 instances of the real daemon (`run_tasks`), each on a
//! simulated host of its own, each talking to the models through a wire of its own
//! ([`Wire`], [`Wan`]) on which the swarm injects the instance's faults (kill -9, pauses,
//! slow or cut MongoDB, lost, withheld or blocked RabbitMQ) and through which the checker
//! sees every call, publish and confirm.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bson::{Bson, Document, doc};
use futures::future::BoxFuture;
use lapin::BasicProperties;
use timeoutd::config::{Config, MessageIdMode, TimeEncoding};
use timeoutd::rabbit::link::{Answer, Broker, Confirm, Link, LinkError, LinkStatus};
use timeoutd::service::health::Health;
use timeoutd::store::backend::{Backend, ChangeStream, MongoError, Op, Reply};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::invariants::{Checker, Expect, RecordInfo, Violation, without_locks};
use super::models;
use super::swarm::{ActionKind, FaultKind, RecordKind, Scenario, UNROUTABLE};
use super::trace::Trace;

/// Faults in force on one instance's wires.
#[derive(Debug, Default)]
struct Ctl {
    killed: bool,
    paused_until: Option<Instant>,
    mongo_slow: Option<(Instant, Duration)>,
    mongo_cut_until: Option<Instant>,
    rabbit_cut_until: Option<Instant>,
    /// Bumped by each RabbitMQ cut: links opened before it are dead.
    rabbit_epoch: u64,
    withhold_until: Option<Instant>,
    blocked_until: Option<Instant>,
}

fn live(until: Option<Instant>) -> bool {
    until.is_some_and(|u| Instant::now() < u)
}

/// What every wire shares: the checker, the trace, the models.
#[derive(Debug)]
pub struct World {
    start: Instant,
    pub trace: Trace,
    pub checker: Mutex<Checker>,
    pub mongo: models::Mongo,
    pub rabbit: models::Rabbit,
    bound: BTreeSet<String>,
    queues: Vec<String>,
    timeouts: String,
    parked: String,
    decoding: timeoutd::record::Decoding,
    /// Reschedules racing claims: the draw, the chance per read, the records moved so far,
    /// and whether faults are still on.
    race: Mutex<Race>,
}

#[derive(Debug)]
struct Race {
    draw: super::swarm::Draw,
    chance: f64,
    moved: BTreeSet<String>,
    on: bool,
}

impl World {
    pub fn now_ms(&self) -> u64 {
        Instant::now()
            .saturating_duration_since(self.start)
            .as_millis() as u64
    }

    fn checker(&self) -> std::sync::MutexGuard<'_, Checker> {
        self.checker.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// After a model answered a call: check the call, then the collections.
    fn after_call(
        &self,
        instance: usize,
        collection: &str,
        op: &Op,
        reply: &Result<Reply, MongoError>,
    ) {
        let at = self.now_ms();
        let summary = match reply {
            Ok(Reply::Docs(d)) => format!("{} docs", d.len()),
            Ok(Reply::Count(n)) => format!("count {n}"),
            Ok(Reply::Values(v)) => format!("{} values", v.len()),
            Ok(Reply::Doc(d)) => format!("doc {}", d.is_some()),
            Ok(Reply::Written(w)) => format!(
                "m{} u{} d{} i{}",
                w.matched, w.modified, w.deleted, w.inserted
            ),
            Err(e) => format!("error {}", super::trace::short(&e.kind, 60)),
        };
        self.trace.event(
            at,
            &format!("i{instance}"),
            format!("{} {collection}: {summary}", op.name()),
        );
        if let Ok(reply) = reply {
            let server_ms = models::server_ms(&self.mongo);
            self.checker()
                .call((at, server_ms), instance, collection, op, reply);
        }
        if let (Op::Find { .. }, Ok(Reply::Docs(docs))) = (op, reply)
            && collection == self.timeouts
        {
            self.race_a_claim(docs);
        }
        // Only a write changes what the collections hold (a failed one may have written too).
        let writes = !matches!(op, Op::Find { .. } | Op::Count { .. } | Op::Distinct { .. });
        if writes && (collection == self.timeouts || collection == self.parked) {
            self.look(at);
        }
    }

    /// A read of `Timeouts` just returned `docs`: by the seed's chance, the operator moves
    /// one of them later at once, before the reader can take it.
    fn race_a_claim(&self, docs: &[Document]) {
        let picked = {
            let mut r = self.race.lock().unwrap_or_else(PoisonError::into_inner);
            let chance = r.chance;
            if !r.on || docs.is_empty() || !r.draw.chance(chance) {
                return;
            }
            let i = r.draw.range(0, docs.len() as u64 - 1) as usize;
            let by = r
                .draw
                .range(super::swarm::RACE_LATER_MS.0, super::swarm::RACE_LATER_MS.1);
            let Some(id) = docs.get(i).and_then(|d| d.get("_id")).cloned() else {
                return;
            };
            let k = super::invariants::key(&id);
            if !r.moved.insert(k.clone()) {
                return;
            }
            (k, id, by as i64)
        };
        let (k, id, by_ms) = picked;
        apply_action(self, &k, &id, Some(by_ms));
    }

    /// Checks the collections as the server holds them now.
    fn look(&self, at: u64) {
        let timeouts = models::docs(&self.mongo, &self.timeouts);
        let parked = models::docs(&self.mongo, &self.parked);
        let server_ms = models::server_ms(&self.mongo);
        self.checker().look(at, server_ms, &timeouts, &parked);
    }

    /// The record a message is of (its `MessageId` or, with random ids, `CorrelationId`).
    fn record_of(&self, props: &BasicProperties) -> Option<String> {
        let c = self.checker();
        if let Some(id) = props.message_id()
            && let Some(r) = c.record_of(id.as_str())
        {
            return Some(r);
        }
        c.record_of(&correlation_id(props)?)
    }

    fn published(
        &self,
        instance: usize,
        routing_key: &str,
        props: &BasicProperties,
    ) -> Option<String> {
        let at = self.now_ms();
        let record = self.record_of(props);
        self.trace.event(
            at,
            &format!("i{instance}"),
            format!(
                "publish {} to {}",
                record.as_deref().unwrap_or("?"),
                super::trace::short(&routing_key, 40)
            ),
        );
        let record = record?;
        let correlation = correlation_id(props);
        self.checker()
            .sent_as(at, instance, &record, routing_key, correlation.as_deref());
        let server_ms = models::server_ms(&self.mongo);
        let id = self.checker().id_of(&record);
        let doc = id.and_then(|id| models::doc(&self.mongo, &self.timeouts, &id));
        self.checker()
            .published(at, instance, &record, doc.as_ref(), server_ms);
        Some(record)
    }

    fn confirmed(
        &self,
        instance: usize,
        routing_key: &str,
        record: Option<&str>,
        answer: &Result<Answer, LinkError>,
    ) {
        let at = self.now_ms();
        let routed = matches!(answer, Ok(Answer::Ack(_))) && self.bound.contains(routing_key);
        self.trace.event(
            at,
            &format!("i{instance}"),
            format!(
                "confirm {} {}",
                record.unwrap_or("?"),
                match answer {
                    Ok(Answer::Ack(None)) => "ack".to_string(),
                    Ok(Answer::Ack(Some(r))) => format!("ack+return {}", r.reply_code),
                    Ok(Answer::Nack(_)) => "nack".to_string(),
                    Ok(Answer::NotRequested) => "not-requested".to_string(),
                    Err(e) => format!("error {e}"),
                }
            ),
        );
        if routed && let Some(record) = record {
            self.checker().delivered(instance, record);
        }
    }
}

/// A message's `CorrelationId` header, as text.
fn correlation_id(props: &BasicProperties) -> Option<String> {
    let headers = props.headers().as_ref()?;
    match headers.inner().get("CorrelationId")? {
        lapin::types::AMQPValue::LongString(s) => {
            Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
        }
        lapin::types::AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
}

/// Waits while the instance is paused; never returns once it is killed (kill -9: nothing it
/// sends or receives moves again).
async fn gate(ctl: &Arc<Mutex<Ctl>>) {
    loop {
        let (killed, paused) = {
            let c = ctl.lock().unwrap_or_else(PoisonError::into_inner);
            (c.killed, c.paused_until.filter(|u| Instant::now() < *u))
        };
        if killed {
            std::future::pending::<()>().await;
        }
        match paused {
            Some(until) => tokio::time::sleep_until(until).await,
            None => return,
        }
    }
}

fn ctl_of(ctl: &Arc<Mutex<Ctl>>) -> std::sync::MutexGuard<'_, Ctl> {
    ctl.lock().unwrap_or_else(PoisonError::into_inner)
}

fn network_error(what: &str) -> MongoError {
    MongoError::from(std::io::Error::new(
        std::io::ErrorKind::ConnectionReset,
        format!("simulated network cut ({what})"),
    ))
}

/// The wire between one instance and the MongoDB model.
#[derive(Debug, Clone)]
pub struct Wire {
    instance: usize,
    inner: Arc<dyn Backend>,
    ctl: Arc<Mutex<Ctl>>,
    world: Arc<World>,
}

impl Wire {
    /// Gate, cut and slowness before and after one call; the call itself runs in a task of
    /// its own on the server, so a client that gives up does not stop it.
    fn call<T: Send + 'static>(
        &self,
        what: &'static str,
        server: BoxFuture<'static, Result<T, MongoError>>,
        after: impl FnOnce(&Result<T, MongoError>) + Send + 'static,
    ) -> BoxFuture<'static, Result<T, MongoError>> {
        let ctl = self.ctl.clone();
        Box::pin(async move {
            gate(&ctl).await;
            if live(ctl_of(&ctl).mongo_cut_until) {
                return Err(network_error(what));
            }
            #[allow(clippy::disallowed_methods)]
            let running = tokio::spawn(async move {
                let r = server.await;
                after(&r);
                r
            });
            let r = match running.await {
                Ok(r) => r,
                Err(e) => Err(MongoError::custom(format!("model task failed: {e}"))),
            };
            let slow = ctl_of(&ctl).mongo_slow.filter(|(u, _)| Instant::now() < *u);
            if let Some((_, delay)) = slow {
                tokio::time::sleep(delay).await;
            }
            gate(&ctl).await;
            if live(ctl_of(&ctl).mongo_cut_until) {
                return Err(network_error(what));
            }
            r
        })
    }
}

/// A take in flight on a wire: unless it is seen to succeed, its drop tells the checker
/// that the instance did not see it (see the `orphaned-lease` invariant).
struct TakeInFlight {
    world: Arc<World>,
    instance: usize,
    owner: Option<String>,
}

impl Drop for TakeInFlight {
    fn drop(&mut self) {
        if let Some(owner) = self.owner.take() {
            let at = (self.world.now_ms(), models::server_ms(&self.world.mongo));
            self.world.checker().take_unseen(self.instance, owner, at);
        }
    }
}

/// A publish's confirm on its way to the instance: unless the instance sees an answer, its
/// drop tells the checker that the instance gave up on it (see the `hold-off` invariant).
struct AnswerInFlight {
    world: Arc<World>,
    instance: usize,
    record: Option<String>,
}

impl AnswerInFlight {
    fn seen(mut self) {
        self.record = None;
        self.world.checker().answer_seen(self.instance);
    }
}

impl Drop for AnswerInFlight {
    fn drop(&mut self) {
        if let Some(record) = self.record.take() {
            let at = self.world.now_ms();
            self.world
                .checker()
                .answer_unseen(self.instance, &record, at);
        }
    }
}

/// The fresh owner a write leases records to (`$set: {LockedBy: owner}`, not the nil GUID).
fn leases_to(op: &Op) -> Option<String> {
    let Op::Update { update, .. } = op else {
        return None;
    };
    let owner = update.get_document("$set").ok()?.get("LockedBy")?;
    super::invariants::uuid_text(owner).filter(|o| o.bytes().any(|b| b != b'0'))
}

impl Backend for Wire {
    fn run(&self, collection: &str, op: Op) -> BoxFuture<'static, Result<Reply, MongoError>> {
        let take = (collection == self.world.timeouts)
            .then(|| leases_to(&op))
            .flatten();
        if collection == self.world.timeouts {
            let at = self.world.now_ms();
            self.world.checker().asked(at, self.instance, &op);
        }
        let server = self.inner.run(collection, op.clone());
        let (world, instance, coll) = (self.world.clone(), self.instance, collection.to_string());
        let call = self.call(op.name(), server, move |r| {
            world.after_call(instance, &coll, &op, r)
        });
        let Some(owner) = take else {
            return call;
        };
        let in_flight = TakeInFlight {
            world: self.world.clone(),
            instance,
            owner: Some(owner),
        };
        Box::pin(async move {
            // The whole guard moves in (not only the field the block writes).
            let mut in_flight = in_flight;
            let r = call.await;
            if r.is_ok() {
                in_flight.owner = None;
            }
            r
        })
    }

    fn command(&self, command: Document) -> BoxFuture<'static, Result<Document, MongoError>> {
        let name = command.keys().next().cloned().unwrap_or_default();
        let reads_clock = matches!(name.as_str(), "hello" | "isMaster" | "ismaster");
        let server = self.inner.command(command);
        let (world, instance) = (self.world.clone(), self.instance);
        let call = self.call("command", server, move |r| {
            world.trace.event(
                world.now_ms(),
                &format!("i{instance}"),
                format!("command {name}: {}", if r.is_ok() { "ok" } else { "error" }),
            );
        });
        if !reads_clock {
            return call;
        }
        // The checker learns when the instance's latest reading of the server clock was
        // asked for (a step back after it is one the instance cannot see); a `hello` given
        // up on (its deadline dropped it) is one that failed.
        let world = self.world.clone();
        Box::pin(async move {
            let mut hello = Hello {
                sent: world.now_ms(),
                world,
                instance,
                ok: None,
            };
            let r = call.await;
            hello.ok = Some(r.is_ok());
            r
        })
    }

    fn watch(
        &self,
        collection: &str,
        pipeline: Vec<Document>,
    ) -> BoxFuture<'static, Result<ChangeStream, MongoError>> {
        let server = self.inner.watch(collection, pipeline);
        self.call("watch", server, |_| {})
    }

    fn shutdown(&self) -> BoxFuture<'static, ()> {
        self.inner.shutdown()
    }
}

/// The wire between one instance and the RabbitMQ model.
#[derive(Debug, Clone)]
pub struct Wan {
    instance: usize,
    inner: Arc<dyn Broker>,
    ctl: Arc<Mutex<Ctl>>,
    world: Arc<World>,
}

impl Broker for Wan {
    fn open(&self, uri: &str, name: &str) -> BoxFuture<'static, Result<Box<dyn Link>, LinkError>> {
        // Each instance's connections carry its number, so that the broker's deliveries
        // tell which instance sent each message.
        let opening = self.inner.open(uri, &format!("{name}#i{}", self.instance));
        let this = self.clone();
        Box::pin(async move {
            gate(&this.ctl).await;
            if live(ctl_of(&this.ctl).rabbit_cut_until) {
                return Err(LinkError("simulated network cut (connect)".into()));
            }
            let link = opening.await?;
            gate(&this.ctl).await;
            let epoch = ctl_of(&this.ctl).rabbit_epoch;
            this.world.trace.event(
                this.world.now_ms(),
                &format!("i{}", this.instance),
                "link open",
            );
            Ok(Box::new(WLink {
                wan: this.clone(),
                inner: Arc::from(link),
                epoch,
            }) as Box<dyn Link>)
        })
    }
}

#[derive(Debug)]
struct WLink {
    wan: Wan,
    inner: Arc<dyn Link>,
    epoch: u64,
}

impl WLink {
    fn dead(&self) -> bool {
        let c = ctl_of(&self.wan.ctl);
        c.killed || c.rabbit_epoch != self.epoch
    }
}

impl Link for WLink {
    fn status(&self) -> LinkStatus {
        let mut s = self.inner.status();
        if self.dead() {
            s.connected = false;
        }
        if live(ctl_of(&self.wan.ctl).blocked_until) {
            s.blocked = true;
        }
        s
    }

    fn frame_max(&self) -> u32 {
        self.inner.frame_max()
    }

    fn server_version(&self) -> Option<String> {
        self.inner.server_version()
    }

    fn publish(
        &self,
        routing_key: &str,
        body: Vec<u8>,
        properties: BasicProperties,
        mandatory: bool,
    ) -> BoxFuture<'static, Result<Confirm, LinkError>> {
        let (wan, inner, epoch) = (self.wan.clone(), self.inner.clone(), self.epoch);
        let rk = routing_key.to_string();
        Box::pin(async move {
            gate(&wan.ctl).await;
            let dead = || {
                let c = ctl_of(&wan.ctl);
                c.killed || c.rabbit_epoch != epoch
            };
            if dead() {
                return Err(LinkError("simulated link lost".into()));
            }
            let record = wan.world.published(wan.instance, &rk, &properties);
            // A content header frame past the connection's frame_max makes the broker close
            // the connection, and every confirm on it is lost.
            let header = super::rabbit::header_frame_len(&properties);
            if header > inner.frame_max() as usize {
                let at = wan.world.now_ms();
                wan.world.checker().broken(
                    at,
                    "frame-too-large",
                    format!(
                        "instance {} sent a {header}-byte header frame of {} on a connection whose frame_max is {}",
                        wan.instance,
                        record.as_deref().unwrap_or("?"),
                        inner.frame_max()
                    ),
                );
            }
            let confirm = inner.publish(&rk, body, properties, mandatory).await?;
            // Unless the instance sees an answer, its drop tells the checker it gave up.
            let seen = AnswerInFlight {
                world: wan.world.clone(),
                instance: wan.instance,
                record: record.clone(),
            };
            let (world, instance, ctl) = (wan.world.clone(), wan.instance, wan.ctl.clone());
            // The broker's answer, seen by the checker when the broker gives it; then
            // withheld, lost with the link, or held while the instance is paused.
            #[allow(clippy::disallowed_methods)]
            let answered = tokio::spawn(async move {
                let answer = confirm.await;
                world.confirmed(instance, &rk, record.as_deref(), &answer);
                answer
            });
            let confirm: Confirm = Box::pin(async move {
                let seen = seen;
                let answer = match answered.await {
                    Ok(a) => a,
                    Err(e) => Err(LinkError(format!("model task failed: {e}"))),
                };
                loop {
                    let (until, dead_now) = {
                        let c = ctl_of(&ctl);
                        (
                            c.withhold_until.filter(|u| Instant::now() < *u),
                            c.killed || c.rabbit_epoch != epoch,
                        )
                    };
                    if dead_now {
                        return Err(LinkError("simulated link lost before the confirm".into()));
                    }
                    match until {
                        Some(u) => tokio::time::sleep_until(u).await,
                        None => break,
                    }
                }
                gate(&ctl).await;
                if answer.is_ok() {
                    seen.seen();
                }
                answer
            });
            Ok(confirm)
        })
    }

    fn close(&self, code: u16, reason: &str) -> BoxFuture<'static, Result<(), LinkError>> {
        self.inner.close(code, reason)
    }
}

/// One instance as the fleet runs it.
struct Instance {
    ctl: Arc<Mutex<Ctl>>,
    health: Arc<Health>,
    shutdown: CancellationToken,
    host: Arc<timeoutd::host::Host>,
    task: tokio::task::JoinHandle<()>,
}

/// What a run found.
#[derive(Debug)]
pub struct Outcome {
    pub violation: Option<Violation>,
    pub trace_hash: u64,
    pub events: u64,
    pub tail: Vec<String>,
    pub all: Option<Vec<String>>,
    pub virtual_ms: u64,
    pub stats: std::collections::BTreeMap<&'static str, u64>,
}

/// The daemon's configuration for a scenario.
pub fn config_of(s: &Scenario) -> Config {
    let k = &s.knobs;
    let mut c = Config::default();
    c.mongodb.uri = "mongodb://sim".into();
    c.mongodb.time_encoding = match k.time_encoding.as_str() {
        "dotnet-ticks" => TimeEncoding::DotnetTicks,
        "date" => TimeEncoding::Date,
        _ => TimeEncoding::Auto,
    };
    c.mongodb.operation_timeout = Duration::from_millis(k.op_timeout_ms);
    c.rabbitmq.uri = super::models::NODES.join(",");
    c.rabbitmq.message_id = if k.message_id == "stable" {
        MessageIdMode::Stable
    } else {
        MessageIdMode::Random
    };
    c.rabbitmq.publish_timeout = Duration::from_millis(k.publish_timeout_ms);
    c.rabbitmq.connect_timeout = Duration::from_millis(k.connect_timeout_ms);
    let d = &mut c.dispatch;
    d.poll_interval = Duration::from_millis(k.poll_ms);
    d.batch_size = k.batch_size;
    d.lock_lease = Duration::from_millis(k.lease_ms);
    d.lease_safety_margin = Duration::from_millis(k.margin_ms);
    d.shutdown_timeout = Duration::from_millis(k.shutdown_timeout_ms);
    d.look_ahead = k.look_ahead_ms.map(Duration::from_millis);
    d.max_rate = k.max_rate;
    d.destination = k
        .destination_rates
        .iter()
        .map(|(name, max_rate)| timeoutd::config::DestinationLimit {
            name: name.clone(),
            max_rate: *max_rate,
        })
        .collect();
    c.retry.base = Duration::from_millis(k.retry_base_ms);
    c.retry.cap = Duration::from_millis(k.retry_cap_ms);
    c.retry.max_attempts = k.max_attempts;
    c
}

/// The documents a scenario inserts, with what the checker must know of each, when each is
/// inserted, and whether beside a claim ([`super::swarm::RecordSpec::during_claim`]).
fn documents(s: &Scenario, config: &Config) -> Vec<(Document, RecordInfo, u64, bool)> {
    let mut d = super::swarm::Draw::new(s.seed ^ 0xD0C5);
    let encoding = config.mongodb.time_encoding;
    let stable = config.rabbitmq.message_id == MessageIdMode::Stable;
    let decoding = timeoutd::record::Decoding::from(encoding);
    let mut out = Vec::new();
    for (n, r) in s.records.iter().enumerate() {
        let mut park_reasons = None;
        let due_ms = s.start_unix_ms + r.due_ms;
        let due = bson::DateTime::from_millis(due_ms);
        // The instant the checker knows an ordinary record due at, worked out apart from
        // timeoutd's decoder; a hostile one's is what the decoder makes of it.
        let mut due_at = None;
        let mut sent_as = None;
        let (doc, expect) = match &r.kind {
            RecordKind::Ordinary { .. } | RecordKind::Unroutable => {
                let destination = match &r.kind {
                    RecordKind::Ordinary { destination } => s
                        .destinations
                        .get(*destination)
                        .cloned()
                        .unwrap_or_else(|| UNROUTABLE.into()),
                    _ => UNROUTABLE.into(),
                };
                let id = uuid::Uuid::from_u64_pair(d.next(), d.next());
                let pm = uuid::Uuid::from_u64_pair(d.next(), n as u64);
                sent_as = Some((destination.clone(), pm.hyphenated().to_string()));
                let dates = match encoding {
                    TimeEncoding::Date => true,
                    TimeEncoding::DotnetTicks => false,
                    TimeEncoding::Auto => d.chance(0.5),
                };
                let time = if dates {
                    due_at = Some(due_ms);
                    Bson::DateTime(due)
                } else {
                    // .NET's ticks, perhaps between two milliseconds: due at the next one.
                    let ticks = timeoutd::record::ms_to_ticks(due_ms) + i64::from(r.due_ticks);
                    due_at = Some(due_ms + i64::from(r.due_ticks > 0));
                    Bson::Array(vec![Bson::Int64(ticks), Bson::Int32(0)])
                };
                let doc = doc! {
                    "_id": timeoutd::record::uuid_bson(id),
                    "Destination": destination.clone(),
                    "ProcessManagerId": timeoutd::record::uuid_bson(pm),
                    "Time": time,
                    "Headers": headers(r.header_bytes),
                    "Locked": false,
                    "LockedBy": timeoutd::record::uuid_bson(uuid::Uuid::nil()),
                    "LockExpiresAt": Bson::Null,
                };
                let expect = if destination == UNROUTABLE {
                    Expect::Parked
                } else {
                    Expect::DeliveredOrParked
                };
                // The reasons it may be parked for: a queue nothing is bound to returns it;
                // any queue may nack it; headers past the smallest node's frame make it
                // unsendable there.
                let mut reasons = vec!["nacked"];
                if destination == UNROUTABLE {
                    reasons.push("unroutable");
                }
                // (Its other properties and headers take well under 1 KiB of the frame.)
                let smallest = s
                    .knobs
                    .node_frame_max
                    .iter()
                    .copied()
                    .min()
                    .unwrap_or(u32::MAX);
                if r.header_bytes > 0 && r.header_bytes.saturating_add(1_024) > smallest {
                    reasons.push("unsendable");
                }
                park_reasons = Some(reasons);
                (doc, expect)
            }
            RecordKind::Hostile { seed } => {
                let bytes = super::hostile::seeded_bytes(*seed, 4096);
                let mut u = arbitrary::Unstructured::new(&bytes);
                let dest = s.destinations.first().cloned().unwrap_or_default();
                match super::hostile::timeout_document(&mut u, due_ms, &dest, false) {
                    Ok(doc) => (doc, Expect::Any),
                    Err(_) => continue,
                }
            }
        };
        let (message_key, due_known) = match timeoutd::record::TimeoutRecord::decode(&doc, decoding)
        {
            Ok(rec) => (
                Some(if stable {
                    rec.id.hyphenated().to_string()
                } else {
                    rec.process_manager_id.hyphenated().to_string()
                }),
                due_at.or(Some(rec.due.timestamp_millis())),
            ),
            Err(_) => (None, None),
        };
        let Some(id) = doc.get("_id").cloned() else {
            continue;
        };
        let info = RecordInfo {
            id,
            message_key,
            due_ms: due_known,
            expect,
            fields: without_locks(&doc),
            inserted: false,
            spec: n,
            park_reasons,
            on_time_ms: r.on_time.then(|| s.on_time_ms() as i64),
            inserted_server_ms: 0,
            sent_as,
        };
        out.push((doc, info, r.insert_at_ms, r.during_claim));
    }
    out
}

/// A record's stored `Headers`, padded by `pad` bytes.
fn headers(pad: u32) -> Document {
    let mut h = doc! { "Tenant": "sim" };
    if pad > 0 {
        h.insert("Pad", "x".repeat(pad as usize));
    }
    h
}

/// Options of one run.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Keep every trace line (not only the tail).
    pub keep_trace: bool,
    /// Invariants counted instead of failing the run (`--allow`).
    pub allow: Vec<String>,
}

/// Runs one scenario to its end (or to its first broken invariant), into a trace the caller
/// holds: a runner that gives up on a run that does not end (a hang) still has its last
/// events.
pub fn run(s: &Scenario, opts: RunOptions, trace: Trace) -> Outcome {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .rng_seed(tokio::runtime::RngSeed::from_bytes(&s.seed.to_le_bytes()))
        .build();
    let rt = match rt {
        Ok(rt) => rt,
        Err(e) => panic!("cannot build the simulation's runtime: {e}"),
    };
    // A recorder of this run's own: the fleet's counters, read at the end.
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let metrics = recorder.handle();
    let _local = metrics::set_default_local_recorder(&recorder);
    let outcome = rt.block_on(run_in(s, opts, trace, metrics));
    // The instances' leftover tasks (those of killed instances wait forever) go with it.
    rt.shutdown_background();
    outcome
}

async fn run_in(
    s: &Scenario,
    opts: RunOptions,
    trace: Trace,
    metrics: metrics_exporter_prometheus::PrometheusHandle,
) -> Outcome {
    let config = Arc::new(config_of(s));
    let opts = &opts;
    let (timeouts, parked) = (
        config.mongodb.collection.clone(),
        config.mongodb.parked_collection(),
    );
    let mongo = models::new_mongo(&config.mongodb.database, s.seed, s.start_unix_ms, &s.knobs);
    let rabbit = models::new_rabbit(s.seed, &s.destinations, &s.knobs);
    let world = Arc::new(World {
        start: Instant::now(),
        trace: trace.clone(),
        checker: Mutex::new({
            let mut c = Checker::new(&timeouts, &parked);
            c.allowed = opts.allow.iter().cloned().collect();
            c.lease_ms = s.knobs.lease_ms;
            c
        }),
        mongo,
        rabbit,
        bound: s.destinations.iter().cloned().collect(),
        queues: s.destinations.clone(),
        timeouts: timeouts.clone(),
        parked: parked.clone(),
        decoding: timeoutd::record::Decoding::from(config.mongodb.time_encoding),
        race: Mutex::new(Race {
            draw: super::swarm::Draw::new(s.seed ^ 0x5ACE),
            chance: s.reschedule_on_read,
            moved: BTreeSet::new(),
            on: true,
        }),
    });
    let mut pending = Vec::new();
    for (doc, info, at, during_claim) in documents(s, &config) {
        world.checker().add_record(info);
        pending.push((at, doc, during_claim));
    }
    pending.sort_by_key(|(at, _, _)| *at);
    let mut instances: Vec<Option<Instance>> = Vec::new();
    let start_instance = |i: usize, skew_ms: i64| -> Instance {
        let ctl = Arc::new(Mutex::new(Ctl::default()));
        let host = timeoutd::host::Host::simulated(
            s.seed.wrapping_mul(31).wrapping_add(i as u64),
            s.start_unix_ms,
            skew_ms,
        );
        let wire = Wire {
            instance: i,
            inner: models::backend(&world.mongo, i),
            ctl: ctl.clone(),
            world: world.clone(),
        };
        let wan = Wan {
            instance: i,
            inner: models::broker(&world.rabbit),
            ctl: ctl.clone(),
            world: world.clone(),
        };
        let shutdown = CancellationToken::new();
        let (config, token, trace) = (config.clone(), shutdown.clone(), trace.clone());
        let task_host = host.clone();
        let world2 = world.clone();
        let health = Arc::new(
            Health::new(config.dispatch.poll_interval)
                .with_stall_after(timeoutd::service::progress::stall_after(&config)),
        );
        let health2 = health.clone();
        #[allow(clippy::disallowed_methods)]
        let task = tokio::spawn(timeoutd::host::scope(task_host, async move {
            let health = health2;
            let store = models::store(&config, Arc::new(wire));
            let publisher = models::publisher(&config, Arc::new(wan));
            let result = match publisher {
                Ok(p) => timeoutd::cli::daemon::run_tasks(config, store, p, health, token).await,
                Err(e) => Err(e.into()),
            };
            trace.event(
                world2.now_ms(),
                &format!("i{i}"),
                format!("stopped: {result:?}"),
            );
        }));
        Instance {
            ctl,
            health,
            shutdown,
            host,
            task,
        }
    };

    // The timeline: inserts, instance starts and faults, in order of their instants.
    enum Step {
        Insert(Document, bool),
        Start(usize),
        Fault(FaultKind),
        Act(ActionKind),
        Heal,
    }
    let mut steps: Vec<(u64, u32, Step)> = Vec::new();
    for (at, doc, during_claim) in pending {
        steps.push((at, 0, Step::Insert(doc, during_claim)));
    }
    for (i, spec) in s.instances.iter().enumerate() {
        steps.push((spec.start_at_ms, 1, Step::Start(i)));
    }
    for f in &s.faults {
        steps.push((f.at_ms, 2, Step::Fault(f.kind.clone())));
    }
    for a in &s.actions {
        steps.push((a.at_ms, 2, Step::Act(a.kind.clone())));
    }
    steps.push((s.faults_end_ms, 3, Step::Heal));
    steps.sort_by_key(|(at, order, _)| (*at, *order));
    instances.resize_with(s.instances.len(), || None);

    let mut healed_at = None;
    for (at, _, step) in steps {
        let until = world.start + Duration::from_millis(at);
        tokio::time::sleep_until(until).await;
        if world.checker().violation.is_some() {
            break;
        }
        let now = world.now_ms();
        match step {
            Step::Insert(doc, true) => {
                let id = doc.get("_id").cloned().unwrap_or(Bson::Null);
                let landed = models::insert_during_next_claim(&world.mongo, &timeouts, doc);
                let (world, trace) = (world.clone(), trace.clone());
                tokio::spawn(async move {
                    if let Ok(server_ms) = landed.await {
                        world.checker().inserted(&id, server_ms);
                        let what = format!("insert {} beside a claim", super::invariants::key(&id));
                        trace.event(world.now_ms(), "sim", what);
                    }
                });
            }
            Step::Insert(doc, false) => {
                let id = doc.get("_id").cloned().unwrap_or(Bson::Null);
                models::insert(&world.mongo, &timeouts, doc);
                let server_ms = models::server_ms(&world.mongo);
                world.checker().inserted(&id, server_ms);
                trace.event(
                    now,
                    "sim",
                    format!("insert {}", super::invariants::key(&id)),
                );
            }
            Step::Start(i) => {
                let skew = s.instances.get(i).map_or(0, |x| x.skew_ms);
                trace.event(now, "sim", format!("start i{i} skew {skew}"));
                instances[i] = Some(start_instance(i, skew));
            }
            Step::Fault(kind) => {
                trace.event(now, "fault", format!("{kind:?}"));
                apply(&world, &instances, &kind);
            }
            Step::Act(kind) => operate(&world, &kind),
            Step::Heal => {
                trace.event(now, "sim", "faults stop");
                world.race.lock().unwrap_or_else(PoisonError::into_inner).on = false;
                healed_at = Some(now);
                models::heal(&world.mongo, &world.rabbit, &world.queues);
                // Every instance that was killed or stopped is replaced by a new one.
                let mut replaced = Vec::new();
                for (i, slot) in instances.iter().enumerate() {
                    let Some(inst) = slot else { continue };
                    let mut c = ctl_of(&inst.ctl);
                    let gone = c.killed || inst.shutdown.is_cancelled() || inst.task.is_finished();
                    let killed = c.killed;
                    *c = Ctl {
                        killed,
                        rabbit_epoch: c.rabbit_epoch,
                        ..Ctl::default()
                    };
                    if gone {
                        replaced.push(i);
                    }
                }
                for i in replaced {
                    let j = instances.len();
                    let skew = s.instances.get(i).map_or(0, |x| x.skew_ms);
                    trace.event(now, "sim", format!("start i{j} in place of i{i}"));
                    instances.push(Some(start_instance(j, skew)));
                }
            }
        }
    }
    // The liveness phase: every record done within the bound, or the first violation.
    let healed_at = healed_at.unwrap_or_else(|| world.now_ms());
    let healed_server_ms = models::server_ms(&world.mongo);
    let deadline = healed_at + s.liveness_bound_ms();
    let tick = Duration::from_millis(s.knobs.poll_ms.max(100));
    let window_ms = (timeoutd::service::progress::stall_after(&config)
        + 2 * timeoutd::maintenance::monitor::MONITOR_INTERVAL
        + config.dispatch.poll_interval)
        .as_millis() as i64;
    let check_readiness = s.knobs.max_rate.is_none() && s.knobs.destination_rates.is_empty();
    let mut next_readiness = 0;
    loop {
        if world.checker().violation.is_some() || world.now_ms() >= deadline {
            break;
        }
        let parked_docs = models::docs(&world.mongo, &parked);
        if world.checker().all_done(&parked_docs) {
            break;
        }
        if check_readiness && world.now_ms() >= next_readiness {
            next_readiness = world.now_ms() + 1_000;
            readiness(&world, &instances, healed_server_ms, window_ms);
        }
        tokio::time::sleep(tick).await;
    }
    // Stop the fleet (SIGTERM, each drains) and check the end.
    for inst in instances.iter().flatten() {
        inst.shutdown.cancel();
    }
    let drain = Duration::from_millis(s.knobs.shutdown_timeout_ms + 6_000);
    for inst in instances.iter_mut().flatten() {
        let _ = tokio::time::timeout(drain, &mut inst.task).await;
    }
    let at = world.now_ms();
    let parked_docs = models::docs(&world.mongo, &parked);
    let counted = counted_duplicates(&metrics.render());
    let deliveries: Vec<(String, usize)> = {
        let c = world.checker();
        models::deliveries(&world.rabbit)
            .into_iter()
            .filter_map(|(message_id, correlation, connection)| {
                let record = message_id
                    .and_then(|m| c.record_of(&m))
                    .or_else(|| correlation.and_then(|m| c.record_of(&m)))?;
                let instance = connection.rsplit_once("#i")?.1.parse().ok()?;
                Some((record, instance))
            })
            .collect()
    };
    {
        let mut c = world.checker();
        if c.violation.is_none() {
            c.finish(at, &parked_docs, counted, &deliveries);
        }
    }
    for inst in instances.iter().flatten() {
        inst.task.abort();
        let _ = &inst.host;
    }
    let c = world.checker();
    if let Some(v) = &c.violation {
        trace.event(v.at_ms, "BROKEN", format!("{}: {}", v.invariant, v.detail));
    }
    Outcome {
        violation: c.violation.clone(),
        trace_hash: trace.hash(),
        events: trace.events(),
        tail: trace.tail(60),
        all: trace.all(),
        virtual_ms: at,
        stats: c.stats.clone(),
    }
}

/// No live instance reports ready while a record it could claim is left unclaimed past the
/// progress window (checked once faults stopped).
fn readiness(world: &Arc<World>, instances: &[Option<Instance>], since_ms: i64, window_ms: i64) {
    let ready: Vec<usize> = instances
        .iter()
        .enumerate()
        .filter_map(|(i, x)| x.as_ref().map(|x| (i, x)))
        .filter(|(_, x)| {
            !ctl_of(&x.ctl).killed && !x.shutdown.is_cancelled() && !x.task.is_finished()
        })
        .filter(|(_, x)| x.health.readiness().ready)
        .map(|(i, _)| i)
        .collect();
    if ready.is_empty() {
        return;
    }
    let timeouts = models::docs(&world.mongo, &world.timeouts);
    let server_ms = models::server_ms(&world.mongo);
    let mut c = world.checker();
    if let Some(stuck) = c.left_unclaimed(&timeouts, server_ms, since_ms, window_ms) {
        let detail = format!("instance(s) {ready:?} report ready while {stuck}");
        c.broken(world.now_ms(), "ready-while-stuck", detail);
    }
}

/// The operator's action, as `timeoutd reschedule` and `timeoutd cancel` write it (a record
/// only while it is free, and only with the `Time` that was read), landing at once: the
/// checker learns the record's new due instant, or that it was cancelled, at the instant it
/// happens.
fn operate(world: &Arc<World>, kind: &ActionKind) {
    let (ActionKind::Reschedule { record, .. } | ActionKind::Cancel { record }) = kind;
    let Some((k, id)) = world.checker().record_by_spec(*record) else {
        return;
    };
    let later = match kind {
        ActionKind::Reschedule { by_ms, .. } => Some(*by_ms),
        ActionKind::Cancel { .. } => None,
    };
    apply_action(world, &k, &id, later);
}

/// Reschedules record `k` (`_id` `id`) by `later` ms, or cancels it when `later` is `None`.
fn apply_action(world: &World, k: &str, id: &Bson, later: Option<i64>) {
    use timeoutd::store::lease;
    let at = world.now_ms();
    let what = match later {
        Some(by) => format!("reschedule by {by} ms"),
        None => "cancel".to_string(),
    };
    let Some(doc) = models::doc(&world.mongo, &world.timeouts, id) else {
        world
            .trace
            .event(at, "op", format!("{what}: {k} is not there"));
        return;
    };
    let now = bson::DateTime::from_millis(models::server_ms(&world.mongo));
    let time = doc.get("Time").cloned().unwrap_or(Bson::Null);
    let free = lease::claimable(now);
    let (op, new_due) = match later {
        Some(by_ms) => {
            let Ok(rec) = timeoutd::record::TimeoutRecord::decode(&doc, world.decoding) else {
                return;
            };
            let due = rec.due.timestamp_millis().saturating_add(by_ms);
            let new_time = match time {
                Bson::DateTime(_) => Bson::DateTime(bson::DateTime::from_millis(due)),
                _ => timeoutd::record::encode_time(
                    bson::DateTime::from_millis(due),
                    TimeEncoding::DotnetTicks,
                ),
            };
            let filter = lease::all_of([doc! { "_id": id.clone(), "Time": time }, free]);
            let update = doc! { "$set": { "Time": new_time } };
            (
                Op::Update {
                    filter,
                    update,
                    many: false,
                    upsert: false,
                },
                Some(due),
            )
        }
        None => (
            Op::Delete {
                filter: lease::all_of([doc! { "_id": id.clone() }, free]),
                many: false,
            },
            None,
        ),
    };
    let done = match models::operate(&world.mongo, &world.timeouts, &op) {
        Ok(Reply::Written(w)) => w.modified + w.deleted > 0,
        _ => false,
    };
    world.trace.event(
        at,
        "op",
        format!(
            "{what}: {k} {}",
            if done { "done" } else { "left (leased)" }
        ),
    );
    if !done {
        return;
    }
    match new_due {
        Some(due) => {
            let fields = models::doc(&world.mongo, &world.timeouts, id)
                .map(|d| without_locks(&d))
                .unwrap_or_default();
            let at = world.now_ms();
            world.checker().rescheduled(at, k, due, fields);
        }
        None => world.checker().cancelled(k),
    }
}

/// Applies one fault.
fn apply(world: &Arc<World>, instances: &[Option<Instance>], kind: &FaultKind) {
    let now = Instant::now();
    let ms = Duration::from_millis;
    let inst = |i: &usize| instances.get(*i).and_then(Option::as_ref);
    match kind {
        FaultKind::Kill { instance } => {
            if let Some(x) = inst(instance) {
                ctl_of(&x.ctl).killed = true;
                x.task.abort();
                world.checker().killed(*instance);
            }
        }
        FaultKind::Sigterm { instance } => {
            if let Some(x) = inst(instance) {
                x.shutdown.cancel();
            }
        }
        FaultKind::Pause { instance, for_ms } => {
            if let Some(x) = inst(instance) {
                ctl_of(&x.ctl).paused_until = Some(now + ms(*for_ms));
                let at = world.now_ms();
                world.checker().paused(*instance, at, at + for_ms);
            }
        }
        FaultKind::ClockStep { instance, ms: step } => {
            if let Some(x) = inst(instance) {
                x.host.step_ms(*step);
            }
        }
        FaultKind::MongoSlow {
            instance,
            delay_ms,
            for_ms,
        } => {
            if let Some(x) = inst(instance) {
                ctl_of(&x.ctl).mongo_slow = Some((now + ms(*for_ms), ms(*delay_ms)));
            }
        }
        FaultKind::MongoCut { instance, for_ms } => {
            if let Some(x) = inst(instance) {
                ctl_of(&x.ctl).mongo_cut_until = Some(now + ms(*for_ms));
            }
        }
        FaultKind::RabbitCut { instance, for_ms } => {
            if let Some(x) = inst(instance) {
                let mut c = ctl_of(&x.ctl);
                c.rabbit_cut_until = Some(now + ms(*for_ms));
                c.rabbit_epoch += 1;
            }
        }
        FaultKind::RabbitWithhold { instance, for_ms } => {
            if let Some(x) = inst(instance) {
                ctl_of(&x.ctl).withhold_until = Some(now + ms(*for_ms));
            }
        }
        FaultKind::RabbitBlocked { instance, for_ms } => {
            if let Some(x) = inst(instance) {
                ctl_of(&x.ctl).blocked_until = Some(now + ms(*for_ms));
            }
        }
        FaultKind::MongoModel { name, arg, for_ms } => {
            if name == "clock_step" {
                let at = world.now_ms();
                world.checker().server_step(at, *arg);
            }
            models::mongo_fault(&world.mongo, name, *arg, *for_ms)
        }
        FaultKind::RabbitModel { name, arg, for_ms } => {
            models::rabbit_fault(&world.rabbit, &world.queues, name, *arg, *for_ms)
        }
    }
}

/// The fleet's count of possible duplicates: `timeoutd_possible_duplicates_total`, summed over
/// its causes (the counters are the fleet's: every instance records into the run's one
/// recorder). Not `timeoutd_lease_lost_total`: a confirmed record whose lease was lost is
/// counted in both, and a refused send's lost lease delivered nothing (summing both let an
/// uncounted duplicate hide behind the double count: helper-28).
pub fn counted_duplicates(rendered: &str) -> f64 {
    rendered
        .lines()
        .filter(|l| l.split(['{', ' ']).next() == Some("timeoutd_possible_duplicates_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |sum, n| sum + n)
}

/// One `hello` of an instance, told to the checker when it ends: answered or not, or given
/// up on (dropped before its answer: a failure).
struct Hello {
    world: Arc<World>,
    instance: usize,
    sent: u64,
    ok: Option<bool>,
}

impl Drop for Hello {
    fn drop(&mut self) {
        let ok = self.ok.unwrap_or(false);
        let ended = self.world.now_ms();
        self.world
            .checker()
            .hello(self.instance, (self.sent, ended), ok);
    }
}
