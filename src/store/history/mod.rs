//! What fired, opt-in: `[history] keep = "7d"` records each fired timeout in
//! `<collection>_history` (never in `Timeouts`), with a TTL index on the send time, and
//! records parked and cancelled ones there too, with what was done and why.
//!
//! The daemon never waits for history: the dispatch loop hands each confirmed wave's rows to
//! [`HistorySink::record`], which queues them for [`run`], a task of its own that writes
//! them with one `insertMany` per wave (waves that queued up meanwhile go into the same
//! write), each under `[mongodb] operation_timeout`. The removal of the sent records does not
//! wait for it, and a failed write loses rows, never a record: it is counted
//! (`timeoutd_history_lost_total{reason="write_failed"}`) and logged. When the database is so
//! slow that [`QUEUED_WAVES`] waves wait, further rows are dropped and counted
//! (`reason="backlog"`) rather than held in memory.

pub mod read;

use std::time::Duration;

use bson::{Bson, DateTime, Document, doc};
use tokio::sync::mpsc;

pub use crate::config::HistoryConfig;
use crate::metrics as m;
use crate::record::id_key;
use crate::store::coll::Coll;
use crate::store::indexes::{create_index, index_spec};
use crate::store::{Store, StoreError};

/// Waves waiting for the writer at most; beyond that rows are dropped and counted.
pub const QUEUED_WAVES: usize = 64;
/// Most rows one write carries (queued waves are joined up to this).
pub const ROWS_PER_WRITE: usize = 10_000;
/// The TTL index on [`field::AT`].
pub const TTL_INDEX: &str = "timeoutd_history_ttl";
/// Fields of a history row.
pub mod field {
    /// `fired`, `parked` or `cancelled`.
    pub const EVENT: &str = "event";
    /// When it happened (server clock): the broker's confirm for `fired`. The TTL key.
    pub const AT: &str = "at";
    /// The record's id as `list` shows it.
    pub const TIMEOUT_ID: &str = "timeout_id";
    /// The record's `ProcessManagerId`, the message's CorrelationId.
    pub const CORRELATION_ID: &str = "correlation_id";
    pub const DESTINATION: &str = "destination";
    /// The record's due instant.
    pub const DUE: &str = "due";
    /// `at` minus `due`, in milliseconds.
    pub const LATE_MS: &str = "late_ms";
    /// Sends tried: 1 plus the failed sends counted before.
    pub const ATTEMPTS: &str = "attempts";
    pub const MESSAGE_ID: &str = "message_id";
    /// The instance that did it ([`crate::service::buildinfo::instance`]).
    pub const INSTANCE: &str = "instance";
    /// Parked: the park reason; cancelled: the operator's `--reason`.
    pub const REASON: &str = "reason";
    /// Parked: the error; cancelled: who ran it (`user@host`).
    pub const DETAIL: &str = "detail";
}

/// The event of a history row.
pub mod event {
    pub const FIRED: &str = "fired";
    pub const PARKED: &str = "parked";
    pub const CANCELLED: &str = "cancelled";
}

/// One row waiting for the writer; `attempts_of` is the timeout's `_id` when its count of
/// failed sends is still to be looked up (fired rows).
#[derive(Debug, Clone)]
pub struct Row {
    pub doc: Document,
    pub attempts_of: Option<Bson>,
}

/// A fired timeout, the broker having confirmed it at `at` (server clock).
pub fn fired(
    id: &Bson,
    record: &crate::record::TimeoutRecord,
    message_id: Option<String>,
    at: DateTime,
) -> Row {
    let late_ms = at
        .timestamp_millis()
        .saturating_sub(record.due.timestamp_millis());
    Row {
        doc: doc! {
            field::EVENT: event::FIRED,
            field::AT: at,
            field::TIMEOUT_ID: crate::record::display_id(id),
            field::CORRELATION_ID: record.process_manager_id.to_string(),
            field::DESTINATION: &record.destination,
            field::DUE: record.due,
            field::LATE_MS: late_ms,
            field::ATTEMPTS: 1_i64,
            field::MESSAGE_ID: message_id.map_or(Bson::Null, Bson::String),
            field::INSTANCE: crate::service::buildinfo::instance(),
        },
        attempts_of: Some(id.clone()),
    }
}

/// Anything else that ended a timeout: parked or cancelled, with why.
pub struct Ended<'a> {
    pub event: &'static str,
    pub timeout_id: String,
    pub correlation_id: Option<String>,
    pub destination: Option<String>,
    pub due: Option<DateTime>,
    pub attempts: Option<i64>,
    pub reason: Option<&'a str>,
    pub detail: Option<&'a str>,
}

impl Ended<'_> {
    pub fn row(&self, at: DateTime) -> Row {
        let opt = |v: Option<&str>| v.map_or(Bson::Null, |s| Bson::String(s.to_string()));
        Row {
            doc: doc! {
                field::EVENT: self.event,
                field::AT: at,
                field::TIMEOUT_ID: &self.timeout_id,
                field::CORRELATION_ID: opt(self.correlation_id.as_deref()),
                field::DESTINATION: opt(self.destination.as_deref()),
                field::DUE: self.due.map_or(Bson::Null, Bson::DateTime),
                field::ATTEMPTS: self.attempts.map_or(Bson::Null, Bson::Int64),
                field::INSTANCE: crate::service::buildinfo::instance(),
                field::REASON: opt(self.reason),
                field::DETAIL: opt(self.detail),
            },
            attempts_of: None,
        }
    }
}

