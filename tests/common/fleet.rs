//! Several timeoutd processes on one collection, for fault injection.
//!
//! - [`Daemon`]: the real binary spawned with `TIMEOUTD_*` variables, its stderr kept line by
//!   line, its HTTP address read from the start-up log; SIGTERM, SIGKILL, `/metrics` scrapes.
//! - [`DeliveryCounter`]: a consumer that counts deliveries per `TimeoutId` header.
//! - The proxies between an instance and its services are [`super::proxy::Proxy`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::options::BasicConsumeOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties};
use timeoutd::config::Config;
use tokio::io::{AsyncBufReadExt, BufReader};
use uuid::Uuid;

use super::{TestEnv, amqp_uri, eventually};

pub const BIN: &str = env!("CARGO_BIN_EXE_timeoutd");

/// The binary with `args`, in the caller's environment without `RUST_LOG` and
/// `TIMEOUTD_CONFIG`, plus `vars`.
pub fn command(args: &[&str], vars: &[(String, String)]) -> std::process::Command {
    let mut cmd = std::process::Command::new(BIN);
    cmd.args(args)
        .env_remove("RUST_LOG")
        .env_remove("TIMEOUTD_CONFIG")
        .envs(vars.iter().cloned());
    cmd
}

/// Runs the binary to its end (see [`command`]).
pub fn run(args: &[&str], vars: &[(String, String)]) -> std::process::Output {
    command(args, vars).output().expect("run timeoutd")
}

/// `env.env_vars(c)` plus the keys it leaves out that fault tests set.
pub fn vars(env: &TestEnv, c: &Config) -> Vec<(String, String)> {
    let ms = |d: Duration| format!("{}ms", d.as_millis());
    let mut v = env.env_vars(c);
    v.push((
        "TIMEOUTD_DISPATCH__BATCH_SIZE".into(),
        c.dispatch.batch_size.to_string(),
    ));
    v.push((
        "TIMEOUTD_DISPATCH__LEASE_SAFETY_MARGIN".into(),
        ms(c.dispatch.lease_safety_margin),
    ));
    if let Some(i) = c.reaper.interval {
        v.push(("TIMEOUTD_REAPER__INTERVAL".into(), ms(i)));
    }
    v
}

/// One `timeoutd run` process.
pub struct Daemon {
    pub name: String,
    child: tokio::process::Child,
    /// `http://HOST:PORT` of its endpoints.
    pub base: String,
    logs: Arc<Mutex<Vec<String>>>,
}

impl Daemon {
    /// Spawns `timeoutd run` with `vars` (debug logs for timeoutd, so every claim logs its
    /// owner) and waits for its HTTP address.
    pub async fn spawn(name: &str, vars: Vec<(String, String)>) -> Daemon {
        let mut cmd = tokio::process::Command::new(BIN);
        cmd.arg("run")
            .env(
                "RUST_LOG",
                "info,timeoutd=debug,lapin::returned_messages=error",
            )
            .env("NO_COLOR", "1")
            .envs(vars)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        // No daemon outlives a test binary that was killed.
        super::dies_with_the_tests(cmd.as_std_mut());
        let mut child = cmd.spawn().expect("spawn timeoutd");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let logs = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = tokio::sync::oneshot::channel();
        let kept = logs.clone();
        tokio::spawn(async move {
            let mut tx = Some(tx);
            while let Ok(Some(line)) = lines.next_line().await {
                // Text logs say addr=HOST:PORT; JSON logs say "addr":"HOST:PORT".
                let addr = line
                    .split_once("addr=")
                    .or_else(|| line.split_once("\"addr\":\""))
                    .map(|(_, rest)| {
                        rest.chars()
                            .take_while(|c| !c.is_whitespace() && *c != '"')
                            .collect::<String>()
                    });
                if let Some(addr) = addr
                    && let Some(tx) = tx.take()
                {
                    let _ = tx.send(addr);
                }
                kept.lock().unwrap().push(line);
            }
        });
        let addr = match tokio::time::timeout(Duration::from_secs(30), rx).await {
            Ok(Ok(addr)) => addr,
            _ => panic!(
                "{name} did not log its HTTP address; its logs:\n{}",
                logs.lock().unwrap().join("\n")
            ),
        };
        Daemon {
            name: name.to_string(),
            child,
            base: format!("http://{addr}"),
            logs,
        }
    }

    pub fn logs(&self) -> Vec<String> {
        self.logs.lock().unwrap().clone()
    }

