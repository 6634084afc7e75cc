//! The claim: steps 1 to 6 of the lease protocol. Reads the due records of each `Time` shape
//! present (one index range each, see [`crate::record::due`]), merges them by true instant, takes
//! them with the compare-and-swap `updateMany`, and reads back what a racing instance left.
//!
//! The read-back (step 5) is skipped when it would tell nothing: every candidate was due when
//! read, the take restricted itself to records due at its own instant, and it took them all.
//! Those records are then the documents read, under this lease, and all are sent at once. The
//! benchmark's drain of 50,000 records on SecantusDB went from 0.51x to 0.58x of the database
//! write floor measured in the same run without it (the server's one core is the limit there,
//! and the read-back was a second read of every record).
//!
//! Long, as one concept: the claim's steps, read, take and read back, in the order they run, with
//! the state only the claim path keeps (about 420 lines of code, the rest its tests).

use std::future::IntoFuture;
use std::time::Duration;

use bson::{Bson, DateTime, Document};
use futures::future::BoxFuture;

use crate::record::{DecodeError, Decoding, TimeoutRecord, field};
use crate::store::backend::{MongoError, Written};
use crate::store::lease::{self, Lease};
use crate::store::paused_head::PausedHead;
use crate::store::read_window::{self, ReadWindow};
use crate::store::shapes::Shapes;
use crate::store::{Store, StoreError};

/// One record of a claim: its raw `_id` (what every guarded write matches) and the decoded
/// record, or why it could not be decoded.
#[derive(Debug, Clone)]
pub struct ClaimedRow {
    pub id: Bson,
    /// The document as stored, for parking it in its original shape.
    pub raw: Document,
    pub record: Result<TimeoutRecord, DecodeError>,
}

impl ClaimedRow {
    /// A row as read back from the collection.
    fn read(raw: Document, decoding: Decoding) -> Self {
        Self {
            id: raw.get(field::ID).cloned().unwrap_or(Bson::Null),
            record: TimeoutRecord::decode(&raw, decoding),
            raw,
        }
    }
}

/// What step 1 of a claim read: the records to take, oldest first, and the bounds the
/// compare-and-swap checks them against again.
#[derive(Debug, Clone)]
pub struct Candidates {
    /// Due by this instant (now plus the look-ahead, when read).
    horizon: DateTime,
    shapes: Vec<crate::record::due::Shape>,
    excluded: Vec<String>,
    /// Each candidate as read (every one has an `_id`).
    found: Vec<Document>,
    /// Every candidate was due when read (see the module).
    all_due: bool,
    /// The read saw more claimable records than it returned.
    more: bool,
}

impl Candidates {
    /// Candidates as a read would return them, for the dispatch machine's tests.
    #[cfg(test)]
    pub(crate) fn of(ids: Vec<Bson>) -> Self {
        Self {
            horizon: DateTime::MAX,
            shapes: Vec::new(),
            excluded: Vec::new(),
            found: ids
                .into_iter()
                .map(|id| bson::doc! { field::ID: id })
                .collect(),
            all_due: false,
            more: false,
        }
    }

    /// Whether the read found nothing to take.
    pub fn is_empty(&self) -> bool {
        self.found.is_empty()
    }

    /// Whether more may be claimable once these are given up: the read saw more than it
    /// returned, or returned any.
    pub fn more(&self) -> bool {
        self.more || !self.found.is_empty()
    }
}

/// A claimed batch: the lease every row shares, rows oldest first.
#[derive(Debug, Clone)]
pub struct Claim {
    pub lease: Lease,
    pub rows: Vec<ClaimedRow>,
    /// The claim saw claimable records it did not get (more than a batch, or lost to a
    /// racing instance): claim again at once rather than wait for the next poll.
    pub more: bool,
    /// Candidates the compare-and-swap was given (taken, or lost to a racing instance); 0
    /// when the read found none or the claim was given up before taking them.
    pub read: usize,
}

