//! Which `Time` shapes the collection holds, so that the due query has one branch per shape
//! present and no more ([`crate::record::due`]).
//!
//! Learned with index-served reads: whether any date-shaped `Time` exists (a read of the date
//! index), and `distinct("Time.1")`, the offsets of the `[ticks, offset]` records (MongoDB
//! answers it from the `{"Time.1": 1, "Time.0": 1}` index with a DISTINCT_SCAN, one seek per
//! distinct offset). Every [`REFRESH`] a background probe asks whether a record of a shape
//! not yet known exists (`"Time.1": {$in: [every offset not seen]}`, index point seeks) and
//! learns the set again only then, or every [`FULL_REFRESH`] (to drop offsets no record holds
//! any more). A claim never waits for this except the first. A record whose offset no other
//! record had (a new time zone, a DST change) is served once the learner knows it: at once
//! when the insert wake-up saw it ([`Shapes::inserted`]), otherwise from the next probe. The
//! probe asks for quarter hours ([`PROBE_STEP_MINUTES`]); any other offset is served from the
//! next full learn.
//!
//! One learner, run as a task of its own ([`Learner::run`], the daemon's `shapes` task): it
//! publishes what it learned, and the claim path and the monitor read that ([`Shapes`]). The
//! claim path waits for the first learn, and while the set is empty for a try it asks for (so
//! an idle instance's claims still meet a database that does not answer); it is woken when
//! the set changes. The monitor ([`crate::store::backlog`]) takes the set only if a probe
//! checked it within its own interval, and fails the reading otherwise: it never reports a
//! count over shapes nobody could check. One-shot commands read the set once ([`Shapes::read_now`]).
//!
//! Long, as one concept: the learner, its probes and the task that publishes what it learned are
//! one concept (about 400 lines of code, the rest its tests).

use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use bson::{Bson, DateTime, Document, doc};
use tokio_util::sync::CancellationToken;

use crate::config::TimeEncoding;
use crate::record::due::{self, Shape};
use crate::record::field;
use crate::store::pacing::Pacing;
use crate::store::{Store, StoreError};

/// How often the learner probes for records of a shape not yet known.
pub const REFRESH: Duration = Duration::from_secs(2);
/// How often, at most, the set is learned again at the claims' ask while it is empty.
pub const REFRESH_WHILE_EMPTY: Duration = Duration::from_millis(200);
/// How often the whole set is learned again.
pub const FULL_REFRESH: Duration = Duration::from_secs(60);

/// What the learner last published, after each try.
#[derive(Debug, Clone, Default)]
pub struct Learned {
    /// `None` until the first learn succeeded.
    shapes: Option<Vec<Shape>>,
    /// When a probe or a learn last succeeded.
    checked_at: Option<Instant>,
    /// How many tries ended, and why the last failed.
    tries: u64,
    failed: Option<String>,
}

/// The `Time` shapes to query: the learner's, or a set read once. Cheap to clone.
#[derive(Debug, Clone)]
pub enum Shapes {
    /// Read once, or known from the configuration (`time_encoding = "date"`).
    Fixed(Vec<Shape>),
    Learned {
        rx: watch::Receiver<Learned>,
        /// Asks the learner to look again (while it knows none).
        wanted: Arc<Notify>,
        /// Asks the learner to learn the set again now: a record of a shape not in it was
        /// inserted ([`Shapes::inserted`]).
        relearn: Arc<Notify>,
        /// The set [`Shapes::changed`] last saw.
        seen: Option<Vec<Shape>>,
    },
}

impl Shapes {
    /// The shapes the collection holds now, read once (one-shot commands, tests).
    pub async fn read_now(store: &Store) -> Result<Self, StoreError> {
        Ok(Self::Fixed(store.shapes().await?))
    }

    /// The shapes to query now: the last published, after the first learn (waited for); while
    /// none is known, after a try asked for (see the module): a wake-up for a record inserted
    /// due soon finds it at once, and a database that does not answer fails the claim.
    pub async fn current(&self) -> Result<Vec<Shape>, StoreError> {
        let (mut rx, wanted) = match self {
            Shapes::Fixed(shapes) => return Ok(shapes.clone()),
            Shapes::Learned { rx, wanted, .. } => (rx.clone(), wanted),
        };
        let unchecked = |_| StoreError::ShapesUnchecked("the shape learner stopped".into());
        let (shapes, tries) = {
            let l = rx
                .wait_for(|l| l.shapes.is_some())
                .await
                .map_err(unchecked)?;
            (l.shapes.clone().unwrap_or_default(), l.tries)
        };
        if !shapes.is_empty() {
            return Ok(shapes);
        }
        wanted.notify_one();
        let l = rx.wait_for(|l| l.tries > tries).await.map_err(unchecked)?;
        match &l.failed {
            Some(why) => Err(StoreError::ShapesUnchecked(why.clone())),
            None => Ok(l.shapes.clone().unwrap_or_default()),
        }
    }

