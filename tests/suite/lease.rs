//! The lease protocol against the real test MongoDB, through the store: claims, the owner and
//! live-lease guard on every later write, and the reaper.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use bson::{Bson, doc};
use common::*;
use futures::TryStreamExt;
use timeoutd::record::due::Shape;
use timeoutd::store::clock::ServerClock;
use timeoutd::store::{Claim, Store, StoreError};
use uuid::Uuid;

async fn store(env: &TestEnv) -> Store {
    let s = Store::connect(&env.config().mongodb, ServerClock::default())
        .await
        .expect("store");
    s.refresh_clock().await.expect("server clock");
    s
}

/// The record ids of a claim, in claim order.
fn ids_of(claim: &Claim) -> Vec<Uuid> {
    claim
        .rows
        .iter()
        .map(|r| r.record.as_ref().expect("decodable").id)
        .collect()
}

#[tokio::test]
async fn claim_takes_due_records_oldest_first_and_nothing_else() {
    let env = TestEnv::new().await;
    let ids: Vec<Uuid> = (0..6).map(|_| Uuid::new_v4()).collect();
    // Due 6 s ago, 5 s ago, ... 1 s ago, inserted in shuffled order.
    let mut docs: Vec<_> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            v7_record(
                *id,
                "q",
                Uuid::new_v4(),
                in_ms(-6_000 + 1_000 * i as i64),
                doc! {},
            )
        })
        .collect();
    docs.reverse();
    docs.swap(1, 4);
    let future = Uuid::new_v4();
    docs.push(v7_record(
        future,
        "q",
        Uuid::new_v4(),
        in_ms(60_000),
        doc! {},
    ));
    let held = Uuid::new_v4();
    let mut held_doc = v7_record(held, "q", Uuid::new_v4(), in_ms(-60_000), doc! {});
    held_doc.insert("Locked", true);
    held_doc.insert("LockedBy", uuid(Uuid::new_v4()));
    held_doc.insert("LockExpiresAt", in_ms(60_000));
    docs.push(held_doc);
    env.insert(docs).await;

    let s = store(&env).await;
    let claim = s.claim(4, Duration::from_secs(30)).await.unwrap();
    let got = ids_of(&claim);
    assert_eq!(got, ids[..4], "the four oldest due records, oldest first");
    let rest = s.claim(10, Duration::from_secs(30)).await.unwrap();
    let got = ids_of(&rest);
    assert_eq!(
        got,
        ids[4..],
        "neither the future nor the live-leased record"
    );
    assert_ne!(
        claim.lease.owner, rest.lease.owner,
        "a fresh owner per claim"
    );

    // Claimed rows carry exactly the lock fields the protocol sets, and no new field.
    let d = env.find(ids[0]).await.unwrap();
    assert_eq!(d.len(), 8, "{d}");
    assert!(d.get_bool("Locked").unwrap());
    assert_eq!(d.get("LockedBy"), Some(&uuid(claim.lease.owner)));
    assert_eq!(
        d.get_datetime("LockExpiresAt").unwrap(),
        &claim.lease.expires_at
    );
    env.cleanup().await;
}

#[tokio::test]
async fn a_lost_lease_cannot_delete_or_release() {
    let env = TestEnv::new().await;
    let id = Uuid::new_v4();
    env.insert(vec![v7_record(
        id,
        "q",
        Uuid::new_v4(),
        in_ms(-1_000),
        doc! {},
    )])
    .await;
    let a = store(&env).await;
    let b = store(&env).await;
    let first = a.claim(10, Duration::from_millis(500)).await.unwrap();
    assert_eq!(first.rows.len(), 1);
    // The lease runs out; another worker claims the record.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let second = b.claim(10, Duration::from_secs(30)).await.unwrap();
    assert_eq!(second.rows.len(), 1, "an expired lease is claimable again");

    let raw = uuid(id);
    assert_eq!(
        a.remove_held(std::slice::from_ref(&raw), first.lease.owner)
            .await
            .unwrap(),
        0,
        "the old owner deletes nothing"
    );
    assert_eq!(
        a.release_many(std::slice::from_ref(&raw), first.lease.owner)
            .await
            .unwrap(),
        0,
        "the old owner frees nothing"
    );
    let d = env.find(id).await.expect("the record survives");
    assert_eq!(d.get("LockedBy"), Some(&uuid(second.lease.owner)));
    assert!(d.get_bool("Locked").unwrap());

    // The new owner can.
    assert_eq!(
        b.remove_held(std::slice::from_ref(&raw), second.lease.owner)
            .await
            .unwrap(),
        1
    );
    assert!(env.find(id).await.is_none());
    env.cleanup().await;
}

