//! The seam under [`crate::store::Store`]: MongoDB at the level of collection operations.
//!
//! Everything the store asks of MongoDB is one [`Op`] on one named collection, one database
//! command (`hello`, `buildInfo`, `collMod`, `count`, `createIndexes`, `listIndexes`,
//! `dropIndexes`), or one change stream. [`Backend`] runs them: [`Driver`](crate::store::driver) with the
//! `mongodb` crate in the daemon, an in-memory model in the simulation (`sim/`). The lease
//! filters, the shape learner, the read window, the paused head and the claim's drop guard all
//! sit above this seam, so they run as real code under the simulation.
//!
//! Errors are the driver's own [`mongodb::error::Error`], so that the code that classifies
//! them (timeouts, `NotWritablePrimary`, `MaxTimeMSExpired`) is the same for both. A model
//! builds them with [`command_error`] and `From<std::io::Error>`.

use std::fmt;
use std::time::Duration;

use bson::{Bson, Document};
use futures::future::BoxFuture;
use futures::stream::BoxStream;

/// The driver's error type, returned by every backend.
pub type MongoError = mongodb::error::Error;

/// One operation on one collection, as data.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// `find`: the matching documents, at most `limit`, in `sort` order, each projected.
    Find {
        filter: Document,
        projection: Option<Document>,
        sort: Option<Document>,
        limit: Option<i64>,
        /// `maxTimeMS`; `None` only where the caller has a reason to send none.
        max_time: Option<Duration>,
    },
    /// `count` (the driver's `countDocuments`).
    Count {
        filter: Document,
        limit: Option<u64>,
        max_time: Option<Duration>,
    },
    /// `distinct` values of `field` among the matching documents.
    Distinct {
        field: String,
        filter: Document,
        max_time: Option<Duration>,
    },
    /// `update` with an update document (`$set`, `$unset`, `$inc`, ...), one or many.
    Update {
        filter: Document,
        update: Document,
        many: bool,
        upsert: bool,
    },
    /// `update` with a whole replacement document (one).
    Replace {
        filter: Document,
        replacement: Document,
        upsert: bool,
    },
    /// `findAndModify` with an update document; the document after the update when
    /// `return_new`, else before it.
    FindOneAndUpdate {
        filter: Document,
        update: Document,
        sort: Option<Document>,
        upsert: bool,
        return_new: bool,
        max_time: Option<Duration>,
    },
    /// `delete`, one or many.
    Delete { filter: Document, many: bool },
    /// `insert`, in order (stops at the first error) or not.
    Insert { docs: Vec<Document>, ordered: bool },
}

impl Op {
    /// A short name for the operation (traces, errors).
    pub fn name(&self) -> &'static str {
        match self {
            Op::Find { .. } => "find",
            Op::Count { .. } => "count",
            Op::Distinct { .. } => "distinct",
            Op::Update { many: true, .. } => "updateMany",
            Op::Update { many: false, .. } => "updateOne",
            Op::Replace { .. } => "replaceOne",
            Op::FindOneAndUpdate { .. } => "findOneAndUpdate",
            Op::Delete { many: true, .. } => "deleteMany",
            Op::Delete { many: false, .. } => "deleteOne",
            Op::Insert { .. } => "insert",
        }
    }
}

/// What an [`Op`] answered.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// `Find`.
    Docs(Vec<Document>),
    /// `Count`.
    Count(u64),
    /// `Distinct`.
    Values(Vec<Bson>),
    /// `Update`, `Replace`, `Delete`, `Insert`.
    Written(Written),
    /// `FindOneAndUpdate`.
    Doc(Option<Document>),
}

/// The counts of a write.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Written {
    pub matched: u64,
    pub modified: u64,
    pub deleted: u64,
    pub inserted: u64,
    pub upserted_id: Option<Bson>,
}

/// A change stream: each item is the server's answer to one read of it (a `getMore`):
/// `Some` change event as the server sends it (`operationType`, `fullDocument`, `documentKey`,
/// ...), or `None` when the server had nothing new within [`AWAIT`]. An open stream answers at
/// least once per `AWAIT`, so its follower can tell a quiet stream from a stalled one.
pub type ChangeStream = BoxStream<'static, Result<Option<Document>, MongoError>>;

