//! The RabbitMQ model (`tests/sim/rabbit.rs`) held honest: each case runs against the model
//! (under a paused clock) and against the real broker through the daemon's own
//! [`LapinBroker`], on the same [`Broker`] and [`Link`] calls, and asserts the same things.
//!
//! The real side is the local broker (`TIMEOUTD_TEST_AMQP_URI`, default
//! amqp://guest:guest@127.0.0.1:5672/%2f) for everything that touches only this test's own
//! queues and connections (`rabbitmqctl close_connection` closes only the test's connection).
//! A memory alarm blocks every publisher of a cluster, so the blocked case and the node lost
//! in the middle of a wave run on a private three-node cluster
//! (`scripts/start-rabbitmq-cluster.sh`), never on the shared broker; they need root and
//! Debian's rabbitmq-server, as the project's machines have, and are skipped with a note
//! otherwise. Where lapin or RabbitMQ leave a choice open (which ack carries a return), the
//! case checks what both must agree on and prints what it saw.
#![allow(clippy::disallowed_methods)]

mod common;
#[path = "sim/rabbit.rs"]
mod rabbit;

use std::collections::BTreeSet;
use std::time::Duration;

use futures::future::BoxFuture;
use lapin::options::{BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, DecimalValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use timeoutd::config::RabbitConfig;
use timeoutd::rabbit::lapinlink::LapinBroker;
use timeoutd::rabbit::link::{Answer, Broker, Confirm, Link, LinkError, Returned};
use uuid::Uuid;

use rabbit::{Behaviour, DownMode, RabbitModel};

/// The bound on every wait of a case (virtual time for the model).
const DEADLINE: Duration = Duration::from_secs(30);
/// How long a confirm held by a quorum queue without its majority may take once the majority
/// is back: past RabbitMQ's resend of commands a lost leader never applied (about 60 s).
const RESEND_DEADLINE: Duration = Duration::from_secs(120);

/// What a case reads back from a queue.
#[derive(Debug, Clone)]
struct Got {
    properties: BasicProperties,
    body: Vec<u8>,
}

/// One broker to run a case against, with what the case does beside the link: declare and
/// read queues, close a connection from the server side, set a memory alarm, stop a node.
trait Server: Send + Sync {
    fn name(&self) -> &'static str;
    fn broker(&self) -> &dyn Broker;
    /// The node the case opens links to.
    fn uri(&self) -> String;
    fn declare<'a>(&'a self, queue: &'a str) -> BoxFuture<'a, ()>;
    /// Declares a queue that nacks every publish.
    fn declare_rejecting<'a>(&'a self, queue: &'a str) -> BoxFuture<'a, ()>;
    fn delete<'a>(&'a self, queue: &'a str) -> BoxFuture<'a, ()>;
    /// Waits until `queue` holds at least `n` messages (or the deadline), then takes every
    /// message it holds.
    fn take<'a>(&'a self, queue: &'a str, n: usize) -> BoxFuture<'a, Vec<Got>>;
    /// A node whose link can stall: the model's node, or the broker behind the test proxy.
    fn stall_uri(&self) -> String;
    /// Stalls that node's links in both directions (bytes held, connections open), or
    /// releases them.
    fn stall(&self, on: bool) -> BoxFuture<'_, ()>;
    /// Holds back what that node sends (it still reads and routes), or releases it.
    fn hold_replies(&self, on: bool) -> BoxFuture<'_, ()>;
    /// The server closes the connections named `name` (`rabbitmqctl close_connection`).
    fn close_connection<'a>(&'a self, name: &'a str) -> BoxFuture<'a, ()>;
}

/// A server that can also raise a memory alarm and stop nodes (the model, or the private
/// cluster).
trait ClusterServer: Server {
    fn node_uri(&self, i: usize) -> String;
    fn set_alarm(&self, on: bool) -> BoxFuture<'_, ()>;
    fn stop_node(&self, i: usize) -> BoxFuture<'_, ()>;
    fn start_node(&self, i: usize) -> BoxFuture<'_, ()>;
}

fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", Uuid::new_v4().simple())
}

async fn within<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(DEADLINE, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: no answer within {DEADLINE:?}"),
    }
}

async fn open(server: &dyn Server, uri: &str, name: &str) -> Box<dyn Link> {
    within("open", server.broker().open(uri, name))
        .await
        .unwrap_or_else(|e| panic!("{}: open {uri}: {e}", server.name()))
}

fn props(id: &str) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(
        "TimeoutId".into(),
        AMQPValue::LongString(LongString::from(id.to_string())),
    );
    headers.insert(
        "MessageType".into(),
        AMQPValue::LongString("ServiceConnect.TimeoutMessage".into()),
    );
    BasicProperties::default()
        .with_message_id(id.into())
        .with_correlation_id(format!("corr-{id}").into())
        .with_delivery_mode(2)
        .with_headers(headers)
}

fn header_str(p: &BasicProperties, name: &str) -> Option<String> {
    match p.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    }
}

fn message_id(p: &BasicProperties) -> Option<String> {
    p.message_id().as_ref().map(|s| s.to_string())
}

async fn publish(
    link: &dyn Link,
    key: &str,
    body: &[u8],
    p: BasicProperties,
) -> Result<Confirm, LinkError> {
    within("publish written", link.publish(key, body.to_vec(), p, true)).await
}

async fn answer(confirm: Confirm) -> Result<Answer, LinkError> {
    within("confirm", confirm).await
}

// ---------------------------------------------------------------------------------------
// The cases