/// Where the dispatch loop hands history rows; cheap to clone. Never waits.
#[derive(Debug, Clone)]
pub struct HistorySink {
    tx: mpsc::Sender<Vec<Row>>,
}

impl HistorySink {
    /// Queues one wave's rows for the writer; drops and counts them when it is backlogged.
    pub fn record(&self, rows: Vec<Row>) {
        if rows.is_empty() {
            return;
        }
        let n = rows.len();
        if let Err(e) = self.tx.try_send(rows) {
            m::history_lost("backlog", n);
            let why = match e {
                mpsc::error::TrySendError::Full(_) => "the history writer is backlogged",
                mpsc::error::TrySendError::Closed(_) => "the history writer has stopped",
            };
            tracing::warn!(
                rows = n,
                "{why}: these history rows are dropped (the timeouts themselves are unaffected)"
            );
        }
    }
}

/// A sink and the receiving end for [`run`].
pub fn channel() -> (HistorySink, mpsc::Receiver<Vec<Row>>) {
    let (tx, rx) = mpsc::channel(QUEUED_WAVES);
    (HistorySink { tx }, rx)
}

/// The daemon's `history` task, the writer: one write per wave (or per set of waves that
/// queued meanwhile), until every sink is gone (the dispatch loop ended). Its indexes are
/// the `indexes` task's ([`crate::store::indexes::run`]).
pub async fn run(store: Store, rx: mpsc::Receiver<Vec<Row>>) {
    let mut queue = Queue { rx, writing: 0 };
    while let Some(mut rows) = queue.rx.recv().await {
        while rows.len() < ROWS_PER_WRITE
            && let Ok(more) = queue.rx.try_recv()
        {
            rows.extend(more);
        }
        let n = rows.len();
        queue.writing = n;
        // Each MongoDB call of the write carries its own deadline (see `write_history`).
        let written = store.write_history(rows).await;
        queue.writing = 0;
        match written {
            Ok(()) => m::history_written(n),
            Err(e) => {
                m::history_lost("write_failed", n);
                tracing::warn!(rows = n, error = %e, "could not write history rows; the timeouts themselves were sent and removed");
            }
        }
    }
}

/// The writer's queue, and how many rows its write in progress holds. Dropped before the
/// queue ran dry (the drain's deadline aborted the writer, MongoDB not answering at
/// shutdown), the rows left are counted lost; before (found in review), they went
/// uncounted.
struct Queue {
    rx: mpsc::Receiver<Vec<Row>>,
    writing: usize,
}

impl Drop for Queue {
    fn drop(&mut self) {
        let mut left = self.writing;
        while let Ok(rows) = self.rx.try_recv() {
            left += rows.len();
        }
        if left > 0 {
            m::history_lost("shutdown", left);
            tracing::warn!(
                rows = left,
                "history rows not written before the end of the shutdown's drain; the timeouts themselves were sent and removed"
            );
        }
    }
}

impl Store {
    /// The history collection: `<collection>_history`.
    pub fn history(&self) -> Coll {
        let name = format!("{}_history", self.coll.name());
        Coll::new(self.backend.clone(), &name, self.server_limit())
    }

    /// The TTL index on the send time (`keep`; an existing index with another expiry is
    /// changed with `collMod`) and the indexes `timeoutd history` reads by.
    pub async fn ensure_history_indexes(&self, keep: Duration) -> Result<(), StoreError> {
        let coll = self.history();
        let ttl = index_spec(TTL_INDEX, doc! { field::AT: 1 }, Some(keep));
        if let Err(e) = self.query(create_index(&coll, ttl)).await {
            // Most likely the index exists with another `keep`: change it in place.
            let secs = i64::try_from(keep.as_secs()).unwrap_or(i64::MAX);
            let change = doc! {
                "collMod": coll.name(),
                "index": { "name": TTL_INDEX, "expireAfterSeconds": secs },
            };
            let change = self.command(change);
            crate::deadline::within(self.op_timeout, "change the history's expiry", change)
                .await
                .map_err(|_| e)?;
        }
        for (name, keys) in [
            (
                "timeoutd_history_correlation",
                doc! { field::CORRELATION_ID: 1, field::AT: -1 },
            ),
            ("timeoutd_history_timeout", doc! { field::TIMEOUT_ID: 1 }),
        ] {
            self.query(create_index(&coll, index_spec(name, keys, None)))
                .await?;
        }
        Ok(())
    }

