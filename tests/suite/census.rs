//! The census of records nothing fires on its own, against the real test MongoDB and
//! RabbitMQ: stuck `Locked: true` records without a lease (left by public ServiceConnect's
//! poller) and records whose `Time` no branch of the due query matches.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common;

use std::time::Duration;

use bson::{Bson, doc};
use common::csharp::*;
use common::fleet::{Daemon, vars};
use common::*;
use timeoutd::config::TimeEncoding;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_lock_is_counted_freed_after_a_lease_and_fired() {
    let env = TestEnv::new().await;
    let (id, pm) = (Uuid::new_v4(), Uuid::new_v4());
    // What public ServiceConnect's poller leaves when it dies between lock and delete.
    let mut stuck = public_record(id, &env.queue, pm, in_ms(-60_000));
    stuck.insert("Locked", true);
    env.insert(vec![stuck]).await;
    let mut config = env.config();
    config.dispatch.lock_lease = Duration::from_secs(4);
    config.reaper.interval = Some(Duration::from_millis(300));
    let store = store_with(&config).await;
    let stats = store.stats().await.unwrap();
    assert_eq!((stats.stuck_locks, stats.due), (1, 0), "{stats:?}");
    let mut consumer = env.consumer().await;
    let daemon = Daemon::spawn("a", vars(&env, &config)).await;
    let got = consumer.take(1, Duration::from_secs(60)).await;
    assert!(
        daemon
            .logged("another dispatcher", Duration::from_secs(10))
            .await,
        "warns that someone else locks records here"
    );
    let freed = daemon.metric("timeoutd_stuck_locks_freed_total").await;
    daemon.stop().await;
    assert_eq!(got.len(), 1, "the stuck record fired once freed");
    assert_eq!(got[0].header("CorrelationId"), Some(pm.to_string()));
    assert_eq!(freed, 1.0);
    assert_eq!(env.count(doc! {}).await, 0);
    env.cleanup().await;
}

#[tokio::test]
async fn a_stuck_lock_is_freed_only_after_a_whole_lease_keeping_its_shape() {
    let env = TestEnv::new().await;
    let id = Uuid::new_v4();
    let mut stuck = public_record(id, &env.queue, Uuid::new_v4(), in_ms(-60_000));
    stuck.insert("Locked", true);
    let mut nulled = offset_record(Uuid::new_v4(), &env.queue, Uuid::new_v4(), in_ms(-1), 0);
    nulled.insert("Locked", true); // LockExpiresAt: null
    // Found in review: an expiry that is no date was matched by no claim and no reaper pass.
    let mut no_date = offset_record(Uuid::new_v4(), &env.queue, Uuid::new_v4(), in_ms(-1), 0);
    no_date.insert("Locked", true);
    no_date.insert("LockExpiresAt", "2020-01-01");
    env.insert(vec![stuck.clone(), nulled, no_date]).await;
    let store = store_with(&env.config()).await;
    let census = timeoutd::store::census::CensusState::default();
    assert_eq!(
        store
            .free_stuck(&census, Duration::from_secs(3_600))
            .await
            .unwrap(),
        0
    );
    assert_eq!(env.count(doc! { "Locked": true }).await, 3, "not yet");
    assert_eq!(store.free_stuck(&census, Duration::ZERO).await.unwrap(), 3);
    let mut free = stuck;
    free.insert("Locked", false);
    let now = env
        .coll
        .find_one(doc! { "_id": legacy(id) })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(now, free, "only Locked changes: no lease fields added");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unschedulable_records_are_counted_and_named_once() {
    let env = TestEnv::new().await;
    let date_shaped = public_record(Uuid::new_v4(), &env.queue, Uuid::new_v4(), in_ms(-1_000));
    let bad_offset = Uuid::new_v4();
    let mut beyond_14h = offset_record(bad_offset, &env.queue, Uuid::new_v4(), in_ms(-1_000), 0);
    beyond_14h.insert(
        "Time",
        vec![Bson::Int64(ticks(in_ms(-1_000))), Bson::Int32(5_000)],
    );
    let good = Uuid::new_v4();
    env.insert(vec![
        date_shaped,
        beyond_14h,
        v7_record(good, &env.queue, Uuid::new_v4(), in_ms(-1_000), doc! {}),
    ])
    .await;
    let mut config = env.config();
    config.mongodb.time_encoding = TimeEncoding::DotnetTicks;
    config.reaper.interval = Some(Duration::from_millis(200));
    assert_eq!(
        store_with(&config)
            .await
            .stats()
            .await
            .unwrap()
            .unschedulable,
        2,
        "a date under dotnet-ticks, and an offset beyond 14 h"
    );
    let mut auto = config.clone();
    auto.mongodb.time_encoding = TimeEncoding::Auto;
    assert_eq!(
        store_with(&auto).await.stats().await.unwrap().unschedulable,
        1
    );
    let mut consumer = env.consumer().await;
    let mut v = vars(&env, &config);
    v.push((
        "TIMEOUTD_MONGODB__TIME_ENCODING".into(),
        "dotnet-ticks".into(),
    ));
    let daemon = Daemon::spawn("a", v).await;
    let got = consumer.take(1, Duration::from_secs(30)).await;
    let gauge = eventually(Duration::from_secs(30), || async {
        daemon.metric("timeoutd_unschedulable_records").await == 2.0
    })
    .await;
    let named_both = daemon
        .logged(&bad_offset.to_string(), Duration::from_secs(30))
        .await;
    // Three more census passes after both were named.
    let passes = daemon.logs_containing("census taken").len();
    let passes_later = eventually(Duration::from_secs(30), || async {
        daemon.logs_containing("census taken").len() >= passes + 3
    })
    .await;
    let lines = daemon.logs_containing("record cannot be scheduled");
    daemon.stop().await;
    assert_eq!(got.len(), 1, "the schedulable record fires");
    assert_eq!(got[0].header("TimeoutId"), Some(good.to_string()));
    assert!(gauge, "timeoutd_unschedulable_records reports both");
    assert!(named_both && passes_later);
    assert_eq!(lines.len(), 2, "each named once: {lines:#?}");
    assert_eq!(env.count(doc! {}).await, 2, "the unschedulable ones stay");
    env.cleanup().await;
}

/// The monitor's backlog gauge reads at most `up_to` due records, whatever the backlog;
/// `stats` still counts them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_monitor_counts_the_backlog_only_up_to_its_limit() {
    let env = TestEnv::new().await;
    env.insert_due(8).await;
    let store = store_with(&env.config()).await;
    assert_eq!(store.backlog(5).await.unwrap().due, 5);
    let reading = store.backlog(100).await.unwrap();
    assert_eq!(reading.due, 8);
    let oldest = reading.oldest_due_age_seconds;
    assert!(oldest.is_some_and(|age| age >= 0.0), "{oldest:?}");
    assert_eq!(store.stats().await.unwrap().due, 8);
    env.cleanup().await;
}

