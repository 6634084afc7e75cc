//! The invariants, checked on every step: after each call a model answered, at each publish
//! the broker model received and at each confirm, from what the wires between the instances
//! and the models saw and from the models' own state (their documents and the server clock).
//!
//! What is checked (the first broken one ends the run):
//! - `left-unsent`: a record leaves `Timeouts` only after a confirmed, routed publish of it, or
//!   into the parked collection (whose copy then stays), or by the operator's cancel;
//! - `not-done`: once faults stop, every ordinary record is delivered or parked, every
//!   unroutable one parked, within [`crate::sim::swarm::Scenario::liveness_bound_ms`] (hostile
//!   ones may also stay, unschedulable);
//! - `stolen-lease`: no instance's publish reaches the broker while the record is leased, live
//!   by the server clock, to an owner another instance took;
//!   (a publish by an instance paused within the last lease is counted, not failed: a pause
//!   between the lease check and the write lets any lease run out, and no client can tell);
//! - `misrouted`: an ordinary record's message goes to its own `Destination` and carries its
//!   own `ProcessManagerId` as `CorrelationId` (known from the scenario);
//! - `early`: nothing reaches the broker before its due instant by the server clock, less
//!   any step back of the server clock since the instance last asked for a reading (a step
//!   it cannot see: `stolen-lease` allows the same); a record the operator rescheduled while
//!   the instance was paused is counted, not failed (its lease ran out in the pause);
//! - `wrong-park`: a record is parked only for a reason it was generated for (`unroutable`
//!   for a queue nothing is bound to, `unsendable` for headers past a node's frame, `nacked`
//!   for any; hostile ones for any reason);
//! - `frame-too-large`: no instance sends a content header frame past its connection's
//!   `frame_max` (the broker would close the connection and lose every confirm on it);
//! - `foreign-write`: timeoutd writes no field of a record but `Locked`, `LockedBy`,
//!   `LockExpiresAt` (each write on `Timeouts` is checked, and each document's other fields
//!   against what was inserted);
//! - `ready-while-stuck` (once faults stopped, without send-rate limits): no live instance
//!   reports ready while a record it could claim has been claimable, unleased, for longer
//!   than its progress window (`stall_after`) plus two monitor intervals and a poll;
//! - `orphaned-lease`: a take (the compare-and-swap that leases records to a fresh owner)
//!   whose answer the instance did not see succeed (dropped by a deadline or shutdown, or
//!   failed) and that leased records is followed by the instance asking to free that owner's
//!   records, after the take landed on the server if it landed while its lease held, unless
//!   the instance was killed (a dropped take must not leave records leased for a lease; one
//!   that lands after the release sent at once leases what that release could not free);
//! - `hold-off`: a record whose publish the instance saw no answer to (its confirm was lost
//!   with the link, or given up at the wave's deadline) is not published again by that
//!   instance sooner than the back-off after unconfirmed waves allows: 100 ms doubling to
//!   10 s for each such publish of it since the instance last saw any answer (a link that
//!   withholds confirms must not get the same records again at once, nor ever faster);
//! - `late`: a record due in the calm after the faults (drawn for it) reaches the broker no
//!   later after its due instant, by the server clock, than its configuration allows: the
//!   poll interval less the look-ahead, and a slack for the calls
//!   ([`crate::sim::swarm::Scenario::on_time_ms`]). So a lost insert wake-up, a claim that is
//!   not scheduled when due, or a held record not sent at its instant is found;
//! - `uncounted-duplicate`: every routed delivery after a record's first is counted by the
//!   fleet's lease-lost or duplicate series, except those after a delivery by an instance that
//!   was killed (read through the run's own metrics recorder at the end).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use bson::{Bson, Document};
use timeoutd::store::backend::{Op, Reply};

/// The lock fields, the only ones timeoutd may write on a record.
pub const LOCK_FIELDS: [&str; 3] = ["Locked", "LockedBy", "LockExpiresAt"];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub at_ms: u64,
    pub invariant: &'static str,
    pub detail: String,
}

/// A record's publishes whose answer an instance did not see (see the `hold-off` invariant).
#[derive(Debug, Clone, Copy)]
struct Unanswered {
    /// The instance's `answers_seen` when these began.
    answers_seen: u64,
    count: u32,
    at_ms: u64,
}

/// The least back-off after `count` unconfirmed waves in a row: `host::Backoff::reconnect`'s
/// schedule without its jitter, which only adds.
fn least_hold_off_ms(count: u32) -> u64 {
    100u64
        .saturating_mul(1u64 << count.saturating_sub(1).min(20))
        .min(10_000)
}

