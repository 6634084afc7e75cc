//! A real three-node RabbitMQ cluster (scripts/start-rabbitmq-cluster.sh) and a quorum queue:
//! one timeoutd given every node, each behind a TCP proxy so that its link can be cut, and
//! the scenarios of issue 20 in sequence on the one cluster (it takes about 30 s to start):
//! the node in use stopped under a steady stream, its link cut, a node restarted while idle,
//! every node down and back, the queue's leader stopped, and a memory alarm
//! (`connection.blocked`). Each asserts that every record is delivered and that duplicates
//! are no more than timeoutd counted (`timeoutd_possible_duplicates_total`). Lateness is printed for
//! the fault table in docs/guarantees.md (no timing is asserted).
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common;

use std::time::Duration;

use bson::doc;
use common::cluster::{Cluster, ClusterCounter};
use common::fleet::Daemon;
use common::proxy::{Mode, Proxy};
use common::*;
use uuid::Uuid;

const NODE_SERIES: &str = "timeoutd_rabbitmq_node{node=\"";

/// Whether scenario `n` runs: all, or those listed in `TIMEOUTD_CLUSTER_SCENARIOS` (e.g.
/// `1,6`), to run one alone while working on it.
fn runs(n: u32) -> bool {
    std::env::var("TIMEOUTD_CLUSTER_SCENARIOS")
        .map_or(true, |v| v.split(',').any(|s| s.trim() == n.to_string()))
}

/// The proxy (index) whose address `timeoutd_rabbitmq_node` shows in use.
async fn node_in_use(d: &Daemon, proxies: &[Proxy]) -> Option<usize> {
    let text = d.metrics().await;
    let line = text
        .lines()
        .find(|l| l.starts_with(NODE_SERIES) && l.ends_with("} 1"))?;
    let addr = line.strip_prefix(NODE_SERIES)?.split('"').next()?;
    proxies.iter().position(|p| p.addr.to_string() == addr)
}

/// `n` records for `queue`, due `start_ms` from now and then one every `every_ms`.
async fn stream(env: &TestEnv, queue: &str, n: usize, start_ms: i64, every_ms: i64) -> Vec<Uuid> {
    let ids: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
    let docs = ids
        .iter()
        .enumerate()
        .map(|(k, id)| {
            let due = in_ms(start_ms + k as i64 * every_ms);
            v7_record(*id, queue, Uuid::new_v4(), due, doc! {})
        })
        .collect();
    env.insert(docs).await;
    ids
}

/// What a scenario ends with: every record delivered, duplicates no more than counted.
struct Check<'a> {
    name: &'a str,
    d: &'a Daemon,
    counter: &'a ClusterCounter,
    lost_before: f64,
    dup_before: usize,
}

impl<'a> Check<'a> {
    async fn begin(name: &'a str, d: &'a Daemon, counter: &'a ClusterCounter) -> Self {
        Check {
            name,
            d,
            counter,
            lost_before: d.idle_duplicates().await,
            dup_before: counter.duplicates(),
        }
    }

