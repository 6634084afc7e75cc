//! Test harness: the real test MongoDB and the real RabbitMQ, isolated per test.
//!
//! MongoDB: `TIMEOUTD_TEST_MONGODB_URI` when set (a real MongoDB, or a server a script
//! started); otherwise one `secantusd-rs` per test binary on a free port in a temporary
//! directory. RabbitMQ: `TIMEOUTD_TEST_AMQP_URI`, default the local broker. Each test gets
//! its own database and its own queue names, so tests run in parallel.
#![allow(dead_code)]

pub mod cluster;
pub mod csharp;
pub mod fleet;
pub mod hostile;
pub mod ops;
pub mod proxy;
pub mod scenario;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use bson::spec::BinarySubtype;
use bson::{Bson, DateTime, Document, doc};
use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use mongodb::{Client, Collection};
use timeoutd::config::Config;
use uuid::Uuid;

pub const DEFAULT_AMQP_URI: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// .NET ticks at the Unix epoch, written out here rather than taken from the crate.
const EPOCH_TICKS: i64 = 621_355_968_000_000_000;

pub fn amqp_uri() -> String {
    std::env::var("TIMEOUTD_TEST_AMQP_URI").unwrap_or_else(|_| DEFAULT_AMQP_URI.into())
}

/// The MongoDB URI tests use; starts a `secantusd-rs` on first use when none is given.
pub fn mongo_uri() -> String {
    static URI: OnceLock<String> = OnceLock::new();
    URI.get_or_init(|| match std::env::var("TIMEOUTD_TEST_MONGODB_URI") {
        Ok(uri) if !uri.is_empty() => uri,
        _ => start_secantus(),
    })
    .clone()
}

/// Prefix of the test server's data directories: `<prefix><pid>-<random>`.
const SERVER_DIR_PREFIX: &str = "timeoutd-test-secantus-";

/// The data directory lives as long as the test process, which ends without dropping it:
/// each test binary removes the ones whose process is gone (they held 100-600 MB each).
fn remove_stale_server_dirs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(SERVER_DIR_PREFIX)
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Sets the parent-death signal of a child the tests start, so that it goes when the test
/// process goes, even killed.
pub fn dies_with_the_tests(cmd: &mut Command) {
    // SAFETY: prctl is async-signal-safe; it only sets this child's parent-death signal.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

/// Starts `secantusd-rs --port 0` from a thread that lives as long as the test process, with
/// the parent-death signal set so the server goes when the tests go.
fn start_secantus() -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        remove_stale_server_dirs();
        let dir = tempfile::Builder::new()
            .prefix(&format!("{SERVER_DIR_PREFIX}{}-", std::process::id()))
            .tempdir()
            .expect("temp dir for secantusd-rs");
        let mut cmd = Command::new("secantusd-rs");
        // Test commands: `configureFailPoint` (failCommand, maxTimeAlwaysTimeOut) for the
        // fault cases of tests/conformance_mongodb.rs.
        cmd.args([
            "--port",
            "0",
            "--log-level",
            "WARNING",
            "--enable-test-commands",
            "--storage-path",
        ])
        .arg(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
        dies_with_the_tests(&mut cmd);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                let _ = tx.send(Err(format!(
                    "cannot start secantusd-rs ({e}). Run scripts/install-test-mongodb.sh, or set TIMEOUTD_TEST_MONGODB_URI to a MongoDB"
                )));
                return;
            }
        };
        let stdout = child.stdout.take().expect("piped stdout");
        let mut lines = BufReader::new(stdout).lines();
        let mut sent = false;
        for line in lines.by_ref() {
            let Ok(line) = line else { break };
            if let Some(addr) = line.strip_prefix("secantusd-rs listening on ") {
                let _ = tx.send(Ok(format!("mongodb://{}/", addr.trim())));
                sent = true;
                break;
            }
        }
        if !sent {
            let _ = tx.send(Err("secantusd-rs exited before listening".into()));
        }
        // Keep draining stdout and keep this thread (the child's parent) alive.
        for _ in lines {}
        let _ = child.wait();
        drop(dir);
        loop {
            std::thread::park();
        }
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(Ok(uri)) => uri,
        Ok(Err(e)) => panic!("{e}"),
        Err(_) => panic!("secantusd-rs did not start within 60 s"),
    }
}