/// A publish to a bound queue is acked without a return and arrives with its properties.
async fn bound_queue(server: &dyn Server) {
    let queue = unique("conf-bound");
    server.declare(&queue).await;
    let link = open(server, &server.uri(), &unique("conf")).await;
    let status = link.status();
    assert!(status.connected && !status.blocked, "{status:?}");
    let id = Uuid::new_v4().to_string();
    let confirm = publish(&*link, &queue, b"hello", props(&id)).await;
    let got = answer(confirm.expect("written")).await;
    assert_eq!(got, Ok(Answer::Ack(None)), "{}", server.name());
    let msgs = server.take(&queue, 1).await;
    assert_eq!(msgs.len(), 1, "{}: {msgs:?}", server.name());
    let m = &msgs[0];
    assert_eq!(m.body, b"hello");
    assert_eq!(message_id(&m.properties), Some(id.clone()));
    assert_eq!(
        m.properties
            .correlation_id()
            .as_ref()
            .map(|s| s.to_string()),
        Some(format!("corr-{id}"))
    );
    assert_eq!(*m.properties.delivery_mode(), Some(2));
    assert_eq!(header_str(&m.properties, "TimeoutId"), Some(id));
    let _ = within("close", link.close(200, "done")).await;
    server.delete(&queue).await;
}

/// A mandatory publish to a name no queue has is returned (312, with its `MessageId`) and
/// acked.
async fn unbound_mandatory(server: &dyn Server) {
    let link = open(server, &server.uri(), &unique("conf")).await;
    let id = Uuid::new_v4().to_string();
    let confirm = publish(&*link, &unique("conf-nowhere"), b"x", props(&id)).await;
    let got = answer(confirm.expect("written")).await;
    assert_eq!(
        got,
        Ok(Answer::Ack(Some(Returned {
            message_id: Some(id),
            reply_code: 312
        }))),
        "{}",
        server.name()
    );
    let _ = within("close", link.close(200, "done")).await;
}

/// A pipelined wave, some of it unroutable: every publish is acked, the set of returned
/// `MessageId`s is exactly the unroutable ones (whichever ack carried each), and the queue
/// holds exactly the routable ones.
async fn wave_with_unroutable(server: &dyn Server) {
    let queue = unique("conf-wave");
    server.declare(&queue).await;
    let link = open(server, &server.uri(), &unique("conf")).await;
    let nowhere = unique("conf-nowhere");
    let mut ids = Vec::new();
    let mut confirms = Vec::new();
    for i in 0..200 {
        let id = format!("{i:04}-{}", Uuid::new_v4().simple());
        let key = if i % 3 == 1 { &nowhere } else { &queue };
        confirms.push(
            publish(&*link, key, id.as_bytes(), props(&id))
                .await
                .expect("written"),
        );
        ids.push((id, i % 3 == 1));
    }
    let answers = within("confirms", futures::future::join_all(confirms)).await;
    let mut returned = BTreeSet::new();
    let mut elsewhere = 0;
    for ((id, _), a) in ids.iter().zip(&answers) {
        match a {
            Ok(Answer::Ack(None)) => {}
            Ok(Answer::Ack(Some(r))) => {
                assert_eq!(r.reply_code, 312);
                if r.message_id.as_deref() != Some(id.as_str()) {
                    elsewhere += 1;
                }
                assert!(
                    returned.insert(r.message_id.clone()),
                    "returned twice: {r:?}"
                );
            }
            other => panic!("{}: {id}: {other:?}", server.name()),
        }
    }
    let unroutable: BTreeSet<Option<String>> = ids
        .iter()
        .filter(|(_, u)| *u)
        .map(|(id, _)| Some(id.clone()))
        .collect();
    assert_eq!(returned, unroutable, "{}", server.name());
    let routable: BTreeSet<String> = ids
        .iter()
        .filter(|(_, u)| !*u)
        .map(|(id, _)| id.clone())
        .collect();
    let got: BTreeSet<String> = server
        .take(&queue, routable.len())
        .await
        .iter()
        .filter_map(|m| message_id(&m.properties))
        .collect();
    assert_eq!(got, routable, "{}", server.name());
    println!(
        "{}: {} returns of {} came with another message's ack",
        server.name(),
        elsewhere,
        unroutable.len()
    );
    let _ = within("close", link.close(200, "done")).await;
    server.delete(&queue).await;
}

/// The link reports the negotiated `frame_max`: the broker's default, or the lower value the
/// URI asks for.
async fn frame_max_reported(server: &dyn Server) {
    let link = open(server, &server.uri(), &unique("conf")).await;
    assert_eq!(link.frame_max(), 131_072, "{}", server.name());
    let _ = within("close", link.close(200, "done")).await;
    let small = format!("{}?frame_max=8192", server.uri());
    let link = open(server, &small, &unique("conf")).await;
    assert_eq!(link.frame_max(), 8192, "{}", server.name());
    assert_eq!(link.server_version(), None, "{}", server.name());
    let _ = within("close", link.close(200, "done")).await;
}

/// Properties whose content header frame is exactly `size` bytes.
fn props_of_header_size(id: &str, size: usize) -> BasicProperties {
    let base = props(id);
    let pad = |n: usize| {
        let mut p = base.clone();
        let mut headers = p.headers().clone().unwrap_or_default();
        headers.insert(
            "Pad".into(),
            AMQPValue::LongString(LongString::from("p".repeat(n))),
        );
        p = p.with_headers(headers);
        p
    };
    let empty = rabbit::header_frame_len(&pad(0));
    let p = pad(size.saturating_sub(empty));
    assert_eq!(rabbit::header_frame_len(&p), size);
    p
}