/// What kind of end a record must reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Delivered, or parked.
    DeliveredOrParked,
    /// Parked (no queue is bound to it).
    Parked,
    /// Anything (hostile: it may be unschedulable and stay).
    Any,
}

#[derive(Debug, Clone)]
pub struct RecordInfo {
    /// `_id` as stored.
    pub id: Bson,
    /// The message key a publish of it carries: its `MessageId` (stable ids) or its
    /// `CorrelationId` (random ids); `None` when it cannot be published.
    pub message_key: Option<String>,
    /// Due instant, Unix ms on the server's clock (`None`: no due instant decodes).
    pub due_ms: Option<i64>,
    pub expect: Expect,
    /// The document as inserted, without its lock fields (compared as a document first, then
    /// as BSON bytes, where a NaN equals itself).
    pub fields: Document,
    pub inserted: bool,
    /// Its index in the scenario's records (the operator's actions name it so).
    pub spec: usize,
    /// The reasons it may be parked for (`None`: any, a hostile record).
    pub park_reasons: Option<Vec<&'static str>>,
    /// Due in the calm: how late its first publish may reach the broker (`late`), after its
    /// due instant or its insert, whichever is later by the server's clock.
    pub on_time_ms: Option<i64>,
    /// The server's clock when it was inserted.
    pub inserted_server_ms: i64,
    /// For an ordinary record: the queue its message goes to (its `Destination`) and the
    /// `CorrelationId` it carries (its `ProcessManagerId` as .NET prints it), known from the
    /// scenario, not from timeoutd's decoder.
    pub sent_as: Option<(String, String)>,
}

/// `doc` without the named fields (for shorter messages).
pub fn without_fields(doc: &Document, names: &[&str]) -> Document {
    let mut d = doc.clone();
    for n in names {
        d.remove(*n);
    }
    d
}

/// The key of an `_id` in maps.
pub fn key(id: &Bson) -> String {
    match id {
        Bson::Binary(b) if b.bytes.len() == 16 => {
            let hex: String = b.bytes.iter().map(|x| format!("{x:02x}")).collect();
            format!("{}:{hex}", u8::from(b.subtype))
        }
        Bson::String(s) => format!("{s:?}"),
        other => format!("{other}"),
    }
}

/// A document's BSON bytes.
pub fn bytes(doc: &Document) -> Vec<u8> {
    bson::to_vec(doc).unwrap_or_default()
}

/// A document without its lock fields.
pub fn without_locks(doc: &Document) -> Document {
    let mut d = doc.clone();
    for f in LOCK_FIELDS {
        d.remove(f);
    }
    d
}

/// The most virtual time between one `hello` of a clock reading answering and the next being
/// sent (none passes: the reading sends it at once).
const HELLO_GAP_MS: u64 = 10;

/// How near its end (server clock) a lease may be when an instance stops waiting for the take
/// that set it and still count as over: the server's clock drifts from the virtual one.
const LEASE_OVER_SLACK_MS: i64 = 200;

