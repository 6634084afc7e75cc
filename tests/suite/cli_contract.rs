//! One CLI: every command that prints takes `--json` and prints one JSON value; an error is
//! printed once, on stderr; bad input (an unknown id included) exits 2; the commands that move
//! or delete records take `--dry-run` and `--reason` and write the audit; `health` reports on
//! stderr; completions and the man page come from the same definition. What the CLI takes
//! from its environment is in tests/suite/cli_environment.rs.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common;
use crate::common::fleet::run;

use std::collections::BTreeSet;
use std::process::Output;
use std::time::Duration;

use bson::{Document, doc};
use clap::CommandFactory;
use common::*;
use uuid::Uuid;

/// Commands whose output is no report: the daemon logs, completions and the man page are
/// scripts and roff.
const NOT_REPORTS: [&str; 3] = ["run", "completions", "man"];
/// Commands that move or delete records.
const CHANGES_RECORDS: [&str; 4] = ["cancel", "reschedule", "parked requeue", "parked drop"];

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Every leaf command, as words (`parked drop`), with its long flags.
fn leaves() -> Vec<(String, BTreeSet<String>)> {
    fn walk(cmd: &clap::Command, path: &str, out: &mut Vec<(String, BTreeSet<String>)>) {
        if cmd.get_subcommands().next().is_none() {
            let flags = cmd
                .get_arguments()
                .filter_map(|a| a.get_long().map(str::to_string))
                .collect();
            out.push((path.to_string(), flags));
        }
        for sub in cmd.get_subcommands() {
            let name = sub.get_name();
            let path = if path.is_empty() {
                name.to_string()
            } else {
                format!("{path} {name}")
            };
            walk(sub, &path, out);
        }
    }
    let mut out = Vec::new();
    walk(&timeoutd::cli::Cli::command(), "", &mut out);
    out
}

#[test]
fn every_command_has_the_flags_of_its_kind() {
    let leaves = leaves();
    assert!(leaves.len() >= 15, "{leaves:?}");
    for (name, flags) in &leaves {
        if !NOT_REPORTS.contains(&name.as_str()) {
            assert!(flags.contains("json"), "{name} takes no --json");
        }
        if CHANGES_RECORDS.contains(&name.as_str()) {
            for flag in ["dry-run", "reason"] {
                assert!(flags.contains(flag), "{name} takes no --{flag}");
            }
        }
    }
}

/// Runs `args` and returns its stdout parsed as one JSON value, after checking the exit code
/// and that stderr holds nothing but `stderr_has` (or is empty), besides the audit log line
/// of an operator action.
fn json_of(
    args: &[&str],
    vars: &[(String, String)],
    code: i32,
    stderr_has: Option<&str>,
) -> serde_json::Value {
    json_in(&run(args, vars), args, code, stderr_has)
}

