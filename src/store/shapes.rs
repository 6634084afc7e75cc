//! Which `Time` shapes the collection holds, so that the due query has one branch per shape
//! present and no more ([`crate::record::due`]).
//!
//! Learned with index-served reads: whether any date-shaped `Time` exists (a read of the date
//! index), and `distinct("Time.1")`, the offsets of the `[ticks, offset]` records (MongoDB
//! answers it from the `{"Time.1": 1, "Time.0": 1}` index with a DISTINCT_SCAN, one seek per
//! distinct offset). Every [`REFRESH`] a background probe asks whether a record of a shape
//! not yet known exists (`"Time.1": {$nin: known}`, one index seek on MongoDB) and learns the
//! set again only then, or every [`FULL_REFRESH`] (to drop offsets no record holds any
//! more). A claim never waits for this except the first. A record whose offset no other
//! record had (a new time zone, a DST change) is served from the next probe: it fires at its
//! instant when it was written at least `REFRESH` ahead of it.
//!
//! One learner, two ways to ask it. The claim path asks [`ShapeCache::current`], which waits
//! only for the first learn and probes in the background. The monitor
//! ([`crate::store::backlog`]) asks [`ShapeCache::checked`], which waits for the probe (or the
//! learn every [`FULL_REFRESH`]) at every reading and fails the reading when a query fails:
//! a reading then counts a record of a new shape at once, and never reports a count over
//! shapes it could not check. The monitor keeps an instance of its own, not the claim path's:
//! a cache wedged on the claim path (issue 19: it knew no shape, every claim read nothing)
//! must not make the backlog read zero too, or nothing would show the wedge.

use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use bson::{Bson, Document, doc};

use crate::config::TimeEncoding;
use crate::record::due::{self, Shape};
use crate::record::field;
use crate::store::{Store, StoreError};

/// How often a background probe looks for records of a shape not yet known.
pub const REFRESH: Duration = Duration::from_secs(2);
/// How often the set is learned again while it is empty.
pub const REFRESH_WHILE_EMPTY: Duration = Duration::from_millis(200);
/// How often the whole set is learned again.
pub const FULL_REFRESH: Duration = Duration::from_secs(60);

/// The learned shapes, shared by the clones of a store.
#[derive(Debug, Default)]
pub struct ShapeCache {
    state: Mutex<State>,
    /// Held by the one learn or probe that runs, for as long as it runs: its guard lives in
    /// the task that runs it (never in a caller's future, which a deadline can drop halfway),
    /// so it is free again whatever becomes of that task, even when it panics.
    busy: Arc<tokio::sync::Mutex<()>>,
}

#[derive(Debug, Default)]
struct State {
    shapes: Option<Vec<Shape>>,
    /// Every `"Time.1"` value seen, servable or not: what the probe need not find again.
    offsets_seen: Vec<Bson>,
    probed_at: Option<Instant>,
    learned_at: Option<Instant>,
}

