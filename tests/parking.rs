//! Records the broker refuses are retried with back-off and then parked; poison records are
//! parked at once; `timeoutd parked` lists, requeues and drops them. Real RabbitMQ, real test
//! MongoDB.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

mod common;

use common::fleet::BIN;
use std::process::{Command, Output};
use std::time::Duration;

use bson::{Bson, Document, doc};
use common::*;
use mongodb::Collection;
use timeoutd::config::Config;
use uuid::Uuid;

fn parked_coll(env: &TestEnv) -> Collection<Document> {
    env.coll
        .client()
        .database(&env.db_name)
        .collection("Timeouts_parked")
}

fn attempts_coll(env: &TestEnv) -> Collection<Document> {
    env.coll
        .client()
        .database(&env.db_name)
        .collection("Timeouts_attempts")
}

async fn parked_doc(env: &TestEnv, id: Uuid) -> Option<Document> {
    parked_coll(env)
        .find_one(doc! { "_id": uuid(id) })
        .await
        .unwrap()
}

/// Waits up to 10 s for a failed send of `id` to be counted.
async fn has_failed_send(env: &TestEnv, id: Uuid) -> bool {
    eventually(Duration::from_secs(10), || async {
        attempts_coll(env)
            .find_one(doc! { "_id": uuid(id) })
            .await
            .unwrap()
            .is_some()
    })
    .await
}