#[derive(Debug, Default)]
pub struct Checker {
    records: HashMap<String, RecordInfo>,
    by_message: HashMap<String, String>,
    /// Owners each instance's claims wrote, by owner.
    owners: HashMap<String, usize>,
    /// Records in `Timeouts` at the last look.
    present: BTreeSet<String>,
    /// Routed, confirmed deliveries of each record, by instance, in order.
    delivered: HashMap<String, Vec<usize>>,
    killed: BTreeSet<usize>,
    /// Pauses of each instance: (from, until) in virtual ms.
    pauses: HashMap<usize, Vec<(u64, u64)>>,
    /// `[dispatch] lock_lease` in ms.
    pub lease_ms: u64,
    /// Steps of the server clock: (virtual ms, the step in ms).
    server_steps: Vec<(u64, i64)>,
    /// When each instance sent the `hello` of its latest reading of the server clock
    /// (virtual ms).
    clock_read: HashMap<usize, u64>,
    /// Each instance's answered `hello`s since its last reading (their sending instants).
    hellos: HashMap<usize, Vec<u64>>,
    /// When each instance's last `hello` answered or failed (virtual ms).
    hello_ended: HashMap<usize, u64>,
    /// Takes (a compare-and-swap that leased records to a fresh owner) whose answer the
    /// instance did not see succeed (the call was dropped, or failed): (instance, owner,
    /// virtual ms, server ms).
    unseen_takes: Vec<(usize, String, u64, i64)>,
    /// Records each take's write leased, by owner (from the server's answer).
    leased_by: HashMap<String, u64>,
    /// (instance, owner) pairs of every release an instance asked for (whether or not it
    /// reached the server), with when it last asked (virtual ms).
    releases: BTreeMap<(usize, String), u64>,
    /// When each take that leased records landed on the server (virtual ms), and when its
    /// lease ends (server ms), by owner, for takes whose lease was still live then.
    landed: HashMap<String, (u64, i64)>,
    /// Parked records whose reason was checked.
    park_checked: BTreeSet<String>,
    /// Records seen parked and gone from Timeouts.
    parked_seen: BTreeSet<String>,
    /// Records locked at the last look, and when (server clock) each was last seen freed.
    locked: BTreeSet<String>,
    freed_at: HashMap<String, i64>,
    /// Publishes whose answer the instance did not see, by (instance, record): how many
    /// since the instance last saw any answer, and when it gave up on the latest.
    unanswered: HashMap<(usize, String), Unanswered>,
    /// Records published at least once.
    first_published: BTreeSet<String>,
    /// When the operator last rescheduled each record (virtual ms).
    rescheduled_at: HashMap<String, u64>,
    /// How many answers each instance has seen (an entry of `unanswered` counts only while
    /// this is what it was).
    answers_seen: HashMap<usize, u64>,
    pub violation: Option<Violation>,
    /// Invariants whose violations are counted (in `stats`) instead of ending the run: a
    /// known open defect, so that a run can look past it (`--allow NAME`).
    pub allowed: BTreeSet<String>,
    pub timeouts: String,
    pub parked: String,
    /// Counts for the report.
    pub stats: BTreeMap<&'static str, u64>,
}

impl Checker {
    pub fn new(timeouts: &str, parked: &str) -> Self {
        Self {
            timeouts: timeouts.into(),
            parked: parked.into(),
            ..Self::default()
        }
    }

    fn fail(&mut self, at_ms: u64, invariant: &'static str, detail: String) {
        if self.allowed.contains(invariant) {
            self.bump(invariant);
            return;
        }
        if self.violation.is_none() {
            self.violation = Some(Violation {
                at_ms,
                invariant,
                detail,
            });
        }
    }

    /// One violation naming every item found (none: no violation).
    fn fail_all(&mut self, at_ms: u64, invariant: &'static str, what: &str, items: &[String]) {
        if !items.is_empty() {
            let d = format!("{} {what}: {}", items.len(), items.join("; "));
            self.fail(at_ms, invariant, d);
        }
    }

    fn bump(&mut self, what: &'static str) {
        *self.stats.entry(what).or_default() += 1;
    }

    pub fn add_record(&mut self, info: RecordInfo) {
        let k = key(&info.id);
        if let Some(m) = &info.message_key {
            self.by_message.insert(m.clone(), k.clone());
        }
        self.records.insert(k, info);
    }

    /// `id` was inserted when the server's clock read `server_ms`.
    pub fn inserted(&mut self, id: &Bson, server_ms: i64) {
        let k = key(id);
        if let Some(r) = self.records.get_mut(&k) {
            r.inserted = true;
            r.inserted_server_ms = server_ms;
        }
        self.present.insert(k);
    }

    /// `instance` is paused from `from_ms` to `until_ms` (virtual).
    pub fn paused(&mut self, instance: usize, from_ms: u64, until_ms: u64) {
        self.pauses
            .entry(instance)
            .or_default()
            .push((from_ms, until_ms));
    }

    /// Whether `instance` was paused within the last lease before `at_ms`: a pause between
    /// the lease check and the write (a SIGSTOP, a long GC) lets any lease run out, and no
    /// client can tell; its publishes then are counted, not failed.
    fn paused_lately(&self, instance: usize, at_ms: u64) -> bool {
        self.pauses.get(&instance).is_some_and(|p| {
            p.iter()
                .any(|(from, until)| *from <= at_ms && *until + self.lease_ms >= at_ms)
        })
    }

