//! timeoutd's own indexes, and the start-up task that asks for them.
//!
//! Building an index never makes start-up fail: the daemon starts dispatching with the
//! indexes that exist, while [`run`] asks for the missing ones in the background. On a
//! large collection `createIndexes` runs far longer than `[mongodb] operation_timeout`; its
//! call then ends on the client while the build goes on on the server (no `maxTimeMS`: that
//! would abort the build). The task lists the indexes again after each wait, keeps
//! `timeoutd_indexes_missing` up to date and logs progress, asks again for an index that is
//! still missing only after [`ASK_AGAIN`] (asking again joins a build that still runs), and
//! treats a build that failed as a warning with its reason.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::time::Instant;

use bson::{Bson, Document, doc};
use tokio_util::sync::CancellationToken;

use crate::metrics as m;
use crate::record::due::Shape;
use crate::record::field;
use crate::store::backend::MongoError;
use crate::store::coll::Coll;
use crate::store::pacing::{Pacing, timed_out};
use crate::store::{Store, StoreError};

/// Index names timeoutd creates. They never reuse ServiceConnect's names or key patterns.
/// `timeoutd_due` (`{"Time.0": 1}`, before offsets were served) is no longer used: drop it.
pub const DATE_DUE_INDEX: &str = "timeoutd_due_date";
pub const TICKS_DUE_INDEX: &str = "timeoutd_due_offset";
pub const LEASE_INDEX: &str = "timeoutd_lease";
pub const OWNER_INDEX: &str = "timeoutd_owner";

/// How often the start-up task looks at the indexes while one is missing.
pub const CHECK_EVERY: Duration = Duration::from_secs(10);

/// How long after asking for a missing index it is asked for again.
pub const ASK_AGAIN: Duration = Duration::from_secs(300);

/// What [`Store::index_plan`] found.
#[derive(Debug, Clone, Default)]
pub struct IndexPlan {
    /// The indexes timeoutd wants (name, keys), whether or not they exist.
    pub wanted: Vec<(&'static str, Document)>,
    /// timeoutd's own indexes that another index made redundant.
    pub redundant: Vec<&'static str>,
    /// The names of the indexes that exist now.
    pub existing: Vec<String>,
}

impl IndexPlan {
    /// The wanted indexes that do not exist (yet).
    pub fn missing(&self) -> Vec<(&'static str, Document)> {
        self.wanted
            .iter()
            .filter(|(name, _)| !self.existing.iter().any(|e| e == name))
            .cloned()
            .collect()
    }
}

impl Store {
    /// Which indexes timeoutd wants where no index serves the same queries: one per `Time`
    /// shape served (so each branch of the due query scans only due records, oldest first),
    /// the lease fields (reaper, census) and the owner. The date index is left out when an
    /// index on `Time` already exists (ServiceConnect v7's `Time_1_Locked_1` serves the same
    /// bounds), the lease index when one leads with `LockExpiresAt` (v7's `LockExpiresAt_1`),
    /// the owner index when one leads with `LockedBy` (v7's `LockedBy_1_Locked_1`): every
    /// index is one more the claim's update and the delete maintain for every record. An own
    /// index made redundant that way (created before v7's appeared) is to be dropped; no
    /// index timeoutd did not create is ever touched.
    pub async fn index_plan(&self) -> Result<IndexPlan, StoreError> {
        let existing = self.query(list_indexes(&self.coll)).await?;
        let served = |first: &str, ours: &str| {
            existing
                .iter()
                .any(|(name, keys)| name != ours && keys.keys().next().is_some_and(|f| f == first))
        };
        let ours = |name: &str| existing.iter().any(|(n, _)| n == name);
        let mut plan = IndexPlan::default();
        // An index with the very keys of one of ours, under another name (a DBA's default
        // `Locked_1_LockExpiresAt_1`), serves as ours would: the server refuses ours beside
        // it, which was asked for again and warned about every 5 minutes, for ever (found in
        // review).
        let same_keys = |name: &str, keys: &Document| {
            existing
                .iter()
                .any(|(n, k)| n != name && same_key_pattern(k, keys))
        };
        if self.encoding.reads_dates() {
            if !served(field::TIME, DATE_DUE_INDEX) {
                plan.wanted.push((DATE_DUE_INDEX, Shape::Date.sort()));
            } else if ours(DATE_DUE_INDEX) {
                plan.redundant.push(DATE_DUE_INDEX);
            }
        }
        if self.encoding.reads_ticks() {
            plan.wanted.push((TICKS_DUE_INDEX, Shape::Ticks(0).sort()));
        }
        for (name, first, keys) in [
            (
                LEASE_INDEX,
                field::LOCK_EXPIRES_AT,
                doc! { field::LOCKED: 1, field::LOCK_EXPIRES_AT: 1 },
            ),
            (OWNER_INDEX, field::LOCKED_BY, doc! { field::LOCKED_BY: 1 }),
        ] {
            if !served(first, name) {
                plan.wanted.push((name, keys));
            } else if ours(name) {
                plan.redundant.push(name);
            }
        }
        plan.wanted.retain(|(name, keys)| !same_keys(name, keys));
        plan.existing = existing.into_iter().map(|(name, _)| name).collect();
        Ok(plan)
    }