/// Fast retries for tests: 200 ms, 400 ms, then parked on the third refusal.
fn fast_retry(env: &TestEnv) -> Config {
    let mut c = env.config();
    c.retry.base = Duration::from_millis(200);
    c.retry.cap = Duration::from_millis(400);
    c.retry.max_attempts = 3;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_record_backs_off_keeping_its_shape_then_is_parked() {
    let env = TestEnv::new().await;
    let missing = format!("timeoutd-test-missing-{}", Uuid::new_v4().simple());
    let id = Uuid::new_v4();
    let original = v7_record(
        id,
        &missing,
        Uuid::new_v4(),
        in_ms(-1_000),
        doc! { "k": "v" },
    );
    env.insert(vec![original.clone()]).await;
    let mut config = fast_retry(&env);
    // Slow enough to look at the record between attempts.
    config.retry.base = Duration::from_secs(2);
    config.retry.cap = Duration::from_secs(2);
    let daemon = start(config);

    // After the first refusal: still in Timeouts, leased until the next attempt, untouched.
    let counted = has_failed_send(&env, id).await;
    assert!(counted, "the failed send is counted outside the record");
    let held = env.find(id).await.expect("still in Timeouts");
    assert_eq!(held.get_bool("Locked"), Ok(true), "kept leased: {held}");
    let until = held.get_datetime("LockExpiresAt").unwrap();
    assert!(until.timestamp_millis() > in_ms(0).timestamp_millis());
    assert_eq!(held.get("Time"), original.get("Time"), "Time unchanged");
    assert_eq!(held.len(), original.len(), "no field added: {held}");
    let attempts = attempts_coll(&env)
        .find_one(doc! { "_id": uuid(id) })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(attempts.get_i32("attempts"), Ok(1), "{attempts}");

    let parked = eventually(Duration::from_secs(20), || async {
        parked_doc(&env, id).await.is_some()
    })
    .await;
    daemon.stop().await;
    assert!(parked, "parked after max_attempts");
    assert!(env.find(id).await.is_none(), "removed from Timeouts");
    let p = parked_doc(&env, id).await.unwrap();
    assert_eq!(p.get_str("reason"), Ok("unroutable"));
    assert_eq!(p.get_i64("attempts"), Ok(3));
    assert!(p.get_str("error").unwrap().contains(&missing), "{p}");
    assert_eq!(
        p.get_document("record").unwrap(),
        &original,
        "parked in its original, free shape"
    );
    assert_eq!(
        attempts_coll(&env).count_documents(doc! {}).await.unwrap(),
        0,
        "count forgotten once parked"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_record_is_sent_once_its_queue_appears() {
    let env = TestEnv::new().await;
    let later = format!("timeoutd-test-later-{}", Uuid::new_v4().simple());
    let id = Uuid::new_v4();
    env.insert(vec![v7_record(
        id,
        &later,
        Uuid::new_v4(),
        in_ms(-100),
        doc! {},
    )])
    .await;
    let mut config = env.config();
    config.retry.base = Duration::from_millis(500);
    config.retry.cap = Duration::from_millis(500);
    config.retry.max_attempts = 1_000;
    let daemon = start(config);
    let refused = has_failed_send(&env, id).await;
    assert!(refused);
    env.declare_queue(&later).await;
    let mut consumer = env.consumer_of(&later).await;
    let got = consumer.take(1, Duration::from_secs(10)).await;
    daemon.stop().await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].header("TimeoutId"), Some(id.to_string()));
    assert!(env.find(id).await.is_none());
    assert!(parked_doc(&env, id).await.is_none(), "not parked");
    let _ = env
        .channel
        .queue_delete(later.as_str().into(), Default::default())
        .await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_records_are_parked_at_once_and_the_rest_flow() {
    let env = TestEnv::new().await;
    let due = in_ms(-1_000);
    let mk = |edit: &dyn Fn(&mut Document)| {
        let mut d = v7_record(Uuid::new_v4(), &env.queue, Uuid::new_v4(), due, doc! {});
        edit(&mut d);
        d
    };
    let cases: Vec<(&str, Document)> = vec![
        (
            "empty_destination",
            mk(&|d| {
                d.insert("Destination", "");
            }),
        ),
        (
            "empty_destination",
            mk(&|d| {
                d.insert("Destination", Bson::Null);
            }),
        ),
        (
            "empty_destination",
            mk(&|d| {
                d.remove("Destination");
            }),
        ),
        (
            "undecodable",
            mk(&|d| {
                d.insert("ProcessManagerId", "not a uuid");
            }),
        ),
        (
            "undecodable",
            mk(&|d| {
                let ticks = d.get_array("Time").unwrap()[0].as_i64().unwrap();
                d.insert("Time", vec![Bson::Double(ticks as f64), Bson::Int32(0)]);
            }),
        ),
        (
            "undecodable",
            mk(&|d| {
                d.insert("Headers", "not a document");
            }),
        ),
        (
            "undecodable",
            mk(&|d| {
                d.insert("_id", "a string id");
            }),
        ),
        // Shapes of the public releases gone wrong: a legacy GUID of the wrong length, a
        // discriminated header whose value is no document... and a Time before year 1.
        (
            "undecodable",
            mk(&|d| {
                d.insert(
                    "ProcessManagerId",
                    bson::Binary {
                        subtype: bson::spec::BinarySubtype::UuidOld,
                        bytes: vec![1; 15],
                    },
                );
            }),
        ),
        (
            "undecodable",
            mk(&|d| {
                d.insert(
                    "_id",
                    bson::Binary {
                        subtype: bson::spec::BinarySubtype::UuidOld,
                        bytes: vec![7; 17],
                    },
                );
            }),
        ),
        (
            "undecodable",
            mk(&|d| {
                // 0000-12-31: before .NET's DateTime.MinValue.
                d.insert("Time", bson::DateTime::from_millis(-62_135_596_800_001));
            }),
        ),
        (
            "undecodable",
            mk(&|d| {
                // Clock ticks of 00:30 on 0001-01-01 at +60 min: UTC falls before year 1.
                d.insert("Time", vec![Bson::Int64(18_000_000_000), Bson::Int32(60)]);
            }),
        ),
    ];
    env.insert(cases.iter().map(|(_, d)| d.clone()).collect())
        .await;
    let good = env.insert_due(20).await;
    let mut consumer = env.consumer().await;
    let daemon = start(env.config());
    let got = consumer.take(20, Duration::from_secs(20)).await;
    let all_parked = eventually(Duration::from_secs(10), || async {
        parked_coll(&env).count_documents(doc! {}).await.unwrap() == cases.len() as u64
    })
    .await;
    daemon.stop().await;
    assert_eq!(
        got.len(),
        good.len(),
        "the good records flow past the poison"
    );
    assert!(all_parked);
    assert_eq!(env.count(doc! {}).await, 0, "nothing left in Timeouts");
    for (reason, d) in &cases {
        let p = parked_coll(&env)
            .find_one(doc! { "_id": d.get("_id").unwrap().clone() })
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("not parked: {d}"));
        assert_eq!(p.get_str("reason"), Ok(*reason), "{p}");
        assert_eq!(p.get_i64("attempts"), Ok(0), "parked without a retry");
        assert!(!p.get_str("error").unwrap().is_empty());
        assert_eq!(p.get_document("record").unwrap(), d, "original shape");
    }
    env.cleanup().await;
}

fn cli(args: &[&str], vars: &[(String, String)]) -> Output {
    Command::new(BIN)
        .args(args)
        .envs(vars.iter().cloned())
        .env("RUST_LOG", "warn")
        .output()
        .expect("run timeoutd")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_list_requeue_and_drop() {
    let env = TestEnv::new().await;
    let missing = format!("timeoutd-test-missing-{}", Uuid::new_v4().simple());
    let ids: Vec<Uuid> = (0..3).map(|_| Uuid::new_v4()).collect();
    let originals: Vec<Document> = ids
        .iter()
        .map(|id| v7_record(*id, &missing, Uuid::new_v4(), in_ms(-500), doc! {}))
        .collect();
    env.insert(originals.clone()).await;
    let mut config = fast_retry(&env);
    config.retry.max_attempts = 1;
    let daemon = start(config.clone());
    let parked = eventually(Duration::from_secs(15), || async {
        parked_coll(&env).count_documents(doc! {}).await.unwrap() == 3
    })
    .await;
    daemon.stop().await;
    assert!(parked);
    let vars = env.env_vars(&config);

    let list = cli(&["parked", "list", "--json"], &vars);
    assert_eq!(list.status.code(), Some(0), "{list:?}");
    let listed: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), 3);
    for entry in listed {
        assert_eq!(entry["reason"], "unroutable");
        assert_eq!(entry["attempts"], 1);
        assert_eq!(entry["destination"], missing.as_str());
        assert!(ids.iter().any(|id| entry["id"] == id.to_string()));
    }
    let text = cli(&["parked", "list"], &vars);
    assert!(stdout(&text).contains("3 parked"), "{}", stdout(&text));

    // Requeue one: back in Timeouts exactly as ServiceConnect wrote it.
    let one = cli(&["parked", "requeue", &ids[0].to_string()], &vars);
    assert_eq!(one.status.code(), Some(0), "{one:?}");
    assert_eq!(env.find(ids[0]).await.as_ref(), Some(&originals[0]));
    assert!(parked_doc(&env, ids[0]).await.is_none());

    // Drop one for good.
    let dropped = cli(&["parked", "drop", &ids[1].to_string()], &vars);
    assert_eq!(dropped.status.code(), Some(0), "{dropped:?}");
    assert!(parked_doc(&env, ids[1]).await.is_none());
    assert!(env.find(ids[1]).await.is_none());

    // Unknown ids are bad input (exit 2), not a silent success.
    let unknown = cli(&["parked", "drop", &Uuid::new_v4().to_string()], &vars);
    assert_eq!(unknown.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("no parked record"));
    let neither = cli(&["parked", "requeue"], &vars);
    assert_eq!(neither.status.code(), Some(2), "an id or --all is required");

    // --all takes the rest; a requeued record is sent once its queue exists.
    let all = cli(&["parked", "requeue", "--all"], &vars);
    assert_eq!(all.status.code(), Some(0), "{all:?}");
    assert_eq!(env.find(ids[2]).await.as_ref(), Some(&originals[2]));
    assert_eq!(parked_coll(&env).count_documents(doc! {}).await.unwrap(), 0);
    env.declare_queue(&missing).await;
    let mut consumer = env.consumer_of(&missing).await;
    let daemon = start(config);
    let got = consumer.take(2, Duration::from_secs(15)).await;
    daemon.stop().await;
    let mut sent: Vec<String> = got.iter().filter_map(|r| r.header("TimeoutId")).collect();
    sent.sort();
    let mut want = vec![ids[0].to_string(), ids[2].to_string()];
    want.sort();
    assert_eq!(sent, want);
    let _ = env
        .channel
        .queue_delete(missing.as_str().into(), Default::default())
        .await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returns_are_matched_to_their_own_messages_in_a_pipelined_batch() {
    let env = TestEnv::new().await;
    let missing = format!("timeoutd-test-missing-{}", Uuid::new_v4().simple());
    let mut good = Vec::new();
    let mut refused = Vec::new();
    let mut docs = Vec::new();
    // Unroutable records interleaved with good ones, all in one batch.
    for i in 0..300 {
        let id = Uuid::new_v4();
        let to = if i % 10 == 3 {
            refused.push(id);
            missing.as_str()
        } else {
            good.push(id);
            env.queue.as_str()
        };
        docs.push(v7_record(
            id,
            to,
            Uuid::new_v4(),
            in_ms(-1_000 + i),
            doc! {},
        ));
    }
    env.insert(docs).await;
    let mut consumer = env.consumer().await;
    let mut config = env.config();
    config.retry.base = Duration::from_secs(600);
    config.retry.cap = Duration::from_secs(600);
    let daemon = start(config);
    let got = consumer.take(good.len() + 1, Duration::from_secs(3)).await;
    let counted = eventually(Duration::from_secs(10), || async {
        attempts_coll(&env).count_documents(doc! {}).await.unwrap() == refused.len() as u64
    })
    .await;
    daemon.stop().await;
    let mut sent: Vec<String> = got.iter().filter_map(|r| r.header("TimeoutId")).collect();
    sent.sort();
    let mut want: Vec<String> = good.iter().map(Uuid::to_string).collect();
    want.sort();
    assert_eq!(sent, want, "every good record sent once, no refused one");
    assert!(counted, "exactly the refused records counted a failure");
    for id in &refused {
        let d = env
            .find(*id)
            .await
            .unwrap_or_else(|| panic!("{id} was deleted though the broker returned it"));
        assert_eq!(d.get_bool("Locked"), Ok(true), "waiting for its retry");
    }
    assert_eq!(env.count(doc! {}).await, refused.len() as u64);
    env.cleanup().await;
}

/// `parked requeue` puts the record back, then deletes the parked copy it read. A daemon may
/// claim the requeued record, fail again and park it again in between: that new parked copy
/// is then the only copy left, and requeue must not delete it (before, it deleted the parked
/// copy by `_id` alone, and the record was lost).
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeue_never_deletes_a_parked_copy_made_again_meanwhile() {
    use timeoutd::store::Store;
    use timeoutd::store::clock::ServerClock;
    use timeoutd::store::parking::{ParkReason, Parked, Requeued};

    let env = TestEnv::new().await;
    let store = Store::connect(&env.config().mongodb, ServerClock::default())
        .await
        .unwrap();
    store.refresh_clock().await.unwrap();
    let parking = store.parking();
    let park_claimed = || async {
        let claim = store.claim(1, Duration::from_secs(30)).await.unwrap();
        let row = claim.rows.into_iter().next().expect("claimed the record");
        let parked = parking
            .park(
                &row.id,
                &row.raw,
                claim.lease.owner,
                ParkReason::Unroutable,
                "no queue",
                3,
            )
            .await
            .unwrap();
        assert_eq!(parked, Parked::Moved);
    };
    let id = Uuid::new_v4();
    env.insert(vec![v7_record(
        id,
        &env.queue,
        Uuid::new_v4(),
        in_ms(-10),
        doc! {},
    )])
    .await;
    park_claimed().await;
    let first_copy = parked_doc(&env, id).await.unwrap();

    // Requeue pauses after its insert; meanwhile a daemon claims and parks the record again.
    fail::cfg("requeue-after-insert", "1*return(1500)").unwrap();
    let requeue = {
        let parking = parking.clone();
        tokio::spawn(async move { parking.requeue_parked(&first_copy, false).await })
    };
    assert!(
        eventually(Duration::from_secs(10), || async {
            env.count(doc! { "_id": uuid(id) }).await == 1
        })
        .await,
        "requeue put the record back"
    );
    park_claimed().await;
    let outcome = requeue.await.unwrap().unwrap();
    fail::remove("requeue-after-insert");

    assert_eq!(outcome, Requeued::ParkedAgain);
    assert!(
        parked_doc(&env, id).await.is_some(),
        "the record parked again is still parked, not lost"
    );
    assert_eq!(env.count(doc! { "_id": uuid(id) }).await, 0);
    env.cleanup().await;
}

/// Issue 25, 8.4: parking on a lost lease changes nothing. Before, the parked copy stayed
/// behind and the new holder's failed-send count was deleted: once the new holder had sent
/// the record, `parked requeue` put it back and it was sent a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parking_on_a_lost_lease_leaves_no_parked_copy_and_keeps_the_count() {
    use timeoutd::store::Store;
    use timeoutd::store::clock::ServerClock;
    use timeoutd::store::parking::{ParkReason, Parked};

    let env = TestEnv::new().await;
    let store = Store::connect(&env.config().mongodb, ServerClock::default())
        .await
        .unwrap();
    store.refresh_clock().await.unwrap();
    let parking = store.parking();
    let id = Uuid::new_v4();
    env.insert(vec![v7_record(
        id,
        &env.queue,
        Uuid::new_v4(),
        in_ms(-10),
        doc! {},
    )])
    .await;

    // A claims it; its lease runs out (set in the past here), and B claims it.
    let a = store.claim(1, Duration::from_secs(30)).await.unwrap();
    let row = a.rows.into_iter().next().expect("A claimed the record");
    env.coll
        .update_one(
            doc! { "_id": uuid(id) },
            doc! { "$set": { "LockExpiresAt": bson::DateTime::from_millis(0) } },
        )
        .await
        .unwrap();
    let b = store.claim(1, Duration::from_secs(30)).await.unwrap();
    assert_eq!(
        b.rows.len(),
        1,
        "B claimed the record after A's lease ran out"
    );
    assert_eq!(
        parking
            .count_failure(&row.id, b.lease.owner, "refused")
            .await
            .unwrap(),
        Some(1)
    );

    // A, late, parks it: nothing may change.
    let parked = parking
        .park(
            &row.id,
            &row.raw,
            a.lease.owner,
            ParkReason::Unroutable,
            "no queue",
            3,
        )
        .await
        .unwrap();
    assert_eq!(parked, Parked::LeaseLost);
    assert!(
        parked_doc(&env, id).await.is_none(),
        "no parked copy of a record A no longer holds"
    );
    assert!(
        attempts_coll(&env)
            .find_one(doc! { "_id": uuid(id) })
            .await
            .unwrap()
            .is_some(),
        "B's failed-send count is kept"
    );
    assert_eq!(env.count(doc! { "_id": uuid(id) }).await, 1);

    // B sends it and removes it; a requeue then has nothing to put back.
    assert_eq!(
        store
            .remove_held(std::slice::from_ref(&row.id), b.lease.owner)
            .await
            .unwrap(),
        1
    );
    assert_eq!(parking.requeue(&row.id, false).await.unwrap(), None);
    assert_eq!(env.count(doc! { "_id": uuid(id) }).await, 0);
    env.cleanup().await;
}

