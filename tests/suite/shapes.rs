//! Every record shape a real ServiceConnect fleet holds (interop doc, section 7), written as
//! raw BSON exactly as the C# driver writes it: C# legacy GUIDs (binary subtype 3, .NET byte
//! order), `Time` as a date and as `[clock ticks, offsetMinutes]` from -12 h to +14 h,
//! `{_t, _v}` header values, stuck `Locked: true` records without a lease. Real RabbitMQ,
//! the real test MongoDB, several instances.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use bson::spec::BinarySubtype;
use bson::{Bson, doc};
use common::csharp::*;
use common::fleet::{Daemon, vars};
use common::*;
use timeoutd::config::{TimeEncoding, UuidRepresentation};
use timeoutd::record::TimeoutRecord;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_shape_fires_once_at_its_instant_with_the_saga_id_dotnet_prints() {
    let env = TestEnv::new().await;
    // What each record must produce: its due instant and the ids .NET prints.
    let mut want: HashMap<String, (i64, String)> = HashMap::new();
    let mut docs = Vec::new();
    // Public releases: legacy GUIDs, dates.
    for i in 0..20 {
        let (id, pm, due) = (Uuid::new_v4(), Uuid::new_v4(), in_ms(4_000 + 50 * i));
        docs.push(public_record(id, &env.queue, pm, due));
        want.insert(id.to_string(), (due.timestamp_millis(), pm.to_string()));
    }
    // Lease-era records written at every whole-hour offset from -12 h to +14 h, and a few
    // half and three-quarter hours; every other one with legacy GUIDs.
    let offsets: Vec<i32> = (-12..=14).map(|h| h * 60).chain([330, 345, -570]).collect();
    for (i, offset) in offsets.iter().enumerate() {
        let (id, pm, due) = (Uuid::new_v4(), Uuid::new_v4(), in_ms(4_000 + 40 * i as i64));
        let mut d = offset_record(id, &env.queue, pm, due, *offset);
        if i % 2 == 1 {
            d.insert("_id", legacy(id));
            d.insert("ProcessManagerId", legacy(pm));
            d.insert("LockedBy", legacy(Uuid::nil()));
        }
        docs.push(d);
        want.insert(id.to_string(), (due.timestamp_millis(), pm.to_string()));
    }
    let n = want.len();
    env.insert(docs).await;
    let mut consumer = env.consumer().await;
    let config = env.config();
    let mut fleet = Vec::new();
    for name in ["a", "b", "c"] {
        fleet.push(Daemon::spawn(name, vars(&env, &config)).await);
    }
    let got = consumer.take(n, Duration::from_secs(90)).await;
    let emptied = eventually(Duration::from_secs(30), || async {
        env.count(doc! {}).await == 0
    })
    .await;
    // Anything sent twice would arrive within the time the fleet takes to stop.
    for d in fleet {
        d.stop().await;
    }
    let extra = consumer.take(1, Duration::from_secs(2)).await;
    assert_eq!(got.len(), n, "every record fired");
    assert!(extra.is_empty(), "a record fired twice: {extra:?}");
    assert!(emptied, "nothing is left in Timeouts");
    let mut seen = std::collections::HashSet::new();
    for r in &got {
        let id = r.header("TimeoutId").expect("TimeoutId");
        assert!(seen.insert(id.clone()), "{id} fired twice");
        let (due_ms, pm) = want.get(&id).unwrap_or_else(|| panic!("unknown id {id}"));
        assert_eq!(r.header("CorrelationId").as_ref(), Some(pm), "{id}");
        assert_eq!(r.body, format!("{{\"CorrelationId\":\"{pm}\"}}"));
        // Not early: at or after its instant (the server clock is estimated to within a
        // round trip). An offset read as UTC would fire hours early or not within the wait.
        assert!(
            time_sent_ms(r) >= due_ms - 20,
            "{id} was sent {} ms before its instant",
            due_ms - time_sent_ms(r)
        );
    }
    let public = got
        .iter()
        .find(|r| r.header("Token").is_some())
        .expect("a public-release record with its headers");
    assert_eq!(public.header("Token").as_deref(), Some("base64:aGk="));
    assert_eq!(public.header("Tenant").as_deref(), Some("acme"));
    env.cleanup().await;
}

