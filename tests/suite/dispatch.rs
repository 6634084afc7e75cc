//! The daemon end to end against the real RabbitMQ and the real test MongoDB: records are
//! inserted as raw ServiceConnect v7 BSON and the messages are read back with lapin.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common;

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, SystemTime};

use bson::{Bson, doc};
use common::*;
use timeoutd::config::MessageIdMode;
use uuid::Uuid;

fn time_sent(r: &Received) -> SystemTime {
    let s = r.header("TimeSent").expect("TimeSent");
    humantime::parse_rfc3339(&s).unwrap_or_else(|e| panic!("TimeSent {s}: {e}"))
}

fn millis(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_matches_the_serviceconnect_wire_format() {
    let env = TestEnv::new().await;
    let id = Uuid::new_v4();
    let pm = Uuid::parse_str("3F2504E0-4F89-11D3-9A0C-0305E82C3301").unwrap();
    let headers = doc! {
        "Tenant": "acme",
        "MessageType": "Publish",
        "CorrelationId": "not-this-one",
        "Flag": true,
        "Count": 42_i32,
        "Raw": bson::Binary { subtype: bson::spec::BinarySubtype::Generic, bytes: b"\x00\xffhi".to_vec() },
        "Empty": Bson::Null,
        "Nested": { "a": 1 },
    };
    env.insert(vec![v7_record(id, &env.queue, pm, in_ms(-500), headers)])
        .await;
    let mut consumer = env.consumer().await;
    let daemon = start(env.config());

    let got = consumer.take(1, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 1, "the due record was sent");
    let m = &got[0];
    assert_eq!(
        m.body,
        r#"{"CorrelationId":"3f2504e0-4f89-11d3-9a0c-0305e82c3301"}"#
    );
    assert_eq!(m.routing_key, env.queue);
    let keys: BTreeSet<&str> = m.headers.keys().map(String::as_str).collect();
    let expected: BTreeSet<&str> = [
        "Tenant",
        "Flag",
        "Count",
        "Raw",
        "Empty",
        "CorrelationId",
        "MessageId",
        "DestinationAddress",
        "MessageType",
        "SourceAddress",
        "TimeSent",
        "TypeName",
        "FullTypeName",
        "ConsumerType",
        "Language",
        "TimeoutId",
    ]
    .into_iter()
    .collect();
    assert_eq!(keys, expected);
    assert_eq!(m.header("Tenant").unwrap(), "acme");
    assert_eq!(m.header("Flag").unwrap(), "True");
    assert_eq!(m.header("Count").unwrap(), "42");
    assert_eq!(m.header("Raw").unwrap(), "base64:AP9oaQ==");
    assert_eq!(m.header("Empty").unwrap(), "");
    assert_eq!(
        m.header("CorrelationId").unwrap(),
        "3f2504e0-4f89-11d3-9a0c-0305e82c3301"
    );
    assert_eq!(m.header("MessageId").unwrap(), id.to_string());
    assert_eq!(m.header("TimeoutId").unwrap(), id.to_string());
    assert_eq!(m.header("DestinationAddress").unwrap(), env.queue);
    assert_eq!(m.header("MessageType").unwrap(), "Send");
    assert_eq!(m.header("SourceAddress").unwrap(), "timeoutd");
    assert_eq!(
        m.header("TypeName").unwrap(),
        "ServiceConnect.Interfaces.TimeoutMessage"
    );
    assert_eq!(
        m.header("FullTypeName").unwrap(),
        "ServiceConnect.Interfaces.TimeoutMessage, ServiceConnect.Interfaces, Version=7.0.0.0, Culture=neutral, PublicKeyToken=null"
    );
    assert_eq!(m.header("ConsumerType").unwrap(), "RabbitMQ");
    assert_eq!(m.header("Language").unwrap(), "C#");
    let sent = m.header("TimeSent").unwrap();
    assert_eq!(sent.len(), 28, "{sent}");
    assert_eq!(&sent[19..20], ".");
    assert!(sent.ends_with('Z'));
    time_sent(m);

    let p = &m.properties;
    assert_eq!(*p.delivery_mode(), Some(2));
    assert_eq!(p.message_id().as_ref().unwrap().as_str(), id.to_string());
    assert!(p.content_type().is_none());
    assert!(p.correlation_id().is_none());
    assert!(p.kind().is_none());
    assert!(p.timestamp().is_none());

    assert!(
        eventually(Duration::from_secs(10), || async {
            env.find(id).await.is_none()
        })
        .await,
        "the sent record is removed"
    );
    daemon.stop().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_message_ids_behave_like_v7() {
    let env = TestEnv::new().await;
    let id = Uuid::new_v4();
    env.insert(vec![v7_record(
        id,
        &env.queue,
        Uuid::new_v4(),
        in_ms(-10),
        doc! {},
    )])
    .await;
    let mut consumer = env.consumer().await;
    let mut config = env.config();
    config.rabbitmq.message_id = MessageIdMode::Random;
    config.rabbitmq.source_address = "billing-timeouts".into();
    let daemon = start(config);
    let got = consumer.take(1, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 1);
    let message_id = got[0].header("MessageId").unwrap();
    assert_ne!(message_id, id.to_string());
    assert!(Uuid::parse_str(&message_id).is_ok());
    assert_eq!(
        got[0].properties.message_id().as_ref().unwrap().as_str(),
        message_id
    );
    assert_eq!(got[0].header("TimeoutId"), None);
    assert_eq!(got[0].header("SourceAddress").unwrap(), "billing-timeouts");
    daemon.stop().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn future_records_wait_and_due_ones_fire() {
    let env = TestEnv::new().await;
    let now = in_ms(0);
    let due = Uuid::new_v4();
    let soon = Uuid::new_v4();
    let later = Uuid::new_v4();
    let soon_at = in_ms(2_500);
    env.insert(vec![
        v7_record(due, &env.queue, Uuid::new_v4(), in_ms(-1_000), doc! {}),
        v7_record(soon, &env.queue, Uuid::new_v4(), soon_at, doc! {}),
        v7_record(later, &env.queue, Uuid::new_v4(), in_ms(3_600_000), doc! {}),
    ])
    .await;
    let mut consumer = env.consumer().await;
    let daemon = start(env.config());

    let got = consumer.take(2, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 2, "the due and the soon-due record fire");
    assert_eq!(got[0].header("TimeoutId").unwrap(), due.to_string());
    assert_eq!(got[1].header("TimeoutId").unwrap(), soon.to_string());
    assert!(millis(time_sent(&got[0])) >= now.timestamp_millis() - 1_000);
    // The server clock is estimated to within a round trip; allow that much.
    assert!(
        millis(time_sent(&got[1])) >= soon_at.timestamp_millis() - 20,
        "the soon record was not sent before it fell due"
    );
    // The far-future record is neither sent nor touched.
    assert!(
        consumer
            .take(1, Duration::from_millis(800))
            .await
            .is_empty()
    );
    daemon.stop().await;
    let mut free_later = is_free();
    free_later.insert("_id", uuid(later));
    assert_eq!(env.count(free_later).await, 1);
    assert_eq!(env.count(doc! {}).await, 1);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn look_ahead_claims_early_and_sends_at_the_due_instant() {
    let env = TestEnv::new().await;
    let mut config = env.config();
    config.dispatch.poll_interval = Duration::from_secs(3);
    config.dispatch.look_ahead = Some(Duration::from_secs(3));
    // Due 1.5 s to 2 s from now, inside the first claim's look-ahead.
    let ids: Vec<Uuid> = (0..10).map(|_| Uuid::new_v4()).collect();
    let dues: Vec<_> = (0..10).map(|i| in_ms(1_500 + 50 * i)).collect();
    env.insert(
        ids.iter()
            .zip(&dues)
            .map(|(id, due)| v7_record(*id, &env.queue, Uuid::new_v4(), *due, doc! {}))
            .collect(),
    )
    .await;
    let mut consumer = env.consumer().await;
    let daemon = start(config);
    // Claimed ahead: leased well before they fall due.
    let leased = eventually(Duration::from_millis(1_200), || async {
        env.count(doc! { "Locked": true }).await == 10
    })
    .await;
    assert!(
        leased,
        "records due within the look-ahead are claimed before they fall due"
    );
    // Until just before the first falls due (not a fixed second: under load the lease is
    // seen late, and a fixed window then reached past the due instant).
    let until_due = dues[0].timestamp_millis() - millis(SystemTime::now()) - 50;
    assert!(
        consumer
            .take(1, Duration::from_millis(until_due.max(0) as u64))
            .await
            .is_empty(),
        "nothing is sent before it falls due"
    );
    let got = consumer.take(10, Duration::from_secs(10)).await;
    daemon.stop().await;
    assert_eq!(got.len(), 10);
    for r in &got {
        let id = r.header("TimeoutId").unwrap();
        let i = ids.iter().position(|u| u.to_string() == id).unwrap();
        // The server clock is estimated to within a round trip; allow that much.
        assert!(
            millis(time_sent(r)) >= dues[i].timestamp_millis() - 20,
            "{id} was sent before its due instant"
        );
    }
    let order: Vec<String> = got.iter().filter_map(|r| r.header("TimeoutId")).collect();
    let want: Vec<String> = ids.iter().map(Uuid::to_string).collect();
    assert_eq!(order, want, "sent in due order");
    assert_eq!(env.count(doc! {}).await, 0);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_inserted_due_before_the_next_poll_fires_at_its_instant() {
    let env = TestEnv::new().await;
    let mut config = env.config();
    // Polls are 60 s apart: only the change stream can fire the record in time.
    config.dispatch.poll_interval = Duration::from_secs(60);
    config.dispatch.look_ahead = Some(Duration::from_secs(60));
    config.dispatch.lock_lease = Duration::from_secs(300);
    let mut consumer = env.consumer().await;
    // A first record shows the first poll has happened; a second, due in 10 s, is held from
    // that poll on, so the loop is waiting for it when the new record comes in.
    let first = env.insert_due(1).await;
    let later = Uuid::new_v4();
    env.insert(vec![v7_record(
        later,
        &env.queue,
        Uuid::new_v4(),
        in_ms(10_000),
        doc! {},
    )])
    .await;
    let daemon = start(config);
    assert_eq!(consumer.take(1, Duration::from_secs(20)).await.len(), 1);
    assert!(
        eventually(Duration::from_secs(5), || async {
            env.find(first[0]).await.is_none()
        })
        .await
    );

    let id = Uuid::new_v4();
    let due = in_ms(1_500);
    env.insert(vec![v7_record(
        id,
        &env.queue,
        Uuid::new_v4(),
        due,
        doc! {},
    )])
    .await;
    let got = consumer.take(2, Duration::from_secs(30)).await;
    daemon.stop().await;
    assert_eq!(got.len(), 2, "both fired well before the next poll");
    assert_eq!(
        got[0].header("TimeoutId"),
        Some(id.to_string()),
        "the new record fired first, at its own instant"
    );
    assert_eq!(got[1].header("TimeoutId"), Some(later.to_string()));
    // The server clock is estimated to within a round trip; allow that much.
    assert!(
        millis(time_sent(&got[0])) >= due.timestamp_millis() - 20,
        "not sent before its due instant"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_dispatchers_send_each_record_once() {
    let env = TestEnv::new().await;
    let n = 1_500;
    let ids: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
    env.insert(
        ids.iter()
            .enumerate()
            .map(|(i, id)| v7_record(*id, &env.queue, Uuid::new_v4(), in_ms(-(i as i64)), doc! {}))
            .collect(),
    )
    .await;
    let mut consumer = env.consumer().await;
    let mut config = env.config();
    config.dispatch.batch_size = 40;
    let a = start(config.clone());
    let b = start(config);

    let got = consumer.take(n, Duration::from_secs(90)).await;
    let extra = consumer.take(1, Duration::from_secs(2)).await;
    a.stop().await;
    b.stop().await;
    let mut per_id: HashMap<String, usize> = HashMap::new();
    for m in got.iter().chain(extra.iter()) {
        *per_id.entry(m.header("TimeoutId").unwrap()).or_default() += 1;
    }
    assert_eq!(per_id.len(), n, "every record was sent");
    assert!(
        per_id.values().all(|c| *c == 1),
        "no record was sent twice: {:?}",
        per_id.iter().filter(|(_, c)| **c > 1).collect::<Vec<_>>()
    );
    assert_eq!(env.count(doc! {}).await, 0, "every sent record was removed");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_reaper_frees_expired_leases() {
    let env = TestEnv::new().await;
    let id = Uuid::new_v4();
    // A future record whose holder died: leased, lease expired.
    let mut d = v7_record(id, &env.queue, Uuid::new_v4(), in_ms(3_600_000), doc! {});
    d.insert("Locked", true);
    d.insert("LockedBy", uuid(Uuid::new_v4()));
    d.insert("LockExpiresAt", in_ms(-60_000));
    env.insert(vec![d]).await;
    let mut config = env.config();
    config.reaper.interval = Some(Duration::from_millis(200));
    let daemon = start(config);
    let mut free = is_free();
    free.insert("_id", uuid(id));
    let freed = eventually(Duration::from_secs(10), || {
        let f = free.clone();
        let env = &env;
        async move { env.count(f).await == 1 }
    })
    .await;
    daemon.stop().await;
    assert!(freed, "the reaper freed the expired lease");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_broker_connection_loses_nothing_and_recovers() {
    let env = TestEnv::new().await;
    let proxy = common::proxy::Proxy::start(&common::proxy::host_port(&amqp_uri())).await;
    let mut config = env.config();
    config.rabbitmq.uri = proxy.rewrite(&amqp_uri());
    let mut consumer = env.consumer().await;
    let daemon = start(config);
    env.insert_due(1).await;
    assert_eq!(consumer.take(1, Duration::from_secs(20)).await.len(), 1);
    // The first record's confirm and removal are done before the cut: a cut between the
    // delivery and the confirm makes its outcome unknown (released and sent again), which
    // is another test's subject and made this one count 21 under load.
    assert!(
        eventually(Duration::from_secs(20), || async {
            env.count(doc! {}).await == 0
        })
        .await,
        "the first record was removed before the cut"
    );

    proxy.set(common::proxy::Mode::Cut);
    let ids = env.insert_due(20).await;
    assert!(consumer.take(1, Duration::from_secs(2)).await.is_empty());
    assert_eq!(
        env.count(doc! {}).await,
        20,
        "nothing deleted while the broker is away"
    );

    proxy.set(common::proxy::Mode::Forward);
    let got = consumer.take(20, Duration::from_secs(30)).await;
    let sent: BTreeSet<String> = got.iter().map(|m| m.header("TimeoutId").unwrap()).collect();
    let want: BTreeSet<String> = ids.iter().map(Uuid::to_string).collect();
    assert_eq!(sent, want, "every record sent after the reconnect");
    assert!(
        eventually(Duration::from_secs(10), || async {
            env.count(doc! {}).await == 0
        })
        .await,
        "and removed"
    );
    daemon.stop().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_creates_its_own_indexes_only() {
    let env = TestEnv::new().await;
    let daemon = start(env.config());
    let ok = eventually(Duration::from_secs(10), || async {
        env.coll
            .list_index_names()
            .await
            .map(|n| n.iter().any(|i| i == "timeoutd_owner"))
            .unwrap_or(false)
    })
    .await;
    daemon.stop().await;
    assert!(ok, "timeoutd_owner (the last) created");
    let mut cursor = env.coll.list_indexes().await.unwrap();
    let mut keys = Vec::new();
    while let Some(ix) = futures::StreamExt::next(&mut cursor).await {
        let ix = ix.unwrap();
        keys.push((ix.options.and_then(|o| o.name).unwrap(), ix.keys));
    }
    keys.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        keys,
        vec![
            ("_id_".to_string(), doc! { "_id": 1 }),
            // time_encoding = "auto": one index per shape of Time.
            ("timeoutd_due_date".to_string(), doc! { "Time": 1 }),
            (
                "timeoutd_due_offset".to_string(),
                doc! { "Time.1": 1, "Time.0": 1 }
            ),
            (
                "timeoutd_lease".to_string(),
                doc! { "Locked": 1, "LockExpiresAt": 1 }
            ),
            ("timeoutd_owner".to_string(), doc! { "LockedBy": 1 }),
        ]
    );
    env.cleanup().await;
}
