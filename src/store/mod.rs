//! The store: the ServiceConnect `Timeouts` collection in MongoDB.
//!
//! Runs the queries that [`lease`] defines: claim a batch ([`claim`]), remove or release what a
//! claim holds, reap expired leases, insert for `schedule`. It only ever `$set`s the three lock
//! fields of an existing record and deletes by `_id`. [`Store`] is the handle on the
//! collections and nothing else: the state of other concerns (pauses, the census's memory) is
//! kept by them and handed in.
//!
//! Long, as one concept: `Store` and its guarded writes: every write on a claimed record sits next
//! to `bounded`, the one bounded call (about 450 lines of code, the rest its tests).

pub mod backend;
pub mod backlog;
pub mod census;
pub mod claim;
pub mod clock;
pub mod coll;
pub mod control;
pub mod driver;
pub mod durability;
pub mod edit;
pub mod follow;
pub mod history;
pub mod indexes;
pub mod lease;
pub mod listing;
pub mod pacing;
pub mod parking;
pub mod paused_head;
pub mod read_window;
pub mod shapes;

use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Duration;

use bson::{Bson, DateTime, Document, doc};
use tokio::time::Instant;
use uuid::Uuid;

use crate::config::{MongoConfig, TimeEncoding, UuidRepresentation};
use crate::record::due::Shape;
use crate::record::{Decoding, TimeoutRecord, field};
use crate::store::backend::{Backend, ChangeStream};
use crate::store::clock::ServerClock;
use crate::store::coll::Coll;

pub use crate::store::claim::{Candidates, Claim, ClaimedRow};

pub use indexes::{DATE_DUE_INDEX, LEASE_INDEX, OWNER_INDEX, TICKS_DUE_INDEX};

