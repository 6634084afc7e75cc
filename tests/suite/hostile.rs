//! Hostile records: structure-aware generated `Timeouts` documents through the record path
//! (no services), and the real daemon among them (real MongoDB-compatible server and RabbitMQ):
//! no stored document may stop dispatch.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common;

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use arbitrary::Unstructured;
use bson::{Bson, doc};
use common::fleet::{Daemon, http_get};
use common::hostile::{Fate, record_path, seeded_bytes, timeout_document};
use common::*;
use timeoutd::config::TimeEncoding;
use timeoutd::record::message::DEFAULT_FRAME_MAX;

#[test]
fn generated_records_never_panic_and_are_either_sendable_or_parked() {
    let mut fates: BTreeMap<String, usize> = BTreeMap::new();
    for seed in 0..3_000u64 {
        let bytes = seeded_bytes(seed, 4_096);
        let mut u = Unstructured::new(&bytes);
        let Ok(doc) = timeout_document(&mut u, 1_767_225_600_000, "orders", true) else {
            continue;
        };
        for encoding in [TimeEncoding::DotnetTicks, TimeEncoding::Date] {
            match record_path(&doc, encoding, DEFAULT_FRAME_MAX) {
                Ok(fate) => *fates.entry(format!("{fate:?}")).or_default() += 1,
                Err(e) => panic!("seed {seed}, {encoding:?}: {e}\n{doc:?}"),
            }
        }
    }
    // The generator reaches every fate, or it is not testing what it claims to.
    for fate in [
        Fate::Sendable,
        Fate::Parked("undecodable"),
        Fate::Parked("empty_destination"),
        Fate::Parked("unsendable"),
    ] {
        assert!(
            fates.get(&format!("{fate:?}")).is_some_and(|n| *n > 10),
            "{fate:?} is rare: {fates:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordinary_records_all_fire_once_beside_hostile_ones_and_every_odd_one_is_accounted_for() {
    let env = TestEnv::new().await;
    let ordinary = env.insert_due(300).await;
    // Hostile records due now, some of them to the test's own queue. Their `Time` is one the
    // due query matches (the ticks array, whatever its second element): records of other
    // shapes are issue 11's (counted as unschedulable), not dispatch's.
    let mut hostile = Vec::new();
    let mut seen_ids = HashSet::new();
    for seed in 0..400u64 {
        if hostile.len() == 60 {
            break;
        }
        let bytes = seeded_bytes(seed.wrapping_mul(7_919), 4_096);
        let mut u = Unstructured::new(&bytes);
        if let Ok(d) = timeout_document(&mut u, in_ms(-50).timestamp_millis(), &env.queue, false)
            && seen_ids.insert(d.get("_id").cloned().unwrap_or(Bson::Null).to_string())
        {
            hostile.push(d);
        }
    }
    let hostile_ids: Vec<Bson> = hostile
        .iter()
        .filter_map(|d| d.get("_id").cloned())
        .collect();
    env.insert(hostile).await;

    let mut consumer = env.consumer().await;
    let mut config = env.config();
    config.retry.base = Duration::from_millis(100);
    config.retry.cap = Duration::from_millis(200);
    config.retry.max_attempts = 2;
    let d = Daemon::spawn("timeoutd", env.env_vars(&config)).await;

    // Every ordinary record arrives, once (hostile ones to the same queue arrive among them).
    let mut got = Vec::new();
    let mut ids: HashSet<String> = HashSet::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while ordinary.iter().any(|id| !ids.contains(&id.to_string()))
        && std::time::Instant::now() < deadline
    {
        let batch = consumer.take(1_000, Duration::from_secs(2)).await;
        ids.extend(batch.iter().filter_map(|m| m.header("TimeoutId")));
        got.extend(batch);
    }
    for id in &ordinary {
        assert!(ids.contains(&id.to_string()), "ordinary {id} not delivered");
    }
    // Every hostile record is delivered, parked, or (a `Time` no due-query branch can match:
    // no instant can be computed for it) named as unschedulable by the census. None is left
    // in Timeouts unaccounted for.
    let parked = env
        .coll
        .client()
        .database(&env.db_name)
        .collection::<bson::Document>("Timeouts_parked");
    let unaccounted = || async {
        let left: Vec<bson::Document> = {
            use futures::TryStreamExt;
            env.coll
                .find(doc! { "_id": { "$in": &hostile_ids } })
                .await
                .unwrap()
                .try_collect()
                .await
                .unwrap()
        };
        let named = d.logs_containing("record cannot be scheduled");
        left.into_iter()
            .filter(|doc| {
                let shown = format!(
                    "timeout_id={}",
                    timeoutd::record::display_id(doc.get("_id").unwrap_or(&Bson::Null))
                );
                !named.iter().any(|l| l.contains(&shown))
            })
            .collect::<Vec<_>>()
    };
    let settled = eventually(Duration::from_secs(60), || async {
        unaccounted().await.is_empty()
    })
    .await;
    assert!(
        settled,
        "hostile records left in Timeouts, neither sent, parked nor named: {:#?}",
        unaccounted().await
    );
    let left = env.count(doc! { "_id": { "$in": &hostile_ids } }).await;
    let parked_count = parked
        .count_documents(doc! { "_id": { "$in": &hostile_ids } })
        .await
        .unwrap();
    let extra = consumer
        .take(hostile_ids.len(), Duration::from_secs(2))
        .await;
    let delivered_hostile = got.len() + extra.len() - ordinary.len();
    assert_eq!(
        parked_count as usize + delivered_hostile + left as usize,
        hostile_ids.len(),
        "each hostile record parked, delivered or left as unschedulable, exactly once"
    );
    assert!(
        parked_count > 0 && delivered_hostile > 0,
        "{parked_count} parked, {delivered_hostile} delivered"
    );
    // Nothing of the ordinary ones twice.
    let mut per_id: BTreeMap<String, usize> = BTreeMap::new();
    for m in got.iter().chain(&extra) {
        if let Some(id) = m.header("TimeoutId") {
            *per_id.entry(id).or_default() += 1;
        }
    }
    for id in &ordinary {
        assert_eq!(per_id.get(&id.to_string()), Some(&1), "{id}");
    }
    // The daemon is alive and healthy: the one process dispatched everything, no restart.
    assert_eq!(http_get(format!("{}/healthz", d.base)).await.0, 200);
    assert_eq!(http_get(format!("{}/readyz", d.base)).await.0, 200);
    // For scripts/fault-table.sh.
    println!(
        "HOSTILE records={} ordinary={} hostile={} lost=0 delivered={} parked={parked_count} unschedulable={left} restarts=0",
        ordinary.len() + hostile_ids.len(),
        ordinary.len(),
        hostile_ids.len(),
        ordinary.len() + delivered_hostile,
    );
    drop(d);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_time_at_the_ends_of_the_date_range_holds_up_nothing() {
    let env = TestEnv::new().await;
    let mut config = env.config();
    config.mongodb.time_encoding = TimeEncoding::Date;
    let record = |id: uuid::Uuid, due: bson::DateTime| {
        let mut d = v7_record(id, &env.queue, uuid::Uuid::new_v4(), in_ms(-10), doc! {});
        d.insert("Time", due);
        d
    };
    // Before: the wait until a Time of the BSON range's first instant overflowed (a panic in a
    // debug build, a wait of centuries in a release build) and held up every record after it.
    let odd: Vec<uuid::Uuid> = (0..2).map(|_| uuid::Uuid::new_v4()).collect();
    let ordinary: Vec<uuid::Uuid> = (0..20).map(|_| uuid::Uuid::new_v4()).collect();
    let mut docs = vec![
        record(odd[0], bson::DateTime::from_millis(i64::MIN)),
        record(odd[1], bson::DateTime::from_millis(-62_135_596_800_001)),
    ];
    docs.extend(ordinary.iter().map(|id| record(*id, in_ms(-10))));
    env.insert(docs).await;
    let mut consumer = env.consumer().await;
    let d = Daemon::spawn("timeoutd", env.env_vars(&config)).await;
    // The ordinary records fire; the two odd ones, outside .NET's range, are parked with a
    // reason (issue 11); neither holds up the others.
    let got = consumer.take(20, Duration::from_secs(30)).await;
    let ids: HashSet<String> = got.iter().filter_map(|m| m.header("TimeoutId")).collect();
    for id in &ordinary {
        assert!(
            ids.contains(&id.to_string()),
            "{id} not delivered: {:#?}",
            d.logs()
        );
    }
    let parked = env
        .coll
        .client()
        .database(&env.db_name)
        .collection::<bson::Document>("Timeouts_parked");
    for id in &odd {
        let parked_one = eventually(Duration::from_secs(30), || async {
            parked
                .find_one(doc! { "_id": uuid(*id) })
                .await
                .unwrap()
                .is_some()
        })
        .await;
        assert!(parked_one, "{id} parked: {:#?}", d.logs_containing("WARN"));
    }
    assert_eq!(http_get(format!("{}/healthz", d.base)).await.0, 200);
    drop(d);
    env.cleanup().await;
}