/// [`json_of`] for a run already made.
fn json_in(out: &Output, args: &[&str], code: i32, stderr_has: Option<&str>) -> serde_json::Value {
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    let stderr: String = stderr
        .lines()
        .filter(|l| !l.contains("operator action"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(
        out.status.code(),
        Some(code),
        "{args:?}: {stdout}\n{stderr}"
    );
    match stderr_has {
        None => assert!(stderr.is_empty(), "{args:?}: stderr {stderr}"),
        Some(s) => assert!(
            stderr.lines().count() == 1 && stderr.contains(s),
            "{args:?}: stderr {stderr}"
        ),
    }
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{args:?}: {e}: {stdout:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_printing_command_prints_json_and_bad_input_exits_2_saying_so_once() {
    let env = TestEnv::new().await;
    let vars = env.env_vars(&env.config());
    let q = env.queue.clone();
    let saga = Uuid::new_v4().to_string();
    let scheduled = json_of(
        &[
            "schedule",
            "--destination",
            &q,
            "--correlation-id",
            &saga,
            "--in",
            "1h",
            "--json",
        ],
        &vars,
        0,
        None,
    );
    let id = scheduled["id"].as_str().expect("id").to_string();
    let unknown = Uuid::new_v4().to_string();
    let dead = "http://127.0.0.1:9/healthz";
    let mut covered = BTreeSet::new();
    let cases: Vec<(&str, Vec<&str>, i32, Option<&str>)> = vec![
        ("check-config", vec!["check-config", "--json"], 0, None),
        ("stats", vec!["stats", "--json"], 0, None),
        ("reap", vec!["reap", "--json"], 0, None),
        ("list", vec!["list", "--json"], 0, None),
        (
            "cancel",
            vec!["cancel", &id, "--dry-run", "--json"],
            0,
            None,
        ),
        (
            "reschedule",
            vec!["reschedule", &id, "--in", "2h", "--dry-run", "--json"],
            0,
            None,
        ),
        ("pause", vec!["pause", &q, "--json"], 0, None),
        ("paused", vec!["paused", "--json"], 0, None),
        // With history off in this configuration it says so (once, on stderr) and shows
        // what is stored.
        (
            "history",
            vec!["history", "--json"],
            0,
            Some("history] keep is 0s"),
        ),
        ("resume", vec!["resume", &q, "--json"], 0, None),
        ("parked list", vec!["parked", "list", "--json"], 0, None),
        (
            "parked requeue",
            vec!["parked", "requeue", "--all", "--json"],
            0,
            None,
        ),
        // Bad input: exit 2, the error once on stderr, and stdout still one JSON value or
        // nothing.
        (
            "parked drop",
            vec!["parked", "drop", &unknown, "--json"],
            2,
            Some("no parked record has id"),
        ),
        (
            "health",
            vec!["health", "--url", dead, "--json"],
            1,
            Some("unhealthy"),
        ),
    ];
    for (name, args, code, stderr) in &cases {
        covered.insert(name.to_string());
        let out = run(args, &vars);
        if out.stdout.is_empty() {
            assert_eq!(out.status.code(), Some(*code), "{args:?}: {out:?}");
            assert_eq!(*code, 2, "{args:?} printed nothing");
            let err = text(&out.stderr);
            assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
            assert!(err.contains(stderr.unwrap_or_default()), "{err}");
            continue;
        }
        let value = json_in(&out, args, *code, *stderr);
        assert!(!value.is_null(), "{args:?}");
    }
    covered.insert("schedule".into());
    // Every command that prints is walked (a new one must be added here).
    let printing: BTreeSet<String> = leaves()
        .into_iter()
        .map(|(n, _)| n)
        .filter(|n| !NOT_REPORTS.contains(&n.as_str()))
        .collect();
    assert_eq!(covered, printing);

    // The dry runs changed nothing.
    let record = env
        .find(id.parse().unwrap())
        .await
        .expect("still scheduled");
    assert!(record.get("Time").is_some());

    // Unknown ids exit 2 in every command that takes one, each saying so once.
    for args in [
        vec!["parked", "requeue", unknown.as_str()],
        vec!["parked", "drop", unknown.as_str()],
        vec!["cancel", unknown.as_str()],
        vec!["reschedule", unknown.as_str(), "--in", "1m"],
        vec!["resume", "timeoutd-test-never-paused"],
    ] {
        let out = run(&args, &vars);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: once: {err}");
        assert!(err.starts_with("timeoutd: error: "), "{err}");
    }
    env.cleanup().await;
}

#[test]
fn a_runtime_error_is_printed_once() {
    // Nothing listens on port 9: the command fails at its first MongoDB call.
    let vars = vec![
        (
            "TIMEOUTD_MONGODB__URI".to_string(),
            "mongodb://127.0.0.1:9/?serverSelectionTimeoutMS=300".to_string(),
        ),
        (
            "TIMEOUTD_MONGODB__OPERATION_TIMEOUT".to_string(),
            "2s".to_string(),
        ),
    ];
    let out = run(&["stats"], &vars);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(out.stdout.is_empty());
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "printed more than once: {err}");
    assert!(lines[0].starts_with("timeoutd: error: "), "{err}");
}

fn control(env: &TestEnv) -> mongodb::Collection<Document> {
    env.coll
        .client()
        .database(&env.db_name)
        .collection("Timeouts_control")
}

fn parked(env: &TestEnv) -> mongodb::Collection<Document> {
    env.coll
        .client()
        .database(&env.db_name)
        .collection("Timeouts_parked")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_requeue_and_drop_dry_run_and_record_why() {
    let env = TestEnv::new().await;
    let missing = format!("timeoutd-test-missing-{}", Uuid::new_v4().simple());
    let ids: Vec<Uuid> = (0..2).map(|_| Uuid::new_v4()).collect();
    env.insert(
        ids.iter()
            .map(|id| v7_record(*id, &missing, Uuid::new_v4(), in_ms(-500), doc! {}))
            .collect(),
    )
    .await;
    let mut config = env.config();
    config.retry.max_attempts = 1;
    let daemon = start(config.clone());
    let all_parked = eventually(Duration::from_secs(15), || async {
        parked(&env).count_documents(doc! {}).await.unwrap() == 2
    })
    .await;
    daemon.stop().await;
    assert!(all_parked, "the unroutable records were not parked");
    let vars = env.env_vars(&config);
    let (a, b) = (ids[0].to_string(), ids[1].to_string());

    // Dry runs: say what would happen, change nothing, record nothing.
    let dry = json_of(
        &["parked", "drop", &a, "--dry-run", "--json"],
        &vars,
        0,
        None,
    );
    assert_eq!(dry[0]["outcome"], "would_drop", "{dry}");
    let dry = json_of(
        &["parked", "requeue", "--all", "--dry-run", "--json"],
        &vars,
        0,
        None,
    );
    assert_eq!(dry.as_array().map(Vec::len), Some(2), "{dry}");
    assert_eq!(parked(&env).count_documents(doc! {}).await.unwrap(), 2);
    assert!(env.find(ids[0]).await.is_none());
    assert_eq!(
        control(&env)
            .count_documents(doc! { "kind": "audit" })
            .await
            .unwrap(),
        0
    );

    // For real, with a reason: done, and audited with who and why.
    let out = run(
        &["parked", "drop", &a, "--reason", "poison, see INC-7"],
        &vars,
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let out = run(
        &["parked", "requeue", &b, "--reason", "queue is back"],
        &vars,
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert_eq!(parked(&env).count_documents(doc! {}).await.unwrap(), 0);
    assert!(env.find(ids[1]).await.is_some(), "requeued");
    for (action, reason, id) in [
        ("parked drop", "poison, see INC-7", &a),
        ("parked requeue", "queue is back", &b),
    ] {
        let entry = control(&env)
            .find_one(doc! { "kind": "audit", "action": action })
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{action} not audited"));
        assert_eq!(entry.get_str("reason"), Ok(reason), "{entry}");
        assert!(
            entry.get_str("user").is_ok_and(|u| !u.is_empty()),
            "{entry}"
        );
        let done = entry
            .get_document("details")
            .and_then(|d| d.get_array("done"))
            .expect("details.done");
        assert_eq!(done, &vec![bson::Bson::String(id.clone())], "{entry}");
    }
    env.cleanup().await;
}

#[test]
fn completions_and_man_pages_cover_every_command() {
    let out = run(&["completions", "bash"], &[]);
    assert_eq!(out.status.code(), Some(0));
    let script = text(&out.stdout);
    for (name, _) in leaves() {
        let last = name.rsplit(' ').next().unwrap_or_default().to_string();
        assert!(script.contains(&last), "bash completion lacks {last}");
    }
    let out = run(&["completions", "fish"], &[]);
    assert!(text(&out.stdout).contains("complete -c timeoutd"));

    let out = run(&["man"], &[]);
    let page = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0));
    assert!(
        page.starts_with(".ie") || page.contains(".TH timeoutd"),
        "{page}"
    );
    assert!(page.contains("check\\-config"), "{page}");
    let dir = tempfile::tempdir().unwrap();
    let out = run(&["man", "--dir", dir.path().to_str().unwrap()], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let pages: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(pages.contains(&"timeoutd.1".to_string()), "{pages:?}");
    assert!(pages.len() > 15, "one page per command: {pages:?}");
}

/// Runs `timeoutd args` with its standard output a pipe whose reader has gone (`| head -1`
/// once `head` has its line).
fn run_into_a_closed_pipe(args: &[&str], vars: &[(String, String)]) -> Output {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    crate::common::fleet::command(args, vars)
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .expect("run timeoutd")
}

/// Found in review: a reader that went away made `println!` panic (exit 101), and `cancel`
/// had then deleted the record and not yet written its audit. The output ends; the command
/// does not.
#[tokio::test]
async fn a_reader_that_went_away_ends_the_output_not_the_command() {
    let o = run_into_a_closed_pipe(&["completions", "bash"], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert!(!text(&o.stderr).contains("panicked"), "{}", text(&o.stderr));

    let env = TestEnv::new().await;
    let id = Uuid::new_v4();
    env.insert(vec![v7_record(
        id,
        &env.queue,
        Uuid::new_v4(),
        in_ms(600_000),
        doc! {},
    )])
    .await;
    let vars = env.env_vars(&env.config());
    let o = run_into_a_closed_pipe(&["cancel", &id.to_string(), "--reason", "r"], &vars);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert!(!text(&o.stderr).contains("panicked"), "{}", text(&o.stderr));
    assert!(env.find(id).await.is_none(), "cancelled");
    let audited = control(&env)
        .find_one(doc! { "kind": "audit", "action": "cancel" })
        .await
        .unwrap();
    assert!(audited.is_some(), "the cancel was audited");
    env.cleanup().await;
}
