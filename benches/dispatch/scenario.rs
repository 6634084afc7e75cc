//! What every scenario shares (services, scale, collection shape), each scenario's own
//! database and queue, and the records it inserts.

use super::*;

/// What every scenario shares.
pub(crate) struct Ctx {
    pub(crate) mongo_uri: String,
    pub(crate) amqp_uri: String,
    pub(crate) client: Client,
    pub(crate) admin: Connection,
    pub(crate) admin_channel: Channel,
    pub(crate) scale: f64,
    pub(crate) bin: PathBuf,
    pub(crate) work: tempfile::TempDir,
    pub(crate) run_id: String,
    pub(crate) rabbit: RabbitConfig,
    /// Whether the consumer receives while the records are sent (`live`), or only once the
    /// timed part is over (`after`: the queue fills, so confirms wait for the disk).
    pub(crate) live: bool,
    /// `timeoutd check-config` with the daemons' environment, captured once.
    pub(crate) effective_config: std::sync::Mutex<Option<String>>,
    /// The shape of every scenario's collection (`TIMEOUTD_BENCH_SHAPE`).
    pub(crate) shape: Shape,
    /// The MongoDB server's process, when the bench started it (for its CPU time).
    pub(crate) mongo_pid: Option<u32>,
}

impl Ctx {
    pub(crate) fn scaled(&self, n: f64, min: u64) -> u64 {
        ((n * self.scale).round() as u64).max(min)
    }

    pub(crate) fn mongo_config(&self, db: &str) -> MongoConfig {
        MongoConfig {
            uri: self.mongo_uri.clone(),
            database: db.to_string(),
            time_encoding: self.shape.encoding(),
            uuid_representation: self.shape.uuids(),
            ..MongoConfig::default()
        }
    }
}

/// One scenario's database and queue.
pub(crate) struct Scen {
    pub(crate) db: String,
    pub(crate) queue: String,
    pub(crate) coll: Collection<Document>,
    pub(crate) shape: Shape,
}

impl Scen {
    pub(crate) async fn new(ctx: &Ctx, key: &str) -> Result<Self> {
        let db = format!("timeoutd_bench_{}_{}", ctx.run_id, key.replace('-', "_"));
        let queue = format!("timeoutd-bench-{}-{}", ctx.run_id, key);
        let coll = ctx.client.database(&db).collection::<Document>("Timeouts");
        // Durable, as ServiceConnect's queues are; persistent messages reach the disk.
        ctx.admin_channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .context("declare queue")?;
        // The collection as users have it (v7's indexes, say) before anything runs on it.
        ctx.shape
            .prepare(&coll)
            .await
            .context("prepare the collection")?;
        Ok(Self {
            db,
            queue,
            coll,
            shape: ctx.shape,
        })
    }

    pub(crate) async fn cleanup(&self, ctx: &Ctx) {
        let _ = ctx
            .admin_channel
            .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
            .await;
        let _ = ctx.client.database(&self.db).drop().await;
    }
}

pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as i64
}

pub(crate) fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros() as i64
}

pub(crate) fn record(destination: &str, due_ms: i64) -> TimeoutRecord {
    TimeoutRecord {
        id: Uuid::new_v4(),
        destination: destination.to_string(),
        process_manager_id: Uuid::new_v4(),
        due: DateTime::from_millis(due_ms),
        headers: Document::new(),
    }
}

/// Expected records: id to due instant (Unix ms).
pub(crate) type Expected = HashMap<u128, i64>;

/// Inserts records in chunks of [`INSERT_CHUNK`]; `due_of(i)` is the due instant of the
/// i-th. Returns the expected map (when `track`) and the seconds it took.
pub(crate) async fn insert_records(
    scen: &Scen,
    n: u64,
    track: bool,
    due_of: impl Fn(u64) -> i64,
) -> Result<(Expected, f64)> {
    let started = Instant::now();
    let mut expected = Expected::new();
    let mut i = 0;
    while i < n {
        let end = (i + INSERT_CHUNK as u64).min(n);
        let mut docs = Vec::with_capacity((end - i) as usize);
        for j in i..end {
            let r = record(&scen.queue, due_of(j));
            if track {
                expected.insert(r.id.as_u128(), r.due.timestamp_millis());
            }
            docs.push(scen.shape.document(&r));
        }
        scen.coll.insert_many(docs).await.context("insert_many")?;
        i = end;
    }
    Ok((expected, started.elapsed().as_secs_f64()))
}

/// `n` records due over the last minute, oldest first.
pub(crate) fn due_in_past(n: u64) -> impl Fn(u64) -> i64 {
    let base = now_ms() - 60_000;
    move |i| base + (i as i64 * 59_000) / n.max(1) as i64
}