    async fn delivered(&self, ids: &[Uuid], within: Duration) {
        let all = eventually(within, || async {
            ids.iter().all(|id| self.counter.has(id))
        })
        .await;
        let missing = ids.iter().filter(|id| !self.counter.has(id)).count();
        assert!(
            all,
            "{}: {missing} of {} records not delivered; {:#?}",
            self.name,
            ids.len(),
            self.d.logs_containing("WARN")
        );
        self.counter.settle(Duration::from_secs(2)).await;
        let counted = self.d.idle_duplicates().await - self.lost_before;
        let dups = self.counter.duplicates() - self.dup_before;
        assert!(
            dups as f64 <= counted,
            "{}: {dups} duplicates, {counted} counted as possible duplicates",
            self.name
        );
        let late = self.counter.lateness_ms(ids);
        println!(
            "{}: {} records, {dups} duplicates ({counted} counted), broker redeliveries {}, lateness p50 {} ms, max {} ms",
            self.name,
            ids.len(),
            self.counter.redelivered(),
            late.get(late.len() / 2).copied().unwrap_or(0),
            late.last().copied().unwrap_or(0),
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_node_cluster_loses_nodes_links_and_leaders_without_losing_records() {
    let cluster = Cluster::start();
    let env = TestEnv::new().await;
    let queue = format!("{}-quorum", env.queue);
    cluster.declare_quorum_queue(0, &queue).await;
    let mut proxies = Vec::new();
    for (_, port) in &cluster.nodes {
        proxies.push(Proxy::start(&format!("127.0.0.1:{port}")).await);
    }
    let uris: Vec<String> = (0..3)
        .map(|i| proxies[i].rewrite(&cluster.uri(i)))
        .collect();
    let mut config = env.config();
    config.rabbitmq.uri = uris.join(",");
    config.rabbitmq.connect_timeout = Duration::from_secs(2);
    config.rabbitmq.publish_timeout = Duration::from_secs(5);
    let d = Daemon::spawn("timeoutd", env.env_vars(&config)).await;
    assert!(
        d.ready_is(200, Duration::from_secs(30)).await,
        "{:#?}",
        d.logs()
    );
    let first = node_in_use(&d, &proxies).await.expect("a node in use");
    // The consumer reads through another node (and follows the nodes as they go).
    let counter = ClusterCounter::start(cluster.uris(), (first + 1) % 3, &queue);
    let failovers = || async { d.metric("timeoutd_rabbitmq_failovers_total").await };
    // 1. The node in use stopped under a steady stream (20 records a second).
    if runs(1) {
        let used = node_in_use(&d, &proxies).await.expect("a node in use");
        let c = Check::begin("node in use stopped", &d, &counter).await;
        let seen = counter.distinct();
        let ids = stream(&env, &queue, 200, 500, 50).await;
        assert!(
            eventually(Duration::from_secs(30), || async {
                counter.distinct() >= seen + 40
            })
            .await
        );
        let before = failovers().await;
        cluster.stop(used).await;
        c.delivered(&ids, Duration::from_secs(60)).await;
        let now_used = node_in_use(&d, &proxies).await.expect("a node in use");
        assert_ne!(now_used, used, "another node took over");
        assert!(failovers().await > before, "the failover was counted");
        assert!(d.logged("RabbitMQ failover", Duration::from_secs(1)).await);
        cluster.start_node(used).await;
        // No flapping: the node that came back is not used again while the other one works.
        let ids = stream(&env, &queue, 20, 0, 10).await;
        c.delivered(&ids, Duration::from_secs(30)).await;
        assert_eq!(
            node_in_use(&d, &proxies).await,
            Some(now_used),
            "no flapping back"
        );
    }

    // 2. The link to the node in use cut under a steady stream.
    if runs(2) {
        let used = node_in_use(&d, &proxies).await.expect("a node in use");
        let c = Check::begin("link to the node in use cut", &d, &counter).await;
        let ids = stream(&env, &queue, 100, 500, 50).await;
        let seen = counter.distinct();
        assert!(
            eventually(Duration::from_secs(30), || async {
                counter.distinct() >= seen + 20
            })
            .await
        );
        proxies[used].set(Mode::Cut);
        c.delivered(&ids, Duration::from_secs(60)).await;
        let now_used = node_in_use(&d, &proxies).await.expect("a node in use");
        assert_ne!(now_used, used, "another node took over");
        proxies[used].set(Mode::Forward);
    }

    // 3. The node in use restarted while idle; then records fall due.
    if runs(3) {
        let used = node_in_use(&d, &proxies).await.expect("a node in use");
        let c = Check::begin("node restarted while idle", &d, &counter).await;
        cluster.stop(used).await;
        cluster.start_node(used).await;
        let ids = stream(&env, &queue, 20, 0, 10).await;
        c.delivered(&ids, Duration::from_secs(60)).await;
    }

    // 4. Every node down, then back: not ready meanwhile, nothing lost.
    if runs(4) {
        let c = Check::begin("every node down and back", &d, &counter).await;
        for i in 0..3 {
            cluster.stop(i).await;
        }
        let ids = stream(&env, &queue, 30, 0, 10).await;
        assert!(d.ready_is(503, Duration::from_secs(30)).await);
        cluster.start_all(&[0, 1, 2]).await;
        c.delivered(&ids, Duration::from_secs(120)).await;
        assert!(d.ready_is(200, Duration::from_secs(30)).await);
    }

    // 5. The quorum queue's leader stopped under a steady stream.
    if runs(5) {
        let used = node_in_use(&d, &proxies).await.expect("a node in use");
        let c = Check::begin("quorum queue leader stopped", &d, &counter).await;
        let other = (used + 1) % 3;
        let leader = cluster.leader_of(other, &queue).await.expect("a leader");
        let ids = stream(&env, &queue, 100, 500, 50).await;
        let seen = counter.distinct();
        assert!(
            eventually(Duration::from_secs(30), || async {
                counter.distinct() >= seen + 20
            })
            .await
        );
        cluster.stop(leader).await;
        c.delivered(&ids, Duration::from_secs(60)).await;
        cluster.start_node(leader).await;
    }

    // 6. A memory alarm: the broker blocks the connection; timeoutd stops claiming and is
    // not ready until the alarm clears; then everything is delivered.
    if runs(6) {
        let used = node_in_use(&d, &proxies).await.expect("a node in use");
        let c = Check::begin("memory alarm (connection.blocked)", &d, &counter).await;
        cluster
            .ctl(used, &["set_vm_memory_high_watermark", "0.000001"])
            .await;
        let ids = stream(&env, &queue, 20, 0, 10).await;
        let blocked = eventually(Duration::from_secs(30), || async {
            d.metric("timeoutd_rabbitmq_blocked").await == 1.0
        })
        .await;
        assert!(
            blocked,
            "the block was seen: {:#?}",
            d.logs_containing("WARN")
        );
        assert!(d.ready_is(503, Duration::from_secs(5)).await);
        let (_, body) = d.get("/readyz").await;
        assert!(body.contains("blocked"), "{body}");
        // Nothing stays claimed while blocked: what was held is released, nothing new is taken.
        let none_held = eventually(Duration::from_secs(30), || async {
            env.count(doc! { "Locked": true }).await == 0
        })
        .await;
        assert!(none_held, "no lease held while blocked");
        cluster
            .ctl(used, &["set_vm_memory_high_watermark", "0.4"])
            .await;
        assert!(d.ready_is(200, Duration::from_secs(30)).await);
        c.delivered(&ids, Duration::from_secs(60)).await;
        assert_eq!(d.metric("timeoutd_rabbitmq_blocked").await, 0.0);
    }

    d.stop().await;
    counter.close();
    env.cleanup().await;
    drop(cluster);
}