    /// Log lines containing `needle`.
    pub fn logs_containing(&self, needle: &str) -> Vec<String> {
        self.logs
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(needle))
            .cloned()
            .collect()
    }

    /// Every lease owner this process named in its logs (each claim logs its owner at debug).
    pub fn owners(&self) -> BTreeSet<Uuid> {
        self.logs
            .lock()
            .unwrap()
            .iter()
            .filter_map(|l| {
                let (_, rest) = l.split_once("owner=")?;
                Uuid::parse_str(rest.get(..36)?).ok()
            })
            .collect()
    }

    /// Waits up to `within` for a log line containing `needle`.
    pub async fn logged(&self, needle: &str, within: Duration) -> bool {
        eventually(within, || async {
            !self.logs_containing(needle).is_empty()
        })
        .await
    }

    /// Sends `sig` to the process (SIGSTOP and SIGCONT freeze and thaw it).
    pub fn signal(&self, sig: i32) {
        if let Some(pid) = self.child.id() {
            // SAFETY: signalling our own child process.
            unsafe { libc::kill(pid as i32, sig) };
        }
    }

    /// The process's peak resident memory (`VmHWM`) in KiB, while it runs.
    pub fn peak_rss_kib(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()?)).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }

    pub fn sigterm(&self) {
        self.signal(libc::SIGTERM);
    }

    /// `kill -9`: no shutdown, no releases; waits until the process is gone.
    pub async fn kill9(&mut self) -> ExitStatus {
        self.signal(libc::SIGKILL);
        self.wait(Duration::from_secs(10)).await
    }

    pub async fn wait(&mut self, within: Duration) -> ExitStatus {
        tokio::time::timeout(within, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("{} did not exit within {within:?}", self.name))
            .expect("wait for timeoutd")
    }

    /// SIGTERM and wait; panics unless it exits 0.
    pub async fn stop(mut self) -> Vec<String> {
        self.sigterm();
        let status = self.wait(Duration::from_secs(40)).await;
        assert_eq!(
            status.code(),
            Some(0),
            "{} exit status; logs:\n{}",
            self.name,
            self.logs().join("\n")
        );
        self.logs()
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        http_get(format!("{}{path}", self.base)).await
    }

    pub async fn metrics(&self) -> String {
        let (code, text) = self.get("/metrics").await;
        assert_eq!(code, 200, "{} /metrics", self.name);
        text
    }

    /// One series of `/metrics`, `name` with its labels as rendered; 0 when absent.
    pub async fn metric(&self, name: &str) -> f64 {
        series(&self.metrics().await, name)
    }

    /// `/metrics` once no batch is in flight, so the counters include all the last batch did.
    pub async fn idle_metrics(&self) -> String {
        idle_metrics(&self.base).await
    }

    /// One series of [`Daemon::idle_metrics`].
    pub async fn idle_metric(&self, name: &str) -> f64 {
        series(&self.idle_metrics().await, name)
    }

    /// Records this instance counted as possibly delivered twice, summed over the causes
    /// ([`duplicates`]).
    pub async fn duplicates(&self) -> f64 {
        duplicates(&self.metrics().await)
    }

    /// [`Daemon::duplicates`] once no batch is in flight.
    pub async fn idle_duplicates(&self) -> f64 {
        duplicates(&self.idle_metrics().await)
    }

    /// Waits up to `within` for `/readyz` to answer `code`.
    pub async fn ready_is(&self, code: u16, within: Duration) -> bool {
        eventually(within, || async { self.get("/readyz").await.0 == code }).await
    }
}

/// A test that fails with a daemon still running prints that daemon's warnings and errors
/// (the last [`LINES_ON_FAILURE`]), so a failure seen once, on CI, says what the daemon saw.
impl Drop for Daemon {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let Ok(logs) = self.logs.lock() else { return };
        let notable: Vec<&String> = logs
            .iter()
            .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
            .collect();
        let skip = notable.len().saturating_sub(LINES_ON_FAILURE);
        eprintln!(
            "--- {}: {} warnings and errors in {} log lines{} ---",
            self.name,
            notable.len(),
            logs.len(),
            if skip > 0 { ", the last ones" } else { "" }
        );
        for line in &notable[skip..] {
            eprintln!("{line}");
        }
    }
}

const LINES_ON_FAILURE: usize = 300;

/// One GET; `(status, body)`. Panics when nothing answers.
pub async fn http_get(url: String) -> (u16, String) {
    tokio::task::spawn_blocking(move || {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(10)))
            .build()
            .new_agent();
        let mut r = agent
            .get(&url)
            .call()
            .unwrap_or_else(|e| panic!("GET {url}: {e}"));
        (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
    })
    .await
    .unwrap()
}