    /// Whether the operator rescheduled `record` while `instance` was paused, in a pause that
    /// ended within a lease of `at_ms`: its pre-publish check (due, lease live) may have come
    /// before the pause, the lease run out in it and the reschedule found the record free
    /// (seed 6661). Like `stolen-lease` after a pause, no client can tell.
    fn rescheduled_while_paused(&self, instance: usize, record: &str, at_ms: u64) -> bool {
        let Some(&r_at) = self.rescheduled_at.get(record) else {
            return false;
        };
        self.pauses.get(&instance).is_some_and(|p| {
            p.iter().any(|(from, until)| {
                *from <= r_at && r_at <= at_ms && *until + self.lease_ms >= at_ms
            })
        })
    }

    /// The server clock stepped by `ms` at `at_ms`.
    pub fn server_step(&mut self, at_ms: u64, ms: i64) {
        self.server_steps.push((at_ms, ms));
    }

    /// A `hello` of `instance`, sent at `sent_ms`, answered (`ok`) or not (failed, or given
    /// up on). The daemon reads the server clock with up to three in a row, keeps the best
    /// of those that answered, and stops at the first that does not: so a reading is counted
    /// once three in a row answered, or at a failure after one answered, as asked for when
    /// the first of them was sent (the earliest its sample can be from).
    pub fn hello(&mut self, instance: usize, (sent_ms, ended_ms): (u64, u64), ok: bool) {
        let previous = self.hello_ended.insert(instance, ended_ms);
        let streak = self.hellos.entry(instance).or_default();
        // A reading sends each `hello` as the one before answers: answered `hello`s not
        // followed at once by another were no reading (start-up's deployment check asks one),
        // and must not make the next reading look older than it is (seed 3456's shrunk
        // scenario: a lone `hello` after a server clock step back, then a reading 17 s later
        // counted from it, so the step looked seen by a publish before that reading ended).
        if previous.is_some_and(|ended| sent_ms > ended + HELLO_GAP_MS) {
            streak.clear();
        }
        if ok {
            streak.push(sent_ms);
        }
        if ok && streak.len() < 3 {
            return;
        }
        let Some(first) = streak.first().copied() else {
            return;
        };
        streak.clear();
        let latest = self.clock_read.entry(instance).or_default();
        *latest = (*latest).max(first);
    }

    /// How far the server clock stepped back since `instance`'s latest reading was asked
    /// for: a step no client can see until it reads the clock again. Up to that much, an
    /// instance that decides by its last reading is early (or takes a lease that has some time
    /// left) by the server clock through no fault of its own; with readings every few seconds
    /// (the monitor's), that is all an NTP step back on the database's host can cost.
    fn unseen_step_back(&self, instance: usize) -> i64 {
        let since = self.clock_read.get(&instance).copied().unwrap_or(0);
        self.server_steps
            .iter()
            .filter(|(at, step)| *at >= since && *step < 0)
            .map(|(_, step)| -step)
            .sum()
    }

    /// The key and `_id` of the record made from the scenario's record `spec`.
    pub fn record_by_spec(&self, spec: usize) -> Option<(String, Bson)> {
        self.records
            .iter()
            .find(|(_, info)| info.spec == spec)
            .map(|(k, info)| (k.clone(), info.id.clone()))
    }

    /// The operator moved `record`'s `Time` (`timeoutd reschedule`): from now on it is due at
    /// `due_ms` and stored with `fields`.
    pub fn rescheduled(&mut self, at_ms: u64, record: &str, due_ms: i64, fields: Document) {
        self.bump("rescheduled");
        self.rescheduled_at.insert(record.to_string(), at_ms);
        if let Some(info) = self.records.get_mut(record) {
            info.due_ms = Some(due_ms);
            info.fields = fields;
        }
    }

    /// The operator deleted `record` (`timeoutd cancel`): it leaves `Timeouts` unsent, and
    /// has no end to reach.
    pub fn cancelled(&mut self, record: &str) {
        self.bump("cancelled");
        if let Some(info) = self.records.get_mut(record) {
            info.expect = Expect::Any;
        }
        self.present.remove(record);
    }

    /// `instance` did not see its take under `owner` succeed: it dropped the call or got an
    /// error. Whatever the server did, the instance must free what the take may have leased.
    pub fn take_unseen(&mut self, instance: usize, owner: String, (at_ms, server_ms): (u64, i64)) {
        self.bump("takes-unseen");
        self.unseen_takes.push((instance, owner, at_ms, server_ms));
    }

