//! Operators in control (issue 14, items 1 and 3): `list` and `reschedule`, run as the
//! binary against the test MongoDB, beside three running instances under load where it
//! matters, with deliveries counted on the real RabbitMQ; bad input exits 2.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common;

use std::time::Duration;

use bson::{Bson, DateTime, Document, doc};
use common::csharp::{legacy, offset_record, public_record};
use common::fleet::{Daemon, DeliveryCounter, vars};
use common::ops::{cli, err, json, leased, out, rfc3339};
use common::*;
use serde_json::Value;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_reads_every_shape_and_state_and_filters() {
    let env = TestEnv::new().await;
    let c = env.config();
    let v = env.env_vars(&c);
    let saga = Uuid::new_v4();
    let owner = Uuid::new_v4();
    let (ticks_id, offset_id, legacy_id, leased_id, due_id) = (
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
    );
    let (retry_id, parked_id) = (Uuid::new_v4(), Uuid::new_v4());
    // Due instants whole seconds apart, far enough ahead that nothing here falls due.
    let base = DateTime::from_millis((DateTime::now().timestamp_millis() / 1000 + 3600) * 1000);
    let at = |s: i64| DateTime::from_millis(base.timestamp_millis() + s * 1000);
    let lease_end = at(50);
    env.insert(vec![
        v7_record(ticks_id, "billing", saga, at(1), doc! {}),
        offset_record(offset_id, "billing", saga, at(2), 60),
        public_record(legacy_id, "shipping", saga, at(3)),
        leased(
            v7_record(leased_id, "shipping", Uuid::new_v4(), at(4), doc! {}),
            owner,
            lease_end,
        ),
        v7_record(due_id, "billing", Uuid::new_v4(), in_ms(-60_000), doc! {}),
        leased(
            v7_record(retry_id, "other", Uuid::new_v4(), at(6), doc! {}),
            owner,
            lease_end,
        ),
    ])
    .await;
    // A refused send counted for one leased record (retrying), and one parked record.
    let db = env.coll.client().database(&env.db_name);
    db.collection::<Document>("Timeouts_attempts")
        .insert_one(doc! { "_id": uuid(retry_id), "attempts": 2 })
        .await
        .unwrap();
    db.collection::<Document>("Timeouts_parked")
        .insert_one(doc! {
            "_id": uuid(parked_id),
            "record": v7_record(parked_id, "billing", saga, at(5), doc! {}),
            "reason": "unroutable",
            "error": "no queue",
            "attempts": 10_i64,
            "parked_at": DateTime::now(),
        })
        .await
        .unwrap();

    let o = cli(&["list", "--json"], &v).await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let rows = json(&o);
    let ids: Vec<&str> = rows.iter().map(|r| r["id"].as_str().unwrap()).collect();
    let expected: Vec<String> = [due_id, ticks_id, offset_id, legacy_id, leased_id, retry_id]
        .iter()
        .map(Uuid::to_string)
        .collect();
    assert_eq!(ids, expected, "soonest first, every shape: {rows:?}");
    let row = |id: Uuid| rows.iter().find(|r| r["id"] == id.to_string()).unwrap();
    assert_eq!(
        row(offset_id)["due"],
        rfc3339(at(2)),
        "clock ticks at +60 read as UTC"
    );
    assert_eq!(row(legacy_id)["due"], rfc3339(at(3)));
    assert_eq!(
        row(legacy_id)["correlation_id"],
        saga.to_string(),
        "a legacy GUID as .NET prints it"
    );
    assert_eq!(row(ticks_id)["state"], "pending");
    assert_eq!(row(due_id)["state"], "due");
    assert_eq!(row(leased_id)["state"], "leased");
    assert_eq!(row(leased_id)["owner"], owner.to_string());
    assert_eq!(row(leased_id)["lease_end"], rfc3339(lease_end));
    assert_eq!(row(ticks_id)["owner"], Value::Null);

    let listed = |args: Vec<String>| {
        let v = v.clone();
        async move {
            let mut all = vec!["list".to_string(), "--json".to_string()];
            all.extend(args);
            let refs: Vec<&str> = all.iter().map(String::as_str).collect();
            let o = cli(&refs, &v).await;
            assert_eq!(o.status.code(), Some(0), "{all:?}: {}", err(&o));
            json(&o)
                .iter()
                .map(|r| r["id"].as_str().unwrap().to_string())
                .collect::<Vec<_>>()
        }
    };
    let s = |u: &[Uuid]| u.iter().map(Uuid::to_string).collect::<Vec<_>>();
    assert_eq!(
        listed(vec!["--correlation-id".into(), saga.to_string()]).await,
        s(&[ticks_id, offset_id, legacy_id])
    );
    assert_eq!(
        listed(vec!["--destination".into(), "shipping".into()]).await,
        s(&[legacy_id, leased_id])
    );
    assert_eq!(
        listed(vec!["--state".into(), "leased".into()]).await,
        s(&[leased_id, retry_id]),
        "leased takes in retrying"
    );
    assert_eq!(
        listed(vec!["--state".into(), "retrying".into()]).await,
        s(&[retry_id])
    );
    assert_eq!(row(retry_id)["state"], "retrying");
    assert_eq!(
        listed(vec![
            "--state".into(),
            "parked".into(),
            "--correlation-id".into(),
            saga.to_string()
        ])
        .await,
        s(&[parked_id])
    );
    assert_eq!(
        listed(vec!["--state".into(), "due".into()]).await,
        s(&[due_id])
    );
    assert_eq!(
        listed(vec!["--state".into(), "pending".into()]).await,
        s(&[ticks_id, offset_id, legacy_id])
    );
    assert_eq!(
        listed(vec![
            "--due-after".into(),
            rfc3339(at(1)),
            "--due-before".into(),
            rfc3339(at(4)),
        ])
        .await,
        s(&[offset_id, legacy_id])
    );
    assert_eq!(
        listed(vec!["--limit".into(), "2".into()]).await,
        s(&[due_id, ticks_id]),
        "the limit keeps the soonest"
    );
    let text = cli(&["list", "--destination", "shipping"], &v).await;
    assert!(
        out(&text).contains(&format!("owner={owner}")),
        "{}",
        out(&text)
    );
    assert!(out(&text).contains("2 listed"), "{}", out(&text));
    env.cleanup().await;
}