#[tokio::test]
async fn release_restores_the_free_shape() {
    let env = TestEnv::new().await;
    let id = Uuid::new_v4();
    let original = v7_record(id, "q", Uuid::new_v4(), in_ms(-1_000), doc! { "K": "v" });
    env.insert(vec![original.clone()]).await;
    let s = store(&env).await;
    let claim = s.claim(10, Duration::from_secs(30)).await.unwrap();
    assert_eq!(
        s.release_many(&[uuid(id)], claim.lease.owner)
            .await
            .unwrap(),
        1
    );
    assert_eq!(env.find(id).await.unwrap(), original);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_claims_never_share_a_record() {
    let env = TestEnv::new().await;
    let n = 600;
    env.insert(
        (0..n)
            .map(|i| {
                v7_record(
                    Uuid::new_v4(),
                    "q",
                    Uuid::new_v4(),
                    in_ms(-(i as i64)),
                    doc! {},
                )
            })
            .collect(),
    )
    .await;
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let s = store(&env).await;
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            // A claim that lost every candidate to a racer comes back empty but says `more`:
            // stop only when one finds nothing left to take.
            for _ in 0..1_000 {
                let c = s.claim(25, Duration::from_secs(60)).await.unwrap();
                if c.rows.is_empty() && !c.more {
                    return mine;
                }
                mine.extend(ids_of(&c));
            }
            panic!("claims did not come to an end")
        }));
    }
    let mut seen = HashSet::new();
    let mut total = 0;
    for t in tasks {
        for id in t.await.unwrap() {
            total += 1;
            assert!(seen.insert(id), "{id} claimed twice");
        }
    }
    assert_eq!(total, n);
    env.cleanup().await;
}

#[tokio::test]
async fn reap_frees_only_expired_leases() {
    let env = TestEnv::new().await;
    let expired = Uuid::new_v4();
    let live = Uuid::new_v4();
    let live_owner = Uuid::new_v4();
    let mut e = v7_record(expired, "q", Uuid::new_v4(), in_ms(-1_000), doc! {});
    e.insert("Locked", true);
    e.insert("LockedBy", uuid(Uuid::new_v4()));
    e.insert("LockExpiresAt", in_ms(-5_000));
    let mut l = v7_record(live, "q", Uuid::new_v4(), in_ms(-1_000), doc! {});
    l.insert("Locked", true);
    l.insert("LockedBy", uuid(live_owner));
    l.insert("LockExpiresAt", in_ms(60_000));
    env.insert(vec![e, l]).await;
    let s = store(&env).await;
    assert_eq!(s.reap().await.unwrap(), 1);
    let mut free = is_free();
    free.insert("_id", uuid(expired));
    assert_eq!(env.count(free).await, 1);
    let d = env.find(live).await.unwrap();
    assert_eq!(d.get("LockedBy"), Some(&uuid(live_owner)));
    assert_eq!(s.reap().await.unwrap(), 0);
    env.cleanup().await;
}

#[tokio::test]
async fn an_unacknowledged_write_concern_is_refused() {
    let config = timeoutd::config::MongoConfig {
        uri: with_query(&mongo_uri(), "w=0"),
        ..Default::default()
    };
    let err = Store::connect(&config, ServerClock::default())
        .await
        .expect_err("w=0 must be refused");
    assert!(
        matches!(err, StoreError::UnacknowledgedWriteConcern),
        "{err}"
    );
    assert!(err.to_string().contains("w=0"));
}

