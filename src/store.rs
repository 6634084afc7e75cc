//! The store: the ServiceConnect `Timeouts` collection in MongoDB.
//!
//! Runs the queries that [`crate::lease`] defines: claim a batch, remove or release what a
//! claim holds, reap expired leases, count for `stats`, insert for `schedule`. It only ever
//! `$set`s the three lock fields of an existing record and deletes by `_id`.

use std::sync::Arc;
use std::time::Duration;

use bson::{Bson, DateTime, Document, doc};
use futures::TryStreamExt;
use mongodb::change_stream::event::ChangeStreamEvent;
use mongodb::options::{Acknowledgment, ClientOptions, IndexOptions};
use mongodb::{Client, Collection, Database, IndexModel};
use serde::Serialize;
use uuid::Uuid;

use crate::clock::ServerClock;
use crate::config::{MongoConfig, TimeEncoding};
use crate::lease::{self, Lease};
use crate::record::{DecodeError, TimeoutRecord, field};
use crate::window::{self, ReadWindow};

/// Index names timeoutd creates. They never reuse ServiceConnect's names or key patterns.
pub const DUE_INDEX: &str = "timeoutd_due";
pub const LEASE_INDEX: &str = "timeoutd_lease";
pub const OWNER_INDEX: &str = "timeoutd_owner";

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
}

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
    fn read(raw: Document, encoding: TimeEncoding) -> Self {
        Self {
            id: raw.get(field::ID).cloned().unwrap_or(Bson::Null),
            record: TimeoutRecord::decode(&raw, encoding),
            raw,
        }
    }

    /// A row read before the claim that the claim took: its lease fields as the claim set them.
    fn held(mut raw: Document, lease: &Lease, encoding: TimeEncoding) -> Self {
        raw.extend(lease::leased_fields(lease));
        Self::read(raw, encoding)
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
}

/// Counts for `timeoutd stats`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Stats {
    /// Records not due yet and not leased.
    pub pending: u64,
    /// Due records any worker may claim now (free, or leased with an expired lease).
    pub due: u64,
    /// Records under a live lease.
    pub leased: u64,
    /// Records whose lease has expired and that the reaper has not freed yet.
    pub expired_leases: u64,
    /// Age of the oldest due record, leased or not, in seconds; `None` when nothing is due.
    pub oldest_due_age_seconds: Option<f64>,
    /// Records in the parking collection.
    pub parked: u64,
    /// Records with failed sends counted (waiting for a retry, or sent in the end).
    pub retrying: u64,
}

/// A handle on the `Timeouts` collection; cheap to clone.
#[derive(Debug, Clone)]
pub struct Store {
    db: Database,
    coll: Collection<Document>,
    parked: Collection<Document>,
    attempts: Collection<Document>,
    encoding: TimeEncoding,
    clock: ServerClock,
    window: Arc<ReadWindow>,
}

impl Store {
    /// Parses the URI and builds a client. Refuses an unacknowledged write concern. The
    /// driver connects lazily; [`Store::refresh_clock`] is the first round trip.
    pub async fn connect(config: &MongoConfig, clock: ServerClock) -> Result<Self, StoreError> {
        let mut options = ClientOptions::parse(&config.uri)
            .await
            .map_err(|e| StoreError::InvalidUri(crate::config::redact_uri(&e.kind.to_string())))?;
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
        let client = Client::with_options(options)?;
        let db = client.database(&config.database);
        let coll = db.collection::<Document>(&config.collection);
        let parked = db.collection::<Document>(&config.parked_collection());
        let attempts = db.collection::<Document>(&config.attempts_collection());
        Ok(Self {
            db,
            coll,
            parked,
            attempts,
            encoding: config.time_encoding,
            clock,
            window: Arc::new(ReadWindow::default()),
        })
    }

    /// The parking collection and the failed-send counts that go with this store.
    pub fn parking(&self) -> crate::parking::Parking {
        crate::parking::Parking::new(
            self.coll.clone(),
            self.parked.clone(),
            self.attempts.clone(),
            self.clock.clone(),
        )
    }

    /// The clock this store stamps leases with.
    pub fn clock(&self) -> &ServerClock {
        &self.clock
    }

    /// The `Time` encoding of the collection.
    pub fn encoding(&self) -> TimeEncoding {
        self.encoding
    }

    /// Reads the server's clock (`hello.localTime`) and updates the offset estimate. Takes
    /// the sample with the shortest round trip of three, so that a first call that also opens
    /// the connection does not skew it. Also the cheapest check that the server answers.
    pub async fn refresh_clock(&self) -> Result<i64, StoreError> {
        let mut best: Option<(i64, DateTime, i64, i64)> = None;
        for _ in 0..3 {
            let sent = self.clock.local_ms();
            let reply = self.db.run_command(doc! { "hello": 1 }).await?;
            let received = self.clock.local_ms();
            let server = *reply
                .get_datetime("localTime")
                .map_err(|_| StoreError::NoServerTime)?;
            let rtt = received - sent;
            if best.is_none_or(|(b, ..)| rtt < b) {
                best = Some((rtt, server, sent, received));
            }
        }
        let (_, server, sent, received) = best.ok_or(StoreError::NoServerTime)?;
        Ok(self.clock.observe(server, sent, received))
    }

