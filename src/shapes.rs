//! Which `Time` shapes the collection holds, so that the due query has one branch per shape
//! present and no more ([`crate::due`]).
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

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bson::{Bson, Document, doc};

use crate::config::TimeEncoding;
use crate::due::{self, Shape};
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
pub struct ShapeCache(Mutex<State>);

#[derive(Debug, Default)]
struct State {
    shapes: Option<Vec<Shape>>,
    /// Every `"Time.1"` value seen, servable or not: what the probe need not find again.
    offsets_seen: Vec<Bson>,
    probed_at: Option<Instant>,
    learned_at: Option<Instant>,
    refreshing: bool,
}

impl ShapeCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The shapes to query now. The first call (and any call while none is known) learns
    /// them; later ones start a background probe once the last is older than [`REFRESH`].
    pub async fn current(self: &Arc<Self>, store: &Store) -> Result<Vec<Shape>, StoreError> {
        if store.encoding == TimeEncoding::Date {
            return Ok(vec![Shape::Date]);
        }
        let (known, start) = {
            let mut s = self.lock();
            // While none is known (an empty collection), look again more often, so that the
            // first records inserted fire on time.
            let every = match &s.shapes {
                Some(shapes) if shapes.is_empty() => REFRESH_WHILE_EMPTY,
                _ => REFRESH,
            };
            let stale = s.probed_at.is_none_or(|t| t.elapsed() >= every);
            let start = stale && !s.refreshing;
            if start {
                s.refreshing = true;
            }
            (s.shapes.clone(), start)
        };
        match known {
            Some(shapes) if !shapes.is_empty() || !start => {
                if start {
                    let (cache, store) = (self.clone(), store.clone());
                    tokio::spawn(async move {
                        if let Err(e) = cache.refresh(&store).await {
                            cache.lock().refreshing = false;
                            tracing::debug!(error = %e, "could not refresh the Time shapes; keeping the last ones");
                        }
                    });
                }
                Ok(shapes)
            }
            // Nothing known yet: learn before claiming.
            _ => self.learn(store).await,
        }
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
            let mut s = self.lock();
            s.probed_at = Some(Instant::now());
            s.refreshing = false;
        }
        Ok(())
    }

    /// Reads the shapes present from the collection and keeps them.
    pub async fn learn(&self, store: &Store) -> Result<Vec<Shape>, StoreError> {
        let learned = Store::timed("shapes", read_shapes(store)).await;
        let mut s = self.lock();
        s.refreshing = false;
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
    let seen: std::collections::HashSet<i64> = seen
        .iter()
        .filter_map(|v| match v {
            Bson::Int32(o) => Some(i64::from(*o)),
            Bson::Int64(o) => Some(*o),
            Bson::Double(o) if o.fract() == 0.0 && o.abs() <= 1e6 => Some(*o as i64),
            _ => None,
        })
        .collect();
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
        .query(
            store
                .coll
                // `$type`, not `$lte` with the largest date: a server whose BSON layer is Python's
                // (SecantusDB's Python server) cannot read a date past year 9999 in a query.
                .find_one(doc! { field::TIME: { "$type": "date" } })
                .projection(doc! { field::ID: 1 })
                .max_time(store.server_limit()),
        )
        .await?;
    Ok(found.is_some())
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
            .query(
                store
                    .coll
                    .distinct(field::TIME_OFFSET, Document::new())
                    .max_time(store.server_limit()),
            )
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
