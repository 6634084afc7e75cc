//! AMQP over TLS against a real RabbitMQ TLS listener that requires client certificates: a
//! second broker node started by `scripts/start-tls-rabbitmq.sh` with a self-signed CA, or the
//! one named by `TIMEOUTD_TEST_TLS_DIR` (ca.pem, client.pem, client.key) and
//! `TIMEOUTD_TEST_AMQPS_URI`.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common;

use std::path::PathBuf;
use std::time::Duration;

use bson::doc;
use common::*;
use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, QueueDeclareOptions};
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::{Connection, ConnectionProperties};
use timeoutd::config::RabbitConfig;
use timeoutd::rabbit::publisher::Publisher;
use uuid::Uuid;

/// Starts the TLS node, or finds it started (the script holds a lock while it starts one).
fn tls_dir() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(start_tls_node).clone()
}

fn start_tls_node() -> PathBuf {
    if let Ok(dir) = std::env::var("TIMEOUTD_TEST_TLS_DIR") {
        return dir.into();
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/start-tls-rabbitmq.sh");
    let out = std::process::Command::new("bash")
        .arg(script)
        .output()
        .expect("run scripts/start-tls-rabbitmq.sh");
    assert!(
        out.status.success(),
        "scripts/start-tls-rabbitmq.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().into()
}

fn amqps_uri() -> String {
    std::env::var("TIMEOUTD_TEST_AMQPS_URI")
        .unwrap_or_else(|_| "amqps://guest:guest@localhost:5671/%2f".into())
}

fn tls_config(dir: &std::path::Path, ca: bool, client_cert: bool) -> RabbitConfig {
    let mut c = RabbitConfig {
        uri: amqps_uri(),
        ..RabbitConfig::default()
    };
    if ca {
        c.tls_ca_file = Some(dir.join("ca.pem"));
    }
    if client_cert {
        c.tls_cert_file = Some(dir.join("client.pem"));
        c.tls_key_file = Some(dir.join("client.key"));
    }
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_needs_the_ca_and_the_client_certificate() {
    let dir = tls_dir();
    for (ca, cert, should_connect) in [
        (false, false, false),
        (false, true, false),
        (true, false, false),
        (true, true, true),
    ] {
        let mut p = Publisher::new(&tls_config(&dir, ca, cert)).unwrap();
        let r = tokio::time::timeout(Duration::from_secs(20), p.connect())
            .await
            .expect("connect answers");
        assert_eq!(
            r.is_ok(),
            should_connect,
            "ca={ca} client_cert={cert}: {r:?}"
        );
        p.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_fire_over_tls() {
    let dir = tls_dir();
    let env = TestEnv::new().await;
    let rabbit = tls_config(&dir, true, true);
    // A consumer on the TLS node, with the same client certificate.
    let tls = OwnedTLSConfig {
        identity: Some(OwnedIdentity::PKCS8 {
            pem: std::fs::read(dir.join("client.pem")).unwrap(),
            key: std::fs::read(dir.join("client.key")).unwrap(),
        }),
        cert_chain: Some(std::fs::read_to_string(dir.join("ca.pem")).unwrap()),
    };
    let conn = Connection::connect_with_config(
        &amqps_uri(),
        ConnectionProperties::default(),
        tls,
        lapin::runtime::default_runtime().unwrap(),
    )
    .await
    .expect("consumer connects over TLS");
    let channel = conn.create_channel().await.unwrap();
    let queue = format!("timeoutd-test-tls-{}", Uuid::new_v4().simple());
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions {
                auto_delete: true,
                ..QueueDeclareOptions::default()
            },
            Default::default(),
        )
        .await
        .unwrap();
    let id = Uuid::new_v4();
    env.insert(vec![v7_record(
        id,
        &queue,
        Uuid::new_v4(),
        in_ms(-10),
        doc! {},
    )])
    .await;
    let mut consumer = channel
        .basic_consume(
            queue.as_str().into(),
            "tls-test".into(),
            BasicConsumeOptions::default(),
            Default::default(),
        )
        .await
        .unwrap();
    let mut config = env.config();
    config.rabbitmq = RabbitConfig {
        publish_timeout: config.rabbitmq.publish_timeout,
        ..rabbit
    };
    let daemon = start(config);
    let delivery = tokio::time::timeout(Duration::from_secs(20), consumer.next())
        .await
        .expect("a message over TLS")
        .unwrap()
        .unwrap();
    delivery.ack(BasicAckOptions::default()).await.unwrap();
    daemon.stop().await;
    let message_id = delivery.properties.message_id().clone().unwrap();
    assert_eq!(message_id.as_str(), id.to_string());
    assert!(env.find(id).await.is_none(), "removed after the confirm");
    let _ = conn.close(200, "done".into()).await;
    env.cleanup().await;
}