    /// `instance` asks for `op` on `Timeouts` at `at_ms` (before any fault decides its fate): a
    /// write that frees records (`Locked: false`) names the owners it frees in its filter.
    pub fn asked(&mut self, at_ms: u64, instance: usize, op: &Op) {
        let (Op::Update { filter, update, .. } | Op::FindOneAndUpdate { filter, update, .. }) = op
        else {
            return;
        };
        let frees = update
            .get_document("$set")
            .is_ok_and(|set| set.get("Locked") == Some(&Bson::Boolean(false)));
        if !frees {
            return;
        }
        let mut owners = Vec::new();
        binaries(&Bson::Document(filter.clone()), &mut owners);
        for owner in owners {
            self.releases.insert((instance, owner), at_ms);
        }
    }

    /// `instance` saw the broker's answer to one of its publishes (an ack, a nack or a
    /// return): the back-off after unconfirmed waves may start again from its base.
    pub fn answer_seen(&mut self, instance: usize) {
        *self.answers_seen.entry(instance).or_default() += 1;
    }

    /// `instance` gave up on its publish of `record` without an answer (the link was lost, or
    /// the wave's deadline passed).
    pub fn answer_unseen(&mut self, instance: usize, record: &str, at_ms: u64) {
        self.bump("publishes-unanswered");
        let seen = self.answers_seen.get(&instance).copied().unwrap_or(0);
        let e = self
            .unanswered
            .entry((instance, record.to_string()))
            .or_insert(Unanswered {
                answers_seen: seen,
                count: 0,
                at_ms,
            });
        if e.answers_seen != seen {
            e.answers_seen = seen;
            e.count = 0;
        }
        e.count += 1;
        e.at_ms = at_ms;
    }

    pub fn killed(&mut self, instance: usize) {
        self.killed.insert(instance);
    }

    /// A call from `instance` to MongoDB and its answer.
    pub fn call(
        &mut self,
        (at_ms, server_ms): (u64, i64),
        instance: usize,
        collection: &str,
        op: &Op,
        reply: &Reply,
    ) {
        if collection != self.timeouts {
            return;
        }
        let update = match op {
            Op::Update { update, .. } => Some(update),
            Op::FindOneAndUpdate { update, .. } => Some(update),
            Op::Replace { .. } => {
                self.fail(
                    at_ms,
                    "foreign-write",
                    format!("instance {instance} replaced a whole record: {op:?}"),
                );
                None
            }
            Op::Insert { .. } => {
                self.fail(
                    at_ms,
                    "foreign-write",
                    format!("instance {instance} inserted into Timeouts: {op:?}"),
                );
                None
            }
            _ => None,
        };
        let Some(update) = update else { return };
        for (operator, fields) in update {
            let Some(fields) = fields.as_document() else {
                self.fail(
                    at_ms,
                    "foreign-write",
                    format!("instance {instance}: update operator {operator} with {fields}"),
                );
                continue;
            };
            for (name, value) in fields {
                if !LOCK_FIELDS.contains(&name.as_str()) {
                    self.fail(
                        at_ms,
                        "foreign-write",
                        format!("instance {instance} writes {operator} {name} on a record"),
                    );
                }
                if operator == "$set"
                    && name == "LockedBy"
                    && let Some(owner) = uuid_text(value)
                {
                    if let Reply::Written(w) = reply {
                        *self.leased_by.entry(owner.clone()).or_default() += w.modified;
                        let ends = fields
                            .get_datetime("LockExpiresAt")
                            .map(|e| e.timestamp_millis());
                        if let Ok(ends) = ends
                            && w.modified > 0
                            && ends > server_ms
                        {
                            self.landed.insert(owner.clone(), (at_ms, ends));
                        }
                    }
                    self.owners.entry(owner).or_insert(instance);
                }
            }
        }
    }

    /// The stored `_id` of a record.
    pub fn id_of(&self, record: &str) -> Option<Bson> {
        self.records.get(record).map(|r| r.id.clone())
    }

    /// The record a message is of.
    pub fn record_of(&self, message_key: &str) -> Option<String> {
        self.by_message.get(message_key).cloned()
    }

    /// A publish from `instance` reached the broker, with the record's document as the
    /// database holds it now and the server's clock.
    /// A publish of `record` went to `routing_key` carrying `correlation_id`: another
    /// record's queue or saga would confirm, the record be removed, and its own saga never
    /// woken, with nothing else to show it (helper-28).
    pub fn sent_as(
        &mut self,
        at_ms: u64,
        instance: usize,
        record: &str,
        routing_key: &str,
        correlation_id: Option<&str>,
    ) {
        let Some((destination, correlation)) =
            self.records.get(record).and_then(|r| r.sent_as.clone())
        else {
            return;
        };
        self.bump("routes-checked");
        if routing_key != destination || correlation_id != Some(correlation.as_str()) {
            let d = format!(
                "instance {instance} published {record} to {routing_key:?} with CorrelationId {correlation_id:?}; it is for {destination:?}, saga {correlation}"
            );
            self.fail(at_ms, "misrouted", d);
        }
    }