/// How long the server may hold one read of a change stream before it answers that it has
/// nothing new (`maxAwaitTimeMS`): MongoDB's default, asked for explicitly.
pub const AWAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// MongoDB, as the store sees it. Cheap to share (`Arc<dyn Backend>`).
///
/// Every method returns a future that owns what it needs (`'static`), so a caller can drop
/// it at any await: the operation may still run to its end on the server, as a real one
/// does after the client gave up on it.
pub trait Backend: Send + Sync + fmt::Debug + 'static {
    /// Runs one operation on `collection` of the database.
    fn run(&self, collection: &str, op: Op) -> BoxFuture<'static, Result<Reply, MongoError>>;

    /// Runs one database command and returns its reply.
    fn command(&self, command: Document) -> BoxFuture<'static, Result<Document, MongoError>>;

    /// Opens a change stream on `collection` with `pipeline`.
    fn watch(
        &self,
        collection: &str,
        pipeline: Vec<Document>,
    ) -> BoxFuture<'static, Result<ChangeStream, MongoError>>;

    /// Ends the client's sessions and background work (the daemon's exit).
    fn shutdown(&self) -> BoxFuture<'static, ()>;
}

/// A server's command error (`{ok: 0, code, codeName, errmsg}`) as the driver reports it:
/// for models, so that error classification sees what the real driver gives.
pub fn command_error(code: i32, code_name: &str, message: &str) -> MongoError {
    let reply = bson::doc! { "code": code, "codeName": code_name, "errmsg": message };
    match bson::from_document::<mongodb::error::CommandError>(reply) {
        Ok(e) => MongoError::from(mongodb::error::ErrorKind::Command(e)),
        Err(e) => MongoError::custom(format!("{code_name} ({code}): {message} [{e}]")),
    }
}

/// What a test backend's function answers to one call: a result at once or later, or nothing
/// ever (a call the server takes and never answers). A `Result` converts into `Now`.
#[cfg(test)]
pub(crate) enum Answer<T> {
    Now(Result<T, MongoError>),
    /// The result, once this much (virtual) time has passed: a slow server.
    After(std::time::Duration, Result<T, MongoError>),
    Never,
}

#[cfg(test)]
impl<T> From<Result<T, MongoError>> for Answer<T> {
    fn from(result: Result<T, MongoError>) -> Self {
        Self::Now(result)
    }
}

#[cfg(test)]
impl<T: Send + 'static> Answer<T> {
    fn future(self) -> BoxFuture<'static, Result<T, MongoError>> {
        match self {
            Self::Now(result) => Box::pin(async move { result }),
            Self::After(wait, result) => Box::pin(async move {
                tokio::time::sleep(wait).await;
                result
            }),
            Self::Never => Box::pin(futures::future::pending()),
        }
    }
}

/// A backend whose collection operations one function answers and whose commands another
/// does ([`Answering::new`]: `ok`), each with a result or an [`Answer`], for unit tests that
/// need no server; change streams cannot be opened.
#[cfg(test)]
pub(crate) struct Answering<F, C = fn(Document) -> Result<Document, MongoError>>(pub F, pub C);

#[cfg(test)]
impl<F> Answering<F> {
    pub fn new(ops: F) -> Self {
        Self(ops, |_| Ok(bson::doc! { "ok": 1 }))
    }
}

#[cfg(test)]
impl<F, C> fmt::Debug for Answering<F, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Answering")
    }
}

#[cfg(test)]
impl<F, C, R, D> Backend for Answering<F, C>
where
    F: Fn(Op) -> R + Send + Sync + 'static,
    C: Fn(Document) -> D + Send + Sync + 'static,
    R: Into<Answer<Reply>>,
    D: Into<Answer<Document>>,
{
    fn run(&self, _: &str, op: Op) -> BoxFuture<'static, Result<Reply, MongoError>> {
        (self.0)(op).into().future()
    }

    fn command(&self, command: Document) -> BoxFuture<'static, Result<Document, MongoError>> {
        (self.1)(command).into().future()
    }

    fn watch(
        &self,
        _: &str,
        _: Vec<Document>,
    ) -> BoxFuture<'static, Result<ChangeStream, MongoError>> {
        Box::pin(async {
            Err(command_error(
                40573,
                "Location40573",
                "no change streams here",
            ))
        })
    }

    fn shutdown(&self) -> BoxFuture<'static, ()> {
        Box::pin(async {})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_error_carries_its_code() {
        let e = command_error(50, "MaxTimeMSExpired", "operation exceeded time limit");
        match *e.kind {
            mongodb::error::ErrorKind::Command(ref c) => {
                assert_eq!(c.code, 50);
                assert_eq!(c.code_name, "MaxTimeMSExpired");
            }
            ref other => panic!("not a command error: {other:?}"),
        }
    }
}
