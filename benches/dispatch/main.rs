//! `cargo bench --bench dispatch`: the dispatch benchmark of issue 5.
//!
//! Scenarios, each in its own MongoDB database and its own RabbitMQ queue, removed afterwards:
//!
//! - `raw`: the broker's limit in this run: persistent publishes with confirms, pipelined
//!   (a sliding window of unconfirmed publishes, one channel), of messages shaped exactly like
//!   timeoutd's, to one durable queue;
//! - `baseline`: ServiceConnect v7's algorithm, in this process: the v7 claim (candidates,
//!   compare-and-swap `updateMany`, read back by owner), then per record one publish with its
//!   confirm awaited and one owner-guarded `deleteOne`;
//! - `timeoutd-1`, `timeoutd-3`: one and three `timeoutd run` processes draining the same due
//!   records;
//! - `lateness-timeoutd`, `lateness-baseline`: records due uniformly over 30 s at 500/s,
//!   poll interval 1 s; lateness is the consumer's receive instant minus the due instant;
//! - `claim-small`, `claim-large`: `Store::claim` of 500 due records with 10k and with 1M
//!   future records in the collection (scenario key `claim`); `claim-backlog`, not a target:
//!   the same with 50k due records waiting as well, what a drain's claims face;
//! - `claim-paused` (issue 14): claims of 500 with 100k due records of a paused destination
//!   at the head of the due range, per `Time` shape, against the same without them
//!   (`benches/dispatch/paused.rs`);
//! - `rss`: one `timeoutd run` draining 100k due records; its peak RSS (`VmHWM`).
//!
//! Throughput is counted by a consumer on the destination queue (deliveries per `MessageId`,
//! which is the record id; duplicates are deliveries beyond the first) together with the time
//! until the collection is empty.
//!
//! Environment:
//! - `TIMEOUTD_BENCH_MONGODB_URI`: a MongoDB to use (default: start `secantusd-rs` on a free
//!   port in a temporary directory);
//! - `TIMEOUTD_BENCH_AMQP_URI`: RabbitMQ (default `amqp://guest:guest@127.0.0.1:5672/%2f`);
//! - `TIMEOUTD_BENCH_SCALE`: multiplies every record count and the lateness window
//!   (1 = the sizes, 0.1 for a quick run);
//! - `TIMEOUTD_BENCH_OUT`: where the JSON goes (default `target/bench/dispatch.json`);
//! - `TIMEOUTD_BENCH_ONLY`: comma-separated scenario keys (`raw,baseline,timeoutd-1,
//!   timeoutd-3,lateness-timeoutd,lateness-baseline,claim,claim-paused,rss`), default all;
//! - `TIMEOUTD_BENCH_BIN`: the `timeoutd` executable (default: the one cargo built with this
//!   bench);
//! - `TIMEOUTD_BENCH_RAW_WINDOW`: unconfirmed publishes in flight for `raw` (default 1000);
//! - `TIMEOUTD_BENCH_RAW_REPS`: `raw` runs, the best counts (default 3);
//! - `TIMEOUTD_BENCH_CONSUMER`: `live` (default) counts deliveries while records are sent,
//!   and a drain ends when all were received and the collection is empty; `after` leaves the
//!   queue without a consumer until the timed part is over (a drain ends when the collection
//!   is empty, `raw` when all are confirmed; confirms then wait for the disk), then counts.
//!   The lateness scenarios always count live;
//! - `TIMEOUTD_BENCH_CLAIM_REPS`: timed claims per size after one untimed warm-up claim, the
//!   median is reported (default 9);
//! - `TIMEOUTD_BENCH_DUMP_DIR`: write each lateness scenario's per-record due and receive
//!   instants there as CSV;
//! - `TIMEOUTD_<SECTION>__<KEY>` set in the environment reach the daemons too (the bench sets
//!   URIs, database, listen address and log level itself; `dispatch.poll_interval` defaults to
//!   1s and `dispatch.batch_size` to 500 unless set).
//!
//! Run by `cargo test --all-targets` (without `--bench`) it only prints how to run it.

mod floors;
mod paused;
mod shape;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail};
use bson::{Bson, DateTime, Document, doc};
use futures::stream::FuturesUnordered;
use futures::{StreamExt, TryStreamExt};
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Confirmation, Connection, ConnectionProperties};
use mongodb::{Client, Collection};
use serde::Serialize;
use serde_json::{Value, json};
use timeoutd::clock::ServerClock;
use timeoutd::config::{MongoConfig, RabbitConfig};
use timeoutd::guid;
use timeoutd::message::{self, OutgoingMessage};
use timeoutd::record::TimeoutRecord;
use timeoutd::store::Store;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use shape::Shape;

const DEFAULT_AMQP_URI: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
const DEFAULT_OUT: &str = "target/bench/dispatch.json";

/// The sizes at scale 1.
const DRAIN_RECORDS: f64 = 50_000.0;
const RSS_RECORDS: f64 = 100_000.0;
const LATENESS_WINDOW_S: f64 = 30.0;
const LATENESS_RATE: f64 = 500.0;
const CLAIM_FUTURE_SMALL: f64 = 10_000.0;
const CLAIM_FUTURE_LARGE: f64 = 1_000_000.0;
const CLAIM_BATCH: u32 = 500;
const INSERT_CHUNK: usize = 10_000;

/// ServiceConnect v7's defaults, used by the baseline.
const V7_BATCH: i64 = 500;
const V7_LEASE: Duration = Duration::from_secs(300);
const V7_MARGIN: Duration = Duration::from_secs(2);

/// No delivery for this long while records are outstanding: the scenario failed.
const STALL: Duration = Duration::from_secs(30);

/// The scenario keys, in the order they run.
const ALL_SCENARIOS: &[&str] = &[
    "raw",
    "floors",
    "baseline",
    "timeoutd-1",
    "timeoutd-3",
    "lateness-timeoutd",
    "lateness-baseline",
    "claim",
    "claim-paused",
    "rss",
];

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "dispatch benchmark: run it with `cargo bench --bench dispatch` (or scripts/bench.sh); skipped under `cargo test`"
        );
        return;
    }
    // secantusd-rs is started from the main thread, which outlives everything: its
    // parent-death signal fires when the thread that forked it exits.
    let started_mongo = match std::env::var("TIMEOUTD_BENCH_MONGODB_URI") {
        Ok(uri) if !uri.is_empty() => None,
        _ => match start_secantus() {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("dispatch bench: {e:#}");
                std::process::exit(1);
            }
        },
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let result = runtime.block_on(run(started_mongo.as_ref()));
    drop(runtime);
    if let Some(mut s) = started_mongo {
        let _ = s.child.kill();
        let _ = s.child.wait();
    }
    if let Err(e) = result {
        eprintln!("dispatch bench failed: {e:#}");
        std::process::exit(1);
    }
}

// ---------------------------------------------------------------------------------------------
// Services

struct Secantus {
    uri: String,
    version: String,
    child: std::process::Child,
    _dir: tempfile::TempDir,
}

fn start_secantus() -> Result<Secantus> {
    use std::io::{BufRead, BufReader};
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().context("temp dir for secantusd-rs")?;
    let version = std::process::Command::new("secantusd-rs")
        .arg("--version")
        .output()
        .ok()
        .map(|o| {
            let text = String::from_utf8_lossy(&o.stdout).into_owned();
            text.lines().next().unwrap_or("").trim().to_string()
        })
        .unwrap_or_default();
    let mut cmd = std::process::Command::new("secantusd-rs");
    cmd.args(["--port", "0", "--log-level", "WARNING", "--storage-path"])
        .arg(dir.path())
        .current_dir(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    // SAFETY: prctl is async-signal-safe; it only sets this child's parent-death signal.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut child = cmd.spawn().context(
        "cannot start secantusd-rs: run scripts/install-test-mongodb.sh, or set TIMEOUTD_BENCH_MONGODB_URI",
    )?;
    let stdout = child.stdout.take().context("secantusd-rs stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        for line in lines.by_ref() {
            let Ok(line) = line else { break };
            if let Some(addr) = line.strip_prefix("secantusd-rs listening on ") {
                let _ = tx.send(format!("mongodb://{}/", addr.trim()));
                break;
            }
        }
        for _ in lines {}
    });
    let uri = rx
        .recv_timeout(Duration::from_secs(60))
        .map_err(|_| anyhow!("secantusd-rs did not report a listening port within 60 s"))?;
    Ok(Secantus {
        uri,
        version,
        child,
        _dir: dir,
    })
}