    pub fn published(
        &mut self,
        at_ms: u64,
        instance: usize,
        record: &str,
        doc: Option<&Document>,
        server_ms: i64,
    ) {
        self.bump("publishes");
        let unseen = self.unseen_step_back(instance);
        if unseen > 0 {
            self.bump("publishes-after-unseen-step-back");
        }
        let seen = self.answers_seen.get(&instance).copied().unwrap_or(0);
        if let Some(u) = self
            .unanswered
            .get(&(instance, record.to_string()))
            .copied()
            && u.answers_seen == seen
            && at_ms < u.at_ms + least_hold_off_ms(u.count)
        {
            let d = format!(
                "instance {instance} published {record} again {} ms after giving up on its publish without an answer ({} in a row); the back-off allows no sooner than {} ms",
                at_ms - u.at_ms,
                u.count,
                least_hold_off_ms(u.count)
            );
            self.fail(at_ms, "hold-off", d);
        }
        let Some(info) = self.records.get(record) else {
            return;
        };
        let first = self.first_published.insert(record.to_string());
        if let (Some(due), Some(allowed), true) = (info.due_ms, info.on_time_ms, first) {
            // A server clock stepped ahead by a fault may make a record overdue at its insert.
            let inserted = info.inserted_server_ms;
            let from = due.max(inserted);
            self.bump("on-time-checked");
            if server_ms - from > allowed {
                let d = format!(
                    "instance {instance} published {record} at server time {server_ms}, {} ms after its due instant {due} (inserted at {inserted}), in the calm; its configuration allows {allowed} ms",
                    server_ms - from
                );
                self.fail(at_ms, "late", d);
            }
        }
        let Some(info) = self.records.get(record) else {
            return;
        };
        if let Some(due) = info.due_ms
            && server_ms + unseen < due
        {
            if self.rescheduled_while_paused(instance, record, at_ms) {
                self.bump("early-after-pause-and-reschedule");
                return;
            }
            let d = format!(
                "instance {instance} published {record} at server time {server_ms}, {} ms before its due instant {due}",
                due - server_ms
            );
            self.fail(at_ms, "early", d);
        }
        let Some(doc) = doc else { return };
        let owner = doc.get("LockedBy").and_then(uuid_text);
        let expires = doc
            .get("LockExpiresAt")
            .and_then(Bson::as_datetime)
            .map(|d| d.timestamp_millis());
        if let (Some(owner), Some(expires)) = (owner, expires)
            && expires > server_ms + unseen
            && let Some(&holder) = self.owners.get(&owner)
            && holder != instance
        {
            if self.paused_lately(instance, at_ms) {
                self.bump("stolen-lease-after-pause");
                return;
            }
            let d = format!(
                "instance {instance} published {record} while instance {holder}'s lease (owner {owner}) is live for {} ms more by the server clock",
                expires - server_ms
            );
            self.fail(at_ms, "stolen-lease", d);
        }
    }

    /// A publish of `record` by `instance` was confirmed and routed to a queue.
    pub fn delivered(&mut self, instance: usize, record: &str) {
        self.bump("deliveries");
        self.delivered
            .entry(record.to_string())
            .or_default()
            .push(instance);
    }

