//! One collection over the [`Backend`]: the driver's call style (`coll.find(filter)
//! .projection(..).limit(..).await`), each call built as one [`Op`] and run by the backend
//! when awaited. Every read carries the collection's `maxTimeMS` ([`Coll::new`]): no call
//! site can forget it. Cheap to clone.

use std::fmt;
use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Duration;

use bson::{Bson, Document};
use futures::future::BoxFuture;

use crate::store::backend::{Backend, ChangeStream, MongoError, Op, Reply, Written};

/// A named collection of the backend's database.
#[derive(Clone)]
pub struct Coll {
    backend: Arc<dyn Backend>,
    name: Arc<str>,
    /// The `maxTimeMS` of every read ([`crate::store::Store::server_limit`]).
    max_time: Duration,
}

impl fmt::Debug for Coll {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Coll").field(&self.name).finish()
    }
}

impl Coll {
    /// `name` of the backend's database, its reads under `maxTimeMS` = `max_time`.
    pub fn new(backend: Arc<dyn Backend>, name: &str, max_time: Duration) -> Self {
        Self {
            backend,
            name: Arc::from(name),
            max_time,
        }
    }

    /// The collection's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The `maxTimeMS` of its reads, as a duration: also the bound of a call nothing else
    /// bounds (one spawned by a drop guard).
    pub fn max_time(&self) -> Duration {
        self.max_time
    }

    /// The backend it runs on.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The `maxTimeMS` of its reads, for the commands that read it (`listIndexes`, `count`).
    pub fn max_time_ms(&self) -> i64 {
        crate::store::max_time_ms(self.max_time)
    }

    fn call<T>(&self, op: Op, reply: fn(Reply) -> Option<T>) -> Call<T> {
        Call {
            backend: self.backend.clone(),
            coll: self.name.clone(),
            op,
            reply,
        }
    }

    /// The matching documents.
    pub fn find(&self, filter: Document) -> Call<Vec<Document>> {
        self.call(self.find_op(filter, None), |r| match r {
            Reply::Docs(d) => Some(d),
            _ => None,
        })
    }

    /// The first matching document.
    pub fn find_one(&self, filter: Document) -> Call<Option<Document>> {
        self.call(self.find_op(filter, Some(1)), |r| match r {
            Reply::Docs(d) => Some(d.into_iter().next()),
            _ => None,
        })
    }

    /// The `_id`s of the matching documents.
    pub fn find_ids(&self, filter: Document) -> Call<Vec<Bson>> {
        let ids = self.call(self.find_op(filter, None), |r| match r {
            Reply::Docs(d) => Some(crate::record::ids_of(d)),
            _ => None,
        });
        ids.projection(bson::doc! { "_id": 1 })
    }

    /// How many documents match (`countDocuments`).
    pub fn count_documents(&self, filter: Document) -> Call<u64> {
        let op = Op::Count {
            filter,
            limit: None,
            max_time: Some(self.max_time),
        };
        self.call(op, |r| match r {
            Reply::Count(n) => Some(n),
            _ => None,
        })
    }

    /// The distinct values of `field` among the matching documents.
    pub fn distinct(&self, field: &str, filter: Document) -> Call<Vec<Bson>> {
        let op = Op::Distinct {
            field: field.to_owned(),
            filter,
            max_time: Some(self.max_time),
        };
        self.call(op, |r| match r {
            Reply::Values(v) => Some(v),
            _ => None,
        })
    }

    fn update(&self, filter: Document, update: Document, many: bool) -> Call<Written> {
        let op = Op::Update {
            filter,
            update,
            many,
            upsert: false,
        };
        self.call(op, written)
    }

    pub fn update_one(&self, filter: Document, update: Document) -> Call<Written> {
        self.update(filter, update, false)
    }

    pub fn update_many(&self, filter: Document, update: Document) -> Call<Written> {
        self.update(filter, update, true)
    }

    pub fn replace_one(&self, filter: Document, replacement: Document) -> Call<Written> {
        let op = Op::Replace {
            filter,
            replacement,
            upsert: false,
        };
        self.call(op, written)
    }