impl ShapeCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The shapes to query now. The first call (and any call while none is known) learns
    /// them; later ones start a background probe once the last is older than [`REFRESH`].
    ///
    /// A learn runs in a task of its own, which the caller awaits: a caller dropped halfway
    /// (its own deadline fired first) leaves the learn to finish under its queries' own
    /// deadlines and keep what it read. (Run in the caller's future, a learn dropped between
    /// its two queries left the cache marked as refreshing for good, and every later claim
    /// read no shape and took nothing.)
    pub async fn current(self: &Arc<Self>, store: &Store) -> Result<Vec<Shape>, StoreError> {
        if store.encoding == TimeEncoding::Date {
            return Ok(vec![Shape::Date]);
        }
        let (known, stale, learned_at) = {
            let s = self.lock();
            // While none is known (an empty collection), look again more often, so that the
            // first records inserted fire on time.
            let every = match &s.shapes {
                Some(shapes) if shapes.is_empty() => REFRESH_WHILE_EMPTY,
                _ => REFRESH,
            };
            let stale = s.probed_at.is_none_or(|t| t.elapsed() >= every);
            (s.shapes.clone(), stale, s.learned_at)
        };
        match known {
            Some(shapes) if !shapes.is_empty() => {
                // A probe in the background; none while one still runs.
                if stale && let Ok(busy) = self.busy.clone().try_lock_owned() {
                    let (cache, store) = (self.clone(), store.clone());
                    crate::host::spawn(async move {
                        let _busy = busy;
                        if let Err(e) = cache.refresh(&store).await {
                            tracing::debug!(error = %e, "could not refresh the Time shapes; keeping the last ones");
                        }
                    });
                }
                Ok(shapes)
            }
            Some(none) if !stale => Ok(none),
            // Nothing known yet: learn before claiming, one learn at a time.
            _ => {
                let busy = self.busy.clone().lock_owned().await;
                // A learn that ran while this call waited has just read the collection.
                {
                    let s = self.lock();
                    if s.learned_at != learned_at
                        && let Some(shapes) = &s.shapes
                    {
                        return Ok(shapes.clone());
                    }
                }
                let (cache, store) = (self.clone(), store.clone());
                alone(busy, async move { cache.learn(&store).await }).await
            }
        }
    }

    /// The shapes as the collection holds them now, for the monitor: a probe for a shape not
    /// known yet at every call, and a learn when it finds one, when the set is older than
    /// [`FULL_REFRESH`] or when none was learned yet (the same [`ShapeCache::refresh`] the
    /// claim path runs in the background, awaited here). A failed query fails the call and
    /// keeps the last shapes. Like a learn, it runs in a task of its own holding `busy`: a
    /// caller dropped halfway leaves it to finish.
    pub async fn checked(self: &Arc<Self>, store: &Store) -> Result<Vec<Shape>, StoreError> {
        if store.encoding == TimeEncoding::Date {
            return Ok(vec![Shape::Date]);
        }
        let busy = self.busy.clone().lock_owned().await;
        let (cache, store) = (self.clone(), store.clone());
        alone(busy, async move {
            cache.refresh(&store).await?;
            Ok(cache.lock().shapes.clone().unwrap_or_default())
        })
        .await
    }

    /// Learns the set again when it is older than [`FULL_REFRESH`] or a probe finds a record
    /// of a shape not in it.
    async fn refresh(&self, store: &Store) -> Result<(), StoreError> {
        let (shapes, seen, learned_at) = {
            let s = self.lock();
            (
                s.shapes.clone().unwrap_or_default(),
                s.offsets_seen.clone(),
                s.learned_at,
            )
        };
        if learned_at.is_none_or(|t| t.elapsed() >= FULL_REFRESH)
            || Store::timed("shapes", probe_finds_new(store, &shapes, seen)).await?
        {
            self.learn(store).await?;
        } else {
            self.lock().probed_at = Some(Instant::now());
        }
        Ok(())
    }

    /// Reads the shapes present from the collection and keeps them.
    pub async fn learn(&self, store: &Store) -> Result<Vec<Shape>, StoreError> {
        let learned = Store::timed("shapes", read_shapes(store)).await;
        let mut s = self.lock();
        if let Ok((shapes, seen)) = &learned {
            if s.shapes.as_ref() != Some(shapes) {
                tracing::debug!(shapes = ?shapes, "Time shapes in the timeouts collection");
            }
            s.shapes = Some(shapes.clone());
            s.offsets_seen = seen.clone();
            s.learned_at = Some(Instant::now());
            s.probed_at = s.learned_at;
        }
        learned.map(|(shapes, _)| shapes)
    }
}

/// Runs `work` in a task of its own that holds `busy` until it ends, and awaits it.
async fn alone<T: Send + 'static>(
    busy: tokio::sync::OwnedMutexGuard<()>,
    work: impl std::future::Future<Output = Result<T, StoreError>> + Send + 'static,
) -> Result<T, StoreError> {
    let task = crate::host::spawn(async move {
        let _busy = busy;
        work.await
    });
    match task.await {
        Ok(done) => done,
        Err(e) => Err(StoreError::Panicked(format!(
            "learning the Time shapes: {e}"
        ))),
    }
}