    /// A record whose `Time` is `time` was inserted (the insert wake-up): when its shape is
    /// one the encoding serves and not in the set, the learner learns the set again at once
    /// instead of at its next probe, so that the record fires on time when it was inserted
    /// due sooner than that. The simulation's `late` invariant found such records up to
    /// [`REFRESH`] late. An offset outside +-14 h is never in the set and asks nothing.
    pub fn inserted(&self, time: Option<&Bson>, encoding: TimeEncoding) {
        let Shapes::Learned { rx, relearn, .. } = self else {
            return;
        };
        let shape = match time {
            Some(Bson::DateTime(_)) if encoding.reads_dates() => Shape::Date,
            Some(Bson::Array(a)) if encoding.reads_ticks() => {
                let offset = a.get(1).and_then(due::whole_number);
                match offset
                    .filter(|o| due::offset_in_range(*o))
                    .map(i32::try_from)
                {
                    Some(Ok(offset)) => Shape::Ticks(offset),
                    _ => return,
                }
            }
            _ => return,
        };
        let known = rx
            .borrow()
            .shapes
            .as_ref()
            .is_some_and(|s| s.contains(&shape));
        if !known {
            relearn.notify_one();
        }
    }

    /// The shapes, if the learner checked them within `within` (the monitor's readings).
    pub fn checked(&self, within: Duration) -> Result<Vec<Shape>, StoreError> {
        match self {
            Shapes::Fixed(shapes) => Ok(shapes.clone()),
            Shapes::Learned { rx, .. } => {
                let l = rx.borrow();
                match (&l.shapes, l.checked_at) {
                    (Some(shapes), Some(at)) if at.elapsed() <= within => Ok(shapes.clone()),
                    _ => Err(StoreError::ShapesUnchecked(format!(
                        "no probe succeeded within {within:?}"
                    ))),
                }
            }
        }
    }

    /// Resolves when the learned set differs from the one this last saw (never, for a
    /// fixed set): the claims that read nothing under the old set may find records now.
    /// Cancel-safe: a change while no one waits is seen at the next call.
    pub async fn changed(&mut self) {
        if let Shapes::Learned { rx, seen, .. } = self {
            loop {
                let now = rx.borrow_and_update().shapes.clone();
                if now != *seen {
                    *seen = now;
                    return;
                }
                if rx.changed().await.is_err() {
                    break;
                }
            }
        }
        std::future::pending().await
    }
}

/// The one learner of the `Time` shapes ([`Learner::run`]).
#[derive(Debug)]
pub struct Learner {
    store: Store,
    tx: watch::Sender<Learned>,
    /// A claim found no shape known: look again.
    wanted: Arc<Notify>,
    /// A record of a shape not known was inserted: learn again.
    relearn: Arc<Notify>,
    /// Every `"Time.1"` value seen, servable or not: what the probe need not find again.
    offsets_seen: Vec<Bson>,
    learned_at: Option<Instant>,
}

/// The learner of `store`'s shapes, and what it publishes; no learner when the configuration
/// fixes the shape (`time_encoding = "date"`).
pub fn learner(store: &Store) -> (Option<Learner>, Shapes) {
    if store.encoding == TimeEncoding::Date {
        return (None, Shapes::Fixed(vec![Shape::Date]));
    }
    let (tx, rx) = watch::channel(Learned::default());
    let wanted = Arc::new(Notify::new());
    let relearn = Arc::new(Notify::new());
    let learner = Learner {
        store: store.clone(),
        tx,
        wanted: wanted.clone(),
        relearn: relearn.clone(),
        offsets_seen: Vec::new(),
        learned_at: None,
    };
    let shapes = Shapes::Learned {
        rx,
        wanted,
        relearn,
        seen: None,
    };
    (Some(learner), shapes)
}

