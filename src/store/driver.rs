//! [`Driver`]: the [`Backend`] of the daemon, MongoDB through the `mongodb` crate.
//!
//! Each [`Op`] becomes the one driver call it names, with its options (projection, sort,
//! limit, `maxTimeMS`, upsert, the document returned); commands go to `runCommand` on the
//! database; change streams yield each event as the raw document the server sent.

use std::future::IntoFuture;
use std::time::Duration;

use bson::{Document, RawDocumentBuf};
use futures::future::BoxFuture;
use futures::{StreamExt, TryStreamExt};
use mongodb::options::{
    Acknowledgment, ClientOptions, CountOptions, DistinctOptions, FindOneAndUpdateOptions,
    FindOptions, ReturnDocument,
};
use mongodb::results::UpdateResult;
use mongodb::{Client, Database};
use std::sync::Arc;
use tokio::sync::OnceCell;

use crate::config::MongoConfig;
use crate::record::from_stored;
use crate::store::StoreError;
use crate::store::backend::{AWAIT, Backend, ChangeStream, MongoError, Op, Reply, Written};

/// MongoDB through the `mongodb` driver: one database of one client.
///
/// The client is built at the first call, not at start-up: for a `mongodb+srv://` URI that
/// resolves DNS (the SRV and TXT records), and a resolver not ready yet (a pod starting, a
/// host booting) or failing for a while is a database not reachable yet, waited for and
/// retried as one, under each call's deadline. Built at start-up (found in review, helper-38),
/// such a failure ended the daemon with exit 1, blaming `mongodb.uri`.
#[derive(Debug, Clone)]
pub struct Driver {
    client: Arc<OnceCell<Client>>,
    /// What builds the client: the URI and the TLS files.
    config: Arc<MongoConfig>,
    database: String,
    /// The write concern and read preference the URI set, for
    /// [`crate::store::Store::durability_risks`].
    pub(crate) write_concern: Option<mongodb::options::WriteConcern>,
    pub(crate) selection: Option<mongodb::options::SelectionCriteria>,
}

impl Driver {
    /// Reads the URI (no DNS) and keeps what builds a client for `[mongodb] database`.
    /// Refuses a URI the driver cannot read and an unacknowledged write concern (w=0).
    pub async fn connect(config: &MongoConfig) -> Result<Self, StoreError> {
        let uri = mongodb::options::ConnectionString::parse(&config.uri)
            .map_err(|e| StoreError::InvalidUri(crate::redact::redact_text(&e.kind.to_string())))?;
        if let Some(wc) = &uri.write_concern
            && wc.w == Some(Acknowledgment::Nodes(0))
        {
            return Err(StoreError::UnacknowledgedWriteConcern);
        }
        Ok(Self {
            client: Arc::new(OnceCell::new()),
            config: Arc::new(config.clone()),
            database: config.database.clone(),
            write_concern: uri.write_concern.clone(),
            selection: uri
                .read_preference
                .clone()
                .map(mongodb::options::SelectionCriteria::ReadPreference),
        })
    }

    /// A backend over a database of a client built elsewhere (tests).
    pub fn new(db: Database) -> Self {
        Self {
            client: Arc::new(OnceCell::new_with(Some(db.client().clone()))),
            config: Arc::new(MongoConfig::default()),
            database: db.name().to_owned(),
            write_concern: None,
            selection: None,
        }
    }

    /// The same client's database `name`.
    pub fn with_database(&self, name: &str) -> Self {
        Self {
            database: name.to_owned(),
            ..self.clone()
        }
    }

    /// The database, its client built first if it was not yet.
    async fn database(&self) -> Result<Database, MongoError> {
        let client = self.client.get_or_try_init(|| build(&self.config)).await?;
        Ok(client.database(&self.database))
    }
}

/// Parses the URI (resolving DNS for `mongodb+srv://`) and builds a client.
async fn build(config: &MongoConfig) -> Result<Client, MongoError> {
    let mut options = ClientOptions::parse(&config.uri).await?;
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
    Client::with_options(options)
}