/// `/metrics` of the daemon at `base` once `timeoutd_leases_held` is 0: no batch in flight,
/// so every counter includes what the last batch did (waits up to 60 s).
pub async fn idle_metrics(base: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (code, text) = http_get(format!("{base}/metrics")).await;
        assert_eq!(code, 200, "{base}/metrics");
        if series(&text, "timeoutd_leases_held") == 0.0 {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "{base} still holds leases: {text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The value of one series (`name` with its label text, exactly as rendered); 0 when absent.
pub fn series(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// `timeoutd_possible_duplicates_total`, summed over its causes: every record that may be
/// delivered twice.
pub fn duplicates(metrics: &str) -> f64 {
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix("timeoutd_possible_duplicates_total{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
        .sum()
}

#[derive(Default)]
struct Tally {
    per_id: HashMap<String, usize>,
    /// When each record was first delivered (wall clock).
    first: HashMap<String, std::time::SystemTime>,
    total: usize,
    without_id: usize,
    last: Option<Instant>,
}

/// Consumes a queue (auto-ack) on its own connection and counts deliveries per `TimeoutId`.
pub struct DeliveryCounter {
    tally: Arc<Mutex<Tally>>,
    conn: Connection,
    _channel: Channel,
}

impl DeliveryCounter {
    pub async fn start(queue: &str) -> Self {
        let conn = Connection::connect(&amqp_uri(), ConnectionProperties::default())
            .await
            .expect("RabbitMQ for the delivery counter");
        let channel = conn.create_channel().await.expect("channel");
        let mut consumer = channel
            .basic_consume(
                queue.into(),
                format!("counter-{}", Uuid::new_v4()).as_str().into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("consume");
        let tally = Arc::new(Mutex::new(Tally::default()));
        let t = tally.clone();
        tokio::spawn(async move {
            while let Some(Ok(d)) = consumer.next().await {
                let id = d.properties.headers().as_ref().and_then(|h| {
                    h.inner().iter().find_map(|(k, v)| match v {
                        AMQPValue::LongString(s) if k.as_str() == "TimeoutId" => {
                            Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
                        }
                        _ => None,
                    })
                });
                let mut t = t.lock().unwrap();
                t.total += 1;
                t.last = Some(Instant::now());
                match id {
                    Some(id) => {
                        t.first
                            .entry(id.clone())
                            .or_insert_with(std::time::SystemTime::now);
                        *t.per_id.entry(id).or_default() += 1;
                    }
                    None => t.without_id += 1,
                }
            }
        });
        Self {
            tally,
            conn,
            _channel: channel,
        }
    }

    /// Deliveries so far, all copies.
    pub fn total(&self) -> usize {
        self.tally.lock().unwrap().total
    }

    /// Records delivered at least once.
    pub fn distinct(&self) -> usize {
        self.tally.lock().unwrap().per_id.len()
    }

    /// Deliveries beyond the first of each record.
    pub fn duplicates(&self) -> usize {
        let t = self.tally.lock().unwrap();
        t.total - t.without_id - t.per_id.len()
    }

    /// Deliveries that carried no `TimeoutId` header.
    pub fn without_id(&self) -> usize {
        self.tally.lock().unwrap().without_id
    }

    pub fn count_of(&self, id: &Uuid) -> usize {
        self.tally
            .lock()
            .unwrap()
            .per_id
            .get(&id.to_string())
            .copied()
            .unwrap_or(0)
    }

    /// First delivery minus due instant, in ms, of every delivered record whose due instant
    /// the test recorded; sorted.
    pub fn lateness_ms(&self) -> Vec<i64> {
        let mut late: Vec<i64> = self
            .first_seen()
            .iter()
            .filter_map(|(id, t)| {
                let got = t.duration_since(std::time::UNIX_EPOCH).ok()?.as_millis() as i64;
                Some(got - super::due_ms(id)?)
            })
            .collect();
        late.sort_unstable();
        late
    }

    /// When each record was first delivered.
    pub fn first_seen(&self) -> HashMap<String, std::time::SystemTime> {
        self.tally.lock().unwrap().first.clone()
    }

    /// Deliveries per record.
    pub fn counts(&self) -> BTreeMap<String, usize> {
        self.tally
            .lock()
            .unwrap()
            .per_id
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect()
    }

    /// Waits up to `within` until `n` distinct records were delivered.
    pub async fn wait_distinct(&self, n: usize, within: Duration) -> bool {
        eventually(within, || async { self.distinct() >= n }).await
    }

    /// Waits up to `within` until `n` deliveries (copies included) arrived.
    pub async fn wait_total(&self, n: usize, within: Duration) -> bool {
        eventually(within, || async { self.total() >= n }).await
    }

    /// Waits until no delivery arrived for `quiet` (at most 30 s), so late copies are counted.
    pub async fn settle(&self, quiet: Duration) {
        let quiet_now = || {
            let last = self.tally.lock().unwrap().last;
            async move { last.is_none_or(|t| t.elapsed() >= quiet) }
        };
        assert!(
            eventually(Duration::from_secs(30), quiet_now).await,
            "deliveries never stopped"
        );
    }

    pub async fn close(self) {
        let _ = self.conn.close(200, "done".into()).await;
    }
}