/// The `Time` of a stored record, as stored.
async fn time_of(env: &TestEnv, id: Bson) -> Bson {
    env.coll
        .find_one(doc! { "_id": id })
        .await
        .unwrap()
        .unwrap()
        .get("Time")
        .cloned()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rescheduled_records_arrive_at_the_new_instant_in_their_own_shape() {
    let env = TestEnv::new().await;
    let c = env.config();
    let v = vars(&env, &c);
    let counter = DeliveryCounter::start(&env.queue).await;
    let mut daemons = Vec::new();
    for i in 0..3 {
        daemons.push(Daemon::spawn(&format!("d{i}"), v.clone()).await);
    }
    // Load beside them, and three records of three shapes due in 4 s, moved to 10 s out.
    let load = env.insert_due(200).await;
    let old_due = in_ms(4_000);
    let saga = Uuid::new_v4();
    let (ticks_id, offset_id, legacy_id) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    env.insert(vec![
        v7_record(ticks_id, &env.queue, saga, old_due, doc! {}),
        offset_record(offset_id, &env.queue, saga, old_due, -300),
        public_record(legacy_id, &env.queue, saga, old_due),
    ])
    .await;
    let new_due = DateTime::from_millis(old_due.timestamp_millis() + 6_000);
    let o = cli(
        &[
            "reschedule",
            "--correlation-id",
            &saga.to_string(),
            "--by",
            "6s",
        ],
        &v,
    )
    .await;
    assert_eq!(o.status.code(), Some(0), "{}{}", out(&o), err(&o));
    assert_eq!(out(&o).matches("rescheduled ").count(), 3, "{}", out(&o));
    // Each keeps its shape: ticks at offset 0, clock ticks at -300, a date with a legacy id.
    assert_eq!(
        time_of(&env, uuid(ticks_id)).await,
        Bson::Array(vec![Bson::Int64(ticks(new_due)), Bson::Int32(0)])
    );
    assert_eq!(
        time_of(&env, uuid(offset_id)).await,
        Bson::Array(vec![
            Bson::Int64(ticks(new_due) - 300 * 600_000_000),
            Bson::Int32(-300)
        ])
    );
    assert_eq!(
        time_of(&env, legacy(legacy_id)).await,
        Bson::DateTime(new_due)
    );
    let o = cli(
        &["list", "--json", "--correlation-id", &saga.to_string()],
        &v,
    )
    .await;
    assert!(
        json(&o).iter().all(|r| r["due"] == rfc3339(new_due)),
        "{}",
        out(&o)
    );

    assert!(
        counter
            .wait_distinct(load.len() + 3, Duration::from_secs(60))
            .await
    );
    let first = counter.first_seen();
    for id in [ticks_id, offset_id, legacy_id] {
        let at = first[&id.to_string()]
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64;
        // Sent at its new instant on the server's clock (this host's here), not the old one.
        assert!(
            at >= new_due.timestamp_millis() - 200,
            "{id} arrived {} ms before its new instant",
            new_due.timestamp_millis() - at
        );
    }
    counter.settle(Duration::from_millis(500)).await;
    assert_eq!(counter.total(), load.len() + 3, "none twice");
    for d in daemons {
        d.stop().await;
    }
    counter.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_clear_error_and_exit_2() {
    let env = TestEnv::new().await;
    let v = env.env_vars(&env.config());
    let known = Uuid::new_v4();
    env.insert(vec![v7_record(
        known,
        "q",
        Uuid::new_v4(),
        in_ms(60_000),
        doc! {},
    )])
    .await;
    let unknown = Uuid::new_v4().to_string();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["cancel", &unknown], "no timeout record has id"),
        (
            vec!["reschedule", &unknown, "--in", "5m"],
            "no timeout record has id",
        ),
        (vec!["cancel", "not-a-uuid"], "invalid value"),
        (
            vec!["list", "--due-before", "yesterday"],
            "is not an instant",
        ),
        (
            vec![
                "reschedule",
                "--correlation-id",
                &unknown,
                "--at",
                "2026-13-45T00:00:00Z",
            ],
            "is not an instant",
        ),
        (vec!["pause", ""], "must not be empty"),
        (vec!["pause", "q", "--until", "soon"], "is not an instant"),
        (
            vec!["pause", "q", "--until", "2001-01-01T00:00:00Z"],
            "not in the future",
        ),
        (vec!["list", "--state", "sleeping"], "invalid value"),
        (vec!["list", "--limit", "0"], "invalid value"),
        (vec!["resume", "never-paused"], "is not paused"),
        (
            vec!["cancel", "--correlation-id", &unknown],
            "no timeout record has correlation id",
        ),
        // Past year 9999: a record ServiceConnect could not read (found in review).
        (
            vec![
                "schedule",
                "--destination",
                "q",
                "--correlation-id",
                &unknown,
                "--in",
                "8000years",
            ],
            "outside .NET's range",
        ),
    ];
    let known_s = known.to_string();
    for (args, says) in cases {
        let o = cli(&args, &v).await;
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}{}", out(&o), err(&o));
        assert!(err(&o).contains(says), "{args:?}: {}", err(&o));
    }
    // Unknown ids beside a known one: nothing changes.
    let o = cli(&["cancel", &known_s, &unknown], &v).await;
    assert_eq!(o.status.code(), Some(2));
    assert!(env.find(known).await.is_some());
    env.cleanup().await;
}
