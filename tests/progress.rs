//! Gauges that would see a wedge, and progress, not only turns (issue 19, items 2 and 3,
//! finding 8), against the real test MongoDB and RabbitMQ: the monitor's backlog reading
//! leaves paused destinations out of the due backlog and counts them apart, and a daemon
//! whose claims take nothing while due records wait turns `/readyz` 503 until they take
//! again.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

mod common;

use common::csharp::store_with;
use common::*;
use timeoutd::store::control::Actor;
use uuid::Uuid;

fn actor() -> Actor {
    Actor {
        host: "test".into(),
        user: "test".into(),
    }
}

/// Finding 8: a pause used to count in `timeoutd_due_backlog` and the oldest due age, so a
/// planned pause fired the backlog alerts. The due backlog and the oldest due age leave the
/// paused destination out, the paused gauge counts it, and the progress check's oldest
/// unclaimed record skips paused and rate-limited destinations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_destination_is_counted_apart_from_the_due_backlog() {
    let env = TestEnv::new().await;
    let paused = format!("{}-paused", env.queue);
    let other = format!("{}-limited", env.queue);
    let oldest = Uuid::new_v4();
    let mut docs = vec![v7_record(
        oldest,
        &env.queue,
        Uuid::new_v4(),
        in_ms(-20_000),
        bson::doc! {},
    )];
    for due in [-10_000, -5_000] {
        docs.push(v7_record(
            Uuid::new_v4(),
            &env.queue,
            Uuid::new_v4(),
            in_ms(due),
            bson::doc! {},
        ));
    }
    // Much older: were they counted, the oldest due age would be theirs.
    for _ in 0..2 {
        docs.push(v7_record(
            Uuid::new_v4(),
            &paused,
            Uuid::new_v4(),
            in_ms(-3_600_000),
            bson::doc! {},
        ));
    }
    let limited = Uuid::new_v4();
    docs.push(v7_record(
        limited,
        &other,
        Uuid::new_v4(),
        in_ms(-60_000),
        bson::doc! {},
    ));
    env.insert(docs).await;
    let store = store_with(&env.config()).await;
    store
        .pause(&paused, None, Some("planned"), &actor())
        .await
        .unwrap();

    let reading = store.backlog(100).await.unwrap();
    assert_eq!(reading.due, 4, "{reading:?}");
    assert_eq!(reading.paused_due, 2, "{reading:?}");
    let age = reading.oldest_due_age_seconds.expect("records are due");
    assert!(age < 1_800.0, "the paused records' age: {reading:?}");
    let named = reading.oldest_unclaimed.map(|(id, _)| id);
    assert_eq!(named, Some(uuid(limited)));

    let shapes = store.shapes().await.unwrap();
    let rated = store
        .read_backlog(&shapes, 100, std::slice::from_ref(&other))
        .await
        .unwrap();
    assert_eq!(rated.due, 4, "a rate limit still counts in the backlog");
    assert_eq!(
        rated.oldest_unclaimed.map(|(id, _)| id),
        Some(uuid(oldest)),
        "a rate-limited destination's records wait by design"
    );

    assert!(store.resume(&paused, None, &actor()).await.unwrap());
    let resumed = store.backlog(100).await.unwrap();
    assert_eq!((resumed.due, resumed.paused_due), (6, 0), "{resumed:?}");
    env.cleanup().await;
}

/// Items 2 and 3: the wedge of issue 19, a claim path that knows no `Time` shape (a
/// failpoint), makes every claim read nothing and succeed while due records wait. The backlog
/// gauge, read independently of the claim path, still shows the records (it read 0 from the
/// same cache before), `/readyz` turns 503 and `timeoutd_due_unclaimed_seconds` shows the
/// wait. Once the cache knows the shapes again, the instance is ready again and the records
/// fire.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_that_take_nothing_make_the_instance_unready_until_they_take_again() {
    use common::fleet::{http_get, series};
    use std::time::Duration;

    let env = TestEnv::new().await;
    let ids: Vec<Uuid> = (0..5).map(|_| Uuid::new_v4()).collect();
    let docs = ids.iter().enumerate().map(|(i, id)| {
        let due = in_ms(-1_000 - 100 * i as i64);
        v7_record(*id, &env.queue, Uuid::new_v4(), due, bson::doc! {})
    });
    env.insert(docs.collect()).await;
    let mut config = env.config();
    config.mongodb.operation_timeout = Duration::from_secs(1);
    fail::cfg("shapes-know-nothing", "return").unwrap();
    let mut consumer = env.consumer().await;
    let token = tokio_util::sync::CancellationToken::new();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let daemon = tokio::spawn(timeoutd::cli::daemon::run_with(
        config,
        timeoutd::store::clock::ServerClock::default(),
        token.clone(),
        move |addr| {
            let _ = tx.send(addr);
        },
    ));
    let base = format!("http://{}", rx.await.expect("the daemon listens"));
    let get = |path: &'static str| http_get(format!("{base}{path}"));

    let unready = eventually(Duration::from_secs(60), || async {
        let (code, body) = get("/readyz").await;
        code == 503 && body.contains("due records left unclaimed")
    })
    .await;
    let metrics = get("/metrics").await.1;
    let still_stored = env.count(bson::doc! {}).await;
    fail::remove("shapes-know-nothing");
    let got = consumer.take(ids.len(), Duration::from_secs(60)).await;
    let ready = eventually(Duration::from_secs(60), || async {
        get("/readyz").await.0 == 200
    })
    .await;
    let after = get("/metrics").await.1;
    token.cancel();
    daemon.await.unwrap().unwrap();

    assert!(unready, "/readyz turned 503 naming the unclaimed records");
    assert!(
        series(&metrics, "timeoutd_due_unclaimed_seconds") > 0.0,
        "{metrics}"
    );
    assert_eq!(series(&metrics, "timeoutd_due_backlog"), 5.0, "{metrics}");
    assert_eq!(series(&metrics, "timeoutd_ready"), 0.0, "{metrics}");
    assert_eq!(still_stored, 5, "nothing was claimed meanwhile");
    assert_eq!(got.len(), ids.len(), "every record fired once claims took");
    assert!(ready, "ready again");
    assert_eq!(series(&after, "timeoutd_due_unclaimed_seconds"), 0.0);
    env.cleanup().await;
}
