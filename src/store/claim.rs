//! The claim: steps 1 to 6 of the lease protocol. Reads the due records of each `Time` shape
//! present (one index range each, see [`crate::record::due`]), merges them by true instant, takes
//! them with the compare-and-swap `updateMany`, and reads back what a racing instance left.

use std::future::IntoFuture;
use std::time::Duration;

use bson::{Bson, DateTime, Document};

use crate::record::{DecodeError, Decoding, TimeoutRecord, field};
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
    /// Each candidate's `_id` and its `Time` as read.
    ids: Vec<(Bson, Bson)>,
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
            ids: ids.into_iter().map(|id| (id, Bson::Null)).collect(),
            more: false,
        }
    }

    /// Whether the read found nothing to take.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Whether more may be claimable once these are given up: the read saw more than it
    /// returned, or returned any.
    pub fn more(&self) -> bool {
        self.more || !self.ids.is_empty()
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
/// task of its own: at once, rather than when the lease runs out.
struct Unclaimed {
    store: Store,
    ids: Vec<Bson>,
    owner: uuid::Uuid,
}

impl Unclaimed {
    fn new(store: &Store, ids: &[Bson], owner: uuid::Uuid) -> Self {
        Self {
            store: store.clone(),
            ids: ids.to_vec(),
            owner,
        }
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
        let (store, ids, owner) = (
            self.store.clone(),
            std::mem::take(&mut self.ids),
            self.owner,
        );
        // Without a runtime (the process is ending) the leases run out on their own.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(crate::host::inherit(async move {
            let release = store.bounded("release an unfinished claim", store.release_many(&ids, owner));
            match release.await {
                Ok(n) => tracing::debug!(%owner, released = n, "released the records of a claim that did not finish"),
                Err(e) => tracing::warn!(%owner, error = %e, "could not release a claim that did not finish; its leases will expire"),
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
        // While a backlog drains, read only about one batch past the last one, or a random
        // slice after meeting a racing instance (see `crate::store::read_window`).
        let slice = crate::host::random_range(0..read_window::SLICES as u64) as i64;
        let range = self.window.range(lease::add(now, look_ahead), slice);
        // Past the due records of the destinations left out, when a read from the start
        // found where the others begin (see `crate::store::paused_head`).
        let from = match (range.from, self.head.start(excluded)) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        // Whole documents (a projection saved nothing measurable on SecantusDB); the take
        // reads back the records it leased, as they are then. One query per shape, each oldest first by its own index, merged by true instant.
        let reads = shapes.iter().map(|shape| {
            store
                .coll
                .find(lease::due_within_except(
                    now,
                    from,
                    range.to,
                    std::slice::from_ref(shape),
                    excluded,
                ))
                .sort(shape.sort())
                .limit(i64::from(batch_size))
                .max_time(self.store.server_limit())
        });
        let mut found: Vec<(DateTime, Document)> = Vec::new();
        for docs in Store::timed(
            "find",
            futures::future::try_join_all(reads.map(IntoFuture::into_future)),
        )
        .await?
        {
            found.extend(docs.into_iter().map(|d| {
                // A record the decoder rejects still joins the batch (to be parked), at the
                // end of the range it matched.
                let due = TimeoutRecord::decode_due(&d, store.encoding).unwrap_or(range.to);
                (due, d)
            }));
        }
        found.sort_by_key(|(due, _)| due.timestamp_millis());
        found.truncate(batch_size as usize);
        let dues: Vec<DateTime> = found.iter().map(|(due, _)| *due).collect();
        self.head
            .update(excluded, from, now, dues.first().copied(), range.to);
        let more = self
            .window
            .update(&range, &dues, found.len() >= batch_size as usize);
        let ids = found
            .iter()
            .map(|(_, d)| d)
            .filter_map(|d| {
                let time = d.get(field::TIME).cloned().unwrap_or(Bson::Null);
                d.get(field::ID).cloned().map(|id| (id, time))
            })
            .collect();
        Ok(Candidates {
            horizon: range.to,
            shapes,
            excluded: excluded.to_vec(),
            ids,
            more,
        })
    }

    /// Steps 2 to 6 of a claim: takes the `candidates` still claimable now under a fresh
    /// owner and a lease from now, with the compare-and-swap `updateMany`, and reads back
    /// the records it leased as they are now: each is scheduled by the `Time` read back.
    pub async fn take(
        &self,
        candidates: Candidates,
        lease_len: Duration,
    ) -> Result<Claim, StoreError> {
        let Candidates {
            horizon,
            shapes,
            excluded,
            ids: as_read,
            more: windowed_more,
        } = candidates;
        let found_count = as_read.len();
        let store = &self.store;
        let now = store.clock.now();
        let lease = Lease::new(now, lease_len);
        if as_read.is_empty() {
            return Ok(Claim {
                lease,
                rows: Vec::new(),
                more: windowed_more,
                read: 0,
            });
        }
        let candidates: Vec<Bson> = as_read.iter().map(|(id, _)| id.clone()).collect();
        // From here until the rows are handed over, records may be leased to this owner: if
        // this future is dropped (its caller's deadline) or fails, they are freed at once.
        let mut unclaimed = Unclaimed::new(store, &candidates, lease.owner);
        let taken = Store::timed(
            "claim",
            store
                .coll
                .update_many(
                    lease::except(
                        lease::claim_filter(now, horizon, &shapes, &as_read),
                        &excluded,
                    ),
                    lease::claim_update(&lease, store.uuids),
                )
                .into_future(),
        )
        .await;
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

    async fn read_back(
        &self,
        candidates: &[Bson],
        lease: &Lease,
    ) -> Result<Vec<ClaimedRow>, crate::store::backend::MongoError> {
        let store = &self.store;
        let docs: Vec<Document> = store
            .coll
            .find(lease::held_many(candidates, lease.owner, store.clock.now()))
            .max_time(self.store.server_limit())
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
