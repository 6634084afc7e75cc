//! The store: the ServiceConnect `Timeouts` collection in MongoDB.
//!
//! Runs the queries that [`lease`] defines: claim a batch ([`claim`]), remove or release what a
//! claim holds, reap expired leases, insert for `schedule`. It only ever `$set`s the three lock
//! fields of an existing record and deletes by `_id`. [`Store`] is the handle on the
//! collections and nothing else: the state of other concerns (pauses, the census's memory) is
//! kept by them and handed in.

pub mod backend;
pub mod backlog;
pub mod claim;
pub mod clock;
pub mod driver;
pub mod durability;
pub mod head;
pub mod history;
pub mod indexes;
pub mod lease;
pub mod parking;
pub mod serverload;
pub mod shapes;
pub mod window;

use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Duration;

use bson::{Bson, DateTime, Document, doc};
use futures::TryStreamExt;
use mongodb::change_stream::event::ChangeStreamEvent;
use mongodb::options::{Acknowledgment, ClientOptions};
use mongodb::{Client, Collection, Database};
use uuid::Uuid;

use crate::config::{MongoConfig, TimeEncoding, UuidRepresentation};
use crate::record::due::Shape;
use crate::record::{Decoding, TimeoutRecord, field};
use crate::store::clock::ServerClock;
use crate::store::shapes::ShapeCache;
use crate::store::window::ReadWindow;

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
}

/// A handle on the `Timeouts` collection; cheap to clone.
#[derive(Debug, Clone)]
pub struct Store {
    pub(crate) db: Database,
    pub(crate) coll: Collection<Document>,
    pub(crate) parked: Collection<Document>,
    pub(crate) attempts: Collection<Document>,
    /// timeoutd's control collection: pauses, ramps and the audit of operator actions.
    pub(crate) control: Collection<Document>,
    pub(crate) encoding: TimeEncoding,
    pub(crate) uuids: UuidRepresentation,
    pub(crate) decoding: Decoding,
    pub(crate) clock: ServerClock,
    pub(crate) window: Arc<ReadWindow>,
    /// Where claims start reading while destinations are left out ([`crate::store::head`]).
    pub(crate) head: Arc<crate::store::head::PausedHead>,
    lock_lease: Duration,
    pub(crate) shapes: Arc<ShapeCache>,
    /// Deadline of every single call ([`Store::bounded`]).
    op_timeout: Duration,
    /// `[history] keep` is set: fired, parked and cancelled timeouts are recorded.
    pub(crate) history_on: bool,
    /// The write concern and read preference the URI set, for [`Store::durability_risks`].
    write_concern: Option<mongodb::options::WriteConcern>,
    selection: Option<mongodb::options::SelectionCriteria>,
}

