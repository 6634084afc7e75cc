//! A broker that stalls: one that stops reading cannot hold up SIGTERM, and publishes it
//! withholds confirms for are possible duplicates, not lost leases. Real binary, real RabbitMQ
//! behind a proxy, real test MongoDB. (That a failed wave is released at once, while the later
//! records of its claim are still held, is a rule of the dispatch machine, shown by its unit
//! test of that name.)
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common;

use std::time::Duration;

use bson::doc;
use common::fleet::Daemon;
use common::proxy::{Mode, Proxy, host_port};
use common::*;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_exits_in_time_when_the_broker_stops_reading_mid_wave() {
    let env = TestEnv::new().await;
    let proxy = Proxy::start(&host_port(&amqp_uri())).await;
    let mut config = env.config();
    config.rabbitmq.uri = proxy.rewrite(&amqp_uri());
    config.rabbitmq.publish_timeout = Duration::from_secs(120);
    config.dispatch.shutdown_timeout = Duration::from_secs(2);
    config.dispatch.look_ahead = Some(Duration::from_secs(10));
    let mut d = Daemon::spawn("timeoutd", env.env_vars(&config)).await;
    assert!(d.ready_is(200, Duration::from_secs(20)).await);

    // A broker that stops reading (as under a memory or disk alarm): the proxy holds every
    // byte, so once the socket buffers fill, writing a publish blocks. 250 records with
    // 120 KB of headers each (30 MB, far more than loopback's buffers hold), due in 15 s and
    // claimed up to 10 s ahead, so that they are all held before they fall due and one wave
    // sends them all. (SecantusDB returns one 16 MB reply to a claim's find, about 110 of
    // these records: the next claim, a poll later, takes the rest.)
    proxy.set(Mode::Stall);
    let big = "x".repeat(120_000);
    let ids: Vec<Uuid> = (0..250).map(|_| Uuid::new_v4()).collect();
    // One due instant for all, so that one wave sends them all.
    let due = in_ms(15_000);
    env.insert(
        ids.iter()
            .map(|id| v7_record(*id, &env.queue, Uuid::new_v4(), due, doc! { "Big": &big }))
            .collect(),
    )
    .await;
    let claimed = eventually(Duration::from_secs(30), || async {
        env.count(doc! { "Locked": true }).await == 250
    })
    .await;
    assert!(
        claimed,
        "the daemon claimed the records: {} locked; {:#?}",
        env.count(doc! { "Locked": true }).await,
        d.logs_containing("claim")
    );
    // The wave is under way: no confirm can come, and the writes stop.
    assert!(
        d.logged("publishing a wave", Duration::from_secs(20)).await,
        "{:#?}",
        d.logs()
    );
    d.sigterm();
    let status = d.wait(Duration::from_secs(30)).await;
    assert_eq!(status.code(), Some(0), "{:#?}", d.logs());
    assert_eq!(
        env.count(is_free()).await,
        250,
        "every claimed record released: {:#?}",
        d.logs_containing("WARN")
    );
    assert!(
        !d.logs_containing("did not finish in time").is_empty(),
        "the publishes were blocked writing, not only waiting for confirms: {:#?}",
        d.logs_containing("WARN")
    );
    proxy.set(Mode::Forward);
    env.cleanup().await;
}

/// Issue 25, 8.9: a broker that withholds confirms causes possible duplicates, counted by
/// their cause, and no lost lease: nothing lost its lease (before, each was counted as one, and
/// an operator paged on lost leases could not tell a lease problem from a broker outage).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unconfirmed_publishes_are_possible_duplicates_not_lost_leases() {
    let env = TestEnv::new().await;
    let proxy = Proxy::start(&host_port(&amqp_uri())).await;
    let mut config = env.config();
    config.rabbitmq.uri = proxy.rewrite(&amqp_uri());
    config.rabbitmq.publish_timeout = Duration::from_secs(1);
    config.rabbitmq.connect_timeout = Duration::from_secs(1);
    config.dispatch.lock_lease = Duration::from_secs(120);
    let d = Daemon::spawn("timeoutd", env.env_vars(&config)).await;
    assert!(d.ready_is(200, Duration::from_secs(20)).await);

    proxy.set(Mode::Stall);
    let ids: Vec<Uuid> = (0..5).map(|_| Uuid::new_v4()).collect();
    env.insert(
        ids.iter()
            .map(|id| v7_record(*id, &env.queue, Uuid::new_v4(), in_ms(-10), doc! {}))
            .collect(),
    )
    .await;
    let timeout = "timeoutd_possible_duplicates_total{cause=\"timeout\"}";
    let connection = "timeoutd_possible_duplicates_total{cause=\"connection\"}";
    let counted = eventually(Duration::from_secs(30), || async {
        let m = d.metrics().await;
        common::fleet::series(&m, timeout) + common::fleet::series(&m, connection) >= 5.0
    })
    .await;
    let metrics = d.metrics().await;
    assert!(counted, "the unconfirmed publishes are counted: {metrics}");
    assert_eq!(
        common::fleet::series(&metrics, "timeoutd_lease_lost_total"),
        0.0,
        "no lease was lost: {metrics}"
    );
    proxy.set(Mode::Forward);
    env.cleanup().await;
}
