//! Operators in control (issue 14, items 4 to 6): pausing a destination fleet-wide, resuming
//! it (by hand, at `--until`, with a ramp), and send-rate limits, against running instances
//! on the real RabbitMQ and the test MongoDB.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common;

use std::time::{Duration, Instant};

use bson::{Document, doc};
use common::fleet::{Daemon, DeliveryCounter, vars};
use common::ops::{cli, err, out};
use common::*;
use serde_json::Value;
use timeoutd::config::DestinationLimit;
use uuid::Uuid;

/// `n` free records for `queue`, due every `step_ms` from `first_ms` from now.
fn records(queue: &str, n: i64, first_ms: i64, step_ms: i64) -> (Vec<Uuid>, Vec<Document>) {
    let ids: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
    let docs = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let due = in_ms(first_ms + i as i64 * step_ms);
            v7_record(*id, queue, Uuid::new_v4(), due, doc! {})
        })
        .collect();
    (ids, docs)
}

/// Waits until every daemon applies `n` paused destinations (its gauge says so).
async fn all_apply(daemons: &[Daemon], n: f64) -> bool {
    for d in daemons {
        let applied = eventually(Duration::from_secs(20), || async {
            d.metric("timeoutd_paused_destinations").await == n
        })
        .await;
        if !applied {
            return false;
        }
    }
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_stops_a_destination_on_every_instance_and_a_resume_brings_each_record_once() {
    let env = TestEnv::new().await;
    let other = format!("{}-other", env.queue);
    env.declare_queue(&other).await;
    let mut c = env.config();
    c.dispatch.batch_size = 50;
    let v = vars(&env, &c);
    let paused = DeliveryCounter::start(&env.queue).await;
    let others = DeliveryCounter::start(&other).await;
    let mut daemons = Vec::new();
    for i in 0..3 {
        daemons.push(Daemon::spawn(&format!("d{i}"), v.clone()).await);
    }
    assert!(
        all_apply(&daemons, 0.0).await,
        "the gauge is there from zero"
    );
    // Load on two queues, due over the next 8 s.
    let (ids, docs) = records(&env.queue, 400, 500, 20);
    let (other_ids, other_docs) = records(&other, 400, 500, 20);
    env.insert(docs.into_iter().chain(other_docs).collect())
        .await;
    assert!(paused.wait_distinct(20, Duration::from_secs(30)).await);

    let o = cli(&["pause", &env.queue, "--reason", "incident 42"], &v).await;
    assert_eq!(o.status.code(), Some(0), "{}{}", out(&o), err(&o));
    assert!(
        all_apply(&daemons, 1.0).await,
        "every instance applies the pause"
    );
    // What was in flight when they applied it has arrived once the other queue moved on.
    let moved = others.distinct() + 50;
    assert!(
        others
            .wait_distinct(moved.min(other_ids.len()), Duration::from_secs(30))
            .await
    );
    let before = paused.total();
    eprintln!("paused after {before} of {} deliveries", ids.len());
    assert!(
        before < ids.len(),
        "the pause came before the end of the load"
    );
    // The other destination runs to the end, past every paused record's due instant.
    assert!(
        others
            .wait_distinct(other_ids.len(), Duration::from_secs(60))
            .await,
        "the other destination runs on: {} of {}",
        others.distinct(),
        other_ids.len()
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            env.count(doc! { "Destination": &other }).await == 0
        })
        .await
    );
    assert_eq!(
        paused.total(),
        before,
        "nothing of a paused destination is sent"
    );
    let held = env.count(doc! { "Destination": &env.queue }).await;
    assert_eq!(held as usize, ids.len() - before, "nothing is lost");
    // Every instance released what it held of it: none is leased.
    assert!(
        eventually(Duration::from_secs(10), || async {
            env.count(doc! { "Destination": &env.queue, "Locked": true, "LockExpiresAt": { "$gt": in_ms(0) } }).await == 0
        })
        .await,
        "paused records are left free"
    );
    let o = cli(&["paused", "--json"], &v).await;
    let listed: Vec<Value> = serde_json::from_str(out(&o).trim()).unwrap();
    assert_eq!(listed.len(), 1, "{}", out(&o));
    assert_eq!(listed[0]["destination"], env.queue.as_str());
    assert_eq!(listed[0]["reason"], "incident 42");
    assert!(listed[0]["by"].as_str().unwrap().contains('@'));
    let o = cli(&["stats", "--json"], &v).await;
    let stats: Value = serde_json::from_str(out(&o).trim()).unwrap();
    assert_eq!(
        stats["paused_destinations"][0]["destination"],
        env.queue.as_str()
    );
    assert_eq!(stats["paused_destinations"][0]["due"], held);

    let o = cli(&["resume", &env.queue], &v).await;
    assert_eq!(o.status.code(), Some(0), "{}{}", out(&o), err(&o));
    assert!(
        paused
            .wait_distinct(ids.len(), Duration::from_secs(60))
            .await,
        "a resume brings every held record: {} of {}",
        paused.distinct(),
        ids.len()
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            env.count(doc! {}).await == 0
        })
        .await
    );
    paused.settle(Duration::from_millis(500)).await;
    others.settle(Duration::from_millis(200)).await;
    assert_eq!(paused.duplicates(), 0, "none twice");
    assert_eq!(others.duplicates(), 0);
    assert!(all_apply(&daemons, 0.0).await);
    let held_back: f64 = {
        let mut sum = 0.0;
        for d in &daemons {
            sum += d
                .metric("timeoutd_held_back_total{reason=\"paused\"}")
                .await;
        }
        sum
    };
    assert!(
        held_back > 0.0,
        "records held for the paused destination were released"
    );
    let control = env
        .coll
        .client()
        .database(&env.db_name)
        .collection::<Document>("Timeouts_control");
    for action in ["pause", "resume"] {
        let audit = control
            .find_one(doc! { "kind": "audit", "action": action })
            .await
            .unwrap();
        assert!(
            audit.is_some_and(|a| a.get_str("user").is_ok() && a.get_datetime("at").is_ok()),
            "{action} audited"
        );
    }
    for d in daemons {
        d.stop().await;
    }
    paused.close().await;
    others.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_ends_by_itself_at_until() {
    let env = TestEnv::new().await;
    let c = env.config();
    let v = vars(&env, &c);
    let until = in_ms(4_000);
    let o = cli(
        &[
            "pause",
            &env.queue,
            "--until",
            &until.try_to_rfc3339_string().unwrap(),
        ],
        &v,
    )
    .await;
    assert_eq!(o.status.code(), Some(0), "{}{}", out(&o), err(&o));
    let counter = DeliveryCounter::start(&env.queue).await;
    let d = Daemon::spawn("d0", v.clone()).await;
    let (ids, docs) = records(&env.queue, 50, -1_000, 1);
    env.insert(docs).await;
    assert!(
        counter
            .wait_distinct(ids.len(), Duration::from_secs(30))
            .await
    );
    let first = counter
        .first_seen()
        .values()
        .min()
        .unwrap()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    assert!(
        first >= until.timestamp_millis(),
        "a record was sent {} ms before the pause ended",
        until.timestamp_millis() - first
    );
    counter.settle(Duration::from_millis(300)).await;
    assert_eq!(counter.duplicates(), 0);
    let o = cli(&["paused"], &v).await;
    assert!(out(&o).contains("0 paused"), "{}", out(&o));
    d.stop().await;
    counter.close().await;
    env.cleanup().await;
}

