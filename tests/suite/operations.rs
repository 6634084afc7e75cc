//! Operating the daemon: `/metrics` counters equal what really happened, health endpoints,
//! draining on SIGTERM. Each test runs the binary, so its metrics are its own.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common;

use std::time::Duration;

use bson::doc;
use common::fleet::{BIN, Daemon, http_get, series};
use common::proxy::{Mode, Proxy, host_port};
use common::*;
use uuid::Uuid;

async fn spawn(vars: Vec<(String, String)>) -> Daemon {
    Daemon::spawn("timeoutd", vars).await
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
    let mut poison = v7_record(
        Uuid::new_v4(),
        &env.queue,
        Uuid::new_v4(),
        in_ms(-100),
        doc! {},
    );
    poison.insert("Headers", 42);
    docs.push(poison);
    env.insert(docs).await;
    let mut consumer = env.consumer().await;
    let mut vars = env.env_vars(&env.config());
    // The unroutable record is refused twice, retried once in between, then parked.
    for (k, v) in [("BASE", "100ms"), ("CAP", "100ms"), ("MAX_ATTEMPTS", "2")] {
        vars.push((format!("TIMEOUTD_RETRY__{k}"), v.into()));
    }
    let d = spawn(vars).await;
    let got = consumer.take(n, Duration::from_secs(30)).await;
    assert_eq!(got.len(), n);
    assert!(
        eventually(Duration::from_secs(10), || async {
            env.count(doc! {}).await == 0
        })
        .await,
        "sent, or parked"
    );
    // Let the confirms and removals of the last batch be counted.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let (code, text) = http_get(format!("{}/metrics", d.base)).await;
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
    assert_eq!(returned, 2.0, "{text}");
    assert_eq!(series(&text, "timeoutd_retries_total"), 1.0);
    assert_eq!(
        series(&text, "timeoutd_parked_total{reason=\"unroutable\"}"),
        1.0
    );
    assert_eq!(
        series(&text, "timeoutd_parked_total{reason=\"undecodable\"}"),
        1.0
    );
    assert_eq!(
        series(&text, "timeoutd_released_total{reason=\"publish_failed\"}"),
        0.0,
        "a refused send keeps its lease until the retry"
    );
    assert_eq!(
        series(&text, "timeoutd_claimed_total"),
        n as f64 + returned + 1.0,
        "every claim was sent, refused or parked"
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

    assert_eq!(http_get(format!("{}/healthz", d.base)).await.0, 200);
    let (code, body) = http_get(format!("{}/readyz", d.base)).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(http_get(format!("{}/nope", d.base)).await.0, 404);
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
                async move { http_get(url).await.0 == want }
            })
            .await
        }
    };
    assert!(ready(200).await, "ready with both services");
    proxy.set(Mode::Cut);
    assert!(ready(503).await, "not ready while RabbitMQ is unreachable");
    let (_, body) = http_get(format!("{}/readyz", d.base)).await;
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
    d.sigterm();
    let url = format!("{}/readyz", d.base);
    let draining = eventually(Duration::from_secs(3), || {
        let url = url.clone();
        async move { http_get(url).await.1.contains("draining") }
    })
    .await;
    assert!(draining, "/readyz says draining before the process exits");
    let status = d.wait(Duration::from_secs(20)).await;
    assert_eq!(status.code(), Some(0));
    assert_eq!(env.count(is_free()).await, 1, "released on the way out");
    proxy.set(Mode::Forward);
    env.cleanup().await;
}

/// Collects what the daemon sends to a `NOTIFY_SOCKET`, as systemd would.
struct NotifySocket {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
    socket: tokio::net::UnixDatagram,
}