/// What every scenario shares.
struct Ctx {
    mongo_uri: String,
    amqp_uri: String,
    client: Client,
    admin: Connection,
    admin_channel: Channel,
    scale: f64,
    bin: PathBuf,
    work: tempfile::TempDir,
    run_id: String,
    rabbit: RabbitConfig,
    /// Whether the consumer receives while the records are sent (`live`), or only once the
    /// timed part is over (`after`: the queue fills, so confirms wait for the disk).
    live: bool,
    /// `timeoutd check-config` with the daemons' environment, captured once.
    effective_config: std::sync::Mutex<Option<String>>,
    /// The shape of every scenario's collection (`TIMEOUTD_BENCH_SHAPE`).
    shape: Shape,
}

impl Ctx {
    fn scaled(&self, n: f64, min: u64) -> u64 {
        ((n * self.scale).round() as u64).max(min)
    }

    fn mongo_config(&self, db: &str) -> MongoConfig {
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
struct Scen {
    db: String,
    queue: String,
    coll: Collection<Document>,
    shape: Shape,
}

impl Scen {
    async fn new(ctx: &Ctx, key: &str) -> Result<Self> {
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

    async fn cleanup(&self, ctx: &Ctx) {
        let _ = ctx
            .admin_channel
            .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
            .await;
        let _ = ctx.client.database(&self.db).drop().await;
    }
}

// ---------------------------------------------------------------------------------------------
// Records

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as i64
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros() as i64
}

fn record(destination: &str, due_ms: i64) -> TimeoutRecord {
    TimeoutRecord {
        id: Uuid::new_v4(),
        destination: destination.to_string(),
        process_manager_id: Uuid::new_v4(),
        due: DateTime::from_millis(due_ms),
        headers: Document::new(),
    }
}

/// Expected records: id to due instant (Unix ms).
type Expected = HashMap<u128, i64>;

/// Inserts records in chunks of [`INSERT_CHUNK`]; `due_of(i)` is the due instant of the
/// i-th. Returns the expected map (when `track`) and the seconds it took.
async fn insert_records(
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
fn due_in_past(n: u64) -> impl Fn(u64) -> i64 {
    let base = now_ms() - 60_000;
    move |i| base + (i as i64 * 59_000) / n.max(1) as i64
}

// ---------------------------------------------------------------------------------------------
// The consumer: counts deliveries per record id and stamps each with its receive instant.

#[derive(Default)]
struct Progress {
    deliveries: AtomicU64,
    unique: AtomicU64,
    /// Microseconds since the Unix epoch of the latest delivery.
    last_us: AtomicU64,
}

struct Received {
    /// First receipt of each expected record: (id, receive instant in Unix µs).
    first: Vec<(u128, i64)>,
    deliveries: u64,
    duplicates: u64,
    unexpected: u64,
    last_us: i64,
}

struct Counter {
    progress: Arc<Progress>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<Received>>,
    conn: Connection,
}

impl Counter {
    async fn start(ctx: &Ctx, queue: &str, expected: Arc<Expected>) -> Result<Self> {
        let conn = Connection::connect(&ctx.amqp_uri, ConnectionProperties::default())
            .await
            .context("consumer connection")?;
        let channel = conn.create_channel().await?;
        let mut consumer = channel
            .basic_consume(
                queue.into(),
                format!("bench-{}", Uuid::new_v4().simple()).as_str().into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .context("basic.consume")?;
        let progress = Arc::new(Progress::default());
        let stop = CancellationToken::new();
        let (p, s) = (progress.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let _channel = channel;
            let mut seen: HashSet<u128> = HashSet::with_capacity(expected.len());
            let mut out = Received {
                first: Vec::with_capacity(expected.len()),
                deliveries: 0,
                duplicates: 0,
                unexpected: 0,
                last_us: 0,
            };
            loop {
                let next = tokio::select! {
                    d = consumer.next() => d,
                    _ = s.cancelled() => break,
                };
                let delivery = match next {
                    Some(Ok(d)) => d,
                    Some(Err(e)) => return Err(anyhow!("consumer: {e}")),
                    None => break,
                };
                let at = now_us();
                out.deliveries += 1;
                out.last_us = at;
                let id = delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .and_then(|m| Uuid::parse_str(m.as_str()).ok())
                    .map(|u| u.as_u128());
                match id {
                    Some(id) if expected.contains_key(&id) => {
                        if seen.insert(id) {
                            out.first.push((id, at));
                            p.unique.fetch_add(1, Ordering::Relaxed);
                        } else {
                            out.duplicates += 1;
                        }
                    }
                    _ => out.unexpected += 1,
                }
                p.deliveries.fetch_add(1, Ordering::Relaxed);
                p.last_us.store(at as u64, Ordering::Relaxed);
            }
            Ok(out)
        });
        Ok(Self {
            progress,
            stop,
            task,
            conn,
        })
    }

    fn unique(&self) -> u64 {
        self.progress.unique.load(Ordering::Relaxed)
    }

    /// Waits until `n` distinct expected records arrived. Fails after [`STALL`] without a
    /// delivery, or when `alive` says a process died.
    async fn wait_for(&self, n: u64, mut alive: impl FnMut() -> Result<()>) -> Result<()> {
        let mut last_count = 0;
        let mut last_change = Instant::now();
        while self.unique() < n {
            alive()?;
            let c = self.progress.deliveries.load(Ordering::Relaxed);
            if c != last_count {
                last_count = c;
                last_change = Instant::now();
            } else if last_change.elapsed() > STALL {
                bail!(
                    "stalled: {} of {n} records received, none for {} s",
                    self.unique(),
                    STALL.as_secs()
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(())
    }

    /// Keeps listening `linger` longer (to catch late duplicates), then stops.
    async fn finish(self, linger: Duration) -> Result<Received> {
        tokio::time::sleep(linger).await;
        self.stop.cancel();
        let r = self.task.await.map_err(|e| anyhow!("consumer task: {e}"))?;
        let _ = self.conn.close(200, "done".into()).await;
        r
    }
}

/// Polls until the collection is empty; returns when it was seen empty.
async fn wait_empty(coll: &Collection<Document>, within: Duration) -> Result<Instant> {
    let deadline = Instant::now() + within;
    loop {
        if coll.count_documents(doc! {}).await? == 0 {
            return Ok(Instant::now());
        }
        if Instant::now() > deadline {
            bail!("collection not empty after {} s", within.as_secs());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Polls until the collection is empty, cheaply (estimated count, then an exact one); fails
/// after [`STALL`] without progress or when `alive` says a worker died.
async fn wait_empty_polling(
    coll: &Collection<Document>,
    mut alive: impl FnMut() -> Result<()>,
) -> Result<()> {
    let mut last = u64::MAX;
    let mut last_change = Instant::now();
    loop {
        alive()?;
        let left = coll.estimated_document_count().await?;
        if left == 0 && coll.count_documents(doc! {}).await? == 0 {
            return Ok(());
        }
        if left != last {
            last = left;
            last_change = Instant::now();
        } else if last_change.elapsed() > STALL {
            bail!(
                "stalled: {left} records left, none removed for {} s",
                STALL.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The consumer, started now when it counts live (`TIMEOUTD_BENCH_CONSUMER=live`).
async fn live_counter(ctx: &Ctx, queue: &str, expected: &Arc<Expected>) -> Result<Option<Counter>> {
    if ctx.live {
        Ok(Some(Counter::start(ctx, queue, expected.clone()).await?))
    } else {
        Ok(None)
    }
}

/// The end of a drain: with a live consumer, every record received and the collection
/// empty; otherwise the collection empty.
async fn wait_drained(
    coll: &Collection<Document>,
    n: u64,
    counter: Option<&Counter>,
    mut alive: impl FnMut() -> Result<()>,
) -> Result<()> {
    match counter {
        Some(c) => {
            c.wait_for(n, &mut alive).await?;
            wait_empty(coll, Duration::from_secs(60)).await?;
            Ok(())
        }
        None => wait_empty_polling(coll, alive).await,
    }
}

/// After the timed part: every delivery counted (the consumer starts now if it was not live),
/// listening `linger` longer for late duplicates.
async fn collect(
    ctx: &Ctx,
    queue: &str,
    n: u64,
    expected: &Arc<Expected>,
    counter: Option<Counter>,
    linger: Duration,
) -> Result<Received> {
    let counter = match counter {
        Some(c) => c,
        None => Counter::start(ctx, queue, expected.clone()).await?,
    };
    counter.wait_for(n, || Ok(())).await?;
    counter.finish(linger).await
}

// ---------------------------------------------------------------------------------------------
// Results

#[derive(Debug, Clone, Serialize, Default)]
struct LatenessMs {
    p50: f64,
    p99: f64,
    max: f64,
    min: f64,
    mean: f64,
    samples: usize,
    over_25ms: usize,
    over_100ms: usize,
}

#[derive(Debug, Clone, Serialize, Default)]
struct ClaimMs {
    median: f64,
    min: f64,
    max: f64,
    samples: Vec<f64>,
    future_records: u64,
}

#[derive(Debug, Clone, Serialize, Default)]
struct Row {
    scenario: String,
    description: String,
    records: u64,
    seconds: Option<f64>,
    records_per_s: Option<f64>,
    ratio_to_raw: Option<f64>,
    /// To the database's write floor measured in this run (`floor-write`).
    ratio_to_floor: Option<f64>,
    ratio_to_baseline: Option<f64>,
    duplicates: Option<u64>,
    lateness_ms: Option<LatenessMs>,
    claim_latency_ms: Option<ClaimMs>,
    peak_rss_mib: Option<f64>,
    /// Scenario-specific detail: insert times, time to first delivery, daemon metrics.
    details: Value,
    error: Option<String>,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn lateness(received: &Received, expected: &Expected) -> LatenessMs {
    let mut late: Vec<f64> = received
        .first
        .iter()
        .filter_map(|(id, at)| {
            expected
                .get(id)
                .map(|due| *at as f64 / 1000.0 - *due as f64)
        })
        .collect();
    late.sort_by(f64::total_cmp);
    let mean = late.iter().fold(0.0, |a, b| a + b) / late.len().max(1) as f64;
    LatenessMs {
        over_25ms: late.iter().filter(|l| **l > 25.0).count(),
        over_100ms: late.iter().filter(|l| **l > 100.0).count(),
        p50: percentile(&late, 0.50),
        p99: percentile(&late, 0.99),
        max: late.last().copied().unwrap_or(f64::NAN),
        min: late.first().copied().unwrap_or(f64::NAN),
        mean,
        samples: late.len(),
    }
}

// ---------------------------------------------------------------------------------------------
// timeoutd processes

struct Daemon {
    child: tokio::process::Child,
    pid: u32,
    port: u16,
    log: PathBuf,
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn daemon_env(ctx: &Ctx, db: &str, port: u16) -> Vec<(String, String)> {
    let mut env = vec![
        ("TIMEOUTD_MONGODB__URI".to_string(), ctx.mongo_uri.clone()),
        ("TIMEOUTD_MONGODB__DATABASE".into(), db.to_string()),
        ("TIMEOUTD_RABBITMQ__URI".into(), ctx.amqp_uri.clone()),
        ("TIMEOUTD_HTTP__LISTEN".into(), format!("127.0.0.1:{port}")),
        ("TIMEOUTD_LOG__LEVEL".into(), "warn".into()),
    ];
    for (key, default) in [
        ("TIMEOUTD_DISPATCH__POLL_INTERVAL", "1s"),
        ("TIMEOUTD_DISPATCH__BATCH_SIZE", "500"),
        // The one shape the collection holds: "auto" would also serve shapes not there.
        ("TIMEOUTD_MONGODB__TIME_ENCODING", ctx.shape.encoding_key()),
        (
            "TIMEOUTD_MONGODB__UUID_REPRESENTATION",
            ctx.shape.uuids_key(),
        ),
    ] {
        if std::env::var(key).is_err() {
            env.push((key.into(), default.into()));
        }
    }
    env
}

impl Daemon {
    async fn spawn(ctx: &Ctx, db: &str, name: &str) -> Result<Self> {
        use std::os::unix::process::CommandExt;
        let port = free_port()?;
        let log = ctx.work.path().join(format!("{name}.log"));
        let log_file = std::fs::File::create(&log)?;
        let env = daemon_env(ctx, db, port);
        let mut cmd = std::process::Command::new(&ctx.bin);
        cmd.arg("run")
            // Not the repository: config/timeoutd.toml must not apply.
            .current_dir(ctx.work.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log_file))
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        // SAFETY: prctl is async-signal-safe; it only sets this child's parent-death signal.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut cmd = tokio::process::Command::from(cmd);
        cmd.kill_on_drop(true);
        let child = cmd
            .spawn()
            .with_context(|| format!("spawn {}", ctx.bin.display()))?;
        let pid = child.id().context("daemon pid")?;
        let mut captured = ctx.effective_config.lock().expect("lock");
        if captured.is_none() {
            let out = std::process::Command::new(&ctx.bin)
                .arg("check-config")
                .current_dir(ctx.work.path())
                .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .output()?;
            *captured = Some(String::from_utf8_lossy(&out.stdout).into_owned());
        }
        Ok(Self {
            child,
            pid,
            port,
            log,
        })
    }

    /// An error (with the end of its log) if the process has exited.
    fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "timeoutd (pid {}) exited early with {status}; log:\n{}",
                self.pid,
                log_tail(&self.log)
            );
        }
        Ok(())
    }

    /// Peak resident set size so far, in MiB (`VmHWM`).
    fn peak_rss_mib(&self) -> Option<f64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb / 1024.0)
    }

    async fn metrics(&self) -> Option<String> {
        http_get(self.port, "/metrics").await.ok()
    }

    /// SIGTERM, then waits for the drain to finish; returns the exit status and seconds.
    async fn stop(mut self) -> Result<Value> {
        let started = Instant::now();
        // SAFETY: plain kill(2) on a child this process spawned and has not reaped.
        unsafe {
            libc::kill(self.pid as i32, libc::SIGTERM);
        }
        let status = tokio::time::timeout(Duration::from_secs(40), self.child.wait()).await;
        let warnings = std::fs::read_to_string(&self.log)
            .map(|l| l.lines().count())
            .unwrap_or(0);
        match status {
            Ok(Ok(s)) => Ok(json!({
                "exit": s.code(),
                "stop_seconds": started.elapsed().as_secs_f64(),
                "log_lines_at_warn": warnings,
            })),
            _ => {
                let _ = self.child.kill().await;
                bail!("timeoutd (pid {}) did not stop within 40 s", self.pid)
            }
        }
    }
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

async fn http_get(port: u16, path: &str) -> Result<String> {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await??;
    let text = String::from_utf8_lossy(&buf).into_owned();
    Ok(text
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap_or(text))
}

/// Sum of every series named `name` (any labels) in Prometheus text.
fn prom_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let metric = series.split('{').next()?;
            (metric == name).then(|| value.trim().parse::<f64>().ok())?
        })
        .fold(0.0, |a, b| a + b)
}

/// The value of the series `name{label="value"}` in Prometheus text (0 when absent).
fn prom_labelled(text: &str, name: &str, label: &str, value: &str) -> f64 {
    let prefix = format!("{name}{{");
    let wanted = format!("{label}=\"{value}\"");
    text.lines()
        .filter(|l| l.starts_with(&prefix) && l.contains(&wanted))
        .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
        .fold(0.0, |a, b| a + b)
}

/// Cumulative buckets `(le, count)` of a histogram, ascending.
fn prom_buckets(text: &str, name: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{");
    let mut b: Vec<(f64, f64)> = text
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            let v = l.rsplit_once(' ')?.1.trim().parse().ok()?;
            Some((le, v))
        })
        .collect();
    b.sort_by(|x, y| x.0.total_cmp(&y.0));
    b
}

/// The upper bound of the bucket holding quantile `q`.
fn bucket_quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    buckets
        .iter()
        .find(|(_, c)| *c >= q * total)
        .map(|(le, _)| *le)
}

/// Where each record's time went, in ms, from the daemons' own histograms summed over
/// instances: the time each step's calls took, divided by the records, and the rest of the
/// instances' wall time. Steps overlap (removals run beside claims and waves), so the rest is
/// idle when positive and the overlap when negative; the parts add up to the wall time per
/// record either way.
fn breakdown(texts: &[String], wall_s: f64, records: u64) -> Value {
    let call = |c: &str| {
        texts.iter().fold(0.0, |a, t| {
            a + prom_labelled(t, "timeoutd_mongodb_call_seconds_sum", "call", c)
        })
    };
    let publish = texts.iter().fold(0.0, |a, t| {
        a + prom_sum(t, "timeoutd_publish_confirm_seconds_sum")
    });
    let per = |s: f64| s * 1000.0 / records.max(1) as f64;
    let mut parts = serde_json::Map::new();
    let mut busy = 0.0;
    for c in ["find", "claim", "read_back", "remove", "release"] {
        let s = call(c);
        busy += s;
        parts.insert(c.to_string(), json!(per(s)));
    }
    busy += publish;
    parts.insert("publish_confirm".into(), json!(per(publish)));
    let wall = wall_s * texts.len() as f64;
    parts.insert("rest".into(), json!(per(wall - busy)));
    parts.insert("wall".into(), json!(per(wall)));
    Value::Object(parts)
}

/// What the daemons' own metrics say, summed over instances, and where a batch's time goes.
fn daemon_metrics(texts: &[String], wall_s: f64, records: u64) -> Value {
    let sum = |name: &str| texts.iter().fold(0.0, |a, t| a + prom_sum(t, name));
    let claims = sum("timeoutd_claim_duration_seconds_count");
    let claim_s = sum("timeoutd_claim_duration_seconds_sum");
    let publishes = sum("timeoutd_publish_confirm_seconds_count");
    let publish_s = sum("timeoutd_publish_confirm_seconds_sum");
    let per = |total: f64, n: f64| if n > 0.0 { total / n * 1000.0 } else { 0.0 };
    // Lateness as the daemon measured it (confirm minus due, server clock), bucket bounds.
    let mut buckets: Vec<(f64, f64)> = Vec::new();
    for t in texts {
        for (le, c) in prom_buckets(t, "timeoutd_dispatch_lateness_seconds") {
            match buckets.iter_mut().find(|(l, _)| *l == le) {
                Some(b) => b.1 += c,
                None => buckets.push((le, c)),
            }
        }
    }
    buckets.sort_by(|x, y| x.0.total_cmp(&y.0));
    let bound_ms = |q| bucket_quantile(&buckets, q).map(|s| s * 1000.0);
    json!({
        "scraped_instances": texts.len(),
        "claimed_total": sum("timeoutd_claimed_total"),
        "dispatched_total": sum("timeoutd_dispatched_total"),
        "removed_total": sum("timeoutd_removed_total"),
        "lease_lost_total": sum("timeoutd_lease_lost_total"),
        "publish_failures_total": sum("timeoutd_publish_failures_total"),
        "released_total": sum("timeoutd_released_total"),
        "claims": claims,
        "claim_seconds_total": claim_s,
        "claim_ms_mean": per(claim_s, claims),
        "published_batches": publishes,
        "publish_confirm_seconds_total": publish_s,
        "publish_confirm_ms_mean_per_batch": per(publish_s, publishes),
        // Per instance: wall time not spent claiming or awaiting confirms (building messages,
        // the guarded deleteMany, pauses between polls, startup).
        "ms_per_record": breakdown(texts, wall_s, records),
        "lateness_confirm_minus_due_ms_bucket_bounds": {
            "p50_at_most": bound_ms(0.5),
            "p99_at_most": bound_ms(0.99),
        },
    })
}

// ---------------------------------------------------------------------------------------------
// Scenarios

fn build_messages(rabbit: &RabbitConfig, records: &[TimeoutRecord]) -> Vec<OutgoingMessage> {
    let now = SystemTime::now();
    records
        .iter()
        .filter_map(|r| message::build(r, rabbit, now, message::DEFAULT_FRAME_MAX).ok())
        .collect()
}

async fn confirm_channel(uri: &str) -> Result<(Connection, Channel)> {
    let conn = Connection::connect(uri, ConnectionProperties::default())
        .await
        .context("RabbitMQ connection")?;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok((conn, channel))
}

const MANDATORY: BasicPublishOptions = BasicPublishOptions {
    mandatory: true,
    immediate: false,
};

fn check_confirmation(c: Confirmation) -> Result<()> {
    match c {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_)) => bail!("publish returned (unroutable)"),
        Confirmation::Nack(_) => bail!("publish nacked"),
        Confirmation::NotRequested => bail!("channel not in confirm mode"),
    }
}

/// One raw run: seconds until done, seconds until all confirmed, duplicates, body size.
struct RawRun {
    seconds: f64,
    confirmed_s: f64,
    duplicates: u64,
    body_bytes: Option<usize>,
}

/// The broker's limit: pipelined persistent publishes with confirms, `window` in flight; the
/// best of `TIMEOUTD_BENCH_RAW_REPS` runs (default 3), since a limit is what the broker can do
/// and the machine is shared.
async fn scenario_raw(ctx: &Ctx, scen: &Scen) -> Result<Row> {
    let n = ctx.scaled(DRAIN_RECORDS, 1_000);
    let window: usize = env_parse("TIMEOUTD_BENCH_RAW_WINDOW", 1000);
    let reps: usize = env_parse("TIMEOUTD_BENCH_RAW_REPS", 3).max(1);
    let mut runs = Vec::with_capacity(reps);
    for _ in 0..reps {
        runs.push(raw_once(ctx, scen, n, window).await?);
    }
    let all: Vec<f64> = runs.iter().map(|r| n as f64 / r.seconds).collect();
    let best = runs
        .iter()
        .min_by(|a, b| a.seconds.total_cmp(&b.seconds))
        .context("no raw run")?;
    Ok(Row {
        scenario: "raw".into(),
        description: format!(
            "RabbitMQ persistent publishes with confirms, pipelined ({window} in flight), one channel, {}, best of {reps}",
            if ctx.live {
                "until received by the consumer"
            } else {
                "until all confirmed (no consumer yet)"
            }
        ),
        records: n,
        seconds: Some(best.seconds),
        records_per_s: Some(n as f64 / best.seconds),
        duplicates: Some(runs.iter().map(|r| r.duplicates).sum()),
        details: json!({
            "window": window,
            "runs_records_per_s": all,
            "all_confirmed_seconds": best.confirmed_s,
            "confirmed_per_s": n as f64 / best.confirmed_s,
            "message_body_bytes": best.body_bytes,
        }),
        ..Row::default()
    })
}

async fn raw_once(ctx: &Ctx, scen: &Scen, n: u64, window: usize) -> Result<RawRun> {
    let records: Vec<TimeoutRecord> = (0..n).map(|_| record(&scen.queue, now_ms())).collect();
    let expected: Arc<Expected> = Arc::new(
        records
            .iter()
            .map(|r| (r.id.as_u128(), r.due.timestamp_millis()))
            .collect(),
    );
    let messages = build_messages(&ctx.rabbit, &records);
    let counter = live_counter(ctx, &scen.queue, &expected).await?;
    let (conn, channel) = confirm_channel(&ctx.amqp_uri).await?;
    let started = Instant::now();
    let mut in_flight = FuturesUnordered::new();
    for m in &messages {
        if in_flight.len() >= window
            && let Some(c) = in_flight.next().await
        {
            check_confirmation(c?)?;
        }
        let confirm = channel
            .basic_publish(
                "".into(),
                m.routing_key.as_str().into(),
                MANDATORY,
                &m.body,
                m.properties.clone(),
            )
            .await?;
        in_flight.push(confirm);
    }
    while let Some(c) = in_flight.next().await {
        check_confirmation(c?)?;
    }
    let confirmed_s = started.elapsed().as_secs_f64();
    if let Some(c) = &counter {
        c.wait_for(n, || Ok(())).await?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let received = collect(
        ctx,
        &scen.queue,
        n,
        &expected,
        counter,
        Duration::from_millis(300),
    )
    .await?;
    let _ = conn.close(200, "done".into()).await;
    Ok(RawRun {
        seconds,
        confirmed_s,
        duplicates: received.duplicates,
        body_bytes: messages.first().map(|m| m.body.len()),
    })
}

/// ServiceConnect v7's poller, single-threaded, as the interop doc describes it.
#[derive(Clone)]
struct V7Poller {
    coll: Collection<Document>,
    shape: Shape,
    channel: Channel,
    rabbit: RabbitConfig,
    poll_interval: Duration,
}

#[derive(Debug, Default, Serialize)]
struct V7Stats {
    claims: u64,
    claimed: u64,
    sent: u64,
    deleted: u64,
    lease_lost: u64,
    skipped_margin: u64,
    claim_seconds: f64,
    send_seconds: f64,
    delete_seconds: f64,
}

impl V7Poller {
    /// v7's indexes on the fields its writes use; and, for the due query, an index on the
    /// ticks element, which v7 lacks: the baseline gets the fast due query, so its figure
    /// isolates one-at-a-time sending.
    async fn ensure_indexes(&self) -> Result<()> {
        for (name, keys) in [
            ("bench_v7_due", doc! { self.shape.due_path(): 1 }),
            ("LockedBy_1_Locked_1", doc! { "LockedBy": 1, "Locked": 1 }),
            ("LockExpiresAt_1", doc! { "LockExpiresAt": 1 }),
        ] {
            shape::create_index(&self.coll, name, keys).await?;
        }
        Ok(())
    }

    /// v7's due filter, written as timeoutd writes it (an explicit `$and` over the ticks
    /// element), on which SecantusDB bounds the index scan; with the implicit form its cost
    /// grows with the collection there, which would flatter timeoutd.
    fn due_filter(&self, now: i64) -> Vec<Document> {
        shape::due_and_free(self.shape, now)
    }

    /// Runs until `stop`; polls again at once after a full batch (in the baseline's favour),
    /// else after the poll interval.
    async fn run(&self, stop: CancellationToken) -> Result<V7Stats> {
        let mut st = V7Stats::default();
        while !stop.is_cancelled() {
            let t = Instant::now();
            let rows = self.claim().await?;
            st.claim_seconds += t.elapsed().as_secs_f64();
            st.claims += 1;
            st.claimed += rows.len() as u64;
            let full = rows.len() as i64 >= V7_BATCH;
            for (owner, expires_ms, doc) in rows {
                if stop.is_cancelled() {
                    break;
                }
                if expires_ms - now_ms() < V7_MARGIN.as_millis() as i64 {
                    st.skipped_margin += 1;
                    continue;
                }
                let r = TimeoutRecord::decode(&doc, self.shape.encoding())
                    .map_err(|e| anyhow!("baseline decode: {e}"))?;
                let m = message::build(
                    &r,
                    &self.rabbit,
                    SystemTime::now(),
                    message::DEFAULT_FRAME_MAX,
                )
                .map_err(|e| anyhow!("baseline message: {e}"))?;
                let t = Instant::now();
                let confirm = self
                    .channel
                    .basic_publish(
                        "".into(),
                        m.routing_key.as_str().into(),
                        MANDATORY,
                        &m.body,
                        m.properties,
                    )
                    .await?;
                check_confirmation(confirm.await?)?;
                st.send_seconds += t.elapsed().as_secs_f64();
                st.sent += 1;
                // Re-check the lease (v7 does it with the local clock).
                let now = now_ms();
                if now >= expires_ms {
                    st.lease_lost += 1;
                    continue;
                }
                let t = Instant::now();
                let deleted = self
                    .coll
                    .delete_one(doc! { "$and": [
                        { "_id": doc.get("_id").cloned().unwrap_or(Bson::Null) },
                        { "Locked": true },
                        { "LockedBy": guid::to_bson(owner, self.shape.uuids()) },
                        { "LockExpiresAt": { "$gt": DateTime::from_millis(now) } },
                    ] })
                    .await?
                    .deleted_count;
                st.delete_seconds += t.elapsed().as_secs_f64();
                if deleted == 1 {
                    st.deleted += 1;
                } else {
                    st.lease_lost += 1;
                }
            }
            if !full {
                tokio::select! {
                    _ = tokio::time::sleep(self.poll_interval) => {}
                    _ = stop.cancelled() => {}
                }
            }
        }
        Ok(st)
    }

    /// The v7 claim: candidates oldest first, compare-and-swap `updateMany` under a fresh
    /// owner, read back by owner.
    async fn claim(&self) -> Result<Vec<(Uuid, i64, Document)>> {
        let now = now_ms();
        let owner = Uuid::new_v4();
        let expires = now + V7_LEASE.as_millis() as i64;
        let ids: Vec<Bson> = self
            .coll
            .find(doc! { "$and": self.due_filter(now) })
            .sort(doc! { self.shape.due_path(): 1 })
            .limit(V7_BATCH)
            .projection(doc! { "_id": 1 })
            .await?
            .try_collect::<Vec<Document>>()
            .await?
            .into_iter()
            .filter_map(|d| d.get("_id").cloned())
            .collect();
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut clauses = vec![doc! { "_id": { "$in": ids } }];
        clauses.extend(self.due_filter(now));
        let filter = doc! { "$and": clauses };
        self.coll
            .update_many(
                filter,
                doc! { "$set": {
                    "Locked": true,
                    "LockedBy": guid::to_bson(owner, self.shape.uuids()),
                    "LockExpiresAt": DateTime::from_millis(expires),
                } },
            )
            .await?;
        let rows: Vec<Document> = self
            .coll
            .find(doc! { "$and": [
                { "LockedBy": guid::to_bson(owner, self.shape.uuids()) },
                { "Locked": true },
                { "LockExpiresAt": { "$gt": DateTime::from_millis(now) } },
            ] })
            .sort(doc! { self.shape.due_path(): 1 })
            .await?
            .try_collect()
            .await?;
        Ok(rows.into_iter().map(|d| (owner, expires, d)).collect())
    }
}

async fn start_v7(
    ctx: &Ctx,
    scen: &Scen,
    poll_interval: Duration,
) -> Result<(V7Poller, Connection)> {
    let (conn, channel) = confirm_channel(&ctx.amqp_uri).await?;
    let poller = V7Poller {
        coll: scen.coll.clone(),
        shape: scen.shape,
        channel,
        rabbit: ctx.rabbit.clone(),
        poll_interval,
    };
    poller.ensure_indexes().await?;
    Ok((poller, conn))
}

async fn scenario_baseline(ctx: &Ctx, scen: &Scen) -> Result<Row> {
    let n = ctx.scaled(DRAIN_RECORDS, 1_000);
    let (poller, conn) = start_v7(ctx, scen, Duration::from_secs(1)).await?;
    let (expected, insert_s) = insert_records(scen, n, true, due_in_past(n)).await?;
    let expected = Arc::new(expected);
    let counter = live_counter(ctx, &scen.queue, &expected).await?;
    let stop = CancellationToken::new();
    let started = Instant::now();
    let task = {
        let s = stop.clone();
        tokio::spawn(async move { poller.run(s).await })
    };
    let emptied = wait_drained(&scen.coll, n, counter.as_ref(), || {
        if task.is_finished() {
            bail!("the baseline poller stopped early");
        }
        Ok(())
    })
    .await;
    let seconds = started.elapsed().as_secs_f64();
    stop.cancel();
    let stats = task.await.map_err(|e| anyhow!("baseline task: {e}"))??;
    emptied?;
    let received = collect(
        ctx,
        &scen.queue,
        n,
        &expected,
        counter,
        Duration::from_millis(300),
    )
    .await?;
    let _ = conn.close(200, "done".into()).await;
    Ok(Row {
        scenario: "baseline".into(),
        description: "ServiceConnect v7 algorithm: v7 claim of 500, then per record one publish awaiting its confirm and one owner-guarded deleteOne".into(),
        records: n,
        seconds: Some(seconds),
        records_per_s: Some(n as f64 / seconds),
        duplicates: Some(received.duplicates),
        details: json!({ "insert_seconds": insert_s, "v7": stats }),
        ..Row::default()
    })
}

/// One or more `timeoutd run` processes draining `n` due records.
async fn scenario_timeoutd_drain(
    ctx: &Ctx,
    scen: &Scen,
    key: &str,
    n: u64,
    instances: usize,
) -> Result<Row> {
    // timeoutd's indexes exist before the records do, so that no instance builds them on a
    // full collection inside the timed window.
    let store = Store::connect(&ctx.mongo_config(&scen.db), ServerClock::default()).await?;
    store.ensure_indexes().await?;
    let (expected, insert_s) = insert_records(scen, n, true, due_in_past(n)).await?;
    let expected = Arc::new(expected);
    let counter = live_counter(ctx, &scen.queue, &expected).await?;
    let started = Instant::now();
    let started_us = now_us();
    let mut daemons = Vec::new();
    for i in 0..instances {
        daemons.push(Daemon::spawn(ctx, &scen.db, &format!("{key}-{i}")).await?);
    }
    let outcome = wait_drained(&scen.coll, n, counter.as_ref(), || {
        daemons.iter_mut().try_for_each(Daemon::check_alive)
    })
    .await;
    let seconds = started.elapsed().as_secs_f64();
    // Read before SIGTERM: the peak of the drain, and the daemons' own counters.
    let rss: Vec<f64> = daemons.iter().filter_map(Daemon::peak_rss_mib).collect();
    let mut texts = Vec::new();
    for d in &daemons {
        if let Some(t) = d.metrics().await {
            texts.push(t);
        }
    }
    let mut stops = Vec::new();
    for d in daemons {
        stops.push(d.stop().await.unwrap_or_else(|e| json!(e.to_string())));
    }
    outcome?;
    let received = collect(
        ctx,
        &scen.queue,
        n,
        &expected,
        counter,
        Duration::from_millis(500),
    )
    .await?;
    let first_delivery_s = received
        .first
        .iter()
        .map(|(_, at)| *at)
        .min()
        .map(|at| (at - started_us) as f64 / 1e6);
    let peak = rss.iter().copied().fold(f64::NAN, f64::max);
    Ok(Row {
        scenario: key.into(),
        description: format!(
            "{instances} timeoutd process{} draining {n} due records",
            if instances == 1 { "" } else { "es" }
        ),
        records: n,
        seconds: Some(seconds),
        records_per_s: Some(n as f64 / seconds),
        duplicates: Some(received.duplicates),
        peak_rss_mib: Some(peak),
        details: json!({
            "instances": instances,
            "insert_seconds": insert_s,
            "first_delivery_after_spawn_seconds": ctx.live.then_some(first_delivery_s).flatten(),
            "steady_records_per_s": ctx.live.then(|| steady_rate(&received, n)).flatten(),
            "unexpected_deliveries": received.unexpected,
            "peak_rss_mib_per_instance": rss,
            "daemon_metrics": daemon_metrics(&texts, seconds, n),
            "stop": stops,
        }),
        ..Row::default()
    })
}

/// Records per second between the first and the last delivery (startup excluded).
fn steady_rate(received: &Received, n: u64) -> Option<f64> {
    let first = received.first.iter().map(|(_, at)| *at).min()?;
    let span = (received.last_us - first) as f64 / 1e6;
    (span > 0.0).then(|| (n.saturating_sub(1)) as f64 / span)
}

/// Records due uniformly over the window at 500/s, fired by timeoutd (one instance) or the
/// baseline, both polling every second.
async fn scenario_lateness(ctx: &Ctx, scen: &Scen, timeoutd: bool) -> Result<Row> {
    let window_s = (LATENESS_WINDOW_S * ctx.scale).max(2.0);
    let n = (window_s * LATENESS_RATE).round() as u64;
    let poll = Duration::from_secs(1);
    let mut v7 = None;
    if timeoutd {
        let store = Store::connect(&ctx.mongo_config(&scen.db), ServerClock::default()).await?;
        store.ensure_indexes().await?;
    } else {
        v7 = Some(start_v7(ctx, scen, poll).await?);
    }
    // The first record falls due well after the inserts and the process start.
    let lead_ms = 2_500 + n as i64 / 10;
    let first_due = now_ms() + lead_ms;
    let step_us = 1e6 / LATENESS_RATE;
    let (expected, insert_s) = insert_records(scen, n, true, |i| {
        first_due + ((i as f64 * step_us) / 1000.0).round() as i64
    })
    .await?;
    let inserted_before_first_due_ms = first_due - now_ms();
    let expected = Arc::new(expected);
    let counter = Counter::start(ctx, &scen.queue, expected.clone()).await?;
    let started = Instant::now();
    let stop = CancellationToken::new();
    let mut daemon = None;
    let mut task = None;
    if timeoutd {
        daemon = Some(Daemon::spawn(ctx, &scen.db, "lateness").await?);
    } else if let Some((poller, _)) = &v7 {
        let poller = poller.clone();
        let s = stop.clone();
        task = Some(tokio::spawn(async move { poller.run(s).await }));
    }
    let outcome = async {
        counter
            .wait_for(n, || match (daemon.as_mut(), task.as_ref()) {
                (Some(d), _) => d.check_alive(),
                (None, Some(t)) if t.is_finished() => bail!("the baseline poller stopped early"),
                _ => Ok(()),
            })
            .await?;
        wait_empty(&scen.coll, Duration::from_secs(60)).await
    }
    .await;
    let seconds = started.elapsed().as_secs_f64();
    let mut details = json!({
        "window_seconds": window_s,
        "rate_per_s": LATENESS_RATE,
        "poll_interval_seconds": poll.as_secs_f64(),
        "insert_seconds": insert_s,
        "inserted_ms_before_first_due": inserted_before_first_due_ms,
        "measured_as": "consumer receive instant minus due instant (host clock)",
    });
    let mut stats = None;
    if let Some(d) = daemon {
        let texts: Vec<String> = d.metrics().await.into_iter().collect();
        details["daemon_metrics"] = daemon_metrics(&texts, seconds, n);
        details["stop"] = d.stop().await.unwrap_or_else(|e| json!(e.to_string()));
    }
    stop.cancel();
    if let Some(t) = task {
        stats = Some(t.await.map_err(|e| anyhow!("baseline task: {e}"))??);
    }
    if let Some((_, conn)) = v7 {
        let _ = conn.close(200, "done".into()).await;
    }
    let received = counter.finish(Duration::from_millis(300)).await?;
    outcome?;
    if let Ok(dir) = std::env::var("TIMEOUTD_BENCH_DUMP_DIR") {
        let path = Path::new(&dir).join(format!("{}.csv", scen_key(timeoutd)));
        details["dump"] = json!(path.display().to_string());
        dump_lateness(&path, &received, &expected)?;
    }
    if let Some(s) = stats {
        details["v7"] = json!(s);
    }
    Ok(Row {
        scenario: scen_key(timeoutd).into(),
        description: format!(
            "{n} records due uniformly over {window_s:.0} s at {LATENESS_RATE:.0}/s, poll 1 s, {}",
            if timeoutd {
                "one timeoutd process"
            } else {
                "v7 baseline"
            }
        ),
        records: n,
        seconds: Some(seconds),
        records_per_s: Some(n as f64 / seconds),
        duplicates: Some(received.duplicates),
        lateness_ms: Some(lateness(&received, &expected)),
        details,
        ..Row::default()
    })
}

fn scen_key(timeoutd: bool) -> &'static str {
    if timeoutd {
        "lateness-timeoutd"
    } else {
        "lateness-baseline"
    }
}

/// One line per record: due instant (Unix ms), receive instant (Unix µs), lateness (ms).
fn dump_lateness(path: &Path, received: &Received, expected: &Expected) -> Result<()> {
    use std::fmt::Write;
    let mut out = String::from("due_ms,received_us,late_ms\n");
    for (id, at) in &received.first {
        if let Some(due) = expected.get(id) {
            let _ = writeln!(out, "{due},{at},{:.3}", *at as f64 / 1000.0 - *due as f64);
        }
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, out)?;
    Ok(())
}

/// `Store::claim` of 500 due records beside 10k, then 1M future records.
async fn scenario_claim(ctx: &Ctx, scen: &Scen) -> Result<Vec<Row>> {
    let reps: usize = env_parse("TIMEOUTD_BENCH_CLAIM_REPS", 9);
    let small = ctx.scaled(CLAIM_FUTURE_SMALL, 1_000);
    let large = ctx.scaled(CLAIM_FUTURE_LARGE, small + 1);
    let store = Store::connect(&ctx.mongo_config(&scen.db), ServerClock::default()).await?;
    store.ensure_indexes().await?;
    store.refresh_clock().await?;
    let future_base = now_ms() + 3_600_000;
    let month_ms = 30 * 86_400_000_i64;
    // Due at random instants over the month after next hour.
    let future = |_: u64| future_base + (Uuid::new_v4().as_u128() as i64).rem_euclid(month_ms);
    let (_, due_insert_s) = insert_records(
        scen,
        u64::from(CLAIM_BATCH),
        false,
        due_in_past(u64::from(CLAIM_BATCH)),
    )
    .await?;
    let (_, small_insert_s) = insert_records(scen, small, false, future).await?;
    let small_ms = time_claims(&store, reps).await?;
    let (_, large_insert_s) = insert_records(scen, large - small, false, future).await?;
    let large_ms = time_claims(&store, reps).await?;
    // Not a target of the issue: the same claim when a drain's backlog of due records waits
    // too (what each claim of the timeoutd-1 drain faces at its start).
    let backlog = ctx.scaled(DRAIN_RECORDS, 1_000);
    let (_, backlog_insert_s) = insert_records(
        scen,
        backlog - u64::from(CLAIM_BATCH),
        false,
        due_in_past(backlog),
    )
    .await?;
    let backlog_ms = time_claims(&store, reps).await?;
    let row = |key: &str, future_records: u64, samples: Vec<f64>, insert: Value| {
        let mut sorted = samples.clone();
        sorted.sort_by(f64::total_cmp);
        Row {
            scenario: key.into(),
            description: format!(
                "Store::claim of {CLAIM_BATCH} with {future_records} future records in the collection{}, median of {reps}",
                if key == "claim-backlog" {
                    format!(" and {backlog} due")
                } else {
                    format!(" and {CLAIM_BATCH} due")
                }
            ),
            records: u64::from(CLAIM_BATCH),
            claim_latency_ms: Some(ClaimMs {
                median: percentile(&sorted, 0.5),
                min: sorted.first().copied().unwrap_or(f64::NAN),
                max: sorted.last().copied().unwrap_or(f64::NAN),
                samples,
                future_records,
            }),
            details: insert,
            ..Row::default()
        }
    };
    Ok(vec![
        row(
            "claim-small",
            small,
            small_ms,
            json!({ "due_insert_seconds": due_insert_s, "future_insert_seconds": small_insert_s }),
        ),
        row(
            "claim-large",
            large,
            large_ms,
            json!({
                "future_insert_seconds": large_insert_s,
                "future_inserted": large - small,
                "future_insert_per_s": (large - small) as f64 / large_insert_s,
            }),
        ),
        row(
            "claim-backlog",
            large,
            backlog_ms,
            json!({ "due_records": backlog, "due_insert_seconds": backlog_insert_s }),
        ),
    ])
}

/// Times `reps` claims of the due batch, after one untimed warm-up claim (the first after a
/// bulk insert pays for the server's catching up); each claim's rows are released afterwards
/// so that the next claim finds them due again.
async fn time_claims(store: &Store, reps: usize) -> Result<Vec<f64>> {
    let mut samples = Vec::with_capacity(reps);
    for i in 0..=reps {
        let t = Instant::now();
        let claim = store.claim(CLAIM_BATCH, V7_LEASE).await?;
        if i > 0 {
            samples.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        if claim.rows.len() != CLAIM_BATCH as usize {
            bail!(
                "claim returned {} rows, expected {CLAIM_BATCH}",
                claim.rows.len()
            );
        }
        let ids: Vec<Bson> = claim.rows.iter().map(|r| r.id.clone()).collect();
        store.release_many(&ids, claim.lease.owner).await?;
    }
    Ok(samples)
}

// ---------------------------------------------------------------------------------------------
// The run

fn env_parse<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The `timeoutd` executable: `TIMEOUTD_BENCH_BIN`, else the one cargo built for this bench.
fn timeoutd_bin() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("TIMEOUTD_BENCH_BIN") {
        return Ok(PathBuf::from(p));
    }
    if let Some(p) = option_env!("CARGO_BIN_EXE_timeoutd") {
        return Ok(PathBuf::from(p));
    }
    // target/<profile>/deps/dispatch-HASH -> target/<profile>/timeoutd
    let exe = std::env::current_exe()?;
    let candidate = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("timeoutd"))
        .context("no target directory")?;
    if candidate.exists() {
        Ok(candidate)
    } else {
        bail!(
            "{} not found: run `cargo build --release` first, or set TIMEOUTD_BENCH_BIN",
            candidate.display()
        )
    }
}

fn machine_info() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, m)| m.trim().to_string());
    let mem_total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().next().map(str::to_string));
    json!({
        "nproc": std::thread::available_parallelism().map(|n| n.get()).ok(),
        "model_name": model,
        "mem_total": mem_total,
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").ok().map(|s| s.trim().to_string()),
    })
}