async fn run(db: Database, collection: String, op: Op) -> Result<Reply, MongoError> {
    let coll = db.collection::<Document>(&collection);
    let updated = |r: UpdateResult| {
        Reply::Written(Written {
            matched: r.matched_count,
            modified: r.modified_count,
            upserted_id: r.upserted_id,
            ..Written::default()
        })
    };
    match op {
        Op::Find {
            filter,
            projection,
            sort,
            limit,
            max_time,
        } => {
            let options = FindOptions::builder()
                .projection(projection)
                .sort(sort)
                .limit(limit)
                .max_time(max_time)
                .build();
            // Raw, each read on its own: see `crate::record::from_stored`.
            let raw = coll.clone_with_type::<RawDocumentBuf>();
            let found: Vec<RawDocumentBuf> = raw
                .find(filter)
                .with_options(options)
                .await?
                .try_collect()
                .await?;
            Ok(Reply::Docs(found.iter().map(|d| from_stored(d)).collect()))
        }
        Op::Count {
            filter,
            limit,
            max_time,
        } => {
            let options = CountOptions::builder().limit(limit).max_time(max_time);
            let count = coll.count_documents(filter).with_options(options.build());
            Ok(Reply::Count(count.await?))
        }
        Op::Distinct {
            field,
            filter,
            max_time,
        } => {
            let options = DistinctOptions::builder().max_time(max_time).build();
            let values = coll.distinct(field, filter).with_options(options);
            Ok(Reply::Values(values.await?))
        }
        Op::Update {
            filter,
            update,
            many: true,
            upsert,
        } => Ok(updated(
            coll.update_many(filter, update).upsert(upsert).await?,
        )),
        Op::Update {
            filter,
            update,
            upsert,
            ..
        } => Ok(updated(
            coll.update_one(filter, update).upsert(upsert).await?,
        )),
        Op::Replace {
            filter,
            replacement,
            upsert,
        } => Ok(updated(
            coll.replace_one(filter, replacement).upsert(upsert).await?,
        )),
        Op::FindOneAndUpdate {
            filter,
            update,
            sort,
            upsert,
            return_new,
            max_time,
        } => {
            let options = FindOneAndUpdateOptions::builder()
                .sort(sort)
                .upsert(upsert)
                .max_time(max_time)
                .return_document(match return_new {
                    true => ReturnDocument::After,
                    false => ReturnDocument::Before,
                })
                .build();
            let raw = coll.clone_with_type::<RawDocumentBuf>();
            let call = raw
                .find_one_and_update(filter, update)
                .with_options(options);
            Ok(Reply::Doc(call.await?.as_deref().map(from_stored)))
        }
        Op::Delete { filter, many } => {
            let r = match many {
                true => coll.delete_many(filter).await?,
                false => coll.delete_one(filter).await?,
            };
            Ok(Reply::Written(Written {
                deleted: r.deleted_count,
                ..Written::default()
            }))
        }
        Op::Insert { mut docs, ordered } => {
            // One document goes as `insert_one`, so that its errors (a duplicate key) are the
            // write errors the callers classify, not an `InsertMany` error.
            let inserted = if docs.len() == 1 {
                let doc = docs.pop().unwrap_or_default();
                coll.insert_one(doc).await?;
                1
            } else if docs.is_empty() {
                0
            } else {
                let r = coll.insert_many(docs).ordered(ordered).await?;
                u64::try_from(r.inserted_ids.len()).unwrap_or(u64::MAX)
            };
            Ok(Reply::Written(Written {
                inserted,
                ..Written::default()
            }))
        }
    }
}

impl Backend for Driver {
    fn run(&self, collection: &str, op: Op) -> BoxFuture<'static, Result<Reply, MongoError>> {
        let (driver, collection) = (self.clone(), collection.to_owned());
        Box::pin(async move { run(driver.database().await?, collection, op).await })
    }

    fn command(&self, command: Document) -> BoxFuture<'static, Result<Document, MongoError>> {
        let driver = self.clone();
        Box::pin(async move {
            let db = driver.database().await?;
            db.run_command(command).into_future().await
        })
    }

    fn watch(
        &self,
        collection: &str,
        pipeline: Vec<Document>,
    ) -> BoxFuture<'static, Result<ChangeStream, MongoError>> {
        let (driver, collection) = (self.clone(), collection.to_owned());
        Box::pin(async move {
            let coll = driver.database().await?.collection::<Document>(&collection);
            let stream = coll
                .watch()
                .pipeline(pipeline)
                .max_await_time(AWAIT)
                .await?
                .with_type::<RawDocumentBuf>();
            // One item per read (`getMore`), an empty one included, rather than the driver's
            // `Stream`, which reads again in silence until an event comes: a read the server
            // never answers would look like a quiet stream. Ends once the cursor is closed.
            Ok(futures::stream::unfold(stream, |mut stream| async move {
                if !stream.is_alive() {
                    return None;
                }
                let read = stream.next_if_any().await;
                let read = read.map(|event| event.as_deref().map(from_stored));
                Some((read, stream))
            })
            .boxed())
        })
    }

    fn shutdown(&self) -> BoxFuture<'static, ()> {
        // A client never built has nothing to close.
        let Some(client) = self.client.get().cloned() else {
            return Box::pin(async {});
        };
        Box::pin(async move {
            // Dropped before the shutdown finished (its deadline), this clone is leaked on
            // purpose: the last drop of a client spawns an `endSessions` task that can race
            // the runtime's end, and the driver panics (`connection_requester.rs:42`, a send
            // to its connection pool's stopped worker). Hence `Store::close` before the end.
            let kept = Leaked(Some(client.clone()));
            client.shutdown().await;
            kept.release();
        })
    }
}

/// A client clone that is forgotten, never dropped, unless released.
struct Leaked(Option<Client>);

impl Leaked {
    fn release(mut self) {
        drop(self.0.take());
    }
}

impl Drop for Leaked {
    fn drop(&mut self) {
        if let Some(client) = self.0.take() {
            std::mem::forget(client);
        }
    }
}
