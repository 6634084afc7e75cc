//! `[history] keep`: what fired, was parked or was cancelled, in `<collection>_history`, and
//! `timeoutd history`; the log lines that name each record; the real binary against the real
//! services.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

mod common;

use std::time::Duration;

use bson::{Document, doc};
use common::fleet::{Daemon, series, vars};
use common::ops::{cli, err, json, out};
use common::*;
use futures::TryStreamExt;
use serde_json::Value;
use uuid::Uuid;

const KEEP: &str = "7d";
const KEEP_SECS: i64 = 7 * 24 * 3600;
const WAIT: Duration = Duration::from_secs(30);

/// The daemon's and the CLI's variables, history on unless `keep` is `None`.
fn history_vars(env: &TestEnv, keep: Option<&str>) -> Vec<(String, String)> {
    let mut v = vars(env, &env.config());
    if let Some(keep) = keep {
        v.push(("TIMEOUTD_HISTORY__KEEP".into(), keep.into()));
    }
    v
}

async fn history_docs(env: &TestEnv) -> Vec<Document> {
    env.coll
        .client()
        .database(&env.db_name)
        .collection::<Document>("Timeouts_history")
        .find(doc! {})
        .await
        .expect("find history")
        .try_collect()
        .await
        .expect("read history")
}

/// Waits until `n` history rows are stored.
async fn rows(env: &TestEnv, n: usize) -> Vec<Document> {
    let stored = eventually(WAIT, || async { history_docs(env).await.len() >= n }).await;
    let docs = history_docs(env).await;
    assert!(stored, "expected {n} history rows, found {docs:?}");
    docs
}