/// A body larger than `frame_max` goes (split in body frames); a content header frame of
/// `frame_max` + 8 bytes goes (RabbitMQ lets a frame run 8 bytes past `frame_max`, its
/// `FRAME_SIZE_FUDGE`; timeoutd's own check stops at `frame_max`, on the safe side); one byte
/// more and the broker closes the connection: its confirm fails, the link reports itself
/// closed and later publishes fail.
async fn frame_limits(server: &dyn Server) {
    let queue = unique("conf-frames");
    server.declare(&queue).await;
    let uri = format!("{}?frame_max=8192", server.uri());
    let link = open(server, &uri, &unique("conf")).await;
    assert_eq!(link.frame_max(), 8192);
    let body: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let big = Uuid::new_v4().to_string();
    let c = publish(&*link, &queue, &body, props(&big))
        .await
        .expect("written");
    assert_eq!(answer(c).await, Ok(Answer::Ack(None)), "{}", server.name());
    let at_limit = Uuid::new_v4().to_string();
    let c = publish(
        &*link,
        &queue,
        b"x",
        props_of_header_size(&at_limit, 8192 + 8),
    )
    .await
    .expect("written");
    assert_eq!(answer(c).await, Ok(Answer::Ack(None)), "{}", server.name());
    let msgs = server.take(&queue, 2).await;
    assert_eq!(msgs.len(), 2, "{}", server.name());
    assert_eq!(msgs[0].body, body);
    assert_eq!(message_id(&msgs[1].properties), Some(at_limit));

    let over = Uuid::new_v4().to_string();
    let outcome = match publish(&*link, &queue, b"x", props_of_header_size(&over, 8192 + 9)).await {
        Ok(c) => answer(c).await.map(|_| ()),
        Err(e) => Err(e),
    };
    let err = outcome.expect_err("a header over frame_max cannot be acked");
    println!("{}: header over frame_max: {err}", server.name());
    within("link closed", async {
        while link.status().connected {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let later = publish(&*link, &queue, b"y", props(&Uuid::new_v4().to_string())).await;
    assert!(
        later.is_err(),
        "{}: a publish on a closed link",
        server.name()
    );
    assert!(server.take(&queue, 0).await.is_empty(), "{}", server.name());
    server.delete(&queue).await;
}

/// The server closes the connection: the link reports it, and later publishes fail.
async fn closed_by_server(server: &dyn Server) {
    let queue = unique("conf-closed");
    server.declare(&queue).await;
    let name = unique("conf-closed");
    let link = open(server, &server.uri(), &name).await;
    let c = publish(&*link, &queue, b"x", props(&Uuid::new_v4().to_string()))
        .await
        .expect("written");
    assert_eq!(answer(c).await, Ok(Answer::Ack(None)));
    server.close_connection(&name).await;
    within("link closed", async {
        while link.status().connected {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let later = publish(&*link, &queue, b"y", props(&Uuid::new_v4().to_string())).await;
    assert!(
        later.is_err(),
        "{}: a publish on a closed link",
        server.name()
    );
    assert_eq!(server.take(&queue, 1).await.len(), 1);
    server.delete(&queue).await;
}

/// A memory alarm: a link that publishes is blocked (`status().blocked`), and publishes are
/// not written until the alarm clears; then all of it is confirmed and delivered. Then a node
/// lost in the middle of a stream of publishes: its pending confirms fail, later publishes
/// fail, the node refuses new links and another node takes one.
async fn alarm_and_node_loss(server: &dyn ClusterServer) {
    let queue = unique("conf-alarm");
    server.declare(&queue).await;
    let link = open(server, &server.node_uri(0), &unique("conf-alarm")).await;
    let c = publish(&*link, &queue, b"before", props("before"))
        .await
        .expect("written");
    assert_eq!(answer(c).await, Ok(Answer::Ack(None)));
    let idle = open(server, &server.node_uri(0), &unique("conf-idle")).await;
    let mut ids = vec!["before".to_string()];

    server.set_alarm(true).await;
    // The broker blocks a link when it publishes (once the alarm took effect): publish until
    // the link says it is blocked.
    let mut confirms = Vec::new();
    let mut unwritten = Vec::new();
    for k in 0..60 {
        if link.status().blocked {
            break;
        }
        let id = format!("a{k}");
        ids.push(id.clone());
        let mut write = link.publish(&queue, b"a".to_vec(), props(&id), true);
        match tokio::time::timeout(Duration::from_secs(1), &mut write).await {
            Ok(written) => confirms.push(written.expect("written")),
            Err(_) => unwritten.push(write),
        }
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            while !link.status().blocked {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
    }
    assert!(link.status().blocked, "{}: never blocked", server.name());
    println!(
        "{}: blocked after {} publishes ({} not written); a link that did not publish is blocked: {}",
        server.name(),
        ids.len() - 1,
        unwritten.len(),
        idle.status().blocked
    );
    ids.push("b".into());
    let mut write = link.publish(&queue, b"b".to_vec(), props("b"), true);
    let not_written = tokio::time::timeout(Duration::from_secs(2), &mut write)
        .await
        .is_err();
    assert!(
        not_written,
        "{}: a publish was written while blocked",
        server.name()
    );
    unwritten.push(write);
    let mut answers = Vec::new();
    let mut pending = Vec::new();
    for mut c in confirms {
        match tokio::time::timeout(Duration::from_millis(500), &mut c).await {
            Ok(a) => answers.push(a),
            Err(_) => pending.push(c),
        }
    }
    // The publish that tripped the block is read only once the alarm clears.
    assert!(
        answers.is_empty(),
        "{}: confirms answered while blocked: {answers:?}",
        server.name()
    );
    assert!(
        !idle.status().blocked,
        "{}: a link that did not publish",
        server.name()
    );
    server.set_alarm(false).await;
    for w in unwritten {
        pending.push(within("written after the alarm", w).await.expect("written"));
    }
    for c in pending {
        answers.push(answer(c).await);
    }
    for a in answers {
        assert_eq!(a, Ok(Answer::Ack(None)), "{}", server.name());
    }
    within("unblocked", async {
        while link.status().blocked {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let got: BTreeSet<String> = server
        .take(&queue, ids.len())
        .await
        .iter()
        .filter_map(|m| message_id(&m.properties))
        .collect();
    assert_eq!(got, ids.into_iter().collect(), "{}", server.name());
    let _ = within("close", idle.close(200, "done")).await;
    let _ = within("close", link.close(200, "done")).await;

    // A node lost in the middle of a stream of publishes.
    let link = open(server, &server.node_uri(1), &unique("conf-lost")).await;
    let mut confirms = Vec::new();
    let publishing = async {
        for i in 0..20_000 {
            let id = format!("lost-{i}");
            match within(
                "publish",
                link.publish(&queue, b"w".to_vec(), props(&id), true),
            )
            .await
            {
                Ok(c) => confirms.push(c),
                Err(_) => return true,
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        false
    };
    let stopping = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        server.stop_node(1).await;
    };
    let (failed_later, ()) = futures::future::join(publishing, stopping).await;
    assert!(
        failed_later,
        "{}: publishes went on after the node stopped",
        server.name()
    );
    let answers = within("confirms", futures::future::join_all(confirms)).await;
    let acked = answers.iter().filter(|a| a.is_ok()).count();
    let failed = answers.iter().filter(|a| a.is_err()).count();
    assert!(
        answers
            .iter()
            .all(|a| matches!(a, Ok(Answer::Ack(None)) | Err(_))),
        "{}: {answers:?}",
        server.name()
    );
    println!(
        "{}: node lost mid-stream: {acked} acked, {failed} pending confirms failed",
        server.name()
    );
    assert!(!link.status().connected, "{}", server.name());
    let refused = tokio::time::timeout(
        Duration::from_secs(10),
        server.broker().open(&server.node_uri(1), "conf-refused"),
    )
    .await;
    assert!(
        !matches!(refused, Ok(Ok(_))),
        "{}: a stopped node took a link",
        server.name()
    );
    let other = open(server, &server.node_uri(2), &unique("conf-other")).await;
    let c = publish(&*other, &queue, b"z", props("other"))
        .await
        .expect("written");
    assert_eq!(answer(c).await, Ok(Answer::Ack(None)));
    let _ = within("close", other.close(200, "done")).await;

    // The quorum queue without its majority (two of three nodes stopped): no answer until
    // the majority is back.
    let _ = server.take(&queue, 0).await;
    let link = open(server, &server.node_uri(0), &unique("conf-majority")).await;
    server.stop_node(2).await;
    let mut held = publish(&*link, &queue, b"h", props("held"))
        .await
        .expect("written");
    let early = tokio::time::timeout(Duration::from_secs(2), &mut held).await;
    assert!(
        early.is_err(),
        "{}: answered without a majority: {early:?}",
        server.name()
    );
    futures::future::join(server.start_node(1), server.start_node(2)).await;
    // RabbitMQ answers at once, or only when the channel's quorum queue client resends what
    // the old leader never applied, after its resend timer: of five timed runs here, four
    // answered within 0.2 s and one after 61.7 s. A wait of `DEADLINE` failed that way in
    // two of seven earlier runs.
    let late = match tokio::time::timeout(RESEND_DEADLINE, held).await {
        Ok(late) => late,
        Err(_) => panic!("the answer once the majority is back: none within {RESEND_DEADLINE:?}"),
    };
    println!(
        "{}: the answer once the majority is back: {late:?}",
        server.name()
    );
    assert_eq!(late, Ok(Answer::Ack(None)), "{}", server.name());
    let got: Vec<Option<String>> = server
        .take(&queue, 1)
        .await
        .iter()
        .map(|m| message_id(&m.properties))
        .collect();
    assert_eq!(got, vec![Some("held".to_string())], "{}", server.name());
    let _ = within("close", link.close(200, "done")).await;
    server.delete(&queue).await;
}

/// A stalled link (nothing flows either way, the connection stays open): a publish is still
/// written (into the sockets' buffers) but gets no answer; once released, it is confirmed and
/// delivered.
async fn stalled(server: &dyn Server) {
    let queue = unique("conf-stalled");
    server.declare(&queue).await;
    let link = open(server, &server.stall_uri(), &unique("conf-stalled")).await;
    let c = publish(&*link, &queue, b"s", props("s0"))
        .await
        .expect("written");
    assert_eq!(answer(c).await, Ok(Answer::Ack(None)));
    server.stall(true).await;
    let mut c = publish(&*link, &queue, b"s", props("s1"))
        .await
        .expect("written");
    let early = tokio::time::timeout(Duration::from_secs(1), &mut c).await;
    assert!(early.is_err(), "{}: answered while stalled", server.name());
    assert!(link.status().connected, "{}", server.name());
    server.stall(false).await;
    assert_eq!(answer(c).await, Ok(Answer::Ack(None)), "{}", server.name());
    let got: Vec<Option<String>> = server
        .take(&queue, 2)
        .await
        .iter()
        .map(|m| message_id(&m.properties))
        .collect();
    assert_eq!(got, vec![Some("s0".to_string()), Some("s1".to_string())]);
    let _ = within("close", link.close(200, "done")).await;
    server.delete(&queue).await;
}

/// Replies held back (the broker reads and routes, the client hears nothing): a wave is
/// delivered while its confirms wait, a stalled open does not complete, and once released
/// every confirm arrives in order.
async fn replies_held(server: &dyn Server) {
    let queue = unique("conf-held");
    server.declare(&queue).await;
    let link = open(server, &server.stall_uri(), &unique("conf-held")).await;
    server.hold_replies(true).await;
    let mut confirms = Vec::new();
    let mut ids = BTreeSet::new();
    for i in 0..20 {
        let id = format!("h{i}");
        ids.insert(id.clone());
        confirms.push(
            publish(&*link, &queue, b"h", props(&id))
                .await
                .expect("written"),
        );
    }
    let got: BTreeSet<String> = server
        .take(&queue, ids.len())
        .await
        .iter()
        .filter_map(|m| message_id(&m.properties))
        .collect();
    assert_eq!(got, ids, "{}: routed while replies are held", server.name());
    let first = confirms.first_mut().expect("a confirm");
    let early = tokio::time::timeout(Duration::from_secs(1), first).await;
    assert!(early.is_err(), "{}: answered while held", server.name());
    server.hold_replies(false).await;
    for c in confirms {
        assert_eq!(answer(c).await, Ok(Answer::Ack(None)), "{}", server.name());
    }
    let _ = within("close", link.close(200, "done")).await;

    // An open to a stalled node does not complete (the caller's deadline ends it).
    server.stall(true).await;
    let hung = tokio::time::timeout(
        Duration::from_secs(2),
        server.broker().open(&server.stall_uri(), "conf-hung"),
    )
    .await;
    assert!(
        hung.is_err(),
        "{}: an open to a stalled node",
        server.name()
    );
    server.stall(false).await;
    server.delete(&queue).await;
}

/// A queue that rejects publishes (`x-overflow: reject-publish` at `x-max-length: 0`): the
/// publish is nacked, without a return, and not delivered.
async fn nacked(server: &dyn Server) {
    let queue = unique("conf-nacked");
    server.declare_rejecting(&queue).await;
    let link = open(server, &server.uri(), &unique("conf")).await;
    let c = publish(&*link, &queue, b"n", props("nacked"))
        .await
        .expect("written");
    assert_eq!(answer(c).await, Ok(Answer::Nack(None)), "{}", server.name());
    assert!(server.take(&queue, 0).await.is_empty(), "{}", server.name());
    let _ = within("close", link.close(200, "done")).await;
    server.delete(&queue).await;
}

/// `props(id)` with more headers.
fn with_headers(id: &str, extra: &[(&str, AMQPValue)]) -> BasicProperties {
    let p = props(id);
    let mut headers = p.headers().clone().unwrap_or_default();
    for (name, value) in extra {
        headers.insert((*name).into(), value.clone());
    }
    p.with_headers(headers)
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(s.into())
}

fn array(values: &[AMQPValue]) -> AMQPValue {
    AMQPValue::FieldArray(values.to_vec().into())
}

/// RabbitMQ reads the headers `CC` and `BCC` (exactly so named) as more routing keys
/// (sender-selected distribution): an array routes the message to the queues its strings name
/// as well, once each (anything else in it is skipped; a mandatory message any of them routes
/// is not returned; one of them rejecting it makes the confirm a nack), and `BCC` is removed
/// before delivery; `cc` and `bcc` are ordinary headers. Any other value of `CC` or `BCC`
/// makes the broker refuse the message and close the channel (406): its confirm fails with
/// the broker's reason, so does what was pipelined behind it (and may the one before it), and
/// the link reports itself closed.
async fn routing_headers(server: &dyn Server) {
    let (queue, other, full) = (unique("conf-cc"), unique("conf-cc"), unique("conf-cc"));
    server.declare(&queue).await;
    server.declare(&other).await;
    server.declare_rejecting(&full).await;
    let link = open(server, &server.uri(), &unique("conf")).await;
    let nowhere = unique("conf-nowhere");
    let sends = [
        (
            "lower",
            &queue,
            vec![("cc", text(&other)), ("bcc", text(&other))],
        ),
        (
            "cc",
            &queue,
            vec![("CC", array(&[text(&other), AMQPValue::LongInt(7)]))],
        ),
        ("bcc", &queue, vec![("BCC", array(&[text(&other)]))]),
        (
            "self",
            &queue,
            vec![("CC", array(&[text(&queue), text(&queue)]))],
        ),
        ("away", &nowhere, vec![("CC", array(&[text(&other)]))]),
        ("full", &queue, vec![("CC", array(&[text(&full)]))]),
    ];
    let mut answers = Vec::new();
    for (id, key, headers) in sends {
        let c = publish(&*link, key, b"c", with_headers(id, &headers)).await;
        answers.push(answer(c.expect("written")).await);
    }
    let ack = || -> Result<Answer, LinkError> { Ok(Answer::Ack(None)) };
    let want = [ack(), ack(), ack(), ack(), ack(), Ok(Answer::Nack(None))];
    assert_eq!(answers, want, "{}", server.name());
    let _ = within("close", link.close(200, "done")).await;
    let seen = |msgs: Vec<Got>| -> Vec<String> {
        let has = |m: &Got, h: &str| {
            m.properties
                .headers()
                .as_ref()
                .is_some_and(|t| t.contains_key(h))
        };
        msgs.iter()
            .map(|m| {
                let id = message_id(&m.properties).unwrap_or_default();
                format!(
                    "{id}{}{}",
                    if has(m, "CC") { " CC" } else { "" },
                    if has(m, "BCC") { " BCC" } else { "" }
                )
            })
            .collect()
    };
    assert_eq!(
        seen(server.take(&queue, 5).await),
        ["lower", "cc CC", "bcc", "self CC", "full CC"],
        "{}",
        server.name()
    );
    assert_eq!(
        seen(server.take(&other, 3).await),
        ["cc CC", "bcc", "away CC"],
        "{}",
        server.name()
    );

    for (name, value, ty) in [
        ("CC", text(&other), "longstr"),
        ("BCC", text(&other), "longstr"),
        ("CC", AMQPValue::Boolean(true), "bool"),
        ("CC", AMQPValue::ShortShortInt(1), "byte"),
        ("CC", AMQPValue::ShortShortUInt(1), "unsignedbyte"),
        ("CC", AMQPValue::ShortInt(1), "short"),
        ("CC", AMQPValue::ShortUInt(1), "unsignedshort"),
        ("CC", AMQPValue::LongInt(1), "signedint"),
        ("CC", AMQPValue::LongUInt(1), "unsignedint"),
        ("CC", AMQPValue::LongLongInt(1), "long"),
        ("CC", AMQPValue::Float(1.0), "float"),
        ("CC", AMQPValue::Double(1.0), "double"),
        (
            "CC",
            AMQPValue::DecimalValue(DecimalValue { scale: 1, value: 1 }),
            "decimal",
        ),
        ("CC", AMQPValue::Timestamp(1), "timestamp"),
        ("CC", AMQPValue::FieldTable(FieldTable::default()), "table"),
        ("CC", AMQPValue::ByteArray(vec![1u8].into()), "binary"),
        ("CC", AMQPValue::Void, "void"),
    ] {
        let link = open(server, &server.uri(), &unique("conf")).await;
        let before = publish(&*link, &queue, b"c", props("before")).await;
        let bad = publish(&*link, &queue, b"c", with_headers("bad", &[(name, value)])).await;
        let after = publish(&*link, &queue, b"c", props("after")).await;
        let outcome = |p: Result<Confirm, LinkError>| async move { answer(p?).await };
        let reason = format!(
            "PRECONDITION_FAILED - invalid message: {{unacceptable_type_in_header,\"{name}\",{ty}}}"
        );
        // The close may overtake the ack of the message routed just before.
        let before = outcome(before).await;
        assert!(
            before == Ok(Answer::Ack(None))
                || before.as_ref().is_err_and(|e| e.0.contains(&reason)),
            "{}: {before:?}",
            server.name()
        );
        let err = outcome(bad)
            .await
            .expect_err("a refused message cannot be acked");
        println!(
            "{}: {name} as {ty}: {err}; the one before: {before:?}",
            server.name()
        );
        assert!(err.0.contains(&reason), "{}: {err}", server.name());
        let later = outcome(after).await;
        assert!(
            later.is_err(),
            "{}: pipelined behind it: {later:?}",
            server.name()
        );
        assert!(!link.status().connected, "{}", server.name());
        assert_eq!(
            seen(server.take(&queue, 1).await),
            ["before"],
            "{}",
            server.name()
        );
        assert!(server.take(&other, 0).await.is_empty(), "{}", server.name());
        let _ = within("close", link.close(200, "done")).await;
    }
    for q in [&queue, &other, &full] {
        server.delete(q).await;
    }
}

// ---------------------------------------------------------------------------------------
// The model

struct Model {
    model: RabbitModel,
}

const MODEL_NODES: [&str; 3] = [
    "amqp://guest:guest@10.0.0.1:5672/%2f",
    "amqp://guest:guest@10.0.0.2:5672/%2f",
    "amqp://guest:guest@10.0.0.3:5672/%2f",
];

impl Model {
    fn new(seed: u64) -> Self {
        Self {
            model: RabbitModel::new(&MODEL_NODES, seed, Behaviour::default()),
        }
    }
}

impl Server for Model {
    fn name(&self) -> &'static str {
        "model"
    }
    fn broker(&self) -> &dyn Broker {
        &self.model
    }
    fn uri(&self) -> String {
        MODEL_NODES[0].to_string()
    }
    fn declare<'a>(&'a self, queue: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move { self.model.declare_quorum_queue(queue) })
    }
    fn declare_rejecting<'a>(&'a self, queue: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            self.model.declare_queue(queue);
            self.model.set_queue_nacks(queue, true);
        })
    }
    fn delete<'a>(&'a self, queue: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move { self.model.delete_queue(queue) })
    }
    fn take<'a>(&'a self, queue: &'a str, n: usize) -> BoxFuture<'a, Vec<Got>> {
        Box::pin(async move {
            let _ = tokio::time::timeout(DEADLINE, async {
                while self.model.deliveries_to(queue).len() < n {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
            .await;
            self.model
                .take_queue(queue)
                .into_iter()
                .map(|d| Got {
                    properties: d.properties,
                    body: d.body,
                })
                .collect()
        })
    }
    fn close_connection<'a>(&'a self, name: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move { self.model.close_connection(name, "closed by the test") })
    }
    fn stall_uri(&self) -> String {
        MODEL_NODES[0].to_string()
    }
    fn stall(&self, on: bool) -> BoxFuture<'_, ()> {
        Box::pin(async move { self.model.stall_node(MODEL_NODES[0], on) })
    }
    fn hold_replies(&self, on: bool) -> BoxFuture<'_, ()> {
        Box::pin(async move { self.model.hold_replies(MODEL_NODES[0], on) })
    }
}

impl ClusterServer for Model {
    fn node_uri(&self, i: usize) -> String {
        MODEL_NODES[i % 3].to_string()
    }
    fn set_alarm(&self, on: bool) -> BoxFuture<'_, ()> {
        Box::pin(async move { self.model.set_memory_alarm(MODEL_NODES[0], on) })
    }
    fn stop_node(&self, i: usize) -> BoxFuture<'_, ()> {
        Box::pin(async move { self.model.node_down(MODEL_NODES[i % 3], DownMode::Refuse) })
    }
    fn start_node(&self, i: usize) -> BoxFuture<'_, ()> {
        Box::pin(async move { self.model.node_up(MODEL_NODES[i % 3]) })
    }
}