    /// Creates timeoutd's own indexes if missing: the due key (so the due query scans only
    /// due records, oldest first), the lease fields (reaper) and the owner (read-back).
    pub async fn ensure_indexes(&self) -> Result<(), StoreError> {
        let indexes = [
            (DUE_INDEX, doc! { lease::due_sort_key(self.encoding): 1 }),
            (
                LEASE_INDEX,
                doc! { field::LOCKED: 1, field::LOCK_EXPIRES_AT: 1 },
            ),
            (OWNER_INDEX, doc! { field::LOCKED_BY: 1 }),
        ];
        for (name, keys) in indexes {
            let model = IndexModel::builder()
                .keys(keys.clone())
                .options(IndexOptions::builder().name(name.to_string()).build())
                .build();
            if let Err(e) = self.coll.create_index(model).await {
                // An index with the same keys under another name serves as well.
                tracing::warn!(index = name, keys = %keys, error = %e, "could not create index; continuing");
            }
        }
        Ok(())
    }

    /// Claims up to `batch_size` due records, oldest first, under a fresh owner. Steps 1 to 6
    /// of the lease protocol: candidates, compare-and-swap `updateMany`, read back.
    pub async fn claim(&self, batch_size: u32, lease_len: Duration) -> Result<Claim, StoreError> {
        self.claim_window(batch_size, lease_len, Duration::ZERO)
            .await
    }

    /// [`Store::claim`] for records due within `look_ahead` from now as well; they are held
    /// under the lease until their due instant.
    ///
    /// Alone, an instance takes the oldest due records. After a claim that lost records to a
    /// racing instance it reads a random slice of the backlog instead, so that concurrent
    /// claims mostly take different records ([`crate::window`]).
    pub async fn claim_window(
        &self,
        batch_size: u32,
        lease_len: Duration,
        look_ahead: Duration,
    ) -> Result<Claim, StoreError> {
        let now = self.clock.now();
        let lease = Lease::new(now, lease_len);
        // While a backlog drains, read only about one batch past the last one, or a random
        // slice after meeting a racing instance (see `crate::window`).
        let slice = rand::random_range(0..window::SLICES);
        let range = self.window.range(lease::add(now, look_ahead), slice);
        // Whole documents: when the compare-and-swap takes every candidate they are the batch.
        let found: Vec<Document> = self
            .coll
            .find(lease::due_within(now, range.from, range.to, self.encoding))
            .sort(doc! { lease::due_sort_key(self.encoding): 1 })
            .limit(i64::from(batch_size))
            .await?
            .try_collect()
            .await?;
        let found_count = found.len();
        let dues: Vec<DateTime> = found
            .iter()
            .filter_map(|d| TimeoutRecord::decode_due(d, self.encoding))
            .collect();
        let windowed_more = self
            .window
            .update(&range, &dues, found_count >= batch_size as usize);
        let candidates: Vec<Bson> = found
            .iter()
            .filter_map(|d| d.get(field::ID).cloned())
            .collect();
        if candidates.is_empty() {
            return Ok(Claim {
                lease,
                rows: Vec::new(),
                more: windowed_more,
            });
        }
        let taken = self
            .coll
            .update_many(
                lease::claim_filter(now, range.to, self.encoding, &candidates),
                lease::claim_update(&lease),
            )
            .await;
        if let Ok(r) = &taken
            && r.modified_count < candidates.len() as u64
        {
            self.window.raced();
        }
        let rows = match taken {
            Ok(r) if r.modified_count == 0 => Ok(Vec::new()),
            // Every candidate matched the compare-and-swap, so every one is now under this
            // lease: the documents read are the batch (ServiceConnect changes only the lease
            // fields of a stored record), and the read-back is skipped.
            Ok(r) if r.modified_count == candidates.len() as u64 => Ok(found
                .into_iter()
                .map(|d| ClaimedRow::held(d, &lease, self.encoding))
                .collect()),
            // A racing instance took some: read back which are ours.
            Ok(_) => self.read_back(&candidates, &lease).await,
            Err(e) => Err(e),
        };
        match rows {
            Ok(rows) => Ok(Claim {
                more: windowed_more || found_count > rows.len(),
                lease,
                rows,
            }),
            Err(e) => {
                // Between the update and the read-back: free what we may hold, best effort.
                if let Err(release_err) = self.release_many(&candidates, lease.owner).await {
                    tracing::warn!(owner = %lease.owner, error = %release_err, "could not release a failed claim; its leases will expire");
                }
                Err(e.into())
            }
        }
    }

    async fn read_back(
        &self,
        candidates: &[Bson],
        lease: &Lease,
    ) -> Result<Vec<ClaimedRow>, mongodb::error::Error> {
        let docs: Vec<Document> = self
            .coll
            .find(lease::held_many(candidates, lease.owner, self.clock.now()))
            .sort(doc! { lease::due_sort_key(self.encoding): 1 })
            .await?
            .try_collect()
            .await?;
        Ok(docs
            .into_iter()
            .map(|d| ClaimedRow::read(d, self.encoding))
            .collect())
    }