/// A failed send is counted only by the record's holder: an instance whose lease was lost
/// (another instance holds the record now) counts nothing, so the record is not parked before
/// `max_attempts` sends of it failed (issue 25's review: `count_failure` had no owner guard,
/// and counted the stale holder's failure beside the new holder's).
#[tokio::test]
async fn only_the_holder_counts_a_failed_send() {
    use timeoutd::store::Store;
    use timeoutd::store::clock::ServerClock;

    let env = TestEnv::new().await;
    let store = Store::connect(&env.config().mongodb, ServerClock::default())
        .await
        .unwrap();
    store.refresh_clock().await.unwrap();
    let parking = store.parking();
    let id = Uuid::new_v4();
    env.insert(vec![v7_record(
        id,
        &env.queue,
        Uuid::new_v4(),
        in_ms(-10),
        doc! {},
    )])
    .await;
    let claim = store.claim(1, Duration::from_secs(30)).await.unwrap();
    let row = claim.rows.into_iter().next().expect("claimed the record");
    let owner = claim.lease.owner;
    assert_eq!(
        parking
            .count_failure(&row.id, owner, "no queue")
            .await
            .unwrap(),
        Some(1)
    );
    // Another instance holds the record now (as after this lease ran out and a claim took it).
    env.coll
        .update_one(
            doc! { "_id": uuid(id) },
            doc! { "$set": { "LockedBy": uuid(Uuid::new_v4()) } },
        )
        .await
        .unwrap();
    assert_eq!(
        parking
            .count_failure(&row.id, owner, "no queue")
            .await
            .unwrap(),
        None,
        "the stale holder counts nothing"
    );
    let counted = attempts_coll(&env)
        .find_one(doc! { "_id": uuid(id) })
        .await
        .unwrap()
        .expect("the holder's count");
    assert_eq!(counted.get("attempts"), Some(&Bson::Int32(1)));
    env.cleanup().await;
}