    /// After a call answered: the records in `Timeouts` and in the parked collection now.
    pub fn look(&mut self, at_ms: u64, server_ms: i64, timeouts: &[Document], parked: &[Document]) {
        let mut now = BTreeSet::new();
        for doc in timeouts {
            let Some(id) = doc.get("_id") else { continue };
            let k = key(id);
            // When a lease ends by a write (a release, the reaper), the record no longer
            // says when it was leased: remember when it became free.
            let locked = doc.get("Locked") == Some(&Bson::Boolean(true));
            if locked {
                self.locked.insert(k.clone());
            } else if self.locked.remove(&k) {
                self.freed_at.insert(k.clone(), server_ms);
            }
            if let Some(info) = self.records.get(&k) {
                let fields = without_locks(doc);
                if fields != info.fields && bytes(&fields) != bytes(&info.fields) {
                    let d = format!(
                        "record {k} changed outside its lock fields: {}",
                        super::trace::short(&fields, 300)
                    );
                    self.fail(at_ms, "foreign-write", d);
                }
            }
            now.insert(k);
        }
        for doc in parked {
            let Some(id) = doc.get("_id") else { continue };
            let k = key(id);
            if !self.park_checked.insert(k.clone()) {
                continue;
            }
            let reason = doc.get_str("reason").unwrap_or("");
            if let Some(info) = self.records.get(&k)
                && let Some(allowed) = &info.park_reasons
                && !allowed.contains(&reason)
            {
                let d = format!(
                    "record {k} parked for {reason:?}, which it was not generated for (may be: {allowed:?}): {}",
                    super::trace::short(&doc.get_str("error").unwrap_or(""), 200)
                );
                self.fail(at_ms, "wrong-park", d);
            }
        }
        let parked: BTreeSet<String> = parked
            .iter()
            .filter_map(|d| d.get("_id").map(key))
            .collect();
        // A parked copy of a record gone from Timeouts is its only copy: it must stay (the
        // simulation runs no `parked requeue` or `parked drop`).
        let vanished: Vec<String> = self
            .parked_seen
            .iter()
            .filter(|k| !parked.contains(*k) && !now.contains(*k))
            .filter(|k| self.delivered.get(*k).is_none_or(|v| v.is_empty()))
            .cloned()
            .collect();
        for k in vanished {
            self.parked_seen.remove(&k);
            let d = format!(
                "record {k} is in neither Timeouts nor the parked collection, and was never delivered"
            );
            self.fail(at_ms, "left-unsent", d);
        }
        for k in &parked {
            if !now.contains(k) {
                self.parked_seen.insert(k.clone());
            }
        }
        let gone: Vec<String> = self.present.difference(&now).cloned().collect();
        for k in gone {
            let delivered = self.delivered.get(&k).is_some_and(|v| !v.is_empty());
            if !delivered && !parked.contains(&k) {
                let d = format!(
                    "record {k} left Timeouts with no confirmed, routed publish and no parked copy"
                );
                self.fail(at_ms, "left-unsent", d);
            }
        }
        self.present = now;
    }

    /// A record that should be sent and that nobody holds (no live lease by the server clock)
    /// although it has been claimable for longer than `window_ms` (counted from its due
    /// instant, its last lease's expiry, when a write last freed it and `since_ms`, all on the
    /// server clock).
    pub fn left_unclaimed(
        &self,
        timeouts: &[Document],
        server_ms: i64,
        since_ms: i64,
        window_ms: i64,
    ) -> Option<String> {
        for doc in timeouts {
            let Some(id) = doc.get("_id") else { continue };
            let k = key(id);
            let Some(info) = self.records.get(&k) else {
                continue;
            };
            if info.expect != Expect::DeliveredOrParked {
                continue;
            }
            let Some(due) = info.due_ms else { continue };
            let expires = doc
                .get("LockExpiresAt")
                .and_then(Bson::as_datetime)
                .map_or(i64::MIN, |d| d.timestamp_millis());
            let freed = self.freed_at.get(&k).copied().unwrap_or(i64::MIN);
            let claimable_since = due.max(expires).max(since_ms).max(freed);
            if server_ms - claimable_since > window_ms {
                return Some(format!(
                    "record {k} due at {due} claimable for {} ms (lease expired at {expires}; {})",
                    server_ms - claimable_since,
                    super::trace::short(
                        &without_fields(doc, &["Headers", "ProcessManagerId", "_id"]),
                        300
                    )
                ));
            }
        }
        None
    }

    /// Records a violation found outside the checker (readiness).
    pub fn broken(&mut self, at_ms: u64, invariant: &'static str, detail: String) {
        self.fail(at_ms, invariant, detail);
    }

    /// Whether every inserted record with an end to reach has reached it.
    pub fn all_done(&self, parked: &[Document]) -> bool {
        let parked: BTreeSet<String> = parked
            .iter()
            .filter_map(|d| d.get("_id").map(key))
            .collect();
        self.records.iter().all(|(k, info)| {
            let present = self.present.contains(k);
            match info.expect {
                Expect::Any => true,
                _ if !info.inserted => false,
                Expect::DeliveredOrParked => {
                    !present && (parked.contains(k) || self.delivered.contains_key(k))
                }
                Expect::Parked => !present && parked.contains(k),
            }
        })
    }

