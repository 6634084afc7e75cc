//! A slow database: start-up does not wait for index builds and yields to SIGTERM at every
//! step, the exit after SIGTERM meets `shutdown_timeout` + 5 s, and the calls timeoutd may have
//! running on a server that answers nothing stay bounded. Real binary (with failpoints), real
//! RabbitMQ, real test MongoDB (behind a proxy where the test needs one).
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness
#![cfg(feature = "failpoints")]

use crate::common;

use std::time::Duration;

use bson::doc;
use common::fleet::{Daemon, vars};
use common::proxy::{Mode, Proxy, host_port};
use common::*;
use uuid::Uuid;

/// `shutdown_timeout` + `shutdown::GRACE` (the bound docs/guarantees.md promises) plus a margin for the process
/// to start exiting and the test to see it: still running after that is a failure.
fn exit_bound(shutdown_timeout: Duration) -> Duration {
    shutdown_timeout + timeoutd::service::shutdown::GRACE + Duration::from_secs(3)
}

fn with_failpoints(env: &TestEnv, c: &timeoutd::config::Config, fp: &str) -> Vec<(String, String)> {
    let mut v = vars(env, c);
    v.push(("FAILPOINTS".into(), fp.into()));
    v
}

/// Every `createIndexes` takes far longer than `operation_timeout` (a large collection):
/// records still fire, the process keeps running, `timeoutd_indexes_missing` shows the
/// indexes not there, and a SIGTERM while the build goes on exits in time. (Before, start-up
/// failed: exit 1, restart, the same again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_index_build_neither_fails_start_up_nor_holds_up_dispatch() {
    let env = TestEnv::new().await;
    let mut config = env.config();
    config.mongodb.operation_timeout = Duration::from_secs(2);
    let mut consumer = env.consumer().await;
    let mut d = Daemon::spawn(
        "timeoutd",
        with_failpoints(&env, &config, "create-index-delay=return(600000)"),
    )
    .await;
    assert!(
        d.ready_is(200, Duration::from_secs(30)).await,
        "{:#?}",
        d.logs()
    );
    let ids: Vec<Uuid> = (0..3).map(|_| Uuid::new_v4()).collect();
    env.insert(
        ids.iter()
            .map(|id| v7_record(*id, &env.queue, Uuid::new_v4(), in_ms(-10), doc! {}))
            .collect(),
    )
    .await;
    let got = consumer.take(3, Duration::from_secs(30)).await;
    assert_eq!(
        got.len(),
        3,
        "records fire while the indexes build: {:#?}",
        d.logs()
    );
    assert!(
        d.logged("index build goes on on the server", Duration::from_secs(30))
            .await,
        "the build is reported: {:#?}",
        d.logs_containing("index")
    );
    let missing = d.metric("timeoutd_indexes_missing").await;
    assert!(missing >= 1.0, "missing indexes shown: {missing}");
    assert_eq!(d.get("/healthz").await.0, 200, "still running and healthy");
    d.sigterm();
    let status = d.wait(exit_bound(config.dispatch.shutdown_timeout)).await;
    assert_eq!(status.code(), Some(0), "{:#?}", d.logs());
    env.cleanup().await;
}

/// A SIGTERM while a start-up call waits for its deadline (60 s here) ends start-up at once:
/// the exit meets `shutdown_timeout` + 5 s. (Before, each bounded call of start-up ran to
/// its deadline first.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_start_up_exits_within_the_bound() {
    let env = TestEnv::new().await;
    let mut config = env.config();
    config.mongodb.operation_timeout = Duration::from_secs(60);
    config.dispatch.shutdown_timeout = Duration::from_secs(1);
    let mut d = Daemon::spawn(
        "timeoutd",
        with_failpoints(&env, &config, "start-up-call-delay=return(60000)"),
    )
    .await;
    assert!(
        d.logged("MongoDB reachable", Duration::from_secs(30)).await,
        "{:#?}",
        d.logs()
    );
    d.sigterm();
    let status = d.wait(exit_bound(config.dispatch.shutdown_timeout)).await;
    assert_eq!(status.code(), Some(0), "{:#?}", d.logs());
    env.cleanup().await;
}