#[tokio::test]
async fn stats_count_each_state() {
    let env = TestEnv::new().await;
    let mut docs = vec![
        v7_record(Uuid::new_v4(), "q", Uuid::new_v4(), in_ms(60_000), doc! {}),
        v7_record(Uuid::new_v4(), "q", Uuid::new_v4(), in_ms(120_000), doc! {}),
        v7_record(Uuid::new_v4(), "q", Uuid::new_v4(), in_ms(-10_000), doc! {}),
    ];
    let mut leased = v7_record(Uuid::new_v4(), "q", Uuid::new_v4(), in_ms(-20_000), doc! {});
    leased.insert("Locked", true);
    leased.insert("LockedBy", uuid(Uuid::new_v4()));
    leased.insert("LockExpiresAt", in_ms(60_000));
    let mut expired = v7_record(Uuid::new_v4(), "q", Uuid::new_v4(), in_ms(-5_000), doc! {});
    expired.insert("Locked", true);
    expired.insert("LockedBy", uuid(Uuid::new_v4()));
    expired.insert("LockExpiresAt", Bson::DateTime(in_ms(-1_000)));
    docs.push(leased);
    docs.push(expired);
    env.insert(docs).await;
    let st = store(&env).await.stats().await.unwrap();
    assert_eq!(st.pending, 2);
    assert_eq!(st.due, 2, "the free due record and the expired lease");
    assert_eq!(st.leased, 1);
    assert_eq!(st.expired_leases, 1);
    let age = st.oldest_due_age_seconds.unwrap();
    assert!((19.0..40.0).contains(&age), "{age}");
    env.cleanup().await;
}

/// The stages of a plan, outermost first, following `inputStage`.
fn stages(plan: &bson::Document) -> Vec<bson::Document> {
    let mut out = vec![plan.clone()];
    let mut p = plan;
    while let Ok(next) = p.get_document("inputStage") {
        out.push(next.clone());
        p = next;
    }
    out
}