/// The records a take may have leased and not yet handed over. Dropped before
/// [`Unclaimed::handed_over`] (the take was dropped at an `.await` by its caller's deadline, or
/// failed between the compare-and-swap and the read-back), it frees them, owner-guarded, in a
/// task of its own: at once, rather than when the lease runs out, and, if the take had not
/// answered yet, again once it has (within a lease). The driver sends no `maxTimeMS` with an
/// update ([`crate::store::pacing`]), so an abandoned compare-and-swap can land on the server
/// any time after the release sent at once, and lease the records to an owner nobody holds
/// for a whole lease; its answer is the one sign that it has landed. Before, the second
/// release went one `operation_timeout` later, and a take slower than that still landed
/// after it.
struct Unclaimed {
    store: Store,
    ids: Vec<Bson>,
    owner: uuid::Uuid,
    /// The take's compare-and-swap, until it answers.
    take: Option<BoxFuture<'static, Result<Written, MongoError>>>,
    /// How long the take's leases last: past that, a late take holds nothing.
    lease_len: Duration,
}

impl Unclaimed {
    /// The take's answer. Dropped before it, the take goes on in the release task.
    async fn answer(&mut self) -> Result<Written, MongoError> {
        let Some(take) = self.take.as_mut() else {
            return Err(MongoError::custom("the take was already answered"));
        };
        let answer = take.await;
        self.take = None;
        answer
    }

    /// The rows are the caller's now.
    fn handed_over(&mut self) {
        self.ids.clear();
    }
}

impl Drop for Unclaimed {
    fn drop(&mut self) {
        if self.ids.is_empty() {
            return;
        }
        let (store, ids, owner, take, lease_len) = (
            self.store.clone(),
            std::mem::take(&mut self.ids),
            self.owner,
            self.take.take(),
            self.lease_len,
        );
        // Without a runtime (the process is ending) the leases run out on their own.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(crate::host::inherit(async move {
            let release = || async {
                let release = store.bounded("release an unfinished claim", store.release_many(&ids, owner));
                match release.await {
                    Ok(n) => tracing::debug!(%owner, released = n, "released the records of a claim that did not finish"),
                    Err(e) => tracing::warn!(%owner, error = %e, "could not release a claim that did not finish; its leases will expire"),
                }
            };
            release().await;
            if let Some(take) = take
                && tokio::time::timeout(lease_len, take).await.is_ok()
            {
                release().await;
            }
        }));
    }
}

/// The claim path: the store, and what its claims keep between them: the `Time` shapes to
/// query, the read window and the paused head. One per dispatch loop; a [`Store`] handle
/// carries none of it. Nothing here is a lease rule: those are [`crate::store::lease`]'s.
#[derive(Debug)]
pub struct ClaimPath {
    store: Store,
    shapes: Shapes,
    window: ReadWindow,
    head: PausedHead,
    /// The records found that no filter can name, each warned of once.
    named: std::sync::Mutex<std::collections::HashSet<Vec<u8>>>,
}

impl Store {
    /// Claims up to `batch_size` due records, oldest first, under a fresh owner, with the
    /// shapes read now: steps 1 to 6 of the lease protocol, outside the dispatch loop.
    pub async fn claim(&self, batch_size: u32, lease_len: Duration) -> Result<Claim, StoreError> {
        let path = ClaimPath::new(self.clone(), Shapes::read_now(self).await?);
        let candidates = path.candidates(batch_size, Duration::ZERO, &[]).await?;
        path.take(candidates, lease_len).await
    }
}

impl ClaimPath {
    pub fn new(store: Store, shapes: Shapes) -> Self {
        Self {
            store,
            shapes,
            window: ReadWindow::default(),
            head: PausedHead::default(),
            named: Default::default(),
        }
    }