fn loadavg() -> Option<String> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

fn rabbitmq_version(amqp_uri: &str) -> Option<String> {
    let local = amqp_uri.contains("@127.0.0.1") || amqp_uri.contains("@localhost");
    if !local {
        return None;
    }
    let out = std::process::Command::new("timeout")
        .args(["15", "rabbitmqctl", "version"])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let v = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !v.is_empty()).then_some(v)
}

async fn run(started_mongo: Option<&Secantus>) -> Result<()> {
    let scale: f64 = env_parse("TIMEOUTD_BENCH_SCALE", 1.0);
    if !scale.is_finite() || scale <= 0.0 {
        bail!("TIMEOUTD_BENCH_SCALE must be a positive number");
    }
    let out_path = PathBuf::from(
        std::env::var("TIMEOUTD_BENCH_OUT").unwrap_or_else(|_| DEFAULT_OUT.to_string()),
    );
    let only: Option<Vec<String>> = std::env::var("TIMEOUTD_BENCH_ONLY")
        .ok()
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.split(',').map(|k| k.trim().to_string()).collect());
    if let Some(only) = &only {
        for k in only {
            if !ALL_SCENARIOS.contains(&k.as_str()) {
                bail!(
                    "TIMEOUTD_BENCH_ONLY: unknown scenario `{k}` (known: {})",
                    ALL_SCENARIOS.join(", ")
                );
            }
        }
    }
    let selected = |k: &str| only.as_ref().is_none_or(|o| o.iter().any(|x| x == k));
    let mongo_uri = match started_mongo {
        Some(s) => s.uri.clone(),
        None => std::env::var("TIMEOUTD_BENCH_MONGODB_URI")?,
    };
    let amqp_uri =
        std::env::var("TIMEOUTD_BENCH_AMQP_URI").unwrap_or_else(|_| DEFAULT_AMQP_URI.to_string());
    let bin = timeoutd_bin()?;
    let live = match std::env::var("TIMEOUTD_BENCH_CONSUMER").as_deref() {
        Err(_) | Ok("") | Ok("live") => true,
        Ok("after") => false,
        Ok(other) => bail!("TIMEOUTD_BENCH_CONSUMER: `{other}` is neither live nor after"),
    };
    let client = Client::with_uri_str(&mongo_uri).await?;
    let build_info = client
        .database("admin")
        .run_command(doc! { "buildInfo": 1 })
        .await
        .ok();
    let admin = Connection::connect(&amqp_uri, ConnectionProperties::default())
        .await
        .with_context(|| {
            format!(
                "RabbitMQ at {} (set TIMEOUTD_BENCH_AMQP_URI)",
                timeoutd::config::redact_uri(&amqp_uri)
            )
        })?;
    let admin_channel = admin.create_channel().await?;
    let ctx = Ctx {
        mongo_uri,
        amqp_uri: amqp_uri.clone(),
        client,
        admin,
        admin_channel,
        scale,
        bin,
        work: tempfile::tempdir()?,
        run_id: Uuid::new_v4().simple().to_string()[..8].to_string(),
        rabbit: RabbitConfig::default(),
        live,
        effective_config: std::sync::Mutex::new(None),
        shape: Shape::from_env()?,
    };
    let run_started = Instant::now();
    let load_before = loadavg();
    eprintln!(
        "dispatch bench: scale {scale}, collection shape {}, timeoutd {}, MongoDB {}, RabbitMQ {}",
        ctx.shape.name(),
        ctx.bin.display(),
        timeoutd::config::redact_uri(&ctx.mongo_uri),
        timeoutd::config::redact_uri(&ctx.amqp_uri)
    );

    let mut rows: Vec<Row> = Vec::new();
    for key in ALL_SCENARIOS {
        if !selected(key) {
            continue;
        }
        eprintln!("dispatch bench: {key} ...");
        let t = Instant::now();
        let load_at_start = loadavg();
        let scen = Scen::new(&ctx, key).await?;
        let result = match *key {
            "raw" => scenario_raw(&ctx, &scen).await.map(|r| vec![r]),
            "floors" => floors::scenario_floors(&ctx, &scen).await,
            "baseline" => scenario_baseline(&ctx, &scen).await.map(|r| vec![r]),
            "timeoutd-1" => {
                scenario_timeoutd_drain(&ctx, &scen, key, ctx.scaled(DRAIN_RECORDS, 1_000), 1)
                    .await
                    .map(|r| vec![r])
            }
            "timeoutd-3" => {
                scenario_timeoutd_drain(&ctx, &scen, key, ctx.scaled(DRAIN_RECORDS, 1_000), 3)
                    .await
                    .map(|r| vec![r])
            }
            "lateness-timeoutd" => scenario_lateness(&ctx, &scen, true).await.map(|r| vec![r]),
            "lateness-baseline" => scenario_lateness(&ctx, &scen, false).await.map(|r| vec![r]),
            "claim" => scenario_claim(&ctx, &scen).await,
            "claim-paused" => paused::scenario(&ctx, &scen).await,
            "rss" => scenario_timeoutd_drain(&ctx, &scen, key, ctx.scaled(RSS_RECORDS, 1_000), 1)
                .await
                .map(|r| vec![r]),
            _ => unreachable!(),
        };
        scen.cleanup(&ctx).await;
        match result {
            Ok(mut r) => {
                for row in r.iter_mut() {
                    row.details["scenario_wall_seconds"] = json!(t.elapsed().as_secs_f64());
                    row.details["loadavg_at_start"] = json!(load_at_start);
                }
                rows.extend(r)
            }
            Err(e) => {
                eprintln!("dispatch bench: {key} failed: {e:#}");
                rows.push(Row {
                    scenario: key.to_string(),
                    error: Some(format!("{e:#}")),
                    ..Row::default()
                });
            }
        }
        eprintln!(
            "dispatch bench: {key} done in {:.1} s",
            t.elapsed().as_secs_f64()
        );
    }

    let rate_of = |k: &str| {
        rows.iter()
            .find(|r| r.scenario == k && r.error.is_none())
            .and_then(|r| r.records_per_s)
    };
    let (raw, baseline) = (rate_of("raw"), rate_of("baseline"));
    let floor = rate_of("floor-write");
    for r in rows.iter_mut() {
        if r.scenario.starts_with("lateness") {
            continue;
        }
        if let Some(rate) = r.records_per_s {
            r.ratio_to_raw = raw.map(|x| rate / x);
            r.ratio_to_floor = floor.map(|x| rate / x);
            r.ratio_to_baseline = baseline.map(|x| rate / x);
        }
    }
    let targets = targets(&rows);
    print_table(&rows, scale, ctx.live, ctx.shape);
    print_breakdown(&rows);
    print_targets(&targets);

    let report = json!({
        "benchmark": "timeoutd dispatch (issue 5)",
        "generated_at": humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
        "scale": scale,
        "consumer": if ctx.live { "live" } else { "after" },
        "shape": ctx.shape.name(),
        "shape_description": ctx.shape.describe(),
        "reduced_run": scale < 1.0,
        "total_seconds": run_started.elapsed().as_secs_f64(),
        "machine": machine_info(),
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
        "services": {
            "mongodb_uri": timeoutd::config::redact_uri(&ctx.mongo_uri),
            "mongodb_started_by_bench": started_mongo.is_some(),
            "secantus_version": started_mongo.map(|s| s.version.clone()),
            "mongodb_build_info_version": build_info.as_ref().and_then(|b| b.get_str("version").ok()),
            "amqp_uri": timeoutd::config::redact_uri(&amqp_uri),
            "rabbitmq_version": rabbitmq_version(&amqp_uri),
        },
        "timeoutd_bin": ctx.bin.display().to_string(),
        "timeoutd_effective_config": ctx.effective_config.lock().expect("lock").clone(),
        "notes": [
            "records/s: records divided by the time from the start (process spawn, or the baseline loop's start) until every record was received by a consumer on the destination queue and the collection was empty (consumer live), or until the collection was empty, raw: all confirmed (consumer after)",
            "lateness: consumer receive instant minus due instant, host clock; RabbitMQ may deliver a persistent message before it confirms it, so this is the lateness a receiver sees, within a few ms of confirm minus due; daemon_metrics has timeoutd's own confirm-minus-due histogram bounds",
            "baseline: ServiceConnect v7's claim and per-record send/confirm/deleteOne, given timeoutd's query shape (explicit $and on the Time.0 index) and an immediate re-poll after a full batch, so it is an optimistic v7",
            "duplicates: deliveries of a record id beyond its first",
        ],
        "rows": rows,
        "targets": targets,
    });
    if let Some(dir) = out_path.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&out_path, serde_json::to_string_pretty(&report)? + "\n")?;
    println!("JSON written to {}", out_path.display());
    let _ = ctx.admin.close(200, "done".into()).await;
    Ok(())
}

