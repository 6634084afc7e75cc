//! A real three-node RabbitMQ cluster for the cluster tests, started by
//! `scripts/start-rabbitmq-cluster.sh` beside the system node and stopped (also when a test
//! fails) by `scripts/stop-rabbitmq-cluster.sh`; and a consumer that survives the loss of
//! the node it reads from.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};
use uuid::Uuid;

/// Three clustered nodes; stopped when dropped.
pub struct Cluster {
    dir: PathBuf,
    /// Node name and AMQP port, in the order of [`Cluster::uris`].
    pub nodes: Vec<(String, u16)>,
}

impl Cluster {
    /// Starts the cluster (about 30 s). A node that does not come up (seen once in a
    /// suite run on 2 busy cores: an Erlang node that never registered with epmd) gets the
    /// whole cluster stopped and started afresh, up to three times; then it panics with the
    /// script's output and the tail of each node's log.
    pub fn start() -> Self {
        let mut failures = Vec::new();
        for _ in 0..3 {
            match Self::start_once() {
                Ok(cluster) => return cluster,
                Err(why) => {
                    eprintln!("cluster start failed, starting afresh: {why}");
                    failures.push(why);
                }
            }
        }
        panic!("start-rabbitmq-cluster.sh failed three times: {failures:#?}");
    }

    fn start_once() -> Result<Self, String> {
        let id = Uuid::new_v4().simple().to_string();
        let dir = std::env::temp_dir().join(format!("timeoutd-cluster-{}", &id[..8]));
        let prefix = format!("tdc{}n", &id[..6]);
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/start-rabbitmq-cluster.sh"
        );
        let out = Command::new(script)
            .arg(&dir)
            .arg(&prefix)
            .output()
            .expect("run scripts/start-rabbitmq-cluster.sh");
        // Stopped when dropped, this attempt's nodes too.
        let mut cluster = Self {
            dir,
            nodes: Vec::new(),
        };
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            return Err(format!(
                "{stdout}{}{}",
                String::from_utf8_lossy(&out.stderr),
                cluster.log_tails()
            ));
        }
        let nodes = stdout
            .lines()
            .filter_map(|l| {
                let (name, port) = l.split_once(' ')?;
                Some((name.to_string(), port.trim().parse().ok()?))
            })
            .collect::<Vec<_>>();
        if nodes.len() != 3 {
            return Err(format!("the script named {} nodes: {stdout}", nodes.len()));
        }
        cluster.nodes = nodes;
        Ok(cluster)
    }

    /// The last lines of each node's logs, for a start that failed.
    fn log_tails(&self) -> String {
        let mut tails = String::new();
        for i in 1..=3 {
            let Ok(entries) = std::fs::read_dir(self.dir.join(i.to_string()).join("log")) else {
                continue;
            };
            for entry in entries.flatten() {
                let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                let tail = lines[lines.len().saturating_sub(15)..].join("\n");
                tails.push_str(&format!("\n--- {}:\n{tail}", entry.path().display()));
            }
        }
        tails
    }

    pub fn uri(&self, i: usize) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.nodes[i].1)
    }

    pub fn uris(&self) -> Vec<String> {
        (0..self.nodes.len()).map(|i| self.uri(i)).collect()
    }

    /// The node whose AMQP port is `port`.
    pub fn index_of_port(&self, port: u16) -> Option<usize> {
        self.nodes.iter().position(|(_, p)| *p == port)
    }

    /// `rabbitmqctl -n NODE ARGS`; returns its output, or panics if it fails.
    pub async fn ctl(&self, i: usize, args: &[&str]) -> String {
        let out = tokio::process::Command::new("rabbitmqctl")
            .arg("-q")
            .arg("-n")
            .arg(&self.nodes[i].0)
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .await
            .expect("run rabbitmqctl");
        assert!(
            out.status.success(),
            "rabbitmqctl -n {} {args:?}: {}",
            self.nodes[i].0,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Stops the RabbitMQ application of node `i` (the Erlang VM stays, as for a restart).
    pub async fn stop(&self, i: usize) {
        self.ctl(i, &["stop_app"]).await;
    }

    pub async fn start_node(&self, i: usize) {
        self.ctl(i, &["start_app"]).await;
    }

    /// Starts several stopped nodes at once (a cluster whose every node stopped waits for
    /// its peers as it starts).
    pub async fn start_all(&self, which: &[usize]) {
        futures::future::join_all(which.iter().map(|i| self.start_node(*i))).await;
    }

    /// Declares a durable quorum queue through node `via`, its leader on that node.
    pub async fn declare_quorum_queue(&self, via: usize, name: &str) {
        let conn = Connection::connect(&self.uri(via), ConnectionProperties::default())
            .await
            .expect("connect to the cluster");
        let channel = conn.create_channel().await.expect("channel");
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        args.insert(
            "x-queue-leader-locator".into(),
            AMQPValue::LongString("client-local".into()),
        );
        channel
            .queue_declare(
                name.into(),
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                args,
            )
            .await
            .expect("declare the quorum queue");
        let _ = conn.close(200, "declared".into()).await;
    }

    /// The node that leads quorum queue `name`, as node `via` sees it.
    pub async fn leader_of(&self, via: usize, name: &str) -> Option<usize> {
        let out = self.ctl(via, &["list_queues", "name", "leader"]).await;
        let leader = out.lines().find_map(|l| {
            let mut cols = l.split_whitespace();
            (cols.next() == Some(name)).then(|| cols.next().map(str::to_string))?
        })?;
        self.nodes.iter().position(|(n, _)| *n == leader)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/stop-rabbitmq-cluster.sh"
        );
        let _ = Command::new(script).arg(&self.dir).status();
    }
}