    /// `findAndModify`: the document before the update, unless [`Call::return_new`].
    pub fn find_one_and_update(
        &self,
        filter: Document,
        update: Document,
    ) -> Call<Option<Document>> {
        let op = Op::FindOneAndUpdate {
            filter,
            update,
            sort: None,
            upsert: false,
            return_new: false,
            max_time: Some(self.max_time),
        };
        self.call(op, |r| match r {
            Reply::Doc(d) => Some(d),
            _ => None,
        })
    }

    pub fn delete_one(&self, filter: Document) -> Call<Written> {
        self.call(
            Op::Delete {
                filter,
                many: false,
            },
            written,
        )
    }

    pub fn delete_many(&self, filter: Document) -> Call<Written> {
        self.call(Op::Delete { filter, many: true }, written)
    }

    pub fn insert_one(&self, doc: Document) -> Call<Written> {
        self.insert_many(vec![doc])
    }

    pub fn insert_many(&self, docs: Vec<Document>) -> Call<Written> {
        self.call(
            Op::Insert {
                docs,
                ordered: true,
            },
            written,
        )
    }

    fn find_op(&self, filter: Document, limit: Option<i64>) -> Op {
        Op::Find {
            filter,
            projection: None,
            sort: None,
            limit,
            max_time: Some(self.max_time),
        }
    }

    /// A change stream of the collection, filtered by `pipeline`: raw change events.
    pub fn watch(
        &self,
        pipeline: Vec<Document>,
    ) -> BoxFuture<'static, Result<ChangeStream, MongoError>> {
        self.backend.watch(&self.name, pipeline)
    }
}

fn written(r: Reply) -> Option<Written> {
    match r {
        Reply::Written(w) => Some(w),
        _ => None,
    }
}

/// One call, built: set its options, then await it. An option the operation does not take
/// is ignored (as the driver's builders would not offer it).
#[must_use = "a call does nothing until awaited"]
pub struct Call<T> {
    backend: Arc<dyn Backend>,
    coll: Arc<str>,
    op: Op,
    reply: fn(Reply) -> Option<T>,
}

impl<T> Call<T> {
    pub fn projection(mut self, p: Document) -> Self {
        if let Op::Find { projection, .. } = &mut self.op {
            *projection = Some(p);
        }
        self
    }

    pub fn sort(mut self, s: Document) -> Self {
        match &mut self.op {
            Op::Find { sort, .. } | Op::FindOneAndUpdate { sort, .. } => *sort = Some(s),
            _ => {}
        }
        self
    }

    /// At most `n` documents.
    pub fn limit(mut self, n: i64) -> Self {
        match &mut self.op {
            Op::Find { limit, .. } => *limit = Some(n),
            Op::Count { limit, .. } => *limit = Some(u64::try_from(n).unwrap_or(0)),
            _ => {}
        }
        self
    }

    pub fn upsert(mut self, u: bool) -> Self {
        match &mut self.op {
            Op::Update { upsert, .. }
            | Op::Replace { upsert, .. }
            | Op::FindOneAndUpdate { upsert, .. } => *upsert = u,
            _ => {}
        }
        self
    }

    /// `findAndModify`: return the document after the update.
    pub fn return_new(mut self, new: bool) -> Self {
        if let Op::FindOneAndUpdate { return_new, .. } = &mut self.op {
            *return_new = new;
        }
        self
    }

    /// `insert`: stop at the first error (`true`, the default) or not.
    pub fn ordered(mut self, o: bool) -> Self {
        if let Op::Insert { ordered, .. } = &mut self.op {
            *ordered = o;
        }
        self
    }
}

impl<T: Send + 'static> IntoFuture for Call<T> {
    type Output = Result<T, MongoError>;
    type IntoFuture = BoxFuture<'static, Result<T, MongoError>>;

    fn into_future(self) -> Self::IntoFuture {
        let Call {
            backend,
            coll,
            op,
            reply,
        } = self;
        let name = op.name();
        let run = backend.run(&coll, op);
        Box::pin(async move {
            let r = run.await?;
            reply(r).ok_or_else(|| {
                MongoError::from(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("the backend answered {name} on {coll} with another kind of reply"),
                ))
            })
        })
    }
}