    /// Writes rows, their attempt counts looked up first. The look-up and the insert are two
    /// calls, each under its own `[mongodb] operation_timeout`: a look-up that fails or times
    /// out leaves the counts at 1 and the rows are still written (the rows matter more than
    /// the count), never lost with it.
    pub async fn write_history(&self, mut rows: Vec<Row>) -> Result<(), StoreError> {
        // Tests only: a history write that fails.
        #[cfg(feature = "failpoints")]
        if fail::eval("history-write", |_| ()).is_some() {
            return Err(crate::deadline::Elapsed {
                what: "write history",
                limit: Duration::ZERO,
            }
            .into());
        }
        let ids: Vec<Bson> = rows.iter().filter_map(|r| r.attempts_of.clone()).collect();
        if !ids.is_empty() {
            match self
                .bounded(
                    "read failed-send counts for history",
                    self.attempt_counts(&ids),
                )
                .await
            {
                Ok(counts) => {
                    for r in &mut rows {
                        let failed = r
                            .attempts_of
                            .as_ref()
                            .and_then(|id| counts.get(&id_key(id)));
                        if let Some(failed) = failed {
                            r.doc.insert(field::ATTEMPTS, failed.saturating_add(1));
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "could not read failed-send counts for history; writing the rows without them")
                }
            }
        }
        let docs: Vec<Document> = rows.into_iter().map(|r| r.doc).collect();
        self.bounded("write history", async {
            Ok(self
                .history()
                .insert_many(docs)
                .ordered(false)
                .await
                .map(|_| ())?)
        })
        .await
    }

    /// The failed-send counts of `ids`, by [`id_key`] (one pass, however many rows).
    async fn attempt_counts(
        &self,
        ids: &[Bson],
    ) -> Result<std::collections::HashMap<Vec<u8>, i64>, StoreError> {
        // Tests only: a look-up that never answers (its deadline ends it).
        #[cfg(feature = "failpoints")]
        if fail::eval("history-attempts-stall", |_| ()).is_some() {
            std::future::pending::<()>().await;
        }
        let counted: Vec<Document> = self
            .attempts
            .find(doc! { "_id": { "$in": ids } })
            .projection(doc! { "attempts": 1 })
            .await?;
        Ok(counted
            .iter()
            .filter_map(|c| {
                let id = c.get("_id")?;
                Some((
                    id_key(id),
                    crate::store::int(c, "attempts").unwrap_or(0).max(0),
                ))
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::config::MongoConfig;
    use crate::store::ServerClock;
    use crate::store::backend::{Answering, Op, Reply, command_error};

    /// Found in review (helper-33): rows still queued, or in a write, when the drain's
    /// deadline aborted the writer (MongoDB not answering at shutdown) went uncounted.
    #[tokio::test(start_paused = true)]
    async fn rows_left_when_the_writer_is_stopped_are_counted_lost() {
        let recorder = crate::service::http::prometheus();
        let lost = |text: &str| -> f64 {
            text.lines()
                .find_map(|l| {
                    l.strip_prefix("timeoutd_history_lost_total{reason=\"shutdown\"} ")?
                        .trim()
                        .parse()
                        .ok()
                })
                .unwrap_or(0.0)
        };
        let before = lost(&recorder.render());
        let backend = Answering::new(|_: Op| crate::store::backend::Answer::Never);
        let config = MongoConfig::default();
        let store = Store::with_backend(Arc::new(backend), &config, ServerClock::default());
        let row = || Row {
            doc: doc! { "event": "fired" },
            attempts_of: None,
        };
        let (sink, rx) = channel();
        sink.record(vec![row(), row(), row()]);
        let writer = crate::host::spawn(run(store, rx));
        // The writer is in its write of three; two more rows queue behind it.
        tokio::time::sleep(Duration::from_millis(10)).await;
        sink.record(vec![row(), row()]);
        writer.abort();
        assert!(writer.await.is_err(), "aborted");
        assert_eq!(lost(&recorder.render()) - before, 5.0);
    }

    /// A `keep` changed since the TTL index was made is applied with `collMod`, which carries
    /// the server's deadline like every command but `createIndexes` (it went without one).
    #[tokio::test]
    async fn a_changed_keep_is_applied_under_max_time() {
        let sent: Arc<Mutex<Vec<Document>>> = Arc::default();
        let kept = sent.clone();
        let command = move |c: Document| {
            kept.lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(c.clone());
            let ttl = c.contains_key("createIndexes") && c.to_string().contains(TTL_INDEX);
            match ttl {
                true => Err(command_error(85, "IndexOptionsConflict", "another expiry")),
                false => Ok(doc! { "ok": 1 }),
            }
        };
        let ops = |_: Op| Ok(Reply::Docs(Vec::new()));
        let backend = Arc::new(Answering(ops, command));
        let config = MongoConfig::default();
        let store = Store::with_backend(backend, &config, ServerClock::default());
        store
            .ensure_history_indexes(Duration::from_secs(3_600))
            .await
            .expect("the indexes");
        let sent = sent.lock().unwrap_or_else(|e| e.into_inner());
        let change = sent.iter().find(|c| c.contains_key("collMod"));
        let limit = crate::store::max_time_ms(store.server_limit());
        assert_eq!(
            change.and_then(|c| c.get("maxTimeMS")),
            Some(&Bson::Int64(limit)),
            "{sent:?}"
        );
    }
}