/// Whether a record of a shape not in `shapes` exists: a date when none is known, or an
/// offset within +-14 h that is not among `seen`.
async fn probe_finds_new(
    store: &Store,
    shapes: &[Shape],
    seen: Vec<Bson>,
) -> Result<bool, StoreError> {
    if store.encoding.reads_dates() && !shapes.contains(&Shape::Date) && any_date(store).await? {
        return Ok(true);
    }
    if store.encoding.reads_ticks() {
        let new_offset = store
            .query(
                store
                    .coll
                    .find_one(doc! { field::TIME_OFFSET: { "$in": unseen_offsets(&seen) } })
                    .projection(doc! { field::ID: 1 })
                    .max_time(store.server_limit()),
            )
            .await?;
        return Ok(new_offset.is_some());
    }
    Ok(false)
}

/// The whole minutes within +-14 h that no value in `seen` equals (numerically: an offset
/// stored as a double matches too), as the probe's `$in`. Point lookups, not a range with
/// `$nin`: MongoDB serves either from the index, SecantusDB scans the whole index for the
/// range (70 ms at 50k records, measured) and seeks for the points (5 ms).
fn unseen_offsets(seen: &[Bson]) -> Vec<i32> {
    let seen: std::collections::HashSet<i64> = seen.iter().filter_map(due::whole_number).collect();
    let max = due::MAX_OFFSET_MINUTES as i32;
    (-max..=max)
        .filter(|o| !seen.contains(&i64::from(*o)))
        .collect()
}

/// Any date: `$type` keeps arrays out, and the date index (or v7's `Time_1_Locked_1`)
/// serves it with the date type's bounds. Dates outside .NET's range count too: those due are
/// claimed and parked with the reason. (Not `$lte: DateTime::MAX`: a server built on
/// Python's datetime, such as SecantusDB's `secantusd-py`, rejects that date in a query.)
async fn any_date(store: &Store) -> Result<bool, StoreError> {
    let found = store
        .query(async {
            slow_reply().await;
            store
                .coll
                // `$type`, not `$lte` with the largest date: a server whose BSON layer is Python's
                // (SecantusDB's Python server) cannot read a date past year 9999 in a query.
                .find_one(doc! { field::TIME: { "$type": "date" } })
                .projection(doc! { field::ID: 1 })
                .max_time(store.server_limit())
                .await
        })
        .await?;
    Ok(found.is_some())
}

/// Tests only: a server that answers each query of a learn late, within the query's own
/// deadline (`shapes-reply-delay`, milliseconds).
async fn slow_reply() {
    #[cfg(feature = "failpoints")]
    if let Some(Some(ms)) = fail::eval("shapes-reply-delay", |arg| {
        arg.and_then(|a| a.parse::<u64>().ok())
    }) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

/// The shapes present, and every `"Time.1"` value seen.
async fn read_shapes(store: &Store) -> Result<(Vec<Shape>, Vec<Bson>), StoreError> {
    let mut shapes = Vec::new();
    if store.encoding.reads_dates() && any_date(store).await? {
        shapes.push(Shape::Date);
    }
    let mut seen = Vec::new();
    if store.encoding.reads_ticks() {
        seen = store
            .query(async {
                slow_reply().await;
                store
                    .coll
                    .distinct(field::TIME_OFFSET, Document::new())
                    .max_time(store.server_limit())
                    .await
            })
            .await?;
        shapes.extend(due::servable_offsets(&seen).into_iter().map(Shape::Ticks));
    }
    Ok((shapes, seen))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_asks_for_every_servable_offset_not_seen() {
        let all = unseen_offsets(&[]);
        assert_eq!(all.len(), 2 * 840 + 1);
        assert_eq!((all.first(), all.last()), (Some(&-840), Some(&840)));
        let seen = [
            Bson::Int32(0),
            Bson::Int64(60),
            Bson::Double(-300.0),
            Bson::Double(30.5),
            Bson::Int32(9_999),
            Bson::String("x".into()),
        ];
        let unseen = unseen_offsets(&seen);
        assert_eq!(unseen.len(), all.len() - 3);
        for o in [0, 60, -300] {
            assert!(!unseen.contains(&o), "{o} was seen");
        }
        for o in [30, 31, -840, 840] {
            assert!(unseen.contains(&o), "{o} was not seen");
        }
    }
}