#[tokio::test]
async fn csharp_legacy_setting_writes_legacy_guids_and_guards_them() {
    let env = TestEnv::new().await;
    let mut config = env.config();
    config.mongodb.uuid_representation = UuidRepresentation::CsharpLegacy;
    config.mongodb.time_encoding = TimeEncoding::Date;
    config.rabbitmq.forward_headers = false;
    let store = store_with(&config).await;
    let record = TimeoutRecord {
        id: Uuid::parse_str("00112233-4455-6677-8899-aabbccddeeff").unwrap(),
        destination: env.queue.clone(),
        process_manager_id: Uuid::new_v4(),
        due: in_ms(-100),
        headers: doc! { "Tenant": "acme" },
    };
    store.insert(&record).await.unwrap();
    let stored = env.coll.find_one(doc! {}).await.unwrap().unwrap();
    let Some(Bson::Binary(id)) = stored.get("_id") else {
        panic!("{stored}")
    };
    assert_eq!(id.subtype, BinarySubtype::UuidOld);
    assert_eq!(
        id.bytes,
        [
            0x33, 0x22, 0x11, 0x00, 0x55, 0x44, 0x77, 0x66, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd,
            0xee, 0xff
        ]
    );
    assert_eq!(
        stored.get("ProcessManagerId"),
        Some(&legacy(record.process_manager_id))
    );
    assert!(matches!(stored.get("Time"), Some(Bson::DateTime(_))));
    let lease = Duration::from_secs(30);
    let claim = store.claim(10, lease).await.unwrap();
    assert_eq!(claim.rows.len(), 1);
    let row = &claim.rows[0];
    let decoded = row.record.as_ref().unwrap();
    assert_eq!(decoded.id, record.id, "the id .NET prints");
    assert!(decoded.headers.is_empty(), "forward_headers = false");
    let held = env.coll.find_one(doc! {}).await.unwrap().unwrap();
    assert_eq!(held.get("LockedBy"), Some(&legacy(claim.lease.owner)));
    assert_eq!(
        store
            .release_many(std::slice::from_ref(&row.id), claim.lease.owner)
            .await
            .unwrap(),
        1
    );
    let freed = env.coll.find_one(doc! {}).await.unwrap().unwrap();
    assert_eq!(freed.get("LockedBy"), Some(&legacy(Uuid::nil())));
    assert_eq!(freed.get("LockExpiresAt"), Some(&Bson::Null));
    let again = store.claim(10, lease).await.unwrap();
    assert_eq!(
        store
            .remove_held(&[again.rows[0].id.clone()], again.lease.owner)
            .await
            .unwrap(),
        1,
        "the owner guard matches the legacy owner"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn serviceconnect_v7_time_index_serves_dates_so_no_second_one_is_made() {
    let env = TestEnv::new().await;
    env.coll
        .create_index(
            mongodb::IndexModel::builder()
                .keys(doc! { "Time": 1, "Locked": 1 })
                .options(
                    mongodb::options::IndexOptions::builder()
                        .name("Time_1_Locked_1".to_string())
                        .build(),
                )
                .build(),
        )
        .await
        .unwrap();
    store_with(&env.config())
        .await
        .ensure_indexes()
        .await
        .unwrap();
    let mut names = env.coll.list_index_names().await.unwrap();
    names.sort();
    assert_eq!(
        names,
        [
            "Time_1_Locked_1",
            "_id_",
            "timeoutd_due_offset",
            "timeoutd_lease",
            "timeoutd_owner"
        ]
    );
    env.cleanup().await;
}

/// Every index is one more that the claim's update and the delete maintain for each record:
/// where v7's indexes serve the due dates, lease and owner queries, timeoutd adds none of its
/// own and drops the ones an older timeoutd made (the date index too: it was kept), never
/// touching v7's.
#[tokio::test]
async fn v7_lease_indexes_serve_so_timeoutd_keeps_only_its_due_index() {
    let env = TestEnv::new().await;
    for (name, keys) in [
        ("Time_1_Locked_1", doc! { "Time": 1, "Locked": 1 }),
        ("LockedBy_1_Locked_1", doc! { "LockedBy": 1, "Locked": 1 }),
        ("LockExpiresAt_1", doc! { "LockExpiresAt": 1 }),
        // What an older timeoutd created beside them.
        ("timeoutd_due_date", doc! { "Time": 1 }),
        ("timeoutd_lease", doc! { "Locked": 1, "LockExpiresAt": 1 }),
        ("timeoutd_owner", doc! { "LockedBy": 1 }),
    ] {
        env.coll
            .create_index(
                mongodb::IndexModel::builder()
                    .keys(keys)
                    .options(
                        mongodb::options::IndexOptions::builder()
                            .name(name.to_string())
                            .build(),
                    )
                    .build(),
            )
            .await
            .unwrap();
    }
    let store = store_with(&env.config()).await;
    store.ensure_indexes().await.unwrap();
    let mut names = env.coll.list_index_names().await.unwrap();
    names.sort();
    assert_eq!(
        names,
        [
            "LockExpiresAt_1",
            "LockedBy_1_Locked_1",
            "Time_1_Locked_1",
            "_id_",
            "timeoutd_due_offset"
        ]
    );
    // The lease still works on these indexes: a claim, an expired lease reaped.
    env.insert(vec![v7_record(
        Uuid::new_v4(),
        &env.queue,
        Uuid::new_v4(),
        in_ms(-10),
        doc! {},
    )])
    .await;
    // A lease long enough for the claim's read-back (it reads what the lease still holds).
    let claim = store
        .claim(10, std::time::Duration::from_millis(500))
        .await
        .unwrap();
    assert_eq!(claim.rows.len(), 1);
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    assert_eq!(store.reap().await.unwrap(), 1, "the expired lease is freed");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offset_first_seen_while_running_fires_at_its_instant() {
    let env = TestEnv::new().await;
    let first = Uuid::new_v4();
    env.insert(vec![
        v7_record(first, &env.queue, Uuid::new_v4(), in_ms(-10), doc! {}),
        // Keeps offset 0 known after the first record is gone.
        v7_record(
            Uuid::new_v4(),
            &env.queue,
            Uuid::new_v4(),
            in_ms(3_600_000),
            doc! {},
        ),
    ])
    .await;
    let mut consumer = env.consumer().await;
    let daemon = start(env.config());
    let got = consumer.take(1, Duration::from_secs(30)).await;
    assert_eq!(got.len(), 1, "running, with offset 0 learned");
    // Written 5 s ahead at offsets no record had.
    let mut want = HashMap::new();
    let mut docs = Vec::new();
    for offset in [345, -570] {
        let (id, pm, due) = (Uuid::new_v4(), Uuid::new_v4(), in_ms(5_000));
        docs.push(offset_record(id, &env.queue, pm, due, offset));
        want.insert(id.to_string(), due.timestamp_millis());
    }
    env.insert(docs).await;
    // Well before the once-a-minute full refresh: the probe found them.
    let got = consumer.take(2, Duration::from_secs(30)).await;
    daemon.stop().await;
    assert_eq!(got.len(), 2, "both new offsets fired");
    for r in &got {
        let id = r.header("TimeoutId").unwrap();
        assert!(time_sent_ms(r) >= want[&id] - 20, "{id} sent early");
    }
    env.cleanup().await;
}