impl Store {
    /// Parses the URI and builds a client. Refuses an unacknowledged write concern. The
    /// driver connects lazily; [`Store::refresh_clock`] is the first round trip.
    pub async fn connect(config: &MongoConfig, clock: ServerClock) -> Result<Self, StoreError> {
        let mut options = ClientOptions::parse(&config.uri)
            .await
            .map_err(|e| StoreError::InvalidUri(crate::redact::redact_text(&e.kind.to_string())))?;
        if let Some(wc) = &options.write_concern
            && wc.w == Some(Acknowledgment::Nodes(0))
        {
            return Err(StoreError::UnacknowledgedWriteConcern);
        }
        if config.tls_ca_file.is_some() || config.tls_certificate_key_file.is_some() {
            let mut tls = match options.tls.take() {
                Some(mongodb::options::Tls::Enabled(t)) => t,
                _ => mongodb::options::TlsOptions::default(),
            };
            if let Some(ca) = &config.tls_ca_file {
                tls.ca_file_path = Some(ca.clone());
            }
            if let Some(cert_key) = &config.tls_certificate_key_file {
                tls.cert_key_file_path = Some(cert_key.clone());
            }
            options.tls = Some(mongodb::options::Tls::Enabled(tls));
        }
        if options.app_name.is_none() {
            options.app_name = Some("timeoutd".into());
        }
        if options.server_selection_timeout.is_none() {
            options.server_selection_timeout = Some(Duration::from_secs(10));
        }
        let (write_concern, selection) = (
            options.write_concern.clone(),
            options.selection_criteria.clone(),
        );
        let client = Client::with_options(options)?;
        let db = client.database(&config.database);
        let coll = db.collection::<Document>(&config.collection);
        let parked = db.collection::<Document>(&config.parked_collection());
        let attempts = db.collection::<Document>(&config.attempts_collection());
        let control = db.collection::<Document>(&config.control_collection());
        Ok(Self {
            db,
            coll,
            parked,
            attempts,
            control,
            encoding: config.time_encoding,
            uuids: config.uuid_representation,
            decoding: Decoding::from(config.time_encoding),
            clock,
            window: Arc::new(ReadWindow::default()),
            head: Arc::default(),
            lock_lease: crate::config::DispatchConfig::default().lock_lease,
            shapes: Arc::new(ShapeCache::default()),
            op_timeout: config.operation_timeout,
            history_on: false,
            write_concern,
            selection,
        })
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

    /// How records are decoded.
    pub fn decoding(&self) -> Decoding {
        self.decoding
    }

    /// The GUID representation the lease fields and `schedule` write.
    pub fn uuid_representation(&self) -> UuidRepresentation {
        self.uuids
    }

    /// The parking collection and the failed-send counts that go with this store.
    /// Ends the client's server sessions and stops its background tasks, within `within`.
    /// Call before the async runtime ends: otherwise the client's drop spawns an
    /// `endSessions` task that can race the runtime's shutdown, and the driver panics
    /// (`connection_requester.rs:42`, a send to its connection pool's stopped worker).
    /// Returns false when the deadline passed; the client is then leaked on purpose, so no
    /// drop spawns that task (the process is about to exit).
    pub async fn close(&self, within: Duration) -> bool {
        let client = self.db.client().clone();
        let closing = async {
            crate::service::shutdown::stall().await;
            client.clone().shutdown().await
        };
        if tokio::time::timeout(within, closing).await.is_ok() {
            return true;
        }
        std::mem::forget(client);
        false
    }

    pub fn parking(&self) -> crate::store::parking::Parking {
        crate::store::parking::Parking::new(
            self.coll.clone(),
            self.parked.clone(),
            self.attempts.clone(),
            self.clock.clone(),
            self.server_limit(),
        )
    }

    /// Runs one store call under `[mongodb] operation_timeout`: a server that stops answering
    /// becomes a [`StoreError::Deadline`] naming the call, never a wait without end.
    /// Counted in `timeoutd_mongodb_calls_in_flight` until it returns, or, when dropped (its
    /// deadline, shutdown), until the server's `maxTimeMS` has ended it
    /// ([`crate::store::serverload`]).
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
        // The largest maxTimeMS a server takes (an int32 of milliseconds), about 24.8 days.
        self.op_timeout.clamp(
            Duration::from_millis(1),
            Duration::from_millis(i32::MAX as u64),
        )
    }

    /// `[mongodb] operation_timeout`.
    pub fn operation_timeout(&self) -> Duration {
        self.op_timeout
    }

    /// A database command with its `maxTimeMS` ([`Store::server_limit`]).
    pub(crate) fn command(&self, mut command: Document) -> Document {
        command.insert("maxTimeMS", max_time_ms(self.server_limit()));
        command
    }

    /// One driver call under `[mongodb] operation_timeout`, its error made a [`StoreError`]:
    /// the bound of every single query the store's own methods make.
    pub(crate) async fn query<T>(
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
        let started = tokio::time::Instant::now();
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
        let hello = self
            .db
            .run_command(self.command(doc! { "hello": 1 }))
            .await?;
        Ok(crate::store::durability::risks(
            &hello,
            self.write_concern.as_ref(),
            self.selection.as_ref(),
        ))
    }

