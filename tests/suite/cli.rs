//! The `timeoutd` binary as an operator runs it: exit codes, messages, signals.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common;
use crate::common::fleet::BIN;
use crate::temp_config;

use std::process::{Output, Stdio};
use std::time::Duration;

use bson::doc;
use common::proxy::{Mode, Proxy, host_port};
use common::*;
use uuid::Uuid;

fn run(args: &[&str], env: &[(String, String)]) -> Output {
    let mut vars = env.to_vec();
    vars.push(("RUST_LOG".into(), "warn".into()));
    crate::common::fleet::run(args, &vars)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn bad_configs_exit_2_naming_the_key() {
    let cases = [
        ("[dispatch]\nbatch_size = 0\n", "dispatch.batch_size"),
        (
            "[dispatch]\npoll_interval = \"-1s\"\n",
            "dispatch.poll_interval",
        ),
        (
            "[dispatch]\nlock_lease = \"2s\"\nlease_safety_margin = \"2s\"\n",
            "dispatch.lock_lease",
        ),
        ("[dispatch]\nbatchsize = 10\n", "dispatch.batchsize"),
        (
            "[mongodb]\ntime_encoding = \"iso\"\n",
            "mongodb.time_encoding",
        ),
        ("[log]\nformat = \"yaml\"\n", "log.format"),
    ];
    for (text, key) in cases {
        let f = temp_config(text);
        for cmd in ["check-config", "run"] {
            let o = run(&[cmd, "--config", f.path().to_str().unwrap()], &[]);
            assert_eq!(
                o.status.code(),
                Some(2),
                "{cmd} with {text}: {}",
                stderr(&o)
            );
            let err = stderr(&o);
            assert!(err.contains(key), "{cmd}: `{err}` names {key}");
            assert_eq!(err.lines().count(), 1, "one line per problem: {err}");
        }
    }
}

#[test]
fn uris_come_from_secret_files_named_by_file_variables() {
    let dir = tempfile::tempdir().unwrap();
    let mongo = dir.path().join("mongodb-uri");
    let amqp = dir.path().join("amqp-uri");
    std::fs::write(&mongo, "mongodb://svc:m-secret@db.internal:27017/\n").unwrap();
    std::fs::write(&amqp, "amqps://svc:a-secret@mq.internal:5671/%2f\n").unwrap();
    let f = temp_config("");
    let config = f.path().to_str().unwrap();
    let o = run(
        &["check-config", "--config", config],
        &[
            (
                "TIMEOUTD_MONGODB__URI_FILE".into(),
                mongo.display().to_string(),
            ),
            (
                "TIMEOUTD_RABBITMQ__URI_FILE".into(),
                amqp.display().to_string(),
            ),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let shown = String::from_utf8_lossy(&o.stdout);
    assert!(shown.contains("svc:***@db.internal:27017"), "{shown}");
    assert!(shown.contains("svc:***@mq.internal:5671"), "{shown}");
    assert!(!shown.contains("secret"), "{shown}");

    let o = run(
        &["check-config", "--config", config],
        &[(
            "TIMEOUTD_MONGODB__URI_FILE".into(),
            dir.path().join("missing").display().to_string(),
        )],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("mongodb.uri_file"), "{}", stderr(&o));
}

#[test]
fn environment_overrides_are_validated_too() {
    let f = temp_config("");
    let o = run(
        &["check-config", "--config", f.path().to_str().unwrap()],
        &[
            ("TIMEOUTD_DISPATCH__BATCH_SIZE".into(), "0".into()),
            ("TIMEOUTD_DISPATCH__SHUTDOWN_TIMEOUT".into(), "0s".into()),
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(err.contains("dispatch.batch_size"), "{err}");
    assert!(err.contains("dispatch.shutdown_timeout"), "{err}");
    assert_eq!(err.lines().count(), 2, "{err}");
}

#[test]
fn a_missing_config_file_is_an_error() {
    let o = run(
        &["check-config", "--config", "/nonexistent/timeoutd.toml"],
        &[],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("/nonexistent/timeoutd.toml"));
}

#[test]
fn check_config_prints_the_effective_config_without_passwords() {
    let f = temp_config("[dispatch]\nbatch_size = 77\n");
    let o = run(
        &["check-config", "--config", f.path().to_str().unwrap()],
        &[
            (
                "TIMEOUTD_MONGODB__URI".into(),
                "mongodb://svc:s3cr3t-mongo@db1:27017,db2:27017/?replicaSet=rs".into(),
            ),
            (
                "TIMEOUTD_RABBITMQ__URI".into(),
                "amqp://svc:s3cr3t-amqp@mq:5672/%2f".into(),
            ),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    assert!(!out.contains("s3cr3t"), "{out}");
    assert!(out.contains("mongodb://svc:***@db1:27017,db2:27017/?replicaSet=rs"));
    assert!(out.contains("amqp://svc:***@mq:5672/%2f"));
    assert!(out.contains("batch_size = 77"));
    assert!(
        out.contains("interval = \"1m 15s\""),
        "reaper default shown: {out}"
    );
}

#[test]
fn run_refuses_an_unacknowledged_write_concern() {
    let f = temp_config("");
    let o = run(
        &["run", "--config", f.path().to_str().unwrap()],
        &[(
            "TIMEOUTD_MONGODB__URI".into(),
            with_query(&mongo_uri(), "w=0"),
        )],
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("mongodb.uri") && err.contains("w=0"), "{err}");
}

#[tokio::test]
async fn schedule_stats_and_reap_work_on_the_collection() {
    let env = TestEnv::new().await;
    let vars = env.env_vars(&env.config());
    let pm = Uuid::new_v4();
    let o = run(
        &[
            "schedule",
            "--destination",
            "billing",
            "--correlation-id",
            &pm.to_string(),
            "--in",
            "10m",
            "--header",
            "Tenant=acme",
            "--header",
            "Note=a=b",
        ],
        &vars,
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let id = Uuid::parse_str(String::from_utf8(o.stdout).unwrap().trim()).expect("prints the id");
    let d = env.find(id).await.expect("inserted");
    let keys: Vec<&str> = d.keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "_id",
            "Destination",
            "ProcessManagerId",
            "Time",
            "Headers",
            "Locked",
            "LockedBy",
            "LockExpiresAt"
        ]
    );
    assert_eq!(d.get("ProcessManagerId"), Some(&uuid(pm)));
    assert_eq!(
        d.get_document("Headers").unwrap(),
        &doc! { "Tenant": "acme", "Note": "a=b" }
    );
    // time_encoding = "auto" into an empty collection: a date, as the public releases write.
    let due_ms = d
        .get_datetime("Time")
        .expect("Time a date")
        .timestamp_millis();
    let expected = in_ms(600_000).timestamp_millis();
    assert!((due_ms - expected).abs() < 5_000, "due in ten minutes");

    // An expired lease for stats and reap to see.
    let mut e = v7_record(Uuid::new_v4(), "q", Uuid::new_v4(), in_ms(-3_000), doc! {});
    e.insert("Locked", true);
    e.insert("LockedBy", uuid(Uuid::new_v4()));
    e.insert("LockExpiresAt", in_ms(-1_000));
    env.insert(vec![e]).await;

    let o = run(&["stats", "--json"], &vars);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["pending"], 1);
    assert_eq!(v["due"], 1);
    assert_eq!(v["leased"], 0);
    assert_eq!(v["expired_leases"], 1);
    assert_eq!(v["stuck_locks"], 0);
    assert_eq!(v["unschedulable"], 0);
    assert!(v["oldest_due_age_seconds"].as_f64().unwrap() >= 3.0);
    let text = run(&["stats"], &vars);
    assert!(String::from_utf8_lossy(&text.stdout).contains("expired_leases  1"));

    let o = run(&["reap"], &vars);
    assert_eq!(o.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        "freed 1 expired leases"
    );
    let o = run(&["reap"], &vars);
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        "freed 0 expired leases"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn schedule_rejects_bad_input_with_exit_2() {
    let nil = Uuid::nil().to_string();
    // destination, correlation id, delay, extra arguments: one bad value in each.
    let cases: [(&str, &str, &str, &[&str]); 4] = [
        ("q", "nope", "1s", &[]),
        ("q", &nil, "soon", &[]),
        ("", &nil, "1s", &[]),
        ("q", &nil, "1s", &["--header", "novalue"]),
    ];
    for (destination, correlation_id, delay, extra) in cases {
        let mut args = vec![
            "schedule",
            "--destination",
            destination,
            "--correlation-id",
            correlation_id,
            "--in",
            delay,
        ];
        args.extend_from_slice(extra);
        let o = run(&args, &[]);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_releases_what_was_claimed_and_not_sent() {
    let env = TestEnv::new().await;
    let proxy = Proxy::start(&host_port(&amqp_uri())).await;
    let mut config = env.config();
    config.rabbitmq.uri = proxy.rewrite(&amqp_uri());
    config.rabbitmq.publish_timeout = std::time::Duration::from_secs(60);
    config.dispatch.shutdown_timeout = std::time::Duration::from_secs(1);
    let mut child = tokio::process::Command::new(BIN)
        .arg("run")
        .envs(env.env_vars(&config))
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr_pipe = child.stderr.take().unwrap();
    let log = tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        let mut s = String::new();
        let mut r = stderr_pipe;
        let _ = r.read_to_string(&mut s).await;
        s
    });

    // Wait for the daemon's broker connection, then freeze it: publishes go nowhere. The five
    // records are written before the freeze and fall due 5 s later, so that one claim takes
    // all of them. (Written after the freeze and due at once, a claim could catch part of the
    // insert; the rest were then never claimed while the stalled wave lasted, and the test
    // failed on a loaded machine.)
    let mut consumer = env.consumer().await;
    env.insert_due(1).await;
    assert_eq!(consumer.take(1, Duration::from_secs(20)).await.len(), 1);
    env.insert(
        (0..5)
            .map(|_| {
                v7_record(
                    Uuid::new_v4(),
                    &env.queue,
                    Uuid::new_v4(),
                    in_ms(5_000),
                    doc! {},
                )
            })
            .collect(),
    )
    .await;
    proxy.set(Mode::Stall);
    let claimed = eventually(Duration::from_secs(30), || async {
        env.count(doc! { "Locked": true }).await == 5
    })
    .await;
    assert!(claimed, "the daemon claimed the records");

    let pid = child.id().unwrap() as i32;
    // SAFETY: sending a signal to our own child process.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("exits within the shutdown timeout")
        .unwrap();
    let log = log.await.unwrap();
    assert_eq!(status.code(), Some(0), "{log}");
    assert_eq!(env.count(is_free()).await, 5, "all five released: {log}");
    assert!(
        consumer
            .take(1, Duration::from_millis(300))
            .await
            .is_empty()
    );
    proxy.set(Mode::Forward);
    env.cleanup().await;
}

/// A one-shot command against a MongoDB that stopped answering ends with an error naming the
/// call and the deadline, instead of waiting without end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_shot_commands_give_up_on_a_stalled_mongodb_at_the_deadline() {
    let env = TestEnv::new().await;
    let proxy = Proxy::start(&host_port(&mongo_uri())).await;
    let mut config = env.config();
    config.mongodb.uri = with_query(&proxy.rewrite(&mongo_uri()), "directConnection=true");
    config.mongodb.operation_timeout = Duration::from_secs(1);
    proxy.set(Mode::Stall);
    let vars = env.env_vars(&config);
    for args in [&["stats"][..], &["reap"], &["parked", "list"]] {
        let o = tokio::task::spawn_blocking({
            let vars = vars.clone();
            let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
            move || {
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                run(&args, &vars)
            }
        })
        .await
        .unwrap();
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("did not finish within 1s"),
            "{args:?}: {}",
            stderr(&o)
        );
    }
    proxy.set(Mode::Forward);
    env.cleanup().await;
}