impl NotifySocket {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let socket = tokio::net::UnixDatagram::bind(&path).unwrap();
        Self {
            _dir: dir,
            path,
            socket,
        }
    }

    /// Waits up to `within` for a datagram containing `line`.
    async fn expect(&self, line: &str, within: Duration) -> bool {
        let mut buf = vec![0u8; 4096];
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, self.socket.recv(&mut buf)).await {
                Ok(Ok(n))
                    if String::from_utf8_lossy(&buf[..n])
                        .lines()
                        .any(|l| l == line) =>
                {
                    return true;
                }
                Ok(_) => {}
                Err(_) => return false,
            }
        }
    }

    /// How many datagrams containing `line` arrive within `within`.
    #[cfg(feature = "failpoints")]
    async fn count(&self, line: &str, within: Duration) -> usize {
        let mut buf = vec![0u8; 4096];
        let deadline = tokio::time::Instant::now() + within;
        let mut n = 0;
        while let Ok(Ok(len)) = tokio::time::timeout_at(deadline, self.socket.recv(&mut buf)).await
        {
            if String::from_utf8_lossy(&buf[..len])
                .lines()
                .any(|l| l == line)
            {
                n += 1;
            }
        }
        n
    }

    /// Discards whatever has arrived so far.
    fn drain(&self) {
        let mut buf = vec![0u8; 4096];
        while self.socket.try_recv(&mut buf).is_ok() {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn systemd_notify_and_health_follow_a_stalled_database() {
    let env = TestEnv::new().await;
    let proxy = Proxy::start(&host_port(&mongo_uri())).await;
    let mut config = env.config();
    config.mongodb.uri = with_query(&proxy.rewrite(&mongo_uri()), "directConnection=true");
    config.mongodb.operation_timeout = Duration::from_secs(1);
    let notify = NotifySocket::new();
    let mut vars = env.env_vars(&config);
    vars.push(("NOTIFY_SOCKET".into(), notify.path.to_str().unwrap().into()));
    // A one-second watchdog: petted every half second while the loop is live.
    vars.push(("WATCHDOG_USEC".into(), "1000000".into()));
    let mut d = spawn(vars).await;
    let status_is = |path: &'static str, want: u16| {
        let url = format!("{}{path}", d.base);
        async move {
            eventually(Duration::from_secs(15), || {
                let url = url.clone();
                async move { http_get(url).await.0 == want }
            })
            .await
        }
    };

    assert!(
        notify.expect("READY=1", Duration::from_secs(20)).await,
        "READY=1 once both services answer"
    );
    assert!(notify.expect("WATCHDOG=1", Duration::from_secs(3)).await);
    assert!(status_is("/healthz", 200).await);

    // Stall MongoDB: every call runs into its deadline. The instance is not ready, but its
    // loop still turns (a restart would not bring the database back): live, watchdog petted.
    proxy.set(Mode::Stall);
    assert!(
        status_is("/readyz", 503).await,
        "/readyz is 503 while MongoDB does not answer: {:#?}",
        d.logs()
    );
    let (_, body) = http_get(format!("{}/readyz", d.base)).await;
    assert!(body.contains("mongodb unreachable"), "{body}");
    assert_eq!(http_get(format!("{}/healthz", d.base)).await.0, 200);
    notify.drain();
    assert!(
        notify.expect("WATCHDOG=1", Duration::from_secs(3)).await,
        "the watchdog is petted while the loop turns"
    );

    proxy.set(Mode::Forward);
    assert!(
        status_is("/readyz", 200).await,
        "/readyz recovers with MongoDB"
    );

    d.sigterm();
    assert!(
        notify.expect("STOPPING=1", Duration::from_secs(5)).await,
        "STOPPING=1 at shutdown"
    );
    let status = d.wait(Duration::from_secs(20)).await;
    assert_eq!(status.code(), Some(0));
    env.cleanup().await;
}

/// Found in review: `READY=1` skipped because a watchdog notification was still stuck on a
/// full notify socket was marked sent, and never sent again. systemd would have stopped the
/// unit at `TimeoutStartSec`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_skipped_behind_a_stuck_notification_is_sent_again() {
    let env = TestEnv::new().await;
    // MongoDB does not answer at first: the instance is live but not ready, and petting the
    // watchdog is what gets stuck.
    let proxy = Proxy::start(&host_port(&mongo_uri())).await;
    proxy.set(Mode::Stall);
    let mut config = env.config();
    config.mongodb.uri = with_query(&proxy.rewrite(&mongo_uri()), "directConnection=true");
    config.mongodb.operation_timeout = Duration::from_secs(1);
    let notify = NotifySocket::new();
    // Fill the socket's queue, as a systemd that does not read would leave it: the first
    // notification blocks, and later ones are skipped while it is stuck.
    let filler = tokio::net::UnixDatagram::unbound().unwrap();
    while filler.try_send_to(b"FILLER=1", &notify.path).is_ok() {}
    let mut vars = env.env_vars(&config);
    vars.push(("NOTIFY_SOCKET".into(), notify.path.to_str().unwrap().into()));
    vars.push(("WATCHDOG_USEC".into(), "1000000".into()));
    let mut d = spawn(vars).await;
    let skipped = || d.logs_containing("skipping one").len();
    assert!(
        eventually(Duration::from_secs(20), || async { skipped() > 0 }).await,
        "a watchdog notification is stuck before the instance is ready: {:#?}",
        d.logs()
    );
    proxy.set(Mode::Forward);
    assert!(
        eventually(Duration::from_secs(20), || async {
            d.get("/readyz").await.0 == 200
        })
        .await,
        "{:#?}",
        d.logs()
    );
    // Two more skips after readiness: the first check after it (READY=1) has come and gone.
    let before = skipped();
    assert!(
        eventually(Duration::from_secs(10), || async {
            skipped() >= before + 2
        })
        .await,
        "{:#?}",
        d.logs()
    );
    // Reading the socket frees it, as systemd would.
    assert!(
        notify.expect("READY=1", Duration::from_secs(5)).await,
        "READY=1 is sent once the socket takes notifications again: {:#?}",
        d.logs()
    );
    d.sigterm();
    assert_eq!(d.wait(Duration::from_secs(20)).await.code(), Some(0));
    proxy.set(Mode::Forward);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_name_each_record_with_its_destination_and_owner() {
    let env = TestEnv::new().await;
    let missing = format!("timeoutd-test-missing-{}", Uuid::new_v4().simple());
    let sent = Uuid::new_v4();
    let unroutable = Uuid::new_v4();
    env.insert(vec![
        v7_record(sent, &env.queue, Uuid::new_v4(), in_ms(-10), doc! {}),
        v7_record(unroutable, &missing, Uuid::new_v4(), in_ms(-10), doc! {}),
    ])
    .await;
    let mut consumer = env.consumer().await;
    let mut vars = env.env_vars(&env.config());
    vars.push(("TIMEOUTD_LOG__FORMAT".into(), "json".into()));
    vars.push(("RUST_LOG".into(), "timeoutd=debug".into()));
    let mut d = spawn(vars).await;
    assert_eq!(consumer.take(1, Duration::from_secs(20)).await.len(), 1);
    for id in [sent, unroutable] {
        assert!(d.logged(&id.to_string(), Duration::from_secs(10)).await);
    }
    d.sigterm();
    d.wait(Duration::from_secs(20)).await;

    let mut about_records = 0;
    for line in d.logs() {
        let v: serde_json::Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("not one JSON object a line ({e}): {line}"));
        for key in ["timestamp", "level", "message"] {
            assert!(v.get(key).is_some(), "{key} missing: {line}");
        }
        if let Some(id) = v.get("timeout_id") {
            about_records += 1;
            assert!(id.is_string(), "{line}");
            assert!(v.get("destination").is_some(), "no destination: {line}");
            let owner = v.get("owner").and_then(|o| o.as_str()).unwrap_or("");
            assert!(Uuid::parse_str(owner).is_ok(), "no owner: {line}");
        }
    }
    assert!(
        about_records >= 2,
        "a sent line and a failed-send line name their records"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_never_appear_in_logs_errors_or_endpoints() {
    let env = TestEnv::new().await;
    let secret = "s3cret-pw-7c1f";
    let (scheme, rest) = mongo_uri()
        .split_once("://")
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .unwrap();
    let bad_mongodb = format!("{scheme}://timeoutd:{secret}@{rest}");
    let bad_amqp = format!("amqp://guest:{secret}@{}/%2f", host_port(&amqp_uri()));
    // Each service in turn refuses a wrong password; the daemon logs the failure.
    for (mongodb, amqp, failure) in [
        (mongo_uri(), bad_amqp.clone(), "RabbitMQ unreachable"),
        (bad_mongodb.clone(), amqp_uri(), "MongoDB unreachable"),
    ] {
        let mut config = env.config();
        config.mongodb.uri = mongodb;
        config.rabbitmq.uri = amqp;
        let mut vars = env.env_vars(&config);
        vars.push(("RUST_LOG".into(), "debug".into()));
        let mut d = spawn(vars).await;
        assert!(
            d.logged(failure, Duration::from_secs(10)).await,
            "{failure} is logged"
        );
        let mut seen = Vec::new();
        for path in ["/metrics", "/readyz", "/healthz"] {
            seen.push(http_get(format!("{}{path}", d.base)).await.1);
        }
        d.sigterm();
        d.wait(Duration::from_secs(20)).await;
        seen.extend(d.logs());
        let check = std::process::Command::new(BIN)
            .args(["check-config"])
            .envs(env.env_vars(&config))
            .output()
            .unwrap();
        seen.push(String::from_utf8_lossy(&check.stdout).into_owned());
        seen.push(String::from_utf8_lossy(&check.stderr).into_owned());
        let all = seen.join("\n");
        assert!(!all.contains("s3cret"), "password leaked: {all}");
    }
    env.cleanup().await;
}

/// Starts the test binary with `FAILPOINTS` set (see `fail::FailScenario`).
#[cfg(feature = "failpoints")]
async fn spawn_failing(
    env: &TestEnv,
    config: &timeoutd::config::Config,
    failpoints: &str,
) -> Daemon {
    let mut vars = env.env_vars(config);
    vars.push(("FAILPOINTS".into(), failpoints.into()));
    spawn(vars).await
}

/// A panic in `task`, set off by `failpoint` seconds after start (while five records are held),
/// makes `/healthz` and `/readyz` 503, releases the records and exits 1.
#[cfg(feature = "failpoints")]
async fn a_panic_stops_the_daemon_unhealthy_with_its_records_released(task: &str, failpoint: &str) {
    let env = TestEnv::new().await;
    // Records due in a minute, claimed ahead (look-ahead) and held when the reaper panics.
    let ids: Vec<Uuid> = (0..5).map(|_| Uuid::new_v4()).collect();
    env.insert(
        ids.iter()
            .map(|id| v7_record(*id, &env.queue, Uuid::new_v4(), in_ms(60_000), doc! {}))
            .collect(),
    )
    .await;
    let mut consumer = env.consumer().await;
    let mut config = env.config();
    config.dispatch.look_ahead = Some(Duration::from_secs(120));
    config.dispatch.lock_lease = Duration::from_secs(300);
    config.reaper.interval = Some(Duration::from_millis(500));
    // The daemon lingers 3 s after the failure, so that /healthz is seen.
    let failpoints = format!("{failpoint};daemon-linger-after-failure=return(3000)");
    let mut d = spawn_failing(&env, &config, &failpoints).await;
    assert!(
        eventually(Duration::from_secs(20), || async {
            env.count(doc! { "Locked": true }).await == 5
        })
        .await,
        "the daemon holds the five records: {:#?}",
        d.logs()
    );
    assert!(
        eventually(Duration::from_secs(20), || async {
            d.get("/healthz").await.0 == 503
        })
        .await,
        "/healthz turns 503 when the {task} panics: {:#?}",
        d.logs()
    );
    assert_eq!(d.get("/readyz").await.0, 503);
    // `timeoutd_up` turns 0 when the supervisor has counted the failure: counted once, not
    // also by the dispatch loop that contained its panic.
    assert!(
        eventually(Duration::from_secs(20), || async {
            d.metrics().await.lines().any(|l| l == "timeoutd_up 0")
        })
        .await,
        "the supervisor saw the {task} fail: {:#?}",
        d.logs()
    );
    let metrics = d.metrics().await;
    let failures = format!("timeoutd_task_failures_total{{task=\"{task}\"}}");
    assert_eq!(series(&metrics, &failures), 1.0, "{metrics}");
    let status = d.wait(Duration::from_secs(20)).await;
    assert_eq!(status.code(), Some(1), "exits non-zero: {:#?}", d.logs());
    assert_eq!(
        env.count(is_free()).await,
        5,
        "the held records were released"
    );
    assert!(
        consumer
            .take(1, Duration::from_millis(300))
            .await
            .is_empty()
    );
    env.cleanup().await;
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reaper_that_panics_stops_the_daemon_unhealthy_with_its_records_released() {
    // The reaper runs every 500 ms: its 21st pass panics.
    a_panic_stops_the_daemon_unhealthy_with_its_records_released(
        "reaper",
        "reaper-panic=20*off->return",
    )
    .await;
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatch_handler_that_panics_stops_the_daemon_unhealthy_with_its_records_released() {
    // The loop turns some 20 times a second with 100 ms polls: a handler panics seconds in.
    a_panic_stops_the_daemon_unhealthy_with_its_records_released(
        "dispatch",
        "dispatch-handler-panic=200*off->return",
    )
    .await;
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wedged_dispatch_loop_turns_healthz_503_and_stops_the_watchdog() {
    let env = TestEnv::new().await;
    let notify = NotifySocket::new();
    let mut vars = env.env_vars(&env.config());
    vars.push(("NOTIFY_SOCKET".into(), notify.path.to_str().unwrap().into()));
    vars.push(("WATCHDOG_USEC".into(), "1000000".into()));
    // After 30 events, the loop waits 12 s on an await, as an unbounded call would.
    vars.push((
        "FAILPOINTS".into(),
        "dispatch-loop-stall=30*off->return(12000)".into(),
    ));
    let d = spawn(vars).await;
    assert!(notify.expect("READY=1", Duration::from_secs(20)).await);
    assert!(
        eventually(Duration::from_secs(30), || async {
            d.get("/healthz").await.0 == 503
        })
        .await,
        "/healthz turns 503 while the loop does not turn"
    );
    notify.drain();
    // Petted every 500 ms while live: three or so in 1.5 s. A wedged loop's: none, or the
    // one the notifier decided on just before liveness ran out, which its sending thread may
    // deliver after /healthz already said 503 (seen once in CI, under load).
    let pets = notify
        .count("WATCHDOG=1", Duration::from_millis(1500))
        .await;
    assert!(
        pets <= 1,
        "the watchdog is not petted while the loop is wedged: {pets} pets in 1.5 s"
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            d.get("/healthz").await.0 == 200
        })
        .await,
        "/healthz recovers once the loop turns again"
    );
    drop(d);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_concern_a_failover_could_undo_is_warned_about_at_start() {
    let env = TestEnv::new().await;
    // The test server is a single-node replica set: w=1 could lose a lease write in a failover.
    let mut config = env.config();
    config.mongodb.uri = with_query(&mongo_uri(), "w=1");
    let d = spawn(env.env_vars(&config)).await;
    assert!(
        d.logged("MongoDB settings weaken the lease", Duration::from_secs(20))
            .await,
        "{:#?}",
        d.logs()
    );
    assert!(!d.logs_containing("not majority").is_empty());
    drop(d);
    // The default (the server's, majority on MongoDB 5.0+) draws no warning.
    let d = spawn(env.env_vars(&env.config())).await;
    assert!(d.ready_is(200, Duration::from_secs(20)).await);
    assert!(d.logs_containing("weaken the lease").is_empty());
    drop(d);
    env.cleanup().await;
}

/// A delete the server applied but whose answer was lost (a deadline, a cut connection) is
/// retried; the retry finds the records gone and counts them removed, not as lost leases:
/// nobody else can delete a record under this instance's live lease.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_whose_answer_was_lost_counts_its_records_removed() {
    let env = TestEnv::new().await;
    let ids = env.insert_due(20).await;
    let mut consumer = env.consumer().await;
    let d = spawn_failing(&env, &env.config(), "remove-answer-lost=1*return").await;
    assert_eq!(consumer.take(20, Duration::from_secs(30)).await.len(), 20);
    assert!(
        eventually(Duration::from_secs(30), || async {
            env.count(doc! {}).await == 0
        })
        .await,
        "the records are deleted"
    );
    assert!(
        d.logged("removing sent records failed", Duration::from_secs(10))
            .await,
        "the first attempt's answer was lost"
    );
    // The retry follows a back-off: wait for its count.
    let removed = eventually(Duration::from_secs(30), || async {
        d.metric("timeoutd_removed_total").await == ids.len() as f64
    })
    .await;
    let metrics = d.metrics().await;
    assert!(removed, "every record counted removed: {metrics}");
    assert_eq!(
        series(&metrics, "timeoutd_lease_lost_total"),
        0.0,
        "{metrics}"
    );
    drop(d);
    env.cleanup().await;
}