/// One test's private database, collection and queue.
pub struct TestEnv {
    pub db_name: String,
    pub queue: String,
    pub coll: Collection<Document>,
    pub amqp: Connection,
    pub channel: Channel,
}

impl TestEnv {
    pub async fn new() -> Self {
        let id = Uuid::new_v4().simple().to_string();
        let db_name = format!("timeoutd_test_{}", &id[..12]);
        let client = Client::with_uri_str(mongo_uri())
            .await
            .expect("mongodb client");
        let coll = client.database(&db_name).collection::<Document>("Timeouts");
        let amqp = Connection::connect(&amqp_uri(), ConnectionProperties::default())
            .await
            .expect("RabbitMQ at TIMEOUTD_TEST_AMQP_URI or 127.0.0.1:5672");
        let channel = amqp.create_channel().await.expect("channel");
        let queue = format!("timeoutd-test-{}", &id[..12]);
        let env = Self {
            db_name,
            queue: queue.clone(),
            coll,
            amqp,
            channel,
        };
        env.declare_queue(&queue).await;
        env
    }

    pub async fn declare_queue(&self, name: &str) {
        self.channel
            .queue_declare(
                name.into(),
                QueueDeclareOptions {
                    auto_delete: false,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("queue declare");
    }

    /// A configuration for this test: its database, short intervals.
    pub fn config(&self) -> Config {
        let mut c = Config::default();
        c.mongodb.uri = mongo_uri();
        c.mongodb.database = self.db_name.clone();
        c.rabbitmq.uri = amqp_uri();
        c.dispatch.poll_interval = Duration::from_millis(100);
        c.dispatch.lock_lease = Duration::from_secs(30);
        c.dispatch.lease_safety_margin = Duration::from_secs(2);
        c.dispatch.shutdown_timeout = Duration::from_secs(2);
        c.rabbitmq.publish_timeout = Duration::from_secs(5);
        c.http.listen = "127.0.0.1:0".parse().unwrap();
        c
    }

    /// The same configuration as `TIMEOUTD_*` environment variables, for the binary.
    pub fn env_vars(&self, c: &Config) -> Vec<(String, String)> {
        let ms = |d: Duration| format!("{}ms", d.as_millis());
        vec![
            ("TIMEOUTD_MONGODB__URI".into(), c.mongodb.uri.clone()),
            (
                "TIMEOUTD_MONGODB__DATABASE".into(),
                c.mongodb.database.clone(),
            ),
            ("TIMEOUTD_RABBITMQ__URI".into(), c.rabbitmq.uri.clone()),
            (
                "TIMEOUTD_DISPATCH__POLL_INTERVAL".into(),
                ms(c.dispatch.poll_interval),
            ),
            (
                "TIMEOUTD_DISPATCH__LOCK_LEASE".into(),
                ms(c.dispatch.lock_lease),
            ),
            (
                "TIMEOUTD_DISPATCH__SHUTDOWN_TIMEOUT".into(),
                ms(c.dispatch.shutdown_timeout),
            ),
            (
                "TIMEOUTD_RABBITMQ__PUBLISH_TIMEOUT".into(),
                ms(c.rabbitmq.publish_timeout),
            ),
            ("TIMEOUTD_HTTP__LISTEN".into(), "127.0.0.1:0".into()),
            (
                "TIMEOUTD_MONGODB__OPERATION_TIMEOUT".into(),
                ms(c.mongodb.operation_timeout),
            ),
            (
                "TIMEOUTD_RABBITMQ__CONNECT_TIMEOUT".into(),
                ms(c.rabbitmq.connect_timeout),
            ),
            (
                "TIMEOUTD_DISPATCH__LOOK_AHEAD".into(),
                ms(c.dispatch.look_ahead()),
            ),
            (
                "TIMEOUTD_MONGODB__TIME_ENCODING".into(),
                serde_json::to_value(c.mongodb.time_encoding)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default(),
            ),
        ]
        .into_iter()
        .chain([
            ("TIMEOUTD_RETRY__BASE".into(), ms(c.retry.base)),
            ("TIMEOUTD_RETRY__CAP".into(), ms(c.retry.cap)),
            (
                "TIMEOUTD_RETRY__MAX_ATTEMPTS".into(),
                c.retry.max_attempts.to_string(),
            ),
        ])
        .chain(
            c.reaper
                .interval
                .map(|i| ("TIMEOUTD_REAPER__INTERVAL".into(), ms(i))),
        )
        .collect()
    }

    pub async fn insert(&self, docs: Vec<Document>) {
        remember_due(&docs);
        if !docs.is_empty() {
            self.coll.insert_many(docs).await.expect("insert");
        }
    }

    /// Inserts `n` free records due 10 ms ago, addressed to this test's queue.
    pub async fn insert_due(&self, n: usize) -> Vec<Uuid> {
        let ids: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
        self.insert(
            ids.iter()
                .map(|id| v7_record(*id, &self.queue, Uuid::new_v4(), in_ms(-10), doc! {}))
                .collect(),
        )
        .await;
        ids
    }

    pub async fn count(&self, filter: Document) -> u64 {
        self.coll.count_documents(filter).await.expect("count")
    }

    pub async fn find(&self, id: Uuid) -> Option<Document> {
        self.coll
            .find_one(doc! { "_id": uuid(id) })
            .await
            .expect("find")
    }

    /// Starts consuming this test's queue.
    pub async fn consumer(&self) -> Consumer {
        self.consumer_of(&self.queue).await
    }

    pub async fn consumer_of(&self, queue: &str) -> Consumer {
        let inner = self
            .channel
            .basic_consume(
                queue.into(),
                format!("test-{}", Uuid::new_v4()).as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("consume");
        Consumer { inner }
    }

    pub async fn cleanup(self) {
        let _ = self
            .channel
            .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
            .await;
        let _ = self.coll.client().database(&self.db_name).drop().await;
        let _ = self.amqp.close(200, "done".into()).await;
    }
}

/// A message as a receiver sees it.
#[derive(Debug, Clone)]
pub struct Received {
    pub body: String,
    pub headers: BTreeMap<String, AMQPValue>,
    pub properties: BasicProperties,
    pub routing_key: String,
}

impl Received {
    /// A header that must be an AMQP long string.
    pub fn header(&self, k: &str) -> Option<String> {
        self.headers.get(k).map(|v| match v {
            AMQPValue::LongString(s) => String::from_utf8(s.as_bytes().to_vec()).unwrap(),
            other => panic!("header {k} is not a long string: {other:?}"),
        })
    }
}

pub struct Consumer {
    inner: lapin::Consumer,
}

impl Consumer {
    /// Receives until `n` messages arrived or `within` passed.
    pub async fn take(&mut self, n: usize, within: Duration) -> Vec<Received> {
        let mut out = Vec::new();
        let deadline = tokio::time::Instant::now() + within;
        while out.len() < n {
            match tokio::time::timeout_at(deadline, self.inner.next()).await {
                Ok(Some(Ok(d))) => {
                    d.ack(BasicAckOptions::default()).await.expect("ack");
                    let headers = d
                        .properties
                        .headers()
                        .clone()
                        .map(|h| {
                            h.inner()
                                .iter()
                                .map(|(k, v)| (k.as_str().to_string(), v.clone()))
                                .collect()
                        })
                        .unwrap_or_default();
                    out.push(Received {
                        body: String::from_utf8(d.data.clone()).expect("utf-8 body"),
                        headers,
                        properties: d.properties.clone(),
                        routing_key: d.routing_key.as_str().to_string(),
                    });
                }
                _ => break,
            }
        }
        out
    }
}

pub fn uuid(u: Uuid) -> Bson {
    Bson::Binary(bson::Binary {
        subtype: BinarySubtype::Uuid,
        bytes: u.as_bytes().to_vec(),
    })
}

pub fn ticks(t: DateTime) -> i64 {
    t.timestamp_millis() * 10_000 + EPOCH_TICKS
}

/// A free record in ServiceConnect v7's exact shape, due at `due`.
pub fn v7_record(
    id: Uuid,
    destination: &str,
    pm: Uuid,
    due: DateTime,
    headers: Document,
) -> Document {
    doc! {
        "_id": uuid(id),
        "Destination": destination,
        "ProcessManagerId": uuid(pm),
        "Time": [ticks(due), 0_i32],
        "Headers": headers,
        "Locked": false,
        "LockedBy": uuid(Uuid::nil()),
        "LockExpiresAt": Bson::Null,
    }
}

/// `now + ms` (negative for the past), on this host's clock.
pub fn in_ms(ms: i64) -> DateTime {
    DateTime::from_millis(DateTime::now().timestamp_millis() + ms)
}

/// Polls `check` every 50 ms until it is true or `within` passed; returns the last result.
pub async fn eventually<F, Fut>(within: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The filter of a free record: what ServiceConnect writes and what a release restores.
pub fn is_free() -> Document {
    doc! { "Locked": false, "LockedBy": uuid(Uuid::nil()), "LockExpiresAt": Bson::Null }
}

/// `uri` with one more query option.
pub fn with_query(uri: &str, option: &str) -> String {
    if uri.contains('?') {
        format!("{uri}&{option}")
    } else if uri.ends_with('/') {
        format!("{uri}?{option}")
    } else {
        format!("{uri}/?{option}")
    }
}

/// The daemon running in this test process.
pub struct Running {
    token: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

/// Starts `timeoutd run` in-process with `config`.
pub fn start(config: Config) -> Running {
    let token = tokio_util::sync::CancellationToken::new();
    let t = token.clone();
    let task = tokio::spawn(async move {
        timeoutd::cli::daemon::run(config, t)
            .await
            .expect("daemon run");
    });
    Running { token, task }
}

impl Running {
    /// Stops it as SIGTERM would, and waits.
    pub async fn stop(self) {
        self.token.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("daemon stops within its shutdown timeout")
            .expect("daemon task");
    }
}

/// Due instants (Unix ms) of every v7-shaped record a test inserted, by id: what lateness is
/// measured against.
fn due_registry() -> &'static std::sync::Mutex<std::collections::HashMap<String, i64>> {
    static DUE: OnceLock<std::sync::Mutex<std::collections::HashMap<String, i64>>> =
        OnceLock::new();
    DUE.get_or_init(Default::default)
}

pub fn remember_due(docs: &[Document]) {
    let mut due = due_registry().lock().unwrap();
    for d in docs {
        let id = match d.get("_id") {
            Some(Bson::Binary(b)) => Uuid::from_slice(&b.bytes).ok(),
            _ => None,
        };
        let ticks = d
            .get_array("Time")
            .ok()
            .and_then(|t| t.first())
            .and_then(Bson::as_i64);
        if let (Some(id), Some(ticks)) = (id, ticks) {
            due.insert(id.to_string(), (ticks - EPOCH_TICKS) / 10_000);
        }
    }
}

/// The due instant (Unix ms) of a record this test binary inserted.
pub fn due_ms(id: &str) -> Option<i64> {
    due_registry().lock().unwrap().get(id).copied()
}