    /// Deletes the given records that `owner` still holds under a live lease; returns how
    /// many were deleted. Fewer than `ids.len()` means some leases were lost.
    pub async fn remove_held(&self, ids: &[Bson], owner: Uuid) -> Result<u64, StoreError> {
        if ids.is_empty() {
            return Ok(0);
        }
        let r = self
            .coll
            .delete_many(lease::held_many(ids, owner, self.clock.now()))
            .await?;
        Ok(r.deleted_count)
    }

    /// Of `ids`, those still in the collection (to name the lost leases after a short delete).
    pub async fn existing(&self, ids: &[Bson]) -> Result<Vec<Bson>, StoreError> {
        let docs: Vec<Document> = self
            .coll
            .find(doc! { field::ID: { "$in": ids } })
            .projection(doc! { field::ID: 1 })
            .await?
            .try_collect()
            .await?;
        Ok(crate::record::ids_of(docs))
    }

    /// Frees one record if `owner` still holds it; `false` means the lease was lost.
    pub async fn release_one(&self, id: &Bson, owner: Uuid) -> Result<bool, StoreError> {
        let r = self
            .coll
            .update_one(
                lease::held_one(id, owner, self.clock.now()),
                lease::release_update(),
            )
            .await?;
        Ok(r.matched_count == 1)
    }

    /// Frees those of `ids` that `owner` still holds; returns how many.
    pub async fn release_many(&self, ids: &[Bson], owner: Uuid) -> Result<u64, StoreError> {
        if ids.is_empty() {
            return Ok(0);
        }
        let r = self
            .coll
            .update_many(
                lease::held_many(ids, owner, self.clock.now()),
                lease::release_update(),
            )
            .await?;
        Ok(r.matched_count)
    }

    /// Frees every expired lease; returns how many.
    pub async fn reap(&self) -> Result<u64, StoreError> {
        let r = self
            .coll
            .update_many(lease::expired(self.clock.now()), lease::release_update())
            .await?;
        Ok(r.modified_count)
    }

    /// The backlog gauges: due and claimable records, and the age of the oldest due one.
    /// Cheap: both queries are bounded by the due records, not by the future ones.
    pub async fn backlog(&self) -> Result<(u64, Option<f64>), StoreError> {
        let now = self.clock.now();
        let due = self
            .coll
            .count_documents(lease::due_filter(now, self.encoding))
            .await?;
        Ok((due, self.oldest_due_age(now).await?))
    }

    async fn oldest_due_age(&self, now: DateTime) -> Result<Option<f64>, StoreError> {
        let oldest = self
            .coll
            .find_one(lease::due_by(now, self.encoding))
            .sort(doc! { lease::due_sort_key(self.encoding): 1 })
            .await?;
        Ok(oldest
            .and_then(|d| TimeoutRecord::decode_due(&d, self.encoding))
            .map(|due| (now.timestamp_millis() - due.timestamp_millis()).max(0) as f64 / 1000.0))
    }

    /// A change stream of the inserts into the collection (for [`crate::wakeup`]).
    pub async fn watch_inserts(
        &self,
    ) -> Result<mongodb::change_stream::ChangeStream<ChangeStreamEvent<Document>>, StoreError> {
        Ok(self
            .coll
            .watch()
            .pipeline([doc! { "$match": { "operationType": "insert" } }])
            .await?)
    }

    /// Counts for operators.
    pub async fn stats(&self) -> Result<Stats, StoreError> {
        let now = self.clock.now();
        let not_due = lease::all_of([
            lease::due_after(now, self.encoding),
            doc! { field::LOCKED: false },
        ]);
        let due = self
            .coll
            .count_documents(lease::due_filter(now, self.encoding));
        let pending = self.coll.count_documents(not_due);
        let leased = self.coll.count_documents(lease::held_any(now));
        let expired = self.coll.count_documents(lease::expired(now));
        let parking = self.parking();
        let (due, pending, leased, expired, parked, retrying) = tokio::try_join!(
            async { due.await.map_err(StoreError::from) },
            async { pending.await.map_err(StoreError::from) },
            async { leased.await.map_err(StoreError::from) },
            async { expired.await.map_err(StoreError::from) },
            parking.count(),
            parking.count_retrying(),
        )?;
        let oldest_due_age_seconds = self.oldest_due_age(now).await?;
        Ok(Stats {
            pending,
            due,
            leased,
            expired_leases: expired,
            oldest_due_age_seconds,
            parked,
            retrying,
        })
    }

    /// Inserts one free record in ServiceConnect's shape.
    pub async fn insert(&self, record: &TimeoutRecord) -> Result<(), StoreError> {
        self.coll
            .insert_one(record.to_document(self.encoding))
            .await?;
        Ok(())
    }
}

/// A time `d` after the server's `now`.
pub fn server_time_in(clock: &ServerClock, d: Duration) -> DateTime {
    lease::add(clock.now(), d)
}
