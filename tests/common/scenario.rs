//! What every fault scenario shares (`tests/suite/faults.rs`, `tests/suite/slowness.rs`): the fleet's
//! configuration, an instance spawned behind its proxies, and the audit of deliveries.
//!
//! Every scenario checks the same three rules:
//! - no record is lost: each one is delivered at least once and the collection ends empty;
//! - no duplicate where the lease protocol forbids one;
//! - every duplicate a fault forces is counted in `timeoutd_possible_duplicates_total` (summed
//!   over its causes and the instances, scraped before each one stops) or is explained by a record that a killed
//!   instance held when it died (one extra delivery each).

use std::collections::BTreeSet;
use std::time::Duration;

use bson::doc;
use timeoutd::config::Config;
use uuid::Uuid;

use super::fleet::{Daemon, DeliveryCounter, vars};
use super::proxy::{Mode, Proxy, host_port};
use super::{TestEnv, amqp_uri, eventually, mongo_uri, with_query};

pub const LEASE_LOST: &str = "timeoutd_lease_lost_total";
/// Where every possible duplicate is counted, by cause ([`super::fleet::duplicates`] sums them).
pub const DUPLICATES: &str = "timeoutd_possible_duplicates_total";

pub fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// The test configuration with a given lease and batch size; publishes wait long for their
/// confirms, so a held-back confirm keeps an instance in the middle of its batch.
pub fn fleet_config(env: &TestEnv, lease: Duration, batch_size: u32) -> Config {
    let mut c = env.config();
    c.dispatch.lock_lease = lease;
    c.dispatch.batch_size = batch_size;
    c.dispatch.lease_safety_margin = Duration::from_millis(500);
    c.rabbitmq.publish_timeout = secs(30);
    c
}

/// Spawns one instance; its RabbitMQ and MongoDB links go through the given proxies.
pub async fn spawn(
    name: &str,
    env: &TestEnv,
    config: &Config,
    amqp: Option<&Proxy>,
    mongodb: Option<&Proxy>,
) -> Daemon {
    let mut c = config.clone();
    if let Some(p) = amqp {
        c.rabbitmq.uri = p.rewrite(&amqp_uri());
    }
    if let Some(p) = mongodb {
        // Through the proxy only (the server may advertise its own address); an operation
        // gives up after 2 s without a server, so a cut shows as errors and retries.
        c.mongodb.uri = with_query(
            &with_query(&p.rewrite(&mongo_uri()), "directConnection=true"),
            "serverSelectionTimeoutMS=2000",
        );
    }
    Daemon::spawn(name, vars(env, &c)).await
}

pub async fn amqp_proxy(initial: Mode) -> Proxy {
    Proxy::start_in(&host_port(&amqp_uri()), initial).await
}

pub async fn empty(env: &TestEnv, within: Duration) -> bool {
    eventually(within, || async { env.count(doc! {}).await == 0 }).await
}

/// Checks the three rules; prints and returns the number of duplicate deliveries.
/// `killed_held`: records a killed instance held when it died.
pub fn audit(
    scenario: &str,
    ids: &[Uuid],
    counter: &DeliveryCounter,
    lease_lost: f64,
    killed_held: &BTreeSet<String>,
) -> usize {
    let counts = counter.counts();
    let known: BTreeSet<String> = ids.iter().map(Uuid::to_string).collect();
    let missing: Vec<&String> = known
        .iter()
        .filter(|id| !counts.contains_key(*id))
        .collect();
    assert!(
        missing.is_empty(),
        "{scenario}: {} of {} records were never delivered, e.g. {:?}",
        missing.len(),
        ids.len(),
        &missing[..missing.len().min(5)]
    );
    assert!(
        counts.keys().all(|id| known.contains(id)),
        "{scenario}: a delivery of a record the test never inserted"
    );
    assert_eq!(
        counter.without_id(),
        0,
        "{scenario}: a delivery without TimeoutId"
    );
    let duplicates = counter.duplicates();
    // A killed instance may have sent each record it held once before dying.
    let unexplained: usize = counts
        .iter()
        .map(|(id, c)| c.saturating_sub(if killed_held.contains(id) { 2 } else { 1 }))
        .sum();
    let late = counter.lateness_ms();
    let p99 = late
        .get((late.len().saturating_sub(1)) * 99 / 100)
        .copied()
        .unwrap_or(0);
    eprintln!(
        "FAULTS {scenario}: records={} deliveries={} duplicates={duplicates} lease_lost={lease_lost} killed_held={} duplicates_beyond_kills={unexplained} lateness_p99_ms={p99}",
        ids.len(),
        counter.total(),
        killed_held.len(),
    );
    assert!(
        unexplained as f64 <= lease_lost,
        "{scenario}: {unexplained} duplicate deliveries are neither counted in {DUPLICATES} ({lease_lost}) nor explained by a killed instance; duplicated records: {:?}",
        counts
            .iter()
            .filter(|(_, c)| **c > 1)
            .take(5)
            .collect::<Vec<_>>()
    );
    duplicates
}

/// A proxy to this test's MongoDB, starting in `initial`.
pub async fn mongodb_proxy(initial: Mode) -> Proxy {
    Proxy::start_in(&host_port(&mongo_uri()), initial).await
}

/// Checks that every instance of `fleet`, on its own, still dispatches: each in turn, with
/// its peers frozen (SIGSTOP), sends `n` fresh records due now. An instance that answers and
/// dispatches nothing (wedged by an earlier fault) fails it, even when its peers would have
/// sent everything. Call once the collection is empty, so that a frozen peer holds nothing.
/// (A frozen peer cannot have sent them.) Returns the ids of the records it inserted.
pub async fn each_alone_delivers(
    env: &TestEnv,
    fleet: &[&Daemon],
    counter: &DeliveryCounter,
    n: usize,
) -> Vec<Uuid> {
    let mut all = Vec::new();
    for (i, d) in fleet.iter().enumerate() {
        let peers: Vec<&&Daemon> = fleet
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, p)| p)
            .collect();
        for p in &peers {
            p.signal(libc::SIGSTOP);
        }
        let ids = env.insert_due(n).await;
        let sent = eventually(Duration::from_secs(60), || async {
            ids.iter().all(|id| counter.count_of(id) >= 1)
        })
        .await;
        for p in &peers {
            p.signal(libc::SIGCONT);
        }
        assert!(
            sent,
            "{} alone sent {} of {n} fresh records once the fault was over; its last notices: {:#?}",
            d.name,
            ids.iter().filter(|id| counter.count_of(id) >= 1).count(),
            last_notices(d, 15)
        );
        assert!(empty(env, Duration::from_secs(30)).await);
        all.extend(ids);
    }
    all
}

/// The last `n` lines of `d` at INFO or above, for a failure message (the debug lines of the
/// background tasks would hide them).
pub fn last_notices(d: &Daemon, n: usize) -> Vec<String> {
    let mut last: Vec<String> = d
        .logs()
        .into_iter()
        .rev()
        .filter(|l| !l.contains(" DEBUG ") && !l.contains(" TRACE "))
        .take(n)
        .collect();
    last.reverse();
    last
}