// ---------------------------------------------------------------------------------------
// The real broker

struct Real {
    broker: LapinBroker,
    uris: Vec<String>,
    _admin: Connection,
    channel: lapin::Channel,
    cluster: Option<common::cluster::Cluster>,
    proxy: common::proxy::Proxy,
}

impl Real {
    async fn local() -> Self {
        Self::with(vec![common::amqp_uri()], None).await
    }

    async fn with(uris: Vec<String>, cluster: Option<common::cluster::Cluster>) -> Self {
        let broker = LapinBroker::new(&RabbitConfig::default()).expect("broker");
        let admin = Connection::connect(&uris[0], ConnectionProperties::default())
            .await
            .expect("connect the admin link");
        let channel = admin.create_channel().await.expect("admin channel");
        let proxy = common::proxy::Proxy::start(&common::proxy::host_port(&uris[0])).await;
        Self {
            broker,
            uris,
            _admin: admin,
            channel,
            cluster,
            proxy,
        }
    }

    async fn rabbitmqctl(&self, args: &[&str]) -> String {
        let mut cmd = tokio::process::Command::new("rabbitmqctl");
        cmd.arg("-q");
        if let Some(c) = &self.cluster {
            cmd.arg("-n").arg(&c.nodes[0].0);
        }
        let out = within(
            "rabbitmqctl",
            cmd.args(args).stdin(std::process::Stdio::null()).output(),
        )
        .await
        .expect("run rabbitmqctl");
        assert!(
            out.status.success(),
            "rabbitmqctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Server for Real {
    fn name(&self) -> &'static str {
        if self.cluster.is_some() {
            "cluster"
        } else {
            "rabbitmq"
        }
    }
    fn broker(&self) -> &dyn Broker {
        &self.broker
    }
    fn uri(&self) -> String {
        self.uris[0].clone()
    }
    fn declare<'a>(&'a self, queue: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let mut args = FieldTable::default();
            if self.cluster.is_some() {
                args.insert(
                    "x-queue-type".into(),
                    AMQPValue::LongString("quorum".into()),
                );
            }
            within(
                "declare",
                self.channel.queue_declare(
                    queue.into(),
                    QueueDeclareOptions {
                        durable: self.cluster.is_some(),
                        ..QueueDeclareOptions::default()
                    },
                    args,
                ),
            )
            .await
            .expect("declare");
        })
    }
    fn declare_rejecting<'a>(&'a self, queue: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let mut args = FieldTable::default();
            args.insert("x-max-length".into(), AMQPValue::LongLongInt(0));
            args.insert(
                "x-overflow".into(),
                AMQPValue::LongString("reject-publish".into()),
            );
            within(
                "declare",
                self.channel
                    .queue_declare(queue.into(), QueueDeclareOptions::default(), args),
            )
            .await
            .expect("declare");
        })
    }
    fn delete<'a>(&'a self, queue: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let _ = within(
                "delete",
                self.channel
                    .queue_delete(queue.into(), QueueDeleteOptions::default()),
            )
            .await;
        })
    }
    fn take<'a>(&'a self, queue: &'a str, n: usize) -> BoxFuture<'a, Vec<Got>> {
        Box::pin(async move {
            let mut got = Vec::new();
            let _ = tokio::time::timeout(DEADLINE, async {
                loop {
                    let m = self
                        .channel
                        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
                        .await
                        .expect("basic.get");
                    match m {
                        Some(m) => got.push(Got {
                            properties: m.delivery.properties.clone(),
                            body: m.delivery.data.clone(),
                        }),
                        None if got.len() >= n => return,
                        None => tokio::time::sleep(Duration::from_millis(20)).await,
                    }
                }
            })
            .await;
            got
        })
    }
    fn stall_uri(&self) -> String {
        self.stall_uri_of()
    }
    fn stall(&self, on: bool) -> BoxFuture<'_, ()> {
        let mode = if on {
            common::proxy::Mode::Stall
        } else {
            common::proxy::Mode::Forward
        };
        self.proxy.set(mode);
        Box::pin(async {})
    }
    fn hold_replies(&self, on: bool) -> BoxFuture<'_, ()> {
        let mode = if on {
            common::proxy::Mode::HoldReplies
        } else {
            common::proxy::Mode::Forward
        };
        self.proxy.set(mode);
        Box::pin(async {})
    }
    fn close_connection<'a>(&'a self, name: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            // The connection shows once the broker registered it.
            let pid = within("the connection listed", async {
                loop {
                    let out = self
                        .rabbitmqctl(&["list_connections", "pid", "client_properties"])
                        .await;
                    if let Some(pid) = out
                        .lines()
                        .find(|l| l.contains(name))
                        .and_then(|l| l.split_whitespace().next())
                    {
                        return pid.to_string();
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            })
            .await;
            self.rabbitmqctl(&["close_connection", &pid, "closed by the test"])
                .await;
        })
    }
}