#[derive(Debug, Serialize)]
struct Target {
    target: String,
    measured: String,
    pass: Option<bool>,
}

fn targets(rows: &[Row]) -> Vec<Target> {
    let row = |k: &str| rows.iter().find(|r| r.scenario == k && r.error.is_none());
    let rate = |k: &str| row(k).and_then(|r| r.records_per_s);
    let mut t = Vec::new();
    let mut push = |target: &str, measured: Option<String>, pass: Option<bool>| {
        t.push(Target {
            target: target.into(),
            measured: measured.unwrap_or_else(|| "not measured".into()),
            pass,
        })
    };
    let one = row("timeoutd-1");
    let r = one.and_then(|r| r.ratio_to_floor);
    push(
        "timeoutd-1 >= 0.85x the database write floor",
        r.map(|r| format!("{r:.2}x")),
        r.map(|r| r >= 0.85),
    );
    let r = one.and_then(|r| r.ratio_to_baseline);
    push(
        "timeoutd-1 >= 8x baseline",
        r.map(|r| format!("{r:.1}x")),
        r.map(|r| r >= 8.0),
    );
    let three = row("timeoutd-3");
    let m = rate("timeoutd-3")
        .zip(rate("timeoutd-1"))
        .zip(three.and_then(|r| r.duplicates));
    push(
        "timeoutd-3 >= 0.95x timeoutd-1, zero duplicates",
        m.map(|((a, b), d)| {
            format!(
                "{:.2}x ({a:.0}/s vs {b:.0}/s), {d} duplicates",
                a / b.max(f64::MIN_POSITIVE)
            )
        }),
        m.map(|((a, b), d)| a >= 0.95 * b && d == 0),
    );
    let l = row("lateness-timeoutd").and_then(|r| r.lateness_ms.clone());
    push(
        "timeoutd lateness p99 <= 25 ms, max <= 100 ms",
        l.as_ref()
            .map(|l| format!("p99 {:.1} ms, max {:.1} ms", l.p99, l.max)),
        l.as_ref().map(|l| l.p99 <= 25.0 && l.max <= 100.0),
    );
    let small = row("claim-small").and_then(|r| r.claim_latency_ms.clone());
    let large = row("claim-large").and_then(|r| r.claim_latency_ms.clone());
    let c = small.zip(large);
    push(
        "claim latency at 1M future <= 2x at 10k",
        c.as_ref().map(|(s, l)| {
            format!(
                "{:.1} ms at {} vs {:.1} ms at {}",
                l.median, l.future_records, s.median, s.future_records
            )
        }),
        c.as_ref().map(|(s, l)| l.median <= 2.0 * s.median),
    );
    let rss = row("rss").and_then(|r| r.peak_rss_mib);
    push(
        "peak RSS <= 64 MiB draining 100k",
        rss.map(|m| format!("{m:.1} MiB")),
        rss.map(|m| m <= 64.0),
    );
    t
}

