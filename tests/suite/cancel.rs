//! Operators in control (issue 14, item 2): `cancel`, run as the binary beside three
//! running instances under load, and against records under a live lease.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common;

use std::time::Duration;

use bson::{Document, doc};
use common::fleet::{Daemon, DeliveryCounter, vars};
use common::ops::{cli, err, json, leased, out};
use common::*;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_records_never_arrive_under_load_on_three_instances() {
    let env = TestEnv::new().await;
    let mut c = env.config();
    c.dispatch.batch_size = 50;
    let v = vars(&env, &c);
    let counter = DeliveryCounter::start(&env.queue).await;
    let mut daemons = Vec::new();
    for i in 0..3 {
        daemons.push(Daemon::spawn(&format!("d{i}"), v.clone()).await);
    }
    // Load: 560 records falling due over the next 6 s; 40 more are cancelled while the fleet
    // sends those, 20 by id and 20 as one saga. They fall due 30 s on, so that no instance
    // holds one yet when the cancel comes, however slow a loaded machine makes the commands
    // (with them among the others, 4 s on, an instance had leased 5 of the saga's first:
    // the cancel rightly left them, and the test failed).
    let saga = Uuid::new_v4();
    let mut docs = Vec::new();
    let mut keep = Vec::new();
    let (mut by_id, mut by_saga) = (Vec::new(), Vec::new());
    for i in 0..600_i64 {
        let id = Uuid::new_v4();
        let (pm, late, due) = match i % 15 {
            0 if i >= 300 => (Uuid::new_v4(), &mut by_id, in_ms(30_000 + i * 10)),
            1 if i >= 300 => (saga, &mut by_saga, in_ms(30_000 + i * 10)),
            _ => (Uuid::new_v4(), &mut keep, in_ms(1_000 + i * 10)),
        };
        late.push(id);
        docs.push(v7_record(id, &env.queue, pm, due, doc! {}));
    }
    env.insert(docs).await;
    assert_eq!((by_id.len(), by_saga.len()), (20, 20));
    assert!(
        counter.wait_distinct(1, Duration::from_secs(30)).await,
        "the fleet sends"
    );
    let mut args = vec!["cancel".to_string(), "--reason".into(), "test".into()];
    args.extend(by_id.iter().map(Uuid::to_string));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = cli(&refs, &v).await;
    assert_eq!(o.status.code(), Some(0), "{}{}", out(&o), err(&o));
    assert_eq!(out(&o).matches("cancelled ").count(), 20, "{}", out(&o));
    // What will fire for this saga, and when: listed while the fleet sends.
    let o = cli(
        &["list", "--json", "--correlation-id", &saga.to_string()],
        &v,
    )
    .await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let mut listed: Vec<String> = json(&o)
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_string())
        .collect();
    let mut want: Vec<String> = by_saga.iter().map(Uuid::to_string).collect();
    listed.sort();
    want.sort();
    assert_eq!(listed, want, "list shows the saga's 20 records");
    let o = cli(
        &["cancel", "--correlation-id", &saga.to_string(), "--json"],
        &v,
    )
    .await;
    assert_eq!(o.status.code(), Some(0), "{}{}", out(&o), err(&o));
    assert_eq!(json(&o).len(), 20);
    assert!(json(&o).iter().all(|r| r["outcome"] == "cancelled"));

    assert!(
        counter
            .wait_distinct(keep.len(), Duration::from_secs(60))
            .await,
        "every record not cancelled arrives: {} of {}",
        counter.distinct(),
        keep.len()
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            env.count(doc! {}).await == 0
        })
        .await
    );
    counter.settle(Duration::from_millis(500)).await;
    for id in by_id.iter().chain(&by_saga) {
        assert_eq!(counter.count_of(id), 0, "cancelled {id} arrived");
    }
    for id in &keep {
        assert_eq!(counter.count_of(id), 1, "{id}");
    }
    assert_eq!(counter.total(), keep.len(), "none twice");
    // Both actions are in the control collection, with who ran them.
    let control = env
        .coll
        .client()
        .database(&env.db_name)
        .collection::<Document>("Timeouts_control");
    let audit = control
        .find_one(doc! { "kind": "audit", "action": "cancel", "reason": "test" })
        .await
        .unwrap()
        .unwrap();
    assert!(audit.get_str("host").is_ok_and(|h| !h.is_empty()));
    assert!(audit.get_str("user").is_ok_and(|u| !u.is_empty()));
    assert!(audit.get_datetime("at").is_ok());
    for d in daemons {
        d.stop().await;
    }
    counter.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_meeting_a_live_lease_leaves_the_record_and_says_so() {
    let env = TestEnv::new().await;
    let v = env.env_vars(&env.config());
    let owner = Uuid::new_v4();
    let (held, expired, free) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    env.insert(vec![
        leased(
            v7_record(held, "q", Uuid::new_v4(), in_ms(-1_000), doc! {}),
            owner,
            in_ms(60_000),
        ),
        // A lease that ran out: any instance may claim it, and a cancel may delete it.
        leased(
            v7_record(expired, "q", Uuid::new_v4(), in_ms(60_000), doc! {}),
            owner,
            in_ms(-1_000),
        ),
        v7_record(free, "q", Uuid::new_v4(), in_ms(60_000), doc! {}),
    ])
    .await;
    let ids = [held.to_string(), expired.to_string(), free.to_string()];
    let o = cli(&["cancel", "--dry-run", &ids[0], &ids[1], &ids[2]], &v).await;
    assert_eq!(o.status.code(), Some(3), "{}{}", out(&o), err(&o));
    assert_eq!(out(&o).matches("would_cancel").count(), 2, "{}", out(&o));
    assert_eq!(env.count(doc! {}).await, 3, "a dry run changes nothing");

    let o = cli(&["cancel", &ids[0], &ids[1], &ids[2]], &v).await;
    assert_eq!(o.status.code(), Some(3), "{}{}", out(&o), err(&o));
    let text = out(&o);
    assert!(
        text.lines().any(|l| l.starts_with("left_leased")
            && l.contains(&ids[0])
            && l.contains(&format!("owner={owner}"))),
        "{text}"
    );
    assert!(err(&o).contains("live lease"), "{}", err(&o));
    assert!(env.find(held).await.is_some(), "the leased record stays");
    assert!(env.find(expired).await.is_none());
    assert!(env.find(free).await.is_none());
    let o = cli(&["cancel", "--skip-leased", &ids[0]], &v).await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    assert!(env.find(held).await.is_some());

    // A record a running instance holds for its instant (look-ahead) is leased: neither
    // cancel nor reschedule touches it, and it fires once, at its own instant.
    let mut c = env.config();
    c.dispatch.look_ahead = Some(Duration::from_secs(8));
    let d = Daemon::spawn("d0", vars(&env, &c)).await;
    let mut consumer = env.consumer().await;
    let soon = Uuid::new_v4();
    let due = in_ms(5_000);
    env.insert(vec![v7_record(
        soon,
        &env.queue,
        Uuid::new_v4(),
        due,
        doc! {},
    )])
    .await;
    assert!(
        eventually(Duration::from_secs(10), || async {
            env.count(doc! { "_id": uuid(soon), "Locked": true }).await == 1
        })
        .await,
        "the instance claims it ahead"
    );
    let o = cli(&["cancel", &soon.to_string()], &v).await;
    assert_eq!(o.status.code(), Some(3), "{}{}", out(&o), err(&o));
    let o = cli(&["reschedule", &soon.to_string(), "--in", "1h"], &v).await;
    assert_eq!(o.status.code(), Some(3), "{}{}", out(&o), err(&o));
    let got = consumer.take(1, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 1, "it fires");
    assert_eq!(got[0].header("TimeoutId"), Some(soon.to_string()));
    assert!(
        consumer
            .take(1, Duration::from_millis(500))
            .await
            .is_empty(),
        "once"
    );
    d.stop().await;
    env.cleanup().await;
}