impl Learner {
    /// Until shutdown: learns, probes and learns again as the module says, and takes a
    /// claim's ask while the set is empty and an ask to learn again ([`Shapes::inserted`]);
    /// failures are paced by [`Pacing`], keeping the last set.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let mut pacing = Pacing::new(self.store.operation_timeout());
        loop {
            // Yields to shutdown: a learn is up to four calls, each bounded on its own.
            let result = tokio::select! {
                r = self.refresh() => r,
                _ = shutdown.cancelled() => return,
            };
            // Published once a try: what it learned, that it checked, or why it failed.
            self.tx.send_modify(|l| {
                l.tries += 1;
                l.failed = result.as_ref().err().map(ToString::to_string);
                if let Ok(learned) = &result {
                    l.checked_at = Some(Instant::now());
                    if let Some(shapes) = learned
                        && l.shapes.as_ref() != Some(shapes)
                    {
                        tracing::debug!(shapes = ?shapes, "Time shapes in the timeouts collection");
                        l.shapes = Some(shapes.clone());
                    }
                }
            });
            let asked_after = Instant::now() + REFRESH_WHILE_EMPTY;
            let wait = pacing.record(&result);
            if let Some(wait) = wait {
                tracing::debug!(error = ?result.err(), ?wait, "could not refresh the Time shapes; keeping the last ones");
            }
            let empty = self.tx.borrow().shapes.as_ref().is_some_and(Vec::is_empty);
            // The next try: at `next`, brought forward (to no sooner than `asked_after`) by an
            // ask. An ask is kept here once taken, never in a future that another branch's
            // win could drop: a relearn asked just before the probe's time was lost that
            // way, and an offset no probe asks for waited for the full learn.
            let mut next = Instant::now() + wait.unwrap_or(REFRESH);
            let mut relearn = false;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep_until(next) => break,
                    _ = self.wanted.notified(), if empty && wait.is_none() => {
                        next = next.min(asked_after);
                    }
                    _ = self.relearn.notified(), if !relearn && wait.is_none() => {
                        relearn = true;
                        next = next.min(asked_after);
                    }
                    _ = shutdown.cancelled() => return,
                }
            }
            if relearn {
                self.learned_at = None;
            }
        }
    }

    /// Learns the set again when it is older than [`FULL_REFRESH`] or a probe finds a record
    /// of a shape not in it; returns it when it did.
    async fn refresh(&mut self) -> Result<Option<Vec<Shape>>, StoreError> {
        let known = self.tx.borrow().shapes.clone();
        let learn = match (known, self.learned_at) {
            (Some(shapes), Some(at)) if at.elapsed() < FULL_REFRESH => {
                let seen = self.offsets_seen.clone();
                Store::timed("shapes", probe_finds_new(&self.store, &shapes, seen)).await?
            }
            _ => true,
        };
        if !learn {
            return Ok(None);
        }
        let (shapes, seen) = Store::timed("shapes", read_shapes(&self.store)).await?;
        self.offsets_seen = seen;
        self.learned_at = Some(Instant::now());
        Ok(Some(shapes))
    }
}

impl Store {
    /// The `Time` shapes the collection holds now, read once.
    pub async fn shapes(&self) -> Result<Vec<Shape>, StoreError> {
        if self.encoding == TimeEncoding::Date {
            return Ok(vec![Shape::Date]);
        }
        Ok(Store::timed("shapes", read_shapes(self)).await?.0)
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
                    .projection(doc! { field::ID: 1 }),
            )
            .await?;
        return Ok(new_offset.is_some());
    }
    Ok(false)
}

/// How far apart the offsets the probe asks for are: every time zone in use is a whole
/// number of quarter hours from UTC (Nepal's +5:45 and the Chatham Islands' +12:45 among
/// them), and a `DateTimeOffset` takes its offset from one.
pub const PROBE_STEP_MINUTES: i32 = 15;

/// The quarter hours within +-14 h that no value in `seen` equals (numerically: an offset
/// stored as a double matches too), as the probe's `$in`. Point lookups, not a range with
/// `$nin`: MongoDB serves either from the index, SecantusDB scans the whole index for the
/// range (70 ms at 50k records, measured) and seeks for the points. Quarter hours, not every
/// whole minute: on SecantusDB at 50k records, 112 points cost 1.3 ms where 1,680 cost 11.5 ms
/// (idle, measured), and the probe of every minute took 215 ms a call during the benchmark's
/// drain, a tenth of the server's time. An offset between quarter hours, which no time zone
/// in use has, is learned by the full learn every [`FULL_REFRESH`] instead.
fn unseen_offsets(seen: &[Bson]) -> Vec<i32> {
    let seen: std::collections::HashSet<i64> = seen.iter().filter_map(due::whole_number).collect();
    let max = due::MAX_OFFSET_MINUTES as i32;
    (-max..=max)
        .step_by(PROBE_STEP_MINUTES as usize)
        .filter(|o| !seen.contains(&i64::from(*o)))
        .collect()
}