impl Real {
    fn stall_uri_of(&self) -> String {
        self.proxy.rewrite(&self.uris[0])
    }
}

impl ClusterServer for Real {
    fn node_uri(&self, i: usize) -> String {
        self.uris[i % self.uris.len()].clone()
    }
    fn set_alarm(&self, on: bool) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if let Some(c) = &self.cluster {
                let mark = if on { "0.0000001" } else { "0.4" };
                c.ctl(0, &["set_vm_memory_high_watermark", mark]).await;
            }
        })
    }
    fn stop_node(&self, i: usize) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if let Some(c) = &self.cluster {
                c.stop(i).await;
            }
        })
    }
    fn start_node(&self, i: usize) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if let Some(c) = &self.cluster {
                c.start_node(i).await;
            }
        })
    }
}

// ---------------------------------------------------------------------------------------
// The tests: each case against the model (several seeds) and the real broker.

macro_rules! conformance {
    ($($case:ident),* $(,)?) => {$(
        mod $case {
            #[tokio::test(start_paused = true)]
            async fn model() {
                for seed in 0..20 {
                    super::$case(&super::Model::new(seed)).await;
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn rabbitmq() {
                super::$case(&super::Real::local().await).await;
            }
        }
    )*};
}

conformance!(
    bound_queue,
    unbound_mandatory,
    wave_with_unroutable,
    frame_max_reported,
    frame_limits,
    closed_by_server,
    nacked,
    stalled,
    replies_held,
    routing_headers,
);

mod alarm_and_node_loss {
    #[tokio::test(start_paused = true)]
    async fn model() {
        for seed in 0..20 {
            super::alarm_and_node_loss(&super::Model::new(seed)).await;
        }
    }

    /// On a private three-node cluster: the alarm would block every publisher of the shared
    /// broker.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cluster() {
        if std::process::Command::new("rabbitmq-server")
            .arg("--help")
            .output()
            .is_err()
        {
            eprintln!("skipped: rabbitmq-server is not installed (the cluster script needs it)");
            return;
        }
        let cluster = super::common::cluster::Cluster::start();
        let uris = cluster.uris();
        let real = super::Real::with(uris, Some(cluster)).await;
        super::alarm_and_node_loss(&real).await;
    }
}

/// timeoutd's estimate of a message's content header frame (`header_frame_size`, which it
/// compares with `frame_max` before sending) is the size the protocol encoder writes, for
/// properties as `message::build` sets them.
#[test]
fn header_estimate_matches_the_encoder() {
    let mut rng = rabbit::SimRng::new(7);
    for _ in 0..500 {
        let mut headers = FieldTable::default();
        for h in 0..rng.below(12) {
            let name = format!("H{h}{}", "n".repeat(rng.below(40) as usize));
            let value = "v".repeat(rng.below(3000) as usize);
            headers.insert(name.as_str().into(), AMQPValue::LongString(value.into()));
        }
        let mut p = BasicProperties::default().with_headers(headers);
        if rng.chance(0.8) {
            p = p.with_delivery_mode(2);
        }
        if rng.chance(0.9) {
            p = p.with_message_id("m".repeat(rng.below(256) as usize).into());
        }
        assert_eq!(
            timeoutd::record::message::header_frame_size(&p),
            rabbit::header_frame_len(&p),
            "{p:?}"
        );
    }
}

/// The model replays: the same seed gives the same answers, deliveries and times.
#[test]
fn model_replays_a_seed() {
    fn run(seed: u64) -> String {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("runtime");
        rt.block_on(async {
            let start = tokio::time::Instant::now();
            let model = RabbitModel::new(&MODEL_NODES, seed, Behaviour::default());
            model.declare_queue("q");
            let link = model.open(MODEL_NODES[1], "replay").await.expect("open");
            let mut confirms = Vec::new();
            for i in 0..100 {
                let key = if i % 4 == 0 { "nowhere" } else { "q" };
                let c = link
                    .publish(key, vec![1], props(&format!("m{i}")), true)
                    .await
                    .expect("written");
                confirms.push(c);
                if i == 50 {
                    model.set_memory_alarm(MODEL_NODES[2], true);
                    tokio::time::sleep(Duration::from_millis(3)).await;
                    model.set_memory_alarm(MODEL_NODES[2], false);
                }
            }
            let answers = futures::future::join_all(confirms).await;
            let deliveries: Vec<(Option<String>, Duration)> = model
                .deliveries()
                .iter()
                .map(|d| (d.message_id(), d.at - start))
                .collect();
            format!("{answers:?}\n{deliveries:?}\n{}", model.returns_elsewhere())
        })
    }
    assert_eq!(run(42), run(42));
    assert_ne!(run(42), run(43));
}