/// Every step after `shutdown_timeout` (the dispatch loop's end, the HTTP endpoints' end,
/// the MongoDB client's close) stalls: together they still meet `shutdown_timeout` + 5 s.
/// (Before, each had 5 s of its own, one after the other: `shutdown_timeout` + 15 s.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exit_after_sigterm_meets_shutdown_timeout_plus_five_seconds() {
    let env = TestEnv::new().await;
    let mut config = env.config();
    config.dispatch.shutdown_timeout = Duration::from_secs(1);
    let mut d = Daemon::spawn(
        "timeoutd",
        with_failpoints(&env, &config, "shutdown-stall=return(60000)"),
    )
    .await;
    assert!(
        d.ready_is(200, Duration::from_secs(30)).await,
        "{:#?}",
        d.logs()
    );
    d.sigterm();
    let status = d.wait(exit_bound(config.dispatch.shutdown_timeout)).await;
    assert_eq!(status.code(), Some(0), "{:#?}", d.logs());
    env.cleanup().await;
}

/// The most calls one idle instance may have running on the server at once: one per task
/// that calls MongoDB while nothing is due (the claims, the shape learner, the reaper, the
/// monitor, the control watcher, the insert watcher; the index task has finished), each
/// paced so that it never starts while its previous run may still run. (It was 5, with the
/// claims counted as waiting for the learner; but they run beside its periodic learn, and
/// one suite run on a loaded machine saw all six at once, each task with one call.)
const CALLS_BOUND: f64 = 6.0;

/// The server answers nothing (every reply held back), so every call times out: the calls
/// timeoutd may have running on it (`timeoutd_mongodb_calls_in_flight`, which counts an
/// abandoned call until its `maxTimeMS` has passed) stay bounded, one per task, for the
/// whole fault, and SIGTERM still exits cleanly. (Before, a timed-out claim was retried
/// 100 ms later and the control watcher's read every poll, each while the last one still ran.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_in_flight_stay_bounded_while_every_call_times_out() {
    let env = TestEnv::new().await;
    let proxy = Proxy::start(&host_port(&mongo_uri())).await;
    let mut config = env.config();
    config.mongodb.uri = with_query(&proxy.rewrite(&mongo_uri()), "directConnection=true");
    config.mongodb.operation_timeout = Duration::from_secs(1);
    config.dispatch.poll_interval = Duration::from_millis(100);
    config.reaper.interval = Some(Duration::from_millis(500));
    let d = Daemon::spawn("timeoutd", vars(&env, &config)).await;
    assert!(
        d.ready_is(200, Duration::from_secs(30)).await,
        "{:#?}",
        d.logs()
    );
    proxy.set(Mode::HoldReplies);
    // Read at every step until six claims in a row have timed out (the fault has lasted
    // several operation_timeouts and their paced retries).
    let most = std::cell::Cell::new(0.0f64);
    let observed = eventually(Duration::from_secs(120), || async {
        let now = d.metric("timeoutd_mongodb_calls_in_flight").await;
        most.set(most.get().max(now));
        d.logs_containing("claim failed").len() >= 6
    })
    .await;
    let most = most.get();
    // The figure for the fault table in docs/guarantees.md.
    eprintln!("SLOWDB most calls in flight while every call timed out: {most}");
    assert!(
        observed,
        "claims kept timing out: {:#?}",
        d.logs_containing("WARN")
    );
    assert!(most >= 1.0, "calls were made and counted: {most}");
    assert!(
        most <= CALLS_BOUND,
        "at most {CALLS_BOUND} calls may be running on the server, saw {most}: {:#?}",
        d.logs_containing("WARN")
    );
    // That a record fires once the server answers again is not asserted here: it depends on
    // the shape cache surviving a dropped refresh (issue 19 item 1, fixed apart).
    proxy.set(Mode::Forward);
    d.stop().await;
    env.cleanup().await;
}

/// A server started for one phase, stopped when the phase ends (or fails).
struct StopOnDrop(i32);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        // SAFETY: signalling the server this test started.
        unsafe { libc::kill(self.0, libc::SIGTERM) };
    }
}