    /// Warns once of each record found whose `_id` the read altered (not UTF-8): nothing
    /// timeoutd writes can name it, so it is left where it is, for an operator.
    fn name_unaddressable(&self, found: Vec<Document>) {
        let mut named = self.named.lock().unwrap_or_else(|e| e.into_inner());
        for doc in found {
            let id = doc.get(field::ID).cloned().unwrap_or(Bson::Null);
            if named.insert(crate::record::id_key(&id)) {
                tracing::warn!(
                    timeout_id = %crate::record::display_id(&id),
                    "record cannot be claimed: its _id is not valid UTF-8, so no filter timeoutd writes can name it; it will not fire until it is fixed or deleted by hand"
                );
            }
        }
    }

    /// Records this instance released may be due before where claims start reading now
    /// ([`crate::store::paused_head`]).
    pub fn released(&self) {
        self.head.forget();
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The learner's shapes, to follow their changes.
    pub fn shapes(&self) -> Shapes {
        self.shapes.clone()
    }

    /// The shapes to query now.
    async fn current_shapes(&self) -> Result<Vec<crate::record::due::Shape>, StoreError> {
        // Tests only: the wedge of issue 19, the claim path knowing no shape (every claim
        // then reads nothing and succeeds), for the checks that must see it from outside.
        // The monitor reads the learner's shapes, not these.
        #[cfg(feature = "failpoints")]
        if fail::eval("shapes-know-nothing", |_| ()).is_some() {
            return Ok(Vec::new());
        }
        self.shapes.current().await
    }

    pub async fn candidates(
        &self,
        batch_size: u32,
        look_ahead: Duration,
        excluded: &[String],
    ) -> Result<Candidates, StoreError> {
        let shapes = self.current_shapes().await?;
        let store = &self.store;
        let now = store.clock.now();
        // The earliest the server's clock can read: a lease is taken for expired, and a record
        // for due, by it. By the midpoint, a lease that still holds on the server (its holder
        // deleting the record it sent) could be taken, and the record sent twice.
        let earliest = store.clock.earliest();
        // While a backlog drains, read only about one batch past the last one, or a random
        // slice after meeting a racing instance (see `crate::store::read_window`).
        let slice = crate::host::random_range(0..read_window::SLICES as u64) as i64;
        let range = self.window.range(lease::add(now, look_ahead), slice);
        // Past the due records of the destinations left out, when a read from the start
        // found where the others begin (see `crate::store::paused_head`).
        let (head, began) = self.head.start(excluded);
        let from = match (range.from, head) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        // Whole documents (a projection saved nothing measurable on SecantusDB); the take
        // reads back the records it leased, as they are then. One query per shape, each oldest first by its own index, merged by true instant.
        let reads = shapes.iter().map(|shape| {
            store
                .coll
                .find(lease::due_within_except(
                    earliest,
                    from,
                    range.to,
                    std::slice::from_ref(shape),
                    excluded,
                ))
                .sort(shape.sort())
                .limit(i64::from(batch_size))
        });
        // Each record with its due instant, when its `Time` decodes. A record the decoder
        // rejects still joins the batch (to be parked), at the end of the range it matched.
        let reads = futures::future::try_join_all(reads.map(IntoFuture::into_future));
        let mut found: Vec<(Option<DateTime>, Document)> = Store::timed("find", reads)
            .await?
            .into_iter()
            .flatten()
            .map(|d| (TimeoutRecord::decode_due(&d, store.encoding), d))
            .collect();
        found.sort_by_key(|(due, _)| due.unwrap_or(range.to).timestamp_millis());
        found.truncate(batch_size as usize);
        let dues: Vec<DateTime> = found
            .iter()
            .map(|(due, _)| due.unwrap_or(range.to))
            .collect();
        // A first record whose `Time` does not decode (all of them, then: they sort last)
        // says nothing of where the due records begin: the bound stays as it was. Taken for
        // due at the horizon (found in review, helper-36), a batch of them moved the bound to
        // about now, and valid due records behind the batch waited for a full read.
        if found.first().is_none_or(|(due, _)| due.is_some()) {
            let first = dues.first().copied();
            self.head
                .update((excluded, began), from, now, first, range.to);
        }
        let more = self
            .window
            .update(&range, &dues, found.len() >= batch_size as usize);
        // Due by the earliest the server's clock can read, as the take judges it.
        let all_due = found
            .iter()
            .all(|(due, _)| due.is_some_and(|due| due <= earliest));
        // Only records a filter can name: a take of an `_id` the read altered matched
        // nothing, and the claim, seeing a candidate it did not get, ran again at once, for
        // ever (found in review, helper-39).
        let (found, unaddressable): (Vec<Document>, Vec<Document>) = found
            .into_iter()
            .map(|(_, d)| d)
            .partition(crate::record::addressable);
        self.name_unaddressable(unaddressable);
        Ok(Candidates {
            horizon: range.to,
            shapes,
            excluded: excluded.to_vec(),
            found,
            all_due,
            more,
        })
    }

    /// Steps 2 to 6 of a claim: takes the `candidates` still claimable now under a fresh
    /// owner and a lease from now, with the compare-and-swap `updateMany`, and reads back
    /// the records it leased as they are now: each is scheduled by the `Time` read back. When
    /// every candidate was due and all were taken, the candidates as read are what it leased,
    /// and it reads nothing back.
    pub async fn take(
        &self,
        candidates: Candidates,
        lease_len: Duration,
    ) -> Result<Claim, StoreError> {
        let Candidates {
            horizon,
            shapes,
            excluded,
            found,
            all_due,
            more: windowed_more,
        } = candidates;
        let found_count = found.len();
        let store = &self.store;
        let now = store.clock.now();
        // Leases expired and records due by the earliest the server's clock can read (see
        // `candidates`).
        let earliest = store.clock.earliest();
        let lease = Lease::new(now, lease_len);
        if found.is_empty() {
            return Ok(Claim {
                lease,
                rows: Vec::new(),
                more: windowed_more,
                read: 0,
            });
        }
        let candidates: Vec<Bson> = found
            .iter()
            .filter_map(|d| d.get(field::ID).cloned())
            .collect();
        // Every candidate was due when read: take only what is due now, so that a record
        // rescheduled since the read is taken only if it is still due, and is sent now
        // either way, as its `Time` says. All taken then means all as read, but for their
        // `Time` and lease: no read-back. Due by the earliest the server's clock can read,
        // as every "is it due?" is: by the midpoint, a record rescheduled to an instant
        // within half a round trip ahead was taken and sent before it was due on the server
        // (the simulation's `early`, seed 1791: 487 ms).
        let horizon = if all_due { earliest } else { horizon };
        // From here until the rows are handed over, records may be leased to this owner: if
        // this future is dropped (its caller's deadline) or fails, they are freed at once.
        let take = store.coll.update_many(
            lease::except(
                lease::claim_filter(earliest, horizon, &shapes, &candidates),
                &excluded,
            ),
            lease::claim_update(&lease, store.uuids),
        );
        let mut unclaimed = Unclaimed {
            store: store.clone(),
            ids: candidates.clone(),
            owner: lease.owner,
            take: Some(take.into_future()),
            lease_len,
        };
        let taken = Store::timed("claim", unclaimed.answer()).await;
        // Tests only: a server slow to answer after it applied the claim.
        #[cfg(feature = "failpoints")]
        if let Some(Some(ms)) = fail::eval("claim-taken-delay", |arg| {
            arg.and_then(|a| a.parse::<u64>().ok())
        }) {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        if let Ok(r) = &taken
            && r.modified < candidates.len() as u64
        {
            self.window.raced();
        }
        let rows = match taken {
            Ok(r) if r.modified == 0 => Ok(Vec::new()),
            Ok(r) if all_due && r.modified == found_count as u64 => {
                Ok(self.as_leased(found, &lease))
            }
            // Read back what this lease holds, as it is now: a racing instance may have taken
            // some, and a record rescheduled since the read is sent by its new `Time`.
            Ok(_) => Store::timed("read_back", self.read_back(&candidates, &lease)).await,
            Err(e) => Err(e),
        };
        match rows {
            Ok(rows) => {
                unclaimed.handed_over();
                Ok(Claim {
                    more: windowed_more || found_count > rows.len(),
                    lease,
                    rows,
                    read: found_count,
                })
            }
            // Between the update and the read-back: what we may hold is freed (`unclaimed`).
            Err(e) => Err(e.into()),
        }
    }

    /// The candidates as read, every one of them taken under `lease`: as the read-back would
    /// return them, but for a `Time` rescheduled since the read to another instant that is
    /// also due: that changes nothing of what is sent, nor when, but the lateness metric and
    /// the history row keep the `Time` read.
    fn as_leased(&self, found: Vec<Document>, lease: &Lease) -> Vec<ClaimedRow> {
        let leased = lease::leased_fields(lease, self.store.uuids);
        found
            .into_iter()
            .map(|mut raw| {
                raw.extend(leased.clone());
                ClaimedRow::read(raw, self.store.decoding)
            })
            .collect()
    }

    async fn read_back(
        &self,
        candidates: &[Bson],
        lease: &Lease,
    ) -> Result<Vec<ClaimedRow>, crate::store::backend::MongoError> {
        let store = &self.store;
        let docs: Vec<Document> = store
            .coll
            .find(lease::held_many(candidates, lease.owner, store.clock.now()))
            .await?;
        let mut rows: Vec<ClaimedRow> = docs
            .into_iter()
            .map(|d| ClaimedRow::read(d, store.decoding))
            .collect();
        rows.sort_by_key(|r| {
            r.record
                .as_ref()
                .map(|r| r.due.timestamp_millis())
                .unwrap_or(i64::MAX)
        });
        Ok(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    use bson::doc;

    use crate::config::{MongoConfig, UuidRepresentation};
    use crate::record::due::Shape;
    use crate::record::guid;
    use crate::store::backend::{Answer, Answering, Op, Reply, Written};
    use crate::store::clock::ServerClock;

    /// A free record due `ms` from now (negative: in the past).
    fn record(ms: i64) -> Document {
        let due = DateTime::from_millis(crate::host::wall_date().timestamp_millis() + ms);
        doc! {
            field::ID: guid::to_bson(crate::host::uuid(), UuidRepresentation::Standard),
            field::DESTINATION: "q",
            field::PROCESS_MANAGER_ID: guid::to_bson(crate::host::uuid(), UuidRepresentation::Standard),
            field::TIME: due,
            field::LOCKED: false,
        }
    }

    /// Claims from a server whose due read returns `docs` and whose compare-and-swap takes
    /// `takes` of them (a read-back finds nothing); returns the claim and every operation
    /// the server was asked for.
    async fn claim(docs: Vec<Document>, takes: u64, look_ahead: Duration) -> (Claim, Vec<Op>) {
        let (path, asked) = path_over(docs, takes);
        let candidates = path
            .candidates(10, look_ahead, &[])
            .await
            .expect("the read answers");
        let claim = path
            .take(candidates, Duration::from_secs(60))
            .await
            .expect("the take answers");
        let ops = asked.lock().unwrap_or_else(|e| e.into_inner()).clone();
        (claim, ops)
    }

    /// A claim path over a server whose first due read returns `docs` and whose
    /// compare-and-swap takes `takes` of them (a read-back finds nothing), and every operation
    /// it was asked for.
    fn path_over(docs: Vec<Document>, takes: u64) -> (ClaimPath, Arc<Mutex<Vec<Op>>>) {
        let asked: Arc<Mutex<Vec<Op>>> = Arc::default();
        let ops = asked.clone();
        let backend = Answering::new(move |op: Op| {
            let mut ops = ops.lock().unwrap_or_else(|e| e.into_inner());
            let reply = match &op {
                Op::Find { .. } if ops.is_empty() => Reply::Docs(docs.clone()),
                Op::Update { .. } => Reply::Written(Written {
                    matched: takes,
                    modified: takes,
                    ..Written::default()
                }),
                _ => Reply::Docs(Vec::new()),
            };
            ops.push(op);
            Ok(reply)
        });
        let store = Store::with_backend(
            Arc::new(backend),
            &MongoConfig::default(),
            ServerClock::default(),
        );
        (
            ClaimPath::new(store, Shapes::Fixed(vec![Shape::Date])),
            asked,
        )
    }

    fn names(ops: &[Op]) -> Vec<&'static str> {
        ops.iter().map(Op::name).collect()
    }

    /// The horizon the take's compare-and-swap put on `Time`.
    fn take_horizon(ops: &[Op]) -> DateTime {
        let Some(Op::Update { filter, .. }) = ops.get(1) else {
            panic!("no take: {ops:?}");
        };
        let due = filter.get_array("$and").expect("an $and")[1]
            .as_document()
            .expect("the due clause");
        *due.get_document(field::TIME)
            .expect("one shape")
            .get_datetime("$lte")
            .expect("a bound")
    }

    /// A take given up on by its caller is released at once; its compare-and-swap may still
    /// land on the server after that release, leasing the records to an owner nobody holds,
    /// for a whole lease. They are released again once it has answered, however late: the
    /// driver sends updates no `maxTimeMS`. Before, the second release went one
    /// `operation_timeout` after the first, and a take answering later still held them.
    #[tokio::test(start_paused = true)]
    async fn a_take_given_up_on_is_released_again_once_it_has_answered() {
        // A server that answers the take's compare-and-swap after 30 s: it applied it then,
        // after the release sent when the caller gave up. Every operation is recorded, with
        // the instant it was asked for.
        let ops: Arc<Mutex<Vec<(Op, tokio::time::Instant)>>> = Arc::default();
        let (asked, due) = (ops.clone(), record(-60_000));
        let late = Duration::from_secs(30);
        let backend = Answering::new(move |op: Op| {
            asked
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((op.clone(), tokio::time::Instant::now()));
            match op {
                Op::Find { .. } => Answer::Now(Ok(Reply::Docs(vec![due.clone()]))),
                Op::Update { update, .. }
                    if update
                        .get_document("$set")
                        .is_ok_and(|s| s.get(field::LOCKED) == Some(&Bson::Boolean(true))) =>
                {
                    let taken = Written {
                        matched: 1,
                        modified: 1,
                        ..Written::default()
                    };
                    Answer::After(late, Ok(Reply::Written(taken)))
                }
                _ => Answer::Now(Ok(Reply::Written(Written::default()))),
            }
        });
        let config = MongoConfig::default();
        let store = Store::with_backend(Arc::new(backend), &config, ServerClock::default());
        let path = ClaimPath::new(store, Shapes::Fixed(vec![Shape::Date]));
        let candidates = path
            .candidates(10, Duration::ZERO, &[])
            .await
            .expect("read");
        let started = tokio::time::Instant::now();
        let take = path.take(candidates, Duration::from_secs(300));
        let given_up = tokio::time::timeout(Duration::from_secs(1), take).await;
        assert!(
            given_up.is_err(),
            "the take answers after its caller gave up"
        );
        tokio::time::sleep(late + Duration::from_secs(1)).await;
        let ops = ops.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let asked: Vec<_> = ops.iter().map(|(op, _)| op.clone()).collect();
        assert_eq!(
            names(&asked),
            ["find", "updateMany", "updateMany", "updateMany"]
        );
        let last = ops.last().map(|(_, at)| *at - started);
        assert!(last >= Some(late), "the last release at {last:?}");
    }

    /// Every `LockExpiresAt` bound of `$lte` in `filter`: the instants at or before which it
    /// takes a lease for expired.
    fn expiry_bounds(filter: &Document) -> Vec<DateTime> {
        let mut bounds = Vec::new();
        for (k, v) in filter {
            match v {
                Bson::Document(d) if k == field::LOCK_EXPIRES_AT => {
                    bounds.extend(d.get_datetime("$lte").ok().copied())
                }
                Bson::Document(d) => bounds.extend(expiry_bounds(d)),
                Bson::Array(a) => {
                    for d in a.iter().filter_map(Bson::as_document) {
                        bounds.extend(expiry_bounds(d));
                    }
                }
                _ => {}
            }
        }
        bounds
    }

    /// What the server's clock read in a reading whose round trip took 10 s: the midpoint
    /// estimate is 5 s ahead of the earliest the server's clock can read.
    const SLOW_READ: DateTime = DateTime::from_millis(1_767_225_600_000);

    /// Claims `found` (what the due read returns; the take takes nothing) after a reading of
    /// the server's clock at [`SLOW_READ`]; returns every operation the server was asked for.
    async fn claim_after_a_slow_reading(found: Document) -> Vec<Op> {
        let asked: Arc<Mutex<Vec<Op>>> = Arc::default();
        let ops = asked.clone();
        let backend = Answering::new(move |op: Op| {
            let mut ops = ops.lock().unwrap_or_else(|e| e.into_inner());
            let reply = match &op {
                Op::Find { .. } => Reply::Docs(vec![found.clone()]),
                _ => Reply::Written(Written::default()),
            };
            ops.push(op);
            Ok(reply)
        });
        let clock = ServerClock::default();
        let received = tokio::time::Instant::now();
        clock.observe(SLOW_READ, received - Duration::from_secs(10), received);
        let store = Store::with_backend(Arc::new(backend), &MongoConfig::default(), clock);
        let path = ClaimPath::new(store, Shapes::Fixed(vec![Shape::Date]));
        let candidates = path
            .candidates(10, Duration::ZERO, &[])
            .await
            .expect("read");
        path.take(candidates, Duration::from_secs(60))
            .await
            .expect("take");
        asked.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// While a destination is left out, a full batch of records whose `Time` does not
    /// decode sets no bound for the next read: it said nothing of where the due records
    /// begin. It set one at about now, and the valid due records behind that batch waited
    /// for the next full read.
    #[tokio::test]
    async fn a_batch_of_undecodable_times_sets_no_bound_to_the_next_read() {
        let undecodable = (0..10).map(|_| {
            let mut bad = record(-60_000);
            bad.insert(field::TIME, "not a date");
            bad
        });
        let (path, asked) = path_over(undecodable.collect(), 0);
        let excluded = ["paused".to_string()];
        for _ in 0..2 {
            path.candidates(10, Duration::ZERO, &excluded)
                .await
                .expect("the read answers");
        }
        let ops = asked.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let Some(Op::Find { filter, .. }) = ops.get(1) else {
            panic!("no second read: {ops:?}");
        };
        let due = filter.get_array("$and").expect("an $and")[0]
            .as_document()
            .expect("the due clause");
        let from = due
            .get_document(field::TIME)
            .expect("one shape")
            .get("$gte");
        assert_eq!(from, None, "the second read starts at {from:?}");
    }

    /// A record whose `_id` is a string with bytes that are not UTF-8 is left out of the
    /// take: the altered `_id` matched nothing, and the claim, seeing a candidate it did not
    /// get, ran again at once, for ever.
    #[tokio::test]
    async fn a_record_whose_id_the_read_altered_is_left_out_of_the_take() {
        let mut bad = record(-60_000);
        bad.insert(field::ID, "id-@@@");
        let bytes = crate::record::tests::not_utf8_at_marks(&bad);
        let read = crate::record::from_stored(bson::RawDocument::from_bytes(&bytes).expect("BSON"));
        let (claim, ops) = claim(vec![read, record(-30_000)], 1, Duration::ZERO).await;
        assert!(!claim.more, "claims again at once");
        assert_eq!(claim.read, 1, "{:?}", names(&ops));
    }

    /// After a reading whose round trip took 10 s, a lease running out 2 s after the earliest
    /// the server's clock can read may still hold on the server, and its holder may be
    /// deleting the record it sent: neither the read nor the compare-and-swap takes it for
    /// expired. Before, both took leases for expired by the midpoint.
    #[tokio::test(start_paused = true)]
    async fn a_claim_takes_no_lease_the_server_may_still_hold() {
        let ops = claim_after_a_slow_reading(record(-60_000)).await;
        let still_held = lease::add(SLOW_READ, Duration::from_secs(2));
        assert_eq!(names(&ops), ["find", "updateMany"]);
        for op in &ops {
            let (Op::Find { filter, .. } | Op::Update { filter, .. }) = op else {
                continue;
            };
            let bounds = expiry_bounds(filter);
            assert!(!bounds.is_empty(), "{filter}");
            assert!(bounds.iter().all(|b| *b < still_held), "{bounds:?}");
        }
    }

    /// After a reading whose round trip took 10 s, candidates read as due may have been
    /// rescheduled since to an instant between the earliest the server's clock can read and
    /// the midpoint estimate: the take's compare-and-swap takes none that is not due by that
    /// earliest instant. Before, its horizon was the midpoint, and a rescheduled record went
    /// out before it was due on the server (the simulation's `early`, seed 1791).
    #[tokio::test(start_paused = true)]
    async fn a_take_takes_nothing_the_server_may_not_yet_have_due() {
        let mut due = record(0);
        due.insert(field::TIME, DateTime::from_millis(1_767_225_540_000));
        let ops = claim_after_a_slow_reading(due).await;
        assert!(take_horizon(&ops) <= SLOW_READ, "{}", take_horizon(&ops));
    }

    /// Every candidate due and every one taken: the rows are the documents read, under the
    /// new lease, without a read-back; the take put the horizon at its own instant.
    #[tokio::test]
    async fn a_take_of_every_due_candidate_needs_no_read_back() {
        let docs = vec![record(-2_000), record(-1_000)];
        let (claim, ops) = claim(docs.clone(), 2, Duration::from_secs(30)).await;
        assert_eq!(names(&ops), ["find", "updateMany"]);
        assert!(take_horizon(&ops) < claim.lease.expires_at);
        assert!(take_horizon(&ops) <= crate::host::wall_date());
        assert_eq!(claim.rows.len(), 2);
        for (row, doc) in claim.rows.iter().zip(&docs) {
            assert_eq!(Some(&row.id), doc.get(field::ID));
            let record = row.record.as_ref().expect("decodes");
            assert_eq!(
                Bson::DateTime(record.due),
                doc.get(field::TIME).cloned().unwrap()
            );
            assert_eq!(row.raw.get_bool(field::LOCKED), Ok(true));
            assert_eq!(
                row.raw.get(field::LOCKED_BY),
                Some(&guid::to_bson(
                    claim.lease.owner,
                    UuidRepresentation::Standard
                ))
            );
            assert_eq!(
                row.raw.get_datetime(field::LOCK_EXPIRES_AT),
                Ok(&claim.lease.expires_at)
            );
        }
        assert!(!claim.more);
    }

    /// A racing instance took one: what this lease holds is read back.
    #[tokio::test]
    async fn a_take_that_lost_a_candidate_reads_back_what_it_holds() {
        let (claim, ops) = claim(vec![record(-2_000), record(-1_000)], 1, Duration::ZERO).await;
        assert_eq!(names(&ops), ["find", "updateMany", "find"]);
        assert!(claim.more, "the read saw more than the take got");
    }

    /// A candidate not yet due (held under the lease until its instant, within the
    /// look-ahead) may have been rescheduled since the read: the take keeps the read's
    /// horizon and reads back the `Time` it took.
    #[tokio::test]
    async fn a_take_of_a_candidate_not_yet_due_reads_back_its_time() {
        let (claim, ops) = claim(
            vec![record(-1_000), record(20_000)],
            2,
            Duration::from_secs(30),
        )
        .await;
        assert_eq!(names(&ops), ["find", "updateMany", "find"]);
        assert!(take_horizon(&ops) > crate::host::wall_date());
        assert!(claim.rows.is_empty(), "the read-back found nothing");
    }
}