/// What can go wrong talking to MongoDB.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("mongodb.uri is not a valid MongoDB connection string: {0}")]
    InvalidUri(String),
    #[error(
        "the MongoDB write concern is unacknowledged (w=0): guarded deletes and releases would all look successful and lost leases would go unnoticed; use w=1 or w=majority"
    )]
    UnacknowledgedWriteConcern,
    #[error("MongoDB: {0}")]
    Mongo(#[from] mongodb::error::Error),
    #[error("MongoDB hello reply has no localTime")]
    NoServerTime,
    #[error("MongoDB: {0}")]
    Deadline(#[from] crate::deadline::Elapsed),
    #[error("a MongoDB call panicked: {0}")]
    Panicked(String),
    #[error("the Time shapes of the timeouts collection could not be checked: {0}")]
    ShapesUnchecked(String),
}

/// A handle on the `Timeouts` collection; cheap to clone.
#[derive(Debug, Clone)]
pub struct Store {
    /// MongoDB: the driver, or a model ([`crate::store::backend`]).
    backend: Arc<dyn Backend>,
    /// `[mongodb] database`.
    database: Arc<str>,
    coll: Coll,
    parked: Coll,
    attempts: Coll,
    /// timeoutd's control collection: pauses, ramps and the audit of operator actions.
    control: Coll,
    /// The same collection in the other spelling of the ServiceConnect database, when the
    /// backend can reach it (the driver): read once, for a warning ([`crate::store::indexes`]).
    other_spelling: Option<(&'static str, Coll)>,
    encoding: TimeEncoding,
    uuids: UuidRepresentation,
    decoding: Decoding,
    clock: ServerClock,
    lock_lease: Duration,
    /// Deadline of every single call ([`Store::bounded`]).
    op_timeout: Duration,
    /// `[history] keep` is set: fired, parked and cancelled timeouts are recorded.
    history_on: bool,
    /// The write concern and read preference the URI set, for [`Store::durability_risks`].
    write_concern: Option<mongodb::options::WriteConcern>,
    selection: Option<mongodb::options::SelectionCriteria>,
}

impl Store {
    /// Reads the URI and keeps what builds a client ([`crate::store::driver::Driver`]).
    /// Refuses an unacknowledged write concern. The client is built at the first call (for
    /// `mongodb+srv://`, resolving DNS) and connects lazily; [`Store::refresh_clock`] is the
    /// first round trip.
    pub async fn connect(config: &MongoConfig, clock: ServerClock) -> Result<Self, StoreError> {
        let driver = crate::store::driver::Driver::connect(config).await?;
        let (write_concern, selection) = (driver.write_concern.clone(), driver.selection.clone());
        let limit = server_limit(config.operation_timeout);
        let other_spelling = other_spelling(&config.database).map(|other| {
            let backend: Arc<dyn Backend> = Arc::new(driver.with_database(other));
            (other, Coll::new(backend, &config.collection, limit))
        });
        let mut store = Self::with_backend(Arc::new(driver), config, clock);
        store.write_concern = write_concern;
        store.selection = selection;
        store.other_spelling = other_spelling;
        Ok(store)
    }

    /// A store with the default configuration on a server that takes every call and never
    /// answers, and the count of the calls it took (for unit tests of what waits on MongoDB).
    #[cfg(test)]
    pub(crate) fn silent() -> (Arc<std::sync::atomic::AtomicUsize>, Self) {
        use backend::{Answer, Answering};
        use std::sync::atomic::{AtomicUsize, Ordering};
        let calls = Arc::new(AtomicUsize::new(0));
        let (ops, commands) = (calls.clone(), calls.clone());
        let silent = Answering(
            move |_: backend::Op| -> Answer<backend::Reply> {
                ops.fetch_add(1, Ordering::SeqCst);
                Answer::Never
            },
            move |_: bson::Document| -> Answer<bson::Document> {
                commands.fetch_add(1, Ordering::SeqCst);
                Answer::Never
            },
        );
        let config = MongoConfig::default();
        let store = Self::with_backend(Arc::new(silent), &config, ServerClock::default());
        (calls, store)
    }

    /// A store over `backend`, the driver or a model, for the collections `config` names.
    pub fn with_backend(
        backend: Arc<dyn Backend>,
        config: &MongoConfig,
        clock: ServerClock,
    ) -> Self {
        let limit = server_limit(config.operation_timeout);
        let coll = |name: &str| Coll::new(backend.clone(), name, limit);
        Self {
            coll: coll(&config.collection),
            parked: coll(&config.parked_collection()),
            attempts: coll(&config.attempts_collection()),
            control: coll(&config.control_collection()),
            backend,
            database: Arc::from(config.database.as_str()),
            other_spelling: None,
            encoding: config.time_encoding,
            uuids: config.uuid_representation,
            decoding: Decoding::from(config.time_encoding),
            clock,
            lock_lease: crate::config::DispatchConfig::default().lock_lease,
            op_timeout: config.operation_timeout,
            history_on: false,
            write_concern: None,
            selection: None,
        }
    }

    /// Takes the settings outside `[mongodb]` that the store needs: whether decoded records
    /// keep their stored headers (`[rabbitmq] forward_headers`) and the lease length (how
    /// long a stuck lock must last before the reaper frees it).
    pub fn with_settings(mut self, config: &crate::config::Config) -> Self {
        self.decoding.forward_headers = config.rabbitmq.forward_headers;
        self.lock_lease = config.dispatch.lock_lease;
        self.history_on = config.history.is_on();
        self
    }

    /// `[dispatch] lock_lease`, as given to [`Store::with_settings`].
    pub fn lock_lease(&self) -> Duration {
        self.lock_lease
    }

    /// `[history] keep` is set: this instance records fired, parked and cancelled timeouts.
    pub fn history_on(&self) -> bool {
        self.history_on
    }

    /// Ends the client's server sessions and stops its background tasks, within `within`;
    /// call before the async runtime ends (why: [`crate::store::driver`]'s `shutdown`).
    /// Returns false when the deadline passed; the client is then leaked on purpose.
    pub async fn close(&self, within: Duration) -> bool {
        let closing = async {
            crate::service::shutdown::stall().await;
            self.backend.shutdown().await
        };
        tokio::time::timeout(within, closing).await.is_ok()
    }

    /// The parking collection and the failed-send counts that go with this store.
    pub fn parking(&self) -> crate::store::parking::Parking {
        crate::store::parking::Parking {
            timeouts: self.coll.clone(),
            parked: self.parked.clone(),
            attempts: self.attempts.clone(),
            clock: self.clock.clone(),
        }
    }

    /// Runs one store call under `[mongodb] operation_timeout`: a server that stops answering
    /// becomes a [`StoreError::Deadline`] naming the call, never a wait without end. Counted
    /// in `timeoutd_mongodb_calls_in_flight` ([`crate::store::pacing`]).
    pub async fn bounded<T>(
        &self,
        what: &'static str,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let counted = crate::deadline::CallInFlight::start(self.op_timeout);
        let result = crate::deadline::within(self.op_timeout, what, call).await;
        // Past its deadline it may still run on the server: counted on (see CallInFlight).
        if !matches!(result, Err(StoreError::Deadline(_))) {
            counted.finished();
        }
        result
    }

    /// The deadline every read carries to the server (`maxTimeMS`): `[mongodb]
    /// operation_timeout`, so that a query timeoutd gave up on stops there too.
    pub fn server_limit(&self) -> Duration {
        server_limit(self.op_timeout)
    }

    /// `[mongodb] operation_timeout`.
    pub fn operation_timeout(&self) -> Duration {
        self.op_timeout
    }

    /// Runs one database command with its `maxTimeMS` ([`Store::server_limit`]); no deadline
    /// of its own: callers bound it.
    async fn command(&self, mut command: Document) -> Result<Document, StoreError> {
        command.insert("maxTimeMS", max_time_ms(self.server_limit()));
        Ok(self.backend.command(command).await?)
    }

    /// One driver call under `[mongodb] operation_timeout`, its error made a [`StoreError`]:
    /// the bound of every single query the store's own methods make.
    async fn query<T>(
        &self,
        call: impl std::future::IntoFuture<Output = Result<T, mongodb::error::Error>>,
    ) -> Result<T, StoreError> {
        // Not counted on its own: it runs within a counted `bounded` call.
        crate::deadline::within(self.op_timeout, "a MongoDB query", async {
            Ok(call.into_future().await?)
        })
        .await
    }

    /// Awaits one MongoDB call (or a background task's set of calls) and records its duration in
    /// `timeoutd_mongodb_call_seconds{call}`, whatever its outcome.
    pub(crate) async fn timed<T>(
        call: &'static str,
        fut: impl std::future::Future<Output = T>,
    ) -> T {
        let started = Instant::now();
        let out = fut.await;
        crate::metrics::mongodb_call(call, started.elapsed());
        out
    }

    /// The clock this store stamps leases with.
    pub fn clock(&self) -> &ServerClock {
        &self.clock
    }

    /// The `Time` encoding of the collection.
    pub fn encoding(&self) -> TimeEncoding {
        self.encoding
    }

    /// The settings that would let a failover undo a lease write or a read miss one, on the
    /// deployment the server describes (see [`crate::store::durability`]).
    pub async fn durability_risks(&self) -> Result<Vec<String>, StoreError> {
        let hello = self.command(doc! { "hello": 1 }).await?;
        Ok(crate::store::durability::risks(
            &hello,
            self.write_concern.as_ref(),
            self.selection.as_ref(),
        ))
    }

    /// The server's version, from `buildInfo` (no deadline of its own: callers bound it).
    pub async fn server_version(&self) -> Result<String, StoreError> {
        let reply = self.command(doc! { "buildInfo": 1 }).await?;
        Ok(reply.get_str("version").unwrap_or("unknown").to_string())
    }

    /// Reads the server's clock (`hello.localTime`) and updates the offset estimate. Takes
    /// the sample with the shortest round trip of three, so that a first call that also opens
    /// the connection does not skew it, unless a later one shows the server's clock stepped
    /// since ([`clock::Sample::better`]). Also the cheapest check that the server answers.
    /// Each `hello` is bounded on its own ([`Store::bounded`]), and a failure after one
    /// answered keeps what answered: under one deadline for all three, a server slower than a
    /// third of `operation_timeout` was never read again, and an instance went on from a
    /// reading taken before the server's clock stepped back, publishing 2.5 s early (the
    /// simulation's `early` invariant, seed 24656).
    pub async fn refresh_clock(&self) -> Result<i64, StoreError> {
        let mut best: Option<clock::Sample> = None;
        for _ in 0..3 {
            let sent = Instant::now();
            let hello = self.bounded("read the server clock", self.command(doc! { "hello": 1 }));
            let reply = match hello.await {
                Ok(reply) => reply,
                Err(_) if best.is_some() => break,
                Err(e) => return Err(e),
            };
            let received = Instant::now();
            let server = *reply
                .get_datetime("localTime")
                .map_err(|_| StoreError::NoServerTime)?;
            let sample = clock::Sample {
                server,
                sent,
                received,
            };
            if best.is_none_or(|b| sample.better(&b)) {
                best = Some(sample);
            }
        }
        let best = best.ok_or(StoreError::NoServerTime)?;
        Ok(self.clock.observe(best.server, best.sent, best.received))
    }

    /// Deletes the given records that `owner` still holds under a live lease; returns how
    /// many were deleted. Fewer than `ids.len()` means some leases were lost.
    pub async fn remove_held(&self, ids: &[Bson], owner: Uuid) -> Result<u64, StoreError> {
        if ids.is_empty() {
            return Ok(0);
        }
        let r = Self::timed(
            "remove",
            self.coll
                .delete_many(lease::held_many(ids, owner, self.clock.now()))
                .into_future(),
        )
        .await?;
        Ok(r.deleted)
    }

    /// Of `ids`, those still in the collection (to name the lost leases after a short delete).
    pub async fn existing(&self, ids: &[Bson]) -> Result<Vec<Bson>, StoreError> {
        Ok(self
            .coll
            .find_ids(doc! { field::ID: { "$in": ids } })
            .await?)
    }

    /// Frees those of `ids` that `owner` still holds; returns how many.
    pub async fn release_many(&self, ids: &[Bson], owner: Uuid) -> Result<u64, StoreError> {
        if ids.is_empty() {
            return Ok(0);
        }
        let r = Self::timed(
            "release",
            self.coll
                .update_many(
                    lease::held_many(ids, owner, self.clock.now()),
                    lease::release_update(self.uuids),
                )
                .into_future(),
        )
        .await?;
        Ok(r.matched)
    }

    /// Frees expired leases, at most [`REAP_BATCH`] a pass; returns how many. Their `_id`s are
    /// read first (why: [`crate::store::pacing`]), then freed by `_id` if still expired.
    pub async fn reap(&self) -> Result<u64, StoreError> {
        // Expired by the earliest the server's clock can read: by the midpoint, a lease that
        // still holds on the server could be freed under its holder.
        let now = self.clock.earliest();
        let expired = self.coll.find_ids(lease::expired(now));
        let ids = expired.limit(REAP_BATCH).await?;
        if ids.is_empty() {
            return Ok(0);
        }
        let r = self
            .coll
            .update_many(
                lease::expired_among(&ids, now),
                lease::release_update(self.uuids),
            )
            .await?;
        Ok(r.modified)
    }

    /// A change stream of the inserts into the collection (for [`crate::maintenance::wakeup`]):
    /// raw change events, the record under `fullDocument`.
    pub async fn watch_inserts(&self) -> Result<ChangeStream, StoreError> {
        Ok(self
            .coll
            .watch(vec![doc! { "$match": { "operationType": "insert" } }])
            .await?)
    }

    /// Inserts one free record in ServiceConnect's shape, GUIDs in the configured
    /// representation. With `time_encoding = "auto"`, `Time` takes the shape the collection
    /// already holds (`[ticks, 0]` when it holds only those, else a date).
    pub async fn insert(&self, record: &TimeoutRecord) -> Result<(), StoreError> {
        let encoding = match self.encoding {
            TimeEncoding::Auto => {
                let shapes = self.shapes().await?;
                if !shapes.is_empty() && !shapes.contains(&Shape::Date) {
                    TimeEncoding::DotnetTicks
                } else {
                    TimeEncoding::Date
                }
            }
            other => other,
        };
        self.query(
            self.coll
                .insert_one(record.to_document_as(encoding, self.uuids)),
        )
        .await?;
        Ok(())
    }
}

/// The most expired leases one reaper pass frees ([`Store::reap`]).
pub const REAP_BATCH: i64 = 1_000;

/// The other spelling of the ServiceConnect database, for `database`, if it is one of them.
fn other_spelling(database: &str) -> Option<&'static str> {
    use crate::config::{LEASE_ERA_DATABASE, PUBLIC_DATABASE};
    match database {
        PUBLIC_DATABASE => Some(LEASE_ERA_DATABASE),
        LEASE_ERA_DATABASE => Some(PUBLIC_DATABASE),
        _ => None,
    }
}

/// [`Store::server_limit`] for `operation_timeout`, within the largest `maxTimeMS` a server
/// takes (an int32 of milliseconds, about 24.8 days).
fn server_limit(operation_timeout: Duration) -> Duration {
    operation_timeout.clamp(
        Duration::from_millis(1),
        Duration::from_millis(i32::MAX as u64),
    )
}

/// A stored field read as hostile: its string, if it is one.
pub(crate) fn text(d: &Document, key: &str) -> Option<String> {
    d.get_str(key).ok().map(str::to_string)
}

/// A stored field read as hostile: its date, if it is one.
pub(crate) fn date(d: &Document, key: &str) -> Option<DateTime> {
    d.get_datetime(key).ok().copied()
}

/// A stored field read as hostile: its integer, of either width.
pub(crate) fn int(d: &Document, key: &str) -> Option<i64> {
    match d.get(key) {
        Some(Bson::Int64(n)) => Some(*n),
        Some(Bson::Int32(n)) => Some(i64::from(*n)),
        _ => None,
    }
}

/// `maxTimeMS` for a limit: whole milliseconds, at least 1 (0 would mean no limit).
pub fn max_time_ms(limit: Duration) -> i64 {
    i64::try_from(limit.as_millis()).unwrap_or(i64::MAX).max(1)
}

/// A time `d` after the server's `now`.
pub fn server_time_in(clock: &ServerClock, d: Duration) -> DateTime {
    lease::add(clock.now(), d)
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::store::backend::{Answering, MongoError, Op, Reply, Written, command_error};

    type Asked<T> = Arc<Mutex<Vec<T>>>;

    fn taken<T: Clone>(asked: &Asked<T>) -> Vec<T> {
        asked.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A store whose finds answer `found` and whose writes match as many; a `listIndexes`
    /// fails as a lost connection does when `list_fails`, else finds no collection. Also
    /// what it was asked: the operations, and each command's name.
    fn store(found: Vec<Document>, list_fails: bool) -> (Store, Asked<Op>, Asked<String>) {
        let (ops, commands): (Asked<Op>, Asked<String>) = Default::default();
        let (asked, named) = (ops.clone(), commands.clone());
        let run = move |op: Op| {
            let n = found.len() as u64;
            let reply = match &op {
                Op::Find { .. } => Reply::Docs(found.clone()),
                Op::Update { .. } => Reply::Written(Written {
                    matched: n,
                    modified: n,
                    ..Written::default()
                }),
                _ => Reply::Written(Written::default()),
            };
            asked.lock().unwrap_or_else(|e| e.into_inner()).push(op);
            Ok(reply)
        };
        let command = move |command: Document| {
            let name = command.keys().next().cloned().unwrap_or_default();
            named
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(name.clone());
            match name.as_str() {
                "listIndexes" if list_fails => Err(MongoError::from(std::io::Error::from(
                    std::io::ErrorKind::ConnectionReset,
                ))),
                "listIndexes" => Err(command_error(26, "NamespaceNotFound", "ns does not exist")),
                _ => Ok(doc! { "ok": 1 }),
            }
        };
        let backend = Arc::new(Answering(run, command));
        let config = MongoConfig::default();
        let store = Store::with_backend(backend, &config, ServerClock::default());
        (store, ops, commands)
    }

    /// Item 9 of issue 25: the reaper's write is bounded on the server. It reads the expired
    /// leases' `_id`s under `maxTimeMS`, at most a batch, and frees them by `_id` with the
    /// expired-lease guard; before, one `updateMany` over the whole expired range ran without
    /// `maxTimeMS` and kept running on a slow server after the reaper gave up on it.
    #[tokio::test]
    async fn the_reaper_reads_ids_under_max_time_then_frees_by_id() {
        let ids = [Bson::Int32(1), Bson::Int32(2)];
        let found = ids.iter().map(|id| doc! { field::ID: id.clone() });
        let (store, ops, _) = store(found.collect(), false);
        assert_eq!(store.reap().await.expect("reap"), 2);
        let ops = taken(&ops);
        let [
            Op::Find {
                filter: read,
                limit,
                max_time,
                ..
            },
            Op::Update {
                filter: write,
                many: true,
                ..
            },
        ] = ops.as_slice()
        else {
            panic!("not a bounded read then a write: {ops:?}");
        };
        assert_eq!(*limit, Some(REAP_BATCH));
        assert_eq!(*max_time, Some(store.server_limit()));
        let clauses = write
            .get_array("$and")
            .expect("an $and of _id and the guard");
        assert_eq!(
            clauses.first(),
            Some(&Bson::Document(doc! { field::ID: { "$in": ids.to_vec() } }))
        );
        // The guard is the read's own filter: a record claimed again since is not freed.
        assert_eq!(clauses.get(1), Some(&Bson::Document(read.clone())));
        assert_eq!(clauses.len(), 2);
    }

    /// The server read its clock somewhere in a round trip of 10 s: the reaper frees no lease
    /// that may still hold on the server, by the earliest its clock can read. Before, it took
    /// leases for expired by the midpoint, 5 s ahead.
    #[tokio::test(start_paused = true)]
    async fn the_reaper_frees_no_lease_the_server_may_still_hold() {
        let (store, ops, _) = store(vec![doc! { field::ID: 1 }], false);
        let server = DateTime::from_millis(1_767_225_600_000);
        let received = Instant::now();
        store
            .clock()
            .observe(server, received - Duration::from_secs(10), received);
        assert_eq!(store.reap().await.expect("reap"), 1);
        let still_held = lease::add(server, Duration::from_secs(2));
        let ops = taken(&ops);
        assert_eq!(ops.len(), 2, "{ops:?}");
        let bound = |d: &Document| {
            let expiry = d.get_document(field::LOCK_EXPIRES_AT).ok()?;
            expiry.get_datetime("$lte").ok().copied()
        };
        let read = match &ops[0] {
            Op::Find { filter, .. } => bound(filter),
            other => panic!("{other:?}"),
        };
        let write = match &ops[1] {
            Op::Update { filter, .. } => filter
                .get_array("$and")
                .ok()
                .and_then(|c| c.get(1))
                .and_then(Bson::as_document)
                .and_then(bound),
            other => panic!("{other:?}"),
        };
        for b in [read, write] {
            assert!(b.is_some_and(|b| b < still_held), "{b:?}");
        }
    }

    /// Nothing expired: no write at all.
    #[tokio::test]
    async fn the_reaper_writes_nothing_when_nothing_expired() {
        let (store, ops, _) = store(Vec::new(), false);
        assert_eq!(store.reap().await.expect("reap"), 0);
        let ops = taken(&ops);
        assert!(matches!(ops.as_slice(), [Op::Find { .. }]), "{ops:?}");
    }

    /// A collection that does not exist yet has no index: all of timeoutd's are created.
    #[tokio::test]
    async fn indexes_are_created_when_the_collection_does_not_exist() {
        let (store, _, commands) = store(Vec::new(), false);
        store.ensure_indexes().await.expect("indexes");
        let commands = taken(&commands);
        let created = commands.iter().filter(|c| *c == "createIndexes").count();
        assert!(created >= 3, "{commands:?}");
    }

    /// A `listIndexes` that failed for another reason (a lost connection) creates nothing
    /// that round: read as "no index", it created indexes beside v7's that serve the same
    /// queries, and never dropped them (issue 25's review).
    #[tokio::test]
    async fn a_failed_index_listing_creates_no_index() {
        let (store, _, commands) = store(Vec::new(), true);
        assert!(store.index_plan().await.is_err());
        assert!(store.ensure_indexes().await.is_err());
        assert_eq!(taken(&commands), ["listIndexes", "listIndexes"]);
    }
}