/// One phase of [`a_million_records_without_the_due_index`]: a server of its own holding
/// `records` future records, one daemon on it for `secs` with `operation_timeout` and its
/// indexes never built. Returns the server's peak memory (MiB), the reaper's and the
/// stuck-lock pass's failures, and the most calls the daemon had in flight.
async fn without_the_due_index(
    env: &TestEnv,
    records: usize,
    operation_timeout: Duration,
    secs: u64,
) -> (u64, usize, usize, f64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = std::process::Command::new("scripts/start-test-mongodb.sh")
        .arg(dir.path())
        .output()
        .expect("start a server");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let uri = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let pid: i32 = std::fs::read_to_string(dir.path().join("pid"))
        .expect("pid")
        .trim()
        .parse()
        .expect("pid");
    // Stopped however the phase ends: a failed assertion must not leave a server holding a
    // million records running.
    let _server = StopOnDrop(pid);
    let peak_mib = || {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|s| {
                let l = s.lines().find(|l| l.starts_with("VmHWM:"))?.to_string();
                l.split_whitespace().nth(1)?.parse::<u64>().ok()
            })
            .unwrap_or(0)
            / 1024
    };
    let client = mongodb::Client::with_uri_str(&uri).await.expect("client");
    let coll = client
        .database(&env.db_name)
        .collection::<bson::Document>("Timeouts");
    let far = in_ms(86_400_000);
    for start in (0..records).step_by(10_000) {
        let docs: Vec<_> = (start..records.min(start + 10_000))
            .map(|_| v7_record(Uuid::new_v4(), &env.queue, Uuid::new_v4(), far, doc! {}))
            .collect();
        coll.insert_many(docs).await.expect("insert");
    }
    let loaded_mib = peak_mib();
    let mut config = env.config();
    config.mongodb.uri = uri;
    config.mongodb.operation_timeout = operation_timeout;
    config.dispatch.poll_interval = Duration::from_secs(1);
    let d = Daemon::spawn(
        "timeoutd",
        with_failpoints(env, &config, "create-index-delay=return(600000)"),
    )
    .await;
    let mut most = 0.0f64;
    let until = std::time::Instant::now() + Duration::from_secs(secs);
    while std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (code, text) = d.get("/metrics").await;
        if code == 200 {
            most = most.max(common::fleet::series(
                &text,
                "timeoutd_mongodb_calls_in_flight",
            ));
        }
    }
    // SAFETY: signal 0 only asks whether our own child's server still runs.
    let alive = unsafe { libc::kill(pid, 0) } == 0;
    assert!(alive, "the server survived: {}", dir.path().display());
    let peak = peak_mib();
    let reaper = d.logs_containing("reaper pass failed").len();
    let stuck = d.logs_containing("freeing stuck locks failed").len();
    eprintln!(
        "SLOWDB without the due index, {records} records, operation_timeout {operation_timeout:?}, {secs} s: server memory {loaded_mib} MiB loaded, {peak} MiB peak; reaper failures {reaper}, stuck-lock failures {stuck}; most calls in flight {most}"
    );
    d.stop().await;
    (peak, reaper, stuck, most)
}

/// Issue 25, item 9, seen from outside: 1M records and no due index, so every claim and
/// every background read scans. With `operation_timeout = 2s` every abandoned call used to
/// keep running on the server, and writes carried no `maxTimeMS`: the server's memory peaked
/// at 6 GiB in 120 s (1.2 GiB when nothing is abandoned) and the reaper's writes timed out 24
/// times. Now every call is bounded on the server too. The same in one run with a deadline
/// long enough that nothing is abandoned, for the ratio. `TIMEOUTD_SLOWDB_RECORDS` (1000000)
/// and `TIMEOUTD_SLOWDB_SECONDS` (120) size it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "several minutes with a million records; run it on purpose"]
async fn a_million_records_without_the_due_index() {
    let records: usize = std::env::var("TIMEOUTD_SLOWDB_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let secs: u64 = std::env::var("TIMEOUTD_SLOWDB_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(120);
    let env = TestEnv::new().await;
    let (short, reaper, stuck, most) =
        without_the_due_index(&env, records, Duration::from_secs(2), secs).await;
    let (long, ..) = without_the_due_index(&env, records, Duration::from_secs(600), secs).await;
    eprintln!(
        "SLOWDB server memory peak with operation_timeout 2s / 600s: {short} / {long} MiB = {:.2}",
        short as f64 / long.max(1) as f64
    );
    // A scan that runs out of `maxTimeMS` fails the pass (and is retried after a back-off):
    // that is the bound working, so the failures are printed, not asserted.
    eprintln!(
        "SLOWDB reaper and stuck-lock failures with operation_timeout 2s: {reaper} + {stuck}"
    );
    assert!(most <= CALLS_BOUND, "calls in flight stay bounded: {most}");
    env.cleanup().await;
}