#[tokio::test]
async fn due_query_scans_timeoutds_index_in_order_and_stops_at_the_batch() {
    let env = TestEnv::new().await;
    let s = store(&env).await;
    s.ensure_indexes().await.unwrap();
    // A backlog of 600 due records among 3,000 future ones.
    let docs: Vec<_> = (0..3_600)
        .map(|i| {
            let due = if i < 600 {
                in_ms(-60_000 + i)
            } else {
                in_ms(3_600_000 + i)
            };
            v7_record(Uuid::new_v4(), "q", Uuid::new_v4(), due, doc! {})
        })
        .collect();
    env.insert(docs).await;
    let now = s.clock().now();
    let batch = 200;
    let explain = env
        .coll
        .client()
        .database(&env.db_name)
        .run_command(doc! {
            "explain": {
                "find": "Timeouts",
                "filter": timeoutd::store::lease::due_within(now, None, now, &[Shape::Ticks(0)]),
                "sort": Shape::Ticks(0).sort(),
                "limit": batch,
                "projection": { "_id": 1, "Time": 1 },
            },
            "verbosity": "executionStats",
        })
        .await
        .expect("explain");
    let plan = explain
        .get_document("queryPlanner")
        .and_then(|q| q.get_document("winningPlan"))
        .unwrap();
    let stages = stages(plan);
    let names: Vec<&str> = stages
        .iter()
        .filter_map(|s| s.get_str("stage").ok())
        .collect();
    let scan = stages
        .iter()
        .find(|s| s.get_str("stage") == Ok("IXSCAN"))
        .unwrap_or_else(|| panic!("no index scan: {names:?}"));
    assert_eq!(
        scan.get_str("indexName"),
        Ok("timeoutd_due_offset"),
        "{plan}"
    );
    assert!(
        !names.contains(&"SORT"),
        "the index gives the order, no sort stage: {names:?}"
    );
    let stats = explain.get_document("executionStats").unwrap();
    let keys = stats
        .get("totalKeysExamined")
        .and_then(Bson::as_i64)
        .or_else(|| {
            stats
                .get("totalKeysExamined")
                .and_then(Bson::as_i32)
                .map(i64::from)
        });
    assert_eq!(
        keys,
        Some(batch),
        "the scan stops after one batch, not at the 3,600 records: {stats}"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn successive_claims_drain_a_backlog_oldest_first_skipping_nothing() {
    let env = TestEnv::new().await;
    // 1,050 due records, unevenly spaced (runs of equal due times, then gaps), so that the
    // read window of each claim after the first is set from the one before.
    let base = bson::DateTime::now().timestamp_millis();
    let mut expected: Vec<(i64, Uuid)> = (0..1_050)
        .map(|i: i64| (-600_000 + (i / 7) * 40 + (i % 3) * (i % 11), Uuid::new_v4()))
        .collect();
    let docs = expected
        .iter()
        .map(|(ms, id)| {
            let due = bson::DateTime::from_millis(base + ms);
            v7_record(*id, "q", Uuid::new_v4(), due, doc! {})
        })
        .collect();
    env.insert(docs).await;
    expected.sort();
    let s = store(&env).await;
    let mut seen: Vec<Uuid> = Vec::new();
    let mut claims = 0;
    loop {
        let claim = s.claim(100, Duration::from_secs(60)).await.unwrap();
        claims += 1;
        assert!(claims < 60, "the drain must end");
        seen.extend(ids_of(&claim));
        if !claim.more {
            assert!(claim.rows.is_empty() || seen.len() == expected.len());
            break;
        }
    }
    let unique: HashSet<&Uuid> = seen.iter().collect();
    assert_eq!(unique.len(), seen.len(), "no record claimed twice");
    assert_eq!(seen.len(), expected.len(), "every due record claimed");
    let order: HashMap<Uuid, i64> = expected.iter().map(|(ms, id)| (*id, *ms)).collect();
    let dues: Vec<i64> = seen.iter().map(|id| order[id]).collect();
    assert!(
        dues.windows(2).all(|w| w[0] <= w[1]),
        "alone, an instance claims oldest first across claims"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn a_slice_of_the_due_range_holds_only_claimable_records_within_both_bounds() {
    let env = TestEnv::new().await;
    let s = store(&env).await;
    s.ensure_indexes().await.unwrap();
    // Due 10 s, 9 s, ... 1 s ago; the one due 6 s ago is under a live lease.
    let ids: Vec<Uuid> = (0..10).map(|_| Uuid::new_v4()).collect();
    let dues: Vec<_> = (0..10).map(|i| in_ms(-10_000 + 1_000 * i)).collect();
    let docs = ids
        .iter()
        .zip(&dues)
        .enumerate()
        .map(|(i, (id, due))| {
            let mut d = v7_record(*id, "q", Uuid::new_v4(), *due, doc! {});
            if i == 4 {
                d.insert("Locked", true);
                d.insert("LockedBy", uuid(Uuid::new_v4()));
                d.insert("LockExpiresAt", in_ms(60_000));
            }
            d
        })
        .collect();
    env.insert(docs).await;
    let now = s.clock().now();
    for (lo, hi) in [(2, 6), (0, 9), (7, 7)] {
        let filter =
            timeoutd::store::lease::due_within(now, Some(dues[lo]), dues[hi], &[Shape::Ticks(0)]);
        let found: HashSet<Uuid> = env
            .coll
            .find(filter)
            .await
            .unwrap()
            .try_collect::<Vec<_>>()
            .await
            .unwrap()
            .iter()
            .filter_map(|d| timeoutd::record::bson_uuid(d.get("_id")?))
            .collect();
        let want: HashSet<Uuid> = (lo..=hi).filter(|i| *i != 4).map(|i| ids[i]).collect();
        assert_eq!(
            found, want,
            "records due from #{lo} to #{hi}, both inclusive"
        );
    }
    env.cleanup().await;
}