    /// Reads the server's clock (`hello.localTime`) and updates the offset estimate. Takes
    /// the sample with the shortest round trip of three, so that a first call that also opens
    /// the connection does not skew it. Also the cheapest check that the server answers.
    pub async fn refresh_clock(&self) -> Result<i64, StoreError> {
        let mut best: Option<(
            Duration,
            DateTime,
            tokio::time::Instant,
            tokio::time::Instant,
        )> = None;
        for _ in 0..3 {
            let sent = tokio::time::Instant::now();
            let reply = self
                .db
                .run_command(self.command(doc! { "hello": 1 }))
                .await?;
            let received = tokio::time::Instant::now();
            let server = *reply
                .get_datetime("localTime")
                .map_err(|_| StoreError::NoServerTime)?;
            let rtt = received.saturating_duration_since(sent);
            if best.is_none_or(|(b, ..)| rtt < b) {
                best = Some((rtt, server, sent, received));
            }
        }
        let (_, server, sent, received) = best.ok_or(StoreError::NoServerTime)?;
        Ok(self.clock.observe(server, sent, received))
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
        Ok(r.deleted_count)
    }

    /// Of `ids`, those still in the collection (to name the lost leases after a short delete).
    pub async fn existing(&self, ids: &[Bson]) -> Result<Vec<Bson>, StoreError> {
        let docs: Vec<Document> = self
            .coll
            .find(doc! { field::ID: { "$in": ids } })
            .projection(doc! { field::ID: 1 })
            .max_time(self.server_limit())
            .await?
            .try_collect()
            .await?;
        Ok(crate::record::ids_of(docs))
    }

    /// Frees one record if `owner` still holds it; `false` means the lease was lost.
    pub async fn release_one(&self, id: &Bson, owner: Uuid) -> Result<bool, StoreError> {
        self.head.forget();
        let r = self
            .coll
            .update_one(
                lease::held_one(id, owner, self.clock.now()),
                lease::release_update(self.uuids),
            )
            .await?;
        Ok(r.matched_count == 1)
    }

    /// Frees those of `ids` that `owner` still holds; returns how many.
    pub async fn release_many(&self, ids: &[Bson], owner: Uuid) -> Result<u64, StoreError> {
        if ids.is_empty() {
            return Ok(0);
        }
        // Freed records may be due before where claims start reading now.
        self.head.forget();
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
        Ok(r.matched_count)
    }

    /// Frees every expired lease; returns how many.
    pub async fn reap(&self) -> Result<u64, StoreError> {
        let r = self
            .coll
            .update_many(
                lease::expired(self.clock.now()),
                lease::release_update(self.uuids),
            )
            .await?;
        if r.modified_count > 0 {
            self.head.forget();
        }
        Ok(r.modified_count)
    }

    /// A change stream of the inserts into the collection (for [`crate::dispatch::wakeup`]).
    pub async fn watch_inserts(
        &self,
    ) -> Result<mongodb::change_stream::ChangeStream<ChangeStreamEvent<Document>>, StoreError> {
        Ok(self
            .coll
            .watch()
            .pipeline([doc! { "$match": { "operationType": "insert" } }])
            .await?)
    }

    /// Inserts one free record in ServiceConnect's shape, GUIDs in the configured
    /// representation. With `time_encoding = "auto"`, `Time` takes the shape the collection
    /// already holds (`[ticks, 0]` when it holds only those, else a date).
    pub async fn insert(&self, record: &TimeoutRecord) -> Result<(), StoreError> {
        let encoding = match self.encoding {
            TimeEncoding::Auto => {
                let shapes = self.learn_shapes().await?;
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

    /// The `Time` shapes the due query covers now (learned from the collection, refreshed in
    /// the background; see [`crate::store::shapes`]).
    pub async fn shapes(&self) -> Result<Vec<Shape>, StoreError> {
        self.shapes.current(self).await
    }

    /// Learns the `Time` shapes from the collection now, and keeps them.
    pub async fn learn_shapes(&self) -> Result<Vec<Shape>, StoreError> {
        self.shapes.learn(self).await
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
