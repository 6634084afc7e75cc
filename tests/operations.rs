//! Operating the daemon: `/metrics` counters equal what really happened, health endpoints,
//! draining on SIGTERM. Each test runs the binary, so its metrics are its own.

mod common;

use std::process::Stdio;
use std::time::Duration;

use bson::doc;
use common::proxy::{Mode, Proxy, host_port};
use common::*;
use tokio::io::{AsyncBufReadExt, BufReader};
use uuid::Uuid;

const BIN: &str = env!("CARGO_BIN_EXE_timeoutd");

struct Daemon {
    child: tokio::process::Child,
    base: String,
}

async fn spawn(vars: Vec<(String, String)>) -> Daemon {
    let mut child = tokio::process::Command::new(BIN)
        .arg("run")
        .envs(vars)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let mut tx = Some(tx);
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(i) = line.find("addr=") {
                let addr: String = line[i + 5..]
                    .chars()
                    .take_while(|c| !c.is_whitespace())
                    .collect();
                if let Some(tx) = tx.take() {
                    let _ = tx.send(addr);
                }
            }
        }
    });
    let addr = tokio::time::timeout(Duration::from_secs(20), rx)
        .await
        .expect("daemon logs its HTTP address")
        .unwrap();
    Daemon {
        child,
        base: format!("http://{addr}"),
    }
}

async fn get(url: String) -> (u16, String) {
    tokio::task::spawn_blocking(move || {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .new_agent();
        let mut r = agent.get(&url).call().expect("HTTP answer");
        (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
    })
    .await
    .unwrap()
}

/// The value of one series (`name` with its label text, exactly as rendered).
fn series(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_what_really_happened() {
    let env = TestEnv::new().await;
    let n = 25;
    let missing = format!("timeoutd-test-missing-{}", Uuid::new_v4().simple());
    let mut docs: Vec<_> = (0..n)
        .map(|_| {
            v7_record(
                Uuid::new_v4(),
                &env.queue,
                Uuid::new_v4(),
                in_ms(-100),
                doc! {},
            )
        })
        .collect();
    docs.push(v7_record(
        Uuid::new_v4(),
        &missing,
        Uuid::new_v4(),
        in_ms(-100),
        doc! {},
    ));
    env.insert(docs).await;
    let mut consumer = env.consumer().await;
    let d = spawn(env.env_vars(&env.config())).await;
    let got = consumer.take(n, Duration::from_secs(30)).await;
    assert_eq!(got.len(), n);
    assert!(
        eventually(Duration::from_secs(10), || async {
            env.count(doc! {}).await == 1
        })
        .await
    );
    // Let the confirms and removals of the last batch be counted.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let (code, text) = get(format!("{}/metrics", d.base)).await;
    assert_eq!(code, 200);
    assert_eq!(
        series(&text, "timeoutd_dispatched_total"),
        n as f64,
        "{text}"
    );
    assert_eq!(series(&text, "timeoutd_removed_total"), n as f64);
    let returned = series(
        &text,
        "timeoutd_publish_failures_total{reason=\"returned\"}",
    );
    assert!(returned >= 1.0, "{text}");
    assert_eq!(
        series(&text, "timeoutd_released_total{reason=\"publish_failed\"}"),
        returned
    );
    assert_eq!(
        series(&text, "timeoutd_claimed_total"),
        n as f64 + returned,
        "every claim either sent or released the unroutable one"
    );
    assert_eq!(series(&text, "timeoutd_lease_lost_total"), 0.0);
    assert_eq!(
        series(&text, "timeoutd_dependency_up{dependency=\"mongodb\"}"),
        1.0
    );
    assert_eq!(
        series(&text, "timeoutd_dependency_up{dependency=\"rabbitmq\"}"),
        1.0
    );
    assert!(
        text.contains("timeoutd_dispatch_lateness_seconds_bucket{le=\"0.001\"}"),
        "{text}"
    );
    assert!(text.contains("timeoutd_build_info{version=\""));

    assert_eq!(get(format!("{}/healthz", d.base)).await.0, 200);
    let (code, body) = get(format!("{}/readyz", d.base)).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(get(format!("{}/nope", d.base)).await.0, 404);
    let url = format!("{}/healthz", d.base);
    let post = tokio::task::spawn_blocking(move || {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .new_agent();
        agent.post(&url).send("").unwrap().status().as_u16()
    })
    .await
    .unwrap();
    assert_eq!(post, 405);

    let probe = std::process::Command::new(BIN)
        .args(["health", "--url", &format!("{}/healthz", d.base)])
        .output()
        .unwrap();
    assert_eq!(probe.status.code(), Some(0));
    drop(d);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_rabbitmq_and_turns_503_on_sigterm() {
    let env = TestEnv::new().await;
    let proxy = Proxy::start(&host_port(&amqp_uri())).await;
    let mut config = env.config();
    config.rabbitmq.uri = proxy.rewrite(&amqp_uri());
    config.dispatch.shutdown_timeout = Duration::from_secs(4);
    config.rabbitmq.publish_timeout = Duration::from_secs(60);
    let mut d = spawn(env.env_vars(&config)).await;
    let ready = |want: u16| {
        let url = format!("{}/readyz", d.base);
        async move {
            eventually(Duration::from_secs(15), || {
                let url = url.clone();
                async move { get(url).await.0 == want }
            })
            .await
        }
    };
    assert!(ready(200).await, "ready with both services");
    proxy.set(Mode::Cut);
    assert!(ready(503).await, "not ready while RabbitMQ is unreachable");
    let (_, body) = get(format!("{}/readyz", d.base)).await;
    assert!(body.contains("rabbitmq unreachable"), "{body}");
    proxy.set(Mode::Forward);
    assert!(ready(200).await, "ready again once RabbitMQ is back");

    // Hold a publish in flight so shutdown has to wait, then SIGTERM.
    proxy.set(Mode::Stall);
    env.insert(vec![v7_record(
        Uuid::new_v4(),
        &env.queue,
        Uuid::new_v4(),
        in_ms(-10),
        doc! {},
    )])
    .await;
    assert!(
        eventually(Duration::from_secs(10), || async {
            env.count(doc! { "Locked": true }).await == 1
        })
        .await
    );
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(d.child.id().unwrap() as i32, libc::SIGTERM) };
    let url = format!("{}/readyz", d.base);
    let draining = eventually(Duration::from_secs(3), || {
        let url = url.clone();
        async move { get(url).await.1.contains("draining") }
    })
    .await;
    assert!(draining, "/readyz says draining before the process exits");
    let status = tokio::time::timeout(Duration::from_secs(20), d.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));
    assert_eq!(env.count(is_free()).await, 1, "released on the way out");
    proxy.set(Mode::Forward);
    env.cleanup().await;
}