    /// Asks for one index (`createIndexes`, which returns once the build ended). Carries no
    /// `maxTimeMS`: that would abort the build on the server.
    pub async fn create_named_index(
        &self,
        name: &'static str,
        keys: Document,
    ) -> Result<(), StoreError> {
        // Tests only: a build that takes this many ms (a large collection).
        #[cfg(feature = "failpoints")]
        if let Some(Some(ms)) = fail::eval("create-index-delay", |arg| {
            arg.and_then(|a| a.parse::<u64>().ok())
        }) {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        self.query(create_index(&self.coll, index_spec(name, keys, None)))
            .await?;
        Ok(())
    }

    /// Drops timeoutd's own indexes that another index made redundant.
    async fn drop_redundant(&self, redundant: &[&'static str]) {
        for name in redundant {
            let drop = self.command(doc! {
                "dropIndexes": self.coll.name(),
                "index": *name,
            });
            match crate::deadline::within(self.op_timeout, "drop an index", drop).await {
                Ok(_) => {
                    tracing::info!(
                        index = name,
                        "dropped timeoutd's own index: another one serves the same queries, and each index costs every write"
                    )
                }
                // Another instance may have dropped it first.
                Err(e) => {
                    tracing::debug!(index = name, error = %e, "could not drop a redundant index")
                }
            }
        }
    }

    /// Creates the indexes of [`Store::index_plan`] and drops the redundant ones, each under
    /// `operation_timeout`, in one go (the `ensure-indexes` path of tests and benchmarks; the
    /// daemon uses [`run`]). Also warns when the collection is empty and the other spelling
    /// of the ServiceConnect database holds records.
    pub async fn ensure_indexes(&self) -> Result<(), StoreError> {
        let plan = self.index_plan().await?;
        for (name, keys) in plan.missing() {
            if let Err(e) = self.create_named_index(name, keys.clone()).await {
                // An index with the same keys under another name serves as well.
                tracing::warn!(index = name, keys = %keys, error = %e, "could not create index; continuing");
            }
        }
        self.drop_redundant(&plan.redundant).await;
        self.warn_if_other_spelling_holds_records().await;
        Ok(())
    }

    /// The default database changed to the public releases' spelling: say so when this
    /// collection is empty and the other spelling's is not.
    async fn warn_if_other_spelling_holds_records(&self) {
        let Some((other, theirs)) = &self.other_spelling else {
            return;
        };
        let ours = self.query(estimated_count(&self.coll)).await;
        let theirs = self.query(estimated_count(theirs)).await;
        if let (Ok(0), Ok(n)) = (ours, theirs)
            && n > 0
        {
            tracing::warn!(
                database = &*self.database,
                other_database = other,
                records_there = n,
                "this database's timeouts collection is empty but the other spelling of the ServiceConnect database holds records: set [mongodb] database to the one your services write"
            );
        }
    }
}

/// An index as `createIndexes` takes it: `keys`, `name`, and for a TTL index its expiry (in
/// whole seconds, as the driver's `IndexOptions::expire_after` sends it).
pub(crate) fn index_spec(name: &str, keys: Document, expire_after: Option<Duration>) -> Document {
    let mut spec = doc! { "key": keys, "name": name };
    if let Some(after) = expire_after {
        let secs = after.as_secs();
        let secs = match i32::try_from(secs) {
            Ok(s) => Bson::Int32(s),
            Err(_) => Bson::Int64(i64::try_from(secs).unwrap_or(i64::MAX)),
        };
        spec.insert("expireAfterSeconds", secs);
    }
    spec
}

/// `createIndexes` of one index on `coll`. Carries no `maxTimeMS`: that would abort a build.
pub(crate) async fn create_index(coll: &Coll, spec: Document) -> Result<(), MongoError> {
    let command = doc! { "createIndexes": coll.name(), "indexes": [spec] };
    coll.backend().command(command).await.map(drop)
}

/// MongoDB's code for a collection (namespace) that does not exist.
const NAMESPACE_NOT_FOUND: i32 = 26;

fn namespace_not_found(e: &MongoError) -> bool {
    matches!(e.kind.as_ref(), mongodb::error::ErrorKind::Command(c) if c.code == NAMESPACE_NOT_FOUND)
}

/// The indexes of `coll` (`listIndexes` under `maxTimeMS`), each its name and keys; none when
/// the collection does not exist. Any other error is an error: read as "no index", it made
/// every round after a transient failure create indexes beside v7's that serve the same
/// queries (and the plan never drops an index it did not find).
/// Whether two key patterns name the same fields in the same order and directions, however
/// their numbers are typed (a shell may write `1.0`).
fn same_key_pattern(a: &Document, b: &Document) -> bool {
    let number = |v: &Bson| match v {
        Bson::Int32(n) => Some(f64::from(*n)),
        Bson::Int64(n) => Some(*n as f64),
        Bson::Double(n) => Some(*n),
        _ => None,
    };
    a.len() == b.len()
        && a.iter().zip(b.iter()).all(|((fa, va), (fb, vb))| {
            fa == fb
                && match (number(va), number(vb)) {
                    (Some(x), Some(y)) => x == y,
                    _ => va == vb,
                }
        })
}

/// The indexes of timeoutd's own collections, each set asked for until it exists.
async fn own_indexes(store: Store, history_keep: Option<Duration>, missing: &Missing) {
    // Whether one set was created; a failure is warned of and asked for again.
    async fn created(
        store: &Store,
        what: &'static str,
        call: impl std::future::Future<Output = Result<(), StoreError>>,
    ) -> bool {
        match store.bounded(what, call).await {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?ASK_AGAIN, "could not {what}");
                false
            }
        }
    }
    let (mut parking, mut control, mut history) = (false, false, history_keep.is_none());
    loop {
        if !parking {
            let parked = store.parking();
            let what = "create the parking and attempts indexes";
            parking = created(&store, what, parked.ensure_indexes()).await;
        }
        if !control {
            let what = "create the control collection's indexes";
            control = created(&store, what, store.ensure_control_indexes()).await;
        }
        if let (false, Some(keep)) = (history, history_keep) {
            let what = "create the history collection's indexes (its TTL among them)";
            history = created(&store, what, store.ensure_history_indexes(keep)).await;
        }
        let left = [parking, control, history]
            .iter()
            .filter(|done| !**done)
            .count();
        missing.set(&missing.own, left);
        if left == 0 {
            return;
        }
        tokio::time::sleep(ASK_AGAIN).await;
    }
}

pub(crate) async fn list_indexes(coll: &Coll) -> Result<Vec<(String, Document)>, MongoError> {
    let command = doc! { "listIndexes": coll.name(), "maxTimeMS": coll.max_time_ms() };
    let reply = match coll.backend().command(command).await {
        Ok(reply) => reply,
        Err(e) if namespace_not_found(&e) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    // At most 64 indexes a collection: the first batch holds them all.
    let batch = reply
        .get_document("cursor")
        .and_then(|c| c.get_array("firstBatch"))
        .map_err(|e| {
            MongoError::from(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("listIndexes reply without cursor.firstBatch: {e}"),
            ))
        })?;
    Ok(batch
        .iter()
        .filter_map(Bson::as_document)
        .map(|ix| {
            let name = ix.get_str("name").unwrap_or_default().to_string();
            let keys = ix.get_document("key").cloned().unwrap_or_default();
            (name, keys)
        })
        .collect())
}

/// The estimated count of `coll` (the `count` command, as the driver's
/// `estimated_document_count` sends it); 0 when it does not exist.
async fn estimated_count(coll: &Coll) -> Result<u64, MongoError> {
    let command = doc! { "count": coll.name(), "maxTimeMS": coll.max_time_ms() };
    match coll.backend().command(command).await {
        Ok(reply) => Ok(match reply.get("n") {
            Some(Bson::Int32(n)) => u64::try_from(*n).unwrap_or(0),
            Some(Bson::Int64(n)) => u64::try_from(*n).unwrap_or(0),
            Some(Bson::Double(n)) if *n >= 0.0 => *n as u64,
            _ => 0,
        }),
        Err(e) if namespace_not_found(&e) => Ok(0),
        Err(e) => Err(e),
    }
}

/// The daemon's `indexes` task (see the module): asks for the indexes of timeoutd's own
/// collections (parking, attempts, control and, with `history_keep`, history, its TTL among
/// them), again every [`ASK_AGAIN`] until each set exists; and for those on the timeouts
/// collection until every one exists; then waits for shutdown. Before (found in review), the
/// own collections' indexes were asked for once a process: one failure left the history
/// without its TTL until a restart.
pub async fn run(store: Store, history_keep: Option<Duration>, shutdown: CancellationToken) {
    // Its calls yield to shutdown too, not only the waits between them (found in review:
    // three calls to a server that did not answer held the drain for 30 s).
    let missing = Missing::default();
    let own = async {
        tokio::select! {
            () = own_indexes(store.clone(), history_keep, &missing) => {}
            () = shutdown.cancelled() => {}
        }
    };
    tokio::join!(
        own,
        timeouts_indexes(store.clone(), shutdown.clone(), &missing)
    );
}

/// What `timeoutd_indexes_missing` counts: the timeouts collection's indexes that do not
/// exist yet, and the sets of timeoutd's own collections not created yet. It counted the
/// first alone (found in review, helper-38): a history TTL index refused for ever read 0
/// while the history grew without expiry.
#[derive(Debug, Default)]
struct Missing {
    timeouts: AtomicUsize,
    own: AtomicUsize,
}

impl Missing {
    fn set(&self, part: &AtomicUsize, n: usize) {
        part.store(n, Ordering::Relaxed);
        let all = self.timeouts.load(Ordering::Relaxed) + self.own.load(Ordering::Relaxed);
        m::indexes_missing(all);
    }
}

/// The indexes of the timeouts collection, until every one exists; then waits for shutdown.
async fn timeouts_indexes(store: Store, shutdown: CancellationToken, gauge: &Missing) {
    let mut listing = Pacing::new(store.operation_timeout());
    // Each index asked for, when, and whether the server refused it (not still building).
    let mut asked: HashMap<&'static str, (Instant, bool)> = HashMap::new();
    let mut first = true;
    loop {
        let round = async {
            let plan = store.bounded("list indexes", store.index_plan()).await;
            listing.record(&plan);
            let plan = match plan {
                Ok(plan) => plan,
                Err(e) => {
                    tracing::warn!(error = %e, "could not list the indexes; dispatching with those that exist");
                    return false;
                }
            };
            if first {
                first = false;
                store.drop_redundant(&plan.redundant).await;
                store.warn_if_other_spelling_holds_records().await;
            }
            let missing = plan.missing();
            gauge.set(&gauge.timeouts, missing.len());
            if missing.is_empty() {
                if !asked.is_empty() {
                    tracing::info!("timeoutd's indexes are built");
                }
                return true;
            }
            for (name, keys) in missing {
                match asked.get(name) {
                    Some((t, refused)) if t.elapsed() < ASK_AGAIN => {
                        // A refused one waits to be asked for again, already warned of.
                        if !refused {
                            tracing::info!(
                                index = name,
                                "index still building on the server; dispatching meanwhile with the indexes that exist"
                            );
                        }
                        continue;
                    }
                    _ => {}
                }
                asked.insert(name, (Instant::now(), false));
                tracing::info!(index = name, keys = %keys, "creating index");
                match store
                    .bounded("create an index", store.create_named_index(name, keys))
                    .await
                {
                    Ok(()) => tracing::info!(index = name, "index created"),
                    Err(e) if timed_out(&e) => {
                        tracing::info!(index = name, error = %e, "index build goes on on the server; dispatching meanwhile with the indexes that exist")
                    }
                    Err(e) => {
                        asked.insert(name, (Instant::now(), true));
                        tracing::warn!(index = name, error = %e, retry_in = ?ASK_AGAIN, "could not create index; dispatching with the indexes that exist")
                    }
                }
            }
            false
        };
        let done = tokio::select! {
            _ = shutdown.cancelled() => return,
            done = round => done,
        };
        if done {
            return shutdown.cancelled().await;
        }
        let next = listing.next_at().max(Instant::now() + CHECK_EVERY);
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep_until(next) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::config::MongoConfig;
    use crate::store::backend::{Answering, Op, Reply, command_error};
    use crate::store::clock::ServerClock;

    /// A shutdown while the own collections' indexes are asked of a server that does not
    /// answer ends the task at once, and nothing more is asked. Before, its three calls ran
    /// to their deadlines one after another (30 s), holding the drain, asking after the
    /// shutdown.
    #[tokio::test(start_paused = true)]
    async fn a_shutdown_while_the_indexes_are_asked_for_ends_the_task_at_once() {
        use std::sync::atomic::Ordering;
        let (calls, store) = Store::silent();
        let stop = CancellationToken::new();
        let day = Some(Duration::from_secs(86_400));
        let task = crate::host::spawn(run(store.clone(), day, stop.clone()));
        while calls.load(Ordering::SeqCst) < 2 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let (stopped, asked) = (Instant::now(), calls.load(Ordering::SeqCst));
        stop.cancel();
        task.await.expect("the task ends at shutdown");
        assert!(
            stopped.elapsed() < store.operation_timeout() / 2,
            "the task ended {:?} after the shutdown",
            stopped.elapsed()
        );
        assert_eq!(
            calls.load(Ordering::SeqCst),
            asked,
            "asked after the shutdown"
        );
    }

    /// Log lines, for the one test here that is about what the log says.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let mut lines = self.0.lock().unwrap_or_else(|e| e.into_inner());
            lines.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// The history collection's indexes (its TTL among them) were asked for once a process:
    /// one failure left the history growing without expiry until a restart (found in
    /// review). They are asked for again until they exist.
    #[tokio::test(start_paused = true)]
    async fn the_history_indexes_are_asked_for_again_until_they_exist() {
        let asked = Arc::new(Mutex::new(0));
        let history = asked.clone();
        let command = move |c: Document| match c.keys().next().map(String::as_str) {
            Some("createIndexes") if c.get_str("createIndexes") == Ok("Timeouts_history") => {
                let mut n = history.lock().unwrap_or_else(|e| e.into_inner());
                *n += 1;
                match *n {
                    1 => Err(command_error(91, "ShutdownInProgress", "shutting down")),
                    _ => Ok(doc! { "ok": 1 }),
                }
            }
            Some("listIndexes") => Err(command_error(26, "NamespaceNotFound", "no collection")),
            Some("collMod") => Err(command_error(27, "IndexNotFound", "no such index")),
            _ => Ok(doc! { "ok": 1 }),
        };
        let backend = Answering(|_: Op| Ok(Reply::Docs(Vec::new())), command);
        let config = MongoConfig::default();
        let store = Store::with_backend(Arc::new(backend), &config, ServerClock::default());
        let stop = CancellationToken::new();
        let keep = Some(Duration::from_secs(86_400));
        let task = crate::host::spawn(run(store, keep, stop.clone()));
        tokio::time::sleep(ASK_AGAIN * 3).await;
        stop.cancel();
        task.await.expect("the index task ends at shutdown");
        // The TTL's first ask failed; the second created it and the two lookup indexes.
        assert_eq!(*asked.lock().unwrap_or_else(|e| e.into_inner()), 4);
    }

    /// A history TTL index the server refuses every time counts in
    /// `timeoutd_indexes_missing`: it read 0 while the history grew without expiry.
    #[tokio::test(start_paused = true)]
    async fn an_own_index_refused_counts_as_missing() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let _recorder = metrics::set_default_local_recorder(&recorder);
        // The timeouts collection has every index it needs (filled in below).
        let listed = Arc::new(Mutex::new(vec![
            doc! { "name": "_id_", "key": { "_id": 1 } },
        ]));
        let listing = listed.clone();
        let command = move |c: Document| match c.keys().next().map(String::as_str) {
            Some("createIndexes") if c.get_str("createIndexes") == Ok("Timeouts_history") => Err(
                command_error(85, "IndexOptionsConflict", "an index with other options"),
            ),
            Some("listIndexes") => {
                let listed = listing.lock().unwrap_or_else(|e| e.into_inner()).clone();
                Ok(doc! { "cursor": { "firstBatch": listed }, "ok": 1 })
            }
            Some("collMod") => Err(command_error(27, "IndexNotFound", "no such index")),
            _ => Ok(doc! { "ok": 1 }),
        };
        let backend = Answering(|_: Op| Ok(Reply::Docs(Vec::new())), command);
        let config = MongoConfig::default();
        let store = Store::with_backend(Arc::new(backend), &config, ServerClock::default());
        let plan = store.index_plan().await.expect("plan");
        for (name, key) in plan.missing() {
            let index = doc! { "name": name, "key": key };
            listed.lock().unwrap_or_else(|e| e.into_inner()).push(index);
        }
        let stop = CancellationToken::new();
        let keep = Some(Duration::from_secs(86_400));
        let task = crate::host::spawn(run(store, keep, stop.clone()));
        tokio::time::sleep(ASK_AGAIN * 2).await;
        stop.cancel();
        task.await.expect("the index task ends at shutdown");
        let missing = m::rendered(&recorder.handle(), "timeoutd_indexes_missing ");
        assert_eq!(missing, 1.0, "the history's set");
    }

    /// An index with the keys of one of ours under another name serves as ours: it was
    /// asked for every 5 minutes and refused, with `timeoutd_indexes_missing` stuck at 1.
    #[tokio::test(start_paused = true)]
    async fn an_index_with_our_keys_under_another_name_serves_as_ours() {
        let command = |c: Document| match c.keys().next().map(String::as_str) {
            Some("listIndexes") => Ok(doc! { "cursor": { "firstBatch": [
                { "name": "_id_", "key": { "_id": 1 } },
                { "name": "Locked_1_LockExpiresAt_1", "key": { "Locked": 1.0, "LockExpiresAt": 1 } },
            ] }, "ok": 1 }),
            _ => Ok(doc! { "ok": 1 }),
        };
        let backend = Answering(|_: Op| Ok(Reply::Docs(Vec::new())), command);
        let config = MongoConfig::default();
        let store = Store::with_backend(Arc::new(backend), &config, ServerClock::default());
        let plan = store.index_plan().await.expect("plan");
        let missing: Vec<&str> = plan.missing().iter().map(|(name, _)| *name).collect();
        assert!(!missing.contains(&LEASE_INDEX), "{missing:?}");
        assert!(missing.contains(&OWNER_INDEX), "{missing:?}");
    }

    /// An index the server refused (not a timeout: it is not being built) was said to be
    /// "still building on the server" every check until it was asked for again, 5 minutes
    /// on. Only the refusal is logged, once per ask.
    #[tokio::test(start_paused = true)]
    async fn a_refused_index_is_not_said_to_be_building() {
        let command = |c: Document| match c.keys().next().map(String::as_str) {
            Some("createIndexes") => Err(command_error(
                85,
                "IndexOptionsConflict",
                "an index with the same keys exists under another name",
            )),
            Some("listIndexes") => Err(command_error(26, "NamespaceNotFound", "no collection")),
            _ => Ok(doc! { "ok": 1 }),
        };
        let backend = Answering(|_: Op| Ok(Reply::Docs(Vec::new())), command);
        let config = MongoConfig::default();
        let store = Store::with_backend(Arc::new(backend), &config, ServerClock::default());
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let _logging = tracing::subscriber::set_default(subscriber);
        let stop = CancellationToken::new();
        let task = crate::host::spawn(run(store, None, stop.clone()));
        tokio::time::sleep(CHECK_EVERY * 5).await;
        stop.cancel();
        task.await.expect("the index task ends at shutdown");
        let text = String::from_utf8_lossy(&lines.0.lock().unwrap_or_else(|e| e.into_inner()))
            .into_owned();
        assert!(text.contains("could not create index"), "{text}");
        assert!(!text.contains("still building"), "{text}");
    }
}
