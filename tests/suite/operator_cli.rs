//! Running the CLI against a real fleet: on a systemd host with the unit's environment file
//! (the file format, read the way the recipe in docs/deployment.md reads it, reaches the fleet's MongoDB
//! and not the defaults), and in Kubernetes (the one-shot Job example reads the fleet's own
//! ConfigMap and Secret; the ConfigMap holds every key of config/timeoutd.toml, and no other).
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common;
use crate::common::fleet::BIN;
use crate::repo;

use std::collections::BTreeSet;
use std::process::Command;

use bson::doc;
use common::*;
use serde_json::Value;
use uuid::Uuid;

const ENV_FILE: &str = "/etc/timeoutd/timeoutd.env";

fn yaml(path: &str) -> Value {
    let text = std::fs::read_to_string(repo(path)).unwrap();
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Every key of a TOML document, dotted (`mongodb.operation_timeout`).
fn keys(text: &str) -> BTreeSet<String> {
    fn walk(prefix: &str, table: &toml::Table, out: &mut BTreeSet<String>) {
        for (k, v) in table {
            let key = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            match v {
                toml::Value::Table(t) => walk(&key, t, out),
                _ => {
                    out.insert(key);
                }
            }
        }
    }
    let table: toml::Table = toml::from_str(text).unwrap();
    let mut out = BTreeSet::new();
    walk("", &table, &mut out);
    out
}

#[test]
fn the_configmap_holds_the_keys_of_the_config_file_and_no_other() {
    let file = std::fs::read_to_string(repo("config/timeoutd.toml")).unwrap();
    let cm = yaml("config/kubernetes/configmap.yaml");
    let cm_toml = cm["data"]["timeoutd.toml"].as_str().expect("timeoutd.toml");
    let (in_file, in_cm) = (keys(&file), keys(cm_toml));
    let missing: Vec<&String> = in_file.difference(&in_cm).collect();
    let extra: Vec<&String> = in_cm.difference(&in_file).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "the ConfigMap lacks {missing:?} and has {extra:?} beyond config/timeoutd.toml"
    );
    // The keys it used to lack, named so the check cannot pass vacuously.
    for key in ["mongodb.operation_timeout", "rabbitmq.connect_timeout"] {
        assert!(in_cm.contains(key), "{key}");
    }
    // And the commented-out keys (the TLS files) too: the ConfigMap is the file, indented.
    let commented = |t: &str| -> BTreeSet<String> {
        t.lines()
            .map(str::trim)
            .filter_map(|l| l.strip_prefix("# "))
            .filter_map(|l| l.split_once(" = ").map(|(k, _)| k.to_string()))
            .filter(|k| k.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
            .collect()
    };
    assert_eq!(commented(&file), commented(cm_toml));
}

#[test]
fn the_cli_job_example_reads_the_fleets_config_and_secret() {
    let deployment = yaml("config/kubernetes/deployment.yaml");
    let job = yaml("config/kubernetes/cli-job.example.yaml");
    assert_eq!(job["kind"], "Job");
    let (pod, job_pod) = (
        &deployment["spec"]["template"]["spec"],
        &job["spec"]["template"]["spec"],
    );
    let (c, jc) = (&pod["containers"][0], &job_pod["containers"][0]);
    assert_eq!(jc["image"], c["image"]);
    assert_eq!(jc["volumeMounts"], c["volumeMounts"]);
    assert_eq!(job_pod["volumes"], pod["volumes"]);
    // Every variable the Deployment takes from the Secret, the Job takes the same way.
    let from_secret = |c: &Value| -> Vec<Value> {
        c["env"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| !e["valueFrom"].is_null())
            .cloned()
            .collect()
    };
    assert_eq!(from_secret(jc), from_secret(c));
    // It runs one command with the fleet's file, once.
    assert_eq!(jc["command"][0], "timeoutd");
    let args: Vec<&str> = jc["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(
        args[..2],
        ["--config", timeoutd::config::SYSTEM_CONFIG_PATH]
    );
    assert_eq!(job["spec"]["backoffLimit"], 0, "never run twice by itself");
    assert_eq!(job_pod["restartPolicy"], "Never");
}

#[test]
fn the_deployment_recipes_name_the_units_environment_file() {
    let unit = std::fs::read_to_string(repo("systemd/timeoutd.service")).unwrap();
    assert!(unit.contains(&format!("EnvironmentFile={ENV_FILE}")));
    let readme = std::fs::read_to_string(repo("docs/deployment.md")).unwrap();
    for recipe in [
        format!("--property EnvironmentFile={ENV_FILE}"),
        format!("set -a; . {ENV_FILE}; set +a;"),
        "kubectl exec deploy/timeoutd -- timeoutd".to_string(),
        "config/kubernetes/cli-job.example.yaml".to_string(),
    ] {
        assert!(
            readme.contains(&recipe),
            "docs/deployment.md has no {recipe:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_with_the_units_environment_file_reaches_the_fleet() {
    let env = TestEnv::new().await;
    let id = Uuid::new_v4();
    env.insert(vec![v7_record(
        id,
        &env.queue,
        Uuid::new_v4(),
        in_ms(3_600_000),
        doc! {},
    )])
    .await;
    // The example file with the fleet's values, in its own format: quoted, so that a URI
    // with `&` reads the same to systemd and to sh.
    let example = std::fs::read_to_string(repo("systemd/timeoutd.env.example")).unwrap();
    let mongodb = with_query(
        &with_query(&mongo_uri(), "appName=timeoutd-cli"),
        "connectTimeoutMS=5000",
    );
    assert!(mongodb.contains('&'));
    let mut lines: Vec<String> = example
        .lines()
        .map(|l| match l.split_once('=') {
            Some(("TIMEOUTD_MONGODB__URI", v)) => {
                assert!(v.starts_with('\''), "the example quotes its values: {l}");
                format!("TIMEOUTD_MONGODB__URI='{mongodb}'")
            }
            Some(("TIMEOUTD_RABBITMQ__URI", _)) => {
                format!("TIMEOUTD_RABBITMQ__URI='{}'", amqp_uri())
            }
            _ => l.to_string(),
        })
        .collect();
    lines.push(format!("TIMEOUTD_MONGODB__DATABASE='{}'", env.db_name));
    let dir = tempfile::tempdir().unwrap();
    let env_file = dir.path().join("timeoutd.env");
    std::fs::write(&env_file, lines.join("\n") + "\n").unwrap();
    let config = dir.path().join("timeoutd.toml");
    std::fs::copy(repo("config/timeoutd.toml"), &config).unwrap();

    // The recipe (docs/deployment.md) for a host without systemd-run: the file sourced with `set -a`.
    let recipe = |args: &str| {
        Command::new("sh")
            .arg("-c")
            .arg(format!(
                "set -a; . \"$ENV_FILE\"; set +a; exec \"$BIN\" {args}"
            ))
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("ENV_FILE", &env_file)
            .env("BIN", BIN)
            .env("TIMEOUTD_CONFIG", &config)
            .output()
            .unwrap()
    };
    let out = recipe("list --json");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.is_empty(), "{stderr}");
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        listed
            .as_array()
            .is_some_and(|rows| rows.iter().any(|r| r["id"] == id.to_string())),
        "the fleet's record is not listed: {listed}"
    );
    let out = recipe("check-config");
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        shown.starts_with(&format!("# read {}", config.display())),
        "{shown}"
    );
    assert!(shown.contains("appName=timeoutd-cli"), "{shown}");
    env.cleanup().await;
}