/// Finding 6 of issue 19: a record whose `Locked` is missing or not a boolean (and that has no
/// lease expiry) matches no claim and no reaper pass. It used to be in no count at all; now
/// `stats`, the census and its gauge count it, and the log names it once. It is never
/// written to: timeoutd only writes to records it can claim under the lease rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_with_an_odd_locked_are_counted_named_and_left_alone() {
    let env = TestEnv::new().await;
    let odd: Vec<Uuid> = (0..3).map(|_| Uuid::new_v4()).collect();
    let mut docs = Vec::new();
    for (id, locked) in odd
        .iter()
        .zip([None, Some(Bson::from("false")), Some(Bson::Int32(0))])
    {
        let mut d = v7_record(*id, &env.queue, Uuid::new_v4(), in_ms(-1_000), doc! {});
        d.remove("Locked");
        if let Some(v) = locked {
            d.insert("Locked", v);
        }
        docs.push(d);
    }
    // Locked missing but an expired lease: the claim's other branch takes it, so not odd.
    let expired = Uuid::new_v4();
    let mut d = v7_record(expired, &env.queue, Uuid::new_v4(), in_ms(-1_000), doc! {});
    d.remove("Locked");
    d.insert("LockExpiresAt", in_ms(-60_000));
    docs.push(d);
    let good = Uuid::new_v4();
    docs.push(v7_record(
        good,
        &env.queue,
        Uuid::new_v4(),
        in_ms(-1_000),
        doc! {},
    ));
    env.insert(docs).await;
    let mut before = Vec::new();
    for id in &odd {
        before.push(env.find(*id).await.expect("inserted"));
    }
    let mut config = env.config();
    config.reaper.interval = Some(Duration::from_millis(200));
    let store = store_with(&config).await;
    assert_eq!(store.stats().await.unwrap().odd_locked, 3);
    assert_eq!(
        store
            .census(&timeoutd::store::census::CensusState::default())
            .await
            .unwrap()
            .odd_locked,
        3
    );

    let mut consumer = env.consumer().await;
    let daemon = Daemon::spawn("a", vars(&env, &config)).await;
    let got = consumer.take(2, Duration::from_secs(30)).await;
    let gauge = eventually(Duration::from_secs(30), || async {
        daemon.metric("timeoutd_odd_locked_records").await == 3.0
    })
    .await;
    let mut named = true;
    for id in &odd {
        named &= daemon
            .logged(&id.to_string(), Duration::from_secs(30))
            .await;
    }
    let passes = daemon.logs_containing("census taken").len();
    let passes_later = eventually(Duration::from_secs(30), || async {
        daemon.logs_containing("census taken").len() >= passes + 3
    })
    .await;
    let lines = daemon.logs_containing("record cannot be claimed");
    daemon.stop().await;
    let mut fired: Vec<String> = got.iter().filter_map(|m| m.header("TimeoutId")).collect();
    fired.sort();
    let mut expected = vec![good.to_string(), expired.to_string()];
    expected.sort();
    assert_eq!(fired, expected, "the claimable records fire");
    assert!(gauge, "timeoutd_odd_locked_records reports the three");
    assert!(named && passes_later);
    assert_eq!(lines.len(), 3, "each named once: {lines:#?}");
    for (id, was) in odd.iter().zip(before) {
        assert_eq!(env.find(*id).await, Some(was), "never written to");
    }
    env.cleanup().await;
}