#[derive(Default)]
struct Tally {
    /// First deliveries (not redelivered by the broker) per `TimeoutId`.
    fresh: HashMap<String, usize>,
    /// When each record was first seen.
    first: HashMap<String, std::time::SystemTime>,
    /// Broker redeliveries after a consumer lost its link (not timeoutd's doing).
    redelivered: usize,
    last: Option<Instant>,
}

/// Consumes a queue of the cluster with acknowledgements, reconnecting to the next node when
/// its node goes, and counts deliveries per `TimeoutId`. A message is acknowledged after it
/// is counted, so none is lost to the test; a broker redelivery (`redelivered`) is counted
/// apart, as it is the consumer's link that failed, not timeoutd.
pub struct ClusterCounter {
    tally: Arc<Mutex<Tally>>,
    stop: tokio_util::sync::CancellationToken,
}

impl ClusterCounter {
    /// Starts consuming through node `first`, then the others in turn.
    pub fn start(uris: Vec<String>, first: usize, queue: &str) -> Self {
        let tally = Arc::new(Mutex::new(Tally::default()));
        let stop = tokio_util::sync::CancellationToken::new();
        let (t, s, queue) = (tally.clone(), stop.clone(), queue.to_string());
        tokio::spawn(async move {
            let mut next = first;
            while !s.is_cancelled() {
                let uri = uris[next % uris.len()].clone();
                next += 1;
                tokio::select! {
                    _ = consume(&uri, &queue, &t) => {}
                    _ = s.cancelled() => return,
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        Self { tally, stop }
    }

    /// Records delivered at least once.
    pub fn distinct(&self) -> usize {
        self.tally.lock().unwrap().fresh.len()
    }

    /// Fresh deliveries beyond the first of each record: timeoutd sent it again.
    pub fn duplicates(&self) -> usize {
        let t = self.tally.lock().unwrap();
        t.fresh.values().map(|n| n - 1).sum()
    }

    pub fn redelivered(&self) -> usize {
        self.tally.lock().unwrap().redelivered
    }

    pub fn has(&self, id: &Uuid) -> bool {
        self.tally
            .lock()
            .unwrap()
            .fresh
            .contains_key(&id.to_string())
    }

    /// First delivery minus due instant, in ms, of the records `ids`, sorted.
    pub fn lateness_ms(&self, ids: &[Uuid]) -> Vec<i64> {
        let t = self.tally.lock().unwrap();
        let mut late: Vec<i64> = ids
            .iter()
            .map(|id| id.to_string())
            .filter_map(|id| {
                let at = t.first.get(&id)?;
                let got = at.duration_since(std::time::UNIX_EPOCH).ok()?.as_millis() as i64;
                Some(got - super::due_ms(&id)?)
            })
            .collect();
        late.sort_unstable();
        late
    }

    /// Waits until no delivery arrived for `quiet` (at most 60 s), so late copies are counted.
    pub async fn settle(&self, quiet: Duration) {
        let quiet_now = || {
            let last = self.tally.lock().unwrap().last;
            async move { last.is_none_or(|t| t.elapsed() >= quiet) }
        };
        assert!(
            super::eventually(Duration::from_secs(60), quiet_now).await,
            "deliveries never stopped"
        );
    }

    pub fn close(self) {
        self.stop.cancel();
    }
}

async fn consume(uri: &str, queue: &str, tally: &Arc<Mutex<Tally>>) {
    let connect = Connection::connect(uri, ConnectionProperties::default());
    let Ok(Ok(conn)) = tokio::time::timeout(Duration::from_secs(5), connect).await else {
        return;
    };
    let Ok(channel) = conn.create_channel().await else {
        return;
    };
    let consumer = channel
        .basic_consume(
            queue.into(),
            format!("counter-{}", Uuid::new_v4()).as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await;
    let Ok(mut consumer) = consumer else {
        return;
    };
    while let Some(Ok(d)) = consumer.next().await {
        let id = d.properties.headers().as_ref().and_then(|h| {
            h.inner().iter().find_map(|(k, v)| match v {
                AMQPValue::LongString(s) if k.as_str() == "TimeoutId" => {
                    Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
                }
                _ => None,
            })
        });
        {
            let mut t = tally.lock().unwrap();
            t.last = Some(Instant::now());
            match id {
                Some(id) if d.redelivered && t.fresh.contains_key(&id) => t.redelivered += 1,
                Some(id) => {
                    t.first
                        .entry(id.clone())
                        .or_insert_with(std::time::SystemTime::now);
                    *t.fresh.entry(id).or_default() += 1;
                }
                None => {}
            }
        }
        if d.acker.ack(BasicAckOptions::default()).await.is_err() {
            return;
        }
    }
}