/// Deliveries of `counter` over `span`, counted from now.
async fn delivered_over(counter: &DeliveryCounter, span: Duration) -> usize {
    let start = counter.total();
    tokio::time::sleep(span).await;
    counter.total() - start
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
/// A destination's rate limit is not exceeded (by more than a tenth, for the 10 s window's
/// edges) while other destinations run free. That the limiter reaches its rate is the unit
/// test's (`ratelimit.rs`, on virtual time): here a loaded machine may send fewer (384 in 10 s
/// in one suite run beside another), which says nothing of the limiter.
async fn a_rate_limit_is_not_exceeded_while_other_destinations_run_free() {
    let env = TestEnv::new().await;
    let slow = format!("{}-slow", env.queue);
    env.declare_queue(&slow).await;
    let mut c = env.config();
    c.dispatch.destination = vec![DestinationLimit {
        name: slow.clone(),
        max_rate: 50.0,
    }];
    let slow_counter = DeliveryCounter::start(&slow).await;
    let fast_counter = DeliveryCounter::start(&env.queue).await;
    let (slow_ids, slow_docs) = records(&slow, 900, -1_000, 0);
    let (fast_ids, fast_docs) = records(&env.queue, 2_000, -1_000, 0);
    env.insert(slow_docs.into_iter().chain(fast_docs).collect())
        .await;
    let daemon = start(c);
    assert!(slow_counter.wait_total(10, Duration::from_secs(30)).await);
    assert!(
        fast_counter
            .wait_distinct(fast_ids.len(), Duration::from_secs(60))
            .await,
        "the other destination is not held back"
    );
    let slow_when_fast_done = slow_counter.total();
    assert!(
        slow_when_fast_done < fast_ids.len() / 2,
        "{} slow records went out while 2,000 others did",
        slow_when_fast_done
    );
    let sent = delivered_over(&slow_counter, Duration::from_secs(10)).await;
    eprintln!(
        "rate limit 50/s: {sent} sent in 10 s; {slow_when_fast_done} while 2,000 others went"
    );
    assert!(sent <= 550, "{sent} records in 10 s under a limit of 50/s");
    assert!(
        slow_counter
            .wait_distinct(slow_ids.len(), Duration::from_secs(60))
            .await
    );
    slow_counter.settle(Duration::from_millis(300)).await;
    assert_eq!(slow_counter.duplicates(), 0);
    daemon.stop().await;
    slow_counter.close().await;
    fast_counter.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_with_a_ramp_starts_at_a_trickle() {
    let env = TestEnv::new().await;
    let c = env.config();
    let v = vars(&env, &c);
    let o = cli(&["pause", &env.queue], &v).await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let counter = DeliveryCounter::start(&env.queue).await;
    let d = Daemon::spawn("d0", v.clone()).await;
    let (ids, docs) = records(&env.queue, 300, -1_000, 0);
    env.insert(docs).await;
    assert!(all_apply(std::slice::from_ref(&d), 1.0).await);
    let o = cli(&["resume", &env.queue, "--ramp", "6s"], &v).await;
    assert_eq!(o.status.code(), Some(0), "{}{}", out(&o), err(&o));
    assert!(all_apply(std::slice::from_ref(&d), 0.0).await);
    let started = Instant::now();
    let first_second = delivered_over(&counter, Duration::from_secs(1)).await;
    eprintln!("ramp: {first_second} records in its first second");
    assert!(
        first_second <= 15,
        "{first_second} records in the ramp's first second (trickle: about 1-3)"
    );
    assert!(
        counter
            .wait_distinct(ids.len(), Duration::from_secs(60))
            .await
    );
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "300 records went out within {:?} of a 6 s ramp",
        started.elapsed()
    );
    counter.settle(Duration::from_millis(300)).await;
    assert_eq!(counter.duplicates(), 0);
    d.stop().await;
    counter.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_due_before_a_paused_head_is_not_passed_over() {
    // While a destination is paused, claims start reading where the other destinations'
    // records begin (src/head.rs). A record that becomes claimable behind that point (here:
    // inserted already overdue, as a release or an expired lease would leave one) is still
    // claimed, by the next read from the start.
    let env = TestEnv::new().await;
    let live = format!("{}-live", env.queue);
    env.declare_queue(&live).await;
    let c = env.config();
    let v = vars(&env, &c);
    let o = cli(&["pause", &env.queue], &v).await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let (_, paused_docs) = records(&env.queue, 300, -600_000, 10);
    env.insert(paused_docs).await;
    let counter = DeliveryCounter::start(&live).await;
    let d = Daemon::spawn("d0", v.clone()).await;
    let (first, docs) = records(&live, 20, 0, 50);
    env.insert(docs).await;
    assert!(
        counter
            .wait_distinct(first.len(), Duration::from_secs(30))
            .await
    );
    // Due ten minutes ago: before every paused record.
    let (behind, docs) = records(&live, 5, -900_000, 1);
    env.insert(docs).await;
    assert!(
        counter
            .wait_distinct(first.len() + behind.len(), Duration::from_secs(30))
            .await,
        "records due before the paused head arrive"
    );
    assert_eq!(
        env.count(doc! { "Destination": &env.queue }).await,
        300,
        "the paused ones stay"
    );
    d.stop().await;
    counter.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_stream_applies_a_pause_before_the_next_poll() {
    // Polled every 30 s, a pause reaches the instance through the control collection's
    // change stream (the test server has change streams) long before the poll would.
    let env = TestEnv::new().await;
    let mut c = env.config();
    c.dispatch.poll_interval = Duration::from_secs(30);
    c.dispatch.look_ahead = Some(Duration::from_secs(1));
    c.dispatch.lock_lease = Duration::from_secs(60);
    let v = vars(&env, &c);
    let d = Daemon::spawn("d0", v.clone()).await;
    // Ready: its first read of the control collection is done and the stream is open.
    assert!(d.ready_is(200, Duration::from_secs(30)).await);
    let o = cli(&["pause", &env.queue], &v).await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let applied = eventually(Duration::from_secs(10), || async {
        d.metric("timeoutd_paused_destinations").await == 1.0
    })
    .await;
    assert!(applied, "the pause waited for the 30 s poll");
    d.stop().await;
    env.cleanup().await;
}