/// Any date, as two ranges around the first instant of year 1, which together hold every
/// date: a range on `Time` matches only dates (arrays and numbers compare in other brackets),
/// and the date index (or v7's `Time_1_Locked_1`) serves each with a seek. Dates outside
/// .NET's range count too: those due are claimed and parked with the reason. Not `$type`:
/// SecantusDB answers it by scanning the whole index (43 ms at 50k records, 190 ms cold,
/// measured; in every probe, every 2 s) where the ranges take 0.9 ms; MongoDB serves both
/// from the index. Not `$lte` with the largest date: a server whose BSON layer is Python's
/// (SecantusDB's Python server) cannot read a date past year 9999 in a query; year 1 it can.
async fn any_date(store: &Store) -> Result<bool, StoreError> {
    let found = store
        .query(async {
            slow_reply().await;
            store
                .coll
                .find_one(any_date_filter())
                .projection(doc! { field::ID: 1 })
                .await
        })
        .await?;
    Ok(found.is_some())
}

/// The filter of [`any_date`]: every record whose `Time` is a date.
pub fn any_date_filter() -> Document {
    // 0001-01-01T00:00:00Z.
    let year_one = DateTime::from_millis(-62_135_596_800_000);
    doc! { "$or": [
        { field::TIME: { "$gte": year_one } },
        { field::TIME: { "$lt": year_one } },
    ] }
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
                // Only the offsets a shape can have: an unbounded `distinct` lists every
                // value of `"Time.1"` in the collection, and a foreign writer's second
                // element (nanoseconds, a sequence number) made it too large to answer (the
                // server caps it at 16 MB), so the set was never learned again and, after a
                // restart, no claim ran (found in review, helper-36). The probe asks for
                // offsets within the same bounds.
                let bounds = due::MAX_OFFSET_MINUTES;
                let servable = doc! { field::TIME_OFFSET: { "$gte": -bounds, "$lte": bounds } };
                store.coll.distinct(field::TIME_OFFSET, servable).await
            })
            .await?;
        shapes.extend(due::servable_offsets(&seen).into_iter().map(Shape::Ticks));
    }
    Ok((shapes, seen))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    use crate::config::MongoConfig;
    use crate::store::backend::{Answering, MongoError, Op, Reply};
    use crate::store::clock::ServerClock;

    /// A collection whose `"Time.1"` values, listed whole, are more than a `distinct` can
    /// answer (a foreign writer's second element): the shapes are learned from the offsets a
    /// shape can have. The whole list was asked for, and every learn failed.
    #[tokio::test]
    async fn offsets_are_learned_where_the_whole_list_would_be_too_large() {
        let backend = Answering::new(|op: Op| match op {
            Op::Distinct { filter, .. } if filter.is_empty() => {
                Err(crate::store::backend::command_error(
                    17217,
                    "Location17217",
                    "distinct too big, 16mb cap",
                ))
            }
            Op::Distinct { .. } => Ok(Reply::Values(vec![Bson::Int32(60)])),
            _ => Ok(Reply::Docs(Vec::new())),
        });
        let config = MongoConfig {
            time_encoding: TimeEncoding::DotnetTicks,
            ..MongoConfig::default()
        };
        let store = Store::with_backend(Arc::new(backend), &config, ServerClock::default());
        let shapes = store.shapes().await.expect("learned");
        assert_eq!(shapes, [Shape::Ticks(60)]);
    }

    /// A timeouts collection of `[ticks, offset]` records at `offsets` (none: empty), or a
    /// server that fails every call while `down`.
    #[derive(Debug, Default)]
    struct Offsets {
        offsets: Mutex<Vec<Bson>>,
        down: AtomicBool,
    }

    impl Offsets {
        fn answer(&self, op: Op) -> Result<Reply, MongoError> {
            let offsets = self
                .offsets
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            match op {
                _ if self.down.load(Ordering::SeqCst) => Err(MongoError::from(
                    std::io::Error::from(std::io::ErrorKind::ConnectionReset),
                )),
                Op::Distinct { .. } => Ok(Reply::Values(offsets)),
                // The probe for the offsets not seen finds a record at one of them.
                Op::Find { filter, .. } if filter.contains_key(field::TIME_OFFSET) => {
                    let asked = filter
                        .get_document(field::TIME_OFFSET)
                        .and_then(|f| f.get_array("$in"))
                        .cloned()
                        .unwrap_or_default();
                    let found = offsets.iter().any(|o| asked.contains(o));
                    Ok(Reply::Docs(
                        found.then(|| doc! { "_id": 1 }).into_iter().collect(),
                    ))
                }
                _ => Ok(Reply::Docs(Vec::new())),
            }
        }
    }

    /// While no shape is known, a claim waits for a try of the learner's and fails with it:
    /// an idle instance's claims meet a database that does not answer (they read nothing
    /// without a call before, and readiness never saw a stalled database). Once a record is
    /// there, the next try finds its shape.
    #[tokio::test(start_paused = true)]
    async fn while_no_shape_is_known_a_claim_waits_for_a_try_and_fails_with_it() {
        let backend = Arc::new(Offsets::default());
        let answering = backend.clone();
        let config = MongoConfig::default();
        let store = Store::with_backend(
            Arc::new(Answering::new(move |op| answering.answer(op))),
            &config,
            ServerClock::default(),
        );
        let (learner, shapes) = learner(&store);
        let stop = CancellationToken::new();
        let task = crate::host::spawn(learner.expect("auto learns").run(stop.clone()));
        assert_eq!(shapes.current().await.expect("an empty collection"), vec![]);

        backend.down.store(true, Ordering::SeqCst);
        let failed = shapes.current().await;
        assert!(
            matches!(failed, Err(StoreError::ShapesUnchecked(_))),
            "{failed:?}"
        );

        backend.down.store(false, Ordering::SeqCst);
        *backend.offsets.lock().unwrap() = vec![Bson::Int32(0)];
        let mut found = shapes.current().await.expect("answers again");
        if found.is_empty() {
            // The try that answered had begun before the record was there.
            found = shapes.current().await.expect("answers");
        }
        assert_eq!(found, vec![Shape::Ticks(0)]);
        stop.cancel();
        task.await.expect("the learner ends at shutdown");
    }

    /// An insert of a shape not known is learned at the next try even when a claim asked
    /// for a try at the same time: here an offset off the quarter hours, which no probe asks
    /// for. Before, the two asks waited out the same short delay in two futures, `select!`
    /// took one at random and dropped the other, and when it dropped the insert's, the record
    /// waited for the full learn (a minute). Twenty rounds: each lost it half the time.
    #[tokio::test(start_paused = true)]
    async fn an_insert_of_a_new_shape_is_learned_beside_a_claims_ask() {
        for round in 0..20 {
            let backend = Arc::new(Offsets::default());
            let answering = backend.clone();
            let store = Store::with_backend(
                Arc::new(Answering::new(move |op| answering.answer(op))),
                &MongoConfig::default(),
                ServerClock::default(),
            );
            let (learner, shapes) = learner(&store);
            let stop = CancellationToken::new();
            let task = crate::host::spawn(learner.expect("auto learns").run(stop.clone()));
            assert_eq!(shapes.current().await.expect("an empty collection"), vec![]);
            // A record at +7 minutes is inserted and seen, and a claim asks for a try.
            backend.offsets.lock().unwrap().push(Bson::Int32(7));
            shapes.inserted(
                Some(&Bson::Array(vec![Bson::Int64(0), Bson::Int32(7)])),
                TimeEncoding::Auto,
            );
            assert_eq!(
                shapes.current().await.expect("learned"),
                vec![Shape::Ticks(7)],
                "round {round}"
            );
            stop.cancel();
            task.await.expect("the learner ends at shutdown");
        }
    }

    /// A shutdown while a learn waits on a server that does not answer ends the learner at
    /// once: a learn is up to four calls, each bounded by `operation_timeout` (40 s with the
    /// defaults), and the drain waited for them past its own deadline (25 s).
    #[tokio::test(start_paused = true)]
    async fn a_shutdown_during_a_learn_ends_the_learner_at_once() {
        let (silent, store) = Store::silent();
        let (learner, _shapes) = learner(&store);
        let stop = CancellationToken::new();
        let task = crate::host::spawn(learner.expect("auto learns").run(stop.clone()));
        while silent.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        let stopped = Instant::now();
        stop.cancel();
        task.await.expect("the learner ends at shutdown");
        assert!(
            stopped.elapsed() < store.operation_timeout(),
            "the learner waited {:?} for its call after the shutdown",
            stopped.elapsed()
        );
    }

    #[test]
    fn the_probe_asks_for_every_quarter_hour_offset_not_seen() {
        let all = unseen_offsets(&[]);
        assert_eq!(all.len(), 2 * 840 / 15 + 1);
        assert_eq!((all.first(), all.last()), (Some(&-840), Some(&840)));
        assert!(all.contains(&0) && all.contains(&345) && all.contains(&765));
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
        for o in [30, 345, -840, 840] {
            assert!(unseen.contains(&o), "{o} was not seen");
        }
        assert!(!unseen.contains(&31), "not a quarter hour");
    }
}