    /// At the end of the liveness phase: every record reached its end.
    /// `deliveries`: every message the broker routed, as (record, instance), in order.
    pub fn finish(
        &mut self,
        at_ms: u64,
        parked: &[Document],
        counted_duplicates: f64,
        deliveries: &[(String, usize)],
    ) {
        let parked: BTreeSet<String> = parked
            .iter()
            .filter_map(|d| d.get("_id").map(key))
            .collect();
        let mut records: Vec<(&String, &RecordInfo)> = self.records.iter().collect();
        records.sort_by(|a, b| a.0.cmp(b.0));
        let mut failures = Vec::new();
        for (k, info) in records {
            if !info.inserted {
                continue;
            }
            let present = self.present.contains(k);
            let delivered = self.delivered.get(k).is_some_and(|v| !v.is_empty());
            let is_parked = parked.contains(k);
            let ok = match info.expect {
                Expect::Any => true,
                Expect::DeliveredOrParked => !present && (delivered || is_parked),
                Expect::Parked => !present && is_parked,
            };
            if !ok {
                failures.push(format!(
                    "{k} ({:?}, due {:?}): present {present}, delivered {delivered}, parked {is_parked}",
                    info.expect, info.due_ms
                ));
            }
        }
        self.fail_all(at_ms, "not-done", "record(s) not done", &failures);
        // Orphaned leases: a take the instance did not see succeed, which leased records, and
        // which the instance never asked to free after it landed, while its lease held (a
        // second before the end at the latest, so that a release started by the shutdown's
        // last drop has had its turn). A release asked before the take landed matched
        // nothing of what it leased.
        let orphaned: Vec<String> = self
            .unseen_takes
            .iter()
            .filter(|(instance, owner, at, server_at)| {
                let released = self.releases.get(&(*instance, owner.clone()));
                let unfreed = match self.landed.get(owner) {
                    // Landed while the instance still waited, or before, with time left on
                    // its lease: a release must follow the landing.
                    Some((landed, ends)) if *ends > server_at + LEASE_OVER_SLACK_MS => {
                        released.is_none_or(|asked| asked < landed)
                    }
                    // Its lease was over when the instance stopped waiting for it.
                    Some(_) => false,
                    None => released.is_none(),
                };
                !self.killed.contains(instance)
                    && *at + 1_000 <= at_ms
                    && self.leased_by.get(owner).is_some_and(|n| *n > 0)
                    && unfreed
            })
            .map(|(instance, owner, at, _)| {
                format!("instance {instance}, owner {owner}, at {at} ms")
            })
            .collect();
        self.fail_all(
            at_ms,
            "orphaned-lease",
            "take(s) whose answer the instance did not see succeed leased records it never freed",
            &orphaned,
        );
        // Duplicates: deliveries after the first, except after a killed instance's delivery.
        let mut uncounted = 0u64;
        let mut total = 0u64;
        let mut routed: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (record, instance) in deliveries {
            routed.entry(record.as_str()).or_default().push(*instance);
        }
        for by in routed.values() {
            for (i, _) in by.iter().enumerate().skip(1) {
                total += 1;
                let excused = by[..i].iter().any(|p| self.killed.contains(p));
                if !excused {
                    uncounted += 1;
                }
            }
        }
        self.stats.insert("duplicates", total);
        self.stats
            .insert("counted-duplicates", counted_duplicates as u64);
        if (uncounted as f64) > counted_duplicates {
            let d = format!(
                "{uncounted} duplicate deliveries not after a killed instance's, {counted_duplicates} counted"
            );
            self.fail(at_ms, "uncounted-duplicate", d);
        }
    }
}

/// A GUID stored as Binary subtype 3 or 4, as text (byte order as stored: only compared).
/// Every 16-byte binary in `value` (owners in a filter, in either GUID form), as
/// [`uuid_text`] writes it.
fn binaries(value: &Bson, out: &mut Vec<String>) {
    match value {
        Bson::Document(d) => d.values().for_each(|v| binaries(v, out)),
        Bson::Array(a) => a.iter().for_each(|v| binaries(v, out)),
        v => out.extend(uuid_text(v).filter(|_| matches!(v, Bson::Binary(_)))),
    }
}

pub fn uuid_text(value: &Bson) -> Option<String> {
    match value {
        Bson::Binary(b) if b.bytes.len() == 16 => {
            Some(b.bytes.iter().map(|x| format!("{x:02x}")).collect())
        }
        Bson::String(s) => Some(s.clone()),
        _ => None,
    }
}
