//! A broker that stalls: records whose publish failed are released as soon as the wave's
//! outcome is known (not when the loop next goes idle), and a broker that stops reading
//! cannot hold up SIGTERM. Real binary, real RabbitMQ behind a proxy, real test MongoDB.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common;

use std::time::Duration;

use bson::doc;
use common::fleet::Daemon;
use common::proxy::{Mode, Proxy, host_port};
use common::*;
use uuid::Uuid;

fn ids_filter(ids: &[Uuid]) -> bson::Document {
    let ids: Vec<bson::Bson> = ids.iter().map(|id| uuid(*id)).collect();
    doc! { "_id": { "$in": ids } }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_wave_is_released_at_once_while_later_records_are_still_held() {
    let env = TestEnv::new().await;
    let proxy = Proxy::start(&host_port(&amqp_uri())).await;
    let mut config = env.config();
    config.rabbitmq.uri = proxy.rewrite(&amqp_uri());
    config.rabbitmq.publish_timeout = Duration::from_secs(1);
    config.rabbitmq.connect_timeout = Duration::from_secs(1);
    config.dispatch.look_ahead = Some(Duration::from_secs(60));
    config.dispatch.lock_lease = Duration::from_secs(120);
    let d = Daemon::spawn("timeoutd", env.env_vars(&config)).await;
    assert!(d.ready_is(200, Duration::from_secs(20)).await);

    // The broker stops answering; then five records fall due now and five in 40 s, claimed
    // together (look-ahead) and held.
    proxy.set(Mode::Stall);
    let now_ids: Vec<Uuid> = (0..5).map(|_| Uuid::new_v4()).collect();
    let later_ids: Vec<Uuid> = (0..5).map(|_| Uuid::new_v4()).collect();
    let docs = now_ids
        .iter()
        .map(|id| v7_record(*id, &env.queue, Uuid::new_v4(), in_ms(-10), doc! {}))
        .chain(
            later_ids
                .iter()
                .map(|id| v7_record(*id, &env.queue, Uuid::new_v4(), in_ms(40_000), doc! {})),
        )
        .collect();
    env.insert(docs).await;

    // The wave of the five due ones times out; they are released while the five later ones
    // are still held under the same claim. (Before, a failed wave was released only once
    // nothing was pending any more: here, after the later records were sent.)
    let now_free = doc! { "$and": [ids_filter(&now_ids), is_free()] };
    let later_held = doc! { "$and": [ids_filter(&later_ids), { "Locked": true }] };
    let released_early = eventually(Duration::from_secs(30), || async {
        env.count(now_free.clone()).await == 5 && env.count(later_held.clone()).await == 5
    })
    .await;
    assert!(
        released_early,
        "the failed wave was released while the later records were held: {:#?}",
        d.logs_containing("WARN")
    );
    proxy.set(Mode::Forward);
    env.cleanup().await;
}

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