fn fmt_opt(v: Option<f64>, decimals: usize) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{x:.decimals$}"),
        _ => "-".into(),
    }
}

fn print_table(rows: &[Row], scale: f64, live: bool, shape: Shape) {
    println!();
    println!(
        "timeoutd dispatch benchmark, collection {}, consumer {}, scale {scale}{}",
        shape.describe(),
        if live { "live" } else { "after" },
        if scale < 1.0 {
            " (REDUCED: record counts scaled down)"
        } else {
            ""
        }
    );
    println!(
        "{:<18} {:>8} {:>8} {:>10} {:>7} {:>7} {:>8} {:>5} {:>9} {:>9} {:>9} {:>9} {:>7}",
        "scenario",
        "records",
        "seconds",
        "records/s",
        "x floor",
        "x raw",
        "x base",
        "dups",
        "late p50",
        "late p99",
        "late max",
        "claim ms",
        "RSS MiB"
    );
    for r in rows {
        if let Some(e) = &r.error {
            println!(
                "{:<18} FAILED: {}",
                r.scenario,
                e.lines().next().unwrap_or("")
            );
            continue;
        }
        let l = r.lateness_ms.as_ref();
        println!(
            "{:<18} {:>8} {:>8} {:>10} {:>7} {:>7} {:>8} {:>5} {:>9} {:>9} {:>9} {:>9} {:>7}",
            r.scenario,
            r.records,
            fmt_opt(r.seconds, 2),
            fmt_opt(r.records_per_s, 0),
            fmt_opt(r.ratio_to_floor, 2),
            fmt_opt(r.ratio_to_raw, 2),
            fmt_opt(r.ratio_to_baseline, 1),
            r.duplicates
                .map(|d| d.to_string())
                .unwrap_or_else(|| "-".into()),
            fmt_opt(l.map(|l| l.p50), 1),
            fmt_opt(l.map(|l| l.p99), 1),
            fmt_opt(l.map(|l| l.max), 1),
            fmt_opt(r.claim_latency_ms.as_ref().map(|c| c.median), 1),
            fmt_opt(r.peak_rss_mib, 1),
        );
    }
    println!();
}