fn row_of(docs: &[Document], id: Uuid) -> &Document {
    docs.iter()
        .find(|d| d.get_str("timeout_id") == Ok(id.to_string().as_str()))
        .unwrap_or_else(|| panic!("no history row for {id}: {docs:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fired_records_are_in_history_with_every_field_and_the_logs_name_them() {
    let env = TestEnv::new().await;
    let mut v = history_vars(&env, Some(KEEP));
    v.push(("TIMEOUTD_LOG__FORMAT".into(), "json".into()));
    v.push(("POD_NAME".into(), "history-test-pod".into()));
    let saga = Uuid::new_v4();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let due = in_ms(-2_000);
    env.insert(vec![
        v7_record(a, &env.queue, saga, due, doc! {}),
        v7_record(b, &env.queue, saga, due, doc! {}),
    ])
    .await;
    let mut consumer = env.consumer().await;
    let d = Daemon::spawn("history", v.clone()).await;
    assert_eq!(consumer.take(2, WAIT).await.len(), 2);
    let docs = rows(&env, 2).await;
    assert!(
        eventually(WAIT, || async { env.count(doc! {}).await == 0 }).await,
        "the fired records were removed"
    );
    for id in [a, b] {
        let r = row_of(&docs, id);
        assert_eq!(r.get_str("event"), Ok("fired"), "{r}");
        assert_eq!(r.get_str("correlation_id"), Ok(saga.to_string().as_str()));
        assert_eq!(r.get_str("destination"), Ok(env.queue.as_str()));
        // Time is stored as .NET ticks: whole milliseconds survive.
        assert_eq!(r.get_datetime("due"), Ok(&due), "{r}");
        let at = *r.get_datetime("at").expect("at");
        assert!(at > due, "{r}");
        assert_eq!(
            r.get_i64("late_ms"),
            Ok(at.timestamp_millis() - due.timestamp_millis())
        );
        assert_eq!(r.get_i64("attempts"), Ok(1));
        // message_id = "stable": the record id.
        assert_eq!(r.get_str("message_id"), Ok(id.to_string().as_str()));
        assert_eq!(r.get_str("instance"), Ok("history-test-pod"));
    }

    // The TTL index on the send time, with the configured expiry.
    let history = env
        .coll
        .client()
        .database(&env.db_name)
        .collection::<Document>("Timeouts_history");
    let indexes: Vec<_> = history
        .list_indexes()
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    let ttl = indexes
        .iter()
        .find(|i| {
            i.options.as_ref().and_then(|o| o.name.as_deref()) == Some("timeoutd_history_ttl")
        })
        .unwrap_or_else(|| panic!("no TTL index: {indexes:?}"));
    assert_eq!(ttl.keys, doc! { "at": 1 });
    let expiry = ttl.options.as_ref().and_then(|o| o.expire_after);
    assert_eq!(expiry, Some(Duration::from_secs(KEEP_SECS as u64)));

    // `timeoutd history` answers by saga, by id, by destination and since, newest first.
    let saga_rows = cli(
        &["history", "--correlation-id", &saga.to_string(), "--json"],
        &v,
    )
    .await;
    assert_eq!(saga_rows.status.code(), Some(0), "{}", err(&saga_rows));
    let listed = json(&saga_rows);
    assert_eq!(listed.len(), 2, "{listed:?}");
    let ats: Vec<&str> = listed.iter().map(|r| r["at"].as_str().unwrap()).collect();
    assert!(ats[0] >= ats[1], "newest first: {ats:?}");
    for r in &listed {
        assert_eq!(r["event"], "fired");
        assert_eq!(r["destination"], Value::String(env.queue.clone()));
        assert_eq!(r["instance"], "history-test-pod");
    }
    let by_id = cli(
        &[
            "history",
            "--timeout-id",
            &a.to_string().to_uppercase(),
            "--json",
        ],
        &v,
    )
    .await;
    let by_id = json(&by_id);
    assert_eq!(by_id.len(), 1);
    assert_eq!(by_id[0]["timeout_id"], Value::String(a.to_string()));
    let text = cli(
        &["history", "--destination", &env.queue, "--since", "1h"],
        &v,
    )
    .await;
    assert_eq!(text.status.code(), Some(0));
    assert!(
        out(&text).contains(&format!("correlation_id={saga}")),
        "{}",
        out(&text)
    );
    assert!(out(&text).contains("2 shown"), "{}", out(&text));
    let limited = json(&cli(&["history", "--limit", "1", "--json"], &v).await);
    assert_eq!(limited.len(), 1);
    let none = json(
        &cli(
            &["history", "--since", "2999-01-01T00:00:00Z", "--json"],
            &v,
        )
        .await,
    );
    assert!(none.is_empty());
    for bad in [
        vec!["history", "--correlation-id", "not-a-uuid"],
        vec!["history", "--since", "yesterday-ish"],
        vec!["history", "--limit", "0"],
        vec!["history", "--destination", ""],
    ] {
        let o = cli(&bad, &v).await;
        assert_eq!(o.status.code(), Some(2), "{bad:?}: {}", err(&o));
        assert!(out(&o).is_empty(), "{bad:?}");
    }

    // Logs that answer: one info line per wave with the count, the lateness range and the
    // destinations; each record's line with its ids; the claim's owner with the instance;
    // the build at start-up.
    let logs = d.stop().await;
    let lines: Vec<Value> = logs
        .iter()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let find = |message: &str| -> Vec<&Value> {
        lines.iter().filter(|l| l["message"] == message).collect()
    };
    let waves = find("wave sent");
    assert!(!waves.is_empty(), "no wave summary: {logs:?}");
    assert_eq!(
        waves
            .iter()
            .map(|w| w["sent"].as_u64().unwrap())
            .sum::<u64>(),
        2
    );
    let wave = waves.last().unwrap();
    assert_eq!(wave["level"], "INFO");
    assert!(wave["late_ms_min"].as_i64().unwrap() <= wave["late_ms_max"].as_i64().unwrap());
    assert!(
        wave["destinations"]
            .as_str()
            .unwrap()
            .contains(&format!("{}=", env.queue)),
        "{wave}"
    );
    for id in [a, b] {
        let sent = find("timeout sent")
            .into_iter()
            .find(|l| l["timeout_id"] == Value::String(id.to_string()))
            .unwrap_or_else(|| panic!("no line for {id}"));
        assert_eq!(sent["correlation_id"], Value::String(saga.to_string()));
        assert_eq!(sent["destination"], Value::String(env.queue.clone()));
    }
    let claims = find("claimed batch");
    assert!(
        claims.iter().any(|c| c["level"] == "INFO"
            && c["instance"] == "history-test-pod"
            && c["owner"].is_string()),
        "{claims:?}"
    );
    assert_eq!(
        find("RabbitMQ connection open").len(),
        1,
        "the connect is logged once"
    );
    let start = find("timeoutd starting");
    assert_eq!(start.len(), 1);
    assert_eq!(start[0]["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(start[0]["revision"], timeoutd::service::buildinfo::REVISION);
    assert_eq!(start[0]["instance"], "history-test-pod");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_and_cancelled_records_are_in_history_with_why() {
    let env = TestEnv::new().await;
    let v = history_vars(&env, Some(KEEP));
    let saga = Uuid::new_v4();
    let (poison, later) = (Uuid::new_v4(), Uuid::new_v4());
    let mut no_destination = v7_record(poison, &env.queue, saga, in_ms(-1_000), doc! {});
    no_destination.insert("Destination", "");
    let due_later = in_ms(3_600_000);
    env.insert(vec![
        no_destination,
        v7_record(later, &env.queue, saga, due_later, doc! {}),
    ])
    .await;
    let d = Daemon::spawn("history-park", v.clone()).await;
    let parked = rows(&env, 1).await;
    let r = row_of(&parked, poison);
    assert_eq!(r.get_str("event"), Ok("parked"), "{r}");
    assert_eq!(r.get_str("reason"), Ok("empty_destination"));
    assert!(!r.get_str("detail").unwrap_or("").is_empty(), "{r}");
    assert_eq!(r.get_str("correlation_id"), Ok(saga.to_string().as_str()));
    assert_eq!(r.get_i64("attempts"), Ok(0));

    let o = cli(
        &[
            "cancel",
            &later.to_string(),
            "--reason",
            "saga closed by hand",
        ],
        &v,
    )
    .await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let docs = rows(&env, 2).await;
    let c = row_of(&docs, later);
    assert_eq!(c.get_str("event"), Ok("cancelled"), "{c}");
    assert_eq!(c.get_str("reason"), Ok("saga closed by hand"));
    assert!(c.get_str("detail").unwrap_or("").contains('@'), "who: {c}");
    assert_eq!(c.get_str("destination"), Ok(env.queue.as_str()));
    assert_eq!(c.get_datetime("due"), Ok(&due_later));

    let listed = json(
        &cli(
            &["history", "--correlation-id", &saga.to_string(), "--json"],
            &v,
        )
        .await,
    );
    let events: Vec<&str> = listed
        .iter()
        .map(|r| r["event"].as_str().unwrap())
        .collect();
    assert_eq!(events, ["cancelled", "parked"], "newest first: {listed:?}");
    d.stop().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_off_writes_nothing() {
    let env = TestEnv::new().await;
    let v = history_vars(&env, None);
    let mut no_destination = v7_record(
        Uuid::new_v4(),
        &env.queue,
        Uuid::new_v4(),
        in_ms(-1_000),
        doc! {},
    );
    no_destination.insert("Destination", "");
    let later = Uuid::new_v4();
    env.insert(vec![
        no_destination,
        v7_record(later, &env.queue, Uuid::new_v4(), in_ms(3_600_000), doc! {}),
    ])
    .await;
    let sent = env.insert_due(3).await;
    let mut consumer = env.consumer().await;
    let d = Daemon::spawn("history-off", v.clone()).await;
    assert_eq!(consumer.take(sent.len(), WAIT).await.len(), sent.len());
    let o = cli(&["cancel", &later.to_string(), "--reason", "r"], &v).await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    assert!(
        eventually(WAIT, || async { env.count(doc! {}).await == 0 }).await,
        "sent, parked and cancelled"
    );
    let metrics = d.idle_metrics().await;
    // The writer finishes what it was given before the daemon exits.
    d.stop().await;
    assert_eq!(series(&metrics, "timeoutd_history_written_total"), 0.0);
    let names = env
        .coll
        .client()
        .database(&env.db_name)
        .list_collection_names()
        .await
        .unwrap();
    assert!(
        !names.contains(&"Timeouts_history".to_string()),
        "{names:?}"
    );
    let shown = cli(&["history", "--json"], &v).await;
    assert_eq!(shown.status.code(), Some(0));
    assert!(json(&shown).is_empty());
    assert!(err(&shown).contains("[history] keep"), "{}", err(&shown));
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_history_write_is_counted_and_the_records_still_go_out() {
    let env = TestEnv::new().await;
    let mut v = history_vars(&env, Some(KEEP));
    v.push(("FAILPOINTS".into(), "history-write=return".into()));
    let ids = env.insert_due(5).await;
    let mut consumer = env.consumer().await;
    let d = Daemon::spawn("history-fails", v).await;
    assert_eq!(consumer.take(ids.len(), WAIT).await.len(), ids.len());
    assert!(
        eventually(WAIT, || async { env.count(doc! {}).await == 0 }).await,
        "the sent records were removed"
    );
    let lost = "timeoutd_history_lost_total{reason=\"write_failed\"}";
    assert!(
        eventually(WAIT, || async { d.metric(lost).await >= ids.len() as f64 }).await,
        "{}",
        d.metrics().await
    );
    let metrics = d.idle_metrics().await;
    assert_eq!(series(&metrics, "timeoutd_removed_total"), ids.len() as f64);
    assert_eq!(series(&metrics, "timeoutd_history_written_total"), 0.0);
    assert_eq!(series(&metrics, "timeoutd_lease_lost_total"), 0.0);
    let logs = d.stop().await;
    assert!(
        logs.iter()
            .any(|l| l.contains("could not write history rows")),
        "the failure is logged"
    );
    assert!(history_docs(&env).await.is_empty());
    // Each record was sent once: the failure neither held one back nor sent one twice.
    assert_eq!(
        series(&metrics, "timeoutd_dispatched_total"),
        ids.len() as f64
    );
    env.cleanup().await;
}

/// Issue 25, 8.7: the failed-send counts are looked up under a deadline of their own, not
/// inside the write's: a look-up that never answers leaves the counts at 1 and the rows are
/// still written (before, its deadline ran out with the write's and the whole batch was lost).
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_count_lookup_still_writes_the_rows() {
    use timeoutd::store::history::{self, Row};

    let env = TestEnv::new().await;
    let mut config = env.config();
    config.mongodb.operation_timeout = Duration::from_secs(1);
    let store = common::csharp::store_with(&config).await;
    let ids: Vec<Uuid> = (0..3).map(|_| Uuid::new_v4()).collect();
    let rows: Vec<Row> = ids
        .iter()
        .map(|id| Row {
            doc: doc! { "event": "fired", "timeout_id": id.to_string(), "attempts": 1_i64 },
            attempts_of: Some(uuid(*id)),
        })
        .collect();
    // The writer counts what it wrote and lost: read through the process's recorder. (The
    // rows alone do not tell: an insert abandoned at its deadline may still land.)
    let recorder = timeoutd::service::http::prometheus();
    let lost = "timeoutd_history_lost_total{reason=\"write_failed\"}";
    let written = "timeoutd_history_written_total";
    let before = recorder.render();
    fail::cfg("history-attempts-stall", "return").unwrap();
    let (sink, rx) = history::channel();
    sink.record(rows);
    drop(sink);
    // The writer ends once every sink is gone and what they queued is written (or lost).
    history::run(store, rx).await;
    fail::remove("history-attempts-stall");
    let after = recorder.render();
    assert_eq!(
        series(&after, lost),
        series(&before, lost),
        "no row lost: {after}"
    );
    assert_eq!(
        series(&after, written) - series(&before, written),
        ids.len() as f64,
        "{after}"
    );
    let docs = history_docs(&env).await;
    assert_eq!(docs.len(), ids.len(), "{docs:?}");
    for id in &ids {
        assert_eq!(row_of(&docs, *id).get_i64("attempts"), Ok(1));
    }
    env.cleanup().await;
}

/// The TTL index follows `keep`: a changed `keep` changes the index's expiry in place.
#[tokio::test]
async fn the_ttl_index_follows_keep() {
    let env = TestEnv::new().await;
    let store = common::csharp::store_with(&env.config()).await;
    let expiry = || async {
        let indexes: Vec<_> = env
            .coll
            .client()
            .database(&env.db_name)
            .collection::<Document>(store.history().name())
            .list_indexes()
            .await
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        indexes
            .into_iter()
            .find(|i| {
                i.options.as_ref().and_then(|o| o.name.as_deref()) == Some("timeoutd_history_ttl")
            })
            .and_then(|i| i.options.and_then(|o| o.expire_after))
    };
    for keep in [
        Duration::from_secs(KEEP_SECS as u64),
        Duration::from_secs(3_600),
    ] {
        store
            .ensure_history_indexes(keep)
            .await
            .expect("history indexes");
        assert_eq!(expiry().await, Some(keep));
    }
    env.cleanup().await;
}