/// Where each record's time went in the drains, from the daemons' own histograms.
fn print_breakdown(rows: &[Row]) {
    let mut any = false;
    for r in rows.iter().filter(|r| r.error.is_none()) {
        let Some(m) = r.details.pointer("/daemon_metrics/ms_per_record") else {
            continue;
        };
        if r.scenario.starts_with("lateness") {
            continue;
        }
        if !any {
            println!(
                "ms per record, from the daemons' metrics (instances' time summed; rest = idle, or overlap when negative):"
            );
            println!(
                "  {:<12} {:>7} {:>7} {:>9} {:>7} {:>7} {:>9} {:>7} {:>7}",
                "scenario",
                "find",
                "claim",
                "read_back",
                "remove",
                "release",
                "pub+conf",
                "rest",
                "wall"
            );
            any = true;
        }
        let f = |k: &str| m.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
        println!(
            "  {:<12} {:>7.4} {:>7.4} {:>9.4} {:>7.4} {:>7.4} {:>9.4} {:>7.4} {:>7.4}",
            r.scenario,
            f("find"),
            f("claim"),
            f("read_back"),
            f("remove"),
            f("release"),
            f("publish_confirm"),
            f("rest"),
            f("wall"),
        );
    }
    for r in rows
        .iter()
        .filter(|r| r.scenario == "floor-write" && r.error.is_none())
    {
        let f = |k: &str| r.details.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
        println!(
            "  {:<12} {:>7} {:>7.4} {:>9} {:>7.4}",
            r.scenario,
            "-",
            f("update_ms_per_record"),
            "-",
            f("delete_ms_per_record"),
        );
    }
    if any {
        println!();
    }
}

fn print_targets(targets: &[Target]) {
    println!("targets:");
    for t in targets {
        let verdict = match t.pass {
            Some(true) => "PASS",
            Some(false) => "FAIL",
            None => "-   ",
        };
        println!("  {verdict}  {:<48} {}", t.target, t.measured);
    }
    println!();
}
